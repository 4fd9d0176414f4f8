"""`python -m raymt.tune`: hyperparameter sweeps where every trial is a multi-worker Ray Train run."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from raymt import storage
from raymt.cluster import init_ray, plan
from raymt.command import flag, group, parse
from raymt.config import Config, CorpusOptions, TrainConfig, apply_overrides
from raymt.errors import check, cli_error
from raymt.flags import TrainFlags, build_config
from raymt.ray_console import quiet_env
from raymt.rundir import finalize, run_location
from raymt.shared_dir import check_shared
from raymt.sweep_report import METRICS, print_table, progress, summarize

SCHEDULERS = ("asha", "pbt", "fifo")
SEARCHERS = ("random", "optuna")
# The sweep's defaults: short trials of the default model on the built-in corpus.
DEFAULT_TRIAL = {"train.max_steps": 300, "train.eval_every": 100, "train.log_every": 50, "decode.beam": 1}
DEFAULT_LRS = "optim.lr=1e-3,2e-3,4e-3,8e-3"


@dataclass
class TuneFlags:
    """The flags of `python -m raymt.tune`: training's (`TrainFlags`, all but --resume/--init) plus the sweep's own."""

    train: TrainFlags = group(TrainFlags, skip=("resume", "init"))
    search: list[str] = flag(
        help="sample a field: loguniform:1e-4:3e-3, uniform:0:0.3, randint:1:4, choice:a,b,c (repeatable)",
        metavar="FIELD=DIST:ARGS",
        repeat=True,
    )
    grid: list[str] = flag(
        help="try every value of a field (repeatable); default: " + DEFAULT_LRS, metavar="FIELD=V1,V2,...", repeat=True
    )
    num_samples: int = flag(1, "samples of --search spaces (each repeats the whole grid)")
    max_concurrent: Optional[int] = flag(None, "trials at once (default: what fits)")
    scheduler: str = flag("asha", f"one of {', '.join(SCHEDULERS)}")
    searcher: str = flag("random", f"one of {', '.join(SEARCHERS)}")
    metric: str = flag("valid_bleu", f"one of {', '.join(METRICS)}")
    sweep_name: Optional[str] = flag(None, "sweep directory name under --storage-path")
    resume_sweep: Optional[str] = flag(None, "sweep directory to continue (Tuner.restore)")

    def __post_init__(self) -> None:
        """One line for a scheduler, searcher or metric raymt does not know, or a count below 1."""
        for name, allowed in (("scheduler", SCHEDULERS), ("searcher", SEARCHERS), ("metric", tuple(METRICS))):
            value = getattr(self, name)
            check(value in allowed, f"--{name} {value!r} must be one of {', '.join(allowed)}")
        check(
            self.num_samples >= 1 and (self.max_concurrent is None or self.max_concurrent >= 1),
            "--num-samples and --max-concurrent must be >= 1",
        )


def parse_args(argv: Optional[list[str]] = None) -> TuneFlags:
    """Training flags plus the sweep's own (a bad value: a ValueError naming its flag)."""
    return parse(TuneFlags, argv, "python -m raymt.tune", __doc__)


def _field_type(key: str) -> Any:
    """The annotated type of a dotted config field, Optional unwrapped (raises for unknown fields)."""
    section, _, name = key.partition(".")
    hints = typing.get_type_hints(Config)
    if section not in hints or name not in typing.get_type_hints(hints[section]):
        apply_overrides(Config(), {key: None})  # raises the standard unknown-field error
    tp = typing.get_type_hints(hints[section])[name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(tp) and len(args) == 1 else tp


def _typed(key: str, raw: str, base: Optional[Config] = None) -> Any:
    """`raw` converted to the field's type (and validated) through the normal overrides of `base`."""
    cfg = apply_overrides(base or Config(), {key: raw})
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


# Fields of the corpus a sweep prepares once for all its trials (tune.shared_corpus). Not
# data.temperature: it mixes the prepared corpora in the workers (only the shared corpus's
# SentencePiece sample follows the base config's temperature), so trials may vary it.
CORPUS_FIELDS = {f.name for f in dataclasses.fields(CorpusOptions) if f.name != "temperature"} | {
    "vocab_size",
    "corpora",
    "corpus",
    "builtin_train_size",
    "builtin_eval_size",
}


def parse_space(search: list[str], grid: list[str], base: Optional[Config] = None) -> dict[str, Any]:
    """`--search`/`--grid` strings -> a Tune param space keyed by dotted config fields (values checked on `base`)."""
    from ray import tune

    space: dict[str, Any] = {}
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--grid {item!r} must look like section.field=v1,v2,...")
        _check_searchable(key)
        space[key] = tune.grid_search(spread([_typed(key, v, base) for v in values.split(",")]))
    for item in search:
        key, sep, spec = item.partition("=")
        kind, _, args = spec.partition(":")
        if not sep or not args:
            raise ValueError(
                f"--search {item!r} must look like section.field=DIST:ARGS, e.g. optim.lr=loguniform:1e-4:3e-3"
            )
        _check_searchable(key)
        space[key] = _distribution(key, kind, args, base)
    return space


def _check_searchable(key: str) -> None:
    """Refuse the fields of the corpus every trial shares."""
    if key.startswith("data.") and key.split(".")[-1] in CORPUS_FIELDS:
        raise ValueError(
            f"--search/--grid {key}: a sweep prepares its corpus once for "
            "every trial; run one sweep per value with --set (e.g. --set data.vocab_size=N)"
        )


def spread(values: list) -> list:
    """Numbers in the order that covers their range soonest: the median, the extremes, then
    the midpoints of the widest gaps. Trials mostly run one after another, and ASHA stops a
    trial only when it is worse than those before it at a rung: in ascending order each new
    learning rate may beat the last and none is stopped. Other values keep their order."""
    if len(values) < 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return list(values)
    ordered = sorted(values)
    picked = list(dict.fromkeys([len(ordered) // 2, 0, len(ordered) - 1]))
    while len(picked) < len(ordered):
        done = sorted(picked)
        gaps = sorted((a - b, (a + b) // 2) for a, b in zip(done, done[1:]) if b - a > 1)
        picked += [middle for _, middle in gaps]  # widest gap first, then left to right
    return [ordered[i] for i in picked]


def _distribution(key: str, kind: str, args: str, base: Optional[Config] = None):
    """One Tune sampler from its name and colon-separated arguments, both bounds valid for the field."""
    from ray import tune

    if kind == "choice":
        return tune.choice([_typed(key, v, base) for v in args.split(",")])
    spec = f"--search {key}={kind}:{args}"
    if kind not in ("loguniform", "uniform", "randint"):
        raise ValueError(f"--search {key}: unknown distribution {kind!r}; use loguniform, uniform, randint or choice")
    tp = _field_type(key)
    if tp not in ((int, float) if kind == "randint" else (float,)):
        fix = "randint or choice" if tp is int else "choice"
        raise ValueError(f"{spec}: {key} is {getattr(tp, '__name__', tp)}, which {kind} cannot draw; use {fix}")
    bounds = args.split(":")
    try:
        low, high = (float(b) for b in bounds)
    except ValueError:
        raise ValueError(f"{spec}: expected two numbers LOW:HIGH") from None
    if not low < high:
        raise ValueError(f"{spec}: LOW must be below HIGH")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"{spec}: bounds must be > 0")
    if kind == "randint" and not (low.is_integer() and high.is_integer()):
        raise ValueError(f"{spec}: randint takes whole numbers LOW:HIGH")
    for bound in bounds:  # trials draw up to HIGH: the field's own check, e.g. model.dropout in [0, 1)
        try:
            _typed(key, bound, base)
        except ValueError as err:
            raise ValueError(f"{spec}: {err}") from None
    if kind == "loguniform":
        return tune.loguniform(low, high)
    if kind == "uniform":
        return tune.uniform(low, high)
    return tune.randint(int(low), int(high) + 1)


class _Forward:
    """Train V2 callback (runs in the Train controller): each report goes to a queue."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        """Forward rank 0's metrics and the checkpoint (path and filesystem) to the trial driver."""
        # The path alone is the filesystem's own (`bucket/key` on S3): its filesystem goes with it.
        self.queue.put((metrics[0], (checkpoint.path, checkpoint.filesystem) if checkpoint else None))


def forward_callback(queue):
    """A `ray.train.UserCallback` instance that forwards reports to `queue`."""
    from ray.train.v2.api.callback import UserCallback

    return type("ForwardReports", (_Forward, UserCallback), {})(queue)


def handoff(checkpoint, cfg: Config) -> str:
    """Copy a Tune checkpoint into the trial's run directory and return that location.

    The trial's workers may run on other nodes than this trial actor: they get a location
    on the run's storage (a shared path or a URI, as every run file), never a node-local
    temp dir. A copy of the trial's own: Tune may delete the donor's while this trial trains.
    Its name says where it came from (init-from-<Tune trial dir>-<checkpoint>).
    """
    import pyarrow.fs as pafs

    donor = Path(checkpoint.path)
    location = storage.join(run_location(cfg), f"init-from-{donor.parent.name}-{donor.name}")
    fs, path = storage.filesystem(location)
    fs.create_dir(path)
    pafs.copy_files(checkpoint.path, path, source_filesystem=checkpoint.filesystem, destination_filesystem=fs)
    return location


def run_trial(trial_config: dict) -> None:
    """One Tune trial: a raymt training run whose reports and checkpoints go to Tune.

    A trial (re)started with a Tune checkpoint (PBT exploit, sweep resume) continues from
    it, optimizer and step included, with this trial's hyperparameters.
    """
    import queue as local_queue
    import uuid

    from ray import tune
    from ray.util.queue import Queue

    from raymt.train import run

    overrides = {k: v for k, v in trial_config.items() if k != "base"}
    cfg = finalize(
        apply_overrides(
            Config.from_dict(trial_config["base"]),
            {**overrides, "train.name": f"{tune.get_context().get_trial_id()}-{uuid.uuid4().hex[:6]}"},
        )
    )
    reports = Queue(actor_options={"num_cpus": 0})  # owned by this trial actor
    checkpoint = tune.get_checkpoint()
    init = handoff(checkpoint, cfg) if checkpoint else None
    outcome: dict = {}

    def train() -> None:
        # No Ray call after `run`: when Tune stops this trial it ends this actor, and with it
        # the queue and the Train run, while this thread may still be here (a `put` of an end
        # marker then raised ActorDiedError on the console of a sweep that succeeded).
        try:
            run(
                cfg, init_checkpoint=init, callbacks=[forward_callback(reports)], score_test=False, init_full_state=True
            )
        except BaseException as err:  # re-raised in the trial's own thread below
            outcome["error"] = err

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    while True:
        try:  # every report is in the queue before `run` returns (after_report blocks on put)
            metrics, where = reports.get(timeout=0.5)
        except local_queue.Empty:
            if thread.is_alive() or not reports.empty():
                continue
            break
        tune.report(metrics, checkpoint=tune.Checkpoint(*where) if where else None)
    if "error" in outcome:
        raise outcome["error"]


class _Janitor:
    """Tune callback: remove training placement groups whose CPUs/GPUs nobody has used for a while.

    When Tune stops a trial (ASHA, PBT exploit) while its Train run still waits for its
    workers' placement group, Ray Train has not yet registered that group for cleanup
    (it does so once the workers started); and a synchronous PBT pause was seen to leave
    groups behind too. Such a group holds CPUs no one uses, and the next trial (or its
    Ray Data reads) waits for them forever. Only this job's groups that reserve CPUs or
    GPUs are considered (Tune's own trial groups reserve memory only).
    """

    def __init__(self, grace_s: float = 30.0, every_s: float = 5.0):
        self.grace_s, self.every_s = grace_s, every_s
        self.last_check, self.idle_since = 0.0, {}

    def on_step_begin(self, iteration: int, trials: list, **info) -> None:
        """Called by Tune on every loop; checks every `every_s` seconds."""
        now = time.monotonic()
        if now - self.last_check < self.every_s:
            return
        self.last_check = now
        try:
            self.sweep(now)
        except Exception as err:  # the GCS may be busy: try again on the next check
            print(f"placement-group check skipped: {str(err).splitlines()[0] if str(err) else err!r}")

    def sweep(self, now: float) -> None:
        """Remove this job's groups whose CPUs/GPUs have been unleased for the grace period."""
        import ray
        from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

        # Group ids end with the id of the job that created them: only this sweep's groups.
        job = ray.get_runtime_context().get_job_id()
        total, free = ray.cluster_resources(), ray.available_resources()
        for group_id, info in placement_group_table().items():
            keys = [k for k in (f"CPU_group_{group_id}", f"GPU_group_{group_id}") if k in total]
            # Idle: it reserves CPUs or GPUs and no actor or task holds any of them (even if
            # a zero-CPU actor of a stopped run still lives in it).
            idle = bool(keys) and all(free.get(k, 0) >= total[k] for k in keys)
            if info["state"] != "CREATED" or not group_id.endswith(job) or not idle:
                self.idle_since.pop(group_id, None)
                continue
            since = self.idle_since.setdefault(group_id, now)
            if now - since > self.grace_s:
                print(
                    f"removing placement group {group_id}: left behind by a stopped trial, "
                    f"unused for {now - since:.0f} s"
                )
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
                self.idle_since.pop(group_id)


def janitor():
    """A `ray.tune.Callback` instance of `_Janitor`."""
    from ray import tune

    return type("PlacementGroupJanitor", (_Janitor, tune.Callback), {})()


def trial_resources(train: TrainConfig) -> tuple[float, int]:
    """(CPUs per worker, trials that fit at once), or a one-line error if none fits."""
    n = train.num_workers
    trial = plan(
        n,
        train.use_gpu,
        train.cpus_per_worker,
        whole_cpus=True,
        what=f"--num-workers {n}",
        fix="lower --num-workers",
    )
    return trial.cpus, trial.fits


def make_scheduler(name: str, train: TrainConfig, space: dict, num_trials: int):
    """ASHA, Population Based Training or plain FIFO, all measured in training steps."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

    if name == "asha":
        grace_period, reduction_factor = asha_rungs(train.max_steps, train.eval_every, num_trials)
        return ASHAScheduler(
            time_attr="step", max_t=train.max_steps, grace_period=grace_period, reduction_factor=reduction_factor
        )
    if name == "pbt":
        mutations = {
            k: (v["grid_search"] if isinstance(v, dict) and "grid_search" in v else v) for k, v in space.items()
        }
        # The usual bottom/top quarter leaves nobody to exploit in a small population.
        return PopulationBasedTraining(
            time_attr="step",
            perturbation_interval=train.eval_every,
            hyperparam_mutations=mutations,
            synch=True,
            quantile_fraction=0.25 if num_trials >= 8 else 0.5,
        )
    return tune.schedulers.FIFOScheduler()


def asha_rungs(max_steps: int, eval_every: int, num_trials: int) -> tuple[int, int]:
    """(grace period, reduction factor) of ASHA for a sweep of `num_trials` trials.

    Each rung keeps 1/factor of the trials that reach it: about log_factor(num_trials) rungs
    leave one trial to run to max_steps. Rungs sit at validations (multiples of eval_every,
    where trials report), the first no earlier than the first validation.
    """
    factor = 2 if num_trials < 9 else 3
    num_rungs = max(1, round(math.log(max(num_trials, 1), factor)))
    grace = max_steps / factor**num_rungs // eval_every * eval_every
    return int(min(max(grace, eval_every), max_steps)), factor


def _grid_size(space: dict) -> int:
    """Configurations one sample of the space expands to."""
    return math.prod(len(v["grid_search"]) for v in space.values() if isinstance(v, dict) and "grid_search" in v)


def make_searcher(name: str, space: dict, metric: str):
    """None (random/grid variants) or Optuna's TPE when it is installed."""
    if name == "random":
        return None
    if any(isinstance(v, dict) and "grid_search" in v for v in space.values()):
        raise ValueError("--searcher optuna cannot take --grid fields: use --search")
    if not space:
        raise ValueError(
            "--searcher optuna needs a --search field to sample, e.g. --search optim.lr=loguniform:1e-3:8e-3 "
            "--num-samples 8"
        )
    try:
        import optuna  # noqa: F401
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise ValueError("--searcher optuna needs the optuna package: pip install optuna") from None
    return OptunaSearch(metric=metric, mode=METRICS[metric])


def run_sweep(
    cfg: Config,
    space: dict,
    scheduler: str = "asha",
    searcher: str = "random",
    metric: str = "valid_bleu",
    num_samples: int = 1,
    max_concurrent: Optional[int] = None,
    sweep_name: Optional[str] = None,
    resume_dir: Optional[str] = None,
    verbose: bool = False,
) -> dict:
    """Run (or resume) a sweep; returns the sorted results table, the best trial and the dir."""
    import datetime

    from ray import tune

    # Before Ray starts and the corpus is prepared: a searcher that cannot take the space is one line.
    search_alg = make_searcher(searcher, space, metric) if resume_dir is None else None
    connect(verbose)
    cpus, fits = trial_resources(cfg.train)  # raises before any trial starts if none fits
    cfg = finalize(apply_overrides(cfg, {"train.cpus_per_worker": cpus}))
    where = cfg.train.storage_path if resume_dir is None else storage.output_location(resume_dir, "--resume-sweep")
    check_shared(where)  # a node-local sweep directory on a multi-node cluster: one line, before any trial
    trainable = tune.with_resources(run_trial, {"cpu": 0, "memory": 64 * 2**20})
    # The sweep's directory is a local path or a URI (s3://...), as every run file: storage.join, not Path.
    if resume_dir is not None:
        sweep_dir = where
        if not tune.Tuner.can_restore(sweep_dir):
            raise ValueError(f"--resume-sweep {resume_dir}: no sweep to resume there")
        tuner = tune.Tuner.restore(sweep_dir, trainable, resume_unfinished=True, resume_errored=True)
    else:
        sweep_name = sweep_name or f"sweep-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        sweep_dir = storage.join(cfg.train.storage_path, sweep_name)
        cfg = apply_overrides(shared_corpus(cfg, sweep_dir), {"train.storage_path": storage.join(sweep_dir, "trials")})
        tuner = tune.Tuner(
            trainable,
            param_space={"base": cfg.to_dict(), **space},
            tune_config=tune.TuneConfig(
                metric=metric,
                mode=METRICS[metric],
                num_samples=num_samples,
                scheduler=make_scheduler(scheduler, cfg.train, space, num_samples * _grid_size(space)),
                search_alg=search_alg,
                max_concurrent_trials=max_concurrent or fits,
            ),
            run_config=tune.RunConfig(
                name=sweep_name,
                storage_path=storage.split(sweep_dir)[0],
                # One line per trial result (progress); Tune's status tables only when verbose.
                callbacks=[janitor(), progress(list(space), metric, cfg.train.max_steps, sweep_dir)],
                verbose=1 if verbose else 0,
                checkpoint_config=tune.CheckpointConfig(
                    # PBT clones checkpoints between trials: keep enough of them around.
                    num_to_keep=4 if scheduler == "pbt" else 2,
                    checkpoint_score_attribute=metric,
                    checkpoint_score_order=METRICS[metric],
                ),
            ),
        )
    started = time.monotonic()
    results = tuner.fit()
    return summarize(results, metric, sweep_dir, early_stopping=scheduler == "asha", wall_s=time.monotonic() - started)


def connect(verbose: bool) -> None:
    """Ray for a sweep, as for training (cluster.init_ray), except that unless `verbose`
    the trials' worker output (every step of every trial) stays in Ray's log files: the
    sweep prints one line per trial result instead. Ray's errors still reach the console."""
    import os

    import ray

    if not verbose:  # Tune's new output engine prints its experiment box even when silent
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if not verbose and not ray.is_initialized():
        quiet = {"logging_level": "WARNING", "log_to_driver": False}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**quiet)  # inside a job, num_cpus may not be passed
        else:
            ray.init(include_dashboard=True, runtime_env={"env_vars": quiet_env()}, **quiet)
    init_ray(dashboard=True, verbose=verbose)


def shared_corpus(cfg: Config, sweep_dir: str) -> Config:
    """Prepare the training corpus once for every trial (unless it is already prepared)."""
    from raymt.rundata import materialize, on_prepared, plan_data

    if cfg.data.corpus is not None:
        return cfg
    cfg, run_data = plan_data(cfg, sweep_dir, None, None)
    materialize(run_data)
    return on_prepared(cfg, run_data)


def sweep_config(flags: TuneFlags) -> tuple[Config, dict[str, Any]]:
    """The trials' base config and the search space of a sweep's flags (`run_sweep`'s arguments)."""
    cfg = build_config(flags.train, apply_overrides(Config(), DEFAULT_TRIAL))
    # The default grid is for grid/random sweeps: Optuna samples --search fields only.
    default = [] if flags.search or flags.searcher == "optuna" else [DEFAULT_LRS]
    return cfg, parse_space(flags.search, flags.grid or default, cfg)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    try:
        flags = parse_args(argv)
        cfg, space = sweep_config(flags)
        summary = run_sweep(
            cfg,
            space,
            flags.scheduler,
            flags.searcher,
            flags.metric,
            flags.num_samples,
            flags.max_concurrent,
            flags.sweep_name,
            flags.resume_sweep,
            flags.train.verbose,
        )
    except ValueError as err:
        return cli_error("raymt.tune", err)
    print_table(summary)
    return exit_status(summary["table"])


def exit_status(table: list[dict]) -> int:
    """0 when no trial failed; else 1, with one line saying how many did."""
    failed = sum(row["status"] == "error" for row in table)
    if failed:
        message = f"{failed} of {len(table)} trials failed; the lines above say where their tracebacks are"
        return cli_error("raymt.tune", message, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
