"""Dropout's masks, the weight gradients' products, the attention heads' transposes, attention of small heads, the
sums of a bias's gradient and global average pooling on the compiled kernels, against what ran before them.

    python benchmarks/small_kernels.py [--threads 1 2] [--rounds 5] [--calls 40] [--isa native|avx2] [--markdown]

Masks: the (32, 4, 64, 64) masks of char_lm's attention (1 M bytes), drawn by numpy's Philox generator (the numpy
kernel, what every program ran before) and by the compiled kernel (`deepdsl_bernoulli`: the same bytes). Products: a
ViT's, char_lm's and LeNet's products (forward, input and weight gradients; `T`: an operand read transposed) and
AlexNet's widest weight gradient and its fc6 forward (from 16 samples), by the BLAS's sgemm on the kernels' threads, cut
as `contract.product_cuts` says (and along the inner dimension where `contract.product_depth_cut` says so, given the
planned workspace), and as `Native.gemm` computes them now: as dot products where `contract.dot_product` takes them
(`dot`), in the kernels' own tiles where `contract.small_product` does (`tiles`), else as before (`sgemm`). Transposes:
the ViT's and char_lm's swaps of heads and tokens, by numpy's copy and by the compiled kernel (`deepdsl_swap_axes`).
Attention: the forward and the gradient of the ViT's heads (64 x 4 units of 16 tokens of 16 features), causal heads of
16 tokens with a tenth of their weights dropped, and char_lm's heads without dropout and with a tenth of their weights
dropped (32 x 4 units of 64 causal tokens of 16 features), by the compiled row passes between BLAS products on blocks of
units, and weighed whole unit by unit (`deepdsl_attention_units`, where `contract.attention_in_units` takes them; within
float32 rounding). Sums: a (1024, 64) and a (2048, 128) gradient summed to its bias, by numpy and by the compiled kernel
(`Native.channel_sum`, each column a channel; within float32 rounding). Pooling: global average pooling and its
gradient of MobileNet-v2's last features (16 x 1280 at 4x4, the network at 112x112) and ResNet-50's (8 and 32 x 2048
at 7x7, at 224x224), by numpy and by the compiled kernels (`Native.avg_pool`, `avg_pool_bwd`: the same bits). The
library is built from the program of
networks/char_lm.py in a temporary directory. For each thread count, `--rounds` rounds alternate the two sides of each
case, `--calls` calls each; printed: the median milliseconds of a call over all calls, the ratio (before / after: above
1, faster now), a check that both sides agree (the same bytes; the products within float32 rounding), the processor's
vector extensions and the load average before and after. `--isa avx2` runs both sides as on a processor without AVX-512
(on one that has it): the generic kernels built with `-mno-avx512f`, OpenBLAS on its Haswell kernels (OPENBLAS_CORETYPE;
the process starts again with it set before numpy loads).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from timing import load_average, print_row, processor  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]
MASK = (32, 4, 64, 64)
PRODUCTS = [  # (m, n, k, a read transposed, b read transposed)
    (1024, 64, 64, False, True), (1024, 64, 64, False, False), (64, 64, 1024, True, False),      # ViT: projections
    (1024, 128, 64, False, True), (1024, 64, 128, False, False), (128, 64, 1024, True, False),   # its MLP
    (2048, 256, 64, False, True), (2048, 64, 256, False, False), (256, 64, 2048, True, False),   # char_lm
    (64, 800, 500, False, False), (500, 800, 64, True, False),                                   # LeNet's fc1
    (64, 500, 800, False, True), (500, 50, 4096, False, True),      # ... its forward, its second filter gradient
    (64, 64, 2048, True, False),                                                                 # a deep one
    (4096, 9216, 16, True, False),                                       # AlexNet's fc6 weight gradient, batch 16
    (16, 4096, 9216, False, True)]                                       # ... and its forward: dot products
TRANSPOSES = [(64, 16, 4, 16), (64, 4, 16, 16), (32, 64, 4, 16)]                  # axes 1 and 2 swapped
ATTENTION = [((64, 4), 16, 16, False, None), ((32, 4), 16, 16, True, 0.9),       # (units, tokens, features, causal,
             ((32, 4), 64, 16, True, None), ((32, 4), 64, 16, True, 0.9)]      # keep)
BIAS_SUMS = [(1024, 64), (2048, 128)]                                            # (rows, columns) to (columns,)
GLOBAL_POOLS = [(16, 1280, 4), (8, 2048, 7), (32, 2048, 7)]                       # (samples, channels, plane side)


class _InBlocks:
    """The compiled kernels as they weighed attention before units were weighed whole: on blocks of units."""

    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def attention_units(self, *args) -> bool:
        return False

    def attention_units_grad(self, *args) -> bool:
        return False


def _library(tmp: Path, avx2: bool):
    from deepdsl_runtime.cpu import native

    for suffix in (".c", ".py"):
        shutil.copy(ROOT / "generated" / f"char_lm{suffix}", tmp / f"char_lm{suffix}")
    path, why = native.build_library(tmp / "char_lm.c")
    if path is None:
        sys.exit(f"cannot build the kernels: {why}")
    lib, why = native.load(tmp / "char_lm.py")
    if lib is None or not lib.products:
        sys.exit(f"cannot load the kernels or their products: {why or 'no CBLAS sgemm'}")
    if avx2:                    # the generic kernels again, built without AVX-512
        import ctypes
        import subprocess

        generic = tmp / "generic_avx2.so"
        subprocess.run(native.compile_command(native.KERNELS_DIR / native.GENERIC_SOURCE, generic) +
                       ["-mno-avx512f"], check=True, capture_output=True)
        lib = native.Native(ctypes.CDLL(str(generic)), lib.program)
    return lib


def _product(kernels, a, b, out, workspace) -> None:
    """out = a @ b as a program's matmul computes it given its planned workspace (cut in depth where the BLAS
    computes it and `contract.product_depth_cut` cuts it)."""
    if not kernels.gemm_in_depth(a, b, out, workspace):
        kernels.gemm(a, b, out)


def _cases(lib):
    """(name, before, after, agree) for each case: two calls and a check of their results."""
    from deepdsl_runtime import contract, cpu
    from deepdsl_runtime.cpu import masks, native, pool, shape as shapes

    rng = np.random.default_rng(0)
    drawn = [np.empty(MASK, np.uint8) for _ in range(2)]
    scratch = np.empty(contract.bernoulli_scratch(MASK) * MASK[0], np.float32)
    cases = [(f"mask {'x'.join(map(str, MASK))}",
              lambda: masks.bernoulli(out=drawn[0], shape=MASK, keep=0.9, key=1, seed=0, step=3, workspace=scratch),
              lambda: masks.bernoulli(out=drawn[1], shape=MASK, keep=0.9, key=1, seed=0, step=3, native=lib),
              lambda: np.array_equal(drawn[0], drawn[1]))]
    blas = native.Native(lib.lib, lib.program)
    blas.tiles = False
    for m, n, k, ta, tb in PRODUCTS:
        a = rng.standard_normal((k, m)).astype(np.float32).T if ta else rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((n, k)).astype(np.float32).T if tb else rng.standard_normal((k, n)).astype(np.float32)
        outs = [np.empty((m, n), np.float32) for _ in range(2)]
        workspace = np.empty(contract.product_depth_scratch(1, m, n, k, ta, tb), np.float32)
        how = "dot" if contract.dot_product(m, n, k, ta, tb, lib.lanes) else \
            "tiles" if contract.small_product(m, n, k, ta, tb, lib.lanes) else "sgemm"

        def agree(outs=outs, k=k):
            return np.allclose(outs[0], outs[1], rtol=0, atol=np.sqrt(k) * 1e-6 * np.abs(outs[0]).max())
        cases.append((f"{m}x{k}{'T' * ta} by {k}x{n}{'T' * tb}, {how}",
                      lambda a=a, b=b, o=outs[0], w=workspace: _product(blas, a, b, o, w),
                      lambda a=a, b=b, o=outs[1], w=workspace: _product(lib, a, b, o, w), agree))
    for shape in TRANSPOSES:
        x = rng.standard_normal(shape).astype(np.float32)
        outs = [np.empty((shape[0], shape[2], shape[1], shape[3]), np.float32) for _ in range(2)]
        cases.append((f"transpose {'x'.join(map(str, shape))}",
                      lambda x=x, o=outs[0]: shapes.transpose(x, out=o, axes=(1, 2)),
                      lambda x=x, o=outs[1]: shapes.transpose(x, out=o, axes=(1, 2), native=lib),
                      lambda outs=outs: np.array_equal(outs[0], outs[1])))
    for lead, t, d, causal, keep in ATTENTION:
        q, k, v, g = (rng.standard_normal((*lead, t, d)).astype(np.float32) for _ in range(4))
        attrs = {"scale": d ** -0.5, "causal": causal}
        if keep is not None:
            attrs.update(keep=keep, mask=(rng.random((*lead, t, t)) < keep).astype(np.uint8))
        units = int(np.prod(lead))
        spaces = [np.empty(units * contract.attention_scratch(t, t), np.float32),
                  np.empty(units * contract.attention_grad_scratch(t, t, d, d, keep is not None), np.float32)]
        outs = [[np.empty_like(q), np.empty(4 * q.size, np.float32)] for _ in range(2)]

        def weigh(kernels, out, q=q, k=k, v=v, g=g, attrs=attrs, spaces=spaces):
            cpu.attention(q, k, v, out=out[0], workspace=spaces[0], gemm=lib.gemm, native=kernels, **attrs)
            cpu.attention_grad(q, k, v, out[0], g, out=out[1][:3 * q.size], workspace=spaces[1], gemm=lib.gemm,
                               native=kernels, **attrs)

        def agree(outs=outs):
            return all(np.allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(a).max()) for a, b in zip(*outs))
        cases.append((f"attention {'x'.join(map(str, (*lead, t, d)))}{'' if keep is None else ' dropped'}",
                      lambda w=weigh, o=outs[0]: w(_InBlocks(lib), o), lambda w=weigh, o=outs[1]: w(lib, o), agree))
    for rows, columns in BIAS_SUMS:
        x = rng.standard_normal((rows, columns)).astype(np.float32)
        outs = [np.empty((columns,), np.float32) for _ in range(2)]

        def agree(outs=outs, rows=rows):
            return np.allclose(outs[0], outs[1], rtol=0, atol=np.sqrt(rows) * 1e-6 * np.abs(outs[0]).max())
        cases.append((f"bias sum {rows}x{columns}", lambda x=x, o=outs[0]: shapes.sum_to(x, out=o, shape=o.shape),
                      lambda x=x, o=outs[1]: shapes.sum_to(x, out=o, shape=o.shape, native=lib), agree))
    for n, c, side in GLOBAL_POOLS:
        x = rng.standard_normal((n, c, side, side)).astype(np.float32)
        g = rng.standard_normal((n, c, 1, 1)).astype(np.float32)
        outs = [(np.empty_like(g), np.empty_like(x)) for _ in range(2)]

        def average(kernels, out, x=x, g=g, side=side):
            pool.avg_pool(x, out=out[0], kernel=side, stride=side, native=kernels)
            pool.avg_pool_bwd(g, out=out[1], kernel=side, stride=side, size=(side, side), native=kernels)
        cases.append((f"global average pool {n}x{c}x{side}x{side}", lambda o=outs[0], a=average: a(None, o),
                      lambda o=outs[1], a=average: a(lib, o),
                      lambda outs=outs: all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                                            for a, b in zip(*outs))))
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native")
    args = parser.parse_args(argv)
    avx2 = args.isa == "avx2"
    if avx2 and os.environ.get("OPENBLAS_CORETYPE") != "Haswell":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OPENBLAS_CORETYPE": "Haswell"})
    name, isa = processor()
    if avx2 and isa == "AVX-512":
        isa = "AVX-512, every side restricted to AVX2"
    print(f"{name} ({isa}); load average before: {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        lib = _library(Path(tmp), avx2)
        cases = _cases(lib)
        print_row(["case", "threads", "before ms", "after ms", "ratio", "agree"], args.markdown, 24, header=True)
        for threads in args.threads:
            lib.set_threads(threads)
            times = {name: ([], []) for name, *_ in cases}
            for _ in range(args.rounds):
                for name, before, after, _ in cases:
                    for side, call in enumerate((before, after)):
                        call()                                      # untimed: caches, the team of threads
                        for _ in range(args.calls):
                            began = time.perf_counter()
                            call()
                            times[name][side].append(time.perf_counter() - began)
            for name, _, _, agree in cases:
                was, now = (statistics.median(t) * 1e3 for t in times[name])
                print_row([name, str(threads), f"{was:.3f}", f"{now:.3f}", f"{was / now:.2f}x",
                           "yes" if agree() else "NO"], args.markdown, 24)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
