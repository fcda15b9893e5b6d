"""Compile time of every network: DSL (loading the network file) to optimized SSA programs.

    python benchmarks/compile_time.py [--repeat 5] [networks/lenet.py ...]

Reports the first (cold: sympy's caches empty) and the median over `--repeat` runs of load + compile, in a fresh hash-cons cache state each run (the module is
re-executed, so graph construction and all passes are timed), plus the number of training-step statements.
Python and sympy import time is excluded (it is paid once per process) and reported separately.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REFERENCE_SECONDS = {"lenet": 0.4, "alexnet": 0.7, "overfeat": 0.5, "vgg16": 0.6, "googlenet": 2.2, "resnet50": 3.2}
TARGET_SECONDS = {"lenet": 0.2, "resnet50": 1.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("networks", nargs="*", help="network files (default: every file in networks/)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    start = time.perf_counter()
    import deepdsl  # noqa: F401  (timed: import of the compiler, numpy, sympy, networkx)
    import_seconds = time.perf_counter() - start
    from deepdsl import compile as compile_loop, load

    paths = [Path(p) for p in args.networks] or sorted((ROOT / "networks").glob("*.py"))
    print(f"import deepdsl: {import_seconds:.2f} s (once per process, not included below)")
    print(f"{'network':<12}{'statements':>11}{'first s':>9}{'median s':>10}{'DeepDSL s':>11}{'target s':>10}")
    for path in paths:
        times, statements = [], 0
        for _ in range(args.repeat):
            gc.collect()
            t0 = time.perf_counter()
            compiled = compile_loop(load(str(path)))
            times.append(time.perf_counter() - t0)
            statements = len(compiled.train.body)
            del compiled
        name = path.stem
        ref = REFERENCE_SECONDS.get(name)
        target = TARGET_SECONDS.get(name)
        print(f"{name:<12}{statements:>11}{times[0]:>9.3f}{statistics.median(times):>10.3f}"
              f"{(f'{ref:.1f}' if ref else '-'):>11}{(f'{target:.1f}' if target else '-'):>10}")


if __name__ == "__main__":
    main()
