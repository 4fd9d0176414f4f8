"""Several corpora in one model: the tags that tell them apart and the temperature that mixes them.

Groundwork for multilingual training (issue 30) and back-translation (issue 29), designed in
docs/design-inputs.md. Plain Python and numpy: the functions here are pure, so the driver,
`raymt data prepare` and every worker compute the same mix from the same (seed, epoch). The
corpora themselves are `CorpusSpec`s (raymt.config.corpus: tables, and the input flags' SPECs
that raymt.flags.InputFlags.corpora reads).

- Reserved tag pieces: `<2de>` target-language tags (Johnson et al. 2017) and `<BT>` on
  back-translated sources (Caswell et al. 2019). Shards and encoded sources hold the target tag
  first; a model with data.tag_side "tgt" reads it as its decoder's first token instead (moved
  at collation and decoding: raymt.batching.tag_to_decoder, raymt.decoding.split_tags).
- Temperature mixing: p_i ~ (w_i n_i)^(1/T) and each epoch's rows per corpus (the epoch's
  schedule of pieces, drawn from (seed, epoch) only, is `raymt.data.epoch.epoch_pieces`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from raymt.config import CorpusSpec, check_lang
from raymt.errors import check

BT_TAG = "<BT>"


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


def reserved_pieces(corpora: Sequence[CorpusSpec], bt_tag: bool = True, every_target: bool = False) -> list[str]:
    """The tag pieces to reserve in SentencePiece (control symbols, never split, never made from
    text), in id order: a `<2xx>` tag per target language when there are several (or always:
    `every_target`, a model that reads language codes), then `<BT>` when a corpus is
    back-translated and `bt_tag`. A single real pair reserves none."""
    langs = target_langs(corpora)
    pieces = [lang_tag(lang) for lang in langs] if len(langs) > 1 or every_target else []
    return pieces + ([BT_TAG] if bt_tag and any(c.origin == "bt" for c in corpora) else [])


def source_tags(corpus: CorpusSpec, reserved: Sequence[str]) -> list[str]:
    """The pieces put before each source of `corpus`: its target tag, then `<BT>`, where reserved."""
    tags = [lang_tag(corpus.tgt_lang)] if lang_tag(corpus.tgt_lang) in reserved else []
    return tags + ([BT_TAG] if corpus.origin == "bt" and BT_TAG in reserved else [])


def source_prefix(corpus: CorpusSpec, ids: dict[str, int], codes: Optional[dict[str, int]] = None) -> list[int]:
    """The ids before each training source of `corpus`: its `source_tags` (`ids`: the reserved
    pieces' ids) with, for a model that reads its source's language code (`codes`: an imported
    NLLB's languages "source_tags", every target tagged), that code after the target tag: the tag
    moves to the decoder (data.tag_side "tgt") and the code starts the source, as
    raymt.engines.ModelInfo.prefix puts them at inference."""
    tags = [ids[piece] for piece in source_tags(corpus, list(ids))]
    return tags[:1] + [codes[corpus.src_lang]] + tags[1:] if codes else tags


def check_tag_side(tag_side: str, corpora: Sequence[CorpusSpec], every_target: bool = False) -> None:
    """data.tag_side "tgt" (the tag first in the decoder) needs tags: several target languages,
    or `every_target` (a model that reads language codes tags every target)."""
    check(
        tag_side == "src" or len(target_langs(corpora)) > 1 or every_target,
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
