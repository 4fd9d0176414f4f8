"""`python -m raymt.backtranslate`: translate a monolingual corpus of any size on a Ray cluster, restartably.

Back-translation (Sennrich et al. 2016; Edunov et al. 2018): a reverse model (de->en, say)
translates target-side monolingual text (German) into synthetic sources (English); the
pairs (synthetic English, real German) then join the real ones for training en->de.

The input's line ids are cut into shards of `--shard-lines`; shard k (line ids
[k*S, (k+1)*S)) becomes `part-<first line id>.parquet` with columns line_id, input, output,
score, written whole (a temporary name renamed, or one object PUT). The driver reads the
input file by file (one shard in memory at a time) and hands each unfinished shard to a pool
of Ray actors (the model loaded once each; two shards queued per actor); an actor cuts the
shard into length-sorted token-budget batches, decodes it and writes the shard's file
itself, then returns a small record (shard, counts) for the progress line and `bt.json`.
(Not Ray Data: a map task's output reaches the next step only per 128 MiB or when the task
ends, so a read step per file fed whole files to one actor and shards to the driver at the end.)
Killed anywhere (driver or actor), the same command finishes the job: a shard file is
written once complete, so a killed driver loses only the shards in flight; the files are
found and verified (row count) on restart, and the rest is redone; every input line ends up
in exactly one row. An empty or invalid line (bad UTF-8, bad JSON, missing column) gets an
empty output and is counted, so the output stays aligned with the input.

`bt.json` in the output names the model and its direction, the decoding options, the
input and its line count, the counts, and `done`; a rerun with other settings is refused.
`--format text` also writes `text.<src>` (the inputs) and `text.<tgt>` (the outputs),
aligned line by line, usable as a `--train` prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import importlib.util
import io
import json
import lzma
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymt import storage
from raymt.checkpoint import (
    CONFIG_FILE,
    SPM_FILE,
    check_checkpoint,
    load_weights,
    local_checkpoint,
    trained_sources,
    weights_file,
)
from raymt.cluster import check_ray_address, init_ray
from raymt.config import BT_FORMATS, BacktranslateConfig, Config, DecodeOptions
from raymt.data.inputs import decode_tags
from raymt.data.text import COMPRESSED, open_binary
from raymt.errors import InputError, first_line, user_error
from raymt.export import CT2_RAYMT_CONFIG
from raymt.tokenizer import EOS_ID, Tokenizer
from raymt.translate import decode_options

INFO_FILE = "bt.json"
INFO_FORMAT = "raymt-bt/1"
SHARD_PREFIX = "part-"
META_KEY = b"raymt.bt"  # Parquet schema metadata of a shard: its counts
STATUS_OK, STATUS_EMPTY, STATUS_INVALID = 0, 1, 2
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")
# For tests of kills and restarts only: seconds each actor sleeps per shard (slows a run down).
DELAY_ENV = "RAYMT_BT_TEST_DELAY_S"
CPU_ACTORS = 2
# Shards given to an actor at a time: the next one is there when it finishes one.
QUEUE_PER_ACTOR = 2
# The process title of a decoding actor (tests and the benchmark find actors by it).
ACTOR_TITLE = "ray::BacktranslateActor"
NOISE_FIELDS = ("noise", "noise_delete", "noise_replace", "noise_swap", "noise_filler")
OUT_SCHEMA = pa.schema(
    [("line_id", pa.int64()), ("input", pa.string()), ("output", pa.string()), ("score", pa.float64())]
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    d, b = DecodeOptions(), BacktranslateConfig()
    p = argparse.ArgumentParser(prog="python -m raymt.backtranslate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--checkpoint", required=True, help="raymt checkpoint, or a `raymt export --format ctranslate2` directory"
    )
    p.add_argument(
        "--input",
        required=True,
        metavar="SPEC",
        help="text (plain, .gz/.xz/.zst/.bz2), .tsv, .jsonl or .parquet: a file, a glob, a directory or a URI",
    )
    p.add_argument("--output", required=True, metavar="DIR|URI", help="shards, bt.json (and text) go here")
    p.add_argument("--format", choices=BT_FORMATS, default="parquet", help="text: also aligned text.<lang> files")
    p.add_argument("--column", help="TSV: 0-based column (default 0); JSONL/Parquet: key (default the source language)")
    p.add_argument("--src-lang", help="the input's language: checked against the model's source")
    p.add_argument("--tgt-lang", help="the output's language: checked (tagged models: picks the tag)")
    p.add_argument("--beam", type=int, default=d.beam, help="beam size (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=d.length_penalty, help="GNMT alpha (raymt engine)")
    p.add_argument("--max-len-a", type=float, default=d.max_len_a, help="max output = a * src_len + b")
    p.add_argument("--max-len-b", type=int, default=d.max_len_b)
    p.add_argument("--sample", action="store_true", help="sample the outputs (Edunov et al. 2018; beam 1)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=d.top_k, help="sample among the K most likely tokens (0 = all)")
    p.add_argument("--noise", action="store_true", help="noised beam output: delete, replace, swap words")
    p.add_argument("--noise-delete", type=float, default=b.noise_delete, help="drop probability of a word")
    p.add_argument("--noise-replace", type=float, default=b.noise_replace, help="probability of the filler")
    p.add_argument("--noise-swap", type=int, default=b.noise_swap, help="words move at most this far")
    p.add_argument("--noise-filler", default=b.noise_filler, help="the word that replaces words")
    p.add_argument("--seed", type=int, default=b.seed, help="seed of sampling and noise (per line id)")
    p.add_argument("--engine", choices=("auto", "raymt", "ctranslate2"), default=b.engine)
    p.add_argument("--compute-type", default=b.compute_type, help="CTranslate2: auto = int8 on CPU, float16 on GPU")
    p.add_argument("--max-tokens", type=int, default=b.max_tokens, help="padded source tokens per batch")
    p.add_argument("--shard-lines", type=int, default=b.shard_lines, help="input lines per output shard")
    p.add_argument("--num-actors", type=int, help=f"decoding actors; default {CPU_ACTORS}, with --gpu one per GPU")
    p.add_argument("--gpu", action="store_true", help="one GPU per actor")
    p.add_argument("--cpus-per-actor", type=float, help="CPUs per actor (default: the cluster's, split)")
    p.add_argument("--num-cpus", type=int, help="CPUs of a local Ray instance (not with RAY_ADDRESS)")
    p.add_argument("--progress-s", type=float, default=b.progress_s, help="seconds between progress lines")
    p.add_argument("--verbose", action="store_true", help="also print Ray's own INFO lines")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the model


@dataclass
class Model:
    """What the driver knows of the model: its kind, config, tokenizer and languages."""

    location: str  # normalized path or URI
    kind: str  # "raymt" (a checkpoint or export) or "ctranslate2" (a CTranslate2 export)
    config: Config
    tokenizer: Tokenizer
    languages: Optional[dict]  # config.json's "languages" (tagged multilingual models), else None


def is_ct2_export(directory: Path) -> bool:
    """Whether a local directory is a `raymt export --format ctranslate2` output."""
    return (directory / "model.bin").is_file() and (directory / CT2_RAYMT_CONFIG).is_file()


def load_model_info(checkpoint: str) -> Model:
    """The model's kind, config, tokenizer and languages; one-line errors for a missing or broken one."""
    directory = local_checkpoint(checkpoint)
    if is_ct2_export(directory):
        meta = _json(directory / CT2_RAYMT_CONFIG)
        try:
            config = Config.from_dict(meta["config"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"{directory / CT2_RAYMT_CONFIG} is not a raymt export config ({err})") from None
        tokenizer = Tokenizer.load(directory / SPM_FILE)
        kind = "ctranslate2"
    else:
        config, tokenizer = check_checkpoint(directory)
        meta = _json(directory / CONFIG_FILE)
        kind = "raymt"
    return Model(storage.normalize(checkpoint), kind, config, tokenizer, meta.get("languages"))


def _json(path: Path) -> dict:
    """A JSON object from a file, with a one-line error."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {first_line(err)}") from None


def directions(model: Model, src_lang: Optional[str], tgt_lang: Optional[str]) -> tuple[str, str, list[str]]:
    """(src_lang, tgt_lang, tag pieces before each source): checked against what the model was trained on."""
    data = model.config.data
    if model.languages:  # a tagged multilingual model (design-inputs.md section 6)
        tags = decode_tags(tgt_lang, model.languages.get("target_langs", []), model.languages.get("reserved", {}))
        tgt_lang = tgt_lang or model.languages["target_langs"][0]  # untagged many-to-one: its one target
        # Only the sources trained into tgt_lang: en->en on an en<->de model is no trained pair.
        sources = trained_sources(model.languages, tgt_lang)
        if src_lang is None and len(sources) > 1:
            raise ValueError(
                f"this model translates into {tgt_lang} from {', '.join(sources)}: pass --src-lang (the input's)"
            )
        if src_lang is not None and src_lang not in sources:
            raise ValueError(
                f"--src-lang {src_lang}: {model.location} was trained to translate into {tgt_lang} from "
                f"{', '.join(sources)}; back-translate text in one of them"
            )
        return src_lang or sources[0], tgt_lang, tags
    for flag, given, own, side in (
        ("--src-lang", src_lang, data.src_lang, "input"),
        ("--tgt-lang", tgt_lang, data.tgt_lang, "output"),
    ):
        if given is not None and given != own:
            raise ValueError(
                f"{flag} {given}: {model.location} translates {data.src_lang}->{data.tgt_lang}, so its "
                f"{side} is {own}; to back-translate {tgt_lang or data.tgt_lang} text into "
                f"{src_lang or data.src_lang}, use a {src_lang or data.src_lang}->"
                f"{tgt_lang or data.tgt_lang} model (a reverse model of the pair you train)"
            )
    return data.src_lang, data.tgt_lang, []


def resolve_engine(requested: str, model: Model) -> str:
    """'raymt' or 'ctranslate2' for --engine; auto takes CTranslate2 when it is installed."""
    have_ct2 = importlib.util.find_spec("ctranslate2") is not None
    if model.kind == "ctranslate2":
        if requested == "raymt":
            raise ValueError(
                f"--engine raymt: {model.location} is a CTranslate2 export; pass the raymt checkpoint "
                "it came from, or --engine ctranslate2"
            )
        if not have_ct2:
            raise ValueError(f"{model.location} is a CTranslate2 export: pip install ctranslate2")
        return "ctranslate2"
    if requested == "ctranslate2" and not have_ct2:
        raise ValueError("--engine ctranslate2 needs the ctranslate2 package: pip install ctranslate2")
    if requested == "auto":
        return "ctranslate2" if have_ct2 else "raymt"
    return requested


def ct2_model_dir(checkpoint: str, cache: Optional[str] = None) -> Path:
    """A local CTranslate2 directory of the model: the export itself, or the checkpoint exported once
    into raymt's cache (keyed by its location and weights), renamed into place whole."""
    from raymt.export import export_model

    local = local_checkpoint(checkpoint)
    if is_ct2_export(local):
        return local
    stat = weights_file(local).stat()
    key = hashlib.sha256(f"{storage.normalize(checkpoint)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    target = (Path(cache) if cache else storage.cache_root()) / "ctranslate2" / key[:16]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        export_model(local, tmp / "model", "ctranslate2")
        os.replace(tmp / "model", target)
    except OSError:
        if not target.is_dir():  # else another process won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------- the input


@dataclass
class InputFile:
    """One input file: where, what kind, and its size, mtime and line count."""

    path: str
    kind: str  # "text", "tsv", "jsonl" or "parquet"
    size: int
    mtime_ns: Optional[int]
    num_lines: int = -1  # counted once (remembered in bt.json)
    first_line: int = 0  # line id of its first line: the files' lines count on in order


def file_kind(path: str) -> str:
    """The reader of a file, by its extension (compression aside)."""
    lower = path.lower()
    for suffix in COMPRESSED:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
            break
    if lower.endswith(".tsv"):
        return "tsv"
    if lower.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if lower.endswith(TABLE_SUFFIXES):
        return "parquet"
    return "text"


def _file_info(path: str) -> InputFile:
    """An input file's kind, size and mtime; one line when it is missing or unreadable."""
    fs, fs_path = storage.filesystem(path)
    try:
        info = fs.get_file_info(fs_path)
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"cannot access --input {path}: {first_line(err)}; check the URI and credentials") from None
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"--input {path} does not exist: check the path (a file, glob, directory or s3:// URI)")
    if info.type != pafs.FileType.File:
        raise ValueError(f"--input {path} is not a file")
    return InputFile(path, file_kind(path), int(info.size or 0), info.mtime_ns)


def input_files(spec: str) -> list[InputFile]:
    """The files of --input in line-id order: a file, a local glob, or every file of a directory/prefix."""
    try:
        if not storage.is_uri(spec) and any(c in spec for c in "*?["):
            paths = sorted(p for p in glob.glob(os.path.expanduser(spec)) if os.path.isfile(p))
            if not paths:
                raise ValueError(f"--input {spec}: no file matches this pattern")
        elif storage.file_type(spec) == pafs.FileType.Directory:
            fs, path = storage.filesystem(spec)
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
            names = sorted(
                i.base_name for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith(".")
            )
            if not names:
                raise ValueError(f"--input {spec} is a directory without files")
            paths = [storage.join(spec, n) for n in names]
        else:
            paths = [storage.normalize(spec) if not storage.is_uri(spec) else spec]
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"cannot read --input {spec}: {first_line(err)}; check the URI and credentials") from None
    return [_file_info(p) for p in paths]


def count_lines(f: InputFile) -> int:
    """Lines of a text file as `raymt.data.text.lines` splits them (a last line without newline
    counts), or rows of a Parquet/Arrow file (from its metadata)."""
    try:
        if f.kind == "parquet":
            return _table_rows(f.path)
        count, last = 0, b"\n"
        with open_binary(f.path) as stream:
            while chunk := stream.read(1 << 20):
                count += chunk.count(b"\n")
                last = chunk[-1:]
        return count + (last != b"\n")
    except (OSError, EOFError, lzma.LZMAError, pa.ArrowException, ValueError) as err:
        raise ValueError(
            f"cannot read --input {f.path}: {first_line(err)}; check that the file is complete and "
            "that its extension matches its compression"
        ) from None


def _table_rows(path: str) -> int:
    """Rows of a Parquet or Arrow IPC file."""
    fs, fs_path = storage.filesystem(path)
    with fs.open_input_file(fs_path) as fh:
        if path.lower().endswith(".parquet"):
            return pq.ParquetFile(fh).metadata.num_rows
        try:
            return pa.ipc.open_file(fh).read_all().num_rows
        except pa.ArrowInvalid:
            fh.seek(0)
            return pa.ipc.open_stream(fh).read_all().num_rows


def default_column(kind: str, column: Optional[str], src_lang: str) -> Optional[str]:
    """The column read from a file: TSV 0, JSONL/Parquet the source language; None for text."""
    if kind == "text":
        return None
    if kind == "tsv":
        col = column or "0"
        if not col.isdigit():
            raise ValueError(f"--column {col!r}: a TSV column is a 0-based number")
        return col
    return column or src_lang


def check_columns(files: Sequence[InputFile], column: Optional[str], src_lang: str) -> None:
    """Parquet and Arrow files must hold the column as strings; a JSONL file's first object must have the key."""
    from raymt.data.prepare import table_schema  # prepare's reader of the same inputs

    for f in files:
        col = default_column(f.kind, column, src_lang)
        if f.kind == "parquet":
            schema = table_schema(f.path)  # a one-line error for a file that is not one
            if col not in schema.names:
                raise ValueError(f"{f.path} has no column {col!r} (columns: {', '.join(schema.names)}): pass --column")
            if not pa.types.is_string(schema.field(col).type) and not pa.types.is_large_string(schema.field(col).type):
                raise ValueError(f"{f.path}: column {col!r} is {schema.field(col).type}, not text: pass --column")
        elif f.kind == "jsonl":
            first = _first_json(f.path)
            if first is not None and col not in first:
                raise ValueError(
                    f"{f.path}: the first object has no key {col!r} (keys: {', '.join(first) or 'none'}): pass --column"
                )


def _first_json(path: str) -> Optional[dict]:
    """The first JSON object of a JSONL file (None when it has none readable)."""
    from raymt.data.text import lines

    for raw in lines(path):
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def _text_of(raw: Any, kind: str, column: Optional[str], first: bool) -> Optional[str]:
    """One input line's text, or None when it is invalid (bad UTF-8, bad JSON, missing column)."""
    if kind == "parquet":
        return raw if isinstance(raw, str) else ""  # null: an empty line
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.lstrip("\ufeff") if first else text
    text = text.rstrip("\r")
    if kind == "text" or not text.strip():
        return text
    if kind == "tsv":
        fields = text.split("\t")
        col = int(column)  # type: ignore[arg-type]
        return fields[col] if col < len(fields) else None
    try:
        value = json.loads(text).get(column)
    except (json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) else ("" if value is None else None)


def _raw_items(f: InputFile, column: Optional[str]) -> Iterator[Any]:
    """A file's lines as bytes (text, tsv, jsonl) or its column's values (parquet)."""
    from raymt.data.text import lines

    if f.kind != "parquet":
        yield from lines(f.path)
        return
    fs, path = storage.filesystem(f.path)
    with fs.open_input_file(path) as fh:
        if f.path.lower().endswith(".parquet"):
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=10_000, columns=[column]):
                yield from batch.column(0).to_pylist()
        else:
            try:
                table = pa.ipc.open_file(fh).read_all()
            except pa.ArrowInvalid:
                fh.seek(0)
                table = pa.ipc.open_stream(fh).read_all()
            yield from table.column(column).to_pylist()


def _changed(f: InputFile, now: str) -> InputError:
    """The error of an input file whose line count is not the one counted when the job started."""
    return InputError(
        f"{f.path} has {now} lines now but had {f.num_lines} when the job started: an input must not "
        "change during a job; pass a new --output"
    )


def shard_inputs(job: Job) -> Iterator[tuple[int, pa.Table]]:
    """The shards to do in line-id order, each one table (line_id, text; text null when invalid),
    read file by file in this process: one shard in memory at a time, whatever the files' sizes.
    A shard may span files; files without a shard to do are not opened."""
    shard_lines, todo = job.bt.shard_lines, set(job.todo)
    src_lang = job.src_lang.split("+")[0]
    ids: list[int] = []
    texts: list[Optional[str]] = []
    for f in job.files:
        first, end = f.first_line, f.first_line + f.num_lines
        if not any(s in todo for s in range(first // shard_lines, -(-end // shard_lines))):
            continue
        col = default_column(f.kind, job.args.column, src_lang)
        line_id = first
        for raw in _raw_items(f, col):
            if line_id == end:
                raise _changed(f, "more")
            shard = line_id // shard_lines
            if shard in todo:  # the lines of done shards are not decoded
                ids.append(line_id)
                texts.append(_text_of(raw, f.kind, col, line_id == first))
                if len(ids) == job.shard_rows(shard):
                    yield shard, pa.table({"line_id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())})
                    ids, texts = [], []
            line_id += 1
        if line_id != end:
            raise _changed(f, str(line_id - first))


# ---------------------------------------------------------------- decoding


def token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices sorted by length (stable), cut so that each batch's padded size (sentences x
    longest) stays within max_tokens; a sentence longer than that is a batch of its own."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def noise_words(text: str, rng: random.Random, bt: BacktranslateConfig) -> str:
    """Edunov et al. (2018)'s noise on an output: each word dropped with p_delete, else replaced
    by the filler with p_replace; then a shuffle moving no word more than noise_swap places
    (Lample et al. 2018: sort by i + U(0, swap + 1)). A non-empty output keeps a word."""
    words = text.split()
    kept = []
    for word in words:
        if rng.random() < bt.noise_delete:
            continue
        kept.append(bt.noise_filler if rng.random() < bt.noise_replace else word)
    if words and not kept:
        kept = [rng.choice(words)]
    if bt.noise_swap > 0:
        keys = [i + rng.uniform(0, bt.noise_swap + 1) for i in range(len(kept))]
        kept = [w for _, w in sorted(zip(keys, kept), key=lambda kw: kw[0])]
    return " ".join(kept)


def _batch_seed(seed: int, first_line_id: int) -> int:
    """A sampling seed per batch, from the run's seed and the batch's first line id (repeatable)."""
    digest = hashlib.blake2b(f"{seed}:{first_line_id}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


class RaymtEngine:
    """raymt's own decoder (raymt.decoding) on CPU or GPU, at the checkpoint's precision."""

    def __init__(self, checkpoint: str, opts: DecodeOptions, device: str, tags: list[str], **_: Any):
        from raymt.checkpoint import load_model
        from raymt.precision import for_inference

        self.model, self.tokenizer, cfg = load_model(checkpoint, device)
        self.opts, self.device = opts, device
        self.tag_ids = [self.tokenizer.sp.piece_to_id(t) for t in tags]
        self.autocast = for_inference(device, cfg, self.tokenizer.vocab_size).apply().autocast
        self.max_src = cfg.model.max_positions - 1

    def encode(self, text: str) -> list[int]:
        """Source ids: tags, pieces (truncated to fit the positions), EOS."""
        return self.tag_ids + self.tokenizer.encode(text)[: self.max_src - 1 - len(self.tag_ids)] + [EOS_ID]

    def translate(self, sources: list[list[int]], seed: int) -> list[tuple[float, str]]:
        """(score, text) of one batch of encoded sources."""
        from raymt.decoding import decode_ids

        opts = dataclasses.replace(self.opts, seed=seed) if self.opts.sample else self.opts
        with self.autocast():
            return [h[0] for h in decode_ids(self.model, self.tokenizer, sources, opts, 1, self.device)]


class CT2Engine:
    """CTranslate2 on the model exported once (int8 on CPU by default); raymt's per-sentence
    length limit (a * src_len + b) by truncation, scores are CTranslate2's."""

    def __init__(
        self,
        checkpoint: str,
        opts: DecodeOptions,
        device: str,
        tags: list[str],
        num_threads: int = 1,
        compute_type: str = "auto",
        cache: Optional[str] = None,
    ):
        import ctranslate2

        directory = ct2_model_dir(checkpoint, cache)
        if compute_type == "auto":
            compute_type = "float16" if device == "cuda" else "int8"
        self.translator = ctranslate2.Translator(
            str(directory), device=device, compute_type=compute_type, intra_threads=num_threads, inter_threads=1
        )
        self.ct2, self.tokenizer = ctranslate2, Tokenizer.load(directory / SPM_FILE)
        self.opts, self.tags = opts, tags
        meta = json.loads((directory / CT2_RAYMT_CONFIG).read_text())
        self.max_src = int(meta["config"]["model"]["max_positions"]) - 1

    def encode(self, text: str) -> list[str]:
        """Source pieces: tags and pieces, truncated to fit (CTranslate2 appends EOS itself)."""
        pieces = self.tokenizer.sp.encode(text, out_type=str)
        return self.tags + pieces[: self.max_src - 1 - len(self.tags)]

    def translate(self, sources: list[list[str]], seed: int) -> list[tuple[float, str]]:
        """(score, text) of one batch of sources."""
        opts = self.opts
        limits = [min(int(opts.max_len_a * (len(s) + 1) + opts.max_len_b), self.max_src) for s in sources]
        if opts.sample:
            self.ct2.set_random_seed(seed % (2**31))
        results = self.translator.translate_batch(
            sources,
            beam_size=opts.beam,
            length_penalty=opts.length_penalty,
            max_decoding_length=max(1, max(limits) - 1),
            min_decoding_length=0,
            return_scores=True,
            sampling_topk=(opts.top_k if opts.sample else 1),
            sampling_temperature=opts.temperature,
        )
        sp = self.tokenizer.sp
        out = []
        for result, limit in zip(results, limits):
            pieces = result.hypotheses[0][: max(0, limit - 1)]  # raymt's limit includes EOS
            ids = [sp.piece_to_id(p) for p in pieces if not p.startswith("<raymt_filler_")]
            out.append((float(result.scores[0]) if result.scores else 0.0, self.tokenizer.decode(ids)))
        return out


ENGINES = {"raymt": RaymtEngine, "ctranslate2": CT2Engine}


class BacktranslateActor:
    """Decoding actor: loads the model once, then translates whole shards and writes each one."""

    def __init__(
        self,
        checkpoint: str,
        engine: str,
        opts: dict,
        bt: dict,
        tags: list[str],
        device: str,
        num_threads: int,
        output: str,
        driver_node: str,
        cache: Optional[str] = None,
        delay_s: float = 0.0,
    ):
        import ray
        import torch

        torch.set_num_threads(num_threads)
        self.bt, self.delay_s, self.output = BacktranslateConfig(**bt), delay_s, output
        # A local --output is the driver's directory: an actor on another machine sends its bytes back.
        self.writes = storage.is_uri(output) or ray.get_runtime_context().get_node_id() == driver_node
        self.engine = ENGINES[engine](
            checkpoint,
            DecodeOptions(**opts),
            device,
            tags,
            num_threads=num_threads,
            compute_type=self.bt.compute_type,
            cache=cache,
        )

    def translate_shard(self, shard: int, block: pa.Table) -> dict:
        """Translate a whole shard and write its file; a small record back (shard, lines, counts),
        with the file's bytes only when this machine cannot write to --output."""
        data, counts = shard_file(translate_block(self.engine, block, self.bt, self.delay_s))
        record: dict[str, Any] = {"shard": shard, "lines": block.num_rows, "counts": counts}
        if self.writes:
            write_shard(storage.join(self.output, shard_name(shard * self.bt.shard_lines)), data)
        else:
            record["data"] = data
        return record


def translate_block(engine: Any, block: pa.Table, bt: BacktranslateConfig, delay_s: float = 0.0) -> pa.Table:
    """Translate a block's valid, non-empty lines in token-budget batches; the others get ''."""
    line_ids = block.column("line_id").to_pylist()
    texts = block.column("text").to_pylist()
    n = len(line_ids)
    outputs, scores = [""] * n, [float("nan")] * n
    status = [STATUS_INVALID if t is None else STATUS_OK if t.strip() else STATUS_EMPTY for t in texts]
    todo = [i for i in range(n) if status[i] == STATUS_OK]
    encoded = [engine.encode(texts[i].strip()) for i in todo]
    for batch in token_batches([len(e) for e in encoded], bt.max_tokens):
        seed = _batch_seed(bt.seed, line_ids[todo[batch[0]]])
        for j, (score, text) in zip(batch, engine.translate([encoded[j] for j in batch], seed)):
            i = todo[j]
            if bt.noise:
                text = noise_words(text, random.Random(f"{bt.seed}:{line_ids[i]}"), bt)
            outputs[i], scores[i] = text.replace("\n", " "), score
    if delay_s:
        time.sleep(delay_s)
    return pa.table(
        {
            "line_id": pa.array(line_ids, pa.int64()),
            "input": pa.array([t or "" for t in texts], pa.string()),
            "output": pa.array(outputs, pa.string()),
            "score": pa.array(scores, pa.float64()),
            "status": pa.array(status, pa.int8()),
        }
    )


# ---------------------------------------------------------------- the job and its output


@dataclass
class Job:
    """Everything checked before Ray starts: the model, input, output and what is left to do."""

    args: argparse.Namespace
    bt: BacktranslateConfig
    opts: DecodeOptions
    model: Model
    engine: str
    src_lang: str
    tgt_lang: str
    tags: list[str]
    files: list[InputFile]
    output: str
    info: dict  # bt.json
    done: dict[int, dict] = field(default_factory=dict)  # shard -> its counts, for verified shard files
    todo: list[int] = field(default_factory=list)

    @property
    def num_lines(self) -> int:
        """Lines of the whole input."""
        return sum(f.num_lines for f in self.files)

    @property
    def num_shards(self) -> int:
        """Output shards of the whole input."""
        return -(-self.num_lines // self.bt.shard_lines)

    def shard_rows(self, shard: int) -> int:
        """Lines of shard `shard` (the last one may be short)."""
        return min(self.bt.shard_lines, self.num_lines - shard * self.bt.shard_lines)


def shard_name(first_line_id: int) -> str:
    """`part-000000010000.parquet`: names sort in line-id order."""
    return f"{SHARD_PREFIX}{first_line_id:012d}.parquet"


def shard_file(table: pa.Table) -> tuple[bytes, dict]:
    """A translated shard's Parquet file (rows in line-id order, its counts in the schema's
    metadata) and its counts."""
    table = table.take(pa.compute.sort_indices(table, [("line_id", "ascending")]))
    status = table.column("status").to_pylist()
    counts = {
        "translated": status.count(STATUS_OK),
        "empty": status.count(STATUS_EMPTY),
        "invalid": status.count(STATUS_INVALID),
    }
    out = table.select(OUT_SCHEMA.names).cast(OUT_SCHEMA).replace_schema_metadata({META_KEY: json.dumps(counts)})
    buf = io.BytesIO()
    pq.write_table(out, buf)
    return buf.getvalue(), counts


def write_shard(location: str, data: bytes) -> None:
    """Write a shard file whole: locally under a temporary name of this writer's own, then renamed
    (a retried task and a first try that is still running never mix); an object in one PUT."""
    if storage.is_uri(location):
        storage.write_bytes(location, data)
        return
    path = Path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")  # find_done removes leftovers
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def settings(job: Job) -> dict:
    """What fixes a job's outputs: a rerun into the same --output must have the same."""
    return {
        "checkpoint": job.model.location,
        "engine": job.engine,
        "src_lang": job.src_lang,
        "tgt_lang": job.tgt_lang,
        "tags": job.tags,
        "decode": {k: v for k, v in job.opts.__dict__.items() if k != "use_cache"},
        "noise": {
            k: getattr(job.bt, k) for k in ("noise", "noise_delete", "noise_replace", "noise_swap", "noise_filler")
        },
        "seed": job.bt.seed,
        "shard_lines": job.bt.shard_lines,
        "input": {
            "spec": job.args.input,
            "column": job.args.column,
            "files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns} for f in job.files],
        },
    }


SETTING_FLAGS = {
    "checkpoint": "--checkpoint",
    "engine": "--engine",
    "src_lang": "--src-lang",
    "tgt_lang": "--tgt-lang",
    "tags": "--tgt-lang",
    "decode": "the decoding flags",
    "noise": "the --noise flags",
    "seed": "--seed",
    "shard_lines": "--shard-lines",
    "input": "--input (or its files changed)",
}


def check_output(job: Job) -> Optional[dict]:
    """The existing bt.json of --output (None for a new job); a one-line error for other settings."""
    location = job.output
    kind = storage.file_type(location)
    if kind == pafs.FileType.File:
        raise ValueError(f"--output {location} is a file: pass a directory (or a URI prefix)")
    old = storage.optional_bytes(storage.join(location, INFO_FILE))
    if old is None:
        if kind == pafs.FileType.Directory and any(n.startswith(SHARD_PREFIX) for n in storage.listdir(location)):
            raise ValueError(f"--output {location} holds shards but no {INFO_FILE}: pass a new --output")
        return None
    try:
        info = json.loads(old)
        assert info.get("format") == INFO_FORMAT
    except (json.JSONDecodeError, AssertionError, AttributeError):
        raise ValueError(f"{storage.join(location, INFO_FILE)} is not a raymt back-translation record") from None
    now = settings(job)
    differ = [k for k in now if info.get(k) != now[k]]
    if differ:
        names = ", ".join(dict.fromkeys(SETTING_FLAGS[k] for k in differ))
        raise ValueError(
            f"--output {location} holds a back-translation with other settings ({names}): rerun it with "
            "the same flags to finish it, or pass a new --output"
        )
    return info


def count_inputs(job: Job, old: Optional[dict]) -> None:
    """Each input file's line count: from bt.json when the same files were counted before."""
    known = old.get("num_lines_per_file") if old else None
    if known and len(known) == len(job.files):
        for f, n in zip(job.files, known):
            f.num_lines = int(n)
        return
    for f in job.files:
        f.num_lines = count_lines(f)
    if job.num_lines == 0:
        raise ValueError(f"--input {job.args.input} has no lines")


def shard_counts(location: str, expected_rows: int) -> Optional[dict]:
    """A finished shard's counts, or None when it is missing, unreadable or has another row count."""
    fs, path = storage.filesystem(location)
    try:
        with fs.open_input_file(path) as fh:
            meta = pq.ParquetFile(fh).metadata
            counts = json.loads((meta.metadata or {}).get(META_KEY, b"{}"))
    except (OSError, pa.ArrowException, json.JSONDecodeError):
        return None
    if meta.num_rows != expected_rows or not isinstance(counts, dict) or "empty" not in counts:
        return None
    return counts


def find_done(job: Job) -> None:
    """Verify the shard files already written (row counts); the rest, and broken ones, are to do."""
    names = set(storage.listdir(job.output))
    if not storage.is_uri(job.output):
        for name in names:  # left by a driver killed while writing
            if name.startswith(SHARD_PREFIX) and name.endswith(".tmp"):
                os.remove(os.path.join(job.output, name))
    for shard in range(job.num_shards):
        name = shard_name(shard * job.bt.shard_lines)
        counts = shard_counts(storage.join(job.output, name), job.shard_rows(shard)) if name in names else None
        if counts is None:
            job.todo.append(shard)
        else:
            job.done[shard] = counts


def write_info(job: Job, done: bool = False) -> None:
    """bt.json: settings, line counts, totals so far and whether the job is complete."""
    totals = {"translated": 0, "empty": 0, "invalid": 0}
    for counts in job.done.values():
        for key in totals:
            totals[key] += int(counts.get(key, 0))
    info = {
        "format": INFO_FORMAT,
        **settings(job),
        "num_lines": job.num_lines,
        "num_lines_per_file": [f.num_lines for f in job.files],
        "num_shards": job.num_shards,
        "shards_done": len(job.done),
        "counts": totals,
        "done": done,
        "text": text_names(job) if done and job.args.format == "text" else [],
    }
    job.info = info
    storage.write_bytes(storage.join(job.output, INFO_FILE), json.dumps(info, indent=2).encode())


def check_args(args: argparse.Namespace) -> Job:
    """Everything that can be wrong with the command line, checked before Ray starts."""
    if args.num_actors is not None and args.num_actors < 1:
        raise ValueError(f"--num-actors {args.num_actors} must be >= 1")
    if args.cpus_per_actor is not None and args.cpus_per_actor <= 0:
        raise ValueError(f"--cpus-per-actor {args.cpus_per_actor} must be > 0")
    if args.beam < 1:
        raise ValueError(f"--beam {args.beam} must be >= 1")
    if args.sample and args.noise:
        raise ValueError("--sample and --noise are two ways of back-translating: pick one")
    bt = BacktranslateConfig(
        shard_lines=args.shard_lines,
        max_tokens=args.max_tokens,
        engine=args.engine,
        compute_type=args.compute_type,
        noise=args.noise,
        noise_delete=args.noise_delete,
        noise_replace=args.noise_replace,
        noise_swap=args.noise_swap,
        noise_filler=args.noise_filler,
        seed=args.seed,
        progress_s=args.progress_s,
    )
    opts = decode_options(args, seed=args.seed if args.sample else None)
    model = load_model_info(args.checkpoint)
    src_lang, tgt_lang, tags = directions(model, args.src_lang, args.tgt_lang)
    engine = resolve_engine(bt.engine, model)
    if engine == "ctranslate2":
        ct2_model_dir(model.location)  # exported once here: an unexportable model fails now
    else:
        load_weights(model.location)  # a corrupt or truncated weights file fails now, not in every actor
    files = input_files(args.input)
    check_columns(files, args.column, src_lang.split("+")[0])
    job = Job(args, bt, opts, model, engine, src_lang, tgt_lang, tags, files, storage.normalize(args.output), {})
    old = check_output(job)
    job.info = old or {}  # the previous run's record until write_info replaces it
    count_inputs(job, old)
    offset = 0
    for f in files:
        f.first_line, offset = offset, offset + f.num_lines
    find_done(job)
    return job


# ---------------------------------------------------------------- running it


class Progress:
    """The driver's record of a run: each finished shard's counts (its file written by its actor,
    or here from the bytes an actor sent), and a progress line every --progress-s seconds."""

    def __init__(self, job: Job):
        self.job = job
        self.lines = 0  # lines translated (or counted empty) in this run
        self.started = self.ended = time.time()
        self.printed = self.started
        self.last_line = ""

    def add(self, record: dict) -> None:
        """Take one finished shard's record (shard, lines, counts and maybe the file's bytes)."""
        shard = record["shard"]
        if "data" in record:
            write_shard(storage.join(self.job.output, shard_name(shard * self.job.bt.shard_lines)), record["data"])
        self.job.done[shard] = record["counts"]
        self.lines += record["lines"]
        self.ended = time.time()

    def show(self, final: bool = False) -> None:
        """A progress line every --progress-s seconds: lines, shards, sentences/s and ETA."""
        now = time.time()
        if not final and now - self.printed < self.job.bt.progress_s:
            return
        self.printed = now
        job, rate = self.job, self.lines / max(now - self.started, 1e-9)
        done_lines = sum(job.shard_rows(s) for s in job.done)
        left = job.num_lines - done_lines
        eta = f"ETA {_clock(left / rate)}" if rate > 0 and left > 0 else ("done" if left <= 0 else "ETA ?")
        line = (
            f"backtranslate: {done_lines:,}/{job.num_lines:,} lines ({100 * done_lines / job.num_lines:.1f}%), "
            f"{len(job.done)}/{job.num_shards} shards, {rate:,.1f} sentences/s, {eta}"
        )
        if line != self.last_line:
            print(line, flush=True)
        self.last_line = line


def _clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def start_actors(job: Job) -> list:
    """The decoding actors (no more than shards to do), restarted by Ray if one dies and its
    shards retried; spread over the cluster's machines."""
    import ray

    from raymt.evaluate import actor_plan, default_actors

    args = job.args
    num_actors = min(args.num_actors or default_actors(args.gpu), len(job.todo))
    # No Ray Data here (the driver reads the input): the actors may take every CPU.
    plan = actor_plan(num_actors, args.gpu, args.cpus_per_actor, keep_cpus=0)  # one line if they do not fit
    actor = ray.remote(BacktranslateActor).options(
        num_cpus=plan.cpus,
        num_gpus=plan.gpus,
        max_restarts=-1,
        max_task_retries=-1,  # a shard of a dead actor is decoded again once Ray restarted it
        scheduling_strategy="SPREAD",
    )
    kwargs = {
        "checkpoint": job.model.location,
        "engine": job.engine,
        "opts": dict(job.opts.__dict__),
        "bt": dataclasses.asdict(job.bt),
        "tags": job.tags,
        "device": "cuda" if args.gpu else "cpu",
        "num_threads": plan.num_threads,
        "output": job.output,
        "driver_node": ray.get_runtime_context().get_node_id(),
        "cache": str(storage.cache_root()),
        "delay_s": float(os.environ.get(DELAY_ENV, "0") or 0),
    }
    return [actor.remote(**kwargs) for _ in range(num_actors)]


def run_on_cluster(job: Job, progress: Progress) -> None:
    """Read the shards to do here and hand each to the least busy actor, which writes its file;
    at most QUEUE_PER_ACTOR shards per actor at a time, so memory stays flat in the input's size."""
    import ray

    actors = start_actors(job)
    queued = [0] * len(actors)
    pending: dict[Any, int] = {}  # a shard's record (ObjectRef) -> its actor's index

    def collect() -> None:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=job.bt.progress_s)
        for ref in ready:
            queued[pending.pop(ref)] -= 1
            progress.add(ray.get(ref))
        progress.show()

    progress.started = progress.printed = time.time()  # the rate counts decoding, not Ray's start
    try:
        for shard, block in shard_inputs(job):
            while len(pending) >= QUEUE_PER_ACTOR * len(actors):
                collect()
            i = queued.index(min(queued))
            pending[actors[i].translate_shard.remote(shard, block)] = i
            queued[i] += 1
        while pending:
            collect()
    finally:
        for actor in actors:  # at once: a failed run's actors must not hold the cluster's CPUs
            ray.kill(actor)


def text_names(job: Job) -> list[str]:
    """The aligned text files of --format text: inputs and outputs."""
    return [f"text.{job.src_lang}", f"text.{job.tgt_lang}"]


def text_complete(job: Job) -> bool:
    """Whether bt.json (as the previous run left it) records the text files as written whole: a run
    killed while writing them left done false, whatever files it left behind."""
    names = text_names(job)
    recorded = job.info.get("done") is True and job.info.get("text") == names
    return recorded and all(storage.exists(storage.join(job.output, n)) for n in names)


def write_text(job: Job) -> None:
    """text.<src> and text.<tgt> from the shards in order, one shard in memory at a time; written
    under temporary names and moved into place only when both are complete."""
    names = text_names(job)
    if names[0] == names[1]:
        raise ValueError(f"--format text: source and target are both {job.src_lang}; read the Parquet shards instead")
    fs, _ = storage.filesystem(job.output)
    targets = [storage.filesystem(storage.join(job.output, n))[1] for n in names]
    temps = [t + ".tmp" for t in targets]
    try:
        with _text_output(fs, temps[0]) as src_out, _text_output(fs, temps[1]) as tgt_out:
            for shard in range(job.num_shards):
                _, path = storage.filesystem(storage.join(job.output, shard_name(shard * job.bt.shard_lines)))
                with fs.open_input_file(path) as fh:
                    table = pq.read_table(fh, columns=["input", "output"])
                for column, out in (("input", src_out), ("output", tgt_out)):
                    out.write("".join(t.replace("\n", " ") + "\n" for t in table.column(column).to_pylist()))
    except BaseException:
        for tmp in temps:  # an object store completes a stream closed by an error: a partial object
            _delete_quietly(fs, tmp)
        raise
    for tmp, target in zip(temps, targets):
        fs.move(tmp, target)


def _text_output(fs: pafs.FileSystem, path: str) -> io.TextIOWrapper:
    """A writable UTF-8 text stream of a file or object (an object appears when closed)."""
    return io.TextIOWrapper(fs.open_output_stream(path, compression=None), encoding="utf-8")


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    """Delete a file or object if it is there."""
    try:
        fs.delete_file(path)
    except (OSError, pa.ArrowException):
        pass


def summary(job: Job, seconds: float, progress: Progress) -> str:
    """The last line: counts, wall time, decoding speed (Ray's start aside) and where the output is."""
    c = job.info["counts"]
    decoding_s = max(progress.ended - progress.started, 1e-9)
    rate = f", {progress.lines / decoding_s:,.1f} sentences/s" if progress.lines else ""
    return (
        f"backtranslated {job.num_lines:,} lines {job.src_lang}->{job.tgt_lang} ({c['translated']:,} translated, "
        f"{c['empty']:,} empty, {c['invalid']:,} invalid; engine {job.engine}) in {seconds:.1f} s{rate} -> {job.output}"
    )


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    t0 = time.time()
    try:
        check_ray_address()  # before anything is written to --output
        job = check_args(args)
        text_done = text_complete(job)  # from the previous run's bt.json, before this run's replaces it
        write_info(job)
    except ValueError as err:
        print(f"raymt.backtranslate: error: {err}", file=sys.stderr)
        return 2
    progress = Progress(job)
    if job.todo:
        print(
            f"backtranslate: {job.num_lines:,} lines in {job.num_shards} shards, {len(job.todo)} to do "
            f"({job.engine} engine, {job.src_lang}->{job.tgt_lang})",
            flush=True,
        )
        started = init_ray(args.num_cpus, verbose=args.verbose)
        try:
            run_on_cluster(job, progress)
        except Exception as err:  # noqa: BLE001 - a reader's one-line error inside Ray's wrapping
            user = user_error(err) if not isinstance(err, ValueError) else err
            if user is None:
                raise
            print(f"raymt.backtranslate: error: {user}", file=sys.stderr)
            return 2
        finally:
            if started:
                import ray

                ray.shutdown()
        progress.show(final=True)
    missing = [s for s in range(job.num_shards) if s not in job.done]
    if missing:
        print(
            f"raymt.backtranslate: error: shards {missing[:5]} are incomplete: run the same command again",
            file=sys.stderr,
        )
        return 1
    if args.format == "text" and (progress.lines or not text_done):  # shards redone: the text too
        write_text(job)
    write_info(job, done=True)
    print(summary(job, time.time() - t0, progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
