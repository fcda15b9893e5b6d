"""`deepdsl` as its users run it, each command a separate process: `deepdsl run` under SIGINT (also as a terminal's
Ctrl-C, sent to the whole process group) and SIGTERM exits with 128 + the signal after the program has saved a
complete, resumable checkpoint, and the program never outlives it; `run` keeps the checkpoints of different
compilations of one network apart and says where each goes; an output that would overwrite the network file, or that
cannot be written, is a one-line error, and outputs in missing directories are written after creating them."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.program_helpers import NETWORKS, ROOT, compile_program, program_env, wait_for

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
        wait_for(lambda: "loss" in errors.read_text(), 120, "a training step")
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
    while signal.getsignal(signal.SIGINT) is signal.default_int_handler:     # until `run_program` relays signals
        time.sleep(0.0005)
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGINT)          # a Ctrl-C reaching `deepdsl run` while the program starts

threading.Thread(target=fire, daemon=True).start()
sys.exit(run_program(sys.argv[1], ["--iters", "100000", "--params", "", "--quiet", "--data", "synthetic"]))
"""


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03])
def test_a_signal_relayed_while_the_program_starts_is_one_line(tmp_path, delay):
    """The program starts with the relayed signals blocked until its own handlers are set; a signal that a thread
    other than the main one takes (here the one sending it) still reaches the program at once."""
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


# ----------------------------------------------------------------------------------------------------------------
# nothing the user has is overwritten, and every fault is one line

TINY = '''\
from deepdsl import dsl as D

x = D.images("x", (2, 1, 4, 4), dataset="synthetic")
y = D.labels("y", 2, classes=3)
network = D.full("fc1", 3) @ D.flatten
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("tiny", iters=2, test_iters=0, lr=0.01))
'''


def program_error(done: subprocess.CompletedProcess, status: int, *fragments: str) -> str:
    """The only line on standard error of a generated program (or of `deepdsl run` running it) that failed with
    `status`, holding every fragment."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == status, done.stdout + done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def tiny_program(tmp_path: Path) -> Path:
    """tiny.py in `tmp_path` and its program gen/tiny.py (the header naming tiny.py, as compiled from there)."""
    (tmp_path / "tiny.py").write_text(TINY)
    done = deepdsl("compile", "tiny.py", "-o", "gen/tiny.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return tmp_path / "gen" / "tiny.py"


def program(program_file: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(program_file), *args], capture_output=True, text=True, cwd=str(cwd),
                          env=_env(), timeout=300)


@pytest.mark.parametrize("options", [("--report-json", "tiny.py"), ("--params", "tiny.py", "--fresh")],
                         ids=["report-json", "params-fresh"])
def test_a_program_output_onto_the_network_file_is_refused_through_run(tmp_path, options):
    (tmp_path / "tiny.py").write_text(TINY)
    done = deepdsl("run", "tiny.py", "--", "--iters", "1", *options, cwd=tmp_path)
    program_error(done, 1, f"tiny: error: {options[0]} tiny.py is the network file; choose another file")
    assert (tmp_path / "tiny.py").read_text() == TINY


def test_a_program_output_onto_its_own_files_or_the_network_file_is_refused(tmp_path):
    """Run directly, from the directory it was compiled in or from another: the network file, the program and its
    kernels' sources stay as they are, and the outputs do not collide."""
    path = tiny_program(tmp_path)
    files = {p: p.read_bytes() for p in (tmp_path / "tiny.py", path, path.with_suffix(".c"), path.with_suffix(".cu"))}
    (tmp_path / "elsewhere").mkdir()
    for cwd, options, what in [
        (tmp_path, ("--report-json", "tiny.py"), "is the network file"),
        (tmp_path / "elsewhere", ("--report-json", "../tiny.py"), "is the network file"),
        (tmp_path / "elsewhere", ("--params", str(tmp_path / "tiny.py"), "--fresh"), "is the network file"),
        (tmp_path, ("--report-json", "gen/tiny.py"), "is this program"),
        (tmp_path, ("--report-json", "gen/tiny.c"), "is this program's .c kernels"),
        (tmp_path, ("--params", "gen/tiny.cu", "--fresh"), "is this program's .cu kernels"),
        (tmp_path, ("--report-json", "out.npz", "--params", "out.npz"), "is --params too"),
    ]:
        done = program(path, "--iters", "1", *options, cwd=cwd)
        program_error(done, 1, f"tiny: error: {options[0]} {options[1]} {what}")
        assert {p: p.read_bytes() for p in files} == files, options
    assert not (tmp_path / "out.npz").exists()


def test_a_checkpoint_replaced_by_a_fifo_during_the_run_is_left_as_it_is(tmp_path):
    """The checkpoint path is looked at again at every save: a link to a FIFO put there while the program trains
    stops the run at the next save (exit 4, one line), and stays a link to a FIFO."""
    path = tiny_program(tmp_path)
    checkpoint, fifo = tmp_path / "ck.npz", tmp_path / "fifo"
    os.mkfifo(fifo)
    run = subprocess.Popen([sys.executable, str(path), "--iters", "100000000", "--save-every", "50", "--params",
                            "ck.npz", "--quiet"], cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_for(checkpoint.is_file, 120, "the first checkpoint")
        good = ckpt.read(str(checkpoint)).iteration
        assert good >= 50
        deadline = time.monotonic() + 120
        while run.poll() is None and time.monotonic() < deadline:
            if not checkpoint.is_symlink():  # (again, where a save renamed its file over the link just made)
                (tmp_path / "link").symlink_to("fifo")
                os.replace(tmp_path / "link", checkpoint)
            time.sleep(0.05)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    done = subprocess.CompletedProcess(run.args, run.returncode, out, err)
    program_error(done, 4, "tiny: error: cannot write ck.npz: not a regular file; training stopped at iteration",
                  "ck.npz is left as it is (not a regular file)")
    assert checkpoint.is_symlink() and os.readlink(checkpoint) == "fifo"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _limit_file_size():
    """In the child: files may grow to 64 bytes, and a write past it fails (EFBIG, as a full disk fails with
    ENOSPC) instead of ending the process."""
    import resource
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))


def test_a_compile_that_cannot_write_leaves_the_previous_program_whole(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "small").mkdir()
    before = {name: f"previous {name}\n".encode() for name in ("prog.py", "prog.c", "prog.cu")}
    for name, data in before.items():
        (tmp_path / "small" / name).write_bytes(data)
    env = {**_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-m", "deepdsl", "compile", "tiny.py", "-o", "small/prog.py"],
                          capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300,
                          preexec_fn=_limit_file_size)
    assert_one_line_error(done, "cannot write small/prog.py: File too large")
    assert {p.name: p.read_bytes() for p in (tmp_path / "small").iterdir()} == before


@pytest.mark.parametrize("command", [("compile", "tiny.py", "-o", "prog.c"), ("compile", "tiny.py", "-o", "prog.cu"),
                                     ("run", "tiny.py", "-o", "prog.c", "--", "--iters", "0")],
                         ids=["compile-c", "compile-cu", "run-c"])
def test_a_program_output_that_its_kernels_would_overwrite_is_refused(tmp_path, command):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / command[3]).write_text("int kept;\n")
    assert_one_line_error(deepdsl(*command, cwd=tmp_path), f"-o {command[3]}: the program's kernels are written "
                                                           "beside it as prog.c and prog.cu")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([command[3], "tiny.py"])
    assert (tmp_path / command[3]).read_text() == "int kept;\n"


@pytest.mark.parametrize("name, tensor", [("__init__", "__init___W"), ("_", "__W")])
def test_a_layer_name_that_makes_a_metadata_name_is_refused_where_it_is_defined(tmp_path, name, tensor):
    (tmp_path / "tiny.py").write_text(TINY.replace('"fc1"', repr(name)))
    assert_one_line_error(deepdsl("compile", "tiny.py", "-o", "gen/tiny.py", cwd=tmp_path),
                          f"tiny.py:5: layer '{name}': its tensors would be named '{tensor}'", "reserved")
    assert not (tmp_path / "gen").exists()


def test_a_parameter_name_of_the_metadata_is_refused(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY.replace("network = ", 'pos = D.param("__seed__", (2, 1, 4, 4))\n'
                                                                 "network = "))
    assert_one_line_error(deepdsl("compile", "tiny.py", cwd=tmp_path), "tiny.py:5: D.param '__seed__'", "reserved")


@pytest.mark.parametrize("command", [("compile", "tiny.py", "-o", "/"), ("run", "tiny.py", "-o", "/"),
                                     ("compile", "tiny.py", "-o", "gen")],
                         ids=["compile-root", "run-root", "compile-directory"])
def test_a_program_output_that_is_a_directory_is_a_one_line_error(tmp_path, command):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "gen").mkdir()
    assert_one_line_error(deepdsl(*command, cwd=tmp_path),
                          f"cannot write {command[3]}: is a directory; name the program file")


@pytest.mark.parametrize("command", ["compile", "run", "memory"])
def test_a_network_path_in_a_loop_of_links_is_a_one_line_error(tmp_path, command):
    os.symlink("b.py", tmp_path / "a.py")
    os.symlink("a.py", tmp_path / "b.py")
    assert_one_line_error(deepdsl(command, "a.py", cwd=tmp_path), "a.py: cannot read:", "symbolic links")


def test_a_network_file_raising_a_base_exception_is_one_line(tmp_path):
    (tmp_path / "odd.py").write_text("class Odd(BaseException):\n    pass\n\n\nraise Odd('not an Exception')\n")
    assert_one_line_error(deepdsl("compile", "odd.py", cwd=tmp_path), "odd.py:5: Odd: not an Exception")


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["sighup", "sigterm"])
def test_a_signal_while_the_network_loads_is_one_line(tmp_path, sig):
    """`deepdsl run` stopped before its program starts: one line and 128 + the signal, nothing written."""
    (tmp_path / "slow.py").write_text("import pathlib, time\npathlib.Path('loading').touch()\ntime.sleep(60)\n"
                                      + TINY)
    run = subprocess.Popen([sys.executable, "-m", "deepdsl", "run", "slow.py"], cwd=str(tmp_path), env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for((tmp_path / "loading").exists, 120, "the network file to run")
        run.send_signal(sig)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 128 + sig, (run.returncode, err)
    assert err.strip() == f"deepdsl: interrupted by {sig.name}", err
    assert not (tmp_path / ".deepdsl").exists()


SIGHUP_INSIDE_AN_IMPORT = SIGNAL_INSIDE_AN_IMPORT.replace("signal.SIGINT", "signal.SIGHUP")


def test_a_sighup_while_the_program_starts_is_one_line(tmp_path):
    """As SIGINT and SIGTERM: held while the modules load, then one line and 128 + SIGHUP."""
    path = tiny_program(tmp_path)
    done = subprocess.run([sys.executable, "-c", SIGHUP_INSIDE_AN_IMPORT, str(path)], capture_output=True,
                          text=True, timeout=120, env=program_env())
    assert done.stdout.strip() == "signalled", (done.stdout, done.stderr)
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    assert done.stderr.strip() == "tiny: interrupted while starting; nothing was written", done.stderr
