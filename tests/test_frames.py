"""Room on the frame stack for a step's calls (deepdsl_runtime.frames): a step of many locals called at any depth
maps no chunk of the frame stack per call."""
import resource
import sys

import pytest

from deepdsl_runtime import frames
from deepdsl_runtime.program import Model

CALLS = 2000


def _leaf(a):
    """A callee of some size: its frame (60 locals) does not fit in the last few hundred bytes of a chunk."""
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = b8 = b9 = c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = a  # noqa: F841
    d0 = d1 = d2 = d3 = d4 = d5 = d6 = d7 = d8 = d9 = e0 = e1 = e2 = e3 = e4 = e5 = e6 = e7 = e8 = e9 = a  # noqa: F841
    f0 = f1 = f2 = f3 = f4 = f5 = f6 = f7 = f8 = f9 = g0 = g1 = g2 = g3 = g4 = g5 = g6 = g7 = g8 = g9 = a  # noqa: F841
    return a


def _big_step(locals_: int):
    """A function of `locals_` locals (a frame of about 8 bytes each, like a generated step's) calling `_leaf`
    CALLS times."""
    names = [f"v{i}" for i in range(locals_)]
    source = (f"def step(leaf, n):\n    {' = '.join(names)} = 0\n    for _ in range(n):\n        leaf(1)\n"
              f"    return {names[-1]}\n")
    scope: dict = {}
    exec(compile(source, "<big step>", "exec"), scope)
    return scope["step"]


def _at_depth(depth: int, fn, *args):
    return fn(*args) if depth == 0 else _at_depth(depth - 1, fn, *args)


def _faults(fn, *args) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn(*args)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_the_chunk_holds_the_frame_and_its_calls():
    step = _big_step(1850).__code__
    chunk = frames.chunk_for(step)
    helper = frames._helper(chunk).__code__
    assert chunk // 2 < frames.frame_bytes(helper) < chunk // 2 + 1024       # CPython maps this chunk for it
    assert frames.frame_bytes(helper) + 8000 <= chunk
    assert chunk - frames.frame_bytes(helper) - 512 >= frames.frame_bytes(step) + frames.CALLS_ROOM
    assert frames.chunk_for(_leaf.__code__) == 4 * frames.CHUNK              # the smallest: 16 KB of calls


@pytest.mark.skipif(sys.version_info < (3, 11), reason="frames are allocated one by one before Python 3.11")
@pytest.mark.parametrize("locals_", [1500, 1700, 1850])
def test_a_step_called_at_any_depth_maps_no_chunk_per_call(locals_):
    step = _big_step(locals_)
    with_room = frames.roomy(step)
    assert with_room.__wrapped__ is step
    bare = [_faults(_at_depth, depth, step, _leaf, CALLS) for depth in range(0, 240)]
    roomy = [_faults(_at_depth, depth, with_room, _leaf, CALLS) for depth in range(0, 240)]
    assert max(roomy) < CALLS // 10, roomy
    if max(bare) < CALLS:
        pytest.skip(f"this Python maps no chunk per call at any of these depths ({max(bare)} faults at most)")
    assert _at_depth(7, with_room, _leaf, 3) == 0


def test_a_generated_program_s_steps_have_room():
    class Net(Model):
        def train_step(self, x, y, *, step, **hyper):
            return x + y

    assert Net.train_step.__wrapped__.__name__ == "train_step" or not frames.NEEDED
    assert Net(kernels="numpy").train_step(1.0, 2.0, step=0) == 3.0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="frames are allocated one by one before Python 3.11")
def test_inside_a_run_s_room_a_step_maps_nothing():
    """`run_with_room` (the training command's) keeps one chunk for the run: a step called inside it faults no page
    in, where outside it each call maps the step's own chunk."""
    with_room = frames.roomy(_big_step(1850))
    outside = [_faults(_at_depth, depth, with_room, _leaf, 10) for depth in range(40)]
    inside = frames.run_with_room(lambda: [_faults(_at_depth, depth, with_room, _leaf, 10) for depth in range(40)])
    assert min(outside) >= 1 and sum(inside) < sum(outside) / 4, (outside, inside)


def test_a_room_is_left_as_it_was_entered_when_its_function_raises():
    def fails():
        assert frames._inside.rooms == 2
        raise ValueError("inside")

    def outer():
        with pytest.raises(ValueError, match="inside"):
            frames.run_with_room(fails)
        return frames._inside.rooms

    if not frames.NEEDED:
        pytest.skip("no rooms before Python 3.11")
    assert frames.run_with_room(outer) == 1 and frames._inside.rooms == 0
    assert frames.run_with_room(lambda a, b=0: a + b, 1, b=2) == 3
