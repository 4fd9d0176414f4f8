"""Fast batched decoding agrees with a slow, obviously-correct reference (ids and scores).

The reference decodes one sentence at a time, recomputes the decoder over the whole
prefix at every step (no cache, no padding, no pruning) and keeps hypotheses in plain
Python lists. Its search rule is the one the fast code documents: at each step the
candidates of all live prefixes are ranked; EOS candidates ranked within the top K
finish with score / GNMT penalty; the best K other candidates live on; a sentence stops
with K finished hypotheses of which the best is no worse than the best live prefix, scored
with this step's penalty (or with no live prefix left).
"""

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from test_model import mixed_batch
from tiny_checkpoint import one_thread  # noqa: F401  (autouse: one torch thread)

from raymt.config import tiny
from raymt.decoding import DecodeOptions, beam_search_nbest, decode_nbest, greedy_scored
from raymt.model import Transformer
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts

LENGTHS = [7, 2, 5, 9, 3]  # a batch of mixed lengths
VOCAB = 64


@functools.lru_cache(maxsize=None)
def random_model(seed: int) -> Transformer:
    """A random tiny model, briefly fit to copy random ids so that sentences end at various steps.

    A freshly initialized model emits EOS either at once or never; 100 Adam steps on a
    copy task (well under a second) make output lengths vary within one batch.
    """
    torch.manual_seed(seed)
    cfg = dataclasses.replace(tiny(), d_model=16 if seed % 2 else 32, pre_norm=seed % 3 != 2)
    model = Transformer(cfg, VOCAB)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(100):
        src = mixed_batch(
            torch.randint(2, 10, (16,), generator=g).tolist(), VOCAB, int(torch.randint(0, 10**6, (1,), generator=g))
        )
        tgt = torch.cat([torch.full((16, 1), BOS_ID), src], 1)  # BOS + copy of the source
        logits = model(src, tgt[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def ref_limit(src_len: int, opts: DecodeOptions, max_positions: int) -> int:
    """a * src_len + b in float32, truncated, clamped to [1, max_positions - 1]."""
    limit = int(torch.tensor(float(src_len)) * opts.max_len_a + opts.max_len_b)
    return min(max(limit, 1), max_positions - 1)


def ref_log_probs(model, src_row: list[int], prefix: list[int], at_limit: bool) -> list[float]:
    """Next-token log-probabilities after `prefix`, recomputed from scratch."""
    with torch.no_grad():
        memory, src_mask = model.encode(torch.tensor([src_row]))
        logits = model.decode(torch.tensor([prefix]), memory, src_mask)[0, -1]
    log_probs = torch.log_softmax(logits.float(), -1).tolist()
    for i in range(len(log_probs)):
        if i in (PAD_ID, BOS_ID) or (at_limit and i != EOS_ID):
            log_probs[i] = -math.inf
    return log_probs


def penalty(length: int, alpha: float) -> float:
    return ((5.0 + length) / 6.0) ** alpha


def ref_greedy(model, src_row, opts):
    """One (score, ids) by argmax, token after token."""
    limit = ref_limit(len(src_row), opts, model.cfg.max_positions)
    prefix, total = [BOS_ID], 0.0
    for step in range(limit):
        log_probs = ref_log_probs(model, src_row, prefix, step + 1 >= limit)
        token = max(range(len(log_probs)), key=lambda i: log_probs[i])  # first of ties
        total += log_probs[token]
        prefix.append(token)
        if token == EOS_ID:
            break
    return total / penalty(len(prefix) - 1, opts.length_penalty), prefix[1:-1]


def ref_beam(model, src_row, opts):
    """All finished (score, ids) of one sentence, best first."""
    k = opts.beam
    limit = ref_limit(len(src_row), opts, model.cfg.max_positions)
    live, finished = [(0.0, [BOS_ID])], []
    for step in range(limit):
        candidates = []
        for score, prefix in live:
            log_probs = ref_log_probs(model, src_row, prefix, step + 1 >= limit)
            candidates += [(score + lp, prefix + [tok]) for tok, lp in enumerate(log_probs) if lp > -math.inf]
        candidates.sort(key=lambda c: -c[0])
        for score, hyp in candidates[:k]:
            if hyp[-1] == EOS_ID:
                finished.append((score / penalty(step + 1, opts.length_penalty), hyp[1:-1]))
        live = [c for c in candidates if c[1][-1] != EOS_ID][:k]
        step_penalty = penalty(step + 1, opts.length_penalty)
        if not live or (len(finished) >= k and max(finished)[0] >= live[0][0] / step_penalty):
            break
    return sorted(finished, reverse=True)


def rows_of(src):
    return [[t for t in row if t != PAD_ID] for row in src.tolist()]


def assert_same(fast, ref):
    assert [ids for _, ids in fast] == [ids for _, ids in ref]
    for (fs, _), (rs, _) in zip(fast, ref):
        assert fs == pytest.approx(rs, abs=1e-4)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_reference(seed, alpha):
    model = random_model(seed)
    src = mixed_batch(LENGTHS, VOCAB, seed)
    opts = DecodeOptions(beam=1, length_penalty=alpha)
    fast = greedy_scored(model, src, opts)
    assert_same(fast, [ref_greedy(model, row, opts) for row in rows_of(src)])
    assert fast == [h[0] for h in decode_nbest(model, src, opts)]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("beam", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_beam_matches_reference(seed, beam, alpha):
    check_beam(
        random_model(seed),
        mixed_batch(LENGTHS, VOCAB, seed),
        DecodeOptions(beam=beam, length_penalty=alpha, max_len_a=1.0, max_len_b=4),
    )


@pytest.mark.parametrize("beam", [1, 3, 5])
def test_beam_at_length_limits_matches_reference(beam):
    """Short limits (0.5 * src_len + 1): some sentences are cut by forced EOS, others end."""
    check_beam(
        random_model(2),
        mixed_batch(LENGTHS, VOCAB, 2),
        DecodeOptions(beam=beam, length_penalty=0.6, max_len_a=0.5, max_len_b=1),
    )


def test_uncached_beam_matches_reference():
    check_beam(
        random_model(3),
        mixed_batch(LENGTHS, VOCAB, 3),
        DecodeOptions(beam=3, length_penalty=1.0, max_len_a=1.0, max_len_b=4, use_cache=False),
    )


def check_beam(model, src, opts):
    """Every sentence's n-best list (n = beam) equals the reference's best n."""
    fast = beam_search_nbest(model, src, opts, n_best=opts.beam)
    for row, nbest in zip(rows_of(src), fast):
        ref = ref_beam(model, row, opts)
        assert 1 <= len(nbest) == min(opts.beam, len(ref))
        assert_same(nbest, ref[: opts.beam])


def test_models_exercise_pruning():
    """Within one batch, sentences end at different steps and before their length limit."""
    for seed in (0, 1, 2, 3):
        src = mixed_batch(LENGTHS, VOCAB, seed)
        hyps = greedy_scored(random_model(seed), src, DecodeOptions(beam=1, max_len_a=1.0, max_len_b=4))
        lengths = [len(ids) for _, ids in hyps]
        assert len(set(lengths)) >= 2, lengths
        assert any(n < src_len + 3 for n, src_len in zip(lengths, LENGTHS)), lengths
