"""Batches and tokens each worker's epoch slice holds, cut by pairs and cut by tokens.

    python benchmarks/epoch_balance.py --corpus DIR [--workers 2] [--epochs 2]

Iterates every worker's `TrainStream` over a prepared corpus twice: once with the shards'
token index dropped (slices of equal numbers of pairs, raymt's cut before the index) and
once as raymt cuts now (equal numbers of tokens). A worker with fewer batches takes
zero-weighted steps while the others finish their epoch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="a prepared corpus (python -m raymt.data prepare)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    return p.parse_args(argv)


def count(files: list, workers: int, epoch: int) -> list[tuple[int, int]]:
    """(batches, target tokens) of each worker's epoch."""
    from raymt.config import DataConfig
    from raymt.data.stream import Position, TrainStream

    out = []
    for rank in range(workers):
        stream = TrainStream(files, DataConfig(), 1, rank, workers, Position(epoch))
        batches = tokens = 0
        for batch in stream:
            batches, tokens = batches + 1, tokens + batch.num_tokens
        stream.close()
        out.append((batches, tokens))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Print each worker's batches and target tokens per epoch under both cuts."""
    import ray

    from raymt.data import format as corpus_format
    from raymt.data.format import Shard

    args = parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_DATA_LOG_LEVEL": "WARNING"}})
    files = corpus_format.train_files(args.corpus, corpus_format.read_manifest(args.corpus))
    if not all(f.token_index for f in files):
        raise SystemExit(f"{args.corpus} has no token index: prepare it with this version of raymt")
    by_pairs = [Shard(f.path, f.num_pairs) for f in files]
    print("| cut | epoch | " + " | ".join(f"rank {r}: batches, tgt tokens" for r in range(args.workers)) + " |")
    print("|---|---|" + "---|" * args.workers)
    for name, cut in (("equal pairs", by_pairs), ("equal tokens", files)):
        for epoch in range(args.epochs):
            cells = " | ".join(f"{b}, {t:,}" for b, t in count(cut, args.workers, epoch))
            print(f"| {name} | {epoch} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
