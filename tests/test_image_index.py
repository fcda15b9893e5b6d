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
    good = cache.read_bytes()
    for damaged in (b"not an archive", good[:len(good) // 2], good[:300] + bytes([good[300] ^ 8]) + good[301:]):
        cache.write_bytes(damaged)
        said = []
        assert load(spec, say=said.append).digest == grown.digest
        assert any("cannot be read; building it again" in s for s in said), said
        assert cache.read_bytes() == good                                    # written again, whole


def test_a_start_with_a_fresh_cache_lists_no_directory(digits, monkeypatch):
    spec = f"folder:{digits}"
    built = load(spec)
    listed, opened = [], []
    scandir, listdir, stat = os.scandir, os.listdir, os.stat
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(os.fspath(path)) or scandir(path))
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(os.fspath(path)) or listdir(path))
    monkeypatch.setattr(os, "stat", lambda path, **kw: opened.append(os.fspath(path)) or stat(path, **kw))
    again = load(spec)
    assert again.digest == built.digest and listed == [], listed
    looked_at = {p for p in opened if not p.endswith(".npz")}
    splits = {str(digits), str(digits / "train"), str(digits / "val")}          # splits() looks for them
    assert looked_at == splits | {str(digits / "train" / c) for c in built.classes}, opened
    (digits / "train" / "10").mkdir()                      # a new class: the split directory's time changes
    assert load(spec).classes == tuple(sorted(built.classes + ("10",)))


def test_a_manifest_holds_arrays_not_an_object_per_record(digits):
    index = load(f"folder:{digits}")
    arrays = index.arrays()
    assert {k: a.dtype for k, a in arrays.items()} == {
        "names": np.uint8, "name_ends": np.int64, "labels": np.int32, "sizes": np.int64, "offsets": np.int64,
        "shard_of": np.int32}
    assert index.nbytes == sum(a.nbytes for a in arrays.values())
    rebuilt = image_index.Index.from_parts(index.meta(), arrays)
    assert [rebuilt.name(i) for i in range(len(index))] == [index.name(i) for i in range(len(index))]
    assert rebuilt.read(7) == index.read(7)


def test_a_read_only_data_directory_caches_in_the_users_cache(digits, tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPDSL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    load(f"folder:{digits}")
    assert list((tmp_path / "cache" / "deepdsl" / "index").glob("*-train.npz"))
    assert not (digits / ".deepdsl-index-train.npz").exists()
    monkeypatch.setenv("DEEPDSL_CACHE", str(tmp_path / "own"))          # deepdsl's own cache directory, if set
    load(f"folder:{digits}")
    assert list((tmp_path / "own" / "index").glob("*-train.npz"))


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


def test_folder_faults_through_the_cli(digits, tmp_path):
    spec = f"folder:{digits}"
    (digits / "train" / "3" / "notes.txt").write_text("a note")
    (digits / "train" / "3" / "scans").mkdir()
    (digits / "train" / "10").mkdir()
    done = deepdsl("data", "index", spec)
    assert done.returncode == 0, done.stderr
    assert f"{spec}: ignored 2 non-image file(s) in the train split (e.g. train/3/" in done.stderr
    assert f"{spec}: class(es) 10 of the train split have no images (they keep their labels)" in done.stderr
    assert done.stdout.splitlines()[0].startswith("train: 60 images in 11 classes")
    assert done.stdout.splitlines()[1].startswith("val: 20 images in 11 classes")
    assert "Traceback" not in done.stderr
    (digits / "val" / "cat").mkdir()
    assert error_line(deepdsl("data", "index", spec)) == (
        f"deepdsl: error: {spec}: class folder 'cat' of the val split is not a class of the training split")
    missing = tmp_path / "missing"
    assert error_line(deepdsl("data", "check", f"folder:{missing}")) == (
        f"deepdsl: error: folder:{missing}: {missing} is not a directory")
    empty = tmp_path / "empty"
    for name in ("a", "b"):
        (empty / "train" / name).mkdir(parents=True)
    (empty / "train" / "a" / "labels.csv").write_text("x")
    assert f"no images in the train split {empty / 'train'}" in error_line(deepdsl("data", "index", f"folder:{empty}"))
    assert "no class folders" in error_line(deepdsl("data", "index", f"folder:{tmp_path / 'empty' / 'train' / 'b'}"))


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
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in tar} == {(0, 0, 0, "", "", 0o644)}
    assert all(p.stat().st_size <= 16 << 10 for p in out.glob("*.tar"))
    assert (out / "classes.txt").read_text() == "".join(f"{d}\n" for d in range(10))
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert "already holds files" in error_line(deepdsl("data", "pack", f"folder:{digits}", "-o", str(out)))
    assert "lies inside the data set" in error_line(deepdsl("data", "pack", f"folder:{digits}", "-o",
                                                            str(digits / "out")))
    assert not (digits / "out").exists()
    repacked = tmp_path / "repacked"                   # shards packed again from their directory: the same bytes
    done = deepdsl("data", "pack", f"shards:{out}", "-o", str(repacked), "--shard-bytes", "16k")
    assert done.returncode == 0, done.stderr
    tars = sorted(p.name for p in out.glob("*.tar"))
    assert sorted(p.name for p in repacked.glob("*.tar")) == tars
    assert all((repacked / name).read_bytes() == (out / name).read_bytes() for name in tars)


def test_packed_shards_read_by_webdataset(digits, tmp_path):
    wds = pytest.importorskip("webdataset")
    pattern = image_data.pack_shards(digits, tmp_path / "shards", shard_bytes=16 << 10)
    folder = load(f"folder:{digits}")
    samples = list(wds.WebDataset(pattern, shardshuffle=False))
    assert len(samples) == len(folder)
    for i, sample in enumerate(samples):
        assert sample["__key__"] == f"{i:09d}" and sample["png"] == folder.read(i)
        assert int(sample["cls"]) == folder.labels[i]


def test_a_faulty_data_set_is_not_packed(digits, tmp_path):
    (digits / "val" / "cat").mkdir()
    out = tmp_path / "shards"
    assert "not a class of the training split" in error_line(deepdsl("data", "pack", f"folder:{digits}", "-o",
                                                                     str(out)))
    assert not out.exists()


PNG = image_data.encode(np.zeros((8, 8), np.uint8), "png")
SYMLINK = tarfile.TarInfo("a.png")
SYMLINK.type, SYMLINK.linkname = tarfile.SYMTYPE, "elsewhere.png"
SHARD_FAULTS = {         # {case: ({shard file: members}, the spec's tail, the error's tail)}
    "no label": ({"train-000000.tar": {"a.png": PNG, "b.png": PNG, "b.cls": b"1"}}, "train-{000000..000000}.tar",
                 "train-000000.tar: sample 'a' has an image but no a.cls label"),
    "not an integer": ({"train-000000.tar": {"a.png": PNG, "a.cls": b"cat"}}, "train-000000.tar",
                       "train-000000.tar: label a.cls is not an integer (b'cat')"),
    "no image": ({"train-000000.tar": {"b.png": PNG, "b.cls": b"0"}, "train-000001.tar": {"a.cls": b"1"}}, "",
                 "train-000001.tar: sample 'a' has a label but no image"),
    "two images": ({"train-000000.tar": {"a.png": PNG, "a.jpg": PNG, "a.cls": b"1"}}, "train-*.tar",
                   "train-000000.tar: sample 'a' has two images, a.png and a.jpg"),
    "not a regular file": ({"train-000000.tar": {SYMLINK: b""}}, "",
                           "train-000000.tar: member a.png is not a regular file"),
    "a val label unknown to train": ({"train-000000.tar": {"a.png": PNG, "a.cls": b"0", "b.png": PNG, "b.cls": b" 1\n"},
                                      "val-000000.tar": {"c.png": PNG, "c.cls": b"2"}}, "train-000000.tar",
                                     "val-000000.tar: the label 2 of c.png is not one of the training split's 2 "
                                     "classes"),
    "compressed": ({"train-000000.tar.gz": {"a.png": PNG, "a.cls": b"0"}}, "train-*.tar.gz",
                   "train-000000.tar.gz is gzip-compressed: records are read in place, so shards must be "
                   "uncompressed tar files (decompress it)"),
    "not a tar file": ({"train-000000.tar": {}}, "", "train-000000.tar is not a tar file (empty file)"),
    "no file of a range": ({}, "none-{0..3}.tar", "no shard {dir}/none-0.tar"),
    "no file of a glob": ({}, "none-*.tar", "no shard {dir}/none-*.tar"),
    "no train shards in a directory": ({"val-000000.tar": {"a.png": PNG, "a.cls": b"0"}}, "",
                                       "no train-*.tar in {dir}"),
}


def shard(path: Path, members: dict, mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = name if isinstance(name, tarfile.TarInfo) else tarfile.TarInfo(name)
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


@pytest.mark.parametrize("case", SHARD_FAULTS)
def test_shard_faults(tmp_path, case):
    files, tail, message = SHARD_FAULTS[case]
    for name, members in files.items():
        if members:
            shard(tmp_path / name, members, "w:gz" if name.endswith(".gz") else "w")
        else:
            (tmp_path / name).write_bytes(b"")
    spec = f"shards:{tmp_path}/{tail}" if tail else f"shards:{tmp_path}"
    assert error_line(deepdsl("data", "index", spec)) == f"deepdsl: error: {spec}: {message.format(dir=tmp_path)}"


def test_a_spec_not_of_image_files():
    assert "not a data set of image files" in error_line(deepdsl("data", "index", "digits"))


def test_check_lists_the_files_that_cannot_be_decoded(tmp_path):
    folder = image_data.write_digits_folder(tmp_path / "jpeg", fmt="jpg", train=30, val=10)
    index = load(f"folder:{folder}")
    truncated, flipped = folder / index.name(4), folder / index.name(9)
    image_data.truncate(truncated)
    image_data.flip_bit(flipped, byte=2, bit=4)               # the marker after SOI: FF -> EF
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
