"""The SSA verifier, run after every stage in tests.

Checks: inputs are leaves with distinct names; every value is defined once (single assignment) and before it is read
(define-before-use); every statement's shape and dtype agree with its op's shape rule applied to its inputs; a freed
value is not read or freed again and is no program output; outputs are defined. Errors quote the statements around
the offending one.
"""
from __future__ import annotations

from deepdsl.errors import VerifyError
from deepdsl.ir import Graph
from deepdsl.ops import get_op
from deepdsl.program import Free, Let, Program


def verify(program: Program) -> Program:
    names = program.names()
    lines = program.text(shapes=False).splitlines()[1:]

    def fail(index: int, message: str):
        lo, hi = max(0, index - 3), min(len(lines), index + 4)
        context = "\n".join(("> " if k == index else "  ") + lines[k] for k in range(lo, hi))
        raise VerifyError(f"{program.name}: {message}\n{context}")

    live: set[int] = set()
    seen_names: set[str] = set()
    for leaf in program.inputs:
        if not leaf.is_leaf:
            raise VerifyError(f"{program.name}: input {leaf!r} is not a leaf")
        if leaf.name in seen_names:
            raise VerifyError(f"{program.name}: two inputs named '{leaf.name}'")
        seen_names.add(leaf.name)
        live.add(id(leaf))
    defined: set[int] = set(live)
    freed: set[int] = set()
    for index, instr in enumerate(program.body):
        if isinstance(instr, Let):
            node = instr.node
            for i in node.inputs:
                if i.op == "const" and i.shape == ():
                    continue
                if id(i) in freed:
                    fail(index, f"{names.get(id(i), i)} read after it was freed")
                if id(i) not in live:
                    fail(index, f"{names.get(id(i), repr(i))} read before it is defined")
            if id(node) in defined:
                fail(index, f"{names[id(node)]} assigned twice")
            try:
                shape, dtype = get_op(node.op).infer(*node.inputs, **node.kwargs)
            except Exception as err:      # noqa: BLE001 -- report any shape-rule failure as a verify error
                fail(index, f"shape rule of {node.op} fails: {err}")
            if tuple(shape) != node.shape or dtype != node.dtype:
                fail(index, f"{names[id(node)]} is {node.shape} {node.dtype}, its op infers {shape} {dtype}")
            defined.add(id(node))
            live.add(id(node))
        elif isinstance(instr, Free):
            for node in instr.nodes:
                if id(node) not in live:
                    fail(index, f"free of {names.get(id(node), node)} which is not live")
                live.discard(id(node))
                freed.add(id(node))
        else:
            fail(index, f"unknown instruction {instr!r}")
    for name, node in program.outputs:
        if node.op == "const" and node.shape == ():
            continue
        if id(node) not in live:
            raise VerifyError(f"{program.name}: output '{name}' is not defined or was freed")
    return program


def verify_graph(graph: Graph) -> Graph:
    """Graph-level check: every node's shape agrees with its op's rule (a graph is acyclic by construction)."""
    for node in graph.nodes():
        if node.inputs or node.op == "bernoulli":
            shape, dtype = get_op(node.op).infer(*node.inputs, **node.kwargs)
            if tuple(shape) != node.shape or dtype != node.dtype:
                raise VerifyError(f"{graph.name}: {node!r} has shape {node.shape}, its op infers {shape}")
    names = [k for k, _ in graph.outputs]
    if len(set(names)) != len(names):
        raise VerifyError(f"{graph.name}: duplicate output names")
    return graph
