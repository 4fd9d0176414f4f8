"""sacreBLEU scores with their signatures."""

from __future__ import annotations

import sacrebleu


def score(hyps: list[str], refs: list[str]) -> dict:
    """Corpus BLEU and chrF with the signatures that make them reproducible."""
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "chrf": c.score, "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}
