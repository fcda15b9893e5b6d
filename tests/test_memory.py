"""The memory stages (schedule, rematerialize, in-place, dealloc, the max-pool gradient rewrite), the verifier's and
interpreter's view of them, LeNet against the DeepDSL paper's Figure 3, the memory table (golden text) and
`deepdsl memory`.

Property tests run each stage on random step programs (`memory_programs.step_programs`: random graphs plus
updates of persistent inputs) and check the verifier after every stage and the interpreter's results against the
program before the stages, exactly (the stages reorder and annotate, they compute nothing differently).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import deepdsl
from deepdsl.cli import main
from deepdsl.errors import VerifyError
from deepdsl.interpret import run
from deepdsl.ir import make
from deepdsl.liveness import StorageGraph, live_profile, peak_estimate
from deepdsl.memory_table import format_table, memory_report
from deepdsl.ops.elementwise import sym
from deepdsl.passes.code_motion import sink
from deepdsl.passes.dealloc import insert_frees
from deepdsl.passes.inplace import compute_in_place
from deepdsl.passes.linearize import linearize
from deepdsl.passes.pool_backward import push_through_pool_backward
from deepdsl.passes.rematerialize import rematerialize
from deepdsl.passes.schedule import respects, schedule_for_memory
from deepdsl.pipeline import CompileOptions
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import analyze
from deepdsl.verify import verify

from tests.support.memory_programs import assert_same, reference, step_programs
from tests.support.random_programs import feeds, graphs

ROOT = pathlib.Path(__file__).resolve().parents[1]
LENET = ROOT / "networks" / "lenet.py"
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MB = 1e6


def values_for(program: Program, seed: int) -> dict:
    return feeds(program.inputs, seed)


# ---------------------------------------------------------------------------------------------------------------
# every stage preserves the interpreter's results and passes the verifier

@SETTINGS
@given(step_programs(), st.integers(0, 2**16))
def test_each_memory_stage_preserves_values(graph, seed):
    program = verify(sink(linearize(graph)))
    values = values_for(program, seed)
    expected = reference(program, values, np.float64)
    scheduled = verify(schedule_for_memory(program))
    assert sorted(id(n) for n in scheduled.statements()) == sorted(id(n) for n in program.statements())
    assert_same(reference(scheduled, values, np.float64), expected)
    recomputed = verify(rematerialize(scheduled))
    assert_same(reference(recomputed, values, np.float64), expected)
    in_place = verify(compute_in_place(recomputed))
    assert_same(reference(in_place, values, np.float64), expected)
    freed = verify(insert_frees(in_place))
    assert_same(reference(freed, values, np.float64), expected)
    unscheduled = verify(insert_frees(compute_in_place(program)))          # the stages work in any valid order
    assert_same(reference(unscheduled, values, np.float64), expected)


@SETTINGS
@given(step_programs())
def test_scheduling_never_raises_the_peak(graph):
    """Against the order it was given, where that order lets every update be written in place: only there is the
    estimate of that order its peak (elsewhere the in-place pass would copy, which the estimate does not count)."""
    program = sink(linearize(graph))
    assume(respects(StorageGraph(program), list(range(len(program.body)))))
    assert peak_estimate(schedule_for_memory(program)) <= peak_estimate(program)


@SETTINGS
@given(step_programs())
def test_rematerialization_never_raises_live_bytes(graph):
    program = schedule_for_memory(sink(linearize(graph)))
    recomputed = rematerialize(program)
    before = live_profile(StorageGraph(program), list(range(len(program.body))))
    after = live_profile(StorageGraph(recomputed), list(range(len(recomputed.body))))
    # the statements of `program` in `recomputed`, at the same live bytes or fewer (copies are inserted before uses)
    kept = [k for k, instr in enumerate(recomputed.body) if not instr.node.attr("remat")]
    assert len(kept) == len(before)
    assert all(after[k] <= b for k, b in zip(kept, before))
    assert all(after[k] <= max(before) for k in range(len(after)))


@SETTINGS
@given(graphs())
def test_pool_backward_rewrite_preserves_graphs_without_pooling(graph):
    assert push_through_pool_backward(graph).outputs == graph.outputs


# ---------------------------------------------------------------------------------------------------------------
# the verifier and the interpreter catch wrong annotations

def lenet_train_program(**overrides) -> Program:
    from deepdsl.dsl import Overrides
    return deepdsl.compile(deepdsl.load(LENET, Overrides(batch=2)), CompileOptions(**overrides)).train


def test_verifier_rejects_reads_after_an_in_place_overwrite():
    program = lenet_train_program()
    body = list(program.body)
    k = next(k for k, i in enumerate(body) if isinstance(i, Let) and i.into is not None and not i.into.is_leaf)
    target = body[k].into
    reader = make("ew", (target,), expr=2 * sym(0))
    body.insert(k + 1, Let(reader))
    with pytest.raises(VerifyError, match="is read later"):
        verify(Program(program.name, program.inputs, tuple(body), program.outputs))
    # the interpreter deleted the overwritten value: the same mistake fails loudly there too
    feeds_ = {leaf.name: np.zeros(leaf.shape) for leaf in program.inputs}
    with pytest.raises(KeyError):
        run(Program(program.name, program.inputs, tuple(body), program.outputs), feeds_)


def test_verifier_rejects_in_place_over_a_value_read_later():
    program = lenet_train_program(inplace=False)
    body = list(program.body)
    # an elementwise statement over an input that some later statement still reads
    for k, instr in enumerate(body):
        node = instr.node if isinstance(instr, Let) else None
        if node is None or node.op != "ew":
            continue
        later = {id(i) for j in body[k + 1:] if isinstance(j, Let) for i in j.node.inputs}
        inputs = [i for i in node.inputs if id(i) in later and i.shape == node.shape and not i.is_leaf]
        if inputs:
            body[k] = Let(node, into=inputs[0])
            break
    else:
        pytest.fail("no candidate statement")
    with pytest.raises(VerifyError, match="read later|overwrote"):
        verify(Program(program.name, program.inputs, tuple(body), program.outputs))


def test_verifier_rejects_updates_of_parameters_by_other_statements():
    program = lenet_train_program(inplace=False)
    body = list(program.body)
    k, instr = next((k, i) for k, i in enumerate(body) if isinstance(i, Let) and i.node.op == "matmul")
    param = next(i for i in instr.node.inputs if i.op == "param")
    body[k] = Let(instr.node, into=param)
    with pytest.raises(VerifyError):
        verify(Program(program.name, program.inputs, tuple(body), program.outputs))


def test_verifier_rejects_late_and_missing_frees():
    program = lenet_train_program()
    body = list(program.body)
    k = next(k for k, i in enumerate(body) if isinstance(i, Free))
    late = body[:k] + body[k + 1:k + 2] + [body[k]] + body[k + 2:]
    with pytest.raises(VerifyError, match="not right after its last use|read after"):
        verify(Program(program.name, program.inputs, tuple(late), program.outputs))
    missing = body[:k] + body[k + 1:]
    with pytest.raises(VerifyError, match="never freed"):
        verify(Program(program.name, program.inputs, tuple(missing), program.outputs))


# ---------------------------------------------------------------------------------------------------------------
# LeNet, batch 500: the DeepDSL paper's Figure 3

@pytest.fixture(scope="module")
def lenet():
    return deepdsl.compile(deepdsl.load(LENET), CompileOptions(verify=True))


def test_lenet_tensor_sizes_match_figure_3(lenet):
    report = memory_report(lenet)
    sizes = {}
    for row in report.rows:
        if row.kind == "input":
            sizes.setdefault(row.name, row.nbytes)
        elif row.kind == "let":
            op = row.text.split(" = ", 1)[1].split("[")[0].split("(")[0]
            sizes.setdefault(op, []).append(row.nbytes)
    # Figure 3 (MB = 10^6 bytes): input 1.568, conv1 23.04, pool1 5.76, conv2 6.4, pool2 1.6, fc1 1.0, fc2 0.02
    assert sizes["x"] == 1_568_000
    assert sizes["conv2d"] == [23_040_000, 6_400_000]
    assert sizes["max_pool"] == [5_760_000, 1_600_000]
    assert sizes["matmul"][:2] == [1_000_000, 20_000]


def test_lenet_peak_is_under_30_mb(lenet):
    plan = lenet.steps["train"].plan
    # The peak is at conv1's pooling (Figure 3 sizes): x 1.568, y, conv1's output 23.04 and the argmax 1.44 MB are
    # live; the pooled output (5.76 MB) takes over the head of conv1's output, which dies there. Max pooling's
    # backward grows conv1's 23.04 MB gradient over its dying 5.76 MB input: x + argmax + 23.04 MB, just below. Without
    # the takeovers both instants held 31.81 MB (x, conv1's output or gradient, the pooled output or its gradient,
    # the argmax), the floor of separate buffers.
    forward = 1_568_000 + 2_000 + 23_040_000 + 1_440_000
    backward = 1_568_000 + 1_440_000 + 23_040_000
    assert plan.peak_live_bytes_exact == max(forward, backward)
    assert plan.peak_live_bytes - plan.peak_live_bytes_exact < 5 * 256
    assert plan.peak_live_bytes <= 30_000_000
    without = deepdsl.pipeline.plan_program(lenet.steps["train"].unplanned, CompileOptions(takeover=False))[1]
    assert without.peak_live_bytes_exact == forward + 5_760_000


def test_lenet_pooled_outputs_take_over_the_convolution_outputs(lenet):
    program, plan = lenet.train, lenet.steps["train"].plan
    body = program.body
    pools = [k for k, instr in enumerate(body) if isinstance(instr, Let) and instr.node.op == "max_pool"]
    assert len(pools) == 2
    for k in pools:
        conv = body[k].node.inputs[0]
        argmax = body[k - 1].node
        assert argmax.op == "max_pool_argmax" and argmax.inputs[0] is conv     # the pair, adjacent, argmax first
        assert isinstance(body[k + 1], Free) and conv in body[k + 1].nodes       # the conv output dies at the pooling
    # conv1's pooling takes over conv1's output, pool1's backward takes over its gradient input: the two instants
    # at the peak (conv2's pair stays below the peak and keeps its own buffers)
    taken = {plan.buffers[b.takes_over].value.op: b.value.op for b in plan.buffers if b.takes_over is not None}
    assert taken == {"conv2d": "max_pool", "conv2d_bwd_data": "max_pool_bwd"}
    for b in plan.buffers:
        if b.takes_over is not None:
            a = plan.buffers[b.takes_over]
            assert a.offset == b.offset and a.end == b.begin + 1
            assert plan.placement(b.value).takes_over is a.value


def test_lenet_updates_overwrite_parameters_and_momentum(lenet):
    program = lenet.train
    into = {id(i.node): i.into for i in program.body if isinstance(i, Let)}
    for name, node in program.outputs:
        if name == "loss":
            continue
        target = into[id(node)]
        assert target is not None and target.name == name, name
        assert lenet.steps["train"].plan.placement(node).leaf is target


def test_lenet_optimizations_each_lower_the_peak(lenet):
    report = memory_report(lenet)
    peak = report.plan.peak_live_bytes
    assert report.what_if["without memory-aware scheduling"] > 1.4 * peak
    assert report.what_if["without in-place parameter updates"] > peak
    assert report.what_if["without taking over dying inputs' storage"] > peak
    assert report.what_if["without rematerialization"] == peak          # LeNet has nothing worth recomputing
    assert report.what_if["without freeing (every tensor kept to the end)"] > 2 * peak


def test_lenet_memory_table_golden(lenet, golden):
    golden("lenet_memory_table.txt", format_table(memory_report(lenet)))


# ---------------------------------------------------------------------------------------------------------------
# the max-pool gradient rewrite lets the pooled activation die in the forward pass

def test_relu_before_pooling_dies_at_the_pooling(tmp_path):
    from test_memory_plan import load_small
    compiled = deepdsl.compile(load_small("pooled", tmp_path), CompileOptions(verify=True))
    program = compiled.train
    body = program.body
    pools = [k for k, i in enumerate(body) if isinstance(i, Let) and i.node.op == "max_pool"]
    assert len(pools) == 2
    for k in pools:
        pooled_input = body[k].node.inputs[0]
        readers = [j for j, i in enumerate(body) if isinstance(i, Let) and pooled_input in i.node.inputs]
        assert readers == [k - 1, k]                     # read by its argmax and the pooling only
        assert body[k - 1].node.op == "max_pool_argmax"
    reference_program = compiled.steps["train"].unplanned
    assert not any(i.node.op == "ew" and any(x.op == "max_pool_bwd" for x in i.node.inputs)
                   for i in reference_program.body)


# ---------------------------------------------------------------------------------------------------------------
# in-place LRN gradients, rematerialization

def test_lrn_backward_writes_over_its_incoming_gradient(tmp_path):
    from test_memory_plan import load_small
    program = deepdsl.compile(load_small("pooled", tmp_path), CompileOptions(verify=True)).train
    (instr,) = [i for i in program.body if isinstance(i, Let) and i.node.op == "lrn_bwd"]
    g, x = instr.node.inputs
    assert instr.into is g                              # dx over g, which dies there; never over the LRN input x


def test_verifier_rejects_in_place_over_an_input_the_kernel_reads_elsewhere(tmp_path):
    from test_memory_plan import load_small
    program = deepdsl.compile(load_small("pooled", tmp_path), CompileOptions(inplace=False)).steps["train"].unplanned
    program = compute_in_place(program, activations=False)
    body = list(program.body)
    k, instr = next((k, i) for k, i in enumerate(body) if i.node.op == "lrn_bwd")
    g, x = instr.node.inputs
    body[k] = Let(instr.node, into=x)                   # the kernel reads x at other positions than it writes
    with pytest.raises(VerifyError, match="other positions"):
        verify(Program(program.name, program.inputs, tuple(body), program.outputs))


def test_rematerialization_recomputes_batch_norm_relus_in_the_backward_pass():
    from deepdsl.dsl import Overrides
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / "resnet_mini.py", Overrides(batch=16)),
                               CompileOptions(verify=True))
    program = compiled.train
    copies = [i.node for i in program.body if isinstance(i, Let) and i.node.attr("remat")]
    assert copies and all(c.op == "ew" and "Max(0" in str(c.attr("expr")) for c in copies)
    assert program.text().count("(recomputed)") == len(copies)
    originals = {id(n) for n in compiled.steps["train"].unplanned.statements()}
    storage = analyze(program)
    position = {id(i.node): k for k, i in enumerate(program.body) if isinstance(i, Let)}
    for copy in copies:
        assert id(copy) not in originals                # a new node: the original keeps its identity
        # it reads only storage that other statements read after it anyway (nothing is kept alive longer)
        k = position[id(copy)]
        for i in copy.inputs:
            if i.op == "const" or storage.of(i).persistent:
                continue
            members = storage.of(i).members
            assert any(m in instr.node.inputs for instr in program.body[k + 1:] if isinstance(instr, Let)
                       for m in members)
    without = deepdsl.pipeline.plan_program(compiled.steps["train"].unplanned, CompileOptions(rematerialize=False))[1]
    assert compiled.steps["train"].plan.peak_live_bytes < 0.8 * without.peak_live_bytes


def test_rematerialization_splits_a_value_used_before_and_after_the_peak():
    """v = 2*w (w a parameter, always alive) is read right away and again after a large temporary: recomputing v
    before its late reader frees it during the temporary's life, so the peak drops by v's size."""
    x = make("param", (), name="x", shape=(64, 64), dtype="float")
    v = make("ew", (x,), expr=2 * sym(0))
    early = make("ew", (v,), expr=3 * sym(0))
    big = make("matmul", (early, early))
    small = make("sum_to", (big,), shape=())
    late = make("ew", (v, small), expr=sym(0) + sym(1))
    program = verify(Program("p", (x,), tuple(Let(n) for n in (v, early, big, small, late)),
                             (("out", late), ("e", small))))
    recomputed = verify(rematerialize(program))
    nodes = recomputed.statements()
    assert [n.op for n in nodes] == ["ew", "ew", "matmul", "sum_to", "ew", "ew"]
    copy = nodes[4]
    assert copy.attr("remat") == 1 and copy.inputs == (x,) and nodes[5].inputs[0] is copy
    assert peak_estimate(recomputed) == peak_estimate(program) - 64 * 64 * 4
    values = {"x": np.random.default_rng(0).standard_normal((64, 64))}
    assert_same(reference(recomputed, values, np.float64), reference(program, values, np.float64))
    assert rematerialize(schedule_for_memory(program)).statements()[-2].attr("remat") == 1
    # the same with x a batch input, dead after v: recomputing v would keep x alive instead, so v stays
    x = make("input", (), name="x", shape=(64, 64), dtype="float", role="data")
    nodes = [make("ew", (x,), expr=2 * sym(0))]
    nodes.append(make("ew", (nodes[0],), expr=3 * sym(0)))
    nodes.append(make("matmul", (nodes[1], nodes[1])))
    nodes.append(make("sum_to", (nodes[2],), shape=()))
    nodes.append(make("ew", (nodes[0], nodes[3]), expr=sym(0) + sym(1)))
    program = Program("p", (x,), tuple(Let(n) for n in nodes), (("out", nodes[4]), ("e", nodes[3])))
    assert rematerialize(program) is program


def test_rematerialization_reads_a_concatenated_piece_back_out_of_its_concatenation():
    """b = x @ w (a product: not cheap to recompute) is concatenated with a into c; b is read again after a large
    temporary, and c is read after that too. Keeping b over the temporary holds its bytes twice (in b and in c):
    the pass reads it back as slice(c) before its late reader, and the peak drops by b's size."""
    x = make("param", (), name="x", shape=(64, 64), dtype="float")
    w = make("param", (), name="w", shape=(64, 32), dtype="float")
    a = make("ew", (x,), expr=2 * sym(0))
    b = make("matmul", (x, w))
    c = make("concat", (a, b), axis=1)
    big = make("matmul", (c, make("ew", (c,), expr=3 * sym(0))), tb=True)
    small = make("sum_to", (big,), shape=())
    late = make("ew", (b, small), expr=sym(0) * sym(1))
    shifted = make("ew", (c, small), expr=sym(0) + sym(1))
    after = make("sum_to", (shifted,), shape=())
    body = (a, b, c, big.inputs[1], big, small, late, shifted, after)
    program = verify(Program("p", (x, w), tuple(Let(n) for n in body), (("late", late), ("after", after))))
    recomputed = verify(rematerialize(program))
    copies = [n for n in recomputed.statements() if n.attr("remat")]
    assert len(copies) == 1 and copies[0].op == "slice" and copies[0].inputs == (c,)
    assert (copies[0].attr("axis"), copies[0].attr("start"), copies[0].attr("stop")) == (1, 64, 96)
    assert recomputed.statements()[-3].inputs[0] is copies[0]            # the late reader reads the slice
    assert peak_estimate(recomputed) == peak_estimate(program) - 64 * 32 * 4
    rng = np.random.default_rng(1)
    values = {"x": rng.standard_normal((64, 64)), "w": rng.standard_normal((64, 32))}
    assert_same(reference(recomputed, values, np.float64), reference(program, values, np.float64))


def test_rematerialization_reads_googlenet_branches_out_of_their_concatenations():
    from deepdsl.dsl import Overrides
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / "googlenet.py", Overrides(batch=2, image=(79, 79))),
                               CompileOptions(verify=True))
    copies = [i.node for i in compiled.train.body if isinstance(i, Let) and i.node.attr("remat")]
    sliced = [c for c in copies if c.op == "slice"]
    assert sliced and all(c.inputs[0].op == "concat" for c in sliced)
    without = deepdsl.pipeline.plan_program(compiled.steps["train"].unplanned, CompileOptions(rematerialize=False))[1]
    assert compiled.steps["train"].plan.peak_live_bytes < without.peak_live_bytes


# ---------------------------------------------------------------------------------------------------------------
# the command line

def test_memory_command_json(capsys):
    assert main(["memory", str(LENET), "--batch", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("steps", "peak_live_bytes", "arena_bytes", "param_bytes", "optimizer_bytes", "workspace_bytes"):
        assert key in data
    assert {"name", "dims", "bytes", "live_bytes"} <= set(data["steps"][0])
    assert max(s["live_bytes"] for s in data["steps"]) == data["peak_live_bytes"]
    assert data["param_bytes"] == data["optimizer_bytes"] == 1_724_320      # Figure 3: 1.72432 MB, x2 with momentum
    assert data["steps"][0]["name"] == "x" and data["steps"][0]["bytes"] == 100 * 28 * 28 * 4
    taking = [b for b in data["buffers"] if b["takes_over"] is not None]
    assert taking and all(b["offset"] == data["buffers"][b["takes_over"]]["offset"] for b in taking)


def test_memory_command_workspace_limit(capsys):
    assert main(["memory", str(LENET), "--workspace-limit", "10MB"]) == 0
    text = capsys.readouterr().out
    assert "workspace:" in text and "limit 10000000 bytes; 5 statements run in batch chunks" in text
    assert "9.619200/3" in text                                        # conv1: 3 chunks of 167 images


def test_memory_command_plot_without_matplotlib(capsys, tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["memory", str(LENET), "--plot", str(tmp_path / "live.png")]) == 1
        assert "needs matplotlib" in capsys.readouterr().err
    else:
        assert main(["memory", str(LENET), "--plot", str(tmp_path / "live.png")]) == 0
        assert (tmp_path / "live.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
