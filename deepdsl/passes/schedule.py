"""Memory-aware scheduling: among the valid orders of an SSA program, pick one with a low peak of live bytes.

Greedy list scheduling over the dependency graph (each statement after the statements defining its inputs; a
statement writing a parameter's new value over the parameter comes after every other reader of the old value, so
the update can run in place). At each step the scheduler picks, among the ready statements, by one of a few
priorities, and keeps the order whose simulated peak is lowest (the input order is one of the candidates, so the
pass never makes the peak worse than it was):

- `net`: the statement that adds the fewest bytes (its output minus the storage it is the last reader of),
  ties by input order: parameter updates run as soon as their gradient exists, so the gradient and the
  activations it read die early; a gradient's small consumers run before the large ones that free it;
- `frees-first`: any statement that adds no bytes, else the input order (a depth-first order: one branch at a time);
- `input`: the input order itself.

Max pooling and its argmax are scheduled next to each other, the argmax first: the pooled input then dies at the
pooling, whose output takes over the input's storage (see `deepdsl.memory_plan`). The peak is simulated as the
memory planner counts it: sizes rounded to the arena alignment, views free, a statement over a same-shape input
that dies there and that its kernel may overwrite reusing that input's storage, a pooling over an input that dies
there sharing that input's bytes. Runs in O((n + e) log n).
Guarantees: same statements, each after its inputs; same inputs and outputs.
"""
from __future__ import annotations

import heapq

from deepdsl.ir import Node
from deepdsl.ops import get_op
from deepdsl.program import Free, Let, Program
from deepdsl.storage import is_batch_input, is_inline, is_persistent, is_view, nbytes
from deepdsl_runtime.contract import placed_size


class _Graph:
    """Dependencies and storage of a Free-less program, as integer-indexed lists for speed."""

    def __init__(self, program: Program):
        lets = [i.node for i in program.body]
        self.nodes = lets
        n = len(lets)
        index = {id(node): k for k, node in enumerate(lets)}
        self.preds: list[set[int]] = [set() for _ in range(n)]
        # storage groups: every batch input and every non-view statement owns one; views join their input's group
        self.group_of: dict[int, int] = {}        # id(value) -> group number
        self.group_size: list[int] = []
        self.group_pinned: list[bool] = []        # persistent, or holding a program output: never freed
        self.group_shape: list[tuple] = []
        self.group_batch: list[bool] = []

        def new_group(value: Node, pinned: bool) -> int:
            self.group_of[id(value)] = len(self.group_size)
            self.group_size.append(placed_size(nbytes(value)))
            self.group_pinned.append(pinned)
            self.group_shape.append(value.shape)
            self.group_batch.append(is_batch_input(value))
            return len(self.group_size) - 1

        for leaf in program.inputs:
            new_group(leaf, is_persistent(leaf))
        for k, node in enumerate(lets):
            for i in node.inputs:
                if id(i) in index:
                    self.preds[k].add(index[id(i)])
            if is_view(node) and id(node.inputs[0]) in self.group_of:
                self.group_of[id(node)] = self.group_of[id(node.inputs[0])]
            else:
                new_group(node, False)
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
        # bytes each statement allocates; parameter updates will be written over their parameter, after every
        # other reader of the old value (write-after-read edges)
        self.updates = _update_targets(program, index, self)
        self.alloc = [0 if is_view(node) or k in self.updates else self.group_size[self.group_of[id(node)]]
                      for k, node in enumerate(lets)]
        self.owned = [None if is_view(node) else self.group_of[id(node)] for node in lets]
        # max pooling and its argmax over the same input with the same window: run together
        self.partner: dict[int, int] = {}
        pools = {(id(node.inputs[0]), node.attrs): k for k, node in enumerate(lets) if node.op == "max_pool"}
        for k, node in enumerate(lets):
            if node.op == "max_pool_argmax":
                p = pools.get((id(node.inputs[0]), node.attrs))
                if p is not None:
                    self.partner[k], self.partner[p] = p, k

    def reuses(self, k: int, dying: list[int]) -> bool:
        """Whether statement k can write over the storage of a same-shape input group that dies (an elementwise
        statement over any input, other ops over the inputs their kernel may overwrite)."""
        node = self.nodes[k]
        if self.alloc[k] == 0 or not dying:
            return False
        positions = get_op(node.op).overwritable(node)
        if not positions:
            return False
        groups = {self.group_of.get(id(node.inputs[j])) for j in positions}
        return any(g in groups and self.group_shape[g] == node.shape and not self.group_batch[g]
                   and self.group_size[g] == self.alloc[k] for g in dying)

    def taken_over(self, k: int, dying: list[int]) -> int:
        """Bytes statement k's output shares with the input whose storage it takes over from the start, when that
        input dies here (pooling, see `Op.takes_over`): its output and that input together take the larger size."""
        node = self.nodes[k]
        j = get_op(node.op).takes_over
        if j is None or self.alloc[k] == 0:
            return 0
        g = self.group_of.get(id(node.inputs[j]))
        if g is None or g not in dying or self.group_batch[g]:
            return 0
        return min(self.alloc[k], self.group_size[g])


def _update_targets(program: Program, index: dict[int, int], graph: _Graph) -> dict[int, int]:
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


def _reads_safely(node: Node, graph: _Graph, group: int) -> bool:
    """A statement may overwrite a storage it reads only elementwise, reading it at its own shape."""
    inside = [i for i in node.inputs if graph.group_of.get(id(i)) == group]
    return not inside or (node.op == "ew" and all(i.shape == node.shape for i in inside))


def _descendants(k: int, graph: _Graph) -> set[int]:
    seen: set[int] = set()
    stack = [k]
    while stack:
        for s in graph.succs[stack.pop()]:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen


def _list_schedule(graph: _Graph, priority: str) -> list[int]:
    n = len(graph.nodes)
    waiting = [len(p) for p in graph.preds]
    remaining = [set(r) for r in graph.readers]
    freed = [0] * n                      # bytes statement k frees if run now (it is the last reader)
    for g, readers in enumerate(remaining):
        if len(readers) == 1 and not graph.group_pinned[g]:
            freed[next(iter(readers))] += graph.group_size[g]

    def key(k: int) -> tuple:
        net = graph.alloc[k] - freed[k]
        if priority == "net":
            return (net, k)
        if priority == "frees-first":
            return (net > 0, k)
        return (k,)

    heap = [(key(k), k) for k in range(n) if waiting[k] == 0]
    heapq.heapify(heap)
    done = [False] * n
    order: list[int] = []

    def run(k: int) -> None:
        done[k] = True
        order.append(k)
        for g in graph.reads[k]:
            readers = remaining[g]
            readers.discard(k)
            if len(readers) == 1 and not graph.group_pinned[g]:
                last = next(iter(readers))
                freed[last] += graph.group_size[g]
                if waiting[last] == 0 and not done[last]:
                    heapq.heappush(heap, (key(last), last))
        for s in graph.succs[k]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(heap, (key(s), s))

    while heap:
        entry, k = heapq.heappop(heap)
        if done[k] or entry != key(k):
            continue                      # stale entry (its key changed) or already run
        partner = graph.partner.get(k)
        if partner is not None and not done[partner] and waiting[partner] == 0:
            first, second = (partner, k) if graph.nodes[k].op == "max_pool" else (k, partner)
            run(first)
            run(second)
        else:
            run(k)
    assert len(order) == n, "dependency cycle in schedule"
    return order


def simulated_peak(graph: _Graph, order: list[int]) -> int:
    """Peak of live bytes of `order`, counted as the memory planner counts them (see the module docstring)."""
    batch = sum(graph.group_size[g] for g in range(len(graph.group_size)) if graph.group_batch[g])
    return max(live_profile(graph, order), default=batch)


def live_profile(graph: _Graph, order: list[int]) -> list[int]:
    """Live bytes while each statement of `order` runs (its output included), as `simulated_peak` counts them."""
    remaining = [len(r) for r in graph.readers]
    live = sum(graph.group_size[g] for g in range(len(remaining)) if graph.group_batch[g])
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
        transient = live if graph.reuses(k, dying) else live + graph.alloc[k] - graph.taken_over(k, dying)
        profile.append(transient)
        live += graph.alloc[k] - sum(graph.group_size[g] for g in dying)
    return profile


def storage_graph(program: Program) -> _Graph:
    """Dependencies, storage groups and their sizes of a program without Free statements (for `live_profile`)."""
    return _Graph(program)


def _views_at_first_use(graph: _Graph, order: list[int]) -> list[int]:
    """Move each view (free to make: a reshape) to just before its first reader, where a reader sees it."""
    readers = [[] for _ in graph.nodes]
    for k, node in enumerate(graph.nodes):
        for p in graph.preds[k]:
            readers[p].append(k)
    deferred = {k for k in order if is_view(graph.nodes[k]) and readers[k]}
    result: list[int] = []
    emitted: set[int] = set()

    def emit(k: int) -> None:
        for p in graph.preds[k]:
            if p in deferred and p not in emitted:
                emit(p)
        emitted.add(k)
        result.append(k)

    for k in order:
        if k not in deferred:
            emit(k)
    emit = None   # the recursive closure refers to itself: break the cycle so reference counting frees the graph
    return result


PRIORITIES = ("net", "frees-first", "input")


def schedule_for_memory(program: Program, priorities: tuple[str, ...] = PRIORITIES) -> Program:
    """The program reordered for a low peak of live bytes (see the module docstring)."""
    if any(isinstance(i, Free) or i.into is not None for i in program.body):
        raise ValueError("schedule_for_memory runs before the in-place and dealloc passes")
    if len(program.body) < 2:
        return program
    graph = _Graph(program)
    best = None
    for priority in priorities:
        order = _list_schedule(graph, priority)
        peak = simulated_peak(graph, order)
        if best is None or peak < best[0]:
            best = (peak, order)
    order = _views_at_first_use(graph, best[1])
    return Program(program.name, program.inputs, tuple(Let(graph.nodes[k]) for k in order), program.outputs)


def peak_estimate(program: Program) -> int:
    """The simulated peak of the program's current order (for tests and what-if reports)."""
    return simulated_peak(_Graph(program), list(range(len(program.body))))


__all__ = ["schedule_for_memory", "simulated_peak", "live_profile", "storage_graph", "peak_estimate", "is_inline"]
