"""Cleaning in a prepare's passes: text and token rules, duplicates, the SentencePiece sample, the drop counts."""

from __future__ import annotations

import difflib
import functools
import hashlib
import heapq
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raymt import langid
from raymt.config import CONTENT_RULES, CorpusOptions, PrepareConfig
from raymt.data.format import COLUMNS
from raymt.data.scores import ScoreReader
from raymt.data.sources import pair_chunks
from raymt.tokenizer import Tokenizer

# Cleaning rules in the order they apply; each pair is counted by the first rule that drops it.
# CONTENT_RULES and `score` (raymt.data.scores) run in pass 2 only, before tokenizing (pass 1's
# sample for SentencePiece keeps such pairs: it needs no language ID, and a few copies do not
# change a vocabulary).
DROP_RULES = (
    ("invalid_utf8", "empty", "too_long_chars")
    + CONTENT_RULES
    + ("score", "too_long", "ratio", "duplicate", "near_duplicate")
)

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


_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"\d+")
_DIGIT = re.compile(r"\d")
_URL = re.compile(r"(?:https?://|www\.)[^\s<>\"]+|[\w.+-]+@[\w-]+(?:\.[\w-]+)+", re.IGNORECASE)
# Spaces, control and format characters (zero-width, byte-order mark): not counted by alpha_ratio.
_INVISIBLE = re.compile(r"[\s\x00-\x1f\x7f-\x9f\xad\u200b-\u200f\u2028-\u202f\u2060-\u206f\ufeff]")


@dataclass(frozen=True)
class ContentRules:
    """The content rules a corpus applies (CorpusOptions' fields of the same names, docs/data.md)."""

    # Off unless named; the thresholds' defaults are CorpusOptions' (their one home).
    copy: bool = False
    copy_similarity: float = CorpusOptions.copy_similarity
    number_mismatch: bool = False
    url_mismatch: bool = False
    alpha_ratio: bool = False
    alpha_ratio_min: float = CorpusOptions.alpha_ratio_min
    repeats: bool = False
    repeats_max: int = CorpusOptions.repeats_max
    wrong_language: bool = False
    wrong_language_confidence: float = CorpusOptions.wrong_language_confidence
    wrong_language_min_chars: int = CorpusOptions.wrong_language_min_chars
    src_lang: str = ""
    tgt_lang: str = ""

    @classmethod
    def of(cls, cfg: PrepareConfig) -> "ContentRules":
        """The rules of one corpus's prepare config (`raymt.data.sources.clean_config`)."""
        return cls(**{name: getattr(cfg, name) for name in cls.__dataclass_fields__})

    @property
    def any(self) -> bool:
        """Whether any rule is on."""
        return any(getattr(self, rule) for rule in CONTENT_RULES)

    def repeated(self) -> re.Pattern:
        """A word n-gram (n <= 3) repeated more than repeats_max times in a row."""
        return _repeat_pattern(self.repeats_max)


@functools.lru_cache(maxsize=8)
def _repeat_pattern(most: int) -> re.Pattern:
    """The compiled `repeats` pattern for at most `most` copies in a row."""
    return re.compile(r"\b(\w+(?:\W+\w+){0,2})(?:\W+\1\b){%d,}" % most)


def _is_copy(src: str, tgt: str, threshold: float) -> bool:
    """Whether the target is (nearly) the source: equal but for case, or alike >= threshold both as
    sets of lower-cased words (Jaccard; cheap, so it goes first) and as characters in order
    (difflib's ratio: a target of the source's words reordered is not a copy)."""
    src, tgt = src.casefold(), tgt.casefold()
    if src == tgt:
        return True
    a, b = set(_WORD.findall(src)), set(_WORD.findall(tgt))
    if not a or not b or len(a & b) < threshold * len(a | b):
        return False
    return difflib.SequenceMatcher(None, src, tgt, autojunk=False).ratio() >= threshold


def _numbers(text: str) -> set[int]:
    """The numbers of a text: its digit runs by value but 0, so 4.50, 4,50 and 4.5 or 07 and 7 agree."""
    return {int(n) for n in _NUMBER.findall(text)} - {0}


def _numbers_differ(src: str, tgt: str) -> bool:
    """Whether both sides have numbers, and not the same (one side's digits against the other's
    number words is how translations often differ: not judged)."""
    if not (_DIGIT.search(src) and _DIGIT.search(tgt)):
        return False
    return _numbers(src) != _numbers(tgt)


def _urls(text: str) -> set[str]:
    """The URLs and e-mail addresses of a text, without trailing punctuation."""
    if "//" not in text and "@" not in text and "www." not in text.lower():  # most texts: no regex
        return set()
    return {u.rstrip(".,;:!?)") for u in _URL.findall(text)}


def _few_letters(text: str, least: float) -> bool:
    """Whether letters are under `least` of the visible characters (a side without any is `empty`'s)."""
    letters = sum(map(str.isalpha, text))
    if letters >= least * len(text):  # most texts: no need to count the visible characters
        return False
    chars = len(_INVISIBLE.sub("", text))
    return bool(chars) and letters < least * chars


def _repeats(text: str, pattern: re.Pattern, most: int) -> bool:
    """Whether a word n-gram comes more than `most` times in a row (`pattern`); the regular
    expression only runs on texts with at least `most` repeated words."""
    words = _WORD.findall(text)
    return len(words) - len(set(words)) >= most and pattern.search(text) is not None


def _text_rule(src: str, tgt: str, rules: ContentRules, repeated: Optional[re.Pattern]) -> Optional[str]:
    """The first content rule but wrong_language that drops this pair, or None."""
    if rules.copy and _is_copy(src, tgt, rules.copy_similarity):
        return "copy"
    if rules.number_mismatch and _numbers_differ(src, tgt):
        return "number_mismatch"
    if rules.url_mismatch and _urls(src) != _urls(tgt):
        return "url_mismatch"
    if rules.alpha_ratio and (_few_letters(src, rules.alpha_ratio_min) or _few_letters(tgt, rules.alpha_ratio_min)):
        return "alpha_ratio"
    if repeated is not None and (
        _repeats(src, repeated, rules.repeats_max) or _repeats(tgt, repeated, rules.repeats_max)
    ):
        return "repeats"
    return None


def _content_rules(src: list[str], tgt: list[str], keep: list[int], rules: ContentRules, counts: Counter) -> list[int]:
    """The indices of `keep` that pass the content rules, counting the others by rule; language ID
    runs last, on the sides of at least wrong_language_min_chars characters, in one batch."""
    repeated = rules.repeated() if rules.repeats else None
    passed = []
    for i in keep:
        rule = _text_rule(src[i], tgt[i], rules, repeated)
        if rule:
            counts[rule] += 1
        else:
            passed.append(i)
    if not rules.wrong_language:
        return passed
    texts = [side for i in passed for side in (src[i], tgt[i])]
    flags = wrong_language(texts, [rules.src_lang, rules.tgt_lang] * len(passed), rules)
    wrong = {i for n, i in enumerate(passed) if flags[2 * n] or flags[2 * n + 1]}
    counts["wrong_language"] += len(wrong)
    return [i for i in passed if i not in wrong]


def side_rule(text: str, rules: ContentRules, repeated: Optional[re.Pattern]) -> Optional[str]:
    """The first content rule of one text alone (alpha_ratio, repeats) that drops it, or None:
    a monolingual line's (`raymt data mono`); `repeated` is `rules.repeated()` when repeats is on."""
    if rules.alpha_ratio and _few_letters(text, rules.alpha_ratio_min):
        return "alpha_ratio"
    if repeated is not None and _repeats(text, repeated, rules.repeats_max):
        return "repeats"
    return None


def wrong_language(texts: Sequence[str], langs: Sequence[str], rules: ContentRules) -> list[bool]:
    """The wrong_language rule of each text in its language (a corpus code): language ID is at least
    wrong_language_confidence sure that it is not in it; texts under wrong_language_min_chars
    characters are never judged. One batch (`raymt.langid.likely`)."""
    judged = [i for i, text in enumerate(texts) if len(text) >= rules.wrong_language_min_chars]
    # Judged by the corpus language's own probability, not by the top label's: short or mixed text
    # spreads its probability over several languages, none above one half (docs/data.md).
    floor = 1.0 - rules.wrong_language_confidence
    labels = [langid.model_label(langs[i]) for i in judged]
    wrong = [False] * len(texts)
    for i, ok in zip(judged, langid.likely([texts[i] for i in judged], labels, floor)):
        wrong[i] = not ok
    return wrong


def near_text(text: str) -> str:
    """A text as near-duplicates share it: lower case, words only (punctuation gone), digits as 0."""
    return " ".join(_WORD.findall(_NUMBER.sub("0", text.casefold())))


def near_key(src: str, tgt: str) -> tuple[str, str]:
    """A pair as near-duplicates share it: each side's `near_text`."""
    return near_text(src), near_text(tgt)


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
        """Set the counts of one part (a read input, a tokenized block, a bucket's de-duplication)."""
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


def _on_invalid(cfg: CorpusOptions) -> str:
    """What readers do with invalid UTF-8 in training data."""
    return "skip" if cfg.skip_invalid else "error"


def sample_inputs(batch: pa.Table, specs: list[dict], cfg: PrepareConfig, k: int) -> pa.Table:
    """Pass 1, one row per input: its counts and its k cleaned pairs with the smallest hashes."""
    key = _hash_key(cfg.seed)
    rows: dict[str, list] = {"counts": [], "h": [], "src": [], "tgt": []}
    for idx in batch.column("idx").to_pylist():
        counts: Counter = Counter()
        heap: list = []
        members: set[int] = set()
        for src, tgt, _ in pair_chunks(specs[idx], _on_invalid(cfg), counts):
            for i in _clean(src, tgt, cfg.max_chars, counts):
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


def read_inputs(batch: pa.Table, specs: list[dict], cfg: PrepareConfig, tally: Any) -> Iterator[pa.Table]:
    """Pass 2 reader (a generator): stripped pairs of each input with their provenance; with scores
    (the spec's "scores", `raymt.data.scores.score_entries`), each one's and whether it is under the threshold."""
    for idx in batch.column("idx").to_pylist():
        counts: Counter = Counter()
        entry = specs[idx].get("scores")
        reader = ScoreReader(entry, f"{specs[idx]['paths'][0]}") if entry else None
        for src, tgt, line_numbers in pair_chunks(specs[idx], _on_invalid(cfg), counts):
            columns = {
                "src": pa.array(src, pa.string()),
                "tgt": pa.array(tgt, pa.string()),
                "source": pa.array([idx] * len(src), pa.int32()),
                "line": pa.array(line_numbers, pa.int64()),
            }
            if reader is not None:  # NaN (an unscored line) is under any threshold
                score = reader.scores(line_numbers)
                columns["below"] = pa.array([not x >= entry["threshold"] for x in score], pa.bool_())
                columns["score"] = pa.array(score, pa.float64())  # near_dedup's rank (best_of_groups)
            yield pa.table(columns)
        _report(tally, ("read", idx), counts)


def tokenize_block(
    table: pa.Table,
    model_proto: bytes,
    cfg: PrepareConfig,
    tally: Any,
    prefix_ids: Sequence[int] = (),
    buckets: int = 1,
) -> pa.Table:
    """Pass 2: clean, tokenize (`prefix_ids`, the corpus's tags, before every source), drop by
    length and ratio; for de-duplication, each pair's DEDUP_COLUMNS ride along (of `buckets`)."""
    tokenizer = Tokenizer(model_proto)  # tens of ms per block of BLOCK_ROWS pairs
    counts: Counter = Counter()
    src, tgt = table.column("src").to_pylist(), table.column("tgt").to_pylist()
    keep = _clean(src, tgt, cfg.max_chars, counts)
    rules = ContentRules.of(cfg)
    if rules.any:
        keep = _content_rules(src, tgt, keep, rules, counts)
    if "below" in table.column_names:  # the score rule: under the corpus's threshold
        below = table.column("below").to_pylist()
        counts["score"] += sum(below[i] for i in keep)
        keep = [i for i in keep if not below[i]]
    src_ids = tokenizer.encode_batch([src[i] for i in keep])
    prefix = list(prefix_ids)  # counted by the length rules
    if prefix:
        src_ids = [prefix + ids for ids in src_ids]
    tgt_ids = tokenizer.encode_batch([tgt[i] for i in keep], side="tgt")
    out_src, out_tgt, hashes, near, rows = [], [], [], [], []
    key = _hash_key(cfg.seed)
    for i, s, t in zip(keep, src_ids, tgt_ids):
        rule = _token_rule(len(s), len(t), cfg)
        if rule:
            counts[rule] += 1
            if rule == "empty":  # also counted apart: pass 1 sees text only, not these
                counts["empty_tokens"] += 1
            continue
        out_src.append(s)
        out_tgt.append(t)
        rows.append(i)
        if cfg.dedup or cfg.near_dedup:
            hashes.append(_pair_hash(src[i], tgt[i], key))
        if cfg.near_dedup:
            near.append(_pair_hash(*near_key(src[i], tgt[i]), key))
    counts["src_tokens"] += sum(map(len, out_src))
    counts["tgt_tokens"] += sum(map(len, out_tgt))
    if len(table):
        first = (table.column("source")[0].as_py(), table.column("line")[0].as_py())
        _report(tally, ("tokenize", *first, len(table)), counts)
    out = {"src_ids": pa.array(out_src, pa.list_(pa.int32())), "tgt_ids": pa.array(out_tgt, pa.list_(pa.int32()))}
    if cfg.dedup or cfg.near_dedup:
        out.update(_dedup_columns(table, rows, hashes, near if cfg.near_dedup else None, buckets))
    return pa.table(out)


def _dedup_columns(
    table: pa.Table, rows: list[int], hashes: list[int], near: Optional[list[int]], buckets: int
) -> dict[str, pa.Array]:
    """The DEDUP_COLUMNS of the pairs at `rows` of a read block (their hashes, near: under near_dedup)."""
    take = np.asarray(rows, np.int64)
    source = table.column("source").to_numpy()[take].astype(np.int64)
    line = table.column("line").to_numpy()[take]
    cols = {"h": pa.array(np.asarray(hashes, np.uint64), pa.uint64())}
    if near is not None:
        cols["nh"] = pa.array(np.asarray(near, np.uint64), pa.uint64())
    cols["order"] = pa.array((source << LINE_BITS) | line, pa.int64())
    if near is not None and "score" in table.column_names:  # ranked near-duplicates
        cols["score"] = table.column("score").take(pa.array(take))
    key = cols.get("nh", cols["h"]).to_numpy()
    cols["bucket"] = pa.array((key % np.uint64(buckets)).astype(np.int64), pa.int64())
    return cols


def _token_rule(src_len: int, tgt_len: int, cfg: CorpusOptions) -> Optional[str]:
    """The token-level rule that drops a pair of these lengths, or None to keep it."""
    if src_len == 0 or tgt_len == 0:  # e.g. only control characters: no token survives
        return "empty"
    if src_len > cfg.max_len or tgt_len > cfg.max_len:
        return "too_long"
    longer, shorter = max(src_len, tgt_len), max(1, min(src_len, tgt_len))
    if longer >= cfg.ratio_min_len and longer > cfg.max_ratio * shorter:
        return "ratio"
    return None


# De-duplication, partitioned by hash (`deduplicate`): tokenize_block gives each pair these
# columns: its hash `h`, under near_dedup its near-duplicate key's `nh` (exact copies share it
# too), its place in input order (`order`: the input's index, then its line), with ranked
# near-duplicates its `score`, and the `bucket` its key (nh, else h) falls in. Every pair of a
# bucket meets in one call, so the pair that today's order or score keeps is found there.
DEDUP_COLUMNS = ("h", "nh", "order", "score", "bucket")
LINE_BITS = 40  # order = input << 40 | line: lines up to 2**40 in each of 2**23 inputs

# Input pairs per partition: a partition's pairs (token ids and hashes) are in one task's memory
# at once, so partitions grow in number with the corpus, not in size.
PARTITION_PAIRS = 200_000
# Buckets per partition: Ray Data's hash shuffle sends each bucket to a partition; many buckets
# per partition even out the partitions' sizes.
BUCKETS_PER_PARTITION = 8


def dedup_partitions(num_pairs: int) -> tuple[int, int]:
    """(partitions, buckets) to de-duplicate `num_pairs` input pairs: one of each up to
    PARTITION_PAIRS (the kept pairs then stay in input order), more beyond."""
    partitions = max(1, -(-num_pairs // PARTITION_PAIRS))
    return partitions, 1 if partitions == 1 else partitions * BUCKETS_PER_PARTITION


def deduplicate(table: pa.Table, tally: Any) -> pa.Table:
    """The pairs of one bucket (tokenize_block's rows, in any order) that de-duplication keeps, in
    input order: of each key (nh under near_dedup, else h) the first pair in input order, or with
    scores the highest-scored (ties: the first; unscored last). A dropped exact copy of the kept
    pair that comes after it counts as `duplicate`, any other as `near_duplicate`."""
    h = table.column("h").to_numpy()
    key = table.column("nh").to_numpy() if "nh" in table.column_names else h
    order = table.column("order").to_numpy()
    if "score" in table.column_names:  # NaN (unscored) ranks below any score
        score = pc.fill_null(table.column("score"), math.nan).to_numpy()
        ranked = np.lexsort((order, np.where(np.isnan(score), np.inf, -score), key))
    else:
        ranked = np.lexsort((order, key))
    first = np.ones(len(ranked), bool)
    first[1:] = key[ranked][1:] != key[ranked][:-1]
    kept = ranked[first]
    group = np.cumsum(first) - 1  # of each ranked pair: its key's index in `kept`
    dropped, group = ranked[~first], group[~first]
    exact = (h[dropped] == h[kept][group]) & (order[dropped] > order[kept][group])
    counts = {"duplicate": int(exact.sum()), "near_duplicate": int(len(dropped) - exact.sum())}
    for col, name in (("src_ids", "src_tokens"), ("tgt_ids", "tgt_tokens")):
        lengths = pc.list_value_length(table.column(col)).to_numpy()
        counts[name] = -int(lengths[dropped].sum())  # taken back from the tokenizer's
    if len(table):
        _report(tally, ("duplicate", table.column("bucket")[0].as_py()), counts)
    return table.take(pa.array(kept[np.argsort(order[kept])])).select(COLUMNS)


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
