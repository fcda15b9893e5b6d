"""Elementwise computation as one sympy expression over its inputs (`ew`), with numpy broadcasting.

Every activation, arithmetic combination, optimizer update and fused chain of those is an `ew` node whose `expr`
uses the symbols v0, v1, ... for its inputs in order. The VJP of input i is `g * d expr / d v_i`, derived by sympy,
summed back to the input's shape when the input was broadcast. Built-in activations may carry `out_grad`, the
derivative written in terms of the output `y` (ReLU: H(y)), so that their backward needs the output only and the
input can be freed early (as DeepDSL's d_ReLU()(X29)/d_X28 does).
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import sympy

from deepdsl.ir import FLOAT, UINT8, Node, make
from deepdsl.ops import Op, dims, register, require
from deepdsl.ops.leaf import const

Y = sympy.Symbol("y", real=True)
G = sympy.Symbol("g", real=True)


@functools.lru_cache(maxsize=None)
def sym(i: int) -> sympy.Symbol:
    return sympy.Symbol(f"v{i}", real=True)


def symbols(n: int) -> list[sympy.Symbol]:
    return [sym(i) for i in range(n)]


def _heaviside_zero_at_zero(expr: sympy.Expr) -> sympy.Expr:
    """sympy's Heaviside(0) is 1/2; PyTorch's ReLU'(0) is 0. Use 0 so gradients match it exactly.
    (sympy >= 1.9 spells the default value out: `diff(Max(v, 0), v)` is Heaviside(v, 1/2), with two arguments.)"""
    return expr.replace(lambda e: isinstance(e, sympy.Heaviside),
                        lambda e: sympy.Heaviside(e.args[0], 0))


@functools.lru_cache(maxsize=4096)
def derivative(expr: sympy.Expr, var: sympy.Symbol) -> sympy.Expr:
    return _heaviside_zero_at_zero(sympy.diff(expr, var))


@functools.lru_cache(maxsize=4096)
def numpy_function(expr: sympy.Expr, n: int):
    return sympy.lambdify(symbols(n), expr, modules="numpy")


@register
class Elementwise(Op):
    name = "ew"

    def infer(self, *inputs: Node, expr, out_grad=None):
        require(all(i.dtype in (FLOAT, UINT8) for i in inputs), "elementwise op on an integer tensor")
        try:
            shape = np.broadcast_shapes(*(i.shape for i in inputs)) if inputs else ()
        except ValueError:
            raise_mismatch(inputs)
        return shape, FLOAT

    def vjp(self, node: Node, g: Node):
        expr = node.attr("expr")
        out_grad = node.attr("out_grad")
        if out_grad is not None:    # derivative in terms of the output: g * f'(y)
            (x,) = node.inputs
            return (elementwise(G * out_grad, [g, node], names=(G, Y)),)
        result = []
        for i, x in enumerate(node.inputs):
            d = derivative(expr, sym(i))
            if d == 0:
                result.append(None)
                continue
            d = d.xreplace({s: sym(j + 1) for j, s in enumerate(symbols(len(node.inputs)))})
            cot = elementwise(sym(0) * d, [g, *node.inputs], shape=node.shape)
            result.append(sum_to(cot, x.shape))
        return tuple(result)

    def evaluate(self, ctx, *args, expr, out_grad=None):
        # a uint8 mask alone (after its float factor is folded into the expression) must not compute in uint8
        args = tuple(a.astype(ctx.float_dtype) if a.dtype == np.uint8 else a for a in args)
        out = numpy_function(expr, len(args))(*args)
        shape = np.broadcast_shapes(*(a.shape for a in args)) if args else ()
        return np.asarray(np.broadcast_to(out, shape), dtype=ctx.float_dtype)

    def describe(self, node: Node) -> str:
        return str(node.attr("expr"))


def raise_mismatch(inputs: Sequence[Node]):
    require(False, "elementwise shapes do not match: " + ", ".join(dims(i.shape) for i in inputs))


def elementwise(expr: sympy.Expr, inputs: Sequence[Node], names: Sequence[sympy.Symbol] | None = None,
                shape: tuple[int, ...] | None = None, out_grad: sympy.Expr | None = None) -> Node:
    """The canonical `ew` node computing `expr` over `inputs`.

    `names` are the symbols `expr` uses for the inputs (default v0, v1, ...). Canonical form: scalar constants are
    folded into the expression, repeated inputs merged, unused inputs dropped and the rest renumbered in order, so
    equal computations are one node. An identity on a same-shape input returns that input; a constant expression
    returns a `const`. The result is broadcast to `shape` when given.
    """
    names = list(names) if names is not None else symbols(len(inputs))
    try:
        target = shape if shape is not None else (np.broadcast_shapes(*(i.shape for i in inputs)) if inputs else ())
    except ValueError:
        raise_mismatch(inputs)
    subst: dict[sympy.Symbol, sympy.Expr] = {}
    kept: list[Node] = []
    for name, node in zip(names, inputs):
        if node.op == "const" and node.shape == ():
            subst[name] = sympy.Float(node.attr("value")) if node.attr("value") != int(node.attr("value")) \
                else sympy.Integer(int(node.attr("value")))
            continue
        for j, other in enumerate(kept):
            if other is node:
                subst[name] = sym(j)
                break
        else:
            subst[name] = sym(len(kept))
            kept.append(node)
    # rename through fresh placeholders so v-symbols in `names` and in the result cannot collide
    tmp = {n: sympy.Dummy() for n in names}
    expr = sympy.sympify(expr).xreplace(tmp).xreplace({tmp[n]: v for n, v in subst.items()})
    used = sorted(expr.free_symbols & set(symbols(len(kept))), key=lambda s: int(s.name[1:]))
    remap = {s: sym(j) for j, s in enumerate(used)}
    expr = expr.xreplace(remap)
    final = [kept[int(s.name[1:])] for s in used]
    if not final:
        value = float(expr)
        return const(value, target) if target else const(value)
    if expr == sym(0) and len(final) == 1 and final[0].shape == target:
        return final[0]
    node = make("ew", final, expr=expr, **({"out_grad": out_grad} if out_grad is not None else {}))
    return node if node.shape == target else broadcast_to(node, target)


def add(*terms: Node) -> Node:
    return elementwise(sympy.Add(*symbols(len(terms))), terms)


def mul(a: Node, b: Node) -> Node:
    return elementwise(sym(0) * sym(1), [a, b])


def scale(a: Node, factor) -> Node:
    return elementwise(sympy.sympify(factor) * sym(0), [a])


def sum_to(x: Node, shape: tuple[int, ...]) -> Node:
    shape = tuple(shape)
    return x if x.shape == shape else make("sum_to", (x,), shape=shape)


def broadcast_to(x: Node, shape: tuple[int, ...]) -> Node:
    shape = tuple(shape)
    return x if x.shape == shape else make("broadcast_to", (x,), shape=shape)


def reshape(x: Node, shape: tuple[int, ...]) -> Node:
    shape = tuple(shape)
    return x if x.shape == shape else make("reshape", (x,), shape=shape)


def _reduced_axes(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    lead = len(src) - len(dst)
    return tuple(range(lead)) + tuple(lead + i for i, d in enumerate(dst) if d == 1 and src[lead + i] != 1)


@register
class SumTo(Op):
    """Sum `x` down to `shape`, the inverse of numpy broadcasting (bias gradients, batch-norm statistics)."""

    name = "sum_to"

    def infer(self, x: Node, *, shape):
        ok = len(shape) <= len(x.shape)
        if ok:
            try:
                ok = np.broadcast_shapes(shape, x.shape) == x.shape
            except ValueError:
                ok = False
        require(ok, f"cannot sum {dims(x.shape)} to {dims(shape)}")
        return shape, x.dtype

    def vjp(self, node, g):
        return (broadcast_to(g, node.inputs[0].shape),)

    def evaluate(self, ctx, x, *, shape):
        axes = _reduced_axes(x.shape, shape)
        return np.asarray(x.sum(axis=axes).reshape(shape), dtype=ctx.float_dtype)

    def describe(self, node):
        return f"sum_to[{dims(node.attr('shape'))}]"


@register
class BroadcastTo(Op):
    name = "broadcast_to"

    def infer(self, x: Node, *, shape):
        try:
            ok = np.broadcast_shapes(shape, x.shape) == tuple(shape)
        except ValueError:
            ok = False
        require(ok, f"cannot broadcast {dims(x.shape)} to {dims(shape)}")
        return shape, x.dtype

    def vjp(self, node, g):
        return (sum_to(g, node.inputs[0].shape),)

    def evaluate(self, ctx, x, *, shape):
        return np.array(np.broadcast_to(x, shape))

    def describe(self, node):
        return f"broadcast_to[{dims(node.attr('shape'))}]"


@register
class Reshape(Op):
    """Same elements, another shape; a view in generated code (no memory, no copy)."""

    name = "reshape"
    view = True

    def infer(self, x: Node, *, shape):
        require(int(np.prod(shape)) == x.size, f"cannot reshape {dims(x.shape)} to {dims(shape)}")
        return shape, x.dtype

    def vjp(self, node, g):
        return (reshape(g, node.inputs[0].shape),)

    def evaluate(self, ctx, x, *, shape):
        return x.reshape(shape)

    def describe(self, node):
        return f"reshape[{dims(node.attr('shape'))}]"
