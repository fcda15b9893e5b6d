"""Where each value of the graph came from: its layer, the direction (forward or backward) and a readable base
name, kept in a side table beside the IR.

Nodes stay free of it: hash-consing still merges equal nodes whatever layer made them. Each network has its own
table (`Table`, weak in its nodes, so it never keeps a graph alive): loading a network file starts one, the `Loop`
keeps it, compiling records into it and the compiled programs carry it, so what one network records never names
another's values. It is written where graph is made with a layer in view: the DSL when a layer is applied
(`record_layer`), differentiation for each VJP rule (`record_backward`, `record_sum`), the solver for each update
(`record_update`), passes that decompose or rebuild a node (`record_parts`, `inherit`). It is read when a program
is printed: `Program.names` names values after it (`cv1`, `fc1_relu`, `d_cv1_W`, `fc1_W_new`) and code generation
puts a banner above each layer's statements (`# ---- bn2a_branch2a (batch norm), backward ----`).

What a step made is found by structure: the computed nodes under its results down to values already in the table
(and the step's own inputs), so a node made earlier for another network is recorded for this one too.
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from deepdsl.ir import Node

__all__ = ["Origin", "Table", "table", "begin", "using", "origin", "base_name", "record_layer", "record_leaf",
           "record_parts", "record_rest", "record_backward", "record_sum", "record_update", "record_value", "inherit"]

FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"

Table = weakref.WeakKeyDictionary


@dataclass(frozen=True, slots=True)
class Origin:
    """layer: the layer's name (`cv1`; a layer without a name of its own is named after the named layer it
    follows: `cv1_max_pool`); what: its description (`conv 5x5, 20 channels, stride 1, padding 0`); direction:
    forward, backward or update; name: the value's base name (`cv1`, `cv1_max_pool_argmax`, `d_cv1_W`); anchor:
    the named layer a parameter-free layer applied after it is named after; kind: the layer's kind (`max_pool`),
    left out of its values' names."""

    layer: str
    what: str
    direction: str
    name: str
    anchor: str
    kind: str = ""

    @property
    def section(self) -> tuple[str, str]:
        """What a banner of the generated program shows: one per layer and direction, a parameter's update
        counted with the backward (its new values are named `_new`)."""
        return self.layer, FORWARD if self.direction == FORWARD else BACKWARD

    def named(self, name: str, direction: str | None = None) -> "Origin":
        return Origin(self.layer, self.what, direction or self.direction, name, self.anchor, self.kind)


_table: contextvars.ContextVar["Table | None"] = contextvars.ContextVar("deepdsl_provenance", default=None)
_default: "Table" = Table()      # where graphs built outside a network file are recorded


def table() -> "Table":
    """The table being recorded into: the current network's (`using`), else the shared default."""
    current = _table.get()
    return _default if current is None else current


def begin() -> "Table":
    """Start a fresh table for the rest of the current context (loading a network file runs in a context of its
    own); returns it."""
    origins = Table()
    _table.set(origins)
    return origins


@contextlib.contextmanager
def using(origins: "Table | None") -> Iterator["Table"]:
    """Record into (and read from) `origins` (a fresh table when None) inside the block."""
    origins = Table() if origins is None else origins
    token = _table.set(origins)
    try:
        yield origins
    finally:
        _table.reset(token)


def origin(node: "Node", origins: "Table | None" = None) -> Origin | None:
    return (table() if origins is None else origins).get(node)


def base_name(node: "Node", origins: "Table | None" = None) -> str | None:
    """A leaf's own name, else the recorded base name of the value (None when nothing was recorded)."""
    if node.is_leaf:
        return node.name
    found = origin(node, origins)
    return found.name if found is not None else None


def _made(roots: Iterable["Node"], stops: Iterable["Node"] = ()) -> list["Node"]:
    """The computed nodes under `roots` that the table does not hold yet, not descending past `stops`, leaves
    and recorded values: what one layer application, VJP rule or update made."""
    origins, result = table(), []
    seen = set(stops)
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen or node.is_leaf or node in origins:
            continue
        seen.add(node)
        result.append(node)
        stack.extend(node.inputs)
    return result


def _record(node: "Node", found: Origin) -> None:
    origins = table()
    if node not in origins:
        origins[node] = found


def inherit(new: "Node", old: "Node", same_name: bool = False) -> "Node":
    """`new` (a pass's rewrite of `old`) takes `old`'s origin unless it has one, and so do the nodes under it
    that the table does not hold (those the rewrite made), each named after its op unless it is the rewrite of a
    layer's output or of the same op, or `same_name` (the rewrite computes what `old`'s name says in one node, as a
    fused sum does); returns `new`."""
    found = table().get(old)
    if found is None or new is old:
        return new
    for node in _made([new]):
        keeps = node.op == old.op or (node is new and (found.name == found.layer or same_name))
        word = f"{found.layer}_{_op_word(node, found.kind)}"
        _record(node, found if keeps else found.named(f"d_{word}" if found.direction == BACKWARD else word))
    return new


def _suffix(op: str, kind: str) -> str:
    """The part of a node's name after its layer's: the op, without the layer kind it repeats
    (`max_pool_argmax` in a `max_pool` layer: `argmax`)."""
    word = op[len(kind):].lstrip("_") if kind and op.startswith(kind) else op
    return word or op


def _op_word(node: "Node", kind: str) -> str:
    """How a value is named within its layer: its op (`argmax`), an elementwise one by its outermost operation
    (`scale`, `rsqrt`)."""
    if node.op != "ew":
        return _suffix(node.op, kind)
    from deepdsl.ops.elementwise import operation_word
    return operation_word(node.attr("expr")) or "copy"


def _word(label: str) -> str:
    """A layer label as a name part: `max_pool(2)` -> `max_pool`."""
    return label.split("(", 1)[0].strip() or "layer"


def record_layer(output: "Node", inputs: Iterable["Node"], label: str, what: str, named: bool) -> None:
    """The nodes a layer application made (under `output`, down to its `inputs`): a named layer's keep its name,
    a parameter-free layer (`relu`) is named after the named layer its first input came from (`fc1_relu`)."""
    inputs = list(inputs)
    origins = table()
    if named:
        layer = anchor = label
    else:
        anchor = next((o.anchor for o in map(origins.get, inputs) if o is not None), "")
        layer = f"{anchor}_{_word(label)}" if anchor else _word(label)
    kind = _word(label)
    for node in _made([output], inputs):
        name = layer if node is output else f"{layer}_{_op_word(node, kind)}"
        _record(node, Origin(layer, what, FORWARD, name, anchor, kind))


def record_leaf(leaf: "Node", layer: str, what: str) -> None:
    """A parameter or running statistic made by layer `layer` (its updates are shown in that layer's section)."""
    _record(leaf, Origin(layer, what, FORWARD, leaf.name or layer, layer))


def record_backward(node: "Node", g: "Node", cotangents: Iterable[tuple["Node", "Node | None"]]) -> None:
    """The nodes the VJP rule of `node` made from its cotangent `g` (`cotangents` pairs each input with the
    cotangent the rule gave it): a cotangent is named after the value it is the gradient of (`d_cv1_W`), other
    nodes after the layer (`d_cv1_sum_to`), and a forward value the rule saves for the backward (a pooling's
    argmax: it does not read `g`) as the layer's (`cv1_max_pool_argmax`)."""
    found = table().get(node)
    if found is None:
        return
    pairs = [(x, c) for x, c in cotangents if c is not None]
    made = _made([c for _, c in pairs], [g, node, *node.inputs])
    fresh = set(made)
    for x, c in pairs:
        target = base_name(x)
        if target and c in fresh:
            _record(c, found.named(f"d_{target}", BACKWARD))
    forward = _independent(made, g)
    for n in made:
        word = f"{found.layer}_{_op_word(n, found.kind)}"
        _record(n, found.named(word, FORWARD) if n in forward else found.named(f"d_{word}", BACKWARD))


def _independent(made: list["Node"], cotangent: "Node") -> set["Node"]:
    """Those of `made` (the new nodes of one VJP rule) that do not read the `cotangent` it was given, even
    indirectly: values computed from forward values only."""
    dependent: set = set()
    for n in sorted(made, key=lambda m: m.serial):       # a node is made after its inputs
        if any(i is cotangent or i in dependent for i in n.inputs):
            dependent.add(n)
    return set(made) - dependent


def record_sum(total: "Node", of: "Node") -> None:
    """`total`, the sum of the gradient contributions to `of`, is its gradient (`d_<of>`)."""
    found = table().get(of)
    target = base_name(of)
    if found is not None and target:
        _record(total, found.named(f"d_{target}", BACKWARD))


def record_update(param: "Node", made: Iterable[tuple[str, "Node"]], gradient: "Node") -> None:
    """The nodes of `param`'s update from its `gradient`: each new value of a tensor `k` is named `k_new`, the
    rest after the parameter; all in the section of the parameter's layer."""
    layer = table().get(param) or Origin(param.name, "parameter", FORWARD, param.name, param.name)
    made = list(made)
    news = {node: k for k, node in made}
    for node in _made(list(news), [gradient]):
        _record(node, layer.named(f"{news[node]}_new" if node in news else f"{param.name}_{node.op}", UPDATE))


def record_value(param: "Node", node: "Node", name: str) -> None:
    """`node`, a value of `param`'s update named `name` (the mean of its accumulated gradient)."""
    layer = table().get(param) or Origin(param.name, "parameter", FORWARD, param.name, param.name)
    _record(node, layer.named(name, UPDATE))


def record_parts(whole: "Node", parts: dict[str, "Node"]) -> None:
    """Nodes a pass made to compute `whole` (its decomposition), named `<layer>_<word>` in `whole`'s layer."""
    found = table().get(whole)
    if found is None:
        return
    for word, part in parts.items():
        if not part.is_leaf:
            _record(part, found.named(f"{found.layer}_{word}"))


def record_rest(root: "Node", layer: str, what: str, name: str) -> None:
    """`root` and the computed nodes under it that have no origin yet (arithmetic written outside layers, such as
    a weighted sum of losses), as values of a layer `layer`: `root` named `name`, the others `<layer>_<op>`."""
    for node in _made([root]):
        _record(node, Origin(layer, what, FORWARD, name if node is root else f"{layer}_{_op_word(node, '')}",
                             layer))
