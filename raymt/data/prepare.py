"""Raw parallel corpora -> a training-ready corpus directory, with Ray Data or, when small, in the driver.

The layout of a prepared corpus is `raymt.data.format`.

Training pairs go through two Ray Data passes and never sit in memory as a whole: the
first reads and cleans every input and keeps a bottom-k hash sample for SentencePiece;
the second reads again, tokenizes in parallel tasks, drops by length, ratio and (optional)
duplicates, and writes the shards. Small inputs (up to DRIVER_PAIRS pairs given in memory,
such as the built-in corpus, and files of up to DRIVER_BYTES in all, such as Multi30k) take
the same two passes in the driver, without Ray Data. Everything is written to
a sibling temporary directory that is renamed into place at the end, so an output
directory is never left half-written; an output URI (s3://...) is built in a local
temporary directory and uploaded, manifest last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import hashlib
import heapq
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

import raymt
from raymt import storage
from raymt.cluster import init_ray, machine_cpus
from raymt.config import CorpusSpec, PrepareConfig
from raymt.data.format import (
    COLUMNS,
    FORMAT,
    FORMAT_CORPORA,
    MANIFEST_FILE,
    MAX_BLOCK_BYTES,
    SPM_FILE,
    TEST_DIR,
    TRAIN_DIR,
    VALID_DIR,
    VALID_FILE,
    read_manifest,
    token_index,
)
from raymt.data.inputs import check_corpora, mixed, reserved_pieces, sample_sizes, source_tags, target_langs
from raymt.data.text import COMPRESSED, decode, lines, resolve
from raymt.errors import InputError, first_line, user_error
from raymt.storage import filesystem
from raymt.tokenizer import Tokenizer, train_tokenizer

KINDS = ("text", "tsv", "jsonl", "parquet", "pairs")
# Cleaning rules in the order they apply; each pair is counted by the first rule that drops it.
DROP_RULES = ("invalid_utf8", "empty", "too_long_chars", "too_long", "ratio", "duplicate")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
# Pairs per Ray Data block: big enough to amortize a task, small enough to spread a corpus
# over many tasks and to keep each task's memory flat.
BLOCK_ROWS = 20_000
# Training inputs up to these sizes (the built-in corpus, a notebook's lists, Multi30k's 1.2 MB
# of gzipped text) are prepared in the driver: starting Ray Data's tasks and actors takes
# longer than tokenizing them (benchmarks/NOTES.md, "The test suite's time").
DRIVER_PAIRS = 50_000  # pairs given in memory
DRIVER_BYTES = 2 << 20  # bytes of input files, as stored (compressed or not)
# Counts that both passes make (the second re-reads the inputs: they must not have changed).
# Pass 2's "empty" adds pairs that tokenize to nothing, which it also counts as "empty_tokens".
READ_COUNTS = ("input", "invalid_utf8", "empty", "too_long_chars")
# PrepareConfig fields that only several corpora use (left out of a one-pair manifest).
CORPORA_OPTIONS = ("temperature", "bt_tag")
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


def _record_batches(uri: str, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Record batches of the named columns of a Parquet or Arrow IPC file."""
    fs, path = filesystem(uri)
    with fs.open_input_file(path) as f:
        if not uri.lower().endswith(ARROW_SUFFIXES):
            yield from pq.ParquetFile(f).iter_batches(batch_size=BLOCK_ROWS, columns=columns)
            return
        try:
            reader = pa.ipc.open_file(f)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # the streaming IPC format has no footer
            f.seek(0)
            batches = pa.ipc.open_stream(f)
        for batch in batches:
            yield batch.select(columns)


def _table_rows(spec: dict, on_invalid: str) -> Iterator[tuple]:
    """(src, tgt, row) from string columns of Parquet/Arrow files; rows count on across files."""
    n = 0
    for uri in spec["paths"]:
        for batch in _record_batches(uri, [spec["src_col"], spec["tgt_col"]]):
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


def _pair_chunks(spec: dict, on_invalid: str, counts: Counter) -> Iterator[tuple[list, list, list]]:
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


def _clean(src: list[str], tgt: list[str], max_chars: int, counts: Counter) -> list[int]:
    """Indices of the pairs that pass the text rules (empty, too_long_chars), counting the others."""
    keep = []
    for i, (s, t) in enumerate(zip(src, tgt)):
        if not s or not t:
            counts["empty"] += 1
        elif len(s) > max_chars or len(t) > max_chars:
            counts["too_long_chars"] += 1
        else:
            keep.append(i)
    return keep


def _pair_hash(src: str, tgt: str, key: bytes) -> int:
    """A keyed 64-bit hash of a pair (the length prefix keeps ("ab", "c") apart from ("a", "bc"))."""
    s = src.encode()
    data = b"%d:" % len(s) + s + tgt.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "little")


def _hash_key(seed: int) -> bytes:
    """The blake2b key of a seed: another seed draws another SentencePiece sample."""
    return b"raymt-%d" % seed


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
    fs, path = filesystem(uri)
    try:
        info = fs.get_file_info(path)
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"cannot access {uri}: {first_line(err)}") from None
    if info.type == pafs.FileType.NotFound:
        raise InputError(f"missing file {uri}: check the path (inputs are local paths or s3://, gs://, hdfs:// URIs)")
    if info.type != pafs.FileType.File:
        raise InputError(f"{uri} is not a file: pass a file (or a prefix for text pairs)")
    if not info.size:
        raise InputError(f"{uri} is empty: pass a file with sentence pairs")
    return {"path": uri if "://" in uri else path, "size": info.size, "mtime_ns": info.mtime_ns}


def table_schema(uri: str) -> pa.Schema:
    """The schema of a Parquet or Arrow IPC file, read without its data."""
    fs, path = filesystem(uri)
    try:
        with fs.open_input_file(path) as f:
            if not uri.lower().endswith(ARROW_SUFFIXES):
                return pq.read_schema(f)
            try:
                return pa.ipc.open_file(f).schema
            except pa.ArrowInvalid:
                f.seek(0)
                return pa.ipc.open_stream(f).schema
    except (OSError, pa.ArrowException) as err:
        kind = "an Arrow IPC" if uri.lower().endswith(ARROW_SUFFIXES) else "a Parquet"
        raise InputError(f"{uri} is not {kind} file ({first_line(err)})") from None


def _check_columns(uri: str, columns: tuple[str, str]) -> None:
    """Parquet/Arrow files must have both named columns, as strings."""
    schema = table_schema(uri)
    for col, flag in zip(columns, ("--src-col", "--tgt-col")):
        if col not in schema.names:
            raise InputError(
                f"{uri} has no column {col!r} (columns: {', '.join(schema.names)}): pass {flag} to name it"
            )
        tp = schema.field(col).type
        if not (pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_string_view(tp)):
            raise InputError(f"{uri}: column {col!r} has type {tp}, not string: pass {flag} to name a text column")


def _check_source(source: Source, cfg: PrepareConfig, split: str) -> dict:
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
            _check_columns(uri, cols)
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
    if len(src) != len(tgt):
        raise ValueError(
            f"{split}: in-memory pairs have {len(src)} source but {len(tgt)} target "
            "sentences: the lists must be aligned"
        )
    if not src:
        raise ValueError(f"{split}: in-memory pairs are empty")
    digest = hashlib.sha256(json.dumps([list(src), list(tgt)]).encode()).hexdigest()
    return {"split": split, "kind": "pairs", "num_pairs": len(src), "sha256": digest}


def _task_spec(source: Source, cfg: PrepareConfig) -> dict:
    """What a reader needs of a source, as a plain dict that crosses to Ray tasks."""
    src_col, tgt_col = _resolved_columns(source, cfg)
    return {
        "kind": source.kind,
        "paths": tuple(source.paths),
        "src_col": src_col,
        "tgt_col": tgt_col,
        "pairs": source.pairs,
    }


def check_sources(
    cfg: PrepareConfig, train: list[Source], valid: list[Source], test: Optional[dict[str, list[Source]]] = None
) -> list[dict]:
    """Check every input on the driver before Ray starts; the inputs' descriptions."""
    if not train:
        raise ValueError("no training data: pass --train, --src-file/--tgt-file or --dataset")
    if not valid:
        raise ValueError("no validation set: pass --valid (a prefix or a file)")
    inputs = [_check_source(s, cfg, "train") for s in train]
    inputs += [_check_source(s, cfg, "valid") for s in valid]
    for name, sources in (test or {}).items():
        if not TEST_NAME.match(name):
            raise ValueError(f"test set name {name!r} must be letters, digits, '_', '.' or '-'")
        if not sources:
            raise ValueError(f"test set {name!r} has no sources")
        inputs += [_check_source(s, cfg, f"test:{name}") for s in sources]
    return inputs


def single_pair_options(cfg: PrepareConfig) -> dict:
    """The options of a one-pair corpus, as before corpora had tags and temperatures: a corpus
    prepared by an older raymt keeps its fingerprint ("already prepared")."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in CORPORA_OPTIONS}


def fingerprint(cfg: PrepareConfig, inputs: list[dict], tokenizer: Optional[Tokenizer]) -> str:
    """sha256 of everything the corpus depends on: options, inputs (paths, sizes, mtimes), tokenizer."""
    sp = hashlib.sha256(tokenizer.model_proto).hexdigest() if tokenizer is not None else None
    blob = json.dumps(
        {"format": FORMAT, "options": single_pair_options(cfg), "inputs": inputs, "tokenizer": sp}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------- Ray tasks


class _Tally:
    """Counts reported by Ray tasks, keyed by what they describe, so a retried task counts once."""

    def __init__(self) -> None:
        self.parts: dict[tuple, dict] = {}

    def put(self, key: tuple, counts: dict) -> None:
        """Set the counts of one part (a read input, a tokenized block, the dedup actor)."""
        self.parts[key] = dict(counts)

    def total(self) -> dict:
        """The sum over all parts."""
        out: Counter = Counter()
        for counts in self.parts.values():
            out.update(counts)
        return dict(out)


def _report(tally: Any, key: tuple, counts: dict) -> None:
    """Send counts to the tally actor and wait, so they are in before the dataset finishes."""
    if isinstance(tally, _Tally):  # the passes run in the driver
        tally.put(key, counts)
        return
    import ray

    ray.get(tally.put.remote(key, dict(counts)))


def _on_invalid(options: dict) -> str:
    """What readers do with invalid UTF-8 in training data."""
    return "skip" if options["skip_invalid"] else "error"


def _sample_inputs(batch: pa.Table, specs: list[dict], options: dict, k: int) -> pa.Table:
    """Pass 1, one row per input: its counts and its k cleaned pairs with the smallest hashes."""
    key = _hash_key(options["seed"])
    rows: dict[str, list] = {"counts": [], "h": [], "src": [], "tgt": []}
    for idx in batch.column("idx").to_pylist():
        counts: Counter = Counter()
        heap: list = []
        members: set[int] = set()
        for src, tgt, _ in _pair_chunks(specs[idx], _on_invalid(options), counts):
            for i in _clean(src, tgt, options["max_chars"], counts):
                _offer(heap, members, k, _pair_hash(src[i], tgt[i], key), (src[i], tgt[i]))
        kept = sorted((-neg, pair) for neg, pair in heap)
        rows["counts"].append(json.dumps(counts))
        rows["h"].append([h for h, _ in kept])
        rows["src"].append([pair[0] for _, pair in kept])
        rows["tgt"].append([pair[1] for _, pair in kept])
    return pa.table(
        {
            "counts": pa.array(rows["counts"], pa.string()),
            "h": pa.array(rows["h"], pa.list_(pa.uint64())),
            "src": pa.array(rows["src"], pa.list_(pa.large_string())),
            "tgt": pa.array(rows["tgt"], pa.list_(pa.large_string())),
        }
    )


def _offer(heap: list, members: set, k: int, h: int, pair: tuple) -> None:
    """Keep `pair` if its hash is among the k smallest distinct ones (a max-heap of -hash)."""
    if h in members:  # a duplicate pair takes one place in the sample, not many
        return
    if len(heap) < k:
        heapq.heappush(heap, (-h, pair))
        members.add(h)
    elif h < -heap[0][0]:
        old, _ = heapq.heapreplace(heap, (-h, pair))
        members.discard(-old)
        members.add(h)


def _read_inputs(batch: pa.Table, specs: list[dict], options: dict, tally: Any) -> Iterator[pa.Table]:
    """Pass 2 reader (a generator): stripped pairs of each input with their provenance."""
    for idx in batch.column("idx").to_pylist():
        counts: Counter = Counter()
        for src, tgt, line_numbers in _pair_chunks(specs[idx], _on_invalid(options), counts):
            yield pa.table(
                {
                    "src": pa.array(src, pa.string()),
                    "tgt": pa.array(tgt, pa.string()),
                    "source": pa.array([idx] * len(src), pa.int32()),
                    "line": pa.array(line_numbers, pa.int64()),
                }
            )
        _report(tally, ("read", idx), counts)


def _tokenize_block(table: pa.Table, model_proto: bytes, options: dict, tally: Any) -> pa.Table:
    """Pass 2: clean, tokenize, drop by length and ratio; hashes ride along for de-duplication."""
    tokenizer = Tokenizer(model_proto)  # tens of ms per block of BLOCK_ROWS pairs
    counts: Counter = Counter()
    src, tgt = table.column("src").to_pylist(), table.column("tgt").to_pylist()
    keep = _clean(src, tgt, options["max_chars"], counts)
    src_ids = tokenizer.encode_batch([src[i] for i in keep])
    prefix = options.get("prefix_ids") or []  # the corpus's tags (prepare_corpora), counted by the length rules
    if prefix:
        src_ids = [prefix + ids for ids in src_ids]
    tgt_ids = tokenizer.encode_batch([tgt[i] for i in keep])
    out_src, out_tgt, hashes = [], [], []
    key = _hash_key(options["seed"])
    for i, s, t in zip(keep, src_ids, tgt_ids):
        rule = _token_rule(len(s), len(t), options)
        if rule:
            counts[rule] += 1
            if rule == "empty":  # also counted apart: pass 1 sees text only, not these
                counts["empty_tokens"] += 1
            continue
        out_src.append(s)
        out_tgt.append(t)
        if options["dedup"]:
            hashes.append(_pair_hash(src[i], tgt[i], key))
    counts["src_tokens"] += sum(map(len, out_src))
    counts["tgt_tokens"] += sum(map(len, out_tgt))
    if len(table):
        first = (table.column("source")[0].as_py(), table.column("line")[0].as_py())
        _report(tally, ("tokenize", *first, len(table)), counts)
    out = {"src_ids": pa.array(out_src, pa.list_(pa.int32())), "tgt_ids": pa.array(out_tgt, pa.list_(pa.int32()))}
    if options["dedup"]:
        out["h"] = pa.array(hashes, pa.uint64())
    return pa.table(out)


def _token_rule(src_len: int, tgt_len: int, options: dict) -> Optional[str]:
    """The token-level rule that drops a pair of these lengths, or None to keep it."""
    if src_len == 0 or tgt_len == 0:  # e.g. only control characters: no token survives
        return "empty"
    if src_len > options["max_len"] or tgt_len > options["max_len"]:
        return "too_long"
    longer, shorter = max(src_len, tgt_len), max(1, min(src_len, tgt_len))
    if longer >= options["ratio_min_len"] and longer > options["max_ratio"] * shorter:
        return "ratio"
    return None


class _Dedup:
    """Ray Data UDF on a single actor: blocks arrive in input order, so the first copy is kept."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.totals: Counter = Counter()

    def __call__(self, table: pa.Table, tally: Any) -> pa.Table:
        """Drop pairs whose hash was seen before; the running totals replace the last report."""
        keep = []
        for i, h in enumerate(table.column("h").to_pylist()):
            if h in self.seen:
                self.totals["duplicate"] += 1
            else:
                self.seen.add(h)
                keep.append(i)
        dropped = sorted(set(range(len(table))) - set(keep))
        for col, name in (("src_ids", "src_tokens"), ("tgt_ids", "tgt_tokens")):
            lengths = pc.list_value_length(table.column(col)).to_pylist()
            self.totals[name] -= sum(lengths[i] for i in dropped)  # taken back from the tokenizer's
        _report(tally, ("duplicate",), self.totals)
        return table.take(pa.array(keep, pa.int64())).drop_columns(["h"])


def _driver_node() -> dict[str, str]:
    """A label selector for this machine, where local inputs are and the output is written."""
    import ray

    return {"ray.io/node-id": ray.get_runtime_context().get_node_id()}


def _inputs_dataset(specs: list[dict]):
    """One row (and one block, so one read task) per input."""
    import ray.data

    return ray.data.from_items([{"idx": i} for i in range(len(specs))], override_num_blocks=len(specs))


# ---------------------------------------------------------------- the two passes


def _sample(cfg: PrepareConfig, specs: list[dict]) -> tuple[list[str], Counter]:
    """Pass 1: read and clean every input; the sampled sentences (src then tgt) and the counts."""
    k = cfg.sp_sample_size
    ds = _inputs_dataset(specs).map_batches(
        _sample_inputs,
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={"specs": specs, "options": dataclasses.asdict(cfg), "k": k},
        label_selector=_driver_node(),
    )
    return _merge_samples(ds.iter_batches(batch_size=None, batch_format="pyarrow"), k)


def _merge_samples(batches: Iterator[pa.Table], k: int) -> tuple[list[str], Counter]:
    """The k pairs with the smallest hashes over every input's sample (src then tgt), and the counts."""
    heap: list = []
    members: set[int] = set()
    counts: Counter = Counter()
    for batch in batches:
        for row in batch.to_pylist():
            counts.update(json.loads(row["counts"]))
            for h, s, t in zip(row["h"], row["src"], row["tgt"]):
                _offer(heap, members, k, h, (s, t))
    pairs = [pair for _, pair in sorted((-neg, pair) for neg, pair in heap)]  # by hash: deterministic
    return [s for s, _ in pairs] + [t for _, t in pairs], counts


def in_driver(inputs: list[dict]) -> bool:
    """Whether the training inputs (`check_sources`' descriptions) are small enough to prepare in
    the driver, without Ray Data."""
    train = [i for i in inputs if i["split"] == "train"]
    pairs = sum(i["num_pairs"] for i in train if i["kind"] == "pairs")
    size = sum(f["size"] for i in train for f in i.get("files", []))
    return pairs <= DRIVER_PAIRS and size <= DRIVER_BYTES


def _sample_here(cfg: PrepareConfig, specs: list[dict]) -> tuple[list[str], Counter]:
    """Pass 1 in the driver (`in_driver` inputs): the same sample and counts as `_sample`."""
    inputs = pa.table({"idx": pa.array(range(len(specs)), pa.int64())})
    sampled = _sample_inputs(inputs, specs, dataclasses.asdict(cfg), cfg.sp_sample_size)
    return _merge_samples(iter([sampled]), cfg.sp_sample_size)


def _shard_names():
    """A FilenameProvider whose names sort in dataset order: <write uuid>_<task index>-<file>."""
    from ray.data.datasource import FilenameProvider

    class ShardNames(FilenameProvider):
        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"{write_uuid}_{task_index:06d}.parquet"

    return ShardNames()


def _write_train(
    cfg: PrepareConfig,
    specs: list[dict],
    model_proto: bytes,
    train_dir: Path,
    tally: Any,
    prefix_ids: Sequence[int] = (),
) -> None:
    """Pass 2: read, tokenize in parallel tasks, filter, de-duplicate and write Parquet shards
    (`prefix_ids` before every source)."""
    import ray.data

    options = {**dataclasses.asdict(cfg), "prefix_ids": list(prefix_ids)}
    # Read tasks run on this machine, where local inputs are; one task reads a whole input.
    ds = _inputs_dataset(specs).map_batches(
        _read_inputs,
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={"specs": specs, "options": options, "tally": tally},
        label_selector=_driver_node(),
    )
    # Blocks of BLOCK_ROWS pairs are tokenized by tasks anywhere in the cluster. A strict
    # repartition is its own operator: Ray Data fuses neither the reads nor the tokenizing
    # into it, so tokenizing is not stuck in the (sequential) task of one input.
    ds = ds.repartition(target_num_rows_per_block=BLOCK_ROWS, strict=True)
    ds = ds.map_batches(
        _tokenize_block,
        batch_size=None,
        batch_format="pyarrow",
        fn_kwargs={"model_proto": model_proto, "options": options, "tally": tally},
    )
    if cfg.dedup:
        # One actor, one call at a time: with preserve_order it sees the blocks in input order.
        # It reserves no CPU: set lookups are light, and a reserved share of a one-CPU machine
        # would leave the tokenizing tasks none.
        one_by_one = ray.data.ActorPoolStrategy(
            size=1, max_tasks_in_flight_per_actor=1, max_concurrent_calls_per_actor=1
        )
        with warnings.catch_warnings():
            # max_restarts has no named parameter yet, and it matters: a restarted actor
            # would have forgotten the pairs it saw, so fail instead.
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            ds = ds.map_batches(
                _Dedup,
                batch_size=None,
                batch_format="pyarrow",
                compute=one_by_one,
                num_cpus=0,
                fn_kwargs={"tally": tally},
                max_restarts=0,
            )
    # The output directory is local: the shards are written on this machine too.
    ds.write_parquet(
        str(train_dir),
        min_rows_per_file=cfg.shard_pairs,
        max_rows_per_file=cfg.shard_pairs,
        filename_provider=_shard_names(),
        ray_remote_args={"label_selector": _driver_node()},
    )


def _write_train_here(
    cfg: PrepareConfig,
    specs: list[dict],
    model_proto: bytes,
    train_dir: Path,
    tally: _Tally,
    prefix_ids: Sequence[int] = (),
) -> None:
    """Pass 2 in the driver (`in_driver` inputs): the pairs and files `_write_train` writes."""
    options = {**dataclasses.asdict(cfg), "prefix_ids": list(prefix_ids)}
    inputs = pa.table({"idx": pa.array(range(len(specs)), pa.int64())})
    read = list(_read_inputs(inputs, specs, options, tally))
    read = pa.concat_tables(read) if read else pa.table({"src": [], "tgt": []})
    dedup = _Dedup() if cfg.dedup else None
    blocks = []
    for lo in range(0, len(read), BLOCK_ROWS):
        block = _tokenize_block(read.slice(lo, BLOCK_ROWS), model_proto, options, tally)
        blocks.append(dedup(block, tally) if dedup else block)
    kept = pa.concat_tables(blocks) if blocks else pa.table({c: [] for c in COLUMNS})
    train_dir.mkdir(parents=True)
    for i, lo in enumerate(range(0, len(kept), cfg.shard_pairs)):  # named as _name_shards expects
        pq.write_table(kept.slice(lo, cfg.shard_pairs), train_dir / f"driver_000000-{i}.parquet")


def _name_shards(train_dir: Path, shard_pairs: int, rel: str = TRAIN_DIR) -> list[dict]:
    """Rename the written files to part-00000.parquet ... in dataset order; their manifest entries
    (paths `rel`/part-...)."""

    def order(path: Path) -> tuple[int, int]:
        match = re.search(r"_(\d+)-(\d+)\.parquet$", path.name)
        assert match, f"unexpected file {path} written by Ray Data"
        return int(match.group(1)), int(match.group(2))

    files = []
    for i, path in enumerate(sorted(train_dir.glob("*.parquet"), key=order)):
        dest = train_dir / f"part-{i:05d}.parquet"
        path.rename(dest)
        num_pairs = pq.ParquetFile(dest).metadata.num_rows
        if num_pairs > shard_pairs:
            raise RuntimeError(f"Ray Data wrote {num_pairs} rows to {dest}, over shard_pairs={shard_pairs}")
        files.append(
            {
                "path": f"{rel}/{dest.name}",
                "num_pairs": num_pairs,
                "sha256": _sha256_file(dest),
                "token_index": _shard_token_index(dest),
            }
        )
    return files


def _shard_token_index(path: Path) -> list[int]:
    """The shard's cumulative src + tgt tokens every TOKEN_INDEX_ROWS rows (raymt.data.format)."""
    table = pq.read_table(path, columns=COLUMNS)
    lengths = sum(pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in COLUMNS)
    return token_index(lengths)


def _sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _drop_summary(counts: dict) -> str:
    """'empty 3, too_long 2' for the rules that dropped something."""
    return ", ".join(f"{rule} {counts[rule]}" for rule in DROP_RULES if counts.get(rule)) or "none"


def _all_dropped(total: int, counts: dict, where: str = "") -> ValueError:
    """The error for a training set that the cleaning rules emptied (`where`: which corpus)."""
    return ValueError(
        f"{where}all {total} training pairs were dropped ({_drop_summary(counts)}): check the "
        "inputs, or relax --max-len/--max-chars/--max-ratio/--ratio-min-len"
    )


def _train_split(
    cfg: PrepareConfig, specs: list[dict], tokenizer: Optional[Tokenizer], tmp: Path, here: bool
) -> tuple[dict, Tokenizer]:
    """Both passes over the training inputs (in the driver when `here`, else with Ray Data); the
    manifest's train entry and the tokenizer."""
    first = None
    if tokenizer is None:
        _progress(f"reading {len(specs)} training input(s) and sampling for SentencePiece")
        sentences, first = (_sample_here if here else _sample)(cfg, specs)
        if not sentences:
            raise _all_dropped(first["input"], first)
        _progress(
            f"training SentencePiece ({cfg.sp_model_type}, {cfg.vocab_size} pieces) on {len(sentences) // 2} pairs"
        )
        tokenizer = train_tokenizer(
            sentences,
            cfg.vocab_size,
            cfg.sp_model_type,
            sample_size=len(sentences),
            seed=cfg.seed,
            num_threads=machine_cpus(),
        )
    _progress("tokenizing and writing training shards")
    return _write_split(cfg, specs, tokenizer.model_proto, tmp, TRAIN_DIR, here, first), tokenizer


def _write_split(
    cfg: PrepareConfig,
    specs: list[dict],
    model_proto: bytes,
    tmp: Path,
    rel: str,
    here: bool,
    first: Optional[dict],
    prefix_ids: Sequence[int] = (),
    where: str = "",
) -> dict:
    """Pass 2 over one corpus's inputs into tmp/`rel` (`prefix_ids` before every source); the
    manifest's train entry, checked against pass 1's counts (`first`, when it ran)."""
    import ray

    if here:
        tally = _Tally()
        _write_train_here(cfg, specs, model_proto, tmp / rel, tally, prefix_ids)
        counts = tally.total()
    else:
        tally = ray.remote(num_cpus=0)(_Tally).remote()
        try:
            _write_train(cfg, specs, model_proto, tmp / rel, tally, prefix_ids)
            counts = ray.get(tally.total.remote())
        finally:
            ray.kill(tally)
    if first is not None and any(first.get(c, 0) != n for c, n in _read_counts(counts).items()):
        raise ValueError("the training inputs changed while they were being prepared: run again")
    dropped = {rule: counts.get(rule, 0) for rule in DROP_RULES}
    kept = counts.get("input", 0) - sum(dropped.values())
    if kept == 0:
        raise _all_dropped(counts.get("input", 0), dropped, where)
    files = _name_shards(tmp / rel, cfg.shard_pairs, rel)
    assert kept == sum(f["num_pairs"] for f in files), (kept, files)
    return {
        "files": files,
        "num_pairs": kept,
        "src_tokens": counts.get("src_tokens", 0),
        "tgt_tokens": counts.get("tgt_tokens", 0),
        "input_pairs": counts.get("input", 0),
        "dropped": dropped,
    }


def _read_counts(counts: dict) -> dict:
    """Pass 2's counts of what pass 1 counts too (READ_COUNTS), to check that the inputs did not change."""
    read = {c: counts.get(c, 0) for c in READ_COUNTS}
    # Pass 2's `empty` also holds the pairs that only tokenizing emptied (e.g. "\u200b"): not text-level.
    read["empty"] -= counts.get("empty_tokens", 0)
    return read


def read_eval(cfg: PrepareConfig, sources: list[Source]) -> tuple[list[str], list[str]]:
    """A validation/test set read whole on the driver: (sources, references), stripped, nothing dropped."""
    # Invalid bytes become U+FFFD under --skip-invalid: a dropped line would misalign scoring.
    on_invalid = "replace" if cfg.skip_invalid else "error"
    src: list[str] = []
    tgt: list[str] = []
    for source in sources:
        for s, t, _ in _pair_chunks(_task_spec(source, cfg), on_invalid, Counter()):
            src += s
            tgt += t
    return src, tgt


def _eval_split(cfg: PrepareConfig, sources: list[Source], path: Path) -> int:
    """Read a validation/test set on the driver and write it whole (stripped, nothing dropped)."""
    src, tgt = read_eval(cfg, sources)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"src": pa.array(src, pa.string()), "tgt": pa.array(tgt, pa.string())}), path)
    return len(src)


def _progress(message: str) -> None:
    """A progress line on stdout."""
    print(f"prepare: {message}", flush=True)


# ---------------------------------------------------------------- the corpus directory


def _existing(out: str, fp: str, overwrite: bool) -> Optional[dict]:
    """The manifest when OUT already holds this very corpus; an error when it holds other content."""
    kind = storage.file_type(out)
    if kind == pafs.FileType.NotFound or (kind == pafs.FileType.Directory and not storage.listdir(out)):
        return None
    if kind != pafs.FileType.Directory:
        raise ValueError(f"--out {out} is a file: pick a directory")
    try:
        manifest = read_manifest(out)
    except ValueError:
        if not _corpus_files_only(out):
            raise ValueError(
                f"--out {out} is not empty and holds no prepared corpus: pick a new or "
                "empty directory (--overwrite only replaces a prepared corpus)"
            ) from None
        if not overwrite:
            raise ValueError(
                f"--out {out} holds corpus files but no {MANIFEST_FILE} (an upload cut short?): "
                "pass --overwrite to replace them, or pick another --out"
            ) from None
        return None
    if manifest.get("fingerprint") == fp and _complete(out, manifest):
        return manifest
    if not overwrite and manifest.get("fingerprint") == fp:
        raise ValueError(
            f"--out {out} holds this corpus but misses some of its files: pass --overwrite to prepare it again"
        )
    if not overwrite:
        raise ValueError(
            f"--out {out} already holds a corpus prepared from other inputs or options: "
            "pass --overwrite to replace it, or pick another --out"
        )
    return None


def _corpus_files_only(out: str) -> bool:
    """Whether every file under OUT is one a corpus holds (what an interrupted upload leaves: its
    manifest goes last), so that --overwrite may replace it."""
    fs, path = storage.filesystem(out)
    root = path.rstrip("/") + "/"
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        assert info.path.startswith(root), (info.path, root)
        rel = info.path[len(root) :].split("/")
        if info.type == pafs.FileType.Directory:
            known = rel[0] in (TRAIN_DIR, VALID_DIR, TEST_DIR)
        elif rel[0] == TRAIN_DIR:  # train/part-N.parquet, or train/CORPUS/part-N.parquet
            known = re.fullmatch(r"part-\d+\.parquet", rel[-1]) is not None and len(rel) <= 3
        elif rel[0] in (VALID_DIR, TEST_DIR):
            known = rel[-1].endswith(".parquet") and len(rel) <= 3
        else:
            known = rel in ([SPM_FILE], [VALID_FILE])
        if not known:
            return False
    return True


def _complete(out: str, manifest: dict) -> bool:
    """Whether every file the manifest names is there."""
    if manifest.get("format") == FORMAT_CORPORA:
        return _complete_corpora(out, manifest)
    splits = manifest.get("splits", {})
    paths = [f["path"] for f in splits.get("train", {}).get("files", [])]
    paths += [splits.get("valid", {}).get("path", VALID_FILE), SPM_FILE]
    paths += [t["path"] for t in splits.get("test", {}).values()]
    return all(storage.exists(storage.join(out, p)) for p in paths)


def _complete_corpora(out: str, manifest: dict) -> bool:
    """Whether every file a `raymt-corpus/2` manifest names is there."""
    splits = manifest.get("splits", {})
    paths = [f["path"] for c in manifest.get("corpora", []) for f in c["train"]["files"]]
    paths += [v["path"] for v in splits.get("valid", {}).values()] + [SPM_FILE]
    paths += [t["path"] for tests in splits.get("test", {}).values() for t in tests.values()]
    return all(storage.exists(storage.join(out, p)) for p in paths)


def _staging(out: str) -> Path:
    """A new local directory to build the corpus in: next to a local OUT (renamed into place at
    the end), else in the local temporary directory (uploaded at the end)."""
    if storage.is_uri(out):
        return Path(tempfile.mkdtemp(prefix="raymt-prepare-"))
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f"{out_path.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def _install(tmp: Path, out: str) -> None:
    """Move the finished corpus into place; a replaced one is removed only afterwards.

    On object storage there is no rename: an old corpus is removed manifest first, the new
    files are uploaded, and the manifest goes last, so no reader sees a corpus half-written.
    """
    if storage.is_uri(out):
        fs, path = storage.filesystem(out)
        if storage.exists(storage.join(out, MANIFEST_FILE)):
            fs.delete_file(storage.filesystem(storage.join(out, MANIFEST_FILE))[1])
        fs.delete_dir_contents(path, missing_dir_ok=True)
        manifest = (tmp / MANIFEST_FILE).read_bytes()
        (tmp / MANIFEST_FILE).unlink()
        storage.upload_dir(tmp, out)
        storage.write_bytes(storage.join(out, MANIFEST_FILE), manifest)
        return
    out_path = Path(out)
    if out_path.is_dir() and not any(out_path.iterdir()):
        out_path.rmdir()
    if not out_path.exists():
        os.rename(tmp, out_path)
        return
    old = out_path.with_name(f"{out_path.name}.old-{secrets.token_hex(4)}")
    os.rename(out_path, old)
    os.rename(tmp, out_path)
    shutil.rmtree(old)


def _only_warnings(record: logging.LogRecord) -> bool:
    """Log filter: Ray Data's warnings reach the terminal, its info and error chatter does not."""
    # Progress bars are off on purpose (below): no need to say so.
    return record.levelno == logging.WARNING and not record.getMessage().startswith("Progress bars")


@contextlib.contextmanager
def _ray_data_settings() -> Iterator[None]:
    """Ordered execution (shard order, first duplicate kept), small blocks, a quiet terminal.

    Errors still raise (ours as one line) and Ray Data's log file keeps everything; on the
    terminal it would print each of our input errors again with a traceback.
    """
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.target_max_block_size
    ctx.execution_options.preserve_order = True
    ctx.target_max_block_size = MAX_BLOCK_BYTES  # task memory independent of input sizes
    ctx.enable_progress_bars = False  # our progress lines and final table say enough
    terminals = [h for h in logging.getLogger("ray.data").handlers if isinstance(h, logging.StreamHandler)]
    for handler in terminals:
        handler.addFilter(_only_warnings)
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.target_max_block_size = saved
        for handler in terminals:
            handler.removeFilter(_only_warnings)


def prepare_corpus(
    cfg: PrepareConfig,
    out: str,
    train: list[Source],
    valid: list[Source],
    test: Optional[dict[str, list[Source]]] = None,
    tokenizer: Optional[Tokenizer] = None,
    overwrite: bool = False,
    command: Optional[str] = None,
) -> dict:
    """Prepare a corpus directory; returns the manifest dict. Starts Ray (ray.init) for inputs
    too large to prepare in the driver (`in_driver`)."""
    t0 = time.time()
    out = storage.normalize(out)
    inputs = check_sources(cfg, train, valid, test)
    fp = fingerprint(cfg, inputs, tokenizer)
    manifest = _existing(out, fp, overwrite)
    if manifest is not None:
        print(f"prepare: {out} already prepared (same inputs and options)", flush=True)
        return manifest
    here = in_driver(inputs)
    if not here:
        init_ray()
    manifest = _build_staged(
        out,
        lambda tmp: _build(cfg, tmp, train, valid, test or {}, tokenizer, here),
        options=single_pair_options(cfg),
        inputs=inputs,
        fingerprint=fp,
        command=command,
    )
    print_summary(manifest, out, time.time() - t0)
    return manifest


def _build_staged(out: Path, build: Callable[[Path], dict], **entries) -> dict:
    """Build a corpus in a staging dir beside `out` with `build(tmp)`, add `entries` and the
    provenance to its manifest, then move it into place: `out` is whole or untouched."""
    tmp = _staging(out)
    try:
        manifest = build(tmp)
        manifest.update(
            **entries,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            raymt_version=raymt.__version__,
        )
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        _install(tmp, out)
    except Exception as err:
        user = user_error(err)
        if user is not None:
            raise user from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _build(
    cfg: PrepareConfig,
    tmp: Path,
    train: list[Source],
    valid: list[Source],
    test: dict[str, list[Source]],
    tokenizer: Optional[Tokenizer],
    here: bool,
) -> dict:
    """Write every file of the corpus into `tmp` (training pairs in the driver when `here`); the
    manifest without its bookkeeping fields."""
    # The small sets first: their errors come before the long passes.
    splits: dict[str, Any] = {"valid": {"path": VALID_FILE, "num_pairs": _eval_split(cfg, valid, tmp / VALID_FILE)}}
    tests = {}
    for name, sources in test.items():
        path = f"{TEST_DIR}/{name}.parquet"
        tests[name] = {"path": path, "num_pairs": _eval_split(cfg, sources, tmp / path)}
    specs = [_task_spec(s, cfg) for s in train]
    with contextlib.nullcontext() if here else _ray_data_settings():
        splits["train"], tokenizer = _train_split(cfg, specs, tokenizer, tmp, here)
    splits["test"] = tests
    (tmp / SPM_FILE).write_bytes(tokenizer.model_proto)
    return {
        "format": FORMAT,
        "src_lang": cfg.src_lang,
        "tgt_lang": cfg.tgt_lang,
        "vocab_size": tokenizer.sp.get_piece_size(),
        "sp_model_type": cfg.sp_model_type,
        "sp_model_sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(),
        "splits": {"train": splits["train"], "valid": splits["valid"], "test": tests},
    }


def print_summary(manifest: dict, out: str, seconds: float) -> None:
    """The per-rule table printed at the end of a preparation."""
    train = manifest["splits"]["train"]
    rows = [("input pairs", train["input_pairs"])]
    rows += [(f"  dropped: {rule}", train["dropped"][rule]) for rule in DROP_RULES]
    rows += [
        ("kept pairs", train["num_pairs"]),
        ("src tokens", train["src_tokens"]),
        ("tgt tokens", train["tgt_tokens"]),
        ("shards", len(train["files"])),
        ("valid pairs", manifest["splits"]["valid"]["num_pairs"]),
    ]
    rows += [(f"test pairs: {name}", t["num_pairs"]) for name, t in manifest["splits"]["test"].items()]
    width = max(len(name) for name, _ in rows)
    print(f"\n=== raymt corpus {out} ===")
    for name, value in rows:
        print(f"{name:<{width}}  {value:>12,}")
    print(f"{'seconds':<{width}}  {seconds:>12.1f}")


# ---------------------------------------------------------------- command-line specs


def _strip_suffixes(name: str) -> str:
    """`news.tsv.gz` -> `news`: the name without compression and format extensions."""
    lower = name.lower()
    for suffix in COMPRESSED:
        if lower.endswith(suffix):
            name, lower = name[: -len(suffix)], lower[: -len(suffix)]
            break
    for suffix in (".tsv", ".jsonl", ".ndjson", ".parquet", *ARROW_SUFFIXES):
        if lower.endswith(suffix):
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
    if spec.lower().endswith((".parquet", *ARROW_SUFFIXES)):
        if "://" in spec or not any(c in spec for c in "*?["):
            return (spec,)
        matches = sorted(glob.glob(os.path.expanduser(spec)))
        if not matches:
            raise ValueError(f"no file matches {spec}: check the pattern")
        return tuple(matches)
    if "://" not in spec and os.path.isdir(spec):
        found = sorted(str(p) for p in Path(spec).iterdir() if p.name.lower().endswith((".parquet", *ARROW_SUFFIXES)))
        if not found:
            raise ValueError(f"{spec} is a directory without .parquet or .arrow files: pass a prefix or a file")
        return tuple(found)
    return None


def source_from_spec(
    spec: str, cfg: PrepareConfig, src_col: Optional[str] = None, tgt_col: Optional[str] = None
) -> Source:
    """A Source from a command-line SPEC: a .tsv/.jsonl(.gz) file, .parquet/.arrow file(s), or a prefix."""
    lower = spec.lower()
    for suffix in COMPRESSED:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
            break
    if lower.endswith(".tsv"):
        return Source("tsv", (spec,), src_col, tgt_col)
    if lower.endswith((".jsonl", ".ndjson")):
        return Source("jsonl", (spec,), src_col, tgt_col)
    files = _table_files(spec)
    if files is not None:
        return Source("parquet", files, src_col, tgt_col)
    return _text_pair(spec, cfg)


# ---------------------------------------------------------------- several corpora: raymt-corpus/2

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


def corpus_config(cfg: PrepareConfig, spec: CorpusSpec) -> PrepareConfig:
    """`cfg` for one corpus: its languages name text files (PREFIX.<lang>) and default columns."""
    return dataclasses.replace(cfg, src_lang=spec.src_lang, tgt_lang=spec.tgt_lang)


def corpus_inputs(
    corpora: list[CorpusSpec],
    cfg: PrepareConfig,
    builtin_splits: Callable[[CorpusSpec, PrepareConfig], dict[str, Source]],
    src_col: Optional[str] = None,
    tgt_col: Optional[str] = None,
    test_names: Optional[dict[str, str]] = None,
) -> list[CorpusInput]:
    """The sources of each corpus: its files (a `--bt` directory of `raymt backtranslate` read as
    output -> input), or `builtin_splits` (the built-in corpus or a --dataset) for one without
    files, whose valid and test splits go to the pair unless it names its own."""
    out, seen = [], set()
    for c in corpora:
        ccfg = corpus_config(cfg, c)
        first = c.pair not in seen
        seen.add(c.pair)
        given = builtin_splits(c, ccfg) if c.builtin else {}

        def spec(location: str) -> Source:
            return source_from_spec(location, ccfg, src_col, tgt_col)  # noqa: B023 (used at once)

        if c.builtin:
            train = [given.pop("train")]
        else:
            train = [bt_source(loc, c, ccfg) if c.origin == "bt" else spec(loc) for loc in c.train]
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
        inputs += [{**_check_source(s, ccfg, "train"), "corpus": c.spec.name} for s in c.train]
        inputs += [{**_check_source(s, ccfg, f"valid:{c.spec.pair}")} for s in c.valid]
        for name, sources in c.test.items():
            if not TEST_NAME.match(name) or not sources:
                raise ValueError(f"test set name {name!r} must be letters, digits, '_', '.' or '-'")
            inputs += [_check_source(s, ccfg, f"test:{c.spec.pair}:{name}") for s in sources]
    for pair in dict.fromkeys(c.spec.pair for c in corpora):
        given = sum(len(c.valid) > 0 for c in corpora if c.spec.pair == pair)
        if given != 1:
            raise ValueError(f"pair {pair} has {given} validation sets: pass one --valid {pair}:PREFIX")
    return inputs


def corpora_fingerprint(
    cfg: PrepareConfig, corpora: list[CorpusInput], inputs: list[dict], tokenizer: Optional[Tokenizer]
) -> str:
    """sha256 of everything a corpus of several corpora depends on: options, corpora, inputs, tokenizer."""
    sp = hashlib.sha256(tokenizer.model_proto).hexdigest() if tokenizer is not None else None
    specs = [{k: getattr(c.spec, k) for k in ("src_lang", "tgt_lang", "origin", "weight")} for c in corpora]
    blob = json.dumps(
        {
            "format": FORMAT_CORPORA,
            "options": _corpora_options(cfg),
            "corpora": specs,
            "inputs": inputs,
            "tokenizer": sp,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _corpora_options(cfg: PrepareConfig) -> dict:
    """The options of a corpus of several corpora (each corpus names its own languages)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("src_lang", "tgt_lang")}


def check_tags(tokenizer: Tokenizer, reserved: list[str], where: str) -> None:
    """A given SentencePiece model (a checkpoint's, a run's) must reserve the corpora's tags as
    control symbols with ids 4, 5, ... in order; a one-line error otherwise."""
    wrong = [
        p
        for i, p in enumerate(reserved, 4)
        if tokenizer.sp.piece_to_id(p) != i or not tokenizer.sp.is_control(tokenizer.sp.piece_to_id(p))
    ]
    if wrong:
        raise ValueError(
            f"{where}: its SentencePiece model does not reserve the tag(s) {', '.join(wrong)} that these "
            "corpora need: train from scratch, or on corpora with the same languages and origins"
        )


def prepare_corpora(
    cfg: PrepareConfig,
    out: str,
    corpora: list[CorpusInput],
    tokenizer: Optional[Tokenizer] = None,
    overwrite: bool = False,
    command: Optional[str] = None,
) -> dict:
    """Prepare several corpora into one `raymt-corpus/2` directory (one joint SentencePiece model
    with the tags reserved, shards per corpus, sets per pair); returns the manifest. One real
    corpus is today's `raymt-corpus/1` corpus, made by `prepare_corpus`."""
    specs = [c.spec for c in corpora]
    if not mixed(specs):
        (c,) = corpora
        return prepare_corpus(corpus_config(cfg, c.spec), out, c.train, c.valid, c.test, tokenizer, overwrite, command)
    t0 = time.time()
    out = storage.normalize(out)
    inputs = check_corpus_inputs(cfg, corpora)
    reserved = reserved_pieces(specs, cfg.bt_tag)
    if tokenizer is not None:
        check_tags(tokenizer, reserved, "the given model")
    fp = corpora_fingerprint(cfg, corpora, inputs, tokenizer)
    manifest = _existing(out, fp, overwrite)
    if manifest is not None:
        print(f"prepare: {out} already prepared (same inputs and options)", flush=True)
        return manifest
    # Each corpus is prepared in the driver when it is small (`in_driver`), else with Ray Data.
    here = [in_driver([i for i in inputs if i.get("corpus") == c.spec.name]) for c in corpora]
    if not all(here):
        init_ray()
    manifest = _build_staged(
        out,
        lambda tmp: _build_corpora(cfg, tmp, corpora, reserved, tokenizer, here),
        options=_corpora_options(cfg),
        inputs=inputs,
        fingerprint=fp,
        command=command,
    )
    print_corpora_summary(manifest, out, time.time() - t0)
    return manifest


def _eval_splits_of(cfg: PrepareConfig, corpora: list[CorpusInput], tmp: Path) -> dict:
    """Write each pair's validation set and test sets (text, nothing dropped); the manifest's entries."""
    valid: dict[str, dict] = {}
    tests: dict[str, dict] = {}
    for c in corpora:
        ccfg, pair = corpus_config(cfg, c.spec), c.spec.pair
        if c.valid:
            path = f"{VALID_DIR}/{pair}.parquet"
            valid[pair] = {"path": path, "num_pairs": _eval_split(ccfg, c.valid, tmp / path)}
        for name, sources in c.test.items():
            path = f"{TEST_DIR}/{pair}/{name}.parquet"
            tests.setdefault(pair, {})[name] = {"path": path, "num_pairs": _eval_split(ccfg, sources, tmp / path)}
    return {"valid": valid, "test": tests}


def _build_corpora(
    cfg: PrepareConfig,
    tmp: Path,
    corpora: list[CorpusInput],
    reserved: list[str],
    tokenizer: Optional[Tokenizer],
    here: list[bool],
) -> dict:
    """Write every file of a corpus of several corpora into `tmp` (corpus i in the driver when
    `here[i]`); the manifest without its bookkeeping."""
    splits = _eval_splits_of(cfg, corpora, tmp)  # the small sets first: their errors come early
    specs = [[_task_spec(s, corpus_config(cfg, c.spec)) for s in c.train] for c in corpora]
    with contextlib.nullcontext() if all(here) else _ray_data_settings():
        firsts: list[Optional[dict]] = [None] * len(corpora)
        if tokenizer is None:
            tokenizer, firsts = _joint_tokenizer(cfg, corpora, specs, reserved, here)
        ids = {piece: tokenizer.sp.piece_to_id(piece) for piece in reserved}
        entries = []
        for c, task_specs, first, in_here in zip(corpora, specs, firsts, here):
            tags = source_tags(c.spec, reserved)
            _progress(f"{c.spec.name}: tokenizing and writing training shards" + (f" ({' '.join(tags)})" * bool(tags)))
            train = _write_split(
                corpus_config(cfg, c.spec),
                task_specs,
                tokenizer.model_proto,
                tmp,
                f"{TRAIN_DIR}/{c.spec.name}",
                in_here,
                first,
                [ids[t] for t in tags],
                f"corpus {c.spec.name}: ",
            )
            entries.append(
                {
                    "name": c.spec.name,
                    "src_lang": c.spec.src_lang,
                    "tgt_lang": c.spec.tgt_lang,
                    "origin": c.spec.origin,
                    "weight": c.spec.weight,
                    "source_tags": tags,
                    "train": train,
                }
            )
    (tmp / SPM_FILE).write_bytes(tokenizer.model_proto)
    return {
        "format": FORMAT_CORPORA,
        "vocab_size": tokenizer.sp.get_piece_size(),
        "sp_model_type": cfg.sp_model_type,
        "sp_model_sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(),
        "corpora": entries,
        "tags": {"target_langs": target_langs([c.spec for c in corpora]), "reserved": ids},
        "splits": splits,
    }


def joint_sample(samples: list[list[str]], shares: list[int]) -> tuple[list[str], list[int]]:
    """The SentencePiece sample: the first k_i pairs of each corpus's sample (its sources, then
    its targets, each ordered by hash), k_i at most the pairs it holds; and the k_i taken."""
    # Pass 1 counted duplicate pairs, which a sample holds once: k_i may exceed its pairs.
    shares = [min(k, len(sentences) // 2) for sentences, k in zip(samples, shares)]
    joint: list[str] = []
    for sentences, k in zip(samples, shares):
        half = len(sentences) // 2
        joint += sentences[:k] + sentences[half : half + k]
    return joint, shares


def _joint_tokenizer(
    cfg: PrepareConfig, corpora: list[CorpusInput], specs: list[list[dict]], reserved: list[str], here: list[bool]
) -> tuple[Tokenizer, list[dict]]:
    """Pass 1 per corpus (a bottom-k hash sample and counts), then one SentencePiece model on the
    k_i smallest hashes of corpus i, k_i the temperature's share of sp_sample_size (`sample_sizes`),
    the tags reserved; the tokenizer and each corpus's pass-1 counts."""
    samples, firsts, sizes = [], [], []
    for c, task_specs, in_here in zip(corpora, specs, here):
        _progress(f"{c.spec.name}: reading {len(task_specs)} training input(s) and sampling for SentencePiece")
        sentences, first = (_sample_here if in_here else _sample)(corpus_config(cfg, c.spec), task_specs)
        if not sentences:
            raise _all_dropped(first["input"], first, f"corpus {c.spec.name}: ")
        samples.append(sentences)
        firsts.append(first)
        # Pairs that pass the text rules: the corpus's size as far as pass 1 knows it.
        sizes.append(first["input"] - sum(first.get(rule, 0) for rule in READ_COUNTS[1:]))
    shares = sample_sizes(sizes, cfg.sp_sample_size, cfg.temperature, [c.spec.weight for c in corpora])
    joint, shares = joint_sample(samples, shares)
    _progress(
        f"training SentencePiece ({cfg.sp_model_type}, {cfg.vocab_size} pieces) on {len(joint) // 2} pairs "
        f"({', '.join(f'{c.spec.name} {k}' for c, k in zip(corpora, shares))}), reserving {' '.join(reserved)}"
    )
    tokenizer = train_tokenizer(
        joint,
        cfg.vocab_size,
        cfg.sp_model_type,
        sample_size=len(joint),
        seed=cfg.seed,
        num_threads=machine_cpus(),
        control_symbols=reserved,
    )
    return tokenizer, firsts


def corpora_summary_rows(manifest: dict) -> list[tuple[str, list]]:
    """The rows of a several-corpora summary: one per corpus, then real and BT totals apart."""
    columns = ("input_pairs", "kept", "src_tokens", "tgt_tokens", "shards")
    rows, totals = [], {"real": [0] * len(columns), "bt": [0] * len(columns)}
    for c in manifest["corpora"]:
        t = c["train"]
        values = [t["input_pairs"], t["num_pairs"], t["src_tokens"], t["tgt_tokens"], len(t["files"])]
        rows.append((f"{c['name']} ({c['origin']})", values))
        totals[c["origin"]] = [a + b for a, b in zip(totals[c["origin"]], values)]
    rows.append(("total real", totals["real"]))
    rows.append(("total bt", totals["bt"]))
    rows.append(("total", [a + b for a, b in zip(totals["real"], totals["bt"])]))
    return rows


def print_corpora_summary(manifest: dict, out: str, seconds: float) -> None:
    """The table printed at the end of preparing several corpora: each corpus (with its drops),
    real and back-translated pairs counted apart, each pair's sets, the tags."""
    header = ("corpus", "input pairs", "kept pairs", "src tokens", "tgt tokens", "shards")
    rows = corpora_summary_rows(manifest)
    width = max(len(name) for name, _ in rows + [("corpus", [])])
    print(f"\n=== raymt corpus {out} ({len(manifest['corpora'])} corpora) ===")
    print(f"{header[0]:<{width}}" + "".join(f"  {h:>12}" for h in header[1:]))
    for name, values in rows:
        print(f"{name:<{width}}" + "".join(f"  {v:>12,}" for v in values))
    for c in manifest["corpora"]:
        print(f"dropped in {c['name']}: {_drop_summary(c['train']['dropped'])}")
    for pair, entry in manifest["splits"]["valid"].items():
        tests = manifest["splits"]["test"].get(pair, {})
        shown = "".join(f", test/{name} {t['num_pairs']:,}" for name, t in tests.items())
        print(f"{pair}: valid {entry['num_pairs']:,}{shown}")
    tags = manifest["tags"]["reserved"]
    print(f"tags: {', '.join(f'{p} = id {i}' for p, i in tags.items()) or 'none'}")
    print(f"seconds: {seconds:.1f}")
