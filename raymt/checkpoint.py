"""Checkpoint directories: weights-only torch files, config JSON and the SentencePiece model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from raymt.config import Config
from raymt.model import Transformer
from raymt.tokenizer import Tokenizer

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
CONFIG_FILE = "config.json"
SPM_FILE = "spm.model"


def _atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary name, then rename, so no half-written file is ever read."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(directory: str | Path, model: torch.nn.Module, config: Config,
                    tokenizer: Tokenizer, train_state: Optional[dict] = None) -> Path:
    """Write model weights, optional optimizer/scheduler/step state, config and tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(directory / SPM_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(
        {"config": config.to_dict(), "vocab_size": model.vocab_size}, indent=2))
    if train_state is not None:
        _atomic_save(train_state, directory / STATE_FILE)
    # The weights go last: their presence marks a complete checkpoint.
    _atomic_save(model.state_dict(), directory / MODEL_FILE)
    return directory


def _torch_load(path: Path) -> Any:
    """Weights-only load with a one-line error for missing or corrupt files."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist; is {path.parent} a raymt checkpoint directory?")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle refused, truncated zip, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load {path}: corrupt, truncated or not weights-only ({first})") from None


def load_config(directory: str | Path) -> tuple[Config, int]:
    """The run config and model vocabulary size stored in a checkpoint."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist; is {directory} a raymt checkpoint directory?")
    try:
        meta = json.loads(path.read_text())
        return Config.from_dict(meta["config"]), int(meta["vocab_size"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a raymt checkpoint config ({err})") from None


def load_model(directory: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer, Config]:
    """Rebuild the model (eval mode) and tokenizer from a checkpoint directory."""
    directory = Path(directory)
    config, vocab_size = load_config(directory)
    tokenizer = Tokenizer.load(directory / SPM_FILE)
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"{directory}: spm.model has {tokenizer.vocab_size} ids but the model "
                         f"was built for {vocab_size}; the files come from different runs")
    model = Transformer(config.model, vocab_size)
    state = _torch_load(directory / MODEL_FILE)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{directory / MODEL_FILE} does not match its config.json "
                         f"({str(err).splitlines()[0]})") from None
    return model.to(device).eval(), tokenizer, config


def load_train_state(directory: str | Path) -> dict:
    """Optimizer, scheduler, step and data position of a training checkpoint."""
    return _torch_load(Path(directory) / STATE_FILE)


def load_weights(directory: str | Path) -> dict:
    """The model state dict of a checkpoint directory (weights only)."""
    return _torch_load(Path(directory) / MODEL_FILE)
