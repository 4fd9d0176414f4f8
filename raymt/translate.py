"""`python -m raymt.translate`: translate text with a checkpoint, or an ensemble of several (no Ray needed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

from raymt.data.text import read_lines
from raymt.engines import check_device, load_engine, load_model_info
from raymt.errors import cli_error
from raymt.flags import add_decode_flags, decode_options
from raymt.metrics import score


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m raymt.translate", description=__doc__)
    p.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        help="checkpoint directory (model.pt, config.json, spm.model), or its URI (s3://...); repeated: an "
        "ensemble of models that share a tokenizer (their log-probabilities averaged at each step)",
    )
    p.add_argument("text", nargs="*", help="sentences to translate; stdin (one per line) when none")
    p.add_argument(
        "--tgt-lang",
        help="target language: required for a multilingual (tagged) model, whose tag goes before each "
        "source; a one-pair model's own target language, if given",
    )
    p.add_argument(
        "--src-lang",
        help="source language, for a model that reads it first in each source (an imported NLLB or "
        "M2M-100; default: the source of the pair config.json records)",
    )
    add_decode_flags(p)
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument(
        "--n-best", type=int, default=1, help="print the N best as 'i ||| hypothesis ||| score' lines (N <= beam)"
    )
    p.add_argument("--seed", type=int, help="seed for --sample (repeatable output)")
    p.add_argument("--ref", help="reference file (one line per input): also print BLEU and chrF")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


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


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        if args.beam < 1:
            raise ValueError(f"--beam {args.beam} must be >= 1")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size {args.batch_size} must be >= 1")
        check_device(args.device)
        opts = decode_options(args, seed=args.seed)
        if not 1 <= args.n_best <= opts.beam:
            raise ValueError(f"--n-best {args.n_best} must be between 1 and the beam size {opts.beam}")
        load_model_info(args.checkpoint).prefix(args.tgt_lang, args.src_lang)  # checked before the weights load
        engine = load_engine(args.checkpoint, "raymt", args.device)  # decodes at the run's precision
        sentences = args.text or [line.rstrip("\n") for line in sys.stdin]
        refs = read_refs(args.ref, len(sentences)) if args.ref else None
    except ValueError as err:
        return cli_error("raymt.translate", err)
    nbest = engine.translate(sentences, opts, args.tgt_lang, args.n_best, args.batch_size, args.src_lang)
    hyps = [h[0][1] for h in nbest]
    for i, hyp_list in enumerate(nbest):
        if args.n_best == 1:
            print(hyp_list[0][1])
        else:  # Moses-style n-best list
            for hyp_score, hyp in hyp_list:
                print(f"{i} ||| {hyp} ||| {hyp_score:.4f}")
    if refs is not None:
        s = score(hyps, refs, lang=args.tgt_lang or engine.info.config.data.pair()[1])
        print(f"BLEU {s['bleu']:.2f} ({s['bleu_signature']})", file=sys.stderr)
        print(f"chrF {s['chrf']:.2f} ({s['chrf_signature']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
