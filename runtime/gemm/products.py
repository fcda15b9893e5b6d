"""The training runtime's matrix products through the tiled multi-device GEMM.

The CPU backend's matmul and convolutions compute every matrix product with a `gemm(a, b, *, out)` function
(numpy's `np.matmul` by default; `deepdsl_runtime.cpu.with_gemm` binds another). `TiledProducts` is such a function
running each product on a `TiledGemm` (`deepdsl_runtime.gemm`): `out = a @ b` is `C = 1 * A B + 0 * C` with the
operands' layouts passed through (a transposed view is a "T" operand, no copy). Batched products (3-D operands, as
numpy's matmul broadcasts them: the per-sample products of large convolution planes) are one tiled GEMM per
matrix. Every call's traffic is added up in `totals()`, which the generated program's report shows as `gemm`.

A generated program builds one from its command line (`--gemm-devices`, `--gemm-device-memory`, `--gemm-tile`;
see `deepdsl_runtime.program`).
"""
from __future__ import annotations

import numpy as np

from deepdsl_runtime.gemm import CpuDevice, TiledGemm

__all__ = ["TiledProducts", "cpu_devices"]


def cpu_devices(count: int, memory_bytes: int) -> list[CpuDevice]:
    """`count` simulated devices of `memory_bytes` each, all peers of one another."""
    return [CpuDevice(memory_bytes, name=f"gemm{i}") for i in range(count)]


class TiledProducts:
    """`gemm(a, b, *, out)`: out = a @ b on a TiledGemm, float32, 2-D or batched over leading axes."""

    def __init__(self, tiled: TiledGemm):
        self.tiled = tiled
        n = len(tiled.devices)
        self.calls = 0
        self.flops = 0
        self.h2d_bytes = self.d2h_bytes = self.d2d_bytes = 0
        self.cache_hits = self.peer_hits = self.cache_misses = self.evictions = self.steals = 0
        self.tasks_per_device = [0] * n
        self.peak_device_bytes = [0] * n
        self.seconds = 0.0

    def __call__(self, a: np.ndarray, b: np.ndarray, *, out: np.ndarray) -> None:
        if a.ndim == 2 and b.ndim == 2:
            self._product(a, b, out)
            return
        lead = out.shape[:-2]
        a = np.broadcast_to(a, lead + a.shape[-2:]) if a.ndim == 2 else a
        b = np.broadcast_to(b, lead + b.shape[-2:]) if b.ndim == 2 else b
        for index in np.ndindex(*lead):
            self._product(a[index], b[index], out[index])

    def _product(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        self.tiled.gemm("N", "N", 1.0, a, b, 0.0, out)
        s = self.tiled.stats
        self.calls += 1
        self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        self.h2d_bytes += s.h2d_bytes
        self.d2h_bytes += s.d2h_bytes
        self.d2d_bytes += s.d2d_bytes
        self.cache_hits += s.cache_hits
        self.peer_hits += s.peer_hits
        self.cache_misses += s.cache_misses
        self.evictions += s.evictions
        self.steals += s.steals
        for d, tasks in enumerate(s.tasks_per_device):
            self.tasks_per_device[d] += tasks
        for d, peak in enumerate(s.peak_device_bytes):
            self.peak_device_bytes[d] = max(self.peak_device_bytes[d], peak)
        self.seconds += s.seconds

    def totals(self) -> dict:
        """Everything the products did so far: calls, floating-point operations, bytes moved host to device,
        device to host and device to device, tile cache hits (own and peer) and misses, evictions, output tiles
        computed per device, steals, each device's peak memory, seconds in the multi-device part."""
        return {"devices": len(self.tiled.devices), "device_memory_bytes": [d.pool.capacity for d in self.tiled.devices],
                "tile": self.tiled.tile, "policy": self.tiled.policy, "calls": self.calls, "flops": self.flops,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "d2d_bytes": self.d2d_bytes,
                "bytes_moved": self.h2d_bytes + self.d2h_bytes + self.d2d_bytes, "cache_hits": self.cache_hits,
                "peer_hits": self.peer_hits, "cache_misses": self.cache_misses, "evictions": self.evictions,
                "tasks_per_device": list(self.tasks_per_device), "steals": self.steals,
                "peak_device_bytes": list(self.peak_device_bytes), "seconds": self.seconds}
