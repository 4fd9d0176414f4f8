"""`raymt.engines`: raymt's decoder and CTranslate2 behind one interface.

raymt's engine gives what `raymt.decoding.translate_nbest` gives (greedy, beam n-best, seeded
sampling, at for_inference's precision); a tagged model takes a target language per sentence,
in one batch; CTranslate2's engine translates the same encoded sources; a wrong engine, a
missing ctranslate2 or an untrained target is one line.
"""

import random

import pytest
import torch
from agreement import assert_translations_agree
from test_tags import PAIRS, SENTENCES, TAG_ID, TAGS, tagged_tokenizer
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import engines
from raymt.checkpoint import languages_entry, load_model, save_checkpoint
from raymt.config import Config, CorpusSpec, DataConfig, tiny
from raymt.decoding import DecodeOptions, encode_sources, token_log_probs, translate_nbest
from raymt.engines import load_engine, token_batches
from raymt.model import Transformer
from raymt.precision import for_inference
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts

# Mixed lengths, an empty line, and one longer than the model's positions (cut to fit).
TEXTS = SENTENCES[:9] + ["", " ".join(SENTENCES * 10)]
CASES = [
    (DecodeOptions(beam=1, max_len_a=0.0, max_len_b=6), 1),
    (DecodeOptions(beam=3, max_len_a=0.0, max_len_b=5), 2),
    (DecodeOptions(beam=1, sample=True, seed=7, top_k=5, max_len_a=0.0, max_len_b=6), 1),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("engines") / "checkpoint", seed=4)


def save_tagged(directory, tag_side: str = "src"):
    """A random tagged en->de/fr checkpoint (test_tags' trained one takes seconds to fit), its tag
    before the source or (tag_side "tgt") the decoder's first token."""
    torch.manual_seed(5)
    tok = tagged_tokenizer()
    corpora = [CorpusSpec(src, tgt) for src, tgt in PAIRS]
    config = Config(model=tiny(), data=DataConfig(vocab_size=256, corpora=corpora, tag_side=tag_side))
    languages = languages_entry(PAIRS, {piece: tok.sp.piece_to_id(piece) for piece in TAGS}, tag_side)
    model = Transformer(config.model, tok.vocab_size)
    with torch.no_grad():  # no logit for PAD, BOS and the fillers: raymt masks them, CTranslate2 not
        model.embed.weight[[PAD_ID, BOS_ID, *range(tok.sp.get_piece_size(), tok.vocab_size)]] = 0.0
    return save_checkpoint(directory, model, config, tok, None, languages)


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """A random en->de/fr checkpoint, its tag before the source."""
    return save_tagged(tmp_path_factory.mktemp("tagged") / "checkpoint")


@pytest.fixture(scope="module")
def decoder_tagged(tmp_path_factory):
    """A random en->de/fr checkpoint, its tag the decoder's first token (data.tag_side "tgt")."""
    return save_tagged(tmp_path_factory.mktemp("decoder_tagged") / "checkpoint", "tgt")


def todays_path(checkpoint, texts, opts, n_best, batch_size, prefix=()):
    """What raymt translate decoded before engines existed: load_model, for_inference, translate_nbest."""
    model, tokenizer, cfg = load_model(checkpoint)
    with for_inference("cpu", cfg, tokenizer.vocab_size).apply().autocast():
        return translate_nbest(model, tokenizer, texts, opts, n_best, batch_size, "cpu", prefix)


@pytest.mark.parametrize("opts, n_best", CASES)
def test_raymt_engine_gives_translate_nbest(checkpoint, opts, n_best):
    engine = load_engine(str(checkpoint), "raymt")
    assert engine.name == "raymt" and engine.info.pairs == [("en", "de")] and engine.info.target_langs == ["de"]
    got = engine.translate(TEXTS, opts, n_best=n_best, batch_size=4)
    assert got == todays_path(checkpoint, TEXTS, opts, n_best, 4)
    assert all(len(hyps) == n_best for hyps in got)
    # The encoded path: ids ending in EOS, cut to the positions, decoded in one batch.
    encoded = engine.encode(TEXTS, "de")  # a one-pair model's own target: no tag
    assert all(ids[-1] == EOS_ID for ids in encoded) and len(encoded[-1]) == engine.info.config.model.max_positions - 1
    order = sorted(range(3), key=lambda i: len(encoded[i]))  # a batch as translate_nbest sorts it
    want = todays_path(checkpoint, TEXTS[:3], opts, n_best, 3)
    assert engine.translate_ids([encoded[i] for i in order], opts, n_best) == [want[i] for i in order]


def test_token_batches_respect_the_budget_and_cover_every_sentence():
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(500)] + [300]  # one longer than the budget
    batches = token_batches(lengths, 256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 256
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)  # sorted by length: little padding
    assert [500] in batches


def test_a_tagged_model_takes_a_target_per_sentence_in_one_batch(tagged):
    engine = load_engine(str(tagged), "raymt")
    assert engine.info.pairs == [("en", "de"), ("en", "fr")] and engine.info.target_langs == ["de", "fr"]
    texts = SENTENCES[:12]
    langs = ["de", "fr"] * 6
    encoded = engine.encode(texts, langs)
    assert [ids[0] for ids in encoded] == [TAG_ID[lang] for lang in langs]
    opts = DecodeOptions(beam=1, max_len_a=0.0, max_len_b=6)
    mixed = engine.translate(texts, opts, langs, batch_size=12)  # one batch, both targets
    for lang in ("de", "fr"):
        own = [t for t, t_lang in zip(texts, langs) if t_lang == lang]
        want = todays_path(tagged, own, opts, 1, 64, [TAG_ID[lang]])
        assert [h[0][1] for h, t_lang in zip(mixed, langs) if t_lang == lang] == [h[0][1] for h in want]
    assert engine.translate([texts[1]], opts, "fr")[0][0][1] == mixed[1][0][1]  # one target for every text


@pytest.mark.parametrize(
    "tgt_lang, message",
    [
        (None, "this model translates into de, fr: pass --tgt-lang"),
        ("es", "--tgt-lang es: this model was trained to translate into de, fr"),
        (["de"], "2 texts but 1 target languages"),
    ],
)
def test_an_untrained_target_is_one_line(tagged, tgt_lang, message):
    info = engines.load_model_info(str(tagged))
    with pytest.raises(ValueError, match=message) as err:
        info.encode(["a", "b"], tgt_lang)
    assert "\n" not in str(err.value)


def test_a_one_pair_model_has_one_target(checkpoint):
    info = engines.load_model_info(str(checkpoint))
    assert info.encode(["Belize"], "de") == info.encode(["Belize"])
    with pytest.raises(ValueError, match="--tgt-lang fr: this model translates en -> de only"):
        info.encode(["Belize"], "fr")


def test_ctranslate2_engine_behind_the_same_interface(tagged, tmp_path):
    pytest.importorskip("ctranslate2")
    cache = str(tmp_path / "cache")
    engine = load_engine(str(tagged), "auto", threads=1, compute_type="float32", cache=cache)
    assert engine.name == "ctranslate2" and engine.info.target_langs == ["de", "fr"]
    assert list((tmp_path / "cache" / "ctranslate2").iterdir())  # exported once, into the cache
    # One batch of both targets, as CTranslate2 translates each target's sources (the documented
    # snippet: the tag piece, then SentencePiece's pieces; EOS is CTranslate2's).
    opts = DecodeOptions(beam=1, max_len_a=0.0, max_len_b=5)
    texts = SENTENCES[:12]
    langs = [("de", "fr")[i % 2] for i in range(len(texts))]
    got = engine.translate(texts, opts, langs, batch_size=len(texts))
    sp = engine.tokenizer.sp
    for lang in ("de", "fr"):
        own = [i for i, t_lang in enumerate(langs) if t_lang == lang]
        pieces = [[f"<2{lang}>", *sp.encode(texts[i], out_type=str)] for i in own]
        results = engine.translator.translate_batch(
            pieces, beam_size=1, length_penalty=opts.length_penalty, max_decoding_length=4, return_scores=True
        )
        for i, result in zip(own, results):
            ids = [sp.piece_to_id(p) for p in result.hypotheses[0]]
            assert got[i][0][1] == engine.tokenizer.decode(ids)
            assert got[i][0][0] == pytest.approx(result.scores[0], abs=1e-2)  # other batches: other sums
    # Greedy: raymt's output too (where raymt forces EOS at its limit, CTranslate2's is cut there).
    raymt = load_engine(str(tagged), "raymt").translate(texts, opts, langs)
    assert all(h[0][1] for h in got)
    for lang in ("de", "fr"):  # two engines: equal but where raymt's scorer finds a tie (tests/agreement.py)
        own = [i for i, t_lang in enumerate(langs) if t_lang == lang]
        ours, theirs = ([nbest[i][0][1] for i in own] for nbest in (got, raymt))
        assert_translations_agree(tagged, [texts[i] for i in own], lang, ours, theirs)
    assert engine.translate(texts, opts, "de") != engine.translate(texts, opts, "fr")  # the tag counts
    assert engine.sub_batch_tokens > 0  # one thread: length-sorted sub-batches
    two = load_engine(str(tagged), "ctranslate2", threads=2, compute_type="float32", cache=cache)
    assert two.sub_batch_tokens == 0  # two threads would starve on them: whole batches (issue 60)
    torch.set_num_threads(1)  # load_engine set 2 for this process
    engine.sub_batch_tokens = 8  # cut by CTranslate2 into length-sorted sub-batches: the same output
    assert [h[0][1] for h in engine.translate(texts, opts, langs, batch_size=len(texts))] == [h[0][1] for h in got]
    encoded = engine.encode(texts[:1], "de")
    assert engine.length(encoded[0]) == len(encoded[0]) - 1  # CTranslate2 appends EOS itself
    [two] = engine.translate_ids(encoded, DecodeOptions(beam=2, length_penalty=0.0), n_best=2)
    assert len(two) == 2 and two[0][0] >= two[1][0]


def direct_log_probs(checkpoint, texts, targets, langs) -> list[list[float]]:
    """Teacher-forced log-probabilities pair by pair, straight from token_log_probs: the tag before
    the source (counted in its length), moved to the decoder's first token (forced at no cost) for a
    decoder-tagged model."""
    model, tok, cfg = load_model(checkpoint)
    decoder_tag = engines.load_model_info(str(checkpoint)).tag_side == "tgt"
    out = []
    for text, target, lang in zip(texts, targets, langs):
        tag = [TAG_ID[lang]] if lang else []
        [src] = encode_sources(tok, [text], cfg.model.max_positions, tag)
        room = cfg.model.max_positions - 2 - len(tag) * decoder_tag
        if decoder_tag:
            src, prefix = src[1:], torch.tensor([tag])
        out += token_log_probs(model, torch.tensor([src]), [tok.encode(target)[:room]], prefix if decoder_tag else None)
    return out


@pytest.mark.parametrize("kind", ["untagged", "tagged", "decoder_tagged"])
def test_raymt_engine_scores_given_targets_as_token_log_probs(kind, checkpoint, tagged, decoder_tagged):
    """Engine.score (sockeye's Scorer): each target's tokens and EOS, teacher-forced, in input order;
    a target too long for the positions is cut as the source is; a decoder-side tag costs nothing."""
    ckpt = {"untagged": checkpoint, "tagged": tagged, "decoder_tagged": decoder_tagged}[kind]
    texts, targets = SENTENCES[:9] + [TEXTS[-1]], SENTENCES[3:12] + [TEXTS[-1]]
    langs = [None] * len(texts) if kind == "untagged" else [("de", "fr")[i % 3 == 0] for i in range(len(texts))]
    engine = load_engine(str(ckpt), "raymt")
    got = engine.score(texts, targets, langs, max_tokens=64)  # several batches, sorted by length
    want = direct_log_probs(ckpt, texts, targets, langs)
    assert [len(g) for g in got] == [len(w) for w in want] == [len(t) + 1 for t in engine.info.encode_targets(targets)]
    assert len(got[-1]) == engine.info.max_positions - 1 - (kind == "decoder_tagged")  # cut to the positions
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)  # other batches: other padding


@pytest.mark.parametrize("kind", ["untagged", "tagged", "decoder_tagged"])
def test_ctranslate2_scores_as_raymt(kind, checkpoint, tagged, decoder_tagged, tmp_path):
    """CTranslate2's score_batch behind Engine.score: raymt's numbers at float32 (its tag forced too)."""
    pytest.importorskip("ctranslate2")
    ckpt = {"untagged": checkpoint, "tagged": tagged, "decoder_tagged": decoder_tagged}[kind]
    texts, targets = SENTENCES[:8], SENTENCES[4:12]
    langs = None if kind == "untagged" else ["de", "fr"] * 4
    ct2 = load_engine(str(ckpt), "ctranslate2", threads=1, compute_type="float32", cache=str(tmp_path))
    got, want = (
        ct2.score(texts, targets, langs, max_tokens=64),
        load_engine(str(ckpt), "raymt").score(texts, targets, langs),
    )
    assert [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)
    assert ct2.score_ids([], []) == []


def test_an_unknown_engine_or_missing_ctranslate2_is_one_line(checkpoint, monkeypatch):
    with pytest.raises(ValueError, match=r"^--engine marian: no such engine; pick one of auto, raymt, ctranslate2$"):
        load_engine(str(checkpoint), "marian")
    real = engines.importlib.util.find_spec
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None if name == "ctranslate2" else real(name))
    with pytest.raises(
        ValueError, match=r"^--engine ctranslate2 needs the ctranslate2 package: pip install ctranslate2$"
    ):
        load_engine(str(checkpoint), "ctranslate2")
    assert load_engine(str(checkpoint), "auto").name == "raymt"  # auto without CTranslate2
