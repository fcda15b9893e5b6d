"""Datasets for generated training programs, chosen by a `--data SPEC` string, and the batch streams over them.

Specs:
- `digits`: scikit-learn's bundled 8x8 handwritten digits (1797 real images, no download), resized bilinearly to
  the network's input size and scaled to [0, 1]; a fixed split keeps 300 images for testing.
- `mnist:DIR`: the MNIST IDX files in DIR (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
  `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each optionally gzipped), scaled to [0, 1].
- `cifar10:DIR`: the CIFAR-10 binary batches in DIR or DIR/cifar-10-batches-bin (`data_batch_*.bin`,
  `test_batch.bin`; one label byte and 3072 pixel bytes per image), scaled to [0, 1].
- `npz:PATH`: arrays `x` (N,C,H,W or N,H,W) and `y` (or `x_train` and `y_train`, as Keras names them),
  optionally `x_test` and `y_test` (else the training arrays are also the test set); an array without its partner
  (`x_test` without `y_test`, ...) is an error. Integer pixels are scaled by 1/255; labels are checked against the
  classes before they become int32. For a network of float targets (`D.targets`), `y` holds them, of the network's
  target shape per example.
- `synthetic`: normally distributed images and uniform labels (for timing; there is nothing to learn); for a network
  of tokens, uniform tokens and next tokens; of float targets, normal targets.
- `digits` for a network whose float targets have its images' shape: each image is its own target (an
  autoencoder's).
- `text:PATH` (networks of tokens, a language model's): the bytes of the file as tokens, cut into consecutive
  windows of the network's T + 1 bytes overlapping by one: the example is the first T, its labels the last T (each
  token's next one). The last tenth of the windows (at least one) is the test set. Byte values must lie below the
  network's vocabulary.
- `folder:DIR`, `shards:PATTERN`: images read from files a batch at a time, not loaded here: `image_stream`.
Images must have the network's channels and size (only `digits` is resized); a mismatch is a `DataError` naming
the spec. Labels must lie in [0, classes).

Batches: training batches follow a fresh permutation each epoch, drawn from (seed, epoch) alone, so the position
(epoch, offset) is the whole state of the stream and a resumed run sees exactly the batches it would have seen.
Augmentation (`Augment`, `--augment crop:P,flip`), when asked, is drawn the same way: per epoch, per position in
it, from (seed, epoch), so it is resumed exactly too.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Augment", "Batches", "DataError", "Dataset", "Order", "load", "resize_bilinear"]

DIGITS_TEST = 300


class DataError(Exception):
    """A dataset that cannot be read or does not fit the network (one line, naming the spec)."""


@dataclass
class Dataset:
    spec: str
    x_train: np.ndarray      # (N, C, H, W) float32 images, or (N, T) int32 tokens
    y_train: np.ndarray      # (N,) int32 labels, or (N, T) the next tokens
    x_test: np.ndarray
    y_test: np.ndarray


def load(spec: str, image_shape: tuple[int, ...], classes: int, seed: int = 0, batch: int = 1,
         tokens: bool = False, targets: tuple[int, ...] | None = None, vocab: int | None = None,
         label_shape: tuple[int, ...] | None = None) -> Dataset:
    """The dataset named by `spec`, checked against the network's (C, H, W) input and its number of classes; for a
    network of `tokens`, against its (T,) input, its vocabulary (`vocab`, default `classes`) and its labels: one per
    position (`label_shape` (T,), a language model's next tokens: the default) or one per sequence (`label_shape`
    (), a sequence classifier's, of `classes` classes); for a network of float `targets` (their shape per example),
    against their shape."""
    kind, _, arg = spec.partition(":")
    if targets is not None:
        return _with_targets(spec, kind, arg, tuple(image_shape), tuple(targets), seed, batch)
    if tokens:
        vocab = vocab or classes
        per_sequence = label_shape is not None and tuple(label_shape) == ()
        if kind == "text" and arg:
            if per_sequence:
                raise DataError(f"data spec '{spec}' gives each position's next byte, and this network takes one "
                                "label per sequence: use npz:PATH (x: N x T integer tokens, y: N labels)")
            data = _text(spec, arg, image_shape[0], vocab)
        elif kind == "synthetic" and not arg:
            data = _synthetic_tokens(spec, image_shape[0], vocab, seed, batch, classes if per_sequence else None)
        elif kind == "npz" and arg:
            data = _npz(spec, arg, classes=classes, tokens=(image_shape[0], vocab, not per_sequence))
        else:
            raise DataError(f"data spec '{spec}' does not give tokens, which this network takes (use text:PATH, "
                            "npz:PATH or synthetic)")
        for x, y, part in ((data.x_train, data.y_train, "training"), (data.x_test, data.y_test, "test")):
            if len(x) != len(y) or (not per_sequence and y.shape != x.shape):
                raise DataError(f"{spec}: {part} tokens of shape {_dims(x.shape)} and labels of shape "
                                f"{_dims(y.shape)}: " + ("one label per sequence" if per_sequence else
                                                        "one label per token"))
            if len(x) == 0:
                raise DataError(f"{spec}: no {part} sequences")
        return data
    if kind == "text":
        raise DataError(f"data spec '{spec}' gives tokens; this network takes images (use digits, synthetic, "
                        "mnist:DIR, cifar10:DIR or npz:PATH)")
    if kind == "digits" and not arg:
        data = _digits(spec, image_shape)
    elif kind == "synthetic" and not arg:
        data = _synthetic(spec, image_shape, classes, seed, batch)
    elif kind == "mnist" and arg:
        data = _mnist(spec, arg)
    elif kind == "cifar10" and arg:
        data = _cifar10(spec, arg)
    elif kind == "npz" and arg:
        data = _npz(spec, arg, classes=classes)
    else:
        raise DataError(f"unknown data spec '{spec}' (use digits, synthetic, mnist:DIR, cifar10:DIR, npz:PATH or "
                        "text:PATH)")
    for x, y, part in ((data.x_train, data.y_train, "training"), (data.x_test, data.y_test, "test")):
        if x.shape[1:] != tuple(image_shape):
            raise DataError(f"{spec}: {part} images are {_dims(x.shape[1:])} (CxHxW), the network takes "
                            f"{_dims(image_shape)}")
        if len(x) != len(y):
            raise DataError(f"{spec}: {len(x)} {part} images but {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{spec}: no {part} images")
        if y.size and (y.min() < 0 or y.max() >= classes):
            raise DataError(f"{spec}: {part} labels range over [{y.min()}, {y.max()}], the network has {classes} "
                            "classes")
    return data


def _dims(shape) -> str:
    return "x".join(map(str, shape))


# ----------------------------------------------------------------------------------------------------------------
# sources

def resize_bilinear(images: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Resize (N, H, W) images to `size` by bilinear interpolation with half-pixel centres (align_corners=False,
    as PyTorch's `interpolate`)."""
    def weights(n_in: int, n_out: int) -> np.ndarray:
        src = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0, n_in - 1)
        lo = np.floor(src).astype(int)
        hi = np.minimum(lo + 1, n_in - 1)
        frac = src - lo
        m = np.zeros((n_out, n_in))
        m[np.arange(n_out), lo] += 1 - frac
        m[np.arange(n_out), hi] += frac
        return m

    rows, cols = weights(images.shape[1], size[0]), weights(images.shape[2], size[1])
    return np.einsum("ih,nhw,jw->nij", rows, images.astype(np.float64), cols)


def _digits_arrays(spec: str = "digits") -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits of 8x8 pixels (float64, 0 to 16) and their labels, as scikit-learn's `load_digits` gives
    them (`images`, `target`): read from the file scikit-learn ships them in (`datasets/data/digits.csv.gz`) as it
    reads it, without importing scikit-learn, whose import (it brings in scipy) took 1.3 s of CPU time, most of a
    small program's start; through `load_digits` where that file is not there."""
    found = importlib.util.find_spec("sklearn")
    for folder in (found.submodule_search_locations or ()) if found else ():
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            try:
                with gzip.open(path, mode="rt", encoding="utf-8") as text:
                    data = np.loadtxt(text, delimiter=",")
            except (OSError, ValueError, EOFError) as err:
                raise DataError(f"{spec}: cannot read scikit-learn's {path}: {err}") from None
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError(f"{spec}: needs scikit-learn (pip install scikit-learn)") from None
    bunch = load_digits()
    return bunch.images, bunch.target


def _digits(spec: str, image_shape) -> Dataset:
    c, h, w = image_shape
    if c != 1:
        raise DataError(f"{spec}: the digits have 1 channel, the network takes {c}")
    digits, target = _digits_arrays(spec)
    images = resize_bilinear(digits / 16.0, (h, w)).astype(np.float32)[:, None]
    labels = target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))      # fixed split, whatever --seed is
    test, train = order[:DIGITS_TEST], order[DIGITS_TEST:]
    return Dataset(spec, images[train], labels[train], images[test], labels[test])


def _synthetic(spec: str, image_shape, classes: int, seed: int, batch: int) -> Dataset:
    rng = np.random.default_rng([seed, 12345])
    n = max(2 * batch, 2)
    x = rng.standard_normal((n + batch,) + tuple(image_shape), dtype=np.float32)
    y = rng.integers(0, classes, n + batch, dtype=np.int32)
    return Dataset(spec, x[:n], y[:n], x[n:], y[n:])


def _with_targets(spec: str, kind: str, arg: str, image_shape, targets, seed: int, batch: int) -> Dataset:
    """Images and float targets: `synthetic` (normal both), `npz:PATH` (float arrays `y`), or `digits` for targets
    of the images' own shape: each image is its own target (an autoencoder's)."""
    if kind == "synthetic" and not arg:
        rng = np.random.default_rng([seed, 54321])
        n = max(2 * batch, 2)
        x = rng.standard_normal((n + batch,) + image_shape, dtype=np.float32)
        y = rng.standard_normal((n + batch,) + targets, dtype=np.float32)
        return Dataset(spec, x[:n], y[:n], x[n:], y[n:])
    if kind == "digits" and not arg:
        if targets != image_shape:
            raise DataError(f"digits: the network's targets are {_dims(targets)}, not its {_dims(image_shape)} "
                            "images (digits gives images as their own targets)")
        images = _digits(spec, image_shape)
        return Dataset(spec, images.x_train, images.x_train, images.x_test, images.x_test)     # read, never written
    if kind == "npz" and arg:
        data = _npz(spec, arg, float_targets=True)
    else:
        raise DataError(f"data spec '{spec}' gives no float targets, which this network takes (use synthetic, "
                        "npz:PATH with float y, or digits for targets the images' size)")
    for x, y, part in ((data.x_train, data.y_train, "training"), (data.x_test, data.y_test, "test")):
        if x.shape[1:] != image_shape or y.shape[1:] != targets or len(x) != len(y):
            raise DataError(f"{spec}: {part} images {_dims(x.shape)} and targets {_dims(y.shape)}, the network takes "
                            f"Nx{_dims(image_shape)} images and Nx{_dims(targets)} targets")
    return data


TEXT_TEST_FRACTION = 10      # the last 1/10 of a text's windows is its test set


def _text(spec: str, path: str, length: int, vocab: int) -> Dataset:
    """Windows of `length` + 1 consecutive bytes of the file at `path`, overlapping by one: tokens and next tokens."""
    try:
        data = np.frombuffer(_read(path), dtype=np.uint8)
    except (OSError, EOFError, zlib.error) as err:        # a truncated gzip: EOFError; a damaged one: the others
        raise DataError(f"{spec}: cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    windows = (len(data) - 1) // length
    if windows < 2:
        raise DataError(f"{spec}: {len(data)} bytes make {max(windows, 0)} window(s) of {length} + 1 tokens; the "
                        "network needs at least 2 (one to train on, one to test)")
    if int(data.max()) >= vocab:
        raise DataError(f"{spec}: byte value {int(data.max())} outside the network's vocabulary of {vocab} tokens")
    starts = np.arange(windows) * length
    x = data[starts[:, None] + np.arange(length)].astype(np.int32)
    y = data[starts[:, None] + np.arange(1, length + 1)].astype(np.int32)
    test = max(1, windows // TEXT_TEST_FRACTION)
    return Dataset(spec, x[:-test], y[:-test], x[-test:], y[-test:])


def _synthetic_tokens(spec: str, length: int, vocab: int, seed: int, batch: int,
                      classes: int | None = None) -> Dataset:
    """Uniform tokens, and uniform next tokens (a language model's), or with `classes` one uniform label per
    sequence (a sequence classifier's)."""
    rng = np.random.default_rng([seed, 12345])
    n = max(2 * batch, 2)
    x = rng.integers(0, vocab, (n + batch, length), dtype=np.int32)
    if classes is None:
        y = rng.integers(0, vocab, (n + batch, length), dtype=np.int32)
    else:
        y = rng.integers(0, classes, n + batch, dtype=np.int32)
    return Dataset(spec, x[:n], y[:n], x[n:], y[n:])


def _read(path: str) -> bytes:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read()


def _find(spec: str, directory: str, names: list[str]) -> str:
    for name in names:
        for candidate in (name, name + ".gz"):
            path = os.path.join(directory, candidate)
            if os.path.isfile(path):
                return path
    raise DataError(f"{spec}: no {names[0]}[.gz] in {directory}")


def read_idx(path: str, spec: str) -> np.ndarray:
    """An array from an IDX file (MNIST's format: two zero bytes, a type byte, the rank, big-endian sizes)."""
    try:
        raw = _read(path)
    except (OSError, EOFError, zlib.error) as err:          # gzip.BadGzipFile is an OSError
        raise DataError(f"{spec}: cannot read {os.path.basename(path)}: {type(err).__name__}: {err}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{spec}: {os.path.basename(path)} is not an IDX file (bad magic number)")
    types = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in types:
        raise DataError(f"{spec}: {os.path.basename(path)}: unknown IDX element type 0x{raw[2]:02x}")
    rank = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank))
    dtype = np.dtype(types[raw[2]])
    expected = 4 + 4 * rank + int(np.prod(dims)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"{spec}: {os.path.basename(path)} has {len(raw)} bytes, its header says {expected}")
    return np.frombuffer(raw, dtype=dtype, offset=4 + 4 * rank).reshape(dims)


def _mnist(spec: str, directory: str) -> Dataset:
    if not os.path.isdir(directory):
        raise DataError(f"{spec}: {directory} is not a directory")
    arrays = []
    for prefix in ("train", "t10k"):
        images = read_idx(_find(spec, directory, [f"{prefix}-images-idx3-ubyte", f"{prefix}-images.idx3-ubyte"]), spec)
        labels = read_idx(_find(spec, directory, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"]), spec)
        if images.ndim != 3 or labels.ndim != 1:
            raise DataError(f"{spec}: {prefix} images must be a 3-D and labels a 1-D IDX array")
        arrays += [(images.astype(np.float32) / 255.0)[:, None], labels.astype(np.int32)]
    return Dataset(spec, *arrays)


CIFAR_RECORD = 1 + 3 * 32 * 32


def _cifar_file(spec: str, path: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as err:
        raise DataError(f"{spec}: cannot read {os.path.basename(path)}: {err}") from None
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise DataError(f"{spec}: {os.path.basename(path)} has {raw.size} bytes, not a multiple of the "
                        f"{CIFAR_RECORD}-byte CIFAR-10 record")
    records = raw.reshape(-1, CIFAR_RECORD)
    images = records[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    return images, records[:, 0].astype(np.int32)


def _cifar10(spec: str, directory: str) -> Dataset:
    nested = os.path.join(directory, "cifar-10-batches-bin")
    if os.path.isdir(nested):
        directory = nested
    if not os.path.isdir(directory):
        raise DataError(f"{spec}: {directory} is not a directory")
    train_files = sorted(f for f in os.listdir(directory) if f.startswith("data_batch_") and f.endswith(".bin"))
    if not train_files:
        raise DataError(f"{spec}: no data_batch_*.bin in {directory}")
    test_path = os.path.join(directory, "test_batch.bin")
    if not os.path.isfile(test_path):
        raise DataError(f"{spec}: no test_batch.bin in {directory}")
    parts = [_cifar_file(spec, os.path.join(directory, f)) for f in train_files]
    x_test, y_test = _cifar_file(spec, test_path)
    return Dataset(spec, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                   x_test, y_test)


def read_npz(spec: str, path: str) -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name (a one-line DataError naming `spec` and the file if it is not one)."""
    if os.path.isdir(path):
        raise DataError(f"{spec}: {path} is a directory, not an .npz file")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise DataError(f"{spec}: cannot read {path}: {type(err).__name__}: {err}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{spec}: {path} holds a single array, not an .npz archive of arrays 'x' and 'y'")
    try:
        with loaded:
            arrays = {k: loaded[k] for k in loaded.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as err:
        raise DataError(f"{spec}: cannot read {path}: {type(err).__name__}: {err}") from None
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray):
            raise DataError(f"{spec}: member '{key}' of {path} is not an .npy array")
    return arrays


def npz_inputs(spec: str, path: str, key: str, x: np.ndarray,
               tokens: tuple[int, int, bool] | None = None) -> np.ndarray:
    """Array `key` of an .npz as a network's inputs: images (N, C, H, W) or (N, H, W) as float32, integer pixels
    scaled by 1/255; with `tokens` = (T, vocab, per_token), integer tokens (N, T) in [0, vocab) as int32."""
    if tokens is not None:
        length, vocab, _ = tokens
        if x.ndim != 2 or x.shape[1] != length or x.dtype.kind not in "iu":
            raise DataError(f"{spec}: array '{key}' must hold integer tokens of shape N x {length}, got {x.dtype} "
                            f"of shape {x.shape}")
        if x.size and (int(x.min()) < 0 or int(x.max()) >= vocab):
            raise DataError(f"{spec}: array '{key}' of {path}: tokens range over [{x.min()}, {x.max()}], the "
                            f"network's vocabulary has {vocab}")
        return np.ascontiguousarray(x, dtype=np.int32)
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DataError(f"{spec}: array '{key}' must be N,C,H,W or N,H,W, got shape {x.shape}")
    if x.dtype.kind not in "iuf":
        raise DataError(f"{spec}: array '{key}' must hold numbers (integer or float pixels), got {x.dtype}")
    scale = 1 / 255.0 if np.issubdtype(x.dtype, np.integer) else 1.0
    x = np.ascontiguousarray(x.astype(np.float32) * np.float32(scale))
    if not np.all(np.isfinite(x)):
        raise DataError(f"{spec}: array '{key}' holds NaN or infinite pixels")
    return x


def npz_labels(spec: str, path: str, key: str, y: np.ndarray, float_targets: bool = False,
               classes: int | None = None, tokens: tuple[int, int, bool] | None = None) -> np.ndarray:
    """Array `key` of an .npz as labels: integers (N,) in [0, classes) as int32, (N, T) with `tokens` whose
    per_token is set; or float targets as float32."""
    if float_targets:
        if y.dtype.kind not in "iuf":
            raise DataError(f"{spec}: array '{key}' must hold finite numbers (the targets), got {y.dtype}")
        y = np.ascontiguousarray(y, dtype=np.float32)
        if not np.all(np.isfinite(y)):          # after the cast: float64 beyond float32's range becomes inf
            raise DataError(f"{spec}: array '{key}' holds NaN, infinite or beyond-float32 targets")
        return y
    rank = 2 if tokens is not None and tokens[2] else 1        # a label per position, or per example
    if y.ndim != rank or not np.issubdtype(y.dtype, np.integer):
        what = "integer labels of shape N x T (one per position)" if rank == 2 else "integer labels of shape N"
        raise DataError(f"{spec}: array '{key}' must hold {what}, got {y.dtype} of shape {y.shape}")
    # the range before the cast: int64 2^32 + 3 would become 3, a valid label
    above = 2 ** 31 if classes is None else classes
    if y.size and (int(y.min()) < 0 or int(y.max()) >= above):
        raise DataError(f"{spec}: array '{key}' of {path}: labels range over [{y.min()}, {y.max()}], "
                        + (f"the network has {classes} classes" if classes is not None else
                           "labels must lie in [0, 2^31)"))
    return y.astype(np.int32)


def _npz(spec: str, path: str, float_targets: bool = False, classes: int | None = None,
         tokens: tuple[int, int, bool] | None = None) -> Dataset:
    """Arrays `x` and `y` (or `x_train`, `y_train` and `x_test`, `y_test`) of an .npz: inputs (`npz_inputs`) and
    labels or targets (`npz_labels`)."""
    arrays = read_npz(spec, path)
    for x_key, y_key in (("x", "y"), ("x_train", "y_train"), ("x_test", "y_test")):
        for key, partner in ((x_key, y_key), (y_key, x_key)):
            if key in arrays and partner not in arrays:      # never fall back to other arrays for the missing one
                raise DataError(f"{spec}: no array '{partner}' in {path}, which has '{key}'")
    if "x" in arrays and "x_train" in arrays:
        raise DataError(f"{spec}: {path} has both 'x' and 'x_train'; keep one pair of training arrays")
    train = ("x", "y") if "x" in arrays or "x_train" not in arrays else ("x_train", "y_train")
    for key in train:
        if key not in arrays:
            raise DataError(f"{spec}: no array '{key}' in {path}")

    def images(key):
        return npz_inputs(spec, path, key, arrays[key], tokens)

    def labels(key):
        return npz_labels(spec, path, key, arrays[key], float_targets, classes, tokens)

    x, y = images(train[0]), labels(train[1])
    if "x_test" in arrays:
        return Dataset(spec, x, y, images("x_test"), labels("y_test"))
    return Dataset(spec, x, y, x, y)


# ----------------------------------------------------------------------------------------------------------------
# batch streams

def evaluation_extent(total: int, batch: int, batches: int | None = None) -> tuple[int, int]:
    """(batches, examples) of a test pass over `total` examples in batches of `batch`: all of them, or the first
    `batches` batches, never more than one pass (a last partial batch counts only the examples it adds)."""
    count = -(-total // batch) if batches is None else min(batches, -(-total // batch))
    return count, min(count * batch, total)


@dataclass(frozen=True)
class Augment:
    """Training-data augmentation as torchvision's RandomCrop(size, padding=crop) then RandomHorizontalFlip():
    each image padded with `crop` zeros on every side and cut back to its size at a random offset in [0, 2 crop]
    on each axis, then mirrored left-right with probability 1/2. Spec: `none`, or `crop:P`, `flip` joined by
    commas (`crop:4,flip`)."""

    crop: int = 0
    flip: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Augment":
        crop, flip = 0, False
        if spec != "none":
            for part in str(spec).split(","):
                name, _, value = part.partition(":")
                if name == "flip" and not value and not flip:
                    flip = True
                elif name == "crop" and value.isdigit() and int(value) > 0 and not crop:
                    crop = int(value)
                else:
                    raise DataError(f"--augment {spec!r}: use none, or crop:P (P > 0) and flip joined by commas")
        return cls(crop, flip)

    def __bool__(self) -> bool:
        return bool(self.crop or self.flip)

    def draws(self, seed: int, epoch: int, count: int) -> np.ndarray:
        """(count, 3) integers of one epoch, one row per position in it: the crop's offsets and whether to flip."""
        rng = np.random.default_rng([seed, epoch, 0xA06])
        return np.stack([rng.integers(0, 2 * self.crop + 1, count), rng.integers(0, 2 * self.crop + 1, count),
                         rng.integers(0, 2, count) if self.flip else np.zeros(count, np.int64)], axis=1)

    def apply(self, images: np.ndarray, draws: np.ndarray, padded: np.ndarray | None) -> None:
        """Augment (N, C, H, W) `images` in place by their rows of `draws`; `padded` is (C, H + 2 crop, W + 2 crop)
        of scratch, zero outside its centre."""
        h, w = images.shape[2:]
        for image, (dy, dx, flip) in zip(images, draws):
            if self.crop:
                padded[:, self.crop:self.crop + h, self.crop:self.crop + w] = image
                image[...] = padded[:, dy:dy + h, dx:dx + w]
            if flip:
                image[...] = image[:, :, ::-1].copy()


class Order:
    """The positions of a stream of examples over a set of `size`: shuffled, each epoch follows its own permutation
    drawn from (seed, epoch), and a batch that crosses the end of an epoch continues into the next; not shuffled,
    the examples in order, wrapping around. The position (epoch, offset) is the whole state."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True):
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size))
        return self._order[1]

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next `count` positions, advancing past them: the examples' indices, the epoch of each and its offset
        in that epoch."""
        indices, epochs, offsets, need = [], [], [], count
        while need:
            order = self.order(self.epoch)
            take = order[self.offset:self.offset + need]
            indices.append(take)
            epochs.append(np.full(len(take), self.epoch, np.int64))
            offsets.append(np.arange(self.offset, self.offset + len(take)))
            need -= len(take)
            self.offset += len(take)
            if self.offset == len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        if len(indices) == 1:
            return indices[0], epochs[0], offsets[0]
        return np.concatenate(indices), np.concatenate(epochs), np.concatenate(offsets)

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.offset

    @position.setter
    def position(self, value: tuple[int, int]) -> None:
        epoch, offset = (int(v) for v in value)
        if epoch < 0 or not 0 <= offset < self.size:
            raise ValueError(f"data position ({epoch}, {offset}) outside a dataset of {self.size} examples")
        self.epoch, self.offset = epoch, offset


class Batches:
    """Batches of `batch` examples into reused buffers, in the positions of an `Order` over them. With `augment`,
    each example is augmented by the draws of its position in its epoch (`Augment.draws`)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, seed: int = 0, shuffle: bool = True,
                 augment: Augment = Augment()):
        self.x, self.y, self.batch, self.seed, self.augment = x, y, batch, seed, augment
        self.positions = Order(len(x), seed, shuffle)
        self._draws: tuple[int, np.ndarray] | None = None
        self.xb = np.empty((batch,) + x.shape[1:], dtype=np.int32 if x.dtype == np.int32 else np.float32)
        self.yb = np.empty((batch,) + y.shape[1:], dtype=np.float32 if y.dtype.kind == "f" else np.int32)
        self._padded = None
        if augment.crop and x.ndim == 4:
            c, h, w = x.shape[1:]
            self._padded = np.zeros((c, h + 2 * augment.crop, w + 2 * augment.crop), np.float32)

    def order(self, epoch: int) -> np.ndarray:
        return self.positions.order(epoch)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        index, epochs, offsets = self.positions.take(self.batch)
        np.take(self.x, index, axis=0, out=self.xb)
        np.take(self.y, index, axis=0, out=self.yb)
        if self.augment and self.xb.ndim == 4:
            # the positions run through one epoch, then the next: each epoch's draws sliced once
            draws = np.concatenate([self.epoch_draws(int(e))[offsets[epochs == e]] for e in np.unique(epochs)])
            self.augment.apply(self.xb, draws, self._padded)
        return self.xb, self.yb

    def epoch_draws(self, epoch: int) -> np.ndarray:
        if self._draws is None or self._draws[0] != epoch:
            self._draws = (epoch, self.augment.draws(self.seed, epoch, len(self.x)))
        return self._draws[1]

    @property
    def position(self) -> tuple[int, int]:
        return self.positions.position

    @position.setter
    def position(self, value: tuple[int, int]) -> None:
        self.positions.position = value
