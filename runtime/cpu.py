"""The CPU backend: every op of the IR as a numpy function that writes its result into an explicit buffer.

The op contract, shared by every backend module (`deepdsl_runtime.cpu` here, a CUDA module with the same names):
- `op(*inputs, out=..., **attrs)`: inputs are positional in the IR's order, attributes are keywords named as in
  the IR, and the result is written into `out`, entirely (callers hand out recycled buffers with stale contents).
- Ops that need scratch memory take `workspace=`, a 1-D float32 buffer whose size the compiler chose
  (the op's `workspace` rule, `deepdsl.ops`); they carve it up in a fixed order and never allocate tensor-sized memory
  themselves. Convolutions process as many samples at a time as their workspace holds (im2col chunks), so a
  smaller workspace trades speed for memory without changing results. Without a workspace an op allocates its
  own scratch (handy interactively, never done by generated programs).
- Small per-row temporaries (a max or a sum per example) may be allocated by numpy.
- `reshape` is a view and has no `out`; `ew(kernel, out, *args)` runs an elementwise kernel the compiler wrote.

Convolution is im2col + GEMM (Torch7's scheme): a strided view of the (zero-padded) input is copied into the
workspace as a (C*kh*kw, Ho*Wo) matrix per sample and multiplied by the (O, C*kh*kw) filter matrix in one batched
`np.matmul` straight into the output. 1x1 convolutions with stride 1 need no copy at all.
"""
from __future__ import annotations

import builtins

import numpy as np

__all__ = [
    "DEVICE", "asarray", "avg_pool", "avg_pool_bwd", "bernoulli", "bernoulli_mask",
    "broadcast_to", "concat", "const", "conv2d", "conv2d_bwd_data", "conv2d_bwd_filter", "copy", "ew", "log_softmax",
    "lrn", "lrn_bwd", "matmul", "max_pool", "max_pool_argmax", "max_pool_bwd", "out_size", "pad_axis", "pick",
    "precision", "reshape", "scalar", "slice", "softmax", "sum_to", "to_numpy", "unpick", "zeros",
]

DEVICE = "cpu"
_F32 = np.float32


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


def _chunk(n: int, workspace: np.ndarray | None, per_sample: int, fixed_if_split: int = 0) -> int:
    """How many samples fit the workspace at a time; `fixed_if_split` floats are reserved when not all do."""
    if workspace is None or per_sample == 0 or workspace.size >= n * per_sample:
        return n
    m = (workspace.size - fixed_if_split) // per_sample
    if m < 1:
        raise ValueError(f"workspace of {workspace.size} floats holds no sample (needs {per_sample + fixed_if_split})")
    return m


# ----------------------------------------------------------------------------------------------------------------
# convolution

def out_size(size: int, kernel: int, stride: int, pad: int, ceil: bool = False) -> int:
    span = size + 2 * pad - kernel
    if ceil:
        out = -(-span // stride) + 1
        if (out - 1) * stride >= size + pad:   # the last window must start inside the input (Caffe, PyTorch)
            out -= 1
        return out
    return span // stride + 1


def _windows(xp: np.ndarray, kh: int, kw: int, stride: int, ho: int, wo: int) -> np.ndarray:
    """(N, C, kh, kw, Ho, Wo) strided view: [n, c, i, j, p, q] = xp[n, c, i + stride*p, j + stride*q]."""
    sn, sc, sh, sw = xp.strides
    return np.lib.stride_tricks.as_strided(
        xp, shape=(xp.shape[0], xp.shape[1], kh, kw, ho, wo),
        strides=(sn, sc, sh, sw, sh * stride, sw * stride), writeable=False)


def _padded_size(c: int, h: int, w: int, pad: int) -> int:
    return c * (h + 2 * pad) * (w + 2 * pad) if pad else 0


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


def _is_pointwise(kh: int, kw: int, stride: int, pad: int) -> bool:
    return kh == 1 and kw == 1 and stride == 1 and pad == 0


def conv2d(x, w, b=None, *, out, stride=1, pad=0, workspace=None):
    """out = x (*) w + b: x (N,C,H,W), w (O,C,kh,kw), b (O,), out (N,O,Ho,Wo).

    Workspace per sample: the im2col matrix (C*kh*kw, Ho*Wo), and with padding the zero-padded input."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho, wo = out.shape[2:]
    w2 = w.reshape(o, c * kh * kw)
    if _is_pointwise(kh, kw, stride, pad):
        np.matmul(w2, x.reshape(n, c, h * wd), out=out.reshape(n, o, ho * wo))
    else:
        ckk = c * kh * kw
        step = _chunk(n, workspace, ckk * ho * wo + _padded_size(c, h, wd, pad))
        for s in range(0, n, step):
            e = min(n, s + step)
            scratch = _Scratch(workspace)
            cols = scratch.take((e - s, c, kh, kw, ho, wo))
            _im2col(x[s:e], cols, stride, pad, scratch)
            np.matmul(w2, cols.reshape(e - s, ckk, ho * wo), out=out[s:e].reshape(e - s, o, ho * wo))
    if b is not None:
        np.add(out, b.reshape(1, o, 1, 1), out=out)


def conv2d_bwd_data(g, w, *, out, stride, pad, size, workspace=None):
    """Gradient of conv2d with respect to its input: col2im(W^T G).

    Stride 1 computes the column gradients on rows as wide as the padded input (the output gradient padded with
    zero columns), so that adding each kernel offset's contribution is one contiguous run per channel. Workspace
    per sample: the widened output gradient (O, Ho*Wp), column gradients (C*kh*kw, Ho*Wp) and the padded input
    gradient (C, Hp*Wp + kw - 1). Other strides add strided windows: column gradients (C*kh*kw, Ho*Wo) only."""
    n, o, ho, wo = g.shape
    _, c, kh, kw = w.shape
    h, wd = size
    w2t = w.reshape(o, c * kh * kw).T
    if _is_pointwise(kh, kw, stride, pad):
        np.matmul(w2t, g.reshape(n, o, ho * wo), out=out.reshape(n, c, h * wd))
        return
    ckk = c * kh * kw
    if stride == 1:
        hp, wp = h + 2 * pad, wd + 2 * pad
        plane = hp * wp + kw - 1
        step = _chunk(n, workspace, (o + ckk) * ho * wp + c * plane)
        for s in range(0, n, step):
            e = min(n, s + step)
            m = e - s
            scratch = _Scratch(workspace)
            wide = scratch.take((m, o, ho, wp))
            wide[..., :wo] = g[s:e]
            wide[..., wo:] = 0
            dcols = scratch.take((m, c, kh, kw, ho * wp))
            np.matmul(w2t, wide.reshape(m, o, ho * wp), out=dcols.reshape(m, ckk, ho * wp))
            dxp = scratch.take((m, c, plane))
            dxp.fill(0)
            for i in range(kh):
                for j in range(kw):
                    view = dxp[:, :, i * wp + j:i * wp + j + ho * wp]
                    np.add(view, dcols[:, :, i, j], out=view)
            np.copyto(out[s:e], dxp[:, :, :hp * wp].reshape(m, c, hp, wp)[:, :, pad:pad + h, pad:pad + wd])
        return
    step = _chunk(n, workspace, ckk * ho * wo)
    out.fill(0)
    for s in range(0, n, step):
        e = min(n, s + step)
        dcols = _Scratch(workspace).take((e - s, c, kh, kw, ho, wo))
        np.matmul(w2t, g[s:e].reshape(e - s, o, ho * wo), out=dcols.reshape(e - s, ckk, ho * wo))
        _col2im_add(dcols, out[s:e], stride, pad)


def conv2d_bwd_filter(g, x, *, out, stride, pad, kernel, workspace=None):
    """Gradient of conv2d with respect to its weights: G im2col(X)^T, one GEMM over all samples of a chunk.

    Workspace per sample: its im2col matrix (C*kh*kw, Ho*Wo), its gradient transposed to (O, Ho*Wo) and with
    padding the zero-padded input; plus an (O, C*kh*kw) accumulator when the batch runs in several chunks."""
    n, o, ho, wo = g.shape
    c, h, wd = x.shape[1:]
    kh, kw = kernel
    ckk = c * kh * kw
    out2 = out.reshape(o, ckk)
    per = (ckk + o) * ho * wo + _padded_size(c, h, wd, pad)
    step = _chunk(n, workspace, per, fixed_if_split=o * ckk)
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
        np.matmul(gt.reshape(o, -1), cols.reshape(ckk, -1).T, out=target)
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


def max_pool(x, *, out, kernel, stride, pad=0, ceil=False, workspace=None):
    ho, wo = out.shape[2:]
    src = _pool_source(x, kernel, stride, pad, ho, wo, -np.inf, _Scratch(workspace))
    np.copyto(out, _window(src, 0, 0, stride, ho, wo))
    for i in range(kernel):
        for j in range(kernel):
            if i or j:
                np.maximum(out, _window(src, i, j, stride, ho, wo), out=out)


def max_pool_argmax(x, *, out, kernel, stride, pad=0, ceil=False, workspace=None):
    """Index (row * kernel + column) of the first maximum of each window, as uint8."""
    ho, wo = out.shape[2:]
    scratch = _Scratch(workspace)
    src = _pool_source(x, kernel, stride, pad, ho, wo, -np.inf, scratch)
    best = scratch.take(out.shape)
    better = scratch.take_bool(out.shape)
    np.copyto(best, _window(src, 0, 0, stride, ho, wo))
    out.fill(0)
    for i in range(kernel):
        for j in range(kernel):
            if i or j:
                win = _window(src, i, j, stride, ho, wo)
                np.greater(win, best, out=better)        # strictly: the first maximum keeps its index
                np.maximum(best, win, out=best)
                np.putmask(out, better, i * kernel + j)


def max_pool_bwd(g, argmax, *, out, kernel, stride, pad=0, ceil=False, size, workspace=None):
    """Each gradient goes to the position its window's argmax names; overlapping windows add up."""
    ho, wo = g.shape[2:]
    h, w = size
    scratch = _Scratch(workspace)
    dst = _scatter_target(out, size, kernel, stride, pad, ho, wo, scratch)
    hit = scratch.take_bool(g.shape)
    part = scratch.take(g.shape) if stride < kernel else None
    dst.fill(0)
    for i in range(kernel):
        for j in range(kernel):
            view = _window(dst, i, j, stride, ho, wo)
            np.equal(argmax, i * kernel + j, out=hit)
            if part is None:          # windows do not overlap: each position is written by one window only
                np.multiply(g, hit, out=view)
            else:
                np.multiply(g, hit, out=part)
                np.add(view, part, out=view)
    if dst is not out:
        np.copyto(out, dst[:, :, pad:pad + h, pad:pad + w])


def avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad) -> np.ndarray:
    """(Ho, Wo) element counts each averaging window divides by (PyTorch's rule)."""
    h, w = size
    ho, wo = out_size(h, kernel, stride, pad, ceil), out_size(w, kernel, stride, pad, ceil)

    def counts(n, on):
        start = np.arange(on) * stride - pad
        end = np.minimum(start + kernel, n + pad)
        if not include_pad:
            return np.minimum(end, n) - np.maximum(start, 0)
        return end - start

    return np.outer(counts(h, ho), counts(w, wo))


def avg_pool(x, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, workspace=None):
    ho, wo = out.shape[2:]
    src = _pool_source(x, kernel, stride, pad, ho, wo, 0.0, _Scratch(workspace))
    np.copyto(out, _window(src, 0, 0, stride, ho, wo))
    for i in range(kernel):
        for j in range(kernel):
            if i or j:
                np.add(out, _window(src, i, j, stride, ho, wo), out=out)
    np.divide(out, avg_pool_divisor(x.shape[2:], kernel, stride, pad, ceil, include_pad), out=out)


def avg_pool_bwd(g, *, out, kernel, stride, pad=0, ceil=False, include_pad=True, size, workspace=None):
    ho, wo = g.shape[2:]
    h, w = size
    scratch = _Scratch(workspace)
    dst = _scatter_target(out, size, kernel, stride, pad, ho, wo, scratch)
    share = scratch.take(g.shape)
    np.divide(g, avg_pool_divisor(size, kernel, stride, pad, ceil, include_pad), out=share)
    dst.fill(0)
    for i in range(kernel):
        for j in range(kernel):
            view = _window(dst, i, j, stride, ho, wo)
            if stride >= kernel:
                np.copyto(view, share)
            else:
                np.add(view, share, out=view)
    if dst is not out:
        np.copyto(out, dst[:, :, pad:pad + h, pad:pad + w])


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
    scratch = _Scratch(workspace)
    s, tmp = scratch.take(x.shape), scratch.take(x.shape)
    _lrn_scale(x, s, tmp, size, alpha, k)
    np.power(s, -beta, out=s)
    np.multiply(x, s, out=out)


def lrn_bwd(g, x, *, out, size, alpha, beta, k, workspace=None):
    """dx = g s^-beta - (2 alpha beta / size) x * window_sum'(g x s^(-beta-1))."""
    scratch = _Scratch(workspace)
    s, a, spread = scratch.take(x.shape), scratch.take(x.shape), scratch.take(x.shape)
    _lrn_scale(x, s, a, size, alpha, k)
    np.power(s, -beta - 1, out=a)
    np.multiply(a, g, out=a)
    np.multiply(a, x, out=a)
    # input j feeds the outputs c with j in window(c): the window mirrored
    _channel_window_sum(a, spread, (size - 1) // 2, size // 2)
    np.multiply(spread, x, out=spread)
    np.multiply(spread, 2 * alpha * beta / size, out=spread)
    np.power(s, -beta, out=s)
    np.multiply(s, g, out=out)
    np.subtract(out, spread, out=out)


# ----------------------------------------------------------------------------------------------------------------
# losses

def softmax(x, *, out):
    np.subtract(x, x.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    np.divide(out, out.sum(axis=1, keepdims=True), out=out)


def log_softmax(x, *, out, workspace=None):
    np.subtract(x, x.max(axis=1, keepdims=True), out=out)
    e = _Scratch(workspace).take(x.shape)
    np.exp(out, out=e)
    np.subtract(out, np.log(e.sum(axis=1, keepdims=True)), out=out)


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


def matmul(a, b, *, out, ta=False, tb=False):
    np.matmul(a.T if ta else a, b.T if tb else b, out=out)


def const(*, out, value, shape=()):
    out.fill(value)


def copy(src, *, out):
    np.copyto(out, src)


def ew(kernel, out, *args):
    """Run an elementwise kernel of the generated program (a numpy function writing `out`)."""
    kernel(out, *args)


# ----------------------------------------------------------------------------------------------------------------
# random masks

def bernoulli_mask(seed: int, step: int, key: int, shape, keep: float) -> np.ndarray:
    """The mask the compiler's reference semantics draw (deepdsl.ops.norm.bernoulli_mask), bit for bit."""
    rng = np.random.Generator(np.random.Philox(key=[seed, step * 65536 + key]))
    return (rng.random(shape, dtype=np.float32) < keep).astype(np.uint8)


def bernoulli(*, out, shape, keep, key, seed, step, workspace=None):
    """out = 1 with probability `keep`, from the counter-based stream (seed, step, key): reproducible and
    independent of what ran before, so resuming a run draws the same masks."""
    rng = np.random.Generator(np.random.Philox(key=[seed, step * 65536 + key]))
    draws = _Scratch(workspace).take(tuple(shape))
    rng.random(dtype=np.float32, out=draws)
    np.less(draws, keep, out=out)
