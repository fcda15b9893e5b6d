"""Specialize mode-dependent layers for the step being compiled.

Training: `dropout` becomes a product with a random 0/1 mask (one per example for drop path), and an `attention`
with dropout takes its mask as an input (`ops.attention.drawn`); `batch_norm` normalizes with the batch statistics
and adds graph outputs that update the running statistics (PyTorch's rule: unbiased variance, `momentum` weight on the
new value). Testing: `dropout` is the identity, and so is an attention's; `batch_norm` uses the running
statistics.
The split step (`specialize_split`, the accumulate step of data-parallel training) is synced: the batch statistics
are those of the batches of every rank, their sums and the example count summed over the ranks (`all_sum`, which
is the identity in one process), and the step does not update the running statistics: it writes the batch's mean
and unbiased variance into the buffers `B_<running statistic>` (`batch_statistics`), from which the statistics
step, built alongside, updates them. Kept apart, the updates can be replayed batch after batch in the order one
process would make them (ranks that normalize by their own batch's statistics).
Guarantees: the result holds no `dropout` or `batch_norm` node, nor an `attention` with a `dropout` attribute.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import sympy

from deepdsl import provenance
from deepdsl.ir import FLOAT, Graph, Node, make
from deepdsl.ops.attention import drawn
from deepdsl.ops.elementwise import elementwise, reshape, sum_to, sym
from deepdsl.ops.leaf import Init

BATCH_STATISTICS = "batch statistics"     # the role of the buffers B_ (`batch_statistics`)


def batch_statistics(running: Node) -> Node:
    """The buffer `B_<running>` of the split step: the statistic of the last batch that the running statistic
    `running` is updated from (role "batch statistics": neither trained nor checkpointed)."""
    return make("state", (), name=f"B_{running.name}", shape=running.shape, dtype=FLOAT,
                init=Init("constant", value=0.0), role=BATCH_STATISTICS)


def is_batch_statistics(node: Node) -> bool:
    return node.op == "state" and node.attr("role") == BATCH_STATISTICS


def specialize(graph: Graph, mode: str) -> Graph:
    """`graph` specialized for `mode`; in training its outputs gain the new running statistics."""
    return _specialize(graph, mode, False, {})


def specialize_split(graph: Graph, statistics_name: str) -> tuple[Graph, Graph]:
    """The split step's training graph, `synced` (its outputs gain the batch statistics, `B_` buffers), and its
    statistics step `statistics_name`: every running statistic updated from its batch statistic as the training
    step updates it from the batch (no outputs without batch norm)."""
    statistics: dict[str, Node] = {}
    synced = _specialize(graph, "train", True, statistics)
    return synced, Graph(statistics_name, tuple(sorted(statistics.items())))


def _specialize(graph: Graph, mode: str, synced: bool, statistics: dict[str, Node]) -> Graph:
    assert mode in ("train", "test"), mode
    updates: dict[str, Node] = {}

    def rewrite(node: Node) -> Node:
        if node.op == "dropout":
            if mode == "test" or node.attr("ratio") == 0.0:
                return node.inputs[0]
            keep = 1.0 - node.attr("ratio")
            shape = (node.shape[0],) + (1,) * (len(node.shape) - 1) if node.attr("per_sample") else node.shape
            mask = make("bernoulli", (), shape=shape, keep=keep, key=node.attr("key"))
            provenance.record_parts(node, {"mask": mask})
            return elementwise(sym(0) * sym(1) / sympy.Float(keep), [node.inputs[0], mask])
        if node.op == "attention" and node.attr("dropout") is not None:
            result = drawn(node, mode)
            if result.attr("keep") is not None:          # its last input the mask drawn
                provenance.record_parts(node, {"mask": result.inputs[-1]})
            return result
        if node.op == "batch_norm":
            return _batch_norm(node, mode, updates, synced, statistics)
        return node

    result = graph.map(rewrite)
    extra = tuple((name, value) for name, value in sorted(updates.items()))
    return Graph(graph.name, result.outputs + extra)


def _batch_norm(node: Node, mode: str, updates: dict[str, Node], synced: bool, statistics: dict[str, Node]) -> Node:
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
    if synced:      # the batch statistics, for the statistics step
        unbiased = elementwise(f.unbiased, [batch_var, n])
        for running, batch in ((running_mean, batch_mean), (running_var, unbiased)):
            buffer = batch_statistics(running)
            updates[buffer.name] = batch
            statistics[running.name] = elementwise(f.running_mean, [running, buffer])
        new_mean, new_var = statistics[running_mean.name], statistics[running_var.name]
    else:
        new_mean = updates[running_mean.name] = elementwise(f.running_mean, [running_mean, batch_mean])
        new_var = updates[running_var.name] = elementwise(f.running_var, [running_var, batch_var])
    provenance.record_parts(node, {
        "weight": w, "bias": b, "sum": total, "batch_mean": mean, "centered": centered, "square": square,
        "sum_of_squares": squares, "batch_var": var, "inv_std": inv_std, "batch_mean_flat": batch_mean,
        "batch_var_flat": batch_var, "running_mean": new_mean, "running_var": new_var,
        **({"count": n, "local_sum": total.inputs[0], "local_sum_of_squares": squares.inputs[0],
            "unbiased_batch_var": unbiased} if synced else {})})
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
    unbiased: sympy.Expr        # variance * count / (count - 1), the count an input (v1)


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
        unbiased=sym(0) * sym(1) / (sym(1) - 1),
    )
