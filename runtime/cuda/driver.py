"""The pycuda device layer: contexts, streams, events, device memory, cuBLAS, kernels.

Shared by the tiled GEMM (``gemm.cuda_device.CudaDevice``) and the CUDA training
backend.  pycuda is imported on first use only (``driver()``), so this module
can be imported -- and its pure functions tested -- on machines without CUDA.

* ``CudaContext``: the *primary* context of one GPU (the one the CUDA runtime,
  and therefore cuBLAS, also uses), made current in a thread with ``with ctx:``.
* ``CudaContext.alloc``: device memory (``cuMemAlloc``) for a
  ``deepdsl_runtime.cuda.arrays.DevicePool``, the runtime's one device pool.
* ``PinnedStaging``: page-locked host buffers, a ring per stream, for
  asynchronous host<->device copies of tiles gathered from strided host arrays.
* ``Cublas``: ``cublas{S,D}gemm_v2`` and ``cublasSgemmStridedBatched`` through
  ctypes, from the ``nvidia-cublas`` wheel or the system, bound with the C
  prototypes of ``CUBLAS_PROTOTYPES`` (copied from ``cublas_api.h``);
  ``row_major_gemm`` maps a row-major GEMM onto cuBLAS's column-major one.
* ``GemmKernels``: our own tiled SGEMM/DGEMM (``kernels/gemm.cu``), compiled with
  pycuda when cuBLAS is not available; ``gemm_launch_config`` is its grid.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deepdsl_runtime.cuda.layout import LaunchConfig

__all__ = [
    "driver", "CudaContext", "PinnedStaging", "Cublas", "CublasError",
    "CUBLAS_PROTOTYPES", "CUBLAS_UNUSABLE", "open_cublas", "CublasGemm", "row_major_gemm",
    "cublas_library_candidates", "GemmKernels", "gemm_launch_config", "GEMM_KERNEL_SOURCE",
]

GEMM_KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "gemm.cu"
GEMM_BLOCK_M = 64  # rows of C per thread block (GEMM_BM in gemm.cu)
GEMM_BLOCK_N = 64  # columns of C per thread block (GEMM_BN)
GEMM_THREADS = (16, 16, 1)  # GEMM_TX x GEMM_TY
MAX_GRID_Y = 65535

_driver = None
_driver_lock = threading.Lock()


def driver():
    """``pycuda.driver``, imported and initialised on first call."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                import pycuda.driver as drv
            except ImportError as error:
                raise ImportError("CUDA devices need pycuda: pip install 'deepdsl[cuda]'") from error
            drv.init()
            _driver = drv
    return _driver


# -- launch geometry (pure) ------------------------------------------------------------------
def gemm_launch_config(m: int, n: int) -> LaunchConfig:
    """Grid and block of ``deepdsl_{s,d}gemm_tile`` for an ``m x n`` output tile."""
    if m < 1 or n < 1:
        raise ValueError(f"empty output tile {m}x{n}")
    grid_y = -(-m // GEMM_BLOCK_M)
    if grid_y > MAX_GRID_Y:
        raise ValueError(f"{m} rows need {grid_y} blocks along y, more than {MAX_GRID_Y}")
    return LaunchConfig((-(-n // GEMM_BLOCK_N), grid_y), GEMM_THREADS)


# -- cuBLAS argument mapping (pure) -----------------------------------------------------------
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1


@dataclass(frozen=True, slots=True)
class CublasGemm:
    """Arguments of one column-major ``cublas?gemm`` call, operands named by role."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    first: str  # which row-major operand is cuBLAS's "A"
    lda: int
    second: str  # ... and cuBLAS's "B"
    ldb: int
    ldc: int


def row_major_gemm(transa: bool, transb: bool, m: int, n: int, k: int, lda: int, ldb: int, ldc: int) -> CublasGemm:
    """Map row-major ``C(m x n) = op(A) op(B)`` onto column-major cuBLAS.

    A row-major matrix read column-major is its transpose, so the call computes
    ``C.T (n x m) = op(B).T op(A).T``: operands swapped, dimensions swapped, the
    transpose flags and leading dimensions (row strides) unchanged.
    """
    return CublasGemm(CUBLAS_OP_T if transb else CUBLAS_OP_N, CUBLAS_OP_T if transa else CUBLAS_OP_N,
                      n, m, k, "B", ldb, "A", lda, ldc)


def cublas_library_candidates() -> list[str]:
    """Where to look for libcublas, best first: the nvidia-cublas wheel, then the system."""
    candidates: list[str] = []
    for base in sys.path:
        for pattern in ("nvidia/cublas/lib/libcublas.so*", "nvidia/cu13/lib/libcublas.so*"):
            candidates += sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
    for home in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        candidates += sorted(glob.glob(os.path.join(home, "lib64", "libcublas.so*")), reverse=True)
    candidates += ["libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11"]
    found = ctypes.util.find_library("cublas")
    if found:
        candidates.append(found)
    return list(dict.fromkeys(candidates))  # first occurrence wins


class CublasError(RuntimeError):
    pass


# The C prototypes of the cuBLAS functions we call, as cublas_api.h (CUDA 12 and 13) declares them: per parameter
# its C type, its name in the header and the ctypes type it is passed as. Handles and streams are opaque pointers,
# cublasOperation_t is an int enum (CUBLAS_OP_N = 0, CUBLAS_OP_T = 1), device matrices are passed as addresses
# (c_void_p) and alpha/beta as host scalars by reference (pointer mode host). Every function returns a
# cublasStatus_t, an int enum (0: success). tests/test_cublas_binding.py checks the table against a real header
# and library; tests/support/fake_pycuda.py implements these prototypes for the tests without a GPU.
_HANDLE = ("cublasHandle_t", "handle", ctypes.c_void_p)
_OPS = (("cublasOperation_t", "transa", ctypes.c_int), ("cublasOperation_t", "transb", ctypes.c_int))
_MNK = (("int", "m", ctypes.c_int), ("int", "n", ctypes.c_int), ("int", "k", ctypes.c_int))
_FLOAT_P, _DOUBLE_P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)

CUBLAS_STATUS = ("cublasStatus_t", ctypes.c_int)
CUBLAS_PROTOTYPES: dict[str, tuple[tuple[str, str, type], ...]] = {
    "cublasCreate_v2": (("cublasHandle_t*", "handle", ctypes.POINTER(ctypes.c_void_p)),),
    "cublasDestroy_v2": (_HANDLE,),
    "cublasSetStream_v2": (_HANDLE, ("cudaStream_t", "streamId", ctypes.c_void_p)),
    "cublasSgemm_v2": (
        _HANDLE, *_OPS, *_MNK,
        ("const float*", "alpha", _FLOAT_P),
        ("const float*", "A", ctypes.c_void_p), ("int", "lda", ctypes.c_int),
        ("const float*", "B", ctypes.c_void_p), ("int", "ldb", ctypes.c_int),
        ("const float*", "beta", _FLOAT_P),
        ("float*", "C", ctypes.c_void_p), ("int", "ldc", ctypes.c_int)),
    "cublasDgemm_v2": (
        _HANDLE, *_OPS, *_MNK,
        ("const double*", "alpha", _DOUBLE_P),
        ("const double*", "A", ctypes.c_void_p), ("int", "lda", ctypes.c_int),
        ("const double*", "B", ctypes.c_void_p), ("int", "ldb", ctypes.c_int),
        ("const double*", "beta", _DOUBLE_P),
        ("double*", "C", ctypes.c_void_p), ("int", "ldc", ctypes.c_int)),
    "cublasSgemmStridedBatched": (
        _HANDLE, *_OPS, *_MNK,
        ("const float*", "alpha", _FLOAT_P),
        ("const float*", "A", ctypes.c_void_p), ("int", "lda", ctypes.c_int),
        ("long long int", "strideA", ctypes.c_longlong),
        ("const float*", "B", ctypes.c_void_p), ("int", "ldb", ctypes.c_int),
        ("long long int", "strideB", ctypes.c_longlong),
        ("const float*", "beta", _FLOAT_P),
        ("float*", "C", ctypes.c_void_p), ("int", "ldc", ctypes.c_int),
        ("long long int", "strideC", ctypes.c_longlong),
        ("int", "batchCount", ctypes.c_int)),
}


class Cublas:
    """cuBLAS through ctypes (host pointer mode): handles, streams, ``cublas{S,D}gemm_v2`` and
    ``cublasSgemmStridedBatched``, every function bound with its prototype from ``CUBLAS_PROTOTYPES``.

    ``library``: an already loaded library object (anything with the functions as attributes) instead of
    searching ``cublas_library_candidates()``. Raises OSError when no library loads and AttributeError when one
    lacks a function; callers fall back to our tiled SGEMM on either, or on a ``CublasError`` from a call."""

    def __init__(self, path: str | None = None, *, library=None):
        if library is not None:
            self.lib, self.path = library, getattr(library, "_name", repr(library))
        else:
            errors = []
            for candidate in [path] if path else cublas_library_candidates():
                try:
                    self.lib = ctypes.CDLL(candidate)
                    self.path = candidate
                    break
                except OSError as error:
                    errors.append(f"{candidate}: {error}")
            else:
                raise OSError("libcublas not found; tried " + "; ".join(errors))
        for name, params in CUBLAS_PROTOTYPES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = [ctype for _, _, ctype in params]
            fn.restype = CUBLAS_STATUS[1]

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasError(f"{what} failed with cublasStatus_t {status}")

    def create_handle(self) -> int:
        """A handle bound to the context current in this thread."""
        handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        if not handle.value:
            raise CublasError("cublasCreate returned a null handle")
        return handle.value

    def destroy_handle(self, handle: int) -> None:
        self._check(self.lib.cublasDestroy_v2(ctypes.c_void_p(handle)), "cublasDestroy")

    def set_stream(self, handle: int, stream_handle: int) -> None:
        self._check(self.lib.cublasSetStream_v2(ctypes.c_void_p(handle), ctypes.c_void_p(stream_handle)),
                    "cublasSetStream")

    def gemm(self, handle: int, stream_handle: int, dtype, transa: bool, transb: bool, m: int, n: int, k: int,
             alpha, a_ptr: int, lda: int, b_ptr: int, ldb: int, beta, c_ptr: int, ldc: int) -> None:
        """Row-major ``C = alpha op(A) op(B) + beta C`` on ``stream_handle`` (C unread if beta == 0)."""
        call = row_major_gemm(transa, transb, m, n, k, lda, ldb, ldc)
        ptrs = {"A": a_ptr, "B": b_ptr}
        if np.dtype(dtype) == np.float32:
            fn, scalar = self.lib.cublasSgemm_v2, ctypes.c_float
        else:
            fn, scalar = self.lib.cublasDgemm_v2, ctypes.c_double
        self.set_stream(handle, stream_handle)
        self._check(fn(ctypes.c_void_p(handle), call.transa, call.transb, call.m, call.n, call.k,
                       ctypes.byref(scalar(alpha)), ctypes.c_void_p(ptrs[call.first]), call.lda,
                       ctypes.c_void_p(ptrs[call.second]), call.ldb, ctypes.byref(scalar(beta)),
                       ctypes.c_void_p(c_ptr), call.ldc), "cublas?gemm")

    def gemm_strided_batched(self, handle: int, stream_handle: int, transa: bool, transb: bool, m: int, n: int,
                             k: int, a_ptr: int, lda: int, stride_a: int, b_ptr: int, ldb: int, stride_b: int,
                             c_ptr: int, ldc: int, stride_c: int, batch: int, alpha: float = 1.0,
                             beta: float = 0.0) -> None:
        """Row-major float32 ``C_i = alpha op(A_i) op(B_i) + beta C_i`` for ``i < batch``, operand ``i`` at its
        address + ``i * stride`` elements, on ``stream_handle`` (one ``cublasSgemmStridedBatched``)."""
        from deepdsl_runtime.cuda.layout import strided_batched_gemm

        call = strided_batched_gemm(transa, transb, m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, batch)
        ptrs = {"A": a_ptr, "B": b_ptr}
        self.set_stream(handle, stream_handle)
        self._check(self.lib.cublasSgemmStridedBatched(
            ctypes.c_void_p(handle), call.transa, call.transb, call.m, call.n, call.k,
            ctypes.byref(ctypes.c_float(alpha)), ctypes.c_void_p(ptrs[call.first]), call.lda, call.stride_first,
            ctypes.c_void_p(ptrs[call.second]), call.ldb, call.stride_second, ctypes.byref(ctypes.c_float(beta)),
            ctypes.c_void_p(c_ptr), call.ldc, call.stride_c, call.batch), "cublasSgemmStridedBatched")


# no usable cuBLAS: no library loads, one lacks a function we bind, or a call fails (cublasCreate without a GPU)
CUBLAS_UNUSABLE = (OSError, AttributeError, CublasError)


def open_cublas() -> tuple[Cublas, int]:
    """cuBLAS and a handle bound to the context current in this thread; raises one of ``CUBLAS_UNUSABLE`` when
    there is no usable cuBLAS (the callers then run our tiled SGEMM)."""
    cublas = Cublas()
    return cublas, cublas.create_handle()


# -- contexts ----------------------------------------------------------------------------------
class CudaContext:
    """The primary context of GPU ``ordinal``; ``with ctx:`` makes it current in this thread."""

    def __init__(self, ordinal: int = 0):
        drv = driver()
        count = drv.Device.count()
        if not 0 <= ordinal < count:
            raise ValueError(f"no CUDA device {ordinal} (found {count})")
        self.ordinal = ordinal
        self.device = drv.Device(ordinal)
        self.context = self.device.retain_primary_context()

    @property
    def name(self) -> str:
        return self.device.name()

    @property
    def compute_capability(self) -> tuple[int, int]:
        return self.device.compute_capability()

    def push(self) -> None:
        self.context.push()

    def pop(self) -> None:
        driver().Context.pop()

    def __enter__(self) -> "CudaContext":
        self.push()
        return self

    def __exit__(self, *exc) -> None:
        self.pop()

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of this GPU."""
        with self:
            return driver().mem_get_info()

    def can_access_peer(self, other: "CudaContext") -> bool:
        return other.ordinal != self.ordinal and bool(self.device.can_access_peer(other.device))

    def enable_peer_access(self, other: "CudaContext") -> bool:
        """Let this context read ``other``'s memory directly; False when the GPUs cannot."""
        if not self.can_access_peer(other):
            return False
        drv = driver()
        with self:
            try:
                drv.Context.enable_peer_access(other.context)
            except drv.Error as error:  # enabled before (by us or by someone else) is fine
                if "ALREADY_ENABLED" not in str(error).upper().replace(" ", "_"):
                    raise
        return True

    def alloc(self, nbytes: int) -> tuple[int, object]:
        """(address, allocation): ``nbytes`` of this GPU's memory (``cuMemAlloc``: 256-byte aligned at least)."""
        with self:
            allocation = driver().mem_alloc(nbytes)
        return int(allocation), allocation

    def free(self, allocation) -> None:
        """Give back an allocation of ``alloc`` now."""
        with self:
            allocation.free()

    def stream(self):
        """A new stream (this context must be current)."""
        return driver().Stream()

    def event(self):
        """A new event without timing (cheapest to record and query)."""
        drv = driver()
        return drv.Event(drv.event_flags.DISABLE_TIMING)


# -- pinned host memory ------------------------------------------------------------------------
class PinnedStaging:
    """Page-locked host buffers, ``slots`` per stream, for asynchronous tile copies.

    Pageable numpy memory cannot be copied asynchronously, so a tile is gathered
    from its strided host view into a pinned slot and copied from there (and the
    other way round for results).  A slot is reused only after the copy that last
    used it has completed; the host side of a device-to-host copy (``then``) runs
    at that point or at ``finish_all``.
    """

    def __init__(self, streams: int, slots: int, nbytes: int):
        drv = driver()
        self.nbytes = nbytes
        self.streams = streams
        self._buffers = [[drv.pagelocked_empty(nbytes, np.uint8) for _ in range(slots)] for _ in range(streams)]
        self._busy: dict[tuple[int, int], tuple[object, object]] = {}  # (stream, slot) -> (event, then)
        self._next = [0] * streams

    def take(self, stream: int, shape: tuple[int, ...], dtype) -> tuple[tuple[int, int], np.ndarray]:
        """A free slot of ``stream`` viewed as ``shape``/``dtype`` (waits if all are busy)."""
        slot = self._next[stream]
        self._next[stream] = (slot + 1) % len(self._buffers[stream])
        self._finish((stream, slot))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        view = self._buffers[stream][slot][:nbytes].view(dtype).reshape(shape)
        return (stream, slot), view

    def busy(self, slot: tuple[int, int], event, then=None) -> None:
        self._busy[slot] = (event, then)

    def _finish(self, slot: tuple[int, int]) -> None:
        entry = self._busy.pop(slot, None)
        if entry is not None:
            event, then = entry
            event.synchronize()
            if then is not None:
                then()

    def finish_all(self) -> None:
        for slot in list(self._busy):
            self._finish(slot)


class GemmKernels:
    """Our tiled SGEMM/DGEMM (``kernels/gemm.cu``), compiled once per context with pycuda."""

    def __init__(self):
        from pycuda.compiler import SourceModule

        self.module = SourceModule(GEMM_KERNEL_SOURCE.read_text(), no_extern_c=True, options=["-O3"])
        self._functions = {}
        for dtype, name, scalar in ((np.float32, "deepdsl_sgemm_tile", "f"), (np.float64, "deepdsl_dgemm_tile", "d")):
            fn = self.module.get_function(name)
            fn.prepare("iii" + scalar + "Pii" + "Pii" + scalar + "Pi")
            self._functions[np.dtype(dtype)] = fn

    def gemm(self, stream, dtype, transa: bool, transb: bool, m: int, n: int, k: int, alpha,
             a_ptr: int, lda: int, b_ptr: int, ldb: int, beta, c_ptr: int, ldc: int) -> None:
        """Row-major ``C = alpha op(A) op(B) + beta C`` on ``stream`` (C unread if beta == 0)."""
        dtype = np.dtype(dtype)
        config = gemm_launch_config(m, n)
        self._functions[dtype].prepared_async_call(
            config.grid, config.block, stream,
            int(m), int(n), int(k), float(alpha),
            int(a_ptr), int(lda), int(bool(transa)),
            int(b_ptr), int(ldb), int(bool(transb)),
            float(beta), int(c_ptr), int(ldc))
