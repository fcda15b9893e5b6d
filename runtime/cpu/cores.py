"""The cores other processes leave free: how many threads a training run should use on a shared machine.

The kernels' threads and the matrix products' (one team, `deepdsl_runtime.cpu.native`) share each pass statically
and wait for one another at its end: when another process keeps one of the cores busy, every pass waits for the
thread that shares a core with it, and a step takes longer on two threads than on one (ResNet-50 at batch 8 on two
cores beside one busy process: 695 ms an iteration on two threads, 345 on one; docs/performance.md). `FreeCores`
follows the load of the cores this process may run on (`/proc/stat`, less the CPU time of this process): between
steps, a window of `WINDOW` seconds at a time, the thread count becomes the cores the other processes left free
(rounded, at least one, at most the threads asked for) once two windows in a row agree on it. Where /proc/stat
cannot be read it keeps the threads asked for. (No result changes with the threads: products are cut into parts fixed
by their shapes, `contract.product_cuts`, and every other kernel sums each output on one thread in a fixed order.)
"""
from __future__ import annotations

import math
import os
import time

__all__ = ["FreeCores", "busy_seconds"]

WINDOW = 0.5        # seconds of load a decision reads


def busy_seconds(cpus: frozenset[int]) -> float | None:
    """The seconds the processors `cpus` have run anything since boot (every state of /proc/stat but idle and
    waiting for I/O; time the hypervisor took, steal, counts as busy), or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            lines = stat.read().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields[:8]]         # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy / tick


class FreeCores:
    """The threads a run should use now, at most `most`: `update()` between steps returns a new count when the
    cores others leave free have changed (else None)."""

    def __init__(self, most: int, cpus=None, busy=busy_seconds, clock=time.monotonic, ours=time.process_time):
        self.most = self.threads = most
        self.cpus = frozenset(cpus if cpus is not None else _affinity())
        self._busy, self._clock, self._ours = busy, clock, ours
        self._start = self._sample()
        self._pending: int | None = None
        self.others = 0.0          # the cores other processes kept busy in the last window

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._busy(self.cpus)
        return None if busy is None else (self._clock(), busy, self._ours())

    def update(self) -> int | None:
        if self._start is None or self.most <= 1 or self._clock() - self._start[0] < WINDOW:
            return None                      # (the clock only: reading /proc/stat costs tens of microseconds)
        now = self._sample()
        if now is None:
            return None
        wall = now[0] - self._start[0]
        others = max(0.0, (now[1] - self._start[1]) - (now[2] - self._start[2])) / wall
        self._start, self.others = now, others
        free = len(self.cpus) - others
        wanted = max(1, min(self.most, math.floor(free + 0.5)))
        if wanted == self.threads:
            self._pending = None
            return None
        if wanted != self._pending:          # one window says so: wait for the next
            self._pending = wanted
            return None
        self._pending, self.threads = None, wanted
        return wanted


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))
