"""In-place computation: let a statement write its result over storage whose value dies at that statement.

Two kinds, both recorded as `Let(node, into=target)`:

- updates: a program output named like a persistent input (a parameter's new value `cv1_W`, the new optimizer
  state `V_cv1_W`, new batch-norm running statistics) is written straight over that input, when every other reader
  of the old value comes before the statement (the scheduler arranges this) and the statement reads the old value,
  if at all, elementwise at its own shape. When that is impossible (the output is an input, a view, shared by two
  outputs, or some reader of the old value comes later), a copy `ew(v0)` into the input is added right after the
  later of the value and the old value's last reader, so the runtime never copies state behind the plan's back.
- activations and gradients: a statement writes over an input of its own shape and dtype whose storage dies at
  this statement (the input and all its views are read for the last time here, none is a program output, and the
  storage is no batch input), when its op's kernel reads every position of that input before writing it
  (`Op.overwritable`): an elementwise statement (`ew`: activations, bias adds, scaling, gradient accumulation,
  optimizer arithmetic) over any input read at its own shape; LRN and its backward over their first input (the
  backward's `dx` over the incoming gradient `g`: the kernel computes everything it needs of `g` before it writes
  `dx`); softmax and log-softmax over their scores. A convolution, matmul or reduction reads its input at other
  positions than it writes (pooling may instead take over its input's storage from the start, which the memory
  plan decides, see `deepdsl.memory_plan`), and a view (`reshape`) already costs nothing.

Guarantees: same values (the interpreter deletes every overwritten value, so a wrong annotation fails loudly); no
value is read after it is overwritten; program outputs and batch inputs are never overwritten; statement order is
unchanged except for added copies.
"""
from __future__ import annotations

import sympy

from deepdsl.ir import COPY, Node, make
from deepdsl.ops import get_op
from deepdsl.ops.elementwise import sym
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import analyze, is_batch_input, is_persistent, is_view


def copy_of(value: Node, k: int = 1) -> Node:
    """A statement that copies `value` (elementwise identity; `elementwise()` would fold it away), the k-th copy of
    the pass (the hidden `copy` attribute keeps it apart from an equal computation the program has already)."""
    return make("ew", (value,), expr=sympy.sympify(sym(0)), **{COPY: k})


def compute_in_place(program: Program, activations: bool = True, updates: bool = True) -> Program:
    """The program with in-place statements marked (see the module docstring)."""
    if any(isinstance(i, Free) or i.into is not None for i in program.body):
        raise ValueError("compute_in_place runs once, before the dealloc pass")
    if updates:
        program = _updates_in_place(program)
    if activations:
        program = _activations_in_place(program)
    return program


def _updates_in_place(program: Program) -> Program:
    program = _copy_outputs_of_old_values(program)
    body = list(program.body)
    storage = analyze(program)
    index = {id(instr.node): k for k, instr in enumerate(body)}
    leaves = {leaf.name: leaf for leaf in program.inputs if is_persistent(leaf)}
    into: dict[int, Node] = {}
    copies: list[tuple[int, Node, Node]] = []          # (insert after body index, copy node, leaf)
    made = sum(1 for instr in body if instr.node.attr(COPY))      # copies of old values, numbered before these
    outputs = list(program.outputs)
    claimed: set[int] = set()
    for position, (name, value) in enumerate(outputs):
        leaf = leaves.get(name)
        if leaf is None or value is leaf:
            continue
        info = storage.of(leaf)
        members = {id(m) for m in info.members}
        k = index.get(id(value))
        last_reader = max((storage.last_read.get(id(m), -1) for m in info.members), default=-1)
        direct = (k is not None and k not in claimed and not is_view(value) and value.shape == leaf.shape
                  and value.dtype == leaf.dtype and _other_reads_before(k, info.members, body, storage))
        if direct:
            inside = [i for i in value.inputs if id(i) in members]
            direct = not inside or (value.op == "ew" and all(i.shape == value.shape for i in inside))
        if direct:
            claimed.add(k)
            into[k] = leaf
            continue
        copy = copy_of(value, made + len(copies) + 1)
        after = max(last_reader, k if k is not None else -1)
        copies.append((after, copy, leaf))
        outputs[position] = (name, copy)
    new_body: list[Let] = []
    pending = sorted(copies, key=lambda c: c[0])
    for c in [c for c in pending if c[0] < 0]:
        new_body.append(Let(c[1], into=c[2]))
    for k, instr in enumerate(body):
        new_body.append(Let(instr.node, into=into.get(k)))
        for c in pending:
            if c[0] == k:
                new_body.append(Let(c[1], into=c[2]))
    return program.rewritten(tuple(new_body), tuple(outputs))


def _copy_outputs_of_old_values(program: Program) -> Program:
    """Outputs that are the old value of an updated persistent input (the input itself under another name, or a
    view of it) must survive the update: each becomes a copy, made right after the value is defined."""
    updated = {leaf.name for leaf in program.inputs if is_persistent(leaf)} & {
        name for name, node in program.outputs if not (node.is_leaf and node.name == name)}
    if not updated or not any(node.is_leaf or is_view(node) for _, node in program.outputs):
        return program
    storage = analyze(program)
    copies: dict[int, Node] = {}                    # id(old value) -> its copy
    outputs = []
    for name, node in program.outputs:
        root = storage.root.get(id(node))
        if root is not None and storage.of(node).persistent and root.name in updated and name != root.name:
            copies.setdefault(id(node), copy_of(node, len(copies) + 1))
            node = copies[id(node)]
        outputs.append((name, node))
    if not copies:
        return program
    body: list[Let] = [Let(copies[id(leaf)]) for leaf in program.inputs if id(leaf) in copies]
    for instr in program.body:
        body.append(instr)
        if id(instr.node) in copies:
            body.append(Let(copies[id(instr.node)]))
    return program.rewritten(tuple(body), tuple(outputs))


def _other_reads_before(k: int, members: list[Node], body, storage) -> bool:
    """Whether every statement other than k that reads a value stored with the leaf comes before k."""
    for m in members:
        last = storage.last_read.get(id(m), -1)
        if last > k:
            return False
    return True


def _activations_in_place(program: Program) -> Program:
    storage = analyze(program)              # last reads are fixed by the order; storages grow as we decide
    outputs = {id(node) for _, node in program.outputs}
    root: dict[int, Node] = {id(leaf): leaf for leaf in program.inputs}
    last_read: dict[int, int] = {}          # id(root) -> last body index reading any value stored there
    pinned: set[int] = set()                # ids of roots holding a program output

    def join(node: Node, r: Node) -> None:
        root[id(node)] = r
        last_read[id(r)] = max(last_read.get(id(r), -1), storage.last_read.get(id(node), -1))
        if id(node) in outputs:
            pinned.add(id(r))

    for leaf in program.inputs:
        join(leaf, leaf)
    result: list[Let] = []
    for k, instr in enumerate(program.body):
        node = instr.node
        target = instr.into
        if target is None and node.inputs:
            target = _dying_input(node, k, root, last_read, pinned)
        host = target if target is not None else (node.inputs[0] if is_view(node) else None)
        join(node, root[id(host)] if host is not None and id(host) in root else node)
        result.append(Let(node, into=target))
    return program.rewritten(tuple(result))


def _dying_input(node: Node, k: int, root, last_read, pinned) -> Node | None:
    positions = get_op(node.op).overwritable(node)
    if not positions:
        return None
    allowed = [node.inputs[j] for j in positions]
    for candidate in allowed:
        if id(candidate) not in root or candidate.shape != node.shape or candidate.dtype != node.dtype:
            continue
        r = root[id(candidate)]
        if is_persistent(r) or is_batch_input(r) or id(r) in pinned or last_read[id(r)] > k:
            continue
        # the statement must read the storage only through overwritable inputs at its own shape (a view of another
        # shape, or an input the kernel reads at other positions, would see overwritten values)
        if any(root.get(id(i)) is r and (i.shape != node.shape or not any(i is a for a in allowed))
               for i in node.inputs):
            continue
        return candidate
    return None
