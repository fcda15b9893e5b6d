"""Host-side decisions of the CUDA backend, as pure functions: no pycuda, no GPU, tested on any machine.

- `launch_1d`: the grid of a grid-stride kernel (`DEEPDSL_FOR` in kernels/deepdsl_common.cuh).
- `ew_layout`: numpy broadcasting of an elementwise statement collapsed to at most four dimensions, with each
  input's element strides (0 where it is broadcast), and which kernel variant (`_1`, `_2`, `_4`) runs it.
- `sum_plan`: `sum_to` as one of three reductions (a column sum, a middle-axis sum, or the generic one).
- `takeover_waves`: how pooling runs when the memory plan writes its output over its dying input from the same
  start: launches over sample ranges that cannot race, and ordered single-block passes where none can.
- `safe_sample_chunks`: the order a per-sample op whose output takes over its input's bytes runs its samples in.
- `conv_samples`: how many samples of a convolution fit the workspace at once.
- `strided_batched_gemm`: a row-major batched product as a column-major `cublasSgemmStridedBatched` call.
- `ew_entry`: the kernel name of a generated elementwise kernel.
- `kernel_sources_digest`: what names a program's prebuilt fat binary (the compiler and the runtime both use it).

Index arithmetic in the kernels is 32-bit: `check_elements` refuses larger tensors.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "THREADS", "MAX_BLOCKS", "MAX_ELEMENTS", "EW_F32", "EW_U8", "EW_VALUE", "LaunchConfig", "EwLayout", "SumPlan",
    "Wave", "GemmBatchedCall", "check_elements", "launch_1d", "ew_layout", "ew_entry", "sum_plan", "takeover_waves",
    "conv_samples", "safe_sample_chunks", "strided_batched_gemm", "windows_leave_input", "kernel_sources_digest", "KERNEL_SOURCES",
]

THREADS = 256                   # DEEPDSL_THREADS
ORDERED_THREADS = 1024          # DEEPDSL_ORDERED_THREADS
MAX_BLOCKS = 1 << 15            # grid-stride loops cover the rest
MAX_ELEMENTS = (1 << 31) - 1
EW_F32, EW_U8, EW_VALUE = 0, 1, 2
EW_MAX_DIMS = 4


def check_elements(count: int, what: str = "tensor") -> int:
    if count > MAX_ELEMENTS:
        raise ValueError(f"{what} of {count} elements: the CUDA kernels index with 32 bits (at most {MAX_ELEMENTS})")
    return count


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """A kernel launch's geometry: `grid`, blocks along x and y; `block`, threads along x, y and z (what pycuda's
    prepared calls take). Every launch of the runtime, generic kernels and the tiled GEMM's alike, has one."""

    grid: tuple[int, int]
    block: tuple[int, int, int]


def launch_1d(n: int, threads: int = THREADS) -> LaunchConfig:
    """Blocks of `threads` covering n items, at most MAX_BLOCKS (the kernels loop over the rest); at least one
    block, so an empty launch is still a valid one."""
    check_elements(n)
    blocks = max(1, min(MAX_BLOCKS, -(-n // threads)))
    return LaunchConfig((blocks, 1), (threads, 1, 1))


# ----------------------------------------------------------------------------------------------------------------
# elementwise broadcasting

@dataclass(frozen=True, slots=True)
class EwLayout:
    """The output as (d0, d1, d2, d3) (right-aligned, leading ones), `nd` the trailing dimensions in use (1, 2 or
    4: the kernel variant), and per input four element strides (all 0 for a host scalar or a single value)."""

    dims: tuple[int, int, int, int]
    nd: int
    strides: tuple[tuple[int, int, int, int], ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    def offset(self, i: int, k: int) -> int:
        """Element offset input k reads for output element i: what EwIndex<nd> computes (the reference of the
        kernels' index arithmetic)."""
        d0, d1, d2, d3 = self.dims
        if self.nd == 1:
            c = (0, 0, 0, i)
        elif self.nd == 2:
            c = (0, 0, i // d3, i % d3)
        else:
            c = (i // (d1 * d2 * d3), (i // (d2 * d3)) % d1, (i // d3) % d2, i % d3)
        return sum(a * b for a, b in zip(c, self.strides[k]))


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def ew_layout(out_shape: tuple[int, ...], in_shapes: list[tuple[int, ...] | None]) -> EwLayout:
    """Collapse numpy broadcasting of inputs (`None`: a host scalar) onto `out_shape` to at most four dimensions.

    Dimensions of size 1 are dropped; neighbouring dimensions merge when every input steps through them as through
    one (stride[j] == stride[j+1] * size[j+1], broadcast or not). ValueError when the shapes do not broadcast to
    the output or more than four dimensions remain."""
    out_shape = tuple(out_shape)
    check_elements(math.prod(out_shape), "elementwise output")
    ndim = len(out_shape)
    per_input: list[list[int]] = []
    for shape in in_shapes:
        if shape is None:
            per_input.append([0] * ndim)
            continue
        shape = tuple(shape)
        if len(shape) > ndim:
            raise ValueError(f"input of shape {shape} does not broadcast to {out_shape}")
        aligned = (1,) * (ndim - len(shape)) + shape
        contiguous = _contiguous_strides(aligned)
        strides = []
        for d, o, s in zip(aligned, out_shape, contiguous):
            if d == o:
                strides.append(s if d != 1 else 0)
            elif d == 1:
                strides.append(0)
            else:
                raise ValueError(f"input of shape {shape} does not broadcast to {out_shape}")
        per_input.append(strides)
    dims: list[int] = []
    columns: list[list[int]] = [[] for _ in in_shapes]
    for j, size in enumerate(out_shape):
        if size == 1:
            continue
        if dims and all(col[-1] == per_input[k][j] * size for k, col in enumerate(columns)):
            dims[-1] *= size            # merge into the previous dimension: every input steps through both as one
            for k, col in enumerate(columns):
                col[-1] = per_input[k][j]
            continue
        dims.append(size)
        for k, col in enumerate(columns):
            col.append(per_input[k][j])
    if len(dims) > EW_MAX_DIMS:
        raise ValueError(f"elementwise broadcasting of {list(in_shapes)} onto {out_shape} needs {len(dims)} "
                         f"dimensions; the kernels index at most {EW_MAX_DIMS}")
    pad = EW_MAX_DIMS - len(dims)
    full_dims = (1,) * pad + tuple(dims)
    strides = tuple(tuple([0] * pad + col) for col in columns)
    nd = 1 if len(dims) <= 1 else 2 if len(dims) == 2 else 4
    return EwLayout(full_dims, nd, strides)  # type: ignore[arg-type]


def ew_entry(kernel_name: str, nd: int) -> str:
    """The CUDA function of generated elementwise kernel `kernel_name` (`ew3`) for `nd` dimensions."""
    return f"deepdsl_{kernel_name}_{nd}"


# ----------------------------------------------------------------------------------------------------------------
# reductions

@dataclass(frozen=True, slots=True)
class SumPlan:
    """How `sum_to` runs. kind "copy": shapes agree; "rows": out[b] = sum_a x[a, b] (a, b); "middle":
    out[b] = sum_{a,c} x[a, b, c] (a, b, c); "generic": up to four collapsed `dims`, `reduced` a bit mask of the
    summed ones, `count` summed elements per output."""

    kind: str
    a: int = 1
    b: int = 1
    c: int = 1
    dims: tuple[int, int, int, int] = (1, 1, 1, 1)
    reduced: int = 0
    count: int = 1


def sum_plan(src: tuple[int, ...], dst: tuple[int, ...]) -> SumPlan:
    """Classify summing `src` down to `dst` (the inverse of broadcasting dst to src)."""
    src, dst = tuple(src), tuple(dst)
    check_elements(math.prod(src), "sum_to input")
    if src == dst:
        return SumPlan("copy")
    aligned = (1,) * (len(src) - len(dst)) + dst
    groups: list[list] = []                 # [size, reduced] of runs of kept or summed dimensions
    for s, d in zip(src, aligned):
        if s == 1:
            continue
        summed = d == 1
        if groups and groups[-1][1] == summed:
            groups[-1][0] *= s
        else:
            groups.append([s, summed])
    pattern = "".join("R" if r else "K" for _, r in groups)
    sizes = [s for s, _ in groups]
    if pattern == "":
        return SumPlan("copy")
    if pattern == "K":
        return SumPlan("copy")
    if pattern == "R":
        return SumPlan("middle", 1, 1, sizes[0])
    if pattern == "RK":
        return SumPlan("rows", sizes[0], sizes[1])
    if pattern == "KR":
        return SumPlan("middle", 1, sizes[0], sizes[1])
    if pattern == "RKR":
        return SumPlan("middle", sizes[0], sizes[1], sizes[2])
    if len(groups) > 4:
        raise ValueError(f"sum_to from {src} to {dst} alternates over {len(groups)} dimension groups; the CUDA "
                         f"kernel handles at most 4")
    pad = 4 - len(groups)
    dims = (1,) * pad + tuple(sizes)
    reduced = sum(1 << (pad + j) for j, (_, r) in enumerate(groups) if r)
    count = math.prod(s for s, r in groups if r)
    return SumPlan("generic", dims=dims, reduced=reduced, count=count)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# pooling over its own input

def windows_leave_input(h: int, w: int, ho: int, wo: int, kernel: int, stride: int, pad: int) -> bool:
    """Whether some window reaches outside the input (padding, or ceil mode's last window)."""
    return pad > 0 or (ho - 1) * stride + kernel > h or (wo - 1) * stride + kernel > w


@dataclass(frozen=True, slots=True)
class Wave:
    """One launch: `ordered` (one block, tiles in order: ascending for a forward op, descending for a backward
    one) or parallel, over output elements [begin, end)."""

    ordered: bool
    begin: int
    end: int


def takeover_waves(samples: int, in_per_sample: int, out_per_sample: int, in_address: int, out_address: int,
                   itemsize: int = 4, backward: bool = False) -> list[Wave]:
    """Launches computing a pooling op whose output may overlap its input, in order.

    Requires what pooling without padding guarantees (the caller copies padded inputs to the workspace first):
    forward, output element K reads input elements >= K only (window starts never precede the output position);
    backward, input-gradient element K reads gradient elements <= K only. The input and output hold elements of
    `itemsize` bytes at the given addresses; all counts are elements.

    Without overlap: one parallel launch. Forward with the output starting `delta` >= 0 elements below the input:
    a launch over samples [s, e) is race-free when its writes end below its reads, e*O - delta <= s*I; the first
    samples, where no such range exists, run ordered (writing element K clobbers input element K - delta, which
    only outputs <= K read). Backward with the output starting `eps` >= 0 elements above the gradient: samples
    [s, e) from the top down when s*O + eps >= e*G, the last ones ordered from the top (writing element K clobbers
    gradient element K + eps, which only elements >= K read)."""
    n, size_in, size_out = samples, in_per_sample, out_per_sample
    total_out = n * size_out
    in_end = in_address + n * size_in * itemsize
    out_end = out_address + total_out * itemsize
    if total_out == 0 or out_end <= in_address or in_end <= out_address:
        return [Wave(False, 0, total_out)]
    if (in_address - out_address) % itemsize:
        raise ValueError("overlapping pooling buffers are not element-aligned")
    shift = (in_address - out_address) // itemsize
    if not backward:
        if shift < 0:
            raise ValueError("pooling output overlaps its input from above; no launch order is race-free")
        waves = []
        if shift >= size_out:
            first = 0
        elif size_in > size_out:
            first = min(n, -(-(size_out - shift) // (size_in - size_out)))
        else:
            first = n
        if first:
            waves.append(Wave(True, 0, first * size_out))
        s = first
        while s < n:
            e = min(n, (s * size_in + shift) // size_out)
            waves.append(Wave(False, s * size_out, e * size_out))
            s = e
        return waves
    eps = -shift
    if eps < 0:
        raise ValueError("pooling input gradient overlaps the output gradient from below; no launch order is "
                         "race-free")
    waves, e = [], n
    while e > 0:
        s = max(0, -(-(e * size_in - eps) // size_out))
        if s >= e:
            break
        waves.append(Wave(False, s * size_out, e * size_out))
        e = s
    if e > 0:
        waves.append(Wave(True, 0, e * size_out))
    return waves


def safe_sample_chunks(n: int, in_bytes: int, out_bytes: int) -> list[tuple[int, int, bool]]:
    """(start, stop, staged) chunks of samples, in launch order, for an op computing output sample i (`out_bytes`)
    from input sample i (`in_bytes`) when the output starts where the input starts (the CPU backend's rule).
    Shrinking runs forward: chunk [s, e) is safe when its output ends before the first unread input byte
    (e * out <= s * in); growing runs backward: when its output starts after the last unread input byte
    (s * out >= e * in). A sample with no safe chunk (the first when shrinking, the last when growing, every one when
    the sizes are equal) is `staged`: computed into scratch and copied (shrinking), or its input copied to scratch
    first (growing)."""
    chunks = []
    if out_bytes <= in_bytes:
        s = 0
        while s < n:
            e = min(n, s * in_bytes // out_bytes)
            chunks.append((s, s + 1, True) if e <= s else (s, e, False))
            s = s + 1 if e <= s else e
    else:
        e = n
        while e > 0:
            s = -(-e * in_bytes // out_bytes)
            chunks.append((e - 1, e, True) if s >= e else (s, e, False))
            e = e - 1 if s >= e else s
    return chunks


# ----------------------------------------------------------------------------------------------------------------
# convolution and GEMM

def conv_samples(batch: int, workspace_floats: int | None, per_sample: int) -> int:
    """Samples per chunk: all when the workspace holds them (or none is needed), else as many as fit."""
    if per_sample == 0 or workspace_floats is None or workspace_floats >= batch * per_sample:
        return batch
    m = workspace_floats // per_sample
    if m < 1:
        raise ValueError(f"workspace of {workspace_floats} floats holds no sample (needs {per_sample})")
    return m


@dataclass(frozen=True, slots=True)
class GemmBatchedCall:
    """Arguments of one column-major `cublasSgemmStridedBatched` call, operands named by role ("A"/"B")."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    first: str
    lda: int
    stride_first: int
    second: str
    ldb: int
    stride_second: int
    ldc: int
    stride_c: int
    batch: int


def strided_batched_gemm(transa: bool, transb: bool, m: int, n: int, k: int, lda: int, stride_a: int, ldb: int,
                         stride_b: int, ldc: int, stride_c: int, batch: int) -> GemmBatchedCall:
    """Row-major C_i (m x n) = op(A_i) op(B_i) for i < batch (A_i at A + i * stride_a, ...) as the column-major
    call computing C_i^T = op(B_i)^T op(A_i)^T: operands and dimensions swapped, flags and leading dimensions
    kept (as `driver.row_major_gemm`)."""
    from deepdsl_runtime.cuda.driver import row_major_gemm

    call = row_major_gemm(transa, transb, m, n, k, lda, ldb, ldc)
    strides = {"A": stride_a, "B": stride_b}
    return GemmBatchedCall(call.transa, call.transb, call.m, call.n, call.k, call.first, call.lda,
                           strides[call.first], call.second, call.ldb, strides[call.second], call.ldc, stride_c,
                           batch)


# ----------------------------------------------------------------------------------------------------------------
# prebuilt kernels

# what a program's .cu includes from the runtime
KERNEL_SOURCES = ("deepdsl_common.cuh", "deepdsl_math.h", "deepdsl_random.h", "ops.cu")


def kernel_sources_digest(program_source: str, kernels: Path) -> str:
    """16 hex digits naming a program's kernels: its `.cu` text and the runtime kernel sources in `kernels` it
    includes. Its fat binary carries them in its name (`<program>.<digest>.fatbin`), so a binary built from other
    sources is never loaded."""
    digest = hashlib.sha256(program_source.encode())
    for name in KERNEL_SOURCES:
        digest.update(b"\0" + name.encode() + b"\0")
        digest.update((Path(kernels) / name).read_bytes())
    return digest.hexdigest()[:16]
