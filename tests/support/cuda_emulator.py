"""A host emulator of the CUDA backend's device, for tests on machines without a GPU.

`HostDevice` implements the device interface of `deepdsl_runtime.cuda.ops` with host memory: allocations are
aligned numpy buffers, GEMMs are numpy products over the addressed memory (the stand-in for cuBLAS), and kernel
launches run the kernels' own CUDA source compiled for the CPU with g++, behind the shim tests/support/simt_host.h. The
host entry point of each kernel is generated from the kernel's signature and body in the CUDA source itself:

- its parameters become a struct, into which the launcher's packed argument buffer (`struct.pack` of the same
  format string the pycuda launcher uses, native alignment) is read -- so a format string that disagrees with the
  kernel's parameter list fails here as it would on the GPU;
- a launch's grid and block must be within CUDA's limits and the kernel's `__launch_bounds__`;
- a grid-stride body `DEEPDSL_FOR(i, begin, end) statement` runs item after item in the order `set_order` chose:
  increasing, decreasing or a pseudo-random permutation. The threads of a launch may run in any order on a GPU,
  so a launch is race-free only if every order gives the same result: tests run in all three orders, and a
  launch whose items read what other items write (pooling over its own input done wrongly) fails in some;
- every other kernel -- those with `__shared__` memory and `__syncthreads()`: the reductions, the ordered pooling
  passes, the tiled GEMM of gemm.cu -- runs as written, SIMT-style: every block of the grid, one after another,
  each thread of a block on its own fiber, all threads up to a barrier in the `set_order` order (reshuffled for
  every block and phase), then all up to the next; shared memory is filled with 0xff bytes (NaN) before each block,
  and a divergent barrier is an error of the launch. See tests/support/simt_host.h.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "runtime" / "kernels"
SHIM = Path(__file__).resolve().parent / "simt_host.h"
CACHE = Path(tempfile.gettempdir()) / "deepdsl-cuda-emulator"

# a kernel: DEEPDSL_KERNEL (ops.cu, generated programs), or a __global__ function with optional launch bounds
_SIGNATURE = re.compile(
    r'(DEEPDSL_KERNEL|(?:DEEPDSL_GLOBAL|(?:extern\s+"C"\s+)?__global__)\s+void(?:\s+__launch_bounds__\((\w+)\))?)'
    r"\s+(\w+)\(([^)]*)\)\s*\{", re.S)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
_SHARED = re.compile(r"__shared__\s+[\w\s:<>,*]*?\b(\w+)\s*[\[;]")


@dataclass(frozen=True)
class Kernel:
    """A __global__ kernel of a CUDA source: its parameters ([(type, name)]), its body and the expression of its
    `__launch_bounds__` (1024, CUDA's limit, where it has none)."""
    params: list[tuple[str, str]]
    body: str
    bound: str


def expand_includes(source: str, seen: set[str] | None = None) -> str:
    """`source` with its `#include "..."` lines of runtime/kernels replaced by their text, each file once."""
    seen = set() if seen is None else seen

    def include(match: re.Match) -> str:
        name = match.group(1)
        if name in seen or not (KERNELS / name).is_file():
            return ""
        seen.add(name)
        return expand_includes((KERNELS / name).read_text(), seen)

    return _INCLUDE.sub(include, source)


def parse_kernels(source: str) -> dict[str, Kernel]:
    """name -> Kernel, for every __global__ kernel of a CUDA source (includes expanded)."""
    kernels = {}
    for match in _SIGNATURE.finditer(source):
        prefix, bound, name, params = match.groups()
        depth, i = 1, match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            i += 1
        parsed = []
        for p in params.split(","):
            p = " ".join(p.split())
            m = re.match(r"(.*?)(\w+)$", p)
            parsed.append((m.group(1).strip(), m.group(2)))
        limit = "DEEPDSL_THREADS" if prefix == "DEEPDSL_KERNEL" else bound or "1024"
        kernels[name] = Kernel(parsed, source[match.end():i - 1].strip(), limit)
    return kernels


_FOR = re.compile(r"^DEEPDSL_FOR\((\w+),\s*([^,]+),\s*([^)]+)\)\s*(.*)$", re.S)


def _host_function(name: str, kernel: Kernel) -> str:
    """The host entry points of a kernel: `host_args_<name>` (the bytes of its parameters), `host_bounds_<name>`
    (its `__launch_bounds__`) and `host_<name>(args, geometry)`, which runs a launch and returns 0, or 1 with the
    reason in `host_error()`."""
    params = kernel.params
    fields = "".join(f"    {t} {n};\n" for t, n in params)
    last = params[-1][1]                       # the parameter bytes a launch packs: up to the end of the last one
    args_size = f"offsetof(P_{name}, {last}) + sizeof(P_{name}::{last})"
    lines = [f"struct P_{name} {{\n{fields}}};",
             f'extern "C" unsigned host_args_{name}() {{ return {args_size}; }}',
             f'extern "C" unsigned host_bounds_{name}() {{ return {kernel.bound}; }}']
    if (m := _FOR.match(kernel.body)) is not None:
        # a grid-stride loop: its items one after another, in the chosen order
        var, begin, end, statement = m.group(1), m.group(2), m.group(3), " ".join(m.group(4).split())
        unpack = "".join(f"    auto {n} = p.{n}; (void){n};\n" for _, n in params)
        lines.append(f"""extern "C" int host_{name}(const void* raw, const unsigned* geometry) {{
    if (simt::check_geometry(geometry, {kernel.bound})) return 1;
    const P_{name}& p = *static_cast<const P_{name}*>(raw);
{unpack.rstrip()}
    if (simt::order_mode == 0) {{
        for (unsigned {var} = {begin}; {var} < {end}; ++{var}) {statement}
        return 0;
    }}
    for (unsigned {var} : simt::item_order({begin}, {end})) {statement}
    return 0;
}}""")
    else:
        # anything else runs as written, SIMT-style (simt_host.h)
        call = ", ".join(f"p.{n}" for _, n in params)
        lines.append(f"""static void simt_run_{name}(const void* raw) {{
    const P_{name}& p = *static_cast<const P_{name}*>(raw);
    {name}({call});
}}
extern "C" int host_{name}(const void* raw, const unsigned* geometry) {{
    return simt::launch(geometry, {kernel.bound}, simt_run_{name}, raw);
}}""")
    return "\n".join(lines)


def host_source(cu_text: str) -> str:
    """C++ source: the shim, `cu_text` and a host entry point per kernel of it (and of the files it includes)."""
    kernels = parse_kernels(expand_includes(cu_text))
    parts = ['#include "simt_host.h"', f'#line 1 "kernel.cu"\n{cu_text}']      # errors name the kernel source
    parts += [_host_function(name, kernel) for name, kernel in kernels.items()]
    return "\n\n".join(parts) + "\n"


def _shared_variables(library: Path, names: set[str]) -> list[tuple[int, int]]:
    """(offset, size) of every static of the library named as a `__shared__` variable of the source: the local
    statics `<function>::<name>` in its symbol table (template instantiations included)."""
    listing = subprocess.run(["nm", "-S", "-C", "--defined-only", str(library)], check=True, capture_output=True,
                             text=True).stdout
    regions = []
    for line in listing.splitlines():
        fields = line.split(maxsplit=3)
        if len(fields) == 4 and fields[2] in "bBdDuV" and "::" in fields[3] and \
                fields[3].rsplit("::", 1)[1] in names:
            regions.append((int(fields[0], 16), int(fields[1], 16)))
    return regions


class HostLibrary:
    """The host build of a CUDA source: its kernels (name -> `Kernel`) and their entry points."""

    def __init__(self, path: Path, kernels: dict[str, Kernel], shared: list[tuple[int, int]]):
        self.cdll = ctypes.CDLL(str(path))
        self.kernels = kernels
        self.cdll.host_error.restype = ctypes.c_char_p
        count = len(shared)
        self.cdll.host_set_shared((ctypes.c_ulonglong * max(count, 1))(*(o for o, _ in shared)),
                                  (ctypes.c_ulonglong * max(count, 1))(*(s for _, s in shared)), ctypes.c_uint(count))
        self.shared_bytes = sum(s for _, s in shared)

    def set_order(self, mode: int, seed: int = 1) -> None:
        """The order threads run in: 0 increasing, 1 decreasing, 2 pseudo-random (from `seed`)."""
        self.cdll.host_set_order(ctypes.c_int(mode), ctypes.c_uint(seed))

    def bounds(self) -> dict[str, int]:
        """name -> the most threads per block each kernel may be launched with: its `__launch_bounds__` (a block
        larger than that fails to launch on a GPU)."""
        return {name: getattr(self.cdll, f"host_bounds_{name}")() for name in self.kernels}

    def run(self, kernel: str, packed: bytes, grid, block) -> None:
        """Run `kernel` on an argument buffer packed as a launcher packs it for the GPU (the kernel's parameters
        with native alignment, checked to be as long as the parameter list) over `grid` x `block` (up to three
        dimensions each)."""
        expected = getattr(self.cdll, f"host_args_{kernel}")()
        if len(packed) != expected:
            raise AssertionError(f"{kernel}: {len(packed)} bytes of arguments for parameters of {expected} bytes")
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        args = (ctypes.c_uint64 * (len(packed) // 8 + 1))()            # aligned for every parameter type
        ctypes.memmove(args, bytes(packed), len(packed))
        geometry = (ctypes.c_uint * 6)(*grid, *block)
        if getattr(self.cdll, f"host_{kernel}")(args, geometry):
            raise AssertionError(f"{kernel} grid={grid} block={block}: {self.cdll.host_error().decode()}")


def build(cu_text: str = '#include "ops.cu"\n') -> HostLibrary:
    """The host library of a CUDA source (default: the generic kernels alone), built once per source and cached on
    disk."""
    text = host_source(cu_text)
    expanded = expand_includes(cu_text)
    key = hashlib.sha256(text.encode() + expanded.encode() + SHIM.read_bytes()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    library, table = CACHE / f"host-{key}.so", CACHE / f"host-{key}.shared.json"
    if not library.exists():
        source = CACHE / f"host-{key}.cpp"
        source.write_text(text)
        partial = CACHE / f"host-{key}.{id(text)}.so"
        subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-I", str(KERNELS),
                        "-I", str(SHIM.parent), "-o", str(partial), str(source)],
                       check=True, capture_output=True, text=True)
        shared = _shared_variables(partial, set(_SHARED.findall(expanded)))
        partial_table = table.with_suffix(f".{id(text)}")
        partial_table.write_text(json.dumps(shared))
        partial_table.replace(table)
        partial.replace(library)
    return HostLibrary(library, parse_kernels(expanded), [tuple(r) for r in json.loads(table.read_text())])


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
    """The device interface of `deepdsl_runtime.cuda.ops` over host memory and the host-compiled kernels (see the
    module doc). `programs` maps a generated program's kernel functions' module name to the host library of its `.cu`."""

    def __init__(self, ops_library: HostLibrary | None = None):
        self.ops = ops_library or build()
        self.programs: dict[str, HostLibrary] = {}
        self.launches: list[str] = []
        self.allocated = 0
        self.order = (0, 1)

    def add_program(self, module_name: str, cu_text: str) -> None:
        self.programs[module_name] = build(cu_text)
        self.programs[module_name].set_order(*self.order)

    def set_order(self, mode: int, seed: int = 1) -> None:
        """The order threads run in: 0 increasing, 1 decreasing, 2 pseudo-random (from `seed`)."""
        self.order = (mode, seed)
        for library in (self.ops, *self.programs.values()):
            library.set_order(mode, seed)

    def alloc(self, nbytes):
        raw = np.empty(nbytes + 256, dtype=np.uint8)
        shift = (-raw.ctypes.data) % 256
        buffer = raw[shift:shift + nbytes]
        self.allocated += nbytes
        return buffer.ctypes.data, buffer

    def launch(self, kernel, fmt, grid, block, args, program=None):
        library = self.ops if program is None else self.programs[getattr(program, "__module__", program)]
        library.run(kernel, struct.pack("@" + fmt, *args), grid, block)
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
