"""Liveness: when each storage of an SSA program is in use, and how many bytes are live at each instruction.

Which values share a storage is `deepdsl.storage.analyze`; this module says when those storages are live, and is
the one model of live bytes that scheduling, rematerialization, dealloc, the memory planner and the memory table
read. It has two views of the same quantity:

- **After the memory passes** (in-place statements and `Free`s decided): `live_ranges` gives every arena storage
  one `LiveRange`, half-open over body indices: `begin` is the index of the `Let` defining its root (0 for a batch
  input, live when the step starts), `end` the index of the first `Free` naming one of its values, or `len(body)`
  when it holds a program output or is never freed. `deaths` says after which statement each storage is read for
  the last time, which is where dealloc frees it. `live_bytes` sums sizes over ranges at every index, a storage
  and the one that takes it over (see `deepdsl.memory_plan`) counted once at their shared statement;
  `changes_at` lists the ranges starting and ending at each index, the order in which the runtime's pool sees
  allocations and frees.
- **Before them** (a program of `Let`s only, in a candidate order): `StorageGraph` groups the values into the
  storages they will have and predicts the in-place decisions the later passes make, and `live_profile` gives the
  live bytes while each statement of an order runs, so the scheduler can compare orders and rematerialization can
  see the peak without running the passes: sizes rounded to the arena alignment, views free, a parameter's new
  value written over the parameter, a statement over a same-shape input that dies there and that its kernel may
  overwrite reusing that input's storage (the in-place pass), a statement taking over an input that dies there
  sharing that input's bytes (the planner), every other storage freed right after its last reader (dealloc).

Guarantee: for a program as the scheduling and rematerialization stages leave it whose updates are all written in
place (`updates_in_place`: every training step of a network), `peak_estimate(program)` equals `peak_live_bytes` of
the plan of `insert_frees(compute_in_place(program))` with in-place activations and takeovers (the compile
defaults): the prediction makes the in-place pass's decisions (`StorageGraph.reuses`), frees where dealloc frees,
and counts a takeover pair once at the statement they share, as the planner does. The planner keeps a takeover
only where it lowers the peak, which never changes the peak. Tests check the equality on every network in
`networks/` and on random programs and networks.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepdsl.ir import Node
from deepdsl.ops import get_op
from deepdsl.ssa import Free, Program
from deepdsl.storage import Storage, StorageInfo, analyze, is_batch_input, is_persistent, is_view, nbytes
from deepdsl_runtime.contract import placed_size


# ---------------------------------------------------------------------------------------------------------------
# after the memory passes: live ranges of a program with its in-place statements and frees

@dataclass(frozen=True, slots=True)
class LiveRange:
    """One arena storage, in use over body indices [begin, end) (begin inclusive, end exclusive), `size` bytes
    placed in the arena."""

    storage: StorageInfo
    begin: int
    end: int
    size: int


def _order(program: Program):
    """Sort key of storages: by begin, then by definition (inputs first), then by the program's input order. Node
    serials depend on which equal leaves earlier compiles left alive in the hash-cons cache, so they must not
    decide an order."""
    position = {id(leaf): k for k, leaf in enumerate(program.inputs)}
    return lambda info: (info.begin, info.defined_at[id(info.root)], position.get(id(info.root), -1))


def live_ranges(program: Program, storage: Storage | None = None,
                freed: tuple[list[int], int] | None = None) -> list[LiveRange]:
    """The live range of every arena storage of `program`, in allocation order (see the module docstring). A
    program without frees keeps every storage to the end of the body; every range covers at least one index.
    `freed` (`dealloc_positions` of a program without frees): the ranges of the program dealloc makes of it,
    indexed in that program, without making it."""
    storage = analyze(program) if storage is None else storage
    infos = sorted(storage.arena(), key=_order(program))
    ranges = []
    if freed is not None:
        at, n = freed
        for info in infos:
            begin = at[info.begin] if info.begin < len(at) else n
            end = n if info.output else at[info.last_use] + 1
            ranges.append(LiveRange(info, begin, max(end, begin + 1), placed_size(nbytes(info.root))))
        return ranges
    n = len(program.body)
    free_index: dict[int, int] = {}
    for k, instr in enumerate(program.body):
        if isinstance(instr, Free):
            for value in instr.nodes:
                free_index.setdefault(id(storage.root[id(value)]), k)
    for info in infos:
        end = n if info.output else free_index.get(id(info.root), n)
        ranges.append(LiveRange(info, max(info.begin, 0), max(end, info.begin + 1), placed_size(nbytes(info.root))))
    return ranges


def dealloc_positions(program: Program, storage: Storage | None = None) -> tuple[list[int], int]:
    """(where each statement of `program`, which has no frees, lands in the program dealloc makes of it, that
    program's length): dealloc puts one `Free` right after each statement of `deaths`."""
    dying = deaths(program, storage)
    at, shift = [], 0
    for k in range(len(program.body)):
        at.append(k + shift)
        shift += k in dying
    return at, len(program.body) + shift


def deaths(program: Program, storage: Storage | None = None) -> dict[int, list[StorageInfo]]:
    """Body index -> the arena storages holding no program output whose last use (the last statement defining or
    reading a value stored there) it is, in allocation order."""
    storage = analyze(program) if storage is None else storage
    result: dict[int, list[StorageInfo]] = {}
    for info in storage.arena():
        if not info.output:
            result.setdefault(info.last_use, []).append(info)
    key = _order(program)
    return {k: sorted(infos, key=key) for k, infos in result.items()}


def live_bytes(intervals: list[tuple[int, int]], sizes: list[int], pairs=(), length: int | None = None) -> list[int]:
    """Live bytes at each index 0 .. length - 1 (default: up to the last end) of blocks of `sizes` live over the
    half-open `intervals`; for each pair `(a, b)` of `pairs` (b takes over a, beginning where a ends next) the two
    count once, at the larger size, at b's first index."""
    if length is None:
        length = max((e for _, e in intervals), default=0)
    delta = [0] * (length + 1)
    for (b, e), s in zip(intervals, sizes):
        if b < length:
            delta[b] += s
            delta[min(e, length)] -= s
    for a, b in pairs:
        t = intervals[b][0]
        if t < length:
            common = min(sizes[a], sizes[b])
            delta[t] -= common
            delta[t + 1] += common
    result = []
    live = 0
    for k in range(length):
        live += delta[k]
        result.append(live)
    return result


def peak_bytes(intervals: list[tuple[int, int]], sizes: list[int], pairs=()) -> int:
    """Largest `live_bytes` at any index: no packing of the blocks can use a smaller arena."""
    return max(live_bytes(intervals, sizes, pairs), default=0)


def changes_at(intervals: list[tuple[int, int]]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(index -> blocks beginning there, index -> blocks ending there), each list in block order."""
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for k, (b, e) in enumerate(intervals):
        starts.setdefault(b, []).append(k)
        ends.setdefault(e, []).append(k)
    return starts, ends


# ---------------------------------------------------------------------------------------------------------------
# before the memory passes: predicted live bytes of an order of a Free-less program

class StorageGraph:
    """Dependencies and predicted storage of a program of `Let`s without in-place statements, as integer-indexed
    lists for speed: every batch input and every non-view statement owns a storage group, views join their
    input's group; a parameter's new value is predicted to be written over the parameter when the in-place pass
    can do so (every other reader of the old value can run first: those write-after-read edges are added to the
    dependencies)."""

    def __init__(self, program: Program):
        if any(isinstance(i, Free) or i.into is not None for i in program.body):
            raise ValueError("a storage graph is made before the in-place and dealloc passes")
        lets = [i.node for i in program.body]
        self.nodes = lets
        n = len(lets)
        index = {id(node): k for k, node in enumerate(lets)}
        self.preds: list[set[int]] = [set() for _ in range(n)]
        self.group_of: dict[int, int] = {}        # id(value) -> group number
        self.group_size: list[int] = []
        self.group_pinned: list[bool] = []        # persistent, or holding a program output: never freed
        self.group_batch: list[bool] = []

        def new_group(value: Node, pinned: bool) -> int:
            self.group_of[id(value)] = len(self.group_size)
            self.group_size.append(placed_size(nbytes(value)))
            self.group_pinned.append(pinned)
            self.group_batch.append(is_batch_input(value))
            return len(self.group_size) - 1

        self.owned: list[int | None] = []        # group each statement allocates (None: a view in its input's)
        for leaf in program.inputs:
            new_group(leaf, is_persistent(leaf))
        for k, node in enumerate(lets):
            for i in node.inputs:
                if id(i) in index:
                    self.preds[k].add(index[id(i)])
            if is_view(node) and id(node.inputs[0]) in self.group_of:
                self.group_of[id(node)] = self.group_of[id(node.inputs[0])]
                self.owned.append(None)
            else:
                self.owned.append(new_group(node, False))
        for _, node in program.outputs:
            if id(node) in self.group_of:
                self.group_pinned[self.group_of[id(node)]] = True
        # groups each statement reads, and the statements reading each group
        self.reads: list[tuple[int, ...]] = []
        self.readers: list[set[int]] = [set() for _ in self.group_size]
        for k, node in enumerate(lets):
            groups = tuple({self.group_of[id(i)] for i in node.inputs if id(i) in self.group_of})
            self.reads.append(groups)
            for g in groups:
                self.readers[g].add(k)
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for k in range(n):
            for p in self.preds[k]:
                self.succs[p].append(k)
        # bytes each statement allocates: none for views and for updates written over their parameter
        self.updates = _update_targets(program, index, self)
        self.alloc = [0 if g is None or k in self.updates else self.group_size[g] for k, g in enumerate(self.owned)]

    def reuses(self, k: int, dying: list[int]) -> int | None:
        """The group whose storage statement k will write over, as the in-place pass decides it (None: none): of an
        input its kernel may overwrite (`Op.overwritable`), of its shape and dtype, dying there, in no batch
        input's storage, which the statement reads only through such inputs at its own shape. The storage may be
        larger than the statement's output (a view's: a slice of a concatenation): the output then lives in it."""
        node = self.nodes[k]
        if self.alloc[k] == 0 or not dying:
            return None
        positions = get_op(node.op).overwritable(node)
        if not positions:
            return None
        allowed = [node.inputs[j] for j in positions]
        for candidate in allowed:
            g = self.group_of.get(id(candidate))
            if g is None or g not in dying or self.group_batch[g]:
                continue
            if candidate.shape != node.shape or candidate.dtype != node.dtype:
                continue
            if any(self.group_of.get(id(i)) == g and (i.shape != node.shape or not any(i is a for a in allowed))
                   for i in node.inputs):
                continue
            return g
        return None

    def taken_over(self, k: int, dying: list[int], size: list[int] | None = None) -> int:
        """Bytes statement k's output shares with the input whose storage it takes over from the start, as the
        planner decides it: when that input dies here, is no batch input and is read through no other input
        (pooling, see `Op.takes_over`): its output and that input together take the larger size. `size`: the
        groups' storage sizes where they differ from `group_size` (`live_profile`)."""
        node = self.nodes[k]
        j = get_op(node.op).takes_over
        if j is None or self.alloc[k] == 0:
            return 0
        g = self.group_of.get(id(node.inputs[j]))
        if g is None or g not in dying or self.group_batch[g]:
            return 0
        if any(self.group_of.get(id(i)) == g for n, i in enumerate(node.inputs) if n != j):
            return 0                      # the kernel reads the storage through another input too
        return min(self.alloc[k], (self.group_size if size is None else size)[g])


def _update_targets(program: Program, index: dict[int, int], graph: StorageGraph) -> dict[int, int]:
    """Statement index -> group of the persistent input it will overwrite: a program output named like a persistent
    input, computed by a statement here, that no reader of the old value depends on."""
    leaves = {leaf.name: leaf for leaf in program.inputs if is_persistent(leaf)}
    result: dict[int, int] = {}
    claimed: set[int] = set()
    for name, value in program.outputs:
        leaf = leaves.get(name)
        k = index.get(id(value))
        if leaf is None or k is None or k in claimed or is_view(value):
            continue
        if value.shape != leaf.shape or value.dtype != leaf.dtype:
            continue
        group = graph.group_of[id(leaf)]
        if not _reads_safely(value, graph, group):
            continue
        # every other reader of the old value must be able to run before k: none may depend on k
        later = _descendants(k, graph)
        others = [r for r in graph.readers[group] if r != k]
        if any(r in later for r in others):
            continue
        claimed.add(k)
        result[k] = group
        for r in others:
            if r not in graph.preds[k]:
                graph.preds[k].add(r)
                graph.succs[r].append(k)
    return result


def _reads_safely(node: Node, graph: StorageGraph, group: int) -> bool:
    """A statement may overwrite a storage it reads only elementwise, reading it at its own shape."""
    inside = [i for i in node.inputs if graph.group_of.get(id(i)) == group]
    return not inside or (node.op == "ew" and all(i.shape == node.shape for i in inside))


def _descendants(k: int, graph: StorageGraph) -> set[int]:
    seen: set[int] = set()
    stack = [k]
    while stack:
        for s in graph.succs[stack.pop()]:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen


def updates_in_place(program: Program, graph: StorageGraph) -> bool:
    """Whether the in-place pass will write every new value of a persistent input straight over it, adding no
    copy: every program output named like a persistent input is that input or a statement of `graph.updates`, and
    no output holds a persistent input's old value under another name. Training steps of networks do; the
    prediction counts no copies, so it is exact only for such programs."""
    index = {id(instr.node): k for k, instr in enumerate(program.body)}
    persistent = {graph.group_of[id(leaf)]: leaf for leaf in program.inputs if is_persistent(leaf)}
    names = {leaf.name for leaf in persistent.values()}
    for name, value in program.outputs:
        if name in names and not (value.is_leaf and value.name == name) and index.get(id(value)) not in graph.updates:
            return False
        leaf = persistent.get(graph.group_of.get(id(value)))
        if leaf is not None and leaf.name != name:
            return False
    return True


def live_profile(graph: StorageGraph, order: list[int]) -> list[int]:
    """Predicted live bytes while each statement of `order` runs, its output included (see the module docstring)."""
    remaining = [len(r) for r in graph.readers]
    size = list(graph.group_size)         # a group written over another's storage takes that storage's size
    live = sum(size[g] for g in range(len(remaining)) if graph.group_batch[g])
    profile = []
    for k in order:
        dying = []
        for g in graph.reads[k]:
            remaining[g] -= 1
            if remaining[g] == 0 and not graph.group_pinned[g]:
                dying.append(g)
        own = graph.owned[k]
        if own is not None and not graph.readers[own] and not graph.group_pinned[own] and graph.alloc[k]:
            dying.append(own)             # never read: freed right after it is made
        reused = graph.reuses(k, dying)
        if reused is not None:
            size[own] = size[reused]      # (counted again below: the storage lives on, holding the output)
            profile.append(live)
            live += size[own] - sum(size[g] for g in dying)
            continue
        profile.append(live + graph.alloc[k] - graph.taken_over(k, dying, size))
        live += graph.alloc[k] - sum(size[g] for g in dying)
    return profile


def simulated_peak(graph: StorageGraph, order: list[int]) -> int:
    """Predicted peak of live bytes of `order`: the largest `live_profile`, or the batch inputs of an empty order."""
    batch = sum(graph.group_size[g] for g in range(len(graph.group_size)) if graph.group_batch[g])
    return max(live_profile(graph, order), default=batch)


def peak_estimate(program: Program) -> int:
    """The predicted peak of live bytes of a Free-less program in its current order."""
    return simulated_peak(StorageGraph(program), list(range(len(program.body))))


__all__ = ["LiveRange", "live_ranges", "dealloc_positions", "deaths", "live_bytes", "peak_bytes", "changes_at",
           "StorageGraph", "updates_in_place", "live_profile", "simulated_peak", "peak_estimate"]
