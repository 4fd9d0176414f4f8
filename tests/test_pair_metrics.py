"""Per-pair validation metrics of a multilingual run (docs/design-inputs.md section 5): the
averages that rank checkpoints, the metrics.csv columns and TensorBoard tags, one plotted line
per pair; one pair keeps today's output. Synthetic, no Ray."""

import csv
import math
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
from matplotlib.figure import Figure

from raymt import curves
from raymt.metrics import CSV_COLUMNS, MetricsLog, pair_columns, pair_metrics

PAIRS = ["en-de", "en-fr", "de-en"]
SIGNATURE = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.4.0"


def evaluated(loss: float, bleu: float, chrf: float) -> dict:
    """A pair's `raymt.trainer.evaluate` result."""
    return {
        "valid_loss": loss,
        "valid_bleu": bleu,
        "valid_chrf": chrf,
        "valid_bleu_signature": SIGNATURE,
        "valid_chrf_signature": "chrF2|" + SIGNATURE,
    }


def test_pair_metrics_average_bleu_and_chrf_and_weight_the_loss_by_tokens():
    per_pair = {
        "en-de": evaluated(2.0, 30.0, 50.0),
        "en-fr": evaluated(3.0, 20.0, 40.0),
        "de-en": evaluated(1.0, 40.0, 60.0),
    }
    tokens = {"en-de": 100, "en-fr": 300, "de-en": 600}
    out = pair_metrics(per_pair, tokens)
    assert out["valid_bleu"] == pytest.approx(30.0) and out["valid_chrf"] == pytest.approx(50.0)
    assert out["valid_loss"] == pytest.approx((2.0 * 100 + 3.0 * 300 + 1.0 * 600) / 1000)
    assert out["valid_bleu/en-fr"] == 20.0 and out["valid_chrf/de-en"] == 60.0 and out["valid_loss/en-de"] == 2.0
    assert out["valid_bleu_signature"] == SIGNATURE
    assert set(out) == set(pair_columns(PAIRS)) | {"valid_loss", "valid_bleu", "valid_chrf"} | {
        "valid_bleu_signature",
        "valid_chrf_signature",
    }
    one = evaluated(2.5, 31.0, 52.0)
    assert pair_metrics({"en-de": one}, {"en-de": 10}) == one  # one pair: today's metrics only


def test_pair_columns_follow_todays_only_for_several_pairs():
    assert pair_columns(["en-de"]) == () and pair_columns([]) == ()
    assert pair_columns(PAIRS[:2]) == (
        "valid_loss/en-de",
        "valid_bleu/en-de",
        "valid_chrf/en-de",
        "valid_loss/en-fr",
        "valid_bleu/en-fr",
        "valid_chrf/en-fr",
    )


def write_log(directory: Path, pairs, monkeypatch) -> list:
    """A MetricsLog's train and validation row (per-pair metrics when `pairs`); its TensorBoard tags."""
    from torch.utils.tensorboard import SummaryWriter

    tags = []
    real = SummaryWriter.add_scalar
    monkeypatch.setattr(
        SummaryWriter, "add_scalar", lambda self, tag, *a, **k: (tags.append(tag), real(self, tag, *a, **k))
    )
    per_pair = {p: evaluated(2.0 + i, 30.0 - i, 50.0 - i) for i, p in enumerate(pairs or ["en-de"])}
    log = MetricsLog(directory, pairs=pairs) if pairs is not None else MetricsLog(directory)
    log.write(10, {"epoch": 0, "train_loss": 3.0, "lr": 1e-3})
    log.write(10, pair_metrics(per_pair, {p: 100 for p in per_pair}))
    log.close()
    return tags


def test_metrics_csv_grows_by_the_pairs_columns_only_for_several_pairs(tmp_path, monkeypatch):
    tags = write_log(tmp_path / "multi", PAIRS, monkeypatch)
    with open(tmp_path / "multi" / "metrics.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS + pair_columns(PAIRS)
    assert float(rows[1]["valid_bleu/en-fr"]) == 29.0 and float(rows[1]["valid_bleu"]) == pytest.approx(29.0)
    assert "valid/bleu/de-en" in tags and "valid/loss/en-de" in tags and "valid/bleu" in tags
    for name, pairs in (("none", None), ("one", ["en-de"])):  # a single pair: today's file
        write_log(tmp_path / name, pairs, monkeypatch)
        header = (tmp_path / name / "metrics.csv").read_text().splitlines()[0]
        assert header == ",".join(CSV_COLUMNS)
    # A resumed run keeps the columns its file has.
    write_log(tmp_path / "multi", PAIRS[:2], monkeypatch)
    assert (tmp_path / "multi" / "metrics.csv").read_text().splitlines()[0] == ",".join(
        CSV_COLUMNS + pair_columns(PAIRS)
    )


def write_run(root: Path, name: str, pairs: list[str]) -> Path:
    """A run whose metrics.csv has a train row every 10 steps and a validation row every 50,
    with per-pair columns when several pairs (as MetricsLog writes them)."""
    logs = root / name / "logs"
    logs.mkdir(parents=True)
    with (logs / "metrics.csv").open("w", newline="") as f:
        rows = csv.DictWriter(f, fieldnames=CSV_COLUMNS + pair_columns(pairs))
        rows.writeheader()
        for step in range(10, 201, 10):
            rows.writerow({"step": step, "time_s": step * 0.7, "train_loss": 8 * math.exp(-step / 80) + 1})
            if step % 50 == 0:
                per_pair = {
                    p: evaluated(7 * math.exp(-step / 90) + 1 + i, (30 - 8 * i) * (1 - math.exp(-step / 100)), 50 - i)
                    for i, p in enumerate(pairs)
                }
                metrics = pair_metrics(per_pair, {p: 100 for p in pairs})
                rows.writerow(
                    {"step": step, "time_s": step * 0.7 + 1, **{k: v for k, v in metrics.items() if "sig" not in k}}
                )
    return root / name


def drawn(monkeypatch, runs: list[Path], tmp_path: Path) -> Figure:
    """The figure `curves.draw` saves against steps, as curves_step.png in tmp_path/out."""
    figures, real = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), real(self, *a, **k))[1])
    (tmp_path / "out").mkdir(exist_ok=True)
    by_run = {run.name: curves.read_metrics(curves.find_metrics(run)) for run in runs}
    curves.draw(by_run, "step", tmp_path / "out" / "curves_step.png")
    return figures[0]


def test_validation_panels_draw_one_line_per_pair(tmp_path, monkeypatch):
    run = write_run(tmp_path, "multi", PAIRS)
    rows = curves.read_metrics(run / "logs" / "metrics.csv")
    assert curves.pairs_of(rows) == PAIRS
    assert curves.series(rows, "step", "valid_bleu/en-fr")[0] == [50, 100, 150, 200]
    train, *valid = drawn(monkeypatch, [run], tmp_path).axes
    assert len(train.lines) == 1
    for ax in valid:
        assert [line.get_label() for line in ax.lines] == ["multi: all pairs", *PAIRS]
        colours = [matplotlib.colors.to_hex(line.get_color()) for line in ax.lines]
        assert len(set(colours)) == 4  # the average and each pair in colours of their own
    assert [t.get_text() for t in valid[1].get_legend().get_texts()] == ["multi: all pairs", *PAIRS]
    image = matplotlib.image.imread(tmp_path / "out" / "curves_step.png")
    rgb = (image[..., :3] * 255).astype(int)
    for colour in ("C1", "C2", "C3"):  # the pairs' lines are on the canvas
        target = np.array(matplotlib.colors.to_rgb(colour)) * 255
        assert (np.abs(rgb - target).sum(axis=-1) < 6).sum() > 100, colour


def test_overlaid_runs_keep_their_colour_and_dash_each_pair(tmp_path, monkeypatch):
    runs = [write_run(tmp_path, "a", PAIRS[:2]), write_run(tmp_path, "b", PAIRS[:2])]
    fig = drawn(monkeypatch, runs, tmp_path)
    lines = fig.axes[2].lines
    assert [line.get_label() for line in lines] == [
        "a: all pairs",
        "a: en-de",
        "a: en-fr",
        "b: all pairs",
        "b: en-de",
        "b: en-fr",
    ]
    assert len({matplotlib.colors.to_hex(line.get_color()) for line in lines[:3]}) == 1
    assert lines[1].get_linestyle() != lines[2].get_linestyle()


def test_a_single_pair_run_plots_as_today(tmp_path, monkeypatch):
    fig = drawn(monkeypatch, [write_run(tmp_path, "one", ["en-de"])], tmp_path)
    assert [len(ax.lines) for ax in fig.axes] == [1, 1, 1, 1]
    assert [ax.get_legend() is not None for ax in fig.axes] == [True, False, False, False]
    assert fig.axes[2].lines[0].get_label() == "one"
