"""`python -m raymt.train`: train a Transformer translation model with Ray Train."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from raymt import storage
from raymt.average import describe_checkpoint
from raymt.checkpoint import MODEL_FILE, RAY_SNAPSHOT_FILE, SAFETENSORS_FILE, SPM_FILE, load_config, load_model
from raymt.cluster import Plan, RayCluster, init_ray, plan, release_request, train_logging
from raymt.config import (
    SCHEDULE_FIELDS,
    Config,
    apply_overrides,
    check_training,
    device_defaults,
    flatten,
    load_file,
    parse_set_args,
    preset,
    schedule_line,
)
from raymt.data import builtin, text
from raymt.data import format as corpus_format
from raymt.decoding import translate
from raymt.metrics import score, score_lines
from raymt.plot import after_training as plot_learning_curves
from raymt.precision import for_inference
from raymt.tokenizer import Tokenizer

RUN_CONFIG = "raymt_config.json"
METRICS_CSV = "logs/metrics.csv"


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
        "src_lang": "data.src_lang",
        "tgt_lang": "data.tgt_lang",
        "corpus": "data.corpus",
        "storage_path": "train.storage_path",
        "name": "train.name",
    }
    for flag, field in flag_fields.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, help=f"sets {field}")
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
    "SRC-TGT: for data.src_lang-data.tgt_lang; repeatable"
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


def input_flags(args: argparse.Namespace, default_pair: tuple[str, str]) -> dict:
    """The config fields that --train/--valid/--test/--bt/--pairs set (none when none is given)."""
    from raymt.data.inputs import input_overrides

    return input_overrides(args.train, args.bt, args.valid, args.test, args.pairs, default_pair, args.real_weight)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags of `python -m raymt.train`."""
    p = flag_parser("python -m raymt.train", __doc__)
    p.add_argument(
        "--resume",
        help="a run directory to continue, or a checkpoint to start from "
        "(local paths or URIs such as s3://bucket/runs/NAME)",
    )
    return p.parse_args(argv)


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
    flags = {field: getattr(args, flag) for flag, field in args.flag_fields.items() if getattr(args, flag) is not None}
    if args.gpu:
        flags["train.use_gpu"] = True
    sets = parse_set_args(args.set)
    # A bare SPEC is for the pair that the config file, flags and --set name.
    lang = {**flags, **sets}
    pair = (lang.get("data.src_lang", cfg.data.src_lang), lang.get("data.tgt_lang", cfg.data.tgt_lang))
    given = {**given, **flags, **input_flags(args, pair), **sets}
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


def count_cluster_gpus(verbose: bool = False) -> int:
    """The GPUs of the cluster the run attaches to (starting Ray here if need be)."""
    init_ray(dashboard=True, verbose=verbose)
    return int(RayCluster().resources().get("GPU", 0))


def resolve_resume(
    args: argparse.Namespace,
    cluster_gpus: Optional[Callable[[], int]] = None,
) -> tuple[Config, Optional[str], Optional[str]]:
    """(config, run directory to continue, checkpoint to initialize from); locations are
    absolute local paths or URIs. `cluster_gpus` as in `build_config`."""
    if not args.resume:
        return build_config(args, cluster_gpus=cluster_gpus), None, None
    location = storage.normalize(args.resume)
    if any(storage.exists(storage.join(location, f)) for f in (MODEL_FILE, SAFETENSORS_FILE)):
        return (
            build_config(
                args,
                load_config(location)[0],
                cluster_gpus=cluster_gpus,  # new run from weights
                from_checkpoint=True,
            ),
            None,
            location,
        )
    saved = storage.optional_bytes(storage.join(location, RUN_CONFIG))
    if saved is None:
        raise ValueError(
            f"--resume {args.resume}: neither a run directory (no {RUN_CONFIG}) nor a checkpoint (no {MODEL_FILE})"
        )
    check_resumable(location)
    before = Config.from_dict(json.loads(saved))
    cfg = build_config(args, before, new_run=False)
    check_same_mix(before, cfg, location)
    parent, name = storage.split(location)
    return apply_overrides(cfg, {"train.storage_path": parent, "train.name": name}), location, None


def registered_checkpoints(run_dir: str) -> int:
    """How many checkpoints Ray Train registered in a run directory (0 when none)."""
    snapshot = storage.optional_bytes(storage.join(run_dir, RAY_SNAPSHOT_FILE))
    try:
        return len(json.loads(snapshot)["checkpoint_results"]) if snapshot else 0
    except (json.JSONDecodeError, KeyError, TypeError):
        return 0


def check_resumable(run_dir: str) -> None:
    """A one-line error when a run that trained has no registered checkpoint to continue from
    (it would silently start again at step 0)."""
    if registered_checkpoints(run_dir):
        return
    last = _last_step(storage.optional_bytes(storage.join(run_dir, METRICS_CSV)))
    found = [n for n in storage.listdir(run_dir) if n.startswith("checkpoint_")]
    if last is not None or found:
        trained = f"logged step {last}" if last is not None else f"has {len(found)} checkpoint_* directories"
        raise ValueError(
            f"--resume {run_dir}: the run {trained} but Ray Train registered no checkpoint "
            f"there (no {RAY_SNAPSHOT_FILE} listing one), so it would start again at step 0; "
            "pass one of its checkpoint_* directories to --resume, or start a new run"
        )


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The checkpoint Ray Train would continue a run from (its latest registered one), if any."""
    snapshot = storage.optional_bytes(storage.join(run_dir, RAY_SNAPSHOT_FILE))
    try:
        name = json.loads(snapshot)["latest_checkpoint_result"]["checkpoint_dir_name"] if snapshot else None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    return storage.join(run_dir, name) if name else None


def mixes_corpora(cfg: Config) -> bool:
    """Whether a run trains on several corpora (data.corpora with tags, or a raymt-corpus/2 --corpus)."""
    from raymt.data.inputs import mixed

    if cfg.data.corpora:
        return mixed(cfg.data.corpora)
    if cfg.data.corpus is None:
        return False
    try:
        return corpus_format.read_manifest(cfg.data.corpus)["format"] == corpus_format.FORMAT_CORPORA
    except ValueError:  # not (or no longer) a prepared corpus: plan_data says so where it reads it
        return False


MIX_FIELDS = ("corpora", "corpus", "temperature")


def check_same_mix(saved: Config, cfg: Config, run_dir: str) -> None:
    """A one-line error, before Ray starts, when a resumed multi-corpus run is given other corpora
    or another data.temperature: its checkpoints' data positions are positions in its mix (the
    workers check the checkpoint's `data_mix` too). One-pair runs resume as they always have."""
    changed = [f for f in MIX_FIELDS if getattr(saved.data, f) != getattr(cfg.data, f)]
    if not changed or not (mixes_corpora(saved) or mixes_corpora(cfg)):
        return
    diff = "; ".join(
        f"data.{f} {_mix_field(saved, f)} there, {_mix_field(cfg, f)} here"
        if _mix_field(saved, f) != _mix_field(cfg, f)
        else f"data.{f}: other files, weights or sets"
        for f in changed
    )
    start = latest_checkpoint(run_dir) or f"{run_dir}/checkpoint_..."
    raise ValueError(
        f"--resume {run_dir}: the run's mix of corpora cannot change ({diff}); "
        f"start a new run from its checkpoint instead: --resume {start} --name NEW"
    )


def _mix_field(cfg: Config, field: str) -> str:
    """data.corpora (its corpora's names), data.corpus or data.temperature, in words."""
    if field == "corpora":
        return "[" + ", ".join(c.name for c in cfg.data.corpora) + "]"
    return f"{getattr(cfg.data, field)}" if field == "corpus" else f"{cfg.data.temperature:g}"


CORPUS_DIR = "corpus"


@dataclass
class PairTags:
    """A multi-corpus run's languages: its checkpoints' config.json entry (`languages_entry`) and
    the ids put before each pair's validation and test sources (its target tag)."""

    languages: dict
    prefixes: dict[str, list[int]]  # "en-de" -> [id of <2de>]; [] where the corpus reserves no tag


def pair_tags(corpus: str, corpora: list) -> PairTags:
    """The PairTags of a prepared multi-corpus corpus and its training corpora (`format.corpora`)."""
    from raymt.checkpoint import languages_entry

    manifest = corpus_format.read_manifest(corpus)
    pairs = list(dict.fromkeys((c.src_lang, c.tgt_lang) for c in corpora))
    reserved = manifest.get("tags", {}).get("reserved", {})
    prefixes = {f"{s}-{t}": corpus_format.prefix_ids(manifest, f"{s}-{t}") for s, t in pairs}
    return PairTags(languages_entry(pairs, reserved), prefixes)


@dataclass
class RunData:
    """What a run trains and validates on, settled on the driver before Ray starts."""

    corpus: str  # a prepared corpus: given (data.corpus) or made in the run directory
    # "valid" and, when known, "test": (sources, references) in memory; with several corpora
    # (`mixed`) each maps a pair ("en-de") to its (sources, references), a test set per pair.
    eval_sets: dict
    tokenizer: Optional[Tokenizer]  # known up front (corpus, resumed run, checkpoint) or None
    sources: Optional[list] = None  # inputs still to prepare into `corpus`
    # Several corpora (data.corpora, or a raymt-corpus/2 --corpus): tags, a mix, sets per pair.
    mixed: bool = False
    corpora: Optional[list] = None  # data.corpora's prepare.CorpusInput list, still to prepare


def plan_data(
    cfg: Config, run_dir: str | Path, resume_dir: Optional[str], init_checkpoint: Optional[str | Path]
) -> tuple[Config, RunData]:
    """Check every input and read the small sets; nothing here needs Ray."""
    from raymt.data import prepare

    known = _known_tokenizer(resume_dir, init_checkpoint)
    if cfg.data.corpora:
        return plan_corpora(cfg, run_dir, resume_dir, init_checkpoint, known)
    if cfg.data.corpus is not None:
        manifest = corpus_format.read_manifest(cfg.data.corpus)
        if manifest["format"] == corpus_format.FORMAT_CORPORA:
            return cfg, _prepared_corpora(cfg, manifest, known, init_checkpoint or resume_dir)
        cfg = apply_overrides(cfg, {"data.src_lang": manifest["src_lang"], "data.tgt_lang": manifest["tgt_lang"]})
        tokenizer = corpus_format.load_tokenizer(cfg.data.corpus, manifest)
        if known is not None and known.model_proto != tokenizer.model_proto:
            raise ValueError(
                f"{init_checkpoint or resume_dir} has a different SentencePiece model "
                f"than the corpus {cfg.data.corpus}: prepare the corpus with that "
                "model, or train from scratch"
            )
        tests = sorted(manifest["splits"].get("test", {}))
        eval_sets = {
            "valid": (
                text.read_parallel(cfg.data.valid, cfg.data.src_lang, cfg.data.tgt_lang)
                if cfg.data.valid
                else corpus_format.eval_pairs(cfg.data.corpus, manifest, "valid")
            )
        }
        if cfg.data.test:
            eval_sets["test"] = text.read_parallel(cfg.data.test, cfg.data.src_lang, cfg.data.tgt_lang)
        elif tests:
            eval_sets["test"] = corpus_format.eval_pairs(cfg.data.corpus, manifest, tests[0])
        return cfg, RunData(cfg.data.corpus, eval_sets, tokenizer)
    corpus_dir = storage.join(run_dir, CORPUS_DIR)  # on the run's storage: every node reads it
    if cfg.data.train is None:
        splits = builtin.builtin_splits(
            cfg.data.src_lang,
            cfg.data.tgt_lang,
            cfg.data.builtin_train_size,
            cfg.data.builtin_eval_size,
            cfg.train.seed,
        )
        sources = [prepare.Source(kind="pairs", pairs=splits.pop("train"))]
        for split in ("valid", "test"):  # --valid/--test PREFIX replace the built-in sets
            if getattr(cfg.data, split):
                splits[split] = text.read_parallel(getattr(cfg.data, split), cfg.data.src_lang, cfg.data.tgt_lang)
    else:
        paths = tuple(str(text.resolve(cfg.data.train, lang)) for lang in (cfg.data.src_lang, cfg.data.tgt_lang))
        sources = [prepare.Source(kind="text", paths=paths)]
        splits = {"valid": text.read_parallel(cfg.data.valid, cfg.data.src_lang, cfg.data.tgt_lang)}
        if cfg.data.test:
            splits["test"] = text.read_parallel(cfg.data.test, cfg.data.src_lang, cfg.data.tgt_lang)
    if resume_dir is not None and storage.exists(storage.join(corpus_dir, corpus_format.MANIFEST_FILE)):
        sources = None  # prepared when the run started
    return cfg, RunData(corpus_dir, splits, known, sources)


def plan_corpora(
    cfg: Config,
    run_dir: str | Path,
    resume_dir: Optional[str],
    init_checkpoint: Optional[str | Path],
    known: Optional[Tokenizer],
) -> tuple[Config, RunData]:
    """plan_data for data.corpora: each corpus's sources and each pair's validation and (first)
    test set in memory, checked before Ray starts. One real corpus is today's single pair."""
    from raymt.config import run_prepare_config
    from raymt.data import inputs, prepare

    specs = cfg.data.corpora
    if not inputs.mixed(specs):  # its languages are the run's (the name, the test set's scorer)
        cfg = apply_overrides(cfg, {"data.src_lang": specs[0].src_lang, "data.tgt_lang": specs[0].tgt_lang})
    options = run_prepare_config(cfg)

    def builtin_splits(spec, corpus_cfg) -> dict:
        sizes = cfg.data.builtin_train_size, cfg.data.builtin_eval_size
        made = builtin.builtin_splits(spec.src_lang, spec.tgt_lang, *sizes, cfg.train.seed)
        return {split: prepare.Source(kind="pairs", pairs=pairs) for split, pairs in made.items()}

    corpora = prepare.corpus_inputs(specs, options, builtin_splits)
    valid, test = {}, {}
    for c in corpora:
        corpus_cfg = prepare.corpus_config(options, c.spec)
        if c.valid:
            valid[c.spec.pair] = prepare.read_eval(corpus_cfg, c.valid)
        if c.test:
            test[c.spec.pair] = prepare.read_eval(corpus_cfg, next(iter(c.test.values())))
    if known is not None and inputs.mixed(specs):
        prepare.check_tags(known, inputs.reserved_pieces(specs, cfg.data.bt_tag), str(init_checkpoint or resume_dir))
    # Validation sets are prepared from memory, as a one-pair run's are (read once).
    for c in corpora:
        c.valid = [prepare.Source(kind="pairs", pairs=valid[c.spec.pair])] if c.valid else []
    corpus_dir = storage.join(run_dir, CORPUS_DIR)
    if resume_dir is not None and storage.exists(storage.join(corpus_dir, corpus_format.MANIFEST_FILE)):
        corpora = None  # prepared when the run started
    if not inputs.mixed(specs):
        eval_sets = {"valid": valid[specs[0].pair], **({"test": test[specs[0].pair]} if test else {})}
        return cfg, RunData(corpus_dir, eval_sets, known, corpora=corpora)
    return cfg, RunData(corpus_dir, {"valid": valid, "test": test}, known, mixed=True, corpora=corpora)


def _prepared_corpora(cfg: Config, manifest: dict, known: Optional[Tokenizer], given: Optional[str]) -> RunData:
    """RunData of a prepared raymt-corpus/2 corpus: each pair's validation set and first test set."""
    corpus = cfg.data.corpus
    if cfg.data.valid or cfg.data.test:
        raise ValueError(
            f"--valid/--test PREFIX replace a one-pair corpus's sets, but {corpus} holds several "
            "pairs: prepare it again with --valid/--test SRC-TGT:SPEC"
        )
    tokenizer = corpus_format.load_tokenizer(corpus, manifest)
    if known is not None and known.model_proto != tokenizer.model_proto:
        raise ValueError(
            f"{given} has a different SentencePiece model than the corpus {corpus}: train from scratch on it"
        )
    prepared_at = manifest.get("options", {}).get("temperature", cfg.data.temperature)
    if prepared_at != cfg.data.temperature:  # data.temperature mixes; a sweep may vary it on purpose
        print(
            f"note: {corpus} was prepared with --temperature {prepared_at:g} (its SentencePiece sample); "
            f"this run mixes its corpora at data.temperature={cfg.data.temperature:g} "
            f"(--set data.temperature={prepared_at:g} mixes them as prepared)",
            flush=True,
        )
    valid, test = {}, {}
    for pair in corpus_format.pairs(manifest):
        valid[pair] = corpus_format.eval_pairs(corpus, manifest, "valid", pair)
        tests = list(manifest["splits"].get("test", {}).get(pair, {}))
        if tests:
            test[pair] = corpus_format.eval_pairs(corpus, manifest, tests[0], pair)
    return RunData(corpus, {"valid": valid, "test": test}, tokenizer, mixed=True)


def _known_tokenizer(resume_dir: Optional[str], init_checkpoint: Optional[str | Path]) -> Optional[Tokenizer]:
    """The SentencePiece model a resumed run or a starting checkpoint already has."""
    for directory in (resume_dir, init_checkpoint):
        proto = storage.optional_bytes(storage.join(directory, SPM_FILE)) if directory is not None else None
        if proto is not None:
            return Tokenizer(proto)
    return None


def materialize(cfg: Config, run_data: RunData) -> tuple[list, Tokenizer]:
    """Prepare the corpus if the run makes its own (Ray Data), then list its training shards:
    a list of `Shard`s for one pair, a `format.Corpus` (its shards, tags, weight) per corpus
    when the run has several (`run_data.mixed`)."""
    from raymt.config import run_prepare_config
    from raymt.data import prepare

    if run_data.corpora is not None:
        prepare.prepare_corpora(
            run_prepare_config(cfg), run_data.corpus, run_data.corpora, tokenizer=run_data.tokenizer
        )
    elif run_data.sources is not None:
        options = run_prepare_config(cfg)
        valid = [prepare.Source(kind="pairs", pairs=run_data.eval_sets["valid"])]
        prepare.prepare_corpus(options, run_data.corpus, run_data.sources, valid, tokenizer=run_data.tokenizer)
    manifest = corpus_format.read_manifest(run_data.corpus)
    tokenizer = corpus_format.load_tokenizer(run_data.corpus, manifest)
    if run_data.mixed:
        return corpus_format.corpora(run_data.corpus, manifest), tokenizer
    return corpus_format.train_files(run_data.corpus, manifest), tokenizer


SHAPE_FIELDS = ("d_model", "num_heads", "d_ff", "num_encoder_layers", "num_decoder_layers", "pre_norm", "activation")


def check_shape(cfg: Config, checkpoint: str | Path) -> None:
    """A one-line error when the starting checkpoint's model differs in shape from the config's."""
    saved, _ = load_config(checkpoint)
    diff = [
        f"model.{f} {getattr(saved.model, f)} there, {getattr(cfg.model, f)} here"
        for f in SHAPE_FIELDS
        if getattr(saved.model, f) != getattr(cfg.model, f)
    ]
    if diff:
        raise ValueError(
            f"{checkpoint} holds a model of another shape ({'; '.join(diff)}): drop "
            "--preset / --set model.* to start from it, or train from scratch"
        )


def check_writable(run_dir: str) -> None:
    """A one-line error, before Ray starts and without leaving anything behind, if a local run
    directory cannot be written (Ray Train checks remote storage itself)."""
    if storage.is_uri(run_dir):
        return
    directory = existing = Path(run_dir)
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file, not a directory")
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise ValueError(
            f"cannot write the run directory {directory} ({err.strerror or err}): pass a writable --storage-path"
        ) from None


def write_run_files(cfg: Config, run_dir: str, tokenizer: Tokenizer) -> None:
    """The run's config and SentencePiece model, for --resume and for people."""
    storage.write_bytes(storage.join(run_dir, SPM_FILE), tokenizer.model_proto)
    storage.write_bytes(storage.join(run_dir, RUN_CONFIG), json.dumps(cfg.to_dict(), indent=2).encode())


def scaling(cfg: Config) -> Plan:
    """Resources per training worker and torch threads, checked against the cluster.

    An elastic group's workers take a fixed share each (train.cpus_per_worker, else one CPU),
    not the cluster split by their number: the number changes; min_workers must fit now. An
    autoscaling cluster is asked to grow first (up to train.autoscale_timeout_s).
    """
    grow = cfg.train.autoscale_timeout_s  # an autoscaling cluster gets time to grow
    if cfg.train.min_workers is None:
        return plan(cfg.train.num_workers, cfg.train.use_gpu, cfg.train.cpus_per_worker, grow_timeout_s=grow)
    return plan(
        cfg.train.min_workers,
        cfg.train.use_gpu,
        cfg.train.cpus_per_worker or 1.0,
        what=f"train.min_workers={cfg.train.min_workers}",
        fix="lower train.min_workers",
        grow_timeout_s=grow,
    )


def fit(
    cfg: Config,
    train_files: list,
    valid: text.Pairs | dict,
    tokenizer: Tokenizer,
    init_checkpoint: Optional[str | Path],
    log_dir: Optional[str] = None,
    callbacks: Optional[list] = None,
    init_full_state: bool = False,
    verbose: bool = False,
    tags: Optional[PairTags] = None,
):
    """Run the TorchTrainer; returns Ray's Result.

    Workers read their own slices of `train_files` (raymt.data.stream), so no
    dataset is split by Ray Train; validation rows travel in the config, every one scored.
    Several corpora: `train_files` is a `format.Corpus` per corpus (mixed by data.temperature
    in the workers), `valid` maps each pair to its set and `tags` gives the pairs' tags.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raymt.worker import train_loop_per_worker

    workers = scaling(cfg)
    num_workers = (
        cfg.train.num_workers if cfg.train.min_workers is None else (cfg.train.min_workers, cfg.train.num_workers)
    )
    # The resolved filesystem travels to every worker with its endpoint (raymt.storage).
    storage_fs, storage_fs_path = storage.filesystem(cfg.train.storage_path)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": cfg.to_dict(),
            "spm_model": tokenizer.model_proto,
            "num_threads": workers.num_threads,
            "train_files": train_files,
            **valid_config(valid, tokenizer, cfg.model.max_positions, tags),
            "init_checkpoint": str(init_checkpoint) if init_checkpoint else None,
            "init_full_state": init_full_state,
            "log_dir": log_dir,
        },
        scaling_config=ScalingConfig(
            num_workers=num_workers,
            use_gpu=cfg.train.use_gpu,
            resources_per_worker=workers.resources(),
            elastic_resize_monitor_interval_s=cfg.train.resize_interval_s,
        ),
        torch_config=TorchConfig(backend="nccl" if cfg.train.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.train.name,
            storage_path=storage_fs_path,
            storage_filesystem=storage_fs,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.train.num_to_keep, checkpoint_score_attribute="valid_bleu", checkpoint_score_order="max"
            ),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            callbacks=callbacks,
            logging_config=train_logging(verbose),
        ),
    )
    return trainer.fit()


def valid_config(valid: text.Pairs | dict, tokenizer: Tokenizer, max_positions: int, tags: Optional[PairTags]) -> dict:
    """The workers' validation rows and references: "valid" for one pair; "valid_pairs" for
    several, each pair's sources starting with its target tag (and the "languages" of the
    model, for its checkpoints' config.json)."""
    if tags is None:
        return {"valid": {"rows": corpus_format.eval_rows(valid, tokenizer, max_positions), "refs": valid[1]}}
    sets = {
        pair: {"rows": corpus_format.eval_rows(p, tokenizer, max_positions, tags.prefixes[pair]), "refs": p[1]}
        for pair, p in valid.items()
    }
    return {"valid_pairs": sets, "languages": tags.languages}


def best_checkpoint(result):
    """The kept Ray checkpoint with the highest validation BLEU."""
    scored = [(m.get("valid_bleu", -1.0), c) for c, m in result.best_checkpoints]
    if not scored:
        raise RuntimeError("training finished without a checkpoint")
    return max(scored, key=lambda x: x[0])[1]


def test_scores(
    checkpoint: str | Path,
    pairs: text.Pairs,
    cfg: Config,
    shown: Optional[str] = None,
    prefix: Sequence[int] = (),
    lang: Optional[str] = None,
) -> dict:
    """Beam-search the test set on the driver with the best checkpoint and score it; the
    scores say which checkpoint (`shown`: its storage path) and how it was decoded. `prefix`:
    a tagged model's target tag before every source; `lang`: the target language (data.tgt_lang)."""
    model, tokenizer, _ = load_model(checkpoint)
    with for_inference(next(model.parameters()).device, cfg, tokenizer.vocab_size).apply().autocast():
        hyps = translate(model, tokenizer, pairs[0], cfg.decode, prefix=prefix)
    return _test_summary(hyps, pairs, cfg, checkpoint, shown, lang)


def cluster_test_scores(
    checkpoint: str | Path,
    pairs: text.Pairs,
    cfg: Config,
    shown: str,
    prefix: Sequence[int] = (),
    lang: Optional[str] = None,
) -> dict:
    """Beam-search the test set through raymt.evaluate's actor pool with the run's resources (one
    GPU per actor, as many actors as training workers), not on the driver; score it as `test_scores`.

    `shown` (the checkpoint's storage path or URI) is what the actors load: every node reads it.
    An elastic run that lost nodes decodes on the GPUs left.
    """
    from raymt.evaluate import translate_on_cluster

    num_actors = max(1, min(cfg.train.num_workers, int(RayCluster().resources().get("GPU", 0))))
    [scored] = translate_on_cluster(
        shown,
        [pairs[0]],
        cfg.decode,
        num_actors=num_actors,
        batch_size=cfg.data.eval_batch_size,
        use_gpu=True,
        prefix=prefix,
    )
    return _test_summary([hyp for _, hyp in scored], pairs, cfg, checkpoint, shown, lang)


def _test_summary(
    hyps: list[str],
    pairs: text.Pairs,
    cfg: Config,
    checkpoint: str | Path,
    shown: Optional[str],
    lang: Optional[str] = None,
) -> dict:
    """The test set's scores, which checkpoint (`shown`) and how it was decoded."""
    scores = score(hyps, pairs[1], extra=True, lang=lang or cfg.data.tgt_lang)
    return {
        **scores,
        "checkpoint": describe_checkpoint(checkpoint, shown),
        "num_sentences": len(pairs[0]),
        "beam": cfg.decode.beam,
        "length_penalty": cfg.decode.length_penalty,
    }


def score_test_set(
    checkpoint: str | Path,
    pairs: text.Pairs,
    cfg: Config,
    shown: str,
    prefix: Sequence[int] = (),
    lang: Optional[str] = None,
) -> dict:
    """The test set's scores: decoded on the run's GPUs (`cluster_test_scores`) when its workers had
    them, else on the driver's CPUs (`test_scores`: no actor start-up, faster for small CPU runs)."""
    if cfg.train.use_gpu:
        return cluster_test_scores(checkpoint, pairs, cfg, shown, prefix, lang)
    return test_scores(checkpoint, pairs, cfg, shown, prefix, lang)


def score_test_pairs(checkpoint: str | Path, tests: dict, cfg: Config, shown: str, tags: PairTags) -> dict:
    """Each pair's test set scored as `score_test_set`, its sources starting with the pair's tag."""
    return {
        pair: score_test_set(checkpoint, pairs, cfg, shown, tags.prefixes[pair], pair.split("-", 1)[1])
        for pair, pairs in tests.items()
    }


def run_pairs(cfg: Config) -> list[str]:
    """The pairs a run trains ("en-de"), for its name: its corpora's, a prepared corpus's, or its one pair's."""
    if cfg.data.corpora:
        return list(dict.fromkeys(c.pair for c in cfg.data.corpora))
    if cfg.data.corpus is not None:  # data.src_lang/tgt_lang come from its manifest only later
        try:
            return corpus_format.pairs(corpus_format.read_manifest(cfg.data.corpus))
        except ValueError:  # not a prepared corpus: plan_data says so
            pass
    return [f"{cfg.data.src_lang}-{cfg.data.tgt_lang}"]


def finalize(cfg: Config) -> Config:
    """Give the run a name and an absolute storage path (URIs such as s3:// stay as they are)."""
    # Named after its pairs: "raymt-en-de-...", or "raymt-en-de+de-en-..." for a mixed run.
    name = cfg.train.name or f"raymt-{'+'.join(run_pairs(cfg))}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    storage = cfg.train.storage_path
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    return apply_overrides(cfg, {"train.name": name, "train.storage_path": storage})


def run_location(cfg: Config) -> str:
    """The run directory: STORAGE_PATH/NAME, a local path or a URI; everything a resume needs is there."""
    return storage.join(cfg.train.storage_path, cfg.train.name)


def run(
    cfg: Config,
    resume_dir: Optional[str] = None,
    init_checkpoint: Optional[str | Path] = None,
    callbacks: Optional[list] = None,
    score_test: bool = True,
    init_full_state: bool = False,
    verbose: bool = False,
) -> dict:
    """Train with Ray Train, score the best checkpoint on the test set, return the summary.

    `init_checkpoint` starts a new run from a checkpoint's weights, or with `init_full_state`
    also from its optimizer, scheduler and step (a Tune trial continuing another's work).
    """
    t0 = time.time()
    check_training(cfg)  # a Config built in code (the notebook, a sweep's trial) skips build_config
    cfg = finalize(cfg)
    if cfg.train.use_gpu:
        print(schedule_line(cfg), flush=True)
    run_dir = run_location(cfg)
    if init_checkpoint is not None:  # before plan_data, which may generate the built-in corpus
        check_shape(cfg, init_checkpoint)
    cfg, run_data = plan_data(cfg, run_dir, resume_dir, init_checkpoint)
    check_writable(run_dir)
    init_ray(dashboard=True, verbose=verbose)
    scaling(cfg)  # more workers or GPUs than the cluster has (or grows to): one line, before any data work
    try:
        train_files, tokenizer = materialize(cfg, run_data)
        tags = pair_tags(run_data.corpus, train_files) if run_data.mixed else None
        write_run_files(cfg, run_dir, tokenizer)
        result = fit(
            cfg,
            train_files,
            run_data.eval_sets["valid"],
            tokenizer,
            init_checkpoint,
            storage.join(run_dir, "logs"),
            callbacks,
            init_full_state,
            verbose,
            tags,
        )
    finally:
        release_request()  # nodes the plan asked for may go when idle
    best = best_checkpoint(result)
    metrics_csv = storage.join(run_dir, METRICS_CSV)
    summary = {
        "run_dir": run_dir,
        "best_checkpoint": storage.join(run_dir, Path(best.path).name),
        "init_checkpoint": str(init_checkpoint) if init_checkpoint else None,
        "start_step": _first_step(storage.optional_bytes(metrics_csv)),
        "metrics_csv": metrics_csv,
        "valid": {k: v for k, v in result.metrics.items() if k.startswith("valid_")},
    }
    if tags is not None and len(tags.prefixes) > 1:
        summary["pairs"] = list(tags.prefixes)  # then "test" holds each pair's scores
    if score_test and run_data.eval_sets.get("test"):
        with best.as_directory() as directory:  # downloads from remote storage if needed
            tests, shown = run_data.eval_sets["test"], summary["best_checkpoint"]
            if tags is None:
                summary["test"] = score_test_set(directory, tests, cfg, shown)
            else:
                scored = score_test_pairs(directory, tests, cfg, shown, tags)
                summary["test"] = scored if "pairs" in summary else next(iter(scored.values()))
    summary["wall_time_s"] = round(time.time() - t0, 1)
    # Plots and summary.json are made in a local mirror of the run directory (itself when local).
    files = storage.MirroredDir(run_dir, fetch=(METRICS_CSV,))
    plot_learning_curves(files.path, run_dir)  # RUN/plots/*.png from logs/metrics.csv; never raises
    # summary.json last: it marks a finished run (a Tune sweep interrupted after it reruns nothing).
    (files.path / "summary.json").write_text(json.dumps(summary, indent=2))
    files.close()
    return summary


def _csv_steps(metrics_csv: Optional[bytes]) -> list[int]:
    """The steps of a metrics.csv's rows (none when it is missing)."""
    rows = (metrics_csv or b"").decode().splitlines()[1:]
    return [int(row.split(",")[0]) for row in rows if row]


def _first_step(metrics_csv: Optional[bytes]) -> Optional[int]:
    """The first step logged by this run (above log_every when it continued another run)."""
    return next(iter(_csv_steps(metrics_csv)), None)


def _last_step(metrics_csv: Optional[bytes]) -> Optional[int]:
    """The last step a run logged, if any."""
    steps = _csv_steps(metrics_csv)
    return steps[-1] if steps else None


def worker_value_error(err: BaseException) -> Optional[ValueError]:
    """The one-line error (a ValueError) a training worker raised, of the lowest rank, if the run
    failed with one (Ray Train's WorkerGroupError carries each failed rank's exception)."""
    from ray.train import WorkerGroupError

    failures = err.worker_failures if isinstance(err, WorkerGroupError) else {}
    return next((failures[rank] for rank in sorted(failures) if isinstance(failures[rank], ValueError)), None)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        cfg, resume_dir, init_checkpoint = resolve_resume(args, functools.partial(count_cluster_gpus, args.verbose))
        summary = run(cfg, resume_dir, init_checkpoint, verbose=args.verbose)
    except Exception as err:  # a worker's one-line error (CUDA out of memory) arrives wrapped by Ray
        user_error = err if isinstance(err, ValueError) else worker_value_error(err)
        if user_error is None:
            raise
        print(f"raymt.train: error: {user_error}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    """The run's closing lines."""
    print("\n=== raymt training finished ===")
    # Several pairs: one "test SRC-TGT:" block per pair.
    if "pairs" in summary:
        tests = {f"test {pair}:": t for pair, t in summary.get("test", {}).items()}
    else:
        tests = {"test": summary["test"]} if "test" in summary else {}
    for name, t in tests.items():
        print("\n".join(score_lines(name, t, t["checkpoint"], t["beam"], t["length_penalty"], t["num_sentences"])))
    print(f"metrics: {summary['metrics_csv']} (TensorBoard: tensorboard --logdir {summary['run_dir']}/logs)")
    print(f"best checkpoint: {summary['best_checkpoint']}")
    print(f"wall time: {summary['wall_time_s'] / 60:.1f} min")
    print(f'translate: python -m raymt.translate --checkpoint {summary["best_checkpoint"]} "..."')


if __name__ == "__main__":
    sys.exit(main())
