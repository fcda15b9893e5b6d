"""Training-step time of one network compiled under several workspace limits, side by side in one process.

    python benchmarks/workspace_limits.py [--network lenet] [--batch 500] [--steps 25] LIMIT ...

LIMIT is a byte count or `none`. Every program is compiled from the same network, made with the same initial
parameters, and the programs take their steps interleaved (step k of each before step k+1 of any), on the same
synthetic batches, so a busy machine slows them alike. Prints each limit's planned workspace and the median and
minimum milliseconds per step after 5 warm-up steps. Set OMP_NUM_THREADS / OPENBLAS_NUM_THREADS for the BLAS
threads.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deepdsl  # noqa: E402
from deepdsl.codegen import write_program  # noqa: E402
from deepdsl.dsl import Overrides  # noqa: E402
from deepdsl.pipeline import CompileOptions  # noqa: E402

WARMUP = 5


def _limit(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _model(network: str, batch: int, limit: int | None, directory: pathlib.Path):
    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / f"{network}.py"), Overrides(batch=batch)),
                               CompileOptions(workspace_limit=limit))
    path = directory / f"{network}_{limit}.py"
    write_program(compiled, path)
    spec = importlib.util.spec_from_file_location(f"{network}_{limit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from deepdsl_runtime.program import model_class
    cls = model_class(module)
    model = cls("cpu", 0)
    model.initialize(0)
    return model, compiled.steps["train"].plan.workspace_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("limits", nargs="+", type=_limit, metavar="LIMIT")
    parser.add_argument("--network", default="lenet")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        models = [(limit, *_model(args.network, args.batch, limit, pathlib.Path(tmp))) for limit in args.limits]
        shape, classes = models[0][1].batch_shape, models[0][1].classes
        rng = np.random.default_rng(0)
        data = [(rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0]).astype(np.int32))
                for _ in range(4)]
        times: dict = {limit: [] for limit, _, _ in models}
        for step in range(args.steps + WARMUP):
            for limit, model, _ in models:
                hyper = model.hyper(0.01, 0.9, 0.0005, step)
                if step == 0:
                    model.prepare(hyper)
                x, y = data[step % len(data)]
                start = time.perf_counter()
                model.train_step(x, y, step=step, **hyper)
                if step >= WARMUP:
                    times[limit].append((time.perf_counter() - start) * 1e3)
    print(f"{args.network}, batch {args.batch}, {args.steps} steps each")
    for limit, _, workspace in models:
        ms = np.array(times[limit])
        print(f"limit {limit}: workspace {workspace / 1e6:.2f} MB, median {np.median(ms):.1f} ms, min {ms.min():.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
