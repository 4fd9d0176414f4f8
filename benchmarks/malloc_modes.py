"""The plain loop in fresh processes, with glibc's malloc thresholds dynamic (default) or fixed.

    python benchmarks/malloc_modes.py [--processes 3] [--batches 60]

Each process starts Ray and builds speed.py's `Bench` as speed.py does, then times the
plain loop over the first `--batches` timed batches, and prints tokens/s with the
process's user and system CPU (cores). Processes alternate between glibc's defaults
(an mmap threshold that moves with the process's allocation history) and
MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=1 GiB (fixed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

FIXED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def child(work_dir: str, num_batches: int) -> None:
    """One measurement in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import speed

    speed.start_ray(False)
    b = speed.Bench(speed.parse_args(["--work-dir", work_dir]), Path(work_dir))
    t0, w0 = os.times(), time.perf_counter()
    rate = b.plain(num_batches=num_batches)()
    t1, wall = os.times(), time.perf_counter() - w0
    print(f"RESULT {rate:.0f} tok/s, user {(t1.user - t0.user) / wall:.2f} cores, "
          f"system {(t1.system - t0.system) / wall:.2f}", flush=True)


def main() -> int:
    """Alternate fresh processes with default and fixed malloc thresholds."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=3, help="processes of each kind")
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--work-dir", default="/tmp/raymt-malloc-modes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.work_dir, args.batches)
        return 0
    for _ in range(args.processes):
        for name, extra in (("default", {}), ("fixed", FIXED)):
            env = {k: v for k, v in os.environ.items() if k not in FIXED} | extra
            out = subprocess.run([sys.executable, __file__, "--child", "--work-dir", args.work_dir,
                                  "--batches", str(args.batches)], env=env, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), out.stderr[-300:])
            print(f"{name}: {line.removeprefix('RESULT ')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
