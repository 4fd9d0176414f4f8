"""`raymt distill` (issue 58): the student presets, its checks before Ray, a whole distillation on the
built-in corpus (tiny sizes), and a kill during the teachers' translation resumed with every line once."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_checkpoint import make_checkpoint, one_thread, write_pairs  # noqa: F401 (autouse fixture)

from raymt import distill, shard_job
from raymt.checkpoint import load_config, weights_file
from raymt.command import parse
from raymt.config import CONTENT_RULES, BacktranslateConfig, preset
from raymt.export import ExportConfig
from raymt.flags import TrainFlags
from raymt.model import Transformer

# The student run of the end-to-end test: 400 built-in pairs, 10 updates of 2 workers.
TINY = [
    "--student-preset",
    "tiny",
    "--max-steps",
    "10",
    "--num-workers",
    "2",
    "--set",
    "data.builtin_train_size=400",
    "--set",
    "data.builtin_eval_size=30",
    "--set",
    "train.eval_every=10",
    "--set",
    "data.max_tokens=256",
    "--beam",
    "2",
    "--engine",
    "raymt",
]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("teacher") / "checkpoint", seed=2)


def test_student_presets_are_deep_encoder_shallow_decoder():
    mini, small = preset("student_mini"), preset("student_base")
    assert (mini.num_encoder_layers, mini.num_decoder_layers, mini.d_model, mini.d_ff) == (4, 1, 128, 256)
    assert (small.num_encoder_layers, small.num_decoder_layers, small.d_model, small.d_ff) == (6, 2, 256, 1536)

    def params(cfg) -> int:
        return sum(p.numel() for p in Transformer(cfg, vocab_size=8000).parameters())

    # The recipe's 4+4 teacher (multi30k-cpu) against its student: the decoder layers go.
    recipe = preset("mini")
    recipe.num_encoder_layers = recipe.num_decoder_layers = 4
    recipe.d_ff = 256
    assert params(mini) < 0.85 * params(recipe)


def test_the_student_config_mixes_the_original_pairs_and_keeps_the_teachers_tokenizer(teacher, tmp_path):
    args = distill.parse_args(
        ["--teacher", str(teacher), "--output", str(tmp_path / "d"), "--mix-original", "0.25", "--max-steps", "7"]
    )
    plan = distill.check_args(args)
    cfg = plan.student
    assert cfg.data.tokenizer == str(teacher)
    assert cfg.model == preset("student_mini") and cfg.train.max_steps == 7
    distilled, original = cfg.data.corpora
    d = tmp_path / "d"
    assert (distilled.label, distilled.weight, distilled.train) == ("distilled", 0.75, (str(d / "teacher/text"),))
    assert (original.label, original.weight, original.train) == ("original", 0.25, (str(d / "builtin/train"),))
    assert distilled.test == (str(tmp_path / "d/builtin/test"),)
    # The built-in corpus written as files is still generated text: no content rules, as in a run.
    assert distilled.clean == original.clean == {rule: False for rule in CONTENT_RULES}
    assert not (tmp_path / "d").exists()  # checks write nothing


def test_bad_input_is_one_line_before_ray(teacher, tmp_path, capsys):
    other = make_checkpoint(tmp_path / "other", seed=3, vocab_size=128)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stray.txt").write_text("someone else's\n")
    cases = {
        "different tokenizers": (["--teacher", str(other), "--output", str(tmp_path / "a")], "another tokenizer"),
        "an ensemble on CTranslate2": (
            ["--teacher", str(teacher), "--engine", "ctranslate2", "--output", str(tmp_path / "f")],
            "--engine ctranslate2 decodes one model",
        ),
        "unknown preset": (["--student-preset", "huge", "--output", str(tmp_path / "b")], "unknown preset 'huge'"),
        "a pair it cannot translate": (["--tgt-lang", "fr", "--output", str(tmp_path / "c")], "--tgt-lang fr"),
        "another directory": (["--output", str(out)], "is not a distillation"),
        "a missing file": (["--train", str(tmp_path / "nope"), "--output", str(tmp_path / "d")], "missing file"),
        "a mix of everything": (["--mix-original", "1", "--output", str(tmp_path / "e")], "--mix-original 1.0"),
    }
    for name, (flags, expected) in cases.items():
        assert distill.main(["--teacher", str(teacher), *flags]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, (name, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"]  # nothing written


@pytest.mark.slow  # ~28 s: Ray actors, a student run, two exports (CI runs it: -m ci)
@pytest.mark.ci
def test_distill_end_to_end_on_the_builtin_corpus(ray_address, teacher, tmp_path, capsys):
    """Done when 2 of issue 58: translate, train, export and compare, then a rerun finds it done."""
    out = tmp_path / "d"
    argv = ["--teacher", str(teacher), "--output", str(out), *TINY]
    assert distill.main(argv) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    # Step 1: every training source translated once by the teacher, kept as a corpus.
    info = json.loads((out / "teacher" / "bt.json").read_text())
    assert info["done"] and info["counts"]["translated"] == 400
    sources = (out / "builtin" / "train.en").read_text().splitlines()
    assert (out / "teacher" / "text.en").read_text().splitlines() == sources
    assert len((out / "teacher" / "text.de").read_text().splitlines()) == 400
    # Step 2: the student, of the preset's shape, with the teacher's tokenizer, on the distilled pairs.
    summary = json.loads((out / "student" / "summary.json").read_text())
    best = Path(summary["best_checkpoint"])
    assert (best / "spm.model").read_bytes() == (teacher / "spm.model").read_bytes()
    assert load_config(best)[0].model == preset("tiny")
    manifest = json.loads((out / "student" / "corpus" / "manifest.json").read_text())
    assert [(c["name"], c["train"]["input_pairs"]) for c in manifest["corpora"]] == [("distilled", 400)]
    # Step 3: exported at the faster weight type of the two it measured.
    choice = json.loads((out / "student-ct2.json").read_text())
    assert choice["dtype"] == max(choice["sentences_per_s"], key=choice["sentences_per_s"].get)
    assert (out / "student-ct2" / "model.bin").exists()
    # Step 4: teacher at beam 2, the student greedy and at beam 2, side by side.
    report = json.loads((out / "report.json").read_text())
    assert [(r["model"], r["beam"]) for r in report["rows"]] == [("teacher", 2), ("student", 1), ("student", 2)]
    assert report["num_sentences"] == 30 and all(r["sentences_per_s"] > 0 for r in report["rows"])
    assert "| student | ctranslate2 | 1 |" in printed
    # Each step's header is the command that runs it alone: it parses back to the step's config.
    headers = dict(re.findall(r"=== distill \d/4: [^:]+: raymt (\w+) (.*)", printed))
    assert set(headers) == {"backtranslate", "train", "export"}
    bt = parse(BacktranslateConfig, shlex.split(headers["backtranslate"]), "raymt backtranslate")
    assert bt == distill.translate_config(distill.parse_args(argv), distill.check_args(distill.parse_args(argv)))
    assert parse(TrainFlags, shlex.split(headers["train"]), "raymt train").name == "student"
    assert parse(ExportConfig, shlex.split(headers["export"]), "raymt export").format == "ctranslate2"
    # The same command again: everything is there, nothing is redone.
    assert distill.main(argv) == 0
    again = capsys.readouterr().out
    assert "0 to do" in again or "backtranslated 400 lines" in again
    assert "=== distill 2/4" not in again and "=== distill 3/4" not in again


@pytest.mark.slow  # ~60 s: Ray started twice by the command, a kill between (CI runs it: .ci/run)
@pytest.mark.ci
def test_a_kill_during_the_teachers_translation_resumes_each_line_once(ray_address, teacher, tmp_path):
    """Done when 2 of issue 58: the command killed while the teacher translates, run again: every
    training source translated once, the shards written before the kill kept."""
    out = tmp_path / "d"
    argv = ["--teacher", str(teacher), "--output", str(out), "--shard-lines", "50", *TINY]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), shard_job.DELAY_ENV: "0.5"}
    cmd = [sys.executable, "-m", "raymt.distill", *argv]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + 300
    while len(list((out / "teacher").glob("part-*.parquet"))) < 2:
        assert first.poll() is None and time.time() < deadline, "no shard written before the command ended"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    written = len(list((out / "teacher").glob("part-*.parquet")))
    assert written < 8 and not (out / "student").exists()

    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    to_do = int(re.search(r"in 8 shards, (\d+) to do", second.stdout).group(1))
    assert to_do <= 8 - written  # the shards written before the kill were kept
    table = pa.concat_tables(pq.read_table(f) for f in sorted((out / "teacher").glob("part-*.parquet")))
    assert sorted(table.column("line_id").to_pylist()) == list(range(400))  # each line once
    sources = (out / "builtin" / "train.en").read_text().splitlines()
    assert (out / "teacher" / "text.en").read_text().splitlines() == sources
    assert (out / "report.json").exists()


def test_the_comparison_has_each_teacher_and_their_ensemble(teacher, tmp_path):
    """Several teachers: each in CTranslate2, their ensemble in raymt's engine (the model the student
    learns from, so the speeds are relative to it), then the student."""
    second = make_checkpoint(tmp_path / "second", seed=5)
    argv = ["--teacher", str(teacher), "--teacher", str(second), "--output", str(tmp_path / "d"), "--beam", "2"]
    args = distill.parse_args(argv)
    plan = distill.check_args(args)
    plan.test = str(write_pairs(tmp_path / "test", 12, seed=4))
    student = distill.ct2_export(str(second), tmp_path / "student-ct2", "float32")  # stands in for one
    report = distill.compare(args, plan, student, "float32")
    rows = {(r["model"], r["beam"]): r for r in report["rows"]}
    assert list(rows) == [("teacher 1", 2), ("teacher 2", 2), ("ensemble of 2", 2), ("student", 1), ("student", 2)]
    assert [rows[k]["engine"] for k in rows] == ["ctranslate2", "ctranslate2", "raymt", "ctranslate2", "ctranslate2"]
    assert rows[("ensemble of 2", 2)]["speed_vs_teacher"] == 1.0
    # The ensemble's size is both teachers' weights files.
    weights = sum(weights_file(t).stat().st_size for t in (teacher, second)) / 2**20
    assert rows[("ensemble of 2", 2)]["mib"] == round(weights, 2)
