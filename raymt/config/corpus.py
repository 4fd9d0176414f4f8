"""Corpus specs: the built-in languages, `CorpusSpec` (its codes checked by raymt.tags), the checks of a
list of corpora, corpora from `[[data.corpora]]` tables and from the input flags' SPECs
(`--train SRC-TGT:SPEC`: `corpora_from_flags`, which `raymt.flags.InputFlags.corpora` reads the
flags into), and the one reader of older configs' one-pair fields (`with_one_pair`,
`read_one_pair`). Imports nothing of raymt.data, which builds on it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

from raymt.errors import check
from raymt.tags import check_lang

# A corpus's label (CorpusSpec.label): never "-" or ".", so never a pair's name (en-de, en-de.bt).
LABEL = r"[A-Za-z][A-Za-z0-9_]*"

# Languages of the built-in corpus (CLDR data through Babel, number words through num2words).
BUILTIN_LANGS = ("en", "de", "fr", "es")

# The content rules of prepare's cleaning (raymt.data.clean), each counted under its name.
CONTENT_RULES = ("copy", "number_mismatch", "url_mismatch", "alpha_ratio", "repeats", "wrong_language")
# The options of the score rule (`raymt data score`'s scores), None unless a corpus filters by score.
SCORE_KEYS = ("min_score", "keep_best", "calibrate_valid", "scores")
# The cleaning options a corpus may set for itself (CorpusSpec.clean: `clean = {wrong_language =
# false}` in its [[data.corpora]] table); CorpusOptions holds their defaults, for every corpus.
CLEAN_KEYS = (
    "copy",
    "copy_similarity",
    "number_mismatch",
    "url_mismatch",
    "alpha_ratio",
    "alpha_ratio_min",
    "repeats",
    "repeats_max",
    "wrong_language",
    "wrong_language_confidence",
    "wrong_language_min_chars",
    "min_score",
    "keep_best",
    "calibrate_valid",
    "scores",
    "max_len",
    "max_chars",
    "max_ratio",
    "ratio_min_len",
)

# Where a training corpus's pairs come from: real pairs, or "bt", sources made by
# back-translating real target-side text (issue 29).
ORIGINS = ("real", "bt")


@dataclass(frozen=True)
class CorpusSpec:
    """One training corpus: its languages, files, origin and weight, and its pair's eval sets."""

    src_lang: str
    tgt_lang: str
    # Prefixes or files as `--train` takes them (raymt.data.prepare.source_from_spec);
    # () means the built-in corpus (generated for these languages).
    train: tuple[str, ...] = ()
    # "real" pairs, or "bt": sources made by back-translating real target-side text.
    origin: str = "real"
    # Multiplies the corpus's size before the temperature: 2 at T=1 = the corpus twice per epoch.
    weight: float = 1.0
    # The pair's validation set (one per pair, on one of its corpora) and test sets.
    valid: Optional[str] = None
    test: tuple[str, ...] = ()
    # A name of its own, for several corpora of one pair and origin mixed by weight (a domain
    # corpus beside a general one, so that fine-tuning keeps the general quality); None: the
    # corpus is named by its pair and origin (`name`).
    label: Optional[str] = None
    # Cleaning options of this corpus over the run's or prepare's (CLEAN_KEYS), e.g. wrong_language
    # off for a language that language ID does not know; their values are checked with the rest.
    clean: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"corpus {self.src_lang}-{self.tgt_lang}"
        check_lang(self.src_lang, f"{where}: src_lang")
        check_lang(self.tgt_lang, f"{where}: tgt_lang")
        check(
            self.src_lang != self.tgt_lang,
            f"{where}: src_lang and tgt_lang are both {self.src_lang!r}: pick two languages",
        )
        check(self.origin in ORIGINS, f"{where}: origin={self.origin!r} must be one of {', '.join(ORIGINS)}")
        check(
            isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0,
            f"{where}: weight={self.weight!r} must be a number > 0",
        )
        # Tables and flags may give one string or a list; the spec holds tuples.
        object.__setattr__(self, "train", _paths(self.train, f"{where}: train"))
        object.__setattr__(self, "test", _paths(self.test, f"{where}: test"))
        check(
            self.valid is None or (isinstance(self.valid, str) and bool(self.valid)),
            f"{where}: valid={self.valid!r} must be a prefix or file",
        )
        check(
            self.origin == "real" or bool(self.train),
            f"{where}: a back-translated corpus needs files: pass --bt {self.pair}:PATH",
        )
        check(
            self.label is None or (isinstance(self.label, str) and re.fullmatch(LABEL, self.label) is not None),
            f"{where}: label={self.label!r} must be a name of letters, digits and '_' starting with a letter",
        )
        check(
            isinstance(self.clean, dict) and not set(self.clean) - set(CLEAN_KEYS),
            f"{where}: clean={self.clean!r} must be a table of cleaning options: {', '.join(CLEAN_KEYS)}",
        )
        check(
            len(set(self.train)) == len(self.train),
            f"{where}: a file is listed twice in train={list(self.train)}: list each once",
        )

    @property
    def pair(self) -> str:
        """ "en-de": the direction this corpus trains."""
        return f"{self.src_lang}-{self.tgt_lang}"

    @property
    def name(self) -> str:
        """ "en-de", or "en-de.bt" for back-translated pairs, or its label: its directory and its summary row."""
        if self.label is not None:
            return self.label
        return self.pair if self.origin == "real" else f"{self.pair}.{self.origin}"

    @property
    def builtin(self) -> bool:
        """Whether the pairs come from the built-in corpus."""
        return not self.train


def _paths(value: Any, where: str) -> tuple[str, ...]:
    """A tuple of non-empty strings from one string or a list of them."""
    items = (value,) if isinstance(value, str) else value
    check(
        isinstance(items, (list, tuple)) and all(isinstance(v, str) and v for v in items),
        f"{where}={value!r} must be a path or a list of paths",
    )
    return tuple(items)


TABLE_KEYS = tuple(f.name for f in fields(CorpusSpec))


def corpora_from_tables(tables: Any, where: str = "data.corpora", builtin: bool = True) -> list[CorpusSpec]:
    """Corpora of `[[data.corpora]]` TOML tables (dicts with CorpusSpec's fields), checked
    (`builtin` as in `check_corpora`)."""
    check(
        isinstance(tables, list) and all(isinstance(t, dict) for t in tables) and bool(tables),
        f"{where} must be a non-empty list of tables ([[data.corpora]] in TOML)",
    )
    corpora = []
    for i, table in enumerate(tables):
        unknown = sorted(set(table) - set(TABLE_KEYS))
        check(not unknown, f"{where}[{i}]: unknown key(s) {', '.join(unknown)}; known: {', '.join(TABLE_KEYS)}")
        missing = [k for k in ("src_lang", "tgt_lang") if k not in table]
        check(not missing, f"{where}[{i}]: {' and '.join(missing)} missing: every corpus names its languages")
        corpora.append(CorpusSpec(**table))
    check_corpora(corpora, builtin=builtin)
    return corpora


def check_corpora(corpora: Sequence[CorpusSpec], need_valid: bool = True, builtin: bool = True) -> None:
    """One-line errors for duplicate corpora, a file in two corpora of a pair, built-in languages and
    validation sets: with `need_valid`, each pair trained from files has exactly one (the
    built-in corpus brings its own). Without `builtin`, corpora without files name the pairs of a
    prepared corpus or a --dataset, in any language."""
    check(bool(corpora), "no training corpus: pass --train SRC-TGT:PATH or a [[data.corpora]] table")
    names = [c.name for c in corpora]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    check(
        not duplicates,
        f"corpus {', '.join(duplicates)} is given twice: give one per pair and "
        'origin, listing all its files in train = [...], or a label to each (label = "general")',
    )
    # A prefix may serve both directions (en-de and de-en), not two corpora of one pair.
    files = [(c.pair, f) for c in corpora for f in c.train]
    twice = sorted({f"{f} ({p})" for p, f in files if files.count((p, f)) > 1})
    check(
        not twice,
        f"{', '.join(twice)} is in two corpora of one pair: real and back-translated pairs come from different files",
    )
    for c in corpora:
        for lang in (c.src_lang, c.tgt_lang) if c.builtin and builtin else ():
            check(
                lang in BUILTIN_LANGS,
                f"corpus {c.name}: language {lang!r} is not in the built-in "
                f"corpus ({', '.join(BUILTIN_LANGS)}); pass files for it",
            )
    for pair in dict.fromkeys(c.pair for c in corpora):
        of_pair = [c for c in corpora if c.pair == pair]
        given = [c.valid for c in of_pair if c.valid is not None]
        check(len(given) <= 1, f"pair {pair} has {len(given)} validation sets: give one per pair")
        check(
            given or not need_valid or any(c.builtin for c in of_pair),
            f"pair {pair} has no validation set: pass --valid {pair}:PREFIX (or valid = ... in its table)",
        )


# ---------------------------------------------------------------- the input flags' SPECs

# A language code of the short SRC-TGT form: no '-', which separates the two (pt_BR, eng_Latn).
SHORT_LANG = r"[A-Za-z][A-Za-z0-9_]*"
PAIR = re.compile(rf"^({SHORT_LANG})-({SHORT_LANG})$")


def parse_pair(text: str, where: str) -> tuple[str, str]:
    """("en", "de") from "en-de"; a one-line ValueError naming `where` otherwise."""
    match = PAIR.match(text)
    check(
        match is not None and match.group(1) != match.group(2),
        f"{where}: {text!r} is not a language pair: write SRC-TGT with two different codes, "
        "e.g. en-de (use pt_BR, not pt-BR)",
    )
    return match.group(1), match.group(2)


def parse_pairs(text: str, where: str = "--pairs") -> list[tuple[str, str]]:
    """The pairs of "en-de,en-fr,de-en" (`--pairs` of the built-in corpus), each once."""
    pairs = [parse_pair(p.strip(), where) for p in text.split(",")]
    duplicates = sorted({f"{s}-{t}" for s, t in pairs if pairs.count((s, t)) > 1})
    check(not duplicates, f"{where}: {', '.join(duplicates)} given twice: list each pair once")
    return pairs


def split_spec(spec: str, flag: str) -> tuple[Optional[tuple[str, str]], str]:
    """(pair or None, location) of a flag's SPEC: "en-de:PREFIX", or a bare PREFIX/file/URI.

    Text before the first ':' is a pair unless it holds a '/' or starts a URI ("s3://");
    so a local path with a ':' in its first component is written ./name:rest.
    """
    head, sep, rest = spec.partition(":")
    if not sep or "/" in head or rest.startswith("//"):
        check(bool(spec), f"{flag}: empty SPEC: pass a prefix, a file or SRC-TGT:PATH")
        return None, spec
    pair = parse_pair(head, f"{flag} {spec}")
    check(bool(rest), f"{flag} {spec}: nothing after '{head}:': write {head}:PATH")
    return pair, rest


def corpora_from_flags(
    train: Sequence[str],
    bt: Sequence[str],
    valid: Sequence[str],
    test: Sequence[str],
    default_pair: tuple[str, str],
    builtin: Sequence[tuple[str, str]] = (),
    real_weight: Optional[float] = None,
    builtin_langs: bool = True,
) -> list[CorpusSpec]:
    """Corpora of repeated --train/--bt/--valid/--test SPECs, in order; a bare SPEC is `default_pair`'s.

    Specs of one pair and origin are one corpus (as repeated --train is today); a pair's
    --valid and --test go to its first corpus. `builtin` pairs (--pairs) come first, without
    files: from the built-in corpus (checked against its languages with `builtin_langs`), or
    `raymt data prepare`'s --dataset or --src-file/--tgt-file. `real_weight` (--real-weight)
    is the weight of every real corpus: the real pairs upsampled beside back-translated ones
    (fairseq's --upsample-primary).
    """
    check_real_weight(real_weight, bt)
    grouped: dict[tuple[str, str, str], list[str]] = {(*pair, "real"): [] for pair in builtin}
    for origin, flag, specs in (("real", "--train", train), ("bt", "--bt", bt)):
        for spec in specs:
            pair, location = split_spec(spec, flag)
            key = (*(pair or default_pair), origin)
            check(
                key[:2] not in builtin or origin != "real",
                f"--train {spec}: {'-'.join(key[:2])} also comes from --pairs: drop it from one of them",
            )
            grouped.setdefault(key, []).append(location)
    evals = {"valid": _eval_specs(valid, "--valid", default_pair), "test": _eval_specs(test, "--test", default_pair)}
    for kind, by_pair in evals.items():
        for pair in by_pair:
            check(
                any(key[:2] == pair for key in grouped),
                f"--{kind} {'-'.join(pair)}:... names a pair with no --train or --bt data: drop it or add its data",
            )
    corpora, seen = [], set()
    for (src, tgt, origin), locations in grouped.items():
        first = (src, tgt) not in seen
        seen.add((src, tgt))
        valid_specs = evals["valid"].get((src, tgt), []) if first else []
        check(len(valid_specs) <= 1, f"--valid is given {len(valid_specs)} times for {src}-{tgt}: one per pair")
        corpora.append(
            CorpusSpec(
                src,
                tgt,
                tuple(locations),
                origin,
                weight=real_weight if origin == "real" and real_weight is not None else 1.0,
                valid=(valid_specs or [None])[0],
                test=tuple(evals["test"].get((src, tgt), [])) if first else (),
            )
        )
    check_corpora(corpora, builtin=builtin_langs)
    return corpora


def check_real_weight(real_weight: Optional[float], bt: Sequence[str]) -> None:
    """--real-weight: a number > 0, given with --bt (one-line errors)."""
    if real_weight is None:
        return
    check(
        math.isfinite(real_weight) and real_weight > 0,
        f"--real-weight {real_weight:g} must be a number > 0 (2: the real pairs twice per epoch)",
    )
    check(
        bool(bt), "--real-weight upsamples the real pairs beside back-translated ones: add --bt SRC-TGT:DIR or drop it"
    )


def _eval_specs(specs: Sequence[str], flag: str, default_pair: tuple[str, str]) -> dict[tuple[str, str], list[str]]:
    """Locations of --valid/--test SPECs by pair, in order."""
    by_pair: dict[tuple[str, str], list[str]] = {}
    for spec in specs:
        pair, location = split_spec(spec, flag)
        by_pair.setdefault(pair or default_pair, []).append(location)
    return by_pair


# ---------------------------------------------------------------- older configs' one pair

# The one-pair fields of data.* in configs before data.corpora described every run (ee135a8 and
# older): data.src_lang/tgt_lang/train/valid/test, read into data.corpora by `with_one_pair`.
ONE_PAIR_FIELDS = ("src_lang", "tgt_lang", "train", "valid", "test")


def one_pair(corpora: Sequence[CorpusSpec]) -> bool:
    """Whether corpora are what the one-pair fields described: one real corpus of at most one
    file and one test set."""
    if len(corpora) != 1:
        return False
    (c,) = corpora
    return c.origin == "real" and len(c.train) <= 1 and len(c.test) <= 1


def check_beside_corpora(given: dict[str, Optional[str]]) -> None:
    """One-pair fields beside corpora they cannot describe: their languages are ignored (as they
    always were), files and sets refused."""
    for name in ("train", "valid", "test"):
        check(
            given.get(name) is None,
            f"data.corpora and data.{name} are both set: give every corpus and its valid/test "
            f"sets in data.corpora (--train/--valid/--test SRC-TGT:SPEC), or drop data.corpora",
        )


def with_one_pair(corpora: Sequence[CorpusSpec], given: dict[str, Optional[str]]) -> list[CorpusSpec]:
    """`corpora` with the one-pair fields in `given` (ONE_PAIR_FIELDS, older configs' and flags'
    names) set on their one corpus. Corpora the fields cannot describe keep their languages
    (as when they stood beside data.corpora), and refuse files or sets."""
    unknown = sorted(set(given) - set(ONE_PAIR_FIELDS))
    check(not unknown, f"unknown one-pair field(s) {', '.join(unknown)}; known: {', '.join(ONE_PAIR_FIELDS)}")
    if not one_pair(corpora):
        check_beside_corpora(given)
        return list(corpora)
    (c,) = corpora
    fields_ = {"src_lang": c.src_lang, "tgt_lang": c.tgt_lang, "valid": c.valid}
    fields_.update({"train": (c.train or (None,))[0], "test": (c.test or (None,))[0]})
    fields_.update(given)
    for name in ("src_lang", "tgt_lang"):
        check_lang(fields_[name], f"data.{name}")
    check(
        fields_["src_lang"] != fields_["tgt_lang"],
        f"data.src_lang and data.tgt_lang are both {fields_['src_lang']!r}: pick two languages",
    )
    check(
        fields_["train"] is None or fields_["valid"] is not None,
        "--train is set but --valid is not: pass a validation file prefix",
    )
    train, test = fields_.pop("train"), fields_.pop("test")
    return [CorpusSpec(**fields_, train=(train,) if train else (), test=(test,) if test else ())]


def read_one_pair(data: dict, current: Sequence[CorpusSpec]) -> dict:
    """The reader of configs before data.corpora described every run (ee135a8 and older): a data
    section (dict) whose one-pair fields are read into data.corpora, set on `current` (the
    corpora they change: the defaults', or those of the layers before). An empty data.corpora
    meant "the one pair"; beside tables, the fields' languages were unused."""
    old = {k: data[k] for k in ONE_PAIR_FIELDS if k in data}
    if not old:
        return data
    data = {k: v for k, v in data.items() if k not in ONE_PAIR_FIELDS}
    if data.get("corpora"):
        check_beside_corpora(old)
    else:
        data["corpora"] = with_one_pair(current, old)
    return data
