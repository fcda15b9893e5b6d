"""Local response normalization and layer normalization on the CUDA device, forward and backward."""
from __future__ import annotations

import math

import numpy as np
from deepdsl_runtime import contract
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


def layer_norm(x, *affine, out, eps, axes, workspace=None):
    rows, features = contract.layer_norm_rows(x.shape, axes)
    w, b = (affine[0].ptr, affine[1].ptr) if affine else (0, 0)
    launch_items(out.device, "deepdsl_layer_norm", "IIfPPPP", rows, rows, features, np.float32(eps), x.ptr, w, b,
                 out.ptr)


def layer_norm_grad(x, g, *weight, out, eps, axes, workspace=None):
    rows, features = contract.layer_norm_rows(x.shape, axes)
    launch_items(out.device, "deepdsl_layer_norm_grad", "IIfPPPP", rows, rows, features, np.float32(eps), x.ptr,
                 g.ptr, weight[0].ptr if weight else 0, out.ptr)


def layer_norm_param_grad(x, g, *, out, eps, axes, workspace=None):
    """The rows' means and 1 / std into the workspace, then a thread per feature over the rows in order."""
    rows, features = contract.layer_norm_rows(x.shape, axes)
    needed = contract.layer_norm_param_scratch(rows, features)
    if workspace is None or workspace.size < needed:
        raise ValueError(f"layer_norm_param_grad needs a workspace of at least {needed} floats")
    launch_items(out.device, "deepdsl_layer_norm_stats", "IIfPP", rows, rows, features, np.float32(eps), x.ptr,
                 workspace.ptr)
    launch_items(out.device, "deepdsl_layer_norm_param_grad", "IIPPPP", features, features, rows, x.ptr, g.ptr,
                 workspace.ptr, out.ptr)
