"""Step replay (`deepdsl_runtime.replay`): replayed training steps compute the bits of the step's Python, whatever
the learning rate, Adam's corrections and dropout's counters do from step to step; the check finds ops that do
numpy's work beside their kernels' calls, and refuses a record that reads values or temporaries it cannot hold."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from deepdsl.codegen.native import build_library
from deepdsl_runtime import replay
from deepdsl_runtime.cpu import native
from tests.support.program_helpers import compile_program, import_program, model_class, run_cli

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler")
_programs: dict = {}


def _cls(name: str, batch: int, tmp_path_factory):
    """The model class of network `name` compiled at `batch`, its library built."""
    if (name, batch) not in _programs:
        _, path = compile_program(name, tmp_path_factory.mktemp(f"replay-{name}"), batch=batch)
        built, why = build_library(path.with_suffix(".c"))
        assert built is not None, why
        _programs[name, batch] = model_class(import_program(path)), path
    return _programs[name, batch][0]


def _both(cls, steps: int = 7, threads: int = 1):
    """Two models trained alike for `steps` steps (the learning rate changing from step to step), one by its
    Python, one through `TrainSteps`: (the replayed one's TrainSteps, whether every loss and tensor was the same)."""
    plain, replayed = (cls("cpu", 0, "static", kernels="compiled", threads=threads) for _ in range(2))
    for model in (plain, replayed):
        model.initialize(0)
        model.prepare(model.hyper(0.01, 0.9, 0.0005, 0))
    trainer = replay.TrainSteps(replayed)
    rng, same = np.random.default_rng(3), True
    for i in range(steps):
        x, y = plain.random_batch(rng)
        hyper = plain.hyper(0.01 * (1 + i % 3), 0.9, 0.0005, i)
        expected = plain.train_step(x, y, step=i, **hyper)
        got = trainer(x, y, step=i, **hyper)
        same = same and got == expected and all(
            np.array_equal(value, replayed.tensors[key]) for key, value in plain.tensors.items()
            if isinstance(value, np.ndarray))
    return trainer, same


@needs_cc
@pytest.mark.parametrize("name,batch", [("vit", 2), ("char_lm", 2), ("lenet", 4), ("se_resnet", 2)])
def test_replayed_steps_compute_the_bits_of_python_steps(name, batch, tmp_path_factory):
    """A ViT (Adam: its bias corrections change at every step), a character model (dropout's counters from the
    step number, causal attention), LeNet (SGD with momentum) and an SE-ResNet (batch norm, squeeze and excitation)
    are replayed after their first steps, step by step the losses and every tensor equal to the Python steps'."""
    trainer, same = _both(_cls(name, batch, tmp_path_factory))
    assert trainer.replayed, trainer.why
    assert same
    assert trainer.figures()["replayed"] and trainer.summary().startswith("on: ")


@needs_cc
def test_an_op_with_numpy_work_beside_its_calls_is_replayed_by_its_python(tmp_path_factory, monkeypatch):
    """Fully connected layers whose bias is added by numpy after the library's product (the bias kept out of the
    product): the check finds the products that differ after the replay, replays them by their Python, and the
    steps are still the Python steps' bits."""
    monkeypatch.setattr(native.Native, "gemm_bias", lambda self, a, b, out, bias: False)
    trainer, same = _both(_cls("vit", 2, tmp_path_factory))
    assert trainer.replayed, trainer.why
    assert "matmul" in trainer.python_ops
    assert same


@needs_cc
def test_a_scalar_read_from_memory_is_read_again_at_every_replay(tmp_path_factory, monkeypatch):
    """The ViT's loss is computed from a size-1 array its kernel takes as a scalar: the record reads it again at
    every replay. A record that did not would replay the first batch's value: the check on another batch finds
    the op that differs and replays it by its Python; the steps keep the Python steps' bits either way."""
    trainer, same = _both(_cls("vit", 2, tmp_path_factory), steps=5)
    assert trainer.replayed and same and trainer.python_ops == []
    assert any(call[3] for op in trainer.replay.ops() if not op.python for call in op.calls)
    monkeypatch.setattr(replay._Record, "element",
                        lambda self, a, into, index: replay._plain_element(a, into, index))
    trainer, same = _both(_cls("vit", 2, tmp_path_factory), steps=5)
    assert trainer.replayed and trainer.python_ops == ["ew"]
    assert same


@needs_cc
def test_an_op_that_gives_a_kernel_a_temporary_is_replayed_by_its_python(tmp_path_factory, monkeypatch):
    """Layer norms whose input the runtime copies into a temporary before the kernel reads it: the temporary is
    gone at the next step, so the layer norms are replayed by their Python, the other ops by their calls; the
    steps keep the Python steps' bits."""
    layer_norm = native.Native.layer_norm
    monkeypatch.setattr(native.Native, "layer_norm", lambda self, x, affine, out, eps, axes:
                        layer_norm(self, x.copy(), affine, out, eps, axes))
    trainer, same = _both(_cls("vit", 2, tmp_path_factory), steps=5)
    assert trainer.replayed, trainer.why
    ops = trainer.replay.ops()
    assert all(op.python for op in ops if op.name == "layer_norm")
    assert sum(not op.python for op in ops) > len(ops) // 2
    assert same


@needs_cc
def test_a_record_that_fails_leaves_the_steps_to_python(tmp_path_factory, monkeypatch):
    """An error inside the record's check (not the step's): the run goes on, every step by its Python, the same
    bits, and says why."""
    def failing(*args, **kwargs):
        raise RuntimeError("a check that breaks")

    monkeypatch.setattr(replay, "_check", failing)
    trainer, same = _both(_cls("lenet", 4, tmp_path_factory), steps=5)
    assert not trainer.replayed and trainer.why == "the record failed (RuntimeError: a check that breaks)"
    assert same


@needs_cc
def test_replaced_tensors_are_recorded_again(tmp_path_factory):
    """Tensors replaced in the middle of a run (a checkpoint's loaded as new arrays): the next step is recorded
    again, against the new arrays, and keeps the bits of the Python steps."""
    cls = _cls("vit", 2, tmp_path_factory)
    plain, replayed = (cls("cpu", 0, "static", kernels="compiled", threads=1) for _ in range(2))
    for model in (plain, replayed):
        model.initialize(0)
        model.prepare(model.hyper(0.01, 0.9, 0.0005, 0))
    trainer, rng = replay.TrainSteps(replayed), np.random.default_rng(5)
    for i in range(8):
        if i == 5:
            for model in (plain, replayed):
                model.load_tensors(model.host_tensors())
        x, y = plain.random_batch(rng)
        hyper = plain.hyper(0.01, 0.9, 0.0005, i)
        assert trainer(x, y, step=i, **hyper) == plain.train_step(x, y, step=i, **hyper), i
        assert trainer.replayed == (i >= 2), (i, trainer.why)
    assert trainer.records == 2
    assert all(np.array_equal(v, replayed.tensors[k]) for k, v in plain.tensors.items() if isinstance(v, np.ndarray))


@needs_cc
def test_a_run_replays_its_steps_and_says_so(tmp_path_factory):
    """A program's run of 110 iterations replays its steps and ends with the loss of the same run by its Python
    (--no-replay): the report says which; a short run is not recorded."""
    _cls("mlp", 8, tmp_path_factory)
    path = _programs["mlp", 8][1]
    reports = {}
    for flag in ("", "--no-replay"):
        report = path.parent / f"report{flag}.json"
        done = run_cli(path, "--iters", "110", "--test-iters", "0", "--data", "synthetic", "--fresh", "--threads",
                       "1", "--report-json", str(report), *filter(None, [flag]), cwd=path.parent)
        assert done.returncode == 0, done.stderr[-2000:]
        reports[flag] = json.loads(report.read_text())
        assert ("step replay: on: " if not flag else "step replay: off: --no-replay") in done.stdout
    assert reports[""]["step_replay"]["replayed"] is True
    assert reports["--no-replay"]["step_replay"] == {"replayed": False, "why_not": "--no-replay", "python_ops": []}
    assert reports[""]["loss"] == reports["--no-replay"]["loss"]
    short = run_cli(path, "--iters", "5", "--test-iters", "0", "--data", "synthetic", "--fresh", cwd=path.parent)
    assert short.returncode == 0 and "step replay: off: a run of 5 steps (fewer than 100)" in short.stdout


@needs_cc
def test_the_replay_benchmark_runs():
    """benchmarks/replay_vs_python.py end to end at a tiny size: a row of positive times, the record's cost, the same
    bits on both sides, and the replay's summary."""
    import subprocess
    import sys

    from tests.support.program_helpers import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replay_vs_python.py"), "mlp:8", "--threads", "1",
                           "--rounds", "2", "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["mlp:8"]]
    assert len(rows) == 1 and rows[0][1] == "1" and rows[0][-1] == "yes", done.stdout
    assert all(float(v) > 0 for v in rows[0][2:6]), done.stdout
    assert "mlp:8, 1 thread(s): step replay on: " in done.stdout, done.stdout


@needs_cc
def test_the_thread_scaling_benchmark_runs():
    """benchmarks/thread_scaling.py end to end at a tiny size: both models' times, their speed-up, the ceiling's
    three speed-ups (benchmarks/two_threads_ceiling.c built and run) and the step's share of the largest, and both
    models replayed without recording again."""
    import re
    import subprocess
    import sys

    from tests.support.program_helpers import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "thread_scaling.py"), "mlp:8", "--rounds", "1",
                           "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    row = re.search(r"^ +mlp:8 +([\d.]+) +([\d.]+) +([\d.]+)x +([\d.]+)x / ([\d.]+)x / ([\d.]+)x +(\d+)%$",
                    done.stdout, re.M)
    assert row is not None, done.stdout
    one, two, speed_up, *limits, share = map(float, row.groups())
    assert one > 0 and two > 0 and all(limit > 0 for limit in limits), done.stdout
    # (one round: the speed-up is its own ratio, each time printed to two decimals)
    assert (one - 0.005) / (two + 0.005) - 0.005 <= speed_up <= (one + 0.005) / (two - 0.005) + 0.005, done.stdout
    assert abs(share - 100 * speed_up / max(limits)) <= 1 + speed_up / max(limits), done.stdout
    assert re.search(r"step replay at 1 / 2 threads: on: .* / on: ", done.stdout), done.stdout
