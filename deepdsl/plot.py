"""`deepdsl plot run.jsonl [other.jsonl ...] -o curves.png`: training curves of one or more runs from their metric
logs (`--log run.jsonl` of a generated training program, one JSON object per logged iteration).

One figure, three panels over the iteration: the training loss (thin, with a moving average over it) and the
validation loss; the validation accuracy (top-1 and every top-K the logs hold); the learning rate. Each run is one
colour, named by its file's stem. Drawn with matplotlib (the `plot` extra, imported only here and only when a
figure is drawn) on a bare `Figure`, so no GUI backend is touched: raster formats are rendered by Agg.

A log's last line may be cut short (a run killed while writing it): it is left out. Any other line that is no log
entry is an error naming the file and the line. The picture is written whole or not at all (a temporary file
beside it, renamed over it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence

# fields of a log entry that hold a number or null (`val_top<K>` too); others are carried along unchecked
NUMBER_FIELDS = ("epoch", "loss", "lr", "images_per_second", "data_wait", "seconds", "peak_bytes", "val_loss",
                 "val_accuracy", "val_examples")
_TOP_K = re.compile(r"val_top(\d+)")
_NO_MATPLOTLIB = "plotting needs matplotlib, which is not installed: pip install 'deepdsl[plot]'"
_MARKERS = ("s", "^", "D", "v", "P", "X")       # top-K markers after top-1's "o"
_TITLE_CHARS = 90


class PlotError(Exception):
    """A problem with a log file, an option or the output, said as one line."""


# ---------------------------------------------------------------------------------------------------------- reading

def read_log(path: str | os.PathLike) -> list[dict]:
    """The entries of a metric log, in file order: each a dict with an integer "iteration" whose numeric fields
    (`NUMBER_FIELDS`, `val_top<K>`) are numbers or None. Blank lines are skipped; a last line that is not JSON (cut
    short by a killed run) is left out. A file that cannot be read, a line that is no entry (other than such a last
    line) and a file without entries are a `PlotError` naming the file (and the line)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as err:
        raise PlotError(f"cannot read {name}: {err.strerror or err}") from None
    numbered = [(number, line) for number, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    entries = []
    for position, (number, raw) in enumerate(numbered):
        try:
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            if position == len(numbered) - 1:
                break
            raise PlotError(f"{name}:{number}: not a line of a metric log (a JSON object per line)") from None
        entries.append(_checked(entry, f"{name}:{number}"))
    if not entries:
        raise PlotError(f"{name}: no entries (is it a metric log written by --log?)")
    return entries


def _checked(entry: object, where: str) -> dict:
    """`entry` if it is a log entry, else a `PlotError` at `where` saying what is wrong."""
    if not isinstance(entry, dict):
        raise PlotError(f"{where}: not a log entry (a JSON object), found a {_json_type(entry)}")
    iteration = entry.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool):
        raise PlotError(f"{where}: a log entry needs an integer 'iteration', found {json.dumps(iteration)}")
    for field, value in entry.items():
        if (field in NUMBER_FIELDS or _TOP_K.fullmatch(field)) and value is not None and not _is_number(value):
            raise PlotError(f"{where}: '{field}' must be a number or null, found a {_json_type(value)}")
    return entry


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def run_names(paths: Sequence[str | os.PathLike]) -> list[str]:
    """One name per log: its file's stem; where stems repeat, as many trailing folders as tell them apart
    (`a/run`, `b/run`); the same file twice is numbered (`run (2)`)."""
    parts = []
    for path in paths:
        full = os.path.abspath(os.fspath(path))
        shown = os.path.relpath(full)
        pieces = (full if shown.startswith("..") else shown).split(os.sep)
        pieces[-1] = os.path.splitext(pieces[-1])[0] or pieces[-1]
        parts.append([p for p in pieces if p])
    depth = [1] * len(parts)
    while True:
        names = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        repeated = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(parts[i])]
        if not repeated:
            break
        for i in repeated:
            depth[i] += 1
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return unique


# ---------------------------------------------------------------------------------------------------------- drawing

def series(entries: Sequence[dict], field: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of `field` over the entries that hold a finite number for it, by iteration; an
    iteration logged twice counts as its later entry."""
    latest = {}
    for entry in entries:
        latest[entry["iteration"]] = entry
    xs, ys = [], []
    for iteration in sorted(latest):
        value = latest[iteration].get(field)
        if _is_number(value) and math.isfinite(value):
            xs.append(iteration)
            ys.append(float(value))
    return xs, ys


def auto_window(points: int) -> int:
    """The moving average's window for a curve of `points` points: about a twentieth of them, none (1) under 40."""
    return max(1, points // 20) if points >= 40 else 1


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The centred moving average of `values` over `window` points (an even window is widened by one); near the
    ends the window shrinks to the points there are, so the result is as long as `values`."""
    half = window // 2
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    n = len(values)
    return [(sums[min(n, i + half + 1)] - sums[max(0, i - half)]) / (min(n, i + half + 1) - max(0, i - half))
            for i in range(n)]


def top_ks(entries: Sequence[dict]) -> list[int]:
    """The K of every top-K accuracy in the entries, 1 (`val_accuracy`) first when present."""
    ks = {int(m.group(1)) for e in entries for f in e if (m := _TOP_K.fullmatch(f))}
    if any("val_accuracy" in e for e in entries):
        ks.add(1)
    return sorted(ks)


def _accuracy_field(entries: Sequence[dict], k: int) -> str:
    return "val_accuracy" if k == 1 and any("val_accuracy" in e for e in entries) else f"val_top{k}"


def figure(runs: Sequence[tuple[str, Sequence[dict]]], smooth: int | None = None, title: str | None = None):
    """The matplotlib `Figure` of the runs, each (name, entries): panels loss, validation accuracy, learning rate
    over a shared iteration axis. `smooth`: the moving average's window over the training loss (None: by
    `auto_window`; 0 or 1: none). Every data line carries a gid `<run>:<field>` (`<run>:loss_smooth` for the
    average) for whoever inspects the figure."""
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import PercentFormatter
    except ImportError:
        raise PlotError(_NO_MATPLOTLIB) from None
    fig = Figure(figsize=(11, 8.5), layout="constrained")
    loss_ax, acc_ax, lr_ax = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": (2.2, 1.5, 1)})
    palette = colormaps["tab10" if len(runs) <= 10 else "tab20"].colors
    ks = sorted({k for _, entries in runs for k in top_ks(entries)})
    markers = {1: "o", **{k: _MARKERS[i % len(_MARKERS)] for i, k in enumerate(k for k in ks if k != 1)}}
    windows, val_loss_seen, lrs, ks_seen = set(), False, [], set()
    for index, (name, entries) in enumerate(runs):
        color = palette[index % len(palette)]
        xs, ys = series(entries, "loss")
        window = auto_window(len(ys)) if smooth is None else min(smooth, len(ys))
        smoothed = window > 1
        if xs:
            loss_ax.plot(xs, ys, color=color, linewidth=0.7 if smoothed else 1.3, alpha=0.3 if smoothed else 1.0,
                         gid=f"{name}:loss", label=f"{name} train loss")
        if xs and smoothed:
            windows.add(window)
            loss_ax.plot(xs, moving_average(ys, window), color=color, linewidth=1.8, gid=f"{name}:loss_smooth",
                         label=f"{name} train loss, moving average of {window}")
        vx, vy = series(entries, "val_loss")
        if vx:
            val_loss_seen = True
            loss_ax.plot(vx, vy, color=color, linestyle="--", linewidth=1, marker="o", markersize=4,
                         markeredgecolor="white", markeredgewidth=0.6, gid=f"{name}:val_loss",
                         label=f"{name} validation loss")
        for k in top_ks(entries):
            field = _accuracy_field(entries, k)
            kx, ky = series(entries, field)
            if kx:
                ks_seen.add(k)
                acc_ax.plot(kx, ky, color=color, linestyle="-" if k == 1 else ":", linewidth=1.2, marker=markers[k],
                            markersize=4.5, gid=f"{name}:{field}", label=f"{name} top-{k}")
        lx, ly = series(entries, "lr")
        if lx:
            lrs.extend(ly)
            lr_ax.plot(lx, ly, color=color, linewidth=1.5, gid=f"{name}:lr", label=f"{name} learning rate")

    # loss: the runs' colours, then what each line style means (one legend per panel: constrained layout makes
    # room beside the axes for that one only)
    loss_ax.set_ylabel("loss")
    loss_ax.grid(True, alpha=0.3)
    if not loss_ax.lines:
        _say(loss_ax, "no loss in these logs")
    key = [(Line2D([], [], color=palette[i % len(palette)], linewidth=2), name) for i, (name, _) in enumerate(runs)]
    styles = []
    if any(line.get_gid().endswith(":loss") for line in loss_ax.lines):
        styles.append((Line2D([], [], color="0.35", linewidth=0.7, alpha=0.5), "training loss"))
    if windows:
        which = f" of {windows.pop()}" if len(windows) == 1 else ""
        styles.append((Line2D([], [], color="0.35", linewidth=1.8), f"moving average{which}"))
    if val_loss_seen:
        styles.append((Line2D([], [], color="0.35", linestyle="--", linewidth=1, marker="o", markersize=4),
                       "validation loss"))
    if styles:
        key += [(Line2D([], [], linestyle="none"), ""), *styles]
    loss_ax.legend(*zip(*key), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                   ncols=1 if len(runs) <= 16 else 2)

    # validation accuracy: top-1 and every top-K, in [0, 1]
    acc_ax.set_ylabel("validation accuracy")
    acc_ax.set_ylim(-0.03, 1.03)
    acc_ax.set_yticks([0, 0.25, 0.5, 0.75, 1])
    acc_ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    acc_ax.grid(True, alpha=0.3)
    if ks_seen:
        shown = sorted(ks_seen)
        acc_ax.legend([Line2D([], [], color="0.35", linestyle="-" if k == 1 else ":", marker=markers[k])
                       for k in shown], [f"top-{k}" for k in shown],
                      loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        _say(acc_ax, "no validation in these logs")

    # learning rate: a log scale when it spans more than a factor 10
    lr_ax.set_ylabel("learning rate")
    lr_ax.grid(True, alpha=0.3)
    if lrs and min(lrs) > 0 and max(lrs) > 10 * min(lrs):
        lr_ax.set_yscale("log")
    if not lrs:
        _say(lr_ax, "no learning rate in these logs")
    lr_ax.set_xlabel("iteration")
    lr_ax.xaxis.get_major_locator().set_params(integer=True)

    fig.suptitle(title if title is not None else _title([name for name, _ in runs]))
    return fig


def _say(ax, text: str) -> None:
    """Write `text` in the middle of an empty panel."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.45", fontsize="medium")
    ax.set_yticks([])


def _title(names: Sequence[str]) -> str:
    """The run names, as many as fit on a line."""
    text = ", ".join(names)
    if len(text) <= _TITLE_CHARS:
        return text
    shown = []
    for name in names:
        if len(", ".join([*shown, name])) > _TITLE_CHARS - 20:
            break
        shown.append(name)
    return f"{', '.join(shown)} and {len(names) - len(shown)} more runs"


# ------------------------------------------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `deepdsl plot`."""
    parser.add_argument("logs", nargs="+", metavar="LOG", help="metric logs (--log run.jsonl of training programs)")
    parser.add_argument("-o", "--output", default="curves.png", metavar="FILE",
                        help="the picture to write; its extension names the format (default: curves.png)")
    parser.add_argument("--smooth", type=_window, default=None, metavar="N",
                        help="points in the moving average of the training loss (0: none; default: about a "
                             "twentieth of the points)")
    parser.add_argument("--title", default=None, metavar="TEXT", help="the figure's title (default: the run names)")


def _window(text: str) -> int:
    try:
        window = int(text)
    except ValueError:
        window = -1
    if window < 0:
        raise argparse.ArgumentTypeError(f"expected a number of points >= 0 (0: no smoothing), got '{text}'")
    return window


def main(args: argparse.Namespace) -> int:
    """Draw the logs `args.logs` into `args.output`; the exit status (1 and one line on stderr on any error,
    nothing written)."""
    try:
        output, runs = _prepare(args)
        fig = figure(runs, smooth=args.smooth, title=args.title)
        _write(fig, output)
    except PlotError as err:
        print(f"deepdsl plot: error: {err}", file=sys.stderr)
        return 1
    total = sum(len(entries) for _, entries in runs)
    print(f"wrote {output} ({len(runs)} run{'s' * (len(runs) != 1)}, {total} logged iterations)")
    return 0


def _prepare(args: argparse.Namespace) -> tuple[str, list[tuple[str, list[dict]]]]:
    """The output checked (matplotlib present, a format it writes, a folder to write in, no input replaced), then
    the logs read, as (name, entries)."""
    output = os.fspath(args.output)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise PlotError(_NO_MATPLOTLIB) from None
    if os.path.isdir(output):
        raise PlotError(f"-o {output}: is a directory; name the picture file")
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = os.path.splitext(output)[1][1:].lower()
    if kind not in kinds:
        known = ", ".join("." + k for k in sorted(kinds))
        said = f"matplotlib cannot write .{kind} files" if kind else "no extension to name the format"
        raise PlotError(f"-o {output}: {said} (use one of {known})")
    folder = os.path.dirname(output) or "."
    if not os.path.isdir(folder):
        raise PlotError(f"-o {output}: no folder {folder} to write it in")
    target = os.path.realpath(output)
    for log in args.logs:
        if os.path.realpath(log) == target or (os.path.exists(output) and os.path.exists(log)
                                               and os.path.samefile(log, output)):
            raise PlotError(f"-o {output} is the log {log} itself; choose another output")
    names = run_names(args.logs)
    return output, [(name, read_log(log)) for name, log in zip(names, args.logs)]


def _write(fig, output: str) -> None:
    """Save `fig` to `output` atomically, in the format its extension names."""
    from deepdsl_runtime.checkpoint import atomic_write

    kind = os.path.splitext(output)[1][1:].lower()
    try:
        atomic_write(output, lambda f: fig.savefig(f, format=kind, dpi=120))
    except OSError as err:
        raise PlotError(f"cannot write {output}: {err.strerror or err}") from None


__all__ = ["PlotError", "read_log", "run_names", "series", "moving_average", "auto_window", "top_ks", "figure",
           "add_arguments", "main"]
