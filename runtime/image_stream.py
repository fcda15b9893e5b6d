"""Image datasets read from files (`--data folder:DIR`, `--data shards:PATTERN`), decoded by worker processes
straight into a ring of shared-memory batch slots.

The data: `image_index` finds the splits of a spec and their cached manifests (`Index`: names, labels, sizes); the
training split's images are decoded and transformed (`image_transforms`: decode, crop box, the antialiased
resampling plan, one pass of the program's compiled C kernel or numpy's) to the network's channels and size.

Exactness: a sample's pixels depend only on its record, the transform and its uniforms, drawn from a counter-based
generator keyed by (seed, epoch, sample index); the order of the samples is `data.Order`'s (a permutation per
epoch drawn from (seed, epoch)). So a batch is bit for bit the same whatever the number of workers, the prefetch
depth or the number of ranks (rank r decodes only its share of every global batch, the rows [r K b, (r + 1) K b)),
and the position (epoch, offset) of the batches consumed is, with the seed, the stream's whole state: a resumed run
continues bit for bit.

The pipeline (`Pipeline`): `--workers N` processes, started once for the run as fresh interpreters (`python -m
deepdsl_runtime.image_stream`: no fork of a process that already runs threads), each reading its tasks from a
pipe and writing pixels and labels into the slots of one shared-memory ring (an anonymous memfd mapped by every
process: nothing to leak when a process is killed). The ring has `--prefetch` + 1 slots of this rank's rows of a
global batch; the slot returned by `next` is the program's until the following `next`. Every slot of a batch is
split among the workers in contiguous rows, so they decode while the step runs. The manifests are shared the same
way (one copy, mapped read-only). `--workers 0` decodes in the program's own process, between steps.

Memory: the ring (slots x rows x (C H W floats + a label)), the shared manifests, and in each worker the decoded
image (H x W x C bytes of the largest image met) and the resampling's row pass; `Pipeline.figures` states them.

Bad records: a missing, truncated or undecodable file stops the run (`BadImage`, naming the record, its index and
epoch); with `skip_bad`, it is replaced by the first readable of 64 other records drawn from (seed, epoch, index)
(the same on every rank, whatever the workers), each replacement reported.
"""
from __future__ import annotations

import math
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import numpy as np

from deepdsl_runtime.data import DataError, Order

__all__ = ["BadImage", "ImageBatches", "ImageData", "Pipeline", "is_image_spec", "load"]

KINDS = ("folder", "shards")
REPLACEMENTS = 64          # candidates a bad record's replacement is drawn from
ALIGN = 64                 # bytes: every array of the ring and the shared manifests starts on a cache line
WINDOW = 32                # batches the progress figures are measured over


def is_image_spec(spec: str) -> bool:
    """Whether `spec` names images read from files (`folder:DIR`, `shards:PATTERN`)."""
    kind, _, arg = spec.partition(":")
    return kind in KINDS and bool(arg)


class BadImage(DataError):
    """A record that cannot be read or decoded during a run (one line naming it, its index and epoch)."""


@dataclass
class ImageData:
    """A spec's splits: the training split and the test split (the validation split; the training split where
    there is none, `test_is_train`), decoded to `channels` x `size`."""
    spec: str
    train: object                # image_index.Index
    test: object
    test_is_train: bool
    channels: int
    size: tuple[int, int]

    def __len__(self) -> int:
        return len(self.train)

    @property
    def digest(self) -> str:
        """The data set's digest (the manifests'), recorded in checkpoints: a changed data set is refused."""
        import hashlib
        parts = [self.train.digest] + ([] if self.test_is_train else [self.test.digest])
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def load(spec: str, image_shape: tuple[int, ...], classes: int, progress: bool = False, say=None) -> ImageData:
    """The data of an image spec for a network of (C, H, W) images and `classes` classes: the manifests (cached;
    built on the first use, with a progress bar when `progress`; what a build finds goes to `say`, by default
    standard error), checked against the network."""
    from deepdsl_runtime import image_index

    if len(image_shape) != 3:
        raise DataError(f"{spec}: images read from files give CxHxW images; the network takes "
                        f"{'x'.join(map(str, image_shape))}")
    channels, h, w = image_shape
    if channels not in (1, 3):
        raise DataError(f"{spec}: images decode to 1 (grey) or 3 (RGB) channels; the network takes {channels}")
    train_source, val_source = image_index.splits(spec)
    train = image_index.load_index(train_source, spec, "train", progress=progress, say=say)
    if val_source is not None:
        test = image_index.load_index(val_source, spec, "val", progress=progress, classes=train.classes,
                                       say=say)
    else:
        test = train
    for index, part in ((train, "training"), (test, "test")):
        if len(index) == 0:
            raise DataError(f"{spec}: no {part} images")
        top = int(index.labels.max())
        if top >= classes:
            raise DataError(f"{spec}: {part} labels range over [0, {top}] ({len(index.classes)} classes), the "
                            f"network has {classes} classes")
    return ImageData(spec, train, test, val_source is None, channels, (h, w))


# ----------------------------------------------------------------------------------------------------------------
# shared memory

def _shared_memory(size: int) -> tuple[int, mmap.mmap]:
    """A file descriptor of `size` bytes of shared memory no name refers to (memfd; elsewhere an unlinked
    temporary file) and its mapping: freed when the last process holding it ends, however it ends."""
    size = max(size, 1)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("deepdsl-batches", 0)
    else:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        handle, path = tempfile.mkstemp(prefix="deepdsl-batches-", dir=directory)
        os.unlink(path)
        fd = handle
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        raise


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(arrays: dict[str, np.ndarray]) -> tuple[dict[str, tuple[int, str, tuple[int, ...]]], int]:
    """Where each array goes in one block: {name: (offset, dtype, shape)}, and the block's size."""
    layout, at = {}, 0
    for name, a in arrays.items():
        layout[name] = (at, a.dtype.str, a.shape)
        at += _aligned(a.nbytes)
    return layout, at


def _views(buffer, layout) -> dict[str, np.ndarray]:
    return {name: np.ndarray(shape, np.dtype(dtype), buffer, offset) for name, (offset, dtype, shape) in
            layout.items()}


class Ring:
    """`slots` batch slots of `rows` images of `image_shape` (float32) and their labels (int32), in shared
    memory (`fd`); `attach` maps the same slots in another process."""

    def __init__(self, slots: int, rows: int, image_shape: tuple[int, ...], fd: int | None = None):
        self.slots, self.rows, self.image_shape = slots, rows, tuple(image_shape)
        self.x_bytes = _aligned(rows * math.prod(image_shape) * 4)
        self.slot_bytes = self.slot_size(rows, image_shape)
        self.nbytes = slots * self.slot_bytes
        if fd is None:
            self.fd, self.buffer = _shared_memory(self.nbytes)
        else:
            self.fd, self.buffer = fd, mmap.mmap(fd, max(self.nbytes, 1))
        self.x = [np.ndarray((rows,) + self.image_shape, np.float32, self.buffer, k * self.slot_bytes)
                  for k in range(slots)]
        self.y = [np.ndarray((rows,), np.int32, self.buffer, k * self.slot_bytes + self.x_bytes)
                  for k in range(slots)]

    @staticmethod
    def slot_size(rows: int, image_shape: tuple[int, ...]) -> int:
        """Bytes of one slot: the images, then the labels, each on its own cache lines."""
        return _aligned(rows * math.prod(image_shape) * 4) + _aligned(rows * 4)

    def describe(self) -> tuple:
        return self.slots, self.rows, self.image_shape

    def close(self) -> None:
        self.x = self.y = []
        try:
            self.buffer.close()
        except BufferError:           # a view still exported (a batch the caller holds): freed with it
            pass
        os.close(self.fd)


# ----------------------------------------------------------------------------------------------------------------
# decoding one record into a slot

@dataclass
class Replacement:
    """A bad record replaced (`--skip-bad`)."""
    name: str
    index: int
    epoch: int
    reason: str
    used: str
    used_index: int


class Decoder:
    """Fills rows of a slot with the samples of a split: read, decode, plan, render (in a worker, or in the
    program's process). `indexes`: {"train": Index, "test": Index}."""

    def __init__(self, indexes: dict, transform, channels: int, size: tuple[int, int], seed: int,
                 native=None, skip_bad: bool = False, spec: str = ""):
        from deepdsl_runtime import image_transforms as it

        self.it, self.indexes, self.transform, self.channels = it, indexes, transform, channels
        self.size, self.seed, self.native, self.skip_bad, self.spec = size, seed, native, skip_bad, spec
        self.scale, self.bias = transform.scale_bias(channels)
        self.scratch = None
        self.largest_image = 0            # bytes of the largest decoded image so far (the worker's scratch)

    def image(self, index, i: int) -> np.ndarray:
        """Record `i` decoded; DataError (unreadable) or DecodeError."""
        return self.it.decode(index.read(i), self.channels)

    def fill(self, split: str, indices, epochs, train: bool, x: np.ndarray, y: np.ndarray) -> list[Replacement]:
        """Rows x[k], y[k] of samples (indices[k], epochs[k]); the replacements made. BadImage where a record
        cannot be used (and no replacement is allowed or found)."""
        index, replaced = self.indexes[split], []
        h, w = self.size
        for k, (i, epoch) in enumerate(zip(indices, epochs)):
            i, epoch = int(i), int(epoch)
            try:
                image, used = self.image(index, i), i
            except (DataError, self.it.DecodeError) as err:
                if not self.skip_bad:
                    raise BadImage(f"{self.spec}: {index.name(i)} (sample {i} of the {_split_name(split)} split, "
                                   f"epoch {epoch}): {_reason(err)}; --skip-bad replaces bad records") from None
                image, used = self.replacement(index, split, i, epoch, err, replaced)
            u = self.it.uniforms(self.seed, epoch, i) if train else None
            plan = self.it.plan(self.transform, image.shape[0], image.shape[1], h, w, u, train)
            self.it.render(image, plan, self.scale, self.bias, x[k], self.scratch_for(image, plan), self.native)
            y[k] = index.labels[used]
            self.largest_image = max(self.largest_image, image.nbytes)
        return replaced

    def scratch_for(self, image, plan):
        need = getattr(self.it, "scratch_size", None)
        if need is None:
            return None
        size = need(image.shape, plan)
        if self.scratch is None or self.scratch.size < size:
            self.scratch = np.empty(size, np.float32)
        return self.scratch

    def replacement(self, index, split: str, i: int, epoch: int, err, replaced: list) -> tuple[np.ndarray, int]:
        """The first readable of REPLACEMENTS records drawn from (seed, epoch, i) in place of bad record i."""
        rng = np.random.default_rng([self.seed, epoch, i, 0xBAD])
        for j in rng.integers(0, len(index), REPLACEMENTS):
            j = int(j)
            if j == i:
                continue
            try:
                image = self.image(index, j)
            except (DataError, self.it.DecodeError):
                continue
            replaced.append(Replacement(index.name(i), i, epoch, _reason(err), index.name(j), j))
            return image, j
        raise BadImage(f"{self.spec}: {index.name(i)} (sample {i} of the {_split_name(split)} split, epoch {epoch}): "
                       f"{_reason(err)}; none of {REPLACEMENTS} records drawn to replace it is readable")


def _native(library: str | None):
    """The compiled kernels of the library at `library` (the runtime's generic kernels'), or None for numpy's."""
    if not library:
        return None
    import ctypes

    from deepdsl_runtime.cpu.native import Native
    return Native(ctypes.CDLL(library))


def _reason(err: Exception) -> str:
    """Why a record could not be used, without its name (the caller says it)."""
    return getattr(err, "reason", None) or str(err)


def _split_name(split: str) -> str:
    return "training" if split == "train" else "test"


# ----------------------------------------------------------------------------------------------------------------
# the workers

@dataclass
class _Batch:
    """A slot being filled: its rows still to come, the position after its samples, what was replaced."""
    slot: int
    waiting: int
    position: tuple[int, int]
    rows: int
    replaced: list = field(default_factory=list)
    error: str | None = None


class Pipeline:
    """The worker processes of a run and their ring of `slots` slots of `rows` images; `workers` = 0 decodes in
    this process."""

    def __init__(self, data: ImageData, transform, rows: int, slots: int, workers: int, seed: int,
                 library: str | None = None, skip_bad: bool = False):
        self.data, self.transform = data, transform
        self.rows, self.seed, self.library, self.skip_bad = rows, seed, library, skip_bad
        c, (h, w) = data.channels, data.size
        self.ring = Ring(slots, rows, (c, h, w))
        self.indexes = {"train": data.train, "test": data.test}
        self.tasks: list[Connection] = []
        self.results: list[Connection] = []
        self.processes: list[subprocess.Popen] = []
        self.index_fd = self.index_map = None
        self.index_bytes = sum(ix.nbytes for ix in {id(ix): ix for ix in self.indexes.values()}.values())
        self.batches: dict[int, _Batch] = {}
        self.turn = 0                      # the worker the next batch's first rows go to
        self.local = None                  # the in-process decoder (workers = 0, and the probe batch)
        self.worker_scratch = 0
        if workers:
            self._start(workers)

    # ---- starting and stopping

    def _start(self, count: int) -> None:
        arrays, meta = {}, {}
        for split, ix in self.indexes.items():
            if split == "test" and ix is self.indexes["train"]:
                meta[split] = None                 # the same manifest
                continue
            meta[split] = ix.meta()
            arrays.update({f"{split}.{k}": a for k, a in ix.arrays().items()})
        layout, size = _layout(arrays)
        self.index_fd, self.index_map = _shared_memory(size)
        for name, view in _views(self.index_map, layout).items():
            view[...] = arrays[name]
        setup = {"indexes": meta, "layout": layout, "index_bytes": size, "ring": self.ring.describe(),
                 "transform": self.transform, "channels": self.data.channels, "size": self.data.size,
                 "seed": self.seed, "library": self.library, "skip_bad": self.skip_bad, "spec": self.data.spec}
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for _ in range(count):
            task_r, task_w = os.pipe()
            result_r, result_w = os.pipe()
            fds = (task_r, result_w, self.ring.fd, self.index_fd)
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", "deepdsl_runtime.image_stream", *map(str, fds)], pass_fds=fds,
                    env=env, stdin=subprocess.DEVNULL)
            finally:
                os.close(task_r)
                os.close(result_w)
            self.processes.append(process)
            self.tasks.append(Connection(task_w, readable=False))
            self.results.append(Connection(result_r, writable=False))
            self.tasks[-1].send(setup)

    def close(self) -> None:
        """Stop the workers (they end when their task pipe closes) and free the ring."""
        for conn in self.tasks + self.results:
            conn.close()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.tasks, self.results, self.processes = [], [], []
        if self.index_map is not None:
            self.index_map.close()
            os.close(self.index_fd)
            self.index_map = None
        self.ring.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- filling slots

    def decoder(self) -> Decoder:
        if self.local is None:
            self.local = Decoder(self.indexes, self.transform, self.data.channels, self.data.size, self.seed,
                                 _native(self.library), self.skip_bad, self.data.spec)
        return self.local

    def submit(self, slot: int, split: str, indices: np.ndarray, epochs: np.ndarray, train: bool,
               position: tuple[int, int]) -> None:
        """Fill the first len(indices) rows of `slot` with these samples (decoded now without workers)."""
        rows = len(indices)
        batch = _Batch(slot, 0, position, rows)
        self.batches[slot] = batch
        if not self.processes:
            x, y = self.ring.x[slot], self.ring.y[slot]
            batch.replaced = self.decoder().fill(split, indices, epochs, train, x, y)
            return
        workers = len(self.processes)
        bounds = np.linspace(0, rows, workers + 1).round().astype(int)
        for part in range(workers):
            lo, hi = int(bounds[part]), int(bounds[part + 1])
            if lo == hi:
                continue
            worker = (self.turn + part) % workers
            try:
                self.tasks[worker].send(("fill", slot, lo, split, indices[lo:hi].tolist(), epochs[lo:hi].tolist(),
                                         train))
            except OSError:                  # its pipe closed: the worker has ended
                raise self._ended(worker) from None
            batch.waiting += 1
        self.turn = (self.turn + rows) % workers

    def collect(self, slot: int) -> _Batch:
        """Wait until `slot` is filled; its batch. BadImage for a record that cannot be used; DataError when a
        worker ended."""
        batch = self.batches[slot]
        while batch.waiting:
            ready = wait(self.results)
            for conn in ready:
                self._receive(conn)
        del self.batches[slot]
        if batch.error:
            raise BadImage(batch.error)
        return batch

    def _receive(self, conn: Connection) -> None:
        worker = self.results.index(conn)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            raise self._ended(worker) from None
        kind, slot = message[0], message[1]
        if kind == "failed":
            raise DataError(f"{self.data.spec}: decoding worker {worker}: {message[2]}")
        batch = self.batches.get(slot)
        if batch is None:
            return
        batch.waiting -= 1
        if kind == "bad":
            batch.error = batch.error or message[2]
        else:
            batch.replaced.extend(message[2])
            self.worker_scratch = max(self.worker_scratch, message[3])

    def _ended(self, worker: int) -> DataError:
        """The error of a worker that ended (killed, or out of memory) while the run needed it."""
        status = self.processes[worker].wait()
        how = f"signal {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        return DataError(f"{self.data.spec}: decoding worker {worker} ended ({how})")

    def drain(self) -> None:
        """Wait for every slot in flight (their contents are then discarded)."""
        for slot in list(self.batches):
            try:
                self.collect(slot)
            except DataError:            # a bad image, or a worker gone: said where its batch was wanted
                self.batches.pop(slot, None)

    def figures(self) -> dict:
        """The pipeline's memory and shape, for the report and `deepdsl memory`."""
        return {"workers": len(self.processes), "slots": self.ring.slots, "rows_per_slot": self.rows,
                "ring_bytes": self.ring.nbytes, "index_bytes": self.index_bytes,
                "worker_image_bytes_measured": self.worker_scratch or None}


def planned(data: ImageData, rows: int, slots: int, workers: int) -> dict:
    """The pipeline's memory before it starts, for `deepdsl memory --data`: the ring, the shared manifests, and
    each worker's bound (the largest file of the manifests, its decoded image and the row pass of its resampling
    at the decoder's limit of pixels)."""
    from deepdsl_runtime import image_transforms as it

    c, (h, w) = data.channels, data.size
    indexes = [data.train] if data.test_is_train else [data.train, data.test]
    largest_file = max(int(ix.sizes.max()) for ix in indexes)
    render = it.scratch_bound(c) * 4                                          # image_transforms.scratch_size at most
    return {"workers": workers, "slots": slots, "rows_per_slot": rows,
            "ring_bytes": slots * Ring.slot_size(rows, (c, h, w)),
            "index_bytes": sum(ix.nbytes for ix in indexes), "largest_file_bytes": largest_file,
            "worker_bytes_bound": largest_file + it.MOST_PIXELS * c + render}


def describe(data: ImageData, figures: dict) -> list[str]:
    """Lines stating the pipeline's memory beside a step's memory table."""
    c, (h, w) = data.channels, data.size
    workers = figures["workers"]
    rows = [("ring of batch slots", figures["ring_bytes"],
             f"{figures['slots']} slots x {figures['rows_per_slot']} images (shared memory)"),
            ("manifests", figures["index_bytes"], "shared by the workers"),
            (f"each of {workers} worker{'s' if workers != 1 else ''}", figures["worker_bytes_bound"],
             f"at most: the largest file ({figures['largest_file_bytes'] / 1e6:.2f} MB), its decoded image and the "
             "render's scratch at the decoder's limits (2^26 pixels, sides of 2^15)")]
    return ([f"input pipeline of {data.spec}: {len(data.train)} training and {len(data.test)} test images, decoded "
             f"to {c}x{h}x{w}"] + [f"  {what:22s}{n / 1e6:10.2f} MB  {why}" for what, n, why in rows])


class ImageBatches:
    """A split's batches through a `Pipeline`, with `data.Batches`' interface (`next`, `position`): this rank's
    `rows` of each global batch of `global_rows` positions (from row `first`), prefetched into the ring's free
    slots; the training split shuffled and augmented, the test split in order with the evaluation transform."""

    def __init__(self, pipeline: Pipeline, split: str, rows: int, global_rows: int, first: int, seed: int,
                 train: bool, say=None):
        self.pipeline, self.split, self.rows, self.global_rows, self.first = pipeline, split, rows, global_rows, first
        self.train, self.say = train, say
        size = len(pipeline.indexes[split])
        self.order = Order(size, seed, shuffle=train)
        self.consumed = self.order.position
        self.pending: deque[int] = deque()
        self.held: int | None = None
        self.free = list(range(pipeline.ring.slots))
        self.waited = 0.0
        self.window: deque[tuple[float, float, int]] = deque(maxlen=WINDOW)    # (seconds, waited, images)
        self._last = None

    @property
    def position(self) -> tuple[int, int]:
        return self.consumed

    @position.setter
    def position(self, value: tuple[int, int]) -> None:
        if self.pending or self.held is not None:
            raise ValueError("the position of a stream is set before its first batch")
        self.order.position = value
        self.consumed = self.order.position

    def _refill(self) -> None:
        while self.free:
            slot = self.free.pop(0)
            indices, epochs, _ = self.order.take(self.global_rows)
            part = slice(self.first, self.first + self.rows)
            self.pipeline.submit(slot, self.split, indices[part], epochs[part], self.train, self.order.position)
            self.pending.append(slot)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        if self.held is not None:
            self.free.append(self.held)
            self.held = None
        self._refill()
        slot = self.pending.popleft()
        waiting = time.perf_counter()
        batch = self.pipeline.collect(slot)
        now = time.perf_counter()
        self.waited += now - waiting
        if self._last is not None:
            self.window.append((now - self._last, now - waiting, self.rows))
        self._last = now
        self.held, self.consumed = slot, batch.position
        for r in batch.replaced:
            if self.say is not None:
                self.say(f"skipped {r.name} (sample {r.index}, epoch {r.epoch}): {r.reason}; used {r.used} "
                         f"(sample {r.used_index}) instead")
        return self.pipeline.ring.x[slot][:self.rows], self.pipeline.ring.y[slot][:self.rows]

    def close(self) -> None:
        """Give the slots back: wait for the batches in flight (their images are discarded)."""
        self.pipeline.drain()
        self.pending.clear()
        self.held = None

    def pause(self) -> None:
        """Give the slots back to another stream (the test batches of a validation) and rewind to the next batch
        not yet returned: the stream goes on where it was, its batches decoded again (the same bits: draws are
        keyed by sample and epoch)."""
        self.close()
        self.order.position = self.consumed
        self.free = list(range(self.pipeline.ring.slots))
        self._last = None

    def rates(self) -> tuple[float, float] | None:
        """(images a second, the share of the time spent waiting for data) over the last batches."""
        if not self.window:
            return None
        seconds = sum(w[0] for w in self.window)
        if seconds <= 0:
            return None
        return sum(w[2] for w in self.window) / seconds, sum(w[1] for w in self.window) / seconds


# ----------------------------------------------------------------------------------------------------------------
# a worker process: python -m deepdsl_runtime.image_stream TASKS RESULTS RING INDEX

def _worker(task_fd: int, result_fd: int, ring_fd: int, index_fd: int) -> int:
    # the program decides when its workers end (it saves its checkpoint on these first), and they end with it
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    tasks, results = Connection(task_fd, writable=False), Connection(result_fd, readable=False)
    try:
        setup = tasks.recv()
    except (EOFError, OSError):
        return 0
    try:
        from deepdsl_runtime import image_index

        ring = Ring(*setup["ring"], fd=ring_fd)
        block = mmap.mmap(index_fd, max(setup["index_bytes"], 1), prot=mmap.PROT_READ)
        views = _views(block, setup["layout"])
        indexes = {}
        for split, meta in setup["indexes"].items():
            if meta is None:
                indexes[split] = indexes["train"]
                continue
            prefix = split + "."
            indexes[split] = image_index.Index.from_parts(meta, {k[len(prefix):]: v for k, v in views.items()
                                                                 if k.startswith(prefix)})
        decoder = Decoder(indexes, setup["transform"], setup["channels"], setup["size"], setup["seed"],
                          _native(setup["library"]), setup["skip_bad"], setup["spec"])
    except Exception as err:                 # noqa: BLE001 - said to the program, which stops with one line
        _send(results, ("failed", -1, f"cannot start: {type(err).__name__}: {err}"))
        return 1
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return 0
        _, slot, lo, split, indices, epochs, train = message
        x, y = ring.x[slot][lo:lo + len(indices)], ring.y[slot][lo:lo + len(indices)]
        try:
            replaced = decoder.fill(split, indices, epochs, train, x, y)
            reply = ("done", slot, replaced, decoder.largest_image)
        except BadImage as err:
            reply = ("bad", slot, str(err))
        except Exception as err:             # noqa: BLE001
            reply = ("failed", slot, f"{type(err).__name__}: {err}")
        if not _send(results, reply):
            return 0


def _send(conn: Connection, message) -> bool:
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, OSError):       # the program has gone
        return False


if __name__ == "__main__":               # the worker runs the package's module (what it sends is its classes')
    from deepdsl_runtime import image_stream
    sys.exit(image_stream._worker(*(int(a) for a in sys.argv[1:5])))
