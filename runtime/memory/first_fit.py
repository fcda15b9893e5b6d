"""One preallocated chunk, carved up first-fit: the runtime's memory pool.

``PoolAllocator`` manages *offsets* inside a chunk of ``capacity`` bytes and
knows nothing about what backs the chunk, so the same class serves host
buffers (``HostPool``, numpy views over one ``np.empty(n, np.uint8)``), device
memory (``deepdsl_runtime.cuda.arrays.DevicePool`` over one device chunk) and the
training runtime's arena.

The design is the heap of BLASX (§IV-E): allocation and deallocation never call
the system allocator; they split and merge segments of the chunk instead.

* ``alloc(n)`` rounds ``n`` up to the alignment (256 bytes, what ``cudaMalloc``
  guarantees), takes the *first* free segment (lowest offset) that is large
  enough and splits off the remainder as a new free segment.
* ``free(offset)`` returns the segment and merges it with its free left and
  right neighbours, so freeing every block always restores one free segment.

Free segments are kept in a list sorted by offset (``bisect`` gives O(log n)
neighbour lookup; insertion is a memmove of the list), allocated segments in a
dict from offset to size.  First-fit scans the free list, O(number of free
segments).

Invariants (checked by ``check()`` and by the property tests):
* every offset handed out is a multiple of the alignment and every segment size
  is a positive multiple of it;
* allocated and free segments tile ``[0, capacity_aligned)`` exactly, with no
  overlap;
* no two free segments are adjacent (they would have been merged).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from deepdsl_runtime.contract import ALIGNMENT as DEFAULT_ALIGNMENT, placed_size

__all__ = ["DEFAULT_ALIGNMENT", "PoolAllocator", "PoolExhausted", "PoolStats", "HostPool"]


class PoolExhausted(MemoryError):
    """No free segment of the pool is large enough for a request.

    ``requested`` is the aligned size asked for, ``largest_free`` the largest
    free segment at the time and ``total_free`` the sum of all free segments;
    ``total_free >= requested > largest_free`` means the failure is due to
    fragmentation rather than to capacity.
    """

    def __init__(self, requested: int, largest_free: int, total_free: int, capacity: int):
        self.requested = requested
        self.largest_free = largest_free
        self.total_free = total_free
        self.capacity = capacity
        cause = "fragmented" if total_free >= requested else "full"
        super().__init__(
            f"pool {cause}: requested {requested} bytes, largest free segment {largest_free}, "
            f"{total_free} bytes free of {capacity}"
        )


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool's counters; all sizes in bytes (aligned sizes)."""

    capacity: int
    bytes_in_use: int
    peak_bytes_in_use: int
    num_allocs: int
    num_frees: int
    live_blocks: int
    free_blocks: int
    total_free: int
    largest_free_block: int

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free / total_free``: 0 when all free space is one segment."""
        if self.total_free == 0:
            return 0.0
        return 1.0 - self.largest_free_block / self.total_free


class PoolAllocator:
    """First-fit allocator of aligned segments inside ``[0, capacity)``.

    ``capacity`` is rounded *down* to the alignment (the tail that cannot hold an
    aligned block is never handed out).  Not thread-safe: callers that share a
    pool between threads hold their own lock (the tiled GEMM does).
    """

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.alignment = alignment
        self.capacity = (capacity // alignment) * alignment
        self._free_offsets: list[int] = []  # sorted
        self._free_size: dict[int, int] = {}
        self._used: dict[int, int] = {}
        self._bytes_in_use = 0
        self._peak = 0
        self._num_allocs = 0
        self._num_frees = 0
        if self.capacity:
            self._free_offsets.append(0)
            self._free_size[0] = self.capacity

    # -- allocation -----------------------------------------------------------------
    def aligned_size(self, nbytes: int) -> int:
        """The size a request of ``nbytes`` really takes (zero-byte requests take one unit)."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        return placed_size(nbytes, self.alignment)

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (rounded up to the alignment); return its offset.

        Raises ``PoolExhausted`` when no free segment is large enough.
        """
        size = self.aligned_size(nbytes)
        for index, offset in enumerate(self._free_offsets):
            free_size = self._free_size[offset]
            if free_size < size:
                continue
            del self._free_size[offset]
            if free_size == size:
                del self._free_offsets[index]
            else:  # split: the remainder stays free, at the same list position
                rest = offset + size
                self._free_offsets[index] = rest
                self._free_size[rest] = free_size - size
            self._used[offset] = size
            self._bytes_in_use += size
            self._peak = max(self._peak, self._bytes_in_use)
            self._num_allocs += 1
            return offset
        total = self.capacity - self._bytes_in_use
        raise PoolExhausted(size, self.largest_free_block(), total, self.capacity)

    def free(self, offset: int) -> None:
        """Return the block at ``offset``; merge it with free neighbours."""
        size = self._used.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not the start of a live block")
        self._bytes_in_use -= size
        self._num_frees += 1
        offsets = self._free_offsets
        index = bisect.bisect_left(offsets, offset)
        # Merge with the right neighbour.
        if index < len(offsets) and offsets[index] == offset + size:
            size += self._free_size.pop(offsets[index])
            del offsets[index]
        # Merge with the left neighbour.
        if index > 0:
            left = offsets[index - 1]
            if left + self._free_size[left] == offset:
                self._free_size[left] += size
                return
        offsets.insert(index, offset)
        self._free_size[offset] = size

    # -- queries --------------------------------------------------------------------
    def size_of(self, offset: int) -> int:
        """Aligned size of the live block at ``offset``."""
        return self._used[offset]

    def owns(self, offset: int) -> bool:
        return offset in self._used

    def largest_free_block(self) -> int:
        return max(self._free_size.values(), default=0)

    def free_segments(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free segment, by offset."""
        return [(o, self._free_size[o]) for o in self._free_offsets]

    def live_blocks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every allocated block, by offset."""
        return sorted(self._used.items())

    @property
    def bytes_in_use(self) -> int:
        return self._bytes_in_use

    @property
    def stats(self) -> PoolStats:
        total_free = self.capacity - self._bytes_in_use
        return PoolStats(
            capacity=self.capacity,
            bytes_in_use=self._bytes_in_use,
            peak_bytes_in_use=self._peak,
            num_allocs=self._num_allocs,
            num_frees=self._num_frees,
            live_blocks=len(self._used),
            free_blocks=len(self._free_offsets),
            total_free=total_free,
            largest_free_block=self.largest_free_block(),
        )

    def reset_peak(self) -> None:
        """Restart peak tracking from the current usage."""
        self._peak = self._bytes_in_use

    def check(self) -> None:
        """Assert the invariants in the module docstring (for tests and debugging)."""
        segments = [(o, s, False) for o, s in self.free_segments()]
        segments += [(o, s, True) for o, s in self._used.items()]
        segments.sort()
        cursor = 0
        previous_free = False
        for offset, size, used in segments:
            assert offset == cursor, f"gap or overlap at {cursor}..{offset}"
            assert size > 0 and size % self.alignment == 0, f"bad size {size} at {offset}"
            assert used or not previous_free, f"adjacent free segments at {offset}"
            previous_free = not used
            cursor += size
        assert cursor == self.capacity, f"segments cover {cursor} of {self.capacity} bytes"
        assert sum(self._used.values()) == self._bytes_in_use


class HostPool:
    """A ``PoolAllocator`` over one host buffer, handing out numpy views.

    >>> pool = HostPool(1 << 20)
    >>> x = pool.empty((16, 16), np.float32)
    >>> pool.free(x)

    The buffer is ``np.empty(capacity + alignment, np.uint8)`` and views start at
    aligned *addresses*, so every view is aligned for any numpy dtype.
    """

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT):
        self.allocator = PoolAllocator(capacity, alignment)
        raw = np.empty(self.allocator.capacity + alignment, np.uint8)
        shift = (-raw.ctypes.data) % alignment
        self._buffer = raw[shift : shift + self.allocator.capacity]
        self._base = self._buffer.ctypes.data

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialized C-contiguous array of ``shape``/``dtype`` inside the pool."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offset = self.allocator.alloc(nbytes)
        return self.view(offset, shape, dtype)

    def view(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        """The array of ``shape``/``dtype`` starting at ``offset`` (no allocation)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self._buffer[offset : offset + nbytes].view(dtype).reshape(shape)

    def offset_of(self, array: np.ndarray) -> int:
        """Offset of the block that ``array`` (as returned by ``empty``) starts."""
        offset = array.__array_interface__["data"][0] - self._base
        if not 0 <= offset < self.allocator.capacity:
            raise ValueError("array does not live in this pool")
        return offset

    def free(self, array_or_offset) -> None:
        """Free a block given the array ``empty`` returned or its offset."""
        if isinstance(array_or_offset, np.ndarray):
            array_or_offset = self.offset_of(array_or_offset)
        self.allocator.free(int(array_or_offset))

    @property
    def stats(self) -> PoolStats:
        return self.allocator.stats
