"""`raymt data score`: every pair of a parallel corpus scored by dual conditional cross-entropy
(raymt.data.scores) under a forward (src->tgt) and a backward (tgt->src) raymt model, on Ray
actors, restartably.

As `raymt backtranslate` runs (`raymt.shard_job`): the corpus's line ids are cut into shards of
`--shard-lines`; the driver reads the corpus (as `raymt data prepare` reads a --train SPEC) one
shard at a time and hands each to a pool of actors that load both models once, score the shard in
length-sorted token-budget batches (`raymt.decoding.token_log_probs`, each model with its own
tokenizer) and write its file whole; a dead actor's shards go to a live one, and a rerun of the
same command verifies the files there and scores the rest, every line in exactly one row. An
empty or invalid line gets a NaN score and is counted. `score.json` names the models, languages,
corpus (a fingerprint of its files) and line count; a rerun with other settings is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymt import shard_job, storage
from raymt.cluster import actor_plan, check_ray_address, default_actors, init_ray
from raymt.config import PrepareConfig, ScoreConfig
from raymt.data import scores
from raymt.data.sources import ROW_READERS, Source, source_from_spec, task_spec
from raymt.errors import cli_error, user_error

if TYPE_CHECKING:  # torch only where a model is loaded: `raymt data prepare` imports this module's parser
    from raymt.engines import Engine, ModelInfo

PROG = "raymt.data score"
# The process title of a scoring actor (tests find actors by it).
ACTOR_TITLE = "ray::ScoreActor"
SETTING_FLAGS = {
    "forward": "--forward",
    "backward": "--backward",
    "src_lang": "--src",
    "tgt_lang": "--tgt",
    "corpus": "--corpus",
    "columns": "--src-col/--tgt-col",
    "files": "--corpus (its files changed)",
    "shard_lines": "--shard-lines",
}


def add_score_parser(sub: Any) -> None:
    """The `score` subcommand's flags (beside `prepare`, raymt.data.__main__)."""
    c = ScoreConfig()
    q = sub.add_parser(
        "score",
        allow_abbrev=False,
        help="score every pair by dual conditional cross-entropy (forward and backward model)",
        description=__doc__.split("\n\n")[0],
    )
    q.add_argument("--forward", required=True, metavar="CKPT", help="a raymt checkpoint translating src->tgt")
    q.add_argument("--backward", required=True, metavar="CKPT", help="a raymt checkpoint translating tgt->src")
    q.add_argument("--corpus", required=True, metavar="SPEC", help="PREFIX (PREFIX.<src>, PREFIX.<tgt>) or a file")
    q.add_argument("--output", metavar="DIR|URI", help="the scores' directory (default SPEC.scores, beside it)")
    q.add_argument("--src", dest="src_lang", help="the corpus's source language (default: the forward model's)")
    q.add_argument("--tgt", dest="tgt_lang", help="the corpus's target language (default: the forward model's)")
    q.add_argument("--src-col", help="TSV column number, or JSONL key / Parquet column (default: --src)")
    q.add_argument("--tgt-col", help="TSV column number, or JSONL key / Parquet column (default: --tgt)")
    q.add_argument("--shard-lines", type=int, default=c.shard_lines, help="corpus lines per score shard")
    q.add_argument("--max-tokens", type=int, default=c.max_tokens, help="padded tokens per batch")
    shard_job.add_actor_flags(q, "scoring", c.progress_s)


@dataclass
class ScoreJob:
    """Everything checked before Ray starts: the models, the corpus, the output, what is left to do."""

    args: argparse.Namespace
    cfg: ScoreConfig
    forward: ModelInfo
    backward: ModelInfo
    src_lang: str
    tgt_lang: str
    source: Source
    output: str
    files: list[dict]  # the corpus files' fingerprints (scores.file_fingerprint)
    num_lines: int = 0
    done: dict[int, dict] = field(default_factory=dict)  # shard -> its counts, for verified shard files
    todo: list[int] = field(default_factory=list)

    @property
    def num_shards(self) -> int:
        """Score shards of the whole corpus."""
        return -(-self.num_lines // self.cfg.shard_lines)

    def rows(self) -> Iterator[tuple[Optional[str], Optional[str]]]:
        """The corpus's pairs in line order, as prepare reads them (None for an invalid side)."""
        cfg = PrepareConfig(src_lang=self.src_lang, tgt_lang=self.tgt_lang)
        for s, t, _ in ROW_READERS[self.source.kind](task_spec(self.source, cfg), "skip"):
            yield s, t


# ---------------------------------------------------------------- checks before Ray


def check_models(forward: ModelInfo, backward: ModelInfo, src: str, tgt: str) -> None:
    """One-line errors unless the forward model translates src->tgt and the backward tgt->src (raymt
    checkpoints: scoring reads their log-probabilities; their tokenizers may differ)."""
    for flag, info, pair in (("--forward", forward, (src, tgt)), ("--backward", backward, (tgt, src))):
        if info.kind != "raymt":
            raise ValueError(f"{flag} {info.location} is a CTranslate2 export: pass the raymt checkpoint it came from")
        if pair not in info.pairs:
            trained = ", ".join(f"{a}->{b}" for a, b in info.pairs)
            raise ValueError(
                f"{flag} {info.location} translates {trained}, but the {flag[2:]} model of a {src}-{tgt} corpus "
                f"translates {pair[0]}->{pair[1]}: pass a {pair[0]}->{pair[1]} model"
            )


def corpus_langs(args: argparse.Namespace, forward: ModelInfo) -> tuple[str, str]:
    """The corpus's languages: --src/--tgt, else the forward model's one pair."""
    if args.src_lang and args.tgt_lang:
        return args.src_lang, args.tgt_lang
    if len(forward.pairs) != 1:
        raise ValueError(f"--forward {forward.location} translates several pairs: pass --src and --tgt (the corpus's)")
    src, tgt = forward.pairs[0]
    return args.src_lang or src, args.tgt_lang or tgt


def check_args(args: argparse.Namespace) -> ScoreJob:
    """Everything that can be wrong with the command line, checked before Ray starts."""
    from raymt.checkpoint import load_weights
    from raymt.engines import load_model_info

    cfg = ScoreConfig(shard_lines=args.shard_lines, max_tokens=args.max_tokens, progress_s=args.progress_s)
    if args.num_actors is not None and args.num_actors < 1:
        raise ValueError(f"--num-actors {args.num_actors} must be >= 1")
    forward, backward = load_model_info(args.forward), load_model_info(args.backward)
    src, tgt = corpus_langs(args, forward)
    check_models(forward, backward, src, tgt)
    for location in (forward.location, backward.location):  # a corrupt weights file fails now, not in every actor
        load_weights(location)
    source = source_from_spec(args.corpus, PrepareConfig(src_lang=src, tgt_lang=tgt), args.src_col, args.tgt_col)
    if source.kind == "parquet" and len(source.paths) != 1:
        raise ValueError(f"--corpus {args.corpus}: score one Parquet file at a time (it names {len(source.paths)})")
    try:
        files = [scores.file_fingerprint(p) for p in source.paths]
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"--corpus {args.corpus}: cannot read {err}".split("\n")[0]) from None
    output = storage.output_location(args.output or scores.default_location(args.corpus), "--output")
    job = ScoreJob(args, cfg, forward, backward, src, tgt, source, output, files)
    old = check_output(job)
    job.num_lines = old["num_lines"] if old else sum(1 for _ in job.rows())
    if job.num_lines == 0:
        raise ValueError(f"--corpus {args.corpus} has no lines")
    job.done, job.todo = shard_job.find_done(
        output, job.num_shards, cfg.shard_lines, job.num_lines, scores.META_KEY, "scored"
    )
    return job


def settings(job: ScoreJob) -> dict:
    """What fixes a job's scores: a rerun into the same --output must have the same."""
    return {
        "forward": job.forward.location,
        "backward": job.backward.location,
        "src_lang": job.src_lang,
        "tgt_lang": job.tgt_lang,
        "corpus": job.args.corpus,
        "columns": [job.args.src_col, job.args.tgt_col],
        "files": job.files,
        "shard_lines": job.cfg.shard_lines,
    }


def check_output(job: ScoreJob) -> Optional[dict]:
    """The existing score.json of --output (None for a new job); a one-line error for other settings."""
    if storage.file_type(job.output) == pafs.FileType.File:
        raise ValueError(f"--output {job.output} is a file: pass a directory (or a URI prefix)")
    raw = storage.optional_bytes(storage.join(job.output, scores.INFO_FILE))
    if raw is None:
        return None
    try:
        info = json.loads(raw)
        assert isinstance(info, dict) and info.get("format") == scores.INFO_FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError, AssertionError):
        raise ValueError(f"--output {job.output}: {scores.INFO_FILE} is not a raymt score record") from None
    now = settings(job)
    differ = [k for k in now if info.get(k) != now[k]]
    if differ:
        names = ", ".join(dict.fromkeys(SETTING_FLAGS[k] for k in differ))
        raise ValueError(
            f"--output {job.output} holds scores of other settings ({names}): rerun it with the same "
            "flags to finish it, or pass a new --output"
        )
    return info


def write_info(job: ScoreJob, done: bool = False) -> dict:
    """score.json: settings, line count, totals so far and whether the job is complete."""
    totals = {k: sum(int(c.get(k, 0)) for c in job.done.values()) for k in scores.COUNTS}
    info = {
        "format": scores.INFO_FORMAT,
        "formula": "exp(-(|H_fwd - H_bwd| + (H_fwd + H_bwd) / 2)), H per target token and EOS",
        **settings(job),
        "num_lines": job.num_lines,
        "num_shards": job.num_shards,
        "shards_done": len(job.done),
        "counts": totals,
        "done": done,
    }
    storage.write_bytes(storage.join(job.output, scores.INFO_FILE), json.dumps(info, indent=2).encode())
    return info


# ---------------------------------------------------------------- scoring


def shard_inputs(job: ScoreJob) -> Iterator[tuple[int, pa.Table]]:
    """The shards to do in line order, each one table (line_id, src, tgt; null when invalid), read
    in this process one shard at a time."""
    todo, per = set(job.todo), job.cfg.shard_lines
    ids: list[int] = []
    src: list[Optional[str]] = []
    tgt: list[Optional[str]] = []
    for line_id, (s, t) in enumerate(job.rows()):
        if line_id >= job.num_lines:
            raise ValueError(
                f"--corpus {job.args.corpus} has more than {job.num_lines:,} lines now: pass a new --output"
            )
        if line_id // per not in todo:
            continue
        ids.append(line_id)
        src.append(s)
        tgt.append(t)
        if len(ids) == min(per, job.num_lines - line_id // per * per):
            yield line_id // per, pa.table({"line_id": ids, "src": pa.array(src, pa.string()), "tgt": tgt})
            ids, src, tgt = [], [], []


def cross_entropies(
    engine: Engine, sources: list[str], targets: list[str], src_lang: str, tgt_lang: str, max_tokens: int
) -> list[float]:
    """H(target | source) of each pair under a raymt engine's model: minus the mean
    log-probability of the target's tokens and EOS (`raymt.decoding.token_log_probs`), in
    length-sorted batches of at most max_tokens padded tokens; a tagged model gets its tag."""
    from raymt.decoding import pad_batch, split_tags, token_log_probs
    from raymt.engines import token_batches

    info, device = engine.info, getattr(engine, "device", "cpu")
    src_ids = info.encode(sources, tgt_lang, src_lang)
    forced = 1 if info.tag_side == "tgt" else 0
    room = info.max_positions - 2 - forced  # BOS, a decoder-side tag, the target, EOS within positions
    tgt_ids = [ids[:room] for ids in engine.tokenizer.encode_batch(targets, side="tgt")]
    out = [math.nan] * len(sources)
    lengths = [max(len(s), len(t) + 2) for s, t in zip(src_ids, tgt_ids)]
    for batch in token_batches(lengths, max_tokens):
        src, prefix = split_tags(pad_batch([src_ids[i] for i in batch], device), info.tag_side)
        with engine.autocast():  # type: ignore[attr-defined] (RaymtEngine's)
            picked = token_log_probs(engine.model, src, [tgt_ids[i] for i in batch], prefix)  # type: ignore[attr-defined]
        for i, log_probs in zip(batch, picked):
            out[i] = scores.cross_entropy(log_probs)
    return out


def score_block(
    forward: Engine, backward: Engine, block: pa.Table, langs: tuple[str, str], max_tokens: int
) -> pa.Table:
    """A shard's rows scored (line_id, score, h_fwd, h_bwd, status): NaN for an empty or invalid pair."""
    src, tgt = block.column("src").to_pylist(), block.column("tgt").to_pylist()
    n = len(src)
    status = [
        "invalid" if s is None or t is None else "scored" if s.strip() and t.strip() else "empty"
        for s, t in zip(src, tgt)
    ]
    todo = [i for i in range(n) if status[i] == "scored"]
    h_fwd, h_bwd = [math.nan] * n, [math.nan] * n
    if todo:
        ss, ts = [src[i].strip() for i in todo], [tgt[i].strip() for i in todo]
        for i, hf, hb in zip(
            todo,
            cross_entropies(forward, ss, ts, langs[0], langs[1], max_tokens),
            cross_entropies(backward, ts, ss, langs[1], langs[0], max_tokens),
        ):
            h_fwd[i], h_bwd[i] = hf, hb
    score = [math.nan if math.isnan(f) else scores.dual_score(f, b) for f, b in zip(h_fwd, h_bwd)]
    columns = {"line_id": block.column("line_id"), "score": score, "h_fwd": h_fwd, "h_bwd": h_bwd}
    return pa.table(columns, schema=scores.OUT_SCHEMA).append_column("status", pa.array(status, pa.string()))


def shard_file(table: pa.Table) -> tuple[bytes, dict]:
    """A scored shard's Parquet file (its counts in the schema's metadata) and its counts."""
    status = table.column("status").to_pylist()
    counts = {k: status.count(k) for k in scores.COUNTS}
    out = table.select(scores.OUT_SCHEMA.names).replace_schema_metadata({scores.META_KEY: json.dumps(counts)})
    buf = io.BytesIO()
    pq.write_table(out, buf)
    return buf.getvalue(), counts


class ScoreActor:
    """Scoring actor: loads both models once (raymt's engine each), then scores and writes whole shards."""

    def __init__(self, forward: str, backward: str, langs: tuple[str, str], cfg: dict, device: str, **kw: Any):
        import ray

        from raymt.engines import load_engine

        self.langs, self.cfg, self.output = tuple(langs), ScoreConfig(**cfg), kw["output"]
        self.delay_s = kw.get("delay_s", 0.0)
        # A local --output is the driver's directory: an actor on another machine sends its bytes back.
        self.writes = storage.is_uri(self.output) or ray.get_runtime_context().get_node_id() == kw["driver_node"]
        self.forward = load_engine(forward, "raymt", device, kw["num_threads"])
        self.backward = load_engine(backward, "raymt", device, kw["num_threads"])

    def ready(self) -> bool:
        """True once the actor is up (the driver's sign that a restarted actor takes shards again)."""
        return True

    def run_shard(self, shard: int, block: pa.Table) -> dict:
        """Score a whole shard and write its file; a small record back (with the file's bytes only
        when this machine cannot write to --output)."""
        data, counts = shard_file(score_block(self.forward, self.backward, block, self.langs, self.cfg.max_tokens))
        if self.delay_s:
            time.sleep(self.delay_s)
        record: dict[str, Any] = {"shard": shard, "lines": block.num_rows, "counts": counts}
        if self.writes:
            shard_job.write_shard(storage.join(self.output, shard_job.shard_name(shard * self.cfg.shard_lines)), data)
        else:
            record["data"] = data
        return record


# ---------------------------------------------------------------- running it


class Progress:
    """The driver's record of a run: each finished shard's counts, a line every --progress-s seconds."""

    def __init__(self, job: ScoreJob):
        self.job, self.lines = job, 0
        self.started = self.printed = time.time()

    def add(self, record: dict) -> None:
        """Take one finished shard's record (and write its file when an actor sent the bytes)."""
        if "data" in record:
            name = shard_job.shard_name(record["shard"] * self.job.cfg.shard_lines)
            shard_job.write_shard(storage.join(self.job.output, name), record["data"])
        self.job.done[record["shard"]] = record["counts"]
        self.lines += record["lines"]

    def show(self, final: bool = False) -> None:
        """A progress line every --progress-s seconds: shards done and pairs/s."""
        now = time.time()
        if not final and now - self.printed < self.job.cfg.progress_s:
            return
        self.printed = now
        rate = self.lines / max(now - self.started, 1e-9)
        print(f"score: {len(self.job.done)}/{self.job.num_shards} shards, {rate:,.1f} pairs/s", flush=True)


def run_on_cluster(job: ScoreJob, progress: Progress) -> None:
    """Start the scoring actors and hand them the shards to do (`raymt.shard_job`)."""
    import ray

    args = job.args
    num_actors = min(args.num_actors or default_actors(args.gpu), len(job.todo))
    plan = actor_plan(num_actors, args.gpu, args.cpus_per_actor, keep_cpus=0)  # one line if they do not fit
    kwargs = {
        "forward": job.forward.location,
        "backward": job.backward.location,
        "langs": (job.src_lang, job.tgt_lang),
        "cfg": dataclasses.asdict(job.cfg),
        "device": "cuda" if args.gpu else "cpu",
        "num_threads": plan.num_threads,
        "output": job.output,
        "driver_node": ray.get_runtime_context().get_node_id(),
        "delay_s": shard_job.actor_delay_s(),
    }
    actors = shard_job.start_actors(ScoreActor, num_actors, plan, kwargs)
    progress.started = progress.printed = time.time()
    shard_job.run_shards(actors, shard_inputs(job), progress, job.cfg.progress_s)


def main(args: argparse.Namespace) -> int:
    """`raymt data score`; returns the exit status."""
    t0 = time.time()
    try:
        check_ray_address()  # before anything is written to --output
        job = check_args(args)
        write_info(job)
    except ValueError as err:
        return cli_error(PROG, " ".join(str(err).split("\n")))
    progress = Progress(job)
    if job.todo:
        print(f"score: {job.num_lines:,} pairs in {job.num_shards} shards, {len(job.todo)} to do", flush=True)
        started = init_ray(args.num_cpus, verbose=args.verbose)
        try:
            run_on_cluster(job, progress)
        except Exception as err:  # noqa: BLE001 - a reader's one-line error inside Ray's wrapping
            user = user_error(err) if not isinstance(err, ValueError) else err
            if user is None:
                raise
            return cli_error(PROG, user)
        finally:
            if started:
                import ray

                ray.shutdown()
        progress.show(final=True)
    missing = [s for s in range(job.num_shards) if s not in job.done]
    if missing:
        return cli_error(PROG, f"shards {missing[:5]} are incomplete: run the same command again", 1)
    info = write_info(job, done=True)
    c = info["counts"]
    print(
        f"scored {job.num_lines:,} pairs {job.src_lang}-{job.tgt_lang} ({c['scored']:,} scored, {c['empty']:,} "
        f"empty, {c['invalid']:,} invalid) in {time.time() - t0:.1f} s -> {job.output}"
    )
    return 0
