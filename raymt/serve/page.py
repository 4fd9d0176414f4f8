"""The one-page UI of `raymt serve` at `/`, laid out as LibreTranslate's users know it: From and To
name the languages served (GET /languages) alike, From offers Detect (`"source": "auto"`: the
server's language ID, as POST /detect answers it, and the page shows what it found), a swap
button where the reverse pair is served, a character count against the server's limit, the model
when the server has several (GET /v1/models) and a Translate button (POST /translate); no
external assets."""

# The server's `max_text_chars` goes in its place (`page`).
LIMIT = "__MAX_TEXT_CHARS__"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>raymt serve</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }
textarea { width: 100%; height: 10rem; font: inherit; box-sizing: border-box; }
.row { display: flex; gap: 1rem; align-items: center; margin: 0.5rem 0; }
#output { white-space: pre-wrap; border: 1px solid #ccc; min-height: 10rem; padding: 0.5rem; }
#error, .over { color: #b00; }
#count { margin-left: auto; color: #555; }
#detected { color: #555; }
</style>
</head>
<body>
<h1>raymt serve</h1>
<div class="row">
  <label>From <select id="source"><option value="auto">Detect</option></select></label>
  <button id="swap" type="button" title="Swap languages" aria-label="Swap languages" disabled>&#8644;</button>
  <label>To <select id="target"></select></label>
  <label id="models" hidden>Model <select id="model"><option value="">any</option></select></label>
  <button id="go" type="button">Translate</button>
</div>
<textarea id="input" placeholder="Text to translate" maxlength="__MAX_TEXT_CHARS__"></textarea>
<div class="row"><span id="detected"></span><span id="count"></span></div>
<div id="error" role="alert"></div>
<div id="output" aria-live="polite"></div>
<script>
const $ = (id) => document.getElementById(id);
const LIMIT = __MAX_TEXT_CHARS__;
let languages = [], models = [], detected = null;  // detected: the code the server found for Detect
const nameOf = (code) => (languages.find((l) => l.code === code) || { name: code }).name;
const sourceCode = () => ($("source").value === "auto" ? detected : $("source").value);
function targetsOf(code) {  // Detect: every language some source translates into
  const targeted = (l) => languages.some((s) => s.targets.includes(l.code));
  if (code === "auto") return languages.filter(targeted).map((l) => l.code);
  const lang = languages.find((l) => l.code === code);
  return lang ? lang.targets : [];
}
function fillTargets() {
  const kept = $("target").value;
  $("target").innerHTML = "";
  for (const code of targetsOf($("source").value)) $("target").add(new Option(nameOf(code), code));
  if (targetsOf($("source").value).includes(kept)) $("target").value = kept;
  updateSwap();
}
function updateSwap() {  // only to a pair the server translates
  const source = sourceCode(), target = $("target").value;
  $("swap").disabled = !(source && target && targetsOf(target).includes(source));
}
function showDetected(found) {
  detected = found ? found.language : null;
  $("detected").textContent = found ? `Detected: ${nameOf(found.language)} (${found.confidence}%)` : "";
  updateSwap();
}
function count() {  // code points, as the server counts them
  const n = [...$("input").value].length;
  $("count").textContent = `${n} / ${LIMIT}`;
  $("count").classList.toggle("over", n > LIMIT);
}
function swap() {
  const source = sourceCode(), target = $("target").value;
  $("source").value = target;
  showDetected(null);
  fillTargets();
  $("target").value = source;
  if ($("output").textContent) $("input").value = $("output").textContent;
  $("output").textContent = "";
  const model = models.find((m) => m.name === $("model").value);
  if (model && !model.pairs.some(([s, t]) => s === target && t === source)) $("model").value = "";
  count();
  updateSwap();
}
async function load() {
  languages = await (await fetch("/languages")).json();
  for (const l of languages.filter((l) => l.targets.length)) $("source").add(new Option(l.name, l.code));
  fillTargets();
  count();
  models = (await (await fetch("/v1/models")).json()).models;
  for (const m of models) $("model").add(new Option(m.name, m.name));
  $("models").hidden = models.length < 2;
}
async function translate() {
  $("error").textContent = "";
  $("go").disabled = true;  // until the answer: a test waits for it
  try {
    const body = { q: $("input").value, source: $("source").value, target: $("target").value, format: "text" };
    const headers = { "Content-Type": "application/json" };
    if ($("model").value) {
      body.model = $("model").value;
      headers["serve_multiplexed_model_id"] = body.model;  // Serve routes it to a replica holding its model
    }
    const response = await fetch("/translate", { method: "POST", headers: headers, body: JSON.stringify(body) });
    const answer = await response.json();
    if (!response.ok) { $("error").textContent = answer.error; return; }
    $("output").textContent = answer.translatedText;
    showDetected(answer.detectedLanguage || null);
  } catch (err) {
    $("error").textContent = String(err);
  } finally {
    $("go").disabled = false;
  }
}
$("source").addEventListener("change", () => { showDetected(null); fillTargets(); });
$("target").addEventListener("change", updateSwap);
$("input").addEventListener("input", () => { count(); showDetected(null); });
$("swap").addEventListener("click", swap);
$("go").addEventListener("click", translate);
load();
</script>
</body>
</html>
"""


def page(max_text_chars: int) -> str:
    """The page, its character count against the server's `max_text_chars`."""
    return PAGE.replace(LIMIT, str(max_text_chars))
