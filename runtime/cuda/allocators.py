"""The allocators of `deepdsl_runtime.memory` with device bytes: the CUDA backend's `allocator`."""
from __future__ import annotations

import numpy as np

from deepdsl_runtime import memory
from deepdsl_runtime.cuda.arrays import Device, DeviceArray, DevicePool, raw_bytes


class _OnDevice:
    """Mixin: the allocator's bytes are memory of its `device`, batches are uploaded (staged through pinned
    memory)."""

    def __init__(self, plans: dict, check: bool = False, *, device: Device):
        self.device = device            # before the allocator's own set-up, which may allocate already
        super().__init__(plans, check)

    def _bytes(self, nbytes: int) -> DeviceArray:
        return raw_bytes(self.device, nbytes)

    def _copy_in(self, buffer: DeviceArray, array: np.ndarray) -> None:
        host = np.ascontiguousarray(array, dtype=buffer.dtype)
        if host.shape != buffer.shape:
            raise ValueError(f"batch of shape {host.shape} for a buffer of shape {buffer.shape}")
        if host.nbytes:
            self.device.upload(buffer.ptr, host, staged=True)

    def _make_pool(self, capacity: int) -> DevicePool:
        """The runtime's first-fit pool over one chunk of the device: what `memory.Pooled` asks of `HostPool`."""
        return DevicePool(capacity, self.device.alloc, memory.ALIGNMENT, device=self.device)


def _device_class(base: type) -> type:
    return type(f"Device{base.__name__}", (_OnDevice, base), {"__doc__": f"{base.__doc__} (device memory)"})


_ALLOCATORS: dict[str, type] = {}


def allocator(mode: str, plans: dict, check: bool = False, *, device: Device) -> memory.Allocator:
    """The allocator of `mode` ("static", "pooled", "dynamic") over the memory of `device`: the same bookkeeping
    (and so the same measured peaks) as on the CPU (`deepdsl_runtime.memory`), the bytes on the GPU."""
    classes = {"static": memory.Static, "pooled": memory.Pooled, "dynamic": memory.Dynamic}
    if mode not in classes:
        raise ValueError(f"unknown memory mode '{mode}' (use {', '.join(memory.MODES)})")
    if mode not in _ALLOCATORS:
        _ALLOCATORS[mode] = _device_class(classes[mode])
    return _ALLOCATORS[mode](plans, check, device=device)
