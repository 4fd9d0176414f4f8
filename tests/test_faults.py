"""Faults: non-finite updates are skipped; killed drivers and workers resume exactly."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import REFERENCE_STEPS, init_flags, tiny_run
from tiny_checkpoint import make_checkpoint, tokenizer

from raymt import compare, train
from raymt.batching import collate
from raymt.checkpoint import RAY_SNAPSHOT_FILE
from raymt.compare import checkpoint_at, trained_pairs
from raymt.config import Config, tiny
from raymt.model import Transformer
from raymt.optim import make_optimizer
from raymt.rundir import RunDir, finalize
from raymt.trainer import train_step


@pytest.mark.parametrize("fused", [True, False])  # skipped on the device / after a host check
def test_nonfinite_update_is_skipped_then_training_goes_on(fused):
    cfg = Config(model=tiny())
    torch.manual_seed(0)
    model = Transformer(cfg.model, 64)
    batch = collate([[5, 6, 3], [9, 3]], [[7, 8], [10]])
    with torch.no_grad():
        model.embed.weight[5] = float("inf")  # every row through token 5 turns into NaN
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, cfg.optim, fused=fused)

    loss, applied = train_step(model, optimizer, [batch], batch.num_tokens, cfg)
    assert applied.item() == 0 and not math.isfinite(loss.item())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True)
    # Adam's moments and step count were not touched either (fused AdamW creates them at zero).
    for state in optimizer.state.values():
        assert state["step"].item() == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert fused or not optimizer.state
    assert all(p.grad is None for p in model.parameters())

    with torch.no_grad():
        model.embed.weight[5] = 0.1
    loss, applied = train_step(model, optimizer, [batch], batch.num_tokens, cfg)
    assert applied.item() == 1 and math.isfinite(loss.item()) and optimizer.state
    assert all(state["step"].item() == 1 for state in optimizer.state.values())


STEPS = REFERENCE_STEPS


def wait_until(value, proc, timeout: float = 300):
    """Poll `value()` until it is truthy and return it; fail if the run ends or time runs out."""
    deadline = time.time() + timeout
    while not (got := value()):
        assert time.time() < deadline and proc.poll() is None, "the run ended before the fault"
        time.sleep(0.2)
    return got


def checkpoint_steps(run_dir) -> list[int]:
    """Steps of the checkpoints in Ray Train's snapshot; [] while it is missing or half-written."""
    try:  # Ray rewrites the file in place: a read can see it empty or cut short
        snapshot = json.loads((run_dir / RAY_SNAPSHOT_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return [r["metrics"]["step"] for r in snapshot["checkpoint_results"]]


def group_starts(run_dir) -> list[int]:
    """The step at which each attempt of the worker group started (rank 0's trace)."""
    return [step for step, _, _ in compare.group_starts(run_dir)]


def final_weights(run_dir, steps: int = STEPS) -> dict:
    """The weights of the run's checkpoint at its last step (`steps`)."""
    return torch.load(checkpoint_at(run_dir, steps) / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(reference_run):
    """The session's uninterrupted run: its final weights and the pairs it trained on at each step."""
    assert reference_run.returncode == 0, reference_run.stderr[-3000:]
    return final_weights(reference_run.dir), trained_pairs(reference_run.dir)


def assert_mid_epoch(checkpoint) -> None:
    """The checkpoint a run resumed from was written in the middle of an epoch."""
    state = torch.load(checkpoint / "train_state.pt", weights_only=True)
    assert all(
        p["epoch"] == state["epoch"] and (p["chunk"], p["batches"]) != (0, 0) for p in state["data_positions"]
    ), state["data_positions"]


def assert_same_as_reference(run_dir, reference, steps: int = STEPS) -> None:
    """Identical parameters at step `steps`, and exactly the same pairs at every step up to it and
    in every epoch (a run resumed with a larger --max-steps goes on after it)."""
    weights, pairs = reference
    got = final_weights(run_dir, steps)
    assert got.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(got[name], value), name
    seen = {key: rows for key, rows in trained_pairs(run_dir).items() if key[1] <= steps}
    assert seen == pairs
    per_epoch = lambda p: Counter((e, d) for rows in p.values() for e, d in rows)
    assert per_epoch(seen) == per_epoch(pairs)


@pytest.mark.hosts  # exact resume
@pytest.mark.slow  # ~75 s: a run killed twice and resumed (CI runs it: .ci/run)
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_killed_worker_then_killed_driver_resume_exactly(tmp_path, reference, ray_address):
    """SIGKILL a training worker mid-epoch: FailureConfig restarts the group from the last
    checkpoint. Then SIGKILL the driver: `--resume RUN --max-steps 90` finishes the run and goes
    on. At step 80 it has the parameters of an uninterrupted run, each pair trained once at the
    same step."""
    run_dir = tmp_path / "faults"
    command = tiny_run(tmp_path, "faults", STEPS, "--set", "train.max_failures=1")
    restart, latest = kill_worker_then_driver(command, run_dir, ray_address, STEPS)

    # --resume RUN with a larger --max-steps: on from the latest checkpoint, past the old end.
    out = subprocess.run(
        [sys.executable, "-m", "raymt.train", "--resume", str(run_dir), "--max-steps", str(STEPS + 10)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [int(m) for m in re.findall(r"step (\d+)/", out.stdout + out.stderr)]
    assert logged and min(logged) > latest and f"step {STEPS + 10}/{STEPS + 10}" in out.stdout + out.stderr
    assert group_starts(run_dir) == [0, restart, latest]
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["curves_step.png", "curves_time.png"]
    assert_same_as_reference(run_dir, reference)


@pytest.fixture(scope="module")
def init_reference(init_run):
    """The session's uninterrupted --init run: its final weights and the pairs it trained on at each step."""
    assert init_run.returncode == 0, init_run.stderr[-3000:]
    return final_weights(init_run.dir), trained_pairs(init_run.dir)


@pytest.mark.hosts  # exact resume
@pytest.mark.slow  # ~90 s: the uninterrupted --init run, then one killed twice and resumed (CI runs it)
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_killed_init_run_resumes_exactly(tmp_path, init_reference, reference_run, ray_address):
    """A run started with --init (conftest.init_run's command) whose worker, then driver, is
    SIGKILLed: the restarted group and `--resume RUN` go on from the run's own checkpoints, not
    from the starting weights again, and end with the uninterrupted --init run's weights and pairs."""
    run_dir = tmp_path / "init-faults"
    command = tiny_run(tmp_path, "init-faults", STEPS, *init_flags(reference_run), "--set", "train.max_failures=1")
    restart, latest = kill_worker_then_driver(command, run_dir, ray_address, STEPS)
    out = subprocess.run(
        [sys.executable, "-m", "raymt.train", "--resume", str(run_dir)], capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert group_starts(run_dir) == [0, restart, latest]
    assert_same_as_reference(run_dir, init_reference)


def test_a_resume_before_the_first_checkpoint_starts_from_the_init_checkpoint_again(tmp_path, monkeypatch):
    """A driver killed before an --init run's first checkpoint: `--resume RUN` starts from the
    checkpoint the run started from (its init_checkpoint.json), not from new weights; once the run
    registered a checkpoint of its own, Ray Train continues from that one instead."""
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    argv = ["--init", str(checkpoint), "--storage-path", str(tmp_path), "--name", "run", "--preset", "tiny"]
    cfg, _, start = train.resolve_resume(train.parse_args(argv))
    RunDir(tmp_path / "run").write_run_files(finalize(cfg), tokenizer(), start)
    handed = []

    def stop(cfg, run_dir, resume_dir, init_checkpoint):
        handed.append(init_checkpoint)
        raise KeyboardInterrupt  # the run's first step after the checks

    monkeypatch.setattr(train, "plan_data", stop)
    for _ in range(2):
        cfg, resume_dir, _ = train.resolve_resume(train.parse_args(["--resume", str(tmp_path / "run")]))
        with pytest.raises(KeyboardInterrupt):
            train.run(cfg, resume_dir)
        snapshot = {"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_x", "metrics": {"step": 20}}]}
        (tmp_path / "run" / RAY_SNAPSHOT_FILE).write_text(json.dumps(snapshot))
    assert handed == [str(checkpoint), None]


def kill_worker_then_driver(command: list[str], run_dir: Path, ray_address, steps: int) -> tuple[int, int]:
    """Run `command`; SIGKILL a training worker mid-epoch (FailureConfig restarts the group from the
    last checkpoint), then the driver. Returns (restart step, latest checkpoint step), both mid-epoch."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: checkpoint_steps(run_dir), proc)
    pids = ray_address.train_workers()
    assert pids, "no training worker process found"
    os.kill(pids[0], signal.SIGKILL)
    # The new worker group started from a checkpoint written in the middle of an epoch.
    restart = wait_until(lambda: group_starts(run_dir)[1:], proc)[0]
    assert 0 < restart < steps
    assert_mid_epoch(checkpoint_at(run_dir, restart))
    wait_until(lambda: max(checkpoint_steps(run_dir)) > restart, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ray_address.wait_idle()  # Ray ends the dead driver's job: its controller, workers and CPUs
    latest = max(checkpoint_steps(run_dir))
    assert restart < latest < steps
    assert_mid_epoch(checkpoint_at(run_dir, latest))
    return restart, latest


def test_ray_trains_print_of_a_workers_one_line_error_is_dropped_and_others_kept():
    """Ray Train's own call (in the worker, as its training thread catches the exception) logs a
    ValueError's traceback no more once quiet_user_errors ran; any other error's it still does."""
    import logging

    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    from raymt.ray_console import RAY_TRAIN_ERROR_LOGGER, quiet_user_errors

    logger, printed = logging.getLogger(RAY_TRAIN_ERROR_LOGGER), []
    handler = logging.Handler()
    handler.emit = lambda record: printed.append(record.getMessage())
    logger.addHandler(handler)
    saved = list(logger.filters)
    try:
        quiet_user_errors()
        quiet_user_errors()  # once per process: a restarted group's worker calls it again
        assert len(logger.filters) == len(saved) + 1
        for err in (ValueError("CUDA out of memory at step 1 ..."), RuntimeError("a bug")):
            try:
                raise err
            except Exception as caught:
                wrapped = construct_user_exception_with_traceback(caught)
            assert "Traceback" in str(wrapped)  # what the driver's error still carries
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = saved
    assert len(printed) == 1 and "RuntimeError: a bug" in printed[0], printed


# A `python -m raymt.train` whose Ray workers raise CUDA out of memory in their first step: the fake
# goes to every worker of the run as Ray's worker_process_setup_hook (no GPU needed).
OOM_DRIVER = """
import runpy, sys
import ray

def fake_oom():
    import torch
    import raymt.trainer

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    raymt.trainer.train_step = out_of_memory

def init(*args, runtime_env=None, _init=ray.init, **kwargs):
    return _init(*args, runtime_env={**(runtime_env or {}), "worker_process_setup_hook": fake_oom}, **kwargs)

ray.init = init
sys.argv[0] = "raymt.train"
runpy.run_module("raymt.train", run_name="__main__")
"""


@pytest.mark.slow  # ~25 s: a Ray Train run (CI runs it: .ci/run)
@pytest.mark.ci
@pytest.mark.timeout(400)
def test_cuda_out_of_memory_in_a_worker_is_one_line_without_a_traceback(tmp_path, ray_address):
    """A worker's CUDA out-of-memory: the console shows raymt's one line naming the token budget,
    and no traceback (neither Ray Train's print of the worker's error nor the driver's)."""
    argv = tiny_run(tmp_path, "oom", 5, "--num-workers", "1", "--set", "train.precision=fp32")[3:]
    out = subprocess.run(
        [sys.executable, "-c", OOM_DRIVER, *argv], capture_output=True, text=True, timeout=360, env=dict(os.environ)
    )
    console = out.stdout + out.stderr
    assert out.returncode == 2, console[-3000:]
    assert "raymt.train: error: CUDA out of memory at step 1 with data.max_tokens=256 per worker" in out.stderr
    assert "OutOfMemoryError" not in console and "Error in training function" not in console, console[-3000:]
    # On an overloaded machine Ray Train's controller warns, with a traceback, that its resource
    # request timed out ("safe to ignore"): Ray's own line, not the run's error. No other traceback.
    overload = "Failed to send resource request" in console
    tracebacks = [line for line in console.splitlines() if "Traceback" in line]
    assert all(overload and "(TrainController" in line for line in tracebacks), console[-3000:]
