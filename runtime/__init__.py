"""deepdsl_runtime: what generated deepdsl programs import."""
import os

# Idle worker threads sleep instead of spinning for long: OpenBLAS's threads otherwise spin for about 2^28 cycles
# (0.1 s) after every matrix product, and would keep a core busy while the compiled kernels work (LeNet at batch 64
# on 2 cores: 16.6 ms a step spinning, 13.9 ms sleeping); with the compiled kernels the products run on the kernels'
# OpenMP threads anyway (deepdsl_runtime.cpu.native), OpenBLAS's own on one. GNU OpenMP's threads spin 10000 times
# first (200-300 us here, benchmarks/omp_wake.c): a thread that finds the next pass in that time is not woken for it,
# which costs 16-50 us on a virtual machine, several hundred times a step (ResNet-50 at batch 8, 2 threads:
# 209.6 ms a step with 1000 spins, 202.5 with 10000; LeNet at batch 500: 30.0 and 29.7 ms). On a machine shared with
# busy processes spinning threads lose more: the threads follow the free cores there (deepdsl_runtime.cpu.cores).
# Values the user set win.
IDLE_THREADS_SLEEP = {"OPENBLAS_THREAD_TIMEOUT": "4", "OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10000"}


def idle_threads_sleep() -> None:
    """Set IDLE_THREADS_SLEEP in the environment where unset (GOMP_SPINCOUNT only where OMP_WAIT_POLICY is unset
    too: GNU OpenMP lets it override the policy a user chose). The libraries read it when they load: call this
    before importing numpy (which loads OpenBLAS) and loading compiled kernels (OpenMP)."""
    chosen = "OMP_WAIT_POLICY" in os.environ
    for key, value in IDLE_THREADS_SLEEP.items():
        if not (key == "GOMP_SPINCOUNT" and chosen):
            os.environ.setdefault(key, value)


def cache_directory() -> str:
    """deepdsl's directory in the user's cache, shared by every program (the generic compiled kernels, image
    indexes): $DEEPDSL_CACHE, else $XDG_CACHE_HOME/deepdsl, else ~/.cache/deepdsl; "" where there is no home
    directory to name it by. Not made here."""
    if os.environ.get("DEEPDSL_CACHE"):
        return os.environ["DEEPDSL_CACHE"]
    home = os.path.expanduser("~")
    base = os.environ.get("XDG_CACHE_HOME") or (os.path.join(home, ".cache") if home != "~" else "")
    return os.path.join(base, "deepdsl") if base else ""
