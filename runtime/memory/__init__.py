"""Where a generated step gets its buffers: the memory plan the compiler baked into the program, served in one of
three modes, with the program's own measurement of what it used.

A generated step never creates arrays itself. Every tensor comes from `mem.tensor(index, shape, dtype)` (buffer
`index` of the step's plan; `over=j` when the plan lets it take over buffer j, which dies at that statement), the
batch from `mem.load(index, array)` (a buffer holding a copy of the array), every
op's scratch from `mem.workspace(nbytes)` (one region shared by all statements: a statement's scratch is dead
once its op returns), and `mem.free(*indices)` returns buffers where the compiler freed them. A step starts with
`mem = allocator.begin(step)` and ends with `mem.end()`, which returns what is still live (its outputs, once
read). The plan of each step is data in the generated file (`StepPlan`: the arena offset and exact bytes of each
buffer), so the program never imports the compiler.

Modes (`--memory-mode`):
- `static` (default): one arena, a host buffer of the largest planned `arena_bytes` of the steps, allocated once;
  buffer `index` is the bytes at its planned offset. Nothing is allocated at run time. A buffer that takes over
  another shares its bytes from the same offset, and the pair counts once, at the larger size, as in the plan.
- `pooled`: the runtime's first-fit `PoolAllocator` (`deepdsl_runtime.memory.first_fit`) over one chunk of the largest
  `pool_bytes` of the steps: the capacity the compiler found replaying the same allocations and frees on the same
  allocator (the "pooled" line of `deepdsl memory`), so the replay at run time always fits.
- `dynamic`: each tensor its own allocation, returned to the system at its free (large ones are memory mappings of
  their own), and each statement's workspace too: the lowest resident memory, and the slowest (fresh pages are
  zeroed by the system on first touch, at every step).
Neither of the last two can hand a buffer the bytes of the one it takes over (a pool cannot grow a block in place,
a separate allocation shares nothing), so there it is allocated like any other: their planned peak is
`pool_peak_bytes`, the pool replay's peak of bytes in use, which equals `peak_bytes` when no buffer takes over.

Measured, in every mode: the bytes handed out by `tensor` and `load`, each rounded up to `ALIGNMENT` as the plan
counts them (views and in-place results take none), their high-water mark per step (`Usage.peak_bytes`), and
the largest workspace handed out (`Usage.workspace_bytes`). In the pooled mode the peak is the pool's own counter.
Every buffer starts at a multiple of `ALIGNMENT` bytes in every mode, so kernels see the same alignment and the
modes compute bit-identical results.

`check=True` (the programs' `--check-memory`) verifies at run time what the plan promises: a buffer has the size
the statement asks for, it is not live already, a freed buffer was live, and (static) the planned offset lies in
the arena and overlaps no live buffer. A corrupted plan then fails loudly instead of computing garbage.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np

from deepdsl_runtime.contract import ALIGNMENT, placed_size
from deepdsl_runtime.memory.first_fit import HostPool, PoolExhausted

__all__ = ["ALIGNMENT", "MODES", "Allocator", "Dynamic", "MemoryPlanError", "Pooled", "Static", "StepPlan", "Usage",
           "allocator", "placed_size"]

MODES = ("static", "pooled", "dynamic")


def _aligned_bytes(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array of `nbytes` starting at an address that is a multiple of ALIGNMENT."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGNMENT
    return raw[shift:shift + nbytes]


MAPPED_BYTES = 1 << 16      # the dynamic mode maps allocations at least this large straight from the system


def _mapped_bytes(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of `nbytes` in its own anonymous memory mapping (page-aligned), unmapped as soon as
    the last array using it goes: its pages return to the system then, whatever the C allocator would keep."""
    if nbytes < MAPPED_BYTES:
        return _aligned_bytes(nbytes)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


class MemoryPlanError(RuntimeError):
    """A step asked for something its memory plan does not allow (only raised when checking, or when a pool is
    exhausted)."""


@dataclass(frozen=True)
class StepPlan:
    """One step's memory plan as a generated program carries it (see `deepdsl.memory_plan.MemoryPlan`).

    buffers: (arena offset, exact bytes) of each buffer, by index;
    arena_bytes: the static arena the offsets need; peak_bytes: the planned high-water mark of bytes allocated at
    once (each buffer counted at its placed size); workspace_bytes: the largest workspace of any statement;
    pool_bytes: the capacity a first-fit pool needs for this step's allocations and frees, in order;
    pool_peak_bytes: the peak when no buffer takes over another (the pooled and dynamic modes; 0: peak_bytes)."""

    buffers: tuple[tuple[int, int], ...] = ()
    arena_bytes: int = 0
    peak_bytes: int = 0
    workspace_bytes: int = 0
    pool_bytes: int = 0
    pool_peak_bytes: int = 0

    def planned_peak(self, mode: str) -> int:
        """The peak the allocator of `mode` must measure."""
        return self.peak_bytes if mode == "static" or not self.pool_peak_bytes else self.pool_peak_bytes


@dataclass
class Usage:
    """What a step measured: high-water mark of tensor bytes (placed sizes) and of workspace bytes handed out,
    over every run of the step; allocation and free counts of its last run."""

    peak_bytes: int = 0
    workspace_bytes: int = 0
    allocations: int = 0
    frees: int = 0
    runs: int = 0


class Allocator:
    """The calls a generated step makes; subclasses decide where bytes come from."""

    mode = ""

    def __init__(self, plans: dict[str, StepPlan], check: bool = False):
        self.plans = dict(plans)
        self.check = check
        self.usage: dict[str, Usage] = {}
        self.workspace_region = self._bytes(max((p.workspace_bytes for p in self.plans.values()), default=0))
        self._name = ""
        self._plan = StepPlan()
        self._persistent = False
        self._live: dict[int, int] = {}         # buffer index -> placed size
        self._credit: dict[int, int] = {}       # buffer index -> bytes it shares with a buffer it took over
        self._taken: dict[int, int] = {}        # buffer taken over -> the buffer that took it over
        self._current = self._peak = self._workspace = self._allocs = self._frees = 0
        self._sizes: dict[tuple, tuple[np.dtype, int, int]] = {}   # (shape, dtype) -> (dtype, bytes, placed bytes)

    # -- a step ------------------------------------------------------------------------------------------------
    def begin(self, step: str, persistent: bool = False) -> "Allocator":
        """Start running `step` with its plan. `persistent`: the step's values outlive it (the setup step, whose
        results are kept as the model's tensors), so each gets its own allocation whatever the mode."""
        for index in list(self._live):         # a step that raised never ended: its buffers are abandoned
            self._release(index)
        self._name, self._plan, self._persistent = step, self.plans[step], persistent
        self._live.clear()
        self._credit.clear()
        self._taken.clear()
        self._current = self._peak = self._workspace = self._allocs = self._frees = 0
        return self

    def end(self) -> None:
        """The step is over: everything still live is returned; the step's figures are recorded."""
        for index in list(self._live):
            self._release(index)
        usage = self.usage.setdefault(self._name, Usage())
        usage.peak_bytes = max(usage.peak_bytes, self._peak_bytes())
        usage.workspace_bytes = max(usage.workspace_bytes, self._workspace)
        usage.allocations, usage.frees, usage.runs = self._allocs, self._frees, usage.runs + 1
        self._name = ""

    # -- the calls of generated code ---------------------------------------------------------------------------
    def tensor(self, index: int, shape: tuple[int, ...], dtype: str, over: int | None = None) -> np.ndarray:
        """Buffer `index` of the plan as an uninitialized array of `shape` and `dtype`; `over`: the plan lets it
        take over that buffer's bytes (live, and released right after this statement)."""
        sizes = self._sizes.get((shape, dtype))
        if sizes is None:
            dt = np.dtype(dtype)
            nbytes = math.prod(shape) * dt.itemsize
            sizes = self._sizes[shape, dtype] = (dt, nbytes, placed_size(nbytes))
        dt, nbytes, size = sizes
        if self.check:
            self._check_request(index, nbytes, over)
        array = self._array(index, shape, dt, nbytes, size, over)
        self._live[index] = size
        self._allocs += 1
        self._current += size - self._credit.get(index, 0)
        if self._current > self._peak:
            self._peak = self._current
        return array

    def load(self, index: int, array: np.ndarray) -> np.ndarray:
        """Buffer `index` holding a copy of `array` (a batch input)."""
        buffer = self.tensor(index, array.shape, array.dtype)
        self._copy_in(buffer, array)
        return buffer

    def free(self, *indices: int) -> None:
        for index in indices:
            if index not in self._live:
                raise MemoryPlanError(f"step '{self._name}' frees buffer {index}, which is not live")
            self._release(index)
            self._frees += 1

    def workspace(self, nbytes: int) -> np.ndarray:
        """`nbytes` of the shared scratch region as float32 elements."""
        if nbytes > self.workspace_region.size:
            raise MemoryPlanError(f"step '{self._name}' asks for {nbytes} bytes of workspace; the plan has "
                               f"{self.workspace_region.size}")
        self._workspace = max(self._workspace, nbytes)
        return self._workspace_view(nbytes)

    # -- measurement ---------------------------------------------------------------------------------------------
    def report(self) -> dict:
        """Planned and measured figures of each step that ran, and the mode's reserved bytes."""
        steps = {}
        for name, usage in self.usage.items():
            plan = self.plans[name]
            steps[name] = {"peak_bytes_measured": usage.peak_bytes, "peak_bytes_planned": plan.planned_peak(self.mode),
                           "workspace_bytes_measured": usage.workspace_bytes,
                           "workspace_bytes_planned": plan.workspace_bytes, "arena_bytes": plan.arena_bytes,
                           "pool_bytes": plan.pool_bytes, "allocations": usage.allocations, "frees": usage.frees}
        return {"memory_mode": self.mode, "reserved_bytes": self.reserved_bytes, "steps": steps}

    @property
    def reserved_bytes(self) -> int:
        """Bytes this allocator holds for tensors between steps (the arena or the pool's chunk; 0 when dynamic)."""
        return 0

    # -- subclass hooks ------------------------------------------------------------------------------------------
    def _bytes(self, nbytes: int) -> np.ndarray:
        """`nbytes` of fresh memory starting at a multiple of ALIGNMENT (a device backend's allocators override
        this and `_copy_in` to hold their bytes on the device: deepdsl_runtime.cuda.ops)."""
        return _aligned_bytes(nbytes)

    def _copy_in(self, buffer, array: np.ndarray) -> None:
        np.copyto(buffer, array)

    def _array(self, index: int, shape: tuple[int, ...], dtype: np.dtype, nbytes: int, size: int,
               over: int | None) -> np.ndarray:
        """Buffer `index`'s bytes as the array `tensor` returns."""
        raw = self._bytes(nbytes) if self._persistent else self._take(index, nbytes, size, over)
        return raw[:nbytes].view(dtype).reshape(shape)

    def _take(self, index: int, nbytes: int, size: int, over: int | None) -> np.ndarray:
        raise NotImplementedError

    def _release(self, index: int) -> None:
        self._current -= self._live.pop(index) - self._credit.pop(index, 0)
        partner = self._taken.pop(index, None)
        if partner in self._live:               # the bytes the pair shared now count for the partner alone
            self._current += self._credit.pop(partner, 0)

    def _peak_bytes(self) -> int:
        return self._peak

    def _workspace_view(self, nbytes: int) -> np.ndarray:
        return self.workspace_region[:nbytes].view(np.float32)

    def _check_request(self, index: int, nbytes: int, over: int | None) -> None:
        buffers = self._plan.buffers
        if not 0 <= index < len(buffers):
            raise MemoryPlanError(f"step '{self._name}' asks for buffer {index}; its plan has {len(buffers)}")
        if buffers[index][1] != nbytes:
            raise MemoryPlanError(f"step '{self._name}': buffer {index} is planned for {buffers[index][1]} bytes, the "
                               f"statement asks for {nbytes}")
        if index in self._live:
            raise MemoryPlanError(f"step '{self._name}' allocates buffer {index}, which is live already")
        if over is not None and over not in self._live:
            raise MemoryPlanError(f"step '{self._name}': buffer {index} takes over buffer {over}, which is not live")


class Static(Allocator):
    """Buffers at their planned offsets in one arena, allocated once (the largest step's `arena_bytes`)."""

    mode = "static"

    def __init__(self, plans: dict[str, StepPlan], check: bool = False):
        super().__init__(plans, check)
        self.arena = self._bytes(max((p.arena_bytes for p in self.plans.values()), default=0))
        self._base = self.arena.ctypes.data
        self._views: dict[tuple, np.ndarray] = {}     # (step, index, shape, dtype) -> the array at its offset

    @property
    def reserved_bytes(self) -> int:
        return self.arena.size

    def _array(self, index, shape, dtype, nbytes, size, over):
        # a buffer is the same bytes at every run of its step: its array is made once and handed out again
        if self._persistent:
            return super()._array(index, shape, dtype, nbytes, size, over)
        if self.check:
            self._check_placement(index, self._plan.buffers[index][0], size, over)
        if over is not None:
            self._credit[index] = min(size, self._live[over])
            self._taken[over] = index
        key = (self._name, index, shape, dtype)
        array = self._views.get(key)
        if array is None:
            offset = self._plan.buffers[index][0]
            array = self._views[key] = self.arena[offset:offset + nbytes].view(dtype).reshape(shape)
        return array

    def _check_placement(self, index: int, offset: int, size: int, over: int | None) -> None:
        where = f"step '{self._name}': buffer {index} at [{offset}, {offset + size})"
        if offset % ALIGNMENT or offset < 0 or offset + size > self.arena.size:
            raise MemoryPlanError(f"{where} is not an aligned range of the {self.arena.size}-byte arena")
        if over is not None and self._plan.buffers[over][0] != offset:
            raise MemoryPlanError(f"{where} takes over buffer {over}, which starts at {self._plan.buffers[over][0]}")
        for other, other_size in self._live.items():
            if other == over:
                continue
            start = self._plan.buffers[other][0]
            if start < offset + size and offset < start + other_size:
                raise MemoryPlanError(f"{where} overlaps live buffer {other} at [{start}, {start + other_size})")
        if self.arena[offset:].ctypes.data != self._base + offset:
            raise MemoryPlanError(f"{where}: the arena view is not at its planned address")


class Pooled(Allocator):
    """Buffers from the runtime's first-fit pool over one chunk (the largest step's `pool_bytes`)."""

    mode = "pooled"

    def __init__(self, plans: dict[str, StepPlan], check: bool = False):
        super().__init__(plans, check)
        self.pool = self._make_pool(max((p.pool_bytes for p in self.plans.values()), default=0))
        self._offsets: dict[int, int] = {}

    def _make_pool(self, capacity: int) -> HostPool:
        """The first-fit pool over one chunk: `.allocator`, `.capacity`, `.view(offset, shape, dtype)`."""
        return HostPool(capacity)

    @property
    def reserved_bytes(self) -> int:
        return self.pool.capacity

    def begin(self, step, persistent=False):
        super().begin(step, persistent)
        self._offsets.clear()
        self.pool.allocator.reset_peak()
        return self

    def end(self):
        super().end()
        if self.check:
            self.pool.allocator.check()

    def _take(self, index, nbytes, size, over):
        try:
            offset = self.pool.allocator.alloc(nbytes)
        except PoolExhausted as err:
            raise MemoryPlanError(f"step '{self._name}', buffer {index}: {err}") from None
        self._offsets[index] = offset
        return self.pool.view(offset, (nbytes,), np.uint8)

    def _release(self, index):
        super()._release(index)
        offset = self._offsets.pop(index, None)
        if offset is not None:
            self.pool.allocator.free(offset)

    def _peak_bytes(self):
        # the pool's own high-water mark of bytes in use (what the allocator did); a persistent step bypasses it
        return self._peak if self._persistent else self.pool.allocator.stats.peak_bytes_in_use


class Dynamic(Allocator):
    """Each tensor its own allocation, dropped at its free (the step drops its names of the buffer too). Large
    ones are anonymous memory mappings, so freed memory leaves the process at once (the C allocator would keep
    much of it for reuse, and the resident memory would not fall)."""

    mode = "dynamic"

    def __init__(self, plans: dict[str, StepPlan], check: bool = False):
        super().__init__(plans, check)
        self.workspace_region = self._bytes(0)
        self._workspace_limit = max((p.workspace_bytes for p in self.plans.values()), default=0)

    def _bytes(self, nbytes):
        return _mapped_bytes(nbytes)

    def _take(self, index, nbytes, size, over):
        return self._bytes(nbytes)

    def workspace(self, nbytes):
        if nbytes > self._workspace_limit:
            raise MemoryPlanError(f"step '{self._name}' asks for {nbytes} bytes of workspace; the plan has "
                               f"{self._workspace_limit}")
        self._workspace = max(self._workspace, nbytes)
        return self._bytes(nbytes).view(np.float32)


def allocator(mode: str, plans: dict[str, StepPlan], check: bool = False) -> Allocator:
    """The allocator of `mode` ("static", "pooled" or "dynamic") serving steps with these plans."""
    classes = {"static": Static, "pooled": Pooled, "dynamic": Dynamic}
    if mode not in classes:
        raise ValueError(f"unknown memory mode '{mode}' (use {', '.join(MODES)})")
    return classes[mode](plans, check)
