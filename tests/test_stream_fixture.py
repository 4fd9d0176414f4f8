"""One pair's stream as a mix of one corpus trains exactly what the one-pair stream of ee135a8
trained: the same epoch slices, batches, trace and positions over 2 workers and 2 epochs, the
same batches after a mid-epoch resume from its positions and after a resize to 3 workers; and a
mix of three corpora likewise. tests/fixtures/stream-ee135a8.json holds what that code gave:
`record(data, stream.TrainStream, stream.epoch_slice, stream.resume_point, root)` run on ee135a8,
`data` the one pair's shards as that code took them (a list), or the `Mix` of three; fast, no Ray.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raymt.config import DataConfig
from raymt.data.format import Shard, TrainingCorpus, token_index

FIXTURE = Path(__file__).parent / "fixtures" / "stream-ee135a8.json"
CFG = dict(window_rows=64, shuffle_buffer_rows=128, max_tokens=160, max_len=12)
SEED = 11
ONE_PAIR = [1500, 0, 310, 700, 45]  # pairs of each shard; the first holds two token-index blocks
MIXED = {"en-de": [300, 140], "en-fr": [70], "de-en": [45, 20]}  # corpus: pairs of its shards
PIECE = 16  # rows of a piece of the mixed schedule (1024 in a run)


def write_shard(path: Path, n: int, rng: np.random.Generator) -> Shard:
    """A shard of `n` random pairs of 1-14 ids, its row groups 128 rows, with its token index."""
    path.parent.mkdir(parents=True, exist_ok=True)
    src = [rng.integers(4, 60, rng.integers(1, 15)).tolist() for _ in range(n)]
    tgt = [rng.integers(4, 60, rng.integers(1, 15)).tolist() for _ in range(n)]
    column = lambda rows: pa.array(rows, pa.list_(pa.int32()))
    pq.write_table(pa.table({"src_ids": column(src), "tgt_ids": column(tgt)}), path, row_group_size=128)
    lengths = np.array([len(s) + len(t) for s, t in zip(src, tgt)], dtype=np.int64)
    return Shard(str(path), n, tuple(token_index(lengths)))


def write_corpus(root: Path) -> tuple[list[Shard], list[list[Shard]]]:
    """One pair's shards at train/part-0000k.parquet and three corpora at train/<name>/."""
    rng = np.random.default_rng(0)
    one = [write_shard(root / "one" / "train" / f"part-{k:05d}.parquet", n, rng) for k, n in enumerate(ONE_PAIR)]
    mixed = [
        [write_shard(root / "mix" / "train" / name / f"part-{k:05d}.parquet", n, rng) for k, n in enumerate(sizes)]
        for name, sizes in MIXED.items()
    ]
    return one, mixed


def digest(batch, hashes: list[str]) -> str:
    """A batch's tensors and traced pairs, as 16 hex digits."""
    h = hashlib.blake2b(digest_size=8)
    for t in (batch.src, batch.tgt_in, batch.tgt_out):
        h.update(str(tuple(t.shape)).encode() + t.numpy().tobytes())
    h.update("\n".join(hashes).encode())
    return h.hexdigest()


def relative(reads, root: Path) -> list:
    """Reads with paths relative to `root`."""
    return [[str(Path(p).relative_to(root)), int(s), int(e)] for p, s, e in reads]


def batches(stream, stop=None) -> list:
    """[digest, epoch, chunk, batches] of each batch of a stream (the position after it)."""
    out = []
    for batch in stream:
        out.append([digest(batch, list(stream.traced)), *stream.position.to_dict().values()])
        stream.traced.clear()
        if len(out) == stop:
            break
    stream.close()
    return out


def record(data, stream_type, epoch_slice, resume_point, root: Path) -> dict:
    """What the stream of `data` gives: the 2 workers' slices and batches over 2 epochs, the
    batches after resuming both mid-epoch 1, and the positions, segment and batches of 3
    workers resumed from there."""
    cfg = DataConfig(**CFG)
    open_ = lambda rank, world, position, n=1, segment=None: stream_type(
        data, cfg, SEED, rank, world, position, trace=True, num_epochs=n, segment=segment
    )
    from raymt.data.stream import Position

    out = {"slices": [], "batches": [], "stops": [5, 13], "resumed": [], "resized": []}
    for rank in range(2):
        out["slices"].append([relative(epoch_slice(data, SEED, e, rank, 2), root) for e in range(2)])
        out["batches"].append(batches(open_(rank, 2, Position(0), n=2)))
    saved = []
    for rank, stop in enumerate(out["stops"]):
        stream = open_(rank, 2, Position(1))
        batches(stream, stop)
        saved.append(stream.position.to_dict())
    out["saved"] = saved
    for rank in range(2):
        position, segment = resume_point(data, cfg, SEED, 1, saved, None, rank, 2, None)
        out["resumed"].append(batches(open_(rank, 2, position, segment=segment)))
    for rank in range(3):
        position, segment = resume_point(data, cfg, SEED, 1, saved, None, rank, 3, None)
        seg = segment.to_dict()
        seg["reads"] = relative(seg["reads"], root)
        out["resized"].append(
            {
                "position": position.to_dict(),
                "segment": seg,
                "batches": batches(open_(rank, 3, position, segment=segment)),
            }
        )
    return out


def test_one_pair_and_mixed_streams_are_ee135a8s(tmp_path):
    """A one-pair corpus's shards (token-indexed or not) as a mix of one corpus, and a mix of
    three corpora, give exactly the slices, batches, trace and positions of ee135a8, resumed
    from its positions on 2 workers and on 3; one pair still records no data_mix."""
    from raymt.data.epoch import Mix, epoch_slice, mix_record, training_data
    from raymt.data.stream import TrainStream, resume_point

    want = json.loads(FIXTURE.read_text())
    one, mixed = write_corpus(tmp_path)
    bare = [Shard(f.path, f.num_pairs) for f in one]
    got = lambda data: record(data, TrainStream, epoch_slice, resume_point, tmp_path)
    as_corpus = lambda shards: [
        TrainingCorpus("en-de", "en", "de", "real", 1.0, (), shards, sum(f.num_pairs for f in shards))
    ]
    assert got(training_data(as_corpus(one), 5.0)) == want["one_pair"]
    assert got(training_data(as_corpus(bare), 5.0)) == want["one_pair_rows"]
    mix = Mix.by_temperature(mixed, 5.0, piece_rows=PIECE)
    assert list(mix.rows) == want["mixed_rows"] and got(mix) == want["mixed"]
    assert mix_record(as_corpus(one), 5.0) is want["data_mix_one_pair"] is None


def test_one_pair_plans_are_ee135a8s_for_any_shards():
    """The epoch reads and every worker's slice of a mix of one corpus are ee135a8's one-pair
    ones (tests/todays_stream.py) over shard counts, empty shards, index blocks, seeds and sizes."""
    import todays_stream as today

    from raymt.data.epoch import Mix, epoch_reads, slice_bounds

    rng = np.random.default_rng(5)
    for case in range(40):
        sizes = rng.integers(0, 3000, rng.integers(1, 9)).tolist()
        sizes[0] = max(sizes[0], 1)
        shards = [
            Shard(f"s3://b/train/part-{k:05d}.parquet", n, tuple(token_index(rng.integers(2, 40, n))))
            for k, n in enumerate(sizes)
        ]
        for files in (shards, [Shard(f.path, f.num_pairs) for f in shards]):
            mix = Mix.of_shards(files)
            for seed, epoch in ((case, 0), (3, case)):
                assert epoch_reads(mix, seed, epoch) == today.epoch_reads(files, seed, epoch)
                for world in (1, 2, 3, 5):
                    for rank in range(world):
                        want = today.slice_bounds(files, seed, epoch, rank, world)
                        assert slice_bounds(mix, seed, epoch, rank, world) == want, (case, sizes, seed, world)
