"""`python -m raymt.translate`: translate text with a checkpoint, or an ensemble of several (no Ray needed)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from raymt.command import flag, group, parse
from raymt.config import DecodeOptions
from raymt.data.text import read_lines
from raymt.engines import check_device, load_engine, load_model_info
from raymt.errors import check, cli_error
from raymt.metrics import score

PROG = "python -m raymt.translate"


@dataclass
class TranslateConfig:
    """`raymt translate`: the checkpoints (several: an ensemble), the sentences, their languages,
    the search and the batches; `run` translates them."""

    checkpoint: tuple[str, ...] = flag(
        default_factory=tuple,
        help="checkpoint directory (model.pt, config.json, spm.model), or its URI (s3://...); repeated: an "
        "ensemble of models that share a tokenizer (their log-probabilities averaged at each step)",
        repeat=True,
        required=True,
    )
    text: tuple[str, ...] = flag(
        default_factory=tuple,
        help="sentences to translate; stdin (one per line) when none",
        positional=True,
        repeat=True,
    )
    tgt_lang: Optional[str] = flag(
        None,
        "target language: required for a multilingual (tagged) model, whose tag goes before each "
        "source; a one-pair model's own target language, if given",
    )
    src_lang: Optional[str] = flag(
        None,
        "source language, for a model that reads it first in each source (an imported NLLB or "
        "M2M-100; default: the source of the pair config.json records)",
    )
    decode: DecodeOptions = group(DecodeOptions)
    batch_size: int = flag(64, "sentences per batch")
    n_best: int = flag(1, "print the N best as 'i ||| hypothesis ||| score' lines (N <= beam)")
    ref: Optional[str] = flag(None, "reference file (one line per input): also print BLEU and chrF")
    # auto: cuda when this machine has a GPU, else cpu (`run` resolves it).
    device: str = flag("auto", "cpu, cuda or cuda:N (default auto: cuda when there is a GPU)")

    def __post_init__(self) -> None:
        check(bool(self.checkpoint), "--checkpoint is required: a checkpoint directory or its URI")
        check(self.batch_size >= 1, f"--batch-size {self.batch_size} must be >= 1")
        check(
            1 <= self.n_best <= self.decode.beam,
            f"--n-best {self.n_best} must be between 1 and the beam size {self.decode.beam}",
        )


@dataclass
class Translations:
    """What `run` translated: each sentence's n best (score, hypothesis), best first, in input
    order; with --ref, the scores of the best ones (`raymt.metrics.score`: BLEU, chrF, signatures)."""

    nbest: list[list[tuple[float, str]]]
    scores: Optional[dict] = None


def read_refs(ref: str, num_inputs: int) -> list[str]:
    """The --ref lines (split on \\n only, as the inputs are), one per input."""
    ref_path = Path(ref)
    if not ref_path.is_file():
        raise ValueError(f"--ref {ref_path} does not exist")
    if num_inputs == 0:
        raise ValueError("--ref: there is no input to score; give sentences as arguments or on stdin")
    refs = read_lines(str(ref_path))
    if len(refs) != num_inputs:
        raise ValueError(f"--ref {ref_path} has {len(refs)} lines for {num_inputs} inputs")
    return refs


def run(cfg: TranslateConfig) -> Translations:
    """Translate cfg.text (stdin's lines when there is none) with raymt's engine, at the run's
    precision; every user error is a one-line ValueError before the first sentence decodes."""
    device = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device)
    load_model_info(cfg.checkpoint).prefix(cfg.tgt_lang, cfg.src_lang)  # checked before the weights load
    engine = load_engine(cfg.checkpoint, "raymt", device)
    sentences = list(cfg.text) or [line.rstrip("\n") for line in sys.stdin]
    refs = read_refs(cfg.ref, len(sentences)) if cfg.ref else None
    nbest = engine.translate(sentences, cfg.decode, cfg.tgt_lang, cfg.n_best, cfg.batch_size, cfg.src_lang)
    if refs is None:
        return Translations(nbest)
    hyps = [h[0][1] for h in nbest]
    return Translations(nbest, score(hyps, refs, lang=cfg.tgt_lang or engine.info.config.data.pair()[1]))


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: prints the translations (Moses-style n-best lines with --n-best), then BLEU and
    chrF on stderr with --ref; returns the exit status."""
    try:
        cfg = parse(TranslateConfig, argv, PROG, description=__doc__)
        done = run(cfg)
    except ValueError as err:
        return cli_error("raymt.translate", err)
    for i, hyp_list in enumerate(done.nbest):
        if cfg.n_best == 1:
            print(hyp_list[0][1])
        else:  # Moses-style n-best list
            for hyp_score, hyp in hyp_list:
                print(f"{i} ||| {hyp} ||| {hyp_score:.4f}")
    if done.scores is not None:
        print(f"BLEU {done.scores['bleu']:.2f} ({done.scores['bleu_signature']})", file=sys.stderr)
        print(f"chrF {done.scores['chrf']:.2f} ({done.scores['chrf_signature']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
