"""A pipeline's report: OUT/report.json, report.md and report.png (`write_report`). Every model on
the test set (the evaluation step's rows), the data funnel (what each step's own output counts:
raw pairs -> each cleaning rule -> kept, translated pairs, ...), each step's wall time and the
CPU- and GPU-hours it held, and a figure: BLEU against one-thread speed, a point per model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from raymt.pipeline.keys import RECORD_FILE, read_json
from raymt.pipeline.steps import KINDS, REPORT, Context

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
REPORT_PNG = "report.png"
FIGSIZE = (7.0, 5.0)  # inches; with DPI the PNG is 700 x 500 pixels
DPI = 100


def step_usage(ctx: Context) -> dict[str, dict]:
    """Each step's key, start, end and wall time, and the CPU-hours (GPU-hours) it held: what it
    took of the cluster (step.json's resources) times its wall time; None for a step not run."""
    steps = {}
    for name, step in ctx.steps.items():
        record = read_json(ctx.dir(name) / RECORD_FILE) or {}
        wall, took = record.get("wall_s"), record.get("resources") or {}
        row = {"key": step.key, "wall_s": wall, "started": record.get("started"), "ended": record.get("ended")}
        row["cpus"], row["gpus"] = took.get("CPU"), took.get("GPU", 0.0)
        row["cpu_hours"] = round(took["CPU"] * wall / 3600, 4) if wall is not None and "CPU" in took else None
        if row["gpus"]:
            row["gpu_hours"] = round(row["gpus"] * wall / 3600, 4)
        steps[name] = row
    return steps


def funnel(ctx: Context) -> list[dict]:
    """The data funnel: the (what, pairs) rows each step's kind reads from its own output, in order."""
    rows = []
    for name, step in ctx.steps.items():
        count = KINDS[step.kind].funnel
        if count is not None:
            rows += [{"step": name, "what": what, "pairs": n} for what, n in count(ctx.dir(name))]
    return rows


def write_report(ctx: Context, out: Path, run: Optional[dict]) -> dict:
    """OUT/report.json, report.md and report.png; `run`: this run's wall time and the time no step
    ran (None: a run that ran no step keeps the last one's)."""
    report = json.loads((ctx.dir("evaluate") / REPORT).read_text())
    report["funnel"] = funnel(ctx)
    report["steps"] = step_usage(ctx)
    report["run"] = run if run is not None else (read_json(out / REPORT_JSON) or {}).get("run")
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2))
    (out / REPORT_MD).write_text(markdown(report))
    figure(report["rows"], out / REPORT_PNG)
    return report


def markdown(report: dict) -> str:
    """report.md: the models side by side, the data funnel, then the steps."""
    lines = [
        f"# Pipeline report: {report['test']} ({report['num_sentences']:,} sentences; {report['engine']})",
        "",
        "| model | engine | beam | BLEU | chrF | MiB | sentences/s | speed vs teacher | BLEU vs teacher |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        speed, bleu = r["speed_vs_teacher"], r["bleu_vs_teacher"]  # None: another direction (backward)
        lines.append(
            f"| {r['model']} | {r['engine']} | {r['beam']} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['mib']:.1f} | "
            f"{r['sentences_per_s']:,.1f} | {'n/a' if speed is None else f'{speed:.2f}x'} | "
            f"{'n/a' if bleu is None else f'{bleu:+.2f}'} |"
        )
    lines += ["", "## The data", "", "| step | what | pairs |", "|---|---|---|"]
    lines += [f"| {row['step']} | {row['what']} | {row['pairs']:,} |" for row in report["funnel"]]
    lines += ["", "## The steps", "", "| step | key | wall s | CPUs | CPU-hours | GPU-hours |", "|" + "---|" * 6]
    for name, s in report["steps"].items():
        cells = (s["wall_s"], s["cpus"], s["cpu_hours"], s.get("gpu_hours"))
        lines.append(f"| {name} | {s['key']} | " + " | ".join("" if c is None else f"{c:g}" for c in cells) + " |")
    run = report.get("run")
    if run:
        lines += [
            "",
            f"The last run: {run['wall_s']:g} s for {len(run['steps_run'])} step(s), {run['overhead_s']:g} s of it "
            "with no step running (the pipeline's own time).",
        ]
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path) -> Optional[Path]:
    """report.png: BLEU against one-thread sentences/s, a labelled point per model and beam; a
    failure prints one line and returns None (a figure never fails a pipeline)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg only: no display, no pyplot
        from matplotlib.figure import Figure

        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for i, r in enumerate(rows):
            ax.scatter(r["sentences_per_s"], r["bleu"], color=f"C{i % 10}")
            ax.annotate(f"{r['model']}, beam {r['beam']}", (r["sentences_per_s"], r["bleu"]), fontsize="small")
        ax.set_xscale("log")
        ax.set_xlabel("sentences/s on one thread (log scale)")
        ax.set_ylabel("BLEU")
        ax.set_title("BLEU against speed, per model")
        ax.grid(alpha=0.3)
        fig.savefig(path)
    except Exception as err:  # the scores matter more than their picture
        first = (str(err).splitlines() or [""])[0]
        print(f"pipeline: report.png not drawn: {type(err).__name__}: {first}", file=sys.stderr)
        return None
    return path
