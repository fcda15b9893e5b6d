"""Common-subexpression elimination by hash-consing, in linear time.

Nodes are hash-consed when made, so structurally equal subexpressions are already one object. What hash-consing
cannot see is elementwise nodes equal up to the order of their inputs: `a*b` and `b*a`, or `v0 - v1` over (a, b)
and `v1 - v0` over (b, a). This pass gives each elementwise node a canonical key (its inputs in creation order, its
expression renumbered to match, its shape and out_grad) and maps every node to the first node seen with its key;
the graph is rebuilt bottom-up through `make`, so readers of merged nodes become equal and merge in turn, with
every other op. Nodes that have no duplicate are kept as they are (no rebuild, so no cascade of new nodes);
elementwise nodes with repeated inputs or scalar-constant inputs are first put in canonical form. The renumbered
expression is computed only for nodes that share their inputs with an earlier candidate, and cached per
(expression, permutation), so sympy rebuilds few expressions (rebuilding `Max` is costly).
Guarantees: same values; no two nodes compute the same canonical expression of the same inputs; idempotent.
"""
from __future__ import annotations

import functools

import sympy

from deepdsl.ir import Graph, Node
from deepdsl.ops.elementwise import elementwise, sym


def cse(graph: Graph) -> Graph:
    """The graph with equal computations merged into one node."""
    # candidates by their inputs in creation order, shape and out_grad; the renumbered expression (a sympy rebuild)
    # is computed only where a second candidate arrives, and most nodes have none
    buckets: dict[tuple, list[list]] = {}

    def merge(node: Node) -> Node:
        if node.op != "ew":
            return node
        inputs = node.inputs
        if len(set(map(id, inputs))) < len(inputs) or any(i.op == "const" and i.shape == () for i in inputs):
            node = elementwise(node.attr("expr"), inputs, shape=node.shape, out_grad=node.attr("out_grad"))
            if node.op != "ew":
                return node
            inputs = node.inputs
        order = tuple(sorted(range(len(inputs)), key=lambda i: inputs[i].serial))
        bucket = buckets.setdefault((tuple(id(inputs[i]) for i in order), node.shape, node.attr("out_grad")), [])
        if not bucket:
            bucket.append([node, order, None])
            return node
        expr = _renumber(node.attr("expr"), order)
        for entry in bucket:    # [node, order, renumbered expression or None until needed]
            if entry[2] is None:
                entry[2] = _renumber(entry[0].attr("expr"), entry[1])
            if entry[2] == expr:
                return entry[0]
        bucket.append([node, order, expr])
        return node

    return graph.map(merge)


@functools.lru_cache(maxsize=8192)
def _renumber(expr: sympy.Expr, order: tuple[int, ...]) -> sympy.Expr:
    """`expr` over inputs permuted so that new input j is old input order[j]."""
    if order == tuple(range(len(order))):
        return expr
    return expr.xreplace({sym(old): sym(new) for new, old in enumerate(order)})
