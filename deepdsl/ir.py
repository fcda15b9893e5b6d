"""The typed expression graph every stage of deepdsl works on.

Nodes are frozen and hash-consed: `make` returns the existing node when an equal one (same op, same input
objects, same attributes) is alive, so structurally equal subexpressions are one object and common-subexpression
elimination is a matter of rebuilding through `make`. A node's shape and dtype are inferred by its op's shape rule
when it is made, so every graph that exists has been shape-checked.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

FLOAT = "float"   # the training dtype: float32 in generated programs, float64 in gradient tests
INT32 = "int32"   # labels
UINT8 = "uint8"   # pooling argmax indices

ITEMSIZE = {FLOAT: 4, INT32: 4, UINT8: 1}


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
        return dict(self.attrs)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

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

_cache: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()
_serial = itertools.count()


def make(op: str, inputs: Iterable[Node] = (), **attrs: Any) -> Node:
    """The node `op(inputs, **attrs)`: shape-checked by the op's rule, hash-consed."""
    from deepdsl.ops import get_op   # the registry imports this module

    inputs = tuple(inputs)
    items = tuple(sorted(attrs.items()))
    key = (op, tuple(id(i) for i in inputs), items)
    found = _cache.get(key)
    if found is not None:
        return found
    shape, dtype = get_op(op).infer(*inputs, **attrs)
    node = Node(op, inputs, items, tuple(int(d) for d in shape), dtype, next(_serial))
    _cache[key] = node
    return node


def rebuild(node: Node, inputs: Iterable[Node]) -> Node:
    """`node` with other inputs (same op and attributes)."""
    inputs = tuple(inputs)
    if all(a is b for a, b in zip(inputs, node.inputs)) and len(inputs) == len(node.inputs):
        return node
    return make(node.op, inputs, **node.kwargs)


def toposort(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from `roots`, each after its inputs (iterative DFS, deterministic)."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        if id(root) in seen:
            continue
        stack: list[tuple[Node, Iterator[Node]]] = [(root, iter(root.inputs))]
        seen.add(id(root))
        while stack:
            node, it = stack[-1]
            for child in it:
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append((child, iter(child.inputs)))
                    break
            else:
                stack.pop()
                order.append(node)
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
    memo: dict[int, Node] = {}
    for node in toposort(roots):
        new = rebuild(node, [memo[id(i)] for i in node.inputs]) if node.inputs else node
        memo[id(node)] = rewrite(new)
    return lambda node: memo[id(node)]


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
