"""The batch schedule (global batch, lr and warm-up by the one rule) and the defaults a GPU or
compiled run gets for the fields its user did not set."""

from __future__ import annotations

from typing import Any, Collection, Optional

from raymt.config.overrides import apply_overrides
from raymt.config.sections import GPU_SHAPE_BUCKETS, Config

# Per-worker token budget on a GPU: a 2,048-token batch leaves a GPU launch-bound (an H200
# was busy ~7.4 of 43.6 ms per base step); 32k tokens ran base at ~452k tok/s there.
GPU_MAX_TOKENS = 32768
# A GPU run's length and validation interval: 20k updates of >= 32k tokens are >= 650M
# tokens (the paper's base saw 2.5G in 100k updates of 25k); validating every 1,000 updates
# (20 times a run) keeps the greedy pass over a WMT-sized dev set to a few % of the time.
GPU_MAX_STEPS = 20000
GPU_EVAL_EVERY = 1000
# The paper's schedule (Vaswani et al. 2017): ~25k target tokens per update, warmup 4000
# updates, peak lr d_model^-0.5 * 4000^-0.5.
PAPER_BATCH_TOKENS = 25000
PAPER_WARMUP_STEPS = 4000
# The lr grows with the square root of the global batch up to this factor (reached at 4x
# the paper's batch): Ott et al. 2018 trained big at 1e-3, about twice the paper's 4.9e-4,
# with ~400k-token batches (16x the paper's), the largest lr reported for such batches.
MAX_LR_SCALE = 2.0
# A run's batch schedule: a run started from a checkpoint's weights keeps the checkpoint's.
SCHEDULE_FIELDS = ("data.max_tokens", "optim.update_freq", "optim.lr", "optim.warmup_steps")


def global_batch_tokens(cfg: "Config") -> int:
    """Tokens per update across workers: workers x data.max_tokens x optim.update_freq."""
    return cfg.train.num_workers * cfg.data.max_tokens * cfg.optim.update_freq


def batch_schedule(cfg: "Config") -> tuple[float, int]:
    """Peak lr and warmup updates for `cfg`'s model, global batch and run length (the one rule).

    The paper's schedule for ~25k tokens, its lr scaled by sqrt(global batch / 25k) (the
    square-root rule for Adam: the update's noise scale stays the same), at most MAX_LR_SCALE
    times; the warmup stays 4000 updates (Ott et al. 2018 kept it at 16x the batch), or a
    quarter of a shorter run.
    """
    scale = min((global_batch_tokens(cfg) / PAPER_BATCH_TOKENS) ** 0.5, MAX_LR_SCALE)
    lr = (cfg.model.d_model * PAPER_WARMUP_STEPS) ** -0.5 * scale
    return float(f"{lr:.2g}"), max(1, min(PAPER_WARMUP_STEPS, cfg.train.max_steps // 4))


def schedule_line(cfg: "Config") -> str:
    """What a GPU run prints at start: its global batch, lr and warmup, and where they come from."""
    tokens, workers = global_batch_tokens(cfg), cfg.train.num_workers
    lr, warmup = batch_schedule(cfg)
    ratio = (tokens / PAPER_BATCH_TOKENS) ** 0.5
    head = (
        f"lr {_short_e(cfg.optim.lr)} and warmup {cfg.optim.warmup_steps} for a global batch of "
        f"{tokens / 1000:.0f}k tokens ({workers} worker{'s' * (workers > 1)} x {cfg.data.max_tokens} "
        f"x update_freq {cfg.optim.update_freq})"
    )
    if (cfg.optim.lr, cfg.optim.warmup_steps) != (lr, warmup):
        return f"{head}: as set (config.batch_schedule would give lr {_short_e(lr)} and warmup {warmup})"
    capped = f", capped at x{MAX_LR_SCALE:g}" if ratio > MAX_LR_SCALE else ""
    return (
        f"{head}: the paper's 25k-token schedule, lr x sqrt(batch ratio) = x{ratio:.2f}{capped}, "
        f"warmup {PAPER_WARMUP_STEPS} or a quarter of train.max_steps (config.batch_schedule)"
    )


def _short_e(x: float) -> str:
    """7e-4 as 7.0e-4 (not 7.0e-04)."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def device_defaults(cfg: "Config", given: Collection[str] = (), num_gpus: Optional[int] = None) -> dict[str, Any]:
    """Values a GPU or compiled run gets for the fields its user did not set (not in `given`).

    On a GPU: one worker per GPU of the cluster (`num_gpus`, when known), 32k-token batches per
    worker (16k for models wider than base, whose activations are twice as large; lower it
    with --set data.max_tokens on small cards), a width ladder of 8, GPU_MAX_STEPS updates
    validated every GPU_EVAL_EVERY, and `batch_schedule`'s lr and warmup for the resulting
    global batch. Compiled runs also get the ladder, so shapes repeat; both get row counts on a
    ladder of `GPU_SHAPE_BUCKETS` widths too, so an epoch has few (B, S, T) shapes.
    """
    out: dict[str, Any] = {}

    def default(key: str, value: Any) -> None:
        if key not in given:
            out[key] = value

    if cfg.train.use_gpu:
        if num_gpus is not None:
            default("train.num_workers", num_gpus)
        default("data.max_tokens", GPU_MAX_TOKENS if cfg.model.d_model <= 512 else GPU_MAX_TOKENS // 2)
        default("train.max_steps", GPU_MAX_STEPS)
        default("train.eval_every", GPU_EVAL_EVERY)
    if cfg.train.use_gpu or cfg.train.compile:
        default("data.pad_multiple", 8)
        default("data.shape_buckets", GPU_SHAPE_BUCKETS)
    if cfg.train.use_gpu:  # the schedule of the batch and run length settled above
        lr, warmup = batch_schedule(apply_overrides(cfg, out))
        default("optim.lr", lr)
        default("optim.warmup_steps", warmup)
    return out
