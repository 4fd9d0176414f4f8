"""A prepare's two passes, in the driver or with Ray Data: training shards in order, token index, eval sets."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raymt.config import PrepareConfig
from raymt.data.clean import (
    DROP_RULES,
    Tally,
    all_dropped,
    dedup_partitions,
    deduplicate,
    merge_samples,
    read_counts,
    read_inputs,
    sample_inputs,
    tokenize_block,
)
from raymt.data.format import COLUMNS, MAX_BLOCK_BYTES, TRAIN_DIR, token_index
from raymt.data.sources import BLOCK_ROWS, Source, read_eval
from raymt.data.text import input_file_info

# Training inputs up to these sizes (the built-in corpus, a notebook's lists, Multi30k's 1.2 MB
# of gzipped text) are prepared in the driver: starting Ray Data's tasks and actors takes
# longer than tokenizing them (benchmarks/NOTES.md, "The test suite's time").
DRIVER_PAIRS = 50_000  # pairs given in memory

DRIVER_BYTES = 2 << 20  # bytes of input files, as stored (compressed or not)


def _driver_node() -> dict[str, str]:
    """A label selector for this machine, where local inputs are and the output is written."""
    import ray

    return {"ray.io/node-id": ray.get_runtime_context().get_node_id()}


def _inputs_dataset(specs: list[dict]):
    """One row (and one block, so one read task) per input.

    Its reading tasks (passes 1 and 2) exit their worker process after their input (max_calls=1):
    Ray reuses worker processes, and Python keeps memory a task freed (pass 1's sample of up to
    sp_sample_size pairs), which the next tasks in that process (reading, tokenizing) then held,
    more the larger the corpus (benchmarks/scale.py). A process start per input costs a second.
    """
    import ray.data

    return ray.data.from_items([{"idx": i} for i in range(len(specs))], override_num_blocks=len(specs))


def _sample(cfg: PrepareConfig, specs: list[dict]) -> tuple[list[str], Counter]:
    """Pass 1: read and clean every input; the sampled sentences (src then tgt) and the counts."""
    k = cfg.sp_sample_size
    ds = _inputs_dataset(specs).map_batches(
        sample_inputs,
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={"specs": specs, "cfg": cfg, "k": k},
        label_selector=_driver_node(),
        max_calls=1,  # its worker process exits after its input: see _inputs_dataset
    )
    return merge_samples(ds.iter_batches(batch_size=None, batch_format="pyarrow"), k)


def _sample_here(cfg: PrepareConfig, specs: list[dict]) -> tuple[list[str], Counter]:
    """Pass 1 in the driver (`in_driver` inputs): the same sample and counts as `_sample`."""
    inputs = pa.table({"idx": pa.array(range(len(specs)), pa.int64())})
    sampled = sample_inputs(inputs, specs, cfg, cfg.sp_sample_size)
    return merge_samples(iter([sampled]), cfg.sp_sample_size)


def first_pass(cfg: PrepareConfig, specs: list[dict], here: bool) -> tuple[list[str], Counter]:
    """Pass 1 over one corpus's training inputs, in the driver when `here` (`in_driver`), else with
    Ray Data: the sampled sentences (src then tgt) and the counts."""
    return (_sample_here if here else _sample)(cfg, specs)


def in_driver(inputs: list[dict]) -> bool:
    """Whether the training inputs (`check_corpus_inputs`' descriptions) are small enough to prepare in
    the driver, without Ray Data."""
    train = [i for i in inputs if i["split"] == "train"]
    pairs = sum(i["num_pairs"] for i in train if i["kind"] == "pairs")
    size = sum(f["size"] for i in train for f in i.get("files", []))
    return pairs <= DRIVER_PAIRS and size <= DRIVER_BYTES


def _shard_names():
    """A FilenameProvider whose names sort in dataset order: <write uuid>_<task index>-<file>."""
    from ray.data.datasource import FilenameProvider

    class ShardNames(FilenameProvider):
        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"{write_uuid}_{task_index:06d}.parquet"

    return ShardNames()


def _write_train(
    cfg: PrepareConfig,
    specs: list[dict],
    model_proto: bytes,
    train_dir: Path,
    tally: Any,
    prefix_ids: Sequence[int] = (),
    num_pairs: int = 0,
) -> None:
    """Pass 2: read, tokenize in parallel tasks, filter, de-duplicate (partitioned by hash, for
    `num_pairs` input pairs) and write Parquet shards (`prefix_ids` before every source)."""
    partitions, buckets = dedup_partitions(num_pairs)
    ds = _tokenized(cfg, specs, model_proto, tally, prefix_ids, buckets)
    if cfg.dedup or cfg.near_dedup:
        # Ray Data's hash shuffle brings each bucket's pairs, from every tokenizing task, to one
        # task of its partition, on any node; each partition's state is its pairs, not the corpus's.
        ds = ds.groupby("bucket", num_partitions=partitions).map_groups(
            deduplicate, batch_format="pyarrow", fn_kwargs={"tally": tally}
        )
    # The output directory is local: the shards are written on this machine too.
    ds.write_parquet(
        str(train_dir),
        min_rows_per_file=cfg.shard_pairs,
        max_rows_per_file=cfg.shard_pairs,
        filename_provider=_shard_names(),
        ray_remote_args={"label_selector": _driver_node()},
    )


def _tokenized(
    cfg: PrepareConfig, specs: list[dict], model_proto: bytes, tally: Any, prefix_ids: Sequence[int], buckets: int
):
    """Pass 2's dataset of tokenized, filtered blocks in input order, before de-duplication (into `buckets`)."""
    # Read tasks run on this machine, where local inputs are; one task reads a whole input.
    ds = _inputs_dataset(specs).map_batches(
        read_inputs,
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={"specs": specs, "cfg": cfg, "tally": tally},
        label_selector=_driver_node(),
        max_calls=1,  # its worker process exits after its input: see _inputs_dataset
    )
    # Blocks of BLOCK_ROWS pairs are tokenized by tasks anywhere in the cluster. A strict
    # repartition is its own operator: Ray Data fuses neither the reads nor the tokenizing
    # into it, so tokenizing is not stuck in the (sequential) task of one input.
    ds = ds.repartition(target_num_rows_per_block=BLOCK_ROWS, strict=True)
    ds = ds.map_batches(
        tokenize_block,
        batch_size=None,
        batch_format="pyarrow",
        fn_kwargs={
            "model_proto": model_proto,
            "cfg": cfg,
            "tally": tally,
            "prefix_ids": list(prefix_ids),
            "buckets": buckets,
        },
    )
    return ds


def _write_train_here(
    cfg: PrepareConfig,
    specs: list[dict],
    model_proto: bytes,
    train_dir: Path,
    tally: Tally,
    prefix_ids: Sequence[int] = (),
    num_pairs: int = 0,
) -> None:
    """Pass 2 in the driver (`in_driver` inputs): the pairs and files `_write_train` writes."""
    partitions, buckets = dedup_partitions(num_pairs)
    blocks = list(_tokenized_here(cfg, specs, model_proto, tally, prefix_ids, buckets))
    kept = pa.concat_tables(blocks) if blocks else pa.table({c: pa.array([], pa.list_(pa.int32())) for c in COLUMNS})
    if (cfg.dedup or cfg.near_dedup) and len(kept):
        # Bucket by bucket, as `_write_train`'s partitions (one bucket up to PARTITION_PAIRS: input order).
        bucket = kept.column("bucket").to_numpy()
        parts = [kept.filter(pa.array(bucket == b)) for b in range(buckets)]
        kept = pa.concat_tables([deduplicate(part, tally) for part in parts if len(part)])
    train_dir.mkdir(parents=True)
    for i, lo in enumerate(range(0, len(kept), cfg.shard_pairs)):  # named as _name_shards expects
        pq.write_table(kept.slice(lo, cfg.shard_pairs), train_dir / f"driver_000000-{i}.parquet")


def _tokenized_here(
    cfg: PrepareConfig, specs: list[dict], model_proto: bytes, tally: Tally, prefix_ids: Sequence[int], buckets: int
) -> Iterator[pa.Table]:
    """`_tokenized` in the driver: the tokenized, filtered blocks in input order."""
    inputs = pa.table({"idx": pa.array(range(len(specs)), pa.int64())})
    read = list(read_inputs(inputs, specs, cfg, tally))
    read = pa.concat_tables(read) if read else pa.table({"src": [], "tgt": []})
    for lo in range(0, len(read), BLOCK_ROWS):
        yield tokenize_block(read.slice(lo, BLOCK_ROWS), model_proto, cfg, tally, prefix_ids, buckets)


def _name_shards(train_dir: Path, shard_pairs: int, rel: str = TRAIN_DIR) -> list[dict]:
    """Rename the written files to part-00000.parquet ... in dataset order; their manifest entries
    (paths `rel`/part-...)."""

    def order(path: Path) -> tuple[int, int]:
        match = re.search(r"_(\d+)-(\d+)\.parquet$", path.name)
        assert match, f"unexpected file {path} written by Ray Data"
        return int(match.group(1)), int(match.group(2))

    files = []
    for i, path in enumerate(sorted(train_dir.glob("*.parquet"), key=order)):
        dest = train_dir / f"part-{i:05d}.parquet"
        path.rename(dest)
        num_pairs = pq.ParquetFile(dest).metadata.num_rows
        if num_pairs > shard_pairs:
            raise RuntimeError(f"Ray Data wrote {num_pairs} rows to {dest}, over shard_pairs={shard_pairs}")
        files.append(
            {
                "path": f"{rel}/{dest.name}",
                "num_pairs": num_pairs,
                "sha256": _sha256_file(dest),
                "token_index": _shard_token_index(dest),
            }
        )
    return files


def _shard_token_index(path: Path) -> list[int]:
    """The shard's cumulative src + tgt tokens every TOKEN_INDEX_ROWS rows (raymt.data.format)."""
    table = pq.read_table(path, columns=COLUMNS)
    lengths = sum(pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in COLUMNS)
    return token_index(lengths)


def _sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_split(
    cfg: PrepareConfig,
    specs: list[dict],
    model_proto: bytes,
    tmp: Path,
    rel: str,
    here: bool,
    first: Optional[dict],
    prefix_ids: Sequence[int] = (),
    where: str = "",
) -> dict:
    """Pass 2 over one corpus's inputs into tmp/`rel` (`prefix_ids` before every source); the
    manifest's train entry, checked against pass 1's counts (`first`, when it ran)."""
    import ray

    num_pairs = first["input"] if first is not None else _estimated_pairs(specs)
    if here:
        tally = Tally()
        _write_train_here(cfg, specs, model_proto, tmp / rel, tally, prefix_ids, num_pairs)
        counts = tally.total()
    else:
        tally = ray.remote(num_cpus=0)(Tally).remote()
        try:
            _write_train(cfg, specs, model_proto, tmp / rel, tally, prefix_ids, num_pairs)
            counts = ray.get(tally.total.remote())
        finally:
            ray.kill(tally)
    if first is not None and any(first.get(c, 0) != n for c, n in read_counts(counts).items()):
        raise ValueError("the training inputs changed while they were being prepared: run again")
    dropped = {rule: counts.get(rule, 0) for rule in DROP_RULES}
    kept = counts.get("input", 0) - sum(dropped.values())
    if kept == 0:
        raise all_dropped(counts.get("input", 0), dropped, where)
    files = _name_shards(tmp / rel, cfg.shard_pairs, rel)
    assert kept == sum(f["num_pairs"] for f in files), (kept, files)
    return {
        "files": files,
        "num_pairs": kept,
        "src_tokens": counts.get("src_tokens", 0),
        "tgt_tokens": counts.get("tgt_tokens", 0),
        "input_pairs": counts.get("input", 0),
        "dropped": dropped,
    }


# Stored bytes per input pair, to estimate a corpus's size (de-duplication's partitions) when
# pass 1 did not count it: low, for compressed text, so that partitions come out small.
BYTES_PER_PAIR = 40


def _estimated_pairs(specs: list[dict]) -> int:
    """About how many pairs the inputs hold, from their sizes (pass 1, which counts them, runs
    only when there is no tokenizer to start from)."""
    pairs = sum(len(spec["pairs"][0]) for spec in specs if spec["kind"] == "pairs")
    uris = [uri for spec in specs if spec["kind"] != "pairs" for uri in spec["paths"]]
    return pairs + sum(input_file_info(uri).size for uri in uris) // BYTES_PER_PAIR


def eval_split(cfg: PrepareConfig, sources: list[Source], path: Path) -> int:
    """Read a validation/test set on the driver and write it whole (stripped, nothing dropped)."""
    src, tgt = read_eval(cfg, sources)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"src": pa.array(src, pa.string()), "tgt": pa.array(tgt, pa.string())}), path)
    return len(src)


SHUFFLE_BATCH_BYTES = 4 * MAX_BLOCK_BYTES


def _only_warnings(record: logging.LogRecord) -> bool:
    """Log filter: Ray Data's warnings reach the terminal, its info and error chatter does not."""
    # Progress bars are off on purpose (below): no need to say so.
    return record.levelno == logging.WARNING and not record.getMessage().startswith("Progress bars")


@contextlib.contextmanager
def ray_data_settings() -> Iterator[None]:
    """Ordered execution (shard order), small blocks, a quiet terminal.

    Errors still raise (ours as one line) and Ray Data's log file keeps everything; on the
    terminal it would print each of our input errors again with a traceback.
    """
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = (
        ctx.execution_options.preserve_order,
        ctx.enable_progress_bars,
        ctx.target_max_block_size,
        ctx.shuffle_input_batch_bytes,
    )
    ctx.execution_options.preserve_order = True
    ctx.target_max_block_size = MAX_BLOCK_BYTES  # task memory independent of input sizes
    # A shuffle map task of de-duplication takes blocks up to this size (Ray's default 1 GiB:
    # its memory grew with the corpus up to that); fewer would mean more, smaller shuffle objects.
    ctx.shuffle_input_batch_bytes = SHUFFLE_BATCH_BYTES
    ctx.enable_progress_bars = False  # our progress lines and final table say enough
    terminals = [h for h in logging.getLogger("ray.data").handlers if isinstance(h, logging.StreamHandler)]
    for handler in terminals:
        handler.addFilter(_only_warnings)
    try:
        yield
    finally:
        (
            ctx.execution_options.preserve_order,
            ctx.enable_progress_bars,
            ctx.target_max_block_size,
            ctx.shuffle_input_batch_bytes,
        ) = saved
        for handler in terminals:
            handler.removeFilter(_only_warnings)
