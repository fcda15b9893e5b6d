"""Specialize mode-dependent layers for the step being compiled.

Training: `dropout` becomes a product with a random 0/1 mask; `batch_norm` normalizes with the batch statistics and
adds graph outputs that update the running statistics (PyTorch's rule: unbiased variance, `momentum` weight on the
new value). Testing: `dropout` is the identity; `batch_norm` uses the running statistics.
`synced` (the accumulate step of data-parallel training): the batch statistics are those of the batches of every
rank, their sums and the example count summed over the ranks (`all_sum`, which is the identity in one process).
Guarantees: the result holds no `dropout` or `batch_norm` node.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import sympy

from deepdsl import provenance
from deepdsl.ir import Graph, Node, make
from deepdsl.ops.elementwise import elementwise, reshape, sum_to, sym


def specialize(graph: Graph, mode: str, synced: bool = False) -> Graph:
    assert mode in ("train", "test"), mode
    updates: dict[str, Node] = {}

    def rewrite(node: Node) -> Node:
        if node.op == "dropout":
            if mode == "test" or node.attr("ratio") == 0.0:
                return node.inputs[0]
            keep = 1.0 - node.attr("ratio")
            mask = make("bernoulli", (), shape=node.shape, keep=keep, key=node.attr("key"))
            provenance.record_parts(node, {"mask": mask})
            return elementwise(sym(0) * sym(1) / sympy.Float(keep), [node.inputs[0], mask])
        if node.op == "batch_norm":
            return _batch_norm(node, mode, updates, synced)
        return node

    result = graph.map(rewrite)
    extra = tuple((name, value) for name, value in sorted(updates.items()))
    return Graph(graph.name, result.outputs + extra)


def _batch_norm(node: Node, mode: str, updates: dict[str, Node], synced: bool = False) -> Node:
    x, weight, bias, running_mean, running_var = node.inputs
    c = x.shape[1]
    bshape = (1, c) + (1,) * (len(x.shape) - 2)
    w, b = reshape(weight, bshape), reshape(bias, bshape)
    count = x.size // c
    f = _batch_norm_exprs(node.attr("eps"), node.attr("momentum"), count)
    if mode == "test":
        mean, var = reshape(running_mean, bshape), reshape(running_var, bshape)
        provenance.record_parts(node, {"weight": w, "bias": b, "running_mean": mean, "running_var": var})
        return elementwise(f.test, [x, mean, var, w, b])
    if synced:     # sums and count over the ranks' batches
        total = make("all_sum", (sum_to(x, bshape),))
        n = make("all_sum", (make("const", (), value=float(count), shape=()),))
        mean = elementwise(f.synced_mean, [total, n])
    else:
        total = sum_to(x, bshape)
        mean = elementwise(f.mean, [total])
    centered = elementwise(f.centered, [x, mean])
    square = elementwise(f.square, [centered])
    squares = make("all_sum", (sum_to(square, bshape),)) if synced else sum_to(square, bshape)
    var = elementwise(f.synced_mean, [squares, n]) if synced else elementwise(f.mean, [squares])
    inv_std = elementwise(f.inv_std, [var])
    y = elementwise(f.normalized, [centered, inv_std, w, b])
    batch_mean, batch_var = reshape(mean, (c,)), reshape(var, (c,))
    updates[running_mean.name] = elementwise(f.running_mean, [running_mean, batch_mean])
    updates[running_var.name] = (elementwise(f.synced_running_var, [running_var, batch_var, n]) if synced else
                                 elementwise(f.running_var, [running_var, batch_var]))
    provenance.record_parts(node, {
        "weight": w, "bias": b, "sum": total, "batch_mean": mean, "centered": centered, "square": square,
        "sum_of_squares": squares, "batch_var": var, "inv_std": inv_std, "batch_mean_flat": batch_mean,
        "batch_var_flat": batch_var,
        "running_mean": updates[running_mean.name], "running_var": updates[running_var.name],
        **({"count": n, "local_sum": total.inputs[0], "local_sum_of_squares": squares.inputs[0]} if synced else {})})
    return y


class _BatchNormExprs(NamedTuple):
    test: sympy.Expr            # (x - running mean) / sqrt(running var + eps) * w + b
    mean: sympy.Expr            # sum / count
    centered: sympy.Expr        # x - mean
    square: sympy.Expr
    inv_std: sympy.Expr         # 1 / sqrt(var + eps)
    normalized: sympy.Expr      # centered * inv_std * w + b
    running_mean: sympy.Expr    # (1 - m) * running + m * batch mean
    running_var: sympy.Expr     # (1 - m) * running + m * unbiased batch variance
    synced_mean: sympy.Expr     # sum / count, the count an input (v1)
    synced_running_var: sympy.Expr      # running_var, the count an input (v2)


@functools.lru_cache(maxsize=256)
def _batch_norm_exprs(eps: float, momentum: float, count: int) -> _BatchNormExprs:
    """The expressions of one batch-norm layer, built once per (eps, momentum, count) (sympy is slow to build them
    and every layer of a network usually shares them)."""
    m = sympy.Float(momentum)
    unbias = sympy.Rational(count, max(count - 1, 1))
    return _BatchNormExprs(
        test=(sym(0) - sym(1)) / sympy.sqrt(sym(2) + eps) * sym(3) + sym(4),
        mean=sym(0) / count,
        centered=sym(0) - sym(1),
        square=sym(0) ** 2,
        inv_std=1 / sympy.sqrt(sym(0) + eps),
        normalized=sym(0) * sym(1) * sym(2) + sym(3),
        running_mean=(1 - m) * sym(0) + m * sym(1),
        running_var=(1 - m) * sym(0) + m * unbias * sym(1),
        synced_mean=sym(0) / sym(1),
        synced_running_var=(1 - m) * sym(0) + m * sym(2) / (sym(2) - 1) * sym(1),
    )
