"""De-duplication partitioned by hash (issue 70): the same pairs as one pass in input order."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_prepare import write_prefix
from tiny_checkpoint import tokenizer

from raymt.config import CONTENT_RULES, PrepareConfig
from raymt.data import clean, sources

WORDS = "a man woman dog cat runs sits on the red blue street park 3 7".split()


def corpus(num_pairs: int, seed: int = 1) -> list[tuple[str, str, float]]:
    """Pairs with many exact and near duplicates (case, punctuation, digits) and scores with ties
    and unscored lines (NaN)."""
    rng = random.Random(seed)
    rows: list[tuple[str, str, float]] = []
    for _ in range(num_pairs):
        draw = rng.random()
        if rows and draw < 0.2:
            s, t, _ = rng.choice(rows)  # an exact copy, scored anew
        elif rows and draw < 0.4:
            s, t, _ = rng.choice(rows)
            s, t = s.upper() + "!", t.replace("3", "5")  # a near duplicate
        else:
            s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            t = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        rows.append((s, t, rng.choice([math.nan, 0.5, round(rng.random(), 1)])))
    return rows


def sequential(table: pa.Table, ranked: bool) -> tuple[set, Counter]:
    """The single actor's de-duplication before issue 70 (clean.Dedup with best_of_groups): in input
    order, the first pair of each key, or of each near-duplicate group its best-scored; the orders
    of the kept pairs and the counts."""
    rows = sorted(table.select(["h", "nh", "order", *["score"] * ranked]).to_pylist(), key=lambda r: r["order"])
    best: dict = {}
    for r in rows if ranked else ():
        score = -math.inf if math.isnan(r["score"]) else r["score"]
        held = best.get(r["nh"])
        if held is None:
            best[r["nh"]] = (score, r["order"], False)
        elif score > held[0]:
            best[r["nh"]] = (score, r["order"], True)
    best = {nh: order for nh, (_, order, later) in best.items() if later}
    seen, seen_near, kept, counts = set(), set(), set(), Counter()
    for r in rows:
        if r["h"] in seen:
            counts["duplicate"] += 1
        elif r["nh"] in seen_near or best.get(r["nh"], r["order"]) != r["order"]:
            counts["near_duplicate"] += 1
        else:
            seen.add(r["h"])
            seen_near.add(r["nh"])
            kept.add(r["order"])
    return kept, counts


def tokenized(rows: list[tuple[str, str, float]], buckets: int) -> pa.Table:
    """tokenize_block's output of the rows (two inputs, in blocks) with their DEDUP_COLUMNS."""
    off = dict.fromkeys(CONTENT_RULES, False)
    cfg = PrepareConfig(max_chars=200, max_len=50, max_ratio=10.0, near_dedup=True, seed=3, **off)
    proto, half = tokenizer().model_proto, len(rows) // 2
    blocks = []
    for source, part in enumerate((rows[:half], rows[half:])):
        for lo in range(0, len(part), 250):
            chunk = part[lo : lo + 250]
            table = pa.table(
                {
                    "src": [s for s, _, _ in chunk],
                    "tgt": [t for _, t, _ in chunk],
                    "source": pa.array([source] * len(chunk), pa.int32()),
                    "line": pa.array(range(lo + 1, lo + len(chunk) + 1), pa.int64()),
                    "below": [False] * len(chunk),
                    "score": [x for _, _, x in chunk],
                }
            )
            blocks.append(clean.tokenize_block(table, proto, cfg, clean.Tally(), buckets=buckets))
    return pa.concat_tables(blocks)


@pytest.mark.parametrize("ranked", [False, True], ids=["first", "best-scored"])
def test_buckets_keep_the_pairs_that_one_pass_in_input_order_keeps(ranked):
    """Bucket by bucket in a shuffled order, `deduplicate` keeps the set of pairs and counts that
    the single actor kept and counted, with and without scores."""
    table = tokenized(corpus(3000), buckets=7)
    if not ranked:
        table = table.drop_columns(["score"])
    expected, counts = sequential(table, ranked)
    assert counts["duplicate"] > 200 and counts["near_duplicate"] > 300  # the corpus is what it says
    order = table.column("order").to_pylist()
    # Each row's target ids: its index, to find it when kept (the source's count its tokens).
    table = table.set_column(1, "tgt_ids", pa.array([[i] for i in range(len(table))], pa.list_(pa.int32())))
    tally, kept = clean.Tally(), []
    shuffled = table.take(pa.array(random.Random(2).sample(range(len(table)), len(table))))
    bucket = shuffled.column("bucket").to_numpy()
    for b in range(7):
        out = clean.deduplicate(shuffled.filter(pa.array(bucket == b)), tally)
        kept += [order[i] for (i,) in out.column("tgt_ids").to_pylist()]
    assert set(kept) == expected and len(kept) == len(expected) < len(order)
    totals = tally.total()
    assert {k: totals[k] for k in ("duplicate", "near_duplicate")} == dict(counts)


def test_partitions_grow_with_the_corpus():
    assert clean.dedup_partitions(0) == (1, 1)
    assert clean.dedup_partitions(clean.PARTITION_PAIRS) == (1, 1)  # one bucket: input order
    parts, buckets = clean.dedup_partitions(10 * clean.PARTITION_PAIRS + 1)
    assert (parts, buckets) == (11, 11 * clean.BUCKETS_PER_PARTITION)


def kept_rows(out: Path) -> tuple[list, dict]:
    """The prepared corpus's rows (sorted) and its train entry's counts."""
    rows = sorted(map(repr, pq.read_table(out / "train" / "en-de").to_pylist()))
    train = json.loads((out / "manifest.json").read_text())["corpora"][0]["train"]
    return rows, {k: train[k] for k in ("num_pairs", "src_tokens", "tgt_tokens", "dropped")}


# The Ray Data side runs on a local cluster of 3 nodes, in a driver of its own that records the
# node of every bucket's call (this process's Ray is the session's head).
RAY_SIDE = """
import json, sys
import ray
from raymt.data import clean, shards
from raymt.data.__main__ import main

clean.PARTITION_PAIRS = 400
shards.DRIVER_PAIRS = shards.DRIVER_BYTES = 0
log = sys.argv[1]

def recorded(table, tally):
    with open(log, "a") as f:
        f.write(json.dumps([ray.get_runtime_context().get_node_id(), table.column("bucket")[0].as_py()]) + "\\n")
    return clean.deduplicate(table, tally)

shards.deduplicate = recorded
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_partitions_spread_over_nodes_and_keep_the_same_pairs(tmp_path, monkeypatch):
    """On a local 3-node cluster, Ray Data's shuffle runs the buckets' calls on several nodes, and
    the corpus holds the pairs (and counts) of the driver's bucket-by-bucket pass."""
    from ray.cluster_utils import Cluster

    rows = corpus(4000, seed=5)
    train = write_prefix(tmp_path / "train", [(s, t) for s, t, _ in rows])
    valid = write_prefix(tmp_path / "valid", [(s, t) for s, t, _ in rows[:20]])
    flags = ["--train", train, "--valid", valid, "--vocab-size", "64", "--near-dedup", "--dedup"]
    flags += ["--no-number-mismatch", "--no-repeats", "--no-copy", "--no-alpha-ratio", "--max-ratio", "10"]
    monkeypatch.setattr(clean, "PARTITION_PAIRS", 400)  # 10 partitions of 8 buckets
    from raymt.data.__main__ import main

    assert main(["prepare", "--out", str(tmp_path / "here"), *flags]) == 0
    here = kept_rows(tmp_path / "here")
    assert here[1]["dropped"]["duplicate"] > 300 and here[1]["dropped"]["near_duplicate"] > 300

    monkeypatch.setenv("RAY_raylet_start_wait_time_s", "300")  # a busy machine starts nodes slowly
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        log = tmp_path / "buckets.jsonl"
        script = tmp_path / "ray_side.py"
        script.write_text(textwrap.dedent(RAY_SIDE))
        env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONPATH=str(Path(clean.__file__).parents[2]))
        cmd = [sys.executable, str(script), str(log), "prepare", "--out", str(tmp_path / "ray"), *flags]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        cluster.shutdown()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted({b for _, b in calls}) == list(range(80))  # every bucket once (no retry here)
    assert len({node for node, _ in calls}) >= 2  # spread over nodes
    assert kept_rows(tmp_path / "ray") == here


def test_inputs_of_a_given_tokenizer_are_estimated_from_their_sizes(tmp_path):
    """Without pass 1 (a given tokenizer), a corpus's size for its partitions comes from its bytes."""
    from raymt.data import shards

    prefix = write_prefix(tmp_path / "t", [("a b c", "d e f")] * 400)
    spec = sources.task_spec(sources.source_from_spec(prefix, PrepareConfig()), PrepareConfig())
    pairs = {"kind": "pairs", "pairs": (["x"] * 7, ["y"] * 7), "paths": ()}
    assert shards._estimated_pairs([spec, pairs]) == 2 * 400 * 6 // shards.BYTES_PER_PAIR + 7
