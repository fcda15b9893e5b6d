"""Record tests/golden/network_steps.json anew on this machine: every network of `tests.test_memory_modes` at its
test size, its planned peaks and workspace and the bits of two training steps and a test step (static memory, numpy's
kernels, one thread), with the kernels that computed them (`tests.support.arithmetic.description`).

    python -m tests.support.record_network_steps [NETWORK ...]

A record made here holds bit for bit on machines with the same kernels, within `RECORD_TOLERANCE` on others. Name
networks to record only those (the others keep their record, and the kernels must be the same).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.support.arithmetic import description
from tests.test_memory_modes import BATCH, GOLDEN_PATH, NETWORKS, batches, run_steps
from tests.support.program_helpers import compile_program, import_program, model_class


def record(name: str, image, directory: Path) -> dict:
    compiled, path = compile_program(name, directory / name, batch=BATCH, image=image)
    model_cls = model_class(import_program(path))
    _, (losses, accuracy, test_loss) = run_steps(model_cls, "static", batches(model_cls, 2), kernels="numpy",
                                                     threads=1)
    train, test = compiled.steps["train"].plan, compiled.steps["test"].plan
    return {"losses": [float(v).hex() for v in losses], "test_accuracy": float(accuracy).hex(),
            "test_loss": float(test_loss).hex(), "test_peak_bytes": test.peak_live_bytes,
            "train_peak_bytes": train.peak_live_bytes, "train_workspace_bytes": train.workspace_bytes}


def main(names: list[str]) -> int:
    known = dict(NETWORKS)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"record_network_steps: unknown network {', '.join(unknown)} (use {', '.join(known)})", file=sys.stderr)
        return 1
    golden = json.loads(GOLDEN_PATH.read_text())
    if names and golden.get("kernels") != description():
        print("record_network_steps: the record was made with other kernels: record every network", file=sys.stderr)
        return 1
    golden["kernels"] = description()
    with tempfile.TemporaryDirectory() as directory:
        for name in names or list(known):
            golden[name] = record(name, known[name], Path(directory))
            print(name, golden[name]["losses"], flush=True)
    GOLDEN_PATH.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
