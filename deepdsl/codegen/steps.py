"""Turn the SSA programs of a compiled network into the Python bodies of its `setup`, `train_step` and `test_step`.

Each `Let` becomes a block: the IR statement as a comment, then its buffer (`mem.empty`, or the buffer it
overwrites in place, or nothing for a view), its scratch space (`mem.workspace`: one region shared by all
statements), and the runtime call (from `lowering`).
`Free` statements become `mem.free`. Elementwise statements call kernels (module-level numpy functions rendered
by `ufuncs`, shared between steps when their expressions agree).

In-place updates: a training step's output `<name>` is the new value of input `<name>` (parameters, optimizer
state, running statistics). Its statement writes straight into the input's buffer when that is safe: it is an
`ew` statement of the same shape, no later statement reads the old value (or a view of it), no other output is
the old value, and the kernel reads the old value no later than its first write. Otherwise the step computes a
fresh buffer and copies it over the old value at the end.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy

from deepdsl.codegen import lowering, ufuncs
from deepdsl.codegen.workspace import workspace_size
from deepdsl.errors import DeepDSLError
from deepdsl.ir import Node
from deepdsl.ops import get_op
from deepdsl.program import Free, Let, Program, format_expr

DTYPES = {"float": "float32", "int32": "int32", "uint8": "uint8"}
TENSOR_ROLES = ("param", "state", "hoisted")


class GenerateError(DeepDSLError):
    """The program uses something code generation does not support (reported as one line)."""


@dataclass
class Block:
    comment: str
    lines: list[str]


@dataclass
class Step:
    name: str
    signature: str
    doc: str
    prologue: list[str]
    blocks: list[Block]
    epilogue: list[str]


@dataclass
class Kernel:
    name: str
    params: str
    doc: str
    body: list[str]


@dataclass
class Kernels:
    """Elementwise kernels of one generated program, numbered in order of first use."""

    items: list[Kernel] = field(default_factory=list)
    _by_key: dict[tuple, str] = field(default_factory=dict)

    def get(self, expr: sympy.Expr, nargs: int, alias: int | None) -> str:
        key = (sympy.srepr(expr), nargs, alias)
        if key not in self._by_key:
            body = ufuncs.kernel_body(expr, alias)
            name = f"ew{len(self.items) + 1}"
            params = ", ".join(["out"] + [f"v{i}" for i in range(nargs)])
            doc = f"out = {sympy.sstr(expr)}" + (f"   (out may be v{alias})" if alias is not None else "")
            self.items.append(Kernel(name, params, doc, body))
            self._by_key[key] = name
        return self._by_key[key]


def identifier(name: str) -> str:
    """A Python identifier for a user-chosen name."""
    text = re.sub(r"\W", "_", name)
    return text if text.isidentifier() and not text[0].isdigit() else f"_{text}"


def _role(leaf: Node) -> str:
    return leaf.attr("role") if leaf.op == "input" else leaf.op


def _is_view(node: Node) -> bool:
    return get_op(node.op).view


def inplace_updates(program: Program) -> dict[int, Node]:
    """id(statement) -> the input leaf whose buffer the statement may overwrite with its value (see module doc)."""
    statements = program.statements()
    position = {id(n): i for i, n in enumerate(statements)}
    root: dict[int, int] = {}                 # id(value) -> id(value owning the memory)
    for n in statements:
        root[id(n)] = root.get(id(n.inputs[0]), id(n.inputs[0])) if _is_view(n) else id(n)
    last_read: dict[int, int] = {}
    for i, n in enumerate(statements):
        if not _is_view(n):
            for x in n.inputs:
                last_read[root.get(id(x), id(x))] = i
    leaves = {n.name: n for n in program.inputs if _role(n) in ("param", "state")}
    result: dict[int, Node] = {}
    for name, value in program.outputs:
        leaf = leaves.get(name)
        if leaf is None or value is leaf or value.op != "ew" or id(value) not in position or id(value) in result:
            continue
        if value.shape != leaf.shape or value.dtype != leaf.dtype:
            continue
        if last_read.get(id(leaf), -1) > position[id(value)]:
            continue
        if any(x is not leaf and root.get(id(x)) == id(leaf) for x in value.inputs):
            continue
        if any(k != name and root.get(id(v), id(v)) == id(leaf) for k, v in program.outputs):
            continue
        alias = next((i for i, x in enumerate(value.inputs) if x is leaf), None)
        if ufuncs.render(value.attr("expr"), alias) is None:
            continue
        result[id(value)] = leaf
    return result


class StepBuilder:
    """Builds one step's code. `py` maps values to Python expressions; `owner` maps values stored in a buffer
    from `mem` to the name of the value that allocated it (views and in-place results share their host's)."""

    def __init__(self, program: Program, kernels: Kernels, workspace_limit: int, inplace: bool):
        self.program = program
        self.kernels = kernels
        self.limit = workspace_limit
        self.ir_names = program.names()
        self.py: dict[int, str] = {}
        for leaf in program.inputs:
            role = _role(leaf)
            if role in TENSOR_ROLES:
                self.py[id(leaf)] = f"T[{leaf.name!r}]"
            elif role in ("data", "label", "hyper"):
                self.py[id(leaf)] = identifier(leaf.name)
            else:
                raise GenerateError(f"input '{leaf.name}' of role '{role}' has no value in generated programs")
        marked = {id(i.node): i.into for i in program.body if isinstance(i, Let) and getattr(i, "into", None)}
        # the compiler's in-place marks when its memory passes ran; else the parameter updates found here
        self.into: dict[int, Node] = marked or (inplace_updates(program) if inplace else {})
        self.owner: dict[int, str] = {}
        self.freed: set[str] = set()

    def arg(self, node: Node) -> str:
        if id(node) in self.py:
            return self.py[id(node)]
        if node.op == "const" and node.shape == ():
            return lowering.literal(float(node.attr("value")))
        raise GenerateError(f"value {node!r} used before it is defined")

    def stored_in(self, node: Node) -> str | None:
        """The python name of the `mem` buffer holding `node` (None: an input's or persistent buffer)."""
        return self.owner.get(id(node))

    def blocks(self) -> list[Block]:
        result = []
        for instr in self.program.body:
            if isinstance(instr, Let):
                result.append(self.let(instr.node))
            elif isinstance(instr, Free):
                buffers = []
                for n in instr.nodes:
                    owner = self.stored_in(n)
                    if owner and owner not in self.freed:
                        self.freed.add(owner)
                        buffers.append(owner)
                if buffers:
                    result.append(Block("free " + ", ".join(self.ir_names[id(n)] for n in instr.nodes),
                                        [f"mem.free({', '.join(buffers)})"]))
        return result

    def let(self, node: Node) -> Block:
        if node.op in lowering.NOT_LOWERED:
            raise GenerateError(f"op '{node.op}' cannot appear in a program statement")
        name = self.ir_names[id(node)]
        comment = f"{name} = {format_expr(node, self.ir_names)}"
        args = tuple(self.arg(x) for x in node.inputs)
        self.py[id(node)] = name
        if _is_view(node):
            owner = self.stored_in(node.inputs[0])
            if owner:
                self.owner[id(node)] = owner
            return Block(comment, [lowering.lower(lowering.Site(node, args, name))])
        lines: list[str] = []
        target = self.into.get(id(node))
        if target is not None:
            what = f"the new {target.name}" if target.is_leaf else f"over {self.ir_names[id(target)]}"
            lines.append(f"{name} = {self.arg(target)}  # in place: {what}")
            if self.stored_in(target):
                self.owner[id(node)] = self.stored_in(target)
        else:
            lines.append(f"{name} = mem.empty({lowering.literal(node.shape)}, {DTYPES[node.dtype]!r})")
            self.owner[id(node)] = name
        size = workspace_size(node, self.limit)
        if size:
            lines.append(f"ws = mem.workspace({size})")
        kernel = None
        if node.op == "ew":
            alias = next((i for i, x in enumerate(node.inputs) if x is target), None) if target is not None else None
            kernel = self.kernels.get(node.attr("expr"), len(node.inputs), alias)
        lines.append(lowering.lower(lowering.Site(node, args, name, "ws" if size else None, kernel)))
        return Block(comment, lines)

    def lives_in(self, value: Node, leaf: Node) -> bool:
        """Whether the step leaves `value` in the persistent buffer of `leaf` (in place, or as a view of it)."""
        while True:
            if value is leaf:
                return True
            target = self.into.get(id(value))
            if target is not None:
                value = target
            elif value.inputs and _is_view(value):
                value = value.inputs[0]
            else:
                return False


def _scalar(builder: StepBuilder, node: Node) -> str:
    return f"rt.scalar({builder.arg(node)})"


def build_setup(program: Program, kernels: Kernels, limit: int) -> Step:
    b = StepBuilder(program, kernels, limit, inplace=False)
    blocks = b.blocks()
    epilogue = [f"T[{k!r}] = {b.arg(v)}" for k, v in program.outputs]
    hyper = [identifier(n.name) for n in program.inputs if _role(n) == "hyper"]
    return Step("setup", ", ".join(["self"] + (["*"] + hyper if hyper else [])),
                "Values computed once before training (hoisted out of the steps).",
                ["rt, mem, T = self.rt, self.rt.Heap(), self.tensors"], blocks, epilogue)


def build_train(program: Program, kernels: Kernels, limit: int, data: str, label: str,
                hyper: tuple[str, ...]) -> Step:
    b = StepBuilder(program, kernels, limit, inplace=True)
    for n in program.inputs:
        if _role(n) == "hyper" and n.name not in hyper:
            raise GenerateError(f"the training step reads hyperparameter '{n.name}', which generated programs do "
                                f"not feed (they feed {', '.join(hyper)})")
    blocks = b.blocks()
    leaves = {n.name: n for n in program.inputs if _role(n) in ("param", "state")}
    epilogue, results = [], []
    for k, v in program.outputs:
        if k in leaves:
            if b.lives_in(v, leaves[k]):
                continue
            epilogue.append(f"rt.copy({b.arg(v)}, out=T[{k!r}])")
        else:
            results.append((k, v))
    if [k for k, _ in results] != ["loss"]:
        raise GenerateError(f"the training step's results are {[k for k, _ in results]}, expected ['loss']")
    epilogue += [f"loss = {_scalar(b, results[0][1])}", "mem.reset()", "return loss"]
    signature = ", ".join(["self", data, label, "*", "step"] + list(hyper))
    return Step("train_step", signature,
                "One training step on the batch: returns the loss; parameters and state are updated.",
                ["rt, mem, T = self.rt, self.mem, self.tensors"], blocks, epilogue)


def build_test(program: Program, kernels: Kernels, limit: int, data: str, label: str) -> Step:
    b = StepBuilder(program, kernels, limit, inplace=False)
    blocks = b.blocks()
    names = [k for k, _ in program.outputs]
    if names != ["accuracy", "loss"]:
        raise GenerateError(f"the test step's results are {names}, expected ['accuracy', 'loss']")
    epilogue = [f"{k} = {_scalar(b, v)}" for k, v in program.outputs] + ["mem.reset()", "return accuracy, loss"]
    return Step("test_step", f"self, {data}, {label}", "Accuracy and loss of the batch (no update).",
                ["rt, mem, T = self.rt, self.mem, self.tensors"], blocks, epilogue)
