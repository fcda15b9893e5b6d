"""Masks on the CUDA device: dropout's random ones (the CPU backend's Bernoulli mask) and equality masks."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cuda.arrays import launch_items

bernoulli_mask = contract.bernoulli_mask      # the mask the compiler's reference semantics draw


def bernoulli(*, out, shape, keep, key, seed, step, workspace=None):
    """out = 1 with probability `keep`: the same counter-based stream as the CPU backend (Philox4x64-10 keyed by
    (seed, `contract.counter_key(step, key)`)), so the mask equals the CPU's bit for bit; each thread makes 8
    bytes."""
    n = out.size
    groups = -(-n // 8)
    launch_items(out.device, "deepdsl_bernoulli", "IIQQfP", groups, groups, n, int(seed),
                 contract.counter_key(step, key), np.float32(keep), out.ptr)


def equal(x, *, out, value):
    """out = 1 where x (int32 tokens or float32) equals `value`, else 0."""
    kernel = "deepdsl_equal_i32" if x.dtype == np.int32 else "deepdsl_equal_f32"
    launch_items(out.device, kernel, "IPfP", out.size, out.size, x.ptr, np.float32(value), out.ptr)
