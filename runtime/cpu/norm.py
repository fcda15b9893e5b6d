"""Local response normalization and layer normalization on the CPU, forward and backward."""
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


def _rows(x, axes):
    """x as (rows, features): the last `axes` axes of each position one row (a view of a contiguous x)."""
    return x.reshape(contract.layer_norm_rows(x.shape, axes))


SUM_LANES = 16       # DEEPDSL_SUM_LANES


def _lane_sums(v):
    """The sum of each row of (rows, features) float32 `v`, in float32 and in the compiled kernels' order
    (`DEEPDSL_LANE_SUM`): element k adds to lane k mod 16 in order, then the lanes are halved down to one."""
    rows, features = v.shape
    lanes = np.zeros((rows, SUM_LANES), np.float32)
    for start in range(0, features, SUM_LANES):
        part = v[:, start:start + SUM_LANES]
        lanes[:, :part.shape[1]] += part
    half = SUM_LANES // 2
    while half:
        lanes[:, :half] += lanes[:, half:2 * half]
        half //= 2
    return lanes[:, :1]


def _row_statistics(x, eps):
    """Each row's mean and 1 / sqrt(var + eps) (the biased variance of the deviations from the rounded mean) of
    (rows, features) float32 `x`, as (rows, 1) columns, in float32 as the compiled kernel computes them
    (`deepdsl_layer_norm_stats`)."""
    features = np.float32(x.shape[1])
    mean = _lane_sums(x) / features
    centered = x - mean
    var = _lane_sums(centered * centered) / features
    return mean, np.float32(1) / np.sqrt(var + np.float32(eps))


def layer_norm(x, *affine, out, eps, axes, native=None):
    """out = (x - mean) / sqrt(var + eps) [* weight + bias] over the last `axes` axes. With `native`, one compiled
    pass that reads each row once (`deepdsl_layer_norm`)."""
    if native is not None and native.layer_norm(x, affine, out, eps, axes):
        return
    rows = _rows(x, axes)
    mean, rstd = _row_statistics(rows, eps)
    y = (rows - mean) * rstd
    if affine:
        y = y * affine[0].reshape(-1) + affine[1].reshape(-1)
    np.copyto(out, y.reshape(out.shape))


def layer_norm_grad(x, g, *weight, out, eps, axes, native=None):
    """dx = rstd (gw - mean(gw) - xhat mean(gw xhat)) per row, gw = g * weight (g without one). `out` may be `g`
    (in place): each row of g is read whole before its row of dx is written."""
    if native is not None and native.layer_norm_grad(x, g, weight, out, eps, axes):
        return
    rows, grads = _rows(x, axes), _rows(g, axes)
    features = rows.shape[1]
    mean, rstd = _row_statistics(rows, eps)
    xhat = (rows - mean) * rstd
    gw = grads * weight[0].reshape(-1) if weight else grads
    a = _lane_sums(gw) / np.float32(features)
    b = _lane_sums(gw * xhat) / np.float32(features)
    np.copyto(out, (rstd * (gw - a - xhat * b)).reshape(out.shape))


def layer_norm_param_grad(x, g, *, out, eps, axes, workspace=None, native=None):
    """out[0] = the sum over rows of g * xhat (the weight's gradient), out[1] = the sum of g (the bias's): each part
    of `contract.LAYER_NORM_PART_ROWS` rows summed in float64 row after row, then the parts in order, as the
    compiled kernel adds them."""
    if native is not None and native.layer_norm_param_grad(x, g, out, workspace, eps, axes):
        return
    rows, grads = _rows(x, axes), _rows(g, axes)
    mean, rstd = _row_statistics(rows, eps)
    both = np.stack([grads * ((rows - mean) * rstd), grads])                  # (2, rows, features)
    step = contract.LAYER_NORM_PART_ROWS
    total = np.zeros((2, rows.shape[1]))
    for first in range(0, rows.shape[0], step):
        total += both[:, first:first + step].sum(axis=1, dtype=np.float64)
    np.copyto(out, total)
