"""The one Ray start-up (`init_ray`) and the one resource planner (`plan`) of every command;
decoding actors' share of it (`actor_plan`, `default_actors`). The live cluster and its
autoscaler are raymt.autoscale's, the console filters raymt.ray_console's."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from raymt.autoscale import RayCluster, grow
from raymt.config import CPU_ACTORS
from raymt.ray_console import filter_worker_output, quiet_console, quiet_env

# A worker may take a quarter CPU at the least: below that Ray packs so many on one core
# that each step mostly waits for the scheduler.
MIN_CPUS_PER_WORKER = 0.25


def machine_cpus() -> int:
    """CPUs this process may run on (the container's or affinity's share, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def data_cpus(num_cpus: float) -> float:
    """CPUs kept out of workers' reservations: one (half of a lone CPU), for Ray Data's
    preparation and decoding tasks and Ray's own actors (Train's controller, Tune's trials)."""
    return 1.0 if num_cpus >= 2 else num_cpus / 2


@dataclass
class Plan:
    """Resources of a group of Ray workers (training workers or decoding actors)."""

    cpus: float  # per worker
    gpus: int  # per worker (0 or 1)
    num_threads: int  # torch threads per worker
    fits: int  # groups of this size the cluster runs at once (Tune's concurrent trials)
    grew: bool = False  # the autoscaler was asked for room (`release_request` withdraws it)

    def resources(self) -> dict:
        """`resources_per_worker` of Ray Train's ScalingConfig."""
        return {"CPU": self.cpus} | ({"GPU": self.gpus} if self.gpus else {})


def plan(
    num: int,
    use_gpu: bool = False,
    cpus_each: Optional[float] = None,
    total: Optional[dict] = None,
    whole_cpus: bool = False,
    what: Optional[str] = None,
    fix: str = "lower --num-workers",
    grow_timeout_s: float = 0.0,
    cluster: Optional[RayCluster] = None,
    keep_cpus: Optional[float] = None,
    timeout_name: str = "train.autoscale_timeout_s",
    cpus_name: str = "train.cpus_per_worker",
) -> Plan:
    """Resources for `num` workers beside Ray Data's CPU; a one-line ValueError if they do not fit.

    The CPUs left after Ray Data's share go to the group, split evenly; `whole_cpus` prefers
    one CPU per worker when the budget allows it, so that several groups (Tune trials) run
    at once. `what` (default "train.num_workers=N") and `fix` name the user's setting in
    the error message. When the live cluster is short and can grow (an autoscaler with node
    types of its own), up to `grow_timeout_s` is spent asking its autoscaler for the
    workers' bundles (`grow`); a fixed cluster, or 0 (the default), fails at once.
    `keep_cpus` overrides Ray Data's share (0 for a group that needs no Ray Data beside it).
    GPU workers of `cpus_each` CPUs (`cpus_name`) are checked against each node of a live cluster.
    """
    what, grew, nodes = what or f"train.num_workers={num}", False, None
    if total is None:
        cluster = cluster or RayCluster()
        total = cluster.resources()
        if grow_timeout_s > 0 and _short(num, use_gpu, cpus_each, total) and cluster.can_grow():
            fits = lambda now: not _short(num, use_gpu, cpus_each, now)  # the totals `grow` waits for
            total = grow(cluster, num, use_gpu, cpus_each, grow_timeout_s, what, fix, fits, timeout_name)
            grew = True
        nodes = cluster.nodes() if use_gpu and cpus_each is not None else None
    num_cpus, num_gpus = total.get("CPU", 0), total.get("GPU", 0)
    if use_gpu and num > num_gpus:
        raise ValueError(f"{what} with --gpu needs {num} GPUs; the cluster has {num_gpus:g}: {fix} or drop --gpu")
    if use_gpu and cpus_each is not None:
        check_gpu_cpus(num, cpus_each, num_cpus, nodes, what, cpus_name)
    kept = data_cpus(num_cpus) if keep_cpus is None else keep_cpus
    budget = num_cpus - kept
    cpus = cpus_each
    if cpus is None:
        share = 1.0 if whole_cpus and budget >= num else budget / num
        cpus = 1.0 if use_gpu else max(MIN_CPUS_PER_WORKER, share)
    if not use_gpu and cpus * num > budget:
        has = f"'s {num_cpus:g} CPUs leave {budget:g} after Ray Data's share" if kept else f" has {num_cpus:g} CPUs"
        raise ValueError(f"{what} x {cpus:g} CPUs needs {cpus * num:g} CPUs but the cluster{has}: {fix}")
    fits = int(num_gpus // num) if use_gpu else int(budget // (num * cpus))
    return Plan(cpus=cpus, gpus=1 if use_gpu else 0, num_threads=max(1, int(cpus)), fits=max(1, fits), grew=grew)


def check_gpu_cpus(num: int, cpus: float, num_cpus: float, nodes: Optional[list[dict]], what: str, name: str) -> None:
    """A one-line error when `num` GPU workers of `cpus` CPUs each do not fit: a worker's CPUs
    are on its GPU's node, so with `nodes` (each node's resources) per GPU node, else in total."""
    if nodes is None:
        if cpus * num > num_cpus:
            raise ValueError(
                f"{what} with --gpu x {cpus:g} CPUs needs {cpus * num:g} CPUs; "
                f"the cluster has {num_cpus:g}: lower {name}"
            )
        return
    gpu_nodes = [n for n in nodes if n.get("GPU", 0) >= 1]
    held = sum(min(int(n["GPU"]), int(n.get("CPU", 0) // cpus)) for n in gpu_nodes)
    most = max((n.get("CPU", 0) for n in gpu_nodes), default=0)
    if held == 0:
        raise ValueError(f"{what} with --gpu: no GPU node has {cpus:g} CPUs (the most is {most:g}): lower {name}")
    if held < num:
        raise ValueError(
            f"{what} with --gpu: the GPU nodes hold {held} workers of {cpus:g} CPUs and a GPU "
            f"(a GPU node has at most {most:g} CPUs): lower {name} or the number of workers"
        )


def _short(num: int, use_gpu: bool, cpus_each: Optional[float], total: dict) -> bool:
    """True when `total` cannot hold `num` workers (GPUs, or CPUs beside Ray Data's share)."""
    if use_gpu:
        return num > total.get("GPU", 0)
    num_cpus = total.get("CPU", 0)
    return (cpus_each or MIN_CPUS_PER_WORKER) * num > num_cpus - data_cpus(num_cpus)


# ---------------------------------------------------------------- decoding actors


def actor_plan(
    num_actors: int,
    use_gpu: bool,
    cpus_per_actor: Optional[float],
    total: Optional[dict] = None,
    keep_cpus: Optional[float] = None,
    grow_timeout_s: float = 0.0,
) -> Plan:
    """CPUs, GPUs and threads per decoding actor (evaluate, backtranslate): by default the
    cluster's CPUs beside Ray Data's (`keep_cpus`: another share, 0 without Ray Data), split
    evenly; an autoscaling cluster is asked for them first, for up to `grow_timeout_s`."""
    return plan(
        num_actors,
        use_gpu,
        cpus_per_actor,
        total,
        what=f"--num-actors {num_actors}",
        fix="lower --num-actors or --cpus-per-actor",
        keep_cpus=keep_cpus,
        grow_timeout_s=grow_timeout_s,
        timeout_name="--autoscale-timeout",
        cpus_name="--cpus-per-actor",
    )


def default_actors(use_gpu: bool, cluster: Optional[RayCluster] = None) -> int:
    """Actors when --num-actors is not given: one per GPU of the cluster with --gpu, else CPU_ACTORS."""
    if not use_gpu:
        return CPU_ACTORS
    num_gpus = int((cluster or RayCluster()).resources().get("GPU", 0))
    if num_gpus < 1:
        raise ValueError("--gpu: the cluster has no GPU now; pass --num-actors N or drop --gpu")
    return num_gpus


def check_ray_address() -> None:
    """A one-line error for a RAY_ADDRESS that ray.init cannot attach to: the job API's http:// one."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address.startswith(("http://", "https://")):  # set for `ray job submit` and left in the shell
        raise ValueError(
            f"RAY_ADDRESS={address} is the job API's address (for `ray job submit`), not a cluster to "
            "attach to: submit this command with `ray job submit`, or unset RAY_ADDRESS to run it here"
        )


def init_ray(num_cpus: Optional[int] = None, dashboard: bool = False, verbose: bool = False) -> bool:
    """Attach to RAY_ADDRESS's cluster (`ray job submit`), else start a local one; True when started here.

    `dashboard` (on 127.0.0.1) serves the state API that Ray Train V2's placement-group
    cleaner polls: train and tune need it (without it the cleaner fails every second and
    Tune over Train leaks placement groups); prepare and evaluate do not. Unless `verbose`,
    Ray's INFO lines and internal chatter stay in its log files (/tmp/ray/session_latest/logs);
    worker prints (raymt's progress lines) and every warning and error still reach the console.
    """
    import ray
    from ray.data import DataContext

    check_ray_address()
    env = quiet_env() if not verbose else {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    DataContext.get_current().enable_progress_bars = False
    started = False
    if not verbose:
        quiet_console()  # Ray's loggers exist from `import ray`; ray.init already logs
    if not ray.is_initialized():
        quiet = {} if verbose else {"logging_level": logging.WARNING}
        if os.environ.get("RAY_ADDRESS") not in (None, "", "local"):  # "local": a new instance here
            ray.init(log_to_driver=True, **quiet)  # inside a job, num_cpus may not be passed
        else:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=dashboard,
                log_to_driver=True,
                runtime_env={"env_vars": env},
                **quiet,
            )
        started = True
    DataContext.get_current().enable_progress_bars = False
    if not verbose:
        quiet_console()
        if started:
            filter_worker_output()
    return started
