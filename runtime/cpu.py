"""The CPU backend: every op of the IR as a numpy function that writes its result into an explicit buffer.

The op contract, shared by every backend module (`deepdsl_runtime.cpu` here, a CUDA module with the same names):
- `op(*inputs, out=..., **attrs)`: inputs are positional in the IR's order, attributes are keywords named as in
  the IR, and the result is written into `out`, entirely (callers hand out recycled buffers with stale contents).
- Ops that need scratch memory take `workspace=`, a 1-D float32 buffer whose size the compiler chose
  (the op's `workspace` rule, `deepdsl.ops`, from the scratch per sample `deepdsl_runtime.contract` states, which
  the kernel here reads too); they carve it up in a fixed order and never allocate tensor-sized memory themselves.
  Convolutions process as many samples at a time as their workspace holds (im2col chunks), so a smaller workspace
  trades speed for memory without changing results. Without a workspace an op allocates its
  own scratch (handy interactively, never done by generated programs).
- Small per-row temporaries (a max or a sum per example) may be allocated by numpy.
- `reshape` is a view and has no `out`; `ew(kernel, out, *args)` runs an elementwise kernel the compiler wrote.
- The ops that multiply matrices (matmul and the three convolutions) take `gemm=`, the function computing each
  product `gemm(a, b, out=c)` (c = a @ b, 2-D or batched as numpy's matmul; operands may be transposed views):
  `np.matmul` by default. `with_gemm(gemm)` is this backend with another one bound, such as the tiled
  multi-device GEMM (`deepdsl_runtime.gemm_backend.TiledProducts`).

Convolution is im2col + GEMM (Torch7's scheme): a strided view of the (zero-padded) input is copied into the
workspace as a (C*kh*kw, samples*Ho*Wo) matrix and multiplied by the (O, C*kh*kw) filter matrix, in one product for
small output planes, per sample for large ones. 1x1 convolutions with stride 1 need no copy at all.

Kernels run the batch in chunks of samples: as many as the workspace holds, and no more than keep about
`CACHE_BYTES` of data per chunk, so that a kernel's several passes over its scratch (an im2col matrix, then its
product; pooling windows one offset at a time) find it in the cache. Every float is float32: scalars enter ufuncs
as Python floats or float32 (numpy keeps the array's precision), and no kernel upcasts.
"""
from __future__ import annotations

import builtins
import functools
import types

import numpy as np

from deepdsl_runtime import contract
from deepdsl_runtime.contract import out_size

__all__ = [
    "DEVICE", "asarray", "avg_pool", "avg_pool_bwd", "bernoulli", "bernoulli_mask",
    "broadcast_to", "concat", "const", "conv2d", "conv2d_bwd_data", "conv2d_bwd_filter", "copy", "ew", "log_softmax",
    "lrn", "lrn_bwd", "matmul", "max_pool", "max_pool_argmax", "max_pool_bwd", "out_size", "pad_axis", "pick",
    "precision", "reshape", "scalar", "slice", "softmax", "sum_to", "to_numpy", "unpick", "zeros",
]

DEVICE = "cpu"
_F32 = np.float32
_PRODUCTS = ("matmul", "conv2d", "conv2d_bwd_data", "conv2d_bwd_filter")


def with_gemm(gemm) -> types.SimpleNamespace:
    """This backend (every name of `__all__`) with the ops of `_PRODUCTS` computing their matrix products by
    `gemm(a, b, out=c)` instead of `np.matmul`: what a generated program's `rt` is when its products run tiled."""
    names = {name: globals()[name] for name in __all__}
    names.update({name: functools.partial(globals()[name], gemm=gemm) for name in _PRODUCTS})
    return types.SimpleNamespace(**names)


# ----------------------------------------------------------------------------------------------------------------
# host <-> device (identity on the CPU)

def asarray(array: np.ndarray, dtype=None) -> np.ndarray:
    """A backend buffer holding a copy of a host array."""
    return np.array(array, dtype=dtype or array.dtype, order="C", copy=True)


def to_numpy(buffer: np.ndarray) -> np.ndarray:
    return np.array(buffer, copy=True)


def zeros(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def scalar(buffer) -> float:
    """The Python float of a 0-d value (the loss, the accuracy)."""
    return float(buffer)


# ----------------------------------------------------------------------------------------------------------------
# scratch space

class _Scratch:
    """Carves consecutive float32 regions (or bool regions) out of a workspace, in a fixed order."""

    def __init__(self, workspace: np.ndarray | None, start: int = 0):
        self.workspace = workspace
        self.used = start

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        if self.workspace is None:
            return np.empty(shape, dtype=_F32)
        end = self.used + count
        if end > self.workspace.size:
            raise ValueError(f"workspace of {self.workspace.size} floats is too small (needs at least {end})")
        region = self.workspace[self.used:end]
        self.used = end
        return region.reshape(shape)

    def take_bool(self, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        if self.workspace is None:
            return np.empty(shape, dtype=np.bool_)
        return self.take(((count + 3) // 4,)).view(np.bool_)[:count].reshape(shape)

    def room(self) -> int:
        """Floats left (unbounded without a workspace)."""
        return 1 << 62 if self.workspace is None else self.workspace.size - self.used


CACHE_BYTES = 1 << 23     # data a kernel keeps per chunk of samples (two cores' L2 caches): passes over it stay cached


def _chunk(n: int, workspace: np.ndarray | None, per_sample: int, fixed_if_split: int = 0,
           cache_floats: int | None = None) -> int:
    """How many samples a kernel runs at a time: as many as the workspace holds (`fixed_if_split` floats are
    reserved when not all do), and no more than keep `cache_floats` of working set (default CACHE_BYTES): a kernel
    makes several passes over its scratch, which then come from the cache instead of memory. The cache bound
    only splits a batch where the workspace still holds the reserved part."""
    if per_sample == 0:
        return n
    cap = _cache_samples(per_sample, cache_floats)
    if workspace is None or workspace.size >= n * per_sample:
        if cap >= n or (workspace is not None and workspace.size < cap * per_sample + fixed_if_split):
            return n
        return cap
    m = (workspace.size - fixed_if_split) // per_sample
    if m < 1:
        raise ValueError(f"workspace of {workspace.size} floats holds no sample (needs {per_sample + fixed_if_split})")
    return min(m, cap)      # a workspace holding less than the batch holds the reserved part already


def _cache_samples(per_sample_floats: int, cache_floats: int | None = None) -> int:
    """Samples whose `per_sample_floats` each fit `cache_floats` (default CACHE_BYTES); at least one."""
    return max(1, (CACHE_BYTES // 4 if cache_floats is None else cache_floats) // max(per_sample_floats, 1))


def _sample_chunks(n: int, workspace: np.ndarray | None, scratch_floats: int, working_floats: int):
    """(start, stop) chunks of samples for a kernel that works sample by sample: cache-sized by its working set
    (`working_floats` per sample: inputs, outputs and scratch) and no larger than the workspace holds
    (`scratch_floats` per sample). The memory plan gives such a kernel the scratch of the whole batch, or of the
    chunks that keep it within the workspace limit (`deepdsl.ops.batch_chunks`), so its chunks here are never
    more than the plan's."""
    step = _cache_samples(working_floats)
    if workspace is not None and scratch_floats:
        fit = workspace.size // scratch_floats
        if fit < 1:
            raise ValueError(f"workspace of {workspace.size} floats holds no sample (needs {scratch_floats})")
        step = min(step, fit)
    step = min(step, n)
    return ((s, min(n, s + step)) for s in range(0, n, step))


# ----------------------------------------------------------------------------------------------------------------
# outputs that take over their input's bytes

def _takes_over(x: np.ndarray, out: np.ndarray) -> bool:
    """Whether `out` shares bytes with `x`: the memory plan then places it at the same start (a pooling output
    taking over its dying input's storage, see `deepdsl.memory_plan`)."""
    if not np.may_share_memory(x, out):
        return False
    if x.ctypes.data != out.ctypes.data or not (x.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("an output overlapping its input must start where the input starts (both contiguous)")
    return True


def _safe_chunks(n: int, bi: int, bo: int):
    """(start, stop, staged) chunks of samples in an order that never overwrites an unread input sample, for an op
    computing output sample i (`bo` bytes) from input sample i (`bi` bytes) with output and input starting at the
    same byte. Shrinking (bo <= bi) runs forward: a chunk [s, e) is safe when its output ends before the first
    unread input byte (e * bo <= s * bi). Growing runs backward: a chunk is safe when its output starts after the
    last unread input byte (s * bo >= e * bi). The chunks grow geometrically by bi / bo; a sample with no safe
    chunk (the first when shrinking, the last when growing, every one when bo == bi) is `staged` through scratch."""
    if bo <= bi:
        s = 0
        while s < n:
            e = min(n, s * bi // bo)
            if e <= s:
                yield s, s + 1, True
                s += 1
            else:
                yield s, e, False
                s = e
    else:
        e = n
        while e > 0:
            s = -(-e * bi // bo)
            if s >= e:
                yield e - 1, e, True
                e -= 1
            else:
                yield s, e, False
                e = s


def _stage_floats(x: np.ndarray, out: np.ndarray) -> int:
    """Workspace floats a taking-over kernel stages one sample through: the smaller of an input and an output
    sample (the memory plan adds them to the statement's workspace, after the op's own scratch)."""
    return contract.stage_floats(x.nbytes, out.nbytes, x.shape[0])


def _over_samples(run, x: np.ndarray, out: np.ndarray, workspace: np.ndarray | None) -> None:
    """Run a per-sample op, `run(start, stop, x_chunk, out_chunk, workspace)`, whose output takes over the bytes of
    its input `x`, chunk by chunk in a safe order (`_safe_chunks`), each call on non-overlapping memory. A staged
    sample runs into (shrinking) or from (growing) one sample of scratch at the end of the workspace."""
    n = x.shape[0]
    bi, bo = x.nbytes // n, out.nbytes // n
    count = _stage_floats(x, out)
    if workspace is None:
        inner, stage = None, np.empty(count, dtype=_F32)
    else:
        if workspace.size < count:
            raise ValueError(f"workspace of {workspace.size} floats is too small (needs at least {count} to stage)")
        inner, stage = workspace[:workspace.size - count], workspace[workspace.size - count:]
    for s, e, staged in _safe_chunks(n, bi, bo):
        if not staged:
            run(s, e, x[s:e], out[s:e], inner)
        elif bo <= bi:
            result = stage.view(out.dtype)[:out[0].size].reshape((1,) + out.shape[1:])
            run(s, e, x[s:e], result, inner)
            np.copyto(out[s:e], result)
        else:
            source = stage.view(x.dtype)[:x[0].size].reshape((1,) + x.shape[1:])
            np.copyto(source, x[s:e])
            run(s, e, source, out[s:e], inner)


# ----------------------------------------------------------------------------------------------------------------
# convolution

def _windows(xp: np.ndarray, kh: int, kw: int, stride: int, ho: int, wo: int) -> np.ndarray:
    """(N, C, kh, kw, Ho, Wo) strided view: [n, c, i, j, p, q] = xp[n, c, i + stride*p, j + stride*q]."""
    sn, sc, sh, sw = xp.strides
    return np.lib.stride_tricks.as_strided(
        xp, shape=(xp.shape[0], xp.shape[1], kh, kw, ho, wo),
        strides=(sn, sc, sh, sw, sh * stride, sw * stride), writeable=False)


def _padded(x: np.ndarray, pad: int, scratch: _Scratch) -> np.ndarray:
    """x with `pad` zeros around its last two axes, in scratch space (x itself when pad is 0)."""
    if pad == 0:
        return x
    n, c, h, w = x.shape
    xp = scratch.take((n, c, h + 2 * pad, w + 2 * pad))
    xp[:, :, :pad] = 0
    xp[:, :, h + pad:] = 0
    xp[:, :, pad:h + pad, :pad] = 0
    xp[:, :, pad:h + pad, w + pad:] = 0
    xp[:, :, pad:h + pad, pad:w + pad] = x
    return xp


def _im2col(x: np.ndarray, cols: np.ndarray, stride: int, pad: int, scratch: _Scratch) -> None:
    """cols[n, c, i, j, p, q] = x[n, c, i + stride*p - pad, j + stride*q - pad] (0 outside x): one strided copy
    from x, or from a zero-padded copy of x in scratch space. `cols` may be a transposed view."""
    kh, kw, ho, wo = cols.shape[2:]
    np.copyto(cols, _windows(_padded(x, pad, scratch), kh, kw, stride, ho, wo))


def _valid(offset: int, size: int, out: int, stride: int, pad: int) -> tuple[int, int]:
    """Output positions [p0, p1) whose input row offset + stride*p - pad lies inside [0, size)."""
    p0 = max(0, -(-(pad - offset) // stride))
    p1 = min(out, (size - 1 + pad - offset) // stride + 1)
    return p0, max(p0, p1)


def _col2im_add(dcols: np.ndarray, dx: np.ndarray, stride: int, pad: int) -> None:
    """dx[n, c, i + stride*p - pad, j + stride*q - pad] += dcols[n, c, i, j, p, q] (the adjoint of _im2col)."""
    kh, kw, ho, wo = dcols.shape[2:]
    h, w = dx.shape[2:]
    for i in range(kh):
        p0, p1 = _valid(i, h, ho, stride, pad)
        for j in range(kw):
            q0, q1 = _valid(j, w, wo, stride, pad)
            r, c = i + stride * p0 - pad, j + stride * q0 - pad
            view = dx[:, :, r:r + stride * (p1 - p0):stride, c:c + stride * (q1 - q0):stride]
            np.add(view, dcols[:, :, i, j, p0:p1, q0:q1], out=view)


_WIDE_PLANE = 256      # output planes at least this large make per-sample products efficient


def conv2d(x, w, b=None, *, out, stride=1, pad=0, workspace=None, gemm=np.matmul):
    """out = x (*) w + b: x (N,C,H,W), w (O,C,kh,kw), b (O,), out (N,O,Ho,Wo).

    Workspace per sample: the im2col matrix (C*kh*kw, Ho*Wo), and with padding the zero-padded input. Small output
    planes (Ho*Wo < 256) make a chunk of samples one GEMM (O, C*kh*kw) x (C*kh*kw, samples*Ho*Wo) -- one large
    product keeps every BLAS thread busy where small products per sample do not -- whose (O, samples, Ho*Wo)
    result lands in the chunk's own output memory and is regrouped to (samples, O, Ho*Wo) through the then dead
    im2col matrix, adding the bias on the way (O <= C*kh*kw: the matrix holds the result). Otherwise each sample is
    one product straight into its output."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho, wo = out.shape[2:]
    w2 = w.reshape(o, c * kh * kw)
    if contract.pointwise_conv(kh, kw, stride, pad):
        gemm(w2, x.reshape(n, c, h * wd), out=out.reshape(n, o, ho * wo))
        if b is not None:
            np.add(out, b.reshape(1, o, 1, 1), out=out)
        return
    ckk, hw = c * kh * kw, ho * wo
    step = _chunk(n, workspace, contract.conv2d_scratch(x.shape, w.shape, out.shape, stride, pad))
    for s in range(0, n, step):
        e = min(n, s + step)
        m = e - s
        scratch = _Scratch(workspace)
        cols = scratch.take((c, kh, kw, m, ho, wo))
        _im2col(x[s:e], cols.transpose(3, 0, 1, 2, 4, 5), stride, pad, scratch)
        target = out[s:e].reshape(m, o, hw)
        if hw < _WIDE_PLANE and ckk >= o:
            block = target.reshape(o, m, hw)            # the chunk's output memory, read as (O, samples, Ho*Wo)
            gemm(w2, cols.reshape(ckk, m * hw), out=block.reshape(o, m * hw))
            regrouped = cols.reshape(-1)[:o * m * hw].reshape(o, m, hw)
            np.copyto(regrouped, block)
            if b is None:
                np.copyto(target.transpose(1, 0, 2), regrouped)
            else:
                np.add(regrouped, b.reshape(o, 1, 1), out=target.transpose(1, 0, 2))
        else:
            gemm(w2, cols.reshape(ckk, m, hw).transpose(1, 0, 2), out=target)
            if b is not None:
                np.add(target, b.reshape(1, o, 1), out=target)


def conv2d_bwd_data(g, w, *, out, stride, pad, size, workspace=None, gemm=np.matmul):
    """Gradient of conv2d with respect to its input: col2im(W^T G).

    Stride 1 computes the column gradients of a chunk of samples in one GEMM, on rows as wide as the padded input
    (the output gradient transposed to (O, samples, Ho, Wp) with zero columns), so that adding each kernel offset's
    contribution is one contiguous run per channel and sample. Workspace per sample: the widened output gradient
    (O, Ho*Wp), column gradients (C*kh*kw, Ho*Wp) and the padded input gradient (C, Hp*Wp + kw - 1). When
    O*kw + kh*C < C*kh*kw the same room holds a cheaper scheme: the widened gradient shifted by each kernel column
    (O*kw rows; a shift by j is an offset of j in rows that end in zero columns), one GEMM with the filters
    regrouped to (kh*C, O*kw) giving each kernel row's contribution (kh*C rows), and kh shifted additions instead
    of kh*kw. Other strides
    add strided windows: column gradients (C*kh*kw, Ho*Wo) only, one product per sample. `out` may take over the
    bytes of `g` (same start): samples then run in a safe order. With stride 1 a chunk reads all of its output
    gradient (into the widened copy) before it writes any of its input gradient, so chunks of any size are safe in
    the order that writes behind the unread samples: forward when a sample's input gradient is the smaller, backward
    otherwise."""
    n, o, ho, wo = g.shape
    _, c, kh, kw = w.shape
    h, wd = size
    over = _takes_over(g, out)
    if over and (stride != 1 or contract.pointwise_conv(kh, kw, stride, pad)):
        return _over_samples(lambda s, e, gs, os, ws: conv2d_bwd_data(
            gs, w, out=os, stride=stride, pad=pad, size=size, workspace=ws, gemm=gemm), g, out, workspace)
    w2t = w.reshape(o, c * kh * kw).T
    if contract.pointwise_conv(kh, kw, stride, pad):
        gemm(w2t, g.reshape(n, o, ho * wo), out=out.reshape(n, c, h * wd))
        return
    ckk = c * kh * kw
    per_sample = contract.conv2d_bwd_data_scratch(g.shape, w.shape, size, stride, pad)
    if stride == 1:
        hp, wp = h + 2 * pad, wd + 2 * pad
        plane = hp * wp + kw - 1
        step = _chunk(n, workspace, per_sample)
        starts = range(0, n, step)
        if over and out.nbytes > g.nbytes:
            starts = reversed(starts)
        by_rows = None
        for s in starts:
            e = min(n, s + step)
            m, rows = e - s, (e - s) * ho * wp
            scratch = _Scratch(workspace)
            if o * kw + kh * c < ckk and m * (ckk - o * kw - kh * c) * ho * wp >= o * (kw - 1):
                # kernel rows: the output gradient shifted by each kernel column (kw contiguous copies), one GEMM
                # by the filters regrouped (kh*C, O*kw), then kh shifted additions instead of kh*kw
                wide = scratch.take((o, kw - 1 + rows))
                wide[:, :kw - 1] = 0
                body = wide[:, kw - 1:].reshape(o, m, ho, wp)
                np.copyto(body[..., :wo], g[s:e].transpose(1, 0, 2, 3))
                body[..., wo:] = 0
                shifted = scratch.take((o, kw, rows))
                for j in range(kw):
                    np.copyto(shifted[:, j], wide[:, kw - 1 - j:kw - 1 - j + rows])
                if by_rows is None:
                    by_rows = np.ascontiguousarray(w.transpose(2, 1, 0, 3)).reshape(kh * c, o * kw)
                partial = scratch.take((kh, c, m, ho * wp))
                gemm(by_rows, shifted.reshape(o * kw, rows), out=partial.reshape(kh * c, rows))
                offsets = [(i * wp, partial[i]) for i in range(kh)]
            else:
                wide = scratch.take((o, m, ho, wp))
                np.copyto(wide[..., :wo], g[s:e].transpose(1, 0, 2, 3))
                wide[..., wo:] = 0
                dcols = scratch.take((c, kh, kw, m, ho * wp))
                gemm(w2t, wide.reshape(o, rows), out=dcols.reshape(ckk, rows))
                offsets = [(i * wp + j, dcols[:, i, j]) for i in range(kh) for j in range(kw)]
            dxp = scratch.take((m, c, plane))
            dxp.fill(0)
            by_channel = dxp.transpose(1, 0, 2)
            for offset, contribution in offsets:
                view = by_channel[:, :, offset:offset + ho * wp]
                np.add(view, contribution, out=view)
            np.copyto(out[s:e], dxp[:, :, :hp * wp].reshape(m, c, hp, wp)[:, :, pad:pad + h, pad:pad + wd])
        return
    step = _chunk(n, workspace, per_sample)
    out.fill(0)
    for s in range(0, n, step):
        e = min(n, s + step)
        dcols = _Scratch(workspace).take((e - s, c, kh, kw, ho, wo))
        gemm(w2t, g[s:e].reshape(e - s, o, ho * wo), out=dcols.reshape(e - s, ckk, ho * wo))
        _col2im_add(dcols, out[s:e], stride, pad)


def conv2d_bwd_filter(g, x, *, out, stride, pad, kernel, workspace=None, gemm=np.matmul):
    """Gradient of conv2d with respect to its weights: G im2col(X)^T, one GEMM over all samples of a chunk.

    Workspace per sample: its im2col matrix (C*kh*kw, Ho*Wo), its gradient transposed to (O, Ho*Wo) and with
    padding the zero-padded input; plus an (O, C*kh*kw) accumulator when the batch runs in several chunks."""
    n, o, ho, wo = g.shape
    c, h, wd = x.shape[1:]
    kh, kw = kernel
    ckk = c * kh * kw
    out2 = out.reshape(o, ckk)
    per_sample, accumulator = contract.conv2d_bwd_filter_scratch(g.shape, x.shape, kernel, pad)
    step = _chunk(n, workspace, per_sample, fixed_if_split=accumulator)
    acc = _Scratch(workspace).take((o, ckk)) if step < n else None
    start = acc.size if acc is not None and workspace is not None else 0
    for s in range(0, n, step):
        e = min(n, s + step)
        scratch = _Scratch(workspace, start)
        cols = scratch.take((c, kh, kw, e - s, ho, wo))
        gt = scratch.take((o, e - s, ho, wo))
        _im2col(x[s:e], cols.transpose(3, 0, 1, 2, 4, 5), stride, pad, scratch)
        np.copyto(gt, g[s:e].transpose(1, 0, 2, 3))
        target = out2 if s == 0 else acc
        gemm(gt.reshape(o, -1), cols.reshape(ckk, -1).T, out=target)
        if s:
            np.add(out2, acc, out=out2)


# ----------------------------------------------------------------------------------------------------------------
# pooling

def _pool_source(x, kernel, stride, pad, ho, wo, fill, scratch):
    """x, or a copy padded with `fill` (padding and, in ceil mode, windows that hang over the edge)."""
    n, c, h, w = x.shape
    hp, wp = (ho - 1) * stride + kernel, (wo - 1) * stride + kernel
    if pad == 0 and hp <= h and wp <= w:
        return x
    src = scratch.take((n, c, max(hp, h + pad), max(wp, w + pad)))
    src.fill(fill)
    src[:, :, pad:pad + h, pad:pad + w] = x
    return src


def _scatter_target(out, size, kernel, stride, pad, ho, wo, scratch):
    """Where window gradients are added up: out itself, or a padded buffer when windows leave the input."""
    n, c = out.shape[:2]
    h, w = size
    hp, wp = (ho - 1) * stride + kernel, (wo - 1) * stride + kernel
    if pad == 0 and hp <= h and wp <= w:
        return out
    return scratch.take((n, c, max(hp, h + pad), max(wp, w + pad)))


def _window(a, i, j, stride, ho, wo):
    return a[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride]


def _pool_per_sample(x_shape, out_shape, *scratch_shapes) -> int:
    """Float32 elements one sample of a pooling kernel touches: input, output and its scratch (cache chunking)."""
    return sum(map(_per, (x_shape, out_shape, *scratch_shapes)))


def _per(shape) -> int:
    """Elements of one sample."""
    return int(np.prod(shape[1:], dtype=np.int64))


def max_pool(x, *, out, kernel, stride, pad=0, ceil=False, argmax=None, workspace=None):
    """Maximum of each window; with `argmax`, also the index `max_pool_argmax` computes, in the same pass over the
    windows (the maxima are the argmax's reference values; the workspace max_pool's plan gives it, which need not
    hold the argmax's one-byte mask). `out` may take over the bytes of `x` (same start): samples then run in a
    safe order."""
    if _takes_over(x, out):
        return _over_samples(lambda s, e, xs, os, ws: max_pool(
            xs, out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil,
            argmax=None if argmax is None else argmax[s:e], workspace=ws), x, out, workspace)
    ho, wo = out.shape[2:]
    extra = () if argmax is None else (out.shape, out.shape)
    padded = contract.max_pool_scratch(x.shape, out.shape, kernel, stride, pad)
    for s, e in _sample_chunks(x.shape[0], workspace, padded,
                               _pool_per_sample(x.shape, out.shape, *extra) + padded):
        scratch = _Scratch(workspace)
        src = _pool_source(x[s:e], kernel, stride, pad, ho, wo, -np.inf, scratch)
        part = out[s:e]
        _window_max(src, part, kernel, stride, ho, wo)
        if argmax is not None:       # the mask: in what the workspace has left, else a chunk-sized temporary
            mask = scratch.take_bool(part.shape) if scratch.room() * 4 >= part.size else np.empty(part.shape, bool)
            _window_argmax(src, part, argmax[s:e], mask, kernel, stride, ho, wo)


def _window_max(src, best, kernel, stride, ho, wo):
    np.copyto(best, _window(src, 0, 0, stride, ho, wo))
    for p in range(1, kernel * kernel):
        np.maximum(best, _window(src, p // kernel, p % kernel, stride, ho, wo), out=best)


def _window_argmax(src, best, index, differs, kernel, stride, ho, wo):
    """The index from the last window position to the first: r = 0 at the last position and
    r = (x_p != max) * (1 + r) before it, so r ends as the offset of the first position holding the maximum. Per
    position one comparison of strided floats and two passes over uint8 bytes, instead of keeping a running index
    next to a running maximum."""
    last = kernel * kernel - 1
    as_bytes = differs.view(np.uint8)
    if last == 0:
        index.fill(0)
    for p in range(last - 1, -1, -1):
        np.not_equal(_window(src, p // kernel, p % kernel, stride, ho, wo), best, out=differs)
        if p == last - 1:
            np.copyto(index, as_bytes)
        else:
            np.add(index, 1, out=index)
            np.multiply(index, as_bytes, out=index)


def max_pool_argmax(x, *, out, kernel, stride, pad=0, ceil=False, workspace=None):
    """Index (row * kernel + column) of the first maximum of each window, as uint8: the window maxima first (as
    max_pool computes them), then the index from them (`_window_argmax`)."""
    ho, wo = out.shape[2:]
    padded = contract.max_pool_scratch(x.shape, out.shape, kernel, stride, pad)
    scratch_floats = contract.max_pool_argmax_scratch(x.shape, out.shape, kernel, stride, pad)
    for s, e in _sample_chunks(x.shape[0], workspace, scratch_floats,
                               _pool_per_sample(x.shape, out.shape, out.shape) + padded):
        scratch = _Scratch(workspace)
        src = _pool_source(x[s:e], kernel, stride, pad, ho, wo, -np.inf, scratch)
        index = out[s:e]
        best = scratch.take(index.shape)
        differs = scratch.take_bool(index.shape)
        _window_max(src, best, kernel, stride, ho, wo)
        _window_argmax(src, best, index, differs, kernel, stride, ho, wo)


def max_pool_bwd(g, argmax, *, out, kernel, stride, pad=0, ceil=False, size, workspace=None):
    """Each gradient goes to the position its window's argmax names; overlapping windows add up. `out` may take
    over the bytes of `g` (same start): samples then run in a safe order."""
    if _takes_over(g, out):
        return _over_samples(lambda s, e, gs, os, ws: max_pool_bwd(
            gs, argmax[s:e], out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil, size=size, workspace=ws),
            g, out, workspace)
    ho, wo = g.shape[2:]
    h, w = size
    overlap = stride < kernel
    padded = contract.pool_padded_scratch(size, (ho, wo), kernel, stride, pad, out.shape[1])
    scratch_floats = contract.max_pool_bwd_scratch(g.shape, out.shape, kernel, stride, pad)
    per_sample = _pool_per_sample(out.shape, g.shape, *((g.shape,) if overlap else ())) + padded
    for s, e in _sample_chunks(g.shape[0], workspace, scratch_floats, per_sample):
        scratch = _Scratch(workspace)
        target = out[s:e]
        dst = _scatter_target(target, size, kernel, stride, pad, ho, wo, scratch)
        grad, index = g[s:e], argmax[s:e]
        hit = scratch.take_bool(grad.shape)
        part = scratch.take(grad.shape) if overlap else None
        if overlap or stride > kernel or dst.shape[2:] != (kernel * ho, kernel * wo):
            dst.fill(0)                   # otherwise the windows tile dst and write every position
        for i in range(kernel):
            for j in range(kernel):
                view = _window(dst, i, j, stride, ho, wo)
                np.equal(index, i * kernel + j, out=hit)
                if part is None:          # windows do not overlap: each position is written by one window only
                    np.multiply(grad, hit, out=view)
                else:
                    np.multiply(grad, hit, out=part)
                    np.add(view, part, out=view)
        if dst is not target:
            np.copyto(target, dst[:, :, pad:pad + h, pad:pad + w])


def avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad) -> np.ndarray:
    """(Ho, Wo) element counts each averaging window divides by (`contract.avg_pool_divisor`), as float32."""
    # float32: an integer divisor would make numpy divide in float64 and round back
    return contract.avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad).astype(_F32)


def avg_pool(x, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, workspace=None):
    """Mean of each window. `out` may take over the bytes of `x` (same start): samples then run in a safe order."""
    if _takes_over(x, out):
        return _over_samples(lambda s, e, xs, os, ws: avg_pool(
            xs, out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil, include_pad=include_pad, workspace=ws),
            x, out, workspace)
    ho, wo = out.shape[2:]
    divisor = avg_pool_divisor(x.shape[2:], kernel, stride, pad, ceil, include_pad)
    padded = contract.avg_pool_scratch(x.shape, out.shape, kernel, stride, pad)
    for s, e in _sample_chunks(x.shape[0], workspace, padded, _pool_per_sample(x.shape, out.shape) + padded):
        src = _pool_source(x[s:e], kernel, stride, pad, ho, wo, 0.0, _Scratch(workspace))
        part = out[s:e]
        np.copyto(part, _window(src, 0, 0, stride, ho, wo))
        for i in range(kernel):
            for j in range(kernel):
                if i or j:
                    np.add(part, _window(src, i, j, stride, ho, wo), out=part)
        np.divide(part, divisor, out=part)


def avg_pool_bwd(g, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, size, workspace=None):
    """Each window's mean gradient spread over the window. `out` may take over the bytes of `g` (same start):
    samples then run in a safe order."""
    if _takes_over(g, out):
        return _over_samples(lambda s, e, gs, os, ws: avg_pool_bwd(
            gs, out=os, kernel=kernel, stride=stride, pad=pad, ceil=ceil, include_pad=include_pad, size=size,
            workspace=ws), g, out, workspace)
    ho, wo = g.shape[2:]
    h, w = size
    divisor = avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad)
    padded = contract.pool_padded_scratch(size, (ho, wo), kernel, stride, pad, out.shape[1])
    scratch_floats = contract.avg_pool_bwd_scratch(g.shape, out.shape, kernel, stride, pad)
    for s, e in _sample_chunks(g.shape[0], workspace, scratch_floats,
                               _pool_per_sample(out.shape, g.shape, g.shape) + padded):
        scratch = _Scratch(workspace)
        target = out[s:e]
        dst = _scatter_target(target, size, kernel, stride, pad, ho, wo, scratch)
        share = scratch.take(g[s:e].shape)
        np.divide(g[s:e], divisor, out=share)
        dst.fill(0)
        for i in range(kernel):
            for j in range(kernel):
                view = _window(dst, i, j, stride, ho, wo)
                if stride >= kernel:
                    np.copyto(view, share)
                else:
                    np.add(view, share, out=view)
        if dst is not target:
            np.copyto(target, dst[:, :, pad:pad + h, pad:pad + w])


# ----------------------------------------------------------------------------------------------------------------
# normalization

def _channel_window_sum(a, out, front, back):
    """out[:, c] = sum of a[:, c - front : c + back + 1], clipped at the ends (axis 1, any trailing axes)."""
    c = a.shape[1]
    np.copyto(out, a)
    for d in range(1, min(front, c - 1) + 1):
        np.add(out[:, d:], a[:, :c - d], out=out[:, d:])
    for d in range(1, min(back, c - 1) + 1):
        np.add(out[:, :c - d], a[:, d:], out=out[:, :c - d])


def _lrn_scale(x, s, tmp, size, alpha, k):
    """s = k + alpha/size * (window sum of x^2)."""
    np.square(x, out=tmp)
    _channel_window_sum(tmp, s, size // 2, (size - 1) // 2)
    np.multiply(s, alpha / size, out=s)
    np.add(s, k, out=s)


def lrn(x, *, out, size, alpha, beta, k, workspace=None):
    """out = x * s^-beta over channel windows, in chunks of samples (scratch: the scale and the squares)."""
    scratch_floats = contract.lrn_scratch(x.shape)
    for a, b in _sample_chunks(x.shape[0], workspace, scratch_floats, 2 * scratch_floats):
        xs, scratch = x[a:b], _Scratch(workspace)
        s, tmp = scratch.take(xs.shape), scratch.take(xs.shape)
        _lrn_scale(xs, s, tmp, size, alpha, k)
        np.power(s, -beta, out=s)
        np.multiply(xs, s, out=out[a:b])


def lrn_bwd(g, x, *, out, size, alpha, beta, k, workspace=None):
    """dx = g s^-beta - (2 alpha beta / size) x * window_sum'(g x s^(-beta-1)), in chunks of samples (scratch: the
    scale, the inner term and its window sum). `out` may be `g` (in place): each chunk reads g before writing."""
    scratch_floats = contract.lrn_bwd_scratch(x.shape)
    for lo, hi in _sample_chunks(x.shape[0], workspace, scratch_floats, 2 * scratch_floats):
        gs, xs, outs, scratch = g[lo:hi], x[lo:hi], out[lo:hi], _Scratch(workspace)
        s, a, spread = scratch.take(xs.shape), scratch.take(xs.shape), scratch.take(xs.shape)
        _lrn_scale(xs, s, a, size, alpha, k)
        np.power(s, -beta - 1, out=a)
        np.multiply(a, gs, out=a)
        np.multiply(a, xs, out=a)
        # input j feeds the outputs c with j in window(c): the window mirrored
        _channel_window_sum(a, spread, (size - 1) // 2, size // 2)
        np.multiply(spread, xs, out=spread)
        np.multiply(spread, 2 * alpha * beta / size, out=spread)
        np.power(s, -beta, out=s)
        np.multiply(s, gs, out=outs)
        np.subtract(outs, spread, out=outs)


# ----------------------------------------------------------------------------------------------------------------
# losses

def softmax(x, *, out):
    np.subtract(x, x.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    np.divide(out, out.sum(axis=1, keepdims=True), out=out)


def log_softmax(x, *, out, workspace=None):
    """Rows' log-softmax, in chunks of rows (scratch: the exponentials)."""
    scratch_floats = contract.log_softmax_scratch(x.shape)
    for a, b in _sample_chunks(x.shape[0], workspace, scratch_floats, 3 * scratch_floats):
        xs, outs = x[a:b], out[a:b]
        np.subtract(xs, xs.max(axis=1, keepdims=True), out=outs)
        e = _Scratch(workspace).take(xs.shape)
        np.exp(outs, out=e)
        np.subtract(outs, np.log(e.sum(axis=1, keepdims=True)), out=outs)


def pick(x, labels, *, out):
    """out[i] = x[i, labels[i]]."""
    np.copyto(out, np.take_along_axis(x, labels.reshape(-1, 1).astype(np.intp, copy=False), axis=1).reshape(-1))


def unpick(g, labels, *, out, classes):
    """out[i, labels[i]] = g[i], zero elsewhere."""
    out.fill(0)
    np.put_along_axis(out, labels.reshape(-1, 1).astype(np.intp, copy=False), g.reshape(-1, 1), axis=1)


def precision(x, labels, *, out):
    """Fraction of rows whose first largest score is at the label."""
    out[...] = np.mean(np.argmax(x, axis=1) == labels)


# ----------------------------------------------------------------------------------------------------------------
# shapes and data movement

def _reduced_axes(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    lead = len(src) - len(dst)
    return tuple(range(lead)) + tuple(lead + i for i, d in enumerate(dst) if d == 1 and src[lead + i] != 1)


def sum_to(x, *, out, shape):
    """Sum x down to `shape` (the inverse of broadcasting)."""
    if x.shape == tuple(shape):
        np.copyto(out, x)
        return
    if x.ndim == 4 and tuple(shape) == (1, x.shape[1], 1, 1) and x.shape[2] * x.shape[3] > 1:
        # per-channel sums (bias and batch-norm gradients): a matrix-vector product over each sample's planes runs
        # at memory speed, numpy's reduction over axes (0, 2, 3) several times slower
        n, c, h, w = x.shape
        per_sample = np.matmul(x.reshape(n, c, h * w), np.ones(h * w, dtype=x.dtype))
        np.sum(per_sample, axis=0, out=out.reshape(c))
        return
    lead = x.ndim - len(shape)
    np.sum(x, axis=_reduced_axes(x.shape, tuple(shape)), keepdims=True, out=out.reshape((1,) * lead + tuple(shape)))


def broadcast_to(x, *, out, shape):
    np.copyto(out, x)


def reshape(x, *, shape):
    """A view with another shape (no copy: x is contiguous)."""
    return x.reshape(shape)


def concat(*xs, out, axis):
    np.concatenate(xs, axis=axis, out=out)


def _axis_index(ndim, axis, start, stop):
    index = [builtins.slice(None)] * ndim
    index[axis] = builtins.slice(start, stop)
    return tuple(index)


def slice(x, *, out, axis, start, stop):  # noqa: A001 -- the IR op's name
    np.copyto(out, x[_axis_index(x.ndim, axis, start, stop)])


def pad_axis(x, *, out, axis, start, size):
    out.fill(0)
    out[_axis_index(x.ndim, axis, start, start + x.shape[axis])] = x


def matmul(a, b, *, out, ta=False, tb=False, gemm=np.matmul):
    gemm(a.T if ta else a, b.T if tb else b, out=out)


def const(*, out, value, shape=()):
    out.fill(value)


def copy(src, *, out):
    np.copyto(out, src)


EW_CHUNK = 1 << 14        # elements per call of a large elementwise kernel: its temporaries stay in the L1/L2 cache


def ew(kernel, out, *args):
    """Run an elementwise kernel of the generated program (a numpy function writing `out`). A large one whose
    arrays all have the output's shape and layout (an optimizer update, say) runs in runs of EW_CHUNK elements:
    the temporaries numpy makes for a product inside a sum are then small and cached, instead of each a pass over
    memory (fc1's momentum update in LeNet: 400,000 floats, about a third faster). Elementwise results do not
    depend on how the elements are grouped, and an output that is one of the inputs is read before it is written
    in every run."""
    n = out.size
    if n < 2 * EW_CHUNK or not out.flags.c_contiguous:
        return kernel(out, *args)
    flat = []                         # (array, whether it is cut into runs)
    for a in args:
        if not isinstance(a, np.ndarray):
            flat.append((a, False))
        elif a.size == 1:
            flat.append((a.reshape(-1), False))      # a (1, 1) operand would widen a run to two dimensions
        elif a.shape == out.shape and a.flags.c_contiguous:
            flat.append((a.reshape(-1), True))
        else:
            return kernel(out, *args)
    o = out.reshape(-1)
    for s in range(0, n, EW_CHUNK):
        e = s + EW_CHUNK
        kernel(o[s:e], *(a[s:e] if cut else a for a, cut in flat))


# ----------------------------------------------------------------------------------------------------------------
# random masks

def bernoulli_mask(seed: int, step: int, key: int, shape, keep: float) -> np.ndarray:
    """The mask the compiler's reference semantics draw (deepdsl.ops.norm.bernoulli_mask), bit for bit."""
    rng = contract.mask_generator(seed, step, key)
    return (rng.random(shape, dtype=np.float32) < keep).astype(np.uint8)


def bernoulli(*, out, shape, keep, key, seed, step, workspace=None):
    """out = 1 with probability `keep`, from the counter-based stream (seed, step, key): reproducible and
    independent of what ran before, so resuming a run draws the same masks."""
    rng = contract.mask_generator(seed, step, key)
    rows = out.reshape(tuple(shape) or (1,))           # a scalar mask as one row
    per = contract.bernoulli_scratch(shape)
    for a, b in _sample_chunks(rows.shape[0], workspace, per, 2 * per):   # consecutive draws: the same stream
        draws = _Scratch(workspace).take((b - a,) + rows.shape[1:])
        rng.random(dtype=np.float32, out=draws)
        np.less(draws, keep, out=rows[a:b])
