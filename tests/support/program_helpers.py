"""Shared by the tests of generated programs: compile a network into a program file, import it, run its CLI."""
from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import deepdsl
from deepdsl.codegen import program_env, write_program
from deepdsl.dsl import Overrides

ROOT = Path(__file__).resolve().parents[2]
NETWORKS = ROOT / "networks"
_modules = itertools.count()


def compile_program(network: str | Path, directory: Path, batch: int | None = None,
                    image: tuple[int, int] | None = None, options: deepdsl.CompileOptions | None = None):
    """(compiled, path of the generated program) for a network file (a name in networks/ or a path), compiled
    with `options` (default: the default compile options)."""
    path = Path(network)
    if not path.suffix:
        path = NETWORKS / f"{network}.py"
    compiled = deepdsl.compile(deepdsl.load(str(path), Overrides(batch=batch, image=image)),
                               options or deepdsl.CompileOptions())
    target = Path(directory) / f"{compiled.name}.py"
    write_program(compiled, target)
    return compiled, target


def import_program(path: Path):
    """The generated program as a module (it imports only numpy and deepdsl_runtime)."""
    spec = importlib.util.spec_from_file_location(f"generated_program_{next(_modules)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_class(module):
    from deepdsl_runtime.program import model_class as defined
    return defined(module)


def run_cli(program: Path, *args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a generated program as its users do: a separate Python process."""
    env = program_env()
    env.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.run([sys.executable, str(program), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(cwd) if cwd else None)


def popen_cli(program: Path, *args: str, cwd: Path | None = None) -> subprocess.Popen:
    env = program_env()
    return subprocess.Popen([sys.executable, str(program), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=str(cwd) if cwd else None)


def wait_for(condition, seconds: float, what: str) -> None:
    """Poll `condition` until it holds; fail, naming `what` was awaited, after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def logged(log: Path) -> bool:
    """Whether a run's `--log` has an entry: the run has done an iteration."""
    return log.is_file() and bool(log.read_text().strip())


__all__ = ["ROOT", "NETWORKS", "compile_program", "import_program", "model_class", "run_cli", "popen_cli", "os",
           "wait_for", "logged"]


ZERO_GRADIENT = 1e-3     # an update is measured against at least this fraction of the largest update


def rel_err(a, b, floor: float = 0.0) -> float:
    """||a - b|| / ||b|| in float64, measured against at least `floor`; ||a|| where both are zero."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.linalg.norm(b)), floor)
    return float(np.linalg.norm(a - b) / scale) if scale else float(np.linalg.norm(a))


def relative_errors(got: dict, expected: dict, updates=lambda key: True) -> list[tuple[str, float]]:
    """||got[k] - expected[k]|| / ||expected[k]|| for every key of `got`, worst first. The keys `updates` names
    (gradients, parameters' changes) are measured against at least ZERO_GRADIENT times the largest of them: some
    gradients are zero in exact arithmetic (the bias of a batch norm whose output reaches the loss only through a
    convolution and another batch norm, which removes any shift: MobileNet-v2's projections), and both sides then
    hold only rounding noise."""
    norms = [np.linalg.norm(np.asarray(expected[k], np.float64)) for k in got if updates(k)]
    floor = ZERO_GRADIENT * max(norms, default=0.0)
    errors = []
    for key, value in got.items():
        error = rel_err(value, expected[key], floor if updates(key) else 0.0)
        errors.append((key, np.inf if np.isnan(error) else error))           # a NaN is the worst error
    return sorted(errors, key=lambda kv: -kv[1])
