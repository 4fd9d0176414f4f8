"""`raymt data score`: every pair of a parallel corpus scored by dual conditional cross-entropy
(raymt.data.scores) under a forward (src->tgt) and a backward (tgt->src) raymt model, on Ray
actors, restartably.

As `raymt backtranslate` runs (`raymt.shard_job`): the corpus's line ids are cut into shards of
`--shard-lines`; the driver reads the corpus (as `raymt data prepare` reads a --train SPEC) one
shard at a time and hands each to a pool of actors that load both models once, score the shard in
length-sorted token-budget batches (`Engine.score`: teacher-forced log-probabilities, each model
with its own tokenizer) and write its file whole; a dead actor's shards go to a live one, and a rerun of the
same command verifies the files there and scores the rest, every line in exactly one row. An
empty or invalid line gets a NaN score and is counted. `score.json` names the models, languages,
corpus (a fingerprint of its files) and line count; a rerun with other settings is refused.
With `--valid SPEC` the validation set is then scored the same way into OUTPUT/valid (a score
directory of its own: prepare's calibrate_valid reads it); without `--forward` a pair's score is
the backward model's exp(-H) alone.
In Python: `run(ScoreConfig(forward=CKPT, backward=CKPT, corpus=SPEC))`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import pyarrow as pa

from raymt import storage
from raymt.cluster import check_ray_address, init_ray
from raymt.command import add_flags
from raymt.config import PrepareConfig, ScoreConfig, ShardJobOptions
from raymt.data import scores
from raymt.data.sources import ROW_READERS, Source, source_from_spec, task_spec
from raymt.shard_job import Progress, SettingsRecord, ShardActor, ShardJob, run_job, shard_bytes

if TYPE_CHECKING:  # torch only where a model is loaded: `raymt data prepare` imports this module's parser
    from raymt.engines import Engine, ModelInfo

PROG = "raymt.data score"
# The process title of a scoring actor (tests find actors by it).
ACTOR_TITLE = "ray::ScoreActor"
RECORD = SettingsRecord(
    scores.INFO_FILE,
    "scores",
    flags={
        "forward": "--forward",
        "backward": "--backward",
        "src_lang": "--src",
        "tgt_lang": "--tgt",
        "corpus": "--corpus",
        "columns": "--src-col/--tgt-col",
        "files": "--corpus (its files changed)",
        "shard_lines": "--shard-lines",
    },
    format=scores.INFO_FORMAT,
)


def add_score_parser(sub: Any) -> None:
    """The `score` subcommand's flags (beside `prepare`, raymt.data.__main__): `ScoreConfig`'s fields."""
    q = sub.add_parser(
        "score",
        allow_abbrev=False,
        help="score every pair by dual conditional cross-entropy (forward and backward model)",
        description=__doc__.split("\n\n")[0],
    )
    add_flags(q, ScoreConfig)


@dataclass(kw_only=True)
class ScoreJob(ShardJob):
    """Everything checked before Ray starts: the models, the corpus, the output, what is left to do."""

    forward: Optional[ModelInfo]  # src->tgt; None: scored by the backward model alone
    backward: ModelInfo  # tgt->src
    source: Source  # the corpus, read as prepare reads it
    files: list[dict] = field(default_factory=list)  # the corpus files' fingerprints (scores.file_fingerprint)
    cfg: ScoreConfig
    name, unit, rate_unit = "score", "pairs", "pairs/s"

    @property
    def options(self) -> ShardJobOptions:
        """--shard-lines, --max-tokens and the actors' flags."""
        return self.cfg.shards

    def rows(self) -> Iterator[tuple[Optional[str], Optional[str]]]:
        """The corpus's pairs in line order, as prepare reads them (None for an invalid side)."""
        cfg = PrepareConfig(src_lang=self.src_lang, tgt_lang=self.tgt_lang)
        for s, t, _ in ROW_READERS[self.source.kind](task_spec(self.source, cfg), "skip"):
            yield s, t

    def record(self, done: bool = False) -> dict:
        """score.json (`write_info`)."""
        return write_info(self, done)

    def shard_inputs(self) -> Iterator[tuple[int, pa.Table]]:
        """The shards to do in line order, each one table (line_id, src, tgt; null when invalid), read
        in this process one shard at a time."""
        todo, per = set(self.todo), self.options.shard_lines
        ids: list[int] = []
        src: list[Optional[str]] = []
        tgt: list[Optional[str]] = []
        for line_id, (s, t) in enumerate(self.rows()):
            if line_id >= self.num_lines:
                raise ValueError(
                    f"--corpus {self.cfg.corpus} has more than {self.num_lines:,} lines now: pass a new --output"
                )
            if line_id // per not in todo:
                continue
            ids.append(line_id)
            src.append(s)
            tgt.append(t)
            if len(ids) == min(per, self.num_lines - line_id // per * per):
                yield line_id // per, pa.table({"line_id": ids, "src": pa.array(src, pa.string()), "tgt": tgt})
                ids, src, tgt = [], [], []

    def actor_kwargs(self) -> dict:
        """A scoring actor's keywords: each loads both models."""
        models = {"forward": self.forward and self.forward.location, "backward": self.backward.location}
        return {**models, "langs": self.langs, "max_tokens": self.options.max_tokens}

    def summary(self, seconds: float, progress: Progress) -> str:
        """The last line: counts, wall time and where the scores are."""
        c = self.totals(scores.COUNTS)
        return (
            f"scored {self.num_lines:,} pairs {self.src_lang}-{self.tgt_lang} ({c['scored']:,} scored, {c['empty']:,} "
            f"empty, {c['invalid']:,} invalid) in {seconds:.1f} s -> {self.output}"
        )


# ---------------------------------------------------------------- checks before Ray


def check_models(forward: Optional[ModelInfo], backward: ModelInfo, src: str, tgt: str) -> None:
    """One-line errors unless the forward model (if any) translates src->tgt and the backward tgt->src
    (raymt checkpoints: scoring reads their log-probabilities; their tokenizers may differ)."""
    for flag, info, pair in (("--forward", forward, (src, tgt)), ("--backward", backward, (tgt, src))):
        if info is None:
            continue
        if info.kind != "raymt":
            raise ValueError(f"{flag} {info.location} is a CTranslate2 export: pass the raymt checkpoint it came from")
        if pair not in info.pairs:
            trained = ", ".join(f"{a}->{b}" for a, b in info.pairs)
            raise ValueError(
                f"{flag} {info.location} translates {trained}, but the {flag[2:]} model of a {src}-{tgt} corpus "
                f"translates {pair[0]}->{pair[1]}: pass a {pair[0]}->{pair[1]} model"
            )


def corpus_langs(cfg: ScoreConfig, forward: Optional[ModelInfo], backward: ModelInfo) -> tuple[str, str]:
    """The corpus's languages: --src/--tgt, else the forward model's one pair (without one, the
    backward model's reversed)."""
    if cfg.src_lang and cfg.tgt_lang:
        return cfg.src_lang, cfg.tgt_lang
    flag, info = ("--forward", forward) if forward is not None else ("--backward", backward)
    if len(info.pairs) != 1:
        raise ValueError(f"{flag} {info.location} translates several pairs: pass --src and --tgt (the corpus's)")
    src, tgt = info.pairs[0] if forward is not None else info.pairs[0][::-1]
    return cfg.src_lang or src, cfg.tgt_lang or tgt


def check_args(cfg: ScoreConfig) -> ScoreJob:
    """Everything that can be wrong with the job beside its config's values, checked before Ray
    starts: the models, the corpus, the output and its record; what is left to do."""
    from raymt.checkpoint import load_weights
    from raymt.engines import load_model_info

    forward = load_model_info(cfg.forward) if cfg.forward is not None else None
    backward = load_model_info(cfg.backward)
    src, tgt = corpus_langs(cfg, forward, backward)
    check_models(forward, backward, src, tgt)
    for info in (forward, backward):  # a corrupt weights file fails now, not in every actor
        if info is not None:
            load_weights(info.location)
    source = source_from_spec(cfg.corpus, PrepareConfig(src_lang=src, tgt_lang=tgt), cfg.src_col, cfg.tgt_col)
    if source.kind == "parquet" and len(source.paths) != 1:
        raise ValueError(f"--corpus {cfg.corpus}: score one Parquet file at a time (it names {len(source.paths)})")
    try:
        files = [scores.file_fingerprint(p) for p in source.paths]
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"--corpus {cfg.corpus}: cannot read {err}".split("\n")[0]) from None
    output = storage.output_location(cfg.output or scores.default_location(cfg.corpus), "--output")
    job = ScoreJob(
        output=output, cfg=cfg, forward=forward, backward=backward, langs=(src, tgt), source=source, files=files
    )
    old = RECORD.check(output, settings(job))
    job.num_lines = old["num_lines"] if old else sum(1 for _ in job.rows())
    if job.num_lines == 0:
        raise ValueError(f"--corpus {cfg.corpus} has no lines")
    job.find_done(scores.META_KEY, "scored")
    return job


def settings(job: ScoreJob) -> dict:
    """What fixes a job's scores: a rerun into the same --output must have the same."""
    return {
        "forward": job.forward and job.forward.location,
        "backward": job.backward.location,
        "src_lang": job.src_lang,
        "tgt_lang": job.tgt_lang,
        "corpus": job.cfg.corpus,
        "columns": [job.cfg.src_col, job.cfg.tgt_col],
        "files": job.files,
        "shard_lines": job.options.shard_lines,
    }


def write_info(job: ScoreJob, done: bool = False) -> dict:
    """score.json: settings, line count, totals so far and whether the job is complete."""
    info = {
        "formula": (
            "exp(-(|H_fwd - H_bwd| + (H_fwd + H_bwd) / 2)), H per target token and EOS"
            if job.forward
            else "exp(-H_bwd), H per source token and EOS"
        ),
        **settings(job),
        "num_lines": job.num_lines,
        "num_shards": job.num_shards,
        "shards_done": len(job.done),
        "counts": job.totals(scores.COUNTS),
        "done": done,
    }
    RECORD.write(job.output, info)
    return info


# ---------------------------------------------------------------- scoring


def cross_entropies(
    engine: Engine, sources: list[str], targets: list[str], src_lang: str, tgt_lang: str, max_tokens: int
) -> list[float]:
    """H(target | source) of each pair under an engine: minus the mean teacher-forced
    log-probability of the target's tokens and EOS (`Engine.score`, in length-sorted batches of at
    most max_tokens padded tokens; a tagged model gets its tag)."""
    return [scores.cross_entropy(lp) for lp in engine.score(sources, targets, tgt_lang, src_lang, max_tokens)]


def score_block(
    forward: Optional[Engine], backward: Engine, block: pa.Table, langs: tuple[str, str], max_tokens: int
) -> pa.Table:
    """A shard's rows scored (line_id, score, h_fwd, h_bwd, status): NaN for an empty or invalid pair
    (and h_fwd NaN without a forward model: the score is then `scores.backward_score`)."""
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
        fwd = cross_entropies(forward, ss, ts, langs[0], langs[1], max_tokens) if forward else [math.nan] * len(todo)
        for i, hf, hb in zip(todo, fwd, cross_entropies(backward, ts, ss, langs[1], langs[0], max_tokens)):
            h_fwd[i], h_bwd[i] = hf, hb
    score = [
        math.nan if math.isnan(b) else scores.dual_score(f, b) if forward else scores.backward_score(b)
        for f, b in zip(h_fwd, h_bwd)
    ]
    columns = {"line_id": block.column("line_id"), "score": score, "h_fwd": h_fwd, "h_bwd": h_bwd}
    return pa.table(columns, schema=scores.OUT_SCHEMA).append_column("status", pa.array(status, pa.string()))


def shard_file(table: pa.Table) -> tuple[bytes, dict]:
    """A scored shard's Parquet file (its counts in the schema's metadata) and its counts."""
    status = table.column("status").to_pylist()
    counts = {k: status.count(k) for k in scores.COUNTS}
    return shard_bytes(table.select(scores.OUT_SCHEMA.names), scores.META_KEY, counts), counts


class ScoreActor(ShardActor):
    """Scoring actor: loads both models once (raymt's engine each), then scores and writes whole shards."""

    def __init__(
        self,
        forward: Optional[str],
        backward: str,
        langs: tuple[str, str],
        max_tokens: int,
        device: str,
        num_threads: int,
        **common: Any,
    ):
        from raymt.engines import load_engine

        super().__init__(**common)  # ShardActor's: output, shard_lines, driver_node, delay_s
        self.langs, self.max_tokens = tuple(langs), max_tokens
        self.forward = load_engine(forward, "raymt", device, num_threads) if forward else None
        self.backward = load_engine(backward, "raymt", device, num_threads)

    def shard_file(self, block: pa.Table) -> tuple[bytes, dict]:
        """A whole shard scored: its file and counts."""
        return shard_file(score_block(self.forward, self.backward, block, self.langs, self.max_tokens))


def valid_config(cfg: ScoreConfig) -> ScoreConfig:
    """The job that scores --valid: the same models, languages and columns, into OUTPUT/valid."""
    assert cfg.valid is not None
    output = scores.valid_location(cfg.output or scores.default_location(cfg.corpus))
    return dataclasses.replace(cfg, corpus=cfg.valid, valid=None, output=output)


def run(cfg: ScoreConfig) -> ScoreJob:
    """Score every pair of `cfg.corpus` into `cfg.output` (default SPEC.scores) on Ray actors (the
    shards a previous run left to do), then --valid's into OUTPUT/valid, both checked before Ray
    and scored in one Ray session; the corpus's finished job (its score.json: `job.record()`'s).
    Raises a one-line ValueError on a user error and `raymt.shard_job.Unfinished` when shards are
    left to do."""
    if cfg.valid is None:
        return run_job(lambda: check_args(cfg), ScoreActor)[0]
    check_ray_address()
    jobs = [check_args(cfg), check_args(valid_config(cfg))]
    # One Ray for both jobs (run_job leaves a Ray it did not start running); none when all is done.
    started = any(job.todo for job in jobs) and init_ray(jobs[0].options.num_cpus, verbose=jobs[0].options.verbose)
    try:
        for job in jobs:
            run_job(lambda job=job: job, ScoreActor)
    finally:
        if started:
            import ray

            ray.shutdown()
    return jobs[0]
