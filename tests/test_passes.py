"""Targeted tests of the optimization passes: each simplification rule, fusion, CSE, hoisting, sinking and
linearization on small graphs built by hand (structure checked, values checked against the reference interpreter),
and LeNet end to end: with every pass on, the interpreted loss and updated parameters equal those with every
optimization off."""
from __future__ import annotations

import pathlib
import time

import numpy as np
import pytest
import sympy

import deepdsl
from deepdsl.dsl import Overrides
from deepdsl.interpret import run
from deepdsl.ir import FLOAT, INT32, Graph, Node, make, toposort
from deepdsl.ops.elementwise import Y, broadcast_to, elementwise, reshape, sum_to, sym
from deepdsl.ops.leaf import const
from deepdsl.ops.linalg import matmul
from deepdsl.ops.loss import log_loss
from deepdsl.ops.shape import concat, slice_axis, transpose
from deepdsl.passes import fuse_elementwise as fusion
from deepdsl.passes.code_motion import hoist_invariants, sink
from deepdsl.passes.cse import cse
from deepdsl.passes.fuse_elementwise import fuse_elementwise
from deepdsl.passes.fuse_epilogue import fuse_epilogue
from deepdsl.passes.fuse_reductions import fuse_reductions
from deepdsl.passes.linearize import linearize
from deepdsl.passes.simplify import simplify
from deepdsl.ssa import Let, Program
from deepdsl.verify import verify

LENET = str(pathlib.Path(__file__).resolve().parents[1] / "networks" / "lenet.py")
v0, v1, v2 = sym(0), sym(1), sym(2)


def data(name, shape) -> Node:
    return make("input", (), name=name, shape=tuple(shape), dtype=FLOAT, role="data")


def param(name, shape) -> Node:
    return make("param", (), name=name, shape=tuple(shape), dtype=FLOAT)


def hyper(name) -> Node:
    return make("input", (), name=name, shape=(), dtype=FLOAT, role="hyper")


def labels(n, classes) -> Node:
    return make("input", (), name="y", shape=(n,), dtype=INT32, role="label", classes=classes)


def graph(*outputs: Node) -> Graph:
    return Graph("g", tuple((f"out{k}", node) for k, node in enumerate(outputs)))


def values_for(program: Program, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {leaf.name: rng.integers(0, leaf.attr("classes"), leaf.shape) if leaf.dtype == INT32
            else rng.uniform(-1, 1, leaf.shape) for leaf in program.inputs}


def evaluate(g: Graph, feeds: dict | None = None) -> dict:
    program = verify(linearize(g))
    feeds = feeds if feeds is not None else values_for(program)
    return run(program, {leaf.name: feeds[leaf.name] for leaf in program.inputs}, float_dtype=np.float64)


def assert_same_values(before: Graph, after: Graph, rtol: float = 1e-12):
    feeds = values_for(linearize(before))
    expected, got = evaluate(before, feeds), evaluate(after, feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=rtol, atol=rtol, err_msg=name)


def simplified(node: Node) -> Node:
    """The single output of `node`'s graph after simplify; the values must not change."""
    before = graph(node)
    after = simplify(before)
    assert_same_values(before, after)
    return after.outputs[0][1]


def ops(node: Node) -> list[str]:
    return [n.op for n in toposort([node]) if n.inputs or n.op == "const"]


# ----------------------------------------------------------------------------------------------------------------
# simplify, rule by rule

def test_fold_all_constant_nodes_with_uniform_results():
    assert simplified(make("ew", (const(2.0), const(3.0)), expr=v0 * v1)) is const(6.0)
    assert simplified(make("softmax", (const(4.0, (2, 5)),))) is const(0.2, (2, 5))
    assert simplified(matmul(const(2.0, (2, 3)), const(0.5, (3, 4)))) is const(3.0, (2, 4))
    # a non-uniform result is kept
    mixed = concat([const(1.0, (2, 1)), const(2.0, (2, 1))], axis=1)
    assert simplified(mixed) is mixed


def test_broadcast_rules():
    x = data("x", (3,))
    assert simplified(broadcast_to(const(1.5), (2, 3))) is const(1.5, (2, 3))
    twice = make("broadcast_to", (broadcast_to(x, (2, 3)),), shape=(4, 2, 3))
    assert simplified(twice) is broadcast_to(x, (4, 2, 3))
    assert simplified(make("broadcast_to", (x,), shape=(3,))) is x


def test_reshape_rules():
    x = data("x", (2, 6))
    assert simplified(make("reshape", (reshape(x, (3, 4)),), shape=(4, 3))) is reshape(x, (4, 3))
    assert simplified(make("reshape", (reshape(x, (12,)),), shape=(2, 6))) is x
    assert simplified(reshape(const(2.0, (2, 6)), (12,))) is const(2.0, (12,))


def test_sum_to_rules():
    s, x = hyper("s"), data("x", (4, 3))
    assert simplified(make("sum_to", (x,), shape=(4, 3))) is x
    assert simplified(sum_to(const(0.5, (4, 3)), (1, 3))) is const(2.0, (1, 3))
    # the sum of a broadcast scalar is the scalar times the count
    total = simplified(sum_to(broadcast_to(s, (4, 3)), ()))
    assert total.op == "ew" and total.inputs == (s,) and total.attr("expr") == 12 * v0
    # a broadcast row summed over the batch: count times the row
    row = data("r", (1, 3))
    summed = simplified(sum_to(broadcast_to(row, (4, 3)), (1, 3)))
    assert summed.op == "ew" and summed.inputs == (row,) and summed.attr("expr") == 4 * v0


def test_sum_of_unpick_reads_the_picked_values():
    g, y = data("g", (5,)), labels(5, 3)
    rows = simplified(sum_to(make("unpick", (g, y), classes=3), (5, 1)))
    assert rows is reshape(g, (5, 1))
    assert simplified(sum_to(make("unpick", (g, y), classes=3), ())) is sum_to(g, ())


def test_elementwise_reads_broadcast_operands_directly():
    x, b = data("x", (3, 4)), param("b", (4,))
    node = simplified(elementwise(v0 * v1, [x, broadcast_to(b, (3, 4))]))
    assert node.op == "ew" and set(node.inputs) == {x, b}
    # a filled constant becomes a number in the expression
    node = simplified(make("ew", (x, const(2.0, (3, 4))), expr=v0 + v1))
    assert node.inputs == (x,) and node.attr("expr") == v0 + 2
    # but not when the broadcast is what gives the result its shape
    alone = elementwise(sympy.tanh(v0), [broadcast_to(b, (3, 4))])
    assert simplified(alone) is alone


def test_log_of_softmax_becomes_log_softmax():
    z, y = data("z", (4, 6)), labels(4, 6)
    loss = log_loss(make("softmax", (z,)), y)
    new = simplified(loss)
    assert "softmax" not in ops(new) and "log_softmax" in ops(new)
    assert not any(n.op == "ew" and n.attr("expr").has(sympy.log) for n in toposort([new]))
    full = simplified(elementwise(sympy.log(v0) * 2, [make("softmax", (z,))]))
    assert "softmax" not in ops(full) and "log_softmax" in ops(full)


def test_log_softmax_rule_is_stable_where_log_of_softmax_is_not():
    z, y = data("z", (1, 2)), labels(1, 2)
    before = graph(log_loss(make("softmax", (z,)), y))
    after = simplify(before)
    feeds = {"z": np.array([[0.0, 800.0]]), "y": np.array([0])}
    with np.errstate(divide="ignore"):
        assert np.isinf(evaluate(before, feeds)["out0"])
    assert evaluate(after, feeds)["out0"] == pytest.approx(800.0)


def test_linear_ops_of_zero_are_zero():
    x, y = data("x", (3, 4)), labels(3, 4)
    assert simplified(matmul(const(0.0, (3, 2)), x, ta=True)) is const(0.0, (2, 4))
    assert simplified(make("unpick", (const(0.0, (3,)), y), classes=4)) is const(0.0, (3, 4))
    assert simplified(make("pick", (const(0.0, (3, 4)), y))) is const(0.0, (3,))


def test_slice_of_concat_selects_the_piece():
    a, b = data("a", (2, 3)), data("b", (2, 5))
    c = concat([a, b], axis=1)
    assert simplified(slice_axis(c, 1, 3, 8)) is b
    assert simplified(slice_axis(c, 1, 4, 6)) is slice_axis(b, 1, 1, 3)
    straddling = slice_axis(c, 1, 2, 5)
    assert simplified(straddling) is straddling


def test_a_transpose_of_a_transpose_of_the_same_axes_is_its_input():
    x = data("x", (2, 3, 4, 5))
    assert simplified(transpose(transpose(x, 1, 2), 1, 2)) is x
    other = transpose(transpose(x, 1, 2), 2, 3)
    assert simplified(other) is other


def test_forward_graph_is_simplified_before_differentiation():
    compiled = deepdsl.compile(deepdsl.load(LENET, Overrides(batch=4)))
    statements = compiled.train.statements() + compiled.setup.statements()
    assert "log_softmax" in {n.op for n in statements}
    assert "softmax" not in {n.op for n in statements}
    # no gradient divides by a probability any more
    assert not any(n.op == "ew" and any(p.op == "pick" for p in n.inputs) for n in statements)


# ----------------------------------------------------------------------------------------------------------------
# fusion

def count_ew(g: Graph) -> int:
    return sum(1 for n in g.nodes() if n.op == "ew")


def test_fusion_of_a_chain_into_one_expression():
    x, b = data("x", (3, 4)), param("b", (4,))
    t = elementwise(sympy.tanh(v0), [x])
    u = elementwise(2 * v0 + v1, [t, b])
    r = elementwise(sympy.Max(v0, 0), [u], out_grad=sympy.Heaviside(Y, 0))
    before = graph(elementwise(v0 * v1, [r, x]))
    after = fuse_elementwise(before)
    assert count_ew(before) == 4 and count_ew(after) == 1
    (node,) = [n for n in after.nodes() if n.op == "ew"]
    assert set(node.inputs) == {x, b} and node.attr("out_grad") is None
    assert_same_values(before, after)


def test_fusion_keeps_values_read_twice_outputs_and_smaller_producers():
    x, b = data("x", (3, 4)), param("b", (4,))
    shared = elementwise(sympy.exp(v0), [x])
    row = elementwise(sympy.sin(v0), [b])                      # (4,) broadcast into (3, 4): not fused
    out = elementwise(v0 * v1 + v2, [shared, x, row])
    before = Graph("g", (("a", out), ("b", elementwise(v0 + 1, [shared])), ("c", elementwise(v0 * 3, [x])),
                         ("d", elementwise(v0 - v1, [elementwise(v0 * 3, [x]), x]))))
    after = fuse_elementwise(before)
    nodes = after.nodes()
    assert shared in nodes and row in nodes
    assert dict(after.outputs)["c"] is dict(before.outputs)["c"]           # an output is not fused away
    assert_same_values(before, after)


def test_fusion_of_scalar_producers():
    x, lr, mu = data("x", (5,)), hyper("lr"), hyper("mu")
    scale = elementwise(v0 * v1, [lr, mu])                      # a scalar read once: fused
    before = graph(elementwise(v0 * v1, [x, scale]))
    after = fuse_elementwise(before)
    assert count_ew(after) == 1
    assert_same_values(before, after)


def test_fusion_respects_the_size_limits():
    leaves = [data(f"x{k}", (2, 2)) for k in range(12)]
    node = leaves[0]
    for leaf in leaves[1:]:
        node = elementwise(v0 * v1 + sympy.sin(v1), [node, leaf])
    before = graph(node)
    after = fuse_elementwise(before)
    assert all(len(n.inputs) <= fusion.MAX_INPUTS for n in after.nodes() if n.op == "ew")
    assert 1 < count_ew(after) < count_ew(before)
    assert_same_values(before, after)


def test_fusion_keeps_out_grad_on_unfused_activations():
    x = data("x", (3,))
    relu = elementwise(sympy.Max(v0, 0), [x], out_grad=sympy.Heaviside(Y, 0))
    g = graph(relu, elementwise(v0 * 2, [relu]))
    assert dict(fuse_elementwise(g).outputs)["out0"].attr("out_grad") == sympy.Heaviside(Y, 0)


# ----------------------------------------------------------------------------------------------------------------
# CSE

def test_cse_merges_commuted_and_renumbered_expressions():
    a, b = data("a", (3,)), data("b", (3,))
    ab = make("ew", (a, b), expr=v0 * v1)
    ba = make("ew", (b, a), expr=v0 * v1)
    d1 = make("ew", (a, b), expr=v0 - v1)
    d2 = make("ew", (b, a), expr=v1 - v0)
    assert ab is not ba and d1 is not d2
    after = cse(graph(ab, ba, d1, d2))
    outs = [node for _, node in after.outputs]
    assert outs[0] is outs[1] and outs[2] is outs[3] and outs[0] is not outs[2]
    assert_same_values(graph(ab, ba, d1, d2), after)


def test_cse_canonicalizes_repeated_inputs_and_constants():
    a = data("a", (3,))
    node = make("ew", (a, a, const(2.0)), expr=v0 * v1 + v2)
    after = cse(graph(node))
    new = after.outputs[0][1]
    assert new.inputs == (a,) and new.attr("expr") == v0 ** 2 + 2
    assert_same_values(graph(node), after)


def test_sums_differing_in_per_channel_factors_become_one_sum():
    """Batch norm's backward: the gradient times the centred input summed per channel, once times the scale and once
    times the inverse deviation (and a number). The factors constant along the summed axes go after the sum, so
    after cse one ew_sum reads the two activations; a sum with no such factor but a number keeps it inside."""
    d, c = data("d", (2, 3, 4, 5)), data("c", (2, 3, 4, 5))
    w, k = param("w", (1, 3, 1, 1)), data("k", (1, 3, 1, 1))
    by_w = sum_to(make("ew", (d, c, w), expr=v0 * v1 * v2), (1, 3, 1, 1))
    by_k = sum_to(make("ew", (d, c, k), expr=2 * v0 * v1 * v2), (1, 3, 1, 1))
    negated = sum_to(make("ew", (d,), expr=-v0), (1, 3, 1, 1))
    before = graph(by_w, by_k, negated)
    after = cse(fuse_reductions(before))
    sums = [n for n in toposort([node for _, node in after.outputs]) if n.op == "ew_sum"]
    assert len(sums) == 2
    (shared,) = [n for n in sums if len(n.inputs) == 2]
    assert set(shared.inputs) == {d, c} and shared.attr("expr") == v0 * v1
    (alone,) = [n for n in sums if len(n.inputs) == 1]
    assert alone.attr("expr") == -v0
    assert_same_values(before, after)


def test_a_size_1_factor_of_more_axes_than_the_sum_stays_inside_it():
    """sum_to (2,) of x (1, 2) * (1 - tanh(b + s)^2), b (2,), s (1, 1): the factor is constant along the summed
    axis, but s (1, 1) does not broadcast to (2,), so the factor is summed with x instead of multiplied after."""
    x, b, s = data("x", (1, 2)), param("b", (2,)), make("state", (), name="s", shape=(1, 1), dtype=FLOAT)
    before = graph(sum_to(make("ew", (x, b, s), expr=v0 * (1 - sympy.tanh(v1 + v2) ** 2)), (2,)))
    after = fuse_reductions(before)
    (summed,) = [n for n in toposort([node for _, node in after.outputs]) if n.op == "ew_sum"]
    assert set(summed.inputs) == {x, b, s} and after.outputs[0][1].shape == (2,)
    assert_same_values(before, after)


def test_a_bias_added_to_a_product_becomes_the_products_third_input():
    """product + bias (n,), either way round, becomes matmul(a, b, bias) with the product's own attributes, the
    values unchanged; not a product read elsewhere, a batched one, a bias of another shape, nor another sum."""
    x, w, b = data("x", (5, 3)), param("W", (4, 3)), param("B", (4,))
    product = matmul(x, w, tb=True)
    for expr, inputs in ((v0 + v1, [product, b]), (v1 + v0, [b, product])):
        before = graph(elementwise(expr, inputs))
        (fused,) = [node for _, node in fuse_epilogue(before).outputs]
        assert fused.op == "matmul" and fused.inputs == (x, w, b) and fused.attr("tb") is True
        assert_same_values(before, fuse_epilogue(before))
    row = param("R", (1, 4))
    stacked = matmul(data("s", (2, 5, 3)), param("V", (2, 3, 4)))
    for before in (graph(elementwise(v0 + v1, [product, b]), product),          # the product read again
                   graph(elementwise(v0 + v1, [product, row])),                 # a bias (1, n)
                   graph(elementwise(v0 - v1, [product, b])),
                   graph(elementwise(v0 + v1, [stacked, b])),                   # a stack of products
                   graph(elementwise(v0 + 2 * v1, [product, b]))):
        after = fuse_epilogue(before)
        assert after.outputs[0][1].op == "ew", before
        assert_same_values(before, after)


def test_a_fully_connected_layers_bias_goes_into_its_product_in_the_pipeline():
    """LeNet's last layer (no activation after it) computes its product and bias in one statement; fc1's bias stays
    in its ReLU's expression."""
    compiled = deepdsl.compile(deepdsl.load(LENET, Overrides(batch=8)))
    text = compiled.train.text()
    assert "matmul[tb](fc1_relu, fc2_W, fc2_B)" in text, text
    assert "Max(0, fc1_matmul + fc1_B)" in text


# ----------------------------------------------------------------------------------------------------------------
# code motion

def test_hoist_invariants_moves_constant_work_to_setup():
    x, lr = data("x", (2, 3)), hyper("lr")
    invariant = elementwise(sympy.exp(v0) + v1, [const(2.0, (2, 3)), lr])    # depends on constants and lr only
    mask = make("bernoulli", (), shape=(2, 3), keep=0.5, key=1)
    step = graph(elementwise(v0 * v1 * v2, [x, invariant, mask]), elementwise(v0 * 3, [lr]))
    setup, (new,) = hoist_invariants("setup", [step])
    assert [name for name, _ in setup.outputs] == ["H1"] and setup.outputs[0][1] is invariant
    leaves = {n.name: n for n in new.leaves()}
    assert leaves["H1"].attr("role") == "hoisted"
    assert any(n.op == "bernoulli" for n in new.nodes())              # random draws stay in the step
    feeds = {"x": np.arange(6.0).reshape(2, 3), "lr": 0.5}
    hoisted = evaluate(setup, feeds)
    np.testing.assert_allclose(evaluate(new, {**feeds, **hoisted})["out0"], evaluate(step, feeds)["out0"])


def test_hoist_invariants_hoists_invariant_outputs():
    lr = hyper("lr")
    table = elementwise(v0 * v1, [const(1.0, (4,)), lr])
    setup, (new,) = hoist_invariants("setup", [graph(table)])
    assert setup.outputs[0][1].shape == (4,) and new.outputs[0][1].attr("role") == "hoisted"


def test_sink_moves_statements_to_their_first_use():
    x = data("x", (3,))
    t = elementwise(sympy.tanh(v0), [x])
    a = elementwise(sympy.exp(v0), [x])
    b = elementwise(v0 * 2, [a])
    c = elementwise(v0 + v1, [t, b])
    program = Program("p", (x,), (Let(t), Let(a), Let(b), Let(c)), (("c", c),))
    assert [i.node for i in sink(program).body] == [a, b, t, c]
    # statements nobody reads keep their order; their inputs come right before them
    d = elementwise(v0 * 5, [t])
    program = Program("p", (x,), (Let(t), Let(a), Let(d), Let(b)), (("d", d), ("b", b)))
    assert [i.node for i in sink(program).body] == [t, d, a, b]


def test_sink_is_fast_on_long_programs():
    x = data("x", (2,))
    nodes, node = [], x
    for _ in range(20000):                 # a long chain with a value read at both ends
        node = make("ew", (node,), expr=v0 + 1)
        nodes.append(node)
    last = elementwise(v0 * v1, [nodes[0], nodes[-1]])
    program = Program("p", (x,), tuple(Let(n) for n in nodes + [last]), (("out", last),))
    start = time.perf_counter()
    sunk = sink(program)
    assert time.perf_counter() - start < 2.0       # ~0.1 s; the quadratic definition takes minutes
    position = {id(i.node): k for k, i in enumerate(sunk.body)}
    assert len(position) == len(program.body)
    assert all(position.get(id(i), -1) < position[id(n.node)] for n in sunk.body for i in n.node.inputs)


# ----------------------------------------------------------------------------------------------------------------
# linearize

def test_linearize_orders_inputs_and_defines_each_value_once():
    x, y = data("x", (4, 3)), labels(4, 3)
    w, lr = param("w", (3, 3)), hyper("lr")
    z = matmul(x, w)
    loss = log_loss(make("softmax", (z,)), y)
    g = Graph("g", (("loss", loss), ("w", elementwise(v0 - v1 * v2, [w, lr, sum_to(z, (1, 3))]))))
    program = verify(linearize(g))
    assert [n.name for n in program.inputs] == ["x", "y", "w", "lr"]
    statements = program.statements()
    assert len(statements) == len({id(n) for n in statements})
    assert not any(n.op == "const" and n.shape == () for n in statements)     # scalars stay inline


# ----------------------------------------------------------------------------------------------------------------
# LeNet end to end

def run_compiled(compiled, feeds: dict) -> tuple[dict, dict]:
    def inputs_of(program):
        return {leaf.name: feeds[leaf.name] for leaf in program.inputs}
    hoisted = run(compiled.setup, inputs_of(compiled.setup), float_dtype=np.float64) if compiled.setup.body else {}
    feeds = {**feeds, **hoisted}
    train = run(compiled.train, inputs_of(compiled.train), float_dtype=np.float64)
    test = run(compiled.test, inputs_of(compiled.test), float_dtype=np.float64)
    return train, test


def lenet_feeds(compiled, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"lr": 0.05, "momentum": 0.9, "decay": 0.0005}
    for program in (compiled.train, compiled.test):
        for leaf in program.inputs:
            if leaf.name in feeds or leaf.attr("role") == "hoisted":
                continue
            if leaf.dtype == INT32:
                feeds[leaf.name] = rng.integers(0, 10, leaf.shape)
            else:
                feeds[leaf.name] = rng.normal(0, 0.1, leaf.shape)
    return feeds


def adam_feeds(compiled) -> dict:
    """`lenet_feeds` for a network trained by Adam: every hyperparameter 0.5, the second moments positive."""
    feeds = lenet_feeds(compiled)
    for program in (compiled.train, compiled.test):
        for leaf in program.inputs:
            if leaf.attr("role") == "hyper":
                feeds[leaf.name] = 0.5
            elif leaf.name.startswith("S_"):            # Adam's second moments
                feeds[leaf.name] = np.abs(feeds[leaf.name])
    return feeds


def test_lenet_optimized_equals_unoptimized():
    loop = deepdsl.load(LENET, Overrides(batch=4))
    off = deepdsl.compile(loop, deepdsl.CompileOptions(simplify=False, fuse=False, cse=False, code_motion=False,
                                                       verify=True))
    on = deepdsl.compile(deepdsl.load(LENET, Overrides(batch=4)), deepdsl.CompileOptions(verify=True))
    feeds = lenet_feeds(off)
    train_off, test_off = run_compiled(off, feeds)
    train_on, test_on = run_compiled(on, feeds)
    assert list(train_on) == list(train_off) and list(test_on) == list(test_off)
    for name in train_off:
        np.testing.assert_allclose(train_on[name], train_off[name], rtol=1e-10, atol=1e-12, err_msg=name)
        if name != "loss":      # the step changed the parameters (the comparison is not vacuous)
            assert not np.array_equal(train_off[name], feeds[name])
    for name in test_off:
        np.testing.assert_allclose(test_on[name], test_off[name], rtol=1e-10, atol=1e-12, err_msg=name)
    assert len(on.train.statements()) < len(off.train.statements())


VIT = str(pathlib.Path(__file__).resolve().parents[1] / "networks" / "vit.py")


def test_attention_reads_and_writes_its_heads_in_place():
    """The ViT's attention and its gradient take the projections' outputs reshaped to (N, T, H, d) (`heads`) and
    their results go to the output projection and the projections' gradients as they are: no transpose is left
    next to an attention node. The training and test steps compute what they compute without the folding (fusion
    switched off), the parameters' new values included."""
    on = deepdsl.compile(deepdsl.load(VIT, Overrides(batch=2)), deepdsl.CompileOptions(verify=True))
    statements = on.train.statements()
    attention = [n for n in statements if n.op in ("attention", "attention_grad")]
    assert len(attention) == 8 and all(n.attr("heads") for n in attention)
    for n in statements:
        if n.op == "transpose":
            assert not any(i.op in ("attention", "attention_grad") for i in n.inputs)
    readers = {id(i) for n in attention for i in n.inputs}
    assert not any(n.op == "transpose" and id(n) in readers for n in statements)
    off = deepdsl.compile(deepdsl.load(VIT, Overrides(batch=2)), deepdsl.CompileOptions(fuse=False, verify=True))
    assert not any(n.attr("heads") for n in off.train.statements() if n.op == "attention")
    feeds = adam_feeds(off)
    (train_on, test_on), (train_off, test_off) = run_compiled(on, feeds), run_compiled(off, feeds)
    for name in train_off:
        np.testing.assert_allclose(train_on[name], train_off[name], rtol=1e-10, atol=1e-12, err_msg=name)
    for name in test_off:
        np.testing.assert_allclose(test_on[name], test_off[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_attention_of_units_the_kernels_do_not_weigh_whole_keeps_its_transposes():
    """Heads of more than `contract.ATTENTION_UNIT` tokens: the row passes would copy the heads' layout, so the
    transposes stay."""
    from deepdsl.passes.fold_transposes import fold_transposes

    def heads(name, tokens):
        return transpose(reshape(data(name, (2 * tokens, 8)), (2, tokens, 2, 4)), 1, 2)

    for tokens, folded in ((8, True), (80, False)):
        q, k, v = heads("q", tokens), heads("k", tokens), heads("v", tokens)
        node = transpose(make("attention", (q, k, v), scale=0.5), 1, 2)
        before = graph(node)
        after = simplify(fold_transposes(before))
        assert_same_values(before, after)
        kinds = {n.op: n for n in after.nodes()}
        assert ("transpose" not in kinds) == folded and kinds["attention"].attr("heads", False) == folded


def test_lenet_compiles_fast():
    deepdsl.compile(deepdsl.load(LENET))           # warm sympy's caches and the imports
    start = time.perf_counter()
    deepdsl.compile(deepdsl.load(LENET))
    assert time.perf_counter() - start < 1.0     # measured ~0.02 s; generous for a loaded machine


# --- horizontal fusion of the small updates ----------------------------------------------------------------------


def test_small_updates_move_to_the_end_in_batches_where_the_peak_allows():
    """Three small parameters, each updated in place right after its gradient; the first gradient comes before a
    large temporary (the step's peak), the two others after it. Moving the first update to the end would keep its
    gradient alive over the peak: it stays. The two others move to the end as one batch (`Let(batch=...)`) of their
    one kernel; the planned peak does not rise and the values are the same."""
    from deepdsl.memory_plan import planned_live_bytes
    from deepdsl.passes.dealloc import insert_frees
    from deepdsl.passes.fuse_horizontal import fuse_horizontal

    x, y = data("x", (64,)), data("y", (4096,))
    w = [param(f"w{k}", (64,)) for k in range(3)]
    g = [elementwise(sym(0) * (k + 2), [x]) for k in range(3)]
    new = [elementwise(sym(0) - sympy.Float(0.1) * sym(1), [w[k], g[k]]) for k in range(3)]
    big = elementwise(sym(0) * 3, [y])
    out = elementwise(sym(0) + 1, [big])
    body = (Let(g[0]), Let(new[0], into=w[0]), Let(big), Let(out), Let(g[1]), Let(new[1], into=w[1]), Let(g[2]),
            Let(new[2], into=w[2]))
    program = verify(Program("step", (x, y, *w), body, (("h", out), *((f"w{k}", new[k]) for k in range(3)))))
    fused = verify(fuse_horizontal(program))
    assert [i.node for i in fused.body] == [g[0], new[0], big, out, g[1], g[2], new[1], new[2]]
    assert fused.body[-1].batch == (new[1],) and not any(i.batch for i in fused.body[:-1])
    assert fuse_horizontal(fused) is fused
    from dataclasses import replace

    from deepdsl.errors import VerifyError
    for wrong in ((new[0],), (g[2],)):       # values the statements before it do not define
        with pytest.raises(VerifyError):
            verify(fused.rewritten(fused.body[:-1] + (replace(fused.body[-1], batch=wrong),)))
    peaks = [max(planned_live_bytes(insert_frees(p))) for p in (program, fused)]
    assert peaks[1] <= peaks[0]
    feeds = values_for(program)
    want, got = run(program, feeds, float_dtype=np.float64), run(verify(insert_frees(fused)), feeds,
                                                                 float_dtype=np.float64)
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_the_vits_updates_run_in_three_batches_with_the_same_values_and_peak(monkeypatch):
    """Every parameter of the ViT is small: its Adam updates (second moments, first moments, parameters) end the
    training step in three batches, one per kernel, of one statement per parameter each, written over its parameter
    or state; those whose gradients would live over the step's peak stay (at batch 2, more than a third). The step
    computes what it computes without the batches (none moved), in float64, at no higher planned peak."""
    from deepdsl.passes import fuse_horizontal as horizontal

    on = deepdsl.compile(deepdsl.load(VIT, Overrides(batch=2)), deepdsl.CompileOptions(verify=True))
    batches = [i for i in on.train.body if isinstance(i, Let) and i.batch]
    assert len(batches) == 3 and len({len(i.batch) for i in batches}) == 1 and len(batches[0].batch) >= 30
    members = [v for i in batches for v in (*i.batch, i.node)]
    updates = {id(i.node): i for i in on.train.body if isinstance(i, Let) and i.into is not None and i.into.is_leaf}
    assert len(updates) == 3 * len([x for x in on.train.inputs if x.op == "param"])
    assert all(id(v) in updates and v.size <= horizontal.SMALL_UPDATE for v in members)
    monkeypatch.setattr(horizontal, "SMALL_UPDATE", 0)
    off = deepdsl.compile(deepdsl.load(VIT, Overrides(batch=2)), deepdsl.CompileOptions(verify=True))
    assert not any(isinstance(i, Let) and i.batch for i in off.train.body)
    assert on.steps["train"].plan.peak_live_bytes <= off.steps["train"].plan.peak_live_bytes
    feeds = adam_feeds(off)
    (train_on, _), (train_off, _) = run_compiled(on, feeds), run_compiled(off, feeds)
    for name in train_off:
        np.testing.assert_array_equal(train_on[name], train_off[name], err_msg=name)
