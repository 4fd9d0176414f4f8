"""`raymt.export --format ctranslate2`: CTranslate2 decodes the exported model as raymt does
(up to ties, which another host's rounding may break otherwise: tests/agreement.py).

The models are briefly trained on built-in en->de pairs (random weights emit EOS at once
or never), so outputs are real, mostly self-terminating pieces of varied length, and any
misplaced weight (K and V swapped, positions in another layout, a missing norm) changes them.
"""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from agreement import assert_agree, raymt_scorer
from tiny_checkpoint import make_checkpoint, one_thread, tokenizer  # noqa: F401 (autouse fixture)

from raymt import export, exporting
from raymt.checkpoint import save_checkpoint
from raymt.config import Config, DataConfig, tiny
from raymt.data.builtin import generate
from raymt.decoding import DecodeOptions, beam_search_nbest, encode_sources, greedy, pad_batch
from raymt.model import Transformer
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts

ctranslate2 = pytest.importorskip("ctranslate2")

# 250 pieces: the model's vocabulary is padded to 256, so the export needs filler tokens.
SPM_VOCAB = 250
# (pre_norm, activation, d_model, encoder layers; 2 decoder layers): both norms, and the erf GELU.
VARIANTS = {"pre-relu": (True, "relu", 32, 2), "post-relu": (False, "relu", 32, 2), "post-gelu": (False, "gelu", 16, 1)}
# a = 1.5 is exact in binary, so raymt's float32 limit and the one computed here agree.
GREEDY = DecodeOptions(beam=1, max_len_a=1.5, max_len_b=5)


def fit(pre_norm: bool, activation: str, d_model: int, layers: int) -> Transformer:
    """A tiny model after 80 Adam steps on en->de pairs: enough to end most sentences."""
    torch.manual_seed(0)
    tok = tokenizer(SPM_VOCAB)
    cfg = dataclasses.replace(
        tiny(),
        d_model=d_model,
        num_encoder_layers=layers,
        num_decoder_layers=2,
        pre_norm=pre_norm,
        activation=activation,
    )
    model = Transformer(cfg, tok.vocab_size)
    src, tgt = generate(400, "en", "de", seed=1)
    sources = [tok.encode(s) + [EOS_ID] for s in src]
    targets = [[BOS_ID] + tok.encode(t) + [EOS_ID] for t in tgt]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        idx = torch.randint(0, len(sources), (32,), generator=g).tolist()
        s, t = pad_batch([sources[i] for i in idx]), pad_batch([targets[i] for i in idx])
        logits = model(s, t[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    """(model, CTranslate2 translator, vocabulary, encoded test sources) of a trained variant."""
    model = fit(*VARIANTS[request.param])
    tok = tokenizer(SPM_VOCAB)
    root = tmp_path_factory.mktemp(request.param)
    config = Config(model=model.cfg, data=DataConfig(vocab_size=256))
    out = exporting.export_model(save_checkpoint(root / "checkpoint", model, config, tok), root / "ct2", "ctranslate2")
    vocab = json.loads((out / "shared_vocabulary.json").read_text())
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32", intra_threads=1)
    sources = encode_sources(tok, generate(8, "en", "de", seed=7)[0], model.cfg.max_positions)
    return model, translator, vocab, sources


def pieces(vocab: list[str], ids: list[int]) -> list[str]:
    """Token strings of ids; sources go without their EOS (the exported config adds it)."""
    return [vocab[i] for i in ids if i != EOS_ID]


def test_vocabulary_is_spm_pieces_then_fillers(exported):
    _, _, vocab, _ = exported
    sp = tokenizer(SPM_VOCAB).sp
    assert sp.get_piece_size() == SPM_VOCAB and len(vocab) == 256 == len(set(vocab))
    assert vocab[:SPM_VOCAB] == [sp.id_to_piece(i) for i in range(SPM_VOCAB)]
    assert vocab[:4] == ["<pad>", "<unk>", "<s>", "</s>"]


def test_greedy_output_is_raymt_greedy_output(exported):
    model, translator, vocab, sources = exported
    expected = greedy(model, pad_batch(sources), GREEDY)
    got = []
    for src in sources:  # one call per sentence: each gets raymt's own length limit
        limit = int(GREEDY.max_len_a * len(src) + GREEDY.max_len_b)  # EOS included
        result = translator.translate_batch(
            [pieces(vocab, src)], beam_size=1, max_decoding_length=limit - 1, min_decoding_length=0
        )
        got.append([vocab.index(p) for p in result[0].hypotheses[0]])
    assert_agree([raymt_scorer(model)], sources, got, expected)  # equal but for ties (tests/agreement.py)
    # Real outputs: most sentences end by themselves, with several tokens each.
    ended = [len(ids) + 1 < GREEDY.max_len_a * len(src) + GREEDY.max_len_b for ids, src in zip(expected, sources)]
    assert sum(ended) >= len(sources) // 2 and sum(map(len, expected)) >= 5 * len(sources)


def test_token_log_probs_match(exported):
    """CTranslate2's per-token scores of raymt's outputs are raymt's log-probabilities."""
    model, translator, vocab, sources = exported
    outputs = greedy(model, pad_batch(sources), GREEDY)
    scored = translator.score_batch([pieces(vocab, s) for s in sources], [pieces(vocab, o) for o in outputs])
    tgt = pad_batch([[BOS_ID] + o + [EOS_ID] for o in outputs])
    with torch.no_grad():
        logits = model(pad_batch(sources), tgt[:, :-1])  # (B, T, V)
    log_probs = logits.log_softmax(-1).gather(2, tgt[:, 1:, None]).squeeze(2)  # (B, T)
    for row, (out, result) in enumerate(zip(outputs, scored)):
        assert len(result.log_probs) == len(out) + 1  # the tokens and EOS
        assert torch.allclose(torch.tensor(result.log_probs), log_probs[row, : len(out) + 1], atol=1e-4)


def test_beam_output_is_raymt_beam_output(exported):
    """5-best lists agree; CTranslate2's length penalty (len ** a) is not GNMT's, so both use 0."""
    model, translator, vocab, sources = exported
    opts = DecodeOptions(beam=5, length_penalty=0.0, max_len_a=1.5, max_len_b=20)
    expected = beam_search_nbest(model, pad_batch(sources), opts, n_best=5)
    compared = 0
    for src, hyps in zip(sources, expected):
        limit = int(opts.max_len_a * len(src) + opts.max_len_b)
        if any(len(ids) + 1 >= limit for _, ids in hyps):
            continue  # at the limit raymt forces EOS while CTranslate2 truncates
        result = translator.translate_batch(
            [pieces(vocab, src)],
            beam_size=5,
            num_hypotheses=5,
            length_penalty=0.0,
            max_decoding_length=limit - 1,
            min_decoding_length=0,
            return_scores=True,
        )[0]
        if [[vocab.index(p) for p in h] for h in result.hypotheses] == [ids for _, ids in hyps]:
            assert result.scores == pytest.approx([s for s, _ in hyps], abs=1e-3)
        else:  # hypotheses within 1e-3 of each other (a tie) may swap places or cross the cut
            assert sorted(result.scores) == pytest.approx(sorted(s for s, _ in hyps), abs=1e-3)
        compared += 1
    assert compared >= len(sources) // 2


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ct2-cli") / "checkpoint", seed=3)


def test_cli_writes_a_ctranslate2_directory(random_checkpoint, tmp_path, err_lines):
    out = tmp_path / "ct2"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "raymt.export",
            "--checkpoint",
            str(random_checkpoint),
            "--output",
            str(out),
            "--format",
            "ctranslate2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "ctranslate2.Translator" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.bin",
        "raymt_config.json",
        "shared_vocabulary.json",
        "spm.model",
    ]
    assert json.loads((out / "raymt_config.json").read_text())["vocab_size"] == 256
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    assert len(translator.translate_batch([["▁Germany"]], beam_size=1, max_decoding_length=3)) == 1
    # A second export into the now non-empty directory: one line, nothing overwritten.
    before = (out / "model.bin").read_bytes()
    assert export.main(["--checkpoint", str(random_checkpoint), "--output", str(out), "--format", "ctranslate2"]) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.export: error: ") and "not empty" in err[0]
    assert (out / "model.bin").read_bytes() == before


def test_half_precision_ctranslate2_export(random_checkpoint, tmp_path):
    full = exporting.export_model(random_checkpoint, tmp_path / "full", "ctranslate2")
    half = exporting.export_model(random_checkpoint, tmp_path / "half", "ctranslate2", "float16")
    assert (half / "model.bin").stat().st_size < 0.6 * (full / "model.bin").stat().st_size
    translator = ctranslate2.Translator(str(half), device="cpu", compute_type="float32", intra_threads=1)
    assert len(translator.translate_batch([["▁Germany"]], beam_size=1, max_decoding_length=3)) == 1


def test_missing_ctranslate2_is_one_line_error(random_checkpoint, tmp_path, monkeypatch, err_lines):
    monkeypatch.setitem(sys.modules, "ctranslate2.specs", None)  # makes the import fail
    out = tmp_path / "ct2"
    assert export.main(["--checkpoint", str(random_checkpoint), "--output", str(out), "--format", "ctranslate2"]) == 2
    assert err_lines() == [
        "raymt.export: error: --format ctranslate2 needs the ctranslate2 package: pip install ctranslate2"
    ]
    assert not out.exists()
