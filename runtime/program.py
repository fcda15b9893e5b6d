"""What every generated training program shares: the model base class and the training loop behind its CLI.

A generated program (`generated/<network>.py`) holds the network-specific parts: a `Model` subclass with the
parameter and state declarations and the compiled `setup`, `train_step` and `test_step` methods, and a `main()`
whose argparse options default to the network's `Train(...)`. `run(ModelClass, args)` does the rest: data, fresh
initialization or resuming from a checkpoint, the loop with its progress bar, periodic and final checkpoints,
SIGINT/SIGTERM handling, stopping on a non-finite loss, the test pass and the report.

Exit status: 0 on success, 1 for a usage problem (bad data spec, unusable checkpoint, unavailable device),
3 when the loss became NaN or infinite, 128 + signal number after an interrupted run saved its checkpoint.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from deepdsl_runtime import checkpoint as ckpt
from deepdsl_runtime import data as datasets
from deepdsl_runtime import memory
from deepdsl_runtime.memory import StepPlan

__all__ = ["Model", "Param", "RunError", "State", "StepPlan", "add_gemm_options", "backend", "initial_value",
           "run"]

EXIT_USAGE, EXIT_DIVERGED = 1, 3


class RunError(Exception):
    """A problem reported as one line (exit status 1)."""


def backend(device: str) -> ModuleType:
    """The runtime module implementing the ops on `device` (`deepdsl_runtime.cpu`, `deepdsl_runtime.cuda`)."""
    if device not in ("cpu", "cuda"):
        raise RunError(f"unknown device '{device}' (use cpu or cuda)")
    try:
        return importlib.import_module(f"deepdsl_runtime.{device}")
    except ImportError as err:
        if device == "cuda":
            reason = "this runtime has no CUDA backend module yet" if getattr(err, "name", "") == \
                "deepdsl_runtime.cuda" else str(err)
            raise RunError(f"CUDA backend not available: {reason}") from None
        raise


# ----------------------------------------------------------------------------------------------------------------
# declarations and initialization

@dataclass(frozen=True)
class Param:
    """A trained parameter: shape, initializer ("xavier", "gaussian(STD)", "constant(VALUE)") and the
    learning-rate and weight-decay multipliers compiled into its update."""

    shape: tuple[int, ...]
    init: str
    lr_mult: float = 1.0
    decay_mult: float = 1.0


@dataclass(frozen=True)
class State:
    """A carried tensor that gradients do not train: optimizer state (`optimizer=True`: momentum, Adam moments)
    or model state (batch-norm running statistics)."""

    shape: tuple[int, ...]
    init: str
    optimizer: bool = False


def initial_value(shape: tuple[int, ...], init: str, rng: np.random.Generator) -> np.ndarray:
    """A float32 array drawn by Caffe's filler rules: xavier is uniform in +-sqrt(3 / fan_in) with
    fan_in = prod(shape[1:])."""
    kind, _, rest = init.partition("(")
    value = float(rest.rstrip(")")) if rest else 0.0
    if kind == "xavier":
        fan_in = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        bound = math.sqrt(3.0 / fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)
    if kind == "gaussian":
        return rng.normal(0.0, value, shape).astype(np.float32)
    if kind == "constant":
        return np.full(shape, value, dtype=np.float32)
    raise ValueError(f"unknown initializer '{init}'")


class Model:
    """Parameters, state and hoisted values of one network (in `tensors`, by name) plus its compiled steps.

    Subclasses (generated) set the class attributes and define `setup`, `train_step(x, y, *, step, <hyper>)`
    returning the loss, and `test_step(x, y)` returning (accuracy, loss). `memory_plans` holds each step's memory
    plan; the steps take their buffers from `self.mem`, an allocator of `memory_mode` (static, pooled, dynamic;
    see `deepdsl_runtime.memory`) that also measures what they use."""

    name = ""
    source = ""
    structure_hash = ""
    optimizer = "sgd"
    betas = (0.9, 0.999)
    batch_shape: tuple[int, ...] = ()
    classes = 0
    dataset = "synthetic"
    defaults: dict = {}
    params: dict[str, Param] = {}
    states: dict[str, State] = {}
    setup_inputs: tuple[str, ...] = ()
    memory_plans: dict[str, StepPlan] = {}

    def __init__(self, device: str = "cpu", seed: int = 0, memory_mode: str = "static", check_memory: bool = False):
        self.rt = backend(device)
        if memory_mode not in memory.MODES:
            raise RunError(f"unknown memory mode '{memory_mode}' (use {', '.join(memory.MODES)})")
        # a device backend serves the plan from device memory (the same bookkeeping) and runs this program's kernels
        self.mem = getattr(self.rt, "allocator", memory.allocator)(memory_mode, self.memory_plans, check=check_memory)
        bind = getattr(self.rt, "bind_program", None)
        program = getattr(type(self).train_step, "__globals__", {}).get("__file__")
        if bind is not None and program:
            try:
                bind(program)
            except FileNotFoundError as err:
                raise RunError(str(err)) from None
        self.tensors: dict[str, object] = {}
        self.seed = seed

    # tensors ----------------------------------------------------------------------------------------------------
    def initialize(self, seed: int) -> None:
        """Fresh parameters (drawn in declaration order from one generator seeded with `seed`) and state."""
        self.seed = seed
        rng = np.random.default_rng(seed)
        for name, p in self.params.items():
            self.tensors[name] = self.rt.asarray(initial_value(p.shape, p.init, rng))
        for name, s in self.states.items():
            self.tensors[name] = self.rt.asarray(initial_value(s.shape, s.init, rng))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**{k: p.shape for k, p in self.params.items()}, **{k: s.shape for k, s in self.states.items()}}

    def host_tensors(self) -> dict[str, np.ndarray]:
        """Parameters and state as numpy arrays, by name."""
        return {name: self.rt.to_numpy(self.tensors[name]) for name in self.expected_shapes()}

    def load_tensors(self, arrays: dict[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            self.tensors[name] = self.rt.asarray(np.asarray(array, dtype=np.float32))

    # steps --------------------------------------------------------------------------------------------------------
    def hyper(self, lr: float, momentum: float, decay: float, iteration: int) -> dict[str, np.float32]:
        """The hyperparameter inputs of training step `iteration` (0-based)."""
        f = np.float32
        if self.optimizer == "adam":
            t = iteration + 1
            return {"lr": f(lr), "bias1": f(1.0 - self.betas[0] ** t), "bias2": f(1.0 - self.betas[1] ** t),
                    "decay": f(decay)}
        return {"lr": f(lr), "momentum": f(momentum), "decay": f(decay)}

    def prepare(self, hyper: dict) -> None:
        """Compute the values hoisted out of the steps (once per run)."""
        self.setup(**{k: hyper[k] for k in self.setup_inputs})

    def setup(self, **hyper) -> None:
        pass

    def train_step(self, x, y, *, step: int, **hyper) -> float:
        raise NotImplementedError

    def test_step(self, x, y) -> tuple[float, float]:
        raise NotImplementedError

    def memory_report(self) -> dict:
        """The memory figures of the report: planned, and measured by the allocator in the steps that ran (None for
        a step that did not run). `peak_bytes_*` and `workspace_bytes_*` are the training step's, `test_*` the test
        step's; `arena_bytes` and `pool_bytes` what the static and pooled modes reserve, `reserved_bytes` what this
        run's mode reserved, `max_rss_bytes` the process's resident-set high-water mark."""
        usage, plans = self.mem.usage, self.memory_plans
        result = {"memory_mode": self.mem.mode}
        for prefix, step in (("", "train_step"), ("test_", "test_step")):
            plan, used = plans.get(step, StepPlan()), usage.get(step)
            result[f"{prefix}peak_bytes_measured"] = used.peak_bytes if used else None
            result[f"{prefix}peak_bytes_planned"] = plan.planned_peak(self.mem.mode)
            result[f"{prefix}workspace_bytes_measured"] = used.workspace_bytes if used else None
            result[f"{prefix}workspace_bytes_planned"] = plan.workspace_bytes
        steps = [p for name, p in plans.items() if name != "setup"]
        result["arena_bytes"] = max((p.arena_bytes for p in steps), default=0)
        result["pool_bytes"] = max((p.pool_bytes for p in steps), default=0)
        result["reserved_bytes"] = self.mem.reserved_bytes
        result["max_rss_bytes"] = _max_rss()
        return result

    def evaluate(self, x: np.ndarray, y: np.ndarray, batches: int) -> tuple[float, float, int]:
        """Mean test accuracy and loss over `batches` consecutive batches of (x, y) (at most one pass; the last
        batch wraps around to the start when the set is not a multiple of the batch size)."""
        n = self.batch_shape[0]
        count = min(batches, -(-len(x) // n))
        stream = datasets.Batches(x, y, n, shuffle=False)
        accuracy = loss = 0.0
        for _ in range(count):
            xb, yb = stream.next()
            a, l_ = self.test_step(xb, yb)
            accuracy += a
            loss += l_
        return accuracy / count, loss / count, count


def _max_rss() -> int | None:
    """High-water mark of the process's resident memory in bytes (None where the platform does not say)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# ----------------------------------------------------------------------------------------------------------------
# the run

class _Signals:
    """Turn SIGINT/SIGTERM into a flag the loop checks after each step."""

    def __init__(self):
        self.received: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None:     # a second signal: stop now
            signal.signal(signum, self._old[signum])
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False


def _say(args, text: str) -> None:
    if not args.quiet:
        print(text, flush=True)


def _error(model_cls, text: str) -> int:
    print(f"{model_cls.name}: error: {text}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _check_args(args) -> None:
    for key in ("iters", "test_iters", "save_every"):
        if getattr(args, key) < 0:
            raise RunError(f"--{key.replace('_', '-')} must be >= 0")
    if args.lr <= 0:
        raise RunError("--lr must be > 0")


# ----------------------------------------------------------------------------------------------------------------
# matrix products through the tiled multi-device GEMM

_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _byte_size(text: str) -> int:
    """'65536', '64K', '256M', '2G' (binary units, an optional trailing 'B' or 'iB') as bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _BYTE_UNITS and not t[-1:].isdigit() else ""
    try:
        value = int(float(t[:len(t) - len(unit)]) * _BYTE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size in bytes (e.g. 65536, 64K, 256M, 2G)") from None
    return value


def add_gemm_options(parser) -> None:
    """The command-line options that run the matrix products of the steps on the tiled multi-device GEMM."""
    parser.add_argument("--gemm-devices", type=int, default=0, metavar="N",
                        help="compute the matrix products (fully connected layers, convolutions) tiled over N "
                             "devices (simulated CPU devices with --device cpu); 0: numpy's matmul in place")
    parser.add_argument("--gemm-device-memory", type=_byte_size, metavar="BYTES",
                        help="memory of each GEMM device (e.g. 64M; default 256M); given alone, one device")
    parser.add_argument("--gemm-tile", type=int, default=512, metavar="T", help="GEMM tile edge in elements")


def _tiled_products(args):
    """The `gemm` function the options ask for (a TiledProducts), or None for numpy's own products."""
    count = getattr(args, "gemm_devices", 0)
    memory_bytes = getattr(args, "gemm_device_memory", None)
    if count < 0:
        raise RunError("--gemm-devices must be >= 0")
    if count == 0 and memory_bytes is None:
        return None
    count = max(count, 1)
    memory_bytes = (256 << 20) if memory_bytes is None else memory_bytes
    tile = args.gemm_tile
    if tile < 1:
        raise RunError("--gemm-tile must be >= 1")
    need = 5 * tile * tile * 4          # a device holds an accumulator, two operand tiles, a spare and its scratch
    if memory_bytes < need:
        raise RunError(f"--gemm-device-memory {memory_bytes} bytes holds fewer than 5 float32 tiles of "
                       f"{tile}x{tile} (needs at least {need}); give more memory or a smaller --gemm-tile")
    if args.device != "cpu":
        raise RunError("--gemm-devices: only the CPU backend routes its matrix products through the tiled GEMM")
    from deepdsl_runtime.gemm import TiledGemm
    from deepdsl_runtime.gemm_backend import TiledProducts, cpu_devices
    return TiledProducts(TiledGemm(cpu_devices(count, memory_bytes), tile=tile))


def _checkpoint(model: Model, iteration: int, position: tuple[int, int], data_spec: str) -> ckpt.Checkpoint:
    return ckpt.Checkpoint(path="", tensors=model.host_tensors(), network=model.name,
                           structure_hash=model.structure_hash, iteration=iteration, seed=model.seed,
                           data_position=position, data=data_spec)


def _resume(model: Model, path: str) -> ckpt.Checkpoint:
    found = ckpt.read(path)
    if found.network != model.name:
        raise ckpt.CheckpointError(f"{path}: field '__network__': a checkpoint of '{found.network}', this program "
                                   f"trains '{model.name}'")
    if found.structure_hash != model.structure_hash:
        raise ckpt.CheckpointError(
            f"{path}: field '__structure_hash__': written by a program of another structure ({found.structure_hash}, "
            f"this one is {model.structure_hash}); use --fresh, or --init-from to reuse matching parameters")
    ckpt.check_tensors(found, model.expected_shapes())
    return found


def _init_from(model: Model, path: str, args) -> None:
    source = ckpt.read(path)
    loaded, skipped = [], []
    candidates = {**model.params, **{k: s for k, s in model.states.items() if not s.optimizer}}
    for name, spec in candidates.items():
        array = source.tensors.get(name)
        if array is None:
            skipped.append(f"{name} (not in file)")
        elif tuple(array.shape) != tuple(spec.shape):
            skipped.append(f"{name} (shape {'x'.join(map(str, array.shape))} in file, "
                           f"{'x'.join(map(str, spec.shape))} here)")
        elif array.dtype.kind != "f" or not np.all(np.isfinite(array)):
            skipped.append(f"{name} (not finite float data)")
        else:
            model.tensors[name] = model.rt.asarray(array.astype(np.float32))
            loaded.append(name)
    _say(args, f"initialized {len(loaded)} of {len(candidates)} tensors from {path}"
               + (f"; skipped: {', '.join(skipped)}" if skipped else ""))


def run(model_cls: type[Model], args) -> int:
    """Train and test as the parsed command-line options say; returns the exit status."""
    try:
        return _Run(model_cls, args).execute()
    except (RunError, ckpt.CheckpointError, datasets.DataError) as err:
        return _error(model_cls, str(err))


class _Run:
    """One invocation of a generated program: start (fresh, resumed or fine-tuned), train, test, report."""

    def __init__(self, model_cls: type[Model], args):
        _check_args(args)
        self.args = args
        self.model = model_cls(args.device, args.seed, getattr(args, "memory_mode", "static"),
                               getattr(args, "check_memory", False))
        self.products = _tiled_products(args)
        if self.products is not None:
            self.model.rt = self.model.rt.with_gemm(self.products)
        self.path = args.params
        self.data_spec = args.data or self.model.dataset
        self.batch = self.model.batch_shape[0]
        self.resumed: ckpt.Checkpoint | None = None
        if self.path and os.path.exists(self.path) and not args.fresh:
            self.resumed = _resume(self.model, self.path)
            self.model.seed = self.resumed.seed
        if args.init_from and self.resumed is None:
            ckpt.read(args.init_from)            # an unusable file is an error before anything else happens

    def execute(self) -> int:
        args, model = self.args, self.model
        if self.resumed is None and args.iters == 0:
            return self.write_initial()
        data = datasets.load(self.data_spec, model.batch_shape[1:], model.classes, seed=model.seed, batch=self.batch)
        self.stream = datasets.Batches(data.x_train, data.y_train, self.batch, seed=model.seed)
        if self.resumed is not None:
            model.load_tensors({k: self.resumed.tensors[k] for k in model.expected_shapes()})
            self.stream.position = self.resumed.data_position
            start = self.resumed.iteration
            _say(args, f"resuming from {self.path} at iteration {start}")
        else:
            self.fresh_start()
            start = 0
        model.prepare(self.hyper(0))
        iteration, loss, elapsed = start, None, 0.0
        if args.iters > start:
            _say(args, f"training {model.name} on {self.data_spec} ({len(data.x_train)} examples, batch "
                       f"{self.batch}) on {args.device}: iterations {start + 1} to {args.iters}")
            iteration, loss, elapsed, stopped = self.train(start)
            if stopped is not None:
                return stopped
        else:
            _say(args, f"nothing to train: already at iteration {iteration} of {args.iters}")
        accuracy = test_loss = None
        if args.test_iters:
            accuracy, test_loss, batches = model.evaluate(data.x_test, data.y_test, args.test_iters)
            _say(args, f"test accuracy {accuracy:.4f}, test loss {test_loss:.4f} ({batches} batches of {self.batch})")
        done = iteration - start
        per_iter = elapsed / done if done else None
        if per_iter is not None:
            _say(args, f"{per_iter * 1000:.2f} ms per iteration ({done} iterations in {elapsed:.2f} s)")
        if self.products is not None:
            g = self.products.totals()
            _say(args, f"matrix products: {g['calls']} tiled GEMMs on {g['devices']} devices, "
                       f"{g['bytes_moved'] / 1e6:.2f} MB moved, output tiles per device {g['tasks_per_device']}")
        figures = model.memory_report()
        if figures["peak_bytes_measured"] is not None:
            _say(args, f"tensor memory ({figures['memory_mode']}): peak {figures['peak_bytes_measured'] / 1e6:.2f} MB "
                       f"measured, {figures['peak_bytes_planned'] / 1e6:.2f} MB planned; workspace "
                       f"{figures['workspace_bytes_measured'] / 1e6:.2f} MB")
        if args.report_json:
            report = {"network": model.name, "device": args.device, "data": self.data_spec, "batch": self.batch,
                      "iterations": iteration, "iterations_run": done, "loss": loss, "test_accuracy": accuracy,
                      "test_loss": test_loss, "seconds_per_iter": per_iter, "params": self.path or None, **figures,
                      "gemm": self.products.totals() if self.products is not None else None}
            with open(args.report_json, "w") as f:
                json.dump(report, f, indent=2)
                f.write("\n")
        return 0

    def hyper(self, iteration: int) -> dict:
        args = self.args
        return self.model.hyper(args.lr, getattr(args, "momentum", 0.0), args.decay, iteration)

    def fresh_start(self) -> None:
        self.model.initialize(self.args.seed)
        if self.args.init_from:
            _init_from(self.model, self.args.init_from, self.args)

    def write_initial(self) -> int:
        """--iters 0: the initial parameters go to --params."""
        if not self.path:
            raise RunError("--iters 0 writes the initial parameters to --params, which is empty")
        self.fresh_start()
        ckpt.write(self.path, _checkpoint(self.model, 0, (0, 0), self.data_spec))
        _say(self.args, f"wrote initial parameters to {self.path}")
        return 0

    def save(self, iteration: int) -> bool:
        """Write the checkpoint unless the tensors went non-finite (the last good one stays)."""
        if not self.path:
            return False
        state = _checkpoint(self.model, iteration, self.stream.position, self.data_spec)
        if not all(np.all(np.isfinite(a)) for a in state.tensors.values()):
            print(f"{self.model.name}: warning: NaN or infinite parameters at iteration {iteration}; "
                  f"{self.path} is not overwritten", file=sys.stderr, flush=True)
            return False
        ckpt.write(self.path, state)
        return True

    def train(self, start: int) -> tuple[int, float | None, float, int | None]:
        """Train from iteration `start` to --iters: (iteration reached, last loss, seconds, exit status if the
        run must stop here)."""
        args, model = self.args, self.model
        iteration, loss = start, None
        bar = _progress(args, start)
        with _Signals() as signals:
            began = time.perf_counter()
            try:
                while iteration < args.iters:
                    xb, yb = self.stream.next()
                    value = model.train_step(xb, yb, step=iteration, **self.hyper(iteration))
                    if not math.isfinite(value):
                        print(f"{model.name}: error: the loss is {value} at iteration {iteration + 1}; training "
                              "stopped" + (f", {self.path} keeps the last good checkpoint" if self.path else ""),
                              file=sys.stderr, flush=True)
                        return iteration, loss, time.perf_counter() - began, EXIT_DIVERGED
                    iteration, loss = iteration + 1, value
                    if bar is not None:
                        bar.set_postfix_str(f"loss {value:.4f}", refresh=False)
                        bar.update(1)
                    if signals.received is not None:
                        break
                    if args.save_every and iteration % args.save_every == 0 and iteration < args.iters:
                        self.save(iteration)
            finally:
                if bar is not None:
                    bar.close()
            elapsed = time.perf_counter() - began
            if signals.received is not None:
                saved = self.save(iteration)
                name = signal.Signals(signals.received).name
                print(f"{model.name}: {name} at iteration {iteration}" + (f"; saved {self.path}" if saved else ""),
                      file=sys.stderr, flush=True)
                return iteration, loss, elapsed, 128 + signals.received
        saved = self.save(iteration)
        _say(args, f"trained to iteration {iteration}, last loss {loss:.4f}" + (f"; saved {self.path}" if saved else ""))
        return iteration, loss, elapsed, None


def _progress(args, start: int):
    if args.quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=args.iters, initial=start, unit="it", dynamic_ncols=True, mininterval=0.5)
