"""The compiler pipeline: one readable tuple of named stages, with a hook after each for dumps and verification.

    Loop ─build_step_graphs→ train/test Graphs ─simplify→ ─cse→ ─push_through_pool_backward→ ─fuse_elementwise→
         ─cse→ ─hoist_invariants→ ─linearize→ Programs ─sink→ ─schedule→ ─rematerialize→ ─inplace→ ─dealloc→
         Programs ─plan_memory→ MemoryPlans

The memory stages (schedule, rematerialize, in-place, dealloc) and the planner run on every program;
`Compiled.plans` holds the plan of each program, and `Compiled.unplanned` the programs as they were before the
memory stages (so what-if analyses can rerun those stages with other options).
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Callable

from deepdsl.dsl import Loop
from deepdsl.ir import Graph, Node
from deepdsl.passes.code_motion import hoist_invariants, sink
from deepdsl.memory_plan import MemoryPlan, plan_memory
from deepdsl.passes.cse import cse
from deepdsl.passes.dealloc import insert_frees
from deepdsl.passes.fuse_elementwise import fuse_elementwise
from deepdsl.passes.inplace import compute_in_place
from deepdsl.passes.linearize import linearize
from deepdsl.passes.pool_backward import push_through_pool_backward
from deepdsl.passes.rematerialize import rematerialize
from deepdsl.passes.schedule import schedule_for_memory
from deepdsl.passes.simplify import simplify
from deepdsl.program import Program
from deepdsl.training import build_step_graphs

Hook = Callable[[str, object], None]

# CSE runs before fusion too: merging duplicates first gives fusion true reader counts
GRAPH_STAGES: tuple[tuple[str, Callable[[Graph], Graph]], ...] = (
    ("simplify", simplify),
    ("cse", cse),
    ("push_through_pool_backward", push_through_pool_backward),
    ("fuse_elementwise", fuse_elementwise),
    ("cse", cse),
)
PROGRAM_STAGES: tuple[tuple[str, Callable[[Program], Program]], ...] = (
    ("sink", sink),
)
# after these the program has its final order, in-place statements and frees; then plan_memory gives the plan
MEMORY_STAGES: tuple[tuple[str, Callable[[Program], Program]], ...] = (
    ("schedule", schedule_for_memory),
    ("rematerialize", rematerialize),        # needs the final order; before in-place decisions and frees
    ("inplace", compute_in_place),
    ("dealloc", insert_frees),
)


# Scratch of one statement at most (im2col matrices, pooling and LRN buffers): ops run over the batch in chunks
# to fit. Unbounded, VGG-16 would need 9 GB; the CPU kernels work in cache-sized chunks of samples anyway, so a
# larger limit buys them nothing (docs/memory.md), while GPU GEMMs may gain from larger chunks (--workspace-limit).
DEFAULT_WORKSPACE_LIMIT = 32 * 2**20


@dataclass(frozen=True)
class CompileOptions:
    """What to run. Every optimization can be switched off to see what it buys."""

    simplify: bool = True
    fuse: bool = True
    cse: bool = True
    code_motion: bool = True
    schedule: bool = True                 # memory-aware scheduling
    rematerialize: bool = True            # recompute cheap elementwise values before their late uses
    inplace: bool = True                  # in-place computation (activations, gradients, parameter updates)
    takeover: bool = True                 # pooling outputs take over their dying inputs' storage (memory plan)
    # bytes of shared scratch (im2col and the like): ops run over the batch in chunks to fit; None: no limit
    workspace_limit: int | None = DEFAULT_WORKSPACE_LIMIT
    verify: bool = False

    def enabled(self, stage: str) -> bool:
        return {"simplify": self.simplify, "fuse_elementwise": self.fuse, "cse": self.cse,
                "sink": self.code_motion, "schedule": self.schedule, "rematerialize": self.rematerialize,
                "inplace": self.inplace}.get(stage, True)


@dataclass(frozen=True)
class Compiled:
    """The result of compiling a Loop: programs for setup (values hoisted out of the step), training and testing."""

    name: str
    source: str | None
    setup: Program
    train: Program
    test: Program
    params: tuple[Node, ...]
    states: tuple[Node, ...]
    loop: Loop = field(repr=False, compare=False)
    options: CompileOptions = CompileOptions()
    plans: dict[str, MemoryPlan] = field(default_factory=dict, repr=False, compare=False)   # "setup"/"train"/"test"
    unplanned: dict[str, Program] = field(default_factory=dict, repr=False, compare=False)  # before memory stages

    @property
    def train_plan(self) -> MemoryPlan:
        return self.plans["train"]

    @property
    def test_plan(self) -> MemoryPlan:
        return self.plans["test"]

    @property
    def setup_plan(self) -> MemoryPlan:
        return self.plans["setup"]


def _optimize_graph(graph: Graph, options: CompileOptions, hook: Hook | None) -> Graph:
    from deepdsl.verify import verify_graph
    return _run_stages(graph, GRAPH_STAGES, options, hook, verify_graph)


def _lower(graph: Graph, options: CompileOptions, hook: Hook | None) -> Program:
    from deepdsl.verify import verify
    program = linearize(graph)
    if options.verify:
        verify(program)
    if hook:
        hook(f"{graph.name}:linearize", program)
    return _run_stages(program, PROGRAM_STAGES, options, hook)


def _run_stages(value, stages, options: CompileOptions, hook: Hook | None, check=None):
    """Run the enabled stages on a Graph or Program, checking (`verify` by default) and hooking after each."""
    if check is None:
        from deepdsl.verify import verify as check
    for name, stage in stages:
        if options.enabled(name):
            value = stage(value)
            if options.verify:
                check(value)
            if hook:
                hook(f"{value.name}:{name}", value)
    return value


def plan_program(program: Program, options: CompileOptions = CompileOptions(),
                 hook: Hook | None = None) -> tuple[Program, MemoryPlan]:
    """Run the memory stages on an optimized program and plan its memory: (final program, its plan)."""
    program = _run_stages(program, MEMORY_STAGES, options, hook)
    plan = plan_memory(program, options.workspace_limit, takeover=options.takeover)
    if options.verify:
        plan.check()
    if hook:
        hook(f"{program.name}:plan_memory", plan)
    return program, plan


def compile(loop: Loop, options: CompileOptions = CompileOptions(), hook: Hook | None = None) -> Compiled:  # noqa: A001
    """Compile a Loop into its setup, training-step and test-step SSA programs."""
    with _collector_paused():
        return _compile(loop, options, hook)


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


def _compile(loop: Loop, options: CompileOptions, hook: Hook | None) -> Compiled:
    graphs = build_step_graphs(loop, forward=simplify if options.simplify else None)
    if hook:
        hook(f"{graphs.train.name}:autodiff", graphs.train)
    train = _optimize_graph(graphs.train, options, hook)
    test = _optimize_graph(graphs.test, options, hook)
    if options.code_motion:
        setup_graph, (train, test) = hoist_invariants(f"{loop.name}_setup", [train, test])
    else:
        setup_graph = Graph(f"{loop.name}_setup", ())
    if hook:
        hook(f"{loop.name}:hoist_invariants", setup_graph)
    unplanned = {"setup": _lower(setup_graph, options, hook), "train": _lower(train, options, hook),
                 "test": _lower(test, options, hook)}
    planned = {step: plan_program(program, options, hook) for step, program in unplanned.items()}
    return Compiled(
        name=loop.name,
        source=loop.source,
        setup=planned["setup"][0],
        train=planned["train"][0],
        test=planned["test"][0],
        params=graphs.params,
        states=graphs.states,
        loop=loop,
        options=options,
        plans={step: plan for step, (_, plan) in planned.items()},
        unplanned=unplanned,
    )
