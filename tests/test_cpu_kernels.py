"""Paths of the CPU kernels that the op tests' small shapes do not reach (`tests/test_runtime_cpu.py` checks every op
once): cache-sized chunks of samples (`CACHE_BYTES` made tiny, so every kernel runs one sample at a time), the three
product layouts of the forward convolution (one GEMM regrouped through the im2col matrix, one product per sample for
large planes, and per sample when the filters outnumber the im2col rows), ties in max-pool windows, per-channel sums.
Expected values always come from the ops' reference semantics (`Op.evaluate`) or numpy in float64.
"""
from __future__ import annotations

import numpy as np
import pytest

from deepdsl.ir import UINT8, make
from deepdsl.ops import EvalContext, get_op
from tests.test_runtime_cpu import check, check_over, leaf, run_runtime

cpu = pytest.importorskip("deepdsl_runtime.cpu")
from deepdsl_runtime.cpu import elementwise as cpu_elementwise, scratch as cpu_scratch  # noqa: E402
from deepdsl_runtime.cpu.scratch import samples_per_chunk  # noqa: E402


@pytest.fixture
def tiny_cache(monkeypatch):
    """Every kernel's cache bound holds one sample: chunk loops run once per sample."""
    monkeypatch.setattr(cpu_scratch, "CACHE_BYTES", 1)


CONV = [
    # (N, C, H, W, O, k, stride, pad): small planes with C*k*k >= O (one GEMM, regrouped), large planes
    # (Ho*Wo >= 256: one product per sample), more filters than im2col rows, padded, strided; stride-1 input
    # gradients by kernel rows (O*kw + kh*C < C*kh*kw) but for the last case
    (5, 3, 9, 9, 4, 3, 1, 1),
    (3, 2, 19, 19, 3, 3, 1, 1),
    (4, 2, 7, 7, 9, 1, 2, 0),
    (4, 2, 6, 6, 9, 1, 1, 1),
    (3, 3, 11, 11, 5, 3, 2, 2),
    (3, 1, 8, 8, 6, 3, 1, 1),          # input gradient by kernel offsets (O*kw + kh*C >= C*kh*kw)
]


def conv_nodes(case):
    n, c, h, w, o, k, s, p = case
    x, wt, b = leaf("x", (n, c, h, w)), leaf("w", (o, c, k, k)), leaf("b", (o,))
    y = make("conv2d", (x, wt, b), stride=s, pad=p)
    g = leaf("g", y.shape)
    return [y, make("conv2d_bwd_data", (g, wt), stride=s, pad=p, size=(h, w)),
            make("conv2d_bwd_filter", (g, x), stride=s, pad=p, kernel=(k, k))]


@pytest.mark.parametrize("case", CONV)
def test_convolutions_in_every_layout(case, stride1_scheme):
    for node in conv_nodes(case):
        check(node)


@pytest.mark.parametrize("case", CONV)
def test_convolutions_in_cache_sized_chunks(case, tiny_cache, stride1_scheme):
    """One sample per chunk, with the whole batch's workspace: the filter gradient adds chunks up in the part of
    the workspace the batch does not need."""
    for node in conv_nodes(case):
        check(node)


def test_every_stride1_scheme_runs_on_these_cases(stride1_scheme):
    """The fixture forces each scheme of the stride-1 input gradient on at least one case of CONV."""
    for case in CONV:
        check(conv_nodes(case)[1])
    assert stride1_scheme.forced in stride1_scheme.ran


def test_cache_chunks_split_only_where_the_workspace_keeps_room():
    per_sample = 10
    assert samples_per_chunk(4, None, per_sample) == 4                               # 8 MiB hold everything
    assert samples_per_chunk(4, None, per_sample, cache_floats=25) == 2
    room = np.empty(4 * per_sample, np.float32)
    assert samples_per_chunk(4, room, per_sample, fixed_if_split=5, cache_floats=25) == 2      # 2 * 10 + 5 <= 40
    assert samples_per_chunk(4, room, per_sample, fixed_if_split=25, cache_floats=25) == 4     # no room to add chunks up
    assert samples_per_chunk(4, room[:25], per_sample, fixed_if_split=5) == 2                  # the workspace decides
    with pytest.raises(ValueError, match="holds no sample"):
        samples_per_chunk(4, room[:12], per_sample, fixed_if_split=5)


POOL = [
    # (N, C, H, W, kernel, stride, pad, ceil)
    (5, 3, 8, 8, 2, 2, 0, False),
    (4, 2, 9, 7, 3, 2, 0, True),
    (3, 2, 7, 7, 3, 1, 1, False),
]


def pool_nodes(case):
    n, c, h, w, k, s, p, ceil = case
    attrs = dict(kernel=k, stride=s, pad=p, ceil=ceil)
    x = leaf("x", (n, c, h, w))
    y = make("max_pool", (x,), **attrs)
    return x, y, make("max_pool_argmax", (x,), **attrs), \
        make("max_pool_bwd", (leaf("g", y.shape), leaf("a", y.shape, UINT8)), size=(h, w), **attrs)


@pytest.mark.parametrize("case", POOL)
def test_max_pooling_in_cache_sized_chunks(case, tiny_cache):
    x, y, argmax, bwd = pool_nodes(case)
    rng = np.random.default_rng(3)
    xv = rng.standard_normal(x.shape).astype(np.float32)
    check(y, [xv])
    index = check(argmax, [xv])
    check(bwd, [rng.standard_normal(y.shape).astype(np.float32), index])


@pytest.mark.parametrize("o,c", [(4, 3), (2, 5), (9, 1)])    # input gradient smaller (forward), larger (backward)
def test_taking_over_in_cache_sized_chunks(o, c, tiny_cache, stride1_scheme):
    check_over(make("max_pool", (leaf("x", (5, 3, 8, 8)),), kernel=2, stride=2))
    check_over(make("conv2d_bwd_data", (leaf("g", (5, o, 6, 6)), leaf("w", (o, c, 3, 3))), stride=1, pad=1,
                    size=(6, 6)))


def test_argmax_picks_the_first_of_equal_maxima():
    """Windows whose maximum appears at several positions, at every position, and nowhere but the last."""
    k = 3
    patterns = []
    for first in range(k * k):
        window = np.zeros(k * k, np.float32)
        window[first:] = 2.0                       # maximum from `first` on: the index is `first`
        patterns.append((window, first))
    last = np.arange(k * k, dtype=np.float32)      # strictly increasing: the last position
    patterns.append((last, k * k - 1))
    patterns.append((np.full(k * k, -np.inf, np.float32), 0))
    x = np.stack([w.reshape(k, k) for w, _ in patterns])[None]      # (1, windows, k, k): one window per channel
    node = make("max_pool_argmax", (leaf("x", x.shape),), kernel=k, stride=k)
    got = run_runtime(node, [x])
    assert got.reshape(-1).tolist() == [index for _, index in patterns]
    expected = get_op("max_pool_argmax").evaluate(EvalContext(np.float32), x, kernel=k, stride=k)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("shape", [(4, 6, 5, 7), (3, 5, 1, 1), (2, 3, 1, 9)])
def test_per_channel_sums(shape):
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    out = np.full((1, shape[1], 1, 1), np.nan, np.float32)
    cpu.sum_to(x, out=out, shape=(1, shape[1], 1, 1))
    expected = x.astype(np.float64).sum(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_average_pool_divides_in_float32():
    divisor = cpu.avg_pool_divisor((7, 7), 3, 2, 1, True, False)
    assert divisor.dtype == np.float32 and divisor.min() >= 1


@pytest.mark.parametrize("case", POOL)
@pytest.mark.parametrize("over", [False, True])
@pytest.mark.parametrize("cache", ["tiny", "default"])
def test_max_pool_with_argmax_in_one_pass(case, over, cache, monkeypatch):
    """`max_pool(x, out=, argmax=)` (what code generation emits for a max_pool and max_pool_argmax pair) gives
    both ops' reference values, also when its output takes over the bytes of x (one sample is then staged through
    the workspace's end) and in chunks of one sample."""
    if cache == "tiny":
        monkeypatch.setattr(cpu_scratch, "CACHE_BYTES", 1)
    x, y, argmax, _ = pool_nodes(case)
    attrs = dict(y.attrs)
    rng = np.random.default_rng(5)
    xv = rng.standard_normal(x.shape).astype(np.float32)
    xv[:, :, :3, :3] = 0.5                                # ties: the first maximum wins
    ctx = EvalContext(np.float32)
    want = get_op("max_pool").evaluate(ctx, xv, **attrs)
    want_index = get_op("max_pool_argmax").evaluate(ctx, xv, **attrs)
    index = np.full(argmax.shape, 255, np.uint8)
    workspace = np.empty(4 * xv.size, np.float32)         # more than any of these cases needs
    if over:
        memory = np.full(xv.size, np.nan, np.float32)
        source = memory.reshape(xv.shape)
        source[...] = xv
        out = memory[:int(np.prod(y.shape))].reshape(y.shape)
    else:
        source, out = xv, np.full(y.shape, np.nan, np.float32)
    cpu.max_pool(source, out=out, argmax=index, workspace=workspace, **attrs)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(index, want_index)


def _update(out, v0, v1, v2, v3, v4):
    """A momentum update as code generation renders it: out may be v0, and v3 * v4 is a temporary."""
    np.multiply(v0, v1, out=out)
    np.add(out, v3 * v4, out=out)
    np.add(out, v2, out=out)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_elementwise_kernels_in_runs(chunk, monkeypatch):
    """Large elementwise kernels run in runs of EW_CHUNK elements (7 does not divide the size): the result equals
    one call of the kernel, in place over an input too; operands of another shape make one call."""
    monkeypatch.setattr(cpu_elementwise, "EW_CHUNK", chunk)
    rng = np.random.default_rng(6)
    v, g, w = (rng.standard_normal((37, 11)).astype(np.float32) for _ in range(3))
    momentum, decay = np.float32(0.9), np.full((1, 1), 0.0005, np.float32)
    want = np.empty_like(v)
    _update(want, v, momentum, g, decay, w)                # one call: the same float32 operations, bit for bit
    np.testing.assert_allclose(want, v.astype(np.float64) * 0.9 + g + 0.0005 * w.astype(np.float64),
                               rtol=1e-5, atol=1e-6)
    out = np.full_like(v, np.nan)
    cpu.ew(_update, out, v, momentum, g, decay, w)
    np.testing.assert_array_equal(out, want)
    inplace = v.copy()
    cpu.ew(_update, inplace, inplace, momentum, g, decay, w)
    np.testing.assert_array_equal(inplace, out)
    row = rng.standard_normal(11).astype(np.float32)      # broadcast along rows: one call
    cpu.ew(_update, out, v, momentum, g, decay, row)
    np.testing.assert_allclose(out, v.astype(np.float64) * 0.9 + g + 0.0005 * row.astype(np.float64),
                               rtol=1e-5, atol=1e-6)


def limited_nodes():
    """Every op with scratch but the convolutions (tests above), at shapes where windows leave the input and
    overlap, so each kernel carves all its buffers."""
    x = leaf("x", (5, 6, 9, 9))
    pooled = dict(kernel=3, stride=2, pad=1, ceil=True)
    y = make("max_pool", (x,), **pooled)
    avg = make("avg_pool", (x,), **pooled, include_pad=False)
    return [
        (y, None), (make("max_pool_argmax", (x,), **pooled), None),
        (make("max_pool_bwd", (leaf("g", y.shape), leaf("a", y.shape, UINT8)), size=(9, 9), **pooled), 9),
        (avg, None), (make("avg_pool_bwd", (leaf("g", avg.shape),), size=(9, 9), **pooled, include_pad=False), None),
        (make("lrn", (x,), size=5, alpha=1e-3, beta=0.75, k=2.0), None),
        (make("lrn_bwd", (leaf("g", x.shape), x), size=5, alpha=1e-3, beta=0.75, k=2.0), None),
        (make("log_softmax", (leaf("s", (7, 10)),)), None),
        (make("bernoulli", (), shape=(6, 50), keep=0.6, key=4), None),
    ]


@pytest.mark.parametrize("node,argmax_kernel", limited_nodes(), ids=lambda v: getattr(v, "op", ""))
@pytest.mark.parametrize("samples", [1, 2, 3])
def test_kernels_run_in_the_chunks_their_workspace_limit_sets(node, argmax_kernel, samples):
    """Under a workspace limit of `samples` samples' scratch, the plan's workspace holds exactly that many and the
    kernel, given it NaN-filled, computes the reference result chunk by chunk (dropout masks: the same bits as one
    draw)."""
    op = get_op(node.op)
    batch = node.shape[0]
    per_sample = op.workspace(node).nbytes // batch
    planned = op.workspace(node, limit=samples * per_sample)
    assert planned.nbytes == samples * per_sample and planned.chunks == -(-batch // samples)
    rng = np.random.default_rng(samples)
    arrays = [rng.integers(0, argmax_kernel, i.shape).astype(np.uint8) if i.dtype == UINT8 else
              rng.standard_normal(i.shape).astype(np.float32) for i in node.inputs]
    check(node, arrays, limit=samples * per_sample, exact=node.op == "bernoulli")
