"""Memory of Ray Data's read tasks while two workers stream an epoch, against corpus size.

Synthetic shards (100k pairs each, random ids, 5-40 tokens per side) are written at run
time for each size; two Ray tasks shaped like training workers read their epoch slices
through `raymt.data.stream.read_plan`. A sampler records the peak private memory of every
Ray process, with the object store's shared pages apart (see bench_data.private_mb).
Each size runs in a fresh process and Ray cluster with a fixed object store, so the
store's pages are capped by `--object-store-mb` and the process heaps show what grows.

    python benchmarks/bench_read_memory.py [--sizes 500000,2000000,4000000] [--object-store-mb 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="500000,2000000,4000000", help="comma-separated corpus sizes (pairs)")
    p.add_argument("--object-store-mb", type=int, default=300)
    p.add_argument("--block-mb", type=int, help="Ray Data's target block size (default: raymt's)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def write_shards(num_pairs: int, directory: Path) -> list[tuple[str, int]]:
    """Parquet shards of random pairs in raymt's layout; returns (path, pairs) per shard."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    files = []
    for i, start in enumerate(range(0, num_pairs, 100_000)):
        n = min(100_000, num_pairs - start)
        columns = {}
        for name in ("src_ids", "tgt_ids"):
            offsets = np.concatenate([[0], np.cumsum(rng.integers(5, 40, n))]).astype(np.int32)
            values = rng.integers(4, 8000, offsets[-1]).astype(np.int32)
            columns[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        path = directory / f"part-{i:05d}.parquet"
        pq.write_table(pa.table(columns), path)
        files.append((str(path), n))
    return files


def one_size(num_pairs: int, args: argparse.Namespace) -> dict:
    """Stream one epoch over 2 tasks in this process's own Ray cluster; peaks per role."""
    import ray

    from bench_data import PeakMemory

    with tempfile.TemporaryDirectory() as tmp:
        files = write_shards(num_pairs, Path(tmp))
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=args.object_store_mb << 20,
                 runtime_env={"env_vars": {"RAY_DATA_LOG_LEVEL": "WARNING"}})
        block_mb = args.block_mb

        @ray.remote(num_cpus=0.5)
        def read_slice(rank: int) -> int:
            from raymt.data import stream

            if block_mb:
                stream.MAX_BLOCK_BYTES = block_mb << 20
            return sum(len(t) for t in stream.read_plan(stream.epoch_slice(files, 1, 0, rank, 2)))

        with PeakMemory() as mem:
            t0 = time.perf_counter()
            rows = sum(ray.get([read_slice.remote(rank) for rank in range(2)]))
            seconds = time.perf_counter() - t0
        ray.shutdown()
    assert rows == num_pairs, f"read {rows} of {num_pairs} pairs"
    return {"pairs": num_pairs, "seconds": seconds, **mem.summary()}


def main(argv: Optional[list[str]] = None) -> int:
    """Each size in a fresh process; then the table."""
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if len(sizes) == 1:
        print(json.dumps(one_size(sizes[0], args)))
        return 0
    results = []
    for n in sizes:
        cmd = [sys.executable, __file__, "--sizes", str(n), "--object-store-mb", str(args.object_store_mb)]
        if args.block_mb:
            cmd += ["--block-mb", str(args.block_mb)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"\nobject store {args.object_store_mb} MB, blocks {args.block_mb or 'raymt default'} MB")
    print("| pairs | seconds | peak private MB: Ray Data task / stream task / driver | object-store pages MB |")
    print("|---|---|---|---|")
    for r in results:
        peaks, store = r["peak_private_mb"], max(r["peak_store_pages_mb"].values(), default=0)
        # the reading tasks are plain Ray tasks (ray::read_slice), Ray Data's are the rest
        tasks = {t: v for t, v in r["peak_private_mb_by_process"].items() if t.startswith("ray::")}
        reader = max((v for t, v in tasks.items() if "read_slice" in t), default=0)
        data = max((v for t, v in tasks.items() if "read_slice" not in t), default=0)
        print(f"| {r['pairs']:,} | {r['seconds']:.1f} | {data:.0f} / {reader:.0f} / {peaks.get('driver', 0):.0f} "
              f"| {store:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
