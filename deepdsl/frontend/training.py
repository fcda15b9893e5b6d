"""Losses and metrics, the solvers (`Train`, `Adam`, `AdamW`) and the `Loop` a network file compiles."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from deepdsl.errors import DeepDSLError, ShapeError, user_location
from deepdsl import provenance
from deepdsl.ir import FLOAT, Node, make, toposort
from deepdsl.ops import dims
from deepdsl.ops import loss as L
from deepdsl.ops.elementwise import reshape
from deepdsl_runtime.schedule import Schedule, ScheduleError
from deepdsl.frontend.core import (Layer, Tensor, _fraction, _leaf_makers, _name, _nonnegative_int,
                                   _nonnegative_number, _positive_number, _reject)
from deepdsl.frontend.layers import _Op

def _label_fn(label: str, y: Tensor, build: Callable[[Node, Node], Node]) -> Layer:
    def check(x: Node) -> Node:
        classes = y.meta.get("classes")
        if classes is not None and len(x.shape) >= 2 and x.shape[-1] != classes:
            raise ShapeError(f"{x.shape[-1]} scores per example for {classes} classes")
        labels = y.node
        if len(labels.shape) == 2 and x.shape[:-1] == labels.shape:
            # a label per position of each sequence: every position is an example
            rows = labels.shape[0] * labels.shape[1]
            x, labels = reshape(x, (rows, x.shape[-1])), reshape(labels, (rows,))
        return build(x, labels)
    return _Op(label, label, check)


def log_loss(y: Tensor) -> Layer:
    """-mean log p[label] of probabilities (apply after softmax)."""
    return _label_fn("log_loss", y, L.log_loss)


def cross_entropy(y: Tensor) -> Layer:
    """Softmax cross entropy of logits: -mean log_softmax(z)[label]."""
    return _label_fn("cross_entropy", y, L.cross_entropy)


def nll_loss(y: Tensor) -> Layer:
    """-mean of log-probabilities at the labels (apply after log_softmax)."""
    return _label_fn("nll_loss", y, L.nll)


def mse_loss(y: Tensor) -> Layer:
    """Mean squared error against float targets of the output's shape (PyTorch's MSELoss): mean((z - y)^2)."""
    def build(x: Node) -> Node:
        if y.node.dtype != FLOAT or y.shape != x.shape:
            raise ShapeError(f"mse_loss of an output of {dims(x.shape)} against {y.node.dtype} targets of "
                             f"{dims(y.shape)}: the targets must be floats of the output's shape (D.targets)")
        return ((Tensor(x) - y) ** 2).mean().node
    return _Op("mse_loss", "mean squared error", build)


def precision(y: Tensor) -> Layer:
    """Top-1 accuracy of scores against labels."""
    return _label_fn("precision", y, lambda x, labels: make("precision", (x, labels)))


# ----------------------------------------------------------------------------------------------------------------
# training

@dataclass(frozen=True)
class Train:
    """The solver: SGD with momentum (`nesterov=True`: Nesterov's), weight decay (added to the gradient before
    momentum, as PyTorch does) and global gradient-norm clipping (`clip`, 0 = none), or Adam (`optimizer="adam"`,
    L2 decay) or AdamW (`optimizer="adamw"`, decay decoupled from the gradient); the learning rate follows
    `schedule` (`constant`, `step:SIZE:GAMMA`, `cosine[:MIN]`) after `warmup` iterations of linear warm-up, as
    PyTorch's schedulers compute it (`deepdsl_runtime.schedule`)."""

    name: str
    iters: int = 1000
    test_iters: int = 10
    lr: float = 0.01
    momentum: float = 0.9
    decay: float = 0.0
    clip: float = 0.0
    optimizer: str = "sgd"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "constant"
    warmup: int = 0
    nesterov: bool = False

    def __post_init__(self):
        what = f"Train '{_name('D.Train', self.name)}'"
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum):
            _reject(what, "nesterov needs the sgd optimizer and a momentum > 0 (as PyTorch's SGD)")
        _nonnegative_int(what, "warmup", self.warmup)
        try:
            Schedule.parse(self.schedule, self.warmup, self.iters)
        except ScheduleError as err:
            _reject(what, str(err).replace("--lr-schedule", "schedule"))
        if self.optimizer not in ("sgd", "adam", "adamw"):
            _reject(what, f"unknown optimizer {self.optimizer!r} (use 'sgd', 'adam' or 'adamw')")
        _nonnegative_int(what, "iters", self.iters)
        _nonnegative_int(what, "test_iters", self.test_iters)
        _positive_number(what, "lr", self.lr)
        _fraction(what, "momentum", self.momentum)
        _nonnegative_number(what, "decay", self.decay)
        _nonnegative_number(what, "clip", self.clip)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            _reject(what, f"betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        for key, beta in zip(("betas[0]", "betas[1]"), self.betas):
            _fraction(what, key, beta)
        object.__setattr__(self, "betas", tuple(self.betas))   # frozen, and hashable
        _positive_number(what, "eps", self.eps)


def Adam(name: str, iters: int = 1000, test_iters: int = 10, lr: float = 1e-3, betas=(0.9, 0.999),
         eps: float = 1e-8, decay: float = 0.0, clip: float = 0.0, schedule: str = "constant",
         warmup: int = 0) -> Train:
    return Train(name, iters, test_iters, lr, 0.0, decay, clip, "adam", betas, eps, schedule, warmup)


def AdamW(name: str, iters: int = 1000, test_iters: int = 10, lr: float = 1e-3, betas=(0.9, 0.999),
          eps: float = 1e-8, decay: float = 0.01, clip: float = 0.0, schedule: str = "constant",
          warmup: int = 0) -> Train:
    """PyTorch's AdamW: the parameter shrinks by lr * decay before the Adam step, which sees no decay."""
    return Train(name, iters, test_iters, lr, 0.0, decay, clip, "adamw", betas, eps, schedule, warmup)


@dataclass
class Loop:
    """What a network file compiles: a scalar training loss, a scalar test accuracy and the solver; `prediction`,
    what the program's predict step computes (`deepdsl predict`), where the accuracy is no `precision` (a
    classifier's predict step gives the softmax of the scores its precision reads)."""

    loss: Tensor
    accuracy: Tensor
    solver: Train
    prediction: Tensor | None = field(default=None, kw_only=True)
    source: str | None = field(default=None, compare=False)
    # the batch and image sizes it was loaded with (`deepdsl.load`), so it can be loaded again at another batch
    overrides: Any = field(default=None, compare=False, repr=False)
    # where its values came from (`deepdsl.provenance`): the table of the network file that made it
    origins: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.origins is None:
            self.origins = provenance.table()
        for what in ("loss", "accuracy"):
            t = getattr(self, what)
            if not isinstance(t, Tensor) or t.shape != ():
                got = dims(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise DeepDSLError(f"Loop: {what} must be a scalar tensor, got {got}", user_location())
        if self.prediction is not None and not isinstance(self.prediction, Tensor):
            raise DeepDSLError(f"Loop: prediction must be a tensor (the network's output), got "
                               f"{type(self.prediction).__name__}", user_location())
        if not isinstance(self.solver, Train):
            raise DeepDSLError("Loop: solver must be a D.Train(...)", user_location())
        self.defined_at = user_location()

    @property
    def name(self) -> str:
        return self.solver.name


_LEAF_KINDS = {"input": "input", "param": "parameter", "state": "running statistic"}


def check_names(loop: Loop) -> None:
    """Two different tensors of one name among the inputs, parameters and running statistics of `loop` (two layers
    named alike, an input named like a parameter) are an error at the line that made the later one."""
    makers = _leaf_makers.get() or {}
    first: dict[str, Node] = {}
    for node in toposort([loop.loss.node, loop.accuracy.node]):
        if node.op not in _LEAF_KINDS or first.setdefault(node.name, node) is node:
            continue
        earlier, later = sorted((first[node.name], node), key=lambda n: n.serial)
        maker, location = makers.get(later, ("D.Loop", loop.defined_at))
        other, other_location = makers.get(earlier, ("another definition", None))
        if other_location is not None:
            same_file = location is not None and other_location.filename == location.filename
            other += f" at line {other_location.lineno}" if same_file else f" at {other_location}"
        raise DeepDSLError(f"{maker}: {_LEAF_KINDS[later.op]} '{later.name}' ({dims(later.shape)}) is also the name of "
                           f"the {_LEAF_KINDS[earlier.op]} ({dims(earlier.shape)}) made by {other}; "
                           "give them distinct names", location or loop.defined_at)
