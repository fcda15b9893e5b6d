"""Winograd's filter gradients by pairs of channel blocks against the same layers by ranges of output blocks.

    python benchmarks/winograd_pairs.py [--network resnet50] [--batch 8] [--image 112] [--threads 1 2] [--rounds 7]
                                        [--isa native|avx2] [--all]

Each distinct 3x3 filter gradient of the network's training step that `contract.winograd_pairs` sends by pairs
(`--all`: every one Winograd takes) runs both ways, each under the workspace the plan gives that way, alternating call
by call (`--rounds` each, the first left out): by pairs (with `--all`, forced where the rule says otherwise:
`WINOGRAD_FEW_TILES` unbounded for the call), and by ranges (the rule held off: `WINOGRAD_PAIR_TILES`,
`WINOGRAD_PAIR_BYTES` and `WINOGRAD_FEW_TILES` 0 for the call; where the layer's rows are too short for the ranges,
im2col). Prints the medians, ranges / pairs (above 1 the pairs are faster), each way's workspace, and whether the two
gave the same bits (they do where the ranges take the whole batch at once).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from deepdsl_runtime import contract  # noqa: E402
from deepdsl_runtime.cpu import conv  # noqa: E402

# (benchmarks/ is on the path)
from conv_layers import geometry, layers, network_options  # noqa: E402
from timing import add_isa_option, load_average, vector_isa  # noqa: E402

RULE = ("WINOGRAD_PAIR_TILES", "WINOGRAD_PAIR_BYTES", "WINOGRAD_FEW_TILES")


@contextmanager
def rule(name: str):
    """The pairs' rule for "pairs" (any number of tiles) or "ranges" (never), for the plan's workspace and the
    kernels' choice alike."""
    saved = {constant: getattr(contract, constant) for constant in RULE}
    try:
        if name == "pairs":
            contract.WINOGRAD_FEW_TILES = 1 << 62
        else:
            for constant in RULE:
                setattr(contract, constant, 0)
        yield
    finally:
        for constant, value in saved.items():
            setattr(contract, constant, value)


def way(node, kernels, name: str):
    """(call, workspace floats, output) of the filter gradient `node` by pairs or by ranges (`rule`)."""
    from deepdsl.ops import get_op

    with rule(name):
        size = get_op(node.op).workspace(node, None).nbytes // 4
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(i.shape).astype(np.float32) for i in node.inputs]
    out, workspace = np.empty(node.shape, np.float32), np.empty(max(size, 1), np.float32)

    def call():
        with rule(name):
            conv.conv2d_bwd_filter(*arrays, out=out, workspace=workspace, gemm=kernels.gemm, native=kernels,
                                   **node.kwargs)
    return call, size, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    network_options(parser, rounds=7)
    parser.add_argument("--all", action="store_true", help="every Winograd filter gradient, not only the pairs'")
    add_isa_option(parser)
    args = parser.parse_args()
    print(f"{vector_isa(args.isa)}; load average before: {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        kernels, found = layers(args.network, args.batch, args.image, Path(tmp))
        if not kernels.winograd_pair_kernels:
            print("these kernels have no Winograd filter gradients by pairs")
            return 1
        kernels.blocked = kernels.tiled_convs = kernels.winograd = True
        print(f"{args.network} batch {args.batch} image {args.image}: ms, ranges / pairs (above 1 the pairs are "
              f"faster)")
        for node, _, count in found:
            x_shape, w_shape, stride, pad = geometry(node)
            if node.op != "conv2d_bwd_filter" or not contract.winograd_conv(
                    x_shape[1], w_shape[0], *w_shape[2:], stride, pad, x_shape[3], op=node.op):
                continue
            pairs = contract.winograd_pairs(node.op, x_shape, w_shape, pad)
            if not pairs and not args.all:
                continue
            ways = {name: way(node, kernels, name) for name in ("pairs", "ranges")}
            for threads in args.threads:
                kernels.set_threads(threads)
                times = {name: [] for name in ways}
                for k in range(args.rounds + 1):
                    for name in (list(ways) if k % 2 else list(ways)[::-1]):
                        start = time.perf_counter()
                        ways[name][0]()
                        times[name].append(time.perf_counter() - start)
                ms = {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}
                same = np.array_equal(ways["pairs"][2], ways["ranges"][2])
                print(f"{'x'.join(map(str, x_shape))} -> {w_shape[0]} channels ({count} a step, "
                      f"{'pairs' if pairs else 'not by pairs'}), {threads} thread(s): pairs {ms['pairs']:.2f} "
                      f"({ways['pairs'][1] * 4 / 2 ** 20:.1f} MiB), ranges {ms['ranges']:.2f} "
                      f"({ways['ranges'][1] * 4 / 2 ** 20:.1f} MiB), {ms['ranges'] / ms['pairs']:.2f}x, "
                      f"{'the same bits' if same else 'other bits'}", flush=True)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
