"""Elementwise computation as one sympy expression over its inputs (`ew`), with numpy broadcasting.

Every activation, arithmetic combination, optimizer update and fused chain of those is an `ew` node whose `expr`
uses the symbols v0, v1, ... for its inputs in order. The VJP of input i is `g * d expr / d v_i`, derived by sympy,
summed back to the input's shape when the input was broadcast. Built-in activations may carry `out_grad`, the
derivative written in terms of the output `y` (ReLU: H(y)), so that their backward needs the output only and the
input can be freed early (as DeepDSL's d_ReLU()(X29)/d_X28 does). A user function may carry `in_grad`, a derivative
the user gave in terms of the input (a straight-through estimator, a numerically stabler form), used instead of
sympy's.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import sympy

from deepdsl.ir import FLOAT, UINT8, Node, make
from deepdsl.ops import Op, Workspace, dims, get_op, register, require, scratch_chunks
from deepdsl.ops.leaf import const
from deepdsl_runtime import contract
from deepdsl_runtime.contract import FLOAT_BYTES
from deepdsl_runtime.cpu.elementwise import erf

Y = sympy.Symbol("y", real=True)
G = sympy.Symbol("g", real=True)


@functools.lru_cache(maxsize=None)
def sym(i: int) -> sympy.Symbol:
    return sympy.Symbol(f"v{i}", real=True)


def symbols(n: int) -> list[sympy.Symbol]:
    return [sym(i) for i in range(n)]


_V0 = sym(0)


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """`numpy.broadcast_shapes` for shape tuples (ValueError when they do not broadcast), without the arrays numpy
    builds for it: shape rules run for every node made, and most operands have equal shapes."""
    if not shapes:
        return ()
    first = shapes[0]
    for shape in shapes:
        if shape != first:
            break
    else:
        return tuple(first)
    result = [1] * max(map(len, shapes))
    for shape in shapes:
        offset = len(result) - len(shape)
        for k, d in enumerate(shape):
            current = result[offset + k]
            if d != current:
                if current == 1:
                    result[offset + k] = d
                elif d != 1:
                    raise ValueError(f"shapes {shapes} do not broadcast")
    return tuple(result)


def broadcasts_to(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to `to` (an operand of `shape` read as one of `to`)."""
    try:
        return broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def _heaviside_zero_at_zero(expr: sympy.Expr) -> sympy.Expr:
    """sympy's Heaviside(0) is 1/2; PyTorch's ReLU'(0) is 0. Use 0 so gradients match it exactly.
    (sympy >= 1.9 spells the default value out: `diff(Max(v, 0), v)` is Heaviside(v, 1/2), with two arguments.)
    A value at 0 written out otherwise (the 1 of a maximum that keeps its first operand on a tie) stays."""
    return expr.replace(lambda e: isinstance(e, sympy.Heaviside) and (len(e.args) == 1 or e.args[1] == sympy.S.Half),
                        lambda e: sympy.Heaviside(e.args[0], 0))


class Sigmoid(sympy.Function):
    """1 / (1 + exp(-x)), computed without overflow: its derivative is Sigmoid(x) (1 - Sigmoid(x)), where the
    written-out exp(-x) / (1 + exp(-x))^2 is inf / inf = NaN once exp(-x) overflows (x < -88 in float32)."""

    nargs = 1

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0]) * (1 - Sigmoid(self.args[0]))

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sympy.exp(-x))


class Softplus(sympy.Function):
    """log(1 + exp(x)), computed without overflow (log(1 + inf) is inf for x > 88 in float32, where the value is
    x); its derivative is Sigmoid(x)."""

    nargs = 1

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0])

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return sympy.log(1 + sympy.exp(x))


def stable_forms(expr: sympy.Expr) -> sympy.Expr:
    """`expr` with the written-out sigmoid 1 / (1 + exp(-u)) and softplus log(1 + exp(u)) as `Sigmoid` and
    `Softplus`, whose values and derivatives do not overflow (Mish, v tanh(log(1 + exp(v))), has a NaN gradient
    beyond v = 88.7 written out; PyTorch's is 1)."""
    def softplus(e):
        return isinstance(e, sympy.log) and e.args[0].is_Add and len(e.args[0].args) == 2 \
            and sympy.S.One in e.args[0].args and any(isinstance(a, sympy.exp) for a in e.args[0].args)

    def sigmoid(e):
        return e.is_Pow and e.exp == -1 and e.base.is_Add and len(e.base.args) == 2 and sympy.S.One in e.base.args \
            and any(isinstance(a, sympy.exp) for a in e.base.args)

    def exponent(add):
        return next(a for a in add.args if isinstance(a, sympy.exp)).args[0]

    expr = expr.replace(softplus, lambda e: Softplus(exponent(e.args[0])))
    return expr.replace(sigmoid, lambda e: Sigmoid(-exponent(e.base)))


def sigmoid_values(x):
    """Sigmoid in numpy, exp(-log(1 + exp(-x))) through logaddexp: no overflow, accurate in both tails."""
    return np.exp(-np.logaddexp(0, -x))


def softplus_values(x):
    return np.logaddexp(0, x)


def _no_dirac_delta(expr: sympy.Expr) -> sympy.Expr:
    """The derivative of a step (sign, Heaviside) is a DiracDelta, zero wherever it has a value: PyTorch's gradient
    of sign is 0, and no backend can compute a DiracDelta."""
    return expr.replace(lambda e: isinstance(e, sympy.DiracDelta), lambda e: sympy.S.Zero) \
        if expr.has(sympy.DiracDelta) else expr


@functools.lru_cache(maxsize=4096)
def derivative(expr: sympy.Expr, var: sympy.Symbol) -> sympy.Expr:
    return _heaviside_zero_at_zero(_no_dirac_delta(sympy.diff(expr, var)))


@functools.lru_cache(maxsize=4096)
def cotangent_exprs(expr: sympy.Expr, n: int) -> tuple[sympy.Expr | None, ...]:
    """For each input i of `expr` over v0..v{n-1}: `g * d expr / d v_i` over (g, inputs) as v0, v1..vn, or None
    where the derivative is identically 0. Cached: every layer of one kind has the same expression."""
    shift = {sym(j): sym(j + 1) for j in range(n)}    # simultaneous: v_j -> v_{j+1} cannot cascade
    result = []
    for i in range(n):
        d = derivative(expr, sym(i))
        result.append(None if d == 0 else sym(0) * d.xreplace(shift))
    return tuple(result)


@functools.lru_cache(maxsize=4096)
def numpy_function(expr: sympy.Expr, n: int):
    """`expr` over v0..v<n-1> as a numpy function (the runtime's `erf`, which numpy lacks, for erf; Sigmoid and
    Softplus in their stable forms)."""
    return sympy.lambdify(symbols(n), expr, modules=[
        {"erf": erf, "Sigmoid": sigmoid_values, "Softplus": softplus_values}, "numpy"])


@register
class Elementwise(Op):
    name = "ew"
    cheap = True

    def infer(self, *inputs: Node, expr, out_grad=None, in_grad=None):
        for i in inputs:
            require(i.dtype == FLOAT or i.dtype == UINT8, "elementwise op on an integer tensor")
        try:
            shape = broadcast_shapes(*[i.shape for i in inputs])
        except ValueError:
            raise_mismatch(inputs)
        return shape, FLOAT

    def vjp(self, node: Node, g: Node):
        expr = node.attr("expr")
        out_grad = node.attr("out_grad")
        if out_grad is not None:    # derivative in terms of the output: g * f'(y)
            (x,) = node.inputs
            return (elementwise(G * out_grad, [g, node], names=(G, Y)),)
        in_grad = node.attr("in_grad")
        if in_grad is not None:     # a derivative the user gave, in terms of the input: g * f'(x)
            (x,) = node.inputs
            return (elementwise(G * in_grad, [g, x], names=(G, sym(0))),)
        result = []
        for x, cotangent in zip(node.inputs, cotangent_exprs(expr, len(node.inputs))):
            if cotangent is None:
                result.append(None)
                continue
            cot = elementwise(cotangent, [g, *node.inputs], shape=node.shape)
            result.append(sum_to(cot, x.shape))
        return tuple(result)

    def overwritable(self, node: Node) -> tuple[int, ...]:
        return tuple(range(len(node.inputs)))         # any input (at the output's shape: see passes/inplace.py)

    def evaluate(self, ctx, *args, expr, out_grad=None, in_grad=None):
        # a uint8 mask alone (after its float factor is folded into the expression) must not compute in uint8
        args = tuple(a.astype(ctx.float_dtype) if a.dtype == np.uint8 else a for a in args)
        out = numpy_function(expr, len(args))(*args)
        shape = np.broadcast_shapes(*(a.shape for a in args)) if args else ()
        return np.asarray(np.broadcast_to(out, shape), dtype=ctx.float_dtype)

    def flops(self, node: Node) -> int:
        """The expression's operations (at least one) at every element."""
        return node.size * max(int(sympy.count_ops(node.attr("expr"))), 1)

    def describe(self, node: Node) -> str:
        return str(node.attr("expr"))


def raise_mismatch(inputs: Sequence[Node]):
    require(False, "elementwise shapes do not match: " + ", ".join(dims(i.shape) for i in inputs))


def elementwise(expr: sympy.Expr, inputs: Sequence[Node], names: Sequence[sympy.Symbol] | None = None,
                shape: tuple[int, ...] | None = None, out_grad: sympy.Expr | None = None,
                in_grad: sympy.Expr | None = None) -> Node:
    """The canonical `ew` node computing `expr` over `inputs`.

    `names` are the symbols `expr` uses for the inputs (default v0, v1, ...). Canonical form: scalar constants are
    folded into the expression, repeated inputs merged, unused inputs dropped and the rest renumbered in order, so
    equal computations are one node. An identity on a same-shape input returns that input; a constant expression
    returns a `const`. The result is broadcast to `shape` when given.
    """
    try:
        target = shape if shape is not None else broadcast_shapes(*(i.shape for i in inputs))
    except ValueError:
        raise_mismatch(inputs)
    # the input pattern: each input is a scalar constant (its value) or the index of its first occurrence among the
    # other inputs; the canonical expression depends on nothing else, so it is computed once per pattern
    pattern: list = []
    distinct: list[Node] = []
    for node in inputs:
        if node.op == "const" and node.shape == ():
            pattern.append((node.attr("value"),))
            continue
        for j, other in enumerate(distinct):
            if other is node:
                pattern.append(j)
                break
        else:
            pattern.append(len(distinct))
            distinct.append(node)
    if not isinstance(expr, sympy.Basic):
        expr = sympy.sympify(expr)
    canonical, used = _canonical(expr, tuple(names) if names is not None else None, tuple(pattern))
    if not used:
        value = float(canonical)
        return const(value, target) if target else const(value)
    final = [distinct[j] for j in used]
    if canonical == _V0 and len(final) == 1 and final[0].shape == target:
        return final[0]
    derivative = {"out_grad": out_grad} if out_grad is not None else {}
    if in_grad is not None:
        derivative["in_grad"] = in_grad
    node = make("ew", final, expr=canonical, **derivative)
    return node if node.shape == target else broadcast_to(node, target)


@functools.lru_cache(maxsize=16384)
def _canonical(expr: sympy.Expr, names: tuple[sympy.Symbol, ...] | None,
               pattern: tuple) -> tuple[sympy.Expr, tuple[int, ...]]:
    """`expr` over inputs with the given pattern (see `elementwise`) in canonical form: constants substituted,
    symbols renumbered v0.. over the distinct inputs it still reads. Returns it with the indices of those inputs
    among the distinct ones."""
    names = names if names is not None else tuple(symbols(len(pattern)))
    subst: dict[sympy.Symbol, sympy.Expr] = {}
    for name, p in zip(names, pattern):
        if isinstance(p, tuple):
            (value,) = p
            subst[name] = sympy.Float(value) if value != int(value) else sympy.Integer(int(value))
        else:
            subst[name] = sym(p)
    # xreplace substitutes simultaneously, so v-symbols in `names` and in `subst` cannot capture each other
    expr = expr.xreplace(subst)
    distinct = sum(1 for p in pattern if not isinstance(p, tuple))
    used = sorted(expr.free_symbols & set(symbols(distinct)), key=lambda s: int(s.name[1:]))
    renumber = {s: sym(j) for j, s in enumerate(used) if s != sym(j)}
    if renumber:
        expr = expr.xreplace(renumber)
    return expr, tuple(int(s.name[1:]) for s in used)


def add(*terms: Node) -> Node:
    return elementwise(sympy.Add(*symbols(len(terms))), terms)


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
        require_summable(x.shape, shape)
        return shape, x.dtype

    def vjp(self, node, g):
        return (broadcast_to(g, node.inputs[0].shape),)

    def evaluate(self, ctx, x, *, shape):
        axes = _reduced_axes(x.shape, shape)
        return np.asarray(x.sum(axis=axes).reshape(shape), dtype=ctx.float_dtype)

    def describe(self, node):
        return f"sum_to[{dims(node.attr('shape'))}]"


def require_summable(source: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """A ShapeError unless `source` sums down to `shape` (`shape` broadcasts to `source`)."""
    require(broadcasts_to(shape, source), f"cannot sum {dims(source)} to {dims(shape)}")


@register
class EwSum(Op):
    """`sum_to(ew(expr, inputs), shape)` in one statement (made by the `fuse_reductions` pass): the elementwise
    values are never a tensor of their own. The runtime computes them in cache-sized chunks of samples where the
    sum adds up the leading axis (`contract.ew_sum_scratch`), so the workspace holds a chunk, not the tensor."""

    name = "ew_sum"

    def infer(self, *inputs: Node, expr, shape):
        values, _ = get_op("ew").infer(*inputs, expr=expr)
        require_summable(values, shape)
        return tuple(shape), FLOAT

    def vjp(self, node, g):
        values = make("ew", node.inputs, expr=node.attr("expr"))
        return get_op("ew").vjp(values, broadcast_to(g, values.shape))

    def evaluate(self, ctx, *args, expr, shape):
        return get_op("sum_to").evaluate(ctx, get_op("ew").evaluate(ctx, *args, expr=expr), shape=shape)

    def workspace(self, node, limit=None):
        """The values of a chunk of samples and, when there are several chunks, a chunk's sum: chunks of at most
        `contract.EW_SUM_CHUNK_BYTES` (or `limit`, the smaller), at least one sample; where the sum keeps the
        leading axis, the whole tensor."""
        full = broadcast_shapes(*(i.shape for i in node.inputs))
        per_sample, fixed, chunked = contract.ew_sum_scratch(full, node.shape)
        if not chunked:
            return Workspace(per_sample * FLOAT_BYTES)
        bound = contract.EW_SUM_CHUNK_BYTES if limit is None else min(limit, contract.EW_SUM_CHUNK_BYTES)
        return scratch_chunks(full[0], per_sample, bound, fixed_if_split=fixed)

    def flops(self, node):
        """The expression's operations at every element it sums, and the addition."""
        full = broadcast_shapes(*(i.shape for i in node.inputs))
        return int(np.prod(full)) * (int(sympy.count_ops(node.attr("expr"))) + 1)

    def describe(self, node):
        return f"sum_to[{dims(node.attr('shape'))}]({node.attr('expr')})"


@register
class BroadcastTo(Op):
    name = "broadcast_to"

    def infer(self, x: Node, *, shape):
        require(broadcasts_to(x.shape, shape), f"cannot broadcast {dims(x.shape)} to {dims(shape)}")
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


def operation_word(e: sympy.Expr) -> str | None:
    """One word for the operation at the top of `e` (None for symbols and numbers): `relu`, `scale`, `sub`,
    `rsqrt`, ... (kernel and value names of generated programs)."""
    if e.is_Atom:
        return None
    if isinstance(e, sympy.Max):
        return "relu" if any(a == 0 for a in e.args) else "max"
    if isinstance(e, sympy.Mul):
        if e.args[0] == -1 and len(e.args) == 2:
            return "neg"
        return "scale" if sum(1 for a in e.args if not a.is_Number) == 1 else "mul"
    if isinstance(e, sympy.Pow):
        exponent = e.args[1]
        return {2: "square", sympy.Rational(1, 2): "sqrt", -1: "recip", sympy.Rational(-1, 2): "rsqrt"}.get(
            exponent, "pow")
    if isinstance(e, sympy.Add):
        return "sub" if any(a.could_extract_minus_sign() for a in e.args) else "add"
    name = type(e).__name__
    return {"Min": "min", "Heaviside": "step", "Abs": "abs"}.get(name, name.lower())
