"""The convolution kernels alone: thin convolutions straight from the input against im2col and the matrix product,
and the two orientations of a filter gradient's product.

    python benchmarks/conv_kernels.py [--threads 1 2] [--repeats 15] [--markdown]

LeNet is compiled with `deepdsl compile` (which builds the compiled kernels); its library runs the kernels. Per
thread count (OpenMP's and OpenBLAS's threads alike), the median milliseconds of `--repeats` calls, after one:

- thin convolutions (`contract.direct_conv`) of several shapes, forward and filter gradient, through
  `deepdsl_runtime.cpu.conv` with the compiled kernels: the im2col path (the direct kernels switched off) against
  the direct one;
- filter-gradient products of convolution shapes (O, C*kh*kw, positions) as G x im2col^T (O, C*kh*kw) and as
  im2col x G^T (C*kh*kw, O), numpy's matmul on OpenBLAS (`conv._transposed_filter_product` picks the second where
  positions >= 4 * C*kh*kw).

The load average is printed before and after; idle threads sleep as in the generated program.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from deepdsl_runtime import contract  # noqa: E402
from deepdsl_runtime.cpu import conv, native  # noqa: E402

from timing import load_average, median_ms, print_row  # noqa: E402  (benchmarks/ is on the script's path)

ROOT = Path(__file__).resolve().parents[1]
THIN = [  # (N, C, H, O, kernel, pad): square images
    (64, 1, 28, 20, 5, 0), (500, 1, 28, 20, 5, 0), (64, 1, 28, 32, 3, 1), (64, 3, 32, 16, 3, 0), (64, 3, 32, 16, 3, 1),
]
PRODUCTS = [  # (O, C*kh*kw, positions): LeNet's conv2 (batch 64, 500), ResNet's and AlexNet's layers
    (50, 500, 4096), (50, 500, 32000), (64, 576, 25088), (128, 1152, 6272), (256, 2304, 1568), (512, 4608, 392),
    (96, 363, 12100), (256, 2400, 2916),
]


def _library(directory: Path) -> native.Native:
    program = directory / "lenet.py"
    subprocess.run([sys.executable, "-m", "deepdsl", "compile", str(ROOT / "networks" / "lenet.py"), "-o",
                    str(program)], check=True, cwd=ROOT, capture_output=True)
    kernels, why = native.load(program)
    if kernels is None:
        raise SystemExit(f"no compiled kernels: {why}")
    return kernels


def thin_rows(kernels: native.Native, threads: int, repeats: int, markdown: bool) -> None:
    rng = np.random.default_rng(0)
    for n, c, h, o, k, pad in THIN:
        ho = h + 2 * pad - k + 1
        x = rng.standard_normal((n, c, h, h), dtype=np.float32)
        w = rng.standard_normal((o, c, k, k), dtype=np.float32)
        b = rng.standard_normal(o, dtype=np.float32)
        g = rng.standard_normal((n, o, ho, ho), dtype=np.float32)
        out, dw = np.empty_like(g), np.empty_like(w)
        workspace = np.empty(n * (contract.conv2d_scratch(x.shape, w.shape, g.shape, 1, pad)
                                  + sum(contract.conv2d_bwd_filter_scratch(g.shape, x.shape, (k, k), pad))),
                             np.float32)
        times = {}
        for path in ("im2col", "direct"):
            if path == "im2col":
                kernels.direct = lambda *args: False        # the direct kernels decline: the im2col path runs
            times[path] = (
                median_ms(lambda: conv.conv2d(x, w, b, out=out, stride=1, pad=pad, workspace=workspace,
                                              native=kernels), repeats),
                median_ms(lambda: conv.conv2d_bwd_filter(g, x, out=dw, stride=1, pad=pad, kernel=(k, k),
                                                         workspace=workspace, native=kernels), repeats))
            if path == "im2col":
                del kernels.direct
        cells = [f"{n}x{c}x{h}x{h} {o}x{k}x{k} pad {pad}", str(threads)]
        for i in range(2):
            cells += [f"{times['im2col'][i]:.2f}", f"{times['direct'][i]:.2f}"]
        print_row(cells, markdown, 10)


def product_rows(threads: int, repeats: int, markdown: bool) -> None:
    rng = np.random.default_rng(1)
    for o, rows, positions in PRODUCTS:
        g = rng.standard_normal((o, positions), dtype=np.float32)
        cols = rng.standard_normal((rows, positions), dtype=np.float32)
        dw, dw_t = np.empty((o, rows), np.float32), np.empty((rows, o), np.float32)
        plain = median_ms(lambda: np.matmul(g, cols.T, out=dw), repeats)
        turned = median_ms(lambda: np.matmul(cols, g.T, out=dw_t), repeats)
        print_row([f"{o} x {rows} x {positions}", str(threads), f"{plain:.2f}", f"{turned:.2f}",
                   f"{plain / turned:.2f}"], markdown, 10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    print(f"load average before: {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        kernels = _library(Path(tmp))
        print("\nthin convolutions, ms (forward and filter gradient: im2col path, direct)")
        print_row(["shape", "threads", "fwd im2col", "fwd direct", "filter im2col", "filter direct"], args.markdown,
                  10, header=True)
        for threads in args.threads:
            kernels.set_threads(threads)
            native.set_blas_threads(threads)
            thin_rows(kernels, threads, args.repeats, args.markdown)
        print("\nfilter-gradient products, ms (O x C*kh*kw x positions)")
        print_row(["product", "threads", "G x im2col^T", "im2col x G^T", "ratio"], args.markdown, 10, header=True)
        for threads in args.threads:
            native.set_blas_threads(threads)
            product_rows(threads, args.repeats, args.markdown)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
