"""raymt.plot and raymt.curves: learning-curve PNGs from metrics.csv files (synthetic, no Ray)."""

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from raymt import curves, plot
from raymt.metrics import CSV_COLUMNS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root: Path, name: str, num_steps: int = 200, speed: float = 1.0) -> Path:
    """A run directory whose logs/metrics.csv has MetricsLog's columns: a train row every 10
    steps, a validation row every 50 (written after that step's train row, as the worker does)."""
    logs = root / name / "logs"
    logs.mkdir(parents=True)
    with (logs / "metrics.csv").open("w", newline="") as f:
        rows = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        rows.writeheader()
        for step in range(10, num_steps + 1, 10):
            time_s = round(step * 0.7 / speed, 2)
            rows.writerow(
                {
                    "step": step,
                    "epoch": 0,
                    "time_s": time_s,
                    "lr": 1e-3,
                    "train_loss": 8 * math.exp(-step / 80) + 1,
                    "tokens_per_s": 900.0,
                }
            )
            if step % 50 == 0:
                rows.writerow(
                    {
                        "step": step,
                        "time_s": time_s + 1,
                        "valid_loss": 7 * math.exp(-step / 90) + 1.5,
                        "valid_bleu": 30 * (1 - math.exp(-step / 100)),
                        "valid_chrf": 55 * (1 - math.exp(-step / 100)),
                    }
                )
    return root / name


def check_png(path: Path) -> np.ndarray:
    """A valid PNG of the figure's size that is not blank; returns its pixels."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)  # (H, W, 4) floats in [0, 1]
    width, height = (round(v * curves.DPI) for v in curves.FIGSIZE)
    assert image.shape[:2] == (height, width)
    assert image.std() > 0.05  # not a blank canvas
    colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 20  # lines, text and antialiasing, not a flat fill
    return image


def test_one_run_writes_step_and_time_curves(tmp_path):
    run = write_run(tmp_path, "run-a")
    written = curves.plot_runs([run], tmp_path / "out")
    assert [p.name for p in written] == ["curves_step.png", "curves_time.png"]
    step_image, time_image = (check_png(p) for p in written)
    assert not np.array_equal(step_image, time_image)  # different x axes


def test_overlay_of_two_runs_draws_both_colours(tmp_path):
    a, b = write_run(tmp_path, "run-a"), write_run(tmp_path, "run-b", num_steps=120, speed=2.0)
    assert plot.main([str(a), str(b), "--out", str(tmp_path / "both")]) == 0
    image = check_png(tmp_path / "both" / "curves_step.png")
    rgb = (image[..., :3] * 255).astype(int)
    for colour in ("C0", "C1"):  # each run's line colour is on the canvas
        import matplotlib.colors

        target = np.array(matplotlib.colors.to_rgb(colour)) * 255
        assert (np.abs(rgb - target).sum(axis=-1) < 6).sum() > 200, colour


def test_rows_are_numbers_and_validation_points_separate(tmp_path):
    rows = curves.read_metrics(write_run(tmp_path, "run-a") / "logs" / "metrics.csv")
    steps, bleu = curves.series(rows, "step", "valid_bleu")
    assert steps == [50, 100, 150, 200] and bleu[0] < bleu[-1]
    assert len(curves.series(rows, "time_s", "train_loss")[0]) == 20


def test_a_resumed_run_keeps_its_clock_counting(tmp_path):
    run = write_run(tmp_path, "run-a", num_steps=60)
    with (run / "logs" / "metrics.csv").open("a", newline="") as f:  # resumed from step 50
        rows = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        rows.writerow({"step": 60, "time_s": 5.0, "train_loss": 2.0})
        rows.writerow({"step": 70, "time_s": 12.0, "train_loss": 1.9})
    steps, times = curves.series(curves.read_metrics(run / "logs" / "metrics.csv"), "step", "time_s")
    assert steps == [10, 20, 30, 40, 50, 50, 60, 70]  # the first segment's step 60 replaced
    assert times == sorted(times) and times[-1] == pytest.approx(42.0 + 12.0)


def test_a_run_without_metrics_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(ValueError, match="no metrics.csv"):
        curves.plot_runs([tmp_path / "empty-run"], tmp_path / "out")
    assert plot.main([str(tmp_path / "empty-run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("raymt.plot: error:") and "raymt.train" in err


def test_an_out_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys):
    run = write_run(tmp_path, "run-a")
    (tmp_path / "a-file").write_text("")
    assert plot.main([str(run), "--out", str(tmp_path / "a-file" / "plots")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("raymt.plot: error: cannot write the plots to"), err


def test_after_training_never_raises(tmp_path, capsys):
    assert curves.after_training(tmp_path / "no-such-run") is None
    assert capsys.readouterr().err.count("\n") == 1
    run = write_run(tmp_path, "run-a")
    assert [p.name for p in curves.after_training(run)] == ["curves_step.png", "curves_time.png"]
    assert (run / "plots" / "curves_time.png").is_file()


def test_the_config_renders_its_command():
    from raymt.command import parse, to_argv

    cfg = plot.PlotConfig(runs=["runs/a", "-odd"], out="compare")
    assert to_argv(cfg) == ["--out", "compare", "--", "runs/a", "-odd"]
    assert parse(plot.PlotConfig, to_argv(cfg), "plot") == cfg
    with pytest.raises(SystemExit):  # argparse's usage error, as before: RUN is required
        parse(plot.PlotConfig, [], "plot")
    with pytest.raises(ValueError, match="no run directory"):
        plot.PlotConfig(runs=[])
