"""The compiler pipeline: one readable tuple of named stages, with a hook after each for dumps and verification.

    Loop ─build_step_graphs→ train/test Graphs ─simplify→ ─fuse_elementwise→ ─cse→ ─hoist_invariants→
         ─linearize→ Programs ─sink→ Programs
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from deepdsl.dsl import Loop
from deepdsl.ir import Graph, Node
from deepdsl.passes.code_motion import hoist_invariants, sink
from deepdsl.passes.cse import cse
from deepdsl.passes.fuse_elementwise import fuse_elementwise
from deepdsl.passes.linearize import linearize
from deepdsl.passes.simplify import simplify
from deepdsl.program import Program
from deepdsl.training import build_step_graphs

Hook = Callable[[str, object], None]

# CSE runs before fusion too: merging duplicates first gives fusion true reader counts
GRAPH_STAGES: tuple[tuple[str, Callable[[Graph], Graph]], ...] = (
    ("simplify", simplify),
    ("cse", cse),
    ("fuse_elementwise", fuse_elementwise),
    ("cse", cse),
)
PROGRAM_STAGES: tuple[tuple[str, Callable[[Program], Program]], ...] = (
    ("sink", sink),
)


@dataclass(frozen=True)
class CompileOptions:
    """What to run. Every optimization can be switched off to see what it buys."""

    simplify: bool = True
    fuse: bool = True
    cse: bool = True
    code_motion: bool = True
    verify: bool = False

    def enabled(self, stage: str) -> bool:
        return {"simplify": self.simplify, "fuse_elementwise": self.fuse, "cse": self.cse,
                "sink": self.code_motion}.get(stage, True)


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


def _optimize_graph(graph: Graph, options: CompileOptions, hook: Hook | None) -> Graph:
    from deepdsl.verify import verify_graph
    for name, stage in GRAPH_STAGES:
        if options.enabled(name):
            graph = stage(graph)
            if options.verify:
                verify_graph(graph)
            if hook:
                hook(f"{graph.name}:{name}", graph)
    return graph


def _lower(graph: Graph, options: CompileOptions, hook: Hook | None) -> Program:
    from deepdsl.verify import verify
    program = linearize(graph)
    if options.verify:
        verify(program)
    if hook:
        hook(f"{graph.name}:linearize", program)
    for name, stage in PROGRAM_STAGES:
        if options.enabled(name):
            program = stage(program)
            if options.verify:
                verify(program)
            if hook:
                hook(f"{graph.name}:{name}", program)
    return program


def compile(loop: Loop, options: CompileOptions = CompileOptions(), hook: Hook | None = None) -> Compiled:  # noqa: A001
    """Compile a Loop into its setup, training-step and test-step SSA programs."""
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
    return Compiled(
        name=loop.name,
        source=loop.source,
        setup=_lower(setup_graph, options, hook),
        train=_lower(train, options, hook),
        test=_lower(test, options, hook),
        params=graphs.params,
        states=graphs.states,
        loop=loop,
        options=options,
    )
