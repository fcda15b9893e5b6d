"""Matrix products and convolution on the CUDA device: im2col + (strided batched) GEMM, forward and both gradients."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cuda import layout as L
from deepdsl_runtime.cuda.arrays import DeviceArray, device_array, launch_items, overlaps


def matmul(a, b, bias=None, *, out, ta=False, tb=False, workspace=None):
    """out = op(a) op(b), 2-D or batched over equal leading axes (one strided batched GEMM; the workspace the CPU's
    depth cut uses stays unused); a 2-D product's bias (n,) added to every row after it (the convolutions' bias
    kernel, each column a channel of planes of one value)."""
    m, n = out.shape[-2:]
    k = a.shape[-2] if ta else a.shape[-1]
    if out.ndim == 2:
        out.device.gemm(bool(ta), bool(tb), m, n, k, 1.0, a.ptr, a.shape[1], b.ptr, b.shape[1], 0.0, out.ptr, n)
        if bias is not None:
            launch_items(out.device, "deepdsl_add_bias", "IIIPP", out.size, out.size, n, 1, bias.ptr, out.ptr)
        return
    batch = out.size // (m * n)
    out.device.gemm_batched(bool(ta), bool(tb), m, n, k, a.ptr, a.shape[-1], m * k, b.ptr, b.shape[-1], k * n,
                            out.ptr, n, m * n, batch)


def _conv_geom(c, h, w, kh, kw, ho, wo, stride, pad) -> tuple[int, ...]:
    return (c, h, w, kh, kw, ho, wo, stride, pad)


_CONV = "I" * 9


def _floats(workspace) -> int | None:
    return None if workspace is None else workspace.nbytes // 4


def _scratch(device, workspace, floats: int) -> DeviceArray:
    """The first `floats` float32 of the workspace (or a temporary on `device` when none was given, as on the
    CPU)."""
    if workspace is None:
        return device_array(device, floats * 4, (floats,), np.float32)
    return workspace.view(np.float32)[:floats] if workspace.dtype != np.float32 else workspace[:floats]


def over_input(device, what: str, samples: int, in_floats: int, out_floats: int, in_ptr: int, out_ptr: int,
               workspace, run) -> None:
    """Run a per-sample op whose output starts where its input starts (the memory plan's takeover) in the CPU
    backend's safe chunk order (`layout.safe_sample_chunks`): `run(first, count, source_ptr, target_ptr)`
    computes samples [first, first + count) with both pointers at sample `first`, on memory that no unread sample
    shares. A sample with no safe chunk goes through one sample of staging at the end of the workspace, which the
    plan adds for that: the output lands there first when the op shrinks, the input is copied there first when it
    grows. The copies run on `device`."""
    staged = min(in_floats, out_floats)
    floats = _floats(workspace) or 0
    if floats < staged:
        raise ValueError(f"{what} over its input: the workspace ({floats} floats) cannot stage a sample ({staged})")
    stage = (workspace.view(np.float32) if workspace.dtype != np.float32 else workspace)[floats - staged:floats]
    for s, e, through_stage in L.safe_sample_chunks(samples, in_floats * 4, out_floats * 4):
        source, target = in_ptr + s * in_floats * 4, out_ptr + s * out_floats * 4
        if not through_stage:
            run(s, e - s, source, target)
        elif out_floats <= in_floats:
            run(s, 1, source, stage.ptr)
            device.copy(target, stage.ptr, out_floats * 4)
        else:
            device.copy(stage.ptr, source, in_floats * 4)
            run(s, 1, stage.ptr, target)


def _im2col(device, x_ptr: int, geom, samples: int, sample_stride: int, row_stride: int, cols_ptr: int) -> None:
    c, _, _, _, _, ho, wo, _, _ = geom
    count = samples * c * ho * wo            # an item per position of each channel, writing its kh * kw rows
    launch_items(device, "deepdsl_im2col", "I" + _CONV + "IIPP", count, count, *geom, sample_stride, row_stride, x_ptr,
                 cols_ptr)


def _products(device, ta: bool, m: int, n: int, k: int, a: int, lda: int, b: int, b_sample: int, c: int,
              c_sample: int, samples: int, groups: int) -> None:
    """For each sample i and group g: C_ig (m, n) = op(A_g) B_ig, B_ig (k, n) and C_ig contiguous rows in groups
    along each sample (B_ig at b + i*b_sample + g*k*n floats, C_ig at c + i*c_sample + g*m*n), A_g the g-th of
    `groups` consecutive (m, k) blocks of A ((k, m) when transposed, `ta`). Without groups, one batched product over
    the samples (A shared); with them, one batched product over the groups per sample."""
    if groups == 1:
        device.gemm_batched(ta, False, m, n, k, a, lda, 0, b, n, b_sample, c, n, c_sample, samples)
        return
    for i in range(samples):
        device.gemm_batched(ta, False, m, n, k, a, lda, m * k, b + 4 * i * b_sample, n, k * n, c + 4 * i * c_sample,
                            n, m * n, groups)


def conv2d(x, w, b=None, *, out, stride=1, pad=0, groups=1, workspace=None):
    """out = x (*) w + b: x (N,C,H,W), w (O,C/groups,kh,kw), b (O,), out (N,O,Ho,Wo). Workspace per sample: the
    im2col matrix (C*kh*kw, Ho*Wo); none for 1x1 stride-1 convolutions (one batched GEMM on the input). With
    `groups`, group g's filters multiply group g's rows of the im2col matrix (or of the input)."""
    n, c, h, wd = x.shape
    o, ci, kh, kw = w.shape
    ho, wo = out.shape[2:]
    hw, ckk = ho * wo, c * kh * kw
    co, rows = o // groups, ci * kh * kw         # one group's filters and rows
    device = out.device
    if contract.pointwise_conv(kh, kw, stride, pad):
        _products(device, False, co, hw, ci, w.ptr, ci, x.ptr, c * hw, out.ptr, o * hw, n, groups)
    else:
        geom = _conv_geom(c, h, wd, kh, kw, ho, wo, stride, pad)
        step = L.conv_samples(n, _floats(workspace), ckk * hw)
        cols = _scratch(device, workspace, step * ckk * hw)
        for s in range(0, n, step):
            m = min(n, s + step) - s
            _im2col(device, x.ptr + s * c * h * wd * 4, geom, m, ckk * hw, hw, cols.ptr)
            _products(device, False, co, hw, rows, w.ptr, rows, cols.ptr, ckk * hw, out.ptr + s * o * hw * 4, o * hw,
                      m, groups)
    if b is not None:
        launch_items(device, "deepdsl_add_bias", "IIIPP", out.size, out.size, o, hw, b.ptr, out.ptr)


def conv2d_bwd_data(g, w, *, out, stride, pad, size, groups=1, workspace=None):
    """Gradient of conv2d with respect to its input: col2im(W^T G). Workspace per sample: the column gradients
    (C*kh*kw, Ho*Wo); none for 1x1 stride-1 (one batched GEMM).

    The memory plan may let `out` take over the bytes of `g` from the same start. Chunks then run forward when the
    gradient shrinks and backward when it grows: a chunk's GEMM reads all its samples of `g` before col2im writes
    them, and col2im's writes reach only samples already read. 1x1 stride-1 products read `g` and write `out`
    directly: they run in the CPU backend's safe chunk order, one sample staged through the end of the workspace."""
    n, o, ho, wo = g.shape
    _, ci, kh, kw = w.shape
    h, wd = size
    c = ci * groups
    hw, ckk = ho * wo, c * kh * kw
    co, rows = o // groups, ci * kh * kw         # one group's filters and column-gradient rows
    device = out.device
    overlap = overlaps(out, g)
    if overlap and out.ptr != g.ptr:
        raise ValueError("conv2d_bwd_data: an output overlapping its input must start where the input starts")
    if contract.pointwise_conv(kh, kw, stride, pad):
        per_in, per_out = o * hw, c * hw
        if not overlap:
            _products(device, True, ci, hw, co, w.ptr, ci, g.ptr, per_in, out.ptr, per_out, n, groups)
            return
        over_input(device, "conv2d_bwd_data", n, per_in, per_out, g.ptr, out.ptr, workspace,
                   lambda s, count, source, target: _products(
                       device, True, ci, hw, co, w.ptr, ci, source, per_in, target, per_out, count, groups))
        return
    geom = _conv_geom(c, h, wd, kh, kw, ho, wo, stride, pad)
    step = L.conv_samples(n, _floats(workspace), ckk * hw)
    dcols = _scratch(device, workspace, step * ckk * hw)
    starts = range(0, n, step)
    if overlap and c * h * wd > o * hw:
        starts = reversed(starts)                   # a growing gradient: the last samples first
    for s in starts:
        m = min(n, s + step) - s
        _products(device, True, rows, hw, co, w.ptr, rows, g.ptr + s * o * hw * 4, o * hw, dcols.ptr, ckk * hw, m,
                  groups)
        count = m * c * h * wd
        launch_items(device, "deepdsl_col2im", "I" + _CONV + "PP", count, count, *geom, dcols.ptr,
                     out.ptr + s * c * h * wd * 4)


def conv2d_bwd_filter(g, x, *, out, stride, pad, kernel, groups=1, workspace=None):
    """Gradient of conv2d with respect to its weights: G im2col(X)^T, one GEMM per chunk of samples over the chunk's
    im2col matrix laid out (C*kh*kw, samples*Ho*Wo) and its gradient regrouped to (O, samples*Ho*Wo); chunks after
    the first accumulate in the GEMM (beta = 1); with `groups`, one GEMM per group. Workspace per sample:
    (C*kh*kw + O) * Ho*Wo."""
    n, o, ho, wo = g.shape
    c, h, wd = x.shape[1:]
    kh, kw = kernel
    hw, ckk = ho * wo, c * kh * kw
    device = out.device
    geom = _conv_geom(c, h, wd, kh, kw, ho, wo, stride, pad)
    step = L.conv_samples(n, _floats(workspace), (ckk + o) * hw)
    scratch = _scratch(device, workspace, step * (ckk + o) * hw)
    for s in range(0, n, step):
        m = min(n, s + step) - s
        cols = scratch.ptr
        regrouped = scratch.ptr + m * ckk * hw * 4
        _im2col(device, x.ptr + s * c * h * wd * 4, geom, m, hw, m * hw, cols)
        count = m * o * hw
        launch_items(device, "deepdsl_swap01", "IIIPP", count, m, o, hw, g.ptr + s * o * hw * 4, regrouped)
        co, rows = o // groups, ckk // groups      # group k: its filters' gradient by its rows of the matrix
        for k in range(groups):
            device.gemm(False, True, co, rows, m * hw, 1.0, regrouped + k * co * m * hw * 4, m * hw,
                        cols + k * rows * m * hw * 4, m * hw, 0.0 if s == 0 else 1.0, out.ptr + k * co * rows * 4, rows)
