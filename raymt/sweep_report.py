"""A sweep's report: one console line per trial result or failure (a Tune callback, `progress`),
the results table (`summarize`: results.json and results.csv in the sweep directory) and its
closing lines (`print_table`). Tune's paths are its filesystem's own (`bucket/key` on S3): they are
printed and stored as whole URIs (`trial_location`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from raymt import storage

METRICS = {"valid_bleu": "max", "valid_chrf": "max", "valid_loss": "min"}
EARLY_STOPPED = "early_stopped"  # in the last result of a trial the scheduler stopped (see _Progress)


class _Progress:
    """Tune callback (on the sweep driver): one console line per trial result or failure; marks
    the last result of a trial the scheduler stopped (EARLY_STOPPED), which `summarize` reads."""

    def __init__(self, params: list[str], metric: str, max_steps: int, sweep_dir: str = ""):
        self.params, self.metric, self.max_steps, self.sweep_dir = params, metric, max_steps, sweep_dir
        self.running: set[str] = set()  # trials whose last line said running

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        """`trial <id>  <params>  step <n>  <metric> <value>  running|completed|stopped`."""
        step = result.get("step", 0)
        # `done` is set on a result callbacks see only when the scheduler has just decided to stop
        # the trial (a trial that ends on its own, on --epochs or train.max_minutes, sends no new result).
        status = "completed" if step >= self.max_steps else "stopped" if result.get("done") else "running"
        if status == "stopped":
            result[EARLY_STOPPED] = True  # Tune keeps this dict as the trial's last result (Result.metrics)
        self.running.discard(trial.trial_id)
        if status == "running":
            self.running.add(trial.trial_id)
        self.print_line(trial, result, status)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        """A trial that ended on its own before max_steps (epochs, time budget) gets its last line."""
        if trial.trial_id in self.running:
            self.running.discard(trial.trial_id)
            self.print_line(trial, trial.last_result, "completed")

    def print_line(self, trial, result: dict, status: str) -> None:
        """One `result_line` for this trial."""
        params = {k: trial.config.get(k) for k in self.params}
        step, value = result.get("step", 0), result.get(self.metric)
        print(result_line(trial.trial_id, params, step, self.metric, value, status), flush=True)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        """Where the failed trial's traceback is."""
        where = trial_location(trial.path, self.sweep_dir)  # s3://bucket/..., not Tune's bucket/...
        print(f"trial {trial.trial_id} failed: its traceback is in {where}/error.txt", flush=True)


def result_line(trial_id: str, params: dict, step: int, metric: str, value: Optional[float], status: str) -> str:
    """One trial result as a console line."""
    shown = "  ".join(f"{k}={v}" for k, v in params.items())
    score = f"{value:.2f}" if isinstance(value, (int, float)) else "-"
    return f"trial {trial_id}  {shown}  step {step}  {metric} {score}  {status}"


def progress(params: list[str], metric: str, max_steps: int, sweep_dir: str = ""):
    """A `ray.tune.Callback` instance of `_Progress` (`sweep_dir`: a URI's scheme for its paths)."""
    from ray import tune

    return type("ResultLines", (_Progress, tune.Callback), {})(params, metric, max_steps, sweep_dir)


def summarize(
    results, metric: str, sweep_dir: str | Path, early_stopping: bool = True, wall_s: Optional[float] = None
) -> dict:
    """One row per trial (its best metric, last step, minutes, status, checkpoint), best first,
    with `early_stopping` (ASHA) the steps it saved, and the sweep's `wall_s` as minutes."""
    mode = METRICS[metric]
    rows, max_steps = [], 0
    for result in results:
        history = result.metrics_dataframe
        config = {k: v for k, v in result.config.items() if k != "base"}
        max_steps = result.config["base"]["train"]["max_steps"]
        if history is None or metric not in history or history[metric].isna().all():
            rows.append({"trial": result.path.split("/")[-1], **config, "status": "error"})
            continue
        best = history[metric].max() if mode == "max" else history[metric].min()
        step = int(history["step"].max())
        checkpoint = result.get_best_checkpoint(metric, mode)
        # Not `step < max_steps`: a trial may end on its own earlier (--epochs, train.max_minutes).
        status = "error" if result.error else "stopped" if result.metrics.get(EARLY_STOPPED) else "completed"
        rows.append(
            {
                "trial": str(result.metrics.get("trial_id")),
                **config,
                "step": step,
                **(
                    {"minutes": round(result.metrics["time_total_s"] / 60, 1)}
                    if "time_total_s" in result.metrics
                    else {}
                ),
                metric: round(float(best), 2),
                "status": status,
                "checkpoint": trial_location(checkpoint.path, sweep_dir) if checkpoint else None,
            }
        )
    sign = -1 if mode == "max" else 1
    rows.sort(key=lambda r: (metric not in r, sign * r.get(metric, 0)))
    summary = {
        "sweep_dir": storage.normalize(sweep_dir),
        "metric": metric,
        "table": rows,
        "best": rows[0] if rows and metric in rows[0] else None,
        "steps": steps_saved(rows, max_steps) if early_stopping else None,
        "minutes": round(wall_s / 60, 1) if wall_s is not None else None,
    }
    storage.write_bytes(storage.join(sweep_dir, "results.json"), json.dumps(summary, indent=2, default=str).encode())
    storage.write_bytes(storage.join(sweep_dir, "results.csv"), _csv(rows).encode())
    return summary


def trial_location(path: str, sweep_dir: str | Path) -> str:
    """A Tune path (a filesystem's own: `bucket/key` on S3) as a location `raymt translate` reads
    (the scheme of `sweep_dir`'s URI added)."""
    scheme, sep, _ = str(sweep_dir).partition("://")
    return f"{scheme}://{path}" if sep and "://" not in path else path


def steps_saved(rows: list[dict], max_steps: int) -> dict:
    """Training steps the stopped trials did not run, of all trials' max_steps."""
    total = max_steps * len(rows)
    saved = sum(max_steps - row["step"] for row in rows if row["status"] == "stopped")
    return {"saved": saved, "total": total, "stopped": sum(row["status"] == "stopped" for row in rows)}


def _csv(rows: list[dict]) -> str:
    """The results table as CSV (columns: union of the rows' keys)."""
    import csv
    import io

    columns = list(dict.fromkeys(k for row in rows for k in row))
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def print_table(summary: dict) -> None:
    """The final table, best trial first, and how to use the best checkpoint."""
    rows = summary["table"]
    columns = [c for c in dict.fromkeys(k for row in rows for k in row) if c != "checkpoint"]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("\n" + "  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))
    best, steps = summary["best"], summary.get("steps")
    if steps and steps["total"]:
        print(
            f"\nearly stopping saved {steps['saved']} of {steps['total']} steps "
            f"({100 * steps['saved'] / steps['total']:.0f}%): {steps['stopped']} of {len(rows)} trials stopped"
        )
    if summary.get("minutes") is not None:
        print(f"\nsweep: {len(rows)} trials in {summary['minutes']} min")
    print(f"\nresults: {summary['sweep_dir']}/results.csv")
    if best:
        config = {k: v for k, v in best.items() if "." in k}
        print(f"best trial {best['trial']}: {summary['metric']} {best[summary['metric']]} with {config}")
        print(f"best checkpoint: {best['checkpoint']}")
        print(f'translate: python -m raymt.translate --checkpoint {best["checkpoint"]} "..."')
