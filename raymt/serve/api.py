"""The HTTP API of one served model, apart from Ray and the web framework: `Service.handle(method,
path, content type, body)` gives a `Reply` to native `POST /v1/translate` and LibreTranslate's
`POST /translate` (JSON or form-encoded), `Service.respond` to one already parsed; `replica_reply`
answers a replica's `GET /health`, `/ready` and `/stats` (`raymt.serve.routing` the page,
`/languages` and which model answers).
Every error is JSON, `{"error": message}` (the LibreTranslate shape), with `"limit"` naming the
server limit a request went over. Request text is never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Optional

from raymt import langid
from raymt.config import ServeConfig
from raymt.config.serve import DEFAULT_MODEL
from raymt.engines import Engine
from raymt.serve.batcher import Batcher, QueueFull
from raymt.serve.routing import TRANSLATE_ROUTES, Refused, Reply, parse_body
from raymt.serve.text import layout

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request's work: texts, languages and search."""

    texts: list[str]
    source: Optional[str]
    target: Optional[str]
    beam: int
    alternatives: int


class Service:
    """One served model behind the API: parses and checks requests, translates through its Batcher
    (`thread`: the decoding thread, shared by the models of one replica)."""

    def __init__(self, engine: Engine, cfg: ServeConfig, name: str = DEFAULT_MODEL, thread: Optional[Executor] = None):
        self.engine, self.cfg, self.info, self.name = engine, cfg, engine.info, name
        self.batcher = Batcher(engine, cfg.max_batch_tokens, cfg.max_queue_sentences, thread)

    async def handle(self, method: str, path: str, content_type: str, body: bytes, authorization: str = "") -> Reply:
        """The reply to one translation request (`authorization`: its Authorization header)."""
        try:
            if method != "POST" or path not in TRANSLATE_ROUTES:
                raise Refused(404, f"{method} {path}: no such route")
            fields = parse_body(content_type, body, self.cfg.max_body_bytes)
        except Refused as refused:
            return refused.reply()
        return await self.respond(path, fields, authorization)

    async def respond(self, path: str, fields: dict, authorization: str = "") -> Reply:
        """The reply to a translation request already parsed (a POST to one of TRANSLATE_ROUTES)."""
        try:
            self.check_key(fields.get("api_key") or authorization.removeprefix("Bearer ").strip())
            if path == "/detect":
                return self.detect(fields)
            return await (self.native if path == "/v1/translate" else self.libre)(fields)
        except Refused as refused:
            return refused.reply()
        except Exception as err:  # a JSON 500 naming the error's type only: its text may quote the request
            log.error("POST %s failed: %s", path, type(err).__name__)
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
        translations = out if isinstance(text, list) else out[0]
        return Reply(200, {"translations": translations, "target": target, "model": self.name})

    async def libre(self, fields: dict) -> Reply:
        """LibreTranslate's POST /translate: q, source, target, format, alternatives, api_key."""
        if fields.get("format", "text") not in ("text", None, ""):
            raise Refused(400, f"format {fields['format']!r} is not supported; use format=text")
        q = fields.get("q")
        source = fields.get("source")
        detected = None
        if source == "auto":  # the language ID of /detect, over every text of the request, among the model's sources
            detected = self.candidates(" ".join(self.texts(q)))[0]
            source = detected["language"]
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

    def texts(self, text: Any) -> list[str]:
        """A request's text (q) as a list, within the server's limits."""
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
        return texts

    def detect(self, fields: dict) -> Reply:
        """LibreTranslate's POST /detect: q (a text, or a list: a list of answers) -> [{"confidence": 0-100,
        "language"}], the languages this model translates from, most likely first."""
        q = fields.get("q")
        answers = [self.candidates(t) for t in self.texts(q)]
        return Reply(200, answers if isinstance(q, list) else answers[0])

    def candidates(self, text: str) -> list[dict]:
        """The model's source languages by language ID (raymt.langid) of `text`, most likely first."""
        ranked = langid.rank(text, sorted({src for src, _ in self.info.pairs}))
        return [{"confidence": round(100 * p, 1), "language": code} for code, p in ranked]

    def job(self, text: Any, source: Any, target: Any, beam: Any, alternatives: Any) -> Job:
        """A checked request: texts within the limits, known languages, beam and alternatives."""
        cfg = self.cfg
        texts = self.texts(text)
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
        prefix = len(info.prefix(job.target, job.source))
        limit = info.config.model.max_positions - 2 - prefix  # room for the tags and EOS
        tokenizer = info.tokenizer
        layouts = [layout(t, lambda s: len(tokenizer.encode(s)), limit) for t in job.texts]
        segments = [s for lay in layouts for s in lay.segments]
        sources = self.engine.encode(segments, job.target, job.source)  # an NLLB's source code too
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
                    "target_tokens": sum(len(self.info.tokenizer.encode(b, "tgt")) for b in best),
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


def replica_reply(path: str, summary: dict, models: list[str]) -> Reply:
    """A replica's GET /health, /ready or /stats: its counters (`summary`, its models' summed), the
    models it has loaded."""
    if path == "/health":
        return Reply(200, {"status": "ok", "stats": summary})
    if path == "/ready":
        return Reply(200, {"ready": True, "models": models})
    if path == "/stats":
        return Reply(200, summary)
    return Refused(404, f"GET {path}: no such route").reply()
