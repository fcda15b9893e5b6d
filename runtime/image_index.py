"""The manifests of image data sets read from files: which records a split has, their labels and byte sizes, and
where each one's bytes are; built once and cached, so a start never lists a million files again.

Specs (`splits`):
- `folder:DIR`: the ImageFolder layout, `DIR/train/<class>/<image>` and `DIR/val/<class>/<image>` (a DIR without
  `train/` is itself the training split). Classes are the sub-directories, sorted (torchvision's numbering; the
  validation split takes the training split's); images are files of IMAGE_EXTENSIONS (any case); hidden files and
  directories are skipped, other entries (files of other types, sub-directories) ignored and counted. An empty
  class keeps its label; a split without any image is refused.
- `shards:PATTERN`: WebDataset-style tar files (brace ranges `{000000..000127}` and globs expanded, sorted): each
  sample is `KEY.<image extension>` and `KEY.cls` (an ASCII integer label), KEY the member's name up to the first
  dot of its base name. The validation shards: the pattern with the last `train` of its file name replaced by
  `val`, where such files exist. `shards:DIR`: DIR/train-*.tar and DIR/val-*.tar. Class names from `classes.txt`
  beside the shards (one per line), else the labels' numbers.

The manifest (`Index`) is numpy arrays, no object per record: the names as one UTF-8 blob and their ends, labels,
byte sizes, and for shards the shard and the offset of each member's data (a record is one positioned read). Its
cache (`load_index`) is `.deepdsl-index-<split>[-<shards digest>].npz` beside the data, or under `index/` of
deepdsl's cache directory (`deepdsl_runtime.cache_directory`: ~/.cache/deepdsl) where that directory is read-only;
it is fresh while the times of the split directory and of its class directories (found by a stat of each, no
directory listed) or the shards' sizes and times are those recorded; a stale or damaged cache is rebuilt. The digest names the data set: class names,
record names, labels and sizes.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import tarfile
import zipfile
from dataclasses import dataclass

import numpy as np

import deepdsl_runtime
from deepdsl_runtime.data import DataError

__all__ = ["IMAGE_EXTENSIONS", "Index", "RecordError", "Source", "expand", "check", "load_index", "pack", "splits"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
CACHE_VERSION = 2
_ARRAYS = ("names", "name_ends", "labels", "sizes", "offsets", "shard_of")


class RecordError(DataError):
    """A record that cannot be read (`reason` says why; the caller names the record)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Source:
    """One split of a spec: a directory of class folders, or shard files."""
    kind: str                        # "folder" | "shards"
    location: str | tuple[str, ...]  # the split's directory, or its shards' paths


def expand(pattern: str) -> list[str]:
    """The files a shard pattern names: brace ranges `{000..127}` (zero-padded as written) and globs, sorted."""
    match = re.search(r"\{(\d+)\.\.(\d+)\}", pattern)
    if match:
        lo, hi = match.group(1), match.group(2)
        width = len(lo) if lo.startswith("0") else 0
        found = []
        for n in range(int(lo), int(hi) + 1):
            found += expand(pattern[:match.start()] + str(n).zfill(width) + pattern[match.end():])
        return found
    if glob.has_magic(pattern):
        return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    return [pattern]


def splits(spec: str) -> tuple[Source, Source | None]:
    """(the training split, the validation split or None) of an image spec."""
    kind, _, arg = spec.partition(":")
    if kind == "folder":
        if not os.path.isdir(arg):
            raise DataError(f"{spec}: {arg} is not a directory")
        train = os.path.join(arg, "train")
        if os.path.isdir(train):
            val = os.path.join(arg, "val")
            return Source("folder", train), (Source("folder", val) if os.path.isdir(val) else None)
        return Source("folder", arg), None
    if kind == "shards":
        if os.path.isdir(arg):
            train, val = (sorted(glob.glob(os.path.join(arg, f"{s}-*.tar"))) for s in ("train", "val"))
            if not train:
                raise DataError(f"{spec}: no train-*.tar in {arg}")
            return Source("shards", tuple(train)), (Source("shards", tuple(val)) if val else None)
        train = expand(arg)
        missing = [p for p in train if not os.path.isfile(p)]
        if not train or missing:
            raise DataError(f"{spec}: no shard {missing[0] if missing else arg}")
        directory, name = os.path.split(arg)
        at = name.rfind("train")
        val = []
        if at >= 0:
            val = [p for p in expand(os.path.join(directory, name[:at] + "val" + name[at + 5:])) if os.path.isfile(p)]
        return Source("shards", tuple(train)), (Source("shards", tuple(val)) if val else None)
    raise DataError(f"unknown image data spec '{spec}' (use folder:DIR or shards:PATTERN)")


class Index:
    """One split's manifest (see the module's docstring)."""

    def __init__(self, meta: dict, arrays: dict[str, np.ndarray]):
        self.spec, self.split, self.kind = meta["spec"], meta["split"], meta["kind"]
        self.root, self.prefix = meta["root"], meta["prefix"]
        self.shards = tuple(meta["shards"])
        self.classes = tuple(meta["classes"])
        self.digest = meta["digest"]
        self._meta = meta
        self.names, self.name_ends, self.labels, self.sizes, self.offsets, self.shard_of = (arrays[k] for k in _ARRAYS)
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def meta(self) -> dict:
        return dict(self._meta)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in _ARRAYS}

    @classmethod
    def from_parts(cls, meta: dict, arrays: dict[str, np.ndarray]) -> "Index":
        return cls(meta, arrays)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())

    def _name(self, i: int) -> str:
        start = int(self.name_ends[i - 1]) if i else 0
        return bytes(self.names[start:int(self.name_ends[i])]).decode("utf-8", "surrogateescape")

    def name(self, i: int) -> str:
        """Record i as the user sees it: `train/cat/img1.jpg`, or `train-000003.tar:key.jpg`."""
        if self.kind == "shards":
            return f"{os.path.basename(self.shards[int(self.shard_of[i])])}:{self._name(i)}"
        return self.prefix + self._name(i)

    def read(self, i: int) -> bytes:
        """The bytes of record i; RecordError where it cannot be read or its size is not the manifest's."""
        size = int(self.sizes[i])
        try:
            if self.kind == "shards":
                k = int(self.shard_of[i])
                fd = self._fds.get(k)
                if fd is None:
                    fd = self._fds[k] = os.open(self.shards[k], os.O_RDONLY)
                data = os.pread(fd, size, int(self.offsets[i]))
            else:
                with open(os.path.join(self.root, self._name(i)), "rb") as f:
                    data = f.read(size + 1)
        except OSError as err:
            raise RecordError(f"{self.spec}: {self.name(i)}: {err.strerror or err}",
                              f"cannot read: {err.strerror or err}") from None
        if len(data) != size:
            reason = (f"{len(data)} bytes where the manifest has {size} (changed since it was built: "
                      "`deepdsl data index` rebuilds it)")
            raise RecordError(f"{self.spec}: {self.name(i)}: {reason}", reason)
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __getstate__(self):
        raise TypeError("an Index is shared as meta() and arrays(), not pickled")


# ----------------------------------------------------------------------------------------------------------------
# building

def _say_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _progress(total: int, what: str, shown: bool, unit: str = "dir"):
    """A progress bar on a terminal (none where standard error is a file or a pipe)."""
    if not shown or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=what, unit=unit, dynamic_ncols=True, mininterval=0.5, leave=False)


def _class_dirs(root: str) -> list[tuple[str, int]]:
    """(name, mtime_ns) of the split's class directories, sorted by name."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(".") and entry.is_dir():
                found.append((entry.name, entry.stat().st_mtime_ns))
    return sorted(found)


def _state(source: Source) -> list:
    """What the cache's freshness is judged by: the split directory's time and its class directories' (names and
    times), or the shards' sizes and times. Taken before a build lists anything, so a change made during the build
    is seen at the next start."""
    if source.kind == "folder":
        return [os.stat(source.location).st_mtime_ns, [list(d) for d in _class_dirs(source.location)]]
    return [[p, st.st_size, st.st_mtime_ns] for p, st in ((p, os.stat(p)) for p in source.location)]


def _unchanged(source: Source, recorded: list) -> bool:
    """Whether the state recorded with a cache is still the data's, without listing any directory: the split
    directory's time (a class directory added, removed or renamed changes it) and each class directory's (an image
    added, removed or renamed changes it) are looked at, the shards' sizes and times."""
    try:
        if source.kind == "folder":
            root_time, dirs = recorded
            return os.stat(source.location).st_mtime_ns == root_time and all(
                os.stat(os.path.join(source.location, name)).st_mtime_ns == t for name, t in dirs)
        return recorded == _state(source)
    except (OSError, TypeError, ValueError):
        return False


def _digest(classes, names: np.ndarray, labels: np.ndarray, sizes: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update("\0".join(classes).encode())
    for a in (names, labels.astype("<i4"), sizes.astype("<i8")):
        h.update(b"\1")
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:32]


def _pack(names: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    blob = np.frombuffer(b"".join(names), np.uint8).copy()
    ends = np.cumsum([len(n) for n in names], dtype=np.int64) if names else np.zeros(0, np.int64)
    return blob, ends


def _build_folder(source: Source, spec: str, split: str, classes, progress: bool, say) -> tuple[dict, dict]:
    root = source.location
    dirs = [name for name, _ in _class_dirs(root)]
    if classes is None:
        classes = dirs
        if not classes:
            raise DataError(f"{spec}: no class folders in {root}")
    else:
        unknown = sorted(set(dirs) - set(classes))
        if unknown:
            raise DataError(f"{spec}: class folder '{unknown[0]}' of the {split} split is not a class of the training "
                            "split")
    names, labels, sizes, ignored, empty = [], [], [], [], []
    bar = _progress(len(classes), f"indexing {split}", progress)
    for label, name in enumerate(classes):
        directory = os.path.join(root, name)
        files = []
        if os.path.isdir(directory):
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue
                    if os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS and entry.is_file():
                        files.append((entry.name, entry.stat().st_size))
                    else:
                        ignored.append(f"{name}/{entry.name}")
        if not files:
            empty.append(name)
        for file, size in sorted(files):
            names.append(f"{name}/{file}".encode("utf-8", "surrogateescape"))
            labels.append(label)
            sizes.append(size)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    prefix = os.path.basename(os.path.normpath(root)) + "/" if split in ("train", "val") and os.path.basename(
        os.path.normpath(root)) == split else ""
    if ignored:
        say(f"{spec}: ignored {len(ignored)} non-image file(s) in the {split} split (e.g. {prefix}{ignored[0]})")
    if not labels:
        raise DataError(f"{spec}: no images in the {split} split {root} (files of "
                        f"{', '.join(e[1:] for e in IMAGE_EXTENSIONS)} in its class folders)")
    if empty:
        say(f"{spec}: class(es) {', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''} of the {split} split have "
            "no images (they keep their labels)")
    blob, ends = _pack(names)
    n = len(labels)
    arrays = {"names": blob, "name_ends": ends, "labels": np.array(labels, np.int32),
              "sizes": np.array(sizes, np.int64), "offsets": np.zeros(n, np.int64),
              "shard_of": np.full(n, -1, np.int32)}
    return {"root": os.path.abspath(root), "prefix": prefix, "shards": [], "classes": list(classes)}, arrays


def _build_shards(source: Source, spec: str, split: str, classes, progress: bool) -> tuple[dict, dict]:
    names, labels, sizes, offsets, shard_of = [], [], [], [], []
    bar = _progress(len(source.location), f"indexing {split}", progress, "shard")
    for k, path in enumerate(source.location):
        shard = os.path.basename(path)
        images, cls = {}, {}
        try:
            with tarfile.open(path, "r:") as tar:
                for member in tar:
                    if not member.isfile():
                        if member.isdir():
                            continue
                        raise DataError(f"{spec}: {shard}: member {member.name} is not a regular file")
                    base = os.path.basename(member.name)
                    if base.startswith("."):
                        continue
                    key = os.path.join(os.path.dirname(member.name), base.split(".", 1)[0])
                    ext = "." + base.split(".", 1)[1].lower() if "." in base else ""
                    if ext == ".cls":
                        text = tar.extractfile(member).read().strip()
                        try:
                            cls[key] = int(text)
                        except ValueError:
                            raise DataError(f"{spec}: {shard}: label {member.name} is not an integer "
                                            f"({text[:20]!r})") from None
                        if cls[key] < 0:
                            raise DataError(f"{spec}: {shard}: label {member.name} is negative ({cls[key]})")
                    elif ext in IMAGE_EXTENSIONS:
                        if key in images:
                            raise DataError(f"{spec}: {shard}: sample '{key}' has two images, {images[key][0]} "
                                            f"and {member.name}")
                        images[key] = (member.name, member.offset_data, member.size)
        except tarfile.TarError as err:
            raise DataError(f"{spec}: {shard} {_not_tar(path, err)}") from None
        except OSError as err:
            raise DataError(f"{spec}: cannot read {shard}: {err.strerror or err}") from None
        for key in images:
            if key not in cls:
                raise DataError(f"{spec}: {shard}: sample '{key}' has an image but no {key}.cls label")
        for key in cls:
            if key not in images:
                raise DataError(f"{spec}: {shard}: sample '{key}' has a label but no image")
        for key, (member, offset, size) in images.items():
            names.append(member.encode("utf-8", "surrogateescape"))
            labels.append(cls[key])
            sizes.append(size)
            offsets.append(offset)
            shard_of.append(k)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not labels:
        raise DataError(f"{spec}: no samples in the {split} shards")
    if classes is None:
        listed = os.path.join(os.path.dirname(source.location[0]), "classes.txt")
        top = max(labels) + 1
        if os.path.isfile(listed):
            with open(listed, encoding="utf-8") as f:
                classes = [line.rstrip("\n") for line in f if line.strip()]
            if len(classes) < top:
                raise DataError(f"{spec}: labels reach {top - 1}, {listed} names {len(classes)} classes")
        else:
            classes = [str(c) for c in range(top)]
    elif max(labels) >= len(classes):
        at = labels.index(max(labels))
        raise DataError(f"{spec}: {os.path.basename(source.location[shard_of[at]])}: the label {labels[at]} of "
                        f"{names[at].decode('utf-8', 'surrogateescape')} is not one of the training split's "
                        f"{len(classes)} classes")
    blob, ends = _pack(names)
    arrays = {"names": blob, "name_ends": ends, "labels": np.array(labels, np.int32),
              "sizes": np.array(sizes, np.int64), "offsets": np.array(offsets, np.int64),
              "shard_of": np.array(shard_of, np.int32)}
    return {"root": "", "prefix": "", "shards": [os.path.abspath(p) for p in source.location],
            "classes": list(classes)}, arrays


_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _not_tar(path: str, err: Exception) -> str:
    """Why a shard could not be read as a tar file, for its one-line error."""
    with open(path, "rb") as f:
        head = f.read(8)
    kind = next((name for magic, name in _COMPRESSED.items() if head.startswith(magic)), None)
    if kind:
        return (f"is {kind}-compressed: records are read in place, so shards must be uncompressed tar files "
                "(decompress it)")
    return f"is not a tar file ({err})"


def _cache_path(source: Source, split: str) -> str:
    if source.kind == "folder":
        root = os.path.normpath(source.location)
        directory = os.path.dirname(root) if os.path.basename(root) in ("train", "val") else root
        name = f".deepdsl-index-{split}.npz"
    else:
        directory = os.path.dirname(os.path.abspath(source.location[0]))
        tag = hashlib.sha256("\0".join(os.path.abspath(p) for p in source.location).encode()).hexdigest()[:12]
        name = f".deepdsl-index-{split}-{tag}.npz"
    inside = source.kind == "folder" and directory == os.path.normpath(source.location)
    # a cache written inside the split directory would change the time its freshness is judged by
    if os.access(directory, os.W_OK) and not inside:
        return os.path.join(directory, name)
    tag = hashlib.sha256(os.path.realpath(os.path.join(directory, name)).encode()).hexdigest()[:16]
    return os.path.join(deepdsl_runtime.cache_directory() or ".", "index", f"{tag}-{split}.npz")


def _read_cache(path: str) -> tuple[dict, dict] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k] for k in _ARRAYS}
        return (meta, arrays) if meta.get("version") == CACHE_VERSION else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError):
        raise _Damaged() from None


class _Damaged(Exception):
    pass


def _write_cache(path: str, meta: dict, arrays: dict) -> bool:
    from deepdsl_runtime.checkpoint import atomic_write
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **arrays))
        return True
    except OSError:
        return False


def load_index(source: Source, spec: str, split: str, progress: bool = False, rebuild: bool = False,
               classes=None, say=None) -> Index:
    """The manifest of one split: the cached one while fresh, else built (a progress bar when `progress`) and
    cached; `classes`: the training split's (for the validation split). `say` reports what the build found
    (default: standard error)."""
    say = say or _say_stderr
    try:
        return _load_index(source, spec, split, progress, rebuild, classes, say)
    except OSError as err:
        raise DataError(f"{spec}: cannot read {err.filename or 'the ' + split + ' split'}: "
                        f"{err.strerror or err}") from None


def _load_index(source: Source, spec: str, split: str, progress: bool, rebuild: bool, classes, say) -> Index:
    path = _cache_path(source, split)
    if not rebuild:
        try:
            cached = _read_cache(path)
        except _Damaged:
            say(f"{spec}: the cached manifest {path} cannot be read; building it again")
            cached = None
        if cached is not None:
            meta, arrays = cached
            if _unchanged(source, meta["state"]) and meta["spec"] == spec and (classes is None or
                                                                    meta["classes"] == list(classes)):
                return Index(meta, arrays)
    state = _state(source)
    if source.kind == "folder":
        meta, arrays = _build_folder(source, spec, split, classes, progress and sys.stderr.isatty(), say)
    else:
        meta, arrays = _build_shards(source, spec, split, classes, progress and sys.stderr.isatty())
    meta.update({"version": CACHE_VERSION, "spec": spec, "split": split, "kind": source.kind, "state": state,
                 "digest": _digest(meta["classes"], arrays["names"], arrays["labels"], arrays["sizes"]),
                 "cache": path})
    if not _write_cache(path, meta, arrays):
        say(f"{spec}: cannot cache the manifest at {path}; it is built again at every start")
    return Index(meta, arrays)


# ----------------------------------------------------------------------------------------------------------------
# packing shards

def pack(spec: str, out: str, shard_bytes: int = 1 << 30, progress: bool = False, say=None) -> dict[str, str]:
    """Write the splits of `spec` as tar shards in directory `out` (`train-000000.tar`, ..., `val-...`; members
    `<key>.<ext>` with the original bytes and `<key>.cls`, keys the record numbers; a shard closes before it
    would pass `shard_bytes`, each written whole or not at all; mtime, owner and modes fixed, so the bytes depend on
    the data alone) and `classes.txt`. Returns {split: the shard pattern to use}."""
    from deepdsl_runtime.checkpoint import atomic_write

    indexes = _both(spec, progress, say)
    os.makedirs(out, exist_ok=True)          # (only once the data set is known to be readable)
    patterns = {}
    for split, index in indexes.items():
        shards = _shard_records(index.sizes, shard_bytes)
        bar = _progress(len(shards), f"packing {split}", progress, "shard")
        for n, records in enumerate(shards):
            path = os.path.join(out, f"{split}-{n:06d}.tar")
            atomic_write(path, lambda f, records=records: _write_shard(f, index, records))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        patterns[split] = os.path.join(out, f"{split}-{{{0:06d}..{len(shards) - 1:06d}}}.tar")
    text = "".join(f"{c}\n" for c in indexes["train"].classes).encode()
    atomic_write(os.path.join(out, "classes.txt"), lambda f: f.write(text))
    return patterns


def _both(spec: str, progress: bool, say) -> dict[str, Index]:
    """{"train": its index, "val": its index (where the spec has a validation split)}."""
    train_source, val_source = splits(spec)
    indexes = {"train": load_index(train_source, spec, "train", progress=progress, say=say)}
    if val_source is not None:
        indexes["val"] = load_index(val_source, spec, "val", progress=progress, classes=indexes["train"].classes,
                                    say=say)
    return indexes


TAR_BLOCK, TAR_RECORD = 512, 10240      # tarfile's block, and the record it pads an archive to


def _shard_records(sizes: np.ndarray, shard_bytes: int) -> list[range]:
    """The records of each shard, in order: as many as keep the tar file (each image and its .cls a header block
    and their data in whole blocks; two zero blocks at the end; padded to a whole record) within `shard_bytes`; a
    record over that alone takes a shard."""
    member = TAR_BLOCK + (sizes + TAR_BLOCK - 1) // TAR_BLOCK * TAR_BLOCK + 2 * TAR_BLOCK
    shards, first, size = [], 0, 0
    for i, need in enumerate(member.tolist()):
        if i > first and -(-(size + need + 2 * TAR_BLOCK) // TAR_RECORD) * TAR_RECORD > shard_bytes:
            shards.append(range(first, i))
            first, size = i, 0
        size += need
    if len(sizes) > first:
        shards.append(range(first, len(sizes)))
    return shards


def _write_shard(f, index: Index, records) -> None:
    import io

    with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in records:
            key = f"{i:09d}"
            ext = os.path.splitext(index._name(i))[1].lower()
            for name, data in ((key + ext, index.read(i)), (key + ".cls", b"%d" % int(index.labels[i]))):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
                tar.addfile(info, io.BytesIO(data))


# ----------------------------------------------------------------------------------------------------------------
# checking every record

CHECK_CHUNK = 256      # records a checking process takes at a time


def check(spec: str, channels: int = 3, workers: int = 1, progress: bool = False,
          say=None) -> tuple[list[tuple[str, int, str, str]], int]:
    """Read and decode every record of both splits (`workers` processes of the spawn context, or this one for 1):
    ([(split, index, name, reason)] of those that cannot be, train's first, in order), and the number of
    records."""
    from concurrent.futures.process import BrokenProcessPool

    indexes = _both(spec, progress, say)
    chunks = [(split, lo, min(lo + CHECK_CHUNK, len(index))) for split, index in indexes.items()
              for lo in range(0, len(index), CHECK_CHUNK)]
    bar = _progress(sum(map(len, indexes.values())), "checking", progress, "img")
    bad, pool = [], None
    try:
        if workers <= 1:
            results = (_check_records(indexes, chunk, channels) for chunk in chunks)
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor
            # each process reads the manifests once (from the cache just made fresh), then takes chunks
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_check_start, initargs=(spec,))
            results = pool.map(_check_chunk, chunks, [channels] * len(chunks))
        for chunk, found in zip(chunks, results):
            bad += found
            if bar is not None:
                bar.update(chunk[2] - chunk[1])
    except BrokenProcessPool as err:
        raise DataError(f"{spec}: a checking process ended ({err}); check with --workers 1 to find the image that "
                        "ends it") from None
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if bar is not None:
            bar.close()
        for index in indexes.values():
            index.close()
    return sorted(bad, key=lambda b: (b[0] != "train", b[1])), sum(map(len, indexes.values()))


def _check_records(indexes: dict[str, Index], chunk, channels: int) -> list[tuple[str, int, str, str]]:
    from deepdsl_runtime import image_transforms

    split, lo, hi = chunk
    index = indexes[split]
    bad = []
    for i in range(lo, hi):
        try:
            image_transforms.decode(index.read(i), channels)
        except RecordError as err:
            bad.append((split, i, index.name(i), err.reason))
        except image_transforms.DecodeError as err:
            bad.append((split, i, index.name(i), str(err)))
    return bad


_checking: dict[str, Index] = {}     # a checking process's manifests (set once by _check_start)


def _check_start(spec: str) -> None:
    _checking.update(_both(spec, False, lambda text: None))


def _check_chunk(chunk, channels: int) -> list[tuple[str, int, str, str]]:
    return _check_records(_checking, chunk, channels)
