"""Tile residency for the tiled GEMM: the L1/L2 tile caches of BLASX (§IV-B).

Each device keeps its tiles in a ``TileStore``:

* the **L1 tile cache** (``TileCache``) maps A/B tile keys to blocks of the
  device's pool, in approximate-LRU order (BLASX Alg. 2).  Every block has a
  *reader* count: a task holds a reader from the moment it asks for the tile
  until the device has finished the kernel that used it (readers are released
  when the stream event recorded after that kernel has completed, so an
  asynchronous device never overwrites a tile a queued kernel still reads).
  Eviction takes the least recently used block *with no readers*; when the
  least recent ones are busy it skips them -- hence "approximate".
* the **L2 tile cache** is every other device's L1 that this device can copy
  from directly (GPU peer-to-peer; ``CpuDevice``s in one peer group).  A
  ``TileDirectory`` records which devices hold which tiles.  On an L1 miss the
  store looks there before going to the host; the source block is pinned
  (a remote reader) until the copy has completed, so its owner cannot evict it.

Coherence is the MESI-X protocol of the paper: A and B are read-only during a
call, so a tile is *Invalid* (no holder), *Exclusive* (one holder) or *Shared*;
output tiles are never cached -- an accumulator is written back to the host
once its task completes (the ephemeral *Modified* state) and freed.  Caches are
emptied at the end of every call, because the host matrices may change between
calls.

Blocks come from the device's ``PoolAllocator``; when the pool has no segment
large enough the store evicts (LRU order, which also merges free neighbours),
then waits for its own in-flight work or for peers' pins to drain, and only
then raises ``PoolExhausted``.  With ``caching=False`` (the round-robin
baseline) every tile is fetched from the host for every use and freed after it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from deepdsl_runtime.gemm.tiles import GemmProblem, TileKey
from deepdsl_runtime.memory.first_fit import PoolExhausted

__all__ = ["Block", "DeviceCounters", "TileCache", "TileDirectory", "TileStore", "Shared", "Aborted"]


class Aborted(RuntimeError):
    """Another device's worker failed; this one stops."""


@dataclass(eq=False, slots=True)
class Block:
    """A tile stored in one device's memory."""

    owner: int
    offset: int
    nbytes: int
    shape: tuple[int, int]
    buf: object
    key: TileKey
    readers: int = 0
    pins: int = 0  # readers that are peers copying from this block
    event: object = None  # completes once the tile's data is in place (None: already)


@dataclass
class DeviceCounters:
    """What one device did during a call (written only by its own worker thread)."""

    h2d_bytes: int = 0
    h2d_tiles: int = 0
    d2h_bytes: int = 0
    d2h_tiles: int = 0
    d2d_bytes_from: dict[int, int] = field(default_factory=dict)  # source device -> bytes
    d2d_tiles: int = 0
    cache_hits: int = 0
    peer_hits: int = 0
    cache_misses: int = 0
    evictions: int = 0
    tasks: int = 0
    steals: int = 0


class TileCache:
    """The L1 tile cache of one device: approximate LRU over blocks with readers."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[TileKey, Block] = OrderedDict()  # least recent first
        self.cached_bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: TileKey) -> bool:
        return key in self._blocks

    def get(self, key: TileKey) -> Block | None:
        return self._blocks.get(key)

    def touch(self, key: TileKey) -> None:
        self._blocks.move_to_end(key)

    def insert(self, block: Block) -> None:
        self._blocks[block.key] = block
        self.cached_bytes += block.nbytes

    def pop_victim(self) -> Block | None:
        """Remove and return the least recently used block no one reads (Alg. 2 Dequeue)."""
        for key, block in self._blocks.items():
            if block.readers == 0:
                del self._blocks[key]
                self.cached_bytes -= block.nbytes
                return block
        return None

    def blocks(self) -> list[Block]:
        return list(self._blocks.values())

    def clear(self) -> list[Block]:
        blocks = list(self._blocks.values())
        self._blocks.clear()
        self.cached_bytes = 0
        return blocks


class TileDirectory:
    """Which devices hold which A/B tiles: the state of the MESI-X protocol."""

    def __init__(self) -> None:
        self._holders: dict[TileKey, set[int]] = {}

    def add(self, key: TileKey, device: int) -> None:
        self._holders.setdefault(key, set()).add(device)

    def remove(self, key: TileKey, device: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(device)
            if not holders:
                del self._holders[key]

    def holders(self, key: TileKey) -> frozenset[int]:
        return frozenset(self._holders.get(key, ()))

    def state(self, key: TileKey) -> str:
        """``"I"``nvalid, ``"E"``xclusive or ``"S"``hared."""
        count = len(self._holders.get(key, ()))
        return "I" if count == 0 else "E" if count == 1 else "S"


class Shared:
    """State every device's store and the scheduler share during one call."""

    def __init__(self, problem: GemmProblem, devices: list) -> None:
        self.problem = problem
        self.devices = devices
        self.lock = threading.Lock()
        self.released = threading.Condition(self.lock)  # a peer unpinned one of our blocks
        self.directory = TileDirectory()
        self.stores: list[TileStore] = []
        self.aborted = False


class TileStore:
    """Tiles resident on one device during a call; see the module docstring."""

    def __init__(self, index: int, shared: Shared, *, caching: bool, cache_bytes: int | None,
                 peers: frozenset[int]) -> None:
        self.index = index
        self.shared = shared
        self.device = shared.devices[index]
        self.pool = self.device.pool
        self.caching = caching
        self.cache_bytes = cache_bytes
        self.peers = peers  # devices whose L1 is this device's L2
        self.cache = TileCache()
        self.counters = DeviceCounters()
        self._live: dict[int, Block] = {}  # offset -> every block this store allocated
        self._pending: list[tuple[object, Callable[[], None]]] = []

    # -- reading A/B tiles ---------------------------------------------------------------
    def acquire(self, key: TileKey, stream: int) -> Block:
        """Return ``key``'s tile on this device with a reader held; its data is ordered
        before any later work on ``stream``."""
        shared, problem = self.shared, self.shared.problem
        if self.caching:
            with shared.lock:
                block = self.cache.get(key)
                if block is not None:
                    block.readers += 1
                    self.cache.touch(key)
                    self.counters.cache_hits += 1
            if block is not None:
                if block.event is not None:
                    self.device.wait(stream, block.event)
                return block
        shape = problem.tile_shape(key)
        nbytes = problem.tile_nbytes(key)
        block = self._allocate(key, shape, nbytes, cached=self.caching)
        block.readers = 1
        source = self._pin_peer_copy(key) if self.caching else None
        if source is not None:
            peer = shared.devices[source.owner]
            block.event = self.device.copy_peer(block.buf, peer, source.buf, stream, after=source.event)
            self.counters.peer_hits += 1
            self.counters.d2d_tiles += 1
            self.counters.d2d_bytes_from[source.owner] = self.counters.d2d_bytes_from.get(source.owner, 0) + nbytes
            self._after(block.event, lambda: self._unpin(source))
        else:
            block.event = self.device.copy_in(block.buf, problem.host_view(key), stream)
            self.counters.cache_misses += 1
            self.counters.h2d_tiles += 1
            self.counters.h2d_bytes += nbytes
        if self.caching:
            with shared.lock:
                self.cache.insert(block)
                shared.directory.add(key, self.index)
        return block

    def release(self, blocks: list[Block], event) -> None:
        """Drop one reader of each block once ``event`` (after their last use) completes."""

        def drop() -> None:
            with self.shared.lock:
                for block in blocks:
                    block.readers -= 1
                    if not self.caching:
                        self._free_locked(block)

        self._after(event, drop)

    # -- output tiles ------------------------------------------------------------------------
    def output(self, key: TileKey, stream: int, load: bool) -> Block:
        """An accumulator for output tile ``key``, loaded from the host when ``load``."""
        problem = self.shared.problem
        shape = problem.tile_shape(key)
        nbytes = problem.tile_nbytes(key)
        block = self._allocate(key, shape, nbytes, cached=False)
        if load:
            block.event = self.device.copy_in(block.buf, problem.host_view(key), stream)
            self.counters.h2d_tiles += 1
            self.counters.h2d_bytes += nbytes
        return block

    def write_back(self, block: Block, stream: int) -> None:
        """Copy a finished accumulator to the host C, then free it."""
        event = self.device.copy_out(self.shared.problem.host_view(block.key), block.buf, stream)
        self.counters.d2h_tiles += 1
        self.counters.d2h_bytes += block.nbytes

        def free() -> None:
            with self.shared.lock:
                self._free_locked(block)

        self._after(event, free)

    # -- completion ------------------------------------------------------------------------
    def poll(self) -> None:
        """Run the actions whose events have completed."""
        if not self._pending:
            return
        ready, waiting = [], []
        for pending in self._pending:               # (event, action): a waiting action keeps its event
            (ready if self.device.done(pending[0]) else waiting).append(pending)
        self._pending = waiting
        for _, action in ready:
            action()

    def finish(self) -> None:
        """Wait for all of this device's work and run every pending action."""
        self.device.synchronize()
        pending, self._pending = self._pending, []
        for _, action in pending:
            action()

    def drop_all(self) -> None:
        """Free every block this store still holds (end of call, or after a failure)."""
        with self.shared.lock:
            self.cache.clear()
            for block in list(self._live.values()):
                self.shared.directory.remove(block.key, self.index)
                self.pool.free(block.offset)
            self._live.clear()
        self._pending = []

    # -- internals ---------------------------------------------------------------------------
    def _after(self, event, action: Callable[[], None]) -> None:
        if event is None or self.device.done(event):
            action()
        else:
            self._pending.append((event, action))

    def _pin_peer_copy(self, key: TileKey) -> Block | None:
        shared = self.shared
        with shared.lock:
            for owner in shared.directory.holders(key):
                if owner in self.peers:
                    source = shared.stores[owner].cache.get(key)
                    if source is not None:
                        source.readers += 1
                        source.pins += 1
                        return source
        return None

    def _unpin(self, source: Block) -> None:
        with self.shared.lock:
            source.readers -= 1
            source.pins -= 1
            self.shared.released.notify_all()

    def _free_locked(self, block: Block) -> None:
        del self._live[block.offset]
        self.pool.free(block.offset)

    def _evict_locked(self, block: Block) -> None:
        self.shared.directory.remove(block.key, self.index)
        self._free_locked(block)
        self.counters.evictions += 1

    def _allocate(self, key: TileKey, shape: tuple[int, int], nbytes: int, cached: bool) -> Block:
        """A block of ``nbytes`` from the pool: evict, wait for in-flight work, or raise."""
        shared = self.shared
        while True:
            with shared.lock:
                if shared.aborted:
                    raise Aborted("another device failed")
                if cached and self.cache_bytes is not None:
                    while self.cache.cached_bytes + nbytes > self.cache_bytes:
                        victim = self.cache.pop_victim()
                        if victim is None:
                            break
                        self._evict_locked(victim)
                offset = self._alloc_locked(nbytes)
                if offset is not None:
                    block = Block(self.index, offset, nbytes, shape, self.device.buffer(offset, shape), key)
                    self._live[offset] = block
                    return block
                pinned_by_peers = any(b.pins for b in self.cache.blocks())
                if not self._pending and not pinned_by_peers:
                    stats = self.pool.stats
                    raise PoolExhausted(self.pool.aligned_size(nbytes), stats.largest_free_block,
                                        stats.total_free, stats.capacity)
                if not self._pending:
                    shared.released.wait(timeout=0.05)
                    continue
            self._wait_oldest()

    def _alloc_locked(self, nbytes: int) -> int | None:
        while True:
            try:
                return self.pool.alloc(nbytes)
            except PoolExhausted:
                victim = self.cache.pop_victim()
                if victim is None:
                    return None
                self._evict_locked(victim)

    def _wait_oldest(self) -> None:
        event, action = self._pending.pop(0)
        self.device.synchronize(event)
        action()
        self.poll()
