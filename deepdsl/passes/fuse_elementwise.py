"""Elementwise fusion: chains and trees of `ew` nodes become one `ew` node computing one sympy expression.

A producer `ew` node is substituted into the expression of an `ew` node reading it when
- that reader is its only reader and it is no graph output (so nothing else needs its value stored), and
- it has the reader's shape, or is a scalar (each element of the result then evaluates the producer's expression
  once, as the unfused program did per element; a smaller non-scalar producer would be recomputed for every element
  it is broadcast to, which can cost more than it saves, so it stays a separate node), and
- the fused expression stays readable and cheap to compile: at most `MAX_INPUTS` distinct inputs and
  `MAX_EXPR_SIZE` sympy nodes.
The sweep runs bottom-up, so a producer has already absorbed its own producers when its reader considers it: whole
trees fuse in one pass. A fused node loses `out_grad` (the derivative in terms of the output, which autodiff has
already used); unfused activations keep it. Composition is cached per pattern of expressions and input sharing,
so repeated layers (ResNet blocks) pay sympy once. Linear in the size of the graph.

Guarantees: same values; every graph output keeps its node's shape and dtype; the number of `ew` nodes does not
grow.
"""
from __future__ import annotations

import functools

import sympy

from deepdsl.ir import Graph, Node, make, rebuild, toposort
from deepdsl.provenance import inherit
from deepdsl.ops.elementwise import elementwise, sym

MAX_INPUTS = 8
MAX_EXPR_SIZE = 80


def fuse_elementwise(graph: Graph) -> Graph:
    """The graph with single-use same-shape (or scalar) `ew` producers substituted into their `ew` readers."""
    order = toposort(node for _, node in graph.outputs)
    readers: dict[int, set[int]] = {}
    for node in order:
        for i in node.inputs:
            readers.setdefault(id(i), set()).add(id(node))
    outputs = {id(node) for _, node in graph.outputs}

    memo: dict[int, Node] = {}
    for node in order:
        if not node.inputs:
            memo[id(node)] = node
            continue
        inputs = [memo[id(i)] for i in node.inputs]
        if node.op != "ew":
            memo[id(node)] = rebuild(node, inputs)
            continue
        fusable = [old.op == "ew" and new.op == "ew" and id(old) not in outputs
                   and readers[id(old)] == {id(node)} and (new.shape == node.shape or new.shape == ())
                   for old, new in zip(node.inputs, inputs)]
        memo[id(node)] = inherit(_fuse(node, inputs, fusable), node)
    return Graph(graph.name, tuple((k, memo[id(v)]) for k, v in graph.outputs))


def _fuse(node: Node, inputs: list[Node], fusable: list[bool]) -> Node:
    """`node` over `inputs`, with the producers marked fusable substituted into its expression, one at a time while
    the result stays within the size limits."""
    expr = node.attr("expr")
    current = list(inputs)
    fused_any = False
    for k in range(len(inputs)):
        if not fusable[k]:
            continue
        # the position of this producer among `current`, which absorbs producers as it goes
        position = next(j for j, x in enumerate(current) if x is inputs[k])
        producer = current[position]
        candidate = current[:position] + list(producer.inputs) + current[position + 1:]
        sharing = _sharing(candidate)
        result = _compose(expr, len(current), position, producer.attr("expr"), len(producer.inputs), sharing)
        if result is None:
            continue
        expr, _ = result
        current = [candidate[j] for j in _firsts(sharing)]
        fused_any = True
    if not fused_any:
        return rebuild(node, inputs)
    if _symbol_count(expr) < len(current):     # terms cancelled: drop the inputs no longer read
        return elementwise(expr, current, shape=node.shape)
    return make("ew", current, expr=expr)


def _sharing(nodes: list[Node]) -> tuple[int, ...]:
    """For each position, the index of the first position holding the same node (canonical sharing pattern)."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(n), j) for j, n in enumerate(nodes))


def _firsts(sharing: tuple[int, ...]) -> list[int]:
    return [j for j, s in enumerate(sharing) if s == j]


@functools.lru_cache(maxsize=8192)
def _compose(outer: sympy.Expr, n_outer: int, position: int, inner: sympy.Expr, n_inner: int,
             sharing: tuple[int, ...]) -> tuple[sympy.Expr, int] | None:
    """`outer` (over n_outer symbols) with symbol `position` replaced by `inner` (over n_inner symbols), the joint
    input list being outer's inputs with position replaced by inner's inputs, merged by `sharing`, renumbered
    v0.. in order of first occurrence. None when the result exceeds the size limits."""
    unique = _firsts(sharing)
    if len(unique) > MAX_INPUTS:
        return None
    new_index = {j: unique.index(sharing[j]) for j in range(len(sharing))}
    # joint position of each outer symbol and each inner symbol
    outer_map = {}
    for j in range(n_outer):
        if j < position:
            outer_map[sym(j)] = sym(new_index[j])
        elif j > position:
            outer_map[sym(j)] = sym(new_index[j + n_inner - 1])
    inner_map = {sym(j): sym(new_index[position + j]) for j in range(n_inner)}
    # xreplace substitutes simultaneously, so renamed symbols cannot capture each other (and each expression is
    # rebuilt once: rebuilding `Max` is costly)
    result = outer.xreplace(outer_map | {sym(position): inner.xreplace(inner_map)})
    if _size(result) > MAX_EXPR_SIZE:
        return None
    return result, len(unique)


@functools.lru_cache(maxsize=8192)
def _symbol_count(expr: sympy.Expr) -> int:
    return len(expr.free_symbols)    # sympy walks the whole expression for this: once per fused expression


@functools.lru_cache(maxsize=8192)
def _size(expr: sympy.Expr) -> int:
    return sum(1 for _ in sympy.preorder_traversal(expr))
