"""`deepdsl import`: models written in plain torch.nn (tests/support/torch_models.py) become network files whose
training step is the PyTorch module's (the float64 interpreter within 1e-9 of autograd, float32 within PyTorch's
own float32 spread), with the same parameter count and the weights carried over exactly; the imported programs
train with measured == planned memory; unsupported ops are all listed at once and nothing is written."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deepdsl  # noqa: E402
from deepdsl import torch_import as ti  # noqa: E402
from deepdsl.codegen import program_env  # noqa: E402
from deepdsl_runtime.run import pytorch_name  # noqa: E402
from tests.support.program_helpers import compile_program, run_cli  # noqa: E402
from tests.test_networks import (EXACT_TOLERANCE, TOLERANCE, _classes, _interpreter_step,  # noqa: E402
                                 _step_errors, dropout_masks, random_value)

MODELS = Path(__file__).parent / "support" / "torch_models.py"
ROOT = Path(__file__).resolve().parents[1]
CASES = {"resnet18": "2x3x32x32", "mobilenet_v2": "2x3x64x64", "unet": "2x3x16x16", "vit": "2x3x16x16",
         "gpt2": "2x16:int64", "text_classifier": "2x16:int64", "drop_path_net": "8x3x8x8"}
TIMEOUT = 600


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def imported(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    result = ti.import_module(f"{MODELS}:{name}", [ti.InputSpec.parse(CASES[name])], name=name)
    directory = tmp_path_factory.mktemp(name)
    (directory / f"{name}.py").write_text(result.text)
    return name, result, directory / f"{name}.py"


def test_parameters_and_weights_carry_over_exactly(imported):
    name, result, _ = imported
    module = result.module
    assert result.parameters == sum(p.numel() for p in module.parameters())
    state = module.state_dict(keep_vars=True)
    carried = {pytorch_name(k): v for k, v in state.items() if pytorch_name(k) is not None}
    assert set(result.weights) <= set(carried)
    for key, value in result.weights.items():
        assert np.array_equal(value, carried[key].detach().numpy()), key
    # an entry left out is a tied one: the same tensor as one carried over
    kept = {id(carried[k]) for k in result.weights}
    assert all(id(t) in kept for t in carried.values()), sorted(set(carried) - set(result.weights))


def _torch_step(module, values: dict, x, y, masks, dtype) -> dict:
    """One training step of the module in `dtype` on the network's tensors `values` (deepdsl's names), with
    deepdsl's dropout masks: loss, gradients, parameter changes of lr 1 and the new running statistics (on a copy:
    the imported module stays as it was)."""
    module = copy.deepcopy(module).to(dtype).train()
    everything = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    named = {pytorch_name(k): t for k, t in everything.items() if pytorch_name(k) in values}
    with torch.no_grad():
        for key, tensor in named.items():
            tensor.copy_(torch.from_numpy(values[key].astype(np.float64)))
    pending = [torch.from_numpy(m).to(dtype) for m in masks]
    functional = torch.nn.functional
    originals = functional.dropout, torch.Tensor.bernoulli_, functional.scaled_dot_product_attention

    def dropout(input, p=0.5, training=True, inplace=False):
        return input * pending.pop(0) / (1 - p) if training and p > 0 else input

    def bernoulli_(tensor, p=0.5, generator=None):       # stochastic depth's noise: deepdsl's per-example masks
        with torch.no_grad():
            return tensor.copy_(pending.pop(0).reshape(tensor.shape))

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **rest):
        """scaled_dot_product_attention, its weights' dropout by deepdsl's masks (nn.MultiheadAttention's too)."""
        if not dropout_p:
            return originals[2](q, k, v, attn_mask, 0.0, is_causal, scale=scale, **rest)
        assert attn_mask is None and not rest
        scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if is_causal:
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return dropout(torch.softmax(scores, -1), dropout_p) @ v
    functional.dropout, torch.Tensor.bernoulli_, functional.scaled_dot_product_attention = \
        dropout, bernoulli_, attention
    try:
        inputs = torch.from_numpy(x).long() if x.dtype == np.int32 else torch.from_numpy(x).to(dtype)
        scores = module(inputs)
        loss = torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]),
                                                 torch.from_numpy(y).long().reshape(-1))
    finally:
        functional.dropout, torch.Tensor.bernoulli_, functional.scaled_dot_product_attention = originals
    assert not pending, "masks left over"
    module.zero_grad()
    loss.backward()
    result = {"loss": np.float64(loss.item())}
    for key, tensor in named.items():
        if tensor.requires_grad:
            result[f"d{key}"] = tensor.grad.double().numpy()
            result[f"new {key}"] = (tensor - tensor.grad).detach().double().numpy() - values[key]
        elif not key.endswith("num_batches_tracked"):
            result[key] = tensor.detach().double().numpy()
    return result


def test_a_training_step_equals_the_pytorch_module(imported):
    """The imported network's step: the float64 interpreter within 1e-9 of PyTorch's float64 autograd step, float32
    as close as TOLERANCE or twice PyTorch's own float32 step."""
    name, result, path = imported
    compiled = deepdsl.compile(deepdsl.load(str(path)), deepdsl.CompileOptions(verify=True))
    rng = np.random.default_rng(5)
    leaves = {leaf.name: leaf for leaf in compiled.train.inputs}
    if leaves["x"].dtype == "int32":                      # tokens, the last ones padding (token 0)
        x = rng.integers(1, 96, leaves["x"].shape).astype(np.int32)
        x[0, -3:] = x[1, -7:] = 0
    else:
        x = rng.standard_normal(leaves["x"].shape).astype(np.float32)
    y = rng.integers(0, _classes(compiled), leaves["y"].shape).astype(np.int32)
    # values of every scale (batch norm's weights and shifts away from 1 and 0, so no statistic is zero)
    values = {k: random_value(k, w.shape, rng).astype(np.float32) for k, w in result.weights.items()}
    masks = dropout_masks(compiled.train)
    exact = _torch_step(result.module, values, x, y, masks, torch.float64)
    step = _interpreter_step(compiled, values, x, y, np.float64)
    assert sorted(step) == sorted(exact)
    worst = _step_errors(step, exact)
    assert worst[0][1] <= EXACT_TOLERANCE, f"{name} in float64: largest relative errors {worst[:5]}"
    worst = _step_errors(_interpreter_step(compiled, values, x, y, np.float32), exact)
    spread = _step_errors(_torch_step(result.module, values, x, y, masks, torch.float32), exact)
    assert worst[0][1] <= max(TOLERANCE, 2 * spread[0][1]), \
        f"{name}: largest relative errors {worst[:5]}; PyTorch's own float32 step's {spread[:3]}"


def deepdsl_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepdsl", *args], capture_output=True, text=True, cwd=str(cwd),
                          env=program_env(), timeout=TIMEOUT)


def test_the_command_writes_a_network_that_trains_in_its_planned_memory(tmp_path):
    """`deepdsl import` then `deepdsl run` with --init-from its weights: a few iterations, every weight taken,
    the measured peak the planned one."""
    done = deepdsl_cli("import", f"{MODELS}:unet", "--input", "4x3x16x16", "--labels", "10", "-o", "net/unet.py",
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote net/unet.py" in done.stdout and (tmp_path / "net" / "unet.weights.npz").exists()
    text = (tmp_path / "net" / "unet.py").read_text()
    assert 'down1_0 = D.conv("down1_0", 3, 8, padding=1, bias=False)(x)' in text
    assert 'up2 = D.conv_transpose("up2", 2, 16, stride=2)(bottom_5)' in text
    report = tmp_path / "report.json"
    program = compile_program(tmp_path / "net" / "unet.py", tmp_path / "program")[1]       # what `run` writes
    done = run_cli(program, "--iters", "3", "--init-from", "net/unet.weights.npz", "--report-json", str(report),
                   "--test-iters", "1", "--params", "p.npz", "--kernels", "numpy", cwd=tmp_path, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "initialized 56 of 56 tensors from net/unet.weights.npz" in done.stdout
    figures = json.loads(report.read_text())
    assert figures["peak_bytes_measured"] == figures["peak_bytes_planned"]
    assert np.isfinite(figures["loss"])


def test_unsupported_ops_are_listed_at_once_and_nothing_is_written(tmp_path):
    done = deepdsl_cli("import", f"{MODELS}:Unsupported", "--input", "2x3x8x8", "-o", "net.py", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert "2 ops with no DSL counterpart (nothing written)" in lines[0]
    assert len(lines) == 3
    source = MODELS.read_text().splitlines()
    for line, op in zip(lines[1:], ("aten.roll.default", "aten.cumsum.default")):
        where = line.strip().split(": ")[0]
        file, number = where.rsplit(":", 1)
        assert Path(file).resolve() == MODELS.resolve() and op in line and "Unsupported (the model itself)" in line
        assert op.split(".")[1] in source[int(number) - 1]
        assert "not supported yet" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args,fragment", [
    (("nothing_here.py:Net", "--input", "2x3x8x8"), "nothing_here.py: cannot read"),
    ((f"{MODELS}:NoSuch", "--input", "2x3x8x8"), "defines no 'NoSuch'"),
    ((f"{MODELS}:unet", "--input", "2x3"), "image inputs are (N, C, H, W)"),
    ((f"{MODELS}:unet", "--input", "2by3"), "--input 2by3: expected sizes joined by 'x'"),
    ((f"{MODELS}:unet", "--input", "2x3x16x16", "--labels", "7"), "--labels 7: the module returns scores of 10"),
    ((f"{MODELS}:unet", "--input", "2x5x16x16"), "torch.export cannot export the module"),
], ids=["no-file", "no-factory", "rank", "syntax", "labels", "export"])
def test_import_errors_are_one_line(tmp_path, args, fragment):
    done = deepdsl_cli("import", *args, "-o", "net.py", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("batch", [1, 3])
def test_an_imported_network_compiles_at_any_batch(imported, batch):
    """The file writes the sizes that follow the batch in N (the batch exported as a size of its own), so it
    compiles at another batch (`--batch`, `--fit`)."""
    from deepdsl.dsl import Overrides

    name, result, path = imported
    compiled = deepdsl.compile(deepdsl.load(str(path), Overrides(batch=batch)))
    x = next(leaf for leaf in compiled.train.inputs if leaf.name == "x")
    assert x.shape[0] == batch
    if name in ("vit", "gpt2"):
        assert "N = x.shape[0]" in result.text and ".reshape(N, " in result.text
