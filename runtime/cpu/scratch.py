"""Scratch space and chunking of the CPU kernels: how many samples a kernel runs at a time (as many as its
workspace holds, no more than keep about `CACHE_BYTES` of data per chunk), and the safe order of chunks for an
output that takes over its input's bytes."""
from __future__ import annotations

import math

import numpy as np

from deepdsl_runtime import contract

_F32 = np.float32


class Scratch:
    """Carves consecutive float32 regions (or bool regions) out of a workspace, in a fixed order."""

    def __init__(self, workspace: np.ndarray | None, start: int = 0):
        self.workspace = workspace
        self.used = start

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        count = int(math.prod(shape))
        if self.workspace is None:
            return np.empty(shape, dtype=_F32)
        end = self.used + count
        if end > self.workspace.size:
            raise ValueError(f"workspace of {self.workspace.size} floats is too small (needs at least {end})")
        region = self.workspace[self.used:end]
        self.used = end
        return region.reshape(shape)

    def take_bool(self, shape: tuple[int, ...]) -> np.ndarray:
        count = int(math.prod(shape))
        if self.workspace is None:
            return np.empty(shape, dtype=np.bool_)
        return self.take(((count + 3) // 4,)).view(np.bool_)[:count].reshape(shape)

    def room(self) -> int:
        """Floats left (unbounded without a workspace)."""
        return 1 << 62 if self.workspace is None else self.workspace.size - self.used


CACHE_BYTES = 1 << 23     # data a kernel keeps per chunk of samples (two cores' L2 caches): passes over it stay cached


def samples_per_chunk(n: int, workspace: np.ndarray | None, per_sample: int, fixed_if_split: int = 0,
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


def sample_chunks(n: int, workspace: np.ndarray | None, scratch_floats: int, working_floats: int):
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


def takes_over(x: np.ndarray, out: np.ndarray) -> bool:
    """Whether `out` shares bytes with `x`: the memory plan then places it at the same start (a pooling output
    taking over its dying input's storage, see `deepdsl.memory_plan`)."""
    if not np.may_share_memory(x, out):
        return False
    if x.ctypes.data != out.ctypes.data or not (x.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("an output overlapping its input must start where the input starts (both contiguous)")
    return True


def safe_chunks(n: int, bi: int, bo: int):
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


def copy(src: np.ndarray, dst: np.ndarray, native=None) -> None:
    """dst = src: by `native`'s copy (the compiled kernels', `Native.copy`) where it takes the arrays, else numpy's."""
    if native is None or not native.copy(src, dst):
        np.copyto(dst, src)


def over_samples(run, x: np.ndarray, out: np.ndarray, workspace: np.ndarray | None, native=None) -> None:
    """Run a per-sample op, `run(start, stop, x_chunk, out_chunk, workspace)`, whose output takes over the bytes of
    its input `x`, chunk by chunk in a safe order (`safe_chunks`), each call on non-overlapping memory. A staged
    sample runs into (shrinking) or from (growing) one sample of scratch at the end of the workspace, copied by
    `native` (`copy`) where given."""
    n = x.shape[0]
    bi, bo = x.nbytes // n, out.nbytes // n
    count = _stage_floats(x, out)
    if workspace is None:
        inner, stage = None, np.empty(count, dtype=_F32)
    else:
        if workspace.size < count:
            raise ValueError(f"workspace of {workspace.size} floats is too small (needs at least {count} to stage)")
        inner, stage = workspace[:workspace.size - count], workspace[workspace.size - count:]
    for s, e, staged in safe_chunks(n, bi, bo):
        if not staged:
            run(s, e, x[s:e], out[s:e], inner)
        elif bo <= bi:
            result = stage.view(out.dtype)[:out[0].size].reshape((1,) + out.shape[1:])
            run(s, e, x[s:e], result, inner)
            copy(result, out[s:e], native)
        else:
            source = stage.view(x.dtype)[:x[0].size].reshape((1,) + x.shape[1:])
            copy(x[s:e], source, native)
            run(s, e, source, out[s:e], inner)
