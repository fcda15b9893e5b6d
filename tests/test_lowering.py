"""Lowering a compiled network to the frozen description both renderers render: the pooling pair is decided by an
IR pass, the description is frozen and made once, kernel arity comes from it, and optimizer state is known by its
role, never by its name."""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
import sympy

import deepdsl
from deepdsl import dsl as D
from deepdsl import interpret
from deepdsl.codegen import description as description_module
from deepdsl.codegen import render_program, write_program
from deepdsl.codegen.cuda import render_cuda
from deepdsl.codegen.description import ProgramDescription, describe
from deepdsl.dsl import Overrides
from deepdsl.errors import VerifyError
from deepdsl.ir import FLOAT, make
from deepdsl.ops.elementwise import elementwise, sym
from deepdsl.memory_plan import plan_memory
from deepdsl.passes.dealloc import insert_frees
from deepdsl.passes.fuse_multi_output import fuse_multi_output
from deepdsl.ssa import Free, Let, Program
from deepdsl.training import is_optimizer_state
from deepdsl.verify import verify

LENET = pathlib.Path(__file__).resolve().parents[1] / "networks" / "lenet.py"


@pytest.fixture(scope="module")
def lenet():
    return deepdsl.compile(deepdsl.load(LENET, Overrides(batch=4)))


def _pooling(**attrs):
    x = make("input", (), name="x", shape=(2, 3, 8, 8), dtype=FLOAT, role="data")
    pool = make("max_pool", (x,), kernel=2, stride=2, **attrs)
    index = make("max_pool_argmax", (x,), kernel=2, stride=2, **attrs)
    return x, pool, index


def _program(x, body, outputs):
    return Program("p", (x,), tuple(body), tuple(outputs))


# --- the merge is an IR pass ------------------------------------------------------------------------------------


def test_adjacent_pool_and_argmax_of_the_same_windows_are_paired_in_either_order():
    x, pool, index = _pooling()
    for first, second in ((pool, index), (index, pool)):
        program = _program(x, [Let(first), Let(second)], [("a", pool), ("b", index)])
        fused = verify(fuse_multi_output(program))
        assert [i.computes_also for i in fused.body] == [None, first]
        assert fuse_multi_output(fused) is fused                      # idempotent
        assert fused.text() == program.text()                        # the values are the same


def test_pools_apart_of_other_windows_or_in_place_are_not_paired():
    x, pool, index = _pooling()
    _, other_pool, _ = _pooling(pad=1)
    cases = [
        _program(x, [Let(pool), Free((pool,)), Let(index)], [("b", index)]),                # a Free between them
        _program(x, [Let(other_pool), Let(index)], [("a", other_pool), ("b", index)]),      # other windows
        _program(x, [Let(pool, into=x), Let(index)], [("a", pool), ("b", index)]),          # one in place
    ]
    for program in cases:
        assert fuse_multi_output(program) is program


def test_the_verifier_rejects_a_wrong_pairing():
    x, pool, index = _pooling()
    _, other_pool, _ = _pooling(pad=1)
    wrong = _program(x, [Let(other_pool), Let(index, computes_also=other_pool)], [("a", other_pool), ("b", index)])
    with pytest.raises(VerifyError, match="cannot be computed by one call"):
        verify(wrong)
    apart = _program(x, [Let(pool), Let(other_pool), Let(index, computes_also=pool)],
                     [("a", pool), ("b", index), ("c", other_pool)])
    with pytest.raises(VerifyError, match="does not define"):
        verify(apart)


def _momentum_update(shape=(4, 3)):
    """An optimizer's two updates as a program: v' = 0.9*v + g (over v) and then w' = w - 0.1*v' (over w)."""
    v0, v1, v2 = sym(0), sym(1), sym(2)
    w = make("param", (), name="w", shape=shape, dtype=FLOAT, init="zeros")
    v = make("state", (), name="v", shape=shape, dtype=FLOAT, init="zeros")
    g = make("input", (), name="g", shape=shape, dtype=FLOAT, role="data")
    v_new = elementwise(sympy.Float(0.9) * v0 + v1 + v2 * 0, [v, g, w])
    w_new = elementwise(v0 - sympy.Float(0.1) * v1, [w, v_new])
    return (w, v, g), v_new, w_new


def test_an_elementwise_statement_and_its_elementwise_reader_are_paired_in_place_or_not():
    """Paired where the second statement writes in place; where it allocates, keeping the gradient (a batch input,
    in the arena) up to it would raise the planned peak, so they stay apart."""
    (w, v, g), v_new, w_new = _momentum_update()
    feeds = {"w": np.arange(12.0).reshape(4, 3), "v": np.ones((4, 3)), "g": np.full((4, 3), 0.5)}
    for into, paired in (((v, w), True), ((None, w), True), ((v, None), False), ((None, None), False)):
        program = Program("p", (w, v, g), (Let(v_new, into=into[0]), Let(w_new, into=into[1])),
                          (("v", v_new), ("w", w_new)))
        fused = verify(fuse_multi_output(program))
        assert [i.computes_also for i in fused.body] == [None, v_new if paired else None], into
        assert [i.into for i in fused.body] == list(into)
        planned = [plan_memory(insert_frees(p)).peak_live_bytes for p in (program, fused)]
        assert planned[1] <= planned[0]
        for key, value in interpret.run(program, feeds).items():
            np.testing.assert_array_equal(interpret.run(fused, feeds)[key], value)


def test_elementwise_statements_apart_unrelated_or_of_other_shapes_are_not_paired():
    (w, v, g), v_new, w_new = _momentum_update()
    other = elementwise(sym(0) * 2, [g])
    wide = elementwise(sym(0) + sym(1), [v_new, make("input", (), name="b", shape=(2, 4, 3), dtype=FLOAT,
                                                           role="label")])
    cases = [
        Program("p", (w, v, g), (Let(v_new), Let(other), Let(w_new)), (("v", v_new), ("w", w_new), ("o", other))),
        Program("p", (w, v, g), (Let(v_new), Let(other)), (("v", v_new), ("o", other))),        # no reader
        Program("p", (w, v, g, wide.inputs[1]), (Let(v_new), Let(wide)), (("v", v_new), ("x", wide))),  # broadcast
    ]
    for program in cases:
        assert fuse_multi_output(program) is program


def test_a_pair_keeps_the_first_statements_inputs_until_the_call():
    """The gradient dies at the first statement of the pair: its Free comes after the second, which is the call
    that reads it, so no output of that statement or after can take its memory while it is still to be read. Of the
    chain gradient -> momentum -> weight, the pair that saves more reading is taken: the two updates, which also
    share the weight."""
    (w, v, g), v_new, w_new = _momentum_update()
    scratch = elementwise(sym(0) * 3, [g])             # an arena gradient, read by the first statement only
    v_new = elementwise(sympy.Float(0.9) * sym(0) + sym(1) + sympy.Float(1e-4) * sym(2), [v, scratch, w])
    w_new = elementwise(sym(0) - sympy.Float(0.1) * sym(1), [w, v_new])
    program = Program("p", (w, v, g), (Let(scratch), Let(v_new, into=v), Let(w_new, into=w)),
                      (("v", v_new), ("w", w_new)))
    def order(body):
        return [i.node if isinstance(i, Let) else i.nodes for i in body]

    freed = verify(insert_frees(fuse_multi_output(program)))
    assert order(freed.body) == [scratch, (g,), v_new, w_new, (scratch,)]
    assert [i.computes_also for i in freed.body if isinstance(i, Let)] == [None, None, v_new]
    assert order(insert_frees(program).body) == [scratch, (g,), v_new, (scratch,), w_new]


def test_a_pairs_first_output_that_nothing_reads_is_freed_after_the_call_that_writes_it():
    x, pool, index = _pooling()
    paired = _program(x, [Let(index), Let(pool, computes_also=index)], [("a", pool)])   # the argmax is never read
    freed = verify(insert_frees(paired))
    assert [i.node if isinstance(i, Let) else i.nodes for i in freed.body] == [index, pool, (x, index)]
    # which raises the peak (the argmax and the maximum live together): the pass leaves them apart
    program = _program(x, [Let(index), Let(pool)], [("a", pool)])
    assert fuse_multi_output(program) is program


def _centred_and_sum(between_shape):
    """A batch norm's centred input `c = y - m` (over its producer y, a layer's output) and the sum of its squares
    per channel, a statement of `between_shape` (reading a batch input of that shape) between them."""
    x = make("input", (), name="x", shape=(2, 3, 4, 4), dtype=FLOAT, role="data")
    z = make("input", (), name="z", shape=between_shape, dtype=FLOAT, role="label")
    m = make("state", (), name="m", shape=(1, 3, 1, 1), dtype=FLOAT, init="zeros")
    y = make("max_pool", (x,), kernel=1, stride=1)
    c = elementwise(sym(0) - sym(1), [y, m])
    between = elementwise(sym(0) * 3, [z])
    total = make("ew_sum", (c,), expr=sym(0) ** 2, shape=(1, 3, 1, 1))
    program = Program("p", (x, z, m), (Let(y), Let(c, into=y), Let(between), Let(total)),
                      (("s", total), ("b", between)))
    return program, c, between, total


def test_a_sum_is_moved_up_to_the_elementwise_statement_it_sums_unless_that_raises_the_peak():
    feeds = {"x": np.arange(96.0).reshape(2, 3, 4, 4), "m": np.ones((1, 3, 1, 1))}
    program, c, between, total = _centred_and_sum((2,))
    fused = verify(fuse_multi_output(program))
    assert [i.node for i in fused.body][1:] == [c, total, between]
    assert fused.body[2].computes_also is c
    assert [plan_memory(insert_frees(p)).peak_live_bytes for p in (fused, program)] == [1280, 1280]
    for key, value in interpret.run(program, {**feeds, "z": np.ones(2)}).items():
        np.testing.assert_array_equal(interpret.run(fused, {**feeds, "z": np.ones(2)})[key], value)
    # the statement in between at the peak: the sum's output, live there, would raise it
    program, *_ = _centred_and_sum((64, 64))
    assert fuse_multi_output(program) is program


def test_the_verifier_rejects_an_elementwise_pair_whose_second_does_not_read_the_first():
    (w, v, g), v_new, _ = _momentum_update()
    other = elementwise(sym(0) * 2, [g])
    wrong = Program("p", (w, v, g), (Let(v_new), Let(other, computes_also=v_new)), (("v", v_new), ("o", other)))
    with pytest.raises(VerifyError, match="cannot be computed by one call"):
        verify(wrong)


def test_compiled_networks_pair_their_pools_and_updates_and_keep_their_plans(lenet):
    pairs = [(body[k - 1].node.op, i.node.op) for body in [lenet.train.body]
             for k, i in enumerate(body) if isinstance(i, Let) and i.computes_also is not None]
    pools = [p for p in pairs if set(p) == {"max_pool", "max_pool_argmax"}]
    updates = [p for p in pairs if p == ("ew", "ew")]
    # the small parameters' updates in batches of one kernel where the peak allows (`fuse_horizontal`), the others
    # in pairs
    batches = [i for i in lenet.train.body if isinstance(i, Let) and i.batch]
    batched = sum(len(i.batch) + 1 for i in batches)
    assert pools and updates and len(updates) + batched >= 8             # 8: LeNet's parameters
    assert len(pools) + len(updates) == len(pairs)
    assert len(lenet.steps["train"].plan.steps) == len(lenet.train.body)
    text = render_program(describe(lenet))
    assert text.count("(computed with the next statement)") == len(pairs)
    assert text.count("(computed with the last statement of its batch)") == batched - len(batches)
    assert text.count("argmax=") == len(pools)
    assert text.count("rt.ew_pair(") == len(updates)
    assert text.count("rt.ew_many(") == len(batches)


# --- one frozen description for both renderers -------------------------------------------------------------------


def test_the_description_is_frozen(lenet):
    d = describe(lenet)
    assert isinstance(d, ProgramDescription)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.kernels[0].arity = 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.steps[1].blocks[0].comment = ""
    for value in (d.steps, d.kernels, d.params, d.states, d.memory_plans, d.steps[1].blocks, d.steps[1].epilogue,
                  d.steps[1].blocks[0].lines, d.memory_plans[0].buffers):
        assert isinstance(value, tuple)
    hash(d.kernels[0].name)


def test_write_program_describes_once_for_both_renderers(lenet, tmp_path, monkeypatch):
    made = []
    real = description_module.describe

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(description_module, "describe", counting)
    path = write_program(lenet, tmp_path / "lenet.py")
    assert len(made) == 1
    assert path.read_text() == render_program(made[0])
    assert path.with_suffix(".cu").read_text() == render_cuda(made[0], "lenet.py")


def test_kernel_arity_comes_from_the_description(lenet):
    d = describe(lenet)
    kernel = max(d.kernels, key=lambda k: k.arity)
    assert kernel.params == ", ".join(["out"] + [f"v{i}" for i in range(kernel.arity)])
    entry = f"deepdsl_{kernel.name}_1(EwShape s, float* out"
    line = next(s for s in render_cuda(d).splitlines() if entry in s)
    assert line.count("EwArg a") == kernel.arity
    # the CUDA renderer reads `arity`, not the Python parameter list
    wider = dataclasses.replace(kernel, arity=kernel.arity + 1)
    text = render_cuda(dataclasses.replace(d, kernels=tuple(wider if k is kernel else k for k in d.kernels)))
    line = next(s for s in text.splitlines() if entry in s)
    assert line.count("EwArg a") == kernel.arity + 1


# --- optimizer state by role ---------------------------------------------------------------------------------------


def _net(layer: str):
    x = D.images("x", (2, 1, 4, 4))
    y = D.labels("y", 2, classes=3)
    network = D.full(layer, 3) @ D.flatten
    return D.Loop((D.cross_entropy(y) @ network)(x), (D.precision(y) @ network)(x), D.Train("named", momentum=0.9))


def test_optimizer_state_is_known_by_role_not_by_name():
    compiled = deepdsl.compile(_net("V_x"))
    assert {p.name for p in compiled.params} == {"V_x_W", "V_x_B"}
    assert not any(is_optimizer_state(p) for p in compiled.params)
    assert {s.name for s in compiled.states if is_optimizer_state(s)} == {"V_V_x_W", "V_V_x_B"}
    d = describe(compiled)
    assert {s.name: s.optimizer for s in d.states} == {"V_V_x_B": True, "V_V_x_W": True}
    assert all(not hasattr(p, "optimizer") or not p.optimizer for p in d.params)


def test_running_statistics_named_like_optimizer_state_are_not_optimizer_state():
    x = D.images("x", (2, 1, 4, 4))
    y = D.labels("y", 2, classes=3)
    network = D.full("fc", 3) @ D.flatten @ D.batch_norm("V_bn")
    loop = D.Loop((D.cross_entropy(y) @ network)(x), (D.precision(y) @ network)(x), D.Train("bn", momentum=0.9))
    compiled = deepdsl.compile(loop)
    optimizer = {s.name for s in compiled.states if is_optimizer_state(s)}
    running = {s.name for s in compiled.states} - optimizer
    assert running and all(name.startswith("V_bn") for name in running)
    assert all(name.startswith("V_") for name in optimizer)
    assert {s.name for s in describe(compiled).states if s.optimizer} == optimizer
