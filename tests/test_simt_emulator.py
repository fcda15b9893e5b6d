"""The host emulator's SIMT execution (tests/support/simt_host.h): kernels with shared memory and barriers run their own
CUDA source on the CPU, block after block, each thread on a fiber, in increasing, decreasing and shuffled order.

- The real block-level kernels of runtime/kernels -- `deepdsl_sum_rows`, `deepdsl_sum_middle`, `deepdsl_precision`,
  the four ordered pooling passes (also over their own input, as the memory plan's takeover has them) and the tiled
  SGEMM/DGEMM of gemm.cu (odd shapes, every transpose, padded leading dimensions, alpha and beta, beta = 0 over a
  NaN C) -- match numpy or the CPU backend in every thread order, and give the same bits in every order.
- The emulator catches what a GPU would get wrong: a read of shared memory another thread has not written yet
  (shared memory is NaN before each block), a write that overtakes another thread's read, a `__syncthreads()` that
  not every thread reaches, or that threads reach at different places or different numbers of times.
- Every block of a 3-D grid and every thread of a 3-D block run exactly once with their own indices, before and
  after a barrier; launches beyond CUDA's limits or the kernel's `__launch_bounds__` are refused.
"""
from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

from deepdsl_runtime import cpu

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None,
                                reason="needs g++ and nm (kernels run on the host emulator)")

ORDERS = (0, 1, 2)                                 # increasing, decreasing, shuffled
F32, F64 = np.float32, np.float64


@pytest.fixture(scope="module")
def emulator():
    from tests.support import cuda_emulator
    return cuda_emulator


@pytest.fixture(scope="module")
def ops(emulator):
    return emulator.build()


@pytest.fixture(scope="module")
def gemm(emulator):
    return emulator.build((emulator.KERNELS / "gemm.cu").read_text())


def _ptr(array: np.ndarray) -> int:
    return array.ctypes.data


def _in_every_order(library, launch) -> list[np.ndarray]:
    """`launch()` (which returns its result) once per thread order, each with another seed for the shuffle."""
    results = []
    for order in ORDERS:
        library.set_order(order, seed=7 + order)
        results.append(launch())
    return results


def _same_bits(results: list[np.ndarray], what: str) -> None:
    for order, result in zip(ORDERS[1:], results[1:]):
        assert result.tobytes() == results[0].tobytes(), f"{what}: order {order} differs from increasing order"


# ----------------------------------------------------------------------------------------------------------------
# the block-level kernels of ops.cu

@pytest.mark.parametrize("a,b", [(1, 1), (37, 70), (8, 32), (300, 5)])
def test_sum_rows_matches_numpy(ops, a, b):
    x = np.random.default_rng(a * b).standard_normal((a, b)).astype(F32)

    def launch():
        out = np.full(b, np.nan, F32)
        ops.run("deepdsl_sum_rows", struct.pack("@IIPP", a, b, _ptr(x), _ptr(out)), (-(-b // 32), 1), (32, 8, 1))
        return out

    results = _in_every_order(ops, launch)
    _same_bits(results, "sum_rows")
    assert np.allclose(results[0], x.astype(F64).sum(axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a,b,c", [(1, 1, 1), (3, 5, 7), (2, 3, 300), (9, 4, 61)])
def test_sum_middle_matches_numpy(ops, a, b, c):
    x = np.random.default_rng(a * b * c).standard_normal((a, b, c)).astype(F32)

    def launch():
        out = np.full(b, np.nan, F32)
        ops.run("deepdsl_sum_middle", struct.pack("@IIIPP", a, b, c, _ptr(x), _ptr(out)), (b, 1), (256, 1, 1))
        return out

    results = _in_every_order(ops, launch)
    _same_bits(results, "sum_middle")
    assert np.allclose(results[0], x.astype(F64).sum(axis=(0, 2)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,classes", [(1, 7), (300, 7), (1000, 10), (256, 1)])
def test_precision_matches_numpy(ops, rows, classes):
    rng = np.random.default_rng(rows + classes)
    x = rng.standard_normal((rows, classes)).astype(F32)
    labels = rng.integers(0, classes, rows).astype(np.int32)
    labels[::3] = x[::3].argmax(axis=1)                     # some right, some wrong

    def launch():
        out = np.full(1, np.nan, F32)
        ops.run("deepdsl_precision", struct.pack("@IIPPP", rows, classes, _ptr(x), _ptr(labels), _ptr(out)),
                (1, 1), (256, 1, 1))
        return out

    results = _in_every_order(ops, launch)
    _same_bits(results, "precision")
    assert results[0][0] == F32(np.count_nonzero(x.argmax(axis=1) == labels)) / F32(rows)


@pytest.mark.parametrize("rows,classes", [(1, 7), (300, 7), (1000, 10)])
def test_label_rank_matches_numpy(ops, rows, classes):
    from deepdsl_runtime.cpu.loss import label_rank

    rng = np.random.default_rng(rows * classes)
    x = np.round(rng.standard_normal((rows, classes)) * 2).astype(F32)        # with ties
    labels = rng.integers(0, classes, rows).astype(np.int32)

    def launch():
        out = np.full(rows, np.nan, F32)
        ops.run("deepdsl_label_rank", struct.pack("@IIPPP", rows, classes, _ptr(x), _ptr(labels), _ptr(out)),
                (-(-rows // 256), 1), (256, 1, 1))
        return out

    results = _in_every_order(ops, launch)
    _same_bits(results, "label_rank")
    want = np.empty(rows, F32)
    label_rank(x, labels, out=want)
    assert np.array_equal(results[0], want)


def test_equality_masks_match_numpy(ops):
    from deepdsl_runtime.cpu.masks import equal

    rng = np.random.default_rng(3)
    for x in (rng.integers(0, 4, 1000).astype(np.int32), (rng.integers(0, 4, 1000) / 2).astype(F32)):
        kernel = "deepdsl_equal_i32" if x.dtype == np.int32 else "deepdsl_equal_f32"

        def launch():
            out = np.full(x.size, 7, np.uint8)
            ops.run(kernel, struct.pack("@IPfP", x.size, _ptr(x), 1.0, _ptr(out)), (4, 1), (256, 1, 1))
            return out

        want = np.empty(x.size, np.uint8)
        equal(x, out=want, value=1.0)
        assert np.array_equal(_in_every_order(ops, launch)[0], want) and 0 < want.sum() < x.size


@pytest.mark.parametrize("rows,d,m", [(7, 3, 40), (50, 65, 300)])
def test_rows_by_index_match_numpy(ops, rows, d, m):
    """deepdsl_gather_rows and deepdsl_scatter_rows (a token embedding and its gradient) against numpy's kernels:
    the same bits in every block order (each column's sum in the order of the lookups)."""
    from deepdsl_runtime.cpu import shape as shapes

    rng = np.random.default_rng(rows + m)
    table = rng.standard_normal((rows, d)).astype(F32)
    g = rng.standard_normal((m, d)).astype(F32)
    ids = rng.integers(0, rows, m).astype(np.int32)
    ids[3], ids[-1] = -1, rows                       # outside the table

    def gather():
        out = np.full((m, d), 7.0, F32)
        ops.run("deepdsl_gather_rows", struct.pack("@IIIPPP", m * d, d, rows, _ptr(table), _ptr(ids), _ptr(out)),
                (-(-m * d // 256), 1), (256, 1, 1))
        return out

    def scatter():
        out = np.full((rows, d), 7.0, F32)
        ops.run("deepdsl_scatter_rows", struct.pack("@IIIPPP", d, m, rows, _ptr(g), _ptr(ids), _ptr(out)),
                (-(-d // 256), 1), (256, 1, 1))
        return out

    for launch, numpy_kernel, shape in ((gather, lambda out: shapes.gather_rows(table, ids, out=out), (m, d)),
                                        (scatter, lambda out: shapes.scatter_rows(g, ids, out=out, rows=rows),
                                         (rows, d))):
        results = _in_every_order(ops, launch)
        _same_bits(results, launch.__name__)
        want = np.empty(shape, F32)
        numpy_kernel(want)
        np.testing.assert_array_equal(results[0], want)


POOL = (3, 40, 40, 2, 2)                            # planes, h, w, kernel, stride: 2 forward, 5 backward tiles


def _pool_reference(kind: str, x: np.ndarray, g: np.ndarray, argmax: np.ndarray) -> np.ndarray:
    planes, h, w, k, s = POOL
    if kind == "max_pool":
        out = np.empty((1, planes, h // s, w // s), F32)
        cpu.max_pool(x, out=out, kernel=k, stride=s)
    elif kind == "avg_pool":
        out = np.empty((1, planes, h // s, w // s), F32)
        cpu.avg_pool(x, out=out, kernel=k, stride=s, include_pad=True)
    elif kind == "max_pool_bwd":
        out = np.empty((1, planes, h, w), F32)
        cpu.max_pool_bwd(g, argmax, out=out, kernel=k, stride=s, size=(h, w))
    else:
        out = np.empty((1, planes, h, w), F32)
        cpu.avg_pool_bwd(g, out=out, kernel=k, stride=s, include_pad=True, size=(h, w))
    return out.ravel()


@pytest.mark.parametrize("kind", ["max_pool", "avg_pool", "max_pool_bwd", "avg_pool_bwd"])
def test_ordered_pooling_matches_the_cpu_backend(ops, kind):
    """One block of 1024 threads walks the elements in tiles (forward increasing, backward decreasing), every
    thread reading before the barrier and writing after it: the CPU's values exactly, into a separate buffer
    (over a sub-range: nothing outside it is written) and over its own input from the same start (takeover)."""
    planes, h, w, k, s = POOL
    ho, wo = h // s, w // s
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, planes, h, w)).astype(F32)
    g = rng.standard_normal((1, planes, ho, wo)).astype(F32)
    argmax = np.empty((1, planes, ho, wo), np.uint8)
    cpu.max_pool_argmax(x, out=argmax, kernel=k, stride=s)
    want = _pool_reference(kind, x, g, argmax)
    backward = kind.endswith("_bwd")
    source = g if backward else x
    average, with_argmax = kind.startswith("avg"), kind == "max_pool_bwd"
    # the parameters: PoolGeom, include_pad (average), the source, the argmax (max backward), out, begin, end
    fmt = "@8I" + "i" * average + "P" + "P" * with_argmax + "PII"

    def pack(source_ptr, out_ptr, begin, end):
        return struct.pack(fmt, planes, h, w, ho, wo, k, s, 0, *(1,) * average, source_ptr,
                           *(_ptr(argmax),) * with_argmax, out_ptr, begin, end)

    begin, end = 100, want.size - 37

    def separate():
        out = np.full(want.size, -7.0, F32)
        ops.run(f"deepdsl_{kind}_ordered", pack(_ptr(source), _ptr(out), begin, end), (1, 1), (1024, 1, 1))
        return out

    def in_place():
        buffer = np.zeros(max(source.size, want.size), F32)
        buffer[:source.size] = source.ravel()
        ops.run(f"deepdsl_{kind}_ordered", pack(_ptr(buffer), _ptr(buffer), 0, want.size), (1, 1), (1024, 1, 1))
        return buffer[:want.size].copy()

    for run, expected in ((separate, np.concatenate([np.full(begin, -7.0, F32), want[begin:end],
                                                     np.full(want.size - end, -7.0, F32)])),
                          (in_place, want)):
        results = _in_every_order(ops, run)
        _same_bits(results, f"{kind} {run.__name__}")
        assert np.array_equal(results[0], expected), (kind, run.__name__)       # (the CPU may write -0.0 for 0)


# ----------------------------------------------------------------------------------------------------------------
# the tiled GEMM of gemm.cu

GEMM_SHAPES = [(1, 1, 1), (70, 133, 37), (64, 64, 16), (65, 3, 129), (5, 7, 0)]
ALPHA_BETA = [(1.0, 0.0), (-0.5, 2.0), (1.5, 1.0)]


@pytest.mark.parametrize("dtype", [F32, F64], ids=["sgemm", "dgemm"])
def test_tiled_gemm_matches_numpy(gemm, dtype):
    """C = alpha op(A) op(B) + beta C for odd shapes (tiles cut by the edges, k = 0), every transpose, leading
    dimensions wider than the matrices, and beta = 0 over a C of NaNs (C is not read)."""
    name, code = ("deepdsl_sgemm_tile", "f") if dtype == F32 else ("deepdsl_dgemm_tile", "d")
    tolerance = 1e-5 if dtype == F32 else 1e-12
    rng = np.random.default_rng(11)
    checked = 0
    for m, n, k in GEMM_SHAPES:
        for transa in (0, 1):
            for transb in (0, 1):
                a_rows, a_cols = (k, m) if transa else (m, k)
                b_rows, b_cols = (n, k) if transb else (k, n)
                a = rng.standard_normal((a_rows, a_cols + 3)).astype(dtype)       # lda = a_cols + 3
                b = rng.standard_normal((b_rows, b_cols + 2)).astype(dtype)
                op_a = (a[:, :a_cols].T if transa else a[:, :a_cols]).astype(F64)
                op_b = (b[:, :b_cols].T if transb else b[:, :b_cols]).astype(F64)
                for alpha, beta in ALPHA_BETA:
                    c0 = rng.standard_normal((m, n + 5)).astype(dtype)              # ldc = n + 5
                    if beta == 0:
                        c0[:, :n] = np.nan
                    scale = abs(alpha) * (np.abs(op_a) @ np.abs(op_b)) + abs(beta) * np.abs(np.nan_to_num(c0[:, :n]))
                    want = alpha * (op_a @ op_b) + (beta * c0[:, :n].astype(F64) if beta else 0.0)

                    def launch():
                        c = c0.copy()
                        packed = struct.pack(f"@iii{code}PiiPii{code}Pi", m, n, k, alpha, _ptr(a), a.shape[1], transa,
                                             _ptr(b), b.shape[1], transb, beta, _ptr(c), c.shape[1])
                        gemm.run(name, packed, (-(-n // 64), -(-m // 64), 1), (16, 16, 1))
                        return c

                    results = _in_every_order(gemm, launch)
                    what = f"{name} m={m} n={n} k={k} transa={transa} transb={transb} alpha={alpha} beta={beta}"
                    _same_bits(results, what)
                    got = results[0]
                    assert np.array_equal(got[:, n:], c0[:, n:], equal_nan=True), f"{what}: wrote past n"
                    assert np.all(np.abs(got[:, :n] - want) <= tolerance * (scale + 1e-30)), what
                    checked += 1
    assert checked == len(GEMM_SHAPES) * 4 * len(ALPHA_BETA)


# ----------------------------------------------------------------------------------------------------------------
# what the emulator catches

TEST_KERNELS = r"""
// thread t of a block of 64 reads the element its right neighbour put in shared memory
extern "C" __global__ void __launch_bounds__(64) shift_synced(const float* x, float* out) {
    __shared__ float tile[64];
    const unsigned i = blockIdx.x * 64 + threadIdx.x;
    tile[threadIdx.x] = x[i];
    __syncthreads();
    out[i] = tile[(threadIdx.x + 1) % 64];
}

// the same without the barrier: the neighbour may not have written its element yet (read before write)
extern "C" __global__ void __launch_bounds__(64) shift_unsynced(const float* x, float* out) {
    __shared__ float tile[64];
    const unsigned i = blockIdx.x * 64 + threadIdx.x;
    tile[threadIdx.x] = x[i];
    out[i] = tile[(threadIdx.x + 1) % 64];
}

// two rounds through one tile without a barrier between reading round one and writing round two: a thread may
// overwrite its element before its left neighbour has read it (write after read; every element is written)
extern "C" __global__ void __launch_bounds__(64) shift_twice_unsynced(const float* x, float* out) {
    __shared__ float tile[64];
    const unsigned i = blockIdx.x * 64 + threadIdx.x;
    tile[threadIdx.x] = x[i];
    __syncthreads();
    const float v = tile[(threadIdx.x + 1) % 64];
    tile[threadIdx.x] = 2.0f * v;
    __syncthreads();
    out[i] = tile[(threadIdx.x + 1) % 64];
}

// only the first half of the block reaches the barrier
extern "C" __global__ void __launch_bounds__(64) barrier_in_branch(float* out) {
    __shared__ float tile[64];
    tile[threadIdx.x] = static_cast<float>(threadIdx.x);
    if (threadIdx.x < 32) __syncthreads();
    out[threadIdx.x] = tile[63 - threadIdx.x];
}

// every thread waits, odd and even threads at different barriers
extern "C" __global__ void __launch_bounds__(64) barriers_apart(float* out) {
    if (threadIdx.x % 2) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

// thread t passes t % 3 barriers
extern "C" __global__ void __launch_bounds__(64) barrier_counts(float* out) {
    for (unsigned k = 0; k < threadIdx.x % 3; ++k) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// every thread of the grid writes its block and thread indices and the launch's dimensions, after a barrier
extern "C" __global__ void __launch_bounds__(128) coordinates(unsigned* out) {
    const unsigned block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const unsigned thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    unsigned* at = out + 12 * (block * blockDim.x * blockDim.y * blockDim.z + thread);
    __syncthreads();
    at[0] += 1;
    at[1] = blockIdx.x; at[2] = blockIdx.y; at[3] = blockIdx.z;
    at[4] = threadIdx.x; at[5] = threadIdx.y; at[6] = threadIdx.z;
    at[7] = gridDim.x * 10000 + gridDim.y * 100 + gridDim.z;
    at[8] = blockDim.x * 10000 + blockDim.y * 100 + blockDim.z;
}
"""


@pytest.fixture(scope="module")
def probes(emulator):
    return emulator.build(TEST_KERNELS)


def _shift(library, kernel: str, x: np.ndarray) -> np.ndarray:
    out = np.full(x.size, -1.0, F32)
    library.run(kernel, struct.pack("@PP", _ptr(x), _ptr(out)), (x.size // 64, 1), (64, 1, 1))
    return out


def test_shared_memory_is_found_and_filled_before_each_block(ops, gemm, probes):
    """Every __shared__ variable is registered: sum_rows, sum_middle and precision (1056 + 1024 + 1024 bytes), the
    float and double tiles of the GEMM (2 x 16 x 65 x (4 + 8) bytes)."""
    assert ops.shared_bytes == 8 * 33 * 4 + 256 * 4 + 256 * 4
    assert gemm.shared_bytes == 2 * 16 * 65 * (4 + 8)
    assert probes.shared_bytes == 4 * 64 * 4


def test_a_missing_barrier_is_caught(probes):
    """Reading a neighbour's shared element without a barrier: wrong in every order here (the element is NaN when
    not yet written -- also in the second block, which must not see the first block's values); with the barrier,
    right in every order."""
    x = np.arange(128, dtype=F32)
    want = np.concatenate([np.roll(x[:64], -1), np.roll(x[64:], -1)])
    for got in _in_every_order(probes, lambda: _shift(probes, "shift_synced", x)):
        assert np.array_equal(got, want)
    unsynced = _in_every_order(probes, lambda: _shift(probes, "shift_unsynced", x))
    assert all(not np.array_equal(got, want) for got in unsynced)
    increasing = unsynced[0]
    assert np.isnan(increasing).sum() == 2 * 63 and increasing[63] == x[0] and increasing[127] == x[64]


def test_a_write_overtaking_a_read_is_caught(probes):
    """Shared memory rewritten before every thread has read it (no NaN involved): some thread order reads the new
    value."""
    x = np.arange(64, dtype=F32)
    want = 2 * np.roll(x, -2)
    outcomes = [np.array_equal(got, want)
                for got in _in_every_order(probes, lambda: _shift(probes, "shift_twice_unsynced", x))]
    assert not all(outcomes)


@pytest.mark.parametrize("kernel,message", [
    ("barrier_in_branch", r"divergent __syncthreads\(\) in block \(0,0,0\): thread \(\d+,0,0\) waits at "
                          r"kernel.cu:36 \(barrier 1\) while thread \(\d+,0,0\) has returned"),
    ("barriers_apart", r"divergent __syncthreads\(\) in block \(0,0,0\): thread \(\d+,0,0\) waits at "
                       r"kernel.cu:(43|45), thread \(\d+,0,0\) at kernel.cu:(43|45)"),
    ("barrier_counts", r"divergent __syncthreads\(\)")])
def test_a_divergent_barrier_is_an_error_of_the_launch(probes, kernel, message):
    """...in every order; the next launch runs normally (its threads start afresh)."""
    out = np.zeros(64, F32)
    for order in ORDERS:
        probes.set_order(order, seed=order)
        with pytest.raises(AssertionError, match=message):
            probes.run(kernel, struct.pack("@P", _ptr(out)), (1, 1), (64, 1, 1))
        x = np.arange(64, dtype=F32)
        assert np.array_equal(_shift(probes, "shift_synced", x), np.roll(x, -1))


def test_every_block_and_thread_runs_once_with_its_indices(probes):
    grid, block = (3, 2, 2), (4, 2, 3)
    blocks, threads = int(np.prod(grid)), int(np.prod(block))
    expected = np.zeros((blocks, threads, 12), np.uint32)
    for b in range(blocks):
        bx, by, bz = b % grid[0], b // grid[0] % grid[1], b // (grid[0] * grid[1])
        for t in range(threads):
            tx, ty, tz = t % block[0], t // block[0] % block[1], t // (block[0] * block[1])
            expected[b, t, :9] = (1, bx, by, bz, tx, ty, tz, 30202, 40203)
    for got in _in_every_order(probes, lambda: _coordinates(probes, grid, block)):
        assert np.array_equal(got.reshape(expected.shape), expected)


def _coordinates(probes, grid, block) -> np.ndarray:
    out = np.zeros(12 * int(np.prod(grid)) * int(np.prod(block)), np.uint32)
    probes.run("coordinates", struct.pack("@P", _ptr(out)), grid, block)
    return out


def test_launches_beyond_the_limits_are_refused(probes, ops):
    out = np.zeros(12 * 1024, np.uint32)
    with pytest.raises(AssertionError, match=r"more threads than __launch_bounds__\(128\)"):
        probes.run("coordinates", struct.pack("@P", _ptr(out)), (1, 1), (16, 16, 1))
    with pytest.raises(AssertionError, match="invalid launch geometry"):
        probes.run("coordinates", struct.pack("@P", _ptr(out)), (1, 1), (0, 1, 1))
    with pytest.raises(AssertionError, match="invalid launch geometry"):
        probes.run("coordinates", struct.pack("@P", _ptr(out)), (1, 70000), (1, 1, 1))
    with pytest.raises(AssertionError, match=r"more threads than __launch_bounds__\(256\)"):       # grid-stride
        ops.run("deepdsl_fill_u32", struct.pack("@IPI", 4, _ptr(out), 7), (1, 1), (512, 1, 1))
    with pytest.raises(AssertionError, match="bytes of arguments"):
        probes.run("coordinates", struct.pack("@PP", _ptr(out), _ptr(out)), (1, 1), (1, 1, 1))
