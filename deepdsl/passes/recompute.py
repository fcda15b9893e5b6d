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
from deepdsl.storage import is_inline, is_persistent, is_view

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
        program = copies_before(program, chosen, recomputation.position, serial)
        yield program, recomputation


class Recomputable:
    """What can be recomputed where in a Free-less program: its storage graph, the statements whose value may be
    dropped and made again (`droppable`), and the chain of values recomputing one needs at a position (`chain`).
    Shared by the greedy sequence and the exact model (`passes/recompute_milp.py`)."""

    def __init__(self, program: Program):
        self.graph = graph = StorageGraph(program)
        self.nodes = graph.nodes
        self.index = {id(node): k for k, node in enumerate(self.nodes)}
        self.readers = [sorted(r) for r in graph.readers]
        self.last_read = [r[-1] if r else -1 for r in self.readers]
        self.viewed = {graph.group_of[id(node)] for k, node in enumerate(self.nodes) if graph.owned[k] is None}

    def droppable(self, k: int) -> int | None:
        """The storage group of statement k if its value may be dropped and recomputed (a statement's own output, no
        program output, no batch input, not read through a view, no parameter update), else None."""
        g = self.graph.owned[k]
        if g is None or self.graph.group_pinned[g] or self.graph.group_batch[g] or g in self.viewed \
                or k in self.graph.updates:
            return None
        return g

    def alive(self, node: Node, position: int) -> bool:
        """Whether `node` can be read at `position` as the program stands (kept until then, or never freed)."""
        if is_inline(node) or (node.is_leaf and is_persistent(node)):
            return True
        g = self.graph.group_of.get(id(node))
        return g is not None and self.last_read[g] >= position

    def chain(self, k: int, position: int, depth: int = CHAIN_DEPTH) -> list[int] | None:
        """The statements to recompute at `position`, inputs first, so that statement k can be: its inputs no longer
        alive there, theirs, ... at most `depth` links; None if some input is neither alive nor recomputable."""
        found: list[int] = []
        return found if self._chain(k, position, depth, found) else None

    def _chain(self, k: int, position: int, depth: int, found: list[int]) -> bool:
        for i in self.nodes[k].inputs:
            if self.alive(i, position):
                continue
            ki = self.index.get(id(i))
            if ki is None or depth == 0 or is_view(i) or self.graph.owned[ki] is None:
                return False
            if ki in found:
                continue
            if not self._chain(ki, position, depth - 1, found):
                return False
            found.append(ki)
        return True

    def flops(self, statements) -> int:
        return sum(get_op(self.nodes[j].op).flops(self.nodes[j]) for j in statements)


def _next(program: Program) -> tuple[list[int], Recomputation] | None:
    """The statements to copy (chain first, value last) and the recomputation that lowers the first statement at the
    peak most cheaply and lowers (peak, statements at the peak); None when none does."""
    if len(program.body) < 3:
        return None
    model = Recomputable(program)
    graph, nodes = model.graph, model.nodes
    profile = np.array(live_profile(graph, list(range(len(nodes)))), dtype=np.int64)
    peak = int(profile.max())
    smallest = max(peak // WORTHWHILE, 1)
    at_peak = int((profile == peak).sum())
    t = int(np.flatnonzero(profile == peak)[0])
    candidates = []
    for k in range(t):
        g = model.droppable(k)
        if g is None:
            continue
        size = graph.group_size[g]
        if size < smallest or model.last_read[g] <= t or t in graph.readers[g]:
            continue
        later = model.readers[g]
        b = next(r for r in later if r > t)
        a = max([k] + [r for r in later if r < t])
        found = model.chain(k, b)
        if found is None:
            continue
        flops = model.flops(found + [k])
        candidates.append((flops / size, -(b - a), k, b, tuple(found), flops, size))
    candidates.sort()
    for _, _, k, b, found, flops, size in candidates[:TRIES]:
        trial = copies_before(program, list(found) + [k], b, 1 << 30)
        trial_profile = live_profile(StorageGraph(trial), list(range(len(trial.body))))
        new_peak = max(trial_profile)
        # the peak falls, or stays with fewer statements at it: the sequence cannot go on forever
        if new_peak < peak or (new_peak == peak and trial_profile.count(peak) < at_peak):
            return list(found) + [k], Recomputation(nodes[k], b, tuple(nodes[j] for j in found), flops, size,
                                                    new_peak)
    return None


def insert_copies(program: Program, at: dict[int, list[int]], copy) -> Program:
    """`program` with copies of statements right before others: `at` maps a body index to the statements copied
    right before it (in that order, inputs first); `copy(original, inputs, position, current)` makes the copy
    made before statement `position` over the inputs as they stand there (`current(node)`: what the statements
    there read for `node`). From each copy on, the
    statements read the copy instead of the original."""
    nodes = [i.node for i in program.body]
    subst: dict[int, Node] = {}
    body: list[Let] = []
    for position, node in enumerate(nodes):
        for j in at.get(position, ()):
            original = nodes[j]
            made = copy(original, [subst.get(id(i), i) for i in original.inputs], position,
                        lambda v: subst.get(id(v), v))
            body.append(Let(made))
            subst[id(original)] = made
        inputs = [subst.get(id(i), i) for i in node.inputs]
        new = substitute(node, inputs) if any(a is not b for a, b in zip(inputs, node.inputs)) else node
        if new is not node:
            subst[id(node)] = new
        body.append(Let(new))
    outputs = tuple((name, subst.get(id(v), v)) for name, v in program.outputs)
    return program.rewritten(tuple(body), outputs)


def copies_before(program: Program, chosen: list[int], position: int, serial: int) -> Program:
    """`program` with copies of the statements `chosen` (in that order) right before statement `position`, marked
    with the `remat` attribute `serial`."""
    return insert_copies(program, {position: chosen},
                         lambda original, inputs, *_: substitute(original, inputs, **{REMAT: serial}))


__all__ = ["Recomputation", "Recomputable", "recomputation_sequence", "insert_copies", "copies_before",
           "CHAIN_DEPTH"]
