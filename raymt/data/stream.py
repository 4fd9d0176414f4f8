"""Training pairs streamed from prepared Parquet shards, one stream per worker.

Ray Data prepares the shards (reading, cleaning and tokenizing in parallel over the
cluster, `raymt.data.prepare`). Ray Train's `streaming_split` would then hand blocks to
whichever worker asks first, so which worker sees which pair, and where an interrupted
epoch stood, could not be reproduced (ray#37633). Here each worker reads its own slice of
the epoch from the shards (local or object storage, through pyarrow) instead:

- the epoch's file order is a permutation drawn from (seed, epoch); the concatenated rows
  are cut into `world_size` contiguous slices holding equal numbers of tokens (from each
  shard's token index in the manifest; equal numbers of rows for shards without one), so
  that every rank cuts about as many token-budget batches and none waits at the epoch's
  end for another (a corpus concatenated from sources of different sentence lengths
  would otherwise give one rank the long sentences and more batches);
- a worker's slice is read in order (only the row groups holding it) and cut into chunks of
  `chunk_rows` rows; each chunk is shuffled and cut into token-budget batches from
  length-sorted windows with a generator seeded by (seed, epoch, rank, chunk);
- the position (epoch, chunk, batches consumed in the chunk) is all a checkpoint needs:
  a resumed worker skips whole files, re-cuts one chunk and drops the batches it had used.

So a pair is seen exactly once per epoch, batch composition depends only on the seed and
the epoch, and a resumed run neither repeats nor skips pairs.

Several corpora (multilingual training, docs/design-inputs.md section 4) come as a `Mix`: each
corpus's shards and the rows it gives every epoch (temperature sampling,
`raymt.data.inputs.epoch_rows`). Corpus i's stream is its corpus epochs one after another;
epoch e takes its rows [e r_i, (e + 1) r_i), cut into pieces of 1024 rows and interleaved by
`raymt.data.inputs.epoch_pieces`. The concatenated reads are the epoch's plan, and everything
after it (slices, chunks, batches, positions, resizes) is the one-corpus code. A `Mix` of one
corpus that gives its own size every epoch runs that code on its shards, unchanged.

When a checkpoint written by N workers is resumed by M (elastic training: Ray Train
restarts a smaller group after a node is lost, a larger one when nodes return), the epoch's
remaining rows become a `Segment`: the old workers' unread rows, minus the pairs of the
batches they had already taken from their current chunks. The M workers share the segment
in equal row slices, so the resized epoch still trains every pair exactly once.
"""

from __future__ import annotations

import bisect
import hashlib
import queue
import re
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raymt.batching import Batch, ShapeLadder, chunk_batches, collate_flat
from raymt.config import DataConfig
from raymt.data.format import COLUMNS, TOKEN_INDEX_ROWS, TRAIN_DIR, Corpus, Files, Shard
from raymt.data.inputs import PIECE_ROWS, epoch_pieces, epoch_rows, stream_ranges
from raymt.storage import filesystem

# Orders an epoch's shards (a corpus epoch's, with the corpus index, in a mix of several).
SHARD_ORDER = 7919


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
    reads: list[tuple[str, int, int]]
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


# ---------------------------------------------------------------- several corpora


@dataclass(frozen=True, eq=False)
class Mix:
    """Training corpora mixed by temperature: each corpus's shards and the rows it gives every
    epoch (docs/design-inputs.md section 4). Stands in for `files` in the functions below."""

    corpora: Sequence[Sequence[Shard]]  # stored as tuples of `Shard`
    rows: Sequence[int]  # r_i: corpus i's rows per epoch (`raymt.data.inputs.epoch_rows`)
    piece_rows: int = PIECE_ROWS  # rows of one piece of the interleaved schedule

    def __post_init__(self) -> None:
        corpora = tuple(tuple(Shard(*f) for f in shards) for shards in self.corpora)
        object.__setattr__(self, "corpora", corpora)
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        # Built by code from a prepared corpus's manifest: the user's mistakes are caught before.
        assert len(self.rows) == len(corpora) > 0 and min(self.rows) > 0, (len(corpora), self.rows)
        assert min(self.sizes) > 0 and self.piece_rows > 0, (self.sizes, self.piece_rows)
        index = {f.path: i for i, shards in enumerate(corpora) for f in shards}
        assert len(index) == sum(map(len, corpora)), "a shard is listed twice"
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_shards", {f.path: f for shards in corpora for f in shards})
        object.__setattr__(self, "_plans", {})  # (seed, epoch) -> reads and their tokens, the last two
        object.__setattr__(self, "_lock", threading.Lock())  # a stream's reader thread plans ahead

    def __reduce__(self):
        # Sent to each worker (the lock does not pickle; the plans are computed again there).
        return Mix, (self.corpora, self.rows, self.piece_rows)

    @classmethod
    def by_temperature(
        cls,
        corpora: Sequence[Sequence[Shard]],
        temperature: float,
        weights: Optional[Sequence[float]] = None,
        piece_rows: int = PIECE_ROWS,
    ) -> Mix:
        """The mix of `corpora` sampled at `temperature` (p_i ~ (w_i n_i)^(1/T))."""
        sizes = [sum(Shard(*f).num_pairs for f in shards) for shards in corpora]
        return cls(corpora, epoch_rows(sizes, temperature, weights), piece_rows)

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
        """One corpus read once per epoch: the one-corpus code runs on its shards."""
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


def training_data(train_files: list, temperature: float) -> Union[Files, Mix]:
    """What the workers read: one pair's shards as they are, or the `Mix` of a prepared corpus's
    training corpora (`format.Corpus`, `format.corpora`) at `temperature`, by their weights."""
    if not train_files or not isinstance(train_files[0], Corpus):
        return train_files
    return Mix.by_temperature([c.files for c in train_files], temperature, [c.weight for c in train_files])


def mix_record(train_files: list, temperature: float) -> Optional[dict]:
    """A multi-corpus run's `data_mix` (checkpoints keep it): its corpora's names, the rows each
    gives every epoch and the temperature; None for one pair's shards."""
    data = training_data(train_files, temperature)
    if not isinstance(data, Mix):
        return None
    return {"names": [c.name for c in train_files], "rows": list(data.rows), "temperature": float(temperature)}


def corpus_name(path: str) -> Optional[str]:
    """ "en-de" for a shard at .../train/en-de/part-00000.parquet (a prepared corpus of several)."""
    match = re.search(rf"(?:^|/){TRAIN_DIR}/([^/]+)/[^/]+$", path)
    return match.group(1) if match else None


def corpus_epoch_reads(mix: Mix, seed: int, corpus: int, k: int) -> list[tuple[str, int, int]]:
    """Corpus `corpus`'s epoch `k`: its shards in the permutation [seed, k, 7919, corpus]
    ([seed, k, 7919], the one-corpus order, in a mix of one)."""
    shards = mix.corpora[corpus]
    key = [seed, k, SHARD_ORDER] + ([corpus] if len(mix.corpora) > 1 else [])
    order = np.random.default_rng(key).permutation(len(shards))
    return [(shards[i].path, 0, shards[i].num_pairs) for i in order if shards[i].num_pairs]


def mixed_reads(mix: Mix, seed: int, epoch: int) -> list[tuple[str, int, int]]:
    """Every row of a mixed epoch as reads, in read order: each piece of `epoch_pieces`
    mapped to its corpus epochs' shards; a read continuing the one before it joins it."""
    return list(_mixed_plan(mix, seed, epoch)[0])


def _mixed_plan(mix: Mix, seed: int, epoch: int) -> tuple[list[tuple[str, int, int]], list[float]]:
    """A mixed epoch's reads and the tokens of each, kept on the mix for the next caller (every
    slice of an epoch cuts the same plan)."""
    key = (seed, epoch)
    with mix._lock:
        if key in mix._plans:
            return mix._plans[key]
        if len(mix._plans) >= 2:  # the epoch being read (and resized) and the next; older ones are done
            mix._plans.pop(next(iter(mix._plans)))
        reads, shard = _mixed_reads(mix, seed, epoch), mix.shard
        indexed = mix.token_indexed  # else no tokens: slices hold equal rows
        tokens = [_tokens_before(shard(p), e) - _tokens_before(shard(p), s) for p, s, e in reads] if indexed else []
        mix._plans[key] = reads, tokens
        return reads, tokens


def _mixed_reads(mix: Mix, seed: int, epoch: int) -> list[tuple[str, int, int]]:
    """`mixed_reads`, computed."""
    sizes, reads = mix.sizes, []
    corpus_epochs: dict[tuple[int, int], tuple[list, list[int]]] = {}  # (corpus, k) -> reads, offsets
    for piece in epoch_pieces(mix.rows, seed, epoch, mix.piece_rows):
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


def mixed_bounds(mix: Mix, seed: int, epoch: int, rank: int, world_size: int) -> tuple[int, int]:
    """A worker's rows [lo, hi) of a mixed epoch: equal shares of tokens (of rows when a shard
    has no token index)."""
    if not mix.token_indexed:
        return row_bounds(mix.num_rows, rank, world_size)
    reads, tokens = _mixed_plan(mix, seed, epoch)
    return _mixed_cut(mix, reads, tokens, rank, world_size), _mixed_cut(mix, reads, tokens, rank + 1, world_size)


def _mixed_cut(mix: Mix, reads: list, tokens: list[float], k: int, world_size: int) -> int:
    """The row (in epoch order) where the first k/world_size of a mixed epoch's tokens end,
    interpolated inside index blocks as `_token_cut` does (the same row for whole shards)."""
    target = round(sum(tokens)) * k // world_size
    rows, done = 0, 0.0
    for (path, start, end), n in zip(reads, tokens):
        if done + n < target or k == world_size:
            rows, done = rows + end - start, done + n
            continue
        shard = mix.shard(path)
        row = _row_at_tokens(shard, _tokens_before(shard, start) + target - done)
        return rows + min(max(row, start), end) - start
    return rows


def _tokens_before(shard: Shard, row: int) -> float:
    """Tokens of a shard's rows before `row`, spread evenly over each index block's rows."""
    b = row // TOKEN_INDEX_ROWS
    if b >= len(shard.token_index):
        return float(shard.token_index[-1])
    lo, hi = b * TOKEN_INDEX_ROWS, min((b + 1) * TOKEN_INDEX_ROWS, shard.num_pairs)
    before = shard.token_index[b - 1] if b else 0
    return before + (shard.token_index[b] - before) * (row - lo) / (hi - lo)


def _row_at_tokens(shard: Shard, tokens: float) -> int:
    """The shard row where `tokens` tokens end (`_tokens_before`'s inverse, rounded)."""
    cumulative = np.asarray(shard.token_index, dtype=np.int64)
    b = min(int(np.searchsorted(cumulative, tokens)), len(cumulative) - 1)
    block_lo = b * TOKEN_INDEX_ROWS
    block_hi = min(block_lo + TOKEN_INDEX_ROWS, shard.num_pairs)
    before = int(cumulative[b - 1]) if b else 0
    share = (tokens - before) / max(int(cumulative[b]) - before, 1)
    return block_lo + round(share * (block_hi - block_lo))


def epoch_reads(files: Union[Files, Mix], seed: int, epoch: int) -> list[tuple[str, int, int]]:
    """Every row of the epoch as (path, first row, end row) per file, in read order."""
    if isinstance(files, Mix):
        if not files.single:
            return mixed_reads(files, seed, epoch)
        files = files.corpora[0]
    files = [Shard(*f) for f in files]
    order = np.random.default_rng([seed, epoch, 7919]).permutation(len(files))
    return [(files[i].path, 0, files[i].num_pairs) for i in order if files[i].num_pairs]


def slice_bounds(files: Union[Files, Mix], seed: int, epoch: int, rank: int, world_size: int) -> tuple[int, int]:
    """This worker's rows of the epoch, as [lo, hi) in epoch order: equal shares of tokens."""
    if isinstance(files, Mix):
        if not files.single:
            return mixed_bounds(files, seed, epoch, rank, world_size)
        files = files.corpora[0]
    files = [Shard(*f) for f in files]
    order = np.random.default_rng([seed, epoch, 7919]).permutation(len(files))
    if all(f.token_index for f in files if f.num_pairs):
        return _token_cut(files, order, rank, world_size), _token_cut(files, order, rank + 1, world_size)
    return row_bounds(sum(f.num_pairs for f in files), rank, world_size)


def row_bounds(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [lo, hi) of `rank` when `num_rows` are cut into `world_size` equal slices."""
    return num_rows * rank // world_size, num_rows * (rank + 1) // world_size


def epoch_slice(
    files: Union[Files, Mix], seed: int, epoch: int, rank: int, world_size: int
) -> list[tuple[str, int, int]]:
    """This worker's rows of the epoch as (path, first row, end row) per file, in read order."""
    return sub_plan(epoch_reads(files, seed, epoch), *slice_bounds(files, seed, epoch, rank, world_size))


def _token_cut(files: list[Shard], order: np.ndarray, k: int, world_size: int) -> int:
    """The row (in epoch order) where the first k/world_size of the epoch's tokens end."""
    total = sum(f.token_index[-1] for f in files if f.num_pairs)
    target = total * k // world_size
    rows = tokens = 0
    for i in order:
        shard = files[i]
        if not shard.num_pairs:
            continue
        if tokens + shard.token_index[-1] < target or k == world_size:
            rows, tokens = rows + shard.num_pairs, tokens + shard.token_index[-1]
            continue
        # Inside this shard: find the index block that crosses the target, then assume the
        # block's tokens are spread evenly over its rows.
        cumulative = np.asarray(shard.token_index, dtype=np.int64)
        b = int(np.searchsorted(cumulative, target - tokens))
        block_lo = b * TOKEN_INDEX_ROWS
        block_hi = min(block_lo + TOKEN_INDEX_ROWS, shard.num_pairs)
        before = int(cumulative[b - 1]) if b else 0
        share = (target - tokens - before) / max(int(cumulative[b]) - before, 1)
        return rows + block_lo + round(share * (block_hi - block_lo))
    return rows


def skip_rows(plan: list[tuple[str, int, int]], num_rows: int) -> list[tuple[str, int, int]]:
    """The plan without its first `num_rows` rows (whole files dropped, one trimmed)."""
    out = []
    for path, start, end in plan:
        if num_rows >= end - start:
            num_rows -= end - start
            continue
        out.append((path, start + num_rows, end))
        num_rows = 0
    return out


def sub_plan(plan: list[tuple[str, int, int]], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """Rows [lo, hi) of the plan's concatenated rows, as reads."""
    out, offset = [], 0
    for path, start, end in plan:
        a, b = max(lo - offset, 0), min(hi - offset, end - start)
        if a < b:
            out.append((path, start + a, start + b))
        offset += end - start
    return out


def read_plan(plan: list[tuple[str, int, int]], corpus_of: Optional[Callable[[str], int]] = None) -> Iterator[pa.Table]:
    """Stream the planned rows in order, reading only the row groups that hold them.

    The plan is fixed by (seed, epoch, rank), so the worker reads its own rows straight from
    the shards (local or any pyarrow filesystem). A Ray Data read per epoch cost 1.4-3.4 s
    before its first block and a few CPU-seconds of task start-up on cores busy training
    (benchmarks/NOTES.md); Ray Data does the parallel work before this (`raymt.data.prepare`).
    With `corpus_of` (a mixed plan: `Mix.corpus_of`), see `read_mixed`.
    """
    if corpus_of is not None:
        yield from read_mixed(plan, corpus_of)
        return
    for path, start, end in plan:
        fs, local = filesystem(path)
        with fs.open_input_file(local) as f:
            shard = pq.ParquetFile(f)
            first = 0  # the row group's first row in the shard
            for g in range(shard.metadata.num_row_groups):
                num_rows = shard.metadata.row_group(g).num_rows
                lo, hi = max(start - first, 0), min(end - first, num_rows)
                if lo < hi:
                    yield shard.read_row_group(g, columns=COLUMNS).slice(lo, hi - lo)
                first += num_rows
                if first >= end:
                    break


def read_mixed(plan: list[tuple[str, int, int]], corpus_of: Callable[[str], int]) -> Iterator[pa.Table]:
    """`read_plan` of a mixed plan: one read per 1024-row piece, so each corpus keeps its shard
    open and its last row group decoded for the pieces that follow (one open and one row
    group read per shard and row group visited, not per piece). Tables gain a `corpus` column."""
    open_shards: dict[int, _OpenShard] = {}
    try:
        for path, start, end in plan:
            corpus = corpus_of(path)
            shard = open_shards.get(corpus)
            if shard is None or shard.path != path:
                if shard is not None:
                    shard.close()
                shard = open_shards[corpus] = _OpenShard(path)
            for table in shard.rows(start, end):
                yield table.append_column("corpus", pa.array(np.full(len(table), corpus, np.int32)))
    finally:
        for shard in open_shards.values():
            shard.close()


class _OpenShard:
    """An open shard of a mixed read, and the last row group read from it."""

    def __init__(self, path: str):
        fs, local = filesystem(path)
        self.path, self.file = path, fs.open_input_file(local)
        self.parquet = pq.ParquetFile(self.file)
        meta = self.parquet.metadata
        # starts[g]: row group g's first row in the shard; starts[-1]: the shard's rows.
        self.starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]).tolist()
        self.group, self.table = -1, None

    def rows(self, start: int, end: int) -> Iterator[pa.Table]:
        """Rows [start, end) of the shard, one table per row group."""
        g = bisect.bisect_right(self.starts, start) - 1
        while g < len(self.starts) - 1 and self.starts[g] < end:
            lo, hi = max(start, self.starts[g]), min(end, self.starts[g + 1])
            if lo < hi:
                if g != self.group:
                    self.group, self.table = g, self.parquet.read_row_group(g, columns=COLUMNS)
                yield self.table.slice(lo - self.starts[g], hi - lo)
            g += 1

    def close(self) -> None:
        """Close the file."""
        self.file.close()


def _read(files: Union[Files, Mix], plan: list[tuple[str, int, int]]) -> Iterator[pa.Table]:
    """`read_plan` for the stream of `files`: `read_mixed` when it mixes several corpora."""
    return read_plan(plan, files.corpus_of) if _mixed(files) else read_plan(plan)


def _mixed(files: Union[Files, Mix]) -> bool:
    """Whether `files` is a mix that the one-corpus code does not read."""
    return isinstance(files, Mix) and not files.single


def chunks(tables: Iterator[pa.Table], chunk_rows: int) -> Iterator[pa.Table]:
    """Regroup a stream of tables into tables of exactly `chunk_rows` rows (the last may be short)."""
    pending: list[pa.Table] = []
    num_pending = 0
    for table in tables:
        pending.append(table)
        num_pending += len(table)
        while num_pending >= chunk_rows:
            merged = pa.concat_tables(pending)
            yield merged.slice(0, chunk_rows)
            rest = merged.slice(chunk_rows)
            pending, num_pending = ([rest] if len(rest) else []), len(rest)
    if num_pending:
        yield pa.concat_tables(pending)


def flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list<int32> column; row i is values[offsets[i]:offsets[i + 1]]."""
    array = column.combine_chunks()
    return array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy()


def pair_hashes(src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray], idx: np.ndarray) -> list[str]:
    """A stable 64-bit hex digest of each pair's ids (for tracing what was trained on)."""
    out = []
    for i in idx:
        h = hashlib.blake2b(digest_size=8)
        h.update(src[0][src[1][i] : src[1][i + 1]].astype(np.int32).tobytes())
        h.update(b"|")
        h.update(tgt[0][tgt[1][i] : tgt[1][i + 1]].astype(np.int32).tobytes())
        out.append(h.hexdigest())
    return out


class TrainStream:
    """`num_epochs` consecutive epochs of a worker's token-budget batches from `position` on;
    `position` follows what was consumed.

    A background thread reads, cuts and collates up to `prefetch` batches ahead, so
    training rarely waits; `start()` begins that early (the training loop starts the next
    epoch's stream after the current epoch's first step). Over several epochs the thread
    goes on into the next epoch's plan without a pause. `busy_s` is the time the consumer
    waited.
    """

    def __init__(
        self,
        files: Union[Files, Mix],
        cfg: DataConfig,
        seed: int,
        rank: int,
        world_size: int,
        position: Position,
        trace: bool = False,
        prefetch: int = 16,
        pin_memory: bool = False,
        num_epochs: int = 1,
        segment: Optional[Segment] = None,
    ):
        self.cfg, self.seed, self.rank, self.world_size = cfg, seed, rank, world_size
        self.files, self.num_epochs = files, num_epochs
        self.names = files.names if isinstance(files, Mix) else []  # corpora of a mixed trace
        self.pin_memory = pin_memory  # page-locked batches for asynchronous copies to a GPU
        self.position = position
        self.segment = segment  # the rest of an epoch after a resize (elastic training)
        self.chunk_rows = cfg.shuffle_buffer_rows or cfg.window_rows
        self.plan = self.epoch_plan(position.epoch, skip_chunks=position.chunk)
        self.trace = trace
        self.traced: list[str] = []  # digests of the pairs handed out (trace only; caller clears)
        self.busy_s = 0.0
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.stopping = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def start(self) -> "TrainStream":
        """Start reading ahead (idempotent)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._produce, daemon=True, name="raymt-stream")
            self.thread.start()
        return self

    def close(self) -> None:
        """Stop the reader thread (batches not consumed are dropped)."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def __iter__(self) -> Iterator[Batch]:
        self.start()
        while True:
            t0 = time.perf_counter()
            item = self.queue.get()
            self.busy_s += time.perf_counter() - t0
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            batch, self.position, hashes = item
            self.traced += hashes
            yield batch

    def _produce(self) -> None:
        """Reader thread: every batch of the epoch from `position` on, then _END (or the error)."""
        batches = self._batches()
        try:
            for item in batches:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as err:  # handed to the consumer, raised in the training loop
            self._put(err)
        finally:
            batches.close()  # stops its read-ahead threads

    def _put(self, item) -> bool:
        """Queue an item unless the stream is being closed."""
        return put_unless_stopping(self.queue, self.stopping, item)

    def epoch_plan(self, epoch: int, skip_chunks: int = 0) -> list[tuple[str, int, int]]:
        """This worker's (path, first row, end row) reads of `epoch`, without its first chunks."""
        segment = self.segment_of(epoch)
        if segment is None:
            plan = epoch_slice(self.files, self.seed, epoch, self.rank, self.world_size)
        else:
            plan = sub_plan(segment.reads, *segment.bounds(self.rank, self.world_size))
        return skip_rows(plan, skip_chunks * self.chunk_rows)

    def segment_of(self, epoch: int) -> Optional[Segment]:
        """The segment `epoch` continues from a resize, if any."""
        return self.segment if self.segment is not None and self.segment.epoch == epoch else None

    def _batches(self) -> Iterator[tuple[Batch, Position, list[str]]]:
        """(batch, position after it, pair digests) for the rest of the stream's epochs."""
        first, end = self.position.epoch, self.position.epoch + self.num_epochs
        chunk_index, skip = self.position.chunk, self.position.batches
        ladder = ShapeLadder.from_config(self.cfg)
        for epoch in range(first, end):
            plan = self.plan if epoch == first else self.epoch_plan(epoch)
            segment = self.segment_of(epoch)
            # Pairs a resized epoch trained before the resize, numbered from this slice's start.
            done = np.asarray(segment.done if segment else [], dtype=np.int64)
            done -= segment.bounds(self.rank, self.world_size)[0] if segment else 0
            read = _ReadAhead(_read(self.files, plan))
            try:
                for table in chunks(iter(read), self.chunk_rows):
                    src, tgt = flat(table.column("src_ids")), flat(table.column("tgt_ids"))
                    base = chunk_index * self.chunk_rows
                    excluded = done[np.searchsorted(done, base) : np.searchsorted(done, base + len(table))] - base
                    rng = chunk_rng(self.seed, epoch, self.rank, chunk_index, segment)
                    corpus = table.column("corpus").to_numpy() if "corpus" in table.column_names else None
                    for b, idx in enumerate(cut_chunk(src, tgt, self.cfg, rng, excluded)[skip:], start=skip):
                        hashes = pair_hashes(src, tgt, idx) if self.trace else []
                        if hashes and corpus is not None:  # a mixed stream's trace names each pair's corpus
                            hashes = [f"{self.names[corpus[i]]}:{h}" for i, h in zip(idx, hashes)]
                        batch = collate_flat(src, tgt, idx, self.cfg.pad_multiple, ladder)
                        yield (
                            (batch.pin_memory() if self.pin_memory else batch),
                            Position(epoch, chunk_index, b + 1),
                            hashes,
                        )
                    chunk_index, skip = chunk_index + 1, 0
            finally:
                read.close()
            chunk_index = 0


def chunk_rng(
    seed: int, epoch: int, rank: int, chunk_index: int, segment: Optional[Segment] = None
) -> np.random.Generator:
    """The generator that shuffles and cuts one chunk of a worker's slice."""
    return np.random.default_rng([seed, epoch, rank, chunk_index] + ([segment.generation] if segment else []))


def cut_chunk(
    src, tgt, cfg: DataConfig, rng: np.random.Generator, excluded: Optional[np.ndarray] = None
) -> list[np.ndarray]:
    """A chunk's batches (row indices); pairs longer than data.max_len and `excluded` rows are dropped."""
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


def put_unless_stopping(q: queue.Queue, stopping: threading.Event, item) -> bool:
    """Put `item` on a bounded queue, giving up (False) once `stopping` is set."""
    while not stopping.is_set():
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


_END = object()  # the reader thread's end-of-stream marker


class _ReadAhead:
    """Pull the tables of a read in a thread of its own (up to `depth` ahead) from creation on."""

    def __init__(self, tables: Iterator[pa.Table], depth: int = 4):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._pull, args=(tables,), daemon=True, name="raymt-read")
        self.thread.start()

    def _pull(self, tables: Iterator[pa.Table]) -> None:
        """Reader: every table, then _END (or the error)."""
        try:
            for table in tables:
                if not self._put(table):
                    return
            self._put(_END)
        except BaseException as err:  # raised in the stream's thread
            self._put(err)

    def _put(self, item) -> bool:
        """Queue an item unless closed."""
        return put_unless_stopping(self.queue, self.stopping, item)

    def __iter__(self) -> Iterator[pa.Table]:
        while True:
            item = self.queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop reading (tables not taken are dropped)."""
        self.stopping.set()


def restore_position(saved: Optional[list], rank: int, world_size: int, epoch: int) -> Position:
    """This rank's saved position, or the start of `epoch` when none fits this world size."""
    if not saved or len(saved) != world_size:
        return Position(epoch)
    position = Position(**saved[rank])
    return position if position.epoch == epoch else Position(epoch)


# The data fields that cut a worker's chunks into batches: a saved position counts batches cut
# with them, so checkpoints record them (`batching_record`) and a resume given others re-cuts.
BATCHING_FIELDS = ("max_len", "window_rows", "max_tokens", "shuffle_buffer_rows", "pad_multiple", "shape_buckets")


def batching_record(cfg: DataConfig) -> dict:
    """The fields of `cfg` that cut chunks into batches, as a checkpoint records them."""
    return {name: getattr(cfg, name) for name in BATCHING_FIELDS}


def resume_point(
    files: Union[Files, Mix],
    cfg: DataConfig,
    seed: int,
    epoch: int,
    saved: Optional[list],
    segment: Optional[dict],
    rank: int,
    world_size: int,
    batching: Optional[dict] = None,
) -> tuple[Position, Optional[Segment]]:
    """Where a worker's stream starts from a checkpoint's positions (and segment): the saved
    position, or, when the checkpoint was written by a group of another size or cut its batches
    with other `batching` fields (a resume with another data.max_tokens), the start of a segment
    holding what the epoch has left (`resize_segment`, which cuts the old batches as they were)."""
    segment = Segment.from_dict(segment)
    before = replace(cfg, **batching) if batching else cfg  # checkpoints before 12-05 record none
    if saved and (len(saved) != world_size or before != cfg):
        return Position(epoch), resize_segment(files, before, seed, epoch, saved, segment)
    return restore_position(saved, rank, world_size, epoch), segment


def resize_segment(
    files: Union[Files, Mix], cfg: DataConfig, seed: int, epoch: int, saved: list[dict], segment: Optional[Segment]
) -> Optional[Segment]:
    """What `epoch` has left after the `len(saved)` workers stopped at `saved` positions, for a
    group of another size; None when none of it was trained (the epoch starts over).

    Each old worker trained the first chunks of its slice and the first batches of the next
    one; that chunk is read again and cut as it was, to learn which pairs those batches held.
    """
    world_size, chunk_rows = len(saved), cfg.shuffle_buffer_rows or cfg.window_rows
    segment = segment if segment is not None and segment.epoch == epoch else None
    if segment is None:
        reads, done = epoch_reads(files, seed, epoch), set()
        bounds = [slice_bounds(files, seed, epoch, r, world_size) for r in range(world_size)]
    else:
        reads, done = segment.reads, set(segment.done)
        bounds = [segment.bounds(r, world_size) for r in range(world_size)]
    left, trained = [], False  # [lo, hi) rows still to train, per old worker
    for rank, ((lo, hi), p) in enumerate(zip(bounds, (Position(**p) for p in saved))):
        if p.epoch != epoch:  # this worker had not started the epoch
            p = Position(epoch)
        start = lo + p.chunk * chunk_rows
        trained |= start > lo or p.batches > 0
        if p.batches:
            end = min(start + chunk_rows, hi)
            table = pa.concat_tables(_read(files, sub_plan(reads, start, end)))
            excluded = np.asarray(sorted(i - start for i in done if start <= i < end), dtype=np.int64)
            rng = chunk_rng(seed, epoch, rank, p.chunk, segment)
            batches = cut_chunk(flat(table.column("src_ids")), flat(table.column("tgt_ids")), cfg, rng, excluded)
            done.update(start + int(i) for idx in batches[: p.batches] for i in idx)
        if start < hi:
            left.append((start, hi))
    if not trained:
        return segment
    new_reads, new_done, offset, done = [], [], 0, sorted(done)
    for lo, hi in left:
        new_reads += sub_plan(reads, lo, hi)
        new_done += [offset + i - lo for i in done if lo <= i < hi]
        offset += hi - lo
    return Segment(epoch, (segment.generation if segment else 0) + 1, new_reads, new_done)
