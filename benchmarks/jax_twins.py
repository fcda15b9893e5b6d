"""JAX twins of the PyTorch twins (tests/support/torch_nets.py) for the side-by-side benchmarks (`cpu_vs_peers.py
--sides jax`): the twin's training loss exported with torch.export and decomposed to core ATen, each ATen op of the
graph computed with jax.numpy and jax.lax. So every network that has a PyTorch twin has a JAX twin of exactly its
layers, parameters and initial values, without a second hand-written copy of each network.

    twin = jax_twin(torch_twin, x, y)       # x, y: example batches (torch tensors) of the benchmark's shapes, or
    twin = from_description(describe(torch_twin, x, y))     # describe in a process with PyTorch, pickled
    loss, buffers = twin.loss(twin.params, twin.buffers, x, y, key)
    step = twin.sgd_step(lr, momentum, decay)   # jitted: (params, velocity, buffers, x, y, key) -> the next three

The graph is the twin in training mode: batch norm normalizes by the batch's statistics and returns its running
statistics updated (PyTorch's momentum and unbiased variance), carried as `buffers`; dropout draws its mask from the
JAX key given to the loss (folded with the op's place in the graph); the SGD step is PyTorch's (`torch.optim.SGD`
with momentum and weight decay: v = momentum v + g + decay p, p = p - lr v). Integer tensors are int32 (JAX's
default). An ATen op the table below does not know stops `from_description` with UnknownOp naming it.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from deepdsl_runtime import contract


class UnknownOp(Exception):
    """An ATen op of the exported graph that the JAX twin has no computation for."""


def _ops():
    """{ATen op name (as `str(node.target)`): its computation with jax.numpy / jax.lax}."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
        if transposed:
            raise UnknownOp("aten.convolution (transposed)")
        y = lax.conv_general_dilated(x, w, tuple(stride), [(p, p) for p in padding], rhs_dilation=tuple(dilation),
                                     feature_group_count=groups, dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y if b is None else y + b.reshape(1, -1, 1, 1)

    def batch_norm(x, w, b, mean, var, training, momentum, eps):
        axes = (0,) + tuple(range(2, x.ndim))
        shape = (1, -1) + (1,) * (x.ndim - 2)
        if training:
            m = jnp.mean(x, axis=axes)
            v = jnp.mean(jnp.square(x - m.reshape(shape)), axis=axes)
            n = x.size // x.shape[1]
            mean = (1 - momentum) * mean + momentum * m
            var = (1 - momentum) * var + momentum * v * n / max(n - 1, 1)
        else:
            m, v = mean, var
        rstd = lax.rsqrt(v + eps)
        y = (x - m.reshape(shape)) * rstd.reshape(shape)
        if w is not None:
            y = y * w.reshape(shape)
        if b is not None:
            y = y + b.reshape(shape)
        return y, m, rstd, mean, var

    def layer_norm(x, shape, w, b, eps):
        axes = tuple(range(x.ndim - len(shape), x.ndim))
        m = jnp.mean(x, axis=axes, keepdims=True)
        rstd = lax.rsqrt(jnp.mean(jnp.square(x - m), axis=axes, keepdims=True) + eps)
        y = (x - m) * rstd
        return (y * w if w is not None else y) + (b if b is not None else 0), m, rstd

    def window(x, init, op, kernel, stride, padding, ceil_mode, dims=2):
        kernel = list(kernel) * (dims // len(kernel))
        stride = list(stride or kernel) * (dims // len(stride or kernel))
        padding = list(padding) * (dims // len(padding))
        pads = []
        for size, k, s, p in zip(x.shape[-dims:], kernel, stride, padding):
            out = contract.out_size(size, k, s, p, ceil_mode)       # PyTorch's rule, ceil mode's last window too
            pads.append((p, (out - 1) * s + k - size - p))
        lead = x.ndim - dims
        return lax.reduce_window(x, init, op, (1,) * lead + tuple(kernel), (1,) * lead + tuple(stride),
                                 [(0, 0)] * lead + pads), kernel, pads

    def max_pool(x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
        if any(d != 1 for d in dilation):
            raise UnknownOp("aten.max_pool2d_with_indices (dilated)")
        return window(x, -jnp.inf, lax.max, kernel, stride, padding, ceil_mode)[0], None

    def avg_pool(dims):
        def pool(x, kernel, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor=None):
            total, kernel, pads = window(x, 0.0, lax.add, kernel, stride, padding, ceil_mode, dims)
            if divisor:
                return total / divisor
            if count_include_pad and not ceil_mode:
                return total / math.prod(kernel)
            ones = jnp.ones(x.shape[-dims:], x.dtype)
            if count_include_pad:     # the input's padding counts, not what ceil mode adds past it
                ones = jnp.pad(ones, [(p, p) for p in padding * (dims // len(padding))], constant_values=1.0)
                pads = [(0, hi - lo) for lo, hi in pads]
            count = lax.reduce_window(ones, 0.0, lax.add, tuple(kernel), tuple(stride or kernel), pads)
            return total / count
        return pool

    def constant_pad(x, pad, value=0.0):
        widths = [(0, 0)] * x.ndim
        for i in range(len(pad) // 2):
            widths[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
        return jnp.pad(x, widths, constant_values=value)

    def expand(x, sizes):
        lead = len(sizes) - x.ndim
        return jnp.broadcast_to(x, tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(sizes)))

    def dropout(x, p, train, *, key):
        if not train or p == 0:
            return x, jnp.ones_like(x, dtype=jnp.bool_)
        keep = jax.random.bernoulli(key, 1 - p, x.shape)
        return jnp.where(keep, x / (1 - p), 0.0), keep

    def hardtanh(x, low=-1.0, high=1.0):
        """PyTorch's: a gradient of 1 strictly inside (low, high), 0 elsewhere (clip's splits it at the ends)."""
        return jnp.where((x > low) & (x < high), x, jnp.where(x <= low, low, high).astype(x.dtype))

    def squeeze(x, dims):
        dims = [d % x.ndim for d in dims]
        return jnp.squeeze(x, tuple(d for d in dims if x.shape[d] == 1))

    return {
        "aten.convolution.default": convolution,
        "aten._native_batch_norm_legit_functional.default": batch_norm,
        "aten.native_layer_norm.default": layer_norm,
        "aten.max_pool2d_with_indices.default": max_pool,
        "aten.avg_pool2d.default": avg_pool(2),
        "aten.avg_pool3d.default": avg_pool(3),
        "aten.constant_pad_nd.default": constant_pad,
        "aten.add.Tensor": lambda a, b, alpha=1: a + (b if alpha == 1 else alpha * b),
        "aten.sub.Tensor": lambda a, b, alpha=1: a - (b if alpha == 1 else alpha * b),
        "aten.mul.Tensor": operator.mul,
        "aten.div.Tensor": operator.truediv,
        "aten.neg.default": operator.neg,
        "aten.log.default": jnp.log,
        "aten.exp.default": jnp.exp,
        "aten.sqrt.default": jnp.sqrt,
        "aten.rsqrt.default": lax.rsqrt,
        "aten.pow.Tensor_Scalar": lambda x, e: x ** e,
        "aten.relu.default": jax.nn.relu,
        "aten.hardtanh.default": hardtanh,
        "aten.gelu.default": lambda x, approximate="none": jax.nn.gelu(x, approximate=approximate == "tanh"),
        "aten.tanh.default": jnp.tanh,
        "aten.sigmoid.default": jax.nn.sigmoid,
        "aten._softmax.default": lambda x, dim, half_to_float=False: jax.nn.softmax(x, axis=dim),
        "aten._log_softmax.default": lambda x, dim, half_to_float=False: jax.nn.log_softmax(x, axis=dim),
        "aten.mean.dim": lambda x, dims, keepdim=False, dtype=None: jnp.mean(
            x, axis=tuple(dims) if dims else None, keepdims=keepdim),
        "aten.sum.dim_IntList": lambda x, dims, keepdim=False, dtype=None: jnp.sum(     # no dims: all of them
            x, axis=tuple(dims) if dims else None, keepdims=keepdim),
        "aten.addmm.default": lambda bias, a, b, beta=1, alpha=1: beta * bias + alpha * (a @ b),
        "aten.mm.default": operator.matmul,
        "aten.bmm.default": operator.matmul,
        "aten.view.default": jnp.reshape,
        "aten._unsafe_view.default": jnp.reshape,
        "aten.reshape.default": jnp.reshape,
        "aten.permute.default": jnp.transpose,
        "aten.expand.default": expand,
        "aten.clone.default": lambda x, memory_format=None: x,
        "aten.unsqueeze.default": jnp.expand_dims,
        "aten.squeeze.dims": squeeze,
        "aten.squeeze.dim": lambda x, d: squeeze(x, [d]),
        "aten.native_dropout.default": dropout,
        "aten.embedding.default": lambda w, ids, padding_idx=-1, scale=False, sparse=False: w[ids],
        "aten.gather.default": lambda x, dim, index, sparse_grad=False: jnp.take_along_axis(x, index, axis=dim),
        "aten.ne.Scalar": operator.ne,
        "aten.ge.Scalar": operator.ge,
        "aten.logical_and.default": jnp.logical_and,
        "aten.where.self": jnp.where,
        "aten.scalar_tensor.default": lambda v, dtype=None, layout=None, device=None, pin_memory=None: jnp.asarray(
            v, dtype_of(dtype, jnp.float32)),
        "aten.full.default": lambda size, v, dtype=None, layout=None, device=None, pin_memory=None: jnp.full(
            tuple(size), v, dtype_of(dtype, jnp.float32)),
        "aten.arange.start_step": lambda start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None:
            jnp.arange(start, end, step, dtype_of(dtype, jnp.int32)),
        "aten._to_copy.default": lambda x, dtype=None, layout=None, device=None, pin_memory=None,
            non_blocking=False, memory_format=None: x if dtype is None else x.astype(dtype_of(dtype)),
        "<built-in function getitem>": operator.getitem,
    }


def dtype_of(name, default=None):
    """JAX's dtype for a torch dtype's name ("float32", "int64", ...: 64-bit integers as int32, JAX's default;
    `default` for None)."""
    import jax.numpy as jnp
    if name is None:
        return default
    return {"float32": jnp.float32, "float64": jnp.float32, "int64": jnp.int32, "int32": jnp.int32,
            "bool": jnp.bool_}[name]


@dataclass
class JaxTwin:
    """A twin's training loss as a JAX function, its parameters and buffers (JAX arrays by their PyTorch names)."""

    loss: Callable[..., Any]            # (params, buffers, x, y, key) -> (loss, the buffers after the step)
    params: dict
    buffers: dict

    def sgd_step(self, lr: float, momentum: float, decay: float):
        """The jitted training step: (params, velocity, buffers, x, y, key) -> (params, velocity, buffers, loss),
        PyTorch's SGD with momentum and weight decay."""
        import jax

        loss = self.loss

        @jax.jit
        def step(params, velocity, buffers, x, y, key):
            (value, buffers), grads = jax.value_and_grad(loss, has_aux=True)(params, buffers, x, y, key)
            velocity = {k: momentum * velocity[k] + grads[k] + decay * params[k] for k in params}
            return {k: params[k] - lr * velocity[k] for k in params}, velocity, buffers, value

        return step


def _loss_module(twin):
    """The twin's `loss(x, y)` as the module torch.export takes."""
    import torch

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.twin = twin

        def forward(self, x, y):
            return self.twin.loss(x, y)

    return Loss()


def describe(twin, x, y) -> dict:
    """The twin's training loss in training mode, exported on the example batches x, y (torch tensors) and
    decomposed to core ATen, as plain data a process without PyTorch reads (`from_description`): the graph's nodes
    (name, op, target, arguments: a node as ("node", name), a dtype as ("dtype", name)), where each placeholder's
    value comes from, which outputs update which buffers, and the parameters' and buffers' values (numpy arrays,
    the twin's values as they are now; a module registered twice is one tensor, under its first name)."""
    import torch
    from torch.export.graph_signature import InputKind, OutputKind

    twin.train()
    module = _loss_module(twin)
    program = torch.export.export(module, (x, y)).run_decompositions()
    signature, graph = program.graph_signature, program.graph
    state = {**program.constants, **module.state_dict(keep_vars=True)}
    places: dict[str, tuple[str, str]] = {}
    arrays: dict[str, dict[str, np.ndarray]] = {"params": {}, "buffers": {}}
    names: dict[tuple, str] = {}
    users = 0
    for spec in signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            value = state[spec.target].detach()
            name = names.setdefault((value.data_ptr(), tuple(value.shape)), spec.target)
            kind = "params" if spec.kind == InputKind.PARAMETER else "buffers"
            places[spec.arg.name] = (kind, name)
            arrays[kind][name] = np.array(value.numpy())        # a copy: the twin's own tensors may change
        elif spec.kind == InputKind.USER_INPUT:
            places[spec.arg.name] = ("inputs", str(users))
            users += 1
        else:
            raise UnknownOp(f"an input of kind {spec.kind}")
    aliases = {spec.target: places[spec.arg.name][1] for spec in signature.input_specs if spec.target in state}

    def encode(a):
        if isinstance(a, torch.fx.Node):
            return ("node", a.name)
        if isinstance(a, (list, tuple)):
            return [encode(b) for b in a]
        if isinstance(a, torch.dtype):
            return ("dtype", str(a).removeprefix("torch."))
        if isinstance(a, (torch.layout, torch.device, torch.memory_format)):
            return None
        return a

    nodes = [(node.name, node.op, str(node.target), encode(list(node.args)),
              {k: encode(v) for k, v in node.kwargs.items()}) for node in graph.nodes
             if node.op in ("placeholder", "call_function")]
    return {"nodes": nodes, "places": places, **arrays,
            "mutated": {spec.arg.name: aliases[spec.target] for spec in signature.output_specs
                        if spec.kind == OutputKind.BUFFER_MUTATION},
            "loss": next(spec.arg.name for spec in signature.output_specs if spec.kind == OutputKind.USER_OUTPUT)}


def from_description(description: dict) -> JaxTwin:
    """The JAX twin of a `describe`d twin (this process need not have PyTorch); raises UnknownOp naming an ATen op
    it has no computation for."""
    import jax
    import jax.numpy as jnp

    ops = _ops()
    places, mutated, nodes = description["places"], description["mutated"], description["nodes"]
    for _, op, target, _, _ in nodes:
        if op == "call_function" and target not in ops:
            raise UnknownOp(target)
    params = {k: jnp.asarray(v, dtype_of(str(v.dtype))) for k, v in description["params"].items()}
    buffers = {k: jnp.asarray(v, dtype_of(str(v.dtype))) for k, v in description["buffers"].items()}

    def loss(params, buffers, x, y, key):
        env: dict[str, Any] = {}
        inputs = {"0": x, "1": y}

        def value(a):
            if isinstance(a, tuple) and len(a) == 2 and a[0] == "node":
                return env[a[1]]
            if isinstance(a, tuple) and len(a) == 2 and a[0] == "dtype":
                return a[1]
            if isinstance(a, list):
                return [value(b) for b in a]
            return a

        for place, (name, op, target, args, kwargs) in enumerate(nodes):
            if op == "placeholder":
                kind, found = places[name]
                env[name] = {"params": params, "buffers": buffers, "inputs": inputs}[kind][found]
                continue
            args, kwargs = value(args), {k: value(v) for k, v in kwargs.items()}
            if target == "aten.native_dropout.default":
                kwargs["key"] = jax.random.fold_in(key, place)
            env[name] = ops[target](*args, **kwargs)
        after = dict(buffers)
        for name, target in mutated.items():
            after[target] = env[name].astype(buffers[target].dtype)
        return env[description["loss"]], after

    return JaxTwin(loss, params, buffers)


def jax_twin(twin, x, y) -> JaxTwin:
    """The JAX twin of a PyTorch twin (`describe`, then `from_description`, in one process)."""
    return from_description(describe(twin, x, y))


def batches(x: np.ndarray, y: np.ndarray):
    """The benchmark's numpy batches as JAX arrays (labels and tokens as int32)."""
    import jax.numpy as jnp
    return (jnp.asarray(x) if x.dtype.kind == "f" else jnp.asarray(x, jnp.int32)), jnp.asarray(y, jnp.int32)
