"""The program this checkout's compiler generates for a network against the one another checkout's generates, both
on this checkout's runtime, alternating in one process.

    python benchmarks/compiler_vs_checkout.py --against DIR NET[:BATCH[:IMAGE]] ... [--threads 1 2] [--rounds 7]
                                              [--steps 8] [--markdown]

DIR is another checkout of this repository (`git worktree add DIR REV`). Each network of networks/ is compiled by
each checkout (`deepdsl compile` run in DIR for its program); both programs' compiled kernels are built from this
checkout's kernel sources, so what differs is what the compiler made of the network (its ops, fusions, memory plan),
not the kernels' code. Per thread count, `--rounds` rounds each run a few untimed steps and then `--steps` timed
training steps of one program and then of the other, with room on the frame stack (`timing.timed_steps`); the table
gives the medians over rounds of each round's median step and the median ratio this / DIR. The processor, its
vector extension and the load average are printed.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from op_profile import _compile, _model  # noqa: E402  (benchmarks/ is on the path of a script run from it)
from timing import (add_checkout_options, load_average, other_checkout, print_comparison,  # noqa: E402
                    print_comparison_header, timed_steps)

WARMUP = 3


def _compile_in(checkout: Path, spec: str, directory: Path) -> Path:
    """The program `checkout`'s compiler generates for network `spec` (NET[:BATCH[:IMAGE]]), its library built."""
    name, batch, image = (spec.split(":") + ["", ""])[:3]
    program = directory / f"{name}{batch}_other.py"
    command = [sys.executable, "-m", "deepdsl", "compile", str(checkout / "networks" / f"{name}.py"), "-o",
               str(program)] + (["--batch", batch] if batch else []) + (["--image", image] if image else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=checkout)
    if done.returncode != 0:
        raise SystemExit(f"compiler_vs_checkout: compiling {spec} in {checkout}: {done.stderr.strip()}")
    return program


def _round(model, batch, hyper, steps: int) -> float:
    """The median milliseconds of `steps` training steps after WARMUP untimed ones."""
    def step(i):
        model.train_step(*batch, step=i, **hyper)
    return statistics.median(timed_steps(step, WARMUP, steps)) * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkout_options(parser, rounds=7)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    other = other_checkout(args.against, "deepdsl/cli.py", "compiler_vs_checkout")
    print_comparison_header(other, f"{args.steps} steps a round, {args.rounds} rounds alternating", args.markdown)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.networks:
            programs = (_compile_in(other, spec, Path(tmp)), _compile(spec, Path(tmp)))
            for threads in args.threads:
                runs = []
                for program in programs:
                    model = _model(program, "compiled", threads)
                    x, y = model.random_batch(np.random.default_rng(0))
                    hyper = model.hyper(0.01, 0.9, 0.0005, 0)
                    model.prepare(hyper)
                    runs.append((model, (model.rt.asarray(x), model.rt.asarray(y)), hyper, []))
                for _ in range(args.rounds):
                    for model, batch, hyper, times in runs:
                        times.append(_round(model, batch, hyper, args.steps))
                (_, _, _, theirs), (_, _, _, ours) = runs
                print_comparison(spec, threads, theirs, ours, args.markdown, 2)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
