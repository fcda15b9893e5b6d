"""Peak live memory of every network's training step at full size, from the static analysis alone (no training),
against the original DeepDSL's figures (shared/reference/README.md: activations and gradients, no cache, no
workspace, MB = 10^6 bytes).

    python benchmarks/memory_vs_deepdsl.py [--markdown]

Columns: our peak of live bytes (placed sizes), DeepDSL's, their ratio, the arena over our peak, what the same
program would peak at without memory-aware scheduling, without rematerialization, without in-place computation
and without outputs taking over their dying inputs' storage, the workspace, the parameters, and the time of the
memory stages and planner on the training step.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deepdsl  # noqa: E402
from deepdsl.memory_table import what_if  # noqa: E402
from deepdsl.pipeline import plan_program  # noqa: E402
from timing import print_row  # noqa: E402  (benchmarks/ is on the path of a script run from it)

DEEPDSL_MB = {"lenet": 59.168, "alexnet": 745.4, "overfeat": 721.8, "vgg16": 3943.4, "googlenet": 2709.1,
              "resnet50": 3423.3}
MB = 1e6


def measure(name: str) -> dict:
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / f"{name}.py"))
    plan = compiled.steps["train"].plan
    start = time.perf_counter()
    plan_program(compiled.steps["train"].unplanned)
    seconds = time.perf_counter() - start
    alternatives = what_if(compiled.steps["train"].unplanned, compiled.options)
    batch = next(leaf.shape[0] for leaf in compiled.train.inputs if leaf.name == "x")
    return {"name": name, "batch": batch, "peak": plan.peak_live_bytes / MB, "deepdsl": DEEPDSL_MB.get(name),
            "arena": plan.arena_bytes / plan.peak_live_bytes,
            "no_schedule": alternatives["without memory-aware scheduling"] / MB,
            "no_inplace": alternatives["without in-place activations and gradients"] / MB,
            "no_remat": alternatives["without rematerialization"] / MB,
            "no_takeover": alternatives["without taking over dying inputs' storage"] / MB,
            "workspace": plan.workspace_bytes / MB, "params": plan.param_bytes / MB, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("networks", nargs="*", help="network names (default: every file in networks/)")
    args = parser.parse_args()
    names = args.networks or sorted(p.stem for p in (ROOT / "networks").glob("*.py"))
    header = ("network", "batch", "peak MB", "DeepDSL MB", "ratio", "arena/peak", "no sched. MB", "no remat. MB",
              "no in-place MB", "no takeover MB", "workspace MB", "params MB", "plan s")
    print_row(header, args.markdown, 13, header=True)
    for name in names:
        r = measure(name)
        ratio = f"{r['peak'] / r['deepdsl']:.3f}" if r["deepdsl"] else "-"
        cells = (r["name"], str(r["batch"]), f"{r['peak']:.1f}", f"{r['deepdsl']}" if r["deepdsl"] else "-", ratio,
                 f"{r['arena']:.4f}", f"{r['no_schedule']:.1f}", f"{r['no_remat']:.1f}", f"{r['no_inplace']:.1f}",
                 f"{r['no_takeover']:.1f}", f"{r['workspace']:.1f}",
                 f"{r['params']:.1f}", f"{r['seconds']:.2f}")
        print_row(cells, args.markdown, 13)


if __name__ == "__main__":
    main()
