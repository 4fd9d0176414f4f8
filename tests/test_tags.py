"""Multilingual (tagged) models at inference: `--tgt-lang` puts the target's tag first in
`raymt translate` and `raymt evaluate`, bad languages are one line before anything heavy loads,
one-pair models behave as before, and a CTranslate2 export translates with the documented snippet.

The tagged model is a tiny Transformer fitted in a few seconds to 24 built-in English sentences
translated into German and French until it has memorized them, its sources tagged as `raymt data
prepare` tags them, with a SentencePiece model whose tags are control symbols (passed to
sentencepiece's trainer directly): so its outputs are real pieces, differ by tag, end by
themselves, and are nats away from a tie on any host's kernels (tests/agreement.py).
"""

import contextlib
import dataclasses
import functools
import io
import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F
from agreement import assert_texts_agree, min_margin
from tiny_checkpoint import make_checkpoint, one_thread, write_pairs  # noqa: F401 (autouse fixture)

from raymt import average, engines, evaluate, exporting, translate
from raymt.checkpoint import (
    TrainState,
    check_languages,
    languages_entry,
    load_model,
    model_languages,
    save_checkpoint,
)
from raymt.command import parse
from raymt.config import Config, CorpusSpec, DataConfig, tiny
from raymt.data.builtin import generate
from raymt.decoding import DecodeOptions, decode_nbest, encode_sources, pad_batch, translate_nbest
from raymt.model import Transformer
from raymt.tags import reserved_pieces
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts

PAIRS = [("en", "de"), ("en", "fr")]
# What `raymt data prepare` reserves for these corpora: ids 4 and 5, after PAD/UNK/BOS/EOS.
TAGS = reserved_pieces([CorpusSpec(src, tgt) for src, tgt in PAIRS])
TAG_ID = {"de": 4, "fr": 5}
# The training sources (the same English for both pairs): the model's outputs on them end.
NUM_PAIRS = 24
SENTENCES = generate(NUM_PAIRS, "en", "de", seed=2)[0]
GREEDY = DecodeOptions(beam=1)


@functools.lru_cache(maxsize=None)
def tagged_tokenizer() -> Tokenizer:
    """A joint en/de/fr SentencePiece model with the tags as control symbols."""
    text = [line for src, tgt in PAIRS for side in generate(300, src, tgt, seed=1) for line in side]
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=buffer,
        vocab_size=250,
        character_coverage=1.0,
        pad_id=PAD_ID,
        unk_id=1,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        hard_vocab_limit=False,
        control_symbols=TAGS,
        minloglevel=2,
    )
    return Tokenizer(buffer.getvalue())


def fit_tagged(tok: Tokenizer) -> Transformer:
    """A 1+1-layer model after 600 Adam steps on tagged en->de and en->fr pairs: it has memorized
    them (loss ~0.001, every greedy output its target, each step 6+ nats ahead of the runner-up,
    where 100 steps left ties that AMX's rounding broke otherwise than AVX2's)."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(tiny(), num_encoder_layers=1, num_decoder_layers=1), tok.vocab_size)
    sources, targets = [], []
    for src_lang, tgt_lang in PAIRS:
        src, tgt = generate(NUM_PAIRS, src_lang, tgt_lang, seed=2)
        sources += [[TAG_ID[tgt_lang], *tok.encode(s), EOS_ID] for s in src]
        targets += [[BOS_ID, *tok.encode(t), EOS_ID] for t in tgt]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(600):
        idx = torch.randint(0, len(sources), (16,), generator=g).tolist()
        s, t = pad_batch([sources[i] for i in idx]), pad_batch([targets[i] for i in idx])
        logits = model(s, t[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def tagged(tmp_path_factory) -> Path:
    """A tagged checkpoint: trained tiny model, tagged spm.model, config.json with `languages`."""
    tok = tagged_tokenizer()
    reserved = {piece: tok.sp.piece_to_id(piece) for piece in TAGS}
    model = fit_tagged(tok)
    config = Config(model=model.cfg, data=DataConfig(vocab_size=256))
    directory = tmp_path_factory.mktemp("tagged") / "checkpoint"
    return save_checkpoint(directory, model, config, tok, TrainState(step=600), languages_entry(PAIRS, reserved))


@pytest.fixture(scope="module")
def untagged(tmp_path_factory) -> Path:
    """A one-pair (en->de) checkpoint as every run so far writes it."""
    return make_checkpoint(tmp_path_factory.mktemp("untagged") / "checkpoint")


def expected(checkpoint: Path, sentences: list[str], tgt_lang: str, opts: DecodeOptions = GREEDY) -> list[str]:
    """raymt's own translations with the tag of `tgt_lang` before each source."""
    model, tok, _ = load_model(checkpoint)
    return [h[0][1] for h in translate_nbest(model, tok, sentences, opts, prefix=[TAG_ID[tgt_lang]])]


def record_sources(monkeypatch) -> list[torch.Tensor]:
    """Every (B, S) source the model encodes, from now on."""
    seen: list[torch.Tensor] = []
    real = Transformer.encode

    def encode(self, src, *args, **kwargs):
        seen.append(src.clone())
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(Transformer, "encode", encode)
    return seen


def no_weights(monkeypatch, module) -> None:
    """Fail the test if `module` loads a model (bad input must be refused before)."""

    def refuse(*_, **__):
        raise AssertionError("the weights must not load on bad input")

    monkeypatch.setattr(module, "load_model", refuse)


# ---------------------------------------------------------------- tokenizer and config.json


def test_tags_are_control_symbols_never_made_from_text_and_dropped_by_decode():
    tok = tagged_tokenizer()
    assert TAGS == ["<2de>", "<2fr>"]
    assert [tok.sp.piece_to_id(t) for t in TAGS] == [4, 5] and all(tok.sp.is_control(i) for i in (4, 5))
    text = "<2de> das Haus <2fr>"
    assert not {4, 5} & set(tok.encode(text)) and len(tok.encode(text)) > 6  # literal tags stay text
    assert not set(TAGS) & set(tok.sp.encode(text, out_type=str))
    ids = tok.encode("the house")
    assert tok.decode([4, *ids, 5]) == tok.decode(ids) == "the house"
    assert tok.decode([4, *ids, EOS_ID, *ids]) == "the house"


def test_languages_are_recorded_only_for_tagged_models(tagged, untagged):
    assert model_languages(untagged) is None
    assert "languages" not in json.loads((untagged / "config.json").read_text())
    assert model_languages(tagged) == {
        "pairs": [["en", "de"], ["en", "fr"]],
        "target_langs": ["de", "fr"],
        "reserved": {"<2de>": 4, "<2fr>": 5},
    }
    prefix = lambda checkpoint, tgt_lang: engines.load_model_info(str(checkpoint)).prefix(tgt_lang)  # noqa: E731
    assert prefix(tagged, "fr") == [5] and prefix(untagged, None) == []
    assert prefix(untagged, "de") == []


@pytest.mark.parametrize(
    "entry",
    [
        {"pairs": [["en", "de"]], "target_langs": ["fr"], "reserved": {}},
        {"pairs": [["en", "de", "fr"]], "target_langs": ["de"], "reserved": {}},
        {"pairs": [["en", "de"]], "target_langs": ["de"], "reserved": {"<2de>": "4"}},
        {"pairs": [], "target_langs": [], "reserved": {}},
        ["en", "de"],
    ],
)
def test_a_malformed_languages_entry_is_one_line(entry, tmp_path):
    with pytest.raises(ValueError, match=r"^x: malformed languages entry .*; expected \{"):
        check_languages(entry, "x")
    checkpoint = make_checkpoint(tmp_path / "checkpoint")
    meta = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**meta, "languages": entry}))
    with pytest.raises(ValueError, match=r"config.json: malformed languages entry"):
        model_languages(checkpoint)


# ---------------------------------------------------------------- translate


@pytest.mark.parametrize("tgt_lang", ["de", "fr"])
def test_translate_puts_the_tag_first(tagged, tgt_lang, monkeypatch, capsys):
    seen = record_sources(monkeypatch)
    sentences = SENTENCES[:8]
    assert translate.main(["--checkpoint", str(tagged), "--tgt-lang", tgt_lang, "--beam", "1", *sentences]) == 0
    out = capsys.readouterr().out.split("\n")[:-1]
    tok = tagged_tokenizer()
    got = sorted(row[row != PAD_ID].tolist() for src in seen for row in src)
    assert got == sorted([TAG_ID[tgt_lang], *tok.encode(s), EOS_ID] for s in sentences)
    monkeypatch.undo()
    assert out == expected(tagged, sentences, tgt_lang)


def test_the_tag_decides_the_language(tagged):
    de, fr = expected(tagged, SENTENCES, "de"), expected(tagged, SENTENCES, "fr")
    assert sum(a != b for a, b in zip(de, fr)) >= len(SENTENCES) // 2


def test_the_tagged_model_is_far_from_ties(tagged):
    """The premise of comparing its outputs across engines and hosts: every greedy output is the
    sentence's target, each token at least 1 nat ahead of the runner-up (rounding moves ~1e-5)."""
    model, tok, _ = load_model(tagged)
    for src_lang, tgt_lang in PAIRS:
        src, tgt = generate(NUM_PAIRS, src_lang, tgt_lang, seed=2)
        sources = encode_sources(tok, src, model.cfg.max_positions, [TAG_ID[tgt_lang]])
        outputs = [ids for [(_, ids)] in decode_nbest(model, pad_batch(sources), GREEDY)]
        assert outputs == [tok.encode(t) for t in tgt]
        assert min(min_margin(model, s, out) for s, out in zip(sources, outputs)) > 1.0


def test_a_tagged_source_still_fits_the_positions():
    tok = tagged_tokenizer()
    long = " ".join(SENTENCES * 20)
    [plain], [tagged_ids] = encode_sources(tok, [long], 64), encode_sources(tok, [long], 64, prefix=[4])
    assert len(plain) == len(tagged_ids) == 63  # max_positions - 1
    assert tagged_ids == [4, *plain[:-2], EOS_ID]
    assert encode_sources(tok, SENTENCES, 64, prefix=()) == encode_sources(tok, SENTENCES, 64)


def test_one_pair_models_translate_as_before(untagged, capsys):
    args = ["--checkpoint", str(untagged), "--beam", "2", "--max-len-b", "4", *SENTENCES[:3]]
    assert translate.main(args) == 0
    before = capsys.readouterr().out
    assert translate.main([*args, "--tgt-lang", "de"]) == 0
    assert capsys.readouterr().out == before and before.count("\n") == 3


BAD = {
    "missing": ("tagged", [], "this model translates into de, fr: pass --tgt-lang"),
    "untrained": ("tagged", ["--tgt-lang", "es"], "--tgt-lang es: this model was trained to translate into de, fr"),
    "mismatch": ("untagged", ["--tgt-lang", "fr"], "--tgt-lang fr: this model translates en -> de only"),
    "other_spm": ("other_spm", ["--tgt-lang", "de"], "config.json reserves id 4 for <2de> but spm.model does not"),
}


@pytest.fixture
def bad_checkpoint(request, tagged, untagged, tmp_path):
    """The checkpoint of a BAD case; other_spm: the tagged config.json beside an untagged spm.model."""
    name = BAD[request.param][0]
    if name != "other_spm":
        return {"tagged": tagged, "untagged": untagged}[name]
    directory = tmp_path / "mixed"
    directory.mkdir()
    for f in ("config.json", "model.pt"):
        (directory / f).write_bytes((tagged / f).read_bytes())
    (directory / "spm.model").write_bytes((untagged / "spm.model").read_bytes())
    meta = json.loads((directory / "config.json").read_text())
    meta["vocab_size"] = Tokenizer.load(directory / "spm.model").vocab_size  # only the tags differ
    (directory / "config.json").write_text(json.dumps(meta))
    return directory


@pytest.mark.parametrize("bad_checkpoint", list(BAD), indirect=True)
def test_bad_languages_are_one_line_before_loading(bad_checkpoint, request, monkeypatch, err_lines):
    _, flags, message = BAD[request.node.callspec.params["bad_checkpoint"]]
    no_weights(monkeypatch, engines)  # where raymt.translate loads them
    assert translate.main(["--checkpoint", str(bad_checkpoint), *flags, "Belize"]) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.translate: error: ") and message in err[0], err


# ---------------------------------------------------------------- evaluate


def write_set(prefix: Path, tgt_lang: str) -> Path:
    """PREFIX.en and PREFIX.<tgt_lang> from the built-in corpus."""
    src, tgt = generate(9, "en", tgt_lang, seed=13)
    for lang, lines in (("en", src), (tgt_lang, tgt)):
        Path(f"{prefix}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return prefix


def test_evaluate_decodes_with_the_tag(tagged, tmp_path):
    """check_args (before Ray) finds the tag and the source suffix; the planned batches start with
    the tag, and an actor decodes them as `raymt translate --tgt-lang fr` does."""
    prefix = write_set(tmp_path / "test", "fr")
    argv = ["--checkpoint", str(tagged), "--test", str(prefix), "--tgt-lang", "fr", "--beam", "1"]
    cfg = parse(evaluate.EvaluateConfig, [*argv, "--output-dir", str(tmp_path / "out")], "raymt evaluate")
    plan = evaluate.check_inputs(cfg)
    assert (plan.cfg.src_lang, plan.cfg.tgt_lang, plan.tag_lang) == ("en", "fr", "fr")
    sources = plan.sets["test"][0]
    rows = evaluate.plan_batches([engines.load_model_info(str(tagged)).encode(sources, plan.tag_lang)], 4)
    actor = evaluate.BatchTranslator(str(tagged), dict(plan.cfg.decode.__dict__), "cpu", 1)
    hyps: dict[int, str] = {}
    for row in rows:
        starts = np.cumsum(np.r_[0, row["lengths"][:-1]])
        assert (row["src_ids"][starts] == 5).all()
        out = actor({k: [v] for k, v in row.items()})
        hyps.update(zip(out["index"].tolist(), out["hyp"].tolist()))
    assert [hyps[i] for i in range(len(sources))] == expected(tagged, sources, "fr")


def test_evaluate_main_passes_the_tag_to_the_cluster(tagged, tmp_path, monkeypatch):
    """`raymt evaluate --tgt-lang fr` hands the tag to the actor pool (Ray stubbed out: the end to
    end run is the slow test below) and writes the hypotheses under the target's suffix."""
    calls = []

    def decode(checkpoint, sources, opts, *args, src_lang=None):
        calls.append((args[-1], src_lang))
        return [[(0.0, "x")] * len(s) for s in sources]

    monkeypatch.setattr(evaluate, "init_ray", lambda *_, **__: False)
    monkeypatch.setattr(evaluate, "actor_plan", lambda *_, **__: None)
    monkeypatch.setattr(evaluate, "translate_on_cluster", decode)
    prefix = write_set(tmp_path / "test", "fr")
    argv = ["--checkpoint", str(tagged), "--test", str(prefix), "--tgt-lang", "fr", "--num-actors", "1"]
    assert evaluate.main([*argv, "--output-dir", str(tmp_path / "out")]) == 0
    assert calls == [("fr", "en")] and (tmp_path / "out" / "test.fr.hyp").read_text() == "x\n" * 9


@pytest.mark.slow
def test_evaluate_on_the_cluster_with_the_tag(ray_cluster, tagged, tmp_path):
    prefix = write_set(tmp_path / "test", "de")
    argv = ["--checkpoint", str(tagged), "--test", str(prefix), "--tgt-lang", "de", "--beam", "1"]
    assert evaluate.main([*argv, "--num-actors", "1", "--output-dir", str(tmp_path / "out")]) == 0
    hyps = (tmp_path / "out" / "test.de.hyp").read_text(encoding="utf-8").split("\n")[:-1]
    assert hyps == expected(tagged, generate(9, "en", "de", seed=13)[0], "de")


@pytest.mark.parametrize("case", ["missing", "untrained", "no_source"])
def test_evaluate_bad_languages_are_one_line_before_ray(tagged, case, tmp_path, monkeypatch, err_lines):
    def no_ray(*_, **__):
        raise AssertionError("Ray must not start on bad input")

    monkeypatch.setattr(evaluate, "init_ray", no_ray)
    flags, message = {
        "missing": ([], "this model translates into de, fr: pass --tgt-lang"),
        "untrained": (["--tgt-lang", "es"], "this model was trained to translate into de, fr"),
        "no_source": (["--tgt-lang", "de", "--src-lang", "xx"], "missing file"),
    }[case]
    prefix = write_set(tmp_path / "test", "de")
    argv = ["--checkpoint", str(tagged), "--test", str(prefix), "--output-dir", str(tmp_path / "o"), *flags]
    assert evaluate.main(argv) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.evaluate: error: ") and message in err[0], err


def test_evaluate_keeps_one_pair_suffixes_as_file_names(untagged, tmp_path):
    """A one-pair model's --src-lang/--tgt-lang only name the files, as before: no tag, no check."""
    prefix = write_set(tmp_path / "test", "fr")
    argv = ["--checkpoint", str(untagged), "--test", str(prefix), "--tgt-lang", "fr"]
    plan = evaluate.check_inputs(parse(evaluate.EvaluateConfig, [*argv, "--output-dir", str(tmp_path / "out")], "e"))
    assert (plan.cfg.src_lang, plan.cfg.tgt_lang, plan.tag_lang) == ("en", "fr", None)
    assert len(plan.sets["test"][0]) == 9


# ---------------------------------------------------------------- average and export


def test_average_and_export_keep_the_languages(tagged, tmp_path):
    averaged = average.average_checkpoints([tagged, tagged], tmp_path / "avg")
    exported = exporting.export_model(averaged, tmp_path / "model", "torch")
    assert model_languages(averaged) == model_languages(exported) == model_languages(tagged)
    untagged_copy = tmp_path / "untagged_copy"
    untagged_copy.mkdir()
    for f in ("model.pt", "spm.model"):
        (untagged_copy / f).write_bytes((tagged / f).read_bytes())
    meta = json.loads((tagged / "config.json").read_text())
    del meta["languages"]
    (untagged_copy / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="was trained on other language pairs than"):
        average.check_same_model([tagged, untagged_copy])


def doc_snippet() -> str:
    """The Python block of docs/translate.md's "Multilingual models" section."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "translate.md").read_text()
    section = page.split("## Multilingual models", 1)[1]
    return textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.S)[1])


def ended(model: Transformer, sentences: list[str], opts: DecodeOptions) -> list[str]:
    """The sentences whose output ends before raymt's length limit into every target language
    (where raymt forces EOS, CTranslate2 would go on), each output at least two words."""
    tok, keep = tagged_tokenizer(), []
    for sentence in sentences:
        ok = True
        for tgt_lang in ("de", "fr"):
            [src] = encode_sources(tok, [sentence], model.cfg.max_positions, [TAG_ID[tgt_lang]])
            [[(_, ids)]] = decode_nbest(model, pad_batch([src]), opts)
            # raymt's limit, EOS included, is int(a * len + b) in float32: one token of margin.
            ok &= len(ids) + 2 < opts.max_len_a * len(src) + opts.max_len_b and len(tok.decode(ids).split()) >= 2
        keep += [sentence] if ok else []
    return keep


def test_ctranslate2_snippet_matches_raymt(tagged, tmp_path):
    """docs/translate.md's snippet, run as written (one CTranslate2 thread) on the exported model,
    prints raymt's greedy and beam translations into both languages."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = exporting.export_model(tagged, tmp_path / "ct2", "ctranslate2")
    vocab = json.loads((out / "shared_vocabulary.json").read_text())
    assert vocab[4:6] == TAGS and model_languages(out) == model_languages(tagged)
    snippet = doc_snippet().replace('"ct2/', f'"{out}/').replace("ctranslate2.Translator(", "Translator(")
    assert '["<2de>"] + sp.encode("text", out_type=str)' in snippet and "beam_size=5" in snippet

    def run(code: str) -> str:
        printed = io.StringIO()
        translator = functools.partial(ctranslate2.Translator, intra_threads=1)
        with contextlib.redirect_stdout(printed):
            exec(code, {"Translator": translator})
        return printed.getvalue().rstrip("\n")

    model, tok, _ = load_model(tagged)
    for beam in (1, 5):
        opts = DecodeOptions(beam=beam, length_penalty=0.0)
        sentences = ended(model, SENTENCES[:16], opts)
        assert len(sentences) >= 4, sentences
        for tgt_lang in ("de", "fr"):
            code = snippet.replace("<2de>", f"<2{tgt_lang}>").replace("beam_size=5", f"beam_size={beam}")
            got = [run(code.replace('"text"', repr(s))) for s in sentences]
            nbest = translate_nbest(model, tok, sentences, opts, prefix=[TAG_ID[tgt_lang]])
            sources = encode_sources(tok, sentences, model.cfg.max_positions, [TAG_ID[tgt_lang]])
            assert_texts_agree(model, tok, sources, got, [h[0][1] for h in nbest])
