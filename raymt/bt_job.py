"""A back-translation job (`Job`, run by `raymt.shard_job.run_job`): its record in its output
(`bt.json`, the shard files, what is left to do) and its reader of the input's shards.

`raymt backtranslate` (raymt.backtranslate) checks its config into a `Job` before Ray starts. The
input's line ids are cut into shards of `--shard-lines`; shard k becomes
`part-<first line id>.parquet` (line_id, input, output, score; its counts in the schema's
metadata), written whole: a temporary name renamed, or one object PUT. `bt.json` names the
settings that fix the outputs (a rerun with others is refused), the input's line counts, the
totals and `done`. A rerun verifies the shard files there (row counts) and redoes the rest;
`--format text` then writes `text.<src>` and `text.<tgt>` from the shards, whole or not at all.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymt import storage
from raymt.config import BacktranslateConfig, DecodeOptions, ShardJobOptions
from raymt.data.mono import InputFile, changed_error, count_lines, default_column, raw_items, text_of
from raymt.engines import ModelInfo
from raymt.shard_job import Progress, SettingsRecord, ShardJob, shard_bytes

INFO_FILE = "bt.json"
INFO_FORMAT = "raymt-bt/1"
META_KEY = b"raymt.bt"  # Parquet schema metadata of a shard: its counts
STATUS_OK, STATUS_EMPTY, STATUS_INVALID = 0, 1, 2
COUNTS = ("translated", "empty", "invalid")
NOISE_FIELDS = ("noise", "noise_delete", "noise_replace", "noise_swap", "noise_filler")
OUT_SCHEMA = pa.schema(
    [("line_id", pa.int64()), ("input", pa.string()), ("output", pa.string()), ("score", pa.float64())]
)


@dataclass(kw_only=True)
class Job(ShardJob):
    """Everything checked before Ray starts: the model, input, output and what is left to do."""

    name, unit, rate_unit = "backtranslate", "lines", "sentences/s"
    cfg: BacktranslateConfig
    model: ModelInfo
    engine: str
    tags: list[str]
    files: list[InputFile]
    info: dict = field(default_factory=dict)  # bt.json: the previous run's until write_info replaces it
    text_done: bool = False  # the previous run wrote the text files whole (`text_complete`)

    @property
    def options(self) -> ShardJobOptions:
        """--shard-lines, --max-tokens and the actors' flags."""
        return self.cfg.shards

    @property
    def opts(self) -> DecodeOptions:
        """The decoding options: sampling seeded by --seed."""
        return self.cfg.decode_options()

    def record(self, done: bool = False) -> dict:
        """bt.json (`write_info`)."""
        write_info(self, done)
        return self.info

    def shard_inputs(self) -> Iterator[tuple[int, pa.Table]]:
        """The shards to do in line-id order, each one table (line_id, text; text null when invalid),
        read file by file in this process: one shard in memory at a time, whatever the files' sizes.
        A shard may span files; files without a shard to do are not opened."""
        shard_lines, todo = self.options.shard_lines, set(self.todo)
        src_lang = self.src_lang.split("+")[0]
        ids: list[int] = []
        texts: list[Optional[str]] = []
        for f in self.files:
            first, end = f.first_line, f.first_line + f.num_lines
            if not any(s in todo for s in range(first // shard_lines, -(-end // shard_lines))):
                continue
            col = default_column(f.kind, self.cfg.column, src_lang)
            line_id = first
            for raw in raw_items(f, col):
                if line_id == end:
                    raise changed_error(f, "more")
                shard = line_id // shard_lines
                if shard in todo:  # the lines of done shards are not decoded
                    ids.append(line_id)
                    texts.append(text_of(raw, f.kind, col, line_id == first))
                    if len(ids) == self.shard_rows(shard):
                        yield (
                            shard,
                            pa.table({"line_id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())}),
                        )
                        ids, texts = [], []
                line_id += 1
            if line_id != end:
                raise changed_error(f, str(line_id - first))

    def actor_kwargs(self) -> dict:
        """A decoding actor's keywords: each loads the model (several: an ensemble)."""
        return {
            "cfg": self.cfg,
            "opts": self.opts,
            "checkpoints": self.model.checkpoints,
            "engine": self.engine,
            "tgt_lang": self.tgt_lang,
            "src_lang": self.src_lang.split("+")[0],  # an imported NLLB's source code (ModelInfo.source_tag)
            "cache": str(storage.cache_root()),
        }

    def note(self) -> str:
        """The engine and direction."""
        return f" ({self.engine} engine, {self.src_lang}->{self.tgt_lang})"

    def finish(self, progress: Progress) -> None:
        """--format text: the text files, again when shards were redone or the last ones were cut short."""
        if self.cfg.format == "text" and (progress.lines or not self.text_done):
            write_text(self)

    def summary(self, seconds: float, progress: Progress) -> str:
        """The last line: counts, wall time, decoding speed (Ray's start aside) and where the output is."""
        c = self.info["counts"]
        return (
            f"backtranslated {self.num_lines:,} lines {self.src_lang}->{self.tgt_lang} ({c['translated']:,} "
            f"translated, {c['empty']:,} empty, {c['invalid']:,} invalid; engine {self.engine}) in {seconds:.1f} s"
            f"{progress.rate()} -> {self.output}"
        )


def shard_file(table: pa.Table) -> tuple[bytes, dict]:
    """A translated shard's Parquet file (rows in line-id order, its counts in the schema's
    metadata) and its counts."""
    table = table.take(pa.compute.sort_indices(table, [("line_id", "ascending")]))
    status = table.column("status").to_pylist()
    counts = {
        "translated": status.count(STATUS_OK),
        "empty": status.count(STATUS_EMPTY),
        "invalid": status.count(STATUS_INVALID),
    }
    return shard_bytes(table.select(OUT_SCHEMA.names).cast(OUT_SCHEMA), META_KEY, counts), counts


def settings(job: Job) -> dict:
    """What fixes a job's outputs: a rerun into the same --output must have the same."""
    return {
        "checkpoint": job.model.location,
        "checkpoints": job.model.checkpoints,  # several: an ensemble (the first is "checkpoint")
        "engine": job.engine,
        "src_lang": job.src_lang,
        "tgt_lang": job.tgt_lang,
        "tags": job.tags,
        "decode": {k: v for k, v in job.opts.__dict__.items() if k != "use_cache"},
        "noise": {k: getattr(job.cfg, k) for k in NOISE_FIELDS},
        "seed": job.cfg.seed,
        "shard_lines": job.options.shard_lines,
        "input": {
            "spec": job.cfg.input,
            "column": job.cfg.column,
            "files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns} for f in job.files],
        },
    }


def _one_checkpoint(record: dict) -> dict:
    """A record older than ensembles names one checkpoint: the same as a list of it."""
    return {**record, "checkpoints": record.get("checkpoints", [record.get("checkpoint")])}


RECORD = SettingsRecord(
    INFO_FILE,
    "a back-translation",
    flags={
        "checkpoint": "--checkpoint",
        "checkpoints": "--checkpoint",
        "engine": "--engine",
        "src_lang": "--src-lang",
        "tgt_lang": "--tgt-lang",
        "tags": "--tgt-lang",
        "decode": "the decoding flags",
        "noise": "the --noise flags",
        "seed": "--seed",
        "shard_lines": "--shard-lines",
        "input": "--input (or its files changed)",
    },
    format=INFO_FORMAT,
    upgrade=_one_checkpoint,
)


def check_output(job: Job) -> Optional[dict]:
    """The existing bt.json of --output (None for a new job); a one-line error for other settings."""
    return RECORD.check(job.output, settings(job))


def count_inputs(job: Job, old: Optional[dict]) -> None:
    """Each input file's line count: from bt.json when the same files were counted before."""
    known = old.get("num_lines_per_file") if old else None
    if known and len(known) == len(job.files):
        for f, n in zip(job.files, known):
            f.num_lines = int(n)
        job.num_lines = sum(f.num_lines for f in job.files)
        return
    for f in job.files:
        f.num_lines = count_lines(f)
    job.num_lines = sum(f.num_lines for f in job.files)
    if job.num_lines == 0:
        raise ValueError(f"--input {job.cfg.input} has no lines")


def write_info(job: Job, done: bool = False) -> None:
    """bt.json: settings, line counts, totals so far and whether the job is complete."""
    job.info = {
        **settings(job),
        "num_lines": job.num_lines,
        "num_lines_per_file": [f.num_lines for f in job.files],
        "num_shards": job.num_shards,
        "shards_done": len(job.done),
        "counts": job.totals(COUNTS),
        "done": done,
        "text": text_names(job) if done and job.cfg.format == "text" else [],
    }
    RECORD.write(job.output, job.info)


# ---------------------------------------------------------------- --format text


def text_names(job: Job) -> list[str]:
    """The aligned text files of --format text: inputs and outputs."""
    return [f"text.{job.src_lang}", f"text.{job.tgt_lang}"]


def text_complete(job: Job) -> bool:
    """Whether bt.json (as the previous run left it) records the text files as written whole: a run
    killed while writing them left done false, whatever files it left behind."""
    names = text_names(job)
    recorded = job.info.get("done") is True and job.info.get("text") == names
    return recorded and all(storage.exists(storage.join(job.output, n)) for n in names)


def write_text(job: Job) -> None:
    """text.<src> and text.<tgt> from the shards in order, one shard in memory at a time; written
    under temporary names and moved into place only when both are complete."""
    names = text_names(job)
    if names[0] == names[1]:
        raise ValueError(f"--format text: source and target are both {job.src_lang}; read the Parquet shards instead")
    fs, _ = storage.filesystem(job.output)
    targets = [storage.filesystem(storage.join(job.output, n))[1] for n in names]
    temps = [t + ".tmp" for t in targets]
    try:
        with _text_output(fs, temps[0]) as src_out, _text_output(fs, temps[1]) as tgt_out:
            for shard in range(job.num_shards):
                _, path = storage.filesystem(job.shard_location(shard))
                with fs.open_input_file(path) as fh:
                    table = pq.read_table(fh, columns=["input", "output"])
                for column, out in (("input", src_out), ("output", tgt_out)):
                    out.write("".join(t.replace("\n", " ") + "\n" for t in table.column(column).to_pylist()))
    except BaseException:
        for tmp in temps:  # an object store completes a stream closed by an error: a partial object
            _delete_quietly(fs, tmp)
        raise
    for tmp, target in zip(temps, targets):
        fs.move(tmp, target)


def _text_output(fs: pafs.FileSystem, path: str) -> io.TextIOWrapper:
    """A writable UTF-8 text stream of a file or object (an object appears when closed)."""
    return io.TextIOWrapper(fs.open_output_stream(path, compression=None), encoding="utf-8")


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    """Delete a file or object if it is there."""
    try:
        fs.delete_file(path)
    except (OSError, pa.ArrowException):
        pass
