"""Matrix multiply (fully connected layers, attention): `op(A) @ op(B)` with op = transpose of the last two axes when
`ta`/`tb` is set; A and B 2-D, or both with the same leading (batch) axes: one product per batch index. A 2-D
product may take a third input, a bias (n,) added to every row of its result (`deepdsl.passes.fuse_epilogue` gives
it a fully connected layer's bias: the runtime adds it as the product's outputs are stored)."""
from __future__ import annotations

import numpy as np

import math

from deepdsl.ir import FLOAT, Node, make
from deepdsl.ops import Op, Workspace, dims, register, require
from deepdsl.ops.elementwise import sum_to
from deepdsl_runtime import contract
from deepdsl_runtime.contract import FLOAT_BYTES


@register
class MatMul(Op):
    name = "matmul"

    def infer(self, a: Node, b: Node, bias: Node | None = None, *, ta=False, tb=False):
        require(len(a.shape) >= 2 and len(a.shape) == len(b.shape) and a.shape[:-2] == b.shape[:-2],
                f"matmul of {dims(a.shape)} and {dims(b.shape)} (2-D, or the same leading batch axes)")
        m, k = a.shape[-1:-3:-1] if ta else a.shape[-2:]
        k2, n = b.shape[-1:-3:-1] if tb else b.shape[-2:]
        require(k == k2, f"inner sizes differ: {dims(a.shape)}{'ᵀ' if ta else ''} @ {dims(b.shape)}{'ᵀ' if tb else ''}")
        if bias is not None:
            require(len(a.shape) == 2 and bias.shape == (n,) and bias.dtype == FLOAT,
                    f"a product's bias is {dims(bias.shape)}: a 2-D product of {n} columns takes ({n},)")
        return (*a.shape[:-2], m, n), FLOAT

    def vjp(self, node, g):
        a, b = node.inputs[:2]
        ta, tb = node.attr("ta", False), node.attr("tb", False)
        # C = op(A) op(B) (+ bias):  dop(A) = G op(B)^T,  dop(B) = op(A)^T G,  dbias = G summed over the rows
        ga = matmul(b, g, ta=tb, tb=True) if ta else matmul(g, b, ta=False, tb=not tb)
        gb = matmul(g, a, ta=True, tb=ta) if tb else matmul(a, g, ta=not ta, tb=False)
        if len(node.inputs) == 3:
            return ga, gb, sum_to(g, node.inputs[2].shape)
        return ga, gb

    def evaluate(self, ctx, a, b, bias=None, *, ta=False, tb=False):
        product = np.asarray((a.swapaxes(-1, -2) if ta else a) @ (b.swapaxes(-1, -2) if tb else b),
                             dtype=ctx.float_dtype)
        return product if bias is None else np.asarray(product + bias, dtype=ctx.float_dtype)

    def flops(self, node):
        return 2 * node.size * _inner(node) + (node.size if len(node.inputs) == 3 else 0)

    def workspace(self, node, limit=None):
        """The compiled kernels' partial products of a depth cut (`contract.product_depth_scratch`: a single
        product with a small output and a long inner dimension, on several threads), none beyond `limit` (then
        the product is not cut)."""
        nbytes = FLOAT_BYTES * contract.product_depth_scratch(math.prod(node.shape[:-2]), *node.shape[-2:],
                                                              _inner(node), node.attr("ta", False),
                                                              node.attr("tb", False))
        return Workspace(nbytes if limit is None or nbytes <= limit else 0)

    def describe(self, node):
        ta, tb = node.attr("ta", False), node.attr("tb", False)
        return "matmul" + ("[" + ",".join(n for n, f in (("ta", ta), ("tb", tb)) if f) + "]" if ta or tb else "")


def _inner(node: Node) -> int:
    """The inner (summed) size of a matmul node's product."""
    a = node.inputs[0]
    return a.shape[-2] if node.attr("ta", False) else a.shape[-1]


def matmul(a: Node, b: Node, ta: bool = False, tb: bool = False) -> Node:
    attrs = {}
    if ta:
        attrs["ta"] = True
    if tb:
        attrs["tb"] = True
    return make("matmul", (a, b), **attrs)
