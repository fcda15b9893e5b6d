"""Attention and its gradient on the CUDA device (`deepdsl.ops.attention`, kernels in ops.cu): one thread per query
row for the output, the row statistics and the queries' gradient, one per key row for the keys' and values'
gradients, each recomputing the scores it needs; with dropout they read a weight's 0/1 mask (uint8) as they
weigh. The gradient's row statistics (log-sum-exp, dO . O) go into the workspace, as many units at a time as it
holds (`contract.attention_grad_scratch` per unit). With `heads`, the operands and results are stored (..., T, H, d)
and a unit's rows read and written in place (`AttShape::base`)."""
from __future__ import annotations

import math

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cuda.arrays import launch_items

_SHAPE = "IIIIIIfifI"   # AttShape: t, s, d, e, the bias's row and column strides, scale, causal, 1 / keep, heads
_LEAD = "IIIIIIII"      # AttLead: four leading sizes, then their strides in the bias


def _shape(q, k, v, bias, scale, causal, keep, heads=False) -> tuple:
    """(AttShape, AttLead) fields: the bias's element strides as broadcast to the scores (0 where it broadcasts)."""
    qs, ks, vs = (contract.attention_unit_shape(x.shape, heads) for x in (q, k, v))
    t, d, s, e = *qs[-2:], ks[-2], vs[-1]
    lead = list(qs[:-2])
    # (a bias has as many axes as the scores: the op's rule)
    steps = [0] * (len(lead) + 2) if bias is None else contract.broadcast_steps(bias.shape)
    sizes, strides = [], []
    for extent, step in zip(lead, steps[:-2]):          # adjacent axes that read as one merge
        if sizes and strides[-1] == step * extent:
            sizes[-1] *= extent
            strides[-1] = step
        else:
            sizes.append(extent)
            strides.append(step)
    if len(sizes) > 4:
        raise ValueError(f"attention bias of shape {bias.shape}: the CUDA kernels take at most four leading axes "
                         f"that broadcast differently, queries {q.shape}")
    sizes, strides = [1] * (4 - len(sizes)) + sizes, [0] * (4 - len(strides)) + strides
    return (t, s, d, e, steps[-2], steps[-1], np.float32(scale), int(bool(causal)), np.float32(1.0 / keep),
            qs[-3] if heads else 0), (*sizes, *strides)


def attention(q, k, v, bias=None, mask=None, *, out, scale, causal=False, keep=1.0, workspace=None, heads=False):
    shape, lead = _shape(q, k, v, bias, scale, causal, keep, heads)
    rows = math.prod(q.shape[:-1])
    launch_items(out.device, "deepdsl_attention", "I" + _SHAPE + _LEAD + "PPPPPP", rows, rows, *shape, *lead, q.ptr,
                 k.ptr, v.ptr, 0 if bias is None else bias.ptr, 0 if mask is None else mask.ptr, out.ptr)


def attention_grad(q, k, v, o, g, bias=None, mask=None, *, out, scale, causal=False, keep=1.0, workspace=None,
                   heads=False):
    shape, lead = _shape(q, k, v, bias, scale, causal, keep, heads)
    t, s, d, e = shape[:4]
    units = math.prod(contract.attention_unit_shape(q.shape, heads)[:-2])
    per_unit = contract.attention_grad_scratch(t, s, d, e, mask is not None)
    if workspace is None or workspace.size < per_unit:
        raise ValueError(f"attention_grad needs a workspace of at least {per_unit} floats")
    chunk = min(units, workspace.size // per_unit)
    dq, dk = out.ptr, out.ptr + 4 * q.size
    dv = dk + 4 * k.size
    pointers = (q.ptr, k.ptr, v.ptr, g.ptr, 0 if bias is None else bias.ptr, 0 if mask is None else mask.ptr,
                workspace.ptr)
    for first in range(0, units, chunk):
        count = min(chunk, units - first)
        items = count * t
        launch_items(out.device, "deepdsl_attention_stats", "I" + _SHAPE + _LEAD + "IPPPPPP", items, items, *shape,
                     *lead, first, q.ptr, k.ptr, o.ptr, g.ptr, pointers[4], workspace.ptr)
        for keys, n in ((0, items), (1, count * s)):
            launch_items(out.device, "deepdsl_attention_grad", "IIi" + _SHAPE + _LEAD + "I" + "P" * 10, n, n, items,
                         keys, *shape, *lead, first, *pointers, dq, dk, dv)
