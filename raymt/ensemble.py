"""Several models that share a tokenizer, decoded as one (plain single-device PyTorch).

An `Ensemble` has the interface `raymt.decoding` uses of a `Transformer` (`encode`, `new_cache`,
`cfg.max_positions`, `eval`), so greedy, sampling and beam search take either; `model_log_probs`
is the one place decoding turns a step's outputs into log-probabilities: a model's log-softmax,
or an ensemble's mean of its members' (not renormalized: a hypothesis's score is the mean of the
members' scores of it; sampling's softmax normalizes what it draws from). Each member keeps its
own encoder memory and K/V cache inside what decoding already selects rows of: the memories side
by side along the model dimension, (B, S, D1 + D2 + ...), and the members' cache layers in one
`Cache`, so the beam's reordering and pruning (`reorder_cache`) reach every member. An ensemble
of one decodes exactly as its model does (same ids, same scores).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

from raymt.errors import check
from raymt.model import Cache, Transformer


class Ensemble:
    """Models over one vocabulary decoded together: their next-token log-probabilities averaged."""

    def __init__(self, models: Sequence[Transformer]):
        check(len(models) > 0, "an ensemble needs at least one model")
        sizes = sorted({m.vocab_size for m in models})
        check(len(sizes) == 1, f"an ensemble's models must share one vocabulary; their sizes are {sizes}")
        self.models = list(models)
        self.dims = [m.cfg.d_model for m in models]  # each member's slice of the joint memory
        self.layers = [len(m.decoder) for m in models]  # each member's layers of the joint cache
        self.vocab_size = sizes[0]
        # What decoding reads of a config (its length limit): the first member's, with the
        # positions every member has.
        self.cfg = dataclasses.replace(models[0].cfg, max_positions=min(m.cfg.max_positions for m in models))

    def eval(self) -> "Ensemble":
        """Every member in eval mode (no dropout)."""
        for m in self.models:
            m.eval()
        return self

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) ids -> the members' memories side by side (B, S, D1 + D2 + ...) and the
        src_mask (B, 1, 1, S) they share (one tokenizer: the same source ids, the same padding)."""
        encoded = [m.encode(src) for m in self.models]
        return torch.cat([memory for memory, _ in encoded], dim=-1), encoded[0][1]

    def new_cache(self) -> Cache:
        """One cache holding every member's layers in order, so `reorder_cache` reorders them all."""
        caches = [m.new_cache() for m in self.models]
        return {"length": 0, "layers": [layer for c in caches for layer in c["layers"]]}

    def _member_caches(self, cache: Optional[Cache]) -> list[Optional[Cache]]:
        """Each member's view of the joint cache: its own layers (the same dicts) at the joint length."""
        if cache is None:
            return [None] * len(self.models)
        bounds = [sum(self.layers[:i]) for i in range(len(self.layers) + 1)]
        return [{"length": cache["length"], "layers": cache["layers"][a:b]} for a, b in zip(bounds, bounds[1:])]


Decoder = Union[Transformer, Ensemble]


def model_log_probs(
    model: Decoder,
    tgt: torch.Tensor,
    memory: torch.Tensor,
    src_mask: torch.Tensor,
    cache: Optional[Cache] = None,
    last: bool = False,
) -> torch.Tensor:
    """(N, T) target ids -> (N, T, V) float log-probabilities of each next token (`last`: (N, V)
    of the last position only): a model's log-softmax, an ensemble's mean of its members' (each
    on its own slice of the memory and its own cache layers); with a cache, only new tokens."""
    if isinstance(model, Ensemble):
        views = model._member_caches(cache)
        memories = memory.split(model.dims, dim=-1)  # (N, S, Di) each
        parts = [
            model_log_probs(m, tgt, mem, src_mask, view, last) for m, mem, view in zip(model.models, memories, views)
        ]
        if cache is not None:  # every member advanced by the same new tokens
            cache["length"] = views[0]["length"]  # type: ignore[index]
        return torch.stack(parts).mean(0)
    logits = model.decode(tgt, memory, src_mask, cache)  # (N, T, V)
    return torch.log_softmax((logits[:, -1] if last else logits).float(), dim=-1)
