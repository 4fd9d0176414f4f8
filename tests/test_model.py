"""Model: masks from the batch actually received, tied embeddings, norms."""

import dataclasses

import pytest
import torch

from raymt.config import tiny
from raymt.model import Transformer
from raymt.tokenizer import EOS_ID, PAD_ID


def mixed_batch(lengths, vocab=64, seed=0):
    """Right-padded rows of different lengths, each ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), max(lengths)), PAD_ID)
    for i, n in enumerate(lengths):
        out[i, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=g)
        out[i, n - 1] = EOS_ID
    return out


def test_split_batch_gives_rows_of_unsplit_batch(tiny_model):
    src = mixed_batch([9, 3, 7, 5, 2, 8, 4, 6])
    tgt = mixed_batch([5, 8, 2, 6, 3, 7, 4, 9], seed=1)
    with torch.no_grad():
        full = tiny_model(src, tgt)
        for rows in (slice(0, 4), slice(4, 8), slice(2, 3)):
            s, t = src[rows], tgt[rows]
            # Each shard trims its own padding, as a worker's collate would.
            s, t = s[:, : int((s != PAD_ID).sum(1).max())], t[:, : int((t != PAD_ID).sum(1).max())]
            part = tiny_model(s, t)
            for i in range(part.size(0)):
                n = int((t[i] != PAD_ID).sum())
                torch.testing.assert_close(part[i, :n], full[rows][i, :n], atol=1e-5, rtol=1e-5)


def test_source_padding_does_not_change_outputs(tiny_model):
    src, tgt = mixed_batch([6, 4]), mixed_batch([5, 5], seed=2)
    padded = torch.cat([src, torch.full((2, 5), PAD_ID)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(src, tgt), tiny_model(padded, tgt), atol=1e-5, rtol=1e-5)


def test_several_new_tokens_after_a_cache_decode_as_the_full_sequence(tiny_model):
    """A forced prefix or a draft of tokens passed at once after cached ones: the same logits."""
    src, tgt = mixed_batch([6, 4]), mixed_batch([7, 7], seed=3)
    with torch.no_grad():
        memory, src_mask = tiny_model.encode(src)
        full = tiny_model.decode(tgt, memory, src_mask)
        cache = tiny_model.new_cache()
        parts = [tiny_model.decode(tgt[:, a:b], memory, src_mask, cache) for a, b in ((0, 1), (1, 4), (4, 5), (5, 7))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_one_tied_embedding_matrix():
    model = Transformer(tiny(), vocab_size=72)
    vocab_shaped = [n for n, p in model.named_parameters() if 72 in p.shape]
    assert vocab_shaped == ["embed.weight"]
    assert torch.all(model.embed.weight[PAD_ID] == 0)


def test_a_target_vocabulary_of_its_own():
    """model.target_vocab_size: the decoder's own embedding and output rows; a shared model's
    state dict keeps its keys (checkpoints load unchanged)."""
    model = Transformer(dataclasses.replace(tiny(), target_vocab_size=40, tie_output=False), vocab_size=72)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if 72 in p.shape or 40 in p.shape}
    assert shapes == {"embed.weight": (72, 32), "target_embed.weight": (40, 32), "output.weight": (40, 32)}
    assert torch.all(model.target_embed.weight[PAD_ID] == 0)
    src, tgt = mixed_batch([6, 4], vocab=72), mixed_batch([5, 3], vocab=40, seed=1)
    assert model(src, tgt).shape == (2, 5, 40)
    assert "target_embed.weight" not in Transformer(tiny(), vocab_size=72).state_dict()
    with pytest.raises(ValueError, match="model.target_vocab_size=42 must be a positive multiple of 8"):
        dataclasses.replace(tiny(), target_vocab_size=42)


@pytest.mark.parametrize("pre_norm", [True, False])
def test_norm_variants_train(pre_norm):
    torch.manual_seed(0)
    cfg = dataclasses.replace(tiny(), pre_norm=pre_norm)
    model = Transformer(cfg, vocab_size=64)
    src, tgt = mixed_batch([5, 4]), mixed_batch([6, 3], seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        logits = model(src, tgt[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert isinstance(model.encoder_norm, torch.nn.LayerNorm) == pre_norm


def test_too_long_input_is_a_clear_error(tiny_model):
    src = torch.full((1, tiny_model.cfg.max_positions + 1), 5)
    with pytest.raises(ValueError, match="max_positions"):
        tiny_model.encode(src)


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_cpu_dropout_rate_scale_gradient_and_seed(p):
    from raymt.model import Dropout

    drop = Dropout(p).train()
    x = torch.ones(1000, 1000, requires_grad=True)
    torch.manual_seed(3)
    out = drop(x)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.002  # 1e6 draws: sd 0.0005
    assert torch.allclose(out[kept], torch.tensor(1 / (1 - p)), rtol=1e-4)
    assert abs(out.mean().item() - 1.0) < 0.005  # expectation preserved
    out.sum().backward()
    assert torch.equal(x.grad, out.detach())  # d out / d x = mask * scale
    torch.manual_seed(3)
    assert torch.equal(drop(x), out)  # the torch seed fixes the masks (exact resume)
    # Rows are not copies of each other (the 16-bit lanes are independent).
    assert not torch.equal(kept[0], kept[1])
    assert torch.equal(drop.eval()(x), x)
