"""CPU time of a local `raymt serve` by process, for benchmarks/serve_load.py (Linux, /proc).

The server is found from the port it listens on: that process is Serve's HTTP proxy, its parent
the raylet of the server's Ray node; the node's processes are named by Ray's process titles
(`ray::ProxyActor`, `ray::ServeReplica:APP:DEPLOYMENT`, `ray::ServeController`) and the Ray
session directory in their command lines (the GCS, the raylet, Ray's other helpers), so another
Ray on the same machine is not counted. Inside the translator replicas, the threads whose OS name
is raymt.serve.batcher's decoding thread (`raymt-decode`: the engine's calls, and the threads
the engine started from it) are the engine's own share. `snapshot` before and after a load,
`per_1k` the CPU seconds of each group per 1,000 sentences answered.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import psutil

DECODING_THREAD = "raymt-decode"  # raymt.serve.batcher.DECODING_THREAD, without importing torch here
SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_[\d_-]+")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# The groups that are a part of another (the engine is inside the translator): not in the total.
PARTS = {"engine"}
Snapshot = dict[int, tuple[str, float, float]]  # pid: (group, CPU seconds, the engine's CPU seconds)


def listener(port: int) -> Optional[int]:
    """The pid listening on TCP `port` on this machine (Serve's proxy), None when none is seen."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except psutil.Error:
        pass
    return None


def title(proc: psutil.Process) -> str:
    """A process's command line as one string ('' when it is gone or not ours)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def group(cmdline: str) -> str:
    """The group of a Ray process by its title: proxy, controller, a Serve deployment's name
    (`translator`), gcs, raylet, or `ray other` (dashboard, agents, idle workers)."""
    if cmdline.startswith("ray::ProxyActor"):
        return "proxy"
    if cmdline.startswith("ray::ServeController"):
        return "controller"
    if cmdline.startswith("ray::ServeReplica:"):  # ray::ServeReplica:APP:DEPLOYMENT[.method]
        return cmdline.split()[0].split(":")[-1].split(".")[0]
    first = cmdline.split()[0] if cmdline else ""
    if first.endswith("gcs_server"):
        return "gcs"
    if first.endswith("raylet"):
        return "raylet"
    return "ray other"


def server_processes(port: int) -> dict[int, str]:
    """The local server's processes on `port` by pid, each with its group; {} when no process of
    this machine listens there (a remote server: nothing to count)."""
    proxy = listener(port)
    if proxy is None:
        return {}
    try:
        raylet = psutil.Process(proxy).parent()
        node = [raylet, *raylet.children(recursive=True)] if raylet else []
    except psutil.Error:
        return {}
    found = {proxy: "proxy"}
    for proc in node:
        found.setdefault(proc.pid, group(title(proc)))
    session = SESSION.search(title(raylet)) if raylet else None
    if session:  # the GCS and Ray's helpers are the raylet's siblings: known by the session
        for proc in psutil.process_iter():
            if proc.pid not in found and session.group(0) in title(proc):
                found[proc.pid] = group(title(proc))
    return found


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds (its threads', not its children's); 0 when gone."""
    try:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


def thread_seconds(pid: int, name: str = DECODING_THREAD) -> float:
    """The CPU seconds of a process's threads whose OS name is `name` (/proc/PID/task)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            if (task / "comm").read_text().strip() != name:
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / TICKS


def snapshot(port: Optional[int], extra: Optional[dict[int, str]] = None) -> Snapshot:
    """Every counted process's CPU seconds now: the server's on `port` (None: none) and `extra`
    ({pid: group}, e.g. the load generator)."""
    procs = (server_processes(port) if port else {}) | (extra or {})
    out = {}
    for pid, name in procs.items():
        engine = thread_seconds(pid) if name == "translator" else 0.0
        out[pid] = (name, cpu_seconds(pid), engine)
    return out


def per_1k(before: Snapshot, after: Snapshot, sentences: int) -> dict[str, float]:
    """CPU seconds per 1,000 sentences of each group between two snapshots, the engine's share
    of the translator replicas apart, and the total; a process that started in between counts
    from zero, one that ended in between is lost (its last seconds unseen)."""
    if not after or sentences <= 0:
        return {}
    spent: dict[str, float] = {}
    for pid, (name, seconds, engine) in after.items():
        _, was, was_engine = before.get(pid, (name, 0.0, 0.0))
        spent[name] = spent.get(name, 0.0) + max(0.0, seconds - was)
        if name == "translator":
            spent["engine"] = spent.get("engine", 0.0) + max(0.0, engine - was_engine)
    spent["total"] = sum(v for k, v in spent.items() if k not in PARTS)
    return {k: round(1000 * v / sentences, 3) for k, v in sorted(spent.items())}
