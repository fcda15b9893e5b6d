"""Elementwise work on the CPU: constants, copies and the elementwise kernels the compiler writes (`ew`), run in
cache-sized chunks, and their sums (`ew_sum`); `erf`, the one function those kernels call that numpy has no ufunc
for."""
from __future__ import annotations

import math

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch, samples_per_chunk
from deepdsl_runtime.cpu.shape import sum_to


def const(*, out, value, shape=()):
    out.fill(value)


def copy(src, *, out):
    np.copyto(out, src)


EW_CHUNK = 1 << 14        # elements per call of a large elementwise kernel: its temporaries stay in the L1/L2 cache


def ew(kernel, out, *args, native=None):
    """Run an elementwise kernel of the generated program (a numpy function writing `out`). A large one whose
    arrays all have the output's shape and layout (an optimizer update, say) runs in runs of EW_CHUNK elements:
    the temporaries numpy makes for a product inside a sum are then small and cached, instead of each a pass over
    memory (fc1's momentum update in LeNet: 400,000 floats, about a third faster). Elementwise results do not
    depend on how the elements are grouped, and an output that is one of the inputs is read before it is written
    in every run. With `native`, the program's compiled kernel of the same name runs where it has one for these
    operands (whole tensors and scalars)."""
    if native is not None and native.ew(kernel, out, args):
        return None
    n = out.size
    if n < 2 * EW_CHUNK or not out.flags.c_contiguous:
        return kernel(out, *args)
    flat = []                         # (array, whether it is cut into runs)
    for a in args:
        if not isinstance(a, np.ndarray):
            flat.append((a, False))
        elif a.size == 1:
            flat.append((a.reshape(-1), False))      # a (1, 1) operand would widen a run to two dimensions
        elif a.shape == out.shape and a.flags.c_contiguous:
            flat.append((a.reshape(-1), True))
        else:
            return kernel(out, *args)
    o = out.reshape(-1)
    for s in range(0, n, EW_CHUNK):
        e = s + EW_CHUNK
        kernel(o[s:e], *(a[s:e] if cut else a for a, cut in flat))


def ew_sum(kernel, out, *args, shape, workspace=None, native=None):
    """out = the sum to `shape` of elementwise kernel `kernel` over `args` (`sum_to` of `ew`, never the whole
    tensor of values): the values of a chunk of samples go into the workspace (`contract.ew_sum_scratch`; as many
    samples as it holds, at most a cache's worth), are summed to `shape` and added to `out` chunk by chunk. Operands
    with the batch's leading axis are cut into the chunk's samples, the others are broadcast as they are. With
    `native`, a per-channel sum the program's library computes directly runs there (no values stored, the
    workspace unused)."""
    if native is not None and native.ew_sum(kernel, out, args, shape):
        return
    full = np.broadcast_shapes(*(np.shape(a) for a in args))
    per_sample, fixed, chunked = contract.ew_sum_scratch(full, shape)
    n = full[0] if chunked else 1
    step = samples_per_chunk(n, workspace, per_sample, fixed_if_split=fixed)
    scratch = Scratch(workspace)
    part = scratch.take(shape) if step < n else None
    values = scratch.take((step,) + full[1:] if chunked else full)
    for s in range(0, n, step):
        e = min(n, s + step)
        chunk = values[:e - s] if chunked else values
        cut = [a[s:e] if chunked and isinstance(a, np.ndarray) and a.ndim == len(full) and a.shape[0] == n else a
               for a in args]
        ew(kernel, chunk, *cut, native=native)
        sum_to(chunk, out=out if s == 0 else part, shape=shape)
        if s:
            np.add(out, part, out=out)


_ERF_SPLIT = 2.5         # |x| below: the Taylor series; above: the continued fraction of erfc
_ERF_TERMS = 60


def erf(x, out=None):
    """The error function, elementwise, in x's float precision (numpy has no ufunc for it): computed in float64 to
    within 1e-14 relative of the exact value (erf(v / sqrt(2)) is the exact GELU's), so float32 results are
    correctly rounded but for ties. |x| < 2.5: the Taylor series 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1));
    above: 1 - exp(-x^2) / (sqrt(pi) K(x)), K the continued fraction x + (1/2)/(x + 1/(x + (3/2)/(x + ...))) of
    erfc. Writes into `out` when given (an array of x's shape), and returns the result."""
    x = np.asarray(x)
    a = np.abs(x.astype(np.float64))
    small = np.minimum(a, _ERF_SPLIT)
    z = small * small
    term, total = small.copy(), small.copy()
    for n in range(1, _ERF_TERMS):
        term *= -z / n
        total += term / (2 * n + 1)
    big = np.maximum(a, _ERF_SPLIT)
    fraction = big.copy()
    for k in range(_ERF_TERMS, 0, -1):
        fraction = big + (k / 2) / fraction
    with np.errstate(all="ignore"):          # exp(-x^2) underflows to 0 for large |x|: erf is then +-1
        tail = 1 - np.exp(-big * big) / (math.sqrt(math.pi) * fraction)
    result = np.copysign(np.where(a < _ERF_SPLIT, total * (2 / math.sqrt(math.pi)), tail), x)
    dtype = x.dtype if x.dtype.kind == "f" else np.float64
    if out is None:
        return result.astype(dtype) if result.ndim else dtype.type(result)
    np.copyto(out, result, casting="same_kind")
    return out
