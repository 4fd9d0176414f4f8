"""`raymt export --format argos` (issue 69 item 1): Argos Translate packages that argostranslate
installs offline and translates with as raymt's CTranslate2 engine (`raymt backtranslate`'s and
`raymt serve`'s) does on the same int8 export at argostranslate's settings (beam 4, length penalty
0.2), one package per pair of a model with a decoder-side tag, and a one-line refusal of what the
package format cannot express.

argostranslate reads its settings from the environment when imported, so it runs in a subprocess
whose environment keeps it off ~/.local and ~/.config and off the network (`raymt.argos.offline_env`)."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from agreement import assert_translations_agree
from test_decoder_tag import save_decoder_tagged
from test_tags import PAIRS, SENTENCES, TAGS, tagged_tokenizer
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import argos, export
from raymt.checkpoint import languages_entry, save_checkpoint
from raymt.command import parse, to_argv
from raymt.config import Config, CorpusSpec, DataConfig, tiny
from raymt.engines import load_engine
from raymt.model import Transformer

pytestmark = pytest.mark.hosts  # decoded outputs across engines: ./run.sh test --hosts
# The translating tests take 10-30 s each (argostranslate starts in a subprocess): `-m ci`.
pytest.importorskip("argostranslate")

RUN_ARGOS = """
import json, sys
from pathlib import Path
import argostranslate.package, argostranslate.translate
packages, pairs, sentences = json.loads(sys.stdin.read())
for path in packages:
    argostranslate.package.install_from_path(Path(path))
out = {f"{s}-{t}": [argostranslate.translate.translate(x, s, t) for x in sentences] for s, t in pairs}
print(json.dumps(out))
"""


def argos_translate(root: Path, packages: list[Path], pairs: list[tuple[str, str]], sentences: list[str]) -> dict:
    """argostranslate's translations of `sentences` for each pair, after installing `packages`."""
    stdin = json.dumps([[str(p) for p in packages], pairs, sentences])
    done = subprocess.run(
        [sys.executable, "-c", RUN_ARGOS], input=stdin, env=argos.offline_env(root), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HTTPSConnection" not in done.stderr, done.stderr[-2000:]  # nothing tried the network
    assert not list(root.rglob("*.onnx")), "MiniSBD fetched a model: the package's spaCy splitter went unused"
    return json.loads(done.stdout.splitlines()[-1])


def raymt_translate(checkpoint: Path, tmp: Path, sentences: list[str], tgt_lang: str) -> list[str]:
    """raymt's CTranslate2 engine (`raymt backtranslate`'s, `raymt serve`'s) on the int8 export of
    `checkpoint` (`raymt export --format ctranslate2 --dtype int8`: the package's model) at
    argostranslate's search."""
    ct2 = export.run(
        export.ExportConfig(checkpoint=str(checkpoint), output=str(tmp), format="ctranslate2", dtype="int8")
    )
    engine = load_engine(str(ct2), "ctranslate2", compute_type="int8")
    return [nbest[0][1] for nbest in engine.translate(sentences, argos.SEARCH, tgt_lang)]


@pytest.mark.slow  # ~5 s: argostranslate in a subprocess (CI runs it: -m ci)
@pytest.mark.ci
def test_a_one_pair_model_installs_and_translates_as_raymt(tmp_path, capsys):
    """Done-when 1: the quick-start-sized model's package, installed offline, translates each sentence
    as raymt's engine does (by raymt's score where the texts differ). Untrained, its outputs run to
    the length limit, which this search shares with argostranslate's."""
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    cfg = export.ExportConfig(checkpoint=str(checkpoint), output=str(tmp_path / "argos"), format="argos")
    assert cfg.weight_type == "int8"
    export.run(cfg)
    [package] = sorted((tmp_path / "argos").iterdir())
    assert package.name == "translate-en_de-1_0.argosmodel"
    with zipfile.ZipFile(package) as zf:
        names = set(zf.namelist())
        meta = json.loads(zf.read("translate-en_de-1_0/metadata.json"))
    assert {"translate-en_de-1_0/sentencepiece.model", "translate-en_de-1_0/model/model.bin"} <= names
    assert any(n.startswith("translate-en_de-1_0/spacy/") for n in names)
    assert (meta["from_code"], meta["from_name"], meta["to_code"], meta["to_name"]) == ("en", "English", "de", "German")
    assert meta["target_prefix"] == ""
    assert "install_from_path" in capsys.readouterr().out
    sentences = SENTENCES[:6]
    got = argos_translate(tmp_path / "env", [package], [("en", "de")], sentences)["en-de"]
    want = raymt_translate(checkpoint, tmp_path / "ct2", sentences, "de")
    assert_translations_agree(checkpoint, sentences, "de", got, want)


@pytest.mark.slow  # ~7 s: a 400-step model, argostranslate in a subprocess (CI runs it: -m ci)
@pytest.mark.ci
def test_a_decoder_tagged_model_exports_one_package_per_pair(tmp_path):
    """A multilingual model with data.tag_side "tgt": a package per pair, the target's tag its
        target_prefix; each translates as raymt's engine does into that language, without the tag, and
    splits a text into sentences with the package's spaCy pipeline."""
    checkpoint = save_decoder_tagged(tmp_path / "ckpt")
    export.run(export.ExportConfig(checkpoint=str(checkpoint), output=str(tmp_path / "argos"), format="argos"))
    packages = sorted((tmp_path / "argos").iterdir())
    assert [p.name for p in packages] == ["translate-en_de-1_0.argosmodel", "translate-en_fr-1_0.argosmodel"]
    with zipfile.ZipFile(packages[1]) as zf:
        assert json.loads(zf.read("translate-en_fr-1_0/metadata.json"))["target_prefix"] == "<2fr>"
    sentences = SENTENCES[:6]
    split = [f"{sentences[0]}.", f"{sentences[1]}.", f"{sentences[0]}. {sentences[1]}."]
    got = argos_translate(tmp_path / "env", packages, [("en", "de"), ("en", "fr")], sentences + split)
    ct2 = export.run(
        export.ExportConfig(
            checkpoint=str(checkpoint), output=str(tmp_path / "ct2"), format="ctranslate2", dtype="int8"
        )
    )
    engine = load_engine(str(ct2), "ctranslate2", compute_type="int8")
    for tgt in ("de", "fr"):
        want = [nbest[0][1] for nbest in engine.translate(sentences, argos.SEARCH, tgt)]
        texts, (first, second, both) = got[f"en-{tgt}"][:-3], got[f"en-{tgt}"][-3:]
        assert not any("<2" in text for text in got[f"en-{tgt}"])
        assert_translations_agree(checkpoint, sentences, tgt, texts, want)
        # Two sentences are split (the package's spaCy splitter), translated apart and joined.
        assert both == f"{first} {second}"
    assert got["en-de"] != got["en-fr"]


def test_a_source_side_tag_is_refused_in_one_line(tmp_path):
    """Argos packages put nothing before a source: a model reading its target's tag there is
    refused in one line, before anything is written."""
    tok = tagged_tokenizer()
    config = Config(model=tiny(), data=DataConfig(vocab_size=256, corpora=[CorpusSpec(s, t) for s, t in PAIRS]))
    languages = languages_entry(PAIRS, {piece: tok.sp.piece_to_id(piece) for piece in TAGS}, "src")
    checkpoint = save_checkpoint(
        tmp_path / "ckpt", Transformer(config.model, tok.vocab_size), config, tok, None, languages
    )
    cfg = export.ExportConfig(checkpoint=str(checkpoint), output=str(tmp_path / "out"), format="argos")
    assert parse(export.ExportConfig, to_argv(cfg), "export") == cfg and cfg.weight_type == "int8"
    with pytest.raises(ValueError, match="^--format argos: Argos packages put nothing before a source") as err:
        export.run(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
