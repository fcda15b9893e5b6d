"""Step replay: a training step's calls of the compiled kernels recorded once, checked, and made again at every later
step without the step's Python.

A step's Python is the generated statements and the runtime's work for each op: the kernel for the operands'
layouts, their addresses, the ctypes call (about 10 us an op, a ViT's 200 ops 2 ms a step whatever its batch). In
static memory a step's buffers have the same addresses at every step, and so have the parameters and the
optimizer's state; which kernel an op runs depends on the operands' layouts alone. So a step calls the library
alike at every step, but for the values that come from the step's own arguments (the learning rate, Adam's bias
corrections, dropout's counters from the step number). `TrainSteps` runs the first steps in Python, then:

- records the step (`_Record`) three times from the same state: every call of the compiled kernels (the library
  loaded again as a `_RecordingLibrary`, the backend's ops on it) with a copy of its arguments (the arrays of
  pointers and values the kernels read included), every op of the backend that called none (numpy's work: the
  loss read back, a fill) as that op with its operands, and the batch's copies into its buffers. The first run
  takes the step's own arguments, the others each argument moved to other values. The three records must be alike
  but in slots that hold one of the step's arguments (a float, rounded to float32 where the kernel takes one) or
  the step number times a whole number plus another (dropout's counters): each such slot is bound to it (`_bind`).
- checks it against the step's Python on another batch (the samples in reverse order, floats scaled), from the
  same state, the static arena and the workspace filled with NaNs before the replay: the loss, the state and, op by
  op, what each op's arrays hold after it must be the Python step's, bit for bit (`_check`). An op that does
  numpy's work beside its calls (a copy, a fill) is found so, and is replayed by its Python from then on, with
  every op that takes its path (its name and its operands' layouts). A step that reads a buffer before it writes
  it, or decides anything by values, fails here and runs in Python from then on (`TrainSteps.why` says why).
- replays it (`_Replay`) at every later step: the batch copied into its buffers, the bound slots written, the
  calls made in order, the loss read: the same calls with the same arguments as the step's Python would make, so
  the same bits. A batch of another shape or dtype runs in Python; a change of the kernels' threads records the
  step again (its products are planned for them).

Only in static memory, with the compiled CPU kernels, in one process (a data-parallel step's reductions are left
to Python), and for `train_step` (gradient accumulation's steps run in Python). A recording costs five steps' work
once. `--no-replay` runs every step in Python.
"""
from __future__ import annotations

import ctypes
import math
import numbers
import operator
import os
import sys
import tempfile
import zlib

import numpy as np

from deepdsl_runtime import cpu

RECORDS = 4         # records made at most (one more each time the kernels' threads change or a tensor is replaced)
MIN_STEPS = 100     # steps a run makes at least for its step to be recorded (a record costs five steps' work)
WARMUP = 2          # steps run in Python before the step is recorded (the runtime's plans made, the caches filled)
_NUMBERS = (numbers.Integral, numbers.Real, np.number)

_RECORD: "_Record | None" = None        # the record being made: one at a time


class ReplayError(Exception):
    """Why a step cannot be replayed."""


class _RecordingLibrary(ctypes.CDLL):
    """A library loaded again whose functions add each call to the record being made (`_RECORD`)."""

    def __init__(self, original: ctypes.CDLL):
        super().__init__(original._name)
        plain, library = self._FuncPtr, original

        class _FuncPtr(plain):
            _flags_, _restype_ = plain._flags_, plain._restype_

            def __call__(self, *args):
                if _RECORD is not None:
                    _RECORD.call(library, self, args)
                return plain.__call__(self, *args)

        self._FuncPtr = _FuncPtr


def _copy(arg):
    """A call's argument as the record keeps it: a ctypes array copied (the runtime fills the same arrays for its
    next calls), a ctypes number's value in a new one, a number or None as it is."""
    if arg is None or isinstance(arg, _NUMBERS):
        return arg
    if isinstance(arg, ctypes.Array):
        return type(arg).from_buffer_copy(arg)
    if isinstance(arg, ctypes._SimpleCData):
        return type(arg)(arg.value)
    raise ReplayError(f"a kernel's argument of type {type(arg).__name__}")


def _slots(arg) -> list:
    """The values of an argument's slots: one for a number, each element for a ctypes array."""
    if isinstance(arg, ctypes.Array):
        return list(arg)
    if isinstance(arg, ctypes._SimpleCData):
        return [arg.value]
    return [arg]


class _Record:
    """One run of a step: its entries in order, ("call", library, function, arguments, values read into them),
    ("op", ...: `_recording_backend`) after an op's calls, or ("load", input, buffer). An array the runtime gives
    a kernel (its address, or a size-1 array's value) that is not the step's memory (`owners`: the static arena,
    the workspace, the model's tensors) is a temporary, gone by the next step: the op that gave it is replayed by
    its Python (`temporary`). A size-1 array given a kernel as a scalar is read into its call's values again at
    every replay."""

    def __init__(self, owners: set[int]):
        self.entries: list[tuple] = []
        self.owners = owners
        self.temporary = False                  # the current op gave a kernel a temporary
        self.reads: dict[int, list] = {}        # a ctypes array of values -> (element, the array read into it)

    def _note(self, x) -> None:
        if id(_owner(x)) not in self.owners:
            self.temporary = True

    def address(self, x) -> int:
        self._note(x)
        return _plain_address(x)

    def element(self, a, into, index: int) -> float:
        """A size-1 array's value read into element `index` of `into` for the next call: read again there at
        every replay."""
        self._note(a)
        self.reads.setdefault(id(into), []).append((index, a))
        return _plain_element(a, into, index)

    def call(self, library, function, args) -> None:
        reads = tuple((position, index, a) for position, arg in enumerate(args)
                      for index, a in self.reads.get(id(arg), ()))
        self.reads.clear()
        self.entries.append(("call", library, function, tuple(_copy(a) for a in args), reads))


_plain_address = _plain_element = None      # the runtime's `native._address` and `_element`, while recording


def _owner(x):
    """The array that owns the memory of array `x` (numpy keeps a view's first base that owns its data)."""
    while isinstance(getattr(x, "base", None), np.ndarray):
        x = x.base
    return x


def _owners(model) -> set[int]:
    """The ids of the arrays owning the step's memory: the static arena, the workspace, the model's tensors."""
    arrays = [model.mem.arena, model.mem.workspace_region,
              *(a for a in model.tensors.values() if isinstance(a, np.ndarray))]
    return {id(_owner(a)) for a in arrays}


def _view(name: str, kwargs: dict) -> bool:
    """Whether an op makes a view and writes nothing (a reshape; a slice without `out`)."""
    return name == "reshape" or name == "slice" and kwargs.get("out") is None


def _recording_backend(model, native):
    """The model's backend on a recording copy of its compiled kernels, each op but the views adding itself to the
    record after its calls: ("op", name, its op of the model's backend, operands, keywords, result, the index of
    its first call, whether it gave a kernel a temporary)."""
    copy = type(native)(_RecordingLibrary(native.lib), _RecordingLibrary(native.program))
    for name in ("tiles", "products", "winograd", "thin_filters", "tiled_convs"):
        setattr(copy, name, getattr(native, name))
    rt = cpu.backend(copy, model.products)         # (as `Model` makes its backend)

    def wrapped(name, op):
        plain = getattr(model.rt, name)             # (the op a replay calls)

        def recorded(*args, **kwargs):
            record, start = _RECORD, len(_RECORD.entries)
            record.temporary = False
            result = op(*args, **kwargs)
            if not _view(name, kwargs):
                record.entries.append(("op", name, plain, args, kwargs, result, start, record.temporary))
            return result
        return recorded

    ops = {name: wrapped(name, value) for name, value in vars(rt).items()
           if callable(value) and name not in ("backend", "with_gemm", "allocator")}
    return type(rt)(**{**vars(rt), **ops})


class _Saved:
    """The model's tensors (parameters, state, hoisted values) written to an unnamed temporary file and read back
    into the same arrays (`restore`): no second copy in memory while a step is recorded (a ResNet-50's 200 MB)."""

    def __init__(self, tensors: dict):
        self.arrays = [a for a in tensors.values() if isinstance(a, np.ndarray) and a.nbytes]
        if not all(a.flags.c_contiguous for a in self.arrays):
            raise ReplayError("a tensor of the model is not contiguous")
        try:
            self.file = tempfile.TemporaryFile()
            for a in self.arrays:
                self.file.write(memoryview(a).cast("B"))
            self.file.flush()
        except OSError as err:
            raise ReplayError(f"no room for a copy of the model's tensors: {err.strerror or err}") from None

    def restore(self, only=None) -> None:
        """All the tensors back, or `only` that one of them."""
        self.file.seek(0)
        for a in self.arrays:
            if only is not None and a is not only:
                self.file.seek(a.nbytes, 1)
                continue
            if self.file.readinto(memoryview(a).cast("B")) != a.nbytes:
                raise OSError("the copy of the model's tensors is short")
            if only is not None:
                return

    def close(self) -> None:
        self.file.close()


def _crc(a: np.ndarray) -> int:
    """The CRC-32 of an array's bytes: its values compared without a copy kept."""
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _sums(tensors: dict) -> dict:
    """The model's tensors' CRC-32s, by name: to compare states."""
    return {name: _crc(a) for name, a in tensors.items() if isinstance(a, np.ndarray)}


def _same_loss(a, b) -> bool:
    """Whether two losses are the same float (NaN included)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _moved(inputs: dict, run: int) -> dict:
    """The step's arguments moved to other values for record `run` (1, 2): each float by its own factor (no two
    arguments alike), the step number by a distinct offset."""
    if run == 0:
        return dict(inputs)
    moved = {}
    for i, (name, value) in enumerate(sorted(inputs.items())):
        if name == "step":
            moved[name] = value + (7 if run == 1 else 19)
        else:
            moved[name] = type(value)(value * (1.375 + 0.125 * i) ** run + 0.0625 * run)
    return moved


def _layout(a: np.ndarray) -> tuple:
    return a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str


def _alike(x, y) -> bool:
    """Whether an op's operand is the same in two records: an array of the same bytes and layout, else equal."""
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and _layout(x) == _layout(y)
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_alike(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


def _bind(values: list, inputs: list[dict], float_slot: bool, kernel: str):
    """The step argument a slot holds in the three records (its `values` under `inputs`): (name, 1, 0) for the
    argument itself (rounded to float32 in a float slot of a ctypes array or number), (step, a, b) for a * step + b;
    a ReplayError where no single one does."""
    found = []
    for name in inputs[0]:
        args = [run[name] for run in inputs]
        if all(v == a or float_slot and v == float(np.float32(a)) for v, a in zip(values, args)):
            found.append((name, 1, 0))
    if not found and all(isinstance(v, numbers.Integral) for v in values):
        steps = [run["step"] for run in inputs]
        a, rest = divmod(values[1] - values[0], steps[1] - steps[0])
        b = values[0] - a * steps[0]
        if rest == 0 and values[2] == a * steps[2] + b:
            found.append(("step", a, b))
    if len(found) != 1:
        raise ReplayError(f"an argument of {kernel} changes from run to run ({', '.join(map(str, values))}): not "
                          "one of the step's arguments (a temporary's address, a value read from memory)")
    return found[0]


class _Op:
    """An op of a record: its calls of the kernels (each ["call", function, arguments, values read], the bound
    slots of the arguments in `bound`) or, where it calls none or does numpy's work beside them (`python`), itself
    called again."""

    __slots__ = ("name", "plain", "args", "kwargs", "calls", "bound", "python", "alike", "result")

    def __init__(self, name, plain, args, kwargs, alike: bool):
        self.name, self.plain, self.args, self.kwargs, self.alike = name, plain, args, kwargs, alike
        self.calls: list[tuple] = []
        self.bound: list[tuple] = []
        self.python = False
        self.result = False


class _Replay:
    """A record made again: `run(x, y, inputs)` is the step's loss. Made from the three records of a step (alike
    but in slots bound to the step's arguments: `_bind`), as ops (`_Op`) and the batch's loads in order."""

    def __init__(self, records: list[_Record], inputs: list[dict], loss: float):
        first = records[0].entries
        if any(len(r.entries) != len(first) for r in records[1:]):
            raise ReplayError("the step makes other calls with other arguments")
        self.parts: list = []                  # _Op | ("load", input, buffer), in order
        originals: dict[tuple, object] = {}
        calls: list[tuple] = []                # the calls since the last op
        for entries in zip(*(r.entries for r in records)):
            kind = entries[0][0]
            if any(e[0] != kind for e in entries):
                raise ReplayError("the step makes other calls with other arguments")
            if kind == "load":
                if any(e[1] != entries[0][1] or e[2] is not entries[0][2] for e in entries):
                    raise ReplayError("the batch goes to other buffers")
                self.parts.append(entries[0])
            elif kind == "op":
                _, name, plain, args, kwargs, result, _, _ = entries[0]
                if any(e[1] != name for e in entries):
                    raise ReplayError("the step makes other calls with other arguments")
                alike = all(_alike(e[3], args) and e[4].keys() == kwargs.keys() and
                            all(_alike(e[4][k], kwargs[k]) for k in kwargs) for e in entries[1:])
                op = _Op(name, plain, args, kwargs, alike)
                op.result = result is loss
                op.python = not calls or any(e[7] for e in entries)
                if not op.python:
                    try:
                        made = [self._call(call, inputs, originals) for call in calls]
                        op.calls = [call[:4] for call in made]
                        op.bound = [b for call in made for b in call[4]]
                    except ReplayError:
                        if not alike:
                            raise
                        op.python = True        # (its calls' arguments move: made by its Python)
                if op.python and not alike:
                    raise ReplayError(f"op {name} takes other operands with other arguments")
                self.parts.append(op)
                calls = []
            else:
                calls.append(entries)
        if calls:
            raise ReplayError("kernels called outside the backend's ops")
        if sum(op.result for op in self.ops()) != 1 or not next(op for op in self.ops() if op.result).python:
            raise ReplayError("the step's loss is not an op's value")
        self.flatten()

    @staticmethod
    def _call(entries, inputs, originals) -> tuple:
        """A call of the three records: ("call", the library's own function, arguments, reads, bound slots)."""
        _, library, function, args, reads = entries[0]
        if any(e[2].__name__ != function.__name__ or len(e[3]) != len(args) for e in entries) or \
                any([(p, i, _layout(a)) for p, i, a in e[4]] != [(p, i, _layout(a)) for p, i, a in reads]
                    for e in entries[1:]):
            raise ReplayError("the step calls other kernels with other arguments")
        key = (id(library), function.__name__, tuple(function.argtypes or ()), function.restype)
        plain = originals.get(key)
        if plain is None:
            plain = originals[key] = library[function.__name__]
            plain.argtypes, plain.restype = function.argtypes, function.restype
        args = list(args)
        read = {(p, i) for p, i, _ in reads}
        bound = []
        for position in range(len(args)):
            slots = [_slots(e[3][position]) for e in entries]
            for element, values in enumerate(zip(*slots)):
                if (position, element) in read or all(v == values[0] for v in values[1:]):
                    continue
                arg = args[position]
                float_slot = isinstance(arg, (ctypes.c_float, ctypes.c_double)) or \
                    isinstance(arg, ctypes.Array) and arg._type_ in (ctypes.c_float, ctypes.c_double)
                name, a, b = _bind(list(values), inputs, float_slot, function.__name__)
                bound.append((args, position, element if isinstance(arg, ctypes.Array) else None, name, a, b))
        return "call", plain, args, reads, bound

    def ops(self) -> list[_Op]:
        return [part for part in self.parts if isinstance(part, _Op)]

    def flatten(self) -> None:
        """The steps `run` makes, in order: ("call", function, arguments, reads), ("op", op) or ("load", input,
        buffer); the slots it writes first."""
        self.steps, self.bound = [], []
        for part in self.parts:
            if not isinstance(part, _Op):
                self.steps.append(part)
            elif part.python:
                self.steps.append(("op", part))
            else:
                self.steps.extend(part.calls)
                self.bound.extend(part.bound)
        self.loads = [(part[1], part[2]) for part in self.parts if not isinstance(part, _Op)]

    def fits(self, x, y) -> bool:
        """Whether a batch has the shapes and dtypes of the recorded one (its buffers take it as they are)."""
        batch = (x, y)
        return all(batch[i].shape == buffer.shape and batch[i].dtype == buffer.dtype for i, buffer in self.loads)

    def _write(self, inputs: dict) -> None:
        """The bound slots given the step's arguments."""
        for args, position, element, name, a, b in self.bound:
            value = inputs[name] * a + b if a != 1 or b else inputs[name]
            arg = args[position]
            if element is not None:
                arg[element] = value
            elif isinstance(arg, ctypes._SimpleCData):
                arg.value = value
            else:
                args[position] = value

    def run(self, x, y, inputs: dict):
        """The step on batch (x, y) with the step's arguments `inputs`: its loss."""
        self._write(inputs)
        batch, result = (x, y), None
        for step in self.steps:
            kind = step[0]
            if kind == "call":
                args = step[2]
                for position, element, a in step[3]:    # (the values of size-1 arrays, as the step read them)
                    args[position][element] = float(a.reshape(-1)[0])
                step[1](*args)
            elif kind == "op":
                op = step[1]
                value = op.plain(*op.args, **op.kwargs)
                if op.result:
                    result = value
            else:
                np.copyto(step[2], batch[step[1]])
        return result

    def run_ops(self, x, y, inputs: dict, each) -> None:
        """`run`, op by op, for checking: `each(op, make)` for each op, `make()` making its calls, or calling it
        where it is replayed by its Python."""
        self._write(inputs)
        batch = (x, y)
        for part in self.parts:
            if isinstance(part, _Op):
                each(part, lambda op=part: self._make(op))
            else:
                np.copyto(part[2], batch[part[1]])

    @staticmethod
    def _make(op: _Op) -> None:
        if op.python:
            op.plain(*op.args, **op.kwargs)
            return
        for _, function, args, reads in op.calls:
            for position, element, a in reads:
                args[position][element] = float(a.reshape(-1)[0])
            function(*args)


class TrainSteps:
    """A model's training steps, replayed where they can be: `steps(x, y, step=..., **hyper)` is
    `model.train_step`'s loss. `why` says why they run in Python (None while they are replayed, or before the
    step is recorded); `why` given: they run in Python for that reason."""

    def __init__(self, model, why: str | None = None):
        self.model = model
        self.replay: _Replay | None = None
        self.why = why
        self.done = 0
        self.records = 0
        self.generation = None
        self.tensors: tuple = ()
        self.python_ops: list[str] = []      # ops replayed by their Python (numpy's work beside their calls)
        self.ahead: int | None = None         # the steps the run makes, where known
        native = getattr(model.rt, "native", None)
        if self.why is None:
            if native is None:
                self.why = "no compiled CPU kernels"
            elif getattr(model.mem, "mode", "") != "static":
                self.why = f"{model.mem.mode} memory (static memory only)"
            elif getattr(getattr(model, "ranks", None), "size", 1) != 1:
                self.why = "a data-parallel run"

    @property
    def replayed(self) -> bool:
        return self.replay is not None

    def summary(self) -> str:
        """How the steps ran, for the run's last lines."""
        if self.replay is not None:
            ops = len(self.replay.ops())
            python = sum(op.python for op in self.replay.ops())
            return (f"on: {len(self.replay.steps)} calls and ops a step without the step's Python ({python} of its "
                    f"{ops} ops by their Python)")
        return f"off: {self.why}" if self.why else f"off: fewer than {WARMUP + 1} steps"

    def figures(self) -> dict:
        """The report's figures: whether the steps were replayed, why not, the ops replayed by their Python."""
        return {"replayed": self.replay is not None, "why_not": None if self.replay is not None else self.why,
                "python_ops": sorted(set(self.python_ops)) if self.replay is not None else []}

    def __call__(self, x, y, *, step: int, **hyper):
        model = self.model
        self.done += 1
        if self.why is None and self.done == WARMUP + 1 and self.ahead is not None and self.ahead < MIN_STEPS:
            self.why = f"a run of {self.ahead} steps (fewer than {MIN_STEPS})"
        if self.why is not None or self.done <= WARMUP:
            return model.train_step(x, y, step=step, **hyper)
        threads = model.rt.native.threads
        if self.replay is None or threads != self.generation or not self._same_tensors():
            self.replay = None             # (recorded again: the kernels' threads changed, or a tensor was replaced)
            self.generation = threads
            return self._record(x, y, step, hyper)
        if not self.replay.fits(x, y):
            return model.train_step(x, y, step=step, **hyper)
        return self.replay.run(x, y, {"step": step, **hyper})

    def _same_tensors(self) -> bool:
        """Whether the model's tensors are the arrays the record's calls address (a checkpoint loaded in the
        middle of a run replaces them)."""
        tensors = self.model.tensors
        return len(tensors) == len(self.tensors) and all(map(operator.is_, tensors.values(), self.tensors))

    def _record(self, x, y, step, hyper):
        """Record the step three times and check the record, from the same state, then make the step: replayed
        where the record holds, else by its Python (and why not kept). Its loss."""
        model = self.model
        inputs = [_moved({"step": step, **hyper}, run) for run in range(3)]
        records, losses = [], []
        try:
            before = _Saved(model.tensors)
        except ReplayError as err:
            self.why = str(err)
            return model.train_step(x, y, step=step, **hyper)
        try:
            for run, values in enumerate(inputs):
                if run:
                    before.restore()
                record, loss = _recorded(model, x, y, values, first=run == 0)
                records.append(record)
                losses.append(loss)
                if run == 0:
                    after = _sums(model.tensors)
            replay = _Replay(records, inputs, losses[0])
            self.python_ops = _check(model, replay, before, x, y, inputs[0])
            before.restore()
            loss = replay.run(x, y, inputs[0])          # (the step itself: the first run's bits, or no replay)
            if not _same_loss(loss, losses[0]) or _sums(model.tensors) != after:
                raise ReplayError("the replayed step's values differ from its first run's")
        except Exception as err:
            if not records and not isinstance(err, ReplayError):
                raise                                   # (the step's own error, as its Python raises it)
            self.why, replay = str(err) if isinstance(err, ReplayError) else \
                f"the record failed ({type(err).__name__}: {err})", None
            before.restore()
            loss = model.train_step(x, y, step=step, **hyper)
        finally:
            before.close()
        self.replay, self.tensors = replay, tuple(model.tensors.values())
        self.records += 1
        if replay is not None and self.records > RECORDS:
            self.why, self.replay = f"recorded {self.records} times (the kernels' threads or the model's tensors " \
                                    "changed)", None
        return loss


def _recorded(model, x, y, values: dict, first: bool) -> tuple[_Record, float]:
    """One run of the step on the batch with the arguments `values`, recorded: (the record, the loss). A step that
    fails in its first run raises its error (as in Python); in another, a ReplayError."""
    global _RECORD, _plain_address, _plain_element
    plain_rt, mem = model.rt, model.mem
    module = sys.modules[type(plain_rt.native).__module__]
    record = _Record(_owners(model))

    def load(index, array, _load=type(mem).load):
        buffer = _load(mem, index, array)
        which = next((i for i, b in enumerate((x, y)) if array is b), None)
        if which is None:
            raise ReplayError("the step loads something else than its batch")
        record.entries.append(("load", which, buffer))
        return buffer

    _plain_address, _plain_element = module._address, module._element
    model.rt = _recording_backend(model, plain_rt.native)
    module._address, module._element, mem.load = record.address, record.element, load
    _RECORD = record
    try:
        args = dict(values)
        return record, model.train_step(x, y, step=args.pop("step"), **args)
    except ReplayError:
        raise
    except Exception as err:
        if first:
            raise                               # (the step's own error, as in Python)
        raise ReplayError(f"the step fails with other arguments: {err}") from None
    finally:
        _RECORD = None
        model.rt, module._address, module._element = plain_rt, _plain_address, _plain_element
        del mem.load


def _other(batch: np.ndarray) -> np.ndarray:
    """Another batch of the same shape and dtype: the samples in reverse order, each reversed, floats scaled."""
    other = np.ascontiguousarray(np.flip(batch))
    return other * other.dtype.type(0.75) if other.dtype.kind == "f" else other


def _arrays(values) -> list:
    """The arrays among an op's operands, those in tuples (`ew_pair`'s, `ew_many`'s) included."""
    found = []
    for value in values:
        if isinstance(value, np.ndarray):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(_arrays(value))
    return found


def _outputs(op) -> list:
    """The arrays an op writes (the backend's contract: `out`, a pooling's `argmax`, an elementwise kernel's
    output after the kernel, each output of a pair's or a batch's tuples); all its arrays where it names none."""
    found = [op.kwargs[k] for k in ("out", "argmax") if isinstance(op.kwargs.get(k), np.ndarray)]
    if op.name in ("ew", "ew_sum"):
        found.append(op.args[1])
    elif op.name in ("ew_pair", "ew_and_sum"):
        found.extend(part[1] for part in op.args)
    elif op.name == "ew_many":
        found.extend(part[0] for part in op.args[1:])
    return found or _arrays((*op.args, *(v for k, v in op.kwargs.items() if k != "workspace")))


def _digest(op) -> tuple:
    """What an op's outputs hold after it: their bytes' CRC-32s."""
    return tuple(_crc(a) for a in _outputs(op))


def _signature(op) -> tuple:
    """An op's name and its operands' layouts: the ops that take the same path through the runtime."""
    def layout(value):
        if isinstance(value, np.ndarray):
            return value.shape, value.strides, value.dtype.str
        if isinstance(value, (tuple, list)):
            return tuple(layout(v) for v in value)
        return value if isinstance(value, (numbers.Number, str, type(None))) else type(value).__name__
    return op.name, layout(op.args), tuple((k, layout(v)) for k, v in sorted(op.kwargs.items()) if k != "workspace")


class _Again(Exception):
    """The check starts over (an op that updates an array in place was found to be made by its Python)."""


def _in_place(op, tensors: set[int]) -> tuple[list, bool]:
    """What an op's Python needs to be made again after its calls: (its outputs that are tensors of the model, an
    update of the step's end, unchanged since the state's copy on file, which they are read back from; whether
    another output shares bytes with an input, an update in place: then the check starts over). Other outputs are
    written whole again from the inputs."""
    outputs = _outputs(op)
    arrays = _arrays((*op.args, *(v for k, v in op.kwargs.items() if k != "workspace")))
    shared = [o for o in outputs if sum(np.may_share_memory(o, a) for a in arrays) > sum(o is p for p in outputs)]
    return [o for o in outputs if id(o) in tensors], any(id(o) not in tensors for o in shared)


def _poison(model) -> None:
    """NaNs in the bytes of the static arena and the workspace the step's Python touched: a replay that reads what
    it did not write fails the check. Pages no step touched stay as they are (zeros the system has not given the
    process yet: filling them would raise its resident memory, a MobileNet's by a tenth)."""
    for region in (model.mem.arena, model.mem.workspace_region):
        for first, last in _resident(region):
            region[first:last].fill(0xFF)


def _resident(region: np.ndarray) -> list[tuple[int, int]]:
    """The byte ranges of a uint8 array on pages resident in memory (`mincore`), or all of it where that cannot be
    asked."""
    size = region.nbytes
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        libc = ctypes.CDLL(None, use_errno=True)
        start = region.ctypes.data
        base = start - start % page
        pages = (start + size - base + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(pages * page), vec) != 0:
            return [(0, size)]
    except (AttributeError, OSError, ValueError):
        return [(0, size)]
    resident = np.frombuffer(vec, np.uint8) & 1
    edges = np.flatnonzero(np.diff(np.concatenate(([0], resident, [0]))))
    return [(max(0, int(a) * page - (start - base)), min(size, int(b) * page - (start - base)))
            for a, b in zip(edges[::2], edges[1::2])]


def _check(model, replay: _Replay, before: _Saved, x, y, values: dict) -> list[str]:
    """Check the replay against the step's Python on another batch, from the state `before`, the static arena and
    the workspace filled with NaNs before the replay. Op by op, what each op's arrays hold after it must be what
    they hold after it in the Python step (`_digest`): an op that calls kernels and differs (it does numpy's work
    beside its calls: a copy, a fill) is made again by its Python from its arrays as they were, and is replayed so
    from then on, with every op that takes its path (`_signature`); any other difference is a ReplayError. Then
    the replay as it runs must leave the loss and the state of the Python step, bit for bit. The names of the ops
    found so."""
    tensors, mem = model.tensors, model.mem
    xo, yo = _other(x), _other(y)
    plain_rt, expected_ops = model.rt, []
    names = {value: name for name, value in vars(plain_rt).items() if callable(value)}

    def digested(op):
        def run(*args, **kwargs):
            result = op(*args, **kwargs)
            if not _view(names[op], kwargs):
                expected_ops.append(_digest(_Op(names[op], op, args, kwargs, True)))
            return result
        return run

    before.restore()
    model.rt = type(plain_rt)(**{**vars(plain_rt), **{name: digested(value) for name, value in vars(plain_rt).items()
                                                      if callable(value) and name not in ("with_gemm", "allocator")}})
    try:
        args = dict(values)
        loss = model.train_step(xo, yo, step=args.pop("step"), **args)
    finally:
        model.rt = plain_rt
    expected = _sums(tensors)
    if len(replay.ops()) != len(expected_ops):
        raise ReplayError("the replayed step makes other ops")
    before.restore()
    _poison(model)
    found, count = [], iter(range(len(expected_ops)))
    tensors_out = {id(a) for a in before.arrays}

    def each(op, make):
        digest = expected_ops[next(count)]
        tensors_in_place, again = ([], False) if op.python else _in_place(op, tensors_out)
        make()
        if _digest(op) == digest:
            return
        if op.python or not op.alike:
            raise ReplayError(f"a replayed step's values differ from the step's after op {op.name}" +
                              (" (which calls no kernel)" if op.python else
                               " (whose operands move from run to run)" if not op.alike else ""))
        op.python = True                        # (by its Python: from its arrays as they were)
        found.append(op)
        if again:
            raise _Again()
        for a in tensors_in_place:
            before.restore(a)
        make()
        if _digest(op) != digest:
            raise ReplayError(f"op {op.name} by its Python differs from the step's")

    while True:
        try:
            replay.run_ops(xo, yo, values, each)
            break
        except _Again:                          # (an op in place found: the check over again, from the start)
            before.restore()
            _poison(model)
            count = iter(range(len(expected_ops)))
    paths = {_signature(op) for op in found}    # (the ops that take the path of one found: by their Python too)
    for op in replay.ops():
        if found and not op.python and op.alike and _signature(op) in paths:
            op.python = True
    replay.flatten()
    before.restore()
    _poison(model)
    replayed = replay.run(xo, yo, values)
    if not _same_loss(replayed, loss) or _sums(tensors) != expected:
        raise ReplayError("a replayed step's values differ from the step's")
    return [op.name for op in found]
