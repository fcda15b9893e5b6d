"""Faults in network files, as `deepdsl` reports them: a bad layer, input, initializer or solver argument, a shape
no layer can produce, two tensors of one name, a name the generated program cannot use, a network file that calls
`sys.exit` and a directory given as the network are each one line naming the network file's line and what is wrong,
with exit status 1 and no program written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepdsl.cli import main

ROOT = Path(__file__).resolve().parents[1]

NET = """\
from deepdsl import dsl as D

x = D.images("x", (4, 1, 8, 8))
y = D.labels("y", 4, classes=3)
cv1 = D.conv("cv1", kernel=3, channels=2)
pool = D.max_pool(2)
fc = D.full("fc", 3)
network = fc @ D.flatten @ pool @ D.relu @ cv1
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
solver = D.Train("tiny", iters=2, test_iters=1, lr=0.1)
loop = D.Loop(loss, accuracy, solver)
"""


def network(tmp_path: Path, variable: str, line: str) -> tuple[Path, int]:
    """NET with the line defining `variable` replaced by `line`, and that line's number."""
    lines = NET.splitlines()
    number = next(i for i, text in enumerate(lines, 1) if text.startswith(f"{variable} = "))
    lines[number - 1] = line
    path = tmp_path / "net.py"
    path.write_text("\n".join(lines) + "\n")
    return path, number


def assert_one_line_error(status: int, stderr: str, *fragments: str) -> None:
    """Exit status 1 and exactly one line on standard error, `deepdsl: error: ...`, holding every fragment."""
    lines = stderr.strip().splitlines()
    assert status == 1, stderr
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("deepdsl: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_nothing_written(tmp_path: Path) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.py"]


CASES = [
    # layer arguments
    ("cv1", 'cv1 = D.conv("cv1", kernel=3, channels=0)', "layer 'cv1': channels must be a positive integer, got 0"),
    ("cv1", 'cv1 = D.conv("cv1", kernel=0, channels=2)', "layer 'cv1': kernel must be a positive integer, got 0"),
    ("cv1", 'cv1 = D.conv("cv1", kernel=3, channels=2, stride=0)', "layer 'cv1': stride must be a positive integer"),
    ("cv1", 'cv1 = D.conv("cv1", kernel=3, channels=2, padding=-1)', "layer 'cv1': padding must be a non-negative"),
    ("cv1", 'cv1 = D.conv("cv1", kernel=3, channels=True)',
     "layer 'cv1': channels must be a positive integer, got True"),
    ("cv1", 'cv1 = D.conv("cv1", kernel=3, channels=2, weight=D.gaussian(0))', "D.gaussian: std must be a positive"),
    ("pool", "pool = D.max_pool(2.0)", "layer 'max_pool': kernel must be a positive integer, got 2.0"),
    ("pool", "pool = D.max_pool(3, padding=2)", "layer 'max_pool': padding 2 exceeds half the kernel 3"),
    ("pool", "pool = D.avg_pool(2, stride=0)", "layer 'avg_pool': stride must be a positive integer, got 0"),
    ("pool", "pool = D.lrn(size=0)", "layer 'lrn': size must be a positive integer, got 0"),
    ("pool", "pool = D.dropout(1.0)", "layer 'dropout': ratio must be a number in [0, 1), got 1.0"),
    ("pool", 'pool = D.batch_norm("bn", momentum=1.5)', "layer 'bn': momentum must be a number in [0, 1], got 1.5"),
    ("pool", "pool = D.clipped_relu(float('nan'))", "layer 'clipped_relu': ceiling must be a positive finite number"),
    ("fc", 'fc = D.full("fc", 0)', "layer 'fc': out must be a positive integer, got 0"),
    # inputs
    ("x", 'x = D.images("x", (0, 1, 8, 8))', "images 'x': batch must be a positive integer, got 0"),
    ("x", 'x = D.images("x", (-4, 1, 8, 8))', "images 'x': batch must be a positive integer, got -4"),
    ("x", 'x = D.images("x", (4, 1, 8))', "images 'x': shape must be (N, C, H, W)"),
    ("y", 'y = D.labels("y", 4, classes=0)', "labels 'y': classes must be a positive integer, got 0"),
    # the solver and the loop (dataclasses: their checks run in the __init__ that `dataclass` writes)
    ("solver", 'solver = D.Train("tiny", iters=-1)', "Train 'tiny': iters must be a non-negative integer, got -1"),
    ("solver", 'solver = D.Train("tiny", iters=2.5)', "Train 'tiny': iters must be a non-negative integer, got 2.5"),
    ("solver", "solver = D.Train('tiny', lr=float('nan'))",
     "Train 'tiny': lr must be a positive finite number, got nan"),
    ("solver", 'solver = D.Train("tiny", momentum=-0.5)', "Train 'tiny': momentum must be a number in [0, 1)"),
    ("solver", 'solver = D.Adam("tiny", betas=(0.9, 1.0))', "Train 'tiny': betas[1] must be a number in [0, 1)"),
    ("loop", "loop = D.Loop(x, accuracy, solver)", "Loop: loss must be a scalar tensor, got 4x1x8x8"),
    ("loss", 'loss = (D.cross_entropy(y) @ network)(x) * float("inf")',
     "'*' of a tensor and a number: the number must be a finite number, got inf"),
    # names the generated program cannot use, and two tensors of one name
    ("solver", 'solver = D.Train("tiny\\n", iters=2)', "D.Train: name must be ASCII letters, digits and underscores"),
    ("solver", 'solver = D.Train("runs/tiny", iters=2)', "D.Train: name must be ASCII letters, digits and underscores"),
    ("cv1", 'cv1 = D.conv("cv\\n1", kernel=3, channels=2)',
     "D.conv: name must be ASCII letters, digits and underscores, got 'cv\\n1'"),
    ("x", 'x = D.images("lr", (4, 1, 8, 8))', "images 'lr': name 'lr' is taken by the generated step functions"),
    ("y", 'y = D.labels("class", 4, classes=3)', "labels 'class': name 'class' is a Python keyword"),
    ("fc", 'fc = D.full("cv1", 3)', "layer 'cv1': parameter 'cv1_"),
]


@pytest.mark.parametrize("variable,line,fragment", CASES, ids=[line.split(" = ", 1)[1] for _, line, _ in CASES])
def test_a_fault_is_one_line_at_its_network_file_line(tmp_path, capsys, variable, line, fragment):
    path, number = network(tmp_path, variable, line)
    status = main(["compile", str(path), "-o", str(tmp_path / "out.py")])
    assert_one_line_error(status, capsys.readouterr().err, f"net.py:{number}: {fragment}")
    assert_nothing_written(tmp_path)


def test_negative_channels_are_rejected_before_the_ir_is_printed(tmp_path, capsys):
    path, number = network(tmp_path, "cv1", 'cv1 = D.conv("cv1", kernel=3, channels=-2)')
    status = main(["ir", str(path)])
    captured = capsys.readouterr()
    assert_one_line_error(status, captured.err, f"net.py:{number}: layer 'cv1': channels must be a positive integer")
    assert captured.out == ""


def deepdsl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "deepdsl", *args], capture_output=True, text=True, cwd=str(cwd),
                          env=env, timeout=120)


@pytest.mark.parametrize("code", ["0", "3", "'done'"])
def test_a_network_file_calling_sys_exit_is_an_error(tmp_path, code):
    path, number = network(tmp_path, "loop", f"import sys; sys.exit({code})")
    done = deepdsl("compile", str(path), "-o", str(tmp_path / "out.py"), cwd=tmp_path)
    assert_one_line_error(done.returncode, done.stderr, f"net.py:{number}: ", f"called sys.exit({code})")
    assert_nothing_written(tmp_path)


def test_a_layer_fault_in_a_separate_process(tmp_path):
    path, number = network(tmp_path, "pool", "pool = D.max_pool(2.0)")
    done = deepdsl("compile", str(path), "-o", str(tmp_path / "out.py"), cwd=tmp_path)
    assert_one_line_error(done.returncode, done.stderr, f"net.py:{number}: layer 'max_pool': kernel must be")
    assert_nothing_written(tmp_path)


def test_a_directory_is_not_a_network_file(tmp_path):
    (tmp_path / "net.py").mkdir()
    done = deepdsl("compile", "net.py", "-o", "out.py", cwd=tmp_path)
    assert_one_line_error(done.returncode, done.stderr, "net.py: is a directory, not a network file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.py"]


def test_a_layer_named_like_an_optimizer_buffer_is_an_error(tmp_path, capsys):
    """`V_fc` beside `fc`: the parameter `V_fc_W` and the momentum of `fc_W` would share one name."""
    path, _ = network(tmp_path, "fc", 'fc = D.full("V_cv1", 3)')
    status = main(["compile", str(path), "-o", str(tmp_path / "out.py")])
    assert_one_line_error(status, capsys.readouterr().err, "two tensors of the training step are named 'V_cv1_W'",
                          "rename the layer")
    assert_nothing_written(tmp_path)
