"""Greedy and beam-search decoding with an incremental K/V cache (plain PyTorch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from raymt.model import Cache, Transformer, reorder_cache
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


@dataclass
class DecodeOptions:
    """How to search: beam 1 is greedy; output length is at most a * src_len + b."""

    beam: int = 5
    length_penalty: float = 0.6
    max_len_a: float = 1.2
    max_len_b: int = 10
    use_cache: bool = True


def _max_lengths(model: Transformer, src: torch.Tensor, opts: DecodeOptions) -> torch.Tensor:
    """(B,) output length limits, EOS included."""
    src_len = (src != PAD_ID).sum(1).float()
    limit = (opts.max_len_a * src_len + opts.max_len_b).long()
    return limit.clamp(min=1, max=model.cfg.max_positions - 1)


def _next_log_probs(model: Transformer, tokens: torch.Tensor, memory: torch.Tensor,
                    src_mask: torch.Tensor, cache: Optional[Cache]) -> torch.Tensor:
    """(N, T) prefixes -> (N, V) log-probabilities of the next token."""
    if cache is None:  # full recomputation: the reference the cache must match
        logits = model.decode(tokens, memory, src_mask)[:, -1]
    else:
        logits = model.decode(tokens[:, -1:], memory, src_mask, cache)[:, -1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    log_probs[:, PAD_ID] = -float("inf")
    log_probs[:, BOS_ID] = -float("inf")
    return log_probs


def _force_eos(log_probs: torch.Tensor, at_limit: torch.Tensor) -> torch.Tensor:
    """Rows at their length limit may only emit EOS."""
    forced = torch.full_like(log_probs, -float("inf"))
    forced[:, EOS_ID] = log_probs[:, EOS_ID]
    return torch.where(at_limit[:, None], forced, log_probs)


@torch.no_grad()
def greedy(model: Transformer, src: torch.Tensor, opts: DecodeOptions) -> list[list[int]]:
    """Greedy decoding of (B, S) source ids; returns token ids without BOS/EOS."""
    memory, src_mask = model.encode(src)
    limits = _max_lengths(model, src, opts)
    tokens = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)
    cache = model.new_cache() if opts.use_cache else None
    finished = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for step in range(int(limits.max())):
        log_probs = _force_eos(_next_log_probs(model, tokens, memory, src_mask, cache),
                               step + 1 >= limits)
        next_token = log_probs.argmax(-1).masked_fill(finished, PAD_ID)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        finished |= next_token == EOS_ID
        if finished.all():
            break
    return [_strip(row) for row in tokens[:, 1:].tolist()]


def _strip(ids: Sequence[int]) -> list[int]:
    """Ids up to (not including) the first EOS or PAD."""
    out = []
    for i in ids:
        if i in (EOS_ID, PAD_ID):
            break
        out.append(i)
    return out


def gnmt_penalty(length: int, alpha: float) -> float:
    """Wu et al. (2016) length penalty ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model: Transformer, src: torch.Tensor, opts: DecodeOptions) -> list[list[int]]:
    """Batched beam search of (B, S) source ids; returns the best hypothesis per sentence."""
    b, k = src.size(0), opts.beam
    memory, src_mask = model.encode(src)
    memory, src_mask = memory.repeat_interleave(k, 0), src_mask.repeat_interleave(k, 0)
    limits = _max_lengths(model, src, opts).repeat_interleave(k)  # (B*K,)
    tokens = torch.full((b * k, 1), BOS_ID, dtype=torch.long, device=src.device)
    scores = torch.zeros(b, k, device=src.device)
    scores[:, 1:] = -float("inf")  # all beams start identical: expand only the first
    cache = model.new_cache() if opts.use_cache else None
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    offsets = (torch.arange(b, device=src.device) * k)[:, None]
    for step in range(int(limits.max())):
        log_probs = _force_eos(_next_log_probs(model, tokens, memory, src_mask, cache),
                               step + 1 >= limits)
        vocab = log_probs.size(-1)
        cand = (scores.view(-1, 1) + log_probs).view(b, k * vocab)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # (B, 2K): at most K of them are EOS
        origin, token = top_idx // vocab, top_idx % vocab
        is_eos = token == EOS_ID
        # Finish EOS candidates that rank within the top K (as fairseq does).
        finishing = is_eos[:, :k] & torch.isfinite(top_scores[:, :k]) & ~done[:, None].to(src.device)
        for i, j in finishing.nonzero().tolist():
            hyp = tokens[i * k + origin[i, j], 1:].tolist()
            finished[i].append((top_scores[i, j].item() / gnmt_penalty(step + 1, opts.length_penalty), hyp))
        done |= torch.tensor([len(f) >= k for f in finished])
        if done.all():
            break
        # Continue with the best K candidates that did not end.
        scores, pick = top_scores.masked_fill(is_eos, -float("inf")).topk(k, dim=1)
        rows = (offsets + origin.gather(1, pick)).view(-1)
        tokens = torch.cat([tokens.index_select(0, rows), token.gather(1, pick).view(-1, 1)], dim=1)
        if cache is not None:
            reorder_cache(cache, rows)
    return [max(f)[1] if f else [] for f in finished]


def decode(model: Transformer, src: torch.Tensor, opts: DecodeOptions) -> list[list[int]]:
    """Greedy when opts.beam == 1, beam search otherwise."""
    return greedy(model, src, opts) if opts.beam == 1 else beam_search(model, src, opts)


def pad_batch(rows: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Right-pad lists of ids into a (B, T) tensor."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


def translate(model: Transformer, tokenizer: Tokenizer, sentences: Sequence[str],
              opts: DecodeOptions, batch_size: int = 64, device: str = "cpu") -> list[str]:
    """Translate raw sentences in length-sorted batches; output follows input order."""
    model.eval()
    max_src = model.cfg.max_positions - 1
    encoded = [tokenizer.encode(s)[:max_src - 1] + [EOS_ID] for s in sentences]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(encoded)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        hyps = decode(model, pad_batch([encoded[i] for i in idx], device), opts)
        for i, hyp in zip(idx, hyps):
            out[i] = tokenizer.decode(hyp)
    return out
