"""`raymt data score` (dual conditional cross-entropy, issue 59 item 3) and prepare's score rule."""

import dataclasses
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tiny_checkpoint import make_checkpoint, one_thread, write_pairs  # noqa: F401 (autouse fixture)

from raymt import shard_job
from raymt.checkpoint import load_model
from raymt.command import command_line, from_args, to_argv
from raymt.config import ScoreConfig, ShardJobOptions
from raymt.data import __main__ as data_main
from raymt.data import prepare, score_job, scores
from raymt.decoding import encode_sources, token_log_probs
from raymt.engines import load_engine
from raymt.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_checkpoint(root / "fwd", seed=0), make_checkpoint(root / "bwd", seed=1, pair="de-en")


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("Ray must not start on bad input")

    monkeypatch.setattr(shard_job, "init_ray", refuse)
    monkeypatch.setattr(prepare, "init_ray", refuse)


def score_args(models, corpus, *extra) -> list[str]:
    return ["score", "--forward", str(models[0]), "--backward", str(models[1]), "--corpus", str(corpus), *extra]


def score_config(argv: list[str]) -> ScoreConfig:
    """The config of a `raymt data score` command line."""
    return from_args(ScoreConfig, data_main.prepare_parser().parse_args(argv))


def score_here(argv: list[str]) -> score_job.ScoreJob:
    """`raymt data score` without Ray: the job checked as the command checks it, its shards to do
    scored and written here as an actor does (then --valid's, as `score_job.run` does)."""
    cfg = score_config(argv)
    job = score_job.check_args(cfg)
    forward = load_engine(job.forward.location, "raymt") if job.forward else None
    backward = load_engine(job.backward.location, "raymt")
    for shard, block in job.shard_inputs():
        table = score_job.score_block(forward, backward, block, (job.src_lang, job.tgt_lang), job.options.max_tokens)
        data, job.done[shard] = score_job.shard_file(table)
        shard_job.write_shard(job.shard_location(shard), data)
    score_job.write_info(job, done=True)
    if cfg.valid is not None:
        score_here(["score", *to_argv(score_job.valid_config(cfg))])
    return job


def read_scores(out: Path) -> list[float]:
    files = sorted(out.glob("part-*.parquet"))
    table = pq.read_table(files) if len(files) > 1 else pq.read_table(files[0])
    assert table.column("line_id").to_pylist() == list(range(table.num_rows))  # each line once, in order
    return table.column("score").to_pylist()


def direct_h(checkpoint: Path, sources: list[str], targets: list[str]) -> list[float]:
    """H(target | source) pair by pair, straight from token_log_probs."""
    model, tok, cfg = load_model(checkpoint)
    out = []
    for s, t in zip(sources, targets):
        src = torch.tensor(encode_sources(tok, [s], cfg.model.max_positions))
        log_probs = token_log_probs(model, src, [tok.encode(t)])[0]
        out.append(-sum(log_probs) / len(log_probs))
    return out


def test_dual_score_is_junczys_dowmunts_formula():
    assert scores.dual_score(1.0, 3.0) == pytest.approx(math.exp(-(2.0 + 2.0)))
    assert scores.dual_score(2.0, 2.0) == pytest.approx(math.exp(-2.0))
    # Alike cross-entropies beat a pair the two models disagree on, at the same mean.
    assert scores.dual_score(2.0, 2.0) > scores.dual_score(1.0, 3.0)
    assert scores.cross_entropy([-1.0, -2.0, -3.0]) == pytest.approx(2.0)
    assert scores.best_threshold(np.array([0.1, 0.9, np.nan, 0.5, 0.7]), 0.5) == 0.7  # the best 2 of 4 scored


def test_a_config_renders_the_command_line_that_builds_it():
    shards = ShardJobOptions(
        shard_lines=7, max_tokens=64, num_actors=3, cpus_per_actor=1.5, progress_s=0.5, verbose=True
    )
    cfg = ScoreConfig(forward="f", backward="b", corpus="c", output="o", src_lang="de", tgt_lang="en", shards=shards)
    cfg = dataclasses.replace(cfg, src_col="0", tgt_col="text")
    assert score_config(["score", *to_argv(cfg)]) == cfg
    assert command_line("data score", cfg).startswith("raymt data score --forward f --backward b --corpus c --output o")
    assert score_config(["score", "--forward", "f", "--backward", "b", "--corpus", "c"]) == ScoreConfig(
        forward="f", backward="b", corpus="c"
    )


def test_score_equals_a_direct_computation_with_token_log_probs(models, tmp_path):
    write_pairs(tmp_path / "train", 23, seed=3)
    src = (tmp_path / "train.en").read_text().splitlines()
    tgt = (tmp_path / "train.de").read_text().splitlines()
    src[4], tgt[9] = "", "   "  # empty pairs: NaN, counted
    (tmp_path / "train.en").write_text("\n".join(src) + "\n")
    (tmp_path / "train.de").write_text("\n".join(tgt) + "\n")
    job = score_here(score_args(models, tmp_path / "train", "--shard-lines", "10", "--max-tokens", "64"))
    assert job.output == str(tmp_path / "train.scores") and job.num_shards == 3
    got = read_scores(tmp_path / "train.scores")
    h_fwd = direct_h(models[0], src, tgt)
    h_bwd = direct_h(models[1], tgt, src)
    for i, score in enumerate(got):
        if i in (4, 9):
            assert math.isnan(score)
        else:
            assert score == pytest.approx(scores.dual_score(h_fwd[i], h_bwd[i]), rel=1e-4)
    info = json.loads((tmp_path / "train.scores" / "score.json").read_text())
    assert info["done"] and info["counts"] == {"scored": 21, "empty": 2, "invalid": 0}


def test_a_rerun_scores_only_the_missing_shards(models, tmp_path):
    write_pairs(tmp_path / "train", 25, seed=4)
    argv = score_args(models, tmp_path / "train", "--shard-lines", "10")
    score_here(argv)
    (tmp_path / "train.scores" / shard_job.shard_name(10)).unlink()
    (tmp_path / "train.scores" / shard_job.shard_name(20)).write_bytes(b"broken")
    job = score_job.check_args(score_config(argv))
    assert job.todo == [1, 2] and sorted(job.done) == [0]


def run_prepare(tmp_path: Path, *extra: str) -> dict:
    off = ["--no-copy", "--no-number-mismatch", "--no-url-mismatch", "--no-alpha-ratio", "--no-repeats"]
    argv = ["prepare", "--out", str(tmp_path / "corpus"), "--train", str(tmp_path / "train")]
    argv += ["--valid", str(tmp_path / "valid"), "--vocab-size", "128", "--max-ratio", "100", *off, *extra]
    argv += ["--overwrite"]
    assert data_main.main(argv) == 0
    return json.loads((tmp_path / "corpus" / "manifest.json").read_text())


def kept_sources(tmp_path: Path) -> list[str]:
    tok = Tokenizer.load(tmp_path / "corpus" / "spm.model")
    ids = pq.read_table(sorted((tmp_path / "corpus" / "train").rglob("*.parquet"))).column("src_ids").to_pylist()
    return sorted(tok.decode(i) for i in ids)


def test_prepare_keeps_pairs_by_score_and_counts_the_rest(models, tmp_path):
    write_pairs(tmp_path / "train", 40, seed=5)
    write_pairs(tmp_path / "valid", 5, seed=6)
    score_here(score_args(models, tmp_path / "train", "--shard-lines", "16"))
    got = np.array(read_scores(tmp_path / "train.scores"))
    src = (tmp_path / "train.en").read_text().splitlines()

    median = float(np.median(got))
    manifest = run_prepare(tmp_path, "--min-score", repr(median))
    train = manifest["corpora"][0]["train"]
    assert train["dropped"]["score"] == int((got < median).sum()) == 20
    assert train["num_pairs"] == 20
    assert kept_sources(tmp_path) == sorted(s for s, x in zip(src, got) if x >= median)
    assert manifest["options"]["min_score"] == median

    manifest = run_prepare(tmp_path, "--keep-best", "0.25")
    assert manifest["corpora"][0]["train"]["dropped"]["score"] == 30
    best = sorted(s for s, x in zip(src, got) if x >= np.sort(got)[-10])
    assert kept_sources(tmp_path) == best


def test_without_a_forward_model_the_score_is_the_backward_cross_entropy(models, tmp_path):
    """The cross-entropy filter of distilled pairs (mozilla/translations' ce-filter): exp(-H_bwd(src|tgt))."""
    write_pairs(tmp_path / "train", 9, seed=11)
    src = (tmp_path / "train.en").read_text().splitlines()
    tgt = (tmp_path / "train.de").read_text().splitlines()
    job = score_here(["score", "--backward", str(models[1]), "--corpus", str(tmp_path / "train")])
    assert (job.src_lang, job.tgt_lang) == ("en", "de")  # the backward model's pair, reversed
    got = read_scores(tmp_path / "train.scores")
    assert got == pytest.approx([math.exp(-h) for h in direct_h(models[1], tgt, src)], rel=1e-4)
    info = json.loads((tmp_path / "train.scores" / "score.json").read_text())
    assert info["forward"] is None and info["formula"].startswith("exp(-H_bwd)")


def test_calibrate_valid_drops_what_scores_under_the_validation_sets_quantile(models, tmp_path):
    """A threshold without labels: the score that Q of the validation pairs (scored by the same
    models, `--valid`) fall under; prepare drops the training pairs under it."""
    write_pairs(tmp_path / "train", 40, seed=12)
    write_pairs(tmp_path / "valid", 11, seed=13)
    score_here(score_args(models, tmp_path / "train", "--valid", str(tmp_path / "valid"), "--shard-lines", "16"))
    got = np.array(read_scores(tmp_path / "train.scores"))
    valid = np.sort(read_scores(tmp_path / "train.scores" / "valid"))
    assert len(valid) == 11
    threshold = valid[2]  # the 0.2 quantile of 11 scores, "lower": the third smallest (index floor(0.2 * 10))
    assert scores.calibrated_threshold(np.array([*valid, np.nan]), 0.2) == threshold
    manifest = run_prepare(tmp_path, "--calibrate-valid", "0.2")
    train = manifest["corpora"][0]["train"]
    assert train["dropped"]["score"] == int((got < threshold).sum()) > 0
    src = (tmp_path / "train.en").read_text().splitlines()
    assert kept_sources(tmp_path) == sorted(s for s, x in zip(src, got) if x >= threshold)
    assert manifest["options"]["calibrate_valid"] == 0.2


@pytest.mark.parametrize("case", ["no_valid_scores", "other_valid_set", "other_models", "keep_best_too", "range"])
def test_calibrate_valid_needs_the_validation_sets_scores_by_the_same_models(models, case, tmp_path, no_ray, capsys):
    write_pairs(tmp_path / "train", 12, seed=14)
    write_pairs(tmp_path / "valid", 4, seed=15)
    extra = [] if case == "no_valid_scores" else ["--valid", str(tmp_path / "valid")]
    score_here(score_args(models, tmp_path / "train", *extra))
    if case == "other_valid_set":
        write_pairs(tmp_path / "valid", 5, seed=16)
    elif case == "other_models":
        info_file = tmp_path / "train.scores" / "valid" / "score.json"
        info_file.write_text(json.dumps({**json.loads(info_file.read_text()), "backward": "elsewhere"}))
    argv = ["prepare", "--out", str(tmp_path / "c"), "--train", str(tmp_path / "train"), "--valid"]
    argv += [str(tmp_path / "valid"), "--calibrate-valid", "1.0" if case == "range" else "0.1"]
    argv += ["--keep-best", "0.5"] if case == "keep_best_too" else []
    capsys.readouterr()
    assert data_main.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    expected = {
        "no_valid_scores": "holds no validation scores: score the corpus with `raymt data score --valid",
        "other_valid_set": "does not match the corpus",
        "other_models": "was scored by other models",
        "keep_best_too": "keep_best and prepare.calibrate_valid are ways of filtering by score: set one",
        "range": "calibrate_valid=1.0 must be a number in (0, 1)",
    }[case]
    assert expected in err[0]


@pytest.mark.parametrize(
    "case",
    ["forward_direction", "backward_direction", "no_corpus", "other_settings", "both_filters", "score_range"],
)
def test_bad_score_input_is_one_line_before_ray(models, case, tmp_path, no_ray, capsys):
    write_pairs(tmp_path / "train", 12, seed=7)
    fwd, bwd = models
    argv = score_args(models, tmp_path / "train")
    if case == "forward_direction":
        argv = score_args((bwd, bwd), tmp_path / "train", "--src", "en", "--tgt", "de")
    elif case == "backward_direction":
        argv = score_args((fwd, fwd), tmp_path / "train")
    elif case == "no_corpus":
        argv = score_args(models, tmp_path / "missing")
    elif case == "other_settings":
        score_here(argv)
        argv = [*argv, "--shard-lines", "5"]
    elif case == "both_filters":
        argv = ["prepare", "--out", str(tmp_path / "c"), "--train", str(tmp_path / "train"), "--valid"]
        argv += [str(tmp_path / "train"), "--min-score", "0.1", "--keep-best", "0.5"]
    elif case == "score_range":
        argv = ["prepare", "--out", str(tmp_path / "c"), "--train", str(tmp_path / "train"), "--valid"]
        argv += [str(tmp_path / "train"), "--min-score", "2"]
    capsys.readouterr()
    assert data_main.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    expected = {
        "forward_direction": "--forward",
        "backward_direction": "--backward",
        "no_corpus": "missing",
        "other_settings": "--shard-lines",
        "both_filters": "set one",
        "score_range": "(0, 1]",
    }[case]
    assert expected in err[0]


@pytest.mark.parametrize("case", ["missing", "changed_corpus", "other_languages", "lost_rows", "unfinished"])
def test_scores_that_do_not_match_the_corpus_are_one_line_before_ray(models, case, tmp_path, no_ray, capsys):
    write_pairs(tmp_path / "train", 12, seed=8)
    write_pairs(tmp_path / "valid", 4, seed=9)
    out = tmp_path / "train.scores"
    if case != "missing":
        score_here(score_args(models, tmp_path / "train", "--shard-lines", "5"))
    info = json.loads((out / "score.json").read_text()) if out.exists() else {}
    if case == "changed_corpus":
        with (tmp_path / "train.de").open("a") as f:
            f.write("eine Zeile mehr\n")
    elif case == "other_languages":
        (out / "score.json").write_text(json.dumps({**info, "src_lang": "de", "tgt_lang": "en"}))
    elif case == "lost_rows":
        (out / shard_job.shard_name(5)).unlink()
    elif case == "unfinished":
        (out / "score.json").write_text(json.dumps({**info, "done": False}))
    argv = ["prepare", "--out", str(tmp_path / "c"), "--train", str(tmp_path / "train"), "--valid"]
    argv += [str(tmp_path / "valid"), "--keep-best", "0.5"]
    capsys.readouterr()
    assert data_main.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    expected = {
        "missing": "raymt data score` first",
        "changed_corpus": "does not match the corpus",
        "other_languages": "scores de-en pairs",
        "lost_rows": "holds 7 scores for 12",
        "unfinished": "not finished",
    }[case]
    assert expected in err[0]


# ---------------------------------------------------------------- on Ray, an actor killed


@pytest.mark.slow  # 11-23 s of call, ~16 s of Ray head setup on a busy 2-core machine (CI runs it: .ci/run)
@pytest.mark.ci
def test_each_line_scored_once_after_an_actor_kill(ray_cluster, ray_head, models, tmp_path, monkeypatch):
    """SIGKILL one of two scoring actors mid-run: its shards go to the other (Ray restarts it); every
    line is scored exactly once, as a run without Ray scores it; a rerun has nothing to do."""
    monkeypatch.setenv(shard_job.DELAY_ENV, "0.3")
    write_pairs(tmp_path / "train", 200, seed=10)
    write_pairs(tmp_path / "ref", 200, seed=10)
    argv = score_args(models, tmp_path / "train", "--shard-lines", "10", "--num-actors", "2", "--progress-s", "0.2")
    before, result = set(ray_head.processes(score_job.ACTOR_TITLE)), {}
    thread = threading.Thread(target=lambda: result.update(rc=data_main.main(argv)), daemon=True)
    thread.start()
    out, deadline = tmp_path / "train.scores", time.time() + 300
    while len(list(out.glob("part-*.parquet"))) < 2:  # both actors are up and busy
        assert thread.is_alive() and time.time() < deadline, "no shard written in time"
        time.sleep(0.05)
    actors = [pid for pid in ray_head.processes(score_job.ACTOR_TITLE) if pid not in before]
    assert len(actors) == 2
    os.kill(actors[0], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive() and result["rc"] == 0
    assert len(list(out.glob("part-*.parquet"))) == 20
    got = read_scores(out)
    score_here(score_args(models, tmp_path / "ref", "--shard-lines", "10"))
    assert got == pytest.approx(read_scores(tmp_path / "ref.scores"), rel=1e-5)
    assert json.loads((out / "score.json").read_text())["counts"]["scored"] == 200
    assert data_main.main(argv) == 0  # done: nothing to do, Ray not needed
