"""`raymt import` of the `m2m_100` family (NLLB-200, M2M-100): pre-norm with final layer norms
(model.encoder_norm, decoder_norm), relu, scaled embeddings, fairseq's sinusoidal positions
(model.positions "fairseq": numbered from the padding index 1 + 1); one SentencePiece model
(sentencepiece.bpe.model) whose pieces are NLLB's ids with fairseq's offset (id + 1 after <s>
<pad> </s> <unk>) or M2M-100's vocab.json. Its language codes (deu_Latn, __de__) are raymt
languages ("de" where the code has a two-letter name and no other script in the model, else the
code: "zho_Hans"): the target's code, which HF forces as the decoder's first token after </s>, is
the decoder-side tag <2de> (languages' "tag_side": "tgt"); the source's code, first in every
source, is the model's `source_tags` entry, which `--src-lang` picks. The languages entry lists
every ordered pair of the model's languages (NLLB-200: 39,800), data.corpora the default pair
(--src-lang/--tgt-lang, else tokenizer_config.json's src_lang/tgt_lang, else English and the
first other language), which translate and serve take when no source is named. Embedding rows no
piece names (NLLB's last two, M2M-100's "madeupword"s) stay, as raymt controls."""

from __future__ import annotations

import re
from typing import Optional, Sequence

import sentencepiece as spm

from raymt.checkpoint import languages_entry
from raymt.hf_model import (
    HFModel,
    Imported,
    hf_weights,
    model_shape,
    output_bias,
    piece_names,
    row_order,
    shared_embedding,
)
from raymt.tags import lang_tag
from raymt.tokenizer import EOS_ID, Tokenizer

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


def fairseq_vocab(hf: HFModel, sp: spm.SentencePieceProcessor, tokenizer_json: dict) -> dict[str, int]:
    """piece -> HF id of the ordinary pieces and <s> <pad> </s> <unk>: M2M-100's vocab.json, or
    NLLB's sentencepiece.bpe.model with fairseq's offset (SentencePiece id + 1 from id 3 on),
    checked against tokenizer.json's vocabulary when there is one."""
    if (hf.directory / "vocab.json").is_file():  # M2M-100
        return hf.json("vocab.json")
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
    tokenizer_json = hf.json("tokenizer.json")
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


def import_m2m(hf: HFModel, src_lang: Optional[str], tgt_lang: Optional[str]) -> Imported:
    """What an NLLB or M2M-100 directory holds, as raymt's: each language code a decoder-side
    target tag and a source tag."""
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
    return Imported(cfg, state, tokenizer, languages, [m2m_pair(hf, names, src_lang, tgt_lang)])
