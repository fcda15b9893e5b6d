"""Memory budgets by recomputation: planned total against extra FLOPs, for the budget search and for baselines.

    python benchmarks/memory_budget.py [--networks NET:BATCH ...] [--steps 12] [--png PATH] [--markdown PATH]
                                       [--json PATH] [--milp-time-limit SECONDS]

Default networks: lenet:500 alexnet:128 vgg16:64 googlenet:128 resnet50:32 (full size). Static planning only: no
program runs, so the figures are the compiler's planned totals of the training step (persistent storage + arena +
workspace, MB = 10^6 bytes) and the FLOPs of its statements (`budget.flops`: recomputed copies over the step's own).

For each network:
- without a budget: the compile's total and the FLOPs its `rematerialize` pass adds (baseline (a), the
  recomputation the compiler does anyway);
- the least reachable total: a compile under a budget of 1 byte, whose `BudgetError` names it;
- a sweep of `--steps` budgets evenly from the total without a budget down to the least reachable, each compiled
  (`compile_without_search`): the planned total, extra FLOPs %, recomputations taken, workspace limit chosen, the
  seconds the budget search took for the training step (`Fit.seconds`) and the compile's wall time beyond a
  compile without a budget;
- baseline (b): Chen et al.'s sqrt(n) segment checkpointing (`passes/checkpointing.py`) of the scheduled,
  rematerialized training step, planned exactly with the default options (and, for comparison with budgets that
  also lower the workspace limit, with workspace limit 0);
- baseline (c): segment checkpointing with the segment count of least planned total among 1, 2, 4, ... up to the
  forward's length (and sqrt(n));
- the budget search at the totals of (b) and (c): the FLOPs it needs to reach them (a budget below the least
  reachable: none reaches them);
- (d) the optimum of the MILP over drop options (`deepdsl.passes.recompute_milp.optimal_curve`, at workspace
  limit 0; needs scipy, left out without it): its model's optimum, not the problem's.

Prints a table per network and the load average; `--png` draws one panel per network (planned total against
extra FLOPs, baselines as markers, matplotlib), `--markdown` writes the tables, `--json` every figure.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import numpy as np
from timing import load_average  # benchmarks/ is on the path of a script run from it

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deepdsl
from deepdsl.budget import BudgetError, flops
from deepdsl.dsl import Overrides
from deepdsl.passes.checkpointing import checkpoint_segments, forward_statements
from deepdsl.pipeline import (
    STAGES,
    CompileOptions,
    compile_without_search,
    run_stages,
    stage_index,
)

DEFAULT_NETWORKS = ["lenet:500", "alexnet:128", "vgg16:64", "googlenet:128", "resnet50:32"]
MB = 1e6
ORDERING = STAGES[stage_index("schedule"):stage_index("inplace")]
FINISHING = STAGES[stage_index("inplace"):]


def _percent(program) -> float:
    extra, own = flops(program)
    return 100.0 * extra / max(own, 1)


def _plan(program, options: CompileOptions | None = None):
    """The exact memory plan of a Free-less scheduled training step (what the compile's memory stages give)."""
    return run_stages({"train": program}, FINISHING, options or CompileOptions())["train"]


def _segment_counts(n: int) -> list[int]:
    counts, k = [], 1
    while k <= n:
        counts.append(k)
        k *= 2
    counts.append(max(1, round(math.sqrt(n))))
    return sorted(set(counts))


def _ours_at(loop, budget: int, least: int) -> dict | None:
    """The budget search at `budget`: its total and extra FLOPs, or None below the least reachable."""
    if budget < least:
        return None
    step = compile_without_search(loop, CompileOptions(memory_budget=budget)).steps["train"]
    return {"budget": budget, "total": step.plan.total_bytes, "extra_percent": _percent(step.program),
            "recomputations": step.fit.recomputations, "workspace_limit": step.fit.workspace_limit}


# ---------------------------------------------------------------------------------------------------------------
# (d) the MILP's optimum. `deepdsl.passes.recompute_milp.optimal_curve(loop, budgets, time_limit)` gives, per
# budget, None (no solution in time) or the planned total and extra FLOPs % of its optimum, as a mapping with
# "total" (bytes) and "extra_percent" (and "optimal", "seconds"). Without scipy the benchmark leaves (d) out.

def _milp_curve(loop, budgets: list[int], time_limit: float) -> list[dict | None] | None:
    try:
        from deepdsl.passes import recompute_milp
    except ImportError:
        return None
    curve = getattr(recompute_milp, "optimal_curve", None)
    if curve is None or time_limit <= 0:
        return None
    points = []
    for budget, point in zip(budgets, curve(loop, budgets, time_limit)):
        if point is None:
            points.append(None)
        elif isinstance(point, dict):
            points.append({"budget": budget, **point, "total": int(point["total"]),
                           "extra_percent": float(point["extra_percent"])})
        else:
            total, percent = point[0], point[1]
            points.append({"budget": budget, "total": int(total), "extra_percent": float(percent)})
    return points
# ---------------------------------------------------------------------------------------------------------------


def measure(network: str, batch: int, steps: int, milp_time_limit: float) -> dict:
    loop = deepdsl.load(str(ROOT / "networks" / f"{network}.py"), Overrides(batch=batch))
    plain_seconds = math.inf
    for _ in range(2):                    # the first compile also warms caches
        began = time.perf_counter()
        compiled = deepdsl.compile(loop)
        plain_seconds = min(plain_seconds, time.perf_counter() - began)
    step = compiled.steps["train"]
    unbudgeted = step.plan.total_bytes
    result = {"network": network, "batch": batch, "plain_compile_s": plain_seconds,
              "unbudgeted": {"total": unbudgeted, "extra_percent": _percent(step.program)}}

    began = time.perf_counter()
    try:
        compile_without_search(loop, CompileOptions(memory_budget=1))
        raise RuntimeError(f"{network}: a budget of 1 byte fits")
    except BudgetError as err:
        least = err.least.total_bytes
        result["least"] = {"total": least, "extra_percent": _percent(err.program), "step": err.step,
                           "seconds": time.perf_counter() - began}

    budgets = sorted({round(b) for b in np.linspace(unbudgeted, least, steps)}, reverse=True)
    sweep = []
    for budget in budgets:
        began = time.perf_counter()
        try:
            fitted = compile_without_search(loop, CompileOptions(memory_budget=budget))
        except BudgetError as err:
            sweep.append({"budget": budget, "error": str(err)})
            continue
        wall = time.perf_counter() - began
        train = fitted.steps["train"]
        sweep.append({"budget": budget, "total": train.plan.total_bytes, "arena": train.plan.arena_bytes,
                      "workspace": train.plan.workspace_bytes, "extra_percent": _percent(train.program),
                      "recomputations": train.fit.recomputations, "workspace_limit": train.fit.workspace_limit,
                      "search_s": train.fit.seconds, "extra_wall_s": wall - plain_seconds})
    result["sweep"] = sweep

    before = run_stages({"train": step.unplanned}, ORDERING, CompileOptions())["train"]
    n = len(forward_statements(before))
    result["forward_statements"] = n
    segments = {}
    for k in _segment_counts(n):
        program = checkpoint_segments(before, k)
        plan = _plan(program)
        segments[k] = {"segments": k, "total": plan.total_bytes, "arena": plan.arena_bytes,
                       "workspace": plan.workspace_bytes, "extra_percent": _percent(program)}
    result["segments"] = list(segments.values())
    k = max(1, round(math.sqrt(n)))
    sqrt_program = checkpoint_segments(before, k)
    sqrt_least_ws = _plan(sqrt_program, CompileOptions(workspace_limit=0))
    result["sqrt"] = dict(segments[k], total_ws0=sqrt_least_ws.total_bytes)
    best = min(segments.values(), key=lambda s: (s["total"], s["extra_percent"]))
    result["best_segments"] = dict(best)
    result["ours_at_sqrt"] = _ours_at(loop, result["sqrt"]["total"], least)
    result["ours_at_sqrt_ws0"] = _ours_at(loop, result["sqrt"]["total_ws0"], least)
    result["ours_at_best_segments"] = _ours_at(loop, best["total"], least)
    result["milp"] = _milp_curve(loop, budgets, milp_time_limit)
    return result


def _limit_text(limit) -> str:
    if limit is None:
        return "none"
    return f"{limit / 2**20:g} MiB" if limit else "0"


def _ours_text(point: dict | None) -> str:
    if point is None:
        return "below the least reachable"
    return (f"{point['total'] / MB:.1f} MB with +{point['extra_percent']:.1f} % FLOPs "
            f"({point['recomputations']} recomputations, workspace limit {_limit_text(point['workspace_limit'])})")


def dominated(result: dict) -> list[str]:
    """Where a baseline beats the budget search: a budget of the sweep whose planned total is above a baseline's
    total at no fewer extra FLOPs than the baseline's, or a baseline's total that the budget search reaches only
    with more extra FLOPs, or not at all."""
    notes = []
    baselines = [("sqrt(n)", result["sqrt"]["total"], result["sqrt"]["extra_percent"]),
                 ("sqrt(n), workspace limit 0", result["sqrt"]["total_ws0"], result["sqrt"]["extra_percent"]),
                 (f"{result['best_segments']['segments']} segments", result["best_segments"]["total"],
                  result["best_segments"]["extra_percent"])]
    for name, total, percent in baselines:
        for row in result["sweep"]:
            if "total" in row and row["extra_percent"] >= percent - 1e-9 and row["total"] > total:
                notes.append(f"budget {row['budget'] / MB:.1f} MB: ours {row['total'] / MB:.1f} MB at "
                             f"+{row['extra_percent']:.1f} % FLOPs, {name} {total / MB:.1f} MB at +{percent:.1f} %")
    for (name, total, percent), key in zip(baselines, ("ours_at_sqrt", "ours_at_sqrt_ws0", "ours_at_best_segments")):
        ours = result[key]
        if ours is None:
            notes.append(f"{name}'s total {total / MB:.1f} MB is below the least the budget search reaches")
        elif ours["extra_percent"] > percent + 1e-9:
            notes.append(f"at {name}'s total {total / MB:.1f} MB the budget search needs +{ours['extra_percent']:.1f} "
                         f"% FLOPs, {name} +{percent:.1f} %")
    return notes


def tables(result: dict) -> tuple[list[str], list[str]]:
    """(text lines, markdown lines) of one network's results."""
    title = f"{result['network']} batch {result['batch']} ({result['forward_statements']} forward statements, " \
            f"compile without a budget {result['plain_compile_s']:.2f} s)"
    header = ("budget MB", "total MB", "extra FLOPs %", "recomputations", "workspace limit", "search s", "wall s")
    rows = []
    for row in result["sweep"]:
        if "error" in row:
            rows.append((f"{row['budget'] / MB:.1f}", "error", "", "", "", "", ""))
            continue
        rows.append((f"{row['budget'] / MB:.1f}", f"{row['total'] / MB:.1f}", f"{row['extra_percent']:.1f}",
                     str(row["recomputations"]), _limit_text(row["workspace_limit"]), f"{row['search_s']:.2f}",
                     f"{row['extra_wall_s']:.2f}"))
    un, least, sq, best = result["unbudgeted"], result["least"], result["sqrt"], result["best_segments"]
    baselines = [
        ("(a) no budget (rematerialize pass only)", f"{un['total'] / MB:.1f}", f"{un['extra_percent']:.1f}"),
        ("least reachable by the budget search", f"{least['total'] / MB:.1f}", f"{least['extra_percent']:.1f}"),
        (f"(b) sqrt(n) checkpointing, {sq['segments']} segments", f"{sq['total'] / MB:.1f}",
         f"{sq['extra_percent']:.1f}"),
        ("(b) the same, workspace limit 0", f"{sq['total_ws0'] / MB:.1f}", f"{sq['extra_percent']:.1f}"),
        (f"(c) best segment count, {best['segments']} segments", f"{best['total'] / MB:.1f}",
         f"{best['extra_percent']:.1f}"),
    ]
    for point in result["milp"] or []:
        if point is not None:
            baselines.append((f"(d) MILP at budget {point['budget'] / MB:.1f} MB", f"{point['total'] / MB:.1f}",
                              f"{point['extra_percent']:.1f}"))
    comparisons = [("budget search at (b)'s total", _ours_text(result["ours_at_sqrt"])),
                   ("budget search at (b)'s total with workspace limit 0", _ours_text(result["ours_at_sqrt_ws0"])),
                   ("budget search at (c)'s total", _ours_text(result["ours_at_best_segments"]))]
    segment_line = "segment sweep: " + ", ".join(
        f"{s['segments']}: {s['total'] / MB:.1f} MB +{s['extra_percent']:.1f} %" for s in result["segments"])
    notes = dominated(result)
    milp_line = "(d) MILP: left out (no deepdsl.passes.recompute_milp.optimal_curve)" if result["milp"] is None else ""

    text = [title, "  ".join(f"{c:>16}" for c in header)]
    text += ["  ".join(f"{c:>16}" for c in row) for row in rows]
    text += [f"{name:>52}  {total:>10} MB  +{percent} % FLOPs" for name, total, percent in baselines]
    text += [f"{name}: {value}" for name, value in comparisons]
    text += [segment_line]
    text += [milp_line] if milp_line else []
    text += ["a baseline beats the budget search at: " + "; ".join(notes)] if notes else \
        ["no baseline beats the budget search (see `dominated`)"]

    md = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    md += ["", "| baseline | total MB | extra FLOPs % |", "|---|---|---|"]
    md += [f"| {name} | {total} | {percent} |" for name, total, percent in baselines]
    md += [""] + [f"- {name}: {value}" for name, value in comparisons] + [f"- {segment_line}"]
    md += [f"- {milp_line}"] if milp_line else []
    md += [f"- a baseline beats the budget search at: {'; '.join(notes)}"] if notes else \
        ["- no baseline beats the budget search (see `dominated`)"]
    md.append("")
    return text, md


def draw(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(results))
    rows = math.ceil(len(results) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False)
    for ax, result in zip(axes.flat, results):
        points = [r for r in result["sweep"] if "total" in r]
        ax.plot([r["extra_percent"] for r in points], [r["total"] / MB for r in points], "o-", color="C0",
                label="budget search (sweep)")
        un, sq, best = result["unbudgeted"], result["sqrt"], result["best_segments"]
        ax.plot(un["extra_percent"], un["total"] / MB, "s", color="C2", markersize=9, label="(a) no budget")
        ax.plot(sq["extra_percent"], sq["total"] / MB, "^", color="C3", markersize=9,
                label=f"(b) sqrt(n): {sq['segments']} segments")
        ax.plot(sq["extra_percent"], sq["total_ws0"] / MB, "v", color="C3", markersize=8, fillstyle="none",
                label="(b) sqrt(n), workspace limit 0")
        ax.plot(best["extra_percent"], best["total"] / MB, "D", color="C1", markersize=8,
                label=f"(c) best: {best['segments']} segments")
        milp = [p for p in result["milp"] or [] if p is not None]
        if milp:
            ax.plot([p["extra_percent"] for p in milp], [p["total"] / MB for p in milp], "x--", color="C4",
                    label="(d) MILP (optimum of its model)")
        ax.set_title(f"{result['network']} batch {result['batch']}")
        ax.set_xlabel("extra FLOPs (% of the step's)")
        ax.set_ylabel("planned total (MB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(results):]:
        ax.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=DEFAULT_NETWORKS, metavar="NET:BATCH")
    parser.add_argument("--steps", type=int, default=12, help="budgets in the sweep (default 12)")
    parser.add_argument("--png", help="write the curves to this PNG")
    parser.add_argument("--markdown", help="write the tables to this Markdown file")
    parser.add_argument("--json", help="write every figure to this JSON file")
    parser.add_argument("--milp-time-limit", type=float, default=60.0,
                        help="seconds per budget for (d), the MILP's optimum (0: leave it out)")
    args = parser.parse_args(argv)
    print(f"load average before: {load_average()}", flush=True)
    results, markdown = [], ["# Memory budgets: planned total against extra FLOPs", ""]
    for spec in args.networks:
        network, _, batch = spec.partition(":")
        result = measure(network, int(batch) if batch else 1, args.steps, args.milp_time_limit)
        results.append(result)
        text, md = tables(result)
        print("\n".join(text) + "\n", flush=True)
        markdown += md
    print(f"load average after: {load_average()}")
    markdown.append(f"Load average after: {load_average()}.")
    if args.markdown:
        pathlib.Path(args.markdown).write_text("\n".join(markdown) + "\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    if args.png:
        draw(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
