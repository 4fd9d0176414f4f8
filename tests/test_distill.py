"""`raymt distill` (issue 58), a preset of the pipeline (issue 67): the student presets, the flags'
PipelineConfig (given teachers), its checks before Ray, a whole distillation on the built-in corpus
(tiny sizes), and a kill during the teachers' translation resumed with every line once."""

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
from raymt.config import CONTENT_RULES, BacktranslateConfig, Config, preset
from raymt.export import ExportConfig
from raymt.flags import TrainFlags
from raymt.model import Transformer
from raymt.pipeline import steps
from raymt.pipeline.config import from_dict
from raymt.pipeline.models import ct2_export
from raymt.pipeline.runner import Pipeline

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


def test_the_command_is_a_pipeline_of_given_teachers(teacher, tmp_path):
    """The flags map to the PipelineConfig a TOML file would give (no teacher trained, no prepare
    step); flags of how it runs (workers, shard size, CPUs) are in no key, --beam is in those after
    the teachers."""
    out = str(tmp_path / "d")
    argv = ["--teacher", str(teacher), "--output", out, "--mix-original", "0.25", "--max-steps", "7"]
    cfg = distill.pipeline_config(distill.parse_args([*argv, "--num-workers", "2", "--beam", "3"]))
    tables = {
        "src": "en",
        "tgt": "de",
        "output": out,
        # The built-in corpus at the student run's sizes and seed (a run's defaults), as before.
        "corpora": {"builtin_train_size": 24000, "builtin_eval_size": 300, "seed": 1},
        "teacher": {"checkpoints": [str(teacher)]},
        "distill": {"beam": 3},
        "student": {"max_steps": 7, "mix_original": 0.25, "set": ["train.num_workers=2"]},
        "export": {"beam": 3},
        "evaluate": {"beam": 3},
    }
    assert cfg == from_dict(tables)
    pipe = Pipeline(cfg)
    assert list(pipe.ctx.steps) == ["corpus", "distill", "student", "export", "evaluate"]
    keys = {name: step.key for name, step in pipe.ctx.steps.items()}
    for flags in (["--num-workers", "1", "--beam", "3"], ["--beam", "3", "--shard-lines", "7", "--num-cpus", "1"]):
        assert keys == key_of(distill.parse_args([*argv, *flags]))
    beam5 = key_of(distill.parse_args(argv))
    assert [name for name in keys if keys[name] != beam5[name]] == ["distill", "student", "export", "evaluate"]
    assert not (tmp_path / "d").exists()  # building the pipeline writes nothing


def key_of(args: distill.DistillConfig) -> dict[str, str]:
    """Each step's key of a distillation's pipeline."""
    return {name: step.key for name, step in Pipeline(distill.pipeline_config(args)).ctx.steps.items()}


def test_the_student_config_mixes_the_original_pairs_and_keeps_the_teachers_tokenizer(teacher, tmp_path):
    args = distill.parse_args(
        ["--teacher", str(teacher), "--output", str(tmp_path / "d"), "--mix-original", "0.25", "--max-steps", "7"]
    )
    ctx = Pipeline(distill.pipeline_config(args)).ctx
    (tmp_path / "d" / "steps").mkdir(parents=True)
    steps.write_student_config(ctx, ctx.steps["student"])
    cfg = Config.from_dict(json.loads(steps.student_config_file(ctx, ctx.steps["student"]).read_text()))
    assert cfg.data.tokenizer == str(teacher)
    assert cfg.model == preset("student_mini") and cfg.train.max_steps == 7
    distilled, original = cfg.data.corpora
    assert (distilled.label, distilled.weight, distilled.train) == (
        "distilled",
        0.75,
        (str(ctx.dir("distill") / "text"),),
    )
    assert (original.label, original.weight, original.train) == ("original", 0.25, (str(ctx.dir("corpus") / "train"),))
    # The built-in corpus written as files is still generated text: no content rules, as in a run.
    assert distilled.clean == original.clean == {rule: False for rule in CONTENT_RULES}


def test_given_teachers_bad_config_is_one_line_before_ray(teacher, tmp_path):
    """[teacher] checkpoints: each a directory, not with import_from, num_seeds, back-translation or
    the score filter; their languages the pair's, one ensemble that distill.engine decodes."""
    other = make_checkpoint(tmp_path / "other", seed=3, vocab_size=128)
    given = {"checkpoints": [str(teacher)]}
    base = {"src": "en", "tgt": "de", "output": str(tmp_path / "o"), "teacher": given}
    cases = {
        "no such directory": ({"teacher": {"checkpoints": [str(tmp_path / "nope")]}}, "no such directory"),
        "imported too": ({"teacher": {**given, "import_from": "org/name"}}, "teacher.checkpoints and teacher.import"),
        "seeds": ({"teacher": {**given, "num_seeds": 2}}, "teacher.num_seeds=2 with teacher.checkpoints"),
        "back-translation": ({"corpora": {"builtin_mono_size": 5}}, "but teacher.checkpoints gives the teachers"),
        "score filter": ({"score_filter": {"enabled": True}}, "score_filter filters the teachers' training pairs"),
        "another pair": ({"tgt": "fr"}, f"teacher.checkpoints: {teacher} does not translate en->fr"),
        "tokenizers": ({"teacher": {"checkpoints": [str(teacher), str(other)]}}, "another tokenizer"),
        "ensemble on CTranslate2": (
            {"teacher": {"checkpoints": [str(teacher)] * 2}, "distill": {"engine": "ctranslate2"}},
            "--engine ctranslate2 decodes one model",
        ),
    }
    for name, (tables, expected) in cases.items():
        with pytest.raises(ValueError) as err:
            Pipeline(from_dict({**base, **tables}))
        assert len(str(err.value).splitlines()) == 1 and expected in str(err.value), (name, err.value)
    assert not (tmp_path / "o").exists()


def test_a_given_teachers_weights_are_in_the_keys(tmp_path):
    """A changed teacher checkpoint (its weights file) makes the steps that use it stale."""
    first = make_checkpoint(tmp_path / "t", seed=2)
    cfg = {"src": "en", "tgt": "de", "output": str(tmp_path / "o"), "teacher": {"checkpoints": [str(first)]}}
    before = {name: s.key for name, s in Pipeline(from_dict(cfg)).ctx.steps.items()}
    make_checkpoint(tmp_path / "t", seed=4, d_model=16)  # another model there
    after = {name: s.key for name, s in Pipeline(from_dict(cfg)).ctx.steps.items()}
    assert [name for name in before if before[name] != after[name]] == ["distill", "student", "export", "evaluate"]


@pytest.mark.slow  # ~40 s: Ray actors, a student run, two exports (CI runs it: -m ci)
@pytest.mark.ci
def test_distill_end_to_end_on_the_builtin_corpus(ray_address, teacher, tmp_path, capsys):
    """Done when 2 of issue 58, as a pipeline (issue 67): translate, train, export and compare, then
    a rerun finds it done."""
    out = tmp_path / "d"
    argv = ["--teacher", str(teacher), "--output", str(out), *TINY]
    assert distill.main(argv) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    ctx = Pipeline(distill.pipeline_config(distill.parse_args(argv))).ctx
    # The teachers' translation: every training source translated once by the teacher, kept as a corpus.
    info = json.loads((ctx.dir("distill") / "bt.json").read_text())
    assert info["done"] and info["counts"]["translated"] == 400
    sources = (ctx.dir("corpus") / "train.en").read_text().splitlines()
    assert (ctx.dir("distill") / "text.en").read_text().splitlines() == sources
    assert len((ctx.dir("distill") / "text.de").read_text().splitlines()) == 400
    # The student, of the preset's shape, with the teacher's tokenizer, on the distilled pairs.
    best = Path(ctx.best("student"))
    assert (best / "spm.model").read_bytes() == (teacher / "spm.model").read_bytes()
    assert load_config(best)[0].model == preset("tiny")
    manifest = json.loads((ctx.dir("student") / "corpus" / "manifest.json").read_text())
    assert [(c["name"], c["train"]["input_pairs"]) for c in manifest["corpora"]] == [("distilled", 400)]
    # Exported at the faster weight type of the two it measured.
    choice = json.loads((ctx.dir("export") / "export.json").read_text())
    assert choice["dtype"] == max(choice["sentences_per_s"], key=choice["sentences_per_s"].get)
    assert (ctx.dir("export") / "model" / "model.bin").exists()
    # Teacher at beam 2, the student greedy and at beam 2, side by side (the pipeline's report).
    report = json.loads((out / "report.json").read_text())
    assert [(r["model"], r["beam"]) for r in report["rows"]] == [("teacher-1", 2), ("student", 1), ("student", 2)]
    assert report["num_sentences"] == 30 and all(r["sentences_per_s"] > 0 for r in report["rows"])
    assert "| student | ctranslate2 | 1 |" in printed and (out / "report.md").exists()
    # Each step's line names the command that runs it alone: it parses back to the step's config.
    started = dict(re.findall(r"pipeline: (\w+) starts \([^)]*\): raymt (?:\w+ )+?(--.*?)(?:  #.*)?$", printed, re.M))
    assert set(started) == {"corpus", "distill", "student", "export", "evaluate"} - {"corpus", "evaluate"}
    bt = parse(BacktranslateConfig, shlex.split(started["distill"]), "raymt backtranslate")
    assert bt == steps.distill_config(ctx, ctx.steps["distill"])
    assert parse(TrainFlags, shlex.split(started["student"]), "raymt train").name == ctx.dir("student").name
    assert parse(ExportConfig, shlex.split(started["export"]), "raymt export").format == "ctranslate2"
    # The same command again: everything is there, nothing is redone.
    assert distill.main(argv) == 0
    again = capsys.readouterr().out
    assert "starts" not in again and "pipeline: student done" in again


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
    shards = "steps/distill.*/part-*.parquet"
    while len(list(out.glob(shards))) < 2:
        assert first.poll() is None and time.time() < deadline, "no shard written before the command ended"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    written = len(list(out.glob(shards)))
    assert written < 8 and not list(out.glob("steps/student.*/summary.json"))

    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    to_do = int(re.search(r"in 8 shards, (\d+) to do", second.stdout).group(1))
    assert to_do <= 8 - written  # the shards written before the kill were kept
    table = pa.concat_tables(pq.read_table(f) for f in sorted(out.glob(shards)))
    assert sorted(table.column("line_id").to_pylist()) == list(range(400))  # each line once
    (sources,) = out.glob("steps/corpus.*/train.en")
    (translated,) = out.glob("steps/distill.*/text.en")
    assert translated.read_text().splitlines() == sources.read_text().splitlines()
    assert (out / "report.json").exists()


def test_the_comparison_has_each_teacher_and_their_ensemble(teacher, tmp_path):
    """Several teachers: each in CTranslate2, their ensemble in raymt's engine (the model the student
    learns from, so the speeds are relative to it), then the student (the pipeline's evaluate step)."""
    second = make_checkpoint(tmp_path / "second", seed=5)
    pairs = [str(write_pairs(tmp_path / split, 12, seed=4)) for split in ("train", "valid", "test")]
    argv = ["--teacher", str(teacher), "--teacher", str(second), "--output", str(tmp_path / "d"), "--beam", "2"]
    argv += ["--engine", "raymt", "--train", pairs[0], "--valid", pairs[1], "--test", pairs[2]]
    ctx = Pipeline(distill.pipeline_config(distill.parse_args(argv))).ctx
    ct2_export(str(second), ctx.dir("export") / steps.MODEL_DIR, "float32")  # stands in for the student
    (ctx.dir("export") / steps.EXPORT_RECORD).write_text(json.dumps({"dtype": "float32"}))
    steps.evaluate_run(ctx, ctx.steps["evaluate"])
    report = json.loads((ctx.dir("evaluate") / steps.REPORT).read_text())
    rows = {(r["model"], r["beam"]): r for r in report["rows"]}
    assert list(rows) == [("teacher-1", 2), ("teacher-2", 2), ("ensemble of 2", 2), ("student", 1), ("student", 2)]
    assert [rows[k]["engine"] for k in rows] == ["ctranslate2", "ctranslate2", "raymt", "ctranslate2", "ctranslate2"]
    assert rows[("ensemble of 2", 2)]["speed_vs_teacher"] == 1.0
    # The ensemble's size is both teachers' weights files.
    weights = sum(weights_file(t).stat().st_size for t in (teacher, second)) / 2**20
    assert rows[("ensemble of 2", 2)]["mib"] == round(weights, 2)
