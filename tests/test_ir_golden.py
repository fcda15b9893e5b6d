"""Golden IR text of LeNet (full batch 500), compared exactly with tests/golden/*.txt:

- lenet_train_unoptimized.txt: the training step as linearized from the differentiated graph, every optimization
  off;
- lenet_train.txt: the setup program and the training step after the optimization passes (simplify, CSE,
  fusion, hoisting, sinking);
- lenet_test.txt: the test step after the same passes.

The programs are taken, through the pipeline's hook, where the optimization passes hand them to the memory stages
(scheduling, in-place computation and frees are tested with those stages). A change to a pass or to the printer
shows up here as a diff: review it, then accept it with `pytest tests/test_ir_golden.py --update-golden`.
"""
from __future__ import annotations

import pathlib

import pytest

import deepdsl

LENET = str(pathlib.Path(__file__).resolve().parents[1] / "networks" / "lenet.py")
UNOPTIMIZED = deepdsl.CompileOptions(simplify=False, fuse=False, cse=False, code_motion=False, verify=True)


def optimized_programs(options: deepdsl.CompileOptions) -> dict:
    """program name -> the program after the last optimization stage that ran on it."""
    last_stage = "sink" if options.code_motion else "linearize"
    programs = {}

    def hook(stage: str, value) -> None:
        name, _, step = stage.rpartition(":")
        if step == last_stage:
            programs[name] = value

    deepdsl.compile(deepdsl.load(LENET), options, hook=hook)
    return programs


@pytest.fixture(scope="module")
def optimized():
    return optimized_programs(deepdsl.CompileOptions(verify=True))


def test_lenet_train_unoptimized(golden):
    programs = optimized_programs(UNOPTIMIZED)
    assert not programs["lenet_setup"].body
    golden("lenet_train_unoptimized.txt", programs["lenet_train"].text())


def test_lenet_train(golden, optimized):
    golden("lenet_train.txt", optimized["lenet_setup"].text() + "\n" + optimized["lenet_train"].text())


def test_lenet_test(golden, optimized):
    golden("lenet_test.txt", optimized["lenet_test"].text())
