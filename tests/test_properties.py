"""Property tests (hypothesis): cleaning and tokenization survive any Unicode, batching and
epoch slicing lose or repeat no pair, and workers stay in lockstep whatever they hold."""

import threading
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_checkpoint import tokenizer

from raymt.batching import chunk_batches, collate
from raymt.config import CONTENT_RULES, PrepareConfig
from raymt.data import clean
from raymt.data.epoch import Mix, epoch_slice
from raymt.data.format import TOKEN_INDEX_ROWS, Shard, token_index
from raymt.data.text import decode
from raymt.tokenizer import EOS_ID
from raymt.trainer import Collective, Done, lockstep

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The length, ratio and duplicate rules only (their counts are checked below), no content rule.
OPTIONS = PrepareConfig(
    max_chars=40, max_len=12, max_ratio=3.0, ratio_min_len=3, dedup=True, seed=1, **dict.fromkeys(CONTENT_RULES, False)
)


@FAST
@given(st.lists(st.tuples(st.text(max_size=60), st.text(max_size=60)), max_size=40))
def test_cleaning_and_tokenizing_any_unicode_accounts_for_every_pair(rows):
    tok = tokenizer()
    tally = clean.Tally()  # counts land here instead of in a Ray actor
    src = [s.strip() for s, _ in rows]
    tgt = [t.strip() for _, t in rows]
    table = pa.table({"src": src, "tgt": tgt, "source": [0] * len(rows), "line": list(range(1, len(rows) + 1))})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(clean, "_report", lambda _, key, counts: tally.put(key, counts))
        out = clean.tokenize_block(table, tok.model_proto, OPTIONS, None)
    counts = tally.total()
    dropped = sum(counts.get(rule, 0) for rule in ("empty", "too_long_chars", "too_long", "ratio"))
    assert len(out) + dropped == len(rows)
    for column in ("src_ids", "tgt_ids"):
        for ids in out.column(column).to_pylist():
            assert 0 < len(ids) <= OPTIONS.max_len
            assert all(0 <= i < tok.vocab_size for i in ids)
            assert isinstance(tok.decode(ids), str)
    assert len(out.column("h")) == len(out)  # every kept pair carries its dedup hash


@FAST
@given(st.binary(max_size=80))
def test_any_bytes_decode_or_fail_in_one_line(raw):
    try:
        text = decode(raw, "f.en", 7, "error")
    except ValueError as err:
        assert "f.en:7: not valid UTF-8" in str(err) and "\n" not in str(err)
    else:
        assert text is not None
    try:
        expected = raw.decode("utf-8")
    except UnicodeDecodeError:
        expected = None  # skipped (and counted by the reader)
    assert decode(raw, "f.en", 7, "skip") == expected
    assert isinstance(decode(raw, "f.en", 7, "replace"), str)


@FAST
@given(
    st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=300),
    st.integers(8, 200),
    st.sampled_from([64, 128, 512]),
    st.integers(0, 2**32 - 1),
)
def test_chunk_batches_keep_every_row_once_within_budget(lengths, window_rows, max_tokens, seed):
    src_lens, tgt_lens = (np.array(x) for x in zip(*lengths))
    batches = chunk_batches(src_lens, tgt_lens, window_rows, max_tokens, np.random.default_rng(seed))
    assert Counter(np.concatenate(batches).tolist()) == Counter(range(len(lengths)))
    longest = np.maximum(src_lens, tgt_lens)
    for b in batches:  # a row longer than the budget travels alone
        assert len(b) * longest[b].max() <= max_tokens or len(b) == 1


@FAST
@given(
    st.lists(st.integers(0, 500), min_size=1, max_size=12),
    st.integers(1, 8),
    st.integers(0, 1000),
    st.integers(0, 10**6),
)
def test_epoch_slices_cover_each_pair_once_and_balance(sizes, world_size, epoch, seed):
    files = [(f"part-{i}", n) for i, n in enumerate(sizes)]
    seen, per_rank = Counter(), []
    for rank in range(world_size):
        plan = epoch_slice(Mix.of_shards(files), seed, epoch, rank, world_size)
        per_rank.append(sum(end - start for _, start, end in plan))
        seen.update((path, i) for path, start, end in plan for i in range(start, end))
    assert seen == Counter((path, i) for path, n in files for i in range(n))
    assert max(per_rank) - min(per_rank) <= 1


@FAST
@given(
    st.lists(st.lists(st.integers(2, 120), max_size=3000), min_size=1, max_size=6),
    st.integers(1, 8),
    st.integers(0, 1000),
    st.integers(0, 10**6),
)
def test_token_balanced_slices_cover_each_pair_once_and_balance_tokens(shards, world_size, epoch, seed):
    # Shards of very different sentence lengths, as when sources are concatenated.
    files = [
        Shard(f"part-{i}", len(lens), tuple(token_index(np.array(lens, dtype=np.int64))))
        for i, lens in enumerate(shards)
    ]
    lengths = {f"part-{i}": lens for i, lens in enumerate(shards)}
    seen, tokens = Counter(), []
    for rank in range(world_size):
        plan = epoch_slice(Mix.of_shards(files), seed, epoch, rank, world_size)
        tokens.append(sum(sum(lengths[path][start:end]) for path, start, end in plan))
        seen.update((path, i) for path, start, end in plan for i in range(start, end))
    assert seen == Counter((f.path, i) for f in files for i in range(f.num_pairs))
    # Each cut lands in the right index block: off by at most a block's tokens per cut.
    block = max(
        (sum(lens[j : j + TOKEN_INDEX_ROWS]) for lens in shards for j in range(0, len(lens), TOKEN_INDEX_ROWS)),
        default=0,
    )
    total = sum(map(sum, shards))
    assert all(abs(t - total / world_size) <= 2 * block + 1 for t in tokens)


class ThreadWorld(Collective):
    """An all-reduce across threads: each thread plays one worker (done when called)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.values: list = [None] * world_size
        self.local = threading.local()

    def all_reduce_sum_async(self, tensor: torch.Tensor) -> Done:
        self.values[self.local.rank] = tensor.clone()
        self.barrier.wait()
        total = torch.stack(self.values).sum(0)
        self.barrier.wait()
        return Done(total)


@FAST
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(1, 3))
def test_workers_stay_in_lockstep_whatever_they_hold(counts, update_freq):
    world = ThreadWorld(len(counts))
    steps: list = [None] * len(counts)

    def run(rank: int) -> None:
        world.local.rank = rank
        batches = [collate([[5, EOS_ID]], [[6] * (rank + 1)]) for _ in range(counts[rank])]
        steps[rank] = [
            (len(u.batches), u.num_tokens) for u in lockstep(batches, update_freq, torch.device("cpu"), world)
        ]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    expected = max(-(-n // update_freq) for n in counts)
    assert all(len(s) == expected for s in steps)  # the same number of updates everywhere
    for i in range(expected):  # ... and the same global token count at each of them
        assert len({s[i][1] for s in steps}) == 1
