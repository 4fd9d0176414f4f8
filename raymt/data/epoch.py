"""Each epoch's plan, pure: which rows every worker reads, in what order, and how a chunk of
them is cut into batches; computed from (seed, epoch) alike on the driver and every worker.

What the workers read is a `Mix`: training corpora, each its shards and the rows it gives
every epoch (temperature sampling, `raymt.data.mixing.epoch_rows`). One pair's shards are a
mix of one corpus that gives its size every epoch (`Mix.of_shards`); a prepared corpus of
several gives one corpus per pair and origin (docs/design-inputs.md section 4).

- Corpus i's stream is its corpus epochs one after another, each its shards in a permutation
  drawn from (seed, corpus epoch), each shard whole or, with data.shuffle_block_rows
  (`Mix.block_rows`), its blocks of that many rows in a permutation drawn from (seed, corpus
  epoch) too, so that chunks hold other pairs every epoch; epoch e takes its rows
  [e r_i, (e + 1) r_i), cut into pieces of 1024 rows (`PIECE_ROWS`) and interleaved by
  `epoch_pieces`. The concatenated reads are the epoch's plan (`epoch_reads`); one corpus read
  once an epoch is its shards in the permutation [seed, epoch, 7919], whole (or their blocks).
- The plan's rows are cut into `world_size` contiguous slices holding equal numbers of tokens
  (from each shard's token index in the manifest; equal numbers of rows for shards without
  one), so that every rank cuts about as many token-budget batches (`slice_bounds`).
- A worker's slice is cut into chunks of `chunk_rows` rows; each chunk is shuffled and cut
  into token-budget batches from length-sorted windows with a generator seeded by (seed,
  epoch, rank, chunk) (`cut_chunk`). A `Position` (epoch, chunk, batches consumed in the
  chunk) is all a checkpoint needs to resume.
- A group of another size resuming mid-epoch (elastic training) shares a `Segment`: the rows
  the epoch had left, minus the pairs of the batches already taken from the current chunks
  (`raymt.data.stream.resize_segment` reads those chunks again to learn which).

Reading the shards and streaming batches is `raymt.data.stream`'s job.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np

from raymt.batching import ShapeLadder, chunk_batches
from raymt.config import DataConfig
from raymt.data.format import TOKEN_INDEX_ROWS, TRAIN_DIR, Shard, TrainingCorpus
from raymt.data.mixing import epoch_rows

Read = tuple[str, int, int]  # (path, first row, end row) of one shard

# Orders an epoch's shards (a corpus epoch's, with the corpus index, in a mix of several).
SHARD_ORDER = 7919
# Mixes the epoch's pieces.
MIX_STREAM = 7927
# Orders each shard's blocks in a corpus epoch (`Mix.block_rows`).
BLOCK_ORDER = 7933
# Rows of one piece of the epoch's mixed schedule: the token index's block, so that a
# worker's token share of a mixed epoch is cut at known counts.
PIECE_ROWS = TOKEN_INDEX_ROWS


@dataclass
class Position:
    """Where a worker stands in an epoch: chunks done, and batches used of the next chunk."""

    epoch: int = 0
    chunk: int = 0
    batches: int = 0

    def to_dict(self) -> dict:
        """Plain ints, as stored in a checkpoint."""
        return asdict(self)


@dataclass
class Segment:
    """The rest of an epoch whose worker group changed size mid-way (elastic training).

    `reads` hold the rows the epoch had left when the group was resized, in order; `done`
    the positions (in the concatenation of `reads`) of pairs trained before the resize,
    which the new group skips. The new group cuts `reads` into equal row slices, one per
    worker, each cut into chunks and batches as usual with `generation` in the seeds.
    """

    epoch: int
    generation: int  # resizes so far in this epoch
    reads: list[Read]
    done: list[int]  # sorted

    def to_dict(self) -> dict:
        """Plain lists and ints, as stored in a checkpoint."""
        return {
            "epoch": self.epoch,
            "generation": self.generation,
            "reads": [list(r) for r in self.reads],
            "done": list(self.done),
        }

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> Optional["Segment"]:
        """The segment a checkpoint stored, or None."""
        if not d:
            return None
        return cls(int(d["epoch"]), int(d["generation"]), [tuple(r) for r in d["reads"]], [int(i) for i in d["done"]])

    @property
    def num_rows(self) -> int:
        """Rows of the segment, trained before the resize or not."""
        return sum(e - s for _, s, e in self.reads)

    def num_left(self) -> int:
        """Pairs of the segment still to train."""
        return self.num_rows - len(self.done)

    def bounds(self, rank: int, world_size: int) -> tuple[int, int]:
        """This worker's rows [lo, hi) of the segment."""
        return row_bounds(self.num_rows, rank, world_size)


# ---------------------------------------------------------------- the mix schedule


class Piece(NamedTuple):
    """Rows [lo, hi) of one corpus's stream (its epochs one after another) in an epoch's schedule."""

    corpus: int
    lo: int
    hi: int


def epoch_pieces(rows: Sequence[int], seed: int, epoch: int, piece_rows: int = PIECE_ROWS) -> list[Piece]:
    """Epoch `epoch`'s read order: corpus i's stream rows [epoch r_i, (epoch + 1) r_i) cut into
    m_i pieces of `piece_rows`, interleaved so that every stretch of the schedule holds the
    epoch's mix (a worker's contiguous slice too): piece j of corpus i goes at (j + u_i) / m_i,
    with offsets u_i in [0, 1) drawn from (seed, epoch) only. One corpus: its rows in order."""
    return [Piece(*p) for p in zip(*(a.tolist() for a in _schedule(rows, seed, epoch, piece_rows)))]


def _schedule(rows: Sequence[int], seed: int, epoch: int, piece_rows: int) -> tuple[np.ndarray, ...]:
    """`epoch_pieces` as arrays: each piece's corpus, first and end row, in read order."""
    counts = [math.ceil(r / piece_rows) for r in rows]
    offsets = np.random.default_rng([seed, epoch, MIX_STREAM]).random(len(rows))
    corpus = np.repeat(np.arange(len(rows)), counts)
    index = np.concatenate([np.arange(m) for m in counts])
    at = (index + offsets[corpus]) / np.asarray(counts)[corpus]
    order = np.lexsort((corpus, at))  # by position, ties to the lower corpus
    corpus, index = corpus[order], index[order]
    r = np.asarray(rows, dtype=np.int64)[corpus]
    lo = epoch * r + index * piece_rows
    return corpus, lo, np.minimum(lo + piece_rows, (epoch + 1) * r)


def _runs(rows: Sequence[int], seed: int, epoch: int, piece_rows: int) -> list[Piece]:
    """The epoch's pieces with each run of one corpus's consecutive rows joined into one (the
    same reads, planned faster: one corpus read once an epoch is a single run)."""
    corpus, lo, hi = _schedule(rows, seed, epoch, piece_rows)
    if not len(corpus):
        return []
    first = np.flatnonzero(np.r_[True, (corpus[1:] != corpus[:-1]) | (lo[1:] != hi[:-1])])
    last = np.r_[first[1:], len(corpus)] - 1
    return [Piece(*p) for p in zip(corpus[first].tolist(), lo[first].tolist(), hi[last].tolist())]


def stream_ranges(num_pairs: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Stream rows [lo, hi) of a corpus of `num_pairs` pairs as (corpus epoch, first row, end row)."""
    assert 0 <= lo <= hi and num_pairs > 0, (num_pairs, lo, hi)
    out = []
    while lo < hi:
        k, start = divmod(lo, num_pairs)
        end = min(num_pairs, start + hi - lo)
        out.append((k, start, end))
        lo += end - start
    return out


# ---------------------------------------------------------------- what the workers read


@dataclass(frozen=True, eq=False)
class Mix:
    """Training corpora mixed by temperature: each corpus's shards and the rows it gives every
    epoch (docs/design-inputs.md section 4); one pair's shards are a mix of one corpus."""

    corpora: Sequence[Sequence[Shard]]  # stored as tuples of `Shard`
    rows: Sequence[int]  # r_i: corpus i's rows per epoch (`raymt.data.mixing.epoch_rows`)
    piece_rows: int = PIECE_ROWS  # rows of one piece of the interleaved schedule
    block_rows: int = 0  # shards read in blocks of this many rows in a new order each corpus epoch; 0: whole

    def __post_init__(self) -> None:
        corpora = tuple(tuple(Shard(*f) for f in shards) for shards in self.corpora)
        object.__setattr__(self, "corpora", corpora)
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        # Built by code from a prepared corpus's manifest: the user's mistakes are caught before.
        # (A corpus gives rows only if it has pairs; one pair's empty shards give an empty epoch.)
        assert len(self.rows) == len(corpora) > 0 and min(self.rows) >= 0, (len(corpora), self.rows)
        assert all(n > 0 or r == 0 for n, r in zip(self.sizes, self.rows)), (self.sizes, self.rows)
        assert self.piece_rows > 0 and self.block_rows >= 0, (self.piece_rows, self.block_rows)
        index = {f.path: i for i, shards in enumerate(corpora) for f in shards}
        assert len(index) == sum(map(len, corpora)), "a shard is listed twice"
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_shards", {f.path: f for shards in corpora for f in shards})
        object.__setattr__(self, "_plans", {})  # (seed, epoch) -> reads and their tokens, the last two
        object.__setattr__(self, "_lock", threading.Lock())  # a stream's reader thread plans ahead

    def __reduce__(self):
        # Sent to each worker (the lock does not pickle; the plans are computed again there).
        return Mix, (self.corpora, self.rows, self.piece_rows, self.block_rows)

    def with_blocks(self, block_rows: int) -> Mix:
        """The same corpora and rows read in blocks of `block_rows` (0: shards whole); self if so already."""
        return self if block_rows == self.block_rows else Mix(self.corpora, self.rows, self.piece_rows, block_rows)

    @classmethod
    def of_shards(cls, shards: Sequence[Shard], block_rows: int = 0) -> Mix:
        """One pair's shards (or (path, num_pairs) tuples): one corpus, read once every epoch."""
        shards = [Shard(*f) for f in shards]
        return cls([shards], [sum(f.num_pairs for f in shards)], block_rows=block_rows)

    @classmethod
    def by_temperature(
        cls,
        corpora: Sequence[Sequence[Shard]],
        temperature: float,
        weights: Optional[Sequence[float]] = None,
        piece_rows: int = PIECE_ROWS,
        block_rows: int = 0,
    ) -> Mix:
        """The mix of `corpora` sampled at `temperature` (p_i ~ (w_i n_i)^(1/T))."""
        sizes = [sum(Shard(*f).num_pairs for f in shards) for shards in corpora]
        return cls(corpora, epoch_rows(sizes, temperature, weights), piece_rows, block_rows)

    @property
    def sizes(self) -> list[int]:
        """n_i: pairs of each corpus (one corpus epoch)."""
        return [sum(f.num_pairs for f in shards) for shards in self.corpora]

    @property
    def num_rows(self) -> int:
        """Rows of one epoch: sum of r_i."""
        return sum(self.rows)

    @property
    def token_indexed(self) -> bool:
        """Whether every shard has a token index (slices then hold equal tokens)."""
        return all(f.token_index for shards in self.corpora for f in shards if f.num_pairs)

    @property
    def single(self) -> bool:
        """One corpus read once per epoch (one pair's run): its trace names no corpus."""
        return len(self.corpora) == 1 and self.rows[0] == self.sizes[0]

    @property
    def names(self) -> list[str]:
        """Each corpus's name: the `train/<name>/` directory of its shards, else its index."""
        return [corpus_name(shards[0].path) or str(i) for i, shards in enumerate(self.corpora)]

    def corpus_of(self, path: str) -> int:
        """The index of the corpus a shard belongs to."""
        return self._index[path]

    def shard(self, path: str) -> Shard:
        """The shard at `path`."""
        return self._shards[path]


def training_data(corpora: list[TrainingCorpus], temperature: float, block_rows: int = 0) -> Mix:
    """What the workers read: a prepared corpus's training corpora (`training_corpora`) mixed at
    `temperature` by their weights (one pair's a mix of one), their shards read in blocks of
    `block_rows` (data.shuffle_block_rows; 0: whole)."""
    shards, weights = [c.shards for c in corpora], [c.weight for c in corpora]
    return Mix.by_temperature(shards, temperature, weights, block_rows=block_rows)


def mix_record(corpora: list[TrainingCorpus], temperature: float) -> Optional[dict]:
    """A mix's `data_mix` (checkpoints keep it): its corpora's names, the rows each gives every
    epoch and the temperature; None for one corpus read once per epoch, whose positions are
    positions in its shards at any temperature (as ee135a8 wrote for one pair)."""
    data = training_data(corpora, temperature)
    if data.single:
        return None
    return {"names": [c.name for c in corpora], "rows": list(data.rows), "temperature": float(temperature)}


def corpus_name(path: str) -> Optional[str]:
    """ "en-de" for a shard at .../train/en-de/part-00000.parquet (a prepared corpus of several)."""
    match = re.search(rf"(?:^|/){TRAIN_DIR}/([^/]+)/[^/]+$", path)
    return match.group(1) if match else None


# ---------------------------------------------------------------- an epoch's reads


def corpus_epoch_reads(mix: Mix, seed: int, corpus: int, k: int) -> list[Read]:
    """Corpus `corpus`'s epoch `k`: its shards in the permutation [seed, k, 7919, corpus]
    ([seed, k, 7919], the one-pair order, in a mix of one), each whole or, with `mix.block_rows`,
    its blocks of that many rows (the last may be short) in permutations drawn in shard order
    from [seed, k, 7933, corpus] ([seed, k, 7933] in a mix of one)."""
    shards = mix.corpora[corpus]
    tail = [corpus] if len(mix.corpora) > 1 else []
    order = np.random.default_rng([seed, k, SHARD_ORDER] + tail).permutation(len(shards))
    if not mix.block_rows:
        return [(shards[i].path, 0, shards[i].num_pairs) for i in order if shards[i].num_pairs]
    blocks, size, reads = np.random.default_rng([seed, k, BLOCK_ORDER] + tail), mix.block_rows, []
    for i in order:
        path, n = shards[i].path, shards[i].num_pairs
        reads += [(path, b * size, min(n, (b + 1) * size)) for b in blocks.permutation(-(-n // size)).tolist()]
    return reads


def epoch_reads(mix: Mix, seed: int, epoch: int) -> list[Read]:
    """Every row of the epoch as reads, in read order: each piece of `epoch_pieces` mapped to its
    corpus epochs' shards; a read continuing the one before it joins it (one corpus read once
    an epoch: its shards whole, in their order)."""
    return list(_plan(mix, seed, epoch)[0])


def _plan(mix: Mix, seed: int, epoch: int) -> tuple[list[Read], list[float]]:
    """An epoch's reads and the tokens of each, kept on the mix for the next caller (every
    slice of an epoch cuts the same plan)."""
    key = (seed, epoch)
    with mix._lock:
        if key in mix._plans:
            return mix._plans[key]
        if len(mix._plans) >= 2:  # the epoch being read (and resized) and the next; older ones are done
            mix._plans.pop(next(iter(mix._plans)))
        reads, shard = _reads(mix, seed, epoch), mix.shard
        indexed = mix.token_indexed  # else no tokens: slices hold equal rows
        tokens = [tokens_before(shard(p), e) - tokens_before(shard(p), s) for p, s, e in reads] if indexed else []
        mix._plans[key] = reads, tokens
        return reads, tokens


def _reads(mix: Mix, seed: int, epoch: int) -> list[Read]:
    """`epoch_reads`, computed."""
    sizes, reads = mix.sizes, []
    corpus_epochs: dict[tuple[int, int], tuple[list, list[int]]] = {}  # (corpus, k) -> reads, offsets
    for piece in _runs(mix.rows, seed, epoch, mix.piece_rows):
        for k, lo, hi in stream_ranges(sizes[piece.corpus], piece.lo, piece.hi):
            if (piece.corpus, k) not in corpus_epochs:
                plan = corpus_epoch_reads(mix, seed, piece.corpus, k)
                corpus_epochs[piece.corpus, k] = plan, np.cumsum([0] + [e - s for _, s, e in plan]).tolist()
            plan, offsets = corpus_epochs[piece.corpus, k]
            j = bisect.bisect_right(offsets, lo) - 1  # the read holding row lo of the corpus epoch
            while lo < hi:
                path, start, end = plan[j]
                a, b = start + lo - offsets[j], min(end, start + hi - offsets[j])
                if reads and reads[-1][0] == path and reads[-1][2] == a:
                    reads[-1] = (path, reads[-1][1], b)
                else:
                    reads.append((path, a, b))
                lo, j = offsets[j] + b - start, j + 1
    return reads


# ---------------------------------------------------------------- each worker's slice


def slice_bounds(mix: Mix, seed: int, epoch: int, rank: int, world_size: int) -> tuple[int, int]:
    """This worker's rows [lo, hi) of the epoch, in epoch order: equal shares of tokens (of rows
    when a shard has no token index)."""
    if not mix.token_indexed:
        return row_bounds(mix.num_rows, rank, world_size)
    reads, tokens = _plan(mix, seed, epoch)
    return _token_cut(mix, reads, tokens, rank, world_size), _token_cut(mix, reads, tokens, rank + 1, world_size)


def _token_cut(mix: Mix, reads: list[Read], tokens: list[float], k: int, world_size: int) -> int:
    """The row (in epoch order) where the first k/world_size of the epoch's tokens end,
    assuming each index block's tokens spread evenly over its rows."""
    target = round(sum(tokens)) * k // world_size
    rows, done = 0, 0.0
    for (path, start, end), n in zip(reads, tokens):
        if done + n < target or k == world_size:
            rows, done = rows + end - start, done + n
            continue
        shard = mix.shard(path)
        row = row_at_tokens(shard, tokens_before(shard, start) + target - done)
        return rows + min(max(row, start), end) - start
    return rows


def tokens_before(shard: Shard, row: int) -> float:
    """Tokens of a shard's rows before `row`, spread evenly over each index block's rows."""
    b = row // TOKEN_INDEX_ROWS
    if b >= len(shard.token_index):
        return float(shard.token_index[-1])
    lo, hi = b * TOKEN_INDEX_ROWS, min((b + 1) * TOKEN_INDEX_ROWS, shard.num_pairs)
    before = shard.token_index[b - 1] if b else 0
    return before + (shard.token_index[b] - before) * (row - lo) / (hi - lo)


def row_at_tokens(shard: Shard, tokens: float) -> int:
    """The shard row where `tokens` tokens end (`tokens_before`'s inverse, rounded)."""
    cumulative = np.asarray(shard.token_index, dtype=np.int64)
    b = min(int(np.searchsorted(cumulative, tokens)), len(cumulative) - 1)
    block_lo = b * TOKEN_INDEX_ROWS
    block_hi = min(block_lo + TOKEN_INDEX_ROWS, shard.num_pairs)
    before = int(cumulative[b - 1]) if b else 0
    share = (tokens - before) / max(int(cumulative[b]) - before, 1)
    return block_lo + round(share * (block_hi - block_lo))


def row_bounds(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [lo, hi) of `rank` when `num_rows` are cut into `world_size` equal slices."""
    return num_rows * rank // world_size, num_rows * (rank + 1) // world_size


def epoch_slice(mix: Mix, seed: int, epoch: int, rank: int, world_size: int) -> list[Read]:
    """This worker's rows of the epoch as (path, first row, end row) per shard, in read order."""
    return sub_plan(epoch_reads(mix, seed, epoch), *slice_bounds(mix, seed, epoch, rank, world_size))


def skip_rows(plan: list[Read], num_rows: int) -> list[Read]:
    """The plan without its first `num_rows` rows (whole files dropped, one trimmed)."""
    out = []
    for path, start, end in plan:
        if num_rows >= end - start:
            num_rows -= end - start
            continue
        out.append((path, start + num_rows, end))
        num_rows = 0
    return out


def sub_plan(plan: list[Read], lo: int, hi: int) -> list[Read]:
    """Rows [lo, hi) of the plan's concatenated rows, as reads."""
    out, offset = [], 0
    for path, start, end in plan:
        a, b = max(lo - offset, 0), min(hi - offset, end - start)
        if a < b:
            out.append((path, start + a, start + b))
        offset += end - start
    return out


# ---------------------------------------------------------------- a chunk's batches


def chunk_rng(
    seed: int, epoch: int, rank: int, chunk_index: int, segment: Optional[Segment] = None
) -> np.random.Generator:
    """The generator that shuffles and cuts one chunk of a worker's slice."""
    return np.random.default_rng([seed, epoch, rank, chunk_index] + ([segment.generation] if segment else []))


def cut_chunk(
    src, tgt, cfg: DataConfig, rng: np.random.Generator, excluded: Optional[np.ndarray] = None
) -> list[np.ndarray]:
    """A chunk's batches (row indices); pairs longer than data.max_len and `excluded` rows are dropped.
    `src` and `tgt` are (values, offsets) of the chunk's id columns."""
    src_lens, tgt_lens = np.diff(src[1]), np.diff(tgt[1])
    ok = (src_lens > 0) & (tgt_lens > 0) & (src_lens <= cfg.max_len) & (tgt_lens <= cfg.max_len)
    if excluded is not None:
        ok[excluded] = False
    keep = np.flatnonzero(ok)
    batches = chunk_batches(
        src_lens[keep] + 1,
        tgt_lens[keep] + 1,
        cfg.window_rows,
        cfg.max_tokens,
        rng,
        shuffle=cfg.shuffle_buffer_rows > 0,
        pad_multiple=cfg.pad_multiple,
        ladder=ShapeLadder.from_config(cfg),
    )
    return [keep[b] for b in batches]


def restore_position(saved: Optional[list], rank: int, world_size: int, epoch: int) -> Position:
    """This rank's saved position, or the start of `epoch` when none fits this world size."""
    if not saved or len(saved) != world_size:
        return Position(epoch)
    position = Position(**saved[rank])
    return position if position.epoch == epoch else Position(epoch)


# The data fields that cut a worker's chunks into batches: a saved position counts batches cut
# with them, so checkpoints record them (`batching_record`; read back by
# raymt.checkpoint.saved_batching) and a resume given others re-cuts.
# data.shuffle_block_rows orders the rows the chunks are cut from: positions count in that order.
BATCHING_FIELDS = (
    "max_len",
    "window_rows",
    "max_tokens",
    "shuffle_buffer_rows",
    "pad_multiple",
    "shape_buckets",
    "shuffle_block_rows",
)


def batching_record(cfg: DataConfig) -> dict:
    """The fields of `cfg` that cut chunks into batches, as a checkpoint records them."""
    return {name: getattr(cfg, name) for name in BATCHING_FIELDS}
