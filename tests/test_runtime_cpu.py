"""Every op of the registry, run by the CPU runtime (`deepdsl_runtime.cpu`), against the op's reference `evaluate`.

Each case builds a node, feeds random float32 inputs, and calls the runtime function the way generated code does:
inputs positional, `out=` a buffer pre-filled with NaN (so an op that leaves elements unwritten fails), the node's
attributes as keywords, and `workspace=` exactly the size code generation allocates, pre-filled with NaN (so an op
relying on zeroed scratch, or carving more than it was given, fails). Convolutions also run with a workspace
limit that forces several batch chunks. Elementwise nodes run through the kernels code generation renders,
including the in-place variants where the output buffer is one of the inputs.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import sympy

from deepdsl.codegen import lowering, ufuncs
from deepdsl.ir import FLOAT, INT32, UINT8, make
from deepdsl.ops import EvalContext, all_ops, get_op
from deepdsl.ops.elementwise import sym
from deepdsl.ops.norm import bernoulli_mask

cpu = pytest.importorskip("deepdsl_runtime.cpu")
from deepdsl_runtime import contract  # noqa: E402
from deepdsl_runtime.cpu.scratch import safe_chunks  # noqa: E402

RTOL = 1e-5
UNLIMITED = 1 << 40


def leaf(name, shape, dtype=FLOAT):
    return make("input", (), name=name, shape=tuple(shape), dtype=dtype, role="data")


def workspace_size(node, limit):
    """Float32 elements of the workspace the memory plan gives the statement (the op's workspace rule)."""
    return get_op(node.op).workspace(node, limit).nbytes // 4


def random_input(node, rng):
    if node.dtype == INT32:
        return rng.integers(0, 7, node.shape).astype(np.int32)
    if node.dtype == UINT8:
        return rng.integers(0, 2, node.shape).astype(np.uint8)
    return rng.standard_normal(node.shape).astype(np.float32)


def runtime_function(op: str):
    """The CPU runtime's function of `op`, called with the node's inputs and attributes: `ew_sum` gets the kernel
    function of its expression, as generated code passes it."""
    if op == "ew_sum":
        def ew_sum(*operands, out, expr, **rest):
            cpu.ew_sum(kernel(expr, len(operands)), out, *operands, **rest)
        return ew_sum
    return getattr(cpu, op)


def run_runtime(node, arrays, limit=UNLIMITED):
    """Call the runtime function of `node` as generated code does."""
    fn = runtime_function(node.op)
    kwargs = dict(node.kwargs)
    if get_op(node.op).view:
        return fn(*arrays, **kwargs)
    dtype = {FLOAT: np.float32, INT32: np.int32, UINT8: np.uint8}[node.dtype]
    out = np.full(node.shape, np.nan if dtype == np.float32 else 255, dtype=dtype)
    size = workspace_size(node, limit)
    if size:
        kwargs["workspace"] = np.full(size, np.nan, dtype=np.float32)
    if node.op == "bernoulli":
        kwargs.update(seed=3, step=5)
    if node.op in ("attention", "attention_grad") and node.attr("keep") is not None:    # a dropout mask
        *arrays, kwargs["mask"] = arrays
    fn(*arrays, out=out, **kwargs)
    return out


def check(node, arrays=None, seed=0, limit=UNLIMITED, exact=False):
    rng = np.random.default_rng(seed)
    if arrays is None:
        arrays = [random_input(i, rng) for i in node.inputs]
    expected = get_op(node.op).evaluate(EvalContext(np.float32, seed=3, step=5), *arrays, **node.kwargs)
    got = run_runtime(node, arrays, limit)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, got.dtype, expected.dtype)
    if exact or got.dtype != np.float32:
        np.testing.assert_array_equal(got, expected)
    else:
        scale = max(1.0, float(np.abs(expected).max()) if expected.size else 1.0)
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL * scale)
    return got


COVERED: set[str] = set()


def covers(*ops):
    COVERED.update(ops)

    def mark(fn):
        return fn
    return mark


# ----------------------------------------------------------------------------------------------------------------
# convolution

CONV = [
    # (N, C, H, W, O, k, stride, pad, bias)
    (2, 3, 9, 9, 4, 3, 1, 1, True),
    (3, 2, 10, 8, 5, 3, 2, 1, True),
    (2, 4, 7, 7, 6, 1, 1, 0, True),      # pointwise: one batched GEMM, no im2col
    (2, 64, 4, 4, 96, 1, 1, 0, True),    # pointwise on a small plane, many channels: one product, regrouped
    (2, 4, 9, 9, 3, 1, 2, 0, False),     # strided 1x1 (ResNet projection)
    (3, 2, 9, 9, 6, 1, 2, 0, True),      # strided 1x1 widening the channels: more filters than im2col rows
    (2, 2, 9, 9, 13, 1, 2, 0, False),    # ... so much that the input gradient is the smaller (taking over: forward)
    (2, 3, 23, 23, 4, 11, 4, 2, True),   # AlexNet's first layer, small
    (4, 2, 6, 6, 3, 5, 1, 2, False),
    (2, 2, 5, 5, 2, 5, 1, 0, True),      # one output pixel
    (3, 1, 8, 8, 2, 2, 3, 1, True),      # stride larger than the kernel: uncovered input positions
]


@covers("conv2d", "conv2d_bwd_data", "conv2d_bwd_filter")
@pytest.mark.parametrize("case", CONV)
@pytest.mark.parametrize("limit", [UNLIMITED, 1])       # 1 byte: one sample per chunk
def test_conv(case, limit):
    n, c, h, w, o, k, s, p, bias = case
    x, wt = leaf("x", (n, c, h, w)), leaf("w", (o, c, k, k))
    inputs = [x, wt] + ([leaf("b", (o,))] if bias else [])
    y = make("conv2d", inputs, stride=s, pad=p)
    check(y, limit=limit)
    g = leaf("g", y.shape)
    check(make("conv2d_bwd_data", (g, wt), stride=s, pad=p, size=(h, w)), limit=limit)
    check(make("conv2d_bwd_filter", (g, x), stride=s, pad=p, kernel=(k, k)), limit=limit)


def test_pointwise_convolutions_regroup_only_where_it_costs_less():
    """One product regrouped (`contract.one_product`) for the pointwise layers whose products per sample leave most
    lanes or strips idle, a product per sample for the others (as measured on ResNet-50's and MobileNet-v2's)."""
    assert contract.one_product(16, pointwise=(64, 96)) and contract.one_product(16, pointwise=(96, 64))
    assert not contract.one_product(49, pointwise=(4, 6)) and not contract.one_product(49, pointwise=(6, 4))
    assert contract.one_product(16, pointwise=(512, 2048))              # ResNet-50's last stage at 4x4
    assert contract.one_product(49, pointwise=(256, 1024))              # its third at 7x7
    assert not contract.one_product(49, pointwise=(64, 384))            # MobileNet-v2's at 7x7
    assert not contract.one_product(196, pointwise=(1024, 256))         # 14x14: a strip or more per sample
    assert not contract.one_product(16, groups=2, pointwise=(64, 96))


GROUPED_CONV = [
    # (N, C, H, W, O, k, stride, pad, bias, groups)
    (2, 4, 7, 7, 6, 3, 1, 1, True, 2),   # two groups of 2 inputs and 3 outputs
    (3, 3, 9, 8, 6, 3, 2, 1, False, 3),  # depthwise with two filters per channel, strided
    (2, 4, 8, 8, 4, 3, 1, 1, True, 4),   # depthwise (MobileNet)
    (2, 4, 6, 5, 4, 1, 1, 0, True, 4),   # pointwise depthwise: no im2col
    (2, 6, 5, 5, 4, 1, 1, 0, False, 2),  # grouped pointwise (ShuffleNet)
    (2, 4, 9, 9, 8, 2, 3, 1, True, 4),   # stride larger than the kernel: uncovered input positions
]


def grouped_conv_nodes(case):
    n, c, h, w, o, k, s, p, bias, groups = case
    x, wt = leaf("x", (n, c, h, w)), leaf("w", (o, c // groups, k, k))
    y = make("conv2d", [x, wt] + ([leaf("b", (o,))] if bias else []), stride=s, pad=p, groups=groups)
    g = leaf("g", y.shape)
    return [y, make("conv2d_bwd_data", (g, wt), stride=s, pad=p, size=(h, w), groups=groups),
            make("conv2d_bwd_filter", (g, x), stride=s, pad=p, kernel=(k, k), groups=groups)]


@pytest.mark.parametrize("case", GROUPED_CONV)
@pytest.mark.parametrize("limit", [UNLIMITED, 1])
def test_grouped_conv(case, limit):
    """Grouped and depthwise convolutions and both their gradients, whole batch and one sample per chunk."""
    for node in grouped_conv_nodes(case):
        check(node, limit=limit)


def test_conv_chunks_follow_the_workspace():
    """With room for two of five samples the runtime runs three chunks and still gives the whole-batch result."""
    x, wt, g = leaf("x", (5, 3, 8, 8)), leaf("w", (4, 3, 3, 3)), leaf("g", (5, 4, 8, 8))
    node = make("conv2d_bwd_filter", (g, x), stride=1, pad=1, kernel=(3, 3))
    per_sample = (3 * 9 + 4) * 64 * 4
    assert workspace_size(node, 2 * per_sample) < workspace_size(node, UNLIMITED)
    check(node, limit=2 * per_sample)
    check(make("conv2d", (x, wt), stride=1, pad=1), limit=2 * 27 * 64 * 4)


def test_chunked_filter_gradients_by_the_transposed_product(monkeypatch):
    """A filter gradient in chunks whose output positions are many against the filter's rows runs its products as
    (C*kh*kw, O) through the accumulator and transposes them back; the others as (O, C*kh*kw): both give the
    gradient, whole batch and one sample per chunk."""
    from deepdsl_runtime.cpu import conv

    asked = []
    decide = conv._transposed_filter_product
    monkeypatch.setattr(conv, "_transposed_filter_product", lambda *a: asked.append(decide(*a)) or asked[-1])
    for shape, kernel in (((3, 2, 12, 12), 3), ((3, 8, 6, 6), 3)):       # 100 positions for 18 rows; 16 for 72
        x = leaf("x", shape)
        ho = shape[2] - kernel + 1
        node = make("conv2d_bwd_filter", (leaf("g", (shape[0], 5, ho, ho)), x), stride=1, pad=0,
                    kernel=(kernel, kernel))
        check(node, limit=1)
        check(node)
    assert True in asked and False in asked


# ----------------------------------------------------------------------------------------------------------------
# pooling

POOL = [
    # (N, C, H, W, kernel, stride, pad, ceil)
    (2, 3, 8, 8, 2, 2, 0, False),
    (2, 2, 9, 7, 3, 2, 0, True),         # Caffe's overlapping 3x3/2 with rounding up
    (2, 2, 7, 7, 3, 1, 1, False),        # inception's pooling branch
    (1, 2, 10, 10, 3, 2, 1, True),
    (2, 1, 5, 5, 5, 5, 0, False),        # global
    (2, 2, 9, 9, 2, 3, 0, False),        # stride larger than the window
]


@covers("max_pool", "max_pool_argmax", "max_pool_bwd")
@pytest.mark.parametrize("case", POOL)
def test_max_pool(case):
    n, c, h, w, k, s, p, ceil = case
    x = leaf("x", (n, c, h, w))
    attrs = dict(kernel=k, stride=s, pad=p, ceil=ceil)
    rng = np.random.default_rng(1)
    xv = rng.standard_normal(x.shape).astype(np.float32)
    xv[0, 0, :2, :2] = 1.5                 # ties: the first maximum wins
    y = make("max_pool", (x,), **attrs)
    check(y, [xv])
    argmax = make("max_pool_argmax", (x,), **attrs)
    index = check(argmax, [xv])
    g = leaf("g", y.shape)
    bwd = make("max_pool_bwd", (g, leaf("a", y.shape, UINT8)), size=(h, w), **attrs)
    check(bwd, [rng.standard_normal(y.shape).astype(np.float32), index])


@covers("avg_pool", "avg_pool_bwd")
@pytest.mark.parametrize("case", POOL)
@pytest.mark.parametrize("include_pad", [True, False])
def test_avg_pool(case, include_pad):
    n, c, h, w, k, s, p, ceil = case
    attrs = dict(kernel=k, stride=s, pad=p, ceil=ceil, include_pad=include_pad)
    y = make("avg_pool", (leaf("x", (n, c, h, w)),), **attrs)
    check(y)
    check(make("avg_pool_bwd", (leaf("g", y.shape),), size=(h, w), **attrs))


# ----------------------------------------------------------------------------------------------------------------
# normalization, losses

@covers("lrn", "lrn_bwd")
@pytest.mark.parametrize("shape", [(2, 7, 3, 3), (3, 6), (2, 2, 2, 2)])
@pytest.mark.parametrize("size", [5, 4, 1])
def test_lrn(shape, size):
    attrs = dict(size=size, alpha=0.3, beta=0.75, k=2.0)
    x = leaf("x", shape)
    check(make("lrn", (x,), **attrs))
    check(make("lrn_bwd", (leaf("g", shape), x), **attrs))


@covers("layer_norm", "layer_norm_grad", "layer_norm_param_grad")
@pytest.mark.parametrize("shape, axes, affine", [((4, 3, 20), 1, True), ((3, 4, 5), 2, True), ((7, 6), 1, False),
                                                 ((2, 1), 1, True), ((130, 17), 1, True)])
def test_layer_norm(shape, axes, affine):
    """The three layer norm ops of the numpy backend against their reference semantics (float32 inputs, values far
    from zero mean), under NaN-filled outputs and workspaces of the planned size; dx written over g (in place)."""
    rng = np.random.default_rng(len(shape) + axes)
    x = (3 * rng.standard_normal(shape) + 2).astype(np.float32)
    features = shape[len(shape) - axes:]
    params = [leaf("w", features), leaf("b", features)] if affine else []
    values = [rng.standard_normal(features).astype(np.float32) for _ in params]
    attrs = dict(eps=1e-5, axes=axes)
    check(make("layer_norm", (leaf("x", shape), *params), **attrs), [x, *values])
    g = rng.standard_normal(shape).astype(np.float32)
    node = make("layer_norm_grad", (leaf("x", shape), leaf("g", shape), *params[:1]), **attrs)
    want = check(node, [x, g, *values[:1]])
    inplace = g.copy()
    cpu.layer_norm_grad(x, inplace, *values[:1], out=inplace, **attrs)
    np.testing.assert_array_equal(inplace, want)
    check(make("layer_norm_param_grad", (leaf("x", shape), leaf("g", shape)), **attrs), [x, g])


@covers("softmax", "log_softmax", "pick", "unpick", "precision", "label_rank")
def test_losses():
    rng = np.random.default_rng(2)
    x, labels = leaf("x", (6, 5)), leaf("y", (6,), INT32)
    scores = (rng.standard_normal((6, 5)) * 20).astype(np.float32)       # large: needs the max shift
    yv = rng.integers(0, 5, 6).astype(np.int32)
    check(make("softmax", (x,)), [scores])
    causal = leaf("c", (12, 4))
    got = check(make("softmax", (causal,), causal=True), [(rng.standard_normal((12, 4)) * 20).astype(np.float32)])
    assert np.all(got.reshape(3, 4, 4)[:, np.triu(np.ones((4, 4), bool), 1)] == 0)
    check(make("log_softmax", (x,)), [scores])
    check(make("pick", (x, labels)), [scores, yv], exact=True)
    check(make("unpick", (leaf("g", (6,)), labels), classes=5), [scores[:, 0].copy(), yv], exact=True)
    check(make("precision", (x, labels)), [scores, yv], exact=True)
    ties = np.round(scores / 20).astype(np.float32)                       # many equal scores
    check(make("label_rank", (x, labels)), [ties, yv], exact=True)
    check(make("label_rank", (x, labels)), [scores, yv], exact=True)


ATTENTION = [  # (units, T, S, d, e, causal, bias shape or None, fraction kept by dropout or None)
    ((2, 3), 5, 7, 4, 6, False, None, None),
    ((2, 3), 6, 6, 4, 3, True, (1, 3, 6, 6), None),
    ((3,), 70, 40, 5, 2, False, (3, 1, 40), None),      # two blocks of queries (64 at a time)
    ((2,), 130, 130, 8, 8, True, None, None),           # three blocks, causal
    ((2, 3), 5, 7, 4, 6, False, None, 0.7),             # dropout
    ((3,), 70, 70, 5, 2, True, (3, 1, 70), 0.5),        # dropout over two blocks, causal, a bias
]


@covers("attention", "attention_grad")
@pytest.mark.parametrize("case", ATTENTION)
@pytest.mark.parametrize("limit", [UNLIMITED, 1])
def test_attention_and_its_gradient(case, limit):
    """numpy's attention kernels against the reference, with the whole workspace and with one unit's (a limit of
    one byte: unit by unit), blocks of queries, causal masks, broadcast biases and dropout masks."""
    lead, t, s, d, e, causal, bias_shape, keep = case
    q, k, v = leaf("q", (*lead, t, d)), leaf("k", (*lead, s, d)), leaf("v", (*lead, s, e))
    bias = () if bias_shape is None else (leaf("b", bias_shape),)
    mask = () if keep is None else (leaf("m", (*lead, t, s), UINT8),)
    attrs = {"scale": 0.3, **({"causal": True} if causal else {}), **({"keep": keep} if keep else {})}
    forward = make("attention", (q, k, v, *bias, *mask), **attrs)
    check(forward, seed=1, limit=limit)
    g = leaf("g", forward.shape)
    check(make("attention_grad", (q, k, v, forward, g, *bias, *mask), **attrs), seed=2, limit=limit)


@covers("equal")
def test_equality_masks():
    tokens = np.array([[3, 0, 1, 0], [2, 2, 0, 5]], np.int32)
    got = check(make("equal", (leaf("t", (2, 4), INT32),), value=0.0), [tokens], exact=True)
    assert got.dtype == np.uint8 and got.tolist() == [[0, 1, 0, 1], [0, 0, 1, 0]]
    check(make("equal", (leaf("x", (3, 5)),), value=0.5), [np.round(np.random.default_rng(1).random((3, 5)) * 2)
                                                            .astype(np.float32) / 2], exact=True)


@covers("gather_rows", "scatter_rows")
def test_rows_by_index():
    rng = np.random.default_rng(4)
    table, ids = leaf("t", (7, 5)), leaf("i", (9,), INT32)
    values = rng.standard_normal((7, 5)).astype(np.float32)
    rows = np.array([3, 0, 3, 6, 3, 1, 0, 6, 2], np.int32)
    check(make("gather_rows", (table, ids)), [values, rows], exact=True)
    g = rng.standard_normal((9, 5)).astype(np.float32)
    check(make("scatter_rows", (leaf("g", (9, 5)), ids), rows=7), [g, rows], exact=True)
    outside = np.array([3, -1, 7, 0, 3, 100, 1, 6, 2], np.int32)      # rows outside the table: NaN, nothing added
    got = check(make("gather_rows", (table, ids)), [values, outside], exact=True)
    assert np.isnan(got[[1, 2, 5]]).all() and not np.isnan(np.delete(got, [1, 2, 5], axis=0)).any()
    check(make("scatter_rows", (leaf("g", (9, 5)), ids), rows=7), [g, outside], exact=True)


@covers("bernoulli")
def test_bernoulli_matches_the_reference_bit_for_bit():
    node = make("bernoulli", (), shape=(4, 33), keep=0.7, key=2)
    got = check(node, [], exact=True)
    assert 0 < got.sum() < got.size
    # the runtime's copy of the mask function agrees with the compiler's
    for seed, step, key, keep in [(0, 0, 1, 0.5), (7, 123456, 3, 0.9), (2**31 - 1, 5, 65535, 0.1)]:
        np.testing.assert_array_equal(cpu.bernoulli_mask(seed, step, key, (3, 17), keep),
                                      bernoulli_mask(seed, step, key, (3, 17), keep))


# ----------------------------------------------------------------------------------------------------------------
# shapes, data movement, matmul

@covers("sum_to", "broadcast_to", "reshape", "const")
def test_shape_ops():
    x = leaf("x", (4, 3, 2, 5))
    for shape in [(), (5,), (1, 3, 1, 1), (3, 1, 5), (4, 3, 2, 5), (1, 1, 1, 1)]:
        check(make("sum_to", (x,), shape=shape))
    for src, dst in [((), (3, 2)), ((5,), (4, 5)), ((1, 3, 1, 1), (2, 3, 4, 4))]:
        check(make("broadcast_to", (leaf("s", src),), shape=dst), exact=True)
    view = check(make("reshape", (x,), shape=(12, 10)), exact=True)
    assert view.base is not None                                    # a view, no copy
    check(make("const", (), value=-0.25, shape=(3, 4)), [], exact=True)


@covers("all_sum")
def test_all_sum_in_one_process_is_its_input():
    """(Over the ranks of a job: tests/test_data_parallel.py.) A tensor, and a number (an example count)."""
    check(make("all_sum", (leaf("x", (2, 3, 1, 1)),)), exact=True)
    out = np.full((), np.nan, np.float32)
    cpu.all_sum(784.0, out=out)
    assert out == 784.0


@covers("concat", "slice", "pad_axis")
def test_concat_slice_pad():
    parts = [leaf(f"p{i}", (2, c, 3, 3)) for i, c in enumerate((1, 4, 2))]
    check(make("concat", parts, axis=1), exact=True)
    x = leaf("x", (2, 7, 3))
    check(make("slice", (x,), axis=1, start=2, stop=6), exact=True)
    check(make("pad_axis", (x,), axis=2, start=1, size=6), exact=True)


@covers("matmul")
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_matmul(ta, tb, batch):
    a = leaf("a", batch + ((5, 3) if ta else (3, 5)))
    b = leaf("b", batch + ((4, 5) if tb else (5, 4)))
    check(make("matmul", (a, b), ta=ta, tb=tb))


@covers("transpose")
def test_transpose():
    x = leaf("x", (2, 3, 4, 5))
    for axes in [(0, 1), (1, 2), (2, 3), (0, 3), (1, 3)]:
        check(make("transpose", (x,), axes=axes), exact=True)


# ----------------------------------------------------------------------------------------------------------------
# elementwise kernels

v = [sym(i) for i in range(6)]
EXPRESSIONS = [
    sympy.Max(0, v[0]), v[0] * sympy.Heaviside(v[1], 0), 1 / (1 + sympy.exp(-v[0])), sympy.tanh(v[0] + v[1]),
    1 - v[0] ** 2, -v[0] * v[1] + v[2], v[0] * v[1] + v[2] + v[3] * v[4], 0.9 * v[0] + 0.1 * v[1] ** 2,
    v[0] - 2 * v[1] / v[2] * v[3] / (sympy.sqrt(v[4]) / sympy.sqrt(v[5]) + 1e-8), -v[0] / 500, -v[0] - v[1],
    sympy.Min(sympy.Max(v[0], 0), 6), v[0] * (v[1] - v[2]), sympy.log(v[0] * v[1]), 2 / v[0], v[0] ** 3,
    v[0] ** -0.5, sympy.Heaviside(v[0]), v[0] * v[1] / 0.8, sympy.Abs(v[0]) * sympy.exp(v[1]),
    sympy.Max(0, v[0] * v[1] * v[2] + v[3] + v[4]), v[0] * (1 + sympy.erf(v[0] * sympy.sqrt(2) / 2)) / 2,
    v[0] * sympy.exp(-v[1] ** 2 / 2) / sympy.sqrt(2 * sympy.pi) + v[1],
]


def kernel(expr, nargs, alias=None):
    """The numpy kernel function of an elementwise expression, as code generation writes it (with the runtime
    functions it calls imported)."""
    body = ufuncs.kernel_body(expr, alias)
    namespace = {"np": np}
    for line in ufuncs.runtime_imports([body]):
        exec(line, namespace)
    exec("def k(" + ", ".join(["out"] + [f"v{i}" for i in range(nargs)]) + "):\n    " + "\n    ".join(body), namespace)
    return namespace["k"]


@covers("ew")
@pytest.mark.parametrize("expr", EXPRESSIONS, ids=str)
def test_elementwise_kernels(expr):
    nargs = max(int(s.name[1:]) for s in expr.free_symbols) + 1
    rng = np.random.default_rng(4)
    shapes = [(3, 4)] * nargs
    if nargs > 1:
        shapes[1] = (4,)                                  # a broadcast operand (a bias)
    inputs = [leaf(f"a{i}", s) for i, s in enumerate(shapes)]
    arrays = [rng.uniform(0.2, 2.0, s).astype(np.float32) for s in shapes]
    node = make("ew", inputs, expr=expr)
    expected = get_op("ew").evaluate(EvalContext(np.float32), *arrays, expr=expr)
    without_alias = None
    for alias in [None] + [i for i, s in enumerate(shapes) if s == node.shape]:
        k = kernel(expr, nargs, alias)
        given = [a.copy() for a in arrays]
        out = given[alias] if alias is not None else np.full(node.shape, np.nan, np.float32)
        cpu.ew(k, out, *given)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, expected, rtol=RTOL, atol=1e-6)
        # written over any input, the same bits as into a buffer of its own (the in-place pass and a memory budget
        # choose which statements write over an input; that must not change the training)
        without_alias = out if alias is None else without_alias
        assert np.array_equal(out, without_alias), alias


@covers("ew_sum")
@pytest.mark.parametrize("limit", [UNLIMITED, 1])       # 1 byte: one sample per chunk
def test_sums_of_elementwise_kernels(limit):
    """Per-channel sums (batch norm's), to a scalar, over the batch axis, and a sum that keeps the batch axis (one
    chunk, the whole tensor), with a uint8 mask, a scalar and a per-channel operand; chunked under a NaN-filled
    workspace of the planned size."""
    x, m = leaf("x", (5, 3, 4, 2)), leaf("m", (1, 3, 1, 1))
    mask = leaf("k", (5, 3, 4, 2), UINT8)
    for inputs, expr, shape in [((x, m), (v[0] - v[1]) ** 2, (1, 3, 1, 1)), ((x, mask), v[0] * v[1] / 0.5, ()),
                                ((x, m), v[0] * v[1], (3, 1, 1)), ((x,), sympy.exp(v[0]), (5, 1, 1, 1)),
                                ((leaf("a", (6, 4)), leaf("b", (4,))), v[0] * v[1] + 1, (4,))]:
        check(make("ew_sum", inputs, expr=expr, shape=shape), limit=limit)


def test_mask_kernel_stays_float32():
    """A dropout product reads a uint8 mask: the result is float32, not promoted."""
    expr = v[0] * v[1] / 0.5
    k = kernel(expr, 2, None)
    x = np.ones((2, 3), np.float32)
    mask = np.array([[1, 0, 1], [0, 1, 1]], np.uint8)
    out = np.empty((2, 3), np.float32)
    cpu.ew(k, out, x, mask)
    np.testing.assert_array_equal(out, mask * 2.0)


# ----------------------------------------------------------------------------------------------------------------
# outputs over their inputs' bytes: in place (same shape) and taking over (per sample, from the same start)

def run_over(node, arrays, j, limit=UNLIMITED):
    """Run `node` with its output in the same bytes as input j (from their common start), as the memory plan places
    it, with the workspace the plan gives it (the op's rule plus, for an op taking over its input, one staged
    sample), poisoned with NaN like every byte of the shared region that input j does not cover."""
    x = node.inputs[j]
    region = np.full(max(x.nbytes, node.nbytes), 0xFF, np.uint8)
    source = region[:x.nbytes].view(np.float32).reshape(x.shape)
    source[...] = arrays[j]
    out = region[:node.nbytes].view(np.float32).reshape(node.shape)
    args = list(arrays)
    args[j] = source
    n = node.shape[0]
    floats = workspace_size(node, limit)
    if get_op(node.op).takes_over == j:
        floats += min(x.nbytes // n, node.nbytes // n) // 4
    kwargs = dict(node.kwargs)
    if floats:
        kwargs["workspace"] = np.full(floats, np.nan, np.float32)
    getattr(cpu, node.op)(*args, out=out, **kwargs)
    return out


def check_over(node, j=0, seed=0, limit=UNLIMITED):
    rng = np.random.default_rng(seed)
    arrays = [random_input(i, rng) for i in node.inputs]
    if node.op == "max_pool_bwd":                               # window positions
        arrays[1] = rng.integers(0, node.attr("kernel") ** 2, node.inputs[1].shape).astype(np.uint8)
    expected = get_op(node.op).evaluate(EvalContext(np.float32), *arrays, **node.kwargs)
    got = run_over(node, arrays, j, limit)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL * scale)


OVER_POOL = POOL + [
    (7, 3, 8, 8, 2, 2, 0, False),        # several geometric chunks each way
    (5, 4, 11, 11, 3, 2, 0, True),       # AlexNet's unpadded overlapping windows
    (1, 2, 4, 4, 2, 2, 0, False),        # one sample: staged alone
]


@pytest.mark.parametrize("case", OVER_POOL)
def test_pooling_takes_over_its_input(case):
    """Pooling writes its output over the start of its input (shrinking: samples forward), its backward over the start
    of its incoming gradient (growing: samples backward), a sample with no safe order staged in the workspace."""
    n, c, h, w, k, s, p, ceil = case
    x = leaf("x", (n, c, h, w))
    for op in ("max_pool", "avg_pool"):
        pooled = make(op, (x,), kernel=k, stride=s, pad=p, ceil=ceil)
        check_over(pooled)
        g = leaf("g", pooled.shape)
        inputs = (g, leaf("a", pooled.shape, UINT8)) if op == "max_pool" else (g,)
        check_over(make(f"{op}_bwd", inputs, kernel=k, stride=s, pad=p, ceil=ceil, size=(h, w)))


@pytest.mark.parametrize("case", CONV)
def test_convolution_input_gradient_takes_over_the_output_gradient(case, stride1_scheme):
    n, c, h, w, o, k, s, p, _ = case
    wt = leaf("w", (o, c, k, k))
    g = leaf("g", make("conv2d", (leaf("x", (n, c, h, w)), wt), stride=s, pad=p).shape)
    for limit in (UNLIMITED, 1):
        check_over(make("conv2d_bwd_data", (g, wt), stride=s, pad=p, size=(h, w)), limit=limit)


@pytest.mark.parametrize("case", GROUPED_CONV)
def test_grouped_convolution_input_gradient_takes_over_the_output_gradient(case):
    for limit in (UNLIMITED, 1):
        check_over(grouped_conv_nodes(case)[1], limit=limit)


def test_safe_chunks_never_overwrite_an_unread_sample():
    """Simulate the chunk order byte by byte: before a chunk runs, its output bytes hold no unread input sample, and
    every sample runs exactly once; the chunks grow geometrically (a handful of calls, not one per sample)."""
    for n in range(1, 40):
        for bi, bo in [(16, 4), (4, 16), (9, 9), (25, 9), (9, 25), (7, 6)]:
            unread = set(range(n))
            calls = 0
            for s, e, staged in safe_chunks(n, bi, bo):
                calls += 1
                # a chunk run in place writes while it reads its own samples; a staged sample is read (or computed
                # into scratch) before its output bytes are written
                at_risk = unread - {s} if staged else unread
                assert staged == (e == s + 1 and not (e * bo <= s * bi or s * bo >= e * bi))
                assert not any(s * bo < (m + 1) * bi and m * bi < e * bo for m in at_risk), (n, bi, bo, s, e)
                assert unread >= set(range(s, e))
                unread -= set(range(s, e))
            assert not unread
            if bi >= 2 * bo or bo >= 2 * bi:
                assert calls <= 2 * np.log2(n + 1) + 3


@pytest.mark.parametrize("shape", [(3, 7, 4, 5), (12, 6)])
def test_in_place_kernels_read_before_they_write(shape):
    """The ops the in-place pass may run over their first input (`Op.in_place`) give the same results with the
    output in the input's own buffer: LRN, its backward over the incoming gradient, softmax and log-softmax."""
    x, g = leaf("x", shape), leaf("g", shape)
    nodes = [make("lrn", (x,), size=5, alpha=1e-2, beta=0.75, k=1.0),
             make("lrn_bwd", (g, x), size=3, alpha=1e-2, beta=0.75, k=2.0)]
    if len(shape) == 2:
        nodes += [make("softmax", (x,)), make("log_softmax", (x,)), make("softmax", (x,), causal=True)]
    for node in nodes:
        assert get_op(node.op).in_place == (0,)
        check_over(node)


def test_every_op_is_covered():
    """A new op needs its runtime kernel and a case here."""
    lowered = set(all_ops()) - lowering.NOT_LOWERED
    assert lowered - COVERED == set()
    for op in lowered:
        assert callable(getattr(cpu, op, None)), f"deepdsl_runtime.cpu has no function '{op}'"


def test_erf_is_pythons_to_the_last_bits():
    """The runtime's erf (numpy has none): float64 within 4e-16 relative of Python's math.erf over the whole range
    (tiny, around every expansion centre, the tails, signed zeros, infinities, NaN), float32 correctly rounded, into
    `out` when given."""
    import math

    from deepdsl_runtime.cpu.elementwise import erf
    rng = np.random.default_rng(5)
    x = np.concatenate([np.linspace(-7, 7, 100_001), 3 * rng.standard_normal(10_000), 1e-9 * rng.standard_normal(100),
                        [0.0, 5.999, 6.0, 6.5, 30.0, 1e-300]])
    want = np.array([math.erf(v) for v in x])
    got = erf(x)
    assert got.dtype == np.float64
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-300)) <= 4e-16
    assert np.signbit(erf(np.float64(-0.0))) and erf(np.float64(-0.0)) == 0.0
    special = erf(np.array([np.inf, -np.inf, np.nan], np.float32))
    assert special[0] == 1 and special[1] == -1 and np.isnan(special[2]) and special.dtype == np.float32
    x32 = x.astype(np.float32)
    rounded = np.array([math.erf(float(v)) for v in x32]).astype(np.float32)
    out = np.empty_like(x32)
    assert erf(x32, out=out) is out and np.count_nonzero(out != rounded) <= 2         # ties apart


def test_idle_threads_sleep_keeps_what_the_user_set(monkeypatch):
    """Idle threads sleep after a short spin unless the environment says otherwise: a user's values win, and a
    user's OpenMP wait policy is not overridden by the spin count (GNU OpenMP would let it)."""
    import deepdsl_runtime

    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    deepdsl_runtime.idle_threads_sleep()
    assert {k: os.environ[k] for k in deepdsl_runtime.IDLE_THREADS_SLEEP} == deepdsl_runtime.IDLE_THREADS_SLEEP
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "9")
    deepdsl_runtime.idle_threads_sleep()
    assert os.environ["OMP_WAIT_POLICY"] == "active" and "GOMP_SPINCOUNT" not in os.environ
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == "9"
