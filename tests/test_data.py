"""Data specs of generated programs: the bundled digits, tiny files in the real MNIST (IDX) and CIFAR-10 (binary)
formats built here byte by byte, npz arrays, synthetic data; the batch streams; mismatches as one-line errors."""
from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.program_helpers import compile_program, run_cli

data = pytest.importorskip("deepdsl_runtime.data")


def write_idx(path, array: np.ndarray, compress: bool = False) -> None:
    """An IDX file as MNIST ships them: 0, 0, type 0x08 (unsigned byte), rank, big-endian sizes, the bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


@pytest.fixture
def mnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28)),
              "train-labels-idx1-ubyte": rng.integers(0, 10, 12),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28)),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, 5)}
    for i, (name, array) in enumerate(arrays.items()):
        write_idx(tmp_path / name, array, compress=i % 2 == 0)     # gzipped and plain files mixed
    return tmp_path, arrays


def test_mnist(mnist_dir):
    directory, arrays = mnist_dir
    d = data.load(f"mnist:{directory}", (1, 28, 28), 10)
    assert d.x_train.shape == (12, 1, 28, 28) and d.x_train.dtype == np.float32
    np.testing.assert_allclose(d.x_train[:, 0], arrays["train-images-idx3-ubyte"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(d.y_train, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(d.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert d.y_train.dtype == np.int32


def test_mnist_errors(mnist_dir, tmp_path_factory):
    directory, _ = mnist_dir
    with pytest.raises(data.DataError, match=r"mnist:.*network takes 1x32x32"):
        data.load(f"mnist:{directory}", (1, 32, 32), 10)
    with pytest.raises(data.DataError, match="labels range over"):
        data.load(f"mnist:{directory}", (1, 28, 28), 3)
    broken = tmp_path_factory.mktemp("broken")
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"):
        (broken / name).write_bytes((directory / name).read_bytes() if (directory / name).exists()
                                    else gzip.open(str(directory / name) + ".gz").read())
    with pytest.raises(data.DataError, match=r"no t10k-images-idx3-ubyte\[\.gz\]"):
        data.load(f"mnist:{broken}", (1, 28, 28), 10)
    (broken / "t10k-images-idx3-ubyte").write_bytes(b"\x08\x03" + bytes(20))
    with pytest.raises(data.DataError, match="bad magic"):
        data.load(f"mnist:{broken}", (1, 28, 28), 10)
    (broken / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">III", 5, 28, 28) + bytes(7))
    with pytest.raises(data.DataError, match="header says"):
        data.load(f"mnist:{broken}", (1, 28, 28), 10)


def write_cifar(path, images: np.ndarray, labels: np.ndarray) -> None:
    """CIFAR-10's binary format: per image one label byte, then 1024 red, 1024 green, 1024 blue bytes."""
    records = np.concatenate([labels.astype(np.uint8)[:, None], images.reshape(len(images), -1)], axis=1)
    path.write_bytes(records.astype(np.uint8).tobytes())


def test_cifar10(tmp_path):
    rng = np.random.default_rng(1)
    nested = tmp_path / "cifar-10-batches-bin"
    nested.mkdir()
    parts = [(rng.integers(0, 256, (4, 3, 32, 32)), rng.integers(0, 10, 4)) for _ in range(3)]
    write_cifar(nested / "data_batch_1.bin", *parts[0])
    write_cifar(nested / "data_batch_2.bin", *parts[1])
    write_cifar(nested / "test_batch.bin", *parts[2])
    d = data.load(f"cifar10:{tmp_path}", (3, 32, 32), 10)
    assert d.x_train.shape == (8, 3, 32, 32)
    red = parts[0][0][2, 0]
    np.testing.assert_allclose(d.x_train[2, 0], red / 255.0, rtol=1e-6)               # channel planes in order
    np.testing.assert_array_equal(d.y_train, np.concatenate([parts[0][1], parts[1][1]]))
    np.testing.assert_array_equal(d.y_test, parts[2][1])
    with pytest.raises(data.DataError, match=r"cifar10:.*are 3x32x32 \(CxHxW\), the network takes 1x28x28"):
        data.load(f"cifar10:{tmp_path}", (1, 28, 28), 10)
    (nested / "data_batch_2.bin").write_bytes(bytes(100))
    with pytest.raises(data.DataError, match="not a multiple of the 3073-byte"):
        data.load(f"cifar10:{tmp_path}", (3, 32, 32), 10)


def test_npz(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (10, 6, 6)).astype(np.uint8)
    y = rng.integers(0, 3, 10)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    d = data.load(f"npz:{tmp_path / 'a.npz'}", (1, 6, 6), 3)
    assert d.x_train.shape == (10, 1, 6, 6)
    np.testing.assert_allclose(d.x_train[:, 0], x / 255.0, rtol=1e-6)
    assert d.x_test is d.x_train                                           # no test arrays: test on training
    xf = rng.standard_normal((4, 2, 5, 5)).astype(np.float32)
    np.savez(tmp_path / "b.npz", x=xf, y=np.arange(4), x_test=xf[:2], y_test=np.arange(2))
    d = data.load(f"npz:{tmp_path / 'b.npz'}", (2, 5, 5), 4)
    np.testing.assert_array_equal(d.x_train, xf)
    assert len(d.x_test) == 2
    np.savez(tmp_path / "c.npz", x=xf)
    with pytest.raises(data.DataError, match="no array 'y'"):
        data.load(f"npz:{tmp_path / 'c.npz'}", (2, 5, 5), 4)
    with pytest.raises(data.DataError, match="cannot read"):
        data.load(f"npz:{tmp_path / 'missing.npz'}", (2, 5, 5), 4)


def test_digits():
    d = data.load("digits", (1, 16, 12), 10)
    assert d.x_train.shape == (1497, 1, 16, 12) and d.x_test.shape == (300, 1, 16, 12)
    assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
    assert set(np.unique(d.y_test)) == set(range(10))
    again = data.load("digits", (1, 16, 12), 10)
    np.testing.assert_array_equal(d.y_test, again.y_test)                 # a fixed split
    with pytest.raises(data.DataError, match="digits: the digits have 1 channel, the network takes 3"):
        data.load("digits", (3, 16, 16), 10)


def test_the_digits_are_scikit_learns_read_without_importing_it(monkeypatch, tmp_path):
    """Read from the file scikit-learn ships: the arrays of its `load_digits`, bit for bit; through `load_digits`
    where that file is not there; one line where scikit-learn is missing or its file is damaged."""
    import importlib.util
    import subprocess
    import sys
    import types

    from sklearn.datasets import load_digits

    bunch = load_digits()
    for images, target in (data._digits_arrays(), _without_the_file(monkeypatch, data._digits_arrays)):
        assert images.dtype == bunch.images.dtype and target.dtype == bunch.target.dtype
        np.testing.assert_array_equal(images, bunch.images)
        np.testing.assert_array_equal(target, bunch.target)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)            # not installed
    with pytest.raises(data.DataError, match="^digits: needs scikit-learn"):
        _without_the_file(monkeypatch, data._digits_arrays)
    monkeypatch.undo()
    damaged = tmp_path / "sklearn" / "datasets" / "data" / "digits.csv.gz"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not gzip")
    installed = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "sklearn")])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: installed if name == "sklearn" else None)
    with pytest.raises(data.DataError, match=f"^digits: cannot read scikit-learn's {damaged}: "):
        data._digits_arrays()
    loaded = subprocess.run([sys.executable, "-c", "import sys; from deepdsl_runtime import data; "
                             "data.load('digits', (1, 8, 8), 10); print('sklearn' in sys.modules)"],
                            capture_output=True, text=True)
    assert loaded.stdout.split() == ["False"], loaded.stderr


def _without_the_file(monkeypatch, call):
    import importlib.util

    with monkeypatch.context() as patch:
        patch.setattr(importlib.util, "find_spec", lambda name, *a: None)
        return call()


def test_bilinear_resize_matches_pytorch():
    images = np.random.default_rng(3).random((3, 8, 8))
    for size in [(28, 28), (5, 11), (8, 8)]:
        expected = F.interpolate(torch.from_numpy(images)[:, None], size=size, mode="bilinear",
                                 align_corners=False)[:, 0].numpy()
        np.testing.assert_allclose(data.resize_bilinear(images, size), expected, rtol=1e-6, atol=1e-9)


def test_synthetic():
    a = data.load("synthetic", (3, 4, 4), 5, seed=1, batch=6)
    b = data.load("synthetic", (3, 4, 4), 5, seed=1, batch=6)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.x_train.shape == (12, 3, 4, 4) and a.y_train.max() < 5


def test_unknown_spec():
    with pytest.raises(data.DataError, match="unknown data spec 'imagenet'"):
        data.load("imagenet", (3, 4, 4), 5)


def test_batches_shuffle_each_epoch_and_resume():
    x = np.arange(10, dtype=np.float32).reshape(10, 1, 1, 1)
    y = np.arange(10, dtype=np.int32)
    stream = data.Batches(x, y, 4, seed=3)
    seen = []
    for _ in range(5):                                                     # 20 examples: two epochs
        xb, yb = stream.next()
        np.testing.assert_array_equal(xb.reshape(-1), yb)                  # images travel with their labels
        seen.append(yb.copy())
    order = np.concatenate(seen)
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10))
    assert list(order[:10]) != list(order[10:])                            # a new order each epoch
    assert list(order[:10]) != list(range(10))

    replay = data.Batches(x, y, 4, seed=3)
    replay.next()
    replay.next()
    position = replay.position
    assert position == (0, 8)
    fresh = data.Batches(x, y, 4, seed=3)
    fresh.position = position
    for expected in seen[2:]:
        np.testing.assert_array_equal(fresh.next()[1], expected)
    other = data.Batches(x, y, 4, seed=4)
    assert not all(np.array_equal(other.next()[1], s) for s in seen[:2])


def test_program_trains_on_mnist_files(mnist_dir, tmp_path):
    directory, _ = mnist_dir
    _, program = compile_program("mlp", tmp_path / "p", batch=4)
    done = run_cli(program, "--data", f"mnist:{directory}", "--iters", "3", "--params", str(tmp_path / "m.npz"),
                   "--test-iters", "1")
    assert done.returncode == 0, done.stderr
    assert f"training mlp on mnist:{directory} (12 examples, batch 4)" in done.stdout
    assert "test accuracy" in done.stdout


def test_program_reports_a_data_mismatch_in_one_line(tmp_path):
    rng = np.random.default_rng(4)
    np.savez(tmp_path / "rgb.npz", x=rng.random((8, 3, 28, 28)).astype(np.float32), y=np.zeros(8, np.int64))
    _, program = compile_program("mlp", tmp_path / "p", batch=4)
    done = run_cli(program, "--data", f"npz:{tmp_path / 'rgb.npz'}", "--iters", "2",
                   "--params", str(tmp_path / "m.npz"))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"npz:{tmp_path / 'rgb.npz'}" in lines[0] and "3x28x28" in lines[0], done.stderr
    assert not (tmp_path / "m.npz").exists()


def test_augmentation_crops_and_flips_as_drawn_and_resumes_exactly():
    """Each augmented image is its zero-padded original cut at the drawn offsets, mirrored where drawn (torchvision's
    RandomCrop(padding=2) then RandomHorizontalFlip()); the draws depend on (seed, epoch, position) only, so a stream
    restarted at a position continues with the same batches; test batches are not augmented."""
    from deepdsl_runtime.data import Augment, Batches, DataError

    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 2, 5, 6)).astype(np.float32)
    y = np.arange(10, dtype=np.int32)
    augment = Augment.parse("crop:2,flip")
    assert augment == Augment(2, True) and not Augment.parse("none")
    straight = Batches(x, y, 4, seed=3, augment=augment)
    seen = []
    for _ in range(7):                                       # crosses epochs and their ends mid-batch
        epoch, offset = straight.position
        xb, yb = (a.copy() for a in straight.next())
        positions = [(epoch + (offset + k) // 10, (offset + k) % 10) for k in range(4)]
        for image, label, (e, at) in zip(xb, yb, positions):
            dy, dx, flip = augment.draws(3, e, 10)[at]
            padded = np.pad(x[label], ((0, 0), (2, 2), (2, 2)))
            want = padded[:, dy:dy + 5, dx:dx + 6]
            np.testing.assert_array_equal(image, want[:, :, ::-1] if flip else want)
            seen.append((dy, dx, flip))
        if len(seen) == 12:
            restart = Batches(x, y, 4, seed=3, augment=augment)
            restart.position = straight.position
    later = [restart.next()[0].copy() for _ in range(4)]
    again = Batches(x, y, 4, seed=3, augment=augment)
    for _ in range(3):
        again.next()
    assert all(np.array_equal(a, again.next()[0]) for a in later)
    assert len({(d[0], d[1]) for d in seen}) > 5 and 0 < sum(d[2] for d in seen) < len(seen)
    plain = Batches(x, y, 4, seed=3)
    assert np.array_equal(plain.next()[0], x[plain.order(0)[:4]])
    for bad in ("crop", "crop:0", "flip,flip", "rotate", "crop:2;flip"):
        with pytest.raises(DataError, match="--augment"):
            Augment.parse(bad)


def test_the_program_augments_and_resumes_augmented_training_exactly(tmp_path):
    _, lenet = compile_program("lenet", tmp_path / "p", batch=8)
    common = ["--data", "digits", "--test-iters", "1", "--quiet", "--augment", "crop:2,flip"]
    straight, resumed, plain = tmp_path / "straight.npz", tmp_path / "resumed.npz", tmp_path / "plain.npz"
    assert run_cli(lenet, "--iters", "4", "--params", str(straight), *common).returncode == 0
    for iters in ("2", "4"):
        done = run_cli(lenet, "--iters", iters, "--params", str(resumed), *common)
        assert done.returncode == 0, done.stderr
    assert run_cli(lenet, "--iters", "4", "--params", str(plain), *common[:-2]).returncode == 0
    a, b, c = (np.load(p) for p in (straight, resumed, plain))
    assert all(np.array_equal(a[k], b[k]) for k in a.files if not k.startswith("__"))
    assert not np.array_equal(a["cv1_W"], c["cv1_W"])
    bad = run_cli(lenet, "--iters", "1", "--params", str(tmp_path / "bad.npz"), "--augment", "mirror")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "--augment 'mirror'" in bad.stderr, bad.stderr


# ----------------------------------------------------------------------------------------------------------------
# text: a language model's bytes

def test_text_is_cut_into_windows_of_tokens_and_next_tokens(tmp_path):
    path = tmp_path / "corpus.txt"
    text = bytes(range(32, 127)) * 3                      # 285 bytes
    path.write_bytes(text)
    got = data.load(f"text:{path}", (8,), 256, tokens=True)
    windows = (len(text) - 1) // 8                        # 35 windows of 8 + 1 bytes overlapping by one
    test = windows // 10
    assert got.x_train.shape == (windows - test, 8) and got.x_test.shape == (test, 8)
    assert got.x_train.dtype == got.y_train.dtype == np.int32
    every_x, every_y = np.concatenate([got.x_train, got.x_test]), np.concatenate([got.y_train, got.y_test])
    source = np.frombuffer(text, np.uint8)
    np.testing.assert_array_equal(every_x.reshape(-1), source[:windows * 8])
    np.testing.assert_array_equal(every_y.reshape(-1), source[1:windows * 8 + 1])      # each token's next one
    stream = data.Batches(got.x_train, got.y_train, 4, seed=2)
    xb, yb = stream.next()
    assert xb.dtype == np.int32 and xb.shape == yb.shape == (4, 8)
    np.testing.assert_array_equal(xb[:, 1:], yb[:, :-1])


def test_text_that_does_not_fit_the_network_is_one_line(tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"too short")
    with pytest.raises(data.DataError, match=r"text:.*short.txt: 9 bytes make 1 window\(s\) of 8 \+ 1 tokens"):
        data.load(f"text:{short}", (8,), 256, tokens=True)
    wide = tmp_path / "wide.txt"
    wide.write_bytes("naïve café ".encode() * 10)
    with pytest.raises(data.DataError, match="byte value 195 outside the network's vocabulary of 128"):
        data.load(f"text:{wide}", (8,), 128, tokens=True)
    with pytest.raises(data.DataError, match="cannot read"):
        data.load(f"text:{tmp_path / 'missing.txt'}", (8,), 256, tokens=True)
    with pytest.raises(data.DataError, match="gives tokens; this network takes images"):
        data.load(f"text:{wide}", (1, 28, 28), 10)
    with pytest.raises(data.DataError, match="does not give tokens"):
        data.load("digits", (8,), 256, tokens=True)
    synthetic = data.load("synthetic", (8,), 50, seed=1, batch=3, tokens=True)
    assert synthetic.x_train.shape == (6, 8) and synthetic.y_test.shape == (3, 8) and synthetic.x_train.max() < 50


def _corpus(lines: int = 700) -> str:
    """Sentences of a small grammar: the next byte is predictable within words, unpredictable between choices."""
    rng = np.random.default_rng(3)
    subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our neighbour"]
    verbs = ["sees", "likes", "finds", "follows", "watches", "calls", "helps"]
    objects = ["the ball", "a red house", "the river", "some bread", "the garden", "a quiet street", "the moon"]
    endings = ["today", "every morning", "at night", "again", "with care", "in the rain"]
    return "".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(endings)}.\n"
                   for _ in range(lines))


def test_the_language_model_learns_a_text_file_well_below_its_unigram_entropy(tmp_path):
    """networks/char_lm.py (a causal Transformer over bytes) trained by its generated program on a text file: the
    test loss (nats per byte, on the file's last tenth) falls far below the entropy of the bytes' frequencies, which
    is the best a model could do that did not look at the preceding bytes."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_corpus())
    counts = np.bincount(np.frombuffer(corpus.read_bytes(), np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * np.log(p)).sum())
    _, program = compile_program("char_lm", tmp_path / "p", batch=16)
    report = tmp_path / "report.json"
    done = run_cli(program, "--data", f"text:{corpus}", "--iters", "250", "--test-iters", "5", "--quiet",
                   "--params", str(tmp_path / "lm.npz"), "--report-json", str(report))
    assert done.returncode == 0, done.stderr
    result = json.loads(report.read_text())
    assert result["test_loss"] < 0.4 * unigram, (result["test_loss"], unigram)
    assert result["peak_bytes_measured"] == result["peak_bytes_planned"]


def test_float_targets_come_from_npz_digits_or_synthetic(tmp_path):
    rng = np.random.default_rng(6)
    x, y = rng.random((10, 1, 4, 4)).astype(np.float32), rng.standard_normal((10, 3)).astype(np.float32)
    np.savez(tmp_path / "regression.npz", x=x, y=y)
    got = data.load(f"npz:{tmp_path / 'regression.npz'}", (1, 4, 4), 0, targets=(3,))
    np.testing.assert_array_equal(got.y_train, y)
    assert got.y_train.dtype == np.float32
    digits = data.load("digits", (1, 8, 8), 0, targets=(1, 8, 8))
    np.testing.assert_array_equal(digits.x_train, digits.y_train)             # each image its own target
    assert data.load("synthetic", (1, 4, 4), 0, batch=2, targets=(3,)).y_test.shape == (2, 3)
    stream = data.Batches(got.x_train, got.y_train, 4, seed=1)
    assert stream.next()[1].dtype == np.float32
    with pytest.raises(data.DataError, match=r"targets 10x3, the network takes Nx1x4x4 images and Nx2 targets"):
        data.load(f"npz:{tmp_path / 'regression.npz'}", (1, 4, 4), 0, targets=(2,))
    with pytest.raises(data.DataError, match="digits: the network's targets are 3"):
        data.load("digits", (1, 8, 8), 0, targets=(3,))
    with pytest.raises(data.DataError, match="gives no float targets"):
        data.load("mnist:/nowhere", (1, 28, 28), 0, targets=(3,))


TEXT_CLASSIFIER = '''
from deepdsl import dsl as D
N, T, V, K = 8, 16, 50, 4
x = D.tokens("x", (N, T), vocab=V)
y = D.labels("y", N, classes=K)
def classify(tokens):
    h = D.embedding("embed", V, 32)(tokens).mean(1)
    return D.full("out", K)(D.relu(D.full("hidden", 32)(h)))
network = D.fn(classify, "textcls")
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("textcls", iters=20, lr=0.1))
'''


def test_token_data_for_a_sequence_classifier_and_a_language_model(tmp_path):
    """Tokens with one label per sequence (a classifier's) or per position (a language model's): synthetic data of
    the network's label shape, npz:PATH of integer tokens checked against the vocabulary and the labels' shape."""
    per_sequence = data.load("synthetic", (16,), 4, batch=8, tokens=True, vocab=50, label_shape=())
    assert per_sequence.x_train.shape[1:] == (16,) and per_sequence.y_train.shape == (len(per_sequence.x_train),)
    assert per_sequence.x_train.max() >= 4 and per_sequence.x_train.max() < 50 and per_sequence.y_train.max() < 4
    per_token = data.load("synthetic", (16,), 50, batch=8, tokens=True, label_shape=(16,))
    assert per_token.y_train.shape == per_token.x_train.shape
    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, (30, 16))
    np.savez(tmp_path / "seq.npz", x=x, y=x[:, 0] % 4)
    np.savez(tmp_path / "lm.npz", x=x, y=np.roll(x, -1, axis=1))
    loaded = data.load(f"npz:{tmp_path / 'seq.npz'}", (16,), 4, tokens=True, vocab=50, label_shape=())
    assert loaded.x_train.dtype == np.int32 and np.array_equal(loaded.y_train, x[:, 0] % 4)
    loaded = data.load(f"npz:{tmp_path / 'lm.npz'}", (16,), 50, tokens=True, label_shape=(16,))
    assert loaded.y_train.shape == (30, 16)
    bad = {"float": dict(x=x.astype(np.float32), y=x[:, 0] % 4), "vocab": dict(x=x + 40, y=x[:, 0] % 4),
           "classes": dict(x=x, y=x[:, 0] % 9), "shape": dict(x=x, y=x % 4), "length": dict(x=x[:, :8], y=x[:, 0] % 4)}
    for name, arrays in bad.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        with pytest.raises(data.DataError) as err:
            data.load(f"npz:{tmp_path / name}.npz", (16,), 4, tokens=True, vocab=50, label_shape=())
        assert f"npz:{tmp_path / name}.npz" in str(err.value), name
    (tmp_path / "text.txt").write_text("some text " * 100)
    with pytest.raises(data.DataError, match="one label per sequence: use npz:PATH"):
        data.load(f"text:{tmp_path / 'text.txt'}", (16,), 4, tokens=True, vocab=256, label_shape=())


def test_a_sequence_classifier_trains_through_the_cli(tmp_path):
    network = tmp_path / "textcls.py"
    network.write_text(TEXT_CLASSIFIER)
    _, program = compile_program(network, tmp_path / "p")
    done = run_cli(program, "--iters", "3", "--params", "", "--test-iters", "1")       # synthetic: its labels' shape
    assert done.returncode == 0, done.stderr
    rng = np.random.default_rng(2)
    x = rng.integers(0, 50, (64, 16))
    np.savez(tmp_path / "seq.npz", x=x, y=x[:, 0] % 4)
    done = run_cli(program, "--data", f"npz:{tmp_path / 'seq.npz'}", "--iters", "150", "--params", "",
                   "--test-iters", "8")
    assert done.returncode == 0, done.stderr
    accuracy = float(done.stdout.split("test accuracy ")[1].split(",")[0])
    assert accuracy > 0.9, done.stdout                     # the label is the first token's class: learnable


RESIDUAL_WITH_DROP_PATH = '''
from deepdsl import dsl as D
x = D.images("x", (8, 1, 28, 28), dataset="digits")
y = D.labels("y", 8, classes=10)
def block(name):
    branch = D.batch_norm(f"{name}_bn") @ D.conv(f"{name}_conv", kernel=3, channels=4, padding=1, bias=False)
    return D.fn(lambda h: D.relu(h + D.drop_path(0.3)(branch(h))), name)
stem = D.relu @ D.conv("stem", kernel=3, channels=4, padding=1)
network = D.full("fc", 10) @ D.flatten @ D.avg_pool() @ block("b2") @ block("b1") @ stem
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("droppath", iters=10, lr=0.05))
'''


def test_a_network_with_drop_path_trains_in_its_plan_and_resumes_exactly(tmp_path):
    """Stochastic depth's per-example masks come from (seed, step, place): a run stopped and resumed equals an
    uninterrupted one bit for bit, and the measured peak is the planned one; the compiled kernels train it as numpy's
    (its masks, uint8 of one value per example, reach numpy's kernels: the compiled ones read floats)."""
    network = tmp_path / "droppath.py"
    network.write_text(RESIDUAL_WITH_DROP_PATH)
    _, program = compile_program(network, tmp_path / "p")
    report = tmp_path / "r.json"
    done = run_cli(program, "--iters", "6", "--params", str(tmp_path / "a.npz"), "--report-json", str(report),
                   "--test-iters", "1", "--kernels", "numpy")
    assert done.returncode == 0, done.stderr
    figures = json.loads(report.read_text())
    assert figures["peak_bytes_measured"] == figures["peak_bytes_planned"] and np.isfinite(figures["loss"])
    for iters in ("3", "6"):
        done = run_cli(program, "--iters", iters, "--params", str(tmp_path / "b.npz"), "--test-iters", "0",
                       "--kernels", "numpy")
        assert done.returncode == 0, done.stderr
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in a.files if not k.startswith("__"))
    done = run_cli(program, "--iters", "6", "--params", str(tmp_path / "c.npz"), "--test-iters", "0",
                   "--kernels", "compiled")
    assert done.returncode == 0, done.stderr
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "c.npz") as c:
        for k in (k for k in a.files if not k.startswith("__")):
            np.testing.assert_allclose(c[k], a[k], rtol=1e-4, atol=1e-5, err_msg=k)
