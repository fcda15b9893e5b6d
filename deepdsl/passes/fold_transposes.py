"""Fold the transposes of attention's heads into the attention.

Multi-head attention is written as PyTorch writes it: each projection's output (N * T, H * d) reshaped to (N, T, H,
d), its tokens' and heads' axes swapped to (N, H, T, d) for `attention`, and the attention's output swapped back to
(N, T, H, e) for the output projection. Each swap is a copy of the whole activation, and the backward copies the
gradients back the other way: eight copies a layer. `attention` and `attention_grad` with the attribute `heads`
read their operands and write their results in the (..., T, H, d) layout instead (a unit's rows `H * d` apart), so

    attention(swap(q), swap(k), swap(v), *rest)   ->   swap(attention[heads](q, k, v, *rest))
    attention_grad(swap(q), swap(k), swap(v), swap(o), swap(g), *rest)
        ->   the same packed gradients, each piece swap(piece of attention_grad[heads](q, k, v, o, g, *rest))

where swap exchanges the last axes but one (`transpose` of axes (n - 3, n - 2)). The forward rule runs first (the
graph is rewritten inputs first), so an `attention_grad` finds its output operand `o` swapped too. `simplify`, which
runs next, removes what is left: a swap of a swap, a slice of the concatenated pieces, a reshape to its own shape.
Only attention whose units the compiled CPU kernels weigh whole (`contract.attention_in_units`) is rewritten: those
kernels read and write the heads' layout in place, where the row passes would copy it.

Guarantees: same values (the transposes are exact); shapes and dtypes of graph outputs unchanged.
"""
from __future__ import annotations

from deepdsl.ir import Graph, Node, make
from deepdsl.ops.attention import split, swap_heads
from deepdsl.ops.elementwise import reshape
from deepdsl.ops.shape import concat, slice_axis
from deepdsl_runtime import contract


def fold_transposes(graph: Graph) -> Graph:
    """The graph with the swaps of heads and tokens around attention folded into it."""
    return graph.map(_rewrite)


def _swapped(x: Node) -> Node | None:
    """`a` where x is `a` with its last axes but one swapped (a `transpose`), else None."""
    n = len(x.shape)
    if x.op == "transpose" and n >= 3 and tuple(x.attr("axes")) == (n - 3, n - 2):
        return x.inputs[0]
    return None


def _rewrite(node: Node) -> Node:
    if node.op not in ("attention", "attention_grad") or node.attr("heads", False):
        return node
    keep = node.attr("keep")
    count = 3 if node.op == "attention" else 5
    operands = node.inputs[:count]
    if node.op == "attention_grad":         # (the bias and mask come after o and g)
        (_, _, _), bias, mask = split(node.inputs[:3] + node.inputs[5:], keep)
    else:
        _, bias, mask = split(node.inputs, keep)
    inner = [_swapped(x) for x in operands]
    if any(x is None for x in inner):
        return node
    q, k, v = operands[:3]
    if not contract.attention_in_units(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]):
        return node
    folded = make(node.op, (*inner, *bias, *mask), **node.kwargs, heads=True)
    if node.op == "attention":
        return swap_heads(folded)
    pieces, start = [], 0
    for x, stored in zip(operands[:3], inner[:3]):
        piece = reshape(slice_axis(folded, 0, start, start + x.size), stored.shape)
        pieces.append(reshape(swap_heads(piece), (x.size,)))
        start += x.size
    return concat(pieces, axis=0)
