"""Fit a step into a byte budget: the memory plan's total, guaranteed, or one line saying why not.

The budget counts what `deepdsl memory` prints as the total of a step: persistent storage (parameters, optimizer
state, running statistics, hoisted constants) + the step's arena + its workspace, in bytes (MB = 10^6 bytes). Every
step of the program (setup, train, test) must fit it.

Two levers, each a fixed sequence that does not depend on the budget:
- recomputation (`passes/recompute.py`): programs p0 (the program without a budget), p1, p2, ... each recomputing
  one more value before its late uses, at a growing cost in FLOPs;
- the workspace limit: levels l0 (the compile's limit), l0/2, l0/4, ... down to the scratch of one sample of the
  op that needs the most. A smaller limit runs ops over the batch in more chunks: no FLOPs, some time, and sums
  over chunks in another order.

The candidates are the pairs (p_i, l_j) in that order (fewer recomputations first, then larger workspace); the
budget takes the first whose planned total fits. Each candidate's total is a fixed number, so this is monotone: a
larger budget never takes a later candidate (never more recomputation, never a smaller workspace), and a smaller
budget never gives a larger plan. Candidates whose predicted peak of live bytes (`liveness.peak_estimate`, a lower
bound of the arena) plus persistent bytes exceeds the budget are skipped without planning; the others are planned
exactly, so the guarantee is the plan's own figure. Training under a budget is bitwise that of the compile without
one at the workspace limit chosen, with the compiled CPU kernels and with numpy's (the copies compute the same ops
over the same values, with the same chunks, and no kernel's rounding depends on which input it writes over, which
a budget can change: docs/memory.md).

`memory_solver="exact"` also solves the MILP of `passes/recompute_milp.py` at every workspace level and takes its
choice where it costs fewer FLOPs than the greedy candidate (a solve per budget: not monotone).

When no candidate fits, `BudgetError` names the least total reachable (over every candidate: the last levels of
each program), its parts, its recomputations and their cost, the statement at its peak, and where the network file
is known the largest batch that fits (`largest_batch`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

from deepdsl.errors import DeepDSLError, SizeError
from deepdsl.ir import REMAT
from deepdsl.liveness import peak_estimate
from deepdsl.memory_plan import MemoryPlan, workspace_bytes
from deepdsl.ops import get_op
from deepdsl.passes.recompute import recomputation_sequence
from deepdsl.ssa import Let, Program, format_expr
from deepdsl.storage import is_persistent, nbytes

MB = 1e6


@dataclass(frozen=True)
class Fit:
    """How a step was fitted into its budget: `recomputations` of the sequence taken (the statements the step
    recomputes, the `rematerialize` pass's included, are `recomputed(program)`), the workspace limit chosen, the
    candidates planned and the seconds the search took."""

    budget: int
    recomputations: int
    workspace_limit: int | None
    planned: int
    seconds: float
    solver: str = "greedy"         # "greedy", or "exact" / "exact, time limit" (the MILP, proved optimal or not)


class BudgetError(DeepDSLError):
    """No candidate fits the budget. `least` is the plan of the least total reachable, `program` its program;
    `largest_batch` the largest batch whose steps fit (0: none does; None: not searched)."""

    def __init__(self, network: str, step: str, batch: int | None, budget: int, program: Program, least: MemoryPlan,
                 largest_batch: int | None = None):
        self.network, self.step, self.batch, self.budget = network, step, batch, budget
        self.program, self.least, self.largest_batch = program, least, largest_batch
        super().__init__(self._text())

    def with_largest_batch(self, largest: int | None) -> "BudgetError":
        return BudgetError(self.network, self.step, self.batch, self.budget, self.program, self.least, largest)

    def _text(self) -> str:
        plan, program = self.least, self.program
        persistent = sum(p.nbytes for p in plan.persistent)
        copies = recomputed(program)
        extra, total = flops(program)
        names = program.names()
        at = ""
        if 0 <= plan.peak_step < len(program.body) and isinstance(program.body[plan.peak_step], Let):
            node = program.body[plan.peak_step].node
            at = f"; binding statement {names[id(node)]} = {_clip(format_expr(node, names))}"
        what = self.network + (f" (batch {self.batch})" if self.batch else "") + \
            ("" if self.step == "train" else f" ({self.step} step)")
        text = (f"cannot fit {what} in {_mb(self.budget)} MB: the least reachable is {_mb(plan.total_bytes)} MB "
                f"(persistent {_mb(persistent)} + arena {_mb(plan.arena_bytes)} + workspace "
                f"{_mb(plan.workspace_bytes)}) with {len(copies)} recomputation{'s' if len(copies) != 1 else ''} "
                f"(+{100 * extra / max(total, 1):.0f} % FLOPs){at}")
        if self.largest_batch:
            text += f"; the largest batch that fits {_mb(self.budget)} MB is {self.largest_batch}"
        elif self.largest_batch == 0 or self.batch == 1:
            text += f"; not even batch 1 fits {_mb(self.budget)} MB"
        return text


class DoesNotFit(DeepDSLError):
    """A step cannot fit the budget (raised without the search for the least reachable `BudgetError` makes)."""


def _mb(nbytes: int) -> str:
    return f"{nbytes / MB:.2f}"


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def recomputed(program: Program) -> list[tuple[int, Let]]:
    """(body index, statement) of every recomputed copy in `program` (by either recomputation pass)."""
    return [(k, i) for k, i in enumerate(program.body) if isinstance(i, Let) and i.node.attr(REMAT)]


def flops(program: Program) -> tuple[int, int]:
    """(FLOPs of the recomputed copies, FLOPs of the other statements: the step's own) of `program`."""
    extra = own = 0
    for instr in program.body:
        if isinstance(instr, Let):
            cost = get_op(instr.node.op).flops(instr.node)
            if instr.node.attr(REMAT):
                extra += cost
            else:
                own += cost
    return extra, own


def workspace_levels(program: Program, limit: int | None) -> list[int | None]:
    """The workspace limits tried, largest first: `limit`, then halvings down to the scratch of one sample of the
    op that needs the most (the least any limit can give: there that op runs one sample at a time, the others in
    chunks of as many samples as fit, so the workspace is that of one sample per chunk everywhere at less time)."""
    nodes = [i.node for i in program.body if isinstance(i, Let)]
    if limit is None:
        limit = max((get_op(n.op).workspace(n, None).nbytes for n in nodes), default=0)
        levels: list[int | None] = [None]
    else:
        levels = [limit]
    floor = max((get_op(n.op).workspace(n, 0).nbytes for n in nodes), default=0)
    while limit // 2 > floor:
        limit //= 2
        levels.append(limit)
    if levels[-1] != floor:
        levels.append(floor)
    return levels


EXACT_TIME_LIMIT = 60.0      # seconds the exact solver may take for one workspace level


def fit_steps(unplanned: Mapping[str, Program], options, hook=None, network: str = "", explain: bool = True):
    """`pipeline.plan_steps` under `options.memory_budget`: every step's final program and plan, each fitting the
    budget, with its `Fit`; `BudgetError` when some step cannot fit (`DoesNotFit`, sooner, when not `explain`): of
    the step whose least reachable total is the largest, so that the minimum it states fits every step (a test
    step may need more than the training step's minimum)."""
    from deepdsl.pipeline import CompiledStep, run_stages, stage_index, STAGES

    ordering = STAGES[stage_index("schedule"):stage_index("inplace")]
    finishing = STAGES[stage_index("inplace"):]
    budget = options.memory_budget
    if options.memory_solver not in (None, "exact"):
        raise ValueError(f"memory_solver must be None (the greedy sequence) or 'exact', got {options.memory_solver!r}")
    ordered = run_stages(unplanned, ordering, options, hook)
    result, failures = {}, []
    start_limit = options.workspace_limit       # the other steps start from the training step's workspace limit
    for step, program in sorted(ordered.items(), key=lambda item: item[0] != "train"):   # the training step first
        start = time.perf_counter()
        persistent = sum(nbytes(leaf) for leaf in program.inputs if is_persistent(leaf))
        planned = 0

        def plan(candidate: Program, limit):
            nonlocal planned
            planned += 1
            return run_stages({step: candidate}, finishing, options.changed(workspace_limit=limit))[step]

        candidates = _Prefixes(program)
        chosen = solver = None
        for count, candidate in enumerate(candidates):
            if persistent + peak_estimate(candidate) > budget:
                continue
            levels = workspace_levels(candidate, start_limit)
            first = plan(candidate, levels[0])
            fixed = first.total_bytes - first.workspace_bytes       # persistent + arena: the same at every level
            if fixed > budget:
                continue                   # the arena alone exceeds it: smaller workspaces cannot help
            limit = next((level for level in levels if fixed + workspace_bytes(first, level) <= budget), False)
            if limit is not False:
                chosen = (count, candidate, limit)
                break
        if options.memory_solver == "exact":      # the MILP's choice where it costs fewer FLOPs than the greedy's
            exact, name = _exact(program, budget, start_limit, plan)
            if exact is not None and (chosen is None or flops(exact[1])[0] < flops(chosen[1])[0]):
                chosen, solver = exact, name
        if chosen is None and not explain:
            raise DoesNotFit(f"{network} ({step} step) does not fit {_mb(budget)} MB")
        if chosen is None:
            least = None
            for candidate in candidates:
                p = plan(candidate, workspace_levels(candidate, start_limit)[-1])
                if least is None or p.total_bytes < least[1].total_bytes:
                    least = (candidate, p)
            final = run_stages({step: least[0]}, finishing[:-1], options)[step]
            failures.append((least[1].total_bytes, step, program, final, least[1]))
            continue
        count, candidate, limit = chosen
        limited = options.changed(workspace_limit=limit)
        final = run_stages({step: candidate}, finishing[:-1], limited, hook)
        plans = run_stages(final, finishing[-1:], limited, hook)
        assert plans[step].total_bytes <= budget, (step, plans[step].total_bytes, budget)
        fit = Fit(budget, count, limit, planned, time.perf_counter() - start, solver or "greedy")
        if step == "train":
            start_limit = limit
        result[step] = CompiledStep(final[step], plans[step], unplanned[step], fit)
    if failures:
        _, step, program, final, least = max(failures, key=lambda failure: failure[0])
        raise BudgetError(network, step, _batch(program), budget, final, least)
    return {step: result[step] for step in ordered}


def _exact(program: Program, budget: int, start_limit, plan):
    """The exact model's (`passes/recompute_milp.py`) least-FLOPs recomputation over the workspace levels (as the
    greedy search orders them: fewer FLOPs first, then the larger workspace), each solve within
    `EXACT_TIME_LIMIT`: ((options chosen, program, limit), solver name), or (None, None) when it finds none (the
    greedy sequence is then searched)."""
    try:
        from deepdsl.passes import recompute_milp
        import scipy.optimize  # noqa: F401
    except ImportError:
        raise DeepDSLError('the exact memory solver needs scipy: pip install "deepdsl[budget]"') from None
    best = None
    for limit in workspace_levels(program, start_limit):
        solution = recompute_milp.solve(program, budget, lambda candidate: plan(candidate, limit).total_bytes,
                                        EXACT_TIME_LIMIT)
        if solution is not None and (best is None or solution.flops < best[1].flops):
            best = (limit, solution)
            if solution.flops == 0:
                break                      # nothing recomputed: no smaller workspace can cost less
    if best is None:
        return None, None
    limit, solution = best
    return (solution.chosen, solution.program, limit), "exact" if solution.optimal else "exact, time limit"


class _Prefixes:
    """The program, then each program of its recomputation sequence: made as they are asked for, kept for another
    pass."""

    def __init__(self, program: Program):
        self._made = [program]
        self._rest = (candidate for candidate, _ in recomputation_sequence(program))

    def __iter__(self):
        k = 0
        while True:
            if k == len(self._made):
                following = next(self._rest, None)
                if following is None:
                    return
                self._made.append(following)
            yield self._made[k]
            k += 1


def _batch(program: Program) -> int | None:
    return next((leaf.shape[0] for leaf in program.inputs if leaf.op == "input" and leaf.attr("role") == "data"
                 and leaf.shape), None)


def largest_batch(loop, options, recompute: bool = True, start: int | None = None, below: int | None = None
                  ) -> int | None:
    """The largest batch of `loop`'s network file (loaded again at other batches) whose steps fit
    `options.memory_budget`; with `recompute` False, without recomputation or workspace changes (the plan the
    compile makes without a budget). Searched by doubling from `start`, then bisection; `below`: a batch known not
    to fit. None when batch 1 does not fit or the network file is not known."""
    from deepdsl.dsl import Overrides
    from deepdsl.loader import load
    from deepdsl.pipeline import compile_without_search as compile_loop

    if loop.source is None:
        return None
    image = loop.overrides.image if loop.overrides is not None else None
    budget = options.memory_budget

    def fits(batch: int) -> bool:
        try:                    # a value or plan beyond any machine (`ir.MAX_BYTES`) fits no budget
            other = load(loop.source, Overrides(batch=batch, image=image))
            if not recompute:
                compiled = compile_loop(other, options.changed(memory_budget=None))
                return all(s.plan.total_bytes <= budget for s in compiled.steps.values())
            compile_loop(other, options, explain=False)
        except (DoesNotFit, SizeError):
            return False
        return True

    if not fits(1):
        return None
    low, high = 1, below
    if high is None:                          # low fits; find a high that does not
        high = max(start or 2, 2)
        while fits(high):
            low, high = high, high * 2
            if high > 1 << 24:
                return low
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


__all__ = ["Fit", "BudgetError", "DoesNotFit", "fit_steps", "largest_batch", "recomputed", "flops",
           "workspace_levels"]
