"""Code motion: hoist what does not change between iterations out of the step; sink the rest to its first use.

`hoist_invariants` finds the largest subgraphs whose leaves are only constants and hyperparameters (fixed for a
run) and that draw no random numbers, computes them once in a setup graph, and feeds them to the step graphs as
`hoisted` inputs H1, H2, ... (named in order of first use). Scalars folded inline stay inline.
`sink` moves each statement of an SSA program to just before its first use, so values are created as late as
possible and live as briefly as possible; statements nobody reads (outputs) keep their relative order.
Guarantees: same values; every statement still follows its inputs.
"""
from __future__ import annotations

from typing import Sequence

from deepdsl.ir import FLOAT, Graph, Node, make, toposort
from deepdsl.ops import get_op
from deepdsl.program import Let, Program

_VARIANT_ROLES = {"data", "label", "rng"}


def _is_variant_leaf(node: Node) -> bool:
    if node.op in ("param", "state"):
        return True
    return node.op == "input" and node.attr("role") in _VARIANT_ROLES


def hoist_invariants(name: str, graphs: Sequence[Graph]) -> tuple[Graph, list[Graph]]:
    roots = [node for g in graphs for _, node in g.outputs]
    order = toposort(roots)
    invariant: dict[int, bool] = {}
    for node in order:
        if not node.inputs:
            invariant[id(node)] = not _is_variant_leaf(node) and not get_op(node.op).random
        else:
            invariant[id(node)] = not get_op(node.op).random and all(invariant[id(i)] for i in node.inputs)

    def worth_hoisting(node: Node) -> bool:
        # a computed tensor, or a filled constant tensor; scalars of constants and hyperparameters stay inline
        return invariant[id(node)] and node.shape != () and not (node.op == "input")

    hoisted: dict[int, Node] = {}
    setup_outputs: list[tuple[str, Node]] = []
    for node in order:
        if invariant[id(node)]:
            continue
        for i in node.inputs:
            if worth_hoisting(i) and id(i) not in hoisted:
                label = f"H{len(setup_outputs) + 1}"
                hoisted[id(i)] = make("input", (), name=label, shape=i.shape, dtype=i.dtype, role="hoisted")
                setup_outputs.append((label, i))

    def replace(node: Node) -> Node:
        return node

    result = []
    for g in graphs:
        memo: dict[int, Node] = {}
        for node in toposort(n for _, n in g.outputs):
            if id(node) in hoisted:
                memo[id(node)] = hoisted[id(node)]
            elif node.inputs:
                new_inputs = [memo[id(i)] for i in node.inputs]
                memo[id(node)] = node if all(a is b for a, b in zip(new_inputs, node.inputs)) else \
                    make(node.op, new_inputs, **node.kwargs)
            else:
                memo[id(node)] = node
        outputs = tuple((k, memo[id(v)] if not (worth_hoisting(v) and id(v) in hoisted) else v)
                        for k, v in g.outputs)
        result.append(Graph(g.name, outputs))
    return Graph(name, tuple(setup_outputs)), result


def sink(program: Program) -> Program:
    lets = [i for i in program.body if isinstance(i, Let)]
    if len(lets) != len(program.body):
        raise ValueError("sink runs before memory passes add free statements")
    users: dict[int, list[Node]] = {}
    for instr in lets:
        for i in instr.node.inputs:
            users.setdefault(id(i), []).append(instr.node)
    placed: list[Node] = []            # the final order, built from the end
    for instr in reversed(lets):
        node = instr.node
        readers = users.get(id(node))
        if not readers:
            placed.insert(0, node)
            continue
        first = min(placed.index(r) for r in readers)
        placed.insert(first, node)
    return Program(program.name, program.inputs, tuple(Let(n) for n in placed), program.outputs)
