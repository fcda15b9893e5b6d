"""Checkpoints of generated programs: format, exact resume, signals, bad files, divergence, fine-tuning.

The programs run as users run them (separate processes through their CLI) at a small batch, so each run takes a
second or two.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal

import numpy as np
import pytest

from tests.support.program_helpers import compile_program, logged, popen_cli, run_cli, wait_for

ckpt = pytest.importorskip("deepdsl_runtime.checkpoint")


def read(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    _, program = compile_program("mlp", tmp_path_factory.mktemp("mlp"), batch=8)
    return program


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
    """Dropout (random masks), concatenation, max pooling with padding."""
    _, program = compile_program("inception_mini", tmp_path_factory.mktemp("inception"), batch=4)
    return program


@pytest.mark.parametrize("shape", [(300, 784), (64, 3, 7, 7), (10,), (), (0, 5)])
def test_xavier_draws_numpys_uniform_bit_for_bit(shape):
    """The xavier initializer gives what `rng.uniform(-b, b, shape)` gives (as float32), and leaves the generator
    where it leaves it: the parameters every program starts from, whichever way they are drawn."""
    from deepdsl_runtime.program import initial_value

    ours, numpys = np.random.default_rng(5), np.random.default_rng(5)
    bound = np.sqrt(3 / (int(np.prod(shape[1:])) if len(shape) > 1 else 1))
    for _ in range(2):
        got = initial_value(shape, "xavier", ours)
        assert got.dtype == np.float32 and got.shape == shape
        assert np.array_equal(got, numpys.uniform(-bound, bound, shape).astype(np.float32))
    assert ours.random() == numpys.random()


def test_initial_checkpoint_format(mlp, tmp_path):
    path = tmp_path / "init.npz"
    done = run_cli(mlp, "--iters", "0", "--params", str(path))
    assert done.returncode == 0, done.stderr
    assert "wrote initial parameters" in done.stdout
    z = read(path)
    # parameters by name in PyTorch's layouts (nn.Linear weight: out x in), momentum buffers, metadata
    assert z["fc1_W"].shape == (300, 784) and z["fc1_W"].dtype == np.float32
    assert z["fc3_B"].shape == (10,) and not z["fc3_B"].any()
    assert np.abs(z["fc1_W"]).max() <= np.sqrt(3 / 784) and z["fc1_W"].std() > 0     # xavier: +-sqrt(3/fan_in)
    assert not z["V_fc1_W"].any()
    assert str(z["__format__"]) == "deepdsl-checkpoint-1" and str(z["__network__"]) == "mlp"
    assert int(z["__iteration__"]) == 0 and len(str(z["__structure_hash__"])) == 16
    assert [p.name for p in tmp_path.iterdir()] == ["init.npz"]            # no temporary file left behind
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask                     # not the 0600 of a temporary file


def test_resume_is_bit_exact(inception, tmp_path):
    """6 iterations in one run == 3, stop, resume for 3 more; also with periodic checkpoints on the way."""
    whole, halves, periodic = tmp_path / "whole.npz", tmp_path / "halves.npz", tmp_path / "periodic.npz"
    common = ("--data", "digits", "--seed", "5", "--test-iters", "0", "--quiet")
    assert run_cli(inception, "--iters", "6", "--params", str(whole), *common).returncode == 0
    assert run_cli(inception, "--iters", "3", "--params", str(halves), *common).returncode == 0
    assert int(read(halves)["__iteration__"]) == 3
    resumed = run_cli(inception, "--iters", "6", "--params", str(halves), "--data", "digits", "--test-iters", "0")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {halves} at iteration 3" in resumed.stdout
    assert run_cli(inception, "--iters", "6", "--save-every", "2", "--params", str(periodic), *common).returncode == 0
    a, b, c = read(whole), read(halves), read(periodic)
    assert sorted(a) == sorted(b) == sorted(c)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
        assert np.array_equal(a[key], c[key]), key
    assert int(a["__iteration__"]) == 6 and int(a["__seed__"]) == 5
    # and training did happen
    init = tmp_path / "init.npz"
    run_cli(inception, "--iters", "0", "--params", str(init), "--seed", "5")
    assert not np.array_equal(read(init)["conv1_W"], a["conv1_W"])


@pytest.mark.parametrize("kernels", ["compiled", "numpy"])
def test_resume_on_another_number_of_threads_is_bit_exact(tmp_path, kernels):
    """The bits do not depend on the threads: 4 iterations on one thread == 2 on two, then 2 more resumed on three
    (a checkpoint moved to a machine with other cores, or started under another load), with the compiled kernels
    (products on their threads) and with numpy's."""
    from deepdsl.codegen.native import build_library, find_compiler

    if kernels == "compiled" and find_compiler() is None:
        pytest.skip("no C compiler")
    _, program = compile_program("resnet_mini", tmp_path / "program", batch=4)
    if kernels == "compiled":
        built, why = build_library(program.with_suffix(".c"))
        assert built is not None, why
    whole, halves = tmp_path / "whole.npz", tmp_path / "halves.npz"
    common = ("--data", "digits", "--seed", "3", "--test-iters", "0", "--quiet", "--kernels", kernels)
    for path, iters, threads in ((whole, 4, 1), (halves, 2, 2), (halves, 4, 3)):
        done = run_cli(program, "--iters", str(iters), "--params", str(path), "--threads", str(threads), *common)
        assert done.returncode == 0, done.stderr
    a, b = read(whole), read(halves)
    assert sorted(a) == sorted(b) and int(b["__iteration__"]) == 4
    differ = [key for key in a if not np.array_equal(a[key], b[key])]
    assert not differ, differ


def test_fresh_starts_over(mlp, tmp_path):
    path = tmp_path / "p.npz"
    assert run_cli(mlp, "--iters", "2", "--params", str(path), "--quiet", "--test-iters", "0").returncode == 0
    done = run_cli(mlp, "--iters", "1", "--params", str(path), "--fresh", "--test-iters", "0")
    assert done.returncode == 0 and "resuming" not in done.stdout
    assert int(read(path)["__iteration__"]) == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint(mlp, tmp_path, sig):
    path = tmp_path / "p.npz"
    log = tmp_path / "log.jsonl"
    process = popen_cli(mlp, "--iters", "1000000", "--params", str(path), "--test-iters", "0", "--data", "synthetic",
                        "--log", str(log), "--log-every", "1")
    try:
        for line in process.stdout:                      # ("building" its library first, where it is not built)
            if line.startswith("training mlp"):          # the loop has started
                break
        else:
            pytest.fail("the program stopped before training: " + process.communicate()[1])
        wait_for(lambda: logged(log), 60, "an iteration")
        process.send_signal(sig)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + sig, err
    assert f"{signal.Signals(sig).name} at iteration" in err and f"saved {path}" in err
    z = read(path)
    done = int(z["__iteration__"])
    assert 0 < done < 1000000
    resumed = run_cli(mlp, "--iters", str(done + 2), "--params", str(path), "--data", "synthetic", "--test-iters", "0")
    assert resumed.returncode == 0 and f"at iteration {done}" in resumed.stdout
    assert int(read(path)["__iteration__"]) == done + 2


# ----------------------------------------------------------------------------------------------------------------
# unusable files: one line naming the file and the field, non-zero exit, the file untouched

def _damaged(mlp, tmp_path, change) -> tuple[str, str]:
    path = tmp_path / "p.npz"
    assert run_cli(mlp, "--iters", "0", "--params", str(path)).returncode == 0
    change(path)
    before = digest(path)
    done = run_cli(mlp, "--iters", "3", "--params", str(path), "--data", "synthetic")
    assert done.returncode == 1, done.stdout + done.stderr
    assert digest(path) == before, "the program touched the bad file"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(path) in lines[0]
    return lines[0], done.stdout


def _rewrite(path, edit):
    arrays = read(path)
    edit(arrays)
    np.savez(path, **arrays)


def test_wrong_shape(mlp, tmp_path):
    def edit(a):
        a["fc2_W"] = np.zeros((100, 301), np.float32)
    line, _ = _damaged(mlp, tmp_path, lambda p: _rewrite(p, edit))
    assert "field 'fc2_W'" in line and "100x301" in line and "100x300" in line


def test_missing_tensor(mlp, tmp_path):
    line, _ = _damaged(mlp, tmp_path, lambda p: _rewrite(p, lambda a: a.pop("V_fc3_B")))
    assert "field 'V_fc3_B': missing" in line


def test_nan_in_file(mlp, tmp_path):
    def edit(a):
        a["fc1_B"][3] = np.nan
    line, _ = _damaged(mlp, tmp_path, lambda p: _rewrite(p, edit))
    assert "field 'fc1_B'" in line and "NaN" in line


def test_other_structure(mlp, tmp_path):
    """A checkpoint of the same network compiled at another batch size: another training program."""
    _, other = compile_program("mlp", tmp_path / "other", batch=4)
    theirs = tmp_path / "theirs.npz"
    assert run_cli(other, "--iters", "0", "--params", str(theirs)).returncode == 0
    line, _ = _damaged(mlp, tmp_path, lambda p: shutil.copyfile(theirs, p))
    assert "field '__structure_hash__'" in line


def test_other_network(mlp, tmp_path):
    _, lenet = compile_program("lenet", tmp_path / "lenet", batch=8)
    theirs = tmp_path / "theirs.npz"
    assert run_cli(lenet, "--iters", "0", "--params", str(theirs)).returncode == 0
    line, _ = _damaged(mlp, tmp_path, lambda p: shutil.copyfile(theirs, p))
    assert "field '__network__'" in line and "'lenet'" in line


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip"])
def test_corrupt_bytes(mlp, tmp_path, damage):
    def change(path):
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "garbage":
            data = bytearray(os.urandom(4096))
        else:                            # a flipped byte inside an array's header
            data[data.index(b"descr") + 10] ^= 0xFF
        path.write_bytes(bytes(data))
    line, _ = _damaged(mlp, tmp_path, change)
    assert "corrupt" in line or "unreadable" in line or "field" in line


def test_not_a_checkpoint(mlp, tmp_path):
    line, _ = _damaged(mlp, tmp_path, lambda p: np.savez(p, x=np.zeros(3)))
    assert "field '__format__': missing" in line


# ----------------------------------------------------------------------------------------------------------------
# divergence, fine-tuning, atomic writes

def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(mlp, tmp_path):
    path = tmp_path / "p.npz"
    assert run_cli(mlp, "--iters", "3", "--params", str(path), "--data", "synthetic", "--quiet",
                   "--test-iters", "0").returncode == 0
    done = run_cli(mlp, "--iters", "50", "--params", str(path), "--data", "synthetic", "--lr", "1e30",
                   "--save-every", "1", "--test-iters", "0", "--quiet")
    assert done.returncode == 3, done.stderr
    message = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(message) == 1 and "loss is" in message[0] and "at iteration" in message[0]
    failed_at = int(message[0].split("at iteration ")[1].split(";")[0])
    z = read(path)
    assert 3 <= int(z["__iteration__"]) < failed_at
    assert all(np.all(np.isfinite(v)) for k, v in z.items() if not k.startswith("__"))


LENET_WIDE = """
from deepdsl import dsl as D

x = D.images("x", (8, 1, 28, 28), dataset="digits")
y = D.labels("y", 8, classes=10)
cv1 = D.conv("cv1", kernel=5, channels=20)
cv2 = D.conv("cv2", kernel=5, channels=50)
mp = D.max_pool(2)
fc1 = D.full("fc1", 300)                 # LeNet has 500
fc2 = D.full("fc2", 10)
network = fc2 @ D.relu @ fc1 @ D.flatten @ mp @ cv2 @ mp @ cv1
loss = (D.log_loss(y) @ D.softmax @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("lenet_narrow", iters=10, lr=0.01, momentum=0.9))
"""


def test_init_from_loads_matching_parameters(tmp_path):
    _, lenet = compile_program("lenet", tmp_path / "a", batch=8)
    trained = tmp_path / "trained.npz"
    assert run_cli(lenet, "--iters", "2", "--params", str(trained), "--test-iters", "0", "--quiet").returncode == 0
    network = tmp_path / "narrow.py"
    network.write_text(LENET_WIDE)
    _, narrow = compile_program(network, tmp_path / "b")
    target = tmp_path / "narrow.npz"
    done = run_cli(narrow, "--iters", "0", "--init-from", str(trained), "--params", str(target), "--seed", "9")
    assert done.returncode == 0, done.stderr
    assert "initialized 5 of 8 tensors" in done.stdout
    for skipped in ("fc1_W (shape 500x800 in file, 300x800 here)", "fc1_B", "fc2_W"):
        assert skipped in done.stdout
    old, new = read(trained), read(target)
    for name in ("cv1_W", "cv1_B", "cv2_W", "cv2_B", "fc2_B"):
        assert np.array_equal(old[name], new[name]), name
    assert not new["V_cv1_W"].any()                      # optimizer state starts fresh
    assert int(new["__iteration__"]) == 0


def test_init_from_a_corrupt_file_is_an_error(mlp, tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    done = run_cli(mlp, "--iters", "1", "--init-from", str(bad), "--params", str(tmp_path / "p.npz"))
    assert done.returncode == 1 and str(bad) in done.stderr and not (tmp_path / "p.npz").exists()


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    state = ckpt.Checkpoint("", {"w": np.ones(3, np.float32)}, "net", "h" * 16, 7)
    ckpt.write(str(path), state)
    before = digest(path)
    calls = []

    def failing(member, array, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise OSError("disk full")
        return original(member, array, **kwargs)

    original = np.lib.format.write_array
    monkeypatch.setattr(np.lib.format, "write_array", failing)
    with pytest.raises(OSError):
        ckpt.write(str(path), ckpt.Checkpoint("", {"w": np.zeros(3, np.float32)}, "net", "h" * 16, 8))
    monkeypatch.undo()
    assert digest(path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]
    assert ckpt.read(str(path)).iteration == 7


class _Interrupted(Exception):
    pass


def test_an_interrupt_while_the_temporary_is_created_leaves_nothing(tmp_path, monkeypatch):
    """A signal whose handler raises right after `atomic_write` has created its temporary (before the file is even
    returned to it) leaves the old file and no temporary: the temporary is named before it is created."""
    path = tmp_path / "c.npz"
    path.write_bytes(b"old")
    made = []
    real = os.open

    def open_then_signal(name, *args, **kwargs):
        fd = real(name, *args, **kwargs)
        if str(name).endswith(".tmp"):
            made.append(name)
            os.kill(os.getpid(), signal.SIGINT)      # its handler runs here, before `fd` is returned
        return fd

    def interrupted(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGINT, interrupted)
    monkeypatch.setattr(ckpt.os, "open", open_then_signal)
    try:
        with pytest.raises(_Interrupted):
            ckpt.atomic_write(str(path), lambda f: f.write(b"new"))
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, previous)
    assert made and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
    assert path.read_bytes() == b"old"


def _safetensors(path, tensors: dict, dtypes: dict | None = None) -> None:
    """Write `tensors` (name -> array) in the safetensors layout: header length, JSON header, data."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, array in tensors.items():
        kind = (dtypes or {}).get(name) or {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
                                            np.dtype(np.int64): "I64"}[array.dtype]
        blob = array.astype("<u2").tobytes() if kind == "BF16" else np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_init_from_a_pytorch_state_dict(tmp_path):
    """A PyTorch state_dict saved as a plain .npz (`np.savez(path, **{k: v.numpy()})`) or as safetensors starts a
    run: its names map to deepdsl's (`cv1.weight` -> `cv1_W`, `cv1.bias` -> `cv1_B`); entries with no counterpart
    (a BatchNorm's `num_batches_tracked`) are left out; bfloat16 is widened."""
    import torch
    from tests.support.torch_nets import LeNet

    torch.manual_seed(3)
    state = {k: v.detach().float().numpy() for k, v in LeNet(image=(28, 28)).state_dict().items()
             if not k.startswith("layers.")}            # (the twin also lists its modules under `layers`)
    _, lenet = compile_program("lenet", tmp_path / "p", batch=8)
    plain = tmp_path / "torch_lenet.npz"
    np.savez(plain, **state)
    safe = tmp_path / "torch_lenet.safetensors"
    _safetensors(safe, {**state, "bn.num_batches_tracked": np.array(7, np.int64)})
    halves = tmp_path / "bf16.safetensors"
    bf16 = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in state.items()}
    _safetensors(halves, bf16, {k: "BF16" for k in bf16})
    for source, expected in [(plain, state), (safe, state),
                             (halves, {k: (v.astype(np.uint32) << 16).view(np.float32) for k, v in bf16.items()})]:
        target = tmp_path / f"{source.name}.params.npz"
        done = run_cli(lenet, "--iters", "0", "--init-from", str(source), "--params", str(target))
        assert done.returncode == 0, done.stderr
        assert "initialized 8 of 8 tensors" in done.stdout and "cv1.weight -> cv1_W" in done.stdout, done.stdout
        loaded = read(target)
        for name, value in expected.items():
            np.testing.assert_array_equal(loaded[name.replace(".weight", "_W").replace(".bias", "_B")], value)


def test_init_from_a_plain_npz_by_deepdsl_names_and_a_damaged_safetensors(tmp_path):
    _, lenet = compile_program("lenet", tmp_path / "p", batch=8)
    rng = np.random.default_rng(0)
    plain = tmp_path / "mine.npz"
    np.savez(plain, cv1_W=rng.standard_normal((20, 1, 5, 5)).astype(np.float32), other=np.zeros(3))
    done = run_cli(lenet, "--iters", "0", "--init-from", str(plain), "--params", str(tmp_path / "a.npz"))
    assert done.returncode == 0 and "initialized 1 of 8 tensors" in done.stdout, done.stdout + done.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((1000).to_bytes(8, "little") + b"{}")
    done = run_cli(lenet, "--iters", "1", "--init-from", str(bad), "--params", str(tmp_path / "b.npz"))
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and str(bad) in done.stderr, done.stderr
    assert "safetensors" in done.stderr and not (tmp_path / "b.npz").exists()
    short = tmp_path / "short.safetensors"
    header = json.dumps({"cv1_W": {"dtype": "F32", "shape": [20, 1, 5, 5], "data_offsets": [0, 2000]}}).encode()
    short.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 100)
    done = run_cli(lenet, "--iters", "1", "--init-from", str(short), "--params", str(tmp_path / "c.npz"))
    assert done.returncode == 1 and "field 'cv1_W'" in done.stderr and "Traceback" not in done.stderr, done.stderr
