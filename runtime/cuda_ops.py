"""The ops of the CUDA backend over an abstract device: what `deepdsl_runtime.cuda` exports with a GPU behind it.

Same names, signatures and contract as `deepdsl_runtime.cpu` (explicit `out=` buffers, `workspace=` scratch the
compiler sized); tensors are `DeviceArray`s (a device pointer, a shape, a dtype). Every op is a short sequence of
kernel launches, GEMMs and copies on one device object (`Device`, below): `deepdsl_runtime.cuda` installs the
pycuda one; the test suite installs a host emulator that runs the kernels' own per-element code compiled for the
CPU, so everything here -- argument packing, chunking, workspace carving, launch order -- is exercised without a
GPU. Launch geometry and layouts come from `cuda_layout`.

Convolution is im2col + GEMM as on the CPU: a chunk of samples' im2col matrices in the workspace, one strided
batched GEMM (cuBLAS) with the filter matrix straight into the output; the filter gradient regroups the output
gradient by channel and makes one GEMM per chunk, accumulating over chunks in the GEMM itself (beta = 1); the input
gradient is a batched GEMM then col2im gathering per input element (no atomics: deterministic). The device needs no
more scratch per sample than the CPU kernels, so the workspace the plan gives is enough, often for larger chunks.
"""
from __future__ import annotations

import builtins
import math
from typing import Protocol

import numpy as np

from . import contract, memory
from . import cuda_layout as L
from .contract import out_size
from .cuda_layout import EW_F32, EW_U8, EW_VALUE

__all__ = [
    "DEVICE", "DeviceArray", "Device", "allocator", "asarray", "avg_pool", "avg_pool_bwd", "bernoulli",
    "bernoulli_mask", "broadcast_to", "concat", "const", "conv2d", "conv2d_bwd_data", "conv2d_bwd_filter", "copy",
    "ew", "log_softmax", "lrn", "lrn_bwd", "matmul", "max_pool", "max_pool_argmax", "max_pool_bwd", "out_size",
    "pad_axis", "pick", "precision", "reshape", "scalar", "slice", "softmax", "sum_to", "to_numpy", "unpick",
    "use_device", "current_device", "zeros",
]

DEVICE = "cuda"


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


_active: list[Device] = []


def use_device(device: Device | None) -> None:
    """Make `device` the one the ops run on (None: back to the default)."""
    _active.clear()
    if device is not None:
        _active.append(device)


def current_device() -> Device:
    if not _active:
        raise RuntimeError("no CUDA device is in use (import deepdsl_runtime.cuda)")
    return _active[0]


# ----------------------------------------------------------------------------------------------------------------
# device arrays

class _Address:
    """`array.ctypes.data` for a device array: its address (what the allocators' placement checks read)."""

    __slots__ = ("data",)

    def __init__(self, data: int):
        self.data = data


class DeviceArray:
    """A C-contiguous tensor in device memory: address, shape, dtype, and the allocation it lives in (`owner`, kept
    alive by every view). Supports the slice of numpy the allocators use: 1-D `[start:stop]`, `view(dtype)`,
    `reshape`, `size`, `nbytes`, `ctypes.data`."""

    __slots__ = ("ptr", "shape", "dtype", "owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype, owner=None):
        self.ptr = int(ptr)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.owner = owner

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
        return DeviceArray(self.ptr, shape, self.dtype, self.owner)

    def view(self, dtype) -> "DeviceArray":
        dtype = np.dtype(dtype)
        if self.ndim != 1 or self.nbytes % dtype.itemsize:
            raise ValueError(f"cannot view {self.nbytes} bytes of shape {self.shape} as {dtype}")
        return DeviceArray(self.ptr, (self.nbytes // dtype.itemsize,), dtype, self.owner)

    def __getitem__(self, key) -> "DeviceArray":
        if self.ndim != 1 or not isinstance(key, builtins.slice) or key.step not in (None, 1):
            raise TypeError("device arrays support only 1-D [start:stop] slices")
        start, stop, _ = key.indices(self.size)
        stop = max(start, stop)
        return DeviceArray(self.ptr + start * self.itemsize, (stop - start,), self.dtype, self.owner)

    def get(self) -> np.ndarray:
        return to_numpy(self)

    def __repr__(self) -> str:
        return f"DeviceArray(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype})"


def _device_array(nbytes: int, shape, dtype) -> DeviceArray:
    ptr, owner = current_device().alloc(max(nbytes, 1))
    return DeviceArray(ptr, shape, dtype, owner)


def _raw_bytes(nbytes: int) -> DeviceArray:
    return _device_array(nbytes, (nbytes,), np.uint8)


def _require(array, what: str) -> DeviceArray:
    if not isinstance(array, DeviceArray):
        raise TypeError(f"{what}: expected a device array, got {type(array).__name__}")
    L.check_elements(array.size, what)
    return array


def _overlap(a: DeviceArray, b: DeviceArray) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


# ----------------------------------------------------------------------------------------------------------------
# host <-> device

def asarray(array: np.ndarray, dtype=None) -> DeviceArray:
    """A device array holding a copy of a host array (its own allocation: parameters, state)."""
    host = np.ascontiguousarray(array, dtype=dtype or np.asarray(array).dtype)
    out = _device_array(host.nbytes, host.shape, host.dtype)
    if host.nbytes:
        current_device().upload(out.ptr, host)
    return out


def to_numpy(buffer) -> np.ndarray:
    if not isinstance(buffer, DeviceArray):
        return np.array(buffer, copy=True)
    host = np.empty(buffer.shape, dtype=buffer.dtype)
    if host.nbytes:
        current_device().download(host, buffer.ptr)
    return host


def zeros(shape: tuple[int, ...], dtype: str) -> DeviceArray:
    dtype = np.dtype(dtype)
    out = _device_array(math.prod(shape) * dtype.itemsize, shape, dtype)
    _fill(out, 0)
    return out


def scalar(buffer) -> float:
    """The Python float of a 0-d value (the loss, the accuracy): waits for the work that computes it."""
    if isinstance(buffer, DeviceArray):
        return float(to_numpy(buffer).reshape(-1)[0])
    return float(buffer)


# ----------------------------------------------------------------------------------------------------------------
# launching

def _launch(kernel: str, fmt: str, items: int, *args, program=None) -> None:
    config = L.launch_1d(items)
    current_device().launch(kernel, fmt, config.grid, config.block, args, program)


def _fill(out: DeviceArray, value: float) -> None:
    if out.size == 0:
        return
    if out.itemsize == 4:
        bits = int(np.array(value, dtype=out.dtype).view(np.uint32))
        _launch("deepdsl_fill_u32", "IPI", out.size, out.size, out.ptr, bits)
    elif out.itemsize == 1:
        _launch("deepdsl_fill_u8", "IPI", out.size, out.size, out.ptr, int(value))
    else:
        raise TypeError(f"cannot fill a device array of {out.dtype}")


def _copy2d(rows: int, cols: int, src: int, src_pitch: int, dst: int, dst_pitch: int, itemsize: int) -> None:
    """rows x cols elements from src (row pitch in elements) to dst."""
    if rows * cols == 0:
        return
    kernel = {4: "deepdsl_copy2d_u32", 1: "deepdsl_copy2d_u8"}.get(itemsize)
    if kernel is None:
        raise TypeError(f"no copy kernel for {itemsize}-byte elements")
    _launch(kernel, "IIPIPI", rows * cols, rows, cols, src, src_pitch, dst, dst_pitch)


# ----------------------------------------------------------------------------------------------------------------
# elementwise

_EW_ARG = "PfiIIII"


def _ew_args(layout: L.EwLayout, args) -> list:
    packed = []
    for k, a in enumerate(args):
        strides = layout.strides[k]
        if isinstance(a, DeviceArray):
            if a.dtype == np.float32:
                kind = EW_F32
            elif a.dtype == np.uint8:
                kind = EW_U8
            else:
                raise TypeError(f"elementwise input {k} is a {a.dtype} device array (float32 or uint8 expected)")
            packed += [a.ptr, 0.0, kind, *strides]
        else:
            packed += [0, float(np.float32(a)), EW_VALUE, *strides]
    return packed


def _layout(out: DeviceArray, args) -> L.EwLayout:
    return _layout_cached(out.shape, tuple(a.shape if isinstance(a, DeviceArray) else None for a in args))


_layouts: dict = {}


def _layout_cached(out_shape, shapes) -> L.EwLayout:
    key = (out_shape, shapes)
    layout = _layouts.get(key)
    if layout is None:
        layout = _layouts[key] = L.ew_layout(out_shape, list(shapes))
    return layout


def ew(kernel, out: DeviceArray, *args) -> None:
    """Run generated elementwise kernel `kernel` (the program's function of that name: the device runs the CUDA
    kernel of the same name from the program's `.cu`), numpy broadcasting over `args`: device arrays (float32,
    uint8) or host scalars. `out` may be one of the args (in place)."""
    _require(out, "elementwise output")
    if out.dtype != np.float32:
        raise TypeError(f"elementwise output of dtype {out.dtype}")
    layout = _layout(out, args)
    name = kernel if isinstance(kernel, str) else kernel.__name__
    d = layout.dims
    config = L.launch_1d(layout.size)
    current_device().launch(L.ew_entry(name, layout.nd), "IIIIP" + _EW_ARG * len(args), config.grid, config.block,
                            (layout.size, d[1], d[2], d[3], out.ptr, *_ew_args(layout, args)), kernel)


def broadcast_to(x, *, out, shape):
    _require(out, "broadcast_to output")
    if out.dtype != np.float32:
        raise TypeError(f"broadcast_to of dtype {out.dtype}")
    layout = _layout(out, (x,))
    d = layout.dims
    _launch(f"deepdsl_broadcast_{layout.nd}", "IIIIP" + _EW_ARG, layout.size, layout.size, d[1], d[2], d[3],
            out.ptr, *_ew_args(layout, (x,)))


def sum_to(x, *, out, shape):
    """Sum x down to `shape` (the inverse of broadcasting): a column sum, a middle-axis sum or the generic one."""
    _require(x, "sum_to input")
    plan = L.sum_plan(x.shape, tuple(shape))
    device = current_device()
    if plan.kind == "copy":
        copy(x, out=out)
    elif plan.kind == "rows":
        device.launch("deepdsl_sum_rows", "IIPP", (-(-plan.b // 32), 1), (32, 8, 1), (plan.a, plan.b, x.ptr, out.ptr))
    elif plan.kind == "middle":
        device.launch("deepdsl_sum_middle", "IIIPP", (plan.b, 1), (L.THREADS, 1, 1),
                      (plan.a, plan.b, plan.c, x.ptr, out.ptr))
    else:
        _launch("deepdsl_sum_generic", "IIIIIIIPP", out.size, out.size, *plan.dims, plan.reduced, plan.count, x.ptr,
                out.ptr)


def reshape(x, *, shape):
    """A view with another shape (no copy)."""
    return x.reshape(shape)


def copy(src, *, out):
    if src.nbytes != out.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {out.nbytes}")
    if out.nbytes and src.ptr != out.ptr:
        current_device().copy(out.ptr, src.ptr, out.nbytes)


def const(*, out, value, shape=()):
    _fill(out, value)


# ----------------------------------------------------------------------------------------------------------------
# shapes

def _split(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    return math.prod(shape[:axis]), math.prod(shape[axis + 1:])


def concat(*xs, out, axis):
    outer, inner = _split(out.shape, axis)
    total, start = out.shape[axis], 0
    for x in xs:
        a = x.shape[axis]
        _copy2d(outer, a * inner, x.ptr, a * inner, out.ptr + start * inner * out.itemsize, total * inner,
                out.itemsize)
        start += a


def slice(x, *, out, axis, start, stop):  # noqa: A001 -- the IR op's name
    outer, inner = _split(x.shape, axis)
    _copy2d(outer, (stop - start) * inner, x.ptr + start * inner * x.itemsize, x.shape[axis] * inner, out.ptr,
            (stop - start) * inner, x.itemsize)


def pad_axis(x, *, out, axis, start, size):
    _fill(out, 0)
    outer, inner = _split(x.shape, axis)
    a = x.shape[axis]
    _copy2d(outer, a * inner, x.ptr, a * inner, out.ptr + start * inner * out.itemsize, size * inner, out.itemsize)


# ----------------------------------------------------------------------------------------------------------------
# matrix products and convolution

def matmul(a, b, *, out, ta=False, tb=False):
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    current_device().gemm(bool(ta), bool(tb), m, n, k, 1.0, a.ptr, a.shape[1], b.ptr, b.shape[1], 0.0, out.ptr, n)


def _conv_geom(c, h, w, kh, kw, ho, wo, stride, pad) -> tuple[int, ...]:
    return (c, h, w, kh, kw, ho, wo, stride, pad)


_CONV = "I" * 9


def _floats(workspace) -> int | None:
    return None if workspace is None else workspace.nbytes // 4


def _scratch(workspace, floats: int) -> DeviceArray:
    """The first `floats` float32 of the workspace (or a temporary when none was given, as on the CPU)."""
    if workspace is None:
        return _device_array(floats * 4, (floats,), np.float32)
    return workspace.view(np.float32)[:floats] if workspace.dtype != np.float32 else workspace[:floats]


def _over_input(what: str, samples: int, in_floats: int, out_floats: int, in_ptr: int, out_ptr: int, workspace,
                run) -> None:
    """Run a per-sample op whose output starts where its input starts (the memory plan's takeover) in the CPU
    backend's safe chunk order (`cuda_layout.safe_sample_chunks`): `run(first, count, source_ptr, target_ptr)`
    computes samples [first, first + count) with both pointers at sample `first`, on memory that no unread sample
    shares. A sample with no safe chunk goes through one sample of staging at the end of the workspace, which the
    plan adds for that: the output lands there first when the op shrinks, the input is copied there first when it
    grows."""
    device = current_device()
    staged = min(in_floats, out_floats)
    floats = _floats(workspace) or 0
    if floats < staged:
        raise ValueError(f"{what} over its input: the workspace ({floats} floats) cannot stage a sample ({staged})")
    stage = (workspace.view(np.float32) if workspace.dtype != np.float32 else workspace)[floats - staged:floats]
    for s, e, through_stage in L.safe_sample_chunks(samples, in_floats * 4, out_floats * 4):
        source, target = in_ptr + s * in_floats * 4, out_ptr + s * out_floats * 4
        if not through_stage:
            run(s, e - s, source, target)
        elif out_floats <= in_floats:
            run(s, 1, source, stage.ptr)
            device.copy(target, stage.ptr, out_floats * 4)
        else:
            device.copy(stage.ptr, source, in_floats * 4)
            run(s, 1, stage.ptr, target)


def _im2col(x_ptr: int, geom, samples: int, sample_stride: int, row_stride: int, cols_ptr: int) -> None:
    c, _, _, kh, kw, ho, wo, _, _ = geom
    count = samples * c * kh * kw * ho * wo
    _launch("deepdsl_im2col", "I" + _CONV + "IIPP", count, count, *geom, sample_stride, row_stride, x_ptr, cols_ptr)


def conv2d(x, w, b=None, *, out, stride=1, pad=0, workspace=None):
    """out = x (*) w + b: x (N,C,H,W), w (O,C,kh,kw), b (O,), out (N,O,Ho,Wo). Workspace per sample: the im2col
    matrix (C*kh*kw, Ho*Wo); none for 1x1 stride-1 convolutions (one batched GEMM on the input)."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho, wo = out.shape[2:]
    hw, ckk = ho * wo, c * kh * kw
    device = current_device()
    if contract.pointwise_conv(kh, kw, stride, pad):
        device.gemm_batched(False, False, o, hw, c, w.ptr, c, 0, x.ptr, hw, c * hw, out.ptr, hw, o * hw, n)
    else:
        geom = _conv_geom(c, h, wd, kh, kw, ho, wo, stride, pad)
        step = L.conv_samples(n, _floats(workspace), ckk * hw)
        cols = _scratch(workspace, step * ckk * hw)
        for s in range(0, n, step):
            m = min(n, s + step) - s
            _im2col(x.ptr + s * c * h * wd * 4, geom, m, ckk * hw, hw, cols.ptr)
            device.gemm_batched(False, False, o, hw, ckk, w.ptr, ckk, 0, cols.ptr, hw, ckk * hw,
                                out.ptr + s * o * hw * 4, hw, o * hw, m)
    if b is not None:
        _launch("deepdsl_add_bias", "IIIPP", out.size, out.size, o, hw, b.ptr, out.ptr)


def conv2d_bwd_data(g, w, *, out, stride, pad, size, workspace=None):
    """Gradient of conv2d with respect to its input: col2im(W^T G). Workspace per sample: the column gradients
    (C*kh*kw, Ho*Wo); none for 1x1 stride-1 (one batched GEMM).

    The memory plan may let `out` take over the bytes of `g` from the same start. Chunks then run forward when the
    gradient shrinks and backward when it grows: a chunk's GEMM reads all its samples of `g` before col2im writes
    them, and col2im's writes reach only samples already read. 1x1 stride-1 products read `g` and write `out`
    directly: they run in the CPU backend's safe chunk order, one sample staged through the end of the workspace."""
    n, o, ho, wo = g.shape
    _, c, kh, kw = w.shape
    h, wd = size
    hw, ckk = ho * wo, c * kh * kw
    device = current_device()
    overlap = _overlap(out, g)
    if overlap and out.ptr != g.ptr:
        raise ValueError("conv2d_bwd_data: an output overlapping its input must start where the input starts")
    if contract.pointwise_conv(kh, kw, stride, pad):
        if not overlap:
            device.gemm_batched(True, False, c, hw, o, w.ptr, c, 0, g.ptr, hw, o * hw, out.ptr, hw, c * hw, n)
            return
        per_in, per_out = o * hw, c * hw
        _over_input("conv2d_bwd_data", n, per_in, per_out, g.ptr, out.ptr, workspace,
                    lambda s, count, source, target: device.gemm_batched(
                        True, False, c, hw, o, w.ptr, c, 0, source, hw, per_in, target, hw, per_out, count))
        return
    geom = _conv_geom(c, h, wd, kh, kw, ho, wo, stride, pad)
    step = L.conv_samples(n, _floats(workspace), ckk * hw)
    dcols = _scratch(workspace, step * ckk * hw)
    starts = range(0, n, step)
    if overlap and c * h * wd > o * hw:
        starts = reversed(starts)                   # a growing gradient: the last samples first
    for s in starts:
        m = min(n, s + step) - s
        device.gemm_batched(True, False, ckk, hw, o, w.ptr, ckk, 0, g.ptr + s * o * hw * 4, hw, o * hw, dcols.ptr,
                            hw, ckk * hw, m)
        count = m * c * h * wd
        _launch("deepdsl_col2im", "I" + _CONV + "PP", count, count, *geom, dcols.ptr, out.ptr + s * c * h * wd * 4)


def conv2d_bwd_filter(g, x, *, out, stride, pad, kernel, workspace=None):
    """Gradient of conv2d with respect to its weights: G im2col(X)^T, one GEMM per chunk of samples over the chunk's
    im2col matrix laid out (C*kh*kw, samples*Ho*Wo) and its gradient regrouped to (O, samples*Ho*Wo); chunks after
    the first accumulate in the GEMM (beta = 1). Workspace per sample: (C*kh*kw + O) * Ho*Wo."""
    n, o, ho, wo = g.shape
    c, h, wd = x.shape[1:]
    kh, kw = kernel
    hw, ckk = ho * wo, c * kh * kw
    device = current_device()
    geom = _conv_geom(c, h, wd, kh, kw, ho, wo, stride, pad)
    step = L.conv_samples(n, _floats(workspace), (ckk + o) * hw)
    scratch = _scratch(workspace, step * (ckk + o) * hw)
    for s in range(0, n, step):
        m = min(n, s + step) - s
        cols = scratch.ptr
        regrouped = scratch.ptr + m * ckk * hw * 4
        _im2col(x.ptr + s * c * h * wd * 4, geom, m, hw, m * hw, cols)
        count = m * o * hw
        _launch("deepdsl_swap01", "IIIPP", count, m, o, hw, g.ptr + s * o * hw * 4, regrouped)
        device.gemm(False, True, o, ckk, m * hw, 1.0, regrouped, m * hw, cols, m * hw, 0.0 if s == 0 else 1.0,
                    out.ptr, ckk)


# ----------------------------------------------------------------------------------------------------------------
# pooling

_POOL = "I" * 8


def _pool_geom(planes, h, w, ho, wo, kernel, stride, pad) -> tuple[int, ...]:
    return (planes, h, w, ho, wo, kernel, stride, pad)


def _pool(kind: str, source: DeviceArray, others: tuple, out: DeviceArray, geom, extra: tuple, samples: int,
          backward: bool, workspace, leaves_input: bool) -> None:
    """Run pooling kernel `kind` (deepdsl_<kind>_range / _ordered) over `out`, reading `source` (the input, or the
    output gradient) and `others` (the argmax). When the memory plan has `out` overlap `source` (from the same
    start): where windows leave the input, the samples run in the safe chunk order of `_over_input`; otherwise all
    at once in race-free waves (cuda_layout.takeover_waves)."""
    device = current_device()
    fmt = _POOL + "i" * len(extra) + "P" * (2 + len(others)) + "II"
    per_source, per_out = source.size // samples, out.size // samples
    per_others = tuple(a.size // samples for a in others)

    def run(first, count, source_ptr, out_ptr, waves=None):
        """Samples [first, first + count) from `source_ptr` into `out_ptr` (each pointing at sample `first`)."""
        args = (geom[0] // samples * count, *geom[1:], *extra, source_ptr,
                *(a.ptr + first * per * a.itemsize for a, per in zip(others, per_others)), out_ptr)
        for wave in waves or [L.Wave(False, 0, count * per_out)]:
            if wave.end <= wave.begin:
                continue
            if wave.ordered:
                device.launch(f"deepdsl_{kind}_ordered", fmt, (1, 1), (L.ORDERED_THREADS, 1, 1),
                              (*args, wave.begin, wave.end))
            else:
                config = L.launch_1d(wave.end - wave.begin)
                device.launch(f"deepdsl_{kind}_range", fmt, config.grid, config.block, (*args, wave.begin, wave.end))

    if not _overlap(out, source):
        run(0, samples, source.ptr, out.ptr)
        return
    if out.ptr != source.ptr:
        raise ValueError(f"{kind}: an output overlapping its input must start where the input starts")
    if not leaves_input:
        run(0, samples, source.ptr, out.ptr,
            L.takeover_waves(samples, per_source, per_out, source.ptr, out.ptr, 4, backward))
        return
    _over_input(kind, samples, per_source, per_out, source.ptr, out.ptr, workspace, run)


def max_pool(x, *, out, kernel, stride, pad=0, ceil=False, argmax=None, workspace=None):
    """Maximum of each window; with `argmax`, also `max_pool_argmax` of the same windows (first, as `out` may
    take over the bytes of `x`)."""
    if argmax is not None:
        max_pool_argmax(x, out=argmax, kernel=kernel, stride=stride, pad=pad, ceil=ceil)
    n, c, h, w = x.shape
    ho, wo = out.shape[2:]
    geom = _pool_geom(n * c, h, w, ho, wo, kernel, stride, pad)
    _pool("max_pool", x, (), out, geom, (), n, False, workspace,
          L.windows_leave_input(h, w, ho, wo, kernel, stride, pad))


def max_pool_argmax(x, *, out, kernel, stride, pad=0, ceil=False, workspace=None):
    """Index (row * kernel + column) of the first maximum of each window, as uint8."""
    n, c, h, w = x.shape
    ho, wo = out.shape[2:]
    geom = _pool_geom(n * c, h, w, ho, wo, kernel, stride, pad)
    _launch("deepdsl_max_pool_argmax", _POOL + "PPI", out.size, *geom, x.ptr, out.ptr, out.size)


def max_pool_bwd(g, argmax, *, out, kernel, stride, pad=0, ceil=False, size, workspace=None):
    """Each input position adds the gradients of the windows whose argmax it is (gathered: no atomics)."""
    n, c, ho, wo = g.shape
    h, w = size
    geom = _pool_geom(n * c, h, w, ho, wo, kernel, stride, pad)
    _pool("max_pool_bwd", g, (argmax,), out, geom, (), n, True, workspace,
          L.windows_leave_input(h, w, ho, wo, kernel, stride, pad))


def avg_pool(x, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, workspace=None):
    n, c, h, w = x.shape
    ho, wo = out.shape[2:]
    geom = _pool_geom(n * c, h, w, ho, wo, kernel, stride, pad)
    _pool("avg_pool", x, (), out, geom, (int(bool(include_pad)),), n, False, workspace,
          L.windows_leave_input(h, w, ho, wo, kernel, stride, pad))


def avg_pool_bwd(g, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, size, workspace=None):
    n, c, ho, wo = g.shape
    h, w = size
    geom = _pool_geom(n * c, h, w, ho, wo, kernel, stride, pad)
    _pool("avg_pool_bwd", g, (), out, geom, (int(bool(include_pad)),), n, True, workspace,
          L.windows_leave_input(h, w, ho, wo, kernel, stride, pad))


# ----------------------------------------------------------------------------------------------------------------
# normalization

LRN_MAX_SIZE = 16     # DEEPDSL_LRN_MAX_SIZE


def _lrn_columns(x: DeviceArray, size: int) -> tuple[int, int, int]:
    if not 1 <= size <= LRN_MAX_SIZE:
        raise ValueError(f"LRN window of {size} channels (the CUDA kernel takes 1 to {LRN_MAX_SIZE})")
    spatial = math.prod(x.shape[2:])
    return x.shape[0] * spatial, x.shape[1], spatial


def lrn(x, *, out, size, alpha, beta, k, workspace=None):
    columns, channels, spatial = _lrn_columns(x, size)
    f = np.float32
    _launch("deepdsl_lrn", "IIIifffPP", columns, columns, channels, spatial, size, f(alpha / size), f(k), f(-beta),
            x.ptr, out.ptr)


def lrn_bwd(g, x, *, out, size, alpha, beta, k, workspace=None):
    columns, channels, spatial = _lrn_columns(x, size)
    f = np.float32
    _launch("deepdsl_lrn_bwd", "IIIifffffPPP", columns, columns, channels, spatial, size, f(alpha / size), f(k),
            f(-beta), f(-beta - 1), f(2 * alpha * beta / size), g.ptr, x.ptr, out.ptr)


# ----------------------------------------------------------------------------------------------------------------
# losses

def softmax(x, *, out):
    rows, classes = x.shape
    _launch("deepdsl_softmax", "IIPPi", rows, rows, classes, x.ptr, out.ptr, 0)


def log_softmax(x, *, out, workspace=None):
    rows, classes = x.shape
    _launch("deepdsl_softmax", "IIPPi", rows, rows, classes, x.ptr, out.ptr, 1)


def pick(x, labels, *, out):
    """out[i] = x[i, labels[i]] (NaN for a label out of range)."""
    rows, classes = x.shape
    _launch("deepdsl_pick", "IIPPP", rows, rows, classes, x.ptr, _labels(labels).ptr, out.ptr)


def unpick(g, labels, *, out, classes):
    _launch("deepdsl_unpick", "IIPPP", out.size, out.size, classes, g.ptr, _labels(labels).ptr, out.ptr)


def precision(x, labels, *, out):
    """Fraction of rows whose first largest score is at the label."""
    rows, classes = x.shape
    current_device().launch("deepdsl_precision", "IIPPP", (1, 1), (L.THREADS, 1, 1),
                            (rows, classes, x.ptr, _labels(labels).ptr, out.ptr))


def _labels(labels) -> DeviceArray:
    if not isinstance(labels, DeviceArray) or labels.dtype != np.int32:
        raise TypeError("labels must be an int32 device array")
    return labels


# ----------------------------------------------------------------------------------------------------------------
# random masks

def bernoulli_mask(seed: int, step: int, key: int, shape, keep: float) -> np.ndarray:
    """The mask the compiler's reference semantics draw (deepdsl.ops.norm.bernoulli_mask), on the host."""
    rng = contract.mask_generator(seed, step, key)
    return (rng.random(shape, dtype=np.float32) < keep).astype(np.uint8)


def bernoulli(*, out, shape, keep, key, seed, step, workspace=None):
    """out = 1 with probability `keep`: the same counter-based stream as the CPU backend (Philox4x64-10 keyed by
    (seed, `contract.counter_key(step, key)`)), so the mask equals the CPU's bit for bit; each thread makes 8
    bytes."""
    n = out.size
    groups = -(-n // 8)
    _launch("deepdsl_bernoulli", "IIQQfP", groups, groups, n, int(seed), contract.counter_key(step, key),
            np.float32(keep), out.ptr)


# ----------------------------------------------------------------------------------------------------------------
# memory: the allocators of deepdsl_runtime.memory with device bytes

class _DevicePool:
    """The runtime's first-fit pool over one device chunk, answering what `memory.Pooled` asks of `HostPool`."""

    def __init__(self, capacity: int):
        from .pool import PoolAllocator

        self.allocator = PoolAllocator(capacity, memory.ALIGNMENT)
        self.chunk = _raw_bytes(max(self.allocator.capacity, memory.ALIGNMENT))

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def view(self, offset: int, shape: tuple[int, ...], dtype) -> DeviceArray:
        dtype = np.dtype(dtype)
        return DeviceArray(self.chunk.ptr + offset, shape, dtype, self.chunk.owner)


class _OnDevice:
    """Mixin: the allocator's bytes are device memory, batches are uploaded (staged through pinned memory)."""

    def _bytes(self, nbytes: int) -> DeviceArray:
        return _raw_bytes(nbytes)

    def _copy_in(self, buffer: DeviceArray, array: np.ndarray) -> None:
        host = np.ascontiguousarray(array, dtype=buffer.dtype)
        if host.shape != buffer.shape:
            raise ValueError(f"batch of shape {host.shape} for a buffer of shape {buffer.shape}")
        if host.nbytes:
            current_device().upload(buffer.ptr, host, staged=True)

    def _make_pool(self, capacity: int) -> _DevicePool:
        return _DevicePool(capacity)


def _device_class(base: type) -> type:
    return type(f"Device{base.__name__}", (_OnDevice, base), {"__doc__": f"{base.__doc__} (device memory)"})


_ALLOCATORS: dict[str, type] = {}


def allocator(mode: str, plans: dict, check: bool = False) -> memory.Allocator:
    """The allocator of `mode` ("static", "pooled", "dynamic") over device memory: the same bookkeeping (and so
    the same measured peaks) as on the CPU (`deepdsl_runtime.memory`), the bytes on the GPU."""
    classes = {"static": memory.Static, "pooled": memory.Pooled, "dynamic": memory.Dynamic}
    if mode not in classes:
        raise ValueError(f"unknown memory mode '{mode}' (use {', '.join(memory.MODES)})")
    if mode not in _ALLOCATORS:
        _ALLOCATORS[mode] = _device_class(classes[mode])
    return _ALLOCATORS[mode](plans, check)
