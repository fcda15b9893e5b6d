"""The training command of a generated program on this checkout's runtime against another checkout's, interleaved.

    python benchmarks/runtime_vs_checkout.py --against DIR NET[:BATCH[:IMAGE]] ... [--threads 1 2] [--rounds 3]
                                             [--iters 20] [--markdown]

DIR is another checkout of this repository (`git worktree add DIR REV`). Each network of networks/ is compiled once
by this checkout (`deepdsl compile`, which also builds the program's compiled kernels) and its program trained on
synthetic data by its own command line, `--iters` iterations without testing, in one process per run: with this
checkout's `deepdsl_runtime`, and with DIR's (each checkout's runtime/ put first on the import path: the installed
runtime may be either's, or a third's), alternating in `--rounds`
rounds with the same thread count. What differs is the Python side of the runtime (the generic compiled kernels
are built from each checkout's sources; the program's own library is the same file). The figure is the command's
own "ms per iteration" (every iteration, the first included); the table gives the median over rounds and the ratio
this / DIR of each round's pair's median. The processor, its vector extension and the load average are printed.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from op_profile import _compile  # benchmarks/ is on the path of a script run from it
from timing import add_checkout_options, load_average, other_checkout, print_comparison, print_comparison_header


def _train_ms(program: Path, threads: int, iters: int, runtime_path: str | None, directory: Path) -> float:
    """The training command's ms per iteration, with the runtime found first on `runtime_path` (None: the installed
    one)."""
    env = dict(os.environ)
    if runtime_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [runtime_path, env.get("PYTHONPATH")]))
    command = [sys.executable, str(program), "--iters", str(iters), "--test-iters", "0", "--data", "synthetic",
               "--fresh", "--params", str(directory / "params.npz"), "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=directory)
    found = re.search(r"([\d.]+) ms per iteration", done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"runtime_vs_checkout: {program.name} ({'DIR' if runtime_path else 'this'}): {tail}")
    return float(found.group(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkout_options(parser, rounds=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    other = other_checkout(args.against, "runtime/program.py", "runtime_vs_checkout")
    print_comparison_header(other, f"{args.iters} iterations a run, {args.rounds} rounds alternating",
                            args.markdown)
    with tempfile.TemporaryDirectory() as tmp:
        shims = {}
        for side, checkout in (("against", other), ("this", Path(__file__).resolve().parents[1])):
            shims[side] = Path(tmp) / side          # (this checkout's too: the installed runtime may be another's)
            shims[side].mkdir()
            (shims[side] / "deepdsl_runtime").symlink_to(checkout / "runtime")
        for spec in args.networks:
            program = _compile(spec, Path(tmp))
            for threads in args.threads:
                theirs, ours = [], []
                for _ in range(args.rounds):
                    theirs.append(_train_ms(program, threads, args.iters, str(shims["against"]), Path(tmp)))
                    ours.append(_train_ms(program, threads, args.iters, str(shims["this"]), Path(tmp)))
                print_comparison(spec, threads, theirs, ours, args.markdown, 1)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
