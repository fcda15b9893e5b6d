"""Render an `ew` node's sympy expression as numpy ufunc calls that write into `out`.

The expression first becomes one tree of ufunc applications (`tree`): the order in which the operands of a sum,
a product or a maximum combine is fixed there, once, and so is every rounding of the kernel. The kernel computes
one path of that tree in place in `out`, from the bottom up (`np.multiply(v0, v1, out=out)`, then `np.add(out,
v2, out=out)`, ...); the subtrees beside the path are plain numpy expressions of the same tree (these make numpy
temporaries, the price of branching trees). ReLU `Max(0, v0)` becomes `np.maximum(v0, 0, out=out)`,
`Heaviside(v0, 0)` `np.greater(v0, 0, out=out)` (a 0/1 float), sigmoid a chain of logaddexp, negative and exp,
all into `out`. Anything without a rule is printed by sympy's NumPyPrinter and assigned with `out[...] = ...`.

In-place updates: when `out` is also input `alias` (a parameter overwritten by its new value, or a dying input
taken over), the path goes down through the operand that reads that input, so that only the first call reads
it. A binary ufunc gives the same bits whichever of its operands was computed first (`np.subtract(a, out,
out=out)` where the right one was), so the kernel rounds exactly as without the alias: which statements write
over an input (the in-place pass's choice, which a memory budget changes) never changes a bit. Where both
operands of one step read the aliased input, the kernel first takes a copy of it.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import sympy
from sympy.printing.numpy import NumPyPrinter

from deepdsl.ops.elementwise import Sigmoid, Softplus

_UNARY = {
    sympy.exp: "np.exp", sympy.log: "np.log", sympy.tanh: "np.tanh", sympy.sinh: "np.sinh", sympy.cosh: "np.cosh",
    sympy.sin: "np.sin", sympy.cos: "np.cos", sympy.tan: "np.tan", sympy.atan: "np.arctan",
    sympy.Abs: "np.abs", sympy.sign: "np.sign", sympy.erf: "erf",
}
# functions the kernels call from the runtime (numpy has no ufunc for them): name -> the import that provides it
RUNTIME_FUNCTIONS = {"erf": "from deepdsl_runtime.cpu.elementwise import erf"}


def runtime_imports(bodies) -> tuple[str, ...]:
    """The import lines of the runtime functions that kernel bodies (lines of code) call."""
    text = "\n".join(line for body in bodies for line in body)
    return tuple(line for name, line in RUNTIME_FUNCTIONS.items() if re.search(rf"(?<![\w.]){name}\(", text))


def _reads(expr: sympy.Expr) -> frozenset[int]:
    return frozenset(int(s.name[1:]) for s in expr.free_symbols)


def _literal(number: sympy.Expr) -> str:
    if number.is_Integer:
        return str(int(number))
    return repr(float(number))


def _size(expr: sympy.Expr) -> int:
    return sympy.count_ops(expr) + len(expr.args)


# ----------------------------------------------------------------------------------------------------------------
# the tree of ufunc applications

_LOW, _ADD, _MUL, _NEG, _ATOM = 0, 1, 2, 3, 4
_INFIX = {"np.add": (" + ", _ADD), "np.subtract": (" - ", _ADD), "np.multiply": (" * ", _MUL),
          "np.divide": (" / ", _MUL)}


@dataclass(frozen=True)
class Leaf:
    """An input (`v3`), a number, or an expression without a rule (`kind` "symbol", "number", "expr")."""

    code: str
    kind: str
    reads: frozenset[int]

    @property
    def prec(self) -> int:
        if self.kind == "expr":
            return _LOW
        return _ADD if self.code.startswith("-") else _ATOM


@dataclass(frozen=True)
class Apply:
    """A ufunc applied to one or two subtrees; `extra`: constant arguments after the operand (`, 0`)."""

    func: str
    args: tuple
    extra: str = ""

    @functools.cached_property
    def reads(self) -> frozenset[int]:
        return frozenset().union(*(a.reads for a in self.args))


def ordered_operands(args: list[sympy.Expr]) -> list[sympy.Expr]:
    """Operands of a commutative op in the order they combine: the largest computed one first (so it is built in
    `out` without a temporary), numbers last."""
    return sorted(args, key=lambda a: (a.is_Number, a.is_Atom, -_size(a)))


def _split_sign(term: sympy.Expr) -> tuple[bool, sympy.Expr]:
    """(negative, |term|) for a term of a sum: -3*x -> (True, 3*x)."""
    coeff, rest = term.as_coeff_Mul()
    if coeff.is_Number and coeff < 0:
        return True, (-coeff) * rest if coeff != -1 else rest
    return False, term


def _factors(expr: sympy.Expr) -> tuple[sympy.Expr, list[sympy.Expr], list[sympy.Expr]]:
    """coefficient, numerator factors, denominator factors of a product."""
    coeff, rest = expr.as_coeff_Mul()
    num, den = [], []
    for f in sympy.Mul.make_args(rest):
        if f.is_Pow and f.exp.is_Number and f.exp < 0:
            den.append(f.base if f.exp == -1 else sympy.Pow(f.base, -f.exp))
        else:
            num.append(f)
    return coeff, num, den


def _fold(head, rest: list, funcs: list[str]):
    """((head f1 rest[0]) f2 rest[1]) ...: left to right."""
    for x, func in zip(rest, funcs):
        head = Apply(func, (head, x))
    return head


def tree(expr: sympy.Expr) -> Leaf | Apply:
    """The ufunc applications computing `expr` (over v0, v1, ...), operands in the order they combine."""
    if expr.is_Symbol:
        return Leaf(expr.name, "symbol", _reads(expr))
    if expr.is_number:
        # a constant (sqrt(2), pi) is one Python float: float32 arrays stay float32 with it, where numpy's own
        # scalars (np.sqrt(2), np.pi) would make a float64 temporary
        return Leaf(_literal(expr) if expr.is_Number else repr(float(expr)), "number", frozenset())
    if expr.is_Add:
        return _add(expr)
    if expr.is_Mul:
        return _mul(expr)
    if expr.is_Pow:
        return _pow(expr)
    if expr.func in _UNARY and len(expr.args) == 1:
        return Apply(_UNARY[expr.func], (tree(expr.args[0]),))
    if isinstance(expr, Softplus):              # log(1 + exp(x)) without overflow
        return Apply("np.logaddexp", (tree(expr.args[0]),), ", 0")
    if isinstance(expr, Sigmoid):               # exp(-log(1 + exp(-x))): no overflow, accurate in both tails
        return Apply("np.exp", (Apply("np.negative", (Apply("np.logaddexp", (tree(-expr.args[0]),), ", 0"),)),))
    if isinstance(expr, (sympy.Max, sympy.Min)):
        func = "np.maximum" if isinstance(expr, sympy.Max) else "np.minimum"
        first, *rest = [tree(a) for a in ordered_operands(list(expr.args))]
        return _fold(first, rest, [func] * len(rest))
    if isinstance(expr, sympy.Heaviside):
        h0 = expr.args[1] if len(expr.args) > 1 else sympy.Rational(1, 2)
        x = tree(expr.args[0])
        if h0 in (0, 1):
            return Apply("np.greater" if h0 == 0 else "np.greater_equal", (x,), ", 0")
        return Apply("np.heaviside", (x,), f", {_literal(h0)}")
    return Leaf(_printer().doprint(expr).replace("numpy.", "np."), "expr", _reads(expr))


def _add(expr: sympy.Expr):
    signed = [_split_sign(t) for t in expr.args]
    terms = ordered_operands([m for _, m in signed])
    negative = {id(m): n for n, m in signed}
    # a positive term leads when there is one (a leading negative term costs a separate negation)
    positive = [t for t in terms if not negative[id(t)]]
    if positive and negative[id(terms[0])]:
        terms.remove(positive[0])
        terms.insert(0, positive[0])
    head = tree(-terms[0]) if negative[id(terms[0])] else tree(terms[0])
    funcs = ["np.subtract" if negative[id(t)] else "np.add" for t in terms[1:]]
    return _fold(head, [tree(t) for t in terms[1:]], funcs)


def _mul(expr: sympy.Expr):
    coeff, num, den = _factors(expr)
    num = ordered_operands(num)
    if not num:                                   # c / d
        return Apply("np.divide", (tree(coeff), tree(sympy.Mul(*den))))
    if len(num) == 1 and not den and coeff == -1:
        return Apply("np.negative", (tree(num[0]),))
    rest = num[1:] + ([coeff] if coeff != 1 else []) + den
    funcs = ["np.multiply"] * (len(rest) - len(den)) + ["np.divide"] * len(den)
    return _fold(tree(num[0]), [tree(x) for x in rest], funcs)


def _pow(expr: sympy.Expr):
    base, exp = expr.args
    if exp == sympy.Rational(1, 2):
        return Apply("np.sqrt", (tree(base),))
    if exp == 2:
        return Apply("np.square", (tree(base),))
    if exp == -1:
        return _mul(expr)
    if exp == sympy.Rational(-1, 2):
        return Apply("np.divide", (Leaf("1.0", "number", frozenset()), Apply("np.sqrt", (tree(base),))))
    return Apply("np.power", (tree(base), tree(exp)))


@functools.lru_cache(maxsize=None)
def _printer() -> NumPyPrinter:
    return NumPyPrinter({"fully_qualified_modules": True})


# ----------------------------------------------------------------------------------------------------------------
# printing: a subtree as a numpy expression, a path as calls into out

def _paren(node, context: int) -> str:
    code, prec = expression(node)
    return f"({code})" if prec < context else code


def expression(node) -> tuple[str, int]:
    """(numpy expression, precedence) computing a subtree by value, in the tree's order."""
    if isinstance(node, Leaf):
        return node.code, node.prec
    if node.func in _INFIX:
        sign, prec = _INFIX[node.func]
        a, b = node.args
        return _paren(a, prec) + sign + _paren(b, prec + 1), prec
    if node.func == "np.negative":
        return "-" + _paren(node.args[0], _NEG), _NEG
    return f"{node.func}({', '.join(expression(a)[0] for a in node.args)}{node.extra})", _ATOM


@dataclass(frozen=True)
class Call:
    """One line of a kernel body and the inputs (by index) it reads."""

    code: str
    reads: frozenset[int]


def _into_out(node, operands: list[str]) -> str:
    return f"{node.func}({', '.join(operands)}{node.extra}, out=out)"


def path(node, alias: int | None = None) -> list[Call] | None:
    """Calls computing `node` into `out`, bottom up. With `alias`, `out` is that input: the path goes through the
    operand reading it, and None says that no path reads it in the first call only."""
    if isinstance(node, Leaf):
        return [Call(f"np.copyto(out, {node.code})" if node.kind == "symbol" else f"out[...] = {node.code}",
                     node.reads)]
    if len(node.args) == 1:
        (x,) = node.args
        if isinstance(x, Leaf):
            return [Call(_into_out(node, [x.code]), x.reads)]
        inner = path(x, alias)
        return inner and inner + [Call(_into_out(node, ["out"]), frozenset())]
    a, b = node.args
    if isinstance(b, Apply) and isinstance(a, Leaf) and a.kind == "number":  # c / d: d into out, then c beside it
        inner = path(b, alias)
        return inner and inner + [Call(_into_out(node, [a.code, "out"]), frozenset())]
    if isinstance(a, Leaf) or (alias in b.reads and isinstance(b, Leaf)):     # one call: the other a temporary
        return [Call(_into_out(node, [expression(a)[0], expression(b)[0]]), node.reads)]
    if alias in b.reads and alias not in a.reads:                             # b into out, then a beside it
        inner = path(b, alias)
        return inner and inner + [Call(_into_out(node, [expression(a)[0], "out"]), a.reads)]
    if alias in b.reads:                                                      # both read it
        return None
    inner = path(a, alias)
    return inner and inner + [Call(_into_out(node, ["out", expression(b)[0]]), b.reads)]


def render(expr: sympy.Expr, alias: int | None = None) -> list[str] | None:
    """Body lines of a kernel computing `expr` (over v0, v1, ...) into `out`, or None where `out` is input `alias`
    and no path of the tree reads it in the first call only."""
    calls = path(tree(expr), alias)
    if calls is None or (alias is not None and any(alias in c.reads for c in calls[1:])):
        return None
    return [c.code for c in calls]


def kernel_body(expr: sympy.Expr, alias: int | None = None) -> list[str]:
    """`render`, or where `out` may be input `alias` and every path reads it after writing `out`, the calls of the
    kernel without an alias over a copy of that input taken first. The same roundings in every case."""
    body = render(expr, alias)
    if body is not None:
        return body
    return [f"v{alias} = v{alias}.copy()      # out is v{alias}, read after out is written"] + render(expr)
