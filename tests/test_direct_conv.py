"""Thin convolutions computed straight from the input by the compiled kernels (runtime/kernels/cpu_conv.c,
`contract.direct_conv`): forward and filter gradient against numpy's im2col kernels on odd geometries (rows of every
width around the vectors' eight and 24 columns, kernels 1 to 8 wide, padding wider than the kernel's reach, output
channels around the block of four), into NaN-filled outputs, identical whatever the thread count, and the same
with the library built without AVX and fused multiply-adds (columns one at a time, unfused). The training steps of
LeNet, whose conv1 runs there, are checked against numpy's in tests/test_native_kernels.py."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hypothesis import assume, given, settings, strategies as st

from deepdsl_runtime import contract
from deepdsl_runtime.cpu import conv
from tests.support.kernel_builds import AVX2, generic_kernels
from tests.test_native_kernels import lib  # noqa: F401  (the fixture: resnet_mini's library)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="needs a C compiler")


@pytest.fixture(scope="session")
def avx2_kernels(tmp_path_factory):
    """The generic kernels built for a processor without AVX-512."""
    return generic_kernels(tmp_path_factory, *AVX2)


@pytest.fixture(scope="session")
def plain_kernels(tmp_path_factory):
    """The generic kernels built for a processor without AVX and fused multiply-adds (no AVX2 either)."""
    return generic_kernels(tmp_path_factory, "-mno-avx", "-mno-fma")


def _convolutions(kernels, x, w, b, g, pad):
    """(forward, filter gradient) of a stride-1 convolution with `kernels` (None: numpy's), outputs NaN-filled."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    out = np.full(g.shape, np.nan, np.float32)
    dw = np.full(w.shape, np.nan, np.float32)
    workspace = np.empty(n * contract.conv2d_scratch(x.shape, w.shape, g.shape, 1, pad)
                         + sum(contract.conv2d_bwd_filter_scratch(g.shape, x.shape, (kh, kw), pad)) * n, np.float32)
    conv.conv2d(x, w, b, out=out, stride=1, pad=pad, workspace=workspace, native=kernels)
    conv.conv2d_bwd_filter(g, x, out=dw, stride=1, pad=pad, kernel=(kh, kw), workspace=workspace, native=kernels)
    return out, dw


def _case(n, c, h, wd, o, kh, kw, pad, seed, bias=True):
    rng = np.random.default_rng(seed)
    ho, wo = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = rng.standard_normal((o, c, kh, kw)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32) if bias else None
    g = rng.standard_normal((n, o, ho, wo)).astype(np.float32)
    return x, w, b, g


def _check_against_numpy(kernels, case, pad):
    x, w, b, g = case
    want = _convolutions(None, x, w, b, g, pad)
    ran = []
    direct = kernels.direct
    kernels.direct = lambda op, *rest: ran.append(op) or direct(op, *rest)
    try:
        got = _convolutions(kernels, x, w, b, g, pad)
    finally:
        del kernels.direct
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    pointwise = contract.pointwise_filter(c, o, g.shape[2] * g.shape[3], kh, kw, 1, pad)    # (its own kernel)
    assert ran == ["conv2d"] + ([] if pointwise else ["conv2d_bwd_filter"])
    # the forward sums the taps in numpy's order (fused where the processor fuses, as OpenBLAS does); the filter
    # gradient in eight interleaved partial sums: within float32 rounding of the sums' magnitude
    for g_, w_ in zip(got, want):
        assert not np.isnan(g_).any()
        scale = float(np.sqrt(np.sum(np.abs(w_)))) + 1.0
        np.testing.assert_allclose(g_, w_, rtol=1e-5, atol=2e-6 * scale)
    return got


GEOMETRIES = [  # (N, C, H, W, O, kh, kw, pad)
    (2, 1, 28, 28, 20, 5, 5, 0),      # LeNet's conv1: rows of 24, three vectors
    (3, 1, 9, 40, 5, 3, 3, 1),        # rows of 40 with padding: masked vectors at both ends, a remainder block
    (1, 3, 6, 7, 4, 3, 2, 2),         # rows narrower than a vector, padding wider than it needs
    (2, 2, 5, 31, 9, 1, 8, 3),        # the widest kernel, rows of 30
    (1, 1, 4, 4, 1, 4, 4, 0),         # a single output
    (2, 3, 10, 19, 6, 3, 3, 0),       # 27 products per output
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_direct_convolution_equals_numpy(lib, geometry):  # noqa: F811
    n, c, h, wd, o, kh, kw, pad = geometry
    assert contract.direct_conv(c, kh, kw, 1)
    _check_against_numpy(lib, _case(n, c, h, wd, o, kh, kw, pad, seed=sum(geometry)), pad)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 2), h=st.integers(1, 12), wd=st.integers(1, 40), o=st.integers(1, 9),
       kh=st.integers(1, 4), kw=st.integers(1, 8), pad=st.integers(0, 3), bias=st.booleans(), seed=st.integers(0, 99))
def test_random_thin_convolutions_equal_numpy(lib, n, c, h, wd, o, kh, kw, pad, bias, seed):  # noqa: F811
    assume(h + 2 * pad >= kh and wd + 2 * pad >= kw and contract.direct_conv(c, kh, kw, 1))
    _check_against_numpy(lib, _case(n, c, h, wd, o, kh, kw, pad, seed, bias), pad)


def test_direct_results_do_not_depend_on_the_thread_count(lib):  # noqa: F811
    case = _case(5, 2, 13, 29, 7, 3, 5, 1, seed=3)
    results = []
    before = lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            results.append(_convolutions(lib, *case, pad=1))
    finally:
        lib.set_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_the_other_convolutions_keep_im2col(lib):  # noqa: F811
    """Strided, grouped, wide, many-channel or pointwise convolutions do not take the direct path."""
    assert not contract.direct_conv(1, 5, 5, 2)
    assert not contract.direct_conv(2, 3, 3, 1, groups=2)
    assert not contract.direct_conv(1, 1, 9, 1)
    assert not contract.direct_conv(4, 3, 3, 1)
    assert not contract.direct_conv(16, 1, 1, 1)          # pointwise: a product (its filter gradient: its own kernel)
    assert contract.direct_conv(1, 5, 5, 1) and contract.direct_conv(3, 3, 3, 1)


def test_without_avx_the_columns_go_one_at_a_time(lib, plain_kernels):  # noqa: F811
    """The library built for a processor without AVX and fused multiply-adds (GCC's generic vectors; the columns
    whose windows leave the input one at a time) computes the same convolutions."""
    plain = plain_kernels
    for geometry in GEOMETRIES[:4]:
        n, c, h, wd, o, kh, kw, pad = geometry
        _check_against_numpy(plain, _case(n, c, h, wd, o, kh, kw, pad, seed=5), pad)


def test_the_kernel_benchmark_runs():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "conv_kernels.py"), "--threads", "1",
                           "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    thin = [line for line in lines if re.match(r"\s*\d+x\d+x\d+x\d+ \d+x\d+x\d+ pad \d+\s+1\s", line)]
    products = [line for line in lines if re.match(r"\s*\d+ x \d+ x \d+\s+1\s", line)]
    assert len(thin) == 5 and len(products) == 8, done.stdout


# ---------------------------------------------------------------------------------------------------------------
# pointwise filter gradients straight from their operands (`contract.pointwise_filter`)

POINTWISE = [  # (N, O, C, H, W): tails of positions and of tiles, MobileNet's shapes, a plane of one position; chunks
    # of several samples (the last one short), a sample's positions in chunks (its rows past DEEPDSL_PW_WHOLE) and
    # whole samples a little past DEEPDSL_PW_CACHE (MobileNet-v2's 28 x 28 layers)
    (2, 96, 16, 11, 13), (3, 5, 7, 9, 9), (1, 24, 144, 16, 16), (2, 33, 30, 1, 1), (1, 17, 3, 40, 41),
    (5, 100, 28, 19, 21), (2, 8, 24, 83, 77), (2, 144, 24, 28, 28),
]


def _pointwise(kernels, g, x):
    out = np.full((g.shape[1], x.shape[1], 1, 1), np.nan, np.float32)
    per, acc = contract.conv2d_bwd_filter_scratch(g.shape, x.shape, (1, 1), 0)
    workspace = np.full(g.shape[0] * per + acc, np.nan, np.float32)
    conv.conv2d_bwd_filter(g, x, out=out, stride=1, pad=0, kernel=(1, 1), workspace=workspace, native=kernels)
    return out


def _against_the_reference(lib, shape, monkeypatch, method):
    """A pointwise filter gradient of `shape` (N, O, C, H, W) through the compiled kernels: `lib.<method>` computes
    it, the reference to float32 rounding, the same bits on 1, 2 and 3 threads. (g, x, the record of its calls)."""
    n, o, c, h, w = shape
    rng = np.random.default_rng(sum(shape))
    g = rng.standard_normal((n, o, h, w)).astype(np.float32)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    ran, call = [], getattr(lib, method)
    monkeypatch.setattr(lib, method, lambda *a: ran.append(1) or call(*a))
    got = _pointwise(lib, g, x)
    assert ran and not np.isnan(got).any()
    want = np.einsum("nop,ncp->oc", g.reshape(n, o, -1).astype(np.float64), x.reshape(n, c, -1).astype(np.float64))
    np.testing.assert_allclose(got[:, :, 0, 0], want, rtol=1e-5, atol=1e-6 * np.sqrt(n * h * w))
    results = []
    before = lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            results.append(_pointwise(lib, g, x))
    finally:
        lib.set_threads(before)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    return g, x, ran


@pytest.mark.parametrize("shape", POINTWISE, ids=[str(s) for s in POINTWISE])
def test_pointwise_filter_gradients_equal_the_reference(lib, shape, monkeypatch):  # noqa: F811
    n, o, c, h, w = shape
    assert contract.pointwise_filter(c, o, h * w, 1, 1, 1, 0)
    _against_the_reference(lib, shape, monkeypatch, "pointwise_filter")


def test_pointwise_filter_gradients_built_for_avx2_give_the_same_bits(lib, avx2_kernels):  # noqa: F811
    """16 lanes in two AVX2 registers or one AVX-512 register, added up in the same order: the same bits."""
    avx2 = avx2_kernels
    rng = np.random.default_rng(1)
    g = rng.standard_normal((2, 37, 9, 23)).astype(np.float32)
    x = rng.standard_normal((2, 19, 9, 23)).astype(np.float32)
    np.testing.assert_array_equal(_pointwise(avx2, g, x), _pointwise(lib, g, x))


BY_SAMPLES = [(3, 64, 48, 14, 14), (2, 40, 72, 15, 17)]     # (N, O, C, H, W): planes of 196 and 255 positions


@pytest.mark.parametrize("shape", BY_SAMPLES, ids=[str(s) for s in BY_SAMPLES])
def test_pointwise_filter_gradients_by_samples_equal_the_reference(lib, shape, monkeypatch):  # noqa: F811
    """Pointwise filter gradients of ordinary channel counts on planes of FILTER_BY_SAMPLES_PLANE positions or
    more: one product per sample summed in order (`Native.gemm_sum`), the reference to float32 rounding, the same
    bits on 1, 2 and 3 threads; on a smaller plane, not taken."""
    n, o, c, h, w = shape
    assert contract.filter_by_samples(1, 1, 1, 0, h * w) and not contract.pointwise_filter(c, o, h * w, 1, 1, 1, 0)
    g, x, ran = _against_the_reference(lib, shape, monkeypatch, "gemm_sum")
    ran.clear()
    small = _pointwise(lib, g[:, :, :7, :7].copy(), x[:, :, :7, :7].copy())
    assert not ran and not np.isnan(small).any()


def test_the_rule_takes_thin_pointwise_filter_gradients():
    assert contract.pointwise_filter(16, 96, 112 * 112, 1, 1, 1, 0)           # few inputs
    assert contract.pointwise_filter(144, 24, 56 * 56, 1, 1, 1, 0)            # few outputs on a wide plane
    assert not contract.pointwise_filter(192, 32, 7 * 7, 1, 1, 1, 0)          # few outputs on a small plane
    assert not contract.pointwise_filter(256, 64, 28 * 28, 1, 1, 1, 0)        # a product of ordinary shape
    assert not contract.pointwise_filter(16, 96, 56 * 56, 1, 1, 2, 0)         # strided
    assert not contract.pointwise_filter(16, 96, 56 * 56, 3, 3, 1, 1)         # not pointwise
    assert not contract.pointwise_filter(16, 96, 56 * 56, 1, 1, 1, 0, groups=2)
    assert contract.filter_by_samples(1, 1, 1, 0, 14 * 14)                     # ResNet's 1x1 layers at 14x14
    assert not contract.filter_by_samples(1, 1, 1, 0, 7 * 7)                  # too shallow products
    assert not contract.filter_by_samples(1, 1, 2, 0, 28 * 28)                # strided
    assert not contract.filter_by_samples(3, 3, 1, 1, 28 * 28)                # not pointwise


# ---------------------------------------------------------------------------------------------------------------
# depthwise convolutions, stride 1 widened (the padded plane in the thread's buffer, each tap one flat pass)

# a vector's channels at a time (16 with AVX-512, 8 with AVX2; small or strided planes): groups cut short (19, 33,
# 24, 11 channels), strides 2 and 3, a 5x5 kernel, padding wider than the kernel, a 1x1 plane, planes of whole
# vectors of eight and not, rows long enough for runs of four positions a stride apart (and their ends); and wide
# stride-1 planes of many channels, which stay plane by plane
LANES = [
    (2, 11, 9, 9, 3, 2, 1), (2, 19, 7, 7, 3, 1, 1), (2, 33, 4, 5, 3, 1, 1), (3, 16, 13, 10, 3, 2, 1),
    (1, 24, 11, 9, 5, 2, 2), (2, 16, 9, 8, 3, 3, 0), (1, 17, 6, 6, 3, 1, 3), (2, 16, 1, 1, 3, 1, 1),
    (1, 32, 16, 16, 3, 2, 1), (1, 16, 7, 20, 3, 3, 1), (1, 8, 6, 21, 5, 2, 2), (2, 32, 14, 14, 3, 1, 1),
]
DEPTHWISE = [  # (N, C, H, W, k, stride, pad): widened (small and large planes, no padding, padding to the kernel's
    # reach, a 1x1 plane, planes past the filter gradient's row limit and below it); row by row (stride 2, padding
    # wider than the kernel, a plane past the buffer's limit)
    (2, 3, 9, 11, 3, 1, 1), (1, 2, 30, 17, 5, 1, 2), (2, 4, 7, 7, 3, 1, 0), (3, 2, 1, 1, 3, 1, 1),
    (2, 5, 4, 4, 3, 1, 1), (1, 2, 16, 16, 3, 1, 2), (2, 3, 13, 10, 3, 2, 1), (1, 2, 6, 6, 3, 1, 3),
    (1, 1, 300, 260, 3, 1, 1),
] + LANES

def _depthwise(kernels, arrays, op, n, c, h, w, k, stride, pad):
    out_shape = {"conv2d": arrays[0].shape[:2] + (contract.out_size(h, k, stride, pad),
                                                  contract.out_size(w, k, stride, pad)),
                 "conv2d_bwd_data": (n, c, h, w), "conv2d_bwd_filter": (c, 1, k, k)}[op]
    out = np.full(out_shape, np.nan, np.float32)
    extra = {"conv2d_bwd_data": {"size": (h, w)}, "conv2d_bwd_filter": {"kernel": (k, k)}}.get(op, {})
    getattr(conv, op)(*arrays, out=out, stride=stride, pad=pad, groups=c, workspace=None, native=kernels, **extra)
    return out


@pytest.mark.parametrize("geometry", DEPTHWISE, ids=[str(g) for g in DEPTHWISE])
def test_depthwise_convolutions_equal_numpy_at_any_thread_count(lib, geometry):  # noqa: F811
    n, c, h, w, k, stride, pad = geometry
    ho, wo = contract.out_size(h, k, stride, pad), contract.out_size(w, k, stride, pad)
    rng = np.random.default_rng(sum(geometry))
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    f = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    g = rng.standard_normal((n, c, ho, wo)).astype(np.float32)
    before = lib.threads
    for op, arrays in (("conv2d", (x, f, b)), ("conv2d_bwd_data", (g, f)), ("conv2d_bwd_filter", (g, x))):
        want = _depthwise(None, arrays, op, n, c, h, w, k, stride, pad)
        runs = []
        try:
            for threads in (1, 2, 3):
                lib.set_threads(threads)
                runs.append(_depthwise(lib, arrays, op, n, c, h, w, k, stride, pad))
        finally:
            lib.set_threads(before)
        assert not np.isnan(runs[0]).any(), op
        # the taps in numpy's order; the filter gradient's sums in another (16 lanes): float32 rounding
        np.testing.assert_allclose(runs[0], want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
        for other in runs[1:]:
            np.testing.assert_array_equal(other, runs[0])


def test_depthwise_convolutions_built_for_avx2_give_the_same_bits(lib, avx2_kernels):  # noqa: F811
    avx2 = avx2_kernels
    n, c, h, w, k, stride, pad = 2, 3, 19, 23, 3, 1, 1
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    f = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    g = rng.standard_normal((n, c, h, w)).astype(np.float32)
    for op, arrays in (("conv2d", (x, f)), ("conv2d_bwd_data", (g, f)), ("conv2d_bwd_filter", (g, x))):
        np.testing.assert_array_equal(_depthwise(avx2, arrays, op, n, c, h, w, k, stride, pad),
                                      _depthwise(lib, arrays, op, n, c, h, w, k, stride, pad))


def _taps_in_order(x, f, stride, pad, ho, wo, scatter_into=None):
    """A depthwise convolution tap by tap in float32 (each tap's products rounded, then added in tap order from
    zero): the order the compiled stride-2 kernels keep. With `scatter_into` (N, C, H, W) zeros: the input gradient
    of x as the output gradient, each tap's products added into the positions it read."""
    n, c, k = x.shape[0], x.shape[1], f.shape[-1]
    h, w = (scatter_into.shape[2:] if scatter_into is not None else x.shape[2:])
    out = np.zeros((n, c, ho, wo), np.float32) if scatter_into is None else scatter_into
    for i in range(k):
        for j in range(k):
            p = [p for p in range(ho) if 0 <= stride * p + i - pad < h]
            q = [q for q in range(wo) if 0 <= stride * q + j - pad < w]
            if not p or not q:                # the tap reads no position
                continue
            rows, cols = [stride * v + i - pad for v in p], [stride * v + j - pad for v in q]
            tap = f[:, 0, i, j][None, :, None, None]
            if scatter_into is None:
                out[:, :, p[0]:p[-1] + 1, q[0]:q[-1] + 1] += tap * x[:, :, rows][:, :, :, cols]
            else:
                out[:, :, rows[0]:rows[-1] + 1:stride, cols[0]:cols[-1] + 1:stride] += \
                    tap * x[:, :, p[0]:p[-1] + 1, q[0]:q[-1] + 1]
    return out


def _rows_in_order(g, x, stride, pad, k):
    """A depthwise convolution's filter gradient in float32 as the compiled kernels sum it row by row: for each tap,
    sample by sample and output row by output row, the row's products added in order from zero, then the row's sum
    added to the tap's."""
    n, c, ho, wo = g.shape
    h, w = x.shape[2:]
    out = np.zeros((c, 1, k, k), np.float32)
    for i in range(k):
        for j in range(k):
            total = np.zeros(c, np.float32)
            for s in range(n):
                for p in range(ho):
                    if not 0 <= stride * p + i - pad < h:
                        continue
                    part = np.zeros(c, np.float32)
                    for q in range(wo):
                        if 0 <= stride * q + j - pad < w:
                            part = part + g[s, :, p, q] * x[s, :, stride * p + i - pad, stride * q + j - pad]
                    total = total + part
            out[:, 0, i, j] = total
    return out


IN_ORDER = [(2, 3, 56, 56, 3, 2, 1), (1, 2, 13, 40, 5, 2, 2), (2, 2, 9, 33, 3, 2, 0)] + LANES[:-1]


@pytest.mark.parametrize("geometry", IN_ORDER, ids=[str(g) for g in IN_ORDER])
def test_depthwise_convolutions_add_the_taps_in_order(lib, avx2_kernels, geometry):  # noqa: F811
    """The strided (rows in vectors) and 16-channel kernels: the forward and the input gradient give the same bits
    as the taps one by one in order, the filter gradient those of the sums row by row in order, with AVX-512 and
    AVX2 alike. Plane by plane or 16 channels at a time, the same bits."""
    n, c, h, w, k, stride, pad = geometry
    ho, wo = contract.out_size(h, k, stride, pad), contract.out_size(w, k, stride, pad)
    rng = np.random.default_rng(sum(geometry))
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    f = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    g = rng.standard_normal((n, c, ho, wo)).astype(np.float32)
    forward = _taps_in_order(x, f, stride, pad, ho, wo)
    backward = _taps_in_order(g, f, stride, pad, ho, wo, scatter_into=np.zeros((n, c, h, w), np.float32))
    filters = _rows_in_order(g, x, stride, pad, k) if h * w < 1000 else None       # (a python loop per position)
    for kernels in (lib, avx2_kernels):
        np.testing.assert_array_equal(_depthwise(kernels, (x, f), "conv2d", n, c, h, w, k, stride, pad), forward)
        np.testing.assert_array_equal(_depthwise(kernels, (g, f), "conv2d_bwd_data", n, c, h, w, k, stride, pad),
                                      backward)
        if filters is not None:
            np.testing.assert_array_equal(_depthwise(kernels, (g, x), "conv2d_bwd_filter", n, c, h, w, k, stride,
                                                     pad), filters)
