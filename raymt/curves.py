"""Learning curves: train and validation loss, validation BLEU and chrF against step and time.

Reads each run's `logs/metrics.csv` (written by `raymt.metrics.MetricsLog`) and writes
`curves_step.png` and `curves_time.png` (`plot_runs`; `raymt plot` is its command). Every
training run writes its own into `RUN/plots/` (`after_training`). A multilingual run's
validation panels also draw one line per language pair (its `valid_bleu/en-de`, ...
columns): in colours of their own for one run, in the run's colour and a dash pattern per
pair when runs are overlaid.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Optional, Sequence

# (csv column, panel title); validation columns are drawn with markers (a few points each)
CURVES = (
    ("train_loss", "train loss"),
    ("valid_loss", "validation loss"),
    ("valid_bleu", "validation BLEU"),
    ("valid_chrf", "validation chrF"),
)
COLUMNS_READ = {"step", "time_s"} | {column for column, _ in CURVES}
VALID_CURVES = {column for column, _ in CURVES if column.startswith("valid")}  # also drawn per pair
# A pair's line when runs are overlaid (the run's colour, one dash pattern per pair).
PAIR_DASHES = ("--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)))
# x axis -> (csv column, axis label, scale from the column's unit to the label's)
X_AXES = {"step": ("step", "step", 1.0), "time": ("time_s", "wall-clock time (min)", 1 / 60)}
FIGSIZE = (10.0, 7.0)  # inches; with DPI the PNG is 1000 x 700 pixels
DPI = 100

Rows = list[dict[str, float]]


def find_metrics(run: str | Path) -> Path:
    """The metrics.csv of a run directory (RUN/logs/metrics.csv), its logs folder, or the file."""
    run = Path(run)
    for path in (run / "logs" / "metrics.csv", run / "metrics.csv", run):
        if path.is_file() and path.name == "metrics.csv":
            return path
    raise ValueError(
        f"{run}: no metrics.csv found (looked in {run}/logs/); pass a run directory written by `python -m raymt.train`"
    )


def run_name(metrics_csv: Path) -> str:
    """The run's name: its directory (the folder above logs/)."""
    parent = metrics_csv.parent
    return parent.parent.name if parent.name == "logs" else parent.name


def read_metrics(metrics_csv: Path) -> Rows:
    """The csv's rows as numbers (empty cells left out); a resumed run's time keeps counting.

    A resumed run appends to the same file with its clock restarted at 0 and may repeat the
    steps after its checkpoint: later rows replace earlier rows of the same or later steps.
    """
    rows: Rows = []
    offset, last_time = 0.0, 0.0
    with metrics_csv.open(newline="") as f:
        reader = csv.DictReader(f)
        if "step" not in (reader.fieldnames or []):
            raise ValueError(f"{metrics_csv}: not a raymt metrics.csv (no 'step' column)")
        for raw in reader:
            row = {k: float(v) for k, v in raw.items() if is_read(k) and v not in ("", None)}
            if "step" not in row:
                continue
            if rows and (row.get("time_s", last_time) < last_time or row["step"] < rows[-1]["step"]):
                offset = rows[-1].get("time_s", 0.0)  # a resumed run: its clock restarted at 0
                rows = [r for r in rows if r["step"] < row["step"]]
            last_time = row.get("time_s", last_time)
            if "time_s" in row:
                row["time_s"] += offset
            rows.append(row)
    if not rows:
        raise ValueError(f"{metrics_csv}: no rows yet; plot once the run has logged a step")
    return rows


def is_read(column: Optional[str]) -> bool:
    """Whether a csv column is plotted: today's, or a pair's validation column (`valid_bleu/en-de`)."""
    metric, slash, pair = (column or "").partition("/")
    return column in COLUMNS_READ or bool(slash and pair and metric in VALID_CURVES)


def pairs_of(rows: Rows) -> list[str]:
    """The language pairs with validation columns of their own (a multilingual run), in order."""
    found: dict[str, None] = {}
    for row in rows:
        found |= {key.partition("/")[2]: None for key in row if "/" in key}
    return list(found)


def series(rows: Rows, x: str, y: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of the rows that have both columns (NaN losses kept: they are gaps)."""
    points = [(r[x], r[y]) for r in rows if x in r and y in r]
    return [p[0] for p in points], [p[1] for p in points]


def draw(runs: dict[str, Rows], axis: str, path: Path) -> Path:
    """One PNG: a 2x2 grid of the CURVES against the x axis, every run overlaid."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg only: no display, no pyplot
    from matplotlib.figure import Figure

    column, label, scale = X_AXES[axis]
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    pairs = {name: pairs_of(rows) for name, rows in runs.items()}
    for ax, (y, title) in zip(fig.subplots(2, 2).flat, CURVES):
        for i, (name, rows) in enumerate(runs.items()):
            xs, ys = series(rows, column, y)
            style = {"marker": "o", "markersize": 3} if y.startswith("valid") else {}
            shown = f"{name}: all pairs" if y in VALID_CURVES and pairs[name] else name
            ax.plot([v * scale for v in xs], ys, color=f"C{i % 10}", label=shown, **style)
            if y in VALID_CURVES:
                draw_pairs(ax, rows, pairs[name], (column, scale), y, name if len(runs) > 1 else None, i)
        ax.set_title(title)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize="small")
    if any(pairs.values()):  # the validation BLEU panel names the pairs' lines
        fig.axes[2].legend(fontsize="x-small")
    fig.savefig(path)
    return path


def draw_pairs(ax, rows: Rows, pairs: list[str], x: tuple[str, float], y: str, run: Optional[str], i: int) -> None:
    """One line per language pair of a validation curve: colours C1, C2, ... for one run;
    the run's colour C`i` and a dash pattern per pair when several runs (`run` named) overlay."""
    column, scale = x
    for j, pair in enumerate(pairs):
        xs, ys = series(rows, column, f"{y}/{pair}")
        colour, dashes = (f"C{(j + 1) % 10}", "-") if run is None else (f"C{i % 10}", PAIR_DASHES[j % len(PAIR_DASHES)])
        label = pair if run is None else f"{run}: {pair}"
        style = {"marker": "o", "markersize": 2, "linewidth": 1}
        ax.plot([v * scale for v in xs], ys, color=colour, linestyle=dashes, label=label, **style)


def plot_runs(runs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Overlay the runs' curves; write curves_step.png and curves_time.png into out_dir."""
    paths = [find_metrics(run) for run in runs]
    names = [run_name(p) for p in paths]
    if len(set(names)) < len(names):  # two runs with the same name: tell them apart by path
        names = [str(p.parent) for p in paths]
    curves = {name: read_metrics(p) for name, p in zip(names, paths)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [draw(curves, axis, out_dir / f"curves_{axis}.png") for axis in X_AXES]


def after_training(run_dir: str | Path, shown_as: Optional[str] = None) -> Optional[list[Path]]:
    """Write RUN/plots/; a failure prints one line and returns None (plots never fail a run).

    `shown_as`: the run directory to name in the printed line (the URI a local copy goes to)."""
    try:
        written = plot_runs([run_dir], Path(run_dir) / "plots")
    except Exception as err:  # the run's checkpoints and scores matter more than its pictures
        first = (str(err).splitlines() or [""])[0]
        print(f"raymt: learning curves not plotted: {type(err).__name__}: {first}", file=sys.stderr)
        return None
    shown = [f"{shown_as}/plots/{p.name}" if shown_as else str(p) for p in written]
    print(f"learning curves: {', '.join(shown)}")
    return written
