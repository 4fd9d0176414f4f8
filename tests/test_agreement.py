"""tests/agreement.py, the comparison of decoded outputs across engines and hosts, can fail: a tie
passes, another language's outputs do not, and neither do too many ties."""

import pytest
import torch
from agreement import assert_agree, parting, raymt_scorer, tied
from tiny_checkpoint import one_thread  # noqa: F401 (autouse fixture)

from raymt.config import DecodeOptions, tiny
from raymt.decoding import decode_nbest, pad_batch, token_log_probs
from raymt.model import Transformer
from raymt.tokenizer import EOS_ID

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts

TWIN, OTHER = 10, 11  # tokens with one embedding row: their logits are equal, a tie by construction


@pytest.fixture(scope="module")
def twins() -> Transformer:
    """A random tiny model whose tokens TWIN and OTHER are indistinguishable as outputs."""
    torch.manual_seed(0)
    model = Transformer(tiny(), vocab_size=32).eval()
    with torch.no_grad():
        model.embed.weight[OTHER] = model.embed.weight[TWIN]
    return model


def test_token_log_probs_sum_to_the_decoders_score(twins):
    src = pad_batch([[5, 6, 7, EOS_ID], [8, 9, EOS_ID]])
    nbest = decode_nbest(twins, src, DecodeOptions(beam=3, length_penalty=0.0), n_best=2)
    for row, hyps in enumerate(nbest):
        scored = token_log_probs(twins, src[row : row + 1].expand(len(hyps), -1), [ids for _, ids in hyps])
        assert [sum(lp) for lp in scored] == pytest.approx([score for score, _ in hyps], abs=1e-4)


def test_a_tie_passes_and_a_different_output_does_not(twins):
    scorer = raymt_scorer(twins)
    src = [5, 6, 7, EOS_ID]
    a, b, c = [3, TWIN, 4], [3, OTHER, 4], [3, 4, 4]
    assert parting(a, b) == 1 and parting(a, a + [5]) == 3  # the shorter one's EOS parts there
    assert tied([scorer], src, a, b)
    assert not tied([scorer], src, a, c)  # another token there: nats apart on a random model
    sources = [src] * 4
    assert assert_agree([scorer], sources, [a, a, c, c], [b, a, c, c]) == 1
    with pytest.raises(AssertionError, match="not tied"):
        assert_agree([scorer], sources, [c, a, a, a], [a, a, a, a])
    with pytest.raises(AssertionError, match="too many"):
        assert_agree([scorer], sources, [a, a, c, c], [b, b, c, c])
