"""The training runtime's matrix products through the tiled multi-device GEMM (`--gemm-devices`, `--gemm-device-memory`,
`--gemm-tile`; `deepdsl_runtime.cpu.with_gemm`, `deepdsl_runtime.gemm.products.TiledProducts`).

Tiles sum the inner dimension in another order than one BLAS call, so results agree within float32 rounding, not
bit for bit. The expected figures come from numpy's own products (`np.matmul`), never from the tiled runs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.program_helpers import compile_program, import_program, model_class, run_cli

cpu = pytest.importorskip("deepdsl_runtime.cpu")
from deepdsl_runtime.gemm import TiledGemm  # noqa: E402
from deepdsl_runtime.gemm.products import TiledProducts, cpu_devices  # noqa: E402

TILE = 16
MEMORY = 64 << 10          # 64 KiB per device: 16 tiles of 16x16 float32, so large operands are out of core


def tiled(devices=2, memory=MEMORY, tile=TILE) -> TiledProducts:
    return TiledProducts(TiledGemm(cpu_devices(devices, memory), tile=tile))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class Counting:
    """np.matmul that records the shape of every product (what a tiled run must reproduce)."""

    def __init__(self):
        self.products: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, a, b, *, out):
        self.products.append((a.shape, b.shape, out.shape))
        np.matmul(a, b, out=out)

    def matrices(self) -> int:
        """Matrix products, a batched product counting one per matrix (one tiled GEMM each)."""
        return sum(int(np.prod(out[:-2])) for _, _, out in self.products)

    def output_bytes(self) -> int:
        return sum(4 * int(np.prod(out)) for _, _, out in self.products)


# ----------------------------------------------------------------------------------------------------------------
# each op that multiplies matrices, with the tiled products against numpy's

CONV = [
    # (N, C, H, W, O, k, stride, pad): small planes (one product per chunk, regrouped), large planes (one product
    # per sample), more filters than im2col rows (per sample), pointwise, strided (bwd data per sample)
    (3, 4, 9, 9, 6, 3, 1, 1),
    (2, 2, 20, 20, 5, 3, 1, 1),
    (2, 2, 8, 8, 7, 1, 2, 0),
    (2, 5, 6, 6, 3, 1, 1, 0),
    (3, 3, 11, 11, 4, 3, 2, 1),
]


@pytest.mark.parametrize("case", CONV)
def test_convolution_products_run_tiled(case):
    n, c, h, w, o, k, s, p = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((o, c, k, k)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    ho, wo = cpu.out_size(h, k, s, p), cpu.out_size(w, k, s, p)
    g = rng.standard_normal((n, o, ho, wo)).astype(np.float32)
    products = tiled()
    for name, args, kwargs, shape in [
        ("conv2d", (x, wt, b), dict(stride=s, pad=p), (n, o, ho, wo)),
        ("conv2d_bwd_data", (g, wt), dict(stride=s, pad=p, size=(h, w)), (n, c, h, w)),
        ("conv2d_bwd_filter", (g, x), dict(stride=s, pad=p, kernel=(k, k)), (o, c, k, k)),
    ]:
        fn = getattr(cpu, name)
        expected, got = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
        fn(*args, out=expected, **kwargs)
        calls = products.calls
        fn(*args, out=got, gemm=products, **kwargs)
        assert products.calls > calls, name
        assert rel_err(got, expected) < 1e-5, name


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_runs_tiled(ta, tb):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((40, 70) if ta else (70, 40)).astype(np.float32)
    b = rng.standard_normal((50, 40) if tb else (40, 50)).astype(np.float32)
    expected = (a.T if ta else a) @ (b.T if tb else b)
    out = np.full((70, 50), np.nan, np.float32)
    products = tiled()
    cpu.matmul(a, b, out=out, ta=ta, tb=tb, gemm=products)
    assert rel_err(out, expected) < 1e-5
    totals = products.totals()
    # 70x50 output in 16x16 tiles: 5 x 4 = 20 tiles, each written back once; every operand element copied in
    assert sum(totals["tasks_per_device"]) == 20 and totals["d2h_bytes"] == out.nbytes
    assert totals["h2d_bytes"] >= a.nbytes + b.nbytes and totals["flops"] == 2 * 70 * 40 * 50


def test_with_gemm_routes_every_product_and_nothing_else():
    counting = Counting()
    rt = cpu.with_gemm(counting)
    for name in cpu.__all__:
        assert hasattr(rt, name), name
    x = np.ones((2, 3, 5, 5), np.float32)
    rt.conv2d(x, np.ones((4, 3, 3, 3), np.float32), out=np.empty((2, 4, 3, 3), np.float32))
    rt.matmul(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), out=np.empty((2, 4), np.float32))
    assert len(counting.products) == 2
    rt.max_pool(x, out=np.empty((2, 3, 2, 2), np.float32), kernel=2, stride=2)
    assert len(counting.products) == 2
    assert cpu.matmul.__kwdefaults__["gemm"] is np.matmul        # the module itself is unchanged


# ----------------------------------------------------------------------------------------------------------------
# a generated program trained with its products tiled

STEPS = 2


def _train(program, tmp_path, tag, *extra):
    """Train with numpy's kernels (a program builds its compiled ones where a C compiler is there; their
    convolutions make fewer products), the products numpy's or tiled."""
    params, report = tmp_path / f"{tag}.npz", tmp_path / f"{tag}.json"
    done = run_cli(program, "--iters", str(STEPS), "--data", "synthetic", "--test-iters", "1", "--params", str(params),
                   "--report-json", str(report), "--quiet", "--kernels", "numpy", *extra)
    assert done.returncode == 0, done.stderr
    with np.load(params) as z:
        tensors = {k: z[k] for k in z.files if not k.startswith("__")}
    return tensors, json.loads(report.read_text())


def test_lenet_trains_the_same_with_tiled_products(tmp_path):
    _, program = compile_program("lenet", tmp_path, batch=4)
    plain, plain_report = _train(program, tmp_path, "plain")
    tiled_tensors, report = _train(program, tmp_path, "tiled", "--gemm-devices", "2", "--gemm-device-memory", "64K",
                                   "--gemm-tile", str(TILE))
    assert plain_report["gemm"] is None
    assert abs(report["loss"] - plain_report["loss"]) <= 1e-5 * abs(plain_report["loss"])
    assert abs(report["test_loss"] - plain_report["test_loss"]) <= 1e-5 * abs(plain_report["test_loss"])
    assert plain.keys() == tiled_tensors.keys()
    worst = max((rel_err(tiled_tensors[k], plain[k]), k) for k in plain)
    assert worst[0] < 1e-5, worst

    # the products the same steps make with numpy, counted in this process
    model = model_class(import_program(program))("cpu", 0, kernels="numpy")
    counting = Counting()
    model.rt = cpu.with_gemm(counting)
    model.initialize(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(model.batch_shape).astype(np.float32)
    y = rng.integers(0, model.classes, model.batch_shape[0]).astype(np.int32)
    hyper = model.hyper(0.01, 0.9, 0.0005, 0)
    model.prepare(hyper)
    for step in range(STEPS):
        model.train_step(x, y, step=step, **hyper)
    for _ in range(2):           # the test loss of one batch taken before the checkpoint is written, the test pass
        model.test_step(x, y)

    gemm = report["gemm"]
    assert gemm["devices"] == 2 and gemm["tile"] == TILE and gemm["device_memory_bytes"] == [MEMORY, MEMORY]
    assert gemm["calls"] == counting.matrices()
    assert gemm["d2h_bytes"] == counting.output_bytes()       # every output tile written back exactly once
    assert gemm["flops"] == sum(2 * a[-2] * a[-1] * b[-1] * int(np.prod(out[:-2])) for a, b, out in counting.products)
    assert all(tasks > 0 for tasks in gemm["tasks_per_device"]), gemm["tasks_per_device"]
    assert gemm["evictions"] > 0            # 64 KiB devices cannot hold LeNet's operands: out of core
    assert gemm["bytes_moved"] == gemm["h2d_bytes"] + gemm["d2h_bytes"] + gemm["d2d_bytes"]


def test_gemm_options_are_checked(tmp_path):
    _, program = compile_program("mlp", tmp_path, batch=4)
    params = tmp_path / "p.npz"
    done = run_cli(program, "--iters", "1", "--data", "synthetic", "--params", str(params), "--gemm-devices", "2",
                   "--gemm-device-memory", "4K", "--gemm-tile", "64")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--gemm-device-memory" in lines[0] and "--gemm-tile" in lines[0], done.stderr
    assert not params.exists()
    done = run_cli(program, "--iters", "1", "--gemm-device-memory", "lots")
    assert done.returncode == 2 and "not a size in bytes" in done.stderr
    help_text = " ".join(run_cli(program, "--help").stdout.split())
    for option in ("--gemm-devices", "--gemm-device-memory", "--gemm-tile"):
        assert option in help_text, option


def test_device_memory_alone_means_one_device(tmp_path):
    _, program = compile_program("mlp", tmp_path, batch=4)
    _, report = _train(program, tmp_path, "one", "--gemm-device-memory", "1M", "--gemm-tile", "64")
    assert report["gemm"]["devices"] == 1 and report["gemm"]["device_memory_bytes"] == [1 << 20]
    assert report["gemm"]["calls"] > 0 and report["gemm"]["d2d_bytes"] == 0
