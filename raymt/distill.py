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

import argparse
import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raymt import storage
from raymt.checkpoint import RAYMT_CONFIG_FILE
from raymt.config import CONTENT_RULES, PRESETS, CorpusSpec, DecodeOptions, apply_overrides, preset
from raymt.errors import check, cli_error
from raymt.shard_job import SettingsRecord

SETTINGS_FILE = "distill.json"
REPORT_FILE = "report.json"
STUDENT_CONFIG = "student.json"
TEACHER_DIR, STUDENT_RUN, STUDENT_CT2, BUILTIN_DIR = "teacher", "student", "student-ct2", "builtin"
# Flags that may change between a killed command and its rerun (they do not change the result).
RERUN_FREE = ("num_cpus", "verbose")
# OUT/distill.json: the settings a rerun must share (a directory without it must be empty).
RECORD = SettingsRecord(SETTINGS_FILE, "a distillation", rerun_free=RERUN_FREE, marks="")
# CTranslate2 weight types the export chooses between by one-thread speed.
CT2_TYPES = ("int8", "float32")
# Sentences decoded before an engine is timed.
WARM_UP = 16


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags of `raymt distill`."""
    p = argparse.ArgumentParser(prog="python -m raymt.distill", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--teacher", action="append", required=True, metavar="CKPT", help="teacher checkpoint (repeat: ensemble)"
    )
    p.add_argument("--train", metavar="PREFIX", help="original pairs PREFIX.SRC/PREFIX.TGT (default: built-in corpus)")
    p.add_argument("--valid", metavar="PREFIX", help="validation pairs of the student run")
    p.add_argument("--test", metavar="PREFIX", help="test pairs: the student run's test and the comparison")
    p.add_argument("--src-lang", help="source language (default: the teacher's)")
    p.add_argument("--tgt-lang", help="target language (default: the teacher's)")
    p.add_argument("--output", required=True, metavar="DIR", help="the distillation's directory (steps 1-4)")
    p.add_argument("--student-preset", default="student_mini", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--student-config", metavar="FILE", help="the student run's config (TOML/JSON) over the preset")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="the student run's")
    p.add_argument("--max-steps", type=int, help="the student's updates (sets train.max_steps)")
    p.add_argument("--num-workers", type=int, help="the student's training workers (sets train.num_workers)")
    p.add_argument(
        "--mix-original", type=float, default=0.0, metavar="F", help="share of original pairs in training (0-1)"
    )
    p.add_argument("--beam", type=int, default=5, help="the teachers' beam when they translate the corpus")
    p.add_argument("--engine", default="auto", help="the teachers' engine (raymt backtranslate --engine)")
    p.add_argument("--shard-lines", type=int, default=10_000, help="restart unit of the teachers' translation")
    p.add_argument("--num-cpus", type=int, help="CPUs of a local Ray instance (not with RAY_ADDRESS)")
    p.add_argument("--verbose", action="store_true", help="also print Ray's own INFO lines")
    return p.parse_args(argv)


@dataclass
class Plan:
    """Everything checked before Ray starts: languages, inputs and the student's config."""

    out: Path
    src_lang: str
    tgt_lang: str
    train: str  # prefix of the original pairs
    valid: Optional[str]
    test: Optional[str]
    student: dict  # the student run's config (Config.to_dict)


def _teacher_pair(args: argparse.Namespace) -> tuple[str, str]:
    """The pair the teachers translate; several teachers must make an ensemble (one tokenizer, one
    set of languages: `check_ensemble`) that --engine can decode."""
    from raymt.backtranslate import directions
    from raymt.engines import load_model_info, resolve_engine

    info = load_model_info(args.teacher)
    resolve_engine(args.engine, info)  # an ensemble on CTranslate2: one line
    return directions(info, args.src_lang, args.tgt_lang)[:2]


def _student_config(args: argparse.Namespace, plan: Plan, distilled: str) -> dict:
    """The student run's config: preset < --student-config < flags < --set, on the distilled pairs
    (mixed with the original ones by --mix-original) with the teacher's tokenizer."""
    from raymt.flags import build_config
    from raymt.train import parse_args as train_args

    argv = ["--preset", args.student_preset, "--src-lang", plan.src_lang, "--tgt-lang", plan.tgt_lang]
    argv += ["--config", args.student_config] if args.student_config else []
    argv += ["--max-steps", str(args.max_steps)] if args.max_steps else []
    argv += ["--num-workers", str(args.num_workers)] if args.num_workers else []
    for item in args.set:
        argv += ["--set", item]
    cfg = build_config(train_args(argv))
    common = {"valid": plan.valid, "test": (plan.test,) if plan.test else ()}
    # The built-in corpus written as files stays generated text: its content rules off, as in a run.
    rules = {} if args.train else {"clean": {rule: False for rule in CONTENT_RULES}}
    weight = 1 - args.mix_original
    corpora = [
        CorpusSpec(plan.src_lang, plan.tgt_lang, (distilled,), label="distilled", weight=weight, **common, **rules)
    ]
    if args.mix_original > 0:
        original = {"label": "original", "weight": args.mix_original, **rules}
        corpora.append(CorpusSpec(plan.src_lang, plan.tgt_lang, (plan.train,), **original))
    tokenizer = storage.normalize(args.teacher[0])  # the teachers' one tokenizer (checked)
    return apply_overrides(cfg, {"data.corpora": corpora, "data.tokenizer": tokenizer}).to_dict()


def check_args(args: argparse.Namespace) -> Plan:
    """Every input, the teachers and the student's config checked; nothing written yet."""
    from raymt.data.text import resolve

    check(0.0 <= args.mix_original < 1.0, f"--mix-original {args.mix_original} must be in [0, 1)")
    check(args.beam >= 1, f"--beam {args.beam} must be >= 1")
    preset(args.student_preset)  # an unknown preset: one line naming the choices
    src, tgt = _teacher_pair(args)
    out = Path(args.output).resolve()
    train = args.train or str(out / BUILTIN_DIR / "train")
    valid = args.valid or (None if args.train else str(out / BUILTIN_DIR / "valid"))
    test = args.test or (None if args.train else str(out / BUILTIN_DIR / "test"))
    if args.train:
        for prefix in (p for p in (args.train, args.valid, args.test) if p):
            resolve(prefix, src), resolve(prefix, tgt)  # a missing file: one line naming it
    plan = Plan(out, src, tgt, train, valid, test, {})
    plan.student = _student_config(args, plan, str(out / TEACHER_DIR / "text"))
    _check_output(args, out)
    return plan


def _settings(args: argparse.Namespace) -> dict:
    """What distill.json records: the flags that decide the result."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in RERUN_FREE}


def _check_output(args: argparse.Namespace, out: Path) -> None:
    """OUT is new, empty, or this distillation's (the same settings): another run is refused."""
    RECORD.check(str(out), vars(args))


def write_builtin(plan: Plan, seed: int, train_size: int, eval_size: int) -> None:
    """The built-in corpus of the pair as text files under OUT/builtin/ (train, valid, test)."""
    from raymt.data.builtin import builtin_splits

    folder = plan.out / BUILTIN_DIR
    if (folder / f"test.{plan.tgt_lang}").exists():
        return
    tmp = folder.with_name(BUILTIN_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for split, (src, tgt) in builtin_splits(plan.src_lang, plan.tgt_lang, train_size, eval_size, seed).items():
        for lang, lines in ((plan.src_lang, src), (plan.tgt_lang, tgt)):
            (tmp / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.rename(folder)


def start(args: argparse.Namespace, plan: Plan) -> None:
    """OUT/distill.json (once), the student's config and, without --train, the built-in corpus."""
    plan.out.mkdir(parents=True, exist_ok=True)
    record = plan.out / SETTINGS_FILE
    if not record.exists():
        record.write_text(json.dumps(_settings(args), indent=2))
    (plan.out / STUDENT_CONFIG).write_text(json.dumps(plan.student, indent=2))
    if not args.train:
        data, seed = plan.student["data"], plan.student["train"]["seed"]
        write_builtin(plan, seed, data["builtin_train_size"], data["builtin_eval_size"])


def _step(number: int, name: str, command: str, argv: list[str]) -> None:
    """A step's header: the command that runs it alone."""
    print(f"\n=== distill {number}/4: {name}: {command} {' '.join(argv)}", flush=True)


def translate_step(args: argparse.Namespace, plan: Plan) -> int:
    """Step 1: the teachers' beam-search translations of the training sources (restartable)."""
    from raymt import backtranslate
    from raymt.data.text import resolve
    from raymt.engines import load_model_info

    decode = load_model_info(args.teacher[0]).config.decode
    argv = [flag for t in args.teacher for flag in ("--checkpoint", t)]
    argv += ["--input", resolve(plan.train, plan.src_lang), "--output", str(plan.out / TEACHER_DIR)]
    argv += ["--format", "text", "--src-lang", plan.src_lang, "--tgt-lang", plan.tgt_lang, "--beam", str(args.beam)]
    argv += ["--length-penalty", str(decode.length_penalty), "--engine", args.engine]
    argv += ["--shard-lines", str(args.shard_lines)]
    argv += ["--num-cpus", str(args.num_cpus)] if args.num_cpus else []
    argv += ["--verbose"] if args.verbose else []
    _step(1, "translate", "raymt backtranslate", argv)
    return backtranslate.main(argv)


def train_step(args: argparse.Namespace, plan: Plan) -> Optional[dict]:
    """Step 2: the student's run (continued when killed); its summary, None when it failed."""
    from raymt import train
    from raymt.rundir import RUN_CONFIG

    run_dir = plan.out / STUDENT_RUN
    summary = run_dir / "summary.json"  # written last: the run finished
    if not summary.exists():
        if (run_dir / RUN_CONFIG).exists():
            argv = ["--resume", str(run_dir)]
        else:
            argv = ["--config", str(plan.out / STUDENT_CONFIG), "--storage-path", str(plan.out), "--name", STUDENT_RUN]
        argv += ["--verbose"] if args.verbose else []
        _step(2, "train the student", "raymt train", argv)
        if train.main(argv) != 0:
            return None
    return json.loads(summary.read_text())


def _engine(model: str | Path | list[str], compute_type: str):
    """The engine of the comparison, on one thread: CTranslate2 for one model (at `compute_type`),
    raymt's for an ensemble (CTranslate2 has none)."""
    from raymt.engines import load_engine

    if isinstance(model, list):
        return load_engine(model, "raymt", threads=1)
    return load_engine(str(model), "ctranslate2", threads=1, compute_type=compute_type)


def _timed(engine, sources: list[str], opts: DecodeOptions) -> tuple[list[str], float]:
    """Hypotheses of `sources` and the sentences/s of decoding them (after a few untimed ones:
    the first calls of an engine also allocate its buffers)."""
    engine.translate(sources[:WARM_UP], opts)
    t0 = time.perf_counter()
    hyps = [nbest[0][1] for nbest in engine.translate(sources, opts)]
    return hyps, len(sources) / max(time.perf_counter() - t0, 1e-9)


def export_step(plan: Plan, best: str, sources: list[str], opts: DecodeOptions) -> dict:
    """Step 3: the student in CTranslate2 (OUT/student-ct2), stored int8 or float32, whichever
    decodes `sources` faster on one thread; the choice and its speeds (OUT/student-ct2.json)."""
    from raymt.export import export_model

    target, record = plan.out / STUDENT_CT2, plan.out / f"{STUDENT_CT2}.json"
    if record.exists():  # written after the export: it is whole
        return json.loads(record.read_text())
    _step(
        3,
        "export the student",
        "raymt export",
        ["--checkpoint", best, "--output", str(target), "--format", "ctranslate2"],
    )
    speeds = {ct: round(_timed(_engine(best, ct), sources, opts)[1], 2) for ct in CT2_TYPES}
    dtype = max(speeds, key=speeds.get)
    print(
        f"export: {', '.join(f'{ct} {v:,.1f}' for ct, v in speeds.items())} sentences/s (1 thread) -> --dtype {dtype}"
    )
    shutil.rmtree(target, ignore_errors=True)
    export_model(best, target, "ctranslate2", dtype)
    choice = {"checkpoint": best, "dtype": dtype, "sentences_per_s": speeds, "beam": opts.beam}
    record.write_text(json.dumps(choice, indent=2))
    return choice


def ct2_export(checkpoint: str, target: Path, dtype: str) -> Path:
    """`checkpoint` exported to CTranslate2 at `dtype` in `target` (once: kept when it is whole)."""
    from raymt.export import export_model

    if not (target / RAYMT_CONFIG_FILE).exists():  # written last by export_model
        shutil.rmtree(target, ignore_errors=True)
        export_model(checkpoint, target, "ctranslate2", dtype)
    return target


def model_row(
    name: str, model: Path | list[str], dtype: str, beam: int, test: tuple[list[str], list[str]], tgt: str
) -> dict:
    """One model at one beam on the test set (`model`: a CTranslate2 directory, or an ensemble's
    checkpoints): sacreBLEU, chrF, the papers' BLEU (Moses-tokenized, lowercased), size on disk
    and one-thread sentences/s."""
    from raymt.checkpoint import weights_file
    from raymt.metrics import score

    engine = _engine(model, dtype)
    opts = dataclasses.replace(engine.info.config.decode, beam=beam)
    hyps, rate = _timed(engine, test[0], opts)
    scores = score(hyps, test[1], extra=True, lang=tgt)
    files = [weights_file(m) for m in model] if isinstance(model, list) else list(model.iterdir())
    return {
        "model": name,
        "engine": engine.name,
        "beam": beam,
        "bleu": round(scores["bleu"], 2),
        "chrf": round(scores["chrf"], 2),
        "bleu_tok": round(scores["bleu_tok"], 2),
        "mib": round(sum(f.stat().st_size for f in files if f.is_file()) / 2**20, 2),
        "sentences_per_s": round(rate, 2),
        "bleu_signature": scores["bleu_signature"],
    }


def compare(args: argparse.Namespace, plan: Plan, student: Path, dtype: str) -> dict:
    """Step 4: teachers (beam --beam; several: each, and their ensemble in raymt's engine) and the
    student (greedy and beam --beam) on the test set, on one thread, one after another here; one
    models in CTranslate2 at the student's weight type."""
    from raymt.data.text import read_parallel

    test = read_parallel(plan.test, plan.src_lang, plan.tgt_lang)
    teachers: list[tuple[str, Path | list[str]]] = [
        (
            "teacher" if len(args.teacher) == 1 else f"teacher {i + 1}",
            ct2_export(t, plan.out / f"teacher-ct2-{i}-{dtype}", dtype),
        )
        for i, t in enumerate(args.teacher)
    ]
    if len(args.teacher) > 1:
        teachers.append((f"ensemble of {len(args.teacher)}", list(args.teacher)))
    rows = [model_row(name, model, dtype, args.beam, test, plan.tgt_lang) for name, model in teachers]
    rows += [model_row("student", student, dtype, beam, test, plan.tgt_lang) for beam in dict.fromkeys((1, args.beam))]
    teacher = next((r for r in rows if r["model"].startswith("ensemble")), rows[0])  # what was distilled
    for row in rows:
        row["speed_vs_teacher"] = round(row["sentences_per_s"] / teacher["sentences_per_s"], 2)
        row["bleu_vs_teacher"] = round(row["bleu"] - teacher["bleu"], 2)
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


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    from raymt.cluster import check_ray_address
    from raymt.data.text import read_parallel

    args = parse_args(argv)
    try:
        check_ray_address()
        plan = check_args(args)
        start(args, plan)
    except ValueError as err:
        return cli_error("raymt.distill", err)
    rc = translate_step(args, plan)
    if rc != 0:
        return rc
    summary = train_step(args, plan)
    if summary is None:
        return 1
    best = summary["best_checkpoint"]
    try:
        if plan.test is None:
            print(f"\ndistill: no --test: the student is {best}; export and compare with a test set")
            return 0
        sources = read_parallel(plan.test, plan.src_lang, plan.tgt_lang)[0]
        choice = export_step(plan, best, sources, DecodeOptions(beam=args.beam))
        report = compare(args, plan, plan.out / STUDENT_CT2, choice["dtype"])
    except ValueError as err:
        return cli_error("raymt.distill", err)
    report["export"] = choice
    (plan.out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    print_report(report)
    print(
        f"student: {best} (CTranslate2 {choice['dtype']}: {plan.out / STUDENT_CT2}); report: {plan.out / REPORT_FILE}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
