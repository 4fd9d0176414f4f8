"""Hugging Face `MarianMTModel` runs of a raymt Transformer, for peer benchmarks on the same weights.

The twin itself is raymt's `--format marian` export (`raymt.exporting.to_marian`, re-exported
here): every weight of a post-norm raymt model in a MarianMTModel, tests/test_peers.py
checks it. `marian_train_step` and `marian_translate` mirror raymt's `train_step` and `translate`:
same loss, same length-sorted batches, same per-sentence length limit with EOS forced at it.
With `length_penalty=0` on both sides beam search returns the same ids as raymt's.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, MarianMTModel

from raymt.batching import Batch
from raymt.decoding import length_batches, pad_batch
from raymt.exporting import to_marian  # noqa: F401 (the twin benchmarks build)
from raymt.optim import loss_sum
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID


def marian_logits(model: MarianMTModel, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    """Teacher forcing as raymt's `model(src, tgt_in)`: (B, S), (B, T) ids -> (B, T, V) logits."""
    return model(input_ids=src, attention_mask=src != PAD_ID, decoder_input_ids=tgt_in, use_cache=False).logits


def marian_train_step(
    model: MarianMTModel,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    label_smoothing: float = 0.1,
    clip_norm: float = 1.0,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> int:
    """One update as raymt's one-worker `train_step` (autocast: bf16 on GPU); returns target tokens."""
    model.train()
    num_tokens = batch.num_tokens
    with autocast():
        logits = marian_logits(model, batch.src, batch.tgt_in)
    (loss_sum(logits, batch.tgt_out, label_smoothing) / num_tokens).backward()
    max_norm = clip_norm if clip_norm > 0 else float("inf")
    if bool(torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return num_tokens


class ForceEosAtLimit(LogitsProcessor):
    """Rows at their own length limit may only emit EOS (raymt's per-sentence `_force_eos`)."""

    def __init__(self, limits: torch.Tensor, num_beams: int):
        self.limits = limits.repeat_interleave(num_beams)  # (B*K,): beams of a sentence are adjacent

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids (N, 1 + generated) -> scores with non-EOS tokens at -inf where at the limit."""
        forced = torch.full_like(scores, -float("inf"))
        forced[:, EOS_ID] = scores[:, EOS_ID]
        return torch.where((input_ids.size(1) >= self.limits)[:, None], forced, scores)


def max_lengths(src: torch.Tensor, max_len_a: float, max_len_b: int, max_positions: int) -> torch.Tensor:
    """(B,) output length limits, EOS included: raymt's a * src_len + b rule."""
    src_len = (src != PAD_ID).sum(1).float()
    return (max_len_a * src_len + max_len_b).long().clamp(min=1, max=max_positions - 1)


def generation_config(beam_size: int, max_new_tokens: int, length_penalty: float) -> GenerationConfig:
    """Plain beam search (greedy for beam 1) that stops a sentence at `beam_size` finished hypotheses."""
    beam = {"early_stopping": True, "length_penalty": length_penalty} if beam_size > 1 else {}
    return GenerationConfig(
        num_beams=beam_size,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_length=0,
        no_repeat_ngram_size=0,
        repetition_penalty=1.0,
        suppress_tokens=[PAD_ID, BOS_ID],
        forced_eos_token_id=None,
        forced_bos_token_id=None,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        num_return_sequences=1,
        use_cache=True,
        **beam,
    )


def _strip(row: list[int]) -> list[int]:
    """Generated ids without the start token, cut before the first EOS."""
    row = row[1:]
    return row[: row.index(EOS_ID)] if EOS_ID in row else row


@torch.no_grad()
def marian_generate(
    model: MarianMTModel,
    src: torch.Tensor,
    beam_size: int,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    length_penalty: float = 0.0,
) -> list[list[int]]:
    """Decode one (B, S) batch of source ids: the best ids per sentence, without BOS/EOS."""
    # length_penalty is HF's (score / length ** lp), not raymt's GNMT one; at 0 the two agree.
    limits = max_lengths(src, max_len_a, max_len_b, model.config.max_position_embeddings)
    out = model.generate(
        input_ids=src,
        attention_mask=src != PAD_ID,
        generation_config=generation_config(beam_size, int(limits.max()), length_penalty),
        logits_processor=LogitsProcessorList([ForceEosAtLimit(limits, beam_size)]),
    )
    return [_strip(row) for row in out.tolist()]


def marian_translate(
    model: MarianMTModel,
    src_ids: Sequence[Sequence[int]],
    beam_size: int,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    batch_size: int = 64,
    length_penalty: float = 0.0,
) -> list[list[int]]:
    """Decode encoded sources (EOS included) in raymt's length-sorted batches; input order out."""
    model.eval()
    device = model.device
    out: list[list[int]] = [[] for _ in src_ids]
    for idx in length_batches([len(s) for s in src_ids], batch_size):
        hyps = marian_generate(
            model, pad_batch([src_ids[i] for i in idx], device), beam_size, max_len_a, max_len_b, length_penalty
        )
        for i, h in zip(idx, hyps):
            out[i] = h
    return out
