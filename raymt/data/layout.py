"""How a prepared corpus names its files and describes itself (`raymt-corpus/2`, one corpus or
several); `raymt.data.format` still reads the one-pair `raymt-corpus/1` that older raymt wrote."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

from raymt.config import SCORE_KEYS, PrepareConfig
from raymt.data.clean import drop_summary
from raymt.data.format import FORMAT, TEST_DIR, TRAIN_DIR, VALID_DIR
from raymt.data.sources import CorpusInput, check_corpus_inputs
from raymt.tags import target_langs
from raymt.tokenizer import Tokenizer


def fingerprint(
    fmt: str, options: dict, inputs: list[dict], tokenizer: Optional[Tokenizer], corpora: list[dict]
) -> str:
    """sha256 of everything a corpus depends on: format, options, inputs (paths, sizes, mtimes),
    tokenizer, and the corpora (languages, origin, weight)."""
    sp = hashlib.sha256(tokenizer.model_proto).hexdigest() if tokenizer is not None else None
    blob = {"format": fmt, "options": options, "inputs": inputs, "tokenizer": sp, "corpora": corpora}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


class Layout:
    """`raymt-corpus/2`: shards per corpus (train/NAME/), sets per pair (valid/PAIR.parquet,
    test/PAIR/NAME.parquet), the corpora and their tags (none for one real pair) in the manifest."""

    format = FORMAT

    def __init__(self, cfg: PrepareConfig, corpora: list[CorpusInput], source_codes: Optional[dict] = None) -> None:
        self.cfg, self.corpora = cfg, corpora
        # language -> id of the code a given model reads first in each source (an imported NLLB's), its corpora's
        codes = source_codes or {}
        self.source_codes = {lang: codes[lang] for lang in sorted({c.spec.src_lang for c in corpora})} if codes else {}

    def check_inputs(self) -> list[dict]:
        """Every input checked on the driver before Ray starts; their descriptions for the manifest."""
        return check_corpus_inputs(self.cfg, self.corpora)

    def options(self) -> dict:
        """The manifest's options (each corpus names its own languages; a given tokenizer is
        fingerprinted by its content, not by where it was read; the score options only when set, so
        a corpus that filters by no score keeps the fingerprint it had before they existed)."""
        return {
            k: v
            for k, v in dataclasses.asdict(self.cfg).items()
            if k not in ("src_lang", "tgt_lang", "tokenizer") and not (k in SCORE_KEYS and v is None)
        }

    def fingerprint(self, inputs: list[dict], tokenizer: Optional[Tokenizer]) -> str:
        """The corpus's fingerprint (`fingerprint`)."""
        keys = ("src_lang", "tgt_lang", "origin", "weight", "clean")
        specs = [{k: getattr(c.spec, k) for k in keys} for c in self.corpora]
        if self.source_codes:  # only then: every other corpus's fingerprint stays as it was
            for spec in specs:
                spec["source_code"] = self.source_codes[spec["src_lang"]]
        return fingerprint(self.format, self.options(), inputs, tokenizer, specs)

    def train_inputs(self, inputs: list[dict], c: CorpusInput) -> list[dict]:
        """The input descriptions of corpus `c`'s training data."""
        return [i for i in inputs if i.get("corpus") == c.spec.name]

    def label(self, c: CorpusInput) -> str:
        """What a progress line about corpus `c` starts with (one corpus needs no name)."""
        return f"{c.spec.name}: " if len(self.corpora) > 1 else ""

    def where(self, c: CorpusInput) -> str:
        """What an error about corpus `c` starts with (one corpus needs no name)."""
        return f"corpus {c.spec.name}: " if len(self.corpora) > 1 else ""

    def train_dir(self, c: CorpusInput) -> str:
        """Corpus `c`'s shards' directory, relative to the corpus."""
        return f"{TRAIN_DIR}/{c.spec.name}"

    def valid_path(self, pair: str) -> str:
        """The validation set's file of `pair`, relative to the corpus."""
        return f"{VALID_DIR}/{pair}.parquet"

    def test_path(self, pair: str, name: str) -> str:
        """Test set `name`'s file of `pair`, relative to the corpus."""
        return f"{TEST_DIR}/{pair}/{name}.parquet"

    def sample_note(self, shares: list[int], reserved: list[str]) -> str:
        """The end of the SentencePiece progress line: each corpus's share of the sample, the tags
        (nothing for one corpus without tags: the sample is its own)."""
        if len(self.corpora) == 1 and not reserved:
            return ""
        taken = ", ".join(f"{c.spec.name} {k}" for c, k in zip(self.corpora, shares))
        return f" ({taken}), reserving {' '.join(reserved)}"

    def manifest(self, tokenizer: Tokenizer, entries: list[dict], valid: dict, tests: dict, ids: dict) -> dict:
        """The manifest without its bookkeeping: `entries` per corpus, `valid`/`tests` per pair."""
        return {
            "format": self.format,
            **_model_fields(self.cfg, tokenizer),
            "corpora": entries,
            "tags": {
                "target_langs": target_langs([c.spec for c in self.corpora]),
                "reserved": ids,
                **({"source_codes": self.source_codes} if self.source_codes else {}),
            },
            "splits": {"valid": valid, "test": tests},
        }

    def print_summary(self, manifest: dict, out: str, seconds: float) -> None:
        """The table printed at the end: each corpus (with its drops), real and back-translated
        pairs counted apart, each pair's sets, the tags."""
        header = ("corpus", "input pairs", "kept pairs", "src tokens", "tgt tokens", "shards")
        rows = corpora_summary_rows(manifest)
        width = max(len(name) for name, _ in rows + [("corpus", [])])
        print(f"\n=== raymt corpus {out} ({len(manifest['corpora'])} corpora) ===")
        print(f"{header[0]:<{width}}" + "".join(f"  {h:>12}" for h in header[1:]))
        for name, values in rows:
            print(f"{name:<{width}}" + "".join(f"  {v:>12,}" for v in values))
        for c in manifest["corpora"]:
            print(f"dropped in {c['name']}: {drop_summary(c['train']['dropped'])}")
        for pair, entry in manifest["splits"]["valid"].items():
            tests = manifest["splits"]["test"].get(pair, {})
            shown = "".join(f", test/{name} {t['num_pairs']:,}" for name, t in tests.items())
            print(f"{pair}: valid {entry['num_pairs']:,}{shown}")
        tags = manifest["tags"]["reserved"]
        print(f"tags: {', '.join(f'{p} = id {i}' for p, i in tags.items()) or 'none'}")
        codes = manifest["tags"].get("source_codes", {})
        if codes:
            print(f"source language codes: {', '.join(f'{lang} = id {i}' for lang, i in codes.items())}")
        print(f"seconds: {seconds:.1f}")


def _model_fields(cfg: PrepareConfig, tokenizer: Tokenizer) -> dict:
    """The manifest's SentencePiece fields."""
    return {
        "vocab_size": tokenizer.num_pieces,
        "sp_model_type": cfg.sp_model_type,
        "sp_model_sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(),
    }


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
