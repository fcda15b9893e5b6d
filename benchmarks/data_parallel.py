"""Data-parallel training on this machine, and a model of larger jobs.

    python benchmarks/data_parallel.py [NET:BATCH ...] [--ranks 1 2] [--iters 30] [--rounds 3]
                                       [--modes exact exact-after fast fast-after local]
                                       [--model alexnet:16:227 resnet50:8:112]
                                       [--markdown]

Measured: each network (default lenet:64 resnet_mini:32 wide:64, the last an MLP of two 512-wide layers whose
gradients make several buckets) compiled with --data-parallel at the per-rank batch (so the work of a rank is
fixed and the global batch grows with the ranks) runs under `mpiexec -n R python -m mpi4py` for each R of --ranks
and, for R > 1, each reduction mode (exact: the chain in rank order, bucket by bucket during the backward pass;
exact-after: the same after the step, --no-overlap; fast: MPI's Allreduce of buckets during the backward pass;
fast-after: the same after the step; local: exact with --batch-norm local, for networks with batch norm: no sums
of batch statistics over the ranks inside the step), one thread a rank, --iters iterations on the
digits, in rounds that interleave all of them (a busy moment of the shared machine falls on all alike). Per run:
the median over rounds of ms per iteration, of the share of it spent waiting in reductions (the exposed part),
the bytes reduced per iteration and the examples per second. The load average is printed before and after.

Model: for each network of --model (NET:BATCH:IMAGE, the per-rank batch), the gradient bytes (4 per parameter) and
the measured ms of one training step of one process at that batch (two threads), then for R = 8 .. 1024 ranks on
10 and 100 Gb/s links the time of a ring allreduce (MPI's, what --reduce fast may use: 2 (R-1)/R B/W + 2 (R-1) a)
and of the exact chain (about 2 B/W + (R - 1) (c/W + a) with c the chunk), the iteration time without overlap,
and the parallel efficiency compute / (compute + reduction): where it falls below one half, communication
dominates.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import load_average, print_row  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]
LINKS = {"10 Gb/s": (10e9 / 8, 20e-6), "100 Gb/s": (100e9 / 8, 5e-6)}     # bytes/s, latency per message (s)
CHUNK = 1 << 20                                                            # the exact chain's chunk, bytes


WIDE = """
from deepdsl import dsl as D

x = D.images("x", (64, 1, 28, 28), dataset="digits")
y = D.labels("y", 64, classes=10)
network = D.full("c", 10) @ D.relu @ D.full("b", 512) @ D.relu @ D.full("a", 512) @ D.flatten
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("wide", iters=10, lr=0.05, momentum=0.9))
"""


def _program(network: str, batch: int, image, directory: Path, data_parallel: bool = True) -> Path:
    import deepdsl
    from deepdsl.codegen import write_program
    from deepdsl.codegen.native import build_library
    from deepdsl.dsl import Overrides

    source = ROOT / "networks" / f"{network}.py"
    if network == "wide":
        source = directory / "wide.py"
        source.write_text(WIDE)
    loop = deepdsl.load(str(source), Overrides(batch=batch, image=image))
    compiled = deepdsl.compile(loop, deepdsl.CompileOptions(data_parallel=data_parallel))
    path = directory / f"{network}_{batch}.py"
    write_program(compiled, path)
    library, why = build_library(path.with_suffix(".c"))
    if library is None:
        print(f"# {network}: numpy kernels ({why})")
    return path


MODES = {"exact": ("--reduce", "exact"), "exact-after": ("--reduce", "exact", "--no-overlap"),
         "fast": ("--reduce", "fast"), "fast-after": ("--reduce", "fast", "--no-overlap"),
         "local": ("--reduce", "exact", "--batch-norm", "local")}


def _run(path: Path, ranks: int, iters: int, threads: int, mode: str, report: Path, data: str) -> dict:
    from deepdsl.codegen import program_env

    mpiexec = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(path), "--data-parallel",
               "--iters", str(iters), "--params", "", "--test-iters", "1", "--threads", str(threads), "--quiet",
               *MODES[mode], "--report-json", str(report), "--data", data]
    done = subprocess.run(command, capture_output=True, text=True, env=program_env(), timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{path.name} on {ranks} ranks failed: {done.stderr.strip()[-500:]}")
    return json.loads(report.read_text())


def measure(args, directory: Path) -> None:
    print(f"load average before: {load_average()}")
    programs = {}
    for spec in args.networks:
        name, batch = spec.split(":")
        programs[spec] = _program(name, int(batch), None, directory)
    def runs(path: Path) -> list[tuple[int, str]]:
        norms = "def statistics_step" in path.read_text()       # batch norm: local differs from exact
        return [(ranks, mode) for ranks in args.ranks for mode in (args.modes if ranks > 1 else ["exact"])
                if mode != "local" or norms]

    results: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for spec, path in programs.items():
            for ranks, mode in runs(path):
                report = directory / f"{path.stem}_{ranks}_{mode}.json"
                results.setdefault((spec, ranks, mode), []).append(
                    _run(path, ranks, args.iters, 1, mode, report, args.data))
    print(f"load average after: {load_average()}")
    header = ["network", "ranks", "reduce", "global batch", "ms/iteration", "waiting %", "MB reduced", "buckets",
              "examples/s", "vs 1 rank"]
    print_row(header, args.markdown, 12, header=True)
    for spec, path in programs.items():
        base = None
        for ranks, mode in runs(path):
            got = results[spec, ranks, mode]
            ms = statistics.median(r["seconds_per_iter"] for r in got) * 1000
            share = statistics.median(r["communication_share"] for r in got) * 100
            throughput = got[0]["global_batch"] / (ms / 1000)
            base = base or throughput
            print_row([spec, str(ranks), mode if ranks > 1 else "-", str(got[0]["global_batch"]), f"{ms:.1f}",
                       f"{share:.1f}", f"{got[0]['bytes_reduced_per_step'] / 1e6:.2f}", str(got[0]["buckets"]),
                       f"{throughput:.0f}", f"{throughput / base:.2f}x"], args.markdown, 12)


def _gradient_bytes(network: str, batch: int, image) -> int:
    import deepdsl
    from deepdsl.dsl import Overrides
    from deepdsl.training import parameters

    loop = deepdsl.load(str(ROOT / "networks" / f"{network}.py"), Overrides(batch=batch, image=image))
    return 4 * sum(math.prod(p.shape) for p in parameters(loop.loss.node))


def ring(nbytes: int, ranks: int, bandwidth: float, latency: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def chain(nbytes: int, ranks: int, bandwidth: float, latency: float) -> float:
    return 2 * nbytes / bandwidth + (ranks - 1) * (min(CHUNK, nbytes) / bandwidth + latency) \
        + math.ceil(math.log2(ranks)) * latency


def model(args, directory: Path) -> None:
    header = ["network", "link", "ranks", "compute ms", "ring ms", "chain ms", "efficiency ring",
              "efficiency chain"]
    rows = []
    for spec in args.model:
        name, batch, image = spec.split(":")
        size = (int(image), int(image))
        nbytes = _gradient_bytes(name, int(batch), size)
        path = _program(name, int(batch), size, directory, data_parallel=False)
        report = directory / f"{name}_alone.json"
        from deepdsl.codegen import program_env
        done = subprocess.run([sys.executable, str(path), "--iters", "3", "--params", "", "--test-iters", "1",
                               "--threads", "2", "--quiet", "--data", "synthetic", "--report-json", str(report)],
                              capture_output=True, text=True, env=program_env(), timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"{name}: {done.stderr.strip()[-500:]}")
        compute = json.loads(report.read_text())["seconds_per_iter"]
        print(f"# {name} batch {batch} at {image}x{image}: {nbytes / 1e6:.1f} MB of gradients, one step "
              f"{compute * 1000:.0f} ms on one process (2 threads)")
        for link, (bandwidth, latency) in LINKS.items():
            for ranks in (8, 64, 256, 1024):
                r, c = ring(nbytes, ranks, bandwidth, latency), chain(nbytes, ranks, bandwidth, latency)
                rows.append([f"{name}:{batch}", link, str(ranks), f"{compute * 1000:.0f}", f"{r * 1000:.0f}",
                             f"{c * 1000:.0f}", f"{compute / (compute + r):.2f}", f"{compute / (compute + c):.2f}"])
    print_row(header, args.markdown, 14, header=True)
    for row in rows:
        print_row(row, args.markdown, 14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("networks", nargs="*", default=["lenet:64", "resnet_mini:32", "wide:64"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--data", default="digits")
    parser.add_argument("--model", nargs="*", default=["alexnet:16:227", "resnet50:8:112"])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.networks:
            measure(args, Path(tmp))
        if args.model:
            model(args, Path(tmp))


if __name__ == "__main__":
    main()
