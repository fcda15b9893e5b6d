"""Generated programs read like hand-written code: values named after the layers that made them (and the names
true to what the values are), a banner per layer and direction, kernels named after their operations, plans
after the code, and every comment agreeing with the line under it."""
from __future__ import annotations

import keyword
import re

import pytest

import deepdsl
from deepdsl import provenance
from deepdsl.ssa import Let
from tests.support.program_helpers import ROOT, compile_program, run_cli

GENERATED = ROOT / "generated"


def _lenet():
    return deepdsl.compile(deepdsl.load(str(ROOT / "networks" / "lenet.py")))


def test_values_are_named_after_their_layers():
    program = _lenet().train
    names = set(program.names().values())
    for expected in ("cv1", "cv1_max_pool", "cv1_max_pool_argmax", "fc1_relu", "fc2_log_loss", "d_fc2", "d_cv1",
                     "d_cv1_W", "d_fc1_B", "V_cv1_W_new", "cv1_W_new"):
        assert expected in names, expected
    values = [program.names()[id(n)] for n in program.statements()]
    assert len(values) == len(set(values)), "two statements share a name"
    assert all(v.isidentifier() and not keyword.iskeyword(v) for v in values)


def test_names_say_what_the_values_are():
    """`d_<p>` is the gradient the update of parameter p reads, `<k>_new` the step's output for tensor k, a
    forward value `<layer>` is the layer's output (the value the next layer reads)."""
    compiled = _lenet()
    program = compiled.train
    names = program.names()
    by_name = {v: k for k, v in names.items()}
    nodes = {id(n): n for n in program.statements()} | {id(n): n for n in program.inputs}
    outputs = dict(program.outputs)
    for p in compiled.params:
        velocity = outputs[f"V_{p.name}"]
        assert names[id(velocity)] == f"V_{p.name}_new"
        assert names[id(outputs[p.name])] == f"{p.name}_new"
        gradient = nodes[by_name[f"d_{p.name}"]]
        assert gradient in velocity.inputs, f"the update of {p.name} does not read d_{p.name}"
    # the ReLU after fc1 reads fc1's matmul; fc2's matmul, its bias added (`fuse_epilogue`: the layer's output), the
    # ReLU
    fc2 = nodes[by_name["fc2"]]
    assert fc2.op == "matmul" and names[id(fc2.inputs[0])] == "fc1_relu"
    assert nodes[by_name["cv2"]].inputs[0] is nodes[by_name["cv1_max_pool"]]


def test_each_network_file_names_its_own_values(tmp_path):
    """Two networks with one equal node made by differently named layers: each program names it after its own
    layer, in whichever order they are loaded and compiled (the side table is per network)."""
    common = """
from deepdsl import dsl as D
x = D.images("x", (4, 1, 6, 6))
y = D.labels("y", 4, 3)
fc1 = D.full("fc1", 8)
fc2 = D.full("fc2", 3)
net = fc2 @ {act} @ fc1 @ D.flatten
loop = D.Loop(loss=(D.cross_entropy(y) @ net)(x), accuracy=(D.precision(y) @ net)(x), solver=D.Train("t"))
"""
    (tmp_path / "a.py").write_text(common.format(act="D.relu"))
    (tmp_path / "b.py").write_text(common.format(act='D.elementwise("act", "Max(v, 0)")'))
    a, b = deepdsl.load(str(tmp_path / "a.py")), deepdsl.load(str(tmp_path / "b.py"))
    for loop, own, other in ((b, "fc1_act", "fc1_relu"), (a, "fc1_relu", "fc1_act")):
        names = set(deepdsl.compile(loop).train.names().values())
        assert own in names and other not in names
        assert f"d_{own}" in names


def test_names_never_hide_what_the_step_uses(tmp_path):
    """Layers named like Python keywords, the step's locals, its inputs or kernels: the values take other names
    and the program runs."""
    network = tmp_path / "odd.py"
    network.write_text("""
from deepdsl import dsl as D
x = D.images("x", (4, 1, 6, 6))
y = D.labels("y", 4, 3)
net = D.full("ew_scale", 3) @ D.flatten @ D.conv("mem", 1, 2) @ D.conv("class", 3, 2) @ D.conv("x", 1, 2)
loop = D.Loop(loss=(D.cross_entropy(y) @ net)(x), accuracy=(D.precision(y) @ net)(x), solver=D.Train("odd"))
""")
    compiled, path = compile_program(network, tmp_path)
    all_names = compiled.train.names()
    values = {all_names[id(n)] for n in compiled.train.statements()}
    assert {"class", "mem", "x"}.isdisjoint(values)
    assert {"class_2", "mem_2", "x_2"} <= values
    text = path.read_text()
    assert "ew_scale" in values and "def ew_scale_2(" in text  # the loss's scaling kernel yields to the layer
    done = run_cli(path, "--iters", "2", "--test-iters", "1", "--data", "synthetic", "--params",
                   str(tmp_path / "odd.npz"), "--quiet")
    assert done.returncode == 0, done.stderr


def _blocks(text: str, method: str) -> list[list[str]]:
    """The statement blocks of one step method: each a comment line and the lines under it."""
    body = text.split(f"    def {method}(", 1)[1].split("\n    def ", 1)[0].split("\n    # memory plan", 1)[0]
    blocks: list[list[str]] = []
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith("# ----"):
            blocks.append([stripped])
        elif stripped.startswith("# "):
            blocks.append([stripped])
        elif blocks and stripped:
            blocks[-1].append(stripped)
    return blocks


def _kernels(text: str) -> dict[str, str]:
    return dict(re.findall(r'^def (ew_\w+)\(out, [^)]*\):\n    """out = (.*?)(?:   \(out may be v\d+\))?"""', text,
                           re.M))


@pytest.mark.parametrize("name", ["lenet", "resnet_mini", "googlenet"])
def test_every_comment_agrees_with_its_line(name):
    text = (GENERATED / f"{name}.py").read_text()
    kernels = _kernels(text)
    assert kernels
    checked = {"free": 0, "ew": 0, "let": 0}
    for method in ("train_step", "test_step"):
        for block in _blocks(text, method):
            comment, lines = block[0][2:], block[1:]
            if comment.startswith("----"):
                continue
            if comment.startswith("free "):
                dropped = [line[4:] for line in lines if line.startswith("del ")]
                assert dropped and comment[5:] == dropped[0], block
                checked["free"] += 1
                continue
            value, expr = comment.split(" = ", 1)
            assert lines[0].startswith(f"{value} = "), block
            call = next((line for line in lines if line.startswith("rt.ew(")), None)
            checked["let"] += 1
            if call is None:
                continue
            kernel, out, *args = [a.strip() for a in call[len("rt.ew("):-1].split(", ")]
            assert out == value, block
            args = [re.sub(r"^T\['(\w+)'\]$", r"\1", a) for a in args]
            # the kernel's own expression with its variables replaced by the call's arguments is the comment's
            shown = re.sub(r"\bv(\d+)\b", lambda m: args[int(m.group(1))], kernels[kernel])
            assert shown == expr, block
            checked["ew"] += 1
    assert min(checked.values()) > 0, checked


def test_sections_follow_layers_and_plans_come_after_the_code():
    text = (GENERATED / "resnet50.py").read_text()
    assert "# ---- bn5c_branch2c (batch norm), backward ----" in text
    assert "# ---- res5c_branch2c (conv 1x1, 2048 channels, stride 1, padding 0), forward ----" in text
    assert text.index("    def train_step(") < text.index("    memory_plans = {")
    assert not re.search(r"\bX\d+\b|\bew\d+\b", text), "positional names left in the program"
    # within a section every statement belongs to that section's layer (checked on the programs themselves)
    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / "resnet_mini.py")))
    program = compiled.train
    lets = [i.node for i in program.body if isinstance(i, Let)]
    unnamed = [n for n in lets if provenance.origin(n, program.origins) is None]
    assert not unnamed, f"{len(unnamed)} statements of no layer, e.g. {unnamed[:3]}"
    layers = {provenance.origin(n, program.origins).layer for n in lets}
    params = {p.name.rsplit("_", 1)[0] for p in compiled.params}
    assert params <= layers, params - layers


def test_structure_hash_does_not_depend_on_names():
    from deepdsl.codegen import structure_hash

    compiled = _lenet()
    text = compiled.train.text(positional=True)
    assert "X1 = conv2d(x, cv1_W, cv1_B)" in text
    assert structure_hash(compiled) == structure_hash(_lenet())
