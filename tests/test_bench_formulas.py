"""The FLOP formula of benchmarks/speed.py against torch's own FLOP counter."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.speed import train_flops
from raymt.batching import collate
from raymt.config import ModelConfig
from raymt.model import Transformer
from raymt.optim import loss_sum


def explicit_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0):
    """SDPA as two matmuls, which FlopCounterMode counts (the CPU kernel it does not)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T, S)
    if is_causal:
        t, s = scores.shape[-2:]
        attn_mask = torch.ones(t, s, dtype=torch.bool).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("layers", [(2, 1), (1, 3)])
def test_train_flops_is_what_torch_counts(monkeypatch, layers):
    cfg = ModelConfig(d_model=32, num_heads=2, d_ff=48, num_encoder_layers=layers[0],
                      num_decoder_layers=layers[1], dropout=0.0)
    model = Transformer(cfg, 64)
    batch = collate([[5, 6, 7, 8, 9, 3], [5, 6, 3]], [[10, 11, 12], [13, 14, 15, 16, 17, 18, 19]])
    monkeypatch.setattr(F, "scaled_dot_product_attention", explicit_attention)
    with FlopCounterMode(display=False) as counter:
        loss_sum(model(batch.src, batch.tgt_in), batch.tgt_out, 0.1).backward()
    assert counter.get_total_flops() == train_flops(cfg, 64, batch)


def test_lockstep_factor_is_the_slowest_worker_over_the_mean_worker():
    from benchmarks.step_balance import lockstep_factor

    assert lockstep_factor([[1.0, 3.0], [3.0, 1.0]]) == pytest.approx(3.0 / 2.0)  # each step waits 1 of 3
    assert lockstep_factor([[2.0, 4.0], [2.0, 4.0]]) == pytest.approx(1.0)  # equal steps: no wait


def test_self_times_subtract_nested_operators():
    from benchmarks.overhead_profile import self_times

    spans = [{"name": "aten::linear", "ts": 0, "dur": 10, "tid": 1, "cat": "cpu_op"},
             {"name": "aten::addmm", "ts": 1, "dur": 6, "tid": 1, "cat": "cpu_op"},
             {"name": "aten::copy_", "ts": 2, "dur": 2, "tid": 1, "cat": "cpu_op"},  # inside addmm
             {"name": "aten::add", "ts": 12, "dur": 3, "tid": 1, "cat": "cpu_op"},
             {"name": "aten::add", "ts": 0, "dur": 50, "tid": 2, "cat": "cpu_op"}]  # another thread
    assert self_times(spans, 1) == {"aten::linear": 4, "aten::addmm": 4, "aten::copy_": 2, "aten::add": 3}


def test_plain_loop_intervals_cover_every_batch():
    from benchmarks.speed import PlainLoop
    from raymt.config import Config

    cfg = ModelConfig(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)
    loop = PlainLoop(Transformer(cfg, 32), Config(model=cfg), "cpu")
    batches = [collate([[5, 6, 3]] * (i + 1), [[7, 8, 9, 3]] * (i + 1)) for i in range(5)]
    parts = loop.intervals(batches, 2)
    # 4 target tokens + EOS per row, steps of 1..5 rows: (1, 2), (3, 4), (5)
    assert [n for n, _, _ in parts] == [5 * 3, 5 * 7, 5 * 5]
    assert all(s > 0 and rss > 0 for _, s, rss in parts)
