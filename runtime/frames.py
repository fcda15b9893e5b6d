"""Room on Python's frame stack for a step's calls.

CPython 3.11 and later keep the frames of Python functions on a stack of chunks of at least 16 KB, allocated with
mmap, and unmap a chunk as soon as the frame at its start returns (Objects/obmalloc.c's arenas; Python/pystate.c,
`push_chunk` and `_PyThreadState_PopFrame`). A generated step is one function with a local per value: ResNet-50's
and MobileNet-v2's `train_step` have about 1,850 locals, a frame of 15 KB. Where such a frame ends near its chunk's
end, every call the step makes that does not fit after it maps a fresh chunk, faults its pages in and unmaps it on
return: MobileNet-v2's step (batch 16, 112x112, 2 threads) made 4,100 mmap/munmap pairs and ran at 283 ms in the
training command, 187 ms where the chunk had room (docs/performance.md, "Room on the frame stack"). Whether it had
room depended on how deep the caller's stack was, so a benchmark's harness could change the step's speed by 1.4x.

`roomy(step)` calls `step` from a helper whose frame is a little more than half of a chunk it cannot share: the
helper starts a chunk of its own, and the step's frame and everything it calls fit in the chunk's other half. One
chunk is mapped and unmapped per step instead of one per call. Earlier Pythons allocate each frame on its own and
need nothing: there `roomy` returns the step unchanged.
"""
from __future__ import annotations

import functools
import sys
from types import CodeType

__all__ = ["roomy", "frame_bytes", "CALLS_ROOM"]

CHUNK = 16 * 1024          # the smallest chunk CPython maps (DATA_STACK_CHUNK_SIZE)
CALLS_ROOM = 16 * 1024     # what a step's calls may stack after its frame (the runtime's chains: under 20 frames)
HEADER_SLOTS = 12          # a frame's fixed part (_PyInterpreterFrame), in 8-byte slots, rounded up

NEEDED = sys.version_info >= (3, 11)


def frame_bytes(code: CodeType) -> int:
    """The bytes a frame of `code` takes on the frame stack (its locals, cells, free variables and value stack)."""
    return 8 * (code.co_nlocals + len(code.co_cellvars) + len(code.co_freevars) + code.co_stacksize + HEADER_SLOTS)


@functools.cache
def _helper(chunk: int):
    """A function calling step(*args, **kwargs) whose frame takes half of `chunk` and a little more: its frame never
    fits a chunk that has less free, so it starts one of `chunk` bytes and leaves the other half to the step. The
    locals are never assigned (the code after `return` is dropped by the compiler; the names stay its locals)."""
    slots = chunk // 16 + HEADER_SLOTS
    names = " = ".join(f"_{i}" for i in range(slots))
    source = f"def call_with_room(step, args, kwargs):\n    return step(*args, **kwargs)\n    {names} = None\n"
    scope: dict = {}
    exec(compile(source, "<deepdsl_runtime.frames>", "exec"), scope)
    return scope["call_with_room"]


def chunk_for(code: CodeType) -> int:
    """The chunk whose second half holds a frame of `code` and CALLS_ROOM after it. CPython maps CHUNK doubled until
    it holds the frame that needs it and 8,000 bytes more (MINIMUM_OVERHEAD), so the helper's frame of half the
    chunk and a little more (`_helper`) gets exactly this one."""
    chunk = 2 * CHUNK
    while chunk // 2 - 512 < frame_bytes(code) + CALLS_ROOM:
        chunk *= 2
    return chunk


def roomy(step):
    """`step`, called so that its frame and its calls share one chunk of the frame stack (see the module's doc)."""
    if not NEEDED:
        return step
    helper = _helper(chunk_for(step.__code__))

    @functools.wraps(step)
    def with_room(*args, **kwargs):
        return helper(step, args, kwargs)

    return with_room
