"""Monolingual input of `raymt backtranslate --input` (and of `raymt data mono`): its files, their
line counts, each line's text. A directory that `raymt data mono` wrote (its record `MONO_FILE`)
reads as the text files its record lists."""

from __future__ import annotations

import glob
import json
import lzma
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from raymt import storage
from raymt.data.text import (
    check_text_column,
    file_kind,
    input_file_info,
    lines,
    open_binary,
    record_batches,
    table_rows,
    table_schema,
)
from raymt.errors import InputError, first_line

BATCH_ROWS = 10_000  # rows of a Parquet/Arrow input read at a time
MONO_FILE = "mono.json"  # the record of a `raymt data mono` output (raymt.data.mono_clean): its "files"


@dataclass
class InputFile:
    """One input file: where, what kind, and its size, mtime and line count."""

    path: str
    kind: str  # "text", "tsv", "jsonl" or "parquet" (raymt.data.text.file_kind)
    size: int
    mtime_ns: Optional[int]
    num_lines: int = -1  # counted once (remembered in bt.json)
    first_line: int = 0  # line id of its first line: the files' lines count on in order


def file_info(path: str, flag: str = "--input") -> InputFile:
    """An input file's kind, size and mtime; one line naming `flag` when it is missing or unreadable."""
    info = input_file_info(path, f"{flag} {path}", "a file, glob, directory or s3:// URI")
    return InputFile(path, file_kind(path), int(info.size or 0), info.mtime_ns)


def input_files(spec: str, flag: str = "--input") -> list[InputFile]:
    """The files of --input (or `flag`) in line-id order: a file, a local glob, every file of a
    directory/prefix, or the text files of a `raymt data mono` output (those its MONO_FILE lists)."""
    try:
        if not storage.is_uri(spec) and any(c in spec for c in "*?["):
            paths = sorted(p for p in glob.glob(os.path.expanduser(spec)) if os.path.isfile(p))
            if not paths:
                raise ValueError(f"{flag} {spec}: no file matches this pattern")
        elif storage.file_type(spec) == pafs.FileType.Directory:
            fs, path = storage.filesystem(spec)
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
            names = sorted(
                i.base_name for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith(".")
            )
            if not names:
                raise ValueError(f"{flag} {spec} is a directory without files")
            names = _mono_files(spec, flag) if MONO_FILE in names else names
            paths = [storage.join(spec, n) for n in names]
        else:
            paths = [storage.normalize(spec) if not storage.is_uri(spec) else spec]
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"cannot read {flag} {spec}: {first_line(err)}; check the URI and credentials") from None
    return [file_info(p, flag) for p in paths]


def _mono_files(location: str, flag: str) -> list[str]:
    """The text files of a `raymt data mono` output, as its record lists them."""
    try:
        files = json.loads(storage.read_bytes(storage.join(location, MONO_FILE)))["files"]
        assert isinstance(files, list) and all(isinstance(f, str) for f in files)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError):
        raise ValueError(f"{flag} {location}: its {MONO_FILE} is not the record of `raymt data mono`") from None
    return files


def count_lines(f: InputFile) -> int:
    """Lines of a text file as `raymt.data.text.lines` splits them (a last line without newline
    counts), or rows of a Parquet/Arrow file (from its metadata)."""
    try:
        if f.kind == "parquet":
            return table_rows(f.path)
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
    """Parquet and Arrow files must hold the column as text; a JSONL file's first object must have the key."""
    for f in files:
        col = default_column(f.kind, column, src_lang)
        if f.kind == "parquet":
            # table_schema: a one-line error for a file that is not one
            check_text_column(f.path, table_schema(f.path), col, "--column")  # type: ignore[arg-type]
        elif f.kind == "jsonl":
            first = _first_json(f.path)
            if first is not None and col not in first:
                raise ValueError(
                    f"{f.path}: the first object has no key {col!r} (keys: {', '.join(first) or 'none'}): pass --column"
                )


def _first_json(path: str) -> Optional[dict]:
    """The first JSON object of a JSONL file (None when it has none readable)."""
    for raw in lines(path):
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def text_of(raw: Any, kind: str, column: Optional[str], first: bool) -> Optional[str]:
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


def raw_items(f: InputFile, column: Optional[str]) -> Iterator[Any]:
    """A file's lines as bytes (text, tsv, jsonl) or its column's values (parquet)."""
    if f.kind != "parquet":
        yield from lines(f.path)
        return
    for batch in record_batches(f.path, [column], BATCH_ROWS):  # type: ignore[list-item]
        yield from batch.column(0).to_pylist()


def changed_error(f: InputFile, now: str) -> InputError:
    """The error of an input file whose line count is not the one counted when the job started."""
    return InputError(
        f"{f.path} has {now} lines now but had {f.num_lines} when the job started: an input must not "
        "change during a job; pass a new --output"
    )
