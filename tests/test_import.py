"""`raymt import`: a Hugging Face OPUS-MT (Marian) directory becomes a raymt checkpoint that
computes what transformers computes (logits, token ids, greedy and beam search), and round trips."""

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from agreement import assert_agree, raymt_scorer  # noqa: E402
from hf_models import save_opus_mt  # noqa: E402
from tiny_checkpoint import one_thread, tokenizer  # noqa: E402, F401 (autouse fixture)

from raymt import export, hf_import  # noqa: E402
from raymt.checkpoint import load_model, load_weights, save_checkpoint  # noqa: E402
from raymt.config import Config, DataConfig, DecodeOptions, ModelConfig  # noqa: E402
from raymt.data.builtin import generate  # noqa: E402
from raymt.decoding import _max_lengths, decode, encode_sources, pad_batch  # noqa: E402
from raymt.model import Transformer  # noqa: E402
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402

pytestmark = pytest.mark.hosts  # decoded outputs across engines: ./run.sh test --hosts

SOURCES, TARGETS = generate(12, "en", "de", seed=5)


class Imported:
    """An OPUS-MT-style directory (`separate`: separate vocabularies), its import, and the id
    maps between them on each side."""

    def __init__(self, tmp_path, **kwargs):
        self.dir = save_opus_mt(tmp_path / "opus-mt-en-de", **kwargs)
        self.checkpoint = hf_import.import_model(self.dir, tmp_path / "imported")
        self.model, self.tok, self.config = load_model(self.checkpoint)
        self.hf = transformers.MarianMTModel.from_pretrained(str(self.dir)).eval()
        self.hf_tok = transformers.MarianTokenizer.from_pretrained(str(self.dir))
        vocab = json.loads((self.dir / "vocab.json").read_text())
        separate = self.dir / "target_vocab.json"
        target_vocab = json.loads(separate.read_text()) if separate.is_file() else vocab
        pad = self.hf.config.pad_token_id
        self.to_hf = [vocab.get(p, pad) for p in self.tok.pieces_of("src")]  # raymt id -> HF id
        self.to_hf_tgt = [target_vocab.get(p, pad) for p in self.tok.pieces_of("tgt")]  # the target's
        self.present = [r for r, p in enumerate(self.tok.pieces_of("tgt")) if p in target_vocab]  # output rows
        self.to_raymt = {self.to_hf_tgt[r]: r for r in self.present}

    def hf_ids(self, rows: torch.Tensor, side: str = "src") -> torch.Tensor:
        """(B, T) raymt ids -> HF ids of `side` ("tgt": the decoder's)."""
        to_hf = self.to_hf_tgt if side == "tgt" else self.to_hf
        return torch.tensor([[to_hf[i] for i in row] for row in rows.tolist()])

    def hf_search(self, src: torch.Tensor, limits: torch.Tensor, beam: int) -> list[list[int]]:
        """HF `generate` with raymt's limits, its pad suppressed (bad_words_ids), in raymt ids."""
        everything = list(range(self.hf.config.decoder_vocab_size))
        eos = [self.hf.config.eos_token_id]
        allowed = lambda i, ids: eos if ids.numel() >= int(limits[i]) else everything  # noqa: E731
        out = self.hf.generate(
            input_ids=self.hf_ids(src),
            attention_mask=src != PAD_ID,
            num_beams=beam,
            do_sample=False,
            max_new_tokens=int(limits.max()),
            max_length=None,
            early_stopping=True,
            length_penalty=0.0,
            prefix_allowed_tokens_fn=allowed,
        )
        rows = [[self.to_raymt[i] for i in row[1:]] for row in out.tolist()]
        return [row[: row.index(EOS_ID)] if EOS_ID in row else row for row in rows]


@pytest.fixture(scope="module", params=["shared", "separate"])
def opus(request, tmp_path_factory):
    """One vocabulary (vocab.json), or separate ones of different sizes (target_vocab.json)."""
    return Imported(tmp_path_factory.mktemp("opus"), separate=request.param == "separate")


def test_token_ids_equal_marian_tokenizers(opus):
    ours = encode_sources(opus.tok, SOURCES, 64)
    assert [[opus.to_hf[i] for i in row] for row in ours] == opus.hf_tok(SOURCES).input_ids
    targets = opus.hf_tok(text_target=TARGETS).input_ids
    assert [[opus.to_hf_tgt[i] for i in opus.tok.encode(t, "tgt")] + [0] for t in TARGETS] == targets
    assert [opus.tok.decode(opus.tok.encode(t, "tgt")) for t in TARGETS] == TARGETS


@pytest.mark.parametrize("opus", ["shared"], indirect=True)
def test_pieces_outside_target_spm_decode_as_marian_tokenizer(opus):
    """OPUS-MT's joint vocab.json holds the source's pieces too, pieces target.spm lacks; a model
    may emit them (printed raw before: "▁car▁car▁car"): decoded as MarianTokenizer decodes the
    same ids, with the target's own pieces, an ending "▁" and EOS among them."""
    pieces = opus.tok.pieces_of("tgt")
    rows = [r for r in opus.present if r > EOS_ID]  # every piece the model can emit but the specials
    outside = [r for r in rows if opus.tok.target.piece_to_id(pieces[r]) == opus.tok.target.unk_id()]
    assert len([r for r in outside if pieces[r].startswith("\u2581")]) > 10
    rng = random.Random(0)
    ids = [[r, r, r] for r in outside] + [rng.choices(rows, k=rng.randint(1, 8)) for _ in range(300)]
    word = next(r for r in rows if r not in outside and pieces[r].startswith("\u2581") and len(pieces[r]) > 1)
    ids.append([word, opus.tok.piece_to_id("\u2581", "tgt")])  # "▁" last: a space MarianTokenizer strips
    theirs = [opus.hf_tok.decode([opus.to_hf_tgt[i] for i in [*row, EOS_ID]], skip_special_tokens=True) for row in ids]
    assert [opus.tok.decode([*row, EOS_ID]) for row in ids] == theirs
    assert "\u2581" not in "".join(theirs)


@pytest.mark.parametrize("tie", [True, False])
def test_logits_equal_hf(tie, opus, tmp_path):
    separate = not opus.tok.shared
    case = opus if tie else Imported(tmp_path, tie=False, separate=separate)
    assert case.config.model.tie_output is tie and case.config.model.activation == "swish"
    assert (case.config.model.target_vocab_size is not None) is separate  # the decoder's own embedding
    src = pad_batch(encode_sources(case.tok, SOURCES, 64))
    tgt = pad_batch([[BOS_ID, *case.tok.encode(t, "tgt")] for t in TARGETS])
    with torch.no_grad():
        ours = case.model(src, tgt)
        hf_tgt = case.hf_ids(tgt, "tgt")
        theirs = case.hf(input_ids=case.hf_ids(src), attention_mask=src != PAD_ID, decoder_input_ids=hf_tgt)
    real = tgt != PAD_ID
    hf_rows = [case.to_hf_tgt[r] for r in case.present]
    torch.testing.assert_close(ours[:, :, case.present][real], theirs.logits[:, :, hf_rows][real], atol=1e-4, rtol=0)
    # Rows the HF model lacks (raymt's PAD, padding to 8) take no probability.
    absent = [r for r in range(case.tok.target_vocab_size) if r not in case.present]
    assert absent and ours.log_softmax(-1)[:, :, absent].max() < -50


@pytest.mark.parametrize("beam", [1, 4])
def test_search_equals_hf_generate(beam, opus):
    sources = encode_sources(opus.tok, SOURCES, 64)
    opts = DecodeOptions(beam=beam, length_penalty=0.0, max_len_a=1.2, max_len_b=6)
    src = pad_batch(sources)
    ours = decode(opus.model, src, opts)
    theirs = opus.hf_search(src, _max_lengths(opus.model, src, opts), beam)
    assert_agree([raymt_scorer(opus.model)], sources, theirs, ours)


def test_translate_command(opus, capsys):
    from raymt import translate

    assert translate.main(["--checkpoint", str(opus.checkpoint), "--beam", "1", SOURCES[0]]) == 0
    ours = capsys.readouterr().out.strip()
    src = pad_batch(encode_sources(opus.tok, SOURCES[:1], 64))
    out = opus.hf.generate(input_ids=opus.hf_ids(src), num_beams=1, do_sample=False, max_length=64)
    theirs = opus.hf_tok.decode(out[0], skip_special_tokens=True)
    assert ours and theirs.startswith(ours)  # raymt's length limit may stop it earlier


def post_norm_model(seed: int = 0) -> Transformer:
    """A random tiny post-norm raymt model (what `export --format marian` takes)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=2, pre_norm=False)
    return Transformer(cfg, tokenizer().vocab_size).eval()


def test_raymt_marian_raymt_is_identity(tmp_path):
    model = post_norm_model()
    config = Config(model=model.cfg, data=DataConfig(vocab_size=256))
    checkpoint = save_checkpoint(tmp_path / "ours", model, config, tokenizer())
    assert export.main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "hf"), "--format", "marian"]) == 0
    back = hf_import.import_model(tmp_path / "hf", tmp_path / "back")
    before, after = load_weights(checkpoint), load_weights(back)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (back / "spm.model").read_bytes() == (checkpoint / "spm.model").read_bytes()
    assert load_model(back)[2].model == model.cfg


@pytest.mark.parametrize("tie", [True, False])
def test_imported_marian_raymt_marian(tie, opus, tmp_path):
    """An imported OPUS-MT model (tied or untied output) exports to HF Marian again (separate
    vocabularies: target_vocab.json): the same logits, MarianTokenizer's ids on both sides, and
    back the same weights and vocabularies."""
    case = opus if tie else Imported(tmp_path, tie=False, separate=not opus.tok.shared)
    out = tmp_path / "again"
    assert export.main(["--checkpoint", str(case.checkpoint), "--output", str(out), "--format", "marian"]) == 0
    assert (out / "target_vocab.json").is_file() is not case.tok.shared
    again = hf_import.import_model(out, tmp_path / "again-imported")
    before, after = load_weights(case.checkpoint), load_weights(again)
    assert all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
    model, tok, config = load_model(again)
    assert config.model == case.config.model
    assert all(tok.pieces_of(side) == case.tok.pieces_of(side) for side in ("src", "tgt"))
    hf_tok = transformers.MarianTokenizer.from_pretrained(str(out))
    assert hf_tok(SOURCES).input_ids == encode_sources(case.tok, SOURCES, 64)
    assert hf_tok(text_target=TARGETS).input_ids == [[*case.tok.encode(t, "tgt"), EOS_ID] for t in TARGETS]
    marian = transformers.MarianMTModel.from_pretrained(str(out)).eval()
    src = pad_batch(encode_sources(case.tok, SOURCES, 64))
    tgt = pad_batch([[BOS_ID, *case.tok.encode(t, "tgt")] for t in TARGETS])
    with torch.no_grad():
        theirs = marian(input_ids=src, attention_mask=src != PAD_ID, decoder_input_ids=tgt).logits
        torch.testing.assert_close(theirs, case.model(src, tgt), atol=1e-4, rtol=0)


def test_imported_model_exports_to_ctranslate2(opus, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    assert export.main(["--checkpoint", str(opus.checkpoint), "--output", str(out), "--format", "ctranslate2"]) == 0
    assert (out / "target_vocabulary.json").is_file() is not opus.tok.shared  # else shared_vocabulary.json
    translator = ctranslate2.Translator(str(out), device="cpu")
    sources = encode_sources(opus.tok, SOURCES, 64)
    pieces = [[opus.tok.id_to_piece(i) for i in s[:-1]] for s in sources]
    results = translator.translate_batch(pieces, beam_size=1, max_decoding_length=12)
    theirs = [[opus.tok.piece_to_id(p, "tgt") for p in r.hypotheses[0]] for r in results]
    opts = DecodeOptions(beam=1, length_penalty=0.0, max_len_a=0.0, max_len_b=13)
    ours = decode(opus.model, pad_batch(sources), opts)
    assert_agree([raymt_scorer(opus.model)], sources, theirs, ours)


def test_multi_target_codes_are_source_tags(tmp_path, capsys):
    """OPUS-MT's >>fr<< codes become raymt's source-side tags: --tgt-lang fr puts it first, as
    MarianTokenizer does for ">>fr<< text"."""
    from raymt import translate
    from raymt.checkpoint import model_languages
    from raymt.engines import load_model_info

    directory = save_opus_mt(tmp_path / "opus-mt-en-ROMANCE", codes=("fr", "es"), langs=("en", "fr"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": False}))
    checkpoint = hf_import.import_model(directory, tmp_path / "imported")
    languages = model_languages(checkpoint)
    assert languages["pairs"] == [["en", "fr"], ["en", "es"]] and languages.get("tag_side", "src") == "src"
    info = load_model_info(str(checkpoint))
    hf_tok = transformers.MarianTokenizer.from_pretrained(str(directory))
    vocab = json.loads((directory / "vocab.json").read_text())
    for lang in ("fr", "es"):
        ours = [info.tokenizer.id_to_piece(i) for i in info.encode([SOURCES[0]], lang)[0]]
        assert [vocab[p] for p in ours] == hf_tok([f">>{lang}<< {SOURCES[0]}"]).input_ids[0]
    assert translate.main(["--checkpoint", str(checkpoint), "--tgt-lang", "es", SOURCES[0]]) == 0
    assert capsys.readouterr().out.strip()


def bad(tmp_path, capsys, directory, *flags) -> str:
    """The one-line error of `raymt import` on `directory` (exit 2, nothing written)."""
    out = tmp_path / "out"
    assert hf_import.main([str(directory), "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("raymt import: error: ") and not out.exists()
    return err


def test_bad_directories(tmp_path, capsys):
    good = save_opus_mt(tmp_path / "opus-mt-en-de")

    def variant(name: str):
        import shutil

        copy = tmp_path / name / "opus-mt-en-de"
        shutil.copytree(good, copy)
        return copy

    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}))
    assert "holds a t5 model (T5ForConditionalGeneration)" in bad(tmp_path, capsys, t5)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert "holds a bert model" in bad(tmp_path, capsys, bert)
    assert "is not a directory" in bad(tmp_path, capsys, tmp_path / "nothing")
    missing = variant("missing")
    (missing / "target.spm").unlink()
    assert "has no target.spm" in bad(tmp_path, capsys, missing)
    corrupt = variant("corrupt")
    (corrupt / "source.spm").write_bytes(b"not a model")
    assert "not a SentencePiece model" in bad(tmp_path, capsys, corrupt)
    short = variant("short")
    vocab = json.loads((short / "vocab.json").read_text())
    (short / "vocab.json").write_text(json.dumps(dict(list(vocab.items())[:-3])))
    assert "must be equal" in bad(tmp_path, capsys, short)
    shape = variant("shape")
    config = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**config, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48}))
    assert "do not fit config.json's shape" in bad(tmp_path, capsys, shape)
    unnamed = variant("unnamed").rename(tmp_path / "model")
    (unnamed / "tokenizer_config.json").write_text("{}")
    assert "pass --src-lang and --tgt-lang" in bad(tmp_path, capsys, unnamed)
    assert hf_import.main([str(unnamed), "--output", str(tmp_path / "ok"), "--src-lang", "en", "--tgt-lang", "de"]) == 0
    weights = variant("weights")
    (weights / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "corrupt or truncated safetensors" in bad(tmp_path, capsys, weights)


def shard(directory, parts: int = 3) -> list[str]:
    """Split `directory`'s model.safetensors into `parts` shards and model.safetensors.index.json,
    as save_pretrained writes a large model; the shards' names."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    names = [f"model-{k + 1:05d}-of-{parts:05d}.safetensors" for k in range(parts)]
    weight_map = {key: names[k % parts] for k, key in enumerate(sorted(state))}
    for name in names:
        save_file({key: t for key, t in state.items() if weight_map[key] == name}, str(directory / name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "model.safetensors").unlink()
    return names


def weights_variant(tmp_path, name: str, sharded: bool = False):
    """A copy of a tiny OPUS-MT directory (one per test, `tmp_path` / "good"), its weights sharded
    (`shard`) or not."""
    import shutil

    good = tmp_path / "good" / "opus-mt-en-de"
    if not good.is_dir():
        save_opus_mt(good)
    copy = shutil.copytree(good, tmp_path / name / "opus-mt-en-de")
    return copy, shard(copy) if sharded else []


def test_sharded_safetensors_and_pytorch_model_bin_import(tmp_path):
    """Shards (model.safetensors.index.json) and a weights-only pytorch_model.bin import as
    model.safetensors does."""
    from raymt import hf_model

    want = load_weights(hf_import.import_model(weights_variant(tmp_path, "one")[0], tmp_path / "want"))
    sharded, _ = weights_variant(tmp_path, "sharded", sharded=True)
    bin_file, _ = weights_variant(tmp_path, "bin")
    torch.save(hf_model.read_weights(bin_file), bin_file / "pytorch_model.bin")
    (bin_file / "model.safetensors").unlink()
    for directory in (sharded, bin_file):
        got = load_weights(hf_import.import_model(directory, tmp_path / f"{directory.parent.name}-out"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture
def shards_read(monkeypatch):
    """The shards `raymt import` reads (none are: every test that uses this expects an error first)."""
    from raymt import hf_model

    read = []
    monkeypatch.setattr(hf_model, "read_safetensors", lambda path: read.append(path) or {})
    return read


def test_a_shard_outside_the_directory_is_refused(tmp_path, capsys, shards_read):
    """An index naming ../model-00001-of-00003.safetensors (or an absolute path): one line naming
    the index and the shard, exit 2, no shard read, nothing written."""
    outside, names = weights_variant(tmp_path, "outside", sharded=True)
    (outside / names[0]).rename(outside.parent / names[0])  # beside the model directory, not in it
    index_file = outside / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for escaped in (f"../{names[0]}", str(outside.parent / names[0])):
        weight_map = {key: escaped if name == names[0] else name for key, name in index["weight_map"].items()}
        index_file.write_text(json.dumps({**index, "weight_map": weight_map}))
        err = bad(tmp_path, capsys, outside)
        assert f"{index_file}: weight_map names the shard '{escaped}', which is not a file of {outside}" in err
        assert "refusing to read it: the index must name the model's own shards" in err
    assert shards_read == []


def test_a_missing_shard_is_one_line(tmp_path, capsys, shards_read):
    """A shard the index names that is not there: one line naming it, exit 2, no shard read."""
    missing, names = weights_variant(tmp_path, "missing", sharded=True)
    (missing / names[1]).unlink()
    err = bad(tmp_path, capsys, missing)
    assert f"{missing} has no {names[1]} (a shard model.safetensors.index.json names); copy the model's whole" in err
    assert shards_read == []


def test_a_pickle_that_runs_code_is_refused(tmp_path, capsys):
    """A pytorch_model.bin whose unpickling would run code (weights_only): one line naming the file
    and what it would run, exit 2, the code not run, nothing written."""
    from test_export import plant_malicious_pickle

    malicious, _ = weights_variant(tmp_path, "malicious")
    (malicious / "model.safetensors").unlink()
    marker = plant_malicious_pickle(malicious / "pytorch_model.bin", tmp_path)
    err = bad(tmp_path, capsys, malicious)
    assert f"refusing to load {malicious / 'pytorch_model.bin'}: it would run posix.system while unpickling" in err
    assert "corrupt or malicious" in err and not marker.exists()


def test_bad_separate_vocabularies(tmp_path, capsys):
    """A separate-vocabulary directory whose target_vocab.json, config.json or embeddings disagree:
    one line, exit 2, before anything is written."""
    import shutil

    good = save_opus_mt(tmp_path / "good" / "opus-mt-en-de", separate=True)

    def variant(name: str):
        return shutil.copytree(good, tmp_path / name / "opus-mt-en-de")

    short = variant("short")
    target_vocab = json.loads((short / "target_vocab.json").read_text())
    (short / "target_vocab.json").write_text(json.dumps(dict(list(target_vocab.items())[:-3])))
    err = bad(tmp_path, capsys, short)
    assert "decoder embedding has 300 rows" in err and "target_vocab.json has 297 pieces" in err
    assert "must be equal" in err
    missing = variant("missing")
    (missing / "target_vocab.json").unlink()
    assert "has no target_vocab.json" in bad(tmp_path, capsys, missing)
    shares = variant("shares")
    config = json.loads((shares / "config.json").read_text())
    (shares / "config.json").write_text(json.dumps({**config, "share_encoder_decoder_embeddings": True}))
    assert "different embeddings (model.decoder.embed_tokens.weight differs)" in bad(tmp_path, capsys, shares)
    one = save_opus_mt(tmp_path / "one" / "opus-mt-en-de")  # one vocabulary and embedding
    shutil.copy(good / "target_vocab.json", one / "target_vocab.json")
    shutil.copy(good / "tokenizer_config.json", one / "tokenizer_config.json")  # separate_vocabs: true
    assert "separate source and target vocabularies (separate_vocabs) but one embedding" in bad(tmp_path, capsys, one)
    start = variant("start")
    (start / "config.json").write_text(json.dumps({**config, "decoder_start_token_id": 300}))
    assert "decoder_start_token_id 300 is not a target id (0..299)" in bad(tmp_path, capsys, start)


def test_average_of_separate_vocabulary_models(tmp_path):
    """`raymt average` of two imports of separate vocabularies: the mean of each tensor, the
    target's embedding included, as a checkpoint that loads."""
    from raymt import average

    imported = []
    for seed in (0, 1):
        directory = save_opus_mt(tmp_path / f"s{seed}" / "opus-mt-en-de", separate=True, seed=seed)
        imported.append(hf_import.import_model(directory, tmp_path / f"imported{seed}"))
    out = tmp_path / "avg"
    assert average.main(["--checkpoints", *map(str, imported), "--output", str(out)]) == 0
    a, b = (load_weights(c) for c in imported)
    model, tok, config = load_model(out)
    assert not tok.shared and config.model.target_vocab_size == tok.target_vocab_size == 304
    torch.testing.assert_close(model.target_embed.weight, (a["target_embed.weight"] + b["target_embed.weight"]) / 2)


def test_a_pair_outside_the_builtin_languages(tmp_path, capsys):
    """Imported pairs are any languages (en-ro), not the built-in corpus's: the checkpoint loads."""
    from raymt import translate

    directory = save_opus_mt(tmp_path / "opus-mt-en-ro")
    (directory / "tokenizer_config.json").write_text("{}")  # the pair from the directory's name
    checkpoint = hf_import.import_model(directory, tmp_path / "imported")
    assert load_model(checkpoint)[2].data.pairs() == [("en", "ro")]
    assert translate.main(["--checkpoint", str(checkpoint), "--tgt-lang", "ro", SOURCES[0]]) == 0
    assert capsys.readouterr().out.strip()


INIT_STEPS = 40


@pytest.mark.slow
@pytest.mark.ci  # ~2.5 min: two 2-worker Ray Train runs, one killed twice and resumed (CI runs it)
@pytest.mark.timeout(900)
def test_init_trains_an_imported_model_and_resumes_exactly(tmp_path, ray_address):
    """`raymt train --init` an imported OPUS-MT model, 40 steps on 2 workers (conftest's tiny_run
    without its model): the built-in corpus tokenized by its two SentencePiece models and vocab.json
    (no new vocabulary), its fixed output bias kept, its weights trained, its tokenizer in every
    checkpoint. The same run with a worker, then the driver, SIGKILLed (test_faults' helpers) and
    `--resume`d ends with the uninterrupted run's weights, each pair trained at the same step."""
    import subprocess
    import sys

    from conftest import tiny_run
    from test_faults import assert_same_as_reference, final_weights, group_starts, kill_worker_then_driver

    from raymt.compare import checkpoint_at, trained_pairs
    from raymt.rundir import fixed_changes

    imported = hf_import.import_model(save_opus_mt(tmp_path / "opus-mt-en-de"), tmp_path / "imported")
    flags = ["--init", str(imported), "--set", "data.max_len=60", "--set", "train.eval_every=10"]
    flags += ["--set", "train.max_failures=1"]  # the killed run's worker group restarts once

    def command(name: str) -> list[str]:
        return tiny_run(tmp_path, name, INIT_STEPS, *flags, model=())  # the imported model's shape and vocabulary

    out = subprocess.run(command("ref"), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    final = checkpoint_at(tmp_path / "ref", INIT_STEPS)
    before, after = load_weights(imported), load_weights(final)
    assert torch.equal(before["output_bias"], after["output_bias"])  # a buffer: not trained
    assert not torch.equal(before["embed.weight"], after["embed.weight"])
    assert (final / "spm.model").read_bytes() == (imported / "spm.model").read_bytes()
    assert not fixed_changes(load_model(imported)[2], load_model(final)[2])  # its shape (dropout 0.1 here)

    run_dir = tmp_path / "killed"
    restart, latest = kill_worker_then_driver(command("killed"), run_dir, ray_address, INIT_STEPS)
    resume = [sys.executable, "-m", "raymt.train", "--resume", str(run_dir)]
    out = subprocess.run(resume, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert group_starts(run_dir) == [0, restart, latest]
    reference = final_weights(tmp_path / "ref", INIT_STEPS), trained_pairs(tmp_path / "ref")
    assert_same_as_reference(run_dir, reference, INIT_STEPS)


@pytest.mark.slow
@pytest.mark.ci  # ~45 s: a 2-worker Ray Train run (CI runs it)
def test_init_trains_an_imported_separate_vocabulary_model(tmp_path, ray_address):
    """`raymt train --init` an imported OPUS-MT model with separate vocabularies on 2 workers: the
    corpus's targets tokenized by target.spm over target_vocab.json, both embeddings trained, the
    output bias kept, the two-vocabulary tokenizer in every checkpoint."""
    import subprocess
    import sys

    from raymt.compare import checkpoint_at

    directory = save_opus_mt(tmp_path / "opus-mt-en-de", separate=True)
    imported = hf_import.import_model(directory, tmp_path / "imported")
    command = [sys.executable, "-m", "raymt.train", "--init", str(imported), "--storage-path", str(tmp_path)]
    command += ["--name", "ft", "--num-workers", "2", "--max-steps", "6", "--set", "train.eval_every=6"]
    command += ["--set", "data.builtin_train_size=400", "--set", "data.builtin_eval_size=8", "--set", "data.max_len=60"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    final = checkpoint_at(tmp_path / "ft", 6)
    before, after = load_weights(imported), load_weights(final)
    assert torch.equal(before["output_bias"], after["output_bias"])  # a buffer: not trained
    for name in ("embed.weight", "target_embed.weight"):
        assert not torch.equal(before[name], after[name])
    assert (final / "spm.model").read_bytes() == (imported / "spm.model").read_bytes()


def test_the_config_renders_its_command():
    from raymt.command import command_line, parse, to_argv

    cfg = hf_import.ImportConfig(directory="models/opus-mt-en-de", output="ckpt", src_lang="en", tgt_lang="de")
    assert parse(hf_import.ImportConfig, to_argv(cfg), "raymt import") == cfg
    assert command_line("import", cfg) == (
        "raymt import --output ckpt --src-lang en --tgt-lang de models/opus-mt-en-de"
    )
