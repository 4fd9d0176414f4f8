"""The training loop each Ray Train worker runs: raymt.trainer's `Trainer` over the epoch feed,
with validation, logs and checkpoints at its hooks. `WorkerLoop.on_ray_train` is the only code
that calls Ray Train; the loop's parts (raymt.worker_env, worker_state, worker_data, worker_logs)
are plain, and tests build the loop with `WorkerLoop.create` and a fake environment."""

from __future__ import annotations

import tempfile
import time
from typing import Optional

import ray.train
import ray.train.torch
import torch

from raymt.config import Config
from raymt.distributed import group_collective, place_model
from raymt.ray_console import quiet_user_errors
from raymt.tokenizer import Tokenizer
from raymt.trainer import Hooks, Trainer, Update, rng_state
from raymt.worker_data import EpochFeed, ValidSets
from raymt.worker_env import LoopConfig, WorkerEnv, elastic_batch
from raymt.worker_logs import RunLogs
from raymt.worker_state import CheckpointWriter, EarlyStop, Restored, Saved, restore, restore_rng


class WorkerLoop(Hooks):
    """One worker's loop: train epoch after epoch until max_steps, the epoch limit or the time
    budget; at each evaluation validate, log and report (rank 0 with a checkpoint)."""

    def __init__(
        self,
        cfg: Config,
        env: WorkerEnv,
        start: Restored,
        feed: EpochFeed,
        logs: RunLogs,
        valid: ValidSets,
        checkpoints: CheckpointWriter,
    ):
        self.cfg, self.env, self.checkpoints = cfg, env, checkpoints
        self.feed, self.logs, self.valid = feed, logs, valid
        self.run_cfg = checkpoints.run_cfg  # as given: the one-line errors name its values
        self.trainer = Trainer(
            cfg,
            start.model,
            start.optimizer,
            start.scheduler,
            env.device,
            start.step,
            start.epoch,
            env.collective,
            env.precision.autocast,
            start.scaler,
            hooks=self,
        )
        self.evaluated: Optional[int] = None  # the step of this attempt's last evaluation
        self.early_stop = EarlyStop(cfg.train.patience, start.valid_best)

    @classmethod
    def on_ray_train(cls, loop: LoopConfig) -> "WorkerLoop":
        """This Ray Train worker's loop: its device, worker group, checkpoint, model and loader
        preparation and reports are Ray Train's (the one place raymt calls them)."""
        quiet_user_errors()  # a one-line error (CUDA out of memory) without Ray's traceback print

        def report(metrics: dict, checkpoint_dir: Optional[str]) -> None:
            checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
            ray.train.report(metrics, checkpoint=checkpoint)

        env = WorkerEnv(
            device=ray.train.torch.get_device(),
            collective=group_collective(),
            prepare_model=ray.train.torch.prepare_model,
            prepare_loader=ray.train.torch.prepare_data_loader,
            report=report,
        )
        checkpoint = ray.train.get_checkpoint()  # after a failure, or on resume
        if checkpoint is None:
            saved = Saved.initial(loop.init_checkpoint, loop.init_full_state)
        else:
            with checkpoint.as_directory() as d:
                saved = Saved.resume(d, shown=str(checkpoint.path))
        return cls.create(loop, env, saved)

    @classmethod
    def create(cls, loop: LoopConfig, env: WorkerEnv, saved: Saved) -> "WorkerLoop":
        """The loop of the driver's `loop` config (raymt.train.fit) in `env`, from `saved`."""
        run_cfg = loop.config  # as given: checkpoints store it
        cfg = elastic_batch(run_cfg, env.world_size, env.is_rank0)
        tokenizer = Tokenizer(loop.spm_model)
        torch.set_num_threads(loop.num_threads)
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        env = env.agree_precision(cfg, tokenizer.vocab_size, saved.start.precision, loop.valid_widths())
        place = lambda m: place_model(m, cfg.train, env.world_size, env.prepare_model)  # noqa: E731
        start = restore(cfg, tokenizer.vocab_size, env, saved, place)
        resumed = saved.resumed_from is not None  # this run's own checkpoint, not a donor's
        feed = EpochFeed(loop.training_corpora, cfg, env.rank, env.world_size, start.epoch, saved.start, resumed)
        restore_rng(saved.start.rng_states, env.rank, env.world_size, env.device, cfg.train.seed, start.step)
        valid = ValidSets.create(loop.valid, cfg, tokenizer, env.prepare_loader)
        logs = RunLogs.open(loop.log_dir, cfg, env, start.step, valid.pairs)
        feed.start(trace=logs.trace is not None, pin_memory=env.device.type == "cuda")  # reads while the rest sets up
        if env.is_rank0:
            print(env.precision.line(env.device) + (" (torch.compile)" if cfg.train.compile else ""), flush=True)
        checkpoints = CheckpointWriter(run_cfg, tokenizer, loop.languages, env.precision)
        return cls(cfg, env, start, feed, logs, valid, checkpoints)

    def run(self) -> None:
        """Train until max_steps, the epoch limit or the time budget; evaluate and report."""
        trainer, limits, stop = self.trainer, self.cfg.train, False
        self.logs.usage.start()
        while not stop and trainer.step < limits.max_steps and (limits.epochs is None or trainer.epoch < limits.epochs):
            self.feed.open_next(trainer.epoch + 1)
            stop = self.train_epoch()
            self.feed.end_epoch(stop)
            if not stop:
                trainer.epoch += 1
        # The epoch or time limit ended the run between evaluations, or the run started at its
        # limit (a Tune trial continuing from a finished trial's checkpoint): every attempt
        # ends with a checkpoint of its final state.
        if self.evaluated != trainer.step:
            self.evaluate(trainer.log_train())
        self.feed.close()
        self.logs.close(trainer.step)

    def train_epoch(self) -> bool:
        """The Trainer's epoch over the feed; a CUDA out-of-memory becomes one line naming the
        token budget to try (the driver prints a worker's ValueError as one line)."""
        try:
            return self.trainer.train_epoch(self.feed.stream, mark=self.feed.mark)
        except torch.cuda.OutOfMemoryError as err:
            cuda = self.env.device.type == "cuda"
            gpu_bytes = torch.cuda.get_device_properties(self.env.device).total_memory if cuda else None
            raise ValueError(out_of_memory_hint(self.trainer.step + 1, self.run_cfg, gpu_bytes)) from err

    def before_step(self, update: Update) -> None:
        """Note the position a checkpoint after this update resumes from."""
        self.feed.advance(update.mark)

    def after_step(self, update: Update) -> None:
        """Trace the pairs this step trained on; profile."""
        self.logs.after_step(self.trainer.step, self.trainer.epoch, update.mark[1])

    def note(self) -> str:
        """The end of rank 0's progress line (a GPU's peak memory)."""
        return self.logs.usage.note()

    def usage(self) -> dict:
        """The loop's share of waiting for data and its peak memory."""
        return self.logs.usage(self.feed.waited())

    def logged(self, metrics: dict) -> None:
        """A log interval's metrics, with the loop's usage, to metrics.csv."""
        metrics.update(**self.usage())
        self.logs.write(self.trainer.step, metrics)

    def evaluate(self, metrics: dict) -> bool:
        """Validate on the whole dev set, log, report to Ray Train with a checkpoint from rank 0;
        True when train.patience stops the run (every rank decides alike: the metrics are the group's)."""
        step = self.trainer.step
        t0 = time.perf_counter()
        metrics.update(self.validate())
        self.logs.usage.eval_s += time.perf_counter() - t0
        metrics.update(step=step, **self.usage())
        stop = self.early_stop.update(step, metrics["valid_bleu"])  # before the checkpoint, which keeps it
        if self.env.is_rank0:
            print(self.valid.line(step, metrics), flush=True)
            if stop:
                print(self.early_stop.line(step), flush=True)
        self.logs.write(step, metrics)
        self.logs.sync()  # before the checkpoint registers: a resume finds the logs up to it
        self.report(metrics)
        self.evaluated = step
        return stop

    def validate(self) -> dict:
        """The validation metrics; a CUDA out-of-memory becomes one line naming the batch size to try."""
        try:
            return self.valid.score(self.trainer.model, self.env.collective, self.trainer.autocast)
        except torch.cuda.OutOfMemoryError as err:
            size = self.run_cfg.data.eval_batch_size
            raise ValueError(
                f"CUDA out of memory validating at step {self.trainer.step} with data.eval_batch_size="
                f"{size}: retry with --set data.eval_batch_size={max(1, size // 2)}"
            ) from err

    def report(self, metrics: dict) -> None:
        """Every rank reports (a barrier); only rank 0 writes and attaches the checkpoint, which
        holds every rank's data position and RNG states (CPU and its GPU's)."""
        ranks = self.env.collective.all_gather_object((self.feed.position.to_dict(), rng_state(self.env.device)))
        if not self.env.is_rank0:
            self.env.report(metrics, None)
            return
        with tempfile.TemporaryDirectory() as tmp:
            self.checkpoints.write(tmp, self.trainer, self.feed, ranks, self.early_stop.best)
            self.env.report(metrics, tmp)


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


def train_loop_per_worker(train_loop_config: dict) -> None:
    """Ray Train entry point: build everything inside the worker from the driver's
    `LoopConfig` (Ray Train hands it on as a dict), then train."""
    WorkerLoop.on_ray_train(LoopConfig.from_dict(train_loop_config)).run()
