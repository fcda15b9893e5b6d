"""Every differentiable op's VJP rule against PyTorch autograd and central finite differences (float64).

For an op application `out = op(inputs)` a case builds `loss = sum(out * R)` for a fixed random R, derives the input
gradients with `deepdsl.autodiff.gradients`, runs forward and backward in the reference interpreter and checks
  * the output against the PyTorch function,
  * each input gradient against torch.autograd (relative error <= 1e-6),
  * each input gradient against central differences of the interpreted loss (all entries of small inputs, random
    directions of larger ones; relative error <= 1e-6).
Inputs of non-smooth ops (ReLU, clipping, max pooling) stay away from their kinks so that differences are exact;
the kinks themselves are checked against autograd alone. The cases form one table, `CASES`; the registry test
builds every case's graph and fails when an op of `deepdsl.ops.all_ops()` appears in none of them and is not listed
in `NOT_DIFFERENTIATED`, so a new op cannot arrive without a gradient test.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import sympy
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from deepdsl import dsl as D
from deepdsl.autodiff import gradients
from deepdsl.interpret import run, run_graph
from deepdsl.ir import FLOAT, INT32, Graph, Node, make, toposort
from deepdsl.ops import all_ops, get_op
from deepdsl.ops.elementwise import broadcast_to, elementwise, reshape, sum_to, sym
from deepdsl.ops.linalg import matmul
from deepdsl.ops.loss import cross_entropy, log_loss, nll
from deepdsl.ops.norm import bernoulli_mask
from deepdsl.ops.shape import concat, slice_axis, transpose
from deepdsl.passes.linearize import linearize
from deepdsl.passes.specialize import specialize
from tests.support.random_programs import conv_geometries, pool_geometries

# PyTorch's default dtype float64 for this file's tests only (conftest's fixture: a setting made at import would
# reach the other files' tests, every worker collecting every file)
pytestmark = pytest.mark.usefixtures("torch_float64")

RTOL = 1e-6            # gradients vs autograd and vs finite differences
FD_STEP = 1e-6         # central differences: O(h^2) truncation and O(eps / h) rounding, both far below RTOL
FD_ALL_ENTRIES = 40    # inputs up to this size are differenced entry by entry, larger ones along random directions
FD_DIRECTIONS = 6


# ----------------------------------------------------------------------------------------------------------------
# the harness

def leaf(name, shape, dtype=FLOAT) -> Node:
    return make("input", (), name=name, shape=tuple(shape), dtype=dtype, role="label" if dtype == INT32 else "data")


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    scale, diff = np.linalg.norm(theirs), np.linalg.norm(ours - theirs)
    return diff / scale if scale > 0 else diff


def assert_close(ours, theirs, what: str, rtol: float = RTOL):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} vs {theirs.shape}"
    err = relative_error(ours, theirs)
    assert err <= rtol, f"{what}: relative error {err:.3g}"


def ops_in(*nodes: Node) -> set[str]:
    return {n.op for n in toposort(nodes)}


def build_case(build: Callable, arrays: dict, labels: dict) -> tuple[dict[str, Node], Node, dict[str, Node]]:
    """The input leaves, the output node and the extra outputs of `build` applied to leaves for the inputs."""
    nodes = {k: leaf(k, a.shape) for k, a in arrays.items()}
    built = build(*nodes.values(), *(leaf(k, a.shape, INT32) for k, a in labels.items()))
    out, extra = built if isinstance(built, tuple) else (built, {})
    return nodes, out, extra


def check_vjp(build: Callable, reference: Callable, arrays: dict[str, np.ndarray],
              labels: dict[str, np.ndarray] | None = None, fixed: dict[str, np.ndarray] | None = None,
              seed: int = 0, fd: bool = True) -> dict[str, np.ndarray]:
    """Check `build(*leaves)` against `reference(*torch tensors)` forward, by autograd and by finite differences.

    Both receive the inputs in order: `arrays`, then `labels`. `arrays` are the differentiated inputs (float leaves;
    a DSL layer makes its own parameter leaves, named as the layer names them, and when the graph holds a leaf of an
    input's name that is the one differentiated), `labels` int32 inputs, `fixed` other leaves the graph reads (fed
    by name, not differentiated). `build` returns the output node, or (node, {name: node}) with extra outputs to
    evaluate. Returns the interpreted values: `out`, `loss`, `d_<name>` and the extra outputs.
    """
    labels, fixed = labels or {}, fixed or {}
    nodes, out, extra = build_case(build, arrays, labels)
    in_graph = {n.name: n for n in toposort([out]) if n.is_leaf}
    wrt = {k: in_graph.get(k, node) for k, node in nodes.items()}
    r = np.random.default_rng(seed + 1000).standard_normal(out.shape)
    loss = sum_to(elementwise(sym(0) * sym(1), [out, leaf("R", out.shape)]), ())
    grads = gradients(loss, list(wrt.values()))
    feeds = {**arrays, **labels, **fixed, "R": r}
    results = run_graph(Graph("vjp", (("out", out), ("loss", loss))
                              + tuple((f"d_{k}", grads[n]) for k, n in wrt.items()) + tuple(extra.items())),
                        feeds, float_dtype=np.float64)

    tensors = {k: torch.tensor(a, requires_grad=True) for k, a in arrays.items()}
    expected = reference(*tensors.values(), *(torch.from_numpy(a.astype(np.int64)) for a in labels.values()))
    assert_close(results["out"], expected, "forward")
    (expected * torch.from_numpy(r)).sum().backward()
    for k, tensor in tensors.items():
        torch_grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
        assert_close(results[f"d_{k}"], torch_grad, f"d_{k} vs autograd")
    if not fd:
        return results

    program = linearize(Graph("loss", (("loss", loss),)))

    def f(name, value):
        return float(run(program, {**feeds, name: value}, float_dtype=np.float64)["loss"])

    rng = np.random.default_rng(seed + 2000)
    for k, a in arrays.items():
        if a.size <= FD_ALL_ENTRIES:
            directions = np.eye(a.size).reshape(a.size, *a.shape)
        else:
            directions = rng.standard_normal((FD_DIRECTIONS, *a.shape))
        fd_values = np.array([(f(k, a + FD_STEP * d) - f(k, a - FD_STEP * d)) / (2 * FD_STEP) for d in directions])
        analytic = np.array([np.sum(results[f"d_{k}"] * d) for d in directions])
        assert_close(analytic, fd_values, f"d_{k} vs finite differences")
    return results


def randn(*shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


def away_from(x: np.ndarray, points, margin=0.05) -> np.ndarray:
    """x with every entry at least `margin` from the kinks `points` (differences must not straddle a kink)."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < margin
        x[near] = p + np.where(x[near] >= p, 2 * margin, -2 * margin)
    return x


def distinct(shape, seed=0):
    """Values without ties, spaced 0.01 apart: every pooling window has a unique maximum."""
    n = int(np.prod(shape))
    return np.random.default_rng(seed).permutation(n).reshape(shape) * 0.01 - n * 0.005


# ----------------------------------------------------------------------------------------------------------------
# the table of cases

@dataclass
class Case:
    build: Callable                     # leaves -> node, or (node, {name: extra output})
    reference: Callable                 # torch tensors -> tensor
    arrays: dict[str, np.ndarray]       # differentiated inputs
    labels: dict[str, np.ndarray] = field(default_factory=dict)
    fixed: dict[str, np.ndarray] = field(default_factory=dict)
    after: Callable | None = None       # more assertions on the interpreted results
    mode_ops: tuple[str, ...] = ()      # ops of the graph before `specialize` rewrote them
    fd: bool = True                     # also against finite differences (not for a derivative the user chose)


CASES: dict[str, Case] = {}


def case(name: str, build, reference, arrays, **kwargs):
    assert name not in CASES, name
    CASES[name] = Case(build, reference, arrays, **kwargs)


def dsl(layer):
    return lambda x: layer(D.Tensor(x)).node


# elementwise: activations (the built-in ones differentiate through `out_grad`, a function of the output),
# user-defined functions through sympy, arithmetic with broadcasting
UNARY = {
    # name: (graph builder, torch function, kinks to avoid)
    "relu": (dsl(D.relu), torch.relu, [0.0]),
    "tanh": (dsl(D.tanh), torch.tanh, []),
    "sigmoid": (dsl(D.sigmoid), torch.sigmoid, []),
    "clipped_relu": (dsl(D.clipped_relu(0.8)), lambda x: F.hardtanh(x, 0.0, 0.8), [0.0, 0.8]),
    "swish": (dsl(D.elementwise("swish", "v / (1 + exp(-v))")), lambda x: x * torch.sigmoid(x), []),
    "relu_by_sympy": (lambda x: elementwise(sympy.Max(sym(0), 0), [x]), torch.relu, [0.0]),
    "clipped_by_sympy": (lambda x: elementwise(sympy.Min(sympy.Max(sym(0), 0), sympy.Float(0.8)), [x]),
                         lambda x: F.hardtanh(x, 0.0, 0.8), [0.0, 0.8]),
    "abs": (dsl(D.elementwise("abs", "Abs(v)")), torch.abs, [0.0]),
    "softplus": (dsl(D.elementwise("softplus", lambda v: sympy.log(1 + sympy.exp(v)))), F.softplus, []),
    "square_sin": (lambda x: elementwise(sym(0) ** 2 * sympy.sin(sym(0)), [x]), lambda x: x ** 2 * torch.sin(x), []),
    "gelu_exact": (dsl(D.elementwise("gelu", "v * (1 + erf(v / sqrt(2))) / 2")), F.gelu, []),
    "mish": (dsl(D.elementwise("mish", "v * tanh(log(1 + exp(v)))")), F.mish, []),
    "mish_named": (dsl(D.elementwise("mish", "v * tanh(softplus(v))")), F.mish, []),
    "sigmoid_named": (dsl(D.elementwise("sig", "sigmoid(2 * v)")), lambda x: torch.sigmoid(2 * x), []),
    "sign_square": (dsl(D.elementwise("sign_square", "sign(v) * v**2 + Heaviside(v)")),
                    lambda x: torch.sign(x) * x ** 2 + torch.heaviside(x.detach(), torch.zeros_like(x)), [0.0]),
    # written piecewise, or through functions deepdsl computes by others (ELEMENTWISE_REWRITTEN)
    "elu": (dsl(D.elementwise("elu", "Piecewise((v, v > 0), (exp(v) - 1, True))")), F.elu, [0.0]),
    "selu": (dsl(D.elementwise("selu", "1.0507009873554805 * Piecewise((v, v > 0), "
                                       "(1.6732632423543772 * (exp(v) - 1), True))")), torch.selu, [0.0]),
    "hardswish": (dsl(D.elementwise("hardswish", "Piecewise((0, v <= -3), (v, v >= 3), (v * (v + 3) / 6, True))")),
                  F.hardswish, [-3.0, 3.0]),
    "hardsigmoid": (dsl(D.elementwise("hardsigmoid", "Piecewise((0, v <= -3), (1, v >= 3), (v / 6 + 1/2, True))")),
                    F.hardsigmoid, [-3.0, 3.0]),
    "erfc": (dsl(D.elementwise("erfc", "erfc(v)")), torch.erfc, []),
    "asinh": (dsl(D.elementwise("asinh", "asinh(3 * v)")), lambda x: torch.asinh(3 * x), [0.0]),
}
for _name, (_build, _reference, _kinks) in UNARY.items():
    _scale = 3.0 if _name in ("hardswish", "hardsigmoid") else 1.5      # values on every piece
    case(f"ew_{_name}", _build, _reference, {"x": away_from(randn(3, 5, scale=_scale), _kinks)})

case("ew_broadcast", lambda a, b, c: elementwise(sym(0) * sympy.sin(sym(1)) + sym(0) * sym(1) / sym(2)
                                                 + sympy.exp(sym(2)) * sym(1), [a, b, c]),
     lambda a, b, c: a * torch.sin(b) + a * b / c + torch.exp(c) * b,
     {"a": randn(2, 3, 1), "b": randn(3, 4, seed=1), "c": away_from(randn(4, seed=2), [0.0], 0.3)})
case("ew_repeated_input_and_scalar", lambda a, s: elementwise(sym(0) * sym(1) + sym(2) ** 3, [a, s, a]),
     lambda a, s: a * s + a ** 3, {"a": randn(3, 4), "s": np.asarray(0.7)})
case("ew_tensor_arithmetic",
     lambda a, b: ((D.Tensor(a) - 0.5 * D.Tensor(b)) / D.Tensor(b) + 2 * -D.Tensor(a)).node,
     lambda a, b: (a - 0.5 * b) / b + 2 * -a, {"a": randn(3, 4), "b": away_from(randn(3, 4, seed=1), [0.0], 0.3)})
case("dsl_add", lambda a, b, c: D.add(D.Tensor(a), D.Tensor(b), D.Tensor(c)).node, lambda a, b, c: a + b + c,
     {"a": randn(2, 3), "b": randn(2, 3, seed=1), "c": randn(2, 3, seed=2)})

# sums of elementwise expressions (what the fuse_reductions pass makes of batch norm's statistics)
case("ew_sum_per_channel", lambda a, m: make("ew_sum", (a, m), expr=(sym(0) - sym(1)) ** 2, shape=(1, 3, 1, 1)),
     lambda a, m: ((a - m) ** 2).sum(dim=(0, 2, 3), keepdim=True),
     {"a": randn(2, 3, 4, 5), "m": randn(1, 3, 1, 1, seed=1)})
case("ew_sum_to_scalar", lambda a, b: make("ew_sum", (a, b), expr=sym(0) * sympy.exp(sym(1)), shape=()),
     lambda a, b: (a * torch.exp(b)).sum(), {"a": randn(3, 4), "b": randn(4, seed=1)})

# tensor arithmetic with broadcasting, reductions over axes, layer norm, zero channels (squeeze-and-excitation,
# Transformers, ResNet's option-A shortcuts)
case("dsl_se_gate", lambda x, g: (D.Tensor(x) * D.sigmoid(D.Tensor(g)).reshape(2, 3, 1, 1)).node,
     lambda x, g: x * torch.sigmoid(g).reshape(2, 3, 1, 1), {"x": randn(2, 3, 4, 5), "g": randn(2, 3, seed=1)})
case("dsl_sum_mean_axes", lambda x: (D.Tensor(x).sum((1, -2)) + D.Tensor(x).mean(2, keepdims=True).reshape(2, 3, 5)
                                      .mean(1) ** 2 * 0.5).node,
     lambda x: x.sum((1, 2)) + x.mean(2, keepdim=True).reshape(2, 3, 5).mean(1) ** 2 * 0.5, {"x": randn(2, 3, 4, 5)})
case("dsl_layer_norm", lambda x, ln_W, ln_B: D.layer_norm("ln", axes=2)(D.Tensor(x)).node,
     lambda x, w, b: F.layer_norm(x, (4, 5), w, b, eps=1e-5),
     {"x": randn(2, 3, 4, 5, scale=2.0), "ln_W": randn(4, 5, seed=1), "ln_B": randn(4, 5, seed=2)})
case("dsl_layer_norm_plain", lambda x: D.layer_norm("lnp", eps=1e-3, affine=False)(D.Tensor(x)).node,
     lambda x: F.layer_norm(x, (6,), eps=1e-3), {"x": randn(5, 6)})
case("dsl_pad_channels", dsl(D.pad_channels(2, 1)), lambda x: F.pad(x, (0, 0, 0, 0, 2, 1)), {"x": randn(2, 3, 4, 4)})

case("dsl_grouped_conv", lambda x, gc_W, gc_B: D.conv("gc", 3, 6, padding=1, groups=2)(D.Tensor(x)).node,
     lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=2),
     {"x": randn(2, 4, 5, 5), "gc_W": randn(6, 2, 3, 3, seed=1), "gc_B": randn(6, seed=2)})
case("dsl_depthwise_conv", lambda x, dw_W: D.conv("dw", 3, 3, stride=2, bias=False, groups=3)(D.Tensor(x)).node,
     lambda x, w: F.conv2d(x, w, stride=2, groups=3), {"x": randn(2, 3, 7, 6), "dw_W": randn(3, 1, 3, 3, seed=1)})

case("dsl_conv_rectangular", lambda x, rc_W, rc_B: D.conv("rc", (1, 3), 4, padding=(0, 1))(D.Tensor(x)).node,
     lambda x, w, b: F.conv2d(x, w, b, padding=(0, 1)),
     {"x": randn(2, 3, 5, 6), "rc_W": randn(4, 3, 1, 3, seed=1), "rc_B": randn(4, seed=2)})
case("dsl_conv_dilated", lambda x, dc_W: D.conv("dc", 3, 4, padding=2, dilation=2, bias=False)(D.Tensor(x)).node,
     lambda x, w: F.conv2d(x, w, padding=2, dilation=2), {"x": randn(2, 3, 7, 6), "dc_W": randn(4, 3, 3, 3, seed=1)})
case("dsl_conv_dilated_grouped", lambda x, dg_W: D.conv("dg", (3, 2), 4, stride=(2, 2), padding=(2, 1), dilation=(2, 3),
                                                        groups=2, bias=False)(D.Tensor(x)).node,
     lambda x, w: F.conv2d(x, w, stride=2, padding=(2, 1), dilation=(2, 3), groups=2),
     {"x": randn(2, 4, 9, 8), "dg_W": randn(4, 2, 3, 2, seed=1)})
case("dsl_conv_strides_by_axis", lambda x, sc_W, sc_B: D.conv("sc", 3, 4, stride=(2, 1), padding=1)(D.Tensor(x)).node,
     lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=1),
     {"x": randn(2, 3, 7, 6), "sc_W": randn(4, 3, 3, 3, seed=1), "sc_B": randn(4, seed=2)})
case("dsl_conv_strides_3_2", lambda x, st_W: D.conv("st", (2, 3), 2, stride=(3, 2), bias=False)(D.Tensor(x)).node,
     lambda x, w: F.conv2d(x, w, stride=(3, 2)), {"x": randn(2, 3, 9, 8), "st_W": randn(2, 3, 2, 3, seed=1)})
case("dsl_tensor_ranges", lambda x: D.Tensor(x)[:, 1:3, ..., :2].node, lambda x: x[:, 1:3, ..., :2],
     {"x": randn(2, 4, 3, 5)})
case("dsl_conv_transpose", lambda x, up_W, up_B: D.conv_transpose("up", 3, 4, stride=2, padding=1,
                                                                   output_padding=1)(D.Tensor(x)).node,
     lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
     {"x": randn(2, 3, 4, 5), "up_W": randn(3, 4, 3, 3, seed=1), "up_B": randn(4, seed=2)})
case("dsl_conv_transpose_plain", lambda x, t_W: D.conv_transpose("t", 2, 2, stride=2, bias=False)(D.Tensor(x)).node,
     lambda x, w: F.conv_transpose2d(x, w, stride=2), {"x": randn(2, 3, 3, 3), "t_W": randn(3, 2, 2, 2, seed=1)})
case("dsl_upsample", dsl(D.upsample(2)), lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
     {"x": randn(2, 3, 3, 4)})
case("dsl_upsample_bilinear", dsl(D.upsample(2, "bilinear")),
     lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False), {"x": randn(2, 3, 3, 4)})
case("dsl_upsample_bilinear_3", dsl(D.upsample(3, "bilinear")),
     lambda x: F.interpolate(x, scale_factor=3, mode="bilinear", align_corners=False), {"x": randn(1, 2, 1, 5)})
case("dsl_adaptive_max_overlapping", dsl(D.adaptive_max_pool((3, 2))), lambda x: F.adaptive_max_pool2d(x, (3, 2)),
     {"x": randn(2, 3, 5, 7)})
case("dsl_global_max_rectangle", dsl(D.max_pool(None)), lambda x: x.amax(dim=(2, 3), keepdim=True),
     {"x": randn(2, 3, 4, 7)})
_TIES = np.array([[[[1.0, 2.0, 2.0, 1.0, 0.5], [2.0, 0.0, 2.0, 2.0, 1.0]]]])      # the first 2 wins, as PyTorch's
case("dsl_global_max_ties", dsl(D.max_pool(None)), lambda x: F.max_pool2d(x, (2, 5)), {"x": _TIES}, fd=False)
case("dsl_adaptive_max_ties", dsl(D.adaptive_max_pool((1, 2))), lambda x: F.adaptive_max_pool2d(x, (1, 2)),
     {"x": _TIES}, fd=False)
case("dsl_adaptive_avg_overlapping", dsl(D.adaptive_avg_pool((3, 2))), lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
     {"x": randn(2, 3, 5, 7)})

# summing, broadcasting, reshaping
case("sum_to_rows", lambda x: sum_to(x, (3, 1)), lambda x: x.sum_to_size(3, 1), {"x": randn(2, 3, 4)})
case("sum_to_middle", lambda x: sum_to(x, (2, 1, 4)), lambda x: x.sum_to_size(2, 1, 4), {"x": randn(2, 3, 4)})
case("sum_to_scalar", lambda x: sum_to(x, ()), lambda x: x.sum(), {"x": randn(2, 3, 4)})
case("broadcast_to", lambda y: broadcast_to(y, (2, 3, 4)), lambda y: y.expand(2, 3, 4), {"y": randn(3, 1)})
case("broadcast_scalar", lambda y: broadcast_to(y, (2, 3)), lambda y: y.expand(2, 3), {"y": np.asarray(1.5)})
case("reshape", lambda x: reshape(x, (4, 6)), lambda x: x.reshape(4, 6), {"x": randn(2, 3, 4)})
case("dsl_flatten", dsl(D.flatten), lambda x: x.flatten(1), {"x": randn(2, 3, 2, 2)})

# matrix multiply and fully connected layers
for _ta in (False, True):
    for _tb in (False, True):
        case(f"matmul_ta{int(_ta)}_tb{int(_tb)}",
             lambda a, b, ta=_ta, tb=_tb: matmul(a, b, ta=ta, tb=tb),
             lambda a, b, ta=_ta, tb=_tb: (a.T if ta else a) @ (b.T if tb else b),
             {"a": randn(*((4, 3) if _ta else (3, 4))), "b": randn(*((5, 4) if _tb else (4, 5)), seed=1)})
for _ta in (False, True):
    for _tb in (False, True):
        case(f"batched_matmul_ta{int(_ta)}_tb{int(_tb)}",
             lambda a, b, ta=_ta, tb=_tb: matmul(a, b, ta=ta, tb=tb),
             lambda a, b, ta=_ta, tb=_tb: (a.transpose(-1, -2) if ta else a) @ (b.transpose(-1, -2) if tb else b),
             {"a": randn(2, 3, *((4, 3) if _ta else (3, 4))), "b": randn(2, 3, *((5, 4) if _tb else (4, 5)), seed=1)})
for _ta in (False, True):
    for _tb in (False, True):
        case(f"matmul_bias_ta{int(_ta)}_tb{int(_tb)}",         # a product taking a bias (`fuse_epilogue`)
             lambda a, b, c, ta=_ta, tb=_tb: make("matmul", (a, b, c), **({"ta": True} if ta else {}),
                                                 **({"tb": True} if tb else {})),
             lambda a, b, c, ta=_ta, tb=_tb: (a.T if ta else a) @ (b.T if tb else b) + c,
             {"a": randn(*((4, 3) if _ta else (3, 4))), "b": randn(*((5, 4) if _tb else (4, 5)), seed=1),
              "c": randn(5, seed=2)})
case("dsl_attention_scores", lambda q, k: (D.Tensor(q) @ D.Tensor(k).transpose(-1, -2)).node,
     lambda q, k: q @ k.transpose(-1, -2), {"q": randn(2, 2, 3, 4), "k": randn(2, 2, 3, 4, seed=1)})
case("all_sum", lambda x: make("all_sum", (x,)), lambda x: x.clone(), {"x": randn(2, 3, 4)})   # one process
case("transpose_adjacent", lambda x: transpose(x, 1, 2), lambda x: x.transpose(1, 2), {"x": randn(2, 3, 4, 5)})
case("transpose_apart", lambda x: transpose(x, 0, 3), lambda x: x.transpose(0, 3), {"x": randn(2, 3, 4, 5)})
case("dsl_softmax_last_axis", dsl(D.softmax), lambda x: torch.softmax(x, dim=-1), {"x": randn(2, 3, 5)})
case("dsl_full_tokens", lambda x, ft_W, ft_B: D.full("ft", 4)(D.Tensor(x)).node, F.linear,
     {"x": randn(2, 3, 5), "ft_W": randn(4, 5, seed=1), "ft_B": randn(4, seed=2)})
case("dsl_param_broadcast", lambda x, pos: (D.Tensor(x) + D.param("pos", (1, 3, 4))).node, lambda x, pos: x + pos,
     {"x": randn(2, 3, 4), "pos": randn(1, 3, 4, seed=1)})
# user functions with the derivative the user gave: a straight-through estimator (PyTorch's x + (f(x) - x).detach()
# idiom), and Mish with its derivative written in a stable form
case("dsl_straight_through", dsl(D.elementwise("binarize", "sign(v)", derivative="1")),
     lambda x: x + (torch.sign(x) - x).detach(), {"x": away_from(randn(3, 4), [0.0])}, fd=False)
_MISH_DERIVATIVE = "tanh(softplus(v)) + v * sigmoid(v) * (1 - tanh(softplus(v))**2)"
case("dsl_given_derivative", dsl(D.elementwise("mish", "v * tanh(softplus(v))", derivative=_MISH_DERIVATIVE)),
     lambda x: x * torch.tanh(F.softplus(x)), {"x": randn(3, 4, scale=3)})
case("dsl_full", lambda x, fc_W, fc_B: D.full("fc", 4)(D.Tensor(x)).node, F.linear,
     {"x": randn(3, 5), "fc_W": randn(4, 5, seed=1), "fc_B": randn(4, seed=2)})
case("dsl_full_no_bias", lambda x, fc2_W: D.full("fc2", 4, bias=False)(D.Tensor(x)).node, F.linear,
     {"x": randn(3, 5), "fc2_W": randn(4, 5, seed=1)})

# convolution: PyTorch layouts x (N,C,H,W), w (O,C,kh,kw), b (O,)
for _stride, _pad, _bias, _hw in [(1, 0, True, (5, 6)), (1, 1, False, (5, 4)), (2, 0, True, (6, 5)),
                                  (2, 1, False, (5, 7)), (2, 1, True, (4, 4)), (3, 2, True, (7, 5))]:
    case(f"conv2d_s{_stride}_p{_pad}_{'bias' if _bias else 'nobias'}_{_hw[0]}x{_hw[1]}",
         lambda x, w, *b, s=_stride, p=_pad: make("conv2d", (x, w, *b), stride=s, pad=p),
         lambda x, w, *b, s=_stride, p=_pad: F.conv2d(x, w, *b, stride=s, padding=p),
         {"x": randn(2, 3, *_hw), "w": randn(4, 3, 3, 2, seed=1)} | ({"b": randn(4, seed=2)} if _bias else {}))
case("dsl_conv", lambda x, cv_W, cv_B: D.conv("cv", 3, 4, stride=2, padding=1)(D.Tensor(x)).node,
     lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
     {"x": randn(2, 3, 6, 5), "cv_W": randn(4, 3, 3, 3, seed=1), "cv_B": randn(4, seed=2)})

# pooling: (h, w, kernel, stride, pad, ceil); the ceil cases include windows hanging over the padding
POOLS = [(6, 6, 2, 2, 0, False), (5, 7, 3, 2, 0, False), (5, 7, 3, 2, 1, False), (5, 7, 3, 2, 0, True),
         (5, 6, 2, 2, 1, True), (6, 4, 3, 2, 1, True), (4, 5, 3, 1, 1, False), (7, 5, 3, 3, 1, True),
         (5, 5, 1, 3, 0, True)]
for _h, _w, _k, _s, _p, _c in POOLS:
    _geometry = f"{_h}x{_w}_k{_k}_s{_s}_p{_p}{'_ceil' if _c else ''}"
    case(f"max_pool_{_geometry}",
         lambda x, k=_k, s=_s, p=_p, c=_c: make("max_pool", (x,), kernel=k, stride=s, pad=p, ceil=c),
         lambda x, k=_k, s=_s, p=_p, c=_c: F.max_pool2d(x, k, s, p, ceil_mode=c), {"x": distinct((2, 2, _h, _w))})
    for _include in (True, False):
        case(f"avg_pool_{_geometry}{'' if _include else '_exclude_pad'}",
             lambda x, k=_k, s=_s, p=_p, c=_c, i=_include: make("avg_pool", (x,), kernel=k, stride=s, pad=p,
                                                                 ceil=c, include_pad=i),
             lambda x, k=_k, s=_s, p=_p, c=_c, i=_include: F.avg_pool2d(x, k, s, p, ceil_mode=c,
                                                                         count_include_pad=i),
             {"x": randn(2, 2, _h, _w)})
case("dsl_global_avg_pool", dsl(D.avg_pool()), lambda x: F.adaptive_avg_pool2d(x, 1), {"x": randn(2, 3, 4, 4)})
case("dsl_global_avg_pool_rectangle", dsl(D.avg_pool()), lambda x: F.adaptive_avg_pool2d(x, 1),
     {"x": randn(2, 3, 4, 6)})
case("dsl_global_max_pool", dsl(D.max_pool(None)), lambda x: F.adaptive_max_pool2d(x, 1), {"x": randn(2, 3, 5, 5)})
case("dsl_adaptive_avg_pool", dsl(D.adaptive_avg_pool((2, 3))), lambda x: F.adaptive_avg_pool2d(x, (2, 3)),
     {"x": randn(2, 3, 4, 6)})
case("dsl_adaptive_avg_pool_1", dsl(D.adaptive_avg_pool(1)), lambda x: F.adaptive_avg_pool2d(x, 1),
     {"x": randn(2, 3, 3, 5)})
case("dsl_adaptive_max_pool", dsl(D.adaptive_max_pool(2)), lambda x: F.adaptive_max_pool2d(x, 2),
     {"x": randn(2, 3, 6, 6)})

# local response normalization across channels, odd and even windows, 4-D and 2-D inputs
for _size in (1, 2, 3, 4, 5, 8):
    case(f"lrn_{_size}", lambda x, n=_size: make("lrn", (x,), size=n, alpha=0.7, beta=0.75, k=1.5),
         lambda x, n=_size: F.local_response_norm(x, n, 0.7, 0.75, 1.5), {"x": randn(2, 6, 2, 3)})
for _size in (2, 3):
    case(f"lrn_{_size}_2d", lambda x, n=_size: make("lrn", (x,), size=n, alpha=0.5, beta=0.6, k=1.0),
         lambda x, n=_size: F.local_response_norm(x[:, :, None], n, 0.5, 0.6, 1.0)[:, :, 0], {"x": randn(3, 5)})
case("dsl_lrn", dsl(D.lrn(5)), lambda x: F.local_response_norm(x, 5, 1e-4, 0.75, 1.0), {"x": randn(2, 7, 2, 2)})

# joining and splitting
case("concat_channels", lambda a, b, c: concat([a, b, c], axis=1), lambda a, b, c: torch.cat([a, b, c], 1),
     {"a": randn(2, 3, 2, 2), "b": randn(2, 1, 2, 2, seed=1), "c": randn(2, 2, 2, 2, seed=2)})
case("concat_batch", lambda a, b: concat([a, b], axis=0), lambda a, b: torch.cat([a, b], 0),
     {"a": randn(2, 3, 2, 2), "b": randn(1, 3, 2, 2, seed=1)})
case("concat_same_input_twice", lambda a: concat([a, a], axis=1), lambda a: torch.cat([a, a], 1), {"a": randn(2, 3)})
case("dsl_concat", lambda a, b: D.concat(D.Tensor(a), D.Tensor(b)).node, lambda a, b: torch.cat([a, b], 1),
     {"a": randn(2, 3, 2, 2), "b": randn(2, 2, 2, 2, seed=1)})
case("slice_middle", lambda x: slice_axis(x, 1, 1, 4), lambda x: x[:, 1:4], {"x": randn(2, 5, 3)})
case("slice_last", lambda x: slice_axis(x, 2, 2, 3), lambda x: x[:, :, 2:3], {"x": randn(2, 5, 3)})
case("pad_axis", lambda x: make("pad_axis", (x,), axis=1, start=2, size=8), lambda x: F.pad(x, (0, 0, 2, 1)),
     {"x": randn(2, 5, 3)})

# softmax, label-indexed ops and losses
LABELS = np.array([2, 0, 3, 3], dtype=np.int32)
_Y = {"y": LABELS}
case("softmax", lambda x: make("softmax", (x,)), lambda x: F.softmax(x, 1), {"x": randn(4, 5, scale=2)})
case("log_softmax", lambda x: make("log_softmax", (x,)), lambda x: F.log_softmax(x, 1), {"x": randn(4, 5, scale=2)})
case("pick", lambda x, y: make("pick", (x, y)), lambda x, y: x.gather(1, y[:, None])[:, 0], {"x": randn(4, 5)},
     labels=_Y)
case("unpick", lambda g, y: make("unpick", (g, y), classes=5),
     lambda g, y: torch.zeros(4, 5).scatter(1, y[:, None], g[:, None]), {"g": randn(4)}, labels=_Y)
case("cross_entropy", cross_entropy, F.cross_entropy, {"x": randn(4, 5, scale=2)}, labels=_Y)
case("nll_loss", nll, F.nll_loss, {"x": randn(4, 5)}, labels=_Y)
case("nll_loss_after_log_softmax", lambda x, y: nll(make("log_softmax", (x,)), y),
     lambda x, y: F.nll_loss(F.log_softmax(x, 1), y), {"x": randn(4, 5)}, labels=_Y)
case("log_loss_after_softmax", lambda x, y: log_loss(make("softmax", (x,)), y),
     lambda x, y: F.nll_loss(torch.log(F.softmax(x, 1)), y), {"x": randn(4, 5, scale=2)}, labels=_Y)
case("dsl_log_loss_softmax", lambda x, y: (D.log_loss(D.Tensor(y)) @ D.softmax)(D.Tensor(x)).node,
     F.cross_entropy, {"x": randn(4, 5)}, labels=_Y)
case("dsl_cross_entropy", lambda x, y: D.cross_entropy(D.Tensor(y))(D.Tensor(x)).node, F.cross_entropy,
     {"x": randn(4, 5)}, labels=_Y)

_TARGETS = randn(2, 3, 4, seed=1)
case("dsl_mse_loss", lambda x: D.mse_loss(D.Tensor(leaf("t", (2, 3, 4))))(D.Tensor(x)).node,
     lambda x: F.mse_loss(x, torch.from_numpy(_TARGETS)), {"x": randn(2, 3, 4)}, fixed={"t": _TARGETS})

# sequences: a label per position, causal attention weights, token embeddings
_SEQUENCE_LABELS = {"y": np.array([[2, 0, 3], [4, 4, 1]], dtype=np.int32)}
case("dsl_cross_entropy_per_position", lambda x, y: D.cross_entropy(D.Tensor(y))(D.Tensor(x)).node,
     lambda x, y: F.cross_entropy(x.reshape(-1, 5), y.reshape(-1)), {"x": randn(2, 3, 5)}, labels=_SEQUENCE_LABELS)
_LATER = torch.ones(4, 4, dtype=torch.bool).triu(1)
case("causal_softmax", lambda x: make("softmax", (x,), causal=True),
     lambda x: torch.softmax(x.reshape(-1, 4, 4).masked_fill(_LATER, float("-inf")), -1).reshape(8, 4),
     {"x": randn(8, 4, scale=2)})
case("dsl_causal_softmax", dsl(D.causal_softmax),
     lambda x: torch.softmax(x.masked_fill(_LATER, float("-inf")), -1), {"x": randn(2, 3, 4, 4)})
case("dsl_embedding", lambda emb_W, ids: D.embedding("emb", 5, 3)(D.Tensor(ids)).node,
     lambda w, ids: F.embedding(ids, w), {"emb_W": randn(5, 3)},
     labels={"ids": np.array([[1, 4, 1], [0, 2, 4]], dtype=np.int32)})

_IDS = {"ids": np.array([3, 0, 3, 1, 3, 4], dtype=np.int32)}         # repeated rows: their gradients summed
case("gather_rows", lambda table, ids: make("gather_rows", (table, ids)), lambda table, ids: table[ids],
     {"table": randn(5, 3)}, labels=_IDS)
case("scatter_rows", lambda g, ids: make("scatter_rows", (g, ids), rows=5),
     lambda g, ids: torch.zeros(5, 3).index_add(0, ids, g), {"g": randn(6, 3)}, labels=_IDS)


# masks from tokens: a padding mask filling attention scores, a choice between two tensors
_TOKENS = {"t": np.array([[3, 0, 1, 0], [2, 2, 0, 5]], dtype=np.int32)}
case("dsl_masked_fill_padding",
     lambda s, t: D.softmax(D.Tensor(s).masked_fill(D.Tensor(t).eq(0).reshape(2, 1, 1, 4), float("-inf"))).node,
     lambda s, t: torch.softmax(s.masked_fill((t == 0).reshape(2, 1, 1, 4), float("-inf")), -1),
     {"s": randn(2, 3, 4, 4)}, labels=_TOKENS)
case("dsl_where", lambda a, b, t: D.where(D.Tensor(t).eq(2), D.Tensor(a), D.Tensor(b)).node,
     lambda a, b, t: torch.where(t == 2, a, b), {"a": randn(2, 4), "b": randn(2, 4, seed=1)}, labels=_TOKENS)


# what imported models are written with: permutations of any axes, a parameter broadcast along the batch,
# scaled dot-product attention (plain, causal, with a scale)
case("dsl_permute", lambda x: D.Tensor(x).permute(2, 0, 3, 1).node, lambda x: x.permute(2, 0, 3, 1),
     {"x": randn(2, 3, 4, 5)})
case("dsl_permute_reverse", lambda x: D.Tensor(x).permute(-1, -2, -3).node, lambda x: x.permute(2, 1, 0),
     {"x": randn(2, 3, 4)})
case("dsl_expand", lambda x: D.Tensor(x).expand(3, -1, 4).node, lambda x: x.expand(3, -1, 4), {"x": randn(1, 2, 1)})
case("dsl_attention", lambda q, k, v: D.attention(D.Tensor(q), D.Tensor(k), D.Tensor(v)).node,
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
     {"q": randn(2, 2, 3, 4), "k": randn(2, 2, 5, 4), "v": randn(2, 2, 5, 3)})
case("dsl_attention_causal_scaled",
     lambda q, k, v: D.attention(D.Tensor(q), D.Tensor(k), D.Tensor(v), causal=True, scale=0.3).node,
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
     {"q": randn(2, 4, 4), "k": randn(2, 4, 4), "v": randn(2, 4, 2)})
# the op itself with a bias that has a gradient (broadcast over the batch, and over the queries); a key padding
# mask from tokens (a bias without one)
case("attention_bias", lambda q, k, v, b: make("attention", (q, k, v, b), scale=0.4),
     lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b, scale=0.4),
     {"q": randn(2, 3, 5, 4), "k": randn(2, 3, 6, 4), "v": randn(2, 3, 6, 3), "b": randn(1, 3, 5, 6)})
case("attention_causal_key_bias", lambda q, k, v, b: make("attention", (q, k, v, b), scale=0.5, causal=True),
     lambda q, k, v, b: F.scaled_dot_product_attention(
         q, k, v, attn_mask=b + torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -np.inf),
         scale=0.5),
     {"q": randn(3, 5, 4), "k": randn(3, 5, 4), "v": randn(3, 5, 2), "b": randn(3, 1, 5)})
case("dsl_attention_padding_mask",
     lambda q, k, v, t: D.attention(D.Tensor(q), D.Tensor(k), D.Tensor(v),
                                    mask=(1 - D.Tensor(t).eq(0)).reshape(2, 1, 1, 4)).node,
     lambda q, k, v, t: F.scaled_dot_product_attention(q, k, v, attn_mask=(t != 0).reshape(2, 1, 1, 4)),
     {"q": randn(2, 3, 5, 4), "k": randn(2, 3, 4, 4), "v": randn(2, 3, 4, 2)}, labels=_TOKENS)


# mode-dependent layers, through `specialize`
def specialized(node: Node, mode: str) -> dict[str, Node]:
    return dict(specialize(Graph("g", (("out", node),)), mode).outputs)


def batch_norm_case(name, shape, mode):
    mean, var = randn(shape[1], seed=3), np.abs(randn(shape[1], seed=4)) + 0.5
    torch_mean, torch_var = torch.tensor(mean), torch.tensor(var)   # updated in place by F.batch_norm

    def build(x, bn_W, bn_B):
        outputs = specialized(D.batch_norm("bn", eps=1e-5, momentum=0.1)(D.Tensor(x)).node, mode)
        assert set(outputs) == ({"out", "bn_mean", "bn_var"} if mode == "train" else {"out"})
        return outputs.pop("out"), outputs

    def reference(x, bn_W, bn_B):
        torch_mean[:], torch_var[:] = torch.tensor(mean), torch.tensor(var)
        return F.batch_norm(x, torch_mean, torch_var, bn_W, bn_B, training=mode == "train", momentum=0.1, eps=1e-5)

    def after(results):
        if mode == "train":
            assert_close(results["bn_mean"], torch_mean, "running mean")
            assert_close(results["bn_var"], torch_var, "running var")
            assert not np.allclose(results["bn_var"], var)

    case(name, build, reference, {"x": randn(*shape, scale=2) + 1.0, "bn_W": randn(shape[1], seed=1),
                                  "bn_B": randn(shape[1], seed=2)},
         fixed={"bn_mean": mean, "bn_var": var}, after=after, mode_ops=("batch_norm",))


batch_norm_case("batch_norm_train_4d", (4, 3, 2, 3), "train")
batch_norm_case("batch_norm_train_2d", (5, 3), "train")
batch_norm_case("batch_norm_test_4d", (4, 3, 2, 2), "test")
batch_norm_case("batch_norm_test_2d", (5, 3), "test")

case("dropout_test", lambda x: specialized(D.dropout(0.4)(D.Tensor(x)).node, "test")["out"],
     lambda x: F.dropout(x, 0.4, training=False), {"x": randn(3, 4)}, mode_ops=("dropout",))


def _dropout_train():
    """Training-mode dropout with the mask the interpreter draws at seed 0, step 0: y = mask * x / keep."""
    ratio, shape, keys = 0.3, (6, 7), []

    def build(x):
        node = D.dropout(ratio)(D.Tensor(x)).node
        keys.append(node.attr("key"))
        return specialized(node, "train")["out"]

    def reference(x):
        mask = torch.from_numpy(bernoulli_mask(0, 0, keys[-1], shape, 1 - ratio).astype(np.float64))
        assert 0 < mask.sum() < mask.numel()
        return x * mask / (1 - ratio)

    case("dropout_train", build, reference, {"x": randn(*shape)}, mode_ops=("dropout",))


_dropout_train()


def _drop_path_train():
    """Training-mode drop path: one draw per example, y = mask[n] * x / keep (torchvision's StochasticDepth, row)."""
    ratio, shape, keys = 0.5, (8, 2, 3, 2), []

    def build(x):
        node = D.drop_path(ratio)(D.Tensor(x)).node
        keys.append(node.attr("key"))
        return specialized(node, "train")["out"]

    def reference(x):
        mask = torch.from_numpy(bernoulli_mask(0, 0, keys[-1], (8, 1, 1, 1), 1 - ratio).astype(np.float64))
        assert 0 < mask.sum() < mask.numel()
        return x * mask / (1 - ratio)

    case("drop_path_train", build, reference, {"x": randn(*shape)}, mode_ops=("dropout",))
    case("drop_path_test", lambda x: specialized(D.drop_path(ratio)(D.Tensor(x)).node, "test")["out"],
         lambda x: x, {"x": randn(3, 4)}, mode_ops=("dropout",))


_drop_path_train()


def _attention_dropout():
    """Attention's dropout of the weights when training, with the mask the interpreter draws at seed 0, step 0:
    (softmax(scores) * mask / keep) v; causal through D.attention, and the op with a bias that has a gradient (the
    scores' gradient carries the mask); the identity when testing."""
    ratio, keys = 0.35, []

    def build(causal):
        def made(q, k, v):
            node = D.attention(D.Tensor(q), D.Tensor(k), D.Tensor(v), causal=causal, dropout=ratio).node
            keys.append(node.attr("key"))
            out = specialized(node, "train")["out"]
            assert out.attr("keep") == 1 - ratio and out.inputs[-1].op == "bernoulli"
            return out
        return made

    def with_bias(q, k, v, b):
        keys.append(7)
        return specialized(make("attention", (q, k, v, b), scale=0.4, dropout=ratio, key=7), "train")["out"]

    def reference(causal, scale=None):
        def weights(q, k, v, b=None):
            s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
            if b is not None:
                s = s + b
            if causal:
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -np.inf)
            mask = torch.from_numpy(bernoulli_mask(0, 0, keys[-1], s.shape, 1 - ratio).astype(np.float64))
            assert 0 < mask.sum() < mask.numel()
            return (torch.softmax(s, -1) * mask / (1 - ratio)) @ v
        return weights

    case("dsl_attention_dropout_train", build(False), reference(False),
         {"q": randn(2, 2, 3, 4), "k": randn(2, 2, 5, 4), "v": randn(2, 2, 5, 3)}, mode_ops=("dropout",))
    case("dsl_attention_dropout_causal_train", build(True), reference(True),
         {"q": randn(3, 6, 4), "k": randn(3, 6, 4), "v": randn(3, 6, 2)}, mode_ops=("dropout",))
    case("attention_dropout_bias_train", with_bias, reference(False, 0.4),
         {"q": randn(2, 3, 5, 4), "k": randn(2, 3, 6, 4), "v": randn(2, 3, 6, 3), "b": randn(1, 3, 5, 6)},
         mode_ops=("dropout",))
    case("dsl_attention_dropout_test",
         lambda q, k, v: specialized(D.attention(D.Tensor(q), D.Tensor(k), D.Tensor(v), dropout=ratio).node,
                                     "test")["out"],
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
         {"q": randn(2, 3, 4), "k": randn(2, 5, 4), "v": randn(2, 5, 3)}, mode_ops=("dropout",))


_attention_dropout()


@pytest.mark.parametrize("name", sorted(CASES))
def test_vjp(name):
    c = CASES[name]
    results = check_vjp(c.build, c.reference, c.arrays, c.labels, c.fixed, fd=c.fd)
    if c.after is not None:
        c.after(results)


# ----------------------------------------------------------------------------------------------------------------
# random geometries

@settings(max_examples=12, deadline=None)
@given(g=conv_geometries(kernel=3, pad=1, largest=6), seed=st.integers(0, 99))
def test_conv2d_random_geometries(g, seed):
    x, w, b = randn(2, 2, g["h"], g["w"], seed=seed), randn(3, 2, g["kh"], g["kw"], seed=seed + 1), randn(3)
    check_vjp(lambda x, w, b: make("conv2d", (x, w, b), stride=g["stride"], pad=g["pad"]),
              lambda x, w, b: F.conv2d(x, w, b, stride=g["stride"], padding=g["pad"]),
              {"x": x, "w": w, "b": b}, seed=seed)


@settings(max_examples=15, deadline=None)
@given(g=pool_geometries(7), include_pad=st.booleans(), seed=st.integers(0, 99))
def test_pool_random_geometries(g, include_pad, seed):
    h, w, kernel, stride, pad, ceil = g.values()
    check_vjp(lambda x: make("max_pool", (x,), kernel=kernel, stride=stride, pad=pad, ceil=ceil),
              lambda x: F.max_pool2d(x, kernel, stride, pad, ceil_mode=ceil), {"x": distinct((1, 2, h, w), seed)},
              seed=seed)
    check_vjp(lambda x: make("avg_pool", (x,), kernel=kernel, stride=stride, pad=pad, ceil=ceil,
                             include_pad=include_pad),
              lambda x: F.avg_pool2d(x, kernel, stride, pad, ceil_mode=ceil, count_include_pad=include_pad),
              {"x": randn(1, 2, h, w, seed=seed)}, seed=seed)


# ----------------------------------------------------------------------------------------------------------------
# kinks: the derivative chosen where there is none is PyTorch's (autograd only; differences are meaningless there)

@pytest.mark.parametrize("name", ["relu", "relu_by_sympy", "clipped_relu", "clipped_by_sympy", "abs"])
def test_activation_kinks_match_torch(name):
    build, reference, kinks = UNARY[name]
    x = np.array([[k - 0.5, k, k + 0.5] for k in kinks]).reshape(len(kinks), 3)
    check_vjp(build, reference, {"x": x}, fd=False)


def test_max_pool_ties_pick_the_first_maximum():
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 1, 1] = x[0, 0, 0, 1] = 1.0     # two maxima in the first window
    check_vjp(lambda x: make("max_pool", (x,), kernel=2, stride=2, pad=0, ceil=False),
              lambda x: F.max_pool2d(x, 2), {"x": x}, fd=False)


@pytest.mark.parametrize("name", ["relu", "tanh", "sigmoid", "clipped_relu"])
def test_activation_backward_reads_only_the_output(name):
    """The built-in activations differentiate through `out_grad`, so their input can be freed after the forward."""
    x = leaf("x", (3, 4))
    y = UNARY[name][0](x)
    assert y.attr("out_grad") is not None
    dx = gradients(sum_to(y, ()), [x])[x]
    readers = [n for n in toposort([dx]) if any(i is x for i in n.inputs)]
    assert readers == [y], f"the gradient of {name} reads its input: {readers}"


# ----------------------------------------------------------------------------------------------------------------
# dropout's mask

def test_dropout_train_mask():
    ratio, shape = 0.3, (40, 50)
    keep = 1 - ratio
    x = leaf("x", shape)
    out = specialized(D.dropout(ratio)(D.Tensor(x)).node, "train")["out"]
    (mask_node,) = [n for n in toposort([out]) if n.op == "bernoulli"]
    r = randn(*shape, seed=5)
    dx = gradients(sum_to(elementwise(sym(0) * sym(1), [out, leaf("R", shape)]), ()), [x])[x]
    xv = randn(*shape)
    values = run_graph(Graph("g", (("out", out), ("dx", dx), ("mask", mask_node))), {"x": xv, "R": r},
                       float_dtype=np.float64, seed=7, step=3)
    mask = values["mask"]
    assert mask.dtype == np.uint8 and set(np.unique(mask)) == {0, 1}
    np.testing.assert_array_equal(mask, bernoulli_mask(7, 3, mask_node.attr("key"), shape, keep))
    assert abs(mask.mean() - keep) < 4 * np.sqrt(keep * ratio / mask.size)     # within 4 standard deviations
    assert_close(values["out"], xv * mask / keep, "dropout forward")
    assert_close(values["dx"], mask * r / keep, "dropout gradient")
    other_step = run_graph(Graph("g", (("mask", mask_node),)), {}, float_dtype=np.float64, seed=7, step=4)["mask"]
    assert (other_step != mask).any()


# ----------------------------------------------------------------------------------------------------------------
# the registry: every op has a case in the table, or a reason not to

NOT_DIFFERENTIATED = {
    # leaves: gradients stop here
    "input": "leaf", "param": "leaf", "state": "leaf", "const": "leaf",
    # backward ops: they only appear in gradient graphs (no second derivatives)
    "conv2d_bwd_filter": "backward op", "max_pool_bwd": "backward op",
    "avg_pool_bwd": "backward op", "lrn_bwd": "backward op", "max_pool_argmax": "backward op (integer output)",
    "attention_grad": "backward op", "layer_norm_grad": "backward op", "layer_norm_param_grad": "backward op",
    # non-differentiable outputs
    "precision": "piecewise constant", "label_rank": "piecewise constant (a count)",
    "bernoulli": "random integer mask",
}


def test_every_op_has_a_vjp_case():
    covered: set[str] = set()
    for c in CASES.values():
        _, out, extra = build_case(c.build, c.arrays, c.labels)
        covered |= ops_in(out, *extra.values()) | set(c.mode_ops)
    ops = set(all_ops())
    assert set(NOT_DIFFERENTIATED) <= ops, f"unknown ops listed: {set(NOT_DIFFERENTIATED) - ops}"
    missing = ops - set(NOT_DIFFERENTIATED) - covered
    assert not missing, f"ops without a VJP case: {sorted(missing)} (add a case, or list them in NOT_DIFFERENTIATED)"
    # the backward ops are exercised by the cases too (as parts of gradients)
    assert "max_pool" in covered and "batch_norm" in covered and "dropout" in covered


def test_non_differentiated_ops_give_no_gradient():
    x, y = leaf("x", (3, 4)), leaf("y", (3,), INT32)
    precision = make("precision", (x, y))
    assert get_op("precision").vjp(precision, leaf("g", ())) == (None, None)
    assert gradients(elementwise(sym(0) * 2, [precision]), [x])[x].op == "const"
    g = leaf("g", (2, 3, 2, 2))
    bwd = make("avg_pool_bwd", (g,), kernel=2, stride=2, pad=0, ceil=False, include_pad=True, size=(4, 4))
    with pytest.raises(NotImplementedError):
        get_op("avg_pool_bwd").vjp(bwd, leaf("h", bwd.shape))
