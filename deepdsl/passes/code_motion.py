"""Code motion: hoist what does not change between iterations out of the step; sink the rest to its first use.

`hoist_invariants` finds the largest subgraphs whose leaves are only constants and hyperparameters (fixed for a
run) and that draw no random numbers, computes them once in a setup graph, and feeds them to the step graphs as
`hoisted` inputs H1, H2, ... (named in order of first use). Scalars stay inline: recomputing a scalar costs nothing
and keeps the expressions that read it readable.
`sink` moves each statement of an SSA program to just before its first use, so values are created as late as
possible and live as briefly as possible; statements nobody reads (outputs) keep their relative order.
Guarantees: same values; every statement still follows its inputs.
"""
from __future__ import annotations

from typing import Sequence

from deepdsl.ir import Graph, Node, make, toposort
from deepdsl.ops import get_op
from deepdsl.provenance import inherit
from deepdsl.ssa import Let, Program

_VARIANT_ROLES = {"data", "label", "rng"}


def _is_variant_leaf(node: Node) -> bool:
    if node.op in ("param", "state"):
        return True
    return node.op == "input" and node.attr("role") in _VARIANT_ROLES


def hoist_invariants(name: str, graphs: Sequence[Graph]) -> tuple[Graph, list[Graph]]:
    """Split `graphs` into a setup graph `name` computing their loop-invariant tensors once, and the graphs reading
    those tensors as `hoisted` inputs. Only the boundary of the invariant region is hoisted: tensors read by a
    varying computation, or graph outputs."""
    roots = [node for g in graphs for _, node in g.outputs]
    order = toposort(roots)
    invariant: dict[int, bool] = {}
    for node in order:
        if get_op(node.op).random:
            invariant[id(node)] = False
        elif not node.inputs:
            invariant[id(node)] = not _is_variant_leaf(node)
        else:
            invariant[id(node)] = all(invariant[id(i)] for i in node.inputs)

    def worth_hoisting(node: Node) -> bool:
        # a computed tensor or a filled constant tensor; not a leaf fed anyway, not a scalar
        return invariant[id(node)] and node.shape != () and node.op != "input"

    hoisted: dict[int, Node] = {}
    setup_outputs: list[tuple[str, Node]] = []

    def hoist(node: Node) -> None:
        if worth_hoisting(node) and id(node) not in hoisted:
            label = f"H{len(setup_outputs) + 1}"
            hoisted[id(node)] = make("input", (), name=label, shape=node.shape, dtype=node.dtype, role="hoisted")
            setup_outputs.append((label, node))

    for node in order:
        if not invariant[id(node)]:
            for i in node.inputs:
                hoist(i)
    for root in roots:
        hoist(root)

    memo: dict[int, Node] = {}
    for node in order:
        if id(node) in hoisted:
            memo[id(node)] = hoisted[id(node)]
        elif node.inputs:
            memo[id(node)] = inherit(make(node.op, [memo[id(i)] for i in node.inputs], **node.kwargs), node)
        else:
            memo[id(node)] = node
    result = [Graph(g.name, tuple((k, memo[id(v)]) for k, v in g.outputs)) for g in graphs]
    return Graph(name, tuple(setup_outputs)), result


def sink(program: Program) -> Program:
    """Each statement moved to just before the first statement that reads it, in O(n log n).

    Statements are placed from last to first: one nobody reads goes to the front of what is placed so far; any other
    goes immediately before its reader that is placed first. The placed order is therefore the post-order of a
    forest where a statement is the child of its first reader (roots: unread statements, in program order; a
    node's children in placement order). The first reader is found by comparing readers' positions in that
    post-order through their lowest common ancestor, found by binary lifting (O(log n) per comparison).
    """
    lets = [i for i in program.body if isinstance(i, Let)]
    if len(lets) != len(program.body):
        raise ValueError("sink runs before memory passes add free statements")
    n = len(lets)
    index = {id(instr.node): k for k, instr in enumerate(lets)}
    readers: list[list[int]] = [[] for _ in range(n)]
    for k, instr in enumerate(lets):
        for i in instr.node.inputs:
            j = index.get(id(i))
            if j is not None and (not readers[j] or readers[j][-1] != k):
                readers[j].append(k)

    # forest over statements 0..n-1 plus a virtual root n whose children are the unread statements
    top = n
    levels = max(1, (n + 1).bit_length())
    up = [[top] * (n + 1) for _ in range(levels)]     # up[k][v]: the 2^k-th ancestor of v (top stays top)
    depth = [0] * (n + 1)
    placed_at = [0] * (n + 1)                          # placement time: later placements are larger
    children: list[list[int]] = [[] for _ in range(n + 1)]

    def ancestor(v: int, steps: int) -> int:
        k = 0
        while steps:
            if steps & 1:
                v = up[k][v]
            steps >>= 1
            k += 1
        return v

    def before(u: int, v: int) -> bool:
        """Whether placed statement u precedes placed statement v in the current order."""
        if depth[u] > depth[v]:
            lifted = ancestor(u, depth[u] - depth[v])
            if lifted == v:
                return True               # u lies in v's subtree: placed before v
            u = lifted
        elif depth[v] > depth[u]:
            lifted = ancestor(v, depth[v] - depth[u])
            if lifted == u:
                return False
            v = lifted
        for k in range(levels - 1, -1, -1):
            if up[k][u] != up[k][v]:
                u, v = up[k][u], up[k][v]
        # u and v are now siblings: under a statement, the later placed comes later (nearer its parent);
        # among roots, the later placed comes first (it went to the front)
        if up[0][u] == top:
            return placed_at[u] > placed_at[v]
        return placed_at[u] < placed_at[v]

    for clock, k in enumerate(range(n - 1, -1, -1)):
        parent = top
        for r in readers[k]:
            if parent == top or before(r, parent):
                parent = r
        placed_at[k] = clock
        depth[k] = depth[parent] + 1 if parent != top else 1
        up[0][k] = parent
        for lvl in range(1, levels):
            up[lvl][k] = up[lvl - 1][up[lvl - 1][k]]
        children[parent].append(k)

    order: list[int] = []
    stack: list[tuple[int, bool]] = [(r, False) for r in children[top]]   # popped in reverse placement: program order
    while stack:
        v, expanded = stack.pop()
        if expanded:
            order.append(v)
        else:
            stack.append((v, True))
            stack.extend((c, False) for c in reversed(children[v]))
    return program.rewritten(tuple(lets[k] for k in order))
