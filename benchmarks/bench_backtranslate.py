"""Back-translation speed: `raymt backtranslate` (raymt and CTranslate2 engines, 1 and 2 actors)
beside single-process `ctranslate2.Translator` on the same model and input, in one run.

Input: Multi30k's German training side (`train.de.gz`), or the first --limit lines of it.
Each `raymt backtranslate` run is a fresh command (its own local Ray, one thread and one CPU
per actor) into a new output directory; its sentences/s is the command's own figure (decoding
only: Ray's start is not counted, the actors' model loading is). The baseline translates the
same lines, tokenized the same way, with one `ctranslate2.Translator` (1 thread, the same
compute type and token-budget batches) in this process. Ratios: each run / the baseline per
core (actors x threads), and 2 actors / 1 actor per engine. Goals (issue 29): the best engine
>= 0.9x single-process CTranslate2 per core, 2 actors >= 1.7x one.

Every row runs --repeat times (default 3), the rows interleaved, and its median counts: on a
small shared machine one disturbed run must not decide a ratio. Each command's processes are
sampled every 0.5 s (psutil), and the table shows the cores that the actors, the driver and
Ray's own processes (GCS, raylet, idle workers) kept busy while it decoded: where the time of
the cores that do not go to the actors goes.

`--memory` instead translates 0.5M and 2M generated lines (Multi30k's lines cycled) with the
fastest engine and reports the peak RSS of the driver and of each actor (psutil, sampled every
0.5 s); issue 29 wants them within 10% of each other.

    python benchmarks/bench_backtranslate.py --checkpoint runs/<de-en run>/best [--limit 2000]
    python benchmarks/bench_backtranslate.py --checkpoint ... --memory

Without --checkpoint a randomly initialised `--preset` model (a SentencePiece model trained on
the input) is used: its speed is real, its outputs run to the length limit and mean nothing.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raymt import backtranslate as bt  # noqa: E402
from raymt import engines  # noqa: E402
from raymt.config import DecodeOptions, ShardJobOptions  # noqa: E402

DEFAULT_INPUT = ROOT.parent / "shared" / "data" / "multi30k" / "train.de.gz"
RATE = re.compile(r"in ([\d.]+) s, ([\d,.]+) sentences/s")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    d = DecodeOptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a de->en raymt checkpoint (default: a random --preset model)")
    p.add_argument("--preset", default="mini", help="shape of the random model without --checkpoint")
    p.add_argument("--input", default=str(DEFAULT_INPUT), help="monolingual text (plain or .gz)")
    p.add_argument("--limit", type=int, help="only the first N lines")
    p.add_argument("--src-lang", default="de", help="the input's language")
    p.add_argument("--tgt-lang", default="en", help="the output's (a tagged model: its tag)")
    p.add_argument("--beam", type=int, default=d.beam)
    p.add_argument("--compute-type", default="int8", help="CTranslate2's, for its engine and the baseline")
    p.add_argument("--max-tokens", type=int, default=ShardJobOptions().max_tokens)
    p.add_argument("--actors", default="1,2", help="actor counts to run")
    p.add_argument("--shard-lines", type=int, default=5000, help="input lines per shard (>= 2 shards per actor)")
    p.add_argument("--engines", default="raymt,ctranslate2")
    p.add_argument("--repeat", type=int, default=3, help="runs of each row (interleaved); the median counts")
    p.add_argument("--memory", action="store_true", help="peak RSS at 0.5M vs 2M lines instead")
    p.add_argument("--memory-lines", default="500000,2000000")
    p.add_argument("--work-dir", help="outputs and the exported model (default: a temporary directory)")
    p.add_argument("--json", default="bench_backtranslate.json", help="where to write the results")
    return p.parse_args(argv)


def random_checkpoint(work: Path, preset: str, lines: list[str]) -> Path:
    """A random model of `preset` with a SentencePiece model trained on the input: real speed only."""
    import torch

    from raymt.checkpoint import save_checkpoint
    from raymt.config import Config, CorpusSpec, DataConfig
    from raymt.config import preset as model_preset
    from raymt.model import Transformer
    from raymt.tokenizer import train_tokenizer

    torch.manual_seed(0)
    tok = train_tokenizer(lines[:20000] + lines[:1], 8000)
    config = Config(model=model_preset(preset), data=DataConfig(corpora=[CorpusSpec("de", "en")], vocab_size=8000))
    return save_checkpoint(work / "checkpoint", Transformer(config.model, tok.vocab_size), config, tok)


def write_input(path: Path, lines: list[str], total: int) -> Path:
    """`total` lines (the input cycled), gzipped."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for line in itertools.islice(itertools.cycle(lines), total):
            f.write(line + "\n")
    return path


def baseline(checkpoint: Path, lines: list[str], args: argparse.Namespace, cache: Path) -> dict:
    """Single-process ctranslate2.Translator, 1 thread, the same batches as an actor's."""
    import ctranslate2

    directory = engines.ct2_model_dir(str(checkpoint), str(cache))
    translator = ctranslate2.Translator(
        str(directory), device="cpu", compute_type=args.compute_type, intra_threads=1, inter_threads=1
    )
    from raymt.tokenizer import Tokenizer

    sp = Tokenizer.load(directory / "spm.model").sp
    opts = DecodeOptions(beam=args.beam)
    # A tagged multilingual model's target tag goes first, as the actors put it.
    _, _, tags = bt.directions(engines.load_model_info(str(checkpoint)), args.src_lang, args.tgt_lang)
    t0 = time.perf_counter()
    sources = [tags + sp.encode(line.strip(), out_type=str) for line in lines if line.strip()]
    for batch in engines.token_batches([len(s) + 1 for s in sources], args.max_tokens):
        limit = max(int(opts.max_len_a * (len(sources[i]) + 1) + opts.max_len_b) for i in batch)
        translator.translate_batch(
            [sources[i] for i in batch],
            beam_size=opts.beam,
            length_penalty=opts.length_penalty,
            max_decoding_length=limit - 1,
            min_decoding_length=0,
        )
    seconds = time.perf_counter() - t0
    rate = len(lines) / seconds
    return {"engine": "ctranslate2.Translator", "actors": 1, "seconds": seconds, "sentences_per_s": rate}


KINDS = ("actors", "driver", "ray")


class Sampler(threading.Thread):
    """Every 0.5 s: the peak RSS and the CPU seconds of a job's processes (driver, actors, Ray's own)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.driver, self.actors, self.stop = pid, 0, {}, threading.Event()
        self.seen: dict[int, float] = {}  # pid -> its CPU seconds at the last sample
        self.used = dict.fromkeys(KINDS, 0.0)  # CPU seconds of each kind, kept after a process exits
        self.timeline: list[tuple[float, dict[str, float]]] = []  # (time, CPU seconds of each kind)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.sample()

    def sample(self) -> None:
        """One sample of every process under the driver (Ray's GCS and raylet, its workers, the actors)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                rss, cpu = proc.memory_info().rss, proc.cpu_times()
                is_actor = " ".join(proc.cmdline()).startswith(bt.ACTOR_TITLE)
            except psutil.Error:
                continue
            kind = "driver" if proc.pid == self.pid else "actors" if is_actor else "ray"
            # A Ray worker becomes an actor (its title changes): only its time since counts as the actor's.
            self.used[kind] += cpu.user + cpu.system - self.seen.get(proc.pid, 0.0)
            self.seen[proc.pid] = cpu.user + cpu.system
            if kind == "driver":
                self.driver = max(self.driver, rss)
            elif kind == "actors":
                self.actors[proc.pid] = max(self.actors.get(proc.pid, 0), rss)
        self.timeline.append((time.perf_counter(), dict(self.used)))

    def cores_busy(self, start: float, end: float) -> dict[str, float]:
        """Cores each kind kept busy on average between two times (from the samples inside them)."""
        inside = [(t, c) for t, c in self.timeline if start <= t <= end]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        return {k: (last[k] - first[k]) / (t1 - t0) for k in KINDS}

    def decoding_end(self) -> float:
        """When the actors' CPU time stopped growing (their last shard done; they idle until shutdown)."""
        final = self.timeline[-1][1]["actors"] if self.timeline else 0.0
        return next((t for t, c in self.timeline if c["actors"] >= final - 0.05), time.perf_counter())


def run_job(
    checkpoint: Path, mono: Path, num_lines: int, out: Path, engine: str, actors: int, args: argparse.Namespace
) -> dict:
    """One `raymt backtranslate` command on `mono` (`num_lines` lines): sentences/s, wall time, peak RSS, CPU use."""
    command = [sys.executable, "-m", "raymt.backtranslate", "--checkpoint", str(checkpoint), "--input", str(mono)]
    command += ["--output", str(out), "--engine", engine, "--num-actors", str(actors), "--cpus-per-actor", "1"]
    command += ["--num-cpus", str(actors), "--beam", str(args.beam), "--max-tokens", str(args.max_tokens)]
    command += ["--compute-type", args.compute_type, "--shard-lines", str(args.shard_lines), "--progress-s", "60"]
    command += ["--src-lang", args.src_lang, "--tgt-lang", args.tgt_lang]
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(ROOT), "RAYMT_CACHE": str(out.parent / "cache")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    log, _ = proc.communicate()
    sampler.stop.set()
    match = RATE.search(log)
    if proc.returncode != 0 or not match:
        raise SystemExit(f"{' '.join(command)} failed:\n{log[-3000:]}")
    seconds, rate = float(match.group(1)), float(match.group(2).replace(",", ""))
    # The command's rate counts from the actors' creation to its last shard: the same window here.
    end = sampler.decoding_end()
    busy = sampler.cores_busy(end - num_lines / rate, end)
    return {
        "engine": engine,
        "actors": actors,
        "seconds": seconds,
        "wall_s": time.perf_counter() - t0,
        "sentences_per_s": rate,
        "driver_rss_mb": sampler.driver / 2**20,
        "actor_rss_mb": [v / 2**20 for v in sampler.actors.values()],
        "cores_busy": busy,
    }


def median_row(jobs: list[dict]) -> dict:
    """The run with the median sentences/s (the lower one of an even count), with every run's rate."""
    middle = statistics.median_low([j["sentences_per_s"] for j in jobs])
    row = dict(next(j for j in jobs if j["sentences_per_s"] == middle))
    row["runs_sentences_per_s"] = [j["sentences_per_s"] for j in jobs]
    return row


def speed(checkpoint: Path, lines: list[str], work: Path, args: argparse.Namespace) -> list[dict]:
    """The baseline, then every engine x actor count, --repeat times interleaved; medians and their ratios."""
    mono = write_input(work / "mono.de.gz", lines, len(lines))
    jobs: dict[tuple[str, int], list[dict]] = {}
    # Interleaved, so that a passing disturbance costs one run of several rows, not every run of one.
    for i in range(args.repeat):
        jobs.setdefault(("ctranslate2.Translator", 1), []).append(baseline(checkpoint, lines, args, work / "cache"))
        for engine in args.engines.split(","):
            for actors in [int(a) for a in args.actors.split(",")]:
                out = work / f"out-{engine}-{actors}-{i}"
                jobs.setdefault((engine, actors), []).append(
                    run_job(checkpoint, mono, len(lines), out, engine, actors, args)
                )
    rows = [median_row(runs) for runs in jobs.values()]
    base = rows[0]["sentences_per_s"]
    for row in rows[1:]:
        row["per_core_vs_ct2"] = row["sentences_per_s"] / row["actors"] / base
        one = next((r for r in rows if r["engine"] == row["engine"] and r["actors"] == 1), None)
        if one is not None and row["actors"] > 1:
            row["vs_one_actor"] = row["sentences_per_s"] / one["sentences_per_s"]
    print_speed(rows, len(lines), args)
    return rows


def print_speed(rows: list[dict], num_lines: int, args: argparse.Namespace) -> None:
    """The table: medians, every run's rate, ratios, and the cores each kind of process kept busy."""
    print(f"{num_lines:,} lines of {args.input}, beam {args.beam}, CTranslate2 {args.compute_type}, ", end="")
    print(f"median of {args.repeat} run(s) each; cores busy while decoding: actors / driver / Ray's processes")
    print(f"{'engine':<24}{'actors':>7}{'sent/s':>9}  {'runs':<24}{'per core/ct2':>13}{'/1 actor':>9}  cores busy")
    for r in rows:
        runs = ", ".join(f"{x:.0f}" for x in r["runs_sentences_per_s"])
        per_core = f"{r.get('per_core_vs_ct2', 1.0):.2f}x"
        scaling = f"{r['vs_one_actor']:.2f}x" if "vs_one_actor" in r else ""
        busy = " / ".join(f"{r['cores_busy'][k]:.2f}" for k in KINDS) if r.get("cores_busy") else ""
        rate = f"{r['sentences_per_s']:>9.1f}"
        print(f"{r['engine']:<24}{r['actors']:>7}{rate}  {runs:<24}{per_core:>13}{scaling:>9}  {busy}")


def memory(checkpoint: Path, lines: list[str], work: Path, args: argparse.Namespace) -> list[dict]:
    """Peak RSS of the driver and the actors at each --memory-lines size, CTranslate2 engine, 2 actors."""
    rows = []
    for total in [int(n) for n in args.memory_lines.split(",")]:
        mono = write_input(work / f"mono-{total}.de.gz", lines, total)
        row = run_job(checkpoint, mono, total, work / f"mem-{total}", "ctranslate2", 2, args)
        row["lines"] = total
        rows.append(row)
        print(
            f"{total:>10,} lines: driver peak {row['driver_rss_mb']:.0f} MB, actors' peaks "
            f"{', '.join(f'{m:.0f}' for m in row['actor_rss_mb'])} MB, {row['sentences_per_s']:.1f} sentences/s"
        )
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    from raymt.data.text import read_lines

    lines = read_lines(args.input)[: args.limit]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-bt-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(args.checkpoint) if args.checkpoint else random_checkpoint(work, args.preset, lines)
    rows = memory(checkpoint, lines, work, args) if args.memory else speed(checkpoint, lines, work, args)
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "checkpoint": str(checkpoint) if args.checkpoint else f"random {args.preset}",
        "input": args.input,
        "lines": len(lines),
        "beam": args.beam,
        "compute_type": args.compute_type,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
