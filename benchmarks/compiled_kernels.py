"""A generated program with its compiled CPU kernels against the same program with numpy's, side by side.

    python benchmarks/compiled_kernels.py [NET[:BATCH] ...] [--threads 1 2] [--rounds 3] [--iters 20] [--markdown]

Each network (default lenet:64 and lenet:500) is compiled once with `deepdsl compile` (which builds the kernels'
library); then, for each thread count, the program runs with `--kernels compiled` and `--kernels numpy`
alternately, `--rounds` times each, every run a process of its own training `--iters` iterations on synthetic
data; the figure of a run is the program's own milliseconds per iteration (its report, which leaves out start-up).
Printed: the load average before and after, the median of each side and their ratio (numpy / compiled: above 1,
the compiled kernels are faster).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import load_average, print_row  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]


def _run(program: Path, kernels: str, threads: int, iters: int, tmp: Path) -> float:
    report = tmp / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, str(program), "--iters", str(iters), "--test-iters", "1", "--data",
                           "synthetic", "--fresh", "--params", str(tmp / "p.npz"), "--report-json", str(report),
                           "--kernels", kernels, "--threads", str(threads), "--quiet"],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{program.name} --kernels {kernels}: {done.stderr.strip()}")
    return json.loads(report.read_text())["seconds_per_iter"] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("networks", nargs="*", default=["lenet:64", "lenet:500"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    print(f"load average before: {load_average()}")
    print_row(("network", "batch", "threads", "compiled ms", "numpy ms", "numpy/compiled"), args.markdown, 14,
              header=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for spec in args.networks:
            name, _, batch = spec.partition(":")
            program = tmp / f"{name}{batch}.py"
            command = [sys.executable, "-m", "deepdsl", "compile", str(ROOT / "networks" / f"{name}.py"), "-o",
                       str(program)] + (["--batch", batch] if batch else [])
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0 or "not built" in done.stdout:
                raise SystemExit(f"compiling {name}: {done.stdout.strip()} {done.stderr.strip()}")
            for threads in args.threads:
                times = {"compiled": [], "numpy": []}
                for _ in range(args.rounds):
                    for kernels in times:
                        times[kernels].append(_run(program, kernels, threads, args.iters, tmp))
                ours, theirs = (statistics.median(times[k]) for k in ("compiled", "numpy"))
                print_row((name, batch or "-", str(threads), f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x"),
                          args.markdown, 14)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
