"""A decoder-side target tag (data.tag_side = "tgt"; fairseq's --decoder-langtok, M2M-100/NLLB):
training moves each source's tag to the decoder (BOS <2de> w1 ..., the tag no prediction target),
decoding forces it after BOS, and `raymt translate`, the CTranslate2 export with
`target_prefix` and docs/translate.md's snippet give the same output, never the tag.

The model is a d=16, 1+1-layer Transformer fitted in a few seconds, through raymt's own
collation, to test_tags.py's 24 English sentences into German and French. Outputs of two engines
are compared as tests/agreement.py says: equal, or tied where they part.
"""

import dataclasses
import functools
import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from agreement import assert_texts_agree
from test_tags import NUM_PAIRS, PAIRS, SENTENCES, TAG_ID, TAGS, tagged_tokenizer
from tiny_checkpoint import one_thread  # noqa: F401 (autouse fixture)
from torch.utils.data import DataLoader

from raymt import evaluate, exporting, translate
from raymt.batching import collate, collate_flat, pad_batch, pad_rows, tag_to_decoder
from raymt.checkpoint import (
    TrainState,
    check_languages,
    languages_entry,
    load_model,
    model_languages,
    save_checkpoint,
)
from raymt.config import Config, CorpusSpec, DataConfig, DecodeOptions, tiny
from raymt.data.builtin import generate
from raymt.decoding import decode_nbest, encode_sources, split_tags, translate_nbest
from raymt.engines import load_engine
from raymt.metrics import score
from raymt.model import Transformer
from raymt.tags import check_tag_side
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID
from raymt.trainer import collate_eval
from raymt.trainer import evaluate as validate

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts

# CTranslate2 scores as raymt at length penalty 0. A length limit far above the outputs' lengths:
# at the limit raymt forces EOS (and scores it) where CTranslate2 returns the unfinished beam
# (unscored EOS), so a looping second beam that reaches a tight limit ahead of a finished first
# one would part the engines by design, not by rounding; with room it falls behind and is dropped.
BEAM2 = DecodeOptions(beam=2, length_penalty=0.0, max_len_b=200)


def fit_decoder_tagged(pre_norm: bool = True) -> Transformer:
    """A d=16 1+1-layer model after 400 Adam steps on en->de and en->fr pairs collated with the tag
    on the decoder side, the loss on tgt_out as raymt's trainer takes it (PAD ignored): most of
    its outputs are its training targets (after 150 steps few were, and ties were common)."""
    tok = tagged_tokenizer()
    torch.manual_seed(0)
    cfg = dataclasses.replace(
        tiny(), d_model=16, d_ff=32, num_encoder_layers=1, num_decoder_layers=1, pre_norm=pre_norm
    )
    model = Transformer(cfg, tok.vocab_size)
    sources, targets = [], []
    for src_lang, tgt_lang in PAIRS:
        src, tgt = generate(NUM_PAIRS, src_lang, tgt_lang, seed=2)
        sources += [[TAG_ID[tgt_lang], *tok.encode(s), EOS_ID] for s in src]  # as prepare writes them
        targets += [tok.encode(t) for t in tgt]
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        idx = torch.randint(0, len(sources), (16,), generator=g).tolist()
        batch = collate([sources[i] for i in idx], [targets[i] for i in idx], tag_side="tgt")
        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def save_decoder_tagged(directory: Path, pre_norm: bool = True) -> Path:
    """A checkpoint trained with data.tag_side = "tgt": its config.json records it in `languages`."""
    tok = tagged_tokenizer()
    reserved = {piece: tok.sp.piece_to_id(piece) for piece in TAGS}
    model = fit_decoder_tagged(pre_norm)
    data = DataConfig(vocab_size=256, corpora=[CorpusSpec(s, t) for s, t in PAIRS], tag_side="tgt")
    languages = languages_entry(PAIRS, reserved, "tgt")
    return save_checkpoint(directory, model, Config(model=model.cfg, data=data), tok, TrainState(step=400), languages)


@pytest.fixture(scope="module")
def decoder_tagged(tmp_path_factory) -> Path:
    """The pre-norm decoder-side tagged checkpoint of the tests."""
    return save_decoder_tagged(tmp_path_factory.mktemp("decoder_tagged") / "checkpoint")


def raymt_nbest(checkpoint: Path, sentences: list[str], tgt_lang: str, opts: DecodeOptions) -> list:
    """raymt.decoding's n-best of sentences into `tgt_lang`: the tag forced first in the decoder."""
    model, tok, _ = load_model(checkpoint)
    return translate_nbest(model, tok, sentences, opts, prefix=[TAG_ID[tgt_lang]], tag_side="tgt")


def assert_raymt_agrees(checkpoint: Path, sentences: list[str], tgt_lang: str, got: list[str], want: list[str]):
    """Another engine's outputs `got` are raymt's `want` but where raymt's scorer finds a tie."""
    model, tok, _ = load_model(checkpoint)
    sources = encode_sources(tok, sentences, model.cfg.max_positions)  # the tag is the decoder's
    assert_texts_agree(model, tok, sources, got, want, prefix=[TAG_ID[tgt_lang]])


def ended(checkpoint: Path, opts: DecodeOptions) -> list[str]:
    """SENTENCES whose outputs into both languages end before raymt's length limit (where raymt
    forces EOS CTranslate2 truncates), each at least two words."""
    key = (str(checkpoint), repr(opts))
    if key not in ENDED:
        ENDED[key] = _ended(checkpoint, opts)
    return ENDED[key]


ENDED: dict[tuple[str, str], list[str]] = {}


def _ended(checkpoint: Path, opts: DecodeOptions) -> list[str]:
    """`ended`, computed."""
    model, tok, _ = load_model(checkpoint)
    keep = []
    for sentence in SENTENCES:
        ok = True
        for lang in ("de", "fr"):
            [src] = encode_sources(tok, [sentence], model.cfg.max_positions)  # the source without its tag
            [[(_, ids), *_]] = decode_nbest(model, pad_batch([src]), opts, prefix=torch.tensor([[TAG_ID[lang]]]))
            ok &= len(ids) + 2 < opts.max_len_a * len(src) + opts.max_len_b and len(tok.decode(ids).split()) >= 2
        keep += [sentence] if ok else []
    return keep


# ---------------------------------------------------------------- training batches


def test_the_tag_moves_to_the_decoder_and_is_no_target():
    src = [[4, 10, 11, EOS_ID], [5, 12, EOS_ID]]
    tgt = [[20, 21], [22, 23, 24]]
    batch = collate(src, tgt, tag_side="tgt")
    assert batch.src.tolist() == [[10, 11, EOS_ID], [12, EOS_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 4, 20, 21, PAD_ID], [BOS_ID, 5, 22, 23, 24]]
    assert batch.tgt_out.tolist() == [[PAD_ID, 20, 21, EOS_ID, PAD_ID], [PAD_ID, 22, 23, 24, EOS_ID]]
    assert batch.num_tokens == 7 == collate(src, tgt).num_tokens  # the tag is not counted
    # The stream's collation (Arrow's flat layout, raw ids: EOS and BOS added there) moves it alike.
    flat_src = (np.array([4, 10, 11, 5, 12]), np.array([0, 3, 5]))
    flat_tgt = (np.array([20, 21, 22, 23, 24]), np.array([0, 2, 5]))
    stream = collate_flat(flat_src, flat_tgt, np.arange(2), tag_side="tgt")
    assert [t.tolist() for t in (stream.src, stream.tgt_in, stream.tgt_out)] == [
        t.tolist() for t in (batch.src, batch.tgt_in, batch.tgt_out)
    ]
    assert stream.num_tokens == 7
    filler = tag_to_decoder(pad_rows(collate(src, tgt), 3))  # a padding row keeps EOS as its one key
    assert filler.src[2].tolist() == [EOS_ID, PAD_ID, PAD_ID] and filler.tgt_out[2].eq(PAD_ID).all()
    assert filler.tgt_in[2].tolist() == [BOS_ID] + [PAD_ID] * 4 and filler.num_tokens == 7


def test_the_forced_prefix_decodes_as_full_recomputation(decoder_tagged):
    model, tok, _ = load_model(decoder_tagged)
    sources = pad_batch(encode_sources(tok, SENTENCES[:6], 64, [TAG_ID["fr"]]))
    src, prefix = split_tags(sources, "tgt")
    assert prefix.flatten().tolist() == [TAG_ID["fr"]] * 6 and torch.equal(src, sources[:, 1:])
    for beam in (1, 3):
        opts = DecodeOptions(beam=beam, length_penalty=0.6, max_len_b=12)
        cached = decode_nbest(model, src, opts, prefix=prefix)
        reference = decode_nbest(model, src, dataclasses.replace(opts, use_cache=False), prefix=prefix)
        assert [[ids for _, ids in h] for h in cached] == [[ids for _, ids in h] for h in reference]
        assert all(TAG_ID["fr"] not in ids and TAG_ID["de"] not in ids for h in cached for _, ids in h)
    # Forcing: greedy's first step is the tag whatever the model prefers, then it goes on from it.
    [[(_, forced)]] = decode_nbest(model, src[:1], DecodeOptions(beam=1), prefix=prefix[:1])
    with torch.no_grad():
        memory, mask = model.encode(src[:1])
        tokens = torch.tensor([[BOS_ID, TAG_ID["fr"]]])
        for _ in forced:
            tokens = torch.cat([tokens, model.decode(tokens, memory, mask)[:, -1:].argmax(-1)], 1)
    assert tokens[0, 2:].tolist() == forced


def test_validation_decodes_with_the_tag_in_the_decoder(decoder_tagged):
    model, tok, _ = load_model(decoder_tagged)
    src, refs = generate(8, "en", "fr", seed=2)
    rows = [
        {"index": i, "src_ids": ids, "tgt_ids": tok.encode(r)}
        for i, (ids, r) in enumerate(zip(encode_sources(tok, src, 64, [TAG_ID["fr"]]), refs))
    ]
    loader = DataLoader(rows, batch_size=3, collate_fn=functools.partial(collate_eval, tag_side="tgt"))
    opts = DecodeOptions(beam=1)
    metrics = validate(model, loader, tok, refs, opts, lang="fr")
    hyps = [h[0][1] for h in raymt_nbest(decoder_tagged, src, "fr", opts)]
    assert metrics["valid_bleu"] == score(hyps, refs, lang="fr")["bleu"]
    assert metrics["valid_tokens"] == sum(len(r["tgt_ids"]) + 1 for r in rows)  # EOS counts, the tag does not


# ---------------------------------------------------------------- translate, evaluate, CTranslate2


@pytest.mark.parametrize("tgt_lang", ["de", "fr"])
def test_translate_and_the_ctranslate2_export_agree(decoder_tagged, tgt_lang, tmp_path, capsys):
    """Done-when of issue 45 item 4: `raymt translate` (raymt's engine) and the CTranslate2 export
    with target_prefix (fp32, beam 2) give the same outputs (up to ties), without the tag."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    sentences = ended(decoder_tagged, BEAM2)
    assert len(sentences) >= 6, sentences
    args = ["--checkpoint", str(decoder_tagged), "--tgt-lang", tgt_lang, "--beam", "2", "--length-penalty", "0"]
    args += ["--max-len-b", str(BEAM2.max_len_b)]
    assert translate.main([*args, *sentences]) == 0
    got = capsys.readouterr().out.split("\n")[:-1]
    assert got == [h[0][1] for h in raymt_nbest(decoder_tagged, sentences, tgt_lang, BEAM2)]
    out = exporting.export_model(decoder_tagged, tmp_path / "ct2", "ctranslate2")
    assert model_languages(out)["tag_side"] == "tgt"
    tok = tagged_tokenizer()
    translator = ctranslate2.Translator(str(out), compute_type="float32", intra_threads=1)
    pieces = [tok.sp.encode(s, out_type=str) for s in sentences]
    results = translator.translate_batch(
        pieces, [[f"<2{tgt_lang}>"]] * len(pieces), beam_size=2, length_penalty=0, min_decoding_length=0
    )
    assert all(r.hypotheses[0][0] == f"<2{tgt_lang}>" for r in results)  # CTranslate2 returns the prefix
    assert_raymt_agrees(decoder_tagged, sentences, tgt_lang, [tok.sp.decode(r.hypotheses[0][1:]) for r in results], got)
    assert not any(p in TAGS for r in results for p in r.hypotheses[0][1:])
    engine = load_engine(str(decoder_tagged), "ctranslate2", compute_type="float32", cache=str(tmp_path / "cache"))
    ct2_outputs = [h[0][1] for h in engine.translate(sentences, BEAM2, tgt_lang)]
    assert_raymt_agrees(decoder_tagged, sentences, tgt_lang, ct2_outputs, got)
    other = "fr" if tgt_lang == "de" else "de"
    assert sum(a != b[0][1] for a, b in zip(got, raymt_nbest(decoder_tagged, sentences, other, BEAM2))) >= 3


def test_one_batch_of_both_languages(decoder_tagged, tmp_path):
    """Engines (serve, backtranslate) batch sentences of several targets: each gets its own prefix."""
    sentences = SENTENCES[:6]
    langs = ["de", "fr"] * 3
    want = [raymt_nbest(decoder_tagged, [s], lang, BEAM2)[0][0][1] for s, lang in zip(sentences, langs)]
    engine = load_engine(str(decoder_tagged), "raymt")
    assert [h[0][1] for h in engine.translate_ids(engine.encode(sentences, langs), BEAM2)] == want


def test_training_test_sets_decode_with_the_tag(decoder_tagged):
    model, _, _ = load_model(decoder_tagged)
    cfg = Config(model=model.cfg, data=DataConfig(tag_side="tgt"), decode=BEAM2)
    got = evaluate.decode_on_driver(decoder_tagged, SENTENCES[:5], cfg, tgt_lang="de")
    assert got == [h[0][1] for h in raymt_nbest(decoder_tagged, SENTENCES[:5], "de", BEAM2)]


def doc_snippet() -> str:
    """The Python block of docs/translate.md's "Decoder-side tags" part."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "translate.md").read_text()
    section = page.split("### Decoder-side tags", 1)[1]
    return textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.S)[1])


def test_the_documented_ctranslate2_snippet(decoder_tagged, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    out = exporting.export_model(decoder_tagged, tmp_path / "ct2", "ctranslate2")
    snippet = doc_snippet()
    assert 'target_prefix=[["<2de>"]]' in snippet
    sentence = ended(decoder_tagged, BEAM2)[0]
    translator = f'ctranslate2.Translator("{out}/", compute_type="float32", intra_threads=1)'
    code = snippet.replace('ctranslate2.Translator("ct2/")', translator).replace('"ct2/', f'"{out}/')
    exec(code.replace('"text"', repr(sentence)).replace("beam_size=5", "beam_size=2"), {})
    want = raymt_nbest(decoder_tagged, [sentence], "de", BEAM2)[0][0][1]
    assert_raymt_agrees(decoder_tagged, [sentence], "de", [capsys.readouterr().out.rstrip("\n")], [want])


# ---------------------------------------------------------------- the option and its record


def test_the_option_is_checked_and_recorded():
    with pytest.raises(ValueError, match="data.tag_side=.dec. must be src"):
        DataConfig(tag_side="dec")
    with pytest.raises(ValueError, match="data.tag_side=tgt puts the target-language tag first in the decoder"):
        check_tag_side("tgt", [CorpusSpec("en", "de"), CorpusSpec("en", "de", ("bt.",), "bt")])
    check_tag_side("tgt", [CorpusSpec("en", "de"), CorpusSpec("de", "en")])
    # A model trained with its tag on one side goes on with it there (--resume, --init).
    with pytest.raises(ValueError, match="ckpt trained with data.tag_side='tgt', this run sets 'src': drop --set"):
        check_tag_side("src", trained="tgt", model="ckpt")
    check_tag_side("tgt", trained="tgt")
    reserved = {"<2de>": 4, "<2fr>": 5}
    assert "tag_side" not in languages_entry(PAIRS, reserved)  # src: config.json as before
    assert languages_entry(PAIRS, reserved, "tgt")["tag_side"] == "tgt"
    for bad in ({"tag_side": "src"}, {"tag_side": "tgt", "reserved": {"<2de>": 4}}):
        entry = {**languages_entry(PAIRS, reserved), **bad}
        with pytest.raises(ValueError, match="malformed languages entry"):
            check_languages(entry, "config.json")
    assert json.dumps(languages_entry(PAIRS, reserved))  # plain JSON


def test_hugging_face_generates_from_the_tag(tmp_path):
    """The Marian export (post-norm models only) generates raymt's output from decoder_input_ids
    [BOS, <2de>], as docs/translate.md says."""
    transformers = pytest.importorskip("transformers")
    checkpoint = save_decoder_tagged(tmp_path / "checkpoint", pre_norm=False)
    marian = transformers.MarianMTModel.from_pretrained(
        str(exporting.export_model(checkpoint, tmp_path / "hf", "marian"))
    )
    tok, sentences = tagged_tokenizer(), ended(checkpoint, BEAM2)[:6]
    got = []
    for sentence in sentences:
        ids = torch.tensor([[*tok.encode(sentence), EOS_ID]])
        start = torch.tensor([[BOS_ID, TAG_ID["de"]]])
        out = marian.eval().generate(
            input_ids=ids, decoder_input_ids=start, num_beams=2, length_penalty=0.0, max_new_tokens=BEAM2.max_len_b
        )
        got.append(tok.decode(out[0, 2:].tolist()))
    assert len(sentences) >= 3
    want = [h[0][1] for h in raymt_nbest(checkpoint, sentences, "de", BEAM2)]
    assert_raymt_agrees(checkpoint, sentences, "de", got, want)
