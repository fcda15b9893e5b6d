"""Forward semantics of every op against PyTorch (float64), and the shape rules' rejections.

Each case builds a node from input leaves (through the DSL where a layer exists, so the DSL's parameter layouts are
checked too: conv weights (out, in, kh, kw), fully connected weights (out, in)), runs it in the reference
interpreter and compares with the PyTorch function of the same name.
"""
from __future__ import annotations

import numpy as np
import pytest
import sympy
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from deepdsl import dsl as D
from deepdsl.errors import ShapeError
from deepdsl.interpret import run_graph
from deepdsl.ir import FLOAT, INT32, Graph, make
from deepdsl.ops.elementwise import broadcast_to, elementwise, reshape, sum_to, sym
from deepdsl.ops.linalg import matmul
from deepdsl.ops.loss import cross_entropy, log_loss, nll
from deepdsl.ops.shape import concat, slice_axis
from tests.support.random_programs import conv_geometries, pool_geometries

# PyTorch's default dtype float64 for this file's tests only (conftest's fixture: a setting made at import would
# reach the other files' tests, every worker collecting every file)
pytestmark = pytest.mark.usefixtures("torch_float64")


def leaf(name, shape, dtype=FLOAT):
    return make("input", (), name=name, shape=tuple(shape), dtype=dtype, role="label" if dtype == INT32 else "data")


def evaluate(node, feeds):
    return run_graph(Graph("forward", (("out", node),)), feeds, float_dtype=np.float64)["out"]


def t(a):
    return torch.from_numpy(np.asarray(a))


def assert_same(ours, theirs, rtol=1e-12):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert ours.dtype == np.float64
    err = np.linalg.norm(ours - theirs)
    assert err <= rtol * max(np.linalg.norm(theirs), 1e-300) + 1e-300, f"relative error {err / np.linalg.norm(theirs)}"


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# ----------------------------------------------------------------------------------------------------------------
# convolution and fully connected layers (through the DSL: PyTorch's weight layouts)

@pytest.mark.parametrize("stride,padding,bias", [(1, 0, True), (1, 1, False), (2, 1, True), (2, 0, False),
                                                 (3, 2, True)])
def test_dsl_conv_is_torch_conv2d(stride, padding, bias):
    x = randn(2, 3, 7, 6)
    layer = D.conv("cv", 3, 4, stride=stride, padding=padding, bias=bias)
    node = layer(D.Tensor(leaf("x", x.shape))).node
    w, b = randn(4, 3, 3, 3, seed=1), randn(4, seed=2)
    feeds = {"x": x, "cv_W": w} | ({"cv_B": b} if bias else {})
    expected = F.conv2d(t(x), t(w), t(b) if bias else None, stride=stride, padding=padding)
    assert_same(evaluate(node, feeds), expected)


@settings(max_examples=40, deadline=None)
@given(geometry=conv_geometries(), bias=st.booleans(), seed=st.integers(0, 99))
def test_conv2d_geometries(geometry, bias, seed):
    h, w, kh, kw, stride, pad = geometry.values()
    x, wt, b = randn(2, 2, h, w, seed=seed), randn(3, 2, kh, kw, seed=seed + 1), randn(3, seed=seed + 2)
    inputs = [leaf("x", x.shape), leaf("w", wt.shape)] + ([leaf("b", b.shape)] if bias else [])
    node = make("conv2d", inputs, stride=stride, pad=pad)
    expected = F.conv2d(t(x), t(wt), t(b) if bias else None, stride=stride, padding=pad)
    assert_same(evaluate(node, {"x": x, "w": wt, "b": b}), expected)


@pytest.mark.parametrize("bias", [True, False])
def test_dsl_full_is_torch_linear(bias):
    x, w, b = randn(3, 5), randn(4, 5, seed=1), randn(4, seed=2)
    node = D.full("fc", 4, bias=bias)(D.Tensor(leaf("x", x.shape))).node
    feeds = {"x": x, "fc_W": w} | ({"fc_B": b} if bias else {})
    assert_same(evaluate(node, feeds), F.linear(t(x), t(w), t(b) if bias else None))


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_transposes(ta, tb):
    a, b = randn(*((4, 3) if ta else (3, 4))), randn(*((5, 4) if tb else (4, 5)), seed=1)
    node = matmul(leaf("a", a.shape), leaf("b", b.shape), ta=ta, tb=tb)
    assert node.shape == (3, 5)
    expected = (t(a).T if ta else t(a)) @ (t(b).T if tb else t(b))
    assert_same(evaluate(node, {"a": a, "b": b}), expected)


# ----------------------------------------------------------------------------------------------------------------
# pooling

def distinct(shape, seed=0):
    """Values without ties (so a window's maximum is unique), spaced 0.01 apart."""
    n = int(np.prod(shape))
    return np.random.default_rng(seed).permutation(n).reshape(shape) * 0.01 - n * 0.005


@settings(max_examples=60, deadline=None)
@given(geometry=pool_geometries(), seed=st.integers(0, 99))
# ceil mode whose last window would start in the padding (PyTorch drops it)
@example(geometry=dict(h=5, w=6, kernel=2, stride=2, pad=1, ceil=True), seed=0)
def test_max_pool_geometries(geometry, seed):
    h, w, kernel, stride, pad, ceil = geometry.values()
    x = distinct((2, 2, h, w), seed)
    node = make("max_pool", (leaf("x", x.shape),), kernel=kernel, stride=stride, pad=pad, ceil=ceil)
    expected = F.max_pool2d(t(x), kernel, stride, pad, ceil_mode=ceil)
    assert_same(evaluate(node, {"x": x}), expected)


@settings(max_examples=60, deadline=None)
@given(geometry=pool_geometries(), include_pad=st.booleans(), seed=st.integers(0, 99))
@example(geometry=dict(h=5, w=6, kernel=2, stride=2, pad=1, ceil=True), include_pad=True, seed=0)
@example(geometry=dict(h=6, w=4, kernel=3, stride=2, pad=1, ceil=True), include_pad=True, seed=0)
@example(geometry=dict(h=6, w=4, kernel=3, stride=2, pad=1, ceil=True), include_pad=False, seed=0)
def test_avg_pool_geometries(geometry, include_pad, seed):
    h, w, kernel, stride, pad, ceil = geometry.values()
    x = randn(2, 2, h, w, seed=seed)
    node = make("avg_pool", (leaf("x", x.shape),), kernel=kernel, stride=stride, pad=pad, ceil=ceil,
                include_pad=include_pad)
    expected = F.avg_pool2d(t(x), kernel, stride, pad, ceil_mode=ceil, count_include_pad=include_pad)
    assert_same(evaluate(node, {"x": x}), expected)


def test_dsl_pools():
    x = distinct((2, 3, 7, 7))
    xn = D.Tensor(leaf("x", x.shape))
    assert_same(evaluate(D.max_pool(3, 2, ceil=True)(xn).node, {"x": x}), F.max_pool2d(t(x), 3, 2, ceil_mode=True))
    assert_same(evaluate(D.max_pool(2)(xn).node, {"x": x}), F.max_pool2d(t(x), 2))
    assert_same(evaluate(D.avg_pool(3, 2, padding=1, include_pad=False)(xn).node, {"x": x}),
                F.avg_pool2d(t(x), 3, 2, 1, count_include_pad=False))
    assert_same(evaluate(D.avg_pool()(xn).node, {"x": x}), F.adaptive_avg_pool2d(t(x), 1))


# ----------------------------------------------------------------------------------------------------------------
# normalization

@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_lrn_is_torch_local_response_norm(size):
    x = randn(2, 6, 3, 4)
    alpha, beta, k = 0.3, 0.75, 2.0
    node = D.lrn(size, alpha, beta, k)(D.Tensor(leaf("x", x.shape))).node
    assert_same(evaluate(node, {"x": x}), F.local_response_norm(t(x), size, alpha, beta, k))


@pytest.mark.parametrize("size", [2, 3])
def test_lrn_on_2d_input(size):
    x = randn(3, 5)
    node = make("lrn", (leaf("x", x.shape),), size=size, alpha=0.5, beta=0.75, k=1.0)
    expected = F.local_response_norm(t(x)[:, :, None], size, 0.5, 0.75, 1.0)[:, :, 0]
    assert_same(evaluate(node, {"x": x}), expected)


# ----------------------------------------------------------------------------------------------------------------
# elementwise

SWISH = "v / (1 + exp(-v))"

ACTIVATIONS = {
    "relu": (D.relu, torch.relu),
    "tanh": (D.tanh, torch.tanh),
    "sigmoid": (D.sigmoid, torch.sigmoid),
    "clipped_relu": (D.clipped_relu(1.5), lambda x: F.hardtanh(x, 0.0, 1.5)),
    "swish": (D.elementwise("swish", SWISH), lambda x: x * torch.sigmoid(x)),
    "softplus": (D.elementwise("softplus", lambda v: sympy.log(1 + sympy.exp(v))), F.softplus),
    "gelu_exact": (D.elementwise("gelu", "v * (1 + erf(v / sqrt(2))) / 2"), F.gelu),
    "mish": (D.elementwise("mish", "v * tanh(softplus(v))"), F.mish),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations(name):
    layer, reference = ACTIVATIONS[name]
    x = randn(3, 4, 2) * 2
    node = layer(D.Tensor(leaf("x", x.shape))).node
    assert node.op == "ew"
    assert_same(evaluate(node, {"x": x}), reference(t(x)))


def test_tensor_arithmetic():
    a, b = randn(3, 4), randn(3, 4, seed=1)
    ta, tb = D.Tensor(leaf("a", a.shape)), D.Tensor(leaf("b", b.shape))
    node = (ta + 0.3 * tb - ta / (tb * tb + 1) + 2).node
    expected = t(a) + 0.3 * t(b) - t(a) / (t(b) * t(b) + 1) + 2
    assert_same(evaluate(node, {"a": a, "b": b}), expected)


def test_elementwise_broadcasting():
    a, b, c = randn(2, 3, 1), randn(3, 4, seed=1), randn(4, seed=2)
    v0, v1, v2 = sym(0), sym(1), sym(2)
    node = elementwise(v0 * sympy.sin(v1) + v2 ** 2 * v0, [leaf("a", a.shape), leaf("b", b.shape),
                                                           leaf("c", c.shape)])
    assert node.shape == (2, 3, 4)
    expected = t(a) * torch.sin(t(b)) + t(c) ** 2 * t(a)
    assert_same(evaluate(node, {"a": a, "b": b, "c": c}), expected)


def test_sum_to_broadcast_to_reshape():
    x = randn(2, 3, 4)
    xn = leaf("x", x.shape)
    for shape in [(3, 1), (1, 3, 4), (4,), (2, 1, 1), ()]:
        assert_same(evaluate(sum_to(xn, shape), {"x": x}), t(x).sum_to_size(shape) if shape else t(x).sum())
    y = randn(3, 1)
    assert_same(evaluate(broadcast_to(leaf("y", y.shape), (2, 3, 4)), {"y": y}), t(y).expand(2, 3, 4))
    assert_same(evaluate(reshape(xn, (6, 4)), {"x": x}), t(x).reshape(6, 4))
    assert_same(evaluate(D.flatten(D.Tensor(xn)).node, {"x": x}), t(x).flatten(1))


# ----------------------------------------------------------------------------------------------------------------
# joining and splitting

def test_concat_slice_pad_axis():
    a, b = randn(2, 3, 4, 4), randn(2, 5, 4, 4, seed=1)
    an, bn = leaf("a", a.shape), leaf("b", b.shape)
    assert_same(evaluate(D.concat(D.Tensor(an), D.Tensor(bn)).node, {"a": a, "b": b}), torch.cat([t(a), t(b)], 1))
    c = randn(2, 3, 2, 4, seed=2)
    assert_same(evaluate(concat([an, leaf("c", c.shape)], axis=2), {"a": a, "c": c}), torch.cat([t(a), t(c)], 2))
    assert_same(evaluate(slice_axis(bn, 1, 1, 4), {"b": b}), t(b).narrow(1, 1, 3))
    assert_same(evaluate(slice_axis(bn, 3, 0, 1), {"b": b}), t(b)[..., :1])
    padded = make("pad_axis", (an,), axis=1, start=2, size=7)
    assert_same(evaluate(padded, {"a": a}), F.pad(t(a), (0, 0, 0, 0, 2, 2)))


# ----------------------------------------------------------------------------------------------------------------
# softmax, losses, label-indexed ops, precision

def test_softmax_and_log_softmax():
    x = randn(4, 6) * 3
    xn = D.Tensor(leaf("x", x.shape))
    assert_same(evaluate(D.softmax(xn).node, {"x": x}), F.softmax(t(x), 1))
    assert_same(evaluate(D.log_softmax(xn).node, {"x": x}), F.log_softmax(t(x), 1))
    big = x + 800.0     # stable for large scores
    assert_same(evaluate(D.log_softmax(xn).node, {"x": big}), F.log_softmax(t(big), 1))


def test_pick_unpick_precision():
    x, labels = randn(5, 4), np.array([0, 3, 1, 3, 2], dtype=np.int32)
    xn, yn = leaf("x", x.shape), leaf("y", labels.shape, INT32)
    tl = torch.from_numpy(labels.astype(np.int64))
    assert_same(evaluate(make("pick", (xn, yn)), {"x": x, "y": labels}), t(x).gather(1, tl[:, None])[:, 0])
    g = randn(5, seed=1)
    unpicked = make("unpick", (leaf("g", g.shape), yn), classes=4)
    expected = torch.zeros(5, 4).scatter(1, tl[:, None], t(g)[:, None])
    assert_same(evaluate(unpicked, {"g": g, "y": labels}), expected)
    labels[:3] = x[:3].argmax(1)     # three rows right; the other two wrong
    labels[3:] = (x[3:].argmax(1) + 1) % 4
    expected = (t(x).argmax(1) == torch.from_numpy(labels.astype(np.int64))).double().mean()
    assert float(expected) == 0.6
    assert_same(evaluate(make("precision", (xn, yn)), {"x": x, "y": labels}), expected)


def test_label_rank_is_the_labels_place_in_torch_topk():
    """Each row's label rank: below k exactly where the label is among torch.topk's k best (no ties), 0 exactly
    where precision counts the row; ties go to the lower column, as argmax's first maximum."""
    x, labels = randn(50, 7), np.random.default_rng(3).integers(0, 7, 50).astype(np.int32)
    xn, yn = leaf("x", x.shape), leaf("y", labels.shape, INT32)
    ranks = evaluate(make("label_rank", (xn, yn)), {"x": x, "y": labels})
    tl = torch.from_numpy(labels.astype(np.int64))
    for k in range(1, 8):
        among = (torch.topk(t(x), k, dim=1).indices == tl[:, None]).any(dim=1).numpy()
        assert np.array_equal(ranks < k, among), k
    assert np.array_equal(ranks == 0, x.argmax(1) == labels)
    tied = np.array([[1.0, 3.0, 3.0, 0.0]] * 4)
    got = evaluate(make("label_rank", (leaf("t", tied.shape), leaf("l", (4,), INT32))),
                   {"t": tied, "l": np.array([1, 2, 0, 3], np.int32)})
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_losses():
    x, labels = randn(5, 4), np.array([0, 3, 1, 3, 2], dtype=np.int32)
    xn, yn = leaf("x", x.shape), leaf("y", labels.shape, INT32)
    feeds = {"x": x, "y": labels}
    tl = torch.from_numpy(labels.astype(np.int64))
    assert_same(evaluate(cross_entropy(xn, yn), feeds), F.cross_entropy(t(x), tl))
    assert_same(evaluate(nll(make("log_softmax", (xn,)), yn), feeds), F.nll_loss(F.log_softmax(t(x), 1), tl))
    assert_same(evaluate(log_loss(make("softmax", (xn,)), yn), feeds), F.nll_loss(torch.log(F.softmax(t(x), 1)), tl))
    y = D.labels("y", 5, 4)
    assert_same(evaluate(D.nll_loss(y)(D.Tensor(xn)).node, feeds), F.nll_loss(t(x), tl))


# ----------------------------------------------------------------------------------------------------------------
# shape rules

def shape_error(build):
    with pytest.raises(ShapeError):
        build()


def test_shape_errors():
    x = leaf("x", (2, 3, 5, 5))
    shape_error(lambda: make("conv2d", (x, leaf("w", (4, 3, 6, 6))), stride=1, pad=0))       # kernel > input
    make("conv2d", (x, leaf("w", (4, 3, 6, 6))), stride=1, pad=1)                             # fits with padding
    shape_error(lambda: make("conv2d", (x, leaf("w", (4, 2, 3, 3))), stride=1, pad=0))       # channel mismatch
    shape_error(lambda: make("conv2d", (x, leaf("w", (4, 3, 3, 3)), leaf("b", (3,))), stride=1, pad=0))
    shape_error(lambda: make("conv2d", (leaf("x3", (3, 5, 5)), leaf("w", (4, 3, 3, 3))), stride=1, pad=0))
    shape_error(lambda: make("conv2d", (x, leaf("w3", (4, 3, 3))), stride=1, pad=0))         # weights not 4-D
    shape_error(lambda: make("max_pool", (x,), kernel=6, stride=1, pad=0, ceil=False))       # window > input
    shape_error(lambda: make("max_pool", (x,), kernel=2, stride=0, pad=0, ceil=False))
    shape_error(lambda: make("max_pool", (leaf("x2", (2, 3)),), kernel=1, stride=1, pad=0, ceil=False))
    shape_error(lambda: make("avg_pool", (x,), kernel=6, stride=1, pad=0, ceil=False, include_pad=True))
    shape_error(lambda: make("max_pool", (x,), kernel=3, stride=1, pad=2, ceil=False))       # pad > kernel / 2
    shape_error(lambda: concat([x, leaf("z", (2, 3, 4, 5))], axis=1))                        # spatial sizes differ
    shape_error(lambda: concat([x, leaf("z", (2, 3, 5))], axis=1))                           # ranks differ
    shape_error(lambda: matmul(leaf("a", (3, 4)), leaf("b", (5, 6))))                        # inner mismatch
    shape_error(lambda: matmul(leaf("a", (3, 4)), leaf("b", (5, 4)), ta=True, tb=True))
    shape_error(lambda: elementwise(sym(0) + sym(1), [leaf("a", (3, 4)), leaf("b", (3,))]))  # no broadcast
    shape_error(lambda: elementwise(sym(0) * sym(1), [leaf("a", (2, 3)), leaf("b", (3, 2))]))
    shape_error(lambda: sum_to(leaf("a", (3, 4)), (3,)))
    shape_error(lambda: broadcast_to(leaf("a", (3, 4)), (4, 4)))
    shape_error(lambda: reshape(leaf("a", (3, 4)), (5, 2)))
    shape_error(lambda: slice_axis(leaf("a", (3, 4)), 1, 2, 5))
    shape_error(lambda: make("softmax", (x,)))
    shape_error(lambda: make("pick", (leaf("s", (4, 3)), leaf("y", (5,), INT32))))
    shape_error(lambda: make("pick", (leaf("s", (4, 3)), leaf("s4", (4,)))))                # float labels
    shape_error(lambda: make("lrn", (leaf("x3", (3, 5, 5)),), size=3, alpha=1.0, beta=0.75, k=1.0))


def test_dsl_shape_errors_name_the_layer():
    x = D.Tensor(leaf("x", (2, 3, 5, 5)))
    with pytest.raises(ShapeError, match="cv"):
        D.conv("cv", 7, 4)(x)
    with pytest.raises(ShapeError):
        D.concat(x, D.Tensor(leaf("z", (2, 3, 4, 4))))
    with pytest.raises(ShapeError):
        D.full("fc", 3)(x)
    with pytest.raises(ShapeError):
        D.add(x, D.Tensor(leaf("z", (2, 3, 4, 4))))
