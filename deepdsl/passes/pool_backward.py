"""Push elementwise factors of a max-pooling gradient through `max_pool_bwd`, onto the pooled side.

Max pooling's backward scatters each window's gradient to the position of the window's maximum; every other
position gets 0. So an elementwise product of that scatter with a function of the pooled input `r`,

    max_pool_bwd(g, argmax(r)) * f(r)   ==   max_pool_bwd(g * f(max_pool(r)), argmax(r)),

holds exactly: at a window's argmax, `r` equals the window's maximum, which is `max_pool(r)` there; elsewhere both
sides are 0; overlapping windows sum `g_w * f(max_w)` at a shared position either way. The typical `f` is the mask
of a ReLU before the pooling (`Heaviside(r)`, from the ReLU's derivative in terms of its output), often fused
with dropout or other factors.

Why: the left side reads `r` in the backward pass, so the whole pre-pooling activation (4x the pooled tensor for
2x2 windows, as much as 822 MB in VGG-16 at batch 64) must be kept from the forward pass to the backward pass; the
right side reads only `max_pool(r)`, usually kept anyway as the next layer's input, and the one-byte argmax, so `r`
dies as soon as the forward pooling ran. The factor is also applied to 1/k^2 of the elements.

Applies when the product is linear in the scatter (zero when it is zero, constant derivative in it) and every other
input is `r` itself or broadcasts along the pooled axes (scalars, per-channel tensors). Linear in the graph size.
Guarantees: same values; shapes and dtypes of graph outputs unchanged.
"""
from __future__ import annotations

import functools

import sympy

from deepdsl.ir import Graph, Node, make
from deepdsl.ops.elementwise import elementwise, sym


def push_through_pool_backward(graph: Graph) -> Graph:
    """The graph with elementwise factors of max-pooling gradients moved before `max_pool_bwd`."""
    return graph.map(_rewrite)


def _rewrite(node: Node) -> Node:
    if node.op != "ew":
        return node
    scatters = [k for k, i in enumerate(node.inputs) if i.op == "max_pool_bwd" and i.shape == node.shape
                and i.inputs[1].op == "max_pool_argmax"]
    if len(scatters) != 1:
        return node
    k = scatters[0]
    scatter = node.inputs[k]
    g, argmax = scatter.inputs
    pooled_input = argmax.inputs[0]
    if pooled_input.shape != node.shape:
        return node
    for j, other in enumerate(node.inputs):
        if j != k and other is not pooled_input and not _per_channel(other.shape, node.shape):
            return node
    factor = _factor(node.attr("expr"), k)
    if factor is None:
        return node
    pooled = make("max_pool", (pooled_input,), **argmax.kwargs)
    inputs = [g] + [pooled if i is pooled_input else i for j, i in enumerate(node.inputs) if j != k]
    names = [sym(k)] + [sym(j) for j in range(len(node.inputs)) if j != k]
    masked = elementwise(sym(k) * factor, inputs, names=names, shape=g.shape)
    return make("max_pool_bwd", (masked, argmax), **scatter.kwargs)


def _per_channel(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """Broadcasts to `full` (N, C, H, W) without varying along H and W: the same on both sides of the pooling."""
    padded = (1,) * (len(full) - len(shape)) + tuple(shape)
    return len(shape) <= len(full) and all(d in (1, f) for d, f in zip(padded, full)) and all(
        d == 1 for d in padded[2:])


@functools.lru_cache(maxsize=1024)
def _factor(expr: sympy.Expr, k: int) -> sympy.Expr | None:
    """`f` with `expr == v_k * f` and `f` free of `v_k`, or None when `expr` is not of that form."""
    v = sym(k)
    factor = sympy.diff(expr, v)
    if v in factor.free_symbols:
        return None
    if sympy.expand(expr - v * factor) != 0:
        return None
    return factor
