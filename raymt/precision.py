"""Which precision a run computes in: the autocast dtype, loss scaling and TF32, and why.

Training (`for_training`): `train.precision` pins it ("fp32", "bf16", "fp16"); "auto" (the
default) keeps the precision a resumed checkpoint recorded, else chooses, with `train.bf16`
(low precision allowed) on:
- a GPU with bf16 units (compute capability >= 8.0): bf16 autocast, no loss scaling;
- an older GPU (V100, T4): fp16 autocast with `torch.amp.GradScaler` (dynamic loss scaling);
- a CPU with bf16 units (AVX512-BF16, AMX): bf16 autocast only where it pays: a short timed
  probe of the run's own training step, fp32 against bf16 in CPU time, run by every worker at
  once with the run's threads per worker on batches cut as the run's loader cuts them from rows
  of its validation set's widths (`ProbeShape`, `batch_shapes`),
  plus the gradient all-reduce both precisions share; cached by CPU, torch and its kernel
  level, model shape, threads, workers and batches in a JSON file (`$RAYMT_PRECISION_CACHE`,
  default ~/.cache/raymt/precision.json);
- any other CPU: fp32.
`train.bf16=false` means fp32 everywhere (it wins over `train.precision`). Weights, loss and
optimizer stay fp32 throughout. TF32 (fp32 matmuls and convolutions on tensor cores) is on for
GPUs of compute capability >= 8.0 unless `train.tf32=false`. The worker records the choice in
every checkpoint (its config's train.precision and its train state), so a resume or restart
computes as before.

Inference (`for_inference`: the test set, translate, evaluate) autocasts to training's dtype on
a GPU with no scaler; on a CPU it decodes in fp32: no decoding measurement found bf16 faster
there, and bf16 changed outputs (issue 44: 28 of 300 sentences). Validation during training
runs in the training precision (the trainer's autocast).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Optional, Sequence

import numpy as np
import torch

from raymt.batching import Batch, ShapeLadder, collate, round_up, token_budget_batches
from raymt.config import Config, DataConfig, ModelConfig
from raymt.model import build_model
from raymt.optim import make_optimizer
from raymt.trainer import SINGLE, Collective, train_step

CACHE_ENV = "RAYMT_PRECISION_CACHE"
# bf16 rounds activations to 8 mantissa bits: on a CPU it has to buy at least this much speed.
BF16_MIN_SPEEDUP = 1.05
PROBE_BUDGET_S = 2.0  # the CPU probe's timed part (at least 2 passes of each); a warm-up pass of each on top
PROBE_ROW_LEN = 20  # tokens per source and target row of the probe's batch without known lengths
PROBE_MAX_TOKENS = 2048  # a one-process probe's batch (no ProbeShape): data.max_tokens, at most this
# A run's probe batches: data.max_tokens, at most this: the ratio hardly depends on the rows (the
# Multi30k recipe's model, rows of 10 and 9 or 13 and 14 tokens: within 5% at 1024, 2048 and
# 4096 tokens), its cost does.
RUN_MAX_TOKENS = 2048
PROBE_BATCHES = 8  # a run's probe: this many of the run's batch shapes (bf16's gain varies with them)
PROBE_WINDOW_BATCHES = 64  # ... picked from this many batches' worth of rows cut as the run cuts them
# In the cache key. 1 timed batches of single rows' lengths (issue 47: mini 0.95 vs runs' 0.76);
# 2 trained CPU bf16 attention in bf16 (its backward's cliff at 12 tokens: model.Attention).
PROBE_VERSION = 3
DTYPES: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """A precision choice: autocast dtype (None: fp32), TF32, and why; the same on every rank."""

    device_type: str  # "cpu" or "cuda"
    dtype: Optional[torch.dtype] = None
    tf32: bool = False
    why: str = ""

    @property
    def name(self) -> str:
        """bf16, fp16 or fp32."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")

    def autocast(self) -> ContextManager:
        """The forward pass's autocast context (a null one in fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> Optional[torch.amp.GradScaler]:
        """A dynamic loss scaler where fp16 needs one (its gradients underflow), else None."""
        # fairseq's initial scale (--fp16-init-scale 128): torch's 2**16 overflows for the first
        # steps of a Transformer, and each overflow is a skipped update that counts towards
        # train.max_nonfinite_steps; the scale grows from 128 after 2000 clean updates.
        return torch.amp.GradScaler(self.device_type, init_scale=128.0) if self.dtype == torch.float16 else None

    def apply(self) -> "Precision":
        """Set this process's TF32 flags as chosen (CUDA only); returns self."""
        if self.device_type == "cuda":  # the legacy flags only: torch refuses reads of mixed APIs
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32
        return self

    def record(self) -> dict:
        """What a checkpoint's train state keeps of this choice (`recorded` reads it back)."""
        return {"name": self.name, "device_type": self.device_type, "why": self.why}

    def line(self, device: torch.device) -> str:
        """The run's first log line: autocast, TF32 and loss scaling, and why."""
        mode = "fp32" if self.dtype is None else f"{self.name} autocast (fp32 weights)"
        why = f" ({self.why})" if self.why else ""
        if self.device_type != "cuda":
            return f"precision: forward pass in {mode} on {device}{why}"
        scaling = "dynamic loss scaling (GradScaler)" if self.dtype == torch.float16 else "no loss scaling"
        return f"precision: forward pass in {mode}, TF32 {'on' if self.tf32 else 'off'}, {scaling} on {device}{why}"


# ---------------------------------------------------------------- hardware


def _cpu_flags() -> str:
    """The flags line of /proc/cpuinfo ("" where there is none)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""
    found = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    return found.group(1) if found else ""


def native_bf16(device: torch.device) -> bool:
    """True on GPUs with bf16 units, and on CPUs with them (AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", _cpu_flags()) is not None


def hardware_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The low-precision dtype the hardware runs natively: bf16 where it has bf16 units, fp16
    on GPUs without them, None (fp32) on CPUs without them."""
    if native_bf16(device):
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else None


def autocast_for(device: torch.device, bf16: bool) -> Callable[[], ContextManager]:
    """The hardware's own autocast, unmeasured (benchmarks comparing a fixed precision)."""
    dtype = hardware_dtype(device) if bf16 else None
    return contextlib.nullcontext if dtype is None else Precision(device.type, dtype).autocast


def _tf32(device: torch.device, wanted: bool) -> tuple[bool, str]:
    """(TF32 on, why not) for fp32 matmuls on `device`."""
    if device.type != "cuda":
        return False, ""
    if not wanted:
        return False, "train.tf32=false"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"no TF32 before compute capability 8.0; this GPU has {major}.{minor}"
    return True, ""


def _cuda_choice(device: torch.device, tf32_wanted: bool) -> Precision:
    """bf16 where the GPU has bf16 units, else fp16 (low precision allowed, nothing pinned)."""
    tf32, tf32_why = _tf32(device, tf32_wanted)
    dtype = hardware_dtype(device)
    why = "no bf16 units" if dtype == torch.float16 else ""
    return Precision("cuda", dtype, tf32, "; ".join(filter(None, [why, tf32_why])))


# ---------------------------------------------------------------- the CPU probe


@dataclass(frozen=True)
class ProbeShape:
    """The run's steps as the probe times them: torch threads per worker, workers busy at once,
    and batches of (rows, source width, target width) as the run's loader cuts them from rows of
    the run's lengths (`batch_shapes`: spread over the widths, as the run's batches are)."""

    threads: int = 1
    workers: int = 1
    max_tokens: int = PROBE_MAX_TOKENS
    shapes: tuple[tuple[int, int, int], ...] = (
        (PROBE_MAX_TOKENS // (PROBE_ROW_LEN + 1), PROBE_ROW_LEN + 1, PROBE_ROW_LEN + 1),
    )

    @classmethod
    def of_run(
        cls, cfg: Config, threads: int, workers: int, widths: Optional[Sequence[tuple[int, int]]] = None
    ) -> "ProbeShape":
        """A run's shape from `widths` (`row_widths` of its validation rows; without: rows of 20
        and 20 tokens), cut into batches of data.max_tokens (at most RUN_MAX_TOKENS)."""
        max_tokens = min(cfg.data.max_tokens, RUN_MAX_TOKENS)
        longest = cfg.data.max_len + 1
        pairs = [(min(s, longest), min(t, longest)) for s, t in widths or ((PROBE_ROW_LEN + 1,) * 2,)]
        return cls(
            threads, workers, max_tokens, batch_shapes(pairs, max_tokens, cfg.data, PROBE_BATCHES if widths else 1)
        )

    @property
    def key(self) -> str:
        """The part of a probe's cache key that this shape decides."""
        rows = ",".join(f"{b}x{s}x{t}" for b, s, t in self.shapes)
        return f"probe{PROBE_VERSION} threads{self.threads} workers{self.workers} batch{self.max_tokens}:{rows}"

    def batches(self, vocab_size: int, target_vocab_size: Optional[int] = None) -> list[Batch]:
        """Random ids (above the special ones; targets below `target_vocab_size`, default the
        source's), one batch of each shape, no padding."""
        out = []
        for rows, src_width, tgt_width in self.shapes:
            src = torch.randint(4, vocab_size, (rows, src_width - 1)).tolist()
            tgt = torch.randint(4, target_vocab_size or vocab_size, (rows, tgt_width - 1)).tolist()
            out.append(collate([s + [3] for s in src], tgt))  # 3: EOS ends a source; BOS/EOS the target
        return out


def row_widths(rows: Sequence[dict]) -> Optional[tuple[tuple[int, int], ...]]:
    """(source, target) widths of raymt.data.format's rows as a batch pads them (source with its
    EOS, target with BOS/EOS); None for no rows."""
    return tuple((len(r["src_ids"]), len(r["tgt_ids"]) + 1) for r in rows) or None


def batch_shapes(
    widths: Sequence[tuple[int, int]], max_tokens: int, data: DataConfig, k: int = PROBE_BATCHES
) -> tuple[tuple[int, int, int], ...]:
    """(rows, source width, target width) of `k` batches as the run's loader cuts them
    (`token_budget_batches`, the run's padding rules) from a window of rows drawn from `widths`,
    at quantiles (i + 1/2) / k of the batches sorted by width (they share the tokens out evenly).
    bf16's gain jumps between neighbouring widths (the default model: 1.48x at 10 and 9 tokens,
    0.71x at 11 and 11; torch 2.13's bf16 flash-attention backward on a CPU costs ~7x fp32's
    from 12 tokens on): the probe samples the run's mix of them, source and target widths together."""
    rng = np.random.default_rng(0)
    pool = np.asarray(widths, dtype=np.int64).reshape(-1, 2)
    mean = float(np.maximum(pool[:, 0], pool[:, 1]).mean())
    picked = pool[rng.integers(0, len(pool), max(1, int(PROBE_WINDOW_BATCHES * max_tokens / mean)))]
    ladder = ShapeLadder.from_config(data)
    cut = token_budget_batches(picked[:, 0], picked[:, 1], max_tokens, rng, data.pad_multiple, ladder)
    shapes = []
    for rows in cut:
        src, tgt = int(picked[rows, 0].max()), int(picked[rows, 1].max())
        if ladder is not None:  # every batch padded to its rung's (rows, width)
            num, width = ladder.shape(max(src, tgt))
            shapes.append((num, width, width))
        else:
            shapes.append((len(rows), round_up(src, data.pad_multiple), round_up(tgt, data.pad_multiple)))
    shapes.sort(key=lambda b: (max(b[1:]), b[1], b[2], b[0]))
    return tuple(shapes[min(len(shapes) - 1, int((i + 0.5) * len(shapes) / k))] for i in range(k))


def cache_path() -> Path:
    """The JSON file of CPU probe results: $RAYMT_PRECISION_CACHE or ~/.cache/raymt/precision.json."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "raymt" / "precision.json")


def probe_key(model_cfg: ModelConfig, vocab_size: int, shape: Optional[ProbeShape] = None) -> str:
    """What a probe result holds for: this CPU (model name and flags), torch and the kernels it
    dispatches to (ATEN_CPU_CAPABILITY), the model's shape, and with `shape` the run's threads,
    workers and batch (without: a one-process measurement)."""
    try:
        name = re.search(r"^model name\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        name = None
    flags = hashlib.sha1(" ".join(sorted(_cpu_flags().split())).encode()).hexdigest()[:10]
    m = model_cfg
    key = (
        f"{name.group(1).strip() if name else 'cpu'} flags:{flags} torch:{torch.__version__} "
        f"d{m.d_model} h{m.num_heads} ff{m.d_ff} enc{m.num_encoder_layers} dec{m.num_decoder_layers} "
        f"{m.activation} {'pre' if m.pre_norm else 'post'}-norm vocab{vocab_size}"
    )
    if shape is None:
        return key
    return f"{key} {torch.backends.cpu.get_cpu_capability()} {shape.key}"


def read_cache() -> dict[str, float]:
    """The cached probe results (bf16 speed / fp32 speed by `probe_key`); {} if none or unreadable."""
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def write_cache(key: str, speedup: float) -> None:
    """Record a probe result (atomically: concurrent runs read a whole file)."""
    path = cache_path()
    cache = {**read_cache(), key: round(speedup, 3)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only home: the next run measures again
        pass


def _allreduce_seconds(model: torch.nn.Module, collective: Collective) -> float:
    """The fastest of three all-reduces of the model's gradients (fp32 in either precision), the
    slowest worker's: the share of a step that bf16 does not change (0 for one worker), the same
    figure on every worker."""
    if collective.world_size == 1:
        return 0.0
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        collective.all_reduce_sum_async(flat).wait()
        times.append(time.perf_counter() - t0)
    return max(collective.all_gather_object(min(times)))  # each worker timed its own wait


def measure_bf16_speedup(
    cfg: Config,
    vocab_size: int,
    shape: Optional[ProbeShape] = None,
    collective: Collective = SINGLE,
    budget_s: float = PROBE_BUDGET_S,
) -> float:
    """bf16-autocast speed / fp32 speed of the run's training step (forward, backward, clip,
    AdamW) for its model on `shape`'s batches (without: one of PROBE_MAX_TOKENS in 20-token
    rows), on every worker of `collective` at once: each pass over the batches starts together,
    a batch takes its slowest worker (the run steps in lockstep), the gradient all-reduce is
    added to both. Passes alternate fp32/bf16 (ABBA), at least two of each; per batch the
    fastest counts (the first pass sets kernels up). Every worker returns the same ratio."""
    shape = shape or ProbeShape.of_run(cfg, torch.get_num_threads(), 1)  # one batch of 20-token rows
    with torch.random.fork_rng(devices=[]):  # the run's weights and dropout stay as without a probe
        torch.manual_seed(0)
        model = build_model(cfg.model, vocab_size)
        optimizer = make_optimizer(model, cfg.optim)
        batches = shape.batches(vocab_size, model.target_vocab_size)

        def seconds(dtype: Optional[torch.dtype]) -> list[float]:
            collective.all_gather_object(None)  # every worker starts the pass together
            times = []
            for batch in batches:
                t0 = time.process_time()  # CPU time: what other processes' load does not change
                train_step(model, optimizer, [batch], batch.num_tokens, cfg, Precision("cpu", dtype).autocast)
                times.append(time.process_time() - t0)
            return times

        passes = [(seconds(None), seconds(torch.bfloat16))]  # (fp32, bf16) seconds per batch
        first = max(collective.all_gather_object(sum(map(sum, passes[0]))))
        for r in range(1, max(2, min(4, 1 + int(budget_s / max(first, 1e-3))))):  # the same on every worker
            if r % 2:
                bf16 = seconds(torch.bfloat16)
                passes.append((seconds(None), bf16))
            else:
                passes.append((seconds(None), seconds(torch.bfloat16)))
        shared = _allreduce_seconds(model, collective)
    ranks = collective.all_gather_object(passes)

    def total(which: int) -> float:
        slowest = [[max(rank[r][which][b] for rank in ranks) for b in range(len(batches))] for r in range(len(passes))]
        return sum(min(times[b] for times in slowest) + shared for b in range(len(batches)))

    return total(0) / total(1)


def cpu_bf16_speedup(
    cfg: Config,
    vocab_size: int,
    measure: bool = True,
    shape: Optional[ProbeShape] = None,
    collective: Collective = SINGLE,
) -> tuple[Optional[float], bool]:
    """(bf16 speed / fp32 speed for this CPU, model and `shape`, whether it came from the cache):
    rank 0's cache answers for every worker; else, with `measure`, every worker probes at once
    and rank 0 caches the result; else (None, False)."""
    key = probe_key(cfg.model, vocab_size, shape)
    cached = collective.all_gather_object(read_cache().get(key) if collective.rank == 0 else None)[0]
    if cached is not None:
        return float(cached), True
    if not measure:
        return None, False
    speedup = measure_bf16_speedup(cfg, vocab_size, shape, collective)
    if collective.rank == 0:
        write_cache(key, speedup)
    return speedup, False


def _cpu_choice(cfg: Config, vocab_size: int, shape: Optional[ProbeShape], collective: Collective) -> Precision:
    """bf16 on a CPU with bf16 units where the probe finds it pays, else fp32, and why."""
    speedup, cached = cpu_bf16_speedup(cfg, vocab_size, True, shape, collective)
    dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else None
    workers = f" with {shape.workers} workers of {shape.threads} threads" if shape and shape.workers > 1 else ""
    return Precision(
        "cpu",
        dtype,
        False,
        f"bf16 measured {speedup:.2f}x fp32 for this model{workers}{'; cached' if cached else ''}"
        + ("" if dtype else f"; bf16 needs {BF16_MIN_SPEEDUP:.2f}x"),
    )


# ---------------------------------------------------------------- the choices


def _pinned(device: torch.device, cfg: Config, kept: Optional[dict]) -> Optional[Precision]:
    """The precision train.bf16=false or train.precision pins, else None (auto)."""
    wanted = cfg.train.precision
    if wanted == "auto" and cfg.train.bf16:
        return None
    why = "train.bf16=false" if not cfg.train.bf16 else f"train.precision={wanted}"
    dtype = None if not cfg.train.bf16 else DTYPES[wanted]
    if kept and kept.get("name") != Precision(device.type, dtype).name:
        why += f"; the checkpoint trained in {kept.get('name')}"
    if device.type == "cuda":
        tf32, tf32_why = _tf32(device, cfg.train.tf32)
        return Precision("cuda", dtype, tf32, "; ".join(filter(None, [why, tf32_why])))
    if dtype == torch.bfloat16 and not native_bf16(device):
        why += " (no bf16 units: emulated)"
    return Precision("cpu", dtype, False, why)


def _settled(device: torch.device, cfg: Config, kept: Optional[dict]) -> Optional[Precision]:
    """The training precision where no probe is needed: pinned, kept from the checkpoint (on
    the same kind of device), a GPU's, a CPU's without bf16 units; None: the probe decides."""
    pinned = _pinned(device, cfg, kept)
    if pinned is not None:
        return pinned
    if kept and kept.get("device_type") == device.type and kept.get("name") in DTYPES:
        tf32, tf32_why = _tf32(device, cfg.train.tf32)
        why = f"as the checkpoint recorded: {kept.get('why') or kept['name']}"
        return Precision(device.type, DTYPES[kept["name"]], tf32, "; ".join(filter(None, [why, tf32_why])))
    if device.type == "cuda":
        return _cuda_choice(device, cfg.train.tf32)
    if not native_bf16(device):
        return Precision("cpu", None, False, "no bf16 units: neither avx512_bf16 nor amx_bf16")
    return None


def for_training(
    device: torch.device,
    cfg: Config,
    vocab_size: int,
    shape: Optional[ProbeShape] = None,
    collective: Collective = SINGLE,
    kept: Optional[dict] = None,
) -> Precision:
    """The training precision of `cfg` on `device`: pinned, else `kept` (a checkpoint's record),
    else the hardware's, on a CPU with bf16 units probed (every worker of `collective` at once,
    with `shape`) or cached. Every worker calls it; rank 0's answer is the one to take."""
    chosen = _settled(device, cfg, kept)
    if collective.all_gather_object(chosen is None)[0]:  # rank 0 probes: every worker times with it
        chosen = _cpu_choice(cfg, vocab_size, shape, collective)
    return chosen


def for_inference(device: torch.device | str, cfg: Config, vocab_size: int) -> Precision:
    """Decoding (the test set, translate, evaluate): training's dtype on a GPU (no scaler needed);
    fp32 on a CPU, where no decoding measurement found bf16 faster and it changes outputs."""
    device = torch.device(device)
    if device.type == "cuda":
        return _pinned(device, cfg, None) or _cuda_choice(device, cfg.train.tf32)
    return Precision("cpu", None, False, "decoding on a CPU: fp32")
