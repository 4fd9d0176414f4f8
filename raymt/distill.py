"""`raymt distill`: a small, fast student from a teacher or an ensemble of teachers, by
sequence-level knowledge distillation (Kim & Rush 2016): the student learns the teachers'
beam-search translations of the training sources instead of the references.

Four steps, each an existing command that the docs show on its own (docs/distill.md):

1. translate: the teachers translate the training corpus's source side with beam search on Ray
   actors (`raymt backtranslate --format text`: every line exactly once, restartable) into
   OUT/teacher/ (text.SRC, text.TGT: the distilled pairs, kept);
2. train: the student trains on them, optionally mixed with the original pairs
   (`--mix-original`), with the teacher's tokenizer (data.tokenizer), on Ray Train: `raymt train
   --config OUT/student.json --storage-path OUT --name student`, the config written here;
3. export: its best checkpoint to CTranslate2 (OUT/student-ct2), stored int8 or float32,
   whichever translates faster on one thread (measured here);
4. compare: teacher and student side by side on the test set, on one thread of CTranslate2:
   BLEU, chrF, size and sentences/s (OUT/report.json).

Killed, the same command goes on: step 1 from its finished shards, step 2 from the student's
latest checkpoint, steps 3 and 4 again. OUT/distill.json records the settings; another
command's settings are refused there. Without --train the built-in corpus of the pair is
written to OUT/builtin/ and distilled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raymt import backtranslate, train
from raymt.cluster import check_ray_address
from raymt.command import command_line, flag, parse
from raymt.config import PRESETS, BacktranslateConfig, Config, DecodeOptions, ShardJobOptions, preset
from raymt.data.builtin import write_builtin as write_builtin_files
from raymt.data.text import read_parallel, resolve
from raymt.engines import load_model_info, resolve_engine
from raymt.errors import check, cli_error
from raymt.export import ExportConfig
from raymt.exporting import export_model
from raymt.flags import TrainFlags
from raymt.pipeline.models import ct2_export, fastest_ct2_type, model_row, relative_to, student_config
from raymt.rundir import RUN_CONFIG
from raymt.shard_job import SettingsRecord, Unfinished

PROG = "raymt.distill"
SETTINGS_FILE = "distill.json"
REPORT_FILE = "report.json"
STUDENT_CONFIG = "student.json"
TEACHER_DIR, STUDENT_RUN, STUDENT_CT2, BUILTIN_DIR = "teacher", "student", "student-ct2", "builtin"
# Flags that may change between a killed command and its rerun (they do not change the result).
RERUN_FREE = ("num_cpus", "verbose")
# OUT/distill.json: the settings a rerun must share (a directory without it must be empty).
RECORD = SettingsRecord(SETTINGS_FILE, "a distillation", rerun_free=RERUN_FREE, marks="")


@dataclass(kw_only=True)
class DistillConfig:
    """`raymt distill`: the teachers, the corpora, the student's run and the teachers' translation;
    every field a flag (`raymt.command`)."""

    teacher: tuple[str, ...] = flag(
        help="teacher checkpoint (repeat: ensemble)", repeat=True, required=True, metavar="CKPT"
    )
    train: Optional[str] = flag(
        None, "original pairs PREFIX.SRC/PREFIX.TGT (default: built-in corpus)", metavar="PREFIX"
    )
    valid: Optional[str] = flag(None, "validation pairs of the student run", metavar="PREFIX")
    test: Optional[str] = flag(None, "test pairs: the student run's test and the comparison", metavar="PREFIX")
    src_lang: Optional[str] = flag(None, "source language (default: the teacher's)")
    tgt_lang: Optional[str] = flag(None, "target language (default: the teacher's)")
    output: str = flag(help="the distillation's directory (steps 1-4)", required=True, metavar="DIR")
    student_preset: str = flag("student_mini", f"one of {', '.join(PRESETS)}")
    student_config: Optional[str] = flag(None, "the student run's config (TOML/JSON) over the preset", metavar="FILE")
    set: list[str] = flag(help="the student run's", repeat=True, metavar="SECTION.FIELD=VALUE")
    max_steps: Optional[int] = flag(None, "the student's updates (sets train.max_steps)")
    num_workers: Optional[int] = flag(None, "the student's training workers (sets train.num_workers)")
    mix_original: float = flag(0.0, "share of original pairs in training (0-1)", metavar="F")
    beam: int = flag(5, "the teachers' beam when they translate the corpus")
    engine: str = flag("auto", "the teachers' engine (raymt backtranslate --engine)")
    shard_lines: int = flag(10_000, "restart unit of the teachers' translation")
    num_cpus: Optional[int] = flag(None, "CPUs of a local Ray instance (not with RAY_ADDRESS)")
    verbose: bool = flag(False, "also print Ray's own INFO lines")

    def __post_init__(self) -> None:
        check(0.0 <= self.mix_original < 1.0, f"--mix-original {self.mix_original} must be in [0, 1)")
        check(self.beam >= 1, f"--beam {self.beam} must be >= 1")
        preset(self.student_preset)  # an unknown preset: one line naming the choices

    def settings(self) -> dict:
        """Its values as distill.json records them (JSON's lists for tuples)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def parse_args(argv: Optional[list[str]] = None) -> DistillConfig:
    """The validated DistillConfig of a command line."""
    return parse(DistillConfig, argv, "python -m raymt.distill", __doc__.split("\n\n")[0])


@dataclass
class Plan:
    """Everything checked before Ray starts: languages, inputs and the student's config."""

    out: Path
    src_lang: str
    tgt_lang: str
    train: str  # prefix of the original pairs
    valid: Optional[str]
    test: Optional[str]
    student: Config  # the student run's config


def _teacher_pair(cfg: DistillConfig) -> tuple[str, str]:
    """The pair the teachers translate; several teachers must make an ensemble (one tokenizer, one
    set of languages: `check_ensemble`) that --engine can decode."""
    info = load_model_info(list(cfg.teacher))
    resolve_engine(cfg.engine, info)  # an ensemble on CTranslate2: one line
    return backtranslate.directions(info, cfg.src_lang, cfg.tgt_lang)[:2]


def _student_config(cfg: DistillConfig, plan: Plan, distilled: str) -> Config:
    """The student run's config: preset < --student-config < flags < --set, as `raymt train`
    builds it, on the distilled pairs (mixed with the original ones by --mix-original) with the
    teacher's tokenizer."""
    flags = TrainFlags(
        preset=cfg.student_preset,
        config=cfg.student_config,
        set=list(cfg.set),
        max_steps=cfg.max_steps or None,
        num_workers=cfg.num_workers or None,
        src_lang=plan.src_lang,
        tgt_lang=plan.tgt_lang,
    )
    pair = (plan.src_lang, plan.tgt_lang)
    return student_config(
        flags, pair, distilled, cfg.teacher[0], plan.valid, plan.test, plan.train, cfg.mix_original, not cfg.train
    )


def check_args(cfg: DistillConfig) -> Plan:
    """Every input, the teachers and the student's config checked; nothing written yet."""
    src, tgt = _teacher_pair(cfg)
    out = Path(cfg.output).resolve()
    train_prefix = cfg.train or str(out / BUILTIN_DIR / "train")
    valid = cfg.valid or (None if cfg.train else str(out / BUILTIN_DIR / "valid"))
    test = cfg.test or (None if cfg.train else str(out / BUILTIN_DIR / "test"))
    if cfg.train:
        for prefix in (p for p in (cfg.train, cfg.valid, cfg.test) if p):
            resolve(prefix, src), resolve(prefix, tgt)  # a missing file: one line naming it
    plan = Plan(out, src, tgt, train_prefix, valid, test, Config())
    plan.student = _student_config(cfg, plan, str(out / TEACHER_DIR / "text"))
    RECORD.check(str(out), cfg.settings())  # OUT is new, empty, or this distillation's
    return plan


def write_builtin(plan: Plan, seed: int, train_size: int, eval_size: int) -> None:
    """The built-in corpus of the pair as text files under OUT/builtin/ (train, valid, test)."""
    write_builtin_files(plan.out / BUILTIN_DIR, plan.src_lang, plan.tgt_lang, train_size, eval_size, seed)


def start(cfg: DistillConfig, plan: Plan) -> None:
    """OUT/distill.json (once), the student's config and, without --train, the built-in corpus."""
    plan.out.mkdir(parents=True, exist_ok=True)
    if RECORD.read(str(plan.out)) is None:
        RECORD.write(str(plan.out), RECORD.settings(cfg.settings()))
    (plan.out / STUDENT_CONFIG).write_text(json.dumps(plan.student.to_dict(), indent=2))
    if not cfg.train:
        data = plan.student.data
        write_builtin(plan, plan.student.train.seed, data.builtin_train_size, data.builtin_eval_size)


def _step(number: int, name: str, command: str, step: object) -> None:
    """A step's header: the command that runs it alone (its config's command line)."""
    print(f"\n=== distill {number}/4: {name}: {command_line(command, step)}", flush=True)


def translate_config(cfg: DistillConfig, plan: Plan) -> BacktranslateConfig:
    """Step 1's back-translation: the teachers at --beam and their length penalty, text output."""
    decode = load_model_info(cfg.teacher[0]).config.decode
    return BacktranslateConfig(
        checkpoint=tuple(cfg.teacher),
        input=resolve(plan.train, plan.src_lang),
        output=str(plan.out / TEACHER_DIR),
        format="text",
        src_lang=plan.src_lang,
        tgt_lang=plan.tgt_lang,
        decode=DecodeOptions(beam=cfg.beam, length_penalty=decode.length_penalty),
        engine=cfg.engine,
        shards=ShardJobOptions(shard_lines=cfg.shard_lines, num_cpus=cfg.num_cpus, verbose=cfg.verbose),
    )


def translate_step(cfg: DistillConfig, plan: Plan) -> None:
    """Step 1: the teachers' beam-search translations of the training sources (restartable;
    `raymt.shard_job.Unfinished` when shards are left to do)."""
    step = translate_config(cfg, plan)
    _step(1, "translate", "backtranslate", step)
    backtranslate.run(step)


def student_flags(cfg: DistillConfig, plan: Plan) -> TrainFlags:
    """Step 2's `raymt train` flags: the student's config in OUT, or its run continued."""
    run_dir = plan.out / STUDENT_RUN
    if (run_dir / RUN_CONFIG).exists():
        return TrainFlags(resume=str(run_dir), verbose=cfg.verbose)
    config = str(plan.out / STUDENT_CONFIG)
    return TrainFlags(config=config, storage_path=str(plan.out), name=STUDENT_RUN, verbose=cfg.verbose)


def train_step(cfg: DistillConfig, plan: Plan) -> dict:
    """Step 2: the student's run (continued when killed); its summary."""
    summary = plan.out / STUDENT_RUN / "summary.json"  # written last: the run finished
    if not summary.exists():
        flags = student_flags(cfg, plan)
        _step(2, "train the student", "train", flags)
        gpus = functools.partial(train.count_cluster_gpus, cfg.verbose)
        student, resume_dir, init = train.resolve_resume(flags, gpus)
        train.run(student, resume_dir, init, verbose=cfg.verbose)
    return json.loads(summary.read_text())


def export_step(plan: Plan, best: str, sources: list[str], opts: DecodeOptions) -> dict:
    """Step 3: the student in CTranslate2 (OUT/student-ct2), stored int8 or float32, whichever
    decodes `sources` faster on one thread; the choice and its speeds (OUT/student-ct2.json)."""
    target, record = plan.out / STUDENT_CT2, plan.out / f"{STUDENT_CT2}.json"
    if record.exists():  # written after the export: it is whole
        return json.loads(record.read_text())
    dtype, speeds = fastest_ct2_type(best, sources, opts)
    step = ExportConfig(checkpoint=best, output=str(target), format="ctranslate2", dtype=dtype)
    _step(3, "export the student", "export", step)
    shutil.rmtree(target, ignore_errors=True)
    export_model(step.checkpoint, target, step.format, step.dtype)
    choice = {"checkpoint": best, "dtype": dtype, "sentences_per_s": speeds, "beam": opts.beam}
    record.write_text(json.dumps(choice, indent=2))
    return choice


def compare(cfg: DistillConfig, plan: Plan, student: Path, dtype: str) -> dict:
    """Step 4: teachers (beam --beam; several: each, and their ensemble in raymt's engine) and the
    student (greedy and beam --beam) on the test set, on one thread, one after another here; one
    models in CTranslate2 at the student's weight type."""
    test = read_parallel(plan.test, plan.src_lang, plan.tgt_lang)
    teachers: list[tuple[str, Path | list[str]]] = [
        (
            "teacher" if len(cfg.teacher) == 1 else f"teacher {i + 1}",
            ct2_export(t, plan.out / f"teacher-ct2-{i}-{dtype}", dtype),
        )
        for i, t in enumerate(cfg.teacher)
    ]
    if len(cfg.teacher) > 1:
        teachers.append((f"ensemble of {len(cfg.teacher)}", list(cfg.teacher)))
    rows = [model_row(name, model, dtype, cfg.beam, test, plan.tgt_lang) for name, model in teachers]
    rows += [model_row("student", student, dtype, beam, test, plan.tgt_lang) for beam in dict.fromkeys((1, cfg.beam))]
    teacher = next((r for r in rows if r["model"].startswith("ensemble")), rows[0])  # what was distilled
    relative_to(rows, teacher)
    return {"test": plan.test, "num_sentences": len(test[0]), "engine": f"ctranslate2 {dtype}, 1 thread", "rows": rows}


def print_report(report: dict) -> None:
    """The side-by-side table of step 4."""
    print(f"\n=== distill: {report['test']} ({report['num_sentences']:,} sentences; {report['engine']})")
    print("| model | engine | beam | BLEU | chrF | MiB | sentences/s | speed vs teacher | BLEU vs teacher |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(
            f"| {r['model']} | {r['engine']} | {r['beam']} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['mib']:.1f} | "
            f"{r['sentences_per_s']:,.1f} | {r['speed_vs_teacher']:.2f}x | {r['bleu_vs_teacher']:+.2f} |"
        )


def run(cfg: DistillConfig) -> Optional[dict]:
    """Distill: the four steps, each skipped where a previous run finished it; the report of step 4
    (None without --test). Raises a one-line ValueError on a user error (before Ray starts where
    it can), `raymt.shard_job.Unfinished` when the teachers' translation left shards to do."""
    check_ray_address()
    plan = check_args(cfg)
    start(cfg, plan)
    translate_step(cfg, plan)
    best = train_step(cfg, plan)["best_checkpoint"]
    if plan.test is None:
        print(f"\ndistill: no --test: the student is {best}; export and compare with a test set")
        return None
    sources = read_parallel(plan.test, plan.src_lang, plan.tgt_lang)[0]
    choice = export_step(plan, best, sources, DecodeOptions(beam=cfg.beam))
    report = compare(cfg, plan, plan.out / STUDENT_CT2, choice["dtype"])
    report["export"] = choice
    (plan.out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    print_report(report)
    print(
        f"student: {best} (CTranslate2 {choice['dtype']}: {plan.out / STUDENT_CT2}); report: {plan.out / REPORT_FILE}"
    )
    return report


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status: 2 for a user error, 1 when a step did not finish."""
    try:
        run(parse_args(argv))
    except ValueError as err:
        return cli_error(PROG, " ".join(str(err).split("\n")))
    except Unfinished as err:
        return cli_error(PROG, err, 1)
    except Exception as err:  # a training worker's one-line error (CUDA out of memory) arrives wrapped by Ray
        user_error = train.worker_value_error(err)
        if user_error is None:
            raise
        return cli_error(PROG, user_error, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
