"""Losses on the CPU: softmax, log-softmax, picking and unpicking labels, precision, labels' ranks."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch, sample_chunks


def softmax(x, *, out, causal=False):
    """Rows' softmax; `causal`: in blocks of K rows (K the columns), row i of a block over columns 0..i only."""
    if causal:
        k = x.shape[1]
        np.copyto(out, x)
        out.reshape(-1, k, k)[:, np.triu(np.ones((k, k), dtype=bool), 1)] = -np.inf
        x = out
    np.subtract(x, x.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    np.divide(out, out.sum(axis=1, keepdims=True), out=out)


def log_softmax(x, *, out, workspace=None, native=None):
    """Rows' log-softmax, in chunks of rows (scratch: the exponentials); with `native`, the program's compiled kernel
    (`Native.log_softmax`: a row at a time, on their threads, no scratch)."""
    if native is not None and native.log_softmax(x, out):
        return
    scratch_floats = contract.log_softmax_scratch(x.shape)
    for a, b in sample_chunks(x.shape[0], workspace, scratch_floats, 3 * scratch_floats):
        xs, outs = x[a:b], out[a:b]
        np.subtract(xs, xs.max(axis=1, keepdims=True), out=outs)
        e = Scratch(workspace).take(xs.shape)
        np.exp(outs, out=e)
        np.subtract(outs, np.log(e.sum(axis=1, keepdims=True)), out=outs)


def pick(x, labels, *, out):
    """out[i] = x[i, labels[i]]."""
    np.copyto(out, np.take_along_axis(x, labels.reshape(-1, 1).astype(np.intp, copy=False), axis=1).reshape(-1))


def unpick(g, labels, *, out, classes):
    """out[i, labels[i]] = g[i], zero elsewhere."""
    out.fill(0)
    np.put_along_axis(out, labels.reshape(-1, 1).astype(np.intp, copy=False), g.reshape(-1, 1), axis=1)


def precision(x, labels, *, out):
    """Fraction of rows whose first largest score is at the label."""
    out[...] = np.mean(np.argmax(x, axis=1) == labels)


RANK_CHUNK = 1 << 16      # scores compared at once by label_rank (its temporaries stay small for any vocabulary)


def label_rank(x, labels, *, out, native=None):
    """out[i] = how many scores of row i come before its label's when sorted by decreasing score, ties in column
    order (0 exactly where `precision` counts the row)."""
    if native is not None and native.label_rank(x, labels, out):
        return
    rows, classes = x.shape
    step = max(1, RANK_CHUNK // max(classes, 1))
    columns = np.arange(classes)
    for a in range(0, rows, step):
        xs, ls = x[a:a + step], labels[a:a + step].astype(np.intp, copy=False)
        outside = (ls < 0) | (ls >= classes)                      # a label outside the row: NaN
        own = np.take_along_axis(xs, np.where(outside, 0, ls)[:, None], axis=1)
        ahead = (xs > own) | ((xs == own) & (columns[None, :] < ls[:, None]))
        out[a:a + step] = ahead.sum(axis=1)
        out[a:a + step][outside] = np.nan
