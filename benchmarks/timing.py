"""What the benchmarks share: the timing loop and their tables' rows."""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence


def timed_steps(step, warmup: int, steps: int) -> list[float]:
    """Run `step(i)` for i = 0 .. warmup + steps - 1 and return the seconds of each step after the first `warmup`;
    with room on the frame stack for a generated step's calls, as the training command runs them
    (`deepdsl_runtime.frames`)."""
    from deepdsl_runtime.frames import run_with_room

    return run_with_room(_timed_steps, step, warmup, steps)


def _timed_steps(step, warmup: int, steps: int) -> list[float]:
    for i in range(warmup):
        step(i)
    times = []
    for i in range(warmup, warmup + steps):
        began = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - began)
    return times


def train_step_ms(model, warmup: int, steps: int) -> float:
    """The median milliseconds of a model's training step on a random batch (its hyperparameters those of step 0),
    after `warmup` untimed steps."""
    import statistics

    import numpy as np

    x, y = model.random_batch(np.random.default_rng(0))
    hyper = model.hyper(0.01, 0.9, 0.0005, 0)
    model.prepare(hyper)
    x, y = model.rt.asarray(x), model.rt.asarray(y)
    return statistics.median(timed_steps(lambda i: model.train_step(x, y, step=i, **hyper), warmup, steps)) * 1000


def median_ms(call, repeats: int) -> float:
    """The median milliseconds of `repeats` calls of `call()`, after one untimed call."""
    call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2] * 1000


def print_row(cells: Sequence[str], markdown: bool, width: int, header: bool = False) -> None:
    """One row of a results table: Markdown (a header row gets its rule) or columns right-aligned to `width`."""
    if markdown:
        print("| " + " | ".join(cells) + " |")
        if header:
            print("|" + "---|" * len(cells))
    else:
        print("  ".join(f"{c:>{width}}" for c in cells))


# Every side as on a processor without AVX-512 (on one that has it): OpenBLAS on its Haswell kernels, oneDNN and
# PyTorch's own kernels on AVX2, XLA's code for AVX2, and deepdsl's compiled kernels built with -mno-avx512f
# ($DEEPDSL_CFLAGS: another library digest, so the cached AVX-512 libraries are neither used nor replaced).
# PyTorch's matrix products run on the MKL its wheel links, which reads MKL_ENABLE_INSTRUCTIONS (ATen's and oneDNN's
# variables leave it on AVX-512: torch.mm at 152 GFLOP/s a core where AVX2 allows 79-87).
AVX2_ENV = {"OPENBLAS_CORETYPE": "Haswell", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
            "DEEPDSL_CFLAGS": "-mno-avx512f"}


def add_isa_option(parser) -> None:
    """`--isa native|avx2` on a script's parser: avx2 runs every side as on a processor without AVX-512."""
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: every side as on a processor without AVX-512")


def vector_isa(choice: str) -> str:
    """The vector extension the sides run with under `--isa choice`: the processor's widest (`processor`), or with
    avx2 AVX2, the script started again first with AVX2_ENV set (the libraries read it when they load)."""
    if choice == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    widest = processor()[1]
    return "AVX2 (on a processor with AVX-512: every side restricted to AVX2)" if choice == "avx2" and \
        widest == "AVX-512" else widest


def torch_isa() -> str:
    """The vector extensions PyTorch's kernels run on in this process, as its libraries report them: ATen's own
    kernels, MKL's (its matrix products) and oneDNN's (its convolutions), from one small product and one small
    convolution with their libraries' verbose lines caught, e.g. "ATen AVX2, MKL AVX2, oneDNN AVX2"."""
    import ctypes
    import tempfile

    import torch

    def verbose_lines(library, run) -> str:
        sys.stdout.flush()
        with tempfile.TemporaryFile() as caught:
            saved = os.dup(1)
            os.dup2(caught.fileno(), 1)
            try:
                with library.verbose(library.VERBOSE_ON):
                    run()
            finally:
                ctypes.CDLL(None).fflush(None)
                os.dup2(saved, 1)
                os.close(saved)
            caught.seek(0)
            return caught.read().decode(errors="replace")

    def extension(text: str) -> str:
        found = [name for name, marks in (("AVX-512", ("AVX-512", "AVX 10", "avx512")), ("AVX2", ("AVX2", "avx2")))
                 if any(mark in text for mark in marks)]
        return found[0] if found else "unknown"

    parts = [f"ATen {torch.backends.cpu.get_cpu_capability()}"]
    if torch.backends.mkl.is_available():
        parts.append("MKL " + extension(verbose_lines(torch.backends.mkl,
                                                      lambda: torch.mm(torch.ones(8, 8), torch.ones(8, 8)))))
    if torch.backends.mkldnn.is_available():
        parts.append("oneDNN " + extension(verbose_lines(torch.backends.mkldnn, lambda: torch.nn.functional.conv2d(
            torch.ones(2, 32, 14, 14), torch.ones(32, 32, 3, 3), padding=1))))
    return ", ".join(parts)


def add_checkout_options(parser, rounds: int) -> None:
    """The options of a comparison of this checkout with another: NET[:BATCH[:IMAGE]] ..., --against DIR, --threads,
    --rounds (default `rounds`), --markdown."""
    parser.add_argument("networks", nargs="+")
    parser.add_argument("--against", required=True, help="another checkout of this repository")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--markdown", action="store_true")


def other_checkout(path: str, marker: str, script: str) -> Path:
    """The checkout at `path`; one line and exit where it has no file `marker` (no checkout of this repository)."""
    other = Path(path).resolve()
    if not (other / marker).is_file():
        raise SystemExit(f"{script}: {other} is no checkout of this repository (no {marker})")
    return other


def print_comparison_header(other: Path, rounds: str, markdown: bool) -> None:
    """The processor, its vector extension, what a round runs (`rounds`) and the load average, then the table's
    header of a comparison with the checkout `other`."""
    cpu, isa = processor()
    print(f"{cpu} ({isa}); {rounds}; load average before: {load_average()}", flush=True)
    print_row(("network", "threads", f"{other.name} ms", "this ms", "this / other"), markdown, 12, header=True)


def print_comparison(spec: str, threads: int, theirs: list[float], ours: list[float], markdown: bool,
                     digits: int) -> None:
    """A row of a comparison with another checkout: the medians over rounds of theirs and ours (ms), and the median
    of the rounds' ratios ours / theirs."""
    ratio = statistics.median(o / t for o, t in zip(ours, theirs))
    print_row((spec, str(threads), f"{statistics.median(theirs):.{digits}f}", f"{statistics.median(ours):.{digits}f}",
               f"{ratio:.3f}"), markdown, 12)


def load_average() -> str:
    """The machine's 1-, 5- and 15-minute load averages ("unknown" where the system has none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "unknown"


def processor() -> tuple[str, str]:
    """(the processor's name, its widest vector extension: AVX-512, AVX2 or neither) from /proc/cpuinfo."""
    name, flags = "unknown processor", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown processor":
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        return name, "unknown"
    return name, "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
