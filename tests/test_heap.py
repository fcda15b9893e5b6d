"""The C library's heap on the CPU (runtime/cpu/heap.py): with glibc's mmap threshold fixed, a large array allocated
after a larger one was freed lies in a mapping of its own, which freeing returns to the system; with the threshold
left to rise, glibc takes it from its heap. Each case in a fresh interpreter."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

PROBE = """
import json, sys, numpy as np
from deepdsl_runtime.cpu import heap
took = heap.map_large_arrays() if sys.argv[1] == "fixed" else None
np.ones(24 << 18, np.float32)               # 24 MiB mapped, then freed: glibc's threshold rises to it
a = np.ones(4 << 18, np.float32)            # 4 MiB
start = a.__array_interface__["data"][0]
heap_ranges = [tuple(int(v, 16) for v in line.split()[0].split("-")) for line in open("/proc/self/maps")
               if line.rstrip().endswith("[heap]")]
print(json.dumps({"took": took, "in_heap": any(lo <= start < hi for lo, hi in heap_ranges)}))
"""


def _probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_large_arrays_get_mappings_of_their_own():
    assert _probe("rising") == {"took": None, "in_heap": True}
    assert _probe("fixed") == {"took": True, "in_heap": False}


def test_a_cpu_model_fixes_the_threshold(monkeypatch, tmp_path_factory):
    from deepdsl_runtime.cpu import heap
    from tests.test_memory_modes import program

    called = []
    monkeypatch.setattr(heap, "map_large_arrays", lambda: called.append(1) or True)
    _, model_cls = program("mlp", None, tmp_path_factory)
    model_cls("cpu", 0, "static", kernels="numpy")
    assert called == [1]
