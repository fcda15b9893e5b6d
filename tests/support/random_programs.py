"""Hypothesis strategies for random well-shaped graphs, the inputs of the pass property tests.

`graphs()` draws a small pool of leaves over three sizes m, n, k (a data batch `x` (m, n), parameters `w` (m, n),
`b` (n,), `u` (n, k), state `s` (m, 1), labels `y` (m,) with n classes, hyperparameters `lr`, `mu`) and then
applies a random sequence of operations to operands chosen from the pool where their shapes fit: elementwise
unary and binary functions with broadcasting (some as activations with `out_grad`, some over hyperparameters or
constants), sum_to, broadcast_to, reshape, matmul (with transposes, and a bias added), softmax, the log-loss and log-softmax
patterns, pick / unpick, concat, slice, constants (scalars and fills, zeros included), a random mask, and
gradients of a scalar of the pool with respect to the parameters (which brings broadcast / sum_to / unpick chains
the simplifier rewrites). Some nodes are built with `make` directly, bypassing the canonical `elementwise` helper,
so passes also see non-canonical input. Values stay moderate: the leaves are drawn in [-1, 1] and the unary
functions are bounded or contracting.

`feeds(graph, seed)` draws the inputs of a graph's leaves; `conv_geometries` and
`pool_geometries` valid convolution and pooling geometries.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
from hypothesis import strategies as st

from deepdsl.autodiff import gradients
from deepdsl.errors import ShapeError
from deepdsl.ir import FLOAT, INT32, Graph, Node, make
from deepdsl.ops.elementwise import Y, broadcast_to, elementwise, reshape, sum_to, sym
from deepdsl.ops.leaf import const
from deepdsl.ops.linalg import matmul
from deepdsl.ops.loss import log_loss
from deepdsl.ops.shape import concat, slice_axis

v0, v1, v2 = sym(0), sym(1), sym(2)

UNARY = [
    (sympy.tanh(v0), 1 - Y ** 2),
    (sympy.Max(v0, 0), sympy.Heaviside(Y, 0)),
    (1 / (1 + sympy.exp(-v0)), Y * (1 - Y)),
    (sympy.sin(v0), None),
    (-v0, None),
    (v0 / 2, None),
    (v0 / (1 + v0 ** 2), None),
    (sympy.exp(-v0 ** 2), None),
    (sympy.log(1 + v0 ** 2), None),
    (3 * v0 + 1, None),
]
BINARY = [v0 + v1, v0 * v1, v0 - v1, v0 / (1 + v1 ** 2), sympy.Max(v0, v1), v0 * v1 + v0, (v0 - v1) / 2]
TERNARY = [v0 * v1 + v2, v0 - v1 * v2, v0 * v1 * v2]


@dataclass
class Leaves:
    m: int
    n: int
    k: int
    x: Node
    w: Node
    b: Node
    u: Node
    s: Node
    y: Node
    lr: Node
    mu: Node

    def pool(self) -> list[Node]:
        return [self.x, self.w, self.b, self.u, self.s, self.lr, self.mu]

    @property
    def params(self) -> list[Node]:
        return [self.w, self.b, self.u]


def leaves(m: int, n: int, k: int) -> Leaves:
    def leaf(op, name, shape, **attrs):
        return make(op, (), name=name, shape=shape, dtype=attrs.pop("dtype", FLOAT), **attrs)

    return Leaves(
        m, n, k,
        x=leaf("input", "x", (m, n), role="data"),
        w=leaf("param", "w", (m, n)),
        b=leaf("param", "b", (n,)),
        u=leaf("param", "u", (n, k)),
        s=leaf("state", "s", (m, 1)),
        y=leaf("input", "y", (m,), dtype=INT32, role="label", classes=n),
        lr=leaf("input", "lr", (), role="hyper"),
        mu=leaf("input", "mu", (), role="hyper"),
    )


def _broadcastable(a: tuple, b: tuple) -> bool:
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def _sum_targets(shape: tuple) -> list[tuple]:
    """Shapes `shape` can be summed down to."""
    out = [()]
    for lead in range(len(shape) + 1):
        tail = shape[lead:]
        out.append(tail)
        out.append(tuple(1 for _ in tail))
        out.extend(tail[:i] + (1,) + tail[i + 1:] for i in range(len(tail)))
    return list(dict.fromkeys(out))


def _broadcast_targets(shape: tuple) -> list[tuple]:
    out = [(2,) + shape, (3,) + shape]
    out += [shape[:i] + (3,) + shape[i + 1:] for i, d in enumerate(shape) if d == 1]
    return [s for s in out if len(s) <= 4 and int(np.prod(s)) <= 256]


def _reshape_targets(shape: tuple) -> list[tuple]:
    size = int(np.prod(shape, dtype=np.int64))
    out = [(size,), tuple(reversed(shape)), (1,) + shape, shape + (1,)]
    out += [(d, size // d) for d in range(1, size + 1) if size % d == 0]
    return [s for s in dict.fromkeys(out) if len(s) <= 4 and s != shape]


SIZES = st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))


@st.composite
def graphs(draw, max_steps: int = 16, sizes: tuple[int, int, int] | None = None) -> Graph:
    """A random graph with one to four float outputs; `sizes` (m, n, k) fixes the leaves' sizes."""
    m, n, k = sizes if sizes is not None else draw(SIZES)
    lv = leaves(m, n, k)
    pool: list[Node] = lv.pool()
    created: list[Node] = []

    def floats(min_rank: int = 0) -> list[Node]:
        return [p for p in pool if p.dtype == FLOAT and len(p.shape) >= min_rank]

    def pick_from(nodes: list[Node]) -> Node:
        return nodes[draw(st.integers(0, len(nodes) - 1))]

    def add(node: Node | None) -> None:
        if node is not None and node.dtype == FLOAT:
            pool.append(node)
            created.append(node)

    steps = draw(st.integers(min(4, max_steps), max_steps))
    kinds = ["unary", "binary", "ternary", "hyper", "const", "fill", "zero", "sum_to", "broadcast_to", "reshape",
             "matmul", "softmax", "log_loss", "log_softmax", "pick", "unpick", "concat", "slice", "mask",
             "raw_ew", "gradients"]
    for _ in range(steps):
        kind = draw(st.sampled_from(kinds))
        try:
            add(_step(draw, kind, lv, floats, pick_from))
        except ShapeError:
            continue
    if not created:
        created.append(elementwise(v0 * v1, [lv.x, lv.w]))
    chosen = [created[-1]] + draw(st.lists(st.sampled_from(created), max_size=3))
    outputs = []
    for node in dict.fromkeys(chosen):
        outputs.append((f"out{len(outputs)}", node))
    return Graph("random", tuple(outputs))


def _step(draw, kind, lv: Leaves, floats, pick_from) -> Node | None:
    if kind == "unary":
        expr, out_grad = draw(st.sampled_from(UNARY))
        x = pick_from(floats())
        return elementwise(expr, [x], out_grad=out_grad if draw(st.booleans()) else None)
    if kind == "binary":
        a = pick_from(floats())
        partners = [p for p in floats() if _broadcastable(a.shape, p.shape)]
        return elementwise(draw(st.sampled_from(BINARY)), [a, pick_from(partners)])
    if kind == "ternary":
        a = pick_from(floats())
        bs = [p for p in floats() if _broadcastable(a.shape, p.shape)]
        b = pick_from(bs)
        cs = [p for p in floats() if _broadcastable(np.broadcast_shapes(a.shape, b.shape), p.shape)]
        return elementwise(draw(st.sampled_from(TERNARY)), [a, b, pick_from(cs)])
    if kind == "hyper":     # an optimizer-like update over hyperparameters
        a = pick_from(floats())
        return elementwise(v0 * v1 - v2 * v0, [a, lv.mu, lv.lr])
    if kind == "const":
        a = pick_from(floats())
        c = draw(st.sampled_from([0.0, 1.0, -2.0, 0.5]))
        return elementwise(v0 * v1 + v1, [a, const(c)])
    if kind == "fill":      # a filled constant tensor, maybe broadcast
        a = pick_from(floats())
        value = draw(st.sampled_from([0.0, 1.0, 0.25, -3.0]))
        fill = const(value, a.shape) if draw(st.booleans()) else broadcast_to(const(value), a.shape)
        return elementwise(draw(st.sampled_from(BINARY)), [a, fill]) if draw(st.booleans()) else fill
    if kind == "zero":      # zeros through linear ops
        a = pick_from(floats(2))
        if len(a.shape) != 2:
            return None
        return matmul(const(0.0, a.shape), a, ta=True)
    if kind == "sum_to":
        a = pick_from(floats())
        return sum_to(a, draw(st.sampled_from(_sum_targets(a.shape))))
    if kind == "broadcast_to":
        a = pick_from(floats())
        targets = _broadcast_targets(a.shape)
        return broadcast_to(a, draw(st.sampled_from(targets))) if targets else None
    if kind == "reshape":
        a = pick_from(floats())
        targets = _reshape_targets(a.shape)
        if not targets:
            return None
        r = reshape(a, draw(st.sampled_from(targets)))
        return reshape(r, a.shape) if draw(st.booleans()) else r
    if kind == "matmul":
        a = pick_from(floats(2))
        if len(a.shape) != 2:
            return None
        ta, tb = draw(st.booleans()), draw(st.booleans())
        inner = a.shape[0] if ta else a.shape[1]
        partners = [p for p in floats(2) if len(p.shape) == 2 and (p.shape[1] if tb else p.shape[0]) == inner]
        if not partners:
            return None
        product = matmul(a, pick_from(partners), ta=ta, tb=tb)
        biases = [p for p in floats(1) if p.shape == product.shape[1:]]
        if biases and draw(st.booleans()):              # a fully connected layer's bias (passes.fuse_epilogue)
            return elementwise(sym(0) + sym(1), [product, pick_from(biases)])
        return product
    if kind in ("softmax", "log_loss", "log_softmax"):
        rows = [p for p in floats(2) if p.shape == (lv.m, lv.n)]
        if kind == "softmax":
            rows = [p for p in floats(2) if len(p.shape) == 2]
        if not rows:
            return None
        z = elementwise(sympy.tanh(v0) * 3, [pick_from(rows)])    # bounded logits: log(softmax) stays finite
        probs = make("softmax", (z,))
        if kind == "softmax":
            return probs
        if kind == "log_loss":
            return log_loss(probs, lv.y)
        return elementwise(sympy.log(v0) * v1, [probs, pick_from([p for p in floats() if p.shape in ((), (lv.n,))])])
    if kind == "pick":
        rows = [p for p in floats(2) if p.shape == (lv.m, lv.n)]
        return make("pick", (pick_from(rows), lv.y)) if rows else None
    if kind == "unpick":
        vectors = [p for p in floats(1) if p.shape == (lv.m,)]
        return make("unpick", (pick_from(vectors), lv.y), classes=lv.n) if vectors else None
    if kind == "concat":
        a = pick_from(floats(1))
        axis = draw(st.integers(0, len(a.shape) - 1))
        partners = [p for p in floats(1) if len(p.shape) == len(a.shape)
                    and p.shape[:axis] + p.shape[axis + 1:] == a.shape[:axis] + a.shape[axis + 1:]]
        c = concat([a, pick_from(partners)], axis=axis)
        if draw(st.booleans()):     # slice it back
            return slice_axis(c, axis, 0, a.shape[axis])
        return c
    if kind == "slice":
        a = pick_from(floats(1))
        axis = draw(st.integers(0, len(a.shape) - 1))
        if a.shape[axis] < 2:
            return None
        start = draw(st.integers(0, a.shape[axis] - 1))
        stop = draw(st.integers(start + 1, a.shape[axis]))
        return slice_axis(a, axis, start, stop)
    if kind == "mask":      # random numbers: never hoisted, never folded
        a = pick_from(floats())
        mask = make("bernoulli", (), shape=a.shape, keep=0.5, key=draw(st.integers(0, 3)))
        return elementwise(v0 * v1 * 2, [a, mask])
    if kind == "raw_ew":    # non-canonical: a scalar constant input, a repeated input, an identity
        a = pick_from(floats())
        form = draw(st.integers(0, 2))
        if form == 0:
            return make("ew", (a, const(draw(st.sampled_from([0.0, 2.0])))), expr=v0 * v1 + v0)
        if form == 1:
            return make("ew", (a, a), expr=v0 - v1 * v0)
        return make("ew", (a,), expr=v0 * 1)
    if kind == "gradients":
        a = pick_from(floats())
        weights = [p for p in floats() if _broadcastable(a.shape, p.shape)]
        loss = sum_to(elementwise(v0 * v1, [a, pick_from(weights)]), ())
        wrt = lv.params
        grads = gradients(loss, wrt)
        chosen = wrt[draw(st.integers(0, len(wrt) - 1))]
        return grads[chosen]
    raise AssertionError(kind)


def feeds(graph_or_leaves, seed: int) -> dict[str, np.ndarray]:
    """Random values for the named leaves of a graph or program: floats in [-1, 1], labels in range."""
    rng = np.random.default_rng(seed)
    leaves_ = graph_or_leaves.leaves() if isinstance(graph_or_leaves, Graph) else graph_or_leaves
    out = {}
    for leaf in leaves_:
        if leaf.dtype == INT32:
            out[leaf.name] = rng.integers(0, leaf.attr("classes"), size=leaf.shape).astype(np.int32)
        else:
            out[leaf.name] = rng.uniform(-1, 1, size=leaf.shape)
    return out


__all__ = ["SIZES", "feeds", "graphs", "leaves"]


@st.composite
def pool_geometries(draw, largest: int = 8):
    """Valid pooling geometries: padding at most half the window, the window no larger than the padded input (of
    at most `largest` rows and columns)."""
    kernel = draw(st.integers(1, 4))
    pad = draw(st.integers(0, kernel // 2))
    h, w = (draw(st.integers(max(1, kernel - 2 * pad), largest)) for _ in range(2))
    return dict(h=h, w=w, kernel=kernel, stride=draw(st.integers(1, 3)), pad=pad, ceil=draw(st.booleans()))


@st.composite
def conv_geometries(draw, kernel: int = 4, pad: int = 2, largest: int = 8):
    """Valid convolution geometries: kernels up to `kernel` rows and columns, padding up to `pad`, the window no
    larger than the padded input (of at most `largest` rows and columns)."""
    kh, kw, pad = draw(st.integers(1, kernel)), draw(st.integers(1, kernel)), draw(st.integers(0, pad))
    h, w = draw(st.integers(max(1, kh - 2 * pad), largest)), draw(st.integers(max(1, kw - 2 * pad), largest))
    return dict(h=h, w=w, kh=kh, kw=kw, stride=draw(st.integers(1, 3)), pad=pad)
