"""Softmax, log-softmax and the label-indexed ops losses are built from (`pick`, `unpick`), top-1 precision and
the rank of each label among its row's scores (top-k accuracy)."""
from __future__ import annotations

import numpy as np
import sympy

from deepdsl.ir import FLOAT, INT32, Node, make
from deepdsl.ops import Op, dims, register, require, scratch_chunks
from deepdsl.ops.elementwise import elementwise, sum_to, sym
from deepdsl_runtime import contract


def _check_scores(x: Node, what: str):
    require(len(x.shape) == 2, f"{what} expects a 2-D (batch, classes) input, got {dims(x.shape)}")


@register
class Softmax(Op):
    """Softmax of each row. `causal` (an attribute present only when set): the rows come in blocks of as many rows
    as columns, and row i of a block weighs only columns 0..i (a causal attention's query i), the others 0."""

    name = "softmax"
    in_place = (0,)           # each row's maximum and sum are taken before the row is written

    def infer(self, x: Node, *, causal=False):
        _check_scores(x, "softmax")
        require(not causal or x.shape[0] % x.shape[1] == 0,
                f"a causal softmax needs rows in blocks of {x.shape[1]} (queries by keys), got {dims(x.shape)}")
        return x.shape, FLOAT

    def vjp(self, node, g):
        # dx = y * (g - sum_j g_j y_j)
        dot = sum_to(elementwise(sym(0) * sym(1), [g, node]), (node.shape[0], 1))
        return (elementwise(sym(1) * (sym(0) - sym(2)), [g, node, dot]),)

    def evaluate(self, ctx, x, *, causal=False):
        if causal:
            k = x.shape[1]
            later = np.arange(k)[None, :] > (np.arange(x.shape[0]) % k)[:, None]
            x = np.where(later, -np.inf, x)
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(ctx.float_dtype)


@register
class LogSoftmax(Op):
    name = "log_softmax"
    in_place = (0,)

    def infer(self, x: Node):
        _check_scores(x, "log_softmax")
        return x.shape, FLOAT

    def vjp(self, node, g):
        # dx = g - exp(y) * sum_j g_j
        total = sum_to(g, (node.shape[0], 1))
        return (elementwise(sym(0) - sympy.exp(sym(1)) * sym(2), [g, node, total]),)

    def evaluate(self, ctx, x):
        shifted = x - x.max(axis=1, keepdims=True)
        return (shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))).astype(ctx.float_dtype)

    def workspace(self, node, limit=None):
        """The CPU kernel's scratch (`contract.log_softmax_scratch`: the exponentials), input-sized, or row chunks'
        within `limit`."""
        return scratch_chunks(node.shape[0], contract.log_softmax_scratch(node.shape), limit)


def _check_labels(x: Node, labels: Node):
    require(labels.dtype == INT32 and labels.shape == (x.shape[0],),
            f"labels of shape {dims(labels.shape)} for scores of shape {dims(x.shape)}")


@register
class Pick(Op):
    """out[i] = x[i, labels[i]]."""

    name = "pick"

    def infer(self, x: Node, labels: Node):
        _check_scores(x, "a loss")
        _check_labels(x, labels)
        return (x.shape[0],), FLOAT

    def vjp(self, node, g):
        x, labels = node.inputs
        return make("unpick", (g, labels), classes=x.shape[1]), None

    def evaluate(self, ctx, x, labels):
        return x[np.arange(x.shape[0]), labels].astype(ctx.float_dtype)


@register
class Unpick(Op):
    """out[i, labels[i]] = g[i], zero elsewhere (the VJP of pick)."""

    name = "unpick"

    def infer(self, g: Node, labels: Node, *, classes):
        require(g.shape == labels.shape and len(g.shape) == 1, "unpick: gradient and labels shapes differ")
        return (g.shape[0], classes), FLOAT

    def vjp(self, node, g):
        return make("pick", (g, node.inputs[1])), None

    def evaluate(self, ctx, g, labels, *, classes):
        out = np.zeros((g.shape[0], classes), dtype=ctx.float_dtype)
        out[np.arange(g.shape[0]), labels] = g
        return out


@register
class Precision(Op):
    """Fraction of rows whose largest score is at the label (top-1 accuracy)."""

    name = "precision"

    def infer(self, x: Node, labels: Node):
        _check_scores(x, "precision")
        _check_labels(x, labels)
        return (), FLOAT

    def vjp(self, node, g):
        return None, None

    def evaluate(self, ctx, x, labels):
        return np.asarray((x.argmax(axis=1) == labels).mean(), dtype=ctx.float_dtype)


@register
class LabelRank(Op):
    """Each row's rank of its label: how many scores come before the label's when the row is sorted by decreasing
    score, ties in column order (so rank 0 exactly where `precision` counts the row, rank < k where the label is
    among the row's k best; NaN for a label outside the row). As floats: exact up to 2^24 classes."""

    name = "label_rank"

    def infer(self, x: Node, labels: Node):
        _check_scores(x, "label_rank")
        _check_labels(x, labels)
        return (x.shape[0],), FLOAT

    def vjp(self, node, g):
        return None, None

    def evaluate(self, ctx, x, labels):
        outside = (labels < 0) | (labels >= x.shape[1])          # a label outside the row: NaN
        own = x[np.arange(x.shape[0]), np.where(outside, 0, labels)][:, None]
        before = np.arange(x.shape[1])[None, :] < labels[:, None]
        ranks = ((x > own) | ((x == own) & before)).sum(axis=1).astype(ctx.float_dtype)
        ranks[outside] = np.nan
        return ranks


def mean_over_batch(per_example: Node) -> Node:
    """Scalar mean of a (N,) tensor."""
    n = per_example.shape[0]
    return elementwise(sym(0) / n, [sum_to(per_example, ())])


def nll(log_probs: Node, labels: Node) -> Node:
    """-mean_i log_probs[i, labels[i]]."""
    return elementwise(-sym(0), [mean_over_batch(make("pick", (log_probs, labels)))])


def log_loss(probs: Node, labels: Node) -> Node:
    """-mean_i log(probs[i, labels[i]]) (DeepDSL's log_loss on softmax outputs)."""
    picked = make("pick", (probs, labels))
    return elementwise(-sym(0), [mean_over_batch(elementwise(sympy.log(sym(0)), [picked]))])


def cross_entropy(logits: Node, labels: Node) -> Node:
    return nll(make("log_softmax", (logits,)), labels)

