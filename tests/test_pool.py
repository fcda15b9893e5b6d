"""PoolAllocator / HostPool: first-fit, splitting, coalescing, alignment, exact stats.

The property test runs random alloc/free sequences against an independent model
that only remembers the live blocks: with correct coalescing the pool's free
segments must be exactly the maximal gaps between live blocks, and first-fit must
return the lowest gap that fits.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from deepdsl_runtime.memory.first_fit import HostPool, PoolAllocator, PoolExhausted

ALIGN = 256


def gaps(live: dict[int, int], capacity: int) -> list[tuple[int, int]]:
    """Maximal free intervals of [0, capacity) given live blocks offset -> size."""
    out, cursor = [], 0
    for offset, size in sorted(live.items()):
        if offset > cursor:
            out.append((cursor, offset - cursor))
        cursor = offset + size
    if cursor < capacity:
        out.append((cursor, capacity - cursor))
    return out


def aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 3000)),
        st.tuples(st.just("free"), st.integers(0, 10_000)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 40 * ALIGN + 255), ops=operations)
def test_pool_matches_model(capacity, ops):
    pool = PoolAllocator(capacity, ALIGN)
    cap = (capacity // ALIGN) * ALIGN
    assert pool.capacity == cap
    live: dict[int, int] = {}
    peak = allocs = frees = 0
    for op, value in ops:
        if op == "alloc":
            size = aligned(value)
            expected = next((o for o, s in gaps(live, cap) if s >= size), None)
            if expected is None:
                with pytest.raises(PoolExhausted) as info:
                    pool.alloc(value)
                assert info.value.requested == size
                assert isinstance(info.value, MemoryError)
            else:
                offset = pool.alloc(value)
                assert offset == expected  # first fit
                assert offset % ALIGN == 0
                for o, s in live.items():  # no overlap with any live block
                    assert offset + size <= o or o + s <= offset
                live[offset] = size
                allocs += 1
                peak = max(peak, sum(live.values()))
        elif live:
            offset = sorted(live)[value % len(live)]
            pool.free(offset)
            del live[offset]
            frees += 1
        pool.check()
        assert pool.free_segments() == gaps(live, cap)  # coalescing is complete
        stats = pool.stats
        in_use = sum(live.values())
        free_sizes = [s for _, s in gaps(live, cap)]
        assert stats.bytes_in_use == in_use
        assert stats.peak_bytes_in_use == peak
        assert stats.num_allocs == allocs and stats.num_frees == frees
        assert stats.live_blocks == len(live)
        assert stats.total_free == cap - in_use
        assert stats.largest_free_block == max(free_sizes, default=0)
        expected_frag = 0.0 if not free_sizes else 1 - max(free_sizes) / sum(free_sizes)
        assert stats.fragmentation == pytest.approx(expected_frag)
    for offset in list(live):
        pool.free(offset)
    assert pool.free_segments() == ([(0, cap)] if cap else [])
    assert pool.stats.fragmentation == 0.0


def test_split_and_coalesce_by_hand():
    pool = PoolAllocator(4 * ALIGN)
    a, b, c = pool.alloc(1), pool.alloc(ALIGN), pool.alloc(ALIGN + 1)
    assert (a, b, c) == (0, ALIGN, 2 * ALIGN)
    assert pool.free_segments() == []
    pool.free(b)
    assert pool.free_segments() == [(ALIGN, ALIGN)]
    assert pool.stats.fragmentation == 0.0
    with pytest.raises(PoolExhausted, match="full"):
        pool.alloc(2 * ALIGN)
    pool.free(a)  # merges with the right neighbour
    assert pool.free_segments() == [(0, 2 * ALIGN)]
    pool.free(c)  # merges with the left neighbour: one segment again
    assert pool.free_segments() == [(0, 4 * ALIGN)]


def test_fragmentation_is_reported():
    pool = PoolAllocator(4 * ALIGN)
    blocks = [pool.alloc(ALIGN) for _ in range(4)]
    pool.free(blocks[0])
    pool.free(blocks[2])
    stats = pool.stats
    assert stats.total_free == 2 * ALIGN and stats.largest_free_block == ALIGN
    assert stats.fragmentation == pytest.approx(0.5)
    with pytest.raises(PoolExhausted, match="fragmented") as info:
        pool.alloc(2 * ALIGN)
    assert info.value.total_free == 2 * ALIGN and info.value.largest_free == ALIGN


def test_bad_frees_and_arguments():
    pool = PoolAllocator(2 * ALIGN)
    with pytest.raises(ValueError):
        pool.free(0)
    offset = pool.alloc(10)
    pool.free(offset)
    with pytest.raises(ValueError):
        pool.free(offset)  # double free
    with pytest.raises(ValueError):
        PoolAllocator(100, alignment=3)
    with pytest.raises(ValueError):
        pool.alloc(-1)


@settings(max_examples=50, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=12),
       dtype=st.sampled_from([np.float32, np.float64, np.int8, np.complex128]))
def test_host_pool_views_are_disjoint_and_aligned(shapes, dtype):
    pool = HostPool(64 * ALIGN)
    arrays = []
    for i, shape in enumerate(shapes):
        x = pool.empty(shape, dtype)
        assert x.shape == shape and x.dtype == dtype and x.flags.c_contiguous
        assert x.ctypes.data % ALIGN == 0
        x[...] = i
        arrays.append(x)
    for i, x in enumerate(arrays):  # nobody overwrote anybody
        assert np.all(x == i)
    for x in arrays:
        pool.free(x)
    assert pool.stats.bytes_in_use == 0
    assert pool.allocator.free_segments() == [(0, pool.capacity)]


def test_host_pool_rejects_foreign_arrays():
    pool = HostPool(4 * ALIGN)
    with pytest.raises(ValueError):
        pool.free(np.zeros(4))
    with pytest.raises(PoolExhausted):
        pool.empty((5 * ALIGN,), np.uint8)
