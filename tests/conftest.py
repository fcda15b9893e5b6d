"""Shared test setup: the checkout's root importable (the `tests` helpers); golden files. The runtime is imported
as installed (`pip install -e ".[test]"`), as `deepdsl_runtime`."""
from __future__ import annotations

import difflib
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


GOLDEN = ROOT / "tests" / "golden"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite the files under tests/golden/ with the current output instead of comparing")
    parser.addoption("--fake-gpu", action="store_true", default=False,
                     help="run the GPU tests on the host emulator of a GPU (tests/support/fake_pycuda.py), in this "
                          "process and in the programs it starts")


def pytest_configure(config):
    import os

    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI's mpiexec (a system one, found before the test extra's mpich) refuses to start ranks as root
        # unless both of these are set; MPICH ignores them. The programs and mpiexec the tests start inherit them.
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if config.getoption("--fake-gpu"):
        from tests.support.fake_pycuda import install_for_process

        install_for_process()
        os.environ["DEEPDSL_FAKE_GPU"] = "1"
        site = str(ROOT / "tests" / "support" / "fake_gpu_site")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture
def golden(request):
    """`golden(name, text)`: assert `text` equals tests/golden/<name> (a unified diff on failure), or rewrite the
    file when pytest runs with --update-golden."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = GOLDEN / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        if not path.exists():
            pytest.fail(f"{path} is missing; create it with: pytest {request.node.fspath} --update-golden")
        expected = path.read_text(encoding="utf-8")
        if text != expected:
            diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                                f"golden/{name}", "now", n=2))
            pytest.fail(f"output differs from golden/{name} (accept with --update-golden):\n{diff}", pytrace=False)

    return check


@pytest.fixture
def torch_float64():
    """PyTorch's default dtype float64 during a test, as it was afterwards (the operator tests compare in float64)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


STRIDE1_SCHEMES = ("columns", "widened", "kernel rows")


@pytest.fixture(params=STRIDE1_SCHEMES)
def stride1_scheme(request, monkeypatch):
    """Each scheme of a stride-1 convolution's input gradient in turn (where it applies; elsewhere the least
    costly), whichever the cost model would pick. Its value: `forced`, the scheme, and `ran`, those that ran."""
    import types

    from deepdsl_runtime.cpu import conv

    forced, ran = request.param, set()

    def scheme(*shape):
        costs = conv.stride1_costs(*shape)
        chosen = forced if forced in costs else min(costs, key=costs.get)
        ran.add(chosen)
        return chosen

    monkeypatch.setattr(conv, "stride1_scheme", scheme)
    return types.SimpleNamespace(forced=forced, ran=ran)
