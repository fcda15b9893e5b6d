"""Dependency graphs of SSA programs as networkx DiGraphs, and their Graphviz DOT text."""
from __future__ import annotations

import networkx as nx

from deepdsl.ops import dims
from deepdsl.program import Let, Program, format_expr


def program_graph(program: Program) -> nx.DiGraph:
    """Nodes are printed value names (inputs and statements); an edge a -> b means b reads a."""
    names = program.names()
    graph = nx.DiGraph()
    for leaf in program.inputs:
        graph.add_node(leaf.name, label=f"{leaf.name}\n{dims(leaf.shape)}", kind=leaf.op, bytes=leaf.nbytes)
    for instr in program.body:
        if not isinstance(instr, Let):
            continue
        node = instr.node
        name = names[id(node)]
        graph.add_node(name, label=f"{name} = {format_expr(node, names)}\n{dims(node.shape)}", kind=node.op,
                       bytes=node.nbytes)
        for i in node.inputs:
            if id(i) in names:
                graph.add_edge(names[id(i)], name)
    for key, node in program.outputs:
        if id(node) in names:
            graph.add_node(f"out:{key}", label=key, kind="output", bytes=0)
            graph.add_edge(names[id(node)], f"out:{key}")
    return graph


_SHAPES = {"param": "box", "state": "box", "input": "invhouse", "output": "house"}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_dot(graph: nx.DiGraph, name: str = "program") -> str:
    """DOT text of a program graph (no pydot/pygraphviz needed)."""
    lines = [f"digraph {_quote(name)} {{", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for node, data in graph.nodes(data=True):
        shape = _SHAPES.get(data.get("kind"), "ellipse")
        lines.append(f"  {_quote(node)} [label={_quote(data.get('label', node))}, shape={shape}];")
    for a, b in graph.edges():
        lines.append(f"  {_quote(a)} -> {_quote(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
