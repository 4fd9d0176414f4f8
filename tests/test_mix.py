"""Several corpora in one stream (raymt.data.epoch.Mix, docs/design-inputs.md section 4):
the temperature's mix in every epoch and every worker's slice, each pair once per epoch of its
corpus, exact resume, elastic resizes, one shard open per corpus, one corpus == today's plan.

Fast, no Ray: synthetic shards written with pyarrow into tmp_path.
"""

import math
import pickle
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import todays_stream

from raymt.config import DataConfig
from raymt.data import stream
from raymt.data.epoch import (
    Mix,
    Position,
    corpus_name,
    epoch_pieces,
    epoch_reads,
    epoch_slice,
    slice_bounds,
    stream_ranges,
    sub_plan,
)
from raymt.data.format import Shard, token_index
from raymt.data.mixing import epoch_rows, sampling_probs
from raymt.data.stream import TrainStream, resume_point

NAMES = ["en-de", "en-fr", "de-en"]
SIZES = [300, 70, 45]  # of the corpora written to files
PIECE = 16  # rows of a piece in the file tests (1024 in a run)
CFG = DataConfig(window_rows=32, shuffle_buffer_rows=32, max_tokens=64, max_len=20)


def write_corpora(directory, sizes=SIZES, long_first=False) -> list[list[Shard]]:
    """Two shards per corpus at train/<name>/part-0000k.parquet, with token indexes; a source
    is [5 + corpus, 100 + row id, 7, ...] (the pair's identity), 2-6 tokens (12-16 for the
    first corpus with `long_first`)."""
    corpora = []
    for i, n in enumerate(sizes):
        (directory / "train" / NAMES[i]).mkdir(parents=True)
        corpora.append([])
        for k, (lo, hi) in enumerate(((0, n // 2), (n // 2, n))):
            path = str(directory / "train" / NAMES[i] / f"part-{k:05d}.parquet")
            extra = 10 if long_first and i == 0 else 0
            src = [[5 + i, 100 + r] + [7] * (r % 5 + extra) for r in range(lo, hi)]
            tgt = [[9, 100 + r] for r in range(lo, hi)]
            pq.write_table(
                pa.table(
                    {"src_ids": pa.array(src, pa.list_(pa.int32())), "tgt_ids": pa.array(tgt, pa.list_(pa.int32()))}
                ),
                path,
                row_group_size=20,
            )
            lengths = np.array([len(s) + len(t) for s, t in zip(src, tgt)])
            corpora[i].append(Shard(path, hi - lo, tuple(token_index(lengths))))
    return corpora


def plan_rows(mix: Mix, reads) -> list[tuple[int, int]]:
    """(corpus, row id) of every planned row, in order."""
    firsts = {f.path: sum(g.num_pairs for g in shards[:j]) for shards in mix.corpora for j, f in enumerate(shards)}
    return [(mix.corpus_of(p), firsts[p] + r) for p, s, e in reads for r in range(s, e)]


def stream_order(mix: Mix, seed: int, epoch: int) -> list[list[int]]:
    """Each corpus's row ids in its stream rows [epoch r_i, (epoch + 1) r_i), in order, computed
    from the design (corpus epoch k = its shards in the permutation [seed, k, 7919, i])."""
    out = []
    for i, (shards, r) in enumerate(zip(mix.corpora, mix.rows)):
        n, out_i = sum(f.num_pairs for f in shards), []
        for k, a, b in stream_ranges(n, epoch * r, (epoch + 1) * r):
            order = np.random.default_rng([seed, k, 7919, i]).permutation(len(shards))
            ids = [sum(shards[j].num_pairs for j in range(o)) + x for o in order for x in range(shards[o].num_pairs)]
            out_i += ids[a:b]
        out.append(out_i)
    return out


def window(mix: Mix, seed: int, epoch: int) -> Counter:
    """(corpus, row id) counts of each corpus's stream window in `epoch`."""
    return Counter((i, row) for i, rows in enumerate(stream_order(mix, seed, epoch)) for row in rows)


def run(mix, rank, world, position, segment=None, stop=None, num_epochs=1, trace=False):
    """[(pairs as (corpus, row id), position after the batch)] of a worker's stream, up to `stop` batches."""
    s = TrainStream(mix, CFG, 7, rank, world, position, segment=segment, num_epochs=num_epochs, trace=trace)
    out = []
    for batch in s:
        out.append(([(c - 5, r - 100) for c, r in batch.src[:, :2].tolist()], s.position))
        if len(out) == stop:
            break
    s.close()
    return (out, s.traced) if trace else out


def trained(*runs) -> Counter:
    """(corpus, row id) counts of the pairs in the runs' batches."""
    return Counter(pair for batches in runs for pairs, _ in batches for pair in pairs)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The three corpora on disk, shared by the file tests (read only)."""
    return write_corpora(tmp_path_factory.mktemp("mix"))


def test_mixed_reads_follow_the_design(corpora):
    """The plan is the pieces of `epoch_pieces`, each corpus's rows in its stream order; a read
    joins the one before it when it continues it."""
    mix = Mix.by_temperature(corpora, 5.0, piece_rows=PIECE)
    assert mix.names == NAMES and mix.sizes == SIZES and mix.rows == tuple(epoch_rows(SIZES, 5.0))
    for epoch in (0, 1, 4):
        reads = epoch_reads(mix, 7, epoch)
        rows = plan_rows(mix, reads)
        for i, order in enumerate(stream_order(mix, 7, epoch)):
            assert [r for c, r in rows if c == i] == order
        corpus_order = [i for p in epoch_pieces(mix.rows, 7, epoch, PIECE) for i in [p.corpus] * (p.hi - p.lo)]
        assert [c for c, _ in rows] == corpus_order
        assert all(a[0] != b[0] or a[2] != b[1] for a, b in zip(reads, reads[1:]))
    assert epoch_reads(mix, 7, 1) != epoch_reads(mix, 8, 1)


@pytest.mark.parametrize("temperature", [1.0, 5.0])
def test_each_epoch_and_each_slice_holds_the_temperatures_mix(temperature):
    """Plan level, 1024-row pieces: an epoch gives corpus i its r_i = N p_i rows (p ~ n^(1/T)),
    and every worker's slice (equal tokens) holds that mix within two pieces per corpus."""
    sizes = [400_000, 60_000, 6_000]
    rng = np.random.default_rng(0)
    corpora = [  # corpus i's pairs hold 4-20, 12-28, 20-36 tokens: equal tokens are not equal rows
        [Shard(f"c{i}/part-{k}", m, tuple(token_index(rng.integers(4 + 8 * i, 21 + 8 * i, m)))) for k in range(4)]
        for i, n in enumerate(sizes)
        for m in [n // 4]
    ]
    corpora[1].append(Shard("c1/empty", 0, ()))  # a shard that cleaning emptied is never read
    mix = Mix.by_temperature(corpora, temperature)
    p = sampling_probs(sizes, temperature)
    assert np.abs(np.asarray(mix.rows) - sum(sizes) * p).max() <= 1
    if temperature == 1.0:
        assert list(mix.rows) == sizes  # each corpus once per epoch
    else:
        assert mix.rows[0] < sizes[0] and mix.rows[2] > 4 * sizes[2]  # big one sampled down, small one up
    for epoch in (0, 3):
        reads = epoch_reads(mix, 5, epoch)
        assert plan_counts(mix, reads).tolist() == list(mix.rows) and "c1/empty" not in {p for p, _, _ in reads}
        for world in (2, 3, 7):
            for rank in range(world):
                got = plan_counts(mix, epoch_slice(mix, 5, epoch, rank, world))
                share = sum(got) * np.asarray(mix.rows) / mix.num_rows
                assert (np.abs(got - share) <= 2 * 1024).all(), (world, rank, got, share)


def plan_counts(mix: Mix, reads) -> np.ndarray:
    """Rows of each corpus in `reads`."""
    counts = np.zeros(len(mix.corpora), np.int64)
    for path, s, e in reads:
        counts[mix.corpus_of(path)] += e - s
    return counts


@pytest.mark.parametrize("temperature", [1.0, 5.0])
def test_trained_mix_follows_the_temperature(corpora, temperature):
    """Stream level, 2 workers: an epoch trains r_i pairs of corpus i, each planned pair once,
    and each batch-chunk of a worker holds the epoch's mix within a few pieces per corpus."""
    mix = Mix.by_temperature(corpora, temperature, piece_rows=PIECE)
    p = sampling_probs(SIZES, temperature)
    both = [run(mix, rank, 2, Position(2)) for rank in range(2)]
    seen = trained(*both)
    assert seen == window(mix, 7, 2)
    per_corpus = [sum(m for (c, _), m in seen.items() if c == i) for i in range(3)]
    assert per_corpus == list(mix.rows) and np.abs(np.asarray(per_corpus) - sum(SIZES) * p).max() <= 1
    for batches in both:
        for chunk in range(max(pos.chunk for _, pos in batches) + 1):
            got = Counter(c for pairs, pos in batches if pos.chunk == chunk for c, _ in pairs)
            share = sum(got.values()) * np.asarray(mix.rows) / mix.num_rows
            assert all(abs(got[i] - share[i]) <= 3 * PIECE for i in range(3)), (chunk, got, share)


def test_each_pair_once_per_epoch_of_its_corpus(corpora):
    """Over 6 epochs at T=5 (the small corpora pass several times, the big one ~1.5 times), the
    2 workers train each epoch's window once, so each pair once per epoch of its corpus."""
    mix = Mix.by_temperature(corpora, 5.0, piece_rows=PIECE)
    seen = [Counter() for _ in SIZES]
    for rank in range(2):
        batches = run(mix, rank, 2, Position(0), num_epochs=6)
        assert [pos.epoch for _, pos in batches] == sorted(pos.epoch for _, pos in batches)
        for pairs, _ in batches:
            for c, row in pairs:
                seen[c][row] += 1
    for i, n in enumerate(SIZES):
        passes = 6 * mix.rows[i] / n
        assert len(seen[i]) == n and set(seen[i].values()) <= {math.floor(passes), math.ceil(passes)}, (i, passes)


@pytest.mark.parametrize("stop", [1, 5, 13])
def test_killed_worker_resumes_the_uninterrupted_order(corpora, stop):
    """2 workers over two epochs; rank 1 is killed after `stop` batches and restarts from the
    checkpoint's positions: both ranks' batches are the uninterrupted run's, in order."""
    mix = Mix.by_temperature(corpora, 5.0, piece_rows=PIECE)
    full = [run(mix, rank, 2, Position(3), num_epochs=2) for rank in range(2)]
    head = run(mix, 1, 2, Position(3), stop=stop, num_epochs=2)
    saved = [full[0][stop][1].to_dict(), head[-1][1].to_dict()]  # the checkpoint's positions
    for rank, before in ((0, full[0][: stop + 1]), (1, head)):
        position, segment = resume_point(mix, CFG, 7, 3, saved, None, rank, 2)
        assert segment is None and position == Position(**saved[rank])
        assert before + run(mix, rank, 2, position, num_epochs=2 - (position.epoch - 3)) == full[rank]
    # A resume in the next epoch continues there too.
    late = [j for j, (_, pos) in enumerate(full[1]) if pos.epoch == 4][3]
    assert run(mix, 1, 2, full[1][late][1]) == full[1][late + 1 :]


def test_resize_mid_epoch_trains_each_pair_once(corpora):
    """2 workers stop mid-epoch, 3 go on from their positions (a `Segment`), then 2 again:
    the epoch's window is trained exactly once."""
    mix = Mix.by_temperature(corpora, 5.0, piece_rows=PIECE)
    old = [run(mix, 0, 2, Position(1), stop=4), run(mix, 1, 2, Position(1), stop=7)]
    saved = [batches[-1][1].to_dict() for batches in old]
    points = [resume_point(mix, CFG, 7, 1, saved, None, r, 3) for r in range(3)]
    segment = points[0][1]
    assert segment.generation == 1 and all(pt == (Position(1), segment) for pt in points)
    assert segment.num_rows == segment.num_left() + len(segment.done)
    mid = [run(mix, r, 3, Position(1), segment, stop=3) for r in range(3)]
    saved = [batches[-1][1].to_dict() for batches in mid]
    position, again = resume_point(mix, CFG, 7, 1, saved, segment.to_dict(), 0, 2)
    assert position == Position(1) and again.generation == 2
    new = [run(mix, r, 2, Position(1), again) for r in range(2)]
    assert trained(*old, *mid, *new) == window(mix, 7, 1)
    assert run(mix, 0, 3, Position(2), segment) == run(mix, 0, 3, Position(2))  # the next epoch: no segment


def test_a_piece_does_not_reopen_its_shard(corpora, monkeypatch):
    """A mixed plan has a read per piece; reading it opens each shard once per visit of its
    corpus and decodes each row group once, not once per piece."""
    mix = Mix.by_temperature(corpora, 5.0, piece_rows=4)
    reads = epoch_reads(mix, 7, 0)
    opens, groups = Counter(), Counter()
    real_filesystem, real_read = stream.filesystem, pq.ParquetFile.read_row_group

    class Counting:
        def __init__(self, fs):
            self.fs = fs

        def open_input_file(self, path):
            opens[path] += 1
            return self.fs.open_input_file(path)

    def filesystem(path):
        fs, local = real_filesystem(path)
        return Counting(fs), local

    def read_row_group(self, i, *args, **kwargs):
        groups[i] += 1
        return real_read(self, i, *args, **kwargs)

    monkeypatch.setattr(stream, "filesystem", filesystem)
    monkeypatch.setattr(todays_stream, "filesystem", filesystem)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    tables = list(stream.read_plan(reads, mix.corpus_of))
    rows = [(c - 5, r - 100) for t in tables for c, r in (s[:2] for s in t.column("src_ids").to_pylist())]
    assert rows == plan_rows(mix, reads)
    assert [int(c) for t in tables for c in t.column("corpus").to_pylist()] == [c for c, _ in rows]
    # Each corpus reads its shards in stream order: one open each time it moves to another
    # shard, each row group (20 rows) decoded once per run of contiguous rows.
    runs = _runs(mix, reads)
    moves = sum(1 for k, (path, _, _) in enumerate(runs) if path != _last_path(mix, runs[:k], path))
    assert sum(opens.values()) == moves and sum(groups.values()) == sum(-(-e // 20) - s // 20 for _, s, e in runs)
    # ee135a8's one-corpus reader on the same plan: an open and its row groups per read.
    mixed = (sum(opens.values()), sum(groups.values()))
    opens.clear(), groups.clear()
    assert [len(t) for t in todays_stream.read_plan(reads)] == [len(t) for t in tables]
    assert sum(opens.values()) == len(reads) > 3 * mixed[0] and sum(groups.values()) > 3 * mixed[1], mixed


def _runs(mix: Mix, reads) -> list[tuple[str, int, int]]:
    """Each corpus's reads joined where one continues the last: (path, first row, end row) per run."""
    last, out = {}, []
    for path, s, e in reads:
        c = mix.corpus_of(path)
        if c in last and out[last[c]][0] == path and out[last[c]][2] == s:
            out[last[c]] = (path, out[last[c]][1], e)
        else:
            last[c] = len(out)
            out.append((path, s, e))
    return out


def _last_path(mix: Mix, runs, path: str):
    """The shard that `path`'s corpus read last in `runs`, or None."""
    mine = [p for p, _, _ in runs if mix.corpus_of(p) == mix.corpus_of(path)]
    return mine[-1] if mine else None


def test_traced_pairs_name_their_corpus(corpora):
    """A mixed stream's trace is CORPUS:DIGEST, the corpus from the shard's train/<name>/."""
    mix = Mix.by_temperature(corpora, 5.0, piece_rows=PIECE)
    batches, traced = run(mix, 0, 2, Position(0), stop=6, trace=True)
    pairs = [pair for ps, _ in batches for pair in ps]
    assert len(traced) == len(pairs) and [t.split(":")[0] for t in traced] == [NAMES[c] for c, _ in pairs]
    assert all(len(t.split(":")[1]) == 16 for t in traced)
    assert corpus_name("s3://b/corpus/train/en-de.bt/part-00003.parquet") == "en-de.bt"
    assert corpus_name("/data/part-00000.parquet") is None


def test_slices_balance_tokens_across_corpora(tmp_path):
    """Corpus 0 has long sentences: the workers' slices hold equal tokens, not equal rows."""
    corpora = write_corpora(tmp_path, long_first=True)
    mix = Mix.by_temperature(corpora, 1.0, piece_rows=PIECE)
    lengths = {}
    for shards in corpora:
        for f in shards:
            table = pq.read_table(f.path)
            lengths[f.path] = [
                len(s) + len(t) for s, t in zip(*(table.column(c).to_pylist() for c in table.column_names))
            ]
    tokens = [sum(sum(lengths[p][s:e]) for p, s, e in epoch_slice(mix, 7, 0, r, 2)) for r in range(2)]
    rows = [sum(e - s for _, s, e in epoch_slice(mix, 7, 0, r, 2)) for r in range(2)]
    assert abs(tokens[0] - tokens[1]) <= 0.02 * sum(tokens), tokens
    bare = Mix([[Shard(f.path, f.num_pairs) for f in shards] for shards in corpora], mix.rows, PIECE)
    assert slice_bounds(bare, 7, 0, 1, 2) == (mix.num_rows // 2, mix.num_rows)  # no index: equal rows
    assert rows != [mix.num_rows // 2, mix.num_rows - mix.num_rows // 2]


def test_one_corpus_is_todays_plan_and_stream(tmp_path):
    """A Mix of one corpus read once per epoch is ee135a8's one-pair plan (tests/todays_stream.py):
    the same reads and slices, a trace naming no corpus, one resize; in pieces of any size.
    (tests/test_stream_fixture.py: the same batches, trace and positions as that code gave.)"""
    (files,) = write_corpora(tmp_path, [300])
    mix = Mix([files], [300])
    assert mix.single and mix.names == ["en-de"]
    for seed, epoch in ((7, 0), (3, 5)):
        assert epoch_reads(mix, seed, epoch) == todays_stream.epoch_reads(files, seed, epoch)
        for world in (1, 2, 3):
            for rank in range(world):
                bounds = todays_stream.slice_bounds(files, seed, epoch, rank, world)
                assert epoch_slice(mix, seed, epoch, rank, world) == sub_plan(epoch_reads(mix, seed, epoch), *bounds)
    traced = run(mix, 1, 2, Position(2), trace=True)
    assert traced == run(Mix.of_shards(files), 1, 2, Position(2), trace=True) and ":" not in traced[1][0]
    saved = [Position(0, 1, 2).to_dict(), Position(0, 0, 3).to_dict()]
    assert resume_point(mix, CFG, 7, 0, saved, None, 1, 3) == resume_point(
        Mix.of_shards(files), CFG, 7, 0, saved, None, 1, 3
    )
    # In pieces of 100 rows (not 1024), one corpus (rows == its size) reads and cuts as ee135a8 did.
    big = [Shard(f"part-{k}", n, tuple(token_index(np.arange(n) % 13 + 2))) for k, n in enumerate([2500, 700, 1800])]
    general = Mix([big], [5000], piece_rows=100)
    for epoch in (0, 1):
        assert epoch_reads(general, 4, epoch) == todays_stream.epoch_reads(big, 4, epoch)
        for world in (2, 3, 5):
            for rank in range(world):
                want = todays_stream.slice_bounds(big, 4, epoch, rank, world)
                assert slice_bounds(general, 4, epoch, rank, world) == want


def test_a_single_corpus_read_twice_per_epoch_uses_the_mix():
    """One corpus with weight 2 (r = 2n) is not today's epoch: two corpus epochs back to back."""
    shards = [Shard("a", 30), Shard("b", 20)]
    mix = Mix.by_temperature([shards], 1.0, weights=[2.0], piece_rows=8)
    assert not mix.single and mix.rows == (100,)
    reads = epoch_reads(mix, 1, 3)
    assert sum(e - s for _, s, e in reads) == 100
    one = Mix.of_shards(shards)  # read once per epoch: its epochs 6 and 7
    assert reads == epoch_reads(one, 1, 6) + epoch_reads(one, 1, 7)
    assert sub_plan(reads, 0, 50) == epoch_reads(one, 1, 6) == todays_stream.epoch_reads(shards, 1, 6)


def test_a_mix_pickles_to_the_same_plan(corpora):
    """A Mix travels to the workers pickled: the same plan there (its lock and cache stay behind)."""
    mix = Mix.by_temperature(corpora, 5.0, piece_rows=PIECE)
    before = epoch_slice(mix, 7, 1, 1, 3)
    again = pickle.loads(pickle.dumps(mix))
    assert again.rows == mix.rows and again.corpora == mix.corpora and again.piece_rows == PIECE
    assert epoch_slice(again, 7, 1, 1, 3) == before
