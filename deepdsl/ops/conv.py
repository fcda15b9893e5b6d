"""2-D convolution (cross-correlation, PyTorch layouts: x (N,C,H,W), w (O,C/groups,kh,kw), b (O,)) and its two
backward ops. The reference semantics are im2col + GEMM, as the CPU runtime's numpy kernels compute them (its
compiled kernels compute some layers directly: `contract.direct_conv`, `contract.blocked_conv`).

`groups` (an attribute present only when above 1, PyTorch's Conv2d `groups`) splits the input and output channels
into that many consecutive groups, group k's outputs convolving group k's inputs only (depthwise: one input channel
per group). The im2col matrix is the same as without groups; each group's product takes its own rows of it."""
from __future__ import annotations

import numpy as np

from deepdsl.ir import FLOAT, Node, make
from deepdsl.ops import Op, Workspace, dims, register, require, scratch_chunks
from deepdsl.ops.elementwise import reshape, sum_to
from deepdsl_runtime import contract
from deepdsl_runtime.contract import FLOAT_BYTES, out_size


def windows(x: np.ndarray, kh: int, kw: int, stride: int, pad: int, fill: float = 0.0) -> np.ndarray:
    """(N, C, Ho, Wo, kh, kw) view of the padded input's sliding windows."""
    if pad:
        x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    view = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))
    return view[:, :, ::stride, ::stride]


def im2col(x: np.ndarray, kh: int, kw: int, stride: int, pad: int) -> np.ndarray:
    """(N*Ho*Wo, C*kh*kw) matrix of input patches."""
    win = windows(x, kh, kw, stride, pad)
    n, c, ho, wo = win.shape[:4]
    return win.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * kh * kw)


def col2im(cols: np.ndarray, shape: tuple[int, ...], kh: int, kw: int, stride: int, pad: int) -> np.ndarray:
    """Adjoint of im2col: scatter-add (N*Ho*Wo, C*kh*kw) patches into an (N,C,H,W) tensor."""
    n, c, h, w = shape
    ho, wo = out_size(h, kh, stride, pad), out_size(w, kw, stride, pad)
    cols = cols.reshape(n, ho, wo, c, kh, kw)
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=cols.dtype)
    for i in range(kh):
        for j in range(kw):
            padded[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride] += \
                cols[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return padded[:, :, pad:pad + h, pad:pad + w]


def grouping(groups: int) -> dict[str, int]:
    """The `groups` attribute of a convolution node: none for an ordinary convolution (so its IR is unchanged)."""
    return {"groups": groups} if groups > 1 else {}


def _by_group(groups: int, *arrays_and_axes):
    """For each group k, the k-th of `groups` equal slices of each (array, axis) pair along its axis."""
    for k in range(groups):
        yield [a[(slice(None),) * axis + (slice(k * (a.shape[axis] // groups), (k + 1) * (a.shape[axis] // groups)),)]
               for a, axis in arrays_and_axes]


def _with_blocked(op: str, im2col: Workspace, node: Node, x_shape, w_shape, wo: int, limit) -> Workspace:
    """A convolution's workspace: numpy's (`im2col`), or where the compiled kernels compute it on channel-blocked
    copies (`contract.blocked_conv`) and those need more, theirs: by Winograd's F(4x4, 3x3) where it takes the layer
    (`contract.winograd_conv`) and its arrays fit (`contract.winograd_samples`: `contract.winograd_scratch`'s), else
    directly (`contract.blocked_scratch`: the filters' copy once, then the operands of the samples the kernel copies
    at a time, `contract.blocked_samples`), within the larger of `limit` and numpy's workspace. Blocked copies that do
    not fit that with one sample are not planned (the kernels then take the im2col path)."""
    (o, _, kh, kw), c, batch = w_shape, x_shape[1], x_shape[0]
    stride, pad, groups = node.attr("stride", 1), node.attr("pad", 0), node.attr("groups", 1)
    room = None if limit is None else max(limit, im2col.nbytes) // FLOAT_BYTES
    if contract.winograd_conv(c, o, kh, kw, stride, pad, wo, groups, op):
        per_sample, once = contract.winograd_scratch(op, x_shape, w_shape, pad, room)
        samples = contract.winograd_samples(batch, op, x_shape, w_shape, pad, room)
        if samples:
            return _larger(im2col, FLOAT_BYTES * (once + samples * per_sample))
    if not contract.blocked_conv(c, o, kh, kw, stride, pad, wo, groups, op):
        return im2col
    return _in_chunks(im2col, *contract.blocked_scratch(op, x_shape, w_shape, pad), batch, room)


def _with_thin(im2col: Workspace, g_shape, x_shape, kernel, pad: int, limit) -> Workspace:
    """A thin layer's filter gradient's workspace (`contract.thin_filter`): numpy's (`im2col`), or the compiled
    kernels' sums and copies of the samples they take at a time (`contract.thin_filter_scratch`) where those need
    more, within the larger of `limit` and numpy's workspace (`_in_chunks`)."""
    room = None if limit is None else max(limit, im2col.nbytes) // FLOAT_BYTES
    return _in_chunks(im2col, *contract.thin_filter_scratch(g_shape, x_shape, kernel, pad), x_shape[0], room)


def _in_chunks(im2col: Workspace, per_sample: int, once: int, batch: int, room: int | None) -> Workspace:
    """The compiled kernels' workspace of `once` floats and `per_sample` floats for each of the samples they take at a
    time (`contract.blocked_samples` within `room` floats), or numpy's where that is larger; not even one sample's
    room: numpy's alone (the kernels then take the im2col path)."""
    if room is not None and room < once + per_sample:
        return im2col
    return _larger(im2col, FLOAT_BYTES * (once + contract.blocked_samples(batch, per_sample, once, room) * per_sample))


def _larger(im2col: Workspace, nbytes: int) -> Workspace:
    """numpy's workspace, or `nbytes` in the same chunks where that is more."""
    return im2col if im2col.nbytes >= nbytes else Workspace(nbytes, im2col.chunks)


@register
class Conv2d(Op):
    name = "conv2d"

    def infer(self, x: Node, w: Node, *b: Node, stride=1, pad=0, groups=1):
        require(len(x.shape) == 4, f"convolution input must be 4-D (N,C,H,W), got {dims(x.shape)}")
        require(len(w.shape) == 4, f"convolution weights must be 4-D (out,in,kh,kw), got {dims(w.shape)}")
        o, c, kh, kw = w.shape
        require(groups >= 1 and o % groups == 0, f"{o} output channels do not split into {groups} groups")
        require(x.shape[1] == c * groups, f"input has {x.shape[1]} channels, weights expect {c * groups}"
                + (f" ({groups} groups of {c})" if groups > 1 else ""))
        h, wd = x.shape[2] + 2 * pad, x.shape[3] + 2 * pad
        require(kh <= h and kw <= wd,
                f"kernel {kh}x{kw} is larger than its input {x.shape[2]}x{x.shape[3]} (padding {pad})")
        require(stride >= 1, "stride must be >= 1")
        if b:
            require(b[0].shape == (o,), f"bias of shape {dims(b[0].shape)}, expected {o}")
        n = x.shape[0]
        return (n, o, out_size(x.shape[2], kh, stride, pad), out_size(x.shape[3], kw, stride, pad)), FLOAT

    def vjp(self, node, g):
        x, w, *b = node.inputs
        s, p, k = node.attr("stride", 1), node.attr("pad", 0), grouping(node.attr("groups", 1))
        dx = make("conv2d_bwd_data", (g, w), stride=s, pad=p, size=x.shape[2:], **k)
        dw = make("conv2d_bwd_filter", (g, x), stride=s, pad=p, kernel=w.shape[2:], **k)
        if not b:
            return dx, dw
        return dx, dw, reshape(sum_to(g, (1, w.shape[0], 1, 1)), (w.shape[0],))

    def evaluate(self, ctx, x, w, *b, stride=1, pad=0, groups=1):
        if groups > 1:
            out = np.concatenate([self.evaluate(ctx, xk, wk, stride=stride, pad=pad)
                                  for xk, wk in _by_group(groups, (x, 1), (w, 0))], axis=1)
            return np.ascontiguousarray(out + b[0].reshape(1, -1, 1, 1) if b else out, dtype=ctx.float_dtype)
        n, _, h, wd = x.shape
        o, c, kh, kw = w.shape
        ho, wo = out_size(h, kh, stride, pad), out_size(wd, kw, stride, pad)
        out = im2col(x, kh, kw, stride, pad) @ w.reshape(o, -1).T
        out = out.reshape(n, ho, wo, o).transpose(0, 3, 1, 2)
        if b:
            out = out + b[0].reshape(1, o, 1, 1)
        return np.ascontiguousarray(out, dtype=ctx.float_dtype)

    def flops(self, node):
        """Two per multiply-add of the product: every output element sums C/groups x kh x kw products."""
        _, c, kh, kw = node.inputs[1].shape
        return 2 * node.size * c * kh * kw + (node.size if len(node.inputs) > 2 else 0)

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.conv2d_scratch`: the im2col matrix, on small planes room for the
        larger of it and the regrouped result, and with padding the zero-padded input; a 1x1 stride-1 convolution's
        regrouped input and result on small planes, else none) for the whole batch, or its chunks' within `limit`;
        or the compiled kernels' blocked copies where they are larger (`_with_blocked`)."""
        x, w = node.inputs[:2]
        per_sample = contract.conv2d_scratch(x.shape, w.shape, node.shape, node.attr("stride", 1), node.attr("pad", 0),
                                             node.attr("groups", 1))
        return _with_blocked(self.name, scratch_chunks(x.shape[0], per_sample, limit), node, x.shape, w.shape,
                             node.shape[3], limit)


@register
class Conv2dBwdData(Op):
    """Gradient of conv2d with respect to its input: col2im(G W)."""

    name = "conv2d_bwd_data"
    takes_over = 0            # the input gradient may take over the dying output gradient's storage (per sample)

    def infer(self, g: Node, w: Node, *, stride=1, pad=0, size, groups=1):
        require(g.shape[1] == w.shape[0], f"gradient has {g.shape[1]} channels, weights {w.shape[0]}")
        require(groups >= 1 and w.shape[0] % groups == 0, f"{w.shape[0]} channels do not split into {groups} groups")
        return (g.shape[0], w.shape[1] * groups, *size), FLOAT

    def vjp(self, node, dz):
        """Also a layer's forward (a transposed convolution, `D.conv_transpose`): it is the adjoint of conv2d(., w)
        on inputs of `size`, so its input's gradient is conv2d(dz, w) and its weights' conv2d_bwd_filter(g, dz)."""
        g, w = node.inputs
        s, p, k = node.attr("stride", 1), node.attr("pad", 0), grouping(node.attr("groups", 1))
        return (make("conv2d", (dz, w), stride=s, pad=p, **k),
                make("conv2d_bwd_filter", (g, dz), stride=s, pad=p, kernel=w.shape[2:], **k))

    def evaluate(self, ctx, g, w, *, stride=1, pad=0, size, groups=1):
        if groups > 1:
            return np.concatenate([self.evaluate(ctx, gk, wk, stride=stride, pad=pad, size=size)
                                   for gk, wk in _by_group(groups, (g, 1), (w, 0))], axis=1)
        n, o, ho, wo = g.shape
        _, c, kh, kw = w.shape
        cols = g.transpose(0, 2, 3, 1).reshape(n * ho * wo, o) @ w.reshape(o, -1)
        return np.ascontiguousarray(col2im(cols, (n, c, *size), kh, kw, stride, pad), dtype=ctx.float_dtype)

    def flops(self, node):
        """The forward product's: every output-gradient element meets C/groups x kh x kw weights."""
        _, c, kh, kw = node.inputs[1].shape
        return 2 * node.inputs[0].size * c * kh * kw

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.conv2d_bwd_data_scratch`: the column gradients, with stride 1 on
        rows as wide as the padded input, with the widened output gradient and the padded input gradient, with other
        strides on small planes after the regrouped output gradient; a 1x1 stride-1 convolution's regrouped output
        gradient and result on small planes, else none) for the whole batch, or its chunks' within `limit`; or the
        compiled kernels' blocked copies where they are larger (`_with_blocked`)."""
        g, w = node.inputs
        per_sample = contract.conv2d_bwd_data_scratch(g.shape, w.shape, node.attr("size"), node.attr("stride", 1),
                                                      node.attr("pad", 0), node.attr("groups", 1))
        return _with_blocked(self.name, scratch_chunks(g.shape[0], per_sample, limit), node, node.shape, w.shape,
                             g.shape[3], limit)


@register
class Conv2dBwdFilter(Op):
    """Gradient of conv2d with respect to its weights: G^T im2col(X)."""

    name = "conv2d_bwd_filter"

    def infer(self, g: Node, x: Node, *, stride=1, pad=0, kernel, groups=1):
        require(groups >= 1 and x.shape[1] % groups == 0 and g.shape[1] % groups == 0,
                f"{x.shape[1]} input and {g.shape[1]} output channels do not split into {groups} groups")
        return (g.shape[1], x.shape[1] // groups, *kernel), FLOAT

    def evaluate(self, ctx, g, x, *, stride=1, pad=0, kernel, groups=1):
        if groups > 1:
            return np.concatenate([self.evaluate(ctx, gk, xk, stride=stride, pad=pad, kernel=kernel)
                                   for gk, xk in _by_group(groups, (g, 1), (x, 1))], axis=0)
        n, o, ho, wo = g.shape
        kh, kw = kernel
        dw = g.transpose(1, 0, 2, 3).reshape(o, -1) @ im2col(x, kh, kw, stride, pad)
        return np.ascontiguousarray(dw.reshape(o, x.shape[1], kh, kw), dtype=ctx.float_dtype)

    def flops(self, node):
        """The forward product's: every weight sums one product per output-gradient position of its channel."""
        g = node.inputs[0]
        return 2 * node.size * g.shape[0] * g.shape[2] * g.shape[3]

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.conv2d_bwd_filter_scratch`: per sample the im2col matrix, the output
        gradient transposed and with padding the zero-padded input; an accumulator when the batch runs in more than
        one chunk) for the whole batch, or its chunks' within `limit`; or the compiled kernels' blocked copies where
        they are larger (`_with_blocked`)."""
        g, x = node.inputs
        per_sample, fixed = contract.conv2d_bwd_filter_scratch(g.shape, x.shape, node.attr("kernel"),
                                                               node.attr("pad", 0), node.attr("groups", 1))
        im2col = scratch_chunks(g.shape[0], per_sample, limit, fixed_if_split=fixed)
        (o, c, kh, kw), pad = node.shape, node.attr("pad", 0)
        if contract.thin_filter(c, o, kh, kw, node.attr("stride", 1), pad, node.attr("groups", 1)):
            return _with_thin(im2col, g.shape, x.shape, (kh, kw), pad, limit)
        return _with_blocked(self.name, im2col, node, x.shape, node.shape, g.shape[3], limit)
