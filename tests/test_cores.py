"""Threads that follow the cores other processes leave free (`deepdsl_runtime.cpu.cores.FreeCores`), on a clock
and a load given by the test; the program's kernels and products set to them between steps where the run did not
ask for a thread count."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from deepdsl_runtime.cpu import cores, native
from deepdsl_runtime.cpu.cores import FreeCores
from tests.support.program_helpers import compile_program, import_program, model_class


class Machine:
    """Two cores, a clock and their busy seconds, which the test advances: `run(seconds, ours, others)`."""

    def __init__(self):
        self.now = self.busy = self.mine = 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.now += seconds
        self.mine += ours * seconds
        self.busy += (ours + others) * seconds

    def cores(self, most: int = 2) -> FreeCores:
        return FreeCores(most, cpus={0, 1}, busy=lambda cpus: self.busy, clock=lambda: self.now,
                         ours=lambda: self.mine)


def _steps(machine, free, seconds, ours, others, step=0.1):
    """`update()` after each step of `step` seconds: the counts it returned."""
    said = []
    for _ in range(round(seconds / step)):
        machine.run(step, ours, others)
        threads = free.update()
        if threads is not None:
            said.append(threads)
    return said


def test_threads_follow_the_cores_other_processes_leave():
    machine = Machine()
    free = machine.cores()
    assert _steps(machine, free, 3.0, ours=2.0, others=0.0) == []           # our own work is not a reason
    assert _steps(machine, free, 3.0, ours=1.0, others=1.0) == [1]          # one busy process: one thread
    assert free.threads == 1 and free.others == pytest.approx(1.0)
    assert _steps(machine, free, 3.0, ours=1.0, others=0.9) == []
    assert _steps(machine, free, 3.0, ours=1.0, others=0.2) == [2]          # gone: both again
    assert _steps(machine, free, 3.0, ours=0.5, others=1.6) == [1]          # never fewer than one


def test_the_load_is_read_once_a_window():
    machine = Machine()
    reads = []
    free = FreeCores(2, cpus={0, 1}, busy=lambda cpus: reads.append(machine.now) or machine.busy,
                     clock=lambda: machine.now, ours=lambda: machine.mine)
    _steps(machine, free, 3.0, ours=1.0, others=0.0, step=0.01)        # 300 short steps
    assert len(reads) <= 3.0 / cores.WINDOW + 1, len(reads)


def test_one_window_of_load_changes_nothing():
    machine = Machine()
    free = machine.cores()
    said = _steps(machine, free, cores.WINDOW * 1.5, ours=1.0, others=1.0)  # one window's decision, then quiet
    said += _steps(machine, free, 3.0, ours=2.0, others=0.0)
    assert said == [] and free.threads == 2


def test_no_more_threads_than_asked_and_none_to_follow():
    machine = Machine()
    assert _steps(machine, machine.cores(most=1), 3.0, ours=1.0, others=1.0) == []
    many = FreeCores(2, cpus={0, 1, 2, 3}, busy=lambda cpus: machine.busy, clock=lambda: machine.now,
                     ours=lambda: machine.mine)
    assert _steps(machine, many, 3.0, ours=2.0, others=1.0) == []            # three cores free, two asked for
    unreadable = FreeCores(2, cpus={0, 1}, busy=lambda cpus: None, clock=lambda: machine.now, ours=lambda: 0.0)
    assert _steps(machine, unreadable, 3.0, ours=1.0, others=1.0) == [] and unreadable.threads == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_busy_seconds_of_this_machine():
    first = cores.busy_seconds(frozenset(range(1024)))
    sum(i * i for i in range(300_000))
    second = cores.busy_seconds(frozenset(range(1024)))
    assert first is not None and 0 < first <= second
    assert cores.busy_seconds(frozenset()) == 0


def test_a_program_sets_its_threads_to_the_free_cores(tmp_path, monkeypatch):
    """A model without a thread count asked for follows FreeCores: the compiled kernels' threads (or, with numpy's
    kernels, the BLAS's) change between steps, its products' bits do not; one with --threads keeps them."""
    from deepdsl.codegen.native import build_library

    _, path = compile_program("mlp", tmp_path, batch=2)
    built, why = build_library(path.with_suffix(".c"))
    assert built is not None, why
    cls = model_class(import_program(path))
    asked = cls("cpu", 0, kernels="compiled", threads=2)
    assert asked.free_cores is None and asked.follow_free_cores() is None
    model = cls("cpu", 0, kernels="compiled")
    machine = Machine()
    model.free_cores = machine.cores()
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((70, 300)).astype(np.float32), rng.standard_normal((300, 530)).astype(np.float32)
    products = [model.rt.native.gemm(a, b, np.empty((70, 530), np.float32))]
    blas = []
    monkeypatch.setattr(native, "set_blas_threads", blas.append)
    said = []
    for _ in range(30):
        machine.run(0.1, 1.0, 1.0)
        said.append(model.follow_free_cores())
    assert [t for t in said if t is not None] == [1]
    assert model.rt.native.threads == 1 and blas[0] == 1
    products.append(model.rt.native.gemm(a, b, np.empty((70, 530), np.float32)))
    np.testing.assert_array_equal(products[1], products[0])     # the bits do not follow the load
    model.rt.native.set_threads(native.threads_available())
