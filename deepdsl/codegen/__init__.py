"""Code generation: a compiled network becomes a standalone Python training program.

`description.describe(compiled)` lowers a compiled network once to a frozen `ProgramDescription`;
`render_program` renders it with `codegen_templates/program.py.jinja` (StrictUndefined) and `cuda.render_cuda`
with `kernels.cu.jinja`, and `generate(compiled)` does both steps for the Python program. The description holds
the network's declarations, the memory plans of its steps as data (`memory_plans`: each buffer's arena offset and
bytes) and the bodies of its setup, training and test steps (built by `steps` from the SSA programs and their
plans, one block per statement under the IR statement as a comment, calls from the per-op snippets of `lowering`,
elementwise kernels from `ufuncs`, scratch sizes from the ops' `workspace` rules through the plan). The program
imports only numpy and `deepdsl_runtime`; its loop, CLI machinery, data, checkpoints and allocators are in
`deepdsl_runtime`.

`python -m deepdsl.codegen.refresh` regenerates `generated/` from `networks/`.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = ["CodegenOptions", "generate", "program_env", "render_program", "run_program", "write_program",
           "write_text_atomically"]

def _templates_dir() -> Path:
    """`codegen_templates/` of a source checkout, else the copy installed as `deepdsl.codegen_templates`."""
    checkout = Path(__file__).resolve().parents[2] / "codegen_templates"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parents[1] / "codegen_templates"    # installed: deepdsl/codegen_templates


TEMPLATES = _templates_dir()


@dataclass(frozen=True)
class CodegenOptions:
    """How to render a program.

    The program follows the memory plans in `compiled.steps` as they are: what they depend on (the workspace limit
    among them) is a compile option.

    source: the network file as named in the header (default: the path the network was loaded from, relative to
        the current directory when inside it).
    params_file: default of the program's --params (default: `<network>.params.npz`; `deepdsl run` gives
        `.deepdsl/<network>-b<batch>-<hash>.params.npz`, beside its program).
    """

    source: str | None = None
    params_file: str | None = None


def structure_hash(compiled) -> str:
    """Identifies the compiled training step (statements, shapes, inputs; not how its values are named):
    checkpoints carry it."""
    return hashlib.sha256(compiled.train.text(positional=True).encode()).hexdigest()[:16]


def render(template: str, **values) -> str:
    """`codegen_templates/<template>` rendered with `values` (StrictUndefined: a missing value is an error)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    return env.get_template(template).render(**values)


def render_program(description) -> str:
    """The source text of the Python program of a `ProgramDescription` (it only renders: every decision is in the
    description)."""
    return render("program.py.jinja", **{f.name: getattr(description, f.name) for f in fields(description)})


def generate(compiled, options: CodegenOptions | None = None) -> str:
    """The source text of the standalone training program of `compiled` (a `deepdsl.Compiled`)."""
    from deepdsl.codegen.description import describe

    return render_program(describe(compiled, options))


def write_program(compiled, path, options: CodegenOptions | None = None) -> Path:
    """Write the program of `compiled` to `path` (directories are created), and beside it its CUDA kernels
    (`<name>.cu`, see `deepdsl.codegen.cuda`) and its compiled CPU kernels' source (`<name>.c`, see
    `deepdsl.codegen.native`), all rendered from one `ProgramDescription`; returns the path of the program."""
    from deepdsl.codegen.cuda import write_cuda
    from deepdsl.codegen.description import describe
    from deepdsl.codegen.native import render_c

    path = Path(path)
    description = describe(compiled, options)
    program, c_source = render_program(description), render_c(description, path.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    # each file replaced whole (a full disk leaves the previous one), the program last: it is replaced only once
    # its kernels are in place
    write_cuda(description, path, build=False)
    write_text_atomically(path.with_suffix(".c"), c_source)
    write_text_atomically(path, program)
    return path


def write_text_atomically(path, text: str) -> None:
    """Write `text` (UTF-8) to `path` as checkpoints are written (`deepdsl_runtime.checkpoint.atomic_write`: into a
    temporary file beside it, fsynced, then renamed over it): a write that fails leaves the previous file whole."""
    from deepdsl_runtime.checkpoint import atomic_write

    data = text.encode("utf-8")
    atomic_write(str(path), lambda f: f.write(data))


def run_program(path, args: list[str]) -> int:
    """Run a generated program with the same Python interpreter until it ends; returns its exit status (128 + N
    when signal N ended it).

    On POSIX, called from the main thread, the program runs in a session of its own and this process relays the
    signals it receives: SIGINT, SIGTERM, SIGHUP and SIGQUIT go to the program exactly once each (a Ctrl-C in the
    terminal reaches the program through this process only, so a second Ctrl-C is the program's second signal), and
    this process waits for the program to end however long it takes to save its checkpoint; Ctrl-C before the
    program has started reaches it as soon as it exists. SIGTSTP (Ctrl-Z) stops the program and this process
    together; both continue on SIGCONT. None of these signals ends this process before the program has ended.
    Elsewhere the program runs in this process's group and receives the terminal's signals itself.
    """
    command = [sys.executable, str(path), *args]
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        try:
            return _exit_status(subprocess.call(command, env=program_env()))
        except KeyboardInterrupt:
            return 130
    with _Relay() as relay:
        # the program starts with the relayed signals blocked and unblocks them once its own handlers are set, so
        # a signal relayed while it starts waits for them instead of interrupting the interpreter's startup
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _Relay.FORWARDED)
        try:
            child = subprocess.Popen(command, env=program_env(), start_new_session=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        relay.attach(child)
        return _exit_status(relay.wait())


def _exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Relay:
    """While active, the signals of `run_program` go to `child` (those received before it exists wait for it)."""

    FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                      if hasattr(signal, name))
    POLL_SECONDS = 0.05       # how long a relayed signal may wait at most

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.pending: list[int] = []
        self._old: dict[int, object] = {}

    def __enter__(self) -> "_Relay":
        for sig in self.FORWARDED:
            self._old[sig] = signal.signal(sig, self._forward)
        if hasattr(signal, "SIGTSTP"):
            self._old[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, self._suspend)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False

    def attach(self, child: subprocess.Popen) -> None:
        self.child = child
        pending, self.pending = self.pending, []
        for sig in pending:
            self._send(sig)

    def wait(self) -> int:
        """The child's return code once it has ended. Waited for in short polls, never one blocking waitpid: a
        signal that another thread of this process took (numpy's BLAS threads, any thread not blocking it) only
        marks itself for the main thread, which runs the relaying handler when it next runs Python code, and a
        waitpid that nothing interrupts would hold it until the child had ended."""
        while True:
            try:
                return self.child.wait(timeout=self.POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass

    def _send(self, sig: int) -> None:
        if self.child is None:
            self.pending.append(sig)
            return
        try:
            self.child.send_signal(sig)           # a no-op once the child has been waited for
        except ProcessLookupError:
            pass

    def _forward(self, signum, frame) -> None:
        self._send(signum)

    def _suspend(self, signum, frame) -> None:
        """Stop the child (SIGTSTP would not stop it: its process group has no terminal), then this process; on
        SIGCONT, continue the child."""
        self._send(signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        try:
            os.kill(os.getpid(), signal.SIGTSTP)
        finally:
            signal.signal(signal.SIGTSTP, self._suspend)
            self._send(signal.SIGCONT)


def program_env(base: dict | None = None) -> dict:
    """The environment a generated program runs in: a copy of `base` (default: this process's environment). The
    program imports the runtime by its name, `deepdsl_runtime`, from wherever the package is installed (a source
    checkout installs it with `pip install -e .`), so the environment needs nothing added."""
    return dict(os.environ if base is None else base)
