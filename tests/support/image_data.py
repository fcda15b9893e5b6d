"""Image data sets written by the tests: scikit-learn's digits as class folders of PNG or JPEG files (the split of
`deepdsl_runtime.data`'s in-memory digits: its 300 test images are the validation split), the same packed as tar
shards, and damaged copies of files."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from deepdsl_runtime import data as datasets


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, val images, val labels): uint8 8x8 images, round(v * 255 / 16)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.round(bunch.images * 255 / 16).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(bunch.target))       # as data._digits splits them
    test, train = order[:datasets.DIGITS_TEST], order[datasets.DIGITS_TEST:]
    return images[train], bunch.target[train], images[test], bunch.target[test]


def encode(image: np.ndarray, fmt: str) -> bytes:
    """A grey uint8 (H, W) image as PNG (Pillow) or JPEG (simplejpeg, quality 95) bytes."""
    if fmt == "png":
        import io

        from PIL import Image
        buffer = io.BytesIO()
        Image.fromarray(image, mode="L").save(buffer, format="PNG")
        return buffer.getvalue()
    import simplejpeg
    return simplejpeg.encode_jpeg(np.ascontiguousarray(image[:, :, None]), quality=95, colorspace="GRAY")


def write_digits_folder(directory: Path, fmt: str = "png", train: int | None = None,
                        val: int | None = None) -> Path:
    """The digits as `directory/train/<digit>/<n>.<fmt>` and `directory/val/...` (the first `train` and `val`
    images of each split; None: all); the directory."""
    directory = Path(directory)
    x_train, y_train, x_val, y_val = digits_split()
    ext = "jpg" if fmt in ("jpg", "jpeg") else "png"
    for split, x, y, count in (("train", x_train, y_train, train), ("val", x_val, y_val, val)):
        for n in range(len(x) if count is None else count):
            path = directory / split / str(int(y[n])) / f"{n:05d}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode(x[n], ext))
    return directory


def pack_shards(folder: Path, out: Path, shard_bytes: int = 1 << 20) -> str:
    """The folder's splits packed as tar shards in `out` (`deepdsl_runtime.image_index.pack`, what `deepdsl data
    pack` runs): the training shards' pattern, for `shards:`."""
    from deepdsl_runtime import image_index

    return image_index.pack(f"folder:{folder}", str(out), shard_bytes, say=lambda text: None)["train"]


def truncate(path: Path, keep: float = 0.6) -> None:
    """Keep the first `keep` of the file's bytes."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:int(len(data) * keep)])


def flip_bit(path: Path, at: float = 0.5, bit: int = 4, byte: int | None = None) -> None:
    """Flip one bit of the file: of the byte at fraction `at` of its length, or of byte number `byte`."""
    data = bytearray(Path(path).read_bytes())
    data[int(len(data) * at) if byte is None else byte] ^= 1 << bit
    Path(path).write_bytes(bytes(data))
