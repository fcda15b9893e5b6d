"""Convolutions and their input gradients computed sample by sample in the matrix products' tiles
(runtime/kernels/cpu_gemm.c, `deepdsl_conv_tiles` and `deepdsl_conv_data_tiles`, `contract.tiled_conv`): each
sample's im2col matrix (column gradients) in a thread's part of the workspace, multiplied straight into the sample's
output (added into its input gradient). Against the tiles' products of each sample's im2col matrix (and of
the whole batch's where the tiles compute that) plus the bias (the same bits), numpy's convolution (float32
rounding), on 1, 2 and 3 threads, into NaN-filled outputs and workspaces, with a workspace holding a single sample's
matrix, and built for AVX2 (the same bits); the input gradients against the tiles' products and numpy's col2im.
"""
from __future__ import annotations

import numpy as np
import pytest

from deepdsl_runtime import contract
from deepdsl_runtime.cpu import conv
from deepdsl_runtime.cpu.scratch import Scratch
from tests.test_direct_conv import avx2_kernels  # noqa: F401  (a fixture)
from tests.test_native_kernels import lib, needs_cc  # noqa: F401

GEOMETRIES = [  # (n, c, h, w, o, kh, kw, stride, pad, bias): LeNet's conv2, a stem of stride 2, AlexNet's first
    (5, 20, 12, 12, 50, 5, 5, 1, 0, True),      # layer's stride 4, planes ending inside a strip, few and odd output
    (2, 3, 30, 30, 13, 7, 7, 2, 3, True),       # channels, a rectangle, no bias
    (2, 3, 43, 43, 7, 11, 11, 4, 0, False),
    (3, 8, 9, 11, 9, 3, 2, 1, 1, True),
    (2, 16, 14, 14, 40, 3, 3, 2, 1, True)]


def _case(n, c, h, wd, o, kh, kw, stride, pad, bias, seed=0):
    rng = np.random.default_rng(seed)
    ho, wo = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = (rng.standard_normal((o, c, kh, kw)) / np.sqrt(c * kh * kw)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32) if bias else None
    return x, w, b, (n, o, ho, wo)


def _tiled(kernels, x, w, b, shape, stride, pad, samples):
    """The convolution by `kernels` with a NaN-filled workspace of `samples` samples' im2col matrices, into a
    NaN-filled output; and whether the tiles computed it."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    out = np.full(shape, np.nan, np.float32)
    workspace = np.full(samples * c * kh * kw * shape[2] * shape[3], np.nan, np.float32)
    done = kernels.conv_tiles(x, w, b, out, stride, pad, workspace)
    return out, done


@needs_cc
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_a_convolution_in_the_tiles_gives_their_product_bits(lib, avx2_kernels, geometry):  # noqa: F811
    n, c, h, wd, o, kh, kw, stride, pad, bias = geometry
    if not lib.tiles:
        pytest.skip("this processor has no tiles (AVX2 and fused multiply-adds)")
    x, w, b, shape = _case(*geometry)
    _, _, ho, wo = shape
    assert contract.tiled_conv(c, o, kh, kw, stride, pad, ho, wo)
    # the tiles' products of each sample's im2col matrix (numpy's), and of the whole batch's where the tiles compute
    # that too; the bias added as numpy adds it
    cols = np.empty((c, kh, kw, n, ho, wo), np.float32)
    conv._NUMPY.im2col(x, cols.transpose(3, 0, 1, 2, 4, 5), stride, pad,
                       Scratch(np.empty(n * c * (h + 2 * pad) * (wd + 2 * pad), np.float32)))
    rows = cols.reshape(c * kh * kw, n, ho * wo)
    want = np.stack([lib.gemm(w.reshape(o, -1), np.ascontiguousarray(rows[:, s]), np.empty((o, ho * wo), np.float32))
                     for s in range(n)]).reshape(shape)
    if contract.small_product(o, n * ho * wo, c * kh * kw, False, False):
        whole = lib.gemm(w.reshape(o, -1), rows.reshape(c * kh * kw, -1), np.empty((o, n * ho * wo), np.float32))
        np.testing.assert_array_equal(whole.reshape(o, n, ho, wo).transpose(1, 0, 2, 3), want)
    want = want + b[:, None, None] if b is not None else want
    for threads in (1, 2, 3):
        lib.set_threads(threads)
        for samples in (n, 1):                                  # room for every sample's matrix, or for one
            got, done = _tiled(lib, x, w, b, shape, stride, pad, samples)
            assert done
            np.testing.assert_array_equal(got, want)
    lib.set_threads(1)
    got, done = _tiled(avx2_kernels, x, w, b, shape, stride, pad, n)
    assert done, "AVX2's tiles"
    np.testing.assert_array_equal(got, want)
    reference = np.full(shape, np.nan, np.float32)
    conv.conv2d(x, w, b, out=reference, stride=stride, pad=pad,
                workspace=np.empty(n * contract.conv2d_scratch(x.shape, w.shape, shape, stride, pad), np.float32))
    np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


@needs_cc
def test_the_program_convolutions_take_the_tiles_with_the_compiled_products(lib, monkeypatch):  # noqa: F811
    """runtime/cpu/conv.py's conv2d and input gradient with the compiled kernels and their products: in the tiles
    given the planned workspace (the bits of the tiles' products); with numpy's products, by im2col and numpy's
    product (within float32 rounding)."""
    if not lib.tiles:
        pytest.skip("this processor has no tiles")
    geometry = GEOMETRIES[0]
    n, c, h, wd, o, kh, kw, stride, pad, _ = geometry
    x, w, b, shape = _case(*geometry, seed=1)
    g = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    forward, done = _tiled(lib, x, w, b, shape, stride, pad, 1)
    assert done
    per_data = contract.conv2d_bwd_data_scratch(shape, w.shape, (h, wd), stride, pad)
    backward = np.full(x.shape, np.nan, np.float32)
    assert lib.conv_data_tiles(g, w, backward, stride, pad, np.full(n * per_data, np.nan, np.float32))
    ran = []
    for name in ("conv_tiles", "conv_data_tiles"):
        monkeypatch.setattr(lib, name, lambda *args, run=getattr(lib, name): ran.append(1) or run(*args))
    per_sample = contract.conv2d_scratch(x.shape, w.shape, shape, stride, pad)
    for gemm, tiles in ((lib.gemm, True), (np.matmul, False)):
        out, dx, ran[:] = np.full(shape, np.nan, np.float32), np.full(x.shape, np.nan, np.float32), []
        conv.conv2d(x, w, b, out=out, stride=stride, pad=pad, gemm=gemm, native=lib,
                    workspace=np.full(n * per_sample, np.nan, np.float32))
        conv.conv2d_bwd_data(g, w, out=dx, stride=stride, pad=pad, size=(h, wd), gemm=gemm, native=lib,
                             workspace=np.full(n * per_data, np.nan, np.float32))
        assert ran == [1, 1] * tiles, "the tiles with the compiled products only"
        for got, want in ((out, forward), (dx, backward)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
            if tiles:
                np.testing.assert_array_equal(got, want)
    short = np.full(c * kh * kw * shape[2] * shape[3] - 1, np.nan, np.float32)
    assert not lib.conv_tiles(x, w, b, np.empty(shape, np.float32), stride, pad, short)


def test_the_rule_leaves_pointwise_grouped_and_large_products():
    assert contract.tiled_conv(20, 50, 5, 5, 1, 0, 8, 8)
    assert not contract.tiled_conv(64, 64, 1, 1, 1, 0, 8, 8), "pointwise: a product on the input itself"
    assert not contract.tiled_conv(32, 32, 3, 3, 1, 1, 8, 8, groups=32), "grouped"
    assert not contract.tiled_conv(512, 64, 3, 3, 1, 1, 56, 56), "a product the tiles do not compute"
    assert contract.tiled_conv(64, 64, 7, 7, 2, 3, 24, 24, op="conv2d_bwd_data")
    assert not contract.tiled_conv(64, 64, 7, 7, 2, 3, 28, 28, op="conv2d_bwd_data"), "a sample's matrix too large"


@needs_cc
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_an_input_gradient_in_the_tiles_gives_their_product_and_col2im_bits(lib, avx2_kernels, geometry):  # noqa: F811
    n, c, h, wd, o, kh, kw, stride, pad, _ = geometry
    if not lib.tiles:
        pytest.skip("this processor has no tiles (AVX2 and fused multiply-adds)")
    x, w, _, shape = _case(*geometry, seed=2)
    g = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    _, _, ho, wo = shape
    ckk = c * kh * kw
    assert contract.tiled_conv(c, o, kh, kw, stride, pad, ho, wo, op="conv2d_bwd_data")
    columns = np.stack([lib.gemm(w.reshape(o, ckk).T, g[s].reshape(o, ho * wo), np.empty((ckk, ho * wo), np.float32))
                        for s in range(n)]).reshape(n, c, kh, kw, ho, wo)
    want = np.full(x.shape, np.nan, np.float32)
    conv._NUMPY.col2im(columns, want, stride, pad)
    for kernels, counts in ((lib, (1, 2, 3)), (avx2_kernels, (2,))):
        for threads in counts:
            kernels.set_threads(threads)
            for samples in (n, 1):
                got = np.full(x.shape, np.nan, np.float32)
                workspace = np.full(samples * ckk * ho * wo, np.nan, np.float32)
                assert kernels.conv_data_tiles(g, w, got, stride, pad, workspace)
                np.testing.assert_array_equal(got, want)
    lib.set_threads(1)
    reference = np.full(x.shape, np.nan, np.float32)
    conv.conv2d_bwd_data(g, w, out=reference, stride=stride, pad=pad, size=(h, wd), workspace=np.empty(
        n * contract.conv2d_bwd_data_scratch(shape, w.shape, (h, wd), stride, pad), np.float32))
    np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    assert not lib.conv_data_tiles(g, w, np.empty(x.shape, np.float32), stride, pad,
                                   np.zeros(ckk * ho * wo - 1, np.float32)), "no room for a sample"
