"""What cutting matrix products by their shapes costs against cutting them by the thread count.

    python benchmarks/product_cuts.py lenet:64 resnet50:8:112 vit:64 --threads 1 2 --rounds 10 --steps 3 [--markdown]

A generated program's products run on the compiled kernels' threads in parts: `shapes` cuts each as
`deepdsl_runtime.contract.product_cuts` does (parts fixed by the shapes, the same bits on any number of threads),
`threads` as the runtime did before (one part per thread, whole products per thread where a stack shares evenly:
bits that depend on the thread count). Each (network, threads) runs in a process of its own, in which the two cuts
alternate `--rounds` times, each round timing `--steps` training steps after one untimed step (alternating in one
process: a shared machine's drift reaches both alike). Prints each cut's median ms a step over the rounds, their
ratio (shapes / threads), the load average before and after, and the processor's vector extensions and numpy's
BLAS kernel (bits and speed both depend on them).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import load_average, print_row, train_step_ms

HERE = Path(__file__).resolve().parent
CUTS = ("shapes", "threads")


def _by_threads(threads: int):
    """The cut of the runtime before: one part per thread (whole products per thread where a stack shares evenly)."""
    from deepdsl_runtime.contract import ProductCuts

    def cuts(batch: int, m: int, n: int, k: int) -> ProductCuts:
        by_columns = n >= m
        side = n if by_columns else m
        parts = 1 if batch % threads == 0 else threads
        return ProductCuts((by_columns, parts, (-(-side // parts) + 15) // 16 * 16))

    return cuts


def _child(program: Path, threads: int, rounds: int, steps: int) -> None:
    """The median ms a step of each cut (printed, in the order of CUTS), alternating in this process."""
    import op_profile
    from deepdsl_runtime import contract

    model = op_profile._model(program, "compiled", threads)
    assert model.rt.native is not None and model.rt.native.products, model.kernels
    rules = {"shapes": contract.product_cuts, "threads": _by_threads(threads)}
    times: dict[str, list[float]] = {cut: [] for cut in CUTS}
    for _ in range(rounds):
        for cut in CUTS:
            contract.product_cuts = rules[cut]
            times[cut].append(train_step_ms(model, 1, steps))
    print(" ".join(f"{statistics.median(times[cut]):.3f}" for cut in CUTS))


def _machine() -> str:
    """The processor's widest vector extension and numpy's BLAS kernel."""
    sys.path.insert(0, str(HERE.parent))
    from tests.support.arithmetic import description

    flags = open("/proc/cpuinfo").read().split() if Path("/proc/cpuinfo").exists() else []
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{isa}; {description()['blas']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("networks", nargs="+", help="NAME[:BATCH[:IMAGE]] of networks/")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", metavar="PROGRAM", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(Path(args.child), args.threads[0], args.rounds, args.steps)
        return 0
    import op_profile

    print(f"{_machine()}; {args.rounds} rounds; load average before: {load_average()}")
    print_row(("network", "threads", "shapes ms", "threads ms", "ratio"), args.markdown, 12, header=True)
    with tempfile.TemporaryDirectory() as tmp:
        for network in args.networks:
            program = op_profile._compile(network, Path(tmp) / network.replace(":", "_"))
            for threads in args.threads:
                done = subprocess.run([sys.executable, __file__, network, "--threads", str(threads), "--rounds",
                                       str(args.rounds), "--steps", str(args.steps), "--child", str(program)],
                                      capture_output=True, text=True, cwd=HERE)
                if done.returncode != 0:
                    raise SystemExit(f"{network}: {done.stderr.strip()}")
                shapes, by_threads = (float(v) for v in done.stdout.split()[-2:])
                print_row((network, str(threads), f"{shapes:.1f}", f"{by_threads:.1f}", f"{shapes / by_threads:.3f}"),
                          args.markdown, 12)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
