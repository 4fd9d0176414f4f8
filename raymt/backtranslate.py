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
aligned line by line, usable as a `--train` prefix. The job (`bt.json`, shard files, what is
left to do, its reader of the input) is `raymt.bt_job`'s; the driver that runs it (check, record,
actors, progress) `raymt.shard_job`'s; the decoding engines `raymt.engines`'. In Python:
`run(BacktranslateConfig(checkpoint=(CKPT,), input=SPEC, output=DIR))`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import sys
from typing import Any, Optional

import pyarrow as pa

from raymt import storage
from raymt.bt_job import (
    META_KEY,
    STATUS_EMPTY,
    STATUS_INVALID,
    STATUS_OK,
    Job,
    check_output,
    count_inputs,
    shard_file,
    text_complete,
)
from raymt.checkpoint import load_weights, trained_sources
from raymt.command import parse
from raymt.config import BacktranslateConfig, DecodeOptions
from raymt.data.mono import check_columns, input_files
from raymt.engines import Engine, ModelInfo, ct2_model_dir, load_engine, load_model_info, resolve_engine, token_batches
from raymt.shard_job import ShardActor, exit_status, run_job

PROG = "raymt.backtranslate"
# The process title of a decoding actor (tests and the benchmark find actors by it).
ACTOR_TITLE = "ray::BacktranslateActor"


def parse_args(argv: Optional[list[str]] = None) -> BacktranslateConfig:
    """The config of a command line (`BacktranslateConfig`'s fields are its flags)."""
    return parse(BacktranslateConfig, argv, "python -m raymt.backtranslate", __doc__.split("\n\n")[0])


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


class BacktranslateActor(ShardActor):
    """Decoding actor: loads the model (or an ensemble) once, then translates whole shards and writes each one."""

    def __init__(
        self,
        cfg: BacktranslateConfig,
        opts: DecodeOptions,
        checkpoints: list[str],
        engine: str,
        tgt_lang: str,
        src_lang: Optional[str],
        device: str,
        num_threads: int,
        cache: Optional[str] = None,
        **common: Any,  # ShardActor's: output, shard_lines, driver_node, delay_s
    ):
        super().__init__(**common)
        self.cfg, self.opts, self.tgt_lang, self.src_lang = cfg, opts, tgt_lang, src_lang
        self.engine = load_engine(checkpoints, engine, device, num_threads, cfg.compute_type, cache)

    def shard_file(self, block: pa.Table) -> tuple[bytes, dict]:
        """A whole shard translated: its file and counts."""
        return shard_file(translate_block(self.engine, block, self.opts, self.cfg, self.tgt_lang, self.src_lang))


def translate_block(
    engine: Engine,
    block: pa.Table,
    opts: DecodeOptions,
    bt: BacktranslateConfig,
    tgt_lang: Optional[str] = None,
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
    for batch in token_batches([engine.length(e) for e in encoded], bt.shards.max_tokens):
        seed = _batch_seed(bt.seed, line_ids[todo[batch[0]]])
        batch_opts = dataclasses.replace(opts, seed=seed) if opts.sample else opts
        for j, [(score, text)] in zip(batch, engine.translate_ids([encoded[j] for j in batch], batch_opts)):
            i = todo[j]
            if bt.noise:
                text = noise_words(text, random.Random(f"{bt.seed}:{line_ids[i]}"), bt)
            outputs[i], scores[i] = text.replace("\n", " "), score
    return pa.table(
        {
            "line_id": pa.array(line_ids, pa.int64()),
            "input": pa.array([t or "" for t in texts], pa.string()),
            "output": pa.array(outputs, pa.string()),
            "score": pa.array(scores, pa.float64()),
            "status": pa.array(status, pa.int8()),
        }
    )


def check_args(cfg: BacktranslateConfig) -> Job:
    """Everything that can be wrong with the job beside its config's values, checked before Ray
    starts: the model and directions, the input, the output and its record; what is left to do."""
    model = load_model_info(cfg.checkpoint)  # several: an ensemble, checked (engines.check_ensemble)
    src_lang, tgt_lang, tags = directions(model, cfg.src_lang, cfg.tgt_lang)
    engine = resolve_engine(cfg.engine, model)  # an ensemble's: raymt's
    if engine == "ctranslate2":
        ct2_model_dir(model.location)  # exported once here: an unexportable model fails now
    else:
        for location in model.checkpoints:  # a corrupt or truncated weights file fails now, not in every actor
            load_weights(location)
    files = input_files(cfg.input)
    check_columns(files, cfg.column, src_lang.split("+")[0])
    output = storage.output_location(cfg.output, "--output")  # never into a job's package
    job = Job(output=output, cfg=cfg, model=model, engine=engine, langs=(src_lang, tgt_lang), tags=tags, files=files)
    old = check_output(job)
    job.info = old or {}  # the previous run's record until write_info replaces it
    job.text_done = text_complete(job)  # from the previous run's bt.json, before this run's replaces it
    count_inputs(job, old)
    offset = 0
    for f in files:
        f.first_line, offset = offset, offset + f.num_lines
    job.find_done(META_KEY, "empty")
    return job


# ---------------------------------------------------------------- running it


def run(cfg: BacktranslateConfig) -> Job:
    """Back-translate `cfg.input` into `cfg.output` on Ray actors (the shards a previous run left
    to do); the finished job (its bt.json: `job.info`). Raises a one-line ValueError on a user
    error and `raymt.shard_job.Unfinished` when shards are left to do."""
    return run_job(lambda: check_args(cfg), BacktranslateActor)[0]


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    return exit_status(PROG, run, lambda: parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
