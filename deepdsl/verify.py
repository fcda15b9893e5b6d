"""The SSA verifier, run after every stage in tests.

Checks: inputs are leaves with distinct names; every value is defined once (single assignment) and before it is read
(define-before-use); every statement's shape and dtype agree with its op's shape rule applied to its inputs; a freed
value is not read or freed again and is no program output; outputs are defined. Errors quote the statements around
the offending one.

In-place statements (`Let(node, into=t)`, see `deepdsl.storage`): `t` is live and of the statement's shape and
dtype; `t` is no batch input; a persistent `t` is overwritten only by the program output of its own name, an arena
`t` only when no value stored with it is a program output; a statement reading the storage it overwrites is
elementwise (or an op whose kernel may overwrite that input, `Op.overwritable`) and reads it at its own shape;
afterwards no value stored with `t` is read (they are overwritten).
A statement computed together with the one before it (`Let(node, computes_also=v)`): `v` is that statement's
node, which is computed with no other, and one call can compute both (`passes.fuse_multi_output.computed_together`,
which also says when either may write in place). A batch (`Let(node, batch=(v1, ..., vk))`): the k statements right
before it define v1, ..., vk, all are `ew` statements of one kernel and operands' pattern
(`passes.fuse_horizontal.batch_key`) in no pair or other batch, and none reads another's value or a storage another
one writes over.
Once a program has Free statements (after the dealloc pass), every arena storage that holds no program output is
freed exactly once, by the Free right after the last statement that defines or reads a value stored there, naming
all of its values still alive; persistent values are never freed.
"""
from __future__ import annotations

from deepdsl.errors import VerifyError
from deepdsl.ir import Graph
from deepdsl.ops import get_op
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import analyze, is_batch_input, is_persistent


def verify(program: Program) -> Program:
    names = program.names()
    lines = program.text(shapes=False).splitlines()[1:]

    def fail(index: int, message: str):
        lo, hi = max(0, index - 3), min(len(lines), index + 4)
        context = "\n".join(("> " if k == index else "  ") + lines[k] for k in range(lo, hi))
        raise VerifyError(f"{program.name}: {message}\n{context}")

    live: set[int] = set()
    seen_names: set[str] = set()
    for leaf in program.inputs:
        if not leaf.is_leaf:
            raise VerifyError(f"{program.name}: input {leaf!r} is not a leaf")
        if leaf.name in seen_names:
            raise VerifyError(f"{program.name}: two inputs named '{leaf.name}'")
        seen_names.add(leaf.name)
        live.add(id(leaf))
    defined: set[int] = set(live)
    freed: set[int] = set()
    overwritten: set[int] = set()
    in_place = any(isinstance(i, Let) and i.into is not None for i in program.body)
    storage = analyze(program) if in_place or any(isinstance(i, Free) for i in program.body) else None
    outputs = {id(node) for _, node in program.outputs}
    for index, instr in enumerate(program.body):
        if isinstance(instr, Let):
            node = instr.node
            for i in node.inputs:
                if i.op == "const" and i.shape == ():
                    continue
                if id(i) in freed:
                    fail(index, f"{names.get(id(i), i)} read after it was freed")
                if id(i) in overwritten:
                    fail(index, f"{names.get(id(i), i)} read after an in-place statement overwrote it")
                if id(i) not in live:
                    fail(index, f"{names.get(id(i), repr(i))} read before it is defined")
            if id(node) in defined:
                fail(index, f"{names[id(node)]} assigned twice")
            if instr.computes_also is not None:
                _check_computed_together(program, index, instr, names, fail)
            if instr.batch:
                _check_batch(program, index, instr, storage, names, fail)
            if instr.into is not None:
                _check_in_place(program, index, instr, storage, live, outputs, names, fail)
                info = storage.of(instr.into)
                for member in info.members:
                    if info.defined_at[id(member)] < index and id(member) in live:
                        live.discard(id(member))
                        overwritten.add(id(member))
            try:
                shape, dtype = get_op(node.op).infer(*node.inputs, **node.kwargs)
            except Exception as err:      # noqa: BLE001 -- report any shape-rule failure as a verify error
                fail(index, f"shape rule of {node.op} fails: {err}")
            if tuple(shape) != node.shape or dtype != node.dtype:
                fail(index, f"{names[id(node)]} is {node.shape} {node.dtype}, its op infers {shape} {dtype}")
            defined.add(id(node))
            live.add(id(node))
        elif isinstance(instr, Free):
            for node in instr.nodes:
                if id(node) not in live:
                    fail(index, f"free of {names.get(id(node), node)} which is not live")
                if storage is not None and storage.of(node).persistent:
                    fail(index, f"free of {names.get(id(node), node)}, which is stored in a persistent input")
                live.discard(id(node))
                freed.add(id(node))
        else:
            fail(index, f"unknown instruction {instr!r}")
    for name, node in program.outputs:
        if node.op == "const" and node.shape == ():
            continue
        if id(node) not in live:
            raise VerifyError(f"{program.name}: output '{name}' is not defined or was freed")
    if any(isinstance(i, Free) for i in program.body):
        _check_frees(program, storage, names, fail)
    return program


def _check_computed_together(program, index, instr, names, fail) -> None:
    from deepdsl.passes.fuse_multi_output import computed_together

    before = program.body[index - 1] if index > 0 else None
    if not isinstance(before, Let) or before.node is not instr.computes_also:
        fail(index, f"{names[id(instr.node)]} computes a value that the statement before it does not define")
    if before.computes_also is not None:
        fail(index, f"{names[id(instr.node)]} is computed with the statement before it, which is already paired")
    if not computed_together(before, instr):
        fail(index, f"{names[id(instr.node)]} and the statement before it cannot be computed by one call")


def _check_batch(program, index, instr, storage, names, fail) -> None:
    from deepdsl.passes.fuse_horizontal import batch_key

    k = len(instr.batch)
    before = program.body[index - k:index] if index >= k else ()
    if len(before) != k or any(not isinstance(b, Let) or b.node is not v for b, v in zip(before, instr.batch)):
        fail(index, f"{names[id(instr.node)]} computes values that the statements before it do not define")
    key = batch_key(instr)
    if key is None or any(batch_key(b) != key or b.computes_also is not None or b.batch for b in before):
        fail(index, f"{names[id(instr.node)]} and the statements before it are no batch of one kernel")
    statements = (*before, instr)
    members = {id(b.node) for b in statements}

    def where(x):       # the storage of a value (itself where no analysis is needed: no statement is in place)
        return id(storage.root.get(id(x), x)) if storage is not None else id(x)

    for b in statements:
        others = {where(c.into) for c in statements if c is not b and c.into is not None}
        if any(id(x) in members or where(x) in others for x in b.node.inputs):
            fail(index, f"{names[id(instr.node)]}: a statement of its batch reads another one's value or storage")


def _check_in_place(program, index, instr, storage, live, outputs, names, fail) -> None:
    node, target = instr.node, instr.into
    label = names.get(id(target)) or repr(target)
    if id(target) not in live:
        fail(index, f"in place of {label}, which is not live")
    if target.shape != node.shape or target.dtype != node.dtype:
        fail(index, f"in place of {label}: {target.shape} {target.dtype} cannot hold {node.shape} {node.dtype}")
    info = storage.of(target)
    if is_batch_input(info.root):
        fail(index, f"in place of {label}, a value stored in the batch input {info.root.name}")
    if info.persistent:
        if not (is_persistent(target) and (target.name, node) in program.outputs):
            fail(index, f"in place of the persistent {label} by a statement that is not its output '{label}'")
    elif any(id(m) in outputs for m in info.members if info.defined_at[id(m)] < index):
        fail(index, f"in place of {label}, whose storage holds a program output")
    inside = [i for i in node.inputs if id(i) in storage.root and storage.root[id(i)] is info.root]
    if info.persistent:
        allowed = [i for i in node.inputs if node.op == "ew" and i.shape == node.shape]
    else:
        allowed = [node.inputs[j] for j in get_op(node.op).overwritable(node) if node.inputs[j].shape == node.shape]
    if any(not any(i is a for a in allowed) for i in inside):
        fail(index, f"in place of {label}: {node.op} reads the storage it overwrites at other positions")
    for m in info.members:
        if info.defined_at[id(m)] < index and storage.last_read.get(id(m), -1) > index:
            fail(index, f"in place of {label}, but {names.get(id(m), m)} (stored with it) is read later")


def _check_frees(program, storage, names, fail) -> None:
    """Every arena storage without a program output is freed once, right after its last use, by all live values."""
    freed_at: dict[int, list[int]] = {}
    for index, instr in enumerate(program.body):
        if isinstance(instr, Free):
            for node in instr.nodes:
                freed_at.setdefault(id(storage.root[id(node)]), []).append(index)
    for info in storage.arena():
        label = names.get(id(info.root)) or repr(info.root)
        where = sorted(set(freed_at.get(id(info.root), [])))
        if info.output:
            continue
        if not where:
            fail(info.last_use, f"{label} is never freed after its last use")
        if len(where) > 1:
            fail(where[1], f"{label} freed in two places")
        expected = info.last_use + 1
        if where[0] != expected:
            fail(where[0], f"{label} freed at {where[0]}, not right after its last use at {info.last_use}")
        named = {id(n) for n in program.body[where[0]].nodes}
        missing = [m for m in info.live_members() if id(m) not in named]
        if missing:
            fail(where[0], f"free of {label} misses {', '.join(names.get(id(m), repr(m)) for m in missing)}")


def verify_graph(graph: Graph) -> Graph:
    """Graph-level check: every node's shape agrees with its op's rule (a graph is acyclic by construction)."""
    for node in graph.nodes():
        if node.inputs or node.op == "bernoulli":
            shape, dtype = get_op(node.op).infer(*node.inputs, **node.kwargs)
            if tuple(shape) != node.shape or dtype != node.dtype:
                raise VerifyError(f"{graph.name}: {node!r} has shape {node.shape}, its op infers {shape}")
    names = [k for k, _ in graph.outputs]
    if len(set(names)) != len(names):
        raise VerifyError(f"{graph.name}: duplicate output names")
    return graph
