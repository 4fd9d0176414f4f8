"""A real LibreTranslate 1.9.6 serves raymt's export (issue 69 item 2): `raymt export --format argos`
of the quick-start-sized model, installed offline into LibreTranslate's packages directory, started
with `--load-only en,de`, answers POST /translate (as libretranslatepy sends it: form-encoded, and a
JSON batch with `"source": "auto"`) with raymt's translations.

What it answers is LibreTranslate's formatting (`improve_translation_formatting`: the source's end
punctuation and case, the source itself for an empty output) of what its argostranslate fork
decodes; so the test checks both links: the answers equal that formatting of the fork's own
decoding of each sentence, and that decoding agrees with raymt's CTranslate2 engine (`raymt serve
--engine ctranslate2`) on the same int8 export at the same search, beam 4 and length penalty 0.2
(by raymt's score where they tie).

LibreTranslate's fork and the test extra's argostranslate are one module, so LibreTranslate lives in
a venv of its own, `.venv-libretranslate` (`./run.sh libretranslate`, which .ci/run calls before the
tests marked ci); without it the test is skipped, except under CI, where it fails."""

import json
import os
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from agreement import assert_translations_agree
from conftest import free_port
from test_tags import SENTENCES
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import argos, export
from raymt.engines import load_engine

pytestmark = [pytest.mark.slow, pytest.mark.ci, pytest.mark.hosts]  # ~30 s: two processes of LibreTranslate's venv
ROOT = Path(__file__).resolve().parents[1]

# In LibreTranslate's venv: its fork's decoding of each sentence (as LibreTranslate's /translate
# calls it) and LibreTranslate's formatting of it (app.py: unescape(improve_translation_formatting)).
FORK_DECODES = """
import html, json, sys
import argostranslate.translate
from libretranslate.language import improve_translation_formatting
src, tgt, sentences = json.loads(sys.stdin.read())
translation = argostranslate.translate.get_translation_from_codes(src, tgt)
raw = [translation.hypotheses(s, 1)[0].value for s in sentences]
formatted = [html.unescape(improve_translation_formatting(s, r)) for s, r in zip(sentences, raw)]
print(json.dumps([raw, formatted]))
"""


def libretranslate() -> Path:
    """LibreTranslate's executable in .venv-libretranslate; a skip where it is missing, a failure
    under CI (.ci/run installs it before the tests marked ci)."""
    executable = argos.libretranslate_executable(ROOT)
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail(f"no {argos.LIBRETRANSLATE_VENV}: .ci/run installs it (./run.sh libretranslate)")
        pytest.skip(f"no {argos.LIBRETRANSLATE_VENV} (./run.sh libretranslate installs it)")
    return executable


def post(url: str, fields: dict, form: bool) -> dict:
    """The JSON answer of one POST (form-encoded as libretranslatepy sends it, or JSON)."""
    if form:
        body, kind = urllib.parse.urlencode(fields).encode(), "application/x-www-form-urlencoded"
    else:
        body, kind = json.dumps(fields).encode(), "application/json"
    request = urllib.request.Request(url, body, {"Content-Type": kind})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_libretranslate_serves_the_export_offline_as_raymt_translates(tmp_path):
    executable = libretranslate()
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    export.run(export.ExportConfig(checkpoint=str(checkpoint), output=str(tmp_path / "argos"), format="argos"))
    [package] = sorted((tmp_path / "argos").iterdir())
    env = argos.offline_env(tmp_path / "lt")
    python = executable.parent / "python"
    argos.install(python, [package], env)
    assert (tmp_path / "lt" / "argos_packages_dir" / "translate-en_de-1_0" / "metadata.json").exists()
    sentences = SENTENCES[:8]
    port = free_port()
    with open(tmp_path / "libretranslate.log", "w+") as log:
        server = argos.start_libretranslate(executable, env, port, ["en", "de"], 1, log)
        try:
            url = f"http://127.0.0.1:{port}"
            with urllib.request.urlopen(f"{url}/languages", timeout=30) as response:
                languages = {lang["code"]: lang["targets"] for lang in json.loads(response.read())}
            assert "de" in languages["en"]
            single = [post(f"{url}/translate", {"q": s, "source": "en", "target": "de"}, True) for s in sentences]
            batch = post(f"{url}/translate", {"q": sentences, "source": "auto", "target": "de"}, False)
        finally:
            server.terminate()
            server.wait(timeout=30)
        log.seek(0)
        logged = log.read()
    assert "HTTPSConnection" not in logged and "Downloading" not in logged, logged[-2000:]
    assert not list((tmp_path / "lt").rglob("*.onnx")), "MiniSBD fetched a model: the package's splitter went unused"
    got = [answer["translatedText"] for answer in single]
    assert batch["translatedText"] == got
    assert {d["language"] for d in batch["detectedLanguage"]} == {"en"}

    stdin = json.dumps(["en", "de", sentences])
    done = subprocess.run([str(python), "-c", FORK_DECODES], input=stdin, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    raw, formatted = json.loads(done.stdout.splitlines()[-1])
    assert got == formatted  # one engine, one host: LibreTranslate answers its fork's decoding, formatted
    ct2 = export.run(
        export.ExportConfig(
            checkpoint=str(checkpoint), output=str(tmp_path / "ct2"), format="ctranslate2", dtype="int8"
        )
    )
    engine = load_engine(str(ct2), "ctranslate2", compute_type="int8")
    want = [nbest[0][1] for nbest in engine.translate(sentences, argos.SEARCH, "de")]
    tied = assert_translations_agree(checkpoint, sentences, "de", raw, want)
    print(f"LibreTranslate and raymt: {len(sentences) - tied} of {len(sentences)} equal, {tied} tied")
