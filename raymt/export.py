"""`python -m raymt.export`: a self-contained model directory for inference.

The output holds the weights (`model.safetensors` when the safetensors package is
installed, else a weights-only torch `model.pt`), `config.json` and the SentencePiece
`spm.model`: no optimizer state, no Ray, no run directory. `python -m raymt.translate
--checkpoint OUT` and `python -m raymt.evaluate --checkpoint OUT` load it; loading never
executes code from the files (safetensors, or torch.load with weights_only=True).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from raymt.checkpoint import (MODEL_FILE, SAFETENSORS_FILE, SPM_FILE, check_checkpoint,
                              load_weights, save_config)
from raymt.model import Transformer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMATS = ("auto", "safetensors", "torch")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m raymt.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (of a run, or averaged)")
    p.add_argument("--output", required=True, help="new directory for the exported model")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="weights file: safetensors if installed (auto), safetensors, or torch")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="store floating-point weights in this dtype (loaded back as float32)")
    return p.parse_args(argv)


def weights_format(requested: str) -> str:
    """'safetensors' or 'torch' for a --format value."""
    have = importlib.util.find_spec("safetensors") is not None
    if requested == "safetensors" and not have:
        raise ValueError("--format safetensors needs the safetensors package: pip install safetensors")
    if requested == "auto":
        return "safetensors" if have else "torch"
    return requested


def save_weights(state: dict, directory: Path, fmt: str) -> Path:
    """Write a state dict as model.safetensors or a weights-only torch model.pt."""
    if fmt == "safetensors":
        from safetensors.torch import save_file

        path = directory / SAFETENSORS_FILE
        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    else:
        path = directory / MODEL_FILE
        torch.save(state, path)
    return path


def export_model(checkpoint: str | Path, output: str | Path, fmt: str = "auto",
                 dtype: str = "float32") -> Path:
    """Write weights, config.json and spm.model of `checkpoint` to a new directory `output`."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    fmt = weights_format(fmt)
    config, tokenizer = check_checkpoint(checkpoint)
    state = load_weights(checkpoint)
    # Build the model once: the weights must match the config before anything is written.
    try:
        Transformer(config.model, tokenizer.vocab_size).load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{checkpoint}: weights do not match config.json ({str(err).splitlines()[0]})") from None
    state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --output {output}: {err.strerror}") from None
    tokenizer.save(output / SPM_FILE)
    save_config(output, config, tokenizer.vocab_size)
    save_weights(state, output, fmt)
    return output


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        output = export_model(args.checkpoint, args.output, args.format, args.dtype)
    except ValueError as err:
        print(f"raymt.export: error: {err}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in output.iterdir())
    size = sum(os.path.getsize(output / f) for f in files) / 2**20
    print(f"exported {args.checkpoint} -> {output} ({', '.join(files)}; {size:.1f} MiB)")
    print(f"translate: python -m raymt.translate --checkpoint {output} \"...\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
