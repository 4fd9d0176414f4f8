"""`raymt distill`: a small, fast student from a teacher or an ensemble of teachers, by
sequence-level knowledge distillation (Kim & Rush 2016): the student learns the teachers'
beam-search translations of the training sources instead of the references.

A preset of `raymt pipeline` (docs/pipeline.md), one code path: the flags make a `PipelineConfig`
(`pipeline_config`: the teachers given as [teacher] checkpoints, none trained) whose steps run:

1. corpus: without --train, the built-in corpus of the pair written as files;
2. distill: the teachers translate the training sources with beam search on Ray actors (`raymt
   backtranslate --format text`: every line exactly once, restartable);
3. student: the student trains on them, optionally mixed with the original pairs
   (`--mix-original`), with the teacher's tokenizer, on Ray Train;
4. export: its best checkpoint to CTranslate2, stored int8 or float32, whichever translates
   faster on one thread;
5. evaluate: teachers and student side by side on the test set, on one thread of CTranslate2:
   BLEU, chrF, size and sentences/s (OUT/report.md, report.json).

Each step's output is OUT/steps/<step>.<key>/. Killed, the same command goes on (the pipeline
skips the steps done; the translation continues from its finished shards, the student from its
latest checkpoint). OUT/distill.json records the settings; another command's are refused there.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raymt import backtranslate, train
from raymt.cluster import check_ray_address
from raymt.command import flag, parse
from raymt.config import PRESETS, preset
from raymt.data.text import resolve
from raymt.engines import load_model_info, resolve_engine
from raymt.errors import check, cli_error
from raymt.flags import TrainFlags, build_config
from raymt.pipeline.config import PipelineConfig, from_dict
from raymt.pipeline.report import REPORT_MD
from raymt.pipeline.runner import Pipeline
from raymt.pipeline.steps import MODEL_DIR
from raymt.shard_job import SettingsRecord, Unfinished

PROG = "raymt.distill"
SETTINGS_FILE = "distill.json"
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
    test: Optional[str] = flag(None, "test pairs of the comparison", metavar="PREFIX")
    src_lang: Optional[str] = flag(None, "source language (default: the teacher's)")
    tgt_lang: Optional[str] = flag(None, "target language (default: the teacher's)")
    output: str = flag(help="the distillation's directory (the pipeline's output)", required=True, metavar="DIR")
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
        given = [self.train, self.valid, self.test]
        check(
            all(given) or not any(given),
            "--train, --valid and --test: give all three (the student's training, validation and the "
            "comparison's test pairs), or none (the built-in corpus)",
        )
        preset(self.student_preset)  # an unknown preset: one line naming the choices

    def settings(self) -> dict:
        """Its values as distill.json records them (JSON's lists for tuples)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def parse_args(argv: Optional[list[str]] = None) -> DistillConfig:
    """The validated DistillConfig of a command line."""
    return parse(DistillConfig, argv, "python -m raymt.distill", __doc__.split("\n\n")[0])


def teacher_pair(cfg: DistillConfig) -> tuple[str, str]:
    """The pair the teachers translate; several teachers must make an ensemble (one tokenizer, one
    set of languages: `check_ensemble`) that --engine can decode."""
    info = load_model_info(list(cfg.teacher))
    resolve_engine(cfg.engine, info)  # an ensemble on CTranslate2: one line
    return backtranslate.directions(info, cfg.src_lang, cfg.tgt_lang)[:2]


def corpora(cfg: DistillConfig, pair: tuple[str, str], student: dict) -> dict:
    """[corpora]: the pairs given (each file there: one line naming a missing one), or the built-in
    corpus at the sizes and seed of the student's config (data.builtin_*_size, train.seed)."""
    if cfg.train:
        for prefix in (cfg.train, cfg.valid, cfg.test):
            resolve(prefix, pair[0]), resolve(prefix, pair[1])
        return {"train": cfg.train, "valid": cfg.valid, "test": cfg.test}
    run = build_config(TrainFlags(preset=student["preset"], config=student.get("config"), set=student["set"]))
    data = run.data
    return {
        "builtin_train_size": data.builtin_train_size,
        "builtin_eval_size": data.builtin_eval_size,
        "seed": run.train.seed,
    }


def pipeline_config(cfg: DistillConfig) -> PipelineConfig:
    """The pipeline this distillation is, as its TOML tables would give it (`from_dict`): the
    teachers as [teacher] checkpoints, the corpora, the student (--num-workers as its first --set
    item, so a --set train.num_workers wins, as in `raymt train`), the teachers' translation at
    --beam, and export and evaluation at --beam."""
    src, tgt = teacher_pair(cfg)
    workers = [f"train.num_workers={cfg.num_workers}"] if cfg.num_workers else []
    student = {"preset": cfg.student_preset, "set": [*workers, *cfg.set], "mix_original": cfg.mix_original}
    student.update({"config": cfg.student_config} if cfg.student_config else {})
    student.update({"max_steps": cfg.max_steps} if cfg.max_steps else {})
    tables = {
        "src": src,
        "tgt": tgt,
        "output": cfg.output,
        "corpora": corpora(cfg, (src, tgt), student),
        "teacher": {"checkpoints": list(cfg.teacher)},
        "distill": {"beam": cfg.beam, "engine": cfg.engine, "shard_lines": cfg.shard_lines},
        "student": student,
        "export": {"beam": cfg.beam},
        "evaluate": {"beam": cfg.beam},
    }
    return from_dict(tables)


def run(cfg: DistillConfig) -> Optional[dict]:
    """Distill: the pipeline's steps, each skipped where a previous run finished it; the report.
    Raises a one-line ValueError on a user error (before Ray starts and before anything is
    written), `raymt.shard_job.Unfinished` when the teachers' translation left shards to do."""
    check_ray_address()
    pipeline = Pipeline(pipeline_config(cfg), cfg.verbose, num_cpus=cfg.num_cpus)
    out = str(pipeline.out)
    settings = cfg.settings()
    RECORD.check(out, settings)  # OUT is new, empty, or this distillation's
    if RECORD.read(out) is None:
        Path(out).mkdir(parents=True, exist_ok=True)
        RECORD.write(out, RECORD.settings(settings))
    report = pipeline.run()
    ctx = pipeline.ctx
    print((Path(out) / REPORT_MD).read_text().split("\n## ")[0].rstrip())
    print(f"student: {ctx.best('student')} (CTranslate2: {ctx.dir('export') / MODEL_DIR}); report: {out}/{REPORT_MD}")
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
