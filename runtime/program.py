"""What every generated training program shares: the model base class, and (from `deepdsl_runtime.run`) the
training loop behind its command line.

A generated program (`generated/<network>.py`) holds the network-specific parts: a `Model` subclass with the
parameter and state declarations and the compiled `setup`, `train_step` and `test_step` methods (and, compiled
with --data-parallel, `accumulate_step` and `apply_step`), and a `main()` whose argparse options default to the
network's `Train(...)`. `run(ModelClass, args)` does the rest (`deepdsl_runtime.run`).
"""
from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from deepdsl_runtime import data as datasets
from deepdsl_runtime import memory, parallel
from deepdsl_runtime.cpu import heap
from deepdsl_runtime.cpu.cores import FreeCores
from deepdsl_runtime.cpu.linalg import Products
from deepdsl_runtime.frames import roomy
from deepdsl_runtime.memory import StepPlan
from deepdsl_runtime.run import (KERNELS, RunError, add_gemm_options, add_kernel_options,  # noqa: F401
                                 add_parallel_options, add_workflow_options, run)

__all__ = ["Model", "Param", "RunError", "State", "StepPlan", "add_gemm_options", "add_kernel_options",
           "add_parallel_options", "add_workflow_options", "backend", "initial_value", "model_class", "run"]


def backend(device: str) -> ModuleType:
    """The runtime module implementing the ops on `device` (`deepdsl_runtime.cpu`, `deepdsl_runtime.cuda`), its
    device started."""
    if device not in ("cpu", "cuda"):
        raise RunError(f"unknown device '{device}' (use cpu or cuda)")
    try:
        module = importlib.import_module(f"deepdsl_runtime.{device}")
        if device == "cuda":
            module.start()
        return module
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
        high = math.sqrt(3.0 / fan_in)
        low = -high
        # rng.uniform(low, high, shape) bit for bit, as numpy computes it (low + (high - low) * u, u from
        # rng.random), in place: 4x faster than rng.uniform here (7 against 27 ns an element)
        values = rng.random(shape)
        values *= high - low
        values += low
        return values.astype(np.float32)
    if kind == "gaussian":
        return rng.normal(0.0, value, shape).astype(np.float32)
    if kind == "constant":
        return np.full(shape, value, dtype=np.float32)
    raise ValueError(f"unknown initializer '{init}'")


class Model:
    """Parameters, state and hoisted values of one network (in `tensors`, by name) plus its compiled steps.

    Subclasses (generated) set the class attributes and define `setup`, `train_step(x, y, *, step, <hyper>)`
    returning the loss, `test_step(x, y)` returning (accuracy, loss, ranks: each row's rank of its label among its
    scores, None for a network that is no classifier) and, where the network says what it predicts,
    `predict_step(x)` returning its outputs (a classifier's class probabilities). `memory_plans` holds each step's memory
    plan; the steps take their buffers from `self.mem`, an allocator of `memory_mode` (static, pooled, dynamic;
    see `deepdsl_runtime.memory`) that also measures what they use."""

    name = ""
    source = ""
    structure_hash = ""
    optimizer = "sgd"
    betas = (0.9, 0.999)
    batch_shape: tuple[int, ...] = ()
    classes = 0
    tokens = False             # the input is (N, T) integer tokens (a language model's), not images
    vocab = 0                  # tokens: their vocabulary (0: the classes, a language model's)
    label_shape: tuple[int, ...] = ()     # a label per example (), or per position (T,) (a language model's)
    target_shape: tuple[int, ...] | None = None     # float targets of this shape per example, instead of labels
    dataset = "synthetic"
    defaults: dict = {}        # the network's Train(...): "iters", the training length without --iters or --epochs
    params: dict[str, Param] = {}
    states: dict[str, State] = {}
    accumulators: dict[str, State] = {}      # of accumulate_step and apply_step, where compiled
    batch_statistics: dict[str, State] = {}  # written by accumulate_step, read by statistics_step (batch norm)
    setup_inputs: tuple[str, ...] = ()
    memory_plans: dict[str, StepPlan] = {}

    STEPS = ("setup", "train_step", "test_step", "predict_step", "accumulate_step", "apply_step", "statistics_step")

    def __init_subclass__(cls, **kwargs):
        """A generated class's steps run with room on the frame stack for their calls (`deepdsl_runtime.frames`)."""
        super().__init_subclass__(**kwargs)
        for name in cls.STEPS:
            step = cls.__dict__.get(name)
            if callable(step):
                setattr(cls, name, roomy(step))

    def __init__(self, device: str = "cpu", seed: int = 0, memory_mode: str = "static", check_memory: bool = False,
                 kernels: str = "auto", threads: int | None = None):
        self.rt = backend(device)
        self.free_cores: FreeCores | None = None
        self.threads = 1
        self.products: Products | None = None
        # on the CPU: the program's compiled kernels where its library is built ("auto"), else numpy's
        self.kernels = f"{device} kernels"
        if device == "cpu":
            heap.map_large_arrays()         # (freed temporaries go back to the system: a lower peak RSS)
            found = self._compiled_kernels(kernels, threads)
            # the products on the kernels' threads where the library computes them, else numpy's in the same parts
            self.products = None if found is not None and found.products else Products(self.threads)
            self.rt = self.rt.backend(found, self.products)
        if memory_mode not in memory.MODES:
            raise RunError(f"unknown memory mode '{memory_mode}' (use {', '.join(memory.MODES)})")
        # a device backend serves the plan from device memory (the same bookkeeping) and runs this program's kernels
        self.mem = getattr(self.rt, "allocator", memory.allocator)(memory_mode, self.memory_plans, check=check_memory)
        bind = getattr(self.rt, "bind_program", None)
        program = self.program_file()
        if bind is not None and program:
            try:
                bind(program)
            except FileNotFoundError as err:
                raise RunError(str(err)) from None
        self.tensors: dict[str, object] = {}
        self.seed = seed
        self.ranks = parallel.Alone()     # the job's ranks, which the accumulate step's batch statistics sum over
        self.reduction = parallel.AFTER_THE_STEP     # told when accumulate_step finishes each accumulator

    def _compiled_kernels(self, kernels: str, threads: int | None):
        """The program's compiled CPU kernels (`deepdsl_runtime.cpu.native`), or None for numpy's; `kernels` is
        "auto" (compiled where built), "compiled" (an error where not) or "numpy". `self.kernels` says which run
        and why. Sets the threads (default: the cores available) and numpy's BLAS to one: the products are cut into
        parts fixed by their shapes, which the threads take (`contract.product_cuts`), so no bit depends on the
        threads."""
        from deepdsl_runtime.cpu import native as compiled

        if kernels not in KERNELS:
            raise RunError(f"unknown kernels '{kernels}' (use {', '.join(KERNELS)})")
        if threads is not None and threads < 1:
            raise RunError("--threads must be >= 1")
        # without a thread count asked for: the cores available, fewer while other processes keep some busy
        self.free_cores = FreeCores(compiled.threads_available()) if threads is None else None
        self.threads = threads = threads or compiled.threads_available()
        compiled.set_blas_threads(1)
        if kernels == "numpy":
            self.kernels = "numpy kernels"
            return None
        program = self.program_file()
        found, why = compiled.load(program) if program else (None, "not a generated program")
        if found is None:
            if kernels == "compiled":
                raise RunError(f"compiled CPU kernels: {why}")
            self.kernels = f"numpy kernels: {why}"
            return None
        found.set_threads(threads)
        self.kernels = f"compiled kernels, {threads} thread{'s' if threads > 1 else ''}"
        return found

    def follow_free_cores(self) -> int | None:
        """Between steps, where the run did not ask for a thread count: the threads (the compiled kernels', or
        numpy's products') set to the cores other processes leave free (`deepdsl_runtime.cpu.cores`) when those
        changed, and returned; else None. The bits do not change with them."""
        threads = self.free_cores.update() if self.free_cores is not None else None
        if threads is not None:
            self.threads = threads
            if self.rt.native is not None:
                self.rt.native.set_threads(threads)
            if self.products is not None:
                self.products.set_threads(threads)
        return threads

    @classmethod
    def random_batch(cls, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """A batch of random data of this model's input and labels, drawn from `rng` (normal images or uniform
        tokens, uniform labels): for timing and tests."""
        n = cls.batch_shape[0]
        if cls.target_shape is not None:
            return (rng.standard_normal(cls.batch_shape).astype(np.float32),
                    rng.standard_normal((n, *cls.target_shape)).astype(np.float32))
        if cls.tokens:
            return (rng.integers(0, cls.vocab or cls.classes, cls.batch_shape).astype(np.int32),
                    rng.integers(0, cls.classes, (n, *cls.label_shape)).astype(np.int32))
        return (rng.standard_normal(cls.batch_shape).astype(np.float32),
                rng.integers(0, cls.classes, n).astype(np.int32))

    @classmethod
    def program_file(cls) -> str | None:
        """The generated program's own file (None for a class not defined in one)."""
        step = getattr(cls.train_step, "__wrapped__", cls.train_step)      # (`roomy` wraps the steps)
        return getattr(step, "__globals__", {}).get("__file__")

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
        if self.optimizer in ("adam", "adamw"):
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

    def test_step(self, x, y) -> tuple[float, float, np.ndarray | None]:
        raise NotImplementedError

    def predict_step(self, x) -> np.ndarray:
        raise RunError(f"{self.name} has no predict step: its accuracy is no D.precision (a classifier's predict "
                       "step gives its class probabilities); give D.Loop a prediction= (the network's output) and "
                       "compile it again")

    def accumulate_step(self, x, y, *, step: int) -> float:
        raise NotImplementedError

    def apply_step(self, *, scale, **hyper) -> None:
        raise NotImplementedError

    def statistics_step(self) -> None:
        """Nothing to update (a network without batch norm)."""

    def memory_report(self, train: str = "train_step") -> dict:
        """The memory figures of the report: planned, and measured by the allocator in the steps that ran (None for
        a step that did not run). `peak_bytes_*` and `workspace_bytes_*` are those of the step `train` that trains
        (`accumulate_step` when gradients are accumulated), `test_*` the test step's; `arena_bytes` and
        `pool_bytes` what the static and pooled modes reserve, `reserved_bytes` what this run's mode reserved,
        `max_rss_bytes` the process's resident-set high-water mark."""
        usage, plans = self.mem.usage, self.memory_plans
        result = {"memory_mode": self.mem.mode}
        for prefix, step in (("", train), ("test_", "test_step")):
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

    def evaluate(self, x: np.ndarray, y: np.ndarray, batches: int, top: tuple[int, ...] = ()) -> "Evaluation":
        """The test step over the first `batches` batches of (x, y) (at most one pass: the last batch completed
        with the first examples when the set is not a multiple of the batch size, which are not counted twice)."""
        n = self.batch_shape[0]
        count, examples = datasets.evaluation_extent(len(x), n, batches)
        return self.evaluate_batches(datasets.Batches(x, y, n, shuffle=False), count, examples, top)

    def evaluate_batches(self, stream, count: int, examples: int | None = None,
                         top: tuple[int, ...] = ()) -> "Evaluation":
        """The test step over the next `count` batches of `stream` (its `next()` gives a batch), of which the first
        `examples` rows count (default: all): a classifier's accuracy and top-k accuracies (each k of `top`)
        counted exactly over those rows (from the ranks of their labels), another network's accuracy and every
        loss the mean of its batches' weighted by the rows each adds. Summed in batch order in float64: the same
        figures on every rank and at every thread count."""
        n = self.batch_shape[0]
        examples = count * n if examples is None else examples
        within = {k: 0 for k in sorted({1, *top})}
        loss = accuracy = 0.0
        rows = 0
        for b in range(count):
            xb, yb = stream.next()
            a, l_, ranks = self.test_step(xb, yb)
            valid = min(n, examples - b * n)
            loss += l_ * valid
            accuracy += a * valid
            if ranks is not None:
                counted = ranks.reshape(n, -1)[:valid]          # a language model ranks every position
                rows += counted.size
                for k in within:
                    within[k] += int(np.count_nonzero(counted < k))
        if not count:
            return Evaluation(0, 0, math.nan, math.nan, {})
        if rows:
            return Evaluation(count, examples, loss / examples, within[1] / rows,
                              {k: within[k] / rows for k in top}, rows)
        return Evaluation(count, examples, loss / examples, accuracy / examples, {})


@dataclass(frozen=True)
class Evaluation:
    """What the test step gave over some batches of a split: `examples` counted in `batches` batches, the mean
    loss, the accuracy (a classifier's top-1) and a classifier's top-k accuracies by k; `rows` the labels ranked
    (a language model's: every position of every sequence; 0 for a network that is no classifier)."""

    batches: int
    examples: int
    loss: float
    accuracy: float
    top: dict[int, float]
    rows: int = 0

    def figures(self, prefix: str = "val_") -> dict:
        """The figures as a log entry's fields: `val_loss`, `val_accuracy`, `val_top5`, `val_examples`."""
        return {f"{prefix}loss": self.loss, f"{prefix}accuracy": self.accuracy,
                **{f"{prefix}top{k}": v for k, v in self.top.items()}, f"{prefix}examples": self.examples}


def model_class(module) -> type[Model]:
    """The model class a generated program's module defines (its one subclass of `Model`): how tools that import a
    program find it."""
    return next(v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Model) and v is not Model)


def _max_rss() -> int | None:
    """High-water mark of the process's resident memory in bytes (None where the platform does not say)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
