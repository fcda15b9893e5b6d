"""The CPU backend: every op of the IR as a numpy function that writes its result into an explicit buffer.

The op contract, shared by every backend module (`deepdsl_runtime.cpu` here, a CUDA module with the same names):
- `op(*inputs, out=..., **attrs)`: inputs are positional in the IR's order, attributes are keywords named as in
  the IR, and the result is written into `out`, entirely (callers hand out recycled buffers with stale contents).
- Ops that need scratch memory take `workspace=`, a 1-D float32 buffer whose size the compiler chose
  (the op's `workspace` rule, `deepdsl.ops`, from the scratch per sample `deepdsl_runtime.contract` states, which
  the kernel here reads too); they carve it up in a fixed order and never allocate tensor-sized memory themselves.
  Convolutions process as many samples at a time as their workspace holds (im2col chunks), so a smaller workspace
  trades speed for memory without changing results. Without a workspace an op allocates its
  own scratch (handy interactively, never done by generated programs).
- Small per-row temporaries (a max or a sum per example) may be allocated by numpy.
- `reshape` is a view and has no `out`, and so is a `slice` called without one; `ew(kernel, out, *args)` runs an elementwise kernel the compiler wrote,
  `ew_pair((kernel, out, *args), (kernel, out, *args))` two of them in one pass (the second reads the first's out),
  `ew_and_sum` the same with the second summed (as `ew_sum`), `ew_many(kernel, (out, *args), ...)` one of them on
  several sets of operands in one call.
- The ops that multiply matrices (matmul and the three convolutions) take `gemm=`, the function computing each
  product `gemm(a, b, out=c)` (c = a @ b, 2-D or batched as numpy's matmul; operands may be transposed views):
  `np.matmul` by default. `with_gemm(gemm)` is this backend with another one bound, such as the tiled
  multi-device GEMM (`deepdsl_runtime.gemm.products.TiledProducts`).

Convolution is im2col + GEMM (Torch7's scheme): a strided view of the (zero-padded) input is copied into the
workspace as a (C*kh*kw, samples*Ho*Wo) matrix and multiplied by the (O, C*kh*kw) filter matrix, in one product for
small output planes, per sample for large ones. 1x1 convolutions with stride 1 need no copy at all.

Kernels run the batch in chunks of samples: as many as the workspace holds, and no more than keep about
`CACHE_BYTES` of data per chunk, so that a kernel's several passes over its scratch (an im2col matrix, then its
product; pooling windows one offset at a time) find it in the cache. Every float is float32: scalars enter ufuncs
as Python floats or float32 (numpy keeps the array's precision), and no kernel upcasts.

Modules, by op family: `transfer` (host <-> device), `scratch` (chunking and workspaces), `conv`, `pool`
(pooling), `norm`, `loss`, `shape`, `linalg`, `attention`, `elementwise`, `masks` (dropout); this package's
namespace is the backend: every op of `__all__` is importable from here.
"""
from __future__ import annotations

import functools
import types

from deepdsl_runtime.contract import out_size
from deepdsl_runtime.cpu.attention import attention, attention_grad
from deepdsl_runtime.cpu.conv import conv2d, conv2d_bwd_data, conv2d_bwd_filter
from deepdsl_runtime.cpu.elementwise import const, copy, ew, ew_and_sum, ew_many, ew_pair, ew_sum
from deepdsl_runtime.cpu.linalg import matmul
from deepdsl_runtime.cpu.loss import label_rank, log_softmax, pick, precision, softmax, unpick
from deepdsl_runtime.cpu.masks import bernoulli, bernoulli_mask, equal
from deepdsl_runtime.cpu.norm import layer_norm, layer_norm_grad, layer_norm_param_grad, lrn, lrn_bwd
from deepdsl_runtime.cpu.pool import avg_pool, avg_pool_bwd, max_pool, max_pool_argmax, max_pool_bwd
from deepdsl_runtime.cpu.pool import avg_pool_divisor  # noqa: F401  (public, not an op)
from deepdsl_runtime.cpu.shape import (broadcast_to, concat, gather_rows, pad_axis, reshape, scatter_rows, slice,
                                       sum_to, transpose)
from deepdsl_runtime.cpu.transfer import all_sum, asarray, scalar, to_numpy, zeros

__all__ = [
    "DEVICE", "all_sum", "asarray", "attention", "attention_grad", "avg_pool", "avg_pool_bwd", "bernoulli",
    "bernoulli_mask", "broadcast_to", "concat", "const", "conv2d", "conv2d_bwd_data", "conv2d_bwd_filter", "copy",
    "ew", "ew_and_sum", "ew_many", "ew_pair", "equal", "ew_sum", "gather_rows", "label_rank", "layer_norm",
    "layer_norm_grad", "layer_norm_param_grad", "log_softmax", "lrn", "lrn_bwd",
    "matmul", "max_pool", "max_pool_argmax", "max_pool_bwd", "out_size", "pad_axis", "pick", "precision", "reshape",
    "scalar", "scatter_rows", "slice", "softmax", "sum_to", "to_numpy", "transpose", "unpick", "zeros",
]

DEVICE = "cpu"
_PRODUCTS = ("matmul", "conv2d", "conv2d_bwd_data", "conv2d_bwd_filter", "attention", "attention_grad")
_COMPILED = ("conv2d", "conv2d_bwd_data", "conv2d_bwd_filter", "layer_norm", "layer_norm_grad",
             "layer_norm_param_grad", "lrn", "lrn_bwd", "max_pool", "max_pool_argmax", "avg_pool", "avg_pool_bwd",
             "max_pool_bwd", "ew", "ew_and_sum", "ew_many", "ew_pair", "ew_sum", "sum_to", "gather_rows",
             "scatter_rows",
             "label_rank", "equal", "attention", "attention_grad", "bernoulli", "matmul",
             "transpose", "log_softmax")


def backend(native=None, gemm=None) -> types.SimpleNamespace:
    """This backend (every name of `__all__`) with the ops of `_PRODUCTS` computing their matrix products by
    `gemm(a, b, out=c)` instead of `np.matmul` (the tiled GEMM), and those of `_COMPILED` running the compiled
    kernels `native` has (`deepdsl_runtime.cpu.native`): what a generated program's `rt` is. Its `with_gemm` keeps
    the compiled kernels; `native` is the `Native` (or None). Without a `gemm`, the products run on the compiled
    kernels' threads where `native` computes them (`Native.gemm`), else by np.matmul (a program passes numpy's
    products on its threads, `linalg.Products`)."""
    names = {name: globals()[name] for name in __all__}
    if gemm is None and native is not None and native.products:
        gemm = native.gemm
    if gemm is not None:
        names.update({name: functools.partial(names[name], gemm=gemm) for name in _PRODUCTS})
    if native is not None:
        names.update({name: functools.partial(names[name], native=native) for name in _COMPILED})
    return types.SimpleNamespace(**names, native=native, with_gemm=lambda g: backend(native, g))


def with_gemm(gemm) -> types.SimpleNamespace:
    """This backend with its matrix products computed by `gemm` (`backend(gemm=gemm)`)."""
    return backend(gemm=gemm)
