"""The training feed of one worker: target tokens per second that a `TrainStream` hands out
after start-up, on one core, at 32k-token batches, over several epochs (epoch boundaries
included), on Multi30k and on a generated 2M-pair corpus, for each order of reading the
shards (data.shuffle_block_rows: 0, every shard whole and in order, and 1024-row blocks in an
order of each epoch's), measured in turns and side by side.

    python benchmarks/feed.py [--multi30k DIR] [--pairs 2000000] [--corpus DIR] [--epochs 3]
                              [--block-rows 0,1024] [--repeats 2]

Multi30k is tokenized with a SentencePiece model trained on it and written in the prepared
format (raymt.data.format) without Ray, as is the generated corpus (random ids, Multi30k-like
lengths); both are cached under --work-dir. The stream reads the shards as in training.
The last line is `feed: <N> target tok/s per worker` for the slower corpus, in the order a
run reads by default (DataConfig's data.shuffle_block_rows).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raymt.data import format as corpus_format  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--multi30k",
        default=str(ROOT.parent / "shared" / "data" / "multi30k"),
        help="directory with train.en.gz and train.de.gz",
    )
    p.add_argument("--corpus", help="a prepared corpus to measure instead of the generated one")
    p.add_argument("--pairs", type=int, default=2_000_000, help="pairs of the generated corpus")
    p.add_argument("--work-dir", default="/tmp/raymt-feed", help="where the corpora are cached")
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--epochs", type=int, default=3, help="epochs per corpus (capped by --max-batches)")
    p.add_argument("--max-batches", type=int, default=600, help="batches measured per corpus")
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one core (default: its first)")
    p.add_argument(
        "--block-rows",
        default="0,1024",
        help="data.shuffle_block_rows values to measure, comma-separated (0: shards whole, in order)",
    )
    p.add_argument("--repeats", type=int, default=2, help="turns of every order; each order's best turn is shown")
    return p.parse_args(argv)


def write_corpus(out: Path, src: list, tgt: list, shard_pairs: int, model_proto: bytes = b"") -> str:
    """Write token-id pairs as a prepared corpus (shards, token index, manifest)."""
    (out / corpus_format.TRAIN_DIR).mkdir(parents=True, exist_ok=True)
    files = []
    for i, lo in enumerate(range(0, len(src), shard_pairs)):
        s, t = src[lo : lo + shard_pairs], tgt[lo : lo + shard_pairs]
        rel = f"{corpus_format.TRAIN_DIR}/part-{i:05d}.parquet"
        pq.write_table(pa.table({"src_ids": s, "tgt_ids": t}), out / rel)
        lengths = pa.compute.list_value_length(s).to_numpy() + pa.compute.list_value_length(t).to_numpy()
        files.append({"path": rel, "num_pairs": len(s), "token_index": corpus_format.token_index(lengths)})
    (out / corpus_format.SPM_FILE).write_bytes(model_proto)
    manifest = {
        "format": corpus_format.ONE_PAIR_FORMAT,  # the smallest manifest a reader takes
        "src_lang": "en",
        "tgt_lang": "de",
        "sp_model_sha256": hashlib.sha256(model_proto).hexdigest(),
        "splits": {"train": {"files": files, "num_pairs": len(src)}, "valid": {}, "test": {}},
    }
    (out / corpus_format.MANIFEST_FILE).write_text(json.dumps(manifest))
    return str(out)


def ragged(lengths: np.ndarray, rng: np.random.Generator, vocab: int = 8000) -> pa.Array:
    """A list<int32> column of random ids with the given row lengths."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(4, vocab, int(offsets[-1]), dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def multi30k_corpus(args: argparse.Namespace) -> str:
    """Multi30k en-de train, SentencePiece-tokenized, as a prepared corpus (cached)."""
    out = Path(args.work_dir) / "multi30k"
    if (out / corpus_format.MANIFEST_FILE).is_file():
        return str(out)
    from raymt.data.text import read_parallel
    from raymt.tokenizer import train_tokenizer

    src, tgt = read_parallel(f"{args.multi30k}/train", "en", "de")
    tokenizer = train_tokenizer(src[:10000] + tgt[:10000], 8000, "unigram", sample_size=20000, seed=1)
    ids = [pa.array(tokenizer.encode_batch(x), pa.list_(pa.int32())) for x in (src, tgt)]
    return write_corpus(out, *ids, shard_pairs=100_000, model_proto=tokenizer.model_proto)


def generated_corpus(args: argparse.Namespace) -> str:
    """`--pairs` pairs of random ids with Multi30k-like lengths (mean ~14 tokens), cached."""
    out = Path(args.work_dir) / f"generated-{args.pairs}"
    if (out / corpus_format.MANIFEST_FILE).is_file():
        return str(out)
    rng = np.random.default_rng(0)
    src_lens = np.clip(rng.normal(14, 5, args.pairs).round(), 2, 60).astype(np.int64)
    tgt_lens = np.clip((src_lens * rng.uniform(0.8, 1.3, args.pairs)).round(), 2, 60).astype(np.int64)
    return write_corpus(out, ragged(src_lens, rng), ragged(tgt_lens, rng), shard_pairs=100_000)


def feed(corpus: str, args: argparse.Namespace, block_rows: int) -> tuple:
    """The corpus's shards as a one-pair run reads them in blocks of `block_rows`, and the data config."""
    from raymt.config import DataConfig
    from raymt.data.epoch import Mix

    files = Mix.of_shards(corpus_format.open_corpus(corpus).shards(), block_rows)
    return files, DataConfig(max_tokens=args.max_tokens, shuffle_block_rows=block_rows)


def measure(corpus: str, args: argparse.Namespace, block_rows: int) -> dict:
    """Target tokens per second of one worker's stream from its first batch on, over epochs."""
    from raymt.data.epoch import Position
    from raymt.data.stream import TrainStream

    files, cfg = feed(corpus, args, block_rows)
    stream = TrainStream(files, cfg, seed=1, rank=0, world_size=1, position=Position(0), num_epochs=args.epochs).start()
    t_start = time.perf_counter()
    tokens = batches = 0
    boundaries, epoch, t0 = [], 0, None
    for batch in stream:
        if t0 is None:  # start-up ends with the first batch
            t0, first_s = time.perf_counter(), time.perf_counter() - t_start
            cpu0 = time.process_time()
            continue
        if stream.position.epoch != epoch:
            boundaries.append(time.perf_counter() - t0)
            epoch = stream.position.epoch
        tokens += batch.num_tokens
        batches += 1
        if batches >= args.max_batches:
            break
    seconds = time.perf_counter() - t0
    stream.close()
    return {
        "corpus": corpus,
        "first_batch_s": round(first_s, 2),
        "batches": batches,
        "epochs_seen": epoch + 1,
        "tgt_tokens": tokens,
        "seconds": round(seconds, 2),
        "cpu_s": round(time.process_time() - cpu0, 2),
        "tok_per_s": tokens / seconds,
    }


def read_cpu(corpus: str, args: argparse.Namespace, block_rows: int) -> float:
    """CPU seconds to read one worker's whole epoch 1 into its chunks' id columns (`read_plan`,
    `chunks`, `flat`: the reader alone, without cutting or collating batches)."""
    from raymt.data.epoch import epoch_slice
    from raymt.data.stream import chunks, flat, read_plan

    files, cfg = feed(corpus, args, block_rows)
    t0 = time.process_time()
    for table in chunks(read_plan(epoch_slice(files, 1, 1, 0, 1), files.corpus_of), cfg.shuffle_buffer_rows):
        flat(table.column("src_ids")), flat(table.column("tgt_ids"))
    return time.process_time() - t0


def boundary_waits(corpus: str, args: argparse.Namespace, continuous: bool, block_rows: int) -> list[float]:
    """Seconds the consumer waited for each epoch's first batch (after the first epoch), with
    one stream over the epochs or, as the training loop does it, one stream per epoch whose
    next one starts after the current epoch's first batch."""
    from raymt.data.epoch import Position
    from raymt.data.stream import TrainStream

    files, cfg = feed(corpus, args, block_rows)
    open_stream = lambda epoch, n=1: TrainStream(files, cfg, 1, 0, 1, Position(epoch), num_epochs=n)
    waits, t = [], time.perf_counter()
    if continuous:
        stream, epoch = open_stream(0, args.epochs).start(), 0
        for _ in stream:
            if stream.position.epoch != epoch:
                waits.append(time.perf_counter() - t)
                epoch = stream.position.epoch
            t = time.perf_counter()
        return waits
    stream = open_stream(0).start()
    for epoch in range(args.epochs):
        upcoming = open_stream(epoch + 1)
        for i, _ in enumerate(stream):
            if i == 0 and epoch:
                waits.append(time.perf_counter() - t)
            upcoming.start()
            t = time.perf_counter()
        stream.close()
        stream = upcoming
    stream.close()
    return waits


def main(argv=None) -> None:
    """Prepare (or reuse) both corpora, then measure each in every order on one core."""
    args = parse_args(argv)
    import torch

    from raymt.config import DataConfig

    torch.set_num_threads(1)
    orders = [int(b) for b in args.block_rows.split(",")]
    default = DataConfig().shuffle_block_rows
    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    corpora = {"multi30k": multi30k_corpus(args), "generated": args.corpus or generated_corpus(args)}
    os.sched_setaffinity(0, {cpu})  # this process (the worker's side of the feed) on one core
    for block_rows in orders:
        for continuous in (False, True):
            waits = boundary_waits(corpora["multi30k"], args, continuous, block_rows)
            print(
                f"multi30k epoch-start waits, blocks {block_rows}, "
                f"{'one stream over epochs' if continuous else 'a stream per epoch'}: "
                + ", ".join(f"{w:.3f}" for w in waits)
                + " s"
            )
    best: dict = {}  # (corpus, block rows) -> the measure of its fastest turn
    read_s: dict = {}  # (corpus, block rows) -> its fewest CPU seconds to read an epoch
    for _ in range(args.repeats):  # the orders in turns: a busy machine slows each alike
        for name, path in corpora.items():
            for b in orders:
                r, key = measure(path, args, b), (name, b)
                best[key] = max(best.get(key, r), r, key=lambda x: x["tok_per_s"])
                read_s[key] = min(read_s.get(key, float("inf")), read_cpu(path, args, b))
    for (name, block_rows), r in best.items():
        print(
            f"{name:>10}, blocks {block_rows:>5}: {r['tok_per_s']:>12,.0f} target tok/s  ({r['tgt_tokens']:,} "
            f"tokens in {r['seconds']} s, {r['batches']} batches, {r['epochs_seen']} epoch(s), process CPU "
            f"{r['cpu_s']} s, first batch after {r['first_batch_s']} s)"
        )
    for name in corpora:
        print(f"{name:>10}: " + " | ".join(f"blocks {b}: {best[name, b]['tok_per_s']:,.0f}" for b in orders))
        print(
            f"{name:>10}: CPU s to read an epoch (reader alone, best turn): "
            + " | ".join(f"blocks {b}: {read_s[name, b]:.2f}" for b in orders)
        )
    shown = default if default in orders else orders[-1]
    slowest = min(best[name, shown]["tok_per_s"] for name in corpora)
    print(f"feed: {slowest:.0f} target tok/s per worker")


if __name__ == "__main__":
    main()
