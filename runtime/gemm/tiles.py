"""Tile geometry of one GEMM call: ``C = alpha op(A) op(B) + beta C``.

A ``GemmProblem`` slices the host matrices *virtually* (BLASX §IV-A): a task
is one output tile ``C[i, j]``, and the tiles it reads are named by ``TileKey``s
in the *storage* coordinates of A and B.  A transposed operand is never
transposed in memory: task ``(i, j)`` at step ``k`` reads the stored tile
``A[k, i]`` when ``transa`` and lets the tile kernel transpose it (§III-C), so
``A`` tiles are shared between tasks exactly as in the plain case.

Host matrices are normalised so that every tile is a 2-D view with unit stride
along its rows (what a pitched 2-D copy needs):

* a column-major operand ``X`` is replaced by ``X.T`` with its flag flipped;
* a column-major ``C`` turns the problem around: ``C.T = alpha op(B).T op(A).T
  + beta C.T``;
* anything else strided is copied to a contiguous array (for ``C``, the result
  is copied back when the call finishes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["TileKey", "Task", "GemmProblem", "prepare_problem", "parse_trans", "tile_count", "tile_span"]

TileKey = tuple[str, int, int]
"""``(matrix, tile_row, tile_col)`` with matrix ``"A"``, ``"B"`` or ``"C"``; storage coordinates."""

_TRANS = {"N": False, "T": True, "C": True}  # conjugation is the identity on real data


def parse_trans(flag) -> bool:
    """``"N"``/``"T"``/``"C"`` (any case) or a bool -> whether the operand is transposed."""
    if isinstance(flag, (bool, np.bool_)):
        return bool(flag)
    try:
        return _TRANS[str(flag).upper()]
    except KeyError:
        raise ValueError(f"transpose flag must be 'N', 'T' or 'C', got {flag!r}") from None


def tile_count(extent: int, tile: int) -> int:
    """Number of tiles along a dimension of ``extent`` elements (the last may be partial)."""
    return -(-extent // tile)


def tile_span(index: int, extent: int, tile: int) -> tuple[int, int]:
    """``[start, stop)`` of tile ``index`` along a dimension of ``extent``."""
    start = index * tile
    return start, min(start + tile, extent)


@dataclass(frozen=True, slots=True)
class Task:
    """Compute the output tile ``C[i, j]`` (all ``k`` steps); ``seq`` is its queue position."""

    i: int
    j: int
    seq: int


@dataclass(frozen=True)
class GemmProblem:
    """A normalised GEMM on host arrays with unit inner stride; see the module docstring."""

    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    transa: bool
    transb: bool
    alpha: float
    beta: float
    tile: int

    @property
    def m(self) -> int:
        return self.c.shape[0]

    @property
    def n(self) -> int:
        return self.c.shape[1]

    @property
    def k(self) -> int:
        return self.a.shape[0] if self.transa else self.a.shape[1]

    @property
    def dtype(self) -> np.dtype:
        return self.c.dtype

    @property
    def grid(self) -> tuple[int, int, int]:
        """Tiles along ``(m, n, k)``."""
        return tile_count(self.m, self.tile), tile_count(self.n, self.tile), tile_count(self.k, self.tile)

    def tasks(self, band: int = 1) -> list[Task]:
        """One task per output tile, in bands of ``band`` tile rows walked column by column
        (``band=1``: row-major); ``seq`` is the position in this order."""
        mt, nt, _ = self.grid
        order = [(i, j) for r0 in range(0, mt, band) for j in range(nt) for i in range(r0, min(r0 + band, mt))]
        return [Task(i, j, seq) for seq, (i, j) in enumerate(order)]

    def a_key(self, i: int, k: int) -> TileKey:
        """The stored A tile holding ``op(A)[i, k]``."""
        return ("A", k, i) if self.transa else ("A", i, k)

    def b_key(self, k: int, j: int) -> TileKey:
        """The stored B tile holding ``op(B)[k, j]``."""
        return ("B", j, k) if self.transb else ("B", k, j)

    def matrix(self, name: str) -> np.ndarray:
        return {"A": self.a, "B": self.b, "C": self.c}[name]

    def host_view(self, key: TileKey) -> np.ndarray:
        """The host tile named by ``key`` (a view, unit inner stride)."""
        name, r, c = key
        x = self.matrix(name)
        r0, r1 = tile_span(r, x.shape[0], self.tile)
        c0, c1 = tile_span(c, x.shape[1], self.tile)
        return x[r0:r1, c0:c1]

    def tile_shape(self, key: TileKey) -> tuple[int, int]:
        name, r, c = key
        rows, cols = self.matrix(name).shape
        r0, r1 = tile_span(r, rows, self.tile)
        c0, c1 = tile_span(c, cols, self.tile)
        return r1 - r0, c1 - c0

    def tile_nbytes(self, key: TileKey) -> int:
        rows, cols = self.tile_shape(key)
        return rows * cols * self.dtype.itemsize

    @property
    def max_tile_nbytes(self) -> int:
        """Bytes of the largest tile of any operand (a full ``tile x tile`` one, or smaller)."""
        shapes = [x.shape for x in (self.a, self.b, self.c)]
        rows = max(min(s[0], self.tile) for s in shapes)
        cols = max(min(s[1], self.tile) for s in shapes)
        return rows * cols * self.dtype.itemsize


def _unit_inner_stride(x: np.ndarray, trans: bool) -> tuple[np.ndarray, bool]:
    """``(x', trans')`` with ``op'(x') == op(x)`` and ``x'`` of unit stride along rows."""
    item = x.dtype.itemsize
    if x.shape[1] <= 1 or x.strides[1] == item:
        return x, trans
    if x.shape[0] <= 1 or x.strides[0] == item:
        return x.T, not trans
    return np.ascontiguousarray(x), trans


def _overlap(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether two arrays share memory (when the exact answer is too costly, assume they do)."""
    if not np.may_share_memory(x, y):
        return False
    try:
        return np.shares_memory(x, y, max_work=100_000)
    except np.exceptions.TooHardError:
        return True


def prepare_problem(transa, transb, alpha, a, b, beta, c, tile: int) -> tuple[GemmProblem, Callable[[], None]]:
    """Validate a GEMM call and normalise it; also return a function to run after it.

    The returned function copies the result back into the caller's ``c`` when a
    contiguous temporary had to be used (only for a ``c`` strided in both axes).
    """
    transa, transb = parse_trans(transa), parse_trans(transb)
    if not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    for name, x in (("A", a), ("B", b), ("C", c)):
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise TypeError(f"{name} must be a 2-D numpy array")
    dtype = c.dtype
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"only float32 and float64 are supported, C is {dtype}")
    if a.dtype != dtype or b.dtype != dtype:
        raise TypeError(f"A, B and C must share one dtype, got {a.dtype}, {b.dtype}, {c.dtype}")
    if not c.flags.writeable:
        raise ValueError("C must be writeable: it is updated in place")
    m, ka = (a.shape[1], a.shape[0]) if transa else a.shape
    kb, n = (b.shape[1], b.shape[0]) if transb else b.shape
    if ka != kb or c.shape != (m, n):
        raise ValueError(
            f"shape mismatch: op(A) is {m}x{ka}, op(B) is {kb}x{n}, C is {c.shape[0]}x{c.shape[1]}")
    for name, x in (("A", a), ("B", b)):
        if _overlap(c, x):
            raise ValueError(f"C overlaps {name}: the output must not alias an input")

    finish: Callable[[], None] = lambda: None
    item = dtype.itemsize
    if not (c.shape[1] <= 1 or c.strides[1] == item):
        if c.shape[0] <= 1 or c.strides[0] == item:
            # Column-major C: compute C.T = op(B).T op(A).T instead.
            a, b, transa, transb, c = b, a, not transb, not transa, c.T
        else:
            target, c = c, np.ascontiguousarray(c)

            def finish() -> None:
                target[...] = c
    a, transa = _unit_inner_stride(a, transa)
    b, transb = _unit_inner_stride(b, transb)
    problem = GemmProblem(a, b, c, transa, transb, dtype.type(alpha), dtype.type(beta), int(tile))
    return problem, finish
