"""The options of `raymt serve` (`ServeConfig`): its models, where it listens, its replicas, token
batches, decoding defaults and the limits of one request, validated in `__post_init__`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from raymt.config.sections import DecodeOptions
from raymt.errors import check

SERVE_ENGINES = ("auto", "raymt", "ctranslate2")
# The name of the one model of `--checkpoint CKPT` (the same as `--model default=CKPT`).
DEFAULT_MODEL = "default"
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass
class ServeConfig:
    """The served models (name -> checkpoint), engine, replicas, batching, defaults and limits."""

    # Every served model by name, in order; `--checkpoint CKPT` is {DEFAULT_MODEL: CKPT}.
    models: dict[str, str] = field(default_factory=dict)
    engine: str = "auto"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    cpus_per_replica: float = 1.0
    # Models one replica holds at once (Serve multiplexing, least recently used out); 0: all.
    models_per_replica: int = 0
    # "MIN:MAX" replicas, scaled by Serve on the requests each holds (instead of `replicas`).
    autoscale: str = ""
    # Ongoing requests per replica Serve's autoscaler aims at: about one token batch's worth.
    target_ongoing_requests: int = 32
    # One engine batch holds at most this many padded source tokens (sentences x longest).
    max_batch_tokens: int = 2048
    # Sentences waiting in one replica's queue; beyond it a request gets 503 with Retry-After.
    max_queue_sentences: int = 4096
    # Requests Serve queues before a replica (`max_queued_requests`); beyond it Serve answers 503.
    max_queued_requests: int = 512
    # A request not answered within this many seconds gets 504 and its unstarted work is dropped.
    request_timeout_s: float = 30.0
    max_body_bytes: int = 1_000_000
    max_text_chars: int = 20_000  # one text of a request
    max_texts: int = 128  # texts in one request
    max_beam: int = 8
    max_alternatives: int = 3
    retry_after_s: int = 1
    # SHA-256 hex digests of the API keys a translation request must carry; none: no key needed.
    api_key_hashes: list[str] = field(default_factory=list)
    decode: DecodeOptions = field(default_factory=DecodeOptions)

    def __post_init__(self) -> None:
        check(
            bool(self.models) and all(self.models.values()),
            "--checkpoint CKPT or --model NAME=CKPT is required: a raymt checkpoint or export directory, or its URI",
        )
        bad = [name for name in self.models if not MODEL_NAME.fullmatch(name)]
        check(not bad, f"--model {bad[0] if bad else ''}=...: a name is letters, digits, '.', '_' or '-' (64 at most)")
        check(self.models_per_replica >= 0, f"--models-per-replica {self.models_per_replica} must be >= 0 (0: all)")
        check(
            self.engine in SERVE_ENGINES,
            f"--engine {self.engine}: no such engine; pick one of {', '.join(SERVE_ENGINES)}",
        )
        check(0 < self.port < 65536, f"--port {self.port} must be between 1 and 65535")
        check(self.replicas >= 1, f"--replicas {self.replicas} must be >= 1")
        self.autoscale_range()  # checks the MIN:MAX form
        check(not self.autoscale or self.replicas == 1, "--replicas and --autoscale: give one of them")
        check(
            self.target_ongoing_requests >= 1, f"--target-ongoing-requests {self.target_ongoing_requests} must be >= 1"
        )
        check(self.cpus_per_replica >= 0, f"--cpus-per-replica {self.cpus_per_replica:g} must be >= 0")
        check(self.max_batch_tokens >= 16, f"--max-batch-tokens {self.max_batch_tokens} must be >= 16")
        check(self.max_queue_sentences >= 1, f"--max-queue-sentences {self.max_queue_sentences} must be >= 1")
        check(self.max_queued_requests >= 1, f"--max-queued-requests {self.max_queued_requests} must be >= 1")
        check(self.request_timeout_s > 0, f"--request-timeout {self.request_timeout_s:g} must be > 0 seconds")
        for name in ("max_body_bytes", "max_text_chars", "max_texts", "max_beam", "max_alternatives"):
            value = getattr(self, name)
            check(value >= 1, f"--{name.replace('_', '-')} {value} must be >= 1")
        check(
            self.decode.beam <= self.max_beam,
            f"--beam {self.decode.beam} is above --max-beam {self.max_beam}: lower it or raise --max-beam",
        )
        bad = [h for h in self.api_key_hashes if not re.fullmatch(r"[0-9a-f]{64}", h)]
        check(not bad, f"--api-keys: {len(bad)} line(s) are not SHA-256 hex digests (sha256sum of a key)")
        check(not self.decode.sample, "raymt serve searches (beam or greedy): sampling is not served")

    def models_held(self) -> int:
        """How many models one replica holds at once."""
        return min(self.models_per_replica or len(self.models), len(self.models))

    def autoscale_range(self) -> Optional[tuple[int, int]]:
        """(MIN, MAX) replicas of --autoscale, None without it; a one-line error for a bad one."""
        if not self.autoscale:
            return None
        low, sep, high = self.autoscale.partition(":")
        ok = sep and low.isdigit() and high.isdigit() and 0 <= int(low) <= int(high) and int(high) >= 1
        check(bool(ok), f"--autoscale {self.autoscale}: give MIN:MAX replicas, 0 <= MIN <= MAX, MAX >= 1 (e.g. 1:4)")
        return int(low), int(high)
