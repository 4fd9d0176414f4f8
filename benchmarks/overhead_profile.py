"""The Ray-overhead gap under torch.profiler: raymt's step against the plain loop's, op by op.

    python benchmarks/overhead_profile.py [--repeats 2] [--profile-steps 60] [--work-dir DIR]

Alternates speed.py's two sides of the Ray-overhead ratio: a plain-loop process (fresh,
main thread, batches read beforehand) and a raymt run on Ray Train (1 worker with every
thread). Both profile the same steps with raymt's `StepProfiler` (the `profile_steps`
window after the first log interval, so the same batches in the same order), and both
step through `raymt.trainer.train_step`, whose named ranges (`raymt.forward`, ...) split
a step. From the two chrome traces this prints, per side (medians over repeats):

- ms per step of each range, the time between steps (raymt: stream, lockstep, logging),
  and the window's wall time per step;
- the operators whose self time differs most between the two sides;
- per-step: the correlation of the two sides' step times (same batches: near 1), and
  raymt / plain per step (uniform when the whole step is slower, skewed when some steps are);
- peak resident memory (raymt's worker and the plain process).

A profiler slows both sides alike (record_function per operator); the ratio is the point.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402

from raymt.profiling import PARTS, StepProfiler  # noqa: E402


def plain_child(b_args: tuple, num_steps: int, prefix: str, results) -> None:
    """Warm up, then profile the first `num_steps` timed batches in this fresh process."""
    from raymt.model import Transformer

    model_cfg, vocab, cfg, threads, warmup, timed = b_args
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    loop = speed.PlainLoop(Transformer(model_cfg, vocab), cfg, "cpu")
    loop.tokens_per_s(warmup)
    profiler = StepProfiler(num_steps, start=0, prefix=Path(prefix))
    profiler.after_step(0)
    for step, batch in enumerate(timed[:num_steps], 1):
        loop.step_fn(batch)
        loop.scheduler.step()
        profiler.after_step(step)
    results.put({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                 "torch_threads": torch.get_num_threads()})


def plain(b: "speed.Bench", num_steps: int, prefix: Path) -> dict:
    """One plain-loop process (spawned, as speed.py's); its trace at PREFIX.json."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (b.model_cfg, b.vocab, b.cfg, b.threads, b.warmup, b.timed)
    proc = ctx.Process(target=plain_child, args=(args, num_steps, str(prefix), results))
    proc.start()
    out = results.get()
    proc.join()
    return {**out, "trace": str(prefix.with_suffix(".json"))}


def raymt(b: "speed.Bench", num_steps: int, name: str) -> dict:
    """One raymt run on Ray Train with `num_steps` profiled steps; its rank-0 trace."""
    run = speed.raymt_run(b.corpus, b.model_cfg, 1, float(b.threads), b.args.ray_steps, b.log_every,
                          b.work / "runs", name, False, profile_steps=num_steps)
    trace = next((b.work / "runs" / name).rglob("profile-rank0.json"))
    peak = max(float(r) for r in _metric(trace.parent / "metrics.csv", "peak_rss_mb"))
    return {"peak_rss_mb": peak, "trace": str(trace), "tokens_per_s": run["tokens_per_s"],
            "cores_used": run["cores_used"]}


def _metric(csv_path: Path, column: str) -> list[str]:
    import csv

    with open(csv_path) as f:
        return [r[column] for r in csv.DictReader(f) if r.get(column)]


def analyse(trace_path: str) -> dict:
    """Per-step range times, gaps between steps, and operator self times from a chrome trace."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    parts = {p: sorted((e["ts"], e["dur"]) for e in spans if e["name"] == p) for p in PARTS}
    fwd, opt = parts["raymt.forward"], parts["raymt.optimizer"]
    steps = [o[0] + o[1] - f[0] for f, o in zip(fwd, opt)]  # forward start -> optimizer end, us
    gaps = [f[0] - (o[0] + o[1]) for o, f in zip(opt, fwd[1:])]  # optimizer end -> next forward
    thread = next(e["tid"] for e in spans if e["name"] == "raymt.forward")
    wall = (opt[-1][0] + opt[-1][1] - fwd[0][0]) / len(steps)
    return {"num_steps": len(steps), "wall_ms": wall / 1000,
            "parts_ms": {p: sum(d for _, d in v) / len(steps) / 1000 for p, v in parts.items() if v},
            "between_ms": sum(gaps) / max(len(gaps), 1) / 1000,
            "step_ms": [s / 1000 for s in steps],
            "self_ms": {k: v / len(steps) / 1000 for k, v in self_times(spans, thread).items()}}


def self_times(spans: list[dict], thread) -> dict[str, float]:
    """Summed self time (us) per operator name on the training thread (children subtracted)."""
    mine = sorted((e for e in spans if e["tid"] == thread and not e["name"].startswith("raymt.")
                   and e.get("cat") in ("cpu_op", "user_annotation", None)),
                  key=lambda e: (e["ts"], -e["dur"]))
    total: dict[str, float] = defaultdict(float)
    stack: list[dict] = []  # open ancestors of the current event
    for e in mine:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        total[e["name"]] += e["dur"]
        if stack:
            total[stack[-1]["name"]] -= e["dur"]
        stack.append(e)
    return dict(total)


def correlation(a: list[float], b: list[float]) -> float:
    """Pearson's r of two equally long lists."""
    n = min(len(a), len(b))
    return statistics.correlation(a[:n], b[:n]) if n > 2 else float("nan")


def summary(results: dict[str, list[dict]]) -> dict:
    """Medians over repeats of each side, and their ratios raymt / plain."""
    def med(side: str, get) -> float:
        return statistics.median(get(r["profile"]) for r in results[side])

    rows = {"wall per step": lambda a: a["wall_ms"], "between steps": lambda a: a["between_ms"]}
    rows |= {p: (lambda a, p=p: a["parts_ms"].get(p, 0.0)) for p in PARTS}
    table = {name: (med("plain", get), med("raymt", get)) for name, get in rows.items()}
    ops = set().union(*(r["profile"]["self_ms"] for side in results.values() for r in side))
    op_diff = {op: tuple(med(side, lambda a: a["self_ms"].get(op, 0.0)) for side in ("plain", "raymt"))
               for op in ops}
    top = sorted(op_diff.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:15]
    pairs = list(zip(results["plain"], results["raymt"]))
    per_step = [[r["profile"]["step_ms"][i] / p["profile"]["step_ms"][i]
                 for i in range(min(len(p["profile"]["step_ms"]), len(r["profile"]["step_ms"])))]
                for p, r in pairs]
    return {"ranges_ms": table, "top_ops_ms": dict(top),
            "step_correlation": [correlation(p["profile"]["step_ms"], r["profile"]["step_ms"]) for p, r in pairs],
            "per_step_ratio_quartiles": [statistics.quantiles(x, n=4) for x in per_step if len(x) > 3],
            "peak_rss_mb": {side: [r["peak_rss_mb"] for r in runs] for side, runs in results.items()}}


def print_summary(s: dict) -> None:
    """The summary as tables."""
    print("\n| range | plain ms/step | raymt ms/step | raymt / plain |\n|---|---|---|---|")
    for name, (p, r) in s["ranges_ms"].items():
        print(f"| {name} | {p:.1f} | {r:.1f} | {r / p if p else float('nan'):.3f} |")
    print("\n| operator (self time) | plain ms/step | raymt ms/step | difference |\n|---|---|---|---|")
    for op, (p, r) in s["top_ops_ms"].items():
        print(f"| {op} | {p:.2f} | {r:.2f} | {r - p:+.2f} |")
    print(f"\nstep-time correlation per pair: {[round(c, 3) for c in s['step_correlation']]}")
    quartiles = [[round(q, 3) for q in x] for x in s["per_step_ratio_quartiles"]]
    print(f"per-step raymt / plain quartiles per pair: {quartiles}")
    print(f"peak RSS (MB): {s['peak_rss_mb']}")


def main(argv: Optional[list[str]] = None) -> int:
    """Alternate plain and raymt, profile both, print the comparison, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=60)
    p.add_argument("--ray-steps", type=int, default=200)
    speed.shared_flags(p, str(Path(tempfile.gettempdir()) / "raymt-overhead-profile"),
                       "benchmarks/results/overhead_profile.json")
    args = p.parse_args(argv)
    if args.profile_steps > args.ray_steps - max(1, args.ray_steps // 6):
        p.error("--profile-steps must fit after the first log interval of --ray-steps")
    speed.start_ray(False)
    work = Path(args.work_dir)
    b = speed.Bench(speed.parse_args(["--work-dir", str(work), "--data", args.data, "--preset", args.preset,
                                      "--ray-steps", str(args.ray_steps)]), work)
    results: dict[str, list[dict]] = {"plain": [], "raymt": []}
    sides = {"plain": lambda r: plain(b, args.profile_steps, work / f"plain-profile-{r}"),
             "raymt": lambda r: raymt(b, args.profile_steps, f"overhead-profile-{r}")}
    for r in range(args.repeats):
        for side in (["plain", "raymt"] if r % 2 == 0 else ["raymt", "plain"]):
            out = sides[side](r)
            out["profile"] = analyse(out["trace"])
            results[side].append(out)
            print(f"{side}: {out['profile']['wall_ms']:.1f} ms per profiled step, "
                  f"peak RSS {out['peak_rss_mb']:.0f} MB", flush=True)
    s = summary(results)
    print_summary(s)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    def lean(run: dict) -> dict:  # the JSON leaves out every operator's self time (the summary has the top ones)
        return run | {"profile": {k: v for k, v in run["profile"].items() if k != "self_ms"}}

    runs = {side: [lean(r) for r in side_runs] for side, side_runs in results.items()}
    Path(args.json).write_text(json.dumps({"summary": s, "runs": runs, "threads": b.threads,
                                           "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
