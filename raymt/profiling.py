"""torch.profiler over a window of training steps (`train.profile_steps`), one file set per rank.

Plain PyTorch: the worker loop calls `after_step` with its step count. The window starts
after the first log interval, so start-up (thread pools, weight packing, the first Ray
Data read) is not in it. The step's parts are named ranges (`raymt.lockstep`,
`raymt.forward`, `raymt.backward`, `raymt.clip`, `raymt.optimizer`); with DDP the
backward range holds the gradient all-reduce that backward does not hide.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from raymt.batching import Batch
from raymt.config import ModelConfig

PARTS = ("raymt.lockstep", "raymt.forward", "raymt.backward", "raymt.clip", "raymt.optimizer")


class StepProfiler:
    """Profile steps (start, start + num_steps]; write PREFIX.txt (tables) and PREFIX.json (trace)."""

    def __init__(self, num_steps: int, start: int, prefix: Optional[Path], cuda: bool = False):
        self.num_steps, self.start, self.prefix, self.cuda = num_steps, start, prefix, cuda
        self.prof: Optional[torch.profiler.profile] = None
        self.t0 = 0.0
        self.done = num_steps <= 0 or prefix is None

    def after_step(self, step: int) -> None:
        """Start the profiler after step `start`, stop and write after `start + num_steps`."""
        if self.done:
            return
        if self.prof is None and step >= self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.first, self.t0 = step, time.perf_counter()
        elif self.prof is not None and step >= self.first + self.num_steps:
            self.finish(step)

    def close(self, step: int) -> None:
        """At the end of a run: write what a window still open at `step` has recorded."""
        if self.prof is not None and not self.done:
            self.finish(step)

    def finish(self, step: int) -> None:
        """Stop profiling and write the tables and the trace."""
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        self.done = True
        assert self.prefix is not None
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.prefix.with_suffix(".json")))
        self.prefix.with_suffix(".txt").write_text(report(self.prof, step - self.first, wall))


def report(prof: torch.profiler.profile, num_steps: int, wall_s: float) -> str:
    """The step's parts (ms per step, share of wall time) and the top operators by self time."""
    events = {e.key: e for e in prof.key_averages()}
    lines = [
        f"{num_steps} steps, {1000 * wall_s / max(num_steps, 1):.1f} ms per step (wall)",
        f"{'part':18s} {'ms/step':>9s} {'share':>7s}",
    ]
    for name in PARTS:
        if name in events:
            ms = events[name].cpu_time_total / 1000 / max(num_steps, 1)
            lines.append(f"{name:18s} {ms:9.3f} {100 * ms / (1000 * wall_s / max(num_steps, 1)):6.1f}%")
    lines += ["", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]
    return "\n".join(lines) + "\n"


def train_flops(cfg: ModelConfig, vocab: int, batch: Batch) -> float:
    """Training FLOPs of one step on the padded batch: 3 x forward (backward = 2 x forward).

    Forward, per sequence with S source and T target positions (padding included: the
    hardware computes it), D = d_model, F = d_ff, V = vocabulary, 2 FLOPs per multiply-add:
    encoder layer 2S(4D^2 + 2DF) + 4S^2 D; decoder layer 2T(4D^2 + 2DF) + 2(T + S)2D^2
    (cross-attention q/out on T, k/v on S) + 4T^2 D + 4TSD; output 2TDV. Embedding
    lookups, norms, softmax and the optimizer are not counted.
    """
    b, s = batch.src.shape
    t = batch.tgt_in.size(1)
    d, f = cfg.d_model, cfg.d_ff
    enc = 2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d
    dec = 2 * t * (4 * d * d + 2 * d * f) + 2 * (t + s) * 2 * d * d + 4 * t * t * d + 4 * t * s * d
    fwd = cfg.num_encoder_layers * enc + cfg.num_decoder_layers * dec + 2 * t * d * vocab
    return 3.0 * b * fwd
