"""A job over an input's line ids cut into shards, done by a pool of Ray actors, restartable:
the one driver of `raymt backtranslate` (raymt.backtranslate) and `raymt data score`
(raymt.data.score_job).

Shard k (line ids [k*S, (k+1)*S)) becomes `part-<first line id>.parquet`, written whole (a
temporary name renamed, or one object PUT) by the actor that did it (`ShardActor`), its counts
in the Parquet schema's metadata; a rerun finds the files there, verifies them (row counts) and
redoes the rest (`find_done`). `run_job` drives a command's job (a `ShardJob`: its record,
reader, actors and lines): check before Ray, record the settings (`SettingsRecord`: a rerun
with other settings is refused), hand each shard to do to an `ActorPool` of actors that each
expose `run_shard(shard, block) -> record` and `ready()` (a dead actor's shards go to a live one
at once), a progress line (`Progress`), and a one-line error (`Unfinished`) when shards are missing.
Ray is imported inside functions only.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, Optional, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymt import storage
from raymt.cluster import actor_plan, check_ray_address, default_actors, init_ray
from raymt.config import ShardJobOptions
from raymt.errors import cli_error, user_error

SHARD_PREFIX = "part-"
# Shards given to an actor at a time: the next one is there when it finishes one.
QUEUE_PER_ACTOR = 2
# For tests of kills and restarts only: seconds each actor sleeps per shard (slows a run down).
DELAY_ENV = "RAYMT_BT_TEST_DELAY_S"
T = TypeVar("T")


class Unfinished(RuntimeError):
    """Shards a run left undone: the same command finishes the job (exit status 1)."""


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


def shard_bytes(table: pa.Table, meta_key: bytes, counts: dict) -> bytes:
    """A shard's Parquet file: `table` with its counts in the schema's metadata (`shard_counts` reads them)."""
    buf = io.BytesIO()
    pq.write_table(table.replace_schema_metadata({meta_key: json.dumps(counts)}), buf)
    return buf.getvalue()


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


# ---------------------------------------------------------------- the settings record


@dataclass(frozen=True)
class SettingsRecord:
    """A job directory's JSON record of the settings that fix its outputs (bt.json, score.json, distill.json):
    the first run writes it, a rerun with other settings is refused naming the flags that differ;
    a directory without it that holds what a job writes is another's."""

    file: str  # its name in the job's directory
    what: str  # the job in messages: "a back-translation"
    flags: dict[str, str] = field(default_factory=dict)  # setting -> the flag(s) that set it (default: its name)
    rerun_free: tuple[str, ...] = ()  # settings a rerun may change: not compared
    format: Optional[str] = None  # the record's "format" entry, checked when given
    marks: Optional[str] = SHARD_PREFIX  # names that make a directory without the record a job's ("": any)
    upgrade: Optional[Callable[[dict], dict]] = None  # an older record's settings as today's names them

    def settings(self, values: dict) -> dict:
        """The settings to record and compare: `values` without the rerun-free ones."""
        return {k: v for k, v in values.items() if k not in self.rerun_free}

    def read(self, output: str) -> Optional[dict]:
        """The record in `output` (None for a new job); one-line errors for a file, another job's
        directory or a record that is not this job's."""
        kind = storage.file_type(output)
        if kind == pafs.FileType.File:
            raise ValueError(f"--output {output} is a file: pass a directory (or a URI prefix)")
        raw = storage.optional_bytes(storage.join(output, self.file))
        if raw is None:
            if kind == pafs.FileType.Directory and self.marks is not None:
                taken = sorted(n for n in storage.listdir(output) if n.startswith(self.marks))
                if taken:
                    raise ValueError(
                        f"--output {output} is not {self.what} (no {self.file}) and holds {taken[0]}: "
                        "pass a new --output"
                    )
            return None
        try:
            record = json.loads(raw)
            assert isinstance(record, dict) and record.get("format") == self.format
        except (json.JSONDecodeError, UnicodeDecodeError, AssertionError):
            raise ValueError(f"--output {output}: its {self.file} is not the record of {self.what}") from None
        return self.upgrade(record) if self.upgrade else record

    def check(self, output: str, values: dict) -> Optional[dict]:
        """The record of `output`'s previous run (None for a new job), refused in one line when its
        settings are not `values`' (`read`'s errors too)."""
        record = self.read(output)
        if record is None:
            return None
        now = self.settings(values)
        differ = [k for k in now if record.get(k) != now[k]]
        if differ:
            names = ", ".join(dict.fromkeys(self.flags.get(k, k) for k in differ))
            raise ValueError(
                f"--output {output} holds {self.what} with other settings ({names}): rerun it with the same "
                "flags to finish it, or pass a new --output"
            )
        return record

    def write(self, output: str, record: dict) -> None:
        """Write the record (whole: a file renamed into place, or one object PUT)."""
        record = {"format": self.format, **record} if self.format else record
        storage.write_bytes(storage.join(output, self.file), json.dumps(record, indent=2).encode())


# ---------------------------------------------------------------- the job


@dataclass(kw_only=True)
class ShardJob(ABC):
    """A job checked before Ray starts: its output, line count and which shards are done (shard ->
    counts) or to do; a command's job (raymt.bt_job.Job, raymt.data.score_job.ScoreJob) adds its
    model, input and settings, and its part of the run: record, reader, actors' keywords, lines."""

    name: ClassVar[str]  # the progress lines' first word: "backtranslate"
    unit: ClassVar[str]  # what the input's lines are: "lines", "pairs"
    rate_unit: ClassVar[str]  # the speed's unit: "sentences/s"
    output: str
    langs: tuple[str, str]  # (source, target): of the input and the output, or of the corpus's pairs
    num_lines: int = 0
    done: dict[int, dict] = field(default_factory=dict)
    todo: list[int] = field(default_factory=list)

    @property
    def src_lang(self) -> str:
        """The source language."""
        return self.langs[0]

    @property
    def tgt_lang(self) -> str:
        """The target language."""
        return self.langs[1]

    @property
    @abstractmethod
    def options(self) -> ShardJobOptions:
        """Sharding, batching, actors and progress (the command's flags)."""

    @abstractmethod
    def record(self, done: bool = False) -> dict:
        """Write the job's record (its settings, counts and whether it is complete); the record."""

    @abstractmethod
    def shard_inputs(self) -> Iterator[tuple[int, pa.Table]]:
        """The shards to do in order, each one table read in this process (one at a time)."""

    @abstractmethod
    def actor_kwargs(self) -> dict:
        """The keywords of the command's actor (a `ShardActor`) beside the driver's."""

    @abstractmethod
    def summary(self, seconds: float, progress: Progress) -> str:
        """The last line: counts, time and where the output is."""

    def note(self) -> str:
        """What the first progress line adds after the shards to do."""
        return ""

    def finish(self, progress: Progress) -> None:
        """After every shard is done, before the record says so (nothing unless the command has more)."""
        return None

    @property
    def num_shards(self) -> int:
        """Output shards of the whole input."""
        return -(-self.num_lines // self.options.shard_lines)

    def shard_rows(self, shard: int) -> int:
        """Lines of shard `shard` (the last one may be short)."""
        return min(self.options.shard_lines, self.num_lines - shard * self.options.shard_lines)

    def shard_location(self, shard: int) -> str:
        """Where shard `shard`'s file goes."""
        return storage.join(self.output, shard_name(shard * self.options.shard_lines))

    def find_done(self, meta_key: bytes, needed: str) -> None:
        """Verify the shard files already written (row counts); the rest, and broken ones, are to do."""
        self.done, self.todo = find_done(
            self.output, self.num_shards, self.options.shard_lines, self.num_lines, meta_key, needed
        )

    def totals(self, keys: Iterable[str]) -> dict[str, int]:
        """The done shards' counts summed."""
        return {k: sum(int(c.get(k, 0)) for c in self.done.values()) for k in keys}


J = TypeVar("J", bound=ShardJob)


class Progress:
    """The driver's record of a run: each finished shard's counts (its file written by its actor,
    or here from the bytes an actor sent), and a progress line every --progress-s seconds."""

    def __init__(self, job: ShardJob):
        self.job = job
        self.lines = 0  # lines done in this run
        self.started = self.ended = self.printed = time.time()
        self.last_line = ""

    def add(self, record: dict) -> None:
        """Take one finished shard's record (shard, lines, counts and maybe the file's bytes)."""
        shard = record["shard"]
        if "data" in record:
            write_shard(self.job.shard_location(shard), record["data"])
        self.job.done[shard] = record["counts"]
        self.lines += record["lines"]
        self.ended = time.time()

    def show(self, final: bool = False) -> None:
        """A progress line every --progress-s seconds: lines, shards, speed and ETA."""
        now = time.time()
        if not final and now - self.printed < self.job.options.progress_s:
            return
        self.printed = now
        job, rate = self.job, self.lines / max(now - self.started, 1e-9)
        done_lines = sum(job.shard_rows(s) for s in job.done)
        left = job.num_lines - done_lines
        eta = f"ETA {_clock(left / rate)}" if rate > 0 and left > 0 else ("done" if left <= 0 else "ETA ?")
        line = (
            f"{job.name}: {done_lines:,}/{job.num_lines:,} {job.unit} ({100 * done_lines / job.num_lines:.1f}%), "
            f"{len(job.done)}/{job.num_shards} shards, {rate:,.1f} {job.rate_unit}, {eta}"
        )
        if line != self.last_line:
            print(line, flush=True)
        self.last_line = line

    def rate(self) -> str:
        """ ", N sentences/s" of this run's work (Ray's start aside), or "" when it did none."""
        seconds = max(self.ended - self.started, 1e-9)
        return f", {self.lines / seconds:,.1f} {self.job.rate_unit}" if self.lines else ""


def _clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# ---------------------------------------------------------------- the actors


class ShardActor:
    """A shard job's actor: loads its model(s) once (a subclass's __init__), then does whole shards
    (`shard_file`) and writes each one's file, or sends its bytes back when its machine cannot
    write to --output (a local directory of the driver's machine)."""

    def __init__(self, output: str, shard_lines: int, driver_node: str, delay_s: float = 0.0):
        import ray

        self.output, self.shard_lines, self.delay_s = output, shard_lines, delay_s
        self.writes = storage.is_uri(output) or ray.get_runtime_context().get_node_id() == driver_node

    def ready(self) -> bool:
        """True once the actor is up (the driver's sign that a restarted actor takes shards again)."""
        return True

    def shard_file(self, block: pa.Table) -> tuple[bytes, dict]:
        """A shard's file and its counts: the command's work."""
        raise NotImplementedError

    def run_shard(self, shard: int, block: pa.Table) -> dict:
        """Do a whole shard and write its file; a small record back (shard, lines, counts), with the
        file's bytes only when this machine cannot write to --output."""
        data, counts = self.shard_file(block)
        if self.delay_s:
            time.sleep(self.delay_s)
        record: dict[str, Any] = {"shard": shard, "lines": block.num_rows, "counts": counts}
        if self.writes:
            write_shard(storage.join(self.output, shard_name(shard * self.shard_lines)), data)
        else:
            record["data"] = data
        return record


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


# ---------------------------------------------------------------- the driver


def run_actors(job: ShardJob, actor: type, progress: Progress) -> None:
    """Start the job's actors (no more than shards to do) and hand them the shards to do, read here."""
    import ray

    opts = job.options
    num_actors = min(opts.num_actors or default_actors(opts.gpu), len(job.todo))
    # No Ray Data here (the driver reads the input): the actors may take every CPU.
    plan = actor_plan(num_actors, opts.gpu, opts.cpus_per_actor, keep_cpus=0)  # one line if they do not fit
    kwargs = {
        **job.actor_kwargs(),
        "device": "cuda" if opts.gpu else "cpu",
        "num_threads": plan.num_threads,
        "output": job.output,
        "shard_lines": opts.shard_lines,
        "driver_node": ray.get_runtime_context().get_node_id(),
        "delay_s": actor_delay_s(),
    }
    actors = start_actors(actor, num_actors, plan, kwargs)
    progress.started = progress.printed = time.time()  # the rate counts the work, not Ray's start
    run_shards(actors, job.shard_inputs(), progress, opts.progress_s)


def run_job(check: Callable[[], J], actor: type) -> tuple[J, Progress]:
    """A shard job from start to end: checked before Ray (`check`, before anything is written to
    --output), its record written, the shards to do handed to Ray actors of class `actor` (a
    `ShardActor`), then finished and recorded complete; the job and this run's progress. Raises a
    one-line ValueError for a user error (a reader's inside Ray's wrapping too) and `Unfinished`
    when shards are left to do."""
    t0 = time.time()
    check_ray_address()
    job = check()
    job.record()
    progress = Progress(job)
    if job.todo:
        print(
            f"{job.name}: {job.num_lines:,} {job.unit} in {job.num_shards} shards, {len(job.todo)} to do{job.note()}",
            flush=True,
        )
        started = init_ray(job.options.num_cpus, verbose=job.options.verbose)
        try:
            run_actors(job, actor, progress)
        except Exception as err:
            user = err if isinstance(err, ValueError) else user_error(err)  # a reader's one line inside Ray's
            if user is None:
                raise
            raise user from None
        finally:
            if started:
                import ray

                ray.shutdown()
        progress.show(final=True)
    missing = [s for s in range(job.num_shards) if s not in job.done]
    if missing:
        raise Unfinished(f"shards {missing[:5]} are incomplete: run the same command again")
    job.finish(progress)
    job.record(done=True)
    print(job.summary(time.time() - t0, progress))
    return job, progress


def exit_status(prog: str, run: Callable[[T], Any], cfg: Callable[[], T]) -> int:
    """A shard job command's `main` after its flags: `run(cfg())`; a user error is one line and
    status 2, shards left to do status 1."""
    try:
        run(cfg())
    except ValueError as err:
        return cli_error(prog, " ".join(str(err).split("\n")))  # one line, whatever the source
    except Unfinished as err:
        return cli_error(prog, err, 1)
    return 0
