"""Recomputation to a peak of live bytes, solved as a mixed-integer linear program (Checkmate's question on this IR).

The options are the ones the greedy pass (`passes/recompute.py`) takes one at a time: a statement's output (no
program output, no batch input, not read through a view) dropped over a gap between two consecutive uses (a, b)
and recomputed right before b, after the chain of its inputs that are no longer alive at b (at most `CHAIN_DEPTH`
links). One binary variable per option; minimize the FLOPs of the chosen options subject to, at every statement t,

    live(t) - sum of the sizes of the options whose gap holds t + sum of the chains' bytes of options made at t <= M

where live(t) is the predicted live bytes of the program without recomputation (`liveness.live_profile`), and one
constraint per pair of options that cannot both be taken: an option needs its inputs at b, so no input may be
dropped over a gap holding b. The model counts an option's copy as taking the bytes the value held at b, so it can
differ from the exact plan by the chains' order of frees; `solve` therefore plans the result exactly and lowers M
by the excess until the planned figure fits (or gives up after `ROUNDS`).

Needs scipy (`pip install "deepdsl[budget]"`: `scipy.optimize.milp`, the HiGHS solver); it is the oracle the
benchmark compares the greedy sequence with (`benchmarks/memory_budget.py`), under a time limit.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from deepdsl.ir import REMAT, substitute
from deepdsl.liveness import StorageGraph, live_profile
from deepdsl.passes.recompute import Recomputable, insert_copies
from deepdsl.ssa import Program
from deepdsl.storage import is_persistent

ROUNDS = 6


@dataclass(frozen=True)
class Option:
    value: int                     # statement index of the value
    before: int                    # its last use before the gap
    after: int                     # its first use after: the copy is made right before it
    chain: tuple[int, ...]         # statements recomputed with it, inputs first
    size: int
    chain_bytes: int
    flops: int
    needs: tuple[int, ...]         # groups that must be alive at `after` (inputs of the value and of its chain)


@dataclass(frozen=True)
class Solution:
    program: Program               # the program with the chosen recomputations
    flops: int                     # their FLOPs
    options: int                   # how many options the model had
    chosen: int
    optimal: bool                  # the solver proved optimality (else: the time limit's best)
    seconds: float


def options(program: Program, smallest: int = 1) -> tuple[StorageGraph, list[int], list[Option]]:
    """The drop options of `program` (see the module docstring): (its storage graph, live profile, options)."""
    model = Recomputable(program)
    graph, nodes = model.graph, model.nodes
    profile = live_profile(graph, list(range(len(nodes))))
    result = []
    for k in range(len(nodes)):
        g = model.droppable(k)
        if g is None or graph.group_size[g] < smallest:
            continue
        uses = [k] + model.readers[g]
        for a, b in zip(uses, uses[1:]):
            found = model.chain(k, b) if b - a > 1 else None
            if found is None:
                continue
            needs = {graph.group_of[id(i)] for j in found + [k] for i in nodes[j].inputs
                     if id(i) in graph.group_of and not (i.is_leaf and is_persistent(i))}
            needs -= {graph.owned[j] for j in found}
            result.append(Option(k, a, b, tuple(found), graph.group_size[g],
                                 sum(graph.group_size[graph.owned[j]] for j in found), model.flops(found + [k]),
                                 tuple(sorted(needs))))
    return graph, profile, result


def choose(profile: list[int], opts: list[Option], graph: StorageGraph, limit: int, time_limit: float):
    """The options to take so that the modelled live bytes stay within `limit` at least FLOPs: (chosen indices,
    proved optimal) or None when the model has no solution (or the solver found none in time)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n, m = len(profile), len(opts)
    rows, cols, vals = [], [], []
    for j, o in enumerate(opts):
        for t in range(o.before + 1, o.after):
            rows.append(t)
            cols.append(j)
            vals.append(-o.size)
        if o.chain_bytes:
            rows.append(o.after)
            cols.append(j)
            vals.append(o.chain_bytes)
    upper = [limit - p for p in profile]
    # conflicts: an option needs its inputs alive at its `after`; none of them may be dropped over a gap holding it
    gaps_of: dict[int, list[int]] = {}
    for j, o in enumerate(opts):
        gaps_of.setdefault(graph.owned[o.value], []).append(j)
    extra = n
    for j, o in enumerate(opts):
        for g in o.needs:
            for i in gaps_of.get(g, ()):
                other = opts[i]
                if other.before < o.after < other.after:
                    rows += [extra, extra]
                    cols += [j, i]
                    vals += [1, 1]
                    upper.append(1)
                    extra += 1
    if m == 0:
        return ([], True) if max(profile, default=0) <= limit else None
    matrix = coo_matrix((vals, (rows, cols)), shape=(extra, m)).tocsr()
    cost = np.array([o.flops for o in opts], dtype=np.float64)
    result = milp(cost, integrality=np.ones(m), bounds=Bounds(0, 1),
                  constraints=LinearConstraint(matrix, -np.inf, np.array(upper, dtype=np.float64)),
                  options={"time_limit": time_limit, "disp": False})
    if result.x is None:
        return None
    return [j for j in range(m) if result.x[j] > 0.5], result.status == 0


def apply(program: Program, opts: list[Option], chosen: list[int]) -> Program:
    """`program` with the chosen options' copies, made right before their `after` statements (copies at one
    statement in program order, inputs first), each statement's copies with a `remat` attribute of their own."""
    at: dict[int, set[int]] = {}
    for j in chosen:
        at.setdefault(opts[j].after, set()).update(opts[j].chain + (opts[j].value,))
    first = max((i.node.attr(REMAT, 0) for i in program.body), default=0) + 1
    serial = {position: first + n for n, position in enumerate(sorted(at))}
    return insert_copies(program, {position: sorted(statements) for position, statements in at.items()},
                         lambda original, inputs, position, _: substitute(original, inputs,
                                                                          **{REMAT: serial[position]}))


def solve(program: Program, budget: int, planned_total, time_limit: float = 600.0) -> Solution | None:
    """The least-FLOPs recomputation whose planned figure (`planned_total(program)`, e.g. the plan's total bytes)
    is at most `budget`: solve the model with the live-bytes limit that figure allows (the budget less what the
    figure counts besides live bytes), plan the result, lower the limit by the excess, up to `ROUNDS` times."""
    start = time.perf_counter()
    graph, profile, opts = options(program, max(max(live_profile(StorageGraph(program), list(range(len(
        program.body)))), default=0) // 1000, 1))
    limit = budget - (planned_total(program) - max(profile, default=0))
    for _ in range(ROUNDS):
        left = time_limit - (time.perf_counter() - start)
        if left <= 0:
            return None
        found = choose(profile, opts, graph, limit, left)
        if found is None:
            return None
        chosen, optimal = found
        result = apply(program, opts, chosen)
        got = planned_total(result)
        if got <= budget:
            return Solution(result, sum(opts[j].flops for j in chosen), len(opts), len(chosen), optimal,
                            time.perf_counter() - start)
        limit -= got - budget
    return None


def optimal_curve(loop, budgets: list[int], time_limit: float = 600.0) -> list[dict | None]:
    """The model's least-FLOPs recomputation of `loop`'s training step at each budget (planned total bytes), at the
    smallest workspace limit (0: one sample per chunk, which leaves the arena the most room): per budget None (no
    solution in time) or its planned total, extra FLOPs % of the step's, whether the solver proved it optimal and
    the seconds it took. The benchmark's oracle (`benchmarks/memory_budget.py`)."""
    from deepdsl.budget import flops
    from deepdsl.pipeline import CompileOptions, STAGES, compile_without_search, run_stages, stage_index

    unplanned = compile_without_search(loop).steps["train"].unplanned
    program = run_stages({"train": unplanned}, STAGES[stage_index("schedule"):stage_index("inplace")],
                         CompileOptions())["train"]
    options = CompileOptions(workspace_limit=0)

    def total(candidate: Program) -> int:
        return run_stages({"train": candidate}, STAGES[stage_index("inplace"):], options)["train"].total_bytes

    curve = []
    for budget in budgets:
        solution = solve(program, budget, total, time_limit)
        if solution is None:
            curve.append(None)
            continue
        extra, own = flops(solution.program)
        curve.append({"total": total(solution.program), "extra_percent": 100.0 * extra / max(own, 1),
                      "optimal": solution.optimal, "seconds": solution.seconds})
    return curve


__all__ = ["Option", "Solution", "options", "choose", "apply", "solve", "optimal_curve"]
