"""The flags shared by `raymt train` and `raymt tune` (`TrainFlags`), the input flags `raymt data
prepare` shares with them (`InputFlags`, read by its `corpora`), and the config they build: defaults <
device defaults < preset < config file < flags < --set (`build_config`, where the one-pair names
of flags, config files and --set are read into data.corpora). The decoding flags of every command
are `DecodeOptions`' fields (`raymt.command.group`)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

from raymt.command import flag, group
from raymt.config import (
    PRESETS,
    SCHEDULE_FIELDS,
    Config,
    CorpusSpec,
    apply_overrides,
    check_real_weight,
    check_training,
    corpora_from_flags,
    device_defaults,
    flatten,
    load_file,
    parse_pairs,
    parse_set_args,
    parse_value,
    preset,
    split_spec,
)
from raymt.config.corpus import ONE_PAIR_FIELDS, one_pair, read_one_pair
from raymt.errors import check

SPEC_HELP = (
    "SPEC = [SRC-TGT:]LOCATION (a prefix, a .tsv/.jsonl/.parquet file or a URI); without "
    "SRC-TGT: for {bare}; repeatable"
)
TRAIN_BARE = "--src-lang-TGT (default: the pair of data.corpora, en-de)"


@dataclass
class InputFlags:
    """--train/--valid/--test/--bt/--pairs/--real-weight: the corpora of a run or a prepare
    (`corpora`). The help's {bare} says whose pair a SPEC without SRC-TGT: is, {pairs_of} whose
    pairs --pairs names (train's here; `raymt data prepare` gives its own: `group(InputFlags, words=...)`)."""

    HELP_WORDS: ClassVar[dict[str, str]] = {"bare": TRAIN_BARE, "pairs_of": "the built-in corpus"}

    train: list[str] = flag(help="training pairs; " + SPEC_HELP, repeat=True, metavar="SPEC")
    valid: list[str] = flag(help="one validation set per pair; " + SPEC_HELP, repeat=True, metavar="SPEC")
    test: list[str] = flag(help="test set(s) of a pair; " + SPEC_HELP, repeat=True, metavar="SPEC")
    bt: list[str] = flag(
        help="back-translated pairs (a `raymt backtranslate` output directory, or files as --train) "
        "for the direction SRC-TGT trained; " + SPEC_HELP,
        repeat=True,
        metavar="SPEC",
    )
    pairs: Optional[str] = flag(None, "pairs of {pairs_of}, e.g. en-de,en-fr,de-en", metavar="SRC-TGT,...")
    real_weight: Optional[float] = flag(None, "with --bt: the real pairs W times per epoch (default 1)", metavar="W")

    def corpora(
        self, pair: tuple[str, str], unnamed: Sequence[tuple[str, str]] = (), builtin_langs: bool = True
    ) -> list[CorpusSpec]:
        """The corpora of the input flags of `raymt train`, `raymt tune` and `raymt data prepare`, in
        order; a SPEC without SRC-TGT: is `pair`'s. The pairs of --pairs, else `unnamed` (prepare's
        --dataset or --src-file pair), come first without files: the built-in corpus's (checked
        against its languages with `builtin_langs`) or the caller's."""
        pairs = parse_pairs(self.pairs) if self.pairs is not None else list(unnamed)  # --pairs "" is an error there
        return corpora_from_flags(
            self.train, self.bt, self.valid, self.test, pair, pairs, self.real_weight, builtin_langs
        )


# The flags that set one config field each, as `--set FIELD=VALUE` would.
FLAG_FIELDS = {
    "num_workers": "train.num_workers",
    "max_steps": "train.max_steps",
    "epochs": "train.epochs",
    "max_minutes": "train.max_minutes",
    "corpus": "data.corpus",
    "storage_path": "train.storage_path",
    "name": "train.name",
}


def field_flag(name: str) -> Any:
    """The flag `name` of `FLAG_FIELDS`, typed as its config field: `--max-steps 1e3` is 1000, a
    bad value names the field as --set's does (`parse_value`)."""
    key = FLAG_FIELDS[name]
    section, _, field = key.partition(".")
    kind = typing.get_type_hints(typing.get_type_hints(Config)[section])[field]
    return flag(None, f"sets {key}", parse=lambda raw: parse_value(raw, kind, key))


LANG_HELP = "the {} language of a SPEC without SRC-TGT: and of the built-in corpus (sets data.corpora)"


@dataclass
class TrainFlags:
    """The flags of `raymt train` (all but --resume/--init those of `raymt tune` too); each one
    addresses a field of `Config` (`build_config`). `raymt.command.to_argv` renders them back."""

    preset: Optional[str] = flag(None, f"model preset: {', '.join(PRESETS)} (default mini)")
    config: Optional[str] = flag(None, "JSON or TOML file with sections model/data/optim/train")
    set: list[str] = flag(
        help="override any config field, e.g. --set optim.lr=5e-4 (repeatable)",
        metavar="SECTION.FIELD=VALUE",
        repeat=True,
    )
    num_workers: Optional[int] = field_flag("num_workers")
    max_steps: Optional[int] = field_flag("max_steps")
    epochs: Optional[int] = field_flag("epochs")
    max_minutes: Optional[float] = field_flag("max_minutes")
    corpus: Optional[str] = field_flag("corpus")
    storage_path: Optional[str] = field_flag("storage_path")
    name: Optional[str] = field_flag("name")
    src_lang: Optional[str] = flag(None, LANG_HELP.format("source"))
    tgt_lang: Optional[str] = flag(None, LANG_HELP.format("target"))
    inputs: InputFlags = group(InputFlags)
    gpu: bool = flag(False, "one GPU per worker (sets train.use_gpu)")
    verbose: bool = flag(False, "also print Ray's own INFO lines and internal messages (else in Ray's log files)")
    resume: Optional[str] = flag(
        None,
        "a run directory to continue from its latest checkpoint (a local path or a URI such as s3://bucket/runs/NAME)",
        metavar="RUN_DIR",
    )
    init: Optional[str] = flag(
        None,
        "start a new run from a checkpoint's weights (step 0, a new optimizer and schedule) with its "
        "model and SentencePiece model: a run's checkpoint_*, `raymt average` or `raymt import` output",
        metavar="CHECKPOINT_DIR",
    )


def data_flags(flags: TrainFlags, sets: dict[str, str], current: Sequence[CorpusSpec]) -> dict[str, Any]:
    """The flat map of the input flags: data.corpora of the corpora that --train/--bt/--pairs name,
    a bare SPEC for the pair that --src-lang/--tgt-lang or --set name, else of the `current`
    corpora's first; without them, the one-pair keys of the flags (`one_pair_flags`)."""
    inputs = flags.inputs
    if not (inputs.train or inputs.bt) and inputs.pairs is None:
        return one_pair_flags(flags)
    langs = {k: v for k in ONE_PAIR_FIELDS[:2] if (v := getattr(flags, k) or sets.get(f"data.{k}")) is not None}
    first = (current[0].src_lang, current[0].tgt_lang) if current else ("en", "de")
    pair = (langs.get("src_lang", first[0]), langs.get("tgt_lang", first[1]))
    return {"data.corpora": inputs.corpora(pair)}


def one_pair_flags(flags: TrainFlags) -> dict[str, Optional[str]]:
    """--src-lang/--tgt-lang and a bare --valid/--test without --train/--bt/--pairs, as the one-pair
    keys (data.src_lang, ...) that change the config's one corpus (the built-in or a prepared
    (--corpus) corpus: its languages and sets)."""
    inputs = flags.inputs
    check_real_weight(inputs.real_weight, inputs.bt)  # corpora_from_flags checks it on the other path
    given = {f"data.{k}": getattr(flags, k) for k in ONE_PAIR_FIELDS[:2] if getattr(flags, k) is not None}
    for name in ("valid", "test"):
        specs = getattr(inputs, name)
        check(len(specs) <= 1, f"--{name} is given {len(specs)} times: one without --train (or use SRC-TGT:SPEC)")
        for spec in specs:
            pair, location = split_spec(spec, f"--{name}")
            check(pair is None, f"--{name} {spec} names a pair with no --train, --bt or --pairs data")
            given[f"data.{name}"] = location
    return given


# The one-pair names of a flat map: older configs' fields (a config file's, --set's) and the flags'.
ONE_PAIR_KEYS = tuple(f"data.{name}" for name in ONE_PAIR_FIELDS)


def read_one_pair_keys(layer: dict[str, Any], corpora: Sequence[CorpusSpec]) -> dict[str, Any]:
    """`layer` (the flat map of a config file, the flags or --set) with its one-pair keys read into
    data.corpora, set on `corpora` (those of the layers before it) as `Config.from_dict` reads a
    stored config's (`raymt.config.corpus.read_one_pair`); string values typed as --set's ("none": unset)."""
    data = {
        k[5:]: parse_value(v, Optional[str], k) if isinstance(v, str) else v
        for k, v in layer.items()
        if k in ONE_PAIR_KEYS
    }
    if not data:
        return layer
    rest = {k: v for k, v in layer.items() if k not in ONE_PAIR_KEYS}
    if "data.corpora" in rest:
        data["corpora"] = rest["data.corpora"]
    return {**rest, "data.corpora": read_one_pair(data, corpora)["corpora"]}


def build_config(
    flags: TrainFlags,
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
    if flags.preset:
        cfg = apply_overrides(cfg, {f"model.{k}": v for k, v in preset(flags.preset).__dict__.items()})
    # Each layer's one-pair names change the corpora of the layers before it (read once, here).
    given = read_one_pair_keys(flatten(load_file(flags.config)) if flags.config else {}, cfg.data.corpora)
    cfg = apply_overrides(cfg, given)
    fields = {key: getattr(flags, name) for name, key in FLAG_FIELDS.items() if getattr(flags, name) is not None}
    if flags.gpu:
        fields["train.use_gpu"] = True
    sets = parse_set_args(flags.set)
    fields = read_one_pair_keys({**fields, **data_flags(flags, sets, cfg.data.corpora)}, cfg.data.corpora)
    corpora = fields.get("data.corpora", cfg.data.corpora)
    check(
        flags.corpus is None or one_pair(corpora),
        "data.corpora and data.corpus are both set: give every corpus and its valid/test sets in data.corpora "
        "(--train/--valid/--test SRC-TGT:SPEC), or drop data.corpora",
    )
    given = {**given, **fields, **read_one_pair_keys(sets, corpora)}
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
