"""Built-in parallel corpus, generated offline from real CLDR data (Babel) and num2words.

Each sentence is a CLDR-formatted list of 1-3 phrases: country and language names, full
dates (month/day order differs), times, quantities with number words (German puts units
before tens), and currency amounts (symbol position and decimal marks differ). Generation
is deterministic given the seed and the installed Babel/num2words versions.
"""

from __future__ import annotations

import datetime as dt
import random
import shutil
from pathlib import Path
from typing import Callable

from babel import Locale
from babel.dates import format_date, format_time
from babel.lists import format_list
from babel.numbers import format_currency
from babel.units import format_unit
from num2words import num2words

LANGS = ("en", "de", "fr", "es")
UNITS = (
    "length-kilometer",
    "length-meter",
    "mass-kilogram",
    "duration-hour",
    "duration-minute",
    "volume-liter",
    "duration-day",
    "length-centimeter",
)
CURRENCIES = ("EUR", "USD", "GBP", "JPY", "CHF")

Phrase = Callable[[random.Random, tuple[str, ...]], dict[str, str]]


def _codes(kind: str) -> list[str]:
    """Codes named in every corpus language (countries or languages), sorted."""
    names = [getattr(Locale.parse(lang), kind) for lang in LANGS]
    return sorted(c for c in names[0] if c.isalpha() and all(c in n for n in names))


_TERRITORIES = [c for c in _codes("territories") if len(c) == 2]
_LANGUAGES = [c for c in _codes("languages") if len(c) == 2]


class _Locales(dict):
    """Babel's locales by language code, each parsed once (a quarter of the time otherwise); any
    language Babel knows, so benchmarks/noise.py can format phrases outside the corpus's LANGS."""

    def __missing__(self, lang: str) -> Locale:
        self[lang] = Locale.parse(lang)
        return self[lang]


_LOCALES = _Locales({lang: Locale.parse(lang) for lang in LANGS})

# Each phrase draws from `rng` the same way whichever `langs` it formats, so a pair of languages
# gets the same sentences as the other pairs, and formatting only the two asked for halves the
# time (24,000 pairs, the default training set, in ~3 s instead of ~8 here).


def _country(rng: random.Random, langs: tuple[str, ...]) -> dict[str, str]:
    code = rng.choice(_TERRITORIES)
    return {lang: _LOCALES[lang].territories[code] for lang in langs}


def _language(rng: random.Random, langs: tuple[str, ...]) -> dict[str, str]:
    code = rng.choice(_LANGUAGES)
    return {lang: _LOCALES[lang].languages[code] for lang in langs}


def _date(rng: random.Random, langs: tuple[str, ...]) -> dict[str, str]:
    day = dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(365 * 100))
    width = rng.choice(("full", "long"))
    return {lang: format_date(day, width, locale=_LOCALES[lang]) for lang in langs}


def _time(rng: random.Random, langs: tuple[str, ...]) -> dict[str, str]:
    t = dt.time(rng.randrange(24), rng.randrange(0, 60, 5))
    return {lang: format_time(t, "short", locale=_LOCALES[lang]) for lang in langs}


def _quantity(rng: random.Random, langs: tuple[str, ...]) -> dict[str, str]:
    n = rng.choice((rng.randrange(2, 20), rng.randrange(20, 100), rng.randrange(100, 1000)))
    unit = rng.choice(UNITS)
    # Format the digits (to get the plural form right), then spell the number out.
    return {
        lang: format_unit(n, unit, length="long", locale=_LOCALES[lang]).replace(str(n), num2words(n, lang=lang), 1)
        for lang in langs
    }


def _money(rng: random.Random, langs: tuple[str, ...]) -> dict[str, str]:
    amount = rng.randrange(1, 100000) / 100
    currency = rng.choice(CURRENCIES)
    return {lang: format_currency(amount, currency, locale=_LOCALES[lang]) for lang in langs}


PHRASES: tuple[Phrase, ...] = (_country, _language, _date, _time, _quantity, _money)


def sentence(rng: random.Random, langs: tuple[str, ...] = LANGS) -> dict[str, str]:
    """One sentence in each of `langs` (LANGS or any other language Babel and num2words know): a CLDR
    list of 1-3 random phrases."""
    phrases = [rng.choice(PHRASES)(rng, langs) for _ in range(rng.choice((1, 2, 2, 3)))]
    # CLDR puts (narrow) no-break spaces in times and amounts; plain spaces keep the
    # text identical after SentencePiece's NFKC normalization.
    return {
        lang: format_list([p[lang] for p in phrases], locale=_LOCALES[lang]).replace("\u202f", " ").replace("\xa0", " ")
        for lang in langs
    }


def generate(num_pairs: int, src_lang: str, tgt_lang: str, seed: int) -> tuple[list[str], list[str]]:
    """`num_pairs` deterministic (src, tgt) sentences for one direction."""
    for lang in (src_lang, tgt_lang):
        if lang not in LANGS:
            raise ValueError(f"language {lang!r} is not in the built-in corpus ({', '.join(LANGS)})")
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(num_pairs):
        s = sentence(rng, (src_lang, tgt_lang))
        src.append(s[src_lang])
        tgt.append(s[tgt_lang])
    return src, tgt


def builtin_splits(
    src_lang: str, tgt_lang: str, train_size: int, eval_size: int, seed: int = 1
) -> dict[str, tuple[list[str], list[str]]]:
    """Train/valid/test splits with no valid or test source sentence seen in training."""
    src, tgt = generate(train_size + 4 * eval_size, src_lang, tgt_lang, seed)
    held_out: dict[str, tuple[list[str], list[str]]] = {"valid": ([], []), "test": ([], [])}
    seen: set[str] = set()
    train_src, train_tgt = [], []
    for s, t in zip(src, tgt):
        for split in ("valid", "test"):
            if len(held_out[split][0]) < eval_size and s not in seen:
                held_out[split][0].append(s)
                held_out[split][1].append(t)
                seen.add(s)
                break
        else:
            if s not in seen and len(train_src) < train_size:
                train_src.append(s)
                train_tgt.append(t)
    return {"train": (train_src, train_tgt), **held_out}


def sources(src_lang: str, tgt_lang: str, train_size: int, eval_size: int, seed: int = 1) -> dict:
    """`builtin_splits` as in-memory `raymt.data.sources.Source`s by split (train, valid, test): the
    built-in corpus of a run or of `raymt data prepare`."""
    from raymt.data.sources import Source

    splits = builtin_splits(src_lang, tgt_lang, train_size, eval_size, seed)
    return {split: Source(kind="pairs", pairs=pairs, generated=True) for split, pairs in splits.items()}


def write_builtin(
    folder: Path, src_lang: str, tgt_lang: str, train_size: int, eval_size: int, seed: int, mono_size: int = 0
) -> None:
    """The built-in corpus of a pair as text files in `folder` (train, valid, test .SRC/.TGT), written
    whole (a temporary sibling renamed) or kept when there; with `mono_size`, also monolingual text
    held out of training (mono.SRC: the sources of `mono_size` more pairs, mono.TGT: the targets of
    `mono_size` others). The training pairs are those of mono_size 0 (the generator's prefix)."""
    if (folder / f"test.{tgt_lang}").exists():
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    splits = builtin_splits(src_lang, tgt_lang, train_size + 2 * mono_size, eval_size, seed)
    src, tgt = splits["train"]
    splits["train"] = (src[:train_size], tgt[:train_size])
    if mono_size:
        splits["mono"] = (src[train_size : train_size + mono_size], tgt[train_size + mono_size :])
    for split, (src, tgt) in splits.items():
        for lang, lines in ((src_lang, src), (tgt_lang, tgt)):
            (tmp / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.rename(folder)
