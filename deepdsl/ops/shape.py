"""Joining and splitting tensors along an axis (inception modules concatenate branches along channels), swapping
two axes (attention's heads and tokens), and taking rows of a table by index (token embeddings) with the sum back
into them (their gradient)."""
from __future__ import annotations

import math

import numpy as np
from deepdsl_runtime.contract import ALIGNMENT

from deepdsl.ir import INT32, ITEMSIZE, Node, make
from deepdsl.ops import Op, dims, register, require


@register
class Concat(Op):
    name = "concat"

    def infer(self, *inputs: Node, axis):
        require(len(inputs) >= 1, "concat of nothing")
        first = inputs[0].shape
        require(all(len(i.shape) == len(first) for i in inputs),
                "concat of tensors of different ranks: " + ", ".join(dims(i.shape) for i in inputs))
        require(all(i.shape[:axis] + i.shape[axis + 1:] == first[:axis] + first[axis + 1:] for i in inputs),
                f"concat along axis {axis} of tensors whose other sizes differ: "
                + ", ".join(dims(i.shape) for i in inputs))
        require(len({i.dtype for i in inputs}) == 1, "concat of tensors of different dtypes")
        total = sum(i.shape[axis] for i in inputs)
        return first[:axis] + (total,) + first[axis + 1:], inputs[0].dtype

    def vjp(self, node, g):
        axis = node.attr("axis")
        result, start = [], 0
        for x in node.inputs:
            stop = start + x.shape[axis]
            result.append(slice_axis(g, axis, start, stop))
            start = stop
        return tuple(result)

    def evaluate(self, ctx, *args, axis):
        return np.concatenate(args, axis=axis)


@register
class Slice(Op):
    """`x[..., start:stop, ...]` along `axis`."""

    name = "slice"

    def infer(self, x: Node, *, axis, start, stop):
        require(0 <= start < stop <= x.shape[axis], f"slice {start}:{stop} out of axis {axis} of {dims(x.shape)}")
        return x.shape[:axis] + (stop - start,) + x.shape[axis + 1:], x.dtype

    def aliases(self, node: Node) -> bool:
        """A view where the slice is one block of its input (every axis before `axis` of size 1) starting on the
        arena's alignment, as every buffer does: a packed gradient's parts (attention's), a row of a layer norm's
        parameter gradients. Other slices copy."""
        x, axis = node.inputs[0], node.attr("axis")
        return math.prod(x.shape[:axis]) == 1 and self.view_offset(node) % ALIGNMENT == 0

    def view_offset(self, node: Node) -> int:
        x, axis = node.inputs[0], node.attr("axis")
        return node.attr("start") * math.prod(x.shape[axis + 1:]) * ITEMSIZE[x.dtype]

    def vjp(self, node, g):
        x = node.inputs[0]
        return (make("pad_axis", (g,), axis=node.attr("axis"), start=node.attr("start"), size=x.shape[node.attr("axis")]),)

    def evaluate(self, ctx, x, *, axis, start, stop):
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        return np.ascontiguousarray(x[tuple(index)])


@register
class PadAxis(Op):
    """Place `x` at `start` of a zero tensor whose `axis` has `size` entries (the VJP of `slice`)."""

    name = "pad_axis"

    def infer(self, x: Node, *, axis, start, size):
        require(0 <= start and start + x.shape[axis] <= size, f"pad_axis does not fit {dims(x.shape)}")
        return x.shape[:axis] + (size,) + x.shape[axis + 1:], x.dtype

    def vjp(self, node, g):
        x = node.inputs[0]
        a, s = node.attr("axis"), node.attr("start")
        return (slice_axis(g, a, s, s + x.shape[a]),)

    def evaluate(self, ctx, x, *, axis, start, size):
        shape = list(x.shape)
        shape[axis] = size
        out = np.zeros(shape, dtype=x.dtype)
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + x.shape[axis])
        out[tuple(index)] = x
        return out


@register
class Transpose(Op):
    """`x` with its axes `axes` = (i, j), i < j, swapped (torch.transpose), stored in the new order."""

    name = "transpose"
    cheap = True

    def infer(self, x: Node, *, axes):
        i, j = axes
        require(0 <= i < j < len(x.shape), f"transpose of axes {i} and {j} of a tensor of {dims(x.shape)}")
        shape = list(x.shape)
        shape[i], shape[j] = shape[j], shape[i]
        return tuple(shape), x.dtype

    def vjp(self, node, g):
        return (make("transpose", (g,), axes=node.attr("axes")),)

    def evaluate(self, ctx, x, *, axes):
        return np.ascontiguousarray(x.swapaxes(*axes))


def transpose(x: Node, i: int, j: int) -> Node:
    """x with axes i and j swapped (the identity when they are equal)."""
    if i == j:
        return x
    return make("transpose", (x,), axes=(min(i, j), max(i, j)))


def concat(inputs, axis: int = 1) -> Node:
    inputs = tuple(inputs)
    return inputs[0] if len(inputs) == 1 else make("concat", inputs, axis=axis)


def slice_axis(x: Node, axis: int, start: int, stop: int) -> Node:
    if start == 0 and stop == x.shape[axis]:
        return x
    return make("slice", (x,), axis=axis, start=start, stop=stop)


def _check_ids(ids: Node, what: str):
    require(ids.dtype == INT32 and len(ids.shape) == 1, f"{what} takes a vector of int32 row numbers, got "
                                                         f"{ids.dtype} {dims(ids.shape)}")


@register
class GatherRows(Op):
    """out[m] = table[ids[m]]: rows of a (V, D) table (a token embedding's lookup); a row number outside [0, V)
    gives a row of NaN."""

    name = "gather_rows"

    def infer(self, table: Node, ids: Node):
        require(len(table.shape) == 2, f"gather_rows takes a (rows, features) table, got {dims(table.shape)}")
        _check_ids(ids, "gather_rows")
        return (ids.shape[0], table.shape[1]), table.dtype

    def vjp(self, node, g):
        table, ids = node.inputs
        return make("scatter_rows", (g, ids), rows=table.shape[0]), None

    def evaluate(self, ctx, table, ids):
        valid = (ids >= 0) & (ids < table.shape[0])
        out = np.full((len(ids), table.shape[1]), np.nan, dtype=ctx.float_dtype)
        out[valid] = table[ids[valid]]
        return out

    def flops(self, node):
        return 0


@register
class ScatterRows(Op):
    """out = zeros(rows, D); out[ids[m]] += g[m] for m in order (the gradient of `gather_rows`: each row the sum of
    the gradients of its lookups, added in the order of the lookups); a row number outside [0, rows) adds nothing."""

    name = "scatter_rows"

    def infer(self, g: Node, ids: Node, *, rows):
        require(len(g.shape) == 2, f"scatter_rows takes (lookups, features) gradients, got {dims(g.shape)}")
        _check_ids(ids, "scatter_rows")
        require(ids.shape[0] == g.shape[0], f"scatter_rows of {dims(g.shape)} gradients by {dims(ids.shape)} rows")
        return (rows, g.shape[1]), g.dtype

    def vjp(self, node, g):
        return make("gather_rows", (g, node.inputs[1])), None

    def evaluate(self, ctx, g, ids, *, rows):
        out = np.zeros((rows, g.shape[1]), dtype=ctx.float_dtype)
        for m, row in enumerate(ids):           # in order: the sums the kernels compute, bit for bit
            if 0 <= row < rows:
                out[row] += g[m]
        return out

    def flops(self, node):
        return node.inputs[0].size
