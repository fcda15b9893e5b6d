"""The DSL network files are written in: tensors, layers as tensor functions composed with `@`, a solver, a Loop.

    network = fc2 @ D.relu @ fc1 @ D.flatten @ mp @ cv2 @ mp @ cv1     # `@` composes, right to left
    loss = (D.log_loss(y) @ D.softmax @ network)(x)

Applying a layer builds graph nodes right away, so shapes are checked while the network file runs; a mismatch is
reported as a `ShapeError` naming the layer, the shapes and the network-file line that defined the layer.
"""
from __future__ import annotations

import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy

from deepdsl.errors import DeepDSLError, ShapeError, SourceLocation, user_location
from deepdsl.ir import FLOAT, INT32, Node, make
from deepdsl.ops import dims
from deepdsl.ops import loss as L
from deepdsl.ops.elementwise import Y, reshape, sym
from deepdsl.ops.elementwise import elementwise as ew_node
from deepdsl.ops.leaf import Init
from deepdsl.ops.shape import concat as _concat

__all__ = [
    "Tensor", "Fn", "Layer", "images", "labels", "scalar", "conv", "full", "max_pool", "avg_pool", "relu", "tanh",
    "sigmoid", "clipped_relu", "lrn", "dropout", "batch_norm", "concat", "add", "flatten", "softmax", "log_softmax",
    "log_loss", "cross_entropy", "nll_loss", "precision", "elementwise", "fn", "xavier", "gaussian", "constant",
    "Param", "Train", "Adam", "Loop", "Overrides", "v",
]

v = sympy.Symbol("v", real=True)      # the variable of user-defined elementwise functions


# ----------------------------------------------------------------------------------------------------------------
# size overrides (tests and benchmarks run networks at a small batch and image size)

@dataclass(frozen=True)
class Overrides:
    """Replace the batch size and/or image height and width that a network file declares."""

    batch: int | None = None
    image: tuple[int, int] | None = None


_overrides: contextvars.ContextVar[Overrides] = contextvars.ContextVar("deepdsl_overrides", default=Overrides())
_dropout_keys: contextvars.ContextVar[Any] = contextvars.ContextVar("deepdsl_dropout_keys", default=None)


def _next_dropout_key() -> int:
    counter = _dropout_keys.get()
    if counter is None:
        counter = itertools.count(1)
        _dropout_keys.set(counter)
    return next(counter)


# ----------------------------------------------------------------------------------------------------------------
# tensors

class Tensor:
    """A value of the network: a graph node with arithmetic (`+`, `-`, `*`, `/` with tensors of the same shape,
    scalar tensors or numbers), e.g. `main_loss + 0.3 * aux_loss`."""

    __slots__ = ("node", "meta")

    def __init__(self, node: Node, meta: dict | None = None):
        self.node = node
        self.meta = meta or {}

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    def __repr__(self) -> str:
        return f"Tensor({dims(self.shape)})"

    def _binary(self, other, expr, symbol: str) -> "Tensor":
        if isinstance(other, (int, float)):
            return Tensor(ew_node(expr.subs(sym(1), other), [self.node]))
        if not isinstance(other, Tensor):
            return NotImplemented
        a, b = self.node, other.node
        if a.shape != b.shape and a.shape != () and b.shape != ():
            raise ShapeError(f"'{symbol}' of tensors of different shapes {dims(a.shape)} and {dims(b.shape)}",
                             user_location())
        return Tensor(ew_node(expr, [a, b]))

    def __add__(self, other):
        return self._binary(other, sym(0) + sym(1), "+")

    def __radd__(self, other):
        return self._binary(other, sym(1) + sym(0), "+")

    def __sub__(self, other):
        return self._binary(other, sym(0) - sym(1), "-")

    def __rsub__(self, other):
        return self._binary(other, sym(1) - sym(0), "-")

    def __mul__(self, other):
        return self._binary(other, sym(0) * sym(1), "*")

    def __rmul__(self, other):
        return self._binary(other, sym(1) * sym(0), "*")

    def __truediv__(self, other):
        return self._binary(other, sym(0) / sym(1), "/")

    def __neg__(self):
        return Tensor(ew_node(-sym(0), [self.node]))


def _node(t: Tensor | Node) -> Node:
    return t.node if isinstance(t, Tensor) else t


def images(name: str, shape: tuple[int, int, int, int], dataset: str = "synthetic") -> Tensor:
    """The input batch (N, C, H, W) of `dataset` (the default `--data` of the generated program)."""
    n, c, h, w = shape
    o = _overrides.get()
    n = o.batch or n
    h, w = o.image or (h, w)
    # the dataset rides on the node so that code generation finds the default `--data` from the compiled program
    node = make("input", (), name=name, shape=(n, c, h, w), dtype=FLOAT, role="data", dataset=dataset)
    return Tensor(node, {"dataset": dataset})


def labels(name: str, n: int, classes: int) -> Tensor:
    """Integer class labels (N,) in [0, classes)."""
    n = _overrides.get().batch or n
    return Tensor(make("input", (), name=name, shape=(n,), dtype=INT32, role="label"), {"classes": classes})


def scalar(name: str) -> Tensor:
    """A named float fed to every step (a hyperparameter)."""
    return Tensor(make("input", (), name=name, shape=(), dtype=FLOAT, role="hyper"))


# ----------------------------------------------------------------------------------------------------------------
# tensor functions

class Fn:
    """A tensor function. `f @ g` is f after g; `f(x)` applies it."""

    def __init__(self, apply: Callable[[Tensor], Tensor], label: str = "fn"):
        self._apply = apply
        self.label = label

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise DeepDSLError(f"{self.label} applied to {type(x).__name__}, expected a tensor", user_location())
        return self._apply(x)

    def __matmul__(self, other) -> "Fn":
        if not callable(other):
            return NotImplemented
        return Fn(lambda x: self(other(x)), f"{self.label} @ {getattr(other, 'label', 'fn')}")

    def __rmatmul__(self, other) -> "Fn":
        if not callable(other):
            return NotImplemented
        return Fn(lambda x: other(self(x)), f"{getattr(other, 'label', 'fn')} @ {self.label}")

    def __repr__(self) -> str:
        return f"Fn({self.label})"


def fn(f: Callable[[Tensor], Tensor], label: str | None = None) -> Fn:
    """Wrap a Python function from tensor to tensor (a subnet) so it composes with `@`."""
    return Fn(f, label or getattr(f, "__name__", "fn"))


class Layer(Fn):
    """A tensor function with a name (for errors and parameter names) and the line that defined it."""

    def __init__(self, label: str, describe: str):
        super().__init__(self.forward, label)
        self.describe = describe
        self.defined_at: SourceLocation | None = user_location()

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise DeepDSLError(f"layer '{self.label}' applied to {type(x).__name__}, expected a tensor",
                               self.defined_at)
        try:
            return self.forward(x)
        except ShapeError as err:
            if err.location is not None and getattr(err, "layer_done", False):
                raise
            applied = user_location()
            where = f" (applied at line {applied.lineno})" if applied and self.defined_at and \
                applied.lineno != self.defined_at.lineno else ""
            new = ShapeError(f"layer '{self.label}' ({self.describe}) on input {dims(x.shape)}: {err.message}{where}",
                             self.defined_at or applied)
            new.layer_done = True
            raise new from None


# ----------------------------------------------------------------------------------------------------------------
# parameters

@dataclass(frozen=True)
class Param:
    """A parameter's initializer with its learning-rate and weight-decay multipliers (Caffe's lr_mult/decay_mult)."""

    init: Init
    lr_mult: float = 1.0
    decay_mult: float = 1.0


def xavier(lr_mult: float = 1.0, decay_mult: float = 1.0) -> Param:
    """Caffe's xavier filler: uniform in +-sqrt(3 / fan_in)."""
    return Param(Init("xavier"), lr_mult, decay_mult)


def gaussian(std: float, lr_mult: float = 1.0, decay_mult: float = 1.0) -> Param:
    return Param(Init("gaussian", std=float(std)), lr_mult, decay_mult)


def constant(value: float = 0.0, lr_mult: float = 1.0, decay_mult: float = 1.0) -> Param:
    return Param(Init("constant", value=float(value)), lr_mult, decay_mult)


def _param(name: str, shape: tuple[int, ...], spec: Param) -> Node:
    return make("param", (), name=name, shape=tuple(shape), dtype=FLOAT, init=spec.init,
                lr_mult=float(spec.lr_mult), decay_mult=float(spec.decay_mult))


def _state(name: str, shape: tuple[int, ...], value: float) -> Node:
    return make("state", (), name=name, shape=tuple(shape), dtype=FLOAT, init=Init("constant", value=value))


class _ParamLayer(Layer):
    """A layer with parameters: applying it twice shares its weights (the inputs must agree in size)."""

    def _weights(self, shapes: dict[str, tuple[int, ...]], specs: dict[str, Param]) -> dict[str, Node]:
        made = {key: _param(f"{self.label}_{key}", shape, specs[key]) for key, shape in shapes.items()}
        previous = getattr(self, "_made", None)
        if previous is not None and any(previous[k] is not made[k] for k in made):
            raise ShapeError(f"used again on an input of another size: weights {dims(previous['W'].shape)} "
                             f"cannot be shared with {dims(made['W'].shape)}")
        self._made = made
        return made


# ----------------------------------------------------------------------------------------------------------------
# layers

class _Conv(_ParamLayer):
    def __init__(self, name, kernel, channels, stride, padding, bias, weight, bias_init):
        super().__init__(name, f"conv {kernel}x{kernel}, {channels} channels, stride {stride}, padding {padding}")
        self.kernel, self.channels, self.stride, self.padding = kernel, channels, stride, padding
        self.bias, self.weight_spec, self.bias_spec = bias, weight, bias_init

    def forward(self, x):
        if len(x.shape) != 4:
            raise ShapeError(f"convolution input must be 4-D (N,C,H,W), got {dims(x.shape)}")
        shapes = {"W": (self.channels, x.shape[1], self.kernel, self.kernel)}
        if self.bias:
            shapes["B"] = (self.channels,)
        p = self._weights(shapes, {"W": self.weight_spec, "B": self.bias_spec})
        inputs = [x.node, p["W"]] + ([p["B"]] if self.bias else [])
        return Tensor(make("conv2d", inputs, stride=self.stride, pad=self.padding))


def conv(name: str, kernel: int, channels: int, stride: int = 1, padding: int = 0, bias: bool = True,
         weight: Param | None = None, bias_init: Param | None = None) -> Layer:
    """2-D convolution with weights `<name>_W` (channels, in, kernel, kernel) and bias `<name>_B` (channels,)."""
    return _Conv(name, kernel, channels, stride, padding, bias, weight or xavier(), bias_init or constant(0.0))


class _Full(_ParamLayer):
    def __init__(self, name, out, bias, weight, bias_init):
        super().__init__(name, f"fully connected, {out} outputs")
        self.out, self.bias, self.weight_spec, self.bias_spec = out, bias, weight, bias_init

    def forward(self, x):
        if len(x.shape) != 2:
            raise ShapeError(f"fully connected input must be 2-D (N,features), got {dims(x.shape)}; "
                             "use D.flatten first")
        shapes = {"W": (self.out, x.shape[1])}
        if self.bias:
            shapes["B"] = (self.out,)
        p = self._weights(shapes, {"W": self.weight_spec, "B": self.bias_spec})
        y = make("matmul", (x.node, p["W"]), tb=True)
        if self.bias:
            y = ew_node(sym(0) + sym(1), [y, p["B"]])
        return Tensor(y)


def full(name: str, out: int, bias: bool = True, weight: Param | None = None,
         bias_init: Param | None = None) -> Layer:
    """Fully connected layer y = x W^T + b with `<name>_W` (out, in) and `<name>_B` (out,)."""
    return _Full(name, out, bias, weight or xavier(), bias_init or constant(0.0))


class _Op(Layer):
    """A parameter-free layer applying one op (reusable anywhere)."""

    def __init__(self, label, describe, build: Callable[[Node], Node]):
        super().__init__(label, describe)
        self._build = build

    def forward(self, x):
        return Tensor(self._build(x.node))


def max_pool(kernel: int, stride: int | None = None, padding: int = 0, ceil: bool = False) -> Layer:
    """Max pooling over kernel x kernel windows (stride defaults to the kernel; `ceil` rounds the output size up,
    as Caffe does)."""
    stride = stride or kernel
    return _Op(f"max_pool({kernel})", f"max pooling {kernel}x{kernel}, stride {stride}, padding {padding}",
               lambda x: make("max_pool", (x,), kernel=kernel, stride=stride, pad=padding, ceil=ceil))


def avg_pool(kernel: int | None = None, stride: int | None = None, padding: int = 0, ceil: bool = False,
             include_pad: bool = True) -> Layer:
    """Average pooling; `kernel=None` averages each channel's whole plane (global average pooling)."""
    def build(x: Node) -> Node:
        if len(x.shape) == 4 and kernel is None and x.shape[2] != x.shape[3]:
            raise ShapeError(f"global average pooling needs a square input, got {dims(x.shape)}")
        k = kernel or (x.shape[2] if len(x.shape) == 4 else 1)
        return make("avg_pool", (x,), kernel=k, stride=stride or k, pad=padding, ceil=ceil, include_pad=include_pad)
    return _Op("avg_pool" if kernel is None else f"avg_pool({kernel})", "average pooling", build)


def _activation(label: str, expr: sympy.Expr, out_grad: sympy.Expr | None = None) -> Layer:
    f = expr.xreplace({v: sym(0)})
    return _Op(label, label, lambda x: ew_node(f, [x], out_grad=out_grad))


relu = _activation("relu", sympy.Max(v, 0), out_grad=sympy.Heaviside(Y, 0))
tanh = _activation("tanh", sympy.tanh(v), out_grad=1 - Y ** 2)
sigmoid = _activation("sigmoid", 1 / (1 + sympy.exp(-v)), out_grad=Y * (1 - Y))


def clipped_relu(ceiling: float) -> Layer:
    """min(max(v, 0), ceiling)."""
    return _activation(f"clipped_relu({ceiling:g})", sympy.Min(sympy.Max(v, 0), ceiling),
                       out_grad=sympy.Heaviside(Y, 0) * sympy.Heaviside(ceiling - Y, 0))


def elementwise(name: str, f) -> Layer:
    """A user-defined elementwise function from a sympy expression in `D.v`, a string, or a Python function of one
    sympy symbol, e.g. swish: `D.elementwise("swish", "v / (1 + exp(-v))")`. Its derivative is derived by sympy."""
    if isinstance(f, str):
        expr = sympy.sympify(f, locals={"v": v})
    elif callable(f) and not isinstance(f, sympy.Basic):
        expr = sympy.sympify(f(v))
    else:
        expr = sympy.sympify(f)
    extra = expr.free_symbols - {v}
    if extra:
        raise DeepDSLError(f"elementwise function '{name}' uses unknown symbols {sorted(map(str, extra))}; "
                           "write it in terms of v", user_location())
    return _activation(name, expr)


def lrn(size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0) -> Layer:
    """Local response normalization across `size` channels."""
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
    return _Dropout(ratio)


class _BatchNorm(_ParamLayer):
    def __init__(self, name, eps, momentum):
        super().__init__(name, "batch norm")
        self.eps, self.momentum = float(eps), float(momentum)

    def forward(self, x):
        if len(x.shape) not in (2, 4):
            raise ShapeError(f"batch norm input must be 2-D or 4-D, got {dims(x.shape)}")
        c = x.shape[1]
        p = self._weights({"W": (c,), "B": (c,)}, {"W": constant(1.0), "B": constant(0.0)})
        mean = _state(f"{self.label}_mean", (c,), 0.0)
        var = _state(f"{self.label}_var", (c,), 1.0)
        return Tensor(make("batch_norm", (x.node, p["W"], p["B"], mean, var), eps=self.eps, momentum=self.momentum))


def batch_norm(name: str, eps: float = 1e-5, momentum: float = 0.1) -> Layer:
    """Batch normalization with weight `<name>_W`, bias `<name>_B` and running statistics `<name>_mean`,
    `<name>_var` (PyTorch's update rule and unbiased running variance; used when testing)."""
    return _BatchNorm(name, eps, momentum)


def concat(*tensors: Tensor) -> Tensor:
    """Concatenate along channels (axis 1)."""
    nodes = [_node(t) for t in tensors]
    try:
        return Tensor(_concat(nodes, axis=1))
    except ShapeError as err:
        raise ShapeError(f"concat: {err.message}", user_location()) from None


def add(*tensors: Tensor) -> Tensor:
    """Elementwise sum of tensors of one shape (residual connections)."""
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ShapeError("add of tensors of different shapes: " + ", ".join(dims(t.shape) for t in tensors),
                         user_location())
    return Tensor(ew_node(sympy.Add(*(sym(i) for i in range(len(tensors)))), [t.node for t in tensors]))


flatten = _Op("flatten", "flatten", lambda x: reshape(x, (x.shape[0], x.size // x.shape[0])))
softmax = _Op("softmax", "softmax", lambda x: make("softmax", (x,)))
log_softmax = _Op("log_softmax", "log-softmax", lambda x: make("log_softmax", (x,)))


def _label_fn(label: str, y: Tensor, build: Callable[[Node, Node], Node]) -> Layer:
    def check(x: Node) -> Node:
        classes = y.meta.get("classes")
        if classes is not None and len(x.shape) == 2 and x.shape[1] != classes:
            raise ShapeError(f"{x.shape[1]} scores per example for {classes} classes")
        return build(x, y.node)
    return _Op(label, label, check)


def log_loss(y: Tensor) -> Layer:
    """-mean log p[label] of probabilities (apply after softmax)."""
    return _label_fn("log_loss", y, L.log_loss)


def cross_entropy(y: Tensor) -> Layer:
    """Softmax cross entropy of logits: -mean log_softmax(z)[label]."""
    return _label_fn("cross_entropy", y, L.cross_entropy)


def nll_loss(y: Tensor) -> Layer:
    """-mean of log-probabilities at the labels (apply after log_softmax)."""
    return _label_fn("nll_loss", y, L.nll)


def precision(y: Tensor) -> Layer:
    """Top-1 accuracy of scores against labels."""
    return _label_fn("precision", y, lambda x, labels: make("precision", (x, labels)))


# ----------------------------------------------------------------------------------------------------------------
# training

@dataclass(frozen=True)
class Train:
    """The solver: SGD with momentum, weight decay (added to the gradient before momentum, as PyTorch does) and
    global gradient-norm clipping (`clip`, 0 = none), or Adam (`optimizer="adam"`)."""

    name: str
    iters: int = 1000
    test_iters: int = 10
    lr: float = 0.01
    momentum: float = 0.9
    decay: float = 0.0
    clip: float = 0.0
    optimizer: str = "sgd"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        if self.optimizer not in ("sgd", "adam"):
            raise DeepDSLError(f"Train: unknown optimizer '{self.optimizer}' (use 'sgd' or 'adam')", user_location())
        for key in ("iters", "test_iters"):
            if getattr(self, key) < 0:
                raise DeepDSLError(f"Train: {key} must be >= 0", user_location())
        if self.lr <= 0:
            raise DeepDSLError("Train: lr must be > 0", user_location())


def Adam(name: str, iters: int = 1000, test_iters: int = 10, lr: float = 1e-3, betas=(0.9, 0.999),
         eps: float = 1e-8, decay: float = 0.0, clip: float = 0.0) -> Train:
    return Train(name, iters, test_iters, lr, 0.0, decay, clip, "adam", tuple(betas), eps)


@dataclass
class Loop:
    """What a network file compiles: a scalar training loss, a scalar test accuracy and the solver."""

    loss: Tensor
    accuracy: Tensor
    solver: Train
    source: str | None = field(default=None, compare=False)

    def __post_init__(self):
        for what in ("loss", "accuracy"):
            t = getattr(self, what)
            if not isinstance(t, Tensor) or t.shape != ():
                got = dims(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise DeepDSLError(f"Loop: {what} must be a scalar tensor, got {got}", user_location())
        if not isinstance(self.solver, Train):
            raise DeepDSLError("Loop: solver must be a D.Train(...)", user_location())
        self.defined_at = user_location()

    @property
    def name(self) -> str:
        return self.solver.name
