"""The one reader of text inputs: local paths or URIs (pyarrow filesystems), plain or
compressed (.gz, .xz, .zst, .bz2). Training (--train/--valid/--test), prepare and
evaluate all read text through here."""

from __future__ import annotations

import contextlib
import gzip
import lzma
import zlib
from typing import Any, Iterator, Optional

import pyarrow as pa

from raymt.errors import InputError, first_line
from raymt.storage import exists, filesystem

Pairs = tuple[list[str], list[str]]
COMPRESSED = (".gz", ".xz", ".zst", ".zstd", ".bz2")


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
    if len(src) != len(tgt):
        raise ValueError(
            f"{src_uri} has {len(src)} lines but {tgt_uri} has {len(tgt)}: "
            "line i of one must translate line i of the other"
        )
    if not src:
        raise ValueError(f"{src_uri} is empty")
    return src, tgt
