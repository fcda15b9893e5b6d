"""Multi-output fusion: one kernel call computes two adjacent statements, each value written where its own
statement writes it.

Three kinds of pairs:
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
- **An elementwise statement and a sum of an elementwise reader of it** (`ew_sum`, batch norm's statistics): the
  centred input `c = x - mean` and the sum of its squares per channel; the gradient of the centred input and its
  sum. One pass stores each element of `c` and adds its contribution to the sum from the value just computed,
  instead of reading `c` again. The sum is moved up to right after the statement it reads (it is usually a few
  statements later: the running statistics' update, a parameter's update in between), which changes no value.

Runs on the final order after the in-place pass and before `dealloc`, moves those sums, and marks the second
statement of each pair `Let(node, computes_also=first)`. From then on the second statement also uses the first
one's inputs and output (`deepdsl.storage.analyze`), so they stay live (and unclobbered by a fresh output) until
the call, and the frees and the memory plan follow from that as from any read. That, and a sum's small output
living longer, could raise the planned peak; fusion never does: a sum is moved only where the bytes live in
between stay under the peak, and the result is checked against the planned peak of the program as it came
(`memory_plan.dealloc_live_bytes`), falling back to no moved sums, then to pairs whose second statement allocates
nothing (which cannot raise it), then to the program as it came.

Guarantees: the same statements with the same `into`, so the same values, in the same order but for the sums
moved up; only `computes_also` is set; a statement is in one pair at most; the planned peak of live bytes does not
rise. Linear in the program size (a few live-bytes profiles).
"""
from __future__ import annotations

from dataclasses import replace

from deepdsl.memory_plan import dealloc_live_bytes
from deepdsl.ops.elementwise import broadcast_shapes
from deepdsl.ssa import Free, Let, Program
from deepdsl_runtime.contract import placed_size

__all__ = ["fuse_multi_output", "computed_together"]

POOL_PAIR = frozenset({"max_pool", "max_pool_argmax"})


def computed_together(first: Let, second: Let) -> bool:
    """Whether one kernel call can compute the statements `first` and then `second` (see the module docstring)."""
    a, b = first.node, second.node
    if {a.op, b.op} == POOL_PAIR:
        return (a.inputs == b.inputs and a.attrs == b.attrs and first.into is None and second.into is None)
    if a.op != "ew" or not any(x is a for x in b.inputs):
        return False
    if b.op == "ew":
        return a.shape == b.shape
    return b.op == "ew_sum" and second.into is None and _summed_shape(b) == a.shape


def _summed_shape(node) -> tuple[int, ...]:
    """The shape of the values an `ew_sum` sums: its inputs broadcast."""
    return broadcast_shapes(*(x.shape for x in node.inputs))


def _hoist_sums(body: tuple, live: list[int]) -> tuple:
    """Each `ew_sum` whose last-defined input is an `ew` statement of the shape it sums moved up to right after it,
    where it can be computed with it, if its output, live longer, keeps the live bytes (`live`: at each `Let`, as
    planned) under their peak. Its inputs are all defined there, and none is overwritten in between (a value is
    dead once overwritten, and the sum reads them later), so its value is the same."""
    position = {id(i.node): k for k, i in enumerate(body)}
    peak, added = max(live, default=0), [0] * len(body)
    moves: dict[int, int] = {}
    targets: set[int] = set()               # the statements a sum moved up to
    for k, instr in enumerate(body):
        if instr.node.op != "ew_sum" or instr.into is not None:
            continue
        p = max((position[id(x)] for x in instr.node.inputs if id(x) in position), default=k)
        if p + 1 >= k or body[p].node.op != "ew" or body[p].node.shape != _summed_shape(instr.node) \
                or p in targets:
            continue
        size = placed_size(instr.node.nbytes)
        if all(live[j] + added[j] + size <= peak for j in range(p + 1, k)):
            moves[k] = p
            targets.add(p)
            for j in range(p + 1, k):
                added[j] += size
    if not moves:
        return body
    after: dict[int, list] = {}
    for k, p in moves.items():
        after.setdefault(p, []).append(body[k])
    result = []
    for k, instr in enumerate(body):
        if k not in moves:
            result.append(instr)
            result.extend(after.get(k, ()))
    return tuple(result)


def _saving(a, b, allocating: bool) -> int:
    """Elements one call saves reading over two, where it can compute the statements `a` and then `b` (else 0): the
    first's output, which the second reads as it is stored, and every input both read, read once. `allocating`:
    whether pairs whose second statement allocates may be made."""
    if not (isinstance(a, Let) and isinstance(b, Let) and a.computes_also is None
            and (b.computes_also is None or b.computes_also is a.node) and computed_together(a, b)):
        return 0
    if not allocating and b.into is None:
        return 0
    shared = sum(1 for x in {id(x): x for x in b.node.inputs}.values() if any(x is y for y in a.node.inputs))
    return max(a.node.size, 1) * (1 + shared)


def _paired(body: tuple, allocating: bool) -> tuple:
    """`body` with the pairs marked that save the most reading among overlapping candidates (a chain of three): a
    maximum-weight matching of the path of statements, by dynamic programming."""
    n = len(body)
    batched = {id(v) for i in body if isinstance(i, Let) and i.batch for v in (*i.batch, i.node)}  # `fuse_horizontal`
    free = [not isinstance(i, Let) or id(i.node) not in batched for i in body]
    saving = [_saving(body[k], body[k + 1], allocating) if free[k] and free[k + 1] else 0 for k in range(n - 1)]
    best = [0] * (n + 2)            # best[k]: the most saved by pairs among body[k:]
    for k in range(n - 2, -1, -1):
        best[k] = max(best[k + 1], saving[k] + best[k + 2] if saving[k] else 0)
    result = list(body)
    k = 0
    while k < n - 1:
        if saving[k] and best[k] == saving[k] + best[k + 2]:
            if result[k + 1].computes_also is not result[k].node:
                result[k + 1] = replace(result[k + 1], computes_also=result[k].node)
            k += 2
        else:
            k += 1
    return tuple(result)


def _peak(program: Program, takeover: bool) -> tuple[int, list[int]]:
    """(the planned peak of live bytes of `program` once freed, the live bytes at each of its statements)."""
    live, at = dealloc_live_bytes(program, takeover)
    return max(live, default=0), [live[k] for k in at]


def fuse_multi_output(program: Program, takeover: bool = True) -> Program:
    """`program` with pairs of adjacent statements one call can compute marked, sums moved up to be paired (see
    the module docstring); `takeover`: the memory plan's option, for its peak."""
    if any(isinstance(i, Free) for i in program.body):     # frees decided: only pairs with no Free between them
        body = _paired(program.body, allocating=True)
        return program if body == program.body else program.rewritten(body)
    peak, live = _peak(program, takeover)
    for hoist, allocating in ((True, True), (False, True), (False, False)):
        body = _paired(_hoist_sums(program.body, live) if hoist else program.body, allocating)
        if body == program.body:
            return program
        fused = program.rewritten(body)
        if _peak(fused, takeover)[0] <= peak:
            return fused
    return program
