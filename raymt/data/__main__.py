"""`python -m raymt.data prepare ...`: flags -> PrepareConfig and sources -> raymt.data.prepare;
`python -m raymt.data score ...`: raymt.data.score_job."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import typing
from pathlib import Path
from typing import Optional

from raymt import storage
from raymt.command import from_args
from raymt.config import DataConfig, PrepareConfig, ScoreConfig, parse_value, split_spec
from raymt.data import score_job
from raymt.data.score_job import add_score_parser
from raymt.errors import cli_error
from raymt.flags import add_input_flags, corpora_from_args
from raymt.shard_job import exit_status

# Flags whose names differ from their PrepareConfig field.
FLAG_NAMES = {"src_lang": "src", "tgt_lang": "tgt"}


def prepare_parser() -> argparse.ArgumentParser:
    """Flags of `python -m raymt.data prepare` (every option names a PrepareConfig field) and of `score`."""
    p = argparse.ArgumentParser(prog="python -m raymt.data", allow_abbrev=False, description="Corpus tools for raymt.")
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser(
        "prepare",
        allow_abbrev=False,
        help="raw parallel corpora -> SentencePiece model and Parquet shards",
        description="Clean, tokenize and shard parallel corpora with Ray Data.",
    )
    q.add_argument(
        "--out", required=True, help="output directory or URI such as s3://bucket/corpus (made whole, or not at all)"
    )
    q.add_argument("--src-file", action="append", default=[], help="training source file (repeatable)")
    q.add_argument("--tgt-file", action="append", default=[], help="training target file, paired in order")
    add_input_flags(
        q, "--src-(--tgt) (PREFIX.<src>, PREFIX.<tgt>, optionally .gz/.xz/.zst)", "the built-in corpus or --dataset"
    )
    q.add_argument(
        "--test-name",
        action="append",
        default=[],
        metavar="NAME",
        help="names of the test sets, in order (default: the basename of each SPEC)",
    )
    q.add_argument("--src-col", help="TSV column number, or JSONL key / Parquet column (default: --src)")
    q.add_argument("--tgt-col", help="TSV column number, or JSONL key / Parquet column (default: --tgt)")
    q.add_argument("--dataset", help="a named public corpus (downloaded and cached), or 'builtin'")
    q.add_argument("--mirror", help="with --dataset: a mirror URL to download from")
    q.add_argument("--cache-dir", help="with --dataset: download cache (default $RAYMT_CACHE or ~/.cache/raymt)")
    for f in dataclasses.fields(PrepareConfig):
        flag = "--" + FLAG_NAMES.get(f.name, f.name).replace("_", "-")
        if f.type in (bool, "bool") and f.default:
            flag = "--no-" + flag[2:]
            q.add_argument(flag, dest=f.name, action="store_false", default=None, help=f"unsets {f.name}")
        elif f.type in (bool, "bool"):
            q.add_argument(flag, dest=f.name, action="store_true", help=f"sets {f.name}")
        else:
            q.add_argument(flag, dest=f.name, help=f"{f.name} (default {f.default})")
    q.add_argument("--overwrite", action="store_true", help="replace a corpus already in --out")
    add_score_parser(sub)
    return p


def prepare_config(args: argparse.Namespace) -> PrepareConfig:
    """PrepareConfig from the flags, typed and validated field by field."""
    hints = typing.get_type_hints(PrepareConfig)
    values = {}
    for f in dataclasses.fields(PrepareConfig):
        raw = getattr(args, f.name)
        if raw is None or raw is f.default:
            continue
        flag = "--" + FLAG_NAMES.get(f.name, f.name).replace("_", "-")
        values[f.name] = raw if isinstance(raw, bool) else parse_value(raw, hints[f.name], flag)
    return PrepareConfig(**values)


def flag_corpora(args: argparse.Namespace, cfg: PrepareConfig) -> list:
    """The corpora the flags name, read as `raymt train` reads them (`raymt.flags.corpora_from_args`),
    with their sources (`sources.CorpusInput`): the --src/--tgt pair without a --train SPEC takes
    its pairs from --src-file/--tgt-file or --dataset, as --pairs takes the built-in corpus's."""
    from raymt.data.sources import Source, corpus_inputs

    check_prepare_flags(args)
    pair = (cfg.src_lang, cfg.tgt_lang)
    files = [Source("text", p) for p in zip(args.src_file, args.tgt_file)]
    unnamed = [pair] if (files or args.dataset is not None) and not args.train else []
    corpora = corpora_from_args(args, pair, unnamed, builtin_langs=args.dataset in (None, "builtin") and not files)
    names = {split_spec(s, "--test")[1]: name for s, name in zip(args.test, args.test_name)}

    def splits(spec, corpus_cfg: PrepareConfig) -> dict:
        return dataset_sources(args.dataset or "builtin", corpus_cfg, args.cache_dir, args.mirror)

    return corpus_inputs(corpora, cfg, splits, args.src_col, args.tgt_col, names, files)


def check_prepare_flags(args: argparse.Namespace) -> None:
    """One-line errors for the flags only `raymt data prepare` has (--src-file/--tgt-file,
    --test-name, --dataset), before any input is read."""
    if (args.mirror or args.cache_dir) and args.dataset is None:
        raise ValueError("--mirror and --cache-dir only apply with --dataset")
    if len(args.test_name) > len(args.test):
        raise ValueError(f"{len(args.test_name)} --test-name for {len(args.test)} --test: one name per test set")
    if len(args.src_file) != len(args.tgt_file):
        raise ValueError(
            f"--src-file given {len(args.src_file)} time(s) but --tgt-file {len(args.tgt_file)}: pass them in pairs"
        )
    if labeled(args):
        if args.src_file:
            raise ValueError("--src-file/--tgt-file name one pair: with several, pass --train SRC-TGT:PREFIX")
        if args.dataset is not None and not args.pairs:
            raise ValueError("--dataset with several corpora: name its pairs with --pairs SRC-TGT,...")
    elif args.dataset is not None:
        if args.train or args.src_file:
            raise ValueError("--dataset and --train/--src-file both name training data: pass one of them")
    elif not (args.train or args.src_file):
        raise ValueError("no training data: pass --train PREFIX|FILE, --src-file/--tgt-file, or --dataset NAME")
    elif not args.valid:
        raise ValueError("--valid is missing: pass a validation prefix or file (all of it is scored)")


def labeled(args: argparse.Namespace) -> bool:
    """Whether the flags name corpora with their languages (--bt, --pairs, --real-weight or a
    SRC-TGT: SPEC), not only the --src/--tgt pair."""
    specs = [("--train", s) for s in args.train] + [("--valid", s) for s in args.valid]
    specs += [("--test", s) for s in args.test]
    many = bool(args.bt or args.pairs) or args.real_weight is not None  # --real-weight alone: its error
    return many or any(split_spec(s, flag)[0] is not None for flag, s in specs)


def dataset_sources(name: str, cfg: PrepareConfig, cache_dir: Optional[str], mirror: Optional[str]) -> dict:
    """Split name -> Source of a named corpus: 'builtin' (generated) or a download (raymt.data.download)."""
    from raymt.data.sources import Source

    if name == "builtin":
        from raymt.data import builtin

        return builtin.sources(
            cfg.src_lang, cfg.tgt_lang, DataConfig.builtin_train_size, DataConfig.builtin_eval_size, cfg.seed
        )
    from raymt.data.download import fetch_dataset

    cache = Path(cache_dir or os.environ.get("RAYMT_CACHE") or "~/.cache/raymt").expanduser()
    files = fetch_dataset(name, cfg.src_lang, cfg.tgt_lang, cache, mirror)
    missing = {"train", "valid"} - set(files)
    if missing:
        raise ValueError(f"dataset {name!r} has no {' or '.join(sorted(missing))} split: pass --valid")
    return {split: Source("text", tuple(map(str, paths))) for split, paths in files.items()}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `python -m raymt.data`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = prepare_parser().parse_args(argv)
    if args.command == "score":
        return exit_status(score_job.PROG, score_job.run, lambda: from_args(ScoreConfig, args))
    try:
        from raymt.data.prepare import prepare_corpora

        out = storage.output_location(args.out, "--out")  # never into a `ray job submit` job's package
        cfg = prepare_config(args)
        command = shlex.join(["python", "-m", "raymt.data", *argv])
        prepare_corpora(cfg, out, flag_corpora(args, cfg), overwrite=args.overwrite, command=command)
    except ValueError as err:
        return cli_error("raymt.data", " ".join(str(err).split("\n")))  # one line, whatever the source
    return 0


if __name__ == "__main__":
    sys.exit(main())
