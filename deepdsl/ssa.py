"""The SSA program: a straight-line sequence of statements, each defining one value once.

A `Let` defines its node's value from the node's inputs; `Let(node, into=t)` writes that value over the storage of
`t` (in-place computation: `t`, and every view of it, is dead from then on); `Free` ends the life of values (added
by the memory passes); `Let(node, computes_also=v)` computes `v`, defined by the statement before it, in the same
kernel call, and `Let(node, batch=(v1, ..., vk))` the values of the k statements before it. Inputs are the
program's leaves (batch, parameters, state, hyperparameters, hoisted values); outputs map names to values. Names
appear only when printing: leaves by their own names, statement values after where they came from
(`deepdsl.provenance`: `cv1`, `fc1_relu`, `d_cv1_W`; the new value of a parameter or state
tensor `fc1_W_new`), made unique in order (`fc1_relu_2`).
"""
from __future__ import annotations

import functools
import inspect
import keyword
import re
from dataclasses import dataclass, field, replace
from typing import Any

from deepdsl.ir import HIDDEN, REMAT, Node
from deepdsl.ops import Op, _fmt, dims, get_op
from deepdsl.provenance import base_name

# names a value never takes: Python keywords and the names generated step functions give their arguments and locals
RESERVED = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(
    {"self", "step", "lr", "momentum", "decay", "bias1", "bias2", "rt", "mem", "T", "loss", "accuracy", "np", "rp"})


@dataclass(frozen=True, slots=True)
class Let:
    """Defines `node`'s value.

    into: the value (or persistent input) whose storage this statement overwrites.
    computes_also: the value of the `Let` just before this one, computed by this statement's kernel together with
        its own (`passes.fuse_multi_output`); that statement then only binds its buffer. The values are those the
        two statements define one by one, so the text of the program does not show it.
    batch: the values of the `Let`s just before this one, in order, that this statement's call computes with its
        own, the same elementwise kernel on each one's operands (`passes.fuse_horizontal`); those statements only
        bind their buffers. Not shown in the text either.
    """

    node: Node
    into: Node | None = None
    computes_also: Node | None = None
    batch: tuple[Node, ...] = ()


@dataclass(frozen=True, slots=True)
class Free:
    nodes: tuple[Node, ...]


Instr = Let | Free


@dataclass(frozen=True)
class Program:
    """name, inputs (leaves), body (statements) and outputs (name -> value); `origins`: the provenance table of
    the network it was compiled from (`deepdsl.provenance`), which names its values when it is printed."""

    name: str
    inputs: tuple[Node, ...]
    body: tuple[Instr, ...]
    outputs: tuple[tuple[str, Node], ...]
    origins: Any = field(default=None, compare=False, repr=False)

    def rewritten(self, body: tuple[Instr, ...], outputs: tuple[tuple[str, Node], ...] | None = None) -> "Program":
        """This program with another body (and outputs): what a pass returns."""
        return replace(self, body=body, outputs=self.outputs if outputs is None else outputs)

    def statements(self) -> list[Node]:
        return [i.node for i in self.body if isinstance(i, Let)]

    def names(self, positional: bool = False) -> dict[int, str]:
        """Deterministic printing names: id(node) -> name. Inputs keep their own; a statement's value is named
        after its origin (the op where none was recorded), an output that is the new value of input `k` `k_new`,
        each name a Python identifier distinct from the inputs', the reserved words and the names before it.
        `positional`: X1, X2, ... in order instead (names that depend on the statements only)."""
        names = {id(n): n.name for n in self.inputs}
        if positional:
            for k, node in enumerate((n for n in self.statements() if id(n) not in names), 1):
                names[id(node)] = f"X{k}"
            return names
        taken = set(RESERVED) | set(names.values())
        leaves = set(names.values())
        new_value = {id(v): f"{k}_new" for k, v in self.outputs if k in leaves and not v.is_leaf}
        for node in self.statements():
            if id(node) in names:
                continue
            base = new_value.get(id(node)) or base_name(node, self.origins) or node.op
            base = re.sub(r"\W", "_", base)
            if not base.isidentifier() or base[0].isdigit():
                base = f"v_{base}"
            name, k = base, 1
            while name in taken:
                k += 1
                name = f"{base}_{k}"
            taken.add(name)
            names[id(node)] = name
        return names

    def text(self, shapes: bool = True, positional: bool = False) -> str:
        return format_program(self, shapes, positional)


def format_expr(node: Node, names: dict[int, str]) -> str:
    """The right-hand side of a statement: `conv2d[stride=2](x, cv1_W, cv1_B)` or, for elementwise nodes,
    their expression over argument names: `Max(0, cv1)` (`sum_to[1x16x1x1](centered**2)` for their sums)."""
    args = [names.get(id(i)) or format_inline(i) for i in node.inputs]
    if node.op in ("ew", "ew_sum"):
        # the expression as printed over its variables v0, v1, ... (the order its kernel shows), each variable
        # replaced by its argument's name: renaming before printing would let the printer reorder the terms
        import sympy
        text = re.sub(r"\bv(\d+)\b", lambda m: args[int(m.group(1))], sympy.sstr(node.attr("expr")))
        return text if node.op == "ew" else f"sum_to[{'x'.join(map(str, node.attr('shape'))) or 'scalar'}]({text})"
    described = describe(node)
    return f"{described}({', '.join(args)})" if node.inputs else described


def describe(node: Node) -> str:
    """The op and its attributes, leaving out attributes equal to the op's declared defaults (`pad=0`, `ceil=False`):
    `max_pool[kernel=2,stride=2]`. Ops that describe themselves are asked."""
    op = get_op(node.op)
    if type(op).describe is not Op.describe:
        return op.describe(node)
    defaults = _defaults(type(op))
    shown = [f"{k}={_fmt(v)}" for k, v in node.attrs
             if k not in HIDDEN and not (k in defaults and type(defaults[k]) is type(v) and defaults[k] == v)]
    return f"{op.name}[{','.join(shown)}]" if shown else op.name


@functools.lru_cache(maxsize=None)
def _defaults(cls: type) -> dict:
    """Keyword defaults of the op's shape rule and reference semantics, over its class hierarchy."""
    found: dict = {}
    for klass in reversed(cls.__mro__):
        for method in ("infer", "evaluate"):
            fn = klass.__dict__.get(method)
            if fn is None:
                continue
            for param in inspect.signature(fn).parameters.values():
                if param.default is not inspect.Parameter.empty:
                    found[param.name] = param.default
    return found


def format_inline(node: Node) -> str:
    if node.op == "const":
        return get_op("const").describe(node)
    return node.name or f"<{node.op}>"


def format_program(program: Program, shapes: bool = True, positional: bool = False) -> str:
    names = program.names(positional)
    lines = [f"program {program.name}(" + ", ".join(
        f"{n.name}: {dims(n.shape)}" + ("" if n.dtype == "float" else f" {n.dtype}") for n in program.inputs) + ")"]
    for instr in program.body:
        if isinstance(instr, Let):
            node = instr.node
            text = f"  {names[id(node)]} = {format_expr(node, names)}"
            if instr.into is not None:
                text += f"  (in place of {names.get(id(instr.into)) or format_inline(instr.into)})"
            if node.attr(REMAT):
                text += "  (recomputed)"
            if shapes:
                tail = dims(node.shape) + ("" if node.dtype == "float" else f" {node.dtype}")
                text = f"{text:<88} # {tail}"
            lines.append(text.rstrip())
        else:
            lines.append("  free " + ", ".join(names[id(n)] for n in instr.nodes))
    lines.append("  return " + ", ".join(f"{k}={names.get(id(v)) or format_inline(v)}" for k, v in program.outputs))
    return "\n".join(lines) + "\n"
