"""Room on Python's frame stack for a step's calls.

CPython 3.11 and later keep the frames of Python functions on a stack of chunks of at least 16 KB, allocated with
mmap, and unmap a chunk as soon as the frame at its start returns (Objects/obmalloc.c's arenas; Python/pystate.c,
`push_chunk` and `_PyThreadState_PopFrame`). A generated step is one function with a local per value: ResNet-50's
and MobileNet-v2's `train_step` have about 1,850 locals, a frame of 15 KB. Where such a frame ends near its chunk's
end, every call the step makes that does not fit after it maps a fresh chunk, faults its pages in and unmaps it on
return: MobileNet-v2's step (batch 16, 112x112, 2 threads) made 4,100 mmap/munmap pairs and ran at 283 ms in the
training command, 187 ms where the chunk had room (docs/performance.md, "Room on the frame stack"). Whether it had
room depended on how deep the caller's stack was, so a benchmark's harness could change the step's speed by 1.4x.

A helper whose frame is a little more than half of a chunk cannot share a chunk: it starts one of its own, and
what it calls fits in the chunk's other half. `run_with_room(fn)` calls `fn` so, with room for a loop and any step
it calls (the training command runs in it, `deepdsl_runtime.run`): the chunk stays mapped for the whole run.
`roomy(step)` (every generated step, `deepdsl_runtime.program.Model`) calls `step` directly inside such a room, and
elsewhere through a helper of its own size: one chunk mapped and unmapped per step instead of one per call (about
25 us a step on one thread, 0.2-0.4 ms with a second thread waiting, LeNet at batch 64). Earlier Pythons allocate
each frame on its own and need nothing: there both call straight through.
"""
from __future__ import annotations

import functools
import sys
import threading
import types
from types import CodeType

__all__ = ["CALLS_ROOM", "chunk_for", "frame_bytes", "roomy", "run_with_room"]

CHUNK = 16 * 1024          # the smallest chunk CPython maps (DATA_STACK_CHUNK_SIZE)
CALLS_ROOM = 16 * 1024     # what a step's calls may stack after its frame (the runtime's chains: under 20 frames)
HEADER_SLOTS = 12          # a frame's fixed part (_PyInterpreterFrame), in 8-byte slots, rounded up
LOOP_ROOM = 32 * 1024      # what a loop inside `run_with_room` may stack before it calls a step
RUN_CHUNK = 256 * 1024     # `run_with_room`'s chunk: 128 KB of room, steps of frames up to 80 KB called directly

NEEDED = sys.version_info >= (3, 11)


def frame_bytes(code: CodeType) -> int:
    """The bytes a frame of `code` takes on the frame stack (its locals, cells, free variables and value stack)."""
    return 8 * (code.co_nlocals + len(code.co_cellvars) + len(code.co_freevars) + code.co_stacksize + HEADER_SLOTS)


def _call_with_room(step, args, kwargs):
    return step(*args, **kwargs)


@functools.cache
def _helper(chunk: int):
    """`_call_with_room` with a frame of half of `chunk` and a little more: its frame never fits a chunk that has
    less free, so it starts one of `chunk` bytes and leaves the other half to what it calls. The frame's size is
    its code's locals, here unused names added to the code object (no bytecode reads them; each call sets them to
    NULL, one store each)."""
    code = _call_with_room.__code__
    slots = chunk // 16 + HEADER_SLOTS
    code = code.replace(co_varnames=code.co_varnames + tuple(f"_{i}" for i in range(slots)),
                        co_nlocals=code.co_nlocals + slots)
    return types.FunctionType(code, globals(), "call_with_room")


def _room(chunk: int) -> int:
    """The bytes after the helper's frame in its chunk of `chunk` bytes (less a margin for the chunk's header)."""
    return chunk // 2 - 512


def chunk_for(code: CodeType) -> int:
    """The chunk whose second half holds a frame of `code` and CALLS_ROOM after it. CPython maps CHUNK doubled until
    it holds the frame that needs it and 8,000 bytes more (MINIMUM_OVERHEAD), so the helper's frame of half the
    chunk and a little more (`_helper`) gets exactly this one."""
    chunk = 2 * CHUNK
    while _room(chunk) < frame_bytes(code) + CALLS_ROOM:
        chunk *= 2
    return chunk


_inside = threading.local()         # .rooms: how many `run_with_room` calls this thread is in


def run_with_room(fn, *args, **kwargs):
    """fn(*args, **kwargs) at the start of a chunk of RUN_CHUNK bytes, its calls to steps direct (`roomy`)."""
    if not NEEDED:
        return fn(*args, **kwargs)
    _inside.rooms = getattr(_inside, "rooms", 0) + 1
    try:
        return _helper(RUN_CHUNK)(fn, args, kwargs)
    finally:
        _inside.rooms -= 1


def roomy(step):
    """`step`, called so that its frame and its calls share one chunk of the frame stack (see the module's doc)."""
    if not NEEDED:
        return step
    chunk = chunk_for(step.__code__)
    helper = _helper(chunk)
    fits = frame_bytes(step.__code__) + CALLS_ROOM + LOOP_ROOM <= _room(RUN_CHUNK)

    @functools.wraps(step)
    def with_room(*args, **kwargs):
        if fits and getattr(_inside, "rooms", 0):
            return step(*args, **kwargs)
        return helper(step, args, kwargs)

    return with_room
