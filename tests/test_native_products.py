"""Matrix products on the compiled kernels' threads (`Native.gemm`, runtime/kernels/cpu_gemm.c): each product cut
into parts the BLAS's single-threaded sgemm computes, shared among the kernels' OpenMP threads, or computed in the
kernels' own tiles where `contract.small_product` takes it. Against numpy's
matmul in float64 on the layouts the convolutions and fully connected layers hand it (transposed views, stacks
broadcast against one matrix, stacks not one stride apart), every element written, the same bits on every call at
one thread count; what it cannot address runs numpy's matmul. The program's backend computes its products there,
with numpy's BLAS on one thread."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from deepdsl_runtime import contract
from deepdsl_runtime.cpu import backend, native
from deepdsl_runtime.cpu.linalg import Products
from tests.support.kernel_builds import AVX2, ISAS, generic_kernels
from tests.test_native_kernels import _program, needs_cc


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    _, _, path = _program("lenet", None, tmp_path_factory)
    found, why = native.load(path)
    assert found is not None, why
    if not found.products:
        pytest.skip("numpy's BLAS has no CBLAS sgemm this process can call")
    yield found
    found.set_threads(native.threads_available())


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _transposed(rng, *shape):
    """A (.., r, c) array as the transposed view of a (.., c, r) one."""
    return _rand(rng, *shape[:-2], shape[-1], shape[-2]).swapaxes(-1, -2)


CASES = {  # name: (a, b) from a generator
    "plain": lambda r: (_rand(r, 70, 300), _rand(r, 300, 530)),
    "tall": lambda r: (_rand(r, 1000, 37), _rand(r, 37, 45)),        # cut along the rows
    "a transposed": lambda r: (_transposed(r, 64, 200), _rand(r, 200, 333)),
    "b transposed (a filter gradient)": lambda r: (_rand(r, 50, 777), _transposed(r, 777, 120)),
    "both transposed, rows cut": lambda r: (_transposed(r, 500, 60), _transposed(r, 60, 70)),
    "a stack by one matrix": lambda r: (_rand(r, 3, 40, 50), _rand(r, 50, 90)),
    "one matrix by a stack (the convolutions)": lambda r: (_rand(r, 96, 72), _rand(r, 5, 72, 49)),
    "a stack of five on three threads": lambda r: (_rand(r, 5, 33, 60), _rand(r, 5, 60, 41)),
    "a stack of 2x3, one stride apart": lambda r: (_rand(r, 2, 3, 20, 30), _rand(r, 2, 3, 30, 25)),
    "a view of a wider matrix": lambda r: (_rand(r, 30, 100)[:, 7:87], _rand(r, 80, 64)),
    "groups of samples (not one stride apart)": lambda r: (_rand(r, 2, 16, 12),
                                                           _rand(r, 2, 3, 12, 40).transpose(1, 0, 2, 3)),
    "one column": lambda r: (_rand(r, 200, 64), _rand(r, 64, 1)),
    "one row": lambda r: (_rand(r, 1, 64), _rand(r, 64, 300)),
    "small": lambda r: (_rand(r, 3, 4), _rand(r, 4, 5)),
}


@needs_cc
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_products_on_the_kernels_threads_equal_numpy(lib, case, threads):
    a, b = CASES[case](np.random.default_rng(7))
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    lib.set_threads(threads)
    got = []
    for _ in range(2):
        out = np.full(want.shape, np.nan, np.float32)
        assert lib.gemm(a, b, out) is out
        got.append(out)
    assert np.isfinite(got[0]).all(), "an element was not written"
    np.testing.assert_array_equal(got[0], got[1])
    scale = np.sqrt(a.shape[-1]) * 1e-6
    np.testing.assert_allclose(got[0], want, rtol=0, atol=scale * max(1.0, float(np.abs(want).max())))


@needs_cc
@pytest.mark.parametrize("case", list(CASES))
def test_the_bits_do_not_depend_on_the_threads(lib, case):
    """A product's parts are fixed by its shape (`contract.product_cuts`), never by the threads taking them: the
    compiled kernels on 1, 2, 3 and 5 threads and numpy's products (`cpu.linalg.Products`) on 1, 2 and 3 compute the
    same bits each, and both equal numpy's matmul in float64 to float32 rounding."""
    a, b = CASES[case](np.random.default_rng(9))
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    compiled, numpys = [], []
    for threads in (1, 2, 3, 5):
        lib.set_threads(threads)
        compiled.append(lib.gemm(a, b, np.full(shape, np.nan, np.float32)))
    for threads in (1, 2, 3):
        numpys.append(Products(threads)(a, b, np.full(shape, np.nan, np.float32)))
    for got in compiled[1:]:
        np.testing.assert_array_equal(got, compiled[0])
    for got in numpys[1:]:
        np.testing.assert_array_equal(got, numpys[0])
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    scale = np.sqrt(a.shape[-1]) * 1e-6 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(numpys[0], want, rtol=0, atol=scale)


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 24, 100])
@pytest.mark.parametrize("m, n, k", [(70, 530, 300), (1000, 45, 37), (50, 500, 4096), (20, 25, 36864), (3, 4, 5),
                                     (64, 6272, 576), (4096, 4096, 1), (0, 10, 10), (10, 0, 10)])
def test_a_products_cut_follows_its_shape_alone(batch, m, n, k):
    """The parts cover the longer side of the output in whole vectors, at most PRODUCT_ITEMS in all, an even count
    (or one), each at least PRODUCT_PART_WIDTH wide (and k / PRODUCT_PART_DEPTH) and PRODUCT_PART_WORK multiply-adds
    where there are several; a single product of PRODUCT_HALVES_WORK in two parts at least."""
    by_columns, parts, width = contract.product_cuts(batch, m, n, k)
    side = n if by_columns else m
    assert by_columns == (n >= m) and side == max(m, n)
    assert parts == 1 or parts % 2 == 0
    assert width % 16 == 0 and parts * width >= side and (parts - 1) * width < max(side, 1)
    if parts > 1:
        assert batch * parts <= contract.PRODUCT_ITEMS
        halves = batch == 1 and parts == 2 and m * n * k >= contract.PRODUCT_HALVES_WORK     # a large one's
        assert halves or side // parts >= max(contract.PRODUCT_PART_WIDTH, k // contract.PRODUCT_PART_DEPTH) - 16
        assert m * n * k // parts >= contract.PRODUCT_PART_WORK
    if batch == 1 and side >= 32 and m * n * k >= contract.PRODUCT_HALVES_WORK:
        assert parts >= 2, "a large product runs on two threads"
    assert contract.product_cuts(batch, m, n, k) == (by_columns, parts, width)


@needs_cc
def test_what_the_library_cannot_address_runs_numpy(lib):
    rng = np.random.default_rng(3)
    a64, b64 = rng.standard_normal((20, 30)), rng.standard_normal((30, 10))
    out64 = np.empty((20, 10))
    lib.gemm(a64, b64, out64)                                 # float64
    np.testing.assert_array_equal(out64, np.matmul(a64, b64))
    a, b = _rand(rng, 20, 60)[:, ::2], _rand(rng, 30, 10)     # columns two floats apart
    out = np.full((20, 10), np.nan, np.float32)
    lib.gemm(a, b, out)
    np.testing.assert_array_equal(out, np.matmul(a, b))
    strided = np.full((20, 20), np.nan, np.float32)[:, ::2]  # an output the library does not write
    lib.gemm(a, b, strided)
    np.testing.assert_array_equal(strided, np.matmul(a, b))
    square = _rand(rng, 40, 40)
    want = np.matmul(square, square)
    lib.gemm(square, square.copy(), square)                   # an output over an operand (numpy buffers it)
    np.testing.assert_array_equal(square, want)
    tiles = _counted(lib)
    try:                                                      # the same layout apart from its operands: the tiles
        lib.gemm(square, square.copy(), np.empty_like(square))
        lib.gemm(square, square.copy(), square)
        assert lib.tile_calls == (1 if lib.tiles else 0)
    finally:
        lib._small_gemm_args = tiles
        lib._product_plans.clear()
    real = native.blas_sgemm()
    lib.lib.deepdsl_set_sgemm(None, 1)                        # a library left without an sgemm to call
    try:
        a, b = _rand(rng, 30, 50), _rand(rng, 50, 20)
        out = np.full((30, 20), np.nan, np.float32)
        tiles, lib.tiles = lib.tiles, False
        try:
            lib.gemm(a, b, out)
        finally:
            lib.tiles = tiles
        np.testing.assert_array_equal(out, np.matmul(a, b))
        if lib.tiles:                                         # the tiles call no sgemm
            assert contract.small_product(30, 20, 50, False, False)
            np.testing.assert_allclose(lib.gemm(a, b, np.full((30, 20), np.nan, np.float32)), np.matmul(a, b),
                                       rtol=0, atol=1e-5 * float(np.abs(out).max()))
    finally:
        lib.lib.deepdsl_set_sgemm(real[0], int(real[1]))


def _blas_threads() -> int | None:
    for blas in native._openblas():
        for name in ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_"):
            getter = getattr(blas, name, None)
            if getter is not None:
                getter.restype = ctypes.c_int
                return getter()
    return None


@needs_cc
def test_the_backend_computes_its_products_on_the_kernels_threads(lib):
    lib.set_threads(2)
    assert _blas_threads() in (1, None)       # the BLAS's own threads would compete with the kernels'
    rt = backend(lib)
    for op in ("matmul", "conv2d", "conv2d_bwd_data", "conv2d_bwd_filter"):
        assert getattr(rt, op).keywords["gemm"] == lib.gemm, op
    tiled = rt.with_gemm(np.matmul)            # another product function bound instead (the tiled GEMM's)
    assert tiled.conv2d.keywords["gemm"] is np.matmul
    lib.products = False
    try:
        assert "gemm" not in backend(lib).conv2d.keywords
    finally:
        lib.products = True


@needs_cc
def test_the_thread_policy_benchmark_runs(tmp_path, lib):
    """benchmarks/thread_policies.py at a tiny size: a row per configuration (products on OpenBLAS's threads or
    the kernels', each spin count), each timed in its own process, the first the reference."""
    import re
    import subprocess
    import sys

    from tests.support.program_helpers import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "thread_policies.py"), "lenet:8", "--threads",
                           "2", "--rounds", "2", "--warmup", "1", "--steps", "2", "--spins", "100", "1000"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^ *(blas|team) +(\d+) +([\d.]+) +([\d.]+) +([\d.]+) ([\d.]+)$", done.stdout, re.M)
    assert [(p, s) for p, s, *_ in rows] == [("blas", "100"), ("blas", "1000"), ("team", "100"), ("team", "1000")]
    assert rows[0][3] == "1.000" and all(float(ms) > 0 for _, _, ms, *_ in rows), done.stdout


# a CBLAS sgemm taking 32-bit integers (an LP64 OpenBLAS's `cblas_sgemm`), row-major calls only
_LP64_SGEMM = r"""
void lp64_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                const float* b, int ldb, float beta, float* c, int ldc) {
    (void)order;
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
            double sum = 0.0;
            for (int p = 0; p < k; ++p)
                sum += (double)(ta == 112 ? a[p * lda + i] : a[i * lda + p]) *
                       (double)(tb == 112 ? b[j * ldb + p] : b[p * ldb + j]);
            c[i * ldc + j] = alpha * (float)sum + (beta == 0.0f ? 0.0f : beta * c[i * ldc + j]);  // as BLAS
        }
}
"""


@needs_cc
def test_products_through_an_lp64_sgemm(lib, tmp_path):
    """The library calls an sgemm taking 32-bit integers as such (the BLAS numpy links may be an LP64 OpenBLAS):
    a naive one here, its results against numpy's in float64."""
    import shutil
    import subprocess

    source = tmp_path / "lp64.c"
    source.write_text(_LP64_SGEMM)
    compiler = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", str(source), "-o", str(tmp_path / "lp64.so")], check=True)
    naive = ctypes.CDLL(str(tmp_path / "lp64.so"))
    lib.set_threads(2)
    real = native.blas_sgemm()
    lib.lib.deepdsl_set_sgemm(ctypes.cast(naive.lp64_sgemm, ctypes.c_void_p).value, 0)
    try:
        for case in ("plain", "tall", "a transposed", "b transposed (a filter gradient)", "both transposed, rows cut",
                     "one matrix by a stack (the convolutions)"):
            a, b = CASES[case](np.random.default_rng(5))
            want = np.matmul(a.astype(np.float64), b.astype(np.float64))
            out = np.full(want.shape, np.nan, np.float32)
            lib.gemm(a, b, out)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()), err_msg=case)
    finally:
        lib.lib.deepdsl_set_sgemm(real[0], int(real[1]))


DEPTH_CASES = [  # (m, n, k, a transposed, b transposed): weight gradients, odd depths, a part shorter than the others
    (64, 64, 2048, True, False), (96, 64, 2048, True, False), (100, 64, 2048, False, True),
    (30, 50, 2000, False, False), (64, 64, 2047, True, True), (17, 9, 40001, False, True)]


@needs_cc
@pytest.mark.parametrize("m, n, k, ta, tb", DEPTH_CASES)
def test_a_product_cut_in_depth_gives_the_same_bits_on_any_threads(lib, m, n, k, ta, tb):
    """A single product whose output is too small to cut (`contract.product_depth_cut`), as the compiled matmul
    computes it given its planned workspace: in parts of its inner dimension, the partial products summed in their
    order; the same bits on 1, 2, 3 and 5 threads (NaN-filled output and workspace), numpy's float64 product to
    float32 rounding; with a workspace too small, not cut (the compiled product, whole)."""
    from deepdsl_runtime import cpu

    rng = np.random.default_rng(m * n + k)
    a = _transposed(rng, m, k) if ta else _rand(rng, m, k)
    b = _transposed(rng, k, n) if tb else _rand(rng, k, n)
    parts = contract.product_depth_cut(1, m, n, k)
    size = contract.product_depth_scratch(1, m, n, k, ta, tb)
    assert not contract.small_product(m, n, k, ta, tb, lib.lanes), "the BLAS computes it, not the kernels' tiles"
    assert parts in (2, 4) and size == (parts - 1) * m * n and contract.product_cuts(1, m, n, k).parts == 1
    rt = cpu.backend(lib)
    results = []
    for threads in (1, 2, 3, 5):
        lib.set_threads(threads)
        out = np.full((m, n), np.nan, np.float32)
        rt.matmul(a.T if ta else a, b.T if tb else b, out=out, ta=ta, tb=tb,
                  workspace=np.full(size, np.nan, np.float32))
        results.append(out)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(results[0], want, rtol=0, atol=np.sqrt(k) * 1e-6 * np.abs(want).max())
    whole = lib.gemm(a, b, np.full((m, n), np.nan, np.float32))
    assert not np.array_equal(whole, results[0]), "the depth cut rounds as its parts do"
    small = np.full((m, n), np.nan, np.float32)
    assert not lib.gemm_in_depth(a, b, small, np.zeros(size - 1, np.float32))
    rt.matmul(a.T if ta else a, b.T if tb else b, out=small, ta=ta, tb=tb, workspace=np.zeros(size - 1, np.float32))
    np.testing.assert_array_equal(small, whole)


TILED_DEPTH_CASES = [  # (m, n, k, a transposed, b transposed): weight gradients the tiles compute, a strip ending
    (64, 64, 1024, True, False), (96, 64, 768, True, False), (64, 128, 1024, True, False),  # inside a vector,
    (60, 70, 1000, True, False), (128, 64, 512, False, True),                               # b read transposed,
    (128, 64, 1024, False, True), (64, 64, 1023, True, True)]           # deeper than 512: vectors of 16 (AVX-512)


@needs_cc
@pytest.mark.parametrize("m, n, k, ta, tb", TILED_DEPTH_CASES)
def test_a_product_of_the_tiles_cut_in_depth_gives_their_bits(lib, m, n, k, ta, tb):
    """A single product of the kernels' tiles with an output too small to share among threads, given its planned
    workspace: on several threads its chunks' partial sums are computed at once, each in a plane of the
    workspace, then added in their order; the bits of the tiles computing it whole on one thread (on 1, 2, 3 and 5
    threads, NaN-filled output and workspace). On one thread the tiles compute it whole (the workspace untouched);
    with a workspace a plane short it is not cut."""
    from deepdsl_runtime import cpu

    if not lib.tiles:
        pytest.skip("this processor has no tiles (AVX2 and fused multiply-adds)")
    if not contract.small_product(m, n, k, ta, tb, lib.lanes):
        pytest.skip("the sgemm computes it on this processor's vectors")
    rng = np.random.default_rng(m * n + k)
    a = _transposed(rng, m, k) if ta else _rand(rng, m, k)
    b = _transposed(rng, k, n) if tb else _rand(rng, k, n)
    chunks = contract.small_product_chunks(1, m, n, k, ta, tb, lib.lanes)
    size = contract.product_depth_scratch(1, m, n, k, ta, tb)
    assert chunks == -(-k // contract.SMALL_PRODUCT_DEPTH) > 1
    assert size == (chunks - 1) * m * n, "the plan holds the chunks on any processor"
    lib.set_threads(1)
    whole = lib.gemm(a, b, np.full((m, n), np.nan, np.float32))
    rt = cpu.backend(lib)
    for threads in (1, 2, 3, 5):
        lib.set_threads(threads)
        out = np.full((m, n), np.nan, np.float32)
        workspace = np.full(size, np.nan, np.float32)
        rt.matmul(a.T if ta else a, b.T if tb else b, out=out, ta=ta, tb=tb, workspace=workspace)
        np.testing.assert_array_equal(out, whole)
        if threads == 1:
            assert np.isnan(workspace).all(), "one thread: the tiles' product whole"
        else:
            assert np.isfinite(workspace).all(), "the chunks' partial sums are in the workspace"
            short = np.full((m, n), np.nan, np.float32)
            assert not lib.gemm_in_depth(a, b, short, np.zeros(size - 1, np.float32))
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(whole, want, rtol=0, atol=np.sqrt(k) * 1e-6 * np.abs(want).max())
    lib.set_threads(2)
    parts = [np.full((m, n), np.nan, np.float32) for _ in range(2)]
    assert lib.gemm_in_depth(a, b, parts[0], np.zeros(size, np.float32))
    for first in range(0, k, contract.SMALL_PRODUCT_DEPTH):      # each chunk summed alone, added in order
        chunk = slice(first, first + contract.SMALL_PRODUCT_DEPTH)
        part = lib.gemm(np.ascontiguousarray(a[:, chunk]), np.ascontiguousarray(b[chunk]),
                        np.empty((m, n), np.float32))
        parts[1] = part if first == 0 else parts[1] + part
    np.testing.assert_array_equal(parts[0], parts[1])


SUM_CASES = [  # (batch, m, n, k, b read transposed): pointwise filter gradients by samples, a stack of one, odd sizes
    (8, 256, 64, 196, True), (5, 64, 130, 200, True), (3, 40, 33, 250, False), (1, 128, 96, 300, True),
    (2, 128, 75, 520, True)]                                   # (three chunks, the last of 8 terms; a short strip)


@needs_cc
@pytest.mark.parametrize("batch, m, n, k, tb", SUM_CASES)
def test_a_sum_of_products_gives_the_same_bits_on_any_threads(lib, batch, m, n, k, tb):
    """`Native.gemm_sum`: the sum over a stack of products, each part of the output's cut summing them in order;
    the same bits on 1, 2, 3 and 5 threads into NaN-filled outputs, numpy's float64 sum to float32 rounding."""
    rng = np.random.default_rng(batch * m + n * k)
    a = _rand(rng, batch, m, k)
    b = _transposed(rng, batch, k, n) if tb else _rand(rng, batch, k, n)
    results = []
    for threads in (1, 2, 3, 5):
        lib.set_threads(threads)
        out = np.full((m, n), np.nan, np.float32)
        assert lib.gemm_sum(a, b, out)
        results.append(out)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    want = np.einsum("bmk,bkn->mn", a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(results[0], want, rtol=0, atol=np.sqrt(batch * k) * 1e-6 * np.abs(want).max())
    assert not lib.gemm_sum(a, b[:, :, :n - 1], np.zeros((m, n), np.float32)), "a shape that does not match"
    assert not lib.gemm_sum(a[:, :, ::2], b[:, ::2], np.zeros((m, n), np.float32)), "a view the sgemm cannot read"


@needs_cc
@pytest.mark.parametrize("batch, m, n, k, tb", SUM_CASES)
def test_a_sum_of_products_in_the_tiles_adds_each_products_chunks_in_order(lib, avx2, batch, m, n, k, tb):
    """Where `contract.tiled_sum` takes the sum (AVX-512), the tiles compute it (`deepdsl_small_gemm_sum`): each
    product's chunks of partial sums added to the output in their order, product after product (the first chunk
    written into it): the bits of each chunk's product in the tiles added in float32 in that order; the same on 1, 2
    and 3 threads. Built for AVX2, the sgemm computes it."""
    if not lib.tiles or not contract.tiled_sum(m, n, k, False, tb, lib.lanes):
        pytest.skip("the sgemm computes these products on this processor's vectors")
    rng = np.random.default_rng(batch * m + n * k + 1)
    a = _rand(rng, batch, m, k)
    b = _transposed(rng, batch, k, n) if tb else _rand(rng, batch, k, n)
    want = np.zeros((m, n), np.float32)
    for i in range(batch):
        for first in range(0, k, contract.SMALL_PRODUCT_DEPTH):
            x, y = (np.ascontiguousarray(z) for z in (a[i][:, first:first + contract.SMALL_PRODUCT_DEPTH],
                                                      b[i][first:first + contract.SMALL_PRODUCT_DEPTH]))
            assert contract.small_product(m, n, x.shape[1], False, False)
            want += lib.gemm(x, y, np.empty((m, n), np.float32))
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            out = np.full((m, n), np.nan, np.float32)
            assert lib.gemm_sum(a, b, out)
            np.testing.assert_array_equal(out, want)
    finally:
        lib.set_threads(native.threads_available())
    assert not contract.tiled_sum(m, n, k, False, tb, 8)
    avx2.set_threads(2)
    out = np.full((m, n), np.nan, np.float32)
    assert avx2.gemm_sum(a, b, out) and not np.array_equal(out, want), "built for AVX2: the sgemm's sums"
    np.testing.assert_allclose(out, want, rtol=0, atol=np.sqrt(batch * k) * 1e-6 * np.abs(want).max())


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("m, n, k", [(64, 64, 1024), (64, 64, 1023), (64, 64, 300), (4096, 64, 2048), (8, 8, 64),
                                     (30, 50, 2000), (200, 200, 4096), (1, 1, 1 << 22)])
def test_a_depth_cut_follows_its_shape_alone(batch, m, n, k):
    """Only a single product that `product_cuts` leaves whole is cut in depth, in 4 or 2 parts of at least
    PRODUCT_DEPTH_PART of the inner dimension and PRODUCT_PART_WORK multiply-adds; its workspace holds the partial
    products but the first, or where the kernels' tiles compute it (read transposed as a weight gradient is) the
    partial sums of its chunks but the first; the matmul op plans that workspace, or none beyond its limit."""
    from deepdsl.ir import make
    from deepdsl.ops import get_op

    parts = contract.product_depth_cut(batch, m, n, k)
    assert parts in (1, 2, 4)
    if batch > 1 or contract.product_cuts(batch, m, n, k).parts > 1:
        assert parts == 1
    if parts > 1:
        assert k // parts >= contract.PRODUCT_DEPTH_PART and m * n * k // parts >= contract.PRODUCT_PART_WORK
    elif batch == 1 and contract.product_cuts(1, m, n, k).parts == 1:
        assert k // 2 < contract.PRODUCT_DEPTH_PART or m * n * k // 2 < contract.PRODUCT_PART_WORK
    for ta, tb in ((True, False), (False, True)):
        chunks = [contract.small_product_chunks(batch, m, n, k, ta, tb, lanes) for lanes in (8, 16)]
        for lanes, count in zip((8, 16), chunks):
            assert count == 1 or (parts > 1 and contract.small_product(m, n, k, ta, tb, lanes) and
                                  count == -(-k // contract.SMALL_PRODUCT_DEPTH) <= contract.SMALL_PRODUCT_CHUNKS)
        planes = max(parts, *chunks) - 1        # (the plan serves either processor)
        assert contract.product_depth_scratch(batch, m, n, k, ta, tb) == planes * m * n
    planes = max(parts, *(contract.small_product_chunks(batch, m, n, k, True, False, lanes) for lanes in (8, 16))) - 1
    a = make("input", (), name="a", shape=(batch, k, m) if batch > 1 else (k, m), dtype="float32", role="data")
    b = make("input", (), name="b", shape=(batch, k, n) if batch > 1 else (k, n), dtype="float32", role="data")
    node = make("matmul", (a, b), ta=True)
    need = 4 * planes * m * n
    assert get_op("matmul").workspace(node).nbytes == need
    assert get_op("matmul").workspace(node, limit=need).nbytes == need
    assert get_op("matmul").workspace(node, limit=max(need - 1, 0)).nbytes == 0


@needs_cc
@pytest.mark.parametrize("isa", ISAS)
def test_the_small_kernels_benchmark_runs(tmp_path, lib, isa):
    """benchmarks/small_kernels.py at a tiny size (also with both sides restricted to AVX2): the mask, the fourteen
    products, the three transposes, the four attentions and the two bias sums timed on both sides, each pair
    agreeing (the same bytes; the products, the attentions and the sums within float32 rounding)."""
    import re
    import subprocess
    import sys

    from tests.support.program_helpers import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "small_kernels.py"), "--threads", "1",
                           "--rounds", "1", "--calls", "2", "--isa", isa], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    wide = isa == "native" and contract.dot_product(16, 4096, 9216, False, True, lib.lanes)    # (AVX-512)
    rows = re.findall(r"^ *((?:mask|transpose|attention|bias sum) [\dx]+(?: dropped)?|"
                      r"\d+x\d+T? by \d+x\d+T?, (?:tiles|sgemm|dot))"
                      r" +1 +([\d.]+) +([\d.]+) +([\d.]+)x +(\w+)$", done.stdout, re.M)
    assert len(rows) == 26 and all(agree == "yes" for *_, agree in rows), done.stdout
    assert [r[0] for r in rows[20:]] == ["attention 64x4x16x16", "attention 32x4x16x16 dropped",
                                         "attention 32x4x64x16", "attention 32x4x64x16 dropped",
                                         "bias sum 1024x64", "bias sum 2048x128"]
    assert [r[0] for r in rows[1:4]] == ["1024x64 by 64x64T, tiles", "1024x64 by 64x64, tiles",
                                         "64x1024T by 1024x64, tiles"]
    lanes = lib.lanes if isa == "native" else 8           # (transposed b's of any depth: tiles with AVX-512)
    fc1, conv2 = (("tiles" if contract.small_product(m, n, k, False, True, lanes) else "sgemm")
                  for m, n, k in ((64, 500, 800), (500, 50, 4096)))
    assert [r[0] for r in rows[9:17]] == ["256x2048T by 2048x64, sgemm", "64x500 by 500x800, tiles",
                                          "500x64T by 64x800, tiles", f"64x800 by 800x500T, {fc1}",
                                          f"500x4096 by 4096x50T, {conv2}", "64x2048T by 2048x64, sgemm",
                                          "4096x16T by 16x9216, tiles",
                                          f"16x9216 by 9216x4096T, {'dot' if wide else 'sgemm'}"]
    assert [r[0] for r in rows[17:20]] == ["transpose 64x16x4x16", "transpose 64x4x16x16", "transpose 32x64x4x16"]


SMALL_CASES = {  # name: (a, b) from a generator, each product taken by contract.small_product
    "a projection (b transposed)": lambda r: (_rand(r, 1024, 64), _transposed(r, 64, 64)),
    "a weight gradient (a transposed, partial sums of four depths)": lambda r: (_transposed(r, 64, 1024),
                                                                               _rand(r, 1024, 64)),
    "odd sizes: columns past a strip, a depth of three partial sums": lambda r: (_rand(r, 61, 513), _rand(r, 513, 77)),
    "b transposed under many rows": lambda r: (_rand(r, 300, 200), _transposed(r, 200, 70)),
    # b's strips packed 8 x 8 floats at a time, the rest one at a time: a last chunk of 244 terms, a strip of 11
    "b transposed, a depth and columns past blocks of 8": lambda r: (_rand(r, 130, 500), _transposed(r, 500, 75)),
    "both transposed": lambda r: (_transposed(r, 13, 9), _transposed(r, 9, 130)),
    "a stack of five": lambda r: (_rand(r, 5, 33, 60), _rand(r, 5, 60, 41)),
    "one matrix by a stack": lambda r: (_rand(r, 96, 72), _rand(r, 5, 72, 49)),
    "a view of a wider matrix": lambda r: (_rand(r, 30, 100)[:, 7:87], _rand(r, 80, 64)),
    "one row": lambda r: (_rand(r, 1, 64), _rand(r, 64, 300)),
    "one column": lambda r: (_rand(r, 200, 64), _rand(r, 64, 1)),
    "a depth of one": lambda r: (_rand(r, 50, 1), _rand(r, 1, 70)),
    "a wide weight gradient from 16 rows: b in two panels of strips, the last one short": lambda r: (
        _transposed(r, 130, 16), _rand(r, 16, 8200)),
    "a wide output: panels of strips two chunks deep, the last one short": lambda r: (_rand(r, 1100, 300),
                                                                                      _rand(r, 300, 1000)),
    "projections of a stack (b transposed), a short strip": lambda r: (_rand(r, 3, 50, 64), _transposed(r, 3, 64, 40)),
    # a read transposed with its columns 64 floats apart or more: each group's rows packed for its strips (AVX2)
    "pointwise filters' input gradient: a transposed by a stack, a short tile, a short strip, a short chunk": (
        lambda r: (_transposed(r, 100, 300), _rand(r, 3, 300, 49))),
    "a transposed a packed over three chunks and thirteen strips": lambda r: (_transposed(r, 256, 700),
                                                                             _rand(r, 700, 200)),
}
PACKED_CASES = [  # the cases above whose a (transposed) the AVX2 tiles read from a copy
    "pointwise filters' input gradient: a transposed by a stack, a short tile, a short strip, a short chunk",
    "a transposed a packed over three chunks and thirteen strips",
    "a weight gradient (a transposed, partial sums of four depths)",
]


def _counted(lib, function: str = "_small_gemm_args", counter: str = "tile_calls"):
    """Count the calls of one of the library's product functions (the tiles, `deepdsl_small_gemm_args`, by default)
    in lib.<counter> (the products planned before forgotten, so that their plans call the counter); the function."""
    called = getattr(lib, function)
    setattr(lib, counter, 0)

    def counting(*args):
        setattr(lib, counter, getattr(lib, counter) + 1)
        return called(*args)
    setattr(lib, function, counting)
    lib._product_plans.clear()
    return called


@pytest.fixture(scope="module")
def avx2(tmp_path_factory):
    """The generic kernels built for a processor with AVX2 but not AVX-512."""
    built = generic_kernels(tmp_path_factory, *AVX2)
    if not built.products:
        pytest.skip("numpy's BLAS has no CBLAS sgemm this process can call")
    return built


@needs_cc
@pytest.mark.parametrize("case", [c for c in list(SMALL_CASES) + list(CASES)
                                  if len(SMALL_CASES.get(c, CASES.get(c))(np.random.default_rng(0))[0].shape) == 2 and
                                  len(SMALL_CASES.get(c, CASES.get(c))(np.random.default_rng(0))[1].shape) == 2])
def test_a_product_plus_a_bias_has_the_bits_of_the_product_and_then_the_add(lib, avx2, case):
    """`Native.gemm_bias`, a bias added to every row of a product as it is stored (the tiles) or after it (the
    BLAS's parts), and `matmul` with a bias: the bits of `Native.gemm` and then numpy's float32 add, into a
    NaN-filled output, on 1, 2 and 3 threads and built for AVX2. An output over the bias is left to the caller."""
    from deepdsl_runtime.cpu import linalg

    a, b = SMALL_CASES.get(case, CASES.get(case))(np.random.default_rng(17))
    m, n = a.shape[0], b.shape[1]
    bias = np.random.default_rng(18).standard_normal(n).astype(np.float32)
    want = lib.gemm(a, b, np.full((m, n), np.nan, np.float32))
    want += bias
    k, ta, tb = a.shape[1], native._matrix(a)[0] == 1, native._matrix(b)[0] == 1
    same = contract.small_product(m, n, k, ta, tb, lib.lanes) == contract.small_product(m, n, k, ta, tb, avx2.lanes)
    try:        # (built for AVX2 where the tiles or the sgemm compute it as here: which does depends on the vectors)
        for built, threads in [(lib, 1), (lib, 2), (lib, 3)] + [(avx2, 2)] * same:
            built.set_threads(threads)
            got = np.full((m, n), np.nan, np.float32)
            assert built.gemm_bias(a, b, got, bias), (case, threads)
            np.testing.assert_array_equal(got, want)
            through = np.full((m, n), np.nan, np.float32)
            linalg.matmul(a, b, bias, out=through, gemm=built.gemm, native=built)
            np.testing.assert_array_equal(through, want)
    finally:
        lib.set_threads(native.threads_available())
    both = np.full(m * n, np.nan, np.float32)
    out, over = both.reshape(m, n), both[m * n - n:]                   # the bias in the output's last row
    over[...] = bias
    assert not lib.gemm_bias(a, b, out, over)
    plain = np.full((m, n), np.nan, np.float32)
    linalg.matmul(a, b, bias, out=plain)                                # numpy's product, then the add
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-4 * max(1.0, float(np.abs(want).max())))


@needs_cc
@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_products_in_tiles_equal_numpy_with_the_same_bits_on_any_threads_and_with_avx2(lib, avx2, case):
    """The products `contract.small_product` takes run in the kernels' tiles (and only they: the cases above that
    the rule does not take run the sgemm): every element written, numpy's float64 product to float32 rounding, the
    same bits on 1, 2, 3 and 5 threads, and the same bits built for AVX2 (16 columns a tile, not 64)."""
    a, b = SMALL_CASES[case](np.random.default_rng(13))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    assert contract.small_product(m, n, k, native._matrix(a)[0] == 1, native._matrix(b)[0] == 1)
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, n)
    tiles = _counted(lib)
    try:
        results = []
        for threads in (1, 2, 3, 5):
            lib.set_threads(threads)
            results.append(lib.gemm(a, b, np.full(shape, np.nan, np.float32)))
        assert lib.tile_calls == 4
        for other in CASES:
            x, y = CASES[other](np.random.default_rng(1))
            before = lib.tile_calls
            lib.gemm(x, y, np.empty((*np.broadcast_shapes(x.shape[:-2], y.shape[:-2]), x.shape[-2], y.shape[-1]),
                                    np.float32))
            taken = contract.small_product(x.shape[-2], y.shape[-1], x.shape[-1], native._matrix(x)[0] == 1,
                                           native._matrix(y)[0] == 1, lib.lanes)
            assert (lib.tile_calls > before) == taken, other
    finally:
        lib._small_gemm_args = tiles
        lib._product_plans.clear()
    assert np.isfinite(results[0]).all(), "an element was not written"
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(results[0], want, rtol=0, atol=np.sqrt(k) * 1e-6 * max(1.0, float(np.abs(want).max())))
    if avx2.tiles:
        avx2.set_threads(2)
        np.testing.assert_array_equal(avx2.gemm(a, b, np.full(shape, np.nan, np.float32)), results[0])


@needs_cc
@pytest.mark.parametrize("case", PACKED_CASES)
def test_a_transposed_a_gives_the_bits_of_the_same_a_read_in_place(lib, avx2, case):
    """The tiles read a transposed a (its columns one after the other) from a copy of each group's rows where it
    has several strips and deep chunks (kernels/cpu_gemm.c, `deepdsl_sg_pack_a`, AVX2 builds): each output the same
    sums in the same order, so the bits of the same matrix stored by rows, which is read in place, on any threads."""
    a, b = SMALL_CASES[case](np.random.default_rng(17))
    assert native._matrix(a)[0] == 1
    rows = np.ascontiguousarray(a)
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    try:
        for built in (lib, avx2):
            built.set_threads(2)
            want = built.gemm(rows, b, np.full(shape, np.nan, np.float32))
            for threads in (1, 2, 3):
                built.set_threads(threads)
                np.testing.assert_array_equal(built.gemm(a, b, np.full(shape, np.nan, np.float32)), want)
    finally:
        lib.set_threads(native.threads_available())


@needs_cc
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True)])
def test_the_tiles_sum_in_partial_sums_of_256_terms_in_order(lib, ta, tb):
    """Each output is the sum of partial sums over 256 consecutive terms of the inner dimension, each summed from
    zero in order, added in order: ones times 2^24, 511 ones and 2^-1 give 2^24 (2^24 + 1 rounds to 2^24, 255 times)
    + 256 (the second part, exactly) + 0.5 = 16777472 (the half is lost), where one sum in order gives 2^24."""
    k = 513
    column = np.ones(k, np.float32)
    column[0], column[-1] = 2.0 ** 24, 0.5
    a = np.ones((8, k), np.float32)
    b = np.repeat(column[:, None], 8, axis=1)
    a, b = (np.ascontiguousarray(a.T).T if ta else a), (np.ascontiguousarray(b.T).T if tb else b)
    assert contract.small_product(8, 8, k, ta, tb)
    lib.set_threads(2)
    out = lib.gemm(a, b, np.full((8, 8), np.nan, np.float32))
    assert np.all(out == 16777472.0), out[0, :3]


def test_which_products_run_in_tiles():
    """contract.small_product on the shapes its rule names: any product of at most SMALL_PRODUCT_WORK
    multiply-adds; a ViT's projections, its weight gradients, a wide layer's weight gradient from few samples; not an
    output too small for its depth, a large a read transposed, a b read transposed under few rows or deep, a large b,
    a large output from more samples."""
    assert contract.small_product(64, 64, 64, True, True)
    assert contract.small_product(2, 2, 1 << 16, False, False)        # 4 k > m n, but small
    assert contract.small_product(1024, 64, 64, False, True) and contract.small_product(1024, 64, 64, False, False)
    assert contract.small_product(64, 64, 1024, True, False) and contract.small_product(64, 128, 1024, True, False)
    assert not contract.small_product(27, 32, 21952, False, True)     # 4 k > m n
    assert not contract.small_product(64, 64, 2048, True, False)
    assert not contract.small_product(1024, 128, 2048, True, False)   # a transposed: 2^21 floats
    assert contract.small_product(1024, 128, 512, True, False)
    assert not contract.small_product(256, 64, 2048, True, False)     # a transposed, deeper than 1024
    assert not contract.small_product(64, 500, 800, False, True)      # b transposed under 64 rows
    assert not contract.small_product(512, 128, 1568, False, True)    # b transposed, deeper than 512
    assert contract.small_product(512, 128, 512, False, True)
    assert not contract.small_product(512, 4096, 512, False, True)    # b transposed: 2^21 floats
    assert not contract.small_product(16, 4096, 4096, False, False)   # b: 2^24 floats
    assert contract.small_product(16, 1280, 1000, False, False)
    assert contract.small_product(4096, 9216, 16, True, False)        # a weight gradient from 16 samples
    assert contract.small_product(4096, 4096, 64, True, False)
    assert not contract.small_product(4096, 4096, 128, True, False)   # 2^24 floats of output, deeper than 64
    assert contract.small_product(2048, 4096, 128, True, False)       # 2^23 floats
    # with vectors of 16 lanes (AVX-512) a b read transposed from 16 rows, of any depth; with 8 as above
    assert contract.small_product(64, 500, 800, False, True, 16) and contract.small_product(512, 128, 1568, False,
                                                                                             True, 16)
    assert contract.small_product(16, 500, 800, False, True, 16) and not contract.small_product(15, 500, 800, False,
                                                                                                 True, 16)
    assert not contract.small_product(16, 4096, 4096, False, True, 16)   # ... but not the other rules' exclusions
    assert not contract.small_product(27, 32, 21952, False, True, 16)
    # sums of products by samples in tiles: with 16 lanes, where the tiles take each product
    assert contract.tiled_sum(512, 128, 196, False, True, 16) and not contract.tiled_sum(512, 128, 196, False, True)
    assert not contract.tiled_sum(8, 1024, 196, False, True, 16)


DOT_CASES = {  # name: (a, b) from a generator, b read transposed: taken by contract.dot_product (b of any size here)
    "16 rows, three chunks, the last one short and ending inside a vector": lambda r: (
        _rand(r, 16, 2 * 4096 + 300 + 5), _transposed(r, 2 * 4096 + 300 + 5, 37)),
    "one row, one chunk exactly": lambda r: (_rand(r, 1, 4096), _transposed(r, 4096, 9)),
    "three rows, a depth inside one vector": lambda r: (_rand(r, 3, 11), _transposed(r, 11, 19)),
    "five rows of a wider matrix, b a view": lambda r: (_rand(r, 5, 700)[:, 50:650], _rand(r, 21, 800)[:, 100:700].T),
    "a stack of two": lambda r: (_rand(r, 2, 7, 513), _transposed(r, 2, 513, 10)),
}


def _dot_order(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (m x k) by b (k x n) in the dot products' order (kernels/cpu_gemm.c), emulated with float32 adds (exact
    where every product is: a's elements powers of two): per chunk of 4096 terms, lane l the sum from zero of terms
    k = l (mod 16) in order, the lanes added as a tree (l + 8, l + 4, l + 2, then 0 and 1), the chunks' sums in
    order."""
    m, k = a.shape
    total = None
    for k0 in range(0, k, 4096):
        lanes = np.zeros((m, b.shape[1], 16), np.float32)
        for p in range(k0, min(k, k0 + 4096)):
            lanes[:, :, p % 16] += (a[:, p:p + 1] * b[p]).astype(np.float32)
        for half in (8, 4, 2, 1):
            lanes = lanes[:, :, :half] + lanes[:, :, half:2 * half]
        total = lanes[:, :, 0] if total is None else total + lanes[:, :, 0]
    return total


@pytest.fixture
def dot_everywhere(lib, monkeypatch):
    """contract.dot_product taking its products of any size, also with AVX2; the library's dot product calls counted
    in lib.dot_calls (the products planned before forgotten, before and after)."""
    monkeypatch.setattr(contract, "DOT_PRODUCT_FLOATS", 0)
    monkeypatch.setattr(contract, "DOT_PRODUCT_LANES", 8)
    dot = _counted(lib, "_dot_gemm_args", "dot_calls")
    yield lib
    lib._dot_gemm_args = dot
    lib._product_plans.clear()
    lib.set_threads(native.threads_available())


@needs_cc
@pytest.mark.parametrize("case", list(DOT_CASES))
def test_dot_products_equal_numpy_with_the_same_bits_on_any_threads_and_with_avx2(dot_everywhere, avx2, case):
    """The products `contract.dot_product` takes (few rows of a by b read transposed) run as the kernels' dot
    products: every element written, numpy's float64 product to float32 rounding, the same bits on 1, 2, 3 and 5
    threads and built for AVX2 (two vectors of 8 lanes for each 16), and with a bias the bits of the product and then
    the add."""
    lib = dot_everywhere
    if not lib.tiles:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    a, b = DOT_CASES[case](np.random.default_rng(23))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, n)
    results = []
    for threads in (1, 2, 3, 5):
        lib.set_threads(threads)
        results.append(lib.gemm(a, b, np.full(shape, np.nan, np.float32)))
    assert lib.dot_calls == 4
    assert np.isfinite(results[0]).all(), "an element was not written"
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(results[0], want, rtol=0, atol=np.sqrt(k) * 1e-6 * scale)
    if avx2.tiles:
        avx2.set_threads(2)
        np.testing.assert_array_equal(avx2.gemm(a, b, np.full(shape, np.nan, np.float32)), results[0])
    if len(shape) == 2:
        bias = np.random.default_rng(24).standard_normal(n).astype(np.float32)
        got = np.full(shape, np.nan, np.float32)
        assert lib.gemm_bias(a, b, got, bias)
        np.testing.assert_array_equal(got, results[0] + bias)


@needs_cc
def test_the_dot_products_sum_lanes_of_chunks_in_their_order(dot_everywhere):
    """Each output is the chunks' sums in order, each chunk 16 lanes added as a tree (`_dot_order`): with a's
    elements powers of two every product is exact, so the kernel's bits are the emulation's, and here differ from a
    sum in order."""
    lib = dot_everywhere
    if not lib.tiles:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    rng = np.random.default_rng(5)
    k = 4096 + 77
    a = np.ldexp(1.0, rng.integers(-3, 4, (4, k))).astype(np.float32)
    b = (rng.standard_normal((k, 6)) * np.ldexp(1.0, rng.integers(0, 20, (k, 6)))).astype(np.float32)
    bt = np.ascontiguousarray(b.T).T
    lib.set_threads(2)
    got = lib.gemm(a, bt, np.full((4, 6), np.nan, np.float32))
    assert lib.dot_calls == 1
    want = _dot_order(a, b)
    np.testing.assert_array_equal(got, want)
    in_order = np.zeros((4, 6), np.float32)
    for p in range(k):
        in_order += (a[:, p:p + 1] * b[p]).astype(np.float32)
    assert not np.array_equal(want, in_order)           # (the order shows)


def test_which_products_run_as_dot_products():
    """contract.dot_product: a fully connected layer's forward on a small batch, its weights read transposed and
    larger than the caches (AlexNet's fc6 and fc7 at batch 16), with AVX-512's vectors; not more rows, not b read in
    place (the input gradient), not a read transposed, not small weights (fc8), not with AVX2's vectors."""
    assert contract.dot_product(16, 4096, 9216, False, True) and contract.dot_product(16, 4096, 4096, False, True)
    assert contract.dot_product(1, 4096, 4096, False, True)
    assert not contract.dot_product(17, 4096, 9216, False, True)
    assert not contract.dot_product(16, 9216, 4096, False, False)
    assert not contract.dot_product(16, 4096, 9216, True, True)
    assert not contract.dot_product(16, 1000, 4096, False, True)
    assert not contract.dot_product(16, 4096, 9216, False, True, lanes=8)     # AVX2: the sgemm


def test_the_address_of_an_array_is_its_ctypes_address(tmp_path):
    """`native._address`, what every compiled call passes for an array, equals `ndarray.ctypes.data` on arrays of
    every kind the runtime hands a kernel: contiguous, views at an offset, transposed, zero-dimensional, a memory map,
    an array the memory plan's arena slices; and anything else goes through `ctypes.data` itself."""
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    mapped = np.memmap(tmp_path / "mapped", dtype=np.float32, mode="w+", shape=(7, 9))
    arena = np.zeros(1 << 12, np.uint8)
    probes = [base, base[1:, 2:, 3:], base.T, base[..., ::2], np.ones((), np.float32), mapped, mapped[2:, 1:],
              arena[256:512].view(np.float32).reshape(8, 8), np.empty(0, np.float32), np.zeros(3, np.uint8)[1:]]
    for x in probes:
        assert native._address(x) == x.ctypes.data
    assert native._DATA_OFFSET is not None, "numpy's array struct as this module expects it"

    class Addressed:
        ctypes = type("ctypes", (), {"data": 1234})()
    assert native._address(Addressed()) == 1234
