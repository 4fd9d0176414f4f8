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

When a checkpoint written by N workers is resumed by M (elastic training: Ray Train
restarts a smaller group after a node is lost, a larger one when nodes return), the epoch's
remaining rows become a `Segment`: the old workers' unread rows, minus the pairs of the
batches they had already taken from their current chunks. The M workers share the segment
in equal row slices, so the resized epoch still trains every pair exactly once.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raymt.batching import Batch, ShapeLadder, chunk_batches, collate_flat
from raymt.config import DataConfig
from raymt.data.format import COLUMNS, TOKEN_INDEX_ROWS, Files, Shard
from raymt.storage import filesystem


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


def epoch_reads(files: Files, seed: int, epoch: int) -> list[tuple[str, int, int]]:
    """Every row of the epoch as (path, first row, end row) per file, in read order."""
    files = [Shard(*f) for f in files]
    order = np.random.default_rng([seed, epoch, 7919]).permutation(len(files))
    return [(files[i].path, 0, files[i].num_pairs) for i in order if files[i].num_pairs]


def slice_bounds(files: Files, seed: int, epoch: int, rank: int, world_size: int) -> tuple[int, int]:
    """This worker's rows of the epoch, as [lo, hi) in epoch order: equal shares of tokens."""
    files = [Shard(*f) for f in files]
    order = np.random.default_rng([seed, epoch, 7919]).permutation(len(files))
    if all(f.token_index for f in files if f.num_pairs):
        return _token_cut(files, order, rank, world_size), _token_cut(files, order, rank + 1, world_size)
    return row_bounds(sum(f.num_pairs for f in files), rank, world_size)


def row_bounds(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [lo, hi) of `rank` when `num_rows` are cut into `world_size` equal slices."""
    return num_rows * rank // world_size, num_rows * (rank + 1) // world_size


def epoch_slice(files: Files, seed: int, epoch: int, rank: int, world_size: int) -> list[tuple[str, int, int]]:
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


def read_plan(plan: list[tuple[str, int, int]]) -> Iterator[pa.Table]:
    """Stream the planned rows in order, reading only the row groups that hold them.

    The plan is fixed by (seed, epoch, rank), so the worker reads its own rows straight from
    the shards (local or any pyarrow filesystem). A Ray Data read per epoch cost 1.4-3.4 s
    before its first block and a few CPU-seconds of task start-up on cores busy training
    (benchmarks/NOTES.md); Ray Data does the parallel work before this (`raymt.data.prepare`).
    """
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
        files: Files,
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
            read = _ReadAhead(read_plan(plan))
            try:
                for table in chunks(iter(read), self.chunk_rows):
                    src, tgt = flat(table.column("src_ids")), flat(table.column("tgt_ids"))
                    base = chunk_index * self.chunk_rows
                    excluded = done[np.searchsorted(done, base) : np.searchsorted(done, base + len(table))] - base
                    rng = chunk_rng(self.seed, epoch, self.rank, chunk_index, segment)
                    for b, idx in enumerate(cut_chunk(src, tgt, self.cfg, rng, excluded)[skip:], start=skip):
                        hashes = pair_hashes(src, tgt, idx) if self.trace else []
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


def resume_point(
    files: Files,
    cfg: DataConfig,
    seed: int,
    epoch: int,
    saved: Optional[list],
    segment: Optional[dict],
    rank: int,
    world_size: int,
) -> tuple[Position, Optional[Segment]]:
    """Where a worker's stream starts from a checkpoint's positions (and segment): the saved
    position, or, when the checkpoint was written by a group of another size, the start of a
    segment holding what the epoch has left (`resize_segment`)."""
    segment = Segment.from_dict(segment)
    if saved and len(saved) != world_size:
        return Position(epoch), resize_segment(files, cfg, seed, epoch, saved, segment)
    return restore_position(saved, rank, world_size, epoch), segment


def resize_segment(
    files: Files, cfg: DataConfig, seed: int, epoch: int, saved: list[dict], segment: Optional[Segment]
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
            table = pa.concat_tables(read_plan(sub_plan(reads, start, end)))
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
