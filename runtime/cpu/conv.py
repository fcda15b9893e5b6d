"""Convolution on the CPU: im2col + GEMM (Torch7's scheme), forward and both gradients; with the compiled kernels,
thin convolutions straight from the input, stride-1 convolutions of many channels directly on channel-blocked
copies (`_blocked`; 3x3 ones by Winograd's transforms, `_winograd`) and thin layers' filter gradients of any stride
(`_thin_filter`)."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.native import _contiguous32
from deepdsl_runtime.cpu.scratch import Scratch, copy, over_samples, samples_per_chunk, takes_over


def _blocked(op: str, a, b, bias, out, stride: int, pad: int, workspace, native, over: bool = False) -> bool:
    """A convolution (`op` "conv2d": a the input, b the filters; "conv2d_bwd_data": a the output gradient, b the
    filters; "conv2d_bwd_filter": a the output gradient, b the input) by the compiled direct kernels on
    channel-blocked copies (`contract.blocked_conv`), where the library has them, the arrays are contiguous float32
    and the workspace holds the copies (`contract.blocked_scratch`: the filters' once at its start, then the
    operands of `contract.blocked_samples` samples at a time); False (nothing written) otherwise. A chunk copies its
    operands before writing its output, so an input gradient taking over its output gradient's bytes (`over`) runs
    the chunks in the order that writes behind the unread samples (`_safe_order`). The filter gradient sums the
    chunks in the blocked sums, so its bits do not depend on the chunks either."""
    if native is None or not getattr(native, "blocked", False):
        return False
    x, w, g = {"conv2d": (a, b, out), "conv2d_bwd_data": (out, b, a), "conv2d_bwd_filter": (b, out, a)}[op]
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho, wo = g.shape[2:]
    if w.shape[1] != c or not _contiguous32(a, b, out, *([] if bias is None else [bias])):
        return False
    if _winograd(op, x, w, bias, out, a, stride, pad, workspace, native, over):
        return True
    if not contract.blocked_conv(c, o, kh, kw, stride, pad, wo, op=op, lanes=native.lanes):
        return False
    per_sample, once = contract.blocked_scratch(op, x.shape, w.shape, pad)
    if workspace is not None and workspace.size < once + per_sample:
        return False
    scratch = Scratch(workspace)
    ob, cb = contract.channel_blocks(o), contract.channel_blocks(c)
    block = contract.CHANNEL_BLOCK
    filters = scratch.take((cb, ob, kh, kw, block, block) if op == "conv2d_bwd_data" else
                           (ob, cb, kh, kw, block, block))
    if op == "conv2d":
        native.block_filters(w, False, filters)
    elif op == "conv2d_bwd_data":
        native.block_filters(w, True, filters)
    step = contract.blocked_samples(n, per_sample, once, None if workspace is None else workspace.size)
    starts = range(0, n, step)
    for s in (_safe_order(starts, over and out.nbytes > a.nbytes) if op == "conv2d_bwd_data" else starts):
        e = min(n, s + step)
        chunk = Scratch(workspace, once)
        if op == "conv2d":
            xb = chunk.take((e - s, cb, h + 2 * pad, wd + 2 * pad, block))
            native.block_input(x[s:e], pad, pad, xb)
            native.blocked_conv(xb, filters, bias, out[s:e])
        elif op == "conv2d_bwd_data":
            ph, pw = kh - 1 - pad, kw - 1 - pad
            gb = chunk.take((e - s, ob, ho + 2 * ph, wo + 2 * pw, block))
            native.block_input(g[s:e], ph, pw, gb)
            native.blocked_conv(gb, filters, None, out[s:e])
        else:
            xb = chunk.take((e - s, cb, h + 2 * pad, wd + 2 * pad, block))
            gb = chunk.take((e - s, ob, ho, wo, block))
            native.block_input(x[s:e], pad, pad, xb)
            native.block_input(g[s:e], 0, 0, gb)
            native.blocked_filter_sums(xb, gb, s == 0, filters)
    if op == "conv2d_bwd_filter":
        native.unblock_filters(filters, out)
    return True


def _winograd(op: str, x, w, bias, out, a, stride: int, pad: int, workspace, native, over: bool) -> bool:
    """A convolution or either of its gradients (`_blocked`'s arrays: x the forward's input, w its filters or, for
    the filter gradient, the gradient) by Winograd's F(4x4, 3x3), where the library has it (`native.winograd`),
    `contract.winograd_conv` takes the layer and the workspace holds its arrays (`contract.winograd_scratch`: a
    range of output blocks' filters transformed straight from w, then `contract.winograd_samples` samples' blocked
    input, transformed tiles and products at a time); False (nothing written) otherwise. The convolution's input is
    `a` (the output gradient for the input gradient, padded by 2 - pad, its filters turned around), and chunks run
    in `_safe_order` as `_blocked`'s do. With one range its filters are transformed once; with several, each range's
    again for every chunk. The filter gradient: `_winograd_filter`, or `_winograd_filter_pairs`
    (`contract.winograd_pairs`)."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    if not getattr(native, "winograd", False) or not contract.winograd_conv(c, o, kh, kw, stride, pad, wd, op=op) or \
            (op == "conv2d_bwd_filter" and not native.winograd_filter_grads):
        return False
    room = None if workspace is None else workspace.size
    step = contract.winograd_samples(n, op, x.shape, w.shape, pad, room)
    if not step:
        return False
    ins, outs, most = contract.winograd_blocks(op, x.shape, w.shape)
    block, points, tiles = contract.CHANNEL_BLOCK, contract.WINOGRAD_POINTS, contract.winograd_tiles(h, wd)
    ranges = [(b, min(outs, b + most)) for b in range(0, outs, most)]
    if op == "conv2d_bwd_filter":
        if contract.winograd_pairs(op, x.shape, w.shape, pad, room):
            if not getattr(native, "winograd_pair_kernels", False):
                return False
            _winograd_filter_pairs(x, a, out, pad, workspace, native)
        else:
            _winograd_filter(x, a, out, pad, workspace, native, (ins, outs, most), ranges, step)
        return True
    flip = op == "conv2d_bwd_data"
    scratch = Scratch(workspace)
    skew = contract.WINOGRAD_SKEW
    transformed = scratch.take((points * (most * ins * block * block + skew),))

    def transform(b0: int, b1: int) -> np.ndarray:   # the range's filters, 36 points of (b1 - b0, ins, 16, 16) + skew
        u = transformed[:points * ((b1 - b0) * ins * block * block + skew)]
        native.winograd_transform(w, flip, b0, b1, u)
        return u

    only = transform(*ranges[0]) if len(ranges) == 1 else None
    starts = range(0, n, step)
    padding = kh - 1 - pad if flip else pad
    for s in _safe_order(starts, over and out.nbytes > a.nbytes) if flip else starts:
        e = min(n, s + step)
        chunk = Scratch(workspace, scratch.used)
        ab = chunk.take((e - s, ins, h + 2 * padding, wd + 2 * padding, block))
        v = chunk.take((points, ins, (e - s) * tiles, block))
        products = chunk.take((points * most * (e - s) * tiles * block,))
        native.block_input(a[s:e], padding, padding, ab)
        for k, (b0, b1) in enumerate(ranges):
            u = only if only is not None else transform(b0, b1)
            native.winograd_conv(ab, u, bias, v, products[:points * (b1 - b0) * (e - s) * tiles * block],
                                 out[s:e], b0, b1, k > 0)
    return True


def _winograd_filter(x, g, out, pad: int, workspace, native, blocks, ranges, step: int) -> None:
    """out (O, C, 3, 3) = the filter gradient of `_winograd`'s layer from its input x and output gradient g, its
    `blocks` (`contract.winograd_blocks`) in `ranges`: for each range of output blocks, each chunk's sums
    (`native.winograd_filter_sums`, the chunks added in order), then their inverse transform into the blocked
    gradient, unblocked at the end. Several ranges take the whole batch in one chunk (`contract.winograd_samples`),
    whose copies and transformed tiles serve every range."""
    n, c, h, wd = x.shape
    block, points, tiles = contract.CHANNEL_BLOCK, contract.WINOGRAD_POINTS, contract.winograd_tiles(h, wd)
    ins, outs, most = blocks
    scratch = Scratch(workspace)
    gradient = scratch.take((outs, ins, 3, 3, block, block))
    sums = scratch.take((points * most * ins * block * block,))
    starts = range(0, n, step)
    for k, (b0, b1) in enumerate(ranges):
        part = sums[:points * (b1 - b0) * ins * block * block]
        for s in starts:
            e = min(n, s + step)
            chunk = Scratch(workspace, scratch.used)
            xb = chunk.take((e - s, ins, h + 2 * pad, wd + 2 * pad, block))
            gb = chunk.take((e - s, outs, h, wd, block))
            v = chunk.take((points, ins, (e - s) * tiles, block))
            y = chunk.take((points * most * (e - s) * tiles * block,))
            again = len(starts) == 1 and k > 0          # (this chunk's copies and tiles: the range before's)
            if not again:
                native.block_input(x[s:e], pad, pad, xb)
                native.block_input(g[s:e], 0, 0, gb)
            native.winograd_filter_sums(xb, gb, v, y[:points * (b1 - b0) * (e - s) * tiles * block], part, b0, b1,
                                        again, s == 0)
        native.winograd_filter_out(part, gradient[b0:b1])
    native.unblock_filters(gradient, out)


def _winograd_filter_pairs(x, g, out, pad: int, workspace, native) -> None:
    """out (O, C, 3, 3) = `_winograd_filter`'s gradient by pairs of blocks (`contract.winograd_pairs`):
    the whole batch blocked and its tiles transformed at once, each pair of blocks' sums, their inverse transform and
    its writing out together (`native.winograd_filter_pairs`), no blocked gradient between."""
    n, c, h, wd = x.shape
    block, points, tiles = contract.CHANNEL_BLOCK, contract.WINOGRAD_POINTS, contract.winograd_tiles(h, wd)
    ins, outs = contract.channel_blocks(c), contract.channel_blocks(out.shape[0])
    scratch = Scratch(workspace)
    xb = scratch.take((n, ins, h + 2 * pad, wd + 2 * pad, block))
    gb = scratch.take((n, outs, h, wd, block))
    v = scratch.take((points, ins, n * tiles, block))
    y = scratch.take((points, outs, n * tiles, block))
    native.block_input(x, pad, pad, xb)
    native.block_input(g, 0, 0, gb)
    native.winograd_filter_pairs(xb, gb, v, y, out)


def _thin_filter(g, x, out, stride: int, pad: int, workspace, native) -> bool:
    """out (O, C, kh, kw) = a thin layer's filter gradient (`contract.thin_filter`) by the compiled kernels straight
    from the zero-padded input and the blocked output gradient, where the library has them (`native.thin_filters`),
    the arrays are contiguous float32 and the workspace holds the sums and a sample's copies
    (`contract.thin_filter_scratch`), `contract.blocked_samples` samples at a time, their sums added in order;
    False (nothing written) otherwise."""
    n, c, h, wd = x.shape
    o, _, kh, kw = out.shape
    if not getattr(native, "thin_filters", False) or not contract.thin_filter(c, o, kh, kw, stride, pad) or \
            not _contiguous32(g, x, out):
        return False
    per_sample, once = contract.thin_filter_scratch(g.shape, x.shape, (kh, kw), pad)
    if workspace is not None and workspace.size < once + per_sample:
        return False
    ob, block = contract.channel_blocks(o), contract.CHANNEL_BLOCK
    scratch = Scratch(workspace)
    sums = scratch.take((ob, c, kh, kw, block))
    step = contract.blocked_samples(n, per_sample, once, None if workspace is None else workspace.size)
    for s in range(0, n, step):
        e = min(n, s + step)
        chunk = Scratch(workspace, scratch.used)
        gb = chunk.take((e - s, ob, *g.shape[2:], block))
        native.block_input(g[s:e], 0, 0, gb)
        native.thin_filter(_padded(x[s:e], pad, chunk, native), gb, stride, s == 0, sums)
    native.thin_filter_out(sums, out)
    return True


def _windows(xp: np.ndarray, kh: int, kw: int, stride: int, ho: int, wo: int) -> np.ndarray:
    """(N, C, kh, kw, Ho, Wo) strided view: [n, c, i, j, p, q] = xp[n, c, i + stride*p, j + stride*q]."""
    sn, sc, sh, sw = xp.strides
    return np.lib.stride_tricks.as_strided(
        xp, shape=(xp.shape[0], xp.shape[1], kh, kw, ho, wo),
        strides=(sn, sc, sh, sw, sh * stride, sw * stride), writeable=False)


def _padded(x: np.ndarray, pad: int, scratch: Scratch, native=None) -> np.ndarray:
    """x with `pad` zeros around its last two axes, in scratch space (x itself when pad is 0); by `native`'s
    `pad_planes` where given and it takes the arrays."""
    if pad == 0:
        return x
    n, c, h, w = x.shape
    xp = scratch.take((n, c, h + 2 * pad, w + 2 * pad))
    if native is not None and native.pad_planes(x, pad, xp):
        return xp
    xp[:, :, :pad] = 0
    xp[:, :, h + pad:] = 0
    xp[:, :, pad:h + pad, :pad] = 0
    xp[:, :, pad:h + pad, w + pad:] = 0
    xp[:, :, pad:h + pad, pad:w + pad] = x
    return xp


def _im2col(x: np.ndarray, cols: np.ndarray, stride: int, pad: int, scratch: Scratch) -> None:
    """cols[n, c, i, j, p, q] = x[n, c, i + stride*p - pad, j + stride*q - pad] (0 outside x): one strided copy
    from x, or from a zero-padded copy of x in scratch space. `cols` may be a transposed view."""
    kh, kw, ho, wo = cols.shape[2:]
    np.copyto(cols, _windows(_padded(x, pad, scratch), kh, kw, stride, ho, wo))


def _valid(offset: int, size: int, out: int, stride: int, pad: int) -> tuple[int, int]:
    """Output positions [p0, p1) whose input row offset + stride*p - pad lies inside [0, size)."""
    p0 = max(0, -(-(pad - offset) // stride))
    p1 = min(out, (size - 1 + pad - offset) // stride + 1)
    return p0, max(p0, p1)


def _col2im_add(dcols: np.ndarray, dx: np.ndarray, stride: int, pad: int) -> None:
    """dx[n, c, i + stride*p - pad, j + stride*q - pad] += dcols[n, c, i, j, p, q] (the adjoint of _im2col)."""
    kh, kw, ho, wo = dcols.shape[2:]
    h, w = dx.shape[2:]
    for i in range(kh):
        p0, p1 = _valid(i, h, ho, stride, pad)
        for j in range(kw):
            q0, q1 = _valid(j, w, wo, stride, pad)
            r, c = i + stride * p0 - pad, j + stride * q0 - pad
            view = dx[:, :, r:r + stride * (p1 - p0):stride, c:c + stride * (q1 - q0):stride]
            np.add(view, dcols[:, :, i, j, p0:p1, q0:q1], out=view)


class _NumpyPasses:
    """The copying passes of the convolutions as numpy runs them (compiled kernels replace them: `native=`, and
    fall back to these on arrays they do not take)."""

    @staticmethod
    def im2col(x, cols, stride, pad, scratch):
        _im2col(x, cols, stride, pad, scratch)

    @staticmethod
    def col2im(dcols, out, stride, pad):
        out.fill(0)
        _col2im_add(dcols, out, stride, pad)

    @staticmethod
    def swap01(src, dst, bias=None):
        """dst = src with its first two axes swapped, plus bias[a] along the first axis of src when given."""
        if bias is None:
            np.copyto(dst, src.swapaxes(0, 1))
        else:
            np.add(src.swapaxes(0, 1), bias.reshape((1, -1) + (1,) * (src.ndim - 2)), out=dst)

    @staticmethod
    def copy(src, dst):
        np.copyto(dst, src)
        return True

    @staticmethod
    def add_bias(x, b):
        np.add(x, b.reshape((1, -1) + (1,) * (x.ndim - 2)), out=x)

    @staticmethod
    def gemm(a, b, out):
        """The stacked products of grouped convolutions (numpy's matmul; the compiled kernels' on their threads)."""
        return np.matmul(a, b, out=out)


_NUMPY = _NumpyPasses()


def conv2d(x, w, b=None, *, out, stride=1, pad=0, groups=1, workspace=None, gemm=np.matmul, native=None):
    """out = x (*) w + b: x (N,C,H,W), w (O,C,kh,kw), b (O,), out (N,O,Ho,Wo).

    Workspace per sample: the im2col matrix (C*kh*kw, Ho*Wo), and with padding the zero-padded input. Small output
    planes (Ho*Wo < 256; pointwise ones by their cost, `contract.one_product`) make a chunk of samples one GEMM
    (O, C*kh*kw) x (C*kh*kw, samples*Ho*Wo) -- one large product keeps every BLAS thread busy where small products
    per sample do not -- whose
    (O, samples, Ho*Wo) result lands in the chunk's own output memory and is regrouped to (samples, O, Ho*Wo) through
    the then dead im2col matrix, adding the bias on the way (the workspace holds max(C*kh*kw, O) rows). Otherwise each
    sample is one product straight into its output. With `native` (compiled kernels, `deepdsl_runtime.cpu.native`) the
    im2col copies and the regrouping run compiled, and a thin convolution (`contract.direct_conv`) runs straight from
    the input, without workspace, and one whose product per sample the products' tiles compute
    (`contract.tiled_conv`) sample by sample, each sample's im2col matrix multiplied straight into its output
    (`Native.conv_tiles`, where `gemm` is the compiled kernels'). With `groups`: `_grouped_conv2d`."""
    if groups > 1:
        return _grouped_conv2d(x, w, b, out, stride, pad, groups, workspace, native or _NUMPY)
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    if native is not None and native.direct("conv2d", x, w, b, out, stride, pad):
        return
    if _blocked("conv2d", x, w, b, out, stride, pad, workspace, native):
        return
    if native is not None and gemm == native.gemm and native.conv_tiles(x, w, b, out, stride, pad, workspace):
        return
    ho, wo = out.shape[2:]
    w2 = w.reshape(o, c * kh * kw)
    ckk, hw = c * kh * kw, ho * wo
    one = contract.one_product(hw)
    if contract.pointwise_conv(kh, kw, stride, pad):
        if contract.one_product(hw, pointwise=(c, o)):
            _regrouped_product(w2, x.reshape(n, c, h * wd), out.reshape(n, o, hw), b, workspace, gemm,
                               native or _NUMPY)
            return
        gemm(w2, x.reshape(n, c, h * wd), out=out.reshape(n, o, hw))
        if b is not None:
            (native or _NUMPY).add_bias(out, b)
        return
    step = samples_per_chunk(n, workspace, contract.conv2d_scratch(x.shape, w.shape, out.shape, stride, pad))
    for s in range(0, n, step):
        e = min(n, s + step)
        m = e - s
        scratch = Scratch(workspace)
        region = scratch.take(((max(ckk, o) if one else ckk) * m * hw,))
        cols = region[:ckk * m * hw].reshape(c, kh, kw, m, ho, wo)
        (native or _NUMPY).im2col(x[s:e], cols.transpose(3, 0, 1, 2, 4, 5), stride, pad, scratch)
        target = out[s:e].reshape(m, o, hw)
        if one:
            _product_by_samples(w2, cols.reshape(ckk, m * hw), target, b, region, gemm, native or _NUMPY)
        else:
            gemm(w2, cols.reshape(ckk, m, hw).transpose(1, 0, 2), out=target)
            if b is not None:
                (native or _NUMPY).add_bias(target, b)


def _product_by_samples(a, rows, target, b, dead, gemm, passes) -> None:
    """target (samples, M, P) = a (M, K) x rows (K, samples*P) (+ b): one product into the target's own memory, read
    as (M, samples*P), copied into `dead` (scratch no longer needed, at least M*samples*P floats) and regrouped back,
    adding the bias on the way."""
    m, (samples, _, p) = a.shape[0], target.shape
    block = target.reshape(m, samples * p)
    gemm(a, rows, out=block)
    regrouped = dead[:m * samples * p].reshape(m, samples, p)
    copy(block.reshape(m, samples, p), regrouped, passes)
    passes.swap01(regrouped, target, b)


def _regrouped_product(a, x, out, b, workspace, gemm, passes) -> None:
    """out[s] = a x[s] (+ b) for every sample s of x (N, K, P) into out (N, M, P), P small: per chunk of samples
    (`contract.one_product`; workspace max(K, M) * P per sample), x regrouped to (K, samples*P) and one
    product (`_product_by_samples`, back through the then dead regrouped x): what a product per sample computes (up
    to the product's rounding), as one product."""
    n, k, p = x.shape
    m = a.shape[0]
    step = samples_per_chunk(n, workspace, max(k, m) * p)
    for s in range(0, n, step):
        e = min(n, s + step)
        scratch = Scratch(workspace).take((max(k, m) * (e - s) * p,))
        rows = scratch[:k * (e - s) * p].reshape(k, e - s, p)
        passes.swap01(x[s:e], rows)
        _product_by_samples(a, rows.reshape(k, -1), out[s:e], b, scratch, gemm, passes)


def _grouped_conv2d(x, w, b, out, stride, pad, groups, workspace, passes):
    """conv2d of `groups` groups: the im2col matrix as without groups (C*kh*kw, samples*Ho*Wo), whose rows come in
    groups of C/groups*kh*kw, then one stacked product per chunk of samples: for each sample and group k, group k's
    filters (O/groups, C/groups*kh*kw) by group k's rows, straight into the sample's output (numpy's stacked
    matmul; the rows are read in place). Pointwise: the same product on the input itself."""
    n, c, h, wd = x.shape
    o, ci, kh, kw = w.shape
    ho, wo = out.shape[2:]
    co, hw = o // groups, ho * wo
    if _depthwise(passes, "conv2d", x, w, b, out, stride, pad, groups):
        return
    filters = w.reshape(groups, co, ci * kh * kw)
    if contract.pointwise_conv(kh, kw, stride, pad):
        passes.gemm(filters, x.reshape(n, groups, ci, h * wd), out=out.reshape(n, groups, co, hw))
    else:
        step = samples_per_chunk(n, workspace, contract.conv2d_scratch(x.shape, w.shape, out.shape, stride, pad,
                                                                       groups))
        for s in range(0, n, step):
            e = min(n, s + step)
            m = e - s
            scratch = Scratch(workspace)
            cols = scratch.take((c, kh, kw, m, ho, wo))
            passes.im2col(x[s:e], cols.transpose(3, 0, 1, 2, 4, 5), stride, pad, scratch)
            rows = cols.reshape(groups, ci * kh * kw, m, hw).transpose(2, 0, 1, 3)     # (samples, groups, rows, hw)
            passes.gemm(filters, rows, out=out[s:e].reshape(m, groups, co, hw))
    if b is not None:
        passes.add_bias(out, b)


def _depthwise(passes, op: str, a, b, bias, out, stride: int, pad: int, groups: int) -> bool:
    """A depthwise convolution (one input channel and one filter per group) or a gradient of it by the compiled
    plane-by-plane kernels (`Native.depthwise`: no workspace), where they are loaded and take the arrays."""
    kernel = getattr(passes, "depthwise", None)
    filters = out if op == "conv2d_bwd_filter" else b          # (O, C/groups, kh, kw): (groups, 1, ...) depthwise
    return kernel is not None and filters.shape[:2] == (groups, 1) and kernel(op, a, b, bias, out, stride, pad)


ADD_COST_FLOPS = contract.ADD_COST_FLOPS


def stride1_costs(o, c, kh, kw, ho, wo, wp, m) -> dict[str, int]:
    """The schemes conv2d_bwd_data can compute a stride-1 chunk of m samples by, and what each costs: matrix-product
    FLOPs plus ADD_COST_FLOPS per float its other passes move. "columns": a GEMM of the forward's FLOPs, then col2im
    adds C*kh*kw values per input position; "widened": the GEMM over rows Wp wide (Wp/Wo times the FLOPs), the same
    additions; "kernel rows" (where its copies fit the workspace): that GEMM, kh additions instead of kh*kw, and kw
    copies of the output gradient."""
    ckk, rows = c * kh * kw, m * ho * wp
    costs = {"columns": 2 * o * ckk * m * ho * wo + ADD_COST_FLOPS * (o + ckk) * m * ho * wo,
             "widened": 2 * o * ckk * rows + ADD_COST_FLOPS * (o + ckk) * rows}
    if o * kw + kh * c < ckk and m * (ckk - o * kw - kh * c) * ho * wp >= o * (kw - 1):
        costs["kernel rows"] = 2 * o * ckk * rows + ADD_COST_FLOPS * (o * (kw + 1) + kh * c) * rows
    return costs


def stride1_scheme(o, c, kh, kw, ho, wo, wp, m) -> str:
    """The scheme of least cost (`stride1_costs`)."""
    costs = stride1_costs(o, c, kh, kw, ho, wo, wp, m)
    return min(costs, key=costs.get)


def conv2d_bwd_data(g, w, *, out, stride, pad, size, groups=1, workspace=None, gemm=np.matmul, native=None):
    """Gradient of conv2d with respect to its input: col2im(W^T G).

    Stride 1 runs chunks of samples by the scheme of least cost (`stride1_costs`) within one workspace per sample: the
    widened output gradient (O, Ho*Wp), column gradients (C*kh*kw, Ho*Wp) and the padded input gradient
    (C, Hp*Wp + kw - 1). "columns": the output gradient regrouped to (O, samples*Ho*Wo), one GEMM for the chunk's
    column gradients (C*kh*kw, samples*Ho*Wo), then col2im (the forward's FLOPs; C*kh*kw additions per input position).
    "widened": the GEMM on rows as wide as the padded input (the output gradient transposed to (O, samples, Ho, Wp)
    with zero columns), so that adding each kernel offset's contribution is one contiguous run per channel and sample.
    "kernel rows" (where O*kw + kh*C < C*kh*kw): the widened gradient shifted by each kernel column (O*kw rows; a shift
    by j is an offset of j in rows that end in zero columns), one GEMM with the filters regrouped to (kh*C, O*kw)
    giving each kernel row's contribution (kh*C rows), and kh shifted additions instead of kh*kw. Other strides add
    strided windows: on small output planes (`contract.one_product`) as "columns" does, one product for the chunk, else
    the column gradients (C*kh*kw, Ho*Wo) only, one product per sample, then col2im. `out` may take over the bytes of
    `g` (same start): samples then run in a safe order. With stride 1, and other strides on small output planes, a
    chunk reads all of its output gradient (into a copy) before it writes any of its input gradient, so chunks of any
    size are safe in the order that writes behind the unread samples: forward when a sample's input gradient is the
    smaller, backward otherwise. With `native` the regrouping, col2im and the shifted additions with the crop run
    compiled (the same additions in the same order), and where `gemm` is theirs, one whose column gradients per
    sample the products' tiles compute (`contract.tiled_conv`) sample by sample (`Native.conv_data_tiles`) unless
    its input gradient takes over the output gradient's bytes. With `groups`: `_grouped_conv2d_bwd_data`."""
    if groups > 1:
        return _grouped_conv2d_bwd_data(g, w, out, stride, pad, size, groups, workspace, native or _NUMPY)
    n, o, ho, wo = g.shape
    _, c, kh, kw = w.shape
    h, wd = size
    over = takes_over(g, out)
    if _blocked("conv2d_bwd_data", g, w, None, out, stride, pad, workspace, native, over):
        return
    if native is not None and gemm == native.gemm and not over and \
            native.conv_data_tiles(g, w, out, stride, pad, workspace):
        return
    one = contract.one_product(ho * wo)
    if over and ((stride != 1 and not one) or contract.pointwise_conv(kh, kw, stride, pad)):
        return over_samples(lambda s, e, gs, os, ws: conv2d_bwd_data(
            gs, w, out=os, stride=stride, pad=pad, size=size, workspace=ws, gemm=gemm, native=native), g, out,
            workspace, native)
    w2t = w.reshape(o, c * kh * kw).T
    if contract.pointwise_conv(kh, kw, stride, pad):
        if contract.one_product(ho * wo, pointwise=(o, c)):
            _regrouped_product(w2t, g.reshape(n, o, ho * wo), out.reshape(n, c, h * wd), None, workspace, gemm,
                               native or _NUMPY)
            return
        gemm(w2t, g.reshape(n, o, ho * wo), out=out.reshape(n, c, h * wd))
        return
    ckk = c * kh * kw
    per_sample = contract.conv2d_bwd_data_scratch(g.shape, w.shape, size, stride, pad)
    if stride == 1:
        hp, wp = h + 2 * pad, wd + 2 * pad
        plane = hp * wp + kw - 1
        step = samples_per_chunk(n, workspace, per_sample)
        starts = _safe_order(range(0, n, step), over and out.nbytes > g.nbytes)
        by_rows = None
        for s in starts:
            e = min(n, s + step)
            m, rows = e - s, (e - s) * ho * wp
            scratch = Scratch(workspace)
            scheme = stride1_scheme(o, c, kh, kw, ho, wo, wp, m)
            if scheme == "columns":
                _columns_product(g[s:e], w2t, kh, kw, out[s:e], stride, pad, scratch, gemm, native or _NUMPY)
                continue
            if scheme == "kernel rows":
                # the output gradient shifted by each kernel column (kw contiguous copies), one GEMM by the
                # filters regrouped (kh*C, O*kw), then kh shifted additions instead of kh*kw
                wide = scratch.take((o, kw - 1 + rows))
                wide[:, :kw - 1] = 0
                body = wide[:, kw - 1:].reshape(o, m, ho, wp)
                np.copyto(body[..., :wo], g[s:e].transpose(1, 0, 2, 3))
                body[..., wo:] = 0
                shifted = scratch.take((o, kw, rows))
                for j in range(kw):
                    np.copyto(shifted[:, j], wide[:, kw - 1 - j:kw - 1 - j + rows])
                if by_rows is None:
                    by_rows = np.ascontiguousarray(w.transpose(2, 1, 0, 3)).reshape(kh * c, o * kw)
                partial = scratch.take((kh, c, m, ho * wp))
                gemm(by_rows, shifted.reshape(o * kw, rows), out=partial.reshape(kh * c, rows))
                offsets = [(i * wp, partial[i]) for i in range(kh)]
            else:
                wide = scratch.take((o, m, ho, wp))
                np.copyto(wide[..., :wo], g[s:e].transpose(1, 0, 2, 3))
                wide[..., wo:] = 0
                dcols = scratch.take((c, kh, kw, m, ho * wp))
                gemm(w2t, wide.reshape(o, rows), out=dcols.reshape(ckk, rows))
                offsets = [(i * wp + j, dcols[:, i, j]) for i in range(kh) for j in range(kw)]
            dxp = scratch.take((m, c, plane))
            if native is not None and native.shifted_sums(offsets, out[s:e], wp, pad):
                continue
            dxp.fill(0)
            by_channel = dxp.transpose(1, 0, 2)
            for offset, contribution in offsets:
                view = by_channel[:, :, offset:offset + ho * wp]
                np.add(view, contribution, out=view)
            np.copyto(out[s:e], dxp[:, :, :hp * wp].reshape(m, c, hp, wp)[:, :, pad:pad + h, pad:pad + wd])
        return
    step = samples_per_chunk(n, workspace, per_sample)
    if one:
        for s in _safe_order(range(0, n, step), over and out.nbytes > g.nbytes):
            e = min(n, s + step)
            _columns_product(g[s:e], w2t, kh, kw, out[s:e], stride, pad, Scratch(workspace), gemm, native or _NUMPY)
        return
    for s in range(0, n, step):
        e = min(n, s + step)
        dcols = Scratch(workspace).take((e - s, c, kh, kw, ho, wo))
        gemm(w2t, g[s:e].reshape(e - s, o, ho * wo), out=dcols.reshape(e - s, ckk, ho * wo))
        (native or _NUMPY).col2im(dcols, out[s:e], stride, pad)


def _safe_order(starts: range, backward: bool):
    """The chunks' starts in the order that writes an input gradient taking over its output gradient's bytes behind
    the samples not yet read, for chunks that copy their output gradient before writing: forward where a sample's
    input gradient is no larger than its output gradient, else `backward`."""
    return reversed(starts) if backward else starts


def _columns_product(g, w2t, kh, kw, out, stride, pad, scratch, gemm, passes) -> None:
    """out (samples, C, H, W) = col2im of the column gradients of the output gradient `g` (samples, O, Ho, Wo) by the
    filters `w2t` (C*kh*kw, O), in one product: g regrouped to (O, samples*Ho*Wo) in scratch, the column gradients
    (C*kh*kw, samples*Ho*Wo) after it, then col2im."""
    m, o, ho, wo = g.shape
    c = out.shape[1]
    gt = scratch.take((o, m, ho * wo))
    passes.swap01(g.reshape(m, o, ho * wo), gt)
    dcols = scratch.take((c, kh, kw, m, ho, wo))
    gemm(w2t, gt.reshape(o, m * ho * wo), out=dcols.reshape(c * kh * kw, m * ho * wo))
    passes.col2im(dcols.transpose(3, 0, 1, 2, 4, 5), out, stride, pad)


def _grouped_conv2d_bwd_data(g, w, out, stride, pad, size, groups, workspace, passes):
    """conv2d_bwd_data of `groups` groups, any stride: per chunk of samples the column gradients (samples, C*kh*kw,
    Ho*Wo) in one stacked product, group k's filters transposed (C/groups*kh*kw, O/groups) by group k's output
    gradient of each sample, then col2im. Pointwise: the product straight into the input gradient. An `out` taking
    over the bytes of `g` runs sample chunks in a safe order (`over_samples`)."""
    if takes_over(g, out):
        return over_samples(lambda s, e, gs, os, ws: _grouped_conv2d_bwd_data(gs, w, os, stride, pad, size, groups,
                                                                              ws, passes), g, out, workspace,
                           passes)
    n, o, ho, wo = g.shape
    _, ci, kh, kw = w.shape
    c, co, hw = ci * groups, o // groups, ho * wo
    if _depthwise(passes, "conv2d_bwd_data", g, w, None, out, stride, pad, groups):
        return
    filters = w.reshape(groups, co, ci * kh * kw).transpose(0, 2, 1)
    if contract.pointwise_conv(kh, kw, stride, pad):
        passes.gemm(filters, g.reshape(n, groups, co, hw), out=out.reshape(n, groups, ci, size[0] * size[1]))
        return
    step = samples_per_chunk(n, workspace, contract.conv2d_bwd_data_scratch(g.shape, w.shape, size, stride, pad,
                                                                            groups))
    for s in range(0, n, step):
        e = min(n, s + step)
        dcols = Scratch(workspace).take((e - s, c, kh, kw, ho, wo))
        passes.gemm(filters, g[s:e].reshape(e - s, groups, co, hw), out=dcols.reshape(e - s, groups, ci * kh * kw, hw))
        passes.col2im(dcols, out[s:e], stride, pad)


def conv2d_bwd_filter(g, x, *, out, stride, pad, kernel, groups=1, workspace=None, gemm=np.matmul, native=None):
    """Gradient of conv2d with respect to its weights: G im2col(X)^T, one GEMM over all samples of a chunk.

    Workspace per sample: its im2col matrix (C*kh*kw, Ho*Wo), its gradient transposed to (O, Ho*Wo) and with
    padding the zero-padded input; plus an accumulator of the weights' size when the batch runs in several chunks.
    With `groups` the product is stacked: group k's output gradient (O/groups, samples*Ho*Wo) by group k's rows of
    the im2col matrix, transposed. With `native`, a thin pointwise convolution's (`contract.pointwise_filter`) runs
    straight from its operands, another pointwise one's on large planes (`contract.filter_by_samples`) as a sum of
    products by samples, and another thin one's (`contract.direct_conv`) straight from the input, all without
    workspace, a blocked one's (`_blocked`) on channel-blocked copies, and a thin one of any stride's
    (`contract.thin_filter`: a first layer's) from the padded input and the blocked output gradient."""
    n, o, ho, wo = g.shape
    c, h, wd = x.shape[1:]
    kh, kw = kernel
    ckk = c * kh * kw
    if native is not None and contract.pointwise_filter(c, o, ho * wo, kh, kw, stride, pad, groups) and \
            native.pointwise_filter(g, x, out):
        return
    if native is not None and contract.filter_by_samples(kh, kw, stride, pad, ho * wo, groups) and \
            _contiguous32(g, x, out) and \
            native.gemm_sum(g.reshape(n, o, ho * wo), x.reshape(n, c, h * wd).transpose(0, 2, 1), out.reshape(o, c)):
        return
    if native is not None and native.direct("conv2d_bwd_filter", g, x, None, out, stride, pad):
        return
    if groups == 1 and _blocked("conv2d_bwd_filter", g, x, None, out, stride, pad, workspace, native):
        return
    if native is not None and _thin_filter(g, x, out, stride, pad, workspace, native):
        return
    if groups > 1:
        if _depthwise(native, "conv2d_bwd_filter", g, x, None, out, stride, pad, groups):
            return
        weights, gemm = (groups, o // groups, ckk // groups), (native or _NUMPY).gemm
    else:
        weights = (o, ckk)
    out2 = out.reshape(weights)
    per_sample, accumulator = contract.conv2d_bwd_filter_scratch(g.shape, x.shape, kernel, pad, groups)
    step = samples_per_chunk(n, workspace, per_sample, fixed_if_split=accumulator)
    acc = Scratch(workspace).take(weights) if step < n else None
    start = acc.size if acc is not None and workspace is not None else 0
    for s in range(0, n, step):
        e = min(n, s + step)
        scratch = Scratch(workspace, start)
        cols = scratch.take((c, kh, kw, e - s, ho, wo))
        gt = scratch.take((o, e - s, ho, wo))
        passes = native or _NUMPY
        passes.im2col(x[s:e], cols.transpose(3, 0, 1, 2, 4, 5), stride, pad, scratch)
        passes.swap01(g[s:e], gt)
        if groups == 1 and _transposed_filter_product(ckk, (e - s) * ho * wo):
            # the chunk's gradient transposed, (C*kh*kw, O): the product in this orientation runs faster. Into the
            # accumulator, or for a single chunk into the output's own bytes, moved to the then dead transposed
            # output gradient (as large as O x the chunk's positions, at least C*kh*kw of them) and back transposed
            by_rows = acc.reshape(ckk, o) if acc is not None else out2.reshape(ckk, o)
            gemm(cols.reshape(ckk, -1), gt.reshape(o, -1).T, out=by_rows)
            if acc is None:
                dead = gt.reshape(-1)[:ckk * o].reshape(ckk, o)
                copy(by_rows, dead, native)
                by_rows = dead
            if s:
                np.add(out2, by_rows.T, out=out2)
            else:
                passes.swap01(by_rows.reshape(ckk, o, 1), out2.reshape(o, ckk, 1))
            continue
        target = out2 if s == 0 else acc
        if groups > 1:
            gemm(gt.reshape(groups, o // groups, -1), cols.reshape(groups, ckk // groups, -1).transpose(0, 2, 1),
                 out=target)
        else:
            gemm(gt.reshape(o, -1), cols.reshape(ckk, -1).T, out=target)
        if s and (native is None or not native.accumulate(acc, out2)):
            np.add(out2, acc, out=out2)


def _transposed_filter_product(ckk: int, columns: int) -> bool:
    """Whether a filter gradient's product over `columns` output positions runs as (C*kh*kw, O) = im2col x G^T
    rather than (O, C*kh*kw) = G x im2col^T: measured here with OpenBLAS, 4-50 % faster where the positions are
    many against the filter's rows (the transposition back then costs little): at least 4 per row. (LeNet's second
    layer at batch 64, (500 x 4096) by (4096 x 50), on an AVX-512 processor: 2.17 ms against 2.58 at one thread,
    1.08 against 1.35 at two.)"""
    return columns >= 4 * ckk
