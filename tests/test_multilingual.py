"""Training on several corpora (issue 30, the wiring): the workers' temperature mix, a tag on
every training source, validation and test per pair, checkpoints that record their mix and
languages, resuming only the same mix, sweeps of data.temperature, and a killed multilingual
run that continues pair by pair as an uninterrupted one.

Fast, without Ray: the built-in corpus at a few hundred pairs per pair, prepared in the driver.
The end-to-end runs (slow, CI) train a tiny model on three built-in pairs with 2 workers.
"""

import json
import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REFERENCE_STEPS, tiny_run
from test_faults import (
    assert_same_as_reference,
    final_weights,
    group_starts,
    kill_worker_then_driver,
    trained_pairs,
)

from raymt.config import apply_overrides, tiny
from raymt.data import format as corpus_format
from raymt.data.epoch import Mix, Position, mix_record, training_data
from raymt.data.stream import TrainStream, flat, pair_hashes
from raymt.flags import build_config
from raymt.metrics import pair_columns
from raymt.model import build_model
from raymt.rundata import PairTags, materialize, pair_tags, plan_data
from raymt.rundir import RUN_CONFIG, RunDir, finalize
from raymt.train import parse_args, resolve_resume, valid_rows
from raymt.trainer import Collective, collate_eval, evaluate
from raymt.worker_env import ValidRows

PAIRS = ["en-de", "en-fr", "de-en"]
WEIGHTS = [4.0, 1.0, 1.0]  # the built-in pairs are equally large: weights make the mix uneven
SIZES = ["--set=data.builtin_train_size=300", "--set=data.builtin_eval_size=20"]
SMALL_VOCAB = ["--set=data.vocab_size=200", "--set=data.sp_model_type=bpe"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Three built-in pairs prepared as a run prepares them (in the driver: they are small):
    (config, RunData, the corpora with WEIGHTS, tokenizer)."""
    cfg = build_config(parse_args(["--pairs", ",".join(PAIRS), *SIZES, *SMALL_VOCAB]))
    cfg, run_data = plan_data(cfg, tmp_path_factory.mktemp("run"), None, None)
    corpus = materialize(run_data)
    weighted = [c._replace(weight=w) for c, w in zip(corpus.training_corpora, WEIGHTS)]
    return cfg, run_data, weighted, corpus.tokenizer()


def expected_rows(corpora, temperature: float) -> list[float]:
    """N p_i: an epoch's rows N = sum w_i n_i shared by p_i ~ (w_i n_i)^(1/T) (issue 30)."""
    sizes = [c.weight * c.num_pairs for c in corpora]
    probs = np.array(sizes) ** (1 / temperature)
    return list(sum(sizes) * probs / probs.sum())


def shard_digests(corpus) -> tuple[Counter, set]:
    """A corpus's pairs as trace digests (a multiset) and the first source id of each row."""
    digests, first = Counter(), set()
    for shard in corpus.shards:
        table = pq.read_table(shard.path)
        src, tgt = flat(table.column("src_ids")), flat(table.column("tgt_ids"))
        digests.update(pair_hashes(src, tgt, np.arange(table.num_rows)))
        first.update(src[0][src[1][:-1]].tolist())
    return digests, first


# ---------------------------------------------------------------- the workers' mix


@pytest.mark.parametrize("temperature", [1.0, 5.0])
def test_every_source_is_tagged_and_each_epoch_is_the_temperatures_mix(prepared, temperature):
    """Two workers' streams over three epochs: every batch source starts with a target tag, each
    traced pair is one of its corpus's, and each epoch holds N p_i pairs of corpus i (to the
    rounding of one row), p_i ~ (w_i n_i)^(1/T); at T=1 each corpus w_i times."""
    cfg, _, corpora, tokenizer = prepared
    mix = training_data(corpora, temperature)
    assert isinstance(mix, Mix) and mix.names == PAIRS
    tags = {c.name: tokenizer.sp.piece_to_id(c.source_tags[0]) for c in corpora}
    digests = {c.name: shard_digests(c) for c in corpora}
    assert all(first == {tags[name]} for name, (_, first) in digests.items())  # every stored source
    want = expected_rows(corpora, temperature)
    for epoch in range(3):
        traced = []
        for rank in range(2):
            stream = TrainStream(mix, cfg.data, cfg.train.seed, rank, 2, Position(epoch), trace=True)
            for batch in stream:
                assert set(batch.src[:, 0].tolist()) <= set(tags.values())  # what the model sees
            traced += stream.traced
        pairs = [entry.split(":") for entry in traced]
        assert all(digest in digests[name][0] for name, digest in pairs)
        counts = Counter(name for name, _ in pairs)
        assert all(abs(counts[c.name] - w) < 1 for c, w in zip(corpora, want)), (counts, want)
        if temperature == 1.0:  # each corpus w_i times over, every pair of it w_i times
            for c in corpora:
                seen = Counter(d for name, d in pairs if name == c.name)
                assert seen == Counter({d: n * int(c.weight) for d, n in digests[c.name][0].items()})
    assert mix_record(corpora, temperature) == {"names": PAIRS, "rows": list(mix.rows), "temperature": temperature}


def test_one_pairs_shards_are_read_as_today(prepared):
    files = [corpus_format.Shard("train/en-de/part-00000.parquet", 10, (40,))]
    one = [corpus_format.TrainingCorpus("en-de", "en", "de", "real", 1.0, (), files, 10)]
    mix = training_data(one, 5.0)  # a mix of one corpus at any temperature, its shards read once
    assert (mix.corpora, mix.rows, mix.single) == ((tuple(files),), (10,), True) and mix_record(one, 5.0) is None


# ---------------------------------------------------------------- validation and test per pair


def test_each_pairs_validation_rows_start_with_its_tag(prepared):
    cfg, run_data, corpora, tokenizer = prepared
    tags = pair_tags(corpus_format.open_corpus(run_data.corpus_dir))
    ids = {lang: tokenizer.sp.piece_to_id(f"<2{lang}>") for lang in ("de", "en", "fr")}
    assert tags.prefixes == {"en-de": [ids["de"]], "en-fr": [ids["fr"]], "de-en": [ids["en"]]}
    assert tags.languages == {
        "pairs": [["en", "de"], ["en", "fr"], ["de", "en"]],
        "target_langs": ["de", "en", "fr"],
        "reserved": {f"<2{lang}>": i for lang, i in ids.items()},
    }
    valid = run_data.eval_sets["valid"]
    sets = valid_rows(valid, tokenizer, cfg.model.max_positions, tags)
    assert list(sets) == PAIRS
    for pair, entry in sets.items():
        assert entry.refs == valid[pair][1] and len(entry.rows) == len(valid[pair][0])
        assert all(row["src_ids"][0] == tags.prefixes[pair][0] for row in entry.rows)
    # One pair: today's rows, untagged.
    one = valid_rows({"en-de": valid["en-de"]}, tokenizer, 64, PairTags(None, {"en-de": []}))
    rows = corpus_format.eval_rows(valid["en-de"], tokenizer, 64)
    assert one == {"en-de": ValidRows(rows, valid["en-de"][1])}


def test_validation_scores_each_pair_and_averages_them(prepared):
    """The worker's ValidSets on two pairs: each pair's evaluate, BLEU/chrF averaged over pairs and
    the loss weighted by the target tokens `evaluate` reports; one pair keeps today's keys."""
    from raymt.worker_data import ValidSets

    cfg, run_data, corpora, tokenizer = prepared
    torch.manual_seed(0)
    model = build_model(tiny(), tokenizer.vocab_size).eval()
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    opts = apply_overrides(cfg, {"decode.beam": 1, "decode.max_len_a": 0.0, "decode.max_len_b": 3}).decode
    tags = pair_tags(corpus_format.open_corpus(run_data.corpus_dir))
    sets = valid_rows(run_data.eval_sets["valid"], tokenizer, tiny().max_positions, tags)
    loaders = {p: ([collate_eval(s.rows[:8]), collate_eval(s.rows[8:])], s.refs) for p, s in sets.items()}
    two = ValidSets({p: loaders[p] for p in ("en-fr", "de-en")}, tokenizer, opts)
    got = two.score(model, Collective(), autocast)
    alone = {p: evaluate(model, loaders[p][0], tokenizer, loaders[p][1], opts) for p in ("en-fr", "de-en")}
    tokens = {p: sum(len(r["tgt_ids"]) + 1 for r in sets[p].rows) for p in alone}  # + EOS
    assert {p: m["valid_tokens"] for p, m in alone.items()} == tokens
    assert set(pair_columns(["en-fr", "de-en"])) < set(got) and "valid_tokens" not in got
    for p, m in alone.items():
        assert got[f"valid_bleu/{p}"] == m["valid_bleu"] and got[f"valid_loss/{p}"] == m["valid_loss"]
    assert got["valid_bleu"] == pytest.approx((alone["en-fr"]["valid_bleu"] + alone["de-en"]["valid_bleu"]) / 2)
    loss = sum(alone[p]["valid_loss"] * tokens[p] for p in alone) / sum(tokens.values())
    assert got["valid_loss"] == pytest.approx(loss)
    one = ValidSets({"en-de": loaders["en-de"]}, tokenizer, opts).score(model, Collective(), autocast)
    alone = evaluate(model, loaders["en-de"][0], tokenizer, loaders["en-de"][1], opts)
    assert one == {k: v for k, v in alone.items() if k != "valid_tokens"}


def test_each_pairs_test_set_is_decoded_with_its_tag_and_scored_in_its_language(prepared, monkeypatch, capsys):
    from raymt import evaluate, train
    from raymt.engines import ModelInfo

    cfg, run_data, corpora, tokenizer = prepared
    tags = pair_tags(corpus_format.open_corpus(run_data.corpus_dir))
    model = ModelInfo("ckpt", "raymt", cfg, tokenizer, tags.languages)  # what the run's checkpoints hold
    calls = []

    def decoded(checkpoint, sources, cfg, shown, tgt_lang, src_lang=None):
        calls.append((sources, tgt_lang))
        return list(sources)

    def scored_in(hyps, refs, cfg, checkpoint, shown, lang):
        calls.append(lang)
        return {"bleu": 1.0, "chrf": 2.0, "bleu_tok": 3.0, "checkpoint": shown, "beam": 5, "length_penalty": 1.0}

    monkeypatch.setattr(evaluate, "decode_on_driver", decoded)
    monkeypatch.setattr(evaluate, "scored_test_set", scored_in)
    scored = evaluate.score_test_sets("ckpt", run_data.eval_sets["test"], cfg, "runs/r/ckpt")
    assert list(scored) == PAIRS
    assert calls == [x for p in PAIRS for x in ((run_data.eval_sets["test"][p][0], p[-2:]), p[-2:])]
    assert [model.prefix(p[-2:]) for p in PAIRS] == [tags.prefixes[p] for p in PAIRS]  # the engine's tag: the pair's
    summary = {"pairs": PAIRS, "test": {p: {**s, "num_sentences": 20} for p, s in scored.items()}}
    train.print_summary({**summary, "metrics_csv": "m", "run_dir": "r", "best_checkpoint": "b", "wall_time_s": 6})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("test")]
    assert [line.split(" BLEU ")[0] for line in lines] == ["test en-de:", "test en-fr:", "test de-en:"]


# ---------------------------------------------------------------- resuming only the same mix


def test_a_checkpoint_of_another_mix_is_refused_in_one_line(prepared):
    from raymt.worker_data import check_data_mix

    _, _, corpora, _ = prepared
    at1, at5 = mix_record(corpora, 1.0), mix_record(corpora, 5.0)
    check_data_mix(at5, mix_record(corpora, 5.0))
    check_data_mix(None, None)  # one pair, as ever
    for saved, current in ((at1, at5), (at5, mix_record(corpora[:2], 5.0)), (None, at5)):
        with pytest.raises(ValueError) as err:
            check_data_mix(saved, current)
        assert "\n" not in str(err.value) and "start a new run from the checkpoint instead" in str(err.value)
    assert "en-de (1200 rows/epoch), en-fr (300 rows/epoch), de-en (300 rows/epoch) at data.temperature=1" in str(
        pytest.raises(ValueError, check_data_mix, at1, at5).value
    )


def saved_run(tmp_path, argv: list[str]) -> str:
    """A run directory as a started run leaves it (its config, one registered checkpoint)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_CONFIG).write_text(json.dumps(build_config(parse_args(argv)).to_dict()))
    snapshot = {"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_x", "metrics": {"step": 20}}]}
    snapshot["latest_checkpoint_result"] = snapshot["checkpoint_results"][0]
    (run_dir / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    return str(run_dir)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--set", "data.temperature=5"], "data.temperature 1 there, 5 here"),
        (["--pairs", "en-de,en-fr"], "data.corpora [en-de, en-fr, de-en] there, [en-de, en-fr] here"),
        (["--pairs", "en-de,en-fr,de-en"], None),
    ],
)
def test_resuming_with_another_mix_fails_before_ray(tmp_path, flags, message):
    run_dir = saved_run(tmp_path, ["--pairs", ",".join(PAIRS)])
    cfg, resume_dir, _ = resolve_resume(parse_args(["--resume", run_dir, *flags]))
    assert resume_dir == run_dir
    if message is None:  # the same corpora again (as a repeated command line gives them)
        placed = RunDir(run_dir).resume_config(cfg).train
        assert (placed.storage_path, placed.name) == (str(tmp_path), "run")
        return
    with pytest.raises(ValueError) as err:
        RunDir(run_dir).resume_config(cfg)
    line = str(err.value)
    assert "\n" not in line and message in line, line
    assert line.endswith(f"start a new run from its checkpoint instead: --init {run_dir}/checkpoint_x --name NEW")


def test_resuming_a_tagged_run_with_its_tag_on_the_other_side_fails_before_ray(tmp_path):
    run_dir = saved_run(tmp_path, ["--pairs", ",".join(PAIRS), "--set", "data.tag_side=tgt"])
    assert RunDir(run_dir).resume_config(resolve_resume(parse_args(["--resume", run_dir]))[0]).data.tag_side == "tgt"
    cfg, _, _ = resolve_resume(parse_args(["--resume", run_dir, "--set", "data.tag_side=src"]))
    with pytest.raises(ValueError) as err:
        RunDir(run_dir).resume_config(cfg)
    line = str(err.value)
    assert "\n" not in line and "data.tag_side='tgt', this run sets 'src'" in line, line


def test_one_pair_runs_resume_as_before_whatever_the_temperature(tmp_path):
    run_dir = saved_run(tmp_path, [])
    cfg, resumed, _ = resolve_resume(parse_args(["--resume", run_dir, "--set", "data.temperature=5"]))
    assert resumed == run_dir and RunDir(run_dir).resume_config(cfg).data.temperature == 5
    # A one-pair run whose --corpus is gone, given another: no manifest is needed to let it go on.
    (tmp_path / "run").rename(tmp_path / "old")
    run_dir = saved_run(tmp_path, ["--corpus", str(tmp_path / "gone")])
    cfg, resumed, _ = resolve_resume(parse_args(["--resume", run_dir, "--corpus", str(tmp_path / "new")]))
    assert resumed == run_dir and RunDir(run_dir).resume_config(cfg).data.corpus == str(tmp_path / "new")


def test_train_run_given_a_run_directory_checks_the_resume_before_ray(tmp_path, monkeypatch):
    """The notebook's door (issue 56, item 5): `train.run(cfg, resume_dir=...)` with another mix
    of corpora than the run's fails in one line before Ray starts, as `--resume` does."""
    from raymt import train

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(train, "init_ray", no_ray)
    run_dir = saved_run(tmp_path, ["--pairs", ",".join(PAIRS)])
    cfg = build_config(parse_args(["--pairs", "en-de,en-fr"]))  # the notebook's Config: one pair less
    with pytest.raises(ValueError) as err:
        train.run(cfg, resume_dir=run_dir)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--resume {run_dir}: the run's mix of corpora cannot change"), line
    assert "data.corpora [en-de, en-fr, de-en] there, [en-de, en-fr] here" in line, line
    with pytest.raises(ValueError, match="not a run directory"):  # a directory that is none
        train.run(cfg, resume_dir=str(tmp_path / "elsewhere"))


def test_a_run_without_a_name_is_named_after_its_pairs(prepared):
    mixed = finalize(build_config(parse_args(["--pairs", "en-de,de-en"]))).train.name
    assert re.fullmatch(r"raymt-en-de\+de-en-\d{8}-\d{6}", mixed), mixed
    assert finalize(build_config(parse_args(["--src", "de", "--tgt", "en"]))).train.name.startswith("raymt-de-en-2")
    corpus = prepared[1].corpus_dir  # a prepared corpus of three pairs: its own pairs, not the default en-de
    named = finalize(build_config(parse_args(["--corpus", str(corpus)]))).train.name
    assert named.startswith(f"raymt-{'+'.join(PAIRS)}-2"), named


# ---------------------------------------------------------------- tune and bad input


def test_a_sweep_may_vary_the_temperature_of_its_shared_corpus(prepared, tmp_path, capsys):
    """data.temperature is the one corpus option a sweep may vary: the shared corpus is the same,
    only the workers' mix changes; every other corpus option is still refused."""
    from raymt.tune import parse_space, shared_corpus

    space = parse_space([], ["data.temperature=1,5"])
    assert list(space) == ["data.temperature"]
    with pytest.raises(ValueError, match="a sweep prepares its corpus once"):
        parse_space([], ["data.vocab_size=104,200"])
    cfg = build_config(parse_args(["--pairs", ",".join(PAIRS), *SIZES, *SMALL_VOCAB]))
    base = shared_corpus(cfg, tmp_path)
    rows = {}
    capsys.readouterr()
    for temperature in (1.0, 5.0):
        trial = apply_overrides(base, {"data.temperature": temperature})
        trial, run_data = plan_data(trial, tmp_path / f"t{temperature}", None, None)
        # a run mixes at its own data.temperature; one other than the corpus's is said once
        note = f"(its SentencePiece sample); this run mixes its corpora at data.temperature={temperature:g}"
        assert (note in capsys.readouterr().out) == (temperature != 1.0)
        assert run_data.corpus_dir == base.data.corpus
        corpora = materialize(run_data).training_corpora
        rows[temperature] = mix_record(corpora, trial.data.temperature)["rows"]
    assert rows[1.0] == [300, 300, 300] and rows[5.0] == rows[1.0]  # equal corpora: any T, the same
    weighted = [c._replace(weight=w) for c, w in zip(corpora, WEIGHTS)]
    assert mix_record(weighted, 1.0)["rows"] != mix_record(weighted, 5.0)["rows"]


def write_pairs(prefix, src: list[str], tgt: list[str], langs=("en", "de")) -> str:
    """PREFIX.<src lang> and PREFIX.<tgt lang> with these lines; the prefix."""
    for lang, lines in zip(langs, (src, tgt)):
        prefix.with_name(f"{prefix.name}.{lang}").write_text("".join(f"{line}\n" for line in lines))
    return str(prefix)


def test_a_pairs_own_sets_replace_the_built_in_ones(tmp_path):
    """--test/--valid for a built-in pair are the sets scored (the built-in ones stay for the others)."""
    mine = write_pairs(tmp_path / "mine", ["a house .", "two dogs ."], ["ein Haus .", "zwei Hunde ."])
    argv = ["--pairs", "en-de,de-en", "--test", f"en-de:{mine}", *SIZES, *SMALL_VOCAB]
    _, run_data = plan_data(build_config(parse_args(argv)), tmp_path / "run", None, None)
    assert run_data.eval_sets["test"]["en-de"] == (["a house .", "two dogs ."], ["ein Haus .", "zwei Hunde ."])
    assert len(run_data.eval_sets["test"]["de-en"][0]) == 20  # the built-in test set
    # one built-in pair: a bare --valid/--test replaces its sets too
    argv = ["--valid", mine, "--test", mine, *SIZES]
    _, run_data = plan_data(build_config(parse_args(argv)), tmp_path / "one", None, None)
    assert (
        run_data.eval_sets["valid"]
        == run_data.eval_sets["test"]
        == {"en-de": (["a house .", "two dogs ."], ["ein Haus .", "zwei Hunde ."])}
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pairs", ""], "--pairs: '' is not a language pair"),
        (["--pairs", "en-de,en-fr,en-de"], "--pairs: en-de given twice"),
        (["--pairs", "en-de,en-fr", "--train", "en-fr:a"], "en-fr also comes from --pairs"),
        (["--train", "en-de:a", "--train", "en-fr:b", "--valid", "en-de:v"], "pair en-fr has no validation set"),
        (["--train", "a", "--valid", "v", "--real-weight", "2"], "--real-weight upsamples the real pairs beside"),
    ],
)
def test_bad_corpora_of_a_run_fail_in_one_line_before_ray(tmp_path, capsys, monkeypatch, argv, message):
    from raymt import train

    monkeypatch.setattr(train, "init_ray", lambda *a, **k: (_ for _ in ()).throw(AssertionError("Ray started")))
    assert train.main(["--storage-path", str(tmp_path), *argv, *SIZES]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# ---------------------------------------------------------------- end to end: three pairs, 2 workers

STEPS = REFERENCE_STEPS
# A tiny model (d=16, 1+1 layers) on three built-in pairs of 200 pairs each, weighted 4:1:1 and
# mixed at T=5: an epoch of 1200 pairs is ~50 steps, so checkpoints every 20 steps fall mid-epoch.
MIX_TOML = """
[data]
temperature = 5.0
[[data.corpora]]
src_lang = "en"
tgt_lang = "de"
weight = 4.0
[[data.corpora]]
src_lang = "en"
tgt_lang = "fr"
[[data.corpora]]
src_lang = "de"
tgt_lang = "en"
"""
MODEL = ["model.d_model=16", "model.d_ff=32", "model.num_encoder_layers=1", "model.num_decoder_layers=1"]
DATA = ["data.builtin_train_size=200", "data.builtin_eval_size=12"]


def mixed_run(storage, name: str, max_steps: int, *extra: str) -> list[str]:
    """`tiny_run`'s command (2 workers, traced, dropout, a checkpoint every 20 steps) on MIX_TOML."""
    config = storage / "mix.toml"
    config.write_text(MIX_TOML)
    sets = [arg for field in MODEL + DATA for arg in ("--set", field)]
    return tiny_run(storage, name, max_steps, "--config", str(config), *sets, *extra)


@pytest.fixture(scope="module")
def mixed_reference(tmp_path_factory, ray_head):
    """One uninterrupted multilingual run of STEPS steps: (completed process, run directory)."""
    storage = tmp_path_factory.mktemp("mixed")
    ray_head.wait_idle()
    out = subprocess.run(
        mixed_run(storage, "ref", STEPS),
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, RAY_ADDRESS=ray_head.address),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out, storage / "ref"


@pytest.mark.slow  # a Ray Train run on three pairs: 245 s on 2 busy cores (CI runs it: .ci/run)
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_three_pairs_train_with_tags_in_the_temperatures_mix_and_score_per_pair(mixed_reference):
    out, run_dir = mixed_reference
    # The workers trained on tagged pairs of their corpora, epoch 0 in the mix of T=5.
    corpus = corpus_format.open_corpus(str(run_dir / "corpus"))
    corpora = corpus.training_corpora
    assert [(c.name, c.weight, c.source_tags) for c in corpora] == [
        ("en-de", 4.0, ("<2de>",)),
        ("en-fr", 1.0, ("<2fr>",)),
        ("de-en", 1.0, ("<2en>",)),
    ]
    digests = {c.name: shard_digests(c) for c in corpora}
    tokenizer = corpus.tokenizer()
    for c in corpora:
        assert digests[c.name][1] == {tokenizer.sp.piece_to_id(c.source_tags[0])}
    trained = [(epoch, entry.split(":")) for rows in trained_pairs(run_dir).values() for epoch, entry in rows]
    assert all(d in digests[name][0] for _, (name, d) in trained)
    assert max(epoch for epoch, _ in trained) >= 1  # epoch 0 is complete
    counts = Counter(name for epoch, (name, _) in trained if epoch == 0)
    want = expected_rows(corpora, 5.0)
    assert all(abs(counts[c.name] - w) < 1 for c, w in zip(corpora, want)), (counts, want)

    # Validation per pair and their mean; checkpoints record the mix and the languages.
    header = (run_dir / "logs" / "metrics.csv").read_text().partition("\n")[0].split(",")
    assert header[-9:] == list(pair_columns(PAIRS))
    best = next(line for line in out.stdout.splitlines() if line.startswith("best checkpoint: "))
    checkpoint = best.split(": ", 1)[1]
    meta = json.loads(open(f"{checkpoint}/config.json").read())
    assert meta["languages"]["pairs"] == [["en", "de"], ["en", "fr"], ["de", "en"]]
    state = torch.load(f"{checkpoint}/train_state.pt", weights_only=True)
    assert state["data_mix"] == {"names": PAIRS, "rows": [counts[p] for p in PAIRS], "temperature": 5.0}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pairs"] == PAIRS and list(summary["test"]) == PAIRS
    for metric in ("valid_bleu", "valid_chrf"):
        each = [summary["valid"][f"{metric}/{p}"] for p in PAIRS]
        assert summary["valid"][metric] == pytest.approx(sum(each) / 3)
    # One test line per pair, each pair beam-searched with its tag.
    lines = [line for line in out.stdout.splitlines() if line.startswith("test ")]
    assert [line.split(" BLEU ")[0] for line in lines] == [f"test {p}:" for p in PAIRS]
    for p, line in zip(PAIRS, lines):
        assert f"BLEU {summary['test'][p]['bleu']:.2f}," in line and summary["test"][p]["num_sentences"] == 12


@pytest.mark.slow  # a run killed twice and resumed: 478 s on 2 busy cores (CI runs it: .ci/run)
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_a_killed_multilingual_run_continues_pair_by_pair(tmp_path, mixed_reference, ray_address):
    """SIGKILL a worker mid-epoch (the group restarts from the last checkpoint), then the driver;
    `--resume RUN` finishes: at step STEPS the weights and the pairs (corpus and digest) of every
    step and epoch are those of the uninterrupted run."""
    _, reference_dir = mixed_reference
    run_dir = tmp_path / "faults"
    command = mixed_run(tmp_path, "faults", STEPS, "--set", "train.max_failures=1")
    restart, latest = kill_worker_then_driver(command, run_dir, ray_address, STEPS)

    out = subprocess.run(
        [sys.executable, "-m", "raymt.train", "--resume", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [int(m) for m in re.findall(r"step (\d+)/", out.stdout + out.stderr)]
    assert logged and min(logged) > latest
    assert group_starts(run_dir) == [0, restart, latest]
    assert_same_as_reference(run_dir, (final_weights(reference_dir), trained_pairs(reference_dir)))
