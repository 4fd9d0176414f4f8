"""One replica's batching across requests (`Batcher`): every request's encoded sentences wait in
one queue; whenever the engine is free, one loop takes everything queued with the same search
options (every target language of a tagged model together, each source carrying its tag), up to
`max_batch_tokens` padded source tokens, and decodes it in one `Engine.translate_ids` call on a
thread of its own, so that requests keep arriving meanwhile.

Ray Serve's `@serve.batch` closes a batch `batch_wait_timeout_s` after its first item even while
the previous batch still runs, which left its batches near one request under load
(benchmarks/NOTES.md, "raymt serve: batching across requests"); this loop takes what waited.
A full queue refuses new work (`QueueFull`), a request past its deadline drops its unstarted
sentences (`asyncio.TimeoutError`). Nothing here imports Ray.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from raymt.config import DecodeOptions
from raymt.engines import Engine, Translation


class QueueFull(Exception):
    """The replica's queue holds `max_queue_sentences` already: answer 503, retry later."""


@dataclass
class Item:
    """One sentence waiting: its encoded source, its batch cost, its search and its result."""

    source: list[int]
    cost: int
    search: tuple  # (DecodeOptions, n_best): only sentences of one search share a batch
    request: int
    future: asyncio.Future


@dataclass
class Stats:
    """What a replica has done: batches, sentences, requests sharing batches, refusals."""

    requests: int = 0
    sentences: int = 0
    batches: int = 0
    batch_tokens: int = 0  # padded source tokens of every batch, summed
    max_batch_sentences: int = 0
    max_batch_requests: int = 0
    shared_batches: int = 0  # batches holding sentences of more than one request
    multi_target_batches: int = 0  # batches holding more than one target tag
    rejected: int = 0
    timed_out: int = 0
    busy_s: float = 0.0
    started: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        """The counters as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def merged(cls, many: Sequence["Stats"]) -> "Stats":
        """The counters of several models (one replica's): summed, the largest batch the largest."""
        out = cls(started=min((s.started for s in many), default=time.time()))
        for name in asdict(out):
            if name != "started":
                values = [getattr(s, name) for s in many]
                setattr(out, name, max(values, default=0) if name.startswith("max_") else sum(values))
        return out


# The decoding thread's name, also its OS name (/proc/PID/task/TID/comm), which the threads it
# starts (CTranslate2's workers, OpenMP's) inherit: benchmarks/serve_load.py counts the engine's
# CPU by it.
DECODING_THREAD = "raymt-decode"


def name_os_thread(name: str = DECODING_THREAD) -> None:
    """Give the calling thread `name` as its OS name too (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        PR_SET_NAME = 15
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def decoding_thread() -> Executor:
    """One thread that runs engine batches one after another (and loads the engines)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=DECODING_THREAD, initializer=name_os_thread)


def padded(costs: Sequence[int]) -> int:
    """A batch's padded size: sentences x the longest."""
    return len(costs) * max(costs, default=0)


class Batcher:
    """One replica's queue of sentences and the loop that decodes them in token-budget batches on
    `thread` (one of its own when None; the models of one replica share one)."""

    def __init__(
        self, engine: Engine, max_batch_tokens: int, max_queue_sentences: int, thread: Optional[Executor] = None
    ):
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_sentences = max_queue_sentences
        self.pending: list[Item] = []
        self.stats = Stats()
        self.wake: Optional[asyncio.Event] = None
        self.task: Optional[asyncio.Task] = None
        self.thread = thread or decoding_thread()
        self.next_request = 0

    def start(self) -> None:
        """Start the loop on the running event loop (again if an earlier event loop has ended)."""
        if self.task is None or self.task.done() or self.task.get_loop() is not asyncio.get_running_loop():
            self.wake = asyncio.Event()
            self.task = asyncio.get_running_loop().create_task(self.run())

    async def translate(
        self, sources: Sequence[list[int]], opts: DecodeOptions, n_best: int, timeout_s: float
    ) -> list[list[Translation]]:
        """The n_best (score, text) of each encoded source, decoded with whatever else is queued;
        QueueFull when the queue has no room, asyncio.TimeoutError past `timeout_s`."""
        self.start()
        if len(self.pending) + len(sources) > self.max_queue_sentences:
            self.stats.rejected += 1
            raise QueueFull(f"{len(self.pending)} sentences queued (max_queue_sentences {self.max_queue_sentences})")
        loop = asyncio.get_running_loop()
        self.next_request += 1
        items = [
            Item(list(s), self.engine.length(s), (opts, n_best), self.next_request, loop.create_future())
            for s in sources
        ]
        self.pending.extend(items)
        self.stats.requests += 1
        self.wake.set()
        try:
            return list(await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), timeout_s))
        except asyncio.TimeoutError:
            self.stats.timed_out += 1
            self.pending = [i for i in self.pending if i.request != items[0].request]  # unstarted work
            raise

    def take(self) -> list[Item]:
        """The next batch: queued sentences of the first one's search, in order, while the padded
        size stays within max_batch_tokens (the first always goes); the rest keep their places."""
        self.pending = [i for i in self.pending if not i.future.done()]  # gathers cancelled on timeout
        if not self.pending:
            return []
        search = self.pending[0].search
        batch: list[Item] = []
        rest: list[Item] = []
        for item in self.pending:
            fits = padded([i.cost for i in batch] + [item.cost]) <= self.max_batch_tokens
            if item.search == search and (not batch or fits):
                batch.append(item)
            else:
                rest.append(item)
        self.pending = rest
        return batch

    async def run(self) -> None:
        """Forever: wait for work, decode the next batch on the decoding thread, hand out results."""
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            self.wake.clear()
            while batch := self.take():
                opts, n_best = batch[0].search
                started = time.perf_counter()
                try:
                    results = await loop.run_in_executor(
                        self.thread, self.engine.translate_ids, [i.source for i in batch], opts, n_best
                    )
                except Exception as err:  # one bad batch fails its requests, not the replica
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(err)
                    continue
                self.count(batch, time.perf_counter() - started)
                for item, hyps in zip(batch, results):
                    if not item.future.done():
                        item.future.set_result(hyps)

    def count(self, batch: list[Item], seconds: float) -> None:
        """Add one decoded batch to the stats."""
        s = self.stats
        requests = len({i.request for i in batch})
        s.batches += 1
        s.sentences += len(batch)
        s.batch_tokens += padded([i.cost for i in batch])
        s.max_batch_sentences = max(s.max_batch_sentences, len(batch))
        s.max_batch_requests = max(s.max_batch_requests, requests)
        s.shared_batches += requests > 1
        s.multi_target_batches += len({i.source[0] for i in batch}) > 1 and bool(self.engine.info.languages)
        s.busy_s += seconds
