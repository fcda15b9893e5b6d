"""Matrix products on the CPU: `matmul` through the backend's `gemm` function (batched as numpy's matmul), and
`Products`, the numpy backend's `gemm`: numpy's matmul on parts fixed by the shapes, on threads of a pool."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from deepdsl_runtime import contract

__all__ = ["matmul", "Products"]


def matmul(a, b, bias=None, *, out, ta=False, tb=False, workspace=None, gemm=np.matmul, native=None):
    """out = op(a) op(b) (+ bias, (n,), added to every row of a 2-D product); with the compiled products and a
    `workspace`, a single product with a small output and a long inner dimension in parts of it
    (`Native.gemm_in_depth`); with them and a bias, the bias added as the product is stored (`Native.gemm_bias`).
    Else the bias is added after the product: the same bits."""
    a, b = a.swapaxes(-1, -2) if ta else a, b.swapaxes(-1, -2) if tb else b
    compiled = native is not None and gemm == native.gemm
    if not (workspace is not None and compiled and native.gemm_in_depth(a, b, out, workspace)):
        if bias is not None and compiled and native.gemm_bias(a, b, out, bias):
            return
        gemm(a, b, out=out)
    if bias is not None:
        np.add(out, bias, out=out)


class Products:
    """out = a @ b as `np.matmul(a, b, out=out)` computes it, numpy's BLAS on one thread, each product cut into the
    parts `contract.product_cuts` fixes by its shape (as the compiled kernels' `Native.gemm` cuts what it gives the
    BLAS) and the parts computed on `threads` threads (numpy releases the interpreter during a product): the same
    bits on any number of threads, where numpy's BLAS on several threads would cut each product by their number.
    What cuts nothing (one part, an output over an operand, fewer than two axes) runs np.matmul as it is."""

    def __init__(self, threads: int = 1):
        self.threads = 1
        self._pool: ThreadPoolExecutor | None = None
        self.set_threads(threads)

    def set_threads(self, threads: int) -> None:
        """Compute the parts on `threads` threads from now on (no result depends on them)."""
        threads = max(1, int(threads))
        if threads == self.threads:
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="deepdsl-products") if threads > 1 else None

    def __call__(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        if a.ndim < 2 or b.ndim < 2 or out.ndim < 2 or np.may_share_memory(out, a) or np.may_share_memory(out, b):
            return np.matmul(a, b, out=out)
        m, k = a.shape[-2:]
        n = out.shape[-1]
        lead = out.shape[:-2]
        batch = math.prod(lead)
        by_columns, parts, width = contract.product_cuts(batch, m, n, k)
        if batch * parts <= 1 or 0 in (m, n, k):
            return np.matmul(a, b, out=out)
        stack_a = np.broadcast_to(a, (*lead, m, k))
        stack_b = np.broadcast_to(b, (*lead, k, n))
        side = n if by_columns else m
        items = [(index, slice(first, min(first + width, side)))
                 for index in np.ndindex(*lead) for first in range(0, side, width)]

        def compute(share) -> None:
            for index, cut in share:
                ai, bi, oi = stack_a[index], stack_b[index], out[index]
                if by_columns:
                    np.matmul(ai, bi[:, cut], out=oi[:, cut])
                else:
                    np.matmul(ai[cut], bi, out=oi[cut])

        if self._pool is None or len(items) < 2:
            compute(items)
            return out
        per = -(-len(items) // self.threads)
        shares = [items[i:i + per] for i in range(0, len(items), per)]
        for done in [self._pool.submit(compute, share) for share in shares]:
            done.result()
        return out
