"""GPU check: raymt's goal measured on one GPU in at most 8 minutes (MFU through Ray Train).

    python benchmarks/gpu_check.py [--corpus PREPARED | --multi30k DIR] [--out DIR] [--work DIR]
    python benchmarks/gpu_check.py --cpu --tiny      # the CPU form (the default test suite adds --skip-resume; CI runs it whole)
    python benchmarks/gpu_check.py --plan [--tiny]   # caps, sizes, training commands, configs (JSON)
    python benchmarks/gpu_check.py --report OUT      # the table again, from OUT/gpu_check.json

Parts, in this order, each in its own process under its own cap (`FULL.caps`, seconds; with
the start-up they sum to TOTAL_S = 480, so nothing waits on the total; tests check it); every
figure goes to OUT/gpu_check.json as soon as its part ends, with the part's log beside it:

| part | what |
|---|---|
| matmul | the card's name, a measured bf16 matmul (fp16 on cards without bf16) and its datasheet dense peak (`raymt.profiling.PEAKS`) |
| ray | `raymt.train.run` of `python -m raymt.train --gpu` flags, so with the `--gpu` defaults (`raymt.config.device_defaults`; one worker, 200 steps, validation at the end only, no test decoding): target tok/s, data_share and peak GPU memory (if logged) from its metrics.csv |
| plain | the ray run's config, initial weights and batches through `raymt.trainer.Trainer` in one process (a second thread, as Ray Train runs it; no Ray): tok/s, peak GPU memory, host syncs per step over one more log interval (`torch.cuda.set_sync_debug_mode("warn")`) |
| compiled | the ray part with `train.compile=true` |
| resume | a short run with `train.max_failures=1`; one Ray Train worker is SIGKILLed after the first registered checkpoint; the group restarts from it on the GPU and trains past it (exit 0) |
| evaluate | `python -m raymt.evaluate --gpu` on the ray run's best checkpoint and the raw test set |

MFU = target tok/s x training FLOPs per target token (`raymt.profiling.train_flops` over
the timed steps' batches, the same in every run) / the datasheet peak ("peak") or the
measured matmul ("matmul"); the peaks, the matmul, MFU, sync counting and a run's rates from
its metrics.csv are `raymt.profiling`'s (tests/test_profiling.py).
The table (Markdown) has the rows `gpu`, `matmul`, `setup`, `tgt tok/s`, `mfu` (columns
`peak` and `matmul`), `goal` (MFU >= 40% of peak through Ray Train), `ray/plain`,
`data_share`, `peak GPU MiB`, `syncs/step`, `resume` and `evaluate`. The script exits 1
when the ray run, resume or evaluate failed; a part that fails or runs out of time says
so in its row.

`--cpu --tiny` takes the same code path on the CPU: the tiny preset, a generated corpus,
tens of steps, the CPU defaults; peak is n/a there (the matmul column is a matmul measured
in raymt's CPU dtype), syncs/step n/a, and the compiled run is skipped (inductor takes ~75 s to compile
the tiny model on two CPU cores; `--compiled` runs it anyway).

On a lent GPU (the device tool; ../shared/gpu/README.md: no Ray and no package index there,
../shared does not travel), from the project root here:

    ../shared/gpu/bundle.sh                                    # -> .gpu/site.tar.xz
    python -m raymt.data prepare --train ../shared/data/multi30k/train \\
        --valid ../shared/data/multi30k/val --test ../shared/data/multi30k/test_2016_flickr \\
        --vocab-size 8000 --out .gpu/multi30k-prepared
    mkdir -p .gpu/multi30k && cp ../shared/data/multi30k/test_2016_flickr.*.gz .gpu/multi30k/

then one `run` with carry [".gpu"] and timeout_s 540:

    mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD \\
    PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0; python3 benchmarks/gpu_check.py \\
    --corpus .gpu/multi30k-prepared --multi30k .gpu/multi30k --out $OUT/gpu_check --work /tmp/gpu_check

(without --corpus it prepares --multi30k DIR itself, ~31 s on that machine, which then also
needs train.*.gz and val.*.gz there). The table, the logs and gpu_check.json come back
under $OUT; checkpoints stay in --work.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
RESULTS = "gpu_check.json"
TOTAL_S = 480  # one GPU session's share for this check: 8 of its 15 device minutes
RUNS = ("ray", "compiled", "plain")
GOAL_MFU = 0.40  # of the datasheet bf16 peak, through Ray Train (issue 27)
FLOPS_BATCHES = 50  # a Ray run's FLOPs per token are estimated over its first batches
CORRECTNESS = ("ray", "resume", "evaluate")  # a failure here: exit status 1


@dataclass(frozen=True)
class Sizes:
    """Everything the GPU and the tiny CPU form differ in."""

    preset: str
    steps: int  # the ray and plain runs' steps; their first log interval is warm-up
    log_every: int
    max_minutes: float  # the ray run's own time bound (train.max_minutes), inside its cap
    compiled_minutes: float  # the same for the compiled run (its first interval compiles)
    compiled: bool  # whether the compiled run happens
    resume_steps: int  # the resume run's max_steps; a checkpoint every resume_every steps
    resume_every: int
    matmul_n: int
    vocab_size: int  # of a corpus the script prepares itself
    caps: dict  # seconds per part, "start-up" included


# On one H200 (../shared/gpu/README.md, benchmarks/NOTES.md): Ray's start ~8 s, a Train
# worker ~10 s, base at 32k tokens ~72 ms a step eager, Multi30k's preparation ~31 s.
FULL = Sizes(
    preset="base",
    steps=200,
    log_every=25,
    max_minutes=1.0,
    compiled_minutes=1.3,
    compiled=True,
    resume_steps=60,
    resume_every=20,
    matmul_n=8192,
    vocab_size=8000,
    caps={
        "start-up": 5,
        "prepare": 40,
        "matmul": 25,
        "ray": 95,
        "plain": 45,
        "compiled": 120,
        "resume": 95,
        "evaluate": 55,
    },
)
TINY = Sizes(
    preset="tiny",
    steps=24,
    log_every=6,
    max_minutes=5.0,
    compiled_minutes=5.0,
    compiled=False,
    resume_steps=20,
    resume_every=10,
    matmul_n=256,
    vocab_size=256,
    caps={
        "start-up": 10,
        "prepare": 60,
        "matmul": 30,
        "ray": 120,
        "plain": 60,
        "compiled": 300,
        "resume": 180,
        "evaluate": 120,
    },
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--multi30k",
        default=str(MULTI30K),
        help="raw Multi30k (train/val/test_2016_flickr .en/.de .gz); evaluate reads its test set",
    )
    p.add_argument("--corpus", help="a corpus already made by `python -m raymt.data prepare` (skips preparing)")
    p.add_argument("--out", default="gpu_check", help="logs and gpu_check.json go here")
    p.add_argument("--work", help="runs (checkpoints), evaluation output and a prepared corpus (default: --out)")
    p.add_argument("--cpu", action="store_true", help="train and measure on the CPU (gloo), not the GPU")
    p.add_argument("--tiny", action="store_true", help="tiny preset, generated corpus, tens of steps")
    p.add_argument("--compiled", action="store_true", help="run the compiled part with --tiny too")
    p.add_argument(
        "--skip-resume",
        action="store_true",
        help="leave the resume part out (the default test suite's form of --cpu --tiny; CI runs it whole)",
    )
    p.add_argument(
        "--timeout-scale", type=float, default=1.0, help="multiply every part's cap (a slow or busy machine)"
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the caps, sizes, training commands and their configs as JSON, and run nothing",
    )
    p.add_argument("--report", metavar="OUT", help="print the table of OUT/gpu_check.json, and run nothing")
    p.add_argument("--part", choices=("matmul", "plain", "train"), help=argparse.SUPPRESS)  # a part's process
    p.add_argument("--name", help=argparse.SUPPRESS)  # the train part's run name
    p.add_argument("train_flags", nargs="*", help=argparse.SUPPRESS)  # the train part's raymt.train flags
    return p.parse_args(argv)


# ---------------------------------------------------------------- processes


class Budget:
    """Per-part caps under one deadline for the whole check."""

    def __init__(self, caps: dict, total: float):
        self.caps = caps
        self.deadline = time.monotonic() + total

    def __getitem__(self, part: str) -> float:
        """Seconds `part` may take: its cap, or what is left of the total."""
        return max(10.0, min(self.caps[part], self.deadline - time.monotonic()))


def run_logged(
    cmd: list[str], log: Path, timeout: float, watch: Optional[Callable[[subprocess.Popen, float], None]] = None
) -> tuple[Optional[int], str]:
    """Run `cmd` with its output in `log`, its process group killed after `timeout` s; (rc or None, output).

    `watch(proc, deadline)` runs while it does (e.g. to kill one of its workers)."""
    deadline = time.monotonic() + timeout
    with log.open("w") as sink:
        sink.write("$ " + " ".join(cmd) + "\n")
        sink.flush()
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            if watch is not None:
                watch(proc, deadline)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
            proc.wait()
            return None, log.read_text()
    return proc.returncode, log.read_text()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the local Ray a driver starts, and its workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    """A process's command line ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ray_processes(driver: int) -> list[int]:
    """The processes of a driver's Ray: the local instance it started, or when it attached to a
    running one (RAY_ADDRESS host:port, as in the test suite) that cluster's raylet on this machine."""
    address = os.environ.get("RAY_ADDRESS")
    commands = {int(p.parent.name): cmdline(int(p.parent.name)) for p in Path("/proc").glob("[0-9]*/cmdline")}
    raylets = [
        pid
        for pid, cmd in commands.items()
        if address and cmd.split(" ", 1)[0].endswith("/raylet") and f"--gcs-address={address} " in cmd
    ]
    return [p for root in (driver, *raylets) for p in descendants(root)]


def num_checkpoints(run_dir: Path) -> int:
    """Checkpoints Ray Train has registered for the run (0 while its snapshot is missing or half-written)."""
    try:
        return len(json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())["checkpoint_results"])
    except (OSError, ValueError, KeyError):
        return 0


def tail(text: str) -> str:
    """The last non-empty line of a log, for the table."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


def part_cmd(args: argparse.Namespace, part: str, *extra: str) -> list[str]:
    """This script as one part's process."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--part",
        part,
        "--out",
        args.out,
        "--work",
        args.work,
        "--corpus",
        args.corpus,
        *(["--cpu"] if args.cpu else []),
        *(["--tiny"] if args.tiny else []),
        *extra,
    ]


def run_part(
    args: argparse.Namespace, budget: Budget, name: str, cmd: list[str], watch: Optional[Callable] = None
) -> dict:
    """A part's process under its cap: what it wrote to OUT/NAME.json, with an error if it failed."""
    result_file = Path(args.out) / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cap = budget[name]
    t0 = time.monotonic()
    rc, text = run_logged(cmd, Path(args.out) / f"{name}.log", cap, watch)
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    if rc != 0:
        result["error"] = f"timed out after {cap:.0f} s" if rc is None else f"rc {rc}: {tail(text)}"
    result.update(seconds=round(time.monotonic() - t0, 1), log=text)
    return result


def write_part(args: argparse.Namespace, name: str, result: dict) -> None:
    """Inside a part's process: save what it measured so far (a part cut by its cap keeps it)."""
    (Path(args.out) / f"{name}.json").write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------- data


def write_tiny_text(directory: Path) -> Path:
    """Generated en-de pairs in Multi30k's layout (train, val, test_2016_flickr; .gz)."""
    from raymt.data.builtin import generate

    directory.mkdir(parents=True, exist_ok=True)
    for name, size, seed in (("train", 2000, 1), ("val", 60, 2), ("test_2016_flickr", 60, 3)):
        for lang, lines in zip(("en", "de"), generate(size, "en", "de", seed=seed)):
            with gzip.open(directory / f"{name}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
    return directory


def prepare(raw: Path, out: Path, log: Path, vocab_size: int, timeout: float) -> tuple[Optional[Path], str]:
    """`python -m raymt.data prepare` of `raw` into `out`: (corpus or None, why not)."""
    if not (raw / "train.en.gz").exists():
        return None, f"no {raw}/train.en.gz: pass --multi30k DIR or --corpus PREPARED"
    cmd = [
        sys.executable,
        "-m",
        "raymt.data",
        "prepare",
        "--train",
        str(raw / "train"),
        "--valid",
        str(raw / "val"),
        "--test",
        str(raw / "test_2016_flickr"),
        "--vocab-size",
        str(vocab_size),
        "--out",
        str(out),
        "--overwrite",
    ]
    rc, text = run_logged(cmd, log, timeout)
    return (out, "") if rc == 0 else (None, f"prepare failed (rc {rc}): {tail(text)}")


def run_batches(cfg, corpus: str, count: int, pin_memory: bool = False) -> list:
    """The first `count` batches a lone worker of a fresh run trains on, epoch after epoch (CPU)."""
    from raymt.data import format as corpus_format
    from raymt.data.epoch import Mix, Position
    from raymt.data.stream import TrainStream

    files = Mix.of_shards(corpus_format.open_corpus(corpus).shards())
    out: list = []
    for epoch in range(count):  # an epoch holds at least one batch
        stream = TrainStream(
            files, cfg.data, cfg.train.seed, rank=0, world_size=1, position=Position(epoch), pin_memory=pin_memory
        )
        out += [batch for batch, _ in zip(stream, range(count - len(out)))]
        stream.close()
        if len(out) == count:
            return out
    return out


# ---------------------------------------------------------------- the parts' processes


def cpu_name() -> str:
    """The CPU's model name (Linux), else 'cpu'."""
    try:
        found = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    except OSError:
        found = None
    return f"{found.group(1).strip() if found else 'cpu'} ({os.cpu_count()} CPUs)"


def part_matmul(args: argparse.Namespace, sizes: Sizes) -> int:
    """The device's name, its datasheet peak and a measured matmul in the peak's dtype."""
    import torch

    from raymt.profiling import gpu_peak, matmul_tflops

    result: dict = {"torch": torch.__version__}
    if args.cpu:  # no datasheet: the matmul column is the measured rate of raymt's CPU dtype
        from benchmarks.speed import trains_in_bf16
        from raymt.cluster import machine_cpus, plan

        torch.set_num_threads(plan(1, total={"CPU": machine_cpus()}).num_threads)  # a worker's threads
        result.update(gpu=cpu_name(), card=None, peak_tflops=None, dtype="bf16" if trains_in_bf16("cpu") else "fp32")
    else:
        result.update(gpu_peak(0))
    write_part(args, "matmul", result)  # the name and peak stand even if the matmul hangs
    tflops = matmul_tflops("cpu" if args.cpu else "cuda", result["dtype"], sizes.matmul_n)
    write_part(args, "matmul", {**result, "matmul_tflops": tflops, "n": sizes.matmul_n})
    return 0


def train_config(args: argparse.Namespace):
    """The config `python -m raymt.train FLAGS` would run (device defaults included)."""
    from raymt.flags import build_config
    from raymt.train import parse_args as train_args

    return build_config(train_args(args.train_flags))


def part_train(args: argparse.Namespace, sizes: Sizes) -> int:
    """`raymt.train.run` of the train flags, without test decoding; FLOPs per token of its batches."""
    from raymt.data import format as corpus_format
    from raymt.profiling import flops_per_token
    from raymt.train import run

    cfg = train_config(args)
    vocab = corpus_format.open_corpus(args.corpus).tokenizer().vocab_size
    t0 = time.perf_counter()
    # Over its first batches (seconds on the CPU); the plain part gives those of the timed steps exactly.
    batches = run_batches(cfg, args.corpus, min(cfg.train.max_steps, FLOPS_BATCHES))
    result = {
        "flops_per_token": flops_per_token(cfg.model, vocab, batches),
        "flops_s": round(time.perf_counter() - t0, 1),
        "max_tokens": cfg.data.max_tokens,
        "pad_multiple": cfg.data.pad_multiple,
        "compile": cfg.train.compile,
        "lr": cfg.optim.lr,
        "warmup_steps": cfg.optim.warmup_steps,
    }
    write_part(args, args.name, result)
    summary = run(cfg, score_test=False)
    write_part(
        args,
        args.name,
        {
            **result,
            "metrics_csv": summary["metrics_csv"],
            "best_checkpoint": summary["best_checkpoint"],
            "wall_time_s": summary["wall_time_s"],
        },
    )
    return 0


def in_a_thread(fn: Callable[[], int]) -> int:
    """fn() in a second thread, as Ray Train runs the loop (a main-thread loop can run at half speed on
    CPUs, benchmarks/NOTES.md "A slow mode of glibc's main arena"); its exception is raised here."""
    import threading

    outcome: dict = {}

    def target() -> None:
        try:
            outcome["rc"] = fn()
        except BaseException as err:  # raised again in the calling thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name="plain-loop")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["rc"]


def worker_precision(device, cfg, vocab: int) -> tuple[Callable, Optional[object]]:
    """(autocast factory, fp16 loss scaler or None) as a Ray Train worker of `cfg` chooses them."""
    from raymt.precision import for_training

    precision = for_training(device, cfg, vocab).apply()  # TF32 flags as the worker sets them
    return precision.autocast, precision.grad_scaler()


def part_plain(args: argparse.Namespace, sizes: Sizes) -> int:
    """The plain loop in a second thread, as Ray Train runs its loop."""
    return in_a_thread(lambda: plain_loop(args))


def plain_loop(args: argparse.Namespace) -> int:
    """The ray run's model on its batches in this process (raymt.trainer, no Ray): tok/s, memory, syncs."""
    import torch

    from raymt.cluster import machine_cpus, plan
    from raymt.data import format as corpus_format
    from raymt.model import build_model
    from raymt.profiling import count_syncs, flops_per_token
    from raymt.trainer import Trainer, compile_model, restore_training

    ray_cfg = train_config(args)  # the ray run's config, its device defaults included
    warm, steps = ray_cfg.train.log_every, ray_cfg.train.max_steps  # the ray run's rate leaves out warm
    # The loop goes on for one log interval more, to count syncs in it; the part's cap bounds its time.
    cfg = replace(ray_cfg, train=replace(ray_cfg.train, max_steps=steps + warm, max_minutes=None))
    gpu = cfg.train.use_gpu
    device = torch.device("cuda" if gpu else "cpu")
    # The threads a Ray Train worker of this run gets on this machine.
    torch.set_num_threads(
        plan(1, gpu, cfg.train.cpus_per_worker, total={"CPU": machine_cpus(), "GPU": int(gpu)}).num_threads
    )
    vocab = corpus_format.open_corpus(args.corpus).tokenizer().vocab_size
    batches = run_batches(cfg, args.corpus, cfg.train.max_steps, pin_memory=gpu)
    torch.manual_seed(cfg.train.seed)  # the worker's initial weights
    model, optimizer, scheduler = restore_training(
        build_model(cfg.model, vocab), cfg, None, None, lambda m: m.to(device)
    )
    if cfg.train.compile:
        model = compile_model(model)
    autocast, scaler = worker_precision(device, cfg, vocab)
    trainer = Trainer(cfg, model, optimizer, scheduler, device, autocast=autocast, scaler=scaler)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train_epoch(batches[:warm])
    sync()
    t0 = time.perf_counter()
    trainer.train_epoch(batches[warm:steps])
    sync()
    seconds = time.perf_counter() - t0
    result = {
        "tokens_per_s": sum(b.num_tokens for b in batches[warm:steps]) / seconds,
        "steps": steps - warm,
        "flops_per_token": flops_per_token(cfg.model, vocab, batches[warm:steps]),
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if gpu else None,
    }
    write_part(args, "plain", result)
    if gpu:  # the next log interval, its progress line's sync included
        num_syncs = count_syncs(lambda: trainer.train_epoch(batches[steps:]))  # no synchronize() of ours
        result["syncs_per_step"] = num_syncs / (trainer.step - steps)
        write_part(args, "plain", result)
    return 0


# ---------------------------------------------------------------- the parts, from the main process


def new_run(args: argparse.Namespace, name: str) -> None:
    """Remove an old run `name` of --work (a new one starts from scratch)."""
    shutil.rmtree(Path(args.work) / "runs" / name, ignore_errors=True)


def train_flags(args: argparse.Namespace, sizes: Sizes, name: str, steps: int, *extra: str) -> list[str]:
    """`python -m raymt.train` flags of a run `name` on one worker of the device."""
    return [
        *([] if args.cpu else ["--gpu"]),
        "--num-workers",
        "1",
        "--preset",
        sizes.preset,
        "--corpus",
        args.corpus,
        "--storage-path",
        str(Path(args.work) / "runs"),
        "--name",
        name,
        "--max-steps",
        str(steps),
        *extra,
    ]


def speed_flags(sizes: Sizes, minutes: float) -> list[str]:
    """One validation, at the end (it would otherwise land inside a timed interval), and a time bound."""
    return [
        "--max-minutes",
        str(minutes),
        "--set",
        f"train.log_every={sizes.log_every}",
        "--set",
        f"train.eval_every={sizes.steps}",
    ]


def train_cmd(args: argparse.Namespace, sizes: Sizes, name: str) -> list[str]:
    """The process of training part `name` (ray, compiled, plain or resume) with its run's raymt.train flags."""
    if name == "resume":
        flags = train_flags(
            args,
            sizes,
            name,
            sizes.resume_steps,
            "--set",
            f"train.eval_every={sizes.resume_every}",
            "--set",
            f"train.log_every={max(1, sizes.resume_every // 2)}",
            "--set",
            "train.max_failures=1",
        )
    else:
        minutes = sizes.compiled_minutes if name == "compiled" else sizes.max_minutes
        compiled = ["--set", "train.compile=true"] if name == "compiled" else []
        flags = train_flags(args, sizes, name, sizes.steps, *speed_flags(sizes, minutes), *compiled)
    if name == "plain":
        return part_cmd(args, "plain", "--", *flags)
    return part_cmd(args, "train", "--name", name, "--", *flags)


def check_speed_run(args: argparse.Namespace, sizes: Sizes, budget: Budget, name: str) -> dict:
    """A Ray Train run with the device defaults: its figures from metrics.csv."""
    from raymt.profiling import metrics_figures

    new_run(args, name)
    result = run_part(args, budget, name, train_cmd(args, sizes, name))
    precision = re.search(r"forward pass in (.+)", result["log"])
    result["precision"] = precision.group(1).strip() if precision else None
    csv_file = Path(args.work) / "runs" / name / "logs" / "metrics.csv"
    if csv_file.exists():
        shutil.copy(csv_file, Path(args.out) / f"{name}-metrics.csv")  # --work may not come back
        figures = metrics_figures(str(csv_file))
        result.update({k: v for k, v in figures.items() if k != "error" or "error" not in result})
    return result


def kill_a_worker_after_checkpoint(run_dir: Path, killed: dict) -> Callable:
    """A `watch` for run_logged: once a checkpoint is registered, SIGKILL one Ray Train worker of the run."""

    def watch(proc: subprocess.Popen, deadline: float) -> None:
        while num_checkpoints(run_dir) < 1:
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.2)
        workers = [p for p in ray_processes(proc.pid) if "RayTrainWorker" in cmdline(p)]
        if workers:
            os.kill(workers[0], signal.SIGKILL)
            killed.update(pid=workers[0], after_checkpoints=num_checkpoints(run_dir))

    return watch


def logged_steps(text: str) -> list[int]:
    """Steps of the progress and validation lines ("step N/M | ...", "step N | valid ...") in order."""
    return [int(s) for s in re.findall(r"step (\d+)(?:/| \|)", text)]


def check_resume(args: argparse.Namespace, sizes: Sizes, budget: Budget) -> dict:
    """A worker SIGKILLed after the first checkpoint: the group restarts from it and trains on past it."""
    killed: dict = {}
    new_run(args, "resume")
    watch = kill_a_worker_after_checkpoint(Path(args.work) / "runs" / "resume", killed)
    result = run_part(args, budget, "resume", train_cmd(args, sizes, "resume"), watch)
    text = result["log"]
    resumed = re.search(r"resuming at step (\d+)", text)
    after = logged_steps(text[resumed.end() :]) if resumed else []
    result.update(
        killed=killed, resumed_at=int(resumed.group(1)) if resumed else None, last_step=max(after, default=None)
    )
    checks = {
        "a worker was killed": bool(killed),
        "exit 0": "error" not in result,
        "restarted from a checkpoint": bool(resumed and int(resumed.group(1)) > 0),
        "trained past it": bool(after and resumed and max(after) > int(resumed.group(1))),
    }
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        result["error"] = f"not: {', '.join(failed)}" + (f" ({result['error']})" if "error" in result else "")
    return result


def check_evaluate(args: argparse.Namespace, checkpoint: Optional[str], budget: Budget) -> dict:
    """`python -m raymt.evaluate` on a checkpoint of this check, one actor on the device."""
    if checkpoint is None:
        return {"error": "no checkpoint (every training run failed)"}
    device = ["--cpus-per-actor", "1"] if args.cpu else ["--gpu"]
    cmd = [
        sys.executable,
        "-m",
        "raymt.evaluate",
        "--checkpoint",
        checkpoint,
        "--test",
        str(Path(args.multi30k) / "test_2016_flickr"),
        "--num-actors",
        "1",
        *device,
        "--output-dir",
        str(Path(args.work) / "evaluate"),
    ]
    t0 = time.monotonic()
    rc, text = run_logged(cmd, Path(args.out) / "evaluate.log", budget["evaluate"])
    report = Path(args.work) / "evaluate" / "report.json"
    if rc != 0 or not report.exists():
        return {"error": "timed out" if rc is None else f"rc {rc}: {tail(text)}"}
    ((name, scores),) = json.loads(report.read_text())["test_sets"].items()
    return {
        "test_set": name,
        "bleu": scores["bleu"],
        "sentences": scores["num_sentences"],
        "checkpoint": checkpoint,
        "seconds": round(time.monotonic() - t0, 1),
    }


# ---------------------------------------------------------------- report


def flop_rate(tflops: float) -> str:
    """A FLOP/s figure in TFLOP/s, or GFLOP/s below one TFLOP/s (CPUs)."""
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1000:,.1f} GFLOP/s"


def pct(x: Optional[float]) -> str:
    """A share as a percentage, or n/a."""
    return "n/a" if x is None else f"{x:.1%}"


def table_rows(parts: dict, cpu: bool) -> list[tuple[str, str, str, str, str]]:
    """The report's rows: (row, run, value, peak, matmul)."""
    from raymt.profiling import mfu

    mm = parts.get("matmul", {})
    peak = mm["peak_tflops"] * 1e12 if mm.get("peak_tflops") else None
    measured = mm["matmul_tflops"] * 1e12 if mm.get("matmul_tflops") else None
    no_peak = "n/a (CPU)" if cpu else "n/a (unknown card)"
    rows = [
        ("gpu", "-", mm.get("gpu") or mm.get("error", "?"), mm.get("card") or no_peak, mm.get("capability", "-")),
        (
            "matmul",
            "-",
            f"{mm.get('dtype', '?')}, n={mm.get('n', '?')}",
            f"{mm['peak_tflops']:.0f} TFLOP/s {mm['dtype']} (datasheet, dense)" if peak else no_peak,
            f"{flop_rate(measured / 1e12)} (measured)" if measured else mm.get("error", "n/a"),
        ),
    ]
    # FLOPs per token: the plain part's, over exactly the timed steps of the runs that cut the
    # same batches (the ray run's padding); else each run's own estimate (on a CPU the compiled
    # run pads to the shape ladder: 28% more FLOPs per target token than the others).
    exact, same_pad = parts.get("plain", {}).get("flops_per_token"), parts.get("ray", {}).get("pad_multiple")
    flops = {
        run: (exact if parts.get(run, {}).get("pad_multiple", same_pad) == same_pad else None)
        or parts.get(run, {}).get("flops_per_token")
        for run in RUNS
    }
    for run in ("ray", "compiled"):
        p = parts.get(run, {})
        if p.get("max_tokens"):
            rows.append(
                (
                    "setup",
                    run,
                    f"{p['max_tokens']} tokens/worker, pad_multiple {p['pad_multiple']}, lr "
                    f"{p['lr']:.2g}, warmup {p['warmup_steps']}; {p.get('precision') or '?'}",
                    "",
                    "",
                )
            )
    for run in RUNS:
        p = parts.get(run, {})
        value = p.get("skipped") or (
            f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") else "error: " + p.get("error", "no figure")
        )
        rows.append(("tgt tok/s", run, value if run in parts else "not run (yet)", "", ""))
    for run in RUNS:
        p = parts.get(run, {})
        tok_s = p.get("tokens_per_s")
        rows.append(("mfu", run, "", pct(mfu(tok_s, flops[run], peak)), pct(mfu(tok_s, flops[run], measured))))
    through_ray = {run: mfu(parts.get(run, {}).get("tokens_per_s"), flops[run], peak) for run in ("ray", "compiled")}
    best = max((v for v in through_ray.values() if v is not None), default=None)
    rows.append(
        (
            "goal",
            "-",
            no_peak
            if peak is None
            else "n/a (no Ray run)"
            if best is None
            else f"{'met' if best >= GOAL_MFU else 'not met'}: best MFU through Ray Train {best:.1%} of peak "
            f"(goal {GOAL_MFU:.0%})",
            "",
            "",
        )
    )
    ray, plain = parts.get("ray", {}), parts.get("plain", {})
    ratio = (
        f"{ray['tokens_per_s'] / plain['tokens_per_s']:.3f}"
        if ray.get("tokens_per_s") and plain.get("tokens_per_s")
        else "n/a"
    )
    rows.append(("ray/plain", "ray", ratio, "", ""))
    for run in ("ray", "compiled"):
        share = parts.get(run, {}).get("data_share")
        rows.append(("data_share", run, "n/a" if share is None else f"{share:.3f}", "", ""))
    for run in RUNS:
        mb = parts.get(run, {}).get("peak_gpu_mb")
        rows.append(("peak GPU MiB", run, f"{mb:,.0f}" if mb else "n/a" if cpu else "n/a (not logged)", "", ""))
    syncs = plain.get("syncs_per_step")
    rows.append(("syncs/step", "plain", "n/a (CPU)" if cpu else "n/a" if syncs is None else f"{syncs:.3f}", "", ""))
    rows.append(("resume", "resume", describe(parts, "resume"), "", ""))
    rows.append(("evaluate", "evaluate", describe(parts, "evaluate"), "", ""))
    return rows


def describe(parts: dict, name: str) -> str:
    """The resume or evaluate row's text."""
    r = parts.get(name)
    if r is None:
        return "not run (yet)"
    if "error" in r:
        return f"FAILED: {r['error']}"
    if "skipped" in r:
        return r["skipped"]
    if name == "resume":
        return (
            f"ok: worker {r['killed']['pid']} killed after checkpoint {r['killed']['after_checkpoints']}; "
            f"restarted at step {r['resumed_at']}, trained to step {r['last_step']}"
        )
    return f"ok: {r['test_set']} BLEU {r['bleu']:.2f} ({r['sentences']} sentences, {r['seconds']:.0f} s)"


def markdown(rows: list[tuple[str, ...]]) -> str:
    """A Markdown table with a header row."""
    lines = ["| row | run | value | peak | matmul |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def save(out: Path, args: argparse.Namespace, sizes: Sizes, parts: dict) -> None:
    """gpu_check.json: every part's figures so far and the table they make (logs stay in OUT/*.log)."""
    shown = {name: {k: v for k, v in p.items() if k != "log"} for name, p in parts.items()}
    (out / RESULTS).write_text(
        json.dumps(
            {
                "device": "cpu" if args.cpu else "cuda",
                "sizes": asdict(sizes),
                "total_s": TOTAL_S,
                "parts": shown,
                "table": table_rows(parts, args.cpu),
            },
            indent=2,
        )
    )


def measure(args: argparse.Namespace, sizes: Sizes, budget: Budget) -> Iterator[tuple[str, dict]]:
    """The parts in order, each one's result as soon as it ends."""
    yield "matmul", run_part(args, budget, "matmul", part_cmd(args, "matmul"))
    yield "ray", check_speed_run(args, sizes, budget, "ray")
    new_run(args, "plain")
    yield "plain", run_part(args, budget, "plain", train_cmd(args, sizes, "plain"))
    yield (
        "compiled",
        (
            check_speed_run(args, sizes, budget, "compiled")
            if sizes.compiled
            else {"skipped": "skipped (--tiny on CPU: ~75 s of inductor; --compiled runs it)"}
        ),
    )
    yield "resume", {"skipped": "skipped (--skip-resume)"} if args.skip_resume else check_resume(args, sizes, budget)
    runs = [Path(args.work) / "runs" / name for name in ("ray", "compiled", "resume")]
    yield "evaluate", check_evaluate(args, next((str(c) for run in runs for c in best_checkpoints(run)), None), budget)


def best_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints, best validation BLEU first (none when it failed)."""
    summary = run_dir / "summary.json"
    return [Path(json.loads(summary.read_text())["best_checkpoint"])] if summary.exists() else []


def plan(args: argparse.Namespace, sizes: Sizes) -> dict:
    """What the check would run (--plan): its caps and sizes, each training part's process and the config
    that process builds from its flags. Nothing runs and nothing is removed."""
    args.out = str(Path(args.out).resolve())
    args.work = str(Path(args.work or args.out).resolve())
    args.corpus = str(Path(args.corpus).resolve()) if args.corpus else str(Path(args.work) / "corpus")
    commands = {name: train_cmd(args, sizes, name) for name in (*RUNS, "resume")}
    configs = {name: asdict(train_config(parse_args(cmd[2:]))) for name, cmd in commands.items()}
    return {"total_s": TOTAL_S, "sizes": asdict(sizes), "commands": commands, "configs": configs}


def report(directory: str) -> str:
    """The table of a check from the parts saved in DIR/gpu_check.json (--report)."""
    results = json.loads((Path(directory) / RESULTS).read_text())
    return markdown(table_rows(results["parts"], results["device"] == "cpu"))


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: each part in its own process under its cap; 1 if ray, resume or evaluate failed."""
    args = parse_args(argv)
    sizes = TINY if args.tiny else FULL
    sizes = replace(
        sizes, caps={k: v * args.timeout_scale for k, v in sizes.caps.items()}, compiled=sizes.compiled or args.compiled
    )
    if args.part:
        return {"matmul": part_matmul, "plain": part_plain, "train": part_train}[args.part](args, sizes)
    if args.plan or args.report:
        print(json.dumps(plan(args, sizes), indent=2, default=str) if args.plan else report(args.report))
        return 0
    budget = Budget(sizes.caps, sum(sizes.caps.values()))
    out = Path(args.out).resolve()
    work = Path(args.work or out).resolve()
    for directory in (out, work):
        directory.mkdir(parents=True, exist_ok=True)
    args.out, args.work = str(out), str(work)
    if args.tiny and not args.corpus and args.multi30k == str(MULTI30K):
        args.multi30k = str(write_tiny_text(work / "text"))
    parts: dict[str, dict] = {}
    corpus, why = (
        (Path(args.corpus).resolve(), "")
        if args.corpus
        else prepare(Path(args.multi30k), work / "corpus", out / "prepare.log", sizes.vocab_size, budget["prepare"])
    )
    if corpus is None:
        parts = {name: {"error": why} for name in (*RUNS, "resume", "evaluate")}
    else:
        args.corpus = str(corpus)
        print("gpu_check: matmul ...", flush=True)
        for name, result in measure(args, sizes, budget):
            parts[name] = result
            save(out, args, sizes, parts)
            print(f"gpu_check: {name} done in {result.get('seconds', 0):.0f} s", flush=True)
    save(out, args, sizes, parts)
    print("\n" + markdown(table_rows(parts, args.cpu)))
    print(f"\nlogs and {RESULTS}: {out}")
    return 0 if all("error" not in parts.get(name, {"error": ""}) for name in CORRECTNESS) else 1


if __name__ == "__main__":
    sys.exit(main())
