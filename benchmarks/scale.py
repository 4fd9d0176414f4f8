"""Prepare at scale: a generated corpus of N pairs with known duplicates and noise (issue 70).

For each size (in a fresh driver process and Ray cluster, one after the other) this benchmark
1. generates a deterministic corpus of N pairs as gzipped text files of `--pairs-per-file`
   pairs each, outside the repository: every pair joins two base pairs (Multi30k's training
   pairs and the built-in corpus's), distinct by construction; `EXACT` of the pairs repeat an
   earlier pair verbatim, `NEAR` an earlier pair but for case and punctuation, `NOISE` carry
   one defect that a default rule or language ID drops (see `noisy`);
2. prepares it as a user would with `raymt data prepare --wrong-language --near-dedup`
   (default rules, language ID, near-duplicates; `--scores`: with a score per line and
   `--keep-best 1`, so near-duplicate groups keep their best-scored pair);
3. reports wall time, pairs/s per core, the peak private memory of every process (smaps
   Private_* without the object store's pages: `bench_data.PeakMemory`) by Ray process
   title, the input and output bytes, the drop counts and an order-free digest of the kept
   pairs (`kept_digest`), so that two code versions can be checked to keep the same set.

    python benchmarks/scale.py --sizes 100000,400000 --json scale.json [--scores] [--work-dir DIR]

The host's other load shows up in every figure: say what else ran.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_data import PeakMemory, write_results  # noqa: E402

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k" / "train"

# Shares of the generated pairs (the rest are distinct clean pairs).
EXACT, NEAR, NOISE = 0.10, 0.05, 0.05
DIGIT = re.compile(r"\d")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100000,400000", help="comma-separated corpus sizes (pairs)")
    p.add_argument("--pairs-per-file", type=int, default=250_000, help="pairs per generated input file")
    p.add_argument("--base", default=str(MULTI30K), help="Multi30k prefix (PREFIX.en.gz, PREFIX.de.gz)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--scores", action="store_true", help="a score per line, near-duplicates ranked by it")
    p.add_argument("--work-dir", help="where corpora go (default: a temporary directory, removed)")
    p.add_argument("--keep", action="store_true", help="keep the prepared corpora in --work-dir")
    p.add_argument("--json", default="scale.json", help="where to write the results")
    return p.parse_args(argv)


# ---------------------------------------------------------------- corpus


def base_pairs(prefix: str) -> tuple[list[str], list[str]]:
    """Multi30k's training pairs (when PREFIX.en.gz is there) and 20,000 built-in pairs."""
    from raymt.data import builtin, text

    # Built-in pairs without digits: their numbers are written differently on each side (12 PM,
    # 12:00), which number_mismatch would drop once they are not exempt as generated text.
    src, tgt = zip(*[(s, t) for s, t in zip(*builtin.generate(20_000, "en", "de", seed=1)) if not DIGIT.search(s + t)])
    src, tgt = list(src), list(tgt)
    if Path(f"{prefix}.en.gz").is_file():
        m_src, m_tgt = text.read_parallel(prefix, "en", "de")
        src, tgt = m_src + src, m_tgt + tgt
    return src, tgt


def noisy(rng: random.Random, src: str, tgt: str, french: list[str]) -> tuple[str, str]:
    """One defect that a default content rule or language ID drops."""
    kind = rng.randrange(6)
    if kind == 0:
        return src, src  # copy
    if kind == 1:
        return f"{src} 12", f"{tgt} 21"  # number_mismatch
    if kind == 2:
        return f"{src} www.example.org/x{rng.randrange(10**6)}", tgt  # url_mismatch
    if kind == 3:
        return src, " ".join(["#### %% 123 ++"] * 6) + f" {rng.randrange(10**6)}"  # alpha_ratio
    if kind == 4:
        return f"{src} the the the the", tgt  # repeats
    return src, rng.choice(french)  # wrong_language


def near(rng: random.Random, src: str, tgt: str) -> tuple[str, str]:
    """A near-duplicate: the same words and numbers, other case and punctuation."""
    kind = rng.randrange(3)
    if kind == 0:
        return src.upper(), tgt.upper()
    if kind == 1:
        return src.lower().rstrip("."), tgt.lower().rstrip(".")
    return src.rstrip(".") + " !", tgt.rstrip(".") + " !"


def generate_pairs(num_pairs: int, base: str, seed: int = 1):
    """The corpus's pairs in order, deterministic for a seed and base; (src, tgt, score) per pair."""
    from raymt.data import builtin

    src, tgt = base_pairs(base)
    french, _ = builtin.generate(2_000, "fr", "en", seed=2)
    rng = random.Random(seed)
    m = len(src)
    order = list(range(m))
    rng.shuffle(order)
    step = 7919 % m or 1
    made: list[tuple[str, str]] = []  # the distinct clean pairs so far, to copy from
    for i in range(num_pairs):
        draw = rng.random()
        if made and draw < EXACT:
            s, t = rng.choice(made)
        elif made and draw < EXACT + NEAR:
            s, t = near(rng, *rng.choice(made))
        else:
            # (i mod m, i div m) is one-to-one below m**2: no two generated pairs join the same two.
            a, b = order[i % m], order[(i // m + step * (i % m)) % m]
            s, t = f"{src[a]} {src[b]}", f"{tgt[a]} {tgt[b]}"
            if draw < EXACT + NEAR + NOISE:
                s, t = noisy(rng, s, t, french)
            else:
                made.append((s, t))
        yield s, t, rng.random()


def make_corpus(num_pairs: int, directory: Path, base: str, per_file: int, with_scores: bool) -> list[str]:
    """Write the corpus as gzipped PREFIX.en.gz/PREFIX.de.gz files of `per_file` pairs; their prefixes."""
    from raymt.data import scores

    prefixes, rows = [], generate_pairs(num_pairs, base)
    for k, start in enumerate(range(0, num_pairs, per_file)):
        prefix = str(directory / f"gen-{k:03d}")
        part = [next(rows) for _ in range(min(per_file, num_pairs - start))]
        for lang, col in (("en", 0), ("de", 1)):
            with gzip.open(f"{prefix}.{lang}.gz", "wt", compresslevel=1) as f:
                f.write("".join(row[col].replace("\n", " ") + "\n" for row in part))
        if with_scores:
            scores.write_given(prefix, [row[2] for row in part], ("en", "de"))
        prefixes.append(prefix)
    return prefixes


def make_valid(directory: Path, base: str, num_pairs: int = 500) -> str:
    """A small validation set (every 50th base pair) as gzipped text; its prefix."""
    src, tgt = base_pairs(base)
    prefix = str(directory / "valid")
    for lang, side in (("en", src), ("de", tgt)):
        with gzip.open(f"{prefix}.{lang}.gz", "wt") as f:
            f.write("".join(text + "\n" for text in side[::50][:num_pairs]))
    return prefix


# ---------------------------------------------------------------- prepare


def prepare(prefixes: list[str], valid: str, out: Path, args: argparse.Namespace) -> dict:
    """`raymt data prepare` of the corpus: its exit status and seconds."""
    from raymt.data.__main__ import main as data_main

    argv = ["prepare", "--out", str(out), "--vocab-size", str(args.vocab_size), "--valid", valid]
    for prefix in prefixes:
        argv += ["--train", prefix]
    argv += ["--wrong-language", "--near-dedup"] + (["--keep-best", "1"] if args.scores else [])
    t0 = time.perf_counter()
    status = data_main(argv)
    return {"status": status, "seconds": time.perf_counter() - t0, "argv": argv}


def kept_digest(corpus: Path) -> str:
    """sha256 of the kept pairs' token ids, sorted: the same for the same set in any order."""
    import pyarrow.parquet as pq

    rows = []
    for path in sorted((corpus / "train").rglob("*.parquet")):
        table = pq.read_table(path)
        for s, t in zip(table.column("src_ids").to_pylist(), table.column("tgt_ids").to_pylist()):
            rows.append(hashlib.blake2b(repr((s, t)).encode(), digest_size=16).digest())
    return hashlib.sha256(b"".join(sorted(rows))).hexdigest()


def du(path: Path) -> int:
    """Bytes of the files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_size(num_pairs: int, args: argparse.Namespace, work: Path) -> dict:
    """Generate and prepare one size."""
    directory = work / f"pairs-{num_pairs}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    t0 = time.perf_counter()
    prefixes = make_corpus(num_pairs, directory, args.base, args.pairs_per_file, args.scores)
    valid = make_valid(directory, args.base)
    result: dict = {"pairs": num_pairs, "generate_s": time.perf_counter() - t0, "input_bytes": du(directory)}
    with PeakMemory() as mem:
        prepared = prepare(prefixes, valid, directory / "corpus", args)
    assert prepared["status"] == 0, prepared
    manifest = json.loads((directory / "corpus" / "manifest.json").read_text())
    split = manifest["corpora"][0]["train"]
    import ray

    cores = ray.cluster_resources().get("CPU", os.cpu_count()) if ray.is_initialized() else os.cpu_count()
    result.update(
        seconds=prepared["seconds"],
        cores=cores,
        pairs_per_s_per_core=num_pairs / prepared["seconds"] / cores,
        kept_pairs=split["num_pairs"],
        dropped={rule: n for rule, n in split["dropped"].items() if n},
        shards=len(split["files"]),
        output_bytes=du(directory / "corpus"),
        kept_digest=kept_digest(directory / "corpus"),
        argv=prepared["argv"],
        **mem.summary(),
    )
    if not args.keep:
        shutil.rmtree(directory, ignore_errors=True)
    return result


def isolated(num_pairs: int, args: argparse.Namespace) -> dict:
    """One size in a fresh driver process with its own Ray cluster (Python, Arrow and Ray's reused
    workers keep their high-water marks: a second size in one process would inherit them)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, __file__, "--sizes", str(num_pairs), "--json", str(out)]
        cmd += ["--pairs-per-file", str(args.pairs_per_file), "--base", args.base, "--vocab-size", str(args.vocab_size)]
        cmd += ["--scores"] * args.scores + ["--keep"] * args.keep
        cmd += ["--work-dir", args.work_dir] if args.work_dir else []
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())["results"][0]


def in_process(sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """Every size in this process (one size: the isolated run itself)."""
    from raymt.cluster import init_ray

    init_ray()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="raymt-scale-"))
    try:
        return [bench_size(n, args, work) for n in sizes]
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def process_kind(title: str) -> str:
    """A Ray process title as a kind: ray::MapBatches(read_inputs)->... -> read_inputs."""
    for name in ("read_inputs", "tokenize_block", "Dedup", "dedup", "Write", "Tally", "IDLE"):
        if name in title:
            return name
    return title


def print_table(results: list[dict]) -> None:
    """One row per size: rates, then the peak private MB of each kind of process."""
    kinds: dict[str, None] = {}
    for r in results:
        for title in r["peak_private_mb_by_process"]:
            kinds.setdefault(process_kind(title))
    print("\n| pairs | s | pairs/s/core | kept | in MB | out MB | " + " | ".join(kinds) + " |")
    print("|---" * (6 + len(kinds)) + "|")
    for r in results:
        peaks: dict[str, float] = {}
        for title, mb in r["peak_private_mb_by_process"].items():
            peaks[process_kind(title)] = max(peaks.get(process_kind(title), 0.0), mb)
        print(
            f"| {r['pairs']:,} | {r['seconds']:.0f} | {r['pairs_per_s_per_core']:,.0f} | {r['kept_pairs']:,} | "
            f"{r['input_bytes'] / 2**20:.0f} | {r['output_bytes'] / 2**20:.0f} | "
            + " | ".join(f"{peaks.get(k, 0):.0f}" for k in kinds)
            + " |"
        )


def main(argv: Optional[list[str]] = None) -> int:
    """Run every size (each in its own process), print the table, write the JSON."""
    import ray

    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = in_process(sizes, args) if len(sizes) == 1 else [isolated(n, args) for n in sizes]
    print_table(results)
    write_results(args.json, results, ray=ray.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
