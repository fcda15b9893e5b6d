"""Faults in what a careless user hands `deepdsl` and its programs, through their real command lines: data files
whose labels or arrays would be misread, checkpoints and weights files with impossible fields, sizes and counts no
machine holds. Each is refused before anything is trained or allocated, as one line on standard error naming the
file, array, field, option or layer, with exit status 1 and no traceback; none is trained on as something else
(labels cast to valid ones, test accuracy measured on the training arrays)."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.program_helpers import ROOT, compile_program, program_env, run_cli

TINY = """\
from deepdsl import dsl as D

x = D.images("x", (4, 1, 8, 8), dataset="synthetic")
y = D.labels("y", 4, classes=3)
network = D.full("fc", 3) @ D.flatten
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("tiny", iters=2, test_iters=1, lr=0.1))
"""

TOKENS = """\
from deepdsl import dsl as D

x = D.tokens("x", (2, 4), vocab=256)
y = D.labels("y", (2, 4), classes=256)
network = D.full("out", 256) @ D.embedding("emb", 256, 4)
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("lm", iters=2, test_iters=1, lr=0.1))
"""

CONV = """\
from deepdsl import dsl as D

x = D.images("x", (4, 1, 8, 8), dataset="synthetic")
y = D.labels("y", 4, classes=3)
cv1 = D.conv("cv1", kernel=3, channels={channels})
network = D.full("fc", 3) @ D.flatten @ D.relu @ cv1
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("big", iters=2, test_iters=1, lr=0.1))
"""


def one_line(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 1, exactly one line on standard error and no traceback; the line holds every fragment."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def deepdsl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = program_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "deepdsl", *args], capture_output=True, text=True, cwd=str(cwd),
                          env=env, timeout=300)


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    (directory / "tiny_net.py").write_text(TINY)
    return compile_program(directory / "tiny_net.py", directory)[1]


def train(program, *args: str) -> subprocess.CompletedProcess:
    return run_cli(program, "--iters", "1", "--test-iters", "1", "--quiet", *args, timeout=120)


# ----------------------------------------------------------------------------------------------------------------
# data

IMAGES = np.random.default_rng(0).random((8, 8, 8), dtype=np.float32)


def test_npz_labels_beyond_int32_are_refused_not_wrapped(tiny, tmp_path):
    """2^32 + 1 would become 1 as int32, a valid label of 3 classes: the range is checked before the cast."""
    path = tmp_path / "d.npz"
    np.savez(path, x=IMAGES, y=np.array([0, 1, 2, 2 ** 32 + 1, 0, 1, 2, 0], np.int64))
    one_line(train(tiny, "--data", f"npz:{path}", "--params", ""), str(path), "'y'", str(2 ** 32 + 1),
             "3 classes")


@pytest.mark.parametrize("arrays, missing", [(("x", "y", "x_test"), "y_test"), (("x", "y", "y_test"), "x_test"),
                                             (("x_train", "x_test", "y_test"), "y_train")])
def test_an_npz_array_without_its_partner_is_refused(tiny, tmp_path, arrays, missing):
    """Never measured on the training arrays (x_test without y_test), nor silently left out (y_test alone)."""
    path = tmp_path / "d.npz"
    np.savez(path, **{name: IMAGES if name.startswith("x") else np.zeros(8, np.int64) for name in arrays})
    line = one_line(train(tiny, "--data", f"npz:{path}", "--params", ""), str(path), f"'{missing}'")
    assert f"no array '{missing}'" in line, line


def test_npz_arrays_as_keras_names_them_train_and_test_apart(tiny, tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=IMAGES, y_train=np.zeros(8, np.int64), x_test=IMAGES[:4], y_test=np.ones(4, np.int64))
    done = train(tiny, "--data", f"npz:{path}", "--params", "", "--report-json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["data"] == f"npz:{path}" and report["test_accuracy"] is not None


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm")
    (directory / "lm_net.py").write_text(TOKENS)
    return compile_program(directory / "lm_net.py", directory)[1]


def test_text_from_a_truncated_gzip_is_one_line(tokens, tmp_path):
    packed = gzip.compress(bytes(range(60)) * 20)
    path = tmp_path / "t.txt.gz"
    path.write_bytes(packed[:len(packed) // 2])
    one_line(train(tokens, "--data", f"text:{path}", "--params", ""), str(path), "cannot read")


# ----------------------------------------------------------------------------------------------------------------
# checkpoints and weights

@pytest.fixture
def checkpoint(tiny, tmp_path):
    path = tmp_path / "p.npz"
    done = run_cli(tiny, "--iters", "2", "--test-iters", "0", "--quiet", "--data", "synthetic", "--params", str(path))
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.parametrize("field, value", [("__iteration__", np.int64(-5)), ("__seed__", np.int64(-1)),
                                          ("__seed__", np.uint64(2 ** 64 - 1)), ("__data_epoch__", np.int64(-1)),
                                          ("__batches__", np.int64(-2)), ("__ranks__", np.int64(0)),
                                          ("__global_batch__", np.int64(0))])
def test_a_checkpoint_field_out_of_range_is_one_line(tiny, checkpoint, field, value):
    entries = dict(np.load(checkpoint))
    entries[field] = np.array(value)
    np.savez(checkpoint, **entries)
    before = digest(checkpoint)
    one_line(train(tiny, "--iters", "4", "--params", str(checkpoint)), str(checkpoint), f"'{field}'", str(value))
    assert digest(checkpoint) == before


def _safetensors(path: Path, shape, offsets=(0, 0)) -> None:
    header = json.dumps({"fc_W": {"dtype": "F32", "shape": shape, "data_offsets": list(offsets)}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("shape", [[2 ** 70], [2 ** 32, 2 ** 32], [3, -1]], ids=["2^70", "2^32x2^32", "negative"])
def test_a_safetensors_shape_beyond_its_bytes_is_one_line(tiny, tmp_path, shape):
    """Checked in exact integers against the bytes the file holds before anything is allocated: [2^32, 2^32] has
    0 elements in int64."""
    path = tmp_path / "w.safetensors"
    _safetensors(path, shape)
    one_line(train(tiny, "--init-from", str(path), "--fresh", "--params", str(tmp_path / "p.npz")), str(path),
             "'fc_W'")
    assert not (tmp_path / "p.npz").exists()


# ----------------------------------------------------------------------------------------------------------------
# sizes and counts beyond any machine

HUGE = "1" * 401


@pytest.mark.parametrize("option, command", [("--memory-budget", "compile"), ("--workspace-limit", "compile"),
                                             ("--fit", "memory")])
def test_a_byte_option_beyond_any_machine_is_one_line(tmp_path, option, command):
    (tmp_path / "tiny_net.py").write_text(TINY)
    extra = ("-o", "out/t.py") if command == "compile" else ()
    line = one_line(deepdsl(command, "tiny_net.py", option, HUGE, *extra, cwd=tmp_path), option, "2^48")
    assert line.startswith("deepdsl: error: "), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, value, fragment", [
    ("--gemm-device-memory", "1e999", "--gemm-device-memory"), ("--gemm-device-memory", "1e20", "2^48"),
    ("--threads", "99999999999", "--threads"), ("--threads", "1025", "[1, 1024]"),
    ("--augment", "crop:100000", "--augment crop:100000"), ("--augment", "crop:9,flip", "at most crop:8"),
    ("--warmup", HUGE, "401 digits"), ("--iters", str(2 ** 63), "2^63"), ("--gemm-devices", "99999999999", "1024")])
def test_a_program_option_beyond_any_machine_is_one_line(tiny, option, value, fragment):
    one_line(train(tiny, "--data", "synthetic", "--params", "", option, value), option, fragment)


def test_the_largest_crop_is_still_taken(tiny):
    done = train(tiny, "--data", "synthetic", "--params", "", "--augment", "crop:8,flip", "--threads", "1")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("channels, fragment", [("10**12", "4x1000000000000x6x6"), ("2**64", "18446744073709551616"),
                                                ("244140625000", "memory plan")])
def test_a_layer_beyond_any_machine_is_refused_naming_it(tmp_path, channels, fragment):
    """A value (the output of 10**12 channels, weights of 2**64) or the whole plan of one step (values of 2^47 bytes
    each, more than 2^48 together) beyond 2^48 bytes: refused while compiling, naming the layer."""
    (tmp_path / "big_net.py").write_text(CONV.format(channels=channels))
    line = one_line(deepdsl("compile", "big_net.py", "-o", "out/big.py", cwd=tmp_path), "'cv1'", "2^48", fragment)
    assert line.startswith("deepdsl: error: "), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, name", [("zoo*v", "zoo"), ("I * v", "I"), ("v / 0", "zoo")])
def test_an_elementwise_name_deepdsl_does_not_know_is_one_line(tmp_path, text, name):
    """Names sympy would read as its own constants (`zoo`: complex infinity, `I`: the imaginary unit) are the user's
    unknown ones; an expression holding such values (v / 0) is refused too."""
    net = TINY.replace('network = D.full("fc", 3) @ D.flatten',
                       f'network = D.full("fc", 3) @ D.flatten @ D.elementwise("f", {text!r})')
    (tmp_path / "ew_net.py").write_text(net)
    line = one_line(deepdsl("compile", "ew_net.py", "-o", "out/ew.py", cwd=tmp_path), "'f'", repr(text), name)
    assert line.startswith("deepdsl: error: ew_net.py:5: "), line
