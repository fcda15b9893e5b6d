"""Device arrays of the CUDA backend over an abstract device: the `Device` the ops need, `DeviceArray` (which
knows its device: an op runs on the device of its output), host <-> device copies and kernel launches. There is
no current device: arrays are made on a device given by name (`asarray(..., device=)`, `zeros(..., device=)`, an
allocator's), and everything else follows from them."""
from __future__ import annotations

import builtins
import math
from typing import Protocol

import numpy as np

from deepdsl_runtime.cuda import layout as L
from deepdsl_runtime.memory.first_fit import DEFAULT_ALIGNMENT, PoolAllocator, PoolStats


class Device(Protocol):
    """What the ops need from a device. Work is ordered: each call runs after the previous ones (one stream)."""

    def alloc(self, nbytes: int) -> tuple[int, object]:
        """(address, owner): device memory, at least 256-byte aligned, freed when `owner` is dropped."""

    def launch(self, kernel: str, fmt: str, grid: tuple[int, int], block: tuple[int, int, int], args: tuple,
               program=None) -> None:
        """Run generic kernel `kernel` (ops.cu), or with `program` (a generated elementwise kernel function) the
        kernel of that program's module; `fmt` packs `args` (struct module codes, native alignment)."""

    def gemm(self, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float, a: int, lda: int, b: int,
             ldb: int, beta: float, c: int, ldc: int) -> None:
        """Row-major float32 C = alpha op(A) op(B) + beta C."""

    def gemm_batched(self, transa: bool, transb: bool, m: int, n: int, k: int, a: int, lda: int, stride_a: int,
                     b: int, ldb: int, stride_b: int, c: int, ldc: int, stride_c: int, batch: int) -> None:
        """Row-major float32 C_i = op(A_i) op(B_i), operand i at address + 4 * i * stride."""

    def copy(self, dst: int, src: int, nbytes: int) -> None: ...

    def upload(self, dst: int, array: np.ndarray, staged: bool = False) -> None:
        """Host to device; `staged`: a batch (through pinned memory on the copy stream, the compute stream waits)."""

    def download(self, array: np.ndarray, src: int) -> None:
        """Device to host, after all work issued so far."""


class _Address:
    """`array.ctypes.data` for a device array: its address (what the allocators' placement checks read)."""

    __slots__ = ("data",)

    def __init__(self, data: int):
        self.data = data


class DeviceArray:
    """A C-contiguous tensor in device memory: address, shape, dtype, the `device` it is on and the allocation it
    lives in (`owner`, kept alive by every view). Supports the slice of numpy the allocators use: 1-D
    `[start:stop]`, `view(dtype)`, `reshape`, `size`, `nbytes`, `ctypes.data`."""

    __slots__ = ("ptr", "shape", "dtype", "owner", "device")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype, owner=None, device: Device | None = None):
        self.ptr = int(ptr)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.owner = owner
        self.device = device

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ctypes(self) -> _Address:
        return _Address(self.ptr)

    def reshape(self, *shape) -> "DeviceArray":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape a device array of {self.size} elements to {shape}")
        return DeviceArray(self.ptr, shape, self.dtype, self.owner, self.device)

    def view(self, dtype) -> "DeviceArray":
        dtype = np.dtype(dtype)
        if self.ndim != 1 or self.nbytes % dtype.itemsize:
            raise ValueError(f"cannot view {self.nbytes} bytes of shape {self.shape} as {dtype}")
        return DeviceArray(self.ptr, (self.nbytes // dtype.itemsize,), dtype, self.owner, self.device)

    def __getitem__(self, key) -> "DeviceArray":
        if self.ndim != 1 or not isinstance(key, builtins.slice) or key.step not in (None, 1):
            raise TypeError("device arrays support only 1-D [start:stop] slices")
        start, stop, _ = key.indices(self.size)
        stop = max(start, stop)
        return DeviceArray(self.ptr + start * self.itemsize, (stop - start,), self.dtype, self.owner, self.device)

    def get(self) -> np.ndarray:
        return to_numpy(self)

    def __repr__(self) -> str:
        return f"DeviceArray(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype})"


class DevicePool:
    """The runtime's first-fit `PoolAllocator` over one chunk of device memory, handing out `DeviceArray` views the
    way `HostPool` hands out numpy views (BLASX §IV-E): allocating and freeing are bookkeeping only, never a driver
    call. The chunk comes from `alloc(nbytes) -> (address, owner)` (a `Device`'s, or a `CudaContext`'s) and lives
    while the pool or a view of it does; `release()` gives it back at once through `free(owner)`, when given. Its
    arrays are on `device` (the `Device` the ops run them on, when they do)."""

    def __init__(self, capacity: int, alloc, alignment: int = DEFAULT_ALIGNMENT, free=None,
                 device: Device | None = None):
        self.allocator = PoolAllocator(capacity, alignment)
        self.base, self._chunk = alloc(max(self.allocator.capacity, alignment))
        self._release = free
        self.device = device

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def stats(self) -> PoolStats:
        return self.allocator.stats

    def empty(self, shape: tuple[int, ...], dtype) -> DeviceArray:
        dtype = np.dtype(dtype)
        return self.view(self.allocator.alloc(math.prod(shape) * dtype.itemsize), shape, dtype)

    def view(self, offset: int, shape: tuple[int, ...], dtype) -> DeviceArray:
        return DeviceArray(self.base + offset, shape, dtype, self._chunk, self.device)

    def free(self, array_or_offset) -> None:
        """Free an array `empty` made, or the allocation at an offset."""
        offset = array_or_offset.ptr - self.base if isinstance(array_or_offset, DeviceArray) else int(array_or_offset)
        self.allocator.free(offset)

    def release(self) -> None:
        """Give the chunk back now (the pool must not be used afterwards; idempotent)."""
        if self._chunk is not None:
            if self._release is not None:
                self._release(self._chunk)
            self._chunk = None


def device_array(device: Device, nbytes: int, shape, dtype) -> DeviceArray:
    """A new allocation of `nbytes` on `device`, as an array of `shape` and `dtype`."""
    ptr, owner = device.alloc(max(nbytes, 1))
    return DeviceArray(ptr, shape, dtype, owner, device)


def raw_bytes(device: Device, nbytes: int) -> DeviceArray:
    return device_array(device, nbytes, (nbytes,), np.uint8)


def require(array, what: str) -> DeviceArray:
    if not isinstance(array, DeviceArray):
        raise TypeError(f"{what}: expected a device array, got {type(array).__name__}")
    L.check_elements(array.size, what)
    return array


def overlaps(a: DeviceArray, b: DeviceArray) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def asarray(array: np.ndarray, dtype=None, *, device: Device) -> DeviceArray:
    """A device array on `device` holding a copy of a host array (its own allocation: parameters, state)."""
    host = np.ascontiguousarray(array, dtype=dtype or np.asarray(array).dtype)
    out = device_array(device, host.nbytes, host.shape, host.dtype)
    if host.nbytes:
        device.upload(out.ptr, host)
    return out


def to_numpy(buffer) -> np.ndarray:
    if not isinstance(buffer, DeviceArray):
        return np.array(buffer, copy=True)
    host = np.empty(buffer.shape, dtype=buffer.dtype)
    if host.nbytes:
        buffer.device.download(host, buffer.ptr)
    return host


def zeros(shape: tuple[int, ...], dtype: str, *, device: Device) -> DeviceArray:
    dtype = np.dtype(dtype)
    out = device_array(device, math.prod(shape) * dtype.itemsize, shape, dtype)
    fill(out, 0)
    return out


def scalar(buffer) -> float:
    """The Python float of a 0-d value (the loss, the accuracy): waits for the work that computes it."""
    if isinstance(buffer, DeviceArray):
        return float(to_numpy(buffer).reshape(-1)[0])
    return float(buffer)


def launch_items(device: Device, kernel: str, fmt: str, items: int, *args, program=None) -> None:
    """Run `kernel` on `device` over `items` work items (one thread each, `layout.launch_1d`)."""
    config = L.launch_1d(items)
    device.launch(kernel, fmt, config.grid, config.block, args, program)


def fill(out: DeviceArray, value: float) -> None:
    if out.size == 0:
        return
    if out.itemsize == 4:
        bits = int(np.array(value, dtype=out.dtype).view(np.uint32))
        launch_items(out.device, "deepdsl_fill_u32", "IPI", out.size, out.size, out.ptr, bits)
    elif out.itemsize == 1:
        launch_items(out.device, "deepdsl_fill_u8", "IPI", out.size, out.size, out.ptr, int(value))
    else:
        raise TypeError(f"cannot fill a device array of {out.dtype}")


def copy2d(device: Device, rows: int, cols: int, src: int, src_pitch: int, dst: int, dst_pitch: int,
           itemsize: int) -> None:
    """rows x cols elements from src (row pitch in elements) to dst, on `device`."""
    if rows * cols == 0:
        return
    kernel = {4: "deepdsl_copy2d_u32", 1: "deepdsl_copy2d_u8"}.get(itemsize)
    if kernel is None:
        raise TypeError(f"no copy kernel for {itemsize}-byte elements")
    launch_items(device, kernel, "IIPIPI", rows * cols, rows, cols, src, src_pitch, dst, dst_pitch)
