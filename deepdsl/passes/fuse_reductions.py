"""Reduction fusion: a `sum_to` of an elementwise result becomes one `ew_sum` node that computes the expression and
sums it, so the elementwise result is never a tensor of its own.

Batch norm is the case this is for: its variance sums the squares of the centred input, its backward sums products
of the incoming gradient with the centred input; unfused, each is a tensor the size of the activation, written once
and read once by the reduction. A `sum_to` whose input is an `ew` node fuses when
- that `ew` node has no other reader and is no graph output (nothing else needs its value stored).
The runtime computes an `ew_sum` in cache-sized chunks of samples (its workspace: `deepdsl.ops.elementwise`'s
rule), so the memory plan holds the chunk instead of the whole tensor. Run after `fuse_elementwise`, which has
made each such `ew` node the whole expression. Linear in the size of the graph.

Guarantees: same values (up to the order of the sums' additions, which follows the chunks); every graph output
keeps its node's shape and dtype.
"""
from __future__ import annotations

from deepdsl.ir import Graph, Node, make, rebuild, toposort
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
            producer = inputs[0]
            memo[id(node)] = inherit(make("ew_sum", producer.inputs, expr=producer.attr("expr"),
                                          shape=node.attr("shape")), node, same_name=True)
        else:
            memo[id(node)] = rebuild(node, inputs) if node.inputs else node
    return Graph(graph.name, tuple((k, memo[id(v)]) for k, v in graph.outputs))
