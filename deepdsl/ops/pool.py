"""Max and average pooling. Max pooling's backward reads only the argmax of each window (one byte per output
element), so the pooled input can be freed as soon as the forward pass is done with it."""
from __future__ import annotations

import numpy as np

from deepdsl.ir import FLOAT, UINT8, Node, make
from deepdsl.ops import Op, dims, register, require, scratch_chunks
from deepdsl_runtime import contract
from deepdsl_runtime.contract import avg_pool_divisor, out_size


def _geometry(shape, kernel, stride, pad, ceil):
    n, c, h, w = shape
    ho, wo = out_size(h, kernel, stride, pad, ceil), out_size(w, kernel, stride, pad, ceil)
    return n, c, h, w, ho, wo


def _padded_windows(x: np.ndarray, kernel, stride, pad, ceil, fill):
    n, c, h, w, ho, wo = _geometry(x.shape, kernel, stride, pad, ceil)
    hp, wp = (ho - 1) * stride + kernel, (wo - 1) * stride + kernel
    padded = np.full((n, c, max(hp, h + pad), max(wp, w + pad)), fill, dtype=x.dtype)
    padded[:, :, pad:pad + h, pad:pad + w] = x
    view = np.lib.stride_tricks.sliding_window_view(padded[:, :, :hp, :wp], (kernel, kernel), axis=(2, 3))
    return view[:, :, ::stride, ::stride]          # (N, C, Ho, Wo, k, k)


def _scatter_windows(values: np.ndarray, shape, kernel, stride, pad, ceil) -> np.ndarray:
    """Adjoint of `_padded_windows`: add (N,C,Ho,Wo,k,k) window values back into an (N,C,H,W) tensor."""
    n, c, h, w, ho, wo = _geometry(shape, kernel, stride, pad, ceil)
    hp, wp = max((ho - 1) * stride + kernel, h + pad), max((wo - 1) * stride + kernel, w + pad)
    padded = np.zeros((n, c, hp, wp), dtype=values.dtype)
    for i in range(kernel):
        for j in range(kernel):
            padded[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride] += values[..., i, j]
    return padded[:, :, pad:pad + h, pad:pad + w]


class _Pool(Op):
    scratch = staticmethod(contract.max_pool_scratch)     # the CPU kernel's scratch per sample, in float32 elements

    def workspace(self, node, limit=None):
        """The scratch of the whole batch, or of the chunks of samples it runs in to stay within `limit` (the
        kernels work sample by sample; the CPU runtime derives the chunk from the workspace it is given)."""
        per_sample = self.scratch(node.inputs[0].shape, node.shape, node.attr("kernel"), node.attr("stride"),
                                  node.attr("pad", 0))
        return scratch_chunks(node.shape[0], per_sample, limit)

    def flops(self, node):
        """One comparison or addition per element of each window."""
        return node.size * node.attr("kernel") ** 2

    def infer(self, x: Node, *, kernel, stride, pad=0, ceil=False, **_):
        require(len(x.shape) == 4, f"pooling input must be 4-D (N,C,H,W), got {dims(x.shape)}")
        require(kernel >= 1 and stride >= 1, f"pooling window {kernel} and stride {stride} must be >= 1")
        require(kernel <= x.shape[2] + 2 * pad and kernel <= x.shape[3] + 2 * pad,
                f"pooling window {kernel}x{kernel} is larger than its input {x.shape[2]}x{x.shape[3]}")
        require(pad <= kernel // 2, f"pooling padding {pad} exceeds half the window {kernel}")
        *_, ho, wo = _geometry(x.shape, kernel, stride, pad, ceil)
        return (x.shape[0], x.shape[1], ho, wo), FLOAT


@register
class MaxPool(_Pool):
    name = "max_pool"
    takes_over = 0            # the pooled output may take over its dying input's storage
    cheap = True

    def vjp(self, node, g):
        x = node.inputs[0]
        argmax = make("max_pool_argmax", (x,), **node.kwargs)
        return (make("max_pool_bwd", (g, argmax), size=x.shape[2:], **node.kwargs),)

    def evaluate(self, ctx, x, *, kernel, stride, pad=0, ceil=False):
        return _padded_windows(x, kernel, stride, pad, ceil, -np.inf).max(axis=(4, 5))


@register
class MaxPoolArgmax(_Pool):
    """Position (row * kernel + column) of the first maximum in each pooling window."""

    name = "max_pool_argmax"

    def infer(self, x, **attrs):
        require(attrs["kernel"] ** 2 <= 256, "max pooling window larger than 16x16")
        shape, _ = super().infer(x, **attrs)
        return shape, UINT8

    def evaluate(self, ctx, x, *, kernel, stride, pad=0, ceil=False):
        win = _padded_windows(x, kernel, stride, pad, ceil, -np.inf)
        return win.reshape(*win.shape[:4], kernel * kernel).argmax(axis=4).astype(np.uint8)

    scratch = staticmethod(contract.max_pool_argmax_scratch)


@register
class MaxPoolBwd(Op):
    name = "max_pool_bwd"
    takes_over = 0            # the input gradient may grow over the dying output gradient's storage

    def infer(self, g, argmax, *, kernel, stride, pad=0, ceil=False, size):
        require(g.shape == argmax.shape, "max_pool_bwd: gradient and argmax shapes differ")
        return g.shape[:2] + tuple(size), FLOAT

    def evaluate(self, ctx, g, argmax, *, kernel, stride, pad=0, ceil=False, size):
        onehot = argmax[..., None] == np.arange(kernel * kernel)
        values = (g[..., None] * onehot).reshape(*g.shape, kernel, kernel)
        return _scatter_windows(values, g.shape[:2] + tuple(size), kernel, stride, pad, ceil).astype(ctx.float_dtype)

    def flops(self, node):
        return node.inputs[0].size * node.attr("kernel") ** 2

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.max_pool_bwd_scratch`: a padded gradient buffer when windows leave
        the input, a boolean 'hit' mask and, when windows overlap, each window offset's share) for the whole
        batch, or its chunks' within `limit`."""
        g = node.inputs[0]
        per_sample = contract.max_pool_bwd_scratch(g.shape, node.shape, node.attr("kernel"), node.attr("stride"),
                                                   node.attr("pad", 0))
        return scratch_chunks(node.shape[0], per_sample, limit)


@register
class AvgPool(_Pool):
    name = "avg_pool"
    takes_over = 0
    cheap = True
    scratch = staticmethod(contract.avg_pool_scratch)

    def vjp(self, node, g):
        x = node.inputs[0]
        return (make("avg_pool_bwd", (g,), size=x.shape[2:], **node.kwargs),)

    def evaluate(self, ctx, x, *, kernel, stride, pad=0, ceil=False, include_pad=True):
        total = _padded_windows(x, kernel, stride, pad, ceil, 0.0).sum(axis=(4, 5))
        return (total / avg_pool_divisor(x.shape[2:], kernel, stride, pad, ceil, include_pad)).astype(ctx.float_dtype)


@register
class AvgPoolBwd(Op):
    name = "avg_pool_bwd"
    takes_over = 0

    def infer(self, g, *, kernel, stride, pad=0, ceil=False, include_pad=True, size):
        return g.shape[:2] + tuple(size), FLOAT

    def evaluate(self, ctx, g, *, kernel, stride, pad=0, ceil=False, include_pad=True, size):
        share = g / avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad)
        values = np.broadcast_to(share[..., None, None], g.shape + (kernel, kernel))
        return _scatter_windows(values, g.shape[:2] + tuple(size), kernel, stride, pad, ceil).astype(ctx.float_dtype)

    def flops(self, node):
        return node.inputs[0].size * node.attr("kernel") ** 2

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.avg_pool_bwd_scratch`: a padded gradient buffer when windows leave
        the input, and each window's share) for the whole batch, or its chunks' within `limit`."""
        g = node.inputs[0]
        per_sample = contract.avg_pool_bwd_scratch(g.shape, node.shape, node.attr("kernel"), node.attr("stride"),
                                                   node.attr("pad", 0))
        return scratch_chunks(node.shape[0], per_sample, limit)
