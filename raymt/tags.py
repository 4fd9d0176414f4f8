"""Language codes and the tag pieces made of them: the one home of raymt's tags.

- A language code (`check_lang`): letters, digits or '_' (en, pt_BR), never '-', which names pairs.
- Reserved tag pieces: `<2de>` target-language tags (Johnson et al. 2017: `lang_tag`, `tag_lang`)
  and `<BT>` on back-translated sources (Caswell et al. 2019: `BT_TAG`), SentencePiece control
  symbols (`reserved_pieces`). Shards and encoded sources hold the target tag first
  (`source_tags`, `source_prefix`); a model with data.tag_side "tgt" (`TAG_SIDES`,
  `check_tag_side`) reads it as its decoder's first token instead (moved at collation and
  decoding: raymt.batching.tag_to_decoder, raymt.decoding.split_tags).
- A given model's vocabulary holds the tags corpora need (`check_tags`) and, where it reads its
  source's language code (an imported NLLB), a code for each source (`check_source_codes`).
- At inference, the pieces before a source: the model's tag for --tgt-lang (`decode_tags`).

Plain Python that imports nothing of raymt but raymt.errors, so that every module may use it
(raymt.config's checks and corpora too: a corpus here is anything with `src_lang`, `tgt_lang`
and `origin`, a `raymt.config.CorpusSpec` or a prepared corpus's `TrainingCorpus`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from raymt.errors import check

# data.tag_side: a tagged model's target-language tag before the source, or first in the decoder.
TAG_SIDES = ("src", "tgt")
BT_TAG = "<BT>"


class Vocabulary(Protocol):
    """What the tags read of a tokenizer (raymt.tokenizer.Tokenizer): a piece's id, and whether an
    id is a control symbol."""

    def piece_to_id(self, piece: str) -> int: ...

    def is_control(self, i: int) -> bool: ...


class Corpus(Protocol):
    """What the tags read of a corpus: its languages and origin ("real" or "bt")."""

    src_lang: str
    tgt_lang: str
    origin: str


def check_lang(lang: Any, where: str) -> None:
    """A language code of a corpus or tag: letters, digits or '_'. Not '-': pairs are named
    "SRC-TGT" (metrics columns, manifests, tags), which a code with '-' would make ambiguous."""
    check(
        isinstance(lang, str) and bool(lang) and lang.replace("_", "").isalnum(),
        f"{where}={lang!r} must be a language code of letters, digits or '_' such as en or pt_BR "
        "(not pt-BR: '-' separates a pair's two languages)",
    )


# Names shown for codes (LibreTranslate's /languages, Argos packages' metadata); others show the code.
LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "es": "Spanish"}


def lang_name(code: str) -> str:
    """A language code's English name where raymt knows it, else the code itself."""
    return LANGUAGE_NAMES.get(code, code)


def lang_tag(lang: str) -> str:
    """The target-language tag piece: "<2de>" for "de" (Johnson et al. 2017)."""
    check_lang(lang, "tag language")
    return f"<2{lang}>"


def tag_lang(piece: str) -> Optional[str]:
    """The language of a target-language tag piece: "de" for "<2de>"; None for any other piece."""
    return piece[2:-1] if piece.startswith("<2") and piece.endswith(">") else None


def target_langs(corpora: Sequence[Corpus]) -> list[str]:
    """The languages the corpora translate into, sorted."""
    return sorted({c.tgt_lang for c in corpora})


def reserved_pieces(corpora: Sequence[Corpus], bt_tag: bool = True, every_target: bool = False) -> list[str]:
    """The tag pieces to reserve in SentencePiece (control symbols, never split, never made from
    text), in id order: a `<2xx>` tag per target language when there are several (or always:
    `every_target`, a model that reads language codes), then `<BT>` when a corpus is
    back-translated and `bt_tag`. A single real pair reserves none."""
    langs = target_langs(corpora)
    pieces = [lang_tag(lang) for lang in langs] if len(langs) > 1 or every_target else []
    return pieces + ([BT_TAG] if bt_tag and any(c.origin == "bt" for c in corpora) else [])


def source_tags(corpus: Corpus, reserved: Sequence[str]) -> list[str]:
    """The pieces put before each source of `corpus`: its target tag, then `<BT>`, where reserved."""
    tags = [lang_tag(corpus.tgt_lang)] if lang_tag(corpus.tgt_lang) in reserved else []
    return tags + ([BT_TAG] if corpus.origin == "bt" and BT_TAG in reserved else [])


def source_prefix(corpus: Corpus, ids: dict[str, int], codes: Optional[dict[str, int]] = None) -> list[int]:
    """The ids before each training source of `corpus`: its `source_tags` (`ids`: the reserved
    pieces' ids) with, for a model that reads its source's language code (`codes`: an imported
    NLLB's languages "source_tags", every target tagged), that code after the target tag: the tag
    moves to the decoder (data.tag_side "tgt") and the code starts the source, as
    raymt.engines.ModelInfo.prefix puts them at inference."""
    tags = [ids[piece] for piece in source_tags(corpus, list(ids))]
    return tags[:1] + [codes[corpus.src_lang]] + tags[1:] if codes else tags


def check_tag_side(
    tag_side: str,
    corpora: Optional[Sequence[Corpus]] = None,
    every_target: bool = False,
    trained: Optional[str] = None,
    model: str = "the model",
) -> None:
    """One-line errors for data.tag_side: "tgt" (the tag first in the decoder) needs tags, so
    `corpora` of several target languages or `every_target` (a model that reads language codes
    tags every target); and a model trained with its tag on one side (`trained`: its
    data.tag_side; `model` names it) goes on training with it there, where its weights learned it."""
    if trained is not None and trained != tag_side:
        raise ValueError(
            f"{model} trained with data.tag_side={trained!r}, this run sets {tag_side!r}: drop --set "
            "data.tag_side to continue it, or train a new model from scratch"
        )
    if corpora is not None:
        check(
            tag_side == "src" or len(target_langs(corpora)) > 1 or every_target,
            f"data.tag_side=tgt puts the target-language tag first in the decoder, but these corpora translate "
            f"into {', '.join(target_langs(corpora))} only (no tags): leave data.tag_side at src",
        )


def check_tags(tokenizer: Vocabulary, reserved: Sequence[str], where: str) -> None:
    """A given model (a checkpoint's, a run's) must have the corpora's tags as control symbols:
    a SentencePiece model's reserved pieces (ids 4, 5, ... where raymt trained it), an imported
    vocabulary's aliases (<2de> of NLLB's deu_Latn, at the model's id); a one-line error otherwise."""
    wrong = [p for p in reserved if not tokenizer.is_control(tokenizer.piece_to_id(p))]
    if wrong:
        raise ValueError(
            f"{where}: its vocabulary does not reserve the tag(s) {', '.join(wrong)} that these "
            "corpora need: train on corpora of its languages and origins, or from scratch"
        )


def check_source_codes(specs: Sequence[Corpus], codes: dict[str, int], where: str) -> None:
    """A given model that reads its source's language code (an imported NLLB's or M2M-100's
    `source_tags`) must have one for every corpus's source language; a one-line error otherwise."""
    missing = sorted({c.src_lang for c in specs} - set(codes))
    if missing:
        raise ValueError(
            f"{where} reads the source's language code first in each source and has none for "
            f"{', '.join(missing)} (it has {', '.join(sorted(codes))}): train on pairs of its languages"
        )


def decode_tags(tgt_lang: Optional[str], trained: Sequence[str], reserved: Sequence[str]) -> list[str]:
    """The pieces before a source at inference (translate, evaluate, backtranslate): the model's
    tag for `tgt_lang` (--tgt-lang); one-line errors when it is missing or not trained. A model
    with data.tag_side "tgt" takes it from there as its decoder's prefix (raymt.decoding.split_tags)."""
    tagged = any(tag_lang(p) is not None for p in reserved)
    if tgt_lang is None:
        check(not tagged, f"this model translates into {', '.join(trained)}: pass --tgt-lang")
        return []
    check(
        tgt_lang in trained,
        f"--tgt-lang {tgt_lang}: this model was trained to translate into {', '.join(trained)}; pick one of them",
    )
    return [lang_tag(tgt_lang)] if tagged else []
