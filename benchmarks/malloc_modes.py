"""The plain loop in fresh processes under different memory-allocation settings and threads.

    python benchmarks/malloc_modes.py [--processes 3] [--batches 60] [--modes main,thread]

Each process starts Ray and builds speed.py's `Bench` as speed.py does, then times the
plain loop over the first `--batches` timed batches, and prints tokens/s with the
process's user and system CPU (cores) and minor page faults per second. Processes
alternate between the modes (A B, B A, ...):

- `main` (also `default`): the loop in the main thread, glibc's defaults (an mmap
  threshold that moves with the process's allocation history);
- `fixed`: MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=1 GiB;
- `thp`: PyTorch's THP_MEM_ALLOC_ENABLE=1 (tensors of 2 MiB and more 2 MiB-aligned and
  madvised for transparent huge pages, which this kernel gives only on request);
  `fixed+thp` both;
- `thread`: the loop in a second thread, as Ray Train runs a worker's training loop
  (glibc gives that thread its own arena); `thread+arena1` the same with
  MALLOC_ARENA_MAX=1 (the thread allocates from the main arena);
- `jemalloc`, `thread+jemalloc`: the jemalloc Ray ships (ray/core/libjemalloc.so) in
  LD_PRELOAD.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

FIXED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
THP = {"THP_MEM_ALLOC_ENABLE": "1"}
ARENA1 = {"MALLOC_ARENA_MAX": "1"}


def jemalloc() -> dict[str, str]:
    """LD_PRELOAD of the jemalloc in Ray's wheel."""
    import ray

    return {"LD_PRELOAD": str(Path(ray.__file__).parent / "core" / "libjemalloc.so")}


# name: (extra environment, loop in a second thread)
MODES = {"main": ({}, False), "default": ({}, False), "fixed": (FIXED, False), "thp": (THP, False),
         "fixed+thp": (FIXED | THP, False), "thread": ({}, True), "thread+arena1": (ARENA1, True),
         "jemalloc": (None, False), "thread+jemalloc": (None, True)}
SET_BY_MODES = [*FIXED, *THP, *ARENA1, "LD_PRELOAD"]


def child(work_dir: str, num_batches: int, in_thread: bool) -> None:
    """One measurement in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import speed

    speed.start_ray(False)
    b = speed.Bench(speed.parse_args(["--work-dir", work_dir]), Path(work_dir))
    out: list[str] = []

    def measure() -> None:
        t0, w0 = os.times(), time.perf_counter()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rate = b.plain(num_batches=num_batches)()
        t1, wall = os.times(), time.perf_counter() - w0
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / wall
        out.append(f"{rate:.0f} tok/s, user {(t1.user - t0.user) / wall:.2f} cores, "
                   f"system {(t1.system - t0.system) / wall:.2f}, {faults / 1000:.1f}k minor faults/s")

    if in_thread:
        thread = threading.Thread(target=measure)
        thread.start()
        thread.join()
    else:
        measure()
    print("RESULT " + out[0], flush=True)


def main() -> int:
    """Alternate fresh processes between the modes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=3, help="processes of each mode")
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--modes", default="main,thread", help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--work-dir", default="/tmp/raymt-malloc-modes")
    p.add_argument("--child", choices=["main", "thread"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.work_dir, args.batches, args.child == "thread")
        return 0
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown --modes {sorted(unknown)}; choose from {list(MODES)}")
    for r in range(args.processes):
        for name in (modes if r % 2 == 0 else modes[::-1]):
            extra, in_thread = MODES[name]
            env = {k: v for k, v in os.environ.items() if k not in SET_BY_MODES} | (jemalloc() if extra is None else extra)
            out = subprocess.run([sys.executable, __file__, "--child", "thread" if in_thread else "main",
                                  "--work-dir", args.work_dir, "--batches", str(args.batches)],
                                 env=env, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), out.stderr[-300:])
            print(f"{time.strftime('%H:%M:%S')} {name}: {line.removeprefix('RESULT ')}", flush=True)
            # each child started its own local cluster
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
