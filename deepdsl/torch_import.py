"""`deepdsl import MODEL.py:FACTORY --input 8x3x224x224 [--labels K] [-o net.py]`: a PyTorch `nn.Module` as a
deepdsl network file and its weights, through `torch.export`.

FACTORY (a class, or a function returning the module) is called with no arguments, the module exported in
training mode on example inputs of the shapes given, and its graph walked in order: every ATen op of the export's
training IR that keeps layers whole (`aten.conv2d`, `batch_norm`, `linear`, `max_pool2d`, ...) becomes one line of
the network file, named after the module it belongs to (`layer1.0.conv1` -> `layer1_0_conv1`), so the file reads
as the module does and its parameters carry PyTorch's `state_dict` names (`layer1_0_conv1_W` is
`layer1.0.conv1.weight`). The weights are written beside it under deepdsl's names (`--init-from` takes them).

Ops with no DSL counterpart are all listed at once, one line per distinct op naming the user's file and line, the
module path and class, the ATen op and what to do; nothing is written then. torch is needed only here.
"""
from __future__ import annotations

import keyword
import operator
import os
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deepdsl.errors import DeepDSLError

INPUT = re.compile(r"^(\d+(?:x\d+)*)(?::(float32|float64|int32|int64))?$")


class ImportProblem(DeepDSLError):
    """An importer error, said as one line (or, for unsupported ops, one line per op)."""


@dataclass(frozen=True)
class InputSpec:
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def parse(cls, text: str) -> "InputSpec":
        match = INPUT.match(text.strip())
        if not match:
            raise ImportProblem(f"--input {text}: expected sizes joined by 'x' and an optional dtype, e.g. "
                                "8x3x224x224 or 2x16:int64")
        shape = tuple(int(s) for s in match.group(1).split("x"))
        if any(s < 1 for s in shape):
            raise ImportProblem(f"--input {text}: every size must be >= 1")
        return cls(shape, match.group(2) or "float32")

    @property
    def tokens(self) -> bool:
        return self.dtype.startswith("int")


def load_factory(target: str):
    """The module FACTORY of MODEL.py builds: FACTORY a class or a function, called with no arguments."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ImportProblem(f"{target}: expected MODEL.py:FACTORY (a class or a function returning the module)")
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ImportProblem(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    module = types.ModuleType(f"deepdsl_import_{Path(path).stem}")
    module.__file__ = os.path.abspath(path)
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 -- the user's file: any error is one line naming it
        raise ImportProblem(f"{path}: {type(err).__name__}: {err}") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise ImportProblem(f"{path}: defines no '{name}'")
    try:
        built = factory()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001
        raise ImportProblem(f"{path}:{name}(): {type(err).__name__}: {err}") from None
    import torch

    if not isinstance(built, torch.nn.Module):
        raise ImportProblem(f"{path}:{name}() returned a {type(built).__name__}, not a torch.nn.Module")
    return built.float(), module.__file__          # deepdsl trains in float32 (whatever torch's default dtype)


# ----------------------------------------------------------------------------------------------------------------
# the walk over the exported graph

@dataclass
class Unsupported:
    op: str
    where: str            # the user's file and line
    module: str           # module path and class
    advice: str
    count: int = 1


ADVICE = {
    "aten.index.Tensor": "not supported yet (indexing by a tensor)",
}


def _is_tensor(node) -> bool:
    """Whether a node computes a tensor (or tensors), not a size (`sym_size`, a product of sizes)."""
    import torch

    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return value is None or isinstance(value, torch.Tensor)


def _shown_path(path: str) -> str:
    """A file as errors name it: relative to the current directory where it lies below it."""
    relative = os.path.relpath(path) if not path.startswith("<") else path
    return path if relative.startswith("..") else relative


def _short(target) -> str:
    return f"aten.{target._schema.name.split('::')[1]}.{target._overloadname}" if hasattr(target, "_schema") \
        else str(target)


@dataclass
class Network:
    """What the walk makes: the lines of the forward function, the layers' weights, the output's node."""

    lines: list[str] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    unsupported: dict[str, Unsupported] = field(default_factory=dict)
    functions: set = field(default_factory=set)       # elementwise functions the file defines (GELU's kinds)


class Walk:
    """One pass over the exported program's nodes in order: a handler per ATen op writes the DSL line of its node
    (`handlers`) and records its parameters; an op without one is recorded as unsupported."""

    def __init__(self, exported, state: dict, user_file: str):
        self.ep, self.state, self.user_file = exported, state, user_file
        signature = exported.graph_signature
        self.param_of = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
        self.names: dict[str, str] = {}           # node name -> its Python variable in the network file
        self.taken: set[str] = set()
        self.net = Network()
        self.vocab = 0                            # the first embedding's vocabulary (of token inputs)
        self.batch_symbol = None                  # the exported program's symbol of the batch size
        self.uses_batch = False                   # whether a line of the file writes a size in N
        self.ranges: dict[str, tuple[int, int]] = {}     # arange nodes: (start, stop)
        self.parts: dict[str, tuple] = {}         # split nodes: (variable, axis, rank, [(start, stop), ...])
        self.noise: dict[str, dict] = {}          # stochastic depth's noise: its shape, keep ratio, scaling
        self.ops_in: dict[str, int] = {}          # module path -> how many ops of the graph it makes
        for node in exported.graph.nodes:
            if node.op == "call_function":
                path = self.module_path(node)[0]
                self.ops_in[path] = self.ops_in.get(path, 0) + 1

    # naming ------------------------------------------------------------------------------------------------
    def variable(self, wanted: str) -> str:
        base = re.sub(r"\W", "_", wanted).strip("_") or "h"
        if base[0].isdigit() or keyword.iskeyword(base) or base in ("D", "x", "y", "network", "forward"):
            base = f"h_{base}"
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    @staticmethod
    def module_path(node, qualified: bool = False) -> tuple[str, str]:
        """The path of the module `node` belongs to and its class (qualified: with its module's name)."""
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return "", ""
        path, kind = list(stack.values())[-1]
        kind = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
        return path, kind if qualified else kind.rsplit(".", 1)[-1]

    def value_name(self, node, op: str) -> str:
        """The name of a parameter-free op's value: its module's path where the module is one of torch.nn's own
        (`self.pool = nn.AdaptiveAvgPool2d(1)`: `pool`), else the path and the op (`layer1_0_relu`)."""
        path, kind = self.module_path(node, qualified=True)
        alone = self.ops_in.get(path, 0) == 1
        path = path.replace(".", "_")
        if path and alone and kind.startswith("torch.nn.modules.") and path not in self.taken:
            return path
        return f"{path}_{op}" if path else op

    def where(self, node) -> str:
        """The user's file and line that made `node` (the innermost frame of the stack in a file not of torch)."""
        trace = node.meta.get("stack_trace") or ""
        found = re.findall(r'File "([^"]+)", line (\d+)', trace)
        torch_dir = os.path.dirname(sys.modules["torch"].__file__)
        for file, line in reversed(found):
            if not os.path.abspath(file).startswith(torch_dir):
                return f"{_shown_path(file)}:{line}"
        return _shown_path(self.user_file)

    def layer_name(self, weight_node) -> str:
        """A layer's name from its weight's `state_dict` key, as `--init-from` reads PyTorch's names
        (`run.pytorch_name`: `layer1.0.conv1.weight` -> `layer1_0_conv1`, `attn.in_proj_weight` -> `attn_in_proj`)."""
        from deepdsl_runtime.run import pytorch_name

        key = self.param_of[weight_node.name]
        name = pytorch_name(key) or key.replace(".", "_")
        return name[:-2] if name.endswith("_W") else name

    def tied(self, weight_node) -> str:
        """`, weight=D.gaussian(0.02)` for a weight more than one layer uses (tied: the layers share one parameter
        when they declare it alike), else ''."""
        users = [u for u in weight_node.users if u.op == "call_function"]
        return ", weight=D.gaussian(0.02)" if len(users) > 1 else ""

    def take(self, node, layer: str, suffix: str, arg) -> None:
        """The parameter or buffer `arg` (a placeholder) as `<layer>_<suffix>` of the weights file."""
        if arg is None:
            return
        key = self.param_of[arg.name]
        self.net.weights[f"{layer}_{suffix}"] = self.state[key].detach().cpu().numpy().astype(np.float32)

    def shape(self, node) -> tuple[str, ...]:
        """The sizes of a node's value as the network file writes them: numbers, and `N` (the batch) in those that
        follow it (`4 * N`)."""
        import sympy

        sizes = []
        for d in node.meta["val"].shape:
            if isinstance(d, int) or str(d).isdigit():
                sizes.append(str(int(d)))
            else:
                expr = d.node.expr.subs(self.batch_symbol, sympy.Symbol("N")) if self.batch_symbol is not None \
                    else d.node.expr
                sizes.append(str(expr).replace("*", " * "))
                self.uses_batch = True
        return tuple(sizes)

    def arg(self, a) -> str:
        """The variable of node `a`; a parameter read directly (`self.pos`, not by a layer) is declared where it
        is first read: `pos = D.param("pos", (1, 17, 32))`, its value in the weights under that name."""
        if a.name not in self.names and a.name in self.param_of:
            from deepdsl_runtime.run import pytorch_name

            key = self.param_of[a.name]
            name = pytorch_name(key) or key.replace(".", "_")
            value = self.state[key].detach().cpu().numpy().astype(np.float32)
            if key in dict(self.ep.graph_signature.inputs_to_buffers).values():
                self.refuse_value(a, key)
                return "None"
            self.net.weights[name] = value
            variable = self.variable(name)
            self.names[a.name] = variable
            self.net.lines.append(f'{variable} = D.param("{name}", {tuple(value.shape)!r})')
        return self.names[a.name]

    def refuse_value(self, a, key: str) -> None:
        op = f"buffer {key}"
        if op not in self.net.unsupported:
            self.net.unsupported[op] = Unsupported(op, _shown_path(self.user_file), "(read directly)",
                                                   "buffers read outside batch norm are not supported yet")

    def emit(self, node, wanted: str, expression) -> None:
        """The line `name = expression` (a function of the name where the expression names itself)."""
        name = self.variable(wanted)
        self.names[node.name] = name
        self.net.lines.append(f"{name} = {expression(name) if callable(expression) else expression}")

    def refuse(self, node, advice: str | None = None) -> None:
        op = _short(node.target)
        seen = self.net.unsupported.get(op)
        if seen is not None:
            seen.count += 1
            return
        path, kind = self.module_path(node)
        module = f"{path} ({kind})" if path else f"{kind or 'the model'} (the model itself)"
        self.net.unsupported[op] = Unsupported(op, self.where(node), module, advice or ADVICE.get(
            op, "not supported yet: no DSL layer computes it"))

    # the walk ------------------------------------------------------------------------------------------------
    def run(self, inputs: list[str]) -> str:
        user = list(self.ep.graph_signature.user_inputs)
        for name, variable in zip(user, inputs):
            self.names[name] = variable
            self.taken.add(variable)
        first = next(n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name == user[0])
        size = first.meta["val"].shape[0]
        self.batch_symbol = None if isinstance(size, int) else size.node.expr
        output = None
        for node in self.ep.graph.nodes:
            if node.op == "call_function" and not _is_tensor(node):
                self.names[node.name] = "None"        # sizes computed from the batch: in the shapes instead
                continue
            if node.op == "call_function":
                handler = _getitem if node.target is operator.getitem else HANDLERS.get(_short(node.target))
                if handler is None:
                    self.refuse(node)
                else:
                    handler(self, node)
                self.names.setdefault(node.name, "None")     # refused: its users are walked on
            elif node.op == "output":
                outputs = [o for o in node.args[0] if o is not None and o.name in self.names and
                           o.name not in self.param_of]
                user_outputs = [o for o in self.ep.graph_signature.user_outputs]
                if len(user_outputs) != 1:
                    raise ImportProblem(f"the module returns {len(user_outputs)} values; a network returns one "
                                        "tensor of scores")
                output = next((self.names[o.name] for o in outputs if o.name == user_outputs[0]), None)
        return output


# ----------------------------------------------------------------------------------------------------------------
# handlers: one per ATen op of the training IR

HANDLERS: dict = {}


def handles(*ops: str):
    def register(f):
        for op in ops:
            HANDLERS[op] = f
        return f
    return register


def _pair(value) -> int | tuple[int, int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) == 1:
        return int(values[0])
    a, b = (int(v) for v in values)
    return a if a == b else (a, b)


def _number(value) -> str:
    """A number as the network file writes it (infinities as float("inf"))."""
    value = float(value)
    return repr(value) if abs(value) != float("inf") else f'float("{value}")'


def _keyword(name: str, value, default) -> str:
    return "" if value == default else f", {name}={value!r}"


@handles("aten.conv2d.default")
def _conv(walk: Walk, node) -> None:
    defaults = (None, None, None, 1, 0, 1, 1)         # conv2d(input, weight, bias, stride, padding, dilation, groups)
    x, weight, bias, stride, padding, dilation, groups = list(node.args) + list(defaults[len(node.args):])
    if isinstance(padding, str):
        walk.refuse(node, "padding given as a string ('same'): give the padding in numbers")
        return
    layer = walk.layer_name(weight)
    out, _, kh, kw = weight.meta["val"].shape
    walk.take(node, layer, "W", weight)
    walk.take(node, layer, "B", bias)
    kernel = _pair((kh, kw))
    options = (_keyword("stride", _pair(stride), 1) + _keyword("padding", _pair(padding), 0) +
               _keyword("dilation", _pair(dilation), 1) + _keyword("groups", int(groups), 1) +
               ("" if bias is not None else ", bias=False"))
    walk.emit(node, layer, f'D.conv("{layer}", {kernel!r}, {int(out)}{options})({walk.arg(x)})')


@handles("aten.conv_transpose2d.input")
def _conv_transpose(walk: Walk, node) -> None:
    args = list(node.args) + [None] * (8 - len(node.args))
    x, weight, bias, stride, padding, output_padding, groups, dilation = args
    _, out, kh, kw = weight.meta["val"].shape
    stride, padding = _pair(stride or 1), _pair(padding or 0)
    output_padding, dilation = _pair(output_padding or 0), _pair(dilation or 1)
    if kh != kw or not all(isinstance(v, int) for v in (stride, padding, output_padding)) or dilation != 1 or \
            (groups or 1) != 1:
        walk.refuse(node, "only square kernels, equal strides and paddings, no dilation or groups: "
                          "D.conv_transpose")
        return
    layer = walk.layer_name(weight)
    walk.take(node, layer, "W", weight)
    walk.take(node, layer, "B", bias)
    options = (_keyword("stride", stride, 1) + _keyword("padding", padding, 0) +
               _keyword("output_padding", output_padding, 0) + ("" if bias is not None else ", bias=False"))
    walk.emit(node, layer, f'D.conv_transpose("{layer}", {int(kh)}, {int(out)}{options})({walk.arg(x)})')


@handles("aten.batch_norm.default")
def _batch_norm(walk: Walk, node) -> None:
    x, weight, bias, mean, var, _training, momentum, eps, *_ = node.args
    if weight is None or bias is None or mean is None:
        walk.refuse(node, "batch norm without affine parameters or running statistics is not supported yet")
        return
    layer = walk.layer_name(weight)
    for suffix, a in (("W", weight), ("B", bias), ("mean", mean), ("var", var)):
        walk.take(node, layer, suffix, a)
    options = _keyword("eps", float(eps), 1e-5) + _keyword("momentum", float(momentum), 0.1)
    walk.emit(node, layer, f'D.batch_norm("{layer}"{options})({walk.arg(x)})')


@handles("aten.layer_norm.default")
def _layer_norm(walk: Walk, node) -> None:
    args = list(node.args) + [None] * (5 - len(node.args))
    x, shape, weight, bias, eps = args[:5]
    if (weight is None) != (bias is None):
        walk.refuse(node, "layer norm with a weight but no bias (or the reverse) is not supported yet")
        return
    if weight is None:
        name = walk.variable(f"{walk.module_path(node)[0].replace('.', '_') or 'layer_norm'}")
        walk.taken.discard(name)
        layer, affine = name, ", affine=False"
    else:
        layer, affine = walk.layer_name(weight), ""
        walk.take(node, layer, "W", weight)
        walk.take(node, layer, "B", bias)
    options = _keyword("axes", len(shape), 1) + _keyword("eps", float(eps if eps is not None else 1e-5), 1e-5)
    walk.emit(node, layer, f'D.layer_norm("{layer}"{options}{affine})({walk.arg(x)})')


@handles("aten.linear.default")
def _linear(walk: Walk, node) -> None:
    x, weight, *rest = node.args
    bias = rest[0] if rest else None
    layer = walk.layer_name(weight)
    out = int(weight.meta["val"].shape[0])
    walk.take(node, layer, "W", weight)
    walk.take(node, layer, "B", bias)
    walk.emit(node, layer, f'D.full("{layer}", {out}{"" if bias is not None else ", bias=False"}'
                           f'{walk.tied(weight)})({walk.arg(x)})')


@handles("aten.embedding.default")
def _embedding(walk: Walk, node) -> None:
    weight, indices = node.args[:2]
    layer = walk.layer_name(weight)
    vocab, dim = (int(s) for s in weight.meta["val"].shape)
    walk.take(node, layer, "W", weight)
    if indices.name in walk.ranges:           # positions 0, 1, ...: rows of the table, no tokens to look up
        start, stop = walk.ranges[indices.name]
        rows = "" if (start, stop) == (0, vocab) else f"[{start}:{stop}]"
        walk.emit(node, layer, f'D.param("{layer}_W", ({vocab}, {dim})){rows}')
        return
    walk.vocab = walk.vocab or vocab
    walk.emit(node, layer, f'D.embedding("{layer}", {vocab}, {dim}{walk.tied(weight)})({walk.arg(indices)})')


@handles("aten.arange.default", "aten.arange.start")
def _arange(walk: Walk, node) -> None:
    """A range of integers: only as the positions an embedding looks up (`pos = torch.arange(T)`)."""
    bounds = [int(a) for a in node.args[:2]]
    start, stop = (0, bounds[0]) if len(bounds) == 1 else bounds
    if any(u.target is not None and _short(u.target) != "aten.embedding.default" or u.args[1] is not node
           for u in node.users):
        walk.refuse(node, "a range is only supported as the positions an embedding looks up")
        return
    walk.ranges[node.name] = (start, stop)


def _simple(wanted: str, expression: str):
    def handle(walk: Walk, node) -> None:
        walk.emit(node, walk.value_name(node, wanted), expression.format(walk.arg(node.args[0])))
    return handle


for _op in ("aten.relu.default", "aten.relu_.default"):
    HANDLERS[_op] = _simple("relu", "D.relu({})")
HANDLERS["aten.sigmoid.default"] = _simple("sigmoid", "D.sigmoid({})")
HANDLERS["aten.tanh.default"] = _simple("tanh", "D.tanh({})")


@handles("aten.hardtanh.default", "aten.hardtanh_.default")
def _hardtanh(walk: Walk, node) -> None:
    low, high = (list(node.args[1:]) + [-1.0, 1.0])[:2]
    if float(low) != 0.0:
        walk.refuse(node, "hardtanh with a floor other than 0 is not supported yet (ReLU6 is: D.clipped_relu(6))")
        return
    _simple("relu6", f"D.clipped_relu({float(high)!r})({{}})")(walk, node)


GELU = {"none": ("gelu", "v * (1 + erf(v / sqrt(2))) / 2"),
        "tanh": ("gelu_tanh", "v * (1 + tanh(sqrt(2 / pi) * (v + 0.044715 * v**3))) / 2")}


@handles("aten.gelu.default")
def _gelu(walk: Walk, node) -> None:
    kind = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    if kind not in GELU:
        walk.refuse(node, f"GELU approximated by {kind!r} is not supported yet")
        return
    walk.net.functions.add(kind)
    _simple(GELU[kind][0], f"{GELU[kind][0]}({{}})")(walk, node)


@handles("aten.split.Tensor", "aten.split_with_sizes.default")
def _split(walk: Walk, node) -> None:
    """Parts of an axis, taken by the `getitem` nodes that read them (each a slice)."""
    x, sizes, *rest = node.args
    axis = int(rest[0]) if rest else 0
    rank = len(x.meta["val"].shape)
    length = int(x.meta["val"].shape[axis])
    sizes = [int(sizes)] * -(-length // int(sizes)) if isinstance(sizes, int) else [int(s) for s in sizes]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, min(start + size, length)))
        start += size
    walk.parts[node.name] = (walk.arg(x), axis % rank, rank, bounds)


def _getitem(walk: Walk, node) -> None:
    source, index = node.args
    if source.name not in walk.parts:
        walk.refuse(node, "taking an item of this op's result is not supported yet")
        return
    variable, axis, rank, bounds = walk.parts[source.name]
    start, stop = bounds[index]
    walk.emit(node, walk.value_name(node, "part"), f"{variable}{_index(rank, axis, f'{start}:{stop}')}")


@handles("aten.silu.default", "aten.silu_.default")
def _silu(walk: Walk, node) -> None:
    _simple("silu", 'D.elementwise("silu", "v * sigmoid(v)")({})')(walk, node)


@handles("aten.dropout.default")
def _dropout(walk: Walk, node) -> None:
    ratio = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    _simple("dropout", f"D.dropout({float(ratio)!r})({{}})")(walk, node)


@handles("aten.max_pool2d.default")
def _max_pool(walk: Walk, node) -> None:
    args = list(node.args) + [None] * (6 - len(node.args))
    x, kernel, stride, padding, dilation, ceil = args
    kernel, stride = _pair(kernel), _pair(stride if stride else kernel)
    padding, dilation = _pair(padding or 0), _pair(dilation or 1)
    if not all(isinstance(v, int) for v in (kernel, stride, padding)) or dilation != 1:
        walk.refuse(node, "max pooling over windows that are not square, or dilated, is not supported yet")
        return
    options = _keyword("stride", stride, kernel) + _keyword("padding", padding, 0) + _keyword("ceil", bool(ceil),
                                                                                              False)
    _simple("max_pool", f"D.max_pool({kernel}{options})({{}})")(walk, node)


@handles("aten.avg_pool2d.default")
def _avg_pool(walk: Walk, node) -> None:
    args = list(node.args) + [None] * (7 - len(node.args))
    x, kernel, stride, padding, ceil, include_pad, divisor = args
    kernel, stride, padding = _pair(kernel), _pair(stride if stride else kernel), _pair(padding or 0)
    if not all(isinstance(v, int) for v in (kernel, stride, padding)) or divisor is not None:
        walk.refuse(node, "average pooling over windows that are not square, or with a divisor, is not supported "
                          "yet")
        return
    options = (_keyword("stride", stride, kernel) + _keyword("padding", padding, 0) +
               _keyword("ceil", bool(ceil), False) + _keyword("include_pad", bool(include_pad is not False), True))
    _simple("avg_pool", f"D.avg_pool({kernel}{options})({{}})")(walk, node)


@handles("aten.adaptive_avg_pool2d.default")
def _adaptive_avg_pool(walk: Walk, node) -> None:
    size = _pair(node.args[1])
    _simple("pool", "D.avg_pool()({})" if size == 1 else f"D.adaptive_avg_pool({size!r})({{}})")(walk, node)


@handles("aten.flatten.using_ints", "aten.unflatten.int", "aten.view.default", "aten.reshape.default",
         "aten._unsafe_view.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
         "aten.squeeze.default")
def _reshape(walk: Walk, node) -> None:
    """Views: the same elements in the node's shape (`D.flatten` where all axes but the batch are joined)."""
    x = node.args[0]
    shape, before = walk.shape(node), walk.shape(x)
    if len(shape) == 2 and len(before) > 2 and shape[0] == before[0] == "N":
        _simple("flatten", "D.flatten({})")(walk, node)
    elif shape == before:
        walk.names[node.name] = walk.arg(x)
    else:
        _simple("reshape", f"{{}}.reshape({', '.join(shape)})")(walk, node)


def _index(rank: int, axis: int, part: str) -> str:
    return "[" + ", ".join([":"] * axis + [part]) + "]" if axis < rank - 1 or axis == 0 else \
        "[..., " + part + "]"


@handles("aten.select.int")
def _select(walk: Walk, node) -> None:
    x, axis, index = node.args
    shape = walk.shape(x)
    axis = int(axis) % len(shape)
    if not shape[axis].isdigit():
        walk.refuse(node, "selecting one example of the batch is not supported")
        return
    index = int(index) % int(shape[axis])
    out = walk.shape(node)
    _simple("select", f"{{}}{_index(len(shape), axis, f'{index}:{index + 1}')}.reshape({', '.join(out)})")(
        walk, node)


@handles("aten.slice.Tensor")
def _slice(walk: Walk, node) -> None:
    args = list(node.args) + [None] * (5 - len(node.args))
    x, axis, start, end, step = args
    shape = walk.shape(x)
    axis = int(axis or 0) % len(shape)
    if not shape[axis].isdigit():
        if (start or 0) == 0 and (end is None or int(end) >= 2 ** 62) and (step or 1) == 1:
            walk.names[node.name] = walk.arg(x)           # all of the batch
        else:
            walk.refuse(node, "slicing the batch is not supported")
        return
    shape = tuple(int(d) for d in shape)
    start, stop, step = slice(start, end, step).indices(shape[axis])
    if step != 1 or start >= stop:
        walk.refuse(node, "slices with a step, or empty ones, are not supported yet")
        return
    if (start, stop) == (0, shape[axis]):
        walk.names[node.name] = walk.arg(x)
        return
    _simple("slice", f"{{}}{_index(len(shape), axis, f'{start}:{stop}')}")(walk, node)


@handles("aten.expand.default")
def _expand(walk: Walk, node) -> None:
    _simple("expand", f"{{}}.expand({', '.join(walk.shape(node))})")(walk, node)


@handles("aten.permute.default")
def _permute(walk: Walk, node) -> None:
    axes = tuple(int(a) for a in node.args[1])
    _simple("permute", f"{{}}.permute{axes!r}")(walk, node)


@handles("aten.scaled_dot_product_attention.default")
def _attention(walk: Walk, node) -> None:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    given = {**dict(zip(names, node.args)), **node.kwargs}
    if given.get("enable_gqa"):
        walk.refuse(node, "attention with grouped queries is not supported yet")
        return
    mask = given.get("attn_mask")
    masking = ""
    if mask is not None:        # a boolean mask: the keys that take part; a float one: added to the scores
        import torch
        kind = "mask" if mask.meta["val"].dtype == torch.bool else "bias"
        masking = f", {kind}={walk.arg(mask)}"
    options = ((", causal=True" if given.get("is_causal") else "") + masking +
               (f", scale={float(given['scale'])!r}" if given.get("scale") is not None else "") +
               (f", dropout={float(given['dropout_p'])!r}" if given.get("dropout_p") else ""))
    q, k, v = (walk.arg(given[n]) for n in names[:3])
    walk.emit(node, walk.value_name(node, "attention"),
              lambda name: f"D.attention({q}, {k}, {v}{options}, name={name!r})")


@handles("aten.transpose.int")
def _transpose(walk: Walk, node) -> None:
    x, a, b = node.args
    _simple("transpose", f"{{}}.transpose({int(a)}, {int(b)})")(walk, node)


@handles("aten.mean.dim")
def _mean(walk: Walk, node) -> None:
    x, axes, *rest = node.args
    keep = bool(rest[0]) if rest else False
    axes = tuple(int(a) % len(x.meta["val"].shape) for a in axes)
    _simple("mean", f"{{}}.mean({axes if len(axes) > 1 else axes[0]!r}{', keepdims=True' if keep else ''})")(
        walk, node)


def _binary(symbol: str, name: str):
    def handle(walk: Walk, node) -> None:
        a, b = node.args[:2]
        if node.kwargs.get("alpha", 1) != 1:
            walk.refuse(node, f"{name} with alpha is not supported yet")
            return
        left = walk.arg(a) if hasattr(a, "name") else _number(a)
        right = walk.arg(b) if hasattr(b, "name") else _number(b)
        walk.emit(node, walk.value_name(node, name), f"{left} {symbol} {right}")
    return handle


for _op, _symbol, _name in (("aten.add.Tensor", "+", "add"), ("aten.add_.Tensor", "+", "add"),
                            ("aten.mul.Tensor", "*", "mul"), ("aten.sub.Tensor", "-", "sub"),
                            ("aten.div.Tensor", "/", "div"), ("aten.matmul.default", "@", "matmul")):
    HANDLERS[_op] = _binary(_symbol, _name)


# stochastic depth as torchvision writes it: noise = empty(N, 1, ..., 1).bernoulli_(keep).div_(keep); x * noise


@handles("aten.empty.memory_format")
def _empty(walk: Walk, node) -> None:
    """An uninitialized tensor: only as the noise of stochastic depth or dropout, which `bernoulli_` fills."""
    walk.noise[node.name] = {"shape": tuple(walk.shape(node)), "keep": None, "scaled": False}


@handles("aten.bernoulli_.float")
def _bernoulli(walk: Walk, node) -> None:
    source = node.args[0]
    keep = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    if source.name not in walk.noise:
        walk.refuse(node, "random draws other than stochastic depth's noise are not supported yet: D.dropout")
        return
    walk.noise[node.name] = {**walk.noise[source.name], "keep": float(keep)}


def _scaled_noise(walk: Walk, node) -> bool:
    """`noise / keep` of stochastic depth's noise: recorded, nothing emitted."""
    source, by = node.args[:2]
    found = walk.noise.get(getattr(source, "name", None))
    if found is None or found["keep"] is None or hasattr(by, "name") or float(by) != found["keep"]:
        return False
    walk.noise[node.name] = {**found, "scaled": True}
    return True


def _divide(walk: Walk, node) -> None:
    if not _scaled_noise(walk, node):
        _binary("/", "div")(walk, node)


HANDLERS["aten.div.Tensor"] = HANDLERS["aten.div_.Tensor"] = _divide


def _multiply(walk: Walk, node) -> None:
    """x * noise of stochastic depth (a draw per example: `D.drop_path`) or of dropout (a draw per element:
    `D.dropout`); other products as products."""
    a, b = node.args[:2]
    found = walk.noise.get(getattr(b, "name", None)) or walk.noise.get(getattr(a, "name", None))
    if found is None:
        _binary("*", "mul")(walk, node)
        return
    x = a if walk.noise.get(getattr(b, "name", None)) else b
    shape, keep = found["shape"], found["keep"]
    if keep is None or not found["scaled"]:
        walk.refuse(node, "a product with unscaled random noise is not supported yet: D.dropout, D.drop_path")
        return
    per_example = len(shape) > 1 and shape[0] in ("N", walk.shape(x)[0]) and all(d == "1" for d in shape[1:])
    if shape == tuple(walk.shape(x)):
        walk.emit(node, walk.value_name(node, "dropout"), f"D.dropout({round(1 - keep, 12)!r})({walk.arg(x)})")
    elif per_example:
        walk.emit(node, walk.value_name(node, "drop_path"), f"D.drop_path({round(1 - keep, 12)!r})({walk.arg(x)})")
    else:
        walk.refuse(node, f"noise of shape {shape} is not supported yet (one draw per example: D.drop_path)")


HANDLERS["aten.mul.Tensor"] = _multiply


def _add_in_place(walk: Walk, node) -> None:
    """`num_batches_tracked += 1` of batch norm (a counter deepdsl does not keep) is left out; other in-place sums
    are sums."""
    target = node.args[0]
    if target.op == "placeholder" and walk.param_of.get(target.name, "").endswith("num_batches_tracked"):
        return
    _binary("+", "add")(walk, node)


HANDLERS["aten.add_.Tensor"] = _add_in_place


@handles("aten.cat.default")
def _cat(walk: Walk, node) -> None:
    tensors, *rest = node.args
    axis = int(rest[0]) if rest else 0
    rank = len(tensors[0].meta["val"].shape)
    if axis % rank != 1:
        walk.refuse(node, "concatenation along another axis than the channels is not supported yet")
        return
    walk.emit(node, walk.value_name(node, "cat"), f"D.concat({', '.join(walk.arg(t) for t in tensors)})")


@handles("aten.upsample_nearest2d.vec", "aten.upsample_bilinear2d.vec")
def _upsample(walk: Walk, node) -> None:
    x, size, *rest = node.args
    h, w = x.meta["val"].shape[2:]
    oh, ow = node.meta["val"].shape[2:]
    if oh % h or ow % w or oh // h != ow // w or (rest and rest[0] and "bilinear" in str(node.target)):
        walk.refuse(node, "upsampling by a whole factor, the same on both axes (bilinear without align_corners) is "
                          "what D.upsample does")
        return
    mode = "bilinear" if "bilinear" in str(node.target) else "nearest"
    _simple("upsample", f"D.upsample({oh // h}{', ' + repr(mode) if mode != 'nearest' else ''})({{}})")(walk, node)


@handles("aten.contiguous.default", "aten.clone.default", "aten.detach.default", "aten.alias.default",
         "aten.to.dtype", "aten._to_copy.default", "aten.type_as.default")
def _same(walk: Walk, node) -> None:
    """The same values: copies, and conversions between float and boolean masks (deepdsl's masks are 0/1 values
    either way); a conversion to integers is not supported."""
    import torch

    dtype = node.meta["val"].dtype
    if dtype not in (torch.float32, torch.float64, torch.bool, torch.float16, torch.bfloat16):
        walk.refuse(node, f"a conversion to {dtype} is not supported")
        return
    walk.names[node.name] = walk.arg(node.args[0])


@handles("aten._assert_tensor_metadata.default", "aten._assert_async.msg", "aten.sym_constrain_range_for_size.default")
def _check(walk: Walk, node) -> None:
    """torch.export's own checks: nothing to compute."""


@handles("aten.eq.Scalar")
def _eq(walk: Walk, node) -> None:
    x, value = node.args
    _simple("eq", f"{{}}.eq({float(value)!r})")(walk, node)


@handles("aten.bitwise_not.default", "aten.logical_not.default")
def _not(walk: Walk, node) -> None:
    _simple("not", "D.where({}, 0.0, 1.0)")(walk, node)


@handles("aten.zeros_like.default")
def _zeros_like(walk: Walk, node) -> None:
    _simple("zeros", "D.where({0}.eq(0.0), 0.0, 0.0)")(walk, node)


@handles("aten.masked_fill.Scalar", "aten.masked_fill_.Scalar")
def _masked_fill(walk: Walk, node) -> None:
    x, mask, value = node.args
    walk.emit(node, walk.value_name(node, "masked"), f"{walk.arg(x)}.masked_fill({walk.arg(mask)}, "
                                                       f"{_number(value)})")


@handles("aten.where.self")
def _where(walk: Walk, node) -> None:
    condition, a, b = node.args
    operands = [walk.arg(t) if hasattr(t, "name") else _number(t) for t in (condition, a, b)]
    walk.emit(node, walk.value_name(node, "where"), f"D.where({', '.join(operands)})")


@handles("aten.sum.dim_IntList")
def _sum(walk: Walk, node) -> None:
    x, axes, *rest = node.args
    keep = bool(rest[0]) if rest else False
    rank = len(x.meta["val"].shape)
    axes = tuple(int(a) % rank for a in axes)
    _simple("sum", f"{{}}.sum({axes if len(axes) > 1 else axes[0]!r}{', keepdims=True' if keep else ''})")(
        walk, node)


@handles("aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default")
def _clamp(walk: Walk, node) -> None:
    x, *bounds = node.args
    low, high = (bounds + [None, None])[:2]
    if "clamp_max" in str(node.target):
        low, high = None, low
    expression = "v"
    if low is not None:
        expression = f"Max({expression}, {float(low)!r})"
    if high is not None:
        expression = f"Min({expression}, {float(high)!r})"
    _simple("clamp", f'D.elementwise("clamp", "{expression}")({{}})')(walk, node)


# ----------------------------------------------------------------------------------------------------------------
# the network file

@dataclass
class Imported:
    text: str                             # the network file
    weights: dict[str, np.ndarray]        # by deepdsl's names
    name: str
    parameters: int                       # trained parameters (running statistics not counted)
    module: object = None                 # the nn.Module exported


def import_module(target: str, inputs: list[InputSpec], labels: int | None = None,
                  name: str | None = None) -> Imported:
    """The network file and weights of FACTORY's module (see the module's docstring); `ImportProblem` naming every
    unsupported op at once."""
    try:
        import torch
    except ImportError:
        raise ImportProblem("deepdsl import needs PyTorch: pip install torch (the importer's only use of it)") \
            from None
    module, user_file = load_factory(target)
    if len(inputs) != 1:
        raise ImportProblem(f"{len(inputs)} --input given: a deepdsl network takes one input (images or tokens)")
    spec = inputs[0]
    kind, rank = ("token inputs are (N, T)", 2) if spec.tokens else ("image inputs are (N, C, H, W)", 4)
    if len(spec.shape) != rank:
        raise ImportProblem(f"--input {'x'.join(map(str, spec.shape))}:{spec.dtype}: {kind}")
    generator = torch.Generator().manual_seed(0)
    # the batch exported as a size of its own (at least 2: torch.export fixes sizes of 1), so the file writes the
    # sizes that follow it in N and compiles at any batch (`--batch`, `--fit`); a module that fixes its batch is
    # exported at the batch given
    shape = (max(2, spec.shape[0]),) + spec.shape[1:]
    if spec.tokens:
        example = torch.zeros(shape, dtype=getattr(torch, spec.dtype))
    else:
        example = torch.randn(shape, generator=generator, dtype=torch.float32)
    module.train()
    try:
        try:
            exported = torch.export.export(module, (example,),
                                           dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
        except Exception:  # noqa: BLE001 -- a module that needs its batch fixed
            exported = torch.export.export(module, (example[:spec.shape[0]],))
    except Exception as err:  # noqa: BLE001 -- torch.export's own errors, many kinds: one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ImportProblem(f"{target}: torch.export cannot export the module on an input of "
                            f"{'x'.join(map(str, spec.shape))} {spec.dtype}: {first}") from None
    state = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    walk = Walk(exported, state, user_file)
    output = walk.run(["x"])
    if walk.net.unsupported:
        raise UnsupportedOps(target, list(walk.net.unsupported.values()))
    result = next(n for n in exported.graph.nodes if n.name == exported.graph_signature.user_outputs[0])
    shape = (spec.shape[0], *(int(d) for d in result.meta["val"].shape[1:]))
    imported = _network_file(target, spec, shape, output, walk, labels, name or _default_name(target))
    imported.module = module
    return imported


class UnsupportedOps(ImportProblem):
    """Every op of the module with no DSL counterpart: one line each."""

    def __init__(self, target: str, found: list[Unsupported]):
        self.lines = [f"{u.where}: {u.module}: {u.op}{f' ({u.count} uses)' if u.count > 1 else ''}: {u.advice}"
                      for u in found]
        super().__init__(f"{target}: {len(found)} op{'s' if len(found) > 1 else ''} with no DSL counterpart "
                         "(nothing written):")


def _default_name(target: str) -> str:
    stem = target.rpartition(":")[2]
    return re.sub(r"\W", "_", stem).lower() or "imported"


def _network_file(target: str, spec: InputSpec, out_shape: tuple[int, ...], output: str, walk: Walk,
                  labels: int | None, name: str) -> Imported:
    import torch

    n = spec.shape[0]
    if len(out_shape) == 2:
        classes = out_shape[1]
        label_shape = f"{n}"
    elif len(out_shape) == 3 and spec.tokens:
        classes = out_shape[2]
        label_shape = f"({n}, {out_shape[1]})"
    else:
        raise ImportProblem(f"{target}: the module returns {'x'.join(map(str, out_shape))} scores; an imported "
                            "network returns (N, classes) scores (or (N, T, classes) for token inputs)")
    if labels is not None and labels != classes:
        raise ImportProblem(f"--labels {labels}: the module returns scores of {classes} classes")
    if spec.tokens:
        vocab = walk.vocab or classes
        data = f'x = D.tokens("x", ({n}, {spec.shape[1]}), vocab={vocab})'
    else:
        data = f'x = D.images("x", {spec.shape!r})'
    count = sum(int(np.prod(w.shape)) for k, w in walk.net.weights.items() if not k.endswith(("_mean", "_var")))
    header = [f"# {name}: imported from {target} by `deepdsl import` (torch.export, torch {torch.__version__}),",
              f"# {count:,} parameters; its weights under these layers' names are in {name}.weights.npz",
              f"# (`--init-from`). One line per layer, named after the module it came from; edit the loss and",
              "# the solver below.",
              "from deepdsl import dsl as D", ""]
    lines = header + [data, f'y = D.labels("y", {label_shape}, classes={classes})', ""]
    for kind in sorted(walk.net.functions):
        function, expression = GELU[kind]
        lines += [f'{function} = D.elementwise("{function}", "{expression}")']
    if walk.net.functions:
        lines.append("")
    batch = ["    N = x.shape[0]                    # the batch: the sizes that follow it are written in N"] \
        if walk.uses_batch else []
    lines += ["", "def forward(x):"] + batch + [f"    {line}" for line in walk.net.lines] + \
        [f"    return {output}", "", ""]
    lines += [f'network = D.fn(forward, "{name}")',
              "loss = (D.cross_entropy(y) @ network)(x)",
              "accuracy = (D.precision(y) @ network)(x)",
              "",
              f'solver = D.Train("{name}", iters=1000, test_iters=10, lr=0.01, momentum=0.9, decay=0.0001)',
              "loop = D.Loop(loss, accuracy, solver)", ""]
    return Imported("\n".join(lines), walk.net.weights, name, count)
