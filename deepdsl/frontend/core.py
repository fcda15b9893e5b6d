"""Argument checks, size overrides, tensors and the network's inputs, tensor functions composed with `@`, and
parameters: what the layers of `deepdsl.frontend.layers` are made of."""
from __future__ import annotations

import contextvars
import itertools
import keyword
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import sympy

from deepdsl.errors import ArgumentError, DeepDSLError, ShapeError, SourceLocation, user_location
from deepdsl import provenance
from deepdsl.ir import FLOAT, INT32, Node, make
from deepdsl.ops import dims
from deepdsl.ops.elementwise import broadcast_shapes, broadcast_to, broadcasts_to, reshape, sum_to, sym
from deepdsl.ops.elementwise import elementwise as ew_node
from deepdsl.ops.leaf import Init
from deepdsl.ops.shape import slice_axis, transpose

v = sympy.Symbol("v", real=True)      # the variable of user-defined elementwise functions


# ----------------------------------------------------------------------------------------------------------------
# argument checks: a bad argument is one line naming what it defines, the argument and the network-file line

# user-chosen names become tensor names, file names, a class name and comments of the generated program
_NAME = re.compile(r"[A-Za-z0-9_]+")
# the data and label inputs are arguments of the generated step functions (deepdsl/codegen/steps.py), so their names
# must not be Python keywords nor the names those functions give their other arguments, locals and kernels
_STEP_NAMES = frozenset({"self", "step", "lr", "momentum", "decay", "bias1", "bias2", "rt", "mem", "T", "loss",
                         "accuracy", "ranks", "probabilities", "outputs"})


def _reject(what: str, message: str) -> NoReturn:
    raise ArgumentError(f"{what}: {message}", user_location())


def _name(what: str, name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        _reject(what, f"name must be ASCII letters, digits and underscores, got {name!r}")
    return name


def _stored_name(what: str, tensor: str) -> None:
    """A parameter's or state's name, `tensor`, kept clear of the checkpoint's metadata entries (`__iteration__`,
    `__seed__`: every name beginning with `__`), checked where the layer or parameter is defined."""
    if tensor.startswith("__"):
        _reject(what, f"its tensors would be named '{tensor}', and names beginning with '__' are reserved for the "
                      "checkpoint's metadata; choose another name")


def _input_name(kind: str, name: Any) -> str:
    """How errors name a data or label input, once its name is checked."""
    what = f"{kind} '{_name(f'D.{kind}', name)}'"
    if keyword.iskeyword(name):
        _reject(what, f"name '{name}' is a Python keyword; choose another")
    if name in _STEP_NAMES:
        _reject(what, f"name '{name}' is taken by the generated step functions; choose another")
    return what


def _integer(what: str, field: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        kind = "a positive integer" if least == 1 else "a non-negative integer"
        _reject(what, f"{field} must be {kind}, got {value!r}")
    return int(value)


def _positive_int(what: str, field: str, value: Any) -> int:
    return _integer(what, field, value, 1)


def _nonnegative_int(what: str, field: str, value: Any) -> int:
    return _integer(what, field, value, 0)


def _number(what: str, field: str, value: Any, rule: str = "a finite number",
            fits: Callable[[float], bool] = lambda _: True) -> float:
    """`value` as a float: a finite real number for which `fits` holds (`rule` says so in words)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not fits(float(value)):
        _reject(what, f"{field} must be {rule}, got {value!r}")
    return float(value)


def _positive_number(what: str, field: str, value: Any) -> float:
    return _number(what, field, value, "a positive finite number", lambda f: f > 0)


def _nonnegative_number(what: str, field: str, value: Any) -> float:
    return _number(what, field, value, "a non-negative finite number", lambda f: f >= 0)


def _fraction(what: str, field: str, value: Any) -> float:
    return _number(what, field, value, "a number in [0, 1)", lambda f: 0 <= f < 1)


def _flag(what: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _reject(what, f"{field} must be True or False, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------------------
# size overrides (tests and benchmarks run networks at a small batch and image size)

@dataclass(frozen=True)
class Overrides:
    """Replace the batch size and/or image height and width that a network file declares."""

    batch: int | None = None
    image: tuple[int, int] | None = None

    def __post_init__(self):
        if self.batch is not None:
            _positive_int("Overrides", "batch", self.batch)
        if self.image is not None:
            if not isinstance(self.image, (tuple, list)) or len(self.image) != 2:
                _reject("Overrides", f"image must be (height, width), got {self.image!r}")
            for what, size in zip(("image height", "image width"), self.image):
                _positive_int("Overrides", what, size)


_overrides: contextvars.ContextVar[Overrides] = contextvars.ContextVar("deepdsl_overrides", default=Overrides())
_dropout_keys: contextvars.ContextVar[Any] = contextvars.ContextVar("deepdsl_dropout_keys", default=None)
# while a network file loads: each named leaf (input, parameter, running statistic) -> what made it and where, so
# that `check_names` can point at the lines of two different leaves of one name
_leaf_makers: contextvars.ContextVar[dict | None] = contextvars.ContextVar("deepdsl_leaf_makers", default=None)


def _made(node: Node, maker: str, location: SourceLocation | None) -> Node:
    """`node`, noted as made by `maker` at `location` (the first maker of a hash-consed node is kept)."""
    makers = _leaf_makers.get()
    if makers is not None:
        makers.setdefault(node, (maker, location))
    return node


def _next_dropout_key() -> int:
    counter = _dropout_keys.get()
    if counter is None:
        counter = itertools.count(1)
        _dropout_keys.set(counter)
    return next(counter)


# ----------------------------------------------------------------------------------------------------------------
# tensors

class Tensor:
    """A value of the network: a graph node with arithmetic (`+`, `-`, `*`, `/` with tensors whose shapes broadcast
    as numpy's do, or numbers; `**` a number), e.g. `main_loss + 0.3 * aux_loss`, `x * gate.reshape(n, c, 1, 1)`,
    and `reshape`, `sum` and `mean` over axes, ranges of axes (`t[:, 4:8]`), `transpose` of two axes and `@`, the
    matrix product (batched)."""

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
            _number(f"'{symbol}' of a tensor and a number", "the number", other)
            return Tensor(ew_node(expr.subs(sym(1), other), [self.node]))
        if not isinstance(other, Tensor):
            return NotImplemented
        a, b = self.node, other.node
        try:
            broadcast_shapes(a.shape, b.shape)
        except ValueError:
            hint = ""
            small, big = sorted((a.shape, b.shape), key=len)
            if len(small) < len(big) and big[:len(small)] == small:
                kept = small + (1,) * (len(big) - len(small))
                hint = f" (to apply {dims(small)} per position, reshape it: .reshape{kept})"
            raise ShapeError(f"'{symbol}' of tensors of shapes {dims(a.shape)} and {dims(b.shape)}, which do not "
                             f"broadcast{hint}", user_location()) from None
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

    def __pow__(self, exponent):
        _number("'**' of a tensor", "the exponent", exponent)
        return Tensor(ew_node(sym(0) ** sympy.nsimplify(exponent), [self.node]))

    def __matmul__(self, other):
        """Matrix product over the last two axes, batched over the leading ones (which must agree), e.g. attention's
        `q @ k.transpose(-2, -1)`."""
        if not isinstance(other, Tensor):
            return NotImplemented
        a, b = self.shape, other.shape
        if len(a) < 2 or len(a) != len(b) or a[:-2] != b[:-2] or a[-1] != b[-2]:
            raise ShapeError(f"'@' of tensors of shapes {dims(a)} and {dims(b)}: a product needs (..., m, k) and "
                             "(..., k, n) with the same leading axes", user_location())
        return Tensor(make("matmul", (self.node, other.node)))

    def __getitem__(self, index) -> "Tensor":
        """Contiguous ranges of axes, as numpy's basic slicing without steps: `t[:, 4:8]` (channels 4 to 7),
        `t[..., :16]`; a copy."""
        index = index if isinstance(index, tuple) else (index,)
        if index.count(Ellipsis) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in index):
            raise ShapeError(f"index {index!r}: a tensor takes ranges (start:stop) of its axes and one '...'",
                             user_location())
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (len(self.shape) - len(index) + 1) + index[at + 1:]
        if len(index) > len(self.shape):
            raise ShapeError(f"index of {len(index)} axes into a tensor of {dims(self.shape)}", user_location())
        node = self.node
        for axis, part in enumerate(index):
            start, stop, step = part.indices(self.shape[axis])
            if step != 1 or start >= stop:
                raise ShapeError(f"index {part} of axis {axis} ({self.shape[axis]} long): deepdsl takes non-empty "
                                 "ranges without steps", user_location())
            node = slice_axis(node, axis, start, stop)
        return Tensor(node)

    def transpose(self, i: int, j: int) -> "Tensor":
        """The tensor with axes `i` and `j` swapped (negative from the end), as torch.transpose (a copy)."""
        i, j = _axes(self.shape, i)[0], _axes(self.shape, j)[0]
        return Tensor(transpose(self.node, i, j))

    def permute(self, *axes) -> "Tensor":
        """The tensor with its axes reordered, as torch.permute: axis k of the result is axis `axes[k]` of this one
        (negative from the end); made of swaps of two axes (`transpose`), each a copy."""
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else tuple(axes)
        rank = len(self.shape)
        if len(axes) != rank or sorted(a % rank if isinstance(a, int) and -rank <= a < rank else -1
                                       for a in axes) != list(range(rank)):
            raise ShapeError(f"permute{axes!r} of a tensor of {dims(self.shape)}: give each of its {rank} axes "
                             "once", user_location())
        order, node = list(range(rank)), self.node           # order[k]: the original axis now at position k
        for k, want in enumerate(a % rank for a in axes):
            at = order.index(want)
            if at != k:
                node = transpose(node, k, at)
                order[k], order[at] = order[at], order[k]
        return Tensor(node)

    def eq(self, value: float) -> "Tensor":
        """A 0/1 mask of this tensor's shape: 1 where it equals `value` (tokens equal to a padding token: a padding
        mask); no gradient flows through it."""
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ArgumentError(f"eq({value!r}): compare with a finite number", user_location())
        return Tensor(make("equal", (self.node,), value=float(value)))

    def masked_fill(self, mask: "Tensor", value: float) -> "Tensor":
        """This tensor with `value` where `mask` (0/1, broadcast to its shape) is 1, as torch.masked_fill; an
        infinite `value` is the largest finite float32 of its sign (a masked score then weighs exactly 0 after a
        softmax, as with -inf, but a row masked whole is uniform, not NaN)."""
        if not isinstance(mask, Tensor):
            raise ArgumentError("masked_fill: the mask must be a tensor (e.g. tokens.eq(0))", user_location())
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise ArgumentError(f"masked_fill(..., {value!r}): the value must be a number", user_location())
        value = max(-FLOAT32_MAX, min(FLOAT32_MAX, float(value)))
        return Tensor(ew_node(sym(0) * (1 - sym(1)) + sympy.Float(value) * sym(1),
                              [self.node, _broadcastable(mask.node, self.shape, "masked_fill")]))

    def expand(self, *shape) -> "Tensor":
        """The tensor repeated along its axes of size 1 to `shape` (-1: keep the size), as torch.expand: a
        parameter broadcast along the batch (ViT's class token); its gradient the sum over the copies."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if len(shape) != len(self.shape) or not all(isinstance(d, int) and (d == -1 or d > 0) for d in shape):
            raise ShapeError(f"expand{shape!r} of a tensor of {dims(self.shape)}: give a size (or -1) for each "
                             "axis", user_location())
        target = tuple(have if want == -1 else want for have, want in zip(self.shape, shape))
        if any(have not in (1, want) for have, want in zip(self.shape, target)):
            raise ShapeError(f"expand of {dims(self.shape)} to {dims(target)}: only axes of size 1 grow",
                             user_location())
        return Tensor(broadcast_to(self.node, target))

    def reshape(self, *shape) -> "Tensor":
        """The same elements in another shape (a view: no copy)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape) or \
                math.prod(shape) != math.prod(self.shape):
            raise ShapeError(f"cannot reshape {dims(self.shape)} to {shape}", user_location())
        return Tensor(reshape(self.node, shape))

    def sum(self, axis=None, keepdims: bool = False) -> "Tensor":
        """The sum over `axis` (an int, a tuple of them, negative from the end; None: all), keeping them as size-1
        axes with `keepdims`."""
        axes = _axes(self.shape, axis)
        kept = tuple(1 if k in axes else d for k, d in enumerate(self.shape))
        total = sum_to(self.node, kept)
        return Tensor(total if keepdims else reshape(total, tuple(d for k, d in enumerate(self.shape)
                                                                   if k not in axes)))

    def mean(self, axis=None, keepdims: bool = False) -> "Tensor":
        """The mean over `axis` (as `sum`)."""
        count = math.prod(self.shape[k] for k in _axes(self.shape, axis))
        return self.sum(axis, keepdims) * (1.0 / count)


FLOAT32_MAX = 3.4028234663852886e38


def _broadcastable(node: Node, shape: tuple[int, ...], what: str) -> Node:
    if not broadcasts_to(node.shape, shape):
        raise ShapeError(f"{what}: a mask of {dims(node.shape)} does not broadcast to {dims(shape)}", user_location())
    return node


def where(condition: Tensor, a, b) -> Tensor:
    """`a` where `condition` (a 0/1 mask) is 1, else `b`, as torch.where; `a` and `b` tensors or numbers,
    broadcast together (an infinite number is the largest finite float32 of its sign)."""
    if not isinstance(condition, Tensor):
        raise ArgumentError("D.where: the condition must be a mask tensor (e.g. tokens.eq(0))", user_location())
    operands, terms = [condition.node], []
    for value in (a, b):
        if isinstance(value, Tensor):
            operands.append(value.node)
            terms.append(sym(len(operands) - 1))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            terms.append(sympy.Float(max(-FLOAT32_MAX, min(FLOAT32_MAX, float(value)))))
        else:
            raise ArgumentError(f"D.where: {value!r} is neither a tensor nor a number", user_location())
    try:
        broadcast_shapes(*(n.shape for n in operands))
    except ValueError:
        raise ShapeError("D.where of shapes " + ", ".join(dims(n.shape) for n in operands) + " that do not "
                         "broadcast together", user_location()) from None
    return Tensor(ew_node(terms[0] * sym(0) + terms[1] * (1 - sym(0)), operands))


def _axes(shape: tuple[int, ...], axis) -> tuple[int, ...]:
    """`axis` (None, an int or ints, negative from the end) as sorted non-negative axes of `shape`."""
    if axis is None:
        return tuple(range(len(shape)))
    given = (axis,) if isinstance(axis, int) and not isinstance(axis, bool) else tuple(axis)
    axes = []
    for a in given:
        if not isinstance(a, int) or isinstance(a, bool) or not -len(shape) <= a < len(shape):
            raise ShapeError(f"axis {a!r} is not an axis of a tensor of {dims(shape)}", user_location())
        axes.append(a % len(shape))
    return tuple(sorted(set(axes)))


def _node(t: Tensor | Node) -> Node:
    return t.node if isinstance(t, Tensor) else t


def images(name: str, shape: tuple[int, int, int, int], dataset: str = "synthetic") -> Tensor:
    """The input batch (N, C, H, W) of `dataset` (the default `--data` of the generated program)."""
    what = _input_name("images", name)
    if not isinstance(shape, (tuple, list)) or len(shape) != 4:
        _reject(what, f"shape must be (N, C, H, W), got {shape!r}")
    n, c, h, w = (_positive_int(what, axis, size) for axis, size in zip(("batch", "channels", "height", "width"),
                                                                          shape))
    _dataset_spec(what, dataset)
    o = _overrides.get()
    n = o.batch or n
    h, w = o.image or (h, w)
    # the dataset rides on the node so that code generation finds the default `--data` from the compiled program
    node = make("input", (), name=name, shape=(n, c, h, w), dtype=FLOAT, role="data", dataset=dataset)
    return Tensor(_made(node, what, user_location()), {"dataset": dataset})


def _dataset_spec(what: str, dataset: Any) -> None:
    """The spec is written into the generated program's docstring and options."""
    if not isinstance(dataset, str) or not dataset or not dataset.isprintable() or '"' in dataset or "\\" in dataset:
        _reject(what, f"dataset must be a data spec such as 'digits' or 'npz:PATH' (printable, no quotes or "
                      f"backslashes), got {dataset!r}")


def tokens(name: str, shape: tuple[int, int], vocab: int, dataset: str = "synthetic") -> Tensor:
    """The input batch of N integer token sequences of length T, (N, T) in [0, vocab), of `dataset` (the default
    `--data` of the generated program; `text:PATH` reads a file's bytes as tokens: vocab 256)."""
    what = _input_name("tokens", name)
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        _reject(what, f"shape must be (N, T), got {shape!r}")
    n, t = (_positive_int(what, axis, size) for axis, size in zip(("batch", "length"), shape))
    vocab = _positive_int(what, "vocab", vocab)
    _dataset_spec(what, dataset)
    n = _overrides.get().batch or n
    node = make("input", (), name=name, shape=(n, t), dtype=INT32, role="data", dataset=dataset)
    return Tensor(_made(node, what, user_location()), {"dataset": dataset, "vocab": vocab})


def labels(name: str, n, classes: int) -> Tensor:
    """Integer class labels (N,) in [0, classes); or, for a batch of sequences, one per position: n = (N, T) (a
    language model's next tokens)."""
    what = _input_name("labels", name)
    if isinstance(n, (tuple, list)) and len(n) == 2:
        shape = tuple(_positive_int(what, axis, size) for axis, size in zip(("batch", "length"), n))
    else:
        shape = (_positive_int(what, "batch", n),)
    classes = _positive_int(what, "classes", classes)
    shape = (_overrides.get().batch or shape[0],) + shape[1:]
    node = make("input", (), name=name, shape=shape, dtype=INT32, role="label")
    return Tensor(_made(node, what, user_location()), {"classes": classes})


def targets(name: str, shape: tuple[int, ...]) -> Tensor:
    """Float targets (N, ...) a network's output is compared with (a regression's values, an autoencoder's images),
    the label input of the step; e.g. `loss = D.mse_loss(y)(network(x))`."""
    what = _input_name("targets", name)
    if not isinstance(shape, (tuple, list)) or not shape:
        _reject(what, f"shape must be (N, ...), got {shape!r}")
    shape = tuple(_positive_int(what, f"size {k}", d) for k, d in enumerate(shape))
    shape = (_overrides.get().batch or shape[0],) + shape[1:]
    node = make("input", (), name=name, shape=shape, dtype=FLOAT, role="label")
    return Tensor(_made(node, what, user_location()))


def scalar(name: str) -> Tensor:
    """A named float fed to every step (a hyperparameter)."""
    what = f"scalar '{_name('D.scalar', name)}'"
    return Tensor(_made(make("input", (), name=name, shape=(), dtype=FLOAT, role="hyper"), what, user_location()))


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
    """A tensor function with a name (for errors and parameter names) and the line that defined it. The values an
    application makes are recorded as this layer's (`deepdsl.provenance`): a `named` layer's under its own name,
    another's (`relu`) under the name of the named layer before it (`fc1_relu`)."""

    named = False

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
            y = self.forward(x)
            if any(size < 1 for size in y.shape):
                raise ShapeError(f"output shape {dims(y.shape)} has a dimension below 1")
            provenance.record_layer(y.node, [x.node], self.label, self.describe, self.named)
            return y
        except ShapeError as err:
            if err.location is not None and getattr(err, "layer_done", False):
                raise
            applied = user_location()
            where = f" (applied at line {applied.lineno})" if applied and self.defined_at and \
                applied.lineno != self.defined_at.lineno else ""
            new = type(err)(f"layer '{self.label}' ({self.describe}) on input {dims(x.shape)}: {err.message}{where}",
                            self.defined_at or applied)          # (a SizeError stays one)
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

    def __post_init__(self):
        if not isinstance(self.init, Init):
            _reject("D.Param", f"init must be an initializer, got {self.init!r}")
        _nonnegative_number("D.Param", "lr_mult", self.lr_mult)
        _nonnegative_number("D.Param", "decay_mult", self.decay_mult)


def xavier(lr_mult: float = 1.0, decay_mult: float = 1.0) -> Param:
    """Caffe's xavier filler: uniform in +-sqrt(3 / fan_in)."""
    return Param(Init("xavier"), lr_mult, decay_mult)


def gaussian(std: float, lr_mult: float = 1.0, decay_mult: float = 1.0) -> Param:
    return Param(Init("gaussian", std=_positive_number("D.gaussian", "std", std)), lr_mult, decay_mult)


def constant(value: float = 0.0, lr_mult: float = 1.0, decay_mult: float = 1.0) -> Param:
    return Param(Init("constant", value=_number("D.constant", "value", value)), lr_mult, decay_mult)


def _spec(what: str, field: str, value: Any, default: Param) -> Param:
    """A layer's initializer argument: `default` for None."""
    if value is None:
        return default
    if not isinstance(value, Param):
        _reject(what, f"{field} must be an initializer such as D.xavier() or D.constant(0.0), got {value!r}")
    return value


def _param(name: str, shape: tuple[int, ...], spec: Param) -> Node:
    return make("param", (), name=name, shape=tuple(shape), dtype=FLOAT, init=spec.init,
                lr_mult=float(spec.lr_mult), decay_mult=float(spec.decay_mult))


def param(name: str, shape: tuple[int, ...], init: Param | None = None) -> Tensor:
    """A learned tensor of its own, e.g. a Transformer's position embeddings `D.param("pos", (1, 16, 64),
    D.gaussian(0.02))` (added to (N, 16, 64) tokens by broadcasting); `init` defaults to N(0, 0.02^2)."""
    what = f"D.param '{_name('D.param', name)}'"
    _stored_name(what, name)
    if not isinstance(shape, (tuple, list)) or not shape or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        _reject(what, f"shape must be a tuple of positive sizes, got {shape!r}")
    leaf = _made(_param(name, tuple(shape), _spec(what, "init", init, gaussian(0.02))), what, user_location())
    provenance.record_leaf(leaf, name, f"parameter {dims(tuple(shape))}")
    return Tensor(leaf)


def _state(name: str, shape: tuple[int, ...], value: float) -> Node:
    return make("state", (), name=name, shape=tuple(shape), dtype=FLOAT, init=Init("constant", value=value))


class _ParamLayer(Layer):
    """A layer with parameters: applying it twice shares its weights (the inputs must agree in size)."""

    named = True

    def _weights(self, shapes: dict[str, tuple[int, ...]], specs: dict[str, Param]) -> dict[str, Node]:
        made = {key: _made(_param(f"{self.label}_{key}", shape, specs[key]), f"layer '{self.label}'", self.defined_at)
                for key, shape in shapes.items()}
        for leaf in made.values():
            provenance.record_leaf(leaf, self.label, self.describe)
        previous = getattr(self, "_made", None)
        if previous is not None and any(previous[k] is not made[k] for k in made):
            raise ShapeError(f"used again on an input of another size: weights {dims(previous['W'].shape)} "
                             f"cannot be shared with {dims(made['W'].shape)}")
        self._made = made
        return made
