"""The DSL front end and the CLI: static shape errors name the layer, shapes and line; bad files give one line."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import deepdsl
from deepdsl import dsl as D
from deepdsl.cli import main
from deepdsl.ir import make
from deepdsl.dsl import Overrides
from deepdsl.errors import DeepDSLError, ShapeError
from deepdsl.interpret import run

ROOT = Path(__file__).resolve().parents[1]

HEADER = """\
from deepdsl import dsl as D
x = D.images("x", (4, 3, 12, 12))
y = D.labels("y", 4, classes=10)
"""


def write(tmp_path: Path, body: str, name: str = "net.py") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return path


def line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def cli_error(path: Path, capsys) -> str:
    assert main(["ir", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_kernel_larger_than_input_names_layer_shapes_and_line(tmp_path, capsys):
    path = write(tmp_path, """\
        c1 = D.conv("c1", kernel=5, channels=8)
        c2 = D.conv("c2", kernel=9, channels=8)
        net = D.full("fc", 10) @ D.flatten @ c2 @ c1
        loss = (D.cross_entropy(y) @ net)(x)
        """)
    err = cli_error(path, capsys)
    assert f"net.py:{line_of(path, 'c2 = D.conv')}:" in err
    assert "'c2'" in err and "9x9" in err and "8x8" in err and "4x8x8x8" in err


def test_concat_of_different_spatial_sizes(tmp_path, capsys):
    path = write(tmp_path, """\
        a = D.conv("a", kernel=3, channels=4)
        b = D.conv("b", kernel=1, channels=4)
        z = D.concat(a(x), b(x))
        """)
    err = cli_error(path, capsys)
    assert f":{line_of(path, 'z = D.concat')}:" in err
    assert "concat" in err and "4x4x10x10" in err and "4x4x12x12" in err


def test_residual_add_of_different_channels(tmp_path, capsys):
    path = write(tmp_path, """\
        a = D.conv("a", kernel=1, channels=4)
        b = D.conv("b", kernel=1, channels=8)
        z = D.add(a(x), b(x))
        """)
    err = cli_error(path, capsys)
    assert f":{line_of(path, 'z = D.add')}:" in err and "4x4x12x12" in err and "4x8x12x12" in err


def test_fully_connected_on_4d_input_suggests_flatten(tmp_path, capsys):
    path = write(tmp_path, """\
        fc = D.full("fc", 10)
        loss = (D.cross_entropy(y) @ fc)(x)
        """)
    err = cli_error(path, capsys)
    assert "'fc'" in err and "flatten" in err and f":{line_of(path, 'fc = D.full')}:" in err


def test_wrong_class_count(tmp_path, capsys):
    path = write(tmp_path, """\
        net = D.full("fc", 7) @ D.flatten
        loss = (D.cross_entropy(y) @ net)(x)
        """)
    err = cli_error(path, capsys)
    assert "7 scores" in err and "10 classes" in err


def test_syntax_and_import_errors_and_missing_loop(tmp_path, capsys):
    bad = tmp_path / "syntax.py"
    bad.write_text("from deepdsl import dsl as D\nx = D.images('x', (1, 1, 4, 4)\n")
    assert "syntax.py:2: syntax error" in cli_error(bad, capsys)
    bad.write_text("import no_such_module_here\n")
    assert "syntax.py:1: import error" in cli_error(bad, capsys)
    bad.write_text("x = 1\ny = x / 0\n")
    assert "syntax.py:2: ZeroDivisionError" in cli_error(bad, capsys)
    bad.write_text("x = 1\n")
    assert "no D.Loop" in cli_error(bad, capsys)
    assert "no such network file" in cli_error(tmp_path / "missing.py", capsys)


def test_debug_shows_traceback(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    result = subprocess.run([sys.executable, "-m", "deepdsl", "--debug", "ir", str(bad)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode != 0 and "Traceback" in result.stderr
    result = subprocess.run([sys.executable, "-m", "deepdsl", "ir", str(bad)], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 1 and "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_ir_and_graph_commands(tmp_path, capsys):
    assert main(["ir", str(ROOT / "networks/lenet.py"), "--batch", "8", "--step", "train"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("program lenet_train(x: 8x1x28x28")
    assert "conv2d_bwd_filter" in text and "return loss=" in text
    dot = tmp_path / "net.dot"
    assert main(["graph", str(ROOT / "networks/lenet.py"), "-o", str(dot)]) == 0
    body = dot.read_text()
    assert body.startswith('digraph "lenet_train"') and '"cv1_W" ->' in body


def test_program_graph_has_an_edge_for_every_read():
    from deepdsl.graph import program_graph
    from deepdsl.ssa import Let

    program = deepdsl.compile(deepdsl.load(str(ROOT / "networks/lenet.py"), Overrides(batch=2))).train
    graph = program_graph(program)
    names = program.names()
    reads = {(names[id(i)], names[id(s.node)]) for s in program.body if isinstance(s, Let) for i in s.node.inputs
             if id(i) in names}
    outputs = {(names[id(node)], f"out:{key}") for key, node in program.outputs if id(node) in names}
    assert set(graph.edges) == reads | outputs and len(graph.edges) == len(set(graph.edges))
    assert [n.name for n in graph.nodes][:len(program.inputs)] == [leaf.name for leaf in program.inputs]


def test_overrides_change_batch_and_image():
    loop = deepdsl.load(str(ROOT / "networks/lenet.py"), Overrides(batch=3, image=(32, 32)))
    assert loop.loss.node.shape == ()
    compiled = deepdsl.compile(loop)
    x = next(n for n in compiled.train.inputs if n.name == "x")
    assert x.shape == (3, 1, 32, 32)
    fc1 = next(n for n in compiled.params if n.name == "fc1_W")
    assert fc1.shape == (500, 50 * 5 * 5)     # 32 -> 28 -> 14 -> 10 -> 5


def _small_input(batch=2, channels=3, size=6):
    x = D.images("x", (batch, channels, size, size))
    y = D.labels("y", batch, classes=3)
    return x, y


def test_layer_with_parameters_shares_weights_when_reused():
    x, y = _small_input()
    c = D.conv("c", kernel=1, channels=3)
    net = D.full("fc", 3) @ D.flatten @ c @ c          # the same weights applied twice
    loop = D.Loop((D.cross_entropy(y) @ net)(x), (D.precision(y) @ net)(x), D.Train("shared"))
    compiled = deepdsl.compile(loop)
    assert [p.name for p in compiled.params].count("c_W") == 1
    convs = [n for n in compiled.train.statements() if n.op == "conv2d"]
    assert len(convs) == 2 and convs[0].inputs[1] is convs[1].inputs[1]


def test_reusing_a_layer_on_another_channel_count_is_an_error():
    x, y = _small_input()
    c = D.conv("c", kernel=1, channels=5)
    with pytest.raises(ShapeError, match="'c'.*another size"):
        (c @ c)(x)


def test_two_layers_with_one_name_are_rejected():
    x, y = _small_input()
    net = D.full("fc", 3) @ D.flatten @ D.conv("c", kernel=1, channels=3) @ D.conv("c", kernel=3, channels=3)
    loop = D.Loop((D.cross_entropy(y) @ net)(x), (D.precision(y) @ net)(x), D.Train("dup"))
    with pytest.raises(DeepDSLError, match="two different parameters are named 'c_W'"):
        deepdsl.compile(loop)


def test_user_elementwise_function_and_weighted_loss_sum():
    x, y = _small_input()
    swish = D.elementwise("swish", "v / (1 + exp(-v))")
    trunk = D.flatten @ swish @ D.conv("c", kernel=3, channels=4)
    head1, head2 = D.full("h1", 3), D.full("h2", 3)
    loss = (D.cross_entropy(y) @ head1 @ trunk)(x) + 0.3 * (D.cross_entropy(y) @ head2 @ trunk)(x)
    loop = D.Loop(loss, (D.precision(y) @ head1 @ trunk)(x), D.Train("two_heads", lr=0.1, momentum=0.0))
    compiled = deepdsl.compile(loop)
    rng = np.random.default_rng(0)
    feeds = {p.name: rng.normal(0, 0.3, p.shape) for p in compiled.params}
    feeds.update({s.name: np.zeros(s.shape) for s in compiled.states})
    feeds.update(x=rng.normal(size=(2, 3, 6, 6)), y=np.array([0, 2]), lr=0.1, momentum=0.0, decay=0.0)
    feeds.update(run(compiled.setup, feeds, np.float64))
    out = run(compiled.train, feeds, np.float64)
    test = run(compiled.test, feeds, np.float64)
    # the weighted loss is the main head's test loss plus 0.3 x the second head's
    main_only = D.Loop((D.cross_entropy(y) @ head1 @ trunk)(x), (D.precision(y) @ head1 @ trunk)(x), D.Train("m"))
    aux_only = D.Loop((D.cross_entropy(y) @ head2 @ trunk)(x), (D.precision(y) @ head2 @ trunk)(x), D.Train("a"))
    m = run(deepdsl.compile(main_only).test, feeds, np.float64)["loss"]
    a = run(deepdsl.compile(aux_only).test, feeds, np.float64)["loss"]
    assert np.isclose(out["loss"], m + 0.3 * a) and np.isclose(test["loss"], m + 0.3 * a)
    assert "h2_W" in out and not np.allclose(out["h2_W"], feeds["h2_W"])


@pytest.mark.parametrize("text, message", [
    ("sigmoid_of(v) * v", "calls sigmoid_of, which deepdsl cannot compute"),
    ("gamma(v)", "calls gamma, which deepdsl cannot compute"),
    ("v +", "cannot read 'v \\+' as an expression in v"),
    ("w * v", r"unknown symbols \['w'\]"),
])
def test_a_user_function_deepdsl_cannot_compute_is_refused_where_it_is_defined(text, message):
    with pytest.raises(DeepDSLError, match=message) as raised:
        D.elementwise("act", text)
    assert raised.value.location.filename == __file__          # the line defining it


@pytest.mark.parametrize("text, message", [
    ("sigmoid_of(v)", "calls sigmoid_of in its derivative, which deepdsl cannot compute"),
    ("v +", "cannot read derivative 'v \\+' as an expression in v"),
    ("w * v", r"unknown symbols \['w'\] in its derivative"),
])
def test_a_derivative_deepdsl_cannot_compute_is_refused_where_it_is_given(text, message):
    with pytest.raises(DeepDSLError, match=message) as raised:
        D.elementwise("act", "v", derivative=text)
    assert raised.value.location.filename == __file__


def test_user_functions_get_their_stable_forms():
    """Written out or by name, the logistic function and softplus become Sigmoid and Softplus (no overflow), and the
    functions every backend computes (erf for the exact GELU, sign, Heaviside) pass."""
    from deepdsl.ops.elementwise import Sigmoid, Softplus
    x = D.Tensor(make("input", (), name="x", shape=(2, 3)))
    for text, cls in [("v * tanh(log(1 + exp(v)))", Softplus), ("v * tanh(softplus(v))", Softplus),
                      ("v / (1 + exp(-v))", Sigmoid), ("sigmoid(v)", Sigmoid)]:
        assert D.elementwise("act", text)(x).node.attr("expr").has(cls), text
    for text in ("v * (1 + erf(v / sqrt(2))) / 2", "sign(v) * v", "Heaviside(v) * v", "Abs(atan(v))"):
        assert D.elementwise("act", text)(x).node.op == "ew"


@pytest.mark.parametrize("layer, shape, message", [
    (lambda: D.adaptive_avg_pool((2, 3)), (2, 30), "adaptive average pooling needs a 4-D input"),
    (lambda: D.adaptive_max_pool(2), (2, 12), "adaptive max pooling needs a 4-D input"),
])
def test_pooling_that_does_not_fit_its_input_says_why(layer, shape, message):
    with pytest.raises(deepdsl.errors.ShapeError, match=message):
        layer()(D.Tensor(make("input", (), name="x", shape=shape)))


def test_adaptive_pooling_sizes_are_checked_where_defined():
    for bad in ((2, 0), (1, 2, 3), "2", 1.5):
        with pytest.raises(DeepDSLError, match="adaptive_avg_pool"):
            D.adaptive_avg_pool(bad)


def test_train_options_are_validated():
    with pytest.raises(DeepDSLError, match="optimizer"):
        D.Train("t", optimizer="rmsprop")
    with pytest.raises(DeepDSLError, match="lr"):
        D.Train("t", lr=0)
    x, y = _small_input()
    with pytest.raises(DeepDSLError, match="loss must be a scalar"):
        D.Loop(x, x, D.Train("t"))


def test_sequence_operations_check_their_shapes_where_written():
    """Attention's pieces: '@' needs (..., m, k) @ (..., k, n) with equal leading axes, `transpose` axes of the
    tensor, `D.param` positive sizes; each refused with the shapes at the user's line."""
    def tensor(shape, name="t"):
        return D.Tensor(make("input", (), name=name, shape=shape))
    q, k = tensor((2, 4, 3, 8), "q"), tensor((2, 4, 3, 8), "k")
    assert (q @ k.transpose(-1, -2)).shape == (2, 4, 3, 3)
    assert (q @ k.transpose(-1, -2) @ tensor((2, 4, 3, 8), "v")).shape == (2, 4, 3, 8)
    with pytest.raises(deepdsl.errors.ShapeError, match=r"'@' of tensors of shapes 2x4x3x8 and 2x4x3x8"):
        q @ k
    with pytest.raises(deepdsl.errors.ShapeError, match="same leading axes"):
        q @ tensor((2, 3, 8, 3), "w")
    with pytest.raises(deepdsl.errors.ShapeError, match="axis 4 is not an axis"):
        q.transpose(1, 4)
    assert D.full("tok", 5)(q.transpose(1, 2).reshape(2, 3, 32)).shape == (2, 3, 5)
    with pytest.raises(DeepDSLError, match="D.param 'pos'.*positive sizes"):
        D.param("pos", (1, 0, 4))
    assert D.softmax(q).shape == q.shape


def test_token_inputs_and_their_layers_check_where_written():
    tokens = D.tokens("tok", (2, 5), vocab=7)
    assert tokens.node.dtype == "int32" and tokens.shape == (2, 5)
    assert D.embedding("emb", 7, 4)(tokens).shape == (2, 5, 4)
    with pytest.raises(DeepDSLError, match=r"tokens 'bad'.*shape must be \(N, T\)"):
        D.tokens("bad", (2, 5, 1), vocab=7)
    with pytest.raises(deepdsl.errors.ShapeError, match="an embedding takes integer tokens"):
        D.embedding("emb2", 7, 4)(D.images("img", (2, 1, 4, 4)))
    scores = D.Tensor(make("input", (), name="s", shape=(2, 3, 5, 4)))
    with pytest.raises(deepdsl.errors.ShapeError, match=r"causal softmax needs \(\.\.\., T, T\)"):
        D.causal_softmax(scores)
    assert D.labels("next", (2, 5), classes=7).shape == (2, 5)


def test_mse_loss_needs_float_targets_of_the_output_shape():
    out = D.Tensor(make("input", (), name="out", shape=(2, 3)))
    assert D.mse_loss(D.targets("t", (2, 3)))(out).shape == ()
    with pytest.raises(deepdsl.errors.ShapeError, match="targets must be floats of the output's shape"):
        D.mse_loss(D.targets("t2", (2, 4)))(out)
    with pytest.raises(deepdsl.errors.ShapeError, match="int32 targets"):
        D.mse_loss(D.labels("lab", 2, classes=3))(out)


@pytest.mark.parametrize("kwargs, message", [
    ({"kernel": (1, 2, 3)}, r"kernel must be an int or a \(height, width\) pair"),
    ({"kernel": (3, 0)}, r"kernel\[1\] must be"),
    ({"kernel": 3, "stride": (2, 0)}, r"stride\[1\] must be"),
    ({"kernel": 3, "dilation": 0}, "dilation must be"),
])
def test_convolution_sizes_are_checked_where_the_layer_is_defined(kwargs, message):
    with pytest.raises(DeepDSLError, match=message) as raised:
        D.conv("cv", channels=4, **kwargs)
    assert raised.value.location.filename == __file__


def test_tensor_ranges_are_checked_where_written():
    t = D.Tensor(make("input", (), name="t", shape=(2, 8, 4, 4)))
    assert t[:, 4:8].shape == (2, 4, 4, 4) and t[..., 1:].shape == (2, 8, 4, 3) and t[:, -2:].shape == (2, 2, 4, 4)
    for bad, message in ((lambda: t[:, 0], "takes ranges"), (lambda: t[:, ::2], "without steps"),
                         (lambda: t[:, 5:5], "non-empty"), (lambda: t[:, :, :, :, :], "index of 5 axes")):
        with pytest.raises(deepdsl.errors.ShapeError, match=message) as raised:
            bad()
        assert raised.value.location.filename == __file__


@pytest.mark.parametrize("make_bad,fragment", [
    (lambda t: t.permute(0, 1), "permute(0, 1) of a tensor of 2x3x4: give each of its 3 axes once"),
    (lambda t: t.permute(0, 0, 1), "give each of its 3 axes once"),
    (lambda t: t.expand(2, 3, 8), "only axes of size 1 grow"),
    (lambda t: t.expand(2, 3), "give a size (or -1) for each axis"),
    (lambda t: D.attention(t, t, D.param("v", (2, 4, 4))), "needs (..., T, d), (..., S, d) and (..., S, e)"),
    (lambda t: D.attention(t, D.param("k", (2, 5, 4)), D.param("v", (2, 5, 4)), causal=True),
     "as many queries as keys"),
], ids=["permute-rank", "permute-repeat", "expand-size", "expand-rank", "attention-shapes", "attention-causal"])
def test_permute_expand_and_attention_refuse_bad_shapes_in_one_line(make_bad, fragment):
    with pytest.raises(ShapeError) as err:
        make_bad(D.param("t", (2, 3, 4)))
    assert fragment in str(err.value)
