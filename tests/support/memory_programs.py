"""Random programs for the memory-stage tests, and an interpreter that runs a program inside its memory plan.

`step_programs()` draws a random graph from `random_programs.graphs()` (sizes up to 24, so tensors span several
alignment units) and adds outputs the way a training step has them: new values of persistent inputs under the
input's name (`w`, `b`, `u`, `s`), computed from the old value and the graph's outputs, so the update can be
written in place; sometimes an output that also reads the old value and the new one (the update must then be a
copy added after it), or an unchanged input as its own new value.

`run_in_arena` executes a planned program the way generated code will: every arena value lives at its planned
offset in one byte array (poisoned with NaN bytes at the start and wherever a buffer is freed), persistent values
in their own arrays updated in place. If two tensors live at the same time overlapped, or a value were read after
it is freed or overwritten, the results would differ from the reference interpreter's. A statement whose output
takes over its dying input's bytes reads its inputs before writing (the reference semantics); that the runtime
kernels do the same on overlapping memory is tested in tests/test_runtime_cpu.py.
"""
from __future__ import annotations

import numpy as np
import sympy
from hypothesis import strategies as st

from deepdsl.interpret import run
from deepdsl.ir import Graph, numpy_dtype, toposort
from deepdsl.memory_plan import MemoryPlan
from deepdsl.ops import EvalContext, get_op
from deepdsl.ops.elementwise import elementwise, sum_to, sym
from deepdsl.ssa import Let, Program
from deepdsl.storage import is_batch_input

from tests.support.random_programs import graphs

PERSISTENT = ("w", "b", "u", "s")


@st.composite
def step_programs(draw) -> Graph:
    sizes = draw(st.tuples(st.integers(1, 24), st.integers(1, 24), st.integers(1, 6)))
    graph = draw(graphs(sizes=sizes, max_steps=12))
    outputs = list(graph.outputs)
    leaves = {}
    for node in toposort(n for _, n in outputs):
        if node.is_leaf and node.name in PERSISTENT:
            leaves[node.name] = node
    for name in PERSISTENT:
        leaf = leaves.get(name)
        if leaf is None or not draw(st.booleans()):
            continue
        kind = draw(st.sampled_from(["update", "update", "update", "read-after", "unchanged"]))
        if kind == "unchanged":
            outputs.append((name, leaf))
            continue
        _, source = outputs[draw(st.integers(0, len(graph.outputs) - 1))]
        try:
            delta = sum_to(source, leaf.shape)
        except Exception:                     # noqa: BLE001 -- shapes that do not sum: use the total
            delta = sum_to(source, ())
        new = elementwise(sympy.Rational(9, 10) * sym(0) - sym(1) / 4, [leaf, delta], shape=leaf.shape)
        outputs.append((name, new))
        if kind == "read-after":
            outputs.append((f"both_{name}", elementwise(sym(0) * sym(1), [leaf, new])))
    return Graph("step", tuple(outputs))


def run_in_arena(program: Program, plan: MemoryPlan, feeds: dict) -> dict:
    """Run `program` with every value stored where `plan` puts it (float32); see the module docstring."""
    ctx = EvalContext(np.float32)
    arena = np.full(plan.arena_bytes, 0xFF, dtype=np.uint8)      # 0xFFFFFFFF is a float32 NaN
    persistent = {}
    for leaf in program.inputs:
        value = np.array(feeds[leaf.name], dtype=numpy_dtype(leaf.dtype, np.float32)).reshape(leaf.shape)
        if is_batch_input(leaf):
            _at(arena, plan, leaf)[...] = value
        else:
            persistent[leaf.name] = value

    def at(node):
        p = plan.placement(node)
        if p.buffer is not None:
            return _at(arena, plan, node)
        if p.view_of is not None:           # a view of a persistent value (a reshape, a slice's block): its bytes
            return get_op(node.op).evaluate(ctx, at(p.view_of), **node.kwargs)
        return persistent[p.leaf.name].reshape(node.shape)

    def read(node):
        if node.op == "const" and node.shape == ():
            return get_op("const").evaluate(ctx, **node.kwargs)
        return at(node).copy()

    for step in plan.steps:
        instr = step.instr
        if isinstance(instr, Let):
            node = instr.node
            out = get_op(node.op).evaluate(ctx, *[read(i) for i in node.inputs], **node.kwargs)
            placement = plan.placement(node)
            if placement.view_of is None:
                at(node)[...] = out
            else:
                assert np.array_equal(at(node), out, equal_nan=True), "a view does not see its base's bytes"
        else:
            for index in step.releases:
                b = plan.buffers[index]
                # a buffer that took over this one's bytes keeps its part (it starts at the same offset)
                kept = max((min(t.size, b.size) for t in plan.buffers if t.takes_over == index), default=0)
                arena[b.offset + kept:b.offset + b.size] = 0xFF
    return {name: read(node) for name, node in program.outputs}


def _at(arena: np.ndarray, plan: MemoryPlan, node) -> np.ndarray:
    p = plan.placement(node)
    dtype = np.dtype(numpy_dtype(node.dtype, np.float32))
    nbytes = int(np.prod(node.shape, dtype=np.int64)) * dtype.itemsize
    return arena[p.offset:p.offset + nbytes].view(dtype).reshape(node.shape)


def reference(program: Program, feeds: dict, float_dtype=np.float32) -> dict:
    return run(program, {leaf.name: feeds[leaf.name] for leaf in program.inputs}, float_dtype=float_dtype)


def assert_same(ours: dict, theirs: dict, rtol: float = 0.0) -> None:
    assert list(ours) == list(theirs)
    for name in theirs:
        a, b = np.asarray(ours[name]), np.asarray(theirs[name])
        assert a.shape == b.shape, name
        if rtol:
            scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@st.composite
def small_networks(draw):
    """A random small convolutional network as a training Loop: a batch of images through 2 to 6 layers drawn from
    convolutions, batch normalization with ReLU (the pattern rematerialization recomputes), ReLU, max and average
    pooling (random windows, strides, padding and ceil mode: outputs that take over their input's storage), LRN
    (its backward runs in place) and residual blocks, then a classifier, softmax and log loss. Sizes are tiny, so the
    memory decisions come from the structure, not the scale."""
    from deepdsl import dsl as D
    from deepdsl.ops.conv import out_size

    n, channels, size = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(5, 12))
    x = D.images("x", (n, channels, size, size))
    y = D.labels("y", n, classes=3)
    layers = []
    for i in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["conv", "bn_relu", "relu", "max_pool", "avg_pool", "lrn", "residual"]))
        if kind == "conv":
            kernel = draw(st.sampled_from([1, 3]))
            channels = draw(st.integers(1, 4))
            layers.append(D.conv(f"c{i}", kernel, channels, padding=kernel // 2))
        elif kind == "bn_relu":
            channels = draw(st.integers(1, 4))
            layers.append(D.relu @ D.batch_norm(f"bn{i}") @ D.conv(f"c{i}", 3, channels, padding=1, bias=False))
        elif kind == "relu":
            layers.append(D.relu)
        elif kind in ("max_pool", "avg_pool"):
            kernel = draw(st.integers(1, min(3, size)))
            stride = draw(st.integers(1, kernel))
            pad = draw(st.integers(0, kernel // 2))
            ceil = draw(st.booleans())
            if out_size(size, kernel, stride, pad, ceil) < 1:
                continue
            layers.append((D.max_pool if kind == "max_pool" else D.avg_pool)(kernel, stride, pad, ceil))
            size = out_size(size, kernel, stride, pad, ceil)
        elif kind == "lrn":
            layers.append(D.lrn(size=draw(st.sampled_from([1, 3, 5]))))
        else:
            block = D.batch_norm(f"rb{i}") @ D.conv(f"r{i}", 3, channels, padding=1, bias=False)
            layers.append(D.relu @ D.fn(lambda p, block=block: D.add(block(p), p), f"res{i}"))
    net = D.full("fc", 3) @ D.flatten
    for layer in reversed(layers):
        net = net @ layer
    return D.Loop((D.log_loss(y) @ D.softmax @ net)(x), (D.precision(y) @ net)(x), D.Train("random"))
