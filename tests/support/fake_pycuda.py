"""A strict stand-in for pycuda and cuBLAS, for testing the pycuda layer on machines without a GPU.

It mirrors **pycuda 2026.1** (`src/wrapper/wrap_cudadrv.cpp`, `src/cpp/cuda.hpp`, `pycuda/driver.py`,
`pycuda/compiler.py`): the modules `pycuda`, `pycuda.driver` and `pycuda.compiler` with the names, parameter lists
and argument conventions of the real ones, for the part of the API a CUDA program like ours uses -- nothing that
pycuda does not have. `install(monkeypatch)` puts them into `sys.modules` for one test and returns the `FakeCuda`
machine behind them (configuration, counters, the fake cuBLAS library).

What it models, and checks as strictly as the real stack would fail:

- **Initialisation and devices**: every driver call before `init()` fails; `init()` can be made to fail like a
  machine without a driver or GPU; `Device.count()` may be 0.
- **Contexts**: pycuda's per-thread context stack (`Context.push`, the static `Context.pop`, the primary context of
  `Device.retain_primary_context`); objects that need a context (streams, events, memory, modules, pinned memory)
  fail without one as pycuda does ("no currently active context?"); launches and copies on a stream or with a
  function of another context fail; peer access must be enabled (`Context.enable_peer_access`) before one context
  reads another's memory.
- **Memory**: device memory is host memory -- `mem_alloc` returns an allocation whose `int()` is the address of an
  aligned numpy buffer, so the emulator's host-compiled kernels (tests/support/cuda_emulator.py) run on it directly; every
  copy, kernel pointer argument and cuBLAS operand must lie in a live allocation the current context may access.
  `pagelocked_empty` memory is registered: asynchronous copies from or into anything else raise (pycuda documents
  page-locked memory as required), and so does page-locked memory of another context (not `PORTABLE`).
- **Streams and events** run *lazily*: work is queued on its stream and runs only when something waits for it
  (`Stream.synchronize`, `Event.synchronize`, a synchronous copy, which runs on the legacy default stream after all
  the context's streams, `Context.synchronize`), a stream waiting for an event first runs the event's stream up to
  the event. Work that is not ordered correctly therefore runs late and computes wrong results: a missing
  `wait_for_event` or a host buffer reused before its copy finished shows up in the numbers. `Event.query` and
  `Stream.is_done` report without making progress.
- **Kernels**: `SourceModule` checks its include directories resolve the source's `#include "..."` lines (pycuda
  compiles in a temporary directory), wraps the source in `extern "C"` unless `no_extern_c` (as pycuda does: a
  source with templates then fails to compile), and builds the emulator's host library of the source;
  `module_from_buffer` accepts the binaries `SourceModule` made and fat binaries registered with
  `FakeCuda.accept_binary`, and refuses other bytes as the driver refuses an invalid image. `Function.prepare` and
  `prepared_call` / `prepared_async_call` are pycuda's own code (`function_prepare`, `_set_block_shape`,
  `struct.pack` of the format, native alignment like pycuda's `_pvt_struct`); `_launch_kernel` checks the grid and
  block tuples as `cuLaunchKernel` and the kernel's `__launch_bounds__` do and runs the kernel's own code through
  the emulator (`cuda_emulator.HostLibrary.run`, which checks the packed size against the kernel's parameter
  list) -- the tiled GEMM of runtime/kernels/gemm.cu (shared memory, barriers, a 2-D grid) included, block by
  block on the emulator's SIMT fibers.
- **cuBLAS**: `FakeCuda.cublas_library` has `cublasCreate_v2`, `cublasDestroy_v2`, `cublasSetStream_v2`,
  `cublas{S,D}gemm_v2` and `cublasSgemmStridedBatched` as `ctypes.CFUNCTYPE` callbacks with the real C prototypes
  of cublas_api.h (CUDA 13), so ctypes marshals the caller's arguments through the real calling convention; they
  check arguments as cuBLAS does (`CUBLAS_STATUS_INVALID_VALUE`), queue column-major GEMMs (numpy over the raw
  addresses) on the handle's stream, and refuse an output overlapping an operand in a batched call.

Known pycuda 2026.1 behaviour mirrored on purpose: `memcpy_peer` / `memcpy_peer_async` ignore the contexts they are
given (an inverted `None` test in `py_memcpy_peer_async`) and would dereference a null context when they are left
out -- here that raises.
"""
from __future__ import annotations

import bisect
import ctypes
import enum
import hashlib
import importlib.machinery
import re
import struct
import subprocess
import sys
import threading
import types
import weakref
from collections import deque
from pathlib import Path

import numpy as np

from tests.support import cuda_emulator

PYCUDA_VERSION = (2026, 1)
CUDA_VERSION = (13, 0, 0)

_machine: "FakeCuda | None" = None


def _m() -> "FakeCuda":
    if _machine is None:
        raise RuntimeError("the fake pycuda is not installed")
    return _machine


# ----------------------------------------------------------------------------------------------------------------
# errors: pycuda._driver's classes and messages ("<routine> failed: <cuGetErrorString>[ - <detail>]")

class Error(Exception):
    """pycuda._driver.Error"""


class CudaMemoryError(Error):
    """pycuda._driver.MemoryError"""


class LogicError(Error):
    """pycuda._driver.LogicError"""


class LaunchError(Error):
    """pycuda._driver.LaunchError"""


class CudaRuntimeError(Error):
    """pycuda._driver.RuntimeError"""


class CompileError(Error):
    """pycuda.driver.CompileError"""

    def __init__(self, msg, command_line, stdout=None, stderr=None):
        self.msg, self.command_line, self.stdout, self.stderr = msg, command_line, stdout, stderr

    def __str__(self):
        result = self.msg
        if self.command_line:
            result += f"\n[command: {' '.join(self.command_line)}]"
        if self.stderr:
            result += f"\n[stderr:\n{self.stderr}]"
        return result


class ArgumentError(TypeError):
    """Boost.Python.ArgumentError: the arguments do not match the C++ signature."""


# CUresult -> (cuGetErrorString, the pycuda exception class translate_cuda_error picks)
_RESULTS = {
    "INVALID_VALUE": ("invalid argument", LogicError),
    "OUT_OF_MEMORY": ("out of memory", CudaMemoryError),
    "NOT_INITIALIZED": ("initialization error", LogicError),
    "NO_DEVICE": ("no CUDA-capable device is detected", CudaRuntimeError),
    "INVALID_DEVICE": ("invalid device ordinal", LogicError),
    "INVALID_IMAGE": ("device kernel image is invalid", LogicError),
    "INVALID_CONTEXT": ("invalid device context", LogicError),
    "INVALID_HANDLE": ("invalid resource handle", LogicError),
    "NOT_FOUND": ("named symbol not found", LogicError),
    "DEVICE_UNAVAILABLE": ("CUDA-capable device(s) is/are busy or unavailable", LogicError),
    "LAUNCH_OUT_OF_RESOURCES": ("too many resources requested for launch", LaunchError),
    "PEER_ACCESS_ALREADY_ENABLED": ("peer access is already enabled", LogicError),
    "PEER_ACCESS_UNSUPPORTED": ("peer access is not supported between these two devices", LogicError),
    "ILLEGAL_ADDRESS": ("an illegal memory access was encountered", LaunchError),
    "SYSTEM_DRIVER_MISMATCH": ("system has unsupported display driver / cuda driver combination", LogicError),
}


def _fail(routine: str, result: str, detail: str | None = None):
    text, cls = _RESULTS[result]
    message = f"{routine} failed: {text}" + (f" - {detail}" if detail else "")
    raise cls(message)


def _no_context():
    _fail("explicit_context_dependent", "INVALID_CONTEXT", "no currently active context?")


def _integer(value, what: str, bits: int = 64) -> int:
    """An unsigned C++ integer parameter as Boost.Python converts it: a Python int only (`PyLong_Check`; numpy
    integers and floats do not convert), in range."""
    if not isinstance(value, int):
        raise ArgumentError(f"{what}: {type(value).__name__} {value!r} does not convert to an unsigned C++ integer "
                            "(Boost.Python takes Python ints only)")
    if not 0 <= value < 1 << bits:
        raise OverflowError(f"{what}: {value} is out of range")
    return int(value)


def _devptr(value, what: str) -> int:
    """A CUdeviceptr argument: an int, or a DeviceAllocation (implicitly convertible)."""
    if isinstance(value, DeviceAllocation):
        return int(value)
    return _integer(value, what)


def _stream_arg(stream, what: str) -> "Stream | None":
    if stream is not None and not isinstance(stream, Stream):
        raise ArgumentError(f"{what}: the stream must be a pycuda.driver.Stream or None, not {type(stream).__name__}")
    return stream


def _host_buffer(obj, writable: bool) -> tuple[int, int, np.ndarray]:
    """(address, nbytes, array) of a Python buffer as py_buffer_wrapper takes it (PyBUF_ANY_CONTIGUOUS)."""
    array = obj if isinstance(obj, np.ndarray) else np.frombuffer(obj, dtype=np.uint8)
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise ValueError("ndarray is not contiguous")
    if writable and not array.flags.writeable:
        raise ValueError("buffer source array is read-only")
    return array.ctypes.data, array.nbytes, array


# ----------------------------------------------------------------------------------------------------------------
# the machine

class _Gpu:
    def __init__(self, ordinal: int, name: str, capability: tuple[int, int], memory_bytes: int):
        self.ordinal, self.name, self.capability, self.total = ordinal, name, capability, memory_bytes
        self.allocated = 0
        self.primary: _ContextState | None = None


class _ContextState:
    """One CUcontext: its device, the contexts whose memory it may access, its streams (for the legacy stream)."""

    _handles = iter(range(0x7C000000, 1 << 62, 0x1000))

    def __init__(self, gpu: _Gpu, primary: bool):
        self.gpu, self.primary, self.handle = gpu, primary, next(self._handles)
        self.peers: set[_ContextState] = set()
        self.streams: list = []          # kept alive: queued work runs even after its stream is dropped

    def can_access(self, other: "_ContextState") -> bool:
        return other is self or other in self.peers


class _Allocation:
    __slots__ = ("start", "size", "context", "buffer")

    def __init__(self, start, size, context, buffer):
        self.start, self.size, self.context, self.buffer = start, size, context, buffer


class FakeCuda:
    """The fake machine behind the fake pycuda: `devices` GPUs of `memory_bytes` each, all peers of each other
    when `peer_access`. `init_error` ("NO_DEVICE", "NOT_INITIALIZED", ...) makes `init()` fail;
    `context_error` makes `retain_primary_context` fail (e.g. "DEVICE_UNAVAILABLE": a GPU in exclusive mode).
    `cublas_create_status` is what the fake `cublasCreate_v2` returns (0: a handle).

    Counters for tests: `compiles` (SourceModule calls: source, options, include_dirs, no_extern_c),
    `loads` (module_from_buffer: "fatbin" or "cubin"), `launches` (kernel names), `cublas_calls` (names),
    `async_copies`, `peer_copies`."""

    def __init__(self, devices: int = 1, memory_bytes: int = 512 << 20, *, peer_access: bool = True,
                 init_error: str | None = None, context_error: str | None = None, cublas_create_status: int = 0,
                 name: str = "Fake GPU", compute_capability: tuple[int, int] = (9, 0)):
        self.gpus = [_Gpu(i, f"{name} {i}", compute_capability, memory_bytes) for i in range(devices)]
        self.peer_access = peer_access
        self.init_error, self.context_error = init_error, context_error
        self.cublas_create_status = cublas_create_status
        self.initialized = False
        self.lock = threading.RLock()
        self._threads = threading.local()
        self._starts: list[int] = []
        self._allocations: dict[int, _Allocation] = {}
        self._pinned: dict[int, tuple[int, _ContextState, bool]] = {}     # start -> (end, context, portable)
        self._graveyard: list = []           # buffers freed while queued work may still touch them
        self._running = 0                    # operations executing (a stream waiting for an event nests)
        self._streams: dict[int, Stream] = {}                              # handle -> Stream
        self._binaries: dict[bytes, tuple[str, str]] = {}                  # image -> (kind, CUDA source)
        self._libraries: dict[str, cuda_emulator.HostLibrary] = {}
        self.compiles: list[dict] = []
        self.loads: list[str] = []
        self.launches: list[str] = []
        self.cublas_calls: list[str] = []
        self.async_copies = 0
        self.peer_copies = 0
        self.cublas_library = FakeCublasLibrary(self)
        self._order = (0, 1)

    # -- configuration -------------------------------------------------------------------------------------------
    def accept_binary(self, image: bytes, source: str) -> None:
        """Let `module_from_buffer` load `image` (e.g. a dummy fat binary) as the module built from `source`."""
        self._binaries[bytes(image)] = ("fatbin", source)

    def set_order(self, mode: int, seed: int = 1) -> None:
        """The order threads run in (see cuda_emulator.HostDevice.set_order), for every kernel library."""
        self._order = (mode, seed)
        for library in self._libraries.values():
            library.set_order(mode, seed)

    # -- state ---------------------------------------------------------------------------------------------------
    def require_init(self, routine: str) -> None:
        if not self.initialized:
            _fail(routine, "NOT_INITIALIZED")

    def stack(self) -> list:
        """This thread's pycuda context stack (Context objects)."""
        stack = getattr(self._threads, "stack", None)
        if stack is None:
            stack = self._threads.stack = []
        return stack

    def current(self) -> _ContextState | None:
        stack = self.stack()
        return stack[-1]._state if stack else None

    def require_context(self) -> _ContextState:
        context = self.current()
        if context is None:
            _no_context()
        return context

    def primary(self, gpu: _Gpu) -> _ContextState:
        if gpu.primary is None:
            gpu.primary = _ContextState(gpu, primary=True)
        return gpu.primary

    # -- memory --------------------------------------------------------------------------------------------------
    def allocate(self, nbytes: int, context: _ContextState) -> _Allocation:
        gpu = context.gpu
        if gpu.allocated + nbytes > gpu.total:
            _fail("cuMemAlloc", "OUT_OF_MEMORY")
        raw = np.empty(nbytes + 512, dtype=np.uint8)
        shift = (-raw.ctypes.data) % 512
        allocation = _Allocation(raw.ctypes.data + shift, nbytes, context, raw)
        with self.lock:
            bisect.insort(self._starts, allocation.start)
            self._allocations[allocation.start] = allocation
            gpu.allocated += nbytes
        return allocation

    def release(self, allocation: _Allocation) -> None:
        with self.lock:
            del self._allocations[allocation.start]
            self._starts.pop(bisect.bisect_left(self._starts, allocation.start))
            allocation.context.gpu.allocated -= allocation.size
            if self.pending():
                self._graveyard.append(allocation.buffer)    # queued work may still use it (cuMemFree waits)

    def check_device_range(self, address: int, nbytes: int, routine: str, context: _ContextState | None = None):
        """[address, address + nbytes) must lie in one live allocation the context (default: current) can access."""
        context = context or self.require_context()
        with self.lock:
            k = bisect.bisect_right(self._starts, address) - 1         # the last allocation starting at or before
            allocation = self._allocations[self._starts[k]] if k >= 0 else None
        if allocation is None or address + nbytes > allocation.start + allocation.size:
            _fail(routine, "INVALID_VALUE", f"[{address:#x}, {address + nbytes:#x}) is not in a live device "
                                            "allocation")
        if not context.can_access(allocation.context):
            _fail(routine, "INVALID_VALUE", f"{address:#x} is memory of another context and peer access from "
                                            "the current one is not enabled")

    def register_pinned(self, array: np.ndarray, context: _ContextState, portable: bool) -> None:
        start = array.ctypes.data
        with self.lock:
            self._pinned[start] = (start + array.nbytes, context, portable)
        weakref.finalize(array, self._unregister_pinned, start)

    def _unregister_pinned(self, start: int) -> None:
        with self.lock:
            self._pinned.pop(start, None)

    def check_pinned(self, address: int, nbytes: int, routine: str) -> None:
        context = self.require_context()
        with self.lock:
            for start, (end, owner, portable) in self._pinned.items():
                if start <= address and address + nbytes <= end:
                    if portable or owner is context:
                        return
                    _fail(routine, "INVALID_VALUE", "the host buffer is page-locked for another context only")
        _fail(routine, "INVALID_VALUE", "the host buffer is not page-locked memory (pagelocked_empty): pycuda "
                                        "requires page-locked memory for asynchronous copies")

    # -- streams -------------------------------------------------------------------------------------------------
    def pending(self) -> bool:
        return any(s._queue for s in list(self._streams.values()))

    def enqueue(self, stream: "Stream | None", operation, what: str) -> None:
        """Queue `operation` on `stream`; on the legacy default stream (None) run it after everything queued in
        the current context."""
        context = self.require_context()
        with self.lock:
            if stream is None:
                self.drain_context(context)
                operation()
                return
            if stream._state is not context:
                _fail(what, "INVALID_HANDLE", "the stream belongs to another context")
            stream._queue.append((operation, what))
            stream._issued += 1

    def marks(self, stream: "Stream | None", context: _ContextState) -> list:
        """What an event recorded now on `stream` waits for: (stream, operations issued) pairs; on the legacy
        default stream (None), everything issued to the context's blocking streams."""
        if stream is None:
            return [(s, s._issued) for s in list(context.streams) if s._blocking]
        return [(stream, stream._issued)]

    def run_marks(self, marks) -> None:
        with self.lock:
            for stream, upto in marks:
                self.run_stream(stream, upto)

    def run_stream(self, stream: "Stream", upto: int | None = None) -> None:
        with self.lock:
            upto = stream._issued if upto is None else upto
            if stream._running and upto > stream._completed:
                raise AssertionError("a stream waits for its own later work")
            while stream._completed < upto:
                operation, _ = stream._queue.popleft()
                stream._running = True
                self._running += 1
                try:
                    operation()
                finally:
                    stream._running = False
                    stream._completed += 1
                    self._running -= 1
            if not self._running and not self.pending():
                self._graveyard.clear()

    def drain_context(self, context: _ContextState, blocking_only: bool = True) -> None:
        """Run what the context's streams have queued: the blocking ones (what the legacy default stream waits
        for), or all (a context synchronize)."""
        with self.lock:
            for stream in list(context.streams):
                if stream._blocking or not blocking_only:
                    self.run_stream(stream)

    # -- kernels -------------------------------------------------------------------------------------------------
    def library(self, source: str) -> cuda_emulator.HostLibrary:
        library = self._libraries.get(source)
        if library is None:
            library = self._libraries[source] = cuda_emulator.build(source)
            library.set_order(*self._order)
        return library


# ----------------------------------------------------------------------------------------------------------------
# pycuda.driver

def init(flags=0):
    machine = _m()
    if flags != 0:
        _fail("cuInit", "INVALID_VALUE")
    if machine.init_error:
        _fail("cuInit", machine.init_error)
    machine.initialized = True


def get_version():
    return CUDA_VERSION


def get_driver_version():
    return CUDA_VERSION[0] * 1000 + CUDA_VERSION[1] * 10


class event_flags(enum.IntEnum):  # noqa: N801 -- pycuda's name
    DEFAULT = 0
    BLOCKING_SYNC = 1
    DISABLE_TIMING = 2
    INTERPROCESS = 4


class host_alloc_flags:  # noqa: N801 -- pycuda's name
    PORTABLE = 1
    DEVICEMAP = 2
    WRITECOMBINED = 4


class Device:
    """pycuda.driver.Device"""

    def __init__(self, ordinal):
        machine = _m()
        machine.require_init("cuDeviceGet")
        if not isinstance(ordinal, int):
            raise ArgumentError(f"Device takes an int ordinal, not {type(ordinal).__name__}")
        if not 0 <= ordinal < len(machine.gpus):
            _fail("cuDeviceGet", "INVALID_DEVICE")
        self._gpu = machine.gpus[ordinal]

    @staticmethod
    def count():
        machine = _m()
        machine.require_init("cuDeviceGetCount")
        return len(machine.gpus)

    def name(self):
        return self._gpu.name

    def compute_capability(self):
        return self._gpu.capability

    def total_memory(self):
        return self._gpu.total

    def pci_bus_id(self):
        return f"0000:{self._gpu.ordinal + 1:02x}:00.0"

    def can_access_peer(self, dev):
        if not isinstance(dev, Device):
            raise ArgumentError("can_access_peer takes a Device")
        return int(_m().peer_access and dev._gpu is not self._gpu)

    def make_context(self, flags=0):
        machine = _m()
        machine.require_init("cuCtxCreate")
        context = Context(_ContextState(self._gpu, primary=False))
        machine.stack().append(context)
        return context

    def retain_primary_context(self):
        machine = _m()
        machine.require_init("cuDevicePrimaryCtxRetain")
        if machine.context_error:
            _fail("cuDevicePrimaryCtxRetain", machine.context_error)
        return Context(machine.primary(self._gpu))

    def __eq__(self, other):
        return isinstance(other, Device) and other._gpu is self._gpu

    def __hash__(self):
        return hash(self._gpu)


class Context:
    """pycuda.driver.Context: push() and the static pop() maintain pycuda's per-thread stack."""

    def __init__(self, state: _ContextState):
        self._state = state
        self._valid = True

    def __eq__(self, other):
        return isinstance(other, Context) and other._state is self._state

    def __hash__(self):
        return hash(self._state)

    @property
    def handle(self):
        return self._state.handle

    def push(self):
        if not self._valid:
            _fail("context::push", "INVALID_CONTEXT")
        _m().stack().append(self)

    @staticmethod
    def pop():
        stack = _m().stack()
        if not stack:
            _fail("context::pop", "INVALID_CONTEXT", "cannot pop non-current context")
        stack.pop()

    @staticmethod
    def get_current():
        stack = _m().stack()
        return stack[-1] if stack else None

    @staticmethod
    def get_device():
        state = _m().require_context()
        device = Device.__new__(Device)
        device._gpu = state.gpu
        return device

    @staticmethod
    def synchronize():
        machine = _m()
        machine.drain_context(machine.require_context(), blocking_only=False)

    @staticmethod
    def enable_peer_access(peer, flags=0):
        machine = _m()
        current = machine.require_context()
        if not isinstance(peer, Context):
            raise ArgumentError("enable_peer_access takes a Context")
        if flags != 0 or peer._state is current:
            _fail("cuCtxEnablePeerAccess", "INVALID_VALUE")
        if not machine.peer_access or peer._state.gpu is current.gpu:
            _fail("cuCtxEnablePeerAccess", "PEER_ACCESS_UNSUPPORTED")
        if peer._state in current.peers:
            _fail("cuCtxEnablePeerAccess", "PEER_ACCESS_ALREADY_ENABLED")
        current.peers.add(peer._state)

    @staticmethod
    def disable_peer_access(peer):
        current = _m().require_context()
        current.peers.discard(peer._state)

    def detach(self):
        if not self._valid:
            _fail("context::detach", "INVALID_CONTEXT", "cannot detach from invalid context")
        stack = _m().stack()
        if stack and stack[-1] == self:
            stack.pop()
        self._valid = False


class DeviceAllocation:
    """pycuda.driver.DeviceAllocation: `int()` is the address; freed by `free()` or when collected."""

    def __init__(self, allocation: _Allocation):
        self._allocation = allocation
        self._machine = _m()

    def __int__(self):
        if self._allocation is None:
            _fail("device_allocation", "INVALID_HANDLE")
        return self._allocation.start

    __index__ = __int__

    def free(self):
        if self._allocation is None:
            _fail("device_allocation::free", "INVALID_HANDLE")
        allocation, self._allocation = self._allocation, None
        self._machine.release(allocation)

    def __del__(self):
        if getattr(self, "_allocation", None) is not None:
            self.free()


def mem_alloc(bytes):  # noqa: A002 -- pycuda's parameter name
    machine = _m()
    context = machine.require_context()
    if _integer(bytes, "mem_alloc") == 0:
        _fail("cuMemAlloc", "INVALID_VALUE")
    return DeviceAllocation(machine.allocate(bytes, context))


def mem_get_info():
    machine = _m()
    gpu = machine.require_context().gpu
    return gpu.total - gpu.allocated, gpu.total


def pagelocked_empty(shape, dtype, order="C", mem_flags=0):
    machine = _m()
    context = machine.require_context()
    dtype = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)         # npy_intp values: Python ints only
    dims = tuple(_integer(d, "pagelocked_empty shape", 63) for d in dims)
    if order not in ("C", "F"):
        _fail("numpy_empty", "INVALID_VALUE", "unrecognized order specifier")
    nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 4096, dtype=np.uint8)                     # page-aligned, as cuMemHostAlloc
    shift = (-raw.ctypes.data) % 4096
    array = raw[shift:shift + nbytes].view(dtype).reshape(dims, order=order)
    machine.register_pinned(raw, context, bool(mem_flags & host_alloc_flags.PORTABLE))
    return array


def pagelocked_zeros(shape, dtype, order="C", mem_flags=0):
    result = pagelocked_empty(shape, dtype, order, mem_flags)
    result.fill(0)
    return result


def pagelocked_empty_like(array, mem_flags=0):
    return pagelocked_empty(array.shape, array.dtype, "F" if np.isfortran(array) else "C", mem_flags)


def pagelocked_zeros_like(array, mem_flags=0):
    result = pagelocked_empty_like(array, mem_flags)
    result.fill(0)
    return result


def _copy(dst: int, src: int, nbytes: int) -> None:
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


def memcpy_htod(dest, src):
    machine = _m()
    dst = _devptr(dest, "memcpy_htod")
    address, nbytes, _ = _host_buffer(src, writable=False)
    machine.check_device_range(dst, nbytes, "cuMemcpyHtoD")
    machine.enqueue(None, lambda: _copy(dst, address, nbytes), "cuMemcpyHtoD")


def memcpy_htod_async(dest, src, stream=None):
    machine = _m()
    dst = _devptr(dest, "memcpy_htod_async")
    address, nbytes, keep = _host_buffer(src, writable=False)
    stream = _stream_arg(stream, "memcpy_htod_async")
    machine.check_device_range(dst, nbytes, "cuMemcpyHtoDAsync")
    machine.check_pinned(address, nbytes, "cuMemcpyHtoDAsync")
    machine.async_copies += 1
    machine.enqueue(stream, lambda keep=keep: _copy(dst, address, nbytes), "cuMemcpyHtoDAsync")


def memcpy_dtoh(dest, src):
    machine = _m()
    address, nbytes, _ = _host_buffer(dest, writable=True)
    source = _devptr(src, "memcpy_dtoh")
    machine.check_device_range(source, nbytes, "cuMemcpyDtoH")
    machine.enqueue(None, lambda: _copy(address, source, nbytes), "cuMemcpyDtoH")


def memcpy_dtoh_async(dest, src, stream=None):
    machine = _m()
    address, nbytes, keep = _host_buffer(dest, writable=True)
    source = _devptr(src, "memcpy_dtoh_async")
    stream = _stream_arg(stream, "memcpy_dtoh_async")
    machine.check_device_range(source, nbytes, "cuMemcpyDtoHAsync")
    machine.check_pinned(address, nbytes, "cuMemcpyDtoHAsync")
    machine.async_copies += 1
    machine.enqueue(stream, lambda keep=keep: _copy(address, source, nbytes), "cuMemcpyDtoHAsync")


def _dtod(dest, src, size, stream, routine):
    machine = _m()
    dst, source, size = _devptr(dest, routine), _devptr(src, routine), _integer(size, routine)
    machine.check_device_range(dst, size, routine)
    machine.check_device_range(source, size, routine)
    machine.enqueue(stream, lambda: _copy(dst, source, size), routine)


def memcpy_dtod(dest, src, size):
    _dtod(dest, src, size, None, "cuMemcpyDtoD")


def memcpy_dtod_async(dest, src, size, stream=None):
    _dtod(dest, src, size, _stream_arg(stream, "memcpy_dtod_async"), "cuMemcpyDtoDAsync")


def _peer(dest, src, size, dest_context, src_context, stream, routine):
    # pycuda 2026.1 (py_memcpy_peer{,_async}): `if (dest_context_py.ptr() == Py_None) dest_context = extract(...)`
    # -- a None context becomes a null pointer that is dereferenced, and a given one is ignored in favour of the
    # current context.
    if dest_context is None or src_context is None:
        raise LogicError(f"{routine}: pycuda {PYCUDA_VERSION[0]}.{PYCUDA_VERSION[1]} dereferences a null context "
                         "when dest_context or src_context is None")
    _m().peer_copies += 1
    _dtod(dest, src, size, stream, routine)


def memcpy_peer(dest, src, size, dest_context=None, src_context=None):
    _peer(dest, src, size, dest_context, src_context, None, "cuMemcpyPeer")


def memcpy_peer_async(dest, src, size, dest_context=None, src_context=None, stream=None):
    _peer(dest, src, size, dest_context, src_context, _stream_arg(stream, "memcpy_peer_async"), "cuMemcpyPeerAsync")


class Stream:
    """pycuda.driver.Stream: flags 0 a blocking stream (the legacy default stream waits for its work and it for the
    legacy stream's), 1 (CU_STREAM_NON_BLOCKING) one that the legacy stream does not order."""

    _handles = iter(range(0x5A000000, 1 << 62, 0x100))

    def __init__(self, flags=0):
        machine = _m()
        self._state = machine.require_context()
        self._blocking = not _integer(flags, "Stream flags", 32) & 1
        self._machine = machine
        self._queue: deque = deque()
        self._issued = self._completed = 0
        self._running = False
        self._handle = next(self._handles)
        self._state.streams.append(self)
        machine._streams[self._handle] = self

    @property
    def handle(self):
        return self._handle

    def synchronize(self):
        self._machine.run_stream(self)

    def is_done(self):
        return self._completed == self._issued

    def wait_for_event(self, evt):
        if not isinstance(evt, Event):
            raise ArgumentError("wait_for_event takes an Event")
        marks = list(evt._marks)     # the work recorded by then (cuStreamWaitEvent), possibly of another context
        self._machine.enqueue(self, lambda: self._machine.run_marks(marks), "cuStreamWaitEvent")


class Event:
    """pycuda.driver.Event"""

    def __init__(self, flags=0):
        machine = _m()
        self._state = machine.require_context()
        self._machine = machine
        self._flags = _integer(flags, "Event flags", 32)
        self._marks: list = []

    def record(self, stream=None):
        machine = self._machine
        stream = _stream_arg(stream, "Event.record")
        if machine.require_context() is not self._state or (stream is not None and stream._state is not self._state):
            _fail("cuEventRecord", "INVALID_HANDLE", "the event, the stream and the current context differ")
        self._marks = machine.marks(stream, self._state)
        return self

    def synchronize(self):
        self._machine.run_marks(self._marks)
        return self

    def query(self):
        return all(stream._completed >= upto for stream, upto in self._marks)

    def time_since(self, start):
        if self._flags & event_flags.DISABLE_TIMING or start._flags & event_flags.DISABLE_TIMING:
            _fail("cuEventElapsedTime", "INVALID_HANDLE")
        return 0.0

    def time_till(self, end):
        return end.time_since(self)


# -- modules and functions ---------------------------------------------------------------------------------------

class Module:
    """pycuda.driver.Module of a fake image of `source`: its kernels run from the emulator's host library of the
    source; per kernel, its `__launch_bounds__`."""

    def __init__(self, source: str, context: _ContextState):
        machine = _m()
        self._state, self._machine, self._source = context, machine, source
        self._library = machine.library(source)
        self._kernels = self._library.bounds()

    def get_function(self, name):
        if name not in self._kernels:
            _fail("cuModuleGetFunction", "NOT_FOUND", name)
        return Function(self, name)

    def get_global(self, name):
        _fail("cuModuleGetGlobal", "NOT_FOUND", name)


def module_from_buffer(buffer, options=[], message_handler=None):  # noqa: B006 -- pycuda's signature
    machine = _m()
    context = machine.require_context()
    image = bytes(memoryview(buffer))
    known = machine._binaries.get(image) or _built_fatbin(image)
    if known is None:
        _fail("cuModuleLoadDataEx", "INVALID_IMAGE")
    kind, source = known
    machine.loads.append(kind)
    return Module(source, context)


class Function:
    """pycuda.driver.Function with pycuda's own prepare / prepared_call / prepared_async_call (driver.py, CUDA
    4 and later), launching through `_launch_kernel` as the C++ side does."""

    def __init__(self, module: Module, name: str):
        self._module, self._name = module, name
        self._block = (1, 1, 1)
        self.texrefs = []
        self.arg_format = ""

    # pycuda/driver.py: function_prepare
    def prepare(self, arg_types, texrefs=None):
        if texrefs is None:
            texrefs = []
        self.texrefs = texrefs
        self.arg_format = ""
        for arg_type in arg_types:
            if isinstance(arg_type, type) and np.number in arg_type.__mro__:
                self.arg_format += np.dtype(arg_type).char
            elif isinstance(arg_type, np.dtype):
                self.arg_format += f"{arg_type.itemsize}s" if arg_type.char == "V" else arg_type.char
            elif isinstance(arg_type, str):
                self.arg_format += arg_type
            else:
                self.arg_format += np.dtype(np.uintp).char
        return self

    # pycuda/driver.py: function_prepared_call
    def prepared_call(self, grid, block, *args, **kwargs):
        if isinstance(block, tuple):
            self._set_block_shape(*block)
        else:
            import warnings
            warnings.warn("Not passing the block size to prepared_call is deprecated as of version 2011.1.",
                          DeprecationWarning, stacklevel=2)
            args = (block, *args)
        shared_size = kwargs.pop("shared_size", 0)
        if kwargs:
            raise TypeError("unknown keyword arguments: " + ", ".join(kwargs.keys()))
        self._check_pointers(args)
        self._launch_kernel(grid, block, struct.pack(self.arg_format, *args), shared_size, None)

    # pycuda/driver.py: function_prepared_async_call
    def prepared_async_call(self, grid, block, stream, *args, **kwargs):
        if isinstance(block, tuple):
            self._set_block_shape(*block)
        else:
            import warnings
            warnings.warn("Not passing the block size to prepared_async_call is deprecated as of version 2011.1.",
                          DeprecationWarning, stacklevel=2)
            args = (stream, *args)
            stream = block
        shared_size = kwargs.pop("shared_size", 0)
        if kwargs:
            raise TypeError("unknown keyword arguments: " + ", ".join(kwargs.keys()))
        self._check_pointers(args)
        self._launch_kernel(grid, block, struct.pack(self.arg_format, *args), shared_size, stream)

    def _set_block_shape(self, x, y, z):
        self._block = tuple(_integer(v, "set_block_shape", 31) for v in (x, y, z))

    def _check_pointers(self, args) -> None:
        """Every pointer argument (`P`) must address memory the current context may access (or be null)."""
        codes = "".join(count and code * int(count) or code
                        for count, code in re.findall(r"(\d*)([a-zA-Z?])", self.arg_format.lstrip("@=<>!")))
        for code, value in zip(codes, args):
            if code == "P" and int(value) != 0:
                self._module._machine.check_device_range(int(value), 1, f"cuLaunchKernel({self._name})")

    def _launch_kernel(self, grid, block, arg_buf, shared_size, stream):
        machine = self._module._machine
        if not isinstance(grid, tuple) or not isinstance(block, tuple):
            raise ArgumentError("_launch_kernel takes the grid and the block as tuples")
        if len(grid) > 3 or len(block) > 3:
            _fail("function::launch_kernel", "INVALID_HANDLE", "too many grid or block dimensions in kernel launch")
        grid = tuple(_integer(v, "grid", 32) for v in grid) + (1,) * (3 - len(grid))
        block = tuple(_integer(v, "block", 32) for v in block) + (1,) * (3 - len(block))
        stream = _stream_arg(stream, "_launch_kernel")
        context = machine.require_context()
        if self._module._state is not context:
            _fail("cuLaunchKernel", "INVALID_HANDLE", f"{self._name} belongs to a module of another context")
        if min(grid) < 1 or grid[0] > 2 ** 31 - 1 or max(grid[1:]) > 65535 or min(block) < 1 or \
                max(block[:2]) > 1024 or block[2] > 64 or not 0 <= shared_size <= 48 << 10:
            _fail("cuLaunchKernel", "INVALID_VALUE", f"{self._name} grid={grid} block={block}")
        threads = self._module._kernels[self._name]
        if block[0] * block[1] * block[2] > threads:
            _fail("cuLaunchKernel", "LAUNCH_OUT_OF_RESOURCES",
                  f"{self._name}: {block} is more threads than __launch_bounds__({threads})")
        packed = bytes(memoryview(arg_buf))
        name, library = self._name, self._module._library
        operation = lambda: library.run(name, packed, grid, block)  # noqa: E731
        machine.launches.append(name)
        machine.enqueue(stream, operation, f"cuLaunchKernel({name})")


def _strided(address: int, shape: tuple[int, int], strides: tuple[int, int], dtype) -> np.ndarray:
    """A (rows, cols) view of raw memory with the given element strides (no copy)."""
    dtype = np.dtype(dtype)
    span = 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 1
    base = np.frombuffer((ctypes.c_char * (span * dtype.itemsize)).from_address(address), dtype=dtype)
    return np.lib.stride_tricks.as_strided(base, shape, tuple(s * dtype.itemsize for s in strides))


# ----------------------------------------------------------------------------------------------------------------
# pycuda.compiler

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_PACKAGE_DIR = Path(__file__).resolve().parent / "_fake_pycuda"      # where the fake modules say they live


def _resolve_includes(source: str, directories: list[str], here: Path | None, command: list[str]) -> None:
    """Every quoted include must be found next to the including file or in an include directory (the top-level
    source is compiled from a temporary directory, as pycuda does)."""
    for name in _INCLUDE.findall(source):
        candidates = ([here / name] if here else []) + [Path(d) / name for d in directories]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise CompileError("nvcc compilation of kernel.cu failed", command,
                               stderr=f'kernel.cu: catastrophic error: cannot open source file "{name}"')
        _resolve_includes(found.read_text(), directories, found.parent, command)


def compile(source, nvcc="nvcc", options=None, keep=False, no_extern_c=False, arch=None, code=None,  # noqa: A001
            cache_dir=None, include_dirs=None, target="cubin"):
    """pycuda.compiler.compile: the options pycuda passes to nvcc, then a fake binary of the source."""
    machine = _m()
    if include_dirs is None:
        include_dirs = []
    assert target in ["cubin", "ptx", "fatbin"]
    if not no_extern_c:
        source = 'extern "C" {\n%s\n}\n' % source
    options = list(options or [])
    if arch is None:
        try:
            arch = "sm_%d%d" % Context.get_device().compute_capability()
        except Error:
            pass
    if arch is not None:
        options.extend(["-arch", arch])
    if code is not None:
        options.extend(["-code", code])
    include_dirs = [*include_dirs, str(_PACKAGE_DIR / "pycuda" / "cuda")]     # _find_pycuda_include_path()
    options += ["-I" + d for d in include_dirs]
    command = [nvcc, "--" + target, *options, "kernel.cu"]
    _resolve_includes(source, include_dirs, None, command)
    machine.compiles.append({"source": source, "options": options, "include_dirs": include_dirs,
                             "no_extern_c": no_extern_c})
    try:
        machine.library(source)               # the emulator's host build of the source (g++): must compile
    except subprocess.CalledProcessError as err:
        raise CompileError("nvcc compilation of kernel.cu failed", command, stderr=err.stderr) from None
    image = b"FAKE-CUBIN" + hashlib.sha256(source.encode()).digest()
    machine._binaries[image] = ("cubin", source)
    return image


class CudaModule:
    """pycuda.compiler.CudaModule"""

    def get_function(self, name):
        return self.module.get_function(name)


class SourceModule(CudaModule):
    """pycuda.compiler.SourceModule: compile, then `module_from_buffer` of the binary."""

    def __init__(self, source, nvcc="nvcc", options=None, keep=False, no_extern_c=False, arch=None, code=None,
                 cache_dir=None, include_dirs=None):
        if include_dirs is None:
            include_dirs = []
        cubin = compile(source, nvcc, options, keep, no_extern_c, arch, code, cache_dir, include_dirs)
        self.module = module_from_buffer(cubin)
        self.get_global = self.module.get_global


# ----------------------------------------------------------------------------------------------------------------
# cuBLAS

_vp, _int, _ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_fptr, _dptr = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)
# cublas_api.h of nvidia-cublas 13.x: every function returns cublasStatus_t
CUBLAS_HEADER_PROTOTYPES = {
    "cublasCreate_v2": (ctypes.POINTER(_vp),),                               # cublasHandle_t* handle
    "cublasDestroy_v2": (_vp,),                                              # cublasHandle_t handle
    "cublasSetStream_v2": (_vp, _vp),                                        # handle, cudaStream_t streamId
    # handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc
    "cublasSgemm_v2": (_vp, _int, _int, _int, _int, _int, _fptr, _vp, _int, _vp, _int, _fptr, _vp, _int),
    "cublasDgemm_v2": (_vp, _int, _int, _int, _int, _int, _dptr, _vp, _int, _vp, _int, _dptr, _vp, _int),
    # handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC, batchCount
    "cublasSgemmStridedBatched": (_vp, _int, _int, _int, _int, _int, _fptr, _vp, _int, _ll, _vp, _int, _ll, _fptr,
                                  _vp, _int, _ll, _int),
}
CUBLAS_STATUS_SUCCESS, CUBLAS_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_INVALID_VALUE = 0, 1, 7
CUBLAS_STATUS_EXECUTION_FAILED = 13


class FakeCublasLibrary:
    """A stand-in for the loaded libcublas: its functions are ctypes callbacks with cuBLAS's C prototypes.
    `errors` collects the reason of every non-success status; `missing` names functions to leave out (a library
    that lacks them)."""

    _name = "fake libcublas"

    def __init__(self, machine: FakeCuda, missing: tuple[str, ...] = ()):
        self._machine = machine
        self._handles: dict[int, list] = {}          # handle -> [context, stream or None]
        self._next = iter(range(0xC0B1A5000, 1 << 62, 0x10))
        self.errors: list[str] = []
        implementations = {"cublasCreate_v2": self._create, "cublasDestroy_v2": self._destroy,
                           "cublasSetStream_v2": self._set_stream,
                           "cublasSgemm_v2": lambda *a: self._gemm("cublasSgemm_v2", np.float32, a, None),
                           "cublasDgemm_v2": lambda *a: self._gemm("cublasDgemm_v2", np.float64, a, None),
                           "cublasSgemmStridedBatched": lambda *a: self._gemm("cublasSgemmStridedBatched",
                                                                              np.float32, a, True)}
        for name, argtypes in CUBLAS_HEADER_PROTOTYPES.items():
            if name not in missing:
                prototype = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)
                setattr(self, name, prototype(self._guarded(name, implementations[name])))

    def without(self, *names: str) -> "FakeCublasLibrary":
        """The same machine's library lacking `names` (an old or partial libcublas)."""
        return FakeCublasLibrary(self._machine, names)

    def _guarded(self, name, function):
        """Exceptions cannot cross a ctypes callback: turn them into a failure status and record them."""
        def call(*args):
            try:
                self._machine.cublas_calls.append(name)
                return function(*args)
            except Exception as err:         # noqa: BLE001 -- reported through `errors` and the status
                self.errors.append(f"{name}: {type(err).__name__}: {err}")
                return CUBLAS_STATUS_EXECUTION_FAILED
        return call

    def _refuse(self, what: str, status: int = CUBLAS_STATUS_INVALID_VALUE) -> int:
        self.errors.append(what)
        return status

    def _create(self, handle_pointer):
        context = self._machine.current()
        if self._machine.cublas_create_status or context is None:
            return self._refuse("cublasCreate_v2: no usable context", self._machine.cublas_create_status or
                                CUBLAS_STATUS_NOT_INITIALIZED)
        handle = next(self._next)
        self._handles[handle] = [context, None]
        handle_pointer[0] = handle
        return CUBLAS_STATUS_SUCCESS

    def _destroy(self, handle):
        if self._handles.pop(handle or 0, None) is None:
            return self._refuse("cublasDestroy_v2: unknown handle", CUBLAS_STATUS_NOT_INITIALIZED)
        return CUBLAS_STATUS_SUCCESS

    def _set_stream(self, handle, stream_handle):
        entry = self._handles.get(handle or 0)
        if entry is None:
            return self._refuse("cublasSetStream_v2: unknown handle", CUBLAS_STATUS_NOT_INITIALIZED)
        if not stream_handle:
            entry[1] = None
            return CUBLAS_STATUS_SUCCESS
        stream = self._machine._streams.get(stream_handle)
        if stream is None or stream._state is not entry[0]:
            return self._refuse(f"cublasSetStream_v2: {stream_handle:#x} is not a stream of the handle's context")
        entry[1] = stream
        return CUBLAS_STATUS_SUCCESS

    def _gemm(self, name, dtype, args, batched):
        if batched:
            (handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c,
             batch) = args
        else:
            handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc = args
            stride_a = stride_b = stride_c = 0
            batch = 1
        entry = self._handles.get(handle or 0)
        if entry is None:
            return self._refuse(f"{name}: unknown handle", CUBLAS_STATUS_NOT_INITIALIZED)
        context, stream = entry
        # cuBLAS's own argument checks (column-major): CUBLAS_STATUS_INVALID_VALUE
        if transa not in (0, 1, 2) or transb not in (0, 1, 2) or min(m, n, k, batch) < 0 or \
                lda < max(1, k if transa else m) or ldb < max(1, n if transb else k) or ldc < max(1, m):
            return self._refuse(f"{name}: invalid arguments transa={transa} transb={transb} m={m} n={n} k={k} "
                                f"lda={lda} ldb={ldb} ldc={ldc} batch={batch}")
        alpha, beta = float(alpha[0]), float(beta[0])
        a, b, c = a or 0, b or 0, c or 0
        if m == 0 or n == 0 or batch == 0:
            return CUBLAS_STATUS_SUCCESS
        size = np.dtype(dtype).itemsize

        def span(address, rows, cols, ld, i, stride):
            start = address + i * stride * size
            return start, start + size * ((cols - 1) * ld + rows)

        a_shape = (k, m) if transa else (m, k)
        b_shape = (n, k) if transb else (k, n)
        reads = []
        for i in range(batch):
            if k and alpha != 0:
                reads += [span(a, *a_shape, lda, i, stride_a), span(b, *b_shape, ldb, i, stride_b)]
        writes = [span(c, m, n, ldc, i, stride_c) for i in range(batch)]
        for start, end in reads + writes:
            self._machine.check_device_range(start, end - start, name, context)
        if batched:
            cuda_emulator._disjoint(writes, reads, name)       # the products of a batch run concurrently

        def run():
            for i in range(batch):
                out = _strided(c + i * stride_c * size, (m, n), (1, ldc), dtype)
                if k and alpha != 0:
                    op_a = _strided(a + i * stride_a * size, (m, k), (lda, 1) if transa else (1, lda), dtype)
                    op_b = _strided(b + i * stride_b * size, (k, n), (ldb, 1) if transb else (1, ldb), dtype)
                    product = dtype(alpha) * (op_a @ op_b)
                else:
                    product = np.zeros((m, n), dtype)
                out[...] = product if beta == 0 else product + dtype(beta) * out

        previous = self._machine.current()
        if previous is not context:
            return self._refuse(f"{name}: the handle's context is not current", CUBLAS_STATUS_EXECUTION_FAILED)
        self._machine.enqueue(stream, run, name)
        return CUBLAS_STATUS_SUCCESS


# ----------------------------------------------------------------------------------------------------------------
# installing

def _module(name: str, is_package: bool = False, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    module.__file__ = str(_PACKAGE_DIR / (name.replace(".", "/") + ".py"))
    if is_package:
        module.__path__ = []
    module.__dict__.update(attributes)
    return module


_DRIVER_NAMES = [
    "init", "get_version", "get_driver_version", "event_flags", "host_alloc_flags", "Device", "Context",
    "DeviceAllocation", "Stream", "Event", "Module", "Function", "mem_alloc", "mem_get_info", "pagelocked_empty",
    "pagelocked_zeros", "pagelocked_empty_like", "pagelocked_zeros_like", "memcpy_htod", "memcpy_htod_async",
    "memcpy_dtoh", "memcpy_dtoh_async", "memcpy_dtod", "memcpy_dtod_async", "memcpy_peer", "memcpy_peer_async",
    "module_from_buffer", "Error", "LogicError", "LaunchError", "CompileError",
]


def install(monkeypatch, **config) -> FakeCuda:
    """Install the fake `pycuda`, `pycuda.driver` and `pycuda.compiler` in `sys.modules` for one test (undone
    by `monkeypatch`) and return the machine behind them (`FakeCuda(**config)`)."""
    machine = FakeCuda(**config)
    monkeypatch.setattr(sys.modules[__name__], "_machine", machine)
    this = sys.modules[__name__]
    driver = _module("pycuda.driver", **{name: getattr(this, name) for name in _DRIVER_NAMES},
                     MemoryError=CudaMemoryError, RuntimeError=CudaRuntimeError)
    compiler = _module("pycuda.compiler", compile=compile, CudaModule=CudaModule, SourceModule=SourceModule,
                       DEFAULT_NVCC_FLAGS=[])
    package = _module("pycuda", is_package=True, VERSION=PYCUDA_VERSION,
                      VERSION_TEXT=".".join(map(str, PYCUDA_VERSION)), driver=driver, compiler=compiler)
    for name, module in (("pycuda", package), ("pycuda.driver", driver), ("pycuda.compiler", compiler)):
        monkeypatch.setitem(sys.modules, name, module)
    return machine


def cublas_class(library):
    """A `deepdsl_runtime.cuda.driver.Cublas` that loads `library` (a `FakeCublasLibrary`) instead of searching the
    system for libcublas."""
    from deepdsl_runtime.cuda import driver as cuda_device

    real = getattr(cuda_device.Cublas, "real", cuda_device.Cublas)     # under --fake-gpu it is already offered

    class OfferedCublas(real):
        def __init__(self, path=None):
            super().__init__(path, library=library)

    OfferedCublas.real = real
    return OfferedCublas


FATBINS = cuda_emulator.CACHE / "fatbins"     # sha256 of a fat binary nvcc built -> the path of its .cu


def _built_fatbin(image: bytes):
    """("fatbin", source) of a fat binary `deepdsl.codegen.cuda.build_fatbin` built while the fake was installed
    for the process (in this process or another), from the record it left; None for other bytes."""
    record = FATBINS / hashlib.sha256(image).hexdigest()
    if not record.exists():
        return None
    cu = Path(record.read_text())
    return ("fatbin", cu.read_text()) if cu.exists() else None


def _recording_build_fatbin(build):
    """`build_fatbin` that also records each fat binary it returns, so `module_from_buffer` loads it as the module
    of its `.cu` source (the driver would load the real image)."""
    def build_and_record(cu, nvcc=None):
        fatbin = build(cu, nvcc)
        if fatbin is not None:
            FATBINS.mkdir(parents=True, exist_ok=True)
            record = FATBINS / hashlib.sha256(fatbin.read_bytes()).hexdigest()
            record.write_text(str(Path(cu).resolve()))
        return fatbin
    return build_and_record


def install_for_process(**config) -> FakeCuda:
    """Install the fake pycuda, and its cuBLAS as the library `deepdsl_runtime` loads, for the rest of this
    process: what `pytest --fake-gpu` does in the test process, and `tests/support/fake_gpu_site/sitecustomize.py` in the
    processes it starts (generated programs, benchmark workers), so the GPU tests run end to end on the host."""
    import pytest

    from deepdsl_runtime.cuda import driver as cuda_device

    patch = pytest.MonkeyPatch()          # never undone: the process stays on the fake
    machine = install(patch, **config)
    patch.setattr(cuda_device, "Cublas", cublas_class(machine.cublas_library))
    patch.setattr(cuda_device, "_driver", None)
    from deepdsl.codegen import cuda as codegen_cuda

    patch.setattr(codegen_cuda, "build_fatbin", _recording_build_fatbin(codegen_cuda.build_fatbin))
    return machine
