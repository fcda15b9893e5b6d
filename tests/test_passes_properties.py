"""Property tests: every pass preserves what the reference interpreter computes, on random well-shaped graphs.

For each pass p and for the whole pipeline, on graphs drawn by `random_programs.graphs()`: the result passes the
verifier after every stage, and `interpret.run(linearize(p(g)))` equals `interpret.run(linearize(g))` in float64
(relative tolerance 1e-9 of each output's scale; the rewrites change rounding only, except log(softmax) ->
log_softmax, which is more accurate and checked with the same tolerance on bounded logits). Plus the guarantees
passes state beyond equal values: simplify and CSE are idempotent, fusion never adds `ew` nodes, sink equals the
direct quadratic definition, hoisting moves no random draws.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from deepdsl import pipeline
from deepdsl.interpret import run
from deepdsl.ir import Graph, toposort
from deepdsl.passes.code_motion import hoist_invariants, sink
from deepdsl.passes.cse import cse
from deepdsl.passes.fuse_elementwise import fuse_elementwise
from deepdsl.passes.fuse_epilogue import fuse_epilogue
from deepdsl.passes.linearize import linearize
from deepdsl.passes.simplify import simplify
from deepdsl.ssa import Let, Program
from deepdsl.verify import verify, verify_graph

from tests.support.random_programs import SIZES, feeds, graphs

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RTOL = 1e-9


def evaluate(program: Program, values: dict) -> dict:
    return run(verify(program), {leaf.name: values[leaf.name] for leaf in program.inputs}, float_dtype=np.float64)


def assert_same(ours: dict, reference: dict):
    assert list(ours) == list(reference)
    for name, ref in reference.items():
        got = ours[name]
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=RTOL * scale, err_msg=name)


def run_graph(graph: Graph, values: dict) -> dict:
    return evaluate(linearize(verify_graph(graph)), values)


def check_graph_pass(graph: Graph, graph_pass, seed: int) -> Graph:
    values = feeds(graph, seed)
    reference = run_graph(graph, values)
    result = graph_pass(graph)
    assert [k for k, _ in result.outputs] == [k for k, _ in graph.outputs]
    for (_, a), (_, b) in zip(result.outputs, graph.outputs):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert_same(run_graph(result, values), reference)
    return result


def ew_count(graph: Graph) -> int:
    return sum(1 for n in graph.nodes() if n.op == "ew")


@SETTINGS
@given(graphs(), st.integers(0, 2**31))
def test_simplify_preserves_values_and_is_idempotent(graph, seed):
    once = check_graph_pass(graph, simplify, seed)
    twice = simplify(once)
    assert all(a is b for (_, a), (_, b) in zip(once.outputs, twice.outputs)), "a rule still applies after simplify"


@SETTINGS
@given(graphs(), st.integers(0, 2**31))
def test_fuse_elementwise_preserves_values_and_adds_no_ew_node(graph, seed):
    fused = check_graph_pass(graph, fuse_elementwise, seed)
    assert ew_count(fused) <= ew_count(graph)
    # after simplification and CSE too (the pipeline's order)
    prepared = cse(simplify(graph))
    check_graph_pass(prepared, fuse_elementwise, seed)


@SETTINGS
@given(graphs(), st.integers(0, 2**31))
def test_fuse_epilogue_preserves_values_and_adds_no_node(graph, seed):
    fused = check_graph_pass(graph, lambda g: fuse_epilogue(fuse_elementwise(g)), seed)
    assert len(toposort(node for _, node in fused.outputs)) <= len(toposort(node for _, node in graph.outputs))


@SETTINGS
@given(graphs(), st.integers(0, 2**31))
def test_cse_preserves_values_and_is_idempotent(graph, seed):
    once = check_graph_pass(graph, cse, seed)
    twice = cse(once)
    assert all(a is b for (_, a), (_, b) in zip(once.outputs, twice.outputs))
    assert len(once.nodes()) <= len(graph.nodes())


def run_hoisted(setup: Graph, steps: list[Graph], values: dict) -> list[dict]:
    hoisted = run_graph(setup, values) if setup.outputs else {}
    return [run_graph(g, {**values, **hoisted}) for g in steps]


@SETTINGS
@given(st.data(), SIZES, st.integers(0, 2**31))
def test_hoist_invariants_preserves_values(data, sizes, seed):
    # two step graphs over the same leaves, as train and test share parameters and hyperparameters
    graph = data.draw(graphs(sizes=sizes))
    other = Graph("other", data.draw(graphs(sizes=sizes)).outputs)
    values = {**feeds(other, seed), **feeds(graph, seed)}
    reference = [run_graph(graph, values), run_graph(other, values)]
    setup, steps = hoist_invariants("setup", [graph, other])
    for step, ref in zip(run_hoisted(setup, steps, values), reference):
        assert_same(step, ref)
    for _, node in setup.outputs:
        assert not any(n.op == "bernoulli" for n in toposort([node])), "a random draw was hoisted"
        assert not any(n.op in ("param", "state") or n.attr("role") in ("data", "label") for n in toposort([node]))
    for step in steps:
        hoisted_inputs = {n.name for n in step.leaves() if n.attr("role") == "hoisted"}
        assert hoisted_inputs <= {name for name, _ in setup.outputs}


def sink_by_definition(program: Program) -> Program:
    """The quadratic definition of sink: from the last statement to the first, each goes right before its first
    placed reader (or to the front when nobody reads it)."""
    users: dict[int, list] = {}
    for instr in program.body:
        for i in instr.node.inputs:
            users.setdefault(id(i), []).append(instr.node)
    placed: list = []
    for instr in reversed(program.body):
        readers = users.get(id(instr.node))
        placed.insert(min(placed.index(r) for r in readers) if readers else 0, instr.node)
    return Program(program.name, program.inputs, tuple(Let(n) for n in placed), program.outputs)


@SETTINGS
@given(graphs(max_steps=20), st.integers(0, 2**31))
def test_sink_preserves_values_and_matches_its_definition(graph, seed):
    values = feeds(graph, seed)
    program = linearize(graph)
    sunk = sink(program)
    assert_same(evaluate(sunk, values), evaluate(program, values))
    assert sunk.body == sink_by_definition(program).body


def compile_graphs(graphs_: list[Graph], options: pipeline.CompileOptions):
    """The pipeline's stages after differentiation, with the verifier after each (as `compile` runs them)."""
    steps = {"setup": Graph("setup", ()), **{f"step{k}": g for k, g in enumerate(graphs_)}}
    programs = pipeline.run_stages(steps, pipeline.OPTIMIZATION_STAGES, options)
    return programs["setup"], [programs[f"step{k}"] for k in range(len(graphs_))]


@SETTINGS
@given(graphs(), st.integers(0, 2**31))
def test_pipeline_preserves_values(graph, seed):
    values = feeds(graph, seed)
    reference = run_graph(graph, values)
    options = pipeline.CompileOptions(verify=True)
    setup, (step,) = compile_graphs([graph], options)
    hoisted = evaluate(setup, values) if setup.body else {}
    assert_same(evaluate(step, {**values, **hoisted}), reference)
    # and after the memory stages (schedule, in-place computation, frees), as `compile` returns the programs
    final, _ = pipeline.plan_program(step, options)
    assert_same(evaluate(final, {**values, **hoisted}), reference)
