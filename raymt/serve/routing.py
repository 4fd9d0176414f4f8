"""Which served model answers a request, apart from Ray and torch: `Router` (each replica's
ingress: the page, `/languages` and `/v1/models` from every model's pairs, a translation request's
model by its `model` field or by its language pair) and what the HTTP side shares: `Reply`, `Refused`
(a JSON error naming the limit), `parse_body` (JSON or form-encoded), `language_list`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import parse_qs

from raymt.errors import first_line
from raymt.serve.page import page
from raymt.tags import lang_name

# Answered by a model's Service (a translator replica): LibreTranslate's /detect reads its languages.
TRANSLATE_ROUTES = ("/v1/translate", "/translate", "/detect")
# Answered by a translator replica without a model (its counters, whether it is up).
REPLICA_ROUTES = ("/health", "/ready", "/stats")
# Answered from every model's pairs, by whichever replica the request reaches.
CATALOG_ROUTES = ("/", "/languages", "/v1/models")
Pair = tuple[str, str]


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


def parse_body(content_type: str, body: bytes, max_body_bytes: int) -> dict:
    """A request's fields from a JSON or form-encoded body (a repeated form field is a list)."""
    if len(body) > max_body_bytes:
        raise Refused(413, f"a body of {len(body)} bytes; the limit is {max_body_bytes}", "max_body_bytes")
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


def language_list(pairs: list[Pair]) -> list[dict]:
    """LibreTranslate's /languages: each language with the targets it translates into, sorted."""
    targets: dict[str, set[str]] = {}
    for src, tgt in pairs:
        targets.setdefault(src, set()).add(tgt)
    codes = sorted(set(targets) | {t for ts in targets.values() for t in ts})
    return [{"code": c, "name": lang_name(c), "targets": sorted(targets.get(c, []))} for c in codes]


def given(value: Any) -> Optional[str]:
    """A language field's value, None when absent, empty or `auto`."""
    return None if value in (None, "", "auto") else str(value)


class Router:
    """Every served model's pairs by name, in order, as each replica's ingress sees them."""

    def __init__(self, models: dict[str, list[Pair]], max_body_bytes: int, max_text_chars: int):
        self.models = {name: [tuple(p) for p in pairs] for name, pairs in models.items()}
        self.max_body_bytes = max_body_bytes
        self.page = page(max_text_chars)  # its character count shows the server's limit

    def local(self, method: str, path: str) -> Optional[Reply]:
        """The answer from the models' pairs alone (the page, the languages, the models, an unknown
        route), or None for a request a model (a translation) or the replica (its health) answers."""
        if method == "POST" and path in TRANSLATE_ROUTES or method == "GET" and path in REPLICA_ROUTES:
            return None
        if method == "GET" and path == "/":
            return Reply(200, self.page, media_type="text/html; charset=utf-8")
        if method == "GET" and path == "/languages":
            return Reply(200, language_list([p for pairs in self.models.values() for p in pairs]))
        if method == "GET" and path == "/v1/models":
            return Reply(
                200, {"models": [{"name": n, "pairs": [list(p) for p in ps]} for n, ps in self.models.items()]}
            )
        known = path in TRANSLATE_ROUTES + REPLICA_ROUTES + CATALOG_ROUTES
        return Refused(405 if known else 404, f"{method} {path}: no such route").reply()

    def pick(self, fields: dict) -> str:
        """The model of a translation request: its `model` field, else the one model serving its
        source and target (either may be absent); a 400 naming the choices otherwise."""
        name = fields.get("model")
        if name not in (None, ""):
            if name not in self.models:
                raise Refused(400, f"model {name!r}: no such model; this server serves {self.served()}")
            return str(name)
        if len(self.models) == 1:  # its own checks name the languages it serves
            return next(iter(self.models))
        source, target = given(fields.get("source")), given(fields.get("target"))
        fits = [
            name
            for name, pairs in self.models.items()
            if any(source in (None, src) and target in (None, tgt) for src, tgt in pairs)
        ]
        wanted = f"{source or 'any source'} -> {target or 'any target'}"
        if not fits:
            raise Refused(400, f"no model translates {wanted}; this server serves {self.served()}")
        if len(fits) > 1:
            raise Refused(400, f"{wanted} is served by models {', '.join(fits)}: name one in the model field")
        return fits[0]

    def served(self) -> str:
        """The models and their pairs in words, e.g. `multi (en-de, en-fr), ende (en-de)`."""
        return ", ".join(f"{n} ({', '.join(f'{s}-{t}' for s, t in ps)})" for n, ps in self.models.items())
