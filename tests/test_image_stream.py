"""Training from images read from files (`folder:`, `shards:`) through the real CLI of generated programs: the
accuracy of the in-memory digits, the same bits whatever the workers, the prefetch depth or the ranks, a resume
after SIGKILL bit for bit, bad records stopping the run with one line (or replaced with --skip-bad), a changed
data set refused on resume, no worker left behind."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("simplejpeg")
pytest.importorskip("PIL")

import deepdsl  # noqa: E402
from deepdsl.codegen import program_env  # noqa: E402
from tests.support import image_data  # noqa: E402
from tests.support.program_helpers import compile_program, run_cli  # noqa: E402

TIMEOUT = 180
AUGMENT = "random-resized-crop:0.3,1,flip,normalize:0.5/0.25"


def tensors(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files if not k.startswith("__")}


def assert_bitwise(got: Path, want: Path) -> None:
    a, b = tensors(got), tensors(want)
    assert a.keys() == b.keys()
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"{got.name} and {want.name} differ in {differ}"


@pytest.fixture(scope="module")
def lenet(tmp_path_factory):
    """LeNet for batches of 8, compiled with the accumulate and apply steps."""
    _, path = compile_program("lenet", tmp_path_factory.mktemp("lenet"), batch=8,
                              options=deepdsl.CompileOptions(data_parallel=True))
    return path


@pytest.fixture(scope="module")
def few_digits(tmp_path_factory):
    """100 training and 30 test digits as PNG class folders (an epoch is 12.5 batches of 8: batches cross epochs),
    and the same as tar shards."""
    root = tmp_path_factory.mktemp("few")
    folder = image_data.write_digits_folder(root / "folder", fmt="png", train=100, val=30)
    shards = image_data.pack_shards(folder, root / "shards", shard_bytes=8 << 10)
    return {"folder": f"folder:{folder}", "shards": f"shards:{shards}"}


def train(program: Path, out: Path, data: str, *args: str, iters: int = 15) -> subprocess.CompletedProcess:
    done = run_cli(program, "--data", data, "--iters", str(iters), "--params", str(out), "--test-iters", "2",
                   "--augment", AUGMENT, "--seed", "3", *args, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("kind", ["folder", "shards"])
def test_the_workers_and_the_prefetch_depth_change_no_bit(lenet, few_digits, tmp_path, kind):
    """Decoded between steps, by one worker and by three with a deeper prefetch: the same parameters, bit for bit."""
    runs = {}
    for name, extra in (("inline", ("--workers", "0")), ("one", ("--workers", "1", "--prefetch", "1")),
                        ("three", ("--workers", "3", "--prefetch", "4"))):
        runs[name] = tmp_path / f"{name}.npz"
        train(lenet, runs[name], few_digits[kind], *extra)
    assert_bitwise(runs["one"], runs["inline"])
    assert_bitwise(runs["three"], runs["inline"])


def test_folder_and_shards_of_the_same_images_train_alike(lenet, few_digits, tmp_path):
    a, b = tmp_path / "folder.npz", tmp_path / "shards.npz"
    train(lenet, a, few_digits["folder"], "--workers", "1")
    train(lenet, b, few_digits["shards"], "--workers", "1")
    assert_bitwise(b, a)


def test_sigkill_mid_epoch_resumes_bit_for_bit(lenet, few_digits, tmp_path):
    """Killed outright after a checkpoint in the middle of an epoch, then resumed: the parameters of a run that was
    never interrupted; the decoding workers end with the program."""
    straight = tmp_path / "straight.npz"
    train(lenet, straight, few_digits["folder"], "--workers", "2", iters=20)
    killed = tmp_path / "killed.npz"
    mark = uuid.uuid4().hex
    env = {**program_env(), "DEEPDSL_TEST_MARK": mark}
    process = subprocess.Popen([sys.executable, str(lenet), "--data", few_digits["folder"], "--iters", "1000000",
                                "--params", str(killed), "--save-every", "7", "--augment", AUGMENT, "--seed", "3",
                                "--workers", "2", "--test-iters", "2", "--quiet"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not killed.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert killed.exists(), process.stderr.read().decode()[-2000:] if process.poll() is not None else "no save"
        workers = _marked(mark) - {process.pid}
        assert len(workers) == 2, workers
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    deadline = time.monotonic() + 30
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked(mark), "decoding workers outlived the program"
    with np.load(killed) as archive:
        at = int(archive["__iteration__"])
        assert at % 7 == 0 and 0 < at < 20 and int(archive["__data_offset__"]) != 0     # inside an epoch
    done = train(lenet, killed, few_digits["folder"], "--workers", "3", iters=20)
    assert f"resuming from {killed} at iteration {at}" in done.stdout
    assert_bitwise(killed, straight)


def test_a_decoding_worker_killed_stops_the_run_with_one_line(lenet, few_digits, tmp_path):
    out = tmp_path / "p.npz"
    mark = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, str(lenet), "--data", few_digits["folder"], "--iters", "1000000",
                                "--params", str(out), "--save-every", "5", "--workers", "2", "--test-iters", "0",
                                "--quiet"], env={**program_env(), "DEEPDSL_TEST_MARK": mark},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not out.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        workers = sorted(_marked(mark) - {process.pid})
        assert out.exists() and len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 6, err
    line = _one_line(err)
    assert "decoding worker" in line and "SIGKILL" in line and f"{out} keeps the checkpoint of iteration" in line, line


def _marked(mark: str) -> set[int]:
    """The processes whose environment holds DEEPDSL_TEST_MARK=`mark`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"DEEPDSL_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                status = (entry / "stat").read_text().split()[2]
                if status != "Z":
                    found.add(int(entry.name))
        except OSError:
            continue
    return found


MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install '.[mpi]' brings one)")
@pytest.mark.parametrize("kind", ["folder", "shards"])
def test_two_ranks_equal_one_process_accumulating_two(lenet, few_digits, tmp_path, kind):
    """Each rank decodes only its share of every global batch; together they train as one process accumulating."""
    pytest.importorskip("mpi4py")
    one = tmp_path / "one.npz"
    train(lenet, one, few_digits[kind], "--accumulate", "2", "--kernels", "numpy", "--threads", "1",
          "--workers", "1", iters=8)
    two = tmp_path / "two.npz"
    common = ("--data", few_digits[kind], "--iters", "8", "--params", str(two), "--test-iters", "2", "--augment",
              AUGMENT, "--seed", "3", "--kernels", "numpy", "--threads", "1", "--workers", "1")
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(lenet), "--data-parallel",
                           *common], capture_output=True, text=True, timeout=TIMEOUT, env=program_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert_bitwise(two, one)


def test_lenet_from_a_folder_of_digits_learns_as_from_memory(tmp_path):
    """LeNet trained on the digits written as PNG files reaches the test accuracy of the in-memory digits (within
    1 %), the report states the pipeline's memory, and the progress figures are there."""
    _, program = compile_program("lenet", tmp_path / "program", batch=64)
    folder = image_data.write_digits_folder(tmp_path / "digits", fmt="png")
    results = {}
    for name, data in (("memory", "digits"), ("folder", f"folder:{folder}")):
        report = tmp_path / f"{name}.json"
        done = run_cli(program, "--data", data, "--iters", "300", "--lr", "0.02", "--params",
                       str(tmp_path / f"{name}.npz"), "--report-json", str(report), "--test-iters", "5",
                       timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = json.loads(report.read_text())
    memory, folder_run = results["memory"], results["folder"]
    assert memory["test_accuracy"] > 0.9
    assert abs(folder_run["test_accuracy"] - memory["test_accuracy"]) <= 0.01, (folder_run, memory)
    pipeline = folder_run["input_pipeline"]
    slot = 64 * 1 * 28 * 28 * 4 + 64 * 4
    assert pipeline["ring_bytes"] == pipeline["slots"] * slot and pipeline["slots"] == 3
    assert pipeline["images_per_second"] > 0 and 0 <= pipeline["data_wait_share"] <= 1
    assert memory["input_pipeline"] is None


# ----------------------------------------------------------------------------------------------------------------
# bad data through the CLI

@pytest.fixture
def damaged(tmp_path, few_digits):
    """A copy of the few digits as JPEG files, one of them truncated after the index was built."""
    folder = image_data.write_digits_folder(tmp_path / "jpeg", fmt="jpg", train=40, val=10)
    return folder


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_a_bad_file_stops_the_run_naming_it_and_keeps_the_checkpoint(lenet, damaged, tmp_path):
    out = tmp_path / "p.npz"
    first = run_cli(lenet, "--data", f"folder:{damaged}", "--iters", "3", "--params", str(out), "--test-iters", "0",
                    "--quiet", timeout=TIMEOUT)
    assert first.returncode == 0, first.stderr
    before = out.read_bytes()
    victim = sorted((damaged / "train").rglob("*.jpg"))[7]
    victim.write_bytes(victim.read_bytes()[:-40])
    done = run_cli(lenet, "--data", f"folder:{damaged}", "--iters", "40", "--params", str(out), "--test-iters", "0",
                   "--quiet", timeout=TIMEOUT)
    assert done.returncode == 6, done.stderr
    line = _one_line(done.stderr)
    assert victim.name in line and "sample 7" in line and "epoch" in line and "--skip-bad" in line, line
    assert f"{out} keeps the checkpoint of iteration 3" in line, line
    assert out.read_bytes() == before
    skipped = run_cli(lenet, "--data", f"folder:{damaged}", "--iters", "40", "--params", str(out), "--test-iters",
                      "0", "--quiet", "--skip-bad", timeout=TIMEOUT)
    assert skipped.returncode == 0, skipped.stderr
    assert f"skipped train/{victim.parent.name}/{victim.name} (sample 7" in skipped.stderr, skipped.stderr
    assert "used train/" in skipped.stderr


def test_an_undecodable_file_of_the_manifests_size_stops_the_run(lenet, damaged, tmp_path):
    index_line = run_cli(lenet, "--data", f"folder:{damaged}", "--iters", "1", "--params", str(tmp_path / "a.npz"),
                         "--test-iters", "0", "--quiet", timeout=TIMEOUT)
    assert index_line.returncode == 0, index_line.stderr
    victim = sorted((damaged / "train").rglob("*.jpg"))[2]
    data = bytearray(victim.read_bytes())
    data[2:4] = b"\x00\x00"                     # the marker after the start of image broken; the size unchanged
    victim.write_bytes(bytes(data))
    done = run_cli(lenet, "--data", f"folder:{damaged}", "--iters", "20", "--params", str(tmp_path / "b.npz"),
                   "--test-iters", "0", "--quiet", "--workers", "1", timeout=TIMEOUT)
    assert done.returncode == 6, done.stderr
    line = _one_line(done.stderr)
    assert f"{victim.parent.name}/{victim.name} (sample 2 of the training split, epoch 0)" in line, line
    assert "no checkpoint was written" in line and not (tmp_path / "b.npz").exists()


def test_a_changed_data_set_is_refused_on_resume(lenet, damaged, tmp_path):
    out = tmp_path / "p.npz"
    assert run_cli(lenet, "--data", f"folder:{damaged}", "--iters", "2", "--params", str(out), "--test-iters", "0",
                   "--quiet", timeout=TIMEOUT).returncode == 0
    with np.load(out) as archive:                  # the data set and the decoders the pixels came from
        assert "simplejpeg" in str(archive["__decoder__"]) and len(str(archive["__data_digest__"])) == 32
    extra = damaged / "train" / "3" / "extra.jpg"
    shutil.copy(next((damaged / "train" / "3").glob("*.jpg")), extra)
    done = run_cli(lenet, "--data", f"folder:{damaged}", "--iters", "4", "--params", str(out), "--test-iters", "0",
                   "--quiet", timeout=TIMEOUT)
    assert done.returncode == 1
    assert "__data_digest__" in _one_line(done.stderr)


def test_random_resized_crop_is_for_images_read_from_files(lenet, tmp_path):
    done = run_cli(lenet, "--augment", "random-resized-crop,flip", "--iters", "1", "--params",
                   str(tmp_path / "p.npz"), timeout=TIMEOUT)
    assert done.returncode == 1
    line = _one_line(done.stderr)
    assert "folder:" in line and "crop:P" in line, line


def test_options_of_the_pipeline_are_checked_at_start(lenet, few_digits, tmp_path):
    for option, value, text in (("--workers", "-1", "--workers must be in"), ("--prefetch", "0",
                                                                                "--prefetch must be in")):
        done = run_cli(lenet, "--data", few_digits["folder"], option, value, "--iters", "1", "--params",
                       str(tmp_path / "p.npz"), timeout=TIMEOUT)
        assert done.returncode == 1 and text in _one_line(done.stderr), done.stderr
    assert not (tmp_path / "p.npz").exists()


def test_validation_during_training_changes_no_training_bit(lenet, few_digits, tmp_path):
    """The training stream gives its slots to the validation's test batches and goes on where it was: a run
    validating every 4 iterations trains bit for bit as one that does not, and validates on all 30 test images."""
    train(lenet, tmp_path / "plain.npz", few_digits["folder"], "--workers", "2")
    log = tmp_path / "run.jsonl"
    train(lenet, tmp_path / "validated.npz", few_digits["folder"], "--workers", "2", "--eval-every", "4",
          "--log", str(log), "--top-k", "3")
    assert_bitwise(tmp_path / "validated.npz", tmp_path / "plain.npz")
    validated = [json.loads(line) for line in log.read_text().splitlines() if "val_loss" in line]
    assert [e["iteration"] for e in validated] == [4, 8, 12]
    assert all(e["val_examples"] == 30 and 0 <= e["val_accuracy"] <= e["val_top3"] <= 1 for e in validated)
    assert all(e["data_wait"] is not None for e in validated)
