"""Profile raymt's training step in a plain loop: tokens/s and torch.profiler's top operators.

Batches come from a prepared corpus's first shard, cut as training cuts them. Switches
compare one change at a time against the same batches in the same process, in
alternation (A B A B), so the ratio is measured side by side:

    python benchmarks/profile_step.py --corpus DIR [--preset small] [--compare torch-dropout]
        [--compare fused-adamw] [--compare compile] [--compare cpu-bf16+compile] [--profile]

`--compare torch-dropout` builds the model with nn.Dropout instead of raymt's CPU masks;
`fused-adamw` uses AdamW(fused=True) on CPU; `compile` wraps the model in
torch.compile(dynamic=True) (its compile time is reported apart, not in tokens/s);
`cpu-bf16` runs forward under torch.autocast("cpu", bfloat16) (AVX512-BF16/AMX units) against
the fp32 `raymt` row; on a CPU with bf16 units its ratio is recorded as this machine's probe
result for the model shape (raymt.precision's cache), so a run of this model then trains in what
was measured faster and its first log line prints what this script prints;
`cpu-bf16+compile` both (bf16 on such a CPU, compiled).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raymt import model as model_module  # noqa: E402
from raymt.batching import Batch, chunk_batches, collate_flat  # noqa: E402
from raymt.config import Config, DataConfig, preset  # noqa: E402
from raymt.data.stream import flat  # noqa: E402
from raymt.optim import make_optimizer  # noqa: E402
from raymt.tokenizer import Tokenizer  # noqa: E402
from raymt.trainer import train_step  # noqa: E402

CHANGES = ("torch-dropout", "fused-adamw", "compile", "cpu-bf16", "cpu-bf16+compile")


def loop_flags(p: argparse.ArgumentParser, batches: int, repeats: int) -> None:
    """The flags of a script that times the plain loop on a prepared corpus's batches."""
    p.add_argument("--corpus", required=True, help="a prepared corpus (python -m raymt.data prepare)")
    p.add_argument("--preset", default="small")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--batches", type=int, default=batches, help="timed batches per measurement")
    p.add_argument("--repeats", type=int, default=repeats)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop_flags(p, batches=30, repeats=2)
    p.add_argument("--compare", action="append", default=[], choices=CHANGES)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top operators")
    return p.parse_args(argv)


def load_batches(corpus: str, num: int) -> list[Batch]:
    """`num` training batches from the first shard, cut with the default data settings."""
    import pyarrow.parquet as pq

    table = pq.read_table(sorted(glob.glob(f"{corpus}/train/*.parquet"))[0])
    src, tgt = flat(table.column("src_ids")), flat(table.column("tgt_ids"))
    cfg = DataConfig()
    idx = chunk_batches(
        np.diff(src[1]) + 1, np.diff(tgt[1]) + 1, cfg.window_rows, cfg.max_tokens, np.random.default_rng(0)
    )
    return [collate_flat(src, tgt, i) for i in idx[:num]]


def build(cfg: Config, vocab: int, change: Optional[str]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and optimizer with one change applied (None: raymt as is)."""
    saved = model_module.Dropout
    if change == "torch-dropout":
        model_module.Dropout = torch.nn.Dropout  # only while the model is built
    try:
        torch.manual_seed(0)
        model = model_module.Transformer(cfg.model, vocab)
    finally:
        model_module.Dropout = saved
    optimizer = make_optimizer(model, cfg.optim, fused=change == "fused-adamw")
    if change in ("compile", "cpu-bf16+compile"):
        model = torch.compile(model, dynamic=True)
    return model, optimizer


def autocast_of(change: Optional[str]):
    """The autocast context train_step runs the forward pass under."""
    if change in ("cpu-bf16", "cpu-bf16+compile"):
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def tokens_per_s(
    model, optimizer, batches: list[Batch], cfg: Config, autocast=contextlib.nullcontext
) -> tuple[float, float]:
    """Target tokens per second of raymt's update over `batches`, and the mean loss per token."""
    t0, num_tokens, loss = time.perf_counter(), 0, 0.0
    for batch in batches:
        loss += train_step(model, optimizer, [batch], batch.num_tokens, cfg, autocast)[0].item()
        num_tokens += batch.num_tokens
    return num_tokens / (time.perf_counter() - t0), loss / num_tokens


def main(argv: Optional[list[str]] = None) -> int:
    """Measure raymt and each change side by side; optionally profile raymt's step."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = Config(model=preset(args.preset))
    vocab = Tokenizer.load(Path(args.corpus) / "spm.model").vocab_size
    batches = load_batches(args.corpus, args.batches + 10)
    warmup, timed = batches[:10], batches[10:]
    setups = {}
    for change in [None, *args.compare]:
        model, optimizer = build(cfg, vocab, change)
        t0 = time.perf_counter()
        tokens_per_s(model, optimizer, warmup, cfg, autocast_of(change))  # allocation, compilation
        setups[change or "raymt"] = (model, optimizer, time.perf_counter() - t0, autocast_of(change))
    rates: dict[str, list[float]] = {name: [] for name in setups}
    losses: dict[str, float] = {}
    for r in range(args.repeats):
        for name in list(setups) if r % 2 == 0 else list(setups)[::-1]:
            model, optimizer, _, autocast = setups[name]
            rate, losses[name] = tokens_per_s(model, optimizer, timed, cfg, autocast)
            rates[name].append(rate)
    base = statistics.median(rates["raymt"])
    print(f"preset {args.preset}, {args.threads} threads, {len(timed)} batches, torch {torch.__version__}")
    # Every setup trains its own copy of the same initial model on the same batches: the
    # loss of the last pass shows whether a change alters what is learned.
    print("| setup | tokens/s | vs raymt | warm-up s | loss/token, last pass |\n|---|---|---|---|---|")
    for name, (_, _, warm_s, _) in setups.items():
        rate = statistics.median(rates[name])
        print(f"| {name} | {rate:.0f} | {rate / base:.3f} | {warm_s:.1f} | {losses[name]:.4f} |")
    if args.profile:
        from torch.profiler import profile

        model, optimizer, _, _ = setups["raymt"]
        with profile() as prof:
            tokens_per_s(model, optimizer, timed[:5], cfg)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
