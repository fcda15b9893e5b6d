"""Code generation: a compiled network becomes a standalone Python training program.

`generate(compiled)` renders `codegen_templates/program.py.jinja` (StrictUndefined) with the network's
declarations, the memory plans of its steps as data (`memory_plans`: each buffer's arena offset and bytes) and the
bodies of its setup, training and test steps (built by `steps` from the SSA programs and their plans, one block per
statement under the IR statement as a comment, calls from the per-op snippets of `lowering`, elementwise kernels
from `ufuncs`, scratch sizes from the ops' `workspace` rules through the plan). The program imports only numpy and
`deepdsl_runtime`; its loop, CLI machinery, data, checkpoints and allocators are in `deepdsl_runtime`.

`python -m deepdsl.codegen.refresh` regenerates `generated/` from `networks/`.
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = ["CodegenOptions", "generate", "program_env", "run_program", "write_program"]

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
    """Identifies the compiled training step (statements, shapes, inputs): checkpoints carry it."""
    return hashlib.sha256(compiled.train.text().encode()).hexdigest()[:16]


def _display_source(compiled, options: CodegenOptions) -> str:
    if options.source:
        return options.source
    source = compiled.source or "<unknown>"
    if os.path.isabs(source):
        relative = os.path.relpath(source)
        source = source if relative.startswith("..") else relative
    return source.replace(os.sep, "/")


def _class_name(name: str) -> str:
    parts = [p for p in re.split(r"\W|_", name) if p]
    text = "".join(p[:1].upper() + p[1:] for p in parts) or "Network"
    return text if text.isidentifier() and not text[0].isdigit() else f"Net{text}"


def _init_text(init) -> str:
    if init.kind == "xavier":
        return "xavier"
    if init.kind == "gaussian":
        return f"gaussian({float(init.std)!r})"
    if init.kind == "constant":
        return f"constant({float(init.value)!r})"
    raise ValueError(f"unknown initializer {init}")


def _plan_data(name: str, program, plan) -> dict:
    """One step's plan as the template writes it (`rp.StepPlan`), with each buffer's value named in a comment."""
    from deepdsl.codegen.steps import DTYPES
    from deepdsl.memory_table import simulate_pool

    names = program.names()
    rows = []
    for b in plan.buffers:
        value = b.value
        label = names.get(id(value)) or value.name
        dims = "x".join(map(str, value.shape)) or "scalar"
        rows.append({"offset": b.offset, "nbytes": b.nbytes, "comment": f"{b.index}: {label} {dims} {DTYPES[value.dtype]}"})
    pool = simulate_pool(plan)
    # the pooled and dynamic modes allocate a buffer that takes over another like any other (see
    # deepdsl_runtime.memory): their peak is the pool replay's; written only where it differs from the plan's
    pool_peak = pool["peak_bytes_in_use"] if pool["peak_bytes_in_use"] != plan.peak_live_bytes else 0
    return {"name": name, "arena_bytes": plan.arena_bytes, "peak_bytes": plan.peak_live_bytes,
            "workspace_bytes": plan.workspace_bytes, "pool_bytes": pool["footprint_bytes"],
            "pool_peak": f", pool_peak_bytes={pool_peak}" if pool_peak else "", "buffers": rows}


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _options_text(compiled) -> str:
    opts = compiled.options
    shown = []
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name == "workspace_limit" or (f.metadata.get("header") == "when off" and value):
            continue
        if isinstance(value, bool):
            shown.append(f.name if value else f"no-{f.name}")
        else:
            shown.append(f"{f.name}={value}")
    return ", ".join(shown)


def _number(value: float) -> str:
    return repr(float(value))


def context(compiled, options: CodegenOptions | None = None) -> dict:
    """Everything the template needs, as plain data."""
    from deepdsl import __version__
    from deepdsl.codegen import steps
    from deepdsl.codegen.lowering import literal

    options = options or CodegenOptions()
    plans = {step: compiled.steps[step].plan for step in ("setup", "train", "test")}
    limit = plans["train"].workspace_limit
    solver = compiled.loop.solver
    inputs = {n.name: n for p in (compiled.train, compiled.test) for n in p.inputs}
    data = [n for n in inputs.values() if n.op == "input" and n.attr("role") == "data"]
    label = [n for n in inputs.values() if n.op == "input" and n.attr("role") == "label"]
    if len(data) != 1 or len(label) != 1:
        raise steps.GenerateError("a generated program needs exactly one image input and one label input")
    data, label = data[0], label[0]
    n_classes = _classes(compiled)
    optimizer = solver.optimizer
    hyper = ("lr", "momentum", "decay") if optimizer == "sgd" else ("lr", "bias1", "bias2", "decay")
    kernels = steps.Kernels()
    data_name, label_name = steps.identifier(data.name), steps.identifier(label.name)
    setup = steps.build_setup(compiled.setup, plans["setup"], kernels)
    bad = [n.name for n in compiled.setup.inputs if n.name in ("bias1", "bias2")]
    if bad:
        raise steps.GenerateError(f"values hoisted out of the step depend on {bad}, which change every step")
    train = steps.build_train(compiled.train, plans["train"], kernels, data_name, label_name, hyper)
    test = steps.build_test(compiled.test, plans["test"], kernels, data_name, label_name)
    memory_plans = [_plan_data(f"{step}_step" if step != "setup" else step, getattr(compiled, step), plans[step])
                    for step in ("setup", "train", "test")]
    train_plan, test_plan = memory_plans[1], memory_plans[2]
    memory_text = (f"peak {_mb(train_plan['peak_bytes'])} of tensors planned for the training step "
                   f"({_mb(test_plan['peak_bytes'])} testing); static arena "
                   f"{_mb(max(train_plan['arena_bytes'], test_plan['arena_bytes']))}, pool "
                   f"{_mb(max(train_plan['pool_bytes'], test_plan['pool_bytes']))}, workspace "
                   f"{_mb(max(p['workspace_bytes'] for p in memory_plans))}")
    optimizer_states = {f"{prefix}_{p.name}" for p in compiled.params for prefix in ("V", "M", "S")}
    if optimizer == "sgd":
        solver_text = (f"SGD, {solver.iters} iterations, lr {solver.lr:g}, momentum {solver.momentum:g}, "
                       f"decay {solver.decay:g}" + (f", gradient clipping at {solver.clip:g}" if solver.clip else ""))
    else:
        solver_text = (f"Adam, {solver.iters} iterations, lr {solver.lr:g}, betas {solver.betas}, eps {solver.eps:g}, "
                       f"decay {solver.decay:g}" + (f", gradient clipping at {solver.clip:g}" if solver.clip else ""))
    params = []
    for p in compiled.params:
        lm, dm = float(p.attr("lr_mult", 1.0)), float(p.attr("decay_mult", 1.0))
        mults = "" if (lm, dm) == (1.0, 1.0) else f", lr_mult={lm!r}, decay_mult={dm!r}"
        params.append({"name": p.name, "shape": literal(p.shape), "init": _init_text(p.attr("init")), "mults": mults})
    states = [{"name": s.name, "shape": literal(s.shape), "init": _init_text(s.attr("init")),
               "optimizer": s.name in optimizer_states} for s in compiled.states]
    return {
        "name": compiled.name,
        "cls": _class_name(compiled.name),
        "version": __version__,
        "source": _display_source(compiled, options),
        "options": _options_text(compiled) + "; workspace limit " + ("none" if limit is None else f"{limit} bytes"),
        "memory": memory_text,
        "memory_plans": memory_plans,
        "filename": f"{compiled.name}.py",
        "description": f"Train and test {compiled.name} (generated by deepdsl {__version__}).",
        "data": "x".join(map(str, data.shape)),
        "label": "x".join(map(str, label.shape)),
        "classes": n_classes,
        "dataset": data.attr("dataset") or "synthetic",
        "solver": solver_text,
        "structure_hash": structure_hash(compiled),
        "optimizer": optimizer,
        "betas": literal(tuple(float(b) for b in solver.betas)),
        "batch_shape": literal(data.shape),
        "params": params,
        "states": states,
        "setup_inputs": literal(tuple(n.name for n in compiled.setup.inputs if n.op == "input")),
        "steps": [setup, train, test],
        "kernels": kernels.items,
        "iters": solver.iters,
        "test_iters": solver.test_iters,
        "lr": _number(solver.lr),
        "momentum": _number(solver.momentum),
        "decay": _number(solver.decay),
        "params_file": options.params_file or f"{compiled.name}.params.npz",
    }


def _classes(compiled) -> int:
    """Number of classes: the width of the scores the test step's precision reads."""
    accuracy = dict(compiled.test.outputs)["accuracy"]
    for node in compiled.test.statements() + [accuracy]:
        if node.op == "precision":
            return node.inputs[0].shape[1]
    raise ValueError("the test step computes no precision")


def generate(compiled, options: CodegenOptions | None = None) -> str:
    """The source text of the standalone training program of `compiled` (a `deepdsl.Compiled`)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    return env.get_template("program.py.jinja").render(**context(compiled, options))


def write_program(compiled, path, options: CodegenOptions | None = None) -> Path:
    """Write the program of `compiled` to `path` (directories are created), and beside it its CUDA kernels
    (`<name>.cu`, see `deepdsl.codegen.cuda`); returns the path of the program."""
    from deepdsl.codegen.cuda import write_cuda

    path = Path(path)
    text = generate(compiled, options)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    write_cuda(compiled, path, options, build=False)
    return path


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
        relay.attach(subprocess.Popen(command, env=program_env(), start_new_session=True))
        return _exit_status(relay.child.wait())


def _exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Relay:
    """While active, the signals of `run_program` go to `child` (those received before it exists wait for it)."""

    FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                      if hasattr(signal, name))

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
