"""The writers behind `raymt export` (raymt/export.py is the command) and the CTranslate2 engine's
cache (raymt.engines): `export_model` writes a checkpoint as a self-contained weights directory, a
CTranslate2 model directory or a Hugging Face Marian directory. A module of the model's floor
(tests/test_layout.py FLOORS), so an engine exports without importing a command.

The output holds the weights (`model.safetensors` when the safetensors package is
installed, else a weights-only torch `model.pt`), `config.json` and the SentencePiece
`spm.model`: no optimizer state, no Ray, no run directory. `python -m raymt.translate
--checkpoint OUT` and `python -m raymt.evaluate --checkpoint OUT` load it; loading never
executes code from the files (safetensors, or torch.load with weights_only=True).

`--format ctranslate2` writes a CTranslate2 model directory instead (`model.bin`, its
`config.json` and `shared_vocabulary.json`, or source_ and target_vocabulary.json for a model of
separate vocabularies, plus `spm.model` and raymt's config as
`raymt_config.json`) for `ctranslate2.Translator`; it needs the ctranslate2 package.

`--format marian` writes a Hugging Face directory that `transformers.MarianMTModel.
from_pretrained(OUT)` and `MarianTokenizer.from_pretrained(OUT)` load (`config.json`,
`model.safetensors`, `generation_config.json`, `source.spm`/`target.spm`/`vocab.json` (and
`target_vocab.json` for separate vocabularies), plus
`spm.model` and `raymt_config.json`); it needs the transformers package. The Marian model
computes raymt's logits (to float rounding): same weights and embeddings, sqrt(D) scaling,
post-norm layers, ReLU or exact GELU, raymt's dropout rates. Marian cannot represent
pre-norm models (`model.pre_norm=true`, the default: no pre-norm layers, no final stack
norms), which are refused. HF recomputes its own sinusoid table on load (cos in the second
half of each vector), so the export reorders the model dimension to match it: raymt's
dims 0, 2, 4, ... come first, then 1, 3, 5, ...; the model computes the same function.
(transformers 5.24 reloads those tables as trainable parameters: freeze them with
`embed_positions.weight.requires_grad_(False)` before fine-tuning to train as raymt does.)
HF's `generate` stops at one `max_length` per batch (raymt: a * source length + b per
sentence) and scores by its own length penalty (equal to raymt's at 0).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from raymt.checkpoint import (
    MODEL_FILE,
    RAYMT_CONFIG_FILE,
    SAFETENSORS_FILE,
    SPM_FILE,
    check_checkpoint,
    config_meta,
    load_weights,
    model_languages,
    save_config,
)
from raymt.config import Config, ModelConfig
from raymt.model import Attention, Transformer, build_model, halves_order
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMATS = ("auto", "safetensors", "torch", "ctranslate2", "marian")
MARIAN_POST_NORM_ONLY = (
    "--format marian needs a post-norm model (model.pre_norm=false): HF Marian "
    "has no pre-norm layers; export this one with --format safetensors or ctranslate2"
)


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


def _set_stack(spec, model: Transformer, embed: torch.nn.Embedding, final_norm: torch.nn.Module) -> None:
    """A stack's embedding, the positions and its final norm (the encoder's and decoder's specs)."""
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = _array(embed.weight)  # (V, D); tied: aliased once on save
    spec.scale_embeddings = model.cfg.scale_embedding  # x * sqrt(D), as Transformer._embed
    # raymt's own table (sin on even, cos on odd dims), not CTranslate2's built-in layout.
    spec.position_encodings.encodings = _array(model.positions)  # (max_positions, D)
    if model.cfg.pre_norm:
        _set_norm(spec.layer_norm, final_norm)


def ct2_vocabulary(tokenizer: Tokenizer, side: str = "src") -> list[str]:
    """The pieces of `side`'s ids in id order, padded to the model's rows with unique fillers."""
    pieces = tokenizer.pieces_of(side)
    rows = tokenizer.target_vocab_size if side == "tgt" else tokenizer.vocab_size
    fillers = [f"<raymt_filler_{i}>" for i in range(len(pieces), rows)]
    if len(set(pieces + fillers)) != rows:
        raise ValueError("spm.model has duplicate pieces or pieces named <raymt_filler_N>")
    return pieces + fillers


def _set_weights(spec, model: Transformer) -> None:
    """Every weight of a TransformerSpec from the raymt model."""
    _set_stack(spec.encoder, model, model.embed, model.encoder_norm)
    _set_stack(spec.decoder, model, model.target_embedding(), model.decoder_norm)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.res1.norm, True)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.res2.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.res1.norm, True)
        _set_attention(layer_spec.attention, layer.cross_attn, layer.res2.norm, False)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.res3.norm)
    # logits = x @ embed.T (or the untied output), no bias but an imported model's fixed one
    # (model.output_bias). raymt.decoding also sets the log-probs of PAD and BOS to -inf after
    # the softmax; a bias there would instead renormalize every other log-prob.
    spec.decoder.projection.weight = _array(model.output_weight())  # (V_tgt, D)
    if model.output_bias is not None:
        spec.decoder.projection.bias = _array(model.output_bias)


def _set_vocabulary(spec, tokenizer: Tokenizer) -> None:
    """The source and target vocabularies (one list twice when shared) and raymt's special tokens:
    BOS starts the decoder, EOS ends both sides."""
    spec.register_source_vocabulary(ct2_vocabulary(tokenizer, "src"))
    spec.register_target_vocabulary(ct2_vocabulary(tokenizer, "tgt"))
    # CTranslate2 names UNK and EOS once for both vocabularies.
    differ = [i for i in (UNK_ID, EOS_ID) if tokenizer.id_to_piece(i) != tokenizer.id_to_piece(i, "tgt")]
    if differ:
        names = ", ".join(f"{tokenizer.id_to_piece(i)} / {tokenizer.id_to_piece(i, 'tgt')}" for i in differ)
        raise ValueError(
            f"--format ctranslate2 names UNK and EOS once for both vocabularies; this model's differ ({names})"
        )
    piece = tokenizer.id_to_piece
    spec.config.unk_token, spec.config.bos_token = piece(UNK_ID), piece(BOS_ID, "tgt")
    spec.config.eos_token = piece(EOS_ID)
    spec.config.decoder_start_token = piece(BOS_ID, "tgt")
    spec.config.add_source_eos = True  # raymt sources are pieces + EOS, without BOS


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer):
    """The model as a ctranslate2.specs.TransformerSpec (imported here: ctranslate2 is optional)."""
    try:
        from ctranslate2.specs import TransformerSpec, common_spec
    except ImportError:
        raise ValueError("--format ctranslate2 needs the ctranslate2 package: pip install ctranslate2") from None
    cfg = model.cfg
    # F.gelu is the exact (erf) GELU: Activation.GELU, not GELUTanh; F.silu is SWISH.
    activation = {"gelu": common_spec.Activation.GELU, "swish": common_spec.Activation.SWISH}.get(
        cfg.activation, common_spec.Activation.RELU
    )
    spec = TransformerSpec.from_config(
        (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads, pre_norm=cfg.pre_norm, activation=activation
    )
    _set_weights(spec, model)
    _set_vocabulary(spec, tokenizer)
    spec.config.layer_norm_epsilon = model.encoder[0].res1.norm.eps  # torch's 1e-5
    return spec


def save_ctranslate2(
    spec, output: Path, config: Config, vocab_size: int, dtype: str, languages: Optional[dict] = None
) -> None:
    """Validate, store weights as `dtype` and write the CTranslate2 directory plus raymt_config.json
    (with the model's `languages`: its tags are pieces of the vocabulary, put before a source, or
    with `"tag_side": "tgt"` given as the decoder's `target_prefix`)."""
    spec.validate()
    spec.optimize(quantization=dtype)  # also stores the tied embedding once
    spec.save(str(output))
    (output / RAYMT_CONFIG_FILE).write_text(json.dumps(config_meta(config, vocab_size, languages), indent=2))


# ---------------------------------------------------------------- Hugging Face Marian


def marian_config(cfg: ModelConfig, vocab_size: int, dropout: bool = True):
    """A transformers MarianConfig of raymt's shape: one scaled embedding (or the decoder's own of
    model.target_vocab_size rows), tied to the output or not; raymt's dropout rates (0 everywhere
    without `dropout`)."""
    if cfg.pre_norm:
        raise ValueError(MARIAN_POST_NORM_ONLY)
    try:
        from transformers import MarianConfig
    except ImportError:
        raise ValueError("--format marian needs the transformers package: pip install transformers") from None
    p = cfg.dropout if dropout else 0.0
    # raymt drops after the embedding, each sublayer and the FFN activation (Marian's dropout and
    # activation_dropout), and inside attention (attention_dropout).
    return MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=cfg.target_vocab_size or vocab_size,
        d_model=cfg.d_model,
        encoder_layers=cfg.num_encoder_layers,
        decoder_layers=cfg.num_decoder_layers,
        encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=cfg.activation,
        dropout=p,
        activation_dropout=p,
        attention_dropout=cfg.attention_dropout if dropout else 0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        max_position_embeddings=cfg.max_positions,
        scale_embedding=cfg.scale_embedding,
        share_encoder_decoder_embeddings=cfg.target_vocab_size is None,
        tie_word_embeddings=cfg.tie_output,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
    )


def _marian_attention(attn: Attention, order: torch.Tensor) -> dict[str, torch.Tensor]:
    """q/k/v/out projections of one attention: inputs in HF's dim order, heads unchanged."""
    d = attn.q_proj.out_features
    k_w, v_w = attn.kv_proj.weight.split(d)  # kv_proj's rows: K, then V
    k_b, v_b = attn.kv_proj.bias.split(d)
    out = {
        "q_proj.weight": attn.q_proj.weight[:, order],
        "q_proj.bias": attn.q_proj.bias,
        "k_proj.weight": k_w[:, order],
        "k_proj.bias": k_b,
        "v_proj.weight": v_w[:, order],
        "v_proj.bias": v_b,
        "out_proj.weight": attn.out_proj.weight[order],
        "out_proj.bias": attn.out_proj.bias[order],
    }
    return out


def _marian_layer(layer: torch.nn.Module, order: torch.Tensor) -> dict[str, torch.Tensor]:
    """One encoder or decoder layer under HF Marian's parameter names."""
    out = {f"self_attn.{k}": v for k, v in _marian_attention(layer.self_attn, order).items()}
    norms = [layer.res1.norm, layer.res2.norm]
    names = ["self_attn_layer_norm", "final_layer_norm"]
    if hasattr(layer, "cross_attn"):
        out.update({f"encoder_attn.{k}": v for k, v in _marian_attention(layer.cross_attn, order).items()})
        norms.append(layer.res3.norm)
        names.insert(1, "encoder_attn_layer_norm")
    for name, norm in zip(names, norms):
        out[f"{name}.weight"], out[f"{name}.bias"] = norm.weight[order], norm.bias[order]
    out.update(
        {
            "fc1.weight": layer.ffn.fc1.weight[:, order],
            "fc1.bias": layer.ffn.fc1.bias,
            "fc2.weight": layer.ffn.fc2.weight[order],
            "fc2.bias": layer.ffn.fc2.bias[order],
        }
    )
    return out


def marian_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Every raymt weight under its HF MarianMTModel name, in HF's dim order (positions included)."""
    order = halves_order(model.cfg.d_model).to(model.embed.weight.device)
    if model.target_embed is None:  # (V, D) both stacks' (which transformers 5 unties from
        # model.shared when the output is untied: each stack's name too)
        names = ("shared", "encoder.embed_tokens", "decoder.embed_tokens")
        state = {f"model.{name}.weight": model.embed.weight[:, order] for name in names}
    else:  # (V, D) and (V_tgt, D)
        state = {
            "model.encoder.embed_tokens.weight": model.embed.weight[:, order],
            "model.decoder.embed_tokens.weight": model.target_embed.weight[:, order],
        }
    for side, layers in (("encoder", model.encoder), ("decoder", model.decoder)):
        state[f"model.{side}.embed_positions.weight"] = model.positions[:, order]
        for i, layer in enumerate(layers):
            state.update({f"model.{side}.layers.{i}.{k}": v for k, v in _marian_layer(layer, order).items()})
    return state


@torch.no_grad()
def to_marian(model: Transformer, dropout: bool = True):
    """A transformers MarianMTModel computing what a post-norm raymt model computes (same device
    and train/eval mode; its position tables hold raymt's own float32 values)."""
    from transformers import MarianMTModel

    marian = MarianMTModel(marian_config(model.cfg, model.vocab_size, dropout))
    params = dict(marian.named_parameters())
    params.update(dict(marian.named_buffers()))
    state = marian_state(model)
    missing = {n for n, p in params.items() if p.requires_grad} - set(state) - {"lm_head.weight"}
    assert not missing, f"no raymt weight for {sorted(missing)[:3]}"
    for name, value in state.items():
        if name in params:  # a name tied to another is listed once
            params[name].copy_(value)
    # raymt's logits have no bias but an imported model's (OPUS-MT's final_logits_bias).
    marian.final_logits_bias.copy_(model.output_bias[None] if model.output_bias is not None else 0.0)
    if model.output is not None:
        marian.lm_head.weight.copy_(model.output.weight[:, halves_order(model.cfg.d_model)])
    tied = marian.lm_head.weight.data_ptr() == marian.model.decoder.embed_tokens.weight.data_ptr()
    assert tied == model.cfg.tie_output, "output tying differs"
    return marian.to(model.embed.weight.device).train(model.training)


def save_marian_tokenizer(tokenizer: Tokenizer, output: Path, pair: Optional[tuple[str, str]] = None) -> None:
    """MarianTokenizer files: the source and target SentencePiece models (raymt's one model on both
    sides), vocab.json of raymt's ids (and target_vocab.json of the target's, when separate);
    `pair`: an untagged model's languages."""
    (output / "source.spm").write_bytes(tokenizer.source_proto)
    (output / "target.spm").write_bytes(tokenizer.target_proto)
    for name, side in [("vocab.json", "src")] + ([] if tokenizer.shared else [("target_vocab.json", "tgt")]):
        vocab = {piece: i for i, piece in enumerate(ct2_vocabulary(tokenizer, side))}
        (output / name).write_text(json.dumps(vocab, ensure_ascii=False, indent=1))
    # Marian's tokenizer appends </s> (raymt's EOS) to a source, as raymt does.
    special = {
        "eos_token": tokenizer.id_to_piece(EOS_ID),
        "unk_token": tokenizer.id_to_piece(UNK_ID),
        "pad_token": tokenizer.id_to_piece(PAD_ID),
        "model_max_length": 512,
        "tokenizer_class": "MarianTokenizer",
        "separate_vocabs": not tokenizer.shared,
    }
    if pair is not None:  # what `raymt import` reads the languages from
        special.update(source_lang=pair[0], target_lang=pair[1])
    (output / "tokenizer_config.json").write_text(json.dumps(special, indent=2))


def save_marian(
    model: Transformer, tokenizer: Tokenizer, config: Config, output: Path, dtype: str, languages: Optional[dict] = None
) -> None:
    """Write a MarianMTModel directory (weights in `dtype`), its tokenizer and raymt_config.json."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one file: no bar
    marian = to_marian(model.eval()).to(DTYPES[dtype])
    # raymt's decoders never emit PAD or BOS and stop at max_positions.
    marian.generation_config.update(
        max_length=config.model.max_positions - 1, suppress_tokens=[PAD_ID, BOS_ID], forced_eos_token_id=None
    )
    marian.save_pretrained(str(output))
    save_marian_tokenizer(tokenizer, output, None if languages else config.data.pair())
    meta = config_meta(config, tokenizer.vocab_size, languages)
    (output / RAYMT_CONFIG_FILE).write_text(json.dumps(meta, indent=2))


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


def check_new_output(output: str | Path) -> Path:
    """`output` as a Path; ValueError where it exists and holds files (an export never overwrites)."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    return output


def export_model(checkpoint: str | Path, output: str | Path, fmt: str = "auto", dtype: str = "float32") -> Path:
    """Write `checkpoint` as weights, config.json and spm.model (or CTranslate2, HF Marian) to a new `output`."""
    output = check_new_output(output)
    fmt = weights_format(fmt)
    if dtype not in DTYPES and fmt != "ctranslate2":
        raise ValueError(f"--dtype {dtype} is a CTranslate2 weight type: use it with --format ctranslate2")
    config, tokenizer = check_checkpoint(checkpoint)
    languages = model_languages(checkpoint)  # a multilingual model's tags travel with it
    state = load_weights(checkpoint)
    # Build the model once: the weights must match the config before anything is written.
    model = build_model(config.model, tokenizer.vocab_size)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{checkpoint}: weights do not match config.json ({str(err).splitlines()[0]})") from None
    spec = ctranslate2_spec(model, tokenizer) if fmt == "ctranslate2" else None
    if fmt == "marian":
        marian_config(config.model, tokenizer.vocab_size)  # refuse before anything is written
    store = DTYPES.get(dtype, torch.float32)  # int8: CTranslate2 quantizes its own copy
    state = {k: v.to(store) if v.is_floating_point() else v for k, v in state.items()}
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --output {output}: {err.strerror}") from None
    tokenizer.save(output / SPM_FILE)
    if fmt == "marian":
        save_marian(model, tokenizer, config, output, dtype, languages)
        return output
    if spec is not None:
        save_ctranslate2(spec, output, config, tokenizer.vocab_size, dtype, languages)
        return output
    save_config(output, config, tokenizer.vocab_size, languages)
    save_weights(state, output, fmt)
    return output
