"""Convolutions computed sample by sample in the matrix products' tiles (runtime/kernels/cpu_gemm.c,
`deepdsl_conv_tiles`, `contract.tiled_conv`): each sample's im2col matrix in a thread's part of the workspace,
multiplied straight into the sample's output. Against the tiles' products of each sample's im2col matrix (and of
the whole batch's where the tiles compute that) plus the bias (the same bits), numpy's convolution (float32
rounding), on 1, 2 and 3 threads, into NaN-filled outputs and workspaces, with a workspace holding a single sample's
matrix, and built for AVX2 (the same bits)."""
from __future__ import annotations

import numpy as np
import pytest

from deepdsl_runtime import contract
from deepdsl_runtime.cpu import conv
from deepdsl_runtime.cpu.scratch import Scratch
from tests.test_direct_conv import avx2_kernels, kernels_built  # noqa: F401  (fixtures)
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
def test_the_program_convolution_takes_the_tiles_where_the_workspace_holds_a_sample(lib):  # noqa: F811
    """runtime/cpu/conv.py's conv2d with the compiled kernels: in the tiles given the planned workspace (the bits of
    the tiles' product plus the bias), by im2col with a workspace too small for one sample's matrix at once."""
    if not lib.tiles:
        pytest.skip("this processor has no tiles")
    geometry = GEOMETRIES[0]
    n, c, h, wd, o, kh, kw, stride, pad, _ = geometry
    x, w, b, shape = _case(*geometry, seed=1)
    want, done = _tiled(lib, x, w, b, shape, stride, pad, 1)
    assert done
    per_sample = contract.conv2d_scratch(x.shape, w.shape, shape, stride, pad)
    out = np.full(shape, np.nan, np.float32)
    conv.conv2d(x, w, b, out=out, stride=stride, pad=pad, workspace=np.full(n * per_sample, np.nan, np.float32),
                native=lib)
    np.testing.assert_array_equal(out, want)
    short = np.full(c * kh * kw * shape[2] * shape[3] - 1, np.nan, np.float32)
    assert not lib.conv_tiles(x, w, b, np.empty(shape, np.float32), stride, pad, short)


def test_the_rule_leaves_pointwise_grouped_and_large_products():
    assert contract.tiled_conv(20, 50, 5, 5, 1, 0, 8, 8)
    assert not contract.tiled_conv(64, 64, 1, 1, 1, 0, 8, 8), "pointwise: a product on the input itself"
    assert not contract.tiled_conv(32, 32, 3, 3, 1, 1, 8, 8, groups=32), "grouped"
    assert not contract.tiled_conv(512, 64, 3, 3, 1, 1, 56, 56), "a sample's matrix of 4 M floats or more"
