"""HTTP load on a `raymt serve` (or any server speaking its POST /v1/translate), loopback only.

Closed loop: C clients, each sending requests of K sentences one after another. Open loop:
requests of K sentences at Poisson arrivals of a fixed rate, each latency counted from its
scheduled send time (a slow server cannot slow the arrivals down). Reports sentences/s, target
tokens/s, p50/p99 latency, errors by status and, from the server's GET /stats, the requests and
padded tokens per batch. `--naive-port` first starts a naive server in this process that
translates one request at a time (the engine behind a lock) on the same API; `--offline` first
measures the ceiling, the engine's `translate` on the same sentences with no HTTP.

    raymt serve --checkpoint CK --engine ctranslate2 --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --data PREFIX --tgt-lang de \\
        --closed 16 --sentences 4 --rates 20,40 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raymt.config import DecodeOptions  # noqa: E402


def post(url: str, texts: list[str], target: Optional[str], model: str = "", timeout: float = 120) -> tuple[int, int]:
    """(HTTP status, target tokens) of one POST /v1/translate (to `model` of a server of several)."""
    fields = {"text": texts} | ({"target": target} if target else {}) | ({"model": model} if model else {})
    body = json.dumps(fields).encode()
    request = urllib.request.Request(f"{url}/v1/translate", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
            return response.status, sum(t.get("target_tokens", 0) for t in answer["translations"])
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
    """Latencies, statuses and tokens of the requests of one load, thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.sentences = self.tokens = 0

    def add(self, latency: float, status: int, sentences: int, tokens: int) -> None:
        """One request's outcome."""
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if status == 200:
                self.latencies.append(latency)
                self.sentences += sentences
                self.tokens += tokens

    def report(self, seconds: float, before: Optional[dict], after: Optional[dict]) -> dict:
        """The load's figures (batch occupancy when the server has /stats)."""
        lat = sorted(self.latencies) or [float("nan")]
        out = {
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


def closed_loop(url: str, texts: list[str], clients: int, per_request: int, requests: int, target, model="") -> dict:
    """`clients` threads, each sending `requests` requests of `per_request` sentences in turn."""
    tally, before = Tally(), stats(url)

    def client(c: int) -> None:
        for r in range(requests):
            start = (c * requests + r) * per_request
            batch = [texts[(start + i) % len(texts)] for i in range(per_request)]
            t0 = time.perf_counter()
            status, tokens = post(url, batch, target, model)
            tally.add(time.perf_counter() - t0, status, per_request, tokens)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"load": f"closed {clients}x{per_request}"} | tally.report(time.perf_counter() - t0, before, stats(url))


def open_loop(url: str, texts: list[str], rate: float, seconds: float, per_request: int, target, model="") -> dict:
    """Requests of `per_request` sentences at Poisson arrivals of `rate`/s for `seconds`; each
    latency from its scheduled send time."""
    rng, tally, before = random.Random(0), Tally(), stats(url)
    schedule, at = [], 0.0
    while at < seconds:
        schedule.append(at)
        at += rng.expovariate(rate)
    t0 = time.perf_counter()

    def send(i: int, due: float) -> None:
        time.sleep(max(0.0, t0 + due - time.perf_counter()))
        batch = [texts[(i * per_request + k) % len(texts)] for k in range(per_request)]
        status, tokens = post(url, batch, target, model)
        tally.add(time.perf_counter() - (t0 + due), status, per_request, tokens)

    threads = [threading.Thread(target=send, args=(i, due)) for i, due in enumerate(schedule)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = max(seconds, time.perf_counter() - t0)
    return {"load": f"open {rate:g}/s x{per_request}"} | tally.report(elapsed, before, stats(url))


def naive_server(checkpoint: str, port: int, engine: str, opts: DecodeOptions) -> ThreadingHTTPServer:
    """A server of POST /v1/translate that translates one request at a time, started on a thread."""
    from raymt.engines import load_engine

    model, lock = load_engine(checkpoint, engine, threads=1), threading.Lock()

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
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def offline(
    checkpoint: str, texts: list[str], engine: str, opts: DecodeOptions, target, threads: int, engines: dict
) -> dict:
    """The ceiling: the engine's own `translate` on the sentences, no HTTP (each thread count's
    engine loaded once, kept in `engines`)."""
    from raymt.engines import load_engine

    model = engines.get(threads) or engines.setdefault(threads, load_engine(checkpoint, engine, threads=threads))
    t0 = time.perf_counter()
    hyps = model.translate(texts, opts, target)
    seconds = time.perf_counter() - t0
    tokens = sum(len(model.tokenizer.encode(h[0][1])) for h in hyps)
    return {"load": f"offline {engine} {threads} thread(s)", "sentences_per_s": round(len(texts) / seconds, 2),
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
    p.add_argument("--offline", action="store_true", help="measure the engine without HTTP (needs --checkpoint)")
    p.add_argument("--checkpoint", help="the served model, for --naive-port and --offline")
    p.add_argument("--engine", default="auto", help="engine of --naive-port and --offline")
    p.add_argument("--beam", type=int, default=DecodeOptions().beam, help="as the server's")
    p.add_argument("--out", help="write every row to this JSON file")
    return p.parse_args(argv)


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
    one = next(r for r in offline_rows if r["load"].endswith(" 1 thread(s)"))
    ceiling = one["sentences_per_s"] / args.sentences
    return [0.5] + [round(f * ceiling, 2) for f in (0.5, 0.7, 0.9)]


def one_round(
    args: argparse.Namespace, texts: list[str], opts: DecodeOptions, round_: int, engines: dict
) -> list[dict]:
    """One round of every load: the offline engine (1 and 2 threads), then the server's closed
    and open loops, then the naive server's closed loop and lowest rate."""
    rows = []
    if args.offline:
        rows += [offline(args.checkpoint, texts, args.engine, opts, args.tgt_lang, n, engines) for n in (1, 2)]
    if args.fixed_rates is None:  # the first round's: every round loads at the same rates
        args.fixed_rates = rates_for(args, rows)
    rates = args.fixed_rates
    servers = [("raymt serve", args.url, rates)]
    if args.naive_port:
        servers.append(("naive", f"http://127.0.0.1:{args.naive_port}", rates[:1]))
    for name, url, server_rates in servers:
        for clients in [int(c) for c in args.closed.split(",") if c]:
            load = closed_loop(url, texts, clients, args.sentences, args.requests, args.tgt_lang, args.model)
            rows.append({"server": name} | load)
        for rate in server_rates:
            load = open_loop(url, texts, rate, args.seconds, args.sentences, args.tgt_lang, args.model)
            rows.append({"server": name} | load)
    return [{"round": round_} | row for row in rows]


def medians(rows: list[dict]) -> list[dict]:
    """Each load's median over the rounds (sentences/s, tokens/s, latencies, batch occupancy)."""
    import statistics

    keys = ("sentences_per_s", "target_tokens_per_s", "p50_ms", "p99_ms", "requests_per_batch", "tokens_per_batch")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("server", "offline"), row["load"]), []).append(row)
    out = []
    for (server, load), runs in groups.items():
        med = {k: statistics.median(r[k] for r in runs) for k in keys if all(k in r for r in runs)}
        errors = sum(n for r in runs for code, n in r.get("statuses", {}).items() if code != "200")
        out.append({"server": server, "load": load, "rounds": len(runs), "non_200": errors} | med)
    return out


def verdict(table: list[dict], args: argparse.Namespace) -> list[str]:
    """The issue's targets as ratios of the medians measured side by side."""
    get = {(r["server"], r["load"]): r for r in table}
    closed = f"closed {args.closed.split(',')[0]}x{args.sentences}"
    lines = []
    one = next((r for r in table if r["load"].endswith(" 1 thread(s)")), None)
    serve, naive = get.get(("raymt serve", closed)), get.get(("naive", closed))
    if serve and one:
        lines.append(
            f"{closed}: raymt serve / offline 1 thread = "
            f"{serve['sentences_per_s'] / one['sentences_per_s']:.2f} (target >= 0.8)"
        )
    if serve and naive:
        lines.append(
            f"{closed}: raymt serve / naive = {serve['sentences_per_s'] / naive['sentences_per_s']:.2f} (target >= 2)"
        )
    opens = sorted((r for r in table if r["load"].startswith("open")), key=lambda r: float(r["load"].split()[1][:-2]))
    low = [r for r in opens if r["load"] == opens[0]["load"]] if opens else []
    by = {r["server"]: r for r in low}
    if "raymt serve" in by and "naive" in by:
        delta = by["raymt serve"]["p50_ms"] - by["naive"]["p50_ms"]
        lines.append(f"{opens[0]['load']}: p50 raymt serve - naive = {delta:+.1f} ms (target <= 15)")
    ok = [r for r in opens if r["server"] == "raymt serve" and r["p99_ms"] <= 1000]
    if ok and one:
        best = max(float(r["load"].split()[1][:-2]) for r in ok)
        share = best * args.sentences / one["sentences_per_s"]
        lines.append(
            f"highest rate with p99 <= 1 s: {best:g} requests/s = {share:.2f} of the offline "
            "1-thread rate (target >= 0.7)"
        )
    return lines


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Run the loads --repeats times, interleaved; print each row, the medians and the targets' ratios."""
    args = parse_args(argv)
    texts, opts, rows, engines = read_texts(args), DecodeOptions(beam=args.beam), [], {}
    args.fixed_rates = None
    if args.naive_port:
        naive_server(args.checkpoint, args.naive_port, args.engine, opts)
    for r in range(args.repeats):
        for row in one_round(args, texts, opts, r, engines):
            print(json.dumps(row), flush=True)
            rows.append(row)
    table = medians(rows)
    print(f"\nmedians of {args.repeats} rounds ({len(texts)} sentences, {args.sentences} a request):")
    for row in table:
        print(json.dumps(row))
    lines = verdict(table, args)
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "medians": table, "ratios": lines}, indent=1))
    return rows


if __name__ == "__main__":
    main()
