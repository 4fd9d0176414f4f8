"""`python -m raymt.train`: train a Transformer translation model with Ray Train."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from raymt import storage
from raymt.autoscale import RayCluster, release_request
from raymt.checkpoint import MODEL_FILE, SAFETENSORS_FILE, check_target_vocabulary, load_config
from raymt.cluster import Plan, init_ray, plan
from raymt.command import parse
from raymt.config import Config, check_training, flatten, load_file, parse_set_args, schedule_line
from raymt.curves import after_training as plot_learning_curves
from raymt.data.format import TrainingCorpus, eval_rows
from raymt.data.text import Pairs
from raymt.errors import check, cli_error
from raymt.evaluate import score_test_sets
from raymt.flags import TrainFlags, build_config
from raymt.metrics import score_lines
from raymt.ray_console import train_logging
from raymt.rundata import PairTags, materialize, pair_tags, plan_data
from raymt.rundir import (
    METRICS_CSV,
    RUN_CONFIG,
    RunDir,
    check_shape,
    finalize,
    first_step,
    fixed_changes,
    init_config,
    run_location,
)
from raymt.shared_dir import check_shared
from raymt.tokenizer import Tokenizer
from raymt.worker_env import LoopConfig, ValidRows


def parse_args(argv: Optional[list[str]] = None) -> TrainFlags:
    """Command-line flags of `python -m raymt.train` (a bad value: a ValueError naming its field)."""
    return parse(TrainFlags, argv, "python -m raymt.train", __doc__)


def resolve_resume(
    flags: TrainFlags,
    cluster_gpus: Optional[Callable[[], int]] = None,
) -> tuple[Config, Optional[str], Optional[str]]:
    """(config, run directory to continue, checkpoint to initialize from) of the command line;
    locations are absolute local paths or URIs. `cluster_gpus` as in `build_config`. A run
    directory's config is its saved one with the flags given; `run` checks the resume."""
    if flags.init:
        check(
            not flags.resume,
            f"--resume {flags.resume} and --init {flags.init}: give one (continue a run, or start one)",
        )
        return init_run_config(flags, cluster_gpus), None, storage.normalize(flags.init)
    if not flags.resume:
        return build_config(flags, cluster_gpus=cluster_gpus), None, None
    location = storage.normalize(flags.resume)
    check(
        not is_checkpoint(location),
        f"--resume {flags.resume} is a checkpoint, not a run directory: start a new run from its weights "
        f"with --init {flags.resume}",
    )
    saved = RunDir(location).saved
    if saved is None:
        raise ValueError(
            f"--resume {flags.resume}: not a run directory (no {RUN_CONFIG}); a checkpoint starts a new run "
            f"instead (--init CHECKPOINT_DIR)"
        )
    return build_config(flags, saved, new_run=False), location, None


def is_checkpoint(location: str) -> bool:
    """Whether a directory (path or URI) holds a model's weights."""
    return any(storage.exists(storage.join(location, f)) for f in (MODEL_FILE, SAFETENSORS_FILE))


def init_run_config(flags: TrainFlags, cluster_gpus: Optional[Callable[[], int]] = None) -> Config:
    """The config of `--init CHECKPOINT_DIR`: the checkpoint's model, vocabulary and batch schedule
    (`rundir.init_config`) with the flags given; a flag that changes the model's shape or
    vocabulary is a one-line error naming it."""
    location = storage.normalize(flags.init)
    check(
        is_checkpoint(location),
        f"--init {flags.init}: not a checkpoint (no {MODEL_FILE} or {SAFETENSORS_FILE}); continue a run "
        f"directory with --resume {flags.init}, or start from one of its checkpoint_* directories",
    )
    saved = load_config(location)[0]
    cfg = build_config(flags, init_config(saved), cluster_gpus=cluster_gpus, from_checkpoint=True)
    changed = fixed_changes(saved, cfg)
    if changed:
        key, there, here = changed[0]
        raise ValueError(
            f"{setting_flag(flags, key)} changes {key} ({there} in --init {flags.init}, {here} here): a run from "
            "a checkpoint keeps its model's shape and vocabulary (model.dropout and model.attention_dropout "
            "may change); drop it, or train from scratch without --init"
        )
    return cfg


def setting_flag(flags: TrainFlags, key: str) -> str:
    """The flag that set a config field `key`: --set, the --config file or --preset, as written."""
    sets, config = parse_set_args(flags.set), flatten(load_file(flags.config)) if flags.config else {}
    if key in sets:
        return f"--set {key}={sets[key]}"
    if key in config:
        return f"--config {flags.config} ({key} = {config[key]!r})"
    return f"--preset {flags.preset}" if flags.preset else "the flags"


def count_cluster_gpus(verbose: bool = False) -> int:
    """The GPUs of the cluster the run attaches to (starting Ray here if need be)."""
    init_ray(dashboard=True, verbose=verbose)
    return int(RayCluster().resources().get("GPU", 0))


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
    training_corpora: list[TrainingCorpus],
    valid: dict[str, Pairs],
    tokenizer: Tokenizer,
    init_checkpoint: Optional[str | Path],
    tags: PairTags,
    log_dir: Optional[str] = None,
    callbacks: Optional[list] = None,
    init_full_state: bool = False,
    verbose: bool = False,
):
    """Run the TorchTrainer; returns Ray's Result.

    Workers read their own slices of `training_corpora` (raymt.data.stream), so no
    dataset is split by Ray Train; validation rows travel in the config, every one scored.
    `valid` maps each pair to its set and `tags` gives the pairs' tags. `training_corpora` are a
    prepared corpus's (mixed by data.temperature in the workers; one pair's a list of one).
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
    loop = LoopConfig(
        config=cfg,
        spm_model=tokenizer.model_proto,
        num_threads=workers.num_threads,
        training_corpora=training_corpora,
        valid=valid_rows(valid, tokenizer, cfg.model.max_positions, tags),
        languages=tags.languages,
        init_checkpoint=str(init_checkpoint) if init_checkpoint else None,
        init_full_state=init_full_state,
        log_dir=log_dir,
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop.to_dict(),
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


def valid_rows(
    valid: dict[str, Pairs], tokenizer: Tokenizer, max_positions: int, tags: PairTags
) -> dict[str, ValidRows]:
    """The workers' validation rows and references by pair, each set's sources starting with its
    pair's target tag."""
    return {
        pair: ValidRows(eval_rows(p, tokenizer, max_positions, tags.prefixes[pair]), p[1]) for pair, p in valid.items()
    }


def best_checkpoint(result):
    """The kept Ray checkpoint with the highest validation BLEU."""
    scored = [(m.get("valid_bleu", -1.0), c) for c, m in result.best_checkpoints]
    if not scored:
        raise RuntimeError("training finished without a checkpoint")
    return max(scored, key=lambda x: x[0])[1]


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

    `resume_dir` continues the run there (checked first: `RunDir.resume_config`; from the
    checkpoint it started from while it has none of its own); `init_checkpoint` starts a new run
    from a checkpoint's weights, or with `init_full_state` also from its optimizer, scheduler and
    step (a Tune trial continuing another's work).
    """
    t0 = time.time()
    check_training(cfg)  # a Config built in code (the notebook, a sweep's trial) skips build_config
    if resume_dir is not None:  # the one door of a resume, the command line's and the notebook's
        resumed = RunDir(resume_dir)
        cfg, resume_dir = resumed.resume_config(cfg), resumed.location
        init_checkpoint = init_checkpoint or resumed.start_checkpoint()  # killed before its first checkpoint
    cfg = finalize(cfg)
    if cfg.train.use_gpu:
        print(schedule_line(cfg), flush=True)
    run_dir = RunDir(run_location(cfg))
    if init_checkpoint is not None:  # before plan_data, which may generate the built-in corpus
        check_shape(cfg, init_checkpoint)
    cfg, run_data = plan_data(cfg, run_dir.location, resume_dir, init_checkpoint)
    run_dir.check_writable()
    init_ray(dashboard=True, verbose=verbose)
    scaling(cfg)  # more workers or GPUs than the cluster has (or grows to): one line, before any data work
    try:
        check_shared(run_dir.location)  # a node-local run directory on a multi-node cluster: one line
        corpus = materialize(run_data)
        tokenizer, tags = corpus.tokenizer(), pair_tags(corpus, cfg.data.tag_side)
        check_target_vocabulary(cfg, tokenizer, "the run")  # a hand-set model.target_vocab_size
        run_dir.write_run_files(cfg, tokenizer, str(init_checkpoint) if init_checkpoint else None)
        valid, logs = run_data.eval_sets["valid"], run_dir.path("logs")
        result = fit(
            cfg,
            corpus.training_corpora,
            valid,
            tokenizer,
            init_checkpoint,
            tags,
            logs,
            callbacks,
            init_full_state,
            verbose,
        )
    finally:
        release_request()  # nodes the plan asked for may go when idle
    summary = run_summary(run_dir.location, result, init_checkpoint, tags)
    if score_test and run_data.eval_sets["test"]:
        with best_checkpoint(result).as_directory() as directory:  # downloads from remote storage if needed
            scored = score_test_sets(directory, run_data.eval_sets["test"], cfg, summary["best_checkpoint"])
        summary["test"] = scored if "pairs" in summary else next(iter(scored.values()))
    summary["wall_time_s"] = round(time.time() - t0, 1)
    # Plots and summary.json are made in a local mirror of the run directory (itself when local).
    files = storage.MirroredDir(run_dir.location, fetch=(METRICS_CSV,))
    plot_learning_curves(files.path, run_dir.location)  # RUN/plots/*.png from logs/metrics.csv; never raises
    # summary.json last: it marks a finished run (a Tune sweep interrupted after it reruns nothing).
    (files.path / "summary.json").write_text(json.dumps(summary, indent=2))
    files.close()
    return summary


def run_summary(run_dir: str, result, init_checkpoint: Optional[str | Path], tags: PairTags) -> dict:
    """The summary of a finished training: its best checkpoint, logs and validation scores; "pairs"
    when it trained several (its "test" then holds each pair's scores)."""
    metrics_csv = storage.join(run_dir, METRICS_CSV)
    summary = {
        "run_dir": run_dir,
        "best_checkpoint": storage.join(run_dir, Path(best_checkpoint(result).path).name),
        "init_checkpoint": str(init_checkpoint) if init_checkpoint else None,
        "start_step": first_step(storage.optional_bytes(metrics_csv)),
        "metrics_csv": metrics_csv,
        "valid": {k: v for k, v in result.metrics.items() if k.startswith("valid_")},
    }
    if len(tags.prefixes) > 1:
        summary["pairs"] = list(tags.prefixes)
    return summary


def worker_value_error(err: BaseException) -> Optional[ValueError]:
    """The one-line error (a ValueError) a training worker raised, of the lowest rank, if the run
    failed with one (Ray Train's WorkerGroupError carries each failed rank's exception)."""
    from ray.train import WorkerGroupError

    failures = err.worker_failures if isinstance(err, WorkerGroupError) else {}
    return next((failures[rank] for rank in sorted(failures) if isinstance(failures[rank], ValueError)), None)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    try:
        flags = parse_args(argv)
        cfg, resume_dir, init_checkpoint = resolve_resume(flags, functools.partial(count_cluster_gpus, flags.verbose))
        summary = run(cfg, resume_dir, init_checkpoint, verbose=flags.verbose)
    except Exception as err:  # a worker's one-line error (CUDA out of memory) arrives wrapped by Ray
        user_error = err if isinstance(err, ValueError) else worker_value_error(err)
        if user_error is None:
            raise
        return cli_error("raymt.train", user_error)
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
