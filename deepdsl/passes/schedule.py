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
pooling, whose output takes over the input's storage (see `deepdsl.memory_plan`). The peak of an order is the one
`deepdsl.liveness` predicts (`simulated_peak`), which counts what the in-place pass, dealloc and the planner will
make of it and equals the planned peak. Runs in O((n + e) log n).
Guarantees: same statements, each after its inputs; same inputs and outputs.
"""
from __future__ import annotations

import heapq

from deepdsl.ir import Node
from deepdsl.liveness import StorageGraph, simulated_peak
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import is_view


def _pool_partners(nodes: list[Node]) -> dict[int, int]:
    """Max pooling and its argmax over the same input with the same window, each statement -> the other."""
    partner: dict[int, int] = {}
    pools = {(id(node.inputs[0]), node.attrs): k for k, node in enumerate(nodes) if node.op == "max_pool"}
    for k, node in enumerate(nodes):
        if node.op == "max_pool_argmax":
            p = pools.get((id(node.inputs[0]), node.attrs))
            if p is not None:
                partner[k], partner[p] = p, k
    return partner


def _list_schedule(graph: StorageGraph, partners: dict[int, int], priority: str) -> list[int]:
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
        partner = partners.get(k)
        if partner is not None and not done[partner] and waiting[partner] == 0:
            first, second = (partner, k) if graph.nodes[k].op == "max_pool" else (k, partner)
            run(first)
            run(second)
        else:
            run(k)
    assert len(order) == n, "dependency cycle in schedule"
    return order


def _views_at_first_use(graph: StorageGraph, order: list[int]) -> list[int]:
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


def respects(graph: StorageGraph, order: list[int]) -> bool:
    """Whether `order` runs every statement after all its predecessors in `graph`."""
    position = {k: i for i, k in enumerate(order)}
    return all(position[p] < position[k] for k in order for p in graph.preds[k])


def schedule_for_memory(program: Program, priorities: tuple[str, ...] = PRIORITIES) -> Program:
    """The program reordered for a low peak of live bytes (see the module docstring)."""
    if any(isinstance(i, Free) or i.into is not None for i in program.body):
        raise ValueError("schedule_for_memory runs before the in-place and dealloc passes")
    if len(program.body) < 2:
        return program
    graph = StorageGraph(program)
    partners = _pool_partners(graph.nodes)
    given = list(range(len(program.body)))
    best = None
    for priority in priorities:
        order = _list_schedule(graph, partners, priority)
        peak = simulated_peak(graph, order)
        if best is None or peak < best[0]:
            best = (peak, order)
    # never worse than the order it was given, where that order lets every update be written in place (after all
    # other readers of the value it overwrites: the edges the storage graph adds)
    if respects(graph, given) and simulated_peak(graph, given) < best[0]:
        return program
    order = _views_at_first_use(graph, best[1])
    return program.rewritten(tuple(Let(graph.nodes[k]) for k in order))


__all__ = ["respects", "schedule_for_memory"]
