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
  and dropout masks are drawn from counters), `__data__` (the data spec used); optionally `__batches__` (batches
  of the compiled size trained on), `__ranks__` and `__global_batch__` (how the run that wrote it made a batch).
  `read` checks every field's type and range (`__iteration__`, `__data_epoch__`, `__data_offset__` and
  `__batches__` >= 0, `__seed__` in [0, 2^63) as `--seed` is, `__ranks__` and `__global_batch__` >= 1): a bad one
  is a `CheckpointError` naming the file and the field.

Files are written atomically: into a temporary file in the same directory (`.NAME.PID-XXXXXXXX.tmp`: the writer's
process id and a random suffix), flushed and fsynced, then renamed over the target, so a crash or a signal mid-write
leaves the previous checkpoint intact. A process killed mid-write leaves its temporary behind;
`remove_stale_temporaries` deletes those of a checkpoint whose writer no longer runs.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Callable, IO

import numpy as np

__all__ = ["FORMAT", "Checkpoint", "CheckpointError", "atomic_write", "check_target", "read", "read_weights",
           "remove_stale_temporaries", "write"]

FORMAT = "deepdsl-checkpoint-1"
# the least value of each integer field (all below 2^63: they are int64), the optional ones among them
_LEAST = {"__iteration__": 0, "__seed__": 0, "__data_epoch__": 0, "__data_offset__": 0, "__batches__": 0,
          "__ranks__": 1, "__global_batch__": 1}
_OPTIONAL = ("__batches__", "__ranks__", "__global_batch__")


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
    for name, value in checkpoint.extra.items():
        entries[name] = np.asarray(value)
    for name, array in checkpoint.tensors.items():
        if name.startswith("__"):
            raise ValueError(f"tensor name '{name}' is reserved for metadata")
        entries[name] = np.ascontiguousarray(array)

    def write_archive(f: IO[bytes]) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in entries.items():
                with archive.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, array, allow_pickle=False)

    atomic_write(path, write_archive)


def atomic_write(path: str, write_to: Callable[[IO[bytes]], None]) -> None:
    """Call `write_to` on a temporary file beside `path`, make it durable, then rename it over `path`: readers see
    the old file or the new one, never a part. On any failure (a full disk, an interrupt) the temporary is removed
    and the old file stays as it was. What `path` names is looked at again on every call: a FIFO, a device or a
    directory put there since it was checked is an `OSError` (ENOTSUP), never replaced by a regular file."""
    path = os.path.realpath(path)               # a link is followed: the file it names is replaced, not the link
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise OSError(errno.ENOTSUP, "not a regular file", path)
    directory = os.path.dirname(path)
    temporary = None
    try:
        # the temporary is named before it exists, so that an interrupt arriving anywhere after its creation (a
        # signal's handler runs in this thread whichever thread the signal reached) finds it here and removes it
        while True:
            temporary = os.path.join(directory, f"{_temporary_prefix(path)}{secrets.token_hex(4)}.tmp")
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:       # (a name of this process's id left by an earlier process)
                continue
        with os.fdopen(fd, "wb") as f:
            os.chmod(temporary, _mode_for(path))       # keep the permissions the file would have
            write_to(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if temporary is not None and os.path.exists(temporary):
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


def _temporary_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.{os.getpid()}-"


def _temporaries(path: str) -> list[tuple[str, int]]:
    """(path, writer's process id) of every temporary of `path`'s writes in its directory."""
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(f".{os.path.basename(path)}.") + r"(\d+)-[a-z0-9_]{8}\.tmp")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            found.append((os.path.join(directory, name), int(match.group(1))))
    return found


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):      # another user's process (or an impossible id): leave its file alone
        return True
    return True


def remove_stale_temporaries(path: str) -> list[str]:
    """Delete the temporaries a killed writer of `path` left (only files named as `atomic_write` names them, and
    only those whose writing process no longer runs); returns the paths removed."""
    removed = []
    for temporary, pid in _temporaries(os.path.realpath(path)):
        if pid == os.getpid() or not _running(pid):
            try:
                os.unlink(temporary)
            except FileNotFoundError:
                continue
            removed.append(temporary)
    return removed


def check_target(path: str, option: str, nbytes: int = 0) -> None:
    """Raise a one-line `CheckpointError` unless `atomic_write(path, ...)` of `nbytes` bytes can succeed: the
    directory exists and takes a new file (tried with a temporary of the same pattern), `path` is not a directory
    nor a read-only file, and the file system has room for the new file beside the old one."""
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise CheckpointError(f"{option} {path}: is a directory; name a file in it")
    real = os.path.realpath(path)               # where `atomic_write` writes: a link's target
    directory = os.path.dirname(real)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{option} {path}: directory {os.path.dirname(path) or '.'} does not exist")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise CheckpointError(f"{option} {path}: {err.strerror}") from None
    if mode is not None and (not stat.S_ISREG(mode) or not mode & 0o222 or not os.access(real, os.W_OK)):
        what = "read-only" if stat.S_ISREG(mode) else "not a regular file"
        raise CheckpointError(f"{option} {path}: {what}; it would be replaced (make it writable or choose another "
                              "path)")
    try:
        fd, probe = tempfile.mkstemp(prefix=_temporary_prefix(real), suffix=".tmp", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise CheckpointError(f"{option} {path}: cannot write in {os.path.dirname(path) or '.'}: "
                              f"{err.strerror}") from None
    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise CheckpointError(f"{option} {path}: {free / 1e6:.1f} MB free in {os.path.dirname(path) or '.'}, the "
                              f"file needs {nbytes / 1e6:.1f} MB")


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
    entries = _entries(path)

    def meta(name: str, kind: str):
        if name not in entries:
            raise CheckpointError(f"{path}: field '{name}': missing (not a deepdsl checkpoint?)")
        value = entries[name]
        if value.shape != () or (kind == "str" and value.dtype.kind != "U") or \
                (kind == "int" and value.dtype.kind not in "iu"):
            raise CheckpointError(f"{path}: field '{name}': expected a {kind}, found {value.dtype} {value.shape}")
        if kind == "str":
            return str(value)
        number = int(value)
        if not _LEAST[name] <= number < 2 ** 63:       # (a uint64 may hold more)
            raise CheckpointError(f"{path}: field '{name}': {number}, expected an integer in "
                                  f"[{_LEAST[name]}, 2^63)")
        return number

    if meta("__format__", "str") != FORMAT:
        raise CheckpointError(f"{path}: field '__format__': {meta('__format__', 'str')!r}, expected {FORMAT!r}")
    tensors = {k: v for k, v in entries.items() if not k.startswith("__")}
    for name in _OPTIONAL:
        if name in entries:
            meta(name, "int")
    known = {"__format__", "__network__", "__structure_hash__", "__iteration__", "__seed__", "__data_epoch__",
             "__data_offset__", "__data__"}
    return Checkpoint(
        path=path, tensors=tensors, network=meta("__network__", "str"),
        structure_hash=meta("__structure_hash__", "str"), iteration=meta("__iteration__", "int"),
        seed=meta("__seed__", "int"), data_position=(meta("__data_epoch__", "int"), meta("__data_offset__", "int")),
        data=meta("__data__", "str"), extra={k: v for k, v in entries.items() if k.startswith("__") and k not in known})


def recorded_iteration(path: str) -> int | None:
    """The iteration the checkpoint at `path` records (None where there is none or it cannot be read): only that
    field is read."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return int(archive["__iteration__"])
    except Exception:       # absent, not an archive, no such field: nothing recorded
        return None


def recorded_text(path: str, field: str) -> str | None:
    """A text field a checkpoint at `path` records (`__augment__`), None where there is none (a plain .npz, a
    safetensors file) or it cannot be read: only that field is read."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            value = archive[field]
            return str(value) if value.dtype.kind == "U" and value.shape == () else None
    except Exception:       # absent, not an archive, no such field: nothing recorded
        return None


def recorded_names(path: str, field: str) -> list[str]:
    """A list of names a checkpoint at `path` records (`__classes__`: the class names of images read from files),
    [] where there is none or it cannot be read: only that field is read."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            value = archive[field]
            return [str(v) for v in value.reshape(-1)] if value.dtype.kind == "U" else []
    except Exception:       # absent, not an archive, no such field: nothing recorded
        return []


def _entries(path: str) -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name; any damage is a `CheckpointError` naming the file (and the field)."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a directory, not a checkpoint")
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise CheckpointError(f"{path}: not a deepdsl checkpoint (a single array, not an .npz archive)")
        with archive:
            entries = {}
            for name in archive.files:
                try:
                    entries[name] = archive[name]
                except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
                    raise CheckpointError(f"{path}: field '{name}': unreadable ({err})") from None
                if not isinstance(entries[name], np.ndarray):
                    raise CheckpointError(f"{path}: field '{name}': not an .npy array")
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: corrupt or not an .npz checkpoint ({type(err).__name__}: {err})") from None
    return entries


SAFETENSORS_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": np.uint16,
                      "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                      "BOOL": np.bool_}


def read_weights(path: str) -> dict[str, np.ndarray]:
    """The named tensors of a file to start a run from (`--init-from`): a deepdsl checkpoint (validated as `read`
    does), a plain `.npz` of arrays by name (`np.savez(path, **state)`, e.g. a PyTorch `state_dict` as numpy arrays)
    or a `.safetensors` file (read with numpy alone; bfloat16 widened to float32). Any damage is a
    `CheckpointError` naming the file and the field."""
    if path.endswith(".safetensors"):
        return _read_safetensors(path)
    entries = _entries(path)
    if "__format__" in entries:
        return read(path).tensors
    return {k: v for k, v in entries.items() if not k.startswith("__")}


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file: an 8-byte little-endian header length, a JSON header (name -> dtype,
    shape, [begin, end) byte offsets into the data after it) and the data."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a directory, not a weights file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable ({err.strerror or err})") from None
    if len(raw) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than its header length)")
    length = int.from_bytes(raw[:8], "little")
    try:
        header = json.loads(raw[8:8 + length].decode("utf-8")) if 8 + length <= len(raw) else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (no JSON header of {length} bytes)")
    data, tensors = raw[8 + length:], {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(_count(d) for d in entry["shape"])
            begin, end = (_count(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: field '{name}': not a tensor entry this reader knows "
                                  f"(dtype {entry.get('dtype') if isinstance(entry, dict) else '?'}, shape and "
                                  "offsets of non-negative integers)") from None
        # in Python's integers, before anything is allocated: [2**32, 2**32] would wrap to 0 elements in int64, and
        # the bytes a shape declares must be the bytes the file holds for it
        count = math.prod(shape)
        if not 0 <= begin <= end <= len(data) or end - begin != count * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{path}: field '{name}': its bytes [{begin}, {end}) do not hold {entry['dtype']} "
                                  f"{_dims(shape)}")
        array = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=begin).reshape(shape)
        if entry["dtype"] == "BF16":          # the upper half of a float32
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array
    return tensors


def _count(value) -> int:
    """A JSON size or offset: a non-negative integer (a float, a string or a boolean is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value


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
