"""Shared test setup: make the runtime importable as `deepdsl_runtime` from a source checkout; golden files."""
from __future__ import annotations

import difflib
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if "deepdsl_runtime" not in sys.modules:
    try:
        import deepdsl_runtime  # noqa: F401  (installed)
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "deepdsl_runtime", ROOT / "runtime" / "__init__.py", submodule_search_locations=[str(ROOT / "runtime")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["deepdsl_runtime"] = module
        spec.loader.exec_module(module)


GOLDEN = ROOT / "tests" / "golden"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite the files under tests/golden/ with the current output instead of comparing")


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
