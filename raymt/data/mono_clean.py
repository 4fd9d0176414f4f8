"""`raymt data mono`: monolingual text made ready for back-translation: read, cleaned, de-duplicated,
decontaminated and sampled into one gzipped text file that `raymt backtranslate --input` reads.

Reads one or more `--input`s, each what `raymt backtranslate --input` reads (raymt.data.mono: text,
plain or compressed, TSV, JSONL, Parquet/Arrow; a file, a glob, a directory or a URI), and keeps a
line unless a rule drops it; each dropped line is counted by the first rule that drops it, in this
order: `invalid` (not UTF-8, bad JSON, no such column), `empty`, `too_short` / `too_long`
(--min-chars/--max-chars, --min-words/--max-words), the content rules of one text `alpha_ratio` and
`repeats` (raymt.data.clean.side_rule), `wrong_language` (language ID: prepare's rule,
raymt.data.clean.wrong_language), `excluded` (its key is a line of an --exclude set: validation and
test sets), `duplicate` and `near_duplicate` (the first in input order stays; prepare's rules), then
`sampled_out` (--max-lines N: the N lines of the smallest seeded hashes of their keys, so the same
lines whatever the inputs' order or files). A line's key is its text stripped, or with --near-dedup
its `raymt.data.clean.near_text` (lower case, words only, digits as 0).

One process streams the inputs in chunks of CHUNK_LINES lines (no Ray): language ID, the costly
rule, runs at tens of thousands of lines a second on a core, and de-duplication needs one view of
every line in input order anyway. Memory is bounded by what is kept, never by the input: 8 bytes
per distinct line for each de-duplication (`HashSet64`: sorted numpy runs, against ~70 in a Python
set), the --exclude sets' keys, and with --max-lines the N sampled lines; without --max-lines the
kept lines are written as they come.

The output (`--output`, a directory or URI) holds `mono.<lang>.gz` (the kept lines, in input order,
or with --max-lines in the order of their hashes) and `mono.json` (the settings, the inputs' and
exclude sets' fingerprints, the counts by rule, the files), built in a staging directory and moved
or uploaded into place with the record last (raymt.data.staging): whole or not at all. A rerun
with the same settings and inputs finds it and does nothing; with others it is refused
(raymt.shard_job.SettingsRecord). `raymt backtranslate --input OUTPUT` reads the files the record
lists (raymt.data.mono). In Python: `run(MonoConfig(input=[SPEC], output=DIR, lang="de"))`.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow.fs as pafs

from raymt import langid, storage
from raymt.command import command_line, flag, options
from raymt.config import CorpusOptions
from raymt.data.clean import ContentRules, near_text, side_rule, wrong_language
from raymt.data.mono import (
    MONO_FILE,
    InputFile,
    check_columns,
    default_column,
    file_info,
    input_files,
    raw_items,
    text_of,
)
from raymt.data.scores import file_fingerprint
from raymt.data.staging import build_staged
from raymt.data.text import resolve
from raymt.errors import check
from raymt.shard_job import SettingsRecord

PROG = "raymt.data mono"
HELP = "clean, de-duplicate, decontaminate and sample monolingual text for back-translation"  # `raymt data --help`
FORMAT = "raymt-mono/1"
# The counts of mono.json, in the order the rules apply: read = the drops + kept.
COUNTS = (
    "read",
    "invalid",
    "empty",
    "too_short",
    "too_long",
    "alpha_ratio",
    "repeats",
    "wrong_language",
    "excluded",
    "duplicate",
    "near_duplicate",
    "sampled_out",
    "kept",
)
CHUNK_LINES = 10_000  # lines judged at a time (language ID in one batch)
PROGRESS_S = 30.0  # seconds between progress lines


@dataclass(kw_only=True)
class MonoConfig:
    """`raymt data mono`: the inputs, language and output of monolingual text for back-translation,
    its rules (prepare's where they apply to one text: CorpusOptions' thresholds), the sets whose
    lines it removes and its sample."""

    input: list[str] = flag(
        help="text (plain, .gz/.xz/.zst/.bz2), .tsv, .jsonl or .parquet: a file, a glob, a directory or a URI "
        "(repeatable; read in order)",
        metavar="SPEC",
        repeat=True,
        required=True,
    )
    output: str = flag(
        help="mono.<lang>.gz and mono.json go here (whole, or not at all)", metavar="DIR|URI", required=True
    )
    lang: str = flag(help="the text's language: language ID's, and the output file's name", required=True)
    column: Optional[str] = flag(None, "TSV: 0-based column (default 0); JSONL/Parquet: key (default --lang)")
    min_chars: int = flag(1, "drop lines of fewer characters (default %(default)s)")
    max_chars: int = flag(CorpusOptions.max_chars, "drop lines of more characters (default %(default)s)")
    min_words: int = flag(1, "drop lines of fewer words, split at spaces (default %(default)s)")
    max_words: Optional[int] = flag(None, "drop lines of more words (default: no limit)")
    alpha_ratio: bool = flag(True, "keep lines of few letters (the alpha_ratio rule off)", name="--no-alpha-ratio")
    alpha_ratio_min: float = flag(
        CorpusOptions.alpha_ratio_min, "alpha_ratio: the least share of letters (default %(default)s)"
    )
    repeats: bool = flag(True, "keep lines that repeat a word n-gram (the repeats rule off)", name="--no-repeats")
    repeats_max: int = flag(
        CorpusOptions.repeats_max, "repeats: the most copies of a word n-gram in a row (default %(default)s)"
    )
    wrong_language: bool = flag(True, "no language ID (the wrong_language rule off)", name="--no-wrong-language")
    wrong_language_confidence: float = flag(
        CorpusOptions.wrong_language_confidence,
        "drop a line when language ID is this sure it is not --lang (default %(default)s)",
    )
    wrong_language_min_chars: int = flag(
        CorpusOptions.wrong_language_min_chars,
        "lines of fewer characters are not judged by language ID (default %(default)s)",
    )
    dedup: bool = flag(True, "keep exact duplicates", name="--no-dedup")
    near_dedup: bool = flag(False, "also drop near-duplicates: equal after lower-casing, words only, digits as 0")
    exclude: list[str] = flag(
        help="drop the lines of this validation/test set: a text file or PREFIX (PREFIX.<lang>); repeatable",
        metavar="SPEC",
        repeat=True,
    )
    max_lines: Optional[int] = flag(
        None, "keep at most N lines, chosen by a seeded hash (the same whatever the inputs' order)", metavar="N"
    )
    seed: int = flag(1, "the seed of --max-lines' hash (default %(default)s)")

    def __post_init__(self) -> None:
        self.input = [self.input] if isinstance(self.input, str) else list(self.input)
        self.exclude = [self.exclude] if isinstance(self.exclude, str) else list(self.exclude)
        check(bool(self.input), "--input is missing: pass monolingual text (a file, glob, directory or URI)")
        check(bool(self.output), "--output is missing: pass a directory or URI")
        check(
            bool(self.lang) and self.lang.replace("-", "").replace("_", "").isalnum(),
            f"--lang {self.lang!r} must be a language code such as de or pt_BR",
        )
        for name in ("min_chars", "min_words"):
            check(getattr(self, name) >= 0, f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 0")
        check(self.max_chars >= max(1, self.min_chars), f"--max-chars {self.max_chars} must be >= --min-chars and 1")
        check(
            self.max_words is None or self.max_words >= max(1, self.min_words),
            f"--max-words {self.max_words} must be >= --min-words and 1",
        )
        for name in ("alpha_ratio_min", "wrong_language_confidence"):
            value = getattr(self, name)
            check(0 < value <= 1, f"--{name.replace('_', '-')} {value} must be in (0, 1]")
        check(self.repeats_max >= 1, f"--repeats-max {self.repeats_max} must be >= 1")
        check(
            self.wrong_language_min_chars >= 1,
            f"--wrong-language-min-chars {self.wrong_language_min_chars} must be >= 1",
        )
        check(self.max_lines is None or self.max_lines >= 1, f"--max-lines {self.max_lines} must be >= 1")
        check(
            not self.wrong_language or langid.model_label(self.lang) is not None,
            f"--lang {self.lang}: language ID (fastText lid.176) cannot identify it: pass --no-wrong-language",
        )

    @property
    def rules(self) -> ContentRules:
        """The content rules of one text (alpha_ratio, repeats, wrong_language) as prepare's code takes them."""
        names = ("alpha_ratio", "alpha_ratio_min", "repeats", "repeats_max", "wrong_language")
        names += ("wrong_language_confidence", "wrong_language_min_chars")
        return ContentRules(**{name: getattr(self, name) for name in names}, src_lang=self.lang)

    @property
    def file_name(self) -> str:
        """The kept lines' file: mono.<lang>.gz."""
        return f"mono.{self.lang}.gz"


@dataclass(frozen=True)
class MonoResult:
    """A finished `raymt data mono`: where its output is and its record (mono.json)."""

    output: str
    record: dict

    @property
    def counts(self) -> dict[str, int]:
        """Lines read, dropped by each rule and kept (COUNTS)."""
        return self.record["counts"]

    @property
    def text(self) -> str:
        """The kept lines' file (`raymt backtranslate --input` reads it, or the output directory)."""
        return storage.join(self.output, self.record["files"][0])


# ---------------------------------------------------------------- the checks before any work


RECORD = SettingsRecord(
    MONO_FILE,
    "monolingual text of raymt data mono",
    flags={
        **{o.path[-1]: o.flag for o in options(MonoConfig)},
        "input": "--input (or its files changed)",
        "exclude": "--exclude (or its files changed)",
        "seed": "--seed",
    },
    format=FORMAT,
    marks="",  # a directory without mono.json must be empty
)


@dataclass
class MonoJob:
    """Everything checked before any line is read: the config, the output, each --input's and
    --exclude's files, the settings a rerun must have, and a finished run's record."""

    cfg: MonoConfig
    output: str
    inputs: list[list[InputFile]]
    excludes: list[list[InputFile]]
    settings: dict = field(default_factory=dict)
    done: Optional[dict] = None  # mono.json of a finished run with these settings, its files there


def exclude_files(spec: str, lang: str) -> list[InputFile]:
    """The files of --exclude SPEC: PREFIX.<lang> (plain or compressed) where one exists, else SPEC
    as --input reads it; a TSV is refused (which column is the language's?)."""
    glob_like = not storage.is_uri(spec) and any(c in spec for c in "*?[")
    if glob_like or storage.file_type(spec) != pafs.FileType.NotFound:
        files = input_files(spec, "--exclude")
    else:
        try:
            files = [file_info(resolve(spec, lang), "--exclude")]
        except ValueError:
            raise ValueError(
                f"--exclude {spec}: no such file, nor {spec}.{lang} (plain or .gz/.xz/.zst/.bz2): pass a "
                "validation or test set's text file or its PREFIX"
            ) from None
    for f in files:
        check(f.kind != "tsv", f"--exclude {f.path}: a TSV file has no language's column: pass its {lang} side as text")
    return files


def fingerprints(files: Sequence[InputFile]) -> list[dict]:
    """Each file's path, size and sha256 of its first and last MiB (`raymt.data.scores.file_fingerprint`)."""
    return [{"path": f.path, **file_fingerprint(f.path)} for f in files]


def settings(job: MonoJob) -> dict:
    """What fixes the output: a rerun into the same --output must have the same (the seed only
    when it samples)."""
    cfg = job.cfg
    values = {o.path[-1]: getattr(cfg, o.path[-1]) for o in options(MonoConfig)}
    del values["output"]
    values["seed"] = cfg.seed if cfg.max_lines is not None else None
    values["input"] = [{"spec": s, "files": fingerprints(f)} for s, f in zip(cfg.input, job.inputs)]
    values["exclude"] = [{"spec": s, "files": fingerprints(f)} for s, f in zip(cfg.exclude, job.excludes)]
    return values


def plan(cfg: MonoConfig) -> MonoJob:
    """The job, checked before any line is read: every input and exclude set there and readable (its
    columns), the output new, empty or this very job's (a finished one: `done`); one-line errors."""
    inputs = [input_files(spec) for spec in cfg.input]
    for files in inputs:
        check_columns(files, cfg.column, cfg.lang)
        for f in files:
            default_column(f.kind, cfg.column, cfg.lang)  # a TSV's --column must be a number
    excludes = [exclude_files(spec, cfg.lang) for spec in cfg.exclude]
    for files in excludes:
        check_columns(files, None, cfg.lang)
    job = MonoJob(cfg, storage.output_location(cfg.output, "--output"), inputs, excludes)
    job.settings = settings(job)
    record = RECORD.check(job.output, job.settings)
    files = (record or {}).get("files") or []
    if files and all(storage.exists(storage.join(job.output, name)) for name in files):
        job.done = record  # else a rerun replaces what is there
    return job


# ---------------------------------------------------------------- the rules


class HashSet64:
    """A set of 64-bit hashes in sorted numpy runs (8 bytes a hash): runs of about equal size merge,
    so a lookup searches O(log n) runs; a chunk's hashes are looked up and added at once."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs)

    def contains(self, hashes: Sequence[int]) -> np.ndarray:
        """Whether each hash is in the set (a bool array)."""
        h = np.asarray(hashes, dtype=np.uint64)
        found = np.zeros(len(h), dtype=bool)
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, h), len(run) - 1)
            found |= run[at] == h
        return found

    def add(self, hashes: Sequence[int]) -> None:
        """Add hashes that are not in the set yet."""
        if not len(hashes):
            return
        self.runs.append(np.unique(np.asarray(hashes, dtype=np.uint64)))
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            new, old = self.runs.pop(), self.runs.pop()
            self.runs.append(np.sort(np.concatenate([old, new]), kind="stable"))  # two sorted runs: a merge


def clean_line(raw: Optional[str]) -> Optional[str]:
    """A read line as it is kept: one line (a JSON value's newlines as spaces), stripped; None when invalid."""
    return None if raw is None else raw.replace("\n", " ").strip()


class MonoFilter:
    """The rules over the lines in input order, chunk by chunk (`chunk`), with the counts; the
    --exclude sets' keys (`exclude`); with --max-lines the N lines of the smallest hashes (`sampled`)."""

    def __init__(self, cfg: MonoConfig) -> None:
        self.cfg = cfg
        self.rules = cfg.rules
        self.repeated = self.rules.repeated() if cfg.repeats else None
        self.key = b"raymt-mono-%d" % (cfg.seed if cfg.max_lines is not None else 1)
        self.hashing = cfg.dedup or cfg.near_dedup or cfg.max_lines is not None
        self.excluded: set[int] = set()
        self.exact, self.near = HashSet64(), HashSet64()
        self.heap: list[tuple[int, str]] = []  # (-hash, line): the largest hash of the sample on top
        self.offered = 0  # lines offered to the sample
        self.counts: Counter = Counter({name: 0 for name in COUNTS})

    def exclude(self, lines: Iterable[Optional[str]]) -> int:
        """Add the keys of an --exclude set's lines (read lines: empty and invalid ones aside); its line count."""
        kept = [text for text in map(clean_line, lines) if text]
        self.excluded.update(map(self.dedup_key, kept))
        self.hashing = True
        return len(kept)

    def hash(self, text: str) -> int:
        """A line's keyed 64-bit hash."""
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, key=self.key).digest(), "little")

    def dedup_key(self, text: str) -> int:
        """The hash of a line's key: its text, or with --near-dedup its near_text (what --exclude matches too)."""
        return self.hash(near_text(text) if self.cfg.near_dedup else text)

    def text_rule(self, text: Optional[str]) -> Optional[str]:
        """The first rule of the text alone that drops a line, or None."""
        cfg = self.cfg
        if text is None:
            return "invalid"
        if not text:
            return "empty"
        if len(text) < cfg.min_chars:
            return "too_short"
        if len(text) > cfg.max_chars:
            return "too_long"
        words = len(text.split())
        if words < cfg.min_words:
            return "too_short"
        if cfg.max_words is not None and words > cfg.max_words:
            return "too_long"
        return side_rule(text, self.rules, self.repeated)

    def chunk(self, raw: Sequence[Optional[str]]) -> list[str]:
        """Judge a chunk of read lines (None: invalid); the lines to write now, in input order (none
        with --max-lines: they wait in the sample)."""
        self.counts["read"] += len(raw)
        texts = []
        for text in map(clean_line, raw):
            rule = self.text_rule(text)
            if rule:
                self.counts[rule] += 1
            else:
                texts.append(text)
        if self.cfg.wrong_language and texts:
            wrong = wrong_language(texts, [self.cfg.lang] * len(texts), self.rules)
            self.counts["wrong_language"] += sum(wrong)
            texts = [t for t, w in zip(texts, wrong) if not w]
        if not self.hashing:
            self.counts["kept"] += len(texts)
            return texts
        return self.offer(*self.dedup(texts))

    def dedup(self, texts: list[str]) -> tuple[list[str], list[int]]:
        """The lines not excluded and not (near-)duplicates of a line kept before, and their key hashes."""
        cfg = self.cfg
        keys = [self.dedup_key(t) for t in texts]
        exact = [self.hash(t) for t in texts] if cfg.near_dedup else keys
        dedup = cfg.dedup or cfg.near_dedup
        seen = self.exact.contains(exact) if dedup else None
        seen_near = self.near.contains(keys) if cfg.near_dedup else None
        new: set[int] = set()
        new_near: set[int] = set()
        kept, kept_keys = [], []
        for i, (text, key, h) in enumerate(zip(texts, keys, exact)):
            if key in self.excluded:
                self.counts["excluded"] += 1
                continue
            if dedup and (seen[i] or h in new):  # an exact copy counts as duplicate under near_dedup too
                self.counts["duplicate"] += 1
                continue
            if seen_near is not None and (seen_near[i] or key in new_near):
                self.counts["near_duplicate"] += 1
                continue
            new.add(h)
            new_near.add(key)
            kept.append(text)
            kept_keys.append(key)
        if dedup:
            self.exact.add(list(new))
        if cfg.near_dedup:
            self.near.add(list(new_near))
        return kept, kept_keys

    def offer(self, texts: list[str], keys: list[int]) -> list[str]:
        """Without --max-lines, the lines (all kept); with it, each offered to the sample of the N
        smallest hashes, and nothing to write yet."""
        if self.cfg.max_lines is None:
            self.counts["kept"] += len(texts)
            return texts
        self.offered += len(texts)
        for text, key in zip(texts, keys):
            if len(self.heap) < self.cfg.max_lines:
                heapq.heappush(self.heap, (-key, text))
            elif key < -self.heap[0][0]:
                heapq.heapreplace(self.heap, (-key, text))
        return []

    def sampled(self) -> list[str]:
        """The sample's lines by hash (any input order: the same file), once every line is offered;
        its counts (kept, sampled_out)."""
        if self.cfg.max_lines is not None:
            self.counts["kept"], self.counts["sampled_out"] = len(self.heap), self.offered - len(self.heap)
        return [text for _, text in sorted((-neg, text) for neg, text in self.heap)]


# ---------------------------------------------------------------- reading and writing


def read_chunks(files: Sequence[InputFile], column: Optional[str], lang: str) -> Iterator[list[Optional[str]]]:
    """The files' lines in order (None for an invalid one), CHUNK_LINES at a time."""
    chunk: list[Optional[str]] = []
    for f in files:
        col = default_column(f.kind, column, lang)
        for n, raw in enumerate(raw_items(f, col)):
            chunk.append(text_of(raw, f.kind, col, n == 0))
            if len(chunk) == CHUNK_LINES:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def write_lines(out: BinaryIO, lines: Sequence[str]) -> None:
    """Lines into the gzipped output, one a line."""
    if lines:
        out.write("".join(line + "\n" for line in lines).encode())


def summary(counts: dict) -> str:
    """'empty 3, duplicate 2' for the rules that dropped lines."""
    return ", ".join(f"{rule} {counts[rule]:,}" for rule in COUNTS[1:-1] if counts.get(rule)) or "none"


def build(job: MonoJob, tmp: Path) -> dict:
    """Write the kept lines into `tmp`; the record's counts, files and exclude sets' sizes."""
    cfg = job.cfg
    lines = MonoFilter(cfg)
    exclude_lines = [lines.exclude(t for c in read_chunks(files, None, cfg.lang) for t in c) for files in job.excludes]
    files = [f for group in job.inputs for f in group]
    print(f"mono: reading {len(files)} file(s) of {cfg.lang} text", flush=True)
    t0 = shown = time.time()
    # mtime 0 and no name in the gzip header: the same lines make the same bytes
    with open(tmp / cfg.file_name, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as out:
        for chunk in read_chunks(files, cfg.column, cfg.lang):
            write_lines(out, lines.chunk(chunk))
            if time.time() - shown >= PROGRESS_S:
                shown = time.time()
                c = lines.counts
                rate = c["read"] / (shown - t0)
                kept = c["kept"] + lines.offered
                print(f"mono: {c['read']:,} lines read, {kept:,} kept, {rate:,.0f} lines/s", flush=True)
        write_lines(out, lines.sampled())
    counts = dict(lines.counts)
    assert counts["read"] == sum(counts[name] for name in COUNTS[1:]), counts
    if not counts["kept"]:
        raise ValueError(
            f"all {counts['read']:,} lines of --input were dropped ({summary(counts)}): check the inputs and "
            "--lang, or relax the rules"
        )
    return {"files": [cfg.file_name], "num_lines": counts["kept"], "counts": counts, "exclude_lines": exclude_lines}


def run(cfg: MonoConfig) -> MonoResult:
    """Clean, de-duplicate, decontaminate and sample `cfg.input` into `cfg.output` (nothing when it
    holds this very job); the result. Raises a one-line ValueError on a user error, before any line
    is read where it can."""
    t0 = time.time()
    job = plan(cfg)
    if job.done is not None:
        print(f"mono: {job.output} already holds this text (same inputs and settings)", flush=True)
        return MonoResult(job.output, job.done)
    entries = {**job.settings, "format": FORMAT, "command": command_line("data mono", cfg), "done": True}
    record = build_staged(job.output, lambda tmp: build(job, tmp), MONO_FILE, **entries)
    counts = record["counts"]
    print(
        f"mono: kept {counts['kept']:,} of {counts['read']:,} lines (dropped: {summary(counts)}) in "
        f"{time.time() - t0:.1f} s -> {storage.join(job.output, cfg.file_name)}",
        flush=True,
    )
    return MonoResult(job.output, record)
