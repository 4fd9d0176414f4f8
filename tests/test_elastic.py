"""Elastic training on a local three-node Ray cluster: a run of 2 workers loses a node and
goes on with 1, then grows back to 2 when a node returns; every pair of every epoch,
the resized ones included, is trained exactly once."""

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raymt.compare import pairs_per_epoch, trained_pairs
from raymt.data import format as corpus_format
from raymt.data.stream import flat, pair_hashes
from raymt.rundir import RunDir

pytestmark = pytest.mark.slow

STEPS = 400


def traced_pairs(run_dir: Path) -> Counter:
    """(epoch, digest) counts of the pairs that count: for each step, the lines of the last
    worker group (attempt) that trained it, every rank of that group."""
    pairs = trained_pairs(run_dir)
    assert sorted({step for _, step in pairs}) == list(range(1, STEPS + 1))
    return pairs_per_epoch(pairs)


def corpus_pairs(run_dir: Path, max_len: int) -> Counter:
    """Digest counts of the run's prepared training pairs (those within data.max_len)."""
    corpus = str(run_dir / "corpus")
    out = Counter()
    for path, _, _ in corpus_format.open_corpus(corpus).shards():
        table = pq.read_table(path)
        src, tgt = flat(table.column("src_ids")), flat(table.column("tgt_ids"))
        lens = [(src[1][i + 1] - src[1][i], tgt[1][i + 1] - tgt[1][i]) for i in range(table.num_rows)]
        out.update(pair_hashes(src, tgt, [i for i, (s, t) in enumerate(lens) if 0 < s <= max_len and 0 < t <= max_len]))
    return out


def wait_for(condition, what: str, proc, log_tail, timeout: float = 300) -> None:
    """Poll `condition` until true; fail naming `what` if the run ends or time runs out first."""
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {log_tail()}"
        assert time.time() < deadline, f"timed out waiting for {what}: {log_tail()}"
        time.sleep(0.5)


@pytest.mark.timeout(1200)
def test_a_run_shrinks_after_a_lost_node_and_grows_back(tmp_path):
    from ray.cluster_utils import Cluster

    # Driver and Train controller on the head, whose one CPU serves Ray Data's tasks there;
    # a worker takes 2 CPUs, so one fits on each 2-CPU node and none on the head. Fast health
    # checks: a lost node is declared dead in seconds.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
        },
    )
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    log = tmp_path / "train.log"
    run_dir = tmp_path / "elastic"
    tail = lambda: log.read_text()[-3000:]  # noqa: E731
    cmd = [
        sys.executable,
        "-m",
        "raymt.train",
        "--storage-path",
        str(tmp_path),
        "--name",
        "elastic",
        "--preset",
        "tiny",
        "--num-workers",
        "2",
        "--max-steps",
        str(STEPS),
        "--set",
        "train.min_workers=1",
        "--set",
        "train.resize_interval_s=2",
        "--set",
        "train.max_failures=3",
        "--set",
        "train.cpus_per_worker=2",
        "--set",
        "train.eval_every=10",
        "--set",
        "train.log_every=10",
        "--set",
        "train.num_to_keep=2",
        "--set",
        "train.trace_data=true",
        "--set",
        "model.dropout=0.1",
        "--set",
        "data.vocab_size=256",
        "--set",
        "data.builtin_train_size=1200",
        "--set",
        "data.builtin_eval_size=20",
        "--set",
        "data.max_tokens=256",
    ]
    try:
        with log.open("w") as sink:
            proc = subprocess.Popen(
                cmd,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # A group of 2 that cannot start (the lost node's CPUs still
                # counted) gives up in 15 s, not 60, and restarts smaller.
                env=dict(os.environ, RAY_ADDRESS=cluster.address, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="15"),
            )
            wait_for(lambda: RunDir(run_dir).registered_checkpoints() >= 2, "two checkpoints", proc, tail)
            cluster.remove_node(nodes[1], allow_graceful=False)  # the node is lost
            wait_for(lambda: "resized from 2 to 1" in log.read_text(), "the shrink to 1 worker", proc, tail)
            after_shrink = lambda: log.read_text().split("resized from 2 to 1", 1)[1]  # noqa: E731
            wait_for(lambda: "valid loss" in after_shrink(), "a checkpoint of 1 worker", proc, tail)
            cluster.add_node(num_cpus=2)  # a node returns
            proc.wait(timeout=900)
        out = log.read_text()
        assert proc.returncode == 0, out[-4000:]
    finally:
        cluster.shutdown()
    assert "resized from 2 to 1" in out and "resized from 1 to 2" in out, out[-4000:]
    assert "optim.update_freq 1 -> 2" in out  # 1 worker keeps the global batch of 2
    # Each resize resumed from a checkpoint written in the middle of an epoch.
    resizes = re.findall(
        r"resized from (\d) to (\d) workers: the workers share the (\d+) pairs left of epoch "
        r"\d+ \((\d+) trained before",
        out,
    )
    assert [r[:2] for r in resizes] == [("2", "1"), ("1", "2")], resizes
    assert all(int(left) > 0 and int(before) > 0 for _, _, left, before in resizes), resizes
    seen = traced_pairs(run_dir)
    last_epoch = max(e for e, _ in seen)
    assert last_epoch >= 2
    expected = corpus_pairs(run_dir, max_len=200)
    for epoch in range(last_epoch):  # every finished epoch: each pair exactly once
        got = Counter({d: n for (e, d), n in seen.items() if e == epoch})
        assert got == expected, (
            f"epoch {epoch}: {sum((got - expected).values())} extra, {sum((expected - got).values())} missing"
        )
