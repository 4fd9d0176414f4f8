"""Training pairs streamed from prepared Parquet shards, one stream per worker.

Ray Data prepares the shards (reading, cleaning and tokenizing in parallel over the
cluster, `raymt.data.prepare`). Ray Train's `streaming_split` would then hand blocks to
whichever worker asks first, so which worker sees which pair, and where an interrupted
epoch stood, could not be reproduced (ray#37633). Here each worker reads its own slice of
the epoch from the shards (local or object storage, through pyarrow) instead, as the epoch's
plan says (`raymt.data.epoch`: the mix's reads, each worker's slice of equal tokens, the
chunks' batches, positions and segments):

- a worker's slice is read in order (only the row groups holding it; each corpus keeps its
  shard open and a row group decoded until the last piece or block of the visit that needs
  it) and cut into chunks of `chunk_rows` rows (with data.shuffle_block_rows the slice's rows
  are the shards' blocks in an order of the epoch's, so chunks hold other pairs every
  epoch); each chunk is shuffled and cut into token-budget batches
  (`raymt.data.epoch.cut_chunk`), collated and handed out by a reader thread;
- the position (epoch, chunk, batches consumed in the chunk) is all a checkpoint needs:
  a resumed worker skips whole files, re-cuts one chunk and drops the batches it had used.

So a pair is seen exactly once per epoch of its corpus, batch composition depends only on
the seed and the epoch, and a resumed run neither repeats nor skips pairs.

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
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raymt.batching import Batch, ShapeLadder, collate_flat
from raymt.checkpoint import saved_batching
from raymt.config import DataConfig
from raymt.data.epoch import (
    Mix,
    Position,
    Read,
    Segment,
    chunk_rng,
    cut_chunk,
    epoch_reads,
    epoch_slice,
    restore_position,
    skip_rows,
    slice_bounds,
    sub_plan,
)
from raymt.data.format import COLUMNS
from raymt.storage import filesystem


def read_plan(plan: list[Read], corpus_of: Callable[[str], int]) -> Iterator[pa.Table]:
    """Stream the planned rows in order, reading only the row groups that hold them; tables gain
    a `corpus` column (`corpus_of`: `Mix.corpus_of`).

    The plan is fixed by (seed, epoch, rank), so the worker reads its own rows straight from
    the shards (local or any pyarrow filesystem). A Ray Data read per epoch cost 1.4-3.4 s
    before its first block and a few CPU-seconds of task start-up on cores busy training
    (benchmarks/NOTES.md); Ray Data does the parallel work before this (`raymt.data.prepare`).
    A mixed plan has one read per 1024-row piece, a shuffled one (`Mix.block_rows`) one per block
    in an order of its own: each corpus keeps its shard open while it reads there (a visit) and
    each row group decoded until the visit's last read that needs it, up to a read of rows read
    before (`_OpenShard`): one open per visit and one decode per row group it needs, not per
    piece or block.
    """
    open_shards: dict[int, _OpenShard] = {}
    corpora = [corpus_of(path) for path, _, _ in plan]
    try:
        for i, (path, start, end) in enumerate(plan):
            corpus = corpora[i]
            shard = open_shards.get(corpus)
            if shard is None or shard.path != path:
                if shard is not None:
                    shard.close()
                shard = open_shards[corpus] = _OpenShard(path, _visit(plan, corpora, i))
            for table in shard.rows(start, end):
                yield table.append_column("corpus", pa.array(np.full(len(table), corpus, np.int32)))
    finally:
        for shard in open_shards.values():
            shard.close()


def _visit(plan: list[Read], corpora: list[int], i: int) -> list[tuple[int, int]]:
    """The rows [start, end) of plan[i] and of the reads after it that its corpus makes of the
    same shard before it reads another (the corpus's reads the shard stays open for)."""
    path, corpus, out = plan[i][0], corpora[i], []
    for j in range(i, len(plan)):
        if corpora[j] == corpus:
            if plan[j][0] != path:
                break
            out.append((plan[j][1], plan[j][2]))
    return out


class _OpenShard:
    """An open shard, the reads its corpus makes of it before it moves to another shard (a visit)
    and the row groups decoded that reads to come still need.

    A visit is read in passes, each up to the first read of rows it has read before (a corpus
    epoch of a small corpus read again): a row group is decoded once per pass that needs it,
    whatever order the pass's pieces or blocks come in, and dropped after its last read there.
    """

    def __init__(self, path: str, reads: list[tuple[int, int]]):
        fs, local = filesystem(path)
        self.path, self.file = path, fs.open_input_file(local)
        self.parquet = pq.ParquetFile(self.file)
        meta = self.parquet.metadata
        # starts[g]: row group g's first row in the shard; starts[-1]: the shard's rows.
        self.starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]).tolist()
        self.reads, self.next = reads, 0  # the visit's reads, and the index of the next one
        self.uses: dict[int, int] = {}  # row group -> reads of this pass still to come that need it
        self.tables: dict[int, pa.Table] = {}

    def _groups(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(row group, first row, end row) of the row groups holding rows [start, end)."""
        g = bisect.bisect_right(self.starts, start) - 1
        while g < len(self.starts) - 1 and self.starts[g] < end:
            lo, hi = max(start, self.starts[g]), min(end, self.starts[g + 1])
            if lo < hi:
                yield g, lo, hi
            g += 1

    def _count_pass(self) -> None:
        """Count the row groups each read of the next pass needs."""
        lo, hi = [], []  # the rows read so far in the pass: disjoint [lo, hi), sorted
        for start, end in self.reads[self.next :]:
            i = bisect.bisect_right(lo, start)
            if (i and hi[i - 1] > start) or (i < len(lo) and lo[i] < end):
                return  # rows read again: the next pass starts here
            lo.insert(i, start), hi.insert(i, end)
            for g, _, _ in self._groups(start, end):
                self.uses[g] = self.uses.get(g, 0) + 1

    def rows(self, start: int, end: int) -> Iterator[pa.Table]:
        """Rows [start, end) of the shard (the visit's next read), one table per row group."""
        if not self.uses:
            self._count_pass()
        self.next += 1
        for g, lo, hi in list(self._groups(start, end)):
            table = self.tables.get(g)
            if table is None:
                table = self.tables[g] = self.parquet.read_row_group(g, columns=COLUMNS)
            self.uses[g] = self.uses.get(g, 1) - 1
            if self.uses[g] <= 0:  # no read of this pass needs it again
                del self.tables[g], self.uses[g]
            yield table.slice(lo - self.starts[g], hi - lo)

    def close(self) -> None:
        """Close the file."""
        self.file.close()


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
        mix: Mix,
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
        self.mix, self.num_epochs = mix, num_epochs
        self.names = [] if mix.single else mix.names  # a mixed trace names each pair's corpus
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

    def epoch_plan(self, epoch: int, skip_chunks: int = 0) -> list[Read]:
        """This worker's (path, first row, end row) reads of `epoch`, without its first chunks."""
        segment = self.segment_of(epoch)
        if segment is None:
            plan = epoch_slice(self.mix, self.seed, epoch, self.rank, self.world_size)
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
            read = _ReadAhead(read_plan(plan, self.mix.corpus_of))
            try:
                for table in chunks(iter(read), self.chunk_rows):
                    src, tgt = flat(table.column("src_ids")), flat(table.column("tgt_ids"))
                    base = chunk_index * self.chunk_rows
                    excluded = done[np.searchsorted(done, base) : np.searchsorted(done, base + len(table))] - base
                    rng = chunk_rng(self.seed, epoch, self.rank, chunk_index, segment)
                    corpus = table.column("corpus").to_numpy() if self.trace and self.names else None
                    for b, idx in enumerate(cut_chunk(src, tgt, self.cfg, rng, excluded)[skip:], start=skip):
                        hashes = pair_hashes(src, tgt, idx) if self.trace else []
                        if hashes and corpus is not None:  # a mixed stream's trace names each pair's corpus
                            hashes = [f"{self.names[corpus[i]]}:{h}" for i, h in zip(idx, hashes)]
                        batch = collate_flat(src, tgt, idx, self.cfg.pad_multiple, ladder, self.cfg.tag_side)
                        yield (
                            (batch.pin_memory() if self.pin_memory else batch),
                            Position(epoch, chunk_index, b + 1),
                            hashes,
                        )
                    chunk_index, skip = chunk_index + 1, 0
            finally:
                read.close()
            chunk_index = 0


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


def resume_point(
    files: Mix,
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
    with other `batching` fields (a resume with another data.max_tokens, or another
    data.shuffle_block_rows: `files` are read in `cfg`'s), the start of a segment holding what
    the epoch has left (`resize_segment`, which reads and cuts the old batches as they were)."""
    segment = Segment.from_dict(segment)
    # Checkpoints before 12-05 record none; a record without data.shuffle_block_rows read shards whole.
    before = replace(cfg, **saved_batching(batching)) if batching else cfg
    if saved and (len(saved) != world_size or before != cfg):
        old = (
            files.with_blocks(before.shuffle_block_rows)
            if before.shuffle_block_rows != cfg.shuffle_block_rows
            else files
        )
        return Position(epoch), resize_segment(old, before, seed, epoch, saved, segment)
    return restore_position(saved, rank, world_size, epoch), segment


def resize_segment(
    files: Mix, cfg: DataConfig, seed: int, epoch: int, saved: list[dict], segment: Optional[Segment]
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
            table = pa.concat_tables(read_plan(sub_plan(reads, start, end), files.corpus_of))
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
