"""Lowering a compiled network, once, to the frozen description its renderers render.

`describe(compiled, options)` makes every decision code generation makes: the header texts, the parameter and state
declarations (optimizer state by its role), the memory plans as tables, the bodies of the setup, training and test
steps (`steps`: one block per statement) and the elementwise kernels with their expressions and arities. The
result, a `ProgramDescription`, is frozen data; `deepdsl.codegen.render_program` renders it as the Python program
and `deepdsl.codegen.cuda.render_cuda` as its `.cu` kernels. Both read the same object, so the program and its
kernels cannot disagree.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from deepdsl.codegen import CodegenOptions, structure_hash, ufuncs
from deepdsl.ir import FLOAT, INT32
from deepdsl_runtime.schedule import Schedule
from deepdsl.codegen.steps import Kernel, Step

__all__ = ["BufferRow", "PlanTable", "TensorDecl", "ProgramDescription", "describe"]


@dataclass(frozen=True)
class BufferRow:
    """One buffer of a memory plan as the program declares it: arena offset, bytes and a comment naming its
    value."""

    offset: int
    nbytes: int
    comment: str


@dataclass(frozen=True)
class PlanTable:
    """One step's memory plan as the program writes it (`rp.StepPlan`). `pool_peak` is the keyword text of the
    pooled modes' peak, empty where it equals the plan's."""

    name: str
    arena_bytes: int
    peak_bytes: int
    workspace_bytes: int
    pool_bytes: int
    pool_peak: str
    buffers: tuple[BufferRow, ...]


@dataclass(frozen=True)
class TensorDecl:
    """A parameter or state tensor the program declares: its name, shape and initializer as literals; `mults`: a
    parameter's learning-rate and decay multipliers as keyword text (empty when both are 1); `optimizer`: a state
    tensor that is optimizer state."""

    name: str
    shape: str
    init: str
    mults: str = ""
    optimizer: bool = False


@dataclass(frozen=True)
class ProgramDescription:
    """Everything the Python program and its CUDA kernels are rendered from, as frozen data: texts are final,
    sequences are tuples. `kernels` are the elementwise kernels in order of first use, each with its expression
    and arity (`kernel_patterns`: the operand patterns each is called with, see `steps.operand_pattern`;
    `kernel_sums`: those of its per-channel sums, `contract.channel_sum_pattern`; `kernel_pairs`: the kernels
    computed two in one pass, each with its pattern, and whether the second is summed, `steps.Kernels.use_pair`;
    `kernel_many`: the patterns of each kernel's batched calls, `steps.Kernels.use_many`); `steps`
    are setup, training step and test step (then the accumulate, apply and statistics steps, where compiled);
    `memory_plans`
    their plans, in that order."""

    name: str
    cls: str
    version: str
    source: str
    options: str
    memory: str
    memory_plans: tuple[PlanTable, ...]
    filename: str
    description: str
    data: str
    label: str
    classes: int
    dataset: str
    tokens: bool
    vocab: int                            # token inputs' vocabulary (0 for images)
    label_shape: str | None               # a label per position: its shape per example ("(T,)"), else None
    target_shape: str | None
    solver: str
    structure_hash: str
    optimizer: str
    betas: str
    batch_shape: str
    params: tuple[TensorDecl, ...]
    states: tuple[TensorDecl, ...]
    accumulators: tuple[TensorDecl, ...]
    batch_statistics: tuple[TensorDecl, ...]
    setup_inputs: str
    steps: tuple[Step, ...]
    kernels: tuple[Kernel, ...]
    kernel_imports: tuple[str, ...]
    kernel_patterns: tuple[tuple[str, tuple[str, ...]], ...]
    kernel_sums: tuple[tuple[str, tuple[str, ...]], ...]
    kernel_pairs: tuple[tuple[str, str, str, str, bool], ...]
    kernel_many: tuple[tuple[str, tuple[str, ...]], ...]
    iters: int
    test_iters: int
    lr: str
    schedule: str
    warmup: int
    momentum: str
    decay: str
    params_file: str


def _display_source(compiled, options: CodegenOptions) -> str:
    if options.source:
        return options.source
    source = compiled.source or "<unknown>"
    if os.path.isabs(source):
        relative = os.path.relpath(source)
        source = source if relative.startswith("..") else relative
    return source.replace(os.sep, "/")


def _class_name(name: str) -> str:
    parts = [p for p in re.split(r"\W|_", name) if p]
    text = "".join(p[:1].upper() + p[1:] for p in parts) or "Network"
    return text if text.isidentifier() and not text[0].isdigit() else f"Net{text}"


def _init_text(init) -> str:
    if init.kind == "xavier":
        return "xavier"
    if init.kind == "gaussian":
        return f"gaussian({float(init.std)!r})"
    if init.kind == "constant":
        return f"constant({float(init.value)!r})"
    raise ValueError(f"unknown initializer {init}")


def _plan_table(name: str, program, plan) -> PlanTable:
    """One step's plan as the template writes it (`rp.StepPlan`), with each buffer's value named in a comment."""
    from deepdsl.codegen.steps import DTYPES
    from deepdsl.memory_table import simulate_pool

    names = program.names()
    rows = []
    for b in plan.buffers:
        value = b.value
        label = names.get(id(value)) or value.name
        dims = "x".join(map(str, value.shape)) or "scalar"
        rows.append(BufferRow(b.offset, b.nbytes, f"{b.index}: {label} {dims} {DTYPES[value.dtype]}"))
    pool = simulate_pool(plan)
    # the pooled and dynamic modes allocate a buffer that takes over another like any other (see
    # deepdsl_runtime.memory): their peak is the pool replay's; written only where it differs from the plan's
    pool_peak = pool["peak_bytes_in_use"] if pool["peak_bytes_in_use"] != plan.peak_live_bytes else 0
    return PlanTable(name, plan.arena_bytes, plan.peak_live_bytes, plan.workspace_bytes, pool["footprint_bytes"],
                     f", pool_peak_bytes={pool_peak}" if pool_peak else "", tuple(rows))


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _options_text(compiled) -> str:
    opts = compiled.options
    shown = []
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name == "workspace_limit" or value is None or f.metadata.get("header") == ("when off" if value else
                                                                                        "when on"):
            continue
        if isinstance(value, bool):
            shown.append(f.name if value else f"no-{f.name}")
        else:
            shown.append(f"{f.name}={value}")
    return ", ".join(shown)


def _number(value: float) -> str:
    return repr(float(value))


def describe(compiled, options: CodegenOptions | None = None) -> ProgramDescription:
    """The description of the program of `compiled` (a `deepdsl.Compiled`) that `options` render."""
    from deepdsl import __version__
    from deepdsl.codegen import steps
    from deepdsl.codegen.lowering import literal
    from deepdsl.training import is_optimizer_state

    options = options or CodegenOptions()
    names = tuple(step for step in ("setup", "train", "test", "predict", "accumulate", "apply", "statistics")
                  if step in compiled.steps)
    plans = {step: compiled.steps[step].plan for step in names}
    programs = {step: compiled.steps[step].program for step in names}
    limit = plans["train"].workspace_limit
    solver = compiled.loop.solver
    inputs = {n.name: n for p in (compiled.train, compiled.test) for n in p.inputs}
    data = [n for n in inputs.values() if n.op == "input" and n.attr("role") == "data"]
    label = [n for n in inputs.values() if n.op == "input" and n.attr("role") == "label"]
    if len(data) != 1 or len(label) != 1:
        raise steps.GenerateError("a generated program needs exactly one data input (images or tokens) and one "
                                  "label input")
    data, label = data[0], label[0]
    n_classes = _classes(compiled)
    optimizer = solver.optimizer
    hyper = ("lr", "momentum", "decay") if optimizer == "sgd" else ("lr", "bias1", "bias2", "decay")
    # kernels are module-level functions the steps call: no value of a step may hide one
    kernels = steps.Kernels(taken={name for program in programs.values() for name in program.names().values()})
    data_name, label_name = steps.identifier(data.name), steps.identifier(label.name)
    setup = steps.build_setup(compiled.setup, plans["setup"], kernels)
    bad = [n.name for n in compiled.setup.inputs if n.name in ("bias1", "bias2")]
    if bad:
        raise steps.GenerateError(f"values hoisted out of the step depend on {bad}, which change every step")
    train = steps.build_train(compiled.train, plans["train"], kernels, data_name, label_name, hyper)
    test = steps.build_test(compiled.test, plans["test"], kernels, data_name, label_name)
    built = [setup, train, test]
    if "predict" in plans:
        built.append(steps.build_predict(programs["predict"], plans["predict"], kernels, data_name))
    accumulators = []
    if "accumulate" in plans:
        accumulators = steps.accumulation_order(programs["accumulate"], compiled.accumulators)
        built += [steps.build_accumulate(programs["accumulate"], plans["accumulate"], kernels, data_name, label_name,
                                         accumulators, compiled.batch_statistics),
                  steps.build_apply(programs["apply"], plans["apply"], kernels, hyper)]
    if "statistics" in plans:
        built.append(steps.build_statistics(programs["statistics"], plans["statistics"], kernels))
    memory_plans = [_plan_table(f"{step}_step" if step != "setup" else step, programs[step], plans[step])
                    for step in names]
    train_plan, test_plan = memory_plans[1], memory_plans[2]
    memory_text = (f"peak {_mb(train_plan.peak_bytes)} of tensors planned for the training step "
                   f"({_mb(test_plan.peak_bytes)} testing); static arena "
                   f"{_mb(max(train_plan.arena_bytes, test_plan.arena_bytes))}, pool "
                   f"{_mb(max(train_plan.pool_bytes, test_plan.pool_bytes))}, workspace "
                   f"{_mb(max(p.workspace_bytes for p in memory_plans))}")
    if optimizer == "sgd":
        moments = f"momentum {solver.momentum:g}" + (" (Nesterov)" if solver.nesterov else "")
    else:
        moments = f"betas {solver.betas}, eps {solver.eps:g}"
    solver_text = (f"{_OPTIMIZER_NAMES[optimizer]}, {solver.iters} iterations, lr {solver.lr:g}, {moments}, decay "
                   f"{solver.decay:g}" + (f", gradient clipping at {solver.clip:g}" if solver.clip else ""))
    if solver.schedule != "constant" or solver.warmup:
        solver_text += f", lr schedule {Schedule.parse(solver.schedule, solver.warmup).describe()}"
    params = []
    for p in compiled.params:
        lm, dm = float(p.attr("lr_mult", 1.0)), float(p.attr("decay_mult", 1.0))
        mults = "" if (lm, dm) == (1.0, 1.0) else f", lr_mult={lm!r}, decay_mult={dm!r}"
        params.append(TensorDecl(p.name, literal(p.shape), _init_text(p.attr("init")), mults=mults))
    states = [TensorDecl(s.name, literal(s.shape), _init_text(s.attr("init")), optimizer=is_optimizer_state(s))
              for s in compiled.states]
    return ProgramDescription(**{
        "name": compiled.name,
        "cls": _class_name(compiled.name),
        "version": __version__,
        "source": _display_source(compiled, options),
        "options": _options_text(compiled) + "; workspace limit " + ("none" if limit is None else f"{limit} bytes"),
        "memory": memory_text,
        "memory_plans": tuple(memory_plans),
        "filename": f"{compiled.name}.py",
        "description": f"Train and test {compiled.name} (generated by deepdsl {__version__}).",
        "data": "x".join(map(str, data.shape)) + (" int32 tokens" if data.dtype == INT32 else " float32 images"),
        "label": "x".join(map(str, label.shape)) + (" float32 targets" if label.dtype == FLOAT
                                                    else f" int32 labels ({n_classes} classes)"),
        "classes": n_classes,
        "dataset": data.attr("dataset") or "synthetic",
        "tokens": data.dtype == INT32,
        "vocab": _vocab(compiled, data, n_classes) if data.dtype == INT32 else 0,
        "label_shape": literal(label.shape[1:]) if label.dtype != FLOAT and label.shape[1:] else None,
        "target_shape": literal(label.shape[1:]) if label.dtype == FLOAT else None,
        "solver": solver_text,
        "structure_hash": structure_hash(compiled),
        "optimizer": optimizer,
        "betas": literal(tuple(float(b) for b in solver.betas)),
        "batch_shape": literal(data.shape),
        "params": tuple(params),
        "states": tuple(states),
        "setup_inputs": literal(tuple(n.name for n in compiled.setup.inputs if n.op == "input")),
        "steps": tuple(built),
        "accumulators": tuple(TensorDecl(g.name, literal(g.shape), _init_text(g.attr("init")))
                              for g in accumulators),
        "batch_statistics": tuple(TensorDecl(s.name, literal(s.shape), _init_text(s.attr("init")))
                                  for s in compiled.batch_statistics),
        "kernels": tuple(kernels.items),
        "kernel_imports": ufuncs.runtime_imports(k.body for k in kernels.items),
        "kernel_patterns": tuple((k.name, tuple(kernels.patterns.get(k.name, ()))) for k in kernels.items),
        "kernel_sums": tuple((k.name, tuple(kernels.sums.get(k.name, ()))) for k in kernels.items),
        "kernel_pairs": tuple(kernels.pairs),
        "kernel_many": tuple((k.name, tuple(kernels.many.get(k.name, ()))) for k in kernels.items),
        "iters": solver.iters,
        "test_iters": solver.test_iters,
        "lr": _number(solver.lr),
        "schedule": solver.schedule,
        "warmup": solver.warmup,
        "momentum": _number(solver.momentum),
        "decay": _number(solver.decay),
        "params_file": options.params_file or f"{compiled.name}.params.npz",
    })


_OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}


def _vocab(compiled, data, classes: int) -> int:
    """The vocabulary of token inputs: the rows of the table the first embedding looks them up in (`gather_rows`
    of the tokens), else the classes (a language model's)."""
    for node in compiled.train.statements():
        if node.op == "gather_rows":
            ids = node.inputs[1]
            while ids.op == "reshape":
                ids = ids.inputs[0]
            if ids is data or (ids.op == "input" and ids.name == data.name):
                return node.inputs[0].shape[0]
    return classes


def _classes(compiled) -> int:
    """Number of classes: the width of the scores the test step's precision reads (0 without one: a network of
    float targets reports another metric)."""
    accuracy = dict(compiled.test.outputs)["accuracy"]
    for node in compiled.test.statements() + [accuracy]:
        if node.op == "precision":
            return node.inputs[0].shape[1]
    return 0
