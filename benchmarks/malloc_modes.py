"""The plain loop in fresh processes under different memory-allocation settings.

    python benchmarks/malloc_modes.py [--processes 3] [--batches 60] [--modes default,fixed]

Each process starts Ray and builds speed.py's `Bench` as speed.py does, then times the
plain loop over the first `--batches` timed batches, and prints tokens/s with the
process's user and system CPU (cores) and minor page faults per second. Processes
alternate between the modes: `default` (glibc's mmap threshold, which moves with the
process's allocation history), `fixed` (MALLOC_MMAP_THRESHOLD_=32 MiB,
MALLOC_TRIM_THRESHOLD_=1 GiB), `thp` (PyTorch's THP_MEM_ALLOC_ENABLE=1: tensors of 2 MiB
and more are 2 MiB-aligned and madvised for transparent huge pages, which this kernel
gives only on madvise), and `fixed+thp`.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

FIXED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
THP = {"THP_MEM_ALLOC_ENABLE": "1"}
MODES = {"default": {}, "fixed": FIXED, "thp": THP, "fixed+thp": FIXED | THP}


def child(work_dir: str, num_batches: int) -> None:
    """One measurement in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import speed

    speed.start_ray(False)
    b = speed.Bench(speed.parse_args(["--work-dir", work_dir]), Path(work_dir))
    t0, w0 = os.times(), time.perf_counter()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rate = b.plain(num_batches=num_batches)()
    t1, wall = os.times(), time.perf_counter() - w0
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / wall
    print(f"RESULT {rate:.0f} tok/s, user {(t1.user - t0.user) / wall:.2f} cores, "
          f"system {(t1.system - t0.system) / wall:.2f}, {faults / 1000:.1f}k minor faults/s", flush=True)


def main() -> int:
    """Alternate fresh processes with default and fixed malloc thresholds."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=3, help="processes of each kind")
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--modes", default="default,fixed", help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--work-dir", default="/tmp/raymt-malloc-modes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.work_dir, args.batches)
        return 0
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown --modes {sorted(unknown)}; choose from {list(MODES)}")
    for _ in range(args.processes):
        for name in modes:
            env = {k: v for k, v in os.environ.items() if k not in FIXED | THP} | MODES[name]
            out = subprocess.run([sys.executable, __file__, "--child", "--work-dir", args.work_dir,
                                  "--batches", str(args.batches)], env=env, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), out.stderr[-300:])
            print(f"{name}: {line.removeprefix('RESULT ')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
