"""`raymt pipeline` (issue 67): its config's one-line errors before Ray, the step keys (a changed
setting makes exactly the steps downstream stale; a reverted one finds its old key), plan and show
on a fresh output without Ray, and the whole chain of recipes/pipeline-tiny.toml end to end."""

import json
import shlex
import time
from pathlib import Path

import pytest
from pipeline_cases import BASE, TINY_STEPS, keys
from tiny_checkpoint import one_thread, write_pairs  # noqa: F401 (autouse fixture)

from raymt.command import parse, to_argv
from raymt.config import BacktranslateConfig
from raymt.data.__main__ import PrepareCommand
from raymt.flags import TrainFlags
from raymt.pipeline import __main__ as pipeline
from raymt.pipeline.config import from_dict, load
from raymt.pipeline.runner import Pipeline

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "pipeline-tiny.toml")


def test_bad_config_is_one_line_before_ray(tmp_path, capsys):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("src = \n")
    cases = {
        "an unknown section": ({"studnet": {}}, "unknown section or field 'studnet'; use one of src, tgt, output"),
        "an unknown field": ({"teacher": {"seeds": 2}}, "[teacher] has no field 'seeds'; use one of preset"),
        "a missing corpus": (
            {"corpora": {"train": str(tmp_path / "nope"), "valid": "v", "test": "t"}},
            "corpora.train: missing file",
        ),
        "a bad type": ({"teacher": {"num_seeds": "two"}}, "teacher.num_seeds='two' must be an int"),
        "a bad value": ({"distill": {"beam": 0}}, "distill.beam=0 must be > 0"),
        "an unknown preset": ({"student": {"preset": "huge"}}, "student.preset: unknown preset 'huge'"),
        "an export type": ({"export": {"dtypes": ["int4"]}}, "export.dtypes: 'int4' is not one of int8, float32"),
        "a prepare option": ({"prepare": {"vocab_size": 100}}, "prepare.vocab_size=100 must be a multiple of 8"),
        "languages set twice": ({"prepare": {"src_lang": "fr"}}, "[prepare] has no field 'src_lang'"),
        "valid without train": ({"corpora": {"valid": "v"}}, "corpora.valid/corpora.test without corpora.train"),
    }
    for name, (tables, expected) in cases.items():
        with pytest.raises(ValueError) as err:
            from_dict({**BASE, **tables})
        assert expected in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
    # The command: a status of 2 and one line, for the file and for --set.
    for argv, expected in (
        (["plan", str(tmp_path / "missing.toml")], "does not exist"),
        (["plan", str(bad_toml)], "is not valid toml"),
        (["run", TINY, "--set", "teacher.nope=1"], "[teacher] has no field 'nope'"),
        (["run", TINY, "--set", "teacher.max_steps=ten"], "teacher.max_steps='ten' is not a valid int"),
        (["show", TINY], "usage: raymt pipeline show STEP CONFIG.toml"),
        (["show", "teacher-9", TINY, "--output", str(tmp_path / "o")], "no step 'teacher-9'; the steps are corpus"),
    ):
        assert pipeline.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]  # nothing written


def test_a_changed_setting_changes_exactly_the_keys_downstream_and_a_reverted_one_the_same():
    base = {**BASE, "teacher": {"num_seeds": 2}, "student": {"set": ["train.max_steps=20"]}}
    before = keys(base)
    assert list(before) == ["corpus", "prepare", "teacher-1", "teacher-2", "distill", "student", "export", "evaluate"]
    assert len(set(before.values())) == len(before)  # two seeds: two teachers
    changed = keys({**base, "student": {"set": ["train.max_steps=30"]}})
    assert {n for n in before if before[n] != changed[n]} == {"student", "export", "evaluate"}
    assert keys(base) == before  # reverted: the old keys, so the old outputs
    # Upstream: the distillation's beam reaches the student and what follows, not the teachers.
    beam = keys({**base, "distill": {"beam": 3}})
    assert {n for n in before if before[n] != beam[n]} == {"distill", "student", "export", "evaluate"}
    # What changes no result changes no key: the restart unit of the teachers' translation.
    assert keys({**base, "distill": {"shard_lines": 7}}) == before
    # The languages are in every key (the same settings for another pair are another pipeline).
    other = keys({**base, "tgt": "fr"})
    assert not set(other.values()) & set(before.values())


def test_plan_and_show_on_a_fresh_output_start_no_ray(tmp_path, capsys, monkeypatch):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("a dry run started Ray")

    monkeypatch.setattr(ray, "init", no_ray)  # whether or not an earlier test left Ray running
    out = tmp_path / "out"
    t0 = time.perf_counter()
    assert pipeline.main(["plan", TINY, "--output", str(out)]) == 0
    *lines, left = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == TINY_STEPS
    assert all(line.endswith("to do") for line in lines), lines
    assert left.startswith(f"time left: unknown for {len(TINY_STEPS)} step(s)") and "(never measured here)" in left
    assert time.perf_counter() - t0 < 10
    # Each step's command line parses back to the config the step runs.
    shown = {}
    for step in ("prepare", "teacher-1", "distill", "student"):
        assert pipeline.main(["show", step, TINY, "--output", str(out)]) == 0
        shown[step] = shlex.split(capsys.readouterr().out.split("  #")[0])
    assert shown["prepare"][:3] == ["raymt", "data", "prepare"]
    prepare = parse(PrepareCommand, shown["prepare"][3:], "raymt data prepare")
    assert prepare.options.vocab_size == 256 and prepare.out.startswith(str(out / "steps" / "prepare."))
    teacher = parse(TrainFlags, shown["teacher-1"][2:], "raymt train")
    assert teacher.preset == "tiny" and teacher.corpus == prepare.out and teacher.set[-1] == "train.seed=1"
    bt = parse(BacktranslateConfig, shown["distill"][2:], "raymt backtranslate")
    assert bt.format == "text" and bt.decode.beam == 2 and bt.engine == "raymt"
    student = parse(TrainFlags, shown["student"][2:], "raymt train")
    assert student.config.endswith(".json") and student.name.startswith("student.")
    assert not out.exists()  # a dry run: nothing written


def test_plan_names_what_changed_since_the_last_run(tmp_path):
    """OUT/pipeline.json records the last run's steps; a step whose key changed since is stale, and
    plan says which setting changed (the end marker of a step decides done, so a fake run works)."""
    out = tmp_path / "out"
    cfg = load(TINY, str(out))
    first = Pipeline(cfg)
    out.mkdir()
    (out / "pipeline.json").write_text(json.dumps({"records": first.records}))
    for name in ("corpus", "prepare"):  # these two finished
        first.ctx.dir(name).mkdir(parents=True)
    (first.ctx.dir("corpus") / "test.de").write_text("x\n")
    (first.ctx.dir("prepare") / "manifest.json").write_text("{}")
    plan = dict(
        line.split(maxsplit=2)[::2] for line in Pipeline(load(TINY, str(out), ["student.max_steps=30"])).plan()[:-1]
    )
    assert plan["corpus"] == plan["prepare"] == "done"
    assert plan["teacher-1"] == plan["distill"] == plan["bt"] == "to do"
    assert plan["student"] == "stale (student.max_steps 10 -> 30)"
    assert plan["export"] == "stale (uses student, which changed)"
    sets = ["student.set=train.eval_every=5"]
    plan = dict(line.split(maxsplit=2)[::2] for line in Pipeline(load(TINY, str(out), sets)).plan()[:-1])
    assert plan["student"] == "stale (student.set.train.eval_every 10 -> 5)"


@pytest.mark.slow  # five Ray Train runs (backward, two teacher stages, student): minutes; CI runs it (.ci/run)
@pytest.mark.ci
def test_the_tiny_recipe_end_to_end_then_a_rerun_redoes_nothing(ray_address, tmp_path, capsys):
    """Done when 1 of issue 67 (its first part): `raymt pipeline run recipes/pipeline-tiny.toml
    --output DIR` runs the whole chain; report.json has a row per model; the rerun runs no step;
    plan names every step done."""
    out = tmp_path / "p"
    argv = ["run", TINY, "--output", str(out)]
    assert pipeline.main(argv) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    started = [line.split()[1] for line in printed.splitlines() if line.startswith("pipeline: ") and " starts " in line]
    assert started == TINY_STEPS
    report = json.loads((out / "report.json").read_text())
    models = [(r["model"], r["beam"]) for r in report["rows"]]
    assert models == [("teacher-1", 2), ("student", 1), ("student", 2), ("backward (de->en)", 2)]
    assert report["rows"][-1]["speed_vs_teacher"] is None  # another direction: not compared
    assert report["num_sentences"] == 30 and all(r["sentences_per_s"] > 0 for r in report["rows"])
    assert report["export"]["dtype"] in ("int8", "float32")
    assert all(step["wall_s"] is not None for step in report["steps"].values())
    assert "| student | ctranslate2 | 1 |" in (out / "report.md").read_text()
    # The student learned from the teacher's translations, with the teacher's tokenizer.
    steps = {p.name.split(".")[0]: p for p in (out / "steps").iterdir() if p.is_dir()}
    bt = json.loads((steps["distill"] / "bt.json").read_text())
    assert bt["done"] and bt["counts"]["translated"] == 400 + 100  # the training sources, the English text
    # Back-translation: the backward de->en model made English sources of the 100 German lines,
    # prepared beside the original pairs; stage 2 started from stage 1's average, on the original.
    back = json.loads((steps["bt"] / "bt.json").read_text())
    assert back["done"] and back["counts"]["translated"] == 100 and (back["src_lang"], back["tgt_lang"]) == ("de", "en")
    manifest = json.loads((steps["prepare-bt"] / "manifest.json").read_text())
    assert [(c["origin"], c["train"]["input_pairs"]) for c in manifest["corpora"]] == [("real", 400), ("bt", 100)]
    stage2 = json.loads((steps["teacher-1"] / "summary.json").read_text())
    assert stage2["init_checkpoint"] == str(steps["teacher-1-avg"] / "model")
    assert json.loads((steps["teacher-1"] / "raymt_config.json").read_text())["data"]["corpus"] == str(steps["prepare"])
    summary = json.loads((steps["student"] / "summary.json").read_text())
    teacher = json.loads((steps["teacher-1"] / "summary.json").read_text())
    spm = (Path(summary["best_checkpoint"]) / "spm.model").read_bytes()
    assert spm == (Path(teacher["best_checkpoint"]) / "spm.model").read_bytes()

    t0 = time.perf_counter()
    assert pipeline.main(argv) == 0
    again = capsys.readouterr().out
    assert " starts " not in again and "pipeline: 0 step(s) run" in again
    assert time.perf_counter() - t0 < 10
    assert pipeline.main(["plan", TINY, "--output", str(out)]) == 0
    *plan, left = capsys.readouterr().out.splitlines()
    assert len(plan) == len(TINY_STEPS) and all(line.endswith("  done") for line in plan), plan
    assert left == "time left: none (every step is done)"
    assert (out / "report.png").stat().st_size > 0


def test_the_command_round_trips_through_its_flags():
    cmd = pipeline.PipelineCommand(
        action="show", args=["student", TINY], output="o", set=["student.max_steps=3", "evaluate.beam=1"]
    )
    assert parse(pipeline.PipelineCommand, to_argv(cmd), "raymt pipeline") == cmd


def test_a_training_step_without_a_length_is_sized_by_patience(tmp_path):
    """No max_steps (nor train.max_steps/epochs in set or the config file): the run ends by
    patience (or max_minutes), not at the quick start's 400 updates; a length given is kept."""
    from raymt.pipeline.config import UNSIZED_MAX_STEPS, TeacherStage

    assert TeacherStage(preset="tiny").length() == (UNSIZED_MAX_STEPS, ["train.patience=5"])
    assert TeacherStage(preset="tiny", patience=2, max_minutes=30).length()[1] == ["train.patience=2"]
    assert TeacherStage(preset="tiny", max_steps=50).length() == (50, [])
    assert TeacherStage(preset="tiny", set=["train.epochs=3"]).length() == (None, [])
    config = tmp_path / "run.toml"
    config.write_text("[train]\nmax_steps = 70\n")
    assert TeacherStage(preset="tiny", config=str(config)).length() == (None, [])
    with pytest.raises(ValueError, match="teacher.patience=0 must be > 0"):
        TeacherStage(preset="tiny", patience=0)
    # In a step's command line (show): the teacher of a config that gives no length.
    cfg = from_dict({"src": "en", "tgt": "de", "output": str(tmp_path / "out"), "teacher": {"preset": "tiny"}})
    line = Pipeline(cfg).command("teacher-1")
    flags = parse(TrainFlags, shlex.split(line.split("  #")[0])[2:], "raymt train")
    assert flags.max_steps == UNSIZED_MAX_STEPS and "train.patience=5" in flags.set
