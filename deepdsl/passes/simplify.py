"""Algebraic simplification and constant folding, one bottom-up sweep over the graph.

Each node is rewritten after its inputs, by the first rule of its op that applies; the result is simplified again
(a rule may enable another), so every node of the result is in normal form under the rules below. Rules are local
and constant-time apart from constant folding, which evaluates only small tensors, so the pass is linear in the
size of the graph. Elementwise expressions are left to sympy's automatic canonicalization (`0*x = 0`, `x + 0 = x`,
`1*x = x`, numbers folded): the pass never calls `sympy.simplify`.

Rules (a "fill" is a `const` tensor, every element equal):

- **fold**: a node whose inputs are all constants becomes a scalar `const` or a fill when its value is uniform
  (evaluated when the tensors involved are small, else by the specific rules below); otherwise it is kept.
- **broadcast_to**: to its own shape -> `x`; of a constant -> fill; of a `broadcast_to(a)` -> one `broadcast_to(a)`.
- **reshape**: to its own shape -> `x`; of a `reshape(a)` -> one reshape of `a` (or `a`); of a fill -> fill.
- **transpose** of `transpose(a)` with the same two axes -> `a`.
- **sum_to**: to its own shape -> `x`; of a fill -> fill of value * (elements summed per output);
  of `broadcast_to(a)` where `a` broadcasts to the target -> `count * a` (`a` scalar: the sum of a broadcast
  scalar is the scalar times the count); of `unpick(g, y)` to (N, 1) -> `reshape(g)` (one nonzero per row), to a
  scalar -> `sum_to(g)`.
- **ew inputs**: an input `broadcast_to(a)` or a fill is read as `a` or as the scalar itself (numpy
  broadcasting), as long as the other inputs still give the result its full shape; scalar constants become numbers
  inside the expression, and an expression left without inputs is folded.
- **log of softmax**: `log(pick(softmax(z), y))` inside an expression -> `pick(log_softmax(z), y)`, and
  `log(softmax(z))` -> `log_softmax(z)`: numerically stable, and the backward of the log-softmax no longer divides
  by a probability. DeepDSL's `log_loss` after `softmax` becomes cross entropy. To matter for gradients this must
  run on the forward graph before differentiation: the pipeline passes `simplify` to `build_step_graphs`.
- **zeros**: ops linear in an input (matmul, pick, unpick, pad_axis, the backward ops of convolution, pooling and
  LRN) whose input there is the constant 0 -> a zero fill.
- **slice** of a `concat` that falls inside one of its pieces -> a slice of that piece (or the piece itself);
  **concat** of fills of one value -> fill; **slice** / **pad_axis** of fills -> fill (zero fill for pad_axis).

Guarantees: same values (up to floating-point rounding of folded constants and the log-softmax rewrite); shapes
and dtypes of graph outputs unchanged; no node of the result matches a rule.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import sympy

from deepdsl.ir import FLOAT, Graph, Node, make
from deepdsl.ops import EvalContext, get_op
from deepdsl.ops.elementwise import broadcast_to, broadcasts_to, elementwise, reshape, sum_to, sym, symbols
from deepdsl.ops.leaf import const

FOLD_LIMIT = 4096          # evaluate all-constant nodes only when every tensor involved is at most this big
_MAX_REWRITES = 32         # rules applied to one node before giving up (a safety net: the rules terminate)

Rule = Callable[[Node], "Node | None"]


def simplify(graph: Graph) -> Graph:
    """The graph with every node simplified by the rules of this module."""
    return graph.map(simplify_node)


def simplify_node(node: Node) -> Node:
    """`node`, whose inputs are already simplified, rewritten until no rule applies."""
    for _ in range(_MAX_REWRITES):
        new = _rewrite_once(node)
        if new is None or new is node:
            return node
        node = new
    return node


def _rewrite_once(node: Node) -> Node | None:
    for rule in _RULES.get(node.op, ()):
        new = rule(node)
        if new is not None and new is not node:
            return new
    return _fold(node)


# ---------------------------------------------------------------------------------------------------------------
# helpers

def _is_fill(node: Node) -> bool:
    return node.op == "const"


def _value(node: Node) -> float:
    return node.attr("value")


def _fill(value: float, shape: tuple[int, ...]) -> Node:
    return const(value, shape)


# ---------------------------------------------------------------------------------------------------------------
# fold

def _fold(node: Node) -> Node | None:
    """All inputs constant, result uniform and float -> a constant. Evaluated with float64 numpy, small sizes only."""
    if not node.inputs or node.dtype != FLOAT or not all(_is_fill(i) for i in node.inputs):
        return None
    op = get_op(node.op)
    if op.random or op.collective or node.size > FOLD_LIMIT or any(i.size > FOLD_LIMIT for i in node.inputs):
        return None
    ctx = EvalContext(np.float64)
    args = [get_op("const").evaluate(ctx, **i.kwargs) for i in node.inputs]
    with np.errstate(all="ignore"):
        out = np.asarray(op.evaluate(ctx, *args, **node.kwargs), dtype=np.float64)
    if out.size == 0:
        return None
    first = out.flat[0]
    if not np.all((out == first) | (np.isnan(out) & np.isnan(first))):
        return None
    return _fill(float(first), node.shape)


# ---------------------------------------------------------------------------------------------------------------
# shape ops

def _reshape_or_broadcast_rule(node: Node) -> Node | None:
    """`reshape`/`broadcast_to` to the same shape is its input; of a fill, a fill; of the same op, one op."""
    (x,) = node.inputs
    shape = node.attr("shape")
    if x.shape == node.shape:
        return x
    if _is_fill(x):
        return _fill(_value(x), shape)
    if x.op == node.op:
        return (reshape if node.op == "reshape" else broadcast_to)(x.inputs[0], shape)
    return None


def _transpose_rule(node: Node) -> Node | None:
    (x,) = node.inputs
    if x.op == "transpose" and tuple(x.attr("axes")) == tuple(node.attr("axes")):
        return x.inputs[0]
    return None


def _sum_to_rule(node: Node) -> Node | None:
    (x,) = node.inputs
    shape = node.shape
    if x.shape == shape:
        return x
    count = x.size // max(node.size, 1)
    if _is_fill(x):
        return _fill(_value(x) * count, shape)
    if x.op == "broadcast_to" and broadcasts_to(x.inputs[0].shape, shape):
        return simplify_node(elementwise(count * sym(0), [x.inputs[0]], shape=shape))
    if x.op == "unpick":
        g = x.inputs[0]
        if shape == (g.shape[0], 1):
            return reshape(g, shape)
        if shape == ():
            return sum_to(g, ())
    return None


def _slice_rule(node: Node) -> Node | None:
    (x,) = node.inputs
    if _is_fill(x):
        return _fill(_value(x), node.shape)
    if x.op == "concat" and x.attr("axis") == node.attr("axis"):
        axis, start, stop = node.attr("axis"), node.attr("start"), node.attr("stop")
        offset = 0
        for piece in x.inputs:
            end = offset + piece.shape[axis]
            if offset <= start and stop <= end:
                if (start - offset, stop - offset) == (0, piece.shape[axis]):
                    return piece
                return make("slice", (piece,), axis=axis, start=start - offset, stop=stop - offset)
            offset = end
    return None


def _concat_rule(node: Node) -> Node | None:
    if all(_is_fill(i) for i in node.inputs) and len({_value(i) for i in node.inputs}) == 1:
        return _fill(_value(node.inputs[0]), node.shape)
    return None


# ops whose value is zero when the input at one of these positions is zero (they are linear in it)
_LINEAR_IN = {
    "matmul": (0, 1), "pick": (0,), "unpick": (0,), "pad_axis": (0,), "conv2d_bwd_data": (0, 1),
    "conv2d_bwd_filter": (0, 1), "max_pool_bwd": (0,), "avg_pool_bwd": (0,), "lrn_bwd": (0,), "transpose": (0,),
}


def _zero_rule(node: Node) -> Node | None:
    if node.op == "matmul" and len(node.inputs) == 3:       # + a bias: not linear in the product's operands
        return None
    if node.dtype == FLOAT and any(_is_fill(node.inputs[k]) and _value(node.inputs[k]) == 0.0
                                   for k in _LINEAR_IN[node.op]):
        return _fill(0.0, node.shape)
    return None


def _pick_rule(node: Node) -> Node | None:
    x = node.inputs[0]
    if _is_fill(x):
        return _fill(_value(x), node.shape)
    return None


# ---------------------------------------------------------------------------------------------------------------
# elementwise

def _log_softmax_rule(node: Node) -> Node | None:
    """log(pick(softmax(z), y)) -> pick(log_softmax(z), y); log(softmax(z)) -> log_softmax(z)."""
    if not any(x.op in ("pick", "softmax") for x in node.inputs):
        return None
    expr = node.attr("expr")
    if not expr.has(sympy.log):
        return None
    inputs = list(node.inputs)
    names = symbols(len(inputs))
    for k, x in enumerate(node.inputs):
        if x.op == "pick" and x.inputs[0].op == "softmax":
            stable = make("pick", (make("log_softmax", (x.inputs[0].inputs[0],)), x.inputs[1]))
        elif x.op == "softmax":
            stable = make("log_softmax", x.inputs)
        else:
            continue
        log = sympy.log(sym(k))
        if not expr.has(log):
            continue
        name = sympy.Dummy()
        expr = expr.xreplace({log: name})
        inputs.append(stable)
        names.append(name)
    if len(inputs) == len(node.inputs):
        return None
    return elementwise(expr, inputs, names=names, shape=node.shape)


def _direct_inputs_rule(node: Node) -> Node | None:
    """Read `a` for `broadcast_to(a)` and a number for a fill, while the result keeps its full shape; scalar
    constants become numbers in the expression (done by `elementwise`); no input left -> folded."""
    inputs = list(node.inputs)
    if not any(x.op in ("broadcast_to", "const") for x in inputs) and len(set(map(id, inputs))) == len(inputs):
        return None
    changed = False
    for k, x in enumerate(node.inputs):
        if x.op == "broadcast_to":
            candidate = x.inputs[0]
        elif _is_fill(x):
            candidate = _fill(_value(x), ())
        else:
            continue
        trial = inputs[:k] + [candidate] + inputs[k + 1:]
        if all(_is_fill(i) for i in trial) or np.broadcast_shapes(*(i.shape for i in trial)) == node.shape:
            inputs, changed = trial, True
    scalar_const = any(_is_fill(i) and i.shape == () for i in inputs)
    if not changed and not scalar_const and len(set(map(id, inputs))) == len(inputs):
        return None
    out_grad = node.attr("out_grad")
    keep_out_grad = out_grad is not None and len(inputs) == 1 and inputs[0] is node.inputs[0]
    try:
        return elementwise(node.attr("expr"), inputs, shape=node.shape,
                           out_grad=out_grad if keep_out_grad else None)
    except TypeError:          # the folded value is not a real number (log of a negative constant): keep it
        return None


def _ew_rules(node: Node) -> Node | None:
    return _log_softmax_rule(node) or _direct_inputs_rule(node)


_RULES: dict[str, tuple[Rule, ...]] = {
    "broadcast_to": (_reshape_or_broadcast_rule,),
    "reshape": (_reshape_or_broadcast_rule,),
    "sum_to": (_sum_to_rule,),
    "slice": (_slice_rule,),
    "concat": (_concat_rule,),
    "ew": (_ew_rules,),
    "pick": (_pick_rule, _zero_rule),
    **{op: (_zero_rule,) for op in _LINEAR_IN if op != "pick"},
    "transpose": (_transpose_rule, _zero_rule),
}
