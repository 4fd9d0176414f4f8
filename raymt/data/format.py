"""The prepared-corpus format, shared by its writer (raymt.data.prepare) and its readers
(raymt.data.stream, training, evaluation).

Layout of a prepared corpus, `raymt-corpus/2` (paths in the manifest are relative to it;
docs/design-inputs.md, section 3); one pair is a corpus of one, with no tags:

    manifest.json                      options, inputs, fingerprint, "corpora" (each with its
                                       languages, origin, weight, source tags, counts per
                                       cleaning rule and shards), "tags" (and their
                                       "source_codes" for an imported NLLB), "splits"
    spm.model                          the joint model; tag pieces (<2de>, <BT>) reserved
    train/<name>/part-00000.parquet    per corpus (name en-de, or en-de.bt): src_ids, tgt_ids,
                                       list<int32> SentencePiece ids (no BOS/EOS), src_ids
                                       starting with the corpus's source tags (and source
                                       language code: `raymt.tags.source_prefix`)
    valid/<pair>.parquet               one per pair: src, tgt stripped text, every row scored
    test/<pair>/<name>.parquet         the pair's test sets

raymt wrote one pair as `raymt-corpus/1` until 2026-12 (train/part-*.parquet, valid.parquet,
test/<name>.parquet, the pair's languages and train entry at the top of the manifest);
`open_corpus` reads either format: a `PreparedCorpus` is the one reader of a manifest (a /1
corpus is one real corpus).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raymt import storage
from raymt.data.text import Pairs
from raymt.storage import filesystem, read_bytes
from raymt.tags import lang_tag
from raymt.tokenizer import EOS_ID, Tokenizer

# One corpus or several, with their languages and tags (raymt.data.prepare.prepare_corpora).
FORMAT = "raymt-corpus/2"
# One pair, as raymt wrote it until 2026-12 (train/, valid.parquet, test/NAME.parquet): read only.
ONE_PAIR_FORMAT = "raymt-corpus/1"
FORMATS = (FORMAT, ONE_PAIR_FORMAT)
VALID_DIR = "valid"
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


class TrainingCorpus(NamedTuple):
    """One training corpus of a prepared corpus: its languages, origin, tags and shards."""

    name: str  # "en-de", or "en-de.bt" for back-translated pairs
    src_lang: str
    tgt_lang: str
    origin: str  # "real" or "bt"
    weight: float
    source_tags: tuple  # pieces put before every training source, e.g. ("<2de>", "<BT>")
    shards: list  # of Shard
    num_pairs: int

    @property
    def pair(self) -> str:
        """ "en-de": the direction the corpus trains."""
        return f"{self.src_lang}-{self.tgt_lang}"


def token_index(num_tokens: np.ndarray, block_rows: int = TOKEN_INDEX_ROWS) -> list[int]:
    """Cumulative token counts after every `block_rows` rows and after the last row."""
    cumulative = np.cumsum(num_tokens, dtype=np.int64)
    if not len(cumulative):
        return []
    ends = list(range(block_rows, len(cumulative), block_rows)) + [len(cumulative)]
    return [int(cumulative[e - 1]) for e in ends]


def _read_manifest(location: str) -> dict:
    """The manifest of a prepared corpus; a one-line ValueError if it is not one."""
    uri = storage.join(location, MANIFEST_FILE)
    try:
        manifest = json.loads(read_bytes(uri))
    except (OSError, pa.ArrowException):
        raise ValueError(
            f"{location} is not a prepared corpus (no {MANIFEST_FILE}): make one with "
            f"python -m raymt.data prepare --out {location} ..."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{uri} is not valid JSON ({err}): prepare the corpus again") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(
            f"{uri} has format {found!r}, not {FORMAT!r}: prepare the corpus again with this version of raymt"
        )
    return manifest


def open_corpus(location: str) -> PreparedCorpus:
    """The prepared corpus at `location` (either format), its manifest read once; a one-line
    ValueError if it is not one."""
    return PreparedCorpus(location, _read_manifest(location))


@dataclass(frozen=True)
class PreparedCorpus:
    """A prepared corpus, opened (`open_corpus`): its pairs, tokenizer, training corpora,
    validation and test sets and options. The one reader of its manifest: a `raymt-corpus/1`
    corpus is one real, untagged pair."""

    location: str  # path or URI of its directory
    manifest: dict

    @property
    def is_v1(self) -> bool:
        """Whether the corpus is the older one-pair `raymt-corpus/1`."""
        return self.manifest["format"] == ONE_PAIR_FORMAT

    @property
    def options(self) -> dict:
        """The prepare options it was made with (temperature, vocabulary, ...)."""
        return self.manifest.get("options", {})

    @property
    def reserved(self) -> dict[str, int]:
        """Its reserved tag pieces ("<2de>", "<BT>") and their ids; none for one untagged pair."""
        return self.manifest.get("tags", {}).get("reserved", {})

    @property
    def source_codes(self) -> dict[str, int]:
        """The id of each source language's code, first in its sources after the target tag, when
        prepared for a model that reads one (an imported NLLB's); else none."""
        return self.manifest.get("tags", {}).get("source_codes", {})

    @property
    def pairs(self) -> list[str]:
        """Its language pairs ("en-de"), in the order of its training corpora."""
        if self.is_v1:
            return [f"{self.manifest['src_lang']}-{self.manifest['tgt_lang']}"]
        return list(dict.fromkeys(f"{c['src_lang']}-{c['tgt_lang']}" for c in self.manifest["corpora"]))

    @property
    def training_corpora(self) -> list[TrainingCorpus]:
        """Its training corpora, in manifest order (a `raymt-corpus/1` one's: its one pair's)."""
        manifest = self.manifest
        if self.is_v1:
            train = manifest["splits"]["train"]
            src, tgt = manifest["src_lang"], manifest["tgt_lang"]
            return [TrainingCorpus(f"{src}-{tgt}", src, tgt, "real", 1.0, (), self._shards(train), train["num_pairs"])]
        return [
            TrainingCorpus(
                c["name"],
                c["src_lang"],
                c["tgt_lang"],
                c["origin"],
                c["weight"],
                tuple(c["source_tags"]),
                self._shards(c["train"]),
                c["train"]["num_pairs"],
            )
            for c in manifest["corpora"]
        ]

    def shards(self) -> list[Shard]:
        """The training shards of a corpus prepared from one corpus, in order (`training_corpora`
        lists each corpus's of several)."""
        found = self.training_corpora
        if len(found) != 1:
            raise ValueError(
                f"{self.location} holds {len(found)} corpora; this reads a corpus prepared from one pair: pass one"
            )
        return list(found[0].shards)

    def _shards(self, train: dict) -> list[Shard]:
        """The `Shard`s of a manifest's train entry, in order."""
        return [
            Shard(storage.join(self.location, f["path"]), f["num_pairs"], tuple(f.get("token_index", ())))
            for f in train["files"]
        ]

    def tokenizer(self) -> Tokenizer:
        """Its SentencePiece model, checked against the manifest's sha256."""
        uri = storage.join(self.location, SPM_FILE)
        try:
            proto = read_bytes(uri)
        except (OSError, pa.ArrowException):
            raise ValueError(f"{uri} is missing: prepare the corpus again") from None
        if hashlib.sha256(proto).hexdigest() != self.manifest["sp_model_sha256"]:
            raise ValueError(f"{uri} does not match the sha256 in {MANIFEST_FILE}: prepare the corpus again")
        return Tokenizer(proto)

    def prefix_ids(self, pair: str) -> list[int]:
        """The ids put before a validation/test source of `pair`: its target tag when the corpus
        reserves one (never <BT>), then its source language's code when it has those (as its
        training sources); none for a one-pair corpus."""
        src, tgt = pair.split("-", 1)
        tag, codes = lang_tag(tgt), self.source_codes
        return ([self.reserved[tag]] if tag in self.reserved else []) + ([codes[src]] if src in codes else [])

    def test_names(self, pair: str) -> list[str]:
        """The test sets of `pair`, in the order they were given (a `raymt-corpus/1` corpus's in
        name order): a run scores the first."""
        tests = self.manifest["splits"].get("test", {})
        return sorted(tests) if self.is_v1 else list(tests.get(pair, {}))

    def eval_set(self, split: str, pair: Optional[str] = None) -> Pairs:
        """The (sources, references) of "valid" or of a test set, every row; of `pair` (None: the
        corpus's only pair)."""
        splits = self.manifest["splits"]
        if not self.is_v1:
            if pair is None and len(splits["valid"]) == 1:  # the corpus's one pair
                (pair,) = splits["valid"]
            if pair not in splits["valid"]:
                raise ValueError(f"corpus {self.location} has no pair {pair!r}; it has: {', '.join(splits['valid'])}")
            splits = {"valid": splits["valid"][pair], "test": splits.get("test", {}).get(pair, {})}
        entry = splits["valid"] if split == "valid" else splits.get("test", {}).get(split)
        if entry is None:
            known = ", ".join(["valid", *splits.get("test", {})])
            raise ValueError(f"corpus {self.location} has no set {split!r}; it has: {known}")
        fs, path = filesystem(storage.join(self.location, entry["path"]))
        with fs.open_input_file(path) as f:
            table = pq.read_table(f, columns=["src", "tgt"])
        return table.column("src").to_pylist(), table.column("tgt").to_pylist()

    def files(self) -> list[str]:
        """Every file its manifest names, relative to it: shards, validation and test sets, the
        SentencePiece model."""
        splits = self.manifest.get("splits", {})
        if not self.is_v1:
            trains = [c["train"] for c in self.manifest.get("corpora", [])]
            valids = list(splits.get("valid", {}).values())
            tests = [t for by_name in splits.get("test", {}).values() for t in by_name.values()]
        else:
            trains = [splits.get("train", {})]
            valids = [splits.get("valid", {})]
            tests = list(splits.get("test", {}).values())
        paths = [f["path"] for train in trains for f in train.get("files", [])]
        paths += [v.get("path", VALID_FILE) for v in valids] + [SPM_FILE]
        return paths + [t["path"] for t in tests]


def eval_rows(pairs: Pairs, tokenizer: Tokenizer, max_positions: int, prefix_ids: Sequence[int] = ()) -> list[dict]:
    """In-memory validation/test rows with their index, sorted by length to limit padding;
    `prefix_ids` (a pair's target tag, `PreparedCorpus.prefix_ids`) go before every source.

    Nothing is dropped: over-long sources are truncated for decoding, and every
    reference still counts in BLEU.
    """
    limit = max_positions - 2
    src_ids = tokenizer.encode_batch(pairs[0])
    tgt_ids = tokenizer.encode_batch(pairs[1], side="tgt")
    prefix = list(prefix_ids)
    rows = [
        {"index": i, "src_ids": (prefix + s)[:limit] + [EOS_ID], "tgt_ids": t[:limit]}
        for i, (s, t) in enumerate(zip(src_ids, tgt_ids))
    ]
    rows.sort(key=lambda r: (len(r["src_ids"]), len(r["tgt_ids"])))
    return rows
