"""Specialize mode-dependent layers for the step being compiled.

Training: `dropout` becomes a product with a random 0/1 mask; `batch_norm` normalizes with the batch statistics and
adds graph outputs that update the running statistics (PyTorch's rule: unbiased variance, `momentum` weight on the
new value). Testing: `dropout` is the identity; `batch_norm` uses the running statistics.
Guarantees: the result holds no `dropout` or `batch_norm` node.
"""
from __future__ import annotations

import sympy

from deepdsl.ir import Graph, Node
from deepdsl.ir import make
from deepdsl.ops.elementwise import elementwise, reshape, sum_to, sym


def specialize(graph: Graph, mode: str) -> Graph:
    assert mode in ("train", "test"), mode
    updates: dict[str, Node] = {}

    def rewrite(node: Node) -> Node:
        if node.op == "dropout":
            if mode == "test" or node.attr("ratio") == 0.0:
                return node.inputs[0]
            keep = 1.0 - node.attr("ratio")
            mask = make("bernoulli", (), shape=node.shape, keep=keep, key=node.attr("key"))
            return elementwise(sym(0) * sym(1) / sympy.Float(keep), [node.inputs[0], mask])
        if node.op == "batch_norm":
            return _batch_norm(node, mode, updates)
        return node

    result = graph.map(rewrite)
    extra = tuple((name, value) for name, value in sorted(updates.items()))
    return Graph(graph.name, result.outputs + extra)


def _batch_norm(node: Node, mode: str, updates: dict[str, Node]) -> Node:
    x, weight, bias, running_mean, running_var = node.inputs
    eps, momentum = node.attr("eps"), node.attr("momentum")
    c = x.shape[1]
    bshape = (1, c) + (1,) * (len(x.shape) - 2)
    w, b = reshape(weight, bshape), reshape(bias, bshape)
    if mode == "test":
        mean, var = reshape(running_mean, bshape), reshape(running_var, bshape)
        return elementwise((sym(0) - sym(1)) / sympy.sqrt(sym(2) + eps) * sym(3) + sym(4), [x, mean, var, w, b])
    count = x.size // c
    mean = elementwise(sym(0) / count, [sum_to(x, bshape)])
    centered = elementwise(sym(0) - sym(1), [x, mean])
    var = elementwise(sym(0) / count, [sum_to(elementwise(sym(0) ** 2, [centered]), bshape)])
    inv_std = elementwise(1 / sympy.sqrt(sym(0) + eps), [var])
    y = elementwise(sym(0) * sym(1) * sym(2) + sym(3), [centered, inv_std, w, b])
    m = sympy.Float(momentum)
    updates[running_mean.name] = elementwise((1 - m) * sym(0) + m * sym(1), [running_mean, reshape(mean, (c,))])
    unbias = sympy.Rational(count, max(count - 1, 1))
    updates[running_var.name] = elementwise((1 - m) * sym(0) + m * unbias * sym(1), [running_var, reshape(var, (c,))])
    return y
