"""A pipeline's steps run in order, each skipped when done (`run`), listed with their states
(`plan`, a dry run: no Ray, nothing written) or shown as the command that runs one alone (`show`);
OUT/pipeline.json records the last run's steps, OUT/report.json and report.md its results."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from raymt import storage
from raymt.command import command_line
from raymt.errors import check
from raymt.pipeline.config import PipelineConfig
from raymt.pipeline.keys import PIPELINE_FILE, RECORD_FILE, State, read_json, set_keys, step_state
from raymt.pipeline.steps import KINDS, REPORT, Context, pipeline_steps

REPORT_MD = "report.md"


class Pipeline:
    """A config's steps with their keys, in OUT (the config's output location)."""

    def __init__(self, cfg: PipelineConfig, verbose: bool = False):
        out = storage.normalize(cfg.output)
        check(not storage.is_uri(out), f"output={cfg.output}: a local directory for now (object storage: later)")
        self.cfg, self.out = cfg, Path(out)
        steps = pipeline_steps(cfg)
        self.records = set_keys(steps, cfg.pair)
        self.ctx = Context(cfg, self.out, {s.name: s for s in steps}, verbose)
        last = read_json(self.out / PIPELINE_FILE)
        check(
            last is None or isinstance(last.get("records"), dict),
            f"output={cfg.output}: {PIPELINE_FILE} there is not a pipeline's",
        )
        self.last = (last or {}).get("records", {})

    def state(self, name: str) -> State:
        """Step `name`'s state against the last run's record."""
        step = self.ctx.steps[name]
        return step_state(step, self.records[name], self.out, KINDS[step.kind].done, self.last.get(name))

    def command(self, name: str) -> str:
        """The command line that runs step `name` alone (the pipeline's own steps say so)."""
        check(name in self.ctx.steps, f"no step {name!r}; the steps are {', '.join(self.ctx.steps)}")
        step = self.ctx.steps[name]
        kind = KINDS[step.kind]
        if kind.command is None:
            return f"# {name}: run by the pipeline itself (no raymt command): {kind.note}"
        line = command_line(kind.command, kind.config(self.ctx, step))
        return f"{line}  # {kind.note}" if kind.note and not kind.done(self.ctx.dir(name)) else line

    def plan(self) -> list[str]:
        """A line per step: its name, key and state (and why it must run)."""
        lines = []
        for name, step in self.ctx.steps.items():
            lines.append(f"{name:<10} {step.key}  {self.state(name)}")
        return lines

    def run(self) -> Optional[dict]:
        """Each step in order, skipped when done; a line as each starts and ends; the report."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / PIPELINE_FILE).write_text(json.dumps({"records": self.records}, indent=2))
        ran = []
        for name, step in self.ctx.steps.items():
            kind, where = KINDS[step.kind], self.ctx.dir(name)
            if kind.done(where):
                print(f"pipeline: {name} done ({where})", flush=True)
                continue
            print(f"pipeline: {name} starts ({self.state(name)}): {self.command(name)}", flush=True)
            t0 = time.time()
            kind.run(self.ctx, step)
            wall = round(time.time() - t0, 1)
            check(kind.done(where), f"step {name} ended without its end marker in {where}")
            (where / RECORD_FILE).write_text(json.dumps({**self.records[name], "wall_s": wall}, indent=2))
            print(f"pipeline: {name} finished in {wall:.1f} s", flush=True)
            ran.append(name)
        report = self.report()
        print(f"pipeline: {len(ran)} step(s) run; report: {self.out / REPORT_MD}", flush=True)
        return report

    def report(self) -> dict:
        """OUT/report.json and report.md: the evaluation's rows and each step's wall time."""
        report = json.loads((self.ctx.dir("evaluate") / REPORT).read_text())
        report["steps"] = {
            name: {"key": step.key, "wall_s": (read_json(self.ctx.dir(name) / RECORD_FILE) or {}).get("wall_s")}
            for name, step in self.ctx.steps.items()
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=2))
        (self.out / REPORT_MD).write_text(markdown(report))
        return report


def markdown(report: dict) -> str:
    """report.md: the models side by side, then the steps."""
    lines = [
        f"# Pipeline report: {report['test']} ({report['num_sentences']:,} sentences; {report['engine']})",
        "",
        "| model | engine | beam | BLEU | chrF | MiB | sentences/s | speed vs teacher | BLEU vs teacher |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['engine']} | {r['beam']} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['mib']:.1f} | "
            f"{r['sentences_per_s']:,.1f} | {r['speed_vs_teacher']:.2f}x | {r['bleu_vs_teacher']:+.2f} |"
        )
    lines += ["", "| step | key | wall s |", "|---|---|---|"]
    lines += [f"| {name} | {s['key']} | {s['wall_s']} |" for name, s in report["steps"].items()]
    return "\n".join(lines) + "\n"
