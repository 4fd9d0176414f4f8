"""Cleaning in a prepare's passes: text and token rules, duplicates, the SentencePiece sample, the drop counts."""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import Counter
from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.compute as pc

from raymt.data.sources import pair_chunks
from raymt.tokenizer import Tokenizer

# Cleaning rules in the order they apply; each pair is counted by the first rule that drops it.
DROP_RULES = ("invalid_utf8", "empty", "too_long_chars", "too_long", "ratio", "duplicate")

# Counts that both passes make (the second re-reads the inputs: they must not have changed).
# Pass 2's "empty" adds pairs that tokenize to nothing, which it also counts as "empty_tokens".
READ_COUNTS = ("input", "invalid_utf8", "empty", "too_long_chars")


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


class Tally:
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
    if isinstance(tally, Tally):  # the passes run in the driver
        tally.put(key, counts)
        return
    import ray

    ray.get(tally.put.remote(key, dict(counts)))


def _on_invalid(options: dict) -> str:
    """What readers do with invalid UTF-8 in training data."""
    return "skip" if options["skip_invalid"] else "error"


def sample_inputs(batch: pa.Table, specs: list[dict], options: dict, k: int) -> pa.Table:
    """Pass 1, one row per input: its counts and its k cleaned pairs with the smallest hashes."""
    key = _hash_key(options["seed"])
    rows: dict[str, list] = {"counts": [], "h": [], "src": [], "tgt": []}
    for idx in batch.column("idx").to_pylist():
        counts: Counter = Counter()
        heap: list = []
        members: set[int] = set()
        for src, tgt, _ in pair_chunks(specs[idx], _on_invalid(options), counts):
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


def merge_samples(batches: Iterator[pa.Table], k: int) -> tuple[list[str], Counter]:
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


def read_inputs(batch: pa.Table, specs: list[dict], options: dict, tally: Any) -> Iterator[pa.Table]:
    """Pass 2 reader (a generator): stripped pairs of each input with their provenance."""
    for idx in batch.column("idx").to_pylist():
        counts: Counter = Counter()
        for src, tgt, line_numbers in pair_chunks(specs[idx], _on_invalid(options), counts):
            yield pa.table(
                {
                    "src": pa.array(src, pa.string()),
                    "tgt": pa.array(tgt, pa.string()),
                    "source": pa.array([idx] * len(src), pa.int32()),
                    "line": pa.array(line_numbers, pa.int64()),
                }
            )
        _report(tally, ("read", idx), counts)


def tokenize_block(table: pa.Table, model_proto: bytes, options: dict, tally: Any) -> pa.Table:
    """Pass 2: clean, tokenize, drop by length and ratio; hashes ride along for de-duplication."""
    tokenizer = Tokenizer(model_proto)  # tens of ms per block of BLOCK_ROWS pairs
    counts: Counter = Counter()
    src, tgt = table.column("src").to_pylist(), table.column("tgt").to_pylist()
    keep = _clean(src, tgt, options["max_chars"], counts)
    src_ids = tokenizer.encode_batch([src[i] for i in keep])
    prefix = options.get("prefix_ids") or []  # the corpus's tags (prepare_corpora), counted by the length rules
    if prefix:
        src_ids = [prefix + ids for ids in src_ids]
    tgt_ids = tokenizer.encode_batch([tgt[i] for i in keep], side="tgt")
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


class Dedup:
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


def read_counts(counts: dict) -> dict:
    """Pass 2's counts of what pass 1 counts too (READ_COUNTS), to check that the inputs did not change."""
    read = {c: counts.get(c, 0) for c in READ_COUNTS}
    # Pass 2's `empty` also holds the pairs that only tokenizing emptied (e.g. "\u200b"): not text-level.
    read["empty"] -= counts.get("empty_tokens", 0)
    return read


def drop_summary(counts: dict) -> str:
    """'empty 3, too_long 2' for the rules that dropped something."""
    return ", ".join(f"{rule} {counts[rule]}" for rule in DROP_RULES if counts.get(rule)) or "none"


def all_dropped(total: int, counts: dict, where: str = "") -> ValueError:
    """The error for a training set that the cleaning rules emptied (`where`: which corpus)."""
    return ValueError(
        f"{where}all {total} training pairs were dropped ({drop_summary(counts)}): check the "
        "inputs, or relax --max-len/--max-chars/--max-ratio/--ratio-min-len"
    )
