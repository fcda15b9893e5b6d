"""A network's convolution layers one by one: deepdsl's kernels on the im2col path, sample by sample in the
products' tiles (`contract.tiled_conv`, those layers only), deepdsl's direct kernels on channel-blocked copies
(`contract.blocked_conv`, those layers only), its Winograd kernels on them (`contract.winograd_conv`, those layers
only) and PyTorch's on the same shapes, side by side.

    python benchmarks/conv_layers.py [--network resnet50] [--batch 8] [--image 112] [--threads 1 2] [--rounds 3]
                                     [--calls 5] [--isa native|avx2] [--winograd-chunk-mib MIB] [--markdown]

The network (a file of networks/) is compiled at that batch and image size (`--image 0`: the network's own), and its
compiled kernels are built; each distinct convolution of its training step (forward, input gradient, filter
gradient) runs under the workspace its memory plan gives it; grouped ones (depthwise: MobileNet-v2's) run in the
"im2col" column on the kernels the runtime gives them (depthwise: plane by plane, or a vector's channels at a
time). Per thread count (the kernels' and PyTorch's), `--rounds` rounds alternate the three sides, `--calls` timed
calls each after one untimed; the table gives the median milliseconds over all calls, GFLOP/s, and PyTorch's time
over ours (above 1: we are faster). PyTorch
(`torch.nn.functional.conv2d` and `torch.ops.aten.convolution_backward` with one output mask at a time) runs where
it is installed; its CPU convolutions are oneDNN's. The processor's vector ISA and the load average are printed.

`--isa avx2` runs every side as on a processor without AVX-512 (on one that has it): the compiled kernels built
with `-mno-avx512f` (DEEPDSL_CFLAGS), OpenBLAS on its Haswell kernels (OPENBLAS_CORETYPE), oneDNN and PyTorch's own
kernels on AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), MKL too (MKL_ENABLE_INSTRUCTIONS); the process starts
again with those set before numpy and torch load (`timing.AVX2_ENV`). The last lines say which vector extensions
PyTorch's libraries report they ran on (`timing.torch_isa`).

`--winograd-chunk-mib` sets `contract.WINOGRAD_CHUNK_BYTES` for the run (the plan's workspaces and the kernels'
chunks alike): the Winograd column with other chunks of samples.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from deepdsl_runtime import contract  # noqa: E402
from deepdsl_runtime.cpu import conv, native  # noqa: E402

# (benchmarks/ is on the path)
from timing import add_isa_option, load_average, print_row, torch_isa, vector_isa  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIRECTIONS = ("conv2d", "conv2d_bwd_data", "conv2d_bwd_filter")


def layers(network: str, batch: int, image: int | None, directory: Path):
    """(the compiled kernels, [(node, planned workspace floats, statements), ...]) for the distinct convolutions of
    the network's training step (the kernels built with $DEEPDSL_CFLAGS, which `--isa avx2` sets)."""
    import deepdsl
    from deepdsl.codegen import write_program
    from deepdsl.codegen.native import build_library
    from deepdsl.dsl import Overrides
    from deepdsl.ssa import Let

    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / f"{network}.py"),
                                            Overrides(batch=batch, image=(image, image) if image else None)))
    path = directory / f"{compiled.name}.py"
    write_program(compiled, path)
    build_library(path.with_suffix(".c"))
    kernels, why = native.load(path)
    if kernels is None:
        raise SystemExit(f"no compiled kernels: {why}")
    found: dict = {}
    for step in compiled.steps["train"].plan.steps:
        node = step.instr.node if isinstance(step.instr, Let) else None
        if node is None or node.op not in DIRECTIONS:
            continue
        key = (node.op, node.shape, tuple(i.shape for i in node.inputs), node.attrs)
        if key not in found:
            found[key] = [node, step.workspace // 4, 0]
        found[key][2] += 1
    return kernels, [tuple(v) for v in found.values()]


def flops(node) -> int:
    from deepdsl.ops import get_op

    return get_op(node.op).flops(node)


def geometry(node):
    """(x shape, w shape, stride, pad) of a convolution node of any direction."""
    a, b = node.inputs[:2]
    x, w = {"conv2d": (a.shape, b.shape), "conv2d_bwd_data": (node.shape, b.shape),
            "conv2d_bwd_filter": (b.shape, node.shape)}[node.op]
    return x, w, node.attr("stride", 1), node.attr("pad", 0)


def sides(node, size, kernels, threads):
    """{side: call} for the node: "im2col", "tiles" (where `contract.tiled_conv` takes it), "blocked" (where
    `contract.blocked_conv` takes it: the direct sums; and a thin filter gradient, `contract.thin_filter`, from the
    blocked output gradient), "winograd" (where `contract.winograd_conv` takes it), "torch"."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(i.shape).astype(np.float32) for i in node.inputs]
    out = np.empty(node.shape, np.float32)
    workspace = np.empty(max(size, 1), np.float32)
    run = getattr(conv, node.op)

    def ours(blocked: bool, tiled: bool, winograd: bool = False):
        def call():
            kernels.blocked, kernels.tiled_convs, kernels.winograd = blocked, tiled, winograd
            kernels.thin_filters = blocked and kernels.thin_filter_kernels
            run(*arrays, out=out, workspace=workspace, gemm=kernels.gemm, native=kernels, **node.kwargs)
        return call

    x_shape, w_shape, stride, pad = geometry(node)
    groups = node.attr("groups", 1)
    calls = {"im2col": ours(False, False)}
    wo = (node.inputs[0] if node.op != "conv2d" else node).shape[3]
    ho = (node.inputs[0] if node.op != "conv2d" else node).shape[2]
    thin = node.op == "conv2d" and contract.direct_conv(x_shape[1], w_shape[2], w_shape[3], stride, groups)
    if kernels.tiles and node.op != "conv2d_bwd_filter" and not thin and contract.tiled_conv(
            x_shape[1], w_shape[0], w_shape[2], w_shape[3], stride, pad, ho, wo, groups, op=node.op):
        calls["tiles"] = ours(False, True)
    if groups == 1 and contract.blocked_conv(x_shape[1], w_shape[0], w_shape[2], w_shape[3], stride, pad, wo,
                                             op=node.op, lanes=kernels.lanes) or \
            node.op == "conv2d_bwd_filter" and kernels.thin_filter_kernels and contract.thin_filter(
                x_shape[1], w_shape[0], w_shape[2], w_shape[3], stride, pad, groups):
        calls["blocked"] = ours(True, True)
    if groups == 1 and kernels.winograd_kernels and contract.winograd_conv(
            x_shape[1], w_shape[0], w_shape[2], w_shape[3], stride, pad, wo, op=node.op):
        calls["winograd"] = ours(True, True, True)      # (also filter gradients the direct sums leave to im2col)
    try:
        import torch
    except ImportError:
        return calls
    torch.set_num_threads(threads)
    t = [torch.from_numpy(a) for a in arrays]
    if node.op == "conv2d":
        calls["torch"] = lambda: torch.nn.functional.conv2d(t[0], t[1], stride=stride, padding=pad, groups=groups)
    else:
        g = t[0]
        xt = torch.from_numpy(rng.standard_normal(x_shape).astype(np.float32))
        wt = torch.from_numpy(rng.standard_normal(w_shape).astype(np.float32))
        mask = [node.op == "conv2d_bwd_data", node.op == "conv2d_bwd_filter", False]
        calls["torch"] = lambda: torch.ops.aten.convolution_backward(
            g, xt, wt, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], groups, mask)
    return calls


def network_options(parser, rounds: int) -> None:
    """The options of a script that times a network's layers (`layers`): --network, --batch, --image, --threads and
    --rounds (by default `rounds`)."""
    parser.add_argument("--network", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image", type=int, default=112, help="height and width; 0: the network's own")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    network_options(parser, rounds=3)
    parser.add_argument("--calls", type=int, default=5)
    add_isa_option(parser)
    parser.add_argument("--winograd-chunk-mib", type=int, help="contract.WINOGRAD_CHUNK_BYTES in MiB for this run")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.winograd_chunk_mib:
        contract.WINOGRAD_CHUNK_BYTES = args.winograd_chunk_mib << 20
    print(f"{vector_isa(args.isa)}; load average before: {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        kernels, found = layers(args.network, args.batch, args.image, Path(tmp))
        print(f"{args.network} batch {args.batch} image {args.image}: {len(found)} distinct convolutions; "
              f"ms (GFLOP/s); ratios are PyTorch's time over ours")
        print_row(["op", "shapes", "calls", "threads", "im2col", "tiles", "blocked", "winograd", "torch",
                   "torch / best ours"],
                  args.markdown, 12, header=True)
        totals = {}
        for threads in args.threads:
            kernels.set_threads(threads)
            native.set_blas_threads(1)
            for node, size, count in found:
                calls = sides(node, size, kernels, threads)
                times = {side: [] for side in calls}
                for _ in range(args.rounds):
                    for side, call in calls.items():
                        call()
                        for _ in range(args.calls):
                            began = time.perf_counter()
                            call()
                            times[side].append(time.perf_counter() - began)
                ms = {side: statistics.median(v) * 1000 for side, v in times.items()}
                best = min(v for k, v in ms.items() if k != "torch")
                ms.setdefault("tiles", ms["im2col"])          # (the im2col path where the layer is not tiled,
                ms.setdefault("blocked", ms["tiles"])         # then the tiles' where it is not blocked,
                ms.setdefault("winograd", ms["blocked"])      # the direct sums' where Winograd does not take it)
                for side, value in ms.items():
                    totals[threads, side] = totals.get((threads, side), 0.0) + count * value
                totals[threads, "best"] = totals.get((threads, "best"), 0.0) + count * best
                gf = flops(node) / 1e6
                cell = lambda side: f"{ms[side]:.2f} ({gf / ms[side]:.0f})" if side in calls else "-"
                shapes = " ".join("x".join(map(str, i.shape)) for i in node.inputs[:2])
                print_row([node.op, shapes, str(count), str(threads), cell("im2col"), cell("tiles"), cell("blocked"),
                           cell("winograd"), cell("torch"), f"{ms['torch'] / best:.2f}" if "torch" in ms else "-"],
                          args.markdown, 12)
            kernels.blocked, kernels.tiled_convs, kernels.winograd = True, True, kernels.winograd_kernels
            kernels.thin_filters = kernels.thin_filter_kernels
        for threads in args.threads:
            parts = [f"im2col only {totals[threads, 'im2col']:.1f}",
                     f"tiles where taken {totals[threads, 'tiles']:.1f}",
                     f"then blocked where taken {totals[threads, 'blocked']:.1f}",
                     f"then Winograd where taken {totals[threads, 'winograd']:.1f}",
                     f"the faster of ours {totals[threads, 'best']:.1f}"]
            if (threads, "torch") in totals:
                parts.append(f"torch {totals[threads, 'torch']:.1f} "
                             f"({totals[threads, 'torch'] / totals[threads, 'best']:.2f}x ours)")
            print(f"the step's convolutions (each distinct one times its statements) at {threads} thread(s), ms: "
                  + ", ".join(parts))
    try:
        print(f"PyTorch's kernels ran on: {torch_isa()}")
    except ImportError:
        pass
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
