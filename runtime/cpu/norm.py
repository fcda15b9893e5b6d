"""Local response normalization on the CPU, forward and backward."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch, sample_chunks


def _channel_window_sum(a, out, front, back):
    """out[:, c] = sum of a[:, c - front : c + back + 1], clipped at the ends (axis 1, any trailing axes)."""
    c = a.shape[1]
    np.copyto(out, a)
    for d in range(1, min(front, c - 1) + 1):
        np.add(out[:, d:], a[:, :c - d], out=out[:, d:])
    for d in range(1, min(back, c - 1) + 1):
        np.add(out[:, :c - d], a[:, d:], out=out[:, :c - d])


def _lrn_scale(x, s, tmp, size, alpha, k):
    """s = k + alpha/size * (window sum of x^2)."""
    np.square(x, out=tmp)
    _channel_window_sum(tmp, s, size // 2, (size - 1) // 2)
    np.multiply(s, alpha / size, out=s)
    np.add(s, k, out=s)


def lrn(x, *, out, size, alpha, beta, k, workspace=None, native=None):
    """out = x * s^-beta over channel windows, in chunks of samples (scratch: the scale and the squares). With
    `native` (compiled kernels) each chunk is one compiled call: the same operations, threaded."""
    scratch_floats = contract.lrn_scratch(x.shape)
    for a, b in sample_chunks(x.shape[0], workspace, scratch_floats, 2 * scratch_floats):
        xs, scratch = x[a:b], Scratch(workspace)
        s, tmp = scratch.take(xs.shape), scratch.take(xs.shape)
        if native is not None and native.lrn(xs, s, out[a:b], size, alpha, beta, k):
            continue
        _lrn_scale(xs, s, tmp, size, alpha, k)
        np.power(s, -beta, out=s)
        np.multiply(xs, s, out=out[a:b])


def lrn_bwd(g, x, *, out, size, alpha, beta, k, workspace=None, native=None):
    """dx = g s^-beta - (2 alpha beta / size) x * window_sum'(g x s^(-beta-1)), in chunks of samples (scratch: the
    scale, the inner term and its window sum). `out` may be `g` (in place): each chunk reads g before writing. With
    `native` each chunk is one compiled call (two of the scratch tensors)."""
    scratch_floats = contract.lrn_bwd_scratch(x.shape)
    for lo, hi in sample_chunks(x.shape[0], workspace, scratch_floats, 2 * scratch_floats):
        gs, xs, outs, scratch = g[lo:hi], x[lo:hi], out[lo:hi], Scratch(workspace)
        s, a, spread = scratch.take(xs.shape), scratch.take(xs.shape), scratch.take(xs.shape)
        if native is not None and native.lrn_bwd(gs, xs, s, a, outs, size, alpha, beta, k):
            continue
        _lrn_scale(xs, s, a, size, alpha, k)
        np.power(s, -beta - 1, out=a)
        np.multiply(a, gs, out=a)
        np.multiply(a, xs, out=a)
        # input j feeds the outputs c with j in window(c): the window mirrored
        _channel_window_sum(a, spread, (size - 1) // 2, size // 2)
        np.multiply(spread, xs, out=spread)
        np.multiply(spread, 2 * alpha * beta / size, out=spread)
        np.power(s, -beta, out=s)
        np.multiply(s, gs, out=outs)
        np.subtract(outs, spread, out=outs)
