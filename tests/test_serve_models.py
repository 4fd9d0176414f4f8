"""`raymt serve --model NAME=CKPT ...` over real HTTP: three tiny checkpoints (a tagged en->de/fr
model, a one-pair en->de one and a de->en one) behind Serve multiplexing, one model held a replica at a time;
each request answered by the model its `model` field or its pair names, equal to `raymt
translate`'s output for that checkpoint; the page at `/` in a headless Chromium (CI).
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest
from conftest import free_port
from test_serve import cli_translation, http, serve_config, tagged  # noqa: F401 (a fixture)
from test_tags import SENTENCES
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

pytestmark = [pytest.mark.slow, pytest.mark.ci]
MAX_TEXT_CHARS = 500  # the page's character count shows it


@pytest.fixture(scope="module")
def models(tagged, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """{name: checkpoint}: the tagged en->de/fr model of test_serve, a one-pair en->de model and a
    de->en one (the page's swap)."""
    made = tmp_path_factory.mktemp("models")
    return {
        "multi": str(tagged),
        "ende": str(make_checkpoint(made / "ende", 3)),
        "deen": str(make_checkpoint(made / "deen", 4, pair="de-en")),
    }


@pytest.fixture(scope="module")
def server(models, ray_cluster):
    """Both models served on the session's Ray head, one replica holding one model at a time."""
    from ray import serve

    from raymt.serve.app import start

    cfg = serve_config(
        "-",
        models=models,
        models_per_replica=1,
        port=free_port(),
        request_timeout_s=60.0,
        max_text_chars=MAX_TEXT_CHARS,
    )
    start(cfg)
    try:
        yield f"http://127.0.0.1:{cfg.port}"
    finally:
        serve.shutdown()


def test_each_request_is_answered_by_the_model_it_names_or_its_pair_picks(server, models, capsys):
    want_fr = cli_translation(models["multi"], SENTENCES[:3], "fr", capsys)
    want_ende = cli_translation(models["ende"], SENTENCES[:3], "de", capsys)
    want_multi_de = cli_translation(models["multi"], SENTENCES[:3], "de", capsys)
    assert want_ende != want_multi_de  # the two models answer differently
    for _ in range(2):  # one model a replica: each request loads its model again
        status, body, _ = http(f"{server}/v1/translate", {"text": SENTENCES[:3], "target": "fr"})
        assert (status, body["model"], [t["text"] for t in body["translations"]]) == (200, "multi", want_fr)
        status, body, _ = http(f"{server}/v1/translate", {"text": SENTENCES[:3], "target": "de", "model": "ende"})
        assert (status, body["model"], [t["text"] for t in body["translations"]]) == (200, "ende", want_ende)
    libre = {"q": SENTENCES[:3], "source": "en", "target": "de", "model": "multi"}
    status, body, _ = http(f"{server}/translate", libre)
    assert (status, body["translatedText"]) == (200, want_multi_de)
    status, body, _ = http(f"{server}/translate", {"q": SENTENCES[0], "source": "en", "target": "fr"}, form=True)
    assert (status, body["translatedText"]) == (200, want_fr[0])


def test_an_ambiguous_or_unknown_model_is_a_400_naming_the_choices(server):
    status, body, _ = http(f"{server}/v1/translate", {"text": "Hello.", "target": "de"})
    assert status == 400 and "served by models multi, ende: name one in the model field" in body["error"]
    status, body, _ = http(f"{server}/translate", {"q": "Hello.", "source": "en", "target": "de", "model": "x"})
    assert (
        status == 400
        and "model 'x': no such model; this server serves multi (en-de, en-fr), ende (en-de)" in (body["error"])
    )
    status, body, _ = http(f"{server}/v1/translate", {"text": "Hello.", "target": "es"})
    assert status == 400 and body["error"].startswith("no model translates any source -> es")


def test_languages_and_models_list_what_each_model_serves(server):
    assert http(f"{server}/languages")[1] == [
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "en", "name": "English", "targets": ["de", "fr"]},
        {"code": "fr", "name": "French", "targets": []},
    ]
    assert http(f"{server}/v1/models")[1] == {
        "models": [
            {"name": "multi", "pairs": [["en", "de"], ["en", "fr"]]},
            {"name": "ende", "pairs": [["en", "de"]]},
            {"name": "deen", "pairs": [["de", "en"]]},
        ]
    }
    assert http(f"{server}/ready")[1]["ready"] is True


def test_a_request_goes_on_to_another_replica_only_when_serve_did_not_route_it_by_its_model(server):
    """One model a replica, two served: a request whose model Serve's header names was routed by
    it and is answered where it lands (one hop); one naming it only in its body goes on to a
    replica holding its model (Forwarder, one more hop)."""
    body = json.dumps({"text": "Hello.", "target": "de", "model": "ende"}).encode()

    def send(headers: dict) -> tuple[int, str, int]:
        request = urllib.request.Request(f"{server}/v1/translate", body, {"Content-Type": "application/json"} | headers)
        with urllib.request.urlopen(request, timeout=120) as response:
            status, model = response.status, json.loads(response.read())["model"]
        return status, model, http(f"{server}/stats")[1]["forwarded"]  # the one replica's

    forwarded = http(f"{server}/stats")[1]["forwarded"]
    assert send({"serve_multiplexed_model_id": "ende"}) == (200, "ende", forwarded)
    assert send({}) == (200, "ende", forwarded + 1)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="no chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver; .ci/run does)",
)
def test_the_page_in_headless_chromium_translates_a_typed_sentence(server, models, capsys):
    """Typed text counted; both menus name languages alike; Detect finds English; each choice of
    target and model answers as `raymt translate`; swap puts the translation back as the source
    of the reverse pair (another model) and translates it as that model does."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    from selenium.webdriver.support.ui import Select, WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, on failure
    wants = {
        key: cli_translation(models[key[0]], SENTENCES, key[1], capsys) for key in (("multi", "fr"), ("ende", "de"))
    }
    # a sentence both untrained models answer with some text (most get an empty answer)
    i = next(i for i in range(len(SENTENCES)) if all(want[i] for want in wants.values()))
    back = cli_translation(models["deen"], [wants[("ende", "de")][i]], "en", capsys)[0]
    t0 = time.time()
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    find = browser.find_element
    try:
        browser.get(f"{server}/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: len(Select(find("id", "model")).options) == 4)  # any, multi, ende, deen
        assert find("id", "models").is_displayed()
        source, target = Select(find("id", "source")), Select(find("id", "target"))
        assert [o.text for o in source.options] == ["Detect", "German", "English"]
        assert [o.text for o in target.options] == ["German", "English", "French"]  # Detect: every target
        source.select_by_value("en")
        assert [o.text for o in target.options] == ["German", "French"]
        box = find("id", "input")
        box.send_keys(SENTENCES[i])
        assert find("id", "count").text == f"{len(SENTENCES[i])} / {MAX_TEXT_CHARS}"

        def translate(model: str, target_code: str, source_code: str = "") -> str:
            if source_code:
                source.select_by_value(source_code)
            target.select_by_value(target_code)
            Select(find("id", "model")).select_by_value(model)
            find("id", "go").click()  # disabled until the answer
            wait.until(lambda b: find("id", "go").is_enabled())
            assert not find("id", "error").text, find("id", "error").text
            return find("id", "output").text

        assert translate("", "fr", "auto") == wants[("multi", "fr")][i]
        assert find("id", "detected").text.startswith("Detected: English (")  # multi's one source
        assert translate("ende", "de", "en") == wants[("ende", "de")][i]
        assert find("id", "detected").text == ""
        assert find("id", "swap").is_enabled()  # deen serves de -> en
        find("id", "swap").click()
        picked = (source.first_selected_option.text, target.first_selected_option.text)
        assert picked == ("German", "English") and box.get_attribute("value") == wants[("ende", "de")][i]
        assert Select(find("id", "model")).first_selected_option.text == "any"  # ende does not serve de -> en
        assert translate("", "en") == back
        source.select_by_value("en")
        target.select_by_value("fr")
        assert not find("id", "swap").is_enabled()  # nothing serves fr -> en
    except Exception:
        print("browser console:", browser.get_log("browser"), "\npage:", browser.page_source[-1500:])
        raise
    finally:
        browser.quit()
    print(f"headless chromium: {time.time() - t0:.1f} s")
