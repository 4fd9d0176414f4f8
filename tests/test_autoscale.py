"""Autoscaling clusters: the planner asks Ray's autoscaler to grow and waits, boundedly, instead of refusing."""

import re
import time

import pytest

from raymt import train
from raymt.autoscale import FIRST_REPORT_S, GROW_POLL_S, STALL_S, Growth, RayCluster, release_request
from raymt.cluster import plan
from raymt.command import parse
from raymt.flags import build_config


class FakeCluster(RayCluster):
    """A cluster whose autoscaler adds one 8-GPU node every `node_every_s` seconds of fake time
    after a request, up to `max_nodes`; `autoscaler=False` is a fixed cluster."""

    def __init__(self, autoscaler=True, max_nodes=4, node_every_s=60.0, gpus_per_node=8, report_after_s=0.0):
        self.autoscaler, self.max_nodes, self.node_every_s = autoscaler, max_nodes, node_every_s
        self.report_after_s = report_after_s  # a fresh head's autoscaler: no report before then
        self.gpus_per_node, self.clock, self.requests, self.requested_at = gpus_per_node, 0.0, [], None
        self.failures, self.most = (), None  # what growth() reports beside its pending launches

    def _nodes(self) -> tuple[int, int]:
        """(nodes up, nodes it will have): up to max_nodes, one every node_every_s after a request."""
        if self.requested_at is None or not self.requests[-1]:
            return 0, 0
        wanted = -(-sum(b.get("GPU", 0) for b in self.requests[-1]) // self.gpus_per_node)
        grown = int((self.clock - self.requested_at) // self.node_every_s)
        target = min(wanted, self.max_nodes)
        return min(grown, target), target

    def resources(self):
        nodes = self._nodes()[0]
        return {"CPU": 16.0 + 96.0 * nodes, "GPU": float(self.gpus_per_node * nodes)}

    def growth(self):  # a node launching until max_nodes are up (Ray's pending_launches)
        up, target = self._nodes()
        return Growth(pending=int(up < target), failures=self.failures, most=self.most)

    def _node_types(self):  # what Ray's autoscaler reports: a configured head, or a read-only one
        if self.clock < self.report_after_s:
            return {}
        return {"aa01": "head_cpu"} if self.autoscaler else {"aa01": "node_aa01"}

    def request(self, bundles):
        self.requests.append(list(bundles))
        self.requested_at = self.clock

    def now(self):
        return self.clock

    def sleep(self, seconds):
        self.clock += seconds


def test_autoscaling_cluster_grows_to_the_request_and_prints_progress(capsys):
    """docs/cluster.md's step 5: 16 GPU workers on a cluster with a CPU head and no GPU node yet."""
    cluster = FakeCluster(node_every_s=70)
    workers = plan(16, use_gpu=True, grow_timeout_s=900, cluster=cluster)
    assert workers.resources() == {"CPU": 1.0, "GPU": 1}
    assert cluster.requests == [[{"CPU": 1.0, "GPU": 1.0}] * 16]  # one bundle per worker
    assert 140 <= cluster.clock < 150  # two nodes at 70 s each, looked at every 5 s
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "waiting for the autoscaler: 0/16 GPUs up, 0:00 of at most 15:00 (train.autoscale_timeout_s)"
    assert "8/16 GPUs up, 2:00 of" in lines[-1] and len(lines) == 5  # a line every 30 s, not every poll


def test_autoscaler_that_stops_short_is_named_within_a_minute_not_at_the_timeout(capsys):
    """max_workers (or a quota) reached at one 8-GPU node of 16 GPUs: the autoscaler launches
    nothing more; that is said STALL_S after the last node came, not when the 15 minutes end."""
    cluster = FakeCluster(max_nodes=1)
    with pytest.raises(ValueError) as err:
        plan(16, use_gpu=True, grow_timeout_s=900, cluster=cluster)
    message = str(err.value)
    assert "\n" not in message and 60 + STALL_S <= cluster.clock <= 60 + STALL_S + GROW_POLL_S
    assert message == (
        "train.num_workers=16 needs 16 GPUs and the autoscaler cannot bring them up: 8 are up and it has "
        f"launched no node for {STALL_S:.0f} s (max_workers or quota): raise the node types' max_workers "
        "(cluster.yaml) or the cloud's quota, or lower --num-workers"
    )


def test_autoscaler_failed_launches_and_max_workers_are_named():
    quota = FakeCluster(max_nodes=0)  # every launch fails: nothing ever comes up
    quota.failures = ("gpu_8x: VcpuLimitExceeded: You have requested more vCPU capacity than your quota",)
    with pytest.raises(ValueError, match=r"0 are up and .* \(max_workers or quota; failed launches: gpu_8x: Vcpu"):
        plan(16, use_gpu=True, grow_timeout_s=900, cluster=quota)
    assert quota.clock <= STALL_S + GROW_POLL_S
    capped = FakeCluster()
    capped.most = {"CPU": 208.0, "GPU": 8.0}  # autoscaler v2 has the cluster config: said at once
    with pytest.raises(ValueError, match="needs 16 GPUs and the autoscaler cannot bring them up: its node types' "):
        plan(16, use_gpu=True, grow_timeout_s=900, cluster=capped)
    assert capped.clock == 0


def test_autoscaler_still_launching_waits_until_the_timeout_with_one_line():
    cluster = FakeCluster(node_every_s=400)  # slow nodes, launching all along
    with pytest.raises(ValueError) as err:
        plan(16, use_gpu=True, grow_timeout_s=600, cluster=cluster)
    message = str(err.value)
    assert "\n" not in message and cluster.clock == 600  # bounded: stops at the timeout
    assert "the autoscaler brought 8/16 GPUs up in 10:00 (train.autoscale_timeout_s)" in message
    assert "lower --num-workers" in message


def test_growth_reads_the_autoscalers_v1_report(monkeypatch):
    """The report of Ray 2.60's autoscaler (v1, `ray up` and Ray's fake provider) as the GCS holds it."""
    import json

    import ray.autoscaler.v2.utils
    import ray.experimental.internal_kv

    report = {
        "active_nodes": {"ray.head.default": 1},
        "pending_nodes": [["10.0.0.5", "gpu_1x", "setting-up"]],
        "pending_launches": {"gpu_1x": 2},
        "failed_nodes": [],
        "node_availability_summary": {
            "node_availabilities": {
                "gpu_8x": {
                    "node_type": "gpu_8x",
                    "is_available": False,
                    "last_checked_timestamp": 1796502973,
                    "unavailable_node_information": {"category": "quota", "description": "VcpuLimitExceeded"},
                },
                "cpu_2x": {"node_type": "cpu_2x", "is_available": True, "unavailable_node_information": None},
            }
        },
        "legacy": True,
    }
    raw = json.dumps({"autoscaler_report": report}).encode()
    monkeypatch.setattr(ray.autoscaler.v2.utils, "is_autoscaler_v2", lambda: False)
    monkeypatch.setattr(ray.experimental.internal_kv, "_internal_kv_get", lambda key: raw)
    assert RayCluster().growth() == Growth(pending=3, failures=("gpu_8x: VcpuLimitExceeded",))
    monkeypatch.setattr(ray.experimental.internal_kv, "_internal_kv_get", lambda key: None)
    assert RayCluster().growth() == Growth()  # no report (yet): nothing pending


def test_fixed_cluster_refuses_at_once_without_asking():
    cluster = FakeCluster(autoscaler=False)
    with pytest.raises(ValueError, match="needs 16 GPUs; the cluster has 0: lower --num-workers or drop --gpu"):
        plan(16, use_gpu=True, grow_timeout_s=900, cluster=cluster)
    assert cluster.requests == [] and cluster.clock == 0


def test_cpu_workers_grow_too_and_no_wait_when_they_fit():
    cluster = FakeCluster(gpus_per_node=0)  # CPU nodes: 96 CPUs each once asked
    cluster.resources = lambda: {"CPU": 16.0 + (96.0 if cluster.requests else 0.0)}
    workers = plan(32, cpus_each=2.0, grow_timeout_s=900, cluster=cluster)
    assert workers.cpus == 2.0 and cluster.requests == [[{"CPU": 2.0}] * 32 + [{"CPU": 1.0}]]
    fits = FakeCluster()
    plan(2, cpus_each=1.0, grow_timeout_s=900, cluster=fits)
    assert fits.requests == []  # the cluster has room: the autoscaler is not asked


def test_train_waits_for_the_autoscaler_with_its_timeout(monkeypatch):
    """The run's planner passes train.autoscale_timeout_s (0: refuse at once, as before)."""
    seen = {}
    monkeypatch.setattr(train, "plan", lambda *a, **kw: seen.setdefault("grow", kw["grow_timeout_s"]))
    train.scaling(build_config(train.parse_args(["--gpu", "--num-workers", "16"])))
    assert seen["grow"] == 900


def test_fresh_head_whose_autoscaler_has_not_reported_yet_still_grows():
    """CI's race: the driver asked before the autoscaler's first report and was refused at once."""
    cluster = FakeCluster(report_after_s=4.0)
    workers = plan(8, use_gpu=True, grow_timeout_s=900, cluster=cluster)
    assert workers.gpus == 1 and cluster.requests == [[{"CPU": 1.0, "GPU": 1.0}] * 8]


def test_a_head_that_never_reports_is_taken_as_fixed_after_a_bounded_wait():
    cluster = FakeCluster(report_after_s=float("inf"))
    with pytest.raises(ValueError, match="needs 8 GPUs; the cluster has 0"):
        plan(8, use_gpu=True, grow_timeout_s=900, cluster=cluster)
    assert cluster.requests == [] and cluster.clock == FIRST_REPORT_S


def test_release_withdraws_the_request_only_where_an_autoscaler_runs():
    grown, fixed = FakeCluster(), FakeCluster(autoscaler=False)
    release_request(grown)
    release_request(fixed)
    assert grown.requests == [[]] and fixed.requests == []


def test_release_that_ray_never_answers_is_bounded_by_one_line(capsys):
    """`release_request` hung once at the end of `raymt evaluate`: a withdrawal that never returns
    (a GCS call without a timeout) ends after its bound with one line, and the command goes on."""
    import threading

    stuck, cluster = threading.Event(), FakeCluster()
    cluster.request = lambda bundles: stuck.wait()  # never answers (until the test ends)
    done = threading.Event()
    caller = threading.Thread(target=lambda: (release_request(cluster, timeout_s=0.5), done.set()), daemon=True)
    start = time.monotonic()
    caller.start()
    try:
        assert done.wait(10), "release_request did not return"
    finally:
        stuck.set()
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert err.startswith("raymt: error: the autoscaler request was not withdrawn in 0.5 s") and err.count("\n") == 1


def test_release_raises_what_ray_raised():
    cluster = FakeCluster()
    cluster.request = lambda bundles: (_ for _ in ()).throw(RuntimeError("Ray is not initialized yet"))
    with pytest.raises(RuntimeError, match="not initialized"):
        release_request(cluster)


def test_read_only_autoscaler_of_a_plain_head_cannot_grow(ray_cluster):
    """Every `ray start --head` runs a read-only autoscaler; it names node types after the nodes."""
    cluster = RayCluster()
    for _ in range(60):  # its first report comes within one update (5 s) of the head's start
        if cluster._node_types():
            break
        time.sleep(0.5)
    assert cluster._node_types() and cluster.can_grow() is False


def fake_autoscaling_config(gcs_address: str) -> dict:
    """A cluster config for Ray's fake multi-node provider (nodes are local raylets): a 1-CPU head,
    up to one 2-CPU node and one node with a (fake) GPU, all from zero (cluster.yaml's min_workers: 0).
    The provider is loaded as an external one: the wheel lacks its example.yaml of defaults."""
    return {
        "cluster_name": "raymt-fake",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 1,
        "provider": {
            "type": "external",
            "gcs_address": gcs_address,
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "disable_launch_config_check": True,
            "disable_node_updaters": True,
            "use_node_id_as_ip": True,
        },
        "auth": {"ssh_user": "ray"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "cpu_2x": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 1},
            "gpu_1x": {"resources": {"CPU": 1, "GPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 1},
        },
        "head_node_type": "ray.head.default",
        **{
            key: []
            for key in (
                "cluster_synced_files",
                "rsync_exclude",
                "rsync_filter",
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
            )
        },
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_docs_cluster_flow_against_rays_fake_autoscaler(tmp_path):
    """docs/cluster.md's step 5, shrunk: a driver attached by RAY_ADDRESS (as under `ray job submit`)
    asks for more than the head has; Ray's autoscaler (fake multi-node provider) adds the nodes.
    GPUs are only a resource here: the --gpu request is planned (no CUDA), the training is on CPUs."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    import psutil
    from conftest import ROOT, free_port, start_head, stop_group, tiny_run

    port = free_port()
    config = tmp_path / "autoscaler.json"
    config.write_text(json.dumps(fake_autoscaling_config(f"127.0.0.1:{port}")))
    log = tmp_path / "head.log"
    env = dict(
        os.environ,
        RAY_FAKE_CLUSTER="1",
        AUTOSCALER_UPDATE_INTERVAL_S="1",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_TRAIN_ENABLE_PRINT_PATCH="0",
    )
    head, temp_dir = start_head(log, env, num_cpus=1, port=port, extra=(f"--autoscaling-config={config}",))
    driver_env = dict(env, RAY_ADDRESS=f"127.0.0.1:{port}", PYTHONPATH=str(ROOT))
    try:
        # --gpu: 1 GPU worker on a cluster with none; the autoscaler adds the gpu_1x node
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray; ray.init(); from raymt.cluster import plan; "
                "print(plan(1, use_gpu=True, grow_timeout_s=240).resources())",
            ],
            env=driver_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "waiting for the autoscaler: 0/1 GPUs up, 0:00 of at most 4:00" in out.stdout
        assert "{'CPU': 1.0, 'GPU': 1}" in out.stdout
        # a training run whose 2 workers x 1 CPU (and Ray Data's CPU) need the cpu_2x node too
        storage = tmp_path / "runs"
        command = tiny_run(
            storage, "grown", 10, "--set", "train.cpus_per_worker=1", "--set", "train.autoscale_timeout_s=240"
        )
        out = subprocess.run(command, env=driver_env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "waiting for the autoscaler:" in out.stdout and "CPUs up" in out.stdout
        assert json.loads((storage / "grown" / "summary.json").read_text())["best_checkpoint"]
        # 2 GPUs where gpu_1x's max_workers allow 1: named within a minute, not after the 4 minutes
        start = time.monotonic()
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray; ray.init(); from raymt.cluster import plan; plan(2, use_gpu=True, grow_timeout_s=240)",
            ],
            env=driver_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 1 and time.monotonic() - start < 90, out.stdout[-2000:] + out.stderr[-2000:]
        error = out.stderr.strip().splitlines()[-1]
        assert re.search(
            r"needs 2 GPUs and the autoscaler cannot bring them up: [01] are up and it has launched", error
        ), error
    finally:
        processes = psutil.Process(head.pid).children(recursive=True)  # the fake nodes' raylets too
        stop_group(head)
        for proc in processes:
            try:
                proc.kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_evaluate_asks_an_autoscaling_cluster_for_its_gpu_actors(monkeypatch, capsys):
    """docs/cluster.md's step 6: `raymt evaluate --gpu --num-actors 8` once training's nodes are gone."""
    from raymt import autoscale, evaluate
    from raymt import cluster as cluster_module

    cluster = FakeCluster()
    monkeypatch.setattr(cluster_module, "RayCluster", lambda: cluster)  # the plan's cluster
    monkeypatch.setattr(autoscale, "RayCluster", lambda: cluster)  # release_request's
    timeout = parse(evaluate.EvaluateConfig, ["--checkpoint", "c", "--test", "t", "--gpu"], "e").autoscale_timeout_s
    planned = cluster_module.actor_plan(8, True, None, grow_timeout_s=timeout)
    assert timeout == 900 and planned.gpus == 1 and planned.grew
    assert "of at most 15:00 (--autoscale-timeout)" in capsys.readouterr().out  # evaluate's own flag
    assert cluster.requests == [[{"CPU": 1.0, "GPU": 1.0}] * 8]
    release_request()
    assert cluster.requests[-1] == []
