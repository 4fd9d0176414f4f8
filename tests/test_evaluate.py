"""`raymt.evaluate`: actor-pool decoding equals 1 actor and `raymt.translate`; bad input fails early."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_checkpoint import make_checkpoint, write_pairs

from raymt import evaluate, metrics
from raymt.checkpoint import load_model
from raymt.data.text import read_parallel
from raymt.decoding import DecodeOptions, translate_nbest

pytestmark = pytest.mark.timeout(300)
OPTS = DecodeOptions(beam=3, max_len_a=1.0, max_len_b=5)
FLAGS = ["--beam", "3", "--max-len-a", "1.0", "--max-len-b", "5", "--batch-size", "8"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny checkpoint and two test sets (one plain, one gzipped) of mixed lengths."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as in each actor, so that scores match bit for bit
    root = tmp_path_factory.mktemp("evaluate")
    yield {
        "checkpoint": make_checkpoint(root / "checkpoint"),
        "root": root,
        "a": write_pairs(root / "set_a", 21, seed=5),
        "b": write_pairs(root / "set_b", 13, seed=6, gz=True),
    }
    torch.set_num_threads(before)


def sources(files):
    return [read_parallel(str(files[name]), "en", "de")[0] for name in ("a", "b")]


def test_two_actors_equal_one_actor_and_translate(ray_cluster, files):
    out_dir = files["root"] / "out"
    status = evaluate.main(
        [
            "--checkpoint",
            str(files["checkpoint"]),
            "--test",
            str(files["a"]),
            "--test",
            str(files["b"]),
            "--num-actors",
            "2",
            "--output-dir",
            str(out_dir),
            *FLAGS,
        ]
    )
    assert status == 0
    report = json.loads((out_dir / "report.json").read_text())
    two = [(out_dir / f"set_{n}.de.hyp").read_text(encoding="utf-8").split("\n")[:-1] for n in "ab"]
    two_scores = [[float(x) for x in (out_dir / f"set_{n}.de.scores").read_text().split()] for n in "ab"]

    one = evaluate.translate_on_cluster(str(files["checkpoint"]), sources(files), OPTS, num_actors=1, batch_size=8)
    assert two == [[hyp for _, hyp in s] for s in one]
    assert two_scores == [[float(f"{score:.6f}") for score, _ in s] for s in one]

    model, tokenizer, _ = load_model(files["checkpoint"])
    local = [[h[0] for h in translate_nbest(model, tokenizer, s, OPTS, 1, batch_size=8)] for s in sources(files)]
    assert one == local  # same hypotheses and the same scores, bit for bit

    for name, hyps in zip(("set_a", "set_b"), two):
        scores = metrics.score(hyps, read_parallel(str(files[name[-1]]), "en", "de")[1], extra=True, lang="de")
        entry = report["test_sets"][name]
        assert {k: entry[k] for k in scores} == scores and entry["num_sentences"] == len(hyps)
    assert "tok:13a" in entry["bleu_lc_signature"] and "case:lc" in entry["bleu_lc_signature"]
    assert {"bleu", "chrf", "ter", "bleu_signature", "chrf_signature", "ter_signature"} <= set(entry)
    assert report["num_actors"] == 2 and report["num_sentences"] == 34


def test_cli_translate_gives_the_same_hypotheses(files):
    """`python -m raymt.translate` on the same input prints what the actors decoded."""
    src = sources(files)[0]
    command = [sys.executable, "-m", "raymt.translate", "--checkpoint", str(files["checkpoint"]), *FLAGS]
    out = subprocess.run(
        command,
        input="".join(s + "\n" for s in src),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    model, tokenizer, _ = load_model(files["checkpoint"])
    expected = [h[0][1] for h in translate_nbest(model, tokenizer, src, OPTS, 1, batch_size=8)]
    assert out.stdout.split("\n")[:-1] == expected


@pytest.mark.parametrize("case", ["no_checkpoint", "no_file", "line_counts", "duplicate_name", "beam"])
def test_bad_input_is_one_line_before_ray(files, case, tmp_path, monkeypatch, err_lines):
    def no_ray(*_):
        raise AssertionError("Ray must not start on bad input")

    monkeypatch.setattr(evaluate, "init_ray", no_ray)
    checkpoint, tests, extra = str(files["checkpoint"]), [str(files["a"])], []
    if case == "no_checkpoint":
        checkpoint = str(tmp_path / "missing")
    elif case == "no_file":
        tests = [str(tmp_path / "nothing")]
    elif case == "line_counts":
        write_pairs(tmp_path / "bad", 5, seed=1)
        (tmp_path / "bad.de").write_text("one line\n")
        tests = [str(tmp_path / "bad")]
    elif case == "duplicate_name":
        tests = [str(files["a"]), str(files["a"])]
    else:
        extra = ["--beam", "0"]
    args = ["--checkpoint", checkpoint, "--output-dir", str(tmp_path / "o"), *extra]
    assert evaluate.main(args + [a for t in tests for a in ("--test", t)]) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.evaluate: error: ")
    expected = {
        "no_checkpoint": "does not exist",
        "no_file": "missing file",
        "line_counts": "has 5 lines",
        "duplicate_name": "two test sets",
        "beam": "beam=0",
    }[case]
    assert expected in err[0]


def test_the_job_apis_address_is_a_one_line_error(files, tmp_path, monkeypatch, err_lines):
    """docs/cluster.md's RAY_ADDRESS=http://127.0.0.1:8265 is for `ray job`; ray.init cannot attach to it."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ray.init")))
    args = ["--checkpoint", str(files["checkpoint"]), "--test", str(files["a"]), "--output-dir", str(tmp_path)]
    assert evaluate.main(args) == 2
    err = err_lines()
    assert len(err) == 1 and "RAY_ADDRESS=http://127.0.0.1:8265 is the job API's address" in err[0], err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-actors", "5"], "needs 1.25 CPUs but the cluster's 2 CPUs"),
        (["--gpu", "--num-actors", "2"], "needs 2 GPUs; the cluster has 0"),
        (["--gpu"], "--gpu: the cluster has no GPU now; pass --num-actors N"),
    ],
)
def test_actors_that_cannot_be_placed_are_one_line(ray_cluster, files, tmp_path, flags, message, err_lines):
    args = ["--checkpoint", str(files["checkpoint"]), "--test", str(files["a"]), "--output-dir", str(tmp_path)]
    assert evaluate.main(args + flags) == 2
    err = err_lines()
    assert len(err) == 1 and message in err[0]


def test_cli_exits_2_without_starting_ray(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "raymt.evaluate", "--checkpoint", str(tmp_path), "--test", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"raymt.evaluate: error: {tmp_path}/config.json does not exist; is {tmp_path} a raymt checkpoint directory?"
    ]
