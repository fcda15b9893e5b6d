"""Op-by-op cases of the CUDA backend against the CPU backend, shared by the emulator tests (test_cuda_codegen.py,
any machine) and the GPU tests (test_cuda_gpu.py).

A case runs one op (forward or backward) with the CUDA backend `g` (`deepdsl_runtime.cuda` on a GPU,
`deepdsl_runtime.cuda.ops.on(emulator)` on the host emulator) and with `deepdsl_runtime.cpu`, and returns what to
compare: (label, CUDA result, CPU result, relative tolerance; 0 = bit for bit). Cases cover the ops' geometry
(strides, padding, ceil mode, chunked workspaces), the writes the memory plan allows over inputs (in place, pooling
taking over its input from the same start) and the counter-based dropout masks.
"""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import cpu as C

F32 = np.float32


def _arena(g, nbytes: int):
    """A fresh device byte buffer (to lay out overlapping tensors by hand)."""
    return g.zeros((nbytes,), "uint8")


def _in(g, array):
    return g.asarray(np.ascontiguousarray(array))


def _out(g, shape, dtype="float32"):
    return g.zeros(tuple(shape), dtype)


def case_conv(g, rng):
    result = []
    for n, c, h, o, k, s, p in [(3, 2, 7, 4, 3, 1, 1), (2, 3, 9, 5, 3, 2, 0), (2, 4, 5, 3, 1, 1, 0),
                                (4, 2, 11, 3, 5, 2, 2), (2, 3, 8, 4, 1, 2, 0),
                                # AlexNet's first layer in small; an even kernel; a last row and column no window reaches
                                (2, 3, 23, 4, 11, 4, 2), (2, 2, 10, 3, 4, 3, 1), (2, 2, 10, 3, 3, 2, 0)]:
        x = rng.standard_normal((n, c, h, h)).astype(F32)
        w = rng.standard_normal((o, c, k, k)).astype(F32)
        b = rng.standard_normal(o).astype(F32)
        ho = C.out_size(h, k, s, p)
        gy = rng.standard_normal((n, o, ho, ho)).astype(F32)
        ref, refd, reff = (np.empty((n, o, ho, ho), F32), np.empty_like(x), np.empty_like(w))
        C.conv2d(x, w, b, out=ref, stride=s, pad=p)
        C.conv2d_bwd_data(gy, w, out=refd, stride=s, pad=p, size=(h, h))
        C.conv2d_bwd_filter(gy, x, out=reff, stride=s, pad=p, kernel=(k, k))
        for samples in (None, 1, 3):          # no workspace (a temporary), chunks of one sample, of three
            ws = None if samples is None else _out(g, (samples * (c * k * k + o) * ho * ho,))
            tag = f"n{n}c{c}h{h}o{o}k{k}s{s}p{p}/ws{samples}"
            out = _out(g, ref.shape)
            g.conv2d(_in(g, x), _in(g, w), _in(g, b), out=out, stride=s, pad=p, workspace=ws)
            result.append((f"conv2d {tag}", out, ref, 1e-5))
            out = _out(g, x.shape)
            g.conv2d_bwd_data(_in(g, gy), _in(g, w), out=out, stride=s, pad=p, size=(h, h), workspace=ws)
            result.append((f"conv2d_bwd_data {tag}", out, refd, 1e-5))
            out = _out(g, w.shape)
            g.conv2d_bwd_filter(_in(g, gy), _in(g, x), out=out, stride=s, pad=p, kernel=(k, k), workspace=ws)
            result.append((f"conv2d_bwd_filter {tag}", out, reff, 1e-5))
    return result


def case_grouped_conv(g, rng):
    """Grouped and depthwise convolutions (strided, padded, pointwise) and their gradients, with the workspace of one
    sample, of all, and none; the input gradient also over the output gradient from the same start."""
    result = []
    for n, c, h, o, k, s, p, groups in [(2, 4, 7, 6, 3, 1, 1, 2), (3, 3, 9, 6, 3, 2, 1, 3), (2, 4, 6, 4, 1, 1, 0, 4),
                                        (2, 6, 5, 4, 1, 1, 0, 2), (3, 4, 8, 4, 3, 1, 1, 4)]:
        x = rng.standard_normal((n, c, h, h)).astype(F32)
        w = rng.standard_normal((o, c // groups, k, k)).astype(F32)
        b = rng.standard_normal(o).astype(F32)
        ho = C.out_size(h, k, s, p)
        gy = rng.standard_normal((n, o, ho, ho)).astype(F32)
        ref, refd, reff = (np.empty((n, o, ho, ho), F32), np.empty_like(x), np.empty_like(w))
        C.conv2d(x, w, b, out=ref, stride=s, pad=p, groups=groups)
        C.conv2d_bwd_data(gy, w, out=refd, stride=s, pad=p, size=(h, h), groups=groups)
        C.conv2d_bwd_filter(gy, x, out=reff, stride=s, pad=p, kernel=(k, k), groups=groups)
        for samples in (None, 1, n):
            ws = None if samples is None else _out(g, (samples * (c * k * k + o) * ho * ho,))
            tag = f"n{n}c{c}h{h}o{o}k{k}s{s}p{p}g{groups}/ws{samples}"
            out = _out(g, ref.shape)
            g.conv2d(_in(g, x), _in(g, w), _in(g, b), out=out, stride=s, pad=p, groups=groups, workspace=ws)
            result.append((f"grouped conv2d {tag}", out, ref, 1e-5))
            out = _out(g, x.shape)
            g.conv2d_bwd_data(_in(g, gy), _in(g, w), out=out, stride=s, pad=p, size=(h, h), groups=groups,
                              workspace=ws)
            result.append((f"grouped conv2d_bwd_data {tag}", out, refd, 1e-5))
            out = _out(g, w.shape)
            g.conv2d_bwd_filter(_in(g, gy), _in(g, x), out=out, stride=s, pad=p, kernel=(k, k), groups=groups,
                                workspace=ws)
            result.append((f"grouped conv2d_bwd_filter {tag}", out, reff, 1e-5))
        out = _bwd_data_over_g(g, gy, w, refd, k, s, p, groups)
        result.append((f"grouped conv2d_bwd_data over g n{n}c{c}h{h}o{o}k{k}s{s}p{p}g{groups}", out, refd, 1e-5))
    return result


def _bwd_data_over_g(g, gy, w, ref, k, s, p, groups=1):
    """The device's conv2d_bwd_data of `gy` written over `gy` itself from the same start (the memory plan's
    takeover), with the workspace the plan gives it (the op's scratch plus one staged sample); `ref` the CPU's."""
    c, h, ho = ref.shape[1], ref.shape[2], gy.shape[2]
    shared = _arena(g, max(gy.nbytes, ref.nbytes))
    g_dev = shared[:gy.nbytes].view(F32).reshape(gy.shape)
    g_dev.device.upload(g_dev.ptr, gy)
    out = shared[:ref.nbytes].view(F32).reshape(ref.shape)
    scratch = 0 if (k == 1 and s == 1 and p == 0) else 2 * c * k * k * ho * ho
    g.conv2d_bwd_data(g_dev, _in(g, w), out=out, stride=s, pad=p, size=(h, h), groups=groups,
                      workspace=_out(g, (scratch + min(gy[0].size, ref[0].size),)))
    return out


def case_conv_bwd_data_takes_over(g, rng):
    """The input gradient written over the dying output gradient from the same start (the memory plan's takeover),
    growing (C*H*W > O*Ho*Wo) and shrinking, 1x1 and not; the workspace as the plan gives it (the op's scratch plus
    one staged sample)."""
    result = []
    for n, c, h, o, k, s, p in [(5, 6, 4, 2, 1, 1, 0), (5, 2, 4, 6, 1, 1, 0), (4, 3, 6, 2, 3, 1, 1),
                                (4, 1, 7, 5, 3, 1, 1), (6, 2, 9, 3, 3, 2, 0), (3, 4, 5, 4, 1, 1, 0)]:
        w = rng.standard_normal((o, c, k, k)).astype(F32)
        ho = C.out_size(h, k, s, p)
        gy = rng.standard_normal((n, o, ho, ho)).astype(F32)
        ref = np.empty((n, c, h, h), F32)
        C.conv2d_bwd_data(gy, w, out=ref, stride=s, pad=p, size=(h, h))
        out = _bwd_data_over_g(g, gy, w, ref, k, s, p)
        result.append((f"conv2d_bwd_data over g n{n}c{c}h{h}o{o}k{k}s{s}p{p}", out, ref, 1e-5))
    return result


POOLS = [(2, 3, 8, 2, 2, 0, False), (2, 3, 7, 3, 2, 1, True), (2, 2, 9, 3, 1, 1, True), (2, 2, 13, 3, 2, 0, True),
         (1, 2, 7, 7, 1, 0, False), (3, 2, 6, 3, 3, 0, False)]


def case_pool(g, rng):
    """Max and average pooling and their backward ops; window sums add in the CPU's order: bit for bit."""
    result = []
    for n, c, h, k, s, p, ceil in POOLS:
        x = rng.standard_normal((n, c, h, h)).astype(F32)
        x[0, 0, 0, :2] = 5.0                    # a tie: the first maximum wins
        ho = C.out_size(h, k, s, p, ceil)
        gy = rng.standard_normal((n, c, ho, ho)).astype(F32)
        geo = dict(kernel=k, stride=s, pad=p, ceil=ceil)
        tag = f"n{n}c{c}h{h}k{k}s{s}p{p}{'ceil' if ceil else ''}"
        for op in ("max_pool", "avg_pool"):
            ref = np.empty((n, c, ho, ho), F32)
            getattr(C, op)(x, out=ref, **geo)
            out = _out(g, ref.shape)
            getattr(g, op)(_in(g, x), out=out, **geo)
            result.append((f"{op} {tag}", out, ref, 0))
            if op == "max_pool":
                maxima = ref
        arg = np.empty((n, c, ho, ho), np.uint8)
        C.max_pool_argmax(x, out=arg, **geo)
        out = _out(g, arg.shape, "uint8")
        g.max_pool_argmax(_in(g, x), out=out, **geo)
        result.append((f"max_pool_argmax {tag}", out, arg, 0))
        pooled, index = _out(g, arg.shape), _out(g, arg.shape, "uint8")     # both in one call, as generated
        g.max_pool(_in(g, x), out=pooled, argmax=index, **geo)
        result.append((f"max_pool with argmax {tag}", index, arg, 0))
        result.append((f"max_pool with argmax, value {tag}", pooled, maxima, 0))
        ref = np.empty_like(x)
        C.max_pool_bwd(gy, arg, out=ref, size=(h, h), **geo)
        out = _out(g, x.shape)
        g.max_pool_bwd(_in(g, gy), _in(g, arg), out=out, size=(h, h), **geo)
        result.append((f"max_pool_bwd {tag}", out, ref, 0))
        for include_pad in (True, False):
            ref = np.empty((n, c, ho, ho), F32)
            C.avg_pool(x, out=ref, include_pad=include_pad, **geo)
            out = _out(g, ref.shape)
            g.avg_pool(_in(g, x), out=out, include_pad=include_pad, **geo)
            result.append((f"avg_pool include_pad={include_pad} {tag}", out, ref, 0))
            ref = np.empty_like(x)
            C.avg_pool_bwd(gy, out=ref, size=(h, h), include_pad=include_pad, **geo)
            out = _out(g, x.shape)
            g.avg_pool_bwd(_in(g, gy), out=out, size=(h, h), include_pad=include_pad, **geo)
            result.append((f"avg_pool_bwd include_pad={include_pad} {tag}", out, ref, 0))
    return result


def case_pool_takes_over(g, rng):
    """Pooling whose output starts where its dying input starts (the static plan's takeover): forward writes over
    its input, backward grows over the output gradient. Workspace: one sample of the smaller of input and output,
    which the plan adds for a taking-over statement (the GPU kernels need no scratch of their own)."""
    result = []
    for n, c, h, k, s, p, ceil in POOLS + [(9, 3, 8, 2, 2, 0, False), (7, 2, 13, 3, 2, 0, True)]:
        x = rng.standard_normal((n, c, h, h)).astype(F32)
        ho = C.out_size(h, k, s, p, ceil)
        gy = rng.standard_normal((n, c, ho, ho)).astype(F32)
        geo = dict(kernel=k, stride=s, pad=p, ceil=ceil)
        tag = f"n{n}c{c}h{h}k{k}s{s}p{p}{'ceil' if ceil else ''}"
        arg = np.empty((n, c, ho, ho), np.uint8)
        C.max_pool_argmax(x, out=arg, **geo)
        for op in ("max_pool", "avg_pool"):
            ref = np.empty((n, c, ho, ho), F32)
            getattr(C, op)(x, out=ref, **geo)
            shared = _arena(g, max(x.nbytes, ref.nbytes))
            x_dev = shared[:x.nbytes].view(F32).reshape(x.shape)
            x_dev.device.upload(x_dev.ptr, x)
            out = shared[:ref.nbytes].view(F32).reshape(ref.shape)
            getattr(g, op)(x_dev, out=out, workspace=_out(g, (min(x.size, ref.size) // n,)), **geo)
            result.append((f"{op} over its input {tag}", out, ref, 0))
        for op, extra in (("max_pool_bwd", (arg,)), ("avg_pool_bwd", ())):
            ref = np.empty_like(x)
            getattr(C, op)(gy, *extra, out=ref, size=(h, h), **geo)
            shared = _arena(g, max(x.nbytes, gy.nbytes))
            g_dev = shared[:gy.nbytes].view(F32).reshape(gy.shape)
            g_dev.device.upload(g_dev.ptr, gy)
            out = shared[:x.nbytes].view(F32).reshape(x.shape)
            workspace = _out(g, (min(x.size, gy.size) // n,))
            getattr(g, op)(g_dev, *(_in(g, e) for e in extra), out=out, size=(h, h), workspace=workspace, **geo)
            result.append((f"{op} over the output gradient {tag}", out, ref, 0))
    return result


def case_lrn(g, rng):
    result = []
    for shape in [(2, 7, 3, 4), (3, 5), (1, 16, 2, 2)]:
        x = rng.standard_normal(shape).astype(F32)
        gy = rng.standard_normal(shape).astype(F32)
        for size in (5, 4, 1):
            attrs = dict(size=size, alpha=1e-2, beta=0.75, k=2.0)
            ref, refb = np.empty_like(x), np.empty_like(x)
            C.lrn(x, out=ref, **attrs)
            C.lrn_bwd(gy, x, out=refb, **attrs)
            out = _out(g, shape)
            g.lrn(_in(g, x), out=out, **attrs)
            result.append((f"lrn {shape} size {size}", out, ref, 1e-5))
            inplace = _in(g, x)
            g.lrn(inplace, out=inplace, **attrs)
            result.append((f"lrn in place {shape} size {size}", inplace, ref, 1e-5))
            out = _out(g, shape)
            g.lrn_bwd(_in(g, gy), _in(g, x), out=out, **attrs)
            result.append((f"lrn_bwd {shape} size {size}", out, refb, 1e-5))
            inplace = _in(g, gy)
            g.lrn_bwd(inplace, _in(g, x), out=inplace, **attrs)
            result.append((f"lrn_bwd over g {shape} size {size}", inplace, refb, 1e-5))
    return result


def case_layer_norm(g, rng):
    """The layer norm, its input gradient (also over g, in place) and its weight's and bias's gradients (through the
    workspace's row statistics), affine and not, rows of whole vectors and not."""
    from deepdsl_runtime import contract

    result = []
    for shape, axes, affine in [((3, 4, 20), 1, True), ((2, 3, 5), 2, True), ((9, 6), 1, False), ((70, 33), 1, True)]:
        x = (2 * rng.standard_normal(shape) + 1).astype(F32)
        gy = rng.standard_normal(shape).astype(F32)
        features = shape[len(shape) - axes:]
        params = [rng.standard_normal(features).astype(F32) for _ in range(2 if affine else 0)]
        attrs = dict(eps=1e-5, axes=axes)
        ref, refd, refp = np.empty_like(x), np.empty_like(x), np.empty((2, int(np.prod(features))), F32)
        C.layer_norm(x, *params, out=ref, **attrs)
        C.layer_norm_grad(x, gy, *params[:1], out=refd, **attrs)
        C.layer_norm_param_grad(x, gy, out=refp, **attrs)
        tag = f"{shape} over {axes} axes{' affine' if affine else ''}"
        out = _out(g, shape)
        g.layer_norm(_in(g, x), *(_in(g, p) for p in params), out=out, **attrs)
        result.append((f"layer_norm {tag}", out, ref, 1e-5))
        out = _out(g, shape)
        g.layer_norm_grad(_in(g, x), _in(g, gy), *(_in(g, p) for p in params[:1]), out=out, **attrs)
        result.append((f"layer_norm_grad {tag}", out, refd, 1e-5))
        inplace = _in(g, gy)
        g.layer_norm_grad(_in(g, x), inplace, *(_in(g, p) for p in params[:1]), out=inplace, **attrs)
        result.append((f"layer_norm_grad over g {tag}", inplace, refd, 1e-5))
        out = _out(g, refp.shape)
        workspace = _out(g, (contract.layer_norm_param_scratch(x.size // refp.shape[1], refp.shape[1]),))
        g.layer_norm_param_grad(_in(g, x), _in(g, gy), out=out, workspace=workspace, **attrs)
        result.append((f"layer_norm_param_grad {tag}", out, refp, 1e-5))
    return result


def case_losses(g, rng):
    result = []
    for rows, classes in [(7, 10), (3, 1000), (1, 2), (12, 4)]:
        x = (3 * rng.standard_normal((rows, classes))).astype(F32)
        y = rng.integers(0, classes, rows).astype(np.int32)
        x[0, 1] = x[0].max() + 1.0
        x[0, 0] = x[0, 1]                       # a tie at the top: precision takes the first
        for op in ("softmax", "log_softmax"):
            ref = np.empty_like(x)
            getattr(C, op)(x, out=ref)
            out = _out(g, x.shape)
            getattr(g, op)(_in(g, x), out=out)
            result.append((f"{op} {rows}x{classes}", out, ref, 1e-5))
            inplace = _in(g, x)
            getattr(g, op)(inplace, out=inplace)
            result.append((f"{op} in place {rows}x{classes}", inplace, ref, 1e-5))
        if rows % classes == 0:                 # a causal softmax: rows in blocks of `classes`
            ref = np.empty_like(x)
            C.softmax(x, out=ref, causal=True)
            out = _out(g, x.shape)
            g.softmax(_in(g, x), out=out, causal=True)
            result.append((f"causal softmax {rows}x{classes}", out, ref, 1e-5))
        ref = np.empty(rows, F32)
        C.pick(x, y, out=ref)
        out = _out(g, (rows,))
        g.pick(_in(g, x), _in(g, y), out=out)
        result.append((f"pick {rows}x{classes}", out, ref, 0))
        gy = rng.standard_normal(rows).astype(F32)
        ref = np.empty((rows, classes), F32)
        C.unpick(gy, y, out=ref, classes=classes)
        out = _out(g, (rows, classes))
        g.unpick(_in(g, gy), _in(g, y), out=out, classes=classes)
        result.append((f"unpick {rows}x{classes}", out, ref, 0))
        for labels in (y, np.argmax(x, axis=1).astype(np.int32)):
            ref = np.empty((), F32)
            C.precision(x, labels, out=ref)
            out = _out(g, ())
            g.precision(_in(g, x), _in(g, labels), out=out)
            result.append((f"precision {rows}x{classes}", out, ref, 0))
    return result


def case_reductions_and_shapes(g, rng):
    result = []
    for src, dst in [((8, 3, 5, 5), (1, 3, 1, 1)), ((500, 10), (10,)), ((500,), ()), ((50, 10), (50, 1)),
                     ((2, 3, 4, 5), (2, 1, 4, 1)), ((4, 5), (4, 5)), ((3, 300), (1, 1)), ((6, 2, 3), (2, 1)),
                     ((2, 3, 4, 5), (3, 1, 5))]:
        x = rng.standard_normal(src).astype(F32)
        ref = np.empty(dst, F32)
        C.sum_to(x, out=ref, shape=dst)
        out = _out(g, dst)
        g.sum_to(_in(g, x), out=out, shape=dst)
        result.append((f"sum_to {src}->{dst}", out, ref, 1e-5))
    for src, dst in [((3,), (4, 3)), ((1, 3, 1, 1), (2, 3, 4, 5)), ((), (2, 2)), ((4, 1), (4, 6))]:
        x = rng.standard_normal(src).astype(F32)
        ref = np.empty(dst, F32)
        C.broadcast_to(x, out=ref, shape=dst)
        out = _out(g, dst)
        g.broadcast_to(_in(g, x), out=out, shape=dst)
        result.append((f"broadcast_to {src}->{dst}", out, ref, 0))
    a = rng.standard_normal((2, 3, 4)).astype(F32)
    b = rng.standard_normal((2, 5, 4)).astype(F32)
    for axis in (0, 1, 2):
        parts = [rng.standard_normal(a.shape[:axis] + (m,) + a.shape[axis + 1:]).astype(F32) for m in (1, 3, 2)]
        ref = np.empty(np.concatenate(parts, axis).shape, F32)
        C.concat(*parts, out=ref, axis=axis)
        out = _out(g, ref.shape)
        g.concat(*(_in(g, p) for p in parts), out=out, axis=axis)
        result.append((f"concat axis {axis}", out, ref, 0))
    ref = np.empty((2, 2, 4), F32)
    C.slice(b, out=ref, axis=1, start=1, stop=3)
    out = _out(g, ref.shape)
    g.slice(_in(g, b), out=out, axis=1, start=1, stop=3)
    result.append(("slice", out, ref, 0))
    block = rng.standard_normal((1, 5, 4)).astype(F32)
    ref = np.empty((1, 2, 4), F32)
    C.slice(block, out=ref, axis=1, start=2, stop=4)
    result.append(("slice of a block: a view", g.slice(_in(g, block), axis=1, start=2, stop=4), ref, 0))
    ref = np.empty((2, 9, 4), F32)
    C.pad_axis(a, out=ref, axis=1, start=2, size=9)
    out = _out(g, ref.shape)
    g.pad_axis(_in(g, a), out=out, axis=1, start=2, size=9)
    result.append(("pad_axis", out, ref, 0))
    masks = (rng.random((2, 3, 4)) < 0.5).astype(np.uint8)
    ref = np.empty((2, 6, 4), np.uint8)
    C.concat(masks, masks, out=ref, axis=1)
    out = _out(g, ref.shape, "uint8")
    g.concat(_in(g, masks), _in(g, masks), out=out, axis=1)
    result.append(("concat uint8", out, ref, 0))
    m = rng.standard_normal((6, 4)).astype(F32)
    n = rng.standard_normal((6, 5)).astype(F32)
    for ta, tb, left, right in [(True, False, m, n), (False, True, m.T.copy(), n.T.copy()), (False, False, m.T.copy(), n),
                                (True, True, m, n.T.copy())]:
        ref = np.empty((4, 5), F32)
        C.matmul(left, right, out=ref, ta=ta, tb=tb)
        out = _out(g, (4, 5))
        g.matmul(_in(g, left), _in(g, right), out=out, ta=ta, tb=tb)
        result.append((f"matmul ta={ta} tb={tb}", out, ref, 1e-5))
        bias = rng.standard_normal(5).astype(F32)        # a fully connected layer's bias (passes.fuse_epilogue)
        ref = np.empty((4, 5), F32)
        C.matmul(left, right, bias, out=ref, ta=ta, tb=tb)
        out = _out(g, (4, 5))
        g.matmul(_in(g, left), _in(g, right), _in(g, bias), out=out, ta=ta, tb=tb)
        result.append((f"matmul + bias ta={ta} tb={tb}", out, ref, 1e-5))
    left = rng.standard_normal((2, 3, 4, 6)).astype(F32)
    right = rng.standard_normal((2, 3, 6, 5)).astype(F32)
    for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
        a_in = np.ascontiguousarray(left.swapaxes(-1, -2)) if ta else left
        b_in = np.ascontiguousarray(right.swapaxes(-1, -2)) if tb else right
        ref = np.empty((2, 3, 4, 5), F32)
        C.matmul(a_in, b_in, out=ref, ta=ta, tb=tb)
        out = _out(g, ref.shape)
        g.matmul(_in(g, a_in), _in(g, b_in), out=out, ta=ta, tb=tb)
        result.append((f"batched matmul ta={ta} tb={tb}", out, ref, 1e-5))
    for axes in [(1, 2), (0, 3), (2, 3), (0, 1)]:
        ref = np.ascontiguousarray(left.swapaxes(*axes))
        out = _out(g, ref.shape)
        g.transpose(_in(g, left), out=out, axes=axes)
        result.append((f"transpose {axes}", out, ref, 0))
    out = _out(g, (3, 3))
    g.const(out=out, value=-0.25, shape=(3, 3))
    result.append(("const", out, np.full((3, 3), -0.25, F32), 0))
    out = _out(g, a.shape)
    g.all_sum(_in(g, a), out=out)                   # one process: the identity
    result.append(("all_sum", out, a, 0))
    out = _out(g, ())
    g.all_sum(784.0, out=out)                        # an example count
    result.append(("all_sum of a number", out, np.array(784.0, F32), 0))
    src = _in(g, a)
    out = _out(g, a.shape)
    g.copy(src, out=out)
    result.append(("copy", out, a, 0))
    result.append(("reshape", g.reshape(src, shape=(6, 4)), a.reshape(6, 4), 0))
    return result


def case_dropout_masks(g, rng):
    """The device draws the CPU's masks: Philox4x64-10 keyed by (seed, step * 65536 + key), bit for bit."""
    result = []
    for shape, keep, key, seed, step in [((37, 11), 0.6, 3, 7, 12), ((1000,), 0.5, 0, 0, 0), ((3, 5, 7), 0.9, 9, 123, 4)]:
        ref = np.empty(shape, np.uint8)
        C.bernoulli(out=ref, shape=shape, keep=keep, key=key, seed=seed, step=step)
        out = _out(g, shape, "uint8")
        g.bernoulli(out=out, shape=shape, keep=keep, key=key, seed=seed, step=step)
        result.append((f"bernoulli {shape} keep {keep}", out, ref, 0))
    return result


def case_attention(g, rng):
    """Attention and its gradient: causal, a bias broadcast over heads, queries or keys, dropout's masks, a
    workspace of one unit (the gradient's row statistics unit by unit) and of all; with `heads`, the operands and
    results stored (N, T, H, d) for the units (N, H), a unit's rows H * d apart."""
    from deepdsl_runtime import contract

    def stored(lead, rows, width, heads):
        return (*lead[:-1], rows, lead[-1], width) if heads else (*lead, rows, width)

    result = []
    for lead, t, s, d, e, causal, bias_shape, keep, heads in [((2, 3), 5, 7, 4, 6, False, None, None, False),
                                                                ((2, 3), 6, 6, 4, 3, True, (2, 1, 6, 6), None, False),
                                                                ((3,), 9, 20, 5, 2, False, (3, 1, 20), None, False),
                                                                ((2, 2, 2), 4, 3, 3, 3, False, (2, 1, 2, 4, 3), None,
                                                                 False),
                                                                ((2, 3), 6, 6, 4, 3, True, (2, 1, 6, 6), 0.7, False),
                                                                ((3,), 9, 20, 5, 2, False, None, 0.5, False),
                                                                ((2, 3), 5, 7, 4, 6, False, None, None, True),
                                                                ((2, 2), 6, 6, 4, 3, True, (1, 2, 6, 6), None, True),
                                                                ((3, 2), 4, 4, 5, 5, False, None, 0.7, True)]:
        q, k = (rng.standard_normal(stored(lead, n, d, heads)).astype(F32) for n in (t, s))
        v, dout = (rng.standard_normal(stored(lead, n, e, heads)).astype(F32) for n in (s, t))
        bias = () if bias_shape is None else (rng.standard_normal(bias_shape).astype(F32),)
        attrs = {"scale": 0.3, "causal": causal, **({"heads": True} if heads else {})}
        mask = None
        if keep is not None:
            mask = (rng.random((*lead, t, s)) < keep).astype(np.uint8)
            attrs["keep"] = keep
        what = f"{lead} {t}x{s}" + (" stored (N, T, H, d)" if heads else "") + \
            (f", dropout keeping {keep}" if keep else "")
        ref = np.empty(stored(lead, t, e, heads), F32)
        C.attention(q, k, v, *bias, mask=mask, out=ref, **attrs)
        out = _out(g, ref.shape)
        device_mask = None if mask is None else _in(g, mask)
        g.attention(*(_in(g, a) for a in (q, k, v, *bias)), mask=device_mask, out=out, **attrs)
        result.append((f"attention {what}", out, ref, 1e-5))
        grads = np.empty(q.size + k.size + v.size, F32)
        C.attention_grad(q, k, v, ref, dout, *bias, mask=mask, out=grads, **attrs)
        per_unit = contract.attention_grad_scratch(t, s, d, e, mask is not None)
        for units in (1, int(np.prod(lead))):
            out = _out(g, grads.shape)
            g.attention_grad(*(_in(g, a) for a in (q, k, v, ref, dout, *bias)), mask=device_mask, out=out,
                             workspace=_out(g, (units * per_unit,)), **attrs)
            result.append((f"attention_grad {what}, workspace of {units} units", out, grads, 1e-5))
    return result


CASES = [case_conv, case_grouped_conv, case_conv_bwd_data_takes_over, case_pool, case_pool_takes_over, case_lrn,
         case_layer_norm, case_losses, case_reductions_and_shapes, case_dropout_masks, case_attention]


def compare(g, label, got, expected, tolerance) -> None:
    """Assert the CUDA result matches the CPU's: bit for bit when `tolerance` is 0, else within that relative
    error (of the largest magnitude)."""
    got = g.to_numpy(got)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (label, got.shape, got.dtype)
    if tolerance == 0:
        assert np.array_equal(got, expected), f"{label}: differs ({np.argwhere(got != expected)[:5].tolist()})"
        return
    scale = max(float(np.max(np.abs(expected))), 1e-30) if expected.size else 1.0
    error = float(np.max(np.abs(got.astype(np.float64) - expected))) / scale if expected.size else 0.0
    assert error <= tolerance, f"{label}: relative error {error:.3g} > {tolerance:g}"
