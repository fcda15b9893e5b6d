"""The generated LeNet (batch 500) and AlexNet (batch 128) training steps on one NVIDIA GPU against the same networks
in PyTorch eager on the same GPU, side by side: milliseconds per step and peak device memory.

    python benchmarks/cuda_vs_pytorch.py [--networks lenet alexnet] [--warmup 5] [--steps 20] [--memory-mode static]
                                         [--workspace-limit MIB] [--allow-tf32] [--cudnn-benchmark] [--kernels N]
                                         [--batch N] [--json PATH]

Needs pycuda, PyTorch with CUDA and a GPU. Each side of each network runs in a process of its own, so the device
memory it reports is its own, on the same synthetic batches generated before timing (no data loading):

- ours: `networks/<net>.py` compiled at that batch size by `deepdsl.compile` (with `--workspace-limit`, that limit on
  a statement's scratch in MiB instead of the default 32: convolutions run over the batch in fewer, larger chunks of
  im2col matrices and products, with fewer launches), written by `write_program` into a
  temporary directory with its `.cu` (and, with nvcc installed, its fat binary, so no kernel is compiled in the
  timed process); the process imports only the generated program and runs its `train_step` with `--device cuda`
  semantics (`Model("cuda", memory_mode=...)`): SGD with momentum and weight decay, the loss read back each step.
- PyTorch: the same layers in eager mode (Conv2d, MaxPool2d(ceil_mode), LocalResponseNorm, Dropout, Linear,
  the network's loss), `torch.optim.SGD` with momentum, weight decay and the networks' per-layer multipliers
  (AlexNet's biases: twice the learning rate, no decay); a step is zero_grad, forward, backward, step, `loss.item()`.

`--batch N` runs both sides of every network at batch N instead (a quick run, or the host emulator of a GPU).

Float32 on both sides: TF32 tensor-core math is off in PyTorch unless --allow-tf32 (our GEMMs are cuBLAS SGEMM in
full FP32). The first --warmup steps are not timed; the figure is the median of --steps timed steps, each ending with
the loss on the host. Memory, ours: the tensor peak the allocator measured (= the plan's), the workspace, the
persistent tensors (parameters, momentum, hoisted values) and the device memory the process took (cuMemGetInfo before
building the model and after the steps); PyTorch: torch.cuda.max_memory_allocated / max_memory_reserved and the same
cuMemGetInfo difference. Ratios are ours / PyTorch (below 1: faster or smaller).

`--kernels N`: after the timed steps, each side runs `--steps` more under PyTorch's profiler (CUPTI, which records
every kernel and copy the process runs on the GPU, pycuda's and cuBLAS's too) and reports the GPU's busy time per
step (the sum of its kernels' and copies' times) against the step's wall time, and its N longest kernels by time
per step: where a step is bound by the GPU's work and where by the host's launches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import timed_steps  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]
LR, MOMENTUM, DECAY = 0.01, 0.9, 0.0005
BATCHES = 4
CONFIG = {"lenet": {"batch": 500, "image": (28, 28), "channels": 1, "classes": 10},
          "alexnet": {"batch": 128, "image": (227, 227), "channels": 3, "classes": 1000}}


def _synthetic(network: str, seed: int = 0):
    import numpy as np

    cfg = CONFIG[network]
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((cfg["batch"], cfg["channels"], *cfg["image"])).astype(np.float32),
             rng.integers(0, cfg["classes"], cfg["batch"]).astype(np.int32)) for _ in range(BATCHES)]


# ----------------------------------------------------------------------------------------------------------------
# ours

def with_batch(batch: int | None) -> None:
    """Every network at batch `batch` from now on in this process (None: each at its benchmark batch)."""
    if batch is not None:
        for network, config in CONFIG.items():
            CONFIG[network] = {**config, "batch": batch}


def prepare_ours(network: str, directory: Path, workspace_mib: int | None = None, fatbin: bool = True) -> Path:
    """Compile the network at its benchmark size (under `workspace_mib` of scratch a statement where given) and write
    the program, its kernels and (with nvcc, unless `fatbin` is false) its fat binary."""
    sys.path.insert(0, str(ROOT))
    import deepdsl
    from deepdsl.codegen import write_program
    from deepdsl.codegen.cuda import build_fatbin, find_nvcc
    from deepdsl.dsl import Overrides
    from deepdsl.pipeline import CompileOptions

    cfg = CONFIG[network]
    options = CompileOptions() if workspace_mib is None else CompileOptions(workspace_limit=workspace_mib << 20)
    compiled = deepdsl.compile(deepdsl.load(str(ROOT / "networks" / f"{network}.py"), Overrides(batch=cfg["batch"])),
                               options)
    program = write_program(compiled, directory / f"{network}.py")
    if fatbin and find_nvcc():
        build_fatbin(program.with_suffix(".cu"))
    return program


def kernel_profile(step, first: int, steps: int, synchronize, top: int) -> dict:
    """Run `steps` more steps (numbered from `first`) under PyTorch's profiler, recording the GPU's activity alone:
    the GPU's busy milliseconds per step and the `top` kernels and copies by time per step, each as
    [name, launches per step, microseconds per step]."""
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + steps):
            step(i)
        synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:                                  # the name before PyTorch 2.4
            us = event.self_cuda_time_total
        if us > 0:
            rows.append([event.key, event.count / steps, us / steps])
    rows.sort(key=lambda row: -row[2])
    return {"gpu_busy_ms": sum(row[2] for row in rows) / 1000, "kernels": rows[:top]}


def worker_ours(program: str, network: str, warmup: int, steps: int, memory_mode: str, top: int = 0) -> dict:
    import importlib.util

    import numpy as np

    import deepdsl_runtime.cuda as rt
    from deepdsl_runtime.cuda import driver as cuda_driver
    from deepdsl_runtime.program import model_class

    device = rt.start()
    drv = cuda_driver.driver()
    free_before, total = drv.mem_get_info()
    spec = importlib.util.spec_from_file_location(f"{network}_program", program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = model_class(module)
    model = cls("cuda", 0, memory_mode)
    model.initialize(0)
    model.prepare(model.hyper(LR, MOMENTUM, DECAY, 0))
    data = _synthetic(network)
    losses = []

    def step(i):
        x, y = data[i % BATCHES]
        losses.append(model.train_step(x, y, step=i, **model.hyper(LR, MOMENTUM, DECAY, i)))

    times = timed_steps(step, warmup, steps)
    rt.synchronize()
    profiled = kernel_profile(step, warmup + steps, steps, rt.synchronize, top) if top else {}
    free_after, _ = drv.mem_get_info()
    usage = model.mem.usage["train_step"]
    persistent = sum(t.nbytes for t in model.tensors.values())
    return {"side": "ours", "network": network, "device": device.name, "ms_per_step": 1000 * statistics.median(times),
            "ms_min": 1000 * min(times), "loss_first": losses[0], "loss_last": losses[-1],
            "tensor_peak_bytes": usage.peak_bytes, "tensor_peak_planned": cls.memory_plans["train_step"].planned_peak(
                memory_mode), "workspace_bytes": usage.workspace_bytes, "persistent_bytes": persistent,
            "reserved_bytes": model.mem.reserved_bytes, "device_bytes_taken": free_before - free_after,
            "memory_mode": memory_mode, "finite": bool(np.isfinite(losses).all()), **profiled}


# ----------------------------------------------------------------------------------------------------------------
# PyTorch

def _torch_network(network: str):
    """The PyTorch twin the tests check our programs against (`tests/support/torch_nets.py`), at the benchmark's
    size."""
    sys.path.insert(0, str(ROOT))
    from tests.support import torch_nets

    config = CONFIG[network]
    twin = {"lenet": torch_nets.LeNet, "alexnet": torch_nets.AlexNet}[network]
    return twin(image=config["image"], classes=config["classes"])


def worker_torch(network: str, warmup: int, steps: int, allow_tf32: bool, cudnn_benchmark: bool,
                 top: int = 0) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    device = torch.device("cuda")
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    model = _torch_network(network).to(device)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if network == "alexnet":        # Caffe's multipliers, as in networks/alexnet.py
        groups = [{"params": weights}, {"params": biases, "lr": 2 * LR, "weight_decay": 0.0}]
    else:
        groups = [{"params": weights + biases}]
    optimizer = torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    data = [(torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)) for x, y in _synthetic(network)]
    torch.cuda.reset_peak_memory_stats()
    losses = []

    def step(i):
        x, y = data[i % BATCHES]
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    times = timed_steps(step, warmup, steps)
    torch.cuda.synchronize()
    profiled = kernel_profile(step, warmup + steps, steps, torch.cuda.synchronize, top) if top else {}
    free_after, _ = torch.cuda.mem_get_info()
    return {"side": "pytorch", "network": network, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "ms_per_step": 1000 * statistics.median(times), "ms_min": 1000 * min(times),
            "loss_first": losses[0], "loss_last": losses[-1],
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(), "device_bytes_taken": free_before - free_after,
            "tf32": allow_tf32, "cudnn_benchmark": cudnn_benchmark, **profiled}


# ----------------------------------------------------------------------------------------------------------------

def _mib(n) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.1f}"


def _run_worker(args: list[str]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_runtime_home()), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"worker {' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _runtime_home() -> str | None:
    sys.path.insert(0, str(ROOT))
    from deepdsl.codegen import program_env

    return program_env().get("PYTHONPATH", "").split(os.pathsep)[0] or None


def print_kernels(rows) -> None:
    """Each side's GPU busy time per step against its step, then its longest kernels."""
    for network, *sides in rows:
        for side in sides:
            print(f"\n{network}, {side['side']}: GPU busy {side['gpu_busy_ms']:.2f} ms of a "
                  f"{side['ms_per_step']:.2f} ms step ({side['gpu_busy_ms'] / side['ms_per_step']:.0%})")
            print("| kernel | launches/step | us/step | share of busy |")
            print("|---|---|---|---|")
            for name, calls, us in side["kernels"]:
                share = us / 1000 / side["gpu_busy_ms"]
                print(f"| {name[:90]} | {calls:g} | {us:.1f} | {share:.1%} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=["lenet", "alexnet"], choices=sorted(CONFIG))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory-mode", default="static", choices=("static", "pooled", "dynamic"))
    parser.add_argument("--workspace-limit", type=int, metavar="MIB",
                        help="our programs' limit on a statement's scratch (default: the compiler's, 32 MiB)")
    parser.add_argument("--allow-tf32", action="store_true", help="let PyTorch use TF32 tensor cores")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="profile --steps more steps and print each side's N longest GPU kernels")
    parser.add_argument("--batch", type=int, metavar="N", help="every network at batch N (default: its own)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--worker", choices=("ours", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--network", help=argparse.SUPPRESS)
    parser.add_argument("--program", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        parser.error("--batch: a positive number of samples")
    with_batch(args.batch)
    if args.worker == "ours":
        print(json.dumps(worker_ours(args.program, args.network, args.warmup, args.steps, args.memory_mode,
                                     args.kernels)))
        return 0
    if args.worker == "torch":
        print(json.dumps(worker_torch(args.network, args.warmup, args.steps, args.allow_tf32, args.cudnn_benchmark,
                                      args.kernels)))
        return 0
    common = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--kernels", str(args.kernels)] + \
        (["--batch", str(args.batch)] if args.batch else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for network in args.networks:
            program = prepare_ours(network, Path(tmp), args.workspace_limit)
            ours = _run_worker(["--worker", "ours", "--network", network, "--program", str(program),
                                "--memory-mode", args.memory_mode, *common])
            theirs = _run_worker(["--worker", "torch", "--network", network, *common]
                                 + (["--allow-tf32"] if args.allow_tf32 else [])
                                 + (["--cudnn-benchmark"] if args.cudnn_benchmark else []))
            rows.append((network, ours, theirs))
    print(f"device: {rows[0][1]['device']}; PyTorch {rows[0][2]['torch']}; median of {args.steps} steps after "
          f"{args.warmup} warm-up steps; memory in MiB; memory mode {args.memory_mode}"
          + (f"; our workspace limit {args.workspace_limit} MiB" if args.workspace_limit else ""))
    print("| network | batch | ours ms/step | PyTorch ms/step | ratio | ours tensor peak (planned) | ours workspace | "
          "ours persistent | ours device taken | PyTorch max allocated | PyTorch max reserved | PyTorch device taken |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for network, ours, theirs in rows:
        print(f"| {network} | {CONFIG[network]['batch']} | {ours['ms_per_step']:.2f} | {theirs['ms_per_step']:.2f} | "
              f"{ours['ms_per_step'] / theirs['ms_per_step']:.2f} | {_mib(ours['tensor_peak_bytes'])} "
              f"({_mib(ours['tensor_peak_planned'])}) | {_mib(ours['workspace_bytes'])} | "
              f"{_mib(ours['persistent_bytes'])} | {_mib(ours['device_bytes_taken'])} | "
              f"{_mib(theirs['max_memory_allocated'])} | {_mib(theirs['max_memory_reserved'])} | "
              f"{_mib(theirs['device_bytes_taken'])} |")
    if args.kernels:
        print_kernels(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([{"network": n, "ours": o, "pytorch": t} for n, o, t in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
