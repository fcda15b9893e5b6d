"""Rematerialization: recompute a cheap value right before its late uses instead of keeping it alive from the forward
pass to the backward pass.

A value made by a cheap op (`Op.cheap`: elementwise, max and average pooling, LRN: one pass over the inputs) from
inputs that are alive anyway when it is needed again can be computed a second time there. The typical case is the
ReLU after a batch normalization, `r = Max(0, xc * inv_std * gamma + beta)`: the next convolution reads `r` in the
forward pass, and its weight gradient and the ReLU's mask read it again in the backward pass, while the centred
input `xc` and the per-channel vectors are kept until the batch normalization's backward anyway. Keeping `r` costs
its full size for the whole distance between the two passes; recomputing it costs one pass over `xc` and nothing
in memory. Likewise a stride-1 max pooling of an inception module's concatenation, kept for the weight gradient of
the convolution after it while the concatenation is kept for its other branches.

The pass works on the scheduled order, before the in-place and dealloc passes (a scheduler running after it could
move the copies back). Each statement of a cheap op whose value is no program output and has no views is a
candidate, split at each gap between consecutive uses; recomputing it at the first use after a gap frees its storage
over that gap, provided every input it reads is still read at or after that use (so no lifetime grows, and no
statement's live bytes rise). Greedily, while every statement at the peak of the simulated live bytes
(`liveness.live_profile`) lies in the gap of some candidate of at least 1/`WORTHWHILE` of the peak, the largest
candidate covering the first of them is recomputed there; the pass stops at the first peak some statement of which
no recomputation can lower, so every copy it adds helped lower the peak. The copy is the same node with an extra
attribute `remat` (hash-consing would otherwise make it the original), which no op sees (`Node.kwargs`) and the
printer shows as `(recomputed)`; the uses after the gap read the copy.

A piece of a concatenation can also be recomputed as a slice of the concatenation, whatever op made it: an
inception module's branch outputs `b1..b4` are read by their ReLU masks in the backward pass while their
concatenation `c = concat(b1..b4)` is kept for the next module's weight gradients, so the same bytes would be kept
twice; `slice(c)` right before the late use keeps them once. The copy is a `slice` node (with the `remat` attribute)
reading the concatenation, which must be alive at that use, as a recomputation's inputs must.

Cost: one pass of a cheap op per copy (ResNet-50, batch 32: 40 batch-norm ReLU outputs, 188 M elements, against
~740 GFLOP of convolutions per training step). Guarantees: same values (the copy computes the same op over the same
values); statement order unchanged apart from the inserted copies; no statement's simulated live bytes rise.
"""
from __future__ import annotations

import bisect

import numpy as np

from deepdsl.ir import REMAT, Node, make, substitute
from deepdsl.ops import get_op
from deepdsl.liveness import StorageGraph, live_profile
from deepdsl.passes.recompute import insert_copies
from deepdsl.ssa import Free, Program
from deepdsl.storage import is_inline, is_persistent


WORTHWHILE = 1000     # values under 1/1000 of the peak (per-channel vectors) are not worth a recomputation


def rematerialize(program: Program) -> Program:
    """The program with cheap values recomputed before their late uses where that lowers the peak of live bytes
    (see the module docstring)."""
    if any(isinstance(i, Free) or i.into is not None for i in program.body):
        raise ValueError("rematerialize runs before the in-place and dealloc passes")
    if len(program.body) < 3:
        return program
    graph = StorageGraph(program)
    nodes = graph.nodes
    index = {id(node): k for k, node in enumerate(nodes)}
    # last statement reading each storage group, updated as recomputations move late reads to copies
    last_read = [max(r) if r else -1 for r in graph.readers]
    viewed = {graph.group_of[id(node)] for k, node in enumerate(nodes) if graph.owned[k] is None}
    pieces = _concat_pieces(nodes, index)       # statement -> (concatenation statement, axis, start, stop)
    uses = {}                                  # candidate statement -> its reader positions, sorted
    for k, node in enumerate(nodes):
        g = graph.owned[k]
        if not (get_op(node.op).cheap or k in pieces) or g is None or graph.group_pinned[g] or not graph.readers[g] \
                or g in viewed:
            continue                           # (a value read through a view would need the view recomputed too)
        uses[k] = sorted(graph.readers[g])
    if not uses:
        return program
    profile = np.array(live_profile(graph, list(range(len(nodes)))), dtype=np.int64)
    size_of = {k: graph.group_size[graph.owned[k]] for k in uses}
    gaps = _Gaps()
    for k in uses:
        gaps.add(k, uses[k])
    chosen: dict[int, int] = {}                # candidate -> position of its first use after the gap
    sliced: set[int] = set()                   # chosen candidates recomputed as a slice of their concatenation

    def alive_at(node: Node, position: int) -> bool:
        if is_inline(node) or (node.is_leaf and is_persistent(node)):
            return True
        g = graph.group_of.get(id(node))
        return g is not None and last_read[g] >= position

    def sources(k: int, after: int) -> tuple[Node, ...] | None:
        """What recomputing candidate k at `after` reads: its inputs if it is cheap and they are alive then, else
        its concatenation if it is a piece of one made before `after` and alive then; None if neither."""
        if get_op(nodes[k].op).cheap and all(alive_at(i, after) for i in nodes[k].inputs):
            return nodes[k].inputs
        if k in pieces and pieces[k][0] < after and alive_at(nodes[pieces[k][0]], after):
            return (nodes[pieces[k][0]],)
        return None

    def lowering(t: int, smallest: int) -> tuple[int, int, int] | None:
        """The largest candidate whose gap holds statement t and that can be recomputed after it."""
        for k, before, after in gaps.covering(t, size_of):
            if size_of[k] < smallest:
                break
            if sources(k, after) is not None:
                return k, before, after
        return None

    while True:
        peak = int(profile.max())
        smallest = peak // WORTHWHILE
        found = [lowering(t, smallest) for t in np.flatnonzero(profile == peak).tolist()]
        if not found or any(f is None for f in found):
            break                              # some statement at the peak cannot be lowered: stop
        k, before, after = found[0]            # recompute for the first statement at the peak
        read = sources(k, after)
        chosen[k] = after
        if read is not nodes[k].inputs:
            sliced.add(k)
        gaps.drop(k)
        profile[before + 1:after] -= size_of[k]
        last_read[graph.owned[k]] = before
        for i in read:                         # the copy reads its sources at `after`: they were read there or later
            gi = graph.group_of.get(id(i))
            if gi is not None:
                last_read[gi] = max(last_read[gi], after)
            ki = index.get(id(i))
            if ki in uses and ki not in chosen and after not in uses[ki]:
                bisect.insort(uses[ki], after)  # a use of that candidate too: its gaps change
                gaps.drop(ki)
                gaps.add(ki, uses[ki])
    if not chosen:
        return program
    return _insert_copies(program, nodes, chosen, {k: pieces[k] for k in sliced})


def _concat_pieces(nodes: list[Node], index: dict[int, int]) -> dict[int, tuple[int, int, int, int]]:
    """Statement of each piece of a concatenation -> (the concatenation's statement, axis, start, stop) (a value
    concatenated more than once: its first concatenation)."""
    pieces: dict[int, tuple[int, int, int, int]] = {}
    for c, node in enumerate(nodes):
        if node.op != "concat":
            continue
        axis, start = node.attr("axis"), 0
        for piece in node.inputs:
            stop = start + piece.shape[axis]
            k = index.get(id(piece))
            if k is not None and k not in pieces:
                pieces[k] = (c, axis, start, stop)
            start = stop
    return pieces


class _Gaps:
    """The gaps between consecutive uses of the candidates (with at least one statement inside), as arrays."""

    def __init__(self):
        self.rows: list[tuple[int, int, int]] = []       # (candidate, last use before, first use after)
        self.valid: list[bool] = []
        self._arrays = None

    def add(self, k: int, positions: list[int]) -> None:
        for before, after in zip(positions, positions[1:]):
            if after - before > 1:
                self.rows.append((k, before, after))
                self.valid.append(True)
        self._arrays = None

    def drop(self, k: int) -> None:
        for j, row in enumerate(self.rows):
            if row[0] == k:
                self.valid[j] = False
        self._arrays = None

    def covering(self, t: int, size_of: dict[int, int]) -> list[tuple[int, int, int]]:
        """(candidate, before, after) of the valid gaps strictly around t, largest candidate first."""
        if self._arrays is None:
            rows = np.array(self.rows, dtype=np.int64).reshape(-1, 3)
            self._arrays = rows, np.array(self.valid, dtype=bool)
        rows, valid = self._arrays
        hits = rows[valid & (rows[:, 1] < t) & (t < rows[:, 2])].tolist()
        return sorted(map(tuple, hits), key=lambda r: (-size_of[r[0]], r[0]))


def _insert_copies(program: Program, nodes: list[Node], chosen: dict[int, int],
                   sliced: dict[int, tuple[int, int, int, int]]) -> Program:
    at: dict[int, list[int]] = {}
    for k, position in chosen.items():
        at.setdefault(position, []).append(k)

    def copy(original: Node, inputs: list[Node], position: int, current) -> Node:
        k = index[id(original)]
        if k in sliced:                        # the piece, read back out of its concatenation
            c, axis, start, stop = sliced[k]
            return make("slice", (current(nodes[c]),), axis=axis, start=start, stop=stop, **{REMAT: 1})
        return substitute(original, inputs, **{REMAT: original.attr(REMAT, 0) + 1})

    index = {id(node): k for k, node in enumerate(nodes)}
    return insert_copies(program, {p: sorted(ks) for p, ks in at.items()}, copy)
