"""Decoding speed on Multi30k test_2016_flickr: raymt's cached decoding vs full recomputation.

For each search (beam 5 and greedy by default) the same sentences are translated with the
K/V cache (`DecodeOptions(use_cache=True)`, what raymt uses) and without it
(`use_cache=False`: the decoder reruns over the whole prefix each step), alternating the
two in every repeat so that both see the same machine load. Prints a table of
sentences/s and ratios and writes every number to a JSON file.

    python benchmarks/bench_decoding.py --checkpoint runs/<run>/checkpoint_<...> [--limit 100]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raymt.checkpoint import load_model  # noqa: E402
from raymt.data.text import read_parallel  # noqa: E402
from raymt.decoding import DecodeOptions, translate  # noqa: E402
from raymt.model import Transformer  # noqa: E402
from raymt.tokenizer import Tokenizer  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "multi30k" / "test_2016_flickr"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint or exported model directory")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="test set prefix (PREFIX.en[.gz], PREFIX.de[.gz])")
    p.add_argument("--src-lang", default="en")
    p.add_argument("--tgt-lang", default="de")
    p.add_argument("--limit", type=int, help="only the first N sentences")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--beams", default="5,1", help="comma-separated beam sizes (1 = greedy)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per setting (median reported)")
    p.add_argument("--json", default="bench_decoding.json", help="where to write the results")
    return p.parse_args(argv)


def timed(
    model: Transformer, tokenizer: Tokenizer, sentences: list[str], opts: DecodeOptions, batch_size: int
) -> tuple[float, list[str]]:
    """Seconds to translate `sentences`, and the translations."""
    t0 = time.perf_counter()
    hyps = translate(model, tokenizer, sentences, opts, batch_size)
    return time.perf_counter() - t0, hyps


def bench_beam(
    model: Transformer, tokenizer: Tokenizer, sentences: list[str], beam: int, args: argparse.Namespace
) -> dict:
    """Cached and uncached decoding side by side for one beam size."""
    for use_cache in (True, False):  # warm-up: first-call allocations are not timed
        timed(model, tokenizer, sentences[:4], DecodeOptions(beam=beam, use_cache=use_cache), args.batch_size)
    times: dict[str, list[float]] = {"cached": [], "uncached": []}
    outputs: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        order = ("cached", "uncached") if repeat % 2 == 0 else ("uncached", "cached")
        for name in order:
            opts = DecodeOptions(beam=beam, use_cache=name == "cached")
            seconds, outputs[name] = timed(model, tokenizer, sentences, opts, args.batch_size)
            times[name].append(seconds)
    rate = {name: len(sentences) / statistics.median(t) for name, t in times.items()}
    return {
        "search": "greedy" if beam == 1 else f"beam {beam}",
        "beam": beam,
        "cached_sentences_per_s": round(rate["cached"], 2),
        "uncached_sentences_per_s": round(rate["uncached"], 2),
        "speedup": round(rate["cached"] / rate["uncached"], 3),
        "identical_output": outputs["cached"] == outputs["uncached"],
        "seconds": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
    }


def print_table(results: list[dict], meta: dict) -> None:
    """One row per search: sentences/s with and without the cache, and their ratio."""
    print(
        f"{meta['num_sentences']} sentences of {Path(meta['data']).name}, {meta['threads']} threads, "
        f"batch {meta['batch_size']}, median of {meta['repeats']}"
    )
    print(f"{'search':<8} {'cached sent/s':>14} {'uncached sent/s':>16} {'cached/uncached':>16} {'same output':>12}")
    for r in results:
        print(
            f"{r['search']:<8} {r['cached_sentences_per_s']:>14.2f} {r['uncached_sentences_per_s']:>16.2f} "
            f"{r['speedup']:>15.2f}x {'yes' if r['identical_output'] else 'NO':>12}"
        )


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        beams = [int(b) for b in args.beams.split(",")]
        if min(beams) < 1 or args.threads < 1 or args.repeats < 1 or (args.limit is not None and args.limit < 1):
            raise ValueError("--beams, --threads, --repeats and --limit must be >= 1")
        model, tokenizer, _ = load_model(args.checkpoint)
        sentences = read_parallel(args.data, args.src_lang, args.tgt_lang)[0][: args.limit]
    except ValueError as err:
        print(f"bench_decoding: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    meta = {
        "checkpoint": str(Path(args.checkpoint).resolve()),
        "data": args.data,
        "num_sentences": len(sentences),
        "threads": args.threads,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "d_model": model.cfg.d_model,
        "layers": [model.cfg.num_encoder_layers, model.cfg.num_decoder_layers],
    }
    results = [bench_beam(model, tokenizer, sentences, beam, args) for beam in beams]
    print_table(results, meta)
    Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
