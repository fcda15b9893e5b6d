"""Scaled dot-product attention on the CPU and its gradient (`deepdsl.ops.attention`).

Where the compiled kernels take a unit's sizes (`contract.attention_in_units`: at most 64 queries, keys and
features, as a ViT's heads or a character model's, with or without dropout), they weigh each unit whole on one thread,
with no workspace (`deepdsl_attention_units`: products, softmax and gradient in registers and on the stack).
Otherwise the kernels weigh `contract.attention_rows` queries of as many units (batch index and head) as the
workspace holds at a time: the block's scores in the workspace (a product, by the backend's `gemm`), their softmax
in place, then the product with the values; the gradient recomputes a block's weights the same way. The passes over
the rows between the products run numpy's code, or the compiled kernels' (kernels/cpu_attention.c) where the program
has them: those compute exp by a polynomial, within an ulp of numpy's. With dropout (a 0/1 `mask` of the scores'
shape, `keep` the fraction kept) a block's weights are multiplied by mask / keep before the product, and the
gradient keeps a block's kept weights (for the values' gradient) beside its weights (for the scores').
"""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch, sample_chunks

__all__ = ["attention", "attention_grad", "Bias"]


def _units(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, *x.shape[-2:])


class Bias:
    """A bias of the scores as the kernels read it: element (i, j) of unit u at `flat[offsets[u] + i * row + j *
    col]`, strides 0 along the axes it broadcasts over (`contract.broadcast_steps`: no copy of the bias broadcast to
    the scores)."""

    def __init__(self, bias: np.ndarray, q_shape):
        self.flat = np.ascontiguousarray(bias).reshape(-1)
        steps = contract.broadcast_steps(bias.shape)           # (as many axes as the scores: the op's rule)
        self.row, self.col = steps[-2:]
        lead = tuple(q_shape[:-2])
        offsets = np.zeros(lead, np.int64)
        for axis, (n, step) in enumerate(zip(lead, steps[:-2])):
            shape = [1] * len(lead)
            shape[axis] = n
            offsets = offsets + np.arange(n, dtype=np.int64).reshape(shape) * step
        self.offsets = offsets.reshape(-1)

    def add(self, w: np.ndarray, a: int, r0: int) -> None:
        """w (units a.. by queries r0.. by keys) += the bias there."""
        step = self.flat.itemsize
        for u in range(w.shape[0]):
            start = self.flat[self.offsets[a + u] + r0 * self.row:]
            np.add(w[u], np.lib.stride_tricks.as_strided(start, w.shape[1:], (self.row * step, self.col * step)),
                   out=w[u])


def _block_weights(q, k, bias, a, b, r0, r1, causal, scale, w, gemm, native):
    """w = softmax(q k^T * scale + bias) of the queries r0:r1 of units a:b (causal: query i over keys 0..i)."""
    gemm(q[a:b, r0:r1], k[a:b].swapaxes(-1, -2), out=w)
    if native is not None and native.attention_weights(w, bias, a, r0, scale, causal):
        return
    np.multiply(w, np.float32(scale), out=w)
    if bias is not None:
        bias.add(w, a, r0)
    if causal:
        w[:, np.arange(r1 - r0)[:, None] + r0 < np.arange(w.shape[-1])[None, :]] = -np.inf
    np.subtract(w, w.max(axis=-1, keepdims=True), out=w)
    np.exp(w, out=w)
    np.divide(w, w.sum(axis=-1, keepdims=True), out=w)


def _kept(w, mask, keep, out, native):
    """out = w * mask / keep: a block's weights kept by dropout (mask: that block's)."""
    if native is None or not native.attention_kept(w, mask, keep, out):
        np.multiply(w, mask, out=out)
        np.multiply(out, np.float32(1.0 / keep), out=out)


def _heads(x: np.ndarray) -> np.ndarray:
    """An operand stored (..., T, H, d) as (N, T, H, d) (a view)."""
    return x.reshape(-1, *x.shape[-3:])


def _swapped(x: np.ndarray) -> np.ndarray:
    """(..., H, T, d) of an operand stored (..., T, H, d): a copy."""
    return np.ascontiguousarray(x.swapaxes(-3, -2))


def attention(q, k, v, bias=None, mask=None, *, out, scale, causal=False, keep=1.0, workspace=None, gemm=np.matmul,
              native=None, heads=False):
    """out = (softmax(q k^T * scale + bias) * mask / keep) v over the last two axes (`deepdsl.ops.attention`; no
    mask: no dropout). With `heads`, q, k, v and out are stored (..., T, H, d): the compiled kernels read and write
    them in place; numpy's kernels compute on copies in the units' layout (..., H, T, d)."""
    if heads:
        bu = None if bias is None else Bias(bias, contract.attention_unit_shape(q.shape, True))
        mu = None if mask is None else _units(mask)
        if native is not None and native.attention_units(_heads(q), _heads(k), _heads(v), bu, mu, keep, _heads(out),
                                                         scale, causal, heads=True):
            return
        o = np.empty(contract.attention_unit_shape(out.shape, True), out.dtype)
        attention(_swapped(q), _swapped(k), _swapped(v), bias, mask, out=o, scale=scale, causal=causal, keep=keep,
                  workspace=workspace, gemm=gemm, native=native)
        out[...] = o.swapaxes(-3, -2)
        return
    t, s = q.shape[-2], k.shape[-2]
    qu, ku, vu, ou = _units(q), _units(k), _units(v), _units(out)
    bu = None if bias is None else Bias(bias, q.shape)
    mu = None if mask is None else _units(mask)
    if native is not None and native.attention_units(qu, ku, vu, bu, mu, keep, ou, scale, causal):
        return
    rows = contract.attention_rows(t)
    per_unit = contract.attention_scratch(t, s)
    for a, b in sample_chunks(qu.shape[0], workspace, per_unit, per_unit + 2 * t * (q.shape[-1] + v.shape[-1])):
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            w = Scratch(workspace).take((b - a, r1 - r0, s))
            _block_weights(qu, ku, bu, a, b, r0, r1, causal, scale, w, gemm, native)
            if mu is not None:
                _kept(w, mu[a:b, r0:r1], keep, w, native)
            gemm(w, vu[a:b], out=ou[a:b, r0:r1])


def attention_grad(q, k, v, o, g, bias=None, mask=None, *, out, scale, causal=False, keep=1.0, workspace=None,
                   gemm=np.matmul, native=None, heads=False):
    """out = (dq, dk, dv) of attention, flat one after the other, given its output o and o's gradient g (with
    `heads`, all stored (..., T, H, d), as `attention`'s)."""
    if heads:
        bu = None if bias is None else Bias(bias, contract.attention_unit_shape(q.shape, True))
        mu = None if mask is None else _units(mask)
        dq, dk, dv = (_heads(out[a:a + x.size].reshape(x.shape))
                      for a, x in ((0, q), (q.size, k), (q.size + k.size, v)))
        if native is not None and native.attention_units_grad(_heads(q), _heads(k), _heads(v), _heads(o), _heads(g),
                                                              bu, mu, keep, dq, dk, dv, scale, causal, heads=True):
            return
        packed = np.empty_like(out)
        attention_grad(*(_swapped(x) for x in (q, k, v, o, g)), bias, mask, out=packed, scale=scale, causal=causal,
                       keep=keep, workspace=workspace, gemm=gemm, native=native)
        for a, x, into in ((0, q, dq), (q.size, k, dk), (q.size + k.size, v, dv)):
            units = contract.attention_unit_shape(x.shape, True)
            into[...] = packed[a:a + x.size].reshape(units).swapaxes(-3, -2).reshape(into.shape)
        return
    t, s, d, e = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    qu, ku, vu, ou, gu = _units(q), _units(k), _units(v), _units(o), _units(g)
    n = qu.shape[0]
    dq = out[:q.size].reshape(n, t, d)
    dk = out[q.size:q.size + k.size].reshape(n, s, d)
    dv = out[q.size + k.size:].reshape(n, s, e)
    bu = None if bias is None else Bias(bias, q.shape)
    mu = None if mask is None else _units(mask)
    if native is not None and native.attention_units_grad(qu, ku, vu, ou, gu, bu, mu, keep, dq, dk, dv, scale, causal):
        return
    rows = contract.attention_rows(t)
    per_unit = contract.attention_grad_scratch(t, s, d, e, mask is not None)
    for a, b in sample_chunks(n, workspace, per_unit, per_unit + 2 * (t + s) * (d + e)):
        scratch = Scratch(workspace)
        w = scratch.take((b - a, rows, s))
        dw = scratch.take((b - a, rows, s))
        kept = scratch.take((b - a, rows, s)) if mu is not None else None
        part = scratch.take((b - a, s, max(d, e))) if rows < t else None
        delta = scratch.take((b - a, t, 1))
        np.einsum("ute,ute->ut", gu[a:b], ou[a:b], out=delta[..., 0])
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            wb, dwb, kb = (None if x is None else x.reshape(-1)[:(b - a) * (r1 - r0) * s].reshape(b - a, r1 - r0, s)
                           for x in (w, dw, kept))
            _block_weights(qu, ku, bu, a, b, r0, r1, causal, scale, wb, gemm, native)
            mb = None if mu is None else mu[a:b, r0:r1]
            if mb is not None:
                _kept(wb, mb, keep, kb, native)
            first = r0 == 0
            # dv += (w * mask / keep)^T g
            _accumulate(gemm, (wb if kb is None else kb).swapaxes(-1, -2), gu[a:b, r0:r1], dv[a:b],
                        None if first else part[..., :e])
            # dw = w * (g v^T [* mask / keep] - rowsum(g * o)) * scale
            gemm(gu[a:b, r0:r1], vu[a:b].swapaxes(-1, -2), out=dwb)
            if native is None or not native.attention_dscores(wb, dwb, delta, r0, scale, mb, keep):
                if mb is not None:
                    _kept(dwb, mb, keep, dwb, None)
                np.subtract(dwb, delta[:, r0:r1], out=dwb)
                np.multiply(dwb, wb, out=dwb)
                np.multiply(dwb, np.float32(scale), out=dwb)
            gemm(dwb, ku[a:b], out=dq[a:b, r0:r1])
            _accumulate(gemm, dwb.swapaxes(-1, -2), qu[a:b, r0:r1], dk[a:b], None if first else part[..., :d])


def _accumulate(gemm, x, y, into, part):
    """into = x @ y (part None: the first block) or into += x @ y through `part`."""
    if part is None:
        gemm(x, y, out=into)
    else:
        gemm(x, y, out=part)
        np.add(into, part, out=into)
