"""Which values of an SSA program share storage, and for how long each storage is in use.

Every value lives in one *storage*, named by its root value:
- a batch input (`x`, `y`) or a statement output owns an arena storage (the memory plan gives it an offset);
- a persistent input (parameters, optimizer and running state, hyperparameters, hoisted constants) owns storage
  that outlives the step; the statement computing a program output may write into the input of the same name
  (`Let(node, into=leaf)`), which is how parameter updates happen in place;
- a view (`reshape`, a `slice` of a block that starts on the arena's alignment: `Op.aliases`) computes nothing and
  lives in the storage of its input;
- an in-place statement `Let(node, into=t)` lives in the storage of `t`.

A statement computed together with the one before it (`Let(node, computes_also=v)`, `passes.fuse_multi_output`)
or with the k before it (`Let(node, batch=(v1, ..., vk))`, `passes.fuse_horizontal`) uses the storages of those
values and of their statements' inputs as well: the one call that computes them writes them and reads those inputs
there (their values are read by their own statements, as the program says, so `last_read` does not move).

The analysis here is shared by the in-place and dealloc passes, the memory planner, the verifier and the
interpreter, so all of them agree on what aliases what. When each storage is live, and how many bytes are live at
each instruction, is `deepdsl.liveness`, built on the extents recorded here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from deepdsl.ir import ITEMSIZE, Node
from deepdsl.ops import get_op
from deepdsl.ssa import Let, Program

BATCH_ROLES = frozenset({"data", "label"})


def is_batch_input(node: Node) -> bool:
    """A per-step batch input: counted with the activations, as DeepDSL counted them."""
    return node.op == "input" and node.attr("role") in BATCH_ROLES


def is_persistent(node: Node) -> bool:
    """An input whose storage outlives a step: parameters, state, hyperparameters, hoisted constants."""
    return node.is_leaf and node.op != "const" and not is_batch_input(node)


def is_view(node: Node) -> bool:
    return bool(node.inputs) and get_op(node.op).aliases(node)


def nbytes(node: Node) -> int:
    """`node.nbytes` without numpy's per-call overhead (the memory passes ask for thousands)."""
    return math.prod(node.shape) * ITEMSIZE[node.dtype]


def is_inline(node: Node) -> bool:
    """A scalar constant: part of the expression that reads it, never stored."""
    return node.op == "const" and node.shape == ()


@dataclass(slots=True)
class StorageInfo:
    """One storage: its root (owner), the values stored in it in definition order, and its extent in the body."""

    root: Node
    persistent: bool
    begin: int                  # body index of the root's Let (0 for inputs)
    last_use: int               # last body index that defines or reads a member (begin if never read)
    members: list[Node]
    defined_at: dict[int, int]  # id(member) -> body index of its Let (inputs: -1)
    output: bool = False        # some member is a program output: the storage lives to the end of the step
    overwritten_at: int = -1    # body index of the last in-place statement into it (-1: none)

    def live_members(self) -> list[Node]:
        """Members alive after the last in-place overwrite (the overwritten ones are dead)."""
        return [m for m in self.members if self.defined_at[id(m)] >= self.overwritten_at]


@dataclass
class Storage:
    """The storage analysis of a program (see the module docstring)."""

    root: dict[int, Node]                  # id(value) -> root of its storage
    infos: dict[int, StorageInfo]          # id(root) -> storage
    last_read: dict[int, int]              # id(value) -> last statement reading it (absent: never read)

    def of(self, value: Node) -> StorageInfo:
        return self.infos[id(self.root[id(value)])]

    def arena(self) -> list[StorageInfo]:
        return [info for info in self.infos.values() if not info.persistent]


def analyze(program: Program) -> Storage:
    """Storage of every value of `program`, in its current order (Free statements are ignored)."""
    info_of: dict[int, StorageInfo] = {}   # id(value) -> its storage (the passes ask for this thousands of times)
    last_read: dict[int, int] = {}

    def new(node: Node, begin: int, defined: int, persistent: bool) -> None:
        info_of[id(node)] = StorageInfo(node, persistent, begin, begin, [node], {id(node): defined}, False, -1)

    for leaf in program.inputs:
        new(leaf, 0, -1, is_persistent(leaf))
    # body indices only grow: a storage's last use is the latest index that touches it
    for index, instr in enumerate(program.body):
        if not isinstance(instr, Let):
            continue
        node = instr.node
        for i in node.inputs:
            info = info_of.get(id(i))
            if info is not None:
                last_read[id(i)] = index
                info.last_use = index
        together = (instr.computes_also,) if instr.computes_also is not None else instr.batch
        for value in together:                   # the call computing them reads their inputs, writes their outputs
            for i in (*value.inputs, value):
                info = info_of.get(id(i))
                if info is not None:
                    info.last_use = index
        host = instr.into if instr.into is not None else (node.inputs[0] if is_view(node) else None)
        info = None if host is None else info_of.get(id(host))
        if info is not None:
            info_of[id(node)] = info
            info.members.append(node)
            info.defined_at[id(node)] = index
            info.last_use = index
            if instr.into is not None:
                info.overwritten_at = index
        else:
            new(node, index, index, False)
    for _, node in program.outputs:
        info = info_of.get(id(node))
        if info is not None:
            info.output = True
    root = {key: info.root for key, info in info_of.items()}
    infos = {id(info.root): info for info in info_of.values()}
    return Storage(root, infos, last_read)
