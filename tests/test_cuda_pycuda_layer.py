"""The pycuda layer of the CUDA backend, run on a strict fake of pycuda and cuBLAS (tests/support/fake_pycuda.py).

What the host emulator does not reach -- `runtime/cuda/pycuda_device.py` (`start_driver`, `PycudaDevice`),
`runtime/cuda/driver.py` (contexts, `Cublas` through ctypes, `PinnedStaging`, `GemmKernels`, `CudaContext.alloc`,
peer access) and `runtime/gemm/cuda_device.py` (`CudaDevice`) -- runs here unchanged against a pycuda with the real API, argument
conventions and failure modes (pycuda 2026.1), whose device memory is host memory and whose kernels are the
emulator's host builds. Streams run lazily (work runs when something waits for it), so an ordering mistake computes
wrong numbers. No GPU, no pycuda and no libcublas are needed; the kernels need g++ (skipped without it).

- `deepdsl_runtime.cuda.start()` starts on the fake: cuBLAS when the library is offered, our tiled SGEMM when it
  cannot be loaded, lacks a function or cannot create a handle; the context is popped when the device closes.
- Generated LeNet and inception_mini at batch 2: two training steps and a test step through `Model("cuda")` (the
  way `--device cuda` makes it) equal the CPU backend's in the static, pooled and dynamic memory modes with the
  planned peaks measured exactly, loading the kernels from a fat binary, from source (`SourceModule`), or from
  source after the driver refused a fat binary.
- The multi-device tiled GEMM on `CudaDevice`s: numpy's results for odd shapes, all transposes, beta = 0 over a
  NaN C, float32 and float64, cuBLAS and our kernel; the same transfer counters as `CpuDevice`s; peer copies.
- Without a driver or a GPU, or with a GPU that cannot be used, `--device cuda` fails with one line.
- The fake itself refuses what real pycuda/CUDA refuse (so passing here means something).
"""
from __future__ import annotations

import importlib.util
import shutil
import sys

import numpy as np
import pytest

import deepdsl_runtime
from deepdsl_runtime.cuda import driver as cuda_device
from deepdsl_runtime.cuda.layout import kernel_sources_digest
from deepdsl_runtime.gemm import CpuDevice, TiledGemm
from deepdsl_runtime.memory import MODES
from deepdsl_runtime.program import RunError, backend
from tests.support import fake_pycuda
from tests.support.program_helpers import import_program, model_class
from tests.test_cuda_codegen import _program, _steps, check_steps_equal_the_cpu

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (kernels run on the host emulator)")
KERNELS = deepdsl_runtime.cuda.driver.GEMM_KERNEL_SOURCE.parent


_offer = fake_pycuda.cublas_class


@pytest.fixture
def fake(monkeypatch):
    """The fake pycuda installed, `deepdsl_runtime.cuda` not yet imported (each test starts it afresh)."""
    machine = fake_pycuda.install(monkeypatch)
    monkeypatch.setattr(cuda_device, "_driver", None)
    monkeypatch.delitem(sys.modules, "deepdsl_runtime.cuda", raising=False)
    monkeypatch.delattr(deepdsl_runtime, "cuda", raising=False)
    yield machine
    # the backend this test imported on the fake goes with it (monkeypatch restores only what was there before)
    sys.modules.pop("deepdsl_runtime.cuda", None)
    if hasattr(deepdsl_runtime, "cuda"):
        delattr(deepdsl_runtime, "cuda")


@pytest.fixture
def start(fake, monkeypatch, tmp_path):
    """start(cublas): import and start `deepdsl_runtime.cuda` on the fake, with cuBLAS "offered" (the fake library), "missing"
    (no library loads), "incomplete" (a function missing) or "failing" (cublasCreate fails). Closes the device at
    the end and checks the context stack is empty again."""
    modules = []

    def start_backend(cublas: str = "offered"):
        if cublas == "offered":
            monkeypatch.setattr(cuda_device, "Cublas", _offer(fake.cublas_library))
        elif cublas == "incomplete":
            monkeypatch.setattr(cuda_device, "Cublas", _offer(fake.cublas_library.without("cublasSgemmStridedBatched")))
        elif cublas == "failing":
            fake.cublas_create_status = 1                  # CUBLAS_STATUS_NOT_INITIALIZED
            monkeypatch.setattr(cuda_device, "Cublas", _offer(fake.cublas_library))
        else:
            assert cublas == "missing"
            monkeypatch.setattr(cuda_device, "cublas_library_candidates", lambda: [str(tmp_path / "libcublas.so.0")])
        rt = importlib.import_module("deepdsl_runtime.cuda")
        rt.start()
        modules.append(rt)
        return rt

    yield start_backend
    for rt in modules:
        rt._device.close()
        rt._device.close()                                   # idempotent, as at exit after an explicit close
    assert fake.stack() == [], "a context is left pushed: pycuda aborts at exit"


def _matmul_and_conv(rt, rng):
    """A GEMM (all transposes) and a convolution (a strided batched GEMM) on the device against numpy."""
    a, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 3)).astype(np.float32)
    for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
        x, y = (a.T.copy() if ta else a), (b.T.copy() if tb else b)
        out = rt.zeros((5, 3), "float32")
        rt.matmul(rt.asarray(x), rt.asarray(y), out=out, ta=ta, tb=tb)
        np.testing.assert_allclose(rt.to_numpy(out), a @ b, rtol=1e-5, atol=1e-5)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    out = rt.zeros((2, 4, 4, 4), "float32")
    rt.conv2d(rt.asarray(x), rt.asarray(w), out=out, stride=1, pad=0)
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))     # (2, 3, 4, 4, 3, 3)
    want = np.einsum("nchwij,ocij->nohw", windows, w)
    np.testing.assert_allclose(rt.to_numpy(out), want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# starting

@needs_cxx
def test_the_backend_starts_with_cublas_when_it_loads(fake, start):
    rt = start("offered")
    device = rt._device
    assert device.cublas is not None and device._tiled is None and device.cublas_error is None
    assert fake.stack() and fake.stack()[-1] == device.context.context          # the primary context is current
    assert device.name == "Fake GPU 0"
    _matmul_and_conv(rt, np.random.default_rng(0))
    assert {"cublasSgemm_v2", "cublasSgemmStridedBatched", "cublasSetStream_v2"} <= set(fake.cublas_calls)
    assert not fake.cublas_library.errors
    assert not any("deepdsl_sgemm_tile" in c["source"] for c in fake.compiles)     # no GEMM kernel compiled
    handle = device._handle
    device.close()
    assert fake.cublas_library._handles.get(handle) is None           # the handle was destroyed


@needs_cxx
@pytest.mark.parametrize("cublas, reason", [("missing", "libcublas not found"),
                                            ("incomplete", "cublasSgemmStridedBatched"),
                                            ("failing", "cublasCreate failed")])
def test_the_backend_falls_back_to_the_tiled_sgemm(fake, start, cublas, reason):
    rt = start(cublas)
    device = rt._device
    assert device.cublas is None and device._handle is None and reason in device.cublas_error
    assert isinstance(device._tiled, cuda_device.GemmKernels)
    (compiled,) = fake.compiles                                      # gemm.cu, as pycuda is asked to build it
    assert compiled["no_extern_c"] and "deepdsl_sgemm_tile" in compiled["source"]
    _matmul_and_conv(rt, np.random.default_rng(1))
    assert "deepdsl_sgemm_tile" in fake.launches and "cublasSgemm_v2" not in fake.cublas_calls


# ----------------------------------------------------------------------------------------------------------------
# generated programs through Model("cuda")

PROGRAMS = [("lenet", "fatbin", "offered"), ("lenet", "source", "missing"),
            ("inception_mini", "source", "offered"), ("inception_mini", "refused fatbin", "offered")]


@needs_cxx
@pytest.mark.parametrize("name, kernels, cublas", PROGRAMS, ids=["-".join(p) for p in PROGRAMS])
def test_generated_program_through_pycuda_matches_the_cpu(name, kernels, cublas, fake, start, tmp_path,
                                                          tmp_path_factory, capfd):
    """Two training steps and a test step of a generated program through `deepdsl_runtime.program.Model("cuda")`
    on `runtime/cuda/pycuda_device.py`'s `PycudaDevice` over the fake, in every memory mode: the CPU's losses, accuracy and
    parameters, and the planned peaks measured exactly. The kernels load from the program's fat binary, from its
    source through `SourceModule`, or from source after the driver refused the fat binary (one stderr line)."""
    _, cached, cached_path = _program(name, None, 2, tmp_path_factory)
    path = tmp_path / cached_path.name                      # a private copy: the fat binary goes next to it
    path.write_text(cached_path.read_text())
    cu_text = cached_path.with_suffix(".cu").read_text()
    path.with_suffix(".cu").write_text(cu_text)
    fatbin = path.with_name(f"{path.stem}.{kernel_sources_digest(cu_text, KERNELS)}.fatbin")
    if kernels != "source":
        fatbin.write_bytes(b"\x50\xed\x55\xba fat binary of " + path.name.encode())
    if kernels == "fatbin":
        fake.accept_binary(fatbin.read_bytes(), cu_text)
    module = import_program(path)
    cls = model_class(module)
    rng = np.random.default_rng(7)
    data = [cls.random_batch(rng) for _ in range(2)]
    expected = _steps(cls("cpu", 0, "static"), data)

    rt = start(cublas)
    fake.set_order(2, seed=5)
    for mode in MODES:
        model = cls("cuda", 0, mode, True)
        assert model.rt is rt and model.mem.mode == mode
        check_steps_equal_the_cpu(model, data, expected)
        assert isinstance(model.mem.workspace_region, rt.DeviceArray)

    program_compiles = [c for c in fake.compiles if c["source"] == cu_text]
    stderr = capfd.readouterr().err
    if kernels == "fatbin":
        assert fake.loads.count("fatbin") == 1 and not program_compiles and "does not load" not in stderr
    else:
        assert "fatbin" not in fake.loads and len(program_compiles) == 1
        assert str(KERNELS) in program_compiles[0]["include_dirs"] and program_compiles[0]["no_extern_c"]
    if kernels == "refused fatbin":
        (line,) = [line for line in stderr.splitlines() if "does not load" in line]
        assert fatbin.name in line and "device kernel image is invalid" in line and path.with_suffix(".cu").name in line
    assert rt._device.program_module is not None
    assert fake.async_copies > 0                               # batches went through pinned staging
    assert ("cublasSgemmStridedBatched" in fake.cublas_calls) == (cublas == "offered")
    assert not fake.cublas_library.errors


# ----------------------------------------------------------------------------------------------------------------
# the tiled GEMM on CudaDevice

@needs_cxx
def test_tile_store_poll_keeps_waiting_events(fake, monkeypatch):
    """The tiled GEMM on a device whose events complete later than they are polled (every GPU): an action whose
    event has not completed stays pending with its event (`TileStore.poll`), and the product is right."""
    from deepdsl_runtime.gemm.cuda_device import CudaDevice

    monkeypatch.setattr(cuda_device, "Cublas", _offer(fake.cublas_library))
    devices = [CudaDevice(0, memory_bytes=1 << 20)]
    a = np.ones((40, 40))
    out = np.zeros((40, 40))
    try:
        TiledGemm(devices, tile=8, streams=2).gemm("N", "N", 1.0, a, a, 0.0, out)
    finally:
        devices[0].release()
    np.testing.assert_array_equal(out, np.full((40, 40), 40.0))


def _reference(transa, transb, alpha, a, b, beta, c):
    op_a = (a.T if transa == "T" else a).astype(np.float64)
    op_b = (b.T if transb == "T" else b).astype(np.float64)
    return alpha * (op_a @ op_b) + (beta * c.astype(np.float64) if beta != 0 else 0)


@needs_cxx
@pytest.mark.parametrize("use_cublas", [True, False], ids=["cublas", "tiled kernel"])
def test_tiled_gemm_on_cuda_devices_matches_numpy(fake, monkeypatch, use_cublas):
    from deepdsl_runtime.gemm.cuda_device import CudaDevice

    monkeypatch.setattr(cuda_device, "Cublas", _offer(fake.cublas_library))
    rng = np.random.default_rng(3)
    tile = 16
    for dtype in (np.float32, np.float64):
        devices = [CudaDevice(0, use_cublas=use_cublas), CudaDevice(0, memory_bytes=1 << 20, use_cublas=use_cublas)]
        assert devices[0].pool.capacity > devices[1].pool.capacity == 1 << 20   # 90 % of free less 256 MiB
        for m, n, k in [(37, 29, 41), (1, 50, 3), (33, 1, 17)]:
            for transa in "NT":
                for transb in "NT":
                    a = rng.uniform(-1, 1, (k, m) if transa == "T" else (m, k)).astype(dtype)
                    b = rng.uniform(-1, 1, (n, k) if transb == "T" else (k, n)).astype(dtype)
                    for alpha, beta in [(1.5, 0.0), (-1.0, 0.5)]:
                        c = rng.uniform(-1, 1, (m, n)).astype(dtype)
                        if beta == 0:
                            c[...] = np.nan                   # must not be read
                        want = _reference(transa, transb, alpha, a, b, beta, c)
                        gemm = TiledGemm(devices, tile=tile, streams=2)
                        gemm.gemm(transa, transb, alpha, a, b, beta, c)
                        tolerance = (3e-5 if dtype == np.float32 else 1e-12) * k
                        np.testing.assert_allclose(c, want, rtol=tolerance, atol=tolerance)
                        for device in devices:
                            assert device.pool.bytes_in_use == 0
        for device in devices:
            assert device.use_cublas == use_cublas
            device.release()
        assert not fake._pinned       # the staging let go by release, in the context (not by some later collection)
    assert fake.stack() == []                        # every worker thread popped what it pushed
    if use_cublas:
        assert "cublasDgemm_v2" in fake.cublas_calls and "deepdsl_sgemm_tile" not in fake.launches
    else:
        assert {"deepdsl_sgemm_tile", "deepdsl_dgemm_tile"} <= set(fake.launches) and not fake.cublas_calls
    assert not fake.cublas_library.errors


@needs_cxx
def test_tiled_gemm_counters_on_cuda_devices_equal_the_cpu_devices(fake, monkeypatch):
    """Round robin moves the same tiles whatever the device; blasx keeps its invariants."""
    from deepdsl_runtime.gemm.cuda_device import CudaDevice

    monkeypatch.setattr(cuda_device, "Cublas", _offer(fake.cublas_library))
    rng = np.random.default_rng(4)
    m, n, k, tile = 45, 38, 27, 8
    a, b = rng.standard_normal((m, k)), rng.standard_normal((n, k))
    c = rng.standard_normal((m, n))
    memory = 40 * tile * tile * 8
    for policy in ("round_robin", "blasx"):
        runs = {}
        for kind in ("cpu", "cuda"):
            devices = ([CpuDevice(memory), CpuDevice(memory)] if kind == "cpu" else
                       [CudaDevice(0, memory_bytes=memory), CudaDevice(0, memory_bytes=memory)])
            gemm = TiledGemm(devices, tile=tile, streams=2, policy=policy)
            out = c.copy()
            gemm.gemm("N", "T", 0.5, a, b, 1.0, out)
            np.testing.assert_allclose(out, 0.5 * a @ b.T + c, rtol=1e-12, atol=1e-12)
            runs[kind] = gemm.stats
            if kind == "cuda":
                for device in devices:
                    device.release()
        cpu, gpu = runs["cpu"], runs["cuda"]
        mt, nt, kt = -(-m // tile), -(-n // tile), -(-k // tile)
        for s in (cpu, gpu):
            assert s.d2h_tiles == mt * nt and s.d2h_bytes == c.nbytes and sum(s.tasks_per_device) == mt * nt
            assert s.cache_hits + s.peer_hits + s.cache_misses == 2 * mt * nt * kt
        if policy == "round_robin":
            for counter in ("h2d_tiles", "h2d_bytes", "d2h_tiles", "d2h_bytes", "tasks_per_device", "cache_hits"):
                assert getattr(gpu, counter) == getattr(cpu, counter), counter
        assert gpu.peer_hits == gpu.d2d_bytes == 0           # two devices on one GPU are not peers


@needs_cxx
def test_cuda_devices_copy_tiles_between_peer_gpus(monkeypatch):
    """Two fake GPUs: peer access is enabled both ways; a tile copied in on one GPU (its own thread, as the tiled
    GEMM's workers) is copied to the other device to device after its copy has landed (the streams run lazily: a
    missing wait would copy stale bytes); a TiledGemm over both is right."""
    import threading

    from deepdsl_runtime.gemm.cuda_device import CudaDevice
    from deepdsl_runtime.gemm.tiles import prepare_problem

    fake = fake_pycuda.install(monkeypatch, devices=2)
    monkeypatch.setattr(cuda_device, "_driver", None)
    monkeypatch.setattr(cuda_device, "Cublas", _offer(fake.cublas_library))
    first, second = CudaDevice(0, memory_bytes=1 << 20), CudaDevice(1, memory_bytes=1 << 20)
    assert first.can_access_peer(second) and second.can_access_peer(first) and first.can_access_peer(second)
    other = CudaDevice(0, memory_bytes=1 << 20)                 # the same primary context: already enabled
    assert other.can_access_peer(second) and not other.can_access_peer(first)
    other.release()
    tile = np.arange(12.0).reshape(3, 4)
    problem = prepare_problem("N", "N", 1.0, tile, tile.T.copy(), 0.0, np.zeros((3, 3)), 4)[0]
    landed, copied, back, errors = {}, threading.Event(), np.zeros_like(tile), []

    def on_second():
        try:
            second.open(problem, 1)
            landed["event"] = second.copy_in(second.buffer(0, (3, 4)), tile, 0)
        except BaseException as err:   # noqa: BLE001 -- reported below
            errors.append(err)
        finally:
            landed.setdefault("event", None)
        copied.wait(10)
        second.close()

    def on_first():
        try:
            first.open(problem, 1)
            while "event" not in landed:
                pass
            source = first.buffer(0, (3, 4))
            first.copy_peer(source, second, second.buffer(0, (3, 4)), 0, after=landed["event"])
            first.synchronize(first.copy_out(back, source, 0))
            first.close()
        except BaseException as err:   # noqa: BLE001 -- reported below
            errors.append(err)
        finally:
            copied.set()

    threads = [threading.Thread(target=on_second), threading.Thread(target=on_first)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors, errors
    np.testing.assert_array_equal(back, tile)
    assert fake.async_copies >= 2
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((30, 20)), rng.standard_normal((20, 25))
    out = np.full((30, 25), np.nan)
    TiledGemm([first, second], tile=8, streams=2).gemm("N", "N", 1.0, a, b, 0.0, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-12, atol=1e-12)
    first.release()
    second.release()
    assert fake.stack() == [] and not fake.cublas_library.errors


# ----------------------------------------------------------------------------------------------------------------
# no GPU

@pytest.mark.parametrize("config, line", [
    ({"init_error": "NO_DEVICE"},
     "the CUDA driver does not start (cuInit failed: no CUDA-capable device is detected)"),
    ({"init_error": "SYSTEM_DRIVER_MISMATCH"}, "the CUDA driver does not start (cuInit failed: system has "
                                               "unsupported display driver / cuda driver combination)"),
    ({"devices": 0}, "no CUDA GPU found"),
    ({"context_error": "DEVICE_UNAVAILABLE"}, "the CUDA device cannot be set up (cuDevicePrimaryCtxRetain failed: "
                                              "CUDA-capable device(s) is/are busy or unavailable)"),
], ids=["no device", "driver mismatch", "zero devices", "busy"])
def test_without_a_usable_gpu_the_cuda_backend_is_one_line(monkeypatch, config, line):
    fake = fake_pycuda.install(monkeypatch, **config)
    monkeypatch.setattr(cuda_device, "_driver", None)
    monkeypatch.delitem(sys.modules, "deepdsl_runtime.cuda", raising=False)
    with pytest.raises(RunError) as error:
        backend("cuda")
    assert str(error.value) == f"CUDA backend not available: {line}"
    assert fake.stack() == [] and sys.modules["deepdsl_runtime.cuda"]._device is None


def test_a_pycuda_that_does_not_load_is_one_line(monkeypatch):
    fake_pycuda.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)          # `import pycuda.driver` raises ImportError
    monkeypatch.setattr(cuda_device, "_driver", None)
    monkeypatch.delitem(sys.modules, "deepdsl_runtime.cuda", raising=False)
    with pytest.raises(RunError, match=r"^CUDA backend not available: pycuda does not load \(.*pycuda.driver.*\)$"):
        backend("cuda")


# ----------------------------------------------------------------------------------------------------------------
# the fake refuses what pycuda and CUDA refuse

@needs_cxx
def test_the_fake_is_strict(fake):
    drv, compiler = sys.modules["pycuda.driver"], sys.modules["pycuda.compiler"]
    with pytest.raises(drv.LogicError, match="initialization error"):
        drv.Device.count()
    drv.init()
    with pytest.raises(drv.LogicError, match="no currently active context"):
        drv.mem_alloc(16)
    context = drv.Device(0).retain_primary_context()
    context.push()
    try:
        memory, stream = drv.mem_alloc(64), drv.Stream()
        with pytest.raises(TypeError):                              # Boost.Python converts Python ints only
            drv.mem_alloc(np.int64(64))
        with pytest.raises(TypeError):
            drv.memcpy_dtod_async(memory, memory, np.uint64(4), stream)
        with pytest.raises(drv.LogicError, match="not page-locked"):
            drv.memcpy_htod_async(memory, np.zeros(4, np.float32), stream)
        with pytest.raises(drv.LogicError, match="not in a live device allocation"):
            drv.memcpy_htod(int(memory) + 32, np.zeros(16, np.float32))
        with pytest.raises(drv.LogicError, match="null context"):
            drv.memcpy_peer_async(memory, memory, 4, stream=stream)
        module = compiler.SourceModule('#include "ops.cu"\n', no_extern_c=True, include_dirs=[str(KERNELS)])
        fill = module.get_function("deepdsl_fill_u32").prepare("IPI")
        with pytest.raises(drv.LogicError, match="named symbol not found"):
            module.get_function("deepdsl_no_such_kernel")
        with pytest.raises(TypeError):                              # the grid must be a tuple
            fill.prepared_async_call([1, 1], (256, 1, 1), stream, 16, int(memory), 7)
        with pytest.raises(drv.LaunchError, match="launch_bounds"):
            fill.prepared_async_call((1, 1), (512, 1, 1), stream, 16, int(memory), 7)
        with pytest.raises(drv.LogicError, match="not in a live device allocation"):
            fill.prepared_async_call((1, 1), (256, 1, 1), stream, 16, np.zeros(4).ctypes.data, 7)
        short = module.get_function("deepdsl_fill_u32").prepare("IP")
        short.prepared_async_call((1, 1), (256, 1, 1), stream, 16, int(memory))
        with pytest.raises(AssertionError, match="bytes of arguments"):    # the kernel takes one more parameter
            stream.synchronize()
        with pytest.raises(drv.CompileError, match="cannot open source file"):
            compiler.SourceModule('#include "ops.cu"\n', no_extern_c=True)            # no include directory
        with pytest.raises(drv.CompileError):                            # templates inside extern "C"
            compiler.SourceModule('#include "ops.cu"\n', include_dirs=[str(KERNELS)])

        # work runs when waited for: a kernel on one stream does not see a copy on another without an event
        pinned = drv.pagelocked_empty(16, np.uint32)
        pinned[:] = 5
        other = drv.Stream()
        drv.memcpy_htod_async(memory, pinned, other)
        fill.prepared_async_call((1, 1), (256, 1, 1), stream, 8, int(memory), 9)       # first 8 words := 9
        stream.synchronize()
        result = np.zeros(16, np.uint32)
        drv.memcpy_dtoh(result, memory)                 # the legacy stream: after every stream of the context
        assert result.tolist() == [5] * 16              # the copy ran last: the ordering was missing
        event = drv.Event(drv.event_flags.DISABLE_TIMING)
        drv.memcpy_htod_async(memory, pinned, other)
        event.record(other)
        assert not event.query()
        stream.wait_for_event(event)
        fill.prepared_async_call((1, 1), (256, 1, 1), stream, 8, int(memory), 9)
        drv.memcpy_dtoh(result, memory)
        assert result.tolist() == [9] * 8 + [5] * 8 and event.query()
    finally:
        drv.Context.pop()
    with pytest.raises(drv.LogicError, match="cannot pop"):
        drv.Context.pop()


# ----------------------------------------------------------------------------------------------------------------
# the GPU tests themselves, on the emulated GPU

@needs_cxx
def test_the_gpu_tests_pass_on_the_emulated_gpu():
    """tests/test_cuda_gpu.py run with `--fake-gpu` (its own pytest process: the fake pycuda is installed there for
    the whole process and the programs it starts): every op, training steps equal to the CPU's in every memory mode,
    LeNet learning the digits with `--device cuda` (95 % in 50 iterations, three processes), the fat binary load
    and the benchmark's worker for our program all pass; only the PyTorch side of the benchmark is skipped (no CUDA
    for PyTorch). Keeps the GPU tests runnable for the machines that have a GPU."""
    import subprocess

    from tests.support.program_helpers import ROOT

    if importlib.util.find_spec("pycuda") is not None:
        pytest.skip("a real pycuda is installed: run tests/test_cuda_gpu.py on the GPU instead")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--fake-gpu",
                           str(ROOT / "tests" / "test_cuda_gpu.py")], capture_output=True, text=True, cwd=ROOT,
                          timeout=1200)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "failed" not in summary and "error" not in summary and " passed" in summary, summary
    assert "1 skipped" in summary, summary            # the PyTorch side of the benchmark, and nothing else
