"""`deepdsl` as its users run it, each command a separate process: `deepdsl run` under SIGINT (also as a terminal's
Ctrl-C, sent to the whole process group) and SIGTERM exits with 128 + the signal after the program has saved a
complete, resumable checkpoint, and the program never outlives it; `run` keeps the checkpoints of different
compilations of one network apart and says where each goes; an output that would overwrite the network file, or that
cannot be written, is a one-line error, and outputs in missing directories are written after creating them."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.program_helpers import NETWORKS, ROOT, compile_program, program_env

ckpt = pytest.importorskip("deepdsl_runtime.checkpoint")

# a fully connected layer of 4096 x 4096: its weights and momentum make a 134 MB checkpoint, whose save takes longer
# than a parent that kills its child a fraction of a second after an interrupt would allow
WIDE = '''\
from deepdsl import dsl as D

x = D.images("x", (2, 1, 64, 64), dataset="synthetic")
y = D.labels("y", 2, classes=10)
network = D.full("fc2", 10) @ D.relu @ D.full("fc1", 4096) @ D.flatten
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("wide", iters=1000000, test_iters=0, lr=0.001, momentum=0.9))
'''

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists() or os.name != "posix",
                                reason="finds the training program through /proc")


def _env() -> dict:
    env = program_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def deepdsl(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepdsl", *args], capture_output=True, text=True, cwd=str(cwd),
                          env=_env(), timeout=timeout)


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 1, exactly one line on standard error, `deepdsl: error: ...` holding every fragment."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("deepdsl: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def checkpoint_named(stdout: str) -> str:
    """The checkpoint `deepdsl run` says its program uses (`wrote P; running it (checkpoint: C)`)."""
    line = next(line for line in stdout.splitlines() if "running it" in line)
    assert "(checkpoint: " in line, line
    return line.split("(checkpoint: ", 1)[1].removesuffix(")")


# ----------------------------------------------------------------------------------------------------------------
# processes, through /proc

def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2:].split()


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of the processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append((int(entry.name), fields[19]))
    return found


def _running(process: tuple[int, str]) -> bool:
    """Whether the process (pid, start time) still runs (a zombie has ended; another start time is another
    process)."""
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------------------------
# signals to `deepdsl run`

@needs_proc
@pytest.mark.parametrize("sig, to_group", [(signal.SIGINT, True), (signal.SIGINT, False), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "sigint", "sigterm"])
def test_signal_to_run_saves_a_resumable_checkpoint_and_leaves_no_program(tmp_path, sig, to_group):
    """`to_group`: the signal goes to every process of `deepdsl run`'s group, as a terminal sends Ctrl-C."""
    (tmp_path / "wide.py").write_text(WIDE)
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err:
        run = subprocess.Popen([sys.executable, "-m", "deepdsl", "run", "wide.py", "--", "--iters", "1000000"],
                               cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE, stderr=err, text=True,
                               start_new_session=True)
    program = None
    try:
        checkpoint = checkpoint_named(run.stdout.readline())
        started = run.stdout.readline()
        assert started.startswith("training wide"), started + errors.read_text()
        programs = _children(run.pid)
        assert len(programs) == 1, programs
        program = programs[0]
        # the progress bar shows a loss once steps run inside the loop
        _wait_for(lambda: "loss" in errors.read_text(), 120, "a training step")
        if to_group:
            os.killpg(run.pid, sig)
        else:
            run.send_signal(sig)
        run.wait(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        run.stdout.close()
        if program is not None and _running(program):
            os.kill(program[0], signal.SIGKILL)
            pytest.fail("the training program outlived `deepdsl run`")
    stderr = errors.read_text()
    assert run.returncode == 128 + sig, stderr
    assert f"{signal.Signals(sig).name} at iteration" in stderr and f"saved {checkpoint}" in stderr, stderr
    state = ckpt.read(str(tmp_path / checkpoint))
    done = state.iteration
    assert done >= 1 and state.network == "wide"

    resumed = deepdsl("run", "wide.py", "--", "--iters", str(done + 1), "--quiet", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert checkpoint_named(resumed.stdout) == checkpoint
    assert ckpt.read(str(tmp_path / checkpoint)).iteration == done + 1


# ----------------------------------------------------------------------------------------------------------------
# where `deepdsl run` writes

def test_runs_of_different_compilations_keep_their_own_checkpoints(tmp_path):
    shutil.copy(NETWORKS / "mlp.py", tmp_path / "mlp.py")
    common = ("--iters", "2", "--test-iters", "1", "--data", "synthetic")
    small = deepdsl("run", "mlp.py", "--batch", "4", "--", *common, cwd=tmp_path)
    large = deepdsl("run", "mlp.py", "--batch", "8", "--", *common, cwd=tmp_path)
    assert small.returncode == 0, small.stdout + small.stderr
    assert large.returncode == 0, large.stdout + large.stderr
    paths = checkpoint_named(small.stdout), checkpoint_named(large.stdout)
    assert paths[0] != paths[1]
    for path in paths:
        assert Path(path).parent == Path(".deepdsl"), path
        assert ckpt.read(str(tmp_path / path)).iteration == 2
    assert not list(tmp_path.glob("*.npz")), "a checkpoint landed in the working directory"

    again = deepdsl("run", "mlp.py", "--batch", "4", "--", "--iters", "3", "--test-iters", "1", "--data",
                    "synthetic", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming from {paths[0]} at iteration 2" in again.stdout

    chosen = deepdsl("run", "mlp.py", "--batch", "4", "--", "--iters", "0", "--params", "mine.npz", cwd=tmp_path)
    assert chosen.returncode == 0, chosen.stdout + chosen.stderr
    assert checkpoint_named(chosen.stdout) == "mine.npz" and (tmp_path / "mine.npz").exists()


# ----------------------------------------------------------------------------------------------------------------
# outputs

@pytest.mark.parametrize("command", [
    ("compile", "mlp.py", "-o", "mlp.py"),
    ("compile", "mlp.py", "-o", "sub/../mlp.py"),
    ("run", "mlp.py", "-o", "mlp.py", "--", "--iters", "0"),
    ("graph", "mlp.py", "-o", "mlp.py"),
    ("memory", "mlp.py", "--plot", "mlp.py"),
], ids=["compile", "compile-other-spelling", "run", "graph", "memory-plot"])
def test_an_output_onto_the_network_file_is_refused(tmp_path, command):
    source = tmp_path / "mlp.py"
    shutil.copy(NETWORKS / "mlp.py", source)
    (tmp_path / "sub").mkdir()
    before = source.read_bytes()
    done = deepdsl(*command, cwd=tmp_path)
    assert_one_line_error(done, "is the network file itself; choose another output")
    assert source.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.py", "sub"]


def test_outputs_in_missing_directories_are_created(tmp_path):
    pytest.importorskip("matplotlib")
    shutil.copy(NETWORKS / "mlp.py", tmp_path / "mlp.py")
    for command, written in [
        (("graph", "mlp.py", "-o", "a/b/train.dot"), "a/b/train.dot"),
        (("memory", "mlp.py", "--plot", "c/d/live.png"), "c/d/live.png"),
        (("compile", "mlp.py", "-o", "e/f/mlp.py"), "e/f/mlp.cu"),
        (("run", "mlp.py", "--batch", "4", "-o", "g/h/mlp.py", "--", "--iters", "0"), "g/h/mlp.params.npz"),
    ]:
        done = deepdsl(*command, cwd=tmp_path)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        assert (tmp_path / written).is_file(), command


@pytest.mark.parametrize("command, output", [
    (("compile", "mlp.py", "-o", "taken/mlp.py"), "taken/mlp.py"),
    (("run", "mlp.py", "-o", "taken/sub/mlp.py", "--", "--iters", "0"), "taken/sub/mlp.py"),
    (("graph", "mlp.py", "-o", "taken/train.dot"), "taken/train.dot"),
    (("memory", "mlp.py", "--plot", "taken/live.png"), "taken/live.png"),
], ids=["compile", "run", "graph", "memory-plot"])
def test_an_output_under_a_file_is_a_one_line_error(tmp_path, command, output):
    if command[0] == "memory":
        pytest.importorskip("matplotlib")
    shutil.copy(NETWORKS / "mlp.py", tmp_path / "mlp.py")
    (tmp_path / "taken").write_text("a file, not a directory\n")
    assert_one_line_error(deepdsl(*command, cwd=tmp_path), f"cannot write {output}", "taken is not a directory")


@pytest.mark.parametrize("command", [("compile", "mlp.py", "-o", "out"), ("graph", "mlp.py", "-o", "out")],
                         ids=["compile", "graph"])
def test_an_output_that_is_a_directory_is_a_one_line_error(tmp_path, command):
    shutil.copy(NETWORKS / "mlp.py", tmp_path / "mlp.py")
    (tmp_path / "out").mkdir()
    assert_one_line_error(deepdsl(*command, cwd=tmp_path), "cannot write out")


def test_a_plot_format_matplotlib_cannot_write_is_a_one_line_error(tmp_path):
    pytest.importorskip("matplotlib")
    shutil.copy(NETWORKS / "mlp.py", tmp_path / "mlp.py")
    assert_one_line_error(deepdsl("memory", "mlp.py", "--plot", "live.txt", cwd=tmp_path),
                          "--plot live.txt", "cannot write .txt files")
    assert not (tmp_path / "live.txt").exists()


EARLY_SIGNAL = """
import os, signal, sys, threading, time
from deepdsl.codegen import run_program

def fire():
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGINT)          # a Ctrl-C reaching `deepdsl run` while the program starts

threading.Thread(target=fire, daemon=True).start()
sys.exit(run_program(sys.argv[1], ["--iters", "100000", "--params", "", "--quiet", "--data", "synthetic"]))
"""


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03])
def test_a_signal_relayed_while_the_program_starts_is_one_line(tmp_path, delay):
    """The program starts with the relayed signals blocked until its own handlers are set."""
    _, program = compile_program("mlp", tmp_path, batch=8)
    done = subprocess.run([sys.executable, "-c", EARLY_SIGNAL, str(program), str(delay)], capture_output=True,
                          text=True, timeout=120, env=program_env())
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


SIGNAL_INSIDE_AN_IMPORT = """
import os, runpy, signal, sys

class SignalOnImport:
    \"\"\"Sends SIGINT to this process when `datetime` is first imported: numpy's extension imports it from C,
    where an exception raised by a signal handler becomes an ImportError.\"\"\"
    def find_spec(self, name, path=None, target=None):
        if name == "datetime":
            sys.meta_path.remove(self)
            print("signalled", flush=True)
            os.kill(os.getpid(), signal.SIGINT)

sys.meta_path.insert(0, SignalOnImport())
sys.argv = [sys.argv[1], "--iters", "1", "--params", "", "--quiet", "--data", "synthetic"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_signal_while_an_extension_module_loads_is_one_line(tmp_path):
    """Signals wait while the program's modules load: one raised inside numpy's C import would be a broken install."""
    _, program = compile_program("mlp", tmp_path, batch=8)
    done = subprocess.run([sys.executable, "-c", SIGNAL_INSIDE_AN_IMPORT, str(program)], capture_output=True,
                          text=True, timeout=120, env=program_env())
    assert done.stdout.strip() == "signalled", (done.stdout, done.stderr)   # the signal came inside the import
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "mlp: interrupted while starting; nothing was written", done.stderr
