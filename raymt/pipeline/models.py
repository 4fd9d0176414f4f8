"""The models a distillation makes, built, exported and compared on one thread: the student's
training config on the teachers' translations (`student_config`), its CTranslate2 export at the
faster weight type (`fastest_ct2_type`, `ct2_export`) and a model's row of the comparison on a
test set (`model_row`). `raymt distill` and `raymt pipeline` share them."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

from raymt import storage
from raymt.checkpoint import RAYMT_CONFIG_FILE, weights_file
from raymt.config import CONTENT_RULES, Config, CorpusSpec, DecodeOptions, apply_overrides
from raymt.engines import load_engine
from raymt.exporting import export_model
from raymt.flags import TrainFlags, build_config
from raymt.metrics import score

# CTranslate2 weight types an export chooses between by one-thread speed.
CT2_TYPES = ("int8", "float32")
# Sentences decoded before an engine is timed.
WARM_UP = 16


def student_config(
    flags: TrainFlags,
    pair: tuple[str, str],
    distilled: str,
    tokenizer: str,
    valid: Optional[str],
    test: Optional[str],
    original: Optional[str] = None,
    mix_original: float = 0.0,
    generated: bool = False,
) -> Config:
    """The student run's config: `flags` (preset < config file < flags < --set, as `raymt train`
    builds it) on the `distilled` pairs (PREFIX), mixed with the `original` ones by `mix_original`,
    with the teachers' `tokenizer`; `generated`: the corpus is the built-in one written as files
    (generated text: its content rules off, as in a run)."""
    src, tgt = pair
    common = {"valid": valid, "test": (test,) if test else ()}
    rules = {"clean": {rule: False for rule in CONTENT_RULES}} if generated else {}
    corpora = [CorpusSpec(src, tgt, (distilled,), label="distilled", weight=1 - mix_original, **common, **rules)]
    if mix_original > 0:
        assert original is not None, "mixing needs the original pairs"
        corpora.append(CorpusSpec(src, tgt, (original,), label="original", weight=mix_original, **rules))
    overrides = {"data.corpora": corpora, "data.tokenizer": storage.normalize(tokenizer)}
    return apply_overrides(build_config(flags), overrides)


def engine_of(model: str | Path | list[str], compute_type: str):
    """The comparison's engine, on one thread: CTranslate2 for one model (at `compute_type`),
    raymt's for an ensemble (CTranslate2 has none)."""
    if isinstance(model, list):
        return load_engine(model, "raymt", threads=1)
    return load_engine(str(model), "ctranslate2", threads=1, compute_type=compute_type)


def timed(engine, sources: list[str], opts: DecodeOptions) -> tuple[list[str], float]:
    """Hypotheses of `sources` and the sentences/s of decoding them (after a few untimed ones:
    the first calls of an engine also allocate its buffers)."""
    engine.translate(sources[:WARM_UP], opts)
    t0 = time.perf_counter()
    hyps = [nbest[0][1] for nbest in engine.translate(sources, opts)]
    return hyps, len(sources) / max(time.perf_counter() - t0, 1e-9)


def fastest_ct2_type(
    checkpoint: str, sources: list[str], opts: DecodeOptions, types: Sequence[str] = CT2_TYPES
) -> tuple[str, dict[str, float]]:
    """The CTranslate2 weight type of `types` that decodes `sources` fastest on one thread, and each
    one's sentences/s (printed)."""
    speeds = {ct: round(timed(engine_of(checkpoint, ct), sources, opts)[1], 2) for ct in types}
    dtype = max(speeds, key=speeds.get)
    print(
        f"export: {', '.join(f'{ct} {v:,.1f}' for ct, v in speeds.items())} sentences/s (1 thread) -> --dtype {dtype}"
    )
    return dtype, speeds


def ct2_export(checkpoint: str, target: Path, dtype: str) -> Path:
    """`checkpoint` exported to CTranslate2 at `dtype` in `target` (once: kept when it is whole)."""
    if not (target / RAYMT_CONFIG_FILE).exists():  # written last by export_model
        shutil.rmtree(target, ignore_errors=True)
        export_model(checkpoint, target, "ctranslate2", dtype)
    return target


def model_row(
    name: str, model: Path | list[str], dtype: str, beam: int, test: tuple[list[str], list[str]], tgt: str
) -> dict:
    """One model at one beam on the test set (`model`: a CTranslate2 directory, or an ensemble's
    checkpoints): sacreBLEU, chrF, the papers' BLEU (Moses-tokenized, lowercased), size on disk
    and one-thread sentences/s."""
    engine = engine_of(model, dtype)
    opts = dataclasses.replace(engine.info.config.decode, beam=beam)
    hyps, rate = timed(engine, test[0], opts)
    scores = score(hyps, test[1], extra=True, lang=tgt)
    files = [weights_file(m) for m in model] if isinstance(model, list) else list(model.iterdir())
    return {
        "model": name,
        "engine": engine.name,
        "beam": beam,
        "bleu": round(scores["bleu"], 2),
        "chrf": round(scores["chrf"], 2),
        "bleu_tok": round(scores["bleu_tok"], 2),
        "mib": round(sum(f.stat().st_size for f in files if f.is_file()) / 2**20, 2),
        "sentences_per_s": round(rate, 2),
        "bleu_signature": scores["bleu_signature"],
    }


def relative_to(rows: list[dict], reference: dict) -> None:
    """Each row's speed and BLEU against the `reference` row's (the model distilled from)."""
    for row in rows:
        row["speed_vs_teacher"] = round(row["sentences_per_s"] / reference["sentences_per_s"], 2)
        row["bleu_vs_teacher"] = round(row["bleu"] - reference["bleu"], 2)
