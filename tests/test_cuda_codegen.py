"""The CUDA backend without a GPU: generated kernels compile, and everything the host decides is checked.

- Every elementwise kernel of generated/<net>.cu compiles with nvcc to PTX (each distinct one once, with the
  generic kernels), and the file with the most of them to cubins for sm_80 and sm_90 (skipped without nvcc), and
  `deepdsl compile`'s fat binary builds and is named by the digest the runtime looks for.
- sympy expressions print as float32 C that computes what numpy computes (compiled with the host C compiler).
- Broadcasting layouts, launch geometry, reduction plans, takeover waves, the batched-GEMM argument mapping and
  workspace chunking, as pure functions, against numpy or by their stated invariants.
- Every op of the CUDA backend (`deepdsl_runtime.cuda.ops`) on the host emulator (tests/support/cuda_emulator.py: the kernels' own code
  compiled for the CPU, launches run in increasing, decreasing and shuffled thread order) against the CPU backend,
  including writes over inputs that the memory plan allows; the dropout masks equal the CPU's bit for bit.
- Generated programs' training and test steps on the emulator, in every memory mode, against the CPU backend:
  same losses and parameters, and the device allocators measure exactly the planned peak.
- Without pycuda, `--device cuda` is a one-line error naming what is missing.
"""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
import math
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import sympy
from hypothesis import given, settings, strategies as st

from deepdsl.codegen.cuda import ARCHS, c_expression, find_nvcc, kernels_dir, nvcc_command, sources_digest
from deepdsl.ops.elementwise import derivative, sym
from deepdsl_runtime.cuda import layout as L
from deepdsl_runtime.memory import MODES
from tests.support import cuda_cases
from tests.support.program_helpers import ROOT, compile_program, import_program, model_class, run_cli

GENERATED = ROOT / "generated"
needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None, reason="needs gcc/g++")


# ----------------------------------------------------------------------------------------------------------------
# nvcc

@needs_nvcc
def test_every_generated_cu_compiles_for_sm80_and_sm90(tmp_path):
    """Every program's elementwise kernels through nvcc's front end to PTX (compute_80): each distinct kernel once,
    all in one file with the generic kernels (ops.cu, the same in every program; a kernel of a name another program
    uses for another expression renamed there), and the program with the most elementwise kernels, as it is,
    through ptxas as well, to a cubin for each of ARCHS."""
    files = sorted(GENERATED.glob("*.cu"))
    assert {f.stem for f in files} == {f.stem for f in GENERATED.glob("*.py")}, "a program without its kernels"
    kernels: dict[str, str] = {}               # the name in the common file -> the kernel's text there
    entries: dict[str, dict[str, str]] = {}    # program -> its kernel's name -> the name in the common file
    for cu in files:
        entries[cu.stem] = {}
        for name, text in _ew_blocks(cu.read_text()).items():
            for unique in itertools.chain([name], (f"{name}_v{k}" for k in itertools.count(2))):
                renamed = re.sub(rf"\bdeepdsl_{name}_", f"deepdsl_{unique}_", text)
                if kernels.setdefault(unique, renamed) == renamed:
                    break
            entries[cu.stem][name] = unique
    common = tmp_path / "every_kernel.cu"
    common.write_text('#include "ops.cu"\n' + "".join(kernels.values()))
    largest = max(files, key=lambda cu: len(entries[cu.stem]))
    jobs = [(common, "ptx", ARCHS[0])] + [(largest, "cubin", arch) for arch in ARCHS]

    def compile_one(job):
        cu, kind, arch = job
        command = nvcc_command(cu, tmp_path / f"{cu.stem}.sm{arch}.{kind}", kind=kind, archs=(arch,))
        done = subprocess.run(command, capture_output=True, text=True)
        return f"{cu.name} {kind} {arch}", done.returncode, done.stderr

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        failures = [f"{what}:\n{err}" for what, rc, err in pool.map(compile_one, jobs) if rc]
    assert not failures, "\n".join(failures)
    ptx = (tmp_path / f"{common.stem}.sm{ARCHS[0]}.ptx").read_text()
    for cu in files:              # every elementwise kernel of the program has its three entry points
        names = sorted(set(_ew_names(cu.with_suffix(".py").read_text())))
        assert names or cu.stem == "mlp", f"{cu.name}: no elementwise kernel"
        assert sorted(entries[cu.stem]) == names, f"{cu.name}: other kernels than its program calls"
        text = cu.read_text()
        for kernel in names:
            for nd in (1, 2, 4):
                assert f" {L.ew_entry(kernel, nd)}(" in text, f"{cu.name} lacks {L.ew_entry(kernel, nd)}"
                entry = L.ew_entry(entries[cu.stem][kernel], nd)
                assert f".entry {entry}(" in ptx, f"{entry} (of {cu.name}) missing from the PTX"
    if shutil.which("cuobjdump"):
        names = subprocess.run(["cuobjdump", "-symbols", str(tmp_path / f"{largest.stem}.sm{ARCHS[-1]}.cubin")],
                               capture_output=True, text=True).stdout
        for kernel in sorted(set(_ew_names(largest.with_suffix(".py").read_text()))):
            assert L.ew_entry(kernel, 4) in names, f"{kernel} missing from the cubin of {largest.name}"


def _ew_blocks(cu_text: str) -> dict[str, str]:
    """A generated .cu's elementwise kernels: name -> its text, from its `// ew_...` comment to the next one."""
    _, include, body = cu_text.partition('#include "ops.cu"\n')
    assert include, "the generic kernels are not included"
    blocks = re.split(r"(?m)^(?=// ew_\w+: )", body)
    assert not blocks[0].strip(), f"text before the first kernel: {blocks[0][:200]}"
    return {re.match(r"// (ew_\w+): ", block).group(1): block for block in blocks[1:]}


def _ew_names(program_text: str) -> list[str]:
    return re.findall(r"^def (ew_\w+)\(", program_text, re.M)


@needs_nvcc
def test_fat_binary_is_named_by_the_digest_the_runtime_looks_for(tmp_path):
    from deepdsl.codegen.cuda import build_fatbin

    cu = tmp_path / "mlp.cu"          # one small kernel: the names are the test (the programs' code is compiled above)
    cu.write_text('extern "C" __global__ void deepdsl_zero(float* x) { x[threadIdx.x] = 0.0F; }\n')
    (tmp_path / "mlp.0123456789abcdef.fatbin").write_bytes(b"stale")
    fatbin = build_fatbin(cu)
    assert fatbin is not None and fatbin.name == f"mlp.{sources_digest(cu.read_text())}.fatbin"
    assert [p.name for p in tmp_path.glob("*.fatbin")] == [fatbin.name]        # the stale one is gone
    assert fatbin.read_bytes()[:4] == bytes.fromhex("50ed55ba")                 # a CUDA fat binary
    cu.write_text(cu.read_text() + "\n// changed\n")
    assert sources_digest(cu.read_text()) not in fatbin.name                     # other sources, other name


def test_nvcc_command_lines():
    cu, out = Path("x.cu"), Path("x.fatbin")
    fat = nvcc_command(cu, out, nvcc="nvcc")
    assert fat[:3] == ["nvcc", "-fatbin", "-O3"] and fat[-3:] == ["-o", "x.fatbin", "x.cu"]
    assert ["-I", str(kernels_dir())] == fat[fat.index("-I"):fat.index("-I") + 2]
    assert "arch=compute_80,code=sm_80" in fat and "arch=compute_90,code=[sm_90,compute_90]" in fat
    assert "-arch=sm_90" in nvcc_command(cu, out, kind="cubin", archs=(90,), nvcc="nvcc")
    assert "-arch=compute_80" in nvcc_command(cu, out, kind="ptx", archs=(80,), nvcc="nvcc")


def test_runtime_and_compiler_agree_on_the_digest():
    text = (GENERATED / "lenet.cu").read_text()
    assert sources_digest(text) == L.kernel_sources_digest(text, ROOT / "runtime" / "kernels")
    assert len(sources_digest(text)) == 16 and sources_digest(text) != sources_digest(text + " ")


# ----------------------------------------------------------------------------------------------------------------
# printing sympy as float32 C

V0, V1, V2 = sym(0), sym(1), sym(2)
EXPRESSIONS = [
    sympy.Max(0, V0 + V1), V0 * sympy.Heaviside(V1, 0), derivative(sympy.Max(V0, 0), V0),
    sympy.Heaviside(V0, 1), sympy.Heaviside(V0), 1 / (1 + sympy.exp(-V0)), sympy.tanh(V0) * V1,
    sympy.log(sympy.Abs(V0) + 1), V0 ** 2 + V1 ** 3 - V2 ** 4, (V0 ** 2 + 1) ** sympy.Rational(-1, 2),
    (sympy.Abs(V1) + 0.5) ** -0.75, sympy.sqrt(sympy.Abs(V2)), -V0 / 500, V0 + 0.002 * sympy.exp(V1),
    V0 * V1 + V2 - sympy.Rational(1, 3) * V0, sympy.Min(6, sympy.Max(0, V0)), sympy.Min(V0, V1, V2),
    sympy.sign(V0) * V1, V0 / (V1 ** 2 + 1), sympy.exp(V0 - V1) / (1 + sympy.exp(V2)),
]


def test_printed_expressions_read_as_intended():
    assert c_expression(sympy.Max(0, V0 + V1)) == "deepdsl_maxf(v0 + v1, 0)"
    assert c_expression(V0 * sympy.Heaviside(V1, 0)) == "v0*((v1) > 0.0F ? 1.0F : 0.0F)"
    assert c_expression(V0 ** 2) == "(v0*v0)"
    assert c_expression((V0 + 1) ** 3) == "((v0 + 1)*(v0 + 1)*(v0 + 1))"
    assert c_expression(V0 ** sympy.Rational(-1, 2)) == "(1.0F/sqrtf(v0))"
    assert "expf(" in c_expression(sympy.exp(V0)) and "logf(" in c_expression(sympy.log(V0))
    assert "powf(" in c_expression(V0 ** 0.75) and "deepdsl_minf(" in c_expression(sympy.Min(V0, V1))
    float32_functions = {"expf", "logf", "powf", "deepdsl_maxf", "deepdsl_minf", "sqrtf", "tanhf", "fabsf",
                         "deepdsl_erff", "deepdsl_expf"}
    for expr in EXPRESSIONS:              # no double-precision function slips in
        called = set(re.findall(r"([A-Za-z_]\w*)\(", c_expression(expr)))
        assert called <= float32_functions, (str(expr), called - float32_functions)


@needs_cxx
def test_printed_expressions_compute_what_numpy_computes(tmp_path):
    functions = "\n".join(f"float f{i}(float v0, float v1, float v2) {{ return {c_expression(e)}; }}"
                          for i, e in enumerate(EXPRESSIONS))
    source = tmp_path / "expressions.c"
    source.write_text('#include <math.h>\n#include "deepdsl_math.h"\n' + functions + "\n")
    library = tmp_path / "expressions.so"
    subprocess.run(["gcc", "-std=c99", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-I", str(kernels_dir()),
                    "-o", str(library), str(source), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(library))
    rng = np.random.default_rng(0)
    points = np.concatenate([rng.uniform(-3, 3, (200, 3)), np.array([[0.0, 0.0, 0.0], [0.0, -1.0, 2.0],
                                                                     [-2.0, 0.0, 0.0]])]).astype(np.float32)
    for i, expr in enumerate(EXPRESSIONS):
        fn = getattr(lib, f"f{i}")
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float] * 3
        # numpy in float64 with the IR's Heaviside (value at 0 as written), the reference of the ew op
        reference = sympy.lambdify([V0, V1, V2], expr, modules=[{"Heaviside": _heaviside}, "numpy"])
        for p in points:
            want = float(np.broadcast_to(reference(*p.astype(np.float64)), ()))
            got = fn(*map(float, p))
            assert math.isclose(got, want, rel_tol=2e-6, abs_tol=2e-6), (str(expr), p.tolist(), got, want)
    # a NaN operand: Max and Min give NaN, as numpy's maximum and minimum do (fmaxf and fminf would drop it)
    for expr in (sympy.Max(0, V0 + V1), sympy.Min(6, sympy.Max(0, V0)), sympy.Min(V0, V1, V2)):
        fn = getattr(lib, f"f{EXPRESSIONS.index(expr)}")
        for nan_at in range(3):
            p = [1.0, 2.0, 3.0]
            p[nan_at] = math.nan
            want = float(sympy.lambdify([V0, V1, V2], expr, "numpy")(*map(np.float32, p)))
            assert math.isnan(fn(*p)) == math.isnan(want), (str(expr), p)


def _heaviside(x, at_zero=0.5):
    return np.where(x > 0, 1.0, np.where(x < 0, 0.0, at_zero))


# ----------------------------------------------------------------------------------------------------------------
# layouts and launch geometry (pure)

@st.composite
def broadcast_case(draw):
    out = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=5)))
    inputs = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()) and draw(st.booleans()):
            inputs.append(None)                                         # a host scalar
            continue
        drop = draw(st.integers(0, len(out)))
        shape = tuple(1 if draw(st.booleans()) and draw(st.booleans()) else d for d in out[drop:])
        inputs.append(shape)
    return out, inputs


@settings(max_examples=300, deadline=None)
@given(broadcast_case())
def test_ew_layout_reads_what_numpy_broadcasting_reads(case):
    out, inputs = case
    try:
        layout = L.ew_layout(out, inputs)
    except ValueError as err:
        assert "dimensions" in str(err)                     # only refused beyond four collapsed dimensions
        return
    assert layout.size == math.prod(out) and layout.nd in (1, 2, 4)
    for k, shape in enumerate(inputs):
        if shape is None:
            assert layout.strides[k] == (0, 0, 0, 0)
            continue
        expected = np.broadcast_to(np.arange(math.prod(shape)).reshape(shape), out).reshape(-1)
        got = [layout.offset(i, k) for i in range(layout.size)]
        assert got == expected.tolist(), (out, shape, layout)


def test_ew_layout_collapses_what_it_can():
    assert L.ew_layout((500, 500), [(500, 500), (500,)]) == L.EwLayout((1, 1, 500, 500), 2,
                                                                      ((0, 0, 500, 1), (0, 0, 0, 1)))
    assert L.ew_layout((8, 3, 5, 5), [(8, 3, 5, 5), (1, 3, 1, 1), None]).dims == (1, 8, 3, 25)
    assert L.ew_layout((2, 3, 4), [(2, 3, 4), (2, 3, 4), ()]).nd == 1
    with pytest.raises(ValueError, match="does not broadcast"):
        L.ew_layout((2, 3), [(3, 2)])
    with pytest.raises(ValueError, match="dimensions"):
        L.ew_layout((2, 3, 4, 5, 6), [(2, 1, 4, 1, 6), (1, 3, 1, 5, 1)])


def test_launch_geometry():
    assert L.launch_1d(1).grid == (1, 1) and L.launch_1d(0).grid == (1, 1)
    assert L.launch_1d(256).grid == (1, 1) and L.launch_1d(257).grid == (2, 1)
    assert L.launch_1d(10 ** 9).grid == (L.MAX_BLOCKS, 1) and L.launch_1d(10 ** 9).block == (256, 1, 1)
    with pytest.raises(ValueError, match="32 bits"):
        L.launch_1d(1 << 31)


def test_sum_plans():
    assert L.sum_plan((8, 3, 5, 5), (1, 3, 1, 1)) == L.SumPlan("middle", 8, 3, 25)
    assert L.sum_plan((500, 10), (10,)) == L.SumPlan("rows", 500, 10)
    assert L.sum_plan((500,), ()) == L.SumPlan("middle", 1, 1, 500)
    assert L.sum_plan((50, 10), (50, 1)) == L.SumPlan("middle", 1, 50, 10)
    assert L.sum_plan((4, 5), (4, 5)).kind == "copy" and L.sum_plan((1, 5), (5,)).kind == "copy"
    generic = L.sum_plan((2, 3, 4, 5), (2, 1, 4, 1))
    assert generic.kind == "generic" and generic.dims == (2, 3, 4, 5) and generic.reduced == 0b1010
    assert generic.count == 15


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 64), st.integers(1, 64), st.integers(0, 64), st.booleans())
def test_takeover_waves_cover_the_output_once_without_races(samples, big, small, shift, backward):
    """Launch by launch, as the GPU runs them: every output element is written by exactly one launch, in a parallel
    launch no element is written that an element of the same launch or a later one still reads, and ordered
    launches start where the earlier ones left off."""
    if small > big:
        big, small = small, big
    size_in, size_out = (small, big) if backward else (big, small)
    total_in, total_out = samples * size_in, samples * size_out
    # element addresses (itemsize 1): the output starts `shift` below (forward) or above (backward) the input
    in_addr, out_addr = (0, shift) if backward else (shift, 0)
    waves = L.takeover_waves(samples, size_in, size_out, in_addr, out_addr, itemsize=1, backward=backward)
    written = np.zeros(total_out, dtype=int)
    for k, wave in enumerate(waves):
        written[wave.begin:wave.end] += 1
        if wave.ordered:
            continue
        # inputs this launch and later ones read, by sample: forward reads samples >= its first, backward <= its last
        first, last = wave.begin // size_out, -(-wave.end // size_out)
        reads = (in_addr + first * size_in, in_addr + total_in) if not backward else (in_addr, in_addr + last * size_in)
        writes = (out_addr + wave.begin, out_addr + wave.end)
        assert writes[1] <= reads[0] or reads[1] <= writes[0], (waves, k)
    assert (written == 1).all(), waves
    assert sum(w.ordered for w in waves) <= 1


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 64), st.integers(1, 64))
def test_safe_sample_chunks_never_overwrite_an_unread_sample(samples, size_in, size_out):
    """Chunks in launch order cover every sample once; a chunk run directly writes no byte of an input sample it or
    a later chunk reads (output and input start at the same byte); staged chunks are single samples."""
    chunks = L.safe_sample_chunks(samples, size_in, size_out)
    done = np.zeros(samples, dtype=int)
    for k, (s, e, staged) in enumerate(chunks):
        done[s:e] += 1
        unread = [i for (a, b, _) in chunks[k:] for i in range(a, b)]
        if staged:
            assert e == s + 1
            continue
        writes = (s * size_out, e * size_out)
        for i in unread:                       # its own samples included: a launch reads and writes concurrently
            assert writes[1] <= i * size_in or (i + 1) * size_in <= writes[0], (chunks, k, i)
    assert (done == 1).all(), chunks


def test_strided_batched_gemm_mapping_computes_row_major_products():
    rng = np.random.default_rng(0)
    for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
        m, n, k, batch = 3, 4, 5, 2
        a = rng.standard_normal((batch, k, m) if ta else (batch, m, k))
        b = rng.standard_normal((batch, n, k) if tb else (batch, k, n))
        call = L.strided_batched_gemm(ta, tb, m, n, k, a.shape[2], a[0].size, b.shape[2], b[0].size, n, m * n, batch)
        operands = {"A": a.reshape(-1), "B": b.reshape(-1)}
        c = np.zeros(batch * m * n)
        for i in range(batch):       # what column-major cuBLAS computes from the call's arguments
            first = operands[call.first][i * call.stride_first:]
            second = operands[call.second][i * call.stride_second:]
            opa = _column_major(first, call.m, call.k, call.lda, call.transa)
            opb = _column_major(second, call.k, call.n, call.ldb, call.transb)
            result = opa @ opb                                    # (call.m x call.n), column-major in C
            for col in range(call.n):
                c[i * call.stride_c + col * call.ldc:i * call.stride_c + col * call.ldc + call.m] = result[:, col]
        want = np.stack([(a[i].T if ta else a[i]) @ (b[i].T if tb else b[i]) for i in range(batch)])
        assert np.allclose(c.reshape(batch, m, n), want), (ta, tb)


def _column_major(flat, rows, cols, ld, transposed):
    """op(X) (rows x cols) of a column-major matrix X stored in `flat` with leading dimension `ld`."""
    stored_rows, stored_cols = (cols, rows) if transposed else (rows, cols)
    matrix = np.array([[flat[j * ld + i] for j in range(stored_cols)] for i in range(stored_rows)])
    return matrix.T if transposed else matrix


def test_conv_samples():
    assert L.conv_samples(10, None, 7) == 10 and L.conv_samples(10, 70, 7) == 10
    assert L.conv_samples(10, 69, 7) == 9 and L.conv_samples(10, 7, 7) == 1 and L.conv_samples(10, 0, 0) == 10
    with pytest.raises(ValueError, match="holds no sample"):
        L.conv_samples(10, 6, 7)


# ----------------------------------------------------------------------------------------------------------------
# the ops on the host emulator

@pytest.fixture(scope="module")
def emulator():
    from tests.support.cuda_emulator import HostDevice

    return HostDevice()


@needs_cxx
@pytest.mark.parametrize("order", [0, 1, 2], ids=["increasing", "decreasing", "shuffled"])
@pytest.mark.parametrize("case", cuda_cases.CASES, ids=[c.__name__[5:] for c in cuda_cases.CASES])
def test_ops_on_the_emulator_match_the_cpu_backend(case, order, emulator):
    from deepdsl_runtime.cuda import ops as cuda_ops

    emulator.set_order(order, seed=17)
    for label, got, expected, tolerance in case(cuda_ops.on(emulator), np.random.default_rng(4)):
        cuda_cases.compare(cuda_ops, label, got, expected, tolerance)


@needs_cxx
def test_data_parallel_sums_of_device_arrays_go_through_the_host(emulator):
    """`--device cuda` with --data-parallel: the accumulators are device arrays, zeroed on the device and summed
    over the ranks through host memory; `all_sum` likewise (a stand-in for 2 ranks holding equal values)."""
    import types

    from deepdsl_runtime import parallel
    from deepdsl_runtime.cuda import ops as cuda_ops
    from deepdsl_runtime.program import State

    class TwoEqualRanks:
        size, mode = 2, "exact"

        def reduce(self, flat):
            flat *= 2               # this rank's values plus the other's, equal to them

    rt = cuda_ops.on(emulator)
    model = types.SimpleNamespace(rt=rt, tensors={}, accumulators={"G_a": State((3, 4), "constant(0.0)"),
                                                                   "G_b": State((5,), "constant(0.0)")})
    gradients = parallel.Gradients(model)
    assert not gradients.on_host and isinstance(model.tensors["G_a"], cuda_ops.DeviceArray)
    values = {"G_a": np.arange(12, dtype=np.float32).reshape(3, 4), "G_b": np.full(5, -1.5, np.float32)}
    for name, value in values.items():
        rt.copy(rt.asarray(value), out=model.tensors[name])
    gradients.reduce(TwoEqualRanks())
    for name, value in values.items():
        np.testing.assert_array_equal(rt.to_numpy(model.tensors[name]), 2 * value)
    gradients.zero()
    for name, value in values.items():
        np.testing.assert_array_equal(rt.to_numpy(model.tensors[name]), np.zeros_like(value))
    out = rt.zeros((2, 3), "float32")
    rt.all_sum(rt.asarray(values["G_a"][:2, :3].copy()), out=out, ranks=TwoEqualRanks())
    np.testing.assert_array_equal(rt.to_numpy(out), 2 * values["G_a"][:2, :3])


@needs_cxx
def test_ops_run_on_the_device_of_their_arrays():
    """No current device: two devices side by side, each op runs on its output's device, interleaved."""
    from deepdsl_runtime import cpu
    from deepdsl_runtime.cuda import ops as cuda_ops
    from tests.support.cuda_emulator import HostDevice

    assert not hasattr(cuda_ops, "use_device") and not hasattr(cuda_ops, "current_device")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    want = np.empty((2, 4, 5, 5), np.float32)
    cpu.conv2d(x, w, out=want, stride=1, pad=0)
    devices = [HostDevice(), HostDevice()]
    backends = [cuda_ops.on(d) for d in devices]
    outs = [g.zeros(want.shape, "float32") for g in backends]
    inputs = [(g.asarray(x), g.asarray(w)) for g in backends]
    assert [o.device for o in outs] == devices and inputs[1][0].reshape(-1).device is devices[1]
    for k in (1, 0):
        backends[k].conv2d(*inputs[k], out=outs[k], stride=1, pad=0)
    for out in outs:
        np.testing.assert_allclose(cuda_ops.to_numpy(out), want, rtol=1e-5, atol=1e-5)


@needs_cxx
def test_the_emulator_catches_a_racy_launch(emulator):
    """Max pooling over its own input in one parallel launch (no waves) goes wrong in some thread order: the
    emulator would expose a kernel schedule that races."""
    from deepdsl_runtime import cpu
    from deepdsl_runtime.cuda import ops as cuda_ops

    x = np.random.default_rng(0).standard_normal((9, 3, 8, 8)).astype(np.float32)
    ref = np.empty((9, 3, 4, 4), np.float32)
    cpu.max_pool(x, out=ref, kernel=2, stride=2)
    outcomes = []
    for order in (0, 1, 2):
        emulator.set_order(order, seed=3)
        ptr, owner = emulator.alloc(x.nbytes)
        emulator.upload(ptr, x)
        config = L.launch_1d(ref.size)
        emulator.launch("deepdsl_max_pool_range", "I" * 8 + "PPII", config.grid, config.block,
                        (9 * 3, 8, 8, 4, 4, 2, 2, 0, ptr, ptr, 0, ref.size))
        out = cuda_ops.DeviceArray(ptr, ref.shape, np.float32, owner, emulator)
        outcomes.append(np.array_equal(cuda_ops.to_numpy(out), ref))
    assert outcomes[0] and not all(outcomes)


@needs_cxx
@pytest.mark.parametrize("network", ["resnet_mini", "user_functions"])
def test_generated_elementwise_kernels_match_the_numpy_kernels(emulator, network, tmp_path):
    """Each ewK of a program's .cu against the numpy ewK of its .py, over random broadcast shapes, float32, uint8
    and host-scalar inputs, and in place: generated/resnet_mini, and a network of user functions (erf, Mish through
    softplus, sign: tests/test_generated.py's USER_FUNCTIONS_NET)."""
    from deepdsl_runtime.cuda import ops as cuda_ops
    from tests.test_generated import USER_FUNCTIONS_NET

    if network == "user_functions":
        (tmp_path / "user_functions.py").write_text(USER_FUNCTIONS_NET)
        _, path = compile_program(tmp_path / "user_functions.py", tmp_path)
    else:
        path = GENERATED / "resnet_mini.py"
    module = import_program(path)
    emulator.add_program(module.__name__, path.with_suffix(".cu").read_text())
    rng = np.random.default_rng(1)
    checked = 0
    for name in _ew_names(path.read_text()):
        kernel = getattr(module, name)
        nargs = kernel.__code__.co_argcount - 1
        for trial in range(4):
            emulator.set_order(trial % 3, seed=trial)
            out_shape = (2, 3, 4, 5)
            shapes = [None if (trial == 1 and k == nargs - 1) else
                      ((3, 1, 1) if (trial == 2 and k == 0) else ((5,) if trial == 3 and k == 0 else out_shape))
                      for k in range(nargs)]
            args = [np.float32(rng.uniform(0.5, 1.5)) if s is None else
                    rng.uniform(0.5, 1.5, s).astype(np.float32) for s in shapes]
            if trial == 3 and nargs > 1:
                args[1] = (rng.random(out_shape) < 0.5).astype(np.uint8)
            want = np.empty(out_shape, np.float32)
            kernel(want, *[a.astype(np.float32) if isinstance(a, np.ndarray) else a for a in args])
            device_args = [cuda_ops.asarray(a, device=emulator) if isinstance(a, np.ndarray) else a for a in args]
            out = cuda_ops.zeros(out_shape, "float32", device=emulator)
            cuda_ops.ew(kernel, out, *device_args)
            cuda_cases.compare(cuda_ops, f"{name} trial {trial}", out, want, 1e-5)
            full = [k for k, s in enumerate(shapes) if s == out_shape and args[k].dtype == np.float32]
            if full:                                            # in place over a full-size input
                target = device_args[full[0]]
                cuda_ops.ew(kernel, target, *device_args)
                cuda_cases.compare(cuda_ops, f"{name} in place, trial {trial}", target, want, 1e-5)
            checked += 1
    assert checked >= 4 * 4


# ----------------------------------------------------------------------------------------------------------------
# generated programs on the emulator

# network, image, memory modes (alexnet, for its LRN and dropout, in one: its 4096-wide layers are slow to emulate)
EMULATED = [("lenet", None, MODES), ("mlp", None, MODES), ("alexnet", (55, 55), ("static",)),
            ("resnet_mini", None, MODES), ("inception_mini", None, MODES), ("se_resnet", None, ("static",)),
            ("unet", None, ("static",)), ("vit", None, ("static",)), ("char_lm", None, ("static",)),
            # tests/test_generated.py's networks of newer layers: user functions (erf, softplus, sign), grouped
            # convolution, layer norm, broadcasting and zero channels; transposed convolution and upsampling
            ("user_functions", None, ("static",)), ("modern_parts", None, ("static",)),
            ("unet_parts", None, ("static",)), ("autoencoder", None, ("static",))]
# networks trained by Adam(W): it divides each element's step by the size of its gradients, so an element whose two
# gradients nearly cancel moves by an amount float32 rounding changes (1.6e-4 of the largest weight in the ViT here,
# 1.7e-3 in the language model, whose steps of lr 0.01 move a weight of 0.24 by up to 8 %)
ADAPTIVE_TOLERANCE = {"vit": 1e-3, "char_lm": 3e-3}
_compiled: dict = {}


def _program(name, image, batch, tmp_path_factory):
    if name not in _compiled:
        from tests import test_generated

        directory = tmp_path_factory.mktemp(f"cuda-{name}")
        network, text = name, getattr(test_generated, f"{name.upper()}_NET", None)
        if text is not None:
            network, batch = directory / f"{name}.py", None
            network.write_text(text)
        compiled, path = compile_program(network, directory, batch=batch, image=image)
        module = import_program(path)
        _compiled[name] = compiled, module, path
    return _compiled[name]


def _steps(model, data, hyper=(0.01, 0.9, 0.001)):
    model.initialize(0)
    model.prepare(model.hyper(*hyper, 0))
    losses = [model.train_step(x, y, step=k, **model.hyper(*hyper, k)) for k, (x, y) in enumerate(data)]
    accuracy, test_loss, _ = model.test_step(*data[0])
    return losses, accuracy, test_loss, model.host_tensors()


def check_steps_equal_the_cpu(model, data, expected, tolerance=1e-4):
    """Two training steps and a test step of `model` (a device model in some memory mode) on `data` give the CPU's
    losses, accuracy, test loss and parameters (`expected`, from `_steps` on a CPU model) within `tolerance`, and
    its allocator measures exactly the planned peaks and workspace of both steps."""
    mode = model.mem.mode
    losses, accuracy, test_loss, tensors = expected
    got_losses, got_accuracy, got_test_loss, got_tensors = _steps(model, data)
    assert np.allclose(got_losses, losses, rtol=tolerance, atol=1e-6), (mode, got_losses, losses)
    # a classifier's accuracy counts examples (equal); a network of float targets computes a float metric instead
    same_metric = got_accuracy == accuracy if model.classes else math.isclose(got_accuracy, accuracy,
                                                                              rel_tol=tolerance)
    assert same_metric and math.isclose(got_test_loss, test_loss, rel_tol=tolerance), (mode, got_accuracy, accuracy)
    for key, value in tensors.items():
        scale = max(float(np.max(np.abs(value))), 1e-6)
        assert float(np.max(np.abs(got_tensors[key] - value))) / scale <= tolerance, (mode, key)
    for step in ("train_step", "test_step"):
        plan = type(model).memory_plans[step]
        usage = model.mem.usage[step]
        assert usage.peak_bytes == plan.planned_peak(mode), (mode, step)
        assert usage.workspace_bytes == plan.workspace_bytes, (mode, step)


@needs_cxx
@pytest.mark.parametrize("name,image,modes", EMULATED, ids=[n for n, _, _ in EMULATED])
def test_generated_program_on_the_emulator_matches_the_cpu(name, image, modes, emulator, tmp_path_factory,
                                                          monkeypatch):
    """Two training steps and a test step with device tensors and device allocators, in every memory mode: the
    CPU's losses, accuracy and parameters (float32 rounding apart), and the planned peaks measured exactly. The
    model is made as `--device cuda` makes it, with the emulated device behind the CUDA ops."""
    import types

    from deepdsl_runtime import program as runtime_program
    from deepdsl_runtime.cuda import ops as cuda_ops

    compiled, module, path = _program(name, image, 2, tmp_path_factory)
    bound = []
    backend = types.SimpleNamespace(**vars(cuda_ops.on(emulator)), bind_program=bound.append)
    cpu_backend = runtime_program.backend
    monkeypatch.setattr(runtime_program, "backend", lambda device: backend if device == "cuda" else cpu_backend(device))
    emulator.add_program(module.__name__, path.with_suffix(".cu").read_text())
    cls = model_class(module)
    rng = np.random.default_rng(7)
    data = [cls.random_batch(rng) for _ in range(2)]
    expected = _steps(cls("cpu", 0, "static"), data)
    # thread orders: shuffled, decreasing, increasing (the fast one alone for a single mode)
    for mode, order in zip(modes, (2, 1, 0)[3 - len(modes):]):
        emulator.set_order(order, seed=11)
        model = cls("cuda", 0, mode, True)
        assert bound[-1] == str(path) and model.mem.mode == mode
        check_steps_equal_the_cpu(model, data, expected, ADAPTIVE_TOLERANCE.get(name, 1e-4))
        assert isinstance(model.mem.workspace_region, cuda_ops.DeviceArray)
        if mode == "static":
            assert isinstance(model.mem.arena, cuda_ops.DeviceArray)


# ----------------------------------------------------------------------------------------------------------------
# without a GPU

@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed here")
def test_device_cuda_without_pycuda_is_one_line_naming_it(tmp_path):
    _, program = compile_program("lenet", tmp_path, batch=4)
    assert program.with_suffix(".cu").exists()
    done = run_cli(program, "--device", "cuda", "--iters", "1", "--params", str(tmp_path / "p.npz"))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pycuda" in lines[0] and "CUDA backend not available" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "p.npz").exists()


STABLE = {  # user functions whose written-out forms overflow in float32, with PyTorch's own (torch, F, x)
    "mish": ("v * tanh(log(1 + exp(v)))", lambda torch, F, x: x * torch.tanh(F.softplus(x))),
    "swish": ("v / (1 + exp(-v))", lambda torch, F, x: x * torch.sigmoid(x)),
    "softplus": ("log(1 + exp(v))", lambda torch, F, x: F.softplus(x)),
    "gelu": ("v * (1 + erf(v / sqrt(2))) / 2", lambda torch, F, x: F.gelu(x)),
}


@needs_cxx
@pytest.mark.parametrize("name", sorted(STABLE))
def test_user_functions_and_their_gradients_stay_finite_at_extremes(name, tmp_path):
    """Far in both tails (|v| up to 200, where exp overflows float32) the numpy kernel and the C kernel of a user
    function and of its derivative give PyTorch's float32 values, not NaN or inf."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from deepdsl import dsl as D
    from tests.test_runtime_cpu import kernel, leaf

    text, reference = STABLE[name]
    expr = D.elementwise(name, text)(D.Tensor(leaf("x", (8,)))).node.attr("expr")
    xs = np.array([-200.0, -90.0, -20.0, -0.5, 0.5, 20.0, 90.0, 200.0], np.float32)
    x = torch.tensor(xs, requires_grad=True)
    value = reference(torch, F, x)
    value.sum().backward()
    for k, (e, want) in enumerate(((expr, value.detach().numpy()), (derivative(expr, sym(0)), x.grad.numpy()))):
        out = np.empty_like(xs)
        with np.errstate(over="raise", invalid="raise"):         # no overflow or NaN on the way either
            kernel(e, 1)(out, xs)
        np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-6, err_msg=f"numpy {e}")
        source = tmp_path / f"f{k}.c"
        source.write_text(f'#include <math.h>\n#include "deepdsl_math.h"\nfloat f(float v0) {{ return {c_expression(e)}; }}\n')
        library = tmp_path / f"f{k}.so"
        subprocess.run(["gcc", "-std=c99", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-I", str(kernels_dir()),
                        "-o", str(library), str(source), "-lm"], check=True, capture_output=True)
        fn = ctypes.CDLL(str(library)).f
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
        got = np.array([fn(float(v)) for v in xs], np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=f"C {c_expression(e)}")
