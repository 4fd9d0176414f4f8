"""Which weights a score comes from (`describe_checkpoint`): a checkpoint's training step (from
Ray Train's snapshot beside it, else its train_state.pt), or the checkpoints an average holds
(`AVERAGE_FILE`, written by `raymt average`); an ensemble's, each of its checkpoints
(`describe_checkpoints`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from raymt.checkpoint import RAY_SNAPSHOT_FILE, STATE_FILE, load_train_state, local_checkpoint

AVERAGE_FILE = "average.json"


def checkpoint_metrics(run_dir: str | Path) -> dict[str, dict]:
    """Metrics Ray Train recorded with each kept checkpoint, by checkpoint directory name."""
    path = Path(run_dir) / RAY_SNAPSHOT_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: no per-checkpoint metrics; use --last or --checkpoints")
    try:
        snapshot = json.loads(path.read_text())
        return {r["checkpoint_dir_name"]: dict(r["metrics"]) for r in snapshot["checkpoint_results"]}
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"cannot read per-checkpoint metrics from {path} ({type(err).__name__}: {err}); use --last or --checkpoints"
        ) from None


def recorded_step(directory: str | Path) -> Optional[int]:
    """The training step of a run's checkpoint: from Ray's snapshot beside it, else its
    train_state.pt; None for weights without either (an exported model)."""
    directory = Path(directory)
    try:
        step = checkpoint_metrics(directory.parent).get(directory.name, {}).get("step")
    except ValueError:  # no snapshot: not (or no longer) in a run directory
        step = None
    if step is None and (directory / STATE_FILE).is_file():
        step = load_train_state(directory).step
    return None if step is None else int(step)


def describe_checkpoint(directory: str | Path, shown: Optional[str] = None) -> str:
    """Which weights a score comes from: `shown` (default the path) with its step, or the
    checkpoints (and steps) it averages."""
    directory = Path(directory)
    shown = shown or str(directory)
    if (directory / AVERAGE_FILE).is_file():
        sources = [Path(s) for s in json.loads((directory / AVERAGE_FILE).read_text())["checkpoints"]]
        steps = [recorded_step(s) if s.is_dir() else None for s in sources]
        parts = ", ".join(f"{s.name} step {'?' if n is None else n}" for s, n in zip(sources, steps))
        return f"{shown} (average of {len(sources)}: {parts})"
    step = recorded_step(directory)
    return f"{shown} ({'no step recorded' if step is None else f'step {step}'}, not averaged)"


def describe_checkpoints(checkpoints: Sequence[str]) -> str:
    """Which weights a score comes from, by path or URI: one checkpoint's `describe_checkpoint`,
    or an ensemble's, each of its checkpoints'."""
    described = [describe_checkpoint(local_checkpoint(c), c) for c in checkpoints]
    return described[0] if len(described) == 1 else f"ensemble of {len(described)}: " + "; ".join(described)
