"""Shapes and data movement on the CPU: reductions to and broadcasts from a shape, reshape (a view), concat,
slices and padding along an axis, two axes swapped."""
from __future__ import annotations

import builtins
import math

import numpy as np


def _reduced_axes(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    lead = len(src) - len(dst)
    return tuple(range(lead)) + tuple(lead + i for i, d in enumerate(dst) if d == 1 and src[lead + i] != 1)


def sum_to(x, *, out, shape, native=None):
    """Sum x down to `shape` (the inverse of broadcasting). Per channel ((N, C, H, W) to (1, C, 1, 1)), over every
    axis but the last ((..., D) to (D,): a bias's gradient), over the last ((..., D) to (..., 1): a layer norm's) and
    over the planes ((N, C, H, W) to (N, C, 1, 1)) with `native`, the program's compiled kernels sum
    (`Native.channel_sum`, on their threads)."""
    if x.shape == tuple(shape):
        np.copyto(out, x)
        return
    if native is not None and x.ndim >= 2 and (tuple(shape)[-1:] == x.shape[-1:] and math.prod(shape) == x.shape[-1]
                                               or tuple(shape) == x.shape[:-1] + (1,)) and native.channel_sum(x, out):
        return
    if native is not None and x.ndim > 3 and tuple(shape) == x.shape[:2] + (1,) * (x.ndim - 2) and \
            x.flags.c_contiguous and native.channel_sum(x.reshape(x.shape[:2] + (-1,)),
                                                        out.reshape(x.shape[:2] + (1,))):
        return          # (the planes of each sample and channel: squeeze-and-excitation's pooling and its gradient)
    if x.ndim == 4 and tuple(shape) == (1, x.shape[1], 1, 1) and x.shape[2] * x.shape[3] > 1:
        if native is not None and native.channel_sum(x, out):
            return
        # per-channel sums (bias and batch-norm gradients): a matrix-vector product over each sample's planes runs
        # at memory speed, numpy's reduction over axes (0, 2, 3) several times slower
        n, c, h, w = x.shape
        per_sample = np.matmul(x.reshape(n, c, h * w), np.ones(h * w, dtype=x.dtype))
        np.sum(per_sample, axis=0, out=out.reshape(c))
        return
    lead = x.ndim - len(shape)
    np.sum(x, axis=_reduced_axes(x.shape, tuple(shape)), keepdims=True, out=out.reshape((1,) * lead + tuple(shape)))


def broadcast_to(x, *, out, shape):
    np.copyto(out, x)


def reshape(x, *, shape):
    """A view with another shape (no copy: x is contiguous)."""
    return x.reshape(shape)


def concat(*xs, out, axis):
    np.concatenate(xs, axis=axis, out=out)


def _axis_index(ndim, axis, start, stop):
    index = [builtins.slice(None)] * ndim
    index[axis] = builtins.slice(start, stop)
    return tuple(index)


def slice(x, *, out=None, axis, start, stop):  # noqa: A001 -- the IR op's name
    """x[..., start:stop, ...] along `axis`, copied into `out`; without `out`, the view of that block of x (a
    program asks for one where the block is contiguous: every axis before `axis` of size 1)."""
    part = x[_axis_index(x.ndim, axis, start, stop)]
    if out is None:
        return part
    np.copyto(out, part)
    return None


def pad_axis(x, *, out, axis, start, size):
    out.fill(0)
    out[_axis_index(x.ndim, axis, start, start + x.shape[axis])] = x


def transpose(x, *, out, axes, native=None):
    """out = x with axes (i, j) swapped, in out's (contiguous) order."""
    if native is not None and native.swap_axes(x, out, axes):
        return
    np.copyto(out, x.swapaxes(*axes))


def gather_rows(table, ids, *, out, native=None):
    """out[m] = table[ids[m]] (a row of NaN for a row number outside the table)."""
    if native is not None and native.gather_rows(table, ids, out):
        return
    valid = (ids >= 0) & (ids < table.shape[0])
    if valid.all():
        np.take(table, ids, axis=0, out=out)
    else:
        out.fill(np.nan)
        out[valid] = table[ids[valid]]


def scatter_rows(g, ids, *, out, rows, native=None):
    """out = zeros; out[ids[m]] += g[m] in the order of m (row numbers outside [0, rows) add nothing)."""
    if native is not None and native.scatter_rows(g, ids, out):
        return
    out.fill(0)
    valid = (ids >= 0) & (ids < rows)
    np.add.at(out, ids[valid], g[valid])       # unbuffered, in index order: the compiled kernel's sums
