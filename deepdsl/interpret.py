"""The reference interpreter: runs an SSA program (or a graph) on numpy arrays with each op's `evaluate`.

It is the oracle for pass tests (`run(p) == run(pass(p))`) and for gradients against PyTorch. Free statements are
honoured (a freed value is deleted, so a read after free fails loudly), and so are in-place statements: after
`Let(node, into=t)` the value `t` and every other value stored with it (its views) are deleted, so a wrong in-place
annotation fails loudly too. Statements computed together (`Let(node, computes_also=v)`) are evaluated one by one:
pairing them changes how the values are computed, not what they are.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from deepdsl.ir import Graph, numpy_dtype
from deepdsl.ops import EvalContext, get_op
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import analyze


def run(program: Program, feeds: Mapping[str, np.ndarray], float_dtype=np.float32, seed: int = 0,
        step: int = 0) -> dict[str, np.ndarray]:
    ctx = EvalContext(float_dtype, seed, step)
    env: dict[int, np.ndarray] = {}
    for leaf in program.inputs:
        if leaf.name not in feeds:
            raise KeyError(f"no value fed for input '{leaf.name}'")
        value = np.asarray(feeds[leaf.name], dtype=numpy_dtype(leaf.dtype, float_dtype))
        if value.shape != leaf.shape:
            raise ValueError(f"input '{leaf.name}' has shape {value.shape}, expected {leaf.shape}")
        env[id(leaf)] = value
    storage = analyze(program) if any(isinstance(i, Let) and i.into is not None for i in program.body) else None
    for index, instr in enumerate(program.body):
        if isinstance(instr, Let):
            node = instr.node
            args = [env[id(i)] if id(i) in env else _inline(i, ctx) for i in node.inputs]
            out = get_op(node.op).evaluate(ctx, *args, **node.kwargs)
            assert out.shape == node.shape, f"{node.op} evaluated to {out.shape}, inferred {node.shape}"
            if instr.into is not None:
                info = storage.of(instr.into)
                for member in info.members:
                    if info.defined_at[id(member)] < index:
                        env.pop(id(member), None)
            env[id(node)] = out
        elif isinstance(instr, Free):
            for node in instr.nodes:
                del env[id(node)]
    return {name: env[id(node)] if id(node) in env else _inline(node, ctx) for name, node in program.outputs}


def _inline(node, ctx):
    if node.op != "const":
        raise KeyError(f"value {node!r} read before it is defined (or after it is freed)")
    return get_op("const").evaluate(ctx, **node.kwargs)


def run_graph(graph: Graph, feeds: Mapping[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    from deepdsl.passes.linearize import linearize
    return run(linearize(graph), feeds, **kwargs)
