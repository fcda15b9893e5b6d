"""The CUDA backend on an NVIDIA GPU (marked `gpu`; skipped without pycuda and a GPU).

- Every op, forward and backward, against the CPU backend (tests/support/cuda_cases.py: the cases the host emulator runs
  too), relative error <= 1e-4, and bit for bit where the CPU's order of operations is reproduced (pooling, labels,
  copies, dropout masks).
- One training step and a test step of LeNet and of a branching network (inception_mini, concat) on the GPU equal
  the CPU's, in every memory mode, and the device allocator measures exactly the planned peak.
- LeNet trained on the digits with --device cuda reaches 97 % test accuracy in 200 iterations (on the emulator 95 %
  in 50); the report's measured peaks equal the planned ones.
- Two ranks of a data-parallel --device cuda program train as one process accumulating two batches (bit for bit).
- The fat binary `deepdsl compile` builds is what the program loads.
- benchmarks/cuda_vs_pytorch.py runs (two steps per side), and its worker for our program alone.

`pytest --fake-gpu tests/test_cuda_gpu.py` runs them all on the host emulator of a GPU (tests/support/fake_pycuda.py), in
this process and in the programs and benchmark workers they start: a check of the tests themselves and of every
host-side path they take, not of a GPU (the PyTorch side of the benchmark is skipped there: no CUDA for PyTorch).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import cuda_cases
from tests.support.program_helpers import ROOT, compile_program, import_program, model_class, run_cli
from tests.test_cuda_codegen import _steps, check_steps_equal_the_cpu

pytestmark = pytest.mark.gpu
GPU_TOLERANCE = 1e-4
# LeNet's training on the digits: as tests/test_generated.py, batch 64 and lr 0.02 reach 97.8-98.75 % on the CPU in
# 200 iterations; on the host emulator of a GPU (--fake-gpu: every thread of every block run on the host, its steps
# checked against the CPU's above) a quarter as many, which reach 97 % on the CPU
EMULATED = os.environ.get("DEEPDSL_FAKE_GPU") == "1"
LENET_ITERS, LENET_ACCURACY = (50, 0.95) if EMULATED else (200, 0.97)
# the networks whose steps are compared with the CPU's; on the emulator AlexNet's convolutions are left to
# tests/test_cuda_codegen.py's emulated programs (the same steps, without the pycuda layer: minutes of host threads)
STEP_CASES = [("lenet", 16, None), ("inception_mini", 4, None), ("resnet_mini", 4, None)] + \
    ([] if EMULATED else [("alexnet", 2, (67, 67))])


@pytest.fixture(scope="module")
def rt():
    cuda = importlib.import_module("deepdsl_runtime.cuda")
    try:
        cuda.start()
    except ImportError as err:
        pytest.skip(f"needs pycuda and an NVIDIA GPU ({err})")
    return cuda


@pytest.mark.parametrize("case", cuda_cases.CASES, ids=[c.__name__[5:] for c in cuda_cases.CASES])
def test_ops_on_the_gpu_match_the_cpu_backend(case, rt):
    for label, got, expected, tolerance in case(rt, np.random.default_rng(4)):
        cuda_cases.compare(rt, label, got, expected, 0 if tolerance == 0 else max(tolerance, GPU_TOLERANCE))


@pytest.mark.parametrize("name,batch,image", STEP_CASES)
def test_a_training_step_on_the_gpu_equals_the_cpu_step(name, batch, image, rt, tmp_path):
    from deepdsl_runtime.memory import MODES

    _, path = compile_program(name, tmp_path, batch=batch, image=image)
    cls = model_class(import_program(path))
    rng = np.random.default_rng(2)
    data = [cls.random_batch(rng) for _ in range(2)]
    expected = _steps(cls("cpu", 0, "static"), data)
    for mode in MODES:
        model = cls("cuda", 0, mode, True)
        assert isinstance(model.mem.workspace_region, rt.DeviceArray)
        check_steps_equal_the_cpu(model, data, expected, GPU_TOLERANCE)


@pytest.mark.parametrize("mode, iters", [("static", LENET_ITERS), ("pooled", 5), ("dynamic", 5)])
def test_lenet_learns_the_digits_on_the_gpu(mode, iters, rt, tmp_path):
    """Trained in the static mode to its accuracy; the other modes compute the same steps (checked against the CPU
    above), so a few iterations show their program runs end to end and measures its planned peaks."""
    _, program = compile_program("lenet", tmp_path, batch=64)
    report = tmp_path / "report.json"
    done = run_cli(program, "--device", "cuda", "--memory-mode", mode, "--iters", str(iters), "--lr", "0.02",
                   "--params", str(tmp_path / "p.npz"), "--report-json", str(report), "--test-iters", "5", "--quiet",
                   timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(report.read_text())
    assert result["device"] == "cuda" and result["iterations"] == iters
    if iters == LENET_ITERS:
        assert result["test_accuracy"] >= LENET_ACCURACY, result
    assert result["peak_bytes_measured"] == result["peak_bytes_planned"], result
    assert result["test_peak_bytes_measured"] == result["test_peak_bytes_planned"], result


def test_data_parallel_ranks_on_the_gpu_train_as_one_process_accumulating(rt, tmp_path):
    """Two ranks of a --device cuda program (accumulators staged through the host) give LeNet the parameters one
    process accumulating two batches on the device gives, bit for bit; resnet_mini's batch-norm sums over the ranks
    (`all_sum` of device arrays) run too; every rank measures its planned peak. Needs mpi4py and its mpiexec (the
    test extra)."""
    import shutil
    from pathlib import Path

    import deepdsl
    from deepdsl.codegen import program_env

    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    common = ["--device", "cuda", "--iters", "2", "--test-iters", "1", "--quiet"]
    for name, batch in (("lenet", 8), ("resnet_mini", 2)):
        _, program = compile_program(name, tmp_path / name, batch=batch,
                                     options=deepdsl.CompileOptions(data_parallel=True))
        report = tmp_path / f"{name}.json"
        ranks = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(program), "--data-parallel",
                                *common, "--params", str(tmp_path / f"{name}-ranks.npz"), "--report-json",
                                str(report)], capture_output=True, text=True, timeout=600, env=program_env())
        assert ranks.returncode == 0, ranks.stderr
        figures = json.loads(report.read_text())
        assert figures["device"] == "cuda" and figures["ranks"] == 2
        assert figures["peak_bytes_measured_by_rank"] == [figures["peak_bytes_planned"]] * 2, figures
        if name == "lenet":
            one = run_cli(program, *common, "--accumulate", "2", "--params", str(tmp_path / "lenet-one.npz"),
                          timeout=600)
            assert one.returncode == 0, one.stderr
            with np.load(tmp_path / "lenet-ranks.npz") as got, np.load(tmp_path / "lenet-one.npz") as want:
                for key in want.files:
                    if not key.startswith("__"):
                        assert np.array_equal(got[key], want[key]), key


def test_the_program_loads_the_fat_binary_deepdsl_compile_built(rt, tmp_path):
    from deepdsl.codegen.cuda import build_fatbin, find_nvcc

    if find_nvcc() is None:
        pytest.skip("needs nvcc")
    _, program = compile_program("mlp", tmp_path, batch=8)
    fatbin = build_fatbin(program.with_suffix(".cu"))
    assert fatbin is not None
    module = import_program(program)
    loaded = []
    original = rt._device._drv.module_from_buffer
    try:
        rt._device._drv.module_from_buffer = lambda data: loaded.append(len(data)) or original(data)
        model = model_class(module)("cuda", 0)
    finally:
        rt._device._drv.module_from_buffer = original
    assert loaded == [fatbin.stat().st_size]
    model.initialize(0)
    model.prepare(model.hyper(0.1, 0.9, 0.0, 0))
    x = np.random.default_rng(0).standard_normal(model.batch_shape).astype(np.float32)
    y = np.zeros(model.batch_shape[0], np.int32)
    assert math.isfinite(model.train_step(x, y, step=0, **model.hyper(0.1, 0.9, 0.0, 0)))


def test_the_benchmark_runs(rt, tmp_path):
    pytest.importorskip("torch")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_vs_pytorch.py"), "--networks", "lenet",
                           "--warmup", "1", "--steps", "2", "--kernels", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())
    assert row["ours"]["tensor_peak_bytes"] == row["ours"]["tensor_peak_planned"]
    assert row["ours"]["finite"] and row["pytorch"]["ms_per_step"] > 0
    for side in (row["ours"], row["pytorch"]):  # the profile saw each side's kernels, pycuda's as well as PyTorch's
        assert 0 < side["gpu_busy_ms"] and len(side["kernels"]) == 3, side


def test_the_benchmark_measures_our_program(rt, tmp_path):
    """The benchmark's worker for our side alone (LeNet, batch 500, one warm-up and one timed step; on the host
    emulator batch 64, `--batch`, without the fat binary, whose loading the test above checks): it reports the
    measured tensor peak equal to the planned one and a finite loss."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cuda_vs_pytorch as bench

    batch = ["--batch", "64"] if EMULATED else []
    saved = dict(bench.CONFIG)
    try:
        bench.with_batch(64 if EMULATED else None)
        program = bench.prepare_ours("lenet", tmp_path, fatbin=not EMULATED)
    finally:
        bench.CONFIG.update(saved)
    row = bench._run_worker(["--worker", "ours", "--network", "lenet", "--program", str(program), "--warmup", "1",
                             "--steps", "1", "--memory-mode", "static", *batch])
    assert row["side"] == "ours" and row["finite"] and row["ms_per_step"] > 0
    assert row["tensor_peak_bytes"] == row["tensor_peak_planned"] > 0
    assert row["workspace_bytes"] > 0 and row["persistent_bytes"] > 0
