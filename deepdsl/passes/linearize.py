"""Linearize a graph into an SSA program.

Order: depth-first post-order from the outputs, visiting each node's inputs in order, so each statement comes
right after what it reads was computed (a valid schedule; `schedule` passes may reorder it later). Constants
become statements only when they are tensors (scalars stay inline in the expressions that read them).
Guarantees: every non-leaf node reachable from an output is defined exactly once, before its first use.
"""
from __future__ import annotations

from deepdsl import provenance
from deepdsl.ir import Graph, Node
from deepdsl.ssa import Let, Program


def linearize(graph: Graph) -> Program:
    from deepdsl.ir import toposort

    order = toposort(node for _, node in graph.outputs)
    inputs = [n for n in order if n.is_leaf and n.op != "const"]
    role = {"data": 0, "label": 1, "param": 2, "state": 3, "hyper": 4, "hoisted": 5}

    def key(n: Node):
        return (role.get(n.attr("role") if n.op == "input" else n.op, 6), n.name)

    body = [Let(n) for n in order if not n.is_leaf or (n.op == "const" and n.shape != ())]
    return Program(graph.name, tuple(sorted(inputs, key=key)), tuple(body), graph.outputs,
                   origins=provenance.table())
