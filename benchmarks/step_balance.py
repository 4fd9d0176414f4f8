"""How long each worker's step takes, and what lockstep costs when their batches differ.

    python benchmarks/step_balance.py [--steps 60] [--workers 2]

With data-parallel training every update waits for the slowest worker: step i takes
max over workers of their batch i's time. This times the first `--steps` batches of each
worker's epoch-0 slice of Multi30k (the `small` model, one thread, the plain loop of
speed.py, one batch at a time after a warm-up, two passes) and prints the lockstep factor

    mean_i max_w t[w, i]  /  mean_i mean_w t[w, i]

the share of time a worker would wait even with free communication; and the same for the
FLOP formula of speed.py (`train_flops`), which needs no timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402


def lockstep_factor(costs: list[list[float]]) -> float:
    """mean over steps of the slowest worker's cost / mean over steps of the mean worker's cost."""
    steps = list(zip(*costs))
    return statistics.mean(max(s) for s in steps) / statistics.mean(statistics.mean(s) for s in steps)


def time_steps(loop: "speed.PlainLoop", batches: list) -> list[float]:
    """Seconds of each training step, one batch at a time."""
    out = []
    for batch in batches:
        t0 = time.perf_counter()
        loop.step_fn(batch)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Print per-worker step times, their spread and the lockstep factor."""
    from raymt.config import Config
    from raymt.model import Transformer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=2)
    speed.shared_flags(p, "/tmp/raymt-step-balance", "benchmarks/results/step_balance.json")
    args = p.parse_args(argv)

    speed.start_ray(False)
    torch.set_num_threads(1)
    corpus = speed.prepare_multi30k(Path(args.data), Path(args.work_dir) / "corpus")
    model_cfg, vocab = speed.model_config(args.preset), speed.vocab_size(corpus)
    batches = [speed.stream_batches(corpus, r, args.workers, limit=args.steps) for r in range(args.workers)]
    flops = [[speed.train_flops(model_cfg, vocab, b) for b in bs] for bs in batches]
    torch.manual_seed(0)
    loop = speed.PlainLoop(Transformer(model_cfg, vocab), Config(model=model_cfg), "cpu")
    time_steps(loop, batches[0][:5])  # warm-up
    passes = [[[0.0] * args.steps for _ in batches] for _ in range(2)]
    for p_ in passes:  # two passes: the same batch timed twice shows the timing noise alone
        for i in range(args.steps):  # step i of every worker back to back: they see the same machine
            for w in range(args.workers):
                p_[w][i] = time_steps(loop, [batches[w][i]])[0]
    seconds = [[statistics.mean(x) for x in zip(a, b)] for a, b in zip(*passes)]
    noise = statistics.mean(lockstep_factor([a, b]) for a, b in zip(*passes))
    result = {"steps": args.steps, "workers": args.workers,
              "lockstep_factor_time": lockstep_factor(seconds), "lockstep_factor_flops": lockstep_factor(flops),
              "lockstep_factor_noise": noise,
              "mean_step_s": [statistics.mean(s) for s in seconds],
              "cv_step_time": [statistics.stdev(s) / statistics.mean(s) for s in seconds],
              "target_tokens": [[b.num_tokens for b in bs] for bs in batches], "seconds": seconds}
    print(f"mean step: {' / '.join(f'{x * 1e3:.0f} ms' for x in result['mean_step_s'])}; spread (CV) "
          f"{' / '.join(f'{x:.3f}' for x in result['cv_step_time'])}")
    print(f"lockstep factor over {args.steps} steps: measured {result['lockstep_factor_time']:.3f} "
          f"(mean of 2 passes; the same batch against itself: {noise:.3f}), "
          f"FLOP formula {result['lockstep_factor_flops']:.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
