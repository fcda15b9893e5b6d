"""Tiled multi-device GEMM: correctness, counters, caches, scheduling, out-of-core, CUDA layer.

CPU devices (``CpuDevice``) run everything here; tests that need a GPU are marked
``gpu`` and skipped without pycuda and a device.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from deepdsl_runtime.cuda.driver import (GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_KERNEL_SOURCE, cublas_library_candidates,
                                         gemm_launch_config, row_major_gemm)
from deepdsl_runtime.gemm import CpuDevice, GemmStats, TiledGemm
from deepdsl_runtime.gemm.cache import Block, TileCache, TileDirectory
from deepdsl_runtime.gemm.devices import blas_thread_limit
from deepdsl_runtime.gemm.tiles import prepare_problem, tile_count

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def op(x, trans):
    return x.T if trans == "T" else x


def reference(transa, transb, alpha, a, b, beta, c):
    a64, b64 = op(a, transa).astype(np.float64), op(b, transb).astype(np.float64)
    out = alpha * (a64 @ b64)
    if beta != 0:
        out += beta * c.astype(np.float64)
    return out


def operand(rng, rows, cols, dtype, layout):
    """A rows x cols matrix stored C-order, F-order, or as a strided view."""
    if layout == "F":
        return np.asfortranarray(rng.uniform(-1, 1, (rows, cols)).astype(dtype))
    if layout == "view":
        return rng.uniform(-1, 1, (2 * rows, cols + 3)).astype(dtype)[::2, 1:cols + 1]
    return rng.uniform(-1, 1, (rows, cols)).astype(dtype)


def memory_for(tile, dtype, tiles):
    """Pool bytes for ``tiles`` full tiles plus the CPU device's scratch tile."""
    itemsize = np.dtype(dtype).itemsize
    aligned = -(-tile * tile * itemsize // 256) * 256
    return (tiles + 1) * aligned


def tolerance(dtype, k):
    return (2e-5 if dtype == np.float32 else 1e-12) * max(k, 1) * 4


# -- correctness -------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data(),
       m=st.integers(1, 30), n=st.integers(1, 30), k=st.integers(1, 30), tile=st.integers(3, 11),
       transa=st.sampled_from("NT"), transb=st.sampled_from("NT"),
       alpha=st.sampled_from([1.0, -0.5, 2.25]), beta=st.sampled_from([0.0, 1.0, 0.75]),
       dtype=st.sampled_from([np.float32, np.float64]), n_devices=st.integers(1, 4),
       policy=st.sampled_from(["blasx", "round_robin"]), streams=st.integers(1, 4))
def test_matches_numpy(data, m, n, k, tile, transa, transb, alpha, beta, dtype, n_devices, policy, streams):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    layouts = data.draw(st.tuples(*[st.sampled_from(["C", "F", "view"])] * 3))
    a = operand(rng, *((k, m) if transa == "T" else (m, k)), dtype, layouts[0])
    b = operand(rng, *((n, k) if transb == "T" else (k, n)), dtype, layouts[1])
    c = operand(rng, m, n, dtype, layouts[2])
    if beta == 0:
        c[...] = np.nan  # must not be read
    expected = reference(transa, transb, alpha, a, b, beta, c)
    devices = [CpuDevice(memory_for(tile, dtype, data.draw(st.integers(4, 40))),
                         delay_s=data.draw(st.sampled_from([0.0, 0.0, 0.0005])))
               for _ in range(n_devices)]
    gemm = TiledGemm(devices, tile=tile, streams=streams, policy=policy)
    gemm.gemm(transa, transb, alpha, a, b, beta, c)
    assert c.dtype == dtype
    np.testing.assert_allclose(c, expected, rtol=tolerance(dtype, k), atol=tolerance(dtype, k))

    s = gemm.stats
    mt, nt, kt = tile_count(m, tile), tile_count(n, tile), tile_count(k, tile)
    assert sum(s.tasks_per_device) == mt * nt
    assert s.cache_hits + s.peer_hits + s.cache_misses == 2 * mt * nt * kt  # every operand read is one of them
    assert s.d2h_tiles == mt * nt and s.d2h_bytes == c.nbytes
    for device in devices:  # every tile, accumulator and scratch block went back to the pool
        assert device.pool.bytes_in_use == 0
        device.pool.check()


def test_beta_zero_with_nan_output_and_alpha_zero_skips_inputs():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((20, 13)), rng.standard_normal((13, 17))
    c = np.full((20, 17), np.nan)
    devices = [CpuDevice(memory_for(6, np.float64, 8)) for _ in range(2)]
    for device in devices:  # stale NaNs in device memory, as a previous call may leave behind
        device.memory.view(0, (device.pool.capacity // 8,), np.float64)[...] = np.nan
    gemm = TiledGemm(devices, tile=6)
    gemm.gemm("N", "N", 1.0, a, b, 0.0, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)
    # alpha == 0: BLAS does not read A or B; C is only scaled (or zeroed when beta == 0).
    nan_a, nan_b = np.full_like(a, np.nan), np.full_like(b, np.nan)
    before = c.copy()
    gemm.gemm("N", "N", 0.0, nan_a, nan_b, 2.0, c)
    np.testing.assert_array_equal(c, 2 * before)
    gemm.gemm("N", "N", 0.0, nan_a, nan_b, 0.0, c)
    assert np.all(c == 0) and gemm.stats.h2d_bytes == 0


@pytest.mark.parametrize("alpha", [1.0, -2.0])
def test_cpu_tile_kernel_never_reads_c_when_beta_is_zero(alpha):
    device = CpuDevice(memory_for(4, np.float64, 4))
    a, b = np.arange(12.0).reshape(3, 4), np.arange(8.0).reshape(4, 2)
    problem = prepare_problem("N", "N", 1.0, a, b, 0.0, np.zeros((3, 2)), 4)[0]
    device.open(problem, 1)
    c = np.full((3, 2), np.nan)
    device.gemm(0, False, False, alpha, a, b, 0.0, c)
    np.testing.assert_array_equal(c, alpha * (a @ b))
    device.gemm(0, True, False, alpha, a.T.copy(), b, 1.0, c)  # beta == 1 accumulates
    np.testing.assert_array_equal(c, 2 * alpha * (a @ b))
    device.close()
    assert device.pool.bytes_in_use == 0


def test_conjugate_flag_bool_flags_and_empty_inner_dimension():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((9, 7)).astype(np.float32), rng.standard_normal((5, 9)).astype(np.float32)
    c = np.zeros((7, 5), np.float32)
    gemm = TiledGemm([CpuDevice(memory_for(4, np.float32, 8))], tile=4)
    gemm.gemm("c", True, 1.0, a, b, 0.0, c)
    np.testing.assert_allclose(c, a.T @ b.T, rtol=1e-5, atol=1e-5)
    c[...] = 3.0
    gemm.gemm("N", "N", 1.0, np.zeros((7, 0), np.float32), np.zeros((0, 5), np.float32), 0.5, c)
    assert np.all(c == 1.5)


def test_task_order_bands():
    x = np.zeros((9, 9))
    problem = prepare_problem("N", "N", 1.0, x, x.copy(), 0.0, x.copy(), 3)[0]  # 3 x 3 tiles
    assert [(t.i, t.j) for t in problem.tasks()] == [(i, j) for i in range(3) for j in range(3)]
    banded = problem.tasks(band=2)
    assert [(t.i, t.j) for t in banded] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert [t.seq for t in banded] == list(range(9))


def test_rejects_bad_calls():
    gemm = TiledGemm([CpuDevice(memory_for(4, np.float64, 8))], tile=4)
    a, b, c = np.ones((3, 4)), np.ones((4, 5)), np.ones((3, 5))
    with pytest.raises(TypeError):
        gemm.gemm("N", "N", 1.0, a.astype(np.float32), b, 0.0, c)
    with pytest.raises(TypeError):
        gemm.gemm("N", "N", 1.0, a.astype(np.int64), b.astype(np.int64), 0.0, c.astype(np.int64))
    with pytest.raises(ValueError, match="shape"):
        gemm.gemm("T", "N", 1.0, a, b, 0.0, c)
    with pytest.raises(ValueError, match="transpose"):
        gemm.gemm("X", "N", 1.0, a, b, 0.0, c)
    square = np.ones((4, 4))
    with pytest.raises(ValueError, match="overlaps"):
        gemm.gemm("N", "N", 1.0, square, square, 1.0, square)
    with pytest.raises(ValueError):
        TiledGemm([], tile=4)
    with pytest.raises(ValueError):
        TiledGemm([CpuDevice(1024)], policy="greedy")
    device = CpuDevice(4096)
    with pytest.raises(ValueError):
        TiledGemm([device, device])


def test_device_too_small_is_a_clear_error():
    gemm = TiledGemm([CpuDevice(memory_for(8, np.float64, 2))], tile=8)
    with pytest.raises(ValueError, match="needs at least"):
        gemm.gemm("N", "N", 1.0, np.ones((16, 16)), np.ones((16, 16)), 0.0, np.ones((16, 16)))


# -- counters ----------------------------------------------------------------------------------------
@SETTINGS
@given(mt=st.integers(1, 4), nt=st.integers(1, 4), kt=st.integers(1, 4), tile=st.integers(2, 6),
       rests=st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6)),
       beta=st.sampled_from([0.0, 0.5]), n_devices=st.integers(1, 3), streams=st.integers(1, 4),
       transa=st.sampled_from("NT"))
def test_round_robin_counters_closed_form(mt, nt, kt, tile, rests, beta, n_devices, streams, transa):
    """Without a cache every task fetches its 2 kt operand tiles (+ C when beta != 0)."""
    m, n, k = ((t - 1) * tile + min(r, tile) for t, r in zip((mt, nt, kt), rests))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if transa == "T" else (m, k))
    b, c = rng.standard_normal((k, n)), rng.standard_normal((m, n))
    gemm = TiledGemm([CpuDevice(memory_for(tile, np.float64, 10)) for _ in range(n_devices)],
                     tile=tile, streams=streams, policy="round_robin")
    gemm.gemm(transa, "N", 1.0, a, b, beta, c)
    s = gemm.stats
    with_c = 1 if beta != 0 else 0
    assert s.h2d_tiles == 2 * mt * nt * kt + with_c * mt * nt
    assert s.d2h_tiles == mt * nt
    # Bytes: each row of tasks reads all of A once per task column, and B once per task row.
    assert s.h2d_bytes == nt * a.nbytes + mt * b.nbytes + with_c * c.nbytes
    assert s.d2h_bytes == c.nbytes
    assert s.cache_hits == s.peer_hits == s.d2d_bytes == s.steals == s.evictions == 0
    q = mt * nt
    assert s.tasks_per_device == tuple(len(range(d, q, n_devices)) for d in range(n_devices))


def test_square_grid_closed_form():
    T, tile = 4, 5
    a = np.ones((T * tile, T * tile), np.float32)
    for beta, c_tiles in ((0.0, 0), (1.0, T * T)):
        gemm = TiledGemm([CpuDevice(memory_for(tile, np.float32, 8)) for _ in range(3)], tile=tile,
                         policy="round_robin")
        gemm.gemm("N", "N", 1.0, a, a.copy(), beta, np.ones_like(a))
        assert gemm.stats.h2d_tiles == 2 * T**3 + c_tiles
        assert gemm.stats.d2h_tiles == T**2


def problem(n, dtype=np.float64, seed=3):
    rng = np.random.default_rng(seed)
    return (rng.uniform(-1, 1, (n, n)).astype(dtype), rng.uniform(-1, 1, (n, n)).astype(dtype),
            rng.uniform(-1, 1, (n, n)).astype(dtype))


def run(policy, a, b, c, devices, tile, **options):
    gemm = TiledGemm(devices, tile=tile, policy=policy, **options)
    out = c.copy()
    gemm.gemm("N", "T", 1.0, a, b, 0.5, out)
    np.testing.assert_allclose(out, a @ b.T + 0.5 * c, rtol=1e-10, atol=1e-10)
    return gemm.stats


@pytest.mark.parametrize("n_devices", [1, 3])
def test_blasx_moves_fewer_bytes_than_round_robin(n_devices):
    a, b, c = problem(64)
    tile = 8
    memory = memory_for(tile, np.float64, 24)
    blasx = run("blasx", a, b, c, [CpuDevice(memory) for _ in range(n_devices)], tile)
    baseline = run("round_robin", a, b, c, [CpuDevice(memory) for _ in range(n_devices)], tile)
    assert blasx.h2d_bytes < baseline.h2d_bytes
    assert blasx.communication_bytes < baseline.communication_bytes
    assert blasx.cache_hits > 0
    assert blasx.d2h_bytes == baseline.d2h_bytes == c.nbytes


def test_out_of_core_matrices_larger_than_every_device():
    a, b, c = problem(96, np.float64, seed=4)
    tile = 16
    memory = memory_for(tile, np.float64, 6)
    for policy in ("blasx", "round_robin"):
        devices = [CpuDevice(memory) for _ in range(2)]
        assert all(d.pool.capacity < a.nbytes for d in devices)
        s = run(policy, a, b, c, devices, tile)
        assert max(s.peak_device_bytes) <= devices[0].pool.capacity
        if policy == "blasx":
            assert s.evictions > 0


def test_small_cache_budget_evicts_and_stays_correct():
    a, b, c = problem(48)
    tile = 8
    s = run("blasx", a, b, c, [CpuDevice(memory_for(tile, np.float64, 40)) for _ in range(2)], tile,
            cache_bytes=3 * tile * tile * 8)
    assert s.evictions > 0


# -- caches and scheduling ---------------------------------------------------------------------------
def test_peer_cache_serves_tiles_device_to_device():
    """Device 1 is 4x slower: when it reaches step k >= 1 of a task in row 0, device 0 already
    holds A[0, k] (it runs task (0, 0)): an L2 hit, copied device to device."""
    a, b, c = problem(16)
    tile = 4  # 4 x 4 x 4 tiles
    devices = [CpuDevice(memory_for(tile, np.float64, 64), delay_s=0.005),
               CpuDevice(memory_for(tile, np.float64, 64), delay_s=0.02)]
    s = run("blasx", a, b, c, devices, tile, streams=1, reservation=1)
    assert s.peer_hits > 0
    assert s.d2d_bytes_by_pair.get((0, 1), 0) > 0
    assert s.d2d_bytes == sum(s.d2d_bytes_by_pair.values()) == s.d2d_tiles * tile * tile * 8
    without_peers = run("blasx", a, b, c, [CpuDevice(memory_for(tile, np.float64, 64)) for _ in range(2)], tile,
                        streams=1, reservation=1, peer_access=False)
    assert without_peers.peer_hits == without_peers.d2d_bytes == 0


def test_peer_groups_limit_the_l2_cache():
    a, b, c = problem(16)
    devices = [CpuDevice(memory_for(4, np.float64, 64), peer_group=0, delay_s=0.005),
               CpuDevice(memory_for(4, np.float64, 64), peer_group=1, delay_s=0.02)]
    s = run("blasx", a, b, c, devices, 4, streams=1, reservation=1)
    assert s.peer_hits == 0 and s.d2d_bytes == 0


def test_faster_devices_take_more_tasks_and_steal():
    a, b, c = problem(48)
    tile = 8  # 36 tasks, 6 steps each
    # The slow device starts first and reserves tasks; the fast one drains the queue, then
    # steals from the slow one's reservation station instead of idling.
    devices = [CpuDevice(memory_for(tile, np.float64, 32), delay_s=0.03), CpuDevice(memory_for(tile, np.float64, 32))]
    s = run("blasx", a, b, c, devices, tile, streams=1, reservation=2)
    assert s.tasks_per_device[1] > 3 * s.tasks_per_device[0]
    assert s.steals_per_device[1] > 0 and s.steals == s.steals_per_device[0] + s.steals_per_device[1]
    # The static baseline cannot rebalance: each device runs half of the tiles.
    devices = [CpuDevice(memory_for(tile, np.float64, 32)), CpuDevice(memory_for(tile, np.float64, 32), delay_s=0.001)]
    s = run("round_robin", a, b, c, devices, tile, streams=1)
    assert s.tasks_per_device == (18, 18)


def test_slowdown_knob_makes_kernels_slower():
    device = CpuDevice(memory_for(8, np.float64, 8), slowdown=1.0, delay_s=0.01)
    a, b, c = problem(8)
    gemm = TiledGemm([device], tile=8)
    gemm.gemm("N", "N", 1.0, a, b, 0.0, c)
    assert gemm.stats.seconds >= 0.01
    with pytest.raises(ValueError):
        CpuDevice(1024, slowdown=0.5)


def test_failure_on_one_device_propagates_and_frees_memory():
    class Broken(CpuDevice):
        def gemm(self, *args):
            raise FloatingPointError("broken kernel")

    a, b, c = problem(32)
    devices = [CpuDevice(memory_for(8, np.float64, 16), delay_s=0.005), Broken(memory_for(8, np.float64, 16))]
    gemm = TiledGemm(devices, tile=8, streams=1, reservation=1)
    with pytest.raises(FloatingPointError, match="broken kernel"):
        gemm.gemm("N", "N", 1.0, a, b, 0.0, c)
    assert all(d.pool.bytes_in_use == 0 for d in devices)


def test_priority_is_eq3_and_orders_the_reservation_station():
    from deepdsl_runtime.gemm import _BlasxScheduler, _Run
    from deepdsl_runtime.gemm.cache import Shared, TileStore
    from deepdsl_runtime.gemm.tiles import Task

    x = np.zeros((12, 12))
    problem = prepare_problem("N", "N", 1.0, x, x.copy(), 0.0, x.copy(), 4)[0]  # 3 x 3 x 3 tiles
    devices = [CpuDevice(memory_for(4, np.float64, 16)) for _ in range(2)]
    shared = Shared(problem, devices)
    for d in range(2):
        shared.stores.append(TileStore(d, shared, caching=True, cache_bytes=None, peers=frozenset({1 - d})))

    def hold(device, key):
        shared.stores[device].cache.insert(Block(device, 0, 128, (4, 4), None, key))
        shared.directory.add(key, device)

    for k in range(3):
        hold(0, ("A", 2, k))  # device 0 holds row 2 of A
    hold(1, ("B", 0, 1))  # device 1 holds one tile of B column 1
    run = _Run(problem, shared, [1, 1])
    scheduler = _BlasxScheduler(run, problem.tasks(), reservation=4)
    task = {(t.i, t.j): t for t in problem.tasks()}
    assert scheduler.priority(0, task[2, 0], set()) == 3 * 2  # three L1 hits
    assert scheduler.priority(0, task[0, 1], set()) == 1  # one L2 hit
    assert scheduler.priority(1, task[0, 1], set()) == 2  # ... an L1 hit for its holder
    assert scheduler.priority(0, task[0, 0], set()) == 0
    # Tiles the batch being formed will load count as L1 hits.
    assert scheduler.priority(0, task[0, 1], set(scheduler.keys(task[0, 0]))) == 3 * 2 + 1
    # The RS holds the first four tasks; the L2 hit wins, and the slot is refilled in queue order.
    assert scheduler.next_batch(0) == [task[0, 1]]
    assert scheduler.stations[0] == [task[0, 0], task[0, 2], task[1, 0], task[1, 1]]
    # With the queue empty, device 1 steals the RS task it likes best: B[0, 1] is in its L1.
    scheduler.queue.clear()
    assert scheduler.next_batch(1) == [task[1, 1]]
    assert shared.stores[1].counters.steals == 1
    assert scheduler.next_batch(0) == [task[0, 0]]  # ties go to the oldest task


def test_alru_skips_tiles_with_readers():
    cache = TileCache()
    blocks = [Block(0, 256 * i, 256, (8, 8), None, ("A", i, 0)) for i in range(3)]
    for block in blocks:
        cache.insert(block)
    blocks[0].readers = 1
    cache.touch(("A", 2, 0))  # order now: A0 (busy), A1, A2
    assert cache.pop_victim() is blocks[1]
    assert cache.pop_victim() is blocks[2]
    assert cache.pop_victim() is None  # only a busy tile is left
    blocks[0].readers = 0
    assert cache.pop_victim() is blocks[0] and cache.cached_bytes == 0


def test_directory_states():
    directory = TileDirectory()
    key = ("B", 0, 1)
    assert directory.state(key) == "I"
    directory.add(key, 0)
    assert directory.state(key) == "E"
    directory.add(key, 2)
    assert directory.state(key) == "S" and directory.holders(key) == {0, 2}
    directory.remove(key, 0)
    directory.remove(key, 2)
    assert directory.state(key) == "I"


def test_blas_thread_limit_splits_cores():
    cores = os.cpu_count() or 1
    assert blas_thread_limit([CpuDevice(1024)]) == cores
    assert blas_thread_limit([CpuDevice(1024) for _ in range(2)]) == max(1, cores // 2)
    assert blas_thread_limit([CpuDevice(1024, blas_threads=1), CpuDevice(1024)]) == 1
    assert blas_thread_limit([]) is None


def test_stats_default_and_communication_total():
    s = GemmStats(h2d_bytes=3, d2h_bytes=4, d2d_bytes=5)
    assert s.communication_bytes == 12


# -- CUDA layer without a GPU --------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_kernel_compiles(arch, tmp_path):
    out = tmp_path / f"gemm_{arch}.cubin"
    result = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-O3", "-o", str(out), str(GEMM_KERNEL_SOURCE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    cubin = out.read_bytes()
    assert b"deepdsl_sgemm_tile" in cubin and b"deepdsl_dgemm_tile" in cubin


@given(m=st.integers(1, 5000), n=st.integers(1, 5000))
def test_launch_config_covers_the_tile(m, n):
    config = gemm_launch_config(m, n)
    assert config.block == (16, 16, 1)
    gx, gy = config.grid
    assert (gx - 1) * GEMM_BLOCK_N < n <= gx * GEMM_BLOCK_N
    assert (gy - 1) * GEMM_BLOCK_M < m <= gy * GEMM_BLOCK_M


def test_launch_config_rejects_empty_tiles():
    with pytest.raises(ValueError):
        gemm_launch_config(0, 4)


def column_major_gemm(call, buffers, shapes):
    """Evaluate a cuBLAS call in numpy, reading each row-major buffer column-major."""
    def col_major(name, ld):
        rows, cols = shapes[name]  # row-major shape; column-major it is cols x rows with ld = row stride
        assert ld == cols
        return buffers[name].reshape(rows, cols).T

    first, second = col_major(call.first, call.lda), col_major(call.second, call.ldb)
    x = first.T if call.transa else first
    y = second.T if call.transb else second
    assert x.shape == (call.m, call.k) and y.shape == (call.k, call.n)
    # cuBLAS's own argument checks (column-major leading dimensions)
    assert call.lda >= max(1, call.k if call.transa else call.m)
    assert call.ldb >= max(1, call.n if call.transb else call.k)
    assert call.ldc >= max(1, call.m)
    return (x @ y).T  # column-major m x n result, read back row-major


@given(m=st.integers(1, 9), n=st.integers(1, 9), k=st.integers(1, 9), transa=st.booleans(), transb=st.booleans())
def test_row_major_gemm_maps_onto_column_major_cublas(m, n, k, transa, transb):
    rng = np.random.default_rng(m * 100 + n * 10 + k)
    a_shape = (k, m) if transa else (m, k)
    b_shape = (n, k) if transb else (k, n)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    call = row_major_gemm(transa, transb, m, n, k, lda=a_shape[1], ldb=b_shape[1], ldc=n)
    got = column_major_gemm(call, {"A": a.ravel(), "B": b.ravel()}, {"A": a_shape, "B": b_shape})
    np.testing.assert_allclose(got, (a.T if transa else a) @ (b.T if transb else b))


def test_cublas_candidates_are_paths_or_sonames():
    candidates = cublas_library_candidates()
    assert "libcublas.so" in candidates
    assert len(candidates) == len(set(candidates))


def test_runtime_imports_without_pycuda():
    code = ("import sys; import deepdsl_runtime.gemm, deepdsl_runtime.cuda.driver, deepdsl_runtime.gemm.cuda_device;"
            "assert 'pycuda' not in sys.modules, 'pycuda imported eagerly'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- on a GPU ----------------------------------------------------------------------------------------------
def _gpu_count() -> int:
    try:
        import pycuda.driver as drv
        drv.init()
        return drv.Device.count()
    except Exception:
        return 0


needs_gpu = pytest.mark.skipif(_gpu_count() == 0, reason="needs pycuda and an NVIDIA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("use_cublas", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_device_matches_numpy(use_cublas, dtype):
    from deepdsl_runtime.gemm import CudaDevice

    rng = np.random.default_rng(5)
    m, n, k, tile = 300, 257, 190, 64
    for transa in "NT":
        for transb in "NT":
            a = rng.uniform(-1, 1, (k, m) if transa == "T" else (m, k)).astype(dtype)
            b = rng.uniform(-1, 1, (n, k) if transb == "T" else (k, n)).astype(dtype)
            for beta in (0.0, 0.5):
                c = rng.uniform(-1, 1, (m, n)).astype(dtype)
                if beta == 0:
                    c[...] = np.nan
                expected = reference(transa, transb, 1.5, a, b, beta, c)
                devices = [CudaDevice(i, memory_bytes=64 << 20, use_cublas=use_cublas) for i in range(_gpu_count())]
                gemm = TiledGemm(devices, tile=tile)
                gemm.gemm(transa, transb, 1.5, a, b, beta, c)
                np.testing.assert_allclose(c, expected, rtol=tolerance(dtype, k), atol=tolerance(dtype, k))
                for device in devices:
                    assert device.pool.bytes_in_use == 0
                    device.release()


@pytest.mark.gpu
@needs_gpu
def test_cuda_out_of_core():
    from deepdsl_runtime.gemm import CudaDevice

    a, b, c = problem(512, np.float32)
    device = CudaDevice(0, memory_bytes=8 * 128 * 128 * 4)
    assert device.pool.capacity < a.nbytes
    gemm = TiledGemm([device], tile=128)
    out = c.copy()
    gemm.gemm("N", "N", 1.0, a, b, 0.0, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-3, atol=1e-3)
    assert gemm.stats.evictions > 0
    device.release()
