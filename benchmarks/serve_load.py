"""HTTP load on a `raymt serve` (or any server speaking its POST /v1/translate), loopback only.

Closed loop: C clients, each sending requests of K sentences one after another. Open loop:
requests of K sentences at Poisson arrivals of a fixed rate, each latency counted from its
scheduled send time (a slow server cannot slow the arrivals down). Reports sentences/s, target
tokens/s, p50/p99 latency, errors by status and, from the server's GET /stats, the requests and
padded tokens per batch; and for every load the CPU seconds per 1,000 sentences of each process
(`cpu_s_per_1k`: Serve's proxy, each deployment's replicas, the engine's own share of the
translator replicas, Serve's controller, the GCS, the raylet, Ray's other processes, the load
generator, the naive server; benchmarks/serve_cpu.py). `--naive-port` first starts a naive
server (a process of its own) that translates one request at a time on the same API; `--offline`
first measures the ceiling, the engine's `translate` on the same sentences with no HTTP;
`--libretranslate-port P` first starts a real LibreTranslate there (from `.venv-libretranslate`:
`./run.sh libretranslate`) serving the same model as an Argos package (`raymt export --format
argos`, int8) and gives it the server's loads through its POST /translate: then every server
searches as argostranslate does (beam --beam, length penalty 0.2, CTranslate2's length limit), a
`raymt serve` started by `--serve` too (one started apart needs `--length-penalty 0.2 --max-len-a 0
--max-len-b 257`). `--kill-after S` adds a round with one kill: C clients load the server, one translator replica
is SIGKILLed after S seconds, and the round reports the requests answered and the seconds until
a new replica is up and the rate is back to 0.9 of the rate before the kill. `--serve FLAGS`
starts `raymt serve` itself (its replicas and threads: `--serve "--replicas 2
--cpus-per-replica 1"`) and stops it at the end.

    raymt serve --checkpoint CK --engine ctranslate2 --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --data PREFIX --tgt-lang de \\
        --closed 16 --sentences 4 --rates 20,40 --seconds 30
    # LibreTranslate as the peer, at equal cores and beam (docs/serving.md, "Measuring")
    python benchmarks/serve_load.py --checkpoint CK --engine ctranslate2 --beam 4 --tgt-lang de \\
        --serve "--cpus-per-replica 2" --libretranslate-port 8002 --libretranslate-ct2 1:2 \\
        --naive-port 8001 --closed 1,4,16 --sentences 4 --rates 0.5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import serve_cpu  # noqa: E402
from raymt import argos  # noqa: E402
from raymt.config import DecodeOptions  # noqa: E402

# The kill round: the rate is back when no 2-second window after the kill is below this share of
# the rate before it; the load goes on at least this long after Serve's new replica is up.
FULL_RATE = 0.9
RATE_WINDOW_S = 2.0
SETTLE_S = 6.0


@dataclass
class Endpoint:
    """Where a load's requests go and in which API: raymt's POST /v1/translate (`target`, and
    `model` of a server of several), or LibreTranslate's POST /translate (`source` given: its
    answers carry no token counts)."""

    url: str
    target: Optional[str]
    model: str = ""
    source: str = ""

    def post(self, texts: list[str], timeout: float = 120) -> tuple[int, int]:
        """(HTTP status, target tokens) of one request of `texts`."""
        if self.source:
            path, fields = "/translate", {"q": texts, "source": self.source, "target": self.target, "format": "text"}
        else:
            path, fields = "/v1/translate", {"text": texts}
            fields |= ({"target": self.target} if self.target else {}) | ({"model": self.model} if self.model else {})
        body = json.dumps(fields).encode()
        request = urllib.request.Request(f"{self.url}{path}", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
                return response.status, sum(t.get("target_tokens", 0) for t in answer.get("translations", []))
        except urllib.error.HTTPError as err:
            return err.code, 0
        except OSError:
            return 0, 0  # refused, reset or timed out


def stats(url: str) -> Optional[dict]:
    """The server's GET /stats, None when it has none."""
    try:
        with urllib.request.urlopen(f"{url}/stats", timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


class Tally:
    """Latencies, statuses, tokens and finish times of the requests of one load, thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.answered: list[float] = []  # perf_counter() when each answered request finished
        self.sentences = self.tokens = 0

    def add(self, latency: float, status: int, sentences: int, tokens: int) -> None:
        """One request's outcome."""
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if status == 200:
                self.latencies.append(latency)
                self.answered.append(time.perf_counter())
                self.sentences += sentences
                self.tokens += tokens

    def report(self, seconds: float, before: Optional[dict], after: Optional[dict]) -> dict:
        """The load's figures (batch occupancy when the server has /stats)."""
        lat = sorted(self.latencies) or [float("nan")]
        out = {
            "sentences": self.sentences,
            "sentences_per_s": round(self.sentences / seconds, 2),
            "target_tokens_per_s": round(self.tokens / seconds, 1),
            "p50_ms": round(1000 * lat[len(lat) // 2], 1),
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
        }
        if before and after and after["batches"] > before["batches"]:
            batches = after["batches"] - before["batches"]
            out["requests_per_batch"] = round((after["requests"] - before["requests"]) / batches, 2)
            out["sentences_per_batch"] = round((after["sentences"] - before["sentences"]) / batches, 2)
            out["tokens_per_batch"] = round((after["batch_tokens"] - before["batch_tokens"]) / batches, 1)
        return out


def closed_loop(to: Endpoint, texts: list[str], clients: int, per_request: int, requests: int) -> dict:
    """`clients` threads, each sending `requests` requests of `per_request` sentences in turn."""
    tally, before = Tally(), stats(to.url)

    def client(c: int) -> None:
        for r in range(requests):
            start = (c * requests + r) * per_request
            batch = [texts[(start + i) % len(texts)] for i in range(per_request)]
            t0 = time.perf_counter()
            status, tokens = to.post(batch)
            tally.add(time.perf_counter() - t0, status, per_request, tokens)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"load": f"closed {clients}x{per_request}"} | tally.report(time.perf_counter() - t0, before, stats(to.url))


def open_loop(to: Endpoint, texts: list[str], rate: float, seconds: float, per_request: int) -> dict:
    """Requests of `per_request` sentences at Poisson arrivals of `rate`/s for `seconds`; each
    latency from its scheduled send time."""
    rng, tally, before = random.Random(0), Tally(), stats(to.url)
    schedule, at = [], 0.0
    while at < seconds:
        schedule.append(at)
        at += rng.expovariate(rate)
    t0 = time.perf_counter()

    def send(i: int, due: float) -> None:
        time.sleep(max(0.0, t0 + due - time.perf_counter()))
        batch = [texts[(i * per_request + k) % len(texts)] for k in range(per_request)]
        status, tokens = to.post(batch)
        tally.add(time.perf_counter() - (t0 + due), status, per_request, tokens)

    threads = [threading.Thread(target=send, args=(i, due)) for i, due in enumerate(schedule)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = max(seconds, time.perf_counter() - t0)
    return {"load": f"open {rate:g}/s x{per_request}"} | tally.report(elapsed, before, stats(to.url))


def replicas_of(port: int) -> set[int]:
    """The pids of the local server's translator replicas."""
    return {pid for pid, name in serve_cpu.server_processes(port).items() if name == "translator"}


def kill_round(args: argparse.Namespace, texts: list[str], clients: int) -> dict:
    """C clients send requests without pause; after --kill-after seconds one translator replica is
    SIGKILLed; the load goes on until Serve's new replica has been up SETTLE_S seconds and the
    rate is back (or --kill-timeout): requests answered, seconds to the new replica and to the
    full rate."""
    load = f"kill closed {clients}x{args.sentences}"
    first = replicas_of(args.port)
    if not first:
        return {"load": load, "error": f"no translator replica of this machine listens on port {args.port}"}
    tally, stop, to = Tally(), threading.Event(), Endpoint(args.url, args.tgt_lang, args.model)

    def client(c: int) -> None:
        i = c
        while not stop.is_set():
            batch = [texts[(i * args.sentences + k) % len(texts)] for k in range(args.sentences)]
            t0 = time.perf_counter()
            status, tokens = to.post(batch)
            tally.add(time.perf_counter() - t0, status, args.sentences, tokens)
            i += clients

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.kill_after)
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    killed, replaced = time.perf_counter(), None
    while (now := time.perf_counter()) < killed + args.kill_timeout:
        if replaced is None and len(replicas_of(args.port) - {victim}) >= len(first):
            replaced = now
        if replaced is not None and now >= replaced + SETTLE_S:
            with tally.lock:
                answered = list(tally.answered)
            if full_rate_back(answered, t0 + 1, killed, now) is not None:
                break
        time.sleep(0.25)
    stopped = time.perf_counter()  # the rate is judged up to here: the clients' last requests end after
    stop.set()
    for t in threads:
        t.join()
    end = time.perf_counter()
    requests = sum(tally.statuses.values())
    row = {"load": load} | tally.report(end - t0, None, None)  # /stats: a new replica's after, not the killed one's
    return row | {
        "answered_pct": round(100 * tally.statuses.get(200, 0) / max(1, requests), 2),
        "rate_before": round(rate_in(tally.answered, t0 + 1, killed) * args.sentences, 2),
        "s_to_new_replica": None if replaced is None else round(replaced - killed, 1),
        "s_to_full_rate": full_rate_back(tally.answered, t0 + 1, killed, stopped),
    }


def rate_in(answered: list[float], start: float, end: float) -> float:
    """Requests answered per second between two perf_counter() times."""
    return sum(start <= t < end for t in answered) / max(1e-9, end - start)


def full_rate_back(answered: list[float], start: float, killed: float, end: float) -> Optional[float]:
    """Seconds from the kill to the end of the last RATE_WINDOW_S window (in 0.5 s steps) whose
    rate is below FULL_RATE of the rate between `start` and the kill; None when the last one is
    (the rate is not back before the round ended)."""
    before = rate_in(answered, start, killed)
    last_slow, at = None, killed
    while at + RATE_WINDOW_S <= end:
        if rate_in(answered, at, at + RATE_WINDOW_S) < FULL_RATE * before:
            last_slow = at + RATE_WINDOW_S
        at += 0.5
    if last_slow is None:
        return 0.0
    return None if last_slow > end - RATE_WINDOW_S else round(last_slow - killed, 1)  # not yet back for a window


def naive_main(checkpoint: str, port: int, engine: str, device: str, opts: DecodeOptions, ready: Any) -> None:
    """A server of POST /v1/translate that translates one request at a time (the naive server's
    process: its CPU apart from the load generator's); sets `ready` once it listens."""
    from raymt.engines import load_engine

    model, lock = load_engine(checkpoint, engine, device, threads=1), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            fields = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                hyps = model.translate(fields["text"], opts, fields.get("target"))
            out = [{"text": h[0][1], "target_tokens": len(model.tokenizer.encode(h[0][1]))} for h in hyps]
            body = json.dumps({"translations": out}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # no line per request
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ready.set()
    server.serve_forever()


def start_naive(args: argparse.Namespace, opts: DecodeOptions) -> multiprocessing.Process:
    """The naive server started in a process of its own on --naive-port (ready when returned)."""
    context = multiprocessing.get_context("spawn")  # no copy of this process's threads
    ready = context.Event()
    naive_args = (args.checkpoint, args.naive_port, args.engine, args.device, opts, ready)
    proc = context.Process(target=naive_main, args=naive_args, daemon=True)
    proc.start()
    if not ready.wait(600):
        proc.kill()
        raise SystemExit("the naive server did not start within 600 s")
    return proc


def start_server(args: argparse.Namespace, opts: DecodeOptions) -> subprocess.Popen:
    """`raymt serve` on --url's port with --checkpoint, --engine, the search `opts` and --serve's
    flags, returned once it serves."""
    search = ["--beam", str(opts.beam), "--length-penalty", str(opts.length_penalty),
              "--max-len-a", str(opts.max_len_a), "--max-len-b", str(opts.max_len_b)]  # fmt: skip
    command = [sys.executable, "-m", "raymt.serve", "--checkpoint", args.checkpoint, "--engine", args.engine,
               *search, "--port", str(args.port), *shlex.split(args.serve)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stdout:
        print(line, end="", file=sys.stderr)
        if "Ctrl-C stops it" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # its status lines
            return proc
    raise SystemExit(f"raymt serve {args.serve} exited ({proc.wait()}) before serving")


def start_libre(args: argparse.Namespace, work: Path) -> subprocess.Popen:
    """LibreTranslate on --libretranslate-port, offline, serving --checkpoint exported as Argos
    packages (int8), its files under `work`: CTranslate2's threads from --libretranslate-ct2, its
    HTTP server's from --libretranslate-threads, its beam --beam; returned once it answers."""
    exe = Path(args.libretranslate_bin) if args.libretranslate_bin else argos.libretranslate_executable(ROOT)
    if exe is None or not exe.exists():
        raise SystemExit(f"no LibreTranslate at {exe or argos.LIBRETRANSLATE_VENV}: ./run.sh libretranslate")
    packages = argos.export_argos(args.checkpoint, work / "argos")
    inter, intra = args.libretranslate_ct2
    env = argos.offline_env(work / "lt", threads=intra) | {"ARGOS_INTER_THREADS": str(inter)}
    env["ARGOS_BEAM_SIZE"] = str(args.beam)
    argos.install(exe.parent / "python", packages, env)
    log = (work / "libretranslate.log").open("w")  # it logs every text it translates (argostranslate's INFO)
    languages = [args.src_lang, args.tgt_lang]
    return argos.start_libretranslate(exe, env, args.libretranslate_port, languages, args.libretranslate_threads, log)


def offline(args: argparse.Namespace, texts: list[str], opts: DecodeOptions, threads: int, engines: dict) -> dict:
    """The ceiling: the engine's own `translate` on the sentences, no HTTP (each thread count's
    engine loaded once, kept in `engines`)."""
    from raymt.engines import load_engine

    model = engines.get(threads) or engines.setdefault(
        threads, load_engine(args.checkpoint, args.engine, args.device, threads=threads)
    )
    t0 = time.perf_counter()
    hyps = model.translate(texts, opts, args.tgt_lang)
    seconds = time.perf_counter() - t0
    tokens = sum(len(model.tokenizer.encode(h[0][1])) for h in hyps)
    return {"load": f"offline {args.engine} {threads} thread(s)", "sentences": len(texts),
            "sentences_per_s": round(len(texts) / seconds, 2),
            "target_tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--data", help="PREFIX: sentences from PREFIX.<src> (default: built-in sentences)")
    p.add_argument("--src-lang", default="en")
    p.add_argument("--tgt-lang", help="target of every request (a tagged model needs one)")
    p.add_argument("--model", default="", help="the model field of every request (a server of several models)")
    p.add_argument("--limit", type=int, default=1000, help="sentences read")
    p.add_argument("--sentences", type=int, default=4, help="sentences a request")
    p.add_argument("--closed", default="16", help="comma-separated client counts (closed loop); '' for none")
    p.add_argument("--requests", type=int, default=8, help="requests per client (closed loop)")
    p.add_argument("--rates", default="", help="comma-separated requests/s (open loop); auto: from the offline rate")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every load, interleaved (medians reported)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each open-loop load")
    p.add_argument(
        "--naive-port", type=int, help="start a naive one-request-at-a-time server there (needs --checkpoint)"
    )
    p.add_argument(
        "--libretranslate-port",
        type=int,
        help="start LibreTranslate there on --checkpoint's Argos export (needs --tgt-lang; ./run.sh libretranslate)",
    )
    p.add_argument("--libretranslate-threads", type=int, default=4, help="its --threads (its HTTP server's)")
    p.add_argument(
        "--libretranslate-ct2",
        default="1:1",
        metavar="INTER:INTRA",
        help="its CTranslate2 workers and threads each (ARGOS_INTER_THREADS, ARGOS_INTRA_THREADS)",
    )
    p.add_argument("--libretranslate-bin", help="its executable (default: .venv-libretranslate/bin/libretranslate)")
    p.add_argument("--offline", action="store_true", help="measure the engine without HTTP (needs --checkpoint)")
    p.add_argument("--offline-threads", default="1,2", help="comma-separated thread counts of --offline")
    p.add_argument("--checkpoint", help="the served model, for --naive-port, --offline and --serve")
    p.add_argument("--engine", default="auto", help="engine of --naive-port, --offline and --serve")
    p.add_argument("--device", default="cpu", help="device of --naive-port and --offline (cpu, cuda)")
    p.add_argument("--beam", type=int, default=DecodeOptions().beam, help="as the server's")
    p.add_argument(
        "--serve",
        metavar="FLAGS",
        help='start `raymt serve` with these flags first, e.g. "--replicas 2 --cpus-per-replica 1"',
    )
    p.add_argument(
        "--kill-after", type=float, help="add a round with one kill: a translator replica SIGKILLed after S s of load"
    )
    p.add_argument("--kill-timeout", type=float, default=120.0, help="seconds the kill round waits for its replica")
    p.add_argument("--out", help="write every row to this JSON file")
    args = p.parse_args(argv)
    if args.kill_after is not None and args.kill_after < 3:
        p.error(f"--kill-after {args.kill_after:g}: at least 3 s (the rate before the kill is measured from 1 s)")
    if (args.offline or args.naive_port or args.serve or args.libretranslate_port) and not args.checkpoint:
        p.error("--offline, --naive-port, --serve and --libretranslate-port need --checkpoint")
    if args.libretranslate_port and not args.tgt_lang:
        p.error("--libretranslate-port needs --tgt-lang (LibreTranslate's requests name their languages)")
    try:
        args.libretranslate_ct2 = tuple(int(n) for n in args.libretranslate_ct2.split(":"))
        assert len(args.libretranslate_ct2) == 2 and min(args.libretranslate_ct2) >= 1
    except (ValueError, AssertionError):
        p.error(f"--libretranslate-ct2 {args.libretranslate_ct2}: give INTER:INTRA, e.g. 1:2")
    args.port = urllib.parse.urlsplit(args.url).port or 80
    return args


def read_texts(args: argparse.Namespace) -> list[str]:
    """The sentences the requests carry."""
    if args.data:
        from raymt.data.text import read_lines, resolve

        return read_lines(resolve(args.data, args.src_lang))[: args.limit]  # PREFIX.en, .en.gz, ...
    from raymt.data.builtin import generate

    return generate(args.limit, args.src_lang, args.tgt_lang or "de", seed=7)[0]


def rates_for(args: argparse.Namespace, offline_rows: list[dict]) -> list[float]:
    """The open-loop rates (requests/s): --rates, or with `auto` a low rate (0.5/s) and 0.5, 0.7
    and 0.9 of the offline one-thread engine's rate (its sentences/s over --sentences)."""
    if args.rates != "auto":
        return [float(r) for r in args.rates.split(",") if r]
    one = next((r for r in offline_rows if r["load"].endswith(" 1 thread(s)")), offline_rows[0])
    ceiling = one["sentences_per_s"] / args.sentences
    return [0.5] + [round(f * ceiling, 2) for f in (0.5, 0.7, 0.9)]


def with_cpu(load: Callable[[], dict], port: Optional[int], extra: dict[int, str]) -> dict:
    """A load's row with the CPU seconds per 1,000 sentences answered of each process: the server
    on `port` (None: no Ray server) and `extra` ({pid: group})."""
    before = serve_cpu.snapshot(port, extra)
    row = load()
    return row | {"cpu_s_per_1k": serve_cpu.per_1k(before, serve_cpu.snapshot(port, extra), row.get("sentences", 0))}


def one_round(args: argparse.Namespace, texts: list[str], opts: DecodeOptions, round_: int, engines: dict) -> list:
    """One round of every load: the offline engine (each --offline-threads), then the server's
    closed and open loops and its kill round, then the naive server's closed loop and lowest rate."""
    me = {os.getpid(): "load generator"}
    rows = []
    if args.offline:
        for n in [int(t) for t in args.offline_threads.split(",") if t]:
            rows.append(with_cpu(partial(offline, args, texts, opts, n, engines), None, {os.getpid(): "offline"}))
    if args.fixed_rates is None:  # the first round's: every round loads at the same rates
        args.fixed_rates = rates_for(args, rows)
    rates = args.fixed_rates
    servers = [("raymt serve", Endpoint(args.url, args.tgt_lang, args.model), rates, args.port, me)]
    if args.libre:
        libre = Endpoint(f"http://127.0.0.1:{args.libretranslate_port}", args.tgt_lang, source=args.src_lang)
        servers.append(("libretranslate", libre, rates, None, me | {args.libre.pid: "libretranslate"}))
    if args.naive_port:
        naive = Endpoint(f"http://127.0.0.1:{args.naive_port}", args.tgt_lang)
        servers.append(("naive", naive, rates[:1], None, me | {args.naive.pid: "naive server"}))
    clients = [int(c) for c in args.closed.split(",") if c]
    for name, to, server_rates, port, extra in servers:
        loads = [partial(closed_loop, to, texts, c, args.sentences, args.requests) for c in clients]
        loads += [partial(open_loop, to, texts, r, args.seconds, args.sentences) for r in server_rates]
        if name == "raymt serve" and args.kill_after is not None:
            loads.append(partial(kill_round, args, texts, clients[0] if clients else 16))
        rows += [{"server": name} | with_cpu(load, port, extra) for load in loads]
    return [{"round": round_} | row for row in rows]


def medians(rows: list[dict]) -> list[dict]:
    """Each load's median over the rounds (sentences/s, tokens/s, latencies, batch occupancy, the
    kill round's figures, and each process's CPU per 1,000 sentences)."""
    keys = ("sentences_per_s", "target_tokens_per_s", "p50_ms", "p99_ms", "requests_per_batch", "tokens_per_batch",
            "answered_pct", "s_to_new_replica", "s_to_full_rate")  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("server", "offline"), row["load"]), []).append(row)
    out = []
    for (server, load), runs in groups.items():
        med = {k: statistics.median(r[k] for r in runs) for k in keys if all(r.get(k) is not None for r in runs)}
        cpus = [r["cpu_s_per_1k"] for r in runs if r.get("cpu_s_per_1k")]
        names = sorted({k for c in cpus for k in c})
        cpu = {k: round(statistics.median(c.get(k, 0.0) for c in cpus), 3) for k in names}
        errors = sum(n for r in runs for code, n in r.get("statuses", {}).items() if code != "200")
        out.append(
            {"server": server, "load": load, "rounds": len(runs), "non_200": errors} | med | {"cpu_s_per_1k": cpu}
        )
    return out


def cpu_line(row: dict) -> str:
    """A load's CPU seconds per 1,000 sentences by process, in words (largest first, the total last)."""
    cpu = dict(row.get("cpu_s_per_1k") or {})
    if not cpu:
        return f"{row['server']}, {row['load']}: no CPU figures (not a server of this machine)"
    total = cpu.pop("total", None)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
    return f"{row['server']}, {row['load']}: CPU s per 1,000 sentences: {parts}; total {total:.2f}"


def verdict(table: list[dict], args: argparse.Namespace) -> list[str]:
    """Issue 60's targets as ratios of the medians measured side by side."""
    get = {(r["server"], r["load"]): r for r in table}
    closed = f"closed {args.closed.split(',')[0]}x{args.sentences}"
    lines = []
    one = next((r for r in table if r["load"].endswith(" 1 thread(s)")), None)
    serve, naive = get.get(("raymt serve", closed)), get.get(("naive", closed))
    if serve and one:
        ratio = serve["sentences_per_s"] / one["sentences_per_s"]
        lines.append(f"{closed}: raymt serve / offline 1 thread = {ratio:.2f} (target >= 0.85)")
    if serve and naive:
        lines.append(
            f"{closed}: raymt serve / naive = {serve['sentences_per_s'] / naive['sentences_per_s']:.2f} "
            "(target >= 1.0 with CTranslate2, >= 2 with raymt's engine)"
        )
    cpu = (serve or {}).get("cpu_s_per_1k") or {}
    if cpu.get("engine"):
        outside = cpu["total"] - cpu["engine"] - cpu.get("load generator", 0.0)
        lines.append(
            f"{closed}: serve's CPU outside the engine / the engine's = {outside:.2f} / {cpu['engine']:.2f} = "
            f"{outside / cpu['engine']:.2f} (target <= 0.5)"
        )
    opens = sorted((r for r in table if r["load"].startswith("open")), key=lambda r: float(r["load"].split()[1][:-2]))
    low = [r for r in opens if r["load"] == opens[0]["load"]] if opens else []
    by = {r["server"]: r for r in low}
    if "raymt serve" in by and "naive" in by:
        delta = by["raymt serve"]["p50_ms"] - by["naive"]["p50_ms"]
        lines.append(f"{opens[0]['load']}: p50 raymt serve - naive = {delta:+.1f} ms (target <= 10)")
    ok = [r for r in opens if r["server"] == "raymt serve" and r["p99_ms"] <= 1000]
    if ok and one:
        best = max(float(r["load"].split()[1][:-2]) for r in ok)
        share = best * args.sentences / one["sentences_per_s"]
        lines.append(
            f"highest rate with p99 <= 1 s: {best:g} requests/s = {share:.2f} of the offline "
            "1-thread rate (target >= 0.7)"
        )
    lines += against_libretranslate(table, args)
    for r in table:
        if r["load"].startswith("kill") and "answered_pct" in r:
            lines.append(
                f"{r['load']}: {r['answered_pct']:g}% answered (target >= 99), full rate back after "
                f"{r.get('s_to_full_rate', 'never')} s (target <= 60), "
                f"a new replica after {r.get('s_to_new_replica')} s"
            )
    return lines


def against_libretranslate(table: list[dict], args: argparse.Namespace) -> list[str]:
    """Issue 69's targets: raymt serve's throughput at the most clients over LibreTranslate's, and
    both p50s at the fewest clients and at the lowest rate; both CPU totals per 1,000 sentences."""
    serve = {r["load"]: r for r in table if r["server"] == "raymt serve"}
    libre = {r["load"]: r for r in table if r["server"] == "libretranslate"}
    both = [load for load in serve if load in libre]
    closed = sorted((load for load in both if load.startswith("closed")), key=lambda x: int(x.split()[1].split("x")[0]))
    opens = sorted((load for load in both if load.startswith("open")), key=lambda x: float(x.split()[1][:-2]))
    lines = []
    if closed:
        most, fewest = serve[closed[-1]], libre[closed[-1]]
        ratio = most["sentences_per_s"] / fewest["sentences_per_s"]
        lines.append(f"{closed[-1]}: raymt serve / LibreTranslate = {ratio:.2f} sentences/s (target >= 1.5)")
    for load in closed[:1] + opens[:1]:
        a, b = serve[load]["p50_ms"], libre[load]["p50_ms"]
        lines.append(f"{load}: p50 raymt serve {a:.1f} ms, LibreTranslate {b:.1f} ms (target: no worse)")
    for load in closed:
        cpu = [(serve if i == 0 else libre)[load].get("cpu_s_per_1k", {}).get("total") for i in range(2)]
        if None not in cpu:
            lines.append(f"{load}: CPU s per 1,000 sentences, raymt serve {cpu[0]:.2f}, LibreTranslate {cpu[1]:.2f}")
    return lines


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Run the loads --repeats times, interleaved; print each row, the medians, each load's CPU by
    process and the targets' ratios."""
    args = parse_args(argv)
    texts, opts, rows, engines = read_texts(args), DecodeOptions(beam=args.beam), [], {}
    if args.libretranslate_port:  # every server searches as LibreTranslate does
        opts = replace(argos.SEARCH, beam=args.beam)
    args.fixed_rates = None
    work = tempfile.TemporaryDirectory(prefix="serve_load_")
    server = args.naive = args.libre = None
    try:
        server = start_server(args, opts) if args.serve else None
        args.naive = start_naive(args, opts) if args.naive_port else None
        args.libre = start_libre(args, Path(work.name)) if args.libretranslate_port else None
        for r in range(args.repeats):
            for row in one_round(args, texts, opts, r, engines):
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        if args.naive:
            args.naive.kill()
        if args.libre:
            args.libre.terminate()
            args.libre.wait(60)
        if server:
            server.send_signal(signal.SIGTERM)
            server.wait(120)
        work.cleanup()
    table = medians(rows)
    print(f"\nmedians of {args.repeats} rounds ({len(texts)} sentences, {args.sentences} a request):")
    for row in table:
        print(json.dumps(row))
    print("\n" + "\n".join(cpu_line(row) for row in table))
    lines = verdict(table, args)
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "medians": table, "ratios": lines}, indent=1))
    return rows


if __name__ == "__main__":
    main()
