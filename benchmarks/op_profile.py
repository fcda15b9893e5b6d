"""Where a generated program's training step spends its time, op by op.

    python benchmarks/op_profile.py NET[:BATCH[:IMAGE]] [--threads 2] [--kernels compiled] [--warmup 2]
                                    [--steps 5] [--top 25] [--markdown] [--steps-only]
    python benchmarks/op_profile.py NET[:BATCH[:IMAGE]] --threads 1 2 [--steps 9] ...

NET is a network of networks/ or the path of a network file (`/tmp/vit_before.py:64`: a version to compare).
The network is compiled with `deepdsl compile` (which builds its compiled kernels), its program imported, and every
op of its backend (`model.rt`) wrapped in a timer; `--warmup` steps run untimed, then `--steps` timed. Printed per
op kind (`conv2d`, `max_pool`, an elementwise kernel by its name, ...) with its input and output shapes: calls per step, the median
over steps of its milliseconds per step, its share of the step and, for the ops that multiply matrices, their
rate in GFLOP/s; then the milliseconds by op (every elementwise
kernel as `ew`), and the sum over ops against the step's median (the rest is Python: the step's glue and the
timers). The load average is printed before and after. Idle threads
sleep at once, as in the generated program (`deepdsl_runtime.idle_threads_sleep`).

With two thread counts, what a second thread gains op by op: the steps alternate between them in one process (a
step at each count per round, `--steps` rounds, each timed step after an untimed one at its count), and each op's
median milliseconds at either count is printed with its speed-up and the milliseconds it loses against a perfect
one (`lost`: its time at the larger count less its time at the smaller scaled by their ratio), the ops that lose
most first; then the whole step's.

The timers cost time of their own, and not the same for every program (they once added 30 ms a step to one
ResNet-50 program's elementwise kernels and nothing to another's): `--steps-only` times whole steps without them,
printing their median (and each step's milliseconds, up to 20 steps), for comparing programs.
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deepdsl_runtime

deepdsl_runtime.idle_threads_sleep()        # as the generated program does, before numpy loads its BLAS
import numpy as np  # noqa: E402

from timing import load_average, print_row, timed_steps  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]


def _compile(spec: str, directory: Path) -> Path:
    name, batch, image = (spec.split(":") + ["", ""])[:3]
    source = Path(name).resolve() if name.endswith(".py") else ROOT / "networks" / f"{name}.py"
    program = directory / f"{source.stem}{batch}.py"
    command = [sys.executable, "-m", "deepdsl", "compile", str(source), "-o", str(program)]
    command += (["--batch", batch] if batch else []) + (["--image", image] if image else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"compiling {spec}: {done.stdout.strip()} {done.stderr.strip()}")
    return program


def _model(program: Path, kernels: str, threads: int):
    spec = importlib.util.spec_from_file_location(program.stem, program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from deepdsl_runtime import program as rp
    cls = rp.model_class(module)
    model = cls(kernels=kernels, threads=threads)
    model.initialize(0)
    return model


def _shape(a) -> str:
    return "x".join(map(str, a.shape)) if isinstance(a, np.ndarray) else ""


def _label(name: str, args, kwargs) -> str:
    if name == "ew":
        return f"ew {args[0].__name__} {_shape(args[1])}"
    if name in ("ew_pair", "ew_and_sum"):          # two kernels' calls, each (kernel, out, *operands)
        first, second = args
        return f"{name} {first[0].__name__}+{second[0].__name__} {_shape(first[1])}"
    out = kwargs.get("out")
    return f"{name} " + ",".join(s for s in map(_shape, args) if s) + (f"->{_shape(out)}" if out is not None else "")


def _flops(name: str, args, kwargs) -> int:
    """The multiply-add FLOPs of a matrix-product op (0 for the others)."""
    out = kwargs.get("out")
    if name in ("conv2d", "conv2d_bwd_data"):
        o, c, kh, kw = args[1].shape
        return 2 * (out.size if name == "conv2d" else args[0].size) * c * kh * kw
    if name == "conv2d_bwd_filter":
        return 2 * args[0].size * out[0].size
    if name == "matmul":
        a = args[0]
        inner = a.shape[-2] if kwargs.get("ta") else a.shape[-1]
        return 2 * out.size * inner
    return 0


def _timed(rt, times: dict):
    """`rt` with every op timed into times[label] (seconds, summed until the caller reads them)."""
    def wrap(name, op):
        @functools.wraps(op)
        def timed(*args, **kwargs):
            began = time.perf_counter()
            result = op(*args, **kwargs)
            label = _label(name, args, kwargs)
            times[label] += time.perf_counter() - began
            calls[label] += 1
            flops[label] = _flops(name, args, kwargs)
            return result
        return timed
    calls, flops = collections.Counter(), {}
    for name in dir(rt):
        op = getattr(rt, name)
        if callable(op) and not name.startswith("_") and name not in ("backend", "with_gemm", "asarray",
                                                                        "to_numpy", "scalar", "reshape"):
            setattr(rt, name, wrap(name, op))
    return calls, flops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("network")
    parser.add_argument("--threads", type=int, nargs="+", default=[2],
                        help="a thread count, or two: the second thread's gain op by op")
    parser.add_argument("--kernels", default="compiled", choices=("compiled", "numpy", "auto"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--steps-only", action="store_true", help="whole steps, without the per-op timers")
    args = parser.parse_args()
    if len(args.threads) > 2:
        parser.error("--threads takes one thread count or two")
    print(f"load average before: {load_average()}")
    if len(args.threads) == 2:
        return _scaling(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(_compile(args.network, Path(tmp)), args.kernels, args.threads[0])
        print(f"{args.network}: {model.kernels}")
        x, y = model.random_batch(np.random.default_rng(0))
        hyper = model.hyper(0.01, 0.9, 0.0005, 0)
        model.prepare(hyper)
        totals = collections.defaultdict(float)
        calls, flops = _timed(model.rt, totals) if not args.steps_only else ({}, {})
        per_step = collections.defaultdict(list)

        def step(i):
            if i > args.warmup:
                for label, seconds in totals.items():       # the step before's (each timed step's, kept)
                    per_step[label].append(seconds)
            totals.clear()
            model.train_step(model.rt.asarray(x), model.rt.asarray(y), step=i, **hyper)

        steps = timed_steps(step, args.warmup, args.steps)
        for label, seconds in totals.items():
            per_step[label].append(seconds)
    step_ms = statistics.median(steps) * 1000
    if args.steps_only:
        if len(steps) <= 20:
            print("steps (ms):", " ".join(f"{t * 1000:.1f}" for t in steps))
        print(f"step {step_ms:.1f} ms (median of {args.steps})")
        print(f"load average after: {load_average()}")
        return 0
    rows = sorted(((statistics.median(v) * 1000, k) for k, v in per_step.items()), reverse=True)
    print_row(("op and shapes", "calls", "ms/step", "share", "GFLOP/s"), args.markdown, 12, header=True)
    runs = args.warmup + args.steps
    for ms, label in rows[:args.top]:
        n = calls[label] // runs
        rate = f"{flops[label] * n / ms / 1e6:.0f}" if flops.get(label) else ""
        print_row((label, str(n), f"{ms:.2f}", f"{ms / step_ms:.1%}", rate), args.markdown, 12)
    kinds = collections.defaultdict(float)
    for ms, label in rows:
        kinds["ew" if label.startswith("ew ") else label.split()[0]] += ms
    print("by op:", ", ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1])))
    product_ms = sum(ms for ms, label in rows if flops.get(label))
    product_flops = sum(flops[label] * calls[label] // runs for _, label in rows if flops.get(label))
    print(f"matrix-product ops: {product_flops / 1e9:.2f} GFLOP in {product_ms:.1f} ms "
          f"({product_flops / product_ms / 1e6:.0f} GFLOP/s)")
    ops_ms = sum(ms for ms, _ in rows)
    print(f"step {step_ms:.1f} ms (median of {args.steps}); ops {ops_ms:.1f} ms; rest {step_ms - ops_ms:.1f} ms")
    print(f"load average after: {load_average()}")
    return 0


def _set_threads(model, threads: int) -> None:
    if model.rt.native is not None:
        model.rt.native.set_threads(threads)
    if getattr(model, "products", None) is not None:
        model.products.set_threads(threads)


def _scaling(args) -> int:
    """Steps at the two thread counts alternating, every op timed: per op, the milliseconds at each, the speed-up
    and the milliseconds lost against a perfect one."""
    few, many = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(_compile(args.network, Path(tmp)), args.kernels, few)
        print(f"{args.network}: {model.kernels}; threads {few} and {many}, alternating")
        x, y = model.random_batch(np.random.default_rng(0))
        hyper = model.hyper(0.01, 0.9, 0.0005, 0)
        model.prepare(hyper)
        totals = collections.defaultdict(float)
        calls, _ = _timed(model.rt, totals)
        per_step = {few: collections.defaultdict(list), many: collections.defaultdict(list)}
        steps = {few: [], many: []}
        for i in range(args.warmup + args.steps):
            for threads in (few, many) if i % 2 == 0 else (many, few):
                _set_threads(model, threads)
                # (a step untimed first: the threads a step at the other count left asleep are awake again, as
                # in a run's steps one after the other)
                model.train_step(model.rt.asarray(x), model.rt.asarray(y), step=i, **hyper)
                totals.clear()
                began = time.perf_counter()
                model.train_step(model.rt.asarray(x), model.rt.asarray(y), step=i, **hyper)
                if i >= args.warmup:
                    steps[threads].append(time.perf_counter() - began)
                    for label, seconds in totals.items():
                        per_step[threads][label].append(seconds)
    ratio = many / few
    rows = []
    for label in per_step[few]:
        a, b = (statistics.median(per_step[t][label]) * 1000 for t in (few, many))
        rows.append((b - a / ratio, label, a, b))
    rows.sort(reverse=True)
    print_row(("op and shapes", "calls", f"ms at {few}", f"ms at {many}", "speed-up", "lost ms"), args.markdown, 12,
              header=True)
    runs = 4 * (args.warmup + args.steps)
    for lost, label, a, b in rows[:args.top]:
        print_row((label, str(calls[label] // runs), f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}x" if b else "",
                   f"{lost:.2f}"), args.markdown, 12)
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for _, label, a, b in rows:
        kind = kinds["ew" if label.startswith("ew ") else label.split()[0]]
        kind[0] += a
        kind[1] += b
    print("by op (ms at each count, speed-up):", ", ".join(
        f"{k} {a:.1f}/{b:.1f} {a / b:.2f}x" for k, (a, b) in sorted(kinds.items(), key=lambda kv: -kv[1][1]) if b))
    a, b = (statistics.median(steps[t]) * 1000 for t in (few, many))
    ops_a, ops_b = (sum(r[i] for r in rows) for i in (2, 3))
    print(f"step {a:.1f} ms at {few}, {b:.1f} ms at {many} (medians of {args.steps}): {a / b:.2f}x; ops {ops_a:.1f} "
          f"and {ops_b:.1f} ms ({ops_a / ops_b:.2f}x), the rest (Python) {a - ops_a:.1f} and {b - ops_b:.1f} ms")
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
