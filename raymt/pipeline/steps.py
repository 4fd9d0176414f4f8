"""The steps of a pipeline, each an existing command called through its typed config: the built-in
corpus written as files (when no corpus is given) -> prepare (`raymt data prepare`) -> teacher-1..N
(`raymt train` on the prepared corpus) -> distill (the teachers, an ensemble if several, translate
the training sources: `raymt backtranslate --format text`) -> student (`raymt train` on those
pairs with the teachers' tokenizer) -> export (`raymt export --format ctranslate2`, int8 or
float32, whichever is faster) -> evaluate (every model on the test set, one thread).

Here also monolingual text, the backward model, back-translation and the teachers' two stages;
the score filters' kinds are in `raymt.pipeline.filters` (they add themselves to `KINDS`).

A step kind (`Kind`) says its version, the command that runs it alone, its end marker, its typed
config, how it runs, what it takes of the cluster (`request`: the runner starts it when that is
free) and what it counts of the data (`funnel`: the report's); `raymt.pipeline.graph.pipeline_steps`
lists a config's steps with the settings and inputs that make their keys (`raymt.pipeline.keys`).
A new kind is one more `Kind` and its place in `pipeline_steps`.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from raymt import average, backtranslate, export, hf_import, train
from raymt.cluster import data_cpus, plan
from raymt.config import (
    BacktranslateConfig,
    Config,
    CorpusOptions,
    DataConfig,
    DecodeOptions,
    PrepareConfig,
    ShardJobOptions,
    apply_overrides,
)
from raymt.config.corpus import SCORE_KEYS
from raymt.data import __main__ as data_command
from raymt.data import mono_clean
from raymt.data.builtin import write_builtin
from raymt.data.clean import DROP_RULES
from raymt.data.format import MANIFEST_FILE, SPM_FILE
from raymt.data.mono import MONO_FILE
from raymt.data.text import lines as text_lines
from raymt.data.text import read_parallel, resolve
from raymt.engines import load_model_info
from raymt.export import ExportConfig
from raymt.flags import InputFlags, TrainFlags, build_config
from raymt.pipeline.config import PipelineConfig, TrainStage
from raymt.pipeline.keys import STEPS_DIR, Step, read_json
from raymt.pipeline.models import ct2_export, fastest_ct2_type, model_row, relative_to, student_config
from raymt.provenance import AVERAGE_FILE
from raymt.rundir import RUN_CONFIG

SUMMARY = "summary.json"  # raymt train's end marker
EXPORT_RECORD = "export.json"  # the export step's: the weight type chosen and the speeds measured
REPORT = "report.json"  # the evaluation step's
MODEL_DIR = "model"  # the export step's CTranslate2 model, in its directory; an import's or average's checkpoint
IMPORT_RECORD = "import.json"  # an import step's end marker (the checkpoint imported and checked)
# The steps whose checkpoint is MODEL_DIR in their directory (not a training run's best).
MODEL_DIR_KINDS = ("teacher-import", "backward-import", "average")
# The steps whose checkpoint is a teacher the student learns from.
TEACHER_KINDS = ("teacher", "teacher-import")


@dataclass
class Context:
    """What a step needs of the pipeline: its config, OUT, the steps by name (keys set)."""

    cfg: PipelineConfig
    out: Path
    steps: dict[str, Step]
    verbose: bool = False

    def dir(self, name: str) -> Path:
        """The directory of step `name` under its current key."""
        return self.out / STEPS_DIR / self.steps[name].dirname()

    def teachers(self) -> list[tuple[str, str]]:
        """The teachers as (name, checkpoint): [teacher] checkpoints given (teacher-1, ...), else the
        teacher steps' (trained or imported)."""
        given = self.cfg.teacher.checkpoints
        if given:
            return [(f"teacher-{i}", path) for i, path in enumerate(given, 1)]
        return [(name, self.best(name)) for name, step in self.steps.items() if step.kind in TEACHER_KINDS]

    def best(self, name: str) -> str:
        """The best checkpoint of training step `name` (a placeholder until it has finished); an
        import's or an average's checkpoint."""
        if self.steps[name].kind in MODEL_DIR_KINDS:
            return str(self.dir(name) / MODEL_DIR)
        summary = read_json(self.dir(name) / SUMMARY)
        return summary["best_checkpoint"] if summary else str(self.dir(name) / "<best checkpoint>")

    def prefix(self, split: str) -> str:
        """The text prefix of a corpus split: the config's, or the built-in corpus's files."""
        given = getattr(self.cfg.corpora, split)
        return given if given is not None else str(self.dir("corpus") / split)

    def train_sources(self) -> str:
        """The training sources' file (the built-in corpus's is written by its step)."""
        prefix = self.prefix("train")
        return f"{prefix}.{self.cfg.src}" if self.cfg.corpora.builtin else resolve(prefix, self.cfg.src)

    def test_pairs(self) -> tuple[list[str], list[str]]:
        """The test set's sources and references."""
        return read_parallel(self.prefix("test"), *self.cfg.pair)

    def mono_input(self, side: str) -> str:
        """The monolingual text of `side` (src or tgt): the config's, or the built-in corpus's held out."""
        given = getattr(self.cfg.corpora, f"mono_{side}")
        lang = self.cfg.src if side == "src" else self.cfg.tgt
        return given if given is not None else str(self.dir("corpus") / f"mono.{lang}")

    def backward(self) -> str:
        """The backward (tgt->src) model's checkpoint: given, imported or trained."""
        given = self.cfg.backward.checkpoint
        return given if given is not None else self.best("backward")


@dataclass(frozen=True)
class Kind:
    """A step kind: its version (bump it when its results change), the `raymt` command that runs
    it alone (None: the pipeline's own), whether a directory holds its end marker, its typed
    config and how it runs."""

    version: int
    command: Optional[str]
    done: Callable[[Path], bool]
    config: Callable[[Context, Step], Any]
    run: Callable[[Context, Step], None]
    note: str = ""  # what `show` adds to its command line (all it says of a step without one)
    # What the step takes of a cluster of these total resources ({"CPU": 3.0, "GPU": 0.0}); None:
    # all of it (a command that spreads over the cluster: Ray Data, decoding actors by default).
    request: Optional[Callable[[Context, Step, dict], dict]] = None
    # The data it counts, read from its directory: (what, pairs) rows of the report's funnel.
    funnel: Optional[Callable[[Path], list[tuple[str, int]]]] = None


# ---------------------------------------------------------------- the corpus and prepare


def corpus_run(ctx: Context, step: Step) -> None:
    """The built-in corpus of the pair as text files (train, valid, test; mono held out)."""
    c = ctx.cfg.corpora
    sizes = c.builtin_train_size, c.builtin_eval_size, c.seed, c.builtin_mono_size
    write_builtin(ctx.dir(step.name), *ctx.cfg.pair, *sizes)


def prepare_config(ctx: Context, step: Step) -> data_command.PrepareCommand:
    """`raymt data prepare`: the training and validation pairs, the [prepare] options (after the
    score step, with [score_filter]'s threshold on its scores: `score_rule`)."""
    inputs = InputFlags(train=[ctx.prefix("train")], valid=[ctx.prefix("valid")])
    options = score_rule(ctx) if "score" in step.uses else ctx.cfg.prepare
    return data_command.PrepareCommand(out=str(ctx.dir(step.name)), inputs=inputs, options=options)


def prepare_run(ctx: Context, step: Step) -> None:
    """The prepared corpus (`raymt.data.__main__.run`)."""
    ctx.dir(step.name).parent.mkdir(parents=True, exist_ok=True)
    data_command.run(prepare_config(ctx, step))


def prepare_funnel(where: Path) -> list[tuple[str, int]]:
    """Each corpus's raw pairs, the pairs left after each cleaning rule that dropped some (in the
    order they apply: the score filter among them) and those kept, from the manifest."""
    rows = []
    for corpus in (read_json(where / MANIFEST_FILE) or {}).get("corpora", []):
        train, name = corpus["train"], f"{corpus['name']} ({corpus['origin']})"
        left = train["input_pairs"]
        rows.append((f"{name}: raw pairs", left))
        for rule in DROP_RULES:
            if train["dropped"].get(rule):
                left -= train["dropped"][rule]
                rows.append((f"{name}: after {rule}", left))
        rows.append((f"{name}: kept", train["num_pairs"]))
    return rows


# ---------------------------------------------------------------- training: teachers and the student


def train_flags(ctx: Context, step: Step) -> TrainFlags:
    """`raymt train`'s flags of a training step: a run in OUT/steps/<step>.<key>/."""
    where = ctx.dir(step.name)
    if step.kind in ("teacher", "teacher-bt"):
        stage: TrainStage = ctx.cfg.teacher
        max_steps, sized = stage.length()
        sets = [*sized, *stage.set, f"train.seed={step.settings['teacher.seed']}"]
        corpus, config = str(ctx.dir("prepare")), stage.config
    else:
        stage, sets, corpus, config = ctx.cfg.student, [], None, str(student_config_file(ctx, step))
        max_steps = None
    teacher = step.kind != "student"
    return TrainFlags(
        preset=stage.preset if teacher else None,
        config=config,
        set=sets,
        max_steps=max_steps,
        max_minutes=stage.max_minutes if teacher else None,
        corpus=corpus,
        storage_path=str(where.parent),
        name=where.name,
        verbose=ctx.verbose,
    )


def student_config_file(ctx: Context, step: Step) -> Path:
    """The student run's config (written when the step starts): OUT/steps/student.<key>.json."""
    return ctx.out / STEPS_DIR / f"{step.dirname()}.json"


def write_student_config(ctx: Context, step: Step) -> None:
    """The student's config (`raymt.pipeline.models.student_config`): the [student] stage on the
    distilled pairs (mixed with the original ones by [student] mix_original) with the first
    teacher's tokenizer."""
    stage = ctx.cfg.student
    max_steps, sized = stage.length()
    flags = TrainFlags(
        preset=stage.preset,
        config=stage.config,
        set=[*sized, *stage.set],
        max_steps=max_steps,
        max_minutes=stage.max_minutes,
        src_lang=ctx.cfg.src,
        tgt_lang=ctx.cfg.tgt,
    )
    distilled = str(ctx.dir("distill") / "text")
    tokenizer = ctx.teachers()[0][1]
    original, mix = ctx.prefix("train"), stage.mix_original
    generated = ctx.cfg.corpora.builtin
    cfg = student_config(flags, ctx.cfg.pair, distilled, tokenizer, ctx.prefix("valid"), None, original, mix, generated)
    if "ce-filter" in step.uses:
        cfg = ce_filtered(ctx, cfg)
    student_config_file(ctx, step).write_text(json.dumps(cfg.to_dict(), indent=2))


def train_run(ctx: Context, step: Step) -> None:
    """A training step: `raymt train` with its flags, or its run continued (`--resume`) when its
    directory has a run that did not finish."""
    where = ctx.dir(step.name)
    where.parent.mkdir(parents=True, exist_ok=True)
    if step.kind == "student" and not (where / RUN_CONFIG).exists():
        write_student_config(ctx, step)
    flags = KINDS[step.kind].config(ctx, step)
    if (where / RUN_CONFIG).exists():
        flags = TrainFlags(resume=str(where), verbose=ctx.verbose)
    gpus = functools.partial(train.count_cluster_gpus, ctx.verbose)
    cfg, resume_dir, init = train.resolve_resume(flags, gpus)
    train.run(cfg, resume_dir, init, verbose=ctx.verbose)


def train_request(ctx: Context, step: Step, total: dict) -> dict:
    """What a training step takes: its workers' CPUs (and GPUs) as `raymt.train.scaling` plans them
    on this cluster, and the CPU its own process works on beside them (Ray Data's preparation, the
    test set's scoring: `raymt.cluster.data_cpus`)."""
    stages = {"student": ctx.cfg.student, "backward": ctx.cfg.backward, "scorer": ctx.cfg.scorers}
    stage: TrainStage = stages.get(step.kind, ctx.cfg.teacher)
    flags = TrainFlags(preset=stage.preset, config=stage.config, set=list(stage.set), max_steps=stage.max_steps)
    t = build_config(flags, cluster_gpus=lambda: int(total.get("GPU", 0))).train
    workers = plan(t.num_workers, t.use_gpu, t.cpus_per_worker, total=total)
    cpus = workers.cpus * t.num_workers + data_cpus(total.get("CPU", 0))
    return {"CPU": cpus, "GPU": float(workers.gpus * t.num_workers)}


# ---------------------------------------------------------------- the teachers translate


def distill_config(ctx: Context, step: Step) -> BacktranslateConfig:
    """`raymt backtranslate --format text`: the teachers (an ensemble if several) translate the
    training sources at [distill] beam with the first teacher's length penalty."""
    checkpoints = tuple(checkpoint for _, checkpoint in ctx.teachers())
    first = Path(checkpoints[0])
    decode = load_model_info(str(first)).config.decode if first.exists() else DecodeOptions()
    stage = ctx.cfg.distill
    return BacktranslateConfig(
        checkpoint=checkpoints,
        input=distill_input(ctx, step),
        output=str(ctx.dir(step.name)),
        format="text",
        src_lang=ctx.cfg.src,
        tgt_lang=ctx.cfg.tgt,
        decode=DecodeOptions(beam=stage.beam, length_penalty=decode.length_penalty),
        engine=stage.engine,
        shards=ShardJobOptions(shard_lines=stage.shard_lines, verbose=ctx.verbose),
    )


def distill_run(ctx: Context, step: Step) -> None:
    """The distilled pairs (`raymt.backtranslate.run`; `raymt.shard_job.Unfinished` when shards are left)."""
    write_distill_input(ctx, step)
    backtranslate.run(distill_config(ctx, step))


def bt_done(where: Path) -> bool:
    """Whether a back-translation finished (bt.json says done)."""
    info = read_json(where / "bt.json")
    return bool(info and info.get("done"))


def translated_funnel(where: Path) -> list[tuple[str, int]]:
    """The lines a `raymt backtranslate` job read and the pairs it wrote (bt.json's counts)."""
    info = read_json(where / "bt.json") or {}
    if "num_lines" not in info:
        return []
    return [("input lines", info["num_lines"]), ("translated pairs", info["counts"]["translated"])]


# ---------------------------------------------------------------- monolingual text and back-translation


def mono_config(ctx: Context, step: Step) -> mono_clean.MonoConfig:
    """`raymt data mono` of one side's monolingual text ([mono]), without the lines of the
    validation and test sets (`exclude_eval`)."""
    side = step.settings["mono.side"]
    lang = ctx.cfg.src if side == "src" else ctx.cfg.tgt
    exclude = [ctx.prefix("valid"), ctx.prefix("test")] if ctx.cfg.mono.exclude_eval else []
    return ctx.cfg.mono.config(ctx.mono_input(side), str(ctx.dir(step.name)), lang, exclude)


def mono_run(ctx: Context, step: Step) -> None:
    """The monolingual text made ready (`raymt.data.mono_clean.run`; a killed one starts again)."""
    where = ctx.dir(step.name)
    if where.exists() and not (where / MONO_FILE).exists():
        shutil.rmtree(where)  # a killed run's partial output: `raymt data mono` wants a new directory
    where.parent.mkdir(parents=True, exist_ok=True)
    mono_clean.run(mono_config(ctx, step))


def import_config(ctx: Context, step: Step) -> hf_import.ImportConfig:
    """`raymt import` of the teacher's or the backward model's import_from, into MODEL_DIR."""
    stage = ctx.cfg.teacher if step.kind == "teacher-import" else ctx.cfg.backward
    assert stage.import_from is not None, "an import step has a model to import"
    output = str(ctx.dir(step.name) / MODEL_DIR)
    return hf_import.ImportConfig(directory=stage.import_from, output=output, revision=stage.revision)


def import_run(ctx: Context, step: Step) -> None:
    """The model imported, then checked to translate the step's direction (a one-line error
    naming the model's languages otherwise); import.json (the end marker) names it."""
    cfg = import_config(ctx, step)
    shutil.rmtree(cfg.output, ignore_errors=True)  # a killed import's
    hf_import.run(cfg)
    src, tgt = ctx.cfg.pair if step.kind == "teacher-import" else ctx.cfg.pair[::-1]
    check_direction(cfg.output, src, tgt, f"{step.name}: {cfg.directory}")
    (ctx.dir(step.name) / IMPORT_RECORD).write_text(json.dumps({"directory": cfg.directory, "checkpoint": cfg.output}))


def check_direction(checkpoint: str, src: str, tgt: str, what: str) -> None:
    """One line unless the model at `checkpoint` translates src->tgt (`raymt.backtranslate.directions`)."""
    try:
        backtranslate.directions(load_model_info(checkpoint), src, tgt)
    except ValueError as err:
        raise ValueError(f"{what} does not translate {src}->{tgt}: {err}") from None


def backward_flags(ctx: Context, step: Step) -> TrainFlags:
    """`raymt train` of the backward model: the training pairs read reversed (--train TGT-SRC:PREFIX,
    as a run reads any pair of text files), cleaned by [prepare]'s options and tokenized with the
    prepared corpus's vocabulary (a prepared corpus holds one direction's ids); a run in its directory."""
    stage, where = ctx.cfg.backward, ctx.dir(step.name)
    reverse = f"{ctx.cfg.tgt}-{ctx.cfg.src}"
    inputs = InputFlags(train=[f"{reverse}:{ctx.prefix('train')}"], valid=[f"{reverse}:{ctx.prefix('valid')}"])
    tokenizer = f"data.tokenizer={ctx.dir('prepare') / SPM_FILE}"
    max_steps, sized = stage.length()
    return TrainFlags(
        preset=stage.preset,
        config=stage.config,
        set=[*cleaning_sets(ctx.cfg.prepare), tokenizer, *sized, *stage.set],
        max_steps=max_steps,
        max_minutes=stage.max_minutes,
        inputs=inputs,
        storage_path=str(where.parent),
        name=where.name,
        verbose=ctx.verbose,
    )


# [prepare]'s options a run's data section does not take from it: the score filter's, the vocabulary.
NOT_CLEANING = (*SCORE_KEYS, "tokenizer", "bt_tag")


def cleaning_sets(prepare: CorpusOptions) -> list[str]:
    """[prepare]'s cleaning options as `raymt train --set data.FIELD=VALUE` items (those that differ
    from a run's defaults), so a run that prepares its own corpus cleans as the prepare step did."""
    default = DataConfig()
    return [
        f"data.{f.name}={str(value).lower() if isinstance(value, bool) else value}"
        for f in dataclasses.fields(CorpusOptions)
        if f.name not in NOT_CLEANING and (value := getattr(prepare, f.name)) != getattr(default, f.name)
    ]


def bt_config(ctx: Context, step: Step) -> BacktranslateConfig:
    """`raymt backtranslate`: the backward model translates the prepared monolingual target text
    into synthetic sources ([bt]), with its length penalty."""
    checkpoint = ctx.backward()
    decode = load_model_info(checkpoint).config.decode if Path(checkpoint).exists() else DecodeOptions()
    stage = ctx.cfg.bt
    return BacktranslateConfig(
        checkpoint=(checkpoint,),
        input=str(ctx.dir("mono-tgt")),
        output=str(ctx.dir(step.name)),
        format="text",
        src_lang=ctx.cfg.tgt,
        tgt_lang=ctx.cfg.src,
        decode=DecodeOptions(beam=stage.beam, sample=stage.sample, length_penalty=decode.length_penalty),
        noise=stage.noise,
        seed=stage.seed,
        engine=stage.engine,
        shards=ShardJobOptions(shard_lines=stage.shard_lines, verbose=ctx.verbose),
    )


def bt_run(ctx: Context, step: Step) -> None:
    """The back-translated pairs (`raymt.backtranslate.run`, continued from its finished shards)."""
    backtranslate.run(bt_config(ctx, step))


def prepare_bt_config(ctx: Context, step: Step) -> data_command.PrepareCommand:
    """`raymt data prepare` of the training pairs and the back-translated ones (`--bt`, the original
    weighted `--real-weight` [teacher] real_weight) with the prepare step's vocabulary, so stage 2
    continues stage 1's model; without the <BT> tag (that vocabulary has none: stage 2 unlearns the
    synthetic sources' style instead)."""
    pair = f"{ctx.cfg.src}-{ctx.cfg.tgt}"
    inputs = InputFlags(
        train=[ctx.prefix("train")],
        valid=[ctx.prefix("valid")],
        bt=[f"{pair}:{ctx.dir('bt')}"],
        real_weight=ctx.cfg.teacher.real_weight,
    )
    tokenizer = str(ctx.dir("prepare") / SPM_FILE)
    options = dataclasses.replace(ctx.cfg.prepare, tokenizer=tokenizer, bt_tag=False)
    return data_command.PrepareCommand(out=str(ctx.dir(step.name)), inputs=inputs, options=options)


def prepare_bt_run(ctx: Context, step: Step) -> None:
    """The prepared corpus of original and back-translated pairs (`raymt.data.__main__.run`)."""
    data_command.run(prepare_bt_config(ctx, step))


def teacher_flags(ctx: Context, step: Step) -> TrainFlags:
    """`raymt train` of a teacher: on the prepared corpus, or with back-translation on the mixed one
    (stage 1, or one stage); stage 2 from stage 1's average (--init) with [teacher] finetune_*."""
    flags = train_flags(ctx, step)
    if "prepare-bt" in step.uses:
        flags.corpus = str(ctx.dir("prepare-bt"))
    averaged = [name for name in step.uses if ctx.steps[name].kind == "average"]
    if averaged:
        stage = ctx.cfg.teacher
        flags.init = ctx.best(averaged[0])
        flags.set = [*flags.set, *stage.finetune_set]
        flags.max_steps = stage.finetune_max_steps or flags.max_steps
        flags.max_minutes = stage.finetune_max_minutes or flags.max_minutes
    return flags


def average_config(ctx: Context, step: Step) -> average.AverageConfig:
    """`raymt average` of stage 1's last [teacher] average_last checkpoints, into MODEL_DIR."""
    run_dir = str(ctx.dir(step.uses[0]))
    return average.AverageConfig(
        run_dir=run_dir, last=ctx.cfg.teacher.average_last, output=str(ctx.dir(step.name) / MODEL_DIR)
    )


def average_run(ctx: Context, step: Step) -> None:
    """Stage 1's average (`raymt.average.run`; a killed one's output replaced)."""
    cfg = average_config(ctx, step)
    shutil.rmtree(cfg.output, ignore_errors=True)
    average.run(cfg)


def distill_input(ctx: Context, step: Step) -> str:
    """What the teachers translate: the training sources, and with corpora.mono_src its prepared
    text after them (one file, written when the step starts: OUT/steps/distill.<key>.<src>.gz)."""
    if "mono-src" not in step.uses:
        return ctx.train_sources()
    return str(ctx.out / STEPS_DIR / f"{step.dirname()}.{ctx.cfg.src}.gz")


def write_distill_input(ctx: Context, step: Step) -> None:
    """The distill step's input with monolingual sources (`distill_input`), written once and whole
    (a rerun's backtranslate continues on the very file)."""
    target = Path(distill_input(ctx, step))
    if "mono-src" not in step.uses or target.exists():
        return
    mono = mono_clean.MonoResult(str(ctx.dir("mono-src")), read_json(ctx.dir("mono-src") / MONO_FILE) or {})
    tmp = target.with_name(target.name + ".tmp")
    with gzip.open(tmp, "wb") as out:
        for path in (ctx.train_sources(), mono.text):
            out.writelines(line + b"\n" for line in text_lines(path))
    tmp.rename(target)


# ---------------------------------------------------------------- export and evaluation


def export_config(ctx: Context, step: Step, dtype: Optional[str] = None) -> ExportConfig:
    """`raymt export --format ctranslate2` of the student's best checkpoint at `dtype` (default: the
    one chosen, else the first of [export] dtypes)."""
    where = ctx.dir(step.name) / MODEL_DIR
    chosen = read_json(ctx.dir(step.name) / EXPORT_RECORD)
    dtype = dtype or (chosen["dtype"] if chosen else ctx.cfg.export.dtypes[0])
    return ExportConfig(checkpoint=ctx.best("student"), output=str(where), format="ctranslate2", dtype=dtype)


def export_run(ctx: Context, step: Step) -> None:
    """The student in CTranslate2 at the faster weight type of [export] dtypes (timed on the test
    sources at [export] beam); the choice and speeds in export.json (the end marker)."""
    where = ctx.dir(step.name)
    best = ctx.best("student")
    opts = DecodeOptions(beam=ctx.cfg.export.beam)
    dtype, speeds = fastest_ct2_type(best, ctx.test_pairs()[0], opts, ctx.cfg.export.dtypes)
    shutil.rmtree(where / MODEL_DIR, ignore_errors=True)  # a killed export's
    export.run(export_config(ctx, step, dtype))
    choice = {"checkpoint": best, "dtype": dtype, "sentences_per_s": speeds, "beam": opts.beam}
    (where / EXPORT_RECORD).write_text(json.dumps(choice, indent=2))


def evaluate_run(ctx: Context, step: Step) -> None:
    """Every model on the test set, one after another on one thread (`model_row`): each teacher in
    CTranslate2 at the student's weight type, their ensemble in raymt's engine (several), the
    student greedy and at [evaluate] beam, and the backward model (back-translation) tgt->src;
    report.json (the end marker)."""
    where, beam = ctx.dir(step.name), ctx.cfg.evaluate.beam
    choice = json.loads((ctx.dir("export") / EXPORT_RECORD).read_text())
    dtype, test, tgt = choice["dtype"], ctx.test_pairs(), ctx.cfg.tgt
    teachers = ctx.teachers()
    models: list[tuple[str, Any]] = [
        (name, ct2_export(checkpoint, where / f"{name}-ct2", dtype)) for name, checkpoint in teachers
    ]
    if len(teachers) > 1:
        models.append((f"ensemble of {len(teachers)}", [checkpoint for _, checkpoint in teachers]))
    rows = [model_row(name, model, dtype, beam, test, tgt) for name, model in models]
    student = ctx.dir("export") / MODEL_DIR
    rows += [model_row("student", student, dtype, b, test, tgt) for b in dict.fromkeys((1, beam))]
    relative_to(rows, rows[len(models) - 1])  # the model distilled: the ensemble, else the teacher
    if ctx.cfg.back_translates:  # the backward model on the test set read the other way
        backward = ct2_export(ctx.backward(), where / "backward-ct2", dtype)
        name = f"backward ({ctx.cfg.tgt}->{ctx.cfg.src})"
        row = model_row(name, backward, dtype, beam, (test[1], test[0]), ctx.cfg.src)
        rows.append({**row, "speed_vs_teacher": None, "bleu_vs_teacher": None})  # another direction
    report = {"test": ctx.prefix("test"), "num_sentences": len(test[0]), "export": choice, "rows": rows}
    report["engine"] = f"ctranslate2 {dtype}, 1 thread"
    (where / REPORT).write_text(json.dumps(report, indent=2))


IMPORT_NOTE = "then checked to translate the step's direction"


def has(name: str) -> Callable[[Path], bool]:
    """Whether a directory holds the file `name` (a command's end marker)."""
    return lambda where: (where / name).exists()


def no_config(ctx: Context, step: Step) -> None:
    """A step the pipeline runs itself: no command."""
    return None


def one_cpu(ctx: Context, step: Step, total: dict) -> dict:
    """A step of the pipeline's own process on one thread (writing text, timing on one thread)."""
    return {"CPU": 1.0}


KINDS: dict[str, Kind] = {
    "corpus": Kind(
        1,
        None,
        lambda where: any(where.glob("test.*")),
        no_config,
        corpus_run,
        "the built-in corpus as text files",
        request=one_cpu,
    ),
    "prepare": Kind(1, "data prepare", has(MANIFEST_FILE), prepare_config, prepare_run, funnel=prepare_funnel),
    "teacher": Kind(1, "train", has(SUMMARY), teacher_flags, train_run, request=train_request),
    "distill": Kind(1, "backtranslate", bt_done, distill_config, distill_run, funnel=translated_funnel),
    "student": Kind(
        1,
        "train",
        has(SUMMARY),
        train_flags,
        train_run,
        "its --config is written when the step starts",
        request=train_request,
    ),
    "export": Kind(
        1,
        "export",
        has(EXPORT_RECORD),
        export_config,
        export_run,
        "--dtype: the fastest of [export] dtypes, timed",
        request=one_cpu,
    ),
    "evaluate": Kind(
        1, None, has(REPORT), no_config, evaluate_run, "every model on the test set, one thread", request=one_cpu
    ),
    # Monolingual text, the backward model, back-translation and the teachers' two stages.
    "mono": Kind(1, "data mono", has(MONO_FILE), mono_config, mono_run),
    "backward-import": Kind(1, "import", has(IMPORT_RECORD), import_config, import_run, IMPORT_NOTE),
    "teacher-import": Kind(1, "import", has(IMPORT_RECORD), import_config, import_run, IMPORT_NOTE),
    "backward": Kind(1, "train", has(SUMMARY), backward_flags, train_run, request=train_request),
    "bt": Kind(1, "backtranslate", bt_done, bt_config, bt_run, funnel=translated_funnel),
    "prepare-bt": Kind(1, "data prepare", has(MANIFEST_FILE), prepare_bt_config, prepare_bt_run, funnel=prepare_funnel),
    "teacher-bt": Kind(1, "train", has(SUMMARY), teacher_flags, train_run, request=train_request),
    "average": Kind(
        1,
        "average",
        lambda where: (where / MODEL_DIR / AVERAGE_FILE).exists(),
        average_config,
        average_run,
        request=one_cpu,
    ),
}


# ---------------------------------------------------------------- what the filters change in other steps


def score_rule(ctx: Context) -> PrepareConfig:
    """[prepare]'s options with [score_filter]'s threshold on the score step's scores."""
    return dataclasses.replace(ctx.cfg.prepare, scores=str(ctx.dir("score")), **ctx.cfg.score_filter.rule())


def ce_filtered(ctx: Context, cfg: Config) -> Config:
    """The student's config with its distilled pairs filtered by the ce-filter step's scores (its
    prepare's score rule: the best [ce_filter] keep_best)."""
    first, *rest = cfg.data.corpora
    clean = {**first.clean, "keep_best": ctx.cfg.ce_filter.keep_best, "scores": str(ctx.dir("ce-filter"))}
    return apply_overrides(cfg, {"data.corpora": [dataclasses.replace(first, clean=clean), *rest]})
