"""Two runs of the same config side by side, from what they leave on disk: the pairs each step
trained on (`train.trace_data`'s logs/trace-rank<r>.tsv), a checkpoint's weights and
metrics.csv's columns. What the fault tests and benchmarks/chaos.py compare a run with."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import torch

from raymt.checkpoint import MODEL_FILE, STATE_FILE, load_train_state
from raymt.rundir import METRICS_CSV


def trained_pairs(run_dir: str | Path) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """(rank, step) -> sorted (epoch, pair digest)s of the worker group (attempt) that trained
    `step` last.

    Each (re)start of the worker group writes `#start<TAB>step<TAB>group id<TAB>world size` to
    every rank's trace; a later group undoes the steps after its checkpoint and trains them
    again, possibly with fewer ranks (an elastic resize): its lines are the ones that count.
    """
    per_step: dict[int, dict[float, dict[int, list]]] = {}
    for trace in Path(run_dir, "logs").glob("trace-rank*.tsv"):
        rank = int(trace.stem.removeprefix("trace-rank"))
        group = None
        for line in trace.read_text().split("\n")[:-1]:  # whole lines only
            fields = line.split("\t")
            if fields[0] == "#start":
                group = float(fields[2])
                continue
            step, epoch, digest = fields
            per_step.setdefault(int(step), {}).setdefault(group, {}).setdefault(rank, []).append((int(epoch), digest))
    return {
        (rank, step): sorted(rows) for step, groups in per_step.items() for rank, rows in groups[max(groups)].items()
    }


def pairs_per_epoch(pairs: dict[tuple[int, int], list[tuple[int, str]]]) -> Counter:
    """(epoch, digest) -> how often `trained_pairs`' steps trained the pair in that epoch."""
    return Counter(row for rows in pairs.values() for row in rows)


def checkpoint_at(run_dir: str | Path, step: int) -> Path:
    """The run's checkpoint directory written at `step`."""
    for state in Path(run_dir).glob(f"checkpoint_*/{STATE_FILE}"):
        if load_train_state(state.parent).step == step:
            return state.parent
    raise FileNotFoundError(f"no checkpoint at step {step} in {run_dir}")


def weights_diff(checkpoint_a: str | Path, checkpoint_b: str | Path) -> dict:
    """Tensor by tensor, the two checkpoints' weights: the largest absolute difference, the
    names that differ (or are only in one) and how many tensors were compared."""
    a = torch.load(Path(checkpoint_a, MODEL_FILE), weights_only=True)
    b = torch.load(Path(checkpoint_b, MODEL_FILE), weights_only=True)
    differing = sorted(a.keys() ^ b.keys())
    max_abs = 0.0
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        if x.shape != y.shape:
            differing.append(name)
            max_abs = float("inf")
            continue
        diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        if diff or not torch.equal(x, y):  # torch.equal also tells NaNs and dtypes apart
            differing.append(name)
        max_abs = max(max_abs, diff)
    return {"max_abs_diff": max_abs, "tensors": len(a.keys() | b.keys()), "differing": differing}


def logged(run_dir: str | Path, column: str) -> dict[int, float]:
    """step -> `column` of the run's metrics.csv, from the last row logged at each step that has
    it (a restarted group logs again the steps after its checkpoint)."""
    with open(Path(run_dir, METRICS_CSV), newline="") as f:
        return {int(row["step"]): float(row[column]) for row in csv.DictReader(f) if row.get(column)}


def group_starts(run_dir: str | Path, rank: int = 0) -> list[tuple[int, float, int]]:
    """(step, start time, workers) of each (re)start of the worker group, from `rank`'s trace
    (whole lines only: the file may be being written); [] while there is none."""
    trace = Path(run_dir, "logs", f"trace-rank{rank}.tsv")
    lines = trace.read_text().split("\n")[:-1] if trace.exists() else []
    starts = [line.split("\t") for line in lines if line.startswith("#start")]
    return [(int(s[1]), float(s[2]), int(s[3])) for s in starts]
