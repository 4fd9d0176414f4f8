"""The one reader of text inputs: local paths or URIs (pyarrow filesystems), plain or
compressed (.gz, .xz, .zst, .bz2); the one home of file kinds and suffixes, the Arrow IPC
file-or-stream opener and the text-column check. Training (--train/--valid/--test), prepare,
evaluate and backtranslate all read their inputs through here."""

from __future__ import annotations

import contextlib
import gzip
import lzma
import zlib
from typing import Any, Iterator, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymt.errors import InputError, check, first_line
from raymt.storage import exists, filesystem

Pairs = tuple[list[str], list[str]]
COMPRESSED = (".gz", ".xz", ".zst", ".zstd", ".bz2")
TSV_SUFFIXES = (".tsv",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")  # Arrow IPC, file or stream format
COLUMNAR_SUFFIXES = (".parquet", *ARROW_SUFFIXES)  # read by column name: file kind "parquet"
# Files of rows with columns (kinds tsv, jsonl, parquet); any other name is text: a file of lines,
# or for parallel data a PREFIX of PREFIX.<src> and PREFIX.<tgt>.
TABLE_SUFFIXES = (*TSV_SUFFIXES, *JSONL_SUFFIXES, *COLUMNAR_SUFFIXES)


def input_file_info(
    uri: str, name: Optional[str] = None, hint: str = "a local path or an s3://, gs://, hdfs:// URI"
) -> pafs.FileInfo:
    """An input file's metadata (pyarrow FileInfo: size, mtime); a one-line `InputError` naming it
    (`name`, default its URI) when it cannot be reached, is missing or is not a file."""
    name = name or uri
    fs, path = filesystem(uri)
    try:
        info = fs.get_file_info(path)
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"cannot access {name}: {first_line(err)}; check the URI and credentials") from None
    if info.type == pafs.FileType.NotFound:
        raise InputError(f"missing file {name}: check the path ({hint})")
    if info.type != pafs.FileType.File:
        raise InputError(f"{name} is not a file: pass a file ({hint})")
    return info


@contextlib.contextmanager
def open_binary(uri: str) -> Iterator[Any]:
    """A readable binary stream of `uri`, decompressed by its extension."""
    fs, path = filesystem(uri)
    with fs.open_input_stream(path, compression=None) as raw:
        name = uri.lower()
        if name.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=raw, mode="rb")  # also reads multi-member files
        elif name.endswith(".xz"):
            stream = lzma.LZMAFile(raw)
        elif name.endswith((".zst", ".zstd")):
            stream = pa.CompressedInputStream(raw, "zstd")
        elif name.endswith(".bz2"):
            stream = pa.CompressedInputStream(raw, "bz2")
        else:
            stream = raw
        yield stream


def lines(uri: str) -> Iterator[bytes]:
    """The lines of a (compressed) file as bytes, split on b"\\n" only."""
    try:
        with open_binary(uri) as stream:
            rest = b""
            while chunk := stream.read(1 << 20):
                parts = (rest + chunk).split(b"\n")
                rest = parts.pop()
                yield from parts
            if rest:
                yield rest
    except (OSError, EOFError, zlib.error, lzma.LZMAError, pa.ArrowException) as err:  # zlib: damaged .gz data
        raise InputError(
            f"cannot read {uri}: {first_line(err)}; check that the file is complete "
            "and that its extension matches its compression"
        ) from None


def decode(raw: bytes, uri: str, line: int, on_invalid: str) -> Optional[str]:
    """A line as text; None for invalid UTF-8 when skipping, U+FFFD for it when replacing."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if on_invalid == "skip":
            return None
        if on_invalid != "replace":
            raise InputError(
                f"{uri}:{line}: not valid UTF-8 (byte {err.start} of the line): "
                "re-encode the file as UTF-8, or pass --skip-invalid to drop and "
                "count such pairs"
            ) from None
        text = raw.decode("utf-8", "replace")
    return text.lstrip("\ufeff") if line == 1 else text  # a byte-order mark is not text


def read_lines(uri: str) -> list[str]:
    """Every line of a UTF-8 text file or URI (compressed or not), without line ends."""
    return [decode(raw, uri, n, "error").rstrip("\r") for n, raw in enumerate(lines(uri), 1)]


def resolve(prefix: str, lang: str) -> str:
    """PREFIX.lang, plain or compressed (.gz/.xz/.zst/.bz2), whichever exists (path or URI)."""
    candidates = [f"{prefix}.{lang}{ext}" for ext in ("", *COMPRESSED)]
    found = next((c for c in candidates if exists(c)), None)
    if found is None:
        raise ValueError(
            f"missing file {prefix}.{lang} (also tried {', '.join(COMPRESSED)}): "
            "a prefix names PREFIX.<src lang> and PREFIX.<tgt lang>; or pass a "
            ".tsv/.jsonl/.parquet file"
        )
    return found


def read_parallel(prefix: str, src_lang: str, tgt_lang: str) -> Pairs:
    """Read PREFIX.src and PREFIX.tgt, checking that line i of one translates line i of the other."""
    src_uri, tgt_uri = resolve(prefix, src_lang), resolve(prefix, tgt_lang)
    src, tgt = read_lines(src_uri), read_lines(tgt_uri)
    misaligned = f"{src_uri} has {len(src)} lines but {tgt_uri} has {len(tgt)}"
    check_aligned(src, tgt, f"{misaligned}: line i of one must translate line i of the other", f"{src_uri} is empty")
    return src, tgt


def check_aligned(src: Sequence[str], tgt: Sequence[str], misaligned: str, empty: str) -> None:
    """The two sides of parallel text: as many sentences each (sentence i of one translates
    sentence i of the other) and some; else the one-line error `misaligned` or `empty`."""
    check(len(src) == len(tgt), misaligned)
    check(len(src) > 0, empty)


# ---------------------------------------------------------------- file kinds


def strip_compression(name: str) -> str:
    """`name` without its compression suffix (.gz, .xz, .zst, .zstd, .bz2; any case), if it has one."""
    lower = name.lower()
    for suffix in COMPRESSED:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name


def file_kind(path: str) -> str:
    """The reader of a file by its extension (compression aside): tsv, jsonl, parquet (Parquet or Arrow) or text."""
    lower = strip_compression(path).lower()
    if lower.endswith(TSV_SUFFIXES):
        return "tsv"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(COLUMNAR_SUFFIXES):
        return "parquet"
    return "text"


def is_arrow(uri: str) -> bool:
    """Whether a Parquet-or-Arrow file is Arrow IPC (.arrow/.feather/.ipc); any other name is Parquet."""
    return uri.lower().endswith(ARROW_SUFFIXES)


# ---------------------------------------------------------------- Parquet and Arrow files


def open_arrow(f: Any) -> Union[pa.ipc.RecordBatchFileReader, pa.ipc.RecordBatchStreamReader]:
    """A reader of an open Arrow IPC file: the file format, or the stream format (no footer)."""
    try:
        return pa.ipc.open_file(f)
    except pa.ArrowInvalid:  # the streaming IPC format has no footer
        f.seek(0)
        return pa.ipc.open_stream(f)


def record_batches(uri: str, columns: Sequence[str], batch_size: int) -> Iterator[pa.RecordBatch]:
    """Record batches of the named columns of a Parquet or Arrow IPC file, one at a time."""
    fs, path = filesystem(uri)
    with fs.open_input_file(path) as f:
        if not is_arrow(uri):
            yield from pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=list(columns))
            return
        reader = open_arrow(f)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches: Any = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = reader
        for batch in batches:
            yield batch.select(list(columns))


def table_rows(uri: str) -> int:
    """Rows of a Parquet file (from its metadata) or an Arrow IPC file."""
    fs, path = filesystem(uri)
    with fs.open_input_file(path) as f:
        if not is_arrow(uri):
            return pq.ParquetFile(f).metadata.num_rows
        return open_arrow(f).read_all().num_rows


def table_schema(uri: str) -> pa.Schema:
    """The schema of a Parquet or Arrow IPC file, read without its data."""
    fs, path = filesystem(uri)
    try:
        with fs.open_input_file(path) as f:
            return open_arrow(f).schema if is_arrow(uri) else pq.read_schema(f)
    except (OSError, pa.ArrowException) as err:
        kind = "an Arrow IPC" if is_arrow(uri) else "a Parquet"
        raise InputError(f"{uri} is not {kind} file ({first_line(err)})") from None


def is_text_type(tp: pa.DataType) -> bool:
    """Whether a column of this type holds text: string, large_string or string_view (str in Python)."""
    return pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_string_view(tp)


def check_text_column(uri: str, schema: pa.Schema, column: str, flag: str) -> None:
    """A Parquet/Arrow file must have `column`, holding text (`is_text_type`); else a one-line error naming `flag`."""
    if column not in schema.names:
        raise InputError(f"{uri} has no column {column!r} (columns: {', '.join(schema.names)}): pass {flag} to name it")
    tp = schema.field(column).type
    if not is_text_type(tp):
        raise InputError(f"{uri}: column {column!r} has type {tp}, not string: pass {flag} to name a text column")
