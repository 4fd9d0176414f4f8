"""Ensembles (issue 58): one search over the mean of several models' log-probabilities; an
ensemble of one decodes as its model; translate, evaluate and backtranslate take --checkpoint
repeated, and refuse models that do not share a tokenizer in one line."""

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
import torch
from agreement import assert_texts_agree
from tiny_checkpoint import make_checkpoint, one_thread, write_pairs  # noqa: F401 (autouse fixture)

from raymt import backtranslate, bt_job, engines, evaluate, shard_job, translate
from raymt.checkpoint import languages_entry, load_model, save_checkpoint
from raymt.config import Config, DataConfig, DecodeOptions, tiny
from raymt.data.builtin import generate
from raymt.decoding import decode_nbest, gnmt_penalty, token_log_probs, translate_nbest
from raymt.ensemble import Ensemble
from raymt.model import Transformer
from raymt.tokenizer import PAD_ID, Tokenizer

pytestmark = pytest.mark.timeout(300)
GREEDY = DecodeOptions(beam=1, max_len_a=1.0, max_len_b=4)
BEAM = DecodeOptions(beam=4, max_len_a=1.0, max_len_b=4, length_penalty=1.0)
FLAGS = ["--beam", "3", "--max-len-a", "1.0", "--max-len-b", "5", "--batch-size", "8"]
OPTS = DecodeOptions(beam=3, max_len_a=1.0, max_len_b=5)


@pytest.fixture(scope="module")
def models() -> tuple[Transformer, Transformer]:
    """Two random models over one vocabulary, of other widths, depths and positions."""
    torch.manual_seed(0)
    a = Transformer(tiny(), vocab_size=64).eval()
    torch.manual_seed(1)
    b = Transformer(dataclasses.replace(tiny(), d_model=48, num_decoder_layers=3, max_positions=512), 64).eval()
    return a, b


@pytest.fixture(scope="module")
def src() -> torch.Tensor:
    """(5, 7) source ids ending in EOS, two rows padded."""
    rows = torch.randint(4, 64, (5, 7), generator=torch.Generator().manual_seed(3))
    rows[:, -1] = 3
    rows[1, 4:], rows[3, 6:] = PAD_ID, PAD_ID
    rows[1, 3] = 3
    return rows


@pytest.mark.parametrize(
    "opts, n_best, prefixed",
    [
        (GREEDY, 1, False),
        (DecodeOptions(beam=1, sample=True, seed=5, top_k=8, max_len_a=1.0, max_len_b=4), 1, False),
        (BEAM, 3, False),
        (dataclasses.replace(BEAM, use_cache=False), 2, False),
        (BEAM, 2, True),  # a forced decoder prefix (a decoder-side tag)
    ],
)
def test_an_ensemble_of_one_decodes_as_its_model(models, src, opts, n_best, prefixed):
    prefix = torch.full((src.size(0), 1), 9) if prefixed else None
    alone = decode_nbest(models[0], src, opts, n_best, prefix)
    assert decode_nbest(Ensemble([models[0]]), src, opts, n_best, prefix) == alone  # same ids, same scores


@pytest.mark.parametrize("opts", [GREEDY, BEAM, dataclasses.replace(BEAM, use_cache=False)])
def test_two_models_score_the_mean_of_their_log_probs(models, src, opts):
    ensemble = Ensemble(list(models))
    assert ensemble.cfg.max_positions == 512  # the positions both have
    n_best = min(opts.beam, 3)
    got = decode_nbest(ensemble, src, opts, n_best)
    assert got != decode_nbest(models[0], src, opts, n_best) and got != decode_nbest(models[1], src, opts, n_best)
    for i, hyps in enumerate(got):
        for score, ids in hyps:
            # A hypothesis's summed log-probability (its score times its length penalty) is the
            # mean of what each member gives it, EOS included: each member's memory and cache
            # followed the beam (a renormalized average would score it lower).
            summed = score * gnmt_penalty(len(ids) + 1, opts.length_penalty)
            members = [sum(token_log_probs(m, src[i : i + 1], [ids])[0]) for m in models]
            assert summed == pytest.approx(sum(members) / 2, abs=1e-4)


# ---------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny checkpoints with one tokenizer (of other widths), one with another tokenizer, one tagged."""
    root = tmp_path_factory.mktemp("ensemble")
    a, b = make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1, d_model=48)
    tok = Tokenizer.load(a / "spm.model")
    torch.manual_seed(2)
    config = Config(model=tiny(), data=DataConfig(vocab_size=256))
    model, languages = Transformer(config.model, tok.vocab_size), languages_entry([("en", "de")], {})
    tagged = save_checkpoint(root / "tagged", model, config, tok, None, languages)
    other = make_checkpoint(root / "other", seed=3, vocab_size=128)
    return {"a": str(a), "b": str(b), "other": str(other), "tagged": str(tagged), "root": root}


def local_ensemble(ckpts, texts: list[str], opts: DecodeOptions = OPTS) -> list[tuple[float, str]]:
    """The ensemble of a and b decoded in this process: the best (score, text) per text."""
    (ma, tok, _), (mb, _, _) = load_model(ckpts["a"]), load_model(ckpts["b"])
    return [h[0] for h in translate_nbest(Ensemble([ma, mb]), tok, texts, opts, 1, batch_size=8)]


def test_engines_load_an_ensemble_with_raymts_engine(ckpts):
    info = engines.load_model_info([ckpts["a"], ckpts["b"]])
    assert info.checkpoints == [ckpts["a"], ckpts["b"]] and info.location == ckpts["a"]
    assert engines.resolve_engine("auto", info) == "raymt"  # ctranslate2 is installed, or not
    with pytest.raises(ValueError, match="CTranslate2 has no ensembles"):
        engines.resolve_engine("ctranslate2", info)
    assert isinstance(engines.load_engine([ckpts["a"], ckpts["b"]]).model, Ensemble)
    assert isinstance(engines.load_engine([ckpts["a"]], "raymt").model, Transformer)  # one: the model itself


def test_translate_decodes_the_ensemble(ckpts, capsys):
    texts = generate(6, "en", "de", seed=8)[0]
    assert translate.main(["--checkpoint", ckpts["a"], "--checkpoint", ckpts["b"], *FLAGS, *texts]) == 0
    printed = capsys.readouterr().out.split("\n")[:-1]
    assert printed == [text for _, text in local_ensemble(ckpts, texts)]
    model, tok, _ = load_model(ckpts["a"])
    assert printed != [h[0][1] for h in translate_nbest(model, tok, texts, OPTS, 1, batch_size=8)]


@pytest.mark.parametrize("command", ["translate", "evaluate", "backtranslate"])
@pytest.mark.parametrize(
    "member, message",
    [
        ("other", "has another tokenizer than"),
        ("tagged", "was trained on other languages or tags (en-de; tags before the source) than"),
    ],
)
def test_models_that_differ_are_one_line_before_ray(ckpts, command, member, message, monkeypatch, err_lines):
    def no_ray(*_, **__):
        raise AssertionError("Ray must not start")

    root, module = ckpts["root"], {"translate": translate, "evaluate": evaluate, "backtranslate": backtranslate}
    monkeypatch.setattr(evaluate, "init_ray", no_ray)
    monkeypatch.setattr(shard_job, "init_ray", no_ray)  # backtranslate's driver
    monkeypatch.setattr(engines, "load_model", no_ray)  # refused before any weights load
    prefix = write_pairs(root / "pairs", 3, seed=1)
    extra = {
        "translate": ["a sentence"],
        "evaluate": ["--test", str(prefix), "--output-dir", str(root / "eval")],
        "backtranslate": ["--input", f"{prefix}.en", "--output", str(root / "bt")],
    }[command]
    assert module[command].main(["--checkpoint", ckpts["a"], "--checkpoint", ckpts[member], *extra]) == 2
    [line] = err_lines()
    assert line.startswith(f"raymt.{command}: error: --checkpoint {ckpts[member]} ") and message in line


def test_backtranslate_refuses_ctranslate2_for_an_ensemble(ckpts, monkeypatch, err_lines):
    monkeypatch.setattr(shard_job, "init_ray", lambda *_, **__: pytest.fail("Ray must not start"))
    prefix = write_pairs(ckpts["root"] / "ct2", 3, seed=1)
    args = ["--checkpoint", ckpts["a"], "--checkpoint", ckpts["b"], "--input", f"{prefix}.en"]
    assert backtranslate.main([*args, "--output", str(ckpts["root"] / "ct2-out"), "--engine", "ctranslate2"]) == 2
    [line] = err_lines()
    assert "--engine ctranslate2 decodes one model, not an ensemble of 2" in line


@pytest.mark.slow  # ~12 s quiet: Ray actors of evaluate and backtranslate (CI runs it: .ci/run)
@pytest.mark.ci
def test_evaluate_and_backtranslate_decode_the_ensemble(ray_cluster, ckpts):
    root, both = ckpts["root"], ["--checkpoint", ckpts["a"], "--checkpoint", ckpts["b"]]
    prefix = write_pairs(root / "test", 9, seed=5)
    out = root / "evaluation"
    assert evaluate.main([*both, "--test", str(prefix), "--num-actors", "1", "--output-dir", str(out), *FLAGS]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["checkpoints"] == [ckpts["a"], ckpts["b"]] and report["checkpoint"] == ckpts["a"]
    assert report["checkpoint_description"].startswith(f"ensemble of 2: {ckpts['a']} (step 0")
    texts = generate(9, "en", "de", seed=5)[0]
    hyps = (out / "test.de.hyp").read_text(encoding="utf-8").split("\n")[:-1]
    assert hyps == [text for _, text in local_ensemble(ckpts, texts)]  # one engine, one host: bit for bit

    bt_out = root / "bt-ensemble"
    bt_flags = ["--beam", "2", "--max-len-a", "1.0", "--max-len-b", "5", "--num-actors", "1", "--progress-s", "0.5"]
    assert backtranslate.main([*both, "--input", f"{prefix}.en", "--output", str(bt_out), *bt_flags]) == 0
    info = json.loads((bt_out / "bt.json").read_text())
    # --engine auto (the default) resolves to raymt's for an ensemble, CTranslate2 installed or not.
    assert info["checkpoints"] == [ckpts["a"], ckpts["b"]] and info["engine"] == "raymt" and info["done"]
    outputs = pq.read_table(next(bt_out.glob("part-*.parquet"))).column("output").to_pylist()
    # The actor is another process (its own kernel paths): a near tie may part (tests/agreement.py).
    (ma, tok, _), (mb, _, _) = load_model(ckpts["a"]), load_model(ckpts["b"])
    opts = DecodeOptions(beam=2, max_len_a=1.0, max_len_b=5)
    sources = engines.load_model_info([ckpts["a"], ckpts["b"]]).encode(texts)
    want = [text for _, text in local_ensemble(ckpts, texts, opts)]
    assert_texts_agree(Ensemble([ma, mb]), tok, sources, outputs, want)


def test_a_back_translation_before_ensembles_finishes_with_its_one_checkpoint(ckpts):
    """An older bt.json names one "checkpoint" and no "checkpoints": the same command still finishes it."""
    prefix = write_pairs(ckpts["root"] / "old", 3, seed=1)
    args = ["--input", f"{prefix}.en", "--output", str(ckpts["root"] / "old-bt"), "--engine", "raymt"]
    job = backtranslate.check_args(backtranslate.parse_args(["--checkpoint", ckpts["a"], *args]))
    bt_job.write_info(job)
    record = json.loads((ckpts["root"] / "old-bt" / "bt.json").read_text())
    assert record.pop("checkpoints") == [ckpts["a"]]
    (ckpts["root"] / "old-bt" / "bt.json").write_text(json.dumps(record))
    backtranslate.check_args(backtranslate.parse_args(["--checkpoint", ckpts["a"], *args]))
    with pytest.raises(ValueError, match=r"other settings \(--checkpoint\)"):
        backtranslate.check_args(
            backtranslate.parse_args(["--checkpoint", ckpts["a"], "--checkpoint", ckpts["b"], *args])
        )
