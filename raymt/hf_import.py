"""`raymt import DIR --output CKPT`: a Hugging Face translation model as a raymt checkpoint.

Reads a model directory as `save_pretrained` writes it (config.json, model.safetensors, its shards
or pytorch_model.bin, read with weights_only=True; the tokenizer's files) without transformers or a
network, and writes a checkpoint that every raymt command takes (translate, evaluate, serve,
backtranslate, average, export, `train --init`). The family comes from config.json's model_type:

- `marian` (OPUS-MT): post-norm, swish (or the model's activation), scaled embeddings, a fixed
  `final_logits_bias` (model.output_bias), tied or separate output; two SentencePiece models
  (source.spm, target.spm) over one vocab.json (the checkpoint's tokenizer bundle). Multi-target
  models' `>>fr<<` codes become raymt's source-side tags (<2fr>).

The model computes what the HF model computes. Two rearrangements keep raymt's conventions: the
vocabulary is reordered so raymt's special ids hold (PAD 0, UNK 1, BOS 2 = the HF decoder start,
EOS 3; rows the HF model lacks get a zero embedding and an output bias of ABSENT_LOGIT, so they
take no probability), and Marian's model dimension is reordered from HF's sinusoid layout (sin in
the first half, cos in the second) to raymt's (interleaved), the inverse of `export --format marian`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from raymt.checkpoint import RAYMT_CONFIG_FILE, _safetensors_load, _torch_load, languages_entry, save_checkpoint
from raymt.config import Config, ModelConfig
from raymt.config.corpus import CorpusSpec
from raymt.config.sections import DataConfig
from raymt.errors import cli_error
from raymt.export import marian_order
from raymt.model import build_model
from raymt.tokenizer import PAD_ID, UNK_ID, Tokenizer, round_up

FAMILIES = ("marian",)
# The output bias of vocabulary rows the imported model does not have (raymt's padding rows, a
# second copy of a special): exp(-100) is no probability next to any logit a model produces.
ABSENT_LOGIT = -100.0
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
LANGUAGE_CODE = re.compile(r"^>>([A-Za-z_]+)<<$")  # OPUS-MT's multi-target codes, >>fr<<, >>por<<


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="raymt import", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="a Hugging Face model directory (OPUS-MT Marian, M2M-100 or NLLB)")
    p.add_argument("--output", required=True, help="new directory for the raymt checkpoint")
    p.add_argument("--src-lang", help="the source language, when neither the tokenizer nor the name says it")
    p.add_argument("--tgt-lang", help="the target language, when neither the tokenizer nor the name says it")
    return p.parse_args(argv)


@dataclass
class HFModel:
    """What a Hugging Face directory holds: config.json, the weights, tokenizer_config.json."""

    directory: Path
    config: dict
    state: dict
    tokenizer_config: dict = field(default_factory=dict)

    def get(self, name: str, default=None):
        """A config.json field."""
        return self.config.get(name, default)

    def file(self, name: str, why: str) -> Path:
        """A file of the directory that must exist; a one-line error naming it otherwise."""
        path = self.directory / name
        if not path.is_file():
            raise ValueError(f"{self.directory} has no {name} ({why}); copy the model's whole directory")
        return path

    def tensor(self, name: str) -> torch.Tensor:
        """A float32 weight by its HF name; a one-line error when the file lacks it."""
        if name not in self.state:
            raise ValueError(
                f"{self.directory}: the weights have no {name}, which config.json's model needs; "
                "the weights and config.json come from different models"
            )
        return self.state[name].float()


def _json(path: Path) -> dict:
    """A JSON object file, with a one-line error."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def read_weights(directory: Path) -> dict:
    """The state dict of model.safetensors, its shards (model.safetensors.index.json) or
    pytorch_model.bin (weights only: no code runs)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        state: dict = {}
        for shard in sorted(set(_json(index).get("weight_map", {}).values())):
            state.update(_safetensors_load(directory / shard))
        return state
    if (directory / "model.safetensors").is_file():
        return _safetensors_load(directory / "model.safetensors")
    if (directory / "pytorch_model.bin").is_file():
        return _torch_load(directory / "pytorch_model.bin")
    raise ValueError(f"{directory} has no model.safetensors or pytorch_model.bin: not a saved Hugging Face model")


def read_hf(directory: str | Path) -> HFModel:
    """config.json, the weights and tokenizer_config.json of a model directory, the family checked."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory; give a Hugging Face model directory (save_pretrained)")
    config = _json(HFModel(directory, {}, {}).file("config.json", "the model's configuration"))
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        what = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise ValueError(
            f"{directory} holds a {model_type or 'model without a model_type'} model ({what}); raymt imports "
            "encoder-decoder translation models of the families marian (OPUS-MT) and m2m_100 (M2M-100, NLLB)"
        )
    tokenizer_config = directory / "tokenizer_config.json"
    extra = _json(tokenizer_config) if tokenizer_config.is_file() else {}
    return HFModel(directory, config, read_weights(directory), extra)


# ---------------------------------------------------------------- vocabulary


def row_order(num_hf: int, pad: int, unk: int, start: int, eos: int) -> list[Optional[int]]:
    """raymt id -> HF id (None: a row the HF model lacks): PAD, UNK, BOS (the decoder's start), EOS
    first, then every other HF id in order, padded to a multiple of 8."""
    specials = [pad if pad != start else None, unk, start, eos]
    rest = [i for i in range(num_hf) if i not in specials]
    rows = specials + rest
    return rows + [None] * (round_up(len(rows)) - len(rows))


def take_rows(weight: torch.Tensor, rows: list[Optional[int]]) -> torch.Tensor:
    """(V_hf, ...) -> (V, ...): HF rows in raymt's order, zeros where the HF model has none."""
    out = weight.new_zeros((len(rows), *weight.shape[1:]))
    present = [r for r, h in enumerate(rows) if h is not None]
    out[present] = weight[[rows[r] for r in present]]
    return out


def output_bias(bias: Optional[torch.Tensor], rows: list[Optional[int]]) -> Optional[torch.Tensor]:
    """(V,) raymt's output bias: the HF one in raymt's order, ABSENT_LOGIT on rows the HF model
    lacks; None when there is nothing to add (a zero bias and every row present)."""
    if bias is None and all(h is not None for h in rows):
        return None
    out = take_rows(bias[:, None] if bias is not None else torch.zeros(len(rows), 1), rows)[:, 0]
    out[[r for r, h in enumerate(rows) if h is None]] = ABSENT_LOGIT
    return None if not out.any() else out


# ---------------------------------------------------------------- Marian (OPUS-MT)


def marian_shape(hf: HFModel, vocab_size: int, output_bias_: bool) -> ModelConfig:
    """raymt's ModelConfig for a MarianConfig; a one-line error for what raymt's model cannot be."""
    g = hf.get
    heads, ffn = g("encoder_attention_heads", 8), g("encoder_ffn_dim", 2048)
    activation = ACTIVATIONS.get(g("activation_function", "swish"))
    problems = [
        f"{name} {g(name)} != {other} {g(other)}"
        for name, other in (
            ("decoder_attention_heads", "encoder_attention_heads"),
            ("decoder_ffn_dim", "encoder_ffn_dim"),
        )
        if g(name, g(other)) != g(other, g(name))
    ]
    if activation is None:
        problems.append(f"activation_function {g('activation_function')!r} (raymt has swish, relu, gelu)")
    if g("normalize_before", False):
        problems.append("normalize_before")
    if problems:
        raise ValueError(f"{hf.directory}: raymt's model cannot compute this one: {'; '.join(problems)}")
    return ModelConfig(
        d_model=g("d_model", 512),
        num_heads=heads,
        d_ff=ffn,
        num_encoder_layers=g("encoder_layers", 6),
        num_decoder_layers=g("decoder_layers", 6),
        dropout=g("dropout", 0.1),
        attention_dropout=g("attention_dropout", 0.0),
        activation=activation,
        pre_norm=False,
        max_positions=g("max_position_embeddings", 512),
        scale_embedding=bool(g("scale_embedding", False)),
        positions="sinusoidal",
        output_bias=output_bias_,
        tie_output=bool(g("tie_word_embeddings", True)),
    )


def marian_vocab(hf: HFModel) -> dict[str, int]:
    """vocab.json (piece -> HF id), checked against the embedding; separate vocabularies refused."""
    if hf.tokenizer_config.get("separate_vocabs") or (hf.directory / "target_vocab.json").is_file():
        raise ValueError(
            f"{hf.directory}: separate source and target vocabularies (separate_vocabs) are not "
            "supported yet; OPUS-MT models with one vocab.json import"
        )
    vocab = _json(hf.file("vocab.json", "OPUS-MT's vocabulary"))
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise ValueError(f"{hf.directory / 'vocab.json'}: ids are not 0..{len(ids) - 1} each once")
    rows = shared_embedding(hf).shape[0]
    if not len(vocab) == rows == hf.get("vocab_size", rows):
        raise ValueError(
            f"{hf.directory}: the embedding has {rows} rows, config.json's vocab_size is {hf.get('vocab_size')} "
            f"and vocab.json has {len(vocab)} pieces; they must be equal (files of different models?)"
        )
    return vocab


def piece_names(pieces_of: dict[int, str], rows: list[Optional[int]]) -> list[str]:
    """raymt id -> piece: the HF id's piece, or a name of raymt's for a row the HF model lacks
    (PAD's <raymt_pad>, export's <raymt_filler_N>): unique, never made from text."""
    return [
        pieces_of[h] if h is not None else "<raymt_pad>" if r == PAD_ID else f"<raymt_filler_{r}>"
        for r, h in enumerate(rows)
    ]


def marian_tokenizer(hf: HFModel, vocab: dict[str, int], rows: list[Optional[int]]) -> Tokenizer:
    """The bundle of source.spm, target.spm and vocab.json in raymt's id order; >>xx<< codes are
    controls aliased as <2xx>."""
    pieces = piece_names({i: p for p, i in vocab.items()}, rows)
    source = hf.file("source.spm", "OPUS-MT's source SentencePiece model").read_bytes()
    target = hf.file("target.spm", "OPUS-MT's target SentencePiece model").read_bytes()
    codes = {r: LANGUAGE_CODE.match(p).group(1) for r, p in enumerate(pieces) if LANGUAGE_CODE.match(p)}
    try:
        tokenizer = Tokenizer.bundle(source, target, pieces, codes, {f"<2{c}>": r for r, c in codes.items()})
    except RuntimeError as err:
        raise ValueError(f"{hf.directory}: source.spm or target.spm is not a SentencePiece model ({err})") from None
    return plain_if_raymt(tokenizer, source, target)


def plain_if_raymt(tokenizer: Tokenizer, source: bytes, target: bytes) -> Tokenizer:
    """A raymt export's vocabulary (one SentencePiece model whose ids are the model's, padded with
    export's fillers) as the plain SentencePiece tokenizer it was; any other unchanged."""
    if source != target:
        return tokenizer
    try:
        plain = Tokenizer(source)
    except (AssertionError, RuntimeError):  # not raymt's special ids
        return tokenizer
    n = plain.num_pieces
    same = plain.vocab_size == tokenizer.vocab_size and tokenizer.pieces[:n] == [plain.id_to_piece(i) for i in range(n)]
    fillers = all(p.startswith("<raymt_filler_") or not p for p in tokenizer.pieces[n:])
    return plain if same and fillers else tokenizer


def shared_embedding(hf: HFModel) -> torch.Tensor:
    """(V, D) the one embedding of source and target: model.shared, or the stacks' own when saved
    apart (they must be equal: raymt's model has one)."""
    names = [n for n in ("model.shared.weight", "model.encoder.embed_tokens.weight") if n in hf.state]
    embed = hf.tensor(names[0] if names else "model.shared.weight")
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        if name in hf.state and not torch.equal(hf.tensor(name), embed):
            raise ValueError(
                f"{hf.directory}: the encoder and decoder have different embeddings ({name} differs); "
                "raymt's model shares one between source and target"
            )
    return embed


def marian_weights(hf: HFModel, rows: list[Optional[int]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """raymt's state dict from HF Marian's: rows in raymt's order, dims in raymt's sinusoid layout."""
    inv = torch.argsort(marian_order(cfg.d_model))  # HF dim k holds raymt dim order[k]
    t = hf.tensor
    state = {"embed.weight": take_rows(shared_embedding(hf)[:, inv], rows)}
    if not cfg.tie_output:
        state["output.weight"] = take_rows(t("lm_head.weight")[:, inv], rows)

    def attention(prefix: str) -> dict[str, torch.Tensor]:
        return {
            "q_proj.weight": t(f"{prefix}.q_proj.weight")[:, inv],
            "q_proj.bias": t(f"{prefix}.q_proj.bias"),
            "kv_proj.weight": torch.cat([t(f"{prefix}.k_proj.weight"), t(f"{prefix}.v_proj.weight")])[:, inv],
            "kv_proj.bias": torch.cat([t(f"{prefix}.k_proj.bias"), t(f"{prefix}.v_proj.bias")]),
            "out_proj.weight": t(f"{prefix}.out_proj.weight")[inv],
            "out_proj.bias": t(f"{prefix}.out_proj.bias")[inv],
        }

    for side, num in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(num):
            hf_layer, layer = f"model.{side}.layers.{i}", f"{side}.{i}"
            parts = {"self_attn": "self_attn", "res1.norm": "self_attn_layer_norm"}
            if side == "decoder":
                parts.update({"cross_attn": "encoder_attn", "res2.norm": "encoder_attn_layer_norm"})
            parts["res3.norm" if side == "decoder" else "res2.norm"] = "final_layer_norm"
            for ours, theirs in parts.items():
                if ours.endswith("norm"):
                    for p in ("weight", "bias"):
                        state[f"{layer}.{ours}.{p}"] = t(f"{hf_layer}.{theirs}.{p}")[inv]
                else:
                    state.update({f"{layer}.{ours}.{k}": v for k, v in attention(f"{hf_layer}.{theirs}").items()})
            state[f"{layer}.ffn.fc1.weight"] = t(f"{hf_layer}.fc1.weight")[:, inv]
            state[f"{layer}.ffn.fc1.bias"] = t(f"{hf_layer}.fc1.bias")
            state[f"{layer}.ffn.fc2.weight"] = t(f"{hf_layer}.fc2.weight")[inv]
            state[f"{layer}.ffn.fc2.bias"] = t(f"{hf_layer}.fc2.bias")[inv]
    return state


def marian_languages(hf: HFModel, tokenizer: Tokenizer, src: str) -> Optional[dict]:
    """A multi-target model's languages entry (its >>xx<< codes as source-side tags), a raymt
    export's own (raymt_config.json), else None (one pair)."""
    saved = hf.directory / RAYMT_CONFIG_FILE
    if saved.is_file():
        return _json(saved).get("languages")
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.num_pieces)]
    tags = {f"<2{m.group(1)}>": i for i, m in enumerate(map(LANGUAGE_CODE.match, pieces)) if m}
    if not tags:
        return None
    return languages_entry([(src, tag[2:-1]) for tag in tags if tag[2:-1] != src], tags)


def import_marian(hf: HFModel, src_lang: Optional[str], tgt_lang: Optional[str]) -> tuple:
    """(model config, state dict, tokenizer, languages, (src, tgt)) of an OPUS-MT directory."""
    vocab = marian_vocab(hf)
    start = hf.get("decoder_start_token_id", hf.get("pad_token_id"))
    rows = row_order(len(vocab), hf.get("pad_token_id"), vocab.get("<unk>", UNK_ID), start, hf.get("eos_token_id"))
    tokenizer = marian_tokenizer(hf, vocab, rows)
    multi = any(map(LANGUAGE_CODE.match, vocab)) or (hf.directory / RAYMT_CONFIG_FILE).is_file()
    src, tgt = pair_of(hf, src_lang, tgt_lang, need_tgt=not multi)
    bias = hf.state.get("final_logits_bias")
    bias = output_bias(bias.float().reshape(-1) if bias is not None else None, rows)
    cfg = marian_shape(hf, len(rows), bias is not None)
    state = marian_weights(hf, rows, cfg)
    if bias is not None:
        state["output_bias"] = bias
    languages = marian_languages(hf, tokenizer, src) if multi else None
    return cfg, state, tokenizer, languages, (src, tgt)


# ---------------------------------------------------------------- languages and the command


def pair_of(hf: HFModel, src_lang: Optional[str], tgt_lang: Optional[str], need_tgt: bool = True) -> tuple:
    """(source, target) language: the flags, else tokenizer_config.json's source_lang/target_lang,
    else the directory's name (opus-mt-en-de); a one-line error asking for the flags otherwise."""
    named = re.search(r"(?:^|[-_])([a-z]{2,3})-([a-z]{2,3}|[A-Za-z]+)$", hf.directory.resolve().name)
    saved = hf.directory / RAYMT_CONFIG_FILE  # a raymt export's pair
    ours = Config.from_dict(_json(saved)["config"]).data.pair() if saved.is_file() else (None, None)
    src = src_lang or hf.tokenizer_config.get("source_lang") or ours[0] or (named.group(1) if named else None)
    tgt = tgt_lang or hf.tokenizer_config.get("target_lang") or ours[1]
    tgt = tgt or (named.group(2) if named and named.group(2).islower() else None)
    if src is None or (tgt is None and need_tgt):
        raise ValueError(
            f"{hf.directory}: cannot tell the model's languages (no source_lang/target_lang in "
            "tokenizer_config.json, no opus-mt-SRC-TGT name): pass --src-lang and --tgt-lang"
        )
    return src, tgt


def import_model(
    directory: str | Path, output: str | Path, src_lang: Optional[str] = None, tgt_lang: Optional[str] = None
) -> Path:
    """Write the HF model of `directory` as a raymt checkpoint in a new `output` directory."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    hf = read_hf(directory)
    model_cfg, state, tokenizer, languages, (src, tgt) = import_marian(hf, src_lang, tgt_lang)
    pairs = languages["pairs"] if languages else [(src, tgt)]
    # data.corpus names the directory imported: what the model was trained on is not raymt's to
    # know, and its pairs (any languages, not the built-in corpus's) name no files. A training run
    # from it (`--init`) names its own corpora.
    data = DataConfig(corpora=[CorpusSpec(s, t) for s, t in pairs], corpus=str(hf.directory.resolve()))
    config = Config(model=model_cfg, data=data)
    model = build_model(model_cfg, tokenizer.vocab_size)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"{hf.directory}: the weights do not fit config.json's shape ({str(err).splitlines()[0]})"
        ) from None
    return save_checkpoint(output, model.eval(), config, tokenizer, languages=languages)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        output = import_model(args.directory, args.output, args.src_lang, args.tgt_lang)
    except ValueError as err:
        return cli_error("raymt import", err)
    print(f"imported {args.directory} -> {output}")
    print(f'translate: raymt translate --checkpoint {output} "..."')
    return 0


if __name__ == "__main__":
    sys.exit(main())
