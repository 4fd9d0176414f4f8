"""`raymt import` of the m2m_100 family: a Hugging Face NLLB-200 (and M2M-100) directory becomes a
raymt checkpoint that computes what transformers computes (logits, token ids, greedy and beam
search with the target's code forced first), and translates, serves and exports with its languages
as a raymt-trained model with a decoder-side tag does."""

import asyncio
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from agreement import assert_agree, raymt_scorer  # noqa: E402
from hf_models import save_m2m100, save_nllb  # noqa: E402
from tiny_checkpoint import one_thread  # noqa: E402, F401 (autouse fixture)

from raymt import export, hf_import  # noqa: E402
from raymt import translate as translate_cli  # noqa: E402
from raymt.checkpoint import load_model, model_languages  # noqa: E402
from raymt.config import DecodeOptions, ServeConfig  # noqa: E402
from raymt.data.builtin import generate  # noqa: E402
from raymt.decoding import _max_lengths, decode, pad_batch, split_tags  # noqa: E402
from raymt.engines import load_engine, load_model_info  # noqa: E402
from raymt.serve.api import Service  # noqa: E402
from raymt.serve.app import model_pairs  # noqa: E402
from raymt.serve.routing import Router  # noqa: E402
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402

pytestmark = pytest.mark.hosts  # decoded outputs across engines: ./run.sh test --hosts

SOURCES, TARGETS = generate(12, "en", "de", seed=5)
FR_SOURCES, _ = generate(4, "fr", "de", seed=6)
DE_SOURCES, _ = generate(4, "de", "en", seed=6)
NLLB_CODE_OF = {"en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn", "es": "spa_Latn"}


class Imported:
    """An NLLB- or M2M-100-style directory, its import, and the id map between them."""

    def __init__(self, tmp_path, family: str):
        self.family = family
        save = save_nllb if family == "nllb" else save_m2m100
        self.dir = save(tmp_path / f"{family}-tiny")
        self.checkpoint = hf_import.import_model(self.dir, tmp_path / "imported")
        self.model, self.tok, self.config = load_model(self.checkpoint)
        self.info = load_model_info(str(self.checkpoint))
        self.hf = transformers.M2M100ForConditionalGeneration.from_pretrained(str(self.dir)).eval()
        tokenizer = transformers.NllbTokenizer if family == "nllb" else transformers.M2M100Tokenizer
        self.hf_tok = tokenizer.from_pretrained(str(self.dir), src_lang=self.hf_lang("en"), tgt_lang=self.hf_lang("de"))
        self.to_hf, self.present = self.id_map()
        self.to_raymt = {self.to_hf[r]: r for r in self.present}

    def code(self, lang: str) -> str:
        """The model's code of a language: NLLB's deu_Latn, M2M-100's __de__."""
        return NLLB_CODE_OF[lang] if self.family == "nllb" else f"__{lang}__"

    def hf_lang(self, lang: str) -> str:
        """transformers' name of a language (src_lang): NLLB's code, M2M-100's two letters."""
        return NLLB_CODE_OF[lang] if self.family == "nllb" else lang

    def id_map(self) -> tuple[list[int], list[int]]:
        """raymt id -> HF id (PAD where HF has no row), and the raymt rows HF has (each once: BOS,
        the decoder's start, is a second </s>)."""
        pieces, pad = self.tok.pieces, self.hf.config.pad_token_id
        to_hf = {r: self.hf_tok.convert_tokens_to_ids(p) for r, p in enumerate(pieces) if not p.startswith("<raymt_")}
        unnamed = [r for r, p in enumerate(pieces) if p.startswith("<raymt_row_")]  # rows no piece names, in order
        to_hf.update(zip(unnamed, sorted(set(range(self.hf.config.vocab_size)) - set(to_hf.values()))))
        assert sorted(to_hf.values()) == list(range(self.hf.config.vocab_size))  # every HF row, once
        to_hf[BOS_ID] = self.hf.config.decoder_start_token_id
        return [to_hf.get(r, pad) for r in range(len(pieces))], sorted(r for r in to_hf if r != BOS_ID)

    def hf_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, T) raymt ids -> HF ids."""
        return torch.tensor([[self.to_hf[i] for i in row] for row in rows.tolist()])

    def hf_search(self, src: torch.Tensor, tag: int, limits: torch.Tensor, beam: int) -> list[list[int]]:
        """HF `generate` with the target's code forced first, raymt's limits (the code counted in
        them) and PAD suppressed (raymt's decoding never emits it), in raymt ids after the code."""
        everything = list(range(self.hf.config.vocab_size))
        eos = [self.hf.config.eos_token_id]
        allowed = lambda i, ids: eos if ids.numel() >= int(limits[i]) else everything  # noqa: E731
        out = self.hf.generate(
            input_ids=self.hf_ids(src),
            attention_mask=src != PAD_ID,
            forced_bos_token_id=self.to_hf[tag],
            suppress_tokens=[self.hf.config.pad_token_id],
            num_beams=beam,
            do_sample=False,
            max_new_tokens=int(limits.max()),
            max_length=None,
            early_stopping=True,
            length_penalty=0.0,
            prefix_allowed_tokens_fn=allowed,
        )
        rows = [[self.to_raymt[i] for i in row[2:] if i != self.hf.config.pad_token_id] for row in out.tolist()]
        return [row[: row.index(EOS_ID)] if EOS_ID in row else row for row in rows]

    def batch(self, texts, tgt_lang: str = "de", src_lang: str = "en") -> tuple[torch.Tensor, torch.Tensor]:
        """(sources without their target tag, (B, 1) decoder prefixes) as raymt's engine decodes them."""
        return split_tags(pad_batch(self.info.encode(texts, tgt_lang, src_lang)), "tgt")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    made: dict[str, Imported] = {}

    def get(family: str) -> Imported:
        if family not in made:
            made[family] = Imported(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get


@pytest.fixture(params=["nllb", "m2m100"])
def case(request, built):
    return built(request.param)


@pytest.fixture
def nllb(built):
    return built("nllb")


def test_languages_entry_and_config(case):
    languages = model_languages(case.checkpoint)
    names = ["de", "en", "es", "fr"] if case.family == "nllb" else sorted("en ha is ja cs ru zh de".split())
    assert languages["target_langs"] == names and languages["tag_side"] == "tgt"
    assert len(languages["pairs"]) == len(names) * (len(names) - 1)  # every direction
    assert languages["source_tags"] == {n: languages["reserved"][f"<2{n}>"] for n in names}
    for name in names:  # each language's tag is its code, a control
        tag = languages["reserved"][f"<2{name}>"]
        assert case.tok.id_to_piece(tag) == case.code(name) and case.tok.is_control(tag)
    data = case.config.data
    assert data.pair() == ("en", "de") and data.tag_side == "tgt" and data.corpus == str(case.dir.resolve())
    cfg = case.config.model
    assert cfg.pre_norm and cfg.positions == "fairseq" and cfg.activation == "relu" and cfg.scale_embedding


def test_token_ids_equal_hf_tokenizers(case):
    tag, *_ = case.info.prefix("de")
    ours, _ = case.batch(SOURCES)
    assert [[case.to_hf[i] for i in row if i != PAD_ID] for row in ours.tolist()] == case.hf_tok(SOURCES).input_ids
    case.hf_tok.src_lang = case.hf_lang("de")
    try:
        de, _ = case.batch(DE_SOURCES, "en", "de")
        assert [[case.to_hf[i] for i in row if i != PAD_ID] for row in de.tolist()] == case.hf_tok(DE_SOURCES).input_ids
    finally:
        case.hf_tok.src_lang = case.hf_lang("en")
    targets = case.hf_tok(text_target=TARGETS).input_ids  # the target's code, pieces, </s>
    assert [[case.to_hf[i] for i in [tag, *case.tok.encode(t, "tgt"), EOS_ID]] for t in TARGETS] == targets
    assert [case.tok.decode([tag, *case.tok.encode(t, "tgt")]) for t in TARGETS] == TARGETS


def test_logits_equal_hf(case):
    src, tags = case.batch(SOURCES)
    tgt = pad_batch([[BOS_ID, *tags[i].tolist(), *case.tok.encode(t, "tgt")] for i, t in enumerate(TARGETS)])
    with torch.no_grad():
        ours = case.model(src, tgt)
        theirs = case.hf(input_ids=case.hf_ids(src), attention_mask=src != PAD_ID, decoder_input_ids=case.hf_ids(tgt))
    real = tgt != PAD_ID
    hf_rows = [case.to_hf[r] for r in case.present]
    torch.testing.assert_close(ours[:, :, case.present][real], theirs.logits[:, :, hf_rows][real], atol=1e-4, rtol=0)
    # BOS (a second </s>) and the padding rows to 8 take no probability.
    absent = [r for r in range(case.tok.vocab_size) if r not in case.present]
    assert BOS_ID in absent and ours.log_softmax(-1)[:, :, absent].max() < -50


@pytest.mark.parametrize("beam", [1, 4])
def test_search_equals_hf_generate(beam, case):
    src, tags = case.batch(SOURCES)
    opts = DecodeOptions(beam=beam, length_penalty=0.0, max_len_a=1.2, max_len_b=6)
    ours = decode(case.model, src, opts, tags)
    theirs = case.hf_search(src, int(tags[0, 0]), _max_lengths(case.model, src, opts, forced=1), beam)
    sources = [[i for i in row if i != PAD_ID] for row in src.tolist()]
    assert_agree([raymt_scorer(case.model, tags[0].tolist())], sources, theirs, ours)


def test_translate_command_takes_src_and_tgt_lang(nllb, capsys):
    flags = ["--checkpoint", str(nllb.checkpoint), "--beam", "1", "--max-len-a", "0", "--max-len-b", "20"]
    assert translate_cli.main([*flags, "--src-lang", "en", "--tgt-lang", "de", SOURCES[0]]) == 0
    ours = capsys.readouterr().out.strip()
    src, tags = nllb.batch(SOURCES[:1])
    out = nllb.hf.generate(
        input_ids=nllb.hf_ids(src),
        forced_bos_token_id=nllb.to_hf[int(tags[0, 0])],
        suppress_tokens=[nllb.hf.config.pad_token_id],
        num_beams=1,
        do_sample=False,
        max_new_tokens=20,  # the code and 19 pieces: raymt's limit 20 + 1 (the code) holds EOS too
    )
    assert ours == nllb.hf_tok.decode(out[0], skip_special_tokens=True)
    assert translate_cli.main([*flags, "--tgt-lang", "de", SOURCES[0]]) == 0  # --src-lang: config.json's pair's
    assert capsys.readouterr().out.strip() == ours
    wrong = {"--tgt-lang": "was trained to translate into de, en, es, fr", "--src-lang": "reads de, en, es, fr"}
    for flag, message in wrong.items():
        assert translate_cli.main([*flags, "--src-lang", "en", "--tgt-lang", "de", flag, "xx", SOURCES[0]]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{flag} xx" in err and message in err, err


def call(service: Service, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of LibreTranslate's POST /translate to a Service, without HTTP."""
    reply = asyncio.run(service.handle("POST", "/translate", "application/json", json.dumps(body).encode()))
    return reply.status, json.loads(reply.content())


def test_serve_lists_the_languages_and_translates_from_the_named_source(nllb):
    cfg = ServeConfig({"nllb": str(nllb.checkpoint)}, engine="raymt", decode=DecodeOptions(beam=2, max_len_b=8))
    languages = Router(model_pairs(cfg), cfg.max_body_bytes, cfg.max_text_chars).local("GET", "/languages").body
    assert [(lang["code"], lang["targets"]) for lang in languages] == [
        ("de", ["en", "es", "fr"]),
        ("en", ["de", "es", "fr"]),
        ("es", ["de", "en", "fr"]),
        ("fr", ["de", "en", "es"]),
    ]
    engine = load_engine(str(nllb.checkpoint), "raymt")
    service = Service(engine, cfg, "nllb")
    for source, texts in (("en", SOURCES[:2]), ("fr", FR_SOURCES[:2])):
        status, body = call(service, {"q": texts, "source": source, "target": "es"})
        want = [hyps[0][1] for hyps in engine.translate(texts, cfg.decode, "es", src_lang=source)]
        assert status == 200 and body["translatedText"] == want
    assert engine.encode(FR_SOURCES[:1], "es", "fr") != engine.encode(FR_SOURCES[:1], "es", "en")  # the source's code
    # "auto": language ID among the model's sources (raymt.langid) picks the source's code.
    status, body = call(service, {"q": SOURCES[0], "source": "auto", "target": "es"})
    want = engine.translate(SOURCES[:1], cfg.decode, "es", src_lang="en")[0][0][1]
    assert status == 200 and body["detectedLanguage"]["language"] == "en" and body["translatedText"] == want
    status, body = call(service, {"q": SOURCES[0], "source": "en", "target": "xx"})
    assert status == 400 and "xx is not supported as a target language" in body["error"]


def test_imported_model_exports_to_ctranslate2(nllb, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    assert export.main(["--checkpoint", str(nllb.checkpoint), "--output", str(out), "--format", "ctranslate2"]) == 0
    translator = ctranslate2.Translator(str(out), device="cpu")
    src, tags = nllb.batch(SOURCES)
    sources = [[i for i in row if i != PAD_ID] for row in src.tolist()]
    pieces = [[nllb.tok.id_to_piece(i) for i in s[:-1]] for s in sources]  # the source's code first
    prefix = [[nllb.tok.id_to_piece(int(t))] for t in tags[:, 0]]  # the target's, the decoder's first
    results = translator.translate_batch(pieces, prefix, beam_size=1, max_decoding_length=13)
    theirs = [[nllb.tok.piece_to_id(p) for p in r.hypotheses[0][1:]] for r in results]
    opts = DecodeOptions(beam=1, length_penalty=0.0, max_len_a=0.0, max_len_b=13)
    ours = decode(nllb.model, src, opts, tags)
    assert_agree([raymt_scorer(nllb.model, tags[0].tolist())], sources, theirs, ours)
    # raymt's CTranslate2 engine puts both codes where the model reads them, as raymt's engine does.
    ct2 = load_engine(str(nllb.checkpoint), "ctranslate2", compute_type="float32", cache=str(tmp_path / "cache"))
    opts = DecodeOptions(beam=2, length_penalty=0.0, max_len_a=0.0, max_len_b=10)
    got = [hyps[0][1] for hyps in ct2.translate(FR_SOURCES, opts, "es", src_lang="fr")]
    want = [
        hyps[0][1]
        for hyps in load_engine(str(nllb.checkpoint), "raymt").translate(FR_SOURCES, opts, "es", src_lang="fr")
    ]
    fr, fr_tags = nllb.batch(FR_SOURCES, "es", "fr")
    fr_sources = [[i for i in row if i != PAD_ID] for row in fr.tolist()]
    got_ids, want_ids = ([nllb.tok.encode(t, "tgt") for t in texts] for texts in (got, want))
    assert_agree([raymt_scorer(nllb.model, fr_tags[0].tolist())], fr_sources, got_ids, want_ids)


def bad(tmp_path, capsys, directory, *flags) -> str:
    """The one-line error of `raymt import` on `directory` (exit 2, nothing written)."""
    out = tmp_path / "out"
    assert hf_import.main([str(directory), "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("raymt import: error: ") and not out.exists()
    return err


def test_bad_directories(nllb, tmp_path, capsys):
    def variant(name: str):
        return shutil.copytree(nllb.dir, tmp_path / name / "nllb")

    assert "--src-lang xx: the model has no such language; it has de, en, es, fr" in bad(
        tmp_path, capsys, nllb.dir, "--src-lang", "xx"
    )
    assert "--tgt-lang xx: the model has no such language" in bad(tmp_path, capsys, nllb.dir, "--tgt-lang", "xx")
    missing = variant("missing")
    (missing / "sentencepiece.bpe.model").unlink()
    assert "has no sentencepiece.bpe.model" in bad(tmp_path, capsys, missing)
    short = save_nllb(tmp_path / "short", extra_rows=-3)  # the tokenizer's last ids have no rows
    capsys.readouterr()  # transformers' progress bars
    assert "the embedding must have one row for each id" in bad(tmp_path, capsys, short)
    sized = variant("sized")
    config = json.loads((sized / "config.json").read_text())
    (sized / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    assert "config.json's vocab_size is" in bad(tmp_path, capsys, sized)
    codeless = variant("codeless")
    tokenizer = json.loads((codeless / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if "_" not in t["content"]]
    (codeless / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert "name 0 language code(s)" in bad(tmp_path, capsys, codeless)
    by_code = hf_import.import_model(nllb.dir, tmp_path / "by-code", "fra_Latn", "spa_Latn")
    assert load_model_info(str(by_code)).config.data.pair() == ("fr", "es")


def test_a_pair_outside_the_built_in_corpus_loads(built, tmp_path, capsys):
    """en-zh names no built-in corpus: config.json loads (data.corpus names the imported directory)."""
    m2m = built("m2m100")
    checkpoint = tmp_path / "en-zh"
    assert hf_import.main([str(m2m.dir), "--output", str(checkpoint), "--tgt-lang", "__zh__"]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint == f'translate: raymt translate --checkpoint {checkpoint} --src-lang en --tgt-lang zh "..."'
    data = load_model_info(str(checkpoint)).config.data
    assert data.pair() == ("en", "zh") and data.corpus == str(m2m.dir.resolve())
    assert translate_cli.main(["--checkpoint", str(checkpoint), "--src-lang", "ja", "--tgt-lang", "zh", "x"]) == 0


# ---------------------------------------------------------------- fine-tuning (train --init)

# The tiny model's 64 positions; the built-in corpus, small.
FINE_TUNE = ["--set", "data.max_len=60", "--set", "data.builtin_train_size=200", "--set", "data.builtin_eval_size=8"]


def init_plan(checkpoint, tmp_path, pairs: str):
    """`raymt train --init CHECKPOINT --pairs PAIRS`'s config and RunData, planned (no Ray)."""
    from raymt import train
    from raymt.rundata import plan_data

    argv = ["--init", str(checkpoint), "--pairs", pairs, "--storage-path", str(tmp_path), "--name", pairs, *FINE_TUNE]
    cfg, _, start = train.resolve_resume(train.parse_args(argv))
    return plan_data(cfg, tmp_path / pairs, None, start)


def first_ids(corpus) -> dict[str, list[int]]:
    """Each training corpus's source ids of its first row."""
    import pyarrow.parquet as pq

    return {c.name: pq.read_table(c.shards[0].path).column("src_ids")[0].as_py() for c in corpus.training_corpora}


def test_init_puts_the_source_code_before_every_training_source(nllb, tmp_path):
    """A run from an imported NLLB prepares each source as translate --src-lang encodes it: the
    target's code (moved to the decoder), then the source's, at the model's ids; its validation
    rows too; its checkpoints' languages keep tag_side tgt and source_tags; one target language
    is tagged as well (the model reads a code on both sides)."""
    from raymt.rundata import materialize, pair_tags, plan_data

    cfg, run_data = init_plan(nllb.checkpoint, tmp_path, "en-de,en-fr,fr-de")
    corpus = materialize(run_data)
    assert corpus.tokenizer().model_proto == nllb.tok.model_proto
    for name, ids in first_ids(corpus).items():
        src, tgt = name.split("-")
        assert ids[:2] == nllb.info.prefix(tgt, src) == [nllb.tok.piece_to_id(nllb.code(x)) for x in (tgt, src)]
    tags = pair_tags(corpus, cfg.data.tag_side)
    imported = model_languages(nllb.checkpoint)
    assert tags.languages["pairs"] == [["en", "de"], ["en", "fr"], ["fr", "de"]] and tags.languages["tag_side"] == "tgt"
    assert tags.languages["source_tags"] == {lang: imported["source_tags"][lang] for lang in ("en", "fr")}
    assert tags.languages["reserved"] == {t: imported["reserved"][t] for t in ("<2de>", "<2fr>")}
    assert all(tags.prefixes[f"{s}-{t}"] == nllb.info.prefix(t, s) for s, t in (("en", "de"), ("fr", "de")))
    cfg, run_data = init_plan(nllb.checkpoint, tmp_path, "en-de")  # one pair: still both codes
    assert first_ids(materialize(run_data))["en-de"][:2] == nllb.info.prefix("de", "en")
    # Resumed (no --init): the codes are its prepared corpus's, the corpus is not prepared again.
    _, resumed = plan_data(cfg, tmp_path / "en-de", str(tmp_path / "en-de"), None)
    assert resumed.corpora is None and resumed.source_codes == {"en": nllb.info.prefix("de", "en")[1]}


def test_init_refuses_a_pair_without_a_code(built, tmp_path, capsys, monkeypatch):
    """M2M-100's wmt21 model has no French: a pair from or into it is one line, exit 2, before Ray."""
    from raymt import train

    m2m = built("m2m100")
    capsys.readouterr()  # transformers' progress bars
    monkeypatch.setattr(train, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    messages = {
        "en-de,fr-de": "reads the source's language code first in each source and has none for fr (it has cs, de, en",
        "en-de,en-fr": "its vocabulary does not reserve the tag(s) <2fr> that these corpora need",
    }
    for pairs, message in messages.items():
        argv = ["--init", str(m2m.checkpoint), "--pairs", pairs, "--storage-path", str(tmp_path), *FINE_TUNE]
        assert train.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("raymt.train: error: ") and message in err, err


@pytest.mark.slow
@pytest.mark.ci  # ~75 s: a 2-worker Ray Train run, then translations (CI runs it)
def test_init_fine_tunes_an_imported_nllb_on_two_pairs(nllb, tmp_path, ray_address, capsys):
    """`raymt train --init` an imported NLLB on en-de and en-fr with 2 workers: its validation and
    test sets scored per pair, its checkpoints' languages entry kept (decoder-side target tag, the
    source's code), and each direction translated from the fine-tuned checkpoint."""
    import subprocess
    import sys

    from raymt.compare import checkpoint_at

    command = [sys.executable, "-m", "raymt.train", "--init", str(nllb.checkpoint), "--pairs", "en-de,en-fr"]
    command += ["--storage-path", str(tmp_path), "--name", "ft", "--num-workers", "2", "--max-steps", "6"]
    command += [*FINE_TUNE, "--set", "train.eval_every=6", "--set", "decode.beam=2"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert sorted(summary["test"]) == ["en-de", "en-fr"]
    final = checkpoint_at(tmp_path / "ft", 6)
    languages, imported = model_languages(final), model_languages(nllb.checkpoint)
    assert languages["tag_side"] == "tgt" and languages["pairs"] == [["en", "de"], ["en", "fr"]]
    assert languages["source_tags"] == {"en": imported["source_tags"]["en"]}
    assert languages["reserved"] == {t: imported["reserved"][t] for t in ("<2de>", "<2fr>")}
    engine = load_engine(str(final), "raymt")
    assert engine.encode(SOURCES[:1], "fr", "en")[0][:2] == nllb.info.prefix("fr", "en")
    flags = ["--checkpoint", str(final), "--beam", "2", "--max-len-a", "0", "--max-len-b", "12", "--src-lang", "en"]
    opts = DecodeOptions(beam=2, max_len_a=0.0, max_len_b=12)  # translate's flags
    for tgt in ("de", "fr"):
        assert translate_cli.main([*flags, "--tgt-lang", tgt, *SOURCES[:2]]) == 0
        want = [hyps[0][1] for hyps in engine.translate(SOURCES[:2], opts, tgt, src_lang="en")]
        assert capsys.readouterr().out.splitlines() == want
    assert translate_cli.main([*flags, "--tgt-lang", "es", SOURCES[0]]) == 2  # not a pair it trained
    assert "was trained to translate into de, fr" in capsys.readouterr().err
