"""The generated program's memory: the peak it measures is the peak the compiler planned, in every memory mode.

For every network of networks/ at a test size, the generated program runs two training steps and one test step in
each mode (`static`: planned offsets in one arena, `pooled`: the runtime's first-fit pool, `dynamic`: one
allocation per tensor) with its run-time plan checks on, on numpy's kernels (tests/test_native_kernels.py runs the
compiled ones). The allocator's own high-water mark of tensor bytes (each
buffer counted at its 256-rounded size, as the plan counts it) must equal the plan's `peak_live_bytes` of that
step, its largest workspace the plan's `workspace_bytes`, and the three modes must compute bit for bit the same
losses, accuracy, parameters and state, each mode on another number of threads (1, 2 and 3). The two training
losses, test accuracy and test loss are those recorded in tests/golden/network_steps.json: bit for bit where the
kernels that made the record compute here (`tests.support.arithmetic`), within float32 tolerance elsewhere. Python's
allocation tracer (tracemalloc, which sees numpy's allocations) checks independently that the dynamic mode really
releases what it frees.

Also: a corrupted plan (two live buffers overlapping, a wrong size, a double free) fails loudly when checked; the
pool's chunk is the capacity the compiler's replay found; every kernel with scratch space uses exactly the
workspace its op rule plans, no more (it raises) and no less (its highest used element is the last); the command
line's --memory-mode and the report's memory fields.
"""
from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from deepdsl.ir import FLOAT, INT32, UINT8
from deepdsl.memory_plan import plan_memory
from deepdsl.memory_table import simulate_pool
from deepdsl.ops import get_op
from deepdsl.pipeline import CompileOptions
from deepdsl.ssa import Let
from tests.support.arithmetic import description
from tests.support.program_helpers import compile_program, import_program, model_class, run_cli
from tests.test_runtime_cpu import runtime_function

from deepdsl_runtime import cpu, memory
from deepdsl_runtime.memory import MODES, MemoryPlanError

# network, image (the smallest sizes the strided networks accept, as tests/test_networks.py uses them)
NETWORKS = [
    ("lenet", None), ("mlp", None), ("alexnet", (55, 55)), ("overfeat", (71, 71)), ("vgg16", (32, 32)),
    ("googlenet", (79, 79)), ("resnet50", (64, 64)), ("resnet_mini", None), ("inception_mini", None),
    ("se_resnet", None), ("unet", None), ("mobilenet_v2", (64, 64)), ("vit", None), ("char_lm", None),
]
BATCH = 2
_programs: dict = {}
# each network's planned peaks and workspace and, bit for bit, its two training losses, test accuracy and test loss
# at this size (float.hex), with the kernels that computed them ("kernels": `tests.support.arithmetic.description`);
# a change of the compiler that changes any of them must say why and refresh the record
# (`python -m tests.support.record_network_steps`)
GOLDEN_PATH = Path(__file__).parent / "golden" / "network_steps.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text())
# where other kernels compute (another BLAS kernel, other SIMD widths): the recorded losses hold to this relative
# float32 tolerance after two steps, or to ten times what a rounding of the input changes them by here (`NUDGES`)
# where the network amplifies roundings more (ResNet-50 at 64x64 and batch 2: by percents after two steps), and the
# test accuracy to one example of the batch (a near tie may fall either way)
RECORD_TOLERANCE = 1e-4
# the inputs' scalings whose changes to the steps measure that spread: a rounding up, one down, two up (one alone
# can miss it: MobileNet-v2 at 64x64 on a Zen 3, its losses moved by 6.6e-6, 1.5e-4 and 8.1e-4 by these three, and
# by 1.8e-4 on other kernels)
NUDGES = (1 + 2 ** -23, 1 - 2 ** -24, 1 + 2 ** -22)
# the threads each mode runs on: every mode and every thread count compute the same bits
MODE_THREADS = dict(zip(MODES, (1, 2, 3)))


def program(name, image, tmp_path_factory):
    """(compiled, generated module's model class) of a network at the test size, compiled once per test run."""
    if name not in _programs:
        compiled, path = compile_program(name, tmp_path_factory.mktemp(name), batch=BATCH, image=image)
        _programs[name] = compiled, model_class(import_program(path))
    return _programs[name]


def batches(model_cls, count, seed=5):
    rng = np.random.default_rng(seed)
    return [model_cls.random_batch(rng) for _ in range(count)]


def planned_peak(plan, mode):
    """The peak `deepdsl memory` prints for a mode: the plan's (static), or the pool replay's peak in use (pooled,
    dynamic: a buffer taking over another's bytes is a separate allocation there; the same without takeovers)."""
    return plan.peak_live_bytes if mode == "static" else simulate_pool(plan)["peak_bytes_in_use"]


def run_steps(model_cls, mode, data, check=True, kernels="auto", threads=None):
    """Two training steps and one test step from the same initial tensors; the model and its results."""
    model = model_cls("cpu", 0, mode, check, kernels=kernels, threads=threads)
    model.initialize(0)
    model.prepare(model.hyper(0.01, 0.9, 0.001, 0))
    losses = [model.train_step(x, y, step=k, **model.hyper(0.01, 0.9, 0.001, k)) for k, (x, y) in enumerate(data)]
    accuracy, test_loss, _ = model.test_step(*data[0])
    return model, (losses, accuracy, test_loss)


@pytest.mark.parametrize("name,image", NETWORKS, ids=[n for n, _ in NETWORKS])
def test_every_mode_measures_the_planned_peak_and_computes_the_same_bits(name, image, tmp_path_factory):
    compiled, model_cls = program(name, image, tmp_path_factory)
    data = batches(model_cls, 2)
    train, test = compiled.steps["train"].plan, compiled.steps["test"].plan
    results, probabilities = {}, {}
    for mode in MODES:
        model, outputs = run_steps(model_cls, mode, data, kernels="numpy", threads=MODE_THREADS[mode])
        usage = model.mem.usage
        assert usage["train_step"].runs == 2 and usage["test_step"].runs == 1
        assert usage["train_step"].peak_bytes == planned_peak(train, mode), mode
        assert usage["test_step"].peak_bytes == planned_peak(test, mode), mode
        assert usage["train_step"].workspace_bytes == train.workspace_bytes, mode
        assert usage["test_step"].workspace_bytes == test.workspace_bytes, mode
        allocations = sum(1 for s in train.steps if s.allocates is not None) + \
            sum(1 for b in train.buffers if b.value.op == "input")
        assert usage["train_step"].allocations == allocations, mode
        # the predict step (the forward pass alone) on the trained tensors: its own plan's peak, the same bits
        predicted = model.predict_step(data[0][0])
        predict = compiled.steps["predict"].plan
        assert usage["predict_step"].peak_bytes == planned_peak(predict, mode), mode
        assert usage["predict_step"].workspace_bytes == predict.workspace_bytes, mode
        probabilities.setdefault("static", predicted)
        assert np.array_equal(predicted, probabilities["static"]), mode
        results[mode] = outputs, model.host_tensors()
    (reference, tensors), *others = results.values()
    assert all(np.isfinite(reference[0]))
    recorded = GOLDEN[name]              # what the compiler planned and computed when the record was made
    assert (train.peak_live_bytes, test.peak_live_bytes, train.workspace_bytes) == \
        (recorded["train_peak_bytes"], recorded["test_peak_bytes"], recorded["train_workspace_bytes"])
    same_kernels = GOLDEN["kernels"] == description()
    spread = 0.0
    if not same_kernels:      # the network's own float32 spread at this size: its steps on inputs moved by a rounding
        for factor in NUDGES:
            nudged = [(x * np.float32(factor) if x.dtype == np.float32 else x, y) for x, y in data]
            _, moved = run_steps(model_cls, "static", nudged, kernels="numpy")
            spread = max(spread, *(abs(a - b) / max(abs(b), 1e-30) for a, b in zip((*moved[0], moved[2]),
                                                                                  (*reference[0], reference[2]))))
    check_record(reference, recorded, same_kernels, spread)
    for mode, (outputs, values) in zip(MODES[1:], others):
        threads = f"{mode} on {MODE_THREADS[mode]} threads"
        assert outputs == reference, f"{threads}: {outputs} != {reference} (static, one thread)"
        for key, value in tensors.items():
            assert np.array_equal(values[key], value), f"{threads}: {key} differs from the static mode's on one"


def check_record(outputs, recorded, same_kernels: bool, spread: float = 0.0) -> None:
    """The losses, test accuracy and test loss of `outputs` against a record: bit for bit where the same kernels
    made it, else within RECORD_TOLERANCE or ten times `spread`, the relative change one rounding of the input makes
    (the accuracy within one example)."""
    losses, accuracy, test_loss = outputs
    if same_kernels:
        assert [float(v).hex() for v in losses] == recorded["losses"], (losses, recorded["losses"])
        assert (float(accuracy).hex(), float(test_loss).hex()) == (recorded["test_accuracy"], recorded["test_loss"])
        return
    want = [float.fromhex(v) for v in (*recorded["losses"], recorded["test_loss"])]
    np.testing.assert_allclose([*losses, test_loss], want, rtol=max(RECORD_TOLERANCE, 10 * spread), atol=0)
    assert abs(accuracy - float.fromhex(recorded["test_accuracy"])) <= 1 / BATCH + 1e-9, accuracy


@pytest.mark.parametrize("same_kernels", [True, False])
def test_a_record_holds_bitwise_on_its_kernels_and_within_tolerance_elsewhere(same_kernels):
    """`check_record`: one ulp off fails on the record's kernels and passes elsewhere; a relative error ten times
    the tolerance fails everywhere."""
    recorded = {"losses": [(2.5).hex(), (2.25).hex()], "test_accuracy": (0.5).hex(), "test_loss": (3.0).hex()}
    check_record(([2.5, 2.25], 0.5, 3.0), recorded, same_kernels)
    ulp = float(np.nextafter(np.float32(2.5), np.float32(3)))
    if same_kernels:
        with pytest.raises(AssertionError):
            check_record(([ulp, 2.25], 0.5, 3.0), recorded, same_kernels)
    else:
        check_record(([ulp, 2.25], 1.0, 3.0), recorded, same_kernels)
    with pytest.raises(AssertionError):
        check_record(([2.5 * (1 + 10 * RECORD_TOLERANCE), 2.25], 0.5, 3.0), recorded, same_kernels)


def test_report_fields_name_the_planned_and_measured_figures(tmp_path_factory):
    compiled, model_cls = program("lenet", None, tmp_path_factory)
    model, _ = run_steps(model_cls, "pooled", batches(model_cls, 2), check=False)
    report = model.memory_report()
    train, test = compiled.steps["train"].plan, compiled.steps["test"].plan
    assert report["memory_mode"] == "pooled"
    assert report["peak_bytes_measured"] == report["peak_bytes_planned"] == planned_peak(train, "pooled")
    assert report["test_peak_bytes_measured"] == report["test_peak_bytes_planned"] == planned_peak(test, "pooled")
    assert report["workspace_bytes_measured"] == report["workspace_bytes_planned"] == train.workspace_bytes
    assert report["arena_bytes"] == max(train.arena_bytes, test.arena_bytes)
    # the pool's chunk: the capacity the compiler's replay of each step on the same first-fit allocator needed
    footprint = max(simulate_pool(train)["footprint_bytes"], simulate_pool(test)["footprint_bytes"])
    assert report["pool_bytes"] == report["reserved_bytes"] == model.mem.pool.capacity == footprint
    assert model_cls("cpu", 0, "static").memory_report()["peak_bytes_measured"] is None      # nothing ran yet


def test_dynamic_mode_releases_what_the_plan_frees(tmp_path, monkeypatch):
    """tracemalloc sees numpy's own allocations: during a dynamic step they stay within the planned live bytes at
    each statement plus its workspace (and the kernels' small numpy temporaries, measured in the static mode,
    which allocates no tensor during a step), and above the planned peak. LeNet at batch 64 with a small workspace,
    so that keeping every buffer (11.8 MB) would break the bound (about 6 MB). Large buffers come from numpy here
    instead of memory mappings of their own, which tracemalloc does not see; both go when their last array goes."""
    monkeypatch.setattr(memory, "MAPPED_BYTES", 1 << 62)
    compiled, path = compile_program("lenet", tmp_path, batch=64, options=CompileOptions(workspace_limit=1_000_000))
    model_cls = model_class(import_program(path))
    plan = model_cls.memory_plans["train_step"]
    data = batches(model_cls, 2)
    traced = {}
    for mode in ("static", "dynamic"):
        model = model_cls("cpu", 0, mode)
        model.initialize(0)
        hyper = model.hyper(0.01, 0.9, 0.001, 0)
        model.prepare(hyper)
        model.train_step(*data[0], step=0, **hyper)
        tracemalloc.start()
        try:
            model.train_step(*data[1], step=1, **hyper)
            traced[mode] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    full = plan_memory(compiled.train, 1_000_000)
    assert full.peak_live_bytes == plan.peak_bytes
    bound = 0
    for step in full.steps:                 # per statement: live buffers with alignment slack, and the workspace
        count = sum(1 for b in full.buffers if b.begin <= step.index < b.end)
        bound = max(bound, step.live_bytes + count * 2 * 256 + step.workspace + 256)
    assert full.peak_live_bytes_exact <= traced["dynamic"] <= bound + traced["static"], (traced, bound)
    assert bound + traced["static"] < sum(b.nbytes for b in full.buffers), "the test would not see a missing free"


def corrupted(model_cls, step, change):
    """A subclass of the generated model whose plan of `step` has buffer rows changed by `change(rows)`."""
    plans = dict(model_cls.memory_plans)
    rows = list(plans[step].buffers)
    change(rows)
    plans[step] = dataclasses.replace(plans[step], buffers=tuple(rows))
    return type("Corrupted", (model_cls,), {"memory_plans": plans})


def test_a_corrupted_static_plan_fails_loudly(tmp_path_factory):
    compiled, model_cls = program("lenet", None, tmp_path_factory)
    plan = compiled.steps["train"].plan
    # two buffers live at the same time: X1 (conv1's output) and X2 (its pooling), put at the same offset
    x1, x2 = (next(b for b in plan.buffers if b.value is s.instr.node) for s in plan.steps[:2])
    assert x1.begin < x2.end and x2.begin < x1.end
    data = batches(model_cls, 2)

    def overlap(rows):
        rows[x2.index] = (rows[x1.index][0], rows[x2.index][1])

    bad = corrupted(model_cls, "train_step", overlap)
    with pytest.raises(MemoryPlanError, match=f"buffer {x2.index} at .* overlaps live buffer"):
        run_steps(bad, "static", data)

    def smaller(rows):
        rows[x1.index] = (rows[x1.index][0], rows[x1.index][1] - 4)

    with pytest.raises(MemoryPlanError, match=f"buffer {x1.index} is planned for"):
        run_steps(corrupted(model_cls, "train_step", smaller), "static", data)

    def outside(rows):
        rows[x1.index] = (plan.arena_bytes, rows[x1.index][1])

    with pytest.raises(MemoryPlanError, match="not an aligned range"):
        run_steps(corrupted(model_cls, "train_step", outside), "static", data)

    mem = model_cls("cpu", 0, "dynamic", True).mem.begin("train_step")
    with pytest.raises(MemoryPlanError, match="not live"):
        mem.free(x1.index)


def test_a_step_that_raised_leaves_the_pool_whole(tmp_path_factory):
    """A step that stops half way (an error in a kernel, an interrupt) never calls `end`: the next step starts
    from an empty pool all the same, and measures its own peak."""
    compiled, model_cls = program("lenet", None, tmp_path_factory)
    model = model_cls("cpu", 0, "pooled", True)
    mem = model.mem.begin("train_step")
    mem.load(0, np.zeros(model_cls.batch_shape, np.float32))
    buffer = next(b for b in compiled.steps["train"].plan.buffers if b.value.op != "input")
    mem.tensor(buffer.index, buffer.value.shape, {"float": "float32", "uint8": "uint8"}[buffer.value.dtype])
    data = batches(model_cls, 1)
    model.initialize(0)
    model.prepare(model.hyper(0.01, 0.9, 0.001, 0))
    model.test_step(*data[0])
    assert model.mem.pool.allocator.stats.bytes_in_use == 0
    assert model.mem.usage["test_step"].peak_bytes == planned_peak(compiled.steps["test"].plan, "pooled")


# ---------------------------------------------------------------------------------------------------------------
# workspace: each kernel uses what its op rule plans, exactly

class Recording(np.ndarray):
    """A float32 workspace that remembers the highest element any slice of it reached."""

    reached = 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, _ = index.indices(self.size)
            if stop > start:
                self.reached = max(self.reached, stop)
        return np.asarray(super().__getitem__(index))


def random_input(node, rng, consumer):
    if node.dtype == INT32:
        return rng.integers(0, consumer.inputs[0].shape[-1], node.shape).astype(np.int32)
    if node.dtype == UINT8:
        kernel = consumer.attr("kernel", 1)
        return rng.integers(0, kernel * kernel, node.shape).astype(np.uint8)
    return rng.standard_normal(node.shape).astype(np.float32)


WORKSPACE_CASES = [("alexnet", (55, 55), None), ("googlenet", (79, 79), None), ("resnet_mini", None, None),
                   ("inception_mini", None, None), ("lenet", None, 60_000),      # the limit chunks LeNet's convolutions
                   ("alexnet", (55, 55), 100_000)]           # and AlexNet's LRN, pooling and dropout at test size


@pytest.mark.parametrize("name,image,limit", WORKSPACE_CASES,
                         ids=[c[0] + ("-limited" if c[2] else "") for c in WORKSPACE_CASES])
def test_kernels_use_exactly_their_planned_workspace(name, image, limit, tmp_path_factory):
    """Every statement with scratch space, run by the CPU kernel with a NaN-filled workspace of exactly the planned
    size: the result equals the op's reference semantics (no NaN leaks in) and the kernel stays inside it. Kernels
    other than convolutions use all of it (the plan is not larger than needed: one element less is too little);
    convolutions run over the batch in as many samples at a time as their workspace holds, or fewer."""
    from deepdsl.ops import EvalContext

    compiled, _ = program(name, image, tmp_path_factory)
    rng = np.random.default_rng(2)
    seen = set()
    chunked = 0
    for which in ("train", "test"):
        plan = plan_memory(getattr(compiled, which), limit) if limit else compiled.steps[which].plan
        for step in plan.steps:
            node = step.instr.node if isinstance(step.instr, Let) else None
            key = node and (node.op, node.shape, tuple(x.shape for x in node.inputs), node.attrs)
            if node is None or not step.workspace or key in seen:
                continue
            if step.allocates is not None and plan.buffers[step.allocates].takes_over is not None:
                continue        # adds one staged sample for running over its input (tests/test_runtime_cpu.py)
            if node.op == "matmul":
                continue        # the compiled products' depth cut alone uses it (tests/test_native_products.py)
            seen.add(key)
            chunked += step.chunks > 1
            assert step.workspace == get_op(node.op).workspace(node, limit).nbytes
            arrays = [random_input(x, rng, node) for x in node.inputs]
            kwargs = dict(node.kwargs)
            if node.op == "bernoulli":
                kwargs.update(seed=3, step=1)
            out = np.full(node.shape, np.nan, dtype=np.float32) if node.dtype == FLOAT else \
                np.zeros(node.shape, dtype=np.uint8)
            workspace = np.full(step.workspace // 4, np.nan, dtype=np.float32).view(Recording)
            run = runtime_function(node.op)
            run(*arrays, out=out, workspace=workspace, **kwargs)
            assert 0 < workspace.reached <= workspace.size, (node.op, workspace.reached, workspace.size)
            expected = get_op(node.op).evaluate(EvalContext(np.float32, seed=3, step=1), *arrays, **node.kwargs)
            np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(expected).max())))
            if not node.op.startswith("conv2d"):
                assert workspace.reached == workspace.size, (node.op, workspace.reached, workspace.size)
                # the scratch of one chunk's samples, and not one element more: less than a sample's is refused
                batch = (node.shape if node.op != "ew_sum" else np.broadcast_shapes(*(a.shape for a in arrays)))[0]
                per_sample = workspace.size // -(-batch // step.chunks)
                with pytest.raises(ValueError, match="holds no sample"):
                    run(*arrays, out=out, workspace=np.empty(per_sample - 1, np.float32), **kwargs)
    assert seen and (chunked > 0) == (limit is not None)


# ---------------------------------------------------------------------------------------------------------------
# the command line

def test_memory_mode_option_and_report(tmp_path):
    _, path = compile_program("mlp", tmp_path, batch=4)
    reports = {}
    for mode in MODES:
        report = tmp_path / f"{mode}.json"
        done = run_cli(path, "--iters", "2", "--test-iters", "1", "--data", "synthetic", "--fresh", "--quiet",
                       "--params", str(tmp_path / f"{mode}.npz"), "--memory-mode", mode, "--check-memory",
                       "--report-json", str(report))
        assert done.returncode == 0, done.stderr
        reports[mode] = json.loads(report.read_text())
    for mode, report in reports.items():
        assert report["memory_mode"] == mode
        assert report["peak_bytes_measured"] == report["peak_bytes_planned"] > 0
        assert report["test_peak_bytes_measured"] == report["test_peak_bytes_planned"] > 0
        assert report["loss"] == reports["static"]["loss"] and report["test_loss"] == reports["static"]["test_loss"]
        assert report["max_rss_bytes"] > 0
    assert reports["static"]["reserved_bytes"] == reports["static"]["arena_bytes"]
    assert reports["dynamic"]["reserved_bytes"] == 0
    done = run_cli(path, "--memory-mode", "lazy", "--iters", "1")
    assert done.returncode != 0 and "--memory-mode" in done.stderr
