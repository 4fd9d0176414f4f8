"""raymt.profiling.train_flops (the hardware ratio's FLOP formula) against torch's own FLOP counter."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from raymt.batching import collate
from raymt.config import ModelConfig
from raymt.model import Transformer
from raymt.optim import loss_sum
from raymt.profiling import train_flops


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
    cfg = ModelConfig(
        d_model=32, num_heads=2, d_ff=48, num_encoder_layers=layers[0], num_decoder_layers=layers[1], dropout=0.0
    )
    model = Transformer(cfg, 64)
    batch = collate([[5, 6, 7, 8, 9, 3], [5, 6, 3]], [[10, 11, 12], [13, 14, 15, 16, 17, 18, 19]])
    monkeypatch.setattr(F, "scaled_dot_product_attention", explicit_attention)
    with FlopCounterMode(display=False) as counter:
        loss_sum(model(batch.src, batch.tgt_in), batch.tgt_out, 0.1).backward()
    assert counter.get_total_flops() == train_flops(cfg, 64, batch)
