"""The steps of a pipeline config (`pipeline_steps`), in the order they run, each with the
settings and input fingerprints that make its key (`raymt.pipeline.keys`) and the steps it uses:
the corpus, the score filter's steps, prepare, back-translation's steps, the teachers (one or two
stages), distill, the CE filter, the student, export, evaluate.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Optional

from raymt.checkpoint import weights_file
from raymt.data.mono import input_files
from raymt.data.text import resolve
from raymt.engines import load_model_info, resolve_engine
from raymt.pipeline.config import PipelineConfig, TrainStage
from raymt.pipeline.filters import SCORER_STEPS
from raymt.pipeline.keys import Step, file_fingerprint
from raymt.pipeline.steps import KINDS, check_direction


def file_hash(path: Optional[str]) -> Optional[str]:
    """sha256 of a small settings file (a train config), None without one."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def stage_settings(name: str, stage: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A stage's fields as flat settings ("teacher.preset"), a config file by its content."""
    out = {f"{name}.{k}": v for k, v in dataclasses.asdict(stage).items() if k not in skip}
    if isinstance(stage, TrainStage):
        out[f"{name}.config"] = file_hash(stage.config)
    return out


def corpus_inputs(cfg: PipelineConfig, splits: tuple[str, ...], sides: tuple[str, ...]) -> dict[str, dict]:
    """The fingerprints of the given corpora's files ("corpora.train.en")."""
    c = cfg.corpora
    if c.builtin:
        return {}
    lang = {"src": cfg.src, "tgt": cfg.tgt}
    return {
        f"corpora.{split}.{lang[side]}": file_fingerprint(resolve(getattr(c, split), lang[side]))
        for split in splits
        for side in sides
    }


def make(name: str, kind: str, settings: dict, inputs: Optional[dict] = None, uses: tuple[str, ...] = ()) -> Step:
    """A step of kind `kind` at its current version."""
    return Step(name, kind, KINDS[kind].version, settings, inputs or {}, uses)


def pipeline_steps(cfg: PipelineConfig) -> list[Step]:
    """The steps of `cfg`, in the order they run (each after the steps it uses); keys not yet set.
    Without a step that uses it (given or imported teachers), no prepare step."""
    c = cfg.corpora
    corpus = ("corpus",) if c.builtin else ()
    steps = import_steps(cfg)  # first: a model without the pair is one line before Ray starts
    given = given_teachers(cfg)  # also first: their languages checked
    if c.builtin:
        sizes = stage_settings("corpora", c, skip=("train", "valid", "test", *MONO_FIELDS))
        sizes.update({"corpora.builtin_mono_size": c.builtin_mono_size} if c.builtin_mono_size else {})
        steps.append(make("corpus", "corpus", sizes))
    prepare = stage_settings("prepare", cfg.prepare, skip=("src_lang", "tgt_lang"))
    steps += scorer_steps(cfg, prepare, corpus)  # none without a score filter
    prepare, scored_uses = filtered_prepare(cfg, prepare)
    pairs = corpus_inputs(cfg, ("train", "valid"), ("src", "tgt"))
    steps.append(make("prepare", "prepare", prepare, pairs, (*scored_uses, *corpus)))
    steps += bt_steps(cfg, corpus)
    teachers = () if given else tuple(f"teacher-{n}" for n in range(1, cfg.teacher.num_seeds + 1))
    if cfg.teacher.trained:
        steps += teacher_steps(cfg, teachers)
    distill = stage_settings("distill", cfg.distill, skip=("shard_lines",))
    mono_src = ("mono-src",) if c.has_mono("src") else ()
    uses = (*teachers, *corpus, *mono_src)
    steps.append(make("distill", "distill", distill, {**corpus_inputs(cfg, ("train",), ("src",)), **given}, uses))
    ce = ce_filter_steps(cfg)
    steps += ce
    steps.append(student_step(cfg, teachers[:1], dict(list(given.items())[:1]), corpus, ce))
    test = corpus_inputs(cfg, ("test",), ("src", "tgt"))
    steps.append(make("export", "export", stage_settings("export", cfg.export), test, ("student", *corpus)))
    evaluate = stage_settings("evaluate", cfg.evaluate)
    backward = ("bt",) if cfg.back_translates else ()  # its key holds the backward model's (evaluated too)
    steps.append(make("evaluate", "evaluate", evaluate, {**test, **given}, (*teachers, "export", *corpus, *backward)))
    return [s for s in steps if s.name != "prepare" or any("prepare" in t.uses for t in steps)]


def student_step(
    cfg: PipelineConfig, teacher: tuple[str, ...], given: dict, corpus: tuple[str, ...], ce: list[Step]
) -> Step:
    """The student: [student] (mix_original in its key when set: a pipeline of before has none), the
    validation pairs, the first teacher (its tokenizer), and the training pairs when it mixes them."""
    settings = stage_settings("student", cfg.student, skip=() if cfg.student.mix_original else ("mix_original",))
    inputs = corpus_inputs(cfg, ("valid", *("train",) * bool(cfg.student.mix_original)), ("src", "tgt"))
    uses = ("distill", *teacher, *corpus, *(s.name for s in ce))
    return make("student", "student", settings, {**inputs, **given}, uses)


def given_teachers(cfg: PipelineConfig) -> dict[str, dict]:
    """The fingerprints of [teacher] checkpoints' weights files ("teacher.checkpoints.1"), each checked
    to translate src->tgt and all to decode as one ensemble (one line each, before Ray starts)."""
    given = cfg.teacher.checkpoints
    if not given:
        return {}
    for path in given:
        check_direction(path, cfg.src, cfg.tgt, f"teacher.checkpoints: {path}")
    try:
        info = load_model_info(list(given))  # `check_ensemble`: one tokenizer, one set of languages
        resolve_engine(cfg.distill.engine, info)  # several on distill.engine ctranslate2: no ensembles there
    except ValueError as err:
        raise ValueError(f"teacher.checkpoints: {err}") from None
    return {f"teacher.checkpoints.{i}": file_fingerprint(str(weights_file(p))) for i, p in enumerate(given, 1)}


# ---------------------------------------------------------------- the steps of back-translation and the teachers

# [corpora]'s monolingual text: the mono steps' inputs, not the built-in corpus's settings.
MONO_FIELDS = ("mono_src", "mono_tgt", "builtin_mono_size")
# [teacher]'s fields that only some teacher steps use (none of them a plain teacher's).
TEACHER_BT = ("stages", "real_weight", "average_last", "finetune_max_steps", "finetune_max_minutes")
TEACHER_ONLY = ("num_seeds", "import_from", "revision", "checkpoints", "finetune_set", *TEACHER_BT)


def mono_fingerprints(spec: str, name: str) -> dict[str, dict]:
    """The fingerprints of the files of monolingual text `spec` (as `raymt data mono` lists them)."""
    files = input_files(spec, name)
    return {f"{name}:{f.path}" if len(files) > 1 else name: {"size": f.size, "mtime_ns": f.mtime_ns} for f in files}


def import_steps(cfg: PipelineConfig) -> list[Step]:
    """The imports (`raymt import`): the teacher's, the backward model's (when it back-translates)."""
    steps = []
    for name, kind, stage in (
        ("teacher-1", "teacher-import", cfg.teacher),
        ("backward", "backward-import", cfg.backward),
    ):
        if stage.import_from is not None and (kind == "teacher-import" or cfg.back_translates):
            settings = {f"{stage.STAGE}.import_from": stage.import_from, f"{stage.STAGE}.revision": stage.revision}
            steps.append(make(name, kind, settings))
    return steps


def bt_steps(cfg: PipelineConfig, corpus: tuple[str, ...]) -> list[Step]:
    """mono-src and mono-tgt (`raymt data mono` of each side given), then, when the teachers learn
    from back-translation, the backward model (trained; a checkpoint given is checked here), bt and
    prepare-bt (the original and back-translated pairs prepared together)."""
    c, steps = cfg.corpora, []
    valid_test = corpus_inputs(cfg, ("valid", "test"), ("src", "tgt")) if cfg.mono.exclude_eval else {}
    for side in ("src", "tgt"):
        if c.has_mono(side):
            given = getattr(c, f"mono_{side}")
            inputs = {**valid_test, **(mono_fingerprints(given, f"corpora.mono_{side}") if given else {})}
            settings = {"mono.side": side, **stage_settings("mono", cfg.mono)}
            steps.append(make(f"mono-{side}", "mono", settings, inputs, corpus))
    if not cfg.back_translates:
        return steps
    b, inputs, backward = cfg.backward, {}, ()
    if b.trained:
        settings = stage_settings("backward", b, skip=("checkpoint", "import_from", "revision"))
        pairs = corpus_inputs(cfg, ("train", "valid"), ("src", "tgt"))
        steps.append(make("backward", "backward", settings, pairs, ("prepare", *corpus)))
        backward = ("backward",)
    elif b.checkpoint is not None:
        check_direction(b.checkpoint, cfg.tgt, cfg.src, f"backward.checkpoint={b.checkpoint}")
        inputs = {"backward.checkpoint": file_fingerprint(str(weights_file(b.checkpoint)))}
    else:
        backward = ("backward",)  # imported: `import_steps`
    steps.append(make("bt", "bt", stage_settings("bt", cfg.bt, skip=("shard_lines",)), inputs, ("mono-tgt", *backward)))
    weight = {"teacher.real_weight": cfg.teacher.real_weight}
    pairs = corpus_inputs(cfg, ("train", "valid"), ("src", "tgt"))
    steps.append(make("prepare-bt", "prepare-bt", weight, pairs, ("prepare", "bt", *corpus)))
    return steps


def teacher_steps(cfg: PipelineConfig, teachers: tuple[str, ...]) -> list[Step]:
    """teacher-1..N on the prepared corpus; with back-translation on the mixed one (one stage), or
    teacher-N-bt on it, teacher-N-avg its average and teacher-N on the original pairs from it (two)."""
    stage, steps = cfg.teacher, []
    plain = stage_settings("teacher", stage, skip=TEACHER_ONLY)
    for n, name in enumerate(teachers, 1):
        seed = {**plain, "teacher.seed": n}
        if not cfg.back_translates:
            steps.append(make(name, "teacher", seed, uses=("prepare",)))
        elif stage.stages == 1:
            steps.append(make(name, "teacher", seed, uses=("prepare-bt",)))
        else:
            last = {"teacher.average_last": stage.average_last}
            finetune = {
                f"teacher.{k}": getattr(stage, k)
                for k in ("finetune_set", "finetune_max_steps", "finetune_max_minutes")
            }
            steps.append(make(f"{name}-bt", "teacher-bt", seed, uses=("prepare-bt",)))
            steps.append(make(f"{name}-avg", "average", last, uses=(f"{name}-bt",)))
            steps.append(make(name, "teacher", {**seed, **finetune}, uses=("prepare", f"{name}-avg")))
    return steps


# ---------------------------------------------------------------- the steps of the score filters


def given_scorers(cfg: PipelineConfig, sides: tuple[str, ...]) -> tuple[dict, dict]:
    """The settings ("scorers.forward": its path) and input fingerprints (its weights file) of the
    scorers of `sides` that [scorers] gives."""
    settings, inputs = {}, {}
    for side in sides:
        given = getattr(cfg.scorers, side)
        if given is not None:
            settings[f"scorers.{side}"] = given
            inputs[f"scorers.{side}"] = file_fingerprint(str(weights_file(given)))
    return settings, inputs


def scorer_steps(cfg: PipelineConfig, prepare: dict, corpus: tuple[str, ...]) -> list[Step]:
    """The steps before the score filter's `prepare`: the scorers not given (prepare-unscored and
    scorer-fwd; prepare-reverse and scorer-bwd, the latter for [ce_filter] too) and the score step."""
    on, sc, steps = cfg.score_filter.enabled, cfg.scorers, []
    pairs = corpus_inputs(cfg, ("train", "valid"), ("src", "tgt"))
    train = stage_settings("scorers", sc, skip=("forward", "backward"))
    if on and sc.forward is None:
        steps.append(make("prepare-unscored", "prepare", prepare, pairs, corpus))
        steps.append(make(SCORER_STEPS["forward"], "scorer", train, uses=("prepare-unscored",)))
    # The CE filter of a pipeline that back-translates scores by its backward model (`ce_backward`).
    if (on or (cfg.ce_filter.enabled and not cfg.back_translates)) and sc.backward is None:
        steps.append(make("prepare-reverse", "prepare-reverse", prepare, pairs, corpus))
        steps.append(make(SCORER_STEPS["backward"], "scorer", train, uses=("prepare-reverse",)))
    if on:
        settings, given = given_scorers(cfg, ("forward", "backward"))
        trained = tuple(s.name for s in steps if s.kind == "scorer")
        steps.append(make("score", "score", settings, {**pairs, **given}, (*trained, *corpus)))
    return steps


def filtered_prepare(cfg: PipelineConfig, prepare: dict) -> tuple[dict, tuple[str, ...]]:
    """`prepare`'s settings and the steps it uses beside the corpus: with [score_filter] on, its
    threshold and the score step."""
    if not cfg.score_filter.enabled:
        return prepare, ()
    rule = {f"score_filter.{k}": v for k, v in cfg.score_filter.rule().items()}
    return {**prepare, **rule}, ("score",)


def ce_filter_steps(cfg: PipelineConfig) -> list[Step]:
    """ce-filter (with [ce_filter] on): the distilled pairs scored by the backward model
    (`ce_backward`)."""
    if not cfg.ce_filter.enabled:
        return []
    settings, given = given_scorers(cfg, ("backward",))
    uses: tuple[str, ...] = ()
    if cfg.scorers.backward is None and not cfg.back_translates:
        uses = (SCORER_STEPS["backward"],)
    elif cfg.scorers.backward is None and cfg.backward.checkpoint is not None:
        given = {"backward.checkpoint": file_fingerprint(str(weights_file(cfg.backward.checkpoint)))}
    elif cfg.scorers.backward is None:
        uses = ("backward",)  # trained or imported
    settings["ce_filter.keep_best"] = cfg.ce_filter.keep_best
    return [make("ce-filter", "ce-filter", settings, given, ("distill", *uses))]
