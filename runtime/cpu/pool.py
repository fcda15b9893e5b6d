"""Pooling on the CPU (max and average, forward and backward), a chunk of samples at a time."""
from __future__ import annotations

import math

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch, over_samples, sample_chunks, takes_over

_F32 = np.float32


def _pool_source(x, kernel, stride, pad, ho, wo, fill, scratch):
    """x, or a copy padded with `fill` (padding and, in ceil mode, windows that hang over the edge)."""
    n, c, h, w = x.shape
    hp, wp = (ho - 1) * stride + kernel, (wo - 1) * stride + kernel
    if pad == 0 and hp <= h and wp <= w:
        return x
    src = scratch.take((n, c, max(hp, h + pad), max(wp, w + pad)))
    src.fill(fill)
    src[:, :, pad:pad + h, pad:pad + w] = x
    return src


def _scatter_target(out, size, kernel, stride, pad, ho, wo, scratch):
    """Where window gradients are added up: out itself, or a padded buffer when windows leave the input."""
    n, c = out.shape[:2]
    h, w = size
    hp, wp = (ho - 1) * stride + kernel, (wo - 1) * stride + kernel
    if pad == 0 and hp <= h and wp <= w:
        return out
    return scratch.take((n, c, max(hp, h + pad), max(wp, w + pad)))


def _contiguous(*arrays) -> bool:
    return all(a is None or a.flags.c_contiguous for a in arrays)


def _window(a, i, j, stride, ho, wo):
    return a[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride]


def _pool_per_sample(x_shape, out_shape, *scratch_shapes) -> int:
    """Float32 elements one sample of a pooling kernel touches: input, output and its scratch (cache chunking)."""
    return sum(math.prod(shape[1:]) for shape in (x_shape, out_shape, *scratch_shapes))


def max_pool(x, *, out, kernel, stride, pad=0, ceil=False, argmax=None, workspace=None, native=None):
    """Maximum of each window; with `argmax`, also the index `max_pool_argmax` computes, in the same pass over the
    windows (the maxima are the argmax's reference values; the workspace max_pool's plan gives it, which need not
    hold the argmax's one-byte mask). `out` may take over the bytes of `x` (same start): samples then run in a
    safe order. With `native` (compiled kernels) one compiled pass computes both."""
    if takes_over(x, out):
        return over_samples(lambda s, e, xs, os, ws: max_pool(
            xs, out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil,
            argmax=None if argmax is None else argmax[s:e], workspace=ws, native=native), x, out, workspace, native)
    if native is not None and _contiguous(x, out, argmax):
        return native.max_pool(x, out, argmax, kernel, stride, pad, workspace)
    ho, wo = out.shape[2:]
    extra = () if argmax is None else (out.shape, out.shape)
    padded = contract.max_pool_scratch(x.shape, out.shape, kernel, stride, pad)
    for s, e in sample_chunks(x.shape[0], workspace, padded,
                              _pool_per_sample(x.shape, out.shape, *extra) + padded):
        scratch = Scratch(workspace)
        src = _pool_source(x[s:e], kernel, stride, pad, ho, wo, -np.inf, scratch)
        part = out[s:e]
        _window_max(src, part, kernel, stride, ho, wo)
        if argmax is not None:       # the mask: in what the workspace has left, else a chunk-sized temporary
            mask = scratch.take_bool(part.shape) if scratch.room() * 4 >= part.size else np.empty(part.shape, bool)
            _window_argmax(src, part, argmax[s:e], mask, kernel, stride, ho, wo)


def _window_max(src, best, kernel, stride, ho, wo):
    np.copyto(best, _window(src, 0, 0, stride, ho, wo))
    for p in range(1, kernel * kernel):
        np.maximum(best, _window(src, p // kernel, p % kernel, stride, ho, wo), out=best)


def _window_argmax(src, best, index, differs, kernel, stride, ho, wo):
    """The index from the last window position to the first: r = 0 at the last position and
    r = (x_p != max) * (1 + r) before it, so r ends as the offset of the first position holding the maximum. Per
    position one comparison of strided floats and two passes over uint8 bytes, instead of keeping a running index
    next to a running maximum."""
    last = kernel * kernel - 1
    as_bytes = differs.view(np.uint8)
    if last == 0:
        index.fill(0)
    for p in range(last - 1, -1, -1):
        np.not_equal(_window(src, p // kernel, p % kernel, stride, ho, wo), best, out=differs)
        if p == last - 1:
            np.copyto(index, as_bytes)
        else:
            np.add(index, 1, out=index)
            np.multiply(index, as_bytes, out=index)


def max_pool_argmax(x, *, out, kernel, stride, pad=0, ceil=False, workspace=None, native=None):
    """Index (row * kernel + column) of the first maximum of each window, as uint8: the window maxima first (as
    max_pool computes them), then the index from them (`_window_argmax`)."""
    if native is not None and _contiguous(x, out):
        return native.max_pool(x, None, out, kernel, stride, pad, workspace)
    ho, wo = out.shape[2:]
    padded = contract.max_pool_scratch(x.shape, out.shape, kernel, stride, pad)
    scratch_floats = contract.max_pool_argmax_scratch(x.shape, out.shape, kernel, stride, pad)
    for s, e in sample_chunks(x.shape[0], workspace, scratch_floats,
                              _pool_per_sample(x.shape, out.shape, out.shape) + padded):
        scratch = Scratch(workspace)
        src = _pool_source(x[s:e], kernel, stride, pad, ho, wo, -np.inf, scratch)
        index = out[s:e]
        best = scratch.take(index.shape)
        differs = scratch.take_bool(index.shape)
        _window_max(src, best, kernel, stride, ho, wo)
        _window_argmax(src, best, index, differs, kernel, stride, ho, wo)


def max_pool_bwd(g, argmax, *, out, kernel, stride, pad=0, ceil=False, size, workspace=None, native=None):
    """Each gradient goes to the position its window's argmax names; overlapping windows add up. `out` may take
    over the bytes of `g` (same start): samples then run in a safe order. With `native`, one compiled pass (the
    same additions in the same order)."""
    if takes_over(g, out):
        return over_samples(lambda s, e, gs, os, ws: max_pool_bwd(
            gs, argmax[s:e], out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil, size=size, workspace=ws,
            native=native), g, out, workspace, native)
    if native is not None and _contiguous(g, argmax, out):
        return native.max_pool_bwd(g, argmax, out, kernel, stride, pad)
    ho, wo = g.shape[2:]
    h, w = size
    overlap = stride < kernel
    padded = contract.pool_padded_scratch(size, (ho, wo), kernel, stride, pad, out.shape[1])
    scratch_floats = contract.max_pool_bwd_scratch(g.shape, out.shape, kernel, stride, pad)
    per_sample = _pool_per_sample(out.shape, g.shape, *((g.shape,) if overlap else ())) + padded
    for s, e in sample_chunks(g.shape[0], workspace, scratch_floats, per_sample):
        scratch = Scratch(workspace)
        target = out[s:e]
        dst = _scatter_target(target, size, kernel, stride, pad, ho, wo, scratch)
        grad, index = g[s:e], argmax[s:e]
        hit = scratch.take_bool(grad.shape)
        part = scratch.take(grad.shape) if overlap else None
        if overlap or stride > kernel or dst.shape[2:] != (kernel * ho, kernel * wo):
            dst.fill(0)                   # otherwise the windows tile dst and write every position
        for i in range(kernel):
            for j in range(kernel):
                view = _window(dst, i, j, stride, ho, wo)
                np.equal(index, i * kernel + j, out=hit)
                if part is None:          # windows do not overlap: each position is written by one window only
                    np.multiply(grad, hit, out=view)
                else:
                    np.multiply(grad, hit, out=part)
                    np.add(view, part, out=view)
        if dst is not target:
            np.copyto(target, dst[:, :, pad:pad + h, pad:pad + w])


def avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad) -> np.ndarray:
    """(Ho, Wo) element counts each averaging window divides by (`contract.avg_pool_divisor`), as float32."""
    # float32: an integer divisor would make numpy divide in float64 and round back
    return contract.avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad).astype(_F32)


def avg_pool(x, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, workspace=None, native=None):
    """Mean of each window. `out` may take over the bytes of `x` (same start): samples then run in a safe order.
    With `native`, one compiled pass (the same additions and divisions in the same order)."""
    if takes_over(x, out):
        return over_samples(lambda s, e, xs, os, ws: avg_pool(
            xs, out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil, include_pad=include_pad, workspace=ws,
            native=native), x, out, workspace, native)
    if native is not None and native.avg_pool(x, out, kernel, stride, pad, include_pad):
        return
    ho, wo = out.shape[2:]
    divisor = avg_pool_divisor(x.shape[2:], kernel, stride, pad, ceil, include_pad)
    padded = contract.avg_pool_scratch(x.shape, out.shape, kernel, stride, pad)
    for s, e in sample_chunks(x.shape[0], workspace, padded, _pool_per_sample(x.shape, out.shape) + padded):
        src = _pool_source(x[s:e], kernel, stride, pad, ho, wo, 0.0, Scratch(workspace))
        part = out[s:e]
        np.copyto(part, _window(src, 0, 0, stride, ho, wo))
        for i in range(kernel):
            for j in range(kernel):
                if i or j:
                    np.add(part, _window(src, i, j, stride, ho, wo), out=part)
        np.divide(part, divisor, out=part)


def avg_pool_bwd(g, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, size, workspace=None,
                 native=None):
    """Each window's mean gradient spread over the window. `out` may take over the bytes of `g` (same start):
    samples then run in a safe order. With `native`, one compiled pass (the same operations in the same order)."""
    if takes_over(g, out):
        return over_samples(lambda s, e, gs, os, ws: avg_pool_bwd(
            gs, out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil, include_pad=include_pad, size=size,
            workspace=ws, native=native), g, out, workspace, native)
    if native is not None and native.avg_pool_bwd(g, out, kernel, stride, pad, include_pad):
        return
    ho, wo = g.shape[2:]
    h, w = size
    divisor = avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad)
    padded = contract.pool_padded_scratch(size, (ho, wo), kernel, stride, pad, out.shape[1])
    scratch_floats = contract.avg_pool_bwd_scratch(g.shape, out.shape, kernel, stride, pad)
    for s, e in sample_chunks(g.shape[0], workspace, scratch_floats,
                              _pool_per_sample(out.shape, g.shape, g.shape) + padded):
        scratch = Scratch(workspace)
        target = out[s:e]
        dst = _scatter_target(target, size, kernel, stride, pad, ho, wo, scratch)
        share = scratch.take(g[s:e].shape)
        np.divide(g[s:e], divisor, out=share)
        dst.fill(0)
        for i in range(kernel):
            for j in range(kernel):
                view = _window(dst, i, j, stride, ho, wo)
                if stride >= kernel:
                    np.copyto(view, share)
                else:
                    np.add(view, share, out=view)
        if dst is not target:
            np.copyto(target, dst[:, :, pad:pad + h, pad:pad + w])
