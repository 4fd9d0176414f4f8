"""ee135a8's one-pair epoch plan and shard reader, copied verbatim (test helper): the one-pair
stream is now a mix of one corpus (raymt.data.epoch), and the tests compare the two."""

import numpy as np
import pyarrow.parquet as pq

from raymt.data.format import COLUMNS, TOKEN_INDEX_ROWS, Shard
from raymt.storage import filesystem


def epoch_reads(files, seed: int, epoch: int) -> list[tuple[str, int, int]]:
    """Every row of the epoch as (path, first row, end row) per file, in read order."""
    files = [Shard(*f) for f in files]
    order = np.random.default_rng([seed, epoch, 7919]).permutation(len(files))
    return [(files[i].path, 0, files[i].num_pairs) for i in order if files[i].num_pairs]


def slice_bounds(files, seed: int, epoch: int, rank: int, world_size: int) -> tuple[int, int]:
    """This worker's rows of the epoch, as [lo, hi) in epoch order: equal shares of tokens."""
    files = [Shard(*f) for f in files]
    order = np.random.default_rng([seed, epoch, 7919]).permutation(len(files))
    if all(f.token_index for f in files if f.num_pairs):
        return _token_cut(files, order, rank, world_size), _token_cut(files, order, rank + 1, world_size)
    n = sum(f.num_pairs for f in files)
    return n * rank // world_size, n * (rank + 1) // world_size


def _token_cut(files: list, order: np.ndarray, k: int, world_size: int) -> int:
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
        cumulative = np.asarray(shard.token_index, dtype=np.int64)
        b = int(np.searchsorted(cumulative, target - tokens))
        block_lo = b * TOKEN_INDEX_ROWS
        block_hi = min(block_lo + TOKEN_INDEX_ROWS, shard.num_pairs)
        before = int(cumulative[b - 1]) if b else 0
        share = (target - tokens - before) / max(int(cumulative[b]) - before, 1)
        return rows + block_lo + round(share * (block_hi - block_lo))
    return rows


def read_plan(plan):
    """The planned rows in order: an open and its row groups per read."""
    for path, start, end in plan:
        fs, local = filesystem(path)
        with fs.open_input_file(local) as f:
            shard = pq.ParquetFile(f)
            first = 0
            for g in range(shard.metadata.num_row_groups):
                num_rows = shard.metadata.row_group(g).num_rows
                lo, hi = max(start - first, 0), min(end - first, num_rows)
                if lo < hi:
                    yield shard.read_row_group(g, columns=COLUMNS).slice(lo, hi - lo)
                first += num_rows
                if first >= end:
                    break
