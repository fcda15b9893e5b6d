"""Dependency graphs of SSA programs and their Graphviz DOT text (`deepdsl graph`)."""
from __future__ import annotations

from dataclasses import dataclass

from deepdsl.ops import dims
from deepdsl.ssa import Let, Program, format_expr


@dataclass(frozen=True, slots=True)
class GraphNode:
    name: str
    label: str
    kind: str            # the op of the value, "output" for a step output
    nbytes: int


@dataclass(frozen=True, slots=True)
class ProgramGraph:
    """Nodes in program order (inputs, statements, outputs); an edge (a, b) means b reads a."""

    nodes: tuple[GraphNode, ...]
    edges: tuple[tuple[str, str], ...]


def program_graph(program: Program) -> ProgramGraph:
    """Nodes are printed value names (inputs and statements) and `out:<key>` for the step's outputs."""
    names = program.names()
    nodes = [GraphNode(leaf.name, f"{leaf.name}\n{dims(leaf.shape)}", leaf.op, leaf.nbytes) for leaf in program.inputs]
    edges = []
    for instr in program.body:
        if not isinstance(instr, Let):
            continue
        node = instr.node
        name = names[id(node)]
        nodes.append(GraphNode(name, f"{name} = {format_expr(node, names)}\n{dims(node.shape)}", node.op, node.nbytes))
        edges += [(names[id(i)], name) for i in dict.fromkeys(node.inputs) if id(i) in names]
    for key, node in program.outputs:
        if id(node) in names:
            nodes.append(GraphNode(f"out:{key}", key, "output", 0))
            edges.append((names[id(node)], f"out:{key}"))
    return ProgramGraph(tuple(nodes), tuple(edges))


_SHAPES = {"param": "box", "state": "box", "input": "invhouse", "output": "house"}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_dot(graph: ProgramGraph, name: str = "program") -> str:
    """DOT text of a program graph."""
    lines = [f"digraph {_quote(name)} {{", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for node in graph.nodes:
        lines.append(f"  {_quote(node.name)} [label={_quote(node.label)}, shape={_SHAPES.get(node.kind, 'ellipse')}];")
    for a, b in graph.edges:
        lines.append(f"  {_quote(a)} -> {_quote(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
