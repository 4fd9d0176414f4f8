"""Decoding: cached equals recomputed, beam 1 equals greedy, limits hold."""

import pytest
import torch
from test_model import mixed_batch

from raymt.config import tiny
from raymt.decoding import DecodeOptions, beam_search, decode, greedy
from raymt.model import Transformer

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beam", [1, 2, 5])
def test_cached_equals_recomputed(seed, beam):
    torch.manual_seed(seed)
    model = Transformer(tiny(), vocab_size=64).eval()
    src = mixed_batch([7, 2, 5, 9], seed=seed)
    cached = decode(model, src, DecodeOptions(beam=beam, use_cache=True))
    full = decode(model, src, DecodeOptions(beam=beam, use_cache=False))
    assert cached == full
    assert all(len(h) <= 1.2 * 9 + 10 for h in cached)


def test_beam_one_is_greedy(tiny_model):
    src = mixed_batch([6, 3, 8])
    opts = DecodeOptions(beam=1)
    assert beam_search(tiny_model, src, opts) == greedy(tiny_model, src, opts)


def test_beam_finds_at_least_greedy_score(tiny_model):
    src = mixed_batch([5, 8])
    opts = DecodeOptions(length_penalty=0.0, max_len_a=0.0, max_len_b=6)

    def logprob(hyp, row):
        from raymt.tokenizer import BOS_ID, EOS_ID

        tgt = torch.tensor([[BOS_ID, *hyp, EOS_ID]])
        with torch.no_grad():
            lp = torch.log_softmax(tiny_model(src[row : row + 1], tgt[:, :-1]), -1)
        return lp[0].gather(1, tgt[0, 1:, None]).sum().item()

    greedy_hyps = greedy(tiny_model, src, opts)
    opts.beam = 4
    beam_hyps = beam_search(tiny_model, src, opts)
    for row in range(2):
        assert logprob(beam_hyps[row], row) >= logprob(greedy_hyps[row], row) - 1e-4
