"""Streaming data at scale: a generated corpus of millions of pairs through 2 training workers.

For each corpus size (0.5 M and 2 M pairs by default) this benchmark
1. generates the corpus at run time (pairs of Multi30k sentence pairs joined at random, or
   the built-in generator when Multi30k is absent) as gzipped text outside the repository;
2. prepares it with `raymt.prepare` (Ray Data: cleaning, SentencePiece, tokenizing, shards);
3. streams one whole epoch through 2 Ray actors shaped like training workers (0.5 CPU each),
   each iterating its `TrainStream` (reads, chunks, token-budget batches, collation): the
   tokens/s the pipeline delivers;
4. trains on the same corpus with `raymt.train.run` (2 workers) for a fixed number of steps:
   the tokens/s training consumes and the share of the loop spent waiting for data.
A sampler thread records the peak private memory of the driver, the training workers,
the stream actors and Ray Data's tasks, with the object store's shared pages apart (see
`private_mb`). Each size runs in a fresh driver process and Ray cluster, one after the
other in this one command; the table shows the ratios and whether memory grew with the
corpus.

    python benchmarks/bench_data.py [--sizes 500000,2000000] [--steps 150] [--json bench_data.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k" / "train"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="500000,2000000", help="comma-separated corpus sizes (pairs)")
    p.add_argument("--steps", type=int, default=150, help="training steps per size")
    p.add_argument("--preset", default="mini", help="model preset for the training phase")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--work-dir", help="where corpora go (default: a temporary directory, removed)")
    p.add_argument("--json", default="bench_data.json", help="where to write the results")
    p.add_argument(
        "--base",
        default=str(MULTI30K),
        help="parallel text prefix (PREFIX.en.gz, PREFIX.de.gz) whose pairs are joined "
        "into the corpus; the built-in corpus when absent",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------- corpus


def base_pairs(prefix: str) -> tuple[list[str], list[str]]:
    """Sentence pairs to combine: PREFIX.en.gz/.de.gz when present, else the built-in corpus."""
    from raymt.data import builtin, text

    if Path(prefix).with_suffix(".en.gz").is_file():
        return text.read_parallel(prefix, "en", "de")
    return builtin.generate(20_000, "en", "de", seed=1)


def make_corpus(num_pairs: int, directory: Path, base: str, seed: int = 1) -> tuple[Path, Path]:
    """Write `num_pairs` pairs, each two random base pairs joined, as gzipped text files."""
    src, tgt = base_pairs(base)
    rng = random.Random(seed)
    paths = directory / "gen.en.gz", directory / "gen.de.gz"
    with gzip.open(paths[0], "wt", compresslevel=1) as fs, gzip.open(paths[1], "wt", compresslevel=1) as ft:
        for start in range(0, num_pairs, 100_000):
            rows = [(rng.randrange(len(src)), rng.randrange(len(src))) for _ in range(min(100_000, num_pairs - start))]
            fs.write("".join(f"{src[a]} {src[b]}\n" for a, b in rows))
            ft.write("".join(f"{tgt[a]} {tgt[b]}\n" for a, b in rows))
    return paths


# ---------------------------------------------------------------- memory


def private_mb(pid: int) -> tuple[float, float]:
    """(heap, object store) MB of a process's private pages, from /proc/PID/smaps.

    Private pages are those no other process maps (USS). Ray's object store is a
    shared-memory file (/dev/shm/plasma*) that every worker maps: a page a task wrote and
    nobody has read yet counts as that task's private memory, and stays in its page table
    after the object is freed, until the store reuses it. Those pages are reported apart
    from the process's own memory, which is what must not grow with the corpus.
    """
    heap = store = 0
    in_store = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                in_store = "/dev/shm/plasma" in line
            elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                kb = int(line.split()[1])
                if in_store:
                    store += kb
                else:
                    heap += kb
    return heap / 1024, store / 1024


class PeakMemory:
    """Samples the private memory of this process and of Ray's worker processes.

    Private (USS), not RSS: RSS would count every shared page a process touched. The
    object store's pages are kept apart (see `private_mb`): `peaks` holds each role's own
    memory, `store_peaks` the object-store pages its processes held privately.
    """

    ROLES = {"RayTrainWorker": "train_worker", "StreamBench": "stream_actor", "ray::": "ray_task"}

    def __init__(self, every_s: float = 0.5):
        import psutil

        self.psutil, self.me, self.every_s = psutil, psutil.Process(), every_s
        self.peaks: dict[str, float] = {}  # role -> MB
        self.store_peaks: dict[str, float] = {}  # role -> MB of object-store pages
        self.by_title: dict[str, float] = {}  # process title (e.g. ray::IDLE) -> MB
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def title(self, proc) -> Optional[str]:
        """The process title of a Ray worker (ray::...), "driver", or None for others."""
        if proc.pid == self.me.pid:
            return "driver"
        try:
            # This driver's Ray cluster only (ray.init starts it as a child): not another one on the host.
            if self.me.pid not in (p.pid for p in proc.parents()):
                return None
            title = " ".join(proc.cmdline())
        except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
            return None
        return title.split(" ")[0][:48] if title.startswith("ray::") else None

    def loop(self) -> None:
        while not self.stop_event.wait(self.every_s):
            for proc in self.psutil.process_iter():
                title = self.title(proc)
                if title is None:
                    continue
                try:
                    heap, store = private_mb(proc.pid)
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    continue
                role = (
                    "driver"
                    if title == "driver"
                    else next((r for key, r in self.ROLES.items() if key in title), "ray_task")
                )
                self.peaks[role] = max(self.peaks.get(role, 0.0), heap)
                self.store_peaks[role] = max(self.store_peaks.get(role, 0.0), store)
                self.by_title[title] = max(self.by_title.get(title, 0.0), heap)

    def summary(self) -> dict:
        """The peaks as JSON fields."""
        return {
            "peak_private_mb": self.peaks,
            "peak_store_pages_mb": self.store_peaks,
            "peak_private_mb_by_process": self.by_title,
        }

    def __enter__(self) -> "PeakMemory":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join()


# ---------------------------------------------------------------- phases


def prepare(src: Path, tgt: Path, out: Path, vocab_size: int, base: str) -> dict:
    """Prepare the generated corpus; returns its manifest and the seconds it took."""
    from raymt.config import CorpusSpec, PrepareConfig
    from raymt.data import prepare as prep
    from raymt.data import sources

    valid = sources.Source(kind="pairs", pairs=base_pairs_sample(base))
    t0 = time.perf_counter()
    cfg = PrepareConfig(vocab_size=vocab_size)
    train = [sources.Source(kind="text", paths=(str(src), str(tgt)))]
    manifest = prep.prepare_corpora(
        cfg, str(out), [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), train, [valid])]
    )
    return {"manifest": manifest, "seconds": time.perf_counter() - t0}


def base_pairs_sample(base: str, n: int = 200) -> tuple[list[str], list[str]]:
    """A small validation set (the training phase validates once, at its end)."""
    src, tgt = base_pairs(base)
    return src[:n], tgt[:n]


def stream_epoch(corpus_dir: str, world_size: int = 2) -> dict:
    """One epoch through `world_size` stream actors: tokens delivered per second, per worker."""
    import ray

    from raymt.config import DataConfig
    from raymt.data import format as corpus_format
    from raymt.data.epoch import Mix, Position
    from raymt.data.stream import TrainStream

    files = Mix.of_shards(corpus_format.open_corpus(corpus_dir).shards())

    @ray.remote(num_cpus=0.5)
    class StreamBench:
        def run(self, rank: int) -> dict:
            stream = TrainStream(files, DataConfig(), seed=1, rank=rank, world_size=world_size, position=Position(0))
            t0, num_batches, num_tokens, num_src = time.perf_counter(), 0, 0, 0
            for batch in stream:
                num_batches += 1
                num_tokens += batch.num_tokens
                num_src += int((batch.src != 0).sum())
            seconds = time.perf_counter() - t0
            return {
                "batches": num_batches,
                "tgt_tokens": num_tokens,
                "src_tokens": num_src,
                "seconds": seconds,
                "tgt_tokens_per_s": num_tokens / seconds,
            }

    actors = [StreamBench.remote() for _ in range(world_size)]
    per_rank = ray.get([a.run.remote(rank) for rank, a in enumerate(actors)])
    for a in actors:
        ray.kill(a)
    return {"per_rank": per_rank, "min_tgt_tokens_per_s_per_worker": min(r["tgt_tokens_per_s"] for r in per_rank)}


def train(corpus_dir: str, steps: int, preset_name: str, storage: Path) -> dict:
    """A short 2-worker training run on the prepared corpus; its speed and data-wait share."""
    import csv

    from raymt.config import Config, apply_overrides, preset
    from raymt.train import run

    cfg = apply_overrides(
        Config(model=preset(preset_name)),
        {
            "data.corpus": corpus_dir,
            "train.max_steps": steps,
            "train.eval_every": steps,
            "train.log_every": 25,
            "train.storage_path": str(storage),
            "train.name": "train",
        },
    )
    summary = run(cfg, score_test=False)
    with open(summary["metrics_csv"]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
    speeds = [float(r["tokens_per_s"]) for r in rows[1:]] or [float(rows[0]["tokens_per_s"])]
    last = rows[-1]
    return {
        "tgt_tokens_per_s": sum(speeds) / len(speeds),
        "steps": steps,
        "data_share": float(last["data_share"]),
        "wall_s": summary["wall_time_s"],
    }


# ---------------------------------------------------------------- main


def bench_size(num_pairs: int, args: argparse.Namespace, work: Path) -> dict:
    """All phases for one corpus size."""
    directory = work / f"pairs-{num_pairs}"
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    src, tgt = make_corpus(num_pairs, directory, args.base)
    generated_s = time.perf_counter() - t0
    result: dict = {"pairs": num_pairs, "generate_s": generated_s}
    with PeakMemory() as mem:
        prepared = prepare(src, tgt, directory / "corpus", args.vocab_size, args.base)
    split = prepared["manifest"]["corpora"][0]["train"]
    result["prepare"] = {
        "seconds": prepared["seconds"],
        "kept_pairs": split["num_pairs"],
        "shards": len(split["files"]),
        **mem.summary(),
    }
    src.unlink(), tgt.unlink()  # only the shards are read from here on
    with PeakMemory() as mem:
        result["stream"] = stream_epoch(str(directory / "corpus"))
    result["stream"].update(mem.summary())
    with PeakMemory() as mem:
        result["train"] = train(str(directory / "corpus"), args.steps, args.preset, directory / "runs")
    result["train"].update(mem.summary())
    # Training reports global tokens/s (both workers); the pipeline's rate is per worker.
    result["ratio"] = result["stream"]["min_tgt_tokens_per_s_per_worker"] / (result["train"]["tgt_tokens_per_s"] / 2)
    return result


def print_table(results: list[dict]) -> None:
    """One row per corpus size, then the memory comparison between the smallest and largest."""
    print(
        "\n| pairs | prepare s | pipeline tok/s/worker | training tok/s/worker | ratio | data wait "
        "| peak private MB: driver / train worker / stream actor / Ray Data task | object-store pages MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        peaks = {
            **r["stream"]["peak_private_mb"],
            **{k: v for k, v in r["train"]["peak_private_mb"].items() if k != "stream_actor"},
        }
        driver = max(r[p]["peak_private_mb"].get("driver", 0) for p in ("prepare", "stream", "train"))
        task = max(r[p]["peak_private_mb"].get("ray_task", 0) for p in ("prepare", "stream", "train"))
        store = max(max(r[p]["peak_store_pages_mb"].values(), default=0) for p in ("prepare", "stream", "train"))
        print(
            f"| {r['pairs']:,} | {r['prepare']['seconds']:.0f} | "
            f"{r['stream']['min_tgt_tokens_per_s_per_worker'] / 1e3:.0f}k | "
            f"{r['train']['tgt_tokens_per_s'] / 2e3:.1f}k | {r['ratio']:.0f}x | "
            f"{100 * r['train']['data_share']:.1f}% | {driver:.0f} / "
            f"{peaks.get('train_worker', 0):.0f} / {peaks.get('stream_actor', 0):.0f} / {task:.0f} | {store:.0f} |"
        )


def isolated(num_pairs: int, args: argparse.Namespace) -> dict:
    """One size in a fresh driver process with its own Ray cluster.

    Python and Arrow keep freed memory for reuse, and Ray reuses its worker processes: in
    one process the second size would inherit the first one's high-water marks.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [
            sys.executable,
            __file__,
            "--sizes",
            str(num_pairs),
            "--steps",
            str(args.steps),
            "--preset",
            args.preset,
            "--vocab-size",
            str(args.vocab_size),
            "--json",
            str(out),
            "--base",
            args.base,
        ]
        if args.work_dir:
            cmd += ["--work-dir", args.work_dir]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())["results"][0]


def in_process(sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """Every size in this process (one size: the isolated run itself)."""
    from raymt.cluster import init_ray

    init_ray(dashboard=True)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="raymt-bench-data-"))
    try:
        return [bench_size(n, args, work) for n in sizes]
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Run every size (each in its own process), print the table, write the JSON."""
    import ray
    import torch

    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = in_process(sizes, args) if len(sizes) == 1 else [isolated(n, args) for n in sizes]
    print_table(results)
    write_results(args.json, results, torch=torch.__version__, ray=ray.__version__)
    return 0


def write_results(path: str, results: list, **versions: str) -> None:
    """The results file: the machine, the versions given, the command line and every size's figures."""
    info = {"machine": platform.platform(), "cpus": os.cpu_count(), **versions, "command": " ".join(sys.argv)}
    Path(path).write_text(json.dumps({"info": info, "results": results}, indent=2))
    print(f"\nfull figures: {path}")


if __name__ == "__main__":
    sys.exit(main())
