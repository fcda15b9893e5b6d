"""The compiled CPU kernels (`<program>.c` built into `<program>.<digest>.so`, deepdsl_runtime.cpu.native) against
the numpy kernels they replace: im2col and the axis swap on odd geometries into NaN-filled buffers, max pooling
with its argmax and its gradient on random geometries (padding, ceil mode, NaN inputs, ties, an output taking
over its input) under NaN-filled workspaces of exactly their planned size, every
elementwise kernel of a program in each operand pattern it is called with (also in place), the convolutions under
NaN-filled workspaces of exactly their planned size, and two training steps and a test step of every network with
the compiled kernels against the numpy backend. Also: how a program finds, refuses and reports its library."""
from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hypothesis import given, settings, strategies as st

from deepdsl.codegen.native import compile_command
from deepdsl.ops import get_op

from deepdsl_runtime import contract
from deepdsl_runtime.cpu import conv, native, pool
from deepdsl_runtime.cpu.scratch import Scratch
from tests.support import kernel_builds
from tests.support.kernel_builds import AVX2, HAS_AVX512, generic_kernels
from tests.support.program_helpers import compile_program, import_program, model_class, popen_cli, run_cli
from tests.test_cuda_codegen import ADAPTIVE_TOLERANCE, _steps
from tests.support.random_programs import pool_geometries
from tests.test_memory_modes import NETWORKS
from tests.test_runtime_cpu import GROUPED_CONV, grouped_conv_nodes

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="needs a C compiler")
_built: dict = {}
# a ViT whose normalizations are written out as tensor ops (RMSNorm, a layer norm): kernels with operands per token
# and per feature, sums over each token's features and over every axis but the last
NORMS_VIT = str(Path(__file__).parent / "support" / "norms_vit.py")


def _program(name, image, tmp_path_factory):
    """(compiled, module, path) of network `name` at batch 2, its library built."""
    from deepdsl.codegen.native import build_library

    if name not in _built:
        compiled, path = compile_program(name, tmp_path_factory.mktemp(f"native-{Path(name).stem}"), batch=2,
                                         image=image)
        built, why = build_library(path.with_suffix(".c"))
        assert built is not None, why
        _built[name] = compiled, import_program(path), path
    return _built[name]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    _, _, path = _program("resnet_mini", None, tmp_path_factory)
    found, why = native.load(path)
    assert found is not None, why
    return found


GEOMETRIES = [  # (N, C, H, W, kernel h, kernel w, stride, pad)
    (3, 2, 7, 5, 3, 3, 1, 1), (2, 3, 9, 9, 3, 3, 2, 0), (1, 1, 5, 8, 5, 1, 1, 2), (4, 2, 6, 6, 1, 1, 3, 0),
    (2, 1, 11, 4, 4, 2, 2, 2), (1, 3, 3, 3, 3, 3, 1, 2),
    (3, 5, 4, 3, 1, 1, 1, 0), (2, 2, 5, 5, 1, 1, 1, 0),     # pointwise on small planes: regrouped, one product
    # rows of several vectors of eight, the padding or the row's end inside a vector; a column kernel without padding
    # (each tap's rows one contiguous copy)
    (2, 3, 12, 19, 3, 3, 1, 1), (1, 2, 9, 16, 5, 5, 1, 2), (2, 2, 6, 12, 3, 3, 1, 0), (2, 2, 7, 6, 3, 1, 1, 0),
    # stride 1 through a zero-padded copy of each plane (`DEEPDSL_SMALL_PLANE`): output rows of 1 to 8 floats and
    # more, rows ending inside a vector or at its end, and the padded planes on either side of the limit (2048)
    (2, 3, 4, 4, 3, 3, 1, 1), (2, 2, 1, 1, 3, 3, 1, 1), (1, 2, 12, 12, 5, 5, 1, 0), (3, 2, 7, 13, 3, 3, 1, 1),
    (1, 2, 43, 43, 3, 3, 1, 1), (1, 2, 44, 44, 3, 3, 1, 1), (2, 2, 5, 9, 3, 2, 1, 3),
    # "same" padding on planes of at most 256 floats and kernels of at most 25 taps: shifted planes
    # (DEEPDSL_SHIFT_PLANE): a plane of whole vectors at the limit and one just past it, a 5x5 kernel, a 7x7 one (past
    # the taps' limit), planes of one row or one column
    (2, 3, 16, 16, 3, 3, 1, 1), (1, 2, 16, 17, 3, 3, 1, 1), (2, 2, 6, 5, 5, 5, 1, 2), (1, 2, 7, 7, 7, 7, 1, 3),
    (2, 2, 1, 9, 3, 3, 1, 1), (2, 2, 9, 1, 3, 3, 1, 1),
    # stride 2 (every other float of two vectors): rows of 8 columns or more with padding on both sides, the last
    # vector reaching past the input row (read masked), a pointwise kernel; stride 4 (a float at a time), AlexNet's
    # first layer among them
    (2, 3, 30, 37, 7, 7, 2, 3), (1, 2, 9, 33, 3, 3, 2, 1), (2, 2, 28, 28, 1, 1, 2, 0), (1, 2, 12, 34, 2, 2, 2, 0),
    (2, 3, 35, 39, 11, 11, 4, 0), (1, 2, 13, 70, 3, 3, 4, 1), (2, 2, 9, 37, 1, 1, 4, 0),
]


@needs_cc
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_im2col_and_swap_equal_numpy_bit_for_bit(lib, geometry):
    n, c, h, w, kh, kw, stride, pad = geometry
    ho, wo = contract.out_size(h, kh, stride, pad), contract.out_size(w, kw, stride, pad)
    x = np.random.default_rng(1).standard_normal((n, c, h, w)).astype(np.float32)
    got = np.full((c, kh, kw, n, ho, wo), np.nan, np.float32)
    want = np.full_like(got, np.nan)
    scratch = np.full(n * c * (h + 2 * pad) * (w + 2 * pad), np.nan, np.float32)
    conv._NUMPY.im2col(x, want.transpose(3, 0, 1, 2, 4, 5), stride, pad, Scratch(scratch))
    lib.im2col(x, got.transpose(3, 0, 1, 2, 4, 5), stride, pad)
    assert np.array_equal(got, want)
    swapped = np.full((c, n, h, w), np.nan, np.float32)
    lib.swap01(x, swapped)
    assert np.array_equal(swapped, x.swapaxes(0, 1))


@needs_cc
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_col2im_equals_numpy_bit_for_bit(lib, geometry):
    """The column gradients added back into the input gradient, in numpy's order, into a NaN-filled output: from a
    chunk's product (C*kh*kw, samples*Ho*Wo) and from per-sample ones (samples, C*kh*kw, Ho*Wo), with -0.0 and
    NaN among the values."""
    n, c, h, w, kh, kw, stride, pad = geometry
    ho, wo = contract.out_size(h, kh, stride, pad), contract.out_size(w, kw, stride, pad)
    rng = np.random.default_rng(2)
    for chunk in (True, False):
        shape = (c, kh, kw, n, ho, wo) if chunk else (n, c, kh, kw, ho, wo)
        columns = np.round(rng.standard_normal(shape), 1).astype(np.float32)
        columns[columns == 0] = -0.0
        columns.reshape(-1)[rng.integers(0, columns.size)] = np.nan
        dcols = columns.transpose(3, 0, 1, 2, 4, 5) if chunk else columns
        want = np.full((n, c, h, w), np.nan, np.float32)
        got = np.full_like(want, np.nan)
        conv._NUMPY.col2im(dcols, want, stride, pad)
        lib.col2im(dcols, got, stride, pad)
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))


# Arrays whose bytes end at, or start after, a page no process may read: a kernel reading a lane past an array (a
# vector reaching past a row's end, a plane shifted by a tap) ends the process instead of reading a neighbour.
_GUARDED = """
import ctypes, mmap, sys
import numpy as np
from deepdsl_runtime import contract
from deepdsl_runtime.cpu import conv, native
from deepdsl_runtime.cpu.scratch import Scratch

found, why = native.load(sys.argv[1])
assert found is not None, why
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
regions = []

def guarded(shape, at_end):
    nbytes = int(np.prod(shape)) * 4
    pages = -(-nbytes // mmap.PAGESIZE)
    region = mmap.mmap(-1, (pages + 2) * mmap.PAGESIZE)
    regions.append(region)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for page in (0, pages + 1):
        assert libc.mprotect(base + page * mmap.PAGESIZE, mmap.PAGESIZE, 0) == 0
    offset = (pages + 1) * mmap.PAGESIZE - nbytes if at_end else mmap.PAGESIZE
    return np.frombuffer(region, np.float32, count=nbytes // 4, offset=offset).reshape(shape)

rng = np.random.default_rng(4)
for n, c, h, w, kh, kw, stride, pad in GEOMETRIES:
    ho, wo = contract.out_size(h, kh, stride, pad), contract.out_size(w, kw, stride, pad)
    for at_end in (True, False):
        x = guarded((n, c, h, w), at_end)
        x[...] = rng.standard_normal(x.shape)
        cols = guarded((c, kh, kw, n, ho, wo), at_end)
        found.im2col(x, cols.transpose(3, 0, 1, 2, 4, 5), stride, pad)
        want = np.empty_like(cols)
        conv._NUMPY.im2col(np.array(x), want.transpose(3, 0, 1, 2, 4, 5), stride, pad, Scratch(None))
        assert np.array_equal(cols, want), (n, c, h, w, kh, kw, stride, pad)
        if stride == 1:
            out = guarded((n, c, h, w), at_end)
            found.col2im(cols.transpose(3, 0, 1, 2, 4, 5), out, stride, pad)
            expected = np.empty(out.shape, np.float32)
            conv._NUMPY.col2im(want.transpose(3, 0, 1, 2, 4, 5), expected, stride, pad)
            assert np.array_equal(out, expected), (n, c, h, w, kh, kw, stride, pad)
print("read nothing outside its arrays")
"""
GUARDED_GEOMETRIES = [(2, 3, 7, 7, 3, 3, 1, 1), (2, 2, 4, 4, 3, 3, 1, 1), (1, 2, 6, 5, 5, 5, 1, 2),
                      (2, 2, 1, 9, 3, 3, 1, 1), (3, 2, 7, 13, 3, 3, 1, 1), (2, 3, 30, 37, 7, 7, 2, 3),
                      (1, 2, 9, 33, 3, 3, 2, 1), (2, 2, 28, 28, 1, 1, 2, 0), (2, 3, 35, 39, 11, 11, 4, 0),
                      (1, 2, 13, 70, 3, 3, 4, 1)]


@needs_cc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's mprotect")
def test_im2col_and_col2im_read_nothing_outside_their_arrays(lib, tmp_path_factory):
    """The masked copies and additions (shifted planes, stride-2 rows, short rows) on arrays placed against pages no
    process may read, at their ends and at their starts: they equal numpy's, and the process is not ended by a
    read outside them. In a process of its own."""
    _, _, path = _program("resnet_mini", None, tmp_path_factory)
    script = f"GEOMETRIES = {GUARDED_GEOMETRIES!r}\n" + _GUARDED
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "read nothing outside" in done.stdout, (done.returncode, done.stderr[-2000:])


@needs_cc
@pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512 here: the tests above ran AVX's masks")
def test_im2col_and_col2im_with_avx_masks_only(tmp_path_factory):
    """Built for a processor with AVX but not AVX-512 (masked vectors by AVX's own masked loads and stores), the
    copies and additions are numpy's bit for bit too."""
    avx = generic_kernels(tmp_path_factory, *AVX2)
    for geometry in GEOMETRIES:
        test_im2col_and_swap_equal_numpy_bit_for_bit(avx, geometry)
        test_col2im_equals_numpy_bit_for_bit(avx, geometry)


def _pool_input(n, c, h, w, rng):
    """Values with ties (rounded), a NaN and negative zeros: what the argmax's first-maximum rule must handle."""
    x = np.round(rng.standard_normal((n, c, h, w)), 1).astype(np.float32)
    x.reshape(-1)[rng.integers(0, x.size)] = np.nan
    x[x == 0] = -0.0
    return x


@needs_cc
@settings(max_examples=40, deadline=None)
@given(geometry=pool_geometries(9), n=st.integers(1, 3), c=st.integers(1, 3), seed=st.integers(0, 99))
def test_max_pool_and_its_gradient_equal_numpy(lib, geometry, n, c, seed):
    _check_max_pool(lib, n, c, *(geometry[key] for key in ("h", "w", "kernel", "stride", "pad", "ceil")), seed)


WIDE_POOLS = [  # (H, W, pad, ceil): rows of 2x2 windows of stride 2 that fill vectors of 8 and 4 windows and more
    (24, 24, 0, False), (6, 37, 0, True), (5, 16, 1, False), (9, 34, 0, False), (4, 26, 1, True)]


@needs_cc
@pytest.mark.parametrize("h,w,pad,ceil", WIDE_POOLS, ids=[str(g) for g in WIDE_POOLS])
def test_wide_2x2_pooling_equals_numpy(lib, h, w, pad, ceil):
    """The vector path (8 and 4 windows at once) on rows long enough to take it, with ties, -0.0 and NaN."""
    for seed in range(3):
        _check_max_pool(lib, 2, 3, h, w, 2, 2, pad, ceil, seed)


@needs_cc
@pytest.mark.parametrize("h,w,pad,ceil", WIDE_POOLS, ids=[str(g) for g in WIDE_POOLS])
def test_wide_overlapping_pooling_equals_numpy(lib, h, w, pad, ceil):
    """3x3 windows of stride 2 (AlexNet's, ResNet's), whose gradient adds eight windows at a time where a row
    holds them, one by one at its ends: numpy's sums bit for bit, with ties, -0.0 and NaN."""
    for seed in range(3):
        want, got = _check_max_pool(lib, 2, 3, h, w, 3, 2, pad, ceil, seed)
        np.testing.assert_array_equal(got, want)


def _check_max_pool(lib, n, c, h, w, k, stride, pad, ceil, seed):
    """Max pooling, its argmax alone and its gradient, compiled against numpy on the same input."""
    ho, wo = contract.out_size(h, k, stride, pad, ceil), contract.out_size(w, k, stride, pad, ceil)
    rng = np.random.default_rng(seed)
    x = _pool_input(n, c, h, w, rng)
    planned = contract.max_pool_scratch(x.shape, (n, c, ho, wo), k, stride, pad)
    results = []
    for kernels in (None, lib):
        out = np.full((n, c, ho, wo), np.nan, np.float32)
        argmax = np.full(out.shape, 255, np.uint8)
        ws = np.full(max(planned * n, 1), np.nan, np.float32)
        pool.max_pool(x, out=out, argmax=argmax, kernel=k, stride=stride, pad=pad, ceil=ceil, workspace=ws,
                      native=kernels)
        alone = np.full(out.shape, 255, np.uint8)
        ws = np.full(contract.max_pool_argmax_scratch(x.shape, out.shape, k, stride, pad) * n, np.nan, np.float32)
        pool.max_pool_argmax(x, out=alone, kernel=k, stride=stride, pad=pad, ceil=ceil, workspace=ws,
                             native=kernels)
        g = np.round(rng.standard_normal(out.shape), 1).astype(np.float32) if kernels is None else results[0][3]
        dx = np.full(x.shape, np.nan, np.float32)
        ws = np.full(max(contract.max_pool_bwd_scratch(g.shape, x.shape, k, stride, pad) * n, 1), np.nan,
                     np.float32)
        pool.max_pool_bwd(g, argmax, out=dx, kernel=k, stride=stride, pad=pad, ceil=ceil, size=(h, w),
                          workspace=ws, native=kernels)
        results.append((out, argmax, alone, g, dx))
    want, got = results
    np.testing.assert_array_equal(got[0], want[0])            # maxima (NaN where numpy has NaN)
    np.testing.assert_array_equal(got[1], want[1])            # argmax with max_pool
    np.testing.assert_array_equal(got[2], want[1])            # argmax alone
    np.testing.assert_allclose(got[4], want[4], rtol=1e-6, atol=1e-6)
    return want[4], got[4]


@needs_cc
@pytest.mark.parametrize("kernel,stride,pad", [(2, 2, 0), (3, 2, 0), (3, 2, 1)])
def test_pooling_over_its_own_input(lib, kernel, stride, pad):
    """An output taking over its input's bytes (same start), as the memory plan lays it out: the compiled kernels
    run in numpy's safe sample order and give numpy's results."""
    rng = np.random.default_rng(5)
    n, c, h, w = 5, 3, 9, 9
    ho, wo = contract.out_size(h, kernel, stride, pad), contract.out_size(w, kernel, stride, pad)
    x = _pool_input(n, c, h, w, rng)
    want = np.empty((n, c, ho, wo), np.float32)
    pool.max_pool(x, out=want, kernel=kernel, stride=stride, pad=pad)
    g = rng.standard_normal(want.shape).astype(np.float32)
    argmax = np.empty(want.shape, np.uint8)
    pool.max_pool_argmax(x, out=argmax, kernel=kernel, stride=stride, pad=pad)
    want_dx = np.empty_like(x)
    pool.max_pool_bwd(g, argmax, out=want_dx, kernel=kernel, stride=stride, pad=pad, size=(h, w))
    stage = contract.stage_floats(x.nbytes, want.nbytes, n)
    planned = contract.max_pool_scratch(x.shape, want.shape, kernel, stride, pad) * n + stage
    arena = np.full(x.size, np.nan, np.float32)
    arena[:] = x.reshape(-1)
    pool.max_pool(arena.reshape(x.shape), out=arena[:want.size].reshape(want.shape), kernel=kernel, stride=stride,
                  pad=pad, workspace=np.full(planned, np.nan, np.float32), native=lib)
    np.testing.assert_array_equal(arena[:want.size].reshape(want.shape), want)
    grows = np.full(x.size, np.nan, np.float32)
    grows[:g.size] = g.reshape(-1)
    planned = contract.max_pool_bwd_scratch(g.shape, x.shape, kernel, stride, pad) * n + stage
    pool.max_pool_bwd(grows[:g.size].reshape(g.shape), argmax, out=grows.reshape(x.shape), kernel=kernel,
                      stride=stride, pad=pad, size=(h, w), workspace=np.full(planned, np.nan, np.float32),
                      native=lib)
    np.testing.assert_allclose(grows.reshape(x.shape), want_dx, rtol=1e-6, atol=1e-6)


@needs_cc
@settings(max_examples=40, deadline=None)
@given(geometry=pool_geometries(9), n=st.integers(1, 3), c=st.integers(1, 3), include_pad=st.booleans(),
       seed=st.integers(0, 99))
def test_average_pooling_and_its_gradient_equal_numpy_bit_for_bit(lib, geometry, n, c, include_pad, seed):
    """Average pooling and its gradient compiled (`Native.avg_pool`, `avg_pool_bwd`) against numpy's on random
    geometries (padding, ceil mode, overlapping and disjoint windows, the padding counted or not), with -0.0 and a
    NaN among the values, into NaN-filled outputs under NaN-filled workspaces of exactly their planned size: the
    same bits (the same additions in the same order, the same divisions)."""
    h, w, k, stride, pad, ceil = (geometry[key] for key in ("h", "w", "kernel", "stride", "pad", "ceil"))
    ho, wo = contract.out_size(h, k, stride, pad, ceil), contract.out_size(w, k, stride, pad, ceil)
    rng = np.random.default_rng(seed)
    x = _pool_input(n, c, h, w, rng)
    g = _pool_input(n, c, ho, wo, rng)
    attrs = dict(kernel=k, stride=stride, pad=pad, ceil=ceil, include_pad=include_pad)
    results = []
    for kernels in (None, lib):
        out = np.full((n, c, ho, wo), np.nan, np.float32)
        ws = np.full(max(contract.avg_pool_scratch(x.shape, out.shape, k, stride, pad) * n, 1), np.nan, np.float32)
        pool.avg_pool(x, out=out, workspace=ws, native=kernels, **attrs)
        dx = np.full(x.shape, np.nan, np.float32)
        ws = np.full(max(contract.avg_pool_bwd_scratch(g.shape, x.shape, k, stride, pad) * n, 1), np.nan, np.float32)
        pool.avg_pool_bwd(g, out=dx, size=(h, w), workspace=ws, native=kernels, **attrs)
        results.append((out, dx))
    (want, want_dx), (got, got_dx) = results
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(got_dx.view(np.uint32), want_dx.view(np.uint32))


@needs_cc
@pytest.mark.parametrize("kernel,stride,pad", [(8, 8, 0), (8, 1, 0), (4, 4, 0), (3, 2, 1), (2, 1, 0)])
def test_average_pooling_over_its_own_input(lib, kernel, stride, pad):
    """Global (a window of the whole 8 x 8 plane) and strided average pooling and their gradients whose outputs take
    over their inputs' bytes, as the memory plan lays them out: compiled, numpy's results bit for bit (an output
    larger than its input, the gradient, runs its samples backward)."""
    rng = np.random.default_rng(7)
    n, c, h, w = 5, 3, 8, 8
    ho, wo = contract.out_size(h, kernel, stride, pad), contract.out_size(w, kernel, stride, pad)
    x, g = _pool_input(n, c, h, w, rng), _pool_input(n, c, ho, wo, rng)
    x.reshape(-1)[1], g.reshape(-1)[1] = -0.0, -0.0      # (a window's sum of -0.0 and its share: signs kept or not)
    want, want_dx = np.empty((n, c, ho, wo), np.float32), np.empty_like(x)
    pool.avg_pool(x, out=want, kernel=kernel, stride=stride, pad=pad)
    pool.avg_pool_bwd(g, out=want_dx, kernel=kernel, stride=stride, pad=pad, size=(h, w))
    stage = contract.stage_floats(x.nbytes, want.nbytes, n)
    arena = x.reshape(-1).copy()
    planned = contract.avg_pool_scratch(x.shape, want.shape, kernel, stride, pad) * n + stage
    pool.avg_pool(arena.reshape(x.shape), out=arena[:want.size].reshape(want.shape), kernel=kernel, stride=stride,
                  pad=pad, workspace=np.full(planned, np.nan, np.float32), native=lib)
    np.testing.assert_array_equal(arena[:want.size].view(np.uint32), want.reshape(-1).view(np.uint32))
    grows = np.full(x.size, np.nan, np.float32)
    grows[:g.size] = g.reshape(-1)
    planned = contract.avg_pool_bwd_scratch(g.shape, x.shape, kernel, stride, pad) * n + stage
    pool.avg_pool_bwd(grows[:g.size].reshape(g.shape), out=grows.reshape(x.shape), kernel=kernel, stride=stride,
                      pad=pad, size=(h, w), workspace=np.full(planned, np.nan, np.float32), native=lib)
    np.testing.assert_array_equal(grows.view(np.uint32), want_dx.reshape(-1).view(np.uint32))


def _operands(pattern, shape, rng):
    """Operands of each letter (`contract.operand_letter`) for an output of `shape`: per-row ones (w) one value for
    each row of the last axis beside last-axis ones (r: a layer norm's statistics), else for each sample's channel
    (squeeze-and-excitation's scale)."""
    channel = (1, shape[1]) + (1,) * (len(shape) - 2)
    row = shape[:-1] + (1,) if "r" in pattern else shape[:2] + (1,) * (len(shape) - 2)
    made = {"f": lambda: rng.uniform(0.5, 1.5, shape), "u": lambda: (rng.random(shape) < 0.5),
            "c": lambda: rng.uniform(0.5, 1.5, channel), "r": lambda: rng.uniform(0.5, 1.5, shape[-1:]),
            "w": lambda: rng.uniform(0.5, 1.5, row), "s": lambda: rng.uniform(0.5, 1.5)}
    return [np.uint8(made[k]()) if k == "u" else np.float32(made[k]()) for k in pattern]


@needs_cc
@pytest.mark.parametrize("name", ["resnet_mini", "lenet", "googlenet", "alexnet", "vit", NORMS_VIT, "se_resnet"])
def test_every_elementwise_kernel_equals_its_numpy_kernel(name, tmp_path_factory):
    compiled, module, path = _program(name, dict(NETWORKS).get(name), tmp_path_factory)
    found, why = native.load(path)
    assert found is not None, why
    from deepdsl.codegen.description import describe

    rng = np.random.default_rng(3)
    checked = 0
    for kernel_name, patterns in describe(compiled).kernel_patterns:
        kernel = getattr(module, kernel_name)
        for pattern in patterns:
            # odd sizes; threaded (past the kernels' 2^16 elements on one thread: DEEPDSL_EW_PARALLEL_MIN)
            for shape in ((3, 5, 7), (3, 5, (1 << 12) + 3), (2, 7, 3, (1 << 13) + 5)):
                args = _operands(pattern, shape, rng)
                want = np.empty(shape, np.float32)
                kernel(want, *args)
                got = np.full(shape, np.nan, np.float32)
                assert found.ew(kernel, got, args), (kernel_name, pattern)
                # (absolute: two ulp of operands up to 1.5, where a result is their difference, Adam's update)
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=3e-7, err_msg=f"{kernel_name} {pattern}")
                full = [k for k, letter in enumerate(pattern) if letter == "f"]
                if full:                                       # in place over an input, as the plan allows
                    target = args[full[0]]
                    assert found.ew(kernel, target, args)
                    np.testing.assert_allclose(target, want, rtol=2e-6, atol=3e-7)
                checked += 1
    assert checked >= 3
    letters = "".join(p for _, patterns in describe(compiled).kernel_patterns for p in patterns)
    if name == "resnet_mini":          # batch norm's per-channel operands
        assert "c" in letters, letters
    if name == "lenet":                # fc1's bias inside its ReLU (fc2's goes into its product: fuse_epilogue)
        assert "r" in letters, letters
    if name == NORMS_VIT:              # the norms' statistics of each token, and their weights
        assert "w" in letters and "r" in letters, letters
    if name == "se_resnet":            # each sample's channel scaled, beside batch norm's per-channel operands
        assert any("w" in p and "c" in p for _, patterns in describe(compiled).kernel_patterns for p in patterns)


@needs_cc
@pytest.mark.parametrize("name", ["resnet_mini", "lenet", "se_resnet"])
def test_every_elementwise_pair_equals_its_two_kernels(name, tmp_path_factory):
    """Every pair of kernels a program computes in one pass (an optimizer's two updates; batch norm's centred input
    and its sum of squares, a gradient and its sum) gives the bits of its two compiled kernels run one after the
    other, and their values within float32 roundings of numpy's: with fresh outputs, the first's output over one of
    its operands, the second's (stored) over one of the first's (the parameter both read), both at once, on odd
    sizes and one threaded, and sums over more channels than a thread reads at a time."""
    from deepdsl.codegen.description import describe
    from deepdsl_runtime.cpu import elementwise

    compiled, module, path = _program(name, dict(NETWORKS)[name], tmp_path_factory)
    found, why = native.load(path)
    assert found is not None, why
    rng = np.random.default_rng(11)
    description = describe(compiled)
    alias = {k.name: k.alias for k in description.kernels}      # the operand a kernel may write over
    pairs = description.kernel_pairs
    assert {summed for *_, summed in pairs} == ({False} if name == "lenet" else {False, True}), pairs
    if name == "se_resnet":        # the scale's gradient summed per channel beside the per-sample channels' values
        assert any("w" in first + second for _, first, _, second, summed in pairs if summed), pairs
    for first_name, first_pattern, second_name, second_pattern, summed in pairs:
        k0, k1 = getattr(module, first_name), getattr(module, second_name)
        full = [k for k, letter in enumerate(first_pattern) if letter == "f"]
        link = second_pattern.rindex("f")          # where the second reads the first's output
        overs = [None, "second"] if alias[first_name] is None else [None, "first", "second", "both"]
        shapes = ((3, 5, 47, 47), (4, 9, 64, 130), (4, 600, 3, 5), (40, 65, 4, 4)) if summed else \
            ((3, 5, 7), (3, 5, (1 << 12) + 3), (2, 7, 3, (1 << 13) + 5))
        for shape in shapes:
            target = (1, shape[1], 1, 1)
            for over in [o for o in overs if not (summed and o in ("second", "both"))]:
                args0, args1 = _operands(first_pattern, shape, rng), _operands(second_pattern, shape, rng)
                runs = []
                for how in ("two kernels", "one pass", "numpy"):
                    a0, a1 = [np.copy(a) for a in args0], [np.copy(a) for a in args1]
                    out0 = a0[alias[first_name]] if over in ("first", "both") else np.full(shape, np.nan, np.float32)
                    out1 = np.full(target, np.nan, np.float32) if summed else \
                        a0[full[-1]] if over in ("second", "both") else np.full(shape, np.nan, np.float32)
                    a1[link] = out0
                    first, second = (k0, out0, *a0), (k1, out1, *a1)
                    if how == "two kernels":
                        assert found.ew(k0, out0, a0)
                        assert found.ew_sum(k1, out1, a1, target) if summed else found.ew(k1, out1, a1)
                    elif how == "one pass":
                        assert (found.ew_and_sum(first, second, target) if summed
                                else found.ew_pair(first, second)), (first_name, second_name)
                    elif summed:
                        elementwise.ew_and_sum(first, second, shape=target)
                    else:
                        elementwise.ew_pair(first, second)
                    runs.append((np.copy(out0), np.copy(out1)))
                message = f"{first_name} {first_pattern} then {second_name} {second_pattern}, over {over}"
                for got, want, numpy_ in zip(runs[1], runs[0], runs[2]):
                    np.testing.assert_array_equal(got, want, err_msg=message)
                    # (the second may subtract numbers near 1, or sum many: roundings of those are the tolerance)
                    scale = float(np.abs(numpy_).max())
                    np.testing.assert_allclose(got, numpy_, rtol=1e-5 if summed else 2e-6,
                                               atol=1e-5 * scale if summed else 1e-6, err_msg=message)


@needs_cc
@pytest.mark.parametrize("name", ["resnet_mini", "googlenet"])
def test_every_per_channel_sum_equals_numpy(name, tmp_path_factory):
    """Every compiled per-channel sum of a program (`_csum`: batch norm's statistics, fused with their elementwise
    producers) against numpy's chunked ew_sum, on odd shapes and one threaded; a program without batch norm has
    none."""
    from deepdsl.codegen.description import describe
    from deepdsl_runtime.cpu import elementwise

    compiled, module, path = _program(name, dict(NETWORKS)[name], tmp_path_factory)
    found, why = native.load(path)
    assert found is not None, why
    rng = np.random.default_rng(5)
    checked = 0
    for kernel_name, patterns in describe(compiled).kernel_sums:
        kernel = getattr(module, kernel_name)
        for pattern in patterns:
            # odd shapes, one threaded, and more channels than a thread reads at a time (DEEPDSL_CSUM_BLOCK, 256;
            # DEEPDSL_CSUM_LANES / the plane on small planes), on one thread and on two; planes on either side of
            # DEEPDSL_CSUM_PLANE (256) and more samples than a lane sums in float32 (DEEPDSL_CSUM_SAMPLES, 32)
            for shape in ((3, 5, 7, 3), (4, 9, 64, 130), (2, 600, 3, 5), (2, 700, 15, 15), (70, 3, 4, 4),
                          (3, 40, 16, 16), (3, 40, 1, 257), (33, 300, 4, 4)):
                args = _operands(pattern, shape, rng)
                target = (1, shape[1], 1, 1)
                want = np.empty(target, np.float32)
                elementwise.ew_sum(kernel, want, *args, shape=target)
                got = np.full(target, np.nan, np.float32)
                assert found.ew_sum(kernel, got, args, target), (kernel_name, pattern)
                scale = float(np.abs(want).max())
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{kernel_name} {pattern}")
                checked += 1
    assert (checked >= 4) == (name == "resnet_mini"), checked


def _row_operands(pattern, shape, rng):
    """Operands of each letter for values of `shape` summed over their last axis: per-channel operands (c) are one
    value per row, (..., 1); last-axis operands (r) one per position of a row, as a layer norm's weight."""
    made = {"f": lambda: rng.uniform(0.5, 1.5, shape), "u": lambda: (rng.random(shape) < 0.5),
            "c": lambda: rng.uniform(0.5, 1.5, shape[:-1] + (1,)), "r": lambda: rng.uniform(0.5, 1.5, shape[-1:]),
            "s": lambda: rng.uniform(0.5, 1.5)}
    return [np.uint8(made[k]()) if k == "u" else np.float32(made[k]()) for k in pattern]


@needs_cc
def test_sums_over_each_rows_last_axis_equal_numpy(tmp_path_factory):
    """Normalizations written out sum over each token's features ((N, T, D) to (N, T, 1)): the compiled per-channel
    sums and summed pairs run them under the view (1, N*T, D), each row a channel (`contract.sum_view`), within
    float32 roundings of numpy's kernels and chunked sums, at one and two threads, on odd shapes and on more rows
    than a thread reads at a time."""
    from deepdsl.codegen.description import describe
    from deepdsl_runtime.cpu import elementwise

    compiled, module, path = _program(NORMS_VIT, None, tmp_path_factory)
    found, why = native.load(path)
    assert found is not None, why
    description = describe(compiled)
    rng = np.random.default_rng(23)
    shapes = ((3, 5, 64), (7, 33, 17), (2, 600, 130), (1, 2, 9))
    before, checked = found.threads, 0
    try:
        for threads in (1, 2):
            found.set_threads(threads)
            for kernel_name, patterns in description.kernel_sums:
                for pattern in patterns:
                    for shape in shapes:
                        args, target = _row_operands(pattern, shape, rng), shape[:-1] + (1,)
                        want, got = np.empty(target, np.float32), np.full(target, np.nan, np.float32)
                        elementwise.ew_sum(getattr(module, kernel_name), want, *args, shape=target)
                        assert found.ew_sum(getattr(module, kernel_name), got, args, target), (kernel_name, pattern)
                        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
                        checked += 1
            for first_name, first_pattern, second_name, second_pattern, summed in description.kernel_pairs:
                if not summed:
                    continue
                k0, k1 = getattr(module, first_name), getattr(module, second_name)
                for shape in shapes:
                    target = shape[:-1] + (1,)
                    args0, args1 = _row_operands(first_pattern, shape, rng), _row_operands(second_pattern, shape, rng)
                    out0, out1 = np.full(shape, np.nan, np.float32), np.full(target, np.nan, np.float32)
                    a1 = list(args1)
                    a1[second_pattern.rindex("f")] = out0
                    assert found.ew_and_sum((k0, out0, *args0), (k1, out1, *a1), target), first_name
                    want0, want1 = np.empty(shape, np.float32), np.empty(target, np.float32)
                    k0(want0, *args0)                                   # numpy's kernels
                    a1[second_pattern.rindex("f")] = want0
                    elementwise.ew_sum(k1, want1, *a1, shape=target)
                    np.testing.assert_allclose(out0, want0, rtol=2e-6, atol=1e-6)
                    np.testing.assert_allclose(out1, want1, rtol=1e-5, atol=1e-5 * float(np.abs(want1).max()))
                    checked += 1
    finally:
        found.set_threads(before)
    letters = "".join(p for _, patterns in description.kernel_sums for p in patterns) + \
        "".join(a + b for a, _, b, *_ in [(p[1], None, p[3]) for p in description.kernel_pairs if p[4]])
    assert checked >= 20 and "c" in letters and "r" in letters, (checked, letters)


@needs_cc
def _column_sums_in_order(x: np.ndarray) -> np.ndarray:
    """(R, D) summed to (D,) as the compiled per-channel sums add a column (`channel_sums`, `deepdsl_column_sums`):
    each column's rows in float32 from zero over groups of DEEPDSL_CSUM_SAMPLES rows in the rows' order, the groups'
    sums added in double in their order."""
    group = 32                                                           # DEEPDSL_CSUM_SAMPLES
    total = np.zeros(x.shape[1], np.float64)
    for start in range(0, x.shape[0], group):
        lanes = np.zeros(x.shape[1], np.float32)
        for row in x[start:start + group]:
            lanes += row
        total += lanes
    return total.astype(np.float32)


def test_sums_over_every_axis_but_the_last_equal_numpy(tmp_path_factory):
    """A bias's and a layer norm weight's gradients sum (..., D) to (D,): the compiled per-channel sums, summed
    pairs and `sum_to` run them under the view (R, D, 1), each column a channel (`contract.sum_view`), within float32
    roundings of numpy's kernels (float64 for `sum_to`), with the same bits at 1, 2 and 3 threads, on odd shapes and
    more columns than a thread reads at a time; `sum_to`'s with the bits of its additions in their order
    (`_column_sums_in_order`), whole groups in pairs or not, a short last group, columns past the vectors, and more
    groups than the kernel keeps. So do the sums over the last axis, (..., D) to (..., 1), under the
    view (1, R, D): `sum_to` through the compiled per-channel sum, rows of 2 to 4100 floats."""
    from deepdsl.codegen.description import describe
    from deepdsl_runtime import cpu
    from deepdsl_runtime.cpu import elementwise

    compiled, module, path = _program(NORMS_VIT, None, tmp_path_factory)
    found, why = native.load(path)
    assert found is not None, why
    description = describe(compiled)
    rng = np.random.default_rng(29)
    shapes = ((3, 5, 64), (7, 33, 17), (2, 600, 130), (3, 4100), (1000, 2), (45, 83), (100, 64), (20000, 64))
    patterns = [(name, p) for name, ps in description.kernel_sums for p in ps if set(p) <= set("fsc")]
    pairs = [p for p in description.kernel_pairs if p[4] and set(p[1] + p[3]) <= set("fsc")]
    assert patterns and pairs, (description.kernel_sums, description.kernel_pairs)

    def operands(pattern, shape):
        made = {"f": lambda: rng.uniform(0.5, 1.5, shape), "c": lambda: rng.uniform(0.5, 1.5, shape[-1:]),
                "s": lambda: rng.uniform(0.5, 1.5)}
        return [np.float32(made[k]()) for k in pattern]

    cases = []
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32) + 0.5
        cases += [("ew_sum", name, operands(p, shape), shape) for name, p in patterns]
        cases += [("pair", pair, (operands(pair[1], shape), operands(pair[3], shape)), shape) for pair in pairs]
        cases.append(("sum_to", None, x, shape))
        cases.append(("rows", None, x, shape))
    before, results = found.threads, []
    try:
        for threads in (1, 2, 3):
            found.set_threads(threads)
            got = []
            for kind, what, args, shape in cases:
                target = shape[-1:]
                if kind == "ew_sum":
                    out = np.full(target, np.nan, np.float32)
                    assert found.ew_sum(getattr(module, what), out, args, target), what
                    want = np.empty(target, np.float32)
                    elementwise.ew_sum(getattr(module, what), want, *args, shape=target)
                    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
                    got.append(out)
                elif kind == "pair":
                    (first, _, second, second_pattern, _), (args0, args1) = what, args
                    k0, k1 = getattr(module, first), getattr(module, second)
                    out0, out1 = np.full(shape, np.nan, np.float32), np.full(target, np.nan, np.float32)
                    a1 = list(args1)
                    a1[second_pattern.rindex("f")] = out0
                    assert found.ew_and_sum((k0, out0, *args0), (k1, out1, *a1), target), first
                    want0, want1 = np.empty(shape, np.float32), np.empty(target, np.float32)
                    k0(want0, *args0)
                    a1[second_pattern.rindex("f")] = want0
                    elementwise.ew_sum(k1, want1, *a1, shape=target)
                    np.testing.assert_allclose(out0, want0, rtol=2e-6, atol=1e-6)
                    np.testing.assert_allclose(out1, want1, rtol=1e-5, atol=1e-5 * float(np.abs(want1).max()))
                    got += [out0, out1]
                elif kind == "rows":                # (..., D) to (..., 1): a layer norm's sums
                    rows = shape[:-1] + (1,)
                    want = args.astype(np.float64).sum(axis=-1, keepdims=True)
                    out = np.full(rows, np.nan, np.float32)
                    assert found.channel_sum(args, out)
                    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * float(np.abs(args).max()))
                    through = np.full(rows, np.nan, np.float32)
                    cpu.backend(found).sum_to(args, out=through, shape=rows)
                    assert through.tobytes() == out.tobytes()
                    got.append(out)
                else:
                    want = args.astype(np.float64).reshape(-1, shape[-1]).sum(axis=0)
                    tolerance = dict(rtol=1e-6, atol=1e-6 * float(np.abs(args).sum() / shape[-1]))
                    out = np.full(target, np.nan, np.float32)
                    assert found.channel_sum(args, out)
                    np.testing.assert_allclose(out, want, **tolerance)
                    assert out.tobytes() == _column_sums_in_order(args.reshape(-1, shape[-1])).tobytes(), shape
                    through = np.full((1,) + target, np.nan, np.float32)
                    cpu.backend(found).sum_to(args, out=through, shape=through.shape)
                    assert through.tobytes() == out.tobytes()
                    got.append(out)
            results.append(got)
    finally:
        found.set_threads(before)
    for got in results[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, results[0]))


@needs_cc
def test_a_tensor_summed_per_channel_equals_numpy(lib, tmp_path_factory):
    """sum_to (1, C, 1, 1) with the compiled kernels (`Native.channel_sum`, the library's `deepdsl_channel_sum`)
    against the float64 sum, on odd shapes: planes summed position by position (below DEEPDSL_CSUM_ROW, 64 floats),
    a row at a time (up to DEEPDSL_CSUM_PLANE, 256: with and without a partial vector, more samples than a lane sums
    in float32, 32) and by rows' vectors (larger), more channels than a thread reads at a time; the same bits on
    one, two and three threads, and built for AVX2 on planes up to 256 floats (larger ones' rows sum in vectors of
    the processor's width); through the backend's `sum_to` too. Tensors that are not
    contiguous float32, and every sum where the library has none, are numpy's."""
    from deepdsl_runtime import cpu
    from deepdsl_runtime.cpu import shape as shapes

    _, _, path = _program("resnet_mini", None, tmp_path_factory)
    program = kernel_builds.built(kernel_builds.shared_directory(tmp_path_factory), path.with_suffix(".c"), *AVX2)
    avx2 = native.Native(lib.lib, ctypes.CDLL(str(program)))
    rng = np.random.default_rng(11)
    rt = cpu.backend(lib)
    before = lib.threads
    try:
        for shape in ((4, 9, 64, 130), (2, 700, 15, 18), (3, 40, 1, 257), (5, 300, 17, 17), (3, 5, 7, 3),
                      (8, 256, 7, 7), (2, 40, 16, 16), (40, 70, 9, 9), (3, 300, 8, 8), (2, 3, 1, 1)):
            x = rng.standard_normal(shape).astype(np.float32) + 0.5
            want = x.astype(np.float64).sum(axis=(0, 2, 3)).reshape(1, shape[1], 1, 1)
            tolerance = dict(rtol=1e-6, atol=1e-6 * float(np.abs(x).sum() / shape[1]), err_msg=str(shape))
            results = []
            for kernels, threads in ((lib, 1), (lib, 2), (lib, 3)) + (((avx2, 2),) if shape[2] * shape[3] <= 256
                                                                     else ()):
                kernels.set_threads(threads)
                got = np.full(want.shape, np.nan, np.float32)
                assert kernels.channel_sum(x, got), shape
                results.append(got)
            np.testing.assert_allclose(results[0], want, **tolerance)
            for got in results[1:]:
                np.testing.assert_array_equal(got, results[0], err_msg=str(shape))
            got = np.full(want.shape, np.nan, np.float32)
            rt.sum_to(x, out=got, shape=got.shape)
            np.testing.assert_array_equal(got, results[0])
    finally:
        lib.set_threads(before)
    strided = np.ones((2, 8, 6, 6), np.float32)[:, :, ::2]
    out = np.full((1, 8, 1, 1), np.nan, np.float32)
    assert not lib.channel_sum(strided, out) and not lib.channel_sum(strided.astype(np.float64), out)
    shapes.sum_to(strided, out=out, shape=out.shape, native=lib)
    np.testing.assert_array_equal(out.ravel(), np.full(8, 36.0, np.float32))
    kept, lib._channel_sum = lib._channel_sum, None      # a library built from an older program's C file
    try:
        x = np.ones((2, 8, 6, 6), np.float32)
        assert not lib.channel_sum(x, out)
        rt.sum_to(x, out=out, shape=out.shape)
        np.testing.assert_array_equal(out.ravel(), np.full(8, 72.0, np.float32))
    finally:
        lib._channel_sum = kept


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_by_index_equal_numpy_bit_for_bit(lib, threads):
    """gather_rows and scatter_rows (a token embedding and its gradient) of the library against numpy's kernels at
    one, two and three threads: the same bits (each sum made in the order of the lookups), row numbers outside the
    table included; a GPT-2-like width (769 features: blocks of 16 and a rest)."""
    from deepdsl_runtime.cpu import shape as shapes

    rng = np.random.default_rng(12)
    before = lib.threads
    lib.set_threads(threads)
    try:
        for rows, d, m in ((50, 769, 300), (7, 3, 40), (1000, 64, 64)):
            table = rng.standard_normal((rows, d)).astype(np.float32)
            ids = rng.integers(0, rows, m).astype(np.int32)
            ids[::7] = ids[0]                        # many lookups of one row
            ids[5] = -3
            ids[-1] = rows
            g = rng.standard_normal((m, d)).astype(np.float32)
            want, got = np.full((m, d), 1.0, np.float32), np.full((m, d), 2.0, np.float32)
            shapes.gather_rows(table, ids, out=want)
            assert lib.gather_rows(table, ids, got)
            np.testing.assert_array_equal(got, want)
            want, got = np.full((rows, d), 1.0, np.float32), np.full((rows, d), 2.0, np.float32)
            shapes.scatter_rows(g, ids, out=want, rows=rows)
            assert lib.scatter_rows(g, ids, got)
            np.testing.assert_array_equal(got, want)
        assert not lib.gather_rows(table, ids.astype(np.int64), got[:len(ids)])
    finally:
        lib.set_threads(before)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
def test_label_ranks_and_token_masks_equal_numpy(lib, threads):
    """label_rank (ties, labels outside the row) and equal on tokens of the library against numpy's kernels."""
    from deepdsl_runtime.cpu import loss, masks

    rng = np.random.default_rng(13)
    before = lib.threads
    lib.set_threads(threads)
    try:
        x = np.round(rng.standard_normal((700, 37)) * 2).astype(np.float32)
        labels = rng.integers(0, 37, 700).astype(np.int32)
        labels[3], labels[9] = -1, 37
        want, got = np.empty(700, np.float32), np.empty(700, np.float32)
        loss.label_rank(x, labels, out=want)
        assert lib.label_rank(x, labels, got)
        np.testing.assert_array_equal(got, want)
        tokens = rng.integers(0, 5, (40, 300)).astype(np.int32)
        want, got = np.empty(tokens.shape, np.uint8), np.empty(tokens.shape, np.uint8)
        masks.equal(tokens, out=want, value=0.0)
        assert lib.equal_tokens(tokens, 0.0, got) and not lib.equal_tokens(tokens, 0.5, got)
        np.testing.assert_array_equal(got, want)
    finally:
        lib.set_threads(before)


@needs_cc
def test_a_batch_of_one_kernel_equals_its_calls_one_by_one(lib, tmp_path_factory):
    """`rt.ew_many` on the compiled kernels (resnet_mini's batched update, v0 - v1 * v2 with v1 a scalar): one call
    of the batched function over sets of operands of every size (two floats, odd sizes, several vectors, one past the
    threads' share), outputs over an operand and not: the same bits as the compiled kernel's function called on each
    set, on 1, 2 and 3 threads; within float32 rounding of the numpy kernel. Called again with other arrays of the
    same shapes (the batch refills what it kept), with a strided operand or a scalar array of two values (numpy's
    kernel on each), the results stay right."""
    from deepdsl_runtime.cpu import backend

    _, module, _ = _program("resnet_mini", None, tmp_path_factory)
    kernel = module.ew_mul_sub
    function = getattr(lib.program, "deepdsl_ew_mul_sub_fsf", None)
    assert function is not None and getattr(lib.program, "deepdsl_ew_mul_sub_fsf_many", None) is not None
    function.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    rng = np.random.default_rng(5)
    sizes = [(2,), (17,), (64,), (3, 5), (4096,), (70001,), (33, 65)]

    def operands():
        return [(rng.standard_normal(s).astype(np.float32), rng.standard_normal(s).astype(np.float32))
                for s in sizes]

    rt, before = backend(lib), lib.threads
    try:
        for _ in range(2):
            sets = operands()
            lr = float(rng.uniform(0.01, 0.1))
            want = [np.empty_like(w) for w, _ in sets]
            for out, (w, v) in zip(want, sets):
                kernel(out, w, lr, v)
            one_by_one = []
            for w, v in sets:
                out = np.full_like(w, np.nan)
                pointers = (ctypes.c_void_p * 3)(w.ctypes.data, 0, v.ctypes.data)
                function(w.size, out.ctypes.data, pointers, (ctypes.c_float * 3)(0, lr, 0))
                one_by_one.append(out)
            for threads in (1, 2, 3):
                lib.set_threads(threads)
                outs = [np.full_like(w, np.nan) for w, _ in sets]
                assert lib.ew_many(kernel, [(o, w, lr, v) for o, (w, v) in zip(outs, sets)])
                for got, exact, close in zip(outs, one_by_one, want):
                    assert got.tobytes() == exact.tobytes()
                    np.testing.assert_allclose(got, close, rtol=1e-6, atol=1e-6)
                over = [w.copy() for w, _ in sets]                   # written over its first operand
                rt.ew_many(kernel, *[(o, o, lr, v) for o, (_, v) in zip(over, sets)])
                assert all(a.tobytes() == b.tobytes() for a, b in zip(over, one_by_one))
    finally:
        lib.set_threads(before)
    w, v = sets[2]
    strided = np.repeat(v, 2)[::2]
    assert not strided.flags.c_contiguous
    assert not lib.ew_many(kernel, [(np.empty_like(w), w, lr, strided)])
    outs = [np.empty_like(w), np.empty_like(w)]
    rt.ew_many(kernel, (outs[0], w, lr, strided), (outs[1], w, np.array([lr, 2.0], np.float32)[:1], v))
    np.testing.assert_allclose(outs[0], w - np.float32(lr) * v, rtol=1e-6)
    np.testing.assert_allclose(outs[1], w - np.float32(lr) * v, rtol=1e-6)
    assert not lib.ew_many(kernel, [(np.empty_like(w), w, np.array([lr, 2.0], np.float32), v)])


def test_a_batch_asks_for_each_call_whether_its_arrays_are_the_last_calls_objects():
    """`_same_objects(positions)` (how `_Batch` finds the calls whose pointers it keeps), written out for up to five
    positions and general beyond: true for the objects `held` holds, in order, false where any one of them is
    another object, even an equal one."""
    rng = np.random.default_rng(3)
    for count in range(1, 8):
        positions = tuple(sorted(rng.choice(9, count, replace=False)))
        call = [np.float32(k) for k in range(9)]
        held = tuple(call[p] for p in positions)
        same = native._same_objects(positions)
        assert same(tuple(call), held)
        for p in positions:
            other = list(call)
            other[p] = np.float32(p)                   # equal, not the same object
            assert not same(tuple(other), held), (positions, p)
        assert same(tuple(call), held[::-1]) == (count == 1 or all(a is b for a, b in zip(held, held[::-1])))


@needs_cc
@pytest.mark.parametrize("rows, columns", [(2048, 256), (7, 1), (33, 15), (65, 17), (3, 1000)])
def test_log_softmax_equals_numpy_at_any_thread_count(lib, rows, columns):
    """The compiled log-softmax against numpy's kernel within float32 rounding, and the same bits on 1, 2 and 3
    threads and written over its input; rows of whole vectors and not, a row holding NaN, a row of -inf, a row with
    -inf among finite scores, a row of large scores (the largest subtracted first); output NaN-filled."""
    from deepdsl_runtime.cpu import loss

    rng = np.random.default_rng(rows + columns)
    x = (4 * rng.standard_normal((rows, columns))).astype(np.float32)
    x[1, 0] = np.nan
    x[2] = -np.inf
    x[-1] += 3e4
    if columns > 1:
        x[0, -1] = -np.inf
    want = np.empty_like(x)
    with np.errstate(invalid="ignore"):                 # the NaN rows
        loss.log_softmax(x, out=want, workspace=np.empty(x.size, np.float32))
    before, results = lib.threads, []
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            got = np.full_like(x, np.nan)
            assert lib.log_softmax(x, got)
            results.append(got)
            inplace = x.copy()
            assert lib.log_softmax(inplace, inplace)
            np.testing.assert_array_equal(inplace, got)
    finally:
        lib.set_threads(before)
    assert all(r.tobytes() == results[0].tobytes() for r in results)
    np.testing.assert_allclose(results[0], want, rtol=2e-6, atol=2e-6)
    assert np.isnan(results[0][1]).all() and np.isnan(results[0][2]).all()
    assert not lib.log_softmax(x[::2], np.empty_like(x[::2]))           # strided rows: numpy's kernel


@needs_cc
@pytest.mark.parametrize("case", [  # (units, T, S, d, e, causal, bias shape or None, dropout's keep or None)
    ((2, 3), 5, 7, 4, 6, False, None, None), ((2, 3), 6, 6, 4, 3, True, (1, 3, 6, 6), None),
    ((3,), 70, 90, 5, 2, False, (3, 1, 90), None), ((2,), 130, 130, 64, 64, True, None, None),
    ((4,), 17, 200, 33, 5, False, (4, 17, 1), None), ((2, 2), 3, 2, 16, 16, True, None, None),
    ((3,), 70, 90, 5, 2, False, (3, 1, 90), 0.8), ((2,), 130, 130, 16, 8, True, None, 0.5),
    # units weighed whole (contract.attention_in_units): a ViT's heads, a causal language model's with dropout, a
    # bias per query, the largest unit, and one query beyond it; with dropout, units of whole blocks of 8 queries
    # and keys (the largest, with a bias per query) and not (odd sizes, causal or not), and one key beyond them
    ((2, 3), 16, 16, 16, 16, False, None, None), ((2,), 16, 16, 16, 16, True, None, 0.9),
    ((3,), 9, 13, 64, 7, False, (3, 9, 1), 0.7), ((2,), 64, 64, 64, 64, True, (1, 64, 64), None),
    ((2,), 65, 8, 4, 4, False, None, None), ((2,), 64, 64, 16, 16, True, None, 0.9),
    ((3,), 9, 17, 8, 8, False, None, 0.7), ((2,), 64, 64, 64, 64, True, (2, 64, 1), 0.6),
    ((2,), 20, 65, 8, 8, False, None, 0.8), ((3,), 27, 19, 5, 9, True, None, 0.75)])
def test_attention_equals_numpy_at_any_thread_count(lib, case, monkeypatch):
    """Attention and its gradient with the library's passes over rows and its products, or with small units
    weighed whole, against numpy's kernels within float32 rounding, the same bits at 1, 2 and 3 threads; outputs
    start NaN-filled, the workspace too; with dropout's masks over one block of queries and over several."""
    from deepdsl_runtime import cpu

    assert lib._attention_weights is not None and lib._attention_dscores is not None
    whole = []
    for name in ("attention_units", "attention_units_grad"):
        def spy(*args, real=getattr(lib, name)):
            whole.append(real(*args))
            return whole[-1]
        monkeypatch.setattr(lib, name, spy)
    lead, t, s, d, e, causal, bias_shape, keep = case
    rng = np.random.default_rng(t * s)
    q, k = rng.standard_normal((*lead, t, d)).astype(np.float32), rng.standard_normal((*lead, s, d)).astype(np.float32)
    v, g = rng.standard_normal((*lead, s, e)).astype(np.float32), rng.standard_normal((*lead, t, e)).astype(np.float32)
    bias = () if bias_shape is None else (rng.standard_normal(bias_shape).astype(np.float32),)
    attrs = {"scale": 0.25, "causal": causal}
    if keep is not None:
        attrs.update(keep=keep, mask=(rng.random((*lead, t, s)) < keep).astype(np.uint8))
    units = math.prod(lead)
    sizes = (units * contract.attention_scratch(t, s),
             units * contract.attention_grad_scratch(t, s, d, e, keep is not None))
    want_o, want_g = np.empty((*lead, t, e), np.float32), np.empty(q.size + k.size + v.size, np.float32)
    cpu.attention(q, k, v, *bias, out=want_o, **attrs)
    cpu.attention_grad(q, k, v, want_o, g, *bias, out=want_g, **attrs)
    before, results = lib.threads, []
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            o, grads = np.full_like(want_o, np.nan), np.full_like(want_g, np.nan)
            cpu.attention(q, k, v, *bias, out=o, workspace=np.full(sizes[0], np.nan, np.float32), gemm=lib.gemm,
                          native=lib, **attrs)
            cpu.attention_grad(q, k, v, want_o, g, *bias, out=grads, workspace=np.full(sizes[1], np.nan, np.float32),
                               gemm=lib.gemm, native=lib, **attrs)
            results.append((o, grads))
    finally:
        lib.set_threads(before)
    assert whole == [contract.attention_in_units(t, s, d, e)] * 6
    for o, grads in results[1:]:
        assert o.tobytes() == results[0][0].tobytes() and grads.tobytes() == results[0][1].tobytes()
    np.testing.assert_allclose(results[0][0], want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[0][1], want_g, rtol=1e-5, atol=1e-5 * np.abs(want_g).max())


@needs_cc
@pytest.mark.parametrize("case", [  # (N, T, S, H, d, e, causal, bias shape or None, dropout's keep or None)
    (3, 16, 16, 4, 16, 16, False, None, None), (2, 9, 13, 3, 7, 5, False, (2, 3, 9, 1), None),
    (2, 16, 16, 2, 8, 8, True, None, 0.9), (1, 64, 64, 2, 64, 64, True, (1, 1, 64, 64), None),
    (2, 5, 5, 1, 3, 3, False, None, None)])
def test_attention_reads_its_heads_in_place_with_the_units_bits(lib, case, monkeypatch):
    """Attention and its gradient with `heads` (q, k, v, its output and gradients stored (N, T, H, d)) weighed in
    place by the compiled kernels: the bits of the same kernels on copies in the units' layout (N, H, T, d), on 1, 2
    and 3 threads, outputs NaN-filled; numpy's kernels (on such copies) within float32 rounding."""
    from deepdsl_runtime import cpu

    in_place = []
    for name in ("attention_units", "attention_units_grad"):
        def spy(*args, real=getattr(lib, name), **kwargs):
            done = real(*args, **kwargs)
            if kwargs.get("heads"):
                in_place.append(done)
            return done
        monkeypatch.setattr(lib, name, spy)

    n, t, s, h, d, e, causal, bias_shape, keep = case
    rng = np.random.default_rng(t * s + h)
    q, k = rng.standard_normal((n, t, h, d)).astype(np.float32), rng.standard_normal((n, s, h, d)).astype(np.float32)
    v, g = rng.standard_normal((n, s, h, e)).astype(np.float32), rng.standard_normal((n, t, h, e)).astype(np.float32)
    bias = () if bias_shape is None else (rng.standard_normal(bias_shape).astype(np.float32),)
    attrs = {"scale": 0.25, "causal": causal}
    if keep is not None:
        attrs.update(keep=keep, mask=(rng.random((n, h, t, s)) < keep).astype(np.uint8))

    def units(x):
        return np.ascontiguousarray(x.swapaxes(1, 2))

    def packed_heads(flat):             # the units' packed gradients as `heads` packs them
        pieces, at = [], 0
        for x in (q, k, v):
            pieces.append(flat[at:at + x.size].reshape(units(x).shape).swapaxes(1, 2).ravel())
            at += x.size
        return np.concatenate(pieces)

    space = np.full(1 << 16, np.nan, np.float32)
    want_o = np.empty((n, h, t, e), np.float32)
    want_g = np.empty(q.size + k.size + v.size, np.float32)
    cpu.attention(units(q), units(k), units(v), *bias, out=want_o, gemm=lib.gemm, native=lib, workspace=space,
                  **attrs)
    cpu.attention_grad(units(q), units(k), units(v), want_o, units(g), *bias, out=want_g, gemm=lib.gemm,
                       native=lib, workspace=space, **attrs)
    o_heads = np.ascontiguousarray(want_o.swapaxes(1, 2))
    before = lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            o, grads = np.full_like(o_heads, np.nan), np.full_like(want_g, np.nan)
            cpu.attention(q, k, v, *bias, out=o, heads=True, gemm=lib.gemm, native=lib, workspace=space, **attrs)
            cpu.attention_grad(q, k, v, o_heads, g, *bias, out=grads, heads=True, gemm=lib.gemm, native=lib,
                               workspace=space, **attrs)
            assert o.tobytes() == o_heads.tobytes() and grads.tobytes() == packed_heads(want_g).tobytes(), threads
    finally:
        lib.set_threads(before)
    assert in_place == [True] * 6
    o, grads = np.full_like(o_heads, np.nan), np.full_like(want_g, np.nan)
    cpu.attention(q, k, v, *bias, out=o, heads=True, **attrs)
    cpu.attention_grad(q, k, v, o_heads, g, *bias, out=grads, heads=True, **attrs)
    np.testing.assert_allclose(o, o_heads, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads, packed_heads(want_g), rtol=1e-5, atol=1e-5 * np.abs(want_g).max())


DROPOUT_MASKS = [  # (shape, keep, seed, step, key): whole blocks of 16 groups of 8 bytes, partial ones, one byte
    ((32, 4, 64, 64), 0.9, 0, 3, 1), ((7, 13), 0.5, 12345, 0, 2), ((1,), 0.3, 1, 1, 1), ((129,), 0.5, 3, 4, 5),
    ((5, 3, 9), 0.7, 2 ** 40, 17, 5), ((1000, 17), 0.2, 9, 9, 9)]


@needs_cc
def test_dropout_masks_are_numpys_at_any_thread_count(lib):
    """The compiled masks (`deepdsl_bernoulli`: Philox4x64-10 sixteen groups at a time) are the bytes numpy's
    generator gives the reference semantics, at 1, 2 and 3 threads, over outputs filled with another value."""
    from deepdsl_runtime.cpu import masks

    before = lib.threads
    try:
        for shape, keep, seed, step, key in DROPOUT_MASKS:
            want = masks.bernoulli_mask(seed, step, key, shape, keep)
            assert 0 < want.mean() < 1 or want.size == 1
            for threads in (1, 2, 3):
                lib.set_threads(threads)
                got = np.full(shape, 7, np.uint8)
                masks.bernoulli(out=got, shape=shape, keep=keep, key=key, seed=seed, step=step, native=lib)
                np.testing.assert_array_equal(got, want, err_msg=f"{shape} at {threads} threads")
    finally:
        lib.set_threads(before)


@needs_cc
def test_attention_passes_built_for_avx2_give_the_same_bits(lib, tmp_path_factory):
    """The attention's passes over rows built for a processor with AVX2 but not AVX-512 (masked vectors by AVX's own
    loads and stores) give this build's bits: rows of every length around a vector's, causal, with a bias, with
    and without dropout's masks; and so do dropout's masks themselves (scalar 128-bit products instead of vectors)."""
    from deepdsl_runtime.cpu.attention import Bias

    avx = generic_kernels(tmp_path_factory, *AVX2)
    rng = np.random.default_rng(17)
    for s in (1, 7, 8, 9, 16, 23):
        scores = (3 * rng.standard_normal((3, s, s))).astype(np.float32)
        bias = Bias(rng.standard_normal((3, 1, s)).astype(np.float32), (3, s, 4))
        delta = rng.standard_normal((3, s)).astype(np.float32)
        mask = (rng.random((3, s, s)) < 0.6).astype(np.uint8)
        results = []
        for kernels in (lib, avx):
            w, dw = scores.copy(), scores[::-1].copy()
            assert kernels.attention_weights(w, bias, 0, 0, 0.3, True)
            kept, dropped = np.empty_like(w), scores.copy()
            assert kernels.attention_kept(w, mask, 0.6, kept)
            assert kernels.attention_dscores(w, dropped, delta, 0, 0.3, mask, 0.6)
            assert kernels.attention_dscores(w, dw, delta, 0, 0.3)
            results.append((w, dw, kept, dropped))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(*results)), s
        assert np.allclose(results[0][0].sum(-1), 1, atol=1e-6)
    for t, s, d, e in ((16, 16, 16, 16), (7, 13, 5, 9), (64, 64, 64, 64)):       # units weighed whole
        q, k = rng.standard_normal((3, t, d)).astype(np.float32), rng.standard_normal((3, s, d)).astype(np.float32)
        v, g = rng.standard_normal((3, s, e)).astype(np.float32), rng.standard_normal((3, t, e)).astype(np.float32)
        bias = Bias(rng.standard_normal((3, t, 1)).astype(np.float32), (3, t, d))
        mask = (rng.random((3, t, s)) < 0.6).astype(np.uint8) if max(t, s) <= 16 else None
        results = []
        for kernels in (lib, avx):
            o, dq, dk, dv = np.empty((3, t, e), np.float32), np.empty_like(q), np.empty_like(k), np.empty_like(v)
            assert kernels.attention_units(q, k, v, bias, mask, 0.6, o, 0.3, True)
            assert kernels.attention_units_grad(q, k, v, o, g, bias, mask, 0.6, dq, dk, dv, 0.3, True)
            results.append((o, dq, dk, dv))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(*results)), (t, s, d, e)
    for shape, keep, seed, step, key in DROPOUT_MASKS:
        masks = [np.full(shape, 7, np.uint8) for _ in range(2)]
        for kernels, out in zip((lib, avx), masks):
            assert kernels.bernoulli(out, seed, contract.counter_key(step, key), keep)
        np.testing.assert_array_equal(masks[0], masks[1])


@needs_cc
def test_layer_norms_built_for_avx2_give_the_same_bits(lib, tmp_path_factory):
    """The layer norm's kernels built for a processor with AVX2 but not AVX-512 give this build's bits: each row's
    sums run in 16 lanes of their own and halve in a fixed order, whatever the vectors' width. Rows of whole
    vectors and not, affine and not."""
    from deepdsl_runtime import contract

    avx = generic_kernels(tmp_path_factory, *AVX2)
    rng = np.random.default_rng(31)
    for rows, features, affine in ((100, 64, True), (7, 33, False), (65, 5, True), (3, 300, True)):
        x = (3 * rng.standard_normal((rows, features)) + 1).astype(np.float32)
        g = rng.standard_normal((rows, features)).astype(np.float32)
        params = tuple(rng.standard_normal(features).astype(np.float32) for _ in range(2 if affine else 0))
        results = []
        for kernels in (lib, avx):
            y, dx, both = np.empty_like(x), np.empty_like(x), np.empty((2, features), np.float32)
            workspace = np.empty(contract.layer_norm_param_scratch(rows, features), np.float32)
            assert kernels.layer_norm(x, params, y, 1e-5, 1)
            assert kernels.layer_norm_grad(x, g, params[:1], dx, 1e-5, 1)
            assert kernels.layer_norm_param_grad(x, g, both, workspace, 1e-5, 1)
            results.append((y, dx, both))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(*results)), (rows, features)


_MATH_LOOPS = """
#include <math.h>
#include <stdint.h>
#include "deepdsl_math.h"
void erf_loop(const float* x, float* out, long n) { for (long i = 0; i < n; ++i) out[i] = deepdsl_erff(x[i]); }
void exp_loop(const float* x, float* out, long n) { for (long i = 0; i < n; ++i) out[i] = deepdsl_expf_poly(x[i]); }
int fused(void) {
#ifdef __FMA__
    return 1;
#else
    return 0;
#endif
}
"""


@needs_cc
def test_the_polynomial_erf_and_exp_are_within_a_few_ulp(tmp_path):
    """deepdsl_erff (what the compiled elementwise kernels call for erf: exact GELU) within 6 ulp of erf (7 on a
    processor without fused multiply-adds) and deepdsl_expf_poly (the attention's softmax) within 1 ulp of exp, over
    their whole ranges (tiny, the largest errors found by scanning every float of [0.5, 3.92), where erf's rational
    form gives way to 1, and where exp overflows or turns subnormal), built as the kernels are, with signed zeros,
    infinities and NaN as libm gives them."""
    source = tmp_path / "math.c"
    source.write_text(_MATH_LOOPS)
    done = subprocess.run(compile_command(source, tmp_path / "math.so"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(tmp_path / "math.so"))
    rng = np.random.default_rng(11)

    def run(name, x):
        out = np.full_like(x, np.nan)
        getattr(lib, name)(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_long(x.size))
        return out

    def ulps(got, want):
        want32 = want.astype(np.float32)
        return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want32)).astype(np.float64)

    x = np.concatenate([np.linspace(-5, 5, 200_001), 2 * rng.standard_normal(50_000), 1e-30 * rng.standard_normal(100),
                        np.linspace(0.92, 0.924, 1001), np.linspace(3.9, 3.94, 1001),
                        [3.653986, 2.9810781, 1.7476387, 3.298341, 2.1586745, 1.759811]]).astype(np.float32)
    want = np.array([math.erf(v) for v in x.astype(np.float64)])
    assert ulps(run("erf_loop", x), want).max() <= (6.0 if lib.fused() else 7.0)
    special = run("erf_loop", np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45], np.float32))
    assert special[:4].tolist() == [0.0, 0.0, 1.0, -1.0] and np.signbit(special[1]) and np.isnan(special[4])
    x = np.concatenate([np.linspace(-87.3, 88.7, 400_001), 5 * rng.standard_normal(50_000)]).astype(np.float32)
    assert ulps(run("exp_loop", x), np.exp(x.astype(np.float64))).max() <= 1.0
    special = run("exp_loop", np.array([0.0, -np.inf, np.inf, np.nan, -100.0, 100.0, 88.72], np.float32))
    assert special[:3].tolist() == [1.0, 0.0, np.inf] and np.isnan(special[3])
    assert special[4] == 0.0 and special[5] == np.inf and np.isfinite(special[6])


@needs_cc
def test_broadcast_operands_run_numpy_and_small_ones_the_compiled_kernel(lib, tmp_path_factory):
    """A kernel whose operand is broadcast other than the compiled patterns take runs numpy's; a small one runs the
    compiled kernel as a large one does (its bits do not depend on its size, nor on a batch)."""
    _, module, _ = _program("resnet_mini", None, tmp_path_factory)
    kernel = module.ew_mul_sub
    out = np.empty((1 << 15, 3), np.float32)
    assert not lib.ew(kernel, out, (np.ones(out.shape, np.float32), 0.5, np.ones((1 << 15, 1), np.float32)))
    small = np.arange(7, dtype=np.float32)
    assert lib.ew(kernel, out[0], (np.ones(3, np.float32), 0.5, small[:3]))
    np.testing.assert_array_equal(out[0], 1 - np.float32(0.5) * small[:3])


@needs_cc
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_convolutions_under_their_planned_workspace(lib, geometry, stride1_scheme):
    """conv2d and both its gradients with the compiled passes equal numpy's (the input gradient bit for bit: the
    same additions in the same order), in chunks of one sample and of all, with workspaces of exactly the planned
    size filled with NaN."""
    n, c, h, w, kh, kw, stride, pad = geometry
    o = 3
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((o, c, kh, kw)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    ho, wo = contract.out_size(h, kh, stride, pad), contract.out_size(w, kw, stride, pad)
    g = rng.standard_normal((n, o, ho, wo)).astype(np.float32)
    per = contract.conv2d_scratch(x.shape, wt.shape, (n, o, ho, wo), stride, pad)
    per_f, acc = contract.conv2d_bwd_filter_scratch(g.shape, x.shape, (kh, kw), pad)
    per_d = contract.conv2d_bwd_data_scratch(g.shape, wt.shape, (h, w), stride, pad)
    for samples in (1, n):
        results = []
        for kernels in (None, lib):
            ws = np.full(samples * per, np.nan, np.float32)
            out = np.full((n, o, ho, wo), np.nan, np.float32)
            conv.conv2d(x, wt, b, out=out, stride=stride, pad=pad, workspace=ws if per else None, native=kernels)
            ws = np.full(samples * per_f + (acc if samples < n else 0), np.nan, np.float32)
            dw = np.full(wt.shape, np.nan, np.float32)
            conv.conv2d_bwd_filter(g, x, out=dw, stride=stride, pad=pad, kernel=(kh, kw), workspace=ws,
                                   native=kernels)
            ws = np.full(max(samples * per_d, 1), np.nan, np.float32)
            dx = np.full(x.shape, np.nan, np.float32)
            conv.conv2d_bwd_data(g, wt, out=dx, stride=stride, pad=pad, size=(h, w), workspace=ws if per_d else None,
                                 native=kernels)
            results.append((out, dw, dx))
        for got, want in zip(results[1], results[0]):
            # (a thin convolution's filter gradient sums in another order: within float32 rounding of its largest)
            assert not np.isnan(got).any()
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * max(1.0, float(np.abs(want).max())))
        np.testing.assert_array_equal(results[1][2], results[0][2])


@needs_cc
@pytest.mark.parametrize("case", GROUPED_CONV, ids=[str(c) for c in GROUPED_CONV])
def test_grouped_convolutions_with_compiled_passes(lib, case, monkeypatch):
    """Grouped and depthwise convolutions and their gradients with the compiled kernels (im2col, col2im, the bias;
    depthwise ones plane by plane, summing in their own order: 1e-5) equal numpy's, with workspaces of exactly the
    planned size filled with NaN, whole batch and one sample at a time."""
    ran, depthwise = [], lib.depthwise
    monkeypatch.setattr(lib, "depthwise", lambda op, *rest: ran.append(op) or depthwise(op, *rest))
    n, c, h, w, o, k, s, p, bias, groups = case
    rng = np.random.default_rng(4)
    for node in grouped_conv_nodes(case):
        arrays = [rng.standard_normal(i.shape).astype(np.float32) for i in node.inputs]
        for limit in (1 << 40, 1):
            results = []
            for kernels in (None, lib):
                out = np.full(node.shape, np.nan, np.float32)
                size = get_op(node.op).workspace(node, limit).nbytes // 4
                workspace = np.full(size, np.nan, np.float32) if size else None
                getattr(conv, node.op)(*arrays, out=out, workspace=workspace, native=kernels, **node.kwargs)
                results.append(out)
            assert not np.isnan(results[1]).any()
            np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert sorted(set(ran)) == (["conv2d", "conv2d_bwd_data", "conv2d_bwd_filter"] if groups == c == o else [])


@needs_cc
@pytest.mark.parametrize("name,image", NETWORKS, ids=[n for n, _ in NETWORKS])
def test_training_steps_with_compiled_kernels_equal_numpy(name, image, tmp_path_factory):
    """Every network: a training step with the compiled kernels computes the same bits on 1, 2 and 3 threads, and
    numpy's on 1 and 2; a training step and a test step with the compiled kernels equal the numpy backend's within
    float32 tolerance (elementwise kernels round as C's float32 functions do, per-channel sums and thin convolutions'
    filter gradients add in another order, which an ill-conditioned network at this size amplifies: 1e-4, or ten
    times the difference one rounding of the input makes, thirty where Winograd's transforms take layers; for
    networks trained by Adam(W), `ADAPTIVE_TOLERANCE`, all but a few in a thousand elements within 1e-4, the rest
    within Adam's step), and the allocator measures the planned peaks (the plan is the same)."""
    _, module, _ = _program(name, image, tmp_path_factory)
    cls = model_class(module)
    rng = np.random.default_rng(7)
    data = [cls.random_batch(rng) for _ in range(2)]
    reference = cls("cpu", 0, "static", kernels="numpy", threads=2)
    losses, _, _, tensors = _steps(reference, data[:1])
    # the network's own float32 spread at this size: numpy's step on the batch moved by one rounding (ResNet-50 at
    # 64x64 and batch 2 turns that into differences of a few parts in 10^3 in its first layer's gradient)
    nudged = [(x * np.float32(1 + 2 ** -23) if x.dtype == np.float32 else x, y) for x, y in data[:1]]
    _, _, _, moved = _steps(cls("cpu", 0, "static", kernels="numpy"), nudged)
    # numpy's products on one thread: the same bits (the parts are the shapes', not the threads')
    alone_losses, _, _, alone = _steps(cls("cpu", 0, "static", kernels="numpy", threads=1), data[:1])
    assert alone_losses == losses and all(np.array_equal(alone[k], v) for k, v in tensors.items())
    runs, winograd = {}, []
    for threads in (1, 2, 3):
        model = cls("cpu", 0, "static", kernels="compiled", threads=threads)
        assert model.kernels.startswith("compiled kernels") and model.rt.native is not None
        native_ = model.rt.native
        transforms = native_.winograd_conv
        native_.winograd_conv = lambda *a, _run=transforms: winograd.append(1) or _run(*a)
        runs[threads] = _steps(model, data[:1])
    # Winograd's transforms (ResNet-50's 3x3 layers at 16x16 and 8x8 here) round more than direct sums (about 1e-5 of
    # a layer's outputs, ~100 units in the last place; tests/test_blocked_conv.py): at most 15 times the spread
    # measured on ResNet-50 (its res5a_branch2b_W gradient), the others within 6 times; bounded at 30 times
    bound = 30 if winograd else 10
    got_losses, _, _, got_tensors = runs[1]
    for threads in (2, 3):        # the compiled kernels compute the same bits on any number of threads
        assert runs[threads][0] == got_losses, threads
        for key, value in got_tensors.items():
            assert np.array_equal(runs[threads][3][key], value), (threads, key)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-4, atol=1e-6)
    for key, value in tensors.items():
        scale = max(float(np.max(np.abs(value))), 1e-6)
        spread = float(np.max(np.abs(moved[key] - value))) / scale
        errors = np.abs(got_tensors[key] - value) / scale
        if name in ADAPTIVE_TOLERANCE:
            # Adam's first step moves an element by lr g / (|g| + eps): where |g| is near eps, one rounding of g moves
            # it by up to 2 lr (0.02 here). Such elements are a few in a thousand at most; the rest agree
            assert np.count_nonzero(errors > 1e-4) <= max(1, errors.size // 1000), (key, np.sort(errors.ravel())[-5:])
            assert float(np.max(np.abs(got_tensors[key] - value))) <= 0.02, key
        else:
            assert float(errors.max()) <= max(1e-4, bound * spread), (key, float(errors.max()), spread)
    model.load_tensors(tensors)            # the test step on the same tensors
    got, want = model.test_step(*data[1]), reference.test_step(*data[1])
    assert got[0] == want[0] and math.isclose(got[1], want[1], rel_tol=1e-4), (got, want)
    for step in ("train_step", "test_step"):
        assert model.mem.usage[step].peak_bytes == cls.memory_plans[step].peak_bytes, step


def test_a_missing_library_runs_numpy_or_is_refused(tmp_path):
    from deepdsl_runtime.program import RunError

    _, path = compile_program("mlp", tmp_path, batch=2)
    cls = model_class(import_program(path))
    model = cls("cpu", 0)
    assert model.rt.native is None and model.kernels.startswith("numpy kernels: ") and ".so" in model.kernels
    with pytest.raises(RunError, match="compiled CPU kernels: .*is not built"):
        cls("cpu", 0, kernels="compiled")
    # the program's run builds a missing library; where the build fails, compiled kernels are refused in one line
    # (an empty cache directory: no library built before to take instead)
    from deepdsl.codegen import program_env
    done = subprocess.run([sys.executable, str(path), "--iters", "1", "--test-iters", "1", "--data", "synthetic",
                           "--params", str(tmp_path / "p.npz"), "--kernels", "compiled"], capture_output=True,
                          text=True, timeout=300, env={**program_env(), "CC": str(tmp_path / "no-such-cc"),
                                                       "DEEPDSL_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "is not built" in done.stderr, done.stderr
    assert "not built (" in done.stdout and "no-such-cc did not run" in done.stdout, done.stdout


@needs_cc
def test_a_program_builds_its_missing_library_on_its_first_run(tmp_path):
    """A program shipped with its `.c` but no library (as generated/'s are) builds it when first run, saying so
    once, atomically (no partial file left), and runs the compiled kernels."""
    root = Path(__file__).resolve().parents[1]
    for suffix in (".py", ".c"):
        shutil.copy(root / "generated" / f"mlp{suffix}", tmp_path / f"mlp{suffix}")
    program = tmp_path / "mlp.py"
    target = native.library_path(tmp_path / "mlp.c")
    common = ("--test-iters", "1", "--data", "synthetic", "--threads", "1")
    # two programs started together: one builds (or each, into a file of its own), neither loads a partial library
    together = [popen_cli(program, "--iters", "1", *common, "--params", str(tmp_path / f"{k}.npz")) for k in "ab"]
    outputs = [job.communicate(timeout=300) for job in together]
    assert [job.returncode for job in together] == [0, 0], outputs
    said = "".join(out for out, _ in outputs)
    assert 1 <= said.count("building ") <= 2 and f"building {target.name} from mlp.c" in said, said
    assert said.count("(compiled kernels, 1 thread)") == 2, said
    assert {p.name for p in tmp_path.iterdir()} == {"mlp.py", "mlp.c", target.name, "a.npz", "b.npz"}
    common += ("--params", str(tmp_path / "a.npz"))
    second = run_cli(program, "--iters", "2", *common)
    assert second.returncode == 0 and "building" not in second.stdout, second.stdout
    assert "(compiled kernels, 1 thread)" in second.stdout
    numpy_only = run_cli(program, "--iters", "3", *common, "--kernels", "numpy")
    assert numpy_only.returncode == 0 and "building" not in numpy_only.stdout


@needs_cc
def test_programs_share_one_library_of_the_generic_kernels(tmp_path, monkeypatch):
    """Every program's library holds its own kernels only; the generic ones are one library in the cache directory,
    built once for all programs, rebuilt where it has gone, and beside the program where no cache can be written.
    A program's library is kept in the cache directory as well: the same program written elsewhere takes it from
    there (no compiler runs), another one is built, and the least recently used go beyond the cache's size."""
    import os

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("DEEPDSL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "BUILD_FLAGS", (*native.BUILD_FLAGS, "-O0"))    # (builds of their own, four times
    for name in ("mlp", "lenet"):                                                # faster: what is built, not how)
        shutil.copy(root / "generated" / f"{name}.c", tmp_path / f"{name}.c")
        built, why = native.build_library(tmp_path / f"{name}.c")
        assert built == native.library_path(tmp_path / f"{name}.c"), why
    generic = native.generic_library(tmp_path / "mlp.c")
    assert generic.parent == tmp_path / "cache" and generic == native.generic_library(tmp_path / "lenet.c")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [generic.name, "programs"]
    assert sorted(p.name for p in (tmp_path / "cache" / "programs").iterdir()) == sorted(
        native.library_path(tmp_path / f"{name}.c").name for name in ("mlp", "lenet"))
    for name in ("mlp", "lenet"):
        own = ctypes.CDLL(str(native.library_path(tmp_path / f"{name}.c")))
        assert hasattr(own, "deepdsl_channel_sum") and not hasattr(own, "deepdsl_im2col")
        found, why = native.load(tmp_path / f"{name}.py")
        assert found is not None and found.program is not found.lib, why
        assert hasattr(found.lib, "deepdsl_im2col") and found.threads >= 1
    lenet = native.library_path(tmp_path / "lenet.c")
    built_at = lenet.stat().st_mtime_ns
    generic.unlink()
    found, why = native.load(tmp_path / "lenet.py")
    assert found is None and f"{generic.name} is not built" in why, why
    assert native.to_build(tmp_path / "lenet.py") == lenet
    assert native.build_library(tmp_path / "lenet.c")[0] == lenet and generic.exists()
    assert lenet.stat().st_mtime_ns == built_at and native.to_build(tmp_path / "lenet.py") is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(tmp_path / "lenet.c", elsewhere / "lenet.c")
    no_compiler = str(tmp_path / "no-such-cc")
    taken, why = native.build_library(elsewhere / "lenet.c", no_compiler)
    assert taken == native.library_path(elsewhere / "lenet.c") and taken.name == lenet.name, why
    assert taken.read_bytes() == lenet.read_bytes() and native.load(elsewhere / "lenet.py")[0] is not None
    (elsewhere / "lenet.c").write_text((tmp_path / "lenet.c").read_text() + "/* another program */\n")
    assert native.build_library(elsewhere / "lenet.c", no_compiler) == (None, f"{no_compiler} did not run: "
                                                                        f"[Errno 2] No such file or directory: "
                                                                        f"'{no_compiler}'")
    kept = {name: native.cached_library(native.library_path(tmp_path / f"{name}.c")) for name in ("mlp", "lenet")}
    monkeypatch.setattr(native, "CACHE_BYTES", sum(p.stat().st_size for p in kept.values()) + 4096)
    os.utime(kept["lenet"], (1, 1))                                             # the least recently used
    other, _ = native.build_library(elsewhere / "lenet.c")                     # one library more than fits
    assert other is not None and other.name != lenet.name
    assert sorted((tmp_path / "cache" / "programs").iterdir()) == sorted([kept["mlp"], native.cached_library(other)])
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DEEPDSL_CACHE", str(tmp_path / "file" / "cache"))      # cannot be made
    assert native.generic_library(tmp_path / "mlp.c") == tmp_path / generic.name
    assert native.build_library(tmp_path / "mlp.c")[0] is not None and (tmp_path / generic.name).exists()
    assert native.load(tmp_path / "mlp.py")[0] is not None
    assert sorted(os.listdir(tmp_path / "cache")) == [generic.name, "programs"]


@needs_cc
def test_compile_builds_the_library_the_program_uses(tmp_path):
    from deepdsl.cli import main

    out = tmp_path / "lenet.py"
    assert main(["compile", "networks/lenet.py", "--batch", "8", "-o", str(out)]) == 0
    # the library builds in the background; the program started at once waits for it
    done = run_cli(out, "--iters", "2", "--test-iters", "1", "--data", "synthetic", "--params",
                   str(tmp_path / "p.npz"), "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert "(compiled kernels, 1 thread)" in done.stdout
    libraries = list(tmp_path.glob("lenet.*.so"))
    assert len(libraries) == 1 and libraries[0] == native.library_path(out.with_suffix(".c"))
    assert not list(tmp_path.glob(".lenet.*.tmp"))
    # the same program written elsewhere: its library comes from the cache directory, nothing left of the build
    again = tmp_path / "again" / "lenet.py"
    again.parent.mkdir()
    assert main(["compile", "networks/lenet.py", "--batch", "8", "-o", str(again)]) == 0
    done = run_cli(again, "--iters", "1", "--test-iters", "1", "--data", "synthetic", "--params", "", "--threads", "1")
    assert done.returncode == 0 and "(compiled kernels, 1 thread)" in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in again.parent.iterdir()) == sorted(["lenet.py", "lenet.c", "lenet.cu",
                                                                     libraries[0].name])
    # a library of other sources is not loaded: the digest names the sources
    source = out.with_suffix(".c")
    source.write_text(source.read_text() + "\n// changed\n")
    assert native.load(out)[0] is None and math.isfinite(len(native.load(out)[1]))


@needs_cc
def test_the_peer_benchmark_runs(tmp_path):
    """benchmarks/cpu_vs_peers.py end to end at a tiny size (ours, numpy, PyTorch eager and JAX; one round): every
    side reports a step time (JAX, where it is not installed, says so in its row), under a first line naming the
    processor's vector extension, for LeNet and for the byte-level language model (trained on random tokens with a
    label per position, ours and PyTorch eager's twin); a spec naming no network, or a batch that is no number, is
    one line and a non-zero exit."""
    import importlib.util
    import re
    import sys

    from tests.support.program_helpers import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_vs_peers.py"), "lenet:8", "char_lm:4",
                           "--threads", "1", "--rounds", "1", "--warmup", "1", "--steps", "2", "--sides", "ours",
                           "numpy", "eager", "jax"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for network in ("lenet", "char_lm"):
        rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == [network]]
        assert [r[3] for r in rows] == ["ours", "numpy", "eager", "jax"], done.stdout
        assert all(float(r[4]) > 0 for r in rows[:3]), done.stdout
        if importlib.util.find_spec("jax") is None:
            assert " ".join(rows[3][4:]).endswith('jax is not installed (pip install -e ".[peers]")'), done.stdout
        else:
            assert float(rows[3][4]) > 0, done.stdout
    assert re.search(r"\(\w+, (AVX-512|AVX2|no AVX2|unknown)\), \d+ cores", done.stdout.splitlines()[0]), done.stdout
    assert re.search(r"^PyTorch's kernels ran on: ATen \w+, MKL [\w-]+, oneDNN [\w-]+$", done.stdout, re.M), done.stdout
    assert "thread(s) to" not in done.stdout, done.stdout            # one thread count: no speed-up to state
    for spec, says in (("nonet:4", "no network 'nonet' in networks/"),
                       ("lenet:x", "the batch 'x' is no positive number")):
        bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_vs_peers.py"), spec], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        assert bad.returncode != 0 and bad.stdout == "" and bad.stderr.strip().splitlines() == [
            f"cpu_vs_peers: '{spec}': {says}"], (bad.stdout, bad.stderr)


def test_an_avx2_run_holds_every_pytorch_library_to_avx2():
    """`--isa avx2`'s environment (benchmarks/timing.py, AVX2_ENV) holds ATen's kernels, MKL's products and oneDNN's
    convolutions to AVX2, as their libraries report (`timing.torch_isa`); without it they report the processor's
    widest. (Without MKL_ENABLE_INSTRUCTIONS, PyTorch's products ran on AVX-512 in such runs.) MKL names the
    extension it runs on only on Intel's processors; on others (AMD's) its verbose line names none, and
    `torch_isa` says "MKL unknown" either way."""
    import sys

    from tests.support.program_helpers import ROOT

    pytest.importorskip("torch")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in flags:
        pytest.skip("the processor has no AVX2")
    said = {}
    for name, setup in (("avx2", "os.environ.update(timing.AVX2_ENV)"),
                        ("native", "[os.environ.pop(key, None) for key in timing.AVX2_ENV]")):
        code = f"import os, timing; {setup}; print(timing.torch_isa())"       # (before torch loads)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              cwd=ROOT / "benchmarks")
        assert done.returncode == 0, done.stderr
        said[name] = done.stdout.strip().splitlines()[-1]
    import torch

    silent = "GenuineIntel" not in flags                   # MKL names no extension on this processor
    libraries = ["ATen", *["MKL"] * (torch.backends.mkl.is_available() and not silent),
                 *["oneDNN"] * torch.backends.mkldnn.is_available()]
    named = [f"{lib} AVX2" for lib in libraries]
    if torch.backends.mkl.is_available() and silent:
        named.insert(1, "MKL unknown")
    assert said["avx2"] == ", ".join(named), said
    if " avx512f" in flags:
        assert all(f"{lib} AVX" in said["native"] and f"{lib} AVX2" not in said["native"] for lib in libraries), said


@needs_cc
def test_the_peer_benchmark_states_each_sides_speed_up_by_rounds():
    """The speed-up from one thread count to the next is the median of each round's ratio (the rounds interleave
    the counts), for every side that ran in both, at every count after the first."""
    import sys

    from tests.support.program_helpers import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_vs_peers

    runs = {1: {"ours": [{"ms": 10.0}, {"ms": 30.0}, {"ms": 12.0}], "eager": [{"ms": 8.0}, {"error": "x"}]},
            2: {"ours": [{"ms": 5.0}, {"ms": 10.0}, {"ms": 8.0}], "eager": [{"ms": 6.0}, {"ms": 4.0}]},
            4: {"ours": [{"ms": 4.0}, {"ms": 6.0}, {"ms": 6.0}], "eager": [{"error": "y"}, {"error": "z"}]}}
    assert cpu_vs_peers._scaling("lenet 8", runs) == [
        "lenet 8: 1 thread(s) to 2, the step's speed-up (median over rounds): ours 2.00x, eager 1.33x",
        "lenet 8: 1 thread(s) to 4, the step's speed-up (median over rounds): ours 2.50x"]
    assert cpu_vs_peers._scaling("lenet 8", {1: runs[1]}) == []


def test_the_op_profile_runs_with_and_without_its_timers(tmp_path):
    """benchmarks/op_profile.py at a tiny size: per op (the convolutions among the ops it lists, their times
    adding up to no more than the step's), `--steps-only` (each step's time and their median, no op), and at two
    thread counts (each op's time at either, its speed-up and the time it loses against a perfect one)."""
    import re
    import sys

    from tests.support.program_helpers import ROOT

    def profile(*extra):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_profile.py"), "lenet:8", "--threads", "1",
                               "--warmup", "1", "--steps", "3", *extra], capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout

    per_op = profile()
    assert re.search(r"^conv2d \S+ +1 ", per_op, re.M), per_op
    step, ops = map(float, re.search(r"^step ([\d.]+) ms \(median of 3\); ops ([\d.]+) ms", per_op, re.M).groups())
    assert 0 < ops <= step * 1.5, per_op
    whole = profile("--steps-only")
    times = re.search(r"^steps \(ms\): (.*)$", whole, re.M).group(1).split()
    assert len(times) == 3 and all(float(t) > 0 for t in times), whole
    assert "conv2d" not in whole and re.search(r"^step [\d.]+ ms \(median of 3\)$", whole, re.M), whole
    scaling = profile("--threads", "1", "2")
    row = re.search(r"^conv2d \S+ +1 +([\d.]+) +([\d.]+) +([\d.]+)x +(-?[\d.]+)$", scaling, re.M)
    one, two, speed_up, lost = map(float, row.groups())
    assert one > 0 and two > 0.005 and (one - 0.005) / (two + 0.005) - 0.005 <= speed_up <= \
        (one + 0.005) / (two - 0.005) + 0.005, scaling          # (each printed to two decimals)
    assert abs(lost - (two - one / 2)) < 0.015, scaling
    steps = re.search(r"^step ([\d.]+) ms at 1, ([\d.]+) ms at 2 \(medians of 3\): ([\d.]+)x; ops ([\d.]+) and "
                      r"([\d.]+) ms", scaling, re.M)
    assert steps is not None and 0 < float(steps[4]) <= float(steps[1]) * 1.5, scaling


@needs_cc
def test_the_checkout_benchmark_compares_two_checkouts_kernels(tmp_path):
    """benchmarks/kernels_vs_checkout.py against a checkout (here this one): every geometry, product, depthwise
    convolution, pointwise filter gradient, dropout mask, layer norm and attention timed with both libraries and
    their results the same; the Winograd layers alone (their three directions, the same bits); and whole steps of a
    network with each checkout's library in turn."""
    import re
    import sys

    from tests.support.program_helpers import ROOT

    def run(*extra):
        env = {**os.environ, "DEEPDSL_CFLAGS": f"{os.environ.get('DEEPDSL_CFLAGS', '')} -O0"}  # (four builds, fast)
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels_vs_checkout.py"), "--against",
                               str(ROOT), "--threads", "1", "--rounds", "1", *extra], capture_output=True, text=True,
                              timeout=600, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    kernels = run("--calls", "1", "--kernels", "copies", "swaps", "products", "depthwise", "pointwise", "masks",
                  "layer_norm", "attention")       # (built at -O0: the products take 0.1 s a call)
    before, depthwise = kernels.split("depthwise (N, C, H, s)")
    rows = re.findall(r"^ +1 +\((.*?)\) +(\d+) / (\d+) +\(.*?\) +(\d+) / (\d+) +\(.*?\)(.*)$", before, re.M)
    assert len(rows) >= 6 and all(not row[-1] for row in rows), kernels
    products = re.findall(r"^ +1 +\((\d+), (\d+), (\d+)\)( [ab]T)? +(\d+) / (\d+) +\(.*?\)(.*)$",
                          before.split("product (m, k, n)")[1], re.M)
    assert len(products) == 11 and all(not row[-1] for row in products), kernels
    assert [row[3] for row in products].count(" aT") == 3 and [row[3] for row in products].count(" bT") == 2, kernels
    depthwise = re.findall(r"^ +1 +\((\d+), (\d+), (\d+), ([12])\)((?: +\d+ / \d+ +\([\d.]+\)){3})(.*)$",
                           depthwise, re.M)
    assert len(depthwise) == 6 and all(not row[-1] for row in depthwise), kernels
    filters = re.findall(r"^ +1 +\((\d+), (\d+), (\d+), (\d+)\) +(\d+) / (\d+) +\([\d.]+\)(.*)$",
                         kernels.split("pointwise filter (N, O, C, H)")[1], re.M)
    assert len(filters) == 4 and all(not row[-1] for row in filters), kernels
    attention = re.findall(r"^ +1 +\((\d+), (\d+), (\d+), (\d+), (True|False), (None|[\d.]+)\)"
                           r"((?: +\d+ / \d+ +\([\d.]+\)){2})(.*)$", kernels.split("attention (N, H, t")[1], re.M)
    assert len(attention) == 4 and all(not row[-1] for row in attention), kernels
    masks = re.findall(r"^ +1 +\(\((.*?)\), ([\d.]+)\) +(\d+) / (\d+) +\([\d.]+\)(.*)$",
                       kernels.split("mask (shape, keep)")[1].split("layer norm")[0], re.M)
    assert len(masks) == 3 and all(not row[-1] for row in masks), kernels
    norms = re.findall(r"^ +1 +\((\d+), (\d+)\)((?: +\d+ / \d+ +\([\d.]+\)){3})(.*)$",
                       kernels.split("layer norm ")[1].split("attention (N")[0], re.M)
    assert len(norms) == 3 and all(not row[-1] for row in norms), kernels
    only = run("--calls", "1", "--kernels", "winograd")
    assert "Winograd (N, C, H, k, p, s)" in only and "swap (A, B, inner)" not in only, only
    winograd = re.findall(r"^ +1 +\((\d+), (\d+), (\d+), 3, 1, 1\)((?: +\d+ / \d+ +\([\d.]+\)){3})(.*)$", only,
                          re.M)
    assert len(winograd) == 4 and all(not row[-1] for row in winograd), only
    whole = run("--network", "lenet:8", "--steps", "3")
    assert re.search(r"^lenet:8 1 thread\(s\), other: [\d.]+ ms; median [\d.]+$", whole, re.M), whole
    assert re.search(r"^lenet:8 1 thread\(s\): this / other, median over rounds [\d.]+$", whole, re.M), whole


@needs_cc
def test_a_build_in_progress_is_waited_for_and_a_dead_one_ignored(tmp_path):
    import os
    import threading

    _, path = compile_program("mlp", tmp_path, batch=2)
    target = native.library_path(path.with_suffix(".c"))
    dead = target.with_name(f".{target.name}.{2 ** 22 + 12345}.tmp")          # no such process
    dead.touch()
    assert native.building(target) == [] and native.load(path)[0] is None
    live = target.with_name(f".{target.name}.{os.getpid()}.tmp")               # this process "builds"
    live.touch()
    assert native.building(target) == [live]

    results = []

    def finish():                      # the build (in this process: it writes and renames the claimed file)
        from deepdsl.codegen.native import build_library
        results.append(build_library(path.with_suffix(".c")))
        live.unlink(missing_ok=True)
    timer = threading.Timer(0.2, finish)
    timer.start()
    found, why = native.load(path)                       # waits for the build in progress
    timer.join()
    assert results and results[0][0] == target, results
    assert found is not None, why


LRN_CASES = [  # (shape, size, alpha, beta, k): odd sizes (window wider than the channels), 2-D input, AlexNet's
    ((3, 7, 5, 3), 5, 1e-4, 0.75, 2.0), ((2, 3, 4, 4), 5, 0.3, 0.75, 1.0), ((4, 6), 3, 0.5, 0.6, 1.5),
    ((2, 5, 3, 7), 4, 2e-3, 1.3, 0.5), ((1, 1, 2, 2), 5, 1.0, 0.75, 1.0)]


def numpy_power_is_powf() -> bool:
    """Whether numpy's float32 power gives the C library's `powf` bits on this machine: the compiled LRN (which
    calls powf) is numpy's bit for bit only then. Where numpy has its own AVX-512 power (x86 processors with
    AVX-512F), about a fifth of the results differ from powf's in the last bit."""
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.powf.restype, libm.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    s = np.linspace(1.0, 4.0, 2000, dtype=np.float32)
    for beta in (-0.75, -1.75):
        powf = np.array([libm.powf(float(v), beta) for v in s], np.float32)
        if not np.array_equal(np.power(s, np.float32(beta)), powf):
            return False
    return True


@needs_cc
@pytest.mark.parametrize("case", LRN_CASES, ids=[str(c[0]) for c in LRN_CASES])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("samples", [1, None])             # chunks of one sample, or the whole batch
def test_lrn_and_its_gradient_equal_numpy(lib, case, in_place, samples):
    """The compiled LRN and its gradient give numpy's float32 results bit for bit (the same operations in the same
    order) where numpy's float32 power is the C library's and beta is not 0.75 (which the kernels compute by square
    roots), within float32 rounding elsewhere, under NaN-filled
    workspaces of exactly their planned size, also writing over their input (lrn over x, lrn_bwd over g, as the
    in-place pass allows)."""
    from deepdsl_runtime.cpu import norm

    shape, size, alpha, beta, k = case
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    n = samples or shape[0]
    attrs = dict(size=size, alpha=alpha, beta=beta, k=k)
    results = []
    for kernels in (None, lib):
        xin = x.copy()
        out = xin if in_place else np.full(shape, np.nan, np.float32)
        ws = np.full(contract.lrn_scratch(shape) * n, np.nan, np.float32)
        norm.lrn(xin, out=out, workspace=ws, native=kernels, **attrs)
        gin = g.copy()
        dx = gin if in_place else np.full(shape, np.nan, np.float32)
        ws = np.full(contract.lrn_bwd_scratch(shape) * n, np.nan, np.float32)
        norm.lrn_bwd(gin, x, out=dx, workspace=ws, native=kernels, **attrs)
        results.append((out, dx))
    (want_y, want_dx), (got_y, got_dx) = results
    assert not np.isnan(got_y).any() and not np.isnan(got_dx).any()
    if numpy_power_is_powf() and beta != 0.75:
        np.testing.assert_array_equal(got_y, want_y)
        np.testing.assert_array_equal(got_dx, want_dx)
    else:       # beta 0.75 by square roots, or numpy's own AVX-512 power: a few ulp apart
        for got, want in ((got_y, want_y), (got_dx, want_dx)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


@needs_cc
@pytest.mark.parametrize("shape, axes, affine", [((64, 16, 64), 1, True), ((3, 5, 7), 2, True), ((130, 33), 1, False),
                                                 ((2, 3, 4, 5), 1, True), ((200, 300), 1, True), ((129, 16), 1, True)])
def test_layer_norm_kernels_equal_numpy_at_any_thread_count(lib, shape, axes, affine):
    """The compiled layer norm, its input gradient (also written over g) and its weight's and bias's gradients equal
    the numpy backend's bit for bit on 1, 2 and 3 threads: the row sums in lanes of 16 and their fixed halving, the
    parameter sums by parts of 64 rows added in order. Features of whole vectors and not, rows of several parts and
    a part cut short; outputs and workspace NaN-filled. What the kernels do not take (a strided input) is numpy's."""
    from deepdsl_runtime import contract
    from deepdsl_runtime.cpu import norm

    rng = np.random.default_rng(sum(shape))
    x = (2 * rng.standard_normal(shape) - 1).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    features = shape[len(shape) - axes:]
    affine = tuple(rng.standard_normal(features).astype(np.float32) for _ in range(2 if affine else 0))
    rows = x.size // math.prod(features)
    attrs = dict(eps=1e-5, axes=axes)
    want_y, want_dx = np.empty_like(x), np.empty_like(x)
    want_p = np.empty((2, math.prod(features)), np.float32)
    norm.layer_norm(x, *affine, out=want_y, **attrs)
    norm.layer_norm_grad(x, g, *affine[:1], out=want_dx, **attrs)
    norm.layer_norm_param_grad(x, g, out=want_p, **attrs)
    before = lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            y, dx, both = np.full_like(x, np.nan), np.full_like(x, np.nan), np.full_like(want_p, np.nan)
            workspace = np.full(contract.layer_norm_param_scratch(rows, math.prod(features)), np.nan, np.float32)
            assert lib.layer_norm(x, affine, y, 1e-5, axes)
            assert lib.layer_norm_grad(x, g, affine[:1], dx, 1e-5, axes)
            assert lib.layer_norm_param_grad(x, g, both, workspace, 1e-5, axes)
            np.testing.assert_array_equal(y, want_y)
            np.testing.assert_array_equal(dx, want_dx)
            np.testing.assert_array_equal(both, want_p)
            inplace = g.copy()
            assert lib.layer_norm_grad(x, inplace, affine[:1], inplace, 1e-5, axes)
            np.testing.assert_array_equal(inplace, want_dx)
    finally:
        lib.set_threads(before)
    strided = np.asfortranarray(x)
    assert not lib.layer_norm(strided, affine, np.empty_like(x), 1e-5, axes)
    y = np.empty_like(x)
    norm.layer_norm(strided, *affine, out=y, native=lib, **attrs)
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)


@needs_cc
@pytest.mark.parametrize("shape, axes", [((64, 16, 4, 16), (1, 2)), ((64, 4, 16, 16), (1, 2)), ((3, 5, 7), (0, 2)),
                                         ((2, 3, 4, 5, 6), (1, 3)), ((9, 1, 11), (0, 1)), ((130, 257), (0, 1))])
def test_transposes_equal_numpy_at_any_thread_count(lib, shape, axes):
    """Any two axes swapped by the compiled kernel (`deepdsl_swap_axes`: rows of the trailing axes copied) equal
    numpy's copy bit for bit at 1, 2 and 3 threads, over an output filled with NaN; what it does not take (another
    dtype) is numpy's."""
    from deepdsl_runtime.cpu import shape as shapes

    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    want = np.ascontiguousarray(x.swapaxes(*axes))
    before = lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            out = np.full(want.shape, np.nan, np.float32)
            assert lib.swap_axes(x, out, axes)
            np.testing.assert_array_equal(out, want)
    finally:
        lib.set_threads(before)
    tokens = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    out = np.zeros(want.shape, np.int32)
    assert not lib.swap_axes(tokens, out, axes)
    shapes.transpose(tokens, out=out, axes=axes, native=lib)
    np.testing.assert_array_equal(out, tokens.swapaxes(*axes))


@needs_cc
@pytest.mark.parametrize("shape", [(2, 64, 7, 7), (3, 5, 4, 4), (2, 3, 16, 16), (4, 2, 56, 56)])
def test_planes_summed_per_sample_and_channel_by_the_compiled_sum(lib, shape, monkeypatch):
    """(N, C, H, W) summed to (N, C, 1, 1) (squeeze-and-excitation's pooling and its gradient) by the compiled
    per-channel sum, each sample's channel a row: numpy's sums within float32 rounding, the same bits at 1, 2 and 3
    threads, into a NaN-filled output."""
    from deepdsl_runtime.cpu import shape as shapes

    rows = []
    compiled = lib.channel_sum
    monkeypatch.setattr(lib, "channel_sum", lambda x, out: rows.append(x.shape) or compiled(x, out))
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    want = np.sum(x.astype(np.float64), axis=(2, 3), keepdims=True)
    before, outs = lib.threads, []
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            out = np.full(shape[:2] + (1, 1), np.nan, np.float32)
            shapes.sum_to(x, out=out, shape=out.shape, native=lib)
            outs.append(out)
    finally:
        lib.set_threads(before)
    assert rows == [(shape[0], shape[1], shape[2] * shape[3])] * 3
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5 * math.sqrt(shape[2] * shape[3]))
    assert all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs[1:])


@needs_cc
@pytest.mark.parametrize("size", [1, 7, 16384, 16385, 100003])
def test_copies_sums_and_padded_planes_equal_numpy_at_any_thread_count(lib, size):
    """The library's copy, its in-place sum and its zero-padded planes (the work a kernel's Python does around its
    calls, `Native.copy`, `accumulate`, `pad_planes`) equal numpy's bit for bit at 1, 2 and 3 threads over outputs
    filled with NaN, sizes on either side of a part (16384 floats), -0.0 and NaN among the values; what they do not
    take (another dtype, another size, a strided view) writes nothing and says so."""
    rng = np.random.default_rng(size)
    src = rng.standard_normal(size).astype(np.float32)
    src[::5] = -0.0
    src[size // 2] = np.nan
    dst = np.round(rng.standard_normal(size), 1).astype(np.float32)
    dst[::3] = -0.0
    planes = rng.standard_normal((2, 3, max(1, size // 600), 5 + size % 7)).astype(np.float32)
    before = lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            out = np.full(size, np.nan, np.float32)
            assert lib.copy(src, out)
            np.testing.assert_array_equal(out.view(np.uint32), src.view(np.uint32))
            total = dst.copy()
            assert lib.accumulate(src, total)
            np.testing.assert_array_equal(total.view(np.uint32), np.add(dst, src).view(np.uint32))
            for pad in (1, 3):
                padded = np.full(planes.shape[:2] + tuple(d + 2 * pad for d in planes.shape[2:]), np.nan, np.float32)
                assert lib.pad_planes(planes, pad, padded)
                want = np.pad(planes, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
                np.testing.assert_array_equal(padded, want)
    finally:
        lib.set_threads(before)
    untouched = np.full(size, np.nan, np.float32)
    assert not lib.copy(src.astype(np.float64), untouched) and not lib.copy(src[:-1], untouched)
    if size > 1:
        assert not lib.accumulate(src[::2], untouched[:(size + 1) // 2])
    assert np.isnan(untouched).all()


def test_more_build_flags_name_other_libraries(tmp_path):
    """$DEEPDSL_CFLAGS (`-mno-avx512f`: kernels for a processor without AVX-512) go after the build flags and into
    the libraries' digest: a library built with them is never loaded as one built without, nor replaces it."""
    (tmp_path / "p.c").write_text("int deepdsl_probe(void) { return 1; }\n")
    probe = ("import sys; from pathlib import Path; from deepdsl_runtime.cpu import native; "
             "print(native.compile_command(Path('p.c'), Path('p.so'))[1:-3]); "
             "print(native.library_path(Path(sys.argv[1])).name, native.generic_library(Path(sys.argv[1])).name)")
    runs = {}
    for flags in ("", "-mno-avx512f -O1"):
        env = {k: v for k, v in os.environ.items() if k != "DEEPDSL_CFLAGS"}
        env.update({"DEEPDSL_CFLAGS": flags} if flags else {})
        done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "p.c")], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        runs[flags] = done.stdout.splitlines()
    plain, more = runs[""], runs["-mno-avx512f -O1"]
    assert "'-mno-avx512f', '-O1'" in more[0] and "-mno-avx512f" not in plain[0]
    assert more[0].index("'-O2'") < more[0].index("'-O1'")                     # after the defaults: they win
    assert all(a != b for a, b in zip(plain[1].split(), more[1].split()))      # other names for both libraries
