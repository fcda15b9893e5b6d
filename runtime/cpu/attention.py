"""Scaled dot-product attention on the CPU and its gradient (`deepdsl.ops.attention`).

numpy's kernels weigh `contract.attention_rows` queries of as many units (batch index and head) as the workspace
holds at a time: the block's scores in the workspace, their softmax in place, then the product with the values;
the gradient recomputes a block's weights the same way. The compiled kernels (kernels/cpu_attention.c) need no
workspace: they weigh tiles of queries against tiles of keys with an online softmax.
"""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch, sample_chunks

__all__ = ["attention", "attention_grad", "bias_units"]


def _units(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, *x.shape[-2:])


def bias_units(bias: np.ndarray | None, q_shape, s: int) -> np.ndarray | None:
    """The bias broadcast to the scores (units, T, S): a view, no copy."""
    if bias is None:
        return None
    return np.broadcast_to(bias, (*q_shape[:-1], s)).reshape(-1, q_shape[-2], s)


def _block_weights(q, k, bias, a, b, r0, r1, causal, scale, w, gemm):
    """w = softmax(q k^T * scale + bias) of the queries r0:r1 of units a:b (causal: query i over keys 0..i)."""
    gemm(q[a:b, r0:r1], k[a:b].swapaxes(-1, -2), out=w)
    np.multiply(w, np.float32(scale), out=w)
    if bias is not None:
        np.add(w, bias[a:b, r0:r1], out=w)
    if causal:
        w[:, np.arange(r1 - r0)[:, None] + r0 < np.arange(w.shape[-1])[None, :]] = -np.inf
    np.subtract(w, w.max(axis=-1, keepdims=True), out=w)
    np.exp(w, out=w)
    np.divide(w, w.sum(axis=-1, keepdims=True), out=w)


def attention(q, k, v, bias=None, *, out, scale, causal=False, workspace=None, gemm=np.matmul, native=None):
    """out = softmax(q k^T * scale + bias) v over the last two axes (`deepdsl.ops.attention`)."""
    if native is not None and native.attention(q, k, v, bias, out, scale, causal):
        return
    t, s = q.shape[-2], k.shape[-2]
    qu, ku, vu, ou = _units(q), _units(k), _units(v), _units(out)
    bu = bias_units(bias, q.shape, s)
    rows = contract.attention_rows(t)
    per_unit = contract.attention_scratch(t, s)
    for a, b in sample_chunks(qu.shape[0], workspace, per_unit, per_unit + 2 * t * (q.shape[-1] + v.shape[-1])):
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            w = Scratch(workspace).take((b - a, r1 - r0, s))
            _block_weights(qu, ku, bu, a, b, r0, r1, causal, scale, w, gemm)
            gemm(w, vu[a:b], out=ou[a:b, r0:r1])


def attention_grad(q, k, v, o, g, bias=None, *, out, scale, causal=False, workspace=None, gemm=np.matmul,
                   native=None):
    """out = (dq, dk, dv) of attention, flat one after the other, given its output o and o's gradient g."""
    if native is not None and native.attention_grad(q, k, v, o, g, bias, out, scale, causal):
        return
    t, s, d, e = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    qu, ku, vu, ou, gu = _units(q), _units(k), _units(v), _units(o), _units(g)
    n = qu.shape[0]
    dq = out[:q.size].reshape(n, t, d)
    dk = out[q.size:q.size + k.size].reshape(n, s, d)
    dv = out[q.size + k.size:].reshape(n, s, e)
    bu = bias_units(bias, q.shape, s)
    rows = contract.attention_rows(t)
    per_unit = contract.attention_grad_scratch(t, s, d, e)
    for a, b in sample_chunks(n, workspace, per_unit, per_unit + 2 * (t + s) * (d + e)):
        scratch = Scratch(workspace)
        w = scratch.take((b - a, rows, s))
        dw = scratch.take((b - a, rows, s))
        part = scratch.take((b - a, s, max(d, e))) if rows < t else None
        delta = scratch.take((b - a, t, 1))
        np.einsum("ute,ute->ut", gu[a:b], ou[a:b], out=delta[..., 0])
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            wb, dwb = w[:, :r1 - r0], dw[:, :r1 - r0]
            _block_weights(qu, ku, bu, a, b, r0, r1, causal, scale, wb, gemm)
            first = r0 == 0
            # dv += w^T g
            _accumulate(gemm, wb.swapaxes(-1, -2), gu[a:b, r0:r1], dv[a:b], None if first else part[..., :e])
            # dw = w * (g v^T - rowsum(g * o)) * scale
            gemm(gu[a:b, r0:r1], vu[a:b].swapaxes(-1, -2), out=dwb)
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
