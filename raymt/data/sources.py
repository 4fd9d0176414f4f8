"""What a prepare reads: `Source`s of specs and corpora, their row readers and the driver's checks of them."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import pyarrow.fs as pafs

from raymt import langid, storage
from raymt.config import CONTENT_RULES, CorpusSpec, PrepareConfig, check_corpora
from raymt.data import scores
from raymt.data.text import (
    COLUMNAR_SUFFIXES,
    TABLE_SUFFIXES,
    check_aligned,
    check_text_column,
    decode,
    file_kind,
    input_file_info,
    lines,
    record_batches,
    resolve,
    strip_compression,
    table_schema,
)
from raymt.errors import InputError
from raymt.storage import filesystem

KINDS = ("text", "tsv", "jsonl", "parquet", "pairs")

# Pairs per Ray Data block: big enough to amortize a task, small enough to spread a corpus
# over many tasks and to keep each task's memory flat.
BLOCK_ROWS = 20_000

TEST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Source:
    """One input of a split: line-aligned text files, a TSV/JSONL/Parquet file, or pairs in memory."""

    kind: str  # "text", "tsv", "jsonl", "parquet" or "pairs"
    # text: (src_path, tgt_path); tsv/jsonl: (path,); parquet: one or more .parquet/.arrow files.
    # Local paths or URIs (s3://, gs://, hdfs://, file://).
    paths: tuple[str, ...] = ()
    # tsv: 0-based column numbers (default "0"/"1"); jsonl/parquet: keys (default the language codes).
    src_col: Optional[str] = None
    tgt_col: Optional[str] = None
    pairs: Optional[tuple[list[str], list[str]]] = None  # kind "pairs": the built-in corpus
    # Generated parallel text (the built-in corpus): the content rules do not apply (`clean_config`).
    generated: bool = False
    # The SPEC it was read from (a --train PREFIX or file): its scores are SPEC.scores (raymt.data.scores).
    location: Optional[str] = None


# ---------------------------------------------------------------- reading pairs


def _text_rows(spec: dict, on_invalid: str) -> Iterator[tuple]:
    """(src, tgt, line) from two line-aligned files read in lockstep."""
    src_uri, tgt_uri = spec["paths"]
    end = object()
    n = 0
    for s, t in itertools.zip_longest(lines(src_uri), lines(tgt_uri), fillvalue=end):
        n += 1
        if s is end or t is end:
            short, long = (src_uri, tgt_uri) if s is end else (tgt_uri, src_uri)
            raise InputError(
                f"{short} ends after {n - 1} lines but {long} has more: line i of one "
                "must translate line i of the other; align the two files"
            )
        yield decode(s, src_uri, n, on_invalid), decode(t, tgt_uri, n, on_invalid), n
    if n == 0:
        raise InputError(f"{src_uri} and {tgt_uri} have no lines: pass files with sentence pairs")


def _tsv_rows(spec: dict, on_invalid: str) -> Iterator[tuple]:
    """(src, tgt, line) from the tab-separated columns of each line."""
    (uri,) = spec["paths"]
    cols = int(spec["src_col"]), int(spec["tgt_col"])
    need = max(cols)
    for n, raw in enumerate(lines(uri), 1):
        line = decode(raw, uri, n, on_invalid)
        if line is None:
            yield None, None, n
            continue
        fields = line.rstrip("\r").split("\t", need + 1)
        if len(fields) <= need:
            if not line.strip():
                yield "", "", n  # a blank line is an empty pair, dropped and counted as such
                continue
            raise InputError(
                f"{uri}:{n}: {len(fields)} tab-separated column(s) but column {need} "
                "is needed: fix the line, or pass --src-col/--tgt-col (0-based)"
            )
        yield fields[cols[0]], fields[cols[1]], n


def _jsonl_rows(spec: dict, on_invalid: str) -> Iterator[tuple]:
    """(src, tgt, line) from one JSON object per line."""
    (uri,) = spec["paths"]
    keys = spec["src_col"], spec["tgt_col"]
    for n, raw in enumerate(lines(uri), 1):
        line = decode(raw, uri, n, on_invalid)
        if line is None or not line.strip():
            yield (None, None, n) if line is None else ("", "", n)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(
                f"{uri}:{n}: not valid JSON ({err.msg} at column {err.colno}): write one JSON object per line"
            ) from None
        if not isinstance(obj, dict):
            raise InputError(
                f"{uri}:{n}: a JSON {type(obj).__name__}, not an object: write one "
                f'{{"{keys[0]}": ..., "{keys[1]}": ...}} object per line'
            )
        yield (*(_json_text(obj, key, uri, n) for key in keys), n)


def _json_text(obj: dict, key: str, uri: str, line: int) -> str:
    """The string under `key` of a JSONL object (null counts as empty)."""
    if key not in obj:
        raise InputError(
            f"{uri}:{line}: no key {key!r} (keys: {', '.join(map(repr, obj)) or 'none'}): "
            "pass --src-col/--tgt-col to name the keys"
        )
    value = obj[key]
    if value is not None and not isinstance(value, str):
        raise InputError(f"{uri}:{line}: {key!r} is a JSON {type(value).__name__}, not a string")
    return value or ""


def _table_rows(spec: dict, on_invalid: str) -> Iterator[tuple]:
    """(src, tgt, row) from string columns of Parquet/Arrow files; rows count on across files."""
    n = 0
    for uri in spec["paths"]:
        for batch in record_batches(uri, [spec["src_col"], spec["tgt_col"]], BLOCK_ROWS):
            # By name: Parquet returns the columns in file order, not in the order asked for.
            src, tgt = (batch.column(spec[c]).to_pylist() for c in ("src_col", "tgt_col"))
            for s, t in zip(src, tgt):
                n += 1
                yield s or "", t or "", n


def _pairs_rows(spec: dict, on_invalid: str) -> Iterator[tuple]:
    """(src, tgt, index) from in-memory lists."""
    for n, (s, t) in enumerate(zip(*spec["pairs"]), 1):
        yield s, t, n


ROW_READERS = {"text": _text_rows, "tsv": _tsv_rows, "jsonl": _jsonl_rows, "parquet": _table_rows, "pairs": _pairs_rows}


def pair_chunks(spec: dict, on_invalid: str, counts: Counter) -> Iterator[tuple[list, list, list]]:
    """Stripped (src, tgt, line) lists of at most BLOCK_ROWS pairs; counts input and invalid pairs."""
    src: list[str] = []
    tgt: list[str] = []
    lines: list[int] = []
    for s, t, n in ROW_READERS[spec["kind"]](spec, on_invalid):
        counts["input"] += 1
        if s is None or t is None:
            counts["invalid_utf8"] += 1
            continue
        src.append(s.strip())
        tgt.append(t.strip())
        lines.append(n)
        if len(src) == BLOCK_ROWS:
            yield src, tgt, lines
            src, tgt, lines = [], [], []
    if src:
        yield src, tgt, lines


def read_eval(cfg: PrepareConfig, sources: list[Source]) -> tuple[list[str], list[str]]:
    """A validation/test set read whole on the driver: (sources, references), stripped, nothing dropped."""
    # Invalid bytes become U+FFFD under --skip-invalid: a dropped line would misalign scoring.
    on_invalid = "replace" if cfg.skip_invalid else "error"
    src: list[str] = []
    tgt: list[str] = []
    for source in sources:
        for s, t, _ in pair_chunks(task_spec(source, cfg), on_invalid, Counter()):
            src += s
            tgt += t
    return src, tgt


# ---------------------------------------------------------------- checks on the driver


def _resolved_columns(source: Source, cfg: PrepareConfig) -> tuple[Optional[str], Optional[str]]:
    """The source's column names/numbers with defaults filled in."""
    if source.kind == "tsv":
        return source.src_col or "0", source.tgt_col or "1"
    if source.kind in ("jsonl", "parquet"):
        return source.src_col or cfg.src_lang, source.tgt_col or cfg.tgt_lang
    return None, None


def _file_info(uri: str) -> dict:
    """Size and mtime of an input file; one-line errors when it is missing or empty."""
    info = input_file_info(uri)
    if not info.size:
        raise InputError(f"{uri} is empty: pass a file with sentence pairs")
    return {"path": uri if "://" in uri else filesystem(uri)[1], "size": info.size, "mtime_ns": info.mtime_ns}


def check_source(source: Source, cfg: PrepareConfig, split: str) -> dict:
    """Check one source on the driver (nothing read but metadata); its description for the manifest."""
    if source.kind not in KINDS:
        raise ValueError(f"{split}: unknown source kind {source.kind!r}; one of {', '.join(KINDS)}")
    if source.kind == "pairs":
        return _check_pairs(source, split)
    expected = {"text": 2, "tsv": 1, "jsonl": 1}.get(source.kind)
    if (expected and len(source.paths) != expected) or not source.paths:
        raise ValueError(
            f"{split}: a {source.kind} source needs {expected or 'at least 1'} path(s), got {len(source.paths)}"
        )
    cols = _resolved_columns(source, cfg)
    if source.kind == "tsv" and not all(c.isdigit() for c in cols):
        raise ValueError(f"TSV columns must be 0-based numbers, got --src-col {cols[0]!r} --tgt-col {cols[1]!r}")
    if cols[0] is not None and cols[0] == cols[1]:
        raise ValueError(f"--src-col and --tgt-col are both {cols[0]!r}: name two columns")
    files = [_file_info(uri) for uri in source.paths]
    if source.kind == "parquet":
        for uri in source.paths:
            schema = table_schema(uri)
            for col, flag in zip(cols, ("--src-col", "--tgt-col")):
                check_text_column(uri, schema, col, flag)
    return {
        "split": split,
        "kind": source.kind,
        "files": files,
        **({"src_col": cols[0], "tgt_col": cols[1]} if cols[0] is not None else {}),
    }


def _check_pairs(source: Source, split: str) -> dict:
    """In-memory pairs: aligned and non-empty; described by a digest of their content."""
    if source.pairs is None:
        raise ValueError(f"{split}: a pairs source needs pairs=(src_list, tgt_list)")
    src, tgt = source.pairs
    misaligned = f"{split}: in-memory pairs have {len(src)} source but {len(tgt)} target sentences"
    check_aligned(src, tgt, f"{misaligned}: the lists must be aligned", f"{split}: in-memory pairs are empty")
    digest = hashlib.sha256(json.dumps([list(src), list(tgt)]).encode()).hexdigest()
    return {"split": split, "kind": "pairs", "num_pairs": len(src), "sha256": digest}


def task_spec(source: Source, cfg: PrepareConfig) -> dict:
    """What a reader needs of a source, as a plain dict that crosses to Ray tasks."""
    src_col, tgt_col = _resolved_columns(source, cfg)
    return {
        "kind": source.kind,
        "paths": tuple(source.paths),
        "src_col": src_col,
        "tgt_col": tgt_col,
        "pairs": source.pairs,
    }


# ---------------------------------------------------------------- command-line specs


def _strip_suffixes(name: str) -> str:
    """`news.tsv.gz` -> `news`: the name without compression and format extensions."""
    name = strip_compression(name)
    for suffix in TABLE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def spec_name(spec: str) -> str:
    """The default name of a test set: the basename of its prefix or file, without extensions."""
    return _strip_suffixes(spec.rstrip("/").rsplit("/", 1)[-1])


def _text_pair(prefix: str, cfg: PrepareConfig) -> Source:
    """PREFIX.<src> and PREFIX.<tgt>, each plain or compressed."""
    return Source("text", tuple(resolve(prefix, lang) for lang in (cfg.src_lang, cfg.tgt_lang)))


def _table_files(spec: str) -> Optional[tuple[str, ...]]:
    """Parquet/Arrow files named by a spec: a file, a local glob pattern or a local directory."""
    if spec.lower().endswith(COLUMNAR_SUFFIXES):  # never .gz & co.: Parquet/Arrow compress inside
        if "://" in spec or not any(c in spec for c in "*?["):
            return (spec,)
        matches = sorted(glob.glob(os.path.expanduser(spec)))
        if not matches:
            raise ValueError(f"no file matches {spec}: check the pattern")
        return tuple(matches)
    if "://" not in spec and os.path.isdir(spec):
        found = sorted(str(p) for p in Path(spec).iterdir() if p.name.lower().endswith(COLUMNAR_SUFFIXES))
        if not found:
            raise ValueError(f"{spec} is a directory without .parquet or .arrow files: pass a prefix or a file")
        return tuple(found)
    return None


def source_from_spec(
    spec: str, cfg: PrepareConfig, src_col: Optional[str] = None, tgt_col: Optional[str] = None
) -> Source:
    """A Source from a command-line SPEC: a .tsv/.jsonl(.gz) file, .parquet/.arrow file(s), or a prefix."""
    kind = file_kind(spec)
    if kind in ("tsv", "jsonl"):
        return Source(kind, (spec,), src_col, tgt_col, location=spec)
    files = _table_files(spec)
    if files is not None:
        return Source("parquet", files, src_col, tgt_col, location=spec)
    return dataclasses.replace(_text_pair(spec, cfg), location=spec)


# ---------------------------------------------------------------- several corpora

# Written by `raymt backtranslate` beside its Parquet shards (line_id, input, output, score):
# {"src_lang", "tgt_lang", ...} of the model that translated `input` into `output`.
BT_META = "bt.json"


@dataclass
class CorpusInput:
    """One training corpus to prepare: its spec (languages, origin, weight) and its sources; the
    validation set and test sets of its pair ride on the pair's first corpus."""

    spec: CorpusSpec
    train: list[Source]
    valid: list[Source] = dataclasses.field(default_factory=list)
    test: dict[str, list[Source]] = dataclasses.field(default_factory=dict)

    @property
    def generated(self) -> bool:
        """Whether every training source is generated text (the built-in corpus)."""
        return bool(self.train) and all(s.generated for s in self.train)


def corpus_config(cfg: PrepareConfig, spec: CorpusSpec) -> PrepareConfig:
    """`cfg` for one corpus: its languages name text files (PREFIX.<lang>) and default columns."""
    return dataclasses.replace(cfg, src_lang=spec.src_lang, tgt_lang=spec.tgt_lang)


def clean_config(cfg: PrepareConfig, corpus: CorpusInput) -> PrepareConfig:
    """How one corpus's training pairs are cleaned: `corpus_config` with its own cleaning options
    (CorpusSpec.clean) over cfg's; the content rules off for generated text (the built-in corpus:
    names are the same in both languages, 12- and 24-hour times differ in digits, amounts are
    mostly digits) unless the corpus turns them on. A one-line error for a rule's bad value or a
    language that language ID does not know."""
    spec = corpus.spec
    off = {rule: False for rule in CONTENT_RULES} if corpus.generated else {}
    try:
        ccfg = dataclasses.replace(corpus_config(cfg, spec), **{**off, **spec.clean})
    except ValueError as e:
        raise ValueError(f"corpus {spec.name}: clean: {e}") from None
    if ccfg.wrong_language:
        langid.check_langs([spec.src_lang, spec.tgt_lang], f"corpus {spec.name}")
    return ccfg


def corpus_inputs(
    corpora: list[CorpusSpec],
    cfg: PrepareConfig,
    builtin_splits: Callable[[CorpusSpec, PrepareConfig], dict[str, Source]],
    src_col: Optional[str] = None,
    tgt_col: Optional[str] = None,
    test_names: Optional[dict[str, str]] = None,
    text_files: Sequence[Source] = (),
) -> list[CorpusInput]:
    """The sources of each corpus: its files (a `--bt` directory of `raymt backtranslate` read as
    output -> input), or `builtin_splits` (the built-in corpus or a --dataset) for one without
    files, whose valid and test splits go to the pair unless it names its own. `text_files`
    (prepare's --src-file/--tgt-file pairs) come before the first corpus's files, in place of
    its built-in splits."""
    out, seen = [], set()
    for c in corpora:
        ccfg = corpus_config(cfg, c)
        first = c.pair not in seen
        extra = list(text_files) if not out else []
        seen.add(c.pair)
        builtin = c.builtin and not extra
        given = builtin_splits(c, ccfg) if builtin else {}

        def spec(location: str) -> Source:
            return source_from_spec(location, ccfg, src_col, tgt_col)  # noqa: B023 (used at once)

        if builtin:
            train = [given.pop("train")]
        else:
            train = extra + [bt_source(loc, c, ccfg) if c.origin == "bt" else spec(loc) for loc in c.train]
        valid = [spec(c.valid)] if c.valid else []
        if first and not valid and "valid" in given:
            valid = [given["valid"]]
        given.pop("valid", None)
        tests: dict[str, list[Source]] = {}
        for location in c.test:
            name = (test_names or {}).get(location) or spec_name(location)
            if name in tests:
                raise ValueError(f"{c.pair}: two test sets are named {name!r}: pass --test-name for each")
            tests[name] = [spec(location)]
        # The pair's own test sets first (a run scores the first); the built-in or dataset's
        # after them, unless one of the pair's has its name.
        for name, source in given.items() if first else ():
            tests.setdefault(name, [source])
        out.append(CorpusInput(c, train, valid, tests))
    return out


def bt_source(location: str, corpus: CorpusSpec, cfg: PrepareConfig) -> Source:
    """The pairs of a `--bt SRC-TGT:LOCATION`: a `raymt backtranslate` output directory (its
    `bt.json` names the model's languages: a TGT->SRC model made SRC `output` from TGT `input`,
    so the source is `output` and the target `input`), else files as --train takes them."""
    meta_uri = storage.join(location, BT_META)
    if storage.file_type(location) != pafs.FileType.Directory or not storage.exists(meta_uri):
        return source_from_spec(location, cfg)
    where = f"--bt {corpus.pair}:{location}"
    try:
        meta = json.loads(storage.read_bytes(meta_uri))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: {BT_META} is not valid JSON ({err}): run raymt backtranslate again") from None
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in ("src_lang", "tgt_lang")):
        raise ValueError(f"{where}: {BT_META} names no src_lang and tgt_lang: run raymt backtranslate again")
    made, trains = f"{meta['src_lang']}-{meta['tgt_lang']}", f"{meta['tgt_lang']}-{meta['src_lang']}"
    if trains != corpus.pair:
        raise ValueError(
            f"{where}: {BT_META} says a {made.replace('-', '->')} model made these pairs, so they train "
            f"{trains}, not {corpus.pair}: pass --bt {trains}:{location} (or back-translate with a "
            f"{corpus.tgt_lang}->{corpus.src_lang} model)"
        )
    if meta.get("done") is False:
        raise ValueError(f"{where}: the back-translation is not finished: run the same raymt backtranslate again")
    names = [n for n in storage.listdir(location) if n.endswith(".parquet") and not n.startswith((".", "_"))]
    if not names:
        raise ValueError(f"{where}: no .parquet shards beside {BT_META}: run raymt backtranslate again")
    names.sort(key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])  # part-2 < part-10
    return Source("parquet", tuple(storage.join(location, n) for n in names), "output", "input")


def check_corpus_inputs(cfg: PrepareConfig, corpora: list[CorpusInput]) -> list[dict]:
    """Check every input of every corpus on the driver before Ray starts; their descriptions."""
    check_corpora([c.spec for c in corpora], need_valid=False)
    inputs = []
    for c in corpora:
        ccfg = corpus_config(cfg, c.spec)
        if not c.train:
            raise ValueError(f"corpus {c.spec.name} has no training data: pass --train {c.spec.pair}:PATH")
        cleaning = clean_config(cfg, c)  # its cleaning options and languages, checked before Ray
        train = [{**check_source(s, ccfg, "train"), "corpus": c.spec.name} for s in c.train]
        if scores.filters(cleaning):  # the score files, matched to the inputs (and in their fingerprint)
            for entry, found in zip(train, scores.check_scores(cleaning, c, f"corpus {c.spec.name}")):
                entry["scores"] = found
        inputs += train
        inputs += [{**check_source(s, ccfg, f"valid:{c.spec.pair}")} for s in c.valid]
        for name, sources in c.test.items():
            if not TEST_NAME.match(name) or not sources:
                raise ValueError(f"test set name {name!r} must be letters, digits, '_', '.' or '-'")
            inputs += [check_source(s, ccfg, f"test:{c.spec.pair}:{name}") for s in sources]
    for pair in dict.fromkeys(c.spec.pair for c in corpora):
        given = sum(len(c.valid) > 0 for c in corpora if c.spec.pair == pair)
        if given != 1:
            raise ValueError(f"pair {pair} has {given} validation sets: pass one --valid {pair}:PREFIX")
    return inputs
