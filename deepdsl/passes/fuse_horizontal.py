"""Horizontal fusion: one kernel call computes several independent statements of one elementwise kernel, each on
operands of its own: the optimizer's updates of a network's small parameters.

A training step updates each parameter and its optimizer state right after the parameter's gradient (the scheduler
frees each gradient as early as it can): a ViT's 51 parameters, 35 of them vectors of 64 floats, each updated by two
calls (Adam's second moment, then its first moment and the parameter in one pass, `fuse_multi_output`). For tensors
that small a call costs far more than its arithmetic: the runtime's dispatch takes microseconds, the kernel
nanoseconds (as PyTorch's optimizers apply one kernel to a list of tensors, `foreach`). So the pass moves the updates
of small tensors to the end of the step, ordered so that the statements of one kernel are adjacent, and marks each
run of two or more on its last statement, `Let(node, batch=(v1, ..., vk))`: that statement's call computes the
values of the k statements before it too, each from its own operands (`rt.ew_many`; those statements only bind
their buffers, as the first of a pair does).

Which statements: `ew` statements written over a persistent input (a parameter's or an optimizer state's new value,
`passes.inplace`) of at most `SMALL_UPDATE` elements whose operands are whole tensors of the output's shape or
scalars (`contract.many_function`: what a batched kernel takes), and only with every statement that must follow
them: their readers (a parameter's new value reads the new moments) and the statements after them writing over a
storage they read (a momentum update reads its parameter, which the parameter's update overwrites); a statement
that another statement must follow stays where it is, so at the end the moved ones read what they read before
(their new values are the step's outputs, which nothing else reads). Their order there: by their depth in those
relations, then by kernel (expression, operands' pattern, the operand written over; the kernels in the order of their
first statement) and their order before; statements of one depth neither read each other nor write over what another
reads, so a batch's members are independent.

Moving statements later keeps their inputs alive longer: the parameters whose updates come last move first, all of
them if the planned peak of live bytes does not rise, else the most that keep it (a binary search over that order).
Runs on the final order after the in-place pass and before `fuse_multi_output` (which pairs no batch's statement)
and `dealloc` (which frees a batch's inputs after its call, `deepdsl.storage`).

Guarantees: the same statements with the same `into`, so the same values; every statement after its inputs; only
`batch` is set, on the last statement of runs of adjacent independent statements of one kernel; the planned peak
does not rise.
"""
from __future__ import annotations

from dataclasses import replace

from deepdsl.memory_plan import dealloc_live_bytes
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import analyze, is_persistent
from deepdsl_runtime import contract

__all__ = ["fuse_horizontal", "batch_key", "SMALL_UPDATE"]

SMALL_UPDATE = 1 << 14      # elements of the largest update moved (64 KB of float32: a 64 x 256 weight)


def batch_key(instr: Let):
    """What the statements of one batch share: the kernel (expression, arity, the operand written over) and the
    operands' pattern; None for a statement no batched kernel computes."""
    node = instr.node
    if node.op != "ew":
        return None
    pattern = contract.operand_pattern([(x.shape, x.dtype == "uint8") for x in node.inputs], node.shape)
    if pattern is None or contract.many_function("k", pattern) is None:
        return None
    alias = next((i for i, x in enumerate(node.inputs) if x is instr.into), None)
    return node.attr("expr"), len(node.inputs), alias, pattern


def _candidates(program: Program) -> tuple[list[list[int]], dict[int, set[int]]]:
    """The movable updates as groups that move together, each a list of body indices in order, the groups in order
    of their last statement, latest first; and for each of them the statements that must follow it (its readers,
    and the statements after it writing over a storage it reads: an update reads its parameter, which the
    parameter's own update overwrites later)."""
    body = program.body
    storage = analyze(program)
    index = {id(instr.node): k for k, instr in enumerate(body)}
    writers: dict[int, list[int]] = {}
    for k, instr in enumerate(body):
        if instr.into is not None:
            writers.setdefault(id(storage.root[id(instr.into)]), []).append(k)
    follow: dict[int, set[int]] = {k: set() for k in range(len(body))}
    for k, instr in enumerate(body):
        for x in instr.node.inputs:
            if id(x) in index:
                follow[index[id(x)]].add(k)
            if id(x) in storage.root:
                follow[k].update(j for j in writers.get(id(storage.root[id(x)]), ()) if j > k)
    ok = {k for k, instr in enumerate(body)
          if instr.into is not None and is_persistent(instr.into) and instr.node.size <= SMALL_UPDATE
          and instr.computes_also is None and batch_key(instr) is not None}
    changed = True
    while changed:                          # a statement moves only with every statement that must follow it
        changed = False
        for k in sorted(ok):
            if not follow[k] <= ok:
                ok.discard(k)
                changed = True
    group = {k: k for k in ok}

    def find(k: int) -> int:
        while group[k] != k:
            group[k] = group[group[k]]
            k = group[k]
        return k

    for k in ok:
        for j in follow[k]:
            group[find(j)] = find(k)
    members: dict[int, list[int]] = {}
    for k in sorted(ok):
        members.setdefault(find(k), []).append(k)
    return sorted(members.values(), key=lambda ks: -ks[-1]), {k: follow[k] for k in ok}


def _moved(program: Program, groups: list[list[int]], follow: dict[int, set[int]]) -> Program:
    """`program` with the statements of `groups` at its end, ordered by depth (each after the statements it must
    follow) and kernel, each run of two or more adjacent statements of one depth and kernel marked as a batch on
    its last one."""
    body = program.body
    chosen = sorted(k for ks in groups for k in ks)
    if not chosen:
        return program
    at = set(chosen)
    depth = {k: 0 for k in chosen}
    for k in chosen:                        # (in body order: what a statement must follow comes after it)
        for j in follow[k]:
            depth[j] = max(depth[j], depth[k] + 1)
    keys = {k: batch_key(body[k]) for k in chosen}
    rank: dict = {}                         # the kernels in the order of their first statement
    for k in chosen:
        rank.setdefault(keys[k], len(rank))
    tail = sorted(chosen, key=lambda k: (depth[k], rank[keys[k]], k))
    result = [instr for k, instr in enumerate(body) if k not in at]
    run: list[int] = []
    for position, k in enumerate(tail):
        run.append(k)
        following = tail[position + 1] if position + 1 < len(tail) else None
        if following is not None and (depth[following], keys[following]) == (depth[k], keys[k]):
            continue
        for member in run[:-1]:
            result.append(body[member])
        last = body[run[-1]]
        result.append(replace(last, batch=tuple(body[m].node for m in run[:-1])) if len(run) > 1 else last)
        run = []
    return program.rewritten(tuple(result))


def _peak(program: Program, takeover: bool) -> int:
    """The planned peak of live bytes of `program` once dealloc has freed it."""
    return max(dealloc_live_bytes(program, takeover)[0], default=0)


def fuse_horizontal(program: Program, takeover: bool = True) -> Program:
    """`program` with the small updates gathered at its end and batched (see the module docstring); `takeover`:
    the memory plan's option, for its peak."""
    if any(isinstance(i, Free) or getattr(i, "batch", ()) for i in program.body):
        return program                      # frees decided, or batched already
    groups, follow = _candidates(program)
    if not groups:
        return program
    peak = _peak(program, takeover)
    moved = _moved(program, groups, follow)
    if _peak(moved, takeover) <= peak:
        return moved
    low, high = 0, len(groups) - 1          # the most groups, in order, whose move keeps the peak
    best = program
    while low < high:
        middle = (low + high + 1) // 2
        trial = _moved(program, groups[:middle], follow)
        if _peak(trial, takeover) <= peak:
            low, best = middle, trial
        else:
            high = middle - 1
    return best
