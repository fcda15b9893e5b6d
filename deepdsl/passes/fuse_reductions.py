"""Reduction fusion: a `sum_to` of an elementwise result becomes one `ew_sum` node that computes the expression and
sums it, so the elementwise result is never a tensor of its own.

Batch norm is the case this is for: its variance sums the squares of the centred input, its backward sums products
of the incoming gradient with the centred input; unfused, each is a tensor the size of the activation, written once
and read once by the reduction. A `sum_to` whose input is an `ew` node fuses when
- that `ew` node has no other reader and is no graph output (nothing else needs its value stored).
The runtime computes an `ew_sum` in cache-sized chunks of samples (its workspace: `deepdsl.ops.elementwise`'s
rule), so the memory plan holds the chunk instead of the whole tensor. Run after `fuse_elementwise`, which has
made each such `ew` node the whole expression. Linear in the size of the graph.

The factors of the expression that are constant along the summed axes (operands of the sum's own shape, size-1
operands of no more axes than it, and with them numbers) are multiplied in after the sum: sum(k * f) = k * sum(f).
Sums that differ only in such factors are then one sum, which `cse` merges: batch norm's backward sums the incoming
gradient times the centred input twice, once times the scale (for the inverse deviation's gradient) and once times
the inverse deviation (for the scale's), which then read the two activations once for both.

Guarantees: same values (up to the order of the sums' additions, which follows the chunks, and the rounding of a
factor multiplied after the sum instead of into each term); every graph output keeps its node's shape and dtype.
"""
from __future__ import annotations

import sympy

from deepdsl.ir import Graph, Node, make, rebuild, toposort
from deepdsl.ops.elementwise import elementwise, sum_to, sym
from deepdsl.provenance import inherit


def fuse_reductions(graph: Graph) -> Graph:
    """The graph with each `sum_to` of a single-use `ew` node replaced by an `ew_sum` node."""
    order = toposort(node for _, node in graph.outputs)
    readers: dict[int, int] = {}
    for node in order:
        for i in node.inputs:
            readers[id(i)] = readers.get(id(i), 0) + 1
    outputs = {id(node) for _, node in graph.outputs}

    memo: dict[int, Node] = {}
    for node in order:
        inputs = [memo[id(i)] for i in node.inputs]
        if node.op == "sum_to" and inputs[0].op == "ew" and readers[id(node.inputs[0])] == 1 \
                and id(node.inputs[0]) not in outputs:
            memo[id(node)] = inherit(_summed(inputs[0], node.attr("shape")), node, same_name=True)
        else:
            memo[id(node)] = rebuild(node, inputs) if node.inputs else node
    return Graph(graph.name, tuple((k, memo[id(v)]) for k, v in graph.outputs))


def _summed(producer: Node, shape: tuple[int, ...]) -> Node:
    """The sum to `shape` of the `ew` node `producer`: an `ew_sum` of its expression, the factors constant along the
    summed axes multiplied in after it (by an `ew` node of `shape`)."""
    expr, inputs = producer.attr("expr"), producer.inputs
    # constant along the summed axes and able to meet the sum at its shape: a size-1 operand of more axes than
    # the sum (a (1, 1) state beside a (2,) sum) would not broadcast to it, so it stays inside
    constant = {sym(i) for i, x in enumerate(inputs)
                if x.shape == tuple(shape) or (x.size == 1 and len(x.shape) <= len(shape))}
    factors = sympy.Mul.make_args(expr)
    outside = [f for f in factors if f.free_symbols <= constant]
    if not any(f.free_symbols for f in outside) or len(outside) == len(factors):
        return make("ew_sum", inputs, expr=expr, shape=shape)
    inside = elementwise(sympy.Mul(*(f for f in factors if f not in outside)), inputs)
    total = (make("ew_sum", inside.inputs, expr=inside.attr("expr"), shape=shape) if inside.op == "ew"
             else sum_to(inside, shape))
    return elementwise(sympy.Mul(*outside) * sym(len(inputs)), [*inputs, total], shape=shape)
