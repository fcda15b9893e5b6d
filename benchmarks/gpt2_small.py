"""GPT-2 small imported from PyTorch and trained by deepdsl: `deepdsl import`, `deepdsl memory` (its table and
`--fit`), then training steps of the generated program.

    python benchmarks/gpt2_small.py [--batch 1] [--fit 16GB] [--iters 2] [--attention-dropout P] [--dir DIR]

The model is tests/support/torch_models.py's GPT2 at GPT-2 small's configuration (Radford et al. 2019: 50,257
tokens, context 1024, 12 layers of 12 heads over 768 features, the output projection tied to the token embedding;
124,439,808 parameters; --attention-dropout: of the attention weights while training, 0.1 in the published
model, none by default), imported at --batch on (batch, 1024) int64 tokens. Each stage runs as its command
would, timed; the training run reads random tokens (`--data synthetic`) from the imported weights (`--init-from`)
and its report gives the seconds an iteration and the measured and planned peak of tensor memory. The processor's
vector extensions and the load average are printed with the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from timing import processor  # noqa: E402  (benchmarks/ is on the path of a script run from it)

FACTORY = '''import sys
sys.path.insert(0, {root!r})
from tests.support.torch_models import GPT2


def gpt2_small():
    return GPT2(vocab=50257, context=1024, dim=768, depth=12, heads=12, attention_dropout={dropout!r})
'''


def stage(what: str, command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=str(cwd))
    print(f"{what}: {time.perf_counter() - began:.1f} s (exit {done.returncode})")
    if done.returncode:
        print(done.stdout[-2000:] + done.stderr[-2000:])
        sys.exit(1)
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--fit", default="16GB")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--dir", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="gpt2-small-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "gpt2small.py").write_text(FACTORY.format(root=str(ROOT), dropout=args.attention_dropout))
    deepdsl = [sys.executable, "-m", "deepdsl"]
    print(f"ISA {processor()[1]}, {os.cpu_count()} cores, load average {os.getloadavg()}")
    done = stage("import", deepdsl + ["import", "gpt2small.py:gpt2_small", "--input", f"{args.batch}x1024:int64",
                                      "-o", "gpt2.py", "--force"], work)
    print("  " + done.stdout.splitlines()[0])
    done = stage("memory", deepdsl + ["memory", "gpt2.py"], work)
    for line in done.stdout.splitlines():
        if line.startswith(("peak", "total", "arena", "persistent", "recomputation")):
            print("  " + line.strip())
    done = stage(f"memory --fit {args.fit}", deepdsl + ["memory", "gpt2.py", "--fit", args.fit], work)
    print("  " + "\n  ".join(done.stdout.strip().splitlines()))
    report = work / "report.json"
    stage(f"run --iters {args.iters}", deepdsl + ["run", "gpt2.py", "--", "--iters", str(args.iters), "--init-from",
                                                  "gpt2.weights.npz", "--params", "", "--test-iters", "0",
                                                  "--report-json", str(report), "--quiet"], work)
    figures = json.loads(report.read_text())
    print(f"  {figures['seconds_per_iter']:.2f} s an iteration at batch {args.batch} (context 1024), loss "
          f"{figures['loss']:.4f}; tensor memory peak {figures['peak_bytes_measured'] / 1e6:.2f} MB measured, "
          f"{figures['peak_bytes_planned'] / 1e6:.2f} MB planned; resident set {figures['max_rss_bytes'] / 1e9:.2f} "
          "GB")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
