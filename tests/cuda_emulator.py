"""A host emulator of the CUDA backend's device, for tests on machines without a GPU.

`HostDevice` implements the device interface of `deepdsl_runtime.cuda_ops` with host memory: allocations are
aligned numpy buffers, GEMMs are numpy products over the addressed memory, and kernel launches run the kernels'
own per-element functions (`DEEPDSL_HD` in runtime/kernels) compiled for the CPU with g++. The host entry point of
each kernel is generated from the kernel's signature and body in the CUDA source itself:

- its parameters become a struct, into which the launcher's packed argument buffer (`struct.pack` of the same
  format string the pycuda launcher uses, native alignment) is read -- so a format string that disagrees with the
  kernel's parameter list fails here as it would on the GPU;
- a grid-stride body `DEEPDSL_FOR(i, begin, end) statement` runs item after item in the order `set_order` chose:
  increasing, decreasing or a pseudo-random permutation. The threads of a launch may run in any order on a GPU,
  so a launch is race-free only if every order gives the same result: tests run in all three orders, and a
  launch whose items read what other items write (pooling over its own input done wrongly) fails in some;
- the block-level kernels (reductions with shared memory, the ordered pooling passes) are emulated by hand below,
  in the same arithmetic order as the GPU, after checking the launch geometry they require.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "runtime" / "kernels"
CACHE = Path(tempfile.gettempdir()) / "deepdsl-cuda-emulator"

_SIGNATURE = re.compile(
    r"(?:DEEPDSL_KERNEL|DEEPDSL_GLOBAL\s+void\s+__launch_bounds__\(\w+\))\s+(\w+)\(([^)]*)\)\s*\{", re.S)


def parse_kernels(source: str) -> dict[str, tuple[list[tuple[str, str]], str]]:
    """name -> ([(type, parameter)], body) of every __global__ kernel of a CUDA source."""
    kernels = {}
    for match in _SIGNATURE.finditer(source):
        name, params = match.group(1), match.group(2)
        depth, i = 1, match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            i += 1
        body = source[match.end():i - 1].strip()
        parsed = []
        for p in params.split(","):
            p = " ".join(p.split())
            m = re.match(r"(.*?)(\w+)$", p)
            parsed.append((m.group(1).strip(), m.group(2)))
        kernels[name] = (parsed, body)
    return kernels


_FOR = re.compile(r"^DEEPDSL_FOR\((\w+),\s*([^,]+),\s*([^)]+)\)\s*(.*)$", re.S)
_ORDERED = re.compile(r"^DEEPDSL_ORDERED_LOOP\((true|false),\s*(.*),\s*(\w+)\[at\]\)$", re.S)

# hand emulations of block-level kernels (same arithmetic order as the device code), by kernel name
_BLOCK_KERNELS = {
    "deepdsl_sum_rows": """
    if (bx != 32 || by != 8 || gx * 32 < b) return 1;
    for (unsigned col = 0; col < b; ++col) {
        float part[8];
        for (unsigned y = 0; y < 8; ++y) part[y] = deepdsl_sum_rows_partial(col, y, 8, a, b, x);
        float s = part[0];
        for (int y = 1; y < 8; ++y) s += part[y];
        out[col] = s;
    }
    return 0;""",
    "deepdsl_sum_middle": """
    if (bx != DEEPDSL_THREADS || by != 1 || gx != b) return 1;
    for (unsigned col = 0; col < b; ++col) {
        float part[DEEPDSL_THREADS];
        for (unsigned t = 0; t < DEEPDSL_THREADS; ++t)
            part[t] = deepdsl_sum_middle_partial(col, t, DEEPDSL_THREADS, a, b, c, x);
        for (unsigned half = DEEPDSL_THREADS / 2; half > 0; half >>= 1)
            for (unsigned t = 0; t < half; ++t) part[t] += part[t + half];
        out[col] = part[0];
    }
    return 0;""",
    "deepdsl_precision": """
    if (bx != DEEPDSL_THREADS || by != 1 || gx != 1) return 1;
    unsigned counts[DEEPDSL_THREADS] = {0};
    for (unsigned t = 0; t < DEEPDSL_THREADS; ++t)
        for (unsigned i = t; i < rows; i += DEEPDSL_THREADS) counts[t] += deepdsl_precision_row(i, classes, x, labels);
    for (unsigned half = DEEPDSL_THREADS / 2; half > 0; half >>= 1)
        for (unsigned t = 0; t < half; ++t) counts[t] += counts[t + half];
    out[0] = static_cast<float>(counts[0]) / static_cast<float>(rows);
    return 0;""",
}


def _host_function(name: str, params, body: str) -> str:
    fields = "".join(f"    {t} {n};\n" for t, n in params)
    unpack = "".join(f"    auto {n} = p.{n}; (void){n};\n" for _, n in params)
    last = params[-1][1]                       # the parameter bytes a launch packs: up to the end of the last one
    args_size = f"offsetof(P_{name}, {last}) + sizeof(P_{name}::{last})"
    lines = [f"struct P_{name} {{\n{fields}}};",
             f'extern "C" unsigned host_args_{name}() {{ return {args_size}; }}',
             f'extern "C" int host_{name}(const void* raw, unsigned gx, unsigned bx, unsigned by) {{',
             f"    const P_{name}& p = *static_cast<const P_{name}*>(raw);", unpack.rstrip("\n"),
             "    (void)gx; (void)bx; (void)by;"]
    if name in _BLOCK_KERNELS:
        lines.append(_BLOCK_KERNELS[name])
    elif (m := _ORDERED.match(body)) is not None:
        ascending, value, target = m.group(1) == "true", " ".join(m.group(2).split()), m.group(3)
        lines.append(f"""
    if (bx != DEEPDSL_ORDERED_THREADS || by != 1 || gx != 1) return 1;
    const unsigned T = DEEPDSL_ORDERED_THREADS, tiles = (end - begin + T - 1) / T;
    for (unsigned tile = 0; tile < tiles; ++tile) {{
        const unsigned lo = {'begin + tile * T' if ascending else '(end - begin > (tile + 1) * T ? end - (tile + 1) * T : begin)'};
        const unsigned hi = {'(lo + T < end ? lo + T : end)' if ascending else 'end - tile * T'};
        std::vector<float> values;
        for (unsigned at = lo; at < hi; ++at) values.push_back({value});
        for (unsigned at = lo; at < hi; ++at) {target}[at] = values[at - lo];
    }}
    return 0;""")
    elif (m := _FOR.match(body)) is not None:
        var, begin, end, statement = m.group(1), m.group(2), m.group(3), " ".join(m.group(4).split())
        lines.append(f"""
    if (host_order_mode == 0) {{
        for (unsigned {var} = {begin}; {var} < {end}; ++{var}) {statement}
        return 0;
    }}
    for (unsigned {var} : host_item_order({begin}, {end})) {statement}
    return 0;""")
    else:
        raise ValueError(f"no host emulation for kernel {name}:\n{body}")
    lines.append("}")
    return "\n".join(lines)


_ORDER = """
static int host_order_mode = 0;          // 0 increasing, 1 decreasing, 2 pseudo-random
static unsigned host_order_seed = 1;
extern "C" void host_set_order(int mode, unsigned seed) { host_order_mode = mode; host_order_seed = seed; }
static std::vector<unsigned> host_item_order(unsigned begin, unsigned end) {
    std::vector<unsigned> items;
    for (unsigned i = begin; i < end; ++i) items.push_back(i);
    if (host_order_mode == 1) std::reverse(items.begin(), items.end());
    if (host_order_mode == 2) {
        unsigned long long state = host_order_seed * 6364136223846793005ULL + 1442695040888963407ULL;
        for (size_t i = items.size(); i > 1; --i) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            std::swap(items[i - 1], items[(state >> 33) % i]);
        }
    }
    return items;
}
"""


def host_source(cu_text: str) -> str:
    """C++ source: `cu_text` (which includes ops.cu) plus a host entry point per kernel of it and of ops.cu."""
    kernels = parse_kernels((KERNELS / "ops.cu").read_text())
    kernels.update(parse_kernels(cu_text))
    parts = ["#include <algorithm>", "#include <cstddef>", "#include <vector>", cu_text, _ORDER]
    parts += [_host_function(name, params, body) for name, (params, body) in kernels.items()]
    return "\n\n".join(parts) + "\n"


def build(cu_text: str = '#include "ops.cu"\n') -> ctypes.CDLL:
    """The host library of a CUDA source (default: the generic kernels alone), built once per source."""
    text = host_source(cu_text)
    key = hashlib.sha256(text.encode() + (KERNELS / "ops.cu").read_bytes()
                         + (KERNELS / "deepdsl_common.cuh").read_bytes()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    library = CACHE / f"host-{key}.so"
    if not library.exists():
        source = CACHE / f"host-{key}.cpp"
        source.write_text(text)
        partial = CACHE / f"host-{key}.{id(text)}.so"
        subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-I", str(KERNELS),
                        "-o", str(partial), str(source)], check=True, capture_output=True, text=True)
        partial.replace(library)
    return ctypes.CDLL(str(library))


_BOUNDS = re.compile(r"(DEEPDSL_KERNEL|__launch_bounds__\((\w+)\))\s+(\w+)\(")
_DEFINE = re.compile(r"^#define\s+(\w+)\s+(\d+)\s*$", re.M)


def launch_bounds(cu_text: str = '#include "ops.cu"\n') -> dict[str, int]:
    """name -> the most threads per block each kernel of a source (with ops.cu) may be launched with: its
    `__launch_bounds__`, resolved through the numeric `#define`s of the kernel sources. A block larger than that
    fails to launch on a GPU."""
    sources = [(KERNELS / "deepdsl_common.cuh").read_text(), (KERNELS / "ops.cu").read_text(), cu_text]
    values = {name: int(value) for text in sources for name, value in _DEFINE.findall(text)}
    bounds = {}
    for text in sources[1:]:
        for match in _BOUNDS.finditer(text):
            limit = "DEEPDSL_THREADS" if match.group(1) == "DEEPDSL_KERNEL" else match.group(2)
            bounds[match.group(3)] = int(limit) if limit.isdigit() else values[limit]
    return bounds


def run_kernel(library: ctypes.CDLL, kernel: str, packed: bytes, grid, block) -> None:
    """Run `kernel` of a host library (`build`) on an argument buffer packed as a launcher packs it for the GPU
    (the kernel's parameters with native alignment, checked to be as long as the parameter list): its grid-stride
    items in the order `HostDevice.set_order` chose, or its hand emulation, which first checks the launch geometry
    it needs."""
    expected = getattr(library, f"host_args_{kernel}")()
    if len(packed) != expected:
        raise AssertionError(f"{kernel}: {len(packed)} bytes of arguments for parameters of {expected} bytes")
    entry = getattr(library, f"host_{kernel}")
    status = entry(ctypes.c_char_p(bytes(packed)), ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]),
                   ctypes.c_uint(block[1]))
    if status:
        raise AssertionError(f"{kernel}: launch geometry grid={grid} block={block} does not cover the work")


def _view(address: int, shape: tuple[int, ...], strides_elements: tuple[int, ...]) -> np.ndarray:
    """A float32 array of `shape` at `address` with the given element strides (no copy)."""
    span = 1 + sum((d - 1) * s for d, s in zip(shape, strides_elements)) if all(shape) else 0
    base = np.ctypeslib.as_array((ctypes.c_float * max(span, 1)).from_address(address))
    return np.lib.stride_tricks.as_strided(base, shape, tuple(4 * s for s in strides_elements))


def _matrix(address: int, rows: int, cols: int, ld: int, transposed: bool) -> np.ndarray:
    """op(M) for a row-major stored matrix: (rows x cols) after the optional transpose."""
    if transposed:
        return _view(address, (cols, rows), (ld, 1)).T
    return _view(address, (rows, cols), (ld, 1))


def _span(address: int, rows: int, cols: int, ld: int) -> tuple[int, int]:
    """Bytes [start, end) a row-major float32 matrix of `rows` x `cols` with row stride `ld` touches."""
    return address, address + 4 * ((rows - 1) * ld + cols)


def _disjoint(writes, reads, what: str) -> None:
    for w0, w1 in writes:
        for r0, r1 in reads:
            if w0 < r1 and r0 < w1:
                raise AssertionError(f"{what}: output bytes [{w0:#x}, {w1:#x}) overlap input bytes [{r0:#x}, {r1:#x})")


class HostDevice:
    """The device interface of cuda_ops over host memory and the host-compiled kernels (see the module doc).
    `programs` maps a generated program's kernel functions' module name to the host library of its `.cu`."""

    def __init__(self, ops_library: ctypes.CDLL | None = None):
        self.ops = ops_library or build()
        self.programs: dict[str, ctypes.CDLL] = {}
        self.launches: list[str] = []
        self.allocated = 0

    def add_program(self, module_name: str, cu_text: str) -> None:
        self.programs[module_name] = build(cu_text)

    def set_order(self, mode: int, seed: int = 1) -> None:
        """The order grid-stride items run in: 0 increasing, 1 decreasing, 2 pseudo-random (from `seed`)."""
        for library in (self.ops, *self.programs.values()):
            library.host_set_order(mode, seed)

    def alloc(self, nbytes):
        raw = np.empty(nbytes + 256, dtype=np.uint8)
        shift = (-raw.ctypes.data) % 256
        buffer = raw[shift:shift + nbytes]
        self.allocated += nbytes
        return buffer.ctypes.data, buffer

    def launch(self, kernel, fmt, grid, block, args, program=None):
        library = self.ops if program is None else self.programs[getattr(program, "__module__", program)]
        run_kernel(library, kernel, struct.pack("@" + fmt, *args), grid, block)
        self.launches.append(kernel)

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        _disjoint([_span(c, m, n, ldc)], [_span(a, *((k, m) if transa else (m, k)), lda),
                                          _span(b, *((n, k) if transb else (k, n)), ldb)], "gemm")
        product = _matrix(a, m, k, lda, transa) @ _matrix(b, k, n, ldb, transb)        # float32, as cuBLAS
        target = _view(c, (m, n), (ldc, 1))
        target[...] = np.float32(alpha) * product + (np.float32(beta) * target if beta else np.float32(0))

    def gemm_batched(self, transa, transb, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c, batch):
        """The products of a batch may run concurrently on a GPU: no output may overlap any operand."""
        outputs = [_span(c + 4 * i * stride_c, m, n, ldc) for i in range(batch)]
        operands = [_span(a + 4 * i * stride_a, *((k, m) if transa else (m, k)), lda) for i in range(batch)] + \
                   [_span(b + 4 * i * stride_b, *((n, k) if transb else (k, n)), ldb) for i in range(batch)]
        _disjoint(outputs, operands, "batched gemm")
        for i in range(batch):
            self.gemm(transa, transb, m, n, k, 1.0, a + 4 * i * stride_a, lda, b + 4 * i * stride_b, ldb, 0.0,
                      c + 4 * i * stride_c, ldc)

    def copy(self, dst, src, nbytes):
        _disjoint([(dst, dst + nbytes)], [(src, src + nbytes)], "device copy")
        ctypes.memmove(dst, src, nbytes)

    def upload(self, dst, array, staged=False):
        array = np.ascontiguousarray(array)
        ctypes.memmove(dst, array.ctypes.data, array.nbytes)

    def download(self, array, src):
        ctypes.memmove(array.ctypes.data, src, array.nbytes)

    def synchronize(self):
        pass
