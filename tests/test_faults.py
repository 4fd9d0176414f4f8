"""Faults: non-finite updates are skipped; a killed driver's run resumes from its checkpoint."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from raymt.batching import collate
from raymt.config import Config, tiny
from raymt.model import Transformer
from raymt.optim import make_optimizer
from raymt.worker import train_step


def test_nonfinite_update_is_skipped_then_training_goes_on():
    cfg = Config(model=tiny())
    torch.manual_seed(0)
    model = Transformer(cfg.model, 64)
    batch = collate([[5, 6, 3], [9, 3]], [[7, 8], [10]])
    with torch.no_grad():
        model.embed.weight[5] = float("inf")  # every row through token 5 turns into NaN
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, cfg.optim)

    loss, applied = train_step(model, optimizer, [batch], batch.num_tokens, cfg)
    assert not applied and not math.isfinite(loss)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True)
    assert not optimizer.state  # Adam's moments were not touched either
    assert all(p.grad is None for p in model.parameters())

    with torch.no_grad():
        model.embed.weight[5] = 0.1
    loss, applied = train_step(model, optimizer, [batch], batch.num_tokens, cfg)
    assert applied and math.isfinite(loss) and optimizer.state


@pytest.mark.timeout(600)
def test_killed_driver_then_resume_continues_from_latest_checkpoint(tmp_path):
    """SIGKILL the driver (and the local Ray it started) mid-run; --resume RUN finishes it."""
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(tiny_run(tmp_path, "killed", 400), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_checkpoints(run_dir, 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and every process of its local Ray
    proc.wait()
    steps = [torch.load(p, weights_only=True)["step"] for p in run_dir.glob("checkpoint_*/train_state.pt")]
    assert steps and max(steps) < 400

    out = subprocess.run([sys.executable, "-m", "raymt.train", "--resume", str(run_dir),
                          "--max-steps", str(max(steps) + 40)], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [int(m) for m in re.findall(r"step (\d+)/", out.stdout + out.stderr)]
    assert logged and min(logged) > 20  # it did not start over (a fresh run logs step 20 first)
    assert f"step {max(steps) + 40}/" in out.stdout + out.stderr


def tiny_run(storage, name: str, max_steps: int, *extra: str) -> list[str]:
    """A `python -m raymt.train` command line for a tiny 2-worker run checkpointing every 20 steps."""
    return [sys.executable, "-m", "raymt.train", "--storage-path", str(storage), "--name", name,
            "--preset", "tiny", "--num-workers", "2", "--max-steps", str(max_steps),
            "--set", "train.eval_every=20", "--set", "train.log_every=20",
            "--set", "data.vocab_size=256", "--set", "data.builtin_train_size=800",
            "--set", "data.builtin_eval_size=30", "--set", "data.max_tokens=256", *extra]


def wait_for_checkpoints(run_dir, count: int, proc, timeout: float = 300) -> None:
    """Block until Ray Train has registered `count` checkpoints in the run's snapshot."""
    deadline = time.time() + timeout
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    while not snapshot.is_file() or len(json.loads(snapshot.read_text())["checkpoint_results"]) < count:
        assert time.time() < deadline and proc.poll() is None, "no checkpoint before the kill"
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_killed_worker_is_restarted_from_the_last_checkpoint(tmp_path):
    """SIGKILL one training worker mid-run: FailureConfig restarts the group and the run ends."""
    log = tmp_path / "train.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(tiny_run(tmp_path, "worker", 200, "--set", "train.max_failures=1"),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for_checkpoints(tmp_path / "worker", 1, proc)
    pids = subprocess.run(["pgrep", "-f", "RayTrainWorker"], capture_output=True, text=True).stdout.split()
    assert pids, "no training worker process found"
    os.kill(int(pids[0]), signal.SIGKILL)
    proc.wait(timeout=400)
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    logged = [int(m) for m in re.findall(r"step (\d+)/200", out)]
    restart = next(i for i in range(1, len(logged)) if logged[i] <= logged[i - 1])
    assert logged[restart] > 20  # the new worker group started from a checkpoint, not step 0
    assert "resuming at step" in out
    assert logged[-1] == 200
