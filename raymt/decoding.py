"""Greedy, sampled and batched beam-search decoding with an incremental K/V cache (plain PyTorch).

Sentences that are done leave the batch: greedy drops a row as soon as it emits EOS, beam
search drops a sentence's K rows once it holds K finished hypotheses, the best of them no worse
than its best live prefix (`_done`). Tokens, scores,
memory, src_mask, length limits and the K/V cache are pruned together, so later steps
only pay for what is still being decoded. A hypothesis is (score, ids): its summed
log-probability divided by the GNMT length penalty, and its ids without BOS/EOS.

A model trained with its target-language tag on the decoder side (data.tag_side = "tgt",
fairseq's --decoder-langtok, M2M-100/NLLB) decodes from a forced `prefix`: every row's first
tokens after BOS are its prefix ids, taken at no cost (CTranslate2's `target_prefix`); the
length limit, the length penalty and the returned ids count the tokens after it only.

Every function taking a `model` takes a `raymt.ensemble.Ensemble` too: one search, whose step
log-probabilities are then the mean of the members' (`raymt.ensemble.model_log_probs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from raymt.batching import pad_batch
from raymt.config import DecodeOptions
from raymt.ensemble import Decoder, model_log_probs
from raymt.model import Cache, reorder_cache
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

Hypothesis = tuple[float, list[int]]
NEG_INF = -float("inf")


def _max_lengths(model: Decoder, src: torch.Tensor, opts: DecodeOptions, forced: int = 0) -> torch.Tensor:
    """(B,) output length limits, EOS included, after `forced` prefix tokens (counted in them)."""
    src_len = (src != PAD_ID).sum(1).float()
    limit = (opts.max_len_a * src_len + opts.max_len_b).long()
    return (limit.clamp(min=1) + forced).clamp(max=model.cfg.max_positions - 1)


def split_tags(src: torch.Tensor, tag_side: str = "src") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, S) sources whose first id is their target-language tag -> (sources, decoder prefix):
    for a model with data.tag_side "tgt" the tag leaves the source for the decoder's (B, 1)
    prefix; "src" keeps the sources as they are (no prefix)."""
    if tag_side == "src":
        return src, None
    return src[:, 1:], src[:, :1]


def _force_prefix(log_probs: torch.Tensor, prefix: torch.Tensor, step: int) -> torch.Tensor:
    """Every row emits its prefix's token at `step`, at no cost (in place); prefix: (N, P)."""
    log_probs.fill_(NEG_INF)
    return log_probs.scatter_(1, prefix[:, step : step + 1], 0.0)


def _next_log_probs(
    model: Decoder, tokens: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: Optional[Cache]
) -> torch.Tensor:
    """(N, T) prefixes -> (N, V) log-probabilities of the next token (an ensemble's: its members' mean)."""
    # Without a cache: full recomputation, the reference the cache must match.
    new = tokens if cache is None else tokens[:, -1:]
    out = model_log_probs(model, new, memory, src_mask, cache, last=True)  # (N, V)
    out[:, PAD_ID] = NEG_INF
    out[:, BOS_ID] = NEG_INF
    return out


def _force_eos(log_probs: torch.Tensor, at_limit: torch.Tensor) -> torch.Tensor:
    """Rows at their length limit may only emit EOS (in place: only those rows are touched)."""
    rows = at_limit.nonzero().squeeze(1)
    if rows.numel():  # a masked copy would write the whole (N, V) tensor at every step
        eos = log_probs[rows, EOS_ID]
        log_probs[rows] = NEG_INF
        log_probs[rows, EOS_ID] = eos
    return log_probs


def gnmt_penalty(length: int, alpha: float) -> float:
    """Wu et al. (2016) length penalty ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def _generator(opts: DecodeOptions, device: torch.device) -> Optional[torch.Generator]:
    """A seeded generator for sampling, or None (torch's global one)."""
    if not opts.sample or opts.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(opts.seed)


def _choose(log_probs: torch.Tensor, opts: DecodeOptions, generator: Optional[torch.Generator]) -> torch.Tensor:
    """(N, V) log-probabilities -> (N,) next tokens: the argmax, or a draw when sampling."""
    if not opts.sample:
        return log_probs.argmax(-1)
    logits = log_probs / opts.temperature
    if opts.top_k:
        kth = logits.topk(min(opts.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, NEG_INF)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)


@torch.no_grad()
def greedy_scored(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, prefix: Optional[torch.Tensor] = None
) -> list[Hypothesis]:
    """Greedy (or sampled) decoding of (B, S) source ids (after a forced (B, P) `prefix`, if
    given): one (score, ids) per sentence."""
    opts.check()
    b, forced = src.size(0), 0 if prefix is None else prefix.size(1)
    memory, src_mask = model.encode(src)  # (A, S, D), (A, 1, 1, S); A = rows still active
    limits = _max_lengths(model, src, opts, forced)  # (A,)
    tokens = torch.full((b, 1), BOS_ID, dtype=torch.long, device=src.device)  # (A, T)
    sums = torch.zeros(b, device=src.device)  # (A,) summed log-probabilities
    active = list(range(b))  # sentence of each row
    cache = model.new_cache() if opts.use_cache else None
    generator = _generator(opts, src.device)
    out: list[Optional[Hypothesis]] = [None] * b
    for step in range(int(limits.max())):
        log_probs = _force_eos(_next_log_probs(model, tokens, memory, src_mask, cache), step + 1 >= limits)
        if step < forced:  # no row ends inside the prefix: prefix rows are still the batch's
            log_probs = _force_prefix(log_probs, prefix, step)  # type: ignore[arg-type]
        next_token = _choose(log_probs, opts, generator)  # (A,)
        sums = sums + log_probs.gather(1, next_token[:, None]).squeeze(1)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        ended = next_token == EOS_ID
        if not bool(ended.any()):
            continue
        penalty = gnmt_penalty(step + 1 - forced, opts.length_penalty)
        for row in ended.nonzero().squeeze(1).tolist():
            out[active[row]] = (sums[row].item() / penalty, tokens[row, 1 + forced : -1].tolist())
        keep = (~ended).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        tokens, sums, memory, src_mask, limits = (
            t.index_select(0, keep) for t in (tokens, sums, memory, src_mask, limits)
        )
        if cache is not None:
            reorder_cache(cache, keep)
        active = [active[i] for i in keep.tolist()]
    assert all(h is not None for h in out), "every row emits EOS by its length limit"
    return out  # type: ignore[return-value]


def greedy(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, prefix: Optional[torch.Tensor] = None
) -> list[list[int]]:
    """Greedy decoding of (B, S) source ids; returns token ids without BOS/EOS (and prefix)."""
    return [ids for _, ids in greedy_scored(model, src, opts, prefix)]


@dataclass
class _Beams:
    """Search state of the A active sentences, K rows each: row r belongs to sentence r // K."""

    tokens: torch.Tensor  # (A*K, T) prefixes, BOS first
    scores: torch.Tensor  # (A, K) summed log-probabilities of the prefixes
    memory: torch.Tensor  # (A*K, S, D)
    src_mask: torch.Tensor  # (A*K, 1, 1, S)
    limits: torch.Tensor  # (A*K,) output length limits, EOS included
    active: list[int]  # sentence id of each active sentence
    cache: Optional[Cache]
    prefix: Optional[torch.Tensor] = None  # (A*K, P) forced decoder prefix of each row

    @property
    def forced(self) -> int:
        """P: the forced prefix tokens each prefix holds after BOS."""
        return 0 if self.prefix is None else self.prefix.size(1)


def _init_beams(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, prefix: Optional[torch.Tensor] = None
) -> _Beams:
    """Encode once, repeat memory K times, start every beam from BOS (then the forced `prefix`)."""
    b, k = src.size(0), opts.beam
    memory, src_mask = model.encode(src)  # (B, S, D), (B, 1, 1, S)
    scores = torch.zeros(b, k, device=src.device)
    scores[:, 1:] = NEG_INF  # all beams start identical: expand only the first
    return _Beams(
        tokens=torch.full((b * k, 1), BOS_ID, dtype=torch.long, device=src.device),
        scores=scores,
        memory=memory.repeat_interleave(k, 0),
        src_mask=src_mask.repeat_interleave(k, 0),
        limits=_max_lengths(model, src, opts, 0 if prefix is None else prefix.size(1)).repeat_interleave(k),
        active=list(range(b)),
        cache=model.new_cache() if opts.use_cache else None,
        prefix=None if prefix is None else prefix.repeat_interleave(k, 0),
    )


def _finish(
    state: _Beams,
    finished: list[list[Hypothesis]],
    top_scores: torch.Tensor,
    origin: torch.Tensor,
    is_eos: torch.Tensor,
    penalty: float,
) -> None:
    """Finish the EOS candidates that rank within the top K of their sentence (as fairseq does)."""
    k = state.scores.size(1)
    finishing = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])  # (A, K)
    for i, j in finishing.nonzero().tolist():
        hyp = state.tokens[i * k + int(origin[i, j]), 1 + state.forced :].tolist()
        finished[state.active[i]].append((top_scores[i, j].item() / penalty, hyp))


def _done(finished: list[Hypothesis], k: int, best_live: float) -> bool:
    """Whether a sentence's search may stop: K finished hypotheses, the best no worse than `best_live`."""
    return len(finished) >= k and max(score for score, _ in finished) >= best_live


def _advance(
    state: _Beams, scores: torch.Tensor, parents: torch.Tensor, new_tokens: torch.Tensor, keep: list[int]
) -> None:
    """Extend the chosen (A, K) parents by new_tokens; drop the sentences not in `keep`."""
    a, k = scores.shape
    if len(keep) < a:
        idx = torch.tensor(keep, device=scores.device)
        scores, parents, new_tokens = scores[idx], parents[idx], new_tokens[idx]
        beam_rows = (idx[:, None] * k + torch.arange(k, device=idx.device)).view(-1)
        state.memory, state.src_mask, state.limits = (
            t.index_select(0, beam_rows) for t in (state.memory, state.src_mask, state.limits)
        )
        if state.cache is not None:  # cross K/V are equal across a sentence's K rows
            reorder_cache(state.cache, beam_rows, parts=("cross",))
        state.active = [state.active[i] for i in keep]
    rows = parents.reshape(-1)  # (A'*K,) parent row of each new prefix
    state.tokens = torch.cat([state.tokens.index_select(0, rows), new_tokens.reshape(-1, 1)], dim=1)
    if state.cache is not None:
        reorder_cache(state.cache, rows, parts=("self",))
    state.scores = scores


def _beam(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, prefix: Optional[torch.Tensor] = None
) -> list[list[Hypothesis]]:
    """Batched beam search; returns every finished hypothesis of every sentence, unsorted."""
    k = opts.beam
    state = _init_beams(model, src, opts, prefix)
    finished: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]
    for step in range(int(state.limits.max())):
        log_probs = _force_eos(
            _next_log_probs(model, state.tokens, state.memory, state.src_mask, state.cache), step + 1 >= state.limits
        )  # (A*K, V)
        if step < state.forced:  # no sentence finishes inside the prefix: its rows are all rows
            log_probs = _force_prefix(log_probs, state.prefix, step)  # type: ignore[arg-type]
        a, vocab = state.scores.size(0), log_probs.size(-1)
        cand = (state.scores.view(-1, 1) + log_probs).view(a, k * vocab)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # (A, 2K): at most K of them are EOS
        origin, token = top_idx // vocab, top_idx % vocab
        is_eos = token == EOS_ID
        penalty = gnmt_penalty(step + 1 - state.forced, opts.length_penalty)
        _finish(state, finished, top_scores, origin, is_eos, penalty)
        # Continue with the best K candidates that did not end.
        scores, pick = top_scores.masked_fill(is_eos, NEG_INF).topk(k, dim=1)  # (A, K)
        parents = torch.arange(a, device=src.device)[:, None] * k + origin.gather(1, pick)
        # A sentence is done when no live prefix is left, or when it holds K finished hypotheses
        # and the best of them beats its best live prefix scored as if it ended now: with
        # length penalty 0 no live prefix can still win (fairseq stops at K finished alone,
        # and on a confident model returns an early EOS nats below the hypothesis still live).
        best_live = (scores[:, 0] / penalty).tolist()
        keep = [
            i for i, s in enumerate(state.active) if best_live[i] > NEG_INF and not _done(finished[s], k, best_live[i])
        ]
        if not keep:
            break
        _advance(state, scores, parents, token.gather(1, pick), keep)
    return finished


@torch.no_grad()
def beam_search_nbest(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, n_best: int = 1, prefix: Optional[torch.Tensor] = None
) -> list[list[Hypothesis]]:
    """Batched beam search of (B, S) source ids (after a forced (B, P) `prefix`, if given): the
    n_best (score, ids) per sentence, best first."""
    opts.check()
    if not 1 <= n_best <= opts.beam:
        raise ValueError(f"n_best={n_best} must be between 1 and the beam size {opts.beam}")
    return [sorted(f, reverse=True)[:n_best] or [(NEG_INF, [])] for f in _beam(model, src, opts, prefix)]


def beam_search(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, prefix: Optional[torch.Tensor] = None
) -> list[list[int]]:
    """Batched beam search of (B, S) source ids; returns the best hypothesis per sentence."""
    return [hyps[0][1] for hyps in beam_search_nbest(model, src, opts, 1, prefix)]


def decode_nbest(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, n_best: int = 1, prefix: Optional[torch.Tensor] = None
) -> list[list[Hypothesis]]:
    """The n_best (score, ids) per sentence, best first; greedy or sampling when opts.beam == 1;
    a (B, P) `prefix` is forced first (a decoder-side target tag, `split_tags`)."""
    if opts.beam == 1:
        if n_best != 1:
            raise ValueError(f"n_best={n_best} needs a beam of at least {n_best}; greedy gives 1")
        return [[hyp] for hyp in greedy_scored(model, src, opts, prefix)]
    return beam_search_nbest(model, src, opts, n_best, prefix)


def decode(
    model: Decoder, src: torch.Tensor, opts: DecodeOptions, prefix: Optional[torch.Tensor] = None
) -> list[list[int]]:
    """Greedy when opts.beam == 1, beam search otherwise (after a forced (B, P) `prefix`, if given)."""
    return greedy(model, src, opts, prefix) if opts.beam == 1 else beam_search(model, src, opts, prefix)


@torch.no_grad()
def token_log_probs(
    model: Decoder, src: torch.Tensor, hyps: Sequence[Sequence[int]], prefix: Optional[torch.Tensor] = None
) -> list[list[float]]:
    """raymt's scorer of given outputs: each hypothesis's (ids without BOS/EOS) log-probabilities,
    token by token and then EOS, given its row of (B, S) source ids after a forced (B, P) `prefix`
    (taken at no cost, as decoding takes it); summed, they are decoding's length-penalty-0 score
    (an ensemble's: the mean of its members')."""
    forced = [] if prefix is None else prefix.tolist()
    rows = [[BOS_ID, *(forced[i] if forced else []), *ids, EOS_ID] for i, ids in enumerate(hyps)]
    tgt = pad_batch(rows, src.device)  # (B, T)
    memory, src_mask = model.encode(src)
    picked = model_log_probs(model, tgt[:, :-1], memory, src_mask).gather(2, tgt[:, 1:, None]).squeeze(2)  # (B, T-1)
    start = len(forced[0]) if forced else 0
    return [picked[i, start : start + len(ids) + 1].tolist() for i, ids in enumerate(hyps)]


def encode_sources(
    tokenizer: Tokenizer, sentences: Sequence[str], max_positions: int, prefix: Sequence[int] = ()
) -> list[list[int]]:
    """Source ids ending in EOS, truncated to fit the model's positions; `prefix` (a tagged
    model's target tag, raymt.engines.ModelInfo.prefix) starts each and counts in the length."""
    max_src = max_positions - 1
    return [[*prefix, *tokenizer.encode(s)][: max_src - 1] + [EOS_ID] for s in sentences]


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices sorted by length (stable) and cut into batches: the batches translate() decodes."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def decode_ids(
    model: Decoder,
    tokenizer: Tokenizer,
    sources: Sequence[Sequence[int]],
    opts: DecodeOptions,
    n_best: int = 1,
    device: str = "cpu",
    tag_side: str = "src",
) -> list[list[tuple[float, str]]]:
    """Decode one batch of encoded sources: the n_best (score, text) per sentence; a model with
    data.tag_side "tgt" takes each source's first id (its tag) as its decoder prefix."""
    src, prefix = split_tags(pad_batch(sources, device), tag_side)
    nbest = decode_nbest(model, src, opts, n_best, prefix)
    return [[(score, tokenizer.decode(ids)) for score, ids in hyps] for hyps in nbest]


def translate_nbest(
    model: Decoder,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    opts: DecodeOptions,
    n_best: int = 1,
    batch_size: int = 64,
    device: str = "cpu",
    prefix: Sequence[int] = (),
    tag_side: str = "src",
) -> list[list[tuple[float, str]]]:
    """Translate raw sentences in length-sorted batches: n_best (score, text) each, input order;
    `prefix` ids (a tagged model's target tag) go before each source (`tag_side` "tgt": the
    decoder's, `decode_ids`)."""
    model.eval()
    encoded = encode_sources(tokenizer, sentences, model.cfg.max_positions, prefix)
    out: list[list[tuple[float, str]]] = [[] for _ in encoded]
    for idx in length_batches([len(e) for e in encoded], batch_size):
        hyps = decode_ids(model, tokenizer, [encoded[i] for i in idx], opts, n_best, device, tag_side)
        for i, h in zip(idx, hyps):
            out[i] = h
    return out


def translate(
    model: Decoder,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    opts: DecodeOptions,
    batch_size: int = 64,
    device: str = "cpu",
    prefix: Sequence[int] = (),
    tag_side: str = "src",
) -> list[str]:
    """Translate raw sentences in length-sorted batches (`prefix` ids before each); input order."""
    nbest = translate_nbest(model, tokenizer, sentences, opts, 1, batch_size, device, prefix, tag_side)
    return [hyps[0][1] for hyps in nbest]
