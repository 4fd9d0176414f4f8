"""Token-budget batching: budget held, every row once, little padding."""

import numpy as np
import torch

from raymt.batching import chunk_batches, collate, token_budget_batches
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
