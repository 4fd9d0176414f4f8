"""Measuring training: torch.profiler over a window of steps (`train.profile_steps`, one file set
per rank), training FLOPs, a card's datasheet peak and a measured matmul, MFU, host syncs, a
run's rates from its metrics.csv, and a measured CPU bf16 ratio recorded as raymt's probe result.

Plain PyTorch: the worker loop calls `after_step` with its step count. The window starts
after the first log interval, so start-up (thread pools, weight packing, the first Ray
Data read) is not in it. The step's parts are named ranges (`raymt.lockstep`,
`raymt.forward`, `raymt.backward`, `raymt.clip`, `raymt.optimizer`); with DDP the
backward range holds the gradient all-reduce that backward does not hide.
"""

from __future__ import annotations

import csv
import re
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from raymt.batching import Batch
from raymt.config import ModelConfig

PARTS = ("raymt.lockstep", "raymt.forward", "raymt.backward", "raymt.clip", "raymt.optimizer")

# (pattern in torch.cuda.get_device_name, card, dtype, dense TFLOP/s on the datasheet, no
# sparsity), most specific first. V100 and T4 have no bf16: their fp16 tensor-core peak.
PEAKS = (
    (r"H100.*PCIe", "H100 PCIe", "bf16", 756.0),
    (r"H100.*NVL", "H100 NVL", "bf16", 835.0),
    (r"H100", "H100 SXM", "bf16", 989.0),
    (r"H200.*NVL", "H200 NVL", "bf16", 835.0),
    (r"H200", "H200", "bf16", 989.0),
    (r"A100", "A100", "bf16", 312.0),
    (r"\bL40S\b", "L40S", "bf16", 362.0),
    (r"\bL4\b", "L4", "bf16", 121.0),
    (r"\bA10G\b", "A10G", "bf16", 70.0),  # AWS's A10 variant, lower clocks than the A10's 125
    (r"V100.*PCIE", "V100 PCIe", "fp16", 112.0),
    (r"V100", "V100 SXM2", "fp16", 125.0),
    (r"\bT4\b", "T4", "fp16", 65.0),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def flops_per_token(cfg: ModelConfig, vocab: int, batches: Sequence[Batch]) -> float:
    """Training FLOPs per target token over `batches` (padding computed too)."""
    return sum(train_flops(cfg, vocab, b) for b in batches) / sum(b.num_tokens for b in batches)


def mfu(tokens_per_s: Optional[float], flops: Optional[float], rate: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization: tok/s x FLOPs per token against `rate` FLOP/s (None when one is unknown)."""
    if not rate or not flops or not tokens_per_s:
        return None
    return tokens_per_s * flops / rate


def card_peak(name: str) -> Optional[tuple[str, str, float]]:
    """(card, dtype, datasheet dense TFLOP/s) of a GPU named `name`, None when not in PEAKS."""
    for pattern, card, dtype, tflops in PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            return card, dtype, tflops
    return None


def gpu_peak(index: int = 0) -> dict:
    """A GPU's name, compute capability, card, datasheet peak (None when unknown) and the peak's dtype
    (else bf16 where the card has it, fp16 where not)."""
    name = torch.cuda.get_device_name(index)
    known = card_peak(name)
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return {
        "gpu": name,
        "capability": "sm_%d%d" % torch.cuda.get_device_capability(index),
        "card": known[0] if known else None,
        "peak_tflops": known[2] if known else None,
        "dtype": known[1] if known else ("bf16" if bf16 else "fp16"),
    }


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_flops(device: str, dtype: torch.dtype, n: int = 2048, seconds: float = 2.0) -> float:
    """Measured FLOP/s of square matrix multiplies in this process (the hardware's practical peak)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
        if count % 8 == 0:
            synchronize(device)
    synchronize(device)
    return 2 * n**3 * count / (time.perf_counter() - t0)


def matmul_tflops(device: str, dtype: str, n: int) -> float:
    """`matmul_flops` in TFLOP/s, the dtype named as in PEAKS ("bf16", "fp16") or "fp32"."""
    return matmul_flops(device, DTYPES[dtype], n) / 1e12


def count_syncs(fn: Callable[[], None]) -> int:
    """Host-device synchronizations while `fn` runs (CUDA's sync debug mode, one warning each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def metrics_figures(metrics_csv: str) -> dict:
    """A run's tok/s (time-weighted over the intervals after the first), last data_share and peak GPU
    memory (when logged) from its metrics.csv."""
    with open(metrics_csv) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
    if len(rows) < 2:
        return {"error": f"{len(rows)} logged interval(s): none after the warm-up one"}
    steps = [int(b["step"]) - int(a["step"]) for a, b in zip(rows, rows[1:])]
    rates = [float(r["tokens_per_s"]) for r in rows[1:]]
    # Time-weighted (token-budget batches: about as many tokens a step): steps / seconds.
    out = {
        "tokens_per_s": sum(steps) / sum(n / v for n, v in zip(steps, rates)),
        "steps": sum(steps),
        "data_share": float(rows[-1]["data_share"]) if rows[-1].get("data_share") else None,
    }
    # When the worker logs it (peak_gpu_mb or a column named alike).
    column = next((k for k in rows[0] if re.fullmatch(r"(peak_)?gpu(_mem(ory)?)?_mi?b", k)), None)
    gpu_mb = [float(r[column]) for r in rows if column and r.get(column)]
    out["peak_gpu_mb"] = max(gpu_mb) if gpu_mb else None
    return out
