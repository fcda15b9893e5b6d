"""Elementwise work on the CUDA device: the compiler's elementwise kernels (`ew`, two at a time `ew_pair`) and their
sums (`ew_sum`, after another kernel `ew_and_sum`), broadcasts and reductions to a shape, copies and constants."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cuda import layout as L
from deepdsl_runtime.cuda.layout import EW_F32, EW_U8, EW_VALUE
from deepdsl_runtime.cuda.arrays import DeviceArray, device_array, fill, launch_items, require, to_numpy


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
    require(out, "elementwise output")
    if out.dtype != np.float32:
        raise TypeError(f"elementwise output of dtype {out.dtype}")
    layout = _layout(out, args)
    name = kernel if isinstance(kernel, str) else kernel.__name__
    d = layout.dims
    config = L.launch_1d(layout.size)
    out.device.launch(L.ew_entry(name, layout.nd), "IIIIP" + _EW_ARG * len(args), config.grid, config.block,
                      (layout.size, d[1], d[2], d[3], out.ptr, *_ew_args(layout, args)), kernel)


def ew_pair(first, second) -> None:
    """Two elementwise kernels, each `(kernel, out, *args)` as `ew` takes it, the second reading the first's
    output: the CPU backend's one pass (`deepdsl_runtime.cpu.elementwise.ew_pair`) is two launches here."""
    ew(*first)
    ew(*second)


def ew_many(kernel, *calls) -> None:
    """One elementwise kernel on several sets of operands, each `(out, *args)` as `ew` takes them: the CPU backend's
    one call (`deepdsl_runtime.cpu.elementwise.ew_many`) is a launch each here."""
    for out, *args in calls:
        ew(kernel, out, *args)


def ew_and_sum(first, second, *, shape, workspace=None) -> None:
    """An elementwise kernel, `(kernel, out, *args)`, and the sum to `shape` of another reading its output (`ew_sum`'s
    arguments): the CPU backend's one pass (`deepdsl_runtime.cpu.elementwise.ew_and_sum`) is `ew` and `ew_sum` here."""
    ew(*first)
    ew_sum(*second, shape=shape, workspace=workspace)


def ew_sum(kernel, out: DeviceArray, *args, shape, workspace=None) -> None:
    """out = the sum to `shape` of elementwise kernel `kernel` over `args`, the CPU backend's way
    (`deepdsl_runtime.cpu.elementwise.ew_sum`): chunks of samples as the workspace holds them
    (`contract.ew_sum_scratch`: a chunk's sum, then its values), each one `ew` into the workspace, a `sum_to` and
    an addition to `out`."""
    require(out, "ew_sum output")
    full = np.broadcast_shapes(*(a.shape if isinstance(a, DeviceArray) else () for a in args))
    per_sample, fixed, chunked = contract.ew_sum_scratch(full, shape)
    n = full[0] if chunked else 1
    floats = None if workspace is None else workspace.nbytes // 4
    step = n if floats is None or floats >= n * per_sample else (floats - fixed) // per_sample
    if step < 1:
        raise ValueError(f"workspace of {floats} floats holds no sample (needs {per_sample + fixed})")
    part_floats = fixed if step < n else 0
    total = part_floats + step * per_sample
    if workspace is None:
        scratch = device_array(out.device, total * 4, (total,), np.float32)
    else:
        scratch = workspace.view(np.float32) if workspace.dtype != np.float32 else workspace
    part = scratch[:part_floats].reshape(shape) if part_floats else None
    for s in range(0, n, step):
        e = min(n, s + step)
        values = scratch[part_floats:part_floats + (e - s) * per_sample].reshape(((e - s,) + full[1:]) if chunked
                                                                              else full)
        cut = [_samples(a, s, e) if chunked and isinstance(a, DeviceArray) and a.ndim == len(full)
               and a.shape[0] == n else a for a in args]
        ew(kernel, values, *cut)
        sum_to(values, out=out if s == 0 else part, shape=shape)
        if s:
            launch_items(out.device, "deepdsl_add_bias", "IIIPP", out.size, out.size, out.size, 1, part.ptr,
                         out.ptr)


def _samples(a: DeviceArray, start: int, stop: int) -> DeviceArray:
    """Samples [start, stop) of a contiguous device array (a view)."""
    per = a.size // a.shape[0]
    return a.reshape(-1)[start * per:stop * per].reshape((stop - start,) + a.shape[1:])


def broadcast_to(x, *, out, shape):
    require(out, "broadcast_to output")
    if out.dtype != np.float32:
        raise TypeError(f"broadcast_to of dtype {out.dtype}")
    layout = _layout(out, (x,))
    d = layout.dims
    launch_items(out.device, f"deepdsl_broadcast_{layout.nd}", "IIIIP" + _EW_ARG, layout.size, layout.size, d[1],
                 d[2], d[3], out.ptr, *_ew_args(layout, (x,)))


def sum_to(x, *, out, shape):
    """Sum x down to `shape` (the inverse of broadcasting): a column sum, a middle-axis sum or the generic one."""
    require(x, "sum_to input")
    plan = L.sum_plan(x.shape, tuple(shape))
    device = out.device
    if plan.kind == "copy":
        copy(x, out=out)
    elif plan.kind == "rows":
        device.launch("deepdsl_sum_rows", "IIPP", (-(-plan.b // 32), 1), (32, 8, 1), (plan.a, plan.b, x.ptr, out.ptr))
    elif plan.kind == "middle":
        device.launch("deepdsl_sum_middle", "IIIPP", (plan.b, 1), (L.THREADS, 1, 1),
                      (plan.a, plan.b, plan.c, x.ptr, out.ptr))
    else:
        launch_items(device, "deepdsl_sum_generic", "IIIIIIIPP", out.size, out.size, *plan.dims, plan.reduced,
                     plan.count, x.ptr, out.ptr)


def reshape(x, *, shape):
    """A view with another shape (no copy)."""
    return x.reshape(shape)


def copy(src, *, out):
    if src.nbytes != out.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {out.nbytes}")
    if out.nbytes and src.ptr != out.ptr:
        out.device.copy(out.ptr, src.ptr, out.nbytes)


def const(*, out, value, shape=()):
    fill(out, value)


def all_sum(x, *, out, ranks=None):
    """out = the sum of x (a device array or a number) over the ranks of a data-parallel job, staged through the
    host (`deepdsl_runtime.parallel`); x itself in one process."""
    if isinstance(x, (int, float)):
        fill(out, x)
    else:
        copy(x, out=out)
    if ranks is not None and ranks.size > 1:
        host = to_numpy(out)
        ranks.reduce(host.reshape(-1))
        out.device.upload(out.ptr, host)
