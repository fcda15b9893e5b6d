"""The layers: convolutions, fully connected and embedding layers, upsampling, pooling, activations and user
functions, normalization and dropout, and the combinators of branches."""
from __future__ import annotations

import math
from typing import Any, Callable

import sympy

from deepdsl.errors import DeepDSLError, ShapeError, user_location
from deepdsl import provenance
from deepdsl.ir import INT32, Node, make
from deepdsl.ops import dims
from deepdsl.ops.elementwise import Sigmoid, Softplus, Y, broadcasts_to, reshape, stable_forms, sum_to, sym
from deepdsl.ops.elementwise import elementwise as ew_node
from deepdsl.ops.conv import grouping
from deepdsl.ops.shape import concat as _concat
from deepdsl.ops.shape import slice_axis
from deepdsl.ops.attention import attention as attention_node
from deepdsl.frontend.core import (Layer, Param, Tensor, _ParamLayer, _flag, _fraction, _integer, _made, _name,
                                   _next_dropout_key, _node, _nonnegative_int, _nonnegative_number, _number,
                                   _positive_int, _positive_number, _reject, _spec, _state, _stored_name, constant,
                                   gaussian, v, where, xavier)

# ----------------------------------------------------------------------------------------------------------------
# layers

def _layer(kind: str, name: Any) -> str:
    """How errors name a layer with parameters, once its name is checked (its tensors are `<name>_W`, ...)."""
    what = f"layer '{_name(kind, name)}'"
    _stored_name(what, f"{name}_W")
    return what


def _pair(what: str, field: str, value: Any, least: int) -> tuple[int, int]:
    """An int, or a (height, width) pair of ints, at least `least` each: as a pair."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return _integer(what, f"{field}[0]", value[0], least), _integer(what, f"{field}[1]", value[1], least)
    if isinstance(value, (tuple, list)):
        _reject(what, f"{field} must be an int or a (height, width) pair, got {value!r}")
    size = _integer(what, field, value, least)
    return size, size


def _sizes(pair: tuple[int, int]) -> str:
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}x{pair[1]}"


class _Conv(_ParamLayer):
    def __init__(self, name, kernel, channels, stride, padding, bias, weight, bias_init, groups=1, dilation=(1, 1)):
        super().__init__(name, f"conv {kernel[0]}x{kernel[1]}, {channels} channels, stride {_sizes(stride)}, padding "
                               f"{_sizes(padding)}" + (f", dilation {_sizes(dilation)}" if dilation != (1, 1) else "")
                               + (f", {groups} groups" if groups > 1 else ""))
        self.kernel, self.channels, self.stride, self.padding = kernel, channels, stride, padding
        self.bias, self.weight_spec, self.bias_spec, self.groups = bias, weight, bias_init, groups
        self.dilation = dilation

    def forward(self, x):
        if len(x.shape) != 4:
            raise ShapeError(f"convolution input must be 4-D (N,C,H,W), got {dims(x.shape)}")
        c, g = x.shape[1], self.groups
        if c % g or self.channels % g:
            raise ShapeError(f"a convolution of {g} groups needs input channels ({c}) and output channels "
                             f"({self.channels}) that {g} divides")
        shapes = {"W": (self.channels, c // g, *self.kernel)}
        if self.bias:
            shapes["B"] = (self.channels,)
        p = self._weights(shapes, {"W": self.weight_spec, "B": self.bias_spec})
        weight = _dilated(p["W"], *self.dilation)
        (ph, pw), pad, image = self.padding, self.padding[0], x.node
        if ph != pw:                 # padding that differs by axis: zeros placed around the input, then none
            h, w = x.shape[2:]
            image = make("pad_axis", (make("pad_axis", (image,), axis=2, start=ph, size=h + 2 * ph),), axis=3,
                         start=pw, size=w + 2 * pw)
            pad = 0
        inputs = [image, weight] + ([p["B"]] if self.bias else [])
        # strides that differ by axis: the convolution at their greatest common divisor, then every k-th position
        # of the axis whose stride is k times that (exact; k times the products along that axis)
        step = math.gcd(*self.stride)
        y = make("conv2d", inputs, stride=step, pad=pad, **grouping(g))
        return Tensor(_every(_every(y, 2, self.stride[0] // step), 3, self.stride[1] // step))


def _every(x: Node, axis: int, k: int) -> Node:
    """Positions 0, k, 2k, ... of `axis` (a reshape into groups of k, zeros completing the last, and their firsts)."""
    if k == 1:
        return x
    n = x.shape[axis]
    kept = -(-n // k)
    if kept * k > n:
        x = make("pad_axis", (x,), axis=axis, start=0, size=kept * k)
    grouped = reshape(x, x.shape[:axis] + (kept, k) + x.shape[axis + 1:])
    return reshape(slice_axis(grouped, axis + 1, 0, 1), x.shape[:axis] + (kept,) + x.shape[axis + 1:])


def _dilated(w: Node, dh: int, dw: int) -> Node:
    """Filters (O, C, kh, kw) with dh - 1 zero rows between their rows and dw - 1 zero columns between their
    columns (PyTorch's dilation: a convolution by them is the dilated convolution by w; it computes the zeros too)."""
    for axis, d in ((2, dh), (3, dw)):
        if d == 1:
            continue
        shape, k = w.shape, w.shape[axis]
        apart = shape[:axis + 1] + (1,) + shape[axis + 1:]
        spaced = make("pad_axis", (reshape(w, apart),), axis=axis + 1, start=0, size=d)
        w = slice_axis(reshape(spaced, shape[:axis] + (k * d,) + shape[axis + 1:]), axis, 0, (k - 1) * d + 1)
    return w


def conv(name: str, kernel, channels: int, stride=1, padding=0, bias: bool = True,
         weight: Param | None = None, bias_init: Param | None = None, groups: int = 1, dilation=1) -> Layer:
    """2-D convolution with weights `<name>_W` (channels, in / groups, kh, kw) and bias `<name>_B` (channels,), as
    PyTorch's Conv2d: `kernel`, `stride`, `padding` and `dilation` (the filters' taps that far apart) an int or a
    (height, width) pair, `groups` splitting the input and output channels into that many groups convolved
    separately (depthwise: groups = the input channels)."""
    what = _layer("D.conv", name)
    return _Conv(name, _pair(what, "kernel", kernel, 1), _positive_int(what, "channels", channels),
                 _pair(what, "stride", stride, 1),
                 _pair(what, "padding", padding, 0), _flag(what, "bias", bias), _spec(what, "weight", weight, xavier()),
                 _spec(what, "bias_init", bias_init, constant(0.0)), _positive_int(what, "groups", groups),
                 _pair(what, "dilation", dilation, 1))


class _ConvTranspose(_ParamLayer):
    def __init__(self, name, kernel, channels, stride, padding, output_padding, bias, weight, bias_init):
        super().__init__(name, f"transposed conv {kernel}x{kernel}, {channels} channels, stride {stride}, "
                               f"padding {padding}")
        self.kernel, self.channels, self.stride, self.padding = kernel, channels, stride, padding
        self.output_padding, self.bias, self.weight_spec, self.bias_spec = output_padding, bias, weight, bias_init

    def forward(self, x):
        if len(x.shape) != 4:
            raise ShapeError(f"transposed convolution input must be 4-D (N,C,H,W), got {dims(x.shape)}")
        size = tuple((d - 1) * self.stride - 2 * self.padding + self.kernel + self.output_padding
                     for d in x.shape[2:])
        if min(size) < 1:
            raise ShapeError(f"transposed convolution of {dims(x.shape)} gives an empty output {size}")
        shapes = {"W": (x.shape[1], self.channels, self.kernel, self.kernel)}
        if self.bias:
            shapes["B"] = (self.channels,)
        p = self._weights(shapes, {"W": self.weight_spec, "B": self.bias_spec})
        y = make("conv2d_bwd_data", (x.node, p["W"]), stride=self.stride, pad=self.padding, size=size)
        if self.bias:
            y = ew_node(sym(0) + sym(1), [y, reshape(p["B"], (1, self.channels, 1, 1))])
        return Tensor(y)


def conv_transpose(name: str, kernel: int, channels: int, stride: int = 1, padding: int = 0,
                   output_padding: int = 0, bias: bool = True, weight: Param | None = None,
                   bias_init: Param | None = None) -> Layer:
    """PyTorch's ConvTranspose2d: weights `<name>_W` (in, channels, kernel, kernel), bias `<name>_B`; output size
    (H - 1) stride - 2 padding + kernel + output_padding (the gradient of a convolution with those settings)."""
    what = _layer("D.conv_transpose", name)
    stride = _positive_int(what, "stride", stride)
    output_padding = _nonnegative_int(what, "output_padding", output_padding)
    if output_padding >= stride:
        _reject(what, f"output_padding {output_padding} must be smaller than the stride {stride}")
    return _ConvTranspose(name, _positive_int(what, "kernel", kernel), _positive_int(what, "channels", channels),
                          stride, _nonnegative_int(what, "padding", padding), output_padding, _flag(what, "bias", bias),
                          _spec(what, "weight", weight, xavier()), _spec(what, "bias_init", bias_init, constant(0.0)))


def upsample(scale: int, mode: str = "nearest") -> Layer:
    """Upsampling by an integer `scale`, as PyTorch's Upsample(scale_factor=scale, mode=mode): "nearest" repeats
    each position scale x scale times (a broadcast between two reshapes); "bilinear" (align_corners=False)
    interpolates linearly along the rows, then along the columns (`_linear_upsample`)."""
    what = "layer 'upsample'"
    scale = _positive_int(what, "scale", scale)
    if mode not in ("nearest", "bilinear"):
        _reject(what, f"mode must be 'nearest' or 'bilinear', got {mode!r}")

    def build(x: Node) -> Node:
        if len(x.shape) != 4:
            raise ShapeError(f"upsampling input must be 4-D (N,C,H,W), got {dims(x.shape)}")
        n, c, h, w = x.shape
        if mode == "bilinear":
            return _linear_upsample(_linear_upsample(x, 2, scale), 3, scale)
        spread = ew_node(sym(0), [reshape(x, (n, c, h, 1, w, 1))], shape=(n, c, h, scale, w, scale))
        return reshape(spread, (n, c, h * scale, w * scale))
    return _Op(f"upsample({scale}{'' if mode == 'nearest' else ', bilinear'})", f"{mode} upsampling x{scale}", build)


def _linear_upsample(x: Node, axis: int, scale: int) -> Node:
    """x `scale` times longer along `axis` by linear interpolation, as PyTorch's (align_corners=False): output
    position scale i + r reads the input at i + f, f = (r + 1/2) / scale - 1/2, between position i and its
    neighbour on f's side, the ends repeated (PyTorch clamps there). The `scale` phases are interleaved by a
    concatenation along a new axis after `axis` and a reshape."""
    n = x.shape[axis]
    before = _concat([slice_axis(x, axis, 0, 1), slice_axis(x, axis, 0, n - 1)], axis) if n > 1 else x
    after = _concat([slice_axis(x, axis, 1, n), slice_axis(x, axis, n - 1, n)], axis) if n > 1 else x
    phases = []
    for r in range(scale):
        f = (r + 0.5) / scale - 0.5
        neighbour, weight = (after, f) if f >= 0 else (before, -f)
        phases.append(ew_node(sym(0) * (1 - weight) + sym(1) * weight, [x, neighbour]) if weight else x)
    apart = x.shape[:axis + 1] + (1,) + x.shape[axis + 1:]
    interleaved = _concat([reshape(p, apart) for p in phases], axis=axis + 1)
    return reshape(interleaved, x.shape[:axis] + (n * scale,) + x.shape[axis + 1:])


class _Embedding(_ParamLayer):
    def __init__(self, name, vocab, dim, weight):
        super().__init__(name, f"embedding of {vocab} tokens in {dim} features")
        self.vocab, self.dim, self.weight_spec = vocab, dim, weight

    def forward(self, x):
        if x.node.dtype != INT32:
            raise ShapeError(f"an embedding takes integer tokens (D.tokens), got {x.node.dtype} {dims(x.shape)}")
        p = self._weights({"W": (self.vocab, self.dim)}, {"W": self.weight_spec})
        count = math.prod(x.shape)
        # each token's row of the table (its gradient: the rows of the tokens' gradients summed into the table's)
        rows = make("gather_rows", (p["W"], reshape(x.node, (count,))))
        return Tensor(reshape(rows, (*x.shape, self.dim)))


def embedding(name: str, vocab: int, dim: int, weight: Param | None = None) -> Layer:
    """Token embedding, PyTorch's nn.Embedding: `<name>_W` (vocab, dim), row t the features of token t; on (N, T)
    tokens it gives (N, T, dim). Initialized N(0, 1) as PyTorch's."""
    what = _layer("D.embedding", name)
    return _Embedding(name, _positive_int(what, "vocab", vocab), _positive_int(what, "dim", dim),
                      _spec(what, "weight", weight, gaussian(1.0)))


class _Full(_ParamLayer):
    def __init__(self, name, out, bias, weight, bias_init):
        super().__init__(name, f"fully connected, {out} outputs")
        self.out, self.bias, self.weight_spec, self.bias_spec = out, bias, weight, bias_init

    def forward(self, x):
        if len(x.shape) < 2:
            raise ShapeError(f"fully connected input must be (N, ..., features), got {dims(x.shape)}")
        if len(x.shape) == 4:
            raise ShapeError(f"fully connected input of {dims(x.shape)}: use D.flatten first (or reshape it to "
                             "(..., features) to apply the layer to the last axis)")
        shapes = {"W": (self.out, x.shape[-1])}
        if self.bias:
            shapes["B"] = (self.out,)
        p = self._weights(shapes, {"W": self.weight_spec, "B": self.bias_spec})
        rows = reshape(x.node, (math.prod(x.shape[:-1]), x.shape[-1]))        # every position's features
        y = make("matmul", (rows, p["W"]), tb=True)
        if self.bias:
            y = ew_node(sym(0) + sym(1), [y, p["B"]])
        return Tensor(reshape(y, (*x.shape[:-1], self.out)))


def full(name: str, out: int, bias: bool = True, weight: Param | None = None,
         bias_init: Param | None = None) -> Layer:
    """Fully connected layer y = x W^T + b with `<name>_W` (out, in) and `<name>_B` (out,): on (N, in), or on the
    last axis of (N, T, in) (every token alike, as nn.Linear)."""
    what = _layer("D.full", name)
    return _Full(name, _positive_int(what, "out", out), _flag(what, "bias", bias),
                 _spec(what, "weight", weight, xavier()), _spec(what, "bias_init", bias_init, constant(0.0)))


class _Op(Layer):
    """A parameter-free layer applying one op (reusable anywhere)."""

    def __init__(self, label, describe, build: Callable[[Node], Node]):
        super().__init__(label, describe)
        self._build = build

    def forward(self, x):
        return Tensor(self._build(x.node))


def _pooling(what: str, kernel, stride, padding, ceil) -> tuple[int | None, int | None, int, bool]:
    """A pooling layer's checked kernel (None: the whole plane), stride (None: the kernel), padding and ceil mode."""
    kernel = None if kernel is None else _positive_int(what, "kernel", kernel)
    stride = None if stride is None else _positive_int(what, "stride", stride)
    padding = _nonnegative_int(what, "padding", padding)
    if kernel is not None and padding > kernel // 2:
        _reject(what, f"padding {padding} exceeds half the kernel {kernel}")
    return kernel, stride, padding, _flag(what, "ceil", ceil)


def max_pool(kernel: int | None, stride: int | None = None, padding: int = 0, ceil: bool = False) -> Layer:
    """Max pooling over kernel x kernel windows (stride defaults to the kernel; `ceil` rounds the output size up,
    as Caffe does); `kernel=None`: the maximum of each channel's whole plane, global max pooling."""
    kernel, stride, padding, ceil = _pooling("layer 'max_pool'", kernel, stride, padding, ceil)

    def build(x: Node) -> Node:
        if kernel is None and len(x.shape) == 4 and x.shape[2] != x.shape[3]:
            return _axis_max(_axis_max(x, 3), 2)       # a rectangle: the maximum of each row, then of those
        k = kernel or (x.shape[2] if len(x.shape) == 4 else 1)
        return make("max_pool", (x,), kernel=k, stride=stride or k, pad=padding, ceil=ceil)
    if kernel is None:
        return _Op("max_pool", "global max pooling", build)
    return _Op(f"max_pool({kernel})", f"max pooling {kernel}x{kernel}, stride {stride or kernel}, padding {padding}",
               build)


def avg_pool(kernel: int | None = None, stride: int | None = None, padding: int = 0, ceil: bool = False,
             include_pad: bool = True) -> Layer:
    """Average pooling; `kernel=None` averages each channel's whole plane (global average pooling, of any
    rectangle: the sum over the plane divided by its size where it is not square)."""
    what = "layer 'avg_pool'"
    kernel, stride, padding, ceil = _pooling(what, kernel, stride, padding, ceil)
    include_pad = _flag(what, "include_pad", include_pad)

    def build(x: Node) -> Node:
        if len(x.shape) == 4 and kernel is None:
            return _plane_mean(x)
        k = kernel or (x.shape[2] if len(x.shape) == 4 else 1)
        return make("avg_pool", (x,), kernel=k, stride=stride or k, pad=padding, ceil=ceil, include_pad=include_pad)
    return _Op("avg_pool" if kernel is None else f"avg_pool({kernel})", "average pooling", build)


def _plane_mean(x: Node) -> Node:
    """Each channel's mean over its (N, C, H, W) plane: one pooling window where the plane is square, else the sum
    over the plane divided by its size."""
    n, c, h, w = x.shape
    if h == w:
        return make("avg_pool", (x,), kernel=h, stride=h, pad=0, ceil=False, include_pad=True)
    return ew_node(sym(0) / (h * w), [sum_to(x, (n, c, 1, 1))])


def _adaptive(what: str, size) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, (tuple, list)) and len(size) == 2):
        _reject(what, f"size must be an int or a pair of ints, got {size!r}")
    return _positive_int(what, "size[0]", size[0]), _positive_int(what, "size[1]", size[1])


def _tiling_window(what: str, x: Node, oh: int, ow: int) -> int | None:
    """The side of the square windows of an adaptive pooling to oh x ow where they tile `x` (its height and width the
    same multiple of oh and ow), else None; a ShapeError unless x is 4-D."""
    if len(x.shape) != 4:
        raise ShapeError(f"{what} needs a 4-D input, got {dims(x.shape)}")
    h, w = x.shape[2:]
    return h // oh if h % oh == 0 and w % ow == 0 and h // oh == w // ow else None


def _per_window(x: Node, axis: int, size: int, reduce: Callable[[Node, int], Node]) -> Node:
    """`reduce` (a window of `axis` -> that axis of length 1) of each of PyTorch's adaptive windows of `axis` into
    `size`, [floor(i n / size), ceil((i + 1) n / size)), concatenated along `axis`."""
    n = x.shape[axis]
    return _concat([reduce(slice_axis(x, axis, i * n // size, -(-(i + 1) * n // size)), axis) for i in range(size)],
                   axis=axis)


def _axis_mean(x: Node, axis: int) -> Node:
    """The mean over `axis` (kept, of length 1)."""
    kept = tuple(1 if k == axis else d for k, d in enumerate(x.shape))
    return ew_node(sym(0) * (1.0 / x.shape[axis]), [sum_to(x, kept)])


def adaptive_avg_pool(size) -> Layer:
    """PyTorch's AdaptiveAvgPool2d(size) of any input: output row i averages input rows floor(i H / oh) up to
    ceil((i + 1) H / oh), and columns likewise. Size 1 is global average pooling; a size whose multiple each side
    is, an average pooling of that kernel; others, the mean of each window of rows, then of columns (a rectangle's
    mean is the mean of its rows' means)."""
    oh, ow = _adaptive("layer 'adaptive_avg_pool'", size)

    def build(x: Node) -> Node:
        k = _tiling_window("adaptive average pooling", x, oh, ow)
        if (oh, ow) == (1, 1):
            return _plane_mean(x)
        if k is not None:
            return make("avg_pool", (x,), kernel=k, stride=k, pad=0, ceil=False, include_pad=True)
        return _per_window(_per_window(x, 2, oh, _axis_mean), 3, ow, _axis_mean)
    return _Op(f"adaptive_avg_pool({oh}x{ow})", f"adaptive average pooling to {oh}x{ow}", build)


def adaptive_max_pool(size) -> Layer:
    """PyTorch's AdaptiveMaxPool2d(size) of any input: where its windows tile the input in squares, a max pooling of
    that kernel; else the maximum of each of PyTorch's windows of columns, then of rows (`_axis_max`)."""
    oh, ow = _adaptive("layer 'adaptive_max_pool'", size)

    def build(x: Node) -> Node:
        k = _tiling_window("adaptive max pooling", x, oh, ow)
        if k is not None:
            return make("max_pool", (x,), kernel=k, stride=k, pad=0, ceil=False)
        return _per_window(_per_window(x, 3, ow, _axis_max), 2, oh, _axis_max)
    return _Op(f"adaptive_max_pool({oh}x{ow})", f"adaptive max pooling to {oh}x{ow}", build)


# max(v0, v1), v0 on a tie (its derivative goes to v0 then, as PyTorch's to the first maximum); NaN propagates
_FIRST_MAX = sym(0) * sympy.Heaviside(sym(0) - sym(1), 1) + sym(1) * (1 - sympy.Heaviside(sym(0) - sym(1), 1))


def _axis_max(x: Node, axis: int) -> Node:
    """The maximum over `axis` (kept, of length 1), by rounds of a tournament between neighbours (positions 2i and
    2i + 1; an odd last one goes on alone): a tie goes to the earlier position, so the gradient reaches the first
    maximum, as PyTorch's max pooling sends it."""
    while x.shape[axis] > 1:
        n, shape = x.shape[axis], x.shape
        even = n - n % 2
        pairs = reshape(slice_axis(x, axis, 0, even), shape[:axis] + (even // 2, 2) + shape[axis + 1:])
        winners = reshape(ew_node(_FIRST_MAX, [slice_axis(pairs, axis + 1, 0, 1), slice_axis(pairs, axis + 1, 1, 2)]),
                          shape[:axis] + (even // 2,) + shape[axis + 1:])
        x = winners if n == even else _concat([winners, slice_axis(x, axis, n - 1, n)], axis)
    return x


def _activation(label: str, expr: sympy.Expr, out_grad: sympy.Expr | None = None,
                in_grad: sympy.Expr | None = None) -> Layer:
    f = expr.xreplace({v: sym(0)})
    in_grad = in_grad.xreplace({v: sym(0)}) if in_grad is not None else None
    return _Op(label, label, lambda x: ew_node(f, [x], out_grad=out_grad, in_grad=in_grad))


relu = _activation("relu", sympy.Max(v, 0), out_grad=sympy.Heaviside(Y, 0))
tanh = _activation("tanh", sympy.tanh(v), out_grad=1 - Y ** 2)
sigmoid = _activation("sigmoid", 1 / (1 + sympy.exp(-v)), out_grad=Y * (1 - Y))


def clipped_relu(ceiling: float) -> Layer:
    """min(max(v, 0), ceiling)."""
    ceiling = _positive_number("layer 'clipped_relu'", "ceiling", ceiling)
    return _activation(f"clipped_relu({ceiling:g})", sympy.Min(sympy.Max(v, 0), ceiling),
                       out_grad=sympy.Heaviside(Y, 0) * sympy.Heaviside(ceiling - Y, 0))


# the functions an elementwise expression may call: every backend computes them (numpy, C, CUDA)
ELEMENTWISE_FUNCTIONS = {f.__name__: f for f in (
    sympy.exp, sympy.log, sympy.sqrt, sympy.tanh, sympy.sinh, sympy.cosh, sympy.sin, sympy.cos, sympy.tan,
    sympy.atan, sympy.Abs, sympy.sign, sympy.erf, sympy.Max, sympy.Min, sympy.Heaviside)}
# besides them, the logistic function and softplus (written out, they are found and replaced by these: see
# `stable_forms`)
ELEMENTWISE_HELPERS = {"sigmoid": Sigmoid, "softplus": Softplus}
# and the constants a string may name (any other name is the user's own, never sympy's: read by sympy, `zoo`, `I` or
# `nan` would be complex infinity, the imaginary unit, not a number)
ELEMENTWISE_CONSTANTS = {"pi": sympy.pi, "E": sympy.E}
# and functions computed through those above (`_rewritten`): a complementary error function, inverse hyperbolic
# functions, and piecewise definitions with conditions on v (ELU, SELU, hardswish, hardsigmoid)
ELEMENTWISE_REWRITTEN = {"erfc": sympy.erfc, "asinh": sympy.asinh, "acosh": sympy.acosh, "atanh": sympy.atanh,
                         "Piecewise": sympy.Piecewise, "True": sympy.true}


def _rewritten(name: str, expr: sympy.Expr) -> sympy.Expr:
    """`expr` with the functions of ELEMENTWISE_REWRITTEN written through those deepdsl computes: erfc(u) as
    1 - erf(u), asinh(u) as sign(u) log(|u| + sqrt(u^2 + 1)) (no cancellation for negative u; acosh and atanh as
    logarithms likewise), and Piecewise((a, cond), ...,
    (z, True)) as steps: a H + (rest) (1 - H) with H = Heaviside of the condition (0 or 1 on its boundary as the
    condition says), where a condition on v against a number also clamps v in each branch to the side that branch
    is used on (ELU's exp(v) - 1 is computed at min(v, 0): no overflow where it is not used)."""
    expr = expr.replace(sympy.erfc, lambda u: 1 - sympy.erf(u))
    expr = expr.replace(sympy.asinh, lambda u: sympy.sign(u) * sympy.log(sympy.Abs(u) + sympy.sqrt(u ** 2 + 1)))
    expr = expr.replace(sympy.acosh, lambda u: sympy.log(u + sympy.sqrt(u ** 2 - 1)))
    expr = expr.replace(sympy.atanh, lambda u: sympy.log((1 + u) / (1 - u)) / 2)

    def steps(pieces) -> sympy.Expr:
        (value, condition), rest = pieces[0], pieces[1:]
        if condition == sympy.true or not rest:
            return value
        if not isinstance(condition, (sympy.StrictGreaterThan, sympy.GreaterThan, sympy.StrictLessThan,
                                      sympy.LessThan)):
            raise DeepDSLError(f"elementwise function '{name}': a piece's condition {condition} is not a comparison "
                               "(>, >=, <, <=) of two expressions in v", user_location())
        above = isinstance(condition, (sympy.StrictGreaterThan, sympy.GreaterThan))
        difference = condition.lhs - condition.rhs if above else condition.rhs - condition.lhs
        step = sympy.Heaviside(difference, 1 if isinstance(condition, (sympy.GreaterThan, sympy.LessThan)) else 0)
        otherwise = steps(rest)
        bound = condition.rhs if condition.lhs == v else condition.lhs if condition.rhs == v else None
        if bound is not None and bound.is_number:       # v against a number: each branch sees its side only
            v_above = v if condition.lhs == v else None
            inside, outside = (sympy.Max(v, bound), sympy.Min(v, bound)) if above == (v_above is not None) \
                else (sympy.Min(v, bound), sympy.Max(v, bound))
            value, otherwise = value.subs(v, inside), otherwise.subs(v, outside)
        return value * step + otherwise * (1 - step)

    return expr.replace(lambda e: isinstance(e, sympy.Piecewise), lambda e: steps(list(e.args)))


def elementwise(name: str, f, derivative=None) -> Layer:
    """A user-defined elementwise function from a sympy expression in `D.v`, a string, or a Python function of one
    sympy symbol, e.g. swish: `D.elementwise("swish", "v / (1 + exp(-v))")`, exact GELU:
    `"v * (1 + erf(v / sqrt(2))) / 2"`, Mish: `"v * tanh(softplus(v))"`. It may call the functions of
    ELEMENTWISE_FUNCTIONS and `sigmoid` and `softplus` (which a string names as such; written out as 1/(1 + exp(-u))
    and log(1 + exp(u)) they are found and computed in forms that do not overflow). Its derivative is derived by
    sympy, or is `derivative` when given (an expression in v written the same ways): a straight-through estimator
    (`D.elementwise("binarize", "sign(v)", derivative="1")`) or a form the user knows to be stabler."""
    _name("D.elementwise", name)
    expr = _user_expression(name, f, "")
    gradient = _user_expression(name, derivative, "derivative ") if derivative is not None else None
    return _activation(name, expr, in_grad=gradient)


def _user_expression(name: str, f, what: str) -> sympy.Expr:
    """A user function's expression (or its `what` = "derivative "), read and checked as `elementwise` says."""
    try:
        if isinstance(f, str):
            known = {"v": v, **ELEMENTWISE_FUNCTIONS, **ELEMENTWISE_HELPERS, **ELEMENTWISE_CONSTANTS,
                     **ELEMENTWISE_REWRITTEN}
            expr = sympy.sympify(f, locals={**_own_names(f, known), **known})
        elif callable(f) and not isinstance(f, sympy.Basic):
            expr = sympy.sympify(f(v))
        else:
            expr = sympy.sympify(f)
    except (sympy.SympifyError, SyntaxError, TypeError, ValueError, AttributeError):
        raise DeepDSLError(f"elementwise function '{name}': cannot read {what}{f!r} as an expression in v",
                           user_location()) from None
    if not isinstance(expr, sympy.Expr):
        raise DeepDSLError(f"elementwise function '{name}': {what}{f!r} is not an expression in v", user_location())
    written = repr(f if isinstance(f, str) else str(expr))
    expr = _rewritten(name, expr)
    extra = expr.free_symbols - {v}
    if extra:
        raise DeepDSLError(f"elementwise function '{name}' uses unknown symbols {sorted(map(str, extra))} in "
                           f"{'its derivative ' if what else ''}{written}; write it in terms of v (and pi, E)",
                           user_location())
    infinite = [str(c) for c in (sympy.zoo, sympy.oo, sympy.S.NegativeInfinity, sympy.nan, sympy.I) if expr.has(c)]
    if infinite:         # `1/0`, `log(0)` (zoo), `sqrt(-1)` (I), or a sympy expression holding them
        raise DeepDSLError(f"elementwise function '{name}': {what}{written} holds {', '.join(infinite)} (an infinity, "
                           "not-a-number or the imaginary unit), not finite real numbers", user_location())
    expr = stable_forms(expr)
    known = (*ELEMENTWISE_FUNCTIONS.values(), *ELEMENTWISE_HELPERS.values())
    unknown = sorted({type(e).__name__ for e in expr.atoms(sympy.Function) if type(e) not in known})
    if unknown:
        known = ", ".join(sorted(ELEMENTWISE_FUNCTIONS, key=str.lower) + sorted(ELEMENTWISE_HELPERS))
        raise DeepDSLError(f"elementwise function '{name}' calls {', '.join(unknown)}"
                           f"{' in its derivative' if what else ''}, which deepdsl cannot compute (it knows {known})",
                           user_location())
    return expr


def _own_names(text: str, known: dict) -> dict:
    """Every name `text` uses that is not `known`, as the user's own: a symbol, or a function where it is called (so
    that the checks of `_user_expression` refuse it by its name)."""
    import keyword
    import re
    names = {}
    for found in re.finditer(r"(?<![\w.])([A-Za-z_]\w*)(\s*\()?", text):    # not the e3 of 1e3, not attributes
        name = found.group(1)
        if keyword.iskeyword(name) and name not in known:      # `lambda`, `if`: Python, not an expression
            raise SyntaxError(name)
        if name not in known:
            names[name] = sympy.Function(name) if found.group(2) else sympy.Symbol(name)
    return names


def lrn(size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0) -> Layer:
    """Local response normalization across `size` channels."""
    what = "layer 'lrn'"
    size, alpha = _positive_int(what, "size", size), _nonnegative_number(what, "alpha", alpha)
    beta, k = _number(what, "beta", beta), _positive_number(what, "k", k)
    return _Op(f"lrn({size})", f"LRN size {size}",
               lambda x: make("lrn", (x,), size=size, alpha=float(alpha), beta=float(beta), k=float(k)))


class _Dropout(Layer):
    def __init__(self, ratio):
        super().__init__(f"dropout({ratio:g})", f"dropout {ratio:g}")
        self.ratio = float(ratio)

    def forward(self, x):
        return Tensor(make("dropout", (x.node,), ratio=self.ratio, key=_next_dropout_key()))


def dropout(ratio: float = 0.5) -> Layer:
    """Zero elements with probability `ratio` while training (each application draws its own mask); identity when
    testing."""
    return _Dropout(_fraction("layer 'dropout'", "ratio", ratio))



class _DropPath(Layer):
    def __init__(self, ratio):
        super().__init__(f"drop_path({ratio:g})", f"drop path {ratio:g}")
        self.ratio = float(ratio)

    def forward(self, x):
        return Tensor(make("dropout", (x.node,), ratio=self.ratio, key=_next_dropout_key(), per_sample=True))


def drop_path(ratio: float) -> Layer:
    """Stochastic depth (Huang et al. 2016), as torchvision's StochasticDepth(ratio, "row"): while training, each
    example's whole tensor is zeroed with probability `ratio` and the others scaled by 1/(1 - ratio), one draw per
    example from the program's masks (seed, step, place); identity when testing. Applied to a residual branch:
    `x + D.drop_path(0.1)(branch(x))`."""
    return _DropPath(_fraction("layer 'drop_path'", "ratio", ratio))


class _BatchNorm(_ParamLayer):
    def __init__(self, name, eps, momentum):
        super().__init__(name, "batch norm")
        self.eps, self.momentum = float(eps), float(momentum)

    def forward(self, x):
        if len(x.shape) not in (2, 4):
            raise ShapeError(f"batch norm input must be 2-D or 4-D, got {dims(x.shape)}")
        c = x.shape[1]
        p = self._weights({"W": (c,), "B": (c,)}, {"W": constant(1.0), "B": constant(0.0)})
        mean = _made(_state(f"{self.label}_mean", (c,), 0.0), f"layer '{self.label}'", self.defined_at)
        var = _made(_state(f"{self.label}_var", (c,), 1.0), f"layer '{self.label}'", self.defined_at)
        for leaf in (mean, var):
            provenance.record_leaf(leaf, self.label, self.describe)
        return Tensor(make("batch_norm", (x.node, p["W"], p["B"], mean, var), eps=self.eps, momentum=self.momentum))


class _LayerNorm(_ParamLayer):
    def __init__(self, name, axes, eps, affine):
        super().__init__(name, f"layer norm over the last {axes} axes")
        self.axes, self.eps, self.affine = axes, float(eps), affine

    def forward(self, x):
        if len(x.shape) <= self.axes:
            raise ShapeError(f"layer norm over the last {self.axes} axes needs an input of more axes, got "
                             f"{dims(x.shape)}")
        affine = ()
        if self.affine:
            shape = x.shape[len(x.shape) - self.axes:]
            p = self._weights({"W": shape, "B": shape}, {"W": constant(1.0), "B": constant(0.0)})
            affine = (p["W"], p["B"])
        return Tensor(make("layer_norm", (x.node, *affine), eps=self.eps, axes=self.axes))


def layer_norm(name: str, axes: int = 1, eps: float = 1e-5, affine: bool = True) -> Layer:
    """PyTorch's LayerNorm over the last `axes` axes: (x - mean) / sqrt(var + eps) (the biased variance), times
    `<name>_W` plus `<name>_B` (of those axes' shape; `affine=False`: neither)."""
    what = _layer("D.layer_norm", name)
    return _LayerNorm(name, _positive_int(what, "axes", axes), _positive_number(what, "eps", eps),
                      _flag(what, "affine", affine))


def pad_channels(before: int, after: int = 0) -> Layer:
    """Zero channels around the input's (axis 1): `before` in front, `after` behind (ResNet's option-A shortcut)."""
    what = "layer 'pad_channels'"
    before, after = _nonnegative_int(what, "before", before), _nonnegative_int(what, "after", after)
    return _Op(f"pad_channels({before},{after})", f"{before} zero channels before, {after} after",
               lambda x: make("pad_axis", (x,), axis=1, start=before, size=x.shape[1] + before + after)
               if before or after else x)


def batch_norm(name: str, eps: float = 1e-5, momentum: float = 0.1) -> Layer:
    """Batch normalization with weight `<name>_W`, bias `<name>_B` and running statistics `<name>_mean`,
    `<name>_var` (PyTorch's update rule and unbiased running variance; used when testing)."""
    what = _layer("D.batch_norm", name)
    momentum = _number(what, "momentum", momentum, "a number in [0, 1]", lambda f: 0 <= f <= 1)
    return _BatchNorm(name, _positive_number(what, "eps", eps), momentum)


def concat(*tensors: Tensor) -> Tensor:
    """Concatenate along channels (axis 1)."""
    nodes = [_node(t) for t in tensors]
    try:
        result = _concat(nodes, axis=1)
    except ShapeError as err:
        raise ShapeError(f"concat: {err.message}", user_location()) from None
    provenance.record_layer(result, nodes, "concat", f"concatenation of {len(nodes)} branches", False)
    return Tensor(result)


def add(*tensors: Tensor) -> Tensor:
    """Elementwise sum of tensors of one shape (residual connections)."""
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ShapeError("add of tensors of different shapes: " + ", ".join(dims(t.shape) for t in tensors),
                         user_location())
    result = ew_node(sympy.Add(*(sym(i) for i in range(len(tensors)))), [t.node for t in tensors])
    provenance.record_layer(result, [t.node for t in tensors], "add", f"sum of {len(tensors)} branches", False)
    return Tensor(result)


flatten = _Op("flatten", "flatten", lambda x: reshape(x, (x.shape[0], x.size // x.shape[0])))


def _last_axis(op: str) -> Callable[[Node], Node]:
    """`op` of (rows, K) applied over the last axis of any tensor of 2 or more axes (its rows, reshaped)."""
    def build(x: Node) -> Node:
        if len(x.shape) <= 2:
            return make(op, (x,))
        rows = reshape(x, (math.prod(x.shape[:-1]), x.shape[-1]))
        return reshape(make(op, (rows,)), x.shape)
    return build


softmax = _Op("softmax", "softmax", _last_axis("softmax"))


def _causal_softmax(x: Node) -> Node:
    if len(x.shape) < 2 or x.shape[-1] != x.shape[-2]:
        raise ShapeError(f"causal softmax needs (..., T, T) scores (query by key), got {dims(x.shape)}")
    rows = reshape(x, (math.prod(x.shape[:-1]), x.shape[-1]))
    return reshape(make("softmax", (rows,), causal=True), x.shape)


# attention's weights of a causal model: each query (axis -2) weighs only the keys (axis -1) at or before it
causal_softmax = _Op("causal_softmax", "causal softmax", _causal_softmax)


def _scores_shaped(t, scores_shape: tuple[int, ...], what: str) -> Tensor:
    """A mask or bias of attention that broadcasts to the scores' shape (a one-line error otherwise)."""
    if not isinstance(t, Tensor):
        _reject("D.attention", f"{what} must be a tensor")
    if not broadcasts_to(t.shape, scores_shape):
        raise ShapeError(f"D.attention: a {what} of {dims(t.shape)} does not broadcast to the scores' "
                         f"{dims(scores_shape)} (queries by keys)", user_location())
    return t


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
              dropout: float = 0.0, mask: Tensor | None = None, bias: Tensor | None = None,
              name: str | None = None) -> Tensor:
    """Scaled dot-product attention of queries (..., T, d), keys (..., S, d) and values (..., S, e), as PyTorch's
    scaled_dot_product_attention: softmax(q k^T scale + bias) v, scale 1 / sqrt(d) by default; `causal`: query i
    weighs only keys 0..i; `mask` (0/1, broadcast to (..., T, S)): the keys each query weighs are those of 1 (a
    boolean attn_mask; a key padding mask is `1 - tokens.eq(pad)` reshaped to (N, 1, 1, S)); `bias` (broadcast
    likewise): added to the scores (a float attn_mask: -inf leaves a key out); `dropout`: of the weights, while
    training; `name`: what the program calls it (its statements' section, `block1_attn`), else it is named after
    the layer its queries came from.

    One statement (the op `attention`, `deepdsl.ops.attention`): the (T, S) weights live only inside it, never
    between the forward and the backward; with `dropout` the training step draws a 0/1 mask of their shape (uint8),
    which the backward reads again."""
    what = "D.attention"
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        _reject(what, "q, k and v must be tensors")
    if len(q.shape) < 2 or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1] or \
            k.shape[:-1] != v.shape[:-1]:
        raise ShapeError(f"D.attention of q {dims(q.shape)}, k {dims(k.shape)}, v {dims(v.shape)}: needs (..., T, d), "
                         "(..., S, d) and (..., S, e)", user_location())
    if causal and q.shape[-2] != k.shape[-2]:
        raise ShapeError(f"D.attention(causal=True) needs as many queries as keys, got {q.shape[-2]} and "
                         f"{k.shape[-2]}", user_location())
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _number(what, "scale", scale, "a finite number",
                                                                        math.isfinite)
    scores_shape = (*q.shape[:-1], k.shape[-2])
    dropout = _fraction(what, "dropout", dropout)
    added = None
    if bias is not None:
        added = _scores_shaped(bias, scores_shape, "bias")
    if mask is not None:        # a key left out: the most negative float added to its score
        left_out = where(_scores_shaped(mask, scores_shape, "mask"), 0.0, -math.inf)
        added = left_out if added is None else added + left_out
    if added is not None and len(added.shape) < len(scores_shape):
        added = added.reshape(*(1,) * (len(scores_shape) - len(added.shape)), *added.shape)
    out = Tensor(attention_node(q.node, k.node, v.node, None if added is None else added.node, causal=causal,
                                scale=float(scale), dropout=dropout, key=_next_dropout_key() if dropout else None))
    return _recorded(out, (q, k, v, bias, mask), causal, name)


def _recorded(out: Tensor, inputs, causal: bool, name: str | None) -> Tensor:
    """`out` of D.attention with its nodes recorded as one layer: `name`, or named after the layer its queries came
    from (`block1_attn_q_attention`)."""
    what = ("causal " if causal else "") + "scaled dot-product attention"
    label = "attention" if name is None else _name("D.attention", name)
    provenance.record_layer(out.node, [t.node for t in inputs if t is not None], label, what, name is not None)
    return out


log_softmax = _Op("log_softmax", "log-softmax", lambda x: make("log_softmax", (x,)))
