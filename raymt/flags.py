"""The flags shared by `raymt train` and `raymt tune`, and the config they build: defaults <
device defaults < preset < config file < flags < --set (`build_config`); the decoding flags of
translate, evaluate, backtranslate and serve (`add_decode_flags`, `decode_options`)."""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

from raymt.config import (
    ONE_PAIR_FIELDS,
    SCHEDULE_FIELDS,
    Config,
    CorpusSpec,
    DecodeOptions,
    apply_overrides,
    check_training,
    device_defaults,
    flatten,
    load_file,
    one_pair,
    parse_set_args,
    parse_value,
    preset,
    with_one_pair,
)
from raymt.errors import check


def flag_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags shared by train and tune; each one addresses a field of `Config`."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--preset", help="model preset: tiny, mini, small, base, big (default mini)")
    p.add_argument("--config", help="JSON or TOML file with sections model/data/optim/train")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set optim.lr=5e-4 (repeatable)",
    )
    flag_fields = {
        "num_workers": "train.num_workers",
        "max_steps": "train.max_steps",
        "epochs": "train.epochs",
        "max_minutes": "train.max_minutes",
        "corpus": "data.corpus",
        "storage_path": "train.storage_path",
        "name": "train.name",
    }
    for flag, field in flag_fields.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, help=f"sets {field}")
    for flag, side in (("--src-lang", "source"), ("--tgt-lang", "target")):
        p.add_argument(
            flag, help=f"the {side} language of a SPEC without SRC-TGT: and of the built-in corpus (sets data.corpora)"
        )
    add_input_flags(p)
    p.add_argument("--gpu", action="store_true", help="one GPU per worker (sets train.use_gpu)")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print Ray's own INFO lines and internal messages (else in Ray's log files)",
    )
    p.set_defaults(flag_fields=flag_fields)
    return p


INPUT_HELP = (
    "SPEC = [SRC-TGT:]LOCATION (a prefix, a .tsv/.jsonl/.parquet file or a URI); without "
    "SRC-TGT: for --src-lang-TGT (default: the pair of data.corpora, en-de); repeatable"
)


def add_input_flags(p: argparse.ArgumentParser) -> None:
    """--train/--valid/--test/--bt/--pairs: the corpora of a run (`raymt.data.inputs.input_overrides`)."""
    p.add_argument("--train", action="append", default=[], metavar="SPEC", help=f"training pairs; {INPUT_HELP}")
    p.add_argument(
        "--valid", action="append", default=[], metavar="SPEC", help=f"one validation set per pair; {INPUT_HELP}"
    )
    p.add_argument("--test", action="append", default=[], metavar="SPEC", help=f"test set(s) of a pair; {INPUT_HELP}")
    p.add_argument(
        "--bt",
        action="append",
        default=[],
        metavar="SPEC",
        help="back-translated pairs (a `raymt backtranslate` output directory, or files as --train) "
        f"for the direction SRC-TGT trained; {INPUT_HELP}",
    )
    p.add_argument("--pairs", metavar="SRC-TGT,...", help="pairs of the built-in corpus, e.g. en-de,en-fr,de-en")
    p.add_argument(
        "--real-weight", type=float, metavar="W", help="with --bt: the real pairs W times per epoch (default 1)"
    )


def input_flags(args: argparse.Namespace, langs: dict[str, str], current: Sequence[CorpusSpec]) -> dict:
    """data.corpora of --train/--valid/--test/--bt/--pairs and --src-lang/--tgt-lang (`langs`), made
    from the `current` corpora (none when no such flag is given)."""
    from raymt.data.inputs import input_overrides

    out = input_overrides(args.train, args.bt, args.valid, args.test, args.pairs, langs, current, args.real_weight)
    check(
        args.corpus is None or one_pair(out.get("data.corpora", current)),
        "data.corpora and data.corpus are both set: give every corpus and its valid/test sets in data.corpora "
        "(--train/--valid/--test SRC-TGT:SPEC), or drop data.corpora",
    )
    return out


# Older configs' names of data.corpora's one pair (raymt.config.with_one_pair reads them).
ONE_PAIR_KEYS = tuple(f"data.{name}" for name in ONE_PAIR_FIELDS)


def one_pair_sets(sets: dict[str, str], corpora: Sequence[CorpusSpec]) -> dict:
    """--set values with older configs' one-pair keys (data.src_lang, data.train, ...) read into
    data.corpora, set on `corpora` (those of the config file and flags)."""
    old = {k[5:]: parse_value(v, Optional[str], k) for k, v in sets.items() if k in ONE_PAIR_KEYS}
    if not old or "data.corpora" in sets:  # beside data.corpora: apply_overrides says what is wrong
        return sets
    return {**{k: v for k, v in sets.items() if k not in ONE_PAIR_KEYS}, "data.corpora": with_one_pair(corpora, old)}


def build_config(
    args: argparse.Namespace,
    base: Optional[Config] = None,
    new_run: bool = True,
    cluster_gpus: Optional[Callable[[], int]] = None,
    from_checkpoint: bool = False,
) -> Config:
    """Defaults < device defaults < preset < config file < flags < --set, validated field by field.

    A new run on a GPU (or compiled) gets `device_defaults` for the fields the config file,
    flags and --set leave alone: with `cluster_gpus` (how many GPUs the cluster has) one
    worker per GPU unless --num-workers is given. A resumed run keeps its saved values (its
    batches stay the same); a run started `from_checkpoint` (`base` is its config) keeps
    the checkpoint's batch schedule (`SCHEDULE_FIELDS`) unless it is set here.
    """
    cfg = base or Config()
    if args.preset:
        cfg = apply_overrides(cfg, {f"model.{k}": v for k, v in preset(args.preset).__dict__.items()})
    given = flatten(load_file(args.config)) if args.config else {}
    cfg = apply_overrides(cfg, given)
    if any(k in given for k in ONE_PAIR_KEYS):  # read into data.corpora, which flags then change
        given = {**{k: v for k, v in given.items() if k not in ONE_PAIR_KEYS}, "data.corpora": cfg.data.corpora}
    flags = {field: getattr(args, flag) for flag, field in args.flag_fields.items() if getattr(args, flag) is not None}
    if args.gpu:
        flags["train.use_gpu"] = True
    sets = parse_set_args(args.set)
    # A bare SPEC is for the pair that flags and --set name, else the config's.
    langs = {k: v for k in ONE_PAIR_FIELDS[:2] if (v := getattr(args, k) or sets.get(f"data.{k}")) is not None}
    inputs = input_flags(args, langs, cfg.data.corpora)
    sets = one_pair_sets(sets, inputs.get("data.corpora", cfg.data.corpora))
    given = {**given, **flags, **inputs, **sets}
    cfg = apply_overrides(cfg, given)
    check_training(cfg)
    if not new_run:
        return cfg
    num_gpus = None
    if cfg.train.use_gpu and "train.num_workers" not in given and cluster_gpus is not None:
        num_gpus = cluster_gpus()
        if num_gpus < 1:
            raise ValueError(
                "--gpu: the cluster has no GPU now; pass --num-workers N (an autoscaling "
                "cluster then adds GPU nodes for N workers) or drop --gpu"
            )
    kept = set(SCHEDULE_FIELDS) if from_checkpoint else set()
    return apply_overrides(cfg, device_defaults(cfg, set(given) | kept, num_gpus))


# ---------------------------------------------------------------- decoding flags


def add_decode_flags(p: argparse.ArgumentParser, sample: bool = True) -> None:
    """The decoding flags of translate, evaluate, backtranslate and serve (`sample`: with the sampling ones)."""
    d = DecodeOptions()
    p.add_argument("--beam", type=int, default=d.beam, help="beam size (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=d.length_penalty, help="GNMT alpha")
    p.add_argument("--max-len-a", type=float, default=d.max_len_a, help="max output = a * src_len + b")
    p.add_argument("--max-len-b", type=int, default=d.max_len_b)
    if sample:
        p.add_argument("--sample", action="store_true", help="sample instead of searching (implies --beam 1)")
        p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
        p.add_argument("--top-k", type=int, default=d.top_k, help="sample among the K most likely tokens (0 = all)")


def decode_options(args: argparse.Namespace, seed: Optional[int] = None) -> DecodeOptions:
    """DecodeOptions (validated) from the decoding flags (`add_decode_flags`)."""
    sample = getattr(args, "sample", False)
    return DecodeOptions(
        beam=1 if sample else args.beam,
        length_penalty=args.length_penalty,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
        sample=sample,
        temperature=getattr(args, "temperature", DecodeOptions.temperature),
        top_k=getattr(args, "top_k", DecodeOptions.top_k),
        seed=seed,
    )
