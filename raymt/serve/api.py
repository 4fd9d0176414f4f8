"""The HTTP API of `raymt serve`, apart from Ray and the web framework: `Service.handle(method,
path, content type, body)` gives a `Reply`. Routes: native `POST /v1/translate`,
LibreTranslate's `POST /translate` (JSON or form-encoded) and `GET /languages`, `GET /health`,
`GET /ready`, `GET /stats` and the page at `/`. Every error is JSON, `{"error": message}` (the
LibreTranslate shape), with `"limit"` naming the server limit a request went over. Request text
is never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional
from urllib.parse import parse_qs

from raymt.config import ServeConfig
from raymt.engines import Engine
from raymt.errors import first_line
from raymt.serve.batcher import Batcher, QueueFull
from raymt.serve.page import PAGE
from raymt.serve.text import layout

log = logging.getLogger(__name__)
LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "es": "Spanish"}


@dataclass
class Reply:
    """An HTTP answer: status, body and extra headers."""

    status: int
    body: Any  # JSON-ready, or str for the page
    headers: dict = field(default_factory=dict)
    media_type: str = "application/json"

    def content(self) -> bytes:
        """The body as bytes."""
        if isinstance(self.body, str):
            return self.body.encode()
        return json.dumps(self.body, ensure_ascii=False).encode()


class Refused(Exception):
    """A request the server will not do: its status, message and the limit it went over."""

    def __init__(self, status: int, message: str, limit: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.limit, self.headers = status, limit, headers or {}

    def reply(self) -> Reply:
        """The JSON error reply."""
        body = {"error": str(self)} | ({"limit": self.limit} if self.limit else {})
        return Reply(self.status, body, self.headers)


@dataclass
class Job:
    """One request's work: texts, languages and search."""

    texts: list[str]
    source: Optional[str]
    target: Optional[str]
    beam: int
    alternatives: int


class Service:
    """A replica's model behind the API: parses and checks requests, translates through its Batcher."""

    def __init__(self, engine: Engine, cfg: ServeConfig):
        self.engine, self.cfg, self.info = engine, cfg, engine.info
        self.batcher = Batcher(engine, cfg.max_batch_tokens, cfg.max_queue_sentences)
        self.loaded = time.time()

    async def handle(self, method: str, path: str, content_type: str, body: bytes, authorization: str = "") -> Reply:
        """The reply to one HTTP request (`authorization`: its Authorization header)."""
        routes = {
            ("GET", "/"): lambda: Reply(200, PAGE, media_type="text/html; charset=utf-8"),
            ("GET", "/health"): lambda: Reply(200, {"status": "ok", "stats": self.batcher.stats.as_dict()}),
            ("GET", "/ready"): lambda: Reply(200, {"ready": True, "model": self.info.location}),
            ("GET", "/stats"): lambda: Reply(200, self.batcher.stats.as_dict()),
            ("GET", "/languages"): lambda: Reply(200, self.languages()),
        }
        try:
            if (method, path) in routes:
                return routes[(method, path)]()
            if method == "POST" and path in ("/v1/translate", "/translate"):
                fields = parse_body(content_type, body, self.cfg)
                self.check_key(fields.get("api_key") or authorization.removeprefix("Bearer ").strip())
                return await (self.native if path == "/v1/translate" else self.libre)(fields)
            known = {p for _, p in routes} | {"/v1/translate", "/translate"}
            raise Refused(405 if path in known else 404, f"{method} {path}: no such route")
        except Refused as refused:
            return refused.reply()
        except Exception as err:  # a JSON 500 naming the error's type only: its text may quote the request
            log.error("%s %s failed: %s", method, path, type(err).__name__)
            return Reply(500, {"error": f"internal error ({type(err).__name__}); see the server's log"})

    def check_key(self, key: Any) -> None:
        """A 403 unless the key's SHA-256 is one of the server's (when it has any); every stored
        digest is compared, each in constant time."""
        if not self.cfg.api_key_hashes:
            return
        digest = hashlib.sha256(str(key or "").encode()).hexdigest()
        found = False
        for stored in self.cfg.api_key_hashes:
            found |= hmac.compare_digest(digest, stored)
        if not key or not found:
            raise Refused(
                403, "Invalid API key" if key else "Please provide an API key (api_key or Authorization: Bearer)"
            )

    def languages(self) -> list[dict]:
        """LibreTranslate's /languages: each source language with the targets it translates into."""
        targets: dict[str, list[str]] = {}
        for src, tgt in self.info.pairs:
            targets.setdefault(src, []).append(tgt)
        codes = sorted(set(targets) | {t for ts in targets.values() for t in ts})
        return [{"code": c, "name": LANGUAGE_NAMES.get(c, c), "targets": sorted(targets.get(c, []))} for c in codes]

    async def native(self, fields: dict) -> Reply:
        """POST /v1/translate: {"text": str or [str], "source", "target", "beam", "alternatives"}."""
        text = fields.get("text")
        job = self.job(text, fields.get("source"), fields.get("target"), fields.get("beam"), fields.get("alternatives"))
        results = await self.run(job)
        out = [
            {"text": r["text"], "alternatives": r["alternatives"], "source_tokens": r["source_tokens"],
             "target_tokens": r["target_tokens"]}
            for r in results
        ]  # fmt: skip
        target = job.target or self.info.target_langs[0]
        return Reply(200, {"translations": out if isinstance(text, list) else out[0], "target": target})

    async def libre(self, fields: dict) -> Reply:
        """LibreTranslate's POST /translate: q, source, target, format, alternatives, api_key."""
        if fields.get("format", "text") not in ("text", None, ""):
            raise Refused(400, f"format {fields['format']!r} is not supported; use format=text")
        q = fields.get("q")
        source = fields.get("source")
        detected = None
        if source == "auto":
            sources = sorted({src for src, _ in self.info.pairs})
            if len(sources) != 1:
                raise Refused(400, f"source auto: this model reads {', '.join(sources)}; name one")
            source, detected = sources[0], {"confidence": 100.0, "language": sources[0]}
        job = self.job(q, source, fields.get("target"), None, fields.get("alternatives"))
        results = await self.run(job)

        def one(r: dict) -> dict:
            return (
                {"translatedText": r["text"]}
                | ({"alternatives": r["alternatives"]} if job.alternatives else {})
                | ({"detectedLanguage": detected} if detected else {})
            )

        if isinstance(q, list):
            items = [one(r) for r in results]
            merged = {k: [item[k] for item in items] for k in items[0]} if items else {"translatedText": []}
            return Reply(200, merged)
        return Reply(200, one(results[0]))

    def job(self, text: Any, source: Any, target: Any, beam: Any, alternatives: Any) -> Job:
        """A checked request: texts within the limits, known languages, beam and alternatives."""
        cfg = self.cfg
        if text is None:
            raise Refused(400, "Invalid request: missing text (q) parameter")
        texts = text if isinstance(text, list) else [text]
        if not all(isinstance(t, str) for t in texts):
            raise Refused(400, "Invalid request: every text must be a string")
        if len(texts) > cfg.max_texts:
            raise Refused(413, f"{len(texts)} texts in one request; the limit is {cfg.max_texts}", "max_texts")
        longest = max((len(t) for t in texts), default=0)
        if longest > cfg.max_text_chars:
            raise Refused(413, f"a text of {longest} characters; the limit is {cfg.max_text_chars}", "max_text_chars")
        sources = {src for src, _ in self.info.pairs}
        if source not in (None, "") and source not in sources:
            raise Refused(400, f"{source} is not supported as a source language; use {', '.join(sorted(sources))}")
        targets = self.info.target_langs
        if target in (None, "") and (self.info.languages or len(targets) != 1):
            raise Refused(400, f"Invalid request: missing target parameter; one of {', '.join(targets)}")
        if target not in (None, "") and target not in targets:
            raise Refused(400, f"{target} is not supported as a target language; use {', '.join(targets)}")
        alts = integer(alternatives, "alternatives", 0)
        if not 0 <= alts <= cfg.max_alternatives:
            raise Refused(400, f"alternatives {alts}: the limit is {cfg.max_alternatives}", "max_alternatives")
        beam_size = max(integer(beam, "beam", cfg.decode.beam), alts + 1)
        if not 1 <= beam_size <= cfg.max_beam:
            raise Refused(400, f"beam {beam_size}: it must be between 1 and {cfg.max_beam}", "max_beam")
        return Job(texts, source or None, target or None, beam_size, alts)

    async def run(self, job: Job) -> list[dict]:
        """Each text translated (its sentences batched with other requests'), in order."""
        info, cfg = self.info, self.cfg
        prefix = len(info.prefix(job.target))
        limit = info.config.model.max_positions - 2 - prefix  # room for the tag and EOS
        tokenizer = info.tokenizer
        layouts = [layout(t, lambda s: len(tokenizer.encode(s)), limit) for t in job.texts]
        segments = [s for lay in layouts for s in lay.segments]
        sources = self.engine.encode(segments, job.target)
        opts = replace(cfg.decode, beam=job.beam)
        try:
            hyps = await self.batcher.translate(sources, opts, job.alternatives + 1, cfg.request_timeout_s)
        except QueueFull as full:
            raise Refused(503, f"the server is busy: {full}", "max_queue_sentences", retry(cfg)) from None
        except asyncio.TimeoutError:
            raise Refused(504, f"no answer within {cfg.request_timeout_s:g} s", "request_timeout_s") from None
        return self.assemble(layouts, sources, hyps, job.alternatives, prefix)

    def assemble(self, layouts: list, sources: list, hyps: list, alternatives: int, prefix: int) -> list[dict]:
        """Per text: its translation, its alternatives and its token counts (EOS and tags excluded)."""
        out, start = [], 0
        for lay in layouts:
            mine = hyps[start : start + len(lay.segments)]
            srcs = sources[start : start + len(lay.segments)]
            start += len(lay.segments)
            best = [h[0][1] for h in mine]
            alts = [lay.join([h[min(k, len(h) - 1)][1] for h in mine]) for k in range(1, alternatives + 1)]
            out.append(
                {
                    "text": lay.join(best),
                    "alternatives": alts,
                    "source_tokens": sum(len(s) - 1 - prefix for s in srcs),
                    "target_tokens": sum(len(self.info.tokenizer.encode(b)) for b in best),
                }
            )
        return out


def retry(cfg: ServeConfig) -> dict:
    """The Retry-After header of a 503."""
    return {"Retry-After": str(cfg.retry_after_s)}


def integer(value: Any, name: str, default: int) -> int:
    """An integer request field (JSON number or form string), else a 400."""
    if value in (None, ""):
        return default
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise Refused(400, f"Invalid request: {name} must be an integer, not {value!r}") from None


def parse_body(content_type: str, body: bytes, cfg: ServeConfig) -> dict:
    """A request's fields from a JSON or form-encoded body (a repeated form field is a list)."""
    if len(body) > cfg.max_body_bytes:
        raise Refused(413, f"a body of {len(body)} bytes; the limit is {cfg.max_body_bytes}", "max_body_bytes")
    kind = content_type.split(";")[0].strip().lower()
    try:
        if kind == "application/x-www-form-urlencoded":
            form = parse_qs(body.decode("utf-8"), keep_blank_values=True)
            return {k: v[0] if len(v) == 1 else v for k, v in form.items()}
        fields = json.loads(body or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        what = "form-encoded" if kind == "application/x-www-form-urlencoded" else "JSON"
        raise Refused(400, f"Invalid request: the body is not {what} ({first_line(err)})") from None
    if not isinstance(fields, dict):
        raise Refused(400, "Invalid request: the body must be a JSON object")
    return fields
