"""``CudaDevice``: one GPU as a device of the tiled GEMM (see ``gemm.devices``).

Built on the pycuda layer of ``deepdsl_runtime.cuda.driver``: the GPU's primary context, one
stream per concurrent task, a ``DevicePool`` chunk holding every tile,
pinned staging slots for asynchronous copies, cuBLAS tile GEMMs (our own CUDA
kernel when cuBLAS cannot be loaded), events for ordering between streams and
peer-to-peer copies between GPUs that can access each other.

Creating a ``CudaDevice`` is what imports pycuda.
"""
from __future__ import annotations

import numpy as np

from deepdsl_runtime.gemm.tiles import GemmProblem

__all__ = ["CudaDevice"]

_RESERVED_BYTES = 256 << 20  # left to the CUDA runtime, cuBLAS workspaces and kernels


class CudaDevice:
    """GPU ``ordinal`` with ``memory_bytes`` of pool memory (default: 90% of what is free,
    less 256 MiB).  ``use_cublas=False`` forces our own tile kernel."""

    kind = "cuda"

    def __init__(self, ordinal: int = 0, memory_bytes: int | None = None, *, name: str | None = None,
                 use_cublas: bool = True, staging_slots: int = 2):
        from deepdsl_runtime.cuda.arrays import DevicePool
        from deepdsl_runtime.cuda.driver import CudaContext

        self.context = CudaContext(ordinal)
        if memory_bytes is None:
            free, _ = self.context.mem_get_info()
            memory_bytes = max(0, int(free * 0.9) - _RESERVED_BYTES)
        self.memory = DevicePool(memory_bytes, self.context.alloc, free=self.context.free)
        self.pool = self.memory.allocator
        self.name = name or f"cuda{ordinal}"
        self.use_cublas = use_cublas
        self.staging_slots = staging_slots
        self._streams: list = []
        self._staging = None
        self._cublas = None
        self._handle = None
        self._kernels = None
        self._dtype = np.dtype(np.float32)
        self._peer_access: dict[int, bool] = {}

    def __repr__(self) -> str:
        return f"CudaDevice({self.context.ordinal}, memory_bytes={self.pool.capacity})"

    # -- lifecycle (called in the worker thread) ---------------------------------------------
    def scratch_bytes(self, problem: GemmProblem) -> int:
        return 0  # tile kernels accumulate in place

    def open(self, problem: GemmProblem, streams: int) -> None:
        from deepdsl_runtime.cuda.driver import CUBLAS_UNUSABLE, GemmKernels, PinnedStaging, open_cublas

        self.context.push()
        try:
            self._dtype = problem.dtype
            while len(self._streams) < streams:
                self._streams.append(self.context.stream())
            nbytes = problem.max_tile_nbytes
            if self._staging is None or self._staging.nbytes < nbytes or self._staging.streams < streams:
                self._staging = PinnedStaging(streams, self.staging_slots, nbytes)
            if self.use_cublas and self._handle is None:
                try:
                    self._cublas, self._handle = open_cublas()
                except CUBLAS_UNUSABLE:  # our own kernel instead
                    self.use_cublas = False
            if not self.use_cublas and self._kernels is None:
                self._kernels = GemmKernels()
        except BaseException:
            self.context.pop()  # close() is only called after a successful open()
            raise

    def close(self) -> None:
        try:
            self.synchronize()
        finally:
            self.context.pop()

    def buffer(self, offset: int, shape: tuple[int, int]):
        return self.memory.view(offset, shape, self._dtype)

    # -- copies --------------------------------------------------------------------------------
    def copy_in(self, dst, host: np.ndarray, stream: int):
        from deepdsl_runtime.cuda.driver import driver

        slot, staged = self._staging.take(stream, host.shape, self._dtype)
        np.copyto(staged, host)  # gather the strided host tile into pinned memory
        driver().memcpy_htod_async(dst.ptr, staged, self._streams[stream])
        event = self.record(stream)
        self._staging.busy(slot, event)
        return event

    def copy_out(self, host: np.ndarray, src, stream: int):
        from deepdsl_runtime.cuda.driver import driver

        slot, staged = self._staging.take(stream, src.shape, self._dtype)
        driver().memcpy_dtoh_async(staged, src.ptr, self._streams[stream])
        event = self.record(stream)
        # The host tile is written when the slot is next needed or at synchronize().
        self._staging.busy(slot, event, then=lambda: np.copyto(host, staged))
        return event

    def copy_peer(self, dst, peer: "CudaDevice", src, stream: int, after=None):
        """Copy a tile from ``peer``'s memory (peer access enabled from this context: ``can_access_peer``).

        With unified addressing a peer's allocation is reachable from this context under its own address, so a
        plain device-to-device copy on our stream does it. (pycuda's ``memcpy_peer_async`` is avoided: up to at
        least pycuda 2026.1 it ignores the contexts it is given, and dereferences a null one when they are left
        out -- an inverted ``None`` check in ``py_memcpy_peer_async``.)"""
        from deepdsl_runtime.cuda.driver import driver

        s = self._streams[stream]
        if after is not None:
            s.wait_for_event(after)  # the source tile's own copy must have landed
        driver().memcpy_dtod_async(dst.ptr, src.ptr, src.nbytes, s)
        return self.record(stream)

    def can_access_peer(self, other) -> bool:
        if not isinstance(other, CudaDevice) or other is self:
            return False
        key = other.context.ordinal
        if key not in self._peer_access:
            self._peer_access[key] = self.context.enable_peer_access(other.context)
        return self._peer_access[key]

    # -- compute ---------------------------------------------------------------------------------
    def gemm(self, stream: int, transa: bool, transb: bool, alpha, a, b, beta, c) -> None:
        m, n = c.shape
        k = a.shape[0] if transa else a.shape[1]
        lda, ldb, ldc = a.shape[1], b.shape[1], n  # tiles are C-contiguous: row stride = columns
        s = self._streams[stream]
        if self.use_cublas:
            self._cublas.gemm(self._handle, s.handle, self._dtype, transa, transb, m, n, k,
                              alpha, a.ptr, lda, b.ptr, ldb, beta, c.ptr, ldc)
        else:
            self._kernels.gemm(s, self._dtype, transa, transb, m, n, k,
                               alpha, a.ptr, lda, b.ptr, ldb, beta, c.ptr, ldc)

    # -- ordering ----------------------------------------------------------------------------------
    def wait(self, stream: int, event) -> None:
        if event is not None:
            self._streams[stream].wait_for_event(event)

    def record(self, stream: int):
        event = self.context.event()
        event.record(self._streams[stream])
        return event

    def done(self, event) -> bool:
        return event is None or event.query()

    def synchronize(self, event=None) -> None:
        if event is not None:
            event.synchronize()
            return
        for s in self._streams:
            s.synchronize()
        if self._staging is not None:
            self._staging.finish_all()

    def release(self) -> None:
        """Free the device chunk, the cuBLAS handle, the streams, the pinned staging and our kernels' module (the
        device is unusable afterwards). They are let go with the device's context current in this thread: pycuda
        frees an object of a context only there or in the context's own thread, and otherwise warns and leaks it,
        as when the cyclic garbage collector happens to run in a worker thread."""
        with self.context:
            if self._handle is not None:
                self._cublas.destroy_handle(self._handle)
            if self._staging is not None:
                self._staging.finish_all()
            self._handle = self._staging = self._kernels = None
            self._streams.clear()
        self.memory.release()
