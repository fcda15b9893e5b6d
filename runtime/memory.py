"""Where a generated step gets its buffers: one allocator object with `empty(shape, dtype)`, `free(*buffers)`,
`workspace(count)` and `reset()`.

A generated step never creates arrays itself; every value and every op's scratch space comes from the allocator
passed to it, in the order the compiler wrote the statements. That makes the allocator the single place a memory
plan plugs in: an arena with planned offsets answers the same calls. Scratch space (`workspace`) is one region
shared by all statements, as the memory plan models it: a statement's scratch is dead once its op returns.

- `Heap`: a fresh `np.empty` per request; `free` is a no-op and Python frees the array when its last reference
  goes. Used for values that must outlive a step (hoisted values computed once by the setup program).
- `Recycler`: keeps the buffers of finished steps and hands them out again to requests of the same shape and
  dtype. A step makes the same requests in the same order every time, so from the second step on no memory is
  allocated and no page is touched for the first time. `free` returns a buffer early (when the program frees it),
  `reset` returns everything handed out since the last reset (end of a step).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

__all__ = ["Heap", "Recycler"]


class Heap:
    """A new array per request."""

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def workspace(self, count: int) -> np.ndarray:
        return np.empty(count, dtype=np.float32)

    def free(self, *buffers: np.ndarray) -> None:
        pass

    def reset(self) -> None:
        pass


class Recycler:
    """Buffers reused across steps, matched by shape and dtype (no planning, no fragmentation)."""

    def __init__(self):
        self._free: dict[tuple, list[np.ndarray]] = defaultdict(list)
        self._lent: dict[int, tuple[tuple, np.ndarray]] = {}
        self._scratch = np.empty(0, dtype=np.float32)
        self.bytes_allocated = 0          # total size of every buffer this allocator ever created

    def workspace(self, count: int) -> np.ndarray:
        """`count` float32 elements of the scratch region (grown to the largest request, never shrunk)."""
        if count > self._scratch.size:
            self.bytes_allocated += 4 * (count - self._scratch.size)
            self._scratch = np.empty(count, dtype=np.float32)
        return self._scratch[:count]

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        pool = self._free[key]
        if pool:
            buf = pool.pop()
        else:
            buf = np.empty(shape, dtype=dtype)
            self.bytes_allocated += buf.nbytes
        self._lent[id(buf)] = (key, buf)
        return buf

    def free(self, *buffers: np.ndarray) -> None:
        for buf in buffers:
            entry = self._lent.pop(id(buf), None)
            if entry is None:
                raise ValueError("freeing a buffer this allocator did not lend (or freeing it twice)")
            self._free[entry[0]].append(entry[1])

    def reset(self) -> None:
        for key, buf in self._lent.values():
            self._free[key].append(buf)
        self._lent.clear()

    @property
    def lent(self) -> int:
        """Number of buffers handed out and not yet returned."""
        return len(self._lent)
