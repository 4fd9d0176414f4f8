"""The running Ray cluster as the planner sees it (`RayCluster`: its resources, nodes and
autoscaler) and an autoscaling cluster asked to grow (`grow`: a request it cannot meet named
within a minute, `stalled`) and its request withdrawn within a bound (`release_request`)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

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
    """What `cluster.plan`, `grow` and `shared_dir.check_shared` ask of the running Ray cluster;
    tests pass a fake with the same methods."""

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
    fits: Callable[[dict], bool],
    timeout_name: str = "train.autoscale_timeout_s",
) -> dict:
    """Ask the autoscaler for `num` workers' bundles and wait until they are up; the new totals.

    Up means `fits(totals)` (the planner's test of the cluster's total resources).
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
        if fits(total):
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
