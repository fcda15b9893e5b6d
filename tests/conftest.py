"""Shared test setup: make the runtime importable as `deepdsl_runtime` from a source checkout."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

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
