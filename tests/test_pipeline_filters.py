"""`raymt pipeline`'s filters (issue 67, thresholds without labels): [score_filter] (the training
pairs by dual cross-entropy, scorers trained or given, keep_best or calibrate_valid) and
[ce_filter] (the distilled pairs by the backward scorer's cross-entropy): their config's one-line
errors, their steps' keys, plan and show without Ray, and the tiny recipe end to end with both on."""

import json
import shlex
import time
from pathlib import Path

import pytest
from pipeline_cases import BASE, changed, keys
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt.command import parse
from raymt.config import ScoreConfig
from raymt.data.__main__ import PrepareCommand
from raymt.flags import TrainFlags
from raymt.pipeline import __main__ as pipeline
from raymt.pipeline.config import from_dict

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "pipeline-tiny.toml")
ON = {"score_filter": {"enabled": True}, "ce_filter": {"enabled": True}}
FILTERS_ON = ["score_filter.enabled=true", "ce_filter.enabled=true"]


def test_bad_filter_config_is_one_line(tmp_path):
    cases = {
        "two thresholds": (
            {"score_filter": {"keep_best": 0.9, "calibrate_valid": 0.05}},
            "score_filter.keep_best and score_filter.calibrate_valid are two thresholds: set one",
        ),
        "keep_best range": ({"score_filter": {"keep_best": 1.5}}, "score_filter.keep_best=1.5 must be in (0, 1]"),
        "calibrate range": ({"score_filter": {"calibrate_valid": 1}}, "score_filter.calibrate_valid=1.0 must be in"),
        "ce range": ({"ce_filter": {"keep_best": 0}}, "ce_filter.keep_best=0.0 must be in (0, 1]"),
        "a scorer not there": (
            {"scorers": {"backward": str(tmp_path / "nope")}},
            "scorers.backward=" + str(tmp_path / "nope") + ": no such directory",
        ),
        "prepare filters too": (
            {**ON, "prepare": {"keep_best": 0.5}},
            "prepare.keep_best with score_filter.enabled: the score filter sets prepare's threshold",
        ),
        "an unknown field": ({"ce_filter": {"keep": 0.9}}, "[ce_filter] has no field 'keep'; use one of enabled"),
        "a scorer preset": ({"scorers": {"preset": "huge"}}, "scorers.preset: unknown preset 'huge'"),
    }
    for name, (tables, expected) in cases.items():
        with pytest.raises(ValueError) as err:
            from_dict({**BASE, **tables})
        assert expected in str(err.value) and "\n" not in str(err.value), (name, str(err.value))


def test_the_filters_steps_and_what_changes_their_keys():
    off = keys(BASE)
    assert list(off) == ["corpus", "prepare", "teacher-1", "distill", "student", "export", "evaluate"]
    assert keys({**BASE, "scorers": {"max_steps": 5}, "ce_filter": {"keep_best": 0.8}}) == off  # off: no effect
    before = keys({**BASE, **ON})
    assert list(before) == [
        "corpus",
        "prepare-unscored",
        "scorer-fwd",
        "prepare-reverse",
        "scorer-bwd",
        "score",
        "prepare",
        "teacher-1",
        "distill",
        "ce-filter",
        "student",
        "export",
        "evaluate",
    ]
    assert len(set(before.values())) == len(before)
    downstream = {"teacher-1", "distill", "ce-filter", "student", "export", "evaluate"}
    # The threshold: the prepared corpus and what follows, not the scorers nor the scores.
    threshold = keys({**BASE, **ON, "score_filter": {"enabled": True, "keep_best": 0.8}})
    assert changed(before, threshold) == {"prepare", *downstream}
    default = keys({**BASE, **ON, "score_filter": {"enabled": True, "calibrate_valid": 0.05}})
    assert default == before  # calibrate_valid 0.05 is what neither threshold means
    # The scorers' training: both scorers, the scores, and the ce-filter (the backward scorer's).
    scorers = keys({**BASE, **ON, "scorers": {"max_steps": 7}})
    assert changed(before, scorers) == {"scorer-fwd", "scorer-bwd", "score", "prepare", *downstream}
    # The distilled pairs' filter: the student and what follows only.
    ce = keys({**BASE, **ON, "ce_filter": {"enabled": True, "keep_best": 0.9}})
    assert changed(before, ce) == {"ce-filter", "student", "export", "evaluate"}
    # The CE filter alone trains the backward scorer only.
    alone = keys({**BASE, "ce_filter": {"enabled": True}})
    assert list(alone) == [
        "corpus",
        "prepare-reverse",
        "scorer-bwd",
        "prepare",
        "teacher-1",
        "distill",
        "ce-filter",
        "student",
        "export",
        "evaluate",
    ]
    assert alone["prepare"] == off["prepare"] and alone["scorer-bwd"] == before["scorer-bwd"]


def test_given_scorers_train_nothing_and_key_by_their_weights(tmp_path):
    fwd = make_checkpoint(tmp_path / "fwd", seed=0)
    bwd = make_checkpoint(tmp_path / "bwd", seed=1, pair="de-en")
    given = {**BASE, **ON, "scorers": {"forward": str(fwd), "backward": str(bwd)}}
    before = keys(given)
    assert [n for n in before if "scorer" in n or "unscored" in n or "reverse" in n] == []
    make_checkpoint(tmp_path / "bwd", seed=2, pair="de-en")  # other weights in the same directory
    assert changed(before, keys(given)) == {
        "score",
        "prepare",
        "teacher-1",
        "distill",
        "ce-filter",
        "student",
        "export",
        "evaluate",
    }


def test_plan_and_show_the_filter_steps_without_ray(tmp_path, capsys, monkeypatch):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("a dry run started Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    out = tmp_path / "out"
    sets = [arg for item in FILTERS_ON for arg in ("--set", item)]
    assert pipeline.main(["plan", TINY, "--output", str(out), *sets]) == 0
    *lines, time_left = capsys.readouterr().out.splitlines()
    assert time_left.startswith("time left:"), time_left
    names = [line.split()[0] for line in lines]
    filters = ["prepare-unscored", "scorer-fwd", "prepare-reverse", "scorer-bwd", "score", "prepare"]
    assert names[1:7] == filters and names.index("ce-filter") == names.index("distill") + 1, names
    assert all(line.endswith("to do") for line in lines), lines
    shown = {}
    for step in ("prepare-unscored", "prepare-reverse", "scorer-fwd", "scorer-bwd", "score", "prepare", "ce-filter"):
        assert pipeline.main(["show", step, TINY, "--output", str(out), *sets]) == 0
        shown[step] = shlex.split(capsys.readouterr().out.split("  #")[0])
    unscored = parse(PrepareCommand, shown["prepare-unscored"][3:], "raymt data prepare")
    reverse = parse(PrepareCommand, shown["prepare-reverse"][3:], "raymt data prepare")
    assert (reverse.options.src_lang, reverse.options.tgt_lang) == ("de", "en")
    assert unscored.options.calibrate_valid is None and unscored.options.scores is None
    fwd = parse(TrainFlags, shown["scorer-fwd"][2:], "raymt train")
    bwd = parse(TrainFlags, shown["scorer-bwd"][2:], "raymt train")
    assert fwd.corpus == unscored.out and (fwd.src_lang, fwd.tgt_lang) == ("en", "de") and fwd.preset == "tiny"
    assert bwd.corpus == reverse.out and (bwd.src_lang, bwd.tgt_lang) == ("de", "en")
    score = parse(ScoreConfig, shown["score"][3:], "raymt data score")
    assert score.forward.startswith(str(out / "steps" / "scorer-fwd.")) and score.valid.endswith("/valid")
    prepare = parse(PrepareCommand, shown["prepare"][3:], "raymt data prepare")
    assert prepare.options.calibrate_valid == 0.05 and prepare.options.scores == score.output
    ce = parse(ScoreConfig, shown["ce-filter"][3:], "raymt data score")
    # The tiny recipe back-translates: its backward model scores the distilled pairs.
    assert ce.forward is None and ce.backward.startswith(str(out / "steps" / "backward."))
    assert ce.corpus.startswith(str(out / "steps" / "distill.")) and ce.corpus.endswith("/text")
    teacher = parse(TrainFlags, shlex.split(pipeline_show("teacher-1", out, sets, capsys))[2:], "raymt train")
    assert teacher.corpus == prepare.out  # the teachers read the filtered corpus
    assert not out.exists()


def pipeline_show(step: str, out: Path, sets: list[str], capsys) -> str:
    """`show STEP`'s command line."""
    assert pipeline.main(["show", step, TINY, "--output", str(out), *sets]) == 0
    return capsys.readouterr().out.split("  #")[0]


@pytest.mark.slow  # 13 steps, 4 Ray Train runs: 441 s of call here at load ~30 on 2 cores; CI runs it (.ci/run)
@pytest.mark.ci
def test_the_tiny_recipe_with_both_filters_end_to_end(ray_address, tmp_path, capsys):
    """The tiny recipe with [score_filter] and [ce_filter] on: scorers trained, the training pairs
    filtered at the validation-calibrated threshold before the teacher, the distilled pairs at the
    best 95% before the student (funnel.json); a rerun redoes nothing."""
    out = tmp_path / "p"
    argv = ["run", TINY, "--output", str(out), *(arg for item in FILTERS_ON for arg in ("--set", item))]
    assert pipeline.main(argv) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    started = [line.split()[1] for line in printed.splitlines() if line.startswith("pipeline: ") and " starts " in line]
    assert started[:7] == [
        "corpus",
        "prepare-unscored",
        "scorer-fwd",
        "prepare-reverse",
        "scorer-bwd",
        "score",
        "prepare",
    ]
    # Then the tiny recipe's back-translation and two-stage teacher (its 100 monolingual lines of
    # each side: 500 sources distilled), the CE filter before the student.
    bt = ["mono-src", "mono-tgt", "backward", "bt", "prepare-bt", "teacher-1-bt", "teacher-1-avg", "teacher-1"]
    assert started[7:] == [*bt, "distill", "ce-filter", "student", "export", "evaluate"]
    steps = {p.name.split(".")[0]: p for p in (out / "steps").iterdir() if p.is_dir()}
    scored = json.loads((steps["score"] / "valid" / "score.json").read_text())
    assert scored["done"] and scored["num_lines"] == 30  # the validation set, by the same scorers
    manifest = json.loads((steps["prepare"] / "manifest.json").read_text())
    assert manifest["options"]["calibrate_valid"] == 0.05 and manifest["corpora"][0]["train"]["dropped"]["score"] > 0
    funnel = json.loads((steps["ce-filter"] / "funnel.json").read_text())
    # The best 95% of the pairs scored (ties at the threshold kept); a pair the backward model
    # cannot score (empty, or past its length limit: 13 of 500 once here) is dropped.
    num_scored = funnel["scored"]
    assert funnel["pairs"] == 500 and 450 <= num_scored and round(0.95 * num_scored) <= funnel["kept"] < num_scored
    student = json.loads((steps["student"] / "corpus" / "manifest.json").read_text())
    # The student's prepare drops what the filter did not keep: an empty translation (unscored)
    # as empty, before the score rule; every other unkept pair by its score.
    dropped, unscored = student["corpora"][0]["train"]["dropped"], funnel["pairs"] - num_scored
    assert dropped["score"] == num_scored - funnel["kept"] + (unscored - dropped["empty"])
    t0 = time.perf_counter()
    assert pipeline.main(argv) == 0
    again = capsys.readouterr().out
    assert " starts " not in again and "pipeline: 0 step(s) run" in again
    assert time.perf_counter() - t0 < 20
