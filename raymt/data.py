"""Corpora on the driver and Ray Data datasets for the workers."""

from __future__ import annotations

import gzip
from pathlib import Path
import numpy as np
import pyarrow as pa

from raymt import corpus
from raymt.config import DataConfig
from raymt.tokenizer import EOS_ID, Tokenizer

Pairs = tuple[list[str], list[str]]


def _open_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file, gzipped or not, without line ends."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f]
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid UTF-8 (byte {err.start}); re-encode it as UTF-8") from None
    except (OSError, EOFError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None


def _resolve(prefix: str, lang: str) -> Path:
    """PREFIX.lang or PREFIX.lang.gz, whichever exists."""
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.is_file():
            return candidate
    raise ValueError(f"missing file {prefix}.{lang} (or .gz): corpus prefixes name "
                     f"PREFIX.<src_lang> and PREFIX.<tgt_lang>")


def read_parallel(prefix: str, src_lang: str, tgt_lang: str) -> Pairs:
    """Read PREFIX.src and PREFIX.tgt, checking that line i of one translates line i of the other."""
    src_path, tgt_path = _resolve(prefix, src_lang), _resolve(prefix, tgt_lang)
    src, tgt = _open_lines(src_path), _open_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
                         "line i of one must translate line i of the other")
    if not src:
        raise ValueError(f"{src_path} is empty")
    return src, tgt


def load_splits(cfg: DataConfig, seed: int) -> dict[str, Pairs]:
    """train/valid (and test when given) sentence pairs: the built-in corpus or files."""
    if cfg.train is None:
        return corpus.builtin_splits(cfg.src_lang, cfg.tgt_lang, cfg.builtin_train_size,
                                     cfg.builtin_eval_size, seed)
    splits = {"train": read_parallel(cfg.train, cfg.src_lang, cfg.tgt_lang),
              "valid": read_parallel(cfg.valid, cfg.src_lang, cfg.tgt_lang)}
    if cfg.test is not None:
        splits["test"] = read_parallel(cfg.test, cfg.src_lang, cfg.tgt_lang)
    return splits


def tokenize_batch(batch: pa.Table, model_proto: bytes, max_len: int) -> dict[str, np.ndarray]:
    """Ray Data `map_batches` function: text columns -> id lists, dropping over-long pairs."""
    tokenizer = Tokenizer(model_proto)  # tens of ms: cheaper than an actor pool here
    src = tokenizer.encode_batch(batch.column("src").to_pylist())
    tgt = tokenizer.encode_batch(batch.column("tgt").to_pylist())
    keep = [i for i in range(len(src)) if 0 < len(src[i]) < max_len and 0 < len(tgt[i]) < max_len]
    return {"src_ids": np.array([np.array(src[i] + [EOS_ID], dtype=np.int32) for i in keep] or [],
                                dtype=object),
            "tgt_ids": np.array([np.array(tgt[i], dtype=np.int32) for i in keep] or [], dtype=object)}


def train_dataset(pairs: Pairs, model_proto: bytes, max_len: int, num_blocks: int = 8,
                  cache: bool = True):
    """Ray Data dataset of tokenized training pairs, tokenized in parallel tasks."""
    import ray.data

    table = pa.table({"src": pairs[0], "tgt": pairs[1]})
    step = max(1, -(-len(table) // num_blocks))
    blocks = [table.slice(i, step) for i in range(0, len(table), step)]
    ds = ray.data.from_arrow(blocks).map_batches(
        tokenize_batch, batch_format="pyarrow", batch_size=None,
        fn_kwargs={"model_proto": model_proto, "max_len": max_len})
    # A small corpus is tokenized once instead of once per epoch.
    return ds.materialize() if cache else ds


def eval_rows(pairs: Pairs, tokenizer: Tokenizer, max_positions: int) -> list[dict]:
    """In-memory validation/test rows with their index, sorted by length to limit padding.

    Nothing is dropped: over-long sources are truncated for decoding, and every
    reference still counts in BLEU.
    """
    limit = max_positions - 2
    src_ids = tokenizer.encode_batch(pairs[0])
    tgt_ids = tokenizer.encode_batch(pairs[1])
    rows = [{"index": i, "src_ids": s[:limit] + [EOS_ID], "tgt_ids": t[:limit]}
            for i, (s, t) in enumerate(zip(src_ids, tgt_ids))]
    rows.sort(key=lambda r: (len(r["src_ids"]), len(r["tgt_ids"])))
    return rows

