"""End to end: `python -m raymt.train` on 2 workers, then `python -m raymt.translate`."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

TINY_RUN = ["--preset", "tiny", "--num-workers", "2", "--max-steps", "40",
            "--set", "train.eval_every=20", "--set", "train.log_every=10",
            "--set", "data.vocab_size=512", "--set", "data.builtin_train_size=1500",
            "--set", "data.builtin_eval_size=60", "--set", "data.max_tokens=512",
            "--set", "optim.warmup_steps=20", "--set", "decode.beam=2"]


# Ray's internal chatter that a default run keeps in Ray's log files (raymt.cluster.init_ray).
RAY_CHATTER = ["gcs_actor_scheduler.cc", "Failed to kill actor", "worker processes have been started",
               "maximum expected startup concurrency", "PreemptionWatcher", "Progress bars disabled",
               "Setting up process group for", "Started training worker group", "Moving model to device",
               "Wrapping provided model in DistributedDataParallel", "Token authentication is enabled",
               "Started a local Ray instance", " INFO ", "Reporting training result",
               "Checkpoint successfully created"]


def run(args, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, **kw)


def test_train_resume_and_translate(tmp_path, ray_address):
    out = run(["raymt.train", "--storage-path", str(tmp_path), "--name", "e2e", *TINY_RUN], timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test BLEU" in out.stdout and "best checkpoint:" in out.stdout
    summary = json.loads((tmp_path / "e2e" / "summary.json").read_text())
    assert 0 <= summary["test"]["bleu"] <= 100 and "nrefs:1" in summary["test"]["bleu_signature"]
    console = out.stdout + out.stderr
    assert "step 40/40" in console and "forward pass in" in console  # rank 0's prints still arrive
    assert [p for p in RAY_CHATTER if p in console] == [], console[-3000:]
    check_live_metrics(tmp_path / "e2e" / "logs")
    plots = tmp_path / "e2e" / "plots"
    assert sorted(p.name for p in plots.iterdir()) == ["curves_step.png", "curves_time.png"]
    first_plot = (plots / "curves_step.png").stat().st_mtime_ns

    # --resume RUN continues from the latest checkpoint (step 40) to the new max_steps.
    out = run(["raymt.train", "--resume", str(tmp_path / "e2e"), "--max-steps", "50"], timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    logs = out.stdout + out.stderr
    assert "step 50/50" in logs and "step 10/50" not in logs
    assert (plots / "curves_step.png").stat().st_mtime_ns > first_plot  # redrawn with both segments

    ckpt = json.loads((tmp_path / "e2e" / "summary.json").read_text())["best_checkpoint"]
    out = run(["raymt.translate", "--checkpoint", ckpt, "--beam", "3",
               "Germany and March 3, 2021", "Monday, July 4, 1999"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2

    ref = tmp_path / "ref.de"
    ref.write_text("Deutschland und 3. März 2021\n")
    out = run(["raymt.translate", "--checkpoint", ckpt, "--ref", str(ref)],
              input="Germany and March 3, 2021\n", timeout=120)
    assert out.returncode == 0 and "BLEU" in out.stderr and "nrefs:1" in out.stderr


def check_live_metrics(log_dir):
    """metrics.csv and the TensorBoard event file hold loss, BLEU, lr and tokens/s."""
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40]
    assert rows[1]["valid_bleu"] != "" and rows[0]["valid_bleu"] == ""
    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "valid/bleu", "valid/loss"} <= tags
    assert [e.step for e in events.Scalars("valid/bleu")] == [20, 40]
    assert [e.step for e in events.Scalars("train/loss")] == [10, 20, 30, 40]


def test_translate_bad_checkpoint_is_one_line(tmp_path):
    out = run(["raymt.translate", "--checkpoint", str(tmp_path), "hello"], timeout=60)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "config.json" in out.stderr
