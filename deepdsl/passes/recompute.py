"""Recomputation to a memory budget: a peak-directed greedy over every value of a step, cheapest FLOPs per byte first.

The `rematerialize` pass recomputes only cheap values whose inputs are alive anyway, where that costs no memory
elsewhere. Under a memory budget (`deepdsl/budget.py`) any value may be recomputed: a convolution's output, a
matrix product, a batch normalization, a dropout mask (its draws come from the counter-based stream of
(seed, step, mask), so the copy draws the same mask). This pass gives the *sequence* of programs such recomputations
make, each from the one before:

1. Predict the live bytes while each statement runs (`liveness.live_profile`, the planner's own figure) and take
   the first statement t at the peak.
2. Candidates are the values alive across t without being read there: a statement's output (no program output, no
   batch input, not read through a view) whose last read before t is a and first read after t is b. Recomputing it
   right before b frees its bytes over the statements between a and b, t among them.
3. The copy reads the value's inputs at b. An input whose storage is no longer alive at b is recomputed there too,
   from its own inputs, in a chain of at most `CHAIN_DEPTH` links (a convolution's output from the pooled value
   before it, itself recomputed from the ReLU output it pools). Chain copies are freed as soon as the copy is made.
4. Take the candidate of least FLOPs (value and chain, `Op.flops`) per byte freed; apply it if the predicted peak
   falls, or stays with fewer statements at it, else try the next one. Stop when no candidate does: each step
   lowers (peak, statements at the peak), so the sequence is finite.

Each element of the sequence is a program with one more recomputation; the budget picks the first that fits. The
sequence does not depend on the budget, which is what makes the budget monotone: a smaller budget takes a longer
prefix of the same sequence. Copies are the original nodes with a fresh `remat` attribute (`ir.REMAT`, which no op
sees): hash-consing would otherwise merge a copy with the original or with an earlier copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from deepdsl.ir import REMAT, Node, substitute
from deepdsl.liveness import StorageGraph, live_profile
from deepdsl.ops import get_op
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import is_batch_input, is_inline, is_persistent, is_view

CHAIN_DEPTH = 3       # values recomputed to recompute one value (its inputs, their inputs, ...), at most
WORTHWHILE = 1000     # values under 1/1000 of the peak (per-channel vectors) are not worth a recomputation
TRIES = 8             # candidates tried at one peak statement before giving up on it


@dataclass(frozen=True)
class Recomputation:
    """One step of the sequence: `value` (a statement's output) recomputed right before statement `position` of
    the program it was chosen in, after the `chain` of values it needs; `flops` of all of them; `freed` bytes over
    the gap; `peak` the predicted peak of live bytes of the program with it."""

    value: Node
    position: int
    chain: tuple[Node, ...]
    flops: int
    freed: int
    peak: int


def recomputation_sequence(program: Program) -> Iterator[tuple[Program, Recomputation]]:
    """The programs recomputing one more value each (see the module docstring), with the recomputation each adds.
    `program` is a Free-less program in its scheduled order; every program of the sequence is one too."""
    if any(isinstance(i, Free) or i.into is not None for i in program.body):
        raise ValueError("recompute runs before the in-place and dealloc passes")
    serial = max((i.node.attr(REMAT, 0) for i in program.body), default=0)
    while True:
        step = _next(program)
        if step is None:
            return
        chosen, recomputation = step
        serial += 1
        program = _insert(program, chosen, recomputation.position, serial)
        yield program, recomputation


def _next(program: Program) -> tuple[list[int], Recomputation] | None:
    """The statements to copy (chain first, value last) and the recomputation that lowers the first statement at the
    peak most cheaply without raising the peak; None when none does."""
    if len(program.body) < 3:
        return None
    graph = StorageGraph(program)
    nodes = graph.nodes
    n = len(nodes)
    profile = np.array(live_profile(graph, list(range(n))), dtype=np.int64)
    peak = int(profile.max())
    index = {id(node): k for k, node in enumerate(nodes)}
    readers = [sorted(r) for r in graph.readers]
    last_read = [r[-1] if r else -1 for r in readers]
    viewed = {graph.group_of[id(node)] for k, node in enumerate(nodes) if graph.owned[k] is None}
    smallest = max(peak // WORTHWHILE, 1)
    at_peak = int((profile == peak).sum())

    def alive(node: Node, b: int) -> bool:
        if is_inline(node) or (node.is_leaf and is_persistent(node)):
            return True
        g = graph.group_of.get(id(node))
        return g is not None and last_read[g] >= b

    def chain(k: int, b: int, depth: int, found: list[int]) -> bool:
        """Add to `found` (inputs first) the statements to recompute at b so that statement k can be: False if some
        input is neither alive at b nor recomputable within `depth` links."""
        for i in nodes[k].inputs:
            if alive(i, b):
                continue
            ki = index.get(id(i))
            if ki is None or depth == 0 or is_view(i) or get_op(i.op).view or graph.owned[ki] is None:
                return False
            if ki in found:
                continue
            if not chain(ki, b, depth - 1, found):
                return False
            found.append(ki)
        return True

    for t in np.flatnonzero(profile == peak).tolist()[:1]:
        candidates = []
        for k in range(t):
            g = graph.owned[k]
            if g is None or graph.group_pinned[g] or graph.group_batch[g] or g in viewed or k in graph.updates:
                continue
            size = graph.group_size[g]
            if size < smallest or last_read[g] <= t or t in graph.readers[g]:
                continue
            later = readers[g]
            b = next(r for r in later if r > t)
            a = max([k] + [r for r in later if r < t])
            found: list[int] = []
            if not chain(k, b, CHAIN_DEPTH, found):
                continue
            flops = sum(get_op(nodes[j].op).flops(nodes[j]) for j in found + [k])
            candidates.append((flops / size, -(b - a), k, a, b, tuple(found), flops, size))
        candidates.sort()
        for _, _, k, a, b, found, flops, size in candidates[:TRIES]:
            trial = _insert(program, list(found) + [k], b, 1 << 30)
            trial_profile = live_profile(StorageGraph(trial), list(range(len(trial.body))))
            new_peak = max(trial_profile)
            # the peak falls, or stays with fewer statements at it: the sequence cannot go on forever
            if new_peak < peak or (new_peak == peak and trial_profile.count(peak) < at_peak):
                return list(found) + [k], Recomputation(nodes[k], b, tuple(nodes[j] for j in found), flops, size,
                                                        new_peak)
    return None


def _insert(program: Program, chosen: list[int], position: int, serial: int) -> Program:
    """`program` with copies of the statements `chosen` (in that order) right before statement `position`; the
    statements from there on read the copies."""
    nodes = [i.node for i in program.body]
    subst: dict[int, Node] = {}
    body: list[Let] = []
    for k, node in enumerate(nodes):
        if k == position:
            for j in chosen:
                original = nodes[j]
                copy = substitute(original, [subst.get(id(i), i) for i in original.inputs], **{REMAT: serial})
                body.append(Let(copy))
                subst[id(original)] = copy
        inputs = [subst.get(id(i), i) for i in node.inputs]
        new = substitute(node, inputs) if any(a is not b for a, b in zip(inputs, node.inputs)) else node
        if new is not node:
            subst[id(node)] = new
        body.append(Let(new))
    outputs = tuple((name, subst.get(id(v), v)) for name, v in program.outputs)
    return program.rewritten(tuple(body), outputs)


__all__ = ["Recomputation", "recomputation_sequence", "CHAIN_DEPTH"]
