"""Scratch memory of each generated statement: the float32 elements of workspace it hands its runtime op.

Convolutions follow the op's own workspace rule (`Op.workspace(node, limit)`): its chunking of the batch, which
the memory plan also uses, and at least its bytes. The runtime ops (`deepdsl_runtime.cpu`) carve their workspace
in a fixed order and derive their chunk from its size; the per-sample needs below are that contract. Where the
runtime needs more than the op rule states (a zero-padded copy of the input, the output gradient transposed or
widened, the input gradient padded; pooling, LRN, log-softmax and random masks keep tensor-sized temporaries),
the statement gets the larger size. The runtime
op tests allocate exactly these sizes, so a disagreement fails there.
"""
from __future__ import annotations

from deepdsl.ir import Node
from deepdsl.ops import get_op

FLOAT_BYTES = 4


def _pool_padded(node: Node, x_shape, out_shape) -> int:
    """Elements of the padded copy pooling works on when windows leave the input (padding, ceil mode)."""
    n, c, h, w = x_shape
    ho, wo = out_shape[2:]
    k, s, p = node.attr("kernel"), node.attr("stride"), node.attr("pad", 0)
    hp, wp = (ho - 1) * s + k, (wo - 1) * s + k
    if p == 0 and hp <= h and wp <= w:
        return 0
    return n * c * max(hp, h + p) * max(wp, w + p)


def _bool_floats(count: int) -> int:
    return (count + 3) // 4


def _padded(c: int, h: int, w: int, pad: int) -> int:
    return c * (h + 2 * pad) * (w + 2 * pad) if pad else 0


def _runtime_need(node: Node, samples: int, chunks: int) -> int:
    """Float32 elements the CPU runtime op carves from its workspace when it runs `samples` samples at a time."""
    op = node.op
    if op in ("conv2d", "conv2d_bwd_data", "conv2d_bwd_filter"):
        if op == "conv2d":
            (n, c, h, w), (o, _, kh, kw) = node.inputs[0].shape, node.inputs[1].shape
        elif op == "conv2d_bwd_data":
            (n, o, _, _), (_, c, kh, kw) = node.inputs[0].shape, node.inputs[1].shape
            h, w = node.attr("size")
        else:
            (n, o, _, _), (_, c, h, w) = node.inputs[0].shape, node.inputs[1].shape
            kh, kw = node.attr("kernel")
        ho, wo = node.shape[2:] if op == "conv2d" else node.inputs[0].shape[2:]
        s, p = node.attr("stride", 1), node.attr("pad", 0)
        if kh == kw == 1 and s == 1 and p == 0 and op != "conv2d_bwd_filter":
            return 0                                   # one GEMM, no im2col
        ckk = c * kh * kw
        if op == "conv2d":
            return samples * (ckk * ho * wo + _padded(c, h, w, p))
        if op == "conv2d_bwd_filter":
            return samples * ((ckk + o) * ho * wo + _padded(c, h, w, p)) + (o * ckk if chunks > 1 else 0)
        if s == 1:                                     # rows as wide as the padded input
            wp = w + 2 * p
            return samples * ((o + ckk) * ho * wp + c * ((h + 2 * p) * wp + kw - 1))
        return samples * ckk * ho * wo
    if op in ("max_pool", "avg_pool"):
        return _pool_padded(node, node.inputs[0].shape, node.shape)
    if op == "max_pool_argmax":
        return _pool_padded(node, node.inputs[0].shape, node.shape) + node.size + _bool_floats(node.size)
    if op == "max_pool_bwd":
        g = node.inputs[0]
        overlap = node.attr("stride") < node.attr("kernel")
        return _pool_padded(node, node.shape, g.shape) + _bool_floats(g.size) + (g.size if overlap else 0)
    if op == "avg_pool_bwd":
        g = node.inputs[0]
        return _pool_padded(node, node.shape, g.shape) + g.size
    if op == "lrn":
        return 2 * node.size
    if op == "lrn_bwd":
        return 3 * node.size
    if op in ("log_softmax", "bernoulli"):
        return node.size
    return 0


def workspace_size(node: Node, limit_bytes: int | None) -> int:
    """Float32 elements of workspace for the statement computing `node` (0: the op takes none)."""
    rule = get_op(node.op).workspace(node, limit_bytes)
    batch = node.inputs[0].shape[0] if node.inputs and node.inputs[0].shape else 1
    samples = -(-batch // rule.chunks)
    return max(-(-rule.nbytes // FLOAT_BYTES), _runtime_need(node, samples, rule.chunks))
