"""Random masks on the CPU (dropout): a Bernoulli mask from (seed, step, key), the same on every backend."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch, sample_chunks

bernoulli_mask = contract.bernoulli_mask      # the mask the compiler's reference semantics draw


def bernoulli(*, out, shape, keep, key, seed, step, workspace=None, native=None):
    """out = 1 with probability `keep`, from the counter-based stream (seed, step, key): reproducible and
    independent of what ran before, so resuming a run draws the same masks. The compiled kernel, where the program
    has it, makes the same bytes from the same generator (kernels/deepdsl_random.h) on the kernels' threads,
    without the workspace."""
    if native is not None and native.bernoulli(out, seed, contract.counter_key(step, key), keep):
        return
    rng = contract.mask_generator(seed, step, key)
    rows = out.reshape(tuple(shape) or (1,))           # a scalar mask as one row
    per = contract.bernoulli_scratch(shape)
    for a, b in sample_chunks(rows.shape[0], workspace, per, 2 * per):   # consecutive draws: the same stream
        draws = Scratch(workspace).take((b - a,) + rows.shape[1:])
        rng.random(dtype=np.float32, out=draws)
        np.less(draws, keep, out=rows[a:b])


def equal(x, *, out, value, native=None):
    """out = 1 where x equals `value`, else 0 (a uint8 mask)."""
    if native is not None and native.equal_tokens(x, value, out):
        return
    np.equal(x, value, out=out.view(np.bool_))
