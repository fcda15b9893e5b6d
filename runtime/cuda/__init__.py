"""The CUDA backend of generated programs (`--device cuda`): every op on one NVIDIA GPU through pycuda.

The ops, with the same names and signatures as `deepdsl_runtime.cpu`, are in `deepdsl_runtime.cuda.ops` (written
over an abstract device, split by op family; an op runs on the device of its output); `start()` supplies the
process's GPU, a `PycudaDevice` (`deepdsl_runtime.cuda.pycuda_device`), on which this package's `asarray`, `zeros`
and `allocator` make arrays. Importing this package needs no pycuda and starts nothing;
`deepdsl_runtime.program.backend("cuda")` calls `start()`, which raises ImportError with a one-line reason when
pycuda is missing, the CUDA driver does not start or there is no GPU, and `backend` reports that line and exits.
The pycuda-free parts (`layout`, `driver`, `ops`) are what the compiler and the host emulator import.
"""
from __future__ import annotations

from pathlib import Path

from deepdsl_runtime.cuda import ops as _ops
from deepdsl_runtime.cuda.ops import *  # noqa: F401,F403  (the ops: this package is the backend)
from deepdsl_runtime.cuda.ops import __all__ as _ops_all

__all__ = [*_ops_all, "bind_program", "start", "synchronize"]

_device = None          # the PycudaDevice `start` made: the process's GPU, started once


def start(ordinal: int = 0):
    """Start GPU `ordinal` and run the ops on it (once: later calls return the same device). Raises ImportError with
    a one-line reason when there is no usable GPU."""
    global _device
    if _device is None:
        from deepdsl_runtime.cuda.pycuda_device import PycudaDevice, start_driver

        drv = start_driver()
        try:
            device = PycudaDevice(ordinal)
        except (drv.Error, OSError) as err:   # the GPU busy (exclusive compute mode), no memory, no nvcc
            raise ImportError(f"the CUDA device cannot be set up ({str(err).strip() or type(err).__name__})") \
                from None
        _device = device
    return _device


def asarray(array, dtype=None):
    """A copy of a host array on the GPU."""
    return _ops.asarray(array, dtype, device=start())


def zeros(shape, dtype):
    return _ops.zeros(shape, dtype, device=start())


def allocator(mode: str, plans: dict, check: bool = False):
    """The allocator of memory mode `mode` over GPU memory (`deepdsl_runtime.cuda.allocators`)."""
    return _ops.allocator(mode, plans, check, device=start())


def bind_program(program) -> None:
    """Run the kernels of a generated program (the path of its `.py`, or its module): the `.cu` beside it, from its
    fat binary when that is current. `deepdsl_runtime.program.Model` calls this when a model is made."""
    path = Path(program.__file__ if hasattr(program, "__file__") else program)
    cu = path.with_suffix(".cu")
    if not cu.exists():
        raise FileNotFoundError(f"{cu} is missing: the CUDA kernels of {path.name} (deepdsl compile writes it)")
    start().load_program(cu)


def synchronize() -> None:
    """Wait for all work issued so far (timing)."""
    start().synchronize()
