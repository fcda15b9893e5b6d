"""Lowering a compiled network to the frozen description both renderers render: the pooling pair is decided by an
IR pass, the description is frozen and made once, kernel arity comes from it, and optimizer state is known by its
role, never by its name."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest

import deepdsl
from deepdsl import dsl as D
from deepdsl.codegen import description as description_module
from deepdsl.codegen import render_program, write_program
from deepdsl.codegen.cuda import render_cuda
from deepdsl.codegen.description import ProgramDescription, describe
from deepdsl.dsl import Overrides
from deepdsl.errors import VerifyError
from deepdsl.ir import FLOAT, make
from deepdsl.passes.fuse_pool_argmax import fuse_pool_argmax
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
        fused = verify(fuse_pool_argmax(program))
        assert [i.computes_also for i in fused.body] == [None, first]
        assert fuse_pool_argmax(fused) is fused                      # idempotent
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
        assert fuse_pool_argmax(program) is program


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


def test_compiled_networks_pair_their_pools_and_keep_their_plans(lenet):
    pairs = [(body[k - 1].node.op, i.node.op) for body in [lenet.train.body]
             for k, i in enumerate(body) if isinstance(i, Let) and i.computes_also is not None]
    assert pairs and all({a, b} == {"max_pool", "max_pool_argmax"} for a, b in pairs)
    assert len(lenet.steps["train"].plan.steps) == len(lenet.train.body)
    text = render_program(describe(lenet))
    assert text.count("(computed with the next statement)") == len(pairs)
    assert text.count("argmax=") == len(pairs)


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
