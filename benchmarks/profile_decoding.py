"""Profile raymt's beam search on a test set: sentences/s, where a step's time goes, top operators.

    python benchmarks/profile_decoding.py --checkpoint DIR [--beam 5] [--limit 300]
        [--threads 2] [--batch-size 64]

Decodes `test_2016_flickr` of ../shared/data/multi30k (or --data PREFIX) in raymt's own
batches (`translate`'s length-sorted batches of 64) with length penalty 0, the setting of
`speed.py`'s decoding rows. Prints the timed rate (after one warm-up pass), the share of
time in each part of the search (cProfile, cumulative), and torch.profiler's top operators.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raymt.checkpoint import load_model  # noqa: E402
from raymt.data.text import read_parallel  # noqa: E402
from raymt.decoding import DecodeOptions, decode, encode_sources, length_batches, pad_batch  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "multi30k" / "test_2016_flickr"
# The search's parts, as cProfile names them (file:line(function) contains these).
PARTS = (
    "decoding._next_log_probs",
    "model.decode",
    "model.encode",
    "decoding._force_eos",
    "decoding._finish",
    "decoding._advance",
    "model.reorder_cache",
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", default=str(DEFAULT_DATA), help="test set prefix (PREFIX.en[.gz])")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--hf",
        action="store_true",
        help="also time and profile Hugging Face `generate` on the same weights (benchmarks/peers.py)",
    )
    return p.parse_args(argv)


def run_all(model, sources: list[list[int]], batches: list[list[int]], opts: DecodeOptions) -> int:
    """Decode every batch; returns the number of output tokens."""
    num_tokens = 0
    with torch.inference_mode():
        for idx in batches:
            for ids in decode(model, pad_batch([sources[i] for i in idx]), opts):
                num_tokens += len(ids) + 1
    return num_tokens


def part_times(model, sources, batches, opts) -> dict[str, float]:
    """Cumulative seconds of each part of the search under cProfile, and the total."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_all(model, sources, batches, opts)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    out = {"total": sum(tt for _, _, tt, _, _ in stats.values())}
    for (file, _, name), (_, _, _, ct, _) in stats.items():
        key = f"{Path(file).stem}.{name}"
        if "raymt" in file and key in PARTS:
            out[key] = out.get(key, 0.0) + ct
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Measure, break down and profile beam search."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(args.checkpoint)
    model.eval()
    src, _ = read_parallel(args.data, "en", "de")
    sources = encode_sources(tokenizer, src[: args.limit], model.cfg.max_positions)
    batches = length_batches([len(s) for s in sources], args.batch_size)
    opts = DecodeOptions(beam=args.beam, length_penalty=0.0)
    run_all(model, sources, batches, opts)  # warm-up
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        num_tokens = run_all(model, sources, batches, opts)
        rates.append(len(sources) / (time.perf_counter() - t0))
    print(
        f"beam {args.beam}, {len(sources)} sentences, {args.threads} threads: "
        f"{' / '.join(f'{r:.1f}' for r in rates)} sent/s, {num_tokens} output tokens"
    )
    parts = part_times(model, sources, batches, opts)
    total = parts.pop("total")
    print(f"\ncProfile, cumulative (model.decode is inside _next_log_probs), total {total:.2f} s")
    for name, seconds in sorted(parts.items(), key=lambda x: -x[1]):
        print(f"  {name:26s} {seconds:7.2f} s  {100 * seconds / total:5.1f}%")
    print("\n" + top_operators(lambda: run_all(model, sources, batches, opts)))
    if args.hf:
        profile_hf(model, sources, args)
    return 0


def top_operators(fn) -> str:
    """torch.profiler's top operators by self CPU time of one call of `fn`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)


def profile_hf(model, sources: list[list[int]], args: argparse.Namespace) -> None:
    """The same for Hugging Face `generate` on a MarianMTModel twin with raymt's weights."""
    from benchmarks import peers

    marian = peers.to_marian(model).eval()
    run = lambda: peers.marian_translate(marian, sources, args.beam, 1.2, 10, args.batch_size, 0.0)
    with torch.inference_mode():
        run()  # warm-up
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            rates.append(len(sources) / (time.perf_counter() - t0))
        print(f"\nHF generate, beam {args.beam}: {' / '.join(f'{r:.1f}' for r in rates)} sent/s")
        print(top_operators(run))


if __name__ == "__main__":
    sys.exit(main())
