"""`raymt import` of the `marian` family (OPUS-MT): post-norm, swish (or the model's activation),
scaled embeddings, a fixed `final_logits_bias` (model.output_bias), tied or separate output; two
SentencePiece models (source.spm, target.spm) over one vocab.json (the checkpoint's tokenizer
bundle), or separate vocabularies (separate_vocabs: vocab.json the source's, target_vocab.json the
target's ids, a decoder embedding of its own: model.target_vocab_size). Multi-target models'
`>>fr<<` codes become raymt's source-side tags (<2fr>). Marian's model dimension is reordered from
HF's sinusoid layout (sin in the first half, cos in the second) to raymt's (interleaved), the
inverse of `export --format marian`."""

from __future__ import annotations

import re
from typing import Optional

import torch

from raymt.checkpoint import RAYMT_CONFIG_FILE, languages_entry
from raymt.config import Config
from raymt.hf_model import (
    HFModel,
    Imported,
    embeddings,
    hf_weights,
    model_shape,
    output_bias,
    piece_names,
    row_order,
)
from raymt.model import halves_order
from raymt.tags import lang_tag
from raymt.tokenizer import UNK_ID, Tokenizer

LANGUAGE_CODE = re.compile(r"^>>([A-Za-z_]+)<<$")  # OPUS-MT's multi-target codes, >>fr<<, >>por<<


def read_vocab(hf: HFModel, name: str, rows: int, size_field: str) -> dict[str, int]:
    """vocab.json or target_vocab.json (piece -> HF id), checked: ids 0..n-1 each once, one for
    each of the embedding's `rows` and config.json's `size_field`."""
    vocab = hf.json(name, "OPUS-MT's vocabulary")
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
    are controls, aliased as <2xx> on the source side; decoded as MarianTokenizer decodes (`strip`)."""
    pieces = piece_names({i: p for p, i in vocab.items()}, rows)
    target_pieces = piece_names({i: p for p, i in target[0].items()}, target[1]) if target else None
    source_spm = hf.file("source.spm", "OPUS-MT's source SentencePiece model").read_bytes()
    target_spm = hf.file("target.spm", "OPUS-MT's target SentencePiece model").read_bytes()
    codes = {r: LANGUAGE_CODE.match(p).group(1) for r, p in enumerate(pieces) if LANGUAGE_CODE.match(p)}
    target_codes = [r for r, p in enumerate(target_pieces or []) if LANGUAGE_CODE.match(p)]
    aliases = {lang_tag(c): r for r, c in codes.items()}
    try:
        tokenizer = Tokenizer.bundle(
            source_spm, target_spm, pieces, codes, aliases, target_pieces, target_codes, strip=True
        )
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
        return hf.json(RAYMT_CONFIG_FILE).get("languages")
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.num_pieces)]
    codes = {m.group(1): i for i, m in enumerate(map(LANGUAGE_CODE.match, pieces)) if m}
    if not codes:
        return None
    return languages_entry([(src, lang) for lang in codes if lang != src], {lang_tag(c): i for c, i in codes.items()})


def import_marian(hf: HFModel, src_lang: Optional[str], tgt_lang: Optional[str]) -> Imported:
    """What an OPUS-MT directory holds, as raymt's."""
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
    return Imported(cfg, state, tokenizer, languages, languages["pairs"] if languages else [(src, tgt)])


def pair_of(hf: HFModel, src_lang: Optional[str], tgt_lang: Optional[str], need_tgt: bool = True) -> tuple:
    """(source, target) language: the flags, else tokenizer_config.json's source_lang/target_lang,
    else the model's name (opus-mt-en-de: the directory's or the Hub id's); a one-line error asking
    for the flags otherwise."""
    named = re.search(r"(?:^|[-_])([a-z]{2,3})-([a-z]{2,3}|[A-Za-z]+)$", hf.name)
    saved = hf.directory / RAYMT_CONFIG_FILE  # a raymt export's pair
    ours = Config.from_dict(hf.json(RAYMT_CONFIG_FILE)["config"]).data.pair() if saved.is_file() else (None, None)
    src = src_lang or hf.tokenizer_config.get("source_lang") or ours[0] or (named.group(1) if named else None)
    tgt = tgt_lang or hf.tokenizer_config.get("target_lang") or ours[1]
    tgt = tgt or (named.group(2) if named and named.group(2).islower() else None)
    if src is None or (tgt is None and need_tgt):
        raise ValueError(
            f"{hf.directory}: cannot tell the model's languages (no source_lang/target_lang in "
            "tokenizer_config.json, no opus-mt-SRC-TGT name): pass --src-lang and --tgt-lang"
        )
    return src, tgt
