"""The timing loop the benchmarks share."""
from __future__ import annotations

import time


def timed_steps(step, warmup: int, steps: int) -> list[float]:
    """Run `step(i)` for i = 0 .. warmup + steps - 1 and return the seconds of each step after the first `warmup`."""
    for i in range(warmup):
        step(i)
    times = []
    for i in range(warmup, warmup + steps):
        began = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - began)
    return times
