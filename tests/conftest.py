"""Shared fixtures: tiny models and one local 2-CPU Ray cluster for the session."""

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
# Ray Train's controller polls its workers every 2 s by default: each run's end (and a killed
# worker) is noticed that much later. Train passes this variable on to its controller.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Two of the helper actors a Train run starts, each a new process importing Ray (1-3 s a run on
# 2 cores, benchmarks/NOTES.md): a watcher for nodes being drained (no test drains one) and the
# Prometheus metrics of the controller and workers (nothing scrapes them here).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
# The timed CPU bf16 probe's results (raymt.precision): a file of this session's, not the user's
# ~/.cache, so that no earlier measurement changes a test run's precision.
os.environ.setdefault("RAYMT_PRECISION_CACHE", os.path.join(tempfile.mkdtemp(prefix="raymt-precision-"), "cache.json"))


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead:
    """A `ray start --head` of this test session: its address and its processes."""

    def __init__(self, proc: subprocess.Popen, address: str):
        self.proc, self.address = proc, address

    def processes(self, *titles: str) -> list[int]:
        """Pids of the head's processes whose title (`ray::Class`) is one of `titles`."""
        found = []
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if " ".join(proc.cmdline()).startswith(titles):
                    found.append(proc.pid)
            except psutil.Error:  # gone meanwhile
                pass
        return found

    def train_workers(self) -> list[int]:
        """Pids of the Ray Train worker processes running on this head."""
        return self.processes("ray::RayTrainWorker")

    def wait_idle(self, timeout: float = 120) -> None:
        """Block until no Ray Train worker of an earlier run holds CPUs (a killed driver's go with
        it). An idle TrainController of this process's own runs may stay: it holds none."""
        deadline = time.time() + timeout
        while self.train_workers():
            assert time.time() < deadline, "Ray Train workers of an earlier test still run on the head"
            time.sleep(0.2)


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process started in a session of its own, and every process in its group."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):  # SIGKILL: what is left
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def start_head(
    log: Path, env: dict, num_cpus: int = 2, port: int | None = None, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, Path]:
    """`ray start --head --block` on free ports (GCS on `port` if given) and a temp dir of its own,
    with `extra` flags; (process, temp dir) once it has started, or an AssertionError with its log."""
    temp_dir = Path(f"/tmp/rmt{secrets.token_hex(3)}")  # short: unix socket paths
    ports = {
        flag: free_port()
        for flag in ("port", "dashboard-port", "dashboard-agent-listen-port", "ray-client-server-port")
    }
    ports["port"] = port or ports["port"]
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--num-cpus={num_cpus}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            *(f"--{flag}={port}" for flag, port in ports.items()),
            *extra,
        ],
        env=env,
        start_new_session=True,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 180
    while "will now block forever" not in log.read_text():  # every Ray process is up
        if proc.poll() is not None or time.time() > deadline:
            stop_group(proc)
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise AssertionError(f"ray start --head failed (rc {proc.returncode}): {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, temp_dir


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory) -> Iterator[RayHead]:
    """One Ray head (2 CPUs, dashboard for Ray Train's state API) for the whole session.

    Ray's start-up and shutdown cost seconds in every process that starts its own; drivers of
    the tests connect to this one instead (RAY_ADDRESS, as under `ray job submit`). It runs in
    its own process group on free ports and a temp dir of its own, and is stopped by its pid:
    `ray stop` would stop every Ray of this user on the machine.
    """
    import s3

    env = dict(
        os.environ,
        **s3.ENV,
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_DATA_LOG_LEVEL="WARNING",
        RAY_TRAIN_ENABLE_PRINT_PATCH="0",
        RAY_DASHBOARD_STARTUP_TIMEOUT_S="300",
    )  # Ray's 60 s fails on a busy machine
    logs = tmp_path_factory.mktemp("ray_head")
    for attempt in range(3):  # Ray gives its raylet 30 s to register: a busy machine may need another go
        try:
            proc, temp_dir = start_head(logs / f"ray_start_{attempt}.log", env)
            break
        except AssertionError:
            if attempt == 2:
                raise
    try:
        head = RayHead(proc, (temp_dir / "ray_current_cluster").read_text().strip())
        # What the head runs with; no Ray Data usage poller (it queries a Prometheus that is not there).
        os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        yield head
    finally:
        for key in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED"):
            os.environ.pop(key, None)
        stop_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def ray_address(ray_head, monkeypatch) -> Iterator[RayHead]:
    """RAY_ADDRESS of the session's head for this test's drivers (subprocesses and notebooks);
    before and after, waits until no Ray Train worker holds the head's CPUs."""
    monkeypatch.setenv("RAY_ADDRESS", ray_head.address)
    ray_head.wait_idle()
    yield ray_head
    ray_head.wait_idle()


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """This process as a Ray driver on the session's head (2 CPUs)."""
    import ray
    from ray.data import DataContext

    if ray.is_initialized():  # an earlier test's in-process command (raymt pipeline run) left its driver
        ray.shutdown()
    ray.init(address=ray_head.address, log_to_driver=True)
    DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


# Ray forwards its actors' log lines to the driver's stderr whenever they come, e.g.
# "\x1b[36m(PlacementGroupCleaner pid=7)\x1b[0m Failed to query ..." from a detached
# helper of an earlier run; those are not the output under test.
_RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\(([^)]*pid=\d+[^)]*|raylet[^)]*)\)")


@pytest.fixture
def err_lines(capsys):
    """Return a function giving captured stderr lines, less lines forwarded from Ray actors."""

    def lines() -> list[str]:
        err = capsys.readouterr().err.strip().splitlines()
        return [line for line in err if not _RAY_FORWARDED.match(line)]

    return lines


@pytest.fixture
def tiny_model():
    """A random tiny Transformer in eval mode."""
    from raymt.config import tiny
    from raymt.model import Transformer

    torch.manual_seed(0)
    return Transformer(tiny(), vocab_size=64).eval()


# The tiny 2-worker run that test_e2e checks and test_faults interrupts: dropout on (so that
# restored RNG states matter), a checkpoint and a validation every 20 steps, data traced.
REFERENCE_STEPS = 80


# tiny_run's model and vocabulary; a run from another model's weights (--init) leaves them out.
TINY_MODEL = ("--preset", "tiny", "--set", "data.vocab_size=256")


def tiny_run(storage, name: str, max_steps: int, *extra: str, model: Sequence[str] = TINY_MODEL) -> list[str]:
    """The command of a tiny 2-worker `python -m raymt.train` run named `name` under `storage`."""
    return [
        sys.executable,
        "-m",
        "raymt.train",
        "--storage-path",
        str(storage),
        "--name",
        name,
        *model,
        "--num-workers",
        "2",
        "--max-steps",
        str(max_steps),
        "--set",
        "train.eval_every=20",
        "--set",
        "train.log_every=10",
        "--set",
        "model.dropout=0.1",
        "--set",
        "train.trace_data=true",
        "--set",
        "data.builtin_train_size=800",
        "--set",
        "data.builtin_eval_size=30",
        "--set",
        "data.max_tokens=256",
        "--set",
        "optim.warmup_steps=20",
        "--set",
        "decode.beam=2",
        *extra,
    ]


class ReferenceRun:
    """An uninterrupted `tiny_run`: its console and its directory."""

    def __init__(self, out: subprocess.CompletedProcess, run_dir: Path):
        self.stdout, self.stderr, self.returncode = out.stdout, out.stderr, out.returncode
        self.dir = run_dir


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, ray_head) -> ReferenceRun:
    """One uninterrupted `tiny_run` of REFERENCE_STEPS steps for the session: test_e2e checks
    its outputs, test_faults compares interrupted runs with it (a Ray Train run costs ~20 s
    here, benchmarks/NOTES.md). Nobody trains it further."""
    storage = tmp_path_factory.mktemp("reference")
    ray_head.wait_idle()
    out = subprocess.run(
        tiny_run(storage, "ref", REFERENCE_STEPS),
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ, RAY_ADDRESS=ray_head.address),
    )
    return ReferenceRun(out, storage / "ref")


def init_flags(reference_run: ReferenceRun) -> list[str]:
    """`--init` of the reference run's last checkpoint: tiny_run's model and vocabulary, trained."""
    from raymt.compare import checkpoint_at

    assert reference_run.returncode == 0, reference_run.stderr[-3000:]
    return ["--init", str(checkpoint_at(reference_run.dir, REFERENCE_STEPS))]


@pytest.fixture(scope="session")
def init_run(tmp_path_factory, reference_run, ray_head) -> ReferenceRun:
    """One uninterrupted `tiny_run` of REFERENCE_STEPS steps started with --init from the reference
    run's last checkpoint: test_e2e checks how it starts, test_faults compares an interrupted one
    with it."""
    storage = tmp_path_factory.mktemp("init")
    ray_head.wait_idle()
    out = subprocess.run(
        tiny_run(storage, "init", REFERENCE_STEPS, *init_flags(reference_run)),
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ, RAY_ADDRESS=ray_head.address),
    )
    return ReferenceRun(out, storage / "init")


from s3 import s3_bucket  # noqa: E402,F401 (session fixture: a local S3 server, tests/s3.py)
