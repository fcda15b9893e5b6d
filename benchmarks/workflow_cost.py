"""What the training workflow's options cost a step: the same training run without them, with `--log` (an entry
every --log-every iterations, and every iteration) and `--tensorboard`, side by side.

    python benchmarks/workflow_cost.py [--network lenet] [--batch 64] [--iters 200] [--rounds 5] [--threads 2]
                                       [--markdown]

Each side is the generated program of --network (compiled once, here) run as a separate process for --iters
iterations on its dataset (digits for LeNet), from the same seed, with no test pass; its `--report-json` gives
the seconds an iteration of the training loop (`seconds_per_iter`: the loop, logging included, without start-up).
The sides alternate in rounds, their order turning from round to round, so a busy moment of a shared machine falls
on all of them alike. The table gives the median over the rounds, the slowest and fastest round, and the ratio to
the run without options (above 1: slower). The load average is printed before and after, with the processor's
vector extensions.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from timing import processor  # noqa: E402  (benchmarks/ is on the path of a script run from it)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--network", default="lenet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)

    import deepdsl
    from deepdsl.codegen import program_env, write_program
    from deepdsl.codegen.native import build_library
    from deepdsl.dsl import Overrides

    work = Path(tempfile.mkdtemp(prefix="workflow-cost-"))
    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / f"{args.network}.py"), Overrides(batch=args.batch)))
    program = work / f"{compiled.name}.py"
    write_program(compiled, program)
    built, why = build_library(program.with_suffix(".c"))
    if built is None:
        print(f"compiled kernels not built ({why}): numpy's kernels")
    sides = {
        "plain": [],
        "log every 10": ["--log", str(work / "a.jsonl")],
        "log every 1": ["--log", str(work / "b.jsonl"), "--log-every", "1"],
    }
    try:
        import tensorboardX  # noqa: F401
        sides["log + tensorboard every 10"] = ["--log", str(work / "c.jsonl"), "--tensorboard", str(work / "board")]
    except ImportError:
        print("tensorboardX not installed: no TensorBoard side")
    env = {**program_env(), "OMP_NUM_THREADS": str(args.threads)}
    name, isa = processor()
    print(f"load average before: {os.getloadavg()}; {name}, {isa}; {args.network} batch {args.batch}, {args.iters} "
          f"iterations, {args.threads} threads, {args.rounds} rounds")
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            report = work / "report.json"
            done = subprocess.run([sys.executable, str(program), "--iters", str(args.iters), "--test-iters", "0",
                                   "--params", "", "--threads", str(args.threads), "--report-json", str(report),
                                   "--quiet", "--fresh", *sides[name]], env=env, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr)
                return 1
            times[name].append(json.loads(report.read_text())["seconds_per_iter"] * 1000)
    print(f"load average after: {os.getloadavg()}")
    base = statistics.median(times["plain"])
    rows = [(name, statistics.median(t), max(t), min(t), statistics.median(t) / base) for name, t in times.items()]
    if args.markdown:
        print("| side | ms / iteration (median) | slowest | fastest | ratio to plain |")
        print("|---|---|---|---|---|")
        for name, med, hi, lo, ratio in rows:
            print(f"| {name} | {med:.2f} | {hi:.2f} | {lo:.2f} | {ratio:.3f} |")
    else:
        for name, med, hi, lo, ratio in rows:
            print(f"{name:28s} {med:8.2f} ms  (slowest {hi:.2f}, fastest {lo:.2f})  x{ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
