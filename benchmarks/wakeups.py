"""What other processes' wake-ups cost a training loop that holds every core.

    python benchmarks/wakeups.py --corpus DIR [--repeats 3] [--batches 40] [--settings quiet,ray-like]

A Ray node runs about fifteen helper processes beside a training worker (raylet, GCS,
the Train controller, dashboard agent, stats and synchronization actors, ...), each
waking ~150 times a second and using 0.004-0.010 of a core (benchmarks/NOTES.md). This
runs raymt's training step (all threads, in a second thread as Ray Train runs it) in a
fresh process with no Ray cluster, beside synthetic wakers, settings alternated:

| setting | wakers beside the loop |
|---|---|
| quiet | none |
| ray-like | 16 processes, each waking 150 times/s and spinning 45 us (2400 wake-ups/s, ~0.11 cores) |
| half | 8 such processes (1200 wake-ups/s, ~0.05 cores) |
| same-cpu-fewer | 1 process waking 150 times/s and spinning 720 us (~0.11 cores in 16x fewer wake-ups) |
| idle-ray | a local Ray cluster started as speed.py starts it (its driver is this script), nothing running on it |

It prints, per setting, tokens/s (median), the ratio to `quiet`, the cores the wakers
used (not counting `idle-ray`'s cluster), and the loop process's involuntary context
switches per second.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_step  # noqa: E402
import speed  # noqa: E402

# name: (waker processes, wake-ups per second each, busy seconds per wake-up, an idle Ray cluster)
SETTINGS = {"quiet": (0, 150, 45e-6, False), "ray-like": (16, 150, 45e-6, False), "half": (8, 150, 45e-6, False),
            "same-cpu-fewer": (1, 150, 720e-6, False), "idle-ray": (0, 150, 45e-6, True)}

WAKER = """
import sys, time
period, busy = float(sys.argv[1]), float(sys.argv[2])
while True:
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
    time.sleep(period)
"""


def loop_child(corpus: str, preset: str, threads: int, num_batches: int, results) -> None:
    """Warm up, then time `num_batches` steps in a second thread of this fresh process."""
    from raymt.config import Config
    from raymt.model import Transformer

    torch.set_num_threads(threads)
    model_cfg = speed.model_config(preset)
    batches = profile_step.load_batches(corpus, 10 + num_batches)
    torch.manual_seed(0)
    loop = speed.PlainLoop(Transformer(model_cfg, speed.vocab_size(Path(corpus))), Config(model=model_cfg), "cpu")
    out: dict = {}

    def measure() -> None:
        torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread
        loop.tokens_per_s(batches[:10])
        r0, t0, w0 = resource.getrusage(resource.RUSAGE_SELF), os.times(), time.perf_counter()
        out["tokens_per_s"] = loop.tokens_per_s(batches[10:])
        r1, t1, wall = resource.getrusage(resource.RUSAGE_SELF), os.times(), time.perf_counter() - w0
        out.update(cores=(t1.user + t1.system - t0.user - t0.system) / wall,
                   nonvoluntary_per_s=(r1.ru_nivcsw - r0.ru_nivcsw) / wall)

    thread = threading.Thread(target=measure)
    thread.start()
    thread.join()
    results.put(out)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace, setting: str) -> dict:
    """One loop process beside the setting's wakers."""
    num, rate, busy, cluster = SETTINGS[setting]
    if cluster:  # as speed.py starts it; its driver (this process) stays connected
        speed.start_ray(False)
        time.sleep(10.0)  # past its start-up
    wakers = [subprocess.Popen([sys.executable, "-c", WAKER, str(1 / rate - busy), str(busy)])
              for _ in range(num)]
    try:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        t0 = time.perf_counter()
        before = {w.pid: cpu_seconds(w.pid) for w in wakers}
        proc = ctx.Process(target=loop_child, args=(args.corpus, args.preset, args.threads, args.batches, results))
        proc.start()
        out = results.get()
        proc.join()
        wall = time.perf_counter() - t0
        out["waker_cores"] = sum(cpu_seconds(w.pid) - before[w.pid] for w in wakers) / wall
    finally:
        for w in wakers:
            w.kill()
            w.wait()
        if cluster:
            import ray

            ray.shutdown()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Alternate the settings, print the table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    profile_step.loop_flags(p, batches=40, repeats=3)
    p.add_argument("--settings", default="quiet,ray-like,half,same-cpu-fewer")
    p.add_argument("--json", default="benchmarks/results/wakeups.json")
    args = p.parse_args(argv)
    settings = args.settings.split(",")
    if "quiet" not in settings or set(settings) - set(SETTINGS):
        p.error(f"--settings takes quiet and any of {', '.join(SETTINGS)}")
    results: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(args.repeats):
        for s in (settings if r % 2 == 0 else settings[::-1]):
            results[s].append(measure(args, s))
            x = results[s][-1]
            print(f"{time.strftime('%H:%M:%S')} {s}: {x['tokens_per_s']:.0f} tok/s, loop {x['cores']:.2f} cores, "
                  f"wakers {x['waker_cores']:.3f} cores, {x['nonvoluntary_per_s']:.0f} involuntary switches/s",
                  flush=True)
    base = statistics.median(x["tokens_per_s"] for x in results["quiet"])
    print("\n| setting | tok/s (median) | / quiet | wakers' cores | loop's involuntary switches/s |")
    print("|---|---|---|---|---|")
    for s, runs in results.items():
        rate = statistics.median(x["tokens_per_s"] for x in runs)
        print(f"| {s} | {rate:.0f} | {rate / base:.3f} | {statistics.median(x['waker_cores'] for x in runs):.3f} | "
              f"{statistics.median(x['nonvoluntary_per_s'] for x in runs):.0f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"settings": SETTINGS, "threads": args.threads, "batches": args.batches,
                                           "torch": torch.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
