"""Multi-output fusion: one kernel call computes two adjacent statements, each value written where its own
statement writes it.

Two kinds of pairs:
- **A window's maximum and its position.** Max pooling's backward reads the argmax of each window (`ops.pool`), so
  a training step computes both `max_pool(x)` and `max_pool_argmax(x)`, each scanning every window of `x`. Next to
  each other (either order), same input, same attributes, neither in place: one `rt.max_pool(x, out=, argmax=)`.
- **An elementwise statement and an elementwise reader of it.** `a = f(...)` and then `b = g(a, ...)` of the same
  shape (an optimizer's two updates: momentum `v' = m*v + dw + decay*w`, then weight `w' = w - lr*v'`): one pass
  over the elements computes element i of `a`, stores it, then element i of `b` from the stored value. Element
  fusion (`fuse_elementwise`) cannot merge them when `a` is stored for its own sake (a program output, or read
  elsewhere). One pass instead of two reads `v`, `dw` and `w` once and writes `v'` and `w'` once: five passes over
  the parameters instead of seven, and one parallel region instead of two. Either statement may be in place: every
  element of an operand is read before that element of the outputs is written, and an in-place output is a whole
  operand of the same shape.

Runs on the final order after the in-place pass and before `dealloc`, and marks the second statement of each pair
`Let(node, computes_also=first)`. From then on the second statement also reads the first one's inputs
(`deepdsl.storage.analyze`), so they stay live (and unclobbered by a fresh output) until the call that reads them,
and the frees and the memory plan follow from that as from any read. Guarantees: the same statements in the same
order with the same `into`, so the same values; only `computes_also` is set; a statement is in one pair at most.
Linear in the program size.
"""
from __future__ import annotations

from dataclasses import replace

from deepdsl.ssa import Let, Program

__all__ = ["fuse_multi_output", "computed_together"]

POOL_PAIR = frozenset({"max_pool", "max_pool_argmax"})


def computed_together(first: Let, second: Let) -> bool:
    """Whether one kernel call can compute the statements `first` and then `second` (see the module docstring)."""
    a, b = first.node, second.node
    if {a.op, b.op} == POOL_PAIR:
        return (a.inputs == b.inputs and a.attrs == b.attrs and first.into is None and second.into is None)
    return a.op == b.op == "ew" and a.shape == b.shape and any(x is a for x in b.inputs)


def _saving(a, b) -> int:
    """Elements one call saves reading over two, where it can compute the statements `a` and then `b` (else 0): the
    first's output, which the second reads as it is stored, and every input both read, read once."""
    if not (isinstance(a, Let) and isinstance(b, Let) and a.computes_also is None
            and (b.computes_also is None or b.computes_also is a.node) and computed_together(a, b)):
        return 0
    shared = sum(1 for x in {id(x): x for x in b.node.inputs}.values() if any(x is y for y in a.node.inputs))
    return a.node.size * (1 + shared)


def fuse_multi_output(program: Program) -> Program:
    """`program` with pairs of adjacent statements one call can compute marked (see the module docstring): of
    overlapping candidates (a chain of three), the pairs that save the most reading (a maximum-weight matching of
    the body's path of statements, by dynamic programming)."""
    body = list(program.body)
    n = len(body)
    saving = [_saving(body[k], body[k + 1]) for k in range(n - 1)]
    best = [0] * (n + 2)            # best[k]: the most saved by pairs among body[k:]
    for k in range(n - 2, -1, -1):
        best[k] = max(best[k + 1], saving[k] + best[k + 2] if saving[k] else 0)
    changed = False
    k = 0
    while k < n - 1:
        if saving[k] and best[k] == saving[k] + best[k + 2]:
            if body[k + 1].computes_also is not body[k].node:
                body[k + 1] = replace(body[k + 1], computes_also=body[k].node)
                changed = True
            k += 2
        else:
            k += 1
    return replace(program, body=tuple(body)) if changed else program
