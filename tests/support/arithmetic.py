"""Which kernels compute a step's floating-point results on this machine, so that a record of bits names them.

The bits of a step depend on the kernels that run it, not on the thread count (products are cut by their shapes,
`deepdsl_runtime.contract.product_cuts`): numpy's BLAS and the kernel it picks for this processor (OpenBLAS's
Haswell kernels round a product otherwise than its SkylakeX ones), numpy's own vector loops (the widest SIMD target it
dispatches to here) and the compiled C kernels (what the C compiler makes of -march=native: its version and the
processor it targets). Two machines with the same `description()` compute the same bits; a record made on another
holds within float32 tolerance only.
"""
from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import numpy as np

from deepdsl_runtime.cpu import native

__all__ = ["description"]

_VECTOR_FLAGS = ("-msse4.2", "-mavx", "-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw")


def _blas() -> str:
    """numpy's BLAS: OpenBLAS's configuration string (version and the kernel it chose), or numpy's own account."""
    for lib in native._openblas():
        for name in ("scipy_openblas_get_config64_", "scipy_openblas_get_config", "openblas_get_config64_",
                     "openblas_get_config"):
            getter = getattr(lib, name, None)
            if getter is not None:
                getter.restype = ctypes.c_char_p
                return " ".join(getter().decode(errors="replace").split())
    return "not OpenBLAS"


def _numpy_simd() -> str:
    """numpy's version and the SIMD targets of its vector loops this processor runs."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:       # numpy < 2
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    running = [target for target in __cpu_dispatch__ if __cpu_features__.get(target)]
    return f"numpy {np.__version__}: {' '.join(running) or 'baseline'}"


def _c_compiler() -> str:
    """The C compiler's version and the processor -march=native targets (its -march and vector width)."""
    from deepdsl.codegen.native import find_compiler

    compiler = find_compiler()
    if compiler is None:
        return "no C compiler"
    try:
        version = subprocess.run([compiler, "-dumpfullversion"], capture_output=True, text=True, timeout=30)
        target = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"{compiler}: {err}"
    chosen, vectors = {}, []
    for line in target.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("-march=", "-mprefer-vector-width="):
            chosen[parts[0].strip("-=")] = parts[1]
        elif len(parts) >= 2 and parts[0] in _VECTOR_FLAGS and parts[1] == "[enabled]":
            vectors.append(parts[0][2:])
    return " ".join([Path(compiler).name, version.stdout.strip(), *(f"{k}={v}" for k, v in sorted(chosen.items())),
                     *vectors])


@functools.cache
def description() -> dict[str, str]:
    """{"blas": ..., "numpy": ..., "c": ...}: the kernels computing a step's bits here."""
    return {"blas": _blas(), "numpy": _numpy_simd(), "c": _c_compiler()}
