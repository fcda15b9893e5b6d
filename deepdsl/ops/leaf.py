"""Leaves: batch inputs and hyperparameters (`input`), trained parameters (`param`), other per-step state
(`state`: optimizer buffers, batch-norm running statistics) and constants (`const`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepdsl.ir import FLOAT, Node, make
from deepdsl.ops import Op, register


@dataclass(frozen=True, slots=True)
class Init:
    """How a parameter or state tensor is initialized (Caffe's fillers).

    kind: "xavier" (uniform in +-sqrt(3 / fan_in)), "gaussian" (normal with `std`), "constant" (`value`).
    """

    kind: str
    value: float = 0.0
    std: float = 0.01

    def __str__(self) -> str:
        if self.kind == "constant":
            return f"constant({self.value:g})"
        if self.kind == "gaussian":
            return f"gaussian({self.std:g})"
        return self.kind


class _Leaf(Op):
    def infer(self, **attrs):
        return attrs["shape"], attrs.get("dtype", FLOAT)

    def vjp(self, node, g):
        return ()

    def describe(self, node: Node) -> str:
        return node.attr("name")


@register
class Input(_Leaf):
    """A value fed to each step: a batch (`role="data"`/`"label"`), a hyperparameter (`"hyper"`), a hoisted value
    computed once before training (`"hoisted"`) or the random-number counter (`"rng"`)."""

    name = "input"


@register
class Param(_Leaf):
    """A trained parameter; attributes carry its initializer and learning-rate / decay multipliers."""

    name = "param"


@register
class State(_Leaf):
    """Carried state that is not trained by gradients (momentum buffers, running statistics)."""

    name = "state"


@register
class Const(Op):
    name = "const"

    def infer(self, *, value, shape=()):
        return shape, FLOAT

    def vjp(self, node, g):
        return ()

    def evaluate(self, ctx, *, value, shape=()):
        return np.full(shape, value, dtype=ctx.float_dtype)

    def describe(self, node: Node) -> str:
        value = node.attr("value")
        return f"{value:g}" if not node.shape else f"fill({value:g})"


def const(value: float, shape: tuple[int, ...] = ()) -> Node:
    return make("const", (), value=float(value), shape=tuple(shape))

