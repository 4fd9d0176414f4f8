"""raymt.profiling: the step profiler's window, its tables and its trace (plain PyTorch); the
figures benchmarks/gpu_check.py reports: card peaks, the matmul, MFU, FLOPs per token, syncs, metrics.csv rates."""

import json
import warnings

import pytest
import torch
from tiny_checkpoint import one_thread  # noqa: F401

from raymt import profiling
from raymt.batching import collate
from raymt.config import Config, tiny
from raymt.model import Transformer
from raymt.optim import make_optimizer
from raymt.profiling import PARTS, StepProfiler, train_flops
from raymt.trainer import lockstep, train_step


def test_profiler_covers_its_window_and_names_the_step_parts(tmp_path):
    cfg = Config(model=tiny())
    torch.manual_seed(0)
    model = Transformer(cfg.model, 64)
    optimizer = make_optimizer(model, cfg.optim)
    batches = [collate([[5, 6, 7, 3]] * 4, [[8, 9, 10]] * 4) for _ in range(8)]
    profiler = StepProfiler(num_steps=3, start=2, prefix=tmp_path / "profile-rank0")
    for step, (group, num_tokens, _, _) in enumerate(lockstep(batches, 1, torch.device("cpu")), start=1):
        train_step(model, optimizer, group, num_tokens, cfg)
        profiler.after_step(step)
        assert profiler.done == (step >= 5)
    text = (tmp_path / "profile-rank0.txt").read_text()
    assert text.startswith("3 steps, ")
    for part in PARTS:  # every part was recorded, with its own time per step
        line = next(line for line in text.splitlines() if line.startswith(part))
        assert float(line.split()[1]) > 0
    trace = json.loads((tmp_path / "profile-rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "raymt.forward" in names and ("aten::mm" in names or "aten::addmm" in names)
    forwards = [e for e in trace["traceEvents"] if e.get("name") == "raymt.forward"]
    assert len(forwards) == 3  # steps 3, 4, 5 only


def test_profiling_off_writes_nothing(tmp_path):
    profiler = StepProfiler(num_steps=0, start=0, prefix=tmp_path / "p")
    for step in range(5):
        profiler.after_step(step)
    assert profiler.done and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "name, card, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "A100", "bf16", 312.0),
        ("NVIDIA A10G", "A10G", "bf16", 70.0),  # not an A100
        ("NVIDIA L4", "L4", "bf16", 121.0),  # not an L40S
        ("NVIDIA L40S", "L40S", "bf16", 362.0),
        ("Tesla V100-SXM2-16GB", "V100 SXM2", "fp16", 125.0),
        ("Tesla T4", "T4", "fp16", 65.0),
    ],
)
def test_card_peaks_match_device_names(name, card, dtype, tflops):
    assert profiling.card_peak(name) == (card, dtype, tflops)


def test_unknown_card_has_no_peak():
    assert profiling.card_peak("NVIDIA GeForce RTX 4090") is None


@pytest.mark.parametrize(
    "name, capability, dtype, peak",
    [
        ("NVIDIA H200", (9, 0), "bf16", 989.0),
        ("Tesla V100-SXM2-16GB", (7, 0), "fp16", 125.0),
        ("NVIDIA GeForce RTX 4090", (8, 9), "bf16", None),  # unknown: the dtype the card has
        ("Quadro RTX 8000", (7, 5), "fp16", None),
    ],
)
def test_peak_and_matmul_on_a_fake_gpu(monkeypatch, name, capability, dtype, peak):
    """The GPU branch of gpu_check's first part (a mistake there would cost a lent GPU's session)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0))
    monkeypatch.setattr(profiling, "matmul_flops", lambda *a: calls.append(a) or 7e14)
    result = profiling.gpu_peak(0)
    assert (result["gpu"], result["peak_tflops"], result["dtype"]) == (name, peak, dtype)
    assert result["card"] == (profiling.card_peak(name) or (None,))[0]
    assert result["capability"] == "sm_%d%d" % capability
    assert profiling.matmul_tflops("cuda", result["dtype"], 8192) == 700.0
    assert calls == [("cuda", {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], 8192)]


def test_matmul_is_timed_on_the_cpu():
    assert profiling.matmul_tflops("cpu", "fp32", 64) > 0


def test_mfu_is_tokens_times_flops_over_the_rate():
    assert profiling.mfu(1e5, 3e8, 150e12) == pytest.approx(0.2)
    assert profiling.mfu(None, 3e8, 150e12) is None and profiling.mfu(1e5, None, 1.0) is None
    assert profiling.mfu(1e5, 3e8, None) is None


def test_flops_per_token_is_over_the_target_tokens():
    cfg = tiny()
    batches = [collate([[5, 6, 7, 3]] * 4, [[8, 9, 10]] * 4), collate([[5, 3]] * 2, [[8, 9, 10, 11]] * 2)]
    total = sum(train_flops(cfg, 64, b) for b in batches)
    assert profiling.flops_per_token(cfg, 64, batches) == total / sum(b.num_tokens for b in batches)


def test_run_figures_from_metrics_csv(tmp_path):
    """tok/s leaves out the warm-up interval and weighs the others by time; the run's last data_share;
    peak GPU memory when the worker logs it."""
    logged = tmp_path / "metrics.csv"
    logged.write_text(
        "step,tokens_per_s,valid_bleu,data_share,peak_gpu_mb\n25,10,,0.5,100\n50,200,,0.1,300\n100,100,1.5,0.05,310\n"
    )
    figures = profiling.metrics_figures(str(logged))
    # 25 steps at 200 tok/s and 50 at 100 (about as many tokens a step): 75 steps in 0.625 "s".
    assert figures == {"tokens_per_s": pytest.approx(120.0), "steps": 75, "data_share": 0.05, "peak_gpu_mb": 310.0}
    logged.write_text("step,tokens_per_s,data_share\n25,10,0.5\n50,200,0.1\n")
    assert profiling.metrics_figures(str(logged))["peak_gpu_mb"] is None
    logged.write_text("step,tokens_per_s,data_share\n25,10,0.5\n")
    assert "error" in profiling.metrics_figures(str(logged))


def test_syncs_counted_once_each(monkeypatch):
    """Every synchronization counts, the same warning from the same line included."""
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def three_syncs():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)

    assert profiling.count_syncs(three_syncs) == 3
    assert modes == ["warn", "default"]
