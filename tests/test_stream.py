"""Per-worker streams over prepared shards: each pair once per epoch, deterministic, resumable."""

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raymt.batching import collate, collate_flat
from raymt.config import DataConfig
from raymt.data.epoch import Mix, Position, batching_record, epoch_slice, restore_position, skip_rows
from raymt.data.format import Shard, token_index
from raymt.data.stream import TrainStream, flat, resume_point


def write_shards(tmp_path, sizes, seed=0):
    """Parquet shards of random pairs; returns them as one pair's `Mix` and every pair as a tuple."""
    rng = np.random.default_rng(seed)
    files, pairs = [], []
    for k, n in enumerate(sizes):
        src = [rng.integers(4, 50, rng.integers(1, 12)).tolist() for _ in range(n)]
        tgt = [rng.integers(4, 50, rng.integers(1, 12)).tolist() for _ in range(n)]
        path = tmp_path / f"part-{k:05d}.parquet"
        pq.write_table(
            pa.table({"src_ids": pa.array(src, pa.list_(pa.int32())), "tgt_ids": pa.array(tgt, pa.list_(pa.int32()))}),
            path,
            row_group_size=97,
        )
        files.append((str(path), n))
        pairs += [(tuple(s), tuple(t)) for s, t in zip(src, tgt)]
    return Mix.of_shards(files), pairs


def batch_pairs(batch):
    """(src without EOS, tgt) tuples of a collated batch."""
    out = []
    for s, t in zip(batch.src.tolist(), batch.tgt_out.tolist()):
        s, t = s[: s.index(3)], t[: t.index(3)]
        out.append((tuple(s), tuple(t)))
    return out


def test_epoch_slices_cover_every_row_once_and_balance():
    files = [(f"f{i}", n) for i, n in enumerate([5, 300, 17, 0, 120, 64])]
    for world_size in (1, 2, 3):
        seen = Counter()
        sizes = []
        for rank in range(world_size):
            plan = epoch_slice(Mix.of_shards(files), seed=1, epoch=2, rank=rank, world_size=world_size)
            sizes.append(sum(e - s for _, s, e in plan))
            for path, start, end in plan:
                seen.update((path, i) for i in range(start, end))
        assert seen == Counter((p, i) for p, n in files for i in range(n))
        assert max(sizes) - min(sizes) <= 1
    order = lambda epoch: [p for p, _, _ in epoch_slice(Mix.of_shards(files), 1, epoch, 0, 1)]
    assert order(0) != order(1) and order(0) == order(0)
    plan = epoch_slice(Mix.of_shards(files), 1, 0, 0, 1)
    assert sum(e - s for _, s, e in skip_rows(plan, 310)) == 506 - 310


def test_slices_balance_tokens_across_sources_of_different_lengths():
    # Two sources: 5000 short pairs (10 tokens) and 5000 long ones (40 tokens).
    lengths = {"short": [10] * 5000, "long": [40] * 5000}
    tokens = lambda files, rank: sum(
        sum(lengths[p][a:b]) for p, a, b in epoch_slice(Mix.of_shards(files), seed=1, epoch=0, rank=rank, world_size=2)
    )
    by_rows = [(p, 5000) for p in lengths]
    assert sorted(tokens(by_rows, r) for r in (0, 1)) == [50_000, 200_000]
    by_tokens = [Shard(p, 5000, tuple(token_index(np.array(v)))) for p, v in lengths.items()]
    assert [tokens(by_tokens, r) for r in (0, 1)] == [125_000, 125_000]


def test_collate_flat_matches_collate():
    src = [[5, 6, 7], [8], [9, 10]]
    tgt = [[11], [12, 13, 14], [15, 16]]
    col = lambda rows: flat(pa.chunked_array([pa.array(rows, pa.list_(pa.int32()))]))
    idx = np.array([2, 0, 1])
    got = collate_flat(col(src), col(tgt), idx)
    want = collate([src[i] + [3] for i in idx], [tgt[i] for i in idx])
    for name in ("src", "tgt_in", "tgt_out"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


CFG = dict(max_tokens=64, max_len=10, window_rows=50, shuffle_buffer_rows=120)


def stream(files, rank, world_size, position, num_epochs=1, segment=None, **data):
    cfg = DataConfig(**{**CFG, **data})
    return TrainStream(
        files, cfg, seed=3, rank=rank, world_size=world_size, position=position, num_epochs=num_epochs, segment=segment
    )


def test_streams_see_each_pair_once_and_repeat_exactly(tmp_path):
    files, pairs = write_shards(tmp_path, [230, 41, 180])
    kept = Counter(p for p in pairs if len(p[0]) <= 10 and len(p[1]) <= 10)
    seen, runs = Counter(), []
    for rank in range(2):
        batches = list(stream(files, rank, 2, Position(epoch=0)))
        assert all(b.src.numel() <= 64 and b.tgt_out.numel() <= 64 for b in batches)
        seen.update(p for b in batches for p in batch_pairs(b))
        runs.append(batches)
    assert seen == kept
    again = list(stream(files, 0, 2, Position(epoch=0)))
    assert [batch_pairs(b) for b in again] == [batch_pairs(b) for b in runs[0]]
    other_epoch = list(stream(files, 0, 2, Position(epoch=1)))
    assert [batch_pairs(b) for b in other_epoch] != [batch_pairs(b) for b in runs[0]]


@pytest.mark.parametrize("stop_after", [1, 7, 25])
def test_resumed_stream_continues_exactly(tmp_path, stop_after):
    files, _ = write_shards(tmp_path, [150, 260], seed=1)
    full = [batch_pairs(b) for b in stream(files, 1, 2, Position(epoch=4))]
    first = stream(files, 1, 2, Position(epoch=4))
    head = []
    for b in first:
        head.append(batch_pairs(b))
        if len(head) == stop_after:
            break
    first.close()
    saved = [Position(4).to_dict(), first.position.to_dict()]  # as a checkpoint stores them
    position = restore_position(saved, rank=1, world_size=2, epoch=4)
    tail = [batch_pairs(b) for b in stream(files, 1, 2, position)]
    assert head + tail == full
    assert restore_position(saved, rank=1, world_size=3, epoch=4) == Position(4)  # other world size
    assert restore_position(saved, rank=1, world_size=2, epoch=5) == Position(5)  # next epoch


def test_a_reader_error_reaches_the_training_loop(tmp_path):
    files, _ = write_shards(tmp_path, [50])
    broken = stream(Mix.of_shards([(str(tmp_path / "missing.parquet"), 50)]), 0, 1, Position(0))
    with pytest.raises(Exception, match="missing.parquet"):
        list(broken)
    assert len(list(stream(files, 0, 1, Position(0)))) > 0


def test_a_stream_over_epochs_is_the_epochs_one_after_another(tmp_path):
    files, _ = write_shards(tmp_path, [150, 260], seed=2)
    each = []
    for epoch in (3, 4):
        one = stream(files, 0, 2, Position(epoch=epoch))
        each += [(batch_pairs(b), one.position) for b in one]
    both = stream(files, 0, 2, Position(epoch=3), num_epochs=2)
    assert [(batch_pairs(b), both.position) for b in both] == each
    # Resuming inside the second epoch of a two-epoch stream continues exactly.
    position = each[len(each) - 5][1]
    assert position.epoch == 4
    tail = [batch_pairs(b) for b in stream(files, 0, 2, position)]
    assert tail == [p for p, _ in each[-4:]]


def take(s, n):
    """The pairs of up to n batches of stream s, then close it."""
    out = []
    for b in s:
        out += batch_pairs(b)
        if (n := n - 1) == 0:
            break
    s.close()
    return out


@pytest.mark.parametrize("steps", [(0, 3, 1), (5, 1, 0), (9, 4, 2), (40, 40, 40)])
def test_resized_epoch_trains_every_pair_once(tmp_path, steps):
    """2 workers take some batches, 3 go on from their checkpoint, then 1 finishes the epoch:
    every pair of the epoch is trained exactly once (elastic training)."""
    files, pairs = write_shards(tmp_path, [230, 41, 180], seed=4)
    kept = Counter(p for p in pairs if len(p[0]) <= 10 and len(p[1]) <= 10)
    seen, state = Counter(), {"data_positions": None, "data_segment": None}
    for world_size, n in zip((2, 3, 1), steps):
        positions, segment = [], None
        for rank in range(world_size):
            position, segment = resume_point(
                files, DataConfig(**CFG), 3, 0, state["data_positions"], state["data_segment"], rank, world_size
            )
            s = stream(files, rank, world_size, position, segment=segment)
            seen.update(take(s, n) if world_size > 1 else [p for b in s for p in batch_pairs(b)])
            positions.append(s.position.to_dict())
        # as a checkpoint stores and loads them
        path = tmp_path / f"state{world_size}.pt"
        torch.save({"data_positions": positions, "data_segment": segment and segment.to_dict()}, path)
        state = torch.load(path, weights_only=True)
    assert seen == kept


@pytest.mark.parametrize("change", [{"max_tokens": 32}, {"max_tokens": 128, "shuffle_buffer_rows": 0}])
def test_a_resume_with_another_token_budget_trains_every_pair_once(tmp_path, change):
    """A resume given another data.max_tokens (the out-of-memory hint's retry) or chunking: the
    saved positions count batches cut the old way, which are cut again to learn what they held."""
    files, pairs = write_shards(tmp_path, [230, 41, 180], seed=4)
    kept = Counter(p for p in pairs if len(p[0]) <= 10 and len(p[1]) <= 10)
    seen, positions = Counter(), []
    for rank in range(2):
        s = stream(files, rank, 2, Position(0))
        seen.update(take(s, 3))
        positions.append(s.position.to_dict())
    before, after = batching_record(DataConfig(**CFG)), DataConfig(**{**CFG, **change})
    for rank in range(2):
        position, segment = resume_point(files, after, 3, 0, positions, None, rank, 2, before)
        assert position == Position(0) and segment.generation == 1
        seen.update(p for b in stream(files, rank, 2, position, segment=segment, **change) for p in batch_pairs(b))
    assert seen == kept
    # The same fields (or a checkpoint that records none): the saved position as before.
    same = DataConfig(**CFG)
    assert resume_point(files, same, 3, 0, positions, None, 1, 2, before) == (Position(**positions[1]), None)
    assert resume_point(files, after, 3, 0, positions, None, 1, 2, None) == (Position(**positions[1]), None)


def test_a_resized_epoch_resumes_exactly_at_the_same_size(tmp_path):
    files, _ = write_shards(tmp_path, [300, 90], seed=5)
    saved = [Position(0, 1, 2).to_dict(), Position(0, 0, 3).to_dict()]
    _, segment = resume_point(files, DataConfig(**CFG), 3, 0, saved, None, 0, 3)
    assert segment.generation == 1 and segment.done
    full = [batch_pairs(b) for b in stream(files, 2, 3, Position(0), segment=segment)]
    first = stream(files, 2, 3, Position(0), segment=segment)
    head = take(first, 4)
    saved = [Position(0).to_dict(), Position(0).to_dict(), first.position.to_dict()]
    position, again = resume_point(files, DataConfig(**CFG), 3, 0, saved, segment.to_dict(), 2, 3)
    assert again == segment
    tail = [p for b in stream(files, 2, 3, position, segment=again) for p in batch_pairs(b)]
    assert head + tail == [p for b in full for p in b]
    # Nothing trained yet: the epoch starts over at the new size, without a segment.
    assert resume_point(files, DataConfig(**CFG), 3, 0, [Position(0).to_dict()] * 2, None, 0, 3) == (Position(0), None)
    # The next epoch ignores the segment.
    assert stream(files, 0, 3, Position(1), segment=segment).segment_of(1) is None
