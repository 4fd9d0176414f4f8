"""The prepared-corpus format, shared by its writer (raymt.data.prepare) and its readers
(raymt.data.stream, training, evaluation).

Layout of a prepared corpus (paths in the manifest are relative to it):

    manifest.json            options, inputs, fingerprint, counts per cleaning rule, shards
    spm.model                the joint SentencePiece model
    train/part-00000.parquet src_ids, tgt_ids: list<int32>, raw SentencePiece ids (no BOS/EOS)
    valid.parquet            src, tgt: stripped text; nothing dropped, every row is scored
    test/<name>.parquet      same as valid, one file per test set
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raymt import storage
from raymt.data.text import Pairs
from raymt.storage import filesystem, read_bytes
from raymt.tokenizer import EOS_ID, Tokenizer

FORMAT = "raymt-corpus/1"
MANIFEST_FILE = "manifest.json"
SPM_FILE = "spm.model"
VALID_FILE = "valid.parquet"
TRAIN_DIR = "train"
TEST_DIR = "test"
# The columns of a training shard.
COLUMNS = ["src_ids", "tgt_ids"]
# Rows per entry of a shard's token index (cumulative src + tgt tokens after every block).
TOKEN_INDEX_ROWS = 1024
# Ray Data gathers what a task yields into blocks of up to 128 MiB by default; a prepare
# task would then hold that much (and copies) at once. Small blocks keep a task's memory
# independent of the corpus size (benchmarks/bench_data.py).
MAX_BLOCK_BYTES = 16 << 20


class Shard(NamedTuple):
    """A training shard: path or URI, pairs in it, and its token index (may be empty)."""

    path: str
    num_pairs: int
    token_index: tuple = ()


Files = list  # of Shard, or of (path, num_pairs) tuples


def token_index(num_tokens: np.ndarray, block_rows: int = TOKEN_INDEX_ROWS) -> list[int]:
    """Cumulative token counts after every `block_rows` rows and after the last row."""
    cumulative = np.cumsum(num_tokens, dtype=np.int64)
    if not len(cumulative):
        return []
    ends = list(range(block_rows, len(cumulative), block_rows)) + [len(cumulative)]
    return [int(cumulative[e - 1]) for e in ends]


def read_manifest(corpus: str) -> dict:
    """The manifest of a prepared corpus; a one-line ValueError if it is not one."""
    uri = storage.join(corpus, MANIFEST_FILE)
    try:
        manifest = json.loads(read_bytes(uri))
    except (OSError, pa.ArrowException):
        raise ValueError(
            f"{corpus} is not a prepared corpus (no {MANIFEST_FILE}): make one with "
            f"python -m raymt.data prepare --out {corpus} ..."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{uri} is not valid JSON ({err}): prepare the corpus again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(
            f"{uri} has format {found!r}, not {FORMAT!r}: prepare the corpus again with this version of raymt"
        )
    return manifest


def train_files(corpus: str, manifest: dict) -> list[Shard]:
    """A `Shard` (path or URI, pairs, token index) per training shard, in order."""
    return [
        Shard(storage.join(corpus, f["path"]), f["num_pairs"], tuple(f.get("token_index", ())))
        for f in manifest["splits"]["train"]["files"]
    ]


def eval_pairs(corpus: str, manifest: dict, split: str) -> Pairs:
    """The (sources, references) of "valid" or of a test set, every row."""
    splits = manifest["splits"]
    entry = splits["valid"] if split == "valid" else splits.get("test", {}).get(split)
    if entry is None:
        known = ", ".join(["valid", *splits.get("test", {})])
        raise ValueError(f"corpus {corpus} has no set {split!r}; it has: {known}")
    fs, path = filesystem(storage.join(corpus, entry["path"]))
    with fs.open_input_file(path) as f:
        table = pq.read_table(f, columns=["src", "tgt"])
    return table.column("src").to_pylist(), table.column("tgt").to_pylist()


def load_tokenizer(corpus: str, manifest: dict) -> Tokenizer:
    """The corpus's SentencePiece model, checked against the manifest's sha256."""
    uri = storage.join(corpus, SPM_FILE)
    try:
        proto = read_bytes(uri)
    except (OSError, pa.ArrowException):
        raise ValueError(f"{uri} is missing: prepare the corpus again") from None
    if hashlib.sha256(proto).hexdigest() != manifest["sp_model_sha256"]:
        raise ValueError(f"{uri} does not match the sha256 in {MANIFEST_FILE}: prepare the corpus again")
    return Tokenizer(proto)


def eval_rows(pairs: Pairs, tokenizer: Tokenizer, max_positions: int) -> list[dict]:
    """In-memory validation/test rows with their index, sorted by length to limit padding.

    Nothing is dropped: over-long sources are truncated for decoding, and every
    reference still counts in BLEU.
    """
    limit = max_positions - 2
    src_ids = tokenizer.encode_batch(pairs[0])
    tgt_ids = tokenizer.encode_batch(pairs[1])
    rows = [
        {"index": i, "src_ids": s[:limit] + [EOS_ID], "tgt_ids": t[:limit]}
        for i, (s, t) in enumerate(zip(src_ids, tgt_ids))
    ]
    rows.sort(key=lambda r: (len(r["src_ids"]), len(r["tgt_ids"])))
    return rows
