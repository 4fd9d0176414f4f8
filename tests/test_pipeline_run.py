"""`raymt pipeline run` (issue 67): steps side by side where the cluster has room (Ray places them;
one at a time on 2 CPUs), what `plan` says is stale and why after each kind of change, the time
left, keys without worker counts, an output written by another pipeline, and the report (the data
funnel, each step's CPU-hours, the figure). Fast tests fake the steps' end markers."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raymt.pipeline import __main__ as pipeline
from raymt.pipeline.config import from_dict, load
from raymt.pipeline.graph import pipeline_steps
from raymt.pipeline.keys import RECORD_FILE, set_keys
from raymt.pipeline.report import write_report
from raymt.pipeline.runner import Pipeline
from raymt.pipeline.steps import KINDS

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "pipeline-tiny.toml")
TWO_SEEDS = ["teacher.num_seeds=2"]
# The tiny recipe without back-translation: corpus, prepare, teachers, distill, student, export, evaluate.
PLAIN = ["corpora.builtin_mono_size=0", "teacher.stages=1"]
# Each kind's end marker (what `Kind.done` looks for) and what a fake run writes in it.
MARKERS = {
    "corpus": ("test.de", "x\n"),
    "prepare": ("manifest.json", "{}"),
    "mono": ("mono.json", "{}"),
    "backward": ("summary.json", "{}"),
    "bt": ("bt.json", '{"done": true}'),
    "prepare-bt": ("manifest.json", "{}"),
    "teacher-bt": ("summary.json", "{}"),
    "average": ("model/average.json", "{}"),
    "teacher": ("summary.json", "{}"),
    "distill": ("bt.json", '{"done": true}'),
    "student": ("summary.json", "{}"),
    "export": ("export.json", "{}"),
    "evaluate": ("report.json", "{}"),
}


def fake_finished(p: Pipeline, walls: dict[str, float] | None = None) -> None:
    """Every step of `p` finished as far as `plan` can tell: its end marker, its step.json (with a
    wall time from `walls`), and pipeline.json as `run` writes it."""
    p.write_record()
    for name, step in p.ctx.steps.items():
        where = p.ctx.dir(name)
        where.mkdir(parents=True, exist_ok=True)
        marker, text = MARKERS[step.kind]
        (where / marker).parent.mkdir(exist_ok=True)
        (where / marker).write_text(text)
        record = {**p.records[name], "wall_s": (walls or {}).get(name, 60.0)}
        (where / RECORD_FILE).write_text(json.dumps(record))


def states(out: Path, sets: list[str]) -> dict[str, str]:
    """`plan`'s state of each step of the tiny recipe with `sets` (its last line, the time left, aside)."""
    lines = Pipeline(load(TINY, str(out), [*TWO_SEEDS, *sets])).plan()[:-1]
    return dict(line.split(maxsplit=2)[::2] for line in lines)


TEACHERS_CHANGED = "uses teacher-1, which changed; uses teacher-2, which changed"


def test_each_change_marks_exactly_the_steps_downstream_stale_with_the_reason(tmp_path):
    """A test per staleness rule (done when 3 of issue 67): the student's settings, a cleaning rule,
    the back-translation's and the distillation's decoding, each against a pipeline (the tiny
    recipe's: back-translation, two-stage teachers) whose every step finished."""
    out = tmp_path / "out"
    fake_finished(Pipeline(load(TINY, str(out), TWO_SEEDS)))
    assert set(states(out, []).values()) == {"done"}
    cases = {
        "the student's settings": (
            ["student.set=train.eval_every=5"],
            {
                "student": "student.set.train.eval_every 10 -> 5",
                "export": "uses student, which changed",
                "evaluate": "uses export, which changed",
            },
        ),
        "a cleaning rule": (
            ["prepare.max_ratio=2.0"],
            {
                "prepare": "prepare.max_ratio 3.0 -> 2.0",
                "backward": "uses prepare, which changed",
                "bt": "uses backward, which changed",
                "prepare-bt": "uses prepare, which changed; uses bt, which changed",
                **{f"teacher-{n}-bt": "uses prepare-bt, which changed" for n in (1, 2)},
                **{f"teacher-{n}-avg": f"uses teacher-{n}-bt, which changed" for n in (1, 2)},
                **{f"teacher-{n}": f"uses prepare, which changed; uses teacher-{n}-avg, which changed" for n in (1, 2)},
                "distill": "uses teacher-1, which changed; uses teacher-2, which changed",
                "student": "uses distill, which changed; uses teacher-1, which changed",
                "export": "uses student, which changed",
                "evaluate": f"{TEACHERS_CHANGED}; uses export, which changed; uses bt, which changed",
            },
        ),
        "the back-translation's decoding": (
            ["bt.beam=3"],
            {
                "bt": "bt.beam 2 -> 3",
                "prepare-bt": "uses bt, which changed",
                **{f"teacher-{n}-bt": "uses prepare-bt, which changed" for n in (1, 2)},
                **{f"teacher-{n}-avg": f"uses teacher-{n}-bt, which changed" for n in (1, 2)},
                **{f"teacher-{n}": f"uses teacher-{n}-avg, which changed" for n in (1, 2)},
                "distill": "uses teacher-1, which changed; uses teacher-2, which changed",
                "student": "uses distill, which changed; uses teacher-1, which changed",
                "export": "uses student, which changed",
                "evaluate": f"{TEACHERS_CHANGED}; uses export, which changed; uses bt, which changed",
            },
        ),
        "the distillation's decoding": (
            ["distill.beam=4"],
            {
                "distill": "distill.beam 2 -> 4",
                "student": "uses distill, which changed",
                "export": "uses student, which changed",
                "evaluate": "uses export, which changed",
            },
        ),
    }
    for case, (sets, stale) in cases.items():
        plan = states(out, sets)
        assert {name: state for name, state in plan.items() if state != "done"} == {
            name: f"stale ({reason})" for name, reason in stale.items()
        }, case
    # How a step runs is no change: the workers and CPUs of a training.
    sets = [
        "teacher.set=train.num_workers=2",
        "student.set=train.cpus_per_worker=0.5",
        "backward.set=train.min_workers=1",
    ]
    assert set(states(out, sets).values()) == {"done"}


def test_worker_counts_cpus_and_actors_are_in_no_key():
    base = {"src": "en", "tgt": "de", "output": "out", "teacher": {"num_seeds": 2, "set": ["train.max_steps=20"]}}

    def keys(**tables) -> dict[str, str]:
        cfg = from_dict({**base, **tables})
        steps = pipeline_steps(cfg)
        set_keys(steps, cfg.pair)
        return {s.name: s.key for s in steps}

    before = keys()
    resources = ["train.num_workers=1", "train.cpus_per_worker=1", "train.min_workers=1", "train.resize_interval_s=5"]
    for item in resources:
        assert keys(teacher={**base["teacher"], "set": [*base["teacher"]["set"], item]}) == before, item
        assert keys(student={"set": [item]}) == before, item
    # A setting of the results changes the keys, in the same list.
    changed = keys(teacher={**base["teacher"], "set": ["train.max_steps=20", "train.num_workers=1", "model.dropout=0"]})
    assert {n for n in before if before[n] != changed[n]} == set(before) - {"corpus", "prepare"}


def test_an_output_written_by_another_pipeline_is_one_line_before_ray(tmp_path, capsys):
    out = tmp_path / "out"
    Pipeline(load(TINY, str(out))).write_record()
    assert pipeline.main(["plan", TINY, "--output", str(out), "--set", "student.max_steps=3"]) == 0  # the same
    capsys.readouterr()
    for argv in (["--set", "tgt=fr"], ["--set", "src=de", "--set", "tgt=en"]):
        assert pipeline.main(["run", TINY, "--output", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"output={out} holds another pipeline's steps (en-de on the built-in corpus)" in err, err
        assert "--share-output to write there too" in err
    # Another training corpus of the same languages is another pipeline too; the flag lets it write there.
    corpus = tmp_path / "c"
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            (tmp_path / f"c.{split}.{lang}").write_text("a b\n")
    other = [
        "corpora.builtin_mono_size=0",
        *(f"corpora.{split}={corpus}.{split}" for split in ("train", "valid", "test")),
    ]
    with pytest.raises(ValueError, match=f"this config is en-de on {corpus}.train"):
        Pipeline(load(TINY, str(out), other))
    assert Pipeline(load(TINY, str(out), other), share_output=True).plan()[0].startswith("prepare ")
    assert pipeline.main(["plan", TINY, "--output", str(out), "--share-output", "--set", "tgt=fr"]) == 0


def test_plan_gives_the_time_left_from_the_steps_measured(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("plan started Ray"))
    out = tmp_path / "out"
    walls = {"corpus": 1, "prepare": 30, "teacher-1": 600, "teacher-2": 660, "distill": 120}
    plain = [*PLAIN, *TWO_SEEDS]
    fake_finished(Pipeline(load(TINY, str(out), plain)), {**walls, "student": 300, "export": 20, "evaluate": 40})
    t0 = time.perf_counter()
    left = Pipeline(load(TINY, str(out), plain)).plan()[-1]
    assert time.perf_counter() - t0 < 3
    assert left == "time left: none (every step is done)"
    # The student changed: it, the export and the evaluation as they took under their old keys.
    left = Pipeline(load(TINY, str(out), [*plain, "student.max_steps=30"])).plan()[-1]
    assert left == "time left: about 6.0 min for 3 step(s) one after another", left
    # A third seed was never run: it takes what a teacher took here (their mean, 630 s).
    left = Pipeline(load(TINY, str(out), [*PLAIN, "teacher.num_seeds=3"])).plan()[-1]
    assert left.startswith("time left: about 18.5 min for 5 step(s)"), left  # 630 + 120 + 300 + 20 + 40
    assert left.endswith("(teacher-3 as a teacher took here)"), left
    # A step of a kind never run here is named, not guessed.
    for path in (out / "steps").glob("student.*"):
        (path / RECORD_FILE).unlink()
    left = Pipeline(load(TINY, str(out), [*plain, "student.max_steps=30"])).plan()[-1]
    assert left == "time left: about 60 s for 3 step(s) one after another (unknown for student (never measured here))"


def teachers_run(monkeypatch, out: Path, total: dict, cpus_per_worker: str) -> dict[str, dict]:
    """Two teachers of the tiny recipe run by `run_steps` on a cluster of `total` resources, each a
    fake training of 0.3 s; their step.json records."""

    def fake_train(ctx, step):
        time.sleep(0.3)
        (ctx.dir(step.name) / "summary.json").write_text("{}")

    monkeypatch.setitem(KINDS, "teacher", dataclasses.replace(KINDS["teacher"], run=fake_train))
    sets = [*PLAIN, *TWO_SEEDS, f"teacher.set=train.cpus_per_worker={cpus_per_worker}"]
    p = Pipeline(load(TINY, str(out), sets))
    for name in ("teacher-1", "teacher-2"):
        p.ctx.dir(name).mkdir(parents=True)
    ran = p.run_steps(["teacher-1", "teacher-2"], total)  # prepare, not among them, counts as done
    assert sorted(name for name, _ in ran) == ["teacher-1", "teacher-2"]
    return {name: json.loads((p.ctx.dir(name) / RECORD_FILE).read_text()) for name in ("teacher-1", "teacher-2")}


def test_steps_start_together_where_the_cluster_has_room_and_one_at_a_time_where_not(tmp_path, monkeypatch):
    """A teacher takes its worker's CPU and one for its own process (Ray Data, its test set): two fit
    in 4 CPUs, one in 2 (the runner's rule, without Ray; the slow test below runs them on Ray)."""
    one, two = teachers_run(monkeypatch, tmp_path / "four", {"CPU": 4.0}, "1").values()
    assert one["resources"] == two["resources"] == {"CPU": 2.0}
    assert one["started"] < two["ended"] and two["started"] < one["ended"]  # side by side
    one, two = teachers_run(monkeypatch, tmp_path / "two", {"CPU": 2.0}, "1").values()
    assert two["started"] >= one["ended"]  # one after the other
    # By default a training takes every CPU (raymt.cluster.plan: the cluster's, split): alone on 4 too.
    one, two = teachers_run(monkeypatch, tmp_path / "default", {"CPU": 4.0}, "null").values()
    assert one["resources"] == {"CPU": 4.0} and two["started"] >= one["ended"]


def test_a_failed_step_lets_the_running_ones_finish_and_starts_no_other(tmp_path, monkeypatch, capsys):
    def fake_train(ctx, step):
        if step.name == "teacher-1":
            raise ValueError("teacher-1 broke")
        time.sleep(0.5)
        (ctx.dir(step.name) / "summary.json").write_text("{}")

    monkeypatch.setitem(KINDS, "teacher", dataclasses.replace(KINDS["teacher"], run=fake_train))
    p = Pipeline(load(TINY, str(tmp_path / "out"), [*PLAIN, *TWO_SEEDS, "teacher.set=train.cpus_per_worker=1"]))
    for name in ("teacher-1", "teacher-2"):
        p.ctx.dir(name).mkdir(parents=True)
    with pytest.raises(ValueError, match="teacher-1 broke"):
        p.run_steps(["teacher-1", "teacher-2", "distill"], {"CPU": 4.0})
    printed = capsys.readouterr().out
    assert "pipeline: teacher-1 failed: ValueError: teacher-1 broke; waiting for teacher-2 to end" in printed
    assert "pipeline: teacher-2 finished" in printed and "distill starts" not in printed
    assert (p.ctx.dir("teacher-2") / RECORD_FILE).exists() and not (p.ctx.dir("teacher-1") / RECORD_FILE).exists()
    # Workers that the cluster cannot hold: the command's own line, before the step starts.
    p = Pipeline(load(TINY, str(tmp_path / "big"), [*PLAIN, "teacher.set=train.num_workers=8"]))
    with pytest.raises(ValueError, match="train.num_workers=8 x 0.25 CPUs needs 2 CPUs but the cluster's 2 CPUs"):
        p.run_steps(["teacher-1"], {"CPU": 2.0})
    assert "pipeline: teacher-1 failed: ValueError: train.num_workers=8" in capsys.readouterr().out


def test_the_report_has_the_data_funnel_each_steps_cpu_hours_and_a_figure(tmp_path):
    out = tmp_path / "out"
    p = Pipeline(load(TINY, str(out), [*PLAIN, *TWO_SEEDS]))
    fake_finished(p, {"teacher-1": 1800.0})
    dropped = {"empty": 3, "ratio": 7, "duplicate": 0}
    train = {"input_pairs": 400, "num_pairs": 390, "dropped": dropped}
    manifest = {"corpora": [{"name": "en-de", "origin": "real", "train": train}]}
    (p.ctx.dir("prepare") / "manifest.json").write_text(json.dumps(manifest))
    bt = {"done": True, "num_lines": 400, "counts": {"translated": 398, "empty": 2, "invalid": 0}}
    (p.ctx.dir("distill") / "bt.json").write_text(json.dumps(bt))
    record = json.loads((p.ctx.dir("teacher-1") / RECORD_FILE).read_text())
    record["resources"] = {"CPU": 2.0, "GPU": 1.0}
    (p.ctx.dir("teacher-1") / RECORD_FILE).write_text(json.dumps(record))
    row = {"engine": "ctranslate2", "beam": 2, "bleu": 1.0, "chrf": 10.0, "mib": 0.1, "bleu_tok": 1.0}
    row |= {"speed_vs_teacher": 1.0, "bleu_vs_teacher": 0.0}
    rows = [{**row, "model": "teacher-1", "sentences_per_s": 50.0}, {**row, "model": "student", "sentences_per_s": 200}]
    evaluation = {"test": "t", "num_sentences": 30, "engine": "ctranslate2 int8, 1 thread", "rows": rows}
    (p.ctx.dir("evaluate") / "report.json").write_text(json.dumps(evaluation))
    run = {"wall_s": 100.0, "steps_run": ["prepare"], "overhead_s": 4.0}
    report = write_report(p.ctx, out, run)
    assert [(r["step"], r["what"], r["pairs"]) for r in report["funnel"]] == [
        ("prepare", "en-de (real): raw pairs", 400),
        ("prepare", "en-de (real): after empty", 397),
        ("prepare", "en-de (real): after ratio", 390),
        ("prepare", "en-de (real): kept", 390),
        ("distill", "input lines", 400),
        ("distill", "translated pairs", 398),
    ]
    teacher = report["steps"]["teacher-1"]
    assert teacher["cpu_hours"] == 1.0 and teacher["gpu_hours"] == 0.5 and "gpu_hours" not in report["steps"]["prepare"]
    assert json.loads((out / "report.json").read_text()) == report
    md = (out / "report.md").read_text()
    assert "| prepare | en-de (real): after ratio | 390 |" in md and "| teacher-1 | " in md and "4 s of it" in md
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A rerun that ran nothing keeps the last run's times.
    assert write_report(p.ctx, out, None)["run"] == run


def overlap(one: dict, two: dict) -> bool:
    """Whether two step records' (started, ended) intervals overlap."""
    return one["started"] < two["ended"] and two["started"] < one["ended"]


@pytest.mark.slow  # a second Ray head, four tiny trainings: 424 s here (2 cores under a load of ~30)
@pytest.mark.ci
def test_two_teacher_seeds_train_together_on_4_cpus_and_one_after_the_other_on_2(ray_address, tmp_path):
    """Done when 3 of issue 67 (its last part), on Ray: `run teacher-1 teacher-2` (and the steps they use) with
    two seeds of one worker of 1 CPU each, on a local head declaring 4 CPUs and on the session's 2."""
    from conftest import start_head, stop_group

    sets = [arg for item in [*PLAIN, *TWO_SEEDS, "teacher.set=train.cpus_per_worker=1"] for arg in ("--set", item)]
    argv = ["run", "teacher-1", "teacher-2", TINY, *sets]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_TRAIN_ENABLE_PRINT_PATCH="0")
    head, temp_dir = start_head(tmp_path / "head.log", env, num_cpus=4)
    four = tmp_path / "four"
    try:
        address = (temp_dir / "ray_current_cluster").read_text().strip()
        command = [sys.executable, "-m", "raymt.pipeline", *argv, "--output", str(four)]
        done = subprocess.run(
            command, env=dict(env, RAY_ADDRESS=address, PYTHONPATH=str(ROOT)), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        print(done.stdout)
    finally:
        stop_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
    records = {p.name.split(".")[0]: json.loads((p / RECORD_FILE).read_text()) for p in (four / "steps").glob("*.*/")}
    assert set(records) == {"corpus", "prepare", "teacher-1", "teacher-2"}  # what the teachers need
    assert records["teacher-1"]["resources"] == {"CPU": 2.0}
    assert overlap(records["teacher-1"], records["teacher-2"]), records
    two = tmp_path / "two"
    assert pipeline.main([*argv, "--output", str(two)]) == 0
    records = {p.name.split(".")[0]: json.loads((p / RECORD_FILE).read_text()) for p in (two / "steps").glob("*.*/")}
    assert not overlap(records["teacher-1"], records["teacher-2"]), records


def test_run_steps_named_runs_them_and_the_steps_they_use(tmp_path, capsys):
    p = Pipeline(load(TINY, str(tmp_path / "out"), [*PLAIN, *TWO_SEEDS]))
    assert p.needed(["teacher-2"]) == ["corpus", "prepare", "teacher-2"]
    assert p.needed(["teacher-1", "teacher-2"]) == ["corpus", "prepare", "teacher-1", "teacher-2"]
    assert p.needed(["student"]) == ["corpus", "prepare", "teacher-1", "teacher-2", "distill", "student"]
    assert p.needed() == list(p.ctx.steps)
    assert pipeline.main(["run", "teacher-9", TINY, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no step 'teacher-9'; the steps are corpus, prepare" in err, err
    assert not (tmp_path / "out").exists()
