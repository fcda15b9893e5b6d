"""The static memory table of a compiled step (DeepDSL's Figure 3, exact): one row per instruction with the tensor
it creates, its workspace, the live bytes after it and its arena offset; then the peak, the arena, a simulation of
the runtime's pool allocator over the same allocations, persistent memory, workspace, and what each memory
optimization bought.

Everything is read from the `MemoryPlan` that code generation consumes, so the table is the program's memory.
MB = 10^6 bytes. "live" counts placed sizes (256-byte aligned), the quantity the generated program measures.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from deepdsl.budget import flops, recomputed
from deepdsl.liveness import changes_at
from deepdsl.memory_plan import MemoryPlan
from deepdsl.ops import dims, get_op
from deepdsl.pipeline import CompileOptions, plan_steps
from deepdsl.ssa import Let, Program, format_expr, format_inline
from deepdsl.storage import is_batch_input
from deepdsl_runtime.memory.first_fit import PoolAllocator

MB = 1e6
STATEMENT_WIDTH = 72


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    kind: str                 # "input", "let" or "free"
    index: int                # body index (-1 for inputs)
    name: str                 # value name (inputs, lets) or "" (frees)
    text: str                 # the IR statement
    dims: str
    dtype: str
    nbytes: int               # bytes of the tensor the row creates (0 for frees)
    change: int               # change of live bytes (placed sizes; negative for frees)
    workspace: int
    chunks: int
    live: int                 # live bytes after the row (placed sizes)
    live_exact: int
    offset: int | None        # arena offset of the tensor's buffer (None if persistent or freed)
    where: str                # "arena", "in place of X4", "view of X5", "in cv1_W", ...


@dataclass(frozen=True)
class Report:
    """Everything the table prints (and `--json` writes)."""

    network: str
    program: Program
    plan: MemoryPlan
    rows: tuple[Row, ...]
    pooled: dict
    what_if: dict[str, int]
    recomputed: tuple["Recomputed", ...] = ()
    flops: tuple[int, int] = (0, 0)      # (FLOPs of the recomputed copies, FLOPs of the step's other statements)
    fit: object = None                   # how a memory budget was met (deepdsl.budget.Fit), None without one


@dataclass(frozen=True)
class Recomputed:
    """A recomputed copy: where (body index), what (its name and statement), from what (its inputs), its FLOPs."""

    index: int
    name: str
    text: str
    sources: tuple[str, ...]
    flops: int


def memory_report(compiled, step: str = "train") -> Report:
    """The report of one step ("train", "test" or "setup") of a `Compiled`."""
    compiled_step = compiled.steps[step]
    program, plan = compiled_step.program, compiled_step.plan
    return Report(compiled.name, program, plan, tuple(rows(program, plan)), simulate_pool(plan),
                  what_if(compiled_step.unplanned, compiled.options), recomputations(program), flops(program),
                  compiled_step.fit)


def recomputations(program: Program) -> tuple[Recomputed, ...]:
    """Every recomputed copy of `program` (by the `rematerialize` pass or under a memory budget)."""
    names = program.names()
    label = lambda n: names.get(id(n)) or format_inline(n)   # noqa: E731
    return tuple(Recomputed(k, names[id(i.node)], f"{names[id(i.node)]} = {format_expr(i.node, names)}",
                            tuple(label(n) for n in i.node.inputs), get_op(i.node.op).flops(i.node))
                 for k, i in recomputed(program))


def rows(program: Program, plan: MemoryPlan) -> list[Row]:
    names = program.names()
    result: list[Row] = []
    live = live_exact = 0
    for leaf in program.inputs:
        if not is_batch_input(leaf):
            continue
        p = plan.placement(leaf)
        buf = plan.buffers[p.buffer]
        live += buf.size
        live_exact += buf.nbytes
        result.append(Row("input", -1, leaf.name, f"input {leaf.name}", dims(leaf.shape), leaf.dtype, buf.nbytes,
                          buf.size, 0, 1, live, live_exact, buf.offset, "arena"))
    for step in plan.steps:
        instr = step.instr
        if isinstance(instr, Let):
            node = instr.node
            p = plan.placement(node)
            change = plan.buffers[step.allocates].size if step.allocates is not None else 0
            if p.takes_over is not None:        # shares the bytes of the buffer it takes over
                change -= min(change, plan.buffers[plan.placement(p.takes_over).buffer].size)
            text = f"{names[id(node)]} = {format_expr(node, names)}"
            result.append(Row("let", step.index, names[id(node)], text, dims(node.shape), node.dtype, node.nbytes,
                              change, step.workspace, step.chunks, step.live_bytes, step.live_bytes_exact,
                              p.offset, _where(p, names)))
        else:
            change = -sum(plan.buffers[b].size - _kept(plan, b) for b in step.releases)
            text = "free " + ", ".join(names.get(id(n)) or format_inline(n) for n in instr.nodes)
            result.append(Row("free", step.index, "", text, "", "", 0, change, 0, 1, step.live_bytes,
                              step.live_bytes_exact, None, ""))
    return result


def _kept(plan: MemoryPlan, index: int) -> int:
    """Bytes of a released buffer that the buffer taking it over keeps (0 when none does)."""
    return max((min(t.size, plan.buffers[index].size) for t in plan.buffers if t.takes_over == index), default=0)


def _where(p, names) -> str:
    label = lambda n: names.get(id(n)) or format_inline(n)   # noqa: E731
    if p.in_place_of is not None:
        return f"in place of {label(p.in_place_of)}"
    if p.view_of is not None:
        return f"view of {label(p.view_of)}"
    if p.takes_over is not None:
        return f"arena, over {label(p.takes_over)}"
    if p.leaf is not None:
        return f"in {p.leaf.name}"
    return "arena"


def simulate_pool(plan: MemoryPlan) -> dict:
    """Replay the plan's allocations and frees, in order, on the runtime's first-fit pool allocator (`pooled`
    mode), in the order of the buffers' live ranges (`deepdsl.liveness.changes_at`: at each instruction the
    buffers it allocates, then those it releases): the capacity the pool needs (highest byte handed out) and its
    peak of bytes in use. A first-fit pool cannot promise to grow a block in place, so a buffer that takes over
    another's bytes in the plan gets a block of its own here, like any other: where the plan lets buffers take over,
    the pool's peak may exceed the plan's (by at most the smaller of the two buffers, at that statement)."""
    pool = PoolAllocator(max(sum(b.size for b in plan.buffers), plan.alignment), plan.alignment)
    starts, ends = changes_at([(b.begin, b.end) for b in plan.buffers])
    offsets: dict[int, int] = {}
    footprint = 0
    for k in range(max(len(plan.steps), 1)):     # a buffer ending at len(steps) lives until the step returns
        for index in starts.get(k, ()):
            b = plan.buffers[index]
            offsets[index] = pool.alloc(b.nbytes)
            footprint = max(footprint, offsets[index] + b.size)
        for index in ends.get(k, ()):
            pool.free(offsets.pop(index))
    stats = pool.stats
    return {"footprint_bytes": footprint, "peak_bytes_in_use": stats.peak_bytes_in_use,
            "allocs": stats.num_allocs, "frees": stats.num_frees}


# what each memory optimization buys: the compile options without it (`CompileOptions.changed`; an option that does
# not exist is an error)
WHAT_IF: dict[str, dict[str, bool]] = {
    "without memory-aware scheduling": {"schedule": False},
    "without rematerialization": {"rematerialize": False},
    "without in-place activations and gradients": {"inplace_activations": False},
    "without in-place parameter updates": {"inplace_updates": False},
    "without taking over dying inputs' storage": {"takeover": False},
    "without scheduling, rematerialization, in-place computation and takeovers":
        {"schedule": False, "rematerialize": False, "inplace": False, "takeover": False},
    "without freeing (every tensor kept to the end)": {"dealloc": False},
}


def what_if(unplanned: Program, options: CompileOptions = CompileOptions(),
            variants: dict[str, dict[str, bool]] | None = None) -> dict[str, int]:
    """Peak live bytes of the same program with memory optimizations left out: for each variant (label -> changes
    of `options`, default `WHAT_IF`), the memory stages and the planner rerun by the pipeline (`plan_steps`) on the
    program as the optimization stages leave it, so each figure is the peak a compile with those options plans."""
    variants = WHAT_IF if variants is None else variants
    return {label: plan_steps({"step": unplanned}, options.changed(memory_budget=None, **changes))["step"]
            .plan.peak_live_bytes
            for label, changes in variants.items()}


# ---------------------------------------------------------------------------------------------------------------
# text

def _mb(nbytes: int) -> str:
    return f"{nbytes / MB:.6f}"


def _clip(text: str, width: int = STATEMENT_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def format_table(report: Report) -> str:
    plan = report.plan
    header = (f"{'IR statement':<{STATEMENT_WIDTH}}  {'dimensions':<18} {'tensor MB':>11} {'change MB':>11} "
              f"{'workspace MB':>12} {'live MB':>11} {'offset':>11}  where")
    lines = [f"memory plan of {plan.name} (MB = 10^6 bytes; change and live count sizes placed in the arena, "
             f"rounded up to {plan.alignment} bytes; workspace/k: run in k batch chunks)", "", header]
    for row in report.rows:
        dims_text = row.dims + ("" if row.dtype in ("float", "") else f" {row.dtype}")
        workspace = _mb(row.workspace) + (f"/{row.chunks}" if row.chunks > 1 else "") if row.workspace else ""
        lines.append(f"{_clip(row.text):<{STATEMENT_WIDTH}}  {dims_text:<18} "
                     f"{_mb(row.nbytes) if row.kind != 'free' else '':>11} {_mb(row.change):>11} {workspace:>12} "
                     f"{_mb(row.live):>11} {'' if row.offset is None else row.offset:>11}  {row.where}".rstrip())
    lines.append("")
    if report.recomputed:
        lines.append(f"recomputed values ({len(report.recomputed)}; at: the copy's statement index, right before "
                     f"the late uses it serves):")
        for r in report.recomputed:
            lines.append(f"  at {r.index:>5}  {_clip(r.text, 60):<60}  from {', '.join(r.sources)}; "
                         f"{r.flops / 1e6:.3f} MFLOP")
        lines.append("")
    lines += summary_lines(report)
    return "\n".join(lines) + "\n"


def summary_lines(report: Report) -> list[str]:
    plan = report.plan
    peak_row = next((r for r in report.rows if r.index == plan.peak_step and r.kind != "input"), None)
    at = f" at {_clip(peak_row.text, 60)}" if peak_row else ""
    limit = "none" if plan.workspace_limit is None else f"{plan.workspace_limit} bytes"
    chunked = sum(1 for s in plan.steps if s.chunks > 1)
    constants = plan.persistent_bytes("hyper") + plan.persistent_bytes("hoisted") + plan.persistent_bytes("other")
    ratio = plan.arena_bytes / plan.peak_live_bytes if plan.peak_live_bytes else 1.0
    pooled = report.pooled
    lines = [
        f"peak live bytes:          {_mb(plan.peak_live_bytes):>14} MB  ({plan.peak_live_bytes} bytes, sizes placed"
        f" in the arena){at}",
        f"peak live bytes, exact:   {_mb(plan.peak_live_bytes_exact):>14} MB  ({plan.peak_live_bytes_exact} bytes,"
        f" tensor sizes)",
        f"arena:                    {_mb(plan.arena_bytes):>14} MB  ({ratio:.4f} x peak; {len(plan.buffers)} buffers,"
        f" offsets by {plan.packing})",
        f"pooled (first-fit pool):  {_mb(pooled['footprint_bytes']):>14} MB  (capacity needed replaying the same"
        f" allocations; peak in use {_mb(pooled['peak_bytes_in_use'])} MB)",
        f"parameters:               {_mb(plan.param_bytes):>14} MB",
        f"optimizer state:          {_mb(plan.optimizer_bytes):>14} MB",
        f"running statistics:       {_mb(plan.persistent_bytes('running')):>14} MB",
        *([f"gradient accumulators:    {_mb(plan.persistent_bytes('gradient')):>14} MB  (summed over the ranks)"]
          if plan.persistent_bytes("gradient") else []),
        *([f"batch statistics:         {_mb(plan.persistent_bytes('batch')):>14} MB  (the last batch's)"]
          if plan.persistent_bytes("batch") else []),
        f"constants:                {_mb(constants):>14} MB  (hyperparameters and values hoisted out of the step)",
        f"workspace:                {_mb(plan.workspace_bytes):>14} MB  (one region shared by all statements; limit"
        f" {limit}; {chunked} statements run in batch chunks)",
        f"total:                    {_mb(plan.total_bytes):>14} MB  (arena + workspace + persistent)",
    ]
    extra, own = report.flops
    lines.append(f"recomputation:            {len(report.recomputed):>14} values, {extra / 1e9:.6f} GFLOP = "
                 f"+{100 * extra / max(own, 1):.2f} % of the step's {own / 1e9:.6f} GFLOP")
    fit = report.fit
    if fit is not None:
        limit = "none" if fit.workspace_limit is None else f"{fit.workspace_limit} bytes"
        chosen = (f"{fit.recomputations} recomputations of the greedy sequence" if fit.solver == "greedy" else
                  f"{fit.recomputations} drop options of the {fit.solver} MILP")
        lines.append(f"memory budget:            {_mb(fit.budget):>14} MB  (total fits; {chosen}, workspace limit "
                     f"{limit}; {fit.planned} candidates planned in {fit.seconds:.2f} s)")
    lines.append("what if (peak live bytes):")
    for label, value in report.what_if.items():
        change = f"{value / plan.peak_live_bytes:.2f} x" if plan.peak_live_bytes else ""
        lines.append(f"  {label + ':':<52} {_mb(value):>14} MB  ({change})")
    return lines


def to_json(report: Report) -> str:
    plan = report.plan
    data = {
        "network": report.network,
        "program": plan.name,
        "alignment": plan.alignment,
        "steps": [{"kind": r.kind, "index": r.index, "name": r.name, "statement": r.text, "dims": r.dims,
                   "dtype": r.dtype, "bytes": r.nbytes, "change_bytes": r.change, "workspace_bytes": r.workspace,
                   "chunks": r.chunks, "live_bytes": r.live, "live_bytes_exact": r.live_exact, "offset": r.offset,
                   "where": r.where} for r in report.rows],
        "peak_live_bytes": plan.peak_live_bytes,
        "peak_live_bytes_exact": plan.peak_live_bytes_exact,
        "peak_step": plan.peak_step,
        "arena_bytes": plan.arena_bytes,
        "packing": plan.packing,
        "buffers": [{"index": b.index, "value": report.program.names().get(id(b.value)), "bytes": b.nbytes,
                     "size": b.size, "offset": b.offset, "begin": b.begin, "end": b.end, "takes_over": b.takes_over}
                    for b in plan.buffers],
        "pooled": report.pooled,
        "param_bytes": plan.param_bytes,
        "optimizer_bytes": plan.optimizer_bytes,
        "running_bytes": plan.persistent_bytes("running"),
        "gradient_accumulator_bytes": plan.persistent_bytes("gradient"),
        "batch_statistics_bytes": plan.persistent_bytes("batch"),
        "constant_bytes": sum(plan.persistent_bytes(k) for k in ("hyper", "hoisted", "other")),
        "workspace_bytes": plan.workspace_bytes,
        "workspace_limit": plan.workspace_limit,
        "total_bytes": plan.total_bytes,
        "recomputed": [{"index": r.index, "name": r.name, "statement": r.text, "sources": list(r.sources),
                        "flops": r.flops} for r in report.recomputed],
        "recomputed_flops": report.flops[0],
        "step_flops": report.flops[1],
        "memory_budget": None if report.fit is None else {
            "budget_bytes": report.fit.budget, "recomputations": report.fit.recomputations,
            "workspace_limit": report.fit.workspace_limit, "planned": report.fit.planned, "solver": report.fit.solver,
            "seconds": report.fit.seconds},
        "what_if": report.what_if,
    }
    return json.dumps(data, indent=1) + "\n"


def plot(report: Report, path: str) -> None:
    """Live bytes over the instructions, with the peak and the arena size (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from deepdsl.errors import DeepDSLError
        raise DeepDSLError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None
    plan = report.plan
    xs = [s.index for s in plan.steps]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, [s.live_bytes / MB for s in plan.steps], label="live (placed)", linewidth=1)
    ax.axhline(plan.arena_bytes / MB, color="gray", linestyle="--", linewidth=0.8, label="arena")
    if plan.peak_step >= 0:
        ax.plot([plan.peak_step], [plan.peak_live_bytes / MB], "o", color="red", label="peak")
    ax.set_xlabel("instruction")
    ax.set_ylabel("MB")
    ax.set_title(f"{plan.name}: live memory, peak {plan.peak_live_bytes / MB:.1f} MB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["Report", "Row", "memory_report", "format_table", "to_json", "plot", "simulate_pool", "what_if"]
