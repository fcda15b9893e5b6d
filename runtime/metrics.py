"""What a run records of its training as it goes: the metric log (`--log run.jsonl`, one JSON object per logged
iteration), the same figures as TensorBoard event files (`--tensorboard DIR`, through tensorboardX, the
`tensorboard` extra), when to validate (`--eval-every N|epoch`) and the best checkpoint's metric (`--keep-best`).

A resumed run continues its log exactly: the entries after the checkpoint's iteration (written by the run that
was stopped after it, a kill -9 included, whose last line may be cut short) are dropped before the first new one is
appended, and the run writes them again (the same figures: the steps are deterministic), so the log holds every
logged iteration once. Event files cannot be rewritten: the resumed writer asks TensorBoard to hide the stopped
run's events after the checkpoint (tensorboardX's `purge_step`).
"""
from __future__ import annotations

import json
import math
import os

from deepdsl_runtime import checkpoint as ckpt

# what a validation may be judged by (--keep-best), and which way is better
METRICS = {"loss": "min", "accuracy": "max"}
EPOCH = "epoch"


class MetricsError(Exception):
    """A problem with a metric option or file, said as one line."""


def parse_every(text: str | None) -> int | str | None:
    """--eval-every: a number of iterations (>= 1), 'epoch', or None (never)."""
    if text is None:
        return None
    if text.strip().lower() == EPOCH:
        return EPOCH
    try:
        every = int(text)
    except ValueError:
        every = 0
    if every < 1:
        raise MetricsError(f"--eval-every must be a number of iterations >= 1 or 'epoch', got '{text}'")
    return every


def metric_sense(metric: str, top: tuple[int, ...]) -> str:
    """'min' or 'max': whether a smaller or a larger value of `metric` is better; an unknown metric is an error
    naming the ones there are (`topK` for each K of `top`)."""
    sense = METRICS.get(metric)
    if sense is None and metric.startswith("top") and metric[3:].isdigit() and int(metric[3:]) in top:
        sense = "max"
    if sense is None:
        known = [*METRICS, *(f"top{k}" for k in top)]
        raise MetricsError(f"--keep-best {metric}: not a validation metric of this run (use {', '.join(known)})")
    return sense


def improves(value: float, best: float | None, sense: str) -> bool:
    """Whether `value` is better than `best` (None: nothing yet); NaN never is."""
    if math.isnan(value):
        return False
    return best is None or (value < best if sense == "min" else value > best)


class MetricLog:
    """The --log file: one JSON object per line, appended as iterations are logged and flushed at once (a killed
    run loses no entry it wrote)."""

    def __init__(self, path: str, start: int, fresh: bool):
        """Open `path` for a run that starts after iteration `start`: a resumed run (`start` > 0) keeps the entries
        up to `start` and drops the others; a new run (`start` 0) finds no log there, or one it may replace
        (`fresh`: --fresh was given)."""
        self.path = path
        entries, dropped = self._read(path)
        if start == 0 and entries and not fresh:
            raise MetricsError(f"--log {path}: holds the log of another run (its last entry: iteration "
                               f"{entries[-1][1]}), and this run starts at iteration 0; remove it, choose another "
                               "file, or add --fresh to replace it")
        kept = [] if start == 0 else [line for line, iteration in entries if iteration <= start]
        if dropped or start == 0 or len(kept) != len(entries):
            text = "".join(kept).encode()
            try:
                ckpt.atomic_write(path, lambda f: f.write(text))
            except OSError as err:
                raise MetricsError(f"cannot write --log {path}: {err.strerror or err}") from None
        try:
            self.file = open(path, "a", encoding="utf-8")
        except OSError as err:
            raise MetricsError(f"cannot write --log {path}: {err.strerror or err}") from None

    @staticmethod
    def _read(path: str) -> tuple[list[tuple[str, int]], bool]:
        """The entries of an existing log as (line, iteration) and whether a last line cut short was dropped. A line
        that is no entry of a log (other than a last one cut short) is an error naming the line."""
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return [], False
        except (OSError, UnicodeDecodeError) as err:
            raise MetricsError(f"--log {path}: cannot be read as a log ({getattr(err, 'strerror', None) or err}); "
                               "choose another file") from None
        entries, dropped = [], False
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
                iteration = entry["iteration"]
                if not isinstance(iteration, int) or not line.endswith("\n"):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                if number == len(lines):      # the last line of a run killed while writing it
                    dropped = True
                    break
                raise MetricsError(f"--log {path}: line {number} is no entry of a metric log (a JSON object with "
                                   "an integer 'iteration'); choose another file") from None
            entries.append((line, iteration))
        return entries, dropped

    def write(self, entry: dict) -> None:
        try:
            self.file.write(json.dumps(entry, allow_nan=True) + "\n")
            self.file.flush()
        except OSError as err:
            raise MetricsError(f"cannot write --log {self.path}: {err.strerror or err}") from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass


# the log entry's fields that TensorBoard shows, and under which tag
_BOARD_TAGS = {"loss": "train/loss", "lr": "train/lr", "images_per_second": "train/images_per_second",
               "data_wait": "train/data_wait", "peak_bytes": "memory/peak_bytes", "val_loss": "val/loss",
               "val_accuracy": "val/accuracy"}


def board_tag(field: str) -> str | None:
    """The TensorBoard tag of a log entry's field (`val_top5` -> `val/top5`), None for one it does not show."""
    if field in _BOARD_TAGS:
        return _BOARD_TAGS[field]
    if field.startswith("val_top"):
        return "val/" + field[4:]
    return None


class Board:
    """TensorBoard event files in a directory (`--tensorboard DIR`), written by tensorboardX."""

    def __init__(self, directory: str, start: int):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise MetricsError("--tensorboard needs tensorboardX: pip install 'deepdsl[tensorboard]'") from None
        try:
            os.makedirs(directory, exist_ok=True)
            # a resumed run hides the events a stopped run wrote after the checkpoint
            self.writer = SummaryWriter(directory, purge_step=start + 1 if start else None, flush_secs=10)
        except OSError as err:
            raise MetricsError(f"cannot write --tensorboard {directory}: {err.strerror or err}") from None
        self.directory = directory

    def write(self, entry: dict) -> None:
        step = entry["iteration"]
        try:
            for field, value in entry.items():
                tag = board_tag(field)
                if tag is not None and value is not None and math.isfinite(value):
                    self.writer.add_scalar(tag, value, step, walltime=entry.get("time"))
        except OSError as err:
            raise MetricsError(f"cannot write --tensorboard {self.directory}: {err.strerror or err}") from None

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError:
            pass
