"""GPU check: raymt on one GPU in at most 8 minutes, correctness first, then a speed table.

    python benchmarks/gpu_check.py [--multi30k DIR] [--corpus PREPARED] [--out DIR]
    python benchmarks/gpu_check.py --cpu --tiny      # the CPU form, in the default test suite

Parts, each with its own timeout and log under --out (gpu_check.json holds every figure):

| part | what |
|---|---|
| run | a fresh `python -m raymt.train --gpu --preset base --corpus C --max-minutes 2`: steps, tok/s, test BLEU |
| resume | a short run with `train.max_failures=1`; one Ray Train worker is SIGKILLed after the first registered checkpoint; the group restarts from it on the GPU and trains past it (exit 0) |
| evaluate | `python -m raymt.evaluate --gpu` on the run's best checkpoint and the raw test set |
| table | one process: the same batches through a Ray run and a plain loop (tok/s); raymt vs HF Marian (its `--format marian` twin) at 12k and 32k tokens (step time); eager vs `torch.compile(model)` at 12k; MFU against a bf16 matmul measured in that process (FLOPs: `benchmarks/speed.py:train_flops`) |

The script exits non-zero when run, resume or evaluate failed; a table part that fails
or runs out of time prints as such. `--cpu --tiny` takes the same code path with the
tiny preset, a generated corpus, tens of steps, gloo, 256/1024-token batches, torch.compile
with the "eager" backend (graph capture without code generation) and no HF part without
transformers.

On a lent GPU (the device tool; ../shared/gpu/README.md: no Ray and no package index there,
../shared does not travel), from the project root here:

    ../shared/gpu/bundle.sh                                    # -> .gpu/site.tar.xz
    python -m raymt.data prepare --train ../shared/data/multi30k/train \\
        --valid ../shared/data/multi30k/val --test ../shared/data/multi30k/test_2016_flickr \\
        --vocab-size 8000 --out .gpu/multi30k-prepared
    mkdir -p .gpu/multi30k && cp ../shared/data/multi30k/test_2016_flickr.*.gz .gpu/multi30k/

then one `run` with carry [".gpu"] and timeout_s 600:

    mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD \\
    PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0; python3 benchmarks/gpu_check.py \\
    --corpus .gpu/multi30k-prepared --multi30k .gpu/multi30k --out $OUT/gpu_check --work /tmp/gpu_check

(without --corpus it prepares --multi30k DIR itself, ~31 s on that machine, which then also
needs train.*.gz and val.*.gz there). The table, the logs and gpu_check.json come back
under $OUT; checkpoints stay in --work.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
CORRECTNESS = ("run", "resume", "evaluate")
TABLE_ROWS = ("ray vs plain", "raymt vs hf marian 12k", "raymt vs hf marian 32k", "eager vs compiled",
              "mfu", "matmul")
RESULTS = "gpu_check.json"


@dataclass(frozen=True)
class Sizes:
    """Everything the GPU and the tiny CPU form differ in."""

    preset: str
    run_args: tuple[str, ...]  # how the fresh run is bounded
    resume_steps: int  # the resume run's max_steps; a checkpoint every resume_every steps
    resume_every: int
    ray_steps: int  # the Ray-vs-plain run: steps, the first log interval being warm-up
    log_every: int
    ray_tokens: int  # data.max_tokens of the Ray-vs-plain batches
    peer_tokens: tuple[int, int]  # the "12k" and "32k" batches
    warmup: int  # untimed batches before each timed loop
    timed: int
    matmul_n: int
    compile_backend: str
    timeouts: dict  # seconds per part; "total" bounds them all together


FULL = Sizes(preset="base", run_args=("--max-minutes", "2", "--max-steps", "1000000"),
             resume_steps=150, resume_every=50, ray_steps=200, log_every=25, ray_tokens=12288,
             peer_tokens=(12288, 32768), warmup=8, timed=30, matmul_n=8192, compile_backend="inductor",
             timeouts={"prepare": 120, "run": 240, "resume": 150, "evaluate": 90, "table": 240,
                       "table part": 120, "total": 480})
TINY = Sizes(preset="tiny", run_args=("--max-steps", "40", "--set", "train.eval_every=20"),
             resume_steps=30, resume_every=10, ray_steps=24, log_every=6, ray_tokens=256,
             peer_tokens=(256, 1024), warmup=3, timed=6, matmul_n=256, compile_backend="eager",
             timeouts={"prepare": 120, "run": 180, "resume": 180, "evaluate": 120, "table": 240,
                       "table part": 120, "total": 600})


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--multi30k", default=str(MULTI30K),
                   help="raw Multi30k (train/val/test_2016_flickr .en/.de .gz); evaluate reads its test set")
    p.add_argument("--corpus", help="a corpus already made by `python -m raymt.data prepare` (skips preparing)")
    p.add_argument("--out", default="gpu_check", help="logs and gpu_check.json go here")
    p.add_argument("--work", help="runs (checkpoints), evaluation output and a prepared corpus (default: --out)")
    p.add_argument("--cpu", action="store_true", help="train and measure on the CPU (gloo), not the GPU")
    p.add_argument("--tiny", action="store_true", help="tiny preset, generated corpus, tens of steps")
    p.add_argument("--timeout-scale", type=float, default=1.0,
                   help="multiply every part's timeout (a slow or busy machine)")
    p.add_argument("--table-child", action="store_true", help=argparse.SUPPRESS)  # the table's own process
    return p.parse_args(argv)


# ---------------------------------------------------------------- processes


class Budget:
    """Per-part timeouts under one deadline for the whole check."""

    def __init__(self, timeouts: dict):
        self.timeouts = timeouts
        self.deadline = time.monotonic() + timeouts["total"]

    def __getitem__(self, part: str) -> float:
        """Seconds `part` may take: its own timeout, or what is left of the total."""
        return max(10.0, min(self.timeouts[part], self.deadline - time.monotonic()))


def run_logged(cmd: list[str], log: Path, timeout: float,
               watch: Optional[Callable[[subprocess.Popen, float], None]] = None) -> tuple[Optional[int], str]:
    """Run `cmd` with its output in `log`, its process group killed after `timeout` s; (rc or None, output).

    `watch(proc, deadline)` runs while it does (e.g. to kill one of its workers)."""
    deadline = time.monotonic() + timeout
    with log.open("w") as sink:
        sink.write("$ " + " ".join(cmd) + "\n")
        sink.flush()
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            if watch is not None:
                watch(proc, deadline)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
            proc.wait()
            return None, log.read_text()
    return proc.returncode, log.read_text()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the local Ray a driver starts, and its workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    """A process's command line ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ray_processes(driver: int) -> list[int]:
    """The processes of a driver's Ray: the local instance it started, or when it attached to a
    running one (RAY_ADDRESS host:port, as in the test suite) that cluster's raylet on this machine."""
    address = os.environ.get("RAY_ADDRESS")
    commands = {int(p.parent.name): cmdline(int(p.parent.name)) for p in Path("/proc").glob("[0-9]*/cmdline")}
    raylets = [pid for pid, cmd in commands.items() if address and cmd.split(" ", 1)[0].endswith("/raylet")
               and f"--gcs-address={address} " in cmd]
    return [p for root in (driver, *raylets) for p in descendants(root)]


def num_checkpoints(run_dir: Path) -> int:
    """Checkpoints Ray Train has registered for the run (0 while its snapshot is missing or half-written)."""
    try:
        return len(json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())["checkpoint_results"])
    except (OSError, ValueError, KeyError):
        return 0


# ---------------------------------------------------------------- data


def write_tiny_text(directory: Path) -> Path:
    """Generated en-de pairs in Multi30k's layout (train, val, test_2016_flickr; .gz)."""
    from raymt.data.builtin import generate

    directory.mkdir(parents=True, exist_ok=True)
    for name, size, seed in (("train", 2000, 1), ("val", 60, 2), ("test_2016_flickr", 60, 3)):
        for lang, lines in zip(("en", "de"), generate(size, "en", "de", seed=seed)):
            with gzip.open(directory / f"{name}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
    return directory


def prepare(raw: Path, out: Path, log: Path, vocab_size: int, budget: Budget) -> tuple[Optional[Path], str]:
    """`python -m raymt.data prepare` of `raw` into `out`: (corpus or None, why not)."""
    if not (raw / "train.en.gz").exists():
        return None, f"no {raw}/train.en.gz: pass --multi30k DIR or --corpus PREPARED"
    cmd = [sys.executable, "-m", "raymt.data", "prepare", "--train", str(raw / "train"),
           "--valid", str(raw / "val"), "--test", str(raw / "test_2016_flickr"),
           "--vocab-size", str(vocab_size), "--out", str(out), "--overwrite"]
    rc, text = run_logged(cmd, log, budget["prepare"])
    return (out, "") if rc == 0 else (None, f"prepare failed (rc {rc}): {tail(text)}")


def tail(text: str) -> str:
    """The last non-empty line of a log, for the table."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


# ---------------------------------------------------------------- correctness parts


def train_cmd(args: argparse.Namespace, sizes: Sizes, corpus: Path, name: str, *extra: str) -> list[str]:
    """`python -m raymt.train` on one worker of the device, as a new run `name` (an old one is removed)."""
    shutil.rmtree(Path(args.work) / "runs" / name, ignore_errors=True)
    device = [] if args.cpu else ["--gpu"]
    return [sys.executable, "-m", "raymt.train", *device, "--num-workers", "1", "--preset", sizes.preset,
            "--corpus", str(corpus), "--storage-path", str(Path(args.work) / "runs"), "--name", name,
            *extra]


def logged_steps(text: str) -> list[int]:
    """Steps of the progress and validation lines ("step N/M | ...", "step N | valid ...") in order."""
    return [int(s) for s in re.findall(r"step (\d+)(?:/| \|)", text)]


def check_run(args: argparse.Namespace, sizes: Sizes, corpus: Path, budget: Budget) -> dict:
    """The fresh run: exit status, steps, precision, interval tok/s, test BLEU."""
    out = Path(args.out)
    rc, text = run_logged(train_cmd(args, sizes, corpus, "run", *sizes.run_args), out / "run.log",
                          budget["run"])
    summary_file = Path(args.work) / "runs" / "run" / "summary.json"
    if rc != 0 or not summary_file.exists():
        return {"ok": False, "why": "timed out" if rc is None else f"rc {rc}: {tail(text)}"}
    summary = json.loads(summary_file.read_text())
    with open(summary["metrics_csv"]) as f:
        rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f) if r.get("tokens_per_s")]
    precision = re.search(r"forward pass in (.+)", text)
    test = summary.get("test", {})
    return {"ok": "bleu" in test, "steps": max(logged_steps(text), default=0), "wall_min": summary["wall_time_s"] / 60,
            "precision": precision.group(1) if precision else "?", "test_bleu": test.get("bleu"),
            "median_tokens_per_s": statistics.median(rates[1:] or rates) if rates else 0.0,
            "best_checkpoint": summary["best_checkpoint"], "why": "" if "bleu" in test else "no test score"}


def kill_a_worker_after_checkpoint(run_dir: Path, killed: dict) -> Callable:
    """A `watch` for run_logged: once a checkpoint is registered, SIGKILL one Ray Train worker of the run."""
    def watch(proc: subprocess.Popen, deadline: float) -> None:
        while num_checkpoints(run_dir) < 1:
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.2)
        workers = [p for p in ray_processes(proc.pid) if "RayTrainWorker" in cmdline(p)]
        if workers:
            os.kill(workers[0], signal.SIGKILL)
            killed.update(pid=workers[0], after_checkpoints=num_checkpoints(run_dir))
    return watch


def check_resume(args: argparse.Namespace, sizes: Sizes, corpus: Path, budget: Budget) -> dict:
    """A worker SIGKILLed after the first checkpoint: the group restarts from it and trains on past it."""
    out, killed = Path(args.out), {}
    extra = ["--max-steps", str(sizes.resume_steps), "--set", f"train.eval_every={sizes.resume_every}",
             "--set", f"train.log_every={max(1, sizes.resume_every // 2)}", "--set", "train.max_failures=1"]
    watch = kill_a_worker_after_checkpoint(Path(args.work) / "runs" / "resume", killed)
    rc, text = run_logged(train_cmd(args, sizes, corpus, "resume", *extra), out / "resume.log",
                          budget["resume"], watch)
    resumed = re.search(r"resuming at step (\d+)", text)
    after = logged_steps(text[resumed.end():]) if resumed else []
    result = {"killed": killed, "rc": rc, "resumed_at": int(resumed.group(1)) if resumed else None,
              "last_step": max(after, default=None)}
    checks = {"a worker was killed": bool(killed), "exit 0": rc == 0,
              "restarted from a checkpoint": bool(resumed and int(resumed.group(1)) > 0),
              "trained past it": bool(after and resumed and max(after) > int(resumed.group(1)))}
    failed = [name for name, ok in checks.items() if not ok]
    why = f"not: {', '.join(failed)}" + ("" if rc == 0 else f" ({'timed out' if rc is None else tail(text)})")
    return {**result, "ok": not failed, "why": why if failed else ""}


def check_evaluate(args: argparse.Namespace, checkpoint: Optional[str], budget: Budget) -> dict:
    """`python -m raymt.evaluate` on the run's best checkpoint, one actor on the device."""
    if checkpoint is None:
        return {"ok": False, "why": "no checkpoint (the run failed)"}
    out = Path(args.out)
    device = ["--cpus-per-actor", "1"] if args.cpu else ["--gpu"]
    cmd = [sys.executable, "-m", "raymt.evaluate", "--checkpoint", checkpoint, "--test",
           str(Path(args.multi30k) / "test_2016_flickr"), "--num-actors", "1", *device,
           "--output-dir", str(Path(args.work) / "evaluate")]
    rc, text = run_logged(cmd, out / "evaluate.log", budget["evaluate"])
    report = Path(args.work) / "evaluate" / "report.json"
    if rc != 0 or not report.exists():
        return {"ok": False, "why": "timed out" if rc is None else f"rc {rc}: {tail(text)}"}
    sets = json.loads(report.read_text())["test_sets"]
    (name, scores), = sets.items()
    return {"ok": True, "test_set": name, "bleu": scores["bleu"], "sentences": scores["num_sentences"]}


# ---------------------------------------------------------------- the table (one process)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread after `seconds`."""
    def expire(*_):
        raise TimeoutError(f"timed out after {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Table:
    """The table's measurements, each under its own time limit, saved as they come in."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, corpus: Path):
        import torch

        from raymt.tokenizer import Tokenizer

        self.args, self.sizes, self.corpus = args, sizes, corpus
        self.device = "cpu" if args.cpu else "cuda"
        self.vocab = Tokenizer.load(corpus / "spm.model").vocab_size
        self.path = Path(args.out) / "table.json"
        self.rows: dict[str, dict] = {}
        torch.manual_seed(0)

    def measure(self, name: str, fn: Callable[[], dict]) -> None:
        """Record fn()'s figures under `name`, or its error."""
        t0, limit = time.perf_counter(), self.sizes.timeouts["table part"]
        try:
            with time_limit(limit):
                row = fn()
        except Exception as err:  # one part failing leaves the others measured
            row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]}
            if time.perf_counter() - t0 >= limit:  # the alarm may surface inside C code as another error
                row["error"] = f"timed out after {limit:.0f} s ({row['error']})"[:200]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        self.rows[name] = row
        self.path.write_text(json.dumps(self.rows, indent=2))

    def batches(self, max_tokens: int, count: int) -> list:
        """The first `count` training batches a lone worker gets at `max_tokens`, on the device."""
        from raymt.config import DataConfig
        from raymt.data import format as corpus_format
        from raymt.data.stream import Position, TrainStream

        files = corpus_format.train_files(str(self.corpus), corpus_format.read_manifest(str(self.corpus)))
        stream = TrainStream(files, DataConfig(max_tokens=max_tokens), seed=1, rank=0, world_size=1,
                             position=Position(0))
        out = []
        for batch in stream:
            out.append(batch.to(self.device))
            if len(out) == count:
                break
        stream.close()
        return out

    def model_config(self, post_norm: bool = False):
        """The preset (post-norm where HF Marian must hold the same weights)."""
        from raymt.config import preset

        cfg = preset(self.sizes.preset)
        cfg.pre_norm = cfg.pre_norm and not post_norm
        return cfg

    def loop(self, model_cfg, compiled: bool = False, marian: bool = False):
        """A plain loop (benchmarks/speed.py's PlainLoop) on a fresh seeded model, its compiled form
        or its HF Marian twin (`raymt.export.to_marian`: same weights, loss, AdamW and autocast)."""
        import torch

        from benchmarks import speed
        from raymt.config import Config
        from raymt.model import build_model

        torch.manual_seed(0)
        model = build_model(model_cfg, self.vocab)
        if marian:
            from benchmarks import peers
            from raymt.export import to_marian

            model = to_marian(model.train())
        loop = speed.PlainLoop(model, Config(model=model_cfg), self.device)
        if compiled:
            loop.model = torch.compile(loop.model, backend=self.sizes.compile_backend)
        if marian:
            loop.step_fn = lambda batch: peers.marian_train_step(
                loop.model, loop.optimizer, batch, loop.cfg.optim.label_smoothing, loop.cfg.optim.clip_norm,
                loop.autocast)
        return loop

    def timed(self, loop, batches: list, model_cfg, warmup: Optional[int] = None) -> dict:
        """Warm up on the first `warmup` batches, then tokens/s, ms/step and FLOP/s over the rest."""
        from benchmarks import speed

        count = self.sizes.warmup if warmup is None else warmup
        warmup, timed = batches[:count], batches[count:]
        t0 = time.perf_counter()
        if warmup:
            loop.tokens_per_s(warmup)
        warm_s = time.perf_counter() - t0
        rate = loop.tokens_per_s(timed)
        tokens = sum(b.num_tokens for b in timed)
        flops = sum(speed.train_flops(model_cfg, self.vocab, b) for b in timed)
        return {"tokens_per_s": rate, "ms_per_step": 1000 * tokens / rate / len(timed),
                "flops_per_s": rate * flops / tokens, "warmup_s": warm_s, "steps": len(timed)}

    def ray_vs_plain(self) -> dict:
        """A Ray run (raymt.train.run in this process) and the plain loop on the batches it trains on."""
        from raymt.config import Config, apply_overrides
        from raymt.train import run

        s = self.sizes
        cfg = apply_overrides(Config(model=self.model_config()), {
            "data.corpus": str(self.corpus), "data.max_tokens": s.ray_tokens, "train.max_steps": s.ray_steps,
            "train.eval_every": s.ray_steps, "train.log_every": s.log_every, "train.num_workers": 1,
            "train.use_gpu": not self.args.cpu, "train.storage_path": str(Path(self.args.work) / "runs"),
            "train.name": "ray-vs-plain", "train.num_to_keep": 1, "train.valid_beam": 1})
        shutil.rmtree(Path(cfg.train.storage_path) / cfg.train.name, ignore_errors=True)  # never resume an old one
        summary = run(cfg, score_test=False)  # Ray stays up: the plain loop's batches stream through Ray Data
        with open(summary["metrics_csv"]) as f:
            rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
        steps = [int(b["step"]) - int(a["step"]) for a, b in zip(rows, rows[1:])]
        speeds = [float(r["tokens_per_s"]) for r in rows[1:]]  # the first interval holds start-up
        ray_rate = sum(steps) / sum(n / v for n, v in zip(steps, speeds))  # time-weighted
        # The plain loop warms up on the Ray run's first interval and times the rest, as the run's rate does.
        batches = self.batches(s.ray_tokens, s.ray_steps)
        plain = self.timed(self.loop(cfg.model), batches, cfg.model, warmup=s.log_every)
        return {"ray_tokens_per_s": ray_rate, "plain_tokens_per_s": plain["tokens_per_s"],
                "ratio": ray_rate / plain["tokens_per_s"], "batch_tokens": s.ray_tokens, "steps": plain["steps"],
                "plain_flops_per_s": plain["flops_per_s"]}

    def peers(self, max_tokens: int) -> dict:
        """raymt vs its HF Marian twin (same weights, batches, loss, AdamW, autocast), alternated."""
        cfg = self.model_config(post_norm=True)
        batches = self.batches(max_tokens, self.sizes.warmup + self.sizes.timed)
        runs = {"raymt": [], "hf_marian": []}
        for name in ("raymt", "hf_marian", "hf_marian", "raymt"):
            runs[name].append(self.timed(self.loop(cfg, marian=name == "hf_marian"), batches, cfg))
        ms = {name: statistics.median(r["ms_per_step"] for r in rs) for name, rs in runs.items()}
        return {"raymt_ms": ms["raymt"], "hf_marian_ms": ms["hf_marian"], "hf_over_raymt": ms["hf_marian"] / ms["raymt"],
                "raymt_flops_per_s": statistics.median(r["flops_per_s"] for r in runs["raymt"]),
                "batch_tokens": max_tokens}

    def compiled(self) -> dict:
        """The eager model vs torch.compile(model) on the same batches ("12k"), each timed on its
        second pass over them: the first one holds the compilations (a new shape recompiles once,
        then dims are dynamic)."""
        cfg = self.model_config()
        batches = self.batches(self.sizes.peer_tokens[0], self.sizes.warmup + self.sizes.timed)
        runs = {}
        for name in ("eager", "compiled"):
            loop = self.loop(cfg, compiled=name == "compiled")
            t0 = time.perf_counter()
            loop.tokens_per_s(batches)
            runs[name] = {**self.timed(loop, batches, cfg, warmup=0), "first_pass_s": time.perf_counter() - t0}
        eager, comp = runs["eager"], runs["compiled"]
        return {"eager_ms": eager["ms_per_step"], "compiled_ms": comp["ms_per_step"],
                "speedup": eager["ms_per_step"] / comp["ms_per_step"], "compile_warmup_s": comp["first_pass_s"],
                "backend": self.sizes.compile_backend, "eager_flops_per_s": eager["flops_per_s"],
                "compiled_flops_per_s": comp["flops_per_s"], "batch_tokens": self.sizes.peer_tokens[0]}

    def matmul(self) -> dict:
        """The device's measured matmul rate in this process (bf16 where raymt trains in bf16)."""
        import torch

        from benchmarks import speed

        dtype = torch.bfloat16 if speed.trains_in_bf16(self.device) else torch.float32
        rate = speed.matmul_flops(self.device, dtype, self.sizes.matmul_n)
        return {"flops_per_s": rate, "tflops": rate / 1e12, "dtype": str(dtype).removeprefix("torch."),
                "n": self.sizes.matmul_n}


def table_child(args: argparse.Namespace, sizes: Sizes) -> int:
    """Measure every table part in this process; rows go to OUT/table.json as they come in."""
    import importlib.util

    table = Table(args, sizes, Path(args.corpus))
    table.path.unlink(missing_ok=True)
    table.measure("ray vs plain", table.ray_vs_plain)
    if importlib.util.find_spec("transformers") is not None:
        for label, tokens in zip(("12k", "32k"), sizes.peer_tokens):
            table.measure(f"raymt vs hf marian {label}", lambda tokens=tokens: table.peers(tokens))
    table.measure("eager vs compiled", table.compiled)
    table.measure("matmul", table.matmul)
    return 0


# ---------------------------------------------------------------- report


def mfu_row(rows: dict) -> dict:
    """Training FLOP/s of each eager/compiled measurement over the matmul rate."""
    peak = rows.get("matmul", {}).get("flops_per_s")
    if not peak:
        return {"error": "no matmul rate"}
    out = {}
    if "plain_flops_per_s" in rows.get("ray vs plain", {}):
        out["plain loop"] = rows["ray vs plain"]["plain_flops_per_s"] / peak
    for label in ("12k", "32k"):
        if "raymt_flops_per_s" in rows.get(f"raymt vs hf marian {label}", {}):
            out[f"eager {label}"] = rows[f"raymt vs hf marian {label}"]["raymt_flops_per_s"] / peak
    if "compiled_flops_per_s" in rows.get("eager vs compiled", {}):
        out["compiled 12k"] = rows["eager vs compiled"]["compiled_flops_per_s"] / peak
    return out or {"error": "no training rate"}


# How each part's figures read in the table (str.format over the part's dict).
CELLS = {
    "run": "{steps} steps in {wall_min:.1f} min ({precision}), {median_tokens_per_s:,.0f} tgt tok/s, "
           "test BLEU {test_bleu:.2f}",
    "resume": "worker {killed[pid]} killed after checkpoint {killed[after_checkpoints]}; restarted at step "
              "{resumed_at}, trained to step {last_step}",
    "evaluate": "{test_set}: BLEU {bleu:.2f} ({sentences} sentences)",
    "ray vs plain": "Ray {ray_tokens_per_s:,.0f} / plain {plain_tokens_per_s:,.0f} tok/s = {ratio:.3f} "
                    "({batch_tokens}-token batches)",
    "raymt vs hf marian": "raymt {raymt_ms:.1f} ms/step, HF {hf_marian_ms:.1f}: HF/raymt {hf_over_raymt:.2f}x "
                          "({batch_tokens} tokens)",
    "eager vs compiled": "eager {eager_ms:.1f} ms/step, compiled {compiled_ms:.1f}: {speedup:.2f}x ({backend}, "
                         "first pass {compile_warmup_s:.0f} s)",
    "matmul": "{tflops:.2f} TFLOP/s ({dtype}, n={n})",
}


def describe(name: str, r: dict) -> str:
    """One table cell's text."""
    if "error" in r or not r.get("ok", True):
        return r.get("error") or r.get("why", "failed")
    if name == "mfu":
        return ", ".join(f"{k} {v:.1%}" for k, v in r.items())
    template = CELLS.get(name.rsplit(" ", 1)[0] if name.startswith("raymt vs hf marian") else name)
    return template.format(**r) if template else json.dumps(r)


def print_table(results: dict) -> None:
    """The final table: one line per part."""
    print(f"\n{'part':<24} {'status':<9} result")
    for name, r in results.items():
        status = ("ok" if r.get("ok") else "FAILED") if name in CORRECTNESS else (
            "error" if "error" in r else "measured")
        print(f"{name:<24} {status:<9} {describe(name, r)}")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: the correctness parts, then the table in its own process; 1 if a correctness part failed."""
    args = parse_args(argv)
    sizes = TINY if args.tiny else FULL
    sizes = replace(sizes, timeouts={k: v * args.timeout_scale for k, v in sizes.timeouts.items()})
    if args.table_child:
        return table_child(args, sizes)
    budget = Budget(sizes.timeouts)
    out = Path(args.out).resolve()
    work = Path(args.work or out).resolve()
    for directory in (out, work):
        directory.mkdir(parents=True, exist_ok=True)
    args.out, args.work = str(out), str(work)
    if args.tiny and not args.corpus and args.multi30k == str(MULTI30K):
        args.multi30k = str(write_tiny_text(work / "text"))
    corpus, why = (Path(args.corpus).resolve(), "") if args.corpus else prepare(
        Path(args.multi30k), work / "corpus", out / "prepare.log", 256 if args.tiny else 8000, budget)
    results: dict[str, dict] = {}
    if corpus is None:
        results = {name: {"ok": False, "why": why} for name in CORRECTNESS}
    else:
        for name, check in (("run", lambda: check_run(args, sizes, corpus, budget)),
                            ("resume", lambda: check_resume(args, sizes, corpus, budget))):
            print(f"gpu_check: {name} ...", flush=True)
            results[name] = check()
        print("gpu_check: evaluate ...", flush=True)
        results["evaluate"] = check_evaluate(args, results["run"].get("best_checkpoint"), budget)
        print("gpu_check: table ...", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--table-child", "--corpus", str(corpus),
               "--out", str(out), "--work", str(work), "--timeout-scale", str(args.timeout_scale),
               *(["--cpu"] if args.cpu else []), *(["--tiny"] if args.tiny else [])]
        rc, text = run_logged(cmd, out / "table.log", budget["table"])
        rows = json.loads((out / "table.json").read_text()) if (out / "table.json").exists() else {}
        if rc != 0:
            rows.setdefault("table", {"error": "timed out" if rc is None else f"rc {rc}: {tail(text)}"})
        rows["mfu"] = mfu_row(rows)
        results.update(rows)
    (out / RESULTS).write_text(json.dumps({"sizes": asdict(sizes), "device": "cpu" if args.cpu else "cuda",
                                           "parts": results}, indent=2))
    print_table(results)
    print(f"logs and {RESULTS}: {out}")
    return 0 if all(results.get(name, {}).get("ok") for name in CORRECTNESS) else 1


if __name__ == "__main__":
    sys.exit(main())
