"""The compiler pipeline: one readable tuple of named stages, with a hook after each for dumps and verification.

    Loop ─autodiff→ setup (empty), train, test Graphs ─simplify→ ─cse→ ─push_through_pool_backward→
         ─fuse_elementwise→ ─fuse_reductions→ ─fuse_epilogue→ ─cse→ ─hoist_invariants→ ─linearize→ Programs
         ─sink→ ─schedule→ ─rematerialize→ ─inplace→ ─fuse_horizontal→ ─fuse_multi_output→ ─dealloc→ Programs
         ─plan_memory→ MemoryPlans

`STAGES` is the whole pipeline after `autodiff`, one `Stage` record per stage: its name, its function and the
`CompileOptions` field that switches it on (None: it always runs). `run_stages` runs any slice of it with the
verifier and the hook after every stage that runs; `compile` runs it up to the memory stages (`MEMORY_STAGES`,
from `schedule` on), then `plan_steps` runs the rest. `plan_steps` is also how an analysis reruns the memory stages
with other options (`deepdsl.memory_table.what_if`): the figures it gets are those of a compile with those options.
A stage or option named anywhere that does not exist is an error, never silently enabled.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Callable, Mapping

from deepdsl import provenance
from deepdsl.dsl import Loop
from deepdsl.errors import SizeError
from deepdsl.ir import MAX_BYTES, Graph, Node, bytes_text
from deepdsl.passes.code_motion import hoist_invariants, sink
from deepdsl.memory_plan import MemoryPlan, plan_memory
from deepdsl.passes.cse import cse
from deepdsl.passes.dealloc import insert_frees
from deepdsl.passes.fold_transposes import fold_transposes
from deepdsl.passes.fuse_elementwise import fuse_elementwise
from deepdsl.passes.fuse_epilogue import fuse_epilogue
from deepdsl.passes.fuse_horizontal import fuse_horizontal
from deepdsl.passes.fuse_multi_output import fuse_multi_output
from deepdsl.passes.fuse_reductions import fuse_reductions
from deepdsl.passes.inplace import compute_in_place
from deepdsl.passes.linearize import linearize
from deepdsl.passes.pool_backward import push_through_pool_backward
from deepdsl.passes.rematerialize import rematerialize
from deepdsl.passes.schedule import schedule_for_memory
from deepdsl.passes.simplify import simplify
from deepdsl.ssa import Program
from deepdsl.training import build_step_graphs

Hook = Callable[[str, object], None]
STEPS = ("setup", "train", "test", "predict")

# Scratch of one statement at most (im2col matrices, pooling and LRN buffers): ops run over the batch in chunks
# to fit. Unbounded, VGG-16 would need 9 GB; the CPU kernels work in cache-sized chunks of samples anyway, so a
# larger limit buys them nothing (docs/memory.md), while GPU GEMMs may gain from larger chunks (--workspace-limit).
DEFAULT_WORKSPACE_LIMIT = 32 * 2**20

# a bool option with this metadata is named in a generated program's header only when off: such options are on
# except in what-if analyses, so a header names them only where they matter
_NAMED_WHEN_OFF = {"header": "when off"}
_NAMED_WHEN_ON = {"header": "when on"}


@dataclass(frozen=True)
class CompileOptions:
    """What to run. Every optimization can be switched off to see what it buys."""

    simplify: bool = True
    fuse: bool = True
    cse: bool = True
    code_motion: bool = True
    schedule: bool = True                 # memory-aware scheduling
    rematerialize: bool = True            # recompute cheap elementwise values before their late uses
    inplace: bool = True                  # in-place computation, of the two kinds below
    inplace_activations: bool = field(default=True, metadata=_NAMED_WHEN_OFF)   # activations and gradients
    inplace_updates: bool = field(default=True, metadata=_NAMED_WHEN_OFF)       # parameter and state updates
    dealloc: bool = field(default=True, metadata=_NAMED_WHEN_OFF)   # free tensors after last use, else keep them
    takeover: bool = True                 # pooling outputs take over their dying inputs' storage (memory plan)
    # bytes of shared scratch (im2col and the like): ops run over the batch in chunks to fit; None: no limit
    workspace_limit: int | None = DEFAULT_WORKSPACE_LIMIT
    # bytes every step's planned total (persistent + arena + workspace) must fit: recompute values and lower the
    # workspace limit until it does (deepdsl/budget.py); None: no budget
    memory_budget: int | None = None
    # how the budget chooses recomputations: None, the greedy sequence (monotone in the budget); "exact", also the
    # MILP (scipy's HiGHS), taken where it costs fewer FLOPs than the greedy sequence's choice
    memory_solver: str | None = None
    verify: bool = False
    # also the accumulate and apply steps (deepdsl/training.py): the program's --accumulate K and --data-parallel
    data_parallel: bool = field(default=False, metadata=_NAMED_WHEN_ON)

    def changed(self, **changes) -> "CompileOptions":
        """These options with some fields changed; a name that is no field is a `ValueError` naming the fields."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"no compile option named {', '.join(map(repr, unknown))}; the options are "
                             f"{', '.join(sorted(names))}")
        return replace(self, **changes)

    def without(self, *stages: str) -> "CompileOptions":
        """These options with the named stages switched off; a name that is no stage, or a stage that always runs,
        is a `ValueError`."""
        switches = {}
        for name in stages:
            stage = stage_named(name)
            if stage.option is None:
                raise ValueError(f"stage {name!r} always runs; it has no option to switch it off")
            switches[stage.option] = False
        return self.changed(**switches)


def _no_arguments(options: CompileOptions) -> dict:
    return {}


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline.

    name: how hooks, dumps and `CompileOptions.without` call it (two stages may share a name: `cse` runs twice).
    function: a pure pass. A per-step stage maps one step's value to the next (Graph -> Graph, Graph -> Program,
        Program -> Program or Program -> MemoryPlan); a stage `across` the steps maps all of them at once (a
        mapping of step names to Graphs to another such mapping).
    option: the `CompileOptions` bool field that switches the stage on, or None when it always runs. Checked when
        the record is made: a misspelt option is an error here, never a stage that runs by default.
    arguments: the keyword arguments the function takes from the options (for example the workspace limit).
    """

    name: str
    function: Callable
    option: str | None = None
    arguments: Callable[[CompileOptions], dict] = _no_arguments
    across: bool = False

    def __post_init__(self):
        switches = {f.name for f in fields(CompileOptions) if f.type in ("bool", bool)}
        if self.option is not None and self.option not in switches:
            raise ValueError(f"stage {self.name!r} is switched by {self.option!r}, which is no bool field of "
                             f"CompileOptions ({', '.join(sorted(switches))})")

    def enabled(self, options: CompileOptions) -> bool:
        return self.option is None or getattr(options, self.option)

    def __call__(self, value, options: CompileOptions):
        return self.function(value, **self.arguments(options))


def _hoist(steps: Mapping[str, Graph]) -> dict[str, Graph]:
    """The "setup" step computes once what the other steps compute the same way every time (`hoist_invariants`)."""
    names = [name for name in steps if name != "setup"]
    setup, graphs = hoist_invariants(steps["setup"].name, [steps[name] for name in names])
    return {"setup": setup, **dict(zip(names, graphs))}


# CSE runs before fusion too: merging duplicates first gives fusion true reader counts. After `inplace` the
# programs have their final order and in-place statements; `fuse_horizontal` gathers the small parameters' updates
# at the end in batches of one kernel; `fuse_multi_output` marks the pairs of statements one
# call computes together, `dealloc` frees each value after its last read (a pair's call reads the inputs of both);
# `plan_memory` gives their plans.
STAGES: tuple[Stage, ...] = (
    Stage("fold_transposes", fold_transposes, "fuse"),    # before simplify, which removes the swaps left paired
    Stage("simplify", simplify, "simplify"),
    Stage("cse", cse, "cse"),
    Stage("push_through_pool_backward", push_through_pool_backward),
    Stage("fuse_elementwise", fuse_elementwise, "fuse"),
    Stage("fuse_reductions", fuse_reductions, "fuse"),
    Stage("fuse_epilogue", fuse_epilogue, "fuse"),        # a fully connected layer's bias into its product
    Stage("cse", cse, "cse"),
    Stage("hoist_invariants", _hoist, "code_motion", across=True),
    Stage("linearize", linearize),
    Stage("sink", sink, "code_motion"),
    Stage("schedule", schedule_for_memory, "schedule"),
    Stage("rematerialize", rematerialize, "rematerialize"),   # needs the final order; before in-place and frees
    Stage("inplace", compute_in_place, "inplace",
          lambda o: {"activations": o.inplace_activations, "updates": o.inplace_updates}),
    Stage("fuse_horizontal", fuse_horizontal, "fuse", lambda o: {"takeover": o.takeover}),   # small updates batched
    Stage("fuse_multi_output", fuse_multi_output, None, lambda o: {"takeover": o.takeover}),  # final order, in place
    Stage("dealloc", insert_frees, "dealloc"),            # frees after the reads of both statements of a pair
    Stage("plan_memory", plan_memory, None, lambda o: {"workspace_limit": o.workspace_limit, "takeover": o.takeover}),
)


def stage_named(name: str) -> Stage:
    """The first stage named `name`; a name that is no stage is a `ValueError` naming the stages."""
    return STAGES[stage_index(name)]


def stage_index(name: str) -> int:
    """Where the first stage named `name` is in `STAGES`; a name that is no stage is a `ValueError`."""
    for k, stage in enumerate(STAGES):
        if stage.name == name:
            return k
    raise ValueError(f"no stage named {name!r}; the stages are {', '.join(dict.fromkeys(s.name for s in STAGES))}")


OPTIMIZATION_STAGES = STAGES[:stage_index("schedule")]                        # Graphs -> optimized Programs
MEMORY_STAGES = STAGES[stage_index("schedule"):stage_index("plan_memory")]    # order, in-place statements, frees
PLANNING_STAGES = STAGES[stage_index("plan_memory"):]                         # Programs -> MemoryPlans


def run_stages(values: Mapping[str, object], stages: tuple[Stage, ...], options: CompileOptions,
               hook: Hook | None = None) -> dict[str, object]:
    """Run the enabled `stages` in order on every step's value (a mapping of step names to Graphs, Programs or
    MemoryPlans), calling the verifier (with `options.verify`) and `hook("<value name>:<stage name>", value)` on
    each step's result after every stage that runs. The per-step stages between two stages across the steps run
    one step after another (each step through all of them, in the order of `values`). Returns the new mapping."""
    values = dict(values)
    enabled = [s for s in stages if s.enabled(options)]
    for across, group in itertools.groupby(enabled, key=lambda s: s.across):
        group = tuple(group)
        if across:
            for stage in group:
                values = dict(stage(values, options))
                for value in values.values():
                    _after(stage, value, options, hook)
            continue
        for step in values:
            for stage in group:
                name = values[step].name
                values[step] = stage(values[step], options)
                _after(stage, values[step], options, hook, name)
    return values


def _after(stage: Stage, value, options: CompileOptions, hook: Hook | None, name: str | None = None) -> None:
    """The verifier and the hook after a stage: `name` is the name of the value the stage ran on (a plan's program
    has the name of the program it plans)."""
    if options.verify:
        _verify(value)
    if hook:
        hook(f"{name or value.name}:{stage.name}", value)


def _verify(value) -> None:
    from deepdsl.verify import verify, verify_graph

    if isinstance(value, Graph):
        verify_graph(value)
    elif isinstance(value, Program):
        verify(value)
    else:
        value.check()


@dataclass(frozen=True)
class CompiledStep:
    """One compiled step: its final `program`, the memory `plan` of that program, and the program as the
    optimization stages left it, before the memory stages (`unplanned`), from which `plan_steps` reruns them."""

    program: Program
    plan: MemoryPlan = field(repr=False)
    unplanned: Program = field(repr=False, compare=False)
    fit: object = field(default=None, compare=False)      # how a memory budget was met (deepdsl.budget.Fit)


@dataclass(frozen=True)
class Compiled:
    """The result of compiling a Loop: `steps` maps "setup" (values hoisted out of the step), "train", "test",
    "predict" (the forward pass alone, where the Loop says what it gives: `training.predict_graph`) and, with
    `data_parallel`, "accumulate", "apply" and, with batch norm, "statistics" to each step's program and memory
    plan; `setup`, `train` and `test` are the programs."""

    name: str
    source: str | None
    steps: Mapping[str, CompiledStep]
    params: tuple[Node, ...]
    states: tuple[Node, ...]
    loop: Loop = field(repr=False, compare=False)
    accumulators: tuple[Node, ...] = ()      # gradient accumulators of the accumulate and apply steps, if compiled
    batch_statistics: tuple[Node, ...] = ()  # the batch statistics B_ the accumulate step writes, statistics reads
    options: CompileOptions = CompileOptions()

    @property
    def setup(self) -> Program:
        return self.steps["setup"].program

    @property
    def train(self) -> Program:
        return self.steps["train"].program

    @property
    def test(self) -> Program:
        return self.steps["test"].program


def plan_steps(unplanned: Mapping[str, Program], options: CompileOptions = CompileOptions(),
               hook: Hook | None = None, network: str = "", explain: bool = True) -> dict[str, CompiledStep]:
    """Run the memory stages and `plan_memory` on programs as the optimization stages leave them (`unplanned`, by
    step name): each step's final program and its plan, exactly as `compile` with these options gives them. Under
    a memory budget, `deepdsl.budget.fit_steps` runs them (`network` names the network in its error; `explain`
    False: a step that cannot fit raises `deepdsl.budget.DoesNotFit` without looking for the least reachable)."""
    origins = next((p.origins for p in unplanned.values() if p.origins is not None), None)
    with provenance.using(provenance.table() if origins is None else origins):     # recomputed copies are named
        if options.memory_budget is not None:
            from deepdsl.budget import fit_steps
            return fit_steps(unplanned, options, hook, network, explain)
        final = run_stages(unplanned, MEMORY_STAGES, options, hook)
        plans = run_stages(final, PLANNING_STAGES, options, hook)
        for step, plan in plans.items():
            _refuse_oversized(step, plan)
    return {step: CompiledStep(final[step], plans[step], unplanned[step]) for step in unplanned}


def _refuse_oversized(step: str, plan: MemoryPlan) -> None:
    """A `SizeError` for a plan larger than any machine holds (`MAX_BYTES`), naming the step, its size and the
    layer of its largest value; every value is within the limit (`ir.make` refuses others), their sum may not be."""
    if plan.total_bytes <= MAX_BYTES:
        return
    values = [(b.nbytes, b.value) for b in plan.buffers] + [(p.nbytes, p.leaf) for p in plan.persistent]
    nbytes, largest = max(values, key=lambda pair: pair[0])
    origin = provenance.origin(largest)
    layer = f" of layer '{origin.layer}'" if origin is not None else ""
    raise SizeError(f"the {step} step's memory plan takes {bytes_text(plan.total_bytes)} (persistent + arena + "
                    f"workspace), more than the 2^48 bytes (256 TiB) any machine holds; its largest value takes "
                    f"{bytes_text(nbytes)}{layer}: make the layers or the batch smaller")


def plan_program(program: Program, options: CompileOptions = CompileOptions(),
                 hook: Hook | None = None) -> tuple[Program, MemoryPlan]:
    """Run the memory stages on an optimized program and plan its memory: (final program, its plan)."""
    step = plan_steps({program.name: program}, options, hook)[program.name]
    return step.program, step.plan


def compile(loop: Loop, options: CompileOptions = CompileOptions(), hook: Hook | None = None) -> Compiled:  # noqa: A001
    """Compile a Loop into its setup, training-step and test-step SSA programs and their memory plans. Under a memory
    budget no step fits, the `deepdsl.budget.BudgetError` names the largest batch that fits (when the Loop was
    loaded from a network file)."""
    from deepdsl.budget import BudgetError, largest_batch

    try:
        return compile_without_search(loop, options, hook)
    except BudgetError as err:
        if err.batch is None or err.batch <= 1 or loop.source is None:
            raise
        raise err.with_largest_batch(largest_batch(loop, options, below=err.batch) or 0) from None


def compile_without_search(loop: Loop, options: CompileOptions = CompileOptions(), hook: Hook | None = None,
                           explain: bool = True) -> Compiled:
    """`compile`, but a `BudgetError` is raised as the budget search leaves it (no search for a batch that fits);
    with `explain` False, a bare `deepdsl.budget.DoesNotFit` (no search for the least reachable either)."""
    with _collector_paused(), provenance.using(loop.origins):
        return _compile(loop, options, hook, explain)


@contextlib.contextmanager
def _collector_paused():
    """Pause CPython's cyclic garbage collector while compiling. Compiling allocates many small objects, so the
    collector would run a few hundred times (for ResNet-50), each time scanning the live graphs and sympy's caches:
    about 15% of the compile time. What compiling drops is freed by reference counting as usual; the collector
    resumes (if it was running) when the compiler returns or raises."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _compile(loop: Loop, options: CompileOptions, hook: Hook | None, explain: bool = True) -> Compiled:
    graphs = build_step_graphs(loop, forward=simplify if options.simplify else None, split=options.data_parallel)
    if hook:
        hook(f"{graphs.train.name}:autodiff", graphs.train)
    # the setup step starts empty: `hoist_invariants` (the `code_motion` option) moves values into it
    steps = {"setup": Graph(f"{loop.name}_setup", ()), "train": graphs.train, "test": graphs.test}
    if graphs.predict is not None:
        steps["predict"] = graphs.predict
    if options.data_parallel:
        steps.update(accumulate=graphs.accumulate, apply=graphs.apply)
        if graphs.statistics is not None:
            steps["statistics"] = graphs.statistics
    unplanned = run_stages(steps, OPTIMIZATION_STAGES, options, hook)
    return Compiled(
        name=loop.name,
        source=loop.source,
        steps=MappingProxyType(plan_steps(unplanned, options, hook, loop.name, explain)),
        params=graphs.params,
        states=graphs.states,
        accumulators=graphs.accumulators,
        batch_statistics=graphs.batch_statistics,
        loop=loop,
        options=options,
    )
