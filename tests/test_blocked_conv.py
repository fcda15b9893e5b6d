"""Stride-1 convolutions of many channels computed directly on channel-blocked copies by the compiled kernels
(runtime/kernels/cpu_blocked.c, `contract.blocked_conv`): the convolution and both its gradients against float64
reference semantics on odd geometries (channels that leave a block partly empty, rows shorter and longer than a
register tile, 3x3, 5x5 and 7x7 kernels, one taller than its input), with bias, into NaN-filled
outputs under NaN-filled workspaces of exactly the planned size; the same bits on 1, 2 and 3 threads, in chunks of
one sample and of all, and built for AVX2 alone; an input gradient over its output gradient's bytes; the fallback to
im2col where the workspace is too small or the processor has no AVX2. Networks whose layers run here (resnet_mini,
SE-ResNet, VGG, U-Net, ResNet-50) are checked step by step against numpy's kernels in tests/test_native_kernels.py."""
from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deepdsl.ir import make
from deepdsl.ops import EvalContext, get_op
from deepdsl_runtime import contract
from deepdsl_runtime.cpu import conv
from tests.support.kernel_builds import ISAS
from tests.test_direct_conv import avx2_kernels, plain_kernels  # noqa: F401  (session fixtures)
from tests.test_native_kernels import lib  # noqa: F401  (the fixture: resnet_mini's library)
from tests.test_runtime_cpu import leaf

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="needs a C compiler")

GEOMETRIES = [  # (N, C, H, W, O, kh, kw, pad)
    (2, 16, 9, 9, 16, 3, 3, 1),       # one block in and out
    (3, 48, 8, 15, 28, 3, 3, 1),      # an output block partly empty, rows of 15 (two tiles)
    (2, 56, 7, 12, 32, 5, 5, 2),      # a 5x5 kernel, an input block partly empty
    (1, 16, 6, 31, 48, 3, 3, 1),      # rows of 31: three tiles
    (2, 32, 9, 7, 40, 3, 3, 1),       # rows of 7 (the shortest taken), blocks partly empty
    (2, 16, 5, 16, 64, 7, 7, 3),      # a 7x7 kernel taller than the input, four output blocks
    (1, 64, 14, 14, 64, 3, 3, 1),     # ResNet's 3x3 at 14x14
    (2, 24, 6, 9, 80, 3, 3, 1),       # five output blocks: groups of three and two of them share the broadcasts
]


def _nodes(n, c, h, w, o, kh, kw, pad, bias):
    x, wt = leaf("x", (n, c, h, w)), leaf("w", (o, c, kh, kw))
    y = make("conv2d", [x, wt] + ([leaf("b", (o,))] if bias else []), stride=1, pad=pad)
    g = leaf("g", y.shape)
    return [y, make("conv2d_bwd_data", (g, wt), stride=1, pad=pad, size=(h, w)),
            make("conv2d_bwd_filter", (g, x), stride=1, pad=pad, kernel=(kh, kw))]


def _arrays(node, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(i.shape).astype(np.float32) for i in node.inputs]


def _samples_limit(node, samples):
    """A workspace limit with room for the filters' blocked copy and `samples` samples' operands."""
    x_shape = {"conv2d": node.inputs[0].shape, "conv2d_bwd_data": node.shape,
               "conv2d_bwd_filter": node.inputs[1].shape}[node.op]
    w_shape = node.shape if node.op == "conv2d_bwd_filter" else node.inputs[1].shape
    per_sample, once = contract.blocked_scratch(node.op, x_shape, w_shape, node.attr("pad", 0))
    return 4 * (once + samples * per_sample)


def _winograd_limit(node, samples):
    """A workspace limit with room for Winograd's transformed filters (the filter gradient's sums) and `samples`
    samples' arrays."""
    per_sample, once = contract.winograd_scratch(node.op, *_forward_shapes(node), 1)
    return 4 * (once + samples * per_sample)


def _by_ranges(patch):
    """Winograd's filter gradients by ranges of output blocks, never by pairs (`contract.winograd_pairs`)."""
    for name in ("WINOGRAD_PAIR_TILES", "WINOGRAD_PAIR_BYTES", "WINOGRAD_FEW_TILES"):
        patch.setattr(contract, name, 0)


def _forward_shapes(node):
    """(the forward's input shape, its filters' shape) of a convolution node of any direction."""
    return {"conv2d": (node.inputs[0].shape, node.inputs[1].shape),
            "conv2d_bwd_data": (node.shape, node.inputs[1].shape),
            "conv2d_bwd_filter": (node.inputs[1].shape, node.shape)}[node.op]


def _run(kernels, node, arrays, limit=None, workspace=None, out=None):
    """The runtime's convolution of `node` with `kernels` into a NaN-filled output, under a NaN-filled workspace of
    exactly the planned size at `limit` (or `workspace`)."""
    if workspace is None:
        size = get_op(node.op).workspace(node, limit).nbytes // 4
        workspace = np.full(size, np.nan, np.float32) if size else None
    if out is None:
        out = np.full(node.shape, np.nan, np.float32)
    getattr(conv, node.op)(*arrays, out=out, workspace=workspace, native=kernels, **node.kwargs)
    return out


@pytest.fixture
def recorded(lib, monkeypatch):  # noqa: F811
    """The ops the blocked kernels computed: each call of `Native.blocked_conv`, `blocked_filter_sums`,
    `winograd_conv` or `winograd_filter_sums` (both "winograd"), `winograd_filter_pairs` ("pairs"). The direct sums
    alone (Winograd's kernels off) unless a test turns them back on."""
    ran = []
    conv_, sums, winograd = lib.blocked_conv, lib.blocked_filter_sums, lib.winograd_conv
    winograd_sums, winograd_pairs = lib.winograd_filter_sums, lib.winograd_filter_pairs
    monkeypatch.setattr(lib, "blocked_conv", lambda *a: ran.append("conv") or conv_(*a))
    monkeypatch.setattr(lib, "blocked_filter_sums", lambda *a: ran.append("filter") or sums(*a))
    monkeypatch.setattr(lib, "winograd_conv", lambda *a: ran.append("winograd") or winograd(*a))
    monkeypatch.setattr(lib, "winograd_filter_sums", lambda *a: ran.append("winograd") or winograd_sums(*a))
    monkeypatch.setattr(lib, "winograd_filter_pairs", lambda *a: ran.append("pairs") or winograd_pairs(*a))
    monkeypatch.setattr(lib, "winograd", False)
    return ran


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_blocked_convolutions_equal_the_reference(lib, recorded, geometry):  # noqa: F811
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    n, c, h, w, o, kh, kw, pad = geometry
    assert contract.blocked_conv(c, o, kh, kw, 1, pad, w + 2 * pad - kw + 1)
    for node in _nodes(n, c, h, w, o, kh, kw, pad, bias=True):
        taken = contract.blocked_conv(c, o, kh, kw, 1, pad, w + 2 * pad - kw + 1, op=node.op, lanes=lib.lanes)
        arrays = _arrays(node, sum(geometry))
        want = get_op(node.op).evaluate(EvalContext(np.float64), *[a.astype(np.float64) for a in arrays],
                                        **node.kwargs)
        for limit in (None, _samples_limit(node, 1)):
            recorded.clear()
            got = _run(lib, node, arrays, limit)
            assert bool(recorded) == taken, (node.op, limit)
            assert not np.isnan(got).any()
            # sums of fused multiply-adds in float32: within float32 rounding of the products' magnitude
            scale = float(np.sqrt(np.abs(want).max() + 1.0))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * scale * np.sqrt(c * kh * kw))


@pytest.mark.parametrize("geometry", [(5, 32, 9, 15, 48), (3, 24, 7, 7, 80)], ids=["rows of 15", "five blocks"])
def test_the_bits_do_not_depend_on_threads_or_chunks(lib, recorded, geometry):  # noqa: F811
    """Threads take shares of the work weighted by the output blocks of each group (five blocks: groups of three
    and two), never parts of a sum; nor do the chunks of samples. (A filter gradient of rows shorter than AVX2's
    blocked rows goes by im2col, whose products over the batch at once or a sample at a time round differently:
    the same bits on any number of threads for each workspace.)"""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    before = lib.threads
    n, c, h, w, o = geometry
    for node in _nodes(*geometry, 3, 3, 1, bias=True):
        taken = contract.blocked_conv(c, o, 3, 3, 1, 1, w, op=node.op, lanes=lib.lanes)
        arrays = _arrays(node, 7)
        limits = (None, _samples_limit(node, 1), _samples_limit(node, 2))
        results = {limit: [] for limit in limits}
        recorded.clear()
        try:
            for threads in (1, 2, 3):
                lib.set_threads(threads)
                for limit in limits:
                    results[limit].append(_run(lib, node, arrays, limit))
        finally:
            lib.set_threads(before)
        assert (len(recorded) >= 9) == taken, node.op
        first = results[None][0]
        for limit in limits:
            for other in results[limit]:
                np.testing.assert_array_equal(other, first if taken else results[limit][0])


def test_the_planned_workspace_holds_the_blocked_copies(monkeypatch):
    """Where the kernels run blocked, the op plans room for the filters' copy and the batch's operands (more where
    numpy's im2col needs more), or under a limit as many samples' as it leaves room for; not even one sample's room:
    numpy's workspace alone."""
    for node in _nodes(4, 64, 8, 16, 256, 3, 3, 1, bias=False):
        x_shape = {"conv2d": node.inputs[0].shape, "conv2d_bwd_data": node.shape,
                   "conv2d_bwd_filter": node.inputs[1].shape}[node.op]
        per_sample, once = contract.blocked_scratch(node.op, x_shape, (256, 64, 3, 3), 1)
        op = get_op(node.op)
        assert op.workspace(node, None).nbytes // 4 >= once + 4 * per_sample
        assert op.workspace(node, _samples_limit(node, 2)).nbytes // 4 >= once + 2 * per_sample
        tight = op.workspace(node, 1)
        with monkeypatch.context() as patch:
            patch.setattr(contract, "blocked_conv", lambda *args, **kwargs: False)
            assert tight == op.workspace(node, 1)           # no room for the filters and a sample: numpy's alone


def test_a_workspace_too_small_runs_im2col(lib, recorded):  # noqa: F811
    """One float short of the filters' copy and a sample's operands: the im2col kernels, with the same result to
    float32 rounding."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    x_shape, w_shape = (2, 128, 7, 7), (128, 128, 3, 3)
    node = make("conv2d", (leaf("x", x_shape), leaf("w", w_shape)), stride=1, pad=1)
    arrays = _arrays(node, 3)
    per_sample, once = contract.blocked_scratch("conv2d", x_shape, w_shape, 1)
    im2col = contract.conv2d_scratch(x_shape, w_shape, node.shape, 1, 1)
    size = once + per_sample - 1
    assert size >= 2 * im2col, "the case needs filters larger than the batch's im2col scratch"
    plain = _run(lib, node, arrays, workspace=np.full(size, np.nan, np.float32))
    assert not recorded
    blocked = _run(lib, node, arrays)
    assert recorded == ["conv"]
    np.testing.assert_allclose(plain, blocked, rtol=1e-5, atol=1e-6 * float(np.abs(blocked).max()))


@pytest.mark.parametrize("winograd", [False, True], ids=["direct", "winograd"])
@pytest.mark.parametrize("c,o", [(16, 32), (32, 16), (32, 32)])
def test_an_input_gradient_over_its_output_gradient(lib, recorded, c, o, winograd, monkeypatch):  # noqa: F811
    """The input gradient taking over the bytes of its dying output gradient (same start; larger, smaller and the
    same size), by the direct sums or Winograd's transforms: chunks of one sample in the safe order give the bits
    of separate buffers."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    monkeypatch.setattr(lib, "winograd", winograd)
    node = _nodes(4, c, 8, 8, o, 3, 3, 1, bias=False)[1]
    g, w = _arrays(node, c + o)
    limit = (_winograd_limit if winograd else _samples_limit)(node, 1)
    want = _run(lib, node, [g, w], limit=limit)
    shared = np.empty(max(g.size, 4 * c * 64), np.float32)
    g_over = shared[:g.size].reshape(g.shape)
    g_over[...] = g
    out = shared[:4 * c * 64].reshape(node.shape)
    recorded.clear()
    got = _run(lib, node, [g_over, w], limit=limit, out=out)
    assert recorded and set(recorded) == {"winograd" if winograd else "conv"}
    np.testing.assert_array_equal(got, want)


def test_the_rule_takes_stride_one_layers_of_many_channels():
    assert contract.blocked_conv(64, 64, 3, 3, 1, 1, 56)
    assert contract.blocked_conv(16, 16, 3, 3, 1, 1, contract.BLOCKED_CONV_ROW)
    assert not contract.blocked_conv(64, 64, 3, 3, 2, 1, 28)                  # strided
    assert not contract.blocked_conv(64, 64, 1, 1, 1, 0, 56)                  # pointwise: a product already
    assert not contract.blocked_conv(3, 64, 7, 7, 1, 3, 112)                  # few input channels
    assert not contract.blocked_conv(64, 8, 3, 3, 1, 1, 56)                   # few output channels
    assert not contract.blocked_conv(64, 64, 3, 3, 1, 1, 4)                   # short rows
    assert contract.blocked_conv(64, 64, 3, 3, 1, 1, 7, op="conv2d_bwd_data")
    assert contract.blocked_conv(64, 64, 3, 3, 1, 1, 7, op="conv2d_bwd_filter")               # AVX-512's lanes
    assert not contract.blocked_conv(64, 64, 3, 3, 1, 1, 7, op="conv2d_bwd_filter", lanes=8)  # (im2col as fast)
    assert contract.blocked_conv(64, 64, 3, 3, 1, 1, contract.BLOCKED_FILTER_ROW, op="conv2d_bwd_filter", lanes=8)
    assert not contract.blocked_conv(64, 64, 3, 3, 1, 0, 54)                  # not "same" padding
    assert not contract.blocked_conv(64, 64, 3, 1, 1, 1, 56)                  # not square
    assert not contract.blocked_conv(20, 50, 5, 5, 1, 2, 8)                   # blocks half empty (LeNet's conv2)
    assert contract.blocked_conv(48, 28, 5, 5, 1, 2, 8)                       # blocks 7/8 full
    assert not contract.blocked_conv(64, 64, 3, 3, 1, 1, 56, groups=2)        # grouped


AVX2_GEOMETRIES = [  # (N, C, H, W, O): AVX2's tiles of one block, and of three blocks as two of three half blocks
    (3, 48, 8, 15, 28),     # two blocks alone, rows of 15
    (2, 32, 5, 7, 80),      # five blocks: three in half blocks, two alone; rows of 7
    (2, 24, 4, 4, 64),      # four blocks: three and one; rows of 4
    (1, 16, 6, 14, 48),     # three blocks; rows of 14 in tiles of 4, 4, 3 and 3 positions
    (1, 16, 3, 350, 48),    # rows too long for the stack: each tile's whole sum at once
]


@pytest.mark.parametrize("winograd", [False, True], ids=["direct", "winograd"])
@pytest.mark.parametrize("geometry", AVX2_GEOMETRIES, ids=[str(g) for g in AVX2_GEOMETRIES])
def test_built_for_avx2_alone_the_bits_are_the_same(lib, avx2_kernels, geometry, winograd, monkeypatch):  # noqa: F811
    """Each lane sums alone in the same order, so two AVX2 registers per 16 channels (or three half blocks' tiles)
    give the bits of one AVX-512 register (where this processor has AVX-512; else both builds are AVX2's), on 1, 2
    and 3 threads; the same for Winograd's transforms (GCC's vectors of 16 floats) where it takes the layer, or with
    it off the direct sums."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    avx2 = avx2_kernels
    assert avx2.blocked and avx2.lanes == 8 and lib.lanes in (8, 16)
    assert avx2.winograd and lib.winograd
    monkeypatch.setattr(avx2, "winograd", winograd)
    monkeypatch.setattr(lib, "winograd", winograd)
    before = avx2.threads
    n, c, h, w, o = geometry
    for node in _nodes(*geometry, 3, 3, 1, bias=True):
        blocked = all(contract.blocked_conv(c, o, 3, 3, 1, 1, w, op=node.op, lanes=lanes) for lanes in (8, lib.lanes))
        if not (winograd and contract.winograd_conv(c, o, 3, 3, 1, 1, w, op=node.op)) and not blocked:
            continue            # (the direct filter gradient of short rows: blocked with AVX-512 alone)
        arrays = _arrays(node, 5)
        want = _run(lib, node, arrays)
        try:
            for threads in (1, 2, 3):
                avx2.set_threads(threads)
                np.testing.assert_array_equal(_run(avx2, node, arrays), want, err_msg=f"{node.op}, {threads} threads")
        finally:
            avx2.set_threads(before)


def test_without_avx2_the_convolutions_keep_im2col(plain_kernels):  # noqa: F811
    plain = plain_kernels
    assert not plain.blocked and plain.lanes == 0
    for node in _nodes(2, 16, 9, 9, 16, 3, 3, 1, bias=False):
        arrays = _arrays(node, 1)
        np.testing.assert_allclose(_run(plain, node, arrays), _run(None, node, arrays), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_the_layer_benchmark_runs(isa):
    """benchmarks/conv_layers.py on a small network: a row per distinct convolution at one thread, the tiles'
    column filled for some layers (forward and input gradients only), the blocked column for some and the Winograd
    column for some of those (filter gradients too), and the step's sums; also with every side restricted to AVX2
    (both libraries built without AVX-512)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "conv_layers.py"), "--network", "resnet_mini",
                           "--batch", "2", "--image", "0", "--threads", "1", "--rounds", "1", "--calls", "1",
                           "--isa", isa], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] and
            line.split()[0].startswith("conv2d")]
    assert rows and all(row[4] == "1" for row in rows)

    def cells(row):         # im2col, tiles, blocked, winograd, torch: "-" or "ms (GFLOP/s)"
        found, rest = [], row[5:]
        while len(found) < 5:
            found.append(None if rest[0] == "-" else rest[0])
            rest = rest[1:] if rest[0] == "-" else rest[2:]
        return found
    assert all(cells(row)[0] is not None for row in rows)
    tiled = [row for row in rows if cells(row)[1] is not None]
    blocked = [row for row in rows if cells(row)[2] is not None]
    winograd = [row for row in rows if cells(row)[3] is not None]
    assert blocked and len(blocked) < len(rows) and tiled and len(tiled) < len(rows)
    assert winograd and {row[0] for row in winograd} == {"conv2d", "conv2d_bwd_data", "conv2d_bwd_filter"}
    avx2 = isa == "avx2" or done.stdout.splitlines()[0].split(";")[0] == "AVX2"
    assert set(map(tuple, winograd)) <= set(map(tuple, blocked)) or avx2  # (AVX2: short rows' filters)
    assert all(row[0] != "conv2d_bwd_filter" for row in tiled)
    assert "the step's convolutions" in done.stdout
    assert done.stdout.splitlines()[0].split(";")[0] in ("AVX-512", "AVX2", "no AVX2", "unknown",
                                                          "AVX2 (on a processor with AVX-512: every side restricted "
                                                          "to AVX2)")


# ----------------------------------------------------------------------------------------------------------------
# Winograd's F(4x4, 3x3) (runtime/kernels/cpu_winograd.c, `contract.winograd_conv`)

WINOGRAD_GEOMETRIES = [  # (N, C, H, W, O)
    (2, 16, 9, 9, 16),        # one block in and out; planes of 9: a last row and column of tiles mostly past them
    (3, 48, 8, 15, 28),       # an output block partly empty, rows of 15
    (2, 32, 9, 7, 40),        # rows of 7, blocks partly empty
    (1, 64, 14, 14, 64),      # ResNet's 3x3 at 14x14
    (2, 24, 6, 9, 80),        # five output blocks: groups of three and two
    (1, 272, 7, 8, 32),       # 17 input blocks: two partial sums of the products, added in order
    (3, 48, 4, 4, 44),        # rows of 4: one tile a sample, an output block partly empty (filter gradient by pairs)
    (2, 32, 5, 6, 48),        # rows of 6 on 5: tiles mostly past the plane (filter gradient by pairs)
    (30, 64, 12, 12, 64),     # 270 tiles: the filter gradient by pairs (past the rule's tiles) in two partial sums,
]                             # of 28 samples and 2


@pytest.mark.parametrize("geometry", WINOGRAD_GEOMETRIES, ids=[str(g) for g in WINOGRAD_GEOMETRIES])
def test_winograd_convolutions_equal_the_reference(lib, recorded, geometry, monkeypatch):  # noqa: F811
    """The forward (with bias), the input gradient and the filter gradient by Winograd's transforms into NaN-filled
    outputs under NaN-filled workspaces of exactly the planned size (unlimited, and one sample's room: the filter
    gradient's sums over chunks of one sample): within its rounding of the float64 reference (Winograd's transforms
    round more than the direct sums: about 1e-5 of the output's magnitude for 256 channels, measured; bounded here
    at 4e-5). These batches take the filter gradient by pairs (`contract.winograd_pairs`), whose bits are those of
    its ranges over the whole batch at once (rows of 7 at least; shorter ones by pairs only)."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    monkeypatch.setattr(lib, "winograd", True)
    monkeypatch.setattr(contract, "WINOGRAD_PAIR_TILES", 1 << 20)
    n, c, h, w, o = geometry
    for node in _nodes(n, c, h, w, o, 3, 3, 1, bias=True):
        assert contract.winograd_conv(c, o, 3, 3, 1, 1, w, op=node.op)
        arrays = _arrays(node, sum(geometry))
        want = get_op(node.op).evaluate(EvalContext(np.float64), *[a.astype(np.float64) for a in arrays],
                                        **node.kwargs)
        pairs = node.op == "conv2d_bwd_filter"
        assert contract.winograd_pairs(node.op, *_forward_shapes(node), 1) == pairs
        runs = [(pairs, None)] + [(False, samples) for samples in (None, 1)
                                  if not pairs or w >= contract.BLOCKED_CONV_ROW]
        results = []
        for by_pairs, samples in runs:
            with monkeypatch.context() as patch:
                if not by_pairs:
                    _by_ranges(patch)
                if samples is None:                     # (the whole batch at once: the pairs' partial sums)
                    patch.setattr(contract, "WINOGRAD_CHUNK_BYTES", 1 << 40)
                limit = None if samples is None else _winograd_limit(node, samples)
                recorded.clear()
                got = _run(lib, node, arrays, limit)
            assert recorded and set(recorded) == {"pairs" if by_pairs else "winograd"}, (node.op, limit)
            assert not np.isnan(got).any()
            np.testing.assert_allclose(got, want, rtol=0, atol=4e-5 * float(np.abs(want).max()))
            results.append(got)
        if pairs and len(results) > 1:
            np.testing.assert_array_equal(results[0], results[1])        # pairs: the ranges' bits


def test_winograd_filter_gradient_by_pairs(lib, recorded, monkeypatch):  # noqa: F811
    """A filter gradient by pairs (ResNet's 4x4 layers: one tile a sample; here with blocks partly empty on both
    sides): the same bits on 1, 2 and 3 threads; where the workspace does not hold the whole batch, im2col (rows of 4:
    no direct sums) within Winograd's rounding."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    monkeypatch.setattr(lib, "winograd", True)
    geometry = (8, 44, 4, 4, 60)
    node = _nodes(*geometry, 3, 3, 1, bias=False)[2]
    x_shape, w_shape = _forward_shapes(node)
    assert contract.winograd_pairs(node.op, x_shape, w_shape, 1) and \
        not contract.winograd_pairs(node.op, (65, *x_shape[1:]), w_shape, 1)        # (12 pairs of blocks: too few)
    per_sample, once = contract.winograd_scratch(node.op, x_shape, w_shape, 1)
    assert once == 0
    arrays = _arrays(node, 5)
    results, before = [], lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            recorded.clear()
            results.append(_run(lib, node, arrays))
            assert recorded == ["pairs"]
    finally:
        lib.set_threads(before)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    limit = 4 * 7 * per_sample
    assert not contract.winograd_pairs(node.op, x_shape, w_shape, 1, limit // 4)
    assert contract.winograd_samples(8, node.op, x_shape, w_shape, 1, limit // 4) == 0
    recorded.clear()
    im2col = _run(lib, node, arrays, limit)
    assert not recorded
    np.testing.assert_allclose(results[0], im2col, rtol=0, atol=4e-5 * float(np.abs(im2col).max()))


def test_the_pairs_benchmark_runs(lib):  # noqa: F811
    """benchmarks/winograd_pairs.py on resnet_mini's filter gradients (`--all`: pairs forced where the rule takes
    ranges): a line for each with both ways' times and workspaces, the same bits where the ranges take the batch at
    once (a batch of 2: every layer)."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "winograd_pairs.py"), "--network", "resnet_mini",
                           "--batch", "2", "--image", "0", "--threads", "1", "2", "--rounds", "1", "--all"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if " thread(s): pairs " in line]
    assert rows and len(rows) % 2 == 0 and all("ranges" in row and "MiB" in row for row in rows)
    assert all(row.endswith("the same bits") for row in rows), rows
    assert done.stdout.splitlines()[0].split(";")[0] in ("AVX-512", "AVX2")


@pytest.mark.parametrize("geometry", [(5, 32, 9, 15, 48), (3, 24, 7, 7, 80)], ids=["rows of 15", "five blocks"])
def test_winograd_bits_do_not_depend_on_threads_or_chunks(lib, recorded, geometry, monkeypatch):  # noqa: F811
    """Threads split tiles, output blocks and points, never a sum; a chunk's tiles are transformed and multiplied
    alone, and a range of output blocks with its own filters: the same bits on 1, 2 and 3 threads, in chunks of one
    sample, two and all, and in ranges of one output block (each transforming its filters for every chunk)."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    monkeypatch.setattr(lib, "winograd", True)
    before = lib.threads
    one_block = 4 * contract.WINOGRAD_POINTS * contract.channel_blocks(geometry[1]) * contract.CHANNEL_BLOCK ** 2
    for node in _nodes(*geometry, 3, 3, 1, bias=True)[:2]:
        arrays = _arrays(node, 7)
        results = []
        try:
            for threads in (1, 2, 3):
                lib.set_threads(threads)
                for limit in (None, _winograd_limit(node, 1), _winograd_limit(node, 2)):
                    results.append(_run(lib, node, arrays, limit))
            with monkeypatch.context() as patch:
                patch.setattr(contract, "WINOGRAD_FILTER_BYTES", one_block if node.op == "conv2d" else
                              one_block * contract.channel_blocks(geometry[4]) // contract.channel_blocks(geometry[1]))
                x_shape = node.shape if node.op == "conv2d_bwd_data" else node.inputs[0].shape
                assert contract.winograd_blocks(node.op, x_shape, node.inputs[1].shape)[2] == 1
                calls = recorded.count("winograd")
                results.append(_run(lib, node, arrays, _winograd_limit(node, 2)))
                outs = geometry[1] if node.op == "conv2d_bwd_data" else geometry[4]
                assert recorded.count("winograd") - calls == contract.channel_blocks(outs) * -(-geometry[0] // 2)
        finally:
            lib.set_threads(before)
        assert recorded.count("winograd") >= 9, node.op
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])


def test_winograd_filter_gradient_bits_do_not_depend_on_threads_chunks_or_ranges(lib, recorded,  # noqa: F811
                                                                                   monkeypatch):
    """The filter gradient adds its tiles' products in partial sums of whole samples (`contract.winograd_sum_samples`:
    4 of these 8), each chunk a multiple of them (room for 5 samples takes 4), the chunks' sums added in order: the
    same bits on 1, 2 and 3 threads, in one chunk or two, and in ranges of one output block (its tiles transformed
    once for both). Ranges take the whole batch in one chunk: with room for fewer samples, the direct sums."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    monkeypatch.setattr(lib, "winograd", True)
    monkeypatch.setattr(contract, "WINOGRAD_CHUNK_BYTES", 1 << 30)        # the room alone decides the chunks
    n, c, h, w, o = geometry = (8, 16, 30, 30, 32)
    assert contract.winograd_sum_samples(h, w) == 4
    node = _nodes(*geometry, 3, 3, 1, bias=False)[2]
    arrays = _arrays(node, 11)
    one_block = 4 * contract.WINOGRAD_POINTS * contract.channel_blocks(c) * contract.CHANNEL_BLOCK ** 2
    results, before = [], lib.threads
    try:
        for threads in (1, 2, 3):
            lib.set_threads(threads)
            for ranges, room in ((1, 8), (1, 5), (1, 4), (2, 8)):
                with monkeypatch.context() as patch:
                    if ranges == 2:
                        patch.setattr(contract, "WINOGRAD_FILTER_BYTES", one_block)
                    assert contract.winograd_blocks(node.op, *_forward_shapes(node))[2] == 2 // ranges
                    limit = _winograd_limit(node, room)
                    chunks = 1 if room == 8 else 2
                    assert contract.winograd_samples(n, node.op, *_forward_shapes(node), 1, limit // 4) == n // chunks
                    calls = recorded.count("winograd")
                    results.append(_run(lib, node, arrays, limit))
                    assert recorded.count("winograd") - calls == ranges * chunks, (ranges, room)
        with monkeypatch.context() as patch:
            patch.setattr(contract, "WINOGRAD_FILTER_BYTES", one_block)
            limit = _winograd_limit(node, n - 1)
            assert contract.winograd_samples(n, node.op, *_forward_shapes(node), 1, limit // 4) == 0
            recorded.clear()
            direct = _run(lib, node, arrays, limit)
            assert recorded and set(recorded) == {"filter"}
    finally:
        lib.set_threads(before)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    np.testing.assert_allclose(direct, results[0], rtol=0, atol=4e-5 * float(np.abs(direct).max()))


def test_the_planned_workspace_holds_winograds_arrays(monkeypatch):
    """Where Winograd's transforms take a layer, the op plans room for its transformed filters and the samples'
    arrays it takes at a time (`contract.winograd_samples`); where they do not fit under the limit, the direct
    sums' copies."""
    _by_ranges(monkeypatch)                                     # (the filter gradient in ranges, by chunks)
    for node in _nodes(4, 64, 8, 16, 256, 3, 3, 1, bias=False):
        x_shape, w_shape = _forward_shapes(node)
        per_sample, once = contract.winograd_scratch(node.op, x_shape, w_shape, 1)
        op = get_op(node.op)
        samples = contract.winograd_samples(4, node.op, x_shape, w_shape, 1)
        assert op.workspace(node, None).nbytes // 4 == once + samples * per_sample
        assert op.workspace(node, _winograd_limit(node, 2)).nbytes // 4 >= once + min(samples, 2) * per_sample
        direct = op.workspace(node, _winograd_limit(node, 1) - 4).nbytes // 4
        blocked_per_sample, blocked_once = contract.blocked_scratch(node.op, x_shape, w_shape, 1)
        assert blocked_once + blocked_per_sample <= direct < once + per_sample


def test_a_workspace_too_small_for_winograd_runs_the_direct_sums(lib, recorded, monkeypatch):  # noqa: F811
    """One float short of Winograd's filters and a sample's arrays: the direct sums on blocked copies, within
    Winograd's rounding of its result."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    monkeypatch.setattr(lib, "winograd", True)
    x_shape, w_shape = (2, 64, 8, 8), (64, 64, 3, 3)
    node = make("conv2d", (leaf("x", x_shape), leaf("w", w_shape)), stride=1, pad=1)
    arrays = _arrays(node, 3)
    per_sample, once = contract.winograd_scratch("conv2d", x_shape, w_shape, 1)
    direct = _run(lib, node, arrays, workspace=np.full(once + per_sample - 1, np.nan, np.float32))
    assert recorded == ["conv"]
    recorded.clear()
    winograd = _run(lib, node, arrays, workspace=np.full(once + per_sample, np.nan, np.float32))
    assert recorded == ["winograd"] * 2          # (a sample at a time)
    np.testing.assert_allclose(winograd, direct, rtol=0, atol=4e-5 * float(np.abs(direct).max()))


def test_the_winograd_rule():
    assert contract.winograd_conv(64, 64, 3, 3, 1, 1, 56)
    assert contract.winograd_conv(64, 64, 3, 3, 1, 1, 7, op="conv2d_bwd_data")
    assert contract.winograd_conv(64, 64, 3, 3, 1, 1, 7, op="conv2d_bwd_filter")          # AVX2's lanes too
    assert not contract.winograd_conv(56, 32, 5, 5, 1, 2, 12)                              # 5x5: F(4x4, 3x3) only
    assert not contract.winograd_conv(64, 64, 3, 3, 2, 1, 28)                              # not blocked: strided
    assert contract.winograd_conv(512, 512, 3, 3, 1, 1, 4)                    # rows of 4: ResNet's 4x4 layers
    assert contract.winograd_conv(512, 512, 3, 3, 1, 1, 4, op="conv2d_bwd_data")
    assert contract.winograd_conv(512, 512, 3, 3, 1, 1, 4, op="conv2d_bwd_filter")     # by pairs only, the batch
    assert contract.winograd_samples(8, "conv2d_bwd_filter", (8, 512, 4, 4), (512, 512, 3, 3), 1) == 8  # at once
    # by pairs: at most 128 tiles (any number on rows too short for the ranges) whose transformed tiles take at most
    # 32 MiB, with 16 pairs of blocks at least; or at most 64 tiles; where the whole batch's arrays fit
    pairs = functools.partial(contract.winograd_pairs, "conv2d_bwd_filter", w_shape=(512, 512, 3, 3), pad=1)
    assert pairs((32, 512, 7, 7)) and not pairs((33, 512, 7, 7)) and pairs((227, 512, 4, 4)) and \
        not pairs((228, 512, 4, 4)) and not contract.winograd_pairs("conv2d", (1, 512, 4, 4), (512, 512, 3, 3), 1)
    assert contract.winograd_samples(227, "conv2d_bwd_filter", (227, 512, 4, 4), (512, 512, 3, 3), 1) == 227
    assert contract.winograd_samples(228, "conv2d_bwd_filter", (228, 512, 4, 4), (512, 512, 3, 3), 1) == 0
    assert contract.winograd_pairs("conv2d_bwd_filter", (2, 64, 28, 28), (64, 64, 3, 3), 1) and \
        not contract.winograd_pairs("conv2d_bwd_filter", (3, 64, 28, 28), (64, 64, 3, 3), 1) and \
        not contract.winograd_pairs("conv2d_bwd_filter", (2, 64, 28, 28), (48, 64, 3, 3), 1) and \
        contract.winograd_pairs("conv2d_bwd_filter", (1, 64, 28, 28), (48, 64, 3, 3), 1)    # 12 pairs, 49 tiles
    per_sample, _ = contract.winograd_scratch("conv2d_bwd_filter", (2, 64, 28, 28), (64, 64, 3, 3), 1)
    for room in (None, 2 * per_sample, 2 * per_sample - 1):
        assert contract.winograd_pairs("conv2d_bwd_filter", (2, 64, 28, 28), (64, 64, 3, 3), 1, room) == \
            (room != 2 * per_sample - 1)
    assert not contract.winograd_conv(64, 64, 3, 3, 1, 1, 3)                               # nor shorter rows
    assert contract.winograd_tiles(7, 7) == 4 and contract.winograd_tiles(8, 9) == 6
    # the filter gradient's partial sums: whole samples within the blocked kernels' partial sums' terms
    blocked_source = (Path(contract.__file__).parent / "kernels" / "cpu_blocked.c").read_text()
    assert f"#define DEEPDSL_SUM_TERMS {contract.WINOGRAD_SUM_TILES} " in blocked_source
    winograd_source = (Path(contract.__file__).parent / "kernels" / "cpu_winograd.c").read_text()
    assert f"#define DEEPDSL_WINO_SKEW {contract.WINOGRAD_SKEW} " in winograd_source
    assert contract.winograd_sum_samples(7, 7) == 64 and contract.winograd_sum_samples(112, 112) == 1
    per_sample, once = contract.winograd_scratch("conv2d_bwd_filter", (8, 16, 30, 30), (32, 16, 3, 3), 1)
    for room, samples in ((once + per_sample - 1, 0), (once + per_sample, 1), (once + 5 * per_sample, 4)):
        assert contract.winograd_samples(8, "conv2d_bwd_filter", (8, 16, 30, 30), (32, 16, 3, 3), 1, room) == samples


def test_deepdsl_winograd_0_turns_the_transforms_off(lib, tmp_path_factory, monkeypatch):  # noqa: F811
    """$DEEPDSL_WINOGRAD=0: the same library loaded again takes the direct sums for the 3x3 layers (the bits of the
    blocked kernels with Winograd's off), and without it Winograd's transforms."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    from deepdsl_runtime.cpu import native
    from tests.test_native_kernels import _program

    _, _, path = _program("resnet_mini", None, tmp_path_factory)
    monkeypatch.setenv("DEEPDSL_WINOGRAD", "0")
    off, _ = native.load(path)
    monkeypatch.delenv("DEEPDSL_WINOGRAD")
    on, _ = native.load(path)
    assert off.blocked and not off.winograd_kernels and not off.winograd
    assert on.winograd_kernels and on.winograd
    node = _nodes(2, 32, 8, 8, 32, 3, 3, 1, bias=True)[0]
    arrays = _arrays(node, 9)
    direct = _run(off, node, arrays)
    with monkeypatch.context() as patch:
        patch.setattr(on, "winograd", False)
        assert np.array_equal(direct, _run(on, node, arrays))
    assert not np.array_equal(direct, _run(on, node, arrays))        # (Winograd's rounding)


# ----------------------------------------------------------------------------------------------------------------
# Thin layers' filter gradients of any stride (runtime/kernels/cpu_blocked.c: `deepdsl_thin_filter`,
# `contract.thin_filter`)

THIN_GEOMETRIES = [  # (N, C, H, W, O, kh, kw, stride, pad)
    (2, 3, 32, 32, 64, 7, 7, 2, 3),       # ResNet's conv1: four output blocks in groups of two (AVX-512)
    (2, 3, 35, 35, 96, 11, 11, 4, 2),     # AlexNet's conv1: rows of 11 taps (AVX2: its 121 in parts of 6 and 5)
    (3, 1, 28, 28, 64, 7, 7, 7, 0),       # a ViT's patch embedding: no padding, the input read in place
    (2, 4, 13, 17, 20, 3, 5, 3, 1),       # an output block partly empty, a kernel wider than tall
    (1, 3, 9, 600, 16, 3, 3, 2, 1),       # rows of 300 positions: partial sums of 256 and 44 of them
]


def _thin_node(n, c, h, w, o, kh, kw, stride, pad):
    g = leaf("g", (n, o, contract.out_size(h, kh, stride, pad), contract.out_size(w, kw, stride, pad)))
    return make("conv2d_bwd_filter", (g, leaf("x", (n, c, h, w))), stride=stride, pad=pad, kernel=(kh, kw))


def _thin_workspace(node, samples):
    """A NaN-filled workspace with room for the thin kernels' sums and `samples` samples' copies, no more."""
    g, x = node.inputs
    per_sample, once = contract.thin_filter_scratch(g.shape, x.shape, node.attr("kernel"), node.attr("pad"))
    return np.full(once + samples * per_sample, np.nan, np.float32)


@pytest.fixture
def thin_calls(lib, monkeypatch):  # noqa: F811
    """How many times `Native.thin_filter` ran (a chunk of samples each)."""
    ran = []
    thin = lib.thin_filter
    monkeypatch.setattr(lib, "thin_filter", lambda *a: ran.append(a[0].shape[0]) or thin(*a))
    return ran


@pytest.mark.parametrize("geometry", THIN_GEOMETRIES, ids=[str(g) for g in THIN_GEOMETRIES])
def test_thin_filter_gradients_equal_the_reference(lib, thin_calls, geometry):  # noqa: F811
    """Into NaN-filled outputs under NaN-filled workspaces of exactly the planned size (the batch at a time) and of
    the sums and one sample's room (a chunk each): the float64 reference to float32 rounding of sums of N*Ho*Wo
    products."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    n, c, h, w, o, kh, kw, stride, pad = geometry
    assert contract.thin_filter(c, o, kh, kw, stride, pad)
    node = _thin_node(*geometry)
    arrays = _arrays(node, sum(geometry))
    want = get_op(node.op).evaluate(EvalContext(np.float64), *[a.astype(np.float64) for a in arrays], **node.kwargs)
    for samples, chunks in ((None, [n]), (1, [1] * n)):
        thin_calls.clear()
        got = _run(lib, node, arrays, workspace=None if samples is None else _thin_workspace(node, samples))
        assert thin_calls == chunks, samples
        assert not np.isnan(got).any()
        positions = n * node.inputs[0].shape[2] * node.inputs[0].shape[3]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-7 * np.sqrt(positions) * float(np.abs(want).max()))


@pytest.mark.parametrize("geometry", THIN_GEOMETRIES[:3], ids=[str(g) for g in THIN_GEOMETRIES[:3]])
def test_thin_filter_gradient_bits_do_not_depend_on_threads_chunks_or_vectors(lib, avx2_kernels, thin_calls,
                                                                               geometry):  # noqa: F811
    """Each sum adds its rows' partial sums in the order of the samples and rows, whoever computes it: the same bits
    on 1, 2 and 3 threads, in chunks of one sample and of all, and built for AVX2 alone (one block by up to six of
    the kernel's taps a pass, where AVX-512's takes two blocks by a kernel row)."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    node = _thin_node(*geometry)
    arrays = _arrays(node, 3)
    results, before = [], (lib.threads, avx2_kernels.threads)
    try:
        for threads in (1, 2, 3):
            for kernels in (lib, avx2_kernels):
                kernels.set_threads(threads)
                for samples in (None, 1):
                    results.append(_run(kernels, node, arrays,
                                        workspace=None if samples is None else _thin_workspace(node, samples)))
    finally:
        lib.set_threads(before[0])
        avx2_kernels.set_threads(before[1])
    assert len(thin_calls) == 3 * (1 + geometry[0])          # (the AVX2 library's calls are not counted)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


def test_a_workspace_too_small_for_the_thin_kernels_leaves_the_layer_to_im2col(lib, thin_calls):  # noqa: F811
    """One float short of the sums and a sample's copies: the thin kernels decline (nothing written; the im2col
    path then runs); the op plans at least their room for the samples they take at a time, and under the tightest
    limit numpy's workspace alone (one sample's im2col matrix, which holds their sums and a sample here)."""
    if not lib.blocked:
        pytest.skip("this processor has no AVX2 with fused multiply-adds")
    node = _thin_node(*THIN_GEOMETRIES[0])
    (g, x), op = node.inputs, get_op(node.op)
    per_sample, once = contract.thin_filter_scratch(g.shape, x.shape, (7, 7), 3)
    assert op.workspace(node, None).nbytes // 4 >= once + 2 * per_sample
    g_, x_ = _arrays(node, 5)
    out = np.full(node.shape, np.nan, np.float32)
    short = np.full(once + per_sample - 1, np.nan, np.float32)
    assert not conv._thin_filter(g_, x_, out, 2, 3, short, lib) and not thin_calls and np.isnan(out).all()
    assert conv._thin_filter(g_, x_, out, 2, 3, _thin_workspace(node, 1), lib) and thin_calls == [1, 1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(contract, "thin_filter", lambda *args, **kwargs: False)
        im2col_alone = op.workspace(node, 1)
    assert op.workspace(node, 1) == im2col_alone


def test_the_thin_filter_rule():
    assert contract.thin_filter(3, 64, 7, 7, 2, 3)                     # ResNet's conv1
    assert contract.thin_filter(3, 96, 11, 11, 4, 2)                   # AlexNet's
    assert contract.thin_filter(1, 64, 7, 7, 7, 0)                     # a ViT's patch embedding
    assert not contract.thin_filter(3, 64, 3, 3, 1, 1)                 # stride 1, 27 products: `direct_conv`'s
    assert contract.thin_filter(3, 64, 5, 5, 1, 2)                     # stride 1 but 75 products
    assert not contract.thin_filter(8, 64, 7, 7, 2, 3)                 # more channels: im2col's product is wide
    assert not contract.thin_filter(3, 8, 7, 7, 2, 3)                  # few outputs: a block mostly empty
    assert not contract.thin_filter(3, 64, 13, 13, 4, 0)               # wider than the kernels take
    assert not contract.thin_filter(3, 64, 1, 1, 2, 0)                 # pointwise
    assert not contract.thin_filter(4, 64, 7, 7, 2, 3, groups=2)       # grouped
    blocked_source = (Path(contract.__file__).parent / "kernels" / "cpu_blocked.c").read_text()
    assert f"#define DEEPDSL_THIN_KW {contract.THIN_FILTER_WIDTH} " in blocked_source
