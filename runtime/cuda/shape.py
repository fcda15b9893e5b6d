"""Shapes on the CUDA device: concat, slices and padding along an axis, two axes swapped."""
from __future__ import annotations

import math

from deepdsl_runtime.cuda.arrays import DeviceArray, copy2d, fill, launch_items


def _split(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    return math.prod(shape[:axis]), math.prod(shape[axis + 1:])


def concat(*xs, out, axis):
    outer, inner = _split(out.shape, axis)
    total, start = out.shape[axis], 0
    for x in xs:
        a = x.shape[axis]
        copy2d(out.device, outer, a * inner, x.ptr, a * inner, out.ptr + start * inner * out.itemsize,
               total * inner, out.itemsize)
        start += a


def slice(x, *, out=None, axis, start, stop):  # noqa: A001 -- the IR op's name
    """x[..., start:stop, ...] along `axis`, copied into `out`; without `out`, the view of that block of x, which must
    be contiguous (every axis before `axis` of size 1)."""
    outer, inner = _split(x.shape, axis)
    if out is None:
        if outer != 1:
            raise ValueError(f"a slice of axis {axis} of {x.shape} is no block of it")
        shape = x.shape[:axis] + (stop - start,) + x.shape[axis + 1:]
        return DeviceArray(x.ptr + start * inner * x.itemsize, shape, x.dtype, x.owner, x.device)
    copy2d(out.device, outer, (stop - start) * inner, x.ptr + start * inner * x.itemsize, x.shape[axis] * inner,
           out.ptr, (stop - start) * inner, x.itemsize)


def pad_axis(x, *, out, axis, start, size):
    fill(out, 0)
    outer, inner = _split(x.shape, axis)
    a = x.shape[axis]
    copy2d(out.device, outer, a * inner, x.ptr, a * inner, out.ptr + start * inner * out.itemsize, size * inner,
           out.itemsize)


def transpose(x, *, out, axes):
    """out = x with axes (i, j) swapped: x read as (P, A, M, B, R) with A, B the swapped axes, out (P, B, M, A, R)."""
    i, j = axes
    shape = x.shape
    dims = (math.prod(shape[:i]), shape[i], math.prod(shape[i + 1:j]), shape[j], math.prod(shape[j + 1:]))
    launch_items(out.device, "deepdsl_transpose", "IIIIIPP", out.size, *dims, x.ptr, out.ptr)


def gather_rows(table, ids, *, out):
    """out[i] = table[ids[i]] (a row of NaN for a row number outside the table)."""
    m, d = out.shape
    launch_items(out.device, "deepdsl_gather_rows", "IIIPPP", m * d, m * d, d, table.shape[0], table.ptr, ids.ptr,
                 out.ptr)


def scatter_rows(g, ids, *, out, rows):
    """out = 0; out[ids[i]] += g[i] in the order of i (one item per column: no atomics, the CPU's bits)."""
    m, d = g.shape
    launch_items(out.device, "deepdsl_scatter_rows", "IIIPPP", d, d, m, rows, g.ptr, ids.ptr, out.ptr)
