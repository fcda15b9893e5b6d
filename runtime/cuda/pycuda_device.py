"""The pycuda device behind the CUDA ops: `PycudaDevice`, one GPU's context, streams, cuBLAS (or our tiled SGEMM),
kernel modules and pinned staging, built on the pycuda layer (`deepdsl_runtime.cuda.driver`).

Kernels: the generic ones are `kernels/ops.cu`; each generated program has its elementwise kernels in
`<program>.cu` next to it, which includes ops.cu, so one module holds everything a program runs. A program binds
its module when its model is made (`load_program`): the fat binary `deepdsl compile` built with nvcc
(`<program>.<hash>.fatbin`, SASS for sm_80 and sm_90 plus PTX) when one of the current sources exists, else the
`.cu` compiled now by pycuda (`SourceModule`, cached on disk by pycuda). Ops called outside a program use ops.cu
alone, compiled the same way.

Streams: all work runs in order on one compute stream; a batch is copied from pinned memory on a second stream
that first waits for the work already issued (its buffer may be memory that work still reads), and the compute
stream waits for the copy, so the host's gathering of the next input and the copy overlap the kernels issued
before them. `download` of a scalar (the loss) synchronizes.
"""
from __future__ import annotations

import atexit
import sys
import weakref
from pathlib import Path

import numpy as np

from deepdsl_runtime.cuda import driver as cuda_device
from deepdsl_runtime.cuda.layout import kernel_sources_digest

__all__ = ["KERNELS", "PycudaDevice", "start_driver"]

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def start_driver():
    """The pycuda driver with at least one GPU; ImportError with a one-line reason otherwise."""
    import importlib.util

    if importlib.util.find_spec("pycuda") is None:
        raise ImportError("pycuda is not installed (pip install 'deepdsl[cuda]')")
    try:
        drv = cuda_device.driver()
    except ImportError as err:          # pycuda without a CUDA driver library, or built for another CUDA
        cause = err.__cause__ or err
        raise ImportError(f"pycuda does not load ({str(cause).strip() or type(cause).__name__})") from None
    except Exception as err:            # pycuda's driver errors: no driver, no device, ...
        raise ImportError(f"the CUDA driver does not start ({str(err).strip() or type(err).__name__})") from None
    try:
        count = drv.Device.count()
    except Exception as err:
        raise ImportError(f"the CUDA driver does not start ({str(err).strip() or type(err).__name__})") from None
    if count == 0:
        raise ImportError("no CUDA GPU found")
    return drv



class PycudaDevice:
    """GPU `ordinal` behind the ops: its primary context made current for the process, a compute and a copy stream,
    cuBLAS (or our tiled SGEMM), the kernel modules and pinned staging for batches."""

    def __init__(self, ordinal: int = 0, use_cublas: bool = True):
        self._drv = _drv = cuda_device.driver()
        self.context = cuda_device.CudaContext(ordinal)
        self.context.push()
        self.stream = None
        self.cublas = self._handle = self._tiled = None
        self.cublas_error = None                       # why cuBLAS is not used, when it is not
        try:
            self.stream = _drv.Stream()
            self.copy_stream = _drv.Stream()
            self.name = self.context.name
            self._functions: dict[tuple[int, str, str], object] = {}
            self._modules: dict[str, object] = {}          # source digest -> loaded module
            self._by_program: dict[str, object] = {}       # a program's .cu path -> its module
            self._ops_module = None
            self.program_module = None
            self._staging = None
            self._scalar = _drv.pagelocked_empty(16, np.uint8)
            if use_cublas:
                try:
                    self.cublas, self._handle = cuda_device.open_cublas()
                except cuda_device.CUBLAS_UNUSABLE as err:      # our tiled SGEMM instead
                    self.cublas_error = str(err).strip() or type(err).__name__
            if self.cublas is None:
                self._tiled = cuda_device.GemmKernels()
        except BaseException:
            self.close()         # pycuda aborts at exit when a pushed context is left on the stack
            raise
        atexit.register(_close_at_exit, weakref.ref(self))

    def close(self) -> None:
        """Wait for the work issued, release the cuBLAS handle and pop the context (idempotent; at exit)."""
        if self.context is None:
            return
        try:
            if self.stream is not None:
                self.stream.synchronize()
            if self._handle is not None:
                self.cublas.destroy_handle(self._handle)
                self._handle = None
        finally:
            self.context.pop()
            self.context = None

    # -- kernels -----------------------------------------------------------------------------------------------
    def _compile(self, source: str):
        from pycuda.compiler import SourceModule

        return SourceModule(source, no_extern_c=True, include_dirs=[str(KERNELS)], options=["-O3"])

    def ops_module(self):
        """The module the generic kernels come from: the bound program's, else ops.cu alone."""
        if self.program_module is not None:
            return self.program_module
        if self._ops_module is None:
            self._ops_module = self._compile('#include "ops.cu"\n')
        return self._ops_module

    def load_program(self, cu_path: Path):
        """The module of the program whose `.cu` is `cu_path`, which then also serves the generic kernels: its
        current fat binary, else the source (a module already loaded for the same sources is reused)."""
        source = cu_path.read_text()
        digest = kernel_sources_digest(source, KERNELS)
        module = self._modules.get(digest)
        if module is None:
            fatbin = cu_path.with_name(f"{cu_path.stem}.{digest}.fatbin")
            if fatbin.exists():
                try:
                    module = self._drv.module_from_buffer(fatbin.read_bytes())
                except Exception as err:     # e.g. built by an nvcc newer than this driver: compile here instead
                    print(f"deepdsl: {fatbin.name} does not load ({str(err).strip()}); compiling {cu_path.name}",
                          file=sys.stderr)
            if module is None:
                module = self._compile(source)
            self._modules[digest] = module   # kept: prepared functions are cached by module identity
        self._by_program[str(cu_path)] = module
        self.program_module = module
        return module

    def _function(self, module, name: str, fmt: str):
        key = (id(module), name, fmt)
        fn = self._functions.get(key)
        if fn is None:
            fn = module.get_function(name)
            fn.prepare(fmt)
            self._functions[key] = fn
        return fn

    def launch(self, kernel, fmt, grid, block, args, program=None):
        if program is None:
            module = self.ops_module()
        else:                   # an elementwise kernel: from the module of the program that defines its function
            cu = str(Path(program.__globals__["__file__"]).with_suffix(".cu"))
            module = self._by_program.get(cu) or self.load_program(Path(cu))
        self._function(module, kernel, fmt).prepared_async_call(grid, block, self.stream, *args)

    # -- GEMM ------------------------------------------------------------------------------------------------
    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        if self.cublas is not None:
            self.cublas.gemm(self._handle, self.stream.handle, np.float32, transa, transb, m, n, k, alpha, a, lda,
                             b, ldb, beta, c, ldc)
        else:
            self._tiled.gemm(self.stream, np.float32, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def gemm_batched(self, transa, transb, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c, batch):
        if self.cublas is not None:
            self.cublas.gemm_strided_batched(self._handle, self.stream.handle, transa, transb, m, n, k, a, lda,
                                             stride_a, b, ldb, stride_b, c, ldc, stride_c, batch)
            return
        for i in range(batch):
            self._tiled.gemm(self.stream, np.float32, transa, transb, m, n, k, 1.0, a + 4 * i * stride_a, lda,
                             b + 4 * i * stride_b, ldb, 0.0, c + 4 * i * stride_c, ldc)

    # -- memory --------------------------------------------------------------------------------------------------
    def alloc(self, nbytes):
        allocation = self._drv.mem_alloc(nbytes)
        return int(allocation), allocation

    def copy(self, dst, src, nbytes):
        self._drv.memcpy_dtod_async(dst, src, nbytes, self.stream)

    def upload(self, dst, array, staged=False):
        if not staged:
            self.stream.synchronize()       # the memory may still be read by work in flight
            self._drv.memcpy_htod(dst, array)
            return
        if self._staging is None or self._staging.nbytes < array.nbytes:
            if self._staging is not None:
                self._staging.finish_all()
            self._staging = cuda_device.PinnedStaging(1, 2, max(array.nbytes, 1 << 20))
        slot, pinned = self._staging.take(0, array.shape, array.dtype)
        np.copyto(pinned, array)
        issued = self.context.event()
        issued.record(self.stream)
        self.copy_stream.wait_for_event(issued)
        self._drv.memcpy_htod_async(dst, pinned, self.copy_stream)
        landed = self.context.event()
        landed.record(self.copy_stream)
        self._staging.busy(slot, landed)
        self.stream.wait_for_event(landed)

    def download(self, array, src):
        if array.nbytes <= self._scalar.nbytes:
            self._drv.memcpy_dtoh_async(self._scalar[:array.nbytes], src, self.stream)
            self.stream.synchronize()
            array.reshape(-1).view(np.uint8)[:] = self._scalar[:array.nbytes]
            return
        self.stream.synchronize()
        self._drv.memcpy_dtoh(array, src)

    def synchronize(self) -> None:
        self.stream.synchronize()


def _close_at_exit(device: "weakref.ref[PycudaDevice]") -> None:
    """Close a device still alive at exit: pycuda aborts the process when a pushed context is left on its stack."""
    if (alive := device()) is not None:
        alive.close()
