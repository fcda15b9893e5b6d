"""Gradient accumulation and data-parallel training over MPI (mpi4py): what `--accumulate K` and `--data-parallel`
of a generated program do.

They run the split step of a program compiled with `deepdsl compile --data-parallel`. One iteration: the global
batch of R x K x b examples (R ranks, K accumulated batches of the compiled batch b) comes from the one seeded
stream that every rank draws alike; rank r runs `accumulate_step` on batches r*K .. r*K + K - 1 of it, adding
their gradients to its accumulators; the accumulators are summed over the ranks (`Ranks.reduce`); `apply_step`
updates the parameters from the sum times 1 / (R*K), the mean gradient of the global batch, whose mean loss is the
iteration's loss. A batch's dropout masks are drawn with its index in the global stream of batches, so they do
not depend on how the batches are spread over ranks. With R = K = 1 the program runs its fused `train_step`, as
without these options.

Batch norm: `--batch-norm synced` (the default) normalizes every batch by the statistics of the R batches the
ranks train on at once (their sums are summed over the ranks inside the step), as one process would normalize a
batch of R x b; `--batch-norm local` by the rank's own batch's, as one process accumulating R batches of b does.
The running statistics follow: after every batch the statistics step updates them from the batch statistics the
accumulate step wrote (synced: the same on every rank); local, every rank replays the updates from the batch
statistics of every rank's batches, in the order of the global stream (one Allgather of a few floats per
batch-norm channel), so the running statistics are those one process accumulating R x K batches computes.

Exactness: `--reduce exact` (the default) sums in rank order along a chain: rank r receives the sum of the ranks
before it, adds its own accumulators and passes the sum on, chunk by chunk so that the ranks work on different
chunks at once; the last rank broadcasts the total. These are the additions one process makes accumulating R
batches, ((G0 + G1) + G2) ..., so R ranks with K = 1 train bit for bit as one process with `--accumulate R` on
the same data. `--reduce fast` is MPI's Allreduce, in an order of MPI's choosing. Either starts during the last
batch's backward pass, bucket by bucket as the step finishes the accumulators (on the CPU; `--no-overlap`: after
the step).

Agreement: the ranks check at the start that they run the same program (structure hash, batch, options), stop at
the same iteration when any of them is signalled (a one-int allreduce per iteration), and before a checkpoint
compare a digest of their parameters and state; rank 0 writes it and the others wait for the rename. An error that
only one rank meets aborts the job (`MPI.Abort`), so no rank waits for ever in a collective; a rank killed outright
ends the job through mpiexec.
"""
from __future__ import annotations

import hashlib
import math
import signal
import sys
import threading
import time

import numpy as np

# chunk of the exact chain reduction, in floats: large enough to amortize a message, small enough to pipeline
CHUNK = 1 << 18
# a bucket of the overlapped reduction: accumulators the step finishes one after another, at least this many bytes
BUCKET_BYTES = 1 << 20
REDUCE_MODES = ("exact", "fast")
BATCH_NORM_MODES = ("synced", "local")


class ParallelError(Exception):
    """The ranks cannot train together (one line); `collective`: every rank found it at the same point."""

    def __init__(self, message: str, collective: bool = False, said: bool = False):
        super().__init__(message)
        self.collective = collective
        self.said = said              # already said (by rank 0): the other ranks stay silent


class Alone:
    """One process: no reduction, no agreement needed."""

    rank, size, local_size = 0, 1, 1
    mode = "exact"
    waited = 0.0                      # seconds spent in reductions
    scratch_bytes = 0

    def reduce(self, flat: np.ndarray) -> None:
        pass

    def gather(self, values: list[float]) -> list[float]:
        return list(values)

    def gather_arrays(self, array: np.ndarray) -> np.ndarray:
        return array[None]

    def largest(self, value: int) -> int:
        return value

    def agree(self, what: dict) -> None:
        pass

    def same(self, digest: str) -> bool:
        return True

    def share(self, value):
        return value

    def barrier(self) -> None:
        pass

    def end(self, status: int, collective: bool) -> None:
        pass


class Ranks:
    """The ranks of an MPI job (`MPI.COMM_WORLD`, R > 1)."""

    def __init__(self, comm, mpi, timeout: float = 0.0, interrupted=None, name: str = "program"):
        self.comm, self.mpi = comm, mpi
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # how long the agreements wait for every rank (0: for ever), the signal received meanwhile, who speaks
        self.timeout, self.interrupted, self.name = timeout, interrupted or (lambda: None), name
        local = comm.Split_type(mpi.COMM_TYPE_SHARED)
        self.local_size = local.Get_size()          # ranks on this machine, which share its cores
        local.Free()
        # the exact chain during the backward pass: its messages and broadcasts, whose order depends on when they
        # complete, apart from those batch norm's sums make meanwhile (a communicator orders its own collectives)
        self.chain_comm = comm.Dup()
        self.waited = 0.0
        self.mode = "exact"                         # how `reduce` sums: the run's --reduce
        self._scratch: np.ndarray | None = None
        self._ahead: np.ndarray | None = None      # the overlapped chain's (batch norm's sums use the other)

    @property
    def scratch_bytes(self) -> int:
        """Bytes the exact reduction receives into (chunks of the sum of the ranks before), besides the
        accumulators: the chain after the step's (and batch norm's sums') and the overlapped chain's."""
        return sum(b.nbytes for b in (self._scratch, self._ahead) if b is not None)

    def ahead(self, floats: int) -> np.ndarray:
        """The overlapped chain's receive space (`OverlappedChain`), at least `floats` float32, kept for the next
        iterations: apart from `_chain`'s, which batch norm's sums use while the overlapped chain receives."""
        self._ahead = _at_least(self._ahead, floats)
        return self._ahead

    def reduce(self, flat: np.ndarray) -> None:
        """Sum `flat` (float32, contiguous) over the ranks into every rank's `flat`, as `mode` says."""
        began = time.perf_counter()
        if self.mode == "fast":
            self.comm.Allreduce(self.mpi.IN_PLACE, flat, op=self.mpi.SUM)
        else:
            self._chain(flat)
        self.waited += time.perf_counter() - began

    def _chain(self, flat: np.ndarray) -> None:
        rank, last = self.rank, self.size - 1
        self._scratch = _at_least(self._scratch, min(CHUNK, flat.size))
        for k, start in enumerate(range(0, flat.size, CHUNK)):
            part = flat[start:start + CHUNK]
            if rank > 0:
                before = self._scratch[:part.size]
                self.comm.Recv(before, source=rank - 1, tag=k)
                np.add(before, part, out=part)          # (sum of the ranks before) + this rank's
            if rank < last:
                self.comm.Send(part, dest=rank + 1, tag=k)
        self.comm.Bcast(flat, root=last)

    def gather(self, values: list[float]) -> list[float]:
        """Every rank's values, in rank order."""
        return [v for part in self.comm.allgather(list(values)) for v in part]

    def gather_arrays(self, array: np.ndarray) -> np.ndarray:
        """Every rank's float32 `array` (of one shape on every rank), stacked in rank order."""
        began = time.perf_counter()
        everyone = np.empty((self.size, *array.shape), np.float32)
        self.comm.Allgather(np.ascontiguousarray(array, np.float32), everyone)
        self.waited += time.perf_counter() - began
        return everyone

    def largest(self, value: int) -> int:
        """The largest of the ranks' `value`s (a one-int allreduce): how they agree to stop."""
        return int(self.comm.allreduce(int(value), op=self.mpi.MAX))

    def agree(self, what: dict) -> None:
        """Refuse to start unless every rank runs with the same `what` (program and options). Every rank has
        reached the agreement before the exchange (`meet`: within --rank-timeout, a signal heard meanwhile)."""
        meet(self.comm, self.comm.Ibarrier(), self.timeout, self.interrupted, self.name, "agreement before training")
        everyone = self.comm.allgather(what)
        for r, theirs in enumerate(everyone):
            differ = [k for k in what if theirs.get(k) != what[k]]
            if differ:
                k = differ[0]
                raise ParallelError(f"rank {r} runs with {k} {theirs.get(k)!r}, rank {self.rank} with {what[k]!r}: "
                                    "every rank must run the same program with the same options", collective=True)

    def same(self, digest: str) -> bool:
        return len(set(self.comm.allgather(digest))) == 1

    def share(self, value):
        """Rank 0's `value`, on every rank."""
        return self.comm.bcast(value, root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

    def end(self, status: int, collective: bool) -> None:
        """After an error this rank has reported: wait for the others where they stop at the same point
        (`collective`), else end the job (`MPI.Abort`), so that no rank waits for ever in a collective. Either
        way after a pause in which mpiexec forwards the lines said (`forwarded`): mpi4py aborts the job when a rank
        leaves with a non-zero status."""
        if collective:
            self.comm.Barrier()
        forwarded()
        if not collective:
            self.comm.Abort(status)


def _at_least(buffer: np.ndarray | None, floats: int) -> np.ndarray:
    """`buffer`, or a larger float32 one where it holds fewer than `floats`."""
    return buffer if buffer is not None and buffer.size >= floats else np.empty(floats, np.float32)


EXIT_STALLED = 5      # a rank made no progress for --rank-timeout seconds: the job was ended


class Watchdog:
    """Ends the job when this rank has made no progress (`beat`) for `seconds`: a rank that is stopped, hung or cut
    off in a way MPI does not notice would leave the others waiting in a collective for ever. One line, then
    `MPI.Abort` from a thread of its own (mpi4py initializes MPI for threads)."""

    def __init__(self, ranks: "Ranks", seconds: float, name: str):
        self.ranks, self.seconds, self.name = ranks, seconds, name
        self.bar_shown = False          # a progress bar holds the current line of standard error
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="deepdsl-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.seconds / 4)):
            if time.monotonic() - self.last > self.seconds:
                # on a line of its own: a progress bar may end the line so far (without a newline)
                forwarded(f"{self.name}: rank {self.ranks.rank}: no progress for {self.seconds:g} s (another rank "
                          "stopped, hung or cannot be reached); ending the job", fresh_line=self.bar_shown)
                self.ranks.comm.Abort(EXIT_STALLED)


class _NoWatchdog:
    bar_shown = False

    def beat(self) -> None:
        pass

    def stop(self) -> None:
        pass


def watchdog(ranks, seconds: float, name: str):
    """A `Watchdog` for the ranks of a job (`seconds` > 0), else one that does nothing."""
    return Watchdog(ranks, seconds, name) if ranks.size > 1 and seconds > 0 else _NoWatchdog()


def world(data_parallel: bool, timeout: float = 0.0, interrupted=None, name: str = "program"):
    """The job this process trains in: `Ranks` under mpiexec with --data-parallel and R > 1, else `Alone`.

    In a job of R > 1 ranks (under `python -m mpi4py`, or with --data-parallel) the ranks first tell each other
    whether they run with --data-parallel, without blocking: a rank that never answers ends the job after
    `timeout` seconds (0: waits for ever), a signal meanwhile (`interrupted()`: its number, or None) ends it at
    once, each with one line; ranks that disagree are refused with one line (rank 0's), `ParallelError(said=True)`
    on every rank. Ranks all without --data-parallel train each alone."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        if not data_parallel and "mpi4py.run" not in sys.modules:     # not under `python -m mpi4py`
            return Alone()
        try:
            from mpi4py import MPI as mpi
        except ImportError:
            raise ParallelError("--data-parallel needs mpi4py and an MPI library (pip install 'deepdsl[mpi]')") \
                from None
    comm = mpi.COMM_WORLD
    if comm.Get_size() == 1:
        return Alone()
    timeout = timeout if math.isfinite(timeout) and timeout > 0 else 0.0
    interrupted = interrupted or (lambda: None)
    mine, everyone = np.array([int(data_parallel)], np.int32), np.zeros(comm.Get_size(), np.int32)
    meet(comm, comm.Iallgather(mine, everyone), timeout, interrupted, name, "start-up agreement")
    if everyone.min() != everyone.max():
        with_it, without = (_ranks_named(np.flatnonzero(everyone == v)) for v in (1, 0))
        message = (f"{with_it} with --data-parallel, {without} without it: every rank of a job must run with it "
                   "(or none: each then trains alone)")
        if comm.Get_rank() == 0:
            _say_line(f"{name}: error: {message}")
        comm.Barrier()
        forwarded()
        raise ParallelError(message, collective=True, said=True)
    return Ranks(comm, mpi, timeout, interrupted, name) if data_parallel else Alone()


FORWARD_SECONDS = 1.0     # how long mpiexec is given to forward a rank's last lines before an abort ends the job


def _say_line(text: str, fresh_line: bool = False) -> None:
    try:
        sys.stderr.write(("\n" if fresh_line else "") + text + "\n")
    except OSError:
        pass


def forwarded(text: str | None = None, fresh_line: bool = False) -> None:
    """Say `text` (one line on standard error; `fresh_line`: after ending the line a progress bar holds), flush
    both streams and pause: mpiexec forwards what a rank wrote before an abort (MPI's, or mpi4py's at a non-zero
    exit) ends every process, which would otherwise race the lines and sometimes win."""
    if text is not None:
        _say_line(text, fresh_line)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    time.sleep(FORWARD_SECONDS)


def meet(comm, request, timeout: float, interrupted, name: str, what: str) -> None:
    """Wait for the non-blocking collective `request` without spinning (MPI's blocking calls poll at full speed
    and hold off signals): within `timeout` seconds (0: for ever), else end the job (exit 5); a signal received
    meanwhile ends it at once (exit 128 + N). Each with one line and `MPI.Abort` (the collective cannot be
    withdrawn, so the process cannot leave MPI in order)."""
    began, rank = time.monotonic(), comm.Get_rank()
    while not request.Test():
        received = interrupted()
        if received:
            forwarded(f"{name}: rank {rank}: {_signal_name(received)} during the {what}; stopped before training")
            comm.Abort(128 + received)
        if timeout and time.monotonic() - began > timeout:
            forwarded(f"{name}: error: rank {rank}: no answer from every rank within {timeout:g} s in the {what} "
                      "(does every rank run this program, with --data-parallel, under `python -m mpi4py`?); "
                      "ending the job")
            comm.Abort(EXIT_STALLED)
        time.sleep(0.005)


def _ranks_named(ranks) -> str:
    """`rank 1 runs` or `ranks 0, 2 run`."""
    return f"rank {ranks[0]} runs" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} run"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def digest(tensors: dict[str, np.ndarray]) -> str:
    """A digest of parameters and state, to compare across ranks."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).tobytes())
    return h.hexdigest()


class Gradients:
    """A model's gradient accumulators (`Model.accumulators`, in the order the accumulate step finishes them),
    contiguous in one float32 buffer: on the CPU the tensors the steps read and write are views of it (no copy to
    reduce); on a device they are device arrays, staged through it. `buckets`: (start, stop) of runs of
    accumulators finished one after another, of at least BUCKET_BYTES each (the last may be smaller);
    `bucket_ending[k]`: the bucket accumulator k completes."""

    def __init__(self, model):
        self.model = model
        shapes = {k: s.shape for k, s in model.accumulators.items()}
        self.sizes = {k: math.prod(s) for k, s in shapes.items()}
        self.flat = np.zeros(sum(self.sizes.values()), np.float32)
        self.views, start = {}, 0
        self.buckets, self.bucket_ending, first = [], {}, 0
        for k, (name, shape) in enumerate(shapes.items()):
            self.views[name] = self.flat[start:start + self.sizes[name]].reshape(shape)
            start += self.sizes[name]
            if 4 * (start - first) >= BUCKET_BYTES or k == len(shapes) - 1:
                self.bucket_ending[k] = len(self.buckets)
                self.buckets.append((first, start))
                first = start
        self.on_host = model.rt.DEVICE == "cpu"
        for k, view in self.views.items():
            model.tensors[k] = view if self.on_host else model.rt.asarray(view)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def zero(self) -> None:
        if self.on_host:
            self.flat[...] = 0.0
        else:
            for k, view in self.views.items():
                self.model.rt.const(out=self.model.tensors[k], value=0.0, shape=view.shape)

    def reduce(self, ranks) -> None:
        if ranks.size == 1:
            return
        if not self.on_host:
            for k, view in self.views.items():
                view[...] = self.model.rt.to_numpy(self.model.tensors[k])
        ranks.reduce(self.flat)
        if not self.on_host:
            for k, view in self.views.items():
                self.model.rt.copy(self.model.rt.asarray(view), out=self.model.tensors[k])


class _AfterTheStep:
    """No reduction during the step (one process, --no-overlap, a device): the sum follows the step."""

    def ready(self, k: int) -> None:
        pass


AFTER_THE_STEP = _AfterTheStep()


class Overlapped:
    """The sums over the ranks of the accumulators' buckets (`--reduce fast`): each started (MPI's Iallreduce, in
    place) as soon as the step has finished its last accumulator, progressed at every later `ready` (MPI progresses
    a non-blocking collective inside MPI calls), waited for after the step (`finish`)."""

    def __init__(self, gradients: Gradients, ranks: "Ranks"):
        self.gradients, self.ranks, self.requests = gradients, ranks, []

    def ready(self, k: int) -> None:
        began, mpi = time.perf_counter(), self.ranks.mpi
        bucket = self.gradients.bucket_ending.get(k)
        if bucket is not None:
            start, stop = self.gradients.buckets[bucket]
            self.requests.append(self.ranks.comm.Iallreduce(mpi.IN_PLACE, self.gradients.flat[start:stop],
                                                            op=mpi.SUM))
        if self.requests:
            mpi.Request.Testall(self.requests)
        self.ranks.waited += time.perf_counter() - began

    def finish(self) -> None:
        began = time.perf_counter()
        self.ranks.mpi.Request.Waitall(self.requests)
        self.ranks.waited += time.perf_counter() - began


class OverlappedChain:
    """The exact sum of the accumulators (`--reduce exact`, `Ranks._chain`'s additions in rank order) while the
    last batch's backward pass goes on: chunk by chunk, as the step finishes each bucket, rank r receives the sum of
    the ranks before it (non-blocking, into one of up to SLOTS chunks of scratch, `Ranks.ahead`), adds its own and
    sends the sum on; the last rank broadcasts each chunk's total (MPI's Ibcast, posted in chunk order on every
    rank). Messages and broadcasts go on `Ranks.chain_comm`. Progressed at every later `ready` (and inside MPI's
    calls), finished after the step (`finish`)."""

    SLOTS = 4           # chunks received ahead of this rank's own additions

    def __init__(self, gradients: Gradients, ranks: "Ranks"):
        self.gradients, self.ranks, self.flat = gradients, ranks, gradients.flat
        self.rank, self.last = ranks.rank, ranks.size - 1
        self.chunks, self.bucket_end = [], []           # (start, stop); chunks[:bucket_end[j]] end with bucket j
        for start, stop in gradients.buckets:
            self.chunks += [(a, min(a + CHUNK, stop)) for a in range(start, stop, CHUNK)]
            self.bucket_end.append(len(self.chunks))
        self.slots = []             # receive space (ranks after the first)
        if self.rank > 0:
            slots, size = min(self.SLOTS, len(self.chunks)), max(b - a for a, b in self.chunks)
            scratch = ranks.ahead(slots * size)
            self.slots = [scratch[k * size:(k + 1) * size] for k in range(slots)]
        self.free = list(range(len(self.slots)))
        self.final = 0              # chunks[:final] hold this rank's whole contribution
        self.posted = 0             # chunks[:posted] have a receive posted (ranks after the first)
        self.receiving: dict[int, tuple[int, object]] = {}     # chunk -> (slot, request)
        self.added = 0              # chunks[:added] hold the sum of ranks 0 .. this one (and were sent on)
        self.sending: dict[int, object] = {}
        self.broadcast: list = []   # requests of the chunks whose total is broadcast, in chunk order

    def _view(self, c: int) -> np.ndarray:
        start, stop = self.chunks[c]
        return self.flat[start:stop]

    def ready(self, k: int) -> None:
        began = time.perf_counter()
        bucket = self.gradients.bucket_ending.get(k)
        if bucket is not None:
            self.final = self.bucket_end[bucket]
        self._advance()
        self.ranks.waited += time.perf_counter() - began

    def finish(self) -> None:
        began = time.perf_counter()
        n = len(self.chunks)
        self.final = n
        while self._advance() < n:          # block on the next thing the chain waits for
            if self.added < n and self.rank > 0:
                self.receiving[self.added][1].Wait()
            else:
                self.sending[len(self.broadcast)].Wait()
        self.ranks.mpi.Request.Waitall(self.broadcast)
        self.ranks.waited += time.perf_counter() - began

    def _advance(self) -> int:
        """Everything the chain can do now without waiting; returns the chunks whose broadcast is posted."""
        comm, n, moved = self.ranks.chain_comm, len(self.chunks), True
        while moved:
            moved = False
            while self.rank > 0 and self.posted < n and self.free:
                slot, c = self.free.pop(), self.posted
                size = self.chunks[c][1] - self.chunks[c][0]
                self.receiving[c] = (slot, comm.Irecv(self.slots[slot][:size], source=self.rank - 1, tag=c))
                self.posted += 1
            while self.added < self.final:
                c, part = self.added, self._view(self.added)
                if self.rank > 0:
                    if c == self.posted:                # its receive waits for a slot: post it first
                        break
                    slot, request = self.receiving[c]
                    if not request.Test():
                        break
                    np.add(self.slots[slot][:part.size], part, out=part)   # (sum of the ranks before) + own
                    del self.receiving[c]
                    self.free.append(slot)
                if self.rank < self.last:
                    self.sending[c] = comm.Isend(part, dest=self.rank + 1, tag=c)
                self.added += 1
                moved = True
            while len(self.broadcast) < self.added:
                c = len(self.broadcast)
                if self.rank < self.last:
                    if not self.sending[c].Test():      # the sum sent on is overwritten by the total
                        break
                    del self.sending[c]
                self.broadcast.append(comm.Ibcast(self._view(c), root=self.last))
                moved = True
        return len(self.broadcast)


class Accumulation:
    """How a run's iterations go: K accumulated batches of b on each of R ranks (`split`: K * R > 1), or the fused
    training step. `overlap`: on the CPU, the buckets are summed while the last batch's backward pass goes on
    (`Overlapped` for `--reduce fast`, `OverlappedChain` for exact). `batch_norm`: "synced" or "local" (see the
    module's docstring)."""

    def __init__(self, ranks, accumulate: int, reduce: str, overlap: bool = True, batch_norm: str = "synced"):
        self.ranks, self.accumulate = ranks, accumulate
        ranks.mode = reduce                              # how its gradients and batch-norm sums are summed
        self.overlap = overlap and ranks.size > 1
        self.batches = accumulate * ranks.size          # batches of b in one iteration, over all ranks
        self.batch_norm = batch_norm
        self.replay = False             # (`start`) the running statistics replayed after the iteration
        self._statistics_size = 0       # (`start`) floats of one batch's statistics
        self.gradients: Gradients | None = None

    @property
    def split(self) -> bool:
        return self.batches > 1

    @property
    def training_step(self) -> str:
        """The model's step that trains on a batch (whose memory the report gives)."""
        return "accumulate_step" if self.split else "train_step"

    @property
    def statistics_bytes(self) -> int:
        """Bytes the replay of the running statistics keeps on the host: the batch statistics of this rank's
        batches and those of every rank's, gathered."""
        return 4 * (self.accumulate + self.batches) * self._statistics_size if self.replay else 0

    def start(self, model) -> None:
        """Allocate the accumulators and batch statistics; with local batch norm the accumulate step's batch
        statistics are the rank's own (its `all_sum`s sum nothing)."""
        self._statistics_size = sum(math.prod(s.shape) for s in model.batch_statistics.values())
        if self.split:
            self.gradients = Gradients(model)
            for name, s in model.batch_statistics.items():
                model.tensors[name] = model.rt.asarray(np.zeros(s.shape, np.float32))
        model.ranks = Alone() if self.batch_norm == "local" else self.ranks
        self.replay = self.batch_norm == "local" and self.ranks.size > 1 and self._statistics_size > 0

    def iterate(self, model, x: np.ndarray, y: np.ndarray, first: int, hyper: dict) -> float:
        """One iteration over the global batch (x, y) whose first batch has index `first` in the global stream of
        batches (or over this rank's K batches of it alone): this rank's K batches accumulated, the sum over the
        ranks, the update. Returns the mean loss."""
        b, k0 = model.batch_shape[0], self.ranks.rank * self.accumulate
        if len(x) == self.accumulate * b < self.batches * b:       # only this rank's K batches (images read from
            k0 = 0                                                  # files: each rank decodes its own share)
        gradients = self.gradients
        gradients.zero()
        overlapped = None
        if self.overlap and gradients.on_host:
            overlapped = (Overlapped if self.ranks.mode == "fast" else OverlappedChain)(gradients, self.ranks)
        losses, statistics = [], []
        for j in range(k0, k0 + self.accumulate):
            if overlapped is not None and j == k0 + self.accumulate - 1:
                model.reduction = overlapped             # the last batch: its accumulators are final
            losses.append(model.accumulate_step(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b], step=first + j))
            if self.replay:
                statistics.append(self._batch_statistics(model))
            else:
                model.statistics_step()
        model.reduction = AFTER_THE_STEP
        if overlapped is not None:
            overlapped.finish()
        else:
            gradients.reduce(self.ranks)
        if self.replay:
            self._replay(model, self.ranks.gather_arrays(np.stack(statistics)))
        model.apply_step(scale=np.float32(1.0 / self.batches), **hyper)
        return sum(self.ranks.gather(losses)) / self.batches

    @staticmethod
    def _batch_statistics(model) -> np.ndarray:
        """The batch statistics the last accumulate step wrote, one flat float32 vector (B_ in name order)."""
        return np.concatenate([model.rt.to_numpy(model.tensors[k]).reshape(-1) for k in model.batch_statistics])

    @staticmethod
    def _replay(model, everyone: np.ndarray) -> None:
        """The running statistics updated from the batch statistics of every rank's batches (`everyone`: rank,
        batch, values), in the order of the global stream, as one process accumulating them all would."""
        for flat in everyone.reshape(-1, everyone.shape[-1]):
            start = 0
            for k, s in model.batch_statistics.items():
                size = math.prod(s.shape)
                model.rt.copy(model.rt.asarray(flat[start:start + size].reshape(s.shape)), out=model.tensors[k])
                start += size
            model.statistics_step()
