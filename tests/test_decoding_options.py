"""Decoding options: n-best lists, sampling, option errors, translate CLI flags."""

import pytest
from test_beam_reference import LENGTHS, VOCAB, random_model
from test_model import mixed_batch
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import translate
from raymt.decoding import DecodeOptions, beam_search, decode_nbest, greedy_scored, translate_nbest
from raymt.decoding import translate as translate_sentences


@pytest.fixture(scope="module")
def model_and_src():
    return random_model(0), mixed_batch(LENGTHS, VOCAB, 0)


def test_nbest_is_sorted_and_starts_with_the_best(model_and_src):
    model, src = model_and_src
    opts = DecodeOptions(beam=4, max_len_a=1.0, max_len_b=4)
    nbest = decode_nbest(model, src, opts, n_best=3)
    assert all(len(hyps) == 3 for hyps in nbest)
    assert all([s for s, _ in hyps] == sorted((s for s, _ in hyps), reverse=True) for hyps in nbest)
    assert [hyps[0][1] for hyps in nbest] == beam_search(model, src, opts)
    assert len({tuple(ids) for _, ids in nbest[0]}) == 3  # distinct hypotheses


def test_sampling_is_seeded(model_and_src):
    model, src = model_and_src
    draw = lambda seed, **kw: greedy_scored(model, src, DecodeOptions(beam=1, sample=True, seed=seed, **kw))
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    greedy = greedy_scored(model, src, DecodeOptions(beam=1))
    assert draw(7, top_k=1) == greedy  # only the argmax can be drawn
    assert [ids for _, ids in draw(7, temperature=1e-4)] == [ids for _, ids in greedy]


def test_sampled_scores_are_model_log_probs(model_and_src):
    """A sample's score is its log-probability under the model (untempered) / length penalty."""
    model, src = model_and_src
    opts = DecodeOptions(beam=1, sample=True, seed=3, temperature=2.0, top_k=5, length_penalty=0.0)
    from test_beam_reference import ref_log_probs, rows_of

    from raymt.tokenizer import BOS_ID, EOS_ID

    for row, (score, ids) in zip(rows_of(src), greedy_scored(model, src, opts)):
        prefix, total = [BOS_ID], 0.0
        for token in ids + [EOS_ID]:
            total += ref_log_probs(model, row, prefix, False)[token]
            prefix.append(token)
        assert score == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize(
    "kwargs, n_best, message",
    [
        ({"beam": 0}, 1, "beam=0"),
        ({"beam": 3, "sample": True}, 1, "use beam 1"),
        ({"beam": 1, "sample": True, "temperature": 0.0}, 1, "temperature"),
        ({"beam": 1, "sample": True, "top_k": -1}, 1, "top_k"),
        ({"beam": 2}, 3, "n_best=3"),
        ({"beam": 1}, 2, "n_best=2"),
        ({"length_penalty": -1.0}, 1, "length_penalty"),
    ],
)
def test_bad_options_raise_value_error(model_and_src, kwargs, n_best, message):
    model, src = model_and_src
    with pytest.raises(ValueError, match=message):
        decode_nbest(model, src, DecodeOptions(**kwargs), n_best)


def test_translate_keeps_input_order_across_batches(tmp_path):
    from raymt.checkpoint import load_model

    model, tokenizer, _ = load_model(make_checkpoint(tmp_path / "c"))
    sentences = ["Belize", "Monday, July 4, 1999 and twelve kilometers", "", "Germany and March 3, 2021"]
    opts = DecodeOptions(beam=2, max_len_b=3)
    one_by_one = [translate_sentences(model, tokenizer, [s], opts)[0] for s in sentences]
    assert translate_sentences(model, tokenizer, sentences, opts, batch_size=3) == one_by_one
    assert [h[0][1] for h in translate_nbest(model, tokenizer, sentences, opts, 2, batch_size=2)] == one_by_one


def test_translate_cli_nbest_and_sampling(tmp_path, capsys):
    ckpt = str(make_checkpoint(tmp_path / "c"))
    assert translate.main(["--checkpoint", ckpt, "--beam", "3", "--n-best", "2", "--max-len-b", "3", "a", "b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ||| ")[0] for line in lines] == ["0", "0", "1", "1"]
    assert all(float(line.split(" ||| ")[2]) <= 0 for line in lines)
    sample = ["--checkpoint", ckpt, "--sample", "--seed", "1", "--top-k", "5", "--max-len-b", "5", "Belize"]
    assert translate.main(sample) == 0 and translate.main(sample) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second
    assert translate.main(["--checkpoint", ckpt, "--n-best", "6", "x"]) == 2
    assert "--n-best 6" in capsys.readouterr().err
