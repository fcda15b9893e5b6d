"""How a generated program's step time depends on who runs its matrix products and how long idle threads spin.

    python benchmarks/thread_policies.py resnet50:8:112 --threads 2 --rounds 4 --steps 6 --spins 1000 10000 [--busy]

Each configuration runs in a process of its own (GNU OpenMP reads GOMP_SPINCOUNT when it loads), the configurations
alternating, `--rounds` times: the products on the compiled kernels' threads (`team`: one OpenMP team for the whole
step, OpenBLAS on one thread) or on OpenBLAS's own threads (`blas`, numpy's matmul), each with every spin count of
`--spins`. Prints each configuration's median ms a step (median over rounds of each process's median step) and its
ratio to the first. With `--busy`, a process spinning on one core runs beside them all along (a machine shared with
another job); the load average is printed before and after. The thread count is fixed (`--threads`): the free-core
following of the program's command line (`deepdsl_runtime.cpu.cores`) is not part of a bare step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import load_average, print_row, train_step_ms

HERE = Path(__file__).resolve().parent


def _child(program: Path, products: str, threads: int, warmup: int, steps: int) -> None:
    """One process's median ms a step (printed), the products where `products` says."""
    import op_profile
    from deepdsl_runtime.cpu import native

    if products == "blas":
        native.blas_sgemm = lambda: None          # as where numpy's BLAS has no sgemm to call: OpenBLAS's threads
    model = op_profile._model(program, "compiled", threads)
    assert model.rt.native.products == (products == "team"), model.kernels
    print(f"{train_step_ms(model, warmup, steps):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("network", help="NAME[:BATCH[:IMAGE]] of networks/")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--spins", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--products", nargs="+", default=["blas", "team"], choices=("blas", "team"))
    parser.add_argument("--busy", action="store_true", help="one process spinning on a core beside them")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("PROGRAM", "PRODUCTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(Path(args.child[0]), args.child[1], args.threads, args.warmup, args.steps)
        return 0
    import op_profile

    configurations = [(p, s) for p in args.products for s in args.spins]
    print(f"{args.network}, {args.threads} threads, {args.rounds} rounds; load average before: {load_average()}")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            program = op_profile._compile(args.network, Path(tmp))
            results: dict[tuple, list[float]] = {c: [] for c in configurations}
            for _ in range(args.rounds):
                for products, spin in configurations:
                    env = dict(os.environ, GOMP_SPINCOUNT=str(spin))
                    done = subprocess.run([sys.executable, __file__, args.network, "--threads", str(args.threads),
                                           "--warmup", str(args.warmup), "--steps", str(args.steps),
                                           "--child", str(program), products], capture_output=True, text=True,
                                          env=env, cwd=HERE)
                    if done.returncode != 0:
                        raise SystemExit(f"{products} spin {spin}: {done.stderr.strip()}")
                    results[(products, spin)].append(float(done.stdout.split()[-1]))
    finally:
        if busy is not None:
            busy.kill()
    first = statistics.median(results[configurations[0]])
    print_row(("products", "spin", "ms/step", "vs first", "rounds"), args.markdown, 10, header=True)
    for (products, spin), times in results.items():
        ms = statistics.median(times)
        print_row((products, str(spin), f"{ms:.1f}", f"{ms / first:.3f}", " ".join(f"{t:.1f}" for t in times)),
                  args.markdown, 10)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
