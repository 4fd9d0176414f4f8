"""Distillation measured (issue 58): a teacher, its distilled student, and the same student trained
on the original pairs at equal updates, side by side on Multi30k's test_2016_flickr.

- distilled: `raymt distill --teacher T ...` (the teacher's beam-5 translations of the training
  sources; the student with the teacher's tokenizer; CTranslate2 at the faster weight type);
- original:  the same student (preset, tokenizer, updates, seed) trained on the original pairs
  (`raymt train --set data.tokenizer=T`), exported at the same weight type.

Every row is decoded by CTranslate2 on one thread in this one process, one after another
(raymt.pipeline.models.model_row): sacreBLEU, chrF, the papers' BLEU (Moses-tokenized, lowercased), size
on disk, sentences/s. With several --teacher, raymt distill decodes with their ensemble and the
table also has each teacher. Prints the table of docs/distill.md and writes OUT/distill.json.

    python benchmarks/distill.py --teacher runs/m30k-cpu/avg5 --m30k ../shared/data/multi30k \
        --out /tmp/distill --steps 2000

`--resume-to N` (after such a run in the same --out) continues both students to N updates
(`raymt train --resume RUN --set train.max_steps=N`: the schedule does not depend on max_steps,
so this trains what an N-update run would) and measures every row again in this one process:
the teacher, each student's best checkpoint and, with `--average K`, the average of its last K.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def raymt(*args: str) -> float:
    """Run `python -m raymt ARGS` (its output to this one's); the seconds it took."""
    t0 = time.time()
    print("+ raymt " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "raymt", *args], check=True, cwd=ROOT)
    return time.time() - t0


def main() -> None:
    """Both arms, then the table."""
    from raymt.data.text import read_parallel
    from raymt.pipeline.models import ct2_export, model_row

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", action="append", required=True)
    p.add_argument("--m30k", default=str(ROOT.parent / "shared/data/multi30k"))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000, help="the students' updates (both arms)")
    p.add_argument("--student-preset", default="student_mini")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--set", action="append", default=[], help="both students' runs")
    p.add_argument("--resume-to", type=int, help="continue both students of --out to this many updates")
    p.add_argument("--average", type=int, default=0, help="with --resume-to: also each student's last K averaged")
    p.add_argument(
        "--also", action="append", default=[], metavar="NAME=RUN", help="with --resume-to: rows of another student run"
    )
    args = p.parse_args()
    if args.resume_to:
        return resume_rows(args)
    out, m30k = Path(args.out).resolve(), Path(args.m30k)
    data = ["--train", str(m30k / "train"), "--valid", str(m30k / "val"), "--test", str(m30k / "test_2016_flickr")]
    extra = [flag for item in args.set for flag in ("--set", item)]
    teachers = [flag for t in args.teacher for flag in ("--teacher", t)]
    seconds = {}
    seconds["distilled"] = raymt(
        "distill", *teachers, *data, "--output", str(out / "distilled"), "--student-preset", args.student_preset,
        "--max-steps", str(args.steps), "--beam", str(args.beam), *extra,
    )  # fmt: skip
    if not (out / "original" / "summary.json").exists():  # a rerun (on a quieter box) times the rows again
        seconds["original"] = raymt(
            "train", "--preset", args.student_preset, *data, "--src-lang", "en", "--tgt-lang", "de",
            "--max-steps", str(args.steps), "--set", f"data.tokenizer={Path(args.teacher[0]).resolve()}",
            "--storage-path", str(out), "--name", "original", *extra,
        )  # fmt: skip
    report = json.loads((out / "distilled" / "report.json").read_text())
    dtype = report["export"]["dtype"]
    best = json.loads((out / "original" / "summary.json").read_text())["best_checkpoint"]
    original = ct2_export(best, out / f"original-ct2-{dtype}", dtype)
    test = read_parallel(str(m30k / "test_2016_flickr"), "en", "de")
    teacher = report["rows"][0]
    for beam in dict.fromkeys((1, args.beam)):
        row = model_row("student, original pairs", original, dtype, beam, test, "de")
        row["speed_vs_teacher"] = round(row["sentences_per_s"] / teacher["sentences_per_s"], 2)
        row["bleu_vs_teacher"] = round(row["bleu"] - teacher["bleu"], 2)
        report["rows"].append(row)
    report["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    report["steps"] = args.steps
    (out / "distill.json").write_text(json.dumps(report, indent=2))
    print_rows(report, seconds)


def updates(run: Path) -> int:
    """The last update a run's metrics.csv records (0: none)."""
    lines = (run / "logs" / "metrics.csv").read_text().splitlines()
    return int(lines[-1].split(",")[0]) if len(lines) > 1 else 0


def student_models(run: Path, steps: int, average: int, dtype: str) -> list[tuple[str, Path]]:
    """A student run's best checkpoint and (average > 0) its last `average` averaged, each exported
    to CTranslate2 at `dtype` (directories named by the updates: an earlier export is not reused)."""
    from raymt.pipeline.models import ct2_export

    checkpoints = [("", json.loads((run / "summary.json").read_text())["best_checkpoint"])]
    if average:
        averaged = run / f"avg{average}-{steps}"
        if not averaged.exists():  # a rerun keeps its average
            raymt("average", str(run), "--last", str(average), "--output", str(averaged))
        checkpoints.append((f", avg{average}", str(averaged)))
    return [(suffix, ct2_export(ck, run.parent / f"{run.name}-ct2-{dtype}-{steps}{suffix[2:]}", dtype))
            for suffix, ck in checkpoints]  # fmt: skip


def resume_rows(args: argparse.Namespace) -> None:
    """--resume-to: both students continued to N updates, then every row measured again."""
    from raymt.data.text import read_parallel
    from raymt.pipeline.models import ct2_export, model_row

    if len(args.teacher) != 1:
        raise SystemExit("--resume-to measures one teacher")
    out, m30k = Path(args.out).resolve(), Path(args.m30k)
    # The distillation's student run: the pipeline's student step (OUT/distilled/steps/student.<key>/).
    (student,) = [p for p in (out / "distilled" / "steps").glob("student.*") if p.is_dir()]
    runs = {"student": student, "student, original pairs": out / "original"}
    runs.update((name, Path(run).resolve()) for name, run in (item.split("=", 1) for item in args.also))
    seconds = {}
    for name, run in runs.items():
        if updates(run) >= args.resume_to:  # a rerun measures the rows again
            continue
        seconds[name] = raymt(
            "train", "--resume", str(run), "--set", f"train.max_steps={args.resume_to}", "--set", "train.num_to_keep=10"
        )
    dtype = json.loads((out / "distilled" / "report.json").read_text())["export"]["dtype"]
    test = read_parallel(str(m30k / "test_2016_flickr"), "en", "de")
    teacher = model_row(
        "teacher", ct2_export(args.teacher[0], out / f"teacher-ct2-{dtype}", dtype), dtype, args.beam, test, "de"
    )
    rows = [teacher]
    for name, run in runs.items():
        for suffix, model in student_models(run, args.resume_to, args.average, dtype):
            for beam in dict.fromkeys((1, args.beam)):
                row = model_row(name + suffix, model, dtype, beam, test, "de")
                row["speed_vs_teacher"] = round(row["sentences_per_s"] / teacher["sentences_per_s"], 2)
                row["bleu_vs_teacher"] = round(row["bleu"] - teacher["bleu"], 2)
                rows.append(row)
    teacher.update(speed_vs_teacher=1.0, bleu_vs_teacher=0.0)
    report = {"test": str(m30k / "test_2016_flickr"), "num_sentences": len(test[0]), "rows": rows}
    report.update(engine=f"ctranslate2 {dtype}, 1 thread", steps=args.resume_to)
    report["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    (out / f"distill-{args.resume_to}.json").write_text(json.dumps(report, indent=2))
    print_rows(report, seconds)


def print_rows(report: dict, seconds: dict) -> None:
    """The table of docs/distill.md."""
    print(f"\n{report['test']}: {report['num_sentences']} sentences, {report['engine']}, {report['steps']} updates")
    print("| model | beam | BLEU | papers' BLEU | chrF | MiB | sentences/s | vs teacher |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(
            f"| {r['model']} | {r['beam']} | {r['bleu']:.2f} | {r['bleu_tok']:.2f} | {r['chrf']:.2f} | "
            f"{r['mib']:.1f} | {r['sentences_per_s']:,.1f} | {r['speed_vs_teacher']:.2f}x |"
        )
    print(f"wall time: {', '.join(f'{k} {v / 60:.1f} min' for k, v in seconds.items())}")


if __name__ == "__main__":
    main()
