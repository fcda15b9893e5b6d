"""This checkout's compiler against another checkout's: the CPU seconds of a compile, without a budget and under the
least memory budget the network can reach, alternating processes, and whether both made the same programs.

    python benchmarks/compile_vs_checkout.py --against DIR NET[:BATCH[:IMAGE]] ... [--rounds 5] [--markdown]

DIR is another checkout of this repository (`git worktree add DIR REV`). Each round runs, for each network, one
process of each checkout (in turn, the other's first in odd rounds), on the processes' own CPU time (less sensitive
to other work on a shared machine than the wall clock): `deepdsl.compile` of the network without a budget ("plain"),
the budget search that finds its least reachable total (a compile under a budget of one byte: "least", as the
budget tests and `deepdsl compile --memory-budget` with too small a budget run it), and a compile under that total
("fit"). The table gives the medians over rounds of each and the ratios this / other, and whether the two
checkouts' steps came out the same: their statements, in-place targets and memory plans (a digest of each). The
default batch is 2, as the tests compile networks; IMAGE is HxW or one side.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from timing import load_average, other_checkout, print_row, processor  # benchmarks/ is on the path of a script

ROOT = Path(__file__).resolve().parents[1]

# one network's figures in a process of the checkout it runs in (its working directory first on the path)
WORKER = r"""
import hashlib, json, sys, time
sys.path.insert(0, ".")
import deepdsl
from deepdsl.budget import BudgetError
from deepdsl.dsl import Overrides
from deepdsl.pipeline import compile_without_search

name, batch, image = sys.argv[1], int(sys.argv[2]), sys.argv[3]
image = tuple(int(side) for side in (image.split("x") * 2)[:2]) if image else None
loop = deepdsl.load(f"networks/{name}.py", Overrides(batch=batch, image=image))


def digest(compiled):
    h = hashlib.sha1()
    for step in sorted(compiled.steps):
        program, plan = compiled.steps[step].program, compiled.steps[step].plan
        h.update(repr([(type(i).__name__, getattr(i, "node", None) and (i.node.op, i.node.shape, i.node.attrs),
                        getattr(i, "into", None) is not None) for i in program.body]).encode())
        h.update(repr((plan.peak_live_bytes, plan.arena_bytes, plan.workspace_bytes, plan.total_bytes)).encode())
    return h.hexdigest()[:12]


seconds, digests = {}, {}
start = time.process_time()
digests["plain"] = digest(deepdsl.compile(loop))
seconds["plain"] = time.process_time() - start
start = time.process_time()
try:
    compile_without_search(loop, deepdsl.CompileOptions(memory_budget=1))
    least = None
except BudgetError as error:
    least = error.least.total_bytes
seconds["least"] = time.process_time() - start
if least is not None:
    start = time.process_time()
    digests["fit"] = digest(deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=least)))
    seconds["fit"] = time.process_time() - start
print(json.dumps({"seconds": seconds, "digests": digests, "least": least}))
"""
PHASES = ("plain", "least", "fit")


def _run(checkout: Path, spec: str) -> dict:
    name, batch, image = (spec.split(":") + ["2", ""])[:3]
    done = subprocess.run([sys.executable, "-c", WORKER, name, batch or "2", image], cwd=checkout,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compiling {spec} in {checkout}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("networks", nargs="+", help="NET[:BATCH[:IMAGE]]")
    parser.add_argument("--against", required=True, help="another checkout of this repository")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    other = other_checkout(args.against, "deepdsl/pipeline.py", "compile_vs_checkout")
    cpu, isa = processor()
    print(f"{cpu} ({isa}); CPU seconds, medians of {args.rounds} rounds; load average before: {load_average()}",
          flush=True)
    print_row(("network", *(f"{phase} {other.name} / this (s)" for phase in PHASES), "same programs"),
              args.markdown, 12, header=True)
    for spec in args.networks:
        runs: dict[str, list[dict]] = {"other": [], "this": []}
        for r in range(args.rounds):
            sides = [("other", other), ("this", ROOT)]
            for side, checkout in (sides if r % 2 == 0 else sides[::-1]):
                runs[side].append(_run(checkout, spec))
        cells = []
        for phase in PHASES:
            theirs = [run["seconds"][phase] for run in runs["other"] if phase in run["seconds"]]
            ours = [run["seconds"][phase] for run in runs["this"] if phase in run["seconds"]]
            cells.append(f"{statistics.median(theirs):.2f} / {statistics.median(ours):.2f} "
                         f"({statistics.median(ours) / statistics.median(theirs):.2f}x)" if theirs and ours else "-")
        digests = {json.dumps(run["digests"], sort_keys=True) for run in runs["other"] + runs["this"]}
        print_row((spec, *cells, "yes" if len(digests) == 1 else "NO"), args.markdown, 12)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
