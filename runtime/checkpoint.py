"""Checkpoints: one `.npz` file per training run, readable with `np.load(path, allow_pickle=False)`.

Contents (every entry a plain array; no pickled objects):
- every parameter under its own name (`cv1_W`, `fc1_B`, ...) in PyTorch's layouts (conv weights O,C,kh,kw; fully
  connected weights out,in), float32;
- every state tensor under its name: optimizer state (`V_<param>` for SGD momentum, `M_<param>` / `S_<param>` for
  Adam's moments) and batch-norm running statistics (`<layer>_mean`, `<layer>_var`);
- metadata, in fields starting with `__`: `__format__` ("deepdsl-checkpoint-1"), `__network__` (name),
  `__structure_hash__` (hash of the compiled training program, so a file cannot be loaded into a program of
  another structure), `__iteration__` (training iterations done), `__seed__`, `__data_epoch__` and
  `__data_offset__` (the data stream's position; with the seed they are its whole random state, since shuffling
  and dropout masks are drawn from counters), `__data__` (the data spec used).

Files are written atomically: into a temporary file in the same directory, flushed and fsynced, then renamed over
the target, so a crash or a signal mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np

__all__ = ["FORMAT", "Checkpoint", "CheckpointError", "read", "write"]

FORMAT = "deepdsl-checkpoint-1"


class CheckpointError(Exception):
    """A checkpoint that cannot be used (one line, naming the file and the field)."""


@dataclass
class Checkpoint:
    path: str
    tensors: dict[str, np.ndarray]
    network: str
    structure_hash: str
    iteration: int = 0
    seed: int = 0
    data_position: tuple[int, int] = (0, 0)
    data: str = ""
    extra: dict[str, np.ndarray] = field(default_factory=dict)


def write(path: str, checkpoint: Checkpoint) -> None:
    """Write `checkpoint` to `path` atomically (temporary file in the same directory, fsync, rename)."""
    entries: dict[str, np.ndarray] = {
        "__format__": np.array(FORMAT),
        "__network__": np.array(checkpoint.network),
        "__structure_hash__": np.array(checkpoint.structure_hash),
        "__iteration__": np.array(checkpoint.iteration, dtype=np.int64),
        "__seed__": np.array(checkpoint.seed, dtype=np.int64),
        "__data_epoch__": np.array(checkpoint.data_position[0], dtype=np.int64),
        "__data_offset__": np.array(checkpoint.data_position[1], dtype=np.int64),
        "__data__": np.array(checkpoint.data),
    }
    for name, array in checkpoint.tensors.items():
        if name.startswith("__"):
            raise ValueError(f"tensor name '{name}' is reserved for metadata")
        entries[name] = np.ascontiguousarray(array)
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.chmod(temporary, _mode_for(path))       # mkstemp makes 0600 files; keep the usual permissions
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                for name, array in entries.items():
                    with archive.open(name + ".npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    try:                                  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _mode_for(path: str) -> int:
    """The permissions the checkpoint would have if written in place: the old file's, else 0666 minus umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def read(path: str) -> Checkpoint:
    """Read a checkpoint; any damage is a `CheckpointError` naming the file (and the field, when one is bad)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not hasattr(archive, "files"):
                raise CheckpointError(f"{path}: not a deepdsl checkpoint (a single array, not an .npz archive)")
            entries = {}
            for name in archive.files:
                try:
                    entries[name] = archive[name]
                except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
                    raise CheckpointError(f"{path}: field '{name}': unreadable ({err})") from None
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as err:
        raise CheckpointError(f"{path}: corrupt or not an .npz checkpoint ({type(err).__name__}: {err})") from None

    def meta(name: str, kind: str):
        if name not in entries:
            raise CheckpointError(f"{path}: field '{name}': missing (not a deepdsl checkpoint?)")
        value = entries[name]
        if value.shape != () or (kind == "str" and value.dtype.kind != "U") or \
                (kind == "int" and value.dtype.kind not in "iu"):
            raise CheckpointError(f"{path}: field '{name}': expected a {kind}, found {value.dtype} {value.shape}")
        return str(value) if kind == "str" else int(value)

    if meta("__format__", "str") != FORMAT:
        raise CheckpointError(f"{path}: field '__format__': {meta('__format__', 'str')!r}, expected {FORMAT!r}")
    tensors = {k: v for k, v in entries.items() if not k.startswith("__")}
    known = {"__format__", "__network__", "__structure_hash__", "__iteration__", "__seed__", "__data_epoch__",
             "__data_offset__", "__data__"}
    return Checkpoint(
        path=path, tensors=tensors, network=meta("__network__", "str"),
        structure_hash=meta("__structure_hash__", "str"), iteration=meta("__iteration__", "int"),
        seed=meta("__seed__", "int"), data_position=(meta("__data_epoch__", "int"), meta("__data_offset__", "int")),
        data=meta("__data__", "str"), extra={k: v for k, v in entries.items() if k.startswith("__") and k not in known})


def check_tensors(checkpoint: Checkpoint, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected tensor is present, float32-compatible, of the expected shape and finite."""
    for name, shape in expected.items():
        if name not in checkpoint.tensors:
            raise CheckpointError(f"{checkpoint.path}: field '{name}': missing")
        array = checkpoint.tensors[name]
        if tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{checkpoint.path}: field '{name}': shape {_dims(array.shape)}, this program "
                                  f"expects {_dims(shape)}")
        if array.dtype.kind != "f":
            raise CheckpointError(f"{checkpoint.path}: field '{name}': dtype {array.dtype}, expected float32")
        if not np.all(np.isfinite(array)):
            raise CheckpointError(f"{checkpoint.path}: field '{name}': holds NaN or infinite values")


def _dims(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"
