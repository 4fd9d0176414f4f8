"""Per-epoch shuffling inside shards (data.shuffle_block_rows): each epoch reads a shard's blocks
in an order of its own, so the chunks batches are cut from hold other pairs every epoch (a
corpus of one shard too), while every pair is still read once per epoch, a killed stream
resumes exactly, a resized group trains every pair once, the mix's schedule is unchanged and
each row group is decoded once; runs and checkpoints without the field keep the old order."""

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_stream import batch_pairs, take

from raymt.checkpoint import TrainState, saved_batching
from raymt.config import Config, DataConfig
from raymt.data import stream as stream_module
from raymt.data.epoch import (
    Mix,
    Position,
    batching_record,
    epoch_reads,
    epoch_slice,
    restore_position,
)
from raymt.data.format import Shard, TrainingCorpus, token_index
from raymt.data.stream import TrainStream, read_plan, resume_point
from raymt.worker_data import EpochFeed, batching_changes

SEED = 3
BLOCK = 64  # rows of a block in the stream tests (1024 in a run: DataConfig's default)
CFG = dict(max_tokens=96, max_len=12, window_rows=64, shuffle_buffer_rows=256)


def write_shards(tmp_path, sizes, seed=0, row_group=97) -> tuple[list[Shard], list[tuple]]:
    """Token-indexed shards of unique pairs (every one kept at max_len 12), row groups of
    `row_group` rows; the shards and every pair as (src, tgt) tuples."""
    rng, shards, pairs, k = np.random.default_rng(seed), [], [], 0
    for i, n in enumerate(sizes):
        src = [
            [4 + (k + j) // 50, 4 + (k + j) % 50] + rng.integers(4, 50, rng.integers(0, 9)).tolist() for j in range(n)
        ]
        tgt = [rng.integers(4, 50, rng.integers(1, 11)).tolist() for _ in range(n)]
        k += n
        path = tmp_path / f"part-{i:05d}.parquet"
        column = lambda rows: pa.array(rows, pa.list_(pa.int32()))  # noqa: E731
        pq.write_table(pa.table({"src_ids": column(src), "tgt_ids": column(tgt)}), path, row_group_size=row_group)
        lengths = np.array([len(s) + len(t) for s, t in zip(src, tgt)], dtype=np.int64)
        shards.append(Shard(str(path), n, tuple(token_index(lengths))))
        pairs += [(tuple(s), tuple(t)) for s, t in zip(src, tgt)]
    return shards, pairs


def stream(files: Mix, rank, world_size, position, num_epochs=1, segment=None, trace=False, **data) -> TrainStream:
    """A worker's stream of `files` at CFG, its blocks as `files` has them."""
    cfg = DataConfig(**{**CFG, "shuffle_block_rows": files.block_rows, **data})
    return TrainStream(files, cfg, SEED, rank, world_size, position, trace, num_epochs=num_epochs, segment=segment)


def overlap(before: list[set], after: list[set]) -> float:
    """How much chunk membership stays: each chunk's largest share of rows found in one chunk of
    the other epoch, weighted by its rows (1.0: the same chunks)."""
    return sum(max(len(c & d) for d in after) for c in before) / sum(len(c) for c in before)


def plan_chunks(mix: Mix, epoch: int, world_size: int, chunk_rows: int) -> list[set]:
    """The rows ((path, row)) of every worker's chunks of `epoch`, as its stream cuts them."""
    out = []
    for rank in range(world_size):
        rows = [(p, i) for p, s, e in epoch_slice(mix, SEED, epoch, rank, world_size) for i in range(s, e)]
        out += [set(rows[k : k + chunk_rows]) for k in range(0, len(rows), chunk_rows)]
    return out


def test_chunks_of_a_one_shard_corpus_hold_other_pairs_every_epoch():
    """A Multi30k-sized corpus of one shard (29,000 pairs) at the defaults (16,384-row chunks,
    1024-row blocks): the same chunks every epoch with whole shards (overlap 1.00), other ones
    with shuffled blocks (overlap below 0.9; 0.55-0.65 measured)."""
    rng = np.random.default_rng(0)
    shard = Shard("s3://b/train/part-00000.parquet", 29_000, tuple(token_index(rng.integers(8, 60, 29_000))))
    cfg = DataConfig()
    assert (cfg.shuffle_block_rows, cfg.shuffle_buffer_rows) == (1024, 16384)
    whole, blocks = Mix.of_shards([shard]), Mix.of_shards([shard], cfg.shuffle_block_rows)
    figures = {}
    for world in (1, 2):
        for a, b in ((0, 1), (0, 5), (1, 5)):
            chunks = lambda mix, e, w=world: plan_chunks(mix, e, w, cfg.shuffle_buffer_rows)  # noqa: E731
            assert overlap(chunks(whole, a), chunks(whole, b)) == 1.0
            figures[world, a, b] = overlap(chunks(blocks, a), chunks(blocks, b))
    print("chunk overlap between epochs with 1024-row blocks (workers, epoch, epoch):", figures)
    assert max(figures.values()) < 0.9, figures


def test_a_streams_chunks_change_and_every_pair_is_read_once_an_epoch(tmp_path):
    """Read through a stream (its trace), one shard's chunks hold other pairs each epoch with
    blocks and the same ones without; each epoch still hands out every pair once over 2 workers."""
    shards, pairs = write_shards(tmp_path, [3000])

    def chunks(mix: Mix, epoch: int) -> list[set]:
        s, found = stream(mix, 0, 1, Position(epoch), trace=True), {}
        for _ in s:
            found.setdefault(s.position.chunk, set()).update(s.traced)
            s.traced.clear()
        return list(found.values())

    whole, blocks = Mix.of_shards(shards), Mix.of_shards(shards, BLOCK)
    assert overlap(chunks(whole, 0), chunks(whole, 1)) == 1.0
    shuffled = overlap(chunks(blocks, 0), chunks(blocks, 1))
    print(f"chunk overlap between epochs 0 and 1 read by a stream ({BLOCK}-row blocks, 256-row chunks): {shuffled:.2f}")
    assert shuffled < 0.9
    for epoch in (0, 1):
        seen = Counter(p for rank in range(2) for b in stream(blocks, rank, 2, Position(epoch)) for p in batch_pairs(b))
        assert seen == Counter(pairs)


@pytest.mark.parametrize("block_rows", [1, 64, 1000])
def test_each_epoch_plans_every_row_once(block_rows):
    files = [Shard(f"f{i}", n, tuple(token_index(np.full(n, 9)))) for i, n in enumerate([5, 3000, 17, 0, 1200, 64])]
    for data in (files, [Shard(f.path, f.num_pairs) for f in files]):
        mix, orders = Mix.of_shards(data, block_rows), []
        for epoch in (0, 1, 4):
            reads = epoch_reads(mix, SEED, epoch)
            assert all(s % block_rows == 0 for _, s, _ in reads)  # blocks (neighbours joined)
            orders.append(reads)
            for world in (1, 2, 3):
                seen = Counter(
                    (p, i)
                    for r in range(world)
                    for p, s, e in epoch_slice(mix, SEED, epoch, r, world)
                    for i in range(s, e)
                )
                assert seen == Counter((f.path, i) for f in data for i in range(f.num_pairs))
        assert orders[0] != orders[1] != orders[2]
    # The blocks' order does not touch the shards' (the runs before it).
    firsts = lambda mix: list(dict.fromkeys(p for p, _, _ in epoch_reads(mix, SEED, 2)))  # noqa: E731
    assert firsts(Mix.of_shards(files, block_rows)) == firsts(Mix.of_shards(files))


def test_a_mix_keeps_its_schedule_and_each_corpus_epoch_reads_every_row_once():
    """Mixed by temperature with shuffled blocks: every stretch of the schedule takes the same
    corpus as without (the mix per piece), each corpus's rows per epoch are r_i, and its stream
    reads every row once per corpus epoch."""
    corpora = [
        [Shard(f"train/{name}/part-{k:05d}.parquet", n) for k, n in enumerate(sizes)]
        for name, sizes in {"en-de": [300, 140], "en-fr": [70], "de-en": [45, 20]}.items()
    ]
    whole = Mix.by_temperature(corpora, 5.0, piece_rows=16)
    blocks = Mix.by_temperature(corpora, 5.0, piece_rows=16, block_rows=24)
    streams: list[list] = [[] for _ in corpora]
    for epoch in range(6):
        which = lambda mix, k=epoch: [mix.corpus_of(p) for p, s, e in epoch_reads(mix, 7, k) for _ in range(s, e)]  # noqa: E731
        assert which(blocks) == which(whole)
        counts = Counter(which(blocks))
        assert [counts[i] for i in range(len(corpora))] == list(blocks.rows)
        for p, s, e in epoch_reads(blocks, 7, epoch):
            streams[blocks.corpus_of(p)] += [(p, i) for i in range(s, e)]
    for i, rows in enumerate(streams):
        every = Counter((f.path, r) for f in corpora[i] for r in range(f.num_pairs))
        n = blocks.sizes[i]
        for k in range(len(rows) // n):
            assert Counter(rows[k * n : (k + 1) * n]) == every, (i, k)


@pytest.mark.parametrize("stop_after", [1, 7, 25])
def test_a_killed_shuffled_stream_resumes_exactly(tmp_path, stop_after):
    """Stopped after some batches, its positions saved with the batching record as a checkpoint
    stores them, and resumed: the same batches as an uninterrupted epoch (and two epochs)."""
    shards, _ = write_shards(tmp_path, [700, 300, 450], seed=1)
    files = Mix.of_shards(shards, BLOCK)
    cfg = DataConfig(**CFG, shuffle_block_rows=BLOCK)
    full = [batch_pairs(b) for b in stream(files, 1, 2, Position(4), num_epochs=2)]
    first = stream(files, 1, 2, Position(4), num_epochs=2)
    head = []
    for b in first:
        head.append(batch_pairs(b))
        if len(head) == stop_after:
            break
    first.close()
    path = tmp_path / "state.pt"
    torch.save(
        {"data_positions": [Position(4).to_dict(), first.position.to_dict()], "data_batching": batching_record(cfg)},
        path,
    )
    state = torch.load(path, weights_only=True)
    position, segment = resume_point(files, cfg, SEED, 4, state["data_positions"], None, 1, 2, state["data_batching"])
    assert segment is None and position == restore_position(state["data_positions"], 1, 2, 4)
    tail = [batch_pairs(b) for b in stream(files, 1, 2, position, num_epochs=2)]
    assert head + tail == full


@pytest.mark.parametrize("steps", [(0, 3, 1), (5, 1, 0), (9, 4, 2)])
def test_a_resized_shuffled_epoch_trains_every_pair_once(tmp_path, steps):
    """2 workers take some batches, 3 go on from their checkpoint, then 1 finishes the epoch."""
    shards, pairs = write_shards(tmp_path, [700, 300, 450], seed=4)
    files, cfg = Mix.of_shards(shards, BLOCK), DataConfig(**CFG, shuffle_block_rows=BLOCK)
    seen, state = Counter(), {"data_positions": None, "data_segment": None}
    for world_size, n in zip((2, 3, 1), steps):
        positions, segment = [], None
        for rank in range(world_size):
            position, segment = resume_point(
                files,
                cfg,
                SEED,
                0,
                state["data_positions"],
                state["data_segment"],
                rank,
                world_size,
                batching_record(cfg),
            )
            s = stream(files, rank, world_size, position, segment=segment)
            seen.update(take(s, n) if world_size > 1 else [p for b in s for p in batch_pairs(b)])
            positions.append(s.position.to_dict())
        state = {"data_positions": positions, "data_segment": segment and segment.to_dict()}
    assert seen == Counter(pairs)


@pytest.mark.parametrize("record", [{}, {"shuffle_block_rows": 0}], ids=["without-the-field", "whole"])
def test_a_resume_in_another_order_trains_every_pair_once(tmp_path, record):
    """Positions of a checkpoint that read shards whole (a record without the field: written
    before it existed), resumed with blocks: the epoch's rest is shared as it was read (a
    segment), and the next epoch reads the new order."""
    shards, pairs = write_shards(tmp_path, [700, 300, 450], seed=6)
    whole, blocks = Mix.of_shards(shards), Mix.of_shards(shards, BLOCK)
    before = {k: v for k, v in batching_record(DataConfig(**CFG)).items() if k != "shuffle_block_rows"} | record
    assert saved_batching(before)["shuffle_block_rows"] == 0
    seen, positions = Counter(), []
    for rank in range(2):
        s = stream(whole, rank, 2, Position(0))
        seen.update(take(s, 3))
        positions.append(s.position.to_dict())
    cfg = DataConfig(**CFG, shuffle_block_rows=BLOCK)
    for rank in range(2):
        position, segment = resume_point(blocks, cfg, SEED, 0, positions, None, rank, 2, before)
        assert position == Position(0) and segment.generation == 1
        s = stream(blocks, rank, 2, position, num_epochs=2, segment=segment)
        seen.update(p for b in s for p in batch_pairs(b))
    assert seen == Counter({p: 2 for p in pairs})  # epoch 0 once, epoch 1 once
    # The same order recorded: the saved positions as they are.
    same = resume_point(blocks, cfg, SEED, 0, positions, None, 1, 2, batching_record(cfg))
    assert same == (Position(**positions[1]), None)


def test_a_shuffled_plan_decodes_each_row_group_once(tmp_path, monkeypatch):
    """Blocks in random order over row groups of 97 rows: each worker opens each shard once and
    decodes each row group its slice needs once, not once per block."""
    shards, _ = write_shards(tmp_path, [1500, 400], seed=2)
    files = Mix.of_shards(shards, BLOCK)
    decoded, opened = Counter(), Counter()
    real_read, real_init = pq.ParquetFile.read_row_group, stream_module._OpenShard.__init__

    def read_row_group(self, i, *args, **kwargs):
        decoded[i] += 1
        return real_read(self, i, *args, **kwargs)

    def init(self, path, reads):
        opened[path] += 1
        real_init(self, path, reads)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    monkeypatch.setattr(stream_module._OpenShard, "__init__", init)
    for world in (1, 2):
        for rank in range(world):
            decoded.clear(), opened.clear()
            plan = epoch_slice(files, SEED, 1, rank, world)
            assert len(plan) > 10  # blocks, most not next to the one before
            assert sum(len(t) for t in read_plan(plan, files.corpus_of)) == sum(e - s for _, s, e in plan)
            need = {(p, i // 97) for p, s, e in plan for i in range(s, e)}
            assert sum(decoded.values()) == len(need) and set(opened) == {p for p, _ in need}
            assert max(opened.values()) == 1


def test_the_field_defaults_on_and_old_configs_and_checkpoints_mean_the_old_order(tmp_path):
    """data.shuffle_block_rows is 1024 for a new config, 0 for a run config or checkpoint config
    written without it; a checkpoint's batching record without it means whole shards, and an
    EpochFeed resumes its positions in that order."""
    assert Config().data.shuffle_block_rows == 1024
    with pytest.raises(ValueError, match=r"data.shuffle_block_rows=-1 must be >= 0"):
        DataConfig(shuffle_block_rows=-1)
    saved = Config().to_dict()
    assert Config.from_dict(saved).data.shuffle_block_rows == 1024
    del saved["data"]["shuffle_block_rows"]
    assert Config.from_dict(saved).data.shuffle_block_rows == 0
    assert batching_record(Config().data)["shuffle_block_rows"] == 1024

    shards, _ = write_shards(tmp_path, [700, 300])
    training_corpora = [TrainingCorpus("en-de", "en", "de", "real", 1.0, (), shards, 1000)]
    cfg = Config(data=DataConfig(**CFG, shuffle_block_rows=BLOCK))
    feed = EpochFeed(training_corpora, cfg, 0, 2, 0, TrainState())
    assert feed.mix.block_rows == BLOCK and feed.position == Position(0) and feed.segment is None
    positions = [Position(0, 1, 2).to_dict(), Position(0, 0, 3).to_dict()]
    old_record = {k: v for k, v in batching_record(cfg.data).items() if k != "shuffle_block_rows"}
    for record, resized in ((batching_record(cfg.data), False), (old_record, True), (None, True)):
        state = {"step": 5, "epoch": 0, "data_positions": positions, "data_batching": record}
        feed = EpochFeed(training_corpora, cfg, 1, 2, 0, TrainState.from_dict(state))  # as a checkpoint loads
        assert (feed.segment is not None) == resized, record
        assert feed.position == (Position(0) if resized else Position(**positions[1]))
    assert batching_changes(saved_batching(old_record), cfg.data) == f"data.shuffle_block_rows 0 -> {BLOCK}"
