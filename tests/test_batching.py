"""Token-budget batching: budget held, every row once, little padding, few shapes."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymt.batching import chunk_batches, collate, collate_flat, pad_batch, round_up, token_budget_batches
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID
from raymt.trainer import lockstep


def test_budget_and_coverage():
    rng = np.random.default_rng(0)
    src_lens, tgt_lens = rng.integers(1, 60, 1000), rng.integers(1, 60, 1000)
    batches = token_budget_batches(src_lens, tgt_lens, 512, np.random.default_rng(1))
    seen = np.sort(np.concatenate(batches))
    assert np.array_equal(seen, np.arange(1000))
    longest = np.maximum(src_lens, tgt_lens)
    assert all(len(b) * longest[b].max() <= 512 for b in batches)
    real = sum(longest[b].sum() for b in batches)
    padded = sum(len(b) * longest[b].max() for b in batches)
    assert real / padded > 0.9  # length-sorted windows keep padding small


def test_chunk_batches_cover_rows_once_within_budget_and_repeat_with_the_seed():
    rng = np.random.default_rng(0)
    src_lens, tgt_lens = rng.integers(2, 40, 700), rng.integers(2, 40, 700)
    cut = lambda seed: chunk_batches(src_lens, tgt_lens, 128, 256, np.random.default_rng(seed))
    batches = cut(5)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(700))
    longest = np.maximum(src_lens, tgt_lens)
    assert all(len(b) * longest[b].max() <= 256 for b in batches)
    assert [b.tolist() for b in cut(5)] == [b.tolist() for b in batches]
    assert [b.tolist() for b in cut(6)] != [b.tolist() for b in batches]


def test_collate_adds_bos_and_eos():
    b = collate([[5, 6, EOS_ID], [7, EOS_ID]], [[8], [9, 10, 11]])
    assert b.num_tokens == 2 + 4
    assert (b.tgt_in[:, 0] == BOS_ID).all()
    rows = {tuple(r[r != PAD_ID].tolist()) for r in b.tgt_out}
    assert rows == {(8, EOS_ID), (9, 10, 11, EOS_ID)}


def test_lockstep_single_process_groups():
    batches = [collate([[5, EOS_ID]], [[6, 7]]) for _ in range(5)]
    groups = list(lockstep(batches, 2, torch.device("cpu")))
    assert [len(u.batches) for u in groups] == [2, 2, 1]
    assert [u.num_tokens for u in groups] == [6, 6, 3]


def row_by_row_batches(src_lens, tgt_lens, max_tokens, rng):
    """The per-row greedy cut that token_budget_batches replaced (the reference)."""
    longest = np.maximum(src_lens, tgt_lens)
    order = np.lexsort((rng.random(len(longest)), tgt_lens, src_lens, longest))
    batches, start, batch_max = [], 0, 0
    for pos, i in enumerate(order):
        new_max = max(batch_max, int(longest[i]))
        if pos > start and new_max * (pos - start + 1) > max_tokens:
            batches.append(order[start:pos])
            start, new_max = pos, int(longest[i])
        batch_max = new_max
    if len(order) > start:
        batches.append(order[start:])
    rng.shuffle(batches)
    return batches


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), max_size=400),
    st.integers(1, 4096),
    st.integers(0, 2**32 - 1),
)
def test_vectorized_cut_equals_the_row_by_row_cut(lens, max_tokens, seed):
    src_lens = np.array([s for s, _ in lens], dtype=np.int64)
    tgt_lens = np.array([t for _, t in lens], dtype=np.int64)
    new = token_budget_batches(src_lens, tgt_lens, max_tokens, np.random.default_rng(seed))
    old = row_by_row_batches(src_lens, tgt_lens, max_tokens, np.random.default_rng(seed))
    assert [b.tolist() for b in new] == [b.tolist() for b in old]


def flat(rows):
    """(values, offsets) of ragged rows, as Arrow lays out a list column."""
    lens = np.array([len(r) for r in rows])
    return np.array([i for r in rows for i in r], dtype=np.int32), np.concatenate([[0], np.cumsum(lens)])


def test_padded_widths_are_multiples_and_the_budget_counts_them():
    rng = np.random.default_rng(0)
    rows = [rng.integers(4, 100, int(n)).tolist() for n in rng.integers(1, 50, 2000)]
    tgt_rows = [rng.integers(4, 100, int(n)).tolist() for n in rng.integers(1, 50, 2000)]
    src, tgt = flat(rows), flat(tgt_rows)
    src_lens, tgt_lens = np.diff(src[1]) + 1, np.diff(tgt[1]) + 1
    for b in chunk_batches(src_lens, tgt_lens, 500, 600, np.random.default_rng(1), pad_multiple=8):
        batch = collate_flat(src, tgt, b, pad_multiple=8)
        assert batch.src.shape[1] % 8 == 0 and batch.tgt_out.shape[1] % 8 == 0
        assert len(b) * max(batch.src.shape[1], batch.tgt_out.shape[1]) <= 600
        assert batch.src.shape[1] - 8 < src_lens[b].max() <= batch.src.shape[1]
        assert batch.num_tokens == int((batch.tgt_out != PAD_ID).sum())  # counted on the host
        exact = collate([rows[i] + [EOS_ID] for i in b], [tgt_rows[i] for i in b])
        assert torch.equal(batch.src[:, : exact.src.shape[1]], exact.src)
        assert torch.equal(batch.tgt_in[:, : exact.tgt_in.shape[1]], exact.tgt_in)
        assert not batch.src[:, exact.src.shape[1] :].any()  # the extra columns are PAD (0)


def test_shape_ladder_bounds_the_shapes_of_an_epoch():
    # Multi30k-like lengths (3-40 tokens), 20k pairs, one epoch of 2048-token batches.
    rng = np.random.default_rng(3)
    src_lens = np.clip(rng.normal(15, 6, 20_000).round(), 3, 40).astype(np.int64)
    tgt_lens = np.clip((src_lens * rng.uniform(0.8, 1.4, 20_000)).round(), 3, 40).astype(np.int64)
    src = (np.full(int(src_lens.sum()), 5, np.int32), np.concatenate([[0], np.cumsum(src_lens)]))
    tgt = (np.full(int(tgt_lens.sum()), 5, np.int32), np.concatenate([[0], np.cumsum(tgt_lens)]))

    def shapes(multiple):
        cut = chunk_batches(src_lens + 1, tgt_lens + 1, 16384, 2048, np.random.default_rng(0), pad_multiple=multiple)
        batches = [collate_flat(src, tgt, b, multiple) for b in cut]
        return {(tuple(b.src.shape), tuple(b.tgt_out.shape)) for b in batches}

    ladder, exact = shapes(8), shapes(1)
    widths = {(s[1], t[1]) for s, t in ladder}
    rungs = round_up(41, 8) // 8  # widths 8, 16, ..., 48
    assert all(s % 8 == 0 and t % 8 == 0 for s, t in widths) and len(widths) <= rungs * rungs
    assert len(ladder) * 4 <= len(exact)  # measured: 16 shapes against 125


def test_pad_batch_pads_rows_with_prefix_and_suffix():
    assert pad_batch([[5, 6], [7]]).tolist() == [[5, 6], [7, PAD_ID]]
    assert pad_batch([[5, 6], [7]], prefix=BOS_ID, suffix=EOS_ID, multiple=8).tolist() == [
        [BOS_ID, 5, 6, EOS_ID] + [PAD_ID] * 4,
        [BOS_ID, 7, EOS_ID] + [PAD_ID] * 5,
    ]
