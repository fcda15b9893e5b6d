"""What a first-time user meets, through the real command lines: the programs' help says what their options do for
the network at hand (a language model's data specs, AdamW's decoupled decay, the device), options that make no
sense for the network are refused in one line, the end of a run names its metric and counts its batches, a run on
the synthetic default says so, and `deepdsl run -- --help` prints the program's help without writing or building
anything."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.support.program_helpers import ROOT, compile_program, program_env, run_cli

GENERATED = ROOT / "generated"

AUTOENCODER = '''\
from deepdsl import dsl as D

x = D.images("x", (4, 1, 8, 8), dataset="digits")
y = D.targets("y", (4, 1, 8, 8))
network = D.conv("c2", kernel=3, channels=1, padding=1) @ D.relu @ D.conv("c1", kernel=3, channels=4, padding=1)
loss = D.mse_loss(y)(network(x))
error = D.elementwise("absolute", "Abs(v)")(network(x) - y).mean()
loop = D.Loop(loss, error, D.Train("autoencoder", iters=2, test_iters=1, lr=0.01, momentum=0.9))
'''

NO_DATASET = '''\
from deepdsl import dsl as D

x = D.images("x", (4, 1, 8, 8))
y = D.labels("y", 4, classes=10)
network = D.full("fc", 10) @ D.flatten
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("plain", iters=2, test_iters=1, lr=0.01, momentum=0.9))
'''


def deepdsl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepdsl", *args], capture_output=True, text=True, cwd=str(cwd),
                          env=program_env(), timeout=300)


def option_help(help_text: str, option: str) -> str:
    """The help of one option in argparse's output (its lines up to the next option), spaces normalized."""
    lines = help_text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.strip().startswith(option))
    end = next((k for k in range(start + 1, len(lines)) if lines[k].strip().startswith("-")), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def test_the_language_model_s_help_describes_its_data_decay_and_augmentation():
    done = run_cli(GENERATED / "char_lm.py", "--help")
    assert done.returncode == 0, done.stderr
    data = option_help(done.stdout, "--data")
    assert "text:PATH" in data and "last tenth is the test set" in data and "mnist" not in data, data
    decay = option_help(done.stdout, "--decay")
    assert "decoupled weight decay" in decay and "added to the gradient" not in decay, decay
    assert "takes tokens" in option_help(done.stdout, "--augment")
    # an SGD program's decay is L2 added to the gradient
    assert "added to the gradient" in option_help(run_cli(GENERATED / "lenet.py", "--help").stdout, "--decay")


def test_every_program_option_has_help():
    done = run_cli(GENERATED / "lenet.py", "--help")
    device = option_help(done.stdout, "--device")
    assert "cuda" in device and "GPU" in device, device


def test_augmentation_of_a_language_model_is_refused_in_one_line(tmp_path):
    done = run_cli(GENERATED / "char_lm.py", "--augment", "flip", "--iters", "1", "--kernels", "numpy",
                   "--params", str(tmp_path / "p.npz"), cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("char_lm: error: --augment flip: augmentation crops and mirrors images"), done.stderr
    assert list(tmp_path.iterdir()) == []


def _train_network(tmp_path, name: str, text: str):
    """(the program of network file `text`, its run of two iterations and one test batch on numpy's kernels)."""
    (tmp_path / f"{name}.py").write_text(text)
    _, program = compile_program(tmp_path / f"{name}.py", tmp_path / "out")
    done = run_cli(program, "--iters", "2", "--test-iters", "1", "--kernels", "numpy", "--params",
                   str(tmp_path / "p.npz"))
    assert done.returncode == 0, done.stderr
    return program, done


def test_a_network_of_float_targets_reports_its_metric_not_an_accuracy(tmp_path):
    _, done = _train_network(tmp_path, "autoencoder", AUTOENCODER)
    assert "test accuracy" not in done.stdout, done.stdout
    assert "test metric (the Loop's second value) " in done.stdout and "(4 examples in 1 batch of 4)" in done.stdout, done.stdout


def test_a_run_on_the_synthetic_default_says_so(tmp_path):
    program, done = _train_network(tmp_path, "plain", NO_DATASET)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("training plain on synthetic"), done.stdout      # the run's first line stays first
    assert lines[1] == "warning: training on synthetic data (the default of a network file without dataset=): 8 " \
                       "random examples with nothing to learn; --data SPEC chooses real data", done.stdout
    chosen = run_cli(program, "--iters", "2", "--test-iters", "1", "--kernels", "numpy", "--data", "synthetic",
                     "--params", str(tmp_path / "q.npz"))
    assert chosen.returncode == 0 and "warning" not in chosen.stdout, chosen.stdout


def test_run_prints_the_program_s_help_without_writing_or_building_anything(tmp_path):
    network = tmp_path / "lenet.py"
    network.write_text((ROOT / "networks" / "lenet.py").read_text())
    began = time.monotonic()
    done = deepdsl("run", "lenet.py", "--", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: lenet.py [-h] [--iters N]"), done.stdout[:300]
    assert "--data-parallel" in done.stdout and "wrote" not in done.stdout and "running it" not in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lenet.py"]         # no .deepdsl/, no library
    assert time.monotonic() - began < 120


def test_the_compiler_s_step_option_has_help(tmp_path):
    for command, words in (("ir", "which step's program to print"), ("graph", "the step whose graph"),
                           ("memory", "the step whose memory table")):
        done = deepdsl(command, "--help", cwd=tmp_path)
        assert words in option_help(done.stdout, "--step"), (command, done.stdout)
