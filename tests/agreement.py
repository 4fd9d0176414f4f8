"""Decoded outputs compared across engines, precisions, processes and hosts (issue 55).

Two engines that compute one model round differently: CTranslate2's kernels are not PyTorch's,
MKL and oneDNN take other paths on an Intel Xeon with AMX than on an AMD EPYC, AVX2 or AVX-512.
Where a model's two best next tokens are nearly tied, each engine may pick another, and the
outputs part from there on. So a test that compares outputs of two engines (or of one engine in
two processes, or of this host against a file written on another) either decodes with wide
margins (a fixture trained until it has memorized the sentences it decodes: `min_margin`), or
asserts `assert_agree`: equal outputs, except a pair that raymt's own scorer
(`raymt.decoding.token_log_probs`, and any other engine's scorer passed in) finds tied where
the two part: their summed log-probabilities up to and including the first token where they
differ (greedy's choice there, and beam search's ranking of the two prefixes), or whole (beam
search's final ranking), within `TIE` nats. A wrong engine (a lost tag, a misplaced weight)
parts from raymt by several nats on most rows, and at most a quarter of the rows (or one) may be
tied.
Exact equality stays where it is the point: one engine in one process on one host (an exact
resume, batching that changes nothing).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from raymt.batching import pad_batch
from raymt.checkpoint import load_model
from raymt.decoding import token_log_probs
from raymt.engines import load_model_info
from raymt.model import Transformer
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

# Nats. Two fp32 engines' log-probabilities of one token differ by ~1e-5 (CTranslate2 vs raymt
# on the tiny models, tests/test_export_ct2.py's 1e-4 bound); summed over 30 tokens and taken on
# both sides of a tie, 1e-3 covers them with room, and a tag or weight mistake costs nats.
TIE = 1e-3
# At most this share of a comparison's rows may differ by a tie: ties are rare where rounding
# alone decides them, so many would hide a bug.
MAX_TIED = 0.25

# (source ids, hypotheses) -> each hypothesis's per-token log-probabilities, EOS last.
Scorer = Callable[[list[int], list[list[int]]], list[list[float]]]


def raymt_scorer(model: Transformer, prefix: Sequence[int] = ()) -> Scorer:
    """raymt's scorer of one source's hypotheses, after a forced decoder `prefix` (a decoder-side tag)."""

    def scorer(src: list[int], hyps: list[list[int]]) -> list[list[float]]:
        batch = pad_batch([src] * len(hyps))
        forced = torch.tensor([list(prefix)] * len(hyps)) if prefix else None
        return token_log_probs(model, batch, hyps, forced)

    return scorer


def parting(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where two outputs (each followed by its EOS) differ."""
    a, b = [*a, EOS_ID], [*b, EOS_ID]
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def tied(scorers: Sequence[Scorer], src: list[int], a: list[int], b: list[int], tol: float = TIE) -> bool:
    """Whether every scorer finds outputs a and b of `src` tied: their summed log-probabilities
    through the first token where they part, or whole, within `tol` nats."""
    at = parting(a, b)
    for scorer in scorers:
        la, lb = scorer(src, [a, b])
        through = abs(sum(la[: at + 1]) - sum(lb[: at + 1]))
        if min(through, abs(sum(la) - sum(lb))) > tol:
            return False
    return True


def assert_agree(
    scorers: Sequence[Scorer],
    sources: Sequence[list[int]],
    got: Sequence[list[int]],
    want: Sequence[list[int]],
    tol: float = TIE,
    max_tied: float = MAX_TIED,
) -> int:
    """Assert that `got` equals `want` row by row, except rows whose outputs are `tied`, at most
    `max_tied` of them; returns how many rows were tied (for a test's report)."""
    assert len(got) == len(want) == len(sources)
    num_tied = 0
    for row, (src, g, w) in enumerate(zip(sources, got, want)):
        if list(g) == list(w):
            continue
        assert tied(scorers, list(src), list(g), list(w), tol), f"row {row}: {g} != {w}, and not tied within {tol}"
        num_tied += 1
    too_many = f"{num_tied} of {len(got)} rows differ by a tie: too many to be rounding"
    assert num_tied <= max(1, max_tied * len(got)), too_many
    return num_tied


def assert_texts_agree(
    model: Transformer,
    tokenizer: Tokenizer,
    sources: Sequence[list[int]],
    got: Sequence[str],
    want: Sequence[str],
    prefix: Sequence[int] = (),
    tol: float = TIE,
) -> int:
    """`assert_agree` for detokenized outputs, re-encoded into pieces, with raymt's scorer of
    `model` after a decoder `prefix`."""
    got_ids, want_ids = ([tokenizer.encode(t) for t in texts] for texts in (got, want))
    return assert_agree([raymt_scorer(model, prefix)], sources, got_ids, want_ids, tol)


def assert_translations_agree(
    checkpoint, texts: Sequence[str], tgt_lang: Optional[str], got: Sequence[str], want: Sequence[str]
) -> int:
    """`assert_texts_agree` for a checkpoint's translations of `texts` into `tgt_lang`, its tag
    where the model reads it (before the source, or first in the decoder)."""
    info = load_model_info(str(checkpoint))
    model, tok, _ = load_model(checkpoint)
    sources = info.encode(list(texts), tgt_lang)
    prefix: list[int] = []
    if info.tag_side == "tgt" and info.languages:
        prefix, sources = sources[0][:1], [src[1:] for src in sources]
    return assert_texts_agree(model.eval(), tok, sources, got, want, prefix)


@torch.no_grad()
def min_margin(model: Transformer, src: list[int], out: list[int], prefix: Sequence[int] = ()) -> float:
    """The smallest gap, in nats, between the best and the second-best next token along `out`
    (and its EOS) of `src`: how far from a tie raymt's greedy path is (PAD and BOS excluded, as
    decoding excludes them)."""
    tgt = torch.tensor([[BOS_ID, *prefix, *out]])
    memory, src_mask = model.encode(torch.tensor([src]))
    log_probs = torch.log_softmax(model.decode(tgt, memory, src_mask).float(), -1)[0, len(prefix) :]  # (T, V)
    log_probs[:, [PAD_ID, BOS_ID]] = -float("inf")
    top2 = log_probs.topk(2, dim=-1).values  # (T, 2)
    return float((top2[:, 0] - top2[:, 1]).min())
