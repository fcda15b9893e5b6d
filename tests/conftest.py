"""Shared test setup: the checkout's root importable (the `tests` helpers); golden files. The runtime is imported
as installed (`pip install -e ".[test]"`), as `deepdsl_runtime`."""
from __future__ import annotations

import difflib
import os
import pathlib
import sys

# numpy asks the kernel for transparent huge pages for every array of 4 MiB or more; each first touch of one then
# zeroes 2 MiB, and on the virtual machines the suite runs on that zeroing took more than half of a test's time (the
# tests allocate and free large arrays by the thousand: parameters initialized, tensors copied out). Off for this
# process and for the programs and ranks it starts (they read it when they import numpy): it changes no value.
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")

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


def _cores_of_this_worker() -> None:
    """A pytest-xdist worker runs on its own share of the cores (`-n auto`: one each). Two workers whose kernels
    each start a thread per core put two threads on every core, and each parallel pass then waits at its end for
    a thread the other worker's has descheduled. The programs and ranks a test starts inherit the share; a test that
    asks for threads still gets them (the results never depend on the thread count)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit() and hasattr(os, "sched_setaffinity")):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // int(count))
    first = int(worker[2:]) * share % len(cpus)
    os.sched_setaffinity(0, cpus[first:first + share])


def pytest_configure(config):
    _cores_of_this_worker()
    if os.environ["NUMPY_MADVISE_HUGEPAGE"] == "0" and "numpy" in sys.modules:    # (a plugin imported numpy first)
        import numpy as np

        core = getattr(np, "_core", None) or np.core          # (numpy 2, numpy 1)
        core.multiarray._set_madvise_hugepage(False)
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
