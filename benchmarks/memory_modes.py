"""The generated training program in each memory mode: planned and measured peaks, reserved memory, resident memory
and time per iteration, from the program's own report (MB = 10^6 bytes).

    python benchmarks/memory_modes.py [--markdown] [--iters N] [--threads T] [--workspace-limit BYTES]
                                      [NETWORK[:BATCH] ...]

Default: LeNet at batch 500 and resnet_mini at batch 100 (the sizes their network files declare). Each network is
compiled once (under the compiler's default workspace limit, or `--workspace-limit BYTES` / `none`: ops with
scratch run over the batch in chunks whose scratch fits); the program then runs as its users run it, one process per mode, on synthetic data:
`--iters N --test-iters 1 --memory-mode MODE --report-json ...`, with OMP_NUM_THREADS=T (default 1) so the modes
compete on equal terms on a shared machine. Columns per mode: the training step's planned peak of tensor bytes
and the peak the allocator measured, the bytes the mode reserves for tensors between steps (static: the arena;
pooled: the pool's chunk; dynamic: none), the planned workspace, the process's resident-memory high-water mark
(ru_maxrss: Python, numpy, parameters, data, tensors, workspace and kernel temporaries), and milliseconds per
training iteration (the program's own timing, which leaves out start-up and the test step).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

from timing import print_row  # benchmarks/ is on the path of a script run from it

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deepdsl  # noqa: E402
from deepdsl.codegen import program_env, write_program  # noqa: E402
from deepdsl.dsl import Overrides  # noqa: E402
from deepdsl.pipeline import DEFAULT_WORKSPACE_LIMIT, CompileOptions  # noqa: E402


def _limit(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)

MODES = ("static", "pooled", "dynamic")
MB = 1e6


def measure(name: str, batch: int | None, iters: int, threads: int, directory: pathlib.Path,
            workspace_limit: int | None = DEFAULT_WORKSPACE_LIMIT) -> list[dict]:
    compiled = deepdsl.compile(deepdsl.load(ROOT / "networks" / f"{name}.py", Overrides(batch=batch)),
                               CompileOptions(workspace_limit=workspace_limit))
    program = write_program(compiled, directory / f"{name}.py")
    env = program_env()
    env.update(OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    rows = []
    for mode in MODES:
        report = directory / f"{name}-{mode}.json"
        done = subprocess.run([sys.executable, str(program), "--iters", str(iters), "--test-iters", "1",
                               "--data", "synthetic", "--fresh", "--quiet", "--params", str(directory / "p.npz"),
                               "--memory-mode", mode, "--report-json", str(report)],
                              capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"{name} ({mode}) failed:\n{done.stderr}")
        r = json.loads(report.read_text())
        rows.append({"network": name, "batch": r["batch"], "mode": mode, **r})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("networks", nargs="*", default=["lenet", "resnet_mini"],
                        help="network names in networks/, optionally with :BATCH")
    parser.add_argument("--iters", type=int, default=20, help="training iterations per run")
    parser.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP threads of the program")
    parser.add_argument("--workspace-limit", type=_limit, default=DEFAULT_WORKSPACE_LIMIT, metavar="BYTES",
                        help=f"compile with this workspace limit ('none': no limit; default {DEFAULT_WORKSPACE_LIMIT})")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    header = ("network", "batch", "mode", "planned peak MB", "measured peak MB", "reserved MB", "workspace MB",
              "max RSS MB", "ms/iter")
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{args.threads} thread(s), {args.iters} iterations, workspace limit {args.workspace_limit}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print_row(header, args.markdown, 16, header=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.networks:
            name, _, batch = spec.partition(":")
            for r in measure(name, int(batch) if batch else None, args.iters, args.threads, pathlib.Path(tmp),
                             args.workspace_limit):
                cells = (r["network"], str(r["batch"]), r["mode"], f"{r['peak_bytes_planned'] / MB:.3f}",
                         f"{r['peak_bytes_measured'] / MB:.3f}", f"{r['reserved_bytes'] / MB:.3f}",
                         f"{r['workspace_bytes_planned'] / MB:.3f}", f"{r['max_rss_bytes'] / MB:.1f}",
                         f"{r['seconds_per_iter'] * 1000:.1f}")
                print_row(cells, args.markdown, 16)


if __name__ == "__main__":
    main()
