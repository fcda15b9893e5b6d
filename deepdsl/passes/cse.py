"""Common-subexpression elimination by hash-consing, in linear time.

Nodes are hash-consed when made, so structurally equal subexpressions are already one object; this pass adds the
canonical form that makes more of them equal: the inputs of an elementwise node are put in a canonical order
(creation order, with the expression's symbols renumbered to match) so `a*b` and `b*a`, or `v0 - v1` over (a, b)
and `v1 - v0` over (b, a), become one node; repeated inputs are merged and scalar constants inlined. The graph is
rebuilt bottom-up through `make`, which returns the existing node for every equal one. The renumbering is cached
per (expression, permutation), so sympy rebuilds each distinct pattern once (rebuilding `Max` is costly).
Guarantees: same values; no two nodes compute the same canonical expression of the same inputs.
"""
from __future__ import annotations

import functools

import sympy

from deepdsl.ir import Graph, Node, make
from deepdsl.ops.elementwise import elementwise, sym


def canonical(node: Node) -> Node:
    """`node` with its elementwise inputs in creation order (other nodes unchanged)."""
    if node.op != "ew" or node.attr("out_grad") is not None:
        return node
    inputs = node.inputs
    if len(set(map(id, inputs))) < len(inputs) or any(i.op == "const" and i.shape == () for i in inputs):
        return elementwise(node.attr("expr"), inputs, shape=node.shape)
    if len(inputs) < 2:
        return node
    order = tuple(sorted(range(len(inputs)), key=lambda i: inputs[i].serial))
    if order == tuple(range(len(order))):
        return node
    return make("ew", [inputs[i] for i in order], expr=_renumber(node.attr("expr"), order))


@functools.lru_cache(maxsize=8192)
def _renumber(expr: sympy.Expr, order: tuple[int, ...]) -> sympy.Expr:
    """`expr` over inputs permuted so that new input j is old input order[j]."""
    return expr.xreplace({sym(old): sym(new) for new, old in enumerate(order)})


def cse(graph: Graph) -> Graph:
    """The graph rebuilt in canonical form; equal computations become one node."""
    return graph.map(canonical)
