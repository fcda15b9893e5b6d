"""The documentation shows what the code does: every line of the worked example in docs/dsl.md is a line of
`deepdsl ir networks/lenet.py --step train`, in order (`...` stands for left-out lines or, inside a line, for
left-out text); docs/ir.md lists the pipeline's stages in their order, and its hook example runs; so does the
Python API example of docs/dsl.md; docs/porting.md quotes the line `deepdsl memory` prints."""
from __future__ import annotations

import re
from pathlib import Path

import deepdsl

ROOT = Path(__file__).resolve().parents[1]


def code_block(markdown: str, heading: str) -> list[str]:
    """The lines of the first fenced code block after `heading`."""
    section = markdown[markdown.index(heading):]
    match = re.search(r"```\w*\n(.*?)```", section, re.S)
    assert match, f"no code block after {heading!r}"
    return match.group(1).splitlines()


def matches(excerpt: str, line: str) -> bool:
    if "..." not in excerpt:
        return excerpt == line
    pattern = ".*".join(re.escape(part) for part in excerpt.split("..."))
    return re.fullmatch(pattern, line) is not None


def assert_excerpt(excerpt: list[str], output: list[str]) -> None:
    position = 0
    for wanted in excerpt:
        if wanted.strip() == "...":
            continue
        for k in range(position, len(output)):
            if matches(wanted, output[k]):
                position = k + 1
                break
        else:
            raise AssertionError(f"documented line not in the output (or out of order):\n{wanted}\n"
                                 "update the excerpt from the command's current output")


def test_worked_example_in_the_dsl_guide_is_current_output():
    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / "lenet.py")))
    excerpt = code_block((ROOT / "docs" / "dsl.md").read_text(), "## Worked example")
    assert len([line for line in excerpt if line.strip() != "..."]) >= 10
    assert_excerpt(excerpt, compiled.train.text().splitlines())


def test_excerpt_check_rejects_what_is_not_output():
    output = ["program p(x: 2)", "  X1 = exp(x)  # 2", "  return y=X1"]
    assert_excerpt(["program p(...)", "...", "  return y=X1"], output)
    for wrong in (["  X1 = log(x)  # 2"], ["  return y=X1", "  X1 = exp(x)  # 2"], ["program q(...)"]):
        try:
            assert_excerpt(wrong, output)
        except AssertionError:
            continue
        raise AssertionError(f"accepted {wrong}")


def test_pipeline_table_in_the_ir_guide_lists_the_stages_in_order():
    from deepdsl.pipeline import STAGES

    text = (ROOT / "docs" / "ir.md").read_text()
    documented = re.findall(r"^\| `(\w+)` \|", text, re.M)
    assert documented == ["autodiff"] + [stage.name for stage in STAGES]


def test_hook_example_in_the_ir_guide_dumps_every_stage(capsys):
    text = (ROOT / "docs" / "ir.md").read_text()
    example = code_block(text, "## Dumping after each stage")
    exec(compile("\n".join(example), "docs/ir.md", "exec"), {"__name__": "docs_example"})
    stages = re.findall(r"^== after (\S+?):?(?: |$)", capsys.readouterr().out, re.M)
    assert stages[0] == "lenet_train:autodiff" and stages[-1] == "lenet_predict:plan_memory"
    for step in ("setup", "train", "test", "predict"):
        for stage in ("linearize", "sink", "schedule", "inplace", "dealloc", "plan_memory"):
            assert f"lenet_{step}:{stage}" in stages


def test_subnet_examples_build_the_shapes_they_promise():
    """The subnets docs/dsl.md shows under "Subnets and branches" run as written and give the shapes a network
    built from them needs."""
    from deepdsl import dsl as D

    markdown = (ROOT / "docs" / "dsl.md").read_text()
    section = markdown[markdown.index("## Subnets and branches"):markdown.index("## Worked example")]
    names: dict = {"D": D}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        exec(compile(block, "docs/dsl.md", "exec"), names)
    maps = D.images("x", (2, 8, 6, 6))
    assert names["inception"](3, 4, 2, 4, 2, 4, 4)(maps).shape == (2, 16, 6, 6)
    assert names["residual"]("res", 8)(maps).shape == (2, 8, 6, 6)
    assert names["squeeze_excite"]("se", 8)(maps).shape == (2, 8, 6, 6)
    assert names["inverted_residual"]("block", 8, 6, 8, 1)(maps).shape == (2, 8, 6, 6)
    assert names["inverted_residual"]("down", 8, 6, 16, 2)(maps).shape == (2, 16, 3, 3)
    tokens = D.param("tokens", (2, 5, 16))
    assert names["attention"]("attn", tokens).shape == (2, 5, 16)
    text = D.tokens("text", (2, 64), vocab=256)
    assert names["language_model"](text).shape == (2, 64, 256)
    deeper = D.images("deep", (2, 16, 3, 3))
    assert names["up_level"]("up", maps, deeper, 4).shape == (2, 12, 6, 6)


def test_python_api_example_in_the_dsl_guide_runs(capsys):
    """docs/dsl.md's Python API example runs as written: it compiles LeNet and runs a training step on the
    reference interpreter (every name it uses is defined in it)."""
    import numpy as np

    example = code_block((ROOT / "docs" / "dsl.md").read_text(), "## Python API")
    names: dict = {"__name__": "docs_example"}
    exec(compile("\n".join(example), "docs/dsl.md", "exec"), names)
    outputs = names["outputs"]
    assert np.isfinite(outputs["loss"]) and outputs["cv1_W"].shape == (20, 1, 5, 5)
    assert capsys.readouterr().out.strip()


def test_porting_guide_says_what_deepdsl_memory_prints_of_the_parameters():
    """docs/porting.md's check of the parameters against PyTorch's count reads the line `deepdsl memory` prints:
    its example figure is LeNet's, 4 bytes a parameter."""
    import math
    import subprocess
    import sys

    from deepdsl.codegen import program_env

    text = (ROOT / "docs" / "porting.md").read_text()
    match = re.search(r"`deepdsl memory net.py` prints the parameters' size in MB \(`(parameters: +[\d.]+ MB)` for "
                      r"LeNet", text)
    assert match, "docs/porting.md no longer says which line of `deepdsl memory` to compare"
    done = subprocess.run([sys.executable, "-m", "deepdsl", "memory", "networks/lenet.py"], capture_output=True,
                          text=True, cwd=str(ROOT), env=program_env(), timeout=300)
    assert match.group(1) in [" ".join(line.split()) for line in done.stdout.splitlines()], done.stdout[-2000:]
    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / "lenet.py")))
    count = sum(math.prod(p.shape) for p in compiled.params)
    assert float(match.group(1).split()[1]) == 4 * count / 1e6
