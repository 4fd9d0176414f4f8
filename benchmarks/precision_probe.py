"""The CPU precision probe against real training runs: bf16 speed / fp32 speed, side by side.

For each model the probe's ratio (raymt.precision.measure_bf16_speedup exactly as the run's
workers call it at start: N processes in a gloo group, each with the run's torch threads and a
batch of the run's shape, timed at once) is printed beside the ratio of real `raymt train`
runs, fp32 then bf16 then fp32 ... (interleaved, `--pairs` of each), N workers, `--updates`
updates each, tokens/s of their log intervals after the first (the first holds start-up), and
their workers' CPU seconds per update (/proc, between the first and the last progress line
before validation: the figure the probe's CPU-time ratio predicts where other load varies):

    python benchmarks/precision_probe.py --m30k /work/shared/data/multi30k [--models mini,m30k,small]
        [--updates 150] [--pairs 1] [--avx2] [--probe-only]

Models: `mini` is the default run (built-in corpus, its vocabulary 1000, data.max_tokens
2048); `m30k` is recipes/multi30k-cpu.toml's model and batch on Multi30k (vocabulary 8000,
4096 tokens); `small` the `small` preset with that recipe's data and batch. `--avx2` runs
everything under ATEN_CPU_CAPABILITY=avx2 (torch's AVX2 kernels, as on a CPU without AVX-512).
Validation runs once, at the last update, on a 100-sentence set (the runs' tokens/s exclude it).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "multi30k-cpu.toml"
SMALL = {"d_model": 256, "num_heads": 4, "d_ff": 1024, "num_encoder_layers": 3, "num_decoder_layers": 3}


def model_flags(name: str, corpus: Optional[Path]) -> list[str]:
    """The `raymt train` flags of a model's runs (its corpus, model and batch)."""
    if name == "mini":
        return ["--set", "data.builtin_eval_size=100"]
    flags = ["--config", str(RECIPE), "--corpus", str(corpus), "--set", "train.max_minutes=60"]
    if name == "small":
        flags += [f for k, v in SMALL.items() for f in ("--set", f"model.{k}={v}")] + ["--set", "model.dropout=0.1"]
    return flags


# ---------------------------------------------------------------- the probe, as the workers run it


def _probe_worker(rank: int, world: int, port: int, threads: int, spec: dict, out) -> None:
    """One worker of the probe's group: its threads, the gloo group, the probe; rank 0 reports."""
    import torch
    import torch.distributed as dist

    from raymt.config import Config
    from raymt.distributed import group_collective
    from raymt.precision import ProbeShape, measure_bf16_speedup

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = Config.from_dict(spec["config"])
    shape = ProbeShape.of_run(cfg, threads, world, [tuple(p) for p in spec["widths"]])
    t0 = time.perf_counter()
    ratio = measure_bf16_speedup(cfg, spec["vocab"], shape, group_collective())
    if rank == 0:
        seconds, capability = time.perf_counter() - t0, torch.backends.cpu.get_cpu_capability()
        out.put({"ratio": ratio, "seconds": seconds, "capability": capability, "shapes": shape.shapes})
    dist.destroy_process_group()


def probe(config: dict, vocab: int, widths: tuple, workers: int, threads: int) -> dict:
    """The probe's ratio with `workers` processes of `threads` threads at once (spawned: they
    read ATEN_CPU_CAPABILITY as a run's workers do)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    spec = {"config": config, "vocab": vocab, "widths": list(widths)}
    procs = [ctx.Process(target=_probe_worker, args=(r, workers, port, threads, spec, out)) for r in range(workers)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join()
    return result


# ---------------------------------------------------------------- real runs


def _stat(pid: str) -> Optional[tuple[int, float]]:
    """(parent pid, CPU seconds: user + system) of a process, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_cpu(root: int) -> dict[int, float]:
    """CPU seconds so far of each Ray Train worker process (by pid) below process `root` (the
    `raymt train` driver starts its own raylet, whose workers these are; other runs' are not)."""
    stats = {int(p): st for p in os.listdir("/proc") if p.isdigit() and (st := _stat(p))}
    below, todo = set(), [root]
    while todo:
        parent = todo.pop()
        kids = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in below]
        below.update(kids)
        todo += kids
    out = {}
    for pid in below:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if name.startswith(b"ray::RayTrainWorker"):
            out[pid] = stats[pid][1]
    return out


def train(name: str, precision: str, flags: list[str], updates: int, storage: Path, env: dict) -> dict:
    """One `raymt train` run pinned to `precision`: its tokens/s after the first log interval,
    and its workers' CPU seconds per update between the first and the last log line before the
    end (validation, at the last update, left out), read from /proc as the lines arrive."""
    run = f"{name}-{precision}-{time.time_ns()}"
    log_every = max(1, updates // 5)
    cmd = [sys.executable, "-m", "raymt.train", *flags, "--max-steps", str(updates), "--storage-path", str(storage)]
    cmd += ["--name", run, "--set", f"train.precision={precision}", "--set", f"train.log_every={log_every}"]
    cmd += ["--set", f"train.eval_every={updates}"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines, cpu = [], {}  # cpu: step -> {worker pid: CPU seconds} when its progress line arrived
    for line in proc.stdout:
        lines.append(line)
        step = re.search(r"\bstep (\d+)/", line)
        if step and int(step.group(1)) < updates:
            cpu[int(step.group(1))] = worker_cpu(proc.pid)
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(lines[-60:])}")
    with open(storage / run / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["tokens_per_s"]]
    rates = [float(r["tokens_per_s"]) for r in rows]
    line = next((x[x.index("precision:") :].strip() for x in lines if "precision:" in x), "")
    loss = next((r["train_loss"] for r in reversed(rows) if r["train_loss"]), "")
    first, last = min(cpu), max(cpu)
    per_worker = [(cpu[last][pid] - cpu[first].get(pid, 0.0)) / (last - first) for pid in cpu[last]]
    return {
        "rates": rates,
        "rate": statistics.mean(rates[1:] or rates),
        "cpu_s_per_update": sum(per_worker),  # both workers together
        "cpu_s_per_update_by_worker": [round(c, 4) for c in per_worker],
        "cpu_steps": [first, last],
        "loss": loss,
        "line": line,
        "wall_s": round(time.time() - t0, 1),
    }


def shape_of(name: str, corpus: Optional[Path], runs: Path) -> tuple[dict, int, tuple]:
    """(the runs' config as a dict, vocabulary size, its validation rows' widths) of a model's
    runs: the rows the run's own probe sees (its corpus's validation set and tokenizer); for
    `mini`, the corpus of an earlier mini run under `runs` (its tokenizer is trained per run)."""
    from raymt.config import Config, apply_overrides
    from raymt.config.overrides import flatten, load_file
    from raymt.data import format as corpus_format
    from raymt.precision import row_widths

    cfg = Config()
    if name != "mini":
        cfg = apply_overrides(cfg, flatten(load_file(str(RECIPE))))
        if name == "small":
            cfg = apply_overrides(cfg, {**{f"model.{k}": v for k, v in SMALL.items()}, "model.dropout": 0.1})
    else:
        made = sorted(runs.glob("mini-*/corpus/manifest.json"), key=lambda f: f.stat().st_mtime)
        if not made:
            raise SystemExit(f"no mini run under {runs} to take the rows from: run --models mini without --probe-only")
        corpus = made[-1].parent
    prepared = corpus_format.open_corpus(str(corpus))
    tok = prepared.tokenizer()
    rows = corpus_format.eval_rows(prepared.eval_set("valid"), tok, cfg.model.max_positions)
    return cfg.to_dict(), tok.vocab_size, row_widths(rows)


def prepare_m30k(m30k: Path, work: Path, env: dict) -> Path:
    """Multi30k prepared once (vocabulary 8000) with a 100-sentence validation set."""
    corpus = work / "m30k-corpus"
    if (corpus / "spm.model").exists():
        return corpus
    for side, lang in (("src", "en"), ("tgt", "de")):
        lines = gzip.open(m30k / f"val.{lang}.gz", "rt").read().splitlines()[:100]
        with gzip.open(work / f"valid-{side}.gz", "wt") as f:
            f.write("\n".join(lines) + "\n")
        (work / f"valid100.{lang}.gz").write_bytes((work / f"valid-{side}.gz").read_bytes())
    cmd = [sys.executable, "-m", "raymt.data", "prepare", "--out", str(corpus), "--train", str(m30k / "train")]
    cmd += ["--valid", str(work / "valid100"), "--src", "en", "--tgt", "de", "--vocab-size", "8000"]
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, capture_output=True)
    return corpus


def main(argv: Optional[list[str]] = None) -> int:
    """Probe and run each model; print and write (--json) the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mini,m30k,small")
    ap.add_argument("--m30k", type=Path, default=Path("/work/shared/data/multi30k"))
    ap.add_argument("--updates", type=int, default=150)
    ap.add_argument("--pairs", type=int, default=1, help="fp32/bf16 run pairs per model (interleaved)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (raymt.cluster.plan's)")
    ap.add_argument("--avx2", action="store_true", help="ATEN_CPU_CAPABILITY=avx2")
    ap.add_argument("--probe-only", action="store_true")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "raymt-precision-probe")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RAYMT_PRECISION_CACHE=str(args.work / f"cache-{time.time_ns()}.json"))
    env["RAY_ADDRESS"] = "local"  # a Ray instance of its own: not another user's `ray start` cluster
    if args.avx2:
        env["ATEN_CPU_CAPABILITY"] = os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    models = args.models.split(",")
    corpus = prepare_m30k(args.m30k, args.work, env) if set(models) - {"mini"} else None
    results = {}
    for name in models:
        found = {}
        if not args.probe_only:
            runs = {"fp32": [], "bf16": []}
            for _ in range(args.pairs):
                for precision in ("fp32", "bf16"):
                    runs[precision].append(
                        train(name, precision, model_flags(name, corpus), args.updates, args.work / "runs", env)
                    )
                    print(f"  {precision}: {runs[precision][-1]}", flush=True)
            found["runs"] = runs
            found["run_ratio"] = statistics.mean(r["rate"] for r in runs["bf16"]) / statistics.mean(
                r["rate"] for r in runs["fp32"]
            )
            found["run_cpu_ratio"] = statistics.mean(r["cpu_s_per_update"] for r in runs["fp32"]) / statistics.mean(
                r["cpu_s_per_update"] for r in runs["bf16"]
            )
        config, vocab, widths = shape_of(name, corpus, args.work / "runs")  # after a mini run: its rows
        found["probe"] = probe(config, vocab, widths, args.workers, args.threads)
        print(
            f"{name}: probe {found['probe']['ratio']:.3f} ({found['probe']['seconds']:.1f} s, "
            f"{found['probe']['capability']}, batches {found['probe']['shapes']})",
            flush=True,
        )
        results[name] = found
    print("\n| model | probe bf16/fp32 | runs bf16/fp32 | runs in CPU time | fp32 tok/s | bf16 tok/s |")
    print("|---|---|---|---|---|---|")
    for name, found in results.items():
        runs = found.get("runs")
        cells = [f"{found['probe']['ratio']:.3f}"]
        if runs:
            cells += [f"{found['run_ratio']:.3f}", f"{found['run_cpu_ratio']:.3f}"] + [
                ", ".join(f"{r['rate']:.0f}" for r in runs[p]) for p in ("fp32", "bf16")
            ]
        print(f"| {name} | " + " | ".join(cells + ["—"] * (5 - len(cells))) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
