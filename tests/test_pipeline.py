"""The pipeline's stage records: every stage is switched by the option its record names (a name that is no stage or
no option is an error), and the what-if figures of the memory table are those of a compile with those options."""
from __future__ import annotations

import pathlib

import pytest

import deepdsl
from deepdsl import pipeline
from deepdsl.dsl import Overrides
from deepdsl.memory_table import WHAT_IF, memory_report, what_if
from deepdsl.pipeline import STAGES, CompileOptions, Stage

LENET = pathlib.Path(__file__).resolve().parents[1] / "networks" / "lenet.py"


def lenet_loop():
    return deepdsl.load(LENET, Overrides(batch=8))


def stages_run(options: CompileOptions) -> set[str]:
    seen = set()
    deepdsl.compile(lenet_loop(), options, hook=lambda stage, value: seen.add(stage.rpartition(":")[2]))
    return seen


def test_a_misspelt_stage_or_option_is_an_error():
    with pytest.raises(ValueError, match="no stage named 'shedule'"):
        pipeline.stage_named("shedule")
    with pytest.raises(ValueError, match="no stage named 'shedule'"):
        CompileOptions().without("schedule", "shedule")
    with pytest.raises(ValueError, match="'linearize' always runs"):
        CompileOptions().without("linearize")
    with pytest.raises(ValueError, match="no compile option named 'shedule'"):
        CompileOptions().changed(shedule=False)
    with pytest.raises(ValueError, match="'shedule', which is no bool field"):
        Stage("schedule", lambda program: program, "shedule")
    with pytest.raises(ValueError, match="'workspace_limit', which is no bool field"):
        Stage("plan_memory", lambda program: program, "workspace_limit")
    program = deepdsl.compile(lenet_loop()).steps["train"].unplanned
    with pytest.raises(ValueError, match="no compile option named 'free'"):
        what_if(program, variants={"without freeing": {"free": False}})


def test_each_stage_runs_exactly_when_its_option_is_on():
    everything = stages_run(CompileOptions())
    assert everything == {"autodiff"} | {stage.name for stage in STAGES}
    switched = [stage.name for stage in STAGES if stage.option is not None]
    assert stages_run(CompileOptions().without(*switched)) == everything - set(switched)
    for name in ("schedule", "dealloc"):
        assert stages_run(CompileOptions().without(name)) == everything - {name}


def test_what_if_figures_equal_a_compile_with_those_options():
    loop = lenet_loop()
    options = CompileOptions(workspace_limit=1_000_000)
    report = memory_report(deepdsl.compile(loop, options))
    assert list(report.what_if) == list(WHAT_IF)
    for label, changes in WHAT_IF.items():
        compiled = deepdsl.compile(loop, options.changed(**changes))
        assert report.what_if[label] == compiled.steps["train"].plan.peak_live_bytes, label
