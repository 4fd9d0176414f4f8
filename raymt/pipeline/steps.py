"""The steps of a pipeline, each an existing command called through its typed config: the built-in
corpus written as files (when no corpus is given) -> prepare (`raymt data prepare`) -> teacher-1..N
(`raymt train` on the prepared corpus) -> distill (the teachers, an ensemble if several, translate
the training sources: `raymt backtranslate --format text`) -> student (`raymt train` on those
pairs with the teachers' tokenizer) -> export (`raymt export --format ctranslate2`, int8 or
float32, whichever is faster) -> evaluate (every model on the test set, one thread).

A step kind (`Kind`) says its version, the command that runs it alone, its end marker, its typed
config, how it runs, what it takes of the cluster (`request`: the runner starts it when that is
free) and what it counts of the data (`funnel`: the report's); `pipeline_steps` lists a config's
steps with the settings and inputs that make their keys (`raymt.pipeline.keys`). A new kind
(monolingual text, back-translation, filters) is one more `Kind` and its place in `pipeline_steps`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from raymt import backtranslate, export, train
from raymt.cluster import data_cpus, plan
from raymt.config import BacktranslateConfig, DecodeOptions, ShardJobOptions
from raymt.data import __main__ as data_command
from raymt.data.builtin import write_builtin
from raymt.data.clean import DROP_RULES
from raymt.data.format import MANIFEST_FILE
from raymt.data.text import read_parallel, resolve
from raymt.engines import load_model_info
from raymt.export import ExportConfig
from raymt.flags import InputFlags, TrainFlags, build_config
from raymt.pipeline.config import PipelineConfig, TrainStage
from raymt.pipeline.keys import STEPS_DIR, Step, file_fingerprint, read_json
from raymt.pipeline.models import ct2_export, fastest_ct2_type, model_row, relative_to, student_config
from raymt.rundir import RUN_CONFIG

SUMMARY = "summary.json"  # raymt train's end marker
EXPORT_RECORD = "export.json"  # the export step's: the weight type chosen and the speeds measured
REPORT = "report.json"  # the evaluation step's
MODEL_DIR = "model"  # the export step's CTranslate2 model, in its directory


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

    def teachers(self) -> list[str]:
        """The teacher steps' names."""
        return [name for name, step in self.steps.items() if step.kind == "teacher"]

    def best(self, name: str) -> str:
        """The best checkpoint of training step `name` (a placeholder until it has finished)."""
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
    """The built-in corpus of the pair as text files (train, valid, test)."""
    c = ctx.cfg.corpora
    write_builtin(ctx.dir(step.name), *ctx.cfg.pair, c.builtin_train_size, c.builtin_eval_size, c.seed)


def prepare_config(ctx: Context, step: Step) -> data_command.PrepareCommand:
    """`raymt data prepare`: the training and validation pairs, the [prepare] options."""
    inputs = InputFlags(train=[ctx.prefix("train")], valid=[ctx.prefix("valid")])
    return data_command.PrepareCommand(out=str(ctx.dir(step.name)), inputs=inputs, options=ctx.cfg.prepare)


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
    if step.kind == "teacher":
        stage: TrainStage = ctx.cfg.teacher
        sets = [*stage.set, f"train.seed={step.settings['teacher.seed']}"]
        corpus, config = str(ctx.dir("prepare")), stage.config
    else:
        stage, sets, corpus, config = ctx.cfg.student, [], None, str(student_config_file(ctx, step))
    return TrainFlags(
        preset=stage.preset if step.kind == "teacher" else None,
        config=config,
        set=sets,
        max_steps=stage.max_steps if step.kind == "teacher" else None,
        max_minutes=stage.max_minutes if step.kind == "teacher" else None,
        corpus=corpus,
        storage_path=str(where.parent),
        name=where.name,
        verbose=ctx.verbose,
    )


def student_config_file(ctx: Context, step: Step) -> Path:
    """The student run's config (written when the step starts): OUT/steps/student.<key>.json."""
    return ctx.out / STEPS_DIR / f"{step.dirname()}.json"


def write_student_config(ctx: Context, step: Step) -> None:
    """The student's config (`raymt.pipeline.models.student_config`, as `raymt distill` builds it):
    the [student] stage on the distilled pairs with the first teacher's tokenizer."""
    stage = ctx.cfg.student
    flags = TrainFlags(
        preset=stage.preset,
        config=stage.config,
        set=list(stage.set),
        max_steps=stage.max_steps,
        max_minutes=stage.max_minutes,
        src_lang=ctx.cfg.src,
        tgt_lang=ctx.cfg.tgt,
    )
    distilled = str(ctx.dir("distill") / "text")
    tokenizer = ctx.best(ctx.teachers()[0])
    generated = ctx.cfg.corpora.builtin
    cfg = student_config(flags, ctx.cfg.pair, distilled, tokenizer, ctx.prefix("valid"), None, generated=generated)
    student_config_file(ctx, step).write_text(json.dumps(cfg.to_dict(), indent=2))


def train_run(ctx: Context, step: Step) -> None:
    """A training step: `raymt train` with its flags, or its run continued (`--resume`) when its
    directory has a run that did not finish."""
    where = ctx.dir(step.name)
    where.parent.mkdir(parents=True, exist_ok=True)
    if step.kind == "student" and not (where / RUN_CONFIG).exists():
        write_student_config(ctx, step)
    flags = train_flags(ctx, step)
    if (where / RUN_CONFIG).exists():
        flags = TrainFlags(resume=str(where), verbose=ctx.verbose)
    gpus = functools.partial(train.count_cluster_gpus, ctx.verbose)
    cfg, resume_dir, init = train.resolve_resume(flags, gpus)
    train.run(cfg, resume_dir, init, verbose=ctx.verbose)


def train_request(ctx: Context, step: Step, total: dict) -> dict:
    """What a training step takes: its workers' CPUs (and GPUs) as `raymt.train.scaling` plans them
    on this cluster, and the CPU its own process works on beside them (Ray Data's preparation, the
    test set's scoring: `raymt.cluster.data_cpus`)."""
    stage: TrainStage = ctx.cfg.teacher if step.kind == "teacher" else ctx.cfg.student
    flags = TrainFlags(preset=stage.preset, config=stage.config, set=list(stage.set), max_steps=stage.max_steps)
    t = build_config(flags, cluster_gpus=lambda: int(total.get("GPU", 0))).train
    workers = plan(t.num_workers, t.use_gpu, t.cpus_per_worker, total=total)
    cpus = workers.cpus * t.num_workers + data_cpus(total.get("CPU", 0))
    return {"CPU": cpus, "GPU": float(workers.gpus * t.num_workers)}


# ---------------------------------------------------------------- the teachers translate


def distill_config(ctx: Context, step: Step) -> BacktranslateConfig:
    """`raymt backtranslate --format text`: the teachers (an ensemble if several) translate the
    training sources at [distill] beam with the first teacher's length penalty."""
    checkpoints = tuple(ctx.best(name) for name in ctx.teachers())
    first = Path(checkpoints[0])
    decode = load_model_info(str(first)).config.decode if first.exists() else DecodeOptions()
    stage = ctx.cfg.distill
    return BacktranslateConfig(
        checkpoint=checkpoints,
        input=ctx.train_sources(),
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
    CTranslate2 at the student's weight type, their ensemble in raymt's engine (several), and the
    student greedy and at [evaluate] beam; report.json (the end marker)."""
    where, beam = ctx.dir(step.name), ctx.cfg.evaluate.beam
    choice = json.loads((ctx.dir("export") / EXPORT_RECORD).read_text())
    dtype, test, tgt = choice["dtype"], ctx.test_pairs(), ctx.cfg.tgt
    teachers = ctx.teachers()
    models: list[tuple[str, Any]] = [
        (name, ct2_export(ctx.best(name), where / f"{name}-ct2", dtype)) for name in teachers
    ]
    if len(teachers) > 1:
        models.append((f"ensemble of {len(teachers)}", [ctx.best(name) for name in teachers]))
    rows = [model_row(name, model, dtype, beam, test, tgt) for name, model in models]
    student = ctx.dir("export") / MODEL_DIR
    rows += [model_row("student", student, dtype, b, test, tgt) for b in dict.fromkeys((1, beam))]
    relative_to(rows, rows[len(models) - 1])  # the model distilled: the ensemble, else the teacher
    report = {"test": ctx.prefix("test"), "num_sentences": len(test[0]), "export": choice, "rows": rows}
    report["engine"] = f"ctranslate2 {dtype}, 1 thread"
    (where / REPORT).write_text(json.dumps(report, indent=2))


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
    "teacher": Kind(1, "train", has(SUMMARY), train_flags, train_run, request=train_request),
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
}


# ---------------------------------------------------------------- the steps of a config


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
    """The steps of `cfg`, in the order they run (each after the steps it uses); keys not yet set."""
    c = cfg.corpora
    corpus = ("corpus",) if c.builtin else ()
    steps = []
    if c.builtin:
        sizes = stage_settings("corpora", c, skip=("train", "valid", "test"))
        steps.append(make("corpus", "corpus", sizes))
    prepare = stage_settings("prepare", cfg.prepare, skip=("src_lang", "tgt_lang"))
    steps.append(make("prepare", "prepare", prepare, corpus_inputs(cfg, ("train", "valid"), ("src", "tgt")), corpus))
    teachers = tuple(f"teacher-{n}" for n in range(1, cfg.teacher.num_seeds + 1))
    teacher = stage_settings("teacher", cfg.teacher, skip=("num_seeds",))
    steps += [make(t, "teacher", {**teacher, "teacher.seed": n}, uses=("prepare",)) for n, t in enumerate(teachers, 1)]
    distill = stage_settings("distill", cfg.distill, skip=("shard_lines",))
    steps.append(make("distill", "distill", distill, corpus_inputs(cfg, ("train",), ("src",)), (*teachers, *corpus)))
    student = stage_settings("student", cfg.student)
    valid = corpus_inputs(cfg, ("valid",), ("src", "tgt"))
    steps.append(make("student", "student", student, valid, ("distill", teachers[0], *corpus)))
    test = corpus_inputs(cfg, ("test",), ("src", "tgt"))
    steps.append(make("export", "export", stage_settings("export", cfg.export), test, ("student", *corpus)))
    evaluate = stage_settings("evaluate", cfg.evaluate)
    steps.append(make("evaluate", "evaluate", evaluate, test, (*teachers, "export", *corpus)))
    return steps
