"""Manifests of image data sets (deepdsl_runtime.image_index) and `deepdsl data index|check|pack` through the real
CLI: layouts, the cache and when it is rebuilt, shards and their faults, packing round trips, bad files listed."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("simplejpeg")
pytest.importorskip("PIL")

from deepdsl_runtime import image_index  # noqa: E402
from deepdsl_runtime.data import DataError  # noqa: E402
from tests.support import image_data  # noqa: E402


def deepdsl(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepdsl", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("deepdsl: error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def load(spec: str, split: str = "train", **kwargs) -> image_index.Index:
    train, val = image_index.splits(spec)
    if split == "train":
        return image_index.load_index(train, spec, "train", **kwargs)
    return image_index.load_index(val, spec, "val", classes=load(spec).classes, **kwargs)


@pytest.fixture
def digits(tmp_path) -> Path:
    return image_data.write_digits_folder(tmp_path / "digits", fmt="png", train=60, val=20)


def test_a_folder_is_indexed_as_torchvision_numbers_it(digits):
    index = load(f"folder:{digits}")
    files = sorted(p for p in (digits / "train").rglob("*.png"))
    assert len(index) == len(files) == 60 and index.classes == tuple(str(d) for d in range(10))
    names = sorted(index.name(i) for i in range(len(index)))
    assert names == sorted(f"train/{p.parent.name}/{p.name}" for p in files)
    for i in range(len(index)):
        path = digits / index.name(i)
        assert index.read(i) == path.read_bytes() and int(index.sizes[i]) == path.stat().st_size
        assert index.classes[index.labels[i]] == path.parent.name
    val = load(f"folder:{digits}", "val")
    assert len(val) == 20 and val.classes == index.classes and val.digest != index.digest


def test_the_cache_is_used_while_the_class_folders_are_unchanged(digits, tmp_path):
    spec = f"folder:{digits}"
    first = load(spec)
    cache = digits / ".deepdsl-index-train.npz"
    stamp = cache.stat().st_mtime_ns
    again = load(spec)
    assert cache.stat().st_mtime_ns == stamp and again.digest == first.digest       # read, not rebuilt
    extra = digits / "train" / "3" / "extra.png"
    extra.write_bytes(next((digits / "train" / "3").glob("0*.png")).read_bytes())
    grown = load(spec)
    assert len(grown) == len(first) + 1 and grown.digest != first.digest
    cache.write_bytes(b"not an archive")
    said = []
    assert load(spec, say=said.append).digest == grown.digest
    assert any("cannot be read; building it again" in s for s in said)


def test_a_read_only_data_directory_caches_in_the_users_cache(digits, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    load(f"folder:{digits}")
    assert list((tmp_path / "cache" / "deepdsl" / "index").glob("*-train.npz"))
    assert not (digits / ".deepdsl-index-train.npz").exists()


def test_folder_faults(digits, tmp_path):
    (digits / "train" / "README.txt").write_text("about these digits")
    (digits / "train" / "3" / "notes.txt").write_text("a note")
    (digits / "train" / "10").mkdir()
    said = []
    index = load(f"folder:{digits}", say=said.append, rebuild=True)
    assert index.classes[-1] == "9" and "10" in index.classes                 # the empty class keeps its label
    assert any("ignored 1 non-image file" in s and "notes.txt" in s for s in said), said
    assert any("10" in s and "no images" in s for s in said), said
    (digits / "val" / "cat").mkdir()
    with pytest.raises(DataError, match="class folder 'cat' of the val split is not a class of the training split"):
        load(f"folder:{digits}", "val")
    with pytest.raises(DataError, match="is not a directory"):
        image_index.splits(f"folder:{tmp_path / 'missing'}")
    victim = digits / index.name(5)
    victim.write_bytes(victim.read_bytes()[:10])
    with pytest.raises(image_index.RecordError, match="10 bytes where the manifest has"):
        index.read(5)
    victim.unlink()
    with pytest.raises(image_index.RecordError, match="No such file"):
        index.read(5)


def test_pack_round_trip_and_deterministic_bytes(digits, tmp_path):
    out = tmp_path / "shards"
    done = deepdsl("data", "pack", f"folder:{digits}", "-o", str(out), "--shard-bytes", "16k")
    assert done.returncode == 0, done.stderr
    pattern = done.stdout.splitlines()[0].split(": ", 1)[1]
    assert f"--data shards:'{pattern}'" in done.stdout
    folder, shards = load(f"folder:{digits}"), load(f"shards:{pattern}")
    assert len(shards.shards) > 1 and shards.classes == folder.classes
    assert len(shards) == len(folder)
    for i in range(len(folder)):                  # keys are the folder's record numbers
        assert shards.read(i) == folder.read(i) and shards.labels[i] == folder.labels[i]
        assert shards.name(i).endswith(f":{i:09d}.png")
    val = load(f"shards:{pattern}", "val")
    assert len(val) == 20
    again = tmp_path / "again"
    assert deepdsl("data", "pack", f"folder:{digits}", "-o", str(again), "--shard-bytes", "16k").returncode == 0
    for a in sorted(out.glob("*.tar")):
        assert (again / a.name).read_bytes() == a.read_bytes()
    with tarfile.open(sorted(out.glob("train-*.tar"))[0]) as tar:                 # a standard tar
        assert tar.getnames()[:2] == ["000000000.png", "000000000.cls"]
    assert "already holds files" in error_line(deepdsl("data", "pack", f"folder:{digits}", "-o", str(out)))
    assert "lies inside the data set" in error_line(deepdsl("data", "pack", f"folder:{digits}", "-o",
                                                            str(digits / "out")))


def shard(path: Path, members: dict[str, bytes], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_shard_faults(tmp_path):
    png = image_data.encode(np.zeros((8, 8), np.uint8), "png")
    cases = {"no label": ({"a.png": png, "b.png": png, "b.cls": b"1"}, "sample 'a' has an image but no a.cls"),
             "not an integer": ({"a.png": png, "a.cls": b"cat"}, "label a.cls is not an integer"),
             "no image": ({"a.cls": b"1"}, "sample 'a' has a label but no image")}
    for name, (members, message) in cases.items():
        directory = tmp_path / name.replace(" ", "_")
        directory.mkdir()
        shard(directory / "train-000000.tar", members)
        assert message in error_line(deepdsl("data", "index", f"shards:{directory}/train-{{000000..000000}}.tar"))
    shard(tmp_path / "train-000000.tar.gz", {"a.png": png, "a.cls": b"0"}, "w:gz")
    assert "not an uncompressed tar" in error_line(deepdsl("data", "index", f"shards:{tmp_path}/train-*.tar.gz"))
    assert "no shard" in error_line(deepdsl("data", "index", f"shards:{tmp_path}/none-{{0..3}}.tar"))
    assert "not a data set of image files" in error_line(deepdsl("data", "index", "digits"))


def test_check_lists_the_files_that_cannot_be_decoded(tmp_path):
    folder = image_data.write_digits_folder(tmp_path / "jpeg", fmt="jpg", train=30, val=10)
    index = load(f"folder:{folder}")
    truncated, flipped = folder / index.name(4), folder / index.name(9)
    image_data.truncate(truncated)
    data = bytearray(flipped.read_bytes())
    data[2:4] = b"\x00\x00"                                  # the JPEG marker after SOI broken
    flipped.write_bytes(bytes(data))
    assert deepdsl("data", "index", f"folder:{folder}").returncode == 0
    done = deepdsl("data", "check", f"folder:{folder}", "--workers", "2")
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{index.name(4)} (train split, sample 4): corrupt JPEG"), lines
    assert lines[1].startswith(f"{index.name(9)} (train split, sample 9):"), lines
    assert lines[-1] == "2 of 40 images cannot be read or decoded"
    clean = image_data.write_digits_folder(tmp_path / "png", fmt="png", train=10, val=5)
    done = deepdsl("data", "check", f"folder:{clean}", "--workers", "1", "--channels", "1")
    assert done.returncode == 0 and done.stdout.strip() == "all 15 images decode"


def test_memory_states_the_input_pipeline(digits):
    done = deepdsl("memory", "networks/lenet.py", "--batch", "16", "--data", f"folder:{digits}", "--workers", "2",
                   "--prefetch", "3")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    slot = 16 * 1 * 28 * 28 * 4 + 64                     # images and the labels' cache line
    assert f"input pipeline of folder:{digits}: 60 training and 20 test images, decoded to 1x28x28" in text
    assert f"  ring of batch slots   {4 * slot / 1e6:10.2f} MB  4 slots x 16 images" in text
    assert "each of 2 workers" in text
    assert "in-memory" in error_line(deepdsl("memory", "networks/lenet.py", "--data", "digits"))
