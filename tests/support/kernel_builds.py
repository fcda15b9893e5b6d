"""The runtime's kernels built with extra compiler flags (for another instruction set: `-mno-avx512f` for a processor
with AVX2 but not AVX-512), once per test run: the tests that compare such a build with the native one share it, in
every pytest-xdist worker (a build takes seconds, and several files ask for the same one)."""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from deepdsl.codegen.native import compile_command
from deepdsl_runtime.cpu import native

AVX2 = ("-mavx2", "-mfma", "-mno-avx512f")     # a processor with AVX2 and fused multiply-adds, no AVX-512


HAS_AVX512 = " avx512f" in native._processor()      # (its feature flags, as the libraries' digest names them)
# `--isa` of the benchmarks' runs: "avx2" restricts every side to AVX2, which is what "native" runs on a processor
# without AVX-512 (the same kernels, built again under other flags): run there only where the two differ
ISAS = ["native", pytest.param("avx2", marks=pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512 here: avx2 is "
                                                                                         "the native run"))]


def built(shared: Path, source: Path, *flags: str) -> Path:
    """The library of the C file `source` built with `flags` after the build's own, in `shared` (a directory every
    worker of the run sees), named by the source's text, the kernels' and the flags (`native.sources_digest`): built
    by the first test that asks, under a lock the others wait on, and renamed into place whole."""
    digest = hashlib.sha256(f"{native.sources_digest(source.read_text())} {' '.join(flags)}".encode()).hexdigest()
    target = shared / f"{source.stem}.{digest[:16]}.so"
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            done = subprocess.run(compile_command(source, partial) + list(flags), capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, done.stderr
            os.replace(partial, target)
    return target


def shared_directory(tmp_path_factory) -> Path:
    """A directory of this test run that every pytest-xdist worker sees (the parent of the workers' own)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kernel_builds"


def generic_kernels(tmp_path_factory, *flags: str) -> native.Native:
    """The runtime's generic kernels (kernels/cpu_ops.c) built with `flags`, loaded. AVX2's on a processor without
    AVX-512 are what `-march=native` builds there: the programs' own library of them (built where missing)."""
    source = native.KERNELS_DIR / native.GENERIC_SOURCE
    if flags == AVX2 and not HAS_AVX512:
        library, why = native._build(source, native.generic_library(source), native.find_compiler() or "cc")
        assert library is not None, why
        return native.Native(ctypes.CDLL(str(library)))
    return native.Native(ctypes.CDLL(str(built(shared_directory(tmp_path_factory), source, *flags))))
