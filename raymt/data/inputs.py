"""Training inputs that carry their languages and origin: corpus specs, tags, temperature mixing.

Groundwork for multilingual training (issue 30) and back-translation (issue 29), designed in
docs/design-inputs.md. Plain Python and numpy: the functions here are pure, so the driver,
`raymt data prepare` and every worker compute the same mix from the same (seed, epoch).

- Corpus specs from flags: `CorpusSpec`s (raymt.config.corpus: one training corpus, its
  languages, files, origin, weight and validation/test sets) of `--train en-de:PREFIX` /
  `--bt SPEC` flags; `[[data.corpora]]` tables are read by raymt.config.corpus too.
- Reserved tag pieces: `<2de>` target-language tags (Johnson et al. 2017) and `<BT>` on
  back-translated sources (Caswell et al. 2019). Shards and encoded sources hold the target tag
  first; a model with data.tag_side "tgt" reads it as its decoder's first token instead (moved
  at collation and decoding: raymt.batching.tag_to_decoder, raymt.decoding.split_tags).
- Temperature mixing: p_i ~ (w_i n_i)^(1/T) and each epoch's rows per corpus (the epoch's
  schedule of pieces, drawn from (seed, epoch) only, is `raymt.data.epoch.epoch_pieces`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

import numpy as np

from raymt.config import CorpusSpec, check_corpora, check_lang, with_one_pair
from raymt.errors import check

BT_TAG = "<BT>"
# A language code of the short SRC-TGT form: no '-', which separates the two (pt_BR, eng_Latn).
SHORT_LANG = r"[A-Za-z][A-Za-z0-9_]*"
PAIR = re.compile(rf"^({SHORT_LANG})-({SHORT_LANG})$")


# ---------------------------------------------------------------- flags and tables


def parse_pair(text: str, where: str) -> tuple[str, str]:
    """("en", "de") from "en-de"; a one-line ValueError naming `where` otherwise."""
    match = PAIR.match(text)
    check(
        match is not None and match.group(1) != match.group(2),
        f"{where}: {text!r} is not a language pair: write SRC-TGT with two different codes, "
        "e.g. en-de (use pt_BR, not pt-BR)",
    )
    return match.group(1), match.group(2)


def parse_pairs(text: str, where: str = "--pairs") -> list[tuple[str, str]]:
    """The pairs of "en-de,en-fr,de-en" (`--pairs` of the built-in corpus), each once."""
    pairs = [parse_pair(p.strip(), where) for p in text.split(",")]
    duplicates = sorted({f"{s}-{t}" for s, t in pairs if pairs.count((s, t)) > 1})
    check(not duplicates, f"{where}: {', '.join(duplicates)} given twice: list each pair once")
    return pairs


def split_spec(spec: str, flag: str) -> tuple[Optional[tuple[str, str]], str]:
    """(pair or None, location) of a flag's SPEC: "en-de:PREFIX", or a bare PREFIX/file/URI.

    Text before the first ':' is a pair unless it holds a '/' or starts a URI ("s3://");
    so a local path with a ':' in its first component is written ./name:rest.
    """
    head, sep, rest = spec.partition(":")
    if not sep or "/" in head or rest.startswith("//"):
        check(bool(spec), f"{flag}: empty SPEC: pass a prefix, a file or SRC-TGT:PATH")
        return None, spec
    pair = parse_pair(head, f"{flag} {spec}")
    check(bool(rest), f"{flag} {spec}: nothing after '{head}:': write {head}:PATH")
    return pair, rest


def corpora_from_flags(
    train: Sequence[str],
    bt: Sequence[str],
    valid: Sequence[str],
    test: Sequence[str],
    default_pair: tuple[str, str],
    builtin: Sequence[tuple[str, str]] = (),
    real_weight: Optional[float] = None,
) -> list[CorpusSpec]:
    """Corpora of repeated --train/--bt/--valid/--test SPECs, in order; a bare SPEC is `default_pair`'s.

    Specs of one pair and origin are one corpus (as repeated --train is today); a pair's
    --valid and --test go to its first corpus. `builtin` pairs (--pairs) come first, from the
    built-in corpus (or the caller's --dataset). `real_weight` (--real-weight) is the weight of
    every real corpus: the real pairs upsampled beside back-translated ones (fairseq's
    --upsample-primary).
    """
    check_real_weight(real_weight, bt)
    grouped: dict[tuple[str, str, str], list[str]] = {(*pair, "real"): [] for pair in builtin}
    for origin, flag, specs in (("real", "--train", train), ("bt", "--bt", bt)):
        for spec in specs:
            pair, location = split_spec(spec, flag)
            key = (*(pair or default_pair), origin)
            check(
                key[:2] not in builtin or origin != "real",
                f"--train {spec}: {'-'.join(key[:2])} also comes from --pairs: drop it from one of them",
            )
            grouped.setdefault(key, []).append(location)
    evals = {"valid": _eval_specs(valid, "--valid", default_pair), "test": _eval_specs(test, "--test", default_pair)}
    for kind, by_pair in evals.items():
        for pair in by_pair:
            check(
                any(key[:2] == pair for key in grouped),
                f"--{kind} {'-'.join(pair)}:... names a pair with no --train or --bt data: drop it or add its data",
            )
    corpora, seen = [], set()
    for (src, tgt, origin), locations in grouped.items():
        first = (src, tgt) not in seen
        seen.add((src, tgt))
        valid_specs = evals["valid"].get((src, tgt), []) if first else []
        check(len(valid_specs) <= 1, f"--valid is given {len(valid_specs)} times for {src}-{tgt}: one per pair")
        corpora.append(
            CorpusSpec(
                src,
                tgt,
                tuple(locations),
                origin,
                weight=real_weight if origin == "real" and real_weight is not None else 1.0,
                valid=(valid_specs or [None])[0],
                test=tuple(evals["test"].get((src, tgt), [])) if first else (),
            )
        )
    check_corpora(corpora)
    return corpora


def check_real_weight(real_weight: Optional[float], bt: Sequence[str]) -> None:
    """--real-weight: a number > 0, given with --bt (one-line errors)."""
    if real_weight is None:
        return
    check(
        math.isfinite(real_weight) and real_weight > 0,
        f"--real-weight {real_weight:g} must be a number > 0 (2: the real pairs twice per epoch)",
    )
    check(
        bool(bt), "--real-weight upsamples the real pairs beside back-translated ones: add --bt SRC-TGT:DIR or drop it"
    )


def input_overrides(
    train: Sequence[str],
    bt: Sequence[str],
    valid: Sequence[str],
    test: Sequence[str],
    pairs: Optional[str],
    langs: dict[str, str],
    current: Sequence[CorpusSpec],
    real_weight: Optional[float] = None,
) -> dict[str, Any]:
    """data.corpora of a run's data flags (`raymt train`, `raymt tune`); none when none is given.
    --train/--bt/--pairs give the corpora, a bare SPEC for the pair of `langs` (--src-lang/
    --tgt-lang: "src_lang", "tgt_lang") or else of the `current` corpora's first. Without them,
    --src-lang/--tgt-lang and a bare --valid/--test change the one corpus of `current` (the
    built-in or a prepared (--corpus) corpus: its languages and sets)."""
    if not (train or bt) and pairs is None:
        check_real_weight(real_weight, bt)  # corpora_from_flags checks it on the other path
        given: dict[str, Optional[str]] = dict(langs)
        for flag, specs in (("valid", valid), ("test", test)):
            check(len(specs) <= 1, f"--{flag} is given {len(specs)} times: one without --train (or use SRC-TGT:SPEC)")
            for spec in specs:
                pair, location = split_spec(spec, f"--{flag}")
                check(pair is None, f"--{flag} {spec} names a pair with no --train, --bt or --pairs data")
                given[flag] = location
        return {"data.corpora": with_one_pair(current, given)} if given else {}
    first = (current[0].src_lang, current[0].tgt_lang) if current else ("en", "de")
    default_pair = (langs.get("src_lang", first[0]), langs.get("tgt_lang", first[1]))
    builtin = parse_pairs(pairs) if pairs is not None else []  # --pairs "" is an error there
    return {"data.corpora": corpora_from_flags(train, bt, valid, test, default_pair, builtin, real_weight)}


def _eval_specs(specs: Sequence[str], flag: str, default_pair: tuple[str, str]) -> dict[tuple[str, str], list[str]]:
    """Locations of --valid/--test SPECs by pair, in order."""
    by_pair: dict[tuple[str, str], list[str]] = {}
    for spec in specs:
        pair, location = split_spec(spec, flag)
        by_pair.setdefault(pair or default_pair, []).append(location)
    return by_pair


def mixed(corpora: Sequence[CorpusSpec]) -> bool:
    """Whether corpora need tags, a mix and the `raymt-corpus/2` format: several corpora, or a
    back-translated one (one real corpus is today's single pair, whatever its files)."""
    return len(corpora) > 1 or any(c.origin != "real" for c in corpora)


# ---------------------------------------------------------------- tags


def lang_tag(lang: str) -> str:
    """The target-language tag piece: "<2de>" for "de" (Johnson et al. 2017)."""
    check_lang(lang, "tag language")
    return f"<2{lang}>"


def target_langs(corpora: Sequence[CorpusSpec]) -> list[str]:
    """The languages the corpora translate into, sorted."""
    return sorted({c.tgt_lang for c in corpora})


def reserved_pieces(corpora: Sequence[CorpusSpec], bt_tag: bool = True) -> list[str]:
    """The tag pieces to reserve in SentencePiece (control symbols, never split, never made from
    text), in id order: a `<2xx>` tag per target language when there are several, then `<BT>`
    when a corpus is back-translated and `bt_tag`. A single real pair reserves none."""
    langs = target_langs(corpora)
    pieces = [lang_tag(lang) for lang in langs] if len(langs) > 1 else []
    return pieces + ([BT_TAG] if bt_tag and any(c.origin == "bt" for c in corpora) else [])


def source_tags(corpus: CorpusSpec, reserved: Sequence[str]) -> list[str]:
    """The pieces put before each source of `corpus`: its target tag, then `<BT>`, where reserved."""
    tags = [lang_tag(corpus.tgt_lang)] if lang_tag(corpus.tgt_lang) in reserved else []
    return tags + ([BT_TAG] if corpus.origin == "bt" and BT_TAG in reserved else [])


def check_tag_side(tag_side: str, corpora: Sequence[CorpusSpec]) -> None:
    """data.tag_side "tgt" (the tag first in the decoder) needs tags: several target languages."""
    check(
        tag_side == "src" or len(target_langs(corpora)) > 1,
        f"data.tag_side=tgt puts the target-language tag first in the decoder, but these corpora translate "
        f"into {', '.join(target_langs(corpora))} only (no tags): leave data.tag_side at src",
    )


def decode_tags(tgt_lang: Optional[str], trained: Sequence[str], reserved: Sequence[str]) -> list[str]:
    """The pieces before a source at inference (translate, evaluate, backtranslate): the model's
    tag for `tgt_lang` (--tgt-lang); one-line errors when it is missing or not trained. A model
    with data.tag_side "tgt" takes it from there as its decoder's prefix (raymt.decoding.split_tags)."""
    tagged = any(p.startswith("<2") for p in reserved)
    if tgt_lang is None:
        check(not tagged, f"this model translates into {', '.join(trained)}: pass --tgt-lang")
        return []
    check(
        tgt_lang in trained,
        f"--tgt-lang {tgt_lang}: this model was trained to translate into {', '.join(trained)}; pick one of them",
    )
    return [lang_tag(tgt_lang)] if tagged else []


# ---------------------------------------------------------------- temperature mixing


def sampling_probs(sizes: Sequence[int], temperature: float, weights: Optional[Sequence[float]] = None) -> np.ndarray:
    """p_i ~ (w_i n_i)^(1/T), normalized: T=1 proportional to size, larger T flatter, inf uniform."""
    check(temperature > 0, f"data.temperature={temperature!r} must be > 0 (1 = proportional)")
    check(
        len(sizes) > 0 and all(n > 0 for n in sizes),
        f"corpus sizes {list(sizes)} must be > 0: a corpus that cleaning emptied cannot be sampled",
    )
    weights = [1.0] * len(sizes) if weights is None else weights
    check(
        len(weights) == len(sizes) and all(w > 0 for w in weights),
        f"corpus weights {list(weights)} must be > 0, one per corpus",
    )
    weighted = np.asarray(sizes, dtype=np.float64) * np.asarray(weights, dtype=np.float64)
    # Powers of shares, not of sizes: (n / max n)^(1/T) stays in (0, 1] for any n and T.
    powered = (weighted / weighted.max()) ** (1.0 / temperature)
    return powered / powered.sum()


def allocate(total: int, probs: Sequence[float]) -> list[int]:
    """`total` split by `probs` into integers that sum to it (largest remainders, ties to the
    lower index), each at least 1 (so every corpus appears in every epoch)."""
    exact = np.asarray(probs, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    order = sorted(range(len(counts)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - int(counts.sum())]:
        counts[i] += 1
    return [max(int(c), 1) for c in counts]


def sample_sizes(
    counts: Sequence[int], sample_pairs: int, temperature: float, weights: Optional[Sequence[float]] = None
) -> list[int]:
    """Pairs of each corpus in the SentencePiece sample: `sample_pairs` split by the training
    temperature, each at most its corpus's `counts` (one corpus: min(sample_pairs, n), today's)."""
    shares = allocate(sample_pairs, sampling_probs(counts, temperature, weights))
    return [min(k, n) for k, n in zip(shares, counts)]


def epoch_rows(sizes: Sequence[int], temperature: float, weights: Optional[Sequence[float]] = None) -> list[int]:
    """Rows each corpus gives every epoch: the epoch holds sum(w_i n_i) rows split by
    `sampling_probs`; at T=1 with weights 1 that is each corpus once (r_i = n_i)."""
    weights = [1.0] * len(sizes) if weights is None else list(weights)
    total = round(sum(n * w for n, w in zip(sizes, weights)))
    return allocate(total, sampling_probs(sizes, temperature, weights))
