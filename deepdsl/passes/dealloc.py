"""Deallocation by liveness: free every tensor right after its last use.

For every arena storage (a batch input or a statement output, with the views and in-place results stored in it,
see `deepdsl.storage`) that holds no program output, one `Free` right after the last statement that defines or
reads any value stored there (`deepdsl.liveness.deaths`) names the values of that storage still alive (those
written after its last in-place overwrite). Storages dying at the same statement share one `Free`, in order of
their roots. Persistent inputs (parameters, state, hyperparameters, hoisted constants) and program outputs are
never freed.
Guarantees: same values; no value is read after it is freed; every arena value that is no output is freed exactly
once, right after its last use (the verifier checks this); statement order unchanged.
"""
from __future__ import annotations

from deepdsl.liveness import deaths
from deepdsl.ssa import Free, Program


def insert_frees(program: Program) -> Program:
    """The program with Free statements after last uses (see the module docstring)."""
    if any(isinstance(i, Free) for i in program.body):
        raise ValueError("insert_frees runs once")
    dying = deaths(program)
    body: list = []
    for k, instr in enumerate(program.body):
        body.append(instr)
        if k in dying:
            body.append(Free(tuple(m for info in dying[k] for m in info.live_members())))
    return program.rewritten(tuple(body))
