"""`raymt pipeline`'s back-translation (issue 67, item 2): monolingual text (`raymt data mono`), the
backward model (trained on the pairs reversed, a checkpoint or imported), bt, prepare-bt and the
teachers' two stages: their config's one-line errors before Ray, their keys (a setting makes exactly
the steps downstream stale) and each step's command line, which parses back to its typed config.
The whole chain runs in tests/test_pipeline.py (recipes/pipeline-tiny.toml)."""

import shlex
from pathlib import Path

import pytest
from pipeline_cases import BASE, TINY_STEPS, changed, keys
from tiny_checkpoint import make_checkpoint, one_thread, write_pairs  # noqa: F401 (autouse fixture)

from raymt.average import AverageConfig
from raymt.command import parse
from raymt.config import BacktranslateConfig
from raymt.data.__main__ import PrepareCommand
from raymt.data.builtin import builtin_splits, write_builtin
from raymt.data.mono_clean import MonoConfig
from raymt.flags import TrainFlags
from raymt.hf_import import ImportConfig
from raymt.pipeline import __main__ as pipeline
from raymt.pipeline.config import from_dict, load
from raymt.pipeline.graph import pipeline_steps
from raymt.pipeline.runner import Pipeline

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "pipeline-tiny.toml")
BT_CPU = str(ROOT / "recipes" / "pipeline-multi30k-bt-cpu.toml")
MONO = {**BASE, "corpora": {"builtin_mono_size": 20}}


def test_the_steps_of_back_translation_one_stage_two_stages_and_an_imported_teacher():
    assert list(keys(MONO)) == TINY_STEPS
    two = keys({**MONO, "teacher": {"num_seeds": 2, "stages": 1}})
    assert [n for n in two if n.startswith("teacher")] == ["teacher-1", "teacher-2"]  # one stage: on the mix
    # Source text only: translated by the teachers, no backward model.
    src_only = keys({**BASE, "corpora": {"builtin_mono_size": 0}})
    assert "mono-src" not in src_only and "bt" not in src_only
    # Without monolingual text the steps and keys are the pipeline's without back-translation.
    assert list(keys(BASE)) == ["corpus", "prepare", "teacher-1", "distill", "student", "export", "evaluate"]


def test_a_bt_setting_changes_exactly_the_keys_downstream():
    before = keys(MONO)
    bt_side = {"bt", "prepare-bt", "teacher-1-bt", "teacher-1-avg", "teacher-1", "distill", "student"}
    downstream = bt_side | {"export", "evaluate"}
    # The back-translation's decoding (issue 67, Done when 3).
    assert changed(before, keys({**MONO, "bt": {"beam": 3}})) == downstream
    assert changed(before, keys({**MONO, "bt": {"sample": True}})) == downstream
    assert keys({**MONO, "bt": {"shard_lines": 7}}) == before  # the restart unit: no result changes
    # The backward model's training.
    assert changed(before, keys({**MONO, "backward": {"max_steps": 5}})) == downstream | {"backward"}
    # [mono]: both sides' text; the source side reaches the distillation only.
    assert changed(before, keys({**MONO, "mono": {"max_lines": 10}})) == downstream | {"mono-src", "mono-tgt"}
    # The mix's weight: prepare-bt and what trains on it, not the backward model or bt.
    assert changed(before, keys({**MONO, "teacher": {"real_weight": 2.0}})) == downstream - {"bt"}
    # Stage 2's own settings: stage 2 and what follows, not stage 1 or its average.
    stage2 = {"teacher-1", "distill", "student", "export", "evaluate"}
    assert changed(before, keys({**MONO, "teacher": {"finetune_set": ["optim.lr=1e-4"]}})) == stage2
    assert changed(before, keys({**MONO, "teacher": {"average_last": 2}})) == stage2 | {"teacher-1-avg"}
    # The teacher's settings: both stages.
    assert changed(before, keys({**MONO, "teacher": {"max_steps": 9}})) == stage2 | {"teacher-1-bt", "teacher-1-avg"}
    assert keys(MONO) == before  # reverted: the old keys


def test_bad_back_translation_settings_are_one_line_before_ray(tmp_path, capsys):
    forward = make_checkpoint(tmp_path / "en-de")  # translates en->de: no backward model
    cases = {
        "mono with given corpora": (
            {"corpora": {"builtin_mono_size": 5, "mono_tgt": str(tmp_path)}},
            "corpora.builtin_mono_size holds text out of the built-in corpus",
        ),
        "a missing mono file": ({"corpora": {"mono_tgt": str(tmp_path / "nope.de")}}, "corpora.mono_tgt="),
        "a bad mono option": ({"corpora": {"builtin_mono_size": 5}, "mono": {"max_lines": 0}}, "[mono]: --max-lines 0"),
        "three stages": ({"teacher": {"stages": 3}}, "teacher.stages=3: 1 or 2"),
        "sample and noise": ({"bt": {"sample": True, "noise": True}}, "bt.sample and bt.noise"),
        "two backward models": (
            {"backward": {"checkpoint": str(forward), "import_from": "a/b"}},
            "backward.checkpoint and backward.import_from both",
        ),
        "no such checkpoint": ({"backward": {"checkpoint": str(tmp_path / "no")}}, "backward.checkpoint="),
        "no such import": ({"backward": {"import_from": str(tmp_path / "x" / "y" / "z")}}, "no such directory, nor"),
        "imported teacher and bt": (
            {"corpora": {"builtin_mono_size": 5}, "teacher": {"import_from": "org/name"}},
            "teacher.import_from imports the teacher",
        ),
        "imported teachers": ({"teacher": {"import_from": "org/name", "num_seeds": 2}}, "an imported teacher is one"),
        "a backward model the other way": (
            {"corpora": {"builtin_mono_size": 5}, "backward": {"checkpoint": str(forward)}},
            "backward.checkpoint=",
        ),
    }
    for name, (tables, expected) in cases.items():
        with pytest.raises(ValueError) as err:
            pipeline_steps(from_dict({**BASE, **tables}))
        assert expected in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
    out = tmp_path / "o"
    argv = ["plan", TINY, "--output", str(out), "--set", f"backward.checkpoint={forward}"]
    assert pipeline.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not translate de->en" in err, err
    assert not out.exists()


def test_a_backward_checkpoint_given_is_an_input_of_bt(tmp_path):
    backward = make_checkpoint(tmp_path / "de-en", pair="de-en")
    data = {**MONO, "backward": {"checkpoint": str(backward)}}
    before = keys(data)
    assert "backward" not in before and "bt" in before
    (backward / "model.pt").write_bytes((backward / "model.pt").read_bytes() + b"\0")  # another model there
    assert (
        changed(before, keys(data)) >= {"bt", "prepare-bt", "teacher-1"}
        and before["mono-tgt"] == keys(data)["mono-tgt"]
    )


def test_show_gives_each_new_steps_command_which_parses_back(tmp_path, capsys):
    out = tmp_path / "out"
    shown = {}
    steps = ("mono-tgt", "backward", "bt", "prepare-bt", "teacher-1-bt", "teacher-1-avg", "teacher-1", "distill")
    for step in steps:
        assert pipeline.main(["show", step, TINY, "--output", str(out)]) == 0
        shown[step] = shlex.split(capsys.readouterr().out.split("  #")[0])
    assert not out.exists()  # a dry run
    mono = parse(MonoConfig, shown["mono-tgt"][3:], "raymt data mono")
    assert mono.lang == "de" and mono.input[0].endswith("/mono.de") and len(mono.exclude) == 2
    backward = parse(TrainFlags, shown["backward"][2:], "raymt train")
    assert backward.inputs.train[0].startswith("de-en:") and backward.inputs.valid[0].startswith("de-en:")
    assert any(s.startswith("data.tokenizer=") and s.endswith("/spm.model") for s in backward.set)
    assert "data.copy=false" in backward.set  # the built-in corpus: [prepare]'s rules off, so the run's too
    bt = parse(BacktranslateConfig, shown["bt"][2:], "raymt backtranslate")
    assert (bt.src_lang, bt.tgt_lang, bt.decode.beam) == ("de", "en", 2) and bt.input == mono.output
    assert bt.checkpoint[0].startswith(backward.storage_path + "/" + backward.name)
    prepared = parse(PrepareCommand, shown["prepare-bt"][3:], "raymt data prepare")
    assert prepared.inputs.bt == [f"en-de:{bt.output}"] and prepared.inputs.real_weight == 1.0
    assert prepared.options.tokenizer.endswith("/spm.model") and not prepared.options.bt_tag
    stage1 = parse(TrainFlags, shown["teacher-1-bt"][2:], "raymt train")
    assert stage1.corpus == prepared.out and stage1.init is None
    avg = parse(AverageConfig, shown["teacher-1-avg"][2:], "raymt average")
    assert avg.run_dir == f"{stage1.storage_path}/{stage1.name}" and avg.last == 1
    stage2 = parse(TrainFlags, shown["teacher-1"][2:], "raymt train")
    assert stage2.init == avg.output and stage2.corpus.split("/")[-1].startswith("prepare.")
    distill = parse(BacktranslateConfig, shown["distill"][2:], "raymt backtranslate")
    assert distill.input.endswith(".en.gz")  # the training sources, then the English text


def test_imports_come_first_and_show_their_command(tmp_path):
    hf = tmp_path / "opus-mt-de-en"
    hf.mkdir()
    cfg = from_dict({**MONO, "output": str(tmp_path / "o"), "backward": {"import_from": str(hf)}})
    pipe = Pipeline(cfg)
    assert list(pipe.ctx.steps)[:2] == ["backward", "corpus"]  # before anything starts Ray
    line = pipe.command("backward")
    imported = parse(ImportConfig, shlex.split(line.split("  #")[0])[2:], "raymt import")
    assert imported.directory == str(hf) and imported.output.endswith("/model") and imported.src_lang is None
    teacher = Pipeline(from_dict({**BASE, "output": str(tmp_path / "t"), "teacher": {"import_from": "org/name"}}))
    assert teacher.ctx.steps["teacher-1"].kind == "teacher-import"
    assert [name for name, _ in teacher.ctx.teachers()] == ["teacher-1"]
    assert "prepare" not in teacher.ctx.steps  # nothing uses it: the teacher is imported


def test_the_built_in_corpus_holds_out_monolingual_text_and_keeps_its_training_pairs(tmp_path):
    write_builtin(tmp_path / "c", "en", "de", 50, 5, 1, mono_size=10)
    read = {name: (tmp_path / "c" / name).read_text().splitlines() for name in ("train.en", "mono.en", "mono.de")}
    assert read["train.en"] == builtin_splits("en", "de", 50, 5, 1)["train"][0]  # as without mono text
    assert len(read["mono.en"]) == len(read["mono.de"]) == 10
    assert not set(read["mono.en"]) & set(read["train.en"])


def test_the_multi30k_bt_recipe_plans(tmp_path, capsys):
    data = tmp_path / "halves"
    data.mkdir()
    for name in ("train-a", "train-b", "val", "test"):
        write_pairs(data / name, 20, seed=len(name))
    sets = [f"corpora.{k}={data / v}" for k, v in (("train", "train-a"), ("valid", "val"), ("test", "test"))]
    sets += [f"corpora.mono_src={data / 'train-b.en'}", f"corpora.mono_tgt={data / 'train-b.de'}"]
    cfg = load(BT_CPU, str(tmp_path / "o"), sets)
    assert cfg.back_translates and cfg.teacher.stages == 2
    lines = Pipeline(cfg).plan()[:-1]  # the last line: the time left
    assert [line.split()[0] for line in lines][:6] == [
        "prepare",
        "mono-src",
        "mono-tgt",
        "backward",
        "bt",
        "prepare-bt",
    ]
    assert all(line.endswith("to do") for line in lines)


@pytest.mark.slow  # 40 s on a loaded 2-core host (transformers, two tiny OPUS-MT models); CI runs it
@pytest.mark.ci
def test_an_imported_backward_model_without_the_languages_is_one_line_and_one_with_them_is_used(tmp_path):
    """The import step (first in the pipeline, so before Ray) checks the model's direction."""
    pytest.importorskip("transformers")
    from hf_models import save_opus_mt

    from raymt.pipeline.steps import KINDS

    for langs, ok in ((("en", "de"), False), (("de", "en"), True)):
        hf = save_opus_mt(tmp_path / "hf" / f"opus-mt-{'-'.join(langs)}", langs=langs)
        pipe = Pipeline(
            from_dict({**MONO, "output": str(tmp_path / "-".join(langs)), "backward": {"import_from": str(hf)}})
        )
        step = pipe.ctx.steps["backward"]
        if not ok:
            with pytest.raises(ValueError) as err:
                KINDS[step.kind].run(pipe.ctx, step)
            assert "does not translate de->en" in str(err.value) and "\n" not in str(err.value), str(err.value)
            assert not KINDS[step.kind].done(pipe.ctx.dir("backward"))
            continue
        KINDS[step.kind].run(pipe.ctx, step)
        assert KINDS[step.kind].done(pipe.ctx.dir("backward")) and pipe.state("backward").state == "done"
        bt = pipe.ctx.steps["bt"]
        assert KINDS["bt"].config(pipe.ctx, bt).checkpoint == (str(pipe.ctx.dir("backward") / "model"),)
