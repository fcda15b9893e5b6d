"""`cuda_device.CUBLAS_PROTOTYPES` (the ctypes binding of cuBLAS) against a real cuBLAS header and library.

- (a) When a `cublas_api.h` can be found -- `$DEEPDSL_CUBLAS_INCLUDE` (its directory or the file), the nvidia
  wheels' `nvidia/cu13/include` or `nvidia/cublas/include` on `sys.path`, `$CUDA_HOME/include`,
  `$CUDA_PATH/include`, `/usr/local/cuda/include` -- every function of the table is declared there with the same
  parameters (C types and names, in order) and returns `cublasStatus_t`, and each ctypes type passes what the C
  type is (an int enum as c_int, `long long int` as c_longlong, pointers as pointers).
- (b) When a real libcublas loads (`cuda_device.cublas_library_candidates()`), it has every function of the table,
  and `Cublas.create_handle` either makes a handle (a GPU is there) or, without a GPU, raises `CublasError` -- in a
  subprocess, so a crash would show as one.
- (c) Everywhere: the fake cuBLAS of the tests without a GPU (tests/support/fake_pycuda.py) implements the same prototypes.

(a) and (b) skip where no CUDA toolkit or nvidia-cublas wheel is installed, as in CI; both have been run against
the nvidia-cublas 13.10 wheel. To run them against the wheel unpacked at DIR (DIR/nvidia/cu13/{include,lib}):
`DEEPDSL_CUBLAS_INCLUDE=DIR/nvidia/cu13/include PYTHONPATH=DIR python -m pytest tests/test_cublas_binding.py`.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepdsl_runtime.cuda.driver import CUBLAS_PROTOTYPES, CUBLAS_STATUS, cublas_library_candidates

ROOT = Path(__file__).resolve().parents[1]


def find_cublas_header() -> Path | None:
    """The first cublas_api.h of the places named in the module docstring."""
    places = []
    if os.environ.get("DEEPDSL_CUBLAS_INCLUDE"):
        given = Path(os.environ["DEEPDSL_CUBLAS_INCLUDE"])
        places.append(given if given.suffix == ".h" else given / "cublas_api.h")
    for base in sys.path:
        places += [Path(base or ".") / "nvidia" / sub / "include" / "cublas_api.h" for sub in ("cu13", "cublas")]
    for home in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        places.append(Path(home) / "include" / "cublas_api.h")
    return next((p for p in places if p.is_file()), None)


def header_prototypes(text: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """name -> (return type, [(C type, parameter name)]) of every `CUBLASWINAPI` function declared in the header."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    found = {}
    for match in re.finditer(r"(\w+)\s+CUBLASWINAPI\s+(\w+)\s*\(([^)]*)\)\s*;", text):
        params = []
        for param in match.group(3).split(","):
            declaration = " ".join(param.replace("*", " * ").split())
            if declaration in ("", "void"):
                continue
            ctype, name = declaration.rsplit(" ", 1)
            params.append((ctype.replace(" *", "*"), name))
        found[match.group(2)] = (match.group(1), params)
    return found


# What each C type of the table may be passed as through ctypes (the same size and kind in the C ABI).
_OPAQUE_POINTERS = {"cublasHandle_t", "cudaStream_t"}
_SCALARS = {"int": ctypes.c_int, "long long int": ctypes.c_longlong, "cublasOperation_t": ctypes.c_int}


def _passes_as(c_type: str, ctype) -> bool:
    if c_type in _SCALARS:
        return ctype is _SCALARS[c_type]
    if c_type in _OPAQUE_POINTERS:
        return ctype is ctypes.c_void_p
    if c_type.endswith("*"):
        pointee = c_type[:-1].replace("const ", "").strip()
        allowed = {"float": ctypes.c_float, "double": ctypes.c_double, "cublasHandle_t": ctypes.c_void_p}
        return ctype is ctypes.c_void_p or ctype is ctypes.POINTER(allowed[pointee])
    return False


def test_table_ctypes_match_their_c_types():
    for name, params in CUBLAS_PROTOTYPES.items():
        for c_type, param, ctype in params:
            assert _passes_as(c_type, ctype), (name, param, c_type, ctype)
    assert CUBLAS_STATUS == ("cublasStatus_t", ctypes.c_int)


def test_the_fake_cublas_has_the_same_prototypes():
    from tests.support.fake_pycuda import CUBLAS_HEADER_PROTOTYPES

    assert set(CUBLAS_HEADER_PROTOTYPES) == set(CUBLAS_PROTOTYPES)
    for name, params in CUBLAS_PROTOTYPES.items():
        assert tuple(ctype for _, _, ctype in params) == CUBLAS_HEADER_PROTOTYPES[name], name


def test_table_matches_the_cublas_header():
    header = find_cublas_header()
    if header is None:
        pytest.skip("no cublas_api.h (set DEEPDSL_CUBLAS_INCLUDE, or install a CUDA toolkit or nvidia-cublas)")
    declared = header_prototypes(header.read_text(errors="replace"))
    assert len(declared) > 100, f"{header}: the declarations were not recognised"
    for name, params in CUBLAS_PROTOTYPES.items():
        assert name in declared, f"{name} is not declared in {header}"
        returns, header_params = declared[name]
        assert returns == CUBLAS_STATUS[0], (name, returns)
        assert [(c_type, param) for c_type, param, _ in params] == header_params, (name, header_params)
    enum = re.search(r"typedef\s+enum\s*\{([^}]*)\}\s*cublasOperation_t", header.read_text(errors="replace"))
    assert enum and re.search(r"CUBLAS_OP_N\s*=\s*0", enum.group(1)) and re.search(r"CUBLAS_OP_T\s*=\s*1",
                                                                                    enum.group(1))


_PROBE = """
import json, sys
from deepdsl_runtime.cuda import driver as cuda_device
try:
    cublas = cuda_device.Cublas()
except OSError as err:
    print(json.dumps({"loaded": None, "error": str(err)}))
    sys.exit(0)
result = {"loaded": cublas.path,
          "symbols": sorted(n for n in cuda_device.CUBLAS_PROTOTYPES if hasattr(cublas.lib, n))}
try:
    handle = cublas.create_handle()
    cublas.destroy_handle(handle)
    result["handle"] = True
except cuda_device.CublasError as err:
    result["handle"] = str(err)
print(json.dumps(result))
"""


def test_a_real_libcublas_has_the_functions_and_fails_cleanly_without_a_gpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, f"the cuBLAS probe crashed ({done.returncode}):\n{done.stderr}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["loaded"] is None:
        pytest.skip(f"no libcublas loads ({', '.join(cublas_library_candidates()[:3])}, ...)")
    assert result["symbols"] == sorted(CUBLAS_PROTOTYPES), result
    if result["handle"] is not True:                     # no GPU: an error status, not a crash
        assert result["handle"].startswith("cublasCreate failed with cublasStatus_t "), result
