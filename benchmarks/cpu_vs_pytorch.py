"""The generated LeNet training step on the CPU against the same network in PyTorch eager, side by side.

    python benchmarks/cpu_vs_pytorch.py [--batch 64 500] [--threads N] [--warmup 5] [--steps 30] [--markdown]

For each batch size, each side runs in a process of its own (so its peak RSS is its own) with the same thread count
(default: every core; numpy's BLAS through OMP/OPENBLAS/MKL_NUM_THREADS, PyTorch through torch.set_num_threads as
well) on the same synthetic batches, generated before timing (no data loading on either side):

- ours: `networks/lenet.py` compiled at that batch size by `deepdsl.compile` and written by
  `deepdsl.codegen.write_program` into a temporary directory; the process imports only the generated program (numpy
  and deepdsl_runtime, not the compiler) and calls its `train_step` (SGD with momentum and weight decay, the loss
  returned as a Python float).
- PyTorch: the same network (Conv2d 1->20 5x5, max-pool 2, Conv2d 20->50 5x5, max-pool 2, Linear 800->500, ReLU,
  Linear 500->10, mean negative log-likelihood of the softmax) in eager mode, `torch.optim.SGD` with momentum and
  weight_decay; a step is zero_grad, forward, backward, optimizer step and `loss.item()`.

Both use lr 0.01, momentum 0.9, weight decay 0.0005, float32. The first `--warmup` steps are not timed; the figure is
the median of `--steps` timed steps. Peak RSS is `ru_maxrss` at the end of the process; "RSS rise" is that peak minus
the resident set (VmRSS) once the imports, parameters and batches were in place: what the training steps added.
Ratios are ours / PyTorch: below 1 is faster or smaller. The machine's load average is printed before and after:
on a shared machine other processes take cores from both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile

from timing import load_average, timed_steps  # benchmarks/ is on the path of a script run from it

ROOT = pathlib.Path(__file__).resolve().parents[1]
LR, MOMENTUM, DECAY = 0.01, 0.9, 0.0005
BATCHES = 4          # distinct synthetic batches, cycled


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # Linux: KiB


def _resident_mib() -> float:
    """The resident set now (Linux); the peak so far elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return _rss_mib()


def _synthetic(batch: int, seed: int = 0):
    import numpy as np
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
             rng.integers(0, 10, batch).astype(np.int32)) for _ in range(BATCHES)]


def _timed(step, warmup: int, steps: int) -> tuple[list[float], float]:
    """Seconds of each timed step, and the resident set (MiB) before the first step."""
    base = _resident_mib()
    return timed_steps(step, warmup, steps), base


def worker_ours(program: str, batch: int, warmup: int, steps: int) -> dict:
    import importlib.util
    spec = importlib.util.spec_from_file_location("lenet_program", program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from deepdsl_runtime.program import model_class
    cls = model_class(module)
    assert cls.batch_shape[0] == batch, cls.batch_shape
    model = cls("cpu", 0)
    model.initialize(0)
    data = _synthetic(batch)
    losses = []

    def step(i):
        hyper = model.hyper(LR, MOMENTUM, DECAY, i)
        if i == 0:
            model.prepare(hyper)
        x, y = data[i % BATCHES]
        losses.append(model.train_step(x, y, step=i, **hyper))

    times, base = _timed(step, warmup, steps)
    return {"times": times, "rss_base": base, "rss_peak": _rss_mib(), "loss_first": losses[0], "loss_last": losses[-1]}


def worker_torch(batch: int, warmup: int, steps: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(ROOT))
    from tests.support.torch_nets import LeNet  # the twin the tests check our programs against
    torch.set_num_threads(threads)
    torch.manual_seed(0)

    net = LeNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    data = [(torch.from_numpy(x), torch.from_numpy(y).long()) for x, y in _synthetic(batch)]
    losses = []

    def step(i):
        x, y = data[i % BATCHES]
        optimizer.zero_grad()
        loss = F.cross_entropy(net.logits(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    times, base = _timed(step, warmup, steps)
    return {"times": times, "rss_base": base, "rss_peak": _rss_mib(), "loss_first": losses[0], "loss_last": losses[-1],
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


# ----------------------------------------------------------------------------------------------------------------
# the driver

def _env(threads: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from deepdsl.codegen import program_env
    env = program_env()
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(threads)
    return env


def _spawn(args: list[str], env: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"worker {' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _program(batch: int, directory: pathlib.Path) -> pathlib.Path:
    import deepdsl
    from deepdsl.codegen import write_program
    from deepdsl.dsl import Overrides
    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / "lenet.py"), Overrides(batch=batch)))
    target = directory / f"lenet_{batch}.py"
    write_program(compiled, target)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 500])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--worker", choices=("ours", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--program", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        batch = args.batch[0]
        result = (worker_ours(args.program, batch, args.warmup, args.steps) if args.worker == "ours"
                  else worker_torch(batch, args.warmup, args.steps, args.threads))
        print(json.dumps(result))
        return 0

    env = _env(args.threads)
    import numpy as np
    print(f"LeNet training step, {args.threads} threads, median of {args.steps} steps after {args.warmup} warm-up "
          f"steps; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, numpy {np.__version__}; load average {load_average()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch:
            program = _program(batch, pathlib.Path(tmp))
            common = ["--batch", str(batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
                      "--threads", str(args.threads)]
            ours = _spawn(["--worker", "ours", "--program", str(program), *common], env)
            torch_ = _spawn(["--worker", "torch", *common], env)
            rows.append((batch, ours, torch_))
    print(f"PyTorch {rows[0][2]['torch']} ({rows[0][2]['torch_threads']} threads)")
    header = ("batch", "ours ms", "PyTorch ms", "ms ratio", "ours peak RSS MiB", "PyTorch peak RSS MiB", "RSS ratio",
              "ours RSS rise MiB", "PyTorch RSS rise MiB", "rise ratio")
    lines = []
    for batch, ours, theirs in rows:
        a, b = (statistics.median(r["times"]) * 1000 for r in (ours, theirs))
        ra, rb = ours["rss_peak"] - ours["rss_base"], theirs["rss_peak"] - theirs["rss_base"]
        lines.append((str(batch), f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x", f"{ours['rss_peak']:.0f}",
                      f"{theirs['rss_peak']:.0f}", f"{ours['rss_peak'] / theirs['rss_peak']:.2f}x", f"{ra:.0f}",
                      f"{rb:.0f}", f"{ra / rb:.2f}x" if rb > 0 else "-"))
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
        for line in lines:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print(f"load average after: {load_average()}")
    for batch, ours, theirs in rows:
        print(f"batch {batch}: losses ours {ours['loss_first']:.4f} -> {ours['loss_last']:.4f}, "
              f"PyTorch {theirs['loss_first']:.4f} -> {theirs['loss_last']:.4f}; min/max ms ours "
              f"{min(ours['times']) * 1000:.1f}/{max(ours['times']) * 1000:.1f}, PyTorch "
              f"{min(theirs['times']) * 1000:.1f}/{max(theirs['times']) * 1000:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
