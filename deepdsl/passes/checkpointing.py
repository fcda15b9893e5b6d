"""Segment checkpointing (Chen, Xu, Zhang and Guestrin, "Training deep nets with sublinear memory cost", 2016): a
baseline for the budgeted recomputation of `passes/recompute.py`.

Chen et al. split the forward computation of a network into k segments, keep only the output of each segment (the
checkpoints) through the backward pass, and recompute a segment's other values from the checkpoint before it when
the backward reaches that segment. With k = sqrt(n) segments of a forward of n values, the memory for activations
is O(sqrt(n)) at the cost of one more forward pass. This module does that on a scheduled, Free-less program (as the
`schedule` and `rematerialize` stages leave it, before `inplace`):

1. The forward statements. The ancestors of the outputs that are not named like a persistent input (the loss;
   every other output is a new value of a parameter, an optimizer state or a running statistic), then, in program
   order, every other statement that reads only values of the forward (at least one): a pooling's argmax, a
   running statistic's update, a mask over an activation. Recomputed copies (`ir.REMAT`, made by the
   `rematerialize` pass) are never forward statements. The forward ends at its last statement in program order;
   the scheduler computes the loss as soon as its inputs exist, so the backward reads forward values after that
   point. (A statement outside the forward placed before that point, such as an auxiliary classifier's gradient in
   GoogLeNet, reads the original values, which live until then anyway.)
2. The segments. The forward statements, in program order, split into `segments` consecutive runs of about equal
   count. A segment's last statement's output is its checkpoint and is kept, as is every program output and every
   value outside the forward.
3. The recomputations. For each segment, the values it defines (other than what is kept) that are read after the
   forward are recomputed: copies of the statements needed to compute them from outside the segment (their closure
   within the segment, in program order) go right before the first statement after the forward that reads one of
   them, and every statement from there on reads the copies (`recompute.copies_before`, one insertion per segment).
   The originals are then no longer read after the forward, so they are freed during it.

The copies read the values from outside their segment that the originals read: checkpoints, parameters, batch
inputs, and on graphs that are no chain (a residual block's input, an inception module's branches) values of an
earlier segment that a later one reads; those stay alive until the copies read them, as extra checkpoints, which is
what checkpointing a general graph at segment boundaries keeps. The last segment's values are by default kept rather
than recomputed (`keep_last`): its backward starts where its forward ends, so recomputing it would cost FLOPs and
lower no peak. Copies carry a fresh `remat` attribute per segment, so `budget.flops` counts them as recomputation.
Segments are inserted from the last position to the first, so the positions found on the input program stay valid.
"""
from __future__ import annotations

import math

from deepdsl.ir import REMAT
from deepdsl.passes.recompute import copies_before
from deepdsl.ssa import Free, Program
from deepdsl.storage import is_persistent


def forward_statements(program: Program) -> list[int]:
    """Body indices of the forward statements of `program`, in program order (see step 1 of the module docstring)."""
    nodes = [i.node for i in program.body]
    index = {id(node): k for k, node in enumerate(nodes)}
    persistent = {leaf.name for leaf in program.inputs if is_persistent(leaf)}
    forward: set[int] = set()
    stack = [index[id(v)] for name, v in program.outputs if name not in persistent and id(v) in index]
    while stack:
        k = stack.pop()
        if k in forward:
            continue
        forward.add(k)
        stack.extend(index[id(i)] for i in nodes[k].inputs if id(i) in index)
    for k, node in enumerate(nodes):
        if k in forward or node.attr(REMAT):
            continue
        inner = [index[id(i)] for i in node.inputs if id(i) in index]
        if inner and all(j in forward for j in inner):
            forward.add(k)
    return sorted(forward)


def split(statements: list[int], segments: int) -> list[list[int]]:
    """`statements` in `segments` consecutive runs of about equal count (the first ones one longer)."""
    segments = max(1, min(segments, len(statements)))
    size, extra = divmod(len(statements), segments)
    runs, start = [], 0
    for s in range(segments):
        end = start + size + (1 if s < extra else 0)
        runs.append(statements[start:end])
        start = end
    return runs


def checkpoint_segments(program: Program, segments: int, keep_last: bool = True) -> Program:
    """`program` with its forward split into `segments` segments and every forward value read after the forward
    recomputed from its segment's inputs, except the checkpoints (see the module docstring). `program` is a
    Free-less program in its scheduled order (before the `inplace` stage); so is the result."""
    if segments < 1:
        raise ValueError(f"checkpointing needs at least one segment, not {segments}")
    if any(isinstance(i, Free) or i.into is not None for i in program.body):
        raise ValueError("checkpointing runs before the in-place and dealloc passes")
    forward = forward_statements(program)
    if not forward:
        return program
    nodes = [i.node for i in program.body]
    index = {id(node): k for k, node in enumerate(nodes)}
    end = forward[-1]
    readers: dict[int, list[int]] = {}
    for k, node in enumerate(nodes):
        for i in node.inputs:
            j = index.get(id(i))
            if j is not None and (not readers.get(j) or readers[j][-1] != k):
                readers.setdefault(j, []).append(k)
    outputs = {id(v) for _, v in program.outputs}
    runs = split(forward, segments)
    insertions = []                        # (position, segment number, statements to copy)
    for s, run in enumerate(runs):
        if keep_last and s == len(runs) - 1:
            break
        members = set(run)
        kept = {run[-1]} | {k for k in run if id(nodes[k]) in outputs}
        late = [k for k in run if k not in kept and any(r > end for r in readers.get(k, ()))]
        if not late:
            continue
        position = min(r for k in late for r in readers[k] if r > end)
        chosen: set[int] = set()
        stack = list(late)
        while stack:
            k = stack.pop()
            if k in chosen:
                continue
            chosen.add(k)
            for i in nodes[k].inputs:
                j = index.get(id(i))
                if j is not None and j in members and j not in kept:
                    stack.append(j)
        insertions.append((position, s, sorted(chosen)))
    serial = max((node.attr(REMAT, 0) for node in nodes), default=0)
    # from the last position to the first (at one position, the later segment first, so that the earlier
    # segment's copies come before it and its copies read them): earlier positions stay valid
    for position, _, chosen in sorted(insertions, reverse=True):
        serial += 1
        program = copies_before(program, chosen, position, serial)
    return program


def sqrt_segments(program: Program, keep_last: bool = True) -> Program:
    """`checkpoint_segments` with round(sqrt(n)) segments for a forward of n statements."""
    n = len(forward_statements(program))
    return checkpoint_segments(program, max(1, round(math.sqrt(n))), keep_last)


__all__ = ["checkpoint_segments", "forward_statements", "split", "sqrt_segments"]
