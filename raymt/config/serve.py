"""The options of `raymt serve` (`ServeConfig`): its models, where it listens, its replicas, token
batches, decoding defaults and the limits of one request, validated in `__post_init__`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from raymt.command import flag, group
from raymt.config.sections import DecodeOptions
from raymt.errors import check

SERVE_ENGINES = ("auto", "raymt", "ctranslate2")
# The name of the one model of `--checkpoint CKPT` (the same as `--model default=CKPT`).
DEFAULT_MODEL = "default"
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def model_pairs(flags: list[str]) -> dict[str, str]:
    """The served models by name of the repeated `--model NAME=CKPT` flags; one-line errors for a
    bad form or a name given twice."""
    out: dict[str, str] = {}
    for given in flags:
        name, sep, path = given.partition("=")
        check(bool(sep and name and path), f"--model {given}: give NAME=CKPT, e.g. --model en-de=runs/en-de/best")
        check(name not in out, f"--model {name}=... is given twice: one checkpoint a name")
        out[name] = path
    return out


@dataclass
class ServeConfig:
    """The served models (name -> checkpoint), engine, replicas, batching, defaults and limits;
    each field with a flag is one of `raymt serve`'s (`raymt.command`)."""

    # Every served model by name, in order; `--checkpoint CKPT` is {DEFAULT_MODEL: CKPT}.
    models: dict[str, str] = flag(
        default_factory=dict,
        help="serve several models (repeat it): a request picks one by its model field or by its language pair",
        name="--model",
        metavar="NAME=CKPT",
        repeat=True,
        parse=model_pairs,
        render=lambda models: [f"{name}={path}" for name, path in models.items()],
    )
    engine: str = flag("auto", f"decoding engine: {', '.join(SERVE_ENGINES)}")
    device: str = flag("cpu", "cpu, cuda or cuda:N")
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(8000)
    replicas: int = flag(1, "Serve replicas, one engine each")
    cpus_per_replica: float = flag(1.0, "also its threads")
    # Models one replica holds at once (Serve multiplexing, least recently used out); 0: all.
    models_per_replica: int = flag(0, "models a replica holds at once; 0: all")
    # "MIN:MAX" replicas, scaled by Serve on the requests each holds (instead of `replicas`).
    autoscale: str = flag("", "replicas scaled by Serve (not --replicas)", metavar="MIN:MAX")
    # Ongoing requests per replica Serve's autoscaler aims at: about one token batch's worth.
    target_ongoing_requests: int = flag(32, "--autoscale's aim a replica")
    # One engine batch holds at most this many padded source tokens (sentences x longest).
    max_batch_tokens: int = flag(2048, "padded source tokens a batch")
    # Sentences waiting in one replica's queue; beyond it a request gets 503 with Retry-After.
    max_queue_sentences: int = flag(4096, "beyond: 503")
    # Requests Serve queues before a replica (`max_queued_requests`); beyond it Serve answers 503.
    max_queued_requests: int = flag(512, "Serve's; beyond: 503")
    # A request not answered within this many seconds gets 504 and its unstarted work is dropped.
    request_timeout_s: float = flag(30.0, "seconds; beyond: 504", name="--request-timeout")
    max_body_bytes: int = flag(1_000_000)
    max_text_chars: int = flag(20_000, "characters in one text")
    max_texts: int = flag(128, "texts in one request")
    max_beam: int = flag(8, "the largest beam a request may ask for")
    max_alternatives: int = flag(3)
    retry_after_s: int = 1
    # SHA-256 hex digests of the API keys a translation request must carry; none: no key needed
    # (`raymt serve --api-keys FILE` reads them).
    api_key_hashes: list[str] = field(default_factory=list)
    # Searches only (raymt translate's flags but the sampling ones).
    decode: DecodeOptions = group(DecodeOptions, skip=("sample", "temperature", "top_k", "seed"))

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
