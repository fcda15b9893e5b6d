"""`deepdsl plot`: metric logs read (a cut-short last line left out, any other bad line an error naming it), the
figure's lines equal to the logged figures, the picture written whole or not at all, and the output checked before
any log is read."""
from __future__ import annotations

import argparse
import json
import math
import os
import re

import pytest

from deepdsl import plot

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def entries_of(iters: int, scale: float, every: int = 10) -> list[dict]:
    """A log's entries: decreasing loss, cosine lr with warmup, validation (top-1, top-5) every `every`."""
    out = []
    for i in range(1, iters + 1):
        lr = scale * min(1.0, i / 5) * 0.5 * (1 + math.cos(math.pi * i / (iters + 1)))
        entry = {"iteration": i, "epoch": i / 10, "loss": scale * (2.0 / i + 0.01 * (i % 3)), "lr": lr,
                 "images_per_second": None, "data_wait": None, "seconds": 0.1 * i, "peak_bytes": None}
        if i % every == 0:
            entry.update(val_loss=scale / i, val_accuracy=1 - 1 / (i + 1), val_top5=1 - 0.5 / (i + 1),
                         val_examples=100)
        out.append(entry)
    return out


def write_log(path, entries, tail: str = "") -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + tail)
    return str(path)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deepdsl plot")
    plot.add_arguments(parser)
    return parser.parse_args(list(argv))


def lines_by_gid(fig) -> dict:
    return {line.get_gid(): line for ax in fig.axes for line in ax.lines if line.get_gid()}


def legend_texts(fig) -> list[str]:
    from matplotlib.legend import Legend

    return [t.get_text() for ax in fig.axes for child in ax.get_children() if isinstance(child, Legend)
            for t in child.get_texts()]


def axes_text(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


@pytest.fixture
def two_logs(tmp_path):
    a, b = entries_of(40, 1.0), entries_of(30, 0.5, every=7)
    return (write_log(tmp_path / "alpha.jsonl", a), a), (write_log(tmp_path / "beta.jsonl", b), b)


# ------------------------------------------------------------------------------------------------------- reading

def test_read_log_returns_the_entries(tmp_path):
    entries = entries_of(12, 1.0)
    assert plot.read_log(write_log(tmp_path / "r.jsonl", entries)) == entries


def test_truncated_last_line_is_left_out(tmp_path):
    entries = entries_of(12, 1.0)
    path = write_log(tmp_path / "r.jsonl", entries, tail='{"iteration": 13, "loss": 0.')
    assert plot.read_log(path) == entries


def test_bad_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps(e) for e in entries_of(5, 1.0)]
    lines[2] = lines[2][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(plot.PlotError, match=rf"^{path}:3: "):
        plot.read_log(path)


@pytest.mark.parametrize("line, said", [('[1, 2]', "found a array"), ('{"loss": 1.0}', "integer 'iteration'"),
                                        ('{"iteration": 2.5}', "integer 'iteration'"),
                                        ('{"iteration": 2, "lr": "fast"}', "'lr' must be a number"),
                                        ('{"iteration": 2, "val_top3": true}', "'val_top3' must be a number")])
def test_json_that_is_no_entry_is_an_error_even_last(tmp_path, line, said):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"iteration": 1, "loss": 1.0}) + "\n" + line + "\n")
    with pytest.raises(plot.PlotError, match=rf"^{path}:2: .*{said}"):
        plot.read_log(path)


def test_missing_or_empty_log_is_an_error(tmp_path):
    with pytest.raises(plot.PlotError, match=r"cannot read .*nothere\.jsonl: No such file"):
        plot.read_log(tmp_path / "nothere.jsonl")
    (tmp_path / "empty.jsonl").write_text('{"iteration": 1, "lo')     # only a cut-short line
    with pytest.raises(plot.PlotError, match=r"empty\.jsonl: no entries"):
        plot.read_log(tmp_path / "empty.jsonl")


def test_nan_and_null_values_are_not_drawn(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"iteration": 1, "loss": 2.0}\n{"iteration": 2, "loss": NaN}\n{"iteration": 3, "loss": null}\n'
                    '{"iteration": 4, "loss": Infinity}\n{"iteration": 5, "loss": 1.0}\n')
    assert plot.series(plot.read_log(path), "loss") == ([1, 5], [2.0, 1.0])


def test_run_names_are_stems_made_unique(tmp_path):
    assert plot.run_names(["x/a.jsonl", "y/b.jsonl"]) == ["a", "b"]
    assert plot.run_names(["x/run.jsonl", "y/run.jsonl", "z.jsonl"]) == ["x/run", "y/run", "z"]
    assert plot.run_names(["r.jsonl", "r.jsonl"]) == ["r", "r (2)"]


def test_moving_average():
    assert plot.moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [1.5, 2.0, 3.0, 4.0, 4.5]
    assert plot.moving_average([1.0, 5.0], 1) == [1.0, 5.0]


# ------------------------------------------------------------------------------------------------------- the figure

def test_figure_lines_hold_the_logged_values(two_logs):
    (_, a), (_, b) = two_logs
    fig = plot.figure([("alpha", a), ("beta", b)])
    lines = lines_by_gid(fig)
    for name, entries in (("alpha", a), ("beta", b)):
        iters = [e["iteration"] for e in entries]
        assert list(lines[f"{name}:loss"].get_xdata()) == iters
        assert list(lines[f"{name}:loss"].get_ydata()) == [e["loss"] for e in entries]
        assert list(lines[f"{name}:lr"].get_ydata()) == [e["lr"] for e in entries]
        validated = [e for e in entries if "val_accuracy" in e]
        assert list(lines[f"{name}:val_accuracy"].get_xdata()) == [e["iteration"] for e in validated]
        assert list(lines[f"{name}:val_accuracy"].get_ydata()) == [e["val_accuracy"] for e in validated]
        assert list(lines[f"{name}:val_top5"].get_ydata()) == [e["val_top5"] for e in validated]
        assert list(lines[f"{name}:val_loss"].get_ydata()) == [e["val_loss"] for e in validated]
    # each run one colour across panels, the two different
    assert lines["alpha:loss"].get_color() == lines["alpha:lr"].get_color() == lines["alpha:val_accuracy"].get_color()
    assert lines["alpha:loss"].get_color() != lines["beta:loss"].get_color()


def test_figure_legend_titles_and_axes(two_logs):
    (_, a), (_, b) = two_logs
    fig = plot.figure([("alpha", a), ("beta", b)])
    texts = legend_texts(fig)
    assert "alpha" in texts and "beta" in texts
    assert "top-1" in texts and "top-5" in texts
    loss_ax, acc_ax, lr_ax = fig.axes
    assert (loss_ax.get_ylabel(), acc_ax.get_ylabel(), lr_ax.get_ylabel()) == ("loss", "validation accuracy",
                                                                               "learning rate")
    assert lr_ax.get_xlabel() == "iteration"
    assert loss_ax.get_shared_x_axes().joined(loss_ax, lr_ax)
    low, high = acc_ax.get_ylim()
    assert low <= 0 and 1 <= high < 1.1
    assert fig._suptitle.get_text() == "alpha, beta"
    assert plot.figure([("alpha", a)], title="mine")._suptitle.get_text() == "mine"


def test_legends_lie_inside_the_picture(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    name = "a-run-with-a-rather-long-name-of-many-words-" * 2
    runs = [(f"{name}{i}", entries_of(50, 1.0 + i)) for i in range(6)]
    fig = plot.figure(runs)
    FigureCanvasAgg(fig).draw()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 2
    for legend in legends:
        extent = legend.get_window_extent()
        assert fig.bbox.x0 <= extent.x0 and extent.x1 <= fig.bbox.x1 and extent.y1 <= fig.bbox.y1


def test_smoothing_window(two_logs):
    (_, a), _ = two_logs
    ys = [e["loss"] for e in a]
    smoothed = lines_by_gid(plot.figure([("alpha", a)], smooth=5))["alpha:loss_smooth"]
    assert list(smoothed.get_ydata()) == pytest.approx(plot.moving_average(ys, 5))
    assert "alpha:loss_smooth" not in lines_by_gid(plot.figure([("alpha", a)], smooth=0))
    assert plot.auto_window(300) == 15 and plot.auto_window(10) == 1


def test_lr_scale_follows_its_span(tmp_path):
    def lr_scale(values):
        entries = [{"iteration": i + 1, "lr": v} for i, v in enumerate(values)]
        return plot.figure([("r", entries)]).axes[2].get_yscale()

    assert lr_scale([1e-4, 1e-2, 1e-3]) == "log"
    assert lr_scale([0.01, 0.05, 0.02]) == "linear"
    assert lr_scale([0.0, 0.05, 0.01]) == "linear"


def test_no_validation_is_said_in_the_panel():
    entries = [{"iteration": i, "loss": 1.0 / i, "lr": 0.1} for i in range(1, 20)]
    fig = plot.figure([("r", entries)])
    assert "no validation in these logs" in axes_text(fig.axes[1])
    assert not fig.axes[1].lines
    fig = plot.figure([("r", entries_of(20, 1.0))])
    assert "no validation in these logs" not in axes_text(fig.axes[1])


# ------------------------------------------------------------------------------------------------------------ main

def test_main_writes_a_png(tmp_path, two_logs, capsys):
    (pa, a), (pb, b) = two_logs
    out = tmp_path / "curves.png"
    assert plot.main(parse(pa, pb, "-o", str(out))) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 800 <= width <= 2000 and 600 <= height <= 1600
    assert capsys.readouterr().out == f"wrote {out} (2 runs, {len(a) + len(b)} logged iterations)\n"
    assert sorted(os.listdir(tmp_path)) == ["alpha.jsonl", "beta.jsonl", "curves.png"]   # no temporary left


def test_main_default_output_and_svg(tmp_path, two_logs, monkeypatch):
    (pa, _), _ = two_logs
    monkeypatch.chdir(tmp_path)
    assert plot.main(parse(pa)) == 0
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert plot.main(parse(pa, "-o", "c.svg")) == 0
    assert b"<svg" in (tmp_path / "c.svg").read_bytes()[:1000]


def test_main_ignores_a_truncated_last_line(tmp_path, capsys):
    path = write_log(tmp_path / "r.jsonl", entries_of(20, 1.0), tail='{"iteration": 21, "lo')
    assert plot.main(parse(path, "-o", str(tmp_path / "c.png"))) == 0
    assert "20 logged iterations" in capsys.readouterr().out


def expect_error(args: argparse.Namespace, capsys, pattern: str, folder) -> None:
    """main fails with one line on stderr matching `pattern`, and leaves `folder` as it was."""
    before = sorted(os.listdir(folder))
    assert plot.main(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("deepdsl plot: error: ")
    assert re.search(pattern, captured.err), captured.err
    assert sorted(os.listdir(folder)) == before


def test_bad_middle_line_fails_main(tmp_path, two_logs, capsys):
    (pa, _), _ = two_logs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "loss": 1.0}\nnot json\n{"iteration": 3, "loss": 1.0}\n')
    expect_error(parse(pa, str(bad), "-o", str(tmp_path / "c.png")), capsys, rf"{bad}:2: ", tmp_path)


def test_missing_log_fails_main(tmp_path, two_logs, capsys):
    (pa, _), _ = two_logs
    expect_error(parse(pa, str(tmp_path / "gone.jsonl"), "-o", str(tmp_path / "c.png")), capsys,
                 r"cannot read .*gone\.jsonl", tmp_path)


@pytest.mark.parametrize("name, said", [("c.txt", r"cannot write \.txt files \(use one of .*\.png"),
                                        ("c", "no extension")])
def test_bad_extension_fails_before_reading(tmp_path, capsys, monkeypatch, name, said):
    def never(path):
        raise AssertionError("read a log")

    monkeypatch.setattr(plot, "read_log", never)
    expect_error(parse(str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / name)), capsys, said, tmp_path)


def test_output_equal_to_an_input_is_refused(tmp_path, two_logs, capsys, monkeypatch):
    (pa, a), _ = two_logs
    png = tmp_path / "run.png"
    png.write_text('{"iteration": 1, "loss": 1.0}\n')         # a log that happens to end in .png
    before = png.read_bytes()
    monkeypatch.chdir(tmp_path)
    expect_error(parse(pa, "run.png", "-o", str(png)), capsys, "is the log run.png itself", tmp_path)
    assert png.read_bytes() == before


def test_output_folder_must_exist(tmp_path, two_logs, capsys):
    (pa, _), _ = two_logs
    expect_error(parse(pa, "-o", str(tmp_path / "no" / "c.png")), capsys, "no folder", tmp_path)
    expect_error(parse(pa, "-o", str(tmp_path)), capsys, "is a directory", tmp_path)


def test_failed_write_leaves_the_old_picture(tmp_path, two_logs, capsys, monkeypatch):
    (pa, _), _ = two_logs
    out = tmp_path / "c.png"
    out.write_bytes(b"old")

    def broken(self, fname, *args, **kwargs):        # a disk that fills up halfway through the picture
        if isinstance(fname, (str, os.PathLike)):
            with open(fname, "wb") as f:
                f.write(b"part")
        else:
            fname.write(b"part")
        raise OSError(28, "No space left on device")

    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", broken)
    expect_error(parse(pa, "-o", str(out)), capsys, "cannot write .*c.png: No space left", tmp_path)
    assert out.read_bytes() == b"old"


def test_missing_matplotlib_is_one_line(tmp_path, two_logs, capsys, monkeypatch):
    import builtins

    (pa, _), _ = two_logs
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    expect_error(parse(pa, "-o", str(tmp_path / "c.png")), capsys, r"pip install 'deepdsl\[plot\]'", tmp_path)


def test_smooth_must_be_a_count():
    with pytest.raises(SystemExit):
        parse("r.jsonl", "--smooth", "-2")
    assert parse("r.jsonl", "--smooth", "0").smooth == 0
    assert parse("r.jsonl").smooth is None
