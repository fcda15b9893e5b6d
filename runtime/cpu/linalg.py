"""Matrix products on the CPU: `matmul` through the backend's `gemm` function."""
from __future__ import annotations

import numpy as np


def matmul(a, b, *, out, ta=False, tb=False, gemm=np.matmul):
    gemm(a.T if ta else a, b.T if tb else b, out=out)
