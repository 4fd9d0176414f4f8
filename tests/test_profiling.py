"""train.profile_steps: the step profiler's window, its tables and its trace (plain PyTorch)."""

import json

import torch
from tiny_checkpoint import one_thread  # noqa: F401

from raymt.batching import collate
from raymt.config import Config, tiny
from raymt.model import Transformer
from raymt.optim import make_optimizer
from raymt.profiling import PARTS, StepProfiler
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
