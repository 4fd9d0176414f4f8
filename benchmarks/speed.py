"""Speed: raymt against a plain PyTorch loop, Hugging Face, CTranslate2 and the hardware.

One command measures every ratio side by side in this one run (never against a number
from another run) on Multi30k en-de with the `small` preset, and prints one table:

    python benchmarks/speed.py [--gpu] [--json benchmarks/results/speed.json]

| ratio | how |
|---|---|
| Ray overhead | raymt (Ray Train, 1 worker x all threads) tokens/s / a plain in-process loop |
| scaling | raymt 2 workers x 1 thread / 1 worker x 1 thread, tokens/s |
| padding | real / all (src + tgt) tokens of the training batches of one epoch |
| hardware | training FLOP/s (formula in `raymt.profiling.train_flops`) / measured matmul FLOP/s |
| peer: training | raymt model / HF MarianMTModel, same dims, weights and batches, plain loop |
| peer: decoding | raymt beam-5 sentences/s / HF `generate` on the same weights |
| inference limit | raymt beam-5 sentences/s / CTranslate2 (float32) on the same weights |
| data | tokens/s the training stream delivers / tokens/s training consumes, per worker |

Timed phases alternate the systems they compare (A B A B ...) so that both see the
same machine; each rate is the median of its repeats. Models are post-norm so that the
very same weights load into HF Marian (which has no pre-norm variant); the checkpoint
decoded is the one the scaling run trains (or --checkpoint). The Ray cluster is
started with one logical CPU more than the machine has, so that Ray Data keeps its CPU
while a lone worker takes every core (its reader is a thread that mostly waits).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raymt.batching import Batch  # noqa: E402
from raymt.config import Config, ModelConfig, apply_overrides, preset  # noqa: E402
from raymt.profiling import matmul_flops, synchronize, train_flops  # noqa: E402
from raymt.tokenizer import PAD_ID  # noqa: E402

if TYPE_CHECKING:
    from raymt.data.stream import TrainStream

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"

TARGETS = {
    "ray_overhead": (0.97, True),
    "scaling": (1.85, True),
    "padding": (0.97, True),
    "hardware": (0.5, False),
    "peer_training": (1.5, True),
    "peer_decoding": (2.0, True),
    "inference_limit": (0.5, False),
    "data": (10.0, True),
}


def shared_flags(p: argparse.ArgumentParser, work_dir: Optional[str], json_path: str) -> None:
    """The flags every benchmark script here takes: model preset, data, work and JSON paths."""
    p.add_argument("--preset", default="small")
    p.add_argument("--data", default=str(MULTI30K), help="Multi30k directory (train/val/test_2016_flickr)")
    p.add_argument(
        "--work-dir",
        default=work_dir,
        help="keep corpus and runs here" + ("" if work_dir else " (default: a temporary directory)"),
    )
    p.add_argument("--json", default=json_path, help="where to write every figure")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="train and decode on the GPU (bf16 autocast)")
    p.add_argument("--ray-steps", type=int, default=200, help="steps of each raymt run")
    p.add_argument(
        "--update-freq",
        type=int,
        default=1,
        help="micro-batches per update in the scaling runs (no_sync on all but the last)",
    )
    p.add_argument("--repeats", type=int, default=2, help="alternated repeats of each in-process comparison")
    p.add_argument(
        "--overhead-repeats",
        type=int,
        default=3,
        help="alternated plain-loop and raymt runs of the Ray-overhead benchmark (medians compared)",
    )
    p.add_argument(
        "--overhead-threads",
        type=int,
        default=0,
        help="threads of both sides of the Ray-overhead benchmark (default: all; fewer leave a core to Ray)",
    )
    p.add_argument("--limit", type=int, default=300, help="test_2016_flickr sentences decoded")
    p.add_argument("--checkpoint", help="decode this checkpoint (default: the scaling run's)")
    p.add_argument(
        "--ddp-bucket-mb",
        type=float,
        help="also run the 2-worker scaling run with this DDP bucket size, right after the default one",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="torch.profiler over this many steps of every Ray run, per rank (slows those runs)",
    )
    p.add_argument("--skip", default="", help="comma-separated benchmarks to skip, e.g. peer_training")
    shared_flags(p, None, "benchmarks/results/speed.json")
    return p.parse_args(argv)


# ---------------------------------------------------------------- setup


def prepare_multi30k(data: Path, out: Path, vocab_size: int = 8000) -> Path:
    """Multi30k train (and 100 validation pairs) as a prepared corpus with an 8k joint vocabulary."""
    from raymt.config import CorpusSpec, PrepareConfig
    from raymt.data import prepare as prep
    from raymt.data import sources
    from raymt.data.text import read_parallel

    if (out / "manifest.json").exists():
        return out
    if not (data / "train.en.gz").exists():
        raise SystemExit(f"speed.py: Multi30k not found in {data}: pass --data DIR")
    src, tgt = read_parallel(str(data / "val"), "en", "de")
    cfg = PrepareConfig(vocab_size=vocab_size)
    train = [sources.Source(kind="text", paths=(str(data / "train.en.gz"), str(data / "train.de.gz")))]
    valid = [sources.Source(kind="pairs", pairs=(src[:100], tgt[:100]))]
    prep.prepare_corpora(cfg, str(out), [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), train, valid)])
    return out


def model_config(name: str) -> ModelConfig:
    """The preset, post-norm (see the module docstring), without dropout's randomness in timing."""
    cfg = preset(name)
    cfg.pre_norm = False
    return cfg


def train_stream(corpus: Path, rank: int, world_size: int) -> "TrainStream":
    """Worker `rank` of `world_size`'s training stream of epoch 0 (seed 1), not started."""
    from raymt.config import DataConfig
    from raymt.data import format as corpus_format
    from raymt.data.epoch import Mix, Position
    from raymt.data.stream import TrainStream

    files = Mix.of_shards(corpus_format.open_corpus(str(corpus)).shards())
    return TrainStream(files, DataConfig(), seed=1, rank=rank, world_size=world_size, position=Position(0))


def stream_batches(corpus: Path, rank: int, world_size: int, limit: Optional[int] = None) -> list[Batch]:
    """The training batches worker `rank` of `world_size` gets in epoch 0 (at most `limit`)."""
    stream = train_stream(corpus, rank, world_size)
    out = []
    for batch in stream:
        out.append(batch)
        if limit and len(out) >= limit:
            break
    stream.close()
    return out


def vocab_size(corpus: Path) -> int:
    """The corpus tokenizer's (padded) vocabulary size."""
    from raymt.tokenizer import Tokenizer

    return Tokenizer.load(corpus / "spm.model").vocab_size


# ---------------------------------------------------------------- in-process training


def autocast_for(device: str) -> Callable:
    """raymt's own choice: bf16 autocast on GPU and on CPUs with bf16 units, else none."""
    from raymt.precision import autocast_for as raymt_autocast

    return raymt_autocast(torch.device(device), True)


def trains_in_bf16(device: str) -> bool:
    """Whether raymt's default training autocasts to bf16 on this device."""
    return autocast_for(device) is not contextlib.nullcontext


class PlainLoop:
    """A hand-written single-process training loop: model, AdamW, inverse-sqrt schedule, steps."""

    def __init__(self, model: torch.nn.Module, cfg: Config, device: str, step_fn: Optional[Callable] = None):
        from raymt.optim import inverse_sqrt, make_optimizer

        self.model, self.cfg, self.device = model.to(device), cfg, device
        self.autocast = autocast_for(device)  # once: it reads the CPU's flags
        self.optimizer = make_optimizer(self.model, cfg.optim, fused=device.startswith("cuda"))
        self.scheduler = inverse_sqrt(self.optimizer, cfg.optim.warmup_steps)
        self.step_fn = step_fn or self.raymt_step

    def raymt_step(self, batch: Batch) -> int:
        """raymt's own update (`raymt.trainer.train_step`, no DDP): loss, backward, clip, AdamW."""
        from raymt.trainer import train_step

        num_tokens = batch.num_tokens
        train_step(self.model, self.optimizer, [batch], num_tokens, self.cfg, self.autocast)
        return num_tokens

    def tokens_per_s(self, batches: list[Batch]) -> float:
        """Target tokens per second over `batches` (already on the device)."""
        ((num_tokens, seconds, _),) = self.intervals(batches, max(1, len(batches)))
        return num_tokens / seconds

    def intervals(self, batches: list[Batch], every: int) -> list[tuple[int, float, float]]:
        """Train on `batches`; (target tokens, seconds, peak RSS MB) of each run of `every` steps,
        the intervals a Ray run logs."""
        import resource

        out = []
        synchronize(self.device)
        for i in range(0, len(batches), every):
            t0 = time.perf_counter()
            num_tokens = 0
            for batch in batches[i : i + every]:
                num_tokens += self.step_fn(batch)
                self.scheduler.step()
            synchronize(self.device)
            out.append(
                (num_tokens, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            )
        return out


def alternate(loops: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run each measurement `repeats` times, alternating their order (A B, B A, ...)."""
    out: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(loops[name]())
    return out


# ---------------------------------------------------------------- raymt on Ray


PLAIN_PROCESS = "plain-loop process"  # cpu_times' name for a spawned plain-loop process


def cpu_times() -> dict[int, tuple[str, float]]:
    """{pid: (process group name, CPU seconds so far)} of every process on the machine."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            raw = (d / "cmdline").read_bytes()
            cmd = raw.split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if cmd.startswith("ray::"):  # Ray's process titles: ray::RayTrainWorker.train_fn, ray::IDLE, ...
            name = cmd.split()[0].split(".")[0]
        elif b"spawn_main" in raw:  # a multiprocessing child: the plain loop
            name = PLAIN_PROCESS
        else:
            name = Path(cmd.split()[0]).name if cmd else f"[{comm}]"
        out[int(d.name)] = (name, seconds)
    return out


def system_context_switches() -> int:
    """The machine's context switches since boot."""
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("ctxt "))


def context_switches(worker: str = "ray::RayTrainWorker") -> dict[str, int]:
    """The machine's context switches so far, and each `worker` process's (summed over its
    threads), voluntary (it waited) and involuntary (something else was given its core)."""
    out = {"system": system_context_switches()}
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or not (d / "cmdline").read_bytes().startswith(worker.encode()):
                continue
            for task in (d / "task").iterdir():
                for line in (task / "status").read_text().splitlines():
                    if line.endswith("ctxt_switches:") or "ctxt_switches:" not in line:
                        continue
                    key = f"{d.name}_{line.split(':')[0].split('_')[0]}"  # PID_voluntary / PID_nonvoluntary
                    out[key] = out.get(key, 0) + int(line.split()[1])
        except OSError:
            continue
    return out


class CpuSampler:
    """Samples every process's CPU time in a thread; `shares` gives cores used per process group,
    `switch_rates` the context switches per second (the machine's and the training workers')."""

    def __init__(self, every_s: float = 2.0):
        import threading

        self.every_s, self.samples = every_s, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.perf_counter(), cpu_times(), context_switches()))
            self.stop.wait(self.every_s)

    def __enter__(self) -> "CpuSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def shares(self, start: float = 0.4, end: float = 0.9) -> dict[str, float]:
        """Cores used per group between two fractions of the sampled time (the steady middle)."""
        if len(self.samples) < 3:
            return {}
        a, b, wall = self._window(start, end)
        used: dict[str, float] = {}
        for pid, (name, seconds) in b[1].items():
            before = a[1].get(pid, (name, 0.0))[1]
            used[name] = used.get(name, 0.0) + (seconds - before) / wall
        return {k: round(v, 3) for k, v in sorted(used.items(), key=lambda x: -x[1]) if v >= 0.005}

    def switch_rates(self, start: float = 0.4, end: float = 0.9) -> dict[str, float]:
        """Context switches per second between two fractions of the sampled time."""
        if len(self.samples) < 3:
            return {}
        a, b, wall = self._window(start, end)
        return {k: round((v - a[2].get(k, 0)) / wall) for k, v in b[2].items()}

    def _window(self, start: float, end: float) -> tuple[tuple, tuple, float]:
        t0, t1 = self.samples[0][0], self.samples[-1][0]
        a = min(self.samples, key=lambda s: abs(s[0] - (t0 + start * (t1 - t0))))
        b = min(self.samples, key=lambda s: abs(s[0] - (t0 + end * (t1 - t0))))
        return a, b, max(b[0] - a[0], 1e-9)


def raymt_run(
    corpus: Path,
    model: ModelConfig,
    workers: int,
    cpus: float,
    steps: int,
    log_every: int,
    storage: Path,
    name: str,
    gpu: bool,
    update_freq: int = 1,
    profile_steps: int = 0,
    ddp_bucket_mb: Optional[float] = None,
) -> dict:
    """Train with `python -m raymt.train`'s code path; tokens/s of the intervals after the first."""
    from raymt.train import run

    overrides = {
        "data.corpus": str(corpus),
        "train.max_steps": steps,
        "train.eval_every": steps,
        "train.log_every": log_every,
        "train.num_workers": workers,
        "train.use_gpu": gpu,
        "train.storage_path": str(storage),
        "train.name": name,
        "train.num_to_keep": 1,
        "train.valid_beam": 1,
        "optim.update_freq": update_freq,
        "train.profile_steps": profile_steps,
    }
    if ddp_bucket_mb:
        overrides["train.ddp_bucket_mb"] = ddp_bucket_mb
    if not gpu:
        overrides["train.cpus_per_worker"] = cpus
    cfg = apply_overrides(Config(model=model), overrides)
    shutil.rmtree(storage / name, ignore_errors=True)  # a fresh run: never resume a kept one (--work-dir)
    with CpuSampler() as sampler:
        summary = run(cfg, score_test=False)
    with open(summary["metrics_csv"]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
    speeds = [float(r["tokens_per_s"]) for r in rows[1:]]  # the first interval holds start-up
    # Intervals differ in steps (the last may hold 2 of 33): time-weighted, not a plain mean.
    steps = [int(b["step"]) - int(a["step"]) for a, b in zip(rows, rows[1:])]
    rate = sum(steps) / sum(n / v for n, v in zip(steps, speeds))
    logs = Path(summary["metrics_csv"]).parent
    profiles = {p.stem: p.read_text().split("\n\n")[0] for p in sorted(logs.glob("profile-rank*.txt"))}
    return {
        "tokens_per_s": rate,
        "interval_tokens_per_s": speeds,
        "interval_steps": steps,
        "data_share": float(rows[-1]["data_share"]),
        "wall_s": summary["wall_time_s"],
        "checkpoint": summary["best_checkpoint"],
        "workers": workers,
        "cpus_per_worker": cpus,
        "cores_used": sampler.shares(),
        "context_switches_per_s": sampler.switch_rates(),
        "peak_rss_mb": [float(r["peak_rss_mb"]) for r in rows if r.get("peak_rss_mb")],
        **({"profiles": profiles} if profiles else {}),
    }


# ---------------------------------------------------------------- benchmarks


class Bench:
    """What every benchmark shares: flags, device, corpus, model shape, the first batches."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.device = "cuda" if args.gpu else "cpu"
        self.threads = torch.get_num_threads()
        self.corpus = prepare_multi30k(Path(args.data), work / "corpus")
        self.vocab = vocab_size(self.corpus)
        self.model_cfg = model_config(args.preset)
        self.cfg = Config(model=self.model_cfg)
        self.log_every = max(1, args.ray_steps // 6)
        # The batches a lone worker trains on first: the plain loop times the ones the Ray
        # run's measured intervals hold (after its first log interval).
        batches = stream_batches(self.corpus, 0, 1, limit=args.ray_steps)
        self.warmup = [b.to(self.device) for b in batches[:10]]
        self.timed = [b.to(self.device) for b in batches[self.log_every :]]
        self.runs: dict[str, dict] = {}
        self.plain_runs: list[dict] = []  # the Ray-overhead benchmark's plain-loop processes

    def new_model(self) -> torch.nn.Module:
        """The model every comparison starts from (same seed, same weights)."""
        from raymt.model import build_model

        torch.manual_seed(0)
        return build_model(self.model_cfg, self.vocab)

    def plain(
        self,
        make_model: Optional[Callable[[], torch.nn.Module]] = None,
        step_fn_of: Optional[Callable] = None,
        num_batches: Optional[int] = None,
    ) -> Callable[[], float]:
        """A measurement: a fresh plain loop, warmed up, timed over `self.timed` (or its first batches)."""

        def measure() -> float:
            loop = PlainLoop((make_model or self.new_model)(), self.cfg, self.device)
            if step_fn_of is not None:
                loop.step_fn = step_fn_of(loop)
            loop.tokens_per_s(self.warmup)
            return loop.tokens_per_s(self.timed[:num_batches])

        return measure

    def decoding(self) -> "Decoding":
        """The decoding setup (built once)."""
        if not hasattr(self, "_decoding"):
            self._decoding = Decoding(self)
        return self._decoding

    def ray(
        self, name: str, workers: int, cpus: float, update_freq: int = 1, ddp_bucket_mb: Optional[float] = None
    ) -> dict:
        """A raymt run on Ray (cached by name)."""
        if name not in self.runs:
            self.runs[name] = raymt_run(
                self.corpus,
                self.model_cfg,
                workers,
                cpus,
                self.args.ray_steps,
                self.log_every,
                self.work / "runs",
                name,
                self.args.gpu,
                update_freq,
                self.args.profile_steps,
                ddp_bucket_mb,
            )
        return self.runs[name]


def bench_ray_overhead(b: Bench) -> dict:
    """raymt on Ray with one worker taking every thread vs the plain loop, alternated, medians.

    Each plain-loop measurement runs in a fresh process, as each raymt run's worker does:
    a main-thread process's speed here is a draw (benchmarks/NOTES.md, "A slow mode of
    the main thread's allocator"), and a plain loop always timed in the driver would
    compare one draw against three. A single pair can
    mislead on a shared machine: in 7 alternated pairs here one raymt run against the
    plain loop next to it ranged 0.93-1.14 (benchmarks/NOTES.md). With
    --overhead-threads N below every thread, both sides use N threads (a spare core)."""
    threads = b.args.overhead_threads or b.threads
    stem = "one-worker-all-threads" if threads == b.threads else f"one-worker-{threads}-threads"
    names = [stem] + [f"{stem}-{r}" for r in range(2, b.args.overhead_repeats + 1)]
    runs = iter(names)
    plain_runs: list[dict] = []

    def plain() -> float:
        with CpuSampler() as sampler:  # what the rest of the machine takes, as for raymt's runs
            plain_runs.append(plain_in_fresh_process(b, matmul=True, threads=threads))
        plain_runs[-1]["cores_used"] = sampler.shares()
        return plain_runs[-1]["tokens_per_s"]

    rates = alternate(
        {"plain": plain, "raymt": lambda: b.ray(next(runs), 1, float(threads))["tokens_per_s"]}, b.args.overhead_repeats
    )
    plain_rate, raymt = statistics.median(rates["plain"]), statistics.median(rates["raymt"])
    if threads == b.threads:  # the hardware benchmark reuses these processes' rates
        b.plain_runs = plain_runs
    return {
        "ratio": raymt / plain_rate,
        "raymt_tokens_per_s": rates["raymt"],
        "plain_tokens_per_s": rates["plain"],
        "threads": threads,
        "plain_runs": plain_runs,
        "runs": {n: b.runs[n] for n in names},
    }


def plain_in_fresh_process(b: Bench, matmul: bool = False, threads: Optional[int] = None) -> dict:
    """The plain loop (`threads`, default b.threads; b.warmup then b.timed) in a new process; with
    `matmul`, that process then measures its matmul FLOP/s (bf16 where training is, fp32)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter, as a Ray worker is
    results = ctx.Queue()
    cpu = [[x.to("cpu") for x in b.warmup], [x.to("cpu") for x in b.timed]]
    threads = threads or b.threads
    proc = ctx.Process(
        target=_plain_child,
        args=(b.model_cfg, b.vocab, b.cfg, b.device, threads, *cpu, matmul, results),
        kwargs={"interval": b.log_every},
    )
    proc.start()
    out = results.get()
    proc.join()
    return out


def _plain_child(
    model_cfg: ModelConfig,
    vocab: int,
    cfg: Config,
    device: str,
    threads: int,
    warmup: list,
    timed: list,
    matmul: bool,
    results,
    barrier=None,
    interval: int = 0,
) -> None:
    """One plain-loop measurement in this process; with `barrier`, timing starts with its peers.
    With `interval`, also the rate and peak RSS of each run of that many steps (as a Ray run logs)."""
    import resource

    from raymt.model import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    loop = PlainLoop(build_model(model_cfg, vocab), cfg, device)
    loop.tokens_per_s([x.to(device) for x in warmup])
    timed = [x.to(device) for x in timed]
    if barrier is not None:
        barrier.wait()
    t0, w0, c0 = os.times(), time.perf_counter(), system_context_switches()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    parts = loop.intervals(timed, interval or len(timed))
    out = {"tokens_per_s": sum(n for n, _, _ in parts) / sum(s for _, s, _ in parts)}
    t1, wall, r1 = os.times(), time.perf_counter() - w0, resource.getrusage(resource.RUSAGE_SELF)
    out.update(
        user_cores=(t1.user - t0.user) / wall,
        system_cores=(t1.system - t0.system) / wall,
        interval_tokens_per_s=[n / s for n, s, _ in parts],
        peak_rss_mb=[m for _, _, m in parts],
        context_switches_per_s={
            "system": round((system_context_switches() - c0) / wall),
            "voluntary": round((r1.ru_nvcsw - r0.ru_nvcsw) / wall),
            "nonvoluntary": round((r1.ru_nivcsw - r0.ru_nivcsw) / wall),
        },
    )
    if matmul:
        dtype = torch.bfloat16 if trains_in_bf16(device) else torch.float32
        out.update(matmul_dtype=str(dtype), matmul_flops=matmul_flops(device, dtype))
        if dtype != torch.float32 and device == "cpu":
            out["fp32_matmul_flops"] = matmul_flops(device, torch.float32)
    results.put(out)


def bench_scaling(b: Bench) -> dict:
    """2 workers x 1 thread vs 1 worker x 1 thread; and the machine's own ceiling for it."""
    if b.args.gpu and torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs"}
    freq = b.args.update_freq
    one = b.ray("one-worker-one-thread", 1, 1.0, freq)
    two = b.ray("two-workers", 2, 1.0, freq)
    out = {
        "ratio": two["tokens_per_s"] / one["tokens_per_s"],
        "update_freq": freq,
        "one_worker": one,
        "two_workers": two,
    }
    if b.args.ddp_bucket_mb:
        other = b.ray(f"two-workers-bucket-{b.args.ddp_bucket_mb:g}mb", 2, 1.0, freq, b.args.ddp_bucket_mb)
        out["other_bucket"] = {
            "ddp_bucket_mb": b.args.ddp_bucket_mb,
            "run": other,
            "ratio": other["tokens_per_s"] / one["tokens_per_s"],
        }
    out["plain_ceiling"] = plain_ceiling(b) if not b.args.gpu else None
    return out


def plain_ceiling(b: Bench, num_batches: int = 20) -> dict:
    """Two independent 1-thread plain loops at once (summed) / one alone: no DDP, no Ray.

    What two workers could reach on this machine if communication and Ray cost nothing:
    both processes share the cores' caches, memory bandwidth and the rest of the machine.
    Measured alone, together, alone (A B A).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    batches = [bt.to("cpu") for bt in b.timed[:num_batches]]

    def together(n: int) -> list[float]:
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [
            ctx.Process(
                target=_plain_child,
                args=(b.model_cfg, b.vocab, b.cfg, "cpu", 1, batches[:3], batches, False, results, barrier),
            )
            for _ in range(n)
        ]
        for p in procs:
            p.start()
        rates = [results.get()["tokens_per_s"] for _ in procs]
        for p in procs:
            p.join()
        return rates

    alone_before, both, alone_after = together(1), together(2), together(1)
    alone = (alone_before[0] + alone_after[0]) / 2
    return {
        "ratio": sum(both) / alone,
        "alone_tokens_per_s": alone_before + alone_after,
        "together_tokens_per_s": both,
        "batches": num_batches,
    }


def bench_padding(b: Bench) -> dict:
    """Real tokens / all tokens (source and target) over rank 0's batches of a 2-worker epoch."""
    real = total = 0
    batches = stream_batches(b.corpus, 0, 2)
    for batch in batches:
        real += int((batch.src != PAD_ID).sum() + (batch.tgt_out != PAD_ID).sum())
        total += batch.src.numel() + batch.tgt_out.numel()
    return {"ratio": real / total, "batches": len(batches), "real_tokens": real, "all_tokens": total}


def bench_hardware(b: Bench) -> dict:
    """Training FLOP/s of the plain loop / matmul FLOP/s of the same process, medians."""
    # Against the matmul rate of the precision raymt trains in (bf16 under autocast); on a
    # CPU that trains in bf16 the fp32 rate, which the issue names, is measured too. The
    # processes are the Ray-overhead benchmark's plain loops, or one of its own.
    runs = b.plain_runs or [plain_in_fresh_process(b, matmul=True)]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in runs)
    peak = statistics.median(r["matmul_flops"] for r in runs)
    flops = sum(train_flops(b.model_cfg, b.vocab, x) for x in b.timed)
    achieved = tokens_per_s * flops / sum(x.num_tokens for x in b.timed)
    out = {
        "ratio": achieved / peak,
        "achieved_flops": achieved,
        "matmul_flops": peak,
        "matmul_dtype": runs[0]["matmul_dtype"],
        "tokens_per_s": tokens_per_s,
        "per_process": [{k: r[k] for k in ("tokens_per_s", "matmul_flops")} for r in runs],
    }
    if "fp32_matmul_flops" in runs[0]:
        fp32_peak = statistics.median(r["fp32_matmul_flops"] for r in runs)
        out.update(fp32_matmul_flops=fp32_peak, ratio_vs_fp32_matmul=achieved / fp32_peak)
    return out


def stream_rate(corpus: Path, rank: int, world_size: int, epochs: int) -> dict:
    """Target tokens/s one worker's stream delivers over `epochs` epochs, each next epoch's
    stream started after the current epoch's first batch (as the training loop does)."""
    from raymt.config import DataConfig
    from raymt.data import format as corpus_format
    from raymt.data.epoch import Mix, Position
    from raymt.data.stream import TrainStream

    files = Mix.of_shards(corpus_format.open_corpus(str(corpus)).shards())
    streams = [TrainStream(files, DataConfig(), 1, rank, world_size, Position(e)) for e in range(epochs)]
    t0 = time.perf_counter()
    first = None
    num_tokens = 0
    for epoch, stream in enumerate(streams):
        for batch in stream.start():
            first = first or time.perf_counter()
            num_tokens += batch.num_tokens
            if epoch + 1 < epochs:
                streams[epoch + 1].start()
        stream.close()
    end = time.perf_counter()
    return {
        "tokens": num_tokens,
        "seconds": end - t0,
        "first_batch_s": first - t0,
        "tokens_per_s": num_tokens / (end - first),
    }


def bench_data(b: Bench) -> dict:
    """Tokens/s the stream delivers per worker (after its first batch) / tokens/s a 2-worker run trains on."""
    import ray

    remote = ray.remote(num_cpus=0.5)(stream_rate)
    delivered = ray.get([remote.remote(b.corpus, rank, 2, 3) for rank in range(2)])
    if b.args.gpu:
        run = b.ray("one-worker-all-threads", 1, float(b.threads))
        consumed = run["tokens_per_s"]
    else:
        run = b.ray("two-workers", 2, 1.0)
        consumed = run["tokens_per_s"] / 2
    rate = min(d["tokens_per_s"] for d in delivered)
    return {
        "ratio": rate / consumed,
        "delivered_per_worker": delivered,
        "consumed_per_worker": consumed,
        "data_share": run["data_share"],
    }


PEER_BATCHES = 60  # timed batches per peer-training measurement


def bench_peer_training(b: Bench) -> dict:
    """raymt's model vs HF MarianMTModel with the same weights, batches, loss and optimizer."""
    try:
        from benchmarks import peers
    except ImportError:
        return {"skipped": "pip install transformers"}

    def hf_step(autocast: Callable) -> Callable[[PlainLoop], Callable[[Batch], int]]:
        return lambda loop: (
            lambda batch: peers.marian_train_step(
                loop.model, loop.optimizer, batch, b.cfg.optim.label_smoothing, b.cfg.optim.clip_norm, autocast
            )
        )

    num = PEER_BATCHES
    marian = lambda: peers.to_marian(b.new_model().train(), dropout=True)
    # The ratio compares the same precision (HF under the autocast raymt uses); where raymt
    # trains in bf16, HF's fp32 plain loop (no autocast, as most such loops run) is measured too.
    measures = {"raymt": b.plain(num_batches=num), "hf_marian": b.plain(marian, hf_step(autocast_for(b.device)), num)}
    if trains_in_bf16(b.device) and not b.args.gpu:
        measures["hf_marian_fp32"] = b.plain(marian, hf_step(contextlib.nullcontext), num)
    rates = alternate(measures, b.args.repeats)
    mid = {k: statistics.median(v) for k, v in rates.items()}
    out = {"ratio": mid["raymt"] / mid["hf_marian"], "tokens_per_s": rates, "bf16": trains_in_bf16(b.device)}
    if "hf_marian_fp32" in mid:
        out["ratio_vs_hf_fp32"] = mid["raymt"] / mid["hf_marian_fp32"]
    return out


# ---------------------------------------------------------------- decoding

BEAM = 5


def decode_options():
    """Beam 5 with no length penalty: CTranslate2's penalty (len^a) is not raymt's (GNMT), and
    HF's is another still; at 0 all three search for the same best hypothesis."""
    from raymt.decoding import DecodeOptions

    return DecodeOptions(beam=BEAM, length_penalty=0.0)


class Decoding:
    """The checkpoint every decoder loads, and the test sentences as source ids."""

    def __init__(self, b: Bench):
        from raymt.checkpoint import load_model
        from raymt.data.text import read_parallel
        from raymt.decoding import encode_sources, length_batches

        checkpoint = b.args.checkpoint or b.ray("two-workers", 2, 1.0)["checkpoint"]
        self.checkpoint = Path(checkpoint)
        self.model, self.tokenizer, _ = load_model(checkpoint, b.device)
        self.model.eval()
        src, _ = read_parallel(str(Path(b.args.data) / "test_2016_flickr"), "en", "de")
        self.sources = encode_sources(self.tokenizer, src[: b.args.limit], self.model.cfg.max_positions)
        self.batches = length_batches([len(s) for s in self.sources], 64)  # translate()'s batches
        self.device = b.device

    def limit(self, idx: list[int]) -> int:
        """raymt's longest output limit in a batch (EOS included): its own rule, not a copy."""
        from raymt.decoding import _max_lengths, pad_batch

        return int(_max_lengths(self.model, pad_batch([self.sources[i] for i in idx]), decode_options()).max())

    def raymt(self) -> list[list[int]]:
        """raymt's beam search (K/V cache), batch by batch."""
        from raymt.decoding import decode, pad_batch

        out: list[list[int]] = [[] for _ in self.sources]
        with torch.inference_mode():
            for idx in self.batches:
                for i, ids in zip(
                    idx, decode(self.model, pad_batch([self.sources[i] for i in idx], self.device), decode_options())
                ):
                    out[i] = ids
        return out

    def timed(self, fn: Callable[[], list[list[int]]]) -> Callable[[], float]:
        """A measurement of sentences/s that keeps the last outputs in `measure.outputs`.

        The first call is a warm-up (thread pools, weight packing, allocator), not timed."""
        warmed = []

        def measure() -> float:
            if not warmed:
                fn()
                warmed.append(True)
            synchronize(self.device)
            t0 = time.perf_counter()
            measure.outputs = fn()
            synchronize(self.device)
            return len(self.sources) / (time.perf_counter() - t0)

        return measure


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of sentences with identical outputs."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def bench_peer_decoding(b: Bench) -> dict:
    """raymt beam 5 / HF `generate` beam 5 on the same weights, batches and length limits."""
    try:
        from benchmarks import peers
    except ImportError:
        return {"skipped": "pip install transformers"}
    dec = b.decoding()
    marian = peers.to_marian(dec.model).eval()
    opts = decode_options()
    measures = {
        "raymt": dec.timed(dec.raymt),
        "hf_generate": dec.timed(
            lambda: peers.marian_translate(marian, dec.sources, BEAM, opts.max_len_a, opts.max_len_b, 64, 0.0)
        ),
    }
    rates = alternate(measures, b.args.repeats)
    mid = {k: statistics.median(v) for k, v in rates.items()}
    lengths = [len(o) for o in measures["raymt"].outputs]
    return {
        "ratio": mid["raymt"] / mid["hf_generate"],
        "sentences_per_s": rates,
        "mean_output_tokens": statistics.mean(lengths),
        "same_output": agreement(measures["raymt"].outputs, measures["hf_generate"].outputs),
        "sentences": len(dec.sources),
    }


def ct2_translator(b: Bench, dec: Decoding):
    """raymt's checkpoint exported with `--format ctranslate2`, loaded for float32 inference."""
    import ctranslate2

    from raymt.exporting import export_model

    out = b.work / "ct2"
    if not out.exists():
        export_model(dec.checkpoint, out, "ctranslate2")
    return ctranslate2.Translator(
        str(out), device=b.device, compute_type="float32", intra_threads=0 if b.args.gpu else b.threads, inter_threads=1
    )


def ct2_decode(translator, vocab: list[str], dec: Decoding) -> list[list[int]]:
    """CTranslate2 beam 5 over the same batches, the same length limits and no length penalty."""
    index = {piece: i for i, piece in enumerate(vocab)}
    out: list[list[int]] = [[] for _ in dec.sources]
    for idx in dec.batches:
        results = translator.translate_batch(
            [[vocab[t] for t in dec.sources[i][:-1]] for i in idx],  # CTranslate2 adds the EOS
            beam_size=BEAM,
            length_penalty=0.0,
            min_decoding_length=0,
            max_decoding_length=dec.limit(idx) - 1,
            max_batch_size=len(idx),
        )
        for i, result in zip(idx, results):
            out[i] = [index[p] for p in result.hypotheses[0]]
    return out


def bench_inference_limit(b: Bench) -> dict:
    """raymt beam 5 / CTranslate2 beam 5 (float32) on the same weights, alternated."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return {"skipped": "pip install ctranslate2"}
    from raymt.exporting import ct2_vocabulary

    dec = b.decoding()
    translator, vocab = ct2_translator(b, dec), ct2_vocabulary(dec.tokenizer)
    measures = {"raymt": dec.timed(dec.raymt), "ctranslate2": dec.timed(lambda: ct2_decode(translator, vocab, dec))}
    rates = alternate(measures, b.args.repeats)
    mid = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "ratio": mid["raymt"] / mid["ctranslate2"],
        "sentences_per_s": rates,
        "same_output": agreement(measures["raymt"].outputs, measures["ctranslate2"].outputs),
        "sentences": len(dec.sources),
    }


# ---------------------------------------------------------------- main

BENCHMARKS: dict[str, Callable[[Bench], dict]] = {
    "ray_overhead": bench_ray_overhead,
    "scaling": bench_scaling,
    "padding": bench_padding,
    "hardware": bench_hardware,
    "peer_training": bench_peer_training,
    "peer_decoding": bench_peer_decoding,
    "inference_limit": bench_inference_limit,
    "data": bench_data,
}


def print_table(results: dict[str, dict]) -> None:
    """One row per benchmark: ratio, target, met."""
    print("\n| benchmark | ratio | target | met |")
    print("|---|---|---|---|")
    for name, result in results.items():
        target, required = TARGETS[name]
        if "ratio" not in result:
            print(f"| {name} | - | {'>=' if required else 'goal >='} {target:g} | {result.get('skipped', '')} |")
            continue
        met = "yes" if result["ratio"] >= target else ("no" if required else "report")
        print(f"| {name} | {result['ratio']:.3f} | {'>=' if required else 'goal >='} {target:g} | {met} |")
    if "ratio_vs_hf_fp32" in results.get("peer_training", {}):
        print(
            f"\npeer training, raymt (bf16 autocast) / HF fp32 plain loop: "
            f"{results['peer_training']['ratio_vs_hf_fp32']:.3f}"
        )
    if "ratio_vs_fp32_matmul" in results.get("hardware", {}):
        print(f"hardware, achieved / fp32 matmul FLOP/s: {results['hardware']['ratio_vs_fp32_matmul']:.3f}")
    other = results.get("scaling", {}).get("other_bucket")
    if other:
        print(f"scaling with {other['ddp_bucket_mb']:g} MB DDP buckets: {other['ratio']:.3f}")
    ceiling = results.get("scaling", {}).get("plain_ceiling")
    if ceiling:
        print(
            f"\nscaling ceiling of this machine: two 1-thread plain loops at once / one alone = "
            f"{ceiling['ratio']:.3f} ({' + '.join(f'{r:.0f}' for r in ceiling['together_tokens_per_s'])} "
            f"vs {' / '.join(f'{r:.0f}' for r in ceiling['alone_tokens_per_s'])} tok/s)"
        )


def print_overhead_detail(result: dict) -> None:
    """Each Ray-overhead run's log intervals (tok/s), peak RSS and context switches per second."""
    runs = [("plain", r) for r in result.get("plain_runs", [])]
    runs += [("raymt", r) for r in result.get("runs", {}).values()]
    for side, run in runs:
        rates = " / ".join(f"{x:.0f}" for x in run.get("interval_tokens_per_s", []))
        rss = run.get("peak_rss_mb") or [0.0]
        used = run.get("cores_used", {})
        loop = used.get(PLAIN_PROCESS if side == "plain" else "ray::RayTrainWorker", 0.0)
        print(
            f"{side}: intervals {rates} tok/s; peak RSS {rss[0]:.0f} -> {rss[-1]:.0f} MB; "
            f"cores: loop {loop:.3f}, everything else {sum(used.values()) - loop:.3f}; "
            f"context switches/s {run.get('context_switches_per_s', {})}"
        )


def start_ray(gpu: bool) -> None:
    """A local cluster with one logical CPU more than the machine (Ray Data's), dashboard on."""
    from raymt.cluster import init_ray

    init_ray(num_cpus=(os.cpu_count() or 1) + 1, dashboard=True)  # attaches under RAY_ADDRESS


def main(argv: Optional[list[str]] = None) -> int:
    """Run every benchmark, print the table, write the JSON."""
    import ray

    args = parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(BENCHMARKS)
    if unknown:
        raise SystemExit(f"speed.py: unknown benchmark(s) in --skip: {', '.join(sorted(unknown))}")
    start_ray(args.gpu)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="raymt-speed-"))
    results: dict[str, dict] = {}
    try:
        bench = Bench(args, work)
        for name, fn in BENCHMARKS.items():
            if name in skip:
                continue
            t0 = time.perf_counter()
            results[name] = fn(bench)
            results[name]["seconds"] = round(time.perf_counter() - t0, 1)
            print(f"{name}: {results[name].get('ratio', results[name].get('skipped'))}", flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if "ray_overhead" in results:
        print()
        print_overhead_detail(results["ray_overhead"])
    for run_name, run in bench.runs.items():
        used = ", ".join(f"{k} {v:.2f}" for k, v in run.get("cores_used", {}).items())
        print(f"\n{run_name}: cores used in the middle of the run: {used}")
        for rank, text in run.get("profiles", {}).items():  # --profile-steps: each rank's step parts
            print(f"\n{run_name} {rank}:\n{text}")
    info = {
        "machine": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if args.gpu else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "command": " ".join(sys.argv),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"info": info, "results": results}, indent=2, default=str))
    print(f"\nfull figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
