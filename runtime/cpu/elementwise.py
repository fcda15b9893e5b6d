"""Elementwise work on the CPU: constants, copies and the elementwise kernels the compiler writes (`ew`), run in
cache-sized chunks."""
from __future__ import annotations

import numpy as np


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
