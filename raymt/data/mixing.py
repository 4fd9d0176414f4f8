"""Several corpora in one model: whether they need a mix, and the temperature that mixes them.

Groundwork for multilingual training (issue 30) and back-translation (issue 29), designed in
docs/design-inputs.md. Plain Python and numpy: the functions here are pure, so the driver,
`raymt data prepare` and every worker compute the same mix from the same (seed, epoch). The
corpora themselves are `CorpusSpec`s (raymt.config.corpus: tables, and the input flags' SPECs
that raymt.flags.InputFlags.corpora reads).

- The tags that tell corpora apart (`<2de>`, `<BT>`) live in raymt.tags.
- Temperature mixing: p_i ~ (w_i n_i)^(1/T) and each epoch's rows per corpus (the epoch's
  schedule of pieces, drawn from (seed, epoch) only, is `raymt.data.epoch.epoch_pieces`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from raymt.config import CorpusSpec
from raymt.errors import check


def mixed(corpora: Sequence[CorpusSpec]) -> bool:
    """Whether corpora need tags, a mix and the `raymt-corpus/2` format: several corpora, or a
    back-translated one (one real corpus is today's single pair, whatever its files)."""
    return len(corpora) > 1 or any(c.origin != "real" for c in corpora)


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
