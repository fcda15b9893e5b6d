"""The training workflow through the real CLI of generated programs and `deepdsl predict`: epochs, validation
during training (equal to a separate test of the checkpoint at that iteration), top-k, the best checkpoint and the
metric log across a kill -9 and a resume, TensorBoard event files read back by TensorBoard's own reader, predict
agreeing with the test step, a language model continuing a prompt deterministically, the predict step's memory."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deepdsl.codegen import program_env
from deepdsl_runtime import checkpoint as ckpt
from tests.support.program_helpers import ROOT, compile_program
from tests.support.program_helpers import run_cli as _run_cli

TIMEOUT = 300
DIGITS_TRAIN, DIGITS_TEST, BATCH = 1497, 300, 50
# what a log entry holds that does not depend on the time it was written at
EXACT = ("iteration", "epoch", "loss", "lr", "peak_bytes", "val_loss", "val_accuracy", "val_top5", "val_examples")


@pytest.fixture(scope="module")
def lenet(tmp_path_factory):
    return compile_program("lenet", tmp_path_factory.mktemp("lenet"), batch=BATCH)[1]


def run_cli(program: Path, *args: str, **options) -> subprocess.CompletedProcess:
    """The program with numpy's kernels (no library built for the tests' programs; predict runs them too)."""
    return _run_cli(program, *args, "--kernels", "numpy", **options)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def log_entries(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def exact(entries: list[dict]) -> list[dict]:
    return [{k: e[k] for k in EXACT if k in e} for e in entries]


def one_line(done: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_epochs_and_validation_equal_a_separate_test_of_the_checkpoint(lenet, tmp_path):
    """--epochs 2 on digits runs ceil(2 x 1497 / 50) iterations; --eval-every epoch validates where each epoch
    ends, on the whole validation split, and its figures equal those of a run stopped there and tested."""
    log = tmp_path / "run.jsonl"
    done = ok(run_cli(lenet, "--epochs", "2", "--eval-every", "epoch", "--log", str(log), "--log-every", "7",
                      "--params", str(tmp_path / "p.npz"), "--test-iters", "0", "--seed", "2", timeout=TIMEOUT))
    iterations = math.ceil(2 * DIGITS_TRAIN / BATCH)
    assert f"iterations 1 to {iterations} (2 epochs)" in done.stdout
    assert ckpt.recorded_iteration(str(tmp_path / "p.npz")) == iterations
    entries = log_entries(log)
    validated = [e for e in entries if "val_loss" in e]
    first_epoch_end = math.ceil(DIGITS_TRAIN / BATCH)
    assert [e["iteration"] for e in validated] == [first_epoch_end, iterations]
    assert [e["iteration"] for e in entries] == sorted({*range(7, iterations + 1, 7), first_epoch_end, iterations})
    assert all(e["val_examples"] == DIGITS_TEST for e in validated)
    assert validated[0]["epoch"] == pytest.approx(first_epoch_end * BATCH / DIGITS_TRAIN)
    assert f"iteration {first_epoch_end} (epoch 1.00): validation loss" in done.stdout
    # the same iterations, then the test step over every test batch
    report = tmp_path / "report.json"
    ok(run_cli(lenet, "--iters", str(first_epoch_end), "--params", str(tmp_path / "q.npz"), "--test-iters", "1000",
               "--seed", "2", "--report-json", str(report), timeout=TIMEOUT))
    tested = json.loads(report.read_text())
    assert tested["test_examples"] == DIGITS_TEST
    assert (tested["test_loss"], tested["test_accuracy"], tested["test_top5"]) == \
        (validated[0]["val_loss"], validated[0]["val_accuracy"], validated[0]["val_top5"])
    assert tested["loss"] == next(e["loss"] for e in entries if e["iteration"] == first_epoch_end)
    assert 0 < validated[0]["val_accuracy"] < validated[0]["val_top5"] <= 1


def test_a_killed_run_resumed_continues_its_log_and_best_checkpoint_exactly(lenet, tmp_path):
    """Killed outright, then resumed: the metric log holds each logged iteration once with the figures of a run
    never interrupted (the entries written after the checkpoint and a last line cut short are dropped), and the
    best checkpoint is the uninterrupted run's, bit for bit, with its metric, value and iteration."""
    options = ["--eval-every", "10", "--eval-batches", "2", "--keep-best", "loss", "--log-every", "3",
               "--save-every", "10", "--test-iters", "0", "--seed", "4", "--lr", "0.05"]
    ok(run_cli(lenet, "--iters", "60", "--params", str(tmp_path / "s.npz"), "--log", str(tmp_path / "s.jsonl"),
               *options, timeout=TIMEOUT))
    params, log = tmp_path / "k.npz", tmp_path / "k.jsonl"
    process = subprocess.Popen([sys.executable, str(lenet), "--iters", "1000000", "--params", str(params),
                                "--log", str(log), *options, "--quiet", "--kernels", "numpy"], env=program_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while (ckpt.recorded_iteration(str(params)) or 0) < 20 and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read()[-2000:]
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    at = ckpt.recorded_iteration(str(params))
    assert 20 <= at < 60
    with log.open("a") as f:                          # as if killed while writing an entry
        f.write('{"iteration": 99999, "loss": 0.')
    done = ok(run_cli(lenet, "--iters", "60", "--params", str(params), "--log", str(log), *options,
                      timeout=TIMEOUT))
    assert f"resuming from {params} at iteration {at}" in done.stdout
    straight, resumed = log_entries(tmp_path / "s.jsonl"), log_entries(log)
    assert [e["iteration"] for e in resumed] == [e["iteration"] for e in straight]
    assert exact(resumed) == exact(straight)
    best, killed_best = (ckpt.read(str(tmp_path / name)) for name in ("s.best.npz", "k.best.npz"))
    for field in ("__best_metric__", "__best_value__", "__best_iteration__"):
        assert killed_best.extra[field] == best.extra[field], field
    assert killed_best.iteration == int(best.extra["__best_iteration__"])
    for name, value in best.tensors.items():
        assert np.array_equal(killed_best.tensors[name], value), name
    val = [e for e in straight if "val_loss" in e]
    lowest = min(val, key=lambda e: e["val_loss"])
    assert float(best.extra["__best_value__"]) == lowest["val_loss"] and best.iteration == lowest["iteration"]
    final = ckpt.read(str(params))
    assert int(final.extra["__best_iteration__"]) == lowest["iteration"]


def test_an_existing_log_of_another_run_is_kept_unless_fresh(lenet, tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text('{"iteration": 5, "loss": 1.0}\n')
    done = run_cli(lenet, "--iters", "2", "--log", str(log), "--params", "", "--test-iters", "0", timeout=TIMEOUT)
    one_line(done, f"--log {log}: holds the log of another run", "--fresh")
    assert log.read_text() == '{"iteration": 5, "loss": 1.0}\n'
    ok(run_cli(lenet, "--iters", "2", "--log", str(log), "--log-every", "1", "--params", "", "--test-iters", "0",
               "--fresh", timeout=TIMEOUT))
    assert [e["iteration"] for e in log_entries(log)] == [1, 2]
    # a file that is no log is never replaced, --fresh or not
    log.write_text('{"iteration": 5}\nnot json\n{"iteration": 6}\n')
    for fresh in ((), ("--fresh",)):
        done = run_cli(lenet, "--iters", "2", "--log", str(log), "--params", "", "--test-iters", "0", *fresh,
                       timeout=TIMEOUT)
        one_line(done, f"--log {log}: line 2 is no entry of a metric log")
    assert log.read_text() == '{"iteration": 5}\nnot json\n{"iteration": 6}\n'


@pytest.mark.parametrize("options,fragments", [
    (("--epochs", "2", "--iters", "5"), ("--epochs 2 and --iters 5 both say how long to train",)),
    (("--eval-every", "0"), ("--eval-every must be a number of iterations >= 1 or 'epoch'",)),
    (("--eval-every", "sometimes"), ("--eval-every must be",)),
    (("--eval-batches", "3"), ("--eval-batches 3", "add --eval-every")),
    (("--top-k", "11"), ("--top-k 11: lenet has 10 classes",)),
    (("--keep-best", "accuracy"), ("--keep-best accuracy", "add --eval-every")),
    (("--keep-best", "top9", "--eval-every", "5"), ("--keep-best top9: not a validation metric", "loss, accuracy, top5")),
    (("--keep-best", "loss", "--eval-every", "5", "--params", ""), ("writes its checkpoint beside --params",)),
    (("--log-every", "0"), ("--log-every must be in [1, 2^63)",)),
    (("--epochs", "0"), ("--epochs must be in [1, 2^63)",)),
], ids=["epochs-and-iters", "eval-zero", "eval-word", "eval-batches-alone", "top-k", "best-without-eval",
        "best-metric", "best-without-params", "log-every", "epochs-zero"])
def test_workflow_options_are_checked_at_start(lenet, tmp_path, options, fragments):
    done = run_cli(lenet, "--params", str(tmp_path / "p.npz"), *options, timeout=TIMEOUT)
    one_line(done, "lenet: error:", *fragments)
    assert not (tmp_path / "p.npz").exists()


def test_outputs_are_checked_before_the_first_iteration(lenet, tmp_path):
    (tmp_path / "file").write_text("x")
    done = run_cli(lenet, "--iters", "3", "--params", str(tmp_path / "p.npz"), "--tensorboard",
                   str(tmp_path / "file"), timeout=TIMEOUT)
    one_line(done, f"--tensorboard {tmp_path / 'file'}: not a directory")
    done = run_cli(lenet, "--iters", "3", "--params", str(tmp_path / "p.npz"), "--log", str(tmp_path),
                   timeout=TIMEOUT)
    one_line(done, f"--log {tmp_path}: is a directory")
    done = run_cli(lenet, "--iters", "3", "--params", str(tmp_path / "p.npz"), "--log", str(tmp_path / "p.npz"),
                   timeout=TIMEOUT)
    one_line(done, "--log", "is --params too")
    assert not (tmp_path / "p.npz").exists()


def test_tensorboard_events_hold_the_logged_figures(lenet, tmp_path):
    pytest.importorskip("tensorboardX")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board, log = tmp_path / "board", tmp_path / "run.jsonl"
    ok(run_cli(lenet, "--iters", "12", "--eval-every", "6", "--log-every", "4", "--log", str(log), "--tensorboard",
               str(board), "--params", "", "--test-iters", "0", timeout=TIMEOUT))
    events = accumulator.EventAccumulator(str(board))
    events.Reload()
    entries = log_entries(log)
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/loss", "val/accuracy", "val/top5"} <= set(tags), tags
    loss = events.Scalars("train/loss")
    assert [s.step for s in loss] == [e["iteration"] for e in entries] == [4, 6, 8, 12]
    assert [s.value for s in loss] == [np.float32(e["loss"]) for e in entries]
    accuracy = events.Scalars("val/accuracy")
    assert [(s.step, s.value) for s in accuracy] == [(e["iteration"], np.float32(e["val_accuracy"]))
                                                    for e in entries if "val_accuracy" in e]


def test_tensorboard_hides_what_a_stopped_run_wrote_after_its_checkpoint(lenet, tmp_path):
    """A run went on past its checkpoint (to 20), then resumed from the checkpoint (10) to 30: TensorBoard shows
    each step once, those after 10 from the resumed run, equal to an uninterrupted run's."""
    pytest.importorskip("tensorboardX")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    common = ("--log-every", "2", "--test-iters", "0", "--quiet")
    params, kept = tmp_path / "p.npz", tmp_path / "p10.npz"
    ok(run_cli(lenet, "--iters", "10", "--params", str(params), "--tensorboard", str(tmp_path / "tb"), *common,
               timeout=TIMEOUT))
    kept.write_bytes(params.read_bytes())
    ok(run_cli(lenet, "--iters", "20", "--params", str(params), "--tensorboard", str(tmp_path / "tb"), *common,
               timeout=TIMEOUT))
    params.write_bytes(kept.read_bytes())
    ok(run_cli(lenet, "--iters", "30", "--params", str(params), "--tensorboard", str(tmp_path / "tb"), *common,
               timeout=TIMEOUT))
    ok(run_cli(lenet, "--iters", "30", "--params", str(tmp_path / "s.npz"), "--tensorboard", str(tmp_path / "s"),
               *common, timeout=TIMEOUT))
    shown = []
    for board in ("tb", "s"):
        events = accumulator.EventAccumulator(str(tmp_path / board))
        events.Reload()
        shown.append([(s.step, s.value) for s in events.Scalars("train/loss")])
    assert [step for step, _ in shown[0]] == list(range(2, 31, 2))
    assert shown[0] == shown[1]


def predict(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`deepdsl predict` with numpy's kernels (no library built for each test's directory)."""
    env = program_env()
    return subprocess.run([sys.executable, "-m", "deepdsl", "predict", "--kernels", "numpy", *args],
                          capture_output=True, text=True, cwd=str(cwd), env=env, timeout=TIMEOUT)


def test_predict_agrees_with_the_test_step_and_its_memory_plan(lenet, tmp_path):
    params, report = tmp_path / "p.npz", tmp_path / "report.json"
    ok(run_cli(lenet, "--iters", "20", "--params", str(params), "--test-iters", "1000", "--report-json",
               str(report), timeout=TIMEOUT))
    done = ok(predict(str(ROOT / "networks" / "lenet.py"), "--batch", "64", "--params", str(params), "--data",
                      "digits", "--json", "--top", "3", cwd=tmp_path))
    result = json.loads(done.stdout)
    tested = json.loads(report.read_text())
    assert result["count"] == DIGITS_TEST and len(result["examples"]) == DIGITS_TEST
    assert result["accuracy"] == tested["test_accuracy"]
    top = [e["top"] for e in result["examples"]]
    assert all(len(t) == 3 and t[0]["probability"] >= t[1]["probability"] >= t[2]["probability"] for t in top)
    assert sum(t[0]["class"] == e["label"] for t, e in zip(top, result["examples"])) / DIGITS_TEST == \
        result["accuracy"]
    assert result["peak_bytes_measured"] == result["peak_bytes_planned"] > 0
    text = ok(predict(str(ROOT / "networks" / "lenet.py"), "--batch", "64", "--params", str(params), "--data",
                      "digits", cwd=tmp_path)).stdout
    assert text.splitlines()[-1] == f"accuracy {tested['test_accuracy']:.4f} over {DIGITS_TEST} examples"
    # the same test split from an .npz: the same probabilities, named by their place in the file
    from deepdsl_runtime import data

    digits = data.load("digits", (1, 28, 28), 10)
    np.savez(tmp_path / "split.npz", x_test=digits.x_test[:, 0], y_test=digits.y_test.astype(np.int64))
    from_file = json.loads(ok(predict(str(ROOT / "networks" / "lenet.py"), "--batch", "64", "--params", str(params),
                                      "--data", f"npz:{tmp_path / 'split.npz'}", "--json", "--top", "3",
                                      cwd=tmp_path)).stdout)
    assert from_file["accuracy"] == result["accuracy"] and from_file["count"] == DIGITS_TEST
    assert [e["top"] for e in from_file["examples"]] == top
    assert from_file["examples"][5]["input"].endswith("split.npz[5]")


def test_predict_of_image_files_equals_predict_of_their_folder(tmp_path):
    pytest.importorskip("PIL")
    from tests.support import image_data

    folder = image_data.write_digits_folder(tmp_path / "digits", fmt="png", train=40, val=12)
    network = ROOT / "networks" / "lenet.py"
    params = tmp_path / "p.npz"
    program = compile_program("lenet", tmp_path / "program", batch=8)[1]
    ok(run_cli(program, "--iters", "3", "--data", f"folder:{folder}", "--params", str(params), "--workers", "0",
               "--augment", "normalize:0.5/0.25", "--test-iters", "0", "--quiet", timeout=TIMEOUT))
    assert ckpt.recorded_text(str(params), "__augment__") == "normalize:0.5/0.25"
    by_folder = json.loads(ok(predict(str(network), "--batch", "8", "--params", str(params), "--data",
                                      f"folder:{folder}", "--json", cwd=tmp_path)).stdout)
    files = [str(folder / e["input"]) for e in by_folder["examples"]]     # named from the data's directory
    by_files = json.loads(ok(predict(str(network), "--batch", "8", "--params", str(params), *files, "--json",
                                     cwd=tmp_path)).stdout)
    assert by_folder["count"] == by_files["count"] == 12 and by_folder["accuracy"] is not None
    for a, b in zip(by_folder["examples"], by_files["examples"]):
        assert a["top"] == b["top"]          # class names too: the checkpoint records the folder's classes
        assert a["top"][0]["name"] == sorted(p.name for p in (folder / "train").iterdir())[a["top"][0]["class"]]


def test_predict_errors_are_one_line(lenet, tmp_path):
    network = str(ROOT / "networks" / "lenet.py")
    done = predict(network, "--params", str(tmp_path / "missing.npz"), "--data", "digits", cwd=tmp_path)
    assert done.returncode == 1 and "missing.npz" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "other.npz").write_bytes(b"")
    np.savez(tmp_path / "other.npz", w=np.zeros(3, np.float32))
    done = predict(network, "--params", str(tmp_path / "other.npz"), "--data", "digits", cwd=tmp_path)
    assert done.returncode == 1 and "no tensor 'cv1_W' of lenet" in done.stderr
    (tmp_path / "bad.png").write_bytes(b"not an image")
    params = tmp_path / "p.npz"
    ok(run_cli(lenet, "--iters", "0", "--params", str(params), timeout=TIMEOUT))
    done = predict(network, "--params", str(params), str(tmp_path / "bad.png"), cwd=tmp_path)
    assert done.returncode == 1 and "bad.png: cannot be decoded" in done.stderr and "Traceback" not in done.stderr
    for arrays, says in (({"x": np.zeros((3, 1, 20, 20), np.float32)}, "of shape 1x20x20, lenet takes 1x28x28"),
                         ({"x": np.zeros((3, 28, 28), np.uint8), "y": np.array([1, 2, 10])}, "the network has 10 cl"),
                         ({"w": np.zeros(3)}, "no array 'x' (or 'x_test')")):
        np.savez(tmp_path / "data.npz", **arrays)
        done = predict(network, "--params", str(params), "--data", f"npz:{tmp_path / 'data.npz'}",
                       cwd=tmp_path)
        assert done.returncode == 1 and "data.npz" in done.stderr and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_a_language_model_continues_a_prompt_deterministically(tmp_path):
    network = ROOT / "networks" / "char_lm.py"
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    params = tmp_path / "lm.npz"
    program = compile_program("char_lm", tmp_path / "program", batch=4)[1]
    ok(run_cli(program, "--iters", "6", "--data", f"text:{text}", "--params", str(params), "--test-iters", "0",
               "--quiet", timeout=TIMEOUT))

    def continued(*extra: str) -> dict:
        return json.loads(ok(predict(str(network), "--batch", "4", "--params", str(params), "--prompt", "the qu",
                                     "--tokens", "12", "--json", *extra, cwd=tmp_path)).stdout)

    first, again, other = continued("--seed", "3"), continued("--seed", "3"), continued("--seed", "4")
    assert first["tokens"] == again["tokens"] and len(first["tokens"]) == 12
    assert first["tokens"] != other["tokens"]
    greedy = continued("--temperature", "0")
    assert greedy["tokens"] == continued("--temperature", "0", "--seed", "9")["tokens"]
    assert first["peak_bytes_measured"] == first["peak_bytes_planned"]
    done = predict(str(network), "--batch", "4", "--params", str(params), "--prompt", "", cwd=tmp_path)
    assert done.returncode == 1 and "--prompt is empty" in done.stderr


def test_plot_through_the_cli_draws_the_logs_of_runs(lenet, tmp_path):
    pytest.importorskip("matplotlib")
    for name, lr in (("a", "0.01"), ("b", "0.02")):
        ok(run_cli(lenet, "--iters", "12", "--eval-every", "6", "--log-every", "3", "--log", str(tmp_path / f"{name}.jsonl"),
                   "--params", "", "--test-iters", "0", "--lr", lr, timeout=TIMEOUT))
    done = subprocess.run([sys.executable, "-m", "deepdsl", "plot", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                           "-o", str(tmp_path / "curves.png")], capture_output=True, text=True, env=program_env(),
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "2 runs" in done.stdout
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = subprocess.run([sys.executable, "-m", "deepdsl", "plot", str(tmp_path / "missing.jsonl")],
                          capture_output=True, text=True, env=program_env(), timeout=TIMEOUT)
    assert done.returncode == 1 and "missing.jsonl" in done.stderr and "Traceback" not in done.stderr
