"""Symbolic reverse-mode differentiation over the graph: one pass from the loss back to every parameter.

The result is more graph (no runtime tape): each op's `vjp` rule maps the cotangent of its output to one cotangent
per input, and contributions to a node reached along several paths are summed in one `ew` node.
"""
from __future__ import annotations

from typing import Sequence

from deepdsl import provenance
from deepdsl.ir import Node, toposort
from deepdsl.ops import get_op
from deepdsl.ops.elementwise import add
from deepdsl.ops.leaf import const


def gradients(loss: Node, wrt: Sequence[Node]) -> dict[Node, Node]:
    """d loss / d w for each w in `wrt` (a zero constant where w does not influence the loss)."""
    if loss.shape != ():
        raise ValueError(f"gradients of a non-scalar ({loss.shape})")
    order = toposort([loss])
    targets = {id(w) for w in wrt}
    # only nodes on a path from some target to the loss need a cotangent
    needed: dict[int, bool] = {}
    for node in order:
        needed[id(node)] = id(node) in targets or any(needed[id(i)] for i in node.inputs)

    pending: dict[int, list[Node]] = {id(loss): [const(1.0)]}
    done: dict[int, Node] = {}
    for node in reversed(order):
        parts = pending.pop(id(node), None)
        if parts is None:
            continue
        if len(parts) == 1:
            g = parts[0]
        else:
            g = add(*parts)
            provenance.record_sum(g, node)
        done[id(node)] = g
        if not node.inputs or not any(needed[id(i)] for i in node.inputs):
            continue
        cotangents = get_op(node.op).vjp(node, g)
        provenance.record_backward(node, g, zip(node.inputs, cotangents))
        assert len(cotangents) == len(node.inputs), f"VJP of {node.op} gave {len(cotangents)} cotangents " \
                                                    f"for {len(node.inputs)} inputs"
        for x, c in zip(node.inputs, cotangents):
            if c is None or not needed[id(x)]:
                continue
            assert c.shape == x.shape, f"VJP of {node.op}: cotangent {c.shape} for input {x.shape}"
            pending.setdefault(id(x), []).append(c)
    return {w: done.get(id(w), const(0.0, w.shape)) for w in wrt}
