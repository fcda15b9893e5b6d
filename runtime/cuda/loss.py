"""Losses on the CUDA device: softmax, log-softmax, picking and unpicking labels, precision, labels' ranks."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime.cuda import layout as L
from deepdsl_runtime.cuda.arrays import DeviceArray, launch_items


def softmax(x, *, out, causal=False):
    rows, classes = x.shape
    launch_items(out.device, "deepdsl_softmax", "IIPPii", rows, rows, classes, x.ptr, out.ptr, 0, int(causal))


def log_softmax(x, *, out, workspace=None):
    rows, classes = x.shape
    launch_items(out.device, "deepdsl_softmax", "IIPPii", rows, rows, classes, x.ptr, out.ptr, 1, 0)


def pick(x, labels, *, out):
    """out[i] = x[i, labels[i]] (NaN for a label out of range)."""
    rows, classes = x.shape
    launch_items(out.device, "deepdsl_pick", "IIPPP", rows, rows, classes, x.ptr, _labels(labels).ptr, out.ptr)


def unpick(g, labels, *, out, classes):
    launch_items(out.device, "deepdsl_unpick", "IIPPP", out.size, out.size, classes, g.ptr, _labels(labels).ptr,
                 out.ptr)


def precision(x, labels, *, out):
    """Fraction of rows whose first largest score is at the label."""
    rows, classes = x.shape
    out.device.launch("deepdsl_precision", "IIPPP", (1, 1), (L.THREADS, 1, 1),
                      (rows, classes, x.ptr, _labels(labels).ptr, out.ptr))


def label_rank(x, labels, *, out):
    """out[i] = how many scores of row i come before its label's sorted by decreasing score, ties in column order."""
    rows, classes = x.shape
    launch_items(out.device, "deepdsl_label_rank", "IIPPP", rows, rows, classes, x.ptr, _labels(labels).ptr,
                 out.ptr)


def _labels(labels) -> DeviceArray:
    if not isinstance(labels, DeviceArray) or labels.dtype != np.int32:
        raise TypeError("labels must be an int32 device array")
    return labels
