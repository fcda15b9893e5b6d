"""Epilogue fusion: a bias added to every row of a matrix product becomes the product's third input, added as each
output is stored, so the product's result is not read and written again by an elementwise pass.

A fully connected layer computes `x Wᵀ + B`: unfused, a `matmul` node and an `ew` node `v0 + v1` adding B,
broadcast over the rows, to its result. The `ew` node becomes `matmul(x, W, B)` (`deepdsl.ops.linalg`) when
- its expression is exactly the sum of its two inputs, one a 2-D `matmul` node of two inputs, the other a float
  vector of the product's columns, (n,);
- that product has no other reader and is no graph output (nothing else needs it without the bias).
Run after `fuse_elementwise`, which has folded the adds that feed another elementwise expression (a ReLU, a GELU)
into that expression's node: those stay there. Linear in the size of the graph.

Guarantees: same values, the same bits on the CPU's compiled kernels and numpy's (the bias is added to the finished
product, in float32, as the elementwise add did); every graph output keeps its node's shape and dtype; the number
of nodes does not grow.
"""
from __future__ import annotations

from deepdsl.ir import FLOAT, Graph, Node, make, rebuild, toposort, users
from deepdsl.ops.elementwise import sym
from deepdsl.provenance import inherit

_SUM = sym(0) + sym(1)


def fuse_epilogue(graph: Graph) -> Graph:
    """The graph with each `ew` node adding a bias vector to a single-use 2-D product replaced by the product taking
    the bias as its third input."""
    order = toposort(node for _, node in graph.outputs)
    readers = users(order)
    outputs = {id(node) for _, node in graph.outputs}
    memo: dict[int, Node] = {}
    for node in order:
        inputs = [memo[id(i)] for i in node.inputs]
        product = _biased_product(node, inputs, readers, outputs)
        memo[id(node)] = (inherit(product, node, same_name=True) if product is not None
                          else rebuild(node, inputs) if node.inputs else node)
    return Graph(graph.name, tuple((k, memo[id(v)]) for k, v in graph.outputs))


def _biased_product(node: Node, inputs: list[Node], readers: dict[int, list[Node]], outputs: set[int]) -> Node | None:
    """`matmul(a, b, bias)` for an `ew` node `node` computing product + bias (inputs already rewritten: `inputs`),
    or None."""
    if node.op != "ew" or len(inputs) != 2 or node.attr("expr") != _SUM:
        return None
    for k in (0, 1):
        old, product, bias = node.inputs[k], inputs[k], inputs[1 - k]
        if product.op == "matmul" and len(product.inputs) == 2 and len(product.shape) == 2 and \
                len(readers[id(old)]) == 1 and id(old) not in outputs and bias.dtype == FLOAT and \
                bias.shape == product.shape[1:] and node.shape == product.shape:
            return make("matmul", (*product.inputs, bias), **dict(product.attrs))
    return None
