"""A generated program's training steps replayed (`deepdsl_runtime.replay`) against the same steps by their Python,
in one process.

    python benchmarks/replay_vs_python.py NET[:BATCH[:IMAGE]] ... [--threads 1 2] [--rounds 12] [--steps 5]
                                          [--markdown]

Each network is compiled once (`deepdsl compile`, which builds its compiled kernels). Per thread count, two models of
the program train on the same synthetic batch: one step by step by its Python (`TrainSteps` told why not), one
through `TrainSteps` (two steps by their Python, the third recorded and checked: its milliseconds are the record's
cost, about five steps' work; then replayed). Then `--rounds` rounds alternate `--steps` steps of each (a slow phase
of a shared machine falls on both); the table gives the median of each side's milliseconds a step over the rounds,
the median of the rounds' ratios (replayed / Python, below 1: faster), the record's milliseconds and the number of
calls and ops a replayed step makes. Whether the two models' losses and tensors stayed equal bit for bit is checked at
the end. The processor, its vector extension and the load average are printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from op_profile import _compile, _model  # noqa: E402  (benchmarks/ is on the path of a script run from it)
from timing import load_average, print_row, processor, vector_isa  # noqa: E402


def compare(program: Path, threads: int, rounds: int, steps: int) -> tuple:
    """(Python's ms a step, the replay's, the median ratio, the record's ms, its summary, same bits)."""
    from deepdsl_runtime.replay import TrainSteps

    plain, replayed = _model(program, "compiled", threads), _model(program, "compiled", threads)
    hyper = plain.hyper(0.01, 0.9, 0.0005, 0)
    for model in (plain, replayed):
        model.prepare(hyper)
    python, replay = TrainSteps(plain, why="compared"), TrainSteps(replayed)
    x, y = plain.random_batch(np.random.default_rng(0))
    record_ms = 0.0
    for i in range(3):
        python(x, y, step=i, **hyper)
        began = time.perf_counter()
        replay(x, y, step=i, **hyper)
        record_ms = (time.perf_counter() - began) * 1000
    times: dict[str, list[float]] = {"python": [], "replay": []}
    done = 3
    for _ in range(rounds):
        for side, train in (("python", python), ("replay", replay)):
            began = time.perf_counter()
            for i in range(steps):
                train(x, y, step=done + i, **hyper)
            times[side].append((time.perf_counter() - began) / steps * 1000)
        done += steps
    same = all(np.array_equal(v, replayed.tensors[k]) for k, v in plain.tensors.items() if isinstance(v, np.ndarray))
    ratio = statistics.median(r / p for p, r in zip(times["python"], times["replay"]))
    return (statistics.median(times["python"]), statistics.median(times["replay"]), ratio, record_ms,
            replay.summary(), same)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("networks", nargs="+")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    print(f"{processor()[0]} ({vector_isa('native')}); {args.rounds} rounds of {args.steps} steps a side, "
          f"alternating; load average before: {load_average()}")
    print_row(("network", "threads", "python ms", "replay ms", "replay / python", "record ms", "same bits"),
              args.markdown, 12, header=True)
    summaries = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.networks:
            program = _compile(spec, Path(tmp))
            for threads in args.threads:
                python, replay, ratio, record, summary, same = compare(program, threads, args.rounds, args.steps)
                print_row((spec, str(threads), f"{python:.2f}", f"{replay:.2f}", f"{ratio:.3f}", f"{record:.0f}",
                           "yes" if same else "NO"), args.markdown, 12)
                summaries.append(f"{spec}, {threads} thread(s): step replay {summary}")
    for line in summaries:
        print(line)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
