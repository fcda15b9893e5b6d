"""The op registry: each op keeps its shape rule, VJP rule, reference semantics and lowering in one class.

Adding an op means writing one `Op` subclass here (plus its runtime kernel). The shape rule runs when a node is made
(`deepdsl.ir.make`), the VJP rule during differentiation, `evaluate` in the reference interpreter (the numpy oracle
for every pass); the runtime function a generated program calls is named after the op (`rt.<name>`).
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import numpy as np

from deepdsl.errors import ShapeError
from deepdsl.ir import HIDDEN, Node
from deepdsl_runtime.contract import FLOAT_BYTES

_REGISTRY: dict[str, "Op"] = {}


class EvalContext:
    """What the reference interpreter passes to `Op.evaluate`: the float dtype and the random-number seed."""

    def __init__(self, float_dtype=np.float32, seed: int = 0, step: int = 0):
        self.float_dtype = float_dtype
        self.seed = seed
        self.step = step


class Workspace(NamedTuple):
    """Scratch memory a statement needs while it runs: `nbytes`, and the number of chunks of the batch it runs in to
    stay within a limit (1: the whole batch at once). The figure is exactly what the CPU runtime's kernel carves out
    of the workspace it is handed (`deepdsl_runtime.cpu`): both take the scratch of a sample from the same function
    of `deepdsl_runtime.contract`, so the memory plan's workspace is the one the program uses; the runtime derives
    its chunk size from the size it is given, the same way as `batch_chunks`."""

    nbytes: int
    chunks: int = 1


def batch_chunks(batch: int, per_sample: int, limit: int | None, fixed_if_split: int = 0) -> Workspace:
    """The smallest number of batch chunks whose workspace (`per_sample` bytes per sample, plus `fixed_if_split`
    bytes when there is more than one chunk) fits `limit`; one sample per chunk when even that does not fit (the
    workspace then exceeds the limit)."""
    if per_sample <= 0 or batch <= 0:
        return Workspace(0)
    whole = batch * per_sample
    if limit is None or whole <= limit:
        return Workspace(whole)
    samples = (limit - fixed_if_split) // per_sample
    chunks = batch if samples < 1 else -(-batch // samples)
    nbytes = -(-batch // chunks) * per_sample + fixed_if_split
    return Workspace(whole) if nbytes >= whole else Workspace(nbytes, chunks)


def scratch_chunks(batch: int, per_sample: int, limit: int | None, fixed_if_split: int = 0) -> Workspace:
    """`batch_chunks` of a kernel's scratch stated as `deepdsl_runtime.contract` states it: in float32 elements of
    the workspace (`per_sample` per sample, `fixed_if_split` once when the batch runs in more than one chunk)."""
    return batch_chunks(batch, per_sample * FLOAT_BYTES, limit, fixed_if_split * FLOAT_BYTES)


class Op:
    """Base class of ops. Subclasses set `name` and override the rules they have."""

    name: ClassVar[str]
    view: ClassVar[bool] = False        # the output aliases input 0 (reshape): costs no memory
    random: ClassVar[bool] = False      # draws random numbers: never hoisted, never merged across layers
    collective: ClassVar[bool] = False  # a sum over the ranks of a data-parallel job: unknown when compiling, never folded
    # inputs the runtime kernel may overwrite with the output (same shape and dtype) when they die at the statement:
    # it reads every position of such an input before it writes that position (the in-place pass, `passes/inplace.py`)
    in_place: ClassVar[tuple[int, ...]] = ()
    # an input whose storage the output may take over from its start when that input dies at the statement: the op
    # computes each sample of its output from the same sample of that input, and the runtime kernel runs the samples
    # in an order that reads each one before its bytes are overwritten (the memory plan, `deepdsl/memory_plan.py`)
    takes_over: ClassVar[int | None] = None
    # one pass over its inputs (elementwise, pooling or channel windows): the rematerialization pass may compute it
    # again before late uses rather than keep it alive (`passes/rematerialize.py`)
    cheap: ClassVar[bool] = False

    def infer(self, *inputs: Node, **attrs: Any) -> tuple[tuple[int, ...], str]:
        raise NotImplementedError(self.name)

    def vjp(self, node: Node, g: Node) -> tuple[Node | None, ...]:
        """One cotangent per input of `node` given the cotangent `g` of its output (None: no gradient)."""
        raise NotImplementedError(f"op '{self.name}' has no VJP rule")

    def evaluate(self, ctx: EvalContext, *args: np.ndarray, **attrs: Any) -> np.ndarray:
        raise NotImplementedError(self.name)

    def aliases(self, node: Node) -> bool:
        """Whether `node`'s output is a view of its input 0 (`view`; an op may decide by its attributes and shapes):
        it computes nothing, costs no memory and lives in that input's storage (`deepdsl.storage`)."""
        return self.view

    def view_offset(self, node: Node) -> int:
        """Where a view's bytes start in its input's (`aliases`): 0 but for a slice's block."""
        return 0

    def overwritable(self, node: Node) -> tuple[int, ...]:
        """Positions of the inputs of `node` its output may be written over (see `in_place`)."""
        return self.in_place

    def workspace(self, node: Node, limit: int | None = None) -> Workspace:
        """Scratch bytes `node` needs while it runs, within `limit` bytes where the op can split its work."""
        return Workspace(0)

    def flops(self, node: Node) -> int:
        """Floating-point operations `node` costs, counting a multiply-add as two: what recomputing it costs (the
        memory budget, `deepdsl/budget.py`). By default one operation per element of its largest operand: a pass
        over its data (shape ops, masks, pooling of 1x1 windows)."""
        return max([node.size, *(i.size for i in node.inputs)])

    def describe(self, node: Node) -> str:
        """The op with its attributes as printed in IR dumps, e.g. `conv2d[stride=1,pad=0]`."""
        shown = [f"{k}={_fmt(v)}" for k, v in node.attrs if k not in HIDDEN]
        return f"{self.name}[{','.join(shown)}]" if shown else self.name


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ",".join(map(_fmt, value)) + ")"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def register(cls: type[Op]) -> type[Op]:
    _REGISTRY[cls.name] = cls()
    return cls


def get_op(name: str) -> Op:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op '{name}'") from None


def all_ops() -> dict[str, Op]:
    return dict(_REGISTRY)


def require(condition: bool, message: str) -> None:
    """Shape rules state their preconditions with this; the DSL adds the layer name and file line."""
    if not condition:
        raise ShapeError(message)


def dims(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


from deepdsl.ops import leaf, elementwise, shape, linalg, conv, pool, norm, loss, attention  # noqa: E402,F401  (registration)
