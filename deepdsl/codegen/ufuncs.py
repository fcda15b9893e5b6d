"""Render an `ew` node's sympy expression as numpy ufunc calls that write into `out`.

The expression tree is walked along one spine, computed in place in `out` (`np.multiply(v0, v1, out=out)`, then
`np.add(out, v2, out=out)`, ...); the other operands of each spine step are plain numpy expressions (these make
numpy temporaries, which is the price of branching trees). ReLU `Max(0, v0)` becomes `np.maximum(v0, 0,
out=out)`, `Heaviside(v0, 0)` `np.greater(v0, 0, out=out)` (a 0/1 float), sigmoid a chain of negative, exp, add
and divide, all into `out`. Anything without a rule is printed by sympy's NumPyPrinter and assigned with
`out[...] = ...`.

In-place updates: when the statement's output buffer is also input `alias` (a parameter overwritten by its new
value), the spine starts at the term holding that input and `render` checks that no later call reads it after
`out` has been written; it returns None when that cannot be guaranteed, and the caller uses a separate buffer.
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


@dataclass(frozen=True)
class Call:
    """One line of a kernel body and the inputs (by index) it reads."""

    code: str
    reads: frozenset[int]


def _index(symbol: sympy.Symbol) -> int:
    return int(symbol.name[1:])


def _reads(expr: sympy.Expr) -> frozenset[int]:
    return frozenset(_index(s) for s in expr.free_symbols)


def _literal(number: sympy.Expr) -> str:
    if number.is_Integer:
        return str(int(number))
    return repr(float(number))


def _size(expr: sympy.Expr) -> int:
    return sympy.count_ops(expr) + len(expr.args)


# ----------------------------------------------------------------------------------------------------------------
# operands: numpy expressions (may create temporaries)

_ATOM, _POW, _MUL, _ADD = 4, 3, 2, 1


def _paren(code_prec: tuple[str, int], context: int) -> str:
    code, prec = code_prec
    return f"({code})" if prec < context else code


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


def operand(expr: sympy.Expr) -> tuple[str, int]:
    """(numpy expression, precedence) computing `expr` by value."""
    if expr.is_Symbol:
        return expr.name, _ATOM
    if expr.is_Number:
        text = _literal(expr)
        return text, (_ATOM if not text.startswith("-") else _ADD)
    if expr.is_Add:
        terms = sorted(expr.args, key=lambda t: _split_sign(t)[0])      # positive terms first
        text = ""
        for t in terms:
            negative, magnitude = _split_sign(t)
            code = _paren(operand(magnitude), _MUL if negative else _ADD)
            if not text:
                text = f"-{_paren(operand(magnitude), _POW)}" if negative else code
            else:
                text += f" - {code}" if negative else f" + {code}"
        return text, _ADD
    if expr.is_Mul:
        coeff, num, den = _factors(expr)
        parts = [_paren(operand(f), _MUL) for f in num]
        if coeff == -1 and num:
            head = "-" + " * ".join(parts)
        elif coeff != 1 or not num:
            head = " * ".join(parts + [_literal(coeff)]) if num else _literal(coeff)
        else:
            head = " * ".join(parts)
        for d in den:
            head += f" / {_paren(operand(d), _POW)}"
        return head, _MUL
    if expr.is_Pow:
        base, exp = expr.args
        if exp == sympy.Rational(1, 2):
            return f"np.sqrt({operand(base)[0]})", _ATOM
        if exp == sympy.Rational(-1, 2):
            return f"1.0 / np.sqrt({operand(base)[0]})", _MUL
        if exp == -1:
            return f"1.0 / {_paren(operand(base), _POW)}", _MUL
        if exp == 2:
            return f"np.square({operand(base)[0]})", _ATOM
        return f"np.power({operand(base)[0]}, {operand(exp)[0]})", _ATOM
    func = _unary_name(expr)
    if func:
        return f"{func}({operand(expr.args[0])[0]})", _ATOM
    if isinstance(expr, Softplus):
        return f"np.logaddexp({operand(expr.args[0])[0]}, 0)", _ATOM
    if isinstance(expr, Sigmoid):
        return f"np.exp(-np.logaddexp({operand(-expr.args[0])[0]}, 0))", _ATOM
    if isinstance(expr, (sympy.Max, sympy.Min)):
        name = "np.maximum" if isinstance(expr, sympy.Max) else "np.minimum"
        args = ordered_operands(list(expr.args), None)
        code = operand(args[0])[0]
        for a in args[1:]:
            code = f"{name}({code}, {operand(a)[0]})"
        return code, _ATOM
    if isinstance(expr, sympy.Heaviside):
        return _heaviside(expr, operand(expr.args[0])[0], None), _ATOM
    return _fallback(expr), _ATOM


def _unary_name(expr: sympy.Expr) -> str | None:
    return _UNARY.get(expr.func) if len(expr.args) == 1 else None


def _heaviside(expr: sympy.Heaviside, x: str, out: str | None) -> str:
    h0 = expr.args[1] if len(expr.args) > 1 else sympy.Rational(1, 2)
    tail = f", out={out}" if out else ""
    if h0 == 0:
        return f"np.greater({x}, 0{tail})"
    if h0 == 1:
        return f"np.greater_equal({x}, 0{tail})"
    return f"np.heaviside({x}, {_literal(h0)}{tail})"


@functools.lru_cache(maxsize=None)
def _printer() -> NumPyPrinter:
    return NumPyPrinter({"fully_qualified_modules": True})


def _fallback(expr: sympy.Expr) -> str:
    return _printer().doprint(expr).replace("numpy.", "np.")


# ----------------------------------------------------------------------------------------------------------------
# the spine: calls writing into out

def ordered_operands(args: list[sympy.Expr], alias: int | None) -> list[sympy.Expr]:
    """Operands of a commutative op: the one holding the aliased input first, then the largest computed one
    (so it is built in `out` without a temporary), numbers last."""
    def key(a):
        holds_alias = alias is not None and alias in _reads(a)
        return (not holds_alias, a.is_Number, a.is_Atom, -_size(a))
    return sorted(args, key=key)


def _spine(expr: sympy.Expr, alias: int | None) -> list[Call]:
    if expr.is_Atom:
        value = _literal(expr) if expr.is_Number else expr.name
        code = f"out[...] = {value}" if expr.is_Number else f"np.copyto(out, {value})"
        return [Call(code, _reads(expr))]
    if expr.is_Add:
        return _add(expr, alias)
    if expr.is_Mul:
        return _mul(expr, alias)
    if expr.is_Pow:
        return _pow(expr, alias)
    func = _unary_name(expr)
    if func:
        return _apply(func, expr.args[0], alias)
    if isinstance(expr, Softplus):              # log(1 + exp(x)) without overflow
        return _apply("np.logaddexp", expr.args[0], alias, ", 0")
    if isinstance(expr, Sigmoid):               # exp(-log(1 + exp(-x))): no overflow, accurate in both tails
        return _apply("np.logaddexp", -expr.args[0], alias, ", 0") + [
            Call("np.negative(out, out=out)", frozenset()), Call("np.exp(out, out=out)", frozenset())]
    if isinstance(expr, (sympy.Max, sympy.Min)):
        name = "np.maximum" if isinstance(expr, sympy.Max) else "np.minimum"
        return _fold(name, ordered_operands(list(expr.args), alias), alias)
    if isinstance(expr, sympy.Heaviside):
        return [Call(_heaviside(expr, operand(expr.args[0])[0], "out"), _reads(expr))]
    return [Call(f"out[...] = {_fallback(expr)}", _reads(expr))]


def _apply(func: str, arg: sympy.Expr, alias: int | None, extra: str = "") -> list[Call]:
    """func(arg) into out: arg computed in out first unless it is an atom."""
    if arg.is_Atom:
        return [Call(f"{func}({operand(arg)[0]}{extra}, out=out)", _reads(arg))]
    return _spine(arg, alias) + [Call(f"{func}(out{extra}, out=out)", frozenset())]


def _fold(op: str, args: list[sympy.Expr], alias: int | None, ops: list[str] | None = None) -> list[Call]:
    """out = args[0] op args[1] op ...; `ops` gives a per-operand op (subtract for negative terms)."""
    ops = ops or [op] * len(args)
    head, rest = args[0], args[1:]
    if head.is_Atom and rest:
        second = rest[0]
        calls = [Call(f"{ops[1]}({operand(head)[0]}, {operand(second)[0]}, out=out)",
                      _reads(head) | _reads(second))]
        start = 2
    else:
        calls = _spine(head, alias)
        start = 1
    for a, o in zip(args[start:], ops[start:]):
        calls.append(Call(f"{o}(out, {operand(a)[0]}, out=out)", _reads(a)))
    return calls


def _add(expr: sympy.Expr, alias: int | None) -> list[Call]:
    signed = [_split_sign(t) for t in expr.args]
    terms = ordered_operands([m for _, m in signed], alias)
    negative = {id(m): n for n, m in signed}
    # a positive term leads when there is one (a leading negative term costs a separate negation)
    positive = [t for t in terms if not negative[id(t)]]
    if positive and negative[id(terms[0])]:
        terms.remove(positive[0])
        terms.insert(0, positive[0])
    ops = ["np.subtract" if negative[id(t)] else "np.add" for t in terms]
    if negative[id(terms[0])]:
        calls = _spine(-terms[0], alias)
        ops[0] = "np.add"
        return calls + [Call(f"{o}(out, {operand(a)[0]}, out=out)", _reads(a)) for a, o in zip(terms[1:], ops[1:])]
    return _fold("np.add", terms, alias, ops)


def _mul(expr: sympy.Expr, alias: int | None) -> list[Call]:
    coeff, num, den = _factors(expr)
    num = ordered_operands(num, alias)
    if not num:                                   # c / d
        denominator = sympy.Mul(*den)
        if denominator.is_Atom:
            return [Call(f"np.divide({_literal(coeff)}, {operand(denominator)[0]}, out=out)", _reads(denominator))]
        return _spine(denominator, alias) + [Call(f"np.divide({_literal(coeff)}, out, out=out)", frozenset())]
    if len(num) == 1 and not den and coeff == -1:
        return _apply("np.negative", num[0], alias)
    args = list(num)
    ops = ["np.multiply"] * len(args)
    if coeff != 1:
        args.append(coeff)
        ops.append("np.multiply")
    args += den
    ops += ["np.divide"] * len(den)
    if len(args) == 1:
        return _spine(args[0], alias)
    return _fold("np.multiply", args, alias, ops)


def _pow(expr: sympy.Expr, alias: int | None) -> list[Call]:
    base, exp = expr.args
    if exp == sympy.Rational(1, 2):
        return _apply("np.sqrt", base, alias)
    if exp == 2:
        return _apply("np.square", base, alias)
    if exp == -1:
        return _mul(expr, alias)
    if exp == sympy.Rational(-1, 2):
        return _apply("np.sqrt", base, alias) + [Call("np.divide(1.0, out, out=out)", frozenset())]
    if base.is_Number:
        return [Call(f"np.power({_literal(base)}, {operand(exp)[0]}, out=out)", _reads(exp))]
    return _apply("np.power", base, alias, extra=f", {operand(exp)[0]}")


def render(expr: sympy.Expr, alias: int | None = None) -> list[str] | None:
    """Body lines of a kernel computing `expr` (over v0, v1, ...) into `out`.

    With `alias`, `out` is input `alias` itself: returns None unless every read of that input happens before or
    in the first write to `out`."""
    calls = _spine(expr, alias)
    if alias is not None and any(alias in c.reads for c in calls[1:]):
        return None
    return [c.code for c in calls]


def kernel_body(expr: sympy.Expr, alias: int | None = None) -> list[str]:
    """`render`, or when the in-place spine is unsafe, one assignment (numpy evaluates the whole right-hand side,
    with temporaries, before writing `out`)."""
    body = render(expr, alias)
    return body if body is not None else [f"out[...] = {operand(expr)[0]}"]
