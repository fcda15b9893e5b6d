"""Turn the SSA programs of a compiled network into the Python bodies of its `setup`, `train_step` and `test_step`.

Each `Let` becomes a block: the IR statement as a comment, then where its value lives and the runtime call (from
`lowering`). Where values live is the step's memory plan (`deepdsl.memory_plan.MemoryPlan`), followed to the
letter: a statement that allocates buffer k gets `mem.tensor(k, shape, dtype)`, an in-place statement the buffer
it overwrites (or the persistent input it updates), a view nothing; its scratch is `mem.workspace(bytes)` of the
plan's `Step.workspace`; each `Free` drops the step's names of the buffers it releases and returns them with
`mem.free(k, ...)`; the batch inputs are copied into their buffers first (`mem.load`). So the allocator sees
exactly the plan's allocations and frees, in order, and the peak it measures is the planned peak. Elementwise
statements call kernels (module-level numpy functions rendered by `ufuncs`, shared between steps when their
expressions agree).

A training step's output `<name>` is the new value of input `<name>` (parameters, optimizer state, running
statistics); the in-place pass writes it over the input (`Let(node, into=input)`), else the step copies it over
the input at the end.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy

from deepdsl import provenance
from deepdsl.codegen import lowering, ufuncs
from deepdsl_runtime import contract
from deepdsl.errors import DeepDSLError
from deepdsl.ir import Node
from deepdsl.memory_plan import MemoryPlan
from deepdsl.ops.elementwise import broadcast_shapes
from deepdsl.ops.elementwise import operation_word
from deepdsl.ssa import Free, Let, Program, format_expr
from deepdsl.storage import is_batch_input, is_view

DTYPES = {"float": "float32", "int32": "int32", "uint8": "uint8"}
TENSOR_ROLES = ("param", "state", "hoisted")


class GenerateError(DeepDSLError):
    """The program uses something code generation does not support (reported as one line)."""


@dataclass(frozen=True)
class Block:
    """One statement's code: the IR statement as a comment, then its lines; `banner`: the title of the section
    (a layer and direction) the statement opens, if it opens one."""

    comment: str
    lines: tuple[str, ...]
    banner: str | None = None


@dataclass(frozen=True)
class Step:
    """One step method of the generated program: signature, docstring, prologue, statement blocks, epilogue."""

    name: str
    signature: str
    doc: str
    prologue: tuple[str, ...]
    blocks: tuple[Block, ...]
    epilogue: tuple[str, ...]


@dataclass(frozen=True)
class Kernel:
    """One elementwise kernel `out = expr(v0, ..., v<arity-1>)`: the numpy function `body` of the Python program
    and the CUDA kernel of the same name both compute `expr` over `arity` inputs; with `alias` set, `out` may be
    input `v<alias>`."""

    name: str
    expr: sympy.Expr
    arity: int
    alias: int | None
    body: tuple[str, ...]

    @property
    def params(self) -> str:
        return ", ".join(["out"] + [f"v{i}" for i in range(self.arity)])

    @property
    def doc(self) -> str:
        return f"out = {sympy.sstr(self.expr)}" + (f"   (out may be v{self.alias})" if self.alias is not None else "")


@dataclass
class Kernels:
    """Collects the elementwise kernels of one generated program while its steps are built, in order of first use
    (one kernel per expression, arity and alias), each named after what it computes (`ew_add_relu`) and distinct
    from `taken` (the values' names of every step) and from the kernels before it."""

    taken: set[str] = field(default_factory=set)
    items: list[Kernel] = field(default_factory=list)
    # kernel name -> the operand patterns it is called with (`operand_pattern`), in order of first use: the
    # compiled CPU library has one function for each
    patterns: dict[str, list[str]] = field(default_factory=dict)
    # kernel name -> the operand patterns of its per-channel sums (`ew_sum` statements), each a compiled function
    sums: dict[str, list[str]] = field(default_factory=dict)
    # (first kernel, its pattern, second kernel, its pattern, whether the second is summed per channel) of the pairs
    # of statements computed in one pass, in order of first use: the compiled CPU library has one function for each
    pairs: list[tuple[str, str, str, str, bool]] = field(default_factory=list)
    # kernel name -> the operand patterns of its batched calls (`use_many`), each a compiled function
    many: dict[str, list[str]] = field(default_factory=dict)
    _by_key: dict[tuple, str] = field(default_factory=dict)

    def use(self, name: str, pattern: str | None) -> None:
        """Note a call of kernel `name` with operands of `pattern` (None: broadcast operands, which the compiled
        library leaves to numpy)."""
        if pattern is not None and pattern not in self.patterns.setdefault(name, []):
            self.patterns[name].append(pattern)

    def use_many(self, name: str, pattern: str | None) -> None:
        """Note a batched call of kernel `name` over operand sets of `pattern` (`passes.fuse_horizontal`): the
        compiled library has one function for each pattern that has one (`deepdsl_runtime.contract.many_function`)."""
        if pattern is not None and contract.many_function(name, pattern) is not None \
                and pattern not in self.many.setdefault(name, []):
            self.many[name].append(pattern)

    def use_sum(self, name: str, pattern: str | None) -> None:
        """Note a per-channel sum of kernel `name` over operands of `pattern` (`contract.channel_sum_pattern`; None:
        one the compiled library leaves to numpy's chunks)."""
        if pattern is not None and pattern not in self.sums.setdefault(name, []):
            self.sums[name].append(pattern)

    def use_pair(self, first: str, first_pattern: str | None, second: str, second_pattern: str | None,
                 summed: bool = False) -> None:
        """Note a call computing kernel `first` and then kernel `second` (which reads the first's output; `summed`:
        the per-channel sum of the second) in one pass: the compiled library has one function for each pair of
        patterns that has one (`deepdsl_runtime.contract.pair_function`)."""
        if first_pattern is None or second_pattern is None or \
                contract.pair_function(first, first_pattern, second, second_pattern, summed) is None:
            return
        pair = (first, first_pattern, second, second_pattern, summed)
        if pair not in self.pairs:
            self.pairs.append(pair)

    def get(self, expr: sympy.Expr, nargs: int, alias: int | None) -> str:
        key = (sympy.srepr(expr), nargs, alias)
        if key not in self._by_key:
            base = kernel_name(expr)
            name, k = base, 1
            while name in self.taken:
                k += 1
                name = f"{base}_{k}"
            self.taken.add(name)
            self.items.append(Kernel(name, expr, nargs, alias, tuple(ufuncs.kernel_body(expr, alias))))
            self._by_key[key] = name
        return self._by_key[key]


def operand_pattern(node: Node) -> str | None:
    """How an elementwise statement's operands reach its compiled kernel, one letter each
    (`deepdsl_runtime.contract.operand_pattern`, the rule the runtime picks the kernel by); None where numpy's
    kernel runs. An `ew_sum` runs its kernel over the values it sums (chunks of samples of them: the same letters)."""
    values = node.shape if node.op == "ew" else broadcast_shapes(*(x.shape for x in node.inputs))
    return contract.operand_pattern([(x.shape, x.dtype == "uint8") for x in node.inputs], values)


def sum_pattern(node: Node, summed_to: tuple[int, ...] | None = None) -> str | None:
    """The operand pattern of an `ew_sum` statement's compiled per-channel sum (`contract.channel_sum_pattern`),
    or of an `ew` statement whose values the next one sums to `summed_to` (a summed pair: its kernel runs under the
    same view); None where numpy's chunks sum it."""
    values = broadcast_shapes(*(x.shape for x in node.inputs)) if summed_to is None else node.shape
    return contract.channel_sum_pattern([(x.shape, x.dtype == "uint8") for x in node.inputs], values,
                                        node.shape if summed_to is None else summed_to)


def kernel_name(expr: sympy.Expr, most: int = 4) -> str:
    """`ew_` and the operations of `expr` in the order they apply, each once (at most `most` of them):
    Max(0, v0 + v1) is `ew_add_relu`, v0*Heaviside(v1, 0) `ew_step_mul`, -v0/500 `ew_scale`, v0 - v1*v2
    `ew_mul_sub`."""
    words: list[str] = []

    def visit(e: sympy.Expr, parent: sympy.Expr | None = None) -> None:
        for a in e.args:
            visit(a, e)
        if isinstance(parent, sympy.Add) and isinstance(e, sympy.Mul) and e.args[0] == -1 and len(e.args) == 2:
            return          # a negated term: the sum is a difference (`sub`)
        word = operation_word(e)
        if word and word not in words:
            words.append(word)
    visit(expr)
    return "_".join(["ew"] + (words[:most] or ["copy"]))


def identifier(name: str) -> str:
    """A Python identifier for a user-chosen name."""
    text = re.sub(r"\W", "_", name)
    return text if text.isidentifier() and not text[0].isdigit() else f"_{text}"


def _role(leaf: Node) -> str:
    return leaf.attr("role") if leaf.op == "input" else leaf.op


class StepBuilder:
    """Builds one step's code from its program and memory plan. `py` maps values to Python expressions."""

    def __init__(self, program: Program, plan: MemoryPlan, kernels: Kernels, after: dict[int, str] | None = None):
        if len(plan.steps) != len(program.body):
            raise GenerateError(f"the memory plan of '{program.name}' does not belong to its program")
        self.program = program
        self.plan = plan
        self.kernels = kernels
        self.after = after or {}       # a line to run after the statement of a node (by id)
        self.ir_names = program.names()
        self.py: dict[int, str] = {}
        for leaf in program.inputs:
            role = _role(leaf)
            if role in TENSOR_ROLES:
                self.py[id(leaf)] = f"T[{leaf.name!r}]"
            elif role in ("data", "label", "hyper"):
                self.py[id(leaf)] = identifier(leaf.name)
            else:
                raise GenerateError(f"input '{leaf.name}' of role '{role}' has no value in generated programs")
        self.into: dict[int, Node] = {id(i.node): i.into for i in program.body
                                      if isinstance(i, Let) and getattr(i, "into", None) is not None}

    def arg(self, node: Node) -> str:
        if id(node) in self.py:
            return self.py[id(node)]
        if node.op == "const" and node.shape == ():
            return lowering.literal(float(node.attr("value")))
        raise GenerateError(f"value {node!r} used before it is defined")

    def value_name(self, node: Node) -> str:
        return node.name if node.is_leaf else self.ir_names[id(node)]

    def loads(self) -> list[str]:
        """The batch inputs, copied into their arena buffers when the step starts (they are live from index 0)."""
        lines = []
        for b in self.plan.buffers:
            if is_batch_input(b.value):
                name = self.arg(b.value)
                lines.append(f"{name} = mem.load({b.index}, {name})")
        return lines

    def blocks(self) -> tuple[Block, ...]:
        """The statements' blocks; the first statement of each layer and direction opens a section (`banner`)."""
        result = []
        body, steps = self.program.body, self.plan.steps
        deferred = {id(i.computes_also) for i in body if isinstance(i, Let) and i.computes_also is not None}
        batched = {id(v) for i in body if isinstance(i, Let) for v in i.batch}
        section = None
        for k, (instr, step) in enumerate(zip(body, steps)):
            if isinstance(instr, Let):
                if id(instr.node) in deferred:
                    block = self.let(instr.node, step, call=False)
                elif id(instr.node) in batched:
                    block = self.let(instr.node, step, call=False, batched=True)
                elif instr.computes_also is not None:
                    block = self.let(instr.node, step, pair=(instr.computes_also, steps[k - 1]))
                else:
                    block = self.let(instr.node, step, batch=instr.batch)
                found = provenance.origin(instr.node, self.program.origins)
                here = found.section if found is not None else None
                if id(instr.node) in batched or instr.batch:
                    found, here = None, "batched"          # the small updates at the end: one section
                if here != section:
                    section = here
                    title = (f"{here[0]} ({found.what}), {here[1]}" if found is not None else
                             "the small tensors' updates, one call per kernel" if here == "batched" else
                             "values of no layer")
                    block = Block(block.comment, block.lines, f"---- {title} ----")
                if id(instr.node) in self.after:
                    block = Block(block.comment, block.lines + (self.after[id(instr.node)],), block.banner)
                result.append(block)
            elif isinstance(instr, Free) and step.releases:
                # the step's names of the released buffers: the freed values and the values they were computed
                # over in place (or that are views of them)
                names = [self.py[id(v)] for k in step.releases for v in self.plan.buffers[k].values
                         if id(v) in self.py and not self.py[id(v)].startswith("T[")]
                buffers = ", ".join(str(k) for k in step.releases)
                lines = [f"del {', '.join(names)}"] if names else []
                lines.append(f"mem.free({buffers})")
                what = ", ".join(names) if names else f"buffer{'s' if len(step.releases) > 1 else ''} {buffers}"
                result.append(Block(f"free {what}", tuple(lines)))
        return tuple(result)

    def let(self, node: Node, step, call: bool = True, pair=None, batch=(), batched: bool = False) -> Block:
        """The block of one statement. A pair of statements computed together (`passes.fuse_multi_output`) makes
        one call: the first statement only binds its buffer (`call=False`), the second (`pair`: the first's node and
        plan step) calls `rt.ew_pair` for two elementwise kernels (`rt.ew_and_sum` when the second is summed), or
        `rt.max_pool(..., argmax=)` for a window's maximum and position, in max_pool's workspace (the kernel's
        small mask may be a temporary). Both statements keep the plan's buffers and the call asks for no more
        workspace than the plan gives, so every allocator mode stays within the plan. A batch
        (`passes.fuse_horizontal`): its members only bind their buffers (`batched`), its last statement (`batch`: the
        members' nodes) calls `rt.ew_many` with each one's output and operands."""
        if node.op in lowering.NOT_LOWERED:
            raise GenerateError(f"op '{node.op}' cannot appear in a program statement")
        name = self.ir_names[id(node)]
        comment = f"{name} = {format_expr(node, self.ir_names)}"
        args = tuple(self.arg(x) for x in node.inputs)
        self.py[id(node)] = name
        if is_view(node):
            return Block(comment, (lowering.lower(lowering.Site(node, args, name)),))
        lines: list[str] = []
        target = self.into.get(id(node))
        if target is not None:
            what = f"the new {target.name}" if target.is_leaf else f"over {self.ir_names[id(target)]}"
            lines.append(f"{name} = {self.arg(target)}  # in place: {what}")
        elif step.allocates is not None:
            over = getattr(self.plan.buffers[step.allocates], "takes_over", None)
            lines.append(f"{name} = mem.tensor({step.allocates}, {lowering.literal(node.shape)}, "
                         f"{DTYPES[node.dtype]!r}" + ("" if over is None else f", over={over}") + ")")
        else:
            raise GenerateError(f"the memory plan gives statement {name} no buffer")
        if not call:
            later = "with the last statement of its batch" if batched else "with the next statement"
            return Block(f"{comment}   (computed {later})", tuple(lines))
        workspace = f"mem.workspace({step.workspace})" if step.workspace else None
        if pair is not None and node.op in ("ew", "ew_sum"):
            first = pair[0]
            first_kernel = self.kernel(first, self.into.get(id(first)))
            kernel = self.kernel(node, target)
            summed = node.op == "ew_sum"
            first_pattern = sum_pattern(first, node.shape) if summed else operand_pattern(first)
            self.kernels.use_pair(first_kernel, first_pattern, kernel,
                                  sum_pattern(node) if summed else operand_pattern(node), summed)
            lines += lowering.elementwise_pair(
                lowering.Site(first, tuple(self.arg(x) for x in first.inputs), self.py[id(first)], None, first_kernel),
                lowering.Site(node, args, name, workspace, kernel)).split("\n")
            return Block(comment, tuple(lines))
        if pair is not None:
            first, first_step = pair
            pool, index = (first, node) if first.op == "max_pool" else (node, first)
            nbytes = (step if pool is node else first_step).workspace
            workspace = f"mem.workspace({nbytes})" if nbytes else None
            lines.append(lowering.max_pool_pair(
                lowering.Site(pool, args, self.py[id(pool)], workspace), self.py[id(index)]))
            return Block(comment, tuple(lines))
        kernel = self.kernel(node, target) if node.op in ("ew", "ew_sum") else None
        if batch:
            self.kernels.use_many(kernel, operand_pattern(node))
            sites = [lowering.Site(v, tuple(self.arg(x) for x in v.inputs), self.py[id(v)], None,
                                   self.kernel(v, self.into.get(id(v)))) for v in batch]
            lines += lowering.elementwise_many([*sites, lowering.Site(node, args, name, None, kernel)]).split("\n")
            return Block(f"{comment}   (and the {len(batch)} statements before it, in one call)", tuple(lines))
        lines.append(lowering.lower(lowering.Site(node, args, name, workspace, kernel)))
        return Block(comment, tuple(lines))

    def kernel(self, node: Node, target: Node | None) -> str:
        """The kernel of an `ew` or `ew_sum` statement (writing over its input `target`, if any), its call noted."""
        alias = next((i for i, x in enumerate(node.inputs) if x is target), None) if target is not None else None
        kernel = self.kernels.get(node.attr("expr"), len(node.inputs), alias)
        self.kernels.use(kernel, operand_pattern(node))
        if node.op == "ew_sum":
            self.kernels.use_sum(kernel, sum_pattern(node))
        return kernel

    def lives_in(self, value: Node, leaf: Node) -> bool:
        """Whether the step leaves `value` in the persistent buffer of `leaf` (in place, or as a view of it)."""
        while True:
            if value is leaf:
                return True
            target = self.into.get(id(value))
            if target is not None:
                value = target
            elif is_view(value):
                value = value.inputs[0]
            else:
                return False


def _scalar(builder: StepBuilder, node: Node) -> str:
    return f"rt.scalar({builder.arg(node)})"


def build_setup(program: Program, plan: MemoryPlan, kernels: Kernels) -> Step:
    b = StepBuilder(program, plan, kernels)
    blocks = b.blocks()
    epilogue = [f"T[{k!r}] = {b.arg(v)}" for k, v in program.outputs] + ["mem.end()"]
    hyper = [identifier(n.name) for n in program.inputs if _role(n) == "hyper"]
    return Step("setup", ", ".join(["self"] + (["*"] + hyper if hyper else [])),
                "Values computed once before training (hoisted out of the steps); they outlive the step.",
                ('rt, mem, T = self.rt, self.mem.begin("setup", persistent=True), self.tensors', *b.loads()),
                blocks, tuple(epilogue))


def _updating_step(program: Program, plan: MemoryPlan, kernels: Kernels, method: str, doc: str,
                   inputs: list[str], hyper: tuple[str, ...], results: list[str],
                   after: dict[int, str] | None = None, written: tuple[str, ...] = ()) -> Step:
    """A step whose outputs are the new values of its parameters and state (written over them, in place or by a
    copy at the end), of the tensors `written` (which it does not read: copied at the end) and the scalar
    `results` it returns; `after`: lines run after some statements."""
    b = StepBuilder(program, plan, kernels, after)
    for n in program.inputs:
        if _role(n) == "hyper" and n.name not in hyper:
            raise GenerateError(f"the {method} reads hyperparameter '{n.name}', which generated programs do "
                                f"not feed (they feed {', '.join(hyper)})")
    blocks = b.blocks()
    leaves = {n.name: n for n in program.inputs if _role(n) in ("param", "state")}
    epilogue, returned = [], []
    for k, v in program.outputs:
        if k in written:
            epilogue.append(f"rt.copy({b.arg(v)}, out=T[{k!r}])")
        elif k in leaves:
            if b.lives_in(v, leaves[k]):
                continue
            epilogue.append(f"rt.copy({b.arg(v)}, out=T[{k!r}])")
        else:
            returned.append((k, v))
    if [k for k, _ in returned] != results:
        raise GenerateError(f"the {method}'s results are {[k for k, _ in returned]}, expected {results}")
    epilogue += [f"{k} = {_scalar(b, v)}" for k, v in returned] + ["mem.end()"] + \
        ([f"return {', '.join(results)}"] if results else [])
    signature = ", ".join(["self", *inputs, *(["*", *hyper] if hyper else [])])
    return Step(method, signature, doc, (f'rt, mem, T = self.rt, self.mem.begin("{method}"), self.tensors',
                                         *b.loads()), blocks, tuple(epilogue))


def build_train(program: Program, plan: MemoryPlan, kernels: Kernels, data: str, label: str,
                hyper: tuple[str, ...]) -> Step:
    return _updating_step(program, plan, kernels, "train_step",
                          "One training step on the batch: returns the loss; parameters and state are updated.",
                          [data, label], ("step", *hyper), ["loss"])


def accumulation_order(program: Program, accumulators) -> list:
    """The accumulators in the order the accumulate step finishes them (the order their sums over the ranks can
    start in)."""
    position = {name: k for k, (name, _) in enumerate(program.outputs)}
    done = {id(i.node): k for k, i in enumerate(program.body) if isinstance(i, Let)}
    outputs = dict(program.outputs)
    return sorted(accumulators, key=lambda g: (done.get(id(outputs[g.name]), -1), position[g.name]))


def build_accumulate(program: Program, plan: MemoryPlan, kernels: Kernels, data: str, label: str,
                     accumulators, batch_statistics) -> Step:
    """`accumulators` in the order the step finishes them: after each one's last addition, the program tells
    `self.reduction` that accumulator k is final for this batch (the ranks may start summing it)."""
    outputs = dict(program.outputs)
    after = {id(outputs[g.name]): f"self.reduction.ready({k})  # {g.name} is final for this batch"
             for k, g in enumerate(accumulators)}
    statistics = (" and its batch statistics to B_ (statistics_step updates the running statistics from them)"
                  if batch_statistics else "")
    return _updating_step(program, plan, kernels, "accumulate_step",
                          f"Add the batch's gradients to the accumulators G_{statistics}: returns the loss.",
                          [data, label], ("step",), ["loss"], after, tuple(s.name for s in batch_statistics))


def build_statistics(program: Program, plan: MemoryPlan, kernels: Kernels) -> Step:
    return _updating_step(program, plan, kernels, "statistics_step",
                          "Update the running statistics from the batch statistics B_ of one batch, as train_step "
                          "does from its batch's.", [], (), [])


def build_apply(program: Program, plan: MemoryPlan, kernels: Kernels, hyper: tuple[str, ...]) -> Step:
    return _updating_step(program, plan, kernels, "apply_step",
                          "Update the parameters from the accumulated gradients times `scale` (1 / the batches "
                          "accumulated), as train_step does from one batch's.", [], ("scale", *hyper), [])


def build_test(program: Program, plan: MemoryPlan, kernels: Kernels, data: str, label: str) -> Step:
    """The test step: returns the batch's accuracy and loss, and a classifier's `ranks` (each row's rank of its
    label among its scores, `label_rank`: top-k accuracy), None for another network."""
    b = StepBuilder(program, plan, kernels)
    blocks = b.blocks()
    names = [k for k, _ in program.outputs]
    if names not in (["accuracy", "loss"], ["accuracy", "loss", "ranks"]):
        raise GenerateError(f"the test step's results are {names}, expected ['accuracy', 'loss'] (and 'ranks')")
    outputs = dict(program.outputs)
    epilogue = [f"accuracy = {_scalar(b, outputs['accuracy'])}", f"loss = {_scalar(b, outputs['loss'])}",
                f"ranks = rt.to_numpy({b.arg(outputs['ranks'])})" if "ranks" in outputs else "ranks = None",
                "mem.end()", "return accuracy, loss, ranks"]
    doc = ("Accuracy and loss of the batch (no update), and each row's rank of its label among its scores (0: "
           "the best; below k: among the k best)." if "ranks" in outputs else
           "Accuracy and loss of the batch (no update); no ranks (not a classifier).")
    return Step("test_step", f"self, {data}, {label}", doc,
                ('rt, mem, T = self.rt, self.mem.begin("test_step"), self.tensors', *b.loads()), blocks,
                tuple(epilogue))


def build_predict(program: Program, plan: MemoryPlan, kernels: Kernels, data: str) -> Step:
    """The predict step: the forward pass of the batch, its one output copied to the host (a classifier's class
    probabilities, or what the Loop's `prediction` computes)."""
    b = StepBuilder(program, plan, kernels)
    blocks = b.blocks()
    (name, value), = program.outputs
    doc = ("The class probabilities of the batch's examples (the forward pass alone: no labels, no update)."
           if name == "probabilities" else "The network's outputs for the batch (the forward pass alone: no update).")
    epilogue = (f"{name} = rt.to_numpy({b.arg(value)})", "mem.end()", f"return {name}")
    return Step("predict_step", f"self, {data}", doc,
                ('rt, mem, T = self.rt, self.mem.begin("predict_step"), self.tensors', *b.loads()), blocks, epilogue)
