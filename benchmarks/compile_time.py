"""Compile time of every network: DSL (loading the network file) to optimized SSA programs with memory plans.

    python benchmarks/compile_time.py [--repeat 5] [networks/lenet.py ...]

Each network is measured in a fresh Python process, so its first run is cold (sympy's and the compiler's caches
empty, as when a user compiles one network from the command line). A run is `deepdsl.load` + `deepdsl.compile`
at the size the network file declares; the table gives that first run and the median of `--repeat` runs (the
later runs find the caches warm) in wall-clock seconds, the median CPU seconds of the process (less sensitive to
other work on a shared machine), and the number of statements of the training step. Importing deepdsl (numpy,
sympy) is paid once per process, is not included, and is reported separately (median over the processes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the original DeepDSL compiler's figures (Scala; /work/shared/reference/README.md): whole program, seconds
REFERENCE_SECONDS = {"lenet": 0.4, "alexnet": 0.7, "overfeat": 0.5, "vgg16": 0.6, "googlenet": 2.2, "resnet50": 3.2}
TARGET_SECONDS = {"lenet": 0.2, "resnet50": 1.5}


def measure(path: str, repeat: int) -> dict:
    """In this process: import time, then `repeat` timed load + compile runs of one network."""
    start = time.perf_counter()
    import deepdsl
    import_seconds = time.perf_counter() - start
    from deepdsl.ssa import Let
    times, cpu_times, statements = [], [], 0
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        compiled = deepdsl.compile(deepdsl.load(path))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        statements = sum(1 for i in compiled.train.body if isinstance(i, Let))
        del compiled
    return {"import": import_seconds, "times": times, "cpu_times": cpu_times, "statements": statements}


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import sympy
    return (f"{model}, {os.cpu_count()} cores; Python {platform.python_version()}, "
            f"numpy {numpy.__version__}, sympy {sympy.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("networks", nargs="*", help="network files (default: every file in networks/)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--worker", metavar="NETWORK", help=argparse.SUPPRESS)   # one network, JSON to stdout
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(measure(args.worker, args.repeat)))
        return

    paths = [Path(p) for p in args.networks] or sorted((ROOT / "networks").glob("*.py"))
    load = f" (load average {os.getloadavg()[0]:.2f})" if hasattr(os, "getloadavg") else ""
    print(machine() + load)
    print(f"{'network':<16}{'statements':>11}{'first s':>9}{'median s':>10}{'median CPU s':>14}{'DeepDSL s':>11}"
          f"{'target s':>10}")
    imports = []
    for path in paths:
        out = subprocess.run([sys.executable, __file__, "--worker", str(path), "--repeat", str(args.repeat)],
                             capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        imports.append(result["import"])
        times, name = result["times"], path.stem
        ref, target = REFERENCE_SECONDS.get(name), TARGET_SECONDS.get(name)
        print(f"{name:<16}{result['statements']:>11}{times[0]:>9.3f}{statistics.median(times):>10.3f}"
              f"{statistics.median(result['cpu_times']):>14.3f}"
              f"{(f'{ref:.1f}' if ref else '-'):>11}{(f'{target:.1f}' if target else '-'):>10}", flush=True)
    print(f"import deepdsl: {statistics.median(imports):.2f} s (once per process, not included above)")


if __name__ == "__main__":
    main()
