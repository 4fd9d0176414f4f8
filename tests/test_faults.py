"""Faults: an update with a non-finite loss or gradient is skipped and changes nothing."""

import math

import torch

from raymt.batching import collate
from raymt.config import Config, tiny
from raymt.model import Transformer
from raymt.optim import make_optimizer
from raymt.worker import train_step


def test_nonfinite_update_is_skipped_then_training_goes_on():
    cfg = Config(model=tiny())
    torch.manual_seed(0)
    model = Transformer(cfg.model, 64)
    batch = collate([[5, 6, 3], [9, 3]], [[7, 8], [10]])
    with torch.no_grad():
        model.embed.weight[5] = float("inf")  # every row through token 5 turns into NaN
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, cfg.optim)

    loss, applied = train_step(model, optimizer, [batch], batch.num_tokens, cfg)
    assert not applied and not math.isfinite(loss)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True)
    assert not optimizer.state  # Adam's moments were not touched either
    assert all(p.grad is None for p in model.parameters())

    with torch.no_grad():
        model.embed.weight[5] = 0.1
    loss, applied = train_step(model, optimizer, [batch], batch.num_tokens, cfg)
    assert applied and math.isfinite(loss) and optimizer.state
