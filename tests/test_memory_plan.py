"""The static memory plan: interval packing, plans run byte-exact inside their arena, the pool replay, workspace,
and the full-size networks against the original DeepDSL's figures (/work/shared/reference/README.md).

The strongest check is `run_in_arena`: a program executed with every tensor at its planned offset of one byte
array (freed bytes poisoned with NaNs) computes what the reference interpreter computes, up to float32 rounding
(the arena's tensors are contiguous where a reference result may have another memory layout, which changes the
order of a sum). Overlapping live tensors, a read after a free or after an in-place overwrite would change the
results far beyond rounding, or make them NaN.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import deepdsl
from deepdsl.dsl import Overrides
from deepdsl.interpret import run
from deepdsl.memory_plan import ALIGNMENT, pack, placed_size, plan_memory
from deepdsl.memory_table import simulate_pool
from deepdsl.ops import Workspace, batch_chunks, get_op
from deepdsl.passes.code_motion import sink
from deepdsl.passes.linearize import linearize
from deepdsl.pipeline import DEFAULT_WORKSPACE_LIMIT, CompileOptions, plan_program
from deepdsl.ssa import Let
from deepdsl.verify import verify

from tests.support.memory_programs import assert_same, reference, run_in_arena, small_networks, step_programs

ROOT = pathlib.Path(__file__).resolve().parents[1]
NETWORKS = sorted(p.stem for p in (ROOT / "networks").glob("*.py"))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MB = 1e6


# ---------------------------------------------------------------------------------------------------------------
# interval packing

@st.composite
def blocks(draw):
    n = draw(st.integers(1, 40))
    intervals, sizes = [], []
    for _ in range(n):
        begin = draw(st.integers(0, 30))
        intervals.append((begin, begin + draw(st.integers(1, 12))))
        sizes.append(placed_size(draw(st.integers(0, 5000))))
    return intervals, sizes


@SETTINGS
@given(blocks())
def test_packing_never_overlaps_live_blocks(case):
    intervals, sizes = case
    offsets, _ = pack(intervals, sizes)
    for i, ((b1, e1), s1, o1) in enumerate(zip(intervals, sizes, offsets)):
        assert o1 % ALIGNMENT == 0 and o1 >= 0
        for (b2, e2), s2, o2 in list(zip(intervals, sizes, offsets))[i + 1:]:
            if b1 < e2 and b2 < e1:                                   # live at the same time
                assert o1 + s1 <= o2 or o2 + s2 <= o1, (i, (b1, e1, o1, s1), (b2, e2, o2, s2))
    peak = max(sum(s for (b, e), s in zip(intervals, sizes) if b <= t < e) for t in range(45))
    assert max(o + s for o, s in zip(offsets, sizes)) >= peak


def test_placed_size_rounds_up_to_the_alignment():
    assert placed_size(0) == 256 and placed_size(1) == 256 and placed_size(256) == 256 and placed_size(257) == 512


# ---------------------------------------------------------------------------------------------------------------
# plans of random programs, executed inside their arena

def planned(graph, **options):
    program = sink(linearize(graph))
    return plan_program(program, CompileOptions(verify=True, **options))


@SETTINGS
@given(step_programs(), st.integers(0, 2**16))
def test_random_programs_run_exactly_inside_their_plan(graph, seed):
    from tests.support.random_programs import feeds
    program, plan = planned(graph)
    plan.check()
    values = feeds(program.inputs, seed)
    assert_same(run_in_arena(program, plan, values), reference(program, values), rtol=1e-5)
    assert simulate_pool(plan)["peak_bytes_in_use"] == plan.peak_live_bytes


def test_an_old_value_kept_as_an_output_beside_an_equal_copy_is_one_statement_each():
    """A step returning a copy of a parameter's view (`ew(v0)`) and the view itself, while it updates the parameter:
    the in-place pass keeps the view's old value by a copy of its own, not the equal statement the program already
    has (hash-consing would make them one node, assigned twice)."""
    from deepdsl.ir import Graph, make
    from deepdsl.ops.elementwise import reshape, sum_to, sym
    from deepdsl.passes.inplace import copy_of
    from tests.support.random_programs import feeds

    w = make("param", (), name="w", shape=(1, 1), dtype="float")
    view = reshape(w, (1,))
    copy = make("ew", (view,), expr=sym(0))
    new_w = make("ew", (w, sum_to(copy, ())), expr=sym(0) * 9 / 10 - sym(1) / 4)
    program, plan = planned(Graph("step", (("out0", copy), ("out1", view), ("w", new_w))))
    plan.check()
    assert copy_of(view) is not copy
    values = feeds(program.inputs, 0)
    assert_same(run_in_arena(program, plan, values), reference(program, values), rtol=1e-5)


def test_a_slice_of_a_block_on_the_alignment_is_a_view_other_slices_copy():
    """Rows 1..2 of a (3, 64) value start 256 bytes in, on the arena's alignment: the slice is a view of the value
    (no buffer, nothing copied; the value stays live while the view is read, and the statement writing in place
    over the view writes the value's bytes). Every row's first half is no block, and a (3, 5) value's row 1
    starts 20 bytes in: both are copies. Run in the plan's arena, the step computes what the interpreter does."""
    from deepdsl.ir import Graph, make
    from deepdsl.ops.elementwise import sym
    from tests.support.random_programs import feeds

    x = make("input", (), name="x", shape=(3, 64), dtype="float", role="data")
    z = make("input", (), name="z", shape=(3, 5), dtype="float", role="data")
    y, zz = make("ew", (x,), expr=sym(0) * 2), make("ew", (z,), expr=sym(0) * 3)
    rows = make("slice", (y,), axis=0, start=1, stop=3)
    half = make("slice", (y,), axis=1, start=0, stop=32)
    odd = make("slice", (zz,), axis=0, start=1, stop=2)
    assert [get_op("slice").aliases(n) for n in (rows, half, odd)] == [True, False, False]
    outputs = (("rows", make("ew", (rows,), expr=sym(0) * sym(0) + 1)), ("half", make("ew", (half,), expr=sym(0) - 1)),
               ("odd", make("ew", (odd,), expr=sym(0) + 5)))
    program, plan = planned(Graph("step", outputs))
    plan.check()
    placed = {id(p.value): p for p in plan.placements.values()}
    assert placed[id(rows)].view_of is y and placed[id(rows)].buffer == placed[id(y)].buffer
    assert placed[id(half)].view_of is None and placed[id(half)].buffer != placed[id(y)].buffer
    assert placed[id(odd)].view_of is None and placed[id(odd)].buffer != placed[id(zz)].buffer
    values = feeds(program.inputs, 3)
    assert_same(run_in_arena(program, plan, values), reference(program, values), rtol=1e-6)


@SETTINGS
@given(step_programs())
def test_live_bytes_are_the_sum_of_live_buffers(graph):
    program, plan = planned(graph)
    for step in plan.steps:
        live = [b for b in plan.buffers if b.begin <= step.index < b.end]
        assert step.live_bytes == sum(b.size for b in live)
        assert step.live_bytes_exact == sum(b.nbytes for b in live)
    # a program of no statement (its output is an input) holds only its loaded inputs
    assert plan.peak_live_bytes == max((s.live_bytes for s in plan.steps), default=sum(b.size for b in plan.buffers))


SMALL = {"lenet": (28, 28), "mlp": None, "resnet_mini": (32, 32), "inception_mini": (32, 32)}
# ReLU before overlapping and non-overlapping max pooling, LRN, dropout, Adam: what the networks above lack
POOLED = """\
from deepdsl import dsl as D
x = D.images("x", (2, 3, 15, 15))
y = D.labels("y", 2, classes=5)
net = (D.full("fc", 5) @ D.dropout(0.5) @ D.flatten @ D.max_pool(3, stride=2, ceil=True) @ D.relu
       @ D.conv("c2", kernel=3, channels=6, padding=1) @ D.max_pool(2) @ D.lrn(size=3) @ D.relu
       @ D.conv("c1", kernel=3, channels=4))
loop = D.Loop((D.log_loss(y) @ D.softmax @ net)(x), (D.precision(y) @ net)(x), D.Train("pooled", optimizer="adam"))
"""


def load_small(name: str, tmp_path: pathlib.Path):
    if name == "pooled":
        path = tmp_path / "pooled.py"
        path.write_text(POOLED)
        return deepdsl.load(path)
    return deepdsl.load(ROOT / "networks" / f"{name}.py", Overrides(batch=2, image=SMALL[name]))


@pytest.mark.parametrize("name", sorted(SMALL) + ["pooled"])
def test_small_networks_run_exactly_inside_their_plans(name, tmp_path):
    check_inside_plans(deepdsl.compile(load_small(name, tmp_path), CompileOptions(verify=True)), seed=1)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_networks(), st.integers(0, 2**16))
def test_random_networks_run_exactly_inside_their_plans(loop, seed):
    """Random convolutional networks (pooling, LRN, batch norm, residual blocks) through every stage, verified,
    their plans checked and run byte-exact in their arenas: rematerialized values, in-place LRN gradients and
    outputs taking over their inputs' storage included."""
    check_inside_plans(deepdsl.compile(loop, CompileOptions(verify=True)), seed)


def check_inside_plans(compiled, seed: int) -> None:
    rng = np.random.default_rng(seed)
    setup = run(compiled.setup, {})
    for step in ("train", "test"):
        program, plan = getattr(compiled, step), compiled.steps[step].plan
        plan.check()
        values = dict(setup)
        for leaf in program.inputs:
            if leaf.name not in values:
                values[leaf.name] = (rng.integers(0, 2, leaf.shape) if leaf.dtype == "int32"
                                     else rng.standard_normal(leaf.shape).astype(np.float32) * 0.1)
        expected = reference(compiled.steps[step].unplanned, values)
        assert_same(run_in_arena(program, plan, values), expected, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# workspace

def test_batch_chunks_is_the_smallest_count_that_fits():
    assert batch_chunks(500, 100, None) == Workspace(50000, 1)
    assert batch_chunks(500, 100, 50000) == Workspace(50000, 1)
    assert batch_chunks(500, 100, 49999) == Workspace(25000, 2)       # 499 samples fit: two chunks of 250
    assert batch_chunks(10, 100, 350) == Workspace(300, 4)            # 3 samples fit: ceil(10/3) = 4 chunks of <= 3
    assert batch_chunks(10, 100, 50) == Workspace(100, 10)            # not even one sample fits: one at a time
    assert batch_chunks(10, 0, 50) == Workspace(0, 1)
    for n in range(1, 40):
        for limit in range(100, 4000, 170):
            got = batch_chunks(n, 100, limit)
            assert got.nbytes <= limit
            assert got.chunks == 1 or -(-n // (got.chunks - 1)) * 100 > limit   # one chunk fewer would not fit


def test_convolution_workspace_is_what_the_cpu_kernels_carve():
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / "lenet.py"), CompileOptions(workspace_limit=None))
    plan = compiled.steps["train"].plan
    convs = {}
    for step in plan.steps:
        if isinstance(step.instr, Let) and step.instr.node.op.startswith("conv2d"):
            convs.setdefault(step.instr.node.op, []).append(step.workspace)
    # float32 per sample, x 500 samples x 4 bytes (no padding in LeNet):
    # conv2d: the im2col matrix C*kh*kw x Ho*Wo: conv1 25*576, conv2 500*64
    assert sorted(convs["conv2d"]) == [28_800_000, 64_000_000]
    # conv2d_bwd_filter: the im2col matrix and the transposed output gradient O x Ho*Wo: (25+20)*576, (500+50)*64
    assert sorted(convs["conv2d_bwd_filter"]) == [51_840_000, 70_400_000]
    # conv2d_bwd_data (stride 1): the output gradient and the column gradients on rows as wide as the input
    # ((O + C*kh*kw) x Ho*W = 550*8*12) and the input gradient with kw-1 spare elements (C x (H*W + 4) = 20*148)
    assert convs["conv2d_bwd_data"] == [111_520_000]
    assert plan.workspace_bytes == 111_520_000


def test_workspace_limit_chunks_the_batch():
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / "lenet.py"),
                               CompileOptions(workspace_limit=10_000_000))
    plan = compiled.steps["train"].plan
    assert plan.workspace_bytes <= 10_000_000 and plan.workspace_limit == 10_000_000
    for step in plan.steps:
        if isinstance(step.instr, Let):
            node = step.instr.node
            full = get_op(node.op).workspace(node).nbytes
            if full > 10_000_000:
                # a chunk of ceil(500 / chunks) samples, plus the weight-gradient accumulator (O x C*kh*kw floats)
                # when the weight gradient is summed over chunks
                fixed = 4 * node.shape[0] * int(np.prod(node.shape[1:])) if node.op == "conv2d_bwd_filter" else 0
                assert step.chunks > 1 and step.workspace == -(-500 // step.chunks) * (full // 500) + fixed
            else:
                assert step.chunks == 1 and step.workspace == full + stage(plan, step)


def stage(plan, step) -> int:
    """Workspace a statement adds when its output takes over its input's bytes: one sample of the smaller."""
    if step.allocates is None or plan.buffers[step.allocates].takes_over is None:
        return 0
    b = plan.buffers[step.allocates]
    a = plan.buffers[b.takes_over]
    n = b.value.shape[0]
    return min(a.nbytes // n, b.nbytes // n)


def test_taking_over_statements_stage_one_sample_in_their_workspace():
    plan = deepdsl.compile(deepdsl.load(ROOT / "networks" / "lenet.py")).steps["train"].plan
    staged = {step.instr.node.op: step.workspace for step in plan.steps if stage(plan, step)}
    # conv1's pooling: one pooled sample (20x12x12 floats) after the op's own scratch (none, no padding);
    # pool1's backward: one sample of its gradient input (20x12x12) after its 'hit' mask (500x20x12x12 booleans)
    assert staged == {"max_pool": 20 * 12 * 12 * 4, "max_pool_bwd": 500 * 20 * 12 * 12 + 20 * 12 * 12 * 4}


# ---------------------------------------------------------------------------------------------------------------
# full-size networks

DEEPDSL_PEAK_MB = {"alexnet": 745.4, "overfeat": 721.8, "vgg16": 3943.4, "resnet50": 3423.3}
TARGET = 0.7          # at most this fraction of DeepDSL's peak


@pytest.fixture(scope="module")
def full_size():
    return {name: deepdsl.compile(deepdsl.load(ROOT / "networks" / f"{name}.py")) for name in NETWORKS}


@pytest.mark.parametrize("name", NETWORKS)
def test_full_size_arena_is_within_five_percent_of_the_peak(full_size, name):
    for step, compiled_step in full_size[name].steps.items():
        plan = compiled_step.plan.check()
        assert plan.arena_bytes <= 1.05 * plan.peak_live_bytes, (step, plan.arena_bytes, plan.peak_live_bytes)
        # a first-fit pool gives a taking-over buffer its own block: its peak is the plan's without takeovers
        program = compiled_step.program
        assert simulate_pool(plan)["peak_bytes_in_use"] == plan_memory(program, takeover=False).peak_live_bytes


def test_lenet_peak_is_under_30_mb(full_size):
    assert full_size["lenet"].steps["train"].plan.peak_live_bytes <= 30_000_000


@pytest.mark.parametrize("name", NETWORKS)
def test_every_statement_keeps_within_the_workspace_limit(full_size, name):
    """The default limit holds for every statement of every network at full size (convolutions, pooling, LRN,
    dropout masks and losses all run over the batch in chunks), except where a single sample's scratch exceeds it:
    that statement then runs one sample at a time."""
    for which, compiled_step in full_size[name].steps.items():
        plan = compiled_step.plan
        assert plan.workspace_limit == DEFAULT_WORKSPACE_LIMIT
        for step in plan.steps:
            if step.workspace > plan.workspace_limit:
                node = step.instr.node
                batch = (node.inputs[0] if node.op == "conv2d_bwd_filter" else node).shape[0]
                assert step.chunks == batch, (name, which, node.op, step.workspace, step.chunks)


@pytest.mark.parametrize("name", sorted(DEEPDSL_PEAK_MB))
def test_full_size_peak_against_deepdsl(full_size, name):
    peak = full_size[name].steps["train"].plan.peak_live_bytes / MB
    assert peak <= TARGET * DEEPDSL_PEAK_MB[name], (name, peak, peak / DEEPDSL_PEAK_MB[name])


def test_memory_stages_are_fast_on_resnet50(full_size):
    import time
    program = full_size["resnet50"].steps["train"].unplanned
    start = time.perf_counter()
    plan_program(program)
    assert time.perf_counter() - start < 1.5        # typically ~0.2 s; generous for a loaded machine


def test_plan_of_a_program_without_frees_keeps_everything():
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / "mlp.py"))
    program = compiled.steps["train"].unplanned
    plan = plan_memory(verify(program)).check()
    assert all(b.end == len(program.body) for b in plan.buffers)
    assert plan.peak_live_bytes == sum(b.size for b in plan.buffers)
