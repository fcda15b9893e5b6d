"""The ops of the CUDA backend over an abstract device: what `deepdsl_runtime.cuda` exports with a GPU behind it.

Same names, signatures and contract as `deepdsl_runtime.cpu` (explicit `out=` buffers, `workspace=` scratch the
compiler sized); tensors are `DeviceArray`s (a device pointer, a shape, a dtype). Every op is a short sequence of
kernel launches, GEMMs and copies on one device object (`arrays.Device`): `deepdsl_runtime.cuda` installs the
pycuda one; the test suite installs a host emulator that runs the kernels' own per-element code compiled for the
CPU, so everything here -- argument packing, chunking, workspace carving, launch order -- is exercised without a
GPU. Launch geometry and layouts come from `deepdsl_runtime.cuda.layout`.

Convolution is im2col + GEMM as on the CPU: a chunk of samples' im2col matrices in the workspace, one strided
batched GEMM (cuBLAS) with the filter matrix straight into the output; the filter gradient regroups the output
gradient by channel and makes one GEMM per chunk, accumulating over chunks in the GEMM itself (beta = 1); the input
gradient is a batched GEMM then col2im gathering per input element (no atomics: deterministic). The device needs no
more scratch per sample than the CPU kernels, so the workspace the plan gives is enough, often for larger chunks.

Modules, by op family: `arrays` (the device, `DeviceArray`, copies, launches), `elementwise`, `shape`, `conv`
(matrix products and convolution), `attention`, `pool` (pooling), `norm`, `loss`, `masks` (dropout), `allocators`.
An op runs on the device of its output; only making arrays names a device (`asarray`, `zeros` and `allocator` take
`device=`). `on(device)` is the backend with one device behind it (what the host emulator's tests use);
`deepdsl_runtime.cuda` is the one with the process's GPU behind it.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

from deepdsl_runtime.contract import out_size
from deepdsl_runtime.cuda.allocators import allocator
from deepdsl_runtime.cuda.attention import attention, attention_grad
from deepdsl_runtime.cuda.arrays import Device, DeviceArray, asarray, scalar, to_numpy, zeros
from deepdsl_runtime.cuda.conv import conv2d, conv2d_bwd_data, conv2d_bwd_filter, matmul
from deepdsl_runtime.cuda.elementwise import (all_sum, broadcast_to, const, copy, ew, ew_and_sum, ew_many, ew_pair,
                                             ew_sum, reshape, sum_to)
from deepdsl_runtime.cuda.loss import label_rank, log_softmax, pick, precision, softmax, unpick
from deepdsl_runtime.cuda.masks import bernoulli, bernoulli_mask, equal
from deepdsl_runtime.cuda.norm import layer_norm, layer_norm_grad, layer_norm_param_grad, lrn, lrn_bwd
from deepdsl_runtime.cuda.pool import avg_pool, avg_pool_bwd, max_pool, max_pool_argmax, max_pool_bwd
from deepdsl_runtime.cuda.shape import concat, gather_rows, pad_axis, scatter_rows, slice, transpose

__all__ = [
    "DEVICE", "DeviceArray", "Device", "all_sum", "allocator", "asarray", "attention", "attention_grad", "avg_pool",
    "avg_pool_bwd", "bernoulli", "bernoulli_mask", "broadcast_to", "concat", "const", "conv2d", "conv2d_bwd_data",
    "conv2d_bwd_filter", "copy", "equal", "ew", "ew_and_sum", "ew_many", "ew_pair", "ew_sum", "gather_rows",
    "label_rank",
    "layer_norm", "layer_norm_grad", "layer_norm_param_grad", "log_softmax", "lrn", "lrn_bwd", "matmul", "max_pool", "max_pool_argmax", "max_pool_bwd", "out_size", "pad_axis",
    "pick", "precision", "reshape", "scalar", "scatter_rows", "slice", "softmax", "sum_to", "to_numpy", "transpose",
    "unpick", "zeros", "on",
]

DEVICE = "cuda"
_MAKERS = ("asarray", "zeros", "allocator")     # the functions that make arrays: they take the device


def on(device: Device) -> SimpleNamespace:
    """The backend with `device` behind it: every op, and `asarray`, `zeros`, `allocator` making their arrays on
    `device` (also its attribute `device`)."""
    here = globals()
    names = {name: here[name] for name in __all__ if name != "on"}
    names.update({name: functools.partial(here[name], device=device) for name in _MAKERS})
    return SimpleNamespace(device=device, **names)
