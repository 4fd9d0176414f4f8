"""The one-page UI of `raymt serve` at `/`: a text box, the languages served (GET /languages), the
model when the server has several (GET /v1/models) and a Translate button (POST /translate); no
external assets."""

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
#error { color: #b00; }
</style>
</head>
<body>
<h1>raymt serve</h1>
<div class="row">
  <label>From <select id="source"></select></label>
  <label>To <select id="target"></select></label>
  <label id="models" hidden>Model <select id="model"><option value="">any</option></select></label>
  <button id="go" type="button">Translate</button>
</div>
<textarea id="input" placeholder="Text to translate"></textarea>
<div id="error" role="alert"></div>
<div id="output" aria-live="polite"></div>
<script>
const $ = (id) => document.getElementById(id);
let languages = [];
function fillTargets() {
  const lang = languages.find((l) => l.code === $("source").value);
  $("target").innerHTML = "";
  for (const code of (lang ? lang.targets : [])) $("target").add(new Option(code, code));
}
async function load() {
  languages = await (await fetch("/languages")).json();
  for (const l of languages.filter((l) => l.targets.length)) $("source").add(new Option(l.name, l.code));
  fillTargets();
  const models = (await (await fetch("/v1/models")).json()).models;
  for (const m of models) $("model").add(new Option(m.name, m.name));
  $("models").hidden = models.length < 2;
}
async function translate() {
  $("error").textContent = "";
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
}
$("source").addEventListener("change", fillTargets);
$("go").addEventListener("click", translate);
load();
</script>
</body>
</html>
"""
