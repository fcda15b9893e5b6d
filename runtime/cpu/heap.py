"""The C library's heap on the CPU: large arrays in mappings of their own, so that the memory of those freed goes
back to the system.

glibc's malloc takes an allocation of at least its mmap threshold from a mapping of its own, which `free` returns to
the system, and a smaller one from its heap, whose freed space the process mostly keeps. The threshold starts at
128 KiB and rises to the size of each mapped block freed, up to 32 MiB: after a program frees its first large
temporaries (initializing a layer's weights), later ones of up to that size come from the heap and stay in the
process's resident memory after they are freed. AlexNet at batch 16 on one thread: a peak RSS of 747 MiB with that
rising threshold, 717 MiB with it fixed at MAPPED_BYTES (its step's time unchanged: 1033 against 1033 ms)."""
from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3       # glibc's mallopt parameter (malloc.h)
MAPPED_BYTES = 1 << 20      # allocations from this size on in mappings of their own


def map_large_arrays() -> bool:
    """Fix the C library's mmap threshold at MAPPED_BYTES for the rest of the process (glibc's `mallopt`), which
    also ends its rise. True where it took; False where the C library has no such setting (nothing changed)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MAPPED_BYTES))
