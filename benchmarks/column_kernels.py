"""The im2col and col2im kernels, and whole training steps, of this checkout's compiled kernels against those of
another kernels directory (another checkout's `runtime/kernels`), alternating in one process.

    python benchmarks/column_kernels.py --against OTHER/runtime/kernels [--threads 1 2] [--rounds 5]
    python benchmarks/column_kernels.py --against OTHER/runtime/kernels --network lenet:64 [--threads 1]
                                        [--rounds 8] [--steps 12]

Kernels: `cpu_ops.c` of each directory is built into a library of its own (the program's build flags); per thread
count and geometry (N, C, H=W, kernel, pad; stride 1), the median microseconds of 15 calls, medians over `--rounds`
rounds that alternate the two libraries, their ratio (this / other), and a check that both give the same bits.
Networks: the network is compiled once, its `.c` built against each directory, and its training step run with each
library in turn, `--steps` steps a round (the first untimed); the median milliseconds per round and the median
ratio. The load average is printed before and after; idle threads sleep as in the generated program.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from deepdsl_runtime import cpu  # noqa: E402
from deepdsl_runtime.cpu import native  # noqa: E402

from op_profile import _compile, _model  # noqa: E402  (benchmarks/ is on the path of a script run from it)
from timing import load_average, median_ms  # noqa: E402

GEOMETRIES = [  # (N, C, H=W, kernel, pad): ResNet-50's 3x3 layers at 112x112 (a chunk of 8), LeNet's, AlexNet's
    (8, 256, 7, 3, 1), (8, 512, 4, 3, 1), (8, 128, 14, 3, 1), (8, 64, 28, 3, 1), (64, 20, 12, 5, 0),
    (64, 1, 28, 5, 0), (1, 256, 27, 5, 2), (4, 256, 13, 3, 1),
]


def _build(source: Path, include: Path, target: Path) -> native.Native:
    subprocess.run(["cc", *native.BUILD_FLAGS, "-I", str(include), "-o", str(target), str(source), "-lm"],
                   check=True)
    return native.Native(ctypes.CDLL(str(target)))


def kernels(libs: dict, threads: list[int], rounds: int) -> None:
    rng = np.random.default_rng(0)
    print("threads  geometry               im2col this / other (us)    col2im this / other (us)")
    for t in threads:
        for lib in libs.values():
            lib.set_threads(t)
        for n, c, h, k, pad in GEOMETRIES:
            ho = h + 2 * pad - k + 1
            x = rng.standard_normal((n, c, h, h), dtype=np.float32)
            grads = rng.standard_normal((c, k, k, n, ho, ho), dtype=np.float32)
            cols = {name: np.full(grads.shape, np.nan, np.float32) for name in libs}
            dx = {name: np.full(x.shape, np.nan, np.float32) for name in libs}
            times = {name: ([], []) for name in libs}
            for _ in range(rounds):
                for name, lib in libs.items():
                    columns, gradient = cols[name].transpose(3, 0, 1, 2, 4, 5), grads.transpose(3, 0, 1, 2, 4, 5)
                    times[name][0].append(1000 * median_ms(lambda: lib.im2col(x, columns, 1, pad), 15))
                    times[name][1].append(1000 * median_ms(lambda: lib.col2im(gradient, dx[name], 1, pad), 15))
            same = np.array_equal(cols["this"], cols["other"]) and np.array_equal(dx["this"], dx["other"])
            a, b = ([statistics.median(v) for v in times[name]] for name in ("this", "other"))
            print(f"{t:>7}  {str((n, c, h, k, pad)):<20} {a[0]:8.0f} / {b[0]:<8.0f} ({a[0] / b[0]:.2f})"
                  f"    {a[1]:8.0f} / {b[1]:<8.0f} ({a[1] / b[1]:.2f}){'' if same else '  RESULTS DIFFER'}")


def steps(spec: str, other: Path, threads: list[int], rounds: int, count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        program = _compile(spec, Path(tmp))
        libs = {name: _build(program.with_suffix(".c"), include, Path(tmp) / f"{name}.so")
                for name, include in (("this", native.KERNELS_DIR), ("other", other))}
        for t in threads:
            model = _model(program, "compiled", t)
            backends = {}
            for name, lib in libs.items():
                lib.set_threads(t)
                backends[name] = cpu.backend(lib)
            x, y = model.random_batch(np.random.default_rng(0))
            hyper = model.hyper(0.01, 0.9, 0.0005, 0)
            model.prepare(hyper)
            per_round = {name: [] for name in libs}
            for _ in range(rounds):
                for name in libs:
                    model.rt = backends[name]
                    times = []
                    for i in range(count):
                        began = time.perf_counter()
                        model.train_step(model.rt.asarray(x), model.rt.asarray(y), step=i, **hyper)
                        times.append(time.perf_counter() - began)
                    per_round[name].append(statistics.median(times[1:]) * 1000)
            ratio = statistics.median(a / b for a, b in zip(per_round["this"], per_round["other"]))
            for name, values in per_round.items():
                print(f"{spec} {t} thread(s), {name}: " + " ".join(f"{v:.1f}" for v in values)
                      + f" ms; median {statistics.median(values):.2f}")
            print(f"{spec} {t} thread(s): this / other, median over rounds {ratio:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True, help="another runtime/kernels directory")
    parser.add_argument("--network", help="NET[:BATCH[:IMAGE]]: whole training steps instead of the kernels")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"load average before: {load_average()}")
    if args.network:
        steps(args.network, args.against.resolve(), args.threads, args.rounds, args.steps)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            libs = {name: _build(directory / "cpu_ops.c", directory, Path(tmp) / f"{name}.so")
                    for name, directory in (("this", native.KERNELS_DIR), ("other", args.against.resolve()))}
            kernels(libs, args.threads, args.rounds)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
