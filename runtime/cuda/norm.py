"""Local response normalization on the CUDA device, forward and backward."""
from __future__ import annotations

import math

import numpy as np
from deepdsl_runtime.cuda.arrays import DeviceArray, launch_items


LRN_MAX_SIZE = 16     # DEEPDSL_LRN_MAX_SIZE


def _lrn_columns(x: DeviceArray, size: int) -> tuple[int, int, int]:
    if not 1 <= size <= LRN_MAX_SIZE:
        raise ValueError(f"LRN window of {size} channels (the CUDA kernel takes 1 to {LRN_MAX_SIZE})")
    spatial = math.prod(x.shape[2:])
    return x.shape[0] * spatial, x.shape[1], spatial


def lrn(x, *, out, size, alpha, beta, k, workspace=None):
    columns, channels, spatial = _lrn_columns(x, size)
    f = np.float32
    launch_items(out.device, "deepdsl_lrn", "IIIifffPP", columns, columns, channels, spatial, size, f(alpha / size),
                 f(k), f(-beta), x.ptr, out.ptr)


def lrn_bwd(g, x, *, out, size, alpha, beta, k, workspace=None):
    columns, channels, spatial = _lrn_columns(x, size)
    f = np.float32
    launch_items(out.device, "deepdsl_lrn_bwd", "IIIifffffPPP", columns, columns, channels, spatial, size,
                 f(alpha / size), f(k), f(-beta), f(-beta - 1), f(2 * alpha * beta / size), g.ptr, x.ptr, out.ptr)
