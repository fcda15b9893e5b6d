"""The static memory plan of an SSA program: where every value lives, and when, as data.

The planner is a pure function of a program that has been through the memory passes (schedule, in-place,
dealloc). It gives every arena storage (a batch input, or a statement output with its views and in-place results,
see `deepdsl.storage`) one `Buffer`: a byte range of one arena, and the body indices during which the range is in
use. Code generation reads the plan to emit every statement with explicit output buffers; the memory table prints
it. Both read the same object, so the table and the running program cannot disagree.

Definitions (body indices count every instruction, `Let` and `Free`; the ranges and the live bytes are
`deepdsl.liveness`'s, the model scheduling and rematerialization predict):
- a buffer is *live* at body index i when `begin <= i < end`: `begin` is the index of the `Let` that allocates it
  (0 for batch inputs, which are live when the step starts), `end` the index of the `Free` that releases it
  (`len(body)` for a storage holding a program output, which lives until the step returns);
- a buffer occupies `size` bytes: its exact `nbytes` rounded up to `ALIGNMENT` (256, what `cudaMalloc` and the
  runtime pool guarantee), at least one unit; offsets are multiples of `ALIGNMENT`;
- `live_bytes(i)` is the sum of the sizes of the buffers live at i, and the *peak live bytes* is its maximum: the
  high-water mark of bytes of tensors allocated at once, counted by placed (rounded) size. It is exactly the
  `peak_bytes_in_use` of the runtime pool allocator given the same allocations and frees in the same order, and
  what a generated program reports. The same quantity over exact sizes is `peak_live_bytes_exact`.
- a statement whose input dies at it may *take over* that input's buffer (`Op.takes_over`: pooling and its
  backward, a convolution's input gradient; ops computing each sample from the same sample of that input): its
  own buffer starts at the same offset and begins at the statement that ends the input's buffer, so the two share
  bytes during that one statement only, where the runtime kernel reads each sample before its bytes are
  overwritten. Live bytes count the pair once, at the larger size: max pooling's output (1/4 of a 2x2-pooled
  input) costs nothing while it is made and the input's tail is released right after; max pooling's backward
  grows its input gradient over the dying output gradient. Pairs are made only where they lower the peak (sharing
  an offset constrains the packing), and the statement's workspace grows by one sample of the smaller of the two.
Invariants (`MemoryPlan.check`): buffers live at the same time never overlap in the arena, except a buffer and
the one it takes over, at the same offset, during the one statement they share; every buffer fits in
`arena_bytes`; `peak_live_bytes <= arena_bytes`.

Offsets come from interval packing: several greedy heuristics (by size, first-fit by size, by allocation order, as
in TFLite's arena planner and XLA's buffer assignment) each place every buffer at the lowest (or best-fitting)
offset that overlaps no buffer live at the same time, and the smallest arena wins.

Persistent storage (parameters, optimizer state, running statistics, hyperparameters, hoisted constants) lies
outside the arena, and so does the workspace: one region shared by all statements, as large as the largest
`Op.workspace` of any statement (within `workspace_limit` when given, by running over the batch in chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deepdsl.ir import Node
from deepdsl.ops import get_op
from deepdsl.liveness import changes_at, dealloc_positions, live_bytes, live_ranges, peak_bytes
from deepdsl.ssa import Free, Let, Program
from deepdsl.storage import analyze, is_batch_input, is_inline, is_persistent, is_view, nbytes
from deepdsl.passes.specialize import is_batch_statistics
from deepdsl.training import is_accumulator, is_optimizer_state
from deepdsl_runtime.contract import ALIGNMENT, FLOAT_BYTES, placed_size, stage_floats


@dataclass(frozen=True, slots=True)
class Buffer:
    """One arena block: bytes [offset, offset + size) hold `values` from body index `begin` (inclusive) to `end`
    (exclusive)."""

    index: int
    value: Node                    # the root: the batch input or statement output that allocates it
    nbytes: int                    # exact bytes of the root
    size: int                      # placed bytes: nbytes rounded up to the alignment
    offset: int                    # a multiple of the alignment
    begin: int                     # body index of the allocating Let (0 for batch inputs)
    end: int                       # body index of the releasing Free (len(body) if it holds a program output)
    values: tuple[Node, ...]       # every value stored here in definition order: root, views, in-place results
    takes_over: int | None = None  # index of the buffer whose bytes this one takes over (same offset; that buffer
                                   # ends right after this one's first statement, which reads it as it writes)


@dataclass(frozen=True, slots=True)
class Persistent:
    """Storage outside the arena that outlives a step: one input leaf."""

    leaf: Node
    kind: str        # "param", "optimizer", "gradient", "batch", "running", "hyper", "hoisted" or "other"
    nbytes: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one value lives: in arena buffer `buffer` at `offset`, or in the persistent input `leaf`."""

    value: Node
    buffer: int | None             # index into MemoryPlan.buffers; None when persistent
    offset: int | None             # byte offset in the arena (the buffer's, or inside it for a slice's view); None
    #                                when persistent
    leaf: Node | None              # the persistent input holding it; None when in the arena
    view_of: Node | None = None    # a view (reshape, a slice's block): this value's bytes, nothing computed
    in_place_of: Node | None = None  # an in-place statement: overwrote this value's bytes
    takes_over: Node | None = None   # a statement whose buffer starts inside this dying input's (see Buffer)


@dataclass(frozen=True, slots=True)
class Step:
    """One body instruction as the runtime executes it."""

    index: int                     # body index
    instr: Let | Free
    allocates: int | None          # buffer allocated by this Let (None: view, in place, persistent output)
    releases: tuple[int, ...]      # buffers released by this Free
    workspace: int                 # workspace bytes the statement uses (0 for Free)
    chunks: int                    # batch chunks the statement runs in (1: whole batch)
    live_bytes: int                # placed bytes of the buffers live at this index
    live_bytes_exact: int          # the same, exact sizes


@dataclass(frozen=True)
class MemoryPlan:
    """The static memory plan of one program (see the module docstring for definitions and invariants)."""

    name: str                      # the SSA program's name (lenet_train)
    alignment: int
    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    persistent: tuple[Persistent, ...]
    outputs: tuple[tuple[str, Placement | None], ...]   # None: an inline constant
    arena_bytes: int
    workspace_bytes: int
    workspace_limit: int | None
    peak_live_bytes: int
    peak_live_bytes_exact: int
    peak_step: int                 # first body index where live_bytes reaches the peak (-1 for an empty body)
    packing: str                   # the heuristic whose offsets were kept
    placements: dict[int, Placement] = field(repr=False, compare=False)   # id(value) -> placement

    def placement(self, value: Node) -> Placement | None:
        """Where `value` lives (None for inline constants)."""
        return self.placements.get(id(value))

    def persistent_bytes(self, kind: str) -> int:
        return sum(p.nbytes for p in self.persistent if p.kind == kind)

    @property
    def param_bytes(self) -> int:
        return self.persistent_bytes("param")

    @property
    def optimizer_bytes(self) -> int:
        return self.persistent_bytes("optimizer")

    @property
    def total_bytes(self) -> int:
        """Everything the program needs at once: arena, workspace and persistent storage."""
        return self.arena_bytes + self.workspace_bytes + sum(p.nbytes for p in self.persistent)

    def check(self) -> "MemoryPlan":
        """Raise AssertionError unless the invariants hold; return the plan."""
        n = len(self.steps)
        for b in self.buffers:
            assert b.offset % self.alignment == 0 and b.size % self.alignment == 0, b
            assert b.size >= b.nbytes and b.offset + b.size <= self.arena_bytes, b
            assert 0 <= b.begin < b.end <= max(n, 1), b
        for b in self.buffers:
            if b.takes_over is not None:
                a = self.buffers[b.takes_over]
                assert a.offset == b.offset and a.end == b.begin + 1, (a, b)
        events = sorted(self.buffers, key=lambda b: b.offset)
        for i, a in enumerate(events):
            for b in events[i + 1:]:
                if b.offset >= a.offset + a.size:
                    break
                handover = b.takes_over == a.index or a.takes_over == b.index
                assert a.end <= b.begin or b.end <= a.begin or handover, f"buffers {a.index} and {b.index} overlap"
        assert self.peak_live_bytes <= self.arena_bytes
        return self


def plan_memory(program: Program, workspace_limit: int | None = None, takeover: bool = True) -> MemoryPlan:
    """The memory plan of `program` (see the module docstring); `takeover`: let statements take over the storage of
    a dying input where that lowers the peak."""
    storage = analyze(program)
    roots, intervals, sizes, takes = _buffers(program, storage, takeover)
    placements: dict[int, Placement] = {}
    pairs = [(a, b) for b, a in takes.items()]
    offsets, packing = pack(intervals, sizes, peak_bytes(intervals, sizes, pairs), pairs)
    buffers = tuple(Buffer(k, info.root, nbytes(info.root), sizes[k], offsets[k], intervals[k][0], intervals[k][1],
                           tuple(info.members), takes.get(k)) for k, info in enumerate(roots))
    buffer_of = {id(b.value): b for b in buffers}

    for info in storage.infos.values():
        buf = None if info.persistent else buffer_of[id(info.root)]
        for member in info.members:
            into = program.body[info.defined_at[id(member)]].into if member is not info.root else None
            view_of = member.inputs[0] if member is not info.root and into is None and is_view(member) else None
            taken = (buffers[buf.takes_over].value if buf is not None and member is info.root
                     and buf.takes_over is not None else None)
            offset = buf.offset if buf else None       # a view's or an in-place value's: where its bytes start
            if buf is not None and (view_of is not None or into is not None):
                host = view_of if view_of is not None else into
                offset = placements[id(host)].offset + (get_op(member.op).view_offset(member) if view_of else 0)
            placements[id(member)] = Placement(member, buf.index if buf else None, offset,
                                               None if buf else info.root, view_of=view_of, in_place_of=into,
                                               takes_over=taken)

    steps, peak, peak_exact, peak_step, ws_max = _steps(program, buffers, workspace_limit)
    arena = max((b.offset + b.size for b in buffers), default=0)
    persistent = tuple(Persistent(leaf, _kind(leaf), nbytes(leaf)) for leaf in program.inputs
                       if is_persistent(leaf))
    outputs = tuple((name, None if is_inline(node) else placements.get(id(node))) for name, node in program.outputs)
    return MemoryPlan(program.name, ALIGNMENT, buffers, steps, persistent, outputs, arena, ws_max, workspace_limit,
                      peak, peak_exact, peak_step, packing, placements)


def _buffers(program: Program, storage, takeover: bool, freed: tuple[list[int], int] | None = None):
    """(the arena storages in allocation order, their live intervals, their placed sizes, buffer index -> index of
    the buffer it takes over); `freed`: of the program dealloc makes of `program` (`live_ranges`)."""
    ranges = live_ranges(program, storage, freed)
    roots = [r.storage for r in ranges]
    intervals = [(r.begin, r.end) for r in ranges]
    sizes = [r.size for r in ranges]
    takes = _takeovers(program, storage, roots, intervals, sizes, freed[0] if freed else None) if takeover else {}
    return roots, intervals, sizes, takes


def planned_live_bytes(program: Program, takeover: bool = True) -> list[int]:
    """The live bytes at each body index of `program` (after dealloc) as its plan counts them (`MemoryPlan.steps`),
    without packing the buffers: for a pass that compares the peaks of two versions of a program."""
    _, intervals, sizes, takes = _buffers(program, analyze(program), takeover)
    return live_bytes(intervals, sizes, [(a, b) for b, a in takes.items()], len(program.body))


def dealloc_live_bytes(program: Program, takeover: bool = True) -> tuple[list[int], list[int]]:
    """(`planned_live_bytes(insert_frees(program), takeover)` of a program without frees, the index there of each
    of its statements), from one storage analysis of `program`: a pass that compares the peaks of many versions of
    a program before dealloc (fuse_horizontal's search) needs neither the freed programs nor their analyses."""
    storage = analyze(program)
    freed = dealloc_positions(program, storage)
    _, intervals, sizes, takes = _buffers(program, storage, takeover, freed)
    return live_bytes(intervals, sizes, [(a, b) for b, a in takes.items()], freed[1]), freed[0]


def _kind(leaf: Node) -> str:
    if leaf.op == "param":
        return "param"
    if leaf.op == "state":
        return ("optimizer" if is_optimizer_state(leaf) else "gradient" if is_accumulator(leaf) else
                "batch" if is_batch_statistics(leaf) else "running")
    role = leaf.attr("role")
    return role if role in ("hyper", "hoisted") else "other"


def stage_bytes(input_bytes: int, output_bytes: int, batch: int) -> int:
    """Workspace a statement taking over its input's bytes adds after its op's own scratch: one sample of the
    smaller of input and output, through which the runtime kernel runs the samples it cannot run in place."""
    return stage_floats(input_bytes, output_bytes, batch) * FLOAT_BYTES


def _takeovers(program: Program, storage, roots: list, intervals: list[tuple[int, int]],
               sizes: list[int], at: list[int] | None = None) -> dict[int, int]:
    """Buffer index -> index of the buffer it takes over: a statement of an op with `takes_over` whose input's arena
    storage (no batch input, no program output, read through that input only) ends right after it. Only where it
    lowers the peak: elsewhere sharing an offset would only constrain the packing. `at`: the intervals index the
    program dealloc makes of `program`, where statement k is at at[k]."""
    index = {id(info.root): k for k, info in enumerate(roots)}
    result: dict[int, int] = {}
    for k, instr in enumerate(program.body):
        if not isinstance(instr, Let) or instr.into is not None:
            continue
        node = instr.node
        j = get_op(node.op).takes_over
        if j is None or id(node) not in index:
            continue
        source = storage.root.get(id(node.inputs[j]))
        a = index.get(id(source))
        here = k if at is None else at[k]
        if a is None or is_batch_input(source) or roots[a].output or intervals[a][1] != here + 1:
            continue
        if any(storage.root.get(id(i)) is source for n, i in enumerate(node.inputs) if n != j):
            continue                # the kernel reads the storage through another input too
        result[index[id(node)]] = a
    if result:
        live = live_bytes(intervals, sizes, [(a, b) for b, a in result.items()])
        peak = max(live)
        for b, a in list(result.items()):
            if live[intervals[b][0]] + min(sizes[a], sizes[b]) <= peak:
                del result[b]               # the step stays below the peak without sharing
    return result


def _workspace(node: Node, allocated: int | None, buffers, workspace_limit: int | None) -> tuple[int, int]:
    """(workspace bytes, batch chunks) of the statement computing `node` into buffer `allocated`: its op's scratch
    within the limit, plus the stage of a buffer taking over another's bytes (`stage_bytes`)."""
    stage = 0
    if allocated is not None and buffers[allocated].takes_over is not None:
        stage = stage_bytes(buffers[buffers[allocated].takes_over].nbytes, buffers[allocated].nbytes, node.shape[0])
    limit = None if workspace_limit is None else max(workspace_limit - stage, 0)
    workspace, chunks = get_op(node.op).workspace(node, limit)
    return workspace + stage, chunks


def workspace_bytes(plan: "MemoryPlan", workspace_limit: int | None) -> int:
    """The workspace `plan`'s program would need under another limit: its plan under that limit differs in nothing
    else (the arena does not depend on the limit)."""
    allocates = {id(b.value): b.index for b in plan.buffers}
    return max((_workspace(s.instr.node, allocates.get(id(s.instr.node)), plan.buffers, workspace_limit)[0]
                for s in plan.steps if isinstance(s.instr, Let)), default=0)


def _steps(program, buffers, workspace_limit):
    intervals = [(b.begin, b.end) for b in buffers]
    pairs = [(b.takes_over, b.index) for b in buffers if b.takes_over is not None]
    n = len(program.body)
    live = live_bytes(intervals, [b.size for b in buffers], pairs, n)
    live_exact = live_bytes(intervals, [b.nbytes for b in buffers], pairs, n)
    _, ends = changes_at(intervals)
    allocates = {id(b.value): b.index for b in buffers}
    peak = peak_exact = 0
    peak_step = -1
    ws_max = 0
    steps = []
    for k, instr in enumerate(program.body):
        allocated = None
        workspace = chunks = 0
        if isinstance(instr, Let):
            allocated = allocates.get(id(instr.node))
            workspace, chunks = _workspace(instr.node, allocated, buffers, workspace_limit)
            ws_max = max(ws_max, workspace)
        releases = tuple(ends.get(k, ())) if isinstance(instr, Free) else ()
        here, here_exact = live[k], live_exact[k]
        steps.append(Step(k, instr, allocated, releases, workspace, max(chunks, 1), here, here_exact))
        if here > peak:
            peak, peak_step = here, k
        peak_exact = max(peak_exact, here_exact)
    if not program.body:            # only inputs: they are live while the (empty) step runs
        peak = sum(b.size for b in buffers)
        peak_exact = sum(b.nbytes for b in buffers)
    return tuple(steps), peak, peak_exact, peak_step, ws_max


# ---------------------------------------------------------------------------------------------------------------
# interval packing

def pack(intervals: list[tuple[int, int]], sizes: list[int], lower_bound: int = 0,
         same_offset: list[tuple[int, int]] = ()) -> tuple[list[int], str]:
    """Offsets for blocks of `sizes` live over half-open `intervals`, such that blocks live at the same time do
    not overlap, except the pairs `(a, b)` of `same_offset`, which are placed at one offset (b takes over a); the
    smallest arena among a few greedy orders, stopping at the first that reaches `lower_bound` (the peak of live
    bytes: optimal). Returns (offsets, name of the heuristic)."""
    if not sizes:
        return [], "none"
    groups = _groups(len(sizes), same_offset)
    begin = np.array([i[0] for i in intervals], dtype=np.int64)
    end = np.array([i[1] for i in intervals], dtype=np.int64)
    size = np.array(sizes, dtype=np.int64)
    k = np.arange(len(sizes))
    candidates = {
        "size/first-fit": np.lexsort((k, begin, -size)),
        "size/best-fit": np.lexsort((k, begin, -size)),
        # equal sizes (a layer's activation and its gradient) with the later-ending first: long-lived blocks settle
        # low before the short-lived ones of the same size
        "size, later end first/first-fit": np.lexsort((k, -end, -size)),
        "size*duration/first-fit": np.lexsort((k, begin, -(size * (end - begin)))),
        "allocation/first-fit": np.lexsort((k, begin)),
    }
    best = None
    for name, order in candidates.items():
        offsets = _place(order, begin, end, size, best_fit=name.endswith("best-fit"), groups=groups)
        arena = int((offsets + size).max())
        if best is None or arena < best[0]:
            best = (arena, offsets, name)
        if arena <= lower_bound:
            break
    return [int(o) for o in best[1]], best[2]


_UNBOUNDED = np.array([np.iinfo(np.int64).max], dtype=np.int64)   # the gap above every placed block


def _groups(n: int, pairs) -> dict[int, list[int]]:
    """Block -> the blocks that must share its offset (chains of takeovers), for blocks in some pair."""
    parent = list(range(n))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for a, b in pairs:
        parent[find(b)] = find(a)
    members: dict[int, list[int]] = {}
    for a, b in pairs:
        for k in (a, b):
            group = members.setdefault(find(k), [])
            if k not in group:
                group.append(k)
    return {k: group for group in members.values() for k in group}


def _lowest_common_offset(members, begin, end, size, placed) -> int:
    """The lowest offset at which every block of `members` overlaps no placed block live at the same time as it."""
    placed_begin, placed_end, placed_lo, placed_hi = placed
    forbidden = []                   # open ranges of offsets (lo - s, hi): a block of size s there would overlap
    for k in members:
        mask = (placed_begin < end[k]) & (placed_end > begin[k])
        forbidden.extend(zip((placed_lo[mask] - size[k]).tolist(), placed_hi[mask].tolist()))
    offset = 0
    for lo, hi in sorted(forbidden):
        if lo >= offset:
            break                    # every later range starts above the offset too
        offset = max(offset, hi)
    return offset


def _place(order, begin, end, size, best_fit: bool, groups: dict[int, list[int]] | None = None) -> np.ndarray:
    n = len(order)
    placed_begin = np.empty(n, dtype=np.int64)
    placed_end = np.empty(n, dtype=np.int64)
    placed_lo = np.empty(n, dtype=np.int64)
    placed_hi = np.empty(n, dtype=np.int64)
    offsets = np.zeros(n, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    m = 0
    for k in order:
        if done[k]:
            continue
        if groups and k in groups:
            members = groups[k]
            offset = _lowest_common_offset(members, begin, end, size,
                                           (placed_begin[:m], placed_end[:m], placed_lo[:m], placed_hi[:m]))
            for j in members:
                offsets[j] = offset
                done[j] = True
                placed_begin[m], placed_end[m], placed_lo[m], placed_hi[m] = begin[j], end[j], offset, offset + size[j]
                m += 1
            continue
        done[k] = True
        b, e, s = begin[k], end[k], size[k]
        if m:
            mask = (placed_begin[:m] < e) & (placed_end[:m] > b)
            lo = placed_lo[:m][mask]
        else:
            lo = placed_lo[:0]
        if len(lo) == 0:
            offset = 0
        else:
            hi = placed_hi[:m][mask]
            by = np.argsort(lo, kind="stable")
            lo, hi = lo[by], hi[by]
            gap_start = np.concatenate(([0], np.maximum.accumulate(hi)))
            gap_end = np.concatenate((lo, _UNBOUNDED))
            room = gap_end - gap_start
            fits = np.nonzero(room >= s)[0]
            if best_fit:
                choice = fits[np.argmin(room[fits])]
            else:
                choice = fits[0]
            offset = int(gap_start[choice])
        offsets[k] = offset
        placed_begin[m], placed_end[m], placed_lo[m], placed_hi[m] = b, e, offset, offset + s
        m += 1
    return offsets
