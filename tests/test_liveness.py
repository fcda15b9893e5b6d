"""The liveness model (`deepdsl.liveness`): the scheduler's predicted peak is the peak the memory plan gives, on
every network in `networks/`; live ranges, deaths and live bytes are what the dealloc pass and the planner use."""
from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, assume, given, settings

import deepdsl
from deepdsl.dsl import Overrides
from deepdsl.ir import Graph, make
from deepdsl.liveness import (StorageGraph, changes_at, deaths, live_bytes, live_ranges, peak_bytes, peak_estimate,
                              updates_in_place)
from deepdsl.memory_plan import dealloc_live_bytes, plan_memory, planned_live_bytes
from deepdsl.ops.elementwise import elementwise, sym
from deepdsl.ops.shape import concat, slice_axis
from deepdsl.passes.code_motion import sink
from deepdsl.passes.dealloc import insert_frees
from deepdsl.passes.inplace import compute_in_place
from deepdsl.passes.linearize import linearize
from deepdsl.passes.rematerialize import rematerialize
from deepdsl.passes.schedule import schedule_for_memory
from deepdsl.pipeline import CompileOptions
from deepdsl.ssa import Free, Let

from tests import test_memory_modes
from tests.support.memory_programs import small_networks, step_programs

ROOT = pathlib.Path(__file__).resolve().parents[1]
NETWORKS = test_memory_modes.NETWORKS       # network, image (the smallest sizes the strided networks accept)


def test_every_network_is_checked():
    assert sorted(name for name, _ in NETWORKS) == sorted(p.stem for p in (ROOT / "networks").glob("*.py"))


def compile_before_inplace(loop, options=CompileOptions(), staged=None):
    """(compiled, step name -> that step's program as the stage before in-place computation leaves it); `staged`:
    a dict to fill with "<program name>:<stage>" -> the program that stage leaves, for the stages after it."""
    before, done = {}, set()

    def hook(label, value):
        program, stage = label.rsplit(":", 1)
        if stage == "inplace":
            done.add(program)
        elif program not in done:
            before[program] = value         # the latest value until in-place computation runs
        if program in done and staged is not None:
            staged[label] = value

    compiled = deepdsl.compile(loop, options, hook)
    return compiled, {step: before[compiled.steps[step].program.name] for step in ("train", "test")}


_SMALL: dict = {}


def compile_small(name, image, options=CompileOptions()):
    """`compile_before_inplace` of a network at its test size, and the programs of the stages after (compiled once
    for every test that asks)."""
    if (name, image, options) not in _SMALL:
        staged: dict = {}
        loop = deepdsl.load(ROOT / "networks" / f"{name}.py", Overrides(batch=2, image=image))
        _SMALL[name, image, options] = (*compile_before_inplace(loop, options, staged), staged)
    return _SMALL[name, image, options]


@pytest.mark.parametrize("name,image", NETWORKS, ids=[n for n, _ in NETWORKS])
def test_the_estimate_is_the_planned_peak(name, image):
    """The peak the scheduler and rematerialization see (`peak_estimate` of the order they leave) is the plan's
    `peak_live_bytes` once the in-place and dealloc passes and the planner have run on that order."""
    compiled, scheduled, _ = compile_small(name, image)
    for step in ("train", "test"):
        assert updates_in_place(scheduled[step], StorageGraph(scheduled[step])), step
        assert peak_estimate(scheduled[step]) == compiled.steps[step].plan.peak_live_bytes, step


@pytest.mark.parametrize("name,image", [n for n in NETWORKS if n[0] in ("lenet", "resnet_mini", "inception_mini")],
                         ids=["lenet", "resnet_mini", "inception_mini"])
def test_the_scheduled_estimate_is_the_planned_peak_without_rematerialization(name, image):
    """Without rematerialization the scheduler's order is the final one: its estimate is the planned peak."""
    compiled, scheduled, _ = compile_small(name, image, CompileOptions(rematerialize=False))
    for step in ("train", "test"):
        assert peak_estimate(scheduled[step]) == compiled.steps[step].plan.peak_live_bytes, step


def test_live_ranges_are_the_plan_buffers_and_deaths_are_the_frees():
    stages = {}
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / "resnet_mini.py", Overrides(batch=2)),
                               hook=lambda label, value: stages.setdefault(label, value))
    program, plan = compiled.train, compiled.steps["train"].plan
    assert [(r.storage.root, r.begin, r.end, r.size) for r in live_ranges(program)] == \
        [(b.value, b.begin, b.end, b.size) for b in plan.buffers]
    # each storage dies at its last use (a pair's call using the first statement's inputs and output), and the Free
    # right after that statement releases it
    before = stages[f"{program.name}:fuse_multi_output"]
    assert any(isinstance(i, Let) and i.computes_also is not None for i in before.body)
    position = [k for k, instr in enumerate(program.body) if not isinstance(instr, Free)]
    dying = deaths(before)
    assert dying
    for k, infos in dying.items():
        free = program.body[position[k] + 1]
        assert isinstance(free, Free)
        assert [id(m) for m in free.nodes] == [id(m) for info in infos for m in info.live_members()]
        for info in infos:
            assert plan.buffers[plan.placement(info.root).buffer].end == position[k] + 1


def assert_dealloc_live_bytes(program):
    """`dealloc_live_bytes` of a program without frees is the live bytes the plan counts in the program dealloc
    makes of it, with and without takeovers, and says where each statement lands there."""
    freed = insert_frees(program)
    where = [k for k, instr in enumerate(freed.body) if not isinstance(instr, Free)]
    for takeover in (True, False):
        assert dealloc_live_bytes(program, takeover) == (planned_live_bytes(freed, takeover), where), takeover


@pytest.mark.parametrize("name,image", NETWORKS, ids=[n for n, _ in NETWORKS])
def test_the_live_bytes_after_dealloc_are_those_of_the_freed_program(name, image):
    """On every network's steps as the in-place pass and the fusions leave them (what fuse_horizontal and
    fuse_multi_output compare)."""
    compiled, _, staged = compile_small(name, image)
    for step in ("train", "test"):
        for stage in ("inplace", "fuse_horizontal", "fuse_multi_output"):
            assert_dealloc_live_bytes(staged[f"{compiled.steps[step].program.name}:{stage}"])


def test_live_bytes_count_a_takeover_pair_once():
    intervals, sizes = [(0, 3), (2, 5), (1, 2)], [512, 256, 1024]
    assert live_bytes(intervals, sizes) == [512, 1536, 768, 256, 256]
    # buffer 1 takes over buffer 0 at index 2: the two count once there, at the larger size
    assert live_bytes(intervals, sizes, [(0, 1)]) == [512, 1536, 512, 256, 256]
    assert peak_bytes(intervals, sizes, [(0, 1)]) == 1536
    assert live_bytes(intervals, sizes, length=2) == [512, 1536]
    assert peak_bytes([], []) == 0
    assert changes_at(intervals) == ({0: [0], 2: [1], 1: [2]}, {3: [0], 5: [1], 2: [2]})


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(small_networks())
def test_the_estimate_is_the_planned_peak_on_random_networks(loop):
    compiled, before = compile_before_inplace(loop)
    for step in ("train", "test"):
        assert peak_estimate(before[step]) == compiled.steps[step].plan.peak_live_bytes, step


@SETTINGS
@given(step_programs())
def test_the_estimate_is_the_planned_peak_on_random_programs(graph):
    program = rematerialize(schedule_for_memory(sink(linearize(graph))))
    assume(updates_in_place(program, StorageGraph(program)))
    assert peak_estimate(program) == plan_memory(insert_frees(compute_in_place(program))).peak_live_bytes


@SETTINGS
@given(step_programs())
def test_the_live_bytes_after_dealloc_are_those_of_the_freed_program_on_random_programs(graph):
    """On random programs after scheduling, rematerialization and the in-place pass."""
    assert_dealloc_live_bytes(compute_in_place(rematerialize(schedule_for_memory(sink(linearize(graph))))))


def test_a_statement_written_over_a_view_of_a_larger_storage_keeps_that_storage():
    """out = x[:5] of concat(x, x) + x: the in-place pass writes the sum over the slice (a view of the concatenation,
    512 bytes placed, where the sum alone would take 256); the estimate counts the storage it lives in, as the plan
    does (it counted the sum's own 256 bytes on top: 1024 against the plan's 768)."""
    x = make("input", (), dtype="float", name="x", role="data", shape=(5, 7))
    out = elementwise(sym(0) + sym(1), [slice_axis(concat([x, x], axis=0), 0, 0, 5), x])
    program = rematerialize(schedule_for_memory(sink(linearize(Graph("step", (("out0", out),))))))
    in_place = compute_in_place(program)
    assert in_place.body[-1].into is not None and in_place.body[-1].into.op == "slice"
    assert peak_estimate(program) == plan_memory(insert_frees(in_place)).peak_live_bytes == 768


def test_a_kept_order_still_lets_updates_be_written_in_place():
    """The scheduler keeps the order it was given only where that order runs every update after the other readers
    of the value it overwrites: here the given order updates w before the product reading w, and keeping it would
    make the in-place pass copy (a planned peak above the estimate)."""
    import sympy

    from deepdsl.ir import Graph, make
    from deepdsl.ops.elementwise import sym

    w = make("param", (), name="w", shape=(1, 1), dtype="float")
    u = make("param", (), name="u", shape=(1, 1), dtype="float")
    product = make("matmul", (w, u))
    zeros = make("const", (), shape=(1,), value=0.0)
    decay = sym(0) * sympy.Rational(9, 10) - sym(1) / 4
    graph = Graph("step", (("out0", product), ("out1", zeros),
                           ("w", make("ew", (w, make("sum_to", (zeros,), shape=())), expr=decay)),
                           ("u", make("ew", (u, product), expr=decay))))
    program = rematerialize(schedule_for_memory(sink(linearize(graph))))
    body = [i.node.op for i in program.body]
    assert body.index("matmul") < [k for k, i in enumerate(program.body) if i.node.inputs[:1] == (w,)
                                   and i.node.op == "ew"][0]
    assert peak_estimate(program) == plan_memory(insert_frees(compute_in_place(program))).peak_live_bytes
