"""deepdsl_runtime: what generated deepdsl programs import."""
import os

# Idle worker threads sleep almost at once instead of spinning: OpenBLAS's threads otherwise spin for about 2^28
# cycles (0.1 s) after every matrix product, and OpenMP's for a while after every compiled kernel, so each pool would
# keep the cores busy while the other works (LeNet at batch 64 on 2 cores: 16.6 ms a step spinning, 13.9 ms
# sleeping), and a machine shared with other processes would lose them too. GNU OpenMP's threads spin 1000 times
# first (microseconds): a thread that finds the next kernel or the end of a barrier in that time is not woken by the
# kernel (LeNet at batch 64, 2 threads: 6.7 ms a step sleeping at once, 5.7 ms with the short spin; batch 500:
# 43.9 and 41.2 ms). Values the user set win.
IDLE_THREADS_SLEEP = {"OPENBLAS_THREAD_TIMEOUT": "4", "OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "1000"}


def idle_threads_sleep() -> None:
    """Set IDLE_THREADS_SLEEP in the environment where unset (GOMP_SPINCOUNT only where OMP_WAIT_POLICY is unset
    too: GNU OpenMP lets it override the policy a user chose). The libraries read it when they load: call this
    before importing numpy (which loads OpenBLAS) and loading compiled kernels (OpenMP)."""
    chosen = "OMP_WAIT_POLICY" in os.environ
    for key, value in IDLE_THREADS_SLEEP.items():
        if not (key == "GOMP_SPINCOUNT" and chosen):
            os.environ.setdefault(key, value)
