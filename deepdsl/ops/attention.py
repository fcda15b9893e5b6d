"""Scaled dot-product attention as one op, and its gradient as one op.

`attention(q, k, v[, bias])` is softmax(q k^T * scale + bias) v over the last two axes of queries (..., T, d), keys
(..., S, d) and values (..., S, e), the leading axes (batch, heads) one *unit* each; `causal`: query i weighs keys
0..i only. `bias` (optional) broadcasts to the scores (..., T, S): a padding mask arrives as a bias of 0 or the
most negative float (`D.attention`). Its CPU kernels weigh a block of `contract.attention_rows` queries of as
many units as the workspace holds against all the keys at a time, its CUDA kernels a query per thread, so the (T,
S) weights exist only inside a statement, never between the forward and the backward: the memory plan keeps q, k,
v and the output, not the weights (as FlashAttention, Dao et al. 2022, keeps them out of memory).

`attention_grad(q, k, v, o, g[, bias])` is the three gradients at once, packed one after the other in one flat
tensor (dq, then dk, then dv; the VJP takes them out with `slice`): its kernels recompute each block's weights,
and use the row sums dO . O (the softmax's backward needs nothing else of the forward). A bias that needs a
gradient gets it from the same formula written with ordinary ops (it needs the (T, S) gradient of the scores).
"""
from __future__ import annotations

import math

import numpy as np

from deepdsl.ir import FLOAT, Node, make
from deepdsl.ops import Op, dims, register, require, scratch_chunks
from deepdsl.ops.elementwise import broadcasts_to, elementwise, reshape, sum_to, sym
from deepdsl.ops.linalg import matmul
from deepdsl.ops.shape import slice_axis
from deepdsl_runtime import contract


def _check(q: Node, k: Node, v: Node, bias: tuple[Node, ...], causal: bool) -> None:
    require(len(q.shape) >= 2 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1]
            and k.shape[-2] == v.shape[-2],
            f"attention of q {dims(q.shape)}, k {dims(k.shape)}, v {dims(v.shape)}: needs (..., T, d), (..., S, d) "
            "and (..., S, e)")
    require(not causal or q.shape[-2] == k.shape[-2],
            f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")
    scores = (*q.shape[:-1], k.shape[-2])
    for b in bias:
        require(len(b.shape) == len(scores) and b.dtype == FLOAT and broadcasts_to(b.shape, scores),
                f"attention bias of {dims(b.shape)} does not broadcast to the scores' {dims(scores)}")


def units(q_shape) -> int:
    """The number of (T, d) query blocks: the product of the leading axes."""
    return math.prod(q_shape[:-2])


@register
class Attention(Op):
    name = "attention"

    def infer(self, q: Node, k: Node, v: Node, *bias: Node, causal=False, scale):
        _check(q, k, v, bias, causal)
        require(len(bias) <= 1, "attention takes one bias at most")
        return (*q.shape[:-1], v.shape[-1]), FLOAT

    def vjp(self, node, g):
        q, k, v, *bias = node.inputs
        packed = make("attention_grad", (q, k, v, node, g, *bias), **node.kwargs)
        grads, start = [], 0
        for x in (q, k, v):
            grads.append(reshape(slice_axis(packed, 0, start, start + x.size), x.shape))
            start += x.size
        return (*grads, *(_bias_grad(node, g) for _ in bias))

    def evaluate(self, ctx, q, k, v, *bias, causal=False, scale):
        return np.asarray(_weights(q, k, bias, causal, scale) @ v, dtype=ctx.float_dtype)

    def workspace(self, node, limit=None):
        """The CPU kernels' scratch: the weights of a block of queries per unit (`contract.attention_scratch`), or
        units' chunks' within `limit` (the CUDA kernel needs none)."""
        q, k = node.inputs[:2]
        return scratch_chunks(units(q.shape), contract.attention_scratch(q.shape[-2], k.shape[-2]), limit)

    def flops(self, node):
        q, k, v = node.inputs[:3]
        return 2 * units(q.shape) * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


@register
class AttentionGrad(Op):
    name = "attention_grad"

    def infer(self, q: Node, k: Node, v: Node, o: Node, g: Node, *bias: Node, causal=False, scale):
        _check(q, k, v, bias, causal)
        out = (*q.shape[:-1], v.shape[-1])
        require(o.shape == out and g.shape == out, f"attention_grad of an output {dims(o.shape)} and its gradient "
                f"{dims(g.shape)}: both must be {dims(out)}")
        return (q.size + k.size + v.size,), FLOAT

    def evaluate(self, ctx, q, k, v, o, g, *bias, causal=False, scale):
        p = _weights(q, k, bias, causal, scale)
        dv = p.swapaxes(-1, -2) @ g
        ds = p * (g @ v.swapaxes(-1, -2) - (g * o).sum(-1, keepdims=True)) * scale
        dq, dk = ds @ k, ds.swapaxes(-1, -2) @ q
        return np.concatenate([dq.ravel(), dk.ravel(), dv.ravel()]).astype(ctx.float_dtype)

    def workspace(self, node, limit=None):
        """The CPU kernels' scratch: a block's weights and their gradient, the keys' and values' gradients of a
        block and the row sums dO . O per unit (`contract.attention_grad_scratch`); the CUDA kernels use a unit's
        row statistics' part."""
        q, k, v = node.inputs[:3]
        per_unit = contract.attention_grad_scratch(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1])
        return scratch_chunks(units(q.shape), per_unit, limit)

    def flops(self, node):
        q, k, v = node.inputs[:3]
        return 2 * units(q.shape) * q.shape[-2] * k.shape[-2] * (3 * q.shape[-1] + 2 * v.shape[-1])


def _weights(q, k, bias, causal, scale) -> np.ndarray:
    """softmax(q k^T * scale + bias) with query i weighing keys 0..i only when causal (the reference)."""
    s = (q @ k.swapaxes(-1, -2)) * scale
    for b in bias:
        s = s + b
    if causal:
        t = s.shape[-1]
        s = np.where(np.triu(np.ones((t, t), dtype=bool), 1), -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    return e / e.sum(axis=-1, keepdims=True)


def _bias_grad(node: Node, g: Node) -> Node:
    """The gradient of attention's bias, written with ordinary ops: dS = P * (g v^T - rowsum(g * o)), summed to
    the bias's shape (P recomputed as the softmax of the scores)."""
    q, k, v, bias = node.inputs
    scale, causal = node.attr("scale"), node.attr("causal", False)
    scores = elementwise(sym(0) * scale + sym(1), [matmul(q, k, tb=True), bias])
    rows = reshape(scores, (math.prod(scores.shape[:-1]), scores.shape[-1]))
    p = reshape(make("softmax", (rows,), **({"causal": True} if causal else {})), scores.shape)
    dot = sum_to(elementwise(sym(0) * sym(1), [g, node]), (*g.shape[:-1], 1))
    ds = elementwise(sym(0) * (sym(1) - sym(2)), [p, matmul(g, v, tb=True), dot])
    return sum_to(ds, bias.shape)


def attention(q: Node, k: Node, v: Node, bias: Node | None, *, causal: bool, scale: float) -> Node:
    """The attention node of q, k, v (and a bias)."""
    attrs = {"scale": float(scale), **({"causal": True} if causal else {})}
    return make("attention", (q, k, v) + ((bias,) if bias is not None else ()), **attrs)
