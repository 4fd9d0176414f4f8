"""A back-translation job's record in its output: `bt.json`, the shard files, what is left to do.

`raymt backtranslate` (raymt.backtranslate) checks its flags into a `Job` before Ray starts. The
input's line ids are cut into shards of `--shard-lines`; shard k becomes
`part-<first line id>.parquet` (line_id, input, output, score; its counts in the schema's
metadata), written whole: a temporary name renamed, or one object PUT. `bt.json` names the
settings that fix the outputs (a rerun with others is refused), the input's line counts, the
totals and `done`. A rerun verifies the shard files there (row counts) and redoes the rest;
`--format text` then writes `text.<src>` and `text.<tgt>` from the shards, whole or not at all.
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass, field
from typing import Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymt import shard_job, storage
from raymt.config import BacktranslateConfig, DecodeOptions
from raymt.data.mono import InputFile, count_lines
from raymt.engines import ModelInfo
from raymt.shard_job import SHARD_PREFIX, shard_name

INFO_FILE = "bt.json"
INFO_FORMAT = "raymt-bt/1"
META_KEY = b"raymt.bt"  # Parquet schema metadata of a shard: its counts
STATUS_OK, STATUS_EMPTY, STATUS_INVALID = 0, 1, 2
NOISE_FIELDS = ("noise", "noise_delete", "noise_replace", "noise_swap", "noise_filler")
OUT_SCHEMA = pa.schema(
    [("line_id", pa.int64()), ("input", pa.string()), ("output", pa.string()), ("score", pa.float64())]
)


@dataclass
class Job:
    """Everything checked before Ray starts: the model, input, output and what is left to do."""

    args: argparse.Namespace
    bt: BacktranslateConfig
    opts: DecodeOptions
    model: ModelInfo
    engine: str
    src_lang: str
    tgt_lang: str
    tags: list[str]
    files: list[InputFile]
    output: str
    info: dict  # bt.json
    done: dict[int, dict] = field(default_factory=dict)  # shard -> its counts, for verified shard files
    todo: list[int] = field(default_factory=list)

    @property
    def num_lines(self) -> int:
        """Lines of the whole input."""
        return sum(f.num_lines for f in self.files)

    @property
    def num_shards(self) -> int:
        """Output shards of the whole input."""
        return -(-self.num_lines // self.bt.shard_lines)

    def shard_rows(self, shard: int) -> int:
        """Lines of shard `shard` (the last one may be short)."""
        return min(self.bt.shard_lines, self.num_lines - shard * self.bt.shard_lines)


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
    out = table.select(OUT_SCHEMA.names).cast(OUT_SCHEMA).replace_schema_metadata({META_KEY: json.dumps(counts)})
    buf = io.BytesIO()
    pq.write_table(out, buf)
    return buf.getvalue(), counts


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
        "noise": {k: getattr(job.bt, k) for k in NOISE_FIELDS},
        "seed": job.bt.seed,
        "shard_lines": job.bt.shard_lines,
        "input": {
            "spec": job.args.input,
            "column": job.args.column,
            "files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns} for f in job.files],
        },
    }


SETTING_FLAGS = {
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
}


def check_output(job: Job) -> Optional[dict]:
    """The existing bt.json of --output (None for a new job); a one-line error for other settings."""
    location = job.output
    kind = storage.file_type(location)
    if kind == pafs.FileType.File:
        raise ValueError(f"--output {location} is a file: pass a directory (or a URI prefix)")
    old = storage.optional_bytes(storage.join(location, INFO_FILE))
    if old is None:
        if kind == pafs.FileType.Directory and any(n.startswith(SHARD_PREFIX) for n in storage.listdir(location)):
            raise ValueError(f"--output {location} holds shards but no {INFO_FILE}: pass a new --output")
        return None
    try:
        info = json.loads(old)
        assert info.get("format") == INFO_FORMAT
    except (json.JSONDecodeError, AssertionError, AttributeError):
        raise ValueError(f"{storage.join(location, INFO_FILE)} is not a raymt back-translation record") from None
    info.setdefault("checkpoints", [info.get("checkpoint")])  # a record older than ensembles names one
    now = settings(job)
    differ = [k for k in now if info.get(k) != now[k]]
    if differ:
        names = ", ".join(dict.fromkeys(SETTING_FLAGS[k] for k in differ))
        raise ValueError(
            f"--output {location} holds a back-translation with other settings ({names}): rerun it with "
            "the same flags to finish it, or pass a new --output"
        )
    return info


def count_inputs(job: Job, old: Optional[dict]) -> None:
    """Each input file's line count: from bt.json when the same files were counted before."""
    known = old.get("num_lines_per_file") if old else None
    if known and len(known) == len(job.files):
        for f, n in zip(job.files, known):
            f.num_lines = int(n)
        return
    for f in job.files:
        f.num_lines = count_lines(f)
    if job.num_lines == 0:
        raise ValueError(f"--input {job.args.input} has no lines")


def find_done(job: Job) -> None:
    """Verify the shard files already written (row counts); the rest, and broken ones, are to do."""
    job.done, job.todo = shard_job.find_done(
        job.output, job.num_shards, job.bt.shard_lines, job.num_lines, META_KEY, "empty"
    )


def write_info(job: Job, done: bool = False) -> None:
    """bt.json: settings, line counts, totals so far and whether the job is complete."""
    totals = {"translated": 0, "empty": 0, "invalid": 0}
    for counts in job.done.values():
        for key in totals:
            totals[key] += int(counts.get(key, 0))
    info = {
        "format": INFO_FORMAT,
        **settings(job),
        "num_lines": job.num_lines,
        "num_lines_per_file": [f.num_lines for f in job.files],
        "num_shards": job.num_shards,
        "shards_done": len(job.done),
        "counts": totals,
        "done": done,
        "text": text_names(job) if done and job.args.format == "text" else [],
    }
    job.info = info
    storage.write_bytes(storage.join(job.output, INFO_FILE), json.dumps(info, indent=2).encode())


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
                _, path = storage.filesystem(storage.join(job.output, shard_name(shard * job.bt.shard_lines)))
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
