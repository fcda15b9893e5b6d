"""Normalization and regularization layers: local response normalization, layer normalization, batch normalization
and dropout.

`batch_norm` and `dropout` behave differently when training and testing; they stay as single nodes in the graph
the user builds and the `specialize` pass rewrites them for the step being compiled (batch statistics and running
statistic updates, or running statistics; a random mask, or the identity). In the accumulate step of data-parallel
training the batch statistics are sums over every rank's batch (`all_sum`).
"""
from __future__ import annotations

import numpy as np

from deepdsl.ir import FLOAT, UINT8, Node, make
from deepdsl.ops import Op, dims, register, require, scratch_chunks
from deepdsl.ops.elementwise import reshape
from deepdsl.ops.shape import slice_axis
from deepdsl_runtime import contract


def _channel_window_sum(a: np.ndarray, front: int, back: int) -> np.ndarray:
    """out[:, c] = sum of a[:, c - front : c + back + 1] (clipped at the ends), for 2-D or 4-D `a`."""
    c = a.shape[1]
    padded = np.concatenate([np.zeros_like(a[:, :1]).repeat(front, 1), a, np.zeros_like(a[:, :1]).repeat(back, 1)], 1)
    csum = np.concatenate([np.zeros_like(padded[:, :1]), np.cumsum(padded, axis=1)], 1)
    return csum[:, front + back + 1:front + back + 1 + c] - csum[:, :c]


def _lrn_scale(x, size, alpha, k):
    return k + (alpha / size) * _channel_window_sum(x * x, size // 2, (size - 1) // 2)


@register
class LRN(Op):
    """Local response normalization across channels (PyTorch's LocalResponseNorm, Caffe's ACROSS_CHANNELS):
    y_c = x_c / (k + alpha/size * sum_{window(c)} x^2)^beta."""

    name = "lrn"
    in_place = (0,)           # the scale is computed from all of x before x * scale is written
    cheap = True

    def infer(self, x: Node, *, size, alpha, beta, k):
        require(len(x.shape) in (2, 4), f"LRN input must be 2-D or 4-D, got {dims(x.shape)}")
        return x.shape, FLOAT

    def vjp(self, node, g):
        return (make("lrn_bwd", (g, node.inputs[0]), **node.kwargs),)

    def evaluate(self, ctx, x, *, size, alpha, beta, k):
        return (x * _lrn_scale(x, size, alpha, k) ** -beta).astype(ctx.float_dtype)

    def flops(self, node):
        """A square and a window sum of `size` channels per element, the power and the product."""
        return node.size * (node.attr("size") + 4)

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.lrn_scratch`: the scale and the squares); for the whole batch, or for
        the chunks of samples it runs in within `limit` (the window runs over channels, inside each sample)."""
        return scratch_chunks(node.shape[0], contract.lrn_scratch(node.shape), limit)


@register
class LRNBwd(Op):
    name = "lrn_bwd"
    in_place = (0,)           # dx may overwrite g: every read of g comes before dx = g * s^-beta - ... is written

    def infer(self, g, x, *, size, alpha, beta, k):
        require(g.shape == x.shape, "lrn_bwd: gradient and input shapes differ")
        return x.shape, FLOAT

    def evaluate(self, ctx, g, x, *, size, alpha, beta, k):
        s = _lrn_scale(x, size, alpha, k)
        inner = g * x * s ** (-beta - 1)
        # input j feeds outputs c with j in window(c), i.e. c in [j - back, j + front]
        spread = _channel_window_sum(inner, (size - 1) // 2, size // 2)
        return (g * s ** -beta - (2 * alpha * beta / size) * x * spread).astype(ctx.float_dtype)

    def flops(self, node):
        return node.size * (node.attr("size") + 8)

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.lrn_bwd_scratch`: the scale, the inner term and its window sum); for
        the whole batch, or for the chunks of samples it runs in within `limit`."""
        return scratch_chunks(node.shape[0], contract.lrn_bwd_scratch(node.shape), limit)


def _layer_norm_check(x: Node, params: tuple[Node, ...], axes: int) -> None:
    """A layer norm's input of more than `axes` axes, its parameters (weight, bias) of the last `axes` axes' shape."""
    require(isinstance(axes, int) and 0 < axes < len(x.shape),
            f"layer norm over the last {axes} axes of {dims(x.shape)}: needs fewer axes than the input has")
    require(x.dtype == FLOAT, f"layer norm of a {x.dtype} tensor")
    features = x.shape[len(x.shape) - axes:]
    for t in params:
        require(t.shape == features and t.dtype == FLOAT,
                f"layer norm parameter {t.name or t.op} of {dims(t.shape)} for features of {dims(features)}")


def _normalized(x: np.ndarray, axes: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x - mean) / sqrt(var + eps) over the last `axes` axes (the biased variance), and 1 / sqrt(var + eps)."""
    over = tuple(range(x.ndim - axes, x.ndim))
    centered = x - x.mean(axis=over, keepdims=True)
    rstd = 1.0 / np.sqrt((centered * centered).mean(axis=over, keepdims=True) + eps)
    return centered * rstd, rstd


@register
class LayerNorm(Op):
    """PyTorch's LayerNorm over the last `axes` axes, as one op: y = (x - mean) / sqrt(var + eps) * weight + bias
    (inputs x, weight, bias; or x alone, not affine). Each row (the last `axes` axes of one position) is normalized
    on its own: the compiled kernel reads a row once into the cache and writes its output, where the same layer
    written with elementwise ops and sums makes several passes over the tensor. The backward recomputes the row's
    mean and variance from x: `layer_norm_grad` (the input's gradient) and `layer_norm_param_grad` (the weight's and
    the bias's)."""

    name = "layer_norm"

    def infer(self, x: Node, *affine: Node, eps, axes):
        require(len(affine) in (0, 2), "layer norm takes a weight and a bias, or neither")
        _layer_norm_check(x, affine, axes)
        require(eps > 0, f"layer norm's eps {eps}: must be positive")
        return x.shape, FLOAT

    def vjp(self, node, g):
        x, *affine = node.inputs
        attrs = dict(eps=node.attr("eps"), axes=node.attr("axes"))
        dx = make("layer_norm_grad", (x, g, *affine[:1]), **attrs)
        if not affine:
            return (dx,)
        both = make("layer_norm_param_grad", (x, g), **attrs)
        features = affine[0].shape
        return (dx, *(reshape(slice_axis(both, 0, i, i + 1), features) for i in (0, 1)))

    def evaluate(self, ctx, x, *affine, eps, axes):
        y, _ = _normalized(x, axes, eps)
        if affine:
            y = y * affine[0] + affine[1]
        return y.astype(ctx.float_dtype)

    def flops(self, node):
        """The sums of x and of its squared deviations, the normalization and the affine map: about 8 a value."""
        return 8 * node.size


@register
class LayerNormGrad(Op):
    """The gradient of `layer_norm` with respect to its input x, given x, the output's gradient g (and the weight):
    dx = rstd (gw - mean(gw) - xhat mean(gw xhat)) per row, gw = g * weight, xhat the normalized x."""

    name = "layer_norm_grad"
    in_place = (1,)           # dx may overwrite g: the kernel reads a row of g whole before writing that row of dx

    def infer(self, x: Node, g: Node, *weight: Node, eps, axes):
        require(len(weight) <= 1, "layer_norm_grad takes the weight, or nothing")
        _layer_norm_check(x, weight, axes)
        require(g.shape == x.shape, f"layer_norm_grad of an output gradient {dims(g.shape)} for an input "
                f"{dims(x.shape)}")
        return x.shape, FLOAT

    def evaluate(self, ctx, x, g, *weight, eps, axes):
        xhat, rstd = _normalized(x, axes, eps)
        over = tuple(range(x.ndim - axes, x.ndim))
        gw = g * weight[0] if weight else g
        dx = rstd * (gw - gw.mean(axis=over, keepdims=True) - xhat * (gw * xhat).mean(axis=over, keepdims=True))
        return dx.astype(ctx.float_dtype)

    def flops(self, node):
        return 14 * node.size


@register
class LayerNormParamGrad(Op):
    """The gradients of `layer_norm`'s weight and bias, one after the other in a (2, features) tensor: the sums over
    the rows of g * xhat and of g. The compiled kernel sums fixed parts of the rows (`contract.layer_norm_parts`),
    each on one thread, then the parts in order: the sums do not depend on the thread count."""

    name = "layer_norm_param_grad"

    def infer(self, x: Node, g: Node, *, eps, axes):
        _layer_norm_check(x, (), axes)
        require(g.shape == x.shape, f"layer_norm_param_grad of an output gradient {dims(g.shape)} for an input "
                f"{dims(x.shape)}")
        return (2, contract.layer_norm_rows(x.shape, axes)[1]), FLOAT

    def evaluate(self, ctx, x, g, *, eps, axes):
        xhat, _ = _normalized(x, axes, eps)
        rows, features = contract.layer_norm_rows(x.shape, axes)
        both = np.stack([(g * xhat).reshape(rows, features).sum(0), g.reshape(rows, features).sum(0)])
        return both.astype(ctx.float_dtype)

    def workspace(self, node, limit=None):
        """The CPU kernel's partial sums (`contract.layer_norm_param_scratch`); the CUDA kernel keeps each row's
        mean and 1 / std there. All rows at once: the parts are fixed by the shape."""
        x = node.inputs[0]
        rows, features = contract.layer_norm_rows(x.shape, node.attr("axes"))
        return scratch_chunks(1, contract.layer_norm_param_scratch(rows, features), None)

    def flops(self, node):
        return 10 * node.inputs[0].size


@register
class BatchNorm(Op):
    """Batch normalization over all axes but 1 (inputs: x, weight, bias, running_mean, running_var)."""

    name = "batch_norm"

    def infer(self, x, weight, bias, mean, var, *, eps, momentum):
        require(len(x.shape) in (2, 4), f"batch norm input must be 2-D or 4-D, got {dims(x.shape)}")
        c = x.shape[1]
        for t, what in ((weight, "weight"), (bias, "bias"), (mean, "running mean"), (var, "running var")):
            require(t.shape == (c,), f"batch norm {what} of shape {dims(t.shape)} for {c} channels")
        return x.shape, FLOAT


@register
class AllSum(Op):
    """The sum of `x` over the ranks of a data-parallel job (MPI): every rank gets the same total. In one process
    (and in the reference interpreter) it is `x`. Its VJP is the sum of the cotangents over the ranks: each rank's
    total feeds every rank's loss. The ranks run the same program, so they meet at each `all_sum` in order."""

    name = "all_sum"
    collective = True

    def infer(self, x: Node):
        return x.shape, x.dtype

    def vjp(self, node, g):
        return (make("all_sum", (g,)),)

    def evaluate(self, ctx, x):
        return np.array(x, copy=True)


@register
class Dropout(Op):
    """Zero each element with probability `ratio` and scale the rest by 1/(1-ratio) when training; identity when
    testing. `key` tells apart the places a dropout layer is applied, so each draws its own mask. `per_sample` (an
    attribute present only when set): one draw per example, zeroing or keeping all of it (stochastic depth, drop
    path: the mask (N, 1, ..., 1) broadcast over the example)."""

    name = "dropout"

    def infer(self, x, *, ratio, key, per_sample=False):
        require(0.0 <= ratio < 1.0, f"dropout ratio {ratio} outside [0, 1)")
        return x.shape, FLOAT


@register
class Equal(Op):
    """A 0/1 mask: 1 where `x` (tokens or floats) equals `value` (a padding mask from a padding token)."""

    name = "equal"

    def infer(self, x, *, value):
        return x.shape, UINT8

    def vjp(self, node, g):
        return (None,)

    def evaluate(self, ctx, x, *, value):
        return np.equal(x, value).astype(np.uint8)

    def flops(self, node):
        return node.size


@register
class Bernoulli(Op):
    """A random 0/1 mask, 1 with probability `keep`, drawn from (seed, step, key): reproducible from the seed."""

    name = "bernoulli"
    random = True

    def infer(self, *, shape, keep, key):
        return shape, UINT8

    def evaluate(self, ctx, *, shape, keep, key):
        return bernoulli_mask(ctx.seed, ctx.step, key, shape, keep)

    def workspace(self, node, limit=None):
        """The CPU kernel draws its float32 uniforms into the workspace (`contract.bernoulli_scratch`, mask-sized),
        or chunk by chunk of rows within `limit` (consecutive draws of one generator: the same mask)."""
        rows = node.shape[0] if node.shape else 1         # a scalar mask as one row
        return scratch_chunks(rows, contract.bernoulli_scratch(node.shape), limit)


bernoulli_mask = contract.bernoulli_mask      # the mask of dropout `key` at `step` (the contract's stream)
