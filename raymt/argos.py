"""`raymt export --format argos`: Argos Translate packages (`.argosmodel`) that
`argostranslate.package.install_from_path` installs (it unzips them into ARGOS_PACKAGES_DIR, where
LibreTranslate finds them too).

A package is a zip of one directory, `translate-SRC_TGT-1_0/`, holding `metadata.json` (from_code,
to_code, their names, `target_prefix`), the CTranslate2 model in `model/` (raymt.exporting's writer,
at the weight type asked: int8 by default), the SentencePiece model as `sentencepiece.model` (one
for both sides: argostranslate encodes and decodes with it), and a blank spaCy pipeline in `spacy/`
(rule-based sentence splitting: argostranslate adds spaCy's `sentencizer` to it, so with
`ARGOS_CHUNK_TYPE=SPACY` nothing is downloaded; docs/serving.md "Deploying to LibreTranslate").

argostranslate decodes each sentence with `translate_batch(pieces, target_prefix=[[prefix]],
beam_size=4, length_penalty=0.2, replace_unknowns=True)` and removes the prefix from the text, so a
one-pair model exports one package (no prefix), and a multilingual model with a decoder-side tag
(data.tag_side "tgt") one package per trained pair, its target's tag as `target_prefix`. Packages
put nothing before a source, hold one tokenizer, and decode into one target: a source-side tag,
source-language codes or separate vocabularies are refused.

Running them offline (`offline_env`, `install`, `start_libretranslate`): argostranslate 1.11.0 or a
real LibreTranslate 1.9.6, whose fork of argostranslate (argos-translate-lt, the same module) lives
in a venv of its own (`./run.sh libretranslate`: LIBRETRANSLATE_VENV).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import IO, Optional, Sequence

from raymt.checkpoint import SPM_FILE, check_checkpoint, model_languages, tag_side
from raymt.config import DecodeOptions
from raymt.exporting import check_new_output, export_model
from raymt.tags import lang_name, lang_tag

PACKAGE_VERSION = "1.0"
ARGOS_VERSION = "1.9"  # the package format argostranslate 1.9+ reads (a `spacy/` or `minisbd/` splitter)
SPM_NAME = "sentencepiece.model"
# argostranslate's search in raymt's terms (translate.apply_packaged_translation: beam 4, length
# penalty 0.2; CTranslate2's default max_decoding_length 256, raymt's limit of a * len + b less one).
SEARCH = DecodeOptions(beam=4, length_penalty=0.2, max_len_a=0.0, max_len_b=257)
# Where `./run.sh libretranslate` installs LibreTranslate (beside the project's .venv).
LIBRETRANSLATE_VENV = ".venv-libretranslate"
INSTALL = (
    "import sys, pathlib, argostranslate.package as p\nfor f in sys.argv[1:]: p.install_from_path(pathlib.Path(f))"
)


def package_name(src: str, tgt: str) -> str:
    """argospm's name for a package: translate-en_de-1_0."""
    return f"translate-{src}_{tgt}-{PACKAGE_VERSION.replace('.', '_')}"


def argos_pairs(checkpoint: str | Path) -> list[tuple[str, str, str]]:
    """(source, target, target_prefix) of each package a checkpoint exports to; ValueError (one line)
    for a model the package format cannot express."""
    config, tokenizer = check_checkpoint(checkpoint)
    if not tokenizer.shared or tokenizer.target is not tokenizer.source:
        raise ValueError(
            "--format argos: an Argos package holds one SentencePiece model for both sides; "
            "this model has separate source and target tokenizers"
        )
    languages = model_languages(checkpoint)
    if languages is None:
        return [(*config.data.pair(), "")]
    if tag_side(languages) != "tgt" or "source_tags" in languages:
        raise ValueError(
            "--format argos: Argos packages put nothing before a source; this model reads "
            + ("its source's language code" if "source_tags" in languages else "its target's tag there")
            + " (a multilingual model exports with a decoder-side tag: data.tag_side tgt)"
        )
    return [(src, tgt, lang_tag(tgt)) for src, tgt in languages["pairs"]]


def metadata(src: str, tgt: str, prefix: str, checkpoint: str | Path) -> dict:
    """An Argos package's metadata.json."""
    return {
        "package_version": PACKAGE_VERSION,
        "argos_version": ARGOS_VERSION,
        "from_code": src,
        "from_name": lang_name(src),
        "to_code": tgt,
        "to_name": lang_name(tgt),
        "target_prefix": prefix,
        "type": "translate",
        "links": [],
        "dependencies": [],
        "description": f"exported by raymt from {checkpoint}",
    }


def write_spacy(directory: Path, src: str) -> None:
    """A blank spaCy pipeline for `src` (multilingual "xx" where spaCy has no such language):
    argostranslate adds the rule-based sentencizer to it."""
    try:
        import spacy
    except ImportError:
        raise ValueError("--format argos needs spaCy (a sentence splitter): pip install 'raymt[argos]'") from None
    try:
        nlp = spacy.blank(src)
    except ImportError:  # spaCy has no such language
        nlp = spacy.blank("xx")
    nlp.to_disk(directory)


def write_package(ct2: Path, output: Path, pair: tuple[str, str, str], checkpoint: str | Path) -> Path:
    """Zip `ct2` (a CTranslate2 export) as OUTPUT/translate-SRC_TGT-1_0.argosmodel for `pair`."""
    src, tgt, prefix = pair
    name = package_name(src, tgt)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / name
        shutil.copytree(ct2, root / "model", ignore=shutil.ignore_patterns(SPM_FILE))
        shutil.copyfile(ct2 / SPM_FILE, root / SPM_NAME)
        write_spacy(root / "spacy", src)
        (root / "metadata.json").write_text(json.dumps(metadata(src, tgt, prefix, checkpoint), indent=2))
        path = output / f"{name}.argosmodel"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for file in sorted(root.rglob("*")):
                zf.write(file, file.relative_to(tmp))
    return path


def export_argos(checkpoint: str | Path, output: str | Path, dtype: str = "int8") -> list[Path]:
    """Write one .argosmodel per pair of `checkpoint` into a new `output`; returns their paths."""
    output = check_new_output(output)
    pairs = argos_pairs(checkpoint)  # refuse before anything is written
    with tempfile.TemporaryDirectory() as tmp:
        ct2 = export_model(checkpoint, Path(tmp) / "model", "ctranslate2", dtype)
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"cannot create --output {output}: {err.strerror}") from None
        return [write_package(ct2, output, pair, checkpoint) for pair in pairs]


def offline_env(root: Path, threads: int = 1) -> dict[str, str]:
    """The environment (os.environ's, changed) in which argostranslate, or LibreTranslate, runs these
    packages offline with its files under `root`: its data, config, cache and packages directories;
    ARGOS_CHUNK_TYPE=SPACY (the package's spaCy splitter instead of MiniSBD, which downloads a
    model); the marker of spaCy's xx_sent_ud_sm in its cache (importing argostranslate.sbd under
    SPACY downloads it where missing); an empty package index on disk (LibreTranslate reads the
    index at start while fewer than two packages are installed, and would download packages and
    MiniSBD models from it); `threads`: CTranslate2's threads per translation."""
    env = dict(os.environ)
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "ARGOS_PACKAGES_DIR"):
        env[var] = str(root / var.lower())
    (root / "xdg_cache_home" / "argos-translate" / "spacy" / "senter" / "model").mkdir(parents=True, exist_ok=True)
    (root / "index").mkdir(parents=True, exist_ok=True)
    (root / "index" / "index.json").write_text("[]")
    env.update(
        ARGOS_CHUNK_TYPE="SPACY",
        ARGOS_PACKAGE_INDEX=(root / "index").as_uri() + "/",
        ARGOS_INTRA_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
    )
    return env


def install(python: str | Path, packages: Sequence[Path], env: dict[str, str]) -> None:
    """Install `packages` with `python`'s argostranslate (`install_from_path`) into env's directory."""
    done = subprocess.run([str(python), "-c", INSTALL, *map(str, packages)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"installing {', '.join(p.name for p in packages)} failed: {done.stderr[-2000:]}")


def start_libretranslate(
    executable: str | Path, env: dict[str, str], port: int, languages: Sequence[str], threads: int, log: IO
) -> subprocess.Popen:
    """LibreTranslate (`executable`) on 127.0.0.1:`port` serving the packages installed under `env`
    (`offline_env`), only `languages`, without its web page; `threads`: its HTTP server's (waitress)
    threads; its output to `log`. Returns once GET /languages answers."""
    flags = ["--host", "127.0.0.1", "--port", str(port), "--load-only", ",".join(languages)]
    flags += ["--disable-web-ui", "--threads", str(threads)]
    process = subprocess.Popen([str(executable), *flags], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/languages", process)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def wait_until_up(url: str, process: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """Return once `url` answers; RuntimeError if `process` exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited ({process.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:g} s")


def libretranslate_executable(root: str | Path) -> Optional[Path]:
    """LibreTranslate's executable in `root`'s LIBRETRANSLATE_VENV, None when not installed there."""
    path = Path(root) / LIBRETRANSLATE_VENV / "bin" / "libretranslate"
    return path if path.exists() else None
