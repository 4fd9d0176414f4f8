"""`raymt import DIR --output CKPT`: a Hugging Face translation model as a raymt checkpoint.

Reads a model directory as `save_pretrained` writes it (config.json, model.safetensors, its shards
or pytorch_model.bin, read with weights_only=True; the tokenizer's files) without transformers or a
network, and writes a checkpoint that every raymt command takes (translate, evaluate, serve,
backtranslate, average, export, `train --init`). The family comes from config.json's model_type:

- `marian` (OPUS-MT): post-norm, swish (or the model's activation), scaled embeddings, a fixed
  `final_logits_bias` (model.output_bias), tied or separate output; two SentencePiece models
  (source.spm, target.spm) over one vocab.json (the checkpoint's tokenizer bundle), or separate
  vocabularies (separate_vocabs: vocab.json the source's, target_vocab.json the target's ids, a
  decoder embedding of its own: model.target_vocab_size). Multi-target models' `>>fr<<` codes
  become raymt's source-side tags (<2fr>).
- `m2m_100` (NLLB-200, M2M-100): pre-norm with final layer norms (model.encoder_norm,
  decoder_norm), relu, scaled embeddings, fairseq's sinusoidal positions (model.positions
  "fairseq": numbered from the padding index 1 + 1); one SentencePiece model
  (sentencepiece.bpe.model) whose pieces are NLLB's ids with fairseq's offset (id + 1 after <s>
  <pad> </s> <unk>) or M2M-100's vocab.json. Its language codes (deu_Latn, __de__) are raymt
  languages ("de" where the code has a two-letter name and no other script in the model, else
  the code: "zho_Hans"): the target's code, which HF forces as the decoder's first token after
  </s>, is the decoder-side tag <2de> (languages' "tag_side": "tgt"); the source's code, first in
  every source, is the model's `source_tags` entry, which `--src-lang` picks. The languages entry
  lists every ordered pair of the model's languages (NLLB-200: 39,800), data.corpora the default
  pair (--src-lang/--tgt-lang, else tokenizer_config.json's src_lang/tgt_lang, else English and
  the first other language), which translate and serve take when no source is named.
  Embedding rows no piece names (NLLB's last two, M2M-100's "madeupword"s) stay, as raymt controls.

The model computes what the HF model computes. Two rearrangements keep raymt's conventions: the
vocabulary is reordered so raymt's special ids hold (PAD 0, UNK 1, BOS 2 = the HF decoder start,
EOS 3; rows the HF model lacks, and BOS where the decoder starts with EOS (</s>, NLLB), get an
output bias of ABSENT_LOGIT, so they take no probability), and Marian's model dimension is
reordered from HF's sinusoid layout (sin in the first half, cos in the second) to raymt's
(interleaved), the inverse of `export --format marian`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import sentencepiece as spm
import torch

from raymt.checkpoint import (
    RAYMT_CONFIG_FILE,
    languages_entry,
    load_config,
    model_languages,
    read_safetensors,
    read_torch_file,
    save_checkpoint,
    tag_side,
)
from raymt.config import Config, ModelConfig
from raymt.config.corpus import CorpusSpec
from raymt.config.sections import DataConfig
from raymt.errors import cli_error
from raymt.model import build_model, halves_order
from raymt.tags import lang_tag
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, round_up

FAMILIES = ("marian", "m2m_100")
# The output bias of vocabulary rows the imported model does not have (raymt's padding rows, a
# second copy of a special): exp(-100) is no probability next to any logit a model produces.
ABSENT_LOGIT = -100.0
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
LANGUAGE_CODE = re.compile(r"^>>([A-Za-z_]+)<<$")  # OPUS-MT's multi-target codes, >>fr<<, >>por<<
NLLB_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")  # NLLB's language codes: deu_Latn, zho_Hant
SPM_NAME = "sentencepiece.bpe.model"  # NLLB's and M2M-100's SentencePiece model
# M2M-100's language codes (transformers' M2M100Tokenizer: __de__ is id len(vocab.json) + its index).
M2M_CODES = {
    "m2m100": (
        "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi hr "
        "ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc or "
        "pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu"
    ).split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}
# ISO 639-3 -> 639-1 of NLLB's languages that have a two-letter name (individual languages as
# their macrolanguage's, as M2M-100 names them: arb ar, pes fa, zsm ms, swh sw).
ISO_639_1 = dict(
    pair.split(":")
    for pair in (
        "afr:af aka:ak als:sq amh:am arb:ar asm:as ayr:ay azj:az bak:ba bam:bm bel:be ben:bn bod:bo bos:bs "
        "bul:bg cat:ca ces:cs cym:cy dan:da deu:de dzo:dz ell:el eng:en epo:eo est:et eus:eu ewe:ee fao:fo "
        "fij:fj fin:fi fra:fr gaz:om gla:gd gle:ga glg:gl grn:gn guj:gu hat:ht hau:ha heb:he hin:hi hrv:hr "
        "hun:hu hye:hy ibo:ig ind:id isl:is ita:it jav:jv jpn:ja kan:kn kas:ks kat:ka kaz:kk khk:mn khm:km "
        "kik:ki kin:rw kir:ky kmr:ku knc:kr kon:kg kor:ko lao:lo lim:li lin:ln lit:lt ltz:lb lug:lg lvs:lv "
        "mal:ml mar:mr mkd:mk mlt:mt mri:mi mya:my nld:nl nno:nn nob:nb npi:ne nya:ny oci:oc ory:or pan:pa "
        "pbt:ps pes:fa plt:mg pol:pl por:pt quy:qu ron:ro run:rn rus:ru sag:sg san:sa sin:si slk:sk slv:sl "
        "smo:sm sna:sn snd:sd som:so sot:st spa:es srd:sc srp:sr ssw:ss sun:su swe:sv swh:sw tam:ta tat:tt "
        "tel:te tgk:tg tgl:tl tha:th tir:ti tsn:tn tso:ts tuk:tk tur:tr twi:tw uig:ug ukr:uk urd:ur uzn:uz "
        "vie:vi wol:wo xho:xh ydd:yi yor:yo zho:zh zsm:ms zul:zu"
    ).split()
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="raymt import", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="a Hugging Face model directory (OPUS-MT Marian, M2M-100 or NLLB)")
    p.add_argument("--output", required=True, help="new directory for the raymt checkpoint")
    p.add_argument(
        "--src-lang",
        help="the source language, when neither the tokenizer nor the name says it; NLLB, M2M-100: the "
        "default pair's (a language of the model: de or deu_Latn)",
    )
    p.add_argument("--tgt-lang", help="the target language, as --src-lang")
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
            state.update(read_safetensors(directory / shard))
        return state
    if (directory / "model.safetensors").is_file():
        return read_safetensors(directory / "model.safetensors")
    if (directory / "pytorch_model.bin").is_file():
        return read_torch_file(directory / "pytorch_model.bin")
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


# ---------------------------------------------------------------- the model (both families)


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


# ---------------------------------------------------------------- Marian (OPUS-MT)


def read_vocab(hf: HFModel, name: str, rows: int, size_field: str) -> dict[str, int]:
    """vocab.json or target_vocab.json (piece -> HF id), checked: ids 0..n-1 each once, one for
    each of the embedding's `rows` and config.json's `size_field`."""
    vocab = _json(hf.file(name, "OPUS-MT's vocabulary"))
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise ValueError(f"{hf.directory / name}: ids are not 0..{len(ids) - 1} each once")
    if not len(vocab) == rows == hf.get(size_field, rows):
        raise ValueError(
            f"{hf.directory}: the {'decoder embedding' if size_field == 'decoder_vocab_size' else 'embedding'} has "
            f"{rows} rows, config.json's {size_field} is {hf.get(size_field)} and {name} has {len(vocab)} pieces; "
            "they must be equal (files of different models?)"
        )
    return vocab


def marian_vocab(hf: HFModel) -> tuple[dict[str, int], Optional[dict[str, int]]]:
    """(vocab.json, target_vocab.json or None: one vocabulary), each piece -> HF id, checked
    against the encoder's and decoder's embeddings. Separate vocabularies as MarianTokenizer reads
    them: tokenizer_config.json's separate_vocabs, else whether target_vocab.json is there."""
    separate = hf.tokenizer_config.get("separate_vocabs", (hf.directory / "target_vocab.json").is_file())
    source, target = embeddings(hf)
    if separate and target is None:
        raise ValueError(
            f"{hf.directory}: separate source and target vocabularies (separate_vocabs) but one embedding "
            "(config.json's share_encoder_decoder_embeddings); files of different models?"
        )
    vocab = read_vocab(hf, "vocab.json", source.shape[0], "vocab_size")
    if target is None:
        return vocab, None
    target_vocab = read_vocab(
        hf, "target_vocab.json" if separate else "vocab.json", target.shape[0], "decoder_vocab_size"
    )
    # The decoder's pad, start and end are ids of the target's vocabulary too.
    ids = {name: hf.get(name) for name in ("pad_token_id", "eos_token_id")}
    ids["decoder_start_token_id"] = marian_start(hf)
    wrong = [f"{name} {i}" for name, i in ids.items() if not (isinstance(i, int) and 0 <= i < len(target_vocab))]
    if wrong:
        raise ValueError(
            f"{hf.directory}: config.json's {', '.join(wrong)} is not a target id (0..{len(target_vocab) - 1})"
        )
    return vocab, target_vocab if separate else None


def marian_start(hf: HFModel) -> int:
    """The HF id the decoder starts with: decoder_start_token_id, else pad_token_id (OPUS-MT's)."""
    return hf.get("decoder_start_token_id", hf.get("pad_token_id"))


def marian_tokenizer(
    hf: HFModel, vocab: dict[str, int], rows: list[Optional[int]], target: Optional[tuple]
) -> Tokenizer:
    """The bundle of source.spm, target.spm and vocab.json in raymt's id order, and of
    `target` = (target_vocab.json, its rows) when the vocabularies are separate; >>xx<< codes
    are controls, aliased as <2xx> on the source side."""
    pieces = piece_names({i: p for p, i in vocab.items()}, rows)
    target_pieces = piece_names({i: p for p, i in target[0].items()}, target[1]) if target else None
    source_spm = hf.file("source.spm", "OPUS-MT's source SentencePiece model").read_bytes()
    target_spm = hf.file("target.spm", "OPUS-MT's target SentencePiece model").read_bytes()
    codes = {r: LANGUAGE_CODE.match(p).group(1) for r, p in enumerate(pieces) if LANGUAGE_CODE.match(p)}
    target_codes = [r for r, p in enumerate(target_pieces or []) if LANGUAGE_CODE.match(p)]
    aliases = {lang_tag(c): r for r, c in codes.items()}
    try:
        tokenizer = Tokenizer.bundle(source_spm, target_spm, pieces, codes, aliases, target_pieces, target_codes)
    except RuntimeError as err:
        raise ValueError(f"{hf.directory}: source.spm or target.spm is not a SentencePiece model ({err})") from None
    return plain_if_raymt(tokenizer, source_spm, target_spm)


def plain_if_raymt(tokenizer: Tokenizer, source: bytes, target: bytes) -> Tokenizer:
    """A raymt export's vocabulary (one SentencePiece model whose ids are the model's, padded with
    export's fillers) as the plain SentencePiece tokenizer it was; any other unchanged."""
    if source != target or not tokenizer.shared:
        return tokenizer
    try:
        plain = Tokenizer(source)
    except (AssertionError, RuntimeError):  # not raymt's special ids
        return tokenizer
    n = plain.num_pieces
    same = plain.vocab_size == tokenizer.vocab_size and tokenizer.pieces[:n] == [plain.id_to_piece(i) for i in range(n)]
    fillers = all(p.startswith("<raymt_filler_") or not p for p in tokenizer.pieces[n:])
    return plain if same and fillers else tokenizer


def marian_languages(hf: HFModel, tokenizer: Tokenizer, src: str) -> Optional[dict]:
    """A multi-target model's languages entry (its >>xx<< codes as source-side tags), a raymt
    export's own (raymt_config.json), else None (one pair)."""
    saved = hf.directory / RAYMT_CONFIG_FILE
    if saved.is_file():
        return _json(saved).get("languages")
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.num_pieces)]
    codes = {m.group(1): i for i, m in enumerate(map(LANGUAGE_CODE.match, pieces)) if m}
    if not codes:
        return None
    return languages_entry([(src, lang) for lang in codes if lang != src], {lang_tag(c): i for c, i in codes.items()})


def import_marian(hf: HFModel, src_lang: Optional[str], tgt_lang: Optional[str]) -> tuple:
    """(model config, state dict, tokenizer, languages, corpora's pairs) of an OPUS-MT directory."""
    vocab, target_vocab = marian_vocab(hf)
    start, pad, eos = marian_start(hf), hf.get("pad_token_id"), hf.get("eos_token_id")
    rows = row_order(len(vocab), pad, vocab.get("<unk>", UNK_ID), start, eos)
    target_rows = rows  # the decoder's ids: the source's, or target_vocab.json's in raymt's order
    if target_vocab is not None:
        target_rows = row_order(len(target_vocab), pad, target_vocab.get("<unk>", UNK_ID), start, eos)
    tokenizer = marian_tokenizer(hf, vocab, rows, (target_vocab, target_rows) if target_vocab else None)
    multi = any(map(LANGUAGE_CODE.match, vocab)) or (hf.directory / RAYMT_CONFIG_FILE).is_file()
    src, tgt = pair_of(hf, src_lang, tgt_lang, need_tgt=not multi)
    bias = hf.state.get("final_logits_bias")
    bias = output_bias(bias.float().reshape(-1) if bias is not None else None, target_rows)
    separate = not hf.get("share_encoder_decoder_embeddings", True)  # the decoder's own embedding
    cfg = model_shape(hf, bias is not None, len(target_rows) if separate else None)
    inv = torch.argsort(halves_order(cfg.d_model))  # HF dim k holds raymt dim order[k]
    state = hf_weights(hf, rows, cfg, inv, target_rows)
    if bias is not None:
        state["output_bias"] = bias
    languages = marian_languages(hf, tokenizer, src) if multi else None
    return cfg, state, tokenizer, languages, languages["pairs"] if languages else [(src, tgt)]


# ---------------------------------------------------------------- M2M-100 and NLLB


def fairseq_vocab(hf: HFModel, sp: spm.SentencePieceProcessor, tokenizer_json: dict) -> dict[str, int]:
    """piece -> HF id of the ordinary pieces and <s> <pad> </s> <unk>: M2M-100's vocab.json, or
    NLLB's sentencepiece.bpe.model with fairseq's offset (SentencePiece id + 1 from id 3 on),
    checked against tokenizer.json's vocabulary when there is one."""
    if (hf.directory / "vocab.json").is_file():  # M2M-100
        return _json(hf.directory / "vocab.json")
    if (sp.unk_id(), sp.bos_id(), sp.eos_id()) != (0, 1, 2):
        raise ValueError(f"{hf.directory / SPM_NAME}: not fairseq's SentencePiece model (<unk> 0, <s> 1, </s> 2)")
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({sp.id_to_piece(i): i + 1 for i in range(3, sp.get_piece_size())})
    theirs = tokenizer_json.get("model", {}).get("vocab")
    if isinstance(theirs, dict) and any(theirs.get(p, i) != i for p, i in vocab.items()):
        raise ValueError(
            f"{hf.directory}: tokenizer.json's vocabulary is not {SPM_NAME}'s with fairseq's offset "
            "(files of different models?)"
        )
    return vocab


def added_tokens(hf: HFModel, tokenizer_json: dict) -> dict[str, int]:
    """The tokenizer's added tokens (NLLB's language codes, <mask>) -> HF id: tokenizer.json's,
    else tokenizer_config.json's added_tokens_decoder."""
    added = {t["content"]: int(t["id"]) for t in tokenizer_json.get("added_tokens", [])}
    return added or {t["content"]: int(i) for i, t in hf.tokenizer_config.get("added_tokens_decoder", {}).items()}


def language_codes(hf: HFModel, added: dict[str, int], num_pieces: int) -> dict[str, int]:
    """The model's language codes (deu_Latn, __de__) -> HF id: NLLB's added tokens; M2M-100's after
    vocab.json's pieces, in the order of tokenizer_config.json's language_codes list (m2m100, wmt21)."""
    codes = {c: i for c, i in added.items() if NLLB_CODE.match(c)}
    if not codes and (hf.directory / "vocab.json").is_file():
        listed = M2M_CODES.get(hf.tokenizer_config.get("language_codes", "m2m100"), [])
        codes = {f"__{c}__": num_pieces + i for i, c in enumerate(listed)}
    if len(codes) < 2:
        raise ValueError(
            f"{hf.directory}: the tokenizer's files name {len(codes)} language code(s) (NLLB's deu_Latn in "
            "tokenizer.json, M2M-100's language_codes in tokenizer_config.json); a model of several languages imports"
        )
    return codes


def language_names(codes: Sequence[str]) -> dict[str, str]:
    """HF code -> raymt's language name: M2M-100's __de__ -> de; NLLB's deu_Latn -> de where ISO
    639-1 has a name for it and the model has no other script of it (zho_Hans stays zho_Hans)."""
    names = {c: c[2:-2] if c.startswith("__") else c for c in codes}
    languages = [c.split("_")[0] for c in codes if NLLB_CODE.match(c)]
    short = {c: ISO_639_1.get(c[:3]) for c in codes if NLLB_CODE.match(c) and languages.count(c[:3]) == 1}
    taken = [n for n in short.values() if n]
    names.update({c: n for c, n in short.items() if n and taken.count(n) == 1 and n not in names.values()})
    return names


def language_of(value: Optional[str], names: dict[str, str], flag: str) -> Optional[str]:
    """raymt's name of a language given by name ("de") or by the model's code ("deu_Latn")."""
    if value is None or value in names.values():
        return value
    if value in names:
        return names[value]
    known = ", ".join(sorted(names.values()))
    raise ValueError(f"{flag} {value}: the model has no such language; it has {known}")


def m2m_pair(hf: HFModel, names: dict[str, str], src_lang: Optional[str], tgt_lang: Optional[str]) -> tuple:
    """(source, target) of data.corpora: the flags, else tokenizer_config.json's src_lang/tgt_lang,
    else English (or the first language) and the first other language."""
    langs = sorted(names.values())
    src = language_of(src_lang, names, "--src-lang")
    src = src or language_of(hf.tokenizer_config.get("src_lang"), names, "tokenizer_config.json's src_lang")
    src = src or ("en" if "en" in langs else langs[0])
    tgt = language_of(tgt_lang, names, "--tgt-lang")
    tgt = tgt or language_of(hf.tokenizer_config.get("tgt_lang"), names, "tokenizer_config.json's tgt_lang")
    tgt = tgt or next(lang for lang in langs if lang != src)
    if src == tgt:
        raise ValueError(f"the source and target languages are both {src}: pass --src-lang and --tgt-lang")
    return src, tgt


def m2m_vocabulary(hf: HFModel) -> tuple[bytes, dict[str, int], dict[str, int], dict[str, int]]:
    """(sentencepiece.bpe.model's bytes, its pieces -> HF id, every named id's piece -> HF id,
    the language codes -> HF id) of an NLLB or M2M-100 directory, checked against the embedding."""
    proto = hf.file(SPM_NAME, "the model's SentencePiece model").read_bytes()
    try:
        sp = spm.SentencePieceProcessor(model_proto=proto)
    except RuntimeError as err:
        raise ValueError(f"{hf.directory / SPM_NAME}: not a SentencePiece model ({err})") from None
    tokenizer_json = _json(hf.directory / "tokenizer.json") if (hf.directory / "tokenizer.json").is_file() else {}
    vocab = fairseq_vocab(hf, sp, tokenizer_json)
    added = added_tokens(hf, tokenizer_json)
    codes = language_codes(hf, added, len(vocab))
    named = {**vocab, **added, **codes}
    rows = shared_embedding(hf).shape[0]
    if len(set(named.values())) != len(named) or not max(named.values()) < rows == hf.get("vocab_size", rows):
        raise ValueError(
            f"{hf.directory}: the embedding has {rows} rows, config.json's vocab_size is {hf.get('vocab_size')} "
            f"and the tokenizer names {len(named)} ids up to {max(named.values())}; the embedding must have one "
            "row for each id (files of different models?)"
        )
    return proto, vocab, named, codes


def import_m2m(hf: HFModel, src_lang: Optional[str], tgt_lang: Optional[str]) -> tuple:
    """(model config, state dict, tokenizer, languages, corpora's pairs) of an NLLB or M2M-100
    directory: each language code a decoder-side target tag and a source tag."""
    proto, vocab, named, codes = m2m_vocabulary(hf)
    g = hf.get
    start, eos = g("decoder_start_token_id", 2), g("eos_token_id", 2)
    rows = row_order(shared_embedding(hf).shape[0], g("pad_token_id", 1), vocab.get("<unk>", 3), start, eos)
    pieces = piece_names({i: p for p, i in named.items()}, rows)
    row_of, names = {p: r for r, p in enumerate(pieces)}, language_names(list(codes))
    tags = {names[c]: row_of[c] for c in codes}
    controls = [r for r, p in enumerate(pieces) if r > EOS_ID and vocab.get(p, 0) <= 3]  # codes, <s>, <mask>
    aliases = {lang_tag(n): r for n, r in tags.items()}
    tokenizer = Tokenizer.bundle(proto, None, pieces, controls, aliases)
    cfg = model_shape(hf, True)
    state = hf_weights(hf, rows, cfg)
    state["output_bias"] = output_bias(None, rows)  # BOS, a second </s>, takes no probability
    langs = sorted(tags)
    pairs = [(s, t) for s in langs for t in langs if s != t]
    languages = languages_entry(pairs, aliases, "tgt", source_tags=tags)
    return cfg, state, tokenizer, languages, [m2m_pair(hf, names, src_lang, tgt_lang)]


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


def imported_data(hf: HFModel, pairs: list, languages: Optional[dict]) -> DataConfig:
    """The data section of an imported model: its pairs (data.corpora, without files) and tag side.
    data.corpus names the directory imported: what the model was trained on is not raymt's to
    know, and its pairs (any languages, not the built-in corpus's) name no files. A training run
    from it (`--init`) names its own corpora."""
    corpora = [CorpusSpec(s, t) for s, t in pairs]
    return DataConfig(corpora=corpora, corpus=str(hf.directory.resolve()), tag_side=tag_side(languages))


def import_model(
    directory: str | Path, output: str | Path, src_lang: Optional[str] = None, tgt_lang: Optional[str] = None
) -> Path:
    """Write the HF model of `directory` as a raymt checkpoint in a new `output` directory."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    hf = read_hf(directory)
    importer = import_m2m if hf.get("model_type") == "m2m_100" else import_marian
    model_cfg, state, tokenizer, languages, pairs = importer(hf, src_lang, tgt_lang)
    data = imported_data(hf, pairs, languages)
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
    src, tgt = load_config(output)[0].data.pair()
    langs = f" --src-lang {src} --tgt-lang {tgt}" if (model_languages(output) or {}).get("source_tags") else ""
    print(f'translate: raymt translate --checkpoint {output}{langs} "..."')
    return 0


if __name__ == "__main__":
    sys.exit(main())
