"""`raymt serve` (raymt.serve): text in sentences and back, one replica's batching across requests,
the API's answers and errors without Ray, then real HTTP requests to a server on the session's
Ray head: answers equal `raymt translate`'s, concurrent requests and two targets share batches,
LibreTranslate's JSON and form bodies, every error code, and the command's one-line errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from agreement import assert_translations_agree
from conftest import free_port
from test_tags import PAIRS, SENTENCES, TAGS, tagged_tokenizer
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import translate as translate_cli
from raymt.checkpoint import languages_entry, save_checkpoint
from raymt.command import parse
from raymt.config import Config, DataConfig, DecodeOptions, ServeConfig, tiny
from raymt.engines import load_engine
from raymt.model import Transformer
from raymt.serve import __main__ as serve_cli
from raymt.serve.api import Service
from raymt.serve.routing import Refused, Reply, Router
from raymt.serve.text import chunk, layout
from raymt.tokenizer import BOS_ID, PAD_ID

OPTS = DecodeOptions(beam=2, max_len_a=0.0, max_len_b=6)
MAX_POSITIONS = 48  # small, so that a long sentence is chunked


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """A random tagged en->de/fr checkpoint with few positions."""
    torch.manual_seed(5)
    tok = tagged_tokenizer()
    config = Config(model=tiny(), data=DataConfig(vocab_size=256))
    config.model.max_positions = MAX_POSITIONS
    languages = languages_entry(PAIRS, {piece: tok.sp.piece_to_id(piece) for piece in TAGS})
    model = Transformer(config.model, tok.vocab_size)
    with torch.no_grad():
        model.embed.weight[[PAD_ID, BOS_ID]] = 0.0
    return save_checkpoint(tmp_path_factory.mktemp("serve") / "tagged", model, config, tok, None, languages)


def serve_config(checkpoint, **changes) -> ServeConfig:
    """A small server's config: raymt's engine, the test's search, a quarter CPU."""
    base = ServeConfig({"default": str(checkpoint)}, engine="raymt", decode=OPTS, cpus_per_replica=0.25, max_texts=16)
    return dataclasses.replace(base, **changes)


def cli_translation(checkpoint, texts, tgt_lang, capsys) -> list[str]:
    """What `raymt translate` prints for the texts with the test's search."""
    capsys.readouterr()
    flags = ["--checkpoint", str(checkpoint), "--tgt-lang", tgt_lang, "--beam", "2", "--max-len-a", "0"]
    assert translate_cli.main([*flags, "--max-len-b", "6", *texts]) == 0
    return capsys.readouterr().out.splitlines()


# ---------------------------------------------------------------- text


def test_layout_keeps_lines_and_blank_lines_and_chunks_long_sentences():
    text = "One. Two!\n\n  Three?\nfour five six seven"
    lay = layout(text, lambda s: len(s.split()), 3)
    assert lay.segments == ["One.", "Two!", "Three?", "four five six", "seven"]
    assert lay.join([s.upper() for s in lay.segments]) == "ONE. TWO!\n\nTHREE?\nFOUR FIVE SIX SEVEN"
    assert chunk("a b c d e", lambda s: len(s.split()), 2) == ["a b", "c d", "e"]


# ---------------------------------------------------------------- without Ray


def call(service: Service, method: str, path: str, body=None, form: bool = False):
    """(status, JSON body, headers) of one request to a Service, without HTTP."""
    if form:
        data, kind = urllib.parse.urlencode(body, doseq=True).encode(), "application/x-www-form-urlencoded"
    else:
        data, kind = json.dumps(body).encode() if body is not None else b"", "application/json"
    reply = asyncio.run(service.handle(method, path, kind, data))
    return reply.status, json.loads(reply.content()) if reply.media_type == "application/json" else None, reply.headers


@pytest.fixture(scope="module")
def engine(tagged):
    return load_engine(str(tagged), "raymt")


def test_concurrent_requests_share_one_batch_and_answer_in_order(engine, tagged, capsys):
    service = Service(engine, serve_config(tagged))

    async def both():
        de = service.handle("POST", "/v1/translate", "application/json",
                            json.dumps({"text": SENTENCES[:3], "target": "de"}).encode())  # fmt: skip
        fr = service.handle("POST", "/v1/translate", "application/json",
                            json.dumps({"text": SENTENCES[3:5], "target": "fr"}).encode())  # fmt: skip
        return await asyncio.gather(de, fr)

    de, fr = asyncio.run(both())
    stats = service.batcher.stats
    assert (stats.batches, stats.shared_batches, stats.multi_target_batches) == (1, 1, 1)
    got_de = [t["text"] for t in json.loads(de.content())["translations"]]
    got_fr = [t["text"] for t in json.loads(fr.content())["translations"]]
    assert got_de == cli_translation(tagged, SENTENCES[:3], "de", capsys)
    assert got_fr == cli_translation(tagged, SENTENCES[3:5], "fr", capsys)


def test_a_long_text_is_chunked_not_truncated(engine, tagged):
    service = Service(engine, serve_config(tagged))
    long = " ".join(SENTENCES[:8]).replace(".", "")  # one sentence over the model's positions
    status, body, _ = call(service, "POST", "/v1/translate", {"text": f"{long}\n\n{SENTENCES[0]}", "target": "de"})
    assert status == 200 and body["translations"]["source_tokens"] > MAX_POSITIONS
    assert service.batcher.stats.sentences >= 3 and body["translations"]["text"].count("\n") == 2


@pytest.mark.parametrize(
    "body, status, limit",
    [
        ({"text": ["a"] * 17, "target": "de"}, 413, "max_texts"),
        ({"text": "a" * 20_001, "target": "de"}, 413, "max_text_chars"),
        ({"text": "a", "target": "de", "beam": 9}, 400, "max_beam"),
        ({"text": "a", "target": "de", "alternatives": 4}, 400, "max_alternatives"),
        ({"text": "a", "target": "xx"}, 400, None),
        ({"text": "a"}, 400, None),
        ({"target": "de"}, 400, None),
    ],
)
def test_bad_requests_are_json_errors_naming_the_limit(engine, tagged, body, status, limit):
    got, answer, _ = call(Service(engine, serve_config(tagged)), "POST", "/v1/translate", body)
    assert got == status and answer["error"] and answer.get("limit") == limit


def test_a_full_queue_is_503_with_retry_after_and_a_late_answer_504(engine, tagged):
    full = Service(engine, serve_config(tagged, max_queue_sentences=2))
    status, answer, headers = call(full, "POST", "/v1/translate", {"text": SENTENCES[:3], "target": "de"})
    assert (status, answer["limit"], headers["Retry-After"]) == (503, "max_queue_sentences", "1")
    late = Service(engine, serve_config(tagged, request_timeout_s=1e-4))
    status, answer, _ = call(late, "POST", "/v1/translate", {"text": SENTENCES[:3], "target": "de"})
    assert (status, answer["limit"]) == (504, "request_timeout_s")
    assert late.batcher.stats.timed_out == 1


class FakeTranslator:
    """The translator deployment's handle whose first calls fail with the given errors."""

    def __init__(self, *errors):
        self.errors, self.calls, self.models = list(errors), 0, []
        self.answer = self

    def options(self, multiplexed_model_id: str):
        self.models.append(multiplexed_model_id)
        return self

    def remote(self, *args):
        async def reply():
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            return Reply(200, {})

        return reply()


@pytest.mark.parametrize("errors, calls, retried", [((), 1, 0), (("died",), 2, 1), (("died", "died"), 2, 1)])
def test_a_forwarded_request_is_retried_once_when_its_replica_dies(errors, calls, retried):
    from ray.exceptions import ActorDiedError

    from raymt.serve.app import Forwarder

    translator = FakeTranslator(*[ActorDiedError() for _ in errors])
    forwarder = Forwarder(lambda: translator, 1)
    reply = asyncio.run(forwarder.call(("POST", "/v1/translate", "", b"", ""), "ende"))
    if len(errors) == 2:
        assert (reply.status, reply.headers) == (503, {"Retry-After": "1"}) and "failed twice" in reply.body["error"]
    else:
        assert reply.status == 200
    assert (translator.calls, forwarder.retried, forwarder.forwarded) == (calls, retried, 1)
    assert translator.models == ["ende"]  # routed by its model


def test_a_forwarded_request_turns_back_pressure_into_a_json_503():
    from ray.serve.exceptions import BackPressureError

    from raymt.serve.app import Forwarder

    translator = FakeTranslator(BackPressureError(num_queued_requests=9, max_queued_requests=8))
    reply = asyncio.run(Forwarder(lambda: translator, 2).call(("POST", "/v1/translate", "", b"", ""), "ende"))
    assert (reply.status, reply.headers["Retry-After"], reply.body["limit"]) == (503, "2", "max_queued_requests")
    assert json.loads(reply.content())["error"].startswith("the server is busy")


# ---------------------------------------------------------------- the command


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--engine", "fast"], "--engine fast: no such engine"),
        (["--replicas", "0"], "--replicas 0 must be >= 1"),
        (["--beam", "9"], "--beam 9 is above --max-beam 8"),
        (["--port", "70000"], "--port 70000 must be between 1 and 65535"),
        (["--autoscale", "4:2"], "--autoscale 4:2: give MIN:MAX replicas"),
        (["--autoscale", "1:2", "--replicas", "2"], "--replicas and --autoscale: give one of them"),
        (["--device", "cuda:7"], "--device cuda:7"),
    ],
)
def test_bad_flags_are_one_line_before_ray(tagged, flags, message, capsys):
    assert serve_cli.main(["--checkpoint", str(tagged), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "--checkpoint CKPT or --model NAME=CKPT is required"),
        (["--model", "nameless"], "--model nameless: give NAME=CKPT"),
        (["--model", "a=x", "--model", "a=y"], "--model a=... is given twice"),
        (["--model", "a b=x"], "--model a b=...: a name is letters"),
        (["--checkpoint", "x", "--model", "a=x"], "--checkpoint and --model: give one of them"),
        (["--model", "a=/no/such/dir", "--model", "b=/no/such/dir"], "--model a=/no/such/dir: "),
        (["--model", "a=x", "--models-per-replica", "-1"], "--models-per-replica -1 must be >= 0"),
    ],
)
def test_bad_model_flags_are_one_line_before_ray(flags, message, capsys):
    assert serve_cli.main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_router_picks_a_model_by_name_or_by_its_one_pair():
    router = Router({"multi": [("en", "de"), ("en", "fr")], "ende": [("en", "de")], "deen": [("de", "en")]}, 100, 50)
    assert router.pick({"model": "ende", "target": "fr"}) == "ende"  # named: its own checks follow
    assert router.pick({"target": "fr"}) == router.pick({"source": "auto", "target": "fr"}) == "multi"
    assert router.pick({"source": "de"}) == "deen"
    with pytest.raises(Refused, match=r"en -> de is served by models multi, ende: name one in the model field"):
        router.pick({"source": "en", "target": "de"})
    with pytest.raises(Refused, match=r"model 'nope': no such model; this server serves multi \(en-de, en-fr\)"):
        router.pick({"model": "nope"})
    with pytest.raises(Refused, match=r"no model translates en -> es; .*, deen \(de-en\)"):
        router.pick({"source": "en", "target": "es"})
    assert Router({"default": [("en", "de")]}, 100, 50).pick({"target": "xx"}) == "default"  # one model: its 400
    assert router.local("GET", "/languages").body == [
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "en", "name": "English", "targets": ["de", "fr"]},
        {"code": "fr", "name": "French", "targets": []},
    ]
    models = router.local("GET", "/v1/models").body["models"]
    assert [(m["name"], m["pairs"]) for m in models][1] == ("ende", [["en", "de"]])
    assert 'maxlength="50"' in router.local("GET", "/").body  # the page counts against max_text_chars
    assert router.local("POST", "/v1/translate") is None and router.local("GET", "/stats") is None
    assert (router.local("GET", "/v1/translate").status, router.local("GET", "/x").status) == (405, 404)


def test_a_missing_checkpoint_or_busy_port_is_one_line(tmp_path, tagged, capsys):
    assert serve_cli.main(["--checkpoint", str(tmp_path / "none")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve_cli.main(["--checkpoint", str(tagged), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot listen there" in err


def test_a_port_a_stopped_server_left_in_time_wait_is_free():
    """Restarting right after a stop: the stopped server's connections hold its port in
    TIME_WAIT, where the new server (SO_REUSEADDR) binds; a listening socket still refuses."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's HTTP server (asyncio)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
        time.sleep(0.05)
        client.close()
        with pytest.raises(ValueError, match="cannot listen there"):
            serve_cli.check_port("127.0.0.1", port)  # still listening
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the check did before: refused
    serve_cli.check_port("127.0.0.1", port)


def test_a_one_pair_model_needs_no_target(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "one-pair", seed=3)
    service = Service(load_engine(str(checkpoint), "raymt"), serve_config(checkpoint))
    status, body, _ = call(service, "POST", "/translate", {"q": "Good morning.", "source": "auto"}, form=True)
    assert status == 200 and body["detectedLanguage"]["language"] == "en"
    capsys.readouterr()
    flags = ["--checkpoint", str(checkpoint), "--beam", "2", "--max-len-a", "0", "--max-len-b", "6"]
    assert translate_cli.main([*flags, "Good morning."]) == 0
    assert body["translatedText"] == capsys.readouterr().out.strip()


@pytest.mark.parametrize("flags, replicas", [(["--replicas", "2"], (2, None)), (["--autoscale", "1:3"], (1, 3))])
def test_print_config_is_a_serve_deploy_file_that_builds_the_app(tagged, flags, replicas, capsys):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from raymt.serve.app import build

    assert serve_cli.main(["--checkpoint", str(tagged), "--beam", "3", *flags, "--print-config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert (app.import_path, app.route_prefix, schema.http_options.port) == ("raymt.serve.app:build", "/", 8000)
    assert app.args["decode"]["beam"] == 3 and app.args["models"] == {"default": str(tagged)}
    deployment = build(app.args)._bound_deployment  # the ingress is the translator: one hop a request
    assert deployment.init_args[1] == {"default": [list(pair) for pair in PAIRS]}  # its routes
    assert deployment.name == "translator" and not any(
        hasattr(arg, "_bound_deployment") for arg in deployment.init_args
    )  # no deployment behind it
    config = deployment._deployment_config
    assert (config.max_queued_requests, config.backpressure_config.retry_after_s) == (512, 1)
    scaling = config.autoscaling_config
    assert (deployment.num_replicas, scaling and scaling.max_replicas) == replicas
    assert deployment.ray_actor_options["num_cpus"] == 1.0


def test_cluster_yaml_has_a_cpu_serving_node_type_reached_only_from_a_load_balancer():
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "cluster.yaml").read_text())
    node = config["available_node_types"]["serve_cpu"]
    assert "GPU" not in node["resources"] and node["min_workers"] == 0 < node["max_workers"]
    rules = [r for r in config["provider"]["security_group"]["IpPermissions"] if r["FromPort"] <= 8000 <= r["ToPort"]]
    assert rules and all(r["UserIdGroupPairs"] and not r.get("IpRanges") and not r.get("Ipv6Ranges") for r in rules)


def test_api_keys_are_checked_against_their_digests(engine, tagged, tmp_path, capsys):
    keys = tmp_path / "keys"
    keys.write_text(f"# the server's keys\n{hashlib.sha256(b'sesame').hexdigest()}  -\n")
    cmd = parse(serve_cli.ServeCommand, ["--checkpoint", str(tagged), "--api-keys", str(keys)], "raymt serve")
    service = Service(
        engine, dataclasses.replace(serve_config(tagged), api_key_hashes=serve_cli.serve_config(cmd).api_key_hashes)
    )
    body = {"q": "Good morning.", "source": "en", "target": "de"}
    assert call(service, "POST", "/translate", body)[:2] == (
        403,
        {"error": "Please provide an API key (api_key or Authorization: Bearer)"},
    )
    assert call(service, "POST", "/translate", body | {"api_key": "open"}, form=True)[:2] == (
        403,
        {"error": "Invalid API key"},
    )
    assert call(service, "POST", "/translate", body | {"api_key": "sesame"}, form=True)[0] == 200
    native = json.dumps({"text": "Hello.", "target": "fr"}).encode()
    reply = asyncio.run(service.handle("POST", "/v1/translate", "application/json", native, "Bearer sesame"))
    assert reply.status == 200 and json.loads(reply.content())["model"] == "default"
    keys.write_text("sesame\n")
    assert serve_cli.main(["--checkpoint", str(tagged), "--api-keys", str(keys)]) == 2
    assert "not SHA-256 hex digests" in capsys.readouterr().err


def test_an_unexpected_error_is_a_json_500_without_the_request_text(engine, tagged):
    service = Service(engine, serve_config(tagged))

    async def broken(fields):
        raise RuntimeError(f"cannot translate {fields['text']}")

    service.native = broken
    status, body, _ = call(service, "POST", "/v1/translate", {"text": "private words", "target": "de"})
    assert status == 500 and "RuntimeError" in body["error"] and "private" not in body["error"]


@pytest.mark.slow
@pytest.mark.ci
def test_the_command_serves_until_sigterm_then_shuts_serve_down(tagged, ray_address, tmp_path):
    """Before the module's server starts (one Serve instance a cluster)."""
    port = free_port()
    command = [sys.executable, "-m", "raymt.serve", "--checkpoint", str(tagged), "--port", str(port),
               "--engine", "raymt", "--cpus-per-replica", "0.25", "--beam", "2", "--max-len-a", "0",
               "--status-every", "1"]  # fmt: skip
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert "Ctrl-C stops it" in proc.stdout.readline()
        status, body, _ = http(f"http://127.0.0.1:{port}/v1/translate", {"text": SENTENCES[0], "target": "fr"})
        assert status == 200 and body["translations"]["source_tokens"] > 0
        assert proc.stdout.readline().startswith("serve: ")  # the status line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    with pytest.raises(urllib.error.URLError):  # Serve's proxy is gone
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)


@pytest.mark.slow
@pytest.mark.ci
def test_a_killed_replica_under_load_costs_at_most_the_requests_it_held(tagged, ray_head, ray_cluster):
    """Two translator replicas under a closed-loop load; one is killed: the requests it held fail
    (one hop: Serve's proxy answers them 500; no front is left to retry them), the other replica
    answers the rest, Serve starts a new one; >= 99% of the requests are answered over a load of
    100 requests a client. Before the module's server starts."""
    from ray import serve

    from raymt.serve.app import APP_NAME, start

    cfg = serve_config(tagged, port=free_port(), replicas=2, request_timeout_s=60.0)
    start(cfg)
    clients = 4
    try:
        title = "ray::ServeReplica:raymt:translator"
        first = ray_head.processes(title)
        assert len(first) == 2, first
        statuses, stop = [], threading.Event()

        def client():
            while not stop.is_set():
                body = {"text": SENTENCES[:2], "target": "de"}
                statuses.append(http(f"http://127.0.0.1:{cfg.port}/v1/translate", body)[0])

        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        time.sleep(3)
        os.kill(first[0], signal.SIGKILL)
        deadline = time.time() + 60
        while len(set(ray_head.processes(title)) - {first[0]}) < 2:  # Serve's new replica
            assert time.time() < deadline, "no new translator replica within 60 s"
            time.sleep(0.5)
        back = time.time()
        while time.time() < back + 2 or (len(statuses) < 100 * clients and time.time() < back + 60):
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join()
        stats = serve.get_app_handle(APP_NAME).stats.remote().result()
    finally:
        serve.shutdown()
    failed = len(statuses) - statuses.count(200)
    print(f"{len(statuses)} requests, {failed} failed ({sorted(set(statuses))})")
    assert failed <= clients and len(statuses) > 20, (statuses, stats)  # at most one in flight a client
    assert statuses.count(200) >= 0.99 * len(statuses), (len(statuses), failed)


@pytest.mark.slow
@pytest.mark.ci
def test_one_model_is_served_in_one_hop(tagged, ray_head, ray_cluster):
    """One model: Serve runs one deployment, the translator, as the application's ingress (no
    front), and no request is forwarded between replicas: the proxy's request is decoded where
    it lands. Before the module's server starts."""
    from ray import serve

    from raymt.serve.app import APP_NAME, start

    cfg = serve_config(tagged, port=free_port())
    start(cfg)
    try:
        app = serve.status().applications[APP_NAME]
        assert list(app.deployments) == ["translator"]
        assert ray_head.processes("ray::ServeReplica:raymt:front") == []
        for target in ("de", "fr"):
            body = {"text": SENTENCES[:2], "target": target}
            assert http(f"http://127.0.0.1:{cfg.port}/v1/translate", body)[0] == 200
        stats = http(f"http://127.0.0.1:{cfg.port}/stats")[1]
    finally:
        serve.shutdown()
    assert (stats["requests"], stats["forwarded"], stats["retried"]) == (2, 0, 0)


# ---------------------------------------------------------------- over HTTP on Ray Serve


@pytest.fixture(scope="module")
def server(tagged, ray_cluster):
    """The tagged model served on the session's Ray head on a free port; its base URL."""
    from ray import serve

    from raymt.serve.app import start

    cfg = serve_config(tagged, port=free_port(), request_timeout_s=60.0)
    t0 = time.time()
    start(cfg)
    print(f"serve started in {time.time() - t0:.1f} s")
    try:
        yield f"http://127.0.0.1:{cfg.port}"
    finally:
        t0 = time.time()
        serve.shutdown()
        print(f"serve stopped in {time.time() - t0:.1f} s")


def http(url: str, body=None, form: bool = False, raw: bytes = None):
    """(status, body as JSON or text, headers) of one real HTTP request."""
    data, headers = raw, {"Content-Type": "application/json"}
    if body is not None:
        data = urllib.parse.urlencode(body, doseq=True).encode() if form else json.dumps(body).encode()
        headers = {"Content-Type": "application/x-www-form-urlencoded"} if form else headers
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, text, got = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as err:
        status, text, got = err.code, err.read().decode(), err.headers
    is_json = got.get("content-type", "").startswith("application/json")
    return status, json.loads(text) if is_json else text, got


@pytest.mark.hosts  # serve vs translate
def test_http_answers_equal_raymt_translate_and_concurrent_requests_share_batches(server, tagged, capsys):
    want_de = cli_translation(tagged, SENTENCES[:4], "de", capsys)
    want_fr = cli_translation(tagged, SENTENCES[4:6], "fr", capsys)
    before = http(f"{server}/stats")[1]
    results = {}

    def send(name, body):
        results[name] = http(f"{server}/v1/translate", body)

    threads = [
        threading.Thread(target=send, args=(f"de{i}", {"text": SENTENCES[:4], "target": "de"})) for i in range(6)
    ]
    threads += [threading.Thread(target=send, args=("fr", {"text": SENTENCES[4:6], "target": "fr"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (status, body, _) in results.items():
        assert status == 200
        texts, lang = (SENTENCES[4:6], "fr") if name == "fr" else (SENTENCES[:4], "de")
        got = [t["text"] for t in body["translations"]]  # another batch than translate's: ties may part
        assert_translations_agree(tagged, texts, lang, got, want_fr if name == "fr" else want_de)
    after = http(f"{server}/stats")[1]
    assert after["requests"] - before["requests"] == 7
    assert after["batches"] - before["batches"] < 7 and after["shared_batches"] > before["shared_batches"]


@pytest.mark.hosts  # serve vs translate
def test_libretranslate_json_and_form_bodies_and_languages(server, tagged, capsys):
    want = cli_translation(tagged, SENTENCES[:2], "de", capsys)
    agree = lambda texts, got, want: assert_translations_agree(tagged, texts, "de", got, want)
    status, body, _ = http(f"{server}/translate", {"q": SENTENCES[0], "source": "en", "target": "de", "format": "text"})
    assert status == 200 and list(body) == ["translatedText"]
    agree(SENTENCES[:1], [body["translatedText"]], want[:1])
    status, body, _ = http(f"{server}/translate", {"q": SENTENCES[:2], "source": "auto", "target": "de"})
    assert status == 200
    agree(SENTENCES[:2], body["translatedText"], want)
    assert body["detectedLanguage"][0]["language"] == "en"
    form = {"q": SENTENCES[0], "source": "en", "target": "de", "api_key": "", "alternatives": "1"}
    status, body, _ = http(f"{server}/translate", form, form=True)
    assert status == 200 and len(body["alternatives"]) == 1
    agree(SENTENCES[:1], [body["translatedText"]], want[:1])
    status, body, _ = http(f"{server}/translate", {"q": "a", "source": "en", "target": "xx"})
    assert status == 400 and "xx is not supported" in body["error"]
    assert http(f"{server}/languages")[1] == [
        {"code": "de", "name": "German", "targets": []},
        {"code": "en", "name": "English", "targets": ["de", "fr"]},
        {"code": "fr", "name": "French", "targets": []},
    ]


def test_health_ready_page_and_http_errors(server):
    assert http(f"{server}/health")[1]["status"] == "ok"
    assert http(f"{server}/ready")[1]["ready"] is True
    status, page, headers = http(f"{server}/")
    assert status == 200 and "<textarea" in page and "http" not in page.split("<body>")[1]
    status, body, _ = http(f"{server}/v1/translate", raw=b"x" * 1_000_001)
    assert (status, body["limit"]) == (413, "max_body_bytes")
    status, body, _ = http(f"{server}/v1/translate", raw=b"{not json")
    assert status == 400 and "not JSON" in body["error"]
    assert http(f"{server}/nowhere")[0] == 404


def load_benchmark(tmp_path: Path, *flags: str) -> dict:
    """benchmarks/serve_load.py's --out JSON after a run with these flags."""
    out = tmp_path / "load.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    command = [sys.executable, str(script), *flags, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    print(done.stdout[-3000:])
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.ci
def test_the_load_benchmark_measures_the_server_a_naive_one_and_the_engine(server, tagged, tmp_path):
    flags = ["--url", server, "--tgt-lang", "de", "--limit", "12", "--sentences", "2", "--closed", "3"]
    flags += ["--requests", "2", "--rates", "20", "--seconds", "0.5", "--naive-port", str(free_port())]
    flags += ["--checkpoint", str(tagged), "--engine", "raymt", "--beam", "2", "--offline", "--repeats", "2"]
    result = load_benchmark(tmp_path, *flags)
    rows = [row for row in result["rows"] if row["round"] == 0]
    assert [row["load"] for row in rows] == ["offline raymt 1 thread(s)", "offline raymt 2 thread(s)"] + [
        "closed 3x2",
        "open 20/s x2",
    ] * 2  # fmt: skip (the naive server: the first rate only)
    for row in rows[2:]:
        assert set(row["statuses"]) == {"200"} and row["sentences_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"]
    assert all("requests_per_batch" in row for row in rows[2:4])  # the server's /stats
    assert [row["server"] for row in rows[2:]] == ["raymt serve"] * 2 + ["naive"] * 2
    assert {r["load"]: r["rounds"] for r in result["medians"]}["closed 3x2"] == 2
    assert any(line.startswith("closed 3x2: raymt serve / naive = ") for line in result["ratios"])
    # CPU seconds per 1,000 sentences by process, for every load: the server's own processes
    # (found from its port), the engine's share inside the translator, the load generator apart
    cpu = [row["cpu_s_per_1k"] for row in rows]
    assert [set(c) for c in cpu[:2]] == [{"offline", "total"}] * 2
    for c in cpu[2:4]:
        assert {"proxy", "translator", "engine", "controller", "gcs", "raylet", "load generator", "total"} <= set(c)
        assert "front" not in c and 0 < c["engine"] <= c["translator"] < c["total"]
        assert c["total"] == pytest.approx(sum(v for k, v in c.items() if k not in ("engine", "total")), abs=0.01)
    assert [set(c) for c in cpu[4:]] == [{"naive server", "load generator", "total"}] * 2
    assert all(c["naive server"] > 0 for c in cpu[4:])
    medians = {r["load"]: r for r in result["medians"] if r["server"] == "raymt serve"}
    assert medians["closed 3x2"]["cpu_s_per_1k"]["engine"] > 0
    assert any("serve's CPU outside the engine" in line for line in result["ratios"])


@pytest.mark.slow
@pytest.mark.ci
def test_the_load_benchmark_kill_round(server, tagged, tmp_path):
    """A round with one kill: the module's one replica SIGKILLed under load, its requests answered
    and the seconds until Serve's new replica and the full rate. The module's last test."""
    flags = ["--url", server, "--tgt-lang", "de", "--limit", "12", "--sentences", "2", "--closed", "2"]
    flags += ["--requests", "1", "--repeats", "1", "--kill-after", "3", "--kill-timeout", "90"]
    result = load_benchmark(tmp_path, *flags)
    kill = next(row for row in result["rows"] if row["load"] == "kill closed 2x2")
    assert kill["s_to_new_replica"] is not None and 0 < kill["s_to_new_replica"] < 90
    assert 0 < kill["answered_pct"] <= 100 and kill["rate_before"] > 0 and kill["cpu_s_per_1k"]["translator"] > 0
    assert kill["s_to_full_rate"] is None or kill["s_to_full_rate"] >= 0
    assert any(line.startswith("kill closed 2x2: ") for line in result["ratios"])
