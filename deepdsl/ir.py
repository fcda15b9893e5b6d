"""The typed expression graph every stage of deepdsl works on.

Nodes are frozen and hash-consed: `make` returns the existing node when an equal one (same op, same input
objects, same attributes) is alive, so structurally equal subexpressions are one object and common-subexpression
elimination is a matter of rebuilding through `make`. A node's shape and dtype are inferred by its op's shape rule
when it is made, so every graph that exists has been shape-checked; a value of more than `MAX_BYTES` (2^48
bytes, 256 TiB: more memory than any machine has) is a `SizeError` when it is made, naming the network file's line.
"""
from __future__ import annotations

import itertools
import math
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from deepdsl.errors import SizeError, user_location
from deepdsl.provenance import inherit

FLOAT = "float"   # the training dtype: float32 in generated programs, float64 in gradient tests
INT32 = "int32"   # labels
UINT8 = "uint8"   # pooling argmax indices

ITEMSIZE = {FLOAT: 4, INT32: 4, UINT8: 1}
# the most bytes a value, or a step's whole memory plan (`pipeline.plan_steps`), may take: 2^48 = 256 TiB is beyond
# any machine's memory, so a larger size is a mistake in the network's sizes (channels=10**12), refused while
# compiling rather than when the program allocates it; it also keeps every sum of sizes within int64
MAX_BYTES = 1 << 48


def bytes_text(nbytes: int) -> str:
    """A byte count for a message: `2.430e+15 bytes` (an integer of any size)."""
    digits = len(str(nbytes)) - 1
    return f"{nbytes:.3e} bytes" if digits < 300 else f"about 10^{digits} bytes"


def numpy_dtype(dtype: str, float_dtype=np.float32):
    return {FLOAT: float_dtype, INT32: np.int32, UINT8: np.uint8}[dtype]


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Node:
    """One value of the graph: `op` applied to `inputs` with hashable `attrs` (sorted (name, value) pairs)."""

    op: str
    inputs: tuple["Node", ...]
    attrs: tuple[tuple[str, Any], ...]
    shape: tuple[int, ...]
    dtype: str
    serial: int = field(compare=False)   # creation order: a deterministic tie-break for traversals

    def attr(self, name: str, default: Any = None) -> Any:
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def kwargs(self) -> dict[str, Any]:
        """The attributes the op sees (all but the HIDDEN ones)."""
        return {k: v for k, v in self.attrs if k not in HIDDEN}

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * ITEMSIZE[self.dtype]

    @property
    def is_leaf(self) -> bool:
        return not self.inputs and self.op in LEAF_OPS

    @property
    def name(self) -> str | None:
        """The user-visible name of a leaf (`x`, `cv1_W`, `lr`), else None."""
        return self.attr("name")

    def __repr__(self) -> str:
        label = self.name or self.op
        return f"<{label} {'x'.join(map(str, self.shape)) or 'scalar'}>"


LEAF_OPS = frozenset({"input", "param", "state", "const"})
# The attribute marking a recomputed copy of a value (`passes/rematerialize.py`): the copy must be another node than
# the original, which hash-consing would otherwise return. No op sees it (`Node.kwargs` leaves it out).
REMAT = "remat"
# Likewise for the copies the in-place pass makes of values that must survive an update (`passes/inplace.py`): an
# equal computation already in the program must not be the same node.
COPY = "copy"
HIDDEN = frozenset({REMAT, COPY})             # attributes that tell nodes apart but no op, printer or kernel sees

_cache: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()
_serial = itertools.count()


def make(op: str, inputs: Iterable[Node] = (), **attrs: Any) -> Node:
    """The node `op(inputs, **attrs)`: shape-checked by the op's rule, hash-consed."""
    return _make(op, tuple(inputs), tuple(sorted(attrs.items())) if attrs else ())


def _make(op: str, inputs: tuple[Node, ...], items: tuple[tuple[str, Any], ...]) -> Node:
    """`make` with the attributes already as sorted pairs (rebuilding a node reuses its own)."""
    key = (op, tuple(map(id, inputs)), items)
    found = _cache.get(key)
    if found is not None:
        return found
    kwargs = {k: v for k, v in items if k not in HIDDEN}
    shape, dtype = _get_op(op).infer(*inputs, **kwargs)
    shape = tuple(map(int, shape))
    nbytes = math.prod(shape) * ITEMSIZE.get(dtype, 8)
    if nbytes > MAX_BYTES:
        raise SizeError(f"a value of shape {'x'.join(map(str, shape))} takes {bytes_text(nbytes)}, more than the "
                        "2^48 bytes (256 TiB) any machine holds", user_location())
    node = Node(op, inputs, items, shape, dtype, next(_serial))
    _cache[key] = node
    return node


def _get_op(name: str):
    global _get_op
    from deepdsl.ops import get_op   # the registry imports this module: bind it on first use
    _get_op = get_op
    return get_op(name)


def rebuild(node: Node, inputs: Iterable[Node]) -> Node:
    """`node` with other inputs (same op and attributes)."""
    inputs = tuple(inputs)
    old = node.inputs
    if len(inputs) == len(old) and all(map(operator.is_, inputs, old)):
        return node
    return inherit(_make(node.op, inputs, node.attrs), node)


def substitute(node: Node, inputs: Iterable[Node], **extra: Any) -> Node:
    """`node` over other inputs of the same shapes and dtypes (and with `extra` attributes added): its shape and dtype
    are `node`'s, so no shape rule runs. For passes that swap a value for an equal one (a recomputed copy)."""
    inputs = tuple(inputs)
    items = tuple(sorted({**dict(node.attrs), **extra}.items())) if extra else node.attrs
    key = (node.op, tuple(map(id, inputs)), items)
    found = _cache.get(key)
    if found is not None:
        return inherit(found, node)
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(inputs, node.inputs)), "not a substitute"
    new = Node(node.op, inputs, items, node.shape, node.dtype, next(_serial))
    _cache[key] = new
    return inherit(new, node)


def toposort(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from `roots`, each after its inputs (iterative DFS, deterministic)."""
    order: list[Node] = []
    seen: set[Node] = set()      # nodes hash by identity
    append, mark = order.append, seen.add
    for root in roots:
        if root in seen:
            continue
        mark(root)
        stack: list[tuple[Node, Iterator[Node]]] = [(root, iter(root.inputs))]
        while stack:
            node, it = stack[-1]
            for child in it:
                if child not in seen:
                    mark(child)
                    if child.inputs:
                        stack.append((child, iter(child.inputs)))
                        break
                    append(child)    # a leaf: done at once
            else:
                stack.pop()
                append(node)
    return order


def users(nodes: Iterable[Node]) -> dict[int, list[Node]]:
    """id(node) -> the nodes (among `nodes`) that read it."""
    result: dict[int, list[Node]] = {}
    for node in nodes:
        for i in node.inputs:
            result.setdefault(id(i), []).append(node)
    return result


def transform(roots: Iterable[Node], rewrite: Callable[[Node], Node]) -> Callable[[Node], Node]:
    """Rebuild the graph under `roots` bottom-up, applying `rewrite` to each rebuilt node.

    Returns the memoised mapping (old node -> new node); `rewrite` sees nodes whose inputs are already rewritten.
    """
    memo: dict[Node, Node] = {}     # nodes hash by identity
    for node in toposort(roots):
        memo[node] = inherit(rewrite(rebuild(node, [memo[i] for i in node.inputs]) if node.inputs else node), node)
    return memo.__getitem__


@dataclass(frozen=True)
class Graph:
    """Named outputs of a computation (a training step, a test step, a setup step)."""

    name: str
    outputs: tuple[tuple[str, Node], ...]

    def nodes(self) -> list[Node]:
        return toposort(node for _, node in self.outputs)

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes() if n.is_leaf and n.op != "const"]

    def map(self, rewrite: Callable[[Node], Node]) -> "Graph":
        lookup = transform((node for _, node in self.outputs), rewrite)
        return Graph(self.name, tuple((k, lookup(v)) for k, v in self.outputs))
