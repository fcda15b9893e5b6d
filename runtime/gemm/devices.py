"""Devices of the tiled GEMM, and the interface the scheduler drives them through.

A device owns a bounded memory (a ``PoolAllocator`` over one chunk) and
``streams`` ordered queues of work.  The scheduler calls, from the device's own
worker thread:

``open(problem, streams)`` / ``close()``
    set up and tear down per call (contexts, streams, scratch space);
``buffer(offset, shape)``
    the device tile stored at a pool offset;
``copy_in(dst, host, s)`` / ``copy_out(host, src, s)`` / ``copy_peer(dst, peer, src, s, after)``
    enqueue a tile copy on stream ``s`` (``after``: an event the copy must wait for);
``gemm(s, transa, transb, alpha, a, b, beta, c)``
    enqueue ``c = alpha op(a) op(b) + beta c``; ``beta == 0`` never reads ``c``;
``wait(s, event)``, ``record(s) -> event``, ``done(event)``, ``synchronize(event=None)``
    ordering between streams and completion; ``None`` is an event that has
    already happened (everything a ``CpuDevice`` does completes before it returns);
``can_access_peer(other)``
    whether tiles may be copied straight from ``other`` (the L2 tile cache).

``CpuDevice`` is the simulated accelerator: a worker thread with its own pool
memory (a ``HostPool``: the capacity and fragmentation limits are real), numpy
BLAS tile kernels and copies that really move bytes between host and "device"
memory.  It makes the scheduler and the caches testable on machines without
GPUs, and shows out-of-core behaviour on one.  ``CudaDevice`` lives in
``gemm.cuda_device`` and imports pycuda only when created.
"""
from __future__ import annotations

import itertools
import os
import time

import numpy as np

from deepdsl_runtime.gemm.tiles import GemmProblem
from deepdsl_runtime.memory.first_fit import HostPool

__all__ = ["CpuDevice", "blas_thread_limit"]

_names = itertools.count()


class CpuDevice:
    """A simulated device: bounded pool memory and numpy BLAS kernels.

    ``memory_bytes``
        size of the device memory (one ``HostPool`` chunk); every tile the device
        holds (cached A/B tiles, C accumulators, kernel scratch) lives there.
    ``slowdown``
        each tile kernel is followed by a sleep of ``(slowdown - 1)`` times its own
        duration, so the device computes ``slowdown`` times slower;
    ``delay_s``
        a fixed extra sleep per tile kernel (deterministic heterogeneity in tests).
    ``peer_group``
        devices in the same group can copy tiles from each other (they share a
        "PCI-E switch"); tiles from other groups come through the host.
    ``blas_threads``
        BLAS threads this device wants; see ``blas_thread_limit``.
    """

    kind = "cpu"

    def __init__(self, memory_bytes: int, *, name: str | None = None, slowdown: float = 1.0,
                 delay_s: float = 0.0, peer_group: int = 0, blas_threads: int | None = None):
        if slowdown < 1.0:
            raise ValueError(f"slowdown must be >= 1, got {slowdown}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.name = name or f"cpu{next(_names)}"
        self.memory = HostPool(memory_bytes)
        self.pool = self.memory.allocator
        self.slowdown = float(slowdown)
        self.delay_s = float(delay_s)
        self.peer_group = peer_group
        self.blas_threads = blas_threads
        self._dtype = np.dtype(np.float32)
        self._scratch: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"CpuDevice({self.name!r}, memory_bytes={self.pool.capacity})"

    # -- lifecycle ------------------------------------------------------------------
    def scratch_bytes(self, problem: GemmProblem) -> int:
        """Pool bytes ``open`` reserves besides tiles: one product buffer."""
        return self.pool.aligned_size(problem.max_tile_nbytes)

    def open(self, problem: GemmProblem, streams: int) -> None:
        self._dtype = problem.dtype
        # The product op(a) op(b) of one step lands here before it is scaled and
        # accumulated, so no tile kernel allocates outside the device memory.
        offset = self.pool.alloc(problem.max_tile_nbytes)
        self._scratch = self.memory.view(offset, (problem.max_tile_nbytes // self._dtype.itemsize,),
                                         self._dtype)

    def close(self) -> None:
        if self._scratch is not None:
            self.memory.free(self._scratch)
            self._scratch = None

    def buffer(self, offset: int, shape: tuple[int, int]) -> np.ndarray:
        return self.memory.view(offset, shape, self._dtype)

    # -- copies (synchronous: the returned event is None, "already happened") --------
    def copy_in(self, dst: np.ndarray, host: np.ndarray, stream: int):
        np.copyto(dst, host)
        return None

    def copy_out(self, host: np.ndarray, src: np.ndarray, stream: int):
        np.copyto(host, src)
        return None

    def copy_peer(self, dst: np.ndarray, peer: "CpuDevice", src: np.ndarray, stream: int, after=None):
        np.copyto(dst, src)
        return None

    def can_access_peer(self, other) -> bool:
        return isinstance(other, CpuDevice) and other is not self and other.peer_group == self.peer_group

    # -- compute ----------------------------------------------------------------------
    def gemm(self, stream: int, transa: bool, transb: bool, alpha, a: np.ndarray, b: np.ndarray,
             beta, c: np.ndarray) -> None:
        start = time.perf_counter()
        opa = a.T if transa else a
        opb = b.T if transb else b
        if beta == 0:
            np.matmul(opa, opb, out=c)  # c is written, never read: NaNs in it cannot leak
            if alpha != 1:
                c *= alpha
        else:
            product = self._scratch[: c.size].reshape(c.shape)
            np.matmul(opa, opb, out=product)
            if alpha != 1:
                product *= alpha
            if beta != 1:
                c *= beta
            c += product
        extra = (self.slowdown - 1.0) * (time.perf_counter() - start) + self.delay_s
        if extra > 0:
            time.sleep(extra)

    # -- ordering -----------------------------------------------------------------------
    def wait(self, stream: int, event) -> None:
        return None

    def record(self, stream: int):
        return None

    def done(self, event) -> bool:
        return True

    def synchronize(self, event=None) -> None:
        return None


def blas_thread_limit(devices) -> int | None:
    """BLAS threads per call so that the CPU workers do not oversubscribe the cores.

    OpenBLAS and MKL keep *one* process-wide thread count (threadpoolctl cannot
    set it per thread), so the tiled GEMM applies a single limit for the whole
    call: the smallest ``blas_threads`` a CPU device asks for, by default the
    number of cores divided by the number of CPU devices.  ``None`` when there
    are no CPU devices.
    """
    cpus = [d for d in devices if getattr(d, "kind", None) == "cpu"]
    if not cpus:
        return None
    default = max(1, (os.cpu_count() or 1) // len(cpus))
    return min(d.blas_threads or default for d in cpus)
