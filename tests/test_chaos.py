"""Runs compared (raymt.compare), and benchmarks/chaos.py's smoke form: a 2-worker run of the
default model whose workers are killed twice and its driver once ends with the weights, data
trace and losses of an uninterrupted run."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from raymt import compare

ROOT = Path(__file__).resolve().parents[1]
STEPS = 150  # chaos.py --smoke's


def write_trace(run_dir: Path, rank: int, text: str) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"trace-rank{rank}.tsv").write_text(text.replace(" ", "\t"))


def test_trained_pairs_are_the_last_groups_across_a_restart_and_a_resize(tmp_path):
    # Group 10.0 (2 workers) trains steps 1-3; a restart from step 1 (group 20.0) trains 2-3
    # with 1 worker (rank 1's lines of steps 2-3 are undone), then group 30.0 goes on with 2.
    write_trace(
        tmp_path,
        0,
        "#start 0 10.0 2\n1 0 a\n2 0 b\n3 0 c\n#start 1 20.0 1\n2 0 x\n2 0 b\n3 1 y\n#start 3 30.0 2\n4 1 z\n",
    )
    write_trace(tmp_path, 1, "#start 0 10.0 2\n1 0 d\n2 0 e\n3 0 f\n#start 3 30.0 2\n4 1 w\n5 1 v")  # a cut line
    pairs = compare.trained_pairs(tmp_path)
    assert pairs == {
        (0, 1): [(0, "a")],
        (1, 1): [(0, "d")],
        (0, 2): [(0, "b"), (0, "x")],
        (0, 3): [(1, "y")],
        (0, 4): [(1, "z")],
        (1, 4): [(1, "w")],
    }
    assert compare.pairs_per_epoch(pairs) == Counter(
        {(0, "a"): 1, (0, "d"): 1, (0, "b"): 1, (0, "x"): 1, (1, "y"): 1, (1, "z"): 1, (1, "w"): 1}
    )
    assert compare.group_starts(tmp_path) == [(0, 10.0, 2), (1, 20.0, 1), (3, 30.0, 2)]
    assert compare.group_starts(tmp_path / "none") == []


def test_weights_diff_checkpoint_at_and_logged(tmp_path):
    for name, step, bias in (("a", 5, 0.0), ("b", 5, 0.25), ("c", 7, 0.0)):
        (tmp_path / f"checkpoint_{name}").mkdir()
        torch.save({"w": torch.ones(2, 2), "b": torch.full((3,), bias)}, tmp_path / f"checkpoint_{name}" / "model.pt")
        torch.save({"step": step}, tmp_path / f"checkpoint_{name}" / "train_state.pt")
    assert compare.checkpoint_at(tmp_path, 7).name == "checkpoint_c"
    with pytest.raises(FileNotFoundError):
        compare.checkpoint_at(tmp_path, 6)
    same = compare.weights_diff(tmp_path / "checkpoint_a", tmp_path / "checkpoint_c")
    assert same == {"max_abs_diff": 0.0, "tensors": 2, "differing": []}
    other = compare.weights_diff(tmp_path / "checkpoint_a", tmp_path / "checkpoint_b")
    assert other == {"max_abs_diff": 0.25, "tensors": 2, "differing": ["b"]}

    (tmp_path / "logs").mkdir()
    # A restarted group logs steps 2-3 again: the last rows count; valid_loss only where set.
    csv = "step,train_loss,valid_loss\n1,3.5,\n2,3.0,\n3,2.0,2.5\n2,3.25,\n3,2.75,2.5\n"
    (tmp_path / "logs" / "metrics.csv").write_text(csv)
    assert compare.logged(tmp_path, "train_loss") == {1: 3.5, 2: 3.25, 3: 2.75}
    assert compare.logged(tmp_path, "valid_loss") == {3: 2.5}


@pytest.mark.slow  # 4-8 min: two Ray Train runs of the default model and three restarts
@pytest.mark.ci
@pytest.mark.timeout(1500)
def test_chaos_smoke_ends_equal_to_the_uninterrupted_run(tmp_path):
    out = tmp_path / "chaos.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--smoke", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary == json.loads(proc.stdout[proc.stdout.index("\n{") :])  # the JSON it printed

    assert summary["worker_kills"] >= 1 and summary["driver_kills"] == 1
    kinds = [kill["kind"] for kill in summary["kills"]]
    assert "driver" in kinds and "RayTrainWorker" in kinds
    # Each kill was followed by a restart of the worker group from an earlier checkpoint, and
    # the run logged again the step it had reached.
    for kill in summary["kills"]:
        assert 0 <= kill["resumed_at"] <= kill["step"] and kill["lost_s"] > 0, kill
    assert summary["lost_per_kill_s"] is not None

    assert summary["weights_max_abs_diff"] == 0.0 and summary["weights_differing"] == []
    assert summary["tensors"] > 0
    assert summary["trace_steps"] == STEPS and summary["trace_steps_differing"] == 0
    assert summary["train_loss_steps"] == STEPS and summary["train_loss_steps_differing"] == 0
    assert summary["valid_loss_steps"] > 0 and summary["valid_loss_steps_differing"] == 0
    assert summary["equal"] is True
    assert "weights_max_abs_diff" in proc.stdout.split("\n{")[0]  # the table before the JSON
