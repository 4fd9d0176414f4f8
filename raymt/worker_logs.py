"""What a training worker writes beside its checkpoints: rank 0's metrics.csv, each rank's data
trace and step profile, and the loop's time and memory use in them."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Optional, TextIO

import torch

from raymt import storage
from raymt.config import Config
from raymt.metrics import MetricsLog
from raymt.profiling import StepProfiler
from raymt.worker_env import WorkerEnv


class Usage:
    """The loop's time and memory: the share of it spent waiting for data (validation excluded),
    this worker's peak resident memory and, on a GPU, the peak of the memory its tensors took there."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start()

    def start(self) -> None:
        """The loop starts now."""
        self.t0, self.eval_s = time.perf_counter(), 0.0  # eval_s: the loop's time in validation

    def __call__(self, waited_s: float) -> dict:
        """The usage metrics, given the seconds the loop has waited for data."""
        training = time.perf_counter() - self.t0 - self.eval_s
        usage = {
            "data_share": waited_s / max(training, 1e-9),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.device.type == "cuda":  # allocator statistics: read on the host, no device sync
            usage["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return usage

    def note(self) -> str:
        """The end of rank 0's progress line: on a GPU, the peak memory its tensors took there."""
        if self.device.type != "cuda":
            return ""
        return f" | peak GPU {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} GiB"


class RunLogs:
    """A worker's files under the run's `logs/` (none without a log directory).

    They are written locally and mirrored to the run's storage at every report when it is
    remote; each rank fetches the files it appends to (a resumed run continues them).
    """

    def __init__(
        self,
        usage: Usage,
        profiler: StepProfiler,
        mirror: Optional[storage.MirroredDir] = None,
        trace: Optional[TextIO] = None,
        metrics: Optional[MetricsLog] = None,
    ):
        self.usage, self.profiler, self.mirror, self.trace, self.metrics = usage, profiler, mirror, trace, metrics

    @classmethod
    def open(cls, log_dir: Optional[str], cfg: Config, env: WorkerEnv, step: int, pairs: list[str]) -> "RunLogs":
        """This worker's logs in `log_dir`, continued at `step`; `pairs`: metrics.csv's pair columns."""
        trace_name = f"trace-rank{env.rank}.tsv"
        fetch = (trace_name, "metrics.csv") if env.is_rank0 else (trace_name,)
        mirror = storage.MirroredDir(log_dir, fetch=fetch) if log_dir else None
        path: Optional[Path] = mirror.path if mirror else None
        trace = None
        if cfg.train.trace_data and path:  # each (re)start of the worker group: an attempt
            trace = open(path / trace_name, "a")
            # One id for every rank of this worker group (attempt), to tell apart the groups
            # of a resized run: a later group undoes the steps after its checkpoint.
            attempt = env.collective.all_gather_object(time.time())[0]
            trace.write(f"#start\t{step}\t{attempt:.6f}\t{env.world_size}\n")
        profiler = StepProfiler(
            cfg.train.profile_steps,
            start=cfg.train.log_every,
            prefix=path / f"profile-rank{env.rank}" if path else None,
            cuda=env.device.type == "cuda",
        )
        metrics = MetricsLog(path, pairs) if env.is_rank0 and path else None
        return cls(Usage(env.device), profiler, mirror, trace, metrics)

    def after_step(self, step: int, epoch: int, traced: list[str]) -> None:
        """With train.trace_data, log the digest of every pair step `step` trained on; profile."""
        if self.trace:
            self.trace.writelines(f"{step}\t{epoch}\t{h}\n" for h in traced)
            self.trace.flush()
        self.profiler.after_step(step)

    def write(self, step: int, metrics: dict) -> None:
        """Rank 0: a row of metrics.csv (and TensorBoard scalars)."""
        if self.metrics:
            self.metrics.write(step, metrics)

    def sync(self) -> None:
        """Mirror the files to the run's storage (before a checkpoint registers: a resume finds
        the logs up to it)."""
        if self.mirror:
            self.mirror.sync()

    def close(self, step: int) -> None:
        """At the end of a run (which may end inside the profiled window): write and close everything."""
        self.profiler.close(step)
        if self.metrics:
            self.metrics.close()
        if self.trace:
            self.trace.close()
        if self.mirror:
            self.mirror.close()
