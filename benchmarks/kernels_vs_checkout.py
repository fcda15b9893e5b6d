"""This checkout's compiled CPU kernels against another checkout's, alternating in one process: the im2col, col2im
and axis-swap kernels, products, depthwise convolutions, pointwise filter gradients, dropout's masks, layer norms,
attention and Winograd convolutions alone, or whole training steps of a network.

    python benchmarks/kernels_vs_checkout.py --against OTHER [--threads 1 2] [--rounds 5] [--calls 15] [--kernels ...]
    python benchmarks/kernels_vs_checkout.py --against OTHER --network lenet:64 [--threads 1] [--rounds 8] [--steps 12]

OTHER is the root of another checkout (`git worktree add /tmp/other REV`). Kernels: `runtime/kernels/cpu_ops.c` of
each is built into a library of its own (this checkout's build flags); per thread count and geometry (N, C, H=W,
kernel, pad, stride; for the swap (A, B, inner); for a product (m, k, n), by `Native.gemm` on each library; for a
depthwise convolution (N, C, H=W, stride), 3x3 with padding 1, its forward, input and filter gradients; for a
pointwise convolution's filter gradient (N, O, C, H=W), `Native.pointwise_filter`; for a mask (shape, keep),
`masks.bernoulli`; for a layer norm (rows, features), its forward with a weight and a bias, its input gradient and
its weight's and bias's gradients; for attention (N, H, T, features, causal, keep), its forward and gradient on heads
read in place, `Native.attention_units`), the median microseconds of `--calls` calls, medians over `--rounds` rounds
that alternate the two libraries, their ratio (this / other), and a check that both give the same bits.
`--kernels` times the families named (copies, swaps, products, depthwise, pointwise, masks, layer_norm, attention,
winograd: ResNet-50's 3x3 layers' forward, input and filter gradients by Winograd's transforms through
runtime/cpu/conv.py, each in the workspace a program plans for it).
Networks: each checkout renders the network's `<program>.c` (its elementwise kernels and its generic ones,
`deepdsl compile` run with that checkout on the path) and it is built against that checkout's kernels; the program
of this checkout then runs its training step with each library in turn, `--steps` steps a round (the first
untimed): the median milliseconds per round and the median ratio. (The other library must have the functions this
checkout's runtime calls.) The load average is printed before and after; idle threads sleep as in the generated
program.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from deepdsl.codegen.native import compile_command  # noqa: E402
from deepdsl_runtime import cpu  # noqa: E402
from deepdsl_runtime.cpu import native  # noqa: E402

from op_profile import _compile, _model  # noqa: E402  (benchmarks/ is on the path of a script run from it)
from timing import load_average, median_ms, timed_steps  # noqa: E402

GEOMETRIES = [  # (N, C, H=W, kernel, pad, stride): ResNet-50's 3x3 layers at 112x112 (a chunk of 8), LeNet's,
    # AlexNet's; ResNet-50's first layer (a chunk of 4) and its strided pointwise layers
    (8, 256, 7, 3, 1, 1), (8, 512, 4, 3, 1, 1), (8, 128, 14, 3, 1, 1), (8, 64, 28, 3, 1, 1), (64, 20, 12, 5, 0, 1),
    (64, 1, 28, 5, 0, 1), (1, 256, 27, 5, 2, 1), (4, 256, 13, 3, 1, 1), (4, 3, 112, 7, 3, 2), (8, 256, 28, 1, 0, 2),
    (1, 3, 227, 11, 0, 4),
]
SWAPS = [(8, 1024, 49), (1024, 8, 49), (8, 2048, 16), (8, 512, 196), (8, 256, 784), (64, 50, 64)]  # (A, B, inner)
PRODUCTS = [  # (m, k, n, the operand read transposed): ResNet-50's pointwise layers at 112x112 (batch 8) on 7x7 and
    # 4x4 planes, forward and ("aT": the filters') input gradients, the ViT's (64 x 16 tokens), its weight gradients and
    # ("bT": by the weights') projections, a character model's (32 x 64 tokens): products of the kernels' tiles
    # (`contract.small_product`) or the sgemm's parts, as `Native.gemm` takes them
    (256, 1024, 392, ""), (1024, 256, 392, ""), (2048, 512, 128, ""), (512, 2048, 128, ""), (1024, 64, 64, ""),
    (1024, 64, 128, ""), (256, 1024, 392, "aT"), (1024, 256, 392, "aT"), (64, 1024, 128, "aT"), (1024, 64, 64, "bT"),
    (2048, 64, 256, "bT"),
]
DEPTHWISE = [  # (N, C, H=W, stride): MobileNet-v2's 3x3 depthwise layers at 112x112 (batch 16), stride-1 planes
    # widened (28x28, 56x56) and a vector's channels at a time (7x7, 4x4, strided)
    (16, 144, 28, 1), (16, 96, 56, 2), (16, 384, 7, 1), (16, 32, 56, 1), (16, 960, 4, 1), (16, 144, 28, 2),
]
ATTENTION = [  # (N, H, t, features, causal, keep): a ViT's heads (64 x 16 tokens at 64 features, 4 heads), a
    # character model's (32 x 64 causal tokens), causal heads of 16 and of 64 tokens with a tenth of their weights
    # dropped, weighed unit by unit (`Native.attention_units`), heads read in place from the projections' (N, t, H, features) layout
    (64, 4, 16, 16, False, None), (32, 4, 64, 16, True, None), (32, 4, 16, 16, True, 0.9),
    (32, 4, 64, 16, True, 0.9),
]
MASKS = [  # (shape, keep): dropout's masks of a character model's attention (32 x 4 heads of 64 x 64 weights) and of
    # a ViT's (64 x 4 heads of 16 x 16), one of an odd size (a last partial block of groups)
    ((32, 4, 64, 64), 0.9), ((64, 4, 16, 16), 0.9), ((1000, 17), 0.5),
]
LAYER_NORMS = [  # (rows, features): a ViT's (64 x 16 tokens of 64), a character model's (32 x 64 tokens of 64), rows
    # of 100 (not whole vectors of 16); the forward with a weight and a bias, the input gradient, the weight's and
    # bias's gradients
    (1024, 64), (2048, 64), (500, 100),
]
POINTWISE_FILTERS = [  # (N, O, C, H=W): MobileNet-v2's filter gradients of thin pointwise layers at 112x112 (batch
    # 16), `contract.pointwise_filter`'s: a sample's rows past the chunk's cap, a little (28x28) and by far (56x56)
    (16, 144, 24, 28), (16, 24, 144, 28), (16, 96, 16, 56), (16, 192, 32, 14),
]


_BUILT: dict[str, Path] = {}        # the libraries built in this run, by the digest of what they are built from


def _build(source: Path, include: Path, target: Path) -> native.Native:
    """The library of `source` built as `deepdsl compile` builds one, its runtime kernels found first in `include`;
    a program's with the generic kernels' library built from `include` beside it, unless the program's C file
    includes them itself (a checkout from before they were one library that programs share). A library of the same
    sources as one built before in this run (a checkout against itself) is a copy of it, loaded on its own."""
    def built(c: Path, library: Path) -> ctypes.CDLL:
        digest = hashlib.sha256(c.read_bytes())
        for kernel in sorted(include.glob("*.[ch]")):
            digest.update(kernel.name.encode() + kernel.read_bytes())
        earlier = _BUILT.get(digest.hexdigest())
        if earlier is not None and earlier.exists():
            shutil.copyfile(earlier, library)
        else:
            command = compile_command(c, library)
            command[1:1] = ["-I", str(include)]         # searched before the runtime's own kernels directory
            subprocess.run(command, check=True)
            _BUILT[digest.hexdigest()] = library
        return ctypes.CDLL(str(library))

    lib = built(source, target)
    if source.name == native.GENERIC_SOURCE or f'#include "{native.GENERIC_SOURCE}"' in source.read_text():
        return native.Native(lib)
    return native.Native(built(include / native.GENERIC_SOURCE, target.with_name(f"{target.stem}-generic.so")), lib)


def _alternating(libs: dict, rounds: int, call, calls: int = 15) -> dict:
    """Per library, the median over `rounds` alternating rounds of the median microseconds of `calls` calls of
    `call(name, lib)`."""
    times = {name: [] for name in libs}
    for _ in range(rounds):
        for name, lib in libs.items():
            times[name].append(1000 * median_ms(lambda: call(name, lib), calls))
    return {name: statistics.median(values) for name, values in times.items()}


def _cell(times: dict) -> str:
    return f"{times['this']:8.0f} / {times['other']:<8.0f} ({times['this'] / times['other']:.2f})"


def _copies(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    for n, c, h, k, pad, stride in GEOMETRIES:
        ho = (h + 2 * pad - k) // stride + 1
        x = rng.standard_normal((n, c, h, h), dtype=np.float32)
        grads = rng.standard_normal((c, k, k, n, ho, ho), dtype=np.float32)
        cols = {name: np.full(grads.shape, np.nan, np.float32) for name in libs}
        dx = {name: np.full(x.shape, np.nan, np.float32) for name in libs}
        gradient = grads.transpose(3, 0, 1, 2, 4, 5)
        im2col = _alternating(libs, rounds, lambda name, lib: lib.im2col(
            x, cols[name].transpose(3, 0, 1, 2, 4, 5), stride, pad), calls)
        col2im = _alternating(libs, rounds, lambda name, lib: lib.col2im(gradient, dx[name], stride, pad), calls)
        same = np.array_equal(cols["this"], cols["other"]) and np.array_equal(dx["this"], dx["other"])
        _row(t, (n, c, h, k, pad, stride), 22, [im2col, col2im], same)


def _swaps(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    for shape in SWAPS:
        src = rng.standard_normal(shape, dtype=np.float32)
        out = {name: np.full((shape[1], shape[0], shape[2]), np.nan, np.float32) for name in libs}
        swap = _alternating(libs, rounds, lambda name, lib: lib.swap01(src, out[name]), calls)
        _row(t, shape, 20, [swap], np.array_equal(out["this"], out["other"]))


def _products(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    for m, k, n, transposed in PRODUCTS:
        a = rng.standard_normal((k, m), dtype=np.float32).T if transposed == "aT" else \
            rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((n, k), dtype=np.float32).T if transposed == "bT" else \
            rng.standard_normal((k, n), dtype=np.float32)
        out = {name: np.full((m, n), np.nan, np.float32) for name in libs}
        product = _alternating(libs, rounds, lambda name, lib: lib.gemm(a, b, out[name]), calls)
        _row(t, f"{(m, k, n)} {transposed}".rstrip(), 20, [product], np.array_equal(out["this"], out["other"]))


def _depthwise(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    for n, c, h, stride in DEPTHWISE:
        ho = (h + 2 - 3) // stride + 1
        x = rng.standard_normal((n, c, h, h), dtype=np.float32)
        w = rng.standard_normal((c, 1, 3, 3), dtype=np.float32)
        g = rng.standard_normal((n, c, ho, ho), dtype=np.float32)
        cells, same = [], True
        for op, a, b, shape in (("conv2d", x, w, g.shape), ("conv2d_bwd_data", g, w, x.shape),
                                ("conv2d_bwd_filter", g, x, w.shape)):
            out = {name: np.full(shape, np.nan, np.float32) for name in libs}
            cells.append(_alternating(libs, rounds, lambda name, lib: lib.depthwise(
                op, a, b, None, out[name], stride, 1), calls))
            same = same and np.array_equal(out["this"], out["other"])
        _row(t, (n, c, h, stride), 22, cells, same)


def _pointwise_filters(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    for n, o, c, h in POINTWISE_FILTERS:
        g = rng.standard_normal((n, o, h, h), dtype=np.float32)
        x = rng.standard_normal((n, c, h, h), dtype=np.float32)
        out = {name: np.full((o, c, 1, 1), np.nan, np.float32) for name in libs}
        gradient = _alternating(libs, rounds, lambda name, lib: lib.pointwise_filter(g, x, out[name]), calls)
        _row(t, (n, o, c, h), 29, [gradient], np.array_equal(out["this"], out["other"]))


def _attention(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    for n, heads, tokens, features, causal, keep in ATTENTION:
        shape = (n, tokens, heads, features)
        q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
        mask = None if keep is None else (rng.random((n * heads, tokens, tokens)) < keep).astype(np.uint8)
        scale = 1.0 / features ** 0.5
        out = {name: np.full(shape, np.nan, np.float32) for name in libs}
        grads = {name: [np.full(shape, np.nan, np.float32) for _ in range(3)] for name in libs}
        forward = _alternating(libs, rounds, lambda name, lib: lib.attention_units(
            q, k, v, None, mask, keep or 1.0, out[name], scale, causal, heads=True), calls)
        gradient = _alternating(libs, rounds, lambda name, lib: lib.attention_units_grad(
            q, k, v, out["this"], g, None, mask, keep or 1.0, *grads[name], scale, causal, heads=True), calls)
        same = all(np.array_equal(x, y) for x, y in zip([out["this"], *grads["this"]], [out["other"], *grads["other"]]))
        _row(t, (n, heads, tokens, features, causal, keep), 30, [forward, gradient], same)


def _masks(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    from deepdsl_runtime.cpu import masks

    for shape, keep in MASKS:
        out = {name: np.full(shape, 7, np.uint8) for name in libs}
        drawn = _alternating(libs, rounds, lambda name, lib: masks.bernoulli(
            out=out[name], shape=shape, keep=keep, key=1, seed=5, step=3, native=lib), calls)
        _row(t, (shape, keep), 24, [drawn], np.array_equal(out["this"], out["other"]))


def _layer_norms(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    from deepdsl_runtime import contract

    for rows, features in LAYER_NORMS:
        x, g = (rng.standard_normal((rows, features), dtype=np.float32) for _ in range(2))
        w, b = (rng.standard_normal(features, dtype=np.float32) for _ in range(2))
        space = np.empty(contract.layer_norm_param_scratch(rows, features), np.float32)
        cells, same = [], True
        for shape, call in (((rows, features), lambda lib, o: lib.layer_norm(x, (w, b), o, 1e-5, 1)),
                            ((rows, features), lambda lib, o: lib.layer_norm_grad(x, g, (w,), o, 1e-5, 1)),
                            ((2, features), lambda lib, o: lib.layer_norm_param_grad(x, g, o, space, 1e-5, 1))):
            out = {name: np.full(shape, np.nan, np.float32) for name in libs}
            cells.append(_alternating(libs, rounds, lambda name, lib: call(lib, out[name]), calls))
            same = same and np.array_equal(out["this"], out["other"])
        _row(t, (rows, features), 14, cells, same)


def _winograd(libs: dict, t: int, rng, rounds: int, calls: int) -> None:
    """ResNet-50's 3x3 layers (GEOMETRIES' first four: 112x112, a chunk of 8) by Winograd's F(4x4, 3x3) where the
    kernels take them: forward, input and filter gradients through runtime/cpu/conv.py, each in the workspace a
    program plans for it under the default limit (`contract.winograd_scratch`, `winograd_samples`)."""
    from deepdsl.pipeline import DEFAULT_WORKSPACE_LIMIT
    from deepdsl_runtime import contract
    from deepdsl_runtime.cpu import conv

    room = DEFAULT_WORKSPACE_LIMIT // contract.FLOAT_BYTES
    for n, c, h, k, pad, stride in GEOMETRIES[:4]:
        x, g = (rng.standard_normal((n, c, h, h), dtype=np.float32) for _ in range(2))
        w = rng.standard_normal((c, c, k, k), dtype=np.float32)
        cells, same = [], True
        directions = (("conv2d", x, w, g.shape, {}), ("conv2d_bwd_data", g, w, x.shape, {"size": (h, h)}),
                      ("conv2d_bwd_filter", g, x, w.shape, {"kernel": (k, k)}))
        for op, a, b, shape, kwargs in directions:
            per_sample, once = contract.winograd_scratch(op, x.shape, w.shape, pad, room)
            workspace = np.empty(once + contract.winograd_samples(n, op, x.shape, w.shape, pad, room) * per_sample,
                                 np.float32)
            out = {name: np.full(shape, np.nan, np.float32) for name in libs}
            cells.append(_alternating(libs, rounds, lambda name, lib: getattr(conv, op)(
                a, b, out=out[name], workspace=workspace, gemm=lib.gemm, native=lib, stride=stride, pad=pad,
                **kwargs), calls))
            same = same and np.array_equal(out["this"], out["other"])
        _row(t, (n, c, h, k, pad, stride), 22, cells, same)


def _row(threads: int, what, width: int, cells: list[dict], same: bool) -> None:
    print(f"{threads:>7}  {str(what):<{width}} {'    '.join(_cell(c) for c in cells)}"
          f"{'' if same else '  RESULTS DIFFER'}")


FAMILIES = {  # name: (header, timing of one thread count)
    "copies": ("threads  geometry                 im2col this / other (us)    col2im this / other (us)", _copies),
    "swaps": ("threads  swap (A, B, inner)     this / other (us)", _swaps),
    "products": ("threads  product (m, k, n)      this / other (us)", _products),
    "depthwise": ("threads  depthwise (N, C, H, s)  forward this / other (us)    input gradient           filter "
                  "gradient", _depthwise),
    "pointwise": ("threads  pointwise filter (N, O, C, H)  this / other (us)", _pointwise_filters),
    "masks": ("threads  mask (shape, keep)       this / other (us)", _masks),
    "layer_norm": ("threads  layer norm    forward this / other (us)    input gradient           weight and bias "
                   "gradients", _layer_norms),
    "attention": ("threads  attention (N, H, t, d, causal, keep)  forward this / other (us)    gradient",
                  _attention),
    "winograd": ("threads  Winograd (N, C, H, k, p, s)  forward this / other (us)    input gradient           "
                 "filter gradient", _winograd),
}


def kernels(libs: dict, threads: list[int], rounds: int, calls: int = 15, families=tuple(FAMILIES)) -> None:
    rng = np.random.default_rng(0)
    for name in families:
        header, family = FAMILIES[name]
        print(header)
        for t in threads:
            for lib in libs.values():
                lib.set_threads(t)
            family(libs, t, rng, rounds, calls)


def _other_source(spec: str, other: Path, directory: Path) -> Path:
    """The `<program>.c` the checkout at `other` renders for network `spec`, its library's build finished (`deepdsl
    compile` starts one in the background; it would share the cores with the timed steps)."""
    runtime = directory / "path"
    runtime.mkdir()
    (runtime / "deepdsl_runtime").symlink_to(other / "runtime")
    name, batch, image = (spec.split(":") + ["", ""])[:3]
    program = directory / f"{name}.py"
    command = [sys.executable, "-m", "deepdsl", "compile", str(other / "networks" / f"{name}.py"), "-o", str(program)]
    command += (["--batch", batch] if batch else []) + (["--image", image] if image else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(runtime), str(other)]))
    done = subprocess.run(command, capture_output=True, text=True, cwd=other, env=env)
    if done.returncode != 0:
        raise SystemExit(f"compiling {spec} with {other}: {done.stdout.strip()} {done.stderr.strip()}")
    deadline = time.monotonic() + 300
    while any(directory.glob(".*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.2)
    return program.with_suffix(".c")


def steps(spec: str, other: Path, threads: list[int], rounds: int, count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        program = _compile(spec, Path(tmp))
        (Path(tmp) / "other").mkdir()
        sources = {"this": (program.with_suffix(".c"), native.KERNELS_DIR),
                   "other": (_other_source(spec, other, Path(tmp) / "other"), other / "runtime" / "kernels")}
        libs = {name: _build(source, include, Path(tmp) / f"{name}.so") for name, (source, include) in sources.items()}
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
                    times = timed_steps(lambda i: model.train_step(model.rt.asarray(x), model.rt.asarray(y), step=i,
                                                                   **hyper), 1, count - 1)
                    per_round[name].append(statistics.median(times) * 1000)
            ratio = statistics.median(a / b for a, b in zip(per_round["this"], per_round["other"]))
            for name, values in per_round.items():
                print(f"{spec} {t} thread(s), {name}: " + " ".join(f"{v:.1f}" for v in values)
                      + f" ms; median {statistics.median(values):.2f}")
            print(f"{spec} {t} thread(s): this / other, median over rounds {ratio:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True, help="the root of another checkout")
    parser.add_argument("--network", help="NET[:BATCH[:IMAGE]]: whole training steps instead of the kernels")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--calls", type=int, default=15, help="kernels: the calls a round times (their median)")
    parser.add_argument("--kernels", nargs="+", choices=list(FAMILIES), default=list(FAMILIES),
                        help="kernels: the families timed (all by default)")
    args = parser.parse_args()
    print(f"load average before: {load_average()}")
    if args.network:
        steps(args.network, args.against.resolve(), args.threads, args.rounds, args.steps)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            libs = {name: _build(directory / native.GENERIC_SOURCE, directory, Path(tmp) / f"{name}.so")
                    for name, directory in (("this", native.KERNELS_DIR),
                                            ("other", args.against.resolve() / "runtime" / "kernels"))}
            kernels(libs, args.threads, args.rounds, args.calls, args.kernels)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
