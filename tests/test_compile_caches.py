"""The compile-time shortcuts keep results identical: the shape broadcast rule against numpy, the cached canonical
form of elementwise nodes (constants folded, inputs merged, dropped, renumbered; names substituted simultaneously),
the cached cotangent expressions against sympy's derivatives, the traversal order against a recursive definition,
and whole compilations that do not depend on what earlier compilations left in the caches."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy
from hypothesis import given, settings

import deepdsl
from deepdsl.dsl import Overrides
from deepdsl.ir import FLOAT, Node, make, toposort
from deepdsl.ops.elementwise import Y, _canonical, broadcast_shapes, cotangent_exprs, elementwise, sym
from deepdsl.ops.leaf import const
from tests.support.random_programs import graphs

ROOT = Path(__file__).resolve().parents[1]
v0, v1, v2 = sym(0), sym(1), sym(2)


def leaf(name: str, shape=(2, 3)) -> Node:
    return make("input", (), name=name, shape=shape, dtype=FLOAT, role="data")


def test_broadcast_shapes_matches_numpy():
    shapes = [s for rank in range(4) for s in itertools.product((0, 1, 2, 3), repeat=rank)]
    for count in (1, 2, 3):
        for combo in itertools.islice(itertools.product(shapes, repeat=count), 0, None, 7 if count == 3 else 1):
            try:
                expected = np.broadcast_shapes(*combo)
            except ValueError:
                with pytest.raises(ValueError):
                    broadcast_shapes(*combo)
                continue
            assert broadcast_shapes(*combo) == expected, combo
    assert broadcast_shapes() == np.broadcast_shapes() == ()


def test_elementwise_canonical_form():
    a, b = leaf("a"), leaf("b")
    # a repeated input is one input
    node = elementwise(v0 * v1, [a, a])
    assert node.inputs == (a,) and node.attr("expr") == v0 ** 2
    # a scalar constant becomes a number in the expression (integers stay integers)
    node = elementwise(v0 * v1 + v2, [const(2.0), a, const(0.5)])
    assert node.inputs == (a,) and node.attr("expr") == 2 * v0 + sympy.Float(0.5)
    # an input the expression does not read is dropped and the rest renumbered in order
    node = elementwise(v1 + 0 * v0, [a, b])
    assert node is b
    node = elementwise(sympy.exp(v1) + 0 * v0, [a, b])
    assert node.inputs == (b,) and node.attr("expr") == sympy.exp(v0)
    # names are substituted simultaneously: swapped names cannot capture each other
    node = elementwise(v0 - v1, [a, b], names=(v1, v0))
    assert node.inputs == (a, b) and node.attr("expr") == v1 - v0
    # a constant expression is a constant
    assert elementwise(v0 * v1, [const(3.0), const(2.0)]) is const(6.0)
    assert elementwise(v0 - v0, [a], shape=(2, 3)) is const(0.0, (2, 3))
    # a scalar result is broadcast to the requested shape
    s = leaf("s", ())
    node = elementwise(2 * v0, [s], shape=(2, 3))
    assert node.op == "broadcast_to" and node.shape == (2, 3) and node.inputs[0].attr("expr") == 2 * v0
    # out_grad is kept; the relu over the output names its symbols g, y
    node = elementwise(sympy.Max(v0, 0), [a], out_grad=sympy.Heaviside(Y, 0))
    assert node.attr("out_grad") == sympy.Heaviside(Y, 0)


def test_elementwise_does_not_depend_on_the_cache_state():
    a, b = leaf("a"), leaf("b")
    cases = [(v0 * v1 + v2, [a, const(2.0), b]), (sympy.Max(v0 - v1, 0), [b, a]), (v0 + v1 + v2, [a, b, a]),
             (v0 / (1 + v1 ** 2), [a, const(1.5)]), (v1 * sympy.tanh(v0), [a, b])]
    warm = [elementwise(e, i) for e, i in cases]
    _canonical.cache_clear()
    assert [elementwise(e, i) for e, i in cases] == warm


def test_cotangent_expressions_are_the_derivatives():
    g = sympy.Symbol("g", real=True)
    for expr, n in [(v0 * v1, 2), (sympy.Max(v0, 0), 1), (v0 / (1 + v1 ** 2) + v2, 3), (v0 + 0 * v1, 2),
                    (sympy.exp(v0) * v1 - v1, 2)]:
        cotangents = cotangent_exprs(expr, n)
        assert len(cotangents) == n
        for i, c in enumerate(cotangents):
            # the cotangent of input i over (g, v0, ..., v{n-1}) renamed v0, v1, ..., vn
            back = {sym(j + 1): sym(j) for j in range(n)} | {v0: g}
            expected = g * sympy.diff(expr, sym(i))
            if expected == 0:
                assert c is None
                continue
            got = c.xreplace(back)
            # sympy writes Max' as Heaviside(x, 1/2); ours takes the value 0 at 0, as PyTorch does
            expected = expected.replace(lambda e: isinstance(e, sympy.Heaviside),
                                        lambda e: sympy.Heaviside(e.args[0], 0))
            assert got == expected, (expr, i, got, expected)


def toposort_by_definition(roots) -> list[Node]:
    """Post-order depth-first search, inputs in order, roots in order (recursive: small graphs only)."""
    order, seen = [], set()

    def visit(node):
        if id(node) in seen:
            return
        seen.add(id(node))
        for i in node.inputs:
            visit(i)
        order.append(node)

    for root in roots:
        visit(root)
    return order


@settings(max_examples=40, deadline=None)
@given(graphs())
def test_toposort_is_the_depth_first_post_order(graph):
    roots = [node for _, node in graph.outputs]
    assert toposort(roots) == toposort_by_definition(roots)


@pytest.mark.parametrize("network", ["lenet", "resnet_mini"])
def test_compiled_programs_do_not_depend_on_earlier_compilations(network):
    """A fresh process (every cache empty) prints the same programs as this one after other networks warmed the
    caches of sympy and of the compiler."""
    path = str(ROOT / "networks" / f"{network}.py")
    script = ("import sys, deepdsl; from deepdsl.dsl import Overrides; "
              "c = deepdsl.compile(deepdsl.load(sys.argv[1], Overrides(batch=2))); "
              "sys.stdout.write(c.setup.text() + c.train.text() + c.test.text())")
    fresh = subprocess.run([sys.executable, "-c", script, path], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    for other in ("inception_mini", "mlp", "resnet_mini", "lenet"):
        deepdsl.compile(deepdsl.load(str(ROOT / "networks" / f"{other}.py"), Overrides(batch=2)))
    c = deepdsl.compile(deepdsl.load(path, Overrides(batch=2)))
    assert c.setup.text() + c.train.text() + c.test.text() == fresh


def test_compile_leaves_no_cyclic_garbage_and_restores_the_collector():
    """The collector is paused while compiling (what compiling drops must be freed by reference counting, so no
    cycles), and is running again afterwards, also when compiling fails; a paused collector stays paused."""
    import gc
    import json

    # in a fresh process: objects other tests of this process leave in cycles may become garbage meanwhile
    script = ("import gc, json, sys, deepdsl; from deepdsl.dsl import Overrides; "
              "loop = deepdsl.load(sys.argv[1], Overrides(batch=2)); deepdsl.compile(loop); gc.collect(); "
              "gc.set_debug(gc.DEBUG_SAVEALL); compiled = deepdsl.compile(loop); del compiled; gc.collect(); "
              "print(json.dumps([type(o).__name__ for o in gc.garbage] + [gc.isenabled()]))")
    done = subprocess.run([sys.executable, "-c", script, str(ROOT / "networks" / "resnet_mini.py")], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    *garbage, enabled = json.loads(done.stdout.splitlines()[-1])
    assert garbage == [], f"compiling left {len(garbage)} objects in reference cycles: {garbage[:10]}"
    assert enabled
    loop = deepdsl.load(str(ROOT / "networks" / "resnet_mini.py"), Overrides(batch=2))

    from deepdsl import dsl as D
    from deepdsl.errors import DeepDSLError
    y = D.labels("y", 2, classes=16)
    features = D.flatten(D.images("x", (2, 1, 4, 4)))
    bad = D.Loop(D.cross_entropy(y)(features), D.precision(y)(features), D.Train("bad"))   # nothing to train
    with pytest.raises(DeepDSLError):
        deepdsl.compile(bad)
    assert gc.isenabled()
    gc.disable()
    try:
        deepdsl.compile(loop)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_compile_benchmark_compares_two_checkouts():
    """benchmarks/compile_vs_checkout.py against a checkout (here this one): a row of CPU seconds for each phase,
    and the two checkouts' programs the same."""
    import re

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_vs_checkout.py"), "--against", str(ROOT),
                           "lenet", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = re.search(r"^ +lenet +(.*)$", done.stdout, re.M)
    assert row, done.stdout
    assert len(re.findall(r"[\d.]+ / [\d.]+ \([\d.]+x\)", row.group(1))) == 3, done.stdout
    assert row.group(1).rstrip().endswith("yes"), done.stdout
