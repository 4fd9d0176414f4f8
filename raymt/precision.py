"""Which precision a run computes in: the autocast dtype, loss scaling and TF32, and why.

Training (`for_training`), with `train.bf16` (low precision allowed) on:
- a GPU with bf16 units (compute capability >= 8.0): bf16 autocast, no loss scaling;
- an older GPU (V100, T4): fp16 autocast with `torch.amp.GradScaler` (dynamic loss scaling);
- a CPU with bf16 units (AVX512-BF16, AMX): bf16 autocast only where it pays: a short timed
  probe of the training step (forward, backward, AdamW) of the run's model shape, fp32
  against bf16, cached per machine and model shape in a JSON file (`$RAYMT_PRECISION_CACHE`,
  default ~/.cache/raymt/precision.json);
- any other CPU: fp32.
`train.bf16=false` means fp32 everywhere. Weights, loss and optimizer stay fp32 throughout.
TF32 (fp32 matmuls and convolutions on tensor cores) is on for GPUs of compute capability
>= 8.0 unless `train.tf32=false`.

Inference (`for_inference`: validation, test set, translate, evaluate) autocasts to the same
dtype with no scaler; on a CPU it only reads the probe's cached result (never runs it), so a
CPU without a measured gain decodes in fp32.
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
from typing import Callable, ContextManager, Optional

import torch

from raymt.batching import collate
from raymt.config import Config, ModelConfig
from raymt.model import build_model
from raymt.optim import make_optimizer
from raymt.trainer import train_step

CACHE_ENV = "RAYMT_PRECISION_CACHE"
# bf16 rounds activations to 8 mantissa bits: on a CPU it has to buy at least this much speed.
BF16_MIN_SPEEDUP = 1.05
PROBE_BUDGET_S = 1.5  # the CPU probe's timed part; a warm-up pass of each precision comes on top
PROBE_ROW_LEN = 20  # tokens per source and target row of the probe's batch (a sentence's)
PROBE_MAX_TOKENS = 2048  # the probe's batch: data.max_tokens, at most this (a pass stays short)


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


def _cuda_choice(device: torch.device, allowed: bool, tf32_wanted: bool) -> Precision:
    """bf16 where the GPU has bf16 units, else fp16; fp32 when low precision is not allowed."""
    tf32, tf32_why = _tf32(device, tf32_wanted)
    if not allowed:
        return Precision("cuda", None, tf32, "; ".join(filter(None, ["train.bf16=false", tf32_why])))
    dtype = hardware_dtype(device)
    why = "no bf16 units" if dtype == torch.float16 else ""
    return Precision("cuda", dtype, tf32, "; ".join(filter(None, [why, tf32_why])))


# ---------------------------------------------------------------- the CPU probe


def cache_path() -> Path:
    """The JSON file of CPU probe results: $RAYMT_PRECISION_CACHE or ~/.cache/raymt/precision.json."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "raymt" / "precision.json")


def probe_key(model_cfg: ModelConfig, vocab_size: int) -> str:
    """What a probe result holds for: this CPU (model name and flags), torch, the model's shape."""
    try:
        name = re.search(r"^model name\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        name = None
    flags = hashlib.sha1(" ".join(sorted(_cpu_flags().split())).encode()).hexdigest()[:10]
    m = model_cfg
    return (
        f"{name.group(1).strip() if name else 'cpu'} flags:{flags} torch:{torch.__version__} "
        f"d{m.d_model} h{m.num_heads} ff{m.d_ff} enc{m.num_encoder_layers} dec{m.num_decoder_layers} "
        f"{m.activation} {'pre' if m.pre_norm else 'post'}-norm vocab{vocab_size}"
    )


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


def measure_bf16_speedup(cfg: Config, vocab_size: int, budget_s: float = PROBE_BUDGET_S) -> float:
    """bf16-autocast speed / fp32 speed of the run's training step (forward, backward, clip,
    AdamW) for its model shape on the CPU, on a batch of data.max_tokens tokens (at most
    PROBE_MAX_TOKENS), timed in alternation (the fastest pass of each)."""
    with torch.random.fork_rng(devices=[]):  # the run's weights and dropout stay as without a probe
        torch.manual_seed(0)
        model = build_model(cfg.model, vocab_size)
        optimizer = make_optimizer(model, cfg.optim)
        length = min(PROBE_ROW_LEN, cfg.data.max_len)
        rows = max(1, min(cfg.data.max_tokens, PROBE_MAX_TOKENS) // (length + 1))
        ids = torch.randint(4, vocab_size, (2, rows, length)).tolist()  # ids above the special ones
        batch = collate(ids[0], ids[1])

        def seconds(dtype: Optional[torch.dtype]) -> float:
            t0 = time.perf_counter()
            train_step(model, optimizer, [batch], batch.num_tokens, cfg, Precision("cpu", dtype).autocast)
            return time.perf_counter() - t0

        warm = seconds(None) + seconds(torch.bfloat16)  # allocations, oneDNN kernel set-up
        reps = max(1, min(5, int(budget_s / max(warm, 1e-3))))  # one each for a model too big to time more
        fp32, bf16 = zip(*[(seconds(None), seconds(torch.bfloat16)) for _ in range(reps)])
    return min(fp32) / min(bf16)


def cpu_bf16_speedup(cfg: Config, vocab_size: int, measure: bool = True) -> tuple[Optional[float], bool]:
    """(bf16 speed / fp32 speed for this CPU and model shape, whether it came from the cache);
    measured and cached when not cached and `measure`, else (None, False)."""
    key = probe_key(cfg.model, vocab_size)
    cached = read_cache().get(key)
    if cached is not None:
        return float(cached), True
    if not measure:
        return None, False
    speedup = measure_bf16_speedup(cfg, vocab_size)
    write_cache(key, speedup)
    return speedup, False


def _cpu_choice(cfg: Config, vocab_size: int, measure: bool) -> Precision:
    """bf16 on a CPU with bf16 units where the probe finds it pays, else fp32, and why."""
    if not cfg.train.bf16:
        return Precision("cpu", None, False, "train.bf16=false")
    if not native_bf16(torch.device("cpu")):
        return Precision("cpu", None, False, "no bf16 units: neither avx512_bf16 nor amx_bf16")
    speedup, cached = cpu_bf16_speedup(cfg, vocab_size, measure)
    if speedup is None:
        return Precision("cpu", None, False, "bf16 not measured for this model")
    dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else None
    return Precision(
        "cpu",
        dtype,
        False,
        f"bf16 measured {speedup:.2f}x fp32 for this model{'; cached' if cached else ''}"
        + ("" if dtype else f"; bf16 needs {BF16_MIN_SPEEDUP:.2f}x"),
    )


# ---------------------------------------------------------------- the choices


def for_training(device: torch.device, cfg: Config, vocab_size: int) -> Precision:
    """The training precision of `cfg` on `device` (on a CPU with bf16 units: probed or cached)."""
    if device.type == "cuda":
        return _cuda_choice(device, cfg.train.bf16, cfg.train.tf32)
    return _cpu_choice(cfg, vocab_size, measure=True)


def for_inference(device: torch.device | str, cfg: Config, vocab_size: int) -> Precision:
    """Validation and decoding: training's dtype on a GPU (no scaler needed); on a CPU bf16
    only where a cached probe found it pays (never probes)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_choice(device, cfg.train.bf16, cfg.train.tf32)
    return _cpu_choice(cfg, vocab_size, measure=False)
