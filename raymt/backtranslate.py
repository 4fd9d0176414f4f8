"""`python -m raymt.backtranslate`: translate a monolingual corpus of any size on a Ray cluster, restartably.

Back-translation (Sennrich et al. 2016; Edunov et al. 2018): a reverse model (de->en, say)
translates target-side monolingual text (German) into synthetic sources (English); the
pairs (synthetic English, real German) then join the real ones for training en->de.

The input's line ids are cut into shards of `--shard-lines`; shard k (line ids
[k*S, (k+1)*S)) becomes `part-<first line id>.parquet` with columns line_id, input, output,
score, written whole (a temporary name renamed, or one object PUT). The driver reads the
input file by file (one shard in memory at a time) and hands each unfinished shard to a pool
of Ray actors (the model loaded once each; two shards queued per actor); an actor cuts the
shard into length-sorted token-budget batches, decodes it and writes the shard's file
itself, then returns a small record (shard, counts) for the progress line and `bt.json`.
(Not Ray Data: a map task's output reaches the next step only per 128 MiB or when the task
ends, so a read step per file fed whole files to one actor and shards to the driver at the end.)
Killed anywhere (driver or actor), the same command finishes the job: a shard file is
written once complete, so a killed driver loses only the shards in flight; the files are
found and verified (row count) on restart, and the rest is redone; every input line ends up
in exactly one row. An empty or invalid line (bad UTF-8, bad JSON, missing column) gets an
empty output and is counted, so the output stays aligned with the input.

`bt.json` in the output names the model and its direction, the decoding options, the
input and its line count, the counts, and `done`; a rerun with other settings is refused.
`--format text` also writes `text.<src>` (the inputs) and `text.<tgt>` (the outputs),
aligned line by line, usable as a `--train` prefix. The job's record (`bt.json`, shard files,
what is left to do) is `raymt.bt_job`'s; the decoding engines are `raymt.engines`'.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import sys
import time
from typing import Any, Iterator, Optional

import pyarrow as pa

from raymt import storage
from raymt.bt_job import (
    STATUS_EMPTY,
    STATUS_INVALID,
    STATUS_OK,
    Job,
    check_output,
    count_inputs,
    find_done,
    shard_file,
    text_complete,
    write_info,
    write_text,
)
from raymt.checkpoint import load_weights, trained_sources
from raymt.cluster import actor_plan, check_ray_address, default_actors, init_ray
from raymt.config import BT_FORMATS, BacktranslateConfig, DecodeOptions
from raymt.data.mono import changed_error, check_columns, default_column, input_files, raw_items, text_of
from raymt.engines import (
    ENGINE_CHOICES,
    Engine,
    ModelInfo,
    ct2_model_dir,
    load_engine,
    load_model_info,
    resolve_engine,
    token_batches,
)
from raymt.errors import cli_error, user_error
from raymt.flags import add_decode_flags, decode_options
from raymt.shard_job import actor_delay_s, add_actor_flags, run_shards, shard_name, start_actors, write_shard

# The process title of a decoding actor (tests and the benchmark find actors by it).
ACTOR_TITLE = "ray::BacktranslateActor"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    b = BacktranslateConfig()
    p = argparse.ArgumentParser(prog="python -m raymt.backtranslate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        help="raymt checkpoint, or a `raymt export --format ctranslate2` directory; repeated: an ensemble of "
        "raymt checkpoints that share a tokenizer (raymt's engine)",
    )
    p.add_argument(
        "--input",
        required=True,
        metavar="SPEC",
        help="text (plain, .gz/.xz/.zst/.bz2), .tsv, .jsonl or .parquet: a file, a glob, a directory or a URI",
    )
    p.add_argument("--output", required=True, metavar="DIR|URI", help="shards, bt.json (and text) go here")
    p.add_argument("--format", choices=BT_FORMATS, default="parquet", help="text: also aligned text.<lang> files")
    p.add_argument("--column", help="TSV: 0-based column (default 0); JSONL/Parquet: key (default the source language)")
    p.add_argument("--src-lang", help="the input's language: checked against the model's source")
    p.add_argument("--tgt-lang", help="the output's language: checked (tagged models: picks the tag)")
    add_decode_flags(p)  # --sample: sampled outputs (Edunov et al. 2018)
    p.add_argument("--noise", action="store_true", help="noised beam output: delete, replace, swap words")
    p.add_argument("--noise-delete", type=float, default=b.noise_delete, help="drop probability of a word")
    p.add_argument("--noise-replace", type=float, default=b.noise_replace, help="probability of the filler")
    p.add_argument("--noise-swap", type=int, default=b.noise_swap, help="words move at most this far")
    p.add_argument("--noise-filler", default=b.noise_filler, help="the word that replaces words")
    p.add_argument("--seed", type=int, default=b.seed, help="seed of sampling and noise (per line id)")
    p.add_argument("--engine", choices=ENGINE_CHOICES, default=b.engine)
    p.add_argument("--compute-type", default=b.compute_type, help="CTranslate2: auto = int8 on CPU, float16 on GPU")
    p.add_argument("--max-tokens", type=int, default=b.max_tokens, help="padded source tokens per batch")
    p.add_argument("--shard-lines", type=int, default=b.shard_lines, help="input lines per output shard")
    add_actor_flags(p, "decoding", b.progress_s)
    return p.parse_args(argv)


# ---------------------------------------------------------------- the model


def directions(model: ModelInfo, src_lang: Optional[str], tgt_lang: Optional[str]) -> tuple[str, str, list[str]]:
    """(src_lang, tgt_lang, tag pieces before each source): checked against what the model was trained on."""
    data = model.config.data
    if model.languages:  # a tagged multilingual model (design-inputs.md section 6)
        tags = model.tags(tgt_lang)
        tgt_lang = tgt_lang or model.languages["target_langs"][0]  # untagged many-to-one: its one target
        # Only the sources trained into tgt_lang: en->en on an en<->de model is no trained pair.
        sources = trained_sources(model.languages, tgt_lang)
        if src_lang is None and len(sources) > 1:
            raise ValueError(
                f"this model translates into {tgt_lang} from {', '.join(sources)}: pass --src-lang (the input's)"
            )
        if src_lang is not None and src_lang not in sources:
            raise ValueError(
                f"--src-lang {src_lang}: {model.location} was trained to translate into {tgt_lang} from "
                f"{', '.join(sources)}; back-translate text in one of them"
            )
        return src_lang or sources[0], tgt_lang, tags
    src, tgt = data.pair()  # untagged: one pair
    if src_lang is not None and src_lang != src:
        raise ValueError(
            f"--src-lang {src_lang}: {model.location} translates {src}->{tgt}, so its input is {src}; to "
            f"back-translate {tgt_lang or tgt} text into {src_lang}, use a {src_lang}->{tgt_lang or tgt} model "
            "(a reverse model of the pair you train)"
        )
    return src, tgt, model.tags(tgt_lang)  # --tgt-lang: its own target or none (the one check, ModelInfo.tags)


# ---------------------------------------------------------------- the input


def shard_inputs(job: Job) -> Iterator[tuple[int, pa.Table]]:
    """The shards to do in line-id order, each one table (line_id, text; text null when invalid),
    read file by file in this process: one shard in memory at a time, whatever the files' sizes.
    A shard may span files; files without a shard to do are not opened."""
    shard_lines, todo = job.bt.shard_lines, set(job.todo)
    src_lang = job.src_lang.split("+")[0]
    ids: list[int] = []
    texts: list[Optional[str]] = []
    for f in job.files:
        first, end = f.first_line, f.first_line + f.num_lines
        if not any(s in todo for s in range(first // shard_lines, -(-end // shard_lines))):
            continue
        col = default_column(f.kind, job.args.column, src_lang)
        line_id = first
        for raw in raw_items(f, col):
            if line_id == end:
                raise changed_error(f, "more")
            shard = line_id // shard_lines
            if shard in todo:  # the lines of done shards are not decoded
                ids.append(line_id)
                texts.append(text_of(raw, f.kind, col, line_id == first))
                if len(ids) == job.shard_rows(shard):
                    yield shard, pa.table({"line_id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())})
                    ids, texts = [], []
            line_id += 1
        if line_id != end:
            raise changed_error(f, str(line_id - first))


# ---------------------------------------------------------------- decoding


def noise_words(text: str, rng: random.Random, bt: BacktranslateConfig) -> str:
    """Edunov et al. (2018)'s noise on an output: each word dropped with p_delete, else replaced
    by the filler with p_replace; then a shuffle moving no word more than noise_swap places
    (Lample et al. 2018: sort by i + U(0, swap + 1)). A non-empty output keeps a word."""
    words = text.split()
    kept = []
    for word in words:
        if rng.random() < bt.noise_delete:
            continue
        kept.append(bt.noise_filler if rng.random() < bt.noise_replace else word)
    if words and not kept:
        kept = [rng.choice(words)]
    if bt.noise_swap > 0:
        keys = [i + rng.uniform(0, bt.noise_swap + 1) for i in range(len(kept))]
        kept = [w for _, w in sorted(zip(keys, kept), key=lambda kw: kw[0])]
    return " ".join(kept)


def _batch_seed(seed: int, first_line_id: int) -> int:
    """A sampling seed per batch, from the run's seed and the batch's first line id (repeatable)."""
    digest = hashlib.blake2b(f"{seed}:{first_line_id}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


class BacktranslateActor:
    """Decoding actor: loads the model (or an ensemble) once, then translates whole shards and writes each one."""

    def __init__(
        self,
        checkpoints: list[str],
        engine: str,
        opts: dict,
        bt: dict,
        tgt_lang: str,
        device: str,
        num_threads: int,
        output: str,
        driver_node: str,
        cache: Optional[str] = None,
        delay_s: float = 0.0,
        src_lang: Optional[str] = None,
    ):
        import ray

        self.bt, self.delay_s, self.output = BacktranslateConfig(**bt), delay_s, output
        self.opts, self.tgt_lang, self.src_lang = DecodeOptions(**opts), tgt_lang, src_lang
        # A local --output is the driver's directory: an actor on another machine sends its bytes back.
        self.writes = storage.is_uri(output) or ray.get_runtime_context().get_node_id() == driver_node
        self.engine = load_engine(checkpoints, engine, device, num_threads, self.bt.compute_type, cache)

    def ready(self) -> bool:
        """True once the actor is up (the driver's sign that a restarted actor takes shards again)."""
        return True

    def run_shard(self, shard: int, block: pa.Table) -> dict:
        """Translate a whole shard and write its file; a small record back (shard, lines, counts),
        with the file's bytes only when this machine cannot write to --output."""
        table = translate_block(self.engine, block, self.opts, self.bt, self.tgt_lang, self.delay_s, self.src_lang)
        data, counts = shard_file(table)
        record: dict[str, Any] = {"shard": shard, "lines": block.num_rows, "counts": counts}
        if self.writes:
            write_shard(storage.join(self.output, shard_name(shard * self.bt.shard_lines)), data)
        else:
            record["data"] = data
        return record


def translate_block(
    engine: Engine,
    block: pa.Table,
    opts: DecodeOptions,
    bt: BacktranslateConfig,
    tgt_lang: Optional[str] = None,
    delay_s: float = 0.0,
    src_lang: Optional[str] = None,
) -> pa.Table:
    """Translate a block's valid, non-empty lines (in `src_lang`, for a model that reads it) into
    `tgt_lang` in token-budget batches (sampling: each batch seeded by its first line id); the
    other lines get ''."""
    line_ids = block.column("line_id").to_pylist()
    texts = block.column("text").to_pylist()
    n = len(line_ids)
    outputs, scores = [""] * n, [float("nan")] * n
    status = [STATUS_INVALID if t is None else STATUS_OK if t.strip() else STATUS_EMPTY for t in texts]
    todo = [i for i in range(n) if status[i] == STATUS_OK]
    encoded = engine.encode([texts[i].strip() for i in todo], tgt_lang, src_lang)
    for batch in token_batches([engine.length(e) for e in encoded], bt.max_tokens):
        seed = _batch_seed(bt.seed, line_ids[todo[batch[0]]])
        batch_opts = dataclasses.replace(opts, seed=seed) if opts.sample else opts
        for j, [(score, text)] in zip(batch, engine.translate_ids([encoded[j] for j in batch], batch_opts)):
            i = todo[j]
            if bt.noise:
                text = noise_words(text, random.Random(f"{bt.seed}:{line_ids[i]}"), bt)
            outputs[i], scores[i] = text.replace("\n", " "), score
    if delay_s:
        time.sleep(delay_s)
    return pa.table(
        {
            "line_id": pa.array(line_ids, pa.int64()),
            "input": pa.array([t or "" for t in texts], pa.string()),
            "output": pa.array(outputs, pa.string()),
            "score": pa.array(scores, pa.float64()),
            "status": pa.array(status, pa.int8()),
        }
    )


def check_args(args: argparse.Namespace) -> Job:
    """Everything that can be wrong with the command line, checked before Ray starts."""
    if args.num_actors is not None and args.num_actors < 1:
        raise ValueError(f"--num-actors {args.num_actors} must be >= 1")
    if args.cpus_per_actor is not None and args.cpus_per_actor <= 0:
        raise ValueError(f"--cpus-per-actor {args.cpus_per_actor} must be > 0")
    if args.beam < 1:
        raise ValueError(f"--beam {args.beam} must be >= 1")
    if args.sample and args.noise:
        raise ValueError("--sample and --noise are two ways of back-translating: pick one")
    bt = BacktranslateConfig(
        shard_lines=args.shard_lines,
        max_tokens=args.max_tokens,
        engine=args.engine,
        compute_type=args.compute_type,
        noise=args.noise,
        noise_delete=args.noise_delete,
        noise_replace=args.noise_replace,
        noise_swap=args.noise_swap,
        noise_filler=args.noise_filler,
        seed=args.seed,
        progress_s=args.progress_s,
    )
    opts = decode_options(args, seed=args.seed if args.sample else None)
    model = load_model_info(args.checkpoint)  # several: an ensemble, checked (engines.check_ensemble)
    src_lang, tgt_lang, tags = directions(model, args.src_lang, args.tgt_lang)
    engine = resolve_engine(bt.engine, model)  # an ensemble's: raymt's
    if engine == "ctranslate2":
        ct2_model_dir(model.location)  # exported once here: an unexportable model fails now
    else:
        for location in model.checkpoints:  # a corrupt or truncated weights file fails now, not in every actor
            load_weights(location)
    files = input_files(args.input)
    check_columns(files, args.column, src_lang.split("+")[0])
    output = storage.output_location(args.output, "--output")  # never into a job's package
    job = Job(args, bt, opts, model, engine, src_lang, tgt_lang, tags, files, output, {})
    old = check_output(job)
    job.info = old or {}  # the previous run's record until write_info replaces it
    count_inputs(job, old)
    offset = 0
    for f in files:
        f.first_line, offset = offset, offset + f.num_lines
    find_done(job)
    return job


# ---------------------------------------------------------------- running it


class Progress:
    """The driver's record of a run: each finished shard's counts (its file written by its actor,
    or here from the bytes an actor sent), and a progress line every --progress-s seconds."""

    def __init__(self, job: Job):
        self.job = job
        self.lines = 0  # lines translated (or counted empty) in this run
        self.started = self.ended = time.time()
        self.printed = self.started
        self.last_line = ""

    def add(self, record: dict) -> None:
        """Take one finished shard's record (shard, lines, counts and maybe the file's bytes)."""
        shard = record["shard"]
        if "data" in record:
            write_shard(storage.join(self.job.output, shard_name(shard * self.job.bt.shard_lines)), record["data"])
        self.job.done[shard] = record["counts"]
        self.lines += record["lines"]
        self.ended = time.time()

    def show(self, final: bool = False) -> None:
        """A progress line every --progress-s seconds: lines, shards, sentences/s and ETA."""
        now = time.time()
        if not final and now - self.printed < self.job.bt.progress_s:
            return
        self.printed = now
        job, rate = self.job, self.lines / max(now - self.started, 1e-9)
        done_lines = sum(job.shard_rows(s) for s in job.done)
        left = job.num_lines - done_lines
        eta = f"ETA {_clock(left / rate)}" if rate > 0 and left > 0 else ("done" if left <= 0 else "ETA ?")
        line = (
            f"backtranslate: {done_lines:,}/{job.num_lines:,} lines ({100 * done_lines / job.num_lines:.1f}%), "
            f"{len(job.done)}/{job.num_shards} shards, {rate:,.1f} sentences/s, {eta}"
        )
        if line != self.last_line:
            print(line, flush=True)
        self.last_line = line


def _clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def backtranslate_actors(job: Job) -> list:
    """The decoding actors (no more than shards to do), on `raymt.shard_job`'s pool."""
    import ray

    args = job.args
    num_actors = min(args.num_actors or default_actors(args.gpu), len(job.todo))
    # No Ray Data here (the driver reads the input): the actors may take every CPU.
    plan = actor_plan(num_actors, args.gpu, args.cpus_per_actor, keep_cpus=0)  # one line if they do not fit
    kwargs = {
        "checkpoints": job.model.checkpoints,  # each actor loads them (several: an ensemble)
        "engine": job.engine,
        "opts": dict(job.opts.__dict__),
        "bt": dataclasses.asdict(job.bt),
        "tgt_lang": job.tgt_lang,
        "device": "cuda" if args.gpu else "cpu",
        "num_threads": plan.num_threads,
        "output": job.output,
        "driver_node": ray.get_runtime_context().get_node_id(),
        "cache": str(storage.cache_root()),
        "delay_s": actor_delay_s(),
        "src_lang": job.src_lang.split("+")[0],  # an imported NLLB's source code (ModelInfo.source_tag)
    }
    return start_actors(BacktranslateActor, num_actors, plan, kwargs)


def run_on_cluster(job: Job, progress: Progress) -> None:
    """Read the shards to do here and hand each to the actor pool, whose actors write their files."""
    actors = backtranslate_actors(job)
    progress.started = progress.printed = time.time()  # the rate counts decoding, not Ray's start
    run_shards(actors, shard_inputs(job), progress, job.bt.progress_s)


def summary(job: Job, seconds: float, progress: Progress) -> str:
    """The last line: counts, wall time, decoding speed (Ray's start aside) and where the output is."""
    c = job.info["counts"]
    decoding_s = max(progress.ended - progress.started, 1e-9)
    rate = f", {progress.lines / decoding_s:,.1f} sentences/s" if progress.lines else ""
    return (
        f"backtranslated {job.num_lines:,} lines {job.src_lang}->{job.tgt_lang} ({c['translated']:,} translated, "
        f"{c['empty']:,} empty, {c['invalid']:,} invalid; engine {job.engine}) in {seconds:.1f} s{rate} -> {job.output}"
    )


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    t0 = time.time()
    try:
        check_ray_address()  # before anything is written to --output
        job = check_args(args)
        text_done = text_complete(job)  # from the previous run's bt.json, before this run's replaces it
        write_info(job)
    except ValueError as err:
        return cli_error("raymt.backtranslate", err)
    progress = Progress(job)
    if job.todo:
        print(
            f"backtranslate: {job.num_lines:,} lines in {job.num_shards} shards, {len(job.todo)} to do "
            f"({job.engine} engine, {job.src_lang}->{job.tgt_lang})",
            flush=True,
        )
        started = init_ray(args.num_cpus, verbose=args.verbose)
        try:
            run_on_cluster(job, progress)
        except Exception as err:  # noqa: BLE001 - a reader's one-line error inside Ray's wrapping
            user = user_error(err) if not isinstance(err, ValueError) else err
            if user is None:
                raise
            return cli_error("raymt.backtranslate", user)
        finally:
            if started:
                import ray

                ray.shutdown()
        progress.show(final=True)
    missing = [s for s in range(job.num_shards) if s not in job.done]
    if missing:
        return cli_error("raymt.backtranslate", f"shards {missing[:5]} are incomplete: run the same command again", 1)
    if args.format == "text" and (progress.lines or not text_done):  # shards redone: the text too
        write_text(job)
    write_info(job, done=True)
    print(summary(job, time.time() - t0, progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
