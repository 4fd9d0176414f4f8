"""cluster.yaml against Ray's own schema and security rules; a two-node `ray job submit` run."""

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import free_port

from raymt import storage as raymt_storage

ROOT = Path(__file__).resolve().parents[1]
RAY_PORTS = (6379, 8265, 10001, 8076)  # GCS, dashboard/job API, Ray client, object manager


def load_cluster_yaml() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_matches_ray_schema():
    import jsonschema
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = load_cluster_yaml()
    jsonschema.validate(config, schema)
    validate_config(prepare_config(config))  # what `ray up` runs, after filling defaults
    gpu = [t for t in config["available_node_types"].values() if t.get("max_workers", 0) > 0]
    assert gpu and all(t.get("min_workers", 0) < t["max_workers"] for t in gpu)  # autoscaling


def test_cluster_yaml_exposes_nothing_but_ssh():
    config = load_cluster_yaml()
    for rule in config["provider"]["security_group"]["IpPermissions"]:
        ports = range(rule["FromPort"], rule["ToPort"] + 1)
        assert not any(p in ports for p in RAY_PORTS), f"rule opens a Ray port: {rule}"
        for cidr in rule.get("IpRanges", []) + rule.get("Ipv6Ranges", []):
            net = ipaddress.ip_network(cidr.get("CidrIp") or cidr.get("CidrIpv6"))
            assert net.prefixlen > 0, f"rule open to the whole internet: {rule}"
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert any("s3://" in c for c in config["setup_commands"])  # checkpoints in object storage
    assert any("torch" in c for c in config["setup_commands"])


def ray_cli(*args, env, timeout=120, check=True):
    ray_bin = str(Path(sys.executable).parent / "ray")
    return subprocess.run([ray_bin, *args], env=env, capture_output=True, text=True, timeout=timeout, check=check)


def wait_for_nodes(address: str, count: int, env: dict, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = ray_cli("status", f"--address={address}", env=env, check=False)
        if out.returncode == 0 and out.stdout.count("node_") >= count:
            return
        time.sleep(2)
    raise TimeoutError(f"{count} Ray nodes did not come up:\n{out.stdout}\n{out.stderr}")


@pytest.mark.slow  # Ray's job agent on the head sometimes stays unavailable for minutes here
@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["default", "s3"])
def test_two_node_ray_job_submit(tmp_path, request, where):
    """A head and a second node on one machine; `ray job submit` a 2-worker training run, its
    storage a bucket on a local S3 server (tests/s3.py) or, without --storage-path, the durable
    default of a job: ~/raymt/runs on the driver's node, not Ray's temporary copy of --working-dir
    (the nodes share this machine's disk, so the multi-node check lets it through)."""
    bucket = request.getfixturevalue("s3_bucket") if where == "s3" else None  # sets AWS_* first
    env = dict(os.environ)
    env.pop("RAYMT_STORAGE_PATH", None)
    env["HOME"] = str(tmp_path / "home")  # the job's ~ (Ray's processes inherit it from `ray start`)
    (tmp_path / "home").mkdir()
    # Token authentication (Ray's default since 2.59), with a token for this test only.
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        RAY_TRAIN_ENABLE_PRINT_PATCH="0",
    )
    port, dashboard = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    temp_dir = Path(f"/tmp/rmt{secrets.token_hex(3)}")  # short: unix socket paths
    started = []
    try:
        started.append(
            subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "ray"),
                    "start",
                    "--head",
                    "--block",
                    f"--port={port}",
                    f"--dashboard-port={dashboard}",
                    "--dashboard-host=127.0.0.1",
                    "--num-cpus=1",
                    "--node-ip-address=127.0.0.1",
                    f"--temp-dir={temp_dir}",
                    "--include-dashboard=true",
                ],
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for_nodes(address, 1, env)
        started.append(
            subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "ray"),
                    "start",
                    "--block",
                    f"--address={address}",
                    "--num-cpus=1",
                    "--node-ip-address=127.0.0.1",
                ],
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for_nodes(address, 2, env)

        storage = f"{bucket}/{secrets.token_hex(4)}" if bucket else str(tmp_path / "home/raymt/runs")
        where_flags = ["--storage-path", storage] if bucket else []
        for _ in range(10):  # the head's job agent may still be starting: Ray says "try again later"
            out = ray_cli(
                "job",
                "submit",
                f"--address=http://127.0.0.1:{dashboard}",
                f"--working-dir={ROOT}",
                "--",
                "python",
                "-m",
                "raymt.train",
                "--preset",
                "tiny",
                "--num-workers",
                "2",
                "--max-steps",
                "20",
                *where_flags,
                "--name",
                "job",
                "--set",
                "train.eval_every=20",
                "--set",
                "data.vocab_size=256",
                "--set",
                "data.builtin_train_size=800",
                "--set",
                "data.builtin_eval_size=40",
                "--set",
                "decode.beam=1",
                "--set",
                "train.trace_data=true",
                env=env,
                timeout=480,
                check=False,
            )
            if "No available agent to submit job" not in out.stdout + out.stderr:
                break
            time.sleep(3)
        (tmp_path / "job.out").write_text(out.stdout + out.stderr)
        assert out.returncode == 0 and "succeeded" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
        # Both workers wrote their data traces through the run's storage (rank 1's included).
        logs = f"{storage}/job/logs"
        assert all(raymt_storage.exists(f"{logs}/trace-rank{r}.tsv") for r in (0, 1)), raymt_storage.listdir(logs)
        summary = json.loads(raymt_storage.read_bytes(f"{storage}/job/summary.json"))
        assert raymt_storage.exists(f"{summary['best_checkpoint']}/model.pt")
        assert raymt_storage.exists(f"{storage}/job/logs/metrics.csv")
        assert raymt_storage.listdir(f"{storage}/job/logs/tensorboard")  # the event file
        if not bucket:  # the start line said where the run goes; Ray's package got none of it
            assert f"goes to {storage}, not into " in out.stdout, out.stdout[-3000:]
            packages = list(temp_dir.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*"))
            assert packages and not any((p / "runs").exists() for p in packages)
    finally:
        for proc in started[::-1]:  # stop only what this test started
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
