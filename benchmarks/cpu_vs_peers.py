"""Generated training programs on the CPU against PyTorch eager, torch.compile and JAX, side by side.

    python benchmarks/cpu_vs_peers.py [NET[:BATCH[:IMAGE]] ...] [--threads 1 2] [--rounds 3] [--warmup 3]
                                      [--steps 10] [--sides ours python numpy eager compile max-autotune jax]
                                      [--isa native|avx2] [--markdown]

Default networks: lenet:64 lenet:500 alexnet:16:227 resnet50:8:112 (BATCH: the network's own where left out; IMAGE:
the input's height and width); also
mobilenet_v2, vit and char_lm (the byte-level language model, on random tokens with a label per position). Each
network is compiled once with `deepdsl compile` (its wall time is reported as ours' compile time; the command also
builds the program's compiled kernels). Then the sides run in rounds, interleaved (one process per side and thread
count per round, so a busy moment of a shared machine falls on all sides and thread counts alike), each on the same
synthetic batches with the same thread count (OMP/OPENBLAS/MKL_NUM_THREADS and torch.set_num_threads):

- ours: the generated program's training steps with its compiled kernels (`--kernels compiled`) as its training
  command runs them: the first two by their Python, the third recorded and checked (`deepdsl_runtime.replay`: make
  `--warmup` at least 3), the others replayed; python: every step by its Python (`--no-replay`); numpy: the same
  program with numpy's kernels (its steps' Python);
- eager: the PyTorch twin the tests check our programs against (tests/support/torch_nets.py), `torch.optim.SGD`
  with the same momentum and weight decay; compile: its loss under `torch.compile` (default mode);
  max-autotune: `torch.compile(mode="max-autotune-no-cudagraphs")`;
- jax: the JAX twin of the PyTorch twin (benchmarks/jax_twins.py: the twin's loss exported with torch.export and
  each core ATen op computed with jax.numpy), the step (loss, gradients, the same SGD update, batch norm's running
  statistics) one function under `jax.jit`, where jax is installed (`pip install ".[peers]"`); its process runs
  on the first THREADS processors (XLA sizes its pool by them; one thread: XLA's single-threaded Eigen).

A side's figure for a round is the median of its `--steps` timed steps after `--warmup` untimed ones; the table
gives the median over rounds, its ratio to ours (above 1: slower than ours), the peak RSS (ru_maxrss) and its
ratio, and the first step's seconds (for torch.compile: compiling; for jax: tracing and compiling); below it, for
each network and thread count after the first, each side's speed-up from the first count (the median of the rounds'
ratios: the same round ran both). The load
average is printed before and after; the first line names the processor and its widest vector extension (AVX-512,
AVX2), which every figure depends on.

`--isa avx2` runs every side as on a processor without AVX-512 (on one that has it; `timing.AVX2_ENV`): our
compiled kernels built with `-mno-avx512f` ($DEEPDSL_CFLAGS), OpenBLAS on its Haswell kernels, oneDNN and PyTorch's
own kernels on AVX2 (torch.compile's generated code included), MKL (PyTorch's matrix products) on AVX2, XLA's on
AVX2; the first line says so. The last lines say which vector extensions PyTorch's ATen, MKL and oneDNN report they
ran on (`timing.torch_isa`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (benchmarks/ is on the path of a script run from it)
from timing import add_isa_option, load_average, print_row, processor, timed_steps, torch_isa, vector_isa

ROOT = Path(__file__).resolve().parents[1]
LR, MOMENTUM, DECAY = 0.01, 0.9, 0.0005
SIDES = ("ours", "python", "numpy", "eager", "compile", "max-autotune", "jax")
TWINS = {"lenet": "LeNet", "alexnet": "AlexNet", "resnet50": "ResNet50", "mobilenet_v2": "MobileNetV2", "vit": "ViT",
         "char_lm": "CharLM"}
BATCHES = 2


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _data(shape, classes, tokens=False, label_shape=(), seed=0):
    """The synthetic batches every side trains on, drawn as the program's `random_batch` draws them: normal images
    and a label each, or uniform tokens and a label per position (a language model's)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    if tokens:
        return [(rng.integers(0, classes, shape).astype(np.int32),
                 rng.integers(0, classes, (shape[0], *label_shape)).astype(np.int32)) for _ in range(BATCHES)]
    return [(rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0]).astype(np.int32))
            for _ in range(BATCHES)]


def _measure(step, warmup: int, steps: int) -> dict:
    began = time.perf_counter()
    step(0)
    first = time.perf_counter() - began
    times = timed_steps(lambda i: step(i + 1), max(warmup - 1, 0), steps)
    return {"ms": statistics.median(times) * 1000, "first_s": first, "peak_mib": _peak_mib()}


# ----------------------------------------------------------------------------------------------------------------
# workers (one process each)

def worker_ours(program: str, kernels: str, threads: int, warmup: int, steps: int, replayed: bool = True) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_program", program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from deepdsl_runtime.program import model_class
    cls = model_class(module)
    from deepdsl_runtime.replay import TrainSteps
    model = cls("cpu", 0, "static", kernels=kernels, threads=threads)
    model.initialize(0)
    data = _data(cls.batch_shape, cls.classes, cls.tokens, cls.label_shape)
    train = TrainSteps(model, why=None if replayed else "--no-replay")

    def step(i):
        hyper = model.hyper(LR, MOMENTUM, DECAY, i)
        if i == 0:
            model.prepare(hyper)
        x, y = data[i % BATCHES]
        train(x, y, step=i, **hyper)

    return {**_measure(step, warmup, steps), "kernels": model.kernels,
            "replay": train.summary() if kernels == "compiled" and replayed else None}


def worker_torch(network: str, shape, classes: int, mode: str, threads: int, warmup: int, steps: int,
                 tokens: bool = False, label_shape=()) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    twin = _twin(network, shape, classes)
    optimizer = torch.optim.SGD(twin.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    loss_fn = twin.loss if mode == "eager" else torch.compile(
        twin.loss, mode=None if mode == "compile" else "max-autotune-no-cudagraphs")
    data = _torch_data(shape, classes, tokens, label_shape)

    def step(i):
        x, y = data[i % BATCHES]
        optimizer.zero_grad()
        loss = loss_fn(x, y)
        loss.backward()
        optimizer.step()
        loss.item()

    return {**_measure(step, warmup, steps), "torch": torch.__version__, "isa": torch_isa()}


def _torch_data(shape, classes: int, tokens: bool, label_shape) -> list:
    """`_data`'s batches as torch tensors (tokens and labels int64, as PyTorch's embedding and losses take them)."""
    import torch

    return [(torch.from_numpy(x).long() if tokens else torch.from_numpy(x), torch.from_numpy(y).long())
            for x, y in _data(shape, classes, tokens, label_shape)]


def _twin(network: str, shape, classes: int):
    """The network's PyTorch twin (tests/support/torch_nets.py), in training mode."""
    sys.path.insert(0, str(ROOT))
    from tests.support import torch_nets

    twin_cls = getattr(torch_nets, TWINS[network])
    twin = twin_cls() if network == "lenet" else twin_cls(image=tuple(shape[2:]), classes=classes)
    twin.train()
    return twin


def worker_jax_export(network: str, shape, classes: int, tokens: bool, label_shape, out: str) -> dict:
    """The network's twin described for its JAX twin (`jax_twins.describe`), pickled to `out`: in a process of its
    own, so that the JAX side's process never loads PyTorch (its peak RSS is JAX's own)."""
    import pickle

    import torch
    from jax_twins import describe

    torch.manual_seed(0)
    x, y = _torch_data(shape, classes, tokens, label_shape)[0]
    with open(out, "wb") as f:
        pickle.dump(describe(_twin(network, shape, classes), x, y), f)
    return {}


def worker_jax(network: str, shape, classes: int, threads: int, warmup: int, steps: int, tokens: bool = False,
               label_shape=()) -> dict:
    """The network's JAX twin (benchmarks/jax_twins.py: the PyTorch twin exported and computed with jax.numpy), its
    step (loss, gradients, PyTorch's SGD update and batch norm's running statistics) one jitted function, on the
    first `threads` processors (XLA sizes its thread pool by the processors it may run on)."""
    import importlib.util
    import pickle

    if importlib.util.find_spec("jax") is None:
        raise SystemExit('jax is not installed (pip install -e ".[peers]")')
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "twin.pickle")
        job = {"side": "jax-export", "threads": threads, "network": network, "shape": shape, "classes": classes,
               "tokens": tokens, "label_shape": label_shape, "out": out}
        done = _spawn(["--worker", json.dumps(job)], threads)
        if "error" in done:
            raise SystemExit(f"exporting the twin: {done['error']}")
        with open(out, "rb") as f:
            description = pickle.load(f)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    if threads == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    import jax
    from jax_twins import batches, from_description

    twin = from_description(description)
    train = twin.sgd_step(LR, MOMENTUM, DECAY)
    state = [twin.params, {k: jax.numpy.zeros_like(a) for k, a in twin.params.items()}, twin.buffers]
    jax_data = [batches(x, y) for x, y in _data(shape, classes, tokens, label_shape)]
    key = jax.random.PRNGKey(0)

    def step(i):
        x, y = jax_data[i % BATCHES]
        state[0], state[1], state[2], loss = train(*state, x, y, jax.random.fold_in(key, i))
        jax.block_until_ready(loss)

    return {**_measure(step, warmup, steps), "jax": jax.__version__}


# ----------------------------------------------------------------------------------------------------------------
# the driver

def _spawn(args: list[str], threads: int) -> dict:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spec(spec: str) -> tuple[str, int | None, str | None]:
    """NAME[:BATCH[:IMAGE]] as (name, batch or None: the network's own, image or None); one line and exit 2 where it
    names no network of networks/ or its batch is no number."""
    name, batch, image = (spec.split(":") + ["", ""])[:3]
    if not (ROOT / "networks" / f"{name}.py").is_file():
        raise SystemExit(f"cpu_vs_peers: '{spec}': no network '{name}' in networks/")
    if batch and not batch.isdigit():
        raise SystemExit(f"cpu_vs_peers: '{spec}': the batch '{batch}' is no positive number")
    return name, int(batch) if batch else None, image or None


def _compile(name: str, batch: int | None, image: str | None, directory: Path) -> tuple[Path, float, dict]:
    program = directory / f"{name}_{batch or 'default'}.py"
    command = [sys.executable, "-m", "deepdsl", "compile", str(ROOT / "networks" / f"{name}.py"), "-o", str(program)]
    command += (["--batch", str(batch)] if batch else []) + (["--image", image] if image else [])
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"compiling {name}: {done.stderr.strip()}")
    sys.path.insert(0, str(ROOT))
    import importlib.util
    spec = importlib.util.spec_from_file_location("probe_program", program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from deepdsl_runtime.program import model_class
    cls = model_class(module)
    return program, seconds, {"shape": list(cls.batch_shape), "classes": cls.classes, "tokens": bool(cls.tokens),
                              "label_shape": list(cls.label_shape)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("networks", nargs="*", default=["lenet:64", "lenet:500", "alexnet:16:227", "resnet50:8:112"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    add_isa_option(parser)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        side, threads = job["side"], job["threads"]
        if side in ("ours", "python", "numpy"):
            result = worker_ours(job["program"], "numpy" if side == "numpy" else "compiled", threads, args.warmup,
                                 args.steps, replayed=side == "ours")
        elif side == "jax-export":
            result = worker_jax_export(job["network"], job["shape"], job["classes"], job["tokens"],
                                       job["label_shape"], job["out"])
        elif side == "jax":
            result = worker_jax(job["network"], job["shape"], job["classes"], threads, args.warmup, args.steps,
                                job.get("tokens", False), job.get("label_shape", ()))
        else:
            result = worker_torch(job["network"], job["shape"], job["classes"], side, threads, args.warmup,
                                  args.steps, job.get("tokens", False), job.get("label_shape", ()))
        print(json.dumps(result))
        return 0

    specs = [_spec(spec) for spec in args.networks]
    isa, cpu = vector_isa(args.isa), processor()[0]
    print(f"{cpu} ({platform.machine()}, {isa}), {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"median of {args.steps} steps after {args.warmup} warm-up steps, {args.rounds} rounds interleaved; "
          f"load average before: {load_average()}", flush=True)
    print_row(("network", "batch", "threads", "side", "ms/step", "vs ours", "peak RSS MiB", "vs ours",
               "first step s"), args.markdown, 12, header=True)
    torch_isas: set[str] = set()
    scaling: list[str] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch, image in specs:
            program, compile_s, info = _compile(name, batch, image, Path(tmp))
            batch = str(info["shape"][0])
            sides = [s for s in args.sides if s not in ("eager", "compile", "max-autotune", "jax") or name in TWINS]
            # a round runs every side at every thread count, so a slow phase of the machine falls on all of them
            by_threads: dict[int, dict[str, list[dict]]] = {t: {s: [] for s in sides} for t in args.threads}
            for _ in range(args.rounds):
                for threads in args.threads:
                    for side in sides:
                        job = {"side": side, "threads": threads, "program": str(program), "network": name, **info}
                        by_threads[threads][side].append(_spawn(["--worker", json.dumps(job), "--warmup",
                                                                 str(args.warmup), "--steps", str(args.steps)],
                                                                threads))
            for threads, runs in by_threads.items():
                ours = _summary(runs["ours"]) if "ours" in runs else None
                torch_isas.update(r["isa"] for side in sides for r in runs[side] if "isa" in r)
                for side in sides:
                    s = _summary(runs[side])
                    if s is None:
                        error = next((r["error"] for r in runs[side] if "error" in r), "failed")
                        print_row((name, batch, str(threads), side, "-", "-", "-", "-", error[:60]), args.markdown,
                                  12)
                        continue
                    first = compile_s if side == "ours" else s["first_s"]
                    print_row((name, batch, str(threads), side, f"{s['ms']:.1f}",
                               f"{s['ms'] / ours['ms']:.2f}x" if ours else "-", f"{s['peak_mib']:.0f}",
                               f"{s['peak_mib'] / ours['peak_mib']:.2f}x" if ours else "-",
                               f"{first:.1f}" + (" (compile)" if side == "ours" else "")), args.markdown, 12)
            scaling.extend(_scaling(f"{name} {batch}", by_threads))
            replays = sorted({r["replay"] for runs in by_threads.values() for r in runs.get("ours", ())
                              if r.get("replay")})
            notes.extend(f"step replay of ours, {name} {batch}: {text}" for text in replays)
    for line in scaling + notes:
        print(line)
    if torch_isas:
        print(f"PyTorch's kernels ran on: {'; '.join(sorted(torch_isas))}")
    print(f"load average after: {load_average()}")
    return 0


def _scaling(network: str, by_threads: dict[int, dict[str, list[dict]]]) -> list[str]:
    """For each thread count after the first: how many times faster each side's step is than at the first count,
    the median of the rounds' ratios (a round ran both counts minutes apart at most, in the same phase of a shared
    machine)."""
    first, *others = by_threads
    lines = []
    for threads in others:
        ratios = []
        for side, runs in by_threads[threads].items():
            pairs = [(a["ms"], b["ms"]) for a, b in zip(by_threads[first][side], runs)
                     if "error" not in a and "error" not in b]
            if pairs:
                ratios.append(f"{side} {statistics.median(a / b for a, b in pairs):.2f}x")
        if ratios:
            lines.append(f"{network}: {first} thread(s) to {threads}, the step's speed-up (median over rounds): "
                         + ", ".join(ratios))
    return lines


def _summary(runs: list[dict]) -> dict | None:
    good = [r for r in runs if "error" not in r]
    if not good:
        return None
    return {key: statistics.median(r[key] for r in good) for key in ("ms", "first_s", "peak_mib")}


if __name__ == "__main__":
    sys.exit(main())
