"""Elementwise work on the CPU: constants, copies and the elementwise kernels the compiler writes (`ew`), run in
cache-sized chunks, two of them in one pass (`ew_pair`), and their sums (`ew_sum`, after another kernel
`ew_and_sum`); `erf`, the one function those kernels call that numpy has no ufunc
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


def ew_pair(first, second, native=None):
    """Two elementwise kernels, each given as `ew` takes it, `(kernel, out, *args)`, the second reading the first's
    output (two statements computed together, `deepdsl.passes.fuse_multi_output`): with `native`, one pass of the
    program's compiled pair where it has one for these operands, else `ew` of the one and then of the other. The
    values are the same either way."""
    if native is not None and native.ew_pair(first, second):
        return
    ew(*first, native=native)
    ew(*second, native=native)


def ew_many(kernel, *calls, native=None):
    """One elementwise kernel on several sets of operands, each `(out, *args)` as `ew` takes them (a batch of
    statements, `deepdsl.passes.fuse_horizontal`: the small tensors' updates): with `native`, one call of the
    program's compiled kernel over them all where it has one for their operands, else `ew` on each. The values are
    the same either way."""
    if native is not None and native.ew_many(kernel, calls):
        return
    for out, *args in calls:
        ew(kernel, out, *args, native=native)


def ew_and_sum(first, second, *, shape, workspace=None, native=None):
    """An elementwise kernel and the sum to `shape` of another reading its output, each given as its function takes
    it (`ew`: `(kernel, out, *args)`, `ew_sum`: the same and `shape`, `workspace`): with `native`, one pass of the
    program's compiled pair where it has one (a per-channel sum), else `ew` and then `ew_sum`. The values are
    those of the two calls."""
    if native is not None and native.ew_and_sum(first, second, shape):
        return
    ew(*first, native=native)
    ew_sum(*second, shape=shape, workspace=workspace, native=native)


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
        sum_to(chunk, out=out if s == 0 else part, shape=shape, native=native)
        if s and (native is None or not native.accumulate(part, out)):
            np.add(out, part, out=out)


_ERF_STEP = 1.0 / 16      # the centres of the expansions: 0, 1/16, ..., 6, so |x - centre| <= 1/32
_ERF_TOP = 6.0            # beyond it erf is 1 in float64 (1 - erf(6) = 2.2e-17)
_ERF_TERMS = 11           # Taylor terms about each centre: the remainder is below 1e-18


def _erf_expansions() -> list[np.ndarray]:
    """Column j: erf's j-th Taylor coefficient erf^(j)(c) / j! at each centre c. The derivatives are
    erf^(j)(c) = 2/sqrt(pi) (-1)^(j-1) H_(j-1)(c) exp(-c^2) (H the physicists' Hermite polynomials,
    H_(n+1) = 2c H_n - 2n H_(n-1)); erf(c) itself is Python's."""
    centres = np.arange(0.0, _ERF_TOP + _ERF_STEP / 2, _ERF_STEP)
    table = np.empty((len(centres), _ERF_TERMS))
    for k, c in enumerate(centres):
        table[k, 0] = math.erf(c)
        scale, factorial, before, hermite = 2 / math.sqrt(math.pi) * math.exp(-c * c), 1.0, 0.0, 1.0
        for j in range(1, _ERF_TERMS):
            factorial *= j
            table[k, j] = scale * (-1) ** (j - 1) * hermite / factorial
            before, hermite = hermite, 2 * c * hermite - 2 * (j - 1) * before
    return [np.ascontiguousarray(table[:, j]) for j in range(_ERF_TERMS)]


_ERF_COEFFICIENTS = _erf_expansions()


def erf(x, out=None):
    """The error function, elementwise, in x's float precision (numpy has no ufunc for it): computed in float64 to
    within 4e-16 relative of the exact value (erf(v / sqrt(2)) is the exact GELU's), so float32 results are
    correctly rounded but for ties: |x| by the Taylor series of erf about the nearest of the centres 0, 1/16, ...,
    6 (11 terms, their coefficients tabulated once), 1 beyond 6, the sign of x. Writes into `out` when given (an
    array of x's shape), and returns the result."""
    x = np.asarray(x)
    flat = x.reshape(-1).astype(np.float64)
    a = np.fmin(np.abs(flat), _ERF_TOP)                        # NaN goes through as 6, then back to NaN
    centre = np.rint(a * (1 / _ERF_STEP)).astype(np.intp)
    d = a - centre * _ERF_STEP
    result = _ERF_COEFFICIENTS[-1].take(centre)
    for column in reversed(_ERF_COEFFICIENTS[:-1]):
        result *= d
        result += column.take(centre)
    np.copysign(result, flat, out=result)
    np.copyto(result, flat, where=np.isnan(flat))
    result = result.reshape(x.shape)
    dtype = x.dtype if x.dtype.kind == "f" else np.float64
    if out is None:
        return result.astype(dtype) if result.ndim else dtype.type(result)
    np.copyto(out, result, casting="same_kind")
    return out
