"""Chaos soak: a job killed again and again ends exactly as an uninterrupted one (issue 46).

CPU, 2 Ray Train workers, the default model (`mini`) on the built-in corpus. Every mode runs an
uninterrupted reference first, then the same command under faults, and compares what both left:

- `--mode train` (default): `python -m raymt.train` for --steps steps; a random Ray Train
  worker process (`ray::RayTrainWorker`) SIGKILLed every --kill-every K1,K2 seconds (Ray
  Train restarts the group from the latest checkpoint: train.max_failures), and the driver
  once, half way (its process group SIGKILLed, then `--resume RUN`). Final weights (tensor by
  tensor, max abs diff: must be 0.0), the data trace (train.trace_data: the pairs of every
  (rank, step)) and metrics.csv's train_loss per step and valid_loss must be equal.
- `--mode elastic`: the same run on a local three-node cluster (ray.cluster_utils, as
  tests/test_elastic.py): a node removed after two checkpoints (2 -> 1 worker), added back
  after a checkpoint of 1 worker (1 -> 2). Dropout streams start afresh at a resize and one
  worker sums the global batch in another order (docs/faults-and-errors.md#elastic-training):
  the weights are not expected to be identical and their difference is reported; every epoch
  both runs finished must train the same pairs as often in both, each corpus row once.
- `--mode backtranslate`: `python -m raymt.backtranslate` of --lines generated English lines
  with 2 actors; a random actor (`ray::BacktranslateActor`) SIGKILLed every --kill-every, the
  driver once, then the same command again. Every output row (line id, input, output, score)
  must equal the reference's.

Time lost per kill: the chaos run's wall time minus the reference's, divided by the kills;
for train, per kill also the seconds from the kill until the run logged again the step it had
reached (restart, the steps redone since the checkpoint, and the driver's start for its kill).

Each run is a fresh command with a local Ray of its own (RAY_ADDRESS=local): the processes
killed are only its own descendants. The whole soak (a reference run of ~30 minutes and a ~40-minute chaos run:
issue 46 asks for at least 10 worker kills, `worker_kills` says how many) is the default;
--smoke is a form of a few minutes, 2 worker kills and the driver's (tests/test_chaos.py):

    python benchmarks/chaos.py --out chaos.json                  # train, 5000 steps, kills every 2-3 min
    python benchmarks/chaos.py --smoke --out chaos.json
    python benchmarks/chaos.py --mode elastic --out elastic.json
    python benchmarks/chaos.py --mode backtranslate --out bt.json

Prints a table and the JSON summary; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raymt import compare  # noqa: E402
from raymt.backtranslate import ACTOR_TITLE  # noqa: E402
from raymt.data import format as corpus_format  # noqa: E402
from raymt.rundir import RunDir  # noqa: E402

WORKER_TITLE = "ray::RayTrainWorker"
STEP_LINE = re.compile(r"step (\d+)/\d+ \|")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags; --smoke sets the short form's defaults."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("train", "elastic", "backtranslate"), default="train")
    p.add_argument("--smoke", action="store_true", help="a few minutes: 150 steps, 2 kills 20-30 s apart, the driver's")
    p.add_argument(
        "--steps", type=int, help="training steps (default 5000: ~30 min on 2 cores; smoke 150; elastic 600, smoke 120)"
    )
    p.add_argument("--eval-every", type=int, help="steps between checkpoints (default 100, smoke 30, elastic smoke 20)")
    p.add_argument("--kill-every", help="K1,K2: seconds between kills, drawn uniformly (default 120,180)")
    p.add_argument("--max-kills", type=int, help="worker or actor kills at most (default unlimited, smoke 2)")
    p.add_argument("--no-driver-kill", action="store_true", help="no driver kill")
    p.add_argument("--lines", type=int, help="backtranslate: input lines (default 200000, smoke 4000)")
    p.add_argument("--checkpoint", help="backtranslate: the model (default: a 100-step run trained first)")
    p.add_argument("--work-dir", help="runs go here (default: a new temporary directory)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    p.add_argument("--out", help="write the JSON summary here")
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = {
        "steps": (150 if smoke else 5000) if args.mode != "elastic" else (120 if smoke else 600),
        "eval_every": (20 if args.mode == "elastic" else 30) if smoke else 100,
        "kill_every": "20,30" if smoke else "120,180",
        "max_kills": 2 if smoke else None,
        "lines": 4000 if smoke else 200_000,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    k1, k2 = (float(x) for x in args.kill_every.split(","))
    if not 0 < k1 <= k2:
        p.error(f"--kill-every {args.kill_every}: want K1,K2 with 0 < K1 <= K2 seconds")
    args.kill_range = (k1, k2)
    return args


class Command:
    """A `python -m raymt.<module>` process in a session of its own, its console in a log file;
    every `step N/M |` line it prints is timestamped into the shared `steps` list."""

    def __init__(self, argv: list[str], log: Path, steps: list, env: dict):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.start = time.time()
        self.end: Optional[float] = None
        self.reader = threading.Thread(target=self._read, args=(steps,), daemon=True)
        self.reader.start()

    def _read(self, steps: list) -> None:
        with self.log.open("a") as sink:
            for line in self.proc.stdout:
                sink.write(line)
                sink.flush()
                if found := STEP_LINE.search(line):
                    steps.append((time.time(), int(found.group(1))))

    def alive(self) -> bool:
        """Whether the process still runs (notes its end time once it has ended)."""
        if self.proc.poll() is None:
            return True
        self.end = self.end or time.time()
        return False

    def wait(self, timeout: float) -> int:
        """Wait for the end; its exit code."""
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        self.alive()
        return rc

    def kill(self) -> None:
        """SIGKILL the process group and every descendant (its local Ray: GCS, raylet, workers)."""
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in family:  # any that left the group
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=30)
        self.wait(timeout=60)

    def titled(self, title: str) -> list[int]:
        """Pids of this command's descendants whose title starts with `title` (`ray::Class`)."""
        found = []
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        for p in family:
            try:
                if " ".join(p.cmdline()).startswith(title):
                    found.append(p.pid)
            except psutil.Error:  # gone meanwhile
                pass
        return found

    def tail(self, chars: int = 3000) -> str:
        """The end of its console."""
        return self.log.read_text()[-chars:] if self.log.exists() else ""


def run_env(address: str = "local") -> dict:
    """The commands' environment: a Ray of their own (RAY_ADDRESS=local starts one), this checkout."""
    return dict(os.environ, RAY_ADDRESS=address, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")


def train_argv(args: argparse.Namespace, work: Path, name: str, *extra: str) -> list[str]:
    """The run: the default model, 2 workers, the built-in corpus, a checkpoint every --eval-every
    steps, every step logged, pairs traced, fp32 (no timed precision probe to differ between runs)."""
    sets = {
        "train.eval_every": args.eval_every,
        "train.log_every": 1,
        "train.trace_data": "true",
        "train.precision": "fp32",
        "train.max_failures": -1,  # every kill survived: the schedule decides how many
        "data.builtin_eval_size": 20 if args.smoke else 50,
    }
    argv = ["raymt.train", "--storage-path", str(work), "--name", name, "--num-workers", "2"]
    argv += ["--max-steps", str(args.steps)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv + list(extra)


def finished(cmd: Command, timeout: float, what: str) -> float:
    """Wait for `cmd`; its wall seconds, or a RuntimeError with its console's end."""
    rc = cmd.wait(timeout)
    if rc != 0:
        raise RuntimeError(f"{what} failed (exit {rc}): {cmd.tail()}")
    return cmd.end - cmd.start


def reference(argv: list[str], log: Path, env: dict, timeout: float) -> float:
    """The uninterrupted run's wall seconds (its console in `log`)."""
    cmd = Command(argv, log, [], env)
    return finished(cmd, timeout, f"the command of {log.name}")


class Chaos:
    """The kill schedule of one chaos run: a process titled `title` killed every K1-K2 seconds
    (the next one only once the job has got past where the last kill hit it), and the driver
    once. `progress()`: how far the job is (a step, shards written); `back(kill)`: whether it
    is past `kill` again."""

    def __init__(self, args: argparse.Namespace, title: str, progress: Callable[[], int], back: Callable):
        self.rng = random.Random(args.seed)
        self.k1, self.k2 = args.kill_range
        self.max_kills, self.title, self.progress, self.back = args.max_kills, title, progress, back
        self.kills: list[dict] = []  # {"kind", "time", "at"} each: "at" the progress when killed
        self.next_kill: Optional[float] = None  # K1-K2 s after the job got going

    def recovered(self) -> bool:
        """Whether the job is past the last kill again."""
        return not self.kills or self.back(self.kills[-1])

    def maybe_kill(self, cmd: Command, busy: bool) -> None:
        """Kill a random process titled `title` of `cmd` when one is due and the job is `busy`."""
        if self.max_kills is not None and sum(k["kind"] != "driver" for k in self.kills) >= self.max_kills:
            return
        if busy and self.next_kill is None:
            self.next_kill = time.time() + self.rng.uniform(self.k1, self.k2)
        if not busy or time.time() < self.next_kill or not self.recovered():
            return
        pids = cmd.titled(self.title)
        if not pids:  # none (re)started yet: try again shortly
            return
        pid, at = self.rng.choice(pids), self.progress()
        os.kill(pid, signal.SIGKILL)
        self.kills.append({"kind": self.title.removeprefix("ray::"), "time": time.time(), "at": at, "pid": pid})
        print(f"chaos: killed {self.title} (pid {pid}) at {at}", flush=True)
        self.next_kill = time.time() + self.rng.uniform(self.k1, self.k2)

    def kill_driver(self, cmd: Command) -> None:
        """SIGKILL the command and its local Ray."""
        at = self.progress()
        cmd.kill()
        self.kills.append({"kind": "driver", "time": time.time(), "at": at})
        print(f"chaos: killed the driver (pid {cmd.proc.pid}) at {at}", flush=True)


# ---------------------------------------------------------------- train


def train_chaos(args: argparse.Namespace, work: Path, env: dict, timeout: float) -> tuple[Chaos, list, float]:
    """The chaos run: worker kills throughout, the driver once past half way (then `--resume`).
    Returns the schedule, the (time, step) of every step line, and the wall seconds."""
    run_dir, steps = work / "chaos", []
    step_now = lambda: steps[-1][1] if steps else 0  # noqa: E731
    back = lambda kill: any(t > kill["time"] and s >= kill["at"] for t, s in reversed(steps[-500:]))  # noqa: E731
    chaos = Chaos(args, WORKER_TITLE, step_now, back)
    half = args.steps // 2
    driver_step = None if args.no_driver_kill else chaos.rng.randint(half, half + args.eval_every - 1)
    cmd = Command(train_argv(args, work, "chaos"), work / "chaos.log", steps, env)
    start = cmd.start
    while cmd.alive():
        if time.time() > start + timeout:
            cmd.kill()
            raise RuntimeError(f"the chaos run took over {timeout:.0f} s: {cmd.tail()}")
        due = driver_step is not None and step_now() >= driver_step and chaos.recovered()
        if due and RunDir(run_dir).registered_checkpoints():
            chaos.kill_driver(cmd)
            driver_step = None
            cmd = Command(["raymt.train", "--resume", str(run_dir)], work / "chaos.log", steps, env)
            continue
        chaos.maybe_kill(cmd, busy=0 < step_now() < args.steps)
        time.sleep(0.2)
    finished(cmd, 60, "the chaos run")
    return chaos, steps, cmd.end - start


def per_kill(kills: list[dict], steps: list, starts: list) -> list[dict]:
    """Each kill's cost: seconds until the worker group started again (`restart_s`, from the
    trace's #start lines), the step it resumed at, the steps redone, and seconds until the run
    logged again the step it had reached (`lost_s`)."""
    out = []
    for kill in kills:
        restart = next(((s, t) for s, t, _ in starts if t > kill["time"]), None)
        after = restart[1] if restart else kill["time"]
        back = next((t for t, s in steps if t > after and s >= kill["at"]), None)
        row = {"kind": kill["kind"], "step": kill["at"]}
        if restart:
            row.update(restart_s=round(restart[1] - kill["time"], 1), resumed_at=restart[0])
            row["redone_steps"] = kill["at"] - restart[0]
        row["lost_s"] = round(back - kill["time"], 1) if back else None
        out.append(row)
    return out


def train_equality(ref_dir: Path, run_dir: Path, steps: int) -> dict:
    """Final weights, data trace and logged losses of the two runs, side by side."""
    weights = compare.weights_diff(compare.checkpoint_at(ref_dir, steps), compare.checkpoint_at(run_dir, steps))
    ref_pairs, got_pairs = compare.trained_pairs(ref_dir), compare.trained_pairs(run_dir)
    keys = ref_pairs.keys() | got_pairs.keys()
    out = {
        "weights_max_abs_diff": weights["max_abs_diff"],
        "weights_differing": weights["differing"],
        "tensors": weights["tensors"],
        "trace_steps": len({step for _, step in keys}),
        "trace_steps_differing": len(
            {step for rank, step in keys if ref_pairs.get((rank, step)) != got_pairs.get((rank, step))}
        ),
    }
    for column in ("train_loss", "valid_loss"):
        a, b = compare.logged(ref_dir, column), compare.logged(run_dir, column)
        out[f"{column}_steps"] = len(a)
        out[f"{column}_steps_differing"] = sum(a.get(s) != b.get(s) for s in a.keys() | b.keys())
    out["equal"] = (
        weights["max_abs_diff"] == 0.0
        and not weights["differing"]
        and out["trace_steps"] == steps
        and not out["trace_steps_differing"]
        and out["train_loss_steps"] == steps
        and not out["train_loss_steps_differing"]
        and not out["valid_loss_steps_differing"]
    )
    return out


def train_mode(args: argparse.Namespace, work: Path) -> dict:
    """Reference, chaos run, and their comparison."""
    env = run_env()
    ref_s = reference(train_argv(args, work, "reference"), work / "reference.log", env, timeout=args.steps * 3 + 600)
    print(f"chaos: reference run of {args.steps} steps in {ref_s:.0f} s", flush=True)
    chaos, steps, chaos_s = train_chaos(args, work, env, timeout=ref_s * 3 + 600)
    kills = per_kill(chaos.kills, steps, compare.group_starts(work / "chaos"))
    return {
        "reference_s": round(ref_s, 1),
        "chaos_s": round(chaos_s, 1),
        "kills": kills,
        **equality_summary(chaos.kills, ref_s, chaos_s),
        **train_equality(work / "reference", work / "chaos", args.steps),
    }


def equality_summary(kills: list[dict], ref_s: float, chaos_s: float, killed: str = "worker") -> dict:
    """Kills survived (of `killed` processes and the driver) and the wall time lost per kill."""
    workers = sum(k["kind"] != "driver" for k in kills)
    return {
        f"{killed}_kills": workers,
        "driver_kills": len(kills) - workers,
        "lost_per_kill_s": round((chaos_s - ref_s) / len(kills), 1) if kills else None,
    }


# ---------------------------------------------------------------- elastic


def elastic_argv(args: argparse.Namespace, work: Path, name: str) -> list[str]:
    """The run of 2 workers that may shrink to 1 (tests/test_elastic.py's settings): 2 CPUs a
    worker, so one fits on each 2-CPU node and none on the 1-CPU head."""
    sets = ["train.min_workers=1", "train.resize_interval_s=2", "train.cpus_per_worker=2", "train.num_to_keep=3"]
    return train_argv(args, work, name, *(x for kv in sets for x in ("--set", kv)))


def three_nodes():
    """A local cluster: a 1-CPU head (driver, Train controller, Ray Data) and two 2-CPU nodes;
    fast health checks, so that a lost node is declared dead in seconds."""
    from ray.cluster_utils import Cluster

    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": system})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    return cluster, nodes


def wait_for(condition: Callable[[], bool], what: str, cmd: Command, timeout: float = 600) -> None:
    """Poll `condition` until it holds; a RuntimeError naming `what` if the run ends or time runs out first."""
    deadline = time.time() + timeout
    while not condition():
        if not cmd.alive() or time.time() > deadline:
            raise RuntimeError(f"no {what}: {cmd.tail()}")
        time.sleep(0.5)


def elastic_run(args: argparse.Namespace, work: Path, name: str, resize: bool) -> float:
    """One run on a fresh three-node cluster; with `resize`, a node removed after two checkpoints
    and a node added back after a checkpoint of the one worker left. Its wall seconds."""
    cluster, nodes = three_nodes()
    try:  # a group of 2 that cannot start (the lost node's CPUs still counted) gives up in 15 s
        env = dict(run_env(cluster.address), RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="15")
        cmd = Command(elastic_argv(args, work, name), work / f"{name}.log", [], env)
        if resize:
            text = lambda: cmd.log.read_text() if cmd.log.exists() else ""  # noqa: E731
            wait_for(lambda: RunDir(work / name).registered_checkpoints() >= 2, "two checkpoints", cmd)
            cluster.remove_node(nodes[1], allow_graceful=False)  # the node is lost
            print("chaos: removed a node", flush=True)
            wait_for(lambda: "resized from 2 to 1" in text(), "shrink to 1 worker", cmd)
            after = lambda: text().split("resized from 2 to 1", 1)[1]  # noqa: E731
            wait_for(lambda: "valid loss" in after(), "checkpoint of 1 worker", cmd)
            cluster.add_node(num_cpus=2)  # a node returns
            print("chaos: added a node", flush=True)
        return finished(cmd, args.steps * 6 + 900, f"the {name} run")
    finally:
        cluster.shutdown()


def elastic_equality(ref_dir: Path, run_dir: Path, steps: int) -> dict:
    """Every epoch both runs finished: the same pairs, as often, and each corpus row once; the
    weights' and losses' differences, reported (a resize is not bit-identical)."""
    weights = compare.weights_diff(compare.checkpoint_at(ref_dir, steps), compare.checkpoint_at(run_dir, steps))
    ref, got = (compare.pairs_per_epoch(compare.trained_pairs(d)) for d in (ref_dir, run_dir))
    finished_epochs = min(max(e for e, _ in ref), max(e for e, _ in got))  # the last one of each is partial
    differing = [
        e
        for e in range(finished_epochs)
        if {k: n for k, n in ref.items() if k[0] == e} != {k: n for k, n in got.items() if k[0] == e}
    ]
    # The built-in corpus repeats some pairs (numbers, dates): each row once is the epoch's count
    # of pairs trained equal to the corpus's rows (none is over data.max_len here).
    corpus = str(run_dir / "corpus")
    rows = sum(shard.num_pairs for shard in corpus_format.open_corpus(corpus).shards())
    once = all(
        sum(n for (e, _), n in c.items() if e == epoch) == rows for c in (ref, got) for epoch in range(finished_epochs)
    )
    a, b = compare.logged(ref_dir, "train_loss"), compare.logged(run_dir, "train_loss")
    starts = compare.group_starts(run_dir)
    sizes = [n for i, (_, _, n) in enumerate(starts) if i == 0 or n != starts[i - 1][2]]
    return {
        "resizes": [f"{x[2]} -> {y[2]} at step {y[0]}" for x, y in zip(starts, starts[1:]) if x[2] != y[2]],
        "resized_2_1_2": sizes == [2, 1, 2],
        "finished_epochs": finished_epochs,
        "epochs_differing": differing,
        "each_row_once": once,
        "weights_max_abs_diff": weights["max_abs_diff"],
        "train_loss_max_abs_diff": max((abs(a[s] - b[s]) for s in a.keys() & b.keys()), default=None),
        "equal": sizes == [2, 1, 2] and finished_epochs > 0 and not differing and once,
    }


def elastic_mode(args: argparse.Namespace, work: Path) -> dict:
    """The run without and with a 2 -> 1 -> 2 resize, compared."""
    ref_s = elastic_run(args, work, "reference", resize=False)
    print(f"chaos: reference run of {args.steps} steps in {ref_s:.0f} s", flush=True)
    chaos_s = elastic_run(args, work, "chaos", resize=True)
    out = elastic_equality(work / "reference", work / "chaos", args.steps)
    lost = (chaos_s - ref_s) / len(out["resizes"]) if out["resizes"] else None
    return {
        "reference_s": round(ref_s, 1),
        "chaos_s": round(chaos_s, 1),
        "lost_per_resize_s": lost and round(lost, 1),
        **out,
    }


# ---------------------------------------------------------------- backtranslate


def bt_model(args: argparse.Namespace, work: Path, env: dict) -> str:
    """--checkpoint, else the last checkpoint of a short run of the default model trained here."""
    if args.checkpoint:
        return args.checkpoint
    short = argparse.Namespace(**{**vars(args), "steps": 100, "eval_every": 100})
    reference(train_argv(short, work, "bt-model"), work / "bt-model.log", env, timeout=1200)
    return RunDir(work / "bt-model").latest_checkpoint()


def bt_input(args: argparse.Namespace, work: Path) -> Path:
    """--lines generated English sentences (the built-in corpus's generator), gzipped."""
    from raymt.data.builtin import generate

    path = work / "mono.en.gz"
    path.write_bytes(
        gzip.compress("".join(line + "\n" for line in generate(args.lines, "en", "de", seed=7)[0]).encode())
    )
    return path


def bt_argv(args: argparse.Namespace, checkpoint: str, mono: Path, out: Path) -> list[str]:
    """The job: 2 actors of raymt's engine, --lines / 40 lines a shard."""
    argv = ["raymt.backtranslate", "--checkpoint", checkpoint, "--input", str(mono), "--output", str(out)]
    argv += ["--engine", "raymt", "--num-actors", "2", "--shard-lines", str(max(args.lines // 40, 1))]
    return argv + ["--progress-s", "1"] + (["--beam", "1"] if args.smoke else [])


def bt_chaos(
    args: argparse.Namespace, argv: list[str], out: Path, env: dict, timeout: float
) -> tuple[Chaos, float, int]:
    """Actor kills while shards are left, the driver once a third of them are written, then the
    same command again (and again if a rerun fails). Returns the schedule, wall seconds, reruns."""
    shards = lambda: len(list(out.glob("part-*.parquet")))  # noqa: E731
    chaos = Chaos(args, ACTOR_TITLE, shards, lambda kill: shards() > kill["at"])
    total = -(-args.lines // max(args.lines // 40, 1))
    driver_at = None if args.no_driver_kill else total // 3
    log, start, reruns = out.parent / "chaos.log", time.time(), 0
    cmd = Command(argv, log, [], env)
    while True:
        while cmd.alive():
            if time.time() > start + timeout:
                cmd.kill()
                raise RuntimeError(f"the chaos job took over {timeout:.0f} s: {cmd.tail()}")
            if driver_at is not None and shards() > driver_at and chaos.recovered():
                chaos.kill_driver(cmd)
                driver_at = None
                cmd = Command(argv, log, [], env)
                continue
            chaos.maybe_kill(cmd, busy=shards() < total)
            time.sleep(0.2)
        if cmd.wait(60) == 0 or reruns >= 2:
            break
        reruns += 1  # the job failed instead of retrying: the same command finishes it
        cmd = Command(argv, log, [], env)
    finished(cmd, 60, "the chaos job")
    return chaos, cmd.end - start, reruns


def bt_equality(ref: Path, got: Path) -> dict:
    """Every output row of both jobs, and their counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    read = lambda out: pa.concat_tables(pq.read_table(f) for f in sorted(out.glob("part-*.parquet")))  # noqa: E731
    a, b = read(ref), read(got)
    columns = ("line_id", "input", "output", "score")
    differing = sum(x != y for c in columns for x, y in zip(a.column(c).to_pylist(), b.column(c).to_pylist()))
    counts = [json.loads((d / "bt.json").read_text())["counts"] for d in (ref, got)]
    out = {"rows": a.num_rows, "rows_chaos": b.num_rows, "values_differing": differing, "counts": counts[1]}
    out["equal"] = a.num_rows == b.num_rows and not differing and counts[0] == counts[1]
    return out


def bt_mode(args: argparse.Namespace, work: Path) -> dict:
    """A model, the reference job, the chaos job, and their rows compared."""
    env = run_env()
    checkpoint, mono = bt_model(args, work, env), bt_input(args, work)
    ref_s = reference(bt_argv(args, checkpoint, mono, work / "bt-reference"), work / "reference.log", env, timeout=3600)
    print(f"chaos: reference job of {args.lines} lines in {ref_s:.0f} s", flush=True)
    argv = bt_argv(args, checkpoint, mono, work / "bt-chaos")
    chaos, chaos_s, reruns = bt_chaos(args, argv, work / "bt-chaos", env, timeout=ref_s * 3 + 600)
    return {
        "reference_s": round(ref_s, 1),
        "chaos_s": round(chaos_s, 1),
        "kills": [{"kind": k["kind"], "shards_written": k["at"]} for k in chaos.kills],
        "failed_reruns": reruns,
        **equality_summary(chaos.kills, ref_s, chaos_s, killed="actor"),
        **bt_equality(work / "bt-reference", work / "bt-chaos"),
    }


# ---------------------------------------------------------------- report

MODES = {"train": train_mode, "elastic": elastic_mode, "backtranslate": bt_mode}


def table(summary: dict) -> str:
    """The summary as a readable table: the figures, then one row per kill."""
    keys = [k for k, v in summary.items() if not isinstance(v, (list, dict))]
    width = max(map(len, keys))
    lines = [f"{k:<{width}}  {summary[k]}" for k in keys]
    kills = summary.get("kills") or []
    if kills:
        columns = list(dict.fromkeys(c for row in kills for c in row))
        lines += ["", " | ".join(columns), " | ".join("---" for _ in columns)]
        lines += [" | ".join(str(row.get(c, "")) for c in columns) for row in kills]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the chosen mode; print the table and the JSON; 0 when the chaos run equals the reference."""
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="raymt-chaos-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"chaos: {args.mode} soak in {work}", flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "kill_range")}
    summary = {"mode": args.mode, "work_dir": str(work), **MODES[args.mode](args, work), "config": config}
    print("\n" + table(summary) + "\n")
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if summary["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
