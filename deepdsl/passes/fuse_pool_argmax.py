"""Compute a window's maximum and its position in one pass: pair a `max_pool` with the `max_pool_argmax` of the
same windows.

Max pooling's backward reads the argmax of each window (`ops.pool`), so a training step computes both `max_pool(x)`
and `max_pool_argmax(x)`; each scans every window of `x`. Where the final order puts the two statements next to
each other (either order, no `Free` between them), same input, same attributes, and neither writes in place, the
second becomes `Let(node, computes_also=first)`: one runtime call (`rt.max_pool(x, out=, argmax=)`) computes both
and the first statement only binds its buffer.

Runs after the memory stages and before `plan_memory`, on the final order. Guarantees: the same statements in the
same order with the same `into` (so the same values, frees and memory plan); only `computes_also` is set, on the
second statement of each pair, naming the node of the `Let` right before it; a statement is in one pair at most.
Linear in the program size.
"""
from __future__ import annotations

from dataclasses import replace

from deepdsl.ir import Node
from deepdsl.ssa import Let, Program

__all__ = ["fuse_pool_argmax", "computed_together"]

POOL_PAIR = frozenset({"max_pool", "max_pool_argmax"})


def computed_together(first: Node, second: Node) -> bool:
    """Whether one kernel call can compute `first` and `second`: a `max_pool` and a `max_pool_argmax` (either
    order) of the same input with the same attributes."""
    return ({first.op, second.op} == POOL_PAIR and first.inputs == second.inputs and first.attrs == second.attrs)


def _pairable(a, b) -> bool:
    return (isinstance(a, Let) and isinstance(b, Let) and a.into is None and b.into is None
            and a.computes_also is None and computed_together(a.node, b.node))


def fuse_pool_argmax(program: Program) -> Program:
    """`program` with each adjacent `max_pool` / `max_pool_argmax` pair marked to be computed by one call."""
    body = list(program.body)
    changed = False
    k = 0
    while k + 1 < len(body):
        if _pairable(body[k], body[k + 1]):
            if body[k + 1].computes_also is not body[k].node:
                body[k + 1] = replace(body[k + 1], computes_also=body[k].node)
                changed = True
            k += 2
        else:
            k += 1
    return replace(program, body=tuple(body)) if changed else program
