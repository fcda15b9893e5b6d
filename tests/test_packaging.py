"""`pip install .` (not editable) into a fresh virtual environment gives a working compiler and runtime."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what runs in the fresh environment must not see a PYTHONPATH that points into a source tree
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _site_dirs():
    """The site-packages directories of the environment running the tests (a virtualenv's or the system's)."""
    dirs = site.getsitepackages()
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    home = tmp_path_factory.mktemp("venv")
    # A fresh environment of the base interpreter, without its site-packages: when the tests run in a virtualenv,
    # `system_site_packages` would mean the base interpreter's packages, not the ones the tests were installed with.
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    # The dependencies (numpy, sympy, ...) come from the test environment's site-packages, so nothing is downloaded.
    # A .pth file only appends those directories to sys.path: they come after the fresh environment's own
    # site-packages, and the .pth files in them (the editable install of the source tree among them) are not run.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, env=CLEAN_ENV).stdout.strip()
    Path(purelib, "_test_environment.pth").write_text("".join(d + "\n" for d in _site_dirs()))
    source = home / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", ".deepdsl", "*.npz", ".pytest_cache", ".hypothesis"))
    # Build the wheel with this interpreter, whose environment is the one checked for the build backend (the test
    # extra installs setuptools and wheel), then install the wheel file, which needs no build backend, into the
    # fresh environment. Without setuptools and wheel here, pip builds in an isolated environment instead.
    have_backend = all(importlib.util.find_spec(name) is not None for name in ("setuptools", "wheel"))
    wheels = home / "wheels"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                             *(["--no-build-isolation"] if have_backend else []), "--wheel-dir", str(wheels),
                             str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    wheel, = wheels.glob("deepdsl-*.whl")
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                             "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, env=CLEAN_ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    shutil.rmtree(source)          # nothing may depend on the source tree any more
    shutil.rmtree(wheels)
    return home


def test_installed_compiler_and_runtime_work_without_the_source_tree(installed, tmp_path):
    bindir = installed / "bin"
    network = tmp_path / "mlp.py"
    shutil.copy(ROOT / "networks" / "mlp.py", network)
    out = tmp_path / "mlp_program.py"
    result = subprocess.run([str(bindir / "deepdsl"), "compile", str(network), "--batch", "8", "-o", str(out)],
                            capture_output=True, text=True, cwd=tmp_path, env=CLEAN_ENV)
    assert result.returncode == 0, result.stderr
    report = tmp_path / "report.json"
    result = subprocess.run([str(bindir / "python"), str(out), "--iters", "2", "--data", "synthetic", "--quiet",
                             "--params", str(tmp_path / "p.npz"), "--report-json", str(report)],
                            capture_output=True, text=True, cwd=tmp_path, env=CLEAN_ENV)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["network"] == "mlp" and data["iterations"] == 2 and data["loss"] > 0
    # the program imports the installed runtime, never the compiler
    probe = subprocess.run([str(bindir / "python"), "-c",
                            "import deepdsl_runtime, deepdsl, os; "
                            "print(deepdsl_runtime.__file__); print(deepdsl.__file__); "
                            "print(os.path.isfile(os.path.join(os.path.dirname(deepdsl.__file__), "
                            "'codegen_templates', 'program.py.jinja')))"],
                           capture_output=True, text=True, cwd=tmp_path, env=CLEAN_ENV)
    lines = probe.stdout.split()
    assert str(installed) in lines[0] and str(installed) in lines[1] and lines[2] == "True"
    assert "import deepdsl\n" not in out.read_text() and "from deepdsl import" not in out.read_text()
