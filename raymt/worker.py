"""The training loop each Ray Train worker runs: raymt.trainer's loop plus the Ray Train glue
(collectives over torch.distributed, checkpoints, reports, the data stream, DDP)."""

from __future__ import annotations

import dataclasses
import inspect
import resource
import tempfile
import time
from typing import Any, Callable, Iterable, Optional

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from raymt import storage
from raymt.batching import Batch
from raymt.checkpoint import load_train_state, load_weights, save_checkpoint
from raymt.config import Config, DataConfig
from raymt.data.stream import Mix, Position, TrainStream, batching_record, mix_record, resume_point, training_data
from raymt.metrics import MetricsLog, pair_metrics
from raymt.model import build_model
from raymt.precision import for_training
from raymt.profiling import StepProfiler
from raymt.tokenizer import Tokenizer
from raymt.trainer import (
    Collective,
    Trainer,
    Update,
    collate_eval,
    compile_model,
    evaluate,
    restore_training,
    rng_state,
    set_rng_state,
    unwrap,
)


class TorchCollective(Collective):
    """The collective operations of a torch.distributed worker group.

    Host-side numbers (lockstep counts, gathered objects) go through a gloo group, so an
    NCCL run exchanges them on the CPU without touching the GPU stream.
    """

    def __init__(self):
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.cpu_group = dist.new_group(backend="gloo")  # every rank calls this, in order

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a device tensor over all workers in place."""
        dist.all_reduce(tensor)
        return tensor

    def all_reduce_sum_async(self, tensor: torch.Tensor):
        """Start summing a CPU tensor over all workers; `.wait()` returns it."""
        work = dist.all_reduce(tensor, group=self.cpu_group, async_op=True)
        return _Pending(work, tensor)

    def all_gather_object(self, obj) -> list:
        """Every worker's `obj`, in rank order."""
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, obj, group=self.cpu_group)
        return parts


class _Pending:
    """An all-reduce in flight and the tensor it writes."""

    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def wait(self) -> torch.Tensor:
        """Block until the sum is in `tensor`; return it."""
        self.work.wait()
        return self.tensor


def _read_checkpoint(cfg: Config, loop_config: dict) -> tuple[Optional[dict], Optional[dict], bool]:
    """(weights, train state, reset lr) of the latest Ray Train checkpoint (after a failure or on
    resume), else of an initial one, else nothing.

    An initial checkpoint gives weights only, or with `init_full_state` also optimizer,
    scheduler and step, continuing at this run's peak learning rate (a PBT exploit).
    """
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            weights, state = load_weights(d), load_train_state(d)
        if ray.train.get_context().get_world_rank() == 0:
            print(f"resuming at step {state['step']} from {checkpoint.path}", flush=True)
        return weights, state, False
    init = loop_config.get("init_checkpoint")
    if init is None:
        return None, None, False
    if not loop_config.get("init_full_state"):
        return load_weights(init), None, False
    return load_weights(init), load_train_state(init), True


def _report(metrics: dict, loop: "WorkerLoop") -> None:
    """Every rank reports (a barrier); only rank 0 writes and attaches the checkpoint.

    The checkpoint holds every rank's data position and RNG states (CPU and its GPU's), so that
    a restart continues each worker's stream and dropout exactly where they were.
    """
    parts = loop.collective.all_gather_object((loop.position.to_dict(), rng_state(loop.device)))
    if not loop.is_rank0:
        ray.train.report(metrics)
        return
    state = {
        "optimizer": loop.optimizer.state_dict(),
        "scheduler": loop.scheduler.state_dict(),
        "step": loop.step,
        "epoch": loop.epoch,
        "data_positions": [p for p, _ in parts],
        "data_segment": loop.segment.to_dict() if loop.segment and loop.segment.epoch == loop.epoch else None,
        "rng_states": [r for _, r in parts],
        "grad_scaler": loop.scaler.state_dict() if loop.scaler else None,
        "data_batching": batching_record(loop.run_cfg.data),  # what data_positions count batches of
    }
    if loop.data_mix is not None:  # several corpora: what the positions are positions in
        state["data_mix"] = loop.data_mix
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, unwrap(loop.model), loop.run_cfg, loop.tokenizer, state, loop.languages)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


class WorkerLoop(Trainer):
    """One worker's model, data and state on Ray Train; `run` trains, evaluates and reports."""

    def __init__(self, loop_config: dict):
        self.run_cfg = Config.from_dict(loop_config["config"])  # as checkpoints store it
        collective = TorchCollective() if dist.is_initialized() else Collective()
        cfg = elastic_batch(self.run_cfg, collective.world_size, collective.rank == 0)
        self.tokenizer = Tokenizer(loop_config["spm_model"])
        torch.set_num_threads(loop_config["num_threads"])
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        device = ray.train.torch.get_device()
        self.rank, self.world_size = collective.rank, collective.world_size

        # Rank 0 chooses (on a CPU it may time a probe) and every rank takes its choice.
        precision = for_training(device, cfg, self.tokenizer.vocab_size) if collective.rank == 0 else None
        self.precision = collective.all_gather_object(precision)[0].apply()
        scaler = self.precision.grad_scaler()  # fp16 only
        weights, state, reset_lr = _read_checkpoint(cfg, loop_config)
        resumed = state is not None and not reset_lr  # this run's own checkpoint, not a donor's
        place = lambda m: place_model(m, cfg, collective.world_size)  # noqa: E731
        model, optimizer, scheduler = restore_training(
            build_model(cfg.model, self.tokenizer.vocab_size), cfg, weights, state, place, scaler
        )
        if cfg.train.compile:
            model = compile_model(model)
        state = state or {"step": 0, "epoch": 0}
        super().__init__(
            cfg,
            model,
            optimizer,
            scheduler,
            device,
            state["step"],
            state["epoch"],
            collective,
            self.precision.autocast,
            scaler,
        )
        # One pair's shards, or several corpora mixed by data.temperature (checkpoints record the mix).
        self.train_files = training_data(loop_config["train_files"], cfg.data.temperature)
        self.data_mix = mix_record(loop_config["train_files"], cfg.data.temperature)
        self.languages = loop_config.get("languages")  # a tagged model's, for its config.json
        if resumed:
            check_data_mix(state.get("data_mix"), self.data_mix)
        saved = state.get("data_positions")
        self.position, self.segment = resume_point(
            self.train_files,
            cfg.data,
            cfg.train.seed,
            self.epoch,
            saved,
            state.get("data_segment"),
            self.rank,
            self.world_size,
            state.get("data_batching"),
        )
        recut = batching_changes(state.get("data_batching"), cfg.data)
        if saved and (len(saved) != self.world_size or recut) and self.is_rank0:
            files = self.train_files
            total = files.num_rows if isinstance(files, Mix) else sum(f[1] for f in files)
            left = self.segment.num_left() if self.segment else total
            what = f"resized from {len(saved)} to {self.world_size} workers" if len(saved) != self.world_size else ""
            what = "; ".join(x for x in (what, recut) if x)
            print(
                f"{what}: the workers share the {left} pairs "
                f"left of epoch {self.epoch + 1} ({total - left} trained before; each pair once)",
                flush=True,
            )
        restore_rng(state.get("rng_states"), self.rank, self.world_size, device, cfg.train.seed, self.step)
        # Logs are written locally and mirrored to the run's storage at every report when it is
        # remote; each rank fetches the files it appends to (a resumed run continues them).
        trace_name = f"trace-rank{self.rank}.tsv"
        self.logs = (
            storage.MirroredDir(
                loop_config["log_dir"], fetch=((trace_name, "metrics.csv") if self.is_rank0 else (trace_name,))
            )
            if loop_config.get("log_dir")
            else None
        )
        log_dir = self.logs.path if self.logs else None
        self.trace = None
        if cfg.train.trace_data and log_dir:  # each (re)start of the worker group: an attempt
            self.trace = open(log_dir / trace_name, "a")
            # One id for every rank of this worker group (attempt), to tell apart the groups
            # of a resized run: a later group undoes the steps after its checkpoint.
            attempt = collective.all_gather_object(time.time())[0]
            self.trace.write(f"#start\t{self.step}\t{attempt:.6f}\t{self.world_size}\n")
        self.stream = self.open_stream(self.position)  # reading starts while the rest sets up
        self.progress.note = self.progress_note
        if self.is_rank0:
            print(self.precision.line(device) + (" (torch.compile)" if cfg.train.compile else ""), flush=True)

        # One pair's validation set, or each pair's (its sources starting with its tag).
        sets = loop_config.get("valid_pairs") or {None: loop_config["valid"]}
        self.pairs = [pair for pair in sets if pair is not None]
        self.valid_sets = {
            pair: (
                ray.train.torch.prepare_data_loader(
                    DataLoader(v["rows"], batch_size=cfg.data.eval_batch_size, collate_fn=collate_eval)
                ),
                v["refs"],
            )
            for pair, v in sets.items()
        }
        # Validation BLEU is greedy or beam search: decode.sample is for translating, not scoring.
        self.opts = dataclasses.replace(cfg.decode, beam=cfg.train.valid_beam, sample=False)
        self.metrics_log = MetricsLog(log_dir, self.pairs) if self.is_rank0 and log_dir else None
        self.profiler = StepProfiler(
            cfg.train.profile_steps,
            start=cfg.train.log_every,
            prefix=log_dir / f"profile-rank{self.rank}" if log_dir else None,
            cuda=device.type == "cuda",
        )

    def run(self) -> None:
        """Train until max_steps, the epoch limit or the time budget; evaluate and report."""
        cfg, stop = self.cfg, False
        self.evaluated: Optional[int] = None  # the step of this attempt's last evaluation
        self.loop_t0, self.data_s, self.eval_s = time.perf_counter(), 0.0, 0.0
        while (
            not stop and self.step < cfg.train.max_steps and (cfg.train.epochs is None or self.epoch < cfg.train.epochs)
        ):
            self.upcoming = self.open_stream(Position(self.epoch + 1), start=False)
            stop = self.train_epoch(self.stream, mark=self.mark)
            if not stop:
                self.position = self.stream.position
            self.data_s += self.stream.busy_s
            self.stream.busy_s = 0.0
            self.stream.close()
            if stop:
                self.upcoming.close()
            else:
                self.epoch += 1
                self.position, self.stream = self.upcoming.position, self.upcoming.start()
        # The epoch or time limit ended the run between evaluations, or the run started at its
        # limit (a Tune trial continuing from a finished trial's checkpoint): every attempt
        # ends with a checkpoint of its final state.
        if self.evaluated != self.step:
            self.evaluate_and_report()
        self.profiler.close(self.step)  # the run may end inside the profiled window
        self.stream.close()
        if self.metrics_log:
            self.metrics_log.close()
        if self.trace:
            self.trace.close()
        if self.logs:
            self.logs.close()

    def open_stream(self, position: Position, start: bool = True) -> TrainStream:
        """This worker's stream of the epoch `position` is in, reading ahead once started."""
        stream = TrainStream(
            self.train_files,
            self.cfg.data,
            self.cfg.train.seed,
            self.rank,
            self.world_size,
            position,
            trace=self.trace is not None,
            pin_memory=self.device.type == "cuda",
            segment=self.segment,
        )
        return stream.start() if start else stream

    def train_epoch(self, batches: Iterable[Batch], mark: Callable[[], Any] = lambda: None) -> bool:
        """Trainer.train_epoch; a CUDA out-of-memory becomes one line naming the token budget to try."""
        try:
            return super().train_epoch(batches, mark)
        except torch.cuda.OutOfMemoryError as err:  # the driver prints a worker's ValueError as one line
            cuda = self.device.type == "cuda"
            gpu_bytes = torch.cuda.get_device_properties(self.device).total_memory if cuda else None
            raise ValueError(out_of_memory_hint(self.step + 1, self.run_cfg, gpu_bytes)) from err

    def mark(self) -> tuple[Position, list[str]]:
        """Right after an update's batches are read: the stream position and traced pairs.

        lockstep reads the next update's batches before this one trains, so both are
        taken here, not after the step.
        """
        traced = list(self.stream.traced)
        self.stream.traced.clear()
        return self.stream.position, traced

    def before_step(self, update: Update) -> None:
        """Note the position a checkpoint after this update resumes from."""
        self.position, _ = update.mark
        # The next epoch's stream starts after this epoch's first step, so its first chunk
        # is read and cut while this epoch trains: an epoch never waits for the next.
        self.upcoming.start()

    def after_step(self, update: Update) -> None:
        """With train.trace_data, log the digest of every pair this step trained on; profile."""
        if self.trace:
            self.trace.writelines(f"{self.step}\t{self.epoch}\t{h}\n" for h in update.mark[1])
            self.trace.flush()
        self.profiler.after_step(self.step)

    def log_train(self) -> dict:
        """Progress line and training metrics of the last interval."""
        metrics = super().log_train()
        metrics.update(**self.usage())
        if self.metrics_log:
            self.metrics_log.write(self.step, metrics)
        return metrics

    def usage(self) -> dict:
        """Share of the loop spent waiting for data, this worker's peak resident memory and, on a
        GPU, the peak of the memory its tensors took there."""
        waited = self.data_s + self.stream.busy_s
        training = time.perf_counter() - self.loop_t0 - self.eval_s  # validation excluded
        usage = {
            "data_share": waited / max(training, 1e-9),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.device.type == "cuda":  # allocator statistics: read on the host, no device sync
            usage["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return usage

    def progress_note(self) -> str:
        """The end of rank 0's progress line: on a GPU, the peak memory its tensors took there."""
        if self.device.type != "cuda":
            return ""
        return f" | peak GPU {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} GiB"

    def validate(self) -> dict:
        """Each pair's validation metrics and, with several pairs, their averages (`pair_metrics`)."""
        per_pair, num_tokens = {}, {}
        for pair, (loader, refs) in self.valid_sets.items():
            lang = pair.split("-", 1)[1] if pair else self.run_cfg.data.tgt_lang  # codes hold no '-'
            scores = evaluate(self.model, loader, self.tokenizer, refs, self.opts, self.collective, self.autocast, lang)
            num_tokens[pair] = scores.pop("valid_tokens")  # weights the pairs' losses; no metric
            per_pair[pair] = scores
        return pair_metrics(per_pair, num_tokens)

    def evaluate_and_report(self) -> None:
        """Validate on the whole dev set, report to Ray Train with a checkpoint from rank 0."""
        metrics = super().log_train()
        t0 = time.perf_counter()
        try:
            metrics.update(self.validate())
        except torch.cuda.OutOfMemoryError as err:
            size = self.run_cfg.data.eval_batch_size
            raise ValueError(
                f"CUDA out of memory validating at step {self.step} with data.eval_batch_size="
                f"{size}: retry with --set data.eval_batch_size={max(1, size // 2)}"
            ) from err
        self.eval_s += time.perf_counter() - t0
        metrics.update(step=self.step, **self.usage())
        if self.is_rank0:
            # Several pairs: BLEU and chrF are their means, and each pair's BLEU follows.
            each = "".join(f" | {p} {metrics[f'valid_bleu/{p}']:.2f}" for p in self.pairs if len(self.pairs) > 1)
            print(
                f"step {self.step} | valid loss {metrics['valid_loss']:.3f} | "
                f"BLEU {metrics['valid_bleu']:.2f} | chrF {metrics['valid_chrf']:.2f}{each}",
                flush=True,
            )
        if self.metrics_log:
            self.metrics_log.write(self.step, metrics)
        if self.logs:  # before the checkpoint registers: a resume finds the logs up to it
            self.logs.sync()
        _report(metrics, self)
        self.evaluated = self.step


def describe_mix(data_mix: Optional[dict]) -> str:
    """A checkpoint's `data_mix` in words: each corpus's rows per epoch and the temperature."""
    if data_mix is None:
        return "one pair's corpus"
    rows = ", ".join(f"{n} ({r} rows/epoch)" for n, r in zip(data_mix["names"], data_mix["rows"]))
    return f"{rows} at data.temperature={data_mix['temperature']:g}"


def check_data_mix(saved: Optional[dict], current: Optional[dict]) -> None:
    """A one-line error when a run resumes from a checkpoint of another mix of corpora (other
    corpora, rows per epoch or data.temperature): its data positions mean other pairs there."""
    if saved != current:
        raise ValueError(
            f"the checkpoint was trained on {describe_mix(saved)}, this run reads {describe_mix(current)}: "
            "its data positions do not carry over; start a new run from the checkpoint instead "
            "(--resume CHECKPOINT_DIR --name NEW)"
        )


# torch 2.13 renamed DDP's broadcast_buffers (deprecated, with a warning) to forward_sync_buffers.
_BUFFER_SYNC = next(
    k
    for k in ("forward_sync_buffers", "broadcast_buffers")
    if k in inspect.signature(DistributedDataParallel).parameters
)


def ddp_kwargs(cfg: Config) -> dict:
    """The DistributedDataParallel arguments prepare_model gets."""
    # Smaller buckets start all-reducing earlier in backward. No buffer needs syncing: the only
    # one, the sinusoid table `positions`, is computed alike on every rank, and syncing would
    # broadcast it from rank 0 before every forward.
    return {"bucket_cap_mb": cfg.train.ddp_bucket_mb, "gradient_as_bucket_view": True, _BUFFER_SYNC: False}


def place_model(model: torch.nn.Module, cfg: Config, world_size: int) -> torch.nn.Module:
    """The model on this worker's device, in DDP (gloo on CPUs, NCCL on GPUs) when there are several."""
    model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs(cfg))
    compress_gradients(model, cfg, world_size)
    return model


def compress_gradients(model: torch.nn.Module, cfg: Config, world_size: int) -> None:
    """With train.grad_compression and several workers, all-reduce gradients in bf16 (half the bytes)."""
    if cfg.train.grad_compression and world_size > 1:  # one worker: no DDP, nothing to reduce
        # NCCL only (torch refuses it on gloo); each bucket is cast to bf16, summed, cast back.
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)


def restore_rng(
    rng_states: Optional[list], rank: int, world_size: int, device: torch.device, seed: int, step: int, cuda=torch.cuda
) -> None:
    """Continue this rank's dropout streams from a checkpoint's RNG states, else reseed them."""
    if rng_states and len(rng_states) == world_size:
        if set_rng_state(rng_states[rank], device, cuda):
            return  # dropout continues exactly
        print(
            f"rank {rank}: the checkpoint holds no RNG state for {device} (saved on a CPU, or by an older "
            "raymt that saw fewer GPUs): dropout is reseeded, as after a resize",
            flush=True,
        )
    # Each rank draws its own dropout masks (after a resize: not those of step 0 again).
    torch.manual_seed(seed * 1000 + rank + 1 + 7919 * step)


def batching_changes(saved: Optional[dict], cfg: DataConfig) -> str:
    """The batching fields a resume changes, in words ("data.max_tokens 4096 -> 2048"); "" if none."""
    now = batching_record(cfg)
    return ", ".join(f"data.{k} {v} -> {now[k]}" for k, v in (saved or {}).items() if now.get(k) != v)


def out_of_memory_hint(step: int, cfg: Config, gpu_bytes: Optional[int]) -> str:
    """The one line a CUDA out-of-memory in training step `step` becomes: the token budget to try."""
    max_tokens, update_freq, smallest = cfg.data.max_tokens, cfg.optim.update_freq, cfg.data.min_max_tokens()
    gpu = f" (GPU {gpu_bytes / 2**30:.0f} GiB)" if gpu_bytes else ""
    where = f"CUDA out of memory at step {step} with data.max_tokens={max_tokens} per worker{gpu}"
    if max_tokens // 2 < smallest:  # config.py's lower bound: one pair of data.max_len must fit
        return (
            f"{where}: data.max_tokens cannot go below {smallest} (data.max_len's padded pair); lower "
            "data.max_len (longer pairs are dropped) or train a smaller model"
        )
    return (
        f"{where}: retry with --set data.max_tokens={max_tokens // 2} "
        f"--set optim.update_freq={2 * update_freq} (same global batch)"
    )


def elastic_batch(cfg: Config, world_size: int, verbose: bool = False) -> Config:
    """The config with optim.update_freq scaled so that a resized elastic group keeps the
    global batch of train.num_workers workers (and so the learning-rate schedule's meaning)."""
    if cfg.train.min_workers is None or world_size == cfg.train.num_workers:
        return cfg
    wanted = cfg.optim.update_freq * cfg.train.num_workers
    update_freq = -(-wanted // world_size)  # rounded up: never a smaller batch than the recipe's
    if verbose:
        print(
            f"{world_size} of {cfg.train.num_workers} workers: optim.update_freq "
            f"{cfg.optim.update_freq} -> {update_freq} keeps the global batch"
            + ("" if wanted % world_size == 0 else f" ({world_size * update_freq}/{wanted} of it)"),
            flush=True,
        )
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, update_freq=update_freq))


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: build everything inside the worker from config, then train."""
    WorkerLoop(loop_config).run()
