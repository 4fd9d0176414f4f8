"""`python -m raymt.data prepare ...`: flags -> PrepareCommand (where, its inputs, PrepareConfig)
and `run` -> raymt.data.prepare; `python -m raymt.data score ...`: raymt.data.score_job;
`python -m raymt.data mono ...`: raymt.data.mono_clean."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from raymt import storage
from raymt.command import add_flags, flag, from_args, group, to_argv
from raymt.config import DataConfig, PrepareConfig, ScoreConfig, split_spec
from raymt.data import mono_clean, score_job
from raymt.data.format import PreparedCorpus
from raymt.data.mono_clean import MonoConfig
from raymt.data.score_job import add_score_parser
from raymt.errors import check, cli_error
from raymt.flags import InputFlags
from raymt.shard_job import exit_status

# What the input flags' help says of prepare (InputFlags.HELP_WORDS: train's).
PREPARE_WORDS = {
    "bare": "--src-(--tgt) (PREFIX.<src>, PREFIX.<tgt>, optionally .gz/.xz/.zst)",
    "pairs_of": "the built-in corpus or --dataset",
}


@dataclass(kw_only=True)
class PrepareCommand:
    """`raymt data prepare`: where the corpus goes, its inputs (the input flags `raymt train` has,
    and the files, columns and named dataset only prepare reads) and its settings (PrepareConfig);
    the flags' checks (`check_prepare_flags`) before any input is read."""

    out: str = flag(
        help="output directory or URI such as s3://bucket/corpus (made whole, or not at all)", required=True
    )
    src_file: list[str] = flag(help="training source file (repeatable)", repeat=True)
    tgt_file: list[str] = flag(help="training target file, paired in order", repeat=True)
    inputs: InputFlags = group(InputFlags, words=PREPARE_WORDS)
    test_name: list[str] = flag(
        help="names of the test sets, in order (default: the basename of each SPEC)", repeat=True, metavar="NAME"
    )
    src_col: Optional[str] = flag(None, "TSV column number, or JSONL key / Parquet column (default: --src)")
    tgt_col: Optional[str] = flag(None, "TSV column number, or JSONL key / Parquet column (default: --tgt)")
    dataset: Optional[str] = flag(None, "a named public corpus (downloaded and cached), or 'builtin'")
    mirror: Optional[str] = flag(None, "with --dataset: a mirror URL to download from")
    cache_dir: Optional[str] = flag(None, "with --dataset: download cache (default $RAYMT_CACHE or ~/.cache/raymt)")
    options: PrepareConfig = group(PrepareConfig)
    overwrite: bool = flag(False, "replace a corpus already in --out")

    def __post_init__(self) -> None:
        check_prepare_flags(self)


def prepare_parser() -> argparse.ArgumentParser:
    """Flags of `python -m raymt.data prepare` (PrepareCommand's), of `score` and of `mono`."""
    p = argparse.ArgumentParser(prog="python -m raymt.data", allow_abbrev=False, description="Corpus tools for raymt.")
    sub = p.add_subparsers(dest="command", required=True)
    prepare_help = "raw parallel corpora -> SentencePiece model and Parquet shards"
    add_command(
        sub, "prepare", PrepareCommand, prepare_help, "Clean, tokenize and shard parallel corpora with Ray Data."
    )
    add_score_parser(sub)
    add_command(sub, "mono", MonoConfig, mono_clean.HELP, (mono_clean.__doc__ or "").split("\n\n")[0])
    return p


def add_command(sub: Any, name: str, cls: type, help: str, description: str) -> None:
    """A subcommand of `python -m raymt.data` whose flags are the fields of config class `cls`."""
    add_flags(sub.add_parser(name, allow_abbrev=False, help=help, description=description), cls)


def prepare_inputs(cfg: PrepareCommand) -> list:
    """The corpora `cfg` names, read as `raymt train` reads them (`InputFlags.corpora`), with their
    sources (`sources.CorpusInput`): the --src/--tgt pair without a --train SPEC takes its pairs
    from --src-file/--tgt-file or --dataset, as --pairs takes the built-in corpus's."""
    from raymt.data.sources import Source, corpus_inputs

    options, inputs = cfg.options, cfg.inputs
    pair = (options.src_lang, options.tgt_lang)
    files = [Source("text", p) for p in zip(cfg.src_file, cfg.tgt_file)]
    unnamed = [pair] if (files or cfg.dataset is not None) and not inputs.train else []
    corpora = inputs.corpora(pair, unnamed, builtin_langs=cfg.dataset in (None, "builtin") and not files)
    names = {split_spec(s, "--test")[1]: name for s, name in zip(inputs.test, cfg.test_name)}

    def splits(spec, corpus_cfg: PrepareConfig) -> dict:
        return dataset_sources(cfg.dataset or "builtin", corpus_cfg, cfg.cache_dir, cfg.mirror)

    return corpus_inputs(corpora, options, splits, cfg.src_col, cfg.tgt_col, names, files)


def check_prepare_flags(cfg: PrepareCommand) -> None:
    """One-line errors for the flags only `raymt data prepare` has (--src-file/--tgt-file,
    --test-name, --dataset), before any input is read."""
    inputs = cfg.inputs
    given = cfg.mirror or cfg.cache_dir
    check(cfg.dataset is not None or not given, "--mirror and --cache-dir only apply with --dataset")
    check(
        len(cfg.test_name) <= len(inputs.test),
        f"{len(cfg.test_name)} --test-name for {len(inputs.test)} --test: one name per test set",
    )
    check(
        len(cfg.src_file) == len(cfg.tgt_file),
        f"--src-file given {len(cfg.src_file)} time(s) but --tgt-file {len(cfg.tgt_file)}: pass them in pairs",
    )
    if labeled(inputs):
        check(not cfg.src_file, "--src-file/--tgt-file name one pair: with several, pass --train SRC-TGT:PREFIX")
        check(
            cfg.dataset is None or bool(inputs.pairs),
            "--dataset with several corpora: name its pairs with --pairs SRC-TGT,...",
        )
    elif cfg.dataset is not None:
        check(
            not (inputs.train or cfg.src_file),
            "--dataset and --train/--src-file both name training data: pass one of them",
        )
    elif not (inputs.train or cfg.src_file):
        raise ValueError("no training data: pass --train PREFIX|FILE, --src-file/--tgt-file, or --dataset NAME")
    elif not inputs.valid:
        raise ValueError("--valid is missing: pass a validation prefix or file (all of it is scored)")


def labeled(inputs: InputFlags) -> bool:
    """Whether the input flags name corpora with their languages (--bt, --pairs, --real-weight or
    a SRC-TGT: SPEC), not only the --src/--tgt pair."""
    specs = [("--train", s) for s in inputs.train] + [("--valid", s) for s in inputs.valid]
    specs += [("--test", s) for s in inputs.test]
    many = bool(inputs.bt or inputs.pairs) or inputs.real_weight is not None  # --real-weight alone: its error
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


def run(cfg: PrepareCommand) -> PreparedCorpus:
    """Prepare the corpora `cfg` names into `cfg.out` (`raymt.data.prepare.prepare_corpora`, which
    records this command line); returns the prepared corpus."""
    from raymt.data.prepare import prepare_corpora

    out = storage.output_location(cfg.out, "--out")  # never into a `ray job submit` job's package
    command = shlex.join(["python", "-m", "raymt.data", "prepare", *to_argv(cfg)])
    manifest = prepare_corpora(cfg.options, out, prepare_inputs(cfg), overwrite=cfg.overwrite, command=command)
    return PreparedCorpus(out, manifest)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `python -m raymt.data`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = prepare_parser().parse_args(argv)
    if args.command == "score":
        return exit_status(score_job.PROG, score_job.run, lambda: from_args(ScoreConfig, args))
    if args.command == "mono":
        return exit_status(mono_clean.PROG, mono_clean.run, lambda: from_args(MonoConfig, args))
    try:
        run(from_args(PrepareCommand, args))
    except ValueError as err:
        return cli_error("raymt.data", " ".join(str(err).split("\n")))  # one line, whatever the source
    return 0


if __name__ == "__main__":
    sys.exit(main())
