"""Pooling on the CUDA device (max and average, forward and backward)."""
from __future__ import annotations


from deepdsl_runtime.cuda import layout as L
from deepdsl_runtime.cuda.arrays import DeviceArray, launch_items, overlaps
from deepdsl_runtime.cuda.conv import over_input


_POOL = "I" * 8


def _pool_geom(planes, h, w, ho, wo, kernel, stride, pad) -> tuple[int, ...]:
    return (planes, h, w, ho, wo, kernel, stride, pad)


def _pool(kind: str, source: DeviceArray, others: tuple, out: DeviceArray, geom, extra: tuple, samples: int,
          backward: bool, workspace, leaves_input: bool) -> None:
    """Run pooling kernel `kind` (deepdsl_<kind>_range / _ordered) over `out`, reading `source` (the input, or the
    output gradient) and `others` (the argmax). When the memory plan has `out` overlap `source` (from the same
    start): where windows leave the input, the samples run in the safe chunk order of `_over_input`; otherwise all
    at once in race-free waves (layout.takeover_waves)."""
    device = out.device
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

    if not overlaps(out, source):
        run(0, samples, source.ptr, out.ptr)
        return
    if out.ptr != source.ptr:
        raise ValueError(f"{kind}: an output overlapping its input must start where the input starts")
    if not leaves_input:
        run(0, samples, source.ptr, out.ptr,
            L.takeover_waves(samples, per_source, per_out, source.ptr, out.ptr, 4, backward))
        return
    over_input(device, kind, samples, per_source, per_out, source.ptr, out.ptr, workspace, run)


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
    launch_items(out.device, "deepdsl_max_pool_argmax", _POOL + "PPI", out.size, *geom, x.ptr, out.ptr, out.size)


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
