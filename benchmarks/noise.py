"""What cleaning removes of injected noise (issue 59, "Measure"): Multi30k en-de train with 30% of
its pairs made noisy in six kinds, then `raymt data prepare`'s rules and language ID, and (with
--forward/--backward) the dual cross-entropy filter of `raymt data score`, per kind.

    python benchmarks/noise.py --data ../shared/data/multi30k --work-dir /tmp/noise --json noise.json
    python benchmarks/noise.py ... --forward CK_EN_DE --backward CK_DE_EN          # + the score filter
    python benchmarks/noise.py ... --train-steps 1200 --train-scorers --oracle        # + BLEU (~2 h)

Kinds (each 1/6 of the noisy pairs; --seed fixes them): misaligned (targets shuffled among them),
copy (target = source), wrong_language (a target from the built-in corpus's fr or es, or another
pair's English source), truncated (the target cut to 30-60% of its words), numbers (an English
number word of the source and the German one of the target written as two different digits),
near_duplicate (an earlier clean pair lower-cased, its punctuation made spaces). Which pairs a
prepare kept is read back from its shards (pieces decoded, matched to the noisy pairs' decoded
pieces), so the figures are prepare's own. --train-steps trains the recipe for the same updates on
clean, noisy and cleaned data and scores test_2016_flickr (hours on CPU: an option, not a default);
with --train-scorers the score filter's models are the noisy arm's en->de model and a de->en model
trained on the noisy corpus for as many updates: what a pipeline without clean data has (models
trained on clean Multi30k would have seen the very pairs they score).

The score filter's threshold three ways (issue 68 item 1), each reported per kind and, with
--train-steps, as a "cleaned" arm: `labels` (the score that --clean-drop of the *known clean* pairs
fall under: what no real corpus allows, the figure before issue 68), `keep_best` (prepare's
--keep-best F: the best F of the scored pairs) and `calibrate_valid` (prepare's --calibrate-valid
Q: the score that Q of Multi30k's validation pairs, scored by the same models, fall under; Q is
--clean-drop). The last two use no labels. --limit N takes the first N training pairs (a smoke run).

--noise-kinds held-out makes noise the rules were not tuned on (issue 68; the wrong_language rule
was tuned on the kinds above, seed 1), each 1/4 of the noisy pairs: wrong_language in it, pt, nl
and ru (a quarter each: 50 hand-written sentences, benchmarks/noise_text.py, the rest phrases of
the built-in corpus's generator in that language), halved (the target cut at its middle
character), boilerplate (web and subtitle lines in German, English or no language) and mixed (the
target's first half of words then the source's second half, or the target followed by the source).
It measures the rules only (no score filter, no training):

    python benchmarks/noise.py --noise-kinds held-out --seed 2 --work-dir /tmp/noise --json held-out.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.noise_text import BOILERPLATE, SENTENCES  # noqa: E402
from raymt.data.builtin import generate, sentence  # noqa: E402
from raymt.tokenizer import Tokenizer  # noqa: E402

KINDS = ("misaligned", "copy", "wrong_language", "truncated", "numbers", "near_duplicate")
HELD_OUT = ("wrong_language", "halved", "boilerplate", "mixed")  # --noise-kinds held-out
EN_NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
DE_NUMBERS = ("zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn")
RULES = ["--wrong-language", "--near-dedup"]  # beside the default rules (copy, numbers, URLs, letters, repeats)
NO_RULES = ["--no-copy", "--no-number-mismatch", "--no-url-mismatch", "--no-alpha-ratio", "--no-repeats"]


def read(prefix: Path, lang: str) -> list[str]:
    """One side of a gzipped Multi30k split."""
    with gzip.open(f"{prefix}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def number_pair(src: str, tgt: str, rng: random.Random) -> tuple[str, str] | None:
    """The pair with its English and German number word written as two different digits, or None."""
    for k, (en, de) in enumerate(zip(EN_NUMBERS, DE_NUMBERS)):
        s_match = re.search(rf"\b{en}\b", src, re.IGNORECASE)
        t_match = re.search(rf"\b{de}\b", tgt, re.IGNORECASE)
        if s_match and t_match:
            wrong = rng.choice([d for d in range(2, 11) if d != k + 2])
            return src.replace(s_match.group(0), str(k + 2), 1), tgt.replace(t_match.group(0), str(wrong), 1)
    return None


def inject(src: list[str], tgt: list[str], share: float, seed: int) -> tuple[list[str], list[str], list[str]]:
    """The noisy corpus and each pair's kind ("clean" or one of KINDS)."""
    rng = random.Random(seed)
    n_each = round(share * len(src) / len(KINDS))
    kinds = ["clean"] * len(src)
    src, tgt = list(src), list(tgt)
    numbered = [i for i in range(len(src)) if number_pair(src[i], tgt[i], random.Random(0))]
    for i in rng.sample(numbered, min(n_each, len(numbered))):
        src[i], tgt[i] = number_pair(src[i], tgt[i], rng)  # type: ignore[misc]
        kinds[i] = "numbers"
    free = [i for i in range(1, len(src)) if kinds[i] == "clean"]
    chosen = rng.sample(free, n_each * (len(KINDS) - 1))
    groups = {k: chosen[j * n_each : (j + 1) * n_each] for j, k in enumerate(k for k in KINDS if k != "numbers")}
    moved = groups["misaligned"][1:] + groups["misaligned"][:1]
    shuffled = [tgt[j] for j in moved]
    for i, t in zip(groups["misaligned"], shuffled):
        tgt[i] = t
    for i in groups["copy"]:
        tgt[i] = src[i]
    third = n_each // 3
    fr = generate(third, "en", "fr", seed)[1]
    es = generate(third, "en", "es", seed + 1)[1]
    english = [src[j] for j in rng.sample(range(len(src)), n_each - 2 * third)]
    for i, t in zip(groups["wrong_language"], fr + es + english):
        tgt[i] = t
    for i in groups["truncated"]:
        words = tgt[i].split()
        tgt[i] = " ".join(words[: max(1, round(len(words) * rng.uniform(0.3, 0.6)))])
    for k, idx in groups.items():  # before near-duplicates: each copies a pair that stays clean
        for i in idx:
            kinds[i] = k
    clean = [j for j in range(len(src)) if kinds[j] == "clean"]
    for i in groups["near_duplicate"]:
        j = clean[rng.randrange(max(1, np.searchsorted(clean, i)))]  # an earlier clean pair
        src[i] = " ".join(re.sub(r"[^\w\s]", " ", src[j]).lower().split())
        tgt[i] = " ".join(re.sub(r"[^\w\s]", " ", tgt[j]).lower().split())
    for i, lang in zip(groups["wrong_language"], ["fr"] * third + ["es"] * third + ["en"] * n_each):
        kinds[i] = f"wrong_language.{lang}"  # reported as wrong_language, and per language
    return src, tgt, kinds


def inject_held_out(src: list[str], tgt: list[str], share: float, seed: int) -> tuple[list[str], list[str], list[str]]:
    """The noisy corpus of --noise-kinds held-out and each pair's kind ("clean", or one of HELD_OUT
    with its variant: wrong_language.ru.sentence, boilerplate.en, mixed.cut)."""
    rng = random.Random(seed)
    n_each = round(share * len(src) / len(HELD_OUT))
    kinds, tgt = ["clean"] * len(src), list(tgt)
    chosen = rng.sample(range(len(src)), n_each * len(HELD_OUT))
    groups = {k: chosen[j * n_each : (j + 1) * n_each] for j, k in enumerate(HELD_OUT)}
    for i, (kind, text) in zip(groups["wrong_language"], wrong_languages(n_each, rng)):
        tgt[i], kinds[i] = text, kind
    for i in groups["halved"]:
        tgt[i], kinds[i] = tgt[i][: len(tgt[i]) // 2].rstrip(), "halved"
    for j, i in enumerate(groups["boilerplate"]):
        where = ("de", "en", "none")[3 * j // n_each]
        numbers = {"n": rng.randint(1, 30), "m": rng.randint(1, 12), "year": rng.randint(2005, 2025)}
        tgt[i], kinds[i] = rng.choice(BOILERPLATE[where]).format(**numbers), f"boilerplate.{where}"
    for j, i in enumerate(groups["mixed"]):
        if j < n_each // 2:  # code-switching: German, then English, in one line
            words, other = tgt[i].split(), src[i].split()
            tgt[i], kinds[i] = " ".join(words[: len(words) // 2] + other[len(other) // 2 :]), "mixed.cut"
        else:  # both sides on one line, as extraction from a bilingual page leaves them
            tgt[i], kinds[i] = f"{tgt[i]} {src[i]}", "mixed.append"
    return list(src), tgt, kinds


def wrong_languages(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """N (kind, target) in languages the rule was not tuned on, a quarter each of it, pt, nl, ru: the
    language's hand-written sentences, then phrases of the built-in corpus's generator in it."""
    out = []
    for k, lang in enumerate(SENTENCES):
        size = n // len(SENTENCES) + (k < n % len(SENTENCES))
        written = list(SENTENCES[lang])[:size]
        out += [(f"wrong_language.{lang}.sentence", text) for text in written]
        out += [(f"wrong_language.{lang}.phrase", sentence(rng, (lang,))[lang]) for _ in range(size - len(written))]
    return out


def write(prefix: Path, src: list[str], tgt: list[str]) -> None:
    """PREFIX.en.gz and PREFIX.de.gz (gzipped: Multi30k-sized inputs are prepared in the driver); a
    file that already holds these lines is left as it is, so a rerun keeps the scores made of it."""
    for lang, lines in (("en", src), ("de", tgt)):
        path, text = Path(f"{prefix}.{lang}.gz"), "".join(line.replace("\n", " ") + "\n" for line in lines)
        if path.exists() and gzip.decompress(path.read_bytes()).decode("utf-8") == text:
            continue
        path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))


def prepare(
    work: Path, name: str, args: argparse.Namespace, extra: list[str], pair: str = "en-de", train: str = "noisy"
) -> tuple[dict, float | None]:
    """`raymt data prepare` of work/TRAIN (PAIR: its direction) into work/NAME, with Multi30k's val
    and test_2016_flickr; its manifest and seconds."""
    data = Path(args.data)
    cmd = [sys.executable, "-m", "raymt.data", "prepare", "--out", str(work / name), "--overwrite"]
    cmd += ["--train", f"{pair}:{work / train}", "--valid", f"{pair}:{data / 'val'}"]
    cmd += ["--test", f"{pair}:{data / 'test_2016_flickr'}", *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True).stdout
    seconds = None if "already prepared" in out else time.time() - t0  # None: a rerun reused it
    return json.loads((work / name / "manifest.json").read_text()), seconds


def kept_by_kind(work: Path, name: str, src: list[str], tgt: list[str], kinds: list[str]) -> dict[str, float]:
    """The share of each kind's pairs a prepared corpus dropped (its shards decoded and matched)."""
    tok = Tokenizer.load(work / name / "spm.model")
    files = sorted((work / name / "train").rglob("*.parquet"))
    table = pq.read_table(files)
    kept = Counter(
        zip(map(tok.decode, table.column("src_ids").to_pylist()), map(tok.decode, table.column("tgt_ids").to_pylist()))
    )
    keys = zip(
        map(tok.decode, tok.encode_batch([s.strip() for s in src])),
        map(tok.decode, tok.encode_batch([t.strip() for t in tgt])),
    )
    dropped, total = Counter(), Counter()
    for key, kind in zip(keys, kinds):
        parts = kind.split(".")
        for name in {".".join(parts[: k + 1]) for k in range(len(parts))}:  # each kind and its variants
            total[name] += 1
            dropped[name] += kept[key] == 0
        kept[key] -= kept[key] > 0
    return {k: dropped[k] / total[k] for k in total}


def score_filter(work: Path, args: argparse.Namespace, kinds: list[str]) -> dict:
    """`raymt data score` of the noisy corpus and of Multi30k's validation set (`--valid`); the
    threshold dropping --clean-drop of the clean pairs (chosen with the labels) and what it drops
    of each kind."""
    cmd = [sys.executable, "-m", "raymt.data", "score", "--forward", args.forward, "--backward", args.backward]
    cmd += ["--corpus", str(work / "noisy"), "--valid", str(Path(args.data) / "val")] + (["--gpu"] if args.gpu else [])
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    seconds = time.time() - t0
    values = read_scores(work / "noisy.scores")
    clean = values[np.array([k == "clean" for k in kinds])]
    threshold = float(np.quantile(clean[~np.isnan(clean)], args.clean_drop))
    return {"threshold": threshold, "dropped": dropped_by_kind(values, kinds, threshold), "score_s": round(seconds, 1)}


def read_scores(location: Path) -> np.ndarray:
    """A score directory's scores in line order."""
    return pq.read_table(sorted(location.glob("part-*.parquet"))).column("score").to_numpy()


def dropped_by_kind(values: np.ndarray, kinds: list[str], threshold: float) -> dict[str, float]:
    """The share of each kind's pairs scoring under `threshold` (an unscored pair counts as dropped)."""
    return {
        k: float(np.mean([not s >= threshold for s, kk in zip(values, kinds) if kk.split(".")[0] == k]))
        for k in ("clean", *KINDS)
    }


def label_free(work: Path, args: argparse.Namespace, kinds: list[str]) -> dict[str, dict]:
    """The thresholds a user can set without labels, as prepare draws them (raymt.data.scores):
    --keep-best F over the noisy corpus's scores, --calibrate-valid Q over the validation set's;
    each one's threshold, its prepare flags and what it drops of each kind."""
    from raymt.data import scores

    values = read_scores(work / "noisy.scores")
    valid = read_scores(work / "noisy.scores" / scores.VALID_DIR)
    rules = {
        "keep_best": (scores.best_threshold(values, args.keep_best), ["--keep-best", repr(args.keep_best)]),
        "calibrate_valid": (
            scores.calibrated_threshold(valid, args.clean_drop),
            ["--calibrate-valid", repr(args.clean_drop)],
        ),
    }
    return {
        name: {"threshold": t, "flags": flags, "dropped": dropped_by_kind(values, kinds, t)}
        for name, (t, flags) in rules.items()
    }


def train(work: Path, args: argparse.Namespace, name: str, corpus: str, pair: str = "en-de") -> dict:
    """The recipe trained for --train-steps on a prepared corpus as work/run-NAME (a finished run is
    kept: a rerun of the benchmark goes on where it stopped); its summary.json."""
    run = work / f"run-{name}"
    if not (run / "summary.json").exists():
        src_lang, tgt_lang = pair.split("-")
        cmd = [sys.executable, "-m", "raymt", "train", "--config", args.recipe, "--corpus", corpus]
        cmd += ["--storage-path", str(work), "--name", run.name, "--src-lang", src_lang, "--tgt-lang", tgt_lang]
        cmd += ["--max-steps", str(args.train_steps)]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads((run / "summary.json").read_text())


def bleu_row(summary: dict) -> dict:
    """A training's test_2016_flickr figures and time from its summary."""
    test = summary["test"]
    return {
        "bleu": round(test["bleu"], 2),
        "chrf": round(test["chrf"], 2),
        "minutes": round(summary["wall_time_s"] / 60, 1),
    }


def train_scorers(work: Path, args: argparse.Namespace) -> None:
    """The scorers a pipeline without clean data has: the noisy arm's en->de model (forward) and a
    de->en model trained on the noisy corpus for as many updates (backward)."""
    prepare(work, "rules-off", args, NO_RULES)
    prepare(work, "rules-off-de-en", args, NO_RULES, pair="de-en")
    args.forward = train(work, args, "noisy", str(work / "rules-off"))["best_checkpoint"]
    args.backward = train(work, args, "noisy-de-en", str(work / "rules-off-de-en"), pair="de-en")["best_checkpoint"]


def prepare_pairs(work: Path, name: str, args: argparse.Namespace, src: list[str], tgt: list[str]) -> str:
    """Pairs written as work/NAME and prepared, rules off, into work/NAME-corpus (its path)."""
    write(work / name, src, tgt)
    prepare(work, f"{name}-corpus", args, NO_RULES, train=name)
    return str(work / f"{name}-corpus")


def train_arms(work: Path, args: argparse.Namespace, clean: tuple, noisy: tuple, report: dict) -> dict:
    """test_2016_flickr BLEU of the recipe trained on clean, noisy and cleaned (rules, language ID
    and, with scores, the score filter) Multi30k, the share of the BLEU lost that cleaning won back,
    and with --oracle on the noisy corpus's clean pairs alone (what a perfect filter would keep)."""
    prepare(work, "rules-off", args, NO_RULES)
    if "score" not in report:  # else prepared with the score filter's threshold
        prepare(work, "cleaned", args, RULES)
    corpora = {"clean": prepare_pairs(work, "clean", args, *clean)}
    corpora |= {"noisy": str(work / "rules-off"), "cleaned": str(work / "cleaned")}
    if args.oracle:
        src, tgt, kinds = noisy
        kept = [(s, t) for s, t, k in zip(src, tgt, kinds) if k == "clean"]
        corpora["oracle"] = prepare_pairs(work, "oracle", args, [s for s, _ in kept], [t for _, t in kept])
    for name in report.get("label_free", {}):  # the cleaned arms of the thresholds without labels
        corpora[f"cleaned-{name}"] = str(work / f"cleaned-{name}")
    rows = {name: bleu_row(train(work, args, name, corpus)) for name, corpus in corpora.items()}
    won = rows["cleaned"]["bleu"] - rows["noisy"]["bleu"]
    out = rows | {"recovered": ratio(won, rows["clean"]["bleu"] - rows["noisy"]["bleu"])}
    for name in report.get("label_free", {}):
        gain = rows[f"cleaned-{name}"]["bleu"] - rows["noisy"]["bleu"]
        out[f"recovered_{name}"] = ratio(gain, rows["clean"]["bleu"] - rows["noisy"]["bleu"])
    if args.oracle:
        out["recovered_of_oracle"] = ratio(won, rows["oracle"]["bleu"] - rows["noisy"]["bleu"])
    return out


def ratio(won: float, lost: float) -> float | None:
    """won / lost, rounded (None: nothing lost)."""
    return round(won / lost, 3) if lost > 0 else None


def main() -> int:
    """Inject, clean, report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"), help="Multi30k en-de")
    p.add_argument("--work-dir", default="/tmp/raymt-noise")
    p.add_argument("--noise", type=float, default=0.3, help="share of noisy pairs, split over six kinds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--noise-kinds",
        choices=("tuned", "held-out"),
        default="tuned",
        help="tuned: the six kinds the rules were tuned on; held-out: other wrong languages, halved targets, "
        "boilerplate, mixed languages (the rules only)",
    )
    p.add_argument("--forward", help="an en->de raymt checkpoint: also the dual cross-entropy filter")
    p.add_argument("--backward", help="a de->en raymt checkpoint (with --forward)")
    p.add_argument(
        "--clean-drop", type=float, default=0.05, help="the score filter's threshold drops this of clean pairs"
    )
    p.add_argument(
        "--keep-best", type=float, default=0.9, help="the label-free keep_best threshold: keep this share of pairs"
    )
    p.add_argument("--limit", type=int, help="only the first N training pairs (a smoke run)")
    p.add_argument("--gpu", action="store_true", help="score on GPUs")
    p.add_argument("--train-steps", type=int, help="also train the recipe on clean, noisy and cleaned data (long)")
    p.add_argument(
        "--train-scorers",
        action="store_true",
        help="with --train-steps: the scorers are the noisy arm's en->de model and a de->en one trained "
        "on the noisy corpus for as many updates (no --forward/--backward)",
    )
    p.add_argument(
        "--oracle", action="store_true", help="with --train-steps: also train on the noisy corpus's clean pairs alone"
    )
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "multi30k-cpu.toml"))
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    if bool(args.forward) != bool(args.backward):
        p.error("--forward and --backward go together")
    if args.train_scorers and (args.forward or not args.train_steps):
        p.error("--train-scorers goes with --train-steps and without --forward/--backward")
    if args.noise_kinds == "held-out" and (args.forward or args.train_steps):
        p.error("--noise-kinds held-out measures the rules only: drop --forward and --train-steps")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    src, tgt = read(Path(args.data) / "train", "en")[: args.limit], read(Path(args.data) / "train", "de")[: args.limit]
    held_out = args.noise_kinds == "held-out"
    noisy_src, noisy_tgt, kinds = (inject_held_out if held_out else inject)(src, tgt, args.noise, args.seed)
    noisy, rules = ("noisy-held-out", "rules-held-out") if held_out else ("noisy", "rules")
    write(work / noisy, noisy_src, noisy_tgt)
    manifest, seconds = prepare(work, rules, args, RULES, train=noisy)
    # The same without language ID: what the wrong_language rule adds to the others.
    prepare(work, f"{rules}-no-langid", args, [r for r in RULES if r != "--wrong-language"], train=noisy)
    report = {
        "noise_kinds": args.noise_kinds,
        "seed": args.seed,
        "pairs": len(src),
        "kinds": dict(Counter(".".join(k.split(".")[: n + 1]) for k in kinds for n in range(k.count(".") + 1))),
        "rules": {
            "dropped": kept_by_kind(work, rules, noisy_src, noisy_tgt, kinds),
            "dropped_without_langid": kept_by_kind(work, f"{rules}-no-langid", noisy_src, noisy_tgt, kinds),
            "by_rule": {k: v for k, v in manifest["corpora"][0]["train"]["dropped"].items() if v},
            "prepare_s": round(seconds, 1) if seconds else None,
            "pairs_per_s": round(len(src) / seconds) if seconds else None,
        },
    }
    if args.train_scorers:  # with --train-steps (checked above)
        train_scorers(work, args)
    if args.forward:
        report["score"] = score_filter(work, args, kinds)
        report["score"]["prepare"] = prepare(
            work, "scored", args, [*NO_RULES, "--min-score", repr(report["score"]["threshold"])]
        )[0]["corpora"][0]["train"]["dropped"]
        report["score"] |= {"forward": args.forward, "backward": args.backward}
        prepare(work, "cleaned", args, [*RULES, "--min-score", repr(report["score"]["threshold"])])
        report["combined"] = kept_by_kind(work, "cleaned", noisy_src, noisy_tgt, kinds)
        report["label_free"] = label_free(work, args, kinds)
        for name, row in report["label_free"].items():  # prepare's own figures at each threshold
            row["prepare"] = prepare(work, f"scored-{name}", args, [*NO_RULES, *row["flags"]])[0]
            row["prepare"] = row["prepare"]["corpora"][0]["train"]["dropped"]
            prepare(work, f"cleaned-{name}", args, [*RULES, *row["flags"]])
            row["combined"] = kept_by_kind(work, f"cleaned-{name}", noisy_src, noisy_tgt, kinds)
    if args.train_steps:
        report["bleu"] = train_arms(work, args, (src, tgt), (noisy_src, noisy_tgt, kinds), report)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def print_table(report: dict) -> None:
    """One Markdown row per kind and variant: its pairs, dropped by the rules and language ID, by the
    rules without language ID, by the score filter, by both."""
    score, both = report.get("score", {}).get("dropped", {}), report.get("combined", {})
    dropped, without = report["rules"]["dropped"], report["rules"].get("dropped_without_langid", {})
    print("\n| kind | pairs | dropped by rules + language ID | without language ID | by the score filter | by both |")
    print("|---|---|---|---|---|---|")
    kinds = ("clean", *(HELD_OUT if report.get("noise_kinds") == "held-out" else KINDS))
    for kind in sorted(dropped, key=lambda k: (kinds.index(k.split(".")[0]), k)):
        pairs = report["kinds"].get(kind, 0)
        cells = [
            f"{100 * table[kind]:.1f}% ({round(table[kind] * pairs):,})" if kind in table else "-"
            for table in (dropped, without, score, both)
        ]
        print(f"| {kind} | {pairs:,} | {' | '.join(cells)} |")
    print(f"by rule: {report['rules']['by_rule']}")
    if report["rules"]["prepare_s"] is None:
        print("prepare: reused (prepared by an earlier run with the same inputs and options)")
    else:
        print(f"prepare: {report['rules']['prepare_s']} s, {report['rules']['pairs_per_s']:,} pairs/s end to end")
    if "score" in report:
        threshold, seconds = report["score"]["threshold"], report["score"]["score_s"]
        print(f"score filter: threshold {threshold:.4f}, scoring {seconds} s (a rerun's: what was missing)")
        print_thresholds(report)
    if "bleu" in report:
        print("\n| trained on | test_2016_flickr BLEU | chrF | minutes |\n|---|---|---|---|")
        for name in ("clean", "noisy", "cleaned", *(f"cleaned-{n}" for n in report.get("label_free", {})), "oracle"):
            if name in report["bleu"]:
                row = report["bleu"][name]
                print(f"| {name} | {row['bleu']:.2f} | {row['chrf']:.2f} | {row['minutes']} |")
        print(f"BLEU lost to noise that cleaning won back: {report['bleu']['recovered']} (the labels' threshold)")
        for name in report.get("label_free", {}):
            print(f"  with the {name} threshold (no labels): {report['bleu'][f'recovered_{name}']}")
        if "recovered_of_oracle" in report["bleu"]:
            print(f"of what the noisy corpus's clean pairs alone win back: {report['bleu']['recovered_of_oracle']}")


def print_thresholds(report: dict) -> None:
    """One Markdown row per kind: what the score filter drops at each threshold, alone and with the rules."""
    rows = {"labels": (report["score"], report.get("combined", {}))}
    rows |= {name: (row, row.get("combined", {})) for name, row in report.get("label_free", {}).items()}
    names = " | ".join(f"score: {n}" for n in rows) + " | " + " | ".join(f"both: {n}" for n in rows)
    print(f"\n| kind | {names} |\n|---|" + "---|" * (2 * len(rows)))
    print("| threshold | " + " | ".join(f"{r['threshold']:.4f}" for r, _ in rows.values()) + " |" * (len(rows) + 1))
    for kind in ("clean", *KINDS):
        alone = [f"{100 * r['dropped'][kind]:.1f}%" for r, _ in rows.values()]
        both = [f"{100 * c[kind]:.1f}%" if kind in c else "-" for _, c in rows.values()]
        print(f"| {kind} | {' | '.join(alone + both)} |")


if __name__ == "__main__":
    sys.exit(main())
