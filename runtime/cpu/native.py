"""The compiled CPU kernels of a generated program, in two libraries built with OpenMP and loaded with ctypes: the
runtime's generic kernels (kernels/cpu_ops.c), one library that every program on this machine shares,
`deepdsl_cpu.<digest>.so` in the user's cache directory (`generic_library`), and the program's elementwise kernels,
`<program>.<digest>.so` beside the program, built from its `<program>.c` (`library_path`). Each digest names the
sources, the build flags and the processor, so a library built elsewhere or from other sources is never loaded.

`load(program)` finds both libraries of a program's current sources on this machine (a build in progress,
`deepdsl compile`'s in the background, is waited for) and returns a `Native` (or None and the reason: the program
then runs the numpy kernels). `build_library` builds them, the generic one where it is missing (for `deepdsl
compile`, and for a program's first run where one is missing: `to_build`). `Native` runs the kernels that replace
numpy passes:
im2col, axis swaps and the input gradient's shifted sums inside the convolutions, thin convolutions and their
filter gradients straight from the input (`contract.direct_conv`), thin pointwise filter gradients straight from
their operands (`contract.pointwise_filter`), direct convolutions of many channels on
channel-blocked copies in their planned workspace (`contract.blocked_conv`), max pooling with its argmax and
its gradient, and every elementwise statement whose operands are whole tensors, scalars, per-channel or last-axis
vectors (`contract.operand_letter`; another broadcast runs numpy's kernel). Each writes what the numpy kernel
writes (to float32 rounding where it sums in another order: thin, pointwise and blocked convolutions, LRN with
beta 0.75), into the same buffers, within the statement's planned workspace (the plan holds the larger of a blocked
convolution's copies and numpy's im2col scratch), so the memory plan is the same with or without them. Where
numpy's BLAS is an OpenBLAS with a CBLAS sgemm, `gemm` computes the matrix products on the
kernels' threads too (numpy's BLAS on one thread: one team for the whole step), in the kernels' own tiles where
`contract.small_product` takes them. `set_threads` sets the kernels'
OpenMP threads.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import operator
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

import deepdsl_runtime
from deepdsl_runtime import contract
from deepdsl_runtime.cpu.scratch import Scratch

__all__ = ["Native", "load", "library_path", "generic_library", "sources_digest", "set_blas_threads",
           "threads_available", "BUILD_FLAGS", "KERNELS_DIR", "build_library", "cached_library", "compile_command",
           "find_compiler", "to_build"]

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
# the generic kernels' source, and the runtime's sources of both libraries (a program's .c includes cpu_common.h)
GENERIC_SOURCE = "cpu_ops.c"
KERNEL_SOURCES = ("cpu_ops.c", "cpu_common.h", "cpu_depthwise.c", "cpu_columns.c", "cpu_conv.c", "cpu_blocked.c",
                  "cpu_winograd.c", "cpu_gemm.c", "cpu_images.c", "cpu_attention.c", "deepdsl_math.h",
                  "deepdsl_random.h")
# -ffp-contract=off: no fused multiply-adds, so products and sums round as numpy's do; -fno-trapping-math: selects
# (x > 0 ? v : 0) may be computed branch-free and -fno-math-errno: sqrtf of a per-channel operand moves out of the
# loop (no program reads floating-point exception flags or errno); -O2: gcc's -O3
# made the pooling kernels' short loops several times slower here
# $DEEPDSL_CFLAGS: more flags, after these (`-mno-avx512f`: kernels for a processor without AVX-512, on one with
# it); they enter the libraries' digest, so libraries built with and without them never mix
BUILD_FLAGS = ("-O2", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno",
               "-fno-strict-aliasing", "-shared", "-fPIC", *os.environ.get("DEEPDSL_CFLAGS", "").split())

_F = ctypes.c_float
_F32 = np.dtype(np.float32)
_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_long


def _processor() -> str:
    """What `-march=native` compiles for: the processor's model and feature flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))][:2]
        return "".join(lines) or platform.processor()
    except OSError:
        return platform.machine() + platform.processor()


def sources_digest(program_source: str) -> str:
    """16 hex digits naming a library: the program's C text, the generic kernels, the build flags and the
    processor (one rule for the compiler, which builds the library, and the runtime, which loads it)."""
    h = hashlib.sha256()
    sources = [(KERNELS_DIR / name).read_text() for name in KERNEL_SOURCES]
    for part in (program_source, *sources, " ".join(BUILD_FLAGS), _processor()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def library_path(source: Path) -> Path:
    """Where the library of the C file `source` (`<program>.c`) is: `<program>.<digest>.so` beside it."""
    source = Path(source)
    return source.with_name(f"{source.stem}.{sources_digest(source.read_text())}.so")


def _cache_directory() -> Path | None:
    """deepdsl's directory in the user's cache (`deepdsl_runtime.cache_directory`), made where missing; None where it
    cannot be made or written."""
    path = deepdsl_runtime.cache_directory()
    if not path:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return Path(path) if os.access(path, os.W_OK | os.X_OK) else None


def generic_library(source: Path) -> Path:
    """Where the library of the runtime's generic kernels is for the program whose C file is `source`:
    `deepdsl_cpu.<digest>.so` in the user's cache directory, shared by every program (beside `source` where there
    is no cache directory to write); its digest names the runtime's sources, the flags and the processor."""
    return (_cache_directory() or Path(source).absolute().parent) / f"deepdsl_cpu.{sources_digest('')}.so"


def building(path: Path) -> list[Path]:
    """The partial files of builds of library `path` in progress: `.<name>.<pid>.tmp` of a running process."""
    found = []
    for partial in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            os.kill(int(partial.name.rsplit(".", 2)[-2]), 0)
        except (ValueError, ProcessLookupError):
            continue
        except PermissionError:
            pass
        found.append(partial)
    return found


def _built_meanwhile(path: Path, timeout: float = 300.0) -> bool:
    """Wait for a build of `path` in progress (`deepdsl compile` builds in the background); whether it is there."""
    deadline = time.monotonic() + timeout
    while building(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def load(program) -> tuple["Native | None", str]:
    """(the compiled kernels of the generated program at path `program`: the generic library's and the program's,
    "") or (None, why not)."""
    # absolute: a bare file name would send the dynamic loader to its search path (`python -m mpi4py prog.py` runs
    # a program whose __file__ is relative)
    source = Path(program).absolute().with_suffix(".c")
    if not source.exists():
        return None, f"no {source.name} beside the program"
    try:
        path = library_path(source)
    except OSError as err:
        return None, f"cannot read {source}: {err.strerror or err}"
    generic = generic_library(source)
    for library in (path, generic):            # (a build in progress builds the generic library first)
        if not library.exists() and not _built_meanwhile(library):
            return None, (f"{library.name} is not built (deepdsl compile, or the program's run, builds it with a C "
                          "compiler)")
    deepdsl_runtime.idle_threads_sleep()        # (the program did so before numpy; another caller may not have)
    try:
        return Native(ctypes.CDLL(str(generic)), ctypes.CDLL(str(path))), ""
    except OSError as err:
        return None, f"cannot load {path.name}: {err}"


NO_COMPILER = "no C compiler (cc, gcc or $CC)"


def find_compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_command(source: Path, output: Path, compiler: str | None = None) -> list[str]:
    """The command that builds the library of `source` into `output`."""
    return [compiler or find_compiler() or "cc", *BUILD_FLAGS, "-I", str(KERNELS_DIR), "-o", str(output),
            str(source), "-lm"]


def build_library(source, compiler: str | None = None) -> tuple[Path | None, str]:
    """Build the library of `source` (`<program>.c`) beside it, unless the current one is there (older libraries of
    the program are removed), and the generic kernels' library first where it is missing (`generic_library`): (the
    program's library's path, "") or (None, why not). A library of the same digest built before, for this program
    written elsewhere, is taken from the cache directory (`cached_library`) instead of being built again."""
    source = Path(source)
    compiler = compiler or find_compiler()
    if compiler is None:
        return None, NO_COMPILER
    generic, why = _build(KERNELS_DIR / GENERIC_SOURCE, generic_library(source), compiler)
    if generic is None:
        return None, why
    target = library_path(source)
    cached = cached_library(target)
    if not target.exists() and cached is not None and cached.exists() and _link(cached, target):
        # (the claim of this build that `deepdsl compile` made for this process is done with)
        target.with_name(f".{target.name}.{os.getpid()}.tmp").unlink(missing_ok=True)
        why = ""
    else:
        target, why = _build(source, target, compiler)
        if target is not None and cached is not None and not cached.exists() and _link(target, cached):
            _prune(cached.parent)
    if target is not None:
        for old in source.parent.glob(f"{source.stem}.*.so"):
            if old != target:
                old.unlink(missing_ok=True)
    return target, why


# the programs' libraries kept in the cache directory: at most this many bytes (the least recently used go first)
CACHE_BYTES = 256 << 20


def cached_library(target: Path) -> Path | None:
    """Where the cache directory keeps a copy of the program library `target` (`programs/<program>.<digest>.so`;
    the digest names the program's C text, the runtime's sources, the flags and the processor); None where there
    is no cache directory to write."""
    cache = _cache_directory()
    if cache is None:
        return None
    try:
        os.makedirs(cache / "programs", exist_ok=True)
    except OSError:
        return None
    return cache / "programs" / target.name


def _link(existing: Path, path: Path) -> bool:
    """Put `existing` at `path` (a hard link, else a copy), atomically: whether it is there now. Marks `existing`
    used (its modification time: the cache keeps what was used last)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.link")       # (no build in progress to `building`)
    try:
        os.utime(existing)
        try:
            os.link(existing, partial)
        except OSError:
            shutil.copyfile(existing, partial)
        os.replace(partial, path)
        return True
    except OSError:
        partial.unlink(missing_ok=True)
        return False


def _prune(directory: Path, keep: int | None = None) -> None:
    """Remove the least recently used libraries of `directory` beyond `keep` bytes in all (`CACHE_BYTES`)."""
    keep = CACHE_BYTES if keep is None else keep
    entries = []
    for path in directory.glob("*.so"):
        try:
            stat = path.stat()
        except OSError:             # (removed meanwhile by another process's pruning)
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= keep:
            break
        path.unlink(missing_ok=True)
        total -= size


def _build(source: Path, target: Path, compiler: str) -> tuple[Path | None, str]:
    """Build the library `target` from the C file `source` unless it is there, or another process's build of it
    ends meanwhile: (target, "") or (None, why not). The build writes `.<name>.<pid>.tmp` (a build in progress to
    others, `building`) and renames it, so programs starting together never load a partial file."""
    mine = f".{os.getpid()}.tmp"
    if target.exists() or (any(not p.name.endswith(mine) for p in building(target)) and _built_meanwhile(target)):
        return target, ""
    partial = target.with_name(f".{target.name}{mine}")
    try:
        done = subprocess.run(compile_command(source, partial, compiler), capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        partial.unlink(missing_ok=True)
        return None, f"{compiler} did not run: {err}"
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
        return None, f"{compiler} failed: {first}"
    os.replace(partial, target)
    return target, ""


def to_build(program) -> Path | None:
    """The library a generated program's run should build first (`build_library` of the `.c` beside it): where
    the current one is missing, no build is in progress and there is a C compiler (a program shipped without its
    library, as `generated/`'s are, or written by the Python API); else None."""
    source = Path(program).absolute().with_suffix(".c")
    try:
        target = library_path(source)
    except OSError:
        return None
    if (target.exists() and generic_library(source).exists()) or building(target) or find_compiler() is None:
        return None
    return target


def _numpy_passes():
    """The convolutions' numpy passes, which the compiled ones fall back to on arrays they do not take."""
    from deepdsl_runtime.cpu.conv import _NUMPY       # (conv takes a Native: imported when first needed)
    return _NUMPY


def _plain(floats: np.ndarray, out: np.ndarray, ids: np.ndarray) -> bool:
    """Contiguous float32 arrays and int32 row numbers, as the row kernels take them."""
    return (floats.dtype == out.dtype == np.float32 and ids.dtype == np.int32 and floats.flags.c_contiguous
            and out.flags.c_contiguous and ids.flags.c_contiguous)


class Native:
    """The kernels of the loaded libraries: the generic one's, and the program's where it has its own."""

    def __init__(self, lib: ctypes.CDLL, program: ctypes.CDLL | None = None):
        """`lib`: the generic kernels' library; `program`: the program's own (its elementwise kernels and
        per-channel sums), if any."""
        self.lib = lib
        self.program = program if program is not None else lib
        lib.deepdsl_im2col.argtypes = [_P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P]
        lib.deepdsl_swap01.argtypes = [_P, _L, _L, _L, _P, _P]
        lib.deepdsl_col2im.argtypes = [_P, _L, _L, _L, _L, _I, _I, _I, _I, _I, _I, _I, _I, _P]
        lib.deepdsl_add_bias.argtypes = [_P, _L, _L, _L, _P]
        lib.deepdsl_shifted_sums.argtypes = [_P, _L, _P, _L, _L, _L, _L, _L, _L, _L, _L, _L, _P]
        lib.deepdsl_max_pool.argtypes = [_P, _L, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I]
        lib.deepdsl_max_pool_bwd.argtypes = [_P, _P, _L, _I, _I, _I, _I, _I, _I, _I, _P]
        # (nor average pooling)
        self._avg_pool = getattr(lib, "deepdsl_avg_pool", None)
        self._avg_pool_bwd = getattr(lib, "deepdsl_avg_pool_bwd", None)
        if self._avg_pool is not None:
            self._avg_pool.argtypes = self._avg_pool_bwd.argtypes = [_P, _L] + [_I] * 8 + [_P]
        lib.deepdsl_lrn.argtypes = [_P, _L, _L, _L, _I, _F, _F, _F, _P, _P]
        lib.deepdsl_lrn_bwd.argtypes = [_P, _P, _L, _L, _L, _I, _F, _F, _F, _F, _F, _P, _P, _P]
        lib.deepdsl_layer_norm.argtypes = [_P, _P, _P, _L, _L, _F, _P]
        lib.deepdsl_layer_norm_grad.argtypes = [_P, _P, _P, _L, _L, _F, _P]
        lib.deepdsl_layer_norm_param_grad.argtypes = [_P, _P, _L, _L, _F, _L, _P, _P]
        depthwise = [_I] * 10 + [_P]           # m, c, h, w, kh, kw, ho, wo, stride, pad, output
        lib.deepdsl_depthwise.argtypes = [_P, _P, _P] + depthwise
        lib.deepdsl_depthwise_bwd_data.argtypes = [_P, _P] + depthwise
        lib.deepdsl_depthwise_bwd_filter.argtypes = [_P, _P] + depthwise
        lib.deepdsl_direct_conv.argtypes = [_P, _P, _P] + [_I] * 10 + [_P]
        lib.deepdsl_conv_tiles.argtypes = [_P, _P, _P] + [_I] * 11 + [_P, _L, _P]
        lib.deepdsl_conv_tiles.restype = _I
        lib.deepdsl_conv_data_tiles.argtypes = [_P, _P] + [_I] * 11 + [_P, _L, _P]
        lib.deepdsl_conv_data_tiles.restype = _I
        lib.deepdsl_direct_conv_bwd_filter.argtypes = [_P, _P] + [_I] * 10 + [_P]
        lib.deepdsl_take_rows.argtypes = [_P, _P, _L, _L, _L, _P]
        lib.deepdsl_label_rank.argtypes = [_P, _P, _L, _L, _P]
        lib.deepdsl_log_softmax.argtypes = [_P, _L, _L, _P]
        lib.deepdsl_equal_tokens.argtypes = [_P, _L, _I, _P]
        lib.deepdsl_add_rows.argtypes = [_P, _P, _L, _L, _L, _P]
        lib.deepdsl_set_threads.argtypes = [_I]
        lib.deepdsl_threads.restype = _I
        lib.deepdsl_gemm.argtypes = [_L, _I, _I, _L, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _L, _I, _L, _L]
        lib.deepdsl_gemm.restype = _I
        # (the products' functions of one argument, the array of a `_ProductCall`, which ctypes passes as it is: no
        # argument types, whose conversion took about 0.5 us a call)
        lib.deepdsl_gemm_args.restype = _I
        lib.deepdsl_set_sgemm.argtypes = [_P, _I]
        # (nor products in tiles of their own)
        self._small_gemm_args = getattr(lib, "deepdsl_small_gemm_args", None)
        if self._small_gemm_args is not None:
            self._small_gemm_args.restype = _I
        # (nor dot products streaming a long b read transposed)
        self._dot_gemm_args = getattr(lib, "deepdsl_dot_gemm_args", None)
        if self._dot_gemm_args is not None:
            self._dot_gemm_args.restype = _I
        self._small_gemm_depth = getattr(lib, "deepdsl_small_gemm_depth", None)
        if self._small_gemm_depth is not None:
            self._small_gemm_depth.argtypes = [_I, _I, _L, _L, _L, _P, _L, _P, _L, _P, _L, _P]
            self._small_gemm_depth.restype = _I
        # the operands' layouts -> how `gemm` computes their product (`_product_plan`)
        self._product_plans: dict[tuple, object] = {}
        # ... and the workspace's -> how `gemm_in_depth` computes it (`_depth_plan`)
        self._depth_plans: dict[tuple, object] = {}
        # (a library built for a processor without AVX2 and fused multiply-adds has no tiles)
        self.tiles = self._small_gemm_args is not None and bool(lib.deepdsl_small_gemm_kernels())
        # (nor sums of products)
        self._gemm_sum = getattr(lib, "deepdsl_gemm_sum", None)
        if self._gemm_sum is not None:
            self._gemm_sum.argtypes = [_L, _I, _I, _L, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _I, _L, _L]
            self._gemm_sum.restype = _I
        self._small_gemm_sum = getattr(lib, "deepdsl_small_gemm_sum", None) if self.tiles else None
        if self._small_gemm_sum is not None:
            self._small_gemm_sum.argtypes = [_L, _I, _I, _L, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L]
            self._small_gemm_sum.restype = _I
        # (nor products cut along their inner dimension)
        self._gemm_depth = getattr(lib, "deepdsl_gemm_depth", None)
        if self._gemm_depth is not None:
            self._gemm_depth.argtypes = [_I, _I, _L, _L, _L, _P, _L, _P, _L, _P, _L, _L, _L, _P]
            self._gemm_depth.restype = _I
        # (a library built from the C file of an older program has no per-channel sum of a tensor)
        self._channel_sum = getattr(self.program, "deepdsl_channel_sum", None)
        if self._channel_sum is not None:
            self._channel_sum.argtypes = [_L, _L, _L, _P, _P]
            self._channel_sum.restype = _I
        # (nor attention's passes over rows)
        self._attention_weights = getattr(lib, "deepdsl_attention_weights", None)
        self._attention_dscores = getattr(lib, "deepdsl_attention_dscores", None)
        self._attention_kept = getattr(lib, "deepdsl_attention_kept", None)
        if self._attention_weights is not None:
            self._attention_weights.argtypes = [_P, _L, _L, _L, _L, _F, _P, _P, _L, _L, _I]
            self._attention_dscores.argtypes = [_P, _P, _P, _L, _L, _L, _L, _L, _F, _P, _L, _F]
            self._attention_kept.argtypes = [_P, _P, _P, _L, _L, _L, _L, _F]
        # (nor attention of small units on the stack)
        self._attention_units = getattr(lib, "deepdsl_attention_units", None)
        self._attention_units_grad = getattr(lib, "deepdsl_attention_units_grad", None)
        if self._attention_units is not None:
            common = [_L] * 6 + [_F, _P, _P, _L, _L, _I, _P, _L, _F]
            self._attention_units.argtypes = [_P] * 4 + common
            self._attention_units.restype = _I
            self._attention_units_grad.argtypes = [_P] * 8 + common
            self._attention_units_grad.restype = _I
        # (nor a swap of any two axes)
        self._swap_axes = getattr(lib, "deepdsl_swap_axes", None)
        if self._swap_axes is not None:
            self._swap_axes.argtypes = [_P, _L, _L, _L, _L, _L, _P]
        # (nor the plain copies and padded planes of the kernels' Python)
        self._copy = getattr(lib, "deepdsl_copy", None)
        self._pad_planes = getattr(lib, "deepdsl_pad_planes", None)
        self._accumulate = getattr(lib, "deepdsl_accumulate", None)
        if self._copy is not None:
            self._copy.argtypes = self._accumulate.argtypes = [_P, _L, _P]
            self._pad_planes.argtypes = [_P, _L, _L, _L, _L, _P]
        # (nor dropout's masks)
        self._bernoulli = getattr(lib, "deepdsl_bernoulli", None)
        if self._bernoulli is not None:
            self._bernoulli.argtypes = [_P, _L, ctypes.c_ulonglong, ctypes.c_ulonglong, _F]
        # (nor pointwise filter gradients straight from their operands)
        self._pointwise_filter = getattr(lib, "deepdsl_pointwise_filter", None)
        if self._pointwise_filter is not None:
            self._pointwise_filter.argtypes = [_P, _P, _I, _I, _I, _L, _P]
        # (nor direct convolutions on channel-blocked copies; nor has a library built for a processor without AVX2
        # and fused multiply-adds)
        blocked = getattr(lib, "deepdsl_blocked_kernels", None)
        self.lanes = 0 if blocked is None else blocked()     # their vectors' lanes: 16 (AVX-512), 8 (AVX2), 0
        self.blocked = self.lanes > 0
        # (nor Winograd's transforms for the blocked 3x3 layers; $DEEPDSL_WINOGRAD=0 turns them off: the direct sums,
        # whose rounding is the products' alone)
        # (a library of the kernels before the filters' transform from their own layout has none taken here)
        self.winograd_kernels = self.blocked and bool(getattr(lib, "deepdsl_winograd_kernels", lambda: 0)()) and \
            hasattr(lib, "deepdsl_winograd_transform") and os.environ.get("DEEPDSL_WINOGRAD", "1") != "0"
        self.winograd = self.winograd_kernels      # (taken where they are; benchmarks turn them off to compare)
        if self.winograd_kernels:
            lib.deepdsl_winograd_transform.argtypes = [_P] + [_I] * 5 + [_P]
            lib.deepdsl_winograd_conv.argtypes = [_P, _P, _P] + [_I] * 8 + [_P, _P, _P]
        # (and of the filter gradients: a library of the kernels before them has the others alone)
        self.winograd_filter_grads = self.winograd_kernels and hasattr(lib, "deepdsl_winograd_filter_sums")
        if self.winograd_filter_grads:
            lib.deepdsl_winograd_filter_sums.argtypes = [_P, _P] + [_I] * 9 + [_P, _P, _P]
            lib.deepdsl_winograd_filter_out.argtypes = [_P, _I, _I, _P]
        # (and of the filter gradients by pairs: a library of the kernels before them takes their layers by im2col)
        self.winograd_pair_kernels = self.winograd_filter_grads and hasattr(lib, "deepdsl_winograd_filter_pairs")
        if self.winograd_pair_kernels:
            lib.deepdsl_winograd_filter_pairs.argtypes = [_P, _P] + [_I] * 7 + [_P, _P, _P]
        self.tiled_convs = True         # convolutions sample by sample in the products' tiles (`conv_tiles`, ...)
        if self.blocked:
            lib.deepdsl_blocked_input.argtypes = [_P] + [_I] * 6 + [_P]
            lib.deepdsl_blocked_filters.argtypes = [_P] + [_I] * 5 + [_P]
            lib.deepdsl_blocked_conv.argtypes = [_P, _P, _P] + [_I] * 7 + [_P]
            lib.deepdsl_blocked_conv_bwd_filter.argtypes = [_P, _P] + [_I] * 8 + [_P]
            lib.deepdsl_unblocked_filters.argtypes = [_P] + [_I] * 4 + [_P]
        # (nor the thin layers' filter gradients of any stride, `contract.thin_filter`)
        self.thin_filter_kernels = self.blocked and hasattr(lib, "deepdsl_thin_filter")
        self.thin_filters = self.thin_filter_kernels    # (taken where they are; benchmarks turn them off to compare)
        if self.thin_filter_kernels:
            lib.deepdsl_thin_filter.argtypes = [_P, _P] + [_I] * 11 + [_P]
            lib.deepdsl_thin_filter_out.argtypes = [_P] + [_I] * 4 + [_P]
        # (nor the render of images read from files)
        self._resample = getattr(lib, "deepdsl_resample_image", None)
        if self._resample is not None:
            self._resample.argtypes = [_P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _I, _I, _P, _P, _P, _P]
        sgemm = blas_sgemm()
        if sgemm is not None:
            lib.deepdsl_set_sgemm(sgemm[0], int(sgemm[1]))
        self.products = sgemm is not None
        # (kernel, output shape, operand shapes) -> (function, pattern, size arguments), or False
        self._ew: dict[tuple, object] = {}
        # (values' shape, sum's shape) -> `deepdsl_channel_sum`'s rows, or False (`channel_sum`)
        self._sum_rows: dict[tuple, object] = {}

    @property
    def tiles(self) -> bool:
        """Whether `gemm` computes the products `contract.small_product` takes in the kernels' own tiles."""
        return self._tiles

    @tiles.setter
    def tiles(self, value: bool) -> None:
        self._tiles = bool(value)
        self._product_plans.clear()
        self._depth_plans.clear()

    @property
    def products(self) -> bool:
        """Whether matrix products run on the kernels' threads (`gemm`), numpy's BLAS on one thread of its own."""
        return self._products_here

    @products.setter
    def products(self, value: bool) -> None:
        self._products_here = bool(value)
        self._product_plans.clear()
        self._depth_plans.clear()

    @property
    def threads(self) -> int:
        return self.lib.deepdsl_threads()

    def set_threads(self, threads: int) -> None:
        """Run the kernels, and the matrix products where this library computes them, on `threads` threads (numpy's
        BLAS on one: each thread of the kernels' calls it for parts of a product). No result depends on them."""
        self.lib.deepdsl_set_threads(int(threads))
        set_blas_threads(1)

    # matrix products ------------------------------------------------------------------------------------------

    def gemm(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = a @ b as `np.matmul(a, b, out=out)` computes it (matrices, or stacks of them broadcast against each
        other; transposed views read in place), on the kernels' threads (kernels/cpu_gemm.c): in the kernels' own
        tiles where `contract.small_product` takes it (`deepdsl_small_gemm`), else the BLAS's sgemm computing each
        part of the cut `contract.product_cuts` fixes by the shapes. What the library cannot address (another
        dtype, a view with strides of its own, an output over an operand) runs np.matmul; a stack that is not one
        stride apart, one product per leading index. How is decided once for each layout of the operands
        (`_product_plan`)."""
        plan = self._planned(a, b, out)
        if plan is None:
            return np.matmul(a, b, out=out)
        if plan == "each":                      # one stride apart below the first axis, maybe
            if np.may_share_memory(out, a) or np.may_share_memory(out, b):
                return np.matmul(a, b, out=out)
            for i in range(out.shape[0]):
                self.gemm(_index(a, i, out.ndim - 2), _index(b, i, out.ndim - 2), out[i])
            return out
        if not plan(_address(a), _address(b), _address(out)):
            return np.matmul(a, b, out=out)     # (0: an output over an operand, or no sgemm to call)
        return out

    def _planned(self, a: np.ndarray, b: np.ndarray, out: np.ndarray):
        """`_product_plan` of these operands' layouts, made once for each."""
        key = (a.shape, a.strides, a.dtype.num, b.shape, b.strides, b.dtype.num, out.shape, out.strides,
               out.dtype.num)
        plan = self._product_plans.get(key, False)
        if plan is False:
            plan = self._product_plans[key] = self._product_plan(a, b, out)
        return plan

    def _product_plan(self, a: np.ndarray, b: np.ndarray, out: np.ndarray):
        """How `gemm` computes out = a @ b for operands laid out as these: None (numpy's matmul), "each" (a product
        per index of the first leading axis), or the library's call (`_ProductCall`). Whether the output lies apart
        from the operands is asked on every call, not here."""
        layout = self._layout(a, b, out, apart=False)
        if layout is None:
            return None
        m, n, k, ta, tb, to = layout
        lead = out.shape[:-2]
        sa, sb, sc = _stack(a, lead), _stack(b, lead), _stack(out, lead)
        if sa is None or sb is None or sc is None:
            if not lead or lead != np.broadcast_shapes(a.shape[:-2], b.shape[:-2], lead):
                return None
            return "each"
        if 0 in (m, n, k, *lead):
            return None
        batch = math.prod(lead)
        head, operands = (batch, ta[0], tb[0], m, n, k), ((ta[1], sa), (tb[1], sb), (to[1], sc))
        if self.tiles and self._dot_gemm_args is not None and \
                contract.dot_product(m, n, k, bool(ta[0]), bool(tb[0]), self.lanes):
            return _ProductCall(self._dot_gemm_args, head, operands, (0,), (a, b, out))
        if self._small(m, n, k, ta, tb):
            return _ProductCall(self._small_gemm_args, head, operands, (0,), (a, b, out))
        return _ProductCall(self.lib.deepdsl_gemm_args, head, operands,
                            (*contract.product_cuts(batch, m, n, k), 0), (a, b, out))

    def gemm_bias(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray) -> bool:
        """out (m x n) = a @ b + bias, the bias (n,) added to every row, in one call of the library: as `gemm`
        computes the product, the tiles adding the bias to each output as they store it finished, the BLAS's parts
        after the product; the bits of the product and then an elementwise add. False where the library does not
        (more than two axes, a bias that is not n contiguous float32 apart from the output, a product `gemm` leaves
        to numpy): the caller computes the product and adds the bias."""
        if out.ndim != 2 or bias.dtype != np.float32 or bias.shape != out.shape[1:] or not bias.flags.c_contiguous:
            return False
        plan = self._planned(a, b, out)
        return isinstance(plan, _ProductCall) and plan(_address(a), _address(b), _address(out), _address(bias))

    def gemm_sum(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
        """out = the sum over i of a[i] @ b[i] (stacks of matrices one stride apart), in order, without workspace:
        in the kernels' tiles where `contract.tiled_sum` takes them (`deepdsl_small_gemm_sum`: product after
        product added to the output), else by the BLAS (`deepdsl_gemm_sum`: the output cut into the parts
        `contract.product_cuts` gives one product of the whole depth, each part summed by the sgemm product after
        product). False where the library cannot address the operands."""
        if self._gemm_sum is None or a.ndim != 3 or b.ndim != 3 or out.ndim != 2 or a.shape[0] != b.shape[0]:
            return False
        layout = self._layout(a[0], b[0], out)
        sa, sb = _stack(a, a.shape[:1]), _stack(b, b.shape[:1])
        if layout is None or sa is None or sb is None or 0 in (*a.shape, *b.shape):
            return False
        m, n, k, ta, tb, to = layout
        batch = a.shape[0]
        if self._small_gemm_sum is not None and contract.tiled_sum(m, n, k, bool(ta[0]), bool(tb[0]), self.lanes):
            return bool(self._small_gemm_sum(batch, ta[0], tb[0], m, n, k, _address(a), ta[1], sa, _address(b),
                                             tb[1], sb, _address(out), to[1]))
        by_columns, parts, width = contract.product_cuts(1, m, n, k * batch)
        return bool(self._gemm_sum(batch, ta[0], tb[0], m, n, k, _address(a), ta[1], sa, _address(b), tb[1], sb,
                                   _address(out), to[1], int(by_columns), parts, width))

    def gemm_in_depth(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, workspace: np.ndarray) -> bool:
        """out = a @ b of two matrices with their inner dimension cut, partial products in `workspace`; False where
        it is not (`gemm` computes the product). The BLAS's sgemm computes the parts `contract.product_depth_cut`
        fixes by the shapes (`deepdsl_gemm_depth`) where the workspace holds `contract.product_depth_scratch`. A
        product of the kernels' own tiles (`contract.small_product`) whose output the cut would leave whole is
        computed on several threads chunk by chunk of its inner dimension, each chunk's partial sums in a plane of
        the workspace (`deepdsl_small_gemm_depth`, the same bits as `gemm`), where the workspace holds a plane for
        each chunk but the first (on one thread, the tiles' product whole). How is decided once for each layout of
        the operands."""
        key = (a.shape, a.strides, a.dtype.num, b.shape, b.strides, b.dtype.num, out.shape, out.strides,
               out.dtype.num, workspace.size, workspace.dtype.num, workspace.flags.c_contiguous)
        plan = self._depth_plans.get(key, False)
        if plan is False:
            plan = self._depth_plans[key] = self._depth_plan(a, b, out, workspace)
        if plan is None:
            return False
        function, head, (lda, ldb, ldc), tail, extents = plan
        pa, pb, pc = _address(a), _address(b), _address(out)
        return _apart(extents, pa, pb, pc) and bool(function(*head, pa, lda, pb, ldb, pc, ldc, *tail,
                                                             _address(workspace)))

    def _depth_plan(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, workspace: np.ndarray):
        """How `gemm_in_depth` computes out = a @ b for operands and a workspace laid out as these: None (it does
        not), or (the library's function, its arguments before a's pointer, a's, b's and out's distances between
        rows or columns, its arguments between out's pointer and the workspace's, the three arrays' `_extent`s)."""
        layout = self._layout(a, b, out, apart=False)
        if layout is None or a.ndim != 2 or b.ndim != 2 or out.ndim != 2 or workspace.dtype != np.float32 or \
                not workspace.flags.c_contiguous:
            return None
        m, n, k, ta, tb, to = layout
        head, lds, extents = (ta[0], tb[0], m, n, k), (ta[1], tb[1], to[1]), tuple(map(_extent, (a, b, out)))
        if self._small(m, n, k, ta, tb):
            chunks = contract.small_product_chunks(1, m, n, k, bool(ta[0]), bool(tb[0]), self.lanes)
            if chunks < 2 or self._small_gemm_depth is None or workspace.size < (chunks - 1) * m * n:
                return None
            return self._small_gemm_depth, head, lds, (), extents
        parts = contract.product_depth_cut(1, m, n, k)
        if self._gemm_depth is None or parts < 2 or workspace.size < (parts - 1) * m * n:
            return None
        return self._gemm_depth, head, lds, (parts, -(-k // parts)), extents

    def _small(self, m: int, n: int, k: int, ta, tb) -> bool:
        """Whether this library computes the product in its own tiles (`contract.small_product`)."""
        return self.tiles and contract.small_product(m, n, k, bool(ta[0]), bool(tb[0]), self.lanes)

    def _layout(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, apart: bool = True):
        """(m, n, k, a's, b's and out's `_matrix`) of out = a @ b where the library's sgemm reads the operands and
        writes the output in place (float32 matrices or stacks of them, the output stored by rows apart from the
        operands: `apart=False` leaves that to the caller), else None."""
        if not self.products or a.ndim < 2 or b.ndim < 2 or out.ndim < 2 or \
                not a.dtype == b.dtype == out.dtype == np.float32 or \
                apart and (np.may_share_memory(out, a) or np.may_share_memory(out, b)):
            return None
        m, k = a.shape[-2:]
        n = out.shape[-1]
        ta, tb, to = _matrix(a), _matrix(b), _matrix(out)
        if ta is None or tb is None or to is None or to[0] or out.shape[-2] != m or b.shape[-2:] != (k, n):
            return None
        return m, n, k, ta, tb, to

    # convolution ----------------------------------------------------------------------------------------------

    def resample_image(self, image: np.ndarray, ys: np.ndarray, wy: np.ndarray, xs: np.ndarray, wx: np.ndarray,
                       scale: np.ndarray, bias: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> bool:
        """`image_transforms.render`'s pass (kernels/cpu_images.c): the uint8 (H, W, C) image resampled by the rows
        (ys, wy) and columns (xs, wx) into float32 (C, OH, OW) `out`, x scale + bias; False where this library has
        no such kernel (the caller runs numpy's, with the same bits)."""
        if self._resample is None or not (image.flags.c_contiguous and out.flags.c_contiguous):
            return False
        h, w, c = image.shape
        args = [np.ascontiguousarray(a, dtype) for a, dtype in ((ys, np.int32), (wy, np.float32), (xs, np.int32),
                                                                 (wx, np.float32), (scale, np.float32),
                                                                 (bias, np.float32))]
        ys, wy, xs, wx, scale, bias = args
        self._resample(_address(image), h, w, c, _address(ys), _address(wy), len(ys), wy.shape[1],
                       _address(xs), _address(wx), len(xs), wx.shape[1], _address(scale), _address(bias),
                       _address(out), _address(scratch))
        return True

    def im2col(self, x: np.ndarray, cols: np.ndarray, stride: int, pad: int, scratch=None) -> None:
        """`cols` (C, kh, kw, m, Ho, Wo) of the m samples of `x`, read through its (m, C, kh, kw, Ho, Wo)
        transposed view as runtime/cpu/conv.py passes it (no scratch: padding is read as zeros)."""
        base = cols.transpose(1, 2, 3, 0, 4, 5)
        if not (x.flags.c_contiguous and base.flags.c_contiguous):
            return _numpy_passes().im2col(x, cols, stride, pad, scratch)
        m, c, h, w = x.shape
        _, kh, kw, _, ho, wo = base.shape
        self.lib.deepdsl_im2col(_address(x), m, c, h, w, kh, kw, ho, wo, stride, pad, _address(base))

    def col2im(self, dcols: np.ndarray, out: np.ndarray, stride: int, pad: int) -> None:
        """out (m, C, H, W) = the col2im of the column gradients `dcols`, an (m, C, kh, kw, Ho, Wo) view whose
        (C, kh, kw) rows are evenly spaced and (Ho, Wo) planes contiguous (`deepdsl_col2im`)."""
        m, c, kh, kw, ho, wo = dcols.shape
        ss, cs, is_, js, ps, qs = (st // 4 for st in dcols.strides)
        if not (out.flags.c_contiguous and dcols.dtype == np.float32 and qs == 1 and ps == wo and is_ == kw * js
                and cs == kh * is_):
            return _numpy_passes().col2im(dcols, out, stride, pad)
        h, w = out.shape[2:]
        self.lib.deepdsl_col2im(_address(dcols), ss, js, m, c, h, w, kh, kw, ho, wo, stride, pad, _address(out))

    def swap01(self, src: np.ndarray, dst: np.ndarray, bias: np.ndarray | None = None) -> None:
        """dst = src with its first two axes swapped (dst contiguous (B, A, ...) from contiguous (A, B, ...)), plus
        bias[a] when given (the sum numpy's `np.add(src, bias)` makes, element for element)."""
        a, b = src.shape[:2]
        if not (src.flags.c_contiguous and dst.flags.c_contiguous and (bias is None or bias.flags.c_contiguous)):
            return _numpy_passes().swap01(src, dst, bias)
        self.lib.deepdsl_swap01(_address(src), a, b, src.size // max(a * b, 1),
                                None if bias is None else _address(bias), _address(dst))

    def swap_axes(self, src: np.ndarray, dst: np.ndarray, axes: tuple[int, int]) -> bool:
        """dst = src with axes (i, j), i < j, swapped, dst contiguous (`deepdsl_swap_axes`); False for other
        arrays (not contiguous float32)."""
        if self._swap_axes is None or not _contiguous32(src, dst):
            return False
        i, j = axes
        shape = src.shape
        self._swap_axes(_address(src), math.prod(shape[:i]), shape[i], math.prod(shape[i + 1:j]), shape[j],
                        math.prod(shape[j + 1:]), _address(dst))
        return True

    def copy(self, src: np.ndarray, dst: np.ndarray) -> bool:
        """dst = src, arrays of one size apart, contiguous float32 (`deepdsl_copy`: on the kernels' threads, and a
        call a step's replay makes again where numpy's copy would be the op's Python); False (nothing written) for
        other arrays."""
        return self._elements(self._copy, src, dst)

    def accumulate(self, src: np.ndarray, dst: np.ndarray) -> bool:
        """dst += src, arrays of one size apart, contiguous float32 (`deepdsl_accumulate`: numpy's float32 sums, on
        the kernels' threads); False (nothing written) for other arrays."""
        return self._elements(self._accumulate, src, dst)

    @staticmethod
    def _elements(function, src: np.ndarray, dst: np.ndarray) -> bool:
        """`function(src, size, dst)` over two contiguous float32 arrays of one size; False where it cannot."""
        if function is None or src.size != dst.size or not _contiguous32(src, dst):
            return False
        function(_address(src), src.size, _address(dst))
        return True

    def pad_planes(self, x: np.ndarray, pad: int, out: np.ndarray) -> bool:
        """out (..., H + 2 pad, W + 2 pad) = x (..., H, W) with `pad` zeros around each plane
        (`deepdsl_pad_planes`); False (nothing written) for arrays not contiguous float32."""
        if self._pad_planes is None or not _contiguous32(x, out):
            return False
        h, w = x.shape[-2:]
        self._pad_planes(_address(x), x.size // max(h * w, 1), h, w, pad, _address(out))
        return True

    def depthwise(self, op: str, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, out: np.ndarray,
                  stride: int, pad: int) -> bool:
        """A depthwise convolution (groups = channels = filters) or one of its gradients, plane by plane: `op` is
        "conv2d" (a the input, b the filters), "conv2d_bwd_data" (a the output gradient, b the filters) or
        "conv2d_bwd_filter" (a the output gradient, b the input). False (nothing written) for arrays it does not
        take."""
        arrays = [a, b, out] + ([bias] if bias is not None else [])
        if not all(t.flags.c_contiguous and t.dtype == np.float32 for t in arrays):
            return False
        if op == "conv2d":
            (m, c, h, w), (kh, kw), (ho, wo) = a.shape, b.shape[2:], out.shape[2:]
            self.lib.deepdsl_depthwise(_address(a), _address(b), None if bias is None else _address(bias),
                                       m, c, h, w, kh, kw, ho, wo, stride, pad, _address(out))
        elif op == "conv2d_bwd_data":
            (m, c, ho, wo), (kh, kw), (h, w) = a.shape, b.shape[2:], out.shape[2:]
            self.lib.deepdsl_depthwise_bwd_data(_address(a), _address(b), m, c, h, w, kh, kw, ho, wo, stride, pad,
                                                _address(out))
        else:
            (m, c, ho, wo), (h, w), (kh, kw) = a.shape, b.shape[2:], out.shape[2:]
            self.lib.deepdsl_depthwise_bwd_filter(_address(a), _address(b), m, c, h, w, kh, kw, ho, wo, stride,
                                                  pad, _address(out))
        return True

    def direct(self, op: str, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, out: np.ndarray,
               stride: int, pad: int) -> bool:
        """A thin convolution (`contract.direct_conv`) or its filter gradient straight from the input, no im2col
        matrix: `op` "conv2d" (a the input, b the filters) or "conv2d_bwd_filter" (a the output gradient, b the
        input). False (nothing written) for other convolutions and arrays it does not take."""
        if op == "conv2d":
            (m, c, h, w), (o, per_group, kh, kw), (ho, wo) = a.shape, b.shape, out.shape[2:]
        else:
            (m, o, ho, wo), (c, h, w), (per_group, kh, kw) = a.shape, b.shape[1:], out.shape[1:]
        arrays = [a, b, out] + ([bias] if bias is not None else [])
        if not contract.direct_conv(c, kh, kw, stride, c // per_group) or not _contiguous32(*arrays):
            return False
        if op == "conv2d":
            self.lib.deepdsl_direct_conv(_address(a), _address(b), None if bias is None else _address(bias),
                                         m, c, h, w, o, kh, kw, ho, wo, pad, _address(out))
        else:
            self.lib.deepdsl_direct_conv_bwd_filter(_address(a), _address(b), m, c, h, w, o, kh, kw, ho, wo, pad,
                                                    _address(out))
        return True

    def conv_tiles(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray, stride: int,
                   pad: int, workspace: np.ndarray | None) -> bool:
        """A convolution whose products per sample the tiles compute (`contract.tiled_conv`), sample by sample on
        the kernels' threads, each sample's im2col matrix in the thread's part of the workspace
        (`deepdsl_conv_tiles`): the bits of its im2col matrix's product in the tiles, plus the bias. False (nothing
        written) where the workspace holds no sample's matrix, the arrays are not contiguous float32 or this
        processor has no tiles."""
        (n, c, h, wd), (o, _, kh, kw), (ho, wo) = x.shape, w.shape, out.shape[2:]
        arrays = [x, w, out] + ([bias] if bias is not None else [])
        if not (self.tiles and self.tiled_convs) or not contract.tiled_conv(c, o, kh, kw, stride, pad, ho, wo) or \
                workspace is None or \
                not _contiguous32(*arrays, workspace):
            return False
        room = workspace.size // (c * kh * kw * ho * wo)
        return room > 0 and bool(self.lib.deepdsl_conv_tiles(
            _address(x), _address(w), None if bias is None else _address(bias), n, c, h, wd, o, kh, kw, ho, wo,
            stride, pad, _address(workspace), room, _address(out)))

    def conv_data_tiles(self, g: np.ndarray, w: np.ndarray, out: np.ndarray, stride: int, pad: int,
                        workspace: np.ndarray | None) -> bool:
        """The input gradient of a convolution whose column gradients per sample the tiles compute
        (`contract.tiled_conv`, "conv2d_bwd_data"), sample by sample on the kernels' threads, each sample's in the
        thread's part of the workspace, then added into its input gradient (`deepdsl_conv_data_tiles`). False
        (nothing written) where the workspace holds no sample's column gradients, the arrays are not contiguous
        float32, the input gradient shares bytes with the output gradient, or this processor has no tiles."""
        (n, o, ho, wo), (_, c, kh, kw), (h, wd) = g.shape, w.shape, out.shape[2:]
        if not (self.tiles and self.tiled_convs) or workspace is None or \
                not contract.tiled_conv(c, o, kh, kw, stride, pad, ho, wo, op="conv2d_bwd_data") or \
                not _contiguous32(g, w, out, workspace) or np.may_share_memory(g, out):
            return False
        room = workspace.size // (c * kh * kw * ho * wo)
        return room > 0 and bool(self.lib.deepdsl_conv_data_tiles(
            _address(g), _address(w), n, c, h, wd, o, kh, kw, ho, wo, stride, pad, _address(workspace), room,
            _address(out)))

    def pointwise_filter(self, g: np.ndarray, x: np.ndarray, out: np.ndarray) -> bool:
        """out (O, C, 1, 1) = the filter gradient of a pointwise convolution (`contract.pointwise_filter`) from its
        output gradient g (m, O, H, W) and input x (m, C, H, W), read in place (`deepdsl_pointwise_filter`); False
        where the library has no such kernel or the arrays are not contiguous float32."""
        if self._pointwise_filter is None or not _contiguous32(g, x, out):
            return False
        m, o, h, w = g.shape
        self._pointwise_filter(_address(g), _address(x), m, o, x.shape[1], h * w, _address(out))
        return True

    # blocked copies (kernels/cpu_blocked.c; `self.blocked`: the library has them): the caller,
    # runtime/cpu/conv.py's `_blocked`, checks the arrays (contiguous float32) and carves the copies out of its
    # workspace

    def block_input(self, x: np.ndarray, ph: int, pw: int, out: np.ndarray) -> None:
        """out (m, ceil(C/16), H + 2 ph, W + 2 pw, 16) = x (m, C, H, W) blocked, zeros around it and past C."""
        m, c, h, w = x.shape
        self.lib.deepdsl_blocked_input(_address(x), m, c, h, w, ph, pw, _address(out))

    def block_filters(self, w: np.ndarray, flip: bool, out: np.ndarray) -> None:
        """out = the filters w (O, C, kh, kw) blocked (ceil(O/16), ceil(C/16), kh, kw, 16, 16), or with `flip` those
        of the input gradient's convolution (ceil(C/16), ceil(O/16), kh, kw, 16, 16; the kernel turned around)."""
        self.lib.deepdsl_blocked_filters(_address(w), *w.shape, int(flip), _address(out))

    def blocked_conv(self, xb: np.ndarray, wb: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> None:
        """out (m, O, Ho, Wo) = the stride-1 convolution of the blocked, padded input xb (m, cb, Hp, Wp, 16) with the
        blocked filters wb (ceil(O/16), cb, kh, kw, 16, 16), + bias (O) when given."""
        m, cb, hp, wp, _ = xb.shape
        kh, kw = wb.shape[2:4]
        self.lib.deepdsl_blocked_conv(_address(xb), _address(wb), None if bias is None else _address(bias),
                                      m, cb, hp, wp, out.shape[1], kh, kw, _address(out))

    def winograd_transform(self, w: np.ndarray, flip: bool, b0: int, b1: int, out: np.ndarray) -> None:
        """out (36 points of (b1 - b0, ib, 16, 16), each followed by contract.WINOGRAD_SKEW floats) = the filters of
        output blocks [b0, b1) of the convolution whose filters are w (O, C, 3, 3) (`flip`: of its input gradient, as
        `block_filters`'), ib its blocks of inputs, in Winograd's F(4x4, 3x3) transform (kernels/cpu_winograd.c)."""
        self.lib.deepdsl_winograd_transform(_address(w), w.shape[0], w.shape[1], int(flip), b0, b1, _address(out))

    def winograd_conv(self, xb: np.ndarray, u: np.ndarray, bias: np.ndarray | None, v: np.ndarray,
                      products: np.ndarray, out: np.ndarray, b0: int, b1: int, transformed: bool) -> None:
        """Output blocks [b0, b1) of out (m, O, Ho, Wo) = the stride-1 3x3 convolution of the blocked input xb (m, cb,
        Ho + 2, Wo + 2, 16) with those blocks' transformed filters u (`winograd_transform`), + bias (O) when given, by
        Winograd's F(4x4, 3x3) through v (36, cb, T, 16; `transformed`: already xb's tiles) and products (36 * (b1 -
        b0) * T * 16 floats), T the tiles (`contract.winograd_tiles`)."""
        m, cb, hp, wp, _ = xb.shape
        self.lib.deepdsl_winograd_conv(_address(xb), _address(u), None if bias is None else _address(bias),
                                       m, cb, hp, wp, out.shape[1], b0, b1, int(transformed), _address(v),
                                       _address(products), _address(out))

    def winograd_filter_sums(self, xb: np.ndarray, gb: np.ndarray, v: np.ndarray, y: np.ndarray, sums: np.ndarray,
                             b0: int, b1: int, transformed: bool, first: bool) -> None:
        """sums (36, b1 - b0, cb, 16, 16) = (first) or += the sums over a chunk's tiles of Winograd's filter gradient
        of a stride-1 3x3 convolution for output blocks [b0, b1), from the blocked, padded input xb (m, cb, Ho + 2,
        Wo + 2, 16) and the blocked output gradient gb (m, ob, Ho, Wo, 16), through v (36, cb, T, 16; `transformed`:
        already xb's tiles) and y (36 * (b1 - b0) * T * 16 floats) (kernels/cpu_winograd.c)."""
        m, cb, hp, wp, _ = xb.shape
        self.lib.deepdsl_winograd_filter_sums(_address(xb), _address(gb), m, cb, hp, wp, gb.shape[1], b0, b1,
                                              int(transformed), int(first), _address(v), _address(y), _address(sums))

    def winograd_filter_pairs(self, xb: np.ndarray, gb: np.ndarray, v: np.ndarray, y: np.ndarray,
                              out: np.ndarray) -> None:
        """out (O, C, 3, 3) = the filter gradient of a stride-1 3x3 convolution by Winograd's transforms, a pair of
        blocks at a time (`contract.winograd_pairs`), from the blocked, padded input xb (m, ceil(C/16), Ho + 2, Wo + 2,
        16) and the blocked output gradient gb (m, ceil(O/16), Ho, Wo, 16) of the whole batch, through v (36,
        ceil(C/16), T, 16) and y (36, ceil(O/16), T, 16) (kernels/cpu_winograd.c)."""
        m, cb, hp, wp, _ = xb.shape
        self.lib.deepdsl_winograd_filter_pairs(_address(xb), _address(gb), m, cb, hp, wp, gb.shape[1], out.shape[0],
                                               out.shape[1], _address(v), _address(y), _address(out))

    def winograd_filter_out(self, sums: np.ndarray, out: np.ndarray) -> None:
        """out (ob, cb, 3, 3, 16, 16) = the blocked filter gradient of Winograd's sums (36, ob, cb, 16, 16)
        (`winograd_filter_sums`)."""
        ob, cb = out.shape[:2]
        self.lib.deepdsl_winograd_filter_out(_address(sums), ob, cb, _address(out))

    def blocked_filter_sums(self, xb: np.ndarray, gb: np.ndarray, first: bool, sums: np.ndarray) -> None:
        """sums (ob, cb, kh, kw, 16, 16) = (first) or += the filter gradient of the blocked, padded input xb (m, cb,
        Hp, Wp, 16) and blocked output gradient gb (m, ob, Ho, Wo, 16), summed over the samples in order."""
        m, cb, hp, wp, _ = xb.shape
        ob, _, kh, kw = sums.shape[:4]
        self.lib.deepdsl_blocked_conv_bwd_filter(_address(xb), _address(gb), m, cb, hp, wp, ob, kh, kw,
                                                 int(first), _address(sums))

    def thin_filter(self, xp: np.ndarray, gb: np.ndarray, stride: int, first: bool, sums: np.ndarray) -> None:
        """sums (ceil(O/16), C, kh, kw, 16) = (first) or += the filter gradient of a convolution by `stride` from the
        zero-padded input xp (m, C, Hp, Wp) and the blocked output gradient gb (m, ceil(O/16), Ho, Wo, 16), summed
        over the samples in order (`deepdsl_thin_filter`)."""
        m, c, hp, wp = xp.shape
        ob, _, kh, kw, _ = sums.shape
        self.lib.deepdsl_thin_filter(_address(xp), _address(gb), m, c, hp, wp, ob, gb.shape[2], gb.shape[3], kh, kw,
                                     stride, int(first), _address(sums))

    def thin_filter_out(self, sums: np.ndarray, out: np.ndarray) -> None:
        """out (O, C, kh, kw) = the thin filter gradient's sums (`thin_filter`) without their channels past O."""
        self.lib.deepdsl_thin_filter_out(_address(sums), *out.shape, _address(out))

    def unblock_filters(self, sums: np.ndarray, out: np.ndarray) -> None:
        """out (O, C, kh, kw) = the blocked filters `sums` without their zero channels."""
        self.lib.deepdsl_unblocked_filters(_address(sums), *out.shape, _address(out))

    def gather_rows(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> bool:
        """out[i] = table[ids[i]] (`deepdsl_take_rows`); False where the arrays are not contiguous float32 and
        int32 (numpy's kernel then)."""
        return self._by_rows(self.lib.deepdsl_take_rows, table, ids, out, out.shape[0], out.shape[1], table.shape[0])

    def scatter_rows(self, g: np.ndarray, ids: np.ndarray, out: np.ndarray) -> bool:
        """out = 0; out[ids[i]] += g[i] in order (`deepdsl_add_rows`); False as `gather_rows`."""
        return self._by_rows(self.lib.deepdsl_add_rows, g, ids, out, g.shape[0], g.shape[1], out.shape[0])

    def log_softmax(self, x: np.ndarray, out: np.ndarray) -> bool:
        """out = the rows' log-softmax of the matrix x (`deepdsl_log_softmax`; out may be x); False (nothing written)
        where the arrays are not contiguous float32."""
        if x.ndim != 2 or not _contiguous32(x, out):
            return False
        self.lib.deepdsl_log_softmax(_address(x), x.shape[0], x.shape[1], _address(out))
        return True

    def label_rank(self, x: np.ndarray, labels: np.ndarray, out: np.ndarray) -> bool:
        """Each row's rank of its label (`deepdsl_label_rank`); False as `gather_rows`."""
        return self._by_rows(self.lib.deepdsl_label_rank, x, labels, out, x.shape[0], x.shape[1])

    def attention_weights(self, w: np.ndarray, bias, a: int, r0: int, scale: float, causal: bool) -> bool:
        """In place over the scores w (units a.. by queries r0.. by keys): scaled, `bias` (a `cpu.attention.Bias`)
        added, causal keys left out, each row's softmax (`deepdsl_attention_weights`); False where the library has
        no such kernel or w is not contiguous float32 (numpy's code then)."""
        if self._attention_weights is None or not _contiguous32(w):
            return False
        units, rows, s = w.shape
        if bias is None:
            extra = (None, None, 0, 0)
        else:
            offsets = bias.offsets[a:a + units]
            extra = (_address(bias.flat), _address(offsets), bias.row, bias.col)
        self._attention_weights(_address(w), units, rows, s, r0, scale, *extra, int(causal))
        return True

    def attention_dscores(self, w: np.ndarray, dw: np.ndarray, delta: np.ndarray, r0: int, scale: float,
                          mask: np.ndarray | None = None, keep: float = 1.0) -> bool:
        """dw = w * (dw [* mask / keep] - delta) * scale in place (`deepdsl_attention_dscores`; `mask` the block's,
        a view of a unit's rows); False as `attention_weights`."""
        if self._attention_dscores is None or not _contiguous32(w, dw, delta) or not _block_mask(mask, w):
            return False
        units, rows, s = w.shape
        self._attention_dscores(_address(w), _address(dw), _address(delta), units, rows, s, r0,
                                delta.shape[1], scale, *_mask_args(mask, keep))
        return True

    def attention_units(self, q, k, v, bias, mask, keep: float, out, scale: float, causal: bool,
                        heads: bool = False) -> bool:
        """out = attention of each unit (arrays (units, rows, features), or with `heads` (N, rows, H, features):
        the units (n, h); `bias` a `cpu.attention.Bias`, `mask` the 0/1 uint8 (units, t, s) or None) weighed whole
        on one thread (`deepdsl_attention_units`), where `contract.attention_in_units` takes the sizes; False
        otherwise (nothing computed)."""
        arrays = self._units(q, k, v, mask, heads, out)
        if arrays is None:
            return False
        return bool(self._attention_units(*arrays, *_unit_sizes(q, k, v, heads), scale, *_bias_args(bias),
                                          int(causal), *_mask_args(mask, keep)))

    def attention_units_grad(self, q, k, v, o, g, bias, mask, keep: float, dq, dk, dv, scale: float,
                             causal: bool, heads: bool = False) -> bool:
        """(dq, dk, dv) of `attention_units` (laid out as q, k and v), given its output o and o's gradient g
        (`deepdsl_attention_units_grad`: the weights recomputed with the forward's bits); False as
        `attention_units`."""
        arrays = self._units(q, k, v, mask, heads, o, g, dq, dk, dv)
        if arrays is None:
            return False
        return bool(self._attention_units_grad(*arrays, *_unit_sizes(q, k, v, heads), scale, *_bias_args(bias),
                                               int(causal), *_mask_args(mask, keep)))

    def _units(self, q, k, v, mask, heads, *others):
        """The pointers of the units' arrays (q, k, v, *others), or None where the kernels do not take them."""
        _, t, s, d, e, _ = _unit_sizes(q, k, v, heads)
        if self._attention_units is None or not _contiguous32(q, k, v, *others) or \
                not contract.attention_in_units(t, s, d, e):
            return None
        if mask is not None and not (mask.dtype == np.uint8 and mask.flags.c_contiguous):
            return None
        return [_address(a) for a in (q, k, v, *others)]

    def attention_kept(self, w: np.ndarray, mask: np.ndarray, keep: float, out: np.ndarray) -> bool:
        """out = w * mask / keep (`deepdsl_attention_kept`; `mask` as `attention_dscores`'s); False as
        `attention_weights`."""
        if self._attention_kept is None or not _contiguous32(w, out) or not _block_mask(mask, w):
            return False
        units, rows, s = w.shape
        self._attention_kept(_address(w), _address(mask), _address(out), units, rows, s,
                             *_mask_args(mask, keep)[1:])
        return True

    @staticmethod
    def _by_rows(function, floats: np.ndarray, ids: np.ndarray, out: np.ndarray, *sizes: int) -> bool:
        """`function(floats, ids, *sizes, out)`, a kernel of rows picked by int32 numbers; False (numpy's kernel)
        where the arrays are not contiguous float32 and int32."""
        if not _plain(floats, out, ids):
            return False
        function(_address(floats), _address(ids), *sizes, _address(out))
        return True

    def equal_tokens(self, x: np.ndarray, value: float, out: np.ndarray) -> bool:
        """out = 1 where the int32 tokens x equal `value` (`deepdsl_equal_tokens`); False for other inputs (a float
        tensor, a value that is no integer)."""
        if x.dtype != np.int32 or not x.flags.c_contiguous or not out.flags.c_contiguous or \
                float(value) != int(value) or not -2 ** 31 <= value < 2 ** 31:
            return False
        self.lib.deepdsl_equal_tokens(_address(x), x.size, int(value), _address(out))
        return True

    def bernoulli(self, out: np.ndarray, seed: int, stream: int, keep: float) -> bool:
        """out (uint8) = dropout's mask keyed by (seed, stream), numpy's generator's bytes (`deepdsl_bernoulli`);
        False where the library has no such kernel or out is not contiguous."""
        if self._bernoulli is None or out.dtype != np.uint8 or not out.flags.c_contiguous:
            return False
        self._bernoulli(_address(out), out.size, int(seed), int(stream), np.float32(keep))
        return True

    def add_bias(self, x: np.ndarray, bias: np.ndarray) -> None:
        """x (N, C, ...) += bias (C,) broadcast over the samples and the trailing axes."""
        if not (x.flags.c_contiguous and bias.flags.c_contiguous):
            return _numpy_passes().add_bias(x, bias)
        n, c = x.shape[:2]
        self.lib.deepdsl_add_bias(_address(x), n, c, x.size // max(n * c, 1), _address(bias))

    def shifted_sums(self, offsets, out: np.ndarray, wp: int, pad: int) -> bool:
        """out (m, C, h, w) = the crop at `pad` of the (m, C) planes of rows `wp` wide that adding each contribution
        at its offset gives (`offsets`: (offset, contribution (C, m, rows)) pairs as runtime/cpu/conv.py makes
        them for a stride-1 input gradient); False (nothing written) where the contributions are not views of one
        array laid out as that needs."""
        first = offsets[0][1]
        c, m, rows = first.shape
        strides = [a.strides for _, a in offsets]
        if not out.flags.c_contiguous or any(s != strides[0] for s in strides) or strides[0][2] != 4 \
                or strides[0][1] != rows * 4:
            return False
        starts = [_address(a) for _, a in offsets]
        k_stride = (starts[1] - starts[0]) // 4 if len(starts) > 1 else 0
        if any(b - a != k_stride * 4 for a, b in zip(starts, starts[1:])):
            return False
        positions = (_L * len(offsets))(*(o for o, _ in offsets))
        self.lib.deepdsl_shifted_sums(starts[0], len(offsets), positions, k_stride, strides[0][0] // 4, rows, m, c,
                                      out.shape[2], out.shape[3], wp, pad, _address(out))
        return True

    # pooling --------------------------------------------------------------------------------------------------

    def max_pool(self, x: np.ndarray, out: np.ndarray | None, argmax: np.ndarray | None, kernel: int, stride: int,
                 pad: int, workspace: np.ndarray | None) -> None:
        """Max pooling of contiguous arrays into `out` and/or `argmax` (`deepdsl_max_pool`). Windows that leave
        the plane read a padded copy of it in `workspace` (the one numpy's kernel pads in, whose plan holds at
        least one sample's padded planes), one plane per thread."""
        n, c, h, w = x.shape
        ho, wo = (out if out is not None else argmax).shape[2:]
        hp, wp = (ho - 1) * stride + kernel, (wo - 1) * stride + kernel
        plane = hp * wp
        if workspace is None and (pad > 0 or hp > h or wp > w):    # (as numpy's kernel, which pads in a temporary)
            workspace = np.empty(plane * self.threads, np.float32)
        # (windows inside the planes read them where they are: no scratch)
        scratch = (None, 0) if workspace is None else \
            (_address(workspace), min(workspace.size // max(plane, 1), 1 << 30))
        self.lib.deepdsl_max_pool(_address(x), n * c, h, w, ho, wo, kernel, stride, pad,
                                  None if out is None else _address(out),
                                  None if argmax is None else _address(argmax), *scratch)

    def max_pool_bwd(self, g: np.ndarray, argmax: np.ndarray, out: np.ndarray, kernel: int, stride: int,
                     pad: int) -> None:
        """The gradient of max pooling, of contiguous arrays (`deepdsl_max_pool_bwd`)."""
        n, c, ho, wo = g.shape
        h, w = out.shape[2:]
        self.lib.deepdsl_max_pool_bwd(_address(g), _address(argmax), n * c, h, w, ho, wo, kernel, stride, pad,
                                      _address(out))

    def avg_pool(self, x: np.ndarray, out: np.ndarray, kernel: int, stride: int, pad: int,
                 include_pad: bool) -> bool:
        """Average pooling of contiguous float32 arrays into `out` (`deepdsl_avg_pool`: numpy's additions and
        divisions, groups of planes per thread); False (nothing written) for other arrays."""
        if self._avg_pool is None or not _contiguous32(x, out):
            return False
        n, c, h, w = x.shape
        self._avg_pool(_address(x), n * c, h, w, *out.shape[2:], kernel, stride, pad, include_pad, _address(out))
        return True

    def avg_pool_bwd(self, g: np.ndarray, out: np.ndarray, kernel: int, stride: int, pad: int,
                     include_pad: bool) -> bool:
        """The gradient of average pooling, of contiguous float32 arrays (`deepdsl_avg_pool_bwd`); False (nothing
        written) for other arrays."""
        if self._avg_pool_bwd is None or not _contiguous32(g, out):
            return False
        n, c, ho, wo = g.shape
        self._avg_pool_bwd(_address(g), n * c, *out.shape[2:], ho, wo, kernel, stride, pad, include_pad,
                           _address(out))
        return True

    # local response normalization -----------------------------------------------------------------------------

    def lrn(self, x: np.ndarray, s: np.ndarray, out: np.ndarray, size: int, alpha: float, beta: float,
            k: float) -> bool:
        """out = LRN of the samples x (2-D or 4-D), the scale in `s` (scratch of x's shape); False (nothing
        written) where the arrays are not contiguous float32."""
        if not _contiguous32(x, s, out):
            return False
        m, c = x.shape[:2]
        self.lib.deepdsl_lrn(_address(x), m, c, x.size // max(m * c, 1), size, alpha / size, k, -beta,
                             _address(s), _address(out))
        return True

    def lrn_bwd(self, g: np.ndarray, x: np.ndarray, t: np.ndarray, a: np.ndarray, out: np.ndarray, size: int,
                alpha: float, beta: float, k: float) -> bool:
        """out = the gradient of LRN (`t`, `a`: scratch of x's shape); False where not contiguous float32. The
        scalars are rounded to float32 as numpy rounds them (ctypes does so)."""
        if not _contiguous32(g, x, t, a, out):
            return False
        m, c = x.shape[:2]
        self.lib.deepdsl_lrn_bwd(_address(g), _address(x), m, c, x.size // max(m * c, 1), size, alpha / size, k,
                                 -beta, -beta - 1, 2 * alpha * beta / size, _address(t), _address(a),
                                 _address(out))
        return True

    # layer normalization --------------------------------------------------------------------------------------

    def layer_norm(self, x: np.ndarray, affine: tuple, out: np.ndarray, eps: float, axes: int) -> bool:
        """out = the layer norm of x over its last `axes` axes (`affine`: the weight and the bias, or nothing);
        False (nothing written) where the arrays are not contiguous float32."""
        if not _contiguous32(x, out, *affine):
            return False
        rows, features = contract.layer_norm_rows(x.shape, axes)
        w, b = (_address(affine[0]), _address(affine[1])) if affine else (None, None)
        self.lib.deepdsl_layer_norm(_address(x), w, b, rows, features, eps, _address(out))
        return True

    def layer_norm_grad(self, x: np.ndarray, g: np.ndarray, weight: tuple, out: np.ndarray, eps: float,
                        axes: int) -> bool:
        """out = the layer norm's input gradient (`out` may be g); False where not contiguous float32."""
        if not _contiguous32(x, g, out, *weight):
            return False
        rows, features = contract.layer_norm_rows(x.shape, axes)
        self.lib.deepdsl_layer_norm_grad(_address(x), _address(g), _address(weight[0]) if weight else None, rows,
                                         features, eps, _address(out))
        return True

    def layer_norm_param_grad(self, x: np.ndarray, g: np.ndarray, out: np.ndarray, workspace: np.ndarray | None,
                              eps: float, axes: int) -> bool:
        """out = the layer norm's weight and bias gradients (2, features), the parts' sums in the workspace
        (`contract.layer_norm_param_scratch`); False where not contiguous float32."""
        if not _contiguous32(x, g, out):
            return False
        rows, features = contract.layer_norm_rows(x.shape, axes)
        parts = Scratch(workspace).take((contract.layer_norm_param_scratch(rows, features),))
        self.lib.deepdsl_layer_norm_param_grad(_address(x), _address(g), rows, features, eps,
                                               contract.LAYER_NORM_PART_ROWS, _address(parts), _address(out))
        return True

    # elementwise ----------------------------------------------------------------------------------------------

    def ew(self, kernel, out: np.ndarray, args) -> bool:
        """Run the compiled `kernel` (a generated numpy kernel function; the library's `deepdsl_<name>_<pattern>`,
        `pattern` by `contract.operand_pattern`) when the library has it, whatever the size (a statement's bits
        depend on the library alone, not on its size nor on whether it runs in a batch, `ew_many`); False otherwise
        (the caller runs the numpy one). Its function is found once for each kernel and layout of the operands
        (`_signature`: shapes, dtypes, whether contiguous)."""
        key = (kernel, out.shape, out.dtype.char, out.flags.c_contiguous, *_signature(args))
        found = self._ew.get(key)
        if found is None:
            found = self._ew[key] = out.flags.c_contiguous and out.dtype == np.float32 and \
                all(a is None or a[2] for a in key[4:]) and self._ew_function(kernel.__name__, out.shape, args)
        if found is False:
            return False
        found(args, out)
        return True

    def ew_pair(self, first, second) -> bool:
        """Run two elementwise kernels, each `(kernel, out, *args)`, the second reading the first's output, in one
        pass of the library's pair function (`contract.pair_function`) when it has one for these operands and the
        outputs are contiguous float32 of one size; False otherwise (nothing run)."""
        if first[1].shape != second[1].shape:
            return False
        return self._pair(first, second, None)

    def ew_many(self, kernel, calls) -> bool:
        """Run the compiled `kernel` on each `(out, *args)` of `calls` in one call of the library's batched
        function (`contract.many_function`, for the pattern of the first call's operands) where it has one and
        every call's operands have that pattern: contiguous float32 (uint8 for u) of their output's size, and
        scalars; False otherwise (nothing run: the caller runs each)."""
        out, *args = calls[0]
        key = ("many", kernel.__name__, len(calls),
               tuple((a.shape, a.dtype.char) if isinstance(a, np.ndarray) else None for a in args), out.shape)
        found = self._ew.get(key)
        if found is None:
            found = self._ew[key] = self._many_function(kernel.__name__, out.shape, args, len(calls))
        if found is False:
            return False
        function, batch = found
        if not batch(calls):
            return False
        function(len(calls), batch.sizes, batch.outs, batch.pointers, batch.values)
        return True

    def _many_function(self, name: str, out_shape, args, count: int):
        pattern = self._pattern(args, out_shape)
        many = None if pattern is None else contract.many_function(name, pattern)
        function = None if many is None else getattr(self.program, many, None)
        if function is None:
            return False
        function.argtypes = [_L, _P, _P, _P, _P]
        return function, _Batch(pattern, count)

    def ew_and_sum(self, first, second, shape) -> bool:
        """Run an elementwise kernel, `(kernel, out, *args)`, and the per-channel sum to `shape` of a second kernel
        reading its output, `(kernel, out, *args)`, in one pass of the library's pair function
        (`contract.pair_function`, summed) when it has one for these operands; False otherwise (nothing run)."""
        return self._pair(first, second, tuple(shape))

    def _pair(self, first, second, sum_shape) -> bool:
        (k0, out0, *args0), (k1, out1, *args1) = first, second
        if not _contiguous32(out0, out1) or \
                any(isinstance(a, np.ndarray) and not a.flags.c_contiguous for a in args0 + args1):
            return False
        key = ("pair", k0.__name__, k1.__name__, out0.shape, sum_shape,
               tuple((a.shape, a.dtype.char) if isinstance(a, np.ndarray) else None for a in args0 + args1))
        found = self._ew.get(key)
        if found is None:
            found = self._ew[key] = self._pair_function(k0.__name__, args0, k1.__name__, args1, out0.shape, sum_shape)
        if found is False:
            return False
        found(args0 + args1, out0, out1)
        return True

    def _pair_function(self, first: str, args0, second: str, args1, out_shape, sum_shape):
        """(the library's pair function for these operands, their patterns joined, its size arguments), or False
        where it has none; `sum_shape`: the second kernel's values summed to it (per channel), or None."""
        summed = sum_shape is not None
        second_pattern = _sum_pattern(args1, out_shape, sum_shape) if summed else self._pattern(args1, out_shape)
        first_pattern = _sum_pattern(args0, out_shape, sum_shape) if summed else self._pattern(args0, out_shape)
        if first_pattern is None or second_pattern is None:
            return False
        name = contract.pair_function(first, first_pattern, second, second_pattern, summed)
        if name is None:
            return False
        sizes = contract.channel_rows(out_shape, sum_shape) if summed else (math.prod(out_shape),)
        return _KernelCall.of(self.program, name, sizes, first_pattern + second_pattern, 2)

    def channel_sum(self, x: np.ndarray, out: np.ndarray) -> bool:
        """out (1, C, 1, ...) = x (N, C, ...) summed per channel, or out (D,) = x (..., D) summed over every axis but
        the last (`sum_to`; `contract.sum_view`), by the library's `deepdsl_channel_sum` on the kernels' threads (as a
        compiled per-channel sum adds its values, but planes of 64 to 256 floats of several samples, a row at a time
        in 16 lanes); False where it does not (another dtype, strides, another
        sum, or a library without it): the caller sums with numpy. Its rows are found once for each pair of
        shapes."""
        if self._channel_sum is None or not _contiguous32(x, out):
            return False
        rows = self._sum_rows.get((x.shape, out.shape))
        if rows is None:
            rows = self._sum_rows[x.shape, out.shape] = contract.sum_view(x.shape, out.shape) is not None and \
                contract.channel_rows(x.shape, out.shape)
        return bool(rows) and bool(self._channel_sum(*rows, _address(out), _address(x)))

    def ew_sum(self, kernel, out: np.ndarray, args, shape) -> bool:
        """out = the per-channel sum of the compiled `kernel` over `args` (the library's
        `deepdsl_<name>_<pattern>_csum`, `contract.channel_sum_pattern`), the values never stored; False where the
        library has none for these operands (the caller sums numpy's chunks)."""
        if out.dtype != np.float32 or not out.flags.c_contiguous:
            return False
        key = ("sum", kernel.__name__, tuple(shape),
               tuple((a.shape, a.dtype.char) if isinstance(a, np.ndarray) else None for a in args))
        found = self._ew.get(key)
        if found is None:
            found = self._ew[key] = self._sum_function(kernel.__name__, shape, args)
        if found is False or any(isinstance(a, np.ndarray) and not a.flags.c_contiguous for a in args):
            return False
        found(args, out)
        return True

    def _sum_function(self, name: str, shape, args):
        values = np.broadcast_shapes(*(np.shape(a) for a in args))
        pattern = _sum_pattern(args, values, shape)
        if pattern is None:
            return False
        return _KernelCall.of(self.program, f"deepdsl_{name}_{pattern}_csum", contract.channel_rows(values, shape),
                              pattern, 1)

    @staticmethod
    def _pattern(args, out_shape) -> str | None:
        """The operand pattern of a kernel call (`contract.operand_pattern`); None for operands no compiled kernel
        takes."""
        shapes = []
        for a in args:
            if not isinstance(a, np.ndarray):
                shapes.append(((), False))
            elif a.dtype not in (np.float32, np.uint8):
                return None
            else:
                shapes.append((a.shape, a.dtype == np.uint8))
        return contract.operand_pattern(shapes, out_shape)

    def _ew_function(self, name: str, out_shape, args):
        """(the library's function of kernel `name` for these operands, their pattern, its size arguments), or
        False where there is none (operands it does not take, or a pattern the program does not call it with)."""
        pattern = self._pattern(args, out_shape)
        if pattern is None:
            return False
        # over rows (rows, channels, inner) with channel, last-axis or per-row operands, else over the n flat elements
        per_row = [a.size for a, letter in zip(args, pattern) if letter == "w"]
        sizes = contract.kernel_rows(pattern, out_shape, *per_row[:1]) if set(pattern) & set("crw") else \
            (math.prod(out_shape),)
        return _KernelCall.of(self.program, f"deepdsl_{name}_{pattern}", sizes, pattern, 1)


def _element(a: np.ndarray, into, index: int) -> float:
    """The value of a size-1 array given a kernel as a scalar operand, for element `index` of the ctypes array
    `into` the kernel reads its values from (a step's record, `deepdsl_runtime.replay`, reads it there again at
    every replay: the array's value changes from step to step)."""
    return float(a.reshape(-1)[0])


def _signature(args, _array=np.ndarray) -> list:
    """The layout of a kernel's operands, the key of its function: each array's (shape, dtype, whether
    contiguous), None for a scalar."""
    return [(a.shape, a.dtype.char, a.flags.c_contiguous) if isinstance(a, _array) else None for a in args]


def _sum_pattern(args, values_shape, shape) -> str | None:
    """The pattern of a compiled per-channel sum to `shape` of a kernel over `args` (`contract.channel_sum_pattern`),
    or None where it has none (operands of other dtypes among them)."""
    if any(isinstance(a, np.ndarray) and a.dtype not in (np.float32, np.uint8) for a in args):
        return None
    return contract.channel_sum_pattern([(np.shape(a), isinstance(a, np.ndarray) and a.dtype == np.uint8)
                                         for a in args], values_shape, shape)


class _ProductCall:
    """One layout's call of a product function of the library (`deepdsl_gemm_args`, `deepdsl_small_gemm_args`):
    its arguments in one array of 64-bit integers made once, the sizes and distances in place, and on each call
    (`call(pa, pb, pc, pbias)`) the operands', output's and bias's addresses written in (the last slot, 0: no
    bias); false where the output's bytes overlap an operand's (`_apart`) or the bias's, or the library has no
    sgemm to call. A `Native` serves one program's steps from one thread, as `_Operands`."""

    __slots__ = ("function", "values", "extents")

    def __init__(self, function, head, operands, tail, arrays):
        assert len(head) == 6
        (lda, sa), (ldb, sb), (ldc, sc) = operands
        self.function = function
        self.values = (ctypes.c_int64 * (len(head) + 9 + len(tail)))(*head, 0, lda, sa, 0, ldb, sb, 0, ldc, sc,
                                                                     *tail)
        self.extents = tuple(_extent(x) for x in arrays)

    def __call__(self, pa: int, pb: int, pc: int, pbias: int = 0) -> bool:
        """The product of the operands at pa and pb into pc, plus the bias (n floats) at `pbias` where not 0."""
        if not _apart(self.extents, pa, pb, pc):
            return False
        values = self.values        # (batch, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, c, ldc, sc, ..., bias)
        if pbias:
            low, high = self.extents[2]
            if pc + low < pbias + 4 * values[4] and pbias < pc + high:
                return False
        values[6], values[9], values[12], values[-1] = pa, pb, pc, pbias
        return bool(self.function(values))


def _apart(extents, pa: int, pb: int, pc: int) -> bool:
    """Whether an output at address pc lies apart from operands at pa and pb (what `np.may_share_memory` asks),
    given the three arrays' `_extent`s."""
    (la, ha), (lb, hb), (lc, hc) = extents
    return not (pa + la < pc + hc and pc + lc < pa + ha or pb + lb < pc + hc and pc + lc < pb + hb)


def _extent(x: np.ndarray) -> tuple[int, int]:
    """The bytes an array's elements span, from its first element's address: (lowest offset, highest + 1)."""
    if x.size == 0:
        return 0, 0
    low = sum((n - 1) * st for n, st in zip(x.shape, x.strides) if st < 0)
    high = sum((n - 1) * st for n, st in zip(x.shape, x.strides) if st > 0)
    return low, high + x.itemsize


class _KernelCall:
    """A compiled elementwise function's call for one layout of its operands (`Native.ew`, its pairs and sums):
    `call(args, *outs)` writes the outputs' pointers and the operands' (`_Operands`) into ctypes objects made once
    and calls the function with them and its sizes, made once too. The function is the library's own object for
    this call, without argument types: every argument is a ctypes object already, which ctypes passes as it is
    (converting them by argument types took about 0.8 us a call). A `Native` serves one program's steps, which
    call its kernels one at a time from one thread, as `_Operands`."""

    __slots__ = ("function", "head", "outs", "operands")

    def __init__(self, function, sizes, pattern: str, outs: int):
        self.function = function
        self.outs = tuple(_P() for _ in range(outs))
        self.head = (*(_L(n) for n in sizes), *self.outs)
        self.operands = _Operands(pattern)

    @classmethod
    def of(cls, library: ctypes.CDLL, name: str, sizes, pattern: str, outs: int):
        """The call of the library's function `name`, or False where it has none."""
        try:
            function = library[name]        # (a new object: the library's attribute of that name keeps its types)
        except AttributeError:
            return False
        function.restype = None
        return cls(function, sizes, pattern, outs)

    def __call__(self, args, out, second=None) -> None:
        pointers = self.outs
        pointers[0].value = _address(out)
        if second is not None:
            pointers[1].value = _address(second)
        self.function(*self.head, *self.operands(args))


class _Operands:
    """A compiled elementwise function's `in` and `value` arrays for the operands of one pattern: made once, filled
    on each call (`operands(args)`: each operand's pointer, or for a scalar (`s`) its value as float32). A
    `Native` serves one program's steps, which call its kernels one at a time from one thread; each call reads the
    arrays before it returns."""

    __slots__ = ("pointers", "values", "arrays", "scalars")

    def __init__(self, pattern: str):
        self.pointers, self.values = (_P * len(pattern))(), (_F * len(pattern))()
        self.arrays = tuple(i for i, p in enumerate(pattern) if p != "s")
        self.scalars = tuple(i for i, p in enumerate(pattern) if p == "s")

    def __call__(self, args):
        pointers, values = self.pointers, self.values
        if not self.scalars:
            pointers[:] = [_address(a) for a in args]
            return pointers, values
        for i in self.arrays:
            pointers[i] = _address(args[i])
        for i in self.scalars:  # (a float, or a size-1 array's element, rounded to float32 by ctypes as by numpy)
            a = args[i]
            values[i] = _element(a, values, i) if isinstance(a, np.ndarray) else float(a)
        return pointers, values


class _Batch:
    """A batched elementwise function's arrays for `count` calls of one operand pattern (`Native.ew_many`): each
    call's size and output pointer, its operands' pointers and scalars' values, `width` = arity apart; made once,
    filled on each call (`batch(calls)`: False where an operand is not of the pattern, the arrays then to be filled
    again). A call whose output and array operands are the objects of the last call (`held`: the parameters, their
    states and, in static memory, the step's buffers are the same arrays at every step) keeps their pointers, checked
    when they came; the batch holds those arrays until its next call."""

    __slots__ = ("sizes", "outs", "pointers", "values", "columns", "arrays", "scalars", "width", "pick", "same",
                 "held", "written")

    def __init__(self, pattern: str, count: int):
        self.width = len(pattern)
        self.sizes, self.outs = (_L * count)(), (_P * count)()
        self.pointers, self.values = (_P * (count * self.width))(), (_F * (count * self.width))()
        self.columns = np.frombuffer(self.values, np.float32).reshape(count, self.width)
        self.arrays = tuple((i + 1, np.dtype(np.uint8 if p == "u" else np.float32)) for i, p in enumerate(pattern)
                            if p != "s")
        self.scalars = tuple(i + 1 for i, p in enumerate(pattern) if p == "s")
        positions = (0, *(i for i, _ in self.arrays))
        self.pick = operator.itemgetter(*positions) if len(positions) > 1 else lambda call: (call[0],)
        self.same = _same_objects(positions)
        self.held: list = [(None,) * len(positions)] * count
        self.written: dict[int, object] = {}     # scalar column -> the object whose value fills it

    def __call__(self, calls) -> bool:
        held, same, arrays, width = self.held, self.same, self.arrays, self.width
        for m, call in enumerate(calls):
            if same(call, held[m]):
                continue
            held[m] = (None,) * (1 + len(arrays))        # (filled again at the next call, unless all is well)
            out = call[0]
            if out.dtype is not _F32 and out.dtype != _F32 or not out.flags.c_contiguous:
                return False
            size = out.size
            for i, dtype in arrays:
                a = call[i]
                if a.__class__ is not np.ndarray or a.size != size or \
                        a.dtype is not dtype and a.dtype != dtype or not a.flags.c_contiguous:
                    return False
            self.sizes[m], self.outs[m] = size, _address(out)
            for i, _ in arrays:
                self.pointers[m * width + i - 1] = _address(call[i])
            held[m] = self.pick(call)
        for i in self.scalars:      # (a float, or a size-1 array's element, rounded to float32 as `_Operands` does)
            first = calls[0][i]
            if first.__class__ is not np.ndarray and \
                    list(map(operator.itemgetter(i), calls)).count(first) == len(calls):
                if self.written.get(i) is not first:            # one value for all (the step's hyperparameters)
                    self.columns[:, i - 1] = first
                    self.written[i] = first
                continue
            self.written.pop(i, None)
            for m, call in enumerate(calls):
                a = call[i]
                if a.__class__ is np.ndarray:
                    if a.size != 1:
                        return False
                    a = _element(a, self.values, m * self.width + i - 1)
                self.columns[m, i - 1] = a
        return True


def _same_objects(positions: tuple[int, ...]):
    """A function of (call, held) telling whether the objects at `positions` of the tuple `call` are those of
    `held`, in order; written out for up to five positions (a generator over them took ten times as long)."""
    if len(positions) == 1:
        (p0,) = positions
        return lambda call, held: call[p0] is held[0]
    if len(positions) == 2:
        p0, p1 = positions
        return lambda call, held: call[p0] is held[0] and call[p1] is held[1]
    if len(positions) == 3:
        p0, p1, p2 = positions
        return lambda call, held: call[p0] is held[0] and call[p1] is held[1] and call[p2] is held[2]
    if len(positions) == 4:
        p0, p1, p2, p3 = positions
        return lambda call, held: (call[p0] is held[0] and call[p1] is held[1] and call[p2] is held[2] and
                                   call[p3] is held[3])
    if len(positions) == 5:
        p0, p1, p2, p3, p4 = positions
        return lambda call, held: (call[p0] is held[0] and call[p1] is held[1] and call[p2] is held[2] and
                                   call[p3] is held[3] and call[p4] is held[4])
    return lambda call, held: all(map(operator.is_, map(call.__getitem__, positions), held))


def _data_offset() -> int | None:
    """Where an ndarray object holds the address of its first element, from the object's own address: numpy's
    array struct puts it right after the object's header (`object.__basicsize__`). Checked on arrays, views and
    transposed views here; None where it does not hold (then `_address` asks `ndarray.ctypes`, about 1 us)."""
    offset = object.__basicsize__
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    probes = (base, base[1:, 2:], base.T, np.empty(0, np.uint8), np.zeros((3, 5), np.int64)[2])
    try:
        if all(ctypes.c_void_p.from_address(id(x) + offset).value == x.ctypes.data for x in probes):
            return offset
    except (ValueError, OSError):
        pass
    return None


_DATA_OFFSET = _data_offset()


def _address(x: np.ndarray, _read=ctypes.c_void_p.from_address, _offset=_DATA_OFFSET, _array=np.ndarray) -> int:
    """The address of an ndarray's first element (`x.ctypes.data`, ten times faster: a compiled kernel's call
    passes several; the module's names bound as defaults, half the time of looking them up)."""
    if x.__class__ is not _array or _offset is None:
        return x.ctypes.data
    return _read(id(x) + _offset).value




def _matrix(x: np.ndarray) -> tuple[int, int] | None:
    """How the BLAS reads the last two axes of `x` (rows, columns): (0, the distance between rows) stored by rows,
    (1, the distance between columns) a transposed view of such a matrix, in floats; None where neither."""
    rows, columns = x.shape[-2:]
    down, across = x.strides[-2:]
    if (across == 4 or columns == 1) and down % 4 == 0 and down // 4 >= max(1, columns):
        return 0, max(down // 4, columns, 1)
    if (down == 4 or rows == 1) and across % 4 == 0 and across // 4 >= max(1, rows):
        return 1, max(across // 4, rows, 1)
    return None


def _stack(x: np.ndarray, lead: tuple[int, ...]) -> int | None:
    """The distance in floats between the matrices of `x` over the leading axes `lead` of a product's output: 0
    where `x` is one matrix broadcast to them, None where its matrices are not one stride apart."""
    shape, strides = x.shape[:-2], x.strides[:-2]
    if math.prod(shape) == 1:
        return 0
    if shape != lead:
        return None
    axes = [(size, stride) for size, stride in zip(shape, strides) if size > 1]
    step = axes[-1][1]
    for (_, stride), (inner, inner_stride) in zip(axes, axes[1:]):
        if stride != inner_stride * inner:
            return None
    return step // 4 if step % 4 == 0 and step > 0 else None


def _index(x: np.ndarray, i: int, axes: int) -> np.ndarray:
    """Matrix stack `x` at index i of the first of an output's `axes` leading axes (x broadcast along it)."""
    if x.ndim - 2 < axes:
        return x
    return x[i] if x.shape[0] > 1 else x[0]


def _block_mask(mask: np.ndarray | None, w: np.ndarray) -> bool:
    """Whether `mask` is none, or a uint8 block of w's shape whose rows are contiguous (units apart by a stride)."""
    return mask is None or (mask.dtype == np.uint8 and mask.shape == w.shape and mask.strides[1:] == (w.shape[2], 1))


def _mask_args(mask: np.ndarray | None, keep: float) -> tuple:
    """The mask's pointer, its units' stride and 1 / keep, as the kernels take them (NULL, 0, 1 without one)."""
    if mask is None:
        return None, 0, 1.0
    return _address(mask), mask.strides[0], np.float32(1.0 / keep)


def _unit_sizes(q, k, v, heads: bool = False) -> tuple[int, int, int, int, int, int]:
    """(units, t, s, d, e, H) of attention's units q (units, t, d), k (units, s, d), v (units, s, e), H 0; or with
    `heads`, of q (N, t, H, d), k (N, s, H, d), v (N, s, H, e): N * H units."""
    if heads:
        return q.shape[0] * q.shape[2], q.shape[1], k.shape[1], q.shape[3], v.shape[3], q.shape[2]
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2], 0


def _bias_args(bias) -> tuple:
    """A `cpu.attention.Bias` as the kernels take it: its elements, each unit's offset, its row and column steps."""
    if bias is None:
        return None, None, 0, 0
    return _address(bias.flat), _address(bias.offsets), bias.row, bias.col


def _contiguous32(*arrays, _f32=_F32) -> bool:
    """Whether every array is contiguous float32 (a loop: all() over a generator took twice as long)."""
    for a in arrays:
        if not a.flags.c_contiguous or a.dtype is not _f32 and a.dtype != _f32:
            return False
    return True


_BLAS_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                 "scipy_openblas_set_num_threads")
# CBLAS sgemm by its name in the OpenBLAS builds numpy ships or links: (name, 64-bit integers)
_SGEMMS = (("scipy_cblas_sgemm64_", True), ("cblas_sgemm64_", True), ("scipy_cblas_sgemm", False),
           ("cblas_sgemm", False))


def _openblas() -> list[ctypes.CDLL]:
    """The OpenBLAS libraries this process has loaded (numpy's), by path."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            found.append(ctypes.CDLL(path))
        except OSError:
            continue
    return found


def set_blas_threads(threads: int) -> bool:
    """Set the threads of the OpenBLAS numpy's matrix products run on (found among the libraries this process has
    loaded); False when there is none to set."""
    for lib in _openblas():
        for name in _BLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter.argtypes = [ctypes.c_int]
                setter(int(threads))
                return True
    return False


def blas_sgemm() -> tuple[int, bool] | None:
    """(the address of the CBLAS sgemm of numpy's OpenBLAS, whether it takes 64-bit integers), or None where this
    process has loaded no OpenBLAS with one, or no way to set its threads."""
    for lib in _openblas():
        if not any(getattr(lib, name, None) is not None for name in _BLAS_SETTERS):
            continue
        for name, ilp64 in _SGEMMS:
            function = getattr(lib, name, None)
            if function is not None:
                return ctypes.cast(function, ctypes.c_void_p).value, ilp64
    return None


def threads_available() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
