"""Faults a careless user or a hostile machine causes to a generated training program, through its real CLI.

Each case runs the program as users do (a separate process) and checks what the user sees: the exit status, one
line on standard error naming the file, option or field, no traceback, and that nothing is lost (the previous
checkpoint byte-identical, no temporary files left). The stress test kills a program that saves every iteration
at random moments and checks that every checkpoint it leaves is a state of an uninterrupted run, bit for bit.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.support.program_helpers import compile_program, popen_cli, program_env, run_cli

ckpt = pytest.importorskip("deepdsl_runtime.checkpoint")


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def error_line(done: subprocess.CompletedProcess, status: int = 1) -> str:
    """The one line a failed run printed (asserting the status, that it is the only line and no traceback)."""
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def temporaries(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    _, program = compile_program("mlp", tmp_path_factory.mktemp("mlp"), batch=8)
    return program


@pytest.fixture
def trained(mlp, tmp_path):
    """A checkpoint of 2 iterations on the synthetic data, and its digest."""
    path = tmp_path / "p.npz"
    done = run_cli(mlp, "--iters", "2", "--params", str(path), "--data", "synthetic", "--test-iters", "0", "--quiet")
    assert done.returncode == 0, done.stderr
    return path, digest(path)


def train(mlp, *args, params=None, iters="3"):
    """A short quiet run on the synthetic data."""
    extra = ("--params", str(params)) if params is not None else ()
    return run_cli(mlp, "--iters", iters, "--data", "synthetic", "--test-iters", "0", "--quiet", *extra, *args)


# ----------------------------------------------------------------------------------------------------------------
# outputs are checked before the first iteration

@pytest.mark.parametrize("case", ["missing directory", "directory", "report in a missing directory",
                                  "report is a directory", "report is the checkpoint", "params is the program"])
def test_unusable_output_paths_fail_before_training(mlp, tmp_path, case):
    params, report = tmp_path / "p.npz", None
    if case == "missing directory":
        params = tmp_path / "no" / "such" / "p.npz"
    elif case == "directory":
        params = tmp_path / "adir"
        params.mkdir()
    elif case == "report in a missing directory":
        report = tmp_path / "missing" / "r.json"
    elif case == "report is a directory":
        report = tmp_path
    elif case == "report is the checkpoint":
        report = params
    else:
        params = mlp
    before = digest(mlp)
    extra = ("--report-json", str(report)) if report is not None else ()
    done = run_cli(mlp, "--iters", "200000", "--data", "synthetic", "--params", str(params), "--fresh", *extra)
    line = error_line(done)
    assert str(report if report is not None and case != "report is the checkpoint" else params) in line, line
    assert "training" not in done.stdout                   # refused before the loop, not after it
    assert digest(mlp) == before
    assert not (tmp_path / "p.npz").exists() or case == "report is the checkpoint"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_fails_before_training(mlp, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        line = error_line(train(mlp, params=locked / "p.npz", iters="200000"))
    finally:
        locked.chmod(0o755)
    assert "cannot write" in line and str(locked / "p.npz") in line


def test_read_only_checkpoint_is_refused(mlp, trained):
    path, before = trained
    path.chmod(0o444)
    line = error_line(train(mlp, params=path, iters="5"))
    assert "read-only" in line and str(path) in line
    assert digest(path) == before
    line = error_line(train(mlp, "--fresh", params=path, iters="5"))
    assert "read-only" in line and digest(path) == before


def test_no_room_for_the_checkpoint_fails_before_training(tmp_path, monkeypatch):
    """The free-space check (a full disk cannot be made on purpose here: the file system's answer is replaced)."""
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(10**9, 10**9 - 5000, 5000))
    with pytest.raises(ckpt.CheckpointError, match=r"--params .*p.npz: 0.0 MB free in .*needs 1.0 MB"):
        ckpt.check_target(str(tmp_path / "p.npz"), "--params", 10**6)
    ckpt.check_target(str(tmp_path / "p.npz"), "--params", 4000)
    assert os.listdir(tmp_path) == []                      # the write probe leaves nothing


def _file_size_limit(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_save_that_fails_mid_run_keeps_the_previous_checkpoint(mlp, trained):
    """Writes beyond a file-size limit fail as on a full disk (EFBIG instead of ENOSPC, from the same write)."""
    path, before = trained
    env = program_env()
    env["OMP_NUM_THREADS"] = "2"
    done = subprocess.run([sys.executable, str(mlp), "--iters", "8", "--save-every", "1", "--params", str(path),
                           "--data", "synthetic", "--test-iters", "0", "--quiet"], capture_output=True, text=True,
                          env=env, timeout=300, preexec_fn=_file_size_limit(os.path.getsize(path) // 2))
    line = error_line(done, status=4)
    assert f"cannot write {path}" in line and "keeps the checkpoint of iteration 2" in line, line
    assert digest(path) == before
    assert temporaries(path.parent) == []


def test_stale_temporaries_of_the_checkpoint_are_removed(mlp, trained):
    path, _ = trained
    directory = path.parent
    dead = 2 ** 22 + 1                                    # above the largest Linux process id: never running
    ours = [f".p.npz.{dead}-abcd_123.tmp", f".p.npz.{dead}-zzzzzzzz.tmp"]
    kept = [f".p.npz.{os.getpid()}-abcdefgh.tmp",         # a running writer's
            ".p.npz.notours.tmp", f".q.npz.{dead}-abcdefgh.tmp", "p.npz.tmp"]
    for name in ours + kept:
        (directory / name).write_bytes(b"x" * 1000)
    done = train(mlp, params=path, iters="3")
    assert done.returncode == 0, done.stderr
    assert temporaries(directory) == sorted(kept)
    done = run_cli(mlp, "--iters", "3", "--data", "synthetic", "--test-iters", "0", "--params", str(path))
    assert "removed" not in done.stdout


# ----------------------------------------------------------------------------------------------------------------
# nothing wrong is saved or reported as success

@pytest.mark.parametrize("option, value", [("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--momentum", "nan"),
                                           ("--momentum", "-5"), ("--momentum", "1"), ("--decay", "nan"),
                                           ("--decay", "-0.1"), ("--seed", "-1"), ("--save-every", "-2")])
def test_bad_hyperparameters_are_rejected_at_start(mlp, tmp_path, option, value):
    line = error_line(train(mlp, option, value, params=tmp_path / "p.npz"))
    assert option in line and value in line, line
    assert not (tmp_path / "p.npz").exists()


def test_divergence_in_the_last_iteration_saves_nothing(mlp, tmp_path):
    """The update of the last iteration makes the parameters huge but finite: the test loss of one batch catches it
    before the checkpoint is written; numpy's overflow warnings stay silent."""
    path = tmp_path / "p.npz"
    line = error_line(train(mlp, "--lr", "1e30", params=path, iters="1"), status=3)
    assert line.startswith("mlp: error: the loss is nan on a test batch at iteration 1"), line
    assert "no checkpoint was written" in line and not path.exists()
    assert temporaries(tmp_path) == []


def test_divergence_keeps_the_last_good_checkpoint_and_says_so(mlp, trained):
    path, before = trained
    done = run_cli(mlp, "--iters", "4", "--params", str(path), "--data", "synthetic", "--lr", "1e30")
    assert done.returncode == 3
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("mlp: error: "), done.stderr   # on its own line, not after the bar
    assert f"{path} keeps the checkpoint of iteration 2" in errors[0]
    assert "Warning" not in done.stderr and "Traceback" not in done.stderr
    assert digest(path) == before


def test_resume_on_other_data_is_refused(mlp, tmp_path, trained):
    path, before = trained
    line = error_line(run_cli(mlp, "--iters", "4", "--params", str(path), "--data", "digits", "--quiet"))
    assert "'__data__'" in line and "'synthetic'" in line and "'digits'" in line and str(path) in line
    assert digest(path) == before
    done = run_cli(mlp, "--iters", "3", "--params", str(path), "--test-iters", "0")    # no --data: the recorded one
    assert done.returncode == 0 and "on synthetic" in done.stdout, done.stdout + done.stderr
    done = run_cli(mlp, "--iters", "4", "--params", str(path), "--data", "digits", "--switch-data", "--test-iters", "0")
    assert done.returncode == 0 and "on digits" in done.stdout, done.stderr
    assert str(np.load(path)["__data__"]) == "digits"


def test_resume_past_the_end_of_a_smaller_data_set_is_one_line(mlp, tmp_path):
    data, path = tmp_path / "d.npz", tmp_path / "p.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.random((40, 1, 28, 28), dtype=np.float32), y=rng.integers(0, 10, 40))
    done = run_cli(mlp, "--iters", "4", "--params", str(path), "--data", f"npz:{data}", "--test-iters", "0")
    assert done.returncode == 0, done.stderr                          # position (0, 32) of 40 examples
    np.savez(data, x=rng.random((16, 1, 28, 28), dtype=np.float32), y=rng.integers(0, 10, 16))
    before = digest(path)
    line = error_line(run_cli(mlp, "--iters", "6", "--params", str(path), "--data", f"npz:{data}"))
    assert str(path) in line and "__data_offset__" in line and "16 training examples" in line, line
    assert digest(path) == before


def test_init_from_needs_a_fresh_start(mlp, tmp_path, trained):
    path, before = trained
    source = tmp_path / "source.npz"
    assert train(mlp, params=source, iters="1").returncode == 0
    line = error_line(train(mlp, "--init-from", str(source), params=path, iters="4"))
    assert "--init-from" in line and "--fresh" in line and str(path) in line
    assert digest(path) == before
    done = run_cli(mlp, "--iters", "0", "--init-from", str(source), "--params", str(path), "--fresh")
    assert done.returncode == 0 and "initialized 6 of 6 tensors" in done.stdout, done.stdout + done.stderr
    fresh, loaded = np.load(path), np.load(source)
    assert np.array_equal(fresh["fc1_W"], loaded["fc1_W"]) and int(fresh["__iteration__"]) == 0
    assert "--init-from" in run_cli(mlp, "--help").stdout.replace("\n", " ")


def test_init_from_that_matches_nothing_is_refused(mlp, tmp_path):
    other = tmp_path / "other.npz"
    ckpt.write(str(other), ckpt.Checkpoint("", {"conv_W": np.ones((2, 2), np.float32),
                                                "fc1_W": np.ones((3, 3), np.float32)}, "other", "h" * 16))
    line = error_line(train(mlp, "--init-from", str(other), params=tmp_path / "p.npz"))
    assert "none of its tensors matches" in line and str(other) in line and "fc1_W (shape 3x3" in line
    assert not (tmp_path / "p.npz").exists()


def test_structure_hash_hint_names_what_works(mlp, tmp_path):
    path = tmp_path / "p.npz"
    ckpt.write(str(path), ckpt.Checkpoint("", {}, "mlp", "0" * 16))
    line = error_line(train(mlp, params=path))
    assert "--fresh" in line and f"--init-from {path}" in line


# ----------------------------------------------------------------------------------------------------------------
# unreadable inputs: one line

def test_a_single_array_as_params_or_init_from(mlp, tmp_path):
    array = tmp_path / "x.npy"
    np.save(array, np.zeros(3, np.float32))
    before = digest(array)
    for option in ("--params", "--init-from"):
        other = ("--params", str(tmp_path / "p.npz")) if option == "--init-from" else ()
        line = error_line(run_cli(mlp, "--iters", "2", option, str(array), *other, "--data", "synthetic"))
        assert str(array) in line and "single array" in line, line
    assert digest(array) == before                         # refused, not overwritten


def _npz_truncated(path):
    np.savez(path, x=np.zeros((16, 1, 28, 28), np.float32), y=np.zeros(16, np.int64))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, expected", [
    (_npz_truncated, "cannot read"),
    (lambda p: np.save(p.with_suffix(".npy"), np.zeros(3)) or os.replace(p.with_suffix(".npy"), p), "single array"),
    (lambda p: np.savez(p, x=np.full((16, 28, 28), "a"), y=np.zeros(16, np.int64)), "must hold numbers"),
    (lambda p: np.savez(p, x=np.full((16, 28, 28), np.nan, np.float32), y=np.zeros(16, np.int64)), "NaN"),
    (lambda p: p.write_bytes(os.urandom(3000)), "cannot read"),
])
def test_damaged_npz_data(mlp, tmp_path, damage, expected):
    data = tmp_path / "d.npz"
    damage(data)
    line = error_line(run_cli(mlp, "--iters", "2", "--data", f"npz:{data}", "--params", str(tmp_path / "p.npz")))
    assert f"npz:{data}" in line and expected in line, line
    assert not (tmp_path / "p.npz").exists()


def test_corrupt_gzip_mnist(mlp, tmp_path):
    def idx(array: np.ndarray) -> bytes:
        header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        return header + array.astype(np.uint8).tobytes()

    for prefix, n in (("train", 32), ("t10k", 16)):
        (tmp_path / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx(np.zeros((n, 28, 28)))))
        (tmp_path / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx(np.zeros(n))))
    broken = tmp_path / "train-images-idx3-ubyte.gz"
    data = bytearray(broken.read_bytes())
    data[10] = 0x07                          # the first deflate block's type: 3, invalid (zlib.error, not OSError)
    broken.write_bytes(bytes(data))
    line = error_line(run_cli(mlp, "--iters", "2", "--data", f"mnist:{tmp_path}", "--params", str(tmp_path / "p.npz")))
    assert f"mnist:{tmp_path}" in line and "train-images-idx3-ubyte.gz" in line, line


# ----------------------------------------------------------------------------------------------------------------
# interrupts

@pytest.mark.parametrize("delay", [0.15, 0.3, 0.6])
def test_interrupt_while_starting_is_one_line(mlp, tmp_path, delay):
    """At these moments the program imports numpy, sets up, or loads the digits (scikit-learn): before the loop."""
    process = popen_cli(mlp, "--iters", "200000", "--params", str(tmp_path / "p.npz"), "--quiet")
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
    assert process.returncode in (130, -signal.SIGINT), (process.returncode, err)   # -2: before Python started
    if process.returncode == 130:
        assert "SIGINT" in err or "interrupted while starting" in err, err
    if (tmp_path / "p.npz").exists():                                    # it got as far as training: it saved
        assert ckpt.read(str(tmp_path / "p.npz")).iteration >= 0


WIDE = """
from deepdsl import dsl as D

x = D.images("x", (4, 1, 28, 28), dataset="synthetic")
y = D.labels("y", 4, classes=10)
network = D.full("fc2", 10) @ D.relu @ D.full("fc1", 16384) @ D.flatten     # a checkpoint of about 100 MB
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("wide", iters=10, test_iters=0, lr=0.01, momentum=0.9))
"""


def test_second_interrupt_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    network = tmp_path / "wide.py"
    network.write_text(WIDE)
    _, wide = compile_program(network, tmp_path / "program")
    path = tmp_path / "p.npz"
    assert run_cli(wide, "--iters", "1", "--params", str(path), "--quiet").returncode == 0
    for _ in range(3):                  # a save that ends before the poll sees its temporary is tried again
        before, iteration = digest(path), ckpt.read(str(path)).iteration
        process = popen_cli(wide, "--iters", "200000", "--params", str(path))
        try:
            assert process.stdout.readline().startswith("resuming")
            assert process.stdout.readline().startswith("training wide")
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)                     # save and stop ...
            deadline = time.monotonic() + 60
            while not temporaries(tmp_path) and time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.001)
            seen = bool(temporaries(tmp_path))
            process.send_signal(signal.SIGINT)                     # ... no: stop now
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        if seen and "again" in err:
            break
    assert seen, "every save ended before it was seen"
    assert process.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    said = f"wide: SIGINT again: stopped at once; {path} keeps the checkpoint of iteration "
    assert last.startswith(said), err
    assert temporaries(tmp_path) == []
    if int(last[len(said):]) == iteration:
        assert digest(path) == before
    else:           # the second signal came after the rename: the new checkpoint is in place, and said so
        assert ckpt.read(str(path)).iteration == int(last[len(said):]) > iteration


def test_what_an_interrupted_run_says_it_kept_is_what_the_file_holds(tmp_path):
    """A signal after a checkpoint's rename, before the run has noted the save: the new file is in place, and the
    line says its iteration (not the previous checkpoint's, which the run last noted)."""
    from types import SimpleNamespace

    from deepdsl_runtime.run import _Run

    path = tmp_path / "p.npz"
    np.savez(path, __iteration__=np.array(8, dtype=np.int64))
    renamed = SimpleNamespace(path=str(path), saved_iteration=7, writing=8)
    assert _Run.kept(renamed) == f"{path} keeps the checkpoint of iteration 8"
    np.savez(path, __iteration__=np.array(7, dtype=np.int64))       # interrupted before the rename
    assert _Run.kept(renamed) == f"{path} keeps the checkpoint of iteration 7"
    path.unlink()
    first = SimpleNamespace(path=str(path), saved_iteration=None, writing=3)
    assert _Run.kept(first) == "no checkpoint was written"
    np.savez(path, __iteration__=np.array(3, dtype=np.int64))       # the first save of a run, renamed
    assert _Run.kept(first) == f"{path} keeps the checkpoint of iteration 3"


# ----------------------------------------------------------------------------------------------------------------
# SIGKILL at random moments while saving every iteration

REFERENCE = """
import hashlib, json, runpy, sys, time
import numpy as np
from deepdsl_runtime import checkpoint

def fingerprint(path):
    with np.load(path) as z:
        return {k: hashlib.sha256(z[k].tobytes() + str((z[k].dtype, z[k].shape)).encode()).hexdigest() for k in z.files}

write = checkpoint.write
states, times = {}, []

def recording_write(path, state):
    write(path, state)
    states[state.iteration] = fingerprint(path)
    times.append(time.perf_counter())

checkpoint.write = recording_write
program, record, *sys.argv[1:] = sys.argv[1:]
sys.argv[0] = program
try:
    runpy.run_path(program, run_name="__main__")
finally:
    json.dump({"states": states, "seconds_per_iteration": (times[-1] - times[0]) / (len(times) - 1)},
              open(record, "w"))
"""


def fingerprint(path) -> dict[str, str]:
    with np.load(path) as z:
        return {k: hashlib.sha256(z[k].tobytes() + str((z[k].dtype, z[k].shape)).encode()).hexdigest()
                for k in z.files}


def test_sigkill_while_saving_every_iteration_leaves_a_state_of_the_uninterrupted_run(mlp, tmp_path):
    iterations, kills_wanted = 200, 24
    args = ["--iters", str(iterations), "--save-every", "1", "--data", "synthetic", "--test-iters", "0"]
    env = program_env()
    env["OMP_NUM_THREADS"] = "2"
    reference_dir, record = tmp_path / "reference", tmp_path / "states.json"
    reference_dir.mkdir()
    done = subprocess.run([sys.executable, "-c", REFERENCE, str(mlp), str(record), *args, "--quiet", "--params",
                           str(reference_dir / "p.npz")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    recorded = json.loads(record.read_text())
    states = {int(k): v for k, v in recorded["states"].items()}
    per_iteration = recorded["seconds_per_iteration"]                  # a step, its check and its save
    assert sorted(states) == list(range(1, iterations + 1))

    directory = tmp_path / "killed"
    directory.mkdir()
    path = directory / "p.npz"
    rng = random.Random(1234)
    longest = 0.5 * iterations / kills_wanted * per_iteration         # about a quarter of the iterations in all
    kills = left_temporaries = 0
    reached = []
    while kills < kills_wanted:
        process = subprocess.Popen([sys.executable, str(mlp), *args, "--params", str(path)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        while not process.stdout.readline().startswith("training mlp"):   # the loop is about to start
            assert process.poll() is None, "the program ended before training"
        time.sleep(rng.uniform(0, longest))
        if process.poll() is None:
            process.kill()
            kills += 1
        process.communicate(timeout=60)
        left_temporaries += bool(temporaries(directory))
        if path.exists():
            found = ckpt.read(str(path))                                  # loads
            assert fingerprint(path) == states[found.iteration], f"iteration {found.iteration} differs"
            reached.append(found.iteration)
        assert not reached or reached[-1] < iterations, "the runs finished: give them more iterations"
    assert reached == sorted(reached) and len(set(reached)) >= 5, reached          # the runs made progress
    assert left_temporaries > 0, "no kill landed during a write"
    done = subprocess.run([sys.executable, str(mlp), *args, "--iters", str(reached[-1] + 1), "--params", str(path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert temporaries(directory) == []
    assert fingerprint(path) == states[reached[-1] + 1]


# ----------------------------------------------------------------------------------------------------------------
# paths and files that look almost right

def test_a_linked_checkpoint_is_written_through_the_link(mlp, trained):
    path, _ = trained
    link = path.parent / "latest.npz"
    link.symlink_to(path.name)
    done = train(mlp, params=link, iters="4")
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and ckpt.read(str(path)).iteration == 4
    assert temporaries(path.parent) == []


def test_a_params_path_ending_in_a_separator_fails_before_training(mlp, tmp_path):
    line = error_line(train(mlp, params=f"{tmp_path / 'out'}{os.sep}", iters="200000"))
    assert "is a directory; name a file in it" in line
    assert not (tmp_path / "out").exists()


def test_switching_to_a_smaller_data_set_starts_its_batches_over(mlp, tmp_path):
    path = tmp_path / "p.npz"
    assert run_cli(mlp, "--iters", "3", "--params", str(path), "--test-iters", "0", "--quiet").returncode == 0
    assert ckpt.read(str(path)).data_position[1] > 16                   # beyond the 16 synthetic examples
    done = run_cli(mlp, "--iters", "4", "--params", str(path), "--data", "synthetic", "--switch-data",
                   "--test-iters", "0")
    assert done.returncode == 0, done.stderr
    assert "switching from 'digits' to 'synthetic'" in done.stdout
    assert ckpt.read(str(path)).data_position == (0, 8)


def _with_raw_member(path, name: str) -> None:
    import zipfile
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr(name, b"not an array")


def test_a_member_that_is_not_an_array_is_one_line(mlp, trained, tmp_path):
    path, _ = trained
    _with_raw_member(path, "fc9_W")
    line = error_line(train(mlp, params=path, iters="4"))
    assert str(path) in line and "field 'fc9_W': not an .npy array" in line
    data = tmp_path / "d.npz"
    np.savez(data, x=np.zeros((16, 1, 28, 28), np.float32), y=np.zeros(16, np.int64))
    _with_raw_member(data, "x_test")
    line = error_line(run_cli(mlp, "--iters", "2", "--data", f"npz:{data}", "--params", str(tmp_path / "q.npz")))
    assert f"npz:{data}" in line and "'x_test'" in line and "not an .npy array" in line


def test_the_report_of_an_initial_checkpoint(mlp, tmp_path):
    report = tmp_path / "r.json"
    done = run_cli(mlp, "--iters", "0", "--params", str(tmp_path / "p.npz"), "--report-json", str(report))
    assert done.returncode == 0, done.stderr
    figures = json.loads(report.read_text())
    assert figures["iterations"] == 0 and figures["iterations_run"] == 0 and figures["loss"] is None
    assert figures["params"] == str(tmp_path / "p.npz") and figures["peak_bytes_measured"] is None


def test_an_archive_interrupted_in_its_constructor_is_freed_without_a_traceback(tmp_path):
    """A second SIGINT can land inside zipfile.ZipFile's constructor while the checkpoint is written; freed later,
    such an archive raises in its __del__ and Python prints a traceback after the program's one line. The run frees
    what the interrupted frames hold at once, quietly (`run._release_quietly`)."""
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent("""
        import io, sys, zipfile
        from deepdsl_runtime.run import _release_quietly

        class Interrupting(io.BytesIO):
            @property
            def name(self):                  # read by ZipFile.__init__ before it sets `_writing`
                raise KeyboardInterrupt

        try:
            with zipfile.ZipFile(Interrupting(), "w"):
                pass
        except KeyboardInterrupt as interrupt:
            if sys.argv[1] == "release":
                _release_quietly(interrupt)
            print("stopped", file=sys.stderr)
        """))
    quiet = subprocess.run([sys.executable, str(script), "release"], capture_output=True, text=True)
    assert quiet.stderr == "stopped\n"
    noisy = subprocess.run([sys.executable, str(script), "keep"], capture_output=True, text=True)
    assert "Traceback" in noisy.stderr          # what the release prevents (the premise of this test)


def test_a_signal_agreed_by_the_ranks_is_not_a_second_one_when_it_arrives_here():
    """Under mpiexec every rank gets its own copy of a Ctrl-C, some after the ranks have agreed on it: that copy is
    this rank's first signal, not a second (which stops at once); a second own signal does; later ones do nothing."""
    from deepdsl_runtime.run import _Signals

    with _Signals() as signals:
        signals.received = signal.SIGINT                    # as `agreed_signal` sets it for another rank's signal
        try:
            os.kill(os.getpid(), signal.SIGINT)             # this rank's own copy, a moment later
            time.sleep(0.01)
        except KeyboardInterrupt:
            pytest.fail("the own copy of an agreed signal stopped the rank at once")
        assert signals.again is None
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)             # a second Ctrl-C: stop now
            time.sleep(1)
        assert signals.again == signal.SIGINT
        os.kill(os.getpid(), signal.SIGTERM)                # stopping already: nothing more
        time.sleep(0.01)
