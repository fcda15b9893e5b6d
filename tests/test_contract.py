"""The compiler-runtime contract (`deepdsl_runtime.contract`) is one module both sides import: the compiler's and
the runtime's names for each rule are the contract's own functions, no other module of either side writes a rule of
its own, the runtime never imports the compiler, and the runtime is imported by its name everywhere."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import deepdsl.memory_plan
import deepdsl.ops.conv
import deepdsl.ops.norm
import deepdsl.ops.pool
import deepdsl.passes.schedule
import deepdsl_runtime.cpu
import deepdsl_runtime.cuda.ops
import deepdsl_runtime.memory
import deepdsl_runtime.memory.first_fit
from deepdsl.codegen import program_env
from deepdsl.ops import get_op
from deepdsl_runtime import contract

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "runtime" / "contract.py"


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("name, value", [
    ("memory_plan.placed_size", deepdsl.memory_plan.placed_size),
    ("runtime memory.placed_size", deepdsl_runtime.memory.placed_size),
    ("ops.conv.out_size", deepdsl.ops.conv.out_size),
    ("ops.pool.out_size", deepdsl.ops.pool.out_size),
    ("cpu.out_size", deepdsl_runtime.cpu.out_size),
    ("cuda.ops.out_size", deepdsl_runtime.cuda.ops.out_size),
    ("ops.pool.avg_pool_divisor", deepdsl.ops.pool.avg_pool_divisor),
])
def test_compiler_and_runtime_names_are_the_contracts_functions(name, value):
    assert value is getattr(contract, name.rsplit(".", 1)[1]), name


def test_one_alignment():
    assert deepdsl.memory_plan.ALIGNMENT == deepdsl_runtime.memory.ALIGNMENT == contract.ALIGNMENT
    assert deepdsl_runtime.memory.first_fit.DEFAULT_ALIGNMENT == contract.ALIGNMENT
    assert deepdsl_runtime.memory.first_fit.PoolAllocator(1 << 12).aligned_size(1) == contract.placed_size(1)


@pytest.mark.parametrize("op, rule", [("max_pool", contract.max_pool_scratch),
                                      ("max_pool_argmax", contract.max_pool_argmax_scratch),
                                      ("avg_pool", contract.avg_pool_scratch)])
def test_pooling_ops_state_the_contracts_scratch(op, rule):
    assert get_op(op).scratch is rule


def test_the_cpu_average_divisor_is_the_contracts_in_float32():
    args = ((7, 6), 3, 2, 1, True, False)
    divisor = deepdsl_runtime.cpu.avg_pool_divisor(*args)
    assert divisor.dtype == "float32"
    assert (divisor == contract.avg_pool_divisor(*args)).all()


def test_masks_draw_from_the_contracts_stream():
    assert contract.counter_key(3, 5) == 3 * contract.COUNTER_KEY_STEP + 5
    draws = np.random.Generator(np.random.Philox(key=[7, 3 * contract.COUNTER_KEY_STEP + 5]))
    want = (draws.random((4, 9), dtype=np.float32) < 0.5).astype(np.uint8)
    assert 0 < want.mean() < 1
    for mask in (deepdsl.ops.norm.bernoulli_mask(7, 3, 5, (4, 9), 0.5),
                 deepdsl_runtime.cpu.bernoulli_mask(7, 3, 5, (4, 9), 0.5)):
        np.testing.assert_array_equal(mask, want)


# the rules no module but the contract writes: their definitions, and the dropout counter key's arithmetic
_RULES = {
    "an alignment": re.compile(r"^\s*(DEFAULT_)?ALIGNMENT\s*=", re.M),
    "a placed size": re.compile(r"^\s*def placed_size\b", re.M),
    "an output size": re.compile(r"^\s*def out_size\b", re.M),
    "a counter key": re.compile(r"\*\s*65536|65536\s*\+"),
}


@pytest.mark.parametrize("path", [p for p in _sources("deepdsl", "runtime") if p != CONTRACT],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_other_module_writes_a_contract_rule(path):
    text = path.read_text()
    found = [what for what, pattern in _RULES.items() if pattern.search(text)]
    assert not found, f"{path.relative_to(ROOT)} writes {', '.join(found)} of its own: import it from the contract"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_contract_imports_only_numpy_and_the_standard_library():
    assert _imported_modules(CONTRACT) <= {"numpy", "__future__"} | set(sys.stdlib_module_names)


@pytest.mark.parametrize("path", _sources("runtime"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runtime_never_imports_the_compiler(path):
    assert "deepdsl" not in _imported_modules(path)


# modules loaded from a file: network files (the loader) and generated programs (the test helper), never the runtime
_LOADED_BY_PATH = {"deepdsl/loader.py", "tests/support/program_helpers.py"}


def test_the_runtime_is_never_loaded_from_a_file():
    by_path = "spec_from_file_" + "location"
    users = {str(p.relative_to(ROOT)) for p in _sources("deepdsl", "tests") if by_path in p.read_text()}
    assert users <= _LOADED_BY_PATH, f"modules loaded by path in {sorted(users - _LOADED_BY_PATH)}"
    runtime_by_path = re.compile(by_path + r"""\(\s*["']deepdsl_runtime""")
    assert not [p for p in _sources("benchmarks") if runtime_by_path.search(p.read_text())]


def test_programs_import_the_runtime_by_name(tmp_path):
    """A generated program runs in `program_env()` from anywhere and finds the installed runtime by its name."""
    code = "import deepdsl_runtime.contract, deepdsl_runtime.cpu, deepdsl_runtime.memory"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=program_env(), capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_operand_letters_of_compiled_elementwise_kernels():
    from deepdsl_runtime.contract import channel_sum_pattern, kernel_rows, operand_letter, operand_pattern

    out = (8, 16, 5, 5)
    assert [operand_letter(s, False, out) for s in (out, (8 * 16 * 25,), (), (1, 1), (1, 16, 1, 1), (16, 1, 1),
                                                    (5,), (1, 1, 1, 5), (16,), (8, 1, 1, 5))] == \
        ["f", "f", "s", "s", "c", "c", "r", "r", None, None]
    assert operand_letter(out, True, out) == "u" and operand_letter((1, 16), False, (8, 16)) == "r"
    assert operand_letter((1, 16, 1), False, (8, 16, 5)) == "c" and operand_letter((2, 16, 1, 1), False, out) is None
    assert operand_pattern([(out, False), ((1, 16, 1, 1), False), ((5,), False)], out) is None   # c and r
    assert operand_pattern([(out, False), ((1, 16, 1, 1), False), ((), False)], out) == "fcs"
    assert kernel_rows("fcs", out) == (8 * 16, 16, 25) and kernel_rows("fr", out) == (8 * 16 * 5, 1, 5)
    assert kernel_rows("fs", out) == (1, 1, 8 * 16 * 25)
    # one value per row of the last axis (a layer norm's statistics), with last-axis operands but not per-channel ones
    assert operand_letter((8, 16, 5, 1), False, out) == "w" and operand_letter((8, 1), False, (8, 16)) == "w"
    assert operand_letter((8, 16, 1), False, (8, 16, 1)) == "f" and operand_letter((8, 16, 1, 5), False, out) is None
    assert operand_pattern([(out, False), ((8, 16, 5, 1), False), ((5,), False)], out) == "fwr"
    assert operand_pattern([(out, False), ((8, 16, 5, 1), False), ((16, 1, 1), False)], out) is None   # c and w
    assert kernel_rows("fwr", out) == (8 * 16 * 5, 1, 5)
    # one value per sample's channel (squeeze-and-excitation's scale), or per sample: rows of the trailing axes, the
    # rows of per-channel operands where those are there too; per-row operands of other rows never meet
    assert operand_letter((8, 16, 1, 1), False, out) == "w" and operand_letter((8, 1, 1, 1), False, out) == "w"
    assert operand_letter((16, 1, 1), False, out) == "c" and operand_letter((1, 16, 5, 1), False, out) is None
    # a uint8 operand broadcast (stochastic depth's per-sample mask) is read by numpy's kernels, not as floats
    assert [operand_letter(s, True, out) for s in ((8, 1, 1, 1), (8, 16, 5, 1), (16, 1, 1), (5,), (1,))] == \
        [None, None, None, None, "s"]
    assert operand_pattern([(out, False), ((8, 16, 1, 1), False), ((16, 1, 1), False)], out) == "fwc"
    assert kernel_rows("fwc", out) == (8 * 16, 16, 25)
    assert operand_pattern([(out, False), ((8, 1, 1, 1), False)], out) == "fw"
    assert kernel_rows("fw", out, 8) == (8, 1, 16 * 25) and kernel_rows("fw", out, 8 * 16) == (8 * 16, 1, 25)
    for rows in (((8, 1, 1, 1), (16, 1, 1)), ((8, 16, 1, 1), (5,)), ((8, 16, 1, 1), (8, 1, 1, 1))):
        assert operand_pattern([(out, False), *((shape, False) for shape in rows)], out) is None, rows
    # summed per channel (an ew_sum, a summed pair): per-row operands of the sum's rows, each sample's channel
    assert channel_sum_pattern([(out, False), ((8, 16, 1, 1), False)], out, (1, 16, 1, 1)) == "fw"
    assert channel_sum_pattern([(out, False), ((8, 1, 1, 1), False)], out, (1, 16, 1, 1)) is None
