"""A job over an input's line ids cut into shards, done by a pool of Ray actors, restartable.

What `raymt backtranslate` (raymt.backtranslate) and `raymt data score` (raymt.data.score_job)
share: shard k (line ids [k*S, (k+1)*S)) becomes `part-<first line id>.parquet`, written whole
(a temporary name renamed, or one object PUT) by the actor that did it, its counts in the
Parquet schema's metadata; a rerun finds the files there, verifies them (row counts) and redoes
the rest (`find_done`). The driver hands each shard to do to an `ActorPool` of actors that each
expose `run_shard(shard, block) -> record` and `ready()`; a dead actor's shards go to a live one
at once. Ray is imported inside functions only.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from raymt import storage

SHARD_PREFIX = "part-"
# Shards given to an actor at a time: the next one is there when it finishes one.
QUEUE_PER_ACTOR = 2
# For tests of kills and restarts only: seconds each actor sleeps per shard (slows a run down).
DELAY_ENV = "RAYMT_BT_TEST_DELAY_S"


def add_actor_flags(p: Any, what: str, progress_s: float) -> None:
    """The flags of a shard job's actors and progress, shared by `raymt backtranslate` and `raymt data
    score` (`what`: the actors' work, e.g. "decoding")."""
    from raymt.cluster import CPU_ACTORS

    p.add_argument("--num-actors", type=int, help=f"{what} actors; default {CPU_ACTORS}, with --gpu one per GPU")
    p.add_argument("--gpu", action="store_true", help="one GPU per actor")
    p.add_argument("--cpus-per-actor", type=float, help="CPUs per actor (default: the cluster's, split)")
    p.add_argument("--num-cpus", type=int, help="CPUs of a local Ray instance (not with RAY_ADDRESS)")
    p.add_argument("--progress-s", type=float, default=progress_s, help="seconds between progress lines")
    p.add_argument("--verbose", action="store_true", help="also print Ray's own INFO lines")


def shard_name(first_line_id: int) -> str:
    """`part-000000010000.parquet`: names sort in line-id order."""
    return f"{SHARD_PREFIX}{first_line_id:012d}.parquet"


def actor_delay_s() -> float:
    """Seconds an actor sleeps per shard (DELAY_ENV; 0 outside tests)."""
    return float(os.environ.get(DELAY_ENV, "0") or 0)


def write_shard(location: str, data: bytes) -> None:
    """Write a shard file whole: locally under a temporary name of this writer's own, then renamed
    (a retried task and a first try that is still running never mix); an object in one PUT."""
    if storage.is_uri(location):
        storage.write_bytes(location, data)
        return
    path = Path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")  # find_done removes leftovers
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def shard_counts(location: str, expected_rows: int, meta_key: bytes, needed: str) -> Optional[dict]:
    """A finished shard's counts (its schema's `meta_key` entry, holding `needed`), or None when it
    is missing, unreadable or has another row count."""
    fs, path = storage.filesystem(location)
    try:
        with fs.open_input_file(path) as fh:
            meta = pq.ParquetFile(fh).metadata
            counts = json.loads((meta.metadata or {}).get(meta_key, b"{}"))
    except (OSError, pa.ArrowException, json.JSONDecodeError):
        return None
    if meta.num_rows != expected_rows or not isinstance(counts, dict) or needed not in counts:
        return None
    return counts


def find_done(
    output: str, num_shards: int, shard_lines: int, num_lines: int, meta_key: bytes, needed: str
) -> tuple[dict[int, dict], list[int]]:
    """The shard files already in `output`, verified (row counts): (shard -> counts, shards to do);
    broken ones are to do, temporary files a killed writer left are removed."""
    names = set(storage.listdir(output))
    if not storage.is_uri(output):
        for name in names:  # left by a driver killed while writing
            if name.startswith(SHARD_PREFIX) and name.endswith(".tmp"):
                os.remove(os.path.join(output, name))
    done: dict[int, dict] = {}
    todo: list[int] = []
    for shard in range(num_shards):
        name = shard_name(shard * shard_lines)
        rows = min(shard_lines, num_lines - shard * shard_lines)
        counts = shard_counts(storage.join(output, name), rows, meta_key, needed) if name in names else None
        if counts is None:
            todo.append(shard)
        else:
            done[shard] = counts
    return done, todo


# ---------------------------------------------------------------- the actors


class Progress(Protocol):
    """What the pool reports to: each finished shard's record, and a chance to print a line."""

    def add(self, record: dict) -> None:
        """Take one finished shard's record."""

    def show(self, final: bool = False) -> None:
        """Print a progress line when it is time."""


def start_actors(actor_class: type, num_actors: int, plan: Any, kwargs: dict) -> list:
    """`num_actors` actors of `actor_class` (each `plan.cpus`/`plan.gpus`, raymt.cluster's
    `actor_plan`), restarted by Ray if one dies (its shards go to the live ones: `ActorPool`);
    spread over the cluster's machines."""
    import ray

    actor = ray.remote(actor_class).options(
        num_cpus=plan.cpus,
        num_gpus=plan.gpus,
        max_restarts=-1,
        max_task_retries=0,  # a dead actor's shards fail at once and go to a live actor (ActorPool)
        scheduling_strategy="SPREAD",
    )
    return [actor.remote(**kwargs) for _ in range(num_actors)]


class ActorPool:
    """The actors and the shards handed to each, at most QUEUE_PER_ACTOR per actor at a time, so
    memory stays flat in the input's size. A shard of an actor that died goes to a live actor at
    once rather than waiting for Ray to restart it (a model's load: ~40 s); the restarted actor
    takes shards again once it answers."""

    def __init__(self, actors: list, progress: Progress, progress_s: float):
        self.actors, self.progress, self.progress_s = actors, progress, progress_s
        self.queued = [0] * len(actors)
        self.tasks: dict[Any, tuple[int, int, pa.Table]] = {}  # a shard's record (ObjectRef) -> actor, shard, block
        self.restarting: dict[Any, int] = {}  # a dead actor's `ready` call (ObjectRef) -> its index
        self.orphans: list[tuple[int, pa.Table]] = []  # dead actors' shards, for the next live slot

    def full(self) -> bool:
        """True while every live actor has QUEUE_PER_ACTOR shards (or none is live)."""
        return len(self.tasks) >= QUEUE_PER_ACTOR * (len(self.actors) - len(self.restarting))

    def put(self, shard: int, block: pa.Table) -> None:
        """Hand a shard to the live actor with the fewest queued, once one has room."""
        while self.full():
            self.collect()
        down = set(self.restarting.values())
        i = min((j for j in range(len(self.actors)) if j not in down), key=lambda j: self.queued[j])
        self.tasks[self.actors[i].run_shard.remote(shard, block)] = (i, shard, block)
        self.queued[i] += 1

    def drain(self) -> None:
        """Wait until every shard handed out is done (a dead actor's by a live one)."""
        while self.tasks or self.orphans:
            self.collect()

    def collect(self) -> None:
        """Take the shards finished within progress_s, and the restarted actors."""
        import ray
        from ray.exceptions import RayActorError

        ready, _ = ray.wait([*self.tasks, *self.restarting], num_returns=1, timeout=self.progress_s)
        for ref in ready:
            if ref in self.restarting:
                i = self.restarting.pop(ref)
                try:
                    ray.get(ref)
                except RayActorError:  # died again while restarting: wait for the next restart
                    self.restarting[self.actors[i].ready.remote()] = i
                continue
            i, shard, block = self.tasks.pop(ref)
            self.queued[i] -= 1
            try:
                self.progress.add(ray.get(ref))
            except RayActorError:  # the actor died (Ray restarts it): its shards go elsewhere
                if i not in self.restarting.values():
                    self.restarting[self.actors[i].ready.remote()] = i
                self.orphans.append((shard, block))
        while self.orphans and not self.full():
            self.put(*self.orphans.pop(0))
        self.progress.show()

    def close(self) -> None:
        """Kill the actors at once: a failed run's actors must not hold the cluster's CPUs."""
        import ray

        for actor in self.actors:
            ray.kill(actor)


def run_shards(actors: list, shards: Iterable[tuple[int, pa.Table]], progress: Progress, progress_s: float) -> None:
    """Hand each (shard, block) read here to the actors, whose `run_shard` writes its file; wait
    for all, then kill the actors."""
    pool = ActorPool(actors, progress, progress_s)
    try:
        for shard, block in shards:
            pool.put(shard, block)
        pool.drain()
    finally:
        pool.close()
