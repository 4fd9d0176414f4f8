"""A pipeline's steps, run (`run`), listed with their states and the time left (`plan`, a dry run:
no Ray, nothing written) or shown as the command that runs one alone (`show`).

`run` starts a step once every step it uses is done and the cluster has room for what it takes
(its kind's `request`: a training step its workers' CPUs and GPUs, as `raymt train` plans them,
and one CPU for its own process; a step that spreads over the cluster, all of it): independent
steps (teacher seeds, an evaluation beside the next training) run side by side on a cluster with
room for both, one at a time on 2 cores. Each step is its command called in a thread of this
process, whose Ray tasks, actors and Train workers Ray places; so no step holds CPUs its own
workers wait for. OUT/pipeline.json records this pipeline (its languages and training corpus)
and the last run's steps; each finished step's step.json its wall time and resources;
OUT/report.json, report.md and report.png the results (`raymt.pipeline.report`).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from raymt import storage
from raymt.command import command_line
from raymt.errors import check
from raymt.pipeline.config import PipelineConfig
from raymt.pipeline.graph import pipeline_steps
from raymt.pipeline.keys import PIPELINE_FILE, RECORD_FILE, STEPS_DIR, State, read_json, set_keys, step_state
from raymt.pipeline.report import REPORT_JSON, write_report
from raymt.pipeline.steps import KINDS, Context

# Seconds between the lines that name the steps still running (their commands print their own).
PROGRESS_S = 60.0
# Slack when requests are added up (CPUs such as 0.25 per worker).
EPSILON = 1e-6


def identity(cfg: PipelineConfig) -> dict:
    """What makes a pipeline the one an output location holds: its languages and training corpus
    (another validation or test set, more monolingual text or other settings only make steps stale)."""
    train = os.path.abspath(cfg.corpora.train) if cfg.corpora.train else "the built-in corpus"
    return {"languages": list(cfg.pair), "train": train}


def describe(ident: dict) -> str:
    """'en-de on /data/train' for one-line messages."""
    return f"{'-'.join(ident.get('languages', ()))} on {ident.get('train')}"


@dataclass
class Running:
    """A step being run in a thread: what it takes, when it started, how it ended."""

    request: dict
    started: float
    error: Optional[BaseException] = None


def fits(request: dict, running: list[dict], total: dict) -> bool:
    """Whether `request` fits in `total` beside the `running` requests."""
    return all(sum(r.get(k, 0.0) for r in running) + v <= total.get(k, 0.0) + EPSILON for k, v in request.items())


def minutes(seconds: float) -> str:
    """'42 s', '3.5 min' or '2.1 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class Pipeline:
    """A config's steps with their keys, in OUT (the config's output location)."""

    def __init__(
        self, cfg: PipelineConfig, verbose: bool = False, share_output: bool = False, num_cpus: Optional[int] = None
    ):
        out = storage.normalize(cfg.output)
        check(not storage.is_uri(out), f"output={cfg.output}: a local directory for now (object storage: later)")
        self.cfg, self.out, self.num_cpus = cfg, Path(out), num_cpus  # num_cpus: of a local Ray instance
        steps = pipeline_steps(cfg)
        self.records = set_keys(steps, cfg.pair)
        self.ctx = Context(cfg, self.out, {s.name: s for s in steps}, verbose)
        self.identity = identity(cfg)
        last = read_json(self.out / PIPELINE_FILE)
        check(
            last is None or isinstance(last.get("records"), dict),
            f"output={cfg.output}: {PIPELINE_FILE} there is not a pipeline's",
        )
        there = (last or {}).get("pipeline")
        if not (share_output or there is None or there == self.identity):
            raise ValueError(
                f"output={cfg.output} holds another pipeline's steps ({describe(there)}); this config is "
                f"{describe(self.identity)}: give another --output, or --share-output to write there too"
            )
        self.last = (last or {}).get("records", {})

    def state(self, name: str) -> State:
        """Step `name`'s state against the last run's record."""
        step = self.ctx.steps[name]
        return step_state(step, self.records[name], self.out, KINDS[step.kind].done, self.last.get(name))

    def check_step(self, name: str) -> None:
        """A one-line error for a step name the config does not have."""
        check(name in self.ctx.steps, f"no step {name!r}; the steps are {', '.join(self.ctx.steps)}")

    def command(self, name: str) -> str:
        """The command line that runs step `name` alone (the pipeline's own steps say so)."""
        self.check_step(name)
        step = self.ctx.steps[name]
        kind = KINDS[step.kind]
        if kind.command is None:
            return f"# {name}: run by the pipeline itself (no raymt command): {kind.note}"
        line = command_line(kind.command, kind.config(self.ctx, step))
        return f"{line}  # {kind.note}" if kind.note and not kind.done(self.ctx.dir(name)) else line

    def plan(self) -> list[str]:
        """A line per step: its name, key and state (and why it must run); then the time left."""
        states = {name: self.state(name) for name in self.ctx.steps}
        lines = [f"{name:<10} {step.key}  {states[name]}" for name, step in self.ctx.steps.items()]
        return [*lines, self.time_left([name for name, s in states.items() if s.state != "done"])]

    def measured(self) -> tuple[dict[str, float], dict[str, list[float]]]:
        """Wall times measured in OUT (any key's step.json): the latest by step name, all by kind."""
        by_name: dict[str, tuple[float, float]] = {}
        by_kind: dict[str, list[float]] = {}
        for path in (self.out / STEPS_DIR).glob(f"*/{RECORD_FILE}"):
            record = read_json(path)
            if not record or record.get("wall_s") is None:
                continue
            name, when = path.parent.name.rpartition(".")[0], path.stat().st_mtime
            if when >= by_name.get(name, (0.0, -1.0))[1]:
                by_name[name] = (record["wall_s"], when)
            by_kind.setdefault(record.get("kind", ""), []).append(record["wall_s"])
        return {name: wall for name, (wall, _) in by_name.items()}, by_kind

    def time_left(self, todo: list[str]) -> str:
        """The line under the plan: the steps to run, timed as this step (under any key) or its kind
        last took in OUT, added up as if run one after another; the steps never measured named."""
        if not todo:
            return "time left: none (every step is done)"
        by_name, by_kind = self.measured()
        known, guessed, unknown = 0.0, [], []
        for name in todo:
            kind = self.ctx.steps[name].kind
            if name in by_name:
                known += by_name[name]
            elif by_kind.get(kind):
                known += sum(by_kind[kind]) / len(by_kind[kind])
                guessed.append(f"{name} as a {kind} took here")
            else:
                unknown.append(name)
        notes = [*guessed, *([f"unknown for {', '.join(unknown)} (never measured here)"] * bool(unknown))]
        head = f"time left: about {minutes(known)}" if len(unknown) < len(todo) else "time left: unknown"
        return f"{head} for {len(todo)} step(s) one after another" + (f" ({'; '.join(notes)})" if notes else "")

    def needed(self, targets: Sequence[str] = ()) -> list[str]:
        """The steps to run for `targets` (they and the steps they use, at any depth), or all, in order."""
        if not targets:
            return list(self.ctx.steps)
        for name in targets:
            self.check_step(name)
        wanted, stack = set(), list(targets)
        while stack:
            name = stack.pop()
            if name not in wanted:
                wanted.add(name)
                stack.extend(self.ctx.steps[name].uses)
        return [name for name in self.ctx.steps if name in wanted]

    def run(self, targets: Sequence[str] = ()) -> Optional[dict]:
        """The steps (those `targets` need, or all), each skipped when done, started together where
        the cluster has room; a line as each starts and ends; the report once the evaluation is done."""
        from raymt.autoscale import RayCluster
        from raymt.cluster import init_ray

        self.write_record()
        t0 = time.time()
        # One Ray for every step (Train needs the dashboard).
        init_ray(self.num_cpus, dashboard=True, verbose=self.ctx.verbose)
        ran = self.run_steps(self.needed(targets), RayCluster().resources())
        run = {"wall_s": round(time.time() - t0, 1), "steps_run": [name for name, _ in ran]}
        run["overhead_s"] = round(run["wall_s"] - covered(interval for _, interval in ran), 1)
        print(
            f"pipeline: {len(ran)} step(s) run in {minutes(run['wall_s'])} "
            f"({run['overhead_s']:.1f} s of it with no step running)",
            flush=True,
        )
        if not KINDS["evaluate"].done(self.ctx.dir("evaluate")):
            return None
        report = write_report(self.ctx, self.out, run if ran else None)
        print(f"pipeline: report: {self.out / 'report.md'} ({REPORT_JSON}, report.png)", flush=True)
        return report

    def write_record(self) -> None:
        """OUT/pipeline.json: this pipeline (`identity`) and its steps' records (what `plan` compares)."""
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"pipeline": self.identity, "records": self.records}
        (self.out / PIPELINE_FILE).write_text(json.dumps(record, indent=2))

    def request(self, name: str, total: dict) -> dict:
        """What step `name` takes of a cluster of `total` resources (at most all of it)."""
        step = self.ctx.steps[name]
        kind = KINDS[step.kind]
        wanted = kind.request(self.ctx, step, total) if kind.request else dict(total)
        return {k: min(float(v), total.get(k, 0.0)) for k, v in wanted.items() if k in ("CPU", "GPU") and v > 0}

    def run_steps(self, names: list[str], total: dict) -> list[tuple[str, tuple[float, float]]]:
        """Run `names` (in order; each after the steps it uses), each started when the cluster has
        room for it beside those running; after a failure none starts and the running ones finish.
        Returns the steps run with their (start, end) times."""
        waiting, running, ran = list(names), {}, []
        ended: queue.Queue[str] = queue.Queue()
        failed: list[BaseException] = []
        while True:
            for name in list(waiting) if not failed else []:
                if any(used in waiting or used in running for used in self.ctx.steps[name].uses):
                    continue
                if KINDS[self.ctx.steps[name].kind].done(self.ctx.dir(name)):
                    print(f"pipeline: {name} done ({self.ctx.dir(name)})", flush=True)
                    waiting.remove(name)
                    continue
                try:
                    request = self.request(name, total)
                except ValueError as err:  # its workers do not fit the cluster: the command's own line
                    waiting.remove(name)
                    self.failed(name, err, failed, running)
                    break
                if running and not fits(request, [r.request for r in running.values()], total):
                    continue
                waiting.remove(name)
                running[name] = self.start(name, request, ended)
            if not running:
                break
            try:
                name = ended.get(timeout=PROGRESS_S)
            except queue.Empty:
                now = time.time()
                busy = ", ".join(f"{n} ({minutes(now - r.started)})" for n, r in running.items())
                print(f"pipeline: running {busy}", flush=True)
                continue
            step = running.pop(name)
            error = step.error or self.finish(name, step)
            if error is not None:
                self.failed(name, error, failed, running)
            else:
                ran.append((name, (step.started, time.time())))
        if failed:
            raise failed[0]
        return ran

    @staticmethod
    def failed(name: str, error: BaseException, failed: list[BaseException], running: dict) -> None:
        """Step `name` failed with `error`: noted in `failed` and printed, with the steps still running."""
        failed.append(error)
        still = f"; waiting for {', '.join(running)} to end" if running else ""
        print(f"pipeline: {name} failed: {type(error).__name__}: {error}{still}", flush=True)

    def start(self, name: str, request: dict, ended: queue.Queue) -> Running:
        """Step `name` started in a thread of its own, which puts its name in `ended` when it ends."""
        step = self.ctx.steps[name]
        kind = KINDS[step.kind]
        takes = ", ".join(f"{v:g} {k}{'s' * (v != 1)}" for k, v in request.items()) or "nothing"
        print(f"pipeline: {name} starts ({self.state(name)}; takes {takes}): {self.command(name)}", flush=True)
        running = Running(request, time.time())

        def work() -> None:
            try:
                kind.run(self.ctx, step)
            except BaseException as err:  # raised in the driver's thread by run_steps
                running.error = err
            finally:
                ended.put(name)

        # A daemon: Ctrl-C or a failure ends the driver, and Ray its tasks, actors and workers.
        threading.Thread(target=work, name=f"pipeline-{name}", daemon=True).start()
        return running

    def finish(self, name: str, step: Running) -> Optional[ValueError]:
        """Step `name`'s step.json (its record, start, end, wall time and resources), or the error
        of a step that ended without its end marker."""
        where, now = self.ctx.dir(name), time.time()
        if not KINDS[self.ctx.steps[name].kind].done(where):
            return ValueError(f"step {name} ended without its end marker in {where}")
        wall = round(now - step.started, 1)
        times = {"started": round(step.started, 3), "ended": round(now, 3), "wall_s": wall}
        (where / RECORD_FILE).write_text(json.dumps({**self.records[name], **times, "resources": step.request}))
        print(f"pipeline: {name} finished in {minutes(wall)}", flush=True)
        return None


def covered(intervals) -> float:
    """Seconds covered by the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
