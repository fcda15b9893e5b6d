"""Matrix products on the CPU: `matmul` through the backend's `gemm` function (batched as numpy's matmul)."""
from __future__ import annotations

import numpy as np


def matmul(a, b, *, out, ta=False, tb=False, gemm=np.matmul):
    gemm(a.swapaxes(-1, -2) if ta else a, b.swapaxes(-1, -2) if tb else b, out=out)
