"""End to end: `python -m raymt.train` on 2 workers, then `python -m raymt.translate`
(`--resume` of a killed run, extended: tests/test_faults.py)."""

import csv
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

# Ray's internal chatter that a default run keeps in Ray's log files (raymt.cluster.init_ray).
RAY_CHATTER = [
    "gcs_actor_scheduler.cc",
    "Failed to kill actor",
    "worker processes have been started",
    "maximum expected startup concurrency",
    "PreemptionWatcher",
    "Progress bars disabled",
    "Setting up process group for",
    "Started training worker group",
    "Moving model to device",
    "Wrapping provided model in DistributedDataParallel",
    "Token authentication is enabled",
    "Started a local Ray instance",
    " INFO ",
    "Reporting training result",
    "Checkpoint successfully created",
]


def run(args, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, **kw)


def test_train_and_translate(tmp_path, reference_run):
    """The session's reference run (conftest.tiny_run, 2 workers, 80 steps): its console,
    summary, metrics and plots; then translate with its best checkpoint."""
    out, run_dir = reference_run, reference_run.dir
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test BLEU" in out.stdout and "best checkpoint:" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 <= summary["test"]["bleu"] <= 100 and "nrefs:1" in summary["test"]["bleu_signature"]
    console = out.stdout + out.stderr
    assert "step 80/80" in console and "forward pass in" in console  # rank 0's prints still arrive
    assert [p for p in RAY_CHATTER if p in console] == [], console[-3000:]
    check_live_metrics(run_dir / "logs")
    plots = run_dir / "plots"
    assert sorted(p.name for p in plots.iterdir()) == ["curves_step.png", "curves_time.png"]

    ckpt = json.loads((run_dir / "summary.json").read_text())["best_checkpoint"]
    out = run(
        ["raymt.translate", "--checkpoint", ckpt, "--beam", "3", "Germany and March 3, 2021", "Monday, July 4, 1999"],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2

    ref = tmp_path / "ref.de"
    ref.write_text("Deutschland und 3. März 2021\n")
    out = run(
        ["raymt.translate", "--checkpoint", ckpt, "--ref", str(ref)], input="Germany and March 3, 2021\n", timeout=120
    )
    assert out.returncode == 0 and "BLEU" in out.stderr and "nrefs:1" in out.stderr


def check_live_metrics(log_dir):
    """metrics.csv and the TensorBoard event file hold loss, BLEU, lr and tokens/s."""
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(10, 81, 10))
    assert [r["step"] for r in rows if r["valid_bleu"] != ""] == ["20", "40", "60", "80"]
    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "valid/bleu", "valid/loss"} <= tags
    assert [e.step for e in events.Scalars("valid/bleu")] == [20, 40, 60, 80]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(10, 81, 10))


def test_translate_bad_checkpoint_is_one_line(tmp_path):
    out = run(["raymt.translate", "--checkpoint", str(tmp_path), "hello"], timeout=60)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "config.json" in out.stderr


# A second Ray Train run (~20 s here, a minute on a busy host): CI runs it after the default suite.
@pytest.mark.slow
@pytest.mark.ci
def test_init_starts_a_new_run_from_a_trained_checkpoint(init_run, reference_run):
    """`--init` of the reference run's last checkpoint (conftest.init_run, 2 workers): a new run
    directory at step 0 with a new schedule, its corpus tokenized with the checkpoint's
    SentencePiece model, its first losses those of the trained model, not of a new one."""
    from raymt.compare import checkpoint_at, group_starts

    out, run_dir = init_run, init_run.dir
    assert out.returncode == 0, out.stderr[-3000:]
    start = checkpoint_at(reference_run.dir, 80)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["init_checkpoint"] == str(start) and summary["start_step"] == 10
    assert [s for s, _, _ in group_starts(run_dir)] == [0]
    assert json.loads((run_dir / "init_checkpoint.json").read_text()) == {"init_checkpoint": str(start)}
    assert (run_dir / "spm.model").read_bytes() == (start / "spm.model").read_bytes()
    assert (run_dir / "corpus" / "spm.model").read_bytes() == (start / "spm.model").read_bytes()
    rows = list(csv.DictReader((run_dir / "logs" / "metrics.csv").open()))
    ref_rows = list(csv.DictReader((reference_run.dir / "logs" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(10, 81, 10))
    assert float(rows[0]["lr"]) == float(ref_rows[0]["lr"])  # step 10 of the same warmup
    # Step 10 from the trained weights: the reference run's last loss, far from its first.
    first, ref_first, ref_last = (float(r["train_loss"]) for r in (rows[0], ref_rows[0], ref_rows[-1]))
    assert abs(first - ref_last) < abs(first - ref_first) / 3, (first, ref_first, ref_last)
