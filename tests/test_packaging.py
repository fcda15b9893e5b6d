"""`pip install .` (not editable) into a fresh virtual environment gives a working compiler and runtime."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    home = tmp_path_factory.mktemp("venv")
    # the fresh environment sees the system's numpy/sympy/... so the test needs no downloads for them
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(home)
    python = home / "bin" / "python"
    source = home / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", ".deepdsl", "*.npz", ".pytest_cache", ".hypothesis"))
    isolation = [] if importlib.util.find_spec("wheel") is None else ["--no-build-isolation"]
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                             "--no-deps", *isolation, str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    shutil.rmtree(source)          # nothing may depend on the source tree any more
    return home


def test_installed_compiler_and_runtime_work_without_the_source_tree(installed, tmp_path):
    bindir = installed / "bin"
    network = tmp_path / "mlp.py"
    shutil.copy(ROOT / "networks" / "mlp.py", network)
    out = tmp_path / "mlp_program.py"
    result = subprocess.run([str(bindir / "deepdsl"), "compile", str(network), "--batch", "8", "-o", str(out)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = tmp_path / "report.json"
    result = subprocess.run([str(bindir / "python"), str(out), "--iters", "2", "--data", "synthetic", "--quiet",
                             "--params", str(tmp_path / "p.npz"), "--report-json", str(report)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["network"] == "mlp" and data["iterations"] == 2 and data["loss"] > 0
    # the program imports the installed runtime, never the compiler
    probe = subprocess.run([str(bindir / "python"), "-c",
                            "import deepdsl_runtime, deepdsl, os; print(deepdsl_runtime.__file__); "
                            "print(os.path.isfile(os.path.join(os.path.dirname(deepdsl.__file__), "
                            "'codegen_templates', 'program.py.jinja')))"],
                           capture_output=True, text=True, cwd=tmp_path)
    lines = probe.stdout.split()
    assert str(installed) in lines[0] and lines[1] == "True"
    assert "import deepdsl\n" not in out.read_text() and "from deepdsl import" not in out.read_text()
