"""What recomputation costs in time: ms per training step of the generated program under memory budgets, on the CPU.

    python benchmarks/budget_step_time.py [NET:BATCH ...] [--fractions 1 0.5 0] [--rounds 3] [--steps 10]
                                          [--warmup 2] [--threads 1] [--markdown]

Default networks: lenet:500 resnet_mini:32. For each network the budgets are least + f x (total without a budget -
least) for each fraction f (1: the program without a budget; 0: the least reachable). Each budget's program is
compiled (`memory_budget`), written with its compiled CPU kernels and imported; then the programs run in rounds,
interleaved (each round times every budget's program, so a busy moment of a shared machine falls on all alike),
each the median of `--steps` timed training steps after `--warmup` untimed ones, on the same synthetic batches.
The table gives per budget: planned total, recomputed GFLOP (% of the step's), workspace limit chosen, median
ms/step over rounds and its ratio to the program without a budget. The load average is printed before and after.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

from timing import load_average, print_row, timed_steps  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]


def _programs(network: str, batch: int, fractions: list[float], directory: Path):
    import deepdsl
    from deepdsl.budget import BudgetError, flops
    from deepdsl.codegen import write_program
    from deepdsl.codegen.native import build_library
    from deepdsl.dsl import Overrides
    from deepdsl.pipeline import compile_without_search
    from deepdsl_runtime.program import model_class

    loop = deepdsl.load(str(ROOT / "networks" / f"{network}.py"), Overrides(batch=batch))
    unbudgeted = deepdsl.compile(loop).steps["train"].plan.total_bytes
    try:
        compile_without_search(loop, deepdsl.CompileOptions(memory_budget=1))
        least = 1
    except BudgetError as err:
        least = err.least.total_bytes
    result = []
    for k, fraction in enumerate(fractions):
        budget = int(least + fraction * (unbudgeted - least))
        compiled = deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=budget))
        path = directory / f"{network}_{k}.py"
        write_program(compiled, path)
        build_library(path.with_suffix(".c"))
        spec = importlib.util.spec_from_file_location(f"budget_program_{network}_{k}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        step = compiled.steps["train"]
        extra, own = flops(step.program)
        result.append((budget, step.plan.total_bytes, extra, own, step.fit.workspace_limit, model_class(module)))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("networks", nargs="*", default=["lenet:500", "resnet_mini:32"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(args.threads)
    import numpy as np

    print(f"load average before: {load_average()}; threads {args.threads}; python {sys.version.split()[0]}")
    header = ["network", "budget MB", "total MB", "recomputed GFLOP", "extra %", "workspace limit", "ms/step",
              "x unbudgeted"]
    print_row(header, args.markdown, 16, header=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.networks:
            network, batch = spec.split(":")
            programs = _programs(network, int(batch), args.fractions, Path(tmp))
            models = []
            rng = np.random.default_rng(0)
            for *_, model_cls in programs:
                model = model_cls("cpu", 0, "static", kernels="compiled", threads=args.threads)
                model.initialize(0)
                model.prepare(model.hyper(0.01, 0.9, 0.0005, 0))
                models.append(model)
            data = [programs[0][-1].random_batch(rng) for _ in range(2)]
            times = [[] for _ in models]
            for _ in range(args.rounds):
                for k, model in enumerate(models):
                    def step(i, model=model):
                        x, y = data[i % 2]
                        model.train_step(x, y, step=i, **model.hyper(0.01, 0.9, 0.0005, i))
                    times[k].append(statistics.median(timed_steps(step, args.warmup, args.steps)) * 1e3)
            base = statistics.median(times[0])
            for (budget, total, extra, own, limit, _), measured in zip(programs, times):
                ms = statistics.median(measured)
                print_row([spec, f"{budget / 1e6:.2f}", f"{total / 1e6:.2f}", f"{extra / 1e9:.3f}",
                           f"{100 * extra / own:.2f}", "none" if limit is None else str(limit), f"{ms:.1f}",
                           f"{ms / base:.2f}"], args.markdown, 16)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
