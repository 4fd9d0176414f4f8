"""Where the Ray-overhead gap comes from: the plain loop moved one step at a time toward raymt.

    python benchmarks/overhead_split.py [--repeats 2] [--raymt]

Each variant trains the `small` model on the same Multi30k batches (the ones `speed.py`'s
Ray-overhead run times, after its first log interval) with 2 threads, alternating order:

| variant | the plain loop, but |
|---|---|
| plain | in this process's main thread, batches read beforehand (speed.py's plain loop) |
| plain+stream | batches from a live `TrainStream` (its reader thread reads, cuts, collates) |
| ray-task | in a Ray worker process (a task with 2 CPUs), batches read beforehand |
| ray-task+stream | in a Ray worker process, batches from a live stream |

| raymt | raymt's own run on Ray Train (1 worker x 2 CPUs), as speed.py runs it |
| plain+idle-train | in this process, while a Ray Train run whose one worker sleeps is up (its controller, worker and helper actors tick) |

`--variants plain,raymt` picks some. The Ray cluster is started as speed.py starts it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402


def measure(corpus: str, preset: str, live: bool, skip: int, count: int, threads: int) -> dict:
    """Tokens/s of the plain loop over batches [skip, skip + count) of rank 0's epoch 0."""
    from raymt.config import Config
    from raymt.model import Transformer

    torch.set_num_threads(threads)
    model_cfg = speed.model_config(preset)
    torch.manual_seed(0)
    loop = speed.PlainLoop(Transformer(model_cfg, speed.vocab_size(Path(corpus))), Config(model=model_cfg), "cpu")
    if live:
        stream, batches = live_batches(Path(corpus), loop, skip, count)
    else:
        stream, batches = None, speed.stream_batches(Path(corpus), 0, 1, limit=skip + count)
        loop.tokens_per_s(batches[:10])  # warm-up, as speed.py
        batches = batches[skip:]
    t0 = time.process_time()
    rate = loop.tokens_per_s(batches)
    out = {"tokens_per_s": rate, "cpu_s": time.process_time() - t0, "torch_threads": torch.get_num_threads(),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid()}
    if stream is not None:
        out["stream_wait_s"] = stream.busy_s
        stream.close()
    return out


def live_batches(corpus: Path, loop: "speed.PlainLoop", skip: int, count: int):
    """A started stream whose first ten batches warmed `loop` up and first `skip` are consumed; the next `count`."""
    stream = speed.train_stream(corpus, 0, 1).start()
    it = iter(stream)
    loop.tokens_per_s(list(itertools.islice(it, 10)))
    for _ in range(skip - 10):
        next(it)
    time.sleep(2.0)  # the reader refills its queue
    stream.busy_s = 0.0
    return stream, itertools.islice(it, count)


def idle_loop(config: dict) -> None:
    """A Ray Train worker that does nothing until told to stop."""
    Path(config["started"]).touch()
    while not Path(config["stop"]).exists():
        time.sleep(0.2)


def beside_idle_train(measure_fn, work: Path) -> dict:
    """Run `measure_fn` in this process while a one-worker Ray Train run sleeps."""
    import threading

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started, stop = work / "idle-started", work / "idle-stop"
    started.unlink(missing_ok=True)
    stop.unlink(missing_ok=True)
    trainer = TorchTrainer(idle_loop, train_loop_config={"started": str(started), "stop": str(stop)},
                           scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=str(work / "runs"), name="idle-train"))
    thread = threading.Thread(target=trainer.fit, daemon=True)
    thread.start()
    while not started.exists():
        time.sleep(0.5)
    time.sleep(5.0)  # past the run's start-up
    try:
        return measure_fn()
    finally:
        stop.touch()
        thread.join()


def raymt(corpus: Path, preset: str, threads: int, steps: int, log_every: int, runs: Path) -> dict:
    """A fresh raymt run on Ray Train, 1 worker with every thread (speed.py's `ray_overhead` run)."""
    run = speed.raymt_run(corpus, speed.model_config(preset), 1, float(threads), steps, log_every,
                          runs, "overhead-split", False)
    return {"tokens_per_s": run["tokens_per_s"], "run": run}


def main(argv: Optional[list[str]] = None) -> int:
    """Run the variants alternated, print tokens/s each and ratios to `plain`."""
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ray-steps", type=int, default=200)
    p.add_argument("--variants", default="plain,plain+stream,ray-task,ray-task+stream,raymt")
    speed.shared_flags(p, str(Path(tempfile.gettempdir()) / "raymt-overhead-split"),
                       "benchmarks/results/overhead_split.json")
    args = p.parse_args(argv)

    threads = torch.get_num_threads()
    work = Path(args.work_dir)
    corpus = speed.prepare_multi30k(Path(args.data), work / "corpus")
    skip = max(1, args.ray_steps // 6)
    count = args.ray_steps - skip
    os.environ["PYTHONPATH"] = os.pathsep.join(  # the Ray tasks import this module's helpers
        filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]))
    speed.start_ray(False)
    remote = ray.remote(num_cpus=threads)(measure)
    variants = {
        "plain": lambda: measure(str(corpus), args.preset, False, skip, count, threads),
        "plain+stream": lambda: measure(str(corpus), args.preset, True, skip, count, threads),
        "ray-task": lambda: ray.get(remote.remote(str(corpus), args.preset, False, skip, count, threads)),
        "ray-task+stream": lambda: ray.get(remote.remote(str(corpus), args.preset, True, skip, count, threads)),
        "raymt": lambda: raymt(corpus, args.preset, threads, args.ray_steps, skip, work / "runs"),
        "plain+idle-train": lambda: beside_idle_train(
            lambda: measure(str(corpus), args.preset, False, skip, count, threads), work),
    }
    chosen = args.variants.split(",")
    if set(chosen) - set(variants) or "plain" not in chosen:
        raise SystemExit(f"overhead_split.py: --variants takes plain and any of {', '.join(variants)}")
    variants = {k: v for k, v in variants.items() if k in chosen}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            results[name].append(variants[name]())
            print(f"{name}: {results[name][-1]['tokens_per_s']:.0f} tok/s", flush=True)
    base = statistics.median(x["tokens_per_s"] for x in results["plain"])
    print("\n| variant | tok/s (each repeat) | median / plain |\n|---|---|---|")
    for name, runs in results.items():
        rates = [x["tokens_per_s"] for x in runs]
        print(f"| {name} | {' / '.join(f'{x:.0f}' for x in rates)} | {statistics.median(rates) / base:.3f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"threads": threads, "torch": torch.__version__,
                                           "ray": ray.__version__, "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
