"""`python -m raymt.export`: a self-contained model directory for inference.

The output holds the weights (`model.safetensors` when the safetensors package is
installed, else a weights-only torch `model.pt`), `config.json` and the SentencePiece
`spm.model`: no optimizer state, no Ray, no run directory. `python -m raymt.translate
--checkpoint OUT` and `python -m raymt.evaluate --checkpoint OUT` load it; loading never
executes code from the files (safetensors, or torch.load with weights_only=True).

`--format ctranslate2` writes a CTranslate2 model directory instead (`model.bin`, its
`config.json` and `shared_vocabulary.json`, plus `spm.model` and raymt's config as
`raymt_config.json`) for `ctranslate2.Translator`; it needs the ctranslate2 package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from raymt.checkpoint import (MODEL_FILE, SAFETENSORS_FILE, SPM_FILE, check_checkpoint,
                              load_weights, save_config)
from raymt.config import Config
from raymt.model import Attention, Transformer, build_model
from raymt.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMATS = ("auto", "safetensors", "torch", "ctranslate2")
# CTranslate2 writes its own config.json; raymt's goes next to it under this name.
CT2_RAYMT_CONFIG = "raymt_config.json"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m raymt.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (of a run, or averaged)")
    p.add_argument("--output", required=True, help="new directory for the exported model")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="weights file: safetensors if installed (auto), safetensors, or torch; "
                        "or a CTranslate2 model directory (ctranslate2)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="store floating-point weights in this dtype (loaded back as float32; "
                        "ctranslate2: its weight type)")
    return p.parse_args(argv)


def weights_format(requested: str) -> str:
    """'safetensors', 'torch' or 'ctranslate2' for a --format value."""
    have = importlib.util.find_spec("safetensors") is not None
    if requested == "safetensors" and not have:
        raise ValueError("--format safetensors needs the safetensors package: pip install safetensors")
    if requested == "auto":
        return "safetensors" if have else "torch"
    return requested


def _array(t: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy of a parameter."""
    return t.detach().cpu().float().numpy().copy()


def _set_linear(spec, *layers: torch.nn.Linear) -> None:
    """A CTranslate2 LinearSpec from one nn.Linear, or several fused along the output rows."""
    spec.weight = np.concatenate([_array(layer.weight) for layer in layers])  # (sum out, in)
    spec.bias = np.concatenate([_array(layer.bias) for layer in layers])


def _set_norm(spec, norm: torch.nn.LayerNorm) -> None:
    """A CTranslate2 LayerNormSpec from an nn.LayerNorm."""
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _set_attention(spec, attn: Attention, norm: torch.nn.LayerNorm, self_attention: bool) -> None:
    """Self-attention: one fused Q|K|V linear; cross-attention: Q, then a fused K|V linear."""
    # kv_proj's rows are already K then V (forward chunks its output in that order),
    # the order CTranslate2 splits a fused K|V or Q|K|V projection in.
    if self_attention:
        _set_linear(spec.linear[0], attn.q_proj, attn.kv_proj)
    else:
        _set_linear(spec.linear[0], attn.q_proj)
        _set_linear(spec.linear[1], attn.kv_proj)
    _set_linear(spec.linear[-1], attn.out_proj)
    _set_norm(spec.layer_norm, norm)


def _set_ffn(spec, ffn, norm: torch.nn.LayerNorm) -> None:
    """The position-wise MLP and the norm of its residual block."""
    _set_linear(spec.linear_0, ffn.fc1)
    _set_linear(spec.linear_1, ffn.fc2)
    _set_norm(spec.layer_norm, norm)


def _set_stack(spec, model: Transformer, final_norm: torch.nn.Module) -> None:
    """Embedding, positions and final norm shared by the encoder and decoder specs."""
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = _array(model.embed.weight)  # (V, D); tied: aliased once on save
    spec.scale_embeddings = True  # x * sqrt(D), as Transformer._embed
    # raymt's own table (sin on even, cos on odd dims), not CTranslate2's built-in layout.
    spec.position_encodings.encodings = _array(model.positions)  # (max_positions, D)
    if model.cfg.pre_norm:
        _set_norm(spec.layer_norm, final_norm)


def ct2_vocabulary(tokenizer: Tokenizer) -> list[str]:
    """The SentencePiece pieces in id order, padded to the model's rows with unique fillers."""
    pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.sp.get_piece_size())]
    fillers = [f"<raymt_filler_{i}>" for i in range(len(pieces), tokenizer.vocab_size)]
    if len(set(pieces + fillers)) != tokenizer.vocab_size:
        raise ValueError("spm.model has duplicate pieces or pieces named <raymt_filler_N>")
    return pieces + fillers


def _set_weights(spec, model: Transformer) -> None:
    """Every weight of a TransformerSpec from the raymt model."""
    _set_stack(spec.encoder, model, model.encoder_norm)
    _set_stack(spec.decoder, model, model.decoder_norm)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.res1.norm, True)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.res2.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.res1.norm, True)
        _set_attention(layer_spec.attention, layer.cross_attn, layer.res2.norm, False)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.res3.norm)
    # logits = x @ embed.T, no bias. raymt.decoding also sets the log-probs of PAD and BOS to
    # -inf after the softmax; a bias here would instead renormalize every other log-prob.
    spec.decoder.projection.weight = _array(model.embed.weight)


def _set_vocabulary(spec, tokenizer: Tokenizer) -> None:
    """One shared vocabulary and raymt's special tokens: BOS starts the decoder, EOS ends both sides."""
    vocab = ct2_vocabulary(tokenizer)
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    piece = tokenizer.sp.id_to_piece
    spec.config.unk_token, spec.config.bos_token = piece(UNK_ID), piece(BOS_ID)
    spec.config.eos_token = piece(EOS_ID)
    spec.config.decoder_start_token = piece(BOS_ID)
    spec.config.add_source_eos = True  # raymt sources are pieces + EOS, without BOS


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer):
    """The model as a ctranslate2.specs.TransformerSpec (imported here: ctranslate2 is optional)."""
    try:
        from ctranslate2.specs import TransformerSpec, common_spec
    except ImportError:
        raise ValueError("--format ctranslate2 needs the ctranslate2 package: pip install ctranslate2") from None
    cfg = model.cfg
    # F.gelu is the exact (erf) GELU: Activation.GELU, not GELUTanh.
    activation = common_spec.Activation.GELU if cfg.activation == "gelu" else common_spec.Activation.RELU
    spec = TransformerSpec.from_config((cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads,
                                       pre_norm=cfg.pre_norm, activation=activation)
    _set_weights(spec, model)
    _set_vocabulary(spec, tokenizer)
    spec.config.layer_norm_epsilon = model.encoder[0].res1.norm.eps  # torch's 1e-5
    return spec


def save_ctranslate2(spec, output: Path, config: Config, vocab_size: int, dtype: str) -> None:
    """Validate, store weights as `dtype` and write the CTranslate2 directory plus raymt_config.json."""
    spec.validate()
    spec.optimize(quantization=dtype)  # also stores the tied embedding once
    spec.save(str(output))
    meta = {"config": config.to_dict(), "vocab_size": vocab_size}
    (output / CT2_RAYMT_CONFIG).write_text(json.dumps(meta, indent=2))


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
    """Write weights, config.json and spm.model (or a CTranslate2 model) of `checkpoint` to a new `output`."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    fmt = weights_format(fmt)
    config, tokenizer = check_checkpoint(checkpoint)
    state = load_weights(checkpoint)
    # Build the model once: the weights must match the config before anything is written.
    model = build_model(config.model, tokenizer.vocab_size)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{checkpoint}: weights do not match config.json ({str(err).splitlines()[0]})") from None
    spec = ctranslate2_spec(model, tokenizer) if fmt == "ctranslate2" else None
    state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --output {output}: {err.strerror}") from None
    tokenizer.save(output / SPM_FILE)
    if spec is not None:
        save_ctranslate2(spec, output, config, tokenizer.vocab_size, dtype)
        return output
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
    if args.format == "ctranslate2":
        print(f"translate: ctranslate2.Translator(\"{output}\").translate_batch(pieces) "
              f"with pieces from {output / SPM_FILE}")
    else:
        print(f"translate: python -m raymt.translate --checkpoint {output} \"...\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
