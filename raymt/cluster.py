"""The one Ray start-up (`init_ray`) and the one resource planner (`plan`) of every command;
decoding actors' share of it (`actor_plan`, `default_actors`)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raymt import storage

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
    cluster: Optional["RayCluster"] = None,
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
            total = grow(cluster, num, use_gpu, cpus_each, grow_timeout_s, what, fix, timeout_name)
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

# Decoding actors on CPU when --num-actors is not given (with --gpu: one per GPU of the cluster).
CPU_ACTORS = 2


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


def default_actors(use_gpu: bool, cluster: Optional["RayCluster"] = None) -> int:
    """Actors when --num-actors is not given: one per GPU of the cluster with --gpu, else CPU_ACTORS."""
    if not use_gpu:
        return CPU_ACTORS
    num_gpus = int((cluster or RayCluster()).resources().get("GPU", 0))
    if num_gpus < 1:
        raise ValueError("--gpu: the cluster has no GPU now; pass --num-actors N or drop --gpu")
    return num_gpus


# ---------------------------------------------------------------- autoscaling clusters

# How often `grow` looks at the cluster, and how often it prints its progress line.
GROW_POLL_S = 5.0
GROW_PRINT_S = 30.0
# How long `can_grow` waits for a fresh head's autoscaler to send its first report
# (one update: 5 s by default, more on a loaded head).
FIRST_REPORT_S = 30.0
# How long `grow` lets an autoscaler that launches nothing and adds nothing stay so before it
# names the request infeasible (max_workers reached, the cloud's quota): an autoscaler that can
# grow shows a pending launch within an update or two of the request (5 s each by default).
STALL_S = 30.0


@dataclass
class Growth:
    """What the autoscaler reports doing about the cluster's size (`RayCluster.growth`)."""

    pending: int = 0  # nodes being launched or starting
    failures: tuple[str, ...] = ()  # its failed launches ("gpu_8x: quota exceeded")
    most: Optional[dict] = None  # the most its node types' max_workers allow, where it says


class RayCluster:
    """What `plan` asks of the running Ray cluster; tests pass a fake with the same methods."""

    def resources(self) -> dict:
        """The cluster's total resources now ({"CPU": 16.0, "GPU": 8.0, ...})."""
        import ray

        return ray.cluster_resources()

    def can_grow(self, wait_s: float = FIRST_REPORT_S) -> bool:
        """True when an autoscaler with a cluster config runs (`ray up`, KubeRay, Ray's fake
        multi-node provider). Every head runs one, but without a config it is read-only and
        names each node's type after the node itself (`node_<id>`); a configured one names
        types after its config (cluster.yaml's `head_cpu`, `gpu_8x`)."""
        node_types, start = self._node_types(), self.now()
        # The autoscaler's first report comes one update after the head starts (a job
        # submitted right after `ray up`, or CI's fresh head): wait for it rather than
        # taking "no report yet" for "no autoscaler".
        while not node_types and self.now() - start < wait_s:
            self.sleep(1.0)
            node_types = self._node_types()
        return any(node_type != f"node_{node_id}" for node_id, node_type in node_types.items())

    def _node_types(self) -> dict[str, str]:
        """Node id -> the autoscaler's node type name (autoscaler v1 or v2); empty when none reports."""
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        if is_autoscaler_v2():
            import ray
            from ray.autoscaler.v2.sdk import get_cluster_status

            status = get_cluster_status(ray.get_runtime_context().gcs_address)
            return {
                n.node_id: n.ray_node_type_name
                for n in status.active_nodes + status.idle_nodes
                if n.node_id and n.ray_node_type_name
            }
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        report = json.loads(raw).get("autoscaler_report") if raw else None
        return (report or {}).get("node_type_mapping") or {}

    def growth(self) -> Growth:
        """Nodes the autoscaler is launching or starting, its failed launches, and (autoscaler v2,
        where the cluster config is in the GCS) the most its node types reach."""
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        if is_autoscaler_v2():
            import ray
            from ray._private.state import state
            from ray.autoscaler.v2.sdk import get_cluster_status

            status = get_cluster_status(ray.get_runtime_context().gcs_address)
            return Growth(
                pending=sum(launch.count for launch in status.pending_launches) + len(status.pending_nodes),
                failures=tuple(f"{f.ray_node_type_name}: {f.details}" for f in status.failed_launches),
                most=state.get_max_resources_from_cluster_config(),
            )
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        report = (json.loads(raw).get("autoscaler_report") if raw else None) or {}
        unavailable = ((report.get("node_availability_summary") or {}).get("node_availabilities") or {}).values()
        return Growth(
            pending=sum((report.get("pending_launches") or {}).values()) + len(report.get("pending_nodes") or ()),
            failures=tuple(
                f"{a['node_type']}: {(a.get('unavailable_node_information') or {}).get('description', '')}"
                for a in unavailable
                if not a.get("is_available", True)
            ),
        )

    def nodes(self) -> list[dict]:
        """Each alive node's total resources ([{"CPU": 8.0, "GPU": 1.0, ...}, ...])."""
        import ray

        return [node["Resources"] for node in ray.nodes() if node.get("Alive")]

    def nodes_without(self, path: str, timeout_s: float = 60.0) -> list[str]:
        """The addresses of the alive nodes other than this one on which the file `path` does not
        exist (a task on each; nodes that do not answer in `timeout_s` are left out)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        others = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
        if not others:
            return []

        @ray.remote(num_cpus=0)  # runs on a node whose CPUs are all taken too
        def exists(p: str) -> bool:
            return os.path.exists(p)

        refs = {
            exists.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(path): n
            for n in others
        }
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        return sorted({refs[r]["NodeManagerAddress"] for r in ready if not ray.get(r)})

    def request(self, bundles: list[dict]) -> None:
        """Ask the autoscaler for room for `bundles` (replaces the last request; [] withdraws it)."""
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Wait between two looks at the cluster."""
        time.sleep(seconds)


def _minutes(seconds: float) -> str:
    """Seconds as M:SS."""
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def grow(
    cluster: RayCluster,
    num: int,
    use_gpu: bool,
    cpus_each: Optional[float],
    timeout_s: float,
    what: str,
    fix: str,
    timeout_name: str = "train.autoscale_timeout_s",
) -> dict:
    """Ask the autoscaler for `num` workers' bundles and wait until they are up; the new totals.

    A line every GROW_PRINT_S says how far it got; past `timeout_s`, a one-line ValueError.
    The request stays until `release_request` (Ray Train's own placement group keeps the nodes busy).
    """
    if use_gpu:  # one GPU and its CPUs (one unless set) per worker (plan's GPU worker)
        bundles, unit, need = [{"CPU": float(cpus_each or 1.0), "GPU": 1.0}] * num, "GPU", float(num)
    else:  # the workers' CPUs and Ray Data's
        bundles = [{"CPU": float(cpus_each or 1.0)}] * num + [{"CPU": 1.0}]
        unit, need = "CPU", sum(b["CPU"] for b in bundles)
    cluster.request(bundles)
    start, printed, moved, had = cluster.now(), None, cluster.now(), None
    while True:
        total = cluster.resources()
        if not _short(num, use_gpu, cpus_each, total):
            return total
        now, have, elapsed = cluster.now(), total.get(unit, 0), cluster.now() - start
        try:
            growth = cluster.growth()
        except Exception:  # noqa: BLE001 - no status from Ray this time: taken as still growing (the timeout bounds it)
            growth = Growth(pending=1)
        if growth.pending or have != had:  # launching, or a node came or went
            moved, had = now, have
        if (growth.most is not None and growth.most.get(unit, 0) < need) or now - moved >= STALL_S:
            raise ValueError(stalled(what, unit, have, need, growth, fix))
        if elapsed >= timeout_s:
            raise ValueError(
                f"{what}: the autoscaler brought {have:g}/{need:g} {unit}s up in "
                f"{_minutes(timeout_s)} ({timeout_name}): check the node types' "
                f"max_workers and the cloud's quota, raise {timeout_name}, or {fix}"
            )
        if printed is None or elapsed - printed >= GROW_PRINT_S:
            print(
                f"waiting for the autoscaler: {have:g}/{need:g} {unit}s up, {_minutes(elapsed)} of at "
                f"most {_minutes(timeout_s)} ({timeout_name})",
                flush=True,
            )
            printed = elapsed
        cluster.sleep(min(GROW_POLL_S, max(0.0, timeout_s - elapsed)))


def stalled(what: str, unit: str, have: float, need: float, growth: Growth, fix: str) -> str:
    """The one line of a request the autoscaler cannot meet: what it lacks, why, what to change."""
    if growth.most is not None and growth.most.get(unit, 0) < need:
        why = f"its node types' max_workers reach at most {growth.most.get(unit, 0):g}"
    else:
        failed = f"; failed launches: {'; '.join(growth.failures)}" if growth.failures else ""
        why = f"{have:g} are up and it has launched no node for {STALL_S:.0f} s (max_workers or quota{failed})"
    return (
        f"{what} needs {need:g} {unit}s and the autoscaler cannot bring them up: {why}: raise the node "
        f"types' max_workers (cluster.yaml) or the cloud's quota, or {fix}"
    )


def check_shared(location: str, flag: str = "--storage-path", cluster: Optional[RayCluster] = None) -> None:
    """A one-line error, before training, when a local run directory is on this node only and the
    cluster has other nodes: their workers read the run's corpus there and Ray Train (2.60) writes
    checkpoints there from the worker of rank 0 (its StorageContext fails on a node without the
    directory's marker). A shared directory (NFS, or nodes on one machine) or a URI passes."""
    if storage.is_uri(location):
        return
    existing = Path(location)
    while not existing.exists():  # nothing is created: the nearest existing directory is probed
        existing = existing.parent
    marker = existing / f".raymt-shared-{uuid.uuid4().hex}"
    marker.touch()
    try:
        missing = (cluster or RayCluster()).nodes_without(str(marker))
    finally:
        marker.unlink(missing_ok=True)
    if missing:
        raise ValueError(
            f"{flag} {location} is on this node only: the cluster's nodes at {', '.join(missing)} cannot "
            f"reach it, and training writes checkpoints and reads its corpus there from every node: "
            f"pass {flag} a URI (s3://...) or a directory every node shares (NFS), or set RAYMT_STORAGE_PATH"
        )


# How long `release_request` waits for Ray to take the withdrawal: it hung once at the end of
# `raymt evaluate` (cause not found), in calls to the GCS that have no timeout of their own.
RELEASE_TIMEOUT_S = 30.0


def release_request(cluster: Optional[RayCluster] = None, timeout_s: Optional[float] = None) -> None:
    """Withdraw this job's request to the autoscaler, so that idle nodes may go (no-op without one).
    Bounded by `timeout_s` (RELEASE_TIMEOUT_S): past it, one line says what stays and goes on."""
    cluster = cluster or RayCluster()
    timeout_s = RELEASE_TIMEOUT_S if timeout_s is None else timeout_s
    failed: list[BaseException] = []

    def withdraw() -> None:
        try:
            if cluster.can_grow(wait_s=0.0):  # a job that asked had its answer: the autoscaler has reported
                cluster.request([])
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread below
            failed.append(err)

    thread = threading.Thread(target=withdraw, daemon=True, name="raymt-release-request")
    thread.start()
    thread.join(timeout_s)
    if failed:
        raise failed[0]
    if thread.is_alive():
        print(
            f"raymt: error: the autoscaler request was not withdrawn in {timeout_s:g} s (Ray did not answer): "
            "its nodes stay up until a new job's request replaces it (`ray status` shows it)",
            file=sys.stderr,
            flush=True,
        )


# Ray's own loggers: on the console only their warnings and errors, minus known chatter.
RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune")
# Lines of Ray's internals that say nothing a raymt user can act on; they stay in Ray's logs.
RAY_CHATTER = (
    "gcs_actor_scheduler.cc",
    "Failed to kill actor",
    "worker processes have been started",
    "maximum expected startup concurrency",
    "PreemptionWatcher",
    "Progress bars disabled",
    "Token authentication is enabled",
    "Tip: For detailed progress reporting",
    # Ray Train's start-up of every worker group
    "Setting up process group for",
    "Started training worker group of size",
    "world_rank=",
    "Moving model to device",
    "Wrapping provided model in DistributedDataParallel",
    "Reporting training result",  # a Train logger outside ray.train: its LoggingConfig misses it
    # Ray Data's check at the start of a read while other groups hold their CPUs; raymt's
    # planner leaves Ray Data a CPU (plan), and the read goes ahead
    "Cluster resources are not enough to run any task from TaskPoolMapOperator[ReadFiles",
)
# A line that one of Ray's Python loggers wrote in a worker process: "DATE TIME\tINFO file.py:12 -- ...".
RAY_INFO_LINE = re.compile(r"^\S+ \S+\s+(DEBUG|INFO) [\w./]+\.py:\d+ -- ")
# Ray Train's helper actor whose console output is Ray's own (its failures to reach the state
# API where several Ray instances share a machine, with tracebacks).
RAY_PROCESSES = ("PlacementGroupCleaner",)


def is_chatter(line: str, source: object = None) -> bool:
    """True for a console line of Ray's internals: kept in Ray's log files, not shown."""
    return (
        source in RAY_PROCESSES
        or RAY_INFO_LINE.match(line) is not None
        or any(pattern in line for pattern in RAY_CHATTER)
    )


class _QuietFilter(logging.Filter):
    """Lets Ray's warnings and errors through to the console, not its INFO lines or chatter."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not is_chatter(record.getMessage())


# The logger through which Ray Train (2.60) prints, in the worker, the traceback of an exception
# its training function raised ("Error in training function:", ray.train.v2._internal.util).
RAY_TRAIN_ERROR_LOGGER = "ray.train.v2._internal.util"


class _UserErrorFilter(logging.Filter):
    """Drops Ray Train's print of a training worker's one-line ValueError (a CUDA out-of-memory's
    hint): the driver prints that line alone (raymt.train.main). Ray logs it while the exception
    is being handled, so it is `sys.exc_info()` here; other errors keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(sys.exc_info()[1], ValueError) and record.getMessage().startswith("Error in training"))


def quiet_user_errors() -> None:
    """In a Ray Train worker: its one-line errors reach the console only through the driver."""
    logger = logging.getLogger(RAY_TRAIN_ERROR_LOGGER)
    if not any(isinstance(f, _UserErrorFilter) for f in logger.filters):
        logger.addFilter(_UserErrorFilter())


def quiet_console() -> None:
    """Filter the console handlers of Ray's loggers in this process (files keep everything)."""
    for name in RAY_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                if not any(isinstance(f, _QuietFilter) for f in handler.filters):
                    handler.addFilter(_QuietFilter())


def _filter_worker_output() -> None:
    """Drop Ray's chatter from the worker output and raylet messages Ray prints on the console.

    Worker prints (raymt's progress lines) arrive through the same function as the raylet's
    warnings (`print_to_stdstream`, fed by the log subscriber and the error listener); Ray has
    no public filter, so that function is wrapped. Should Ray's private names change, the
    console is only louder.
    """
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
        print_to_stdstream = ray_worker.print_to_stdstream
    except (ImportError, AttributeError):
        return
    if getattr(print_to_stdstream, "raymt_filter", False):
        return

    def filtered(data: dict, ignore_prefix: bool) -> None:
        source = data.get("actor_name") or data.get("pid")
        lines = [line for line in data.get("lines", []) if not is_chatter(line, source)]
        if lines:
            print_to_stdstream({**data, "lines": lines}, ignore_prefix=ignore_prefix)

    filtered.raymt_filter = True
    ray_worker.print_to_stdstream = filtered  # the error listener looks it up at every call
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", lambda data: filtered(data, ignore_prefix))


def quiet_env() -> dict[str, str]:
    """Environment of Ray's processes that keeps their console output to what matters."""
    return {
        "RAY_DATA_LOG_LEVEL": "WARNING",  # Ray Data's per-execution lines
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    }  # worker prints appear once


def train_logging(verbose: bool = False):
    """Ray Train's `RunConfig.logging_config`: its INFO lines (worker group start, reports,
    checkpoints) stay in its log files unless `verbose`."""
    from ray.train import LoggingConfig

    return LoggingConfig(log_level="INFO" if verbose else "WARNING")


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
            _filter_worker_output()
    return started
