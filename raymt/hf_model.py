"""What `raymt import` reads of a Hugging Face model directory for every family (raymt.hf_import):
the directory (`HFModel`: config.json, the weights, tokenizer_config.json), the vocabulary's rows
in raymt's order (`row_order`: PAD 0, UNK 1, BOS 2 = the HF decoder start, EOS 3; rows the HF
model lacks get an output bias of ABSENT_LOGIT), the model's shape (`model_shape`) and its weights
under raymt's names (`hf_weights`). A family (raymt.hf_marian, raymt.hf_m2m) reads its vocabulary
and languages and returns what it imported (`Imported`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import NamedTuple, Optional

import torch

from raymt.checkpoint import read_safetensors, read_torch_file
from raymt.config import ModelConfig
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, round_up

# The output bias of vocabulary rows the imported model does not have (raymt's padding rows, a
# second copy of a special): exp(-100) is no probability next to any logit a model produces.
ABSENT_LOGIT = -100.0
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}


class Imported(NamedTuple):
    """What a family's importer (`import_marian`, `import_m2m`) makes of a directory."""

    model: ModelConfig
    state: dict[str, torch.Tensor]  # raymt's state dict
    tokenizer: Tokenizer
    languages: Optional[dict]  # the checkpoint's languages entry; None: one untagged pair
    pairs: list[tuple[str, str]]  # data.corpora's pairs (the first: the default direction)


@dataclass
class HFModel:
    """What a Hugging Face directory holds: config.json, the weights, tokenizer_config.json."""

    directory: Path
    config: dict
    state: dict
    tokenizer_config: dict = field(default_factory=dict)
    name: str = ""  # the model's name (opus-mt-en-de): a Hub id's, or by default the directory's

    def __post_init__(self) -> None:
        self.name = self.name or self.directory.resolve().name

    def get(self, name: str, default=None):
        """A config.json field."""
        return self.config.get(name, default)

    def file(self, name: str, why: str) -> Path:
        """A file of the directory that must exist; a one-line error naming it otherwise."""
        path = self.directory / name
        if not path.is_file():
            raise ValueError(f"{self.directory} has no {name} ({why}); copy the model's whole directory")
        return path

    def json(self, name: str, why: Optional[str] = None) -> dict:
        """A JSON object file of the directory (`read_json`): with `why`, one that must exist
        (`file`); without, {} when it is absent."""
        if why is not None:
            return read_json(self.file(name, why))
        return read_json(self.directory / name) if (self.directory / name).is_file() else {}

    def tensor(self, name: str) -> torch.Tensor:
        """A float32 weight by its HF name; a one-line error when the file lacks it."""
        if name not in self.state:
            raise ValueError(
                f"{self.directory}: the weights have no {name}, which config.json's model needs; "
                "the weights and config.json come from different models"
            )
        return self.state[name].float()


def read_json(path: Path) -> dict:
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
        for shard in shard_files(index):
            state.update(read_safetensors(shard))
        return state
    if (directory / "model.safetensors").is_file():
        return read_safetensors(directory / "model.safetensors")
    if (directory / "pytorch_model.bin").is_file():
        return read_torch_file(directory / "pytorch_model.bin")
    raise ValueError(f"{directory} has no model.safetensors or pytorch_model.bin: not a saved Hugging Face model")


def shard_files(index: Path) -> list[Path]:
    """The shards that model.safetensors.index.json's weight_map names, all checked before any is
    read: each a file of the index's directory (a name that leaves it, "../x" or "/x", is refused)
    that is there."""
    directory = index.parent
    weight_map = read_json(index).get("weight_map", {})
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is not a JSON object (tensor name -> shard file)")
    for name in weight_map.values():
        path = PurePosixPath(name) if isinstance(name, str) and name else None
        if path is None or path.is_absolute() or ".." in path.parts:
            raise ValueError(
                f"{index}: weight_map names the shard {name!r}, which is not a file of {directory}; "
                "refusing to read it: the index must name the model's own shards (model-00001-of-00002.safetensors)"
            )
    names = sorted(set(weight_map.values()))
    for name in names:
        if not (directory / name).is_file():
            raise ValueError(
                f"{directory} has no {name} (a shard {index.name} names); copy the model's whole directory"
            )
    return [directory / name for name in names]


# ---------------------------------------------------------------- vocabulary


def row_order(num_hf: int, pad: int, unk: int, start: int, eos: int) -> list[Optional[int]]:
    """raymt id -> HF id (None: a row the HF model lacks): PAD, UNK, BOS (the decoder's start), EOS
    first, then every other HF id in order, padded to a multiple of 8. A decoder that starts with
    EOS (NLLB's </s>) has it twice: as BOS and as EOS (`second_copy`)."""
    specials = [pad if pad != start else None, unk, start, eos]
    rest = [i for i in range(num_hf) if i not in specials]
    rows = specials + rest
    return rows + [None] * (round_up(len(rows)) - len(rows))


def second_copy(rows: list[Optional[int]], r: int) -> bool:
    """Whether raymt row r repeats another row's HF id: BOS where the decoder starts with EOS."""
    return r == BOS_ID and rows[BOS_ID] == rows[EOS_ID]


def take_rows(weight: torch.Tensor, rows: list[Optional[int]]) -> torch.Tensor:
    """(V_hf, ...) -> (V, ...): HF rows in raymt's order, zeros where the HF model has none."""
    out = weight.new_zeros((len(rows), *weight.shape[1:]))
    present = [r for r, h in enumerate(rows) if h is not None]
    out[present] = weight[[rows[r] for r in present]]
    return out


def output_bias(bias: Optional[torch.Tensor], rows: list[Optional[int]]) -> Optional[torch.Tensor]:
    """(V,) raymt's output bias: the HF one in raymt's order, ABSENT_LOGIT on rows the HF model
    lacks and on a `second_copy`; None when there is nothing to add (a zero bias, every row once)."""
    out = take_rows(bias[:, None] if bias is not None else torch.zeros(len(rows), 1), rows)[:, 0]
    out[[r for r, h in enumerate(rows) if h is None or second_copy(rows, r)]] = ABSENT_LOGIT
    return None if not out.any() else out


def piece_names(pieces_of: dict[int, str], rows: list[Optional[int]]) -> list[str]:
    """raymt id -> piece: the HF id's piece, or a name of raymt's for a row without one (PAD's
    <raymt_pad>, BOS's <raymt_bos> as a `second_copy`, export's <raymt_filler_N>, <raymt_row_N>
    for an HF row no piece names): unique, never made from text."""
    names = []
    for r, h in enumerate(rows):
        if h is None:
            names.append("<raymt_pad>" if r == PAD_ID else f"<raymt_filler_{r}>")
        else:
            names.append("<raymt_bos>" if second_copy(rows, r) else pieces_of.get(h, f"<raymt_row_{r}>"))
    return names


def shared_embedding(hf: HFModel) -> torch.Tensor:
    """(V, D) the one embedding of source and target: model.shared, or the stacks' own when saved
    apart (they must be equal: raymt's model has one)."""
    names = [n for n in ("model.shared.weight", "model.encoder.embed_tokens.weight") if n in hf.state]
    embed = hf.tensor(names[0] if names else "model.shared.weight")
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        if name in hf.state and not torch.equal(hf.tensor(name), embed):
            raise ValueError(
                f"{hf.directory}: the encoder and decoder have different embeddings ({name} differs) but "
                "config.json's share_encoder_decoder_embeddings is true (files of different models?)"
            )
    return embed


def embeddings(hf: HFModel) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(V, D) the encoder's embedding and (V_tgt, D) the decoder's own, None when they are one
    (`shared_embedding`; a Marian config's share_encoder_decoder_embeddings, true by default)."""
    if hf.get("share_encoder_decoder_embeddings", True):
        return shared_embedding(hf), None
    encoder = "model.encoder.embed_tokens.weight"
    source = hf.tensor(encoder if encoder in hf.state else "model.shared.weight")
    return source, hf.tensor("model.decoder.embed_tokens.weight")


# ---------------------------------------------------------------- the model


def model_shape(hf: HFModel, output_bias_: bool, target_vocab_size: Optional[int] = None) -> ModelConfig:
    """raymt's ModelConfig for a MarianConfig (post-norm) or M2M100Config (pre-norm, fairseq's
    positions), with a decoder embedding of its own of `target_vocab_size` rows if given; a
    one-line error for what raymt's model cannot be."""
    g, m2m = hf.get, hf.get("model_type") == "m2m_100"
    activation = ACTIVATIONS.get(g("activation_function", "relu" if m2m else "swish"))
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
    if g("normalize_before", False) and not m2m:
        problems.append("normalize_before")
    if m2m and g("pad_token_id", 1) != 1:
        problems.append(f"pad_token_id {g('pad_token_id')} (raymt's fairseq positions count from pad_token_id 1)")
    if problems:
        raise ValueError(f"{hf.directory}: raymt's model cannot compute this one: {'; '.join(problems)}")
    return ModelConfig(
        d_model=g("d_model", 1024 if m2m else 512),
        num_heads=g("encoder_attention_heads", 16 if m2m else 8),
        d_ff=g("encoder_ffn_dim", 4096 if m2m else 2048),
        num_encoder_layers=g("encoder_layers", 12 if m2m else 6),
        num_decoder_layers=g("decoder_layers", 12 if m2m else 6),
        dropout=g("dropout", 0.1),
        attention_dropout=g("attention_dropout", 0.1 if m2m else 0.0),
        activation=activation,
        pre_norm=m2m,
        max_positions=g("max_position_embeddings", 1024 if m2m else 512),
        scale_embedding=bool(g("scale_embedding", m2m)),
        positions="fairseq" if m2m else "sinusoidal",
        output_bias=output_bias_,
        tie_output=bool(g("tie_word_embeddings", True)),
        target_vocab_size=target_vocab_size,
    )


def hf_weights(
    hf: HFModel, rows: list[Optional[int]], cfg: ModelConfig, inv=slice(None), target_rows: Optional[list] = None
) -> dict[str, torch.Tensor]:
    """raymt's state dict from HF Marian's or M2M-100's: rows in raymt's order (the decoder's
    embedding and output in `target_rows`', default `rows`), model dims taken in the order `inv`
    (Marian: raymt's sinusoid layout; M2M-100: as they are), a pre-norm model's final stack norms."""
    t, target_rows = hf.tensor, target_rows or rows
    source, target = embeddings(hf)
    state = {"embed.weight": take_rows(source[:, inv], rows)}
    if target is not None:
        state["target_embed.weight"] = take_rows(target[:, inv], target_rows)
    if not cfg.tie_output:
        state["output.weight"] = take_rows(t("lm_head.weight")[:, inv], target_rows)
    for side in ("encoder", "decoder") if cfg.pre_norm else ():
        for p in ("weight", "bias"):
            state[f"{side}_norm.{p}"] = t(f"model.{side}.layer_norm.{p}")[inv]

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
