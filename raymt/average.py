"""`python -m raymt.average`: average the weights of several checkpoints of one model.

Which checkpoints: `--last N` of a run directory (by the step in each train_state.pt),
`--best N` of a run directory (by a metric Ray Train recorded for each kept checkpoint in
`<run>/checkpoint_manager_snapshot.json`, default valid_bleu), or `--checkpoints DIR ...`.
A run keeps `train.num_to_keep` checkpoints (5 by default): raise it to average more.
The result is a checkpoint directory (model.pt, config.json, spm.model, average.json).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from raymt import storage
from raymt.checkpoint import (
    MODEL_FILE,
    RAY_SNAPSHOT_FILE,
    SPM_FILE,
    check_checkpoint,
    load_train_state,
    load_weights,
    local_checkpoint,
    model_languages,
    save_checkpoint,
    weights_file,
)
from raymt.command import flag, main_of
from raymt.config import Config
from raymt.errors import check
from raymt.model import build_model
from raymt.provenance import AVERAGE_FILE, checkpoint_metrics
from raymt.tokenizer import Tokenizer

# Training-only fields that may differ between checkpoints of one model.
DROPOUTS = ("dropout", "attention_dropout")


@dataclass(kw_only=True)
class AverageConfig:
    """`raymt average`: which checkpoints (one of --last, --best, --checkpoints) and where their
    average goes."""

    run_dir: Optional[str] = flag(
        None, "a raymt.train run directory or its URI (with --last or --best)", positional=True
    )
    last: Optional[int] = flag(None, "the N checkpoints with the highest steps", metavar="N")
    best: Optional[int] = flag(None, "the N checkpoints with the best --metric", metavar="N")
    checkpoints: list[str] = flag(
        help="these checkpoint directories (paths or URIs)", repeat=True, many=True, metavar="DIR"
    )
    metric: str = flag("valid_bleu", "reported metric that ranks --best (default valid_bleu)")
    mode: Optional[str] = flag(
        None, "higher or lower is better (default: min for *loss*, else max)", choices=("max", "min")
    )
    output: str = flag(help="new checkpoint directory to write", required=True)

    def __post_init__(self) -> None:
        picks = [name for name in ("last", "best") if getattr(self, name) is not None]
        picks += ["checkpoints"] if self.checkpoints else []
        check(bool(picks), "which checkpoints? give --last N, --best N or --checkpoints DIR ...")
        check(len(picks) == 1, f"{' and '.join('--' + p for p in picks)} each pick checkpoints: give one of them")
        check(self.mode in (None, "max", "min"), f"--mode {self.mode}: max or min")
        if self.checkpoints:
            check(not self.run_dir, "give either a run directory (with --last/--best) or --checkpoints, not both")
        else:
            check(bool(self.run_dir), f"--{picks[0]} needs a run directory: python -m raymt.average RUN_DIR ...")


def run_dir_on_disk(run_dir: str | Path) -> Path:
    """A run directory on local disk: itself, or for a URI a directory in the cache holding Ray's
    snapshot and links named like the run's complete checkpoints to their downloaded copies."""
    if not storage.is_uri(run_dir):
        return Path(run_dir)
    local = storage.cache_root() / "runs" / hashlib.sha256(storage.normalize(run_dir).encode()).hexdigest()[:16]
    shutil.rmtree(local, ignore_errors=True)  # checkpoints Ray has deleted since must not linger
    local.mkdir(parents=True)
    for name in storage.listdir(run_dir):
        if name.startswith("checkpoint_") and storage.exists(storage.join(run_dir, name, MODEL_FILE)):
            (local / name).symlink_to(local_checkpoint(storage.join(run_dir, name)), target_is_directory=True)
    snapshot = storage.optional_bytes(storage.join(run_dir, RAY_SNAPSHOT_FILE))
    if snapshot is not None:
        (local / RAY_SNAPSHOT_FILE).write_bytes(snapshot)
    return local


def run_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoint_* directories (weights present) of a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    found = sorted(d for d in run_dir.glob("checkpoint_*") if d.is_dir() and (d / MODEL_FILE).is_file())
    if not found:
        raise ValueError(f"{run_dir} has no checkpoint_* directories; is it a raymt.train run directory?")
    return found


def _take(candidates: list[Path], n: int, what: str) -> list[Path]:
    """The first n candidates, or a one-line error saying how many there are."""
    if n < 1:
        raise ValueError(f"{what} {n}: N must be >= 1")
    if n > len(candidates):
        raise ValueError(
            f"{what} {n}: only {len(candidates)} checkpoint(s) available; a run keeps "
            "train.num_to_keep of them (--set train.num_to_keep=N when training)"
        )
    return candidates[:n]


def last_checkpoints(run_dir: str | Path, n: int) -> list[Path]:
    """The n checkpoints of a run with the highest training steps, newest first."""
    steps = {d: load_train_state(d).step for d in run_checkpoints(run_dir)}
    return _take(sorted(steps, key=lambda d: (steps[d], d.name), reverse=True), n, "--last")


def best_checkpoints(run_dir: str | Path, n: int, metric: str = "valid_bleu", mode: Optional[str] = None) -> list[Path]:
    """The n checkpoints of a run with the best recorded `metric`, best first."""
    mode = mode or ("min" if "loss" in metric else "max")
    found = run_checkpoints(run_dir)
    metrics = checkpoint_metrics(run_dir)
    scored = []
    for d in found:
        value = metrics.get(d.name, {}).get(metric)
        if isinstance(value, (int, float)):
            scored.append((value, d))
    if not scored and metrics:
        known = sorted({k for m in metrics.values() for k in m})
        raise ValueError(f"no checkpoint of {run_dir} has the metric {metric!r}; recorded: {', '.join(known)}")
    scored.sort(key=lambda x: (x[0] if mode == "min" else -x[0], x[1].name))
    return _take([d for _, d in scored], n, "--best")


def check_same_model(directories: Sequence[Path]) -> tuple[Config, Tokenizer]:
    """Config and tokenizer shared by all checkpoints; one-line error if any differs."""
    first = directories[0]
    config, tokenizer = check_checkpoint(first)
    languages = model_languages(first)
    for d in directories[1:]:
        other, other_tokenizer = check_checkpoint(d)  # each one whole: config, spm.model, weights
        diff = [
            f"model.{k}={getattr(other.model, k)!r} vs {v!r}"
            for k, v in config.model.__dict__.items()
            if k not in DROPOUTS and getattr(other.model, k) != v
        ]
        if diff:
            raise ValueError(
                f"{d} is a different model than {first} ({', '.join(diff)}): "
                "only checkpoints of one model can be averaged"
            )
        if other_tokenizer.model_proto != tokenizer.model_proto:
            raise ValueError(
                f"{d / SPM_FILE} differs from {first / SPM_FILE}: "
                "only checkpoints with the same vocabulary can be averaged"
            )
        if model_languages(d) != languages:
            raise ValueError(
                f"{d} was trained on other language pairs than {first}: only checkpoints of one model can be averaged"
            )
        pair, other_pair = config.data.pair(), other.data.pair()
        if languages is None and other_pair != pair:  # untagged: the direction is its one pair's
            raise ValueError(
                f"{d} translates {'->'.join(other_pair)} but {first} translates {'->'.join(pair)}: "
                "only checkpoints of one direction can be averaged"
            )
    return config, tokenizer


def average_state_dicts(states: Sequence[dict]) -> dict:
    """Element-wise mean of floating-point tensors (accumulated in float64); others from the first."""
    keys = list(states[0])
    out = {}
    for key in keys:
        first = states[0][key]
        if not first.is_floating_point():
            out[key] = first.clone()
            continue
        total = torch.zeros_like(first, dtype=torch.float64)
        for state in states:
            total += state[key].double()
        out[key] = (total / len(states)).to(first.dtype)
    return out


def average_checkpoints(directories: Sequence[str | Path], output: str | Path) -> Path:
    """Write a checkpoint whose weights are the mean of the given checkpoints' weights."""
    directories = [Path(d) for d in directories]
    output = Path(output)
    if output.resolve() in {d.resolve() for d in directories}:
        raise ValueError(f"--output {output} is one of the checkpoints being averaged")
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    config, tokenizer = check_same_model(directories)
    states = [load_weights(d) for d in directories]
    for d, state in zip(directories[1:], states[1:]):
        if state.keys() != states[0].keys() or any(state[k].shape != states[0][k].shape for k in state):
            raise ValueError(f"{weights_file(d)} holds other tensors than {weights_file(directories[0])}")
    model = build_model(config.model, tokenizer.vocab_size)
    model.load_state_dict(average_state_dicts(states))
    save_checkpoint(output, model, config, tokenizer, languages=model_languages(directories[0]))
    sources = [str(d.resolve()) for d in directories]
    (output / AVERAGE_FILE).write_text(json.dumps({"checkpoints": sources}, indent=2))
    return output


def select(cfg: AverageConfig) -> list[Path]:
    """The checkpoint directories the config asks for (downloaded when they are URIs)."""
    if cfg.checkpoints:
        return [local_checkpoint(d) for d in cfg.checkpoints]
    assert cfg.run_dir is not None  # AverageConfig's check
    run_dir = run_dir_on_disk(cfg.run_dir)
    if cfg.last is not None:
        return last_checkpoints(run_dir, cfg.last)
    assert cfg.best is not None
    return best_checkpoints(run_dir, cfg.best, cfg.metric, cfg.mode)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    return main_of("python -m raymt.average", AverageConfig, run, argv, __doc__.split("\n\n")[0])


def run(cfg: AverageConfig) -> Path:
    """Average the checkpoints `cfg` names into `cfg.output`, saying which; returns the new checkpoint."""
    chosen = select(cfg)
    output = average_checkpoints(chosen, cfg.output)
    for d in chosen:
        print(f"averaged {d}")
    print(f"wrote {output}")
    return output


if __name__ == "__main__":
    sys.exit(main())
