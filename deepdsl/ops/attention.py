"""Scaled dot-product attention as one op, and its gradient as one op.

`attention(q, k, v[, bias])` is softmax(q k^T * scale + bias) v over the last two axes of queries (..., T, d), keys
(..., S, d) and values (..., S, e), the leading axes (batch, heads) one *unit* each; `causal`: query i weighs keys
0..i only. `bias` (optional) broadcasts to the scores (..., T, S): a padding mask arrives as a bias of 0 or the
most negative float (`D.attention`). Its CPU kernels weigh a block of `contract.attention_rows` queries of as
many units as the workspace holds against all the keys at a time, its CUDA kernels a query per thread, so the (T,
S) weights exist only inside a statement, never between the forward and the backward: the memory plan keeps q, k,
v and the output, not the weights (as FlashAttention, Dao et al. 2022, keeps them out of memory).

Dropout of the weights: as written (`D.attention(dropout=p)`) the node has attributes `dropout` (p) and `key` (its
mask's stream, as the `dropout` op's); the `specialize` pass leaves them out when testing, and when training gives
the node its mask as a last input, a `bernoulli` 0/1 mask of the scores' shape (uint8: a quarter of the weights'
bytes), and the attribute `keep` (1 - p): the output is (P * mask / keep) v. The mask is the one value of the
(T, S) shape kept for the backward, and the rematerialization pass can draw it again instead.

With the attribute `heads` (set by `passes.fold_transposes`), q, k, v and the output are stored (..., T, H, d), a
projection's output reshaped, rather than (..., H, T, d): the units are (..., H) and a unit's rows lie H * d apart,
which the kernels read and write in place of the transposes around the op; the bias and the mask keep the scores'
(..., H, T, S) shape, and the gradients come packed in the operands' own layout.

`attention_grad(q, k, v, o, g[, bias][, mask])` is the three gradients at once, packed one after the other in one
flat tensor (dq, then dk, then dv; the VJP takes them out with `slice`): its kernels recompute each block's weights,
and use the row sums dO . O (the softmax's backward needs nothing else of the forward; with dropout too, O being
the product of the kept weights). A bias that needs a gradient gets it from the same formula written with ordinary
ops (it needs the (T, S) gradient of the scores).
"""
from __future__ import annotations

import math

import numpy as np
import sympy

from deepdsl.ir import FLOAT, UINT8, Node, make
from deepdsl.ops import Op, dims, register, require, scratch_chunks
from deepdsl.ops.elementwise import broadcasts_to, elementwise, reshape, sum_to, sym
from deepdsl.ops.linalg import matmul
from deepdsl.ops.shape import slice_axis, transpose
from deepdsl_runtime import contract


def split(inputs: tuple, keep) -> tuple[tuple, tuple, tuple]:
    """(q, k, v), the bias (none or one) and the dropout mask (none or one, present when `keep` is) of the inputs
    of an attention node, or of the inputs after the output and its gradient of an attention_grad node."""
    rest = inputs[3:]
    return inputs[:3], (rest[:-1] if keep is not None else rest), (rest[-1:] if keep is not None else ())


def unit_shape(shape: tuple[int, ...], heads: bool) -> tuple[int, ...]:
    """The (..., T, d) shape of the units' rows of an operand of attention (`contract.attention_unit_shape`), with
    `heads` one of at least three axes."""
    require(not heads or len(shape) >= 3,
            f"attention with its heads after the tokens needs (..., T, H, d), got {dims(shape)}")
    return contract.attention_unit_shape(shape, heads)


def swap_heads(x: Node) -> Node:
    """x with its heads' and tokens' axes (the last but one and the one before) swapped."""
    return transpose(x, len(x.shape) - 3, len(x.shape) - 2)


def _check(q_shape, k_shape, v_shape, bias: tuple[Node, ...], causal: bool, mask: tuple[Node, ...] = (),
           keep=None, dropout=None, key=None) -> None:
    """The operands of attention, given the units' shapes of q, k and v (`unit_shape`)."""
    require(len(q_shape) >= 2 and q_shape[:-2] == k_shape[:-2] == v_shape[:-2] and q_shape[-1] == k_shape[-1]
            and k_shape[-2] == v_shape[-2],
            f"attention of q {dims(q_shape)}, k {dims(k_shape)}, v {dims(v_shape)}: needs (..., T, d), (..., S, d) "
            "and (..., S, e)")
    require(not causal or q_shape[-2] == k_shape[-2],
            f"causal attention needs as many queries as keys, got {q_shape[-2]} and {k_shape[-2]}")
    scores = (*q_shape[:-1], k_shape[-2])
    for b in bias:
        require(len(b.shape) == len(scores) and b.dtype == FLOAT and broadcasts_to(b.shape, scores),
                f"attention bias of {dims(b.shape)} does not broadcast to the scores' {dims(scores)}")
    require(len(bias) <= 1, "attention takes one bias at most")
    for m in mask:
        require(m.shape == scores and m.dtype == UINT8, f"attention's dropout mask of {dims(m.shape)} {m.dtype}: "
                f"needs the scores' shape {dims(scores)}, uint8")
    require(keep is None or 0.0 < keep <= 1.0, f"attention keeps a weight with probability {keep}: not in (0, 1]")
    require(dropout is None or (0.0 <= dropout < 1.0 and key is not None and keep is None),
            f"attention's dropout {dropout} (key {key}): a ratio in [0, 1) with a key, before the mask is drawn")


def units(q_shape) -> int:
    """The number of (T, d) query blocks: the product of the leading axes."""
    return math.prod(q_shape[:-2])


def _unit_shapes(q: Node, k: Node, v: Node, heads: bool):
    return unit_shape(q.shape, heads), unit_shape(k.shape, heads), unit_shape(v.shape, heads)


def _units_of(x: np.ndarray, heads: bool) -> np.ndarray:
    """An operand's values as (..., T, d) units (a view)."""
    return x.swapaxes(-3, -2) if heads else x


@register
class Attention(Op):
    """With `heads`, q, k and v are stored (..., T, H, d) and the output (..., T, H, e): a projection's output
    reshaped, read and written in place of the transposes to (..., H, T, d) and back (`passes.fold_transposes`)."""
    name = "attention"

    def infer(self, q: Node, k: Node, v: Node, *rest: Node, causal=False, scale, keep=None, dropout=None, key=None,
              heads=False):
        _, bias, mask = split((q, k, v, *rest), keep)
        qs, ks, vs = _unit_shapes(q, k, v, heads)
        _check(qs, ks, vs, bias, causal, mask, keep, dropout, key)
        return (*q.shape[:-1], v.shape[-1]), FLOAT

    def vjp(self, node, g):
        require(node.attr("dropout") is None, "attention with an undrawn dropout has no gradient: specialize it")
        (q, k, v), bias, mask = split(node.inputs, node.attr("keep"))
        packed = make("attention_grad", (q, k, v, node, g, *bias, *mask), **node.kwargs)
        grads, start = [], 0
        for x in (q, k, v):
            grads.append(reshape(slice_axis(packed, 0, start, start + x.size), x.shape))
            start += x.size
        return (*grads, *(_bias_grad(node, g) for _ in bias), *(None for _ in mask))

    def evaluate(self, ctx, q, k, v, *rest, causal=False, scale, keep=None, heads=False):
        _, bias, mask = split((q, k, v, *rest), keep)
        q, k, v = (_units_of(x, heads) for x in (q, k, v))
        out = _kept(_weights(q, k, bias, causal, scale), mask, keep) @ v
        return np.ascontiguousarray(_units_of(out, heads), dtype=ctx.float_dtype)

    def workspace(self, node, limit=None):
        """The CPU kernels' scratch: the weights of a block of queries per unit (`contract.attention_scratch`), or
        units' chunks' within `limit` (the CUDA kernel needs none)."""
        q, k, _ = _unit_shapes(*node.inputs[:3], node.attr("heads", False))
        return scratch_chunks(units(q), contract.attention_scratch(q[-2], k[-2]), limit)

    def flops(self, node):
        q, k, v = _unit_shapes(*node.inputs[:3], node.attr("heads", False))
        return 2 * units(q) * q[-2] * k[-2] * (q[-1] + v[-1])


@register
class AttentionGrad(Op):
    name = "attention_grad"

    def infer(self, q: Node, k: Node, v: Node, o: Node, g: Node, *rest: Node, causal=False, scale, keep=None,
              heads=False):
        _, bias, mask = split((q, k, v, *rest), keep)
        _check(*_unit_shapes(q, k, v, heads), bias, causal, mask, keep)
        out = (*q.shape[:-1], v.shape[-1])
        require(o.shape == out and g.shape == out, f"attention_grad of an output {dims(o.shape)} and its gradient "
                f"{dims(g.shape)}: both must be {dims(out)}")
        return (q.size + k.size + v.size,), FLOAT

    def evaluate(self, ctx, q, k, v, o, g, *rest, causal=False, scale, keep=None, heads=False):
        _, bias, mask = split((q, k, v, *rest), keep)
        q, k, v, o, g = (_units_of(x, heads) for x in (q, k, v, o, g))
        p = _weights(q, k, bias, causal, scale)
        dv = _kept(p, mask, keep).swapaxes(-1, -2) @ g
        ds = p * (_kept(g @ v.swapaxes(-1, -2), mask, keep) - (g * o).sum(-1, keepdims=True)) * scale
        dq, dk = ds @ k, ds.swapaxes(-1, -2) @ q
        return np.concatenate([np.ascontiguousarray(_units_of(x, heads)).ravel() for x in (dq, dk, dv)]).astype(
            ctx.float_dtype)

    def workspace(self, node, limit=None):
        """The CPU kernels' scratch: a block's weights and their gradient (and the weights kept, with dropout),
        the keys' and values' gradients of a block and the row sums dO . O per unit
        (`contract.attention_grad_scratch`); the CUDA kernels use a unit's row statistics' part."""
        q, k, v = _unit_shapes(*node.inputs[:3], node.attr("heads", False))
        per_unit = contract.attention_grad_scratch(q[-2], k[-2], q[-1], v[-1], node.attr("keep") is not None)
        return scratch_chunks(units(q), per_unit, limit)

    def flops(self, node):
        q, k, v = _unit_shapes(*node.inputs[:3], node.attr("heads", False))
        return 2 * units(q) * q[-2] * k[-2] * (3 * q[-1] + 2 * v[-1])


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


def _kept(p: np.ndarray, mask: tuple, keep) -> np.ndarray:
    """p * mask / keep: dropout's weights (p itself without a mask)."""
    return p * mask[0] / keep if mask else p


def _bias_grad(node: Node, g: Node) -> Node:
    """The gradient of attention's bias, written with ordinary ops: dS = P * (g v^T [* mask / keep] - rowsum(g *
    o)), summed to the bias's shape (P recomputed as the softmax of the scores)."""
    keep = node.attr("keep")
    (q, k, v), (bias,), mask = split(node.inputs, keep)
    scale, causal = node.attr("scale"), node.attr("causal", False)
    if node.attr("heads", False):               # the units' (..., H, T, d) operands
        q, k, v, g, node = (swap_heads(x) for x in (q, k, v, g, node))
    scores = elementwise(sym(0) * scale + sym(1), [matmul(q, k, tb=True), bias])
    rows = reshape(scores, (math.prod(scores.shape[:-1]), scores.shape[-1]))
    p = reshape(make("softmax", (rows,), **({"causal": True} if causal else {})), scores.shape)
    dot = sum_to(elementwise(sym(0) * sym(1), [g, node]), (*g.shape[:-1], 1))
    dp = matmul(g, v, tb=True)
    if mask:
        dp = elementwise(sym(0) * sym(1) / sympy.Float(keep), [dp, mask[0]])
    ds = elementwise(sym(0) * (sym(1) - sym(2)), [p, dp, dot])
    return sum_to(ds, bias.shape)


def attention(q: Node, k: Node, v: Node, bias: Node | None, *, causal: bool, scale: float, dropout: float = 0.0,
              key: int | None = None) -> Node:
    """The attention node of q, k, v (and a bias; with dropout of the weights while training, `key` naming its
    mask's stream)."""
    attrs = {"scale": float(scale), **({"causal": True} if causal else {}),
             **({"dropout": float(dropout), "key": key} if dropout else {})}
    return make("attention", (q, k, v) + ((bias,) if bias is not None else ()), **attrs)


def drawn(node: Node, mode: str) -> Node:
    """An attention node written with `dropout` as the step of `mode` computes it: the weights all kept when
    testing; when training, a `bernoulli` mask of the scores' shape as a last input and the attribute `keep`."""
    heads = node.attr("heads", False)
    attrs = {"scale": node.attr("scale"), **({"causal": True} if node.attr("causal") else {}),
             **({"heads": True} if heads else {})}
    ratio = node.attr("dropout")
    if mode == "test" or not ratio:
        return make("attention", node.inputs, **attrs)
    keep = 1.0 - ratio
    q, k = (unit_shape(x.shape, heads) for x in node.inputs[:2])
    mask = make("bernoulli", (), shape=(*q[:-1], k[-2]), keep=keep, key=node.attr("key"))
    return make("attention", (*node.inputs, mask), **attrs, keep=keep)
