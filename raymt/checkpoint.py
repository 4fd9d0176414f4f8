"""Checkpoint directories: weights-only torch files, config JSON and the SentencePiece model.

An exported model directory (`python -m raymt.export`) has the same layout, with the
weights in `model.safetensors` when the safetensors package is installed. Loading never
runs code from a file: torch files are read with `weights_only=True`.

A model trained on several corpora records its languages in config.json (`"languages":
{"pairs", "target_langs", "reserved"}`, docs/design-inputs.md section 6; an imported NLLB or
M2M-100 also `"source_tags"`, `languages_entry`); a model without
them (every single-pair run) is untagged and translates its one pair (`data.corpora`, `DataConfig.pair`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from raymt import storage
from raymt.config import Config
from raymt.errors import first_line
from raymt.model import Transformer, build_model
from raymt.tags import lang_tag
from raymt.tokenizer import Tokenizer

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
CONFIG_FILE = "config.json"
SPM_FILE = "spm.model"
SAFETENSORS_FILE = "model.safetensors"
# raymt's config.json beside a CTranslate2 or HF Marian directory's own config.json (raymt.export).
RAYMT_CONFIG_FILE = "raymt_config.json"
# Written by Ray Train (2.60: train/v2 CheckpointManager) in a run directory: the checkpoints it
# registered, with their metrics; a run of that name started again restores from the latest.
RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
# The batching fields (raymt.data.epoch.BATCHING_FIELDS) that a checkpoint whose record lacks them
# (written before they existed) cut its batches with.
BATCHING_BEFORE = {"shuffle_block_rows": 0}  # shards read whole, in order


@dataclass(frozen=True)
class TrainState:
    """What a training checkpoint's train_state.pt holds besides the weights: the optimizer,
    scheduler and fp16 loss scaler to continue with, the step and epoch, every rank's data
    position and RNG streams, what the positions mean (batching fields, mix of corpora) and the
    early stop's count.

    The one reader of the file's keys (`from_dict`): older checkpoints lack the keys added since
    (`rng_states`, `grad_scaler`, `data_segment`, `data_batching`, `data_mix`, `precision`,
    `valid_best`) and read as their defaults; a state that is not trained yet is `TrainState()` (step 0 of epoch 0).
    """

    optimizer: Optional[dict] = None  # the optimizer's state_dict (absent: weights-only starts)
    scheduler: Optional[dict] = None
    step: int = 0
    epoch: int = 0
    data_positions: Optional[list[dict]] = None  # every rank's `Position`, by rank
    data_segment: Optional[dict] = None  # the rest of the epoch a resized group shares (`Segment`)
    rng_states: Optional[list[dict]] = None  # every rank's (raymt.trainer.rng_state)
    grad_scaler: Optional[dict] = None  # fp16's loss scaler; None: saved by a bf16/fp32 run
    data_batching: Optional[dict] = None  # the batching fields data_positions count batches with
    data_mix: Optional[dict] = None  # several corpora: what the positions are positions in
    precision: Optional[dict] = None  # the run's precision (`Precision.record`)
    valid_best: Optional[dict] = None  # train.patience's count (`worker_state.EarlyStop.best`)

    # Written only when set, so that one-pair checkpoints hold the keys they always did.
    WRITTEN_IF_SET = ("data_mix", "precision", "valid_best")

    def to_dict(self) -> dict:
        """The plain dict torch.save writes (tensors, lists, numbers and strings only)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in state.items() if v is not None or k not in self.WRITTEN_IF_SET}

    @classmethod
    def from_dict(cls, saved: Any, where: str = "train state") -> "TrainState":
        """The train state of a train_state.pt written by any raymt so far: keys it lacks take
        their defaults, batching fields it does not record what they meant before they were
        recorded (`saved_batching`: none before 12-05, shards read whole without
        `shuffle_block_rows`); a one-line error for a file that is not one."""
        known = {f.name for f in fields(cls)}
        if not isinstance(saved, dict) or not set(saved) <= known:
            what = sorted(set(saved) - known) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"{where}: not a raymt train state (unknown {what}); from a newer raymt? Upgrade "
                "raymt, or start a new run from the checkpoint's weights: --init CHECKPOINT_DIR --name NEW"
            )
        return cls(**{**saved, "data_batching": saved_batching(saved.get("data_batching"))})


def saved_batching(record: Optional[dict]) -> dict:
    """The batching fields a checkpoint's positions were counted with: its record, a field it
    lacks at what that meant before the field existed (`BATCHING_BEFORE`)."""
    return {**BATCHING_BEFORE, **(record or {})}


def _atomic_save(obj: Any, path: Path) -> None:
    """torch.save (bytes: plain write) to a temporary name, then rename, so no half-written
    file is ever read and a file being replaced stays whole until the new one is."""
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(obj, bytes):
        tmp.write_bytes(obj)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    config: Config,
    tokenizer: Tokenizer,
    train_state: Optional[TrainState] = None,
    languages: Optional[dict] = None,
) -> Path:
    """Write model weights, optional optimizer/scheduler/step state, config (with the model's
    `languages`, see `languages_entry`) and tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_save(tokenizer.model_proto, directory / SPM_FILE)
    save_config(directory, config, model.vocab_size, languages)
    if train_state is not None:
        _atomic_save(train_state.to_dict(), directory / STATE_FILE)
    # The weights go last: their presence marks a complete checkpoint.
    _atomic_save(model.state_dict(), directory / MODEL_FILE)
    return directory


def config_meta(config: Config, vocab_size: int, languages: Optional[dict] = None) -> dict:
    """What config.json holds: the run config, the vocabulary size and, for a model trained on
    several corpora, its `languages` (absent otherwise, so single-pair files stay as they were)."""
    meta: dict[str, Any] = {"config": config.to_dict(), "vocab_size": vocab_size}
    if languages is not None:
        meta["languages"] = check_languages(languages, "languages")
    return meta


def save_config(directory: str | Path, config: Config, vocab_size: int, languages: Optional[dict] = None) -> None:
    """Write config.json: the run config, the model's vocabulary size and its `languages`, if any."""
    _atomic_save(
        json.dumps(config_meta(config, vocab_size, languages), indent=2).encode(), Path(directory) / CONFIG_FILE
    )


def languages_entry(
    pairs: Sequence[Sequence[str]],
    reserved: dict[str, int],
    tag_side: str = "src",
    source_tags: Optional[dict[str, int]] = None,
) -> dict:
    """The `languages` entry of a multi-corpus run's config.json: the trained (src, tgt) pairs,
    their target languages, the reserved tag pieces with their SentencePiece ids and, for a
    model trained with data.tag_side "tgt", `"tag_side": "tgt"` (absent: "src", as before); for
    a model that reads its source's language too (an imported NLLB or M2M-100: the code first in
    each source), `"source_tags"`, each source language's id."""
    entry: dict[str, Any] = {
        "pairs": [[src, tgt] for src, tgt in pairs],
        "target_langs": sorted({tgt for _, tgt in pairs}),
        "reserved": {piece: int(i) for piece, i in reserved.items()},
    }
    if tag_side != "src":
        entry["tag_side"] = tag_side
    if source_tags:
        entry["source_tags"] = {lang: int(i) for lang, i in source_tags.items()}
    return check_languages(entry, "languages")


def tag_side(languages: Optional[dict]) -> str:
    """Where a model reads its target-language tag: "tgt" (the decoder's first token after BOS)
    when its `languages` entry says so, else "src" (before the source; untagged models too)."""
    return (languages or {}).get("tag_side", "src")


def check_languages(entry: Any, where: str) -> dict:
    """A `languages` entry, checked: pairs of two language codes, their sorted target languages,
    tag pieces mapped to ids, an optional tag_side "tgt" and optional source_tags, an id for each
    source language (the file is corrupt or hand-edited otherwise)."""
    keys = {"pairs", "target_langs", "reserved"}
    ok = isinstance(entry, dict) and keys <= set(entry) <= keys | {"tag_side", "source_tags"}
    ok = ok and entry.get("tag_side", "tgt") == "tgt"
    pairs = entry.get("pairs") if ok else None
    ok = ok and isinstance(pairs, list) and bool(pairs)
    ok = ok and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs)
    ok = ok and entry["target_langs"] == sorted({tgt for _, tgt in pairs})
    reserved = entry.get("reserved") if ok else None
    ok = ok and isinstance(reserved, dict) and all(isinstance(i, int) for i in reserved.values())
    # A decoder-side tag needs one for every target language (what decoding forces first).
    ok = ok and ("tag_side" not in entry or all(lang_tag(t) in reserved for t in entry["target_langs"]))
    sources = entry.get("source_tags", {}) if ok else None
    ok = ok and isinstance(sources, dict) and all(isinstance(i, int) for i in sources.values())
    ok = ok and ("source_tags" not in entry or all(src in sources for src, _ in pairs))
    if not ok:
        raise ValueError(
            f"{where}: malformed languages entry {json.dumps(entry)[:200]}; expected "
            '{"pairs": [["en", "de"], ...], "target_langs": [...], "reserved": {"<2de>": 4, ...}} '
            '(and "tag_side": "tgt" for a decoder-side tag, "source_tags": {"en": 5, ...} for source tags)'
        )
    return entry


def _meta_file(directory: Path) -> Path:
    """raymt's config.json of a checkpoint or exported model (raymt_config.json beside a
    CTranslate2 or Marian directory's own config.json)."""
    beside = directory / RAYMT_CONFIG_FILE
    return beside if beside.is_file() else directory / CONFIG_FILE


def model_languages(checkpoint: str | Path) -> Optional[dict]:
    """The `languages` entry of a checkpoint or exported model (path or URI); None for a model
    trained on one pair (untagged: `DataConfig.pair`), every checkpoint so far."""
    path = _meta_file(local_checkpoint(checkpoint))
    if not path.is_file():
        raise ValueError(f"{path} does not exist; is {checkpoint} a raymt checkpoint directory?")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a raymt checkpoint config ({err})") from None
    entry = meta.get("languages") if isinstance(meta, dict) else None
    return None if entry is None else check_languages(entry, str(path))


def trained_sources(languages: dict, tgt_lang: str) -> list[str]:
    """The source languages a multi-pair model was trained to translate into `tgt_lang` from."""
    return sorted({src for src, tgt in languages["pairs"] if tgt == tgt_lang})


def default_src_lang(languages: dict, tgt_lang: str) -> str:
    """The one source language a tagged model was trained to translate into `tgt_lang` from."""
    sources = trained_sources(languages, tgt_lang)
    if len(sources) != 1:
        raise ValueError(
            f"this model translates into {tgt_lang} from {', '.join(sources)}: pass --src-lang "
            "(the source suffix of the test files)"
        )
    return sources[0]


def read_torch_file(path: Path) -> Any:
    """Weights-only load with a one-line error for missing or corrupt files."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist; is {path.parent} a raymt checkpoint directory?")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle refused, truncated zip, ...
        code = re.search(r"GLOBAL (\S+)", str(err))
        if code:  # the pickle names a function or class to run: never allowed here
            raise ValueError(
                f"refusing to load {path}: it would run {code.group(1)} while unpickling; "
                "raymt weights hold tensors only, so the file is corrupt or malicious"
            ) from None
        raise ValueError(f"cannot load {path}: corrupt, truncated or not weights-only ({first_line(err)})") from None


def local_checkpoint(directory: str | Path) -> Path:
    """A checkpoint directory on local disk: itself, or the copy of a URI (s3://...) downloaded
    once into raymt's cache (raymt.storage.local_copy); its files are then loaded as local ones."""
    return storage.local_copy(directory, "checkpoints")


def load_config(directory: str | Path) -> tuple[Config, int]:
    """The run config and model vocabulary size stored in a checkpoint (path or URI)."""
    path = local_checkpoint(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist; is {directory} a raymt checkpoint directory?")
    try:
        meta = json.loads(path.read_text())
        return Config.from_dict(meta["config"]), int(meta["vocab_size"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a raymt checkpoint config ({err})") from None


def check_checkpoint(directory: str | Path) -> tuple[Config, Tokenizer]:
    """Config and tokenizer of a checkpoint whose weights file exists (the weights are not read)."""
    directory = local_checkpoint(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist")
    config, vocab_size = load_config(directory)
    tokenizer = Tokenizer.load(directory / SPM_FILE)
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(
            f"{directory}: spm.model has {tokenizer.vocab_size} ids but the model "
            f"was built for {vocab_size}; the files come from different runs"
        )
    check_target_vocabulary(config, tokenizer, str(directory))
    weights_file(directory)
    return config, tokenizer


def check_target_vocabulary(config: Config, tokenizer: Tokenizer, where: str) -> None:
    """A one-line error when the model's target rows (model.target_vocab_size, else its one
    vocabulary's) are not the tokenizer's target ids (separate vocabularies need a target embedding)."""
    rows = config.model.target_vocab_size or tokenizer.vocab_size
    if rows != tokenizer.target_vocab_size:
        raise ValueError(
            f"{where}: the model has {rows} target rows (model.target_vocab_size={config.model.target_vocab_size}) "
            f"but the tokenizer has {tokenizer.target_vocab_size} target ids; the files come from different models"
        )


def load_model(directory: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer, Config]:
    """Rebuild the model (eval mode) and tokenizer from a checkpoint directory (path or URI)."""
    directory = local_checkpoint(directory)
    config, tokenizer = check_checkpoint(directory)
    model = build_model(config.model, tokenizer.vocab_size)
    state = load_weights(directory)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"{weights_file(directory)} does not match its config.json ({str(err).splitlines()[0]})"
        ) from None
    return model.to(device).eval(), tokenizer, config


def load_train_state(directory: str | Path) -> TrainState:
    """Optimizer, scheduler, step and data position of a training checkpoint (path or URI)."""
    path = local_checkpoint(directory) / STATE_FILE
    return TrainState.from_dict(read_torch_file(path), str(path))


def weights_file(directory: str | Path) -> Path:
    """The weights of a checkpoint or exported model: model.safetensors, else model.pt."""
    directory = local_checkpoint(directory)
    for name in (SAFETENSORS_FILE, MODEL_FILE):
        if (directory / name).is_file():
            return directory / name
    raise ValueError(f"{directory / MODEL_FILE} does not exist; is {directory} a raymt checkpoint directory?")


def read_safetensors(path: Path) -> dict:
    """A safetensors file as a CPU state dict, with one-line errors."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ValueError(f"{path} needs the safetensors package: pip install safetensors") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as err:  # header or size mismatch, truncated file, ...
        raise ValueError(f"cannot load {path}: corrupt or truncated safetensors file ({first_line(err)})") from None


def load_weights(directory: str | Path) -> dict:
    """The model state dict of a checkpoint or exported directory (weights only: no code runs)."""
    path = weights_file(directory)
    return read_safetensors(path) if path.name == SAFETENSORS_FILE else read_torch_file(path)
