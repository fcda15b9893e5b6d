"""Gradient accumulation and data-parallel training (`deepdsl_runtime.parallel`), run as users run them: generated
programs under `mpiexec` (the mpich wheel of the test extra), every run under a timeout.

R ranks with `--reduce exact` train bit for bit as one process with `--accumulate R` on the same data (LeNet, a
network with dropout), measuring on every rank the peak its plan states; `--reduce fast` within float32 rounding
of it; one rank (or none) trains as the fused step does; K accumulated batches of b make one step of a batch of
K*b within float32 tolerance; a checkpoint resumes exactly with another number of ranks; a signal to one rank stops
all of them at one iteration with a checkpoint, a rank killed outright ends the job, and ranks running different
programs are refused at the start.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import deepdsl
from deepdsl.codegen import program_env
from deepdsl_runtime import parallel
from tests.support.program_helpers import (NETWORKS, compile_program, import_program, logged, model_class, rel_err,
                                           run_cli, wait_for)

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install '.[mpi]' brings one)")

TIMEOUT = 120
# one thread and numpy's kernels: ranks sharing the cores are not slowed by threads of their own (no bit depends on
# the threads: `test_ranks_of_one_thread_equal_one_process_of_two_or_three_accumulating`)
SAME_BITS = ("--kernels", "numpy", "--threads", "1", "--quiet")

DROPOUT_NETWORK = """
from deepdsl import dsl as D

x = D.images("x", (4, 1, 16, 16), dataset="digits")
y = D.labels("y", 4, classes=10)
network = (D.full("fc", 10) @ D.flatten @ D.max_pool(2) @ D.dropout(0.3) @ D.relu
           @ D.conv("c1", kernel=3, channels=6, padding=1))
loss = (D.log_loss(y) @ D.softmax @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("dropnet", iters=10, lr=0.05, momentum=0.9))
"""


# wide enough that its gradients make several buckets of the overlapped reduction (each layer over 1 MiB)
WIDE_NETWORK = """
from deepdsl import dsl as D

x = D.images("x", (8, 1, 28, 28), dataset="digits")
y = D.labels("y", 8, classes=10)
network = D.full("c", 10) @ D.relu @ D.full("b", 512) @ D.relu @ D.full("a", 512) @ D.flatten
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("wide", iters=10, lr=0.05, momentum=0.9))
"""


def program(name, directory: Path, batch=None, data_parallel=True) -> Path:
    _, path = compile_program(name, directory, batch, options=deepdsl.CompileOptions(data_parallel=data_parallel))
    return path


@pytest.fixture(scope="module")
def lenet(tmp_path_factory):
    return program("lenet", tmp_path_factory.mktemp("lenet"), batch=8)


def network_program(directory: Path, name: str, text: str) -> Path:
    """The program of the network file `text`, written as `directory/name.py`."""
    network = directory / f"{name}.py"
    network.write_text(text)
    return program(network, directory / "out")


@pytest.fixture(scope="module")
def dropnet(tmp_path_factory):
    return network_program(tmp_path_factory.mktemp("dropnet"), "dropnet", DROPOUT_NETWORK)


def mpiexec(ranks: int, path: Path, *args: str, timeout: float = TIMEOUT, cwd=None) -> subprocess.CompletedProcess:
    env = program_env()
    return subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(path), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def tensors(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files if not k.startswith("__")}


def meta(path: Path, key: str) -> int:
    with np.load(path) as archive:
        return int(archive[key])


def assert_bitwise(got: Path, want: Path):
    a, b = tensors(got), tensors(want)
    assert a.keys() == b.keys()
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"{got.name} and {want.name} differ in {differ}"


def train(path: Path, out: Path, *args: str, ranks: int = 0, iters: int | None = 4) -> dict:
    """Train `iters` iterations (None: as `args` say) into checkpoint `out` (`ranks` > 0: under mpiexec with
    --data-parallel); the report."""
    report = out.with_suffix(".json")
    common = (*(("--iters", str(iters)) if iters is not None else ()), "--params", str(out), "--report-json", str(report), "--test-iters", "1",
              *SAME_BITS, *args)
    done = mpiexec(ranks, path, "--data-parallel", *common) if ranks else run_cli(path, *common, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())


def test_ranks_of_one_thread_equal_one_process_of_two_or_three_accumulating(tmp_path):
    """The bits do not depend on the threads: two ranks of one thread each train bit for bit as one process of two
    threads (and of three) accumulating two batches, with the compiled kernels (products on their threads) and with
    numpy's."""
    from deepdsl.codegen.native import build_library, find_compiler

    path = program("lenet", tmp_path / "program", batch=8)
    kernels = ["numpy"]
    if find_compiler() is not None:
        built, why = build_library(path.with_suffix(".c"))
        assert built is not None, why
        kernels.append("compiled")
    for kind in kernels:
        train(path, tmp_path / f"ranks-{kind}.npz", "--kernels", kind, ranks=2)
        for threads in ("2", "3"):
            one = tmp_path / f"one-{kind}-{threads}.npz"
            train(path, one, "--accumulate", "2", "--kernels", kind, "--threads", threads)
            assert_bitwise(tmp_path / f"ranks-{kind}.npz", one)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_train_bit_for_bit_as_one_process_accumulating(lenet, tmp_path, ranks):
    one = train(lenet, tmp_path / "one.npz", "--accumulate", str(ranks))
    many = train(lenet, tmp_path / "many.npz", ranks=ranks)
    assert_bitwise(tmp_path / "many.npz", tmp_path / "one.npz")
    assert one["loss"] == many["loss"]
    assert (many["ranks"], many["global_batch"], many["reduce"]) == (ranks, 8 * ranks, "exact")
    assert many["bytes_reduced_per_step"] == 4 * sum(int(np.prod(t.shape)) for k, t in
                                                      tensors(tmp_path / "one.npz").items() if not k.startswith("V_"))
    assert 0 < many["communication_share"] < 1
    # every rank measured the peak its plan states (the accumulate step's)
    assert many["peak_bytes_measured_by_rank"] == [many["peak_bytes_planned"]] * ranks
    assert one["peak_bytes_measured"] == one["peak_bytes_planned"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_dropout_masks_follow_the_batch_not_the_rank(dropnet, tmp_path, ranks):
    train(dropnet, tmp_path / "one.npz", "--accumulate", str(ranks), iters=5)
    train(dropnet, tmp_path / "many.npz", ranks=ranks, iters=5)
    assert_bitwise(tmp_path / "many.npz", tmp_path / "one.npz")
    # the masks matter: other masks (another seed) train otherwise
    train(dropnet, tmp_path / "other_seed.npz", "--accumulate", str(ranks), "--seed", "1", iters=5)
    with pytest.raises(AssertionError):
        assert_bitwise(tmp_path / "other_seed.npz", tmp_path / "one.npz")


def test_the_fast_reduction_is_within_rounding_of_the_exact_one(lenet, tmp_path):
    """On 3 ranks MPI's Allreduce may add in another order than the chain: equal within float32 rounding."""
    train(lenet, tmp_path / "exact.npz", ranks=3)
    fast = train(lenet, tmp_path / "fast.npz", "--reduce", "fast", ranks=3)
    assert fast["reduce"] == "fast"
    exact, got = tensors(tmp_path / "exact.npz"), tensors(tmp_path / "fast.npz")
    worst = max(rel_err(got[key], exact[key]) for key in exact)
    print(f"fast against exact on 3 ranks, 4 iterations: {worst:.2e} relative at most")
    assert worst <= 1e-5


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return network_program(tmp_path_factory.mktemp("wide"), "wide", WIDE_NETWORK)


def test_the_overlapped_reduction_sums_buckets_during_the_backward_pass(wide, tmp_path):
    """--reduce fast starts a bucket's sum as soon as the step has finished it; on 2 ranks every order of summing
    gives the same bits (a + b is b + a), so overlapped, after the step and exact agree bit for bit."""
    source = wide.read_text()
    assert source.count("self.reduction.ready(") == 6
    overlapped = train(wide, tmp_path / "overlapped.npz", "--reduce", "fast", ranks=2)
    assert overlapped["overlapped"] and overlapped["buckets"] >= 2
    after = train(wide, tmp_path / "after.npz", "--reduce", "fast", "--no-overlap", ranks=2)
    assert not after["overlapped"]
    train(wide, tmp_path / "exact.npz", ranks=2)
    assert_bitwise(tmp_path / "overlapped.npz", tmp_path / "exact.npz")
    assert_bitwise(tmp_path / "after.npz", tmp_path / "exact.npz")


def test_the_exact_chain_overlaps_the_backward_pass_bit_for_bit(wide, tmp_path):
    """--reduce exact during the backward pass: the chain in rank order, chunk by chunk as the step finishes the
    buckets (the first of them over one chunk), on 3 ranks where the order of the additions shows: bit for bit the
    chain after the step and one process accumulating 3 batches."""
    overlapped = train(wide, tmp_path / "overlapped.npz", ranks=3)
    assert overlapped["overlapped"] and overlapped["reduce"] == "exact" and overlapped["buckets"] >= 2
    assert overlapped["reduce_scratch_bytes"] == 4 * 4 * (1 << 18)      # four chunks received ahead (ranks 1, 2)
    after = train(wide, tmp_path / "after.npz", "--no-overlap", ranks=3)
    assert not after["overlapped"]
    train(wide, tmp_path / "one.npz", "--accumulate", "3")
    assert_bitwise(tmp_path / "overlapped.npz", tmp_path / "one.npz")
    assert_bitwise(tmp_path / "after.npz", tmp_path / "one.npz")


# batch norm under a layer whose gradients make many chunks: its sums over the ranks run while the overlapped chain
# has receives posted for chunks of the layers above
NORMED_NETWORK = """
from deepdsl import dsl as D

x = D.images("x", (4, 1, 28, 28), dataset="digits")
y = D.labels("y", 4, classes=10)
network = (D.full("c", 10) @ D.relu @ D.full("a", 256) @ D.flatten @ D.relu @ D.batch_norm("bn")
           @ D.conv("c1", kernel=3, channels=8, padding=1))
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("normed", iters=10, lr=0.05, momentum=0.9))
"""


def test_the_overlapped_chain_and_batch_norm_sums_share_the_step(tmp_path):
    """3 ranks of a network with batch norm below a 6.4 MB layer (seven chunks, more than the four received ahead):
    synced, the batch-norm sums over the ranks run inside the step while the chain's receives are posted, and the
    result is bit for bit the chain after the step; local, one process accumulating 3 batches."""
    normed = network_program(tmp_path, "normed", NORMED_NETWORK)
    overlapped = train(normed, tmp_path / "overlapped.npz", ranks=3, iters=3)
    assert overlapped["overlapped"] and overlapped["bytes_reduced_per_step"] > 6 * (1 << 20)
    train(normed, tmp_path / "after.npz", "--no-overlap", ranks=3, iters=3)
    assert_bitwise(tmp_path / "overlapped.npz", tmp_path / "after.npz")
    train(normed, tmp_path / "local.npz", "--batch-norm", "local", ranks=3, iters=3)
    train(normed, tmp_path / "one.npz", "--accumulate", "3", iters=3)
    assert_bitwise(tmp_path / "local.npz", tmp_path / "one.npz")


def test_local_batch_norm_without_batch_norm_is_the_plain_exact_run(lenet, tmp_path):
    train(lenet, tmp_path / "local.npz", "--batch-norm", "local", ranks=2, iters=2)
    train(lenet, tmp_path / "one.npz", "--accumulate", "2", iters=2)
    assert_bitwise(tmp_path / "local.npz", tmp_path / "one.npz")


def test_one_rank_trains_as_the_fused_step(lenet, tmp_path):
    plain = train(lenet, tmp_path / "plain.npz")
    alone = train(lenet, tmp_path / "alone.npz", ranks=1)
    assert_bitwise(tmp_path / "alone.npz", tmp_path / "plain.npz")
    assert alone["ranks"] == 1 and alone["accumulate"] == 1 and alone["loss"] == plain["loss"]


def test_accumulated_batches_make_one_step_of_the_larger_batch(lenet, tmp_path):
    """K = 4 batches of 8 against one batch of 32, one iteration from the same start: the updates agree within
    float32 rounding (the same examples: both streams draw the global batch from one permutation)."""
    large = program("lenet", tmp_path / "large", batch=32, data_parallel=False)
    train(lenet, tmp_path / "start.npz", iters=0)
    start = tensors(tmp_path / "start.npz")
    train(lenet, tmp_path / "small.npz", "--accumulate", "4", "--init-from", str(tmp_path / "start.npz"), iters=1)
    train(large, tmp_path / "large.npz", "--init-from", str(tmp_path / "start.npz"), iters=1)
    small, big = tensors(tmp_path / "small.npz"), tensors(tmp_path / "large.npz")
    for key in start:
        if not key.startswith("V_"):
            assert rel_err(small[key] - start[key], big[key] - start[key]) <= 1e-5, key


def test_a_checkpoint_resumes_exactly_with_another_number_of_ranks(lenet, tmp_path):
    train(lenet, tmp_path / "straight.npz", ranks=2, iters=4)
    train(lenet, tmp_path / "resumed.npz", ranks=2, iters=2)
    assert (meta(tmp_path / "resumed.npz", "__ranks__"), meta(tmp_path / "resumed.npz", "__batches__")) == (2, 4)
    # the same global batch from one process: bit for bit the straight run
    train(lenet, tmp_path / "resumed.npz", "--accumulate", "2", iters=4)
    assert_bitwise(tmp_path / "resumed.npz", tmp_path / "straight.npz")
    # another global batch: the sample stream goes on where it stopped, and the run says so
    shutil.copy(tmp_path / "straight.npz", tmp_path / "three.npz")
    done = mpiexec(3, lenet, "--data-parallel", "--iters", "5", "--params", str(tmp_path / "three.npz"),
                   "--test-iters", "1", *SAME_BITS[:-1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "global batch of 16 on 2 ranks, now 24 on 3" in done.stdout
    assert meta(tmp_path / "three.npz", "__data_offset__") == 4 * 16 + 24
    assert meta(tmp_path / "three.npz", "__batches__") == 4 * 2 + 3


def _running(path: Path, out: Path, ranks: int) -> subprocess.Popen:
    """A job of `ranks` ranks training for ever, checkpoint `out`, logging every iteration to `_log(out)`."""
    return subprocess.Popen([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(path), "--data-parallel",
                             "--iters", "1000000", "--params", str(out), "--log", str(_log(out)), "--log-every", "1",
                             *SAME_BITS[:-1]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=program_env(),
                            start_new_session=True)


def _log(out: Path) -> Path:
    return out.with_suffix(".log")


def _ranks_of(out: Path, ranks: int, training: bool = True) -> list[int]:
    """The process ids of a job's ranks (Python processes whose checkpoint is `out`), once they have started and,
    with `training`, once rank 0 has logged an iteration (`_running`): every rank has taken a step, so every rank is
    past the start-up agreement."""
    deadline = time.monotonic() + 120
    found: list[int] = []
    while time.monotonic() < deadline and len(found) != ranks:
        time.sleep(0.2)
        found = []
        for pid in subprocess.run(["pgrep", "-f", "--", f"--params {out}"], capture_output=True, text=True).stdout.split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"mpi4py" in argv[:3] and b"mpiexec" not in argv[0]:
                found.append(int(pid))
    assert len(found) == ranks, "the ranks did not start"
    if training:
        wait_for(lambda: logged(_log(out)), deadline - time.monotonic(), "the ranks to train")
    return sorted(found)


def test_a_signal_to_one_rank_stops_every_rank_at_one_iteration_with_a_checkpoint(lenet, tmp_path):
    out = tmp_path / "p.npz"
    job = _running(lenet, out, 2)
    try:
        pids = _ranks_of(out, 2)
        os.kill(pids[-1], signal.SIGTERM)
        _, stderr = job.communicate(timeout=TIMEOUT)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("lenet:")]
    assert any(": SIGTERM at iteration" in line for line in lines), stderr
    assert any("SIGTERM to another rank at iteration" in line for line in lines), stderr
    assert len({line.split(" at iteration ")[1] for line in lines}) == 1, stderr     # the same iteration, saved
    assert meta(out, "__iteration__") > 0 and meta(out, "__ranks__") == 2


def test_a_diverging_run_stops_every_rank_at_the_same_iteration(lenet, tmp_path):
    out = tmp_path / "nan.npz"
    done = mpiexec(2, lenet, "--data-parallel", "--iters", "50", "--lr", "1e30", "--params", str(out),
                   "--save-every", "1", *SAME_BITS)
    assert done.returncode == 3, done.stderr
    lines = [line.replace("rank 0: ", "") for line in done.stderr.splitlines() if line.startswith("lenet: error:")]
    assert len(lines) == 2 and len(set(lines)) == 1, done.stderr        # one line a rank, the same iteration
    assert "training stopped" in lines[0]
    assert not out.exists() or np.isfinite(np.concatenate([t.ravel() for t in tensors(out).values()])).all()


def test_a_rank_killed_outright_ends_the_job(lenet, tmp_path):
    job = _running(lenet, tmp_path / "k.npz", 2)
    began = None
    try:
        pids = _ranks_of(tmp_path / "k.npz", 2)
        os.kill(pids[-1], signal.SIGKILL)
        began = time.monotonic()
        job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0 and time.monotonic() - began < 60


def test_ranks_running_different_programs_are_refused(lenet, tmp_path):
    other = program("lenet", tmp_path / "other", batch=4)
    done = subprocess.run([MPIEXEC, "-n", "1", sys.executable, "-m", "mpi4py", str(lenet), "--data-parallel",
                           "--iters", "2", "--params", "", ":", "-n", "1", sys.executable, "-m", "mpi4py", str(other),
                           "--data-parallel", "--iters", "2", "--params", ""],
                          capture_output=True, text=True, timeout=TIMEOUT, env=program_env())
    assert done.returncode != 0
    assert "every rank must run the same program" in done.stderr, done.stderr


def _job(command: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """An MPI job (each part of `command` separated by ":"), ended with its whole session when it overruns."""
    return _session([MPIEXEC, *command], timeout)


def _session(argv: list[str], timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """`argv` run in a session of its own, ended with all its processes when it overruns."""
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=program_env(),
                           start_new_session=True, cwd=cwd)
    try:
        out, err = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


# a rank that starts MPI but never reaches the program's agreements
SILENT_RANK = ["-n", "1", sys.executable, "-m", "mpi4py", "-c", "import time; from mpi4py import MPI; time.sleep(60)"]


def test_ranks_that_disagree_on_data_parallel_are_refused_in_one_line(lenet):
    began = time.monotonic()
    done = _job(["-n", "1", sys.executable, "-m", "mpi4py", str(lenet), "--data-parallel", "--iters", "2",
                 "--params", "", ":", "-n", "1", sys.executable, "-m", "mpi4py", str(lenet), "--iters", "2",
                 "--params", ""])
    assert done.returncode == 1 and time.monotonic() - began < 60, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("lenet:")]
    assert lines == ["lenet: error: rank 0 runs with --data-parallel, rank 1 runs without it: every rank of a job "
                     "must run with it (or none: each then trains alone)"], done.stderr
    assert "Traceback" not in done.stderr and "training" not in done.stdout


def test_the_start_up_agreement_ends_after_the_rank_timeout(lenet):
    began = time.monotonic()
    done = _job(["-n", "1", sys.executable, "-m", "mpi4py", str(lenet), "--data-parallel", "--iters", "2",
                 "--params", "", "--rank-timeout", "2", ":", *SILENT_RANK])
    assert done.returncode == parallel.EXIT_STALLED and time.monotonic() - began < 40, done.stderr
    assert "lenet: error: rank 0: no answer from every rank within 2 s in the start-up agreement" in done.stderr


def test_a_signal_ends_the_start_up_agreement_without_a_timeout(lenet, tmp_path):
    """Waiting for ever (--rank-timeout 0) for a rank that never answers, a rank still hears SIGTERM, and waits
    without spinning."""
    out = tmp_path / "waiting.npz"
    job = subprocess.Popen([MPIEXEC, "-n", "1", sys.executable, "-m", "mpi4py", str(lenet), "--data-parallel",
                            "--iters", "2", "--params", str(out), "--rank-timeout", "0", ":", *SILENT_RANK],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=program_env(),
                           start_new_session=True)
    try:
        rank = _ranks_of(out, 1, training=False)[0]
        # started (importing, building) it takes CPU time; waiting in the agreement, almost none: two quiet seconds
        # in a row, which a rank polling at full speed never has
        quiet, deadline = 0, time.monotonic() + 60
        while quiet < 2 and time.monotonic() < deadline:
            cpu = _cpu_seconds(rank)
            time.sleep(1.0)
            quiet = quiet + 1 if _cpu_seconds(rank) - cpu < 0.1 else 0
        assert quiet == 2, "the waiting rank kept using CPU time: polling"
        began = time.monotonic()
        os.kill(rank, signal.SIGTERM)
        _, stderr = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode == 128 + signal.SIGTERM and time.monotonic() - began < 30, stderr
    assert "lenet: rank 0: SIGTERM during the start-up agreement; stopped before training" in stderr, stderr


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_error_of_one_rank_is_said_before_the_job_ends(monkeypatch, capsys):
    """MPI.Abort ends every process, racing mpiexec's forwarding of what the rank wrote last: the line is flushed
    and given time to arrive first."""
    events = []

    class Comm:
        def Abort(self, status):
            events.append(("abort", status))

        def Barrier(self):
            events.append(("barrier",))

    monkeypatch.setattr(parallel.time, "sleep", lambda seconds: events.append(("pause", seconds)))
    ranks = parallel.Ranks.__new__(parallel.Ranks)
    ranks.comm = Comm()
    ranks.end(1, collective=False)
    ranks.end(3, collective=True)
    assert events == [("pause", parallel.FORWARD_SECONDS), ("abort", 1),
                      ("barrier",), ("pause", parallel.FORWARD_SECONDS)]
    assert parallel.FORWARD_SECONDS >= 0.5


def test_a_missing_data_file_is_said_by_every_rank(lenet, tmp_path):
    for _ in range(2):
        done = mpiexec(2, lenet, "--data-parallel", "--iters", "2", "--params", "", "--data",
                       f"npz:{tmp_path / 'missing.npz'}", *SAME_BITS)
        assert done.returncode == 1, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("lenet: error:")]
        assert len(lines) == 2 and "missing.npz" in lines[0], done.stderr


def test_the_documented_commands_run_as_written(tmp_path):
    """docs/distributed.md's first commands, in a directory holding the network file as a checkout does (2
    iterations each): nothing is written under generated/, and each run has a checkpoint of its own."""
    import re
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "distributed.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("  #")[0].split() for line in block.splitlines() if line.strip()]
    assert commands[0][:3] == ["pip", "install", "-e"], commands[0]       # keeps an editable install editable
    (tmp_path / "networks").mkdir()
    shutil.copy(root / "networks" / "lenet.py", tmp_path / "networks" / "lenet.py")
    checkpoints = []
    for command in commands[1:]:
        assert "generated/" not in " ".join(command), command
        if command[0] == "deepdsl":
            done = subprocess.run([sys.executable, "-m", "deepdsl", *command[1:]], capture_output=True, text=True,
                                  cwd=tmp_path, env=program_env(), timeout=TIMEOUT)
        else:
            command = [MPIEXEC if c == "mpiexec" else sys.executable if c == "python" else c for c in command]
            checkpoints.append(command[command.index("--params") + 1])
            done = _session(command + ["--iters", "2", "--test-iters", "1", "--quiet"], TIMEOUT, cwd=tmp_path)
        assert done.returncode == 0, (command, done.stderr[-2000:])
    assert len(checkpoints) == 3 and len(set(checkpoints)) == 3
    for checkpoint in checkpoints:
        assert meta(tmp_path / checkpoint, "__iteration__") == 2
    assert not (tmp_path / "generated").exists()


def test_a_program_without_the_split_steps_says_how_to_compile_one(tmp_path):
    plain = program("lenet", tmp_path / "plain", batch=4, data_parallel=False)
    done = run_cli(plain, "--accumulate", "2", "--iters", "1", "--params", "")
    assert done.returncode == 1 and "compile it with `deepdsl compile" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def resnet_mini(tmp_path_factory):
    return program("resnet_mini", tmp_path_factory.mktemp("resnet_mini"), batch=4)


@pytest.mark.parametrize("count", [2, 3])
def test_batch_norm_statistics_are_those_of_the_global_batch(resnet_mini, tmp_path, count):
    """resnet_mini on `count` ranks of batch 4 against one process of batch 4 x count, one iteration from the same
    parameters: the batch statistics (and their gradients) are summed over the ranks, so the updates and running
    statistics are those of the whole batch within float32 rounding; accumulating the batches of 4 in one process
    normalizes each by its own statistics and lands far from it."""
    ranks = resnet_mini
    whole = program("resnet_mini", tmp_path / "whole", batch=4 * count, data_parallel=False)
    train(ranks, tmp_path / "start.npz", iters=0)
    start = tmp_path / "start.npz"
    report = train(ranks, tmp_path / "ranks.npz", "--init-from", str(start), ranks=count, iters=1)
    assert report["peak_bytes_measured_by_rank"] == [report["peak_bytes_planned"]] * count
    train(whole, tmp_path / "whole.npz", "--init-from", str(start), iters=1)
    train(ranks, tmp_path / "local.npz", "--init-from", str(start), "--accumulate", str(count), iters=1)
    before, want = tensors(start), tensors(tmp_path / "whole.npz")
    deltas = {k: want[k] - before[k] for k in before if not k.startswith("V_")}
    floor = 1e-3 * max(float(np.linalg.norm(d)) for d in deltas.values())      # updates zero in exact arithmetic

    def worst(path):
        got = tensors(path)
        return max(rel_err(got[k] - before[k], d, floor) for k, d in deltas.items())
    assert worst(tmp_path / "ranks.npz") <= 5e-4
    assert worst(tmp_path / "local.npz") > 0.05


@pytest.mark.parametrize("count", [2, 3])
def test_local_batch_norm_trains_bit_for_bit_as_one_process_accumulating(resnet_mini, tmp_path, count):
    """--batch-norm local: every rank normalizes by its own batch's statistics, and the running statistics replay
    the updates of every rank's batches in the order of the global stream: parameters, optimizer state and running
    statistics are those of one process accumulating `count` batches, bit for bit, after several iterations; they
    are not those of synced batch norm."""
    one = train(resnet_mini, tmp_path / "one.npz", "--accumulate", str(count), iters=3)
    many = train(resnet_mini, tmp_path / "many.npz", "--batch-norm", "local", ranks=count, iters=3)
    assert_bitwise(tmp_path / "many.npz", tmp_path / "one.npz")
    assert one["loss"] == many["loss"] and many["batch_norm"] == "local"
    assert many["peak_bytes_measured_by_rank"] == [many["peak_bytes_planned"]] * count
    running = [k for k in tensors(tmp_path / "one.npz") if k.endswith("_bn_mean") or k.endswith("_bn_var")]
    assert running, "resnet_mini has batch norm"
    train(resnet_mini, tmp_path / "synced.npz", ranks=count, iters=3)
    synced, local = tensors(tmp_path / "synced.npz"), tensors(tmp_path / "many.npz")
    assert all(not np.array_equal(synced[k], local[k]) for k in running)


def test_accumulated_running_statistics_follow_every_batch(resnet_mini, tmp_path):
    """One process accumulating two batches updates the running statistics after each, as two iterations of the
    fused step on the same batches do (within float32 rounding: the steps round the update differently)."""
    model_cls = model_class(import_program(resnet_mini))
    rng = np.random.default_rng(1)
    batches = [model_cls.random_batch(rng) for _ in range(2)]
    fused, split = model_cls(kernels="numpy"), model_cls(kernels="numpy")
    hyper = fused.hyper(0.0, 0.0, 0.0, 0)          # no update of the parameters: only the statistics move
    for m in (fused, split):
        m.initialize(0)
        m.prepare(hyper)
    before = fused.host_tensors()
    acc = parallel.Accumulation(parallel.Alone(), 2, "exact")
    acc.start(split)
    for x, y in batches:
        fused.train_step(x, y, step=0, **hyper)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    acc.iterate(split, x, y, 0, hyper)
    a, b = fused.host_tensors(), split.host_tensors()
    running = [k for k in a if k.endswith("_bn_mean") or k.endswith("_bn_var")]
    assert running, "resnet_mini has batch norm"
    for k in running:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert not np.allclose(a[k], before[k]), k


def test_one_rank_with_dropout_or_batch_norm_trains_as_the_fused_step(dropnet, resnet_mini, tmp_path):
    for name, path in (("dropnet", dropnet), ("resnet_mini", resnet_mini)):
        train(path, tmp_path / f"{name}_plain.npz", iters=3)
        alone = train(path, tmp_path / f"{name}_alone.npz", "--batch-norm", "local", ranks=1, iters=3)
        assert_bitwise(tmp_path / f"{name}_alone.npz", tmp_path / f"{name}_plain.npz")
        assert alone["ranks"] == 1


def test_the_memory_table_of_the_accumulate_step_counts_the_accumulators(capsys):
    """`deepdsl memory --step accumulate` (which compiles the split steps): persistent accumulators, one float per
    parameter, in the step's total."""
    from deepdsl.cli import main

    assert main(["memory", str(NETWORKS / "lenet.py"), "--batch", "4", "--step", "accumulate", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["gradient_accumulator_bytes"] == table["param_bytes"] > 0
    assert table["total_bytes"] >= table["arena_bytes"] + table["workspace_bytes"] + 2 * table["param_bytes"]


def test_a_rank_stopped_where_mpi_cannot_see_it_ends_the_job_after_the_rank_timeout(lenet, tmp_path):
    """SIGSTOP leaves a rank alive but silent: the other waits in a collective until its watchdog ends the job."""
    out = tmp_path / "stalled.npz"
    job = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(lenet), "--data-parallel",
                            "--iters", "1000000", "--params", str(out), "--rank-timeout", "3", *SAME_BITS[:-1]],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=program_env(),
                           start_new_session=True)
    stopped = None
    try:
        stopped = _ranks_of(out, 2, training=False)[-1]
        while "training lenet" not in job.stdout.readline():     # past the agreements: the watchdog's watch
            assert job.poll() is None, job.stderr.read()
        time.sleep(1.0)                                            # the progress bar is shown
        os.kill(stopped, signal.SIGSTOP)
        began = time.monotonic()
        _, stderr = job.communicate(timeout=60)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0 and time.monotonic() - began < 30
    assert "no progress for 3 s" in stderr and "ending the job" in stderr, stderr
    # on a line of its own, not after the progress bar's last state (which ends with a carriage return at most)
    assert any(line.startswith("lenet: rank 0: no progress for 3 s") for line in stderr.split("\n")), stderr


def test_validation_during_training_gives_the_figures_of_one_process(lenet, tmp_path):
    """--eval-every under two ranks: the same validation figures, log entries and best checkpoint as one process
    accumulating two batches (each rank validates the whole split, summed in batch order)."""
    common = ("--eval-every", "3", "--eval-batches", "5", "--keep-best", "accuracy", "--log-every", "2",
              "--top-k", "3", "--epochs", "1")
    train(lenet, tmp_path / "one.npz", "--accumulate", "2", "--log", str(tmp_path / "one.jsonl"), *common, iters=None)
    train(lenet, tmp_path / "many.npz", "--log", str(tmp_path / "many.jsonl"), *common, ranks=2, iters=None)
    fields = ("iteration", "epoch", "loss", "lr", "val_loss", "val_accuracy", "val_top3", "val_examples")
    one, many = ([{k: e.get(k) for k in fields} for e in map(json.loads, (tmp_path / f"{n}.jsonl").open())]
                 for n in ("one", "many"))
    assert one == many and any(e["val_loss"] is not None for e in one)
    assert one[-1]["iteration"] == -(-1497 // 16)          # one pass over digits in global batches of 16
    assert_bitwise(tmp_path / "many.best.npz", tmp_path / "one.best.npz")
