"""Common-subexpression elimination by hash-consing, in linear time.

Nodes are hash-consed when made, so structurally equal subexpressions are already one object; this pass adds the
canonical form that makes more of them equal: the inputs of an elementwise node are put in a canonical order
(creation order, with the expression's symbols renumbered to match) so `a*b` and `b*a` become one node, and the
graph is rebuilt bottom-up through `make`. Guarantees: same values; no two nodes compute the same canonical
expression of the same inputs.
"""
from __future__ import annotations

from deepdsl.ir import Graph, Node
from deepdsl.ops.elementwise import elementwise, sym


def canonical(node: Node) -> Node:
    if node.op != "ew" or len(node.inputs) < 2 or node.attr("out_grad") is not None:
        return node
    order = sorted(range(len(node.inputs)), key=lambda i: node.inputs[i].serial)
    if order == list(range(len(order))):
        return node
    names = [sym(i) for i in range(len(node.inputs))]
    return elementwise(node.attr("expr"), [node.inputs[i] for i in order], names=[names[i] for i in order],
                       shape=node.shape)


def cse(graph: Graph) -> Graph:
    return graph.map(canonical)
