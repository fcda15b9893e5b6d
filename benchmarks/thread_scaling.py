"""A generated program's training step on two threads against one, beside the most a second thread gives this
machine at the same moment (benchmarks/two_threads_ceiling.c): the steps' speed-up, the ceiling's, and their ratio.

    python benchmarks/thread_scaling.py NET[:BATCH[:IMAGE]] ... [--rounds 8] [--steps 5] [--no-replay] [--markdown]

On a shared virtual machine a second core gives work that shares nothing between 1.5x and 1.9x from one minute to
the next (its host's other tenants), so a step's speed-up alone says little about the step. Here each network is
compiled once (`deepdsl compile`) and two models of its program train on one synthetic batch, one on one thread
and one on two, each through `TrainSteps` as the program's command trains (replayed from the third step; each
keeps its thread count, so neither records again; `--no-replay`: every step by its Python). The ceiling is
benchmarks/two_threads_ceiling.c, built once (gcc -O2 -march=native -fopenmp). Each round runs the ceiling (3
alternations of its three kinds of work: multiply-adds in registers, passes over arrays in a core's cache and in
memory), then `--steps` steps of each model, the one that goes first alternating. Printed per network: the medians
over rounds of each model's milliseconds a step, the median of the rounds' speed-ups, the medians of the ceiling's
speed-ups, and the step's speed-up as a share of the largest of the ceiling's (the rounds' own ratios, median).
The processor, its vector extension and the load average are printed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from op_profile import _compile, _model, _set_threads  # noqa: E402  (benchmarks/ is on a script's path)
from timing import load_average, print_row, processor, vector_isa  # noqa: E402

HERE = Path(__file__).resolve().parent
KINDS = ("multiply-adds", "cache", "memory")


def build_ceiling(directory: Path) -> Path:
    """benchmarks/two_threads_ceiling.c built into `directory`."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise SystemExit("thread_scaling: needs gcc (or cc) to build benchmarks/two_threads_ceiling.c")
    binary = directory / "two_threads_ceiling"
    done = subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(HERE / "two_threads_ceiling.c"), "-o",
                           str(binary)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"thread_scaling: building the ceiling: {done.stderr.strip()}")
    return binary


def ceiling(binary: Path) -> dict[str, float]:
    """The ceiling's speed-ups now, by kind (3 alternations of its work)."""
    done = subprocess.run([str(binary), "3"], capture_output=True, text=True,
                          env={**os.environ, "OMP_WAIT_POLICY": "passive"})
    ratios = [float(r) for r in re.findall(r": ([\d.]+)x$", done.stdout, re.M)]
    if done.returncode != 0 or len(ratios) != len(KINDS):
        raise SystemExit(f"thread_scaling: the ceiling printed {done.stdout!r}")
    return dict(zip(KINDS, ratios))


def scaling(program: Path, binary: Path, rounds: int, steps: int, replay: bool) -> dict:
    """Per round: the ceiling's speed-ups, then `steps` steps of a model on one thread and of one on two."""
    from deepdsl_runtime.replay import TrainSteps

    models = {threads: _model(program, "compiled", threads) for threads in (1, 2)}
    hyper = models[1].hyper(0.01, 0.9, 0.0005, 0)
    x, y = models[1].random_batch(np.random.default_rng(0))
    trainers = {}
    for threads, model in models.items():
        model.prepare(hyper)
        _set_threads(model, threads)
        trainers[threads] = TrainSteps(model, why=None if replay else "compared")
        for i in range(3):                        # (two steps by their Python, the third recorded)
            trainers[threads](x, y, step=i, **hyper)
    times: dict[int, list[float]] = {1: [], 2: []}
    ceilings: list[dict[str, float]] = []
    done = 3
    for r in range(rounds):
        ceilings.append(ceiling(binary))
        for threads in (1, 2) if r % 2 == 0 else (2, 1):
            _set_threads(models[threads], threads)
            train = trainers[threads]
            train(x, y, step=done, **hyper)      # (a step untimed: the other model's threads left these asleep)
            began = time.perf_counter()
            for i in range(steps):
                train(x, y, step=done + 1 + i, **hyper)
            times[threads].append((time.perf_counter() - began) / steps * 1000)
        done += steps + 1
    speed_ups = [one / two for one, two in zip(times[1], times[2])]
    return {"one": statistics.median(times[1]), "two": statistics.median(times[2]),
            "speed_up": statistics.median(speed_ups),
            "ceiling": {kind: statistics.median(c[kind] for c in ceilings) for kind in KINDS},
            "share": statistics.median(s / max(c.values()) for s, c in zip(speed_ups, ceilings)),
            "replayed": [trainers[t].summary() for t in (1, 2)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("networks", nargs="+")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-replay", action="store_true", help="every step by its Python")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    print(f"{processor()[0]} ({vector_isa('native')}); {args.rounds} rounds of {args.steps} steps a thread count, "
          f"alternating, each beside the ceiling; load average before: {load_average()}")
    print_row(("network", "1 thread ms", "2 threads ms", "speed-up", "ceiling: multiply-adds / cache / memory",
               "share of the ceiling"), args.markdown, 12, header=True)
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_ceiling(Path(tmp))
        for spec in args.networks:
            row = scaling(_compile(spec, Path(tmp)), binary, args.rounds, args.steps, not args.no_replay)
            limits = " / ".join(f"{row['ceiling'][kind]:.2f}x" for kind in KINDS)
            print_row((spec, f"{row['one']:.2f}", f"{row['two']:.2f}", f"{row['speed_up']:.2f}x", limits,
                       f"{row['share']:.0%}"), args.markdown, 12)
            print(f"  step replay at 1 / 2 threads: {row['replayed'][0]} / {row['replayed'][1]}")
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
