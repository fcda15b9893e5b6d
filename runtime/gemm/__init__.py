"""Tiled multi-device GEMM on host matrices: the BLASX runtime (Wang et al., §IV).

``TiledGemm(devices, tile=1024, streams=4, policy="blasx")`` computes
``C = alpha op(A) op(B) + beta C`` in place on host numpy arrays, the way
cuBLAS-XT does: matrices stay on the host and tiles move to the devices.

``policy="blasx"`` (the design of the paper, with the parts its public code
left out):

* **Tasks.**  One task per output tile ``C[i, j]`` (it runs every ``k`` step);
  tasks are independent, so any device may run any task.
* **Global queue, demand driven.**  Tasks wait in one queue shared by all
  devices.  A device dequeues only when it needs work, so a faster device takes
  more tasks.  The queue walks C in bands of ``isqrt(streams)`` tile rows, column
  by column, so consecutive tasks form square blocks (with 4 streams a batch
  reads 2 A and 2 B tiles per step instead of 1 + 4 for a row of 4 tasks).
* **Reservation stations.**  Each device holds up to ``reservation`` (4) upcoming
  tasks.  To start a batch of up to ``streams`` tasks it repeatedly takes the RS
  task of highest priority and refills the slot from the queue; the RS then
  refills again, so waiting tasks stay visible to thieves while the batch runs.
* **Priority (eq. 3).**  ``sum_k f(A_ik) + f(B_kj)`` with ``f = 2`` for a tile in
  this device's L1 cache, ``1`` for one in a peer's (L2), ``0`` otherwise.  Tiles
  the batch being formed will load count as L1: it runs its tasks in lock step,
  so batch-mates share them.  Ties go to the older task.
* **Work stealing.**  A device whose RS is empty while the queue is empty steals
  the task its own priority favours from the fullest RS of another device.
* **Execution.**  A batch runs in lock step over ``k``: at each step every task
  (one per stream) acquires ``A_ik`` and ``B_kj`` from the tile store (L1, then a
  peer's L1, then the host) and enqueues its tile GEMM on its stream; readers are
  released when the stream has passed the kernel.  Accumulators are written
  back when the task completes.  On GPUs copies and kernels of different
  streams overlap.  Consecutive batches of a device walk k in alternating
  directions, so a batch starts with the tiles the previous one used last --
  the ones an LRU cache smaller than the working set still holds.

``policy="round_robin"`` is the cuBLAS-XT baseline: output tiles are assigned
statically, tile ``q`` (row-major) to device ``q mod n``; every tile is copied
from the host each time it is used and freed afterwards (no cache, no peers).

Every copy is counted (``TiledGemm.stats``, a ``GemmStats``).  For a ``T x T x T``
tile grid the round-robin baseline moves ``2 T^3 + [beta != 0] T^2`` tiles to the
devices and ``T^2`` back.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from deepdsl_runtime.gemm.cache import Aborted, Shared, TileStore
from deepdsl_runtime.gemm.devices import CpuDevice, blas_thread_limit
from deepdsl_runtime.gemm.tiles import GemmProblem, Task, TileKey, prepare_problem

__all__ = ["TiledGemm", "GemmStats", "CpuDevice", "CudaDevice", "POLICIES"]

POLICIES = ("blasx", "round_robin")


def __getattr__(name):
    # CudaDevice is importable from here, but its module is loaded on first use only.
    if name == "CudaDevice":
        from deepdsl_runtime.gemm.cuda_device import CudaDevice
        return CudaDevice
    raise AttributeError(name)


@dataclass(frozen=True)
class GemmStats:
    """Counters of one ``TiledGemm.gemm`` call (bytes are payload bytes of tiles)."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0
    h2d_tiles: int = 0
    d2h_tiles: int = 0
    d2d_tiles: int = 0
    d2d_bytes_by_pair: dict[tuple[int, int], int] = field(default_factory=dict)  # (src, dst) -> bytes
    cache_hits: int = 0  # A/B tile found in the device's own L1
    peer_hits: int = 0  # ... in a peer's L1 (L2 hit), copied device to device
    cache_misses: int = 0  # ... copied from the host
    evictions: int = 0
    tasks_per_device: tuple[int, ...] = ()
    steals: int = 0
    steals_per_device: tuple[int, ...] = ()
    peak_device_bytes: tuple[int, ...] = ()  # pool high-water mark per device
    seconds: float = 0.0

    @property
    def communication_bytes(self) -> int:
        """Everything that crossed a link: host to device, device to host, device to device."""
        return self.h2d_bytes + self.d2h_bytes + self.d2d_bytes


class _Run:
    """One call in flight: the problem, the shared state, the scheduler."""

    def __init__(self, problem: GemmProblem, shared: Shared, batch_sizes: list[int]) -> None:
        self.problem = problem
        self.shared = shared
        self.batch_sizes = batch_sizes
        self.errors: list[BaseException] = []
        self.scheduler = None


class _BlasxScheduler:
    """Global queue + reservation stations + priority + stealing (see module docstring)."""

    def __init__(self, run: _Run, tasks: list[Task], reservation: int) -> None:
        self.run = run
        self.shared = run.shared
        self.queue: deque[Task] = deque(tasks)
        self.reservation = reservation
        self.stations: list[list[Task]] = [[] for _ in self.shared.devices]
        self._keys: dict[Task, tuple[TileKey, ...]] = {}

    def keys(self, task: Task) -> tuple[TileKey, ...]:
        keys = self._keys.get(task)
        if keys is None:
            p = self.run.problem
            kt = p.grid[2]
            keys = tuple(p.a_key(task.i, k) for k in range(kt)) + tuple(p.b_key(k, task.j) for k in range(kt))
            self._keys[task] = keys
        return keys

    def priority(self, device: int, task: Task, lookahead: set[TileKey]) -> int:
        """Eq. 3: 2 per tile in this device's L1 (or loaded by the batch), 1 per tile in an L2 peer."""
        store = self.shared.stores[device]
        directory = self.shared.directory
        score = 0
        for key in self.keys(task):
            if key in lookahead or key in store.cache:
                score += 2
            elif store.peers and not store.peers.isdisjoint(directory.holders(key)):
                score += 1
        return score

    def _refill(self, device: int) -> None:
        station = self.stations[device]
        while len(station) < self.reservation and self.queue:
            station.append(self.queue.popleft())

    def _steal(self, thief: int, lookahead: set[TileKey]) -> bool:
        victims = [v for v, station in enumerate(self.stations) if v != thief and station]
        if not victims:
            return False
        victim = max(victims, key=lambda v: len(self.stations[v]))
        task = max(self.stations[victim], key=lambda t: (self.priority(thief, t, lookahead), -t.seq))
        self.stations[victim].remove(task)
        self.stations[thief].append(task)
        self.shared.stores[thief].counters.steals += 1
        return True

    def next_batch(self, device: int) -> list[Task]:
        with self.shared.lock:
            if self.shared.aborted:
                return []
            station = self.stations[device]
            batch: list[Task] = []
            lookahead: set[TileKey] = set()
            while len(batch) < self.run.batch_sizes[device]:
                self._refill(device)
                if not station and not self._steal(device, lookahead):
                    break
                best = max(station, key=lambda t: (self.priority(device, t, lookahead), -t.seq))
                station.remove(best)
                batch.append(best)
                lookahead.update(self.keys(best))
            self._refill(device)
            return batch


class _RoundRobinScheduler:
    """Static assignment: output tile ``q`` (row-major) goes to device ``q mod n``."""

    def __init__(self, run: _Run, tasks: list[Task]) -> None:
        self.run = run
        n = len(run.shared.devices)
        self.lists = [deque(t for t in tasks if t.seq % n == d) for d in range(n)]

    def next_batch(self, device: int) -> list[Task]:
        with self.run.shared.lock:
            if self.run.shared.aborted:
                return []
        own = self.lists[device]
        return [own.popleft() for _ in range(min(len(own), self.run.batch_sizes[device]))]


class TiledGemm:
    """``C = alpha op(A) op(B) + beta C`` on host arrays, tiled over several devices.

    ``devices``
        ``CpuDevice``/``CudaDevice`` objects, each used by one worker thread.
    ``tile``
        tile edge in elements; edge tiles are smaller (never padded).
    ``streams``
        tasks a device runs concurrently (one per stream); fewer when its memory
        cannot hold ``streams`` accumulators plus two operand tiles and a spare.
    ``policy``
        ``"blasx"`` or ``"round_robin"`` (the cuBLAS-XT baseline), see the module docstring.
    ``reservation``
        reservation-station slots per device (blasx).
    ``cache_bytes``
        optional cap on cached A/B bytes per device (default: all of its memory).
    ``peer_access``
        whether devices may read tiles from peers' caches (the L2 cache; blasx).
    """

    def __init__(self, devices, tile: int = 1024, streams: int = 4, policy: str = "blasx", *,
                 reservation: int = 4, cache_bytes: int | None = None, peer_access: bool = True):
        self.devices = list(devices)
        if not self.devices:
            raise ValueError("at least one device is needed")
        if len({id(d) for d in self.devices}) != len(self.devices):
            raise ValueError("a device may appear only once")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not isinstance(tile, (int, np.integer)) or tile < 1:
            raise ValueError(f"tile must be a positive int, got {tile!r}")
        if streams < 1 or reservation < 1:
            raise ValueError("streams and reservation must be >= 1")
        self.tile = int(tile)
        self.streams = int(streams)
        self.policy = policy
        self.reservation = int(reservation)
        self.cache_bytes = cache_bytes
        self.peer_access = peer_access
        self._stats = GemmStats(tasks_per_device=(0,) * len(self.devices))

    @property
    def stats(self) -> GemmStats:
        """Counters of the most recent ``gemm`` call."""
        return self._stats

    def gemm(self, transa, transb, alpha, A: np.ndarray, B: np.ndarray, beta, C: np.ndarray) -> None:
        """``C = alpha op(A) op(B) + beta C``; ``trans*`` is ``"N"``, ``"T"`` or ``"C"``.

        float32 or float64, one dtype for all three.  ``C`` is updated in place and
        is not read when ``beta == 0``.  As in BLAS, ``A`` and ``B`` are not read
        when ``alpha == 0`` or the inner dimension is empty.
        """
        problem, finish = prepare_problem(transa, transb, alpha, A, B, beta, C, self.tile)
        n_devices = len(self.devices)
        empty = GemmStats(tasks_per_device=(0,) * n_devices, steals_per_device=(0,) * n_devices,
                          peak_device_bytes=(0,) * n_devices)
        if problem.m == 0 or problem.n == 0:
            self._stats = empty
            return
        if problem.k == 0 or problem.alpha == 0:
            if problem.beta == 0:
                problem.c[...] = 0
            else:
                np.multiply(problem.c, problem.beta, out=problem.c)
            finish()
            self._stats = empty
            return
        limit = blas_thread_limit(self.devices)
        with _blas_threads(limit):
            self._stats = self._run(problem)
        finish()

    # -- one call ------------------------------------------------------------------------
    def _batch_size(self, device, problem: GemmProblem) -> int:
        pool = device.pool
        tile_bytes = pool.aligned_size(problem.max_tile_nbytes)
        scratch = device.scratch_bytes(problem)
        tiles = (pool.capacity - pool.bytes_in_use - scratch) // tile_bytes
        if tiles < 4:  # one accumulator, two operands and a spare against fragmentation
            need = 4 * tile_bytes + scratch
            raise ValueError(f"{device!r} has {pool.capacity - pool.bytes_in_use} bytes free; "
                             f"tile {self.tile} needs at least {need}")
        return min(self.streams, tiles - 3)

    def _run(self, problem: GemmProblem) -> GemmStats:
        devices = self.devices
        shared = Shared(problem, devices)
        blasx = self.policy == "blasx"
        for d, device in enumerate(devices):
            peers = ()
            if blasx and self.peer_access:
                peers = tuple(e for e, other in enumerate(devices) if e != d and device.can_access_peer(other))
            shared.stores.append(TileStore(d, shared, caching=blasx, cache_bytes=self.cache_bytes,
                                           peers=frozenset(peers)))
            device.pool.reset_peak()
        run = _Run(problem, shared, [self._batch_size(d, problem) for d in devices])
        # blasx queues tasks in bands of isqrt(streams) rows, walked column by column, so a
        # batch is a square block of C: with 4 streams it reads 2 A and 2 B tiles per step
        # (a 1 x 4 row of tasks would read 1 + 4).
        tasks = problem.tasks(band=math.isqrt(self.streams) if blasx else 1)
        run.scheduler = _BlasxScheduler(run, tasks, self.reservation) if blasx else _RoundRobinScheduler(run, tasks)

        start = time.perf_counter()
        threads = [threading.Thread(target=self._worker, args=(run, d), name=f"gemm-{device.name}", daemon=True)
                   for d, device in enumerate(devices)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        peaks = tuple(d.pool.stats.peak_bytes_in_use for d in devices)
        for store in shared.stores:
            store.drop_all()
        if run.errors:
            real = [e for e in run.errors if not isinstance(e, Aborted)]
            raise (real or run.errors)[0]
        return _collect(shared, peaks, seconds)

    def _worker(self, run: _Run, d: int) -> None:
        device = run.shared.devices[d]
        store = run.shared.stores[d]
        opened = False
        try:
            device.open(run.problem, self.streams)
            opened = True
            reverse = False
            while True:
                batch = run.scheduler.next_batch(d)
                if not batch:
                    break
                self._run_batch(run, store, device, batch, reverse)
                # Serpentine k order: the next batch starts with the tiles this one used
                # last, which LRU is most likely to still hold when the cache is small.
                reverse = not reverse
            store.finish()
        except BaseException as error:  # recorded and re-raised by the calling thread
            with run.shared.lock:
                run.shared.aborted = True
                run.errors.append(error)
                run.shared.released.notify_all()
            if opened:
                try:
                    store.finish()
                except BaseException:
                    pass
        finally:
            if opened:
                device.close()

    @staticmethod
    def _run_batch(run: _Run, store: TileStore, device, batch: list[Task], reverse: bool) -> None:
        """Run ``batch`` in lock step over k (descending if ``reverse``), task ``s`` on stream ``s``."""
        p = run.problem
        one = p.dtype.type(1)
        accumulators = [store.output(("C", t.i, t.j), s, load=p.beta != 0) for s, t in enumerate(batch)]
        kt = p.grid[2]
        for step in range(kt):
            k = kt - 1 - step if reverse else step
            for s, task in enumerate(batch):
                a = store.acquire(p.a_key(task.i, k), s)
                b = store.acquire(p.b_key(k, task.j), s)
                device.gemm(s, p.transa, p.transb, p.alpha, a.buf, b.buf, p.beta if step == 0 else one,
                            accumulators[s].buf)
                store.release([a, b], device.record(s))
            store.poll()
        for s, block in enumerate(accumulators):
            store.write_back(block, s)
        store.counters.tasks += len(batch)


def _collect(shared: Shared, peaks: tuple[int, ...], seconds: float) -> GemmStats:
    counters = [store.counters for store in shared.stores]
    pairs = {(src, dst): nbytes for dst, c in enumerate(counters) for src, nbytes in c.d2d_bytes_from.items()}
    return GemmStats(
        h2d_bytes=sum(c.h2d_bytes for c in counters),
        d2h_bytes=sum(c.d2h_bytes for c in counters),
        d2d_bytes=sum(pairs.values()),
        h2d_tiles=sum(c.h2d_tiles for c in counters),
        d2h_tiles=sum(c.d2h_tiles for c in counters),
        d2d_tiles=sum(c.d2d_tiles for c in counters),
        d2d_bytes_by_pair=pairs,
        cache_hits=sum(c.cache_hits for c in counters),
        peer_hits=sum(c.peer_hits for c in counters),
        cache_misses=sum(c.cache_misses for c in counters),
        evictions=sum(c.evictions for c in counters),
        tasks_per_device=tuple(c.tasks for c in counters),
        steals=sum(c.steals for c in counters),
        steals_per_device=tuple(c.steals for c in counters),
        peak_device_bytes=peaks,
        seconds=seconds,
    )


def _blas_threads(limit: int | None):
    """Limit BLAS threads for the call (process-wide; see ``blas_thread_limit``)."""
    if limit is None:
        return nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # without threadpoolctl, BLAS keeps its own thread count
        return nullcontext()
    return threadpool_limits(limits=limit, user_api="blas")
