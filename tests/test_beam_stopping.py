"""Beam search on a confident model returns its sentence, not an early EOS (the stopping rule).

fairseq stops a sentence's beam search once it holds K finished hypotheses. On a confident
model an EOS candidate ranks within the top K at every step (the runner-up of one sure
prefix), so the K slots fill with early, unlikely EOS hypotheses while the likely sentence is
still live, and the search returns one of them (raymt did until 4dc5a56). raymt stops only
once the best finished hypothesis is no worse than the best live prefix scored as if it ended
now (`raymt.decoding._done`).

The model here is a stand-in with fixed next-token probabilities (`Bigram`) run through the
same decoding code; the expected outputs and scores are worked out by hand below, from the
tables, not by another search.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from raymt.decoding import DecodeOptions, beam_search_nbest, greedy_scored
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID

A, B, C, D = 4, 5, 6, 7  # ids after PAD 0, UNK 1, BOS 2, EOS 3
VOCAB = 8

# Next-token probabilities after each token; a source's first id picks the table.
CONFIDENT = {  # has memorized "A B C"; D is an unlikely detour
    BOS_ID: {A: 0.99, D: 0.007, EOS_ID: 0.002, B: 0.0005, C: 0.0005},
    A: {B: 0.99, EOS_ID: 0.006, D: 0.003, A: 0.0005, C: 0.0005},
    B: {C: 0.99, EOS_ID: 0.006, D: 0.003, A: 0.0005, B: 0.0005},
    C: {EOS_ID: 0.99, D: 0.006, A: 0.002, B: 0.001, C: 0.001},
    D: {D: 0.5, EOS_ID: 0.4, A: 0.05, B: 0.03, C: 0.02},
}
SHORT = {  # says "A" and stops; both rules stop after step 1 (it leaves the batch early)
    BOS_ID: {A: 0.95, EOS_ID: 0.05},
    A: {EOS_ID: 0.95, B: 0.05},
    B: {EOS_ID: 1.0},
}
TABLES = {A: CONFIDENT, B: SHORT}


class Bigram:
    """What decoding uses of a Transformer (encode, decode, new_cache, cfg.max_positions) with
    fixed next-token probabilities: TABLES[source's first id][previous token]."""

    cfg = SimpleNamespace(max_positions=64)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) ids -> "memory" (B, 1, 1): the first id, selected and pruned with its rows."""
        return src[:, :1, None].float(), (src != PAD_ID)[:, None, None, :]

    def new_cache(self) -> dict:
        """No layers: the next token depends on the last one only, the one a cached step sees."""
        return {"length": 0, "layers": []}

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache=None) -> torch.Tensor:
        """(N, T) ids -> (N, T, V) logits: the log-probabilities of the tables (-inf elsewhere)."""
        logits = torch.full((*tgt.shape, VOCAB), -math.inf)
        for n, table in enumerate(TABLES[int(i)] for i in memory[:, 0, 0].tolist()):
            for t, prev in enumerate(tgt[n].tolist()):
                for token, p in table[prev].items():
                    logits[n, t, token] = math.log(p)
        return logits


def log_p(table: dict, ids: list[int]) -> float:
    """Summed log-probability of BOS ids EOS under a table."""
    path = [BOS_ID, *ids, EOS_ID]
    return sum(math.log(table[prev][token]) for prev, token in zip(path, path[1:]))


def gnmt(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


SRC = torch.tensor([[A, EOS_ID], [B, EOS_ID]])  # the confident sentence, the short one


# By hand, beam 2 on CONFIDENT (summed log-probabilities; candidates of a step in order):
# step 0: A -0.010, D -4.96 live (EOS -6.21 ranks 3rd).
# step 1: A B -0.020 live, A EOS -5.13 finishes [A], D D -5.66 live.
# step 2: A B C -0.030 live, A B EOS -5.14 finishes [A B]: two finished, the K-finished rule
#         stops here and returns [A] (-5.13 nats; at alpha 0.6 [A B], -4.32), the best live
#         prefix -0.030; raymt goes on (A B D -5.83 is the second live prefix).
# step 3: A B C EOS -0.040 finishes [A B C], now better than any live prefix: stop.
@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("use_cache", [True, False])
def test_confident_model_beam_returns_its_sentence_not_an_early_eos(alpha, use_cache):
    opts = DecodeOptions(beam=2, length_penalty=alpha, max_len_a=0.0, max_len_b=10, use_cache=use_cache)
    sentence = (log_p(CONFIDENT, [A, B, C]) / gnmt(4, alpha), [A, B, C])
    early = [(log_p(CONFIDENT, [A]) / gnmt(2, alpha), [A]), (log_p(CONFIDENT, [A, B]) / gnmt(3, alpha), [A, B])]
    runner_up = max(early)  # [A] at alpha 0, [A B] at 0.6
    assert sentence[0] - runner_up[0] > 4  # nats between the sentence and the early EOS
    short = [(log_p(SHORT, [A]) / gnmt(2, alpha), [A]), (log_p(SHORT, []) / gnmt(1, alpha), [])]

    got = beam_search_nbest(Bigram(), SRC, opts, n_best=2)

    assert [[ids for _, ids in hyps] for hyps in got] == [[[A, B, C], runner_up[1]], [[A], []]]
    for hyps, expected in zip(got, [[sentence, runner_up], short]):
        assert [score for score, _ in hyps] == pytest.approx([score for score, _ in expected], abs=1e-5)
    # Greedy finds the same sentence, with the same score.
    greedy = greedy_scored(Bigram(), SRC, DecodeOptions(beam=1, length_penalty=alpha, max_len_a=0.0, max_len_b=10))
    assert greedy[0][1] == [A, B, C] and greedy[0][0] == pytest.approx(sentence[0], abs=1e-5)
