"""What a training worker starts from and what its checkpoints hold: the saved weights and train
state, the restored model, optimizer, scheduler, step and RNG streams, the early stop's count, the
checkpoint writer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from raymt.checkpoint import TrainState, load_train_state, load_weights, save_checkpoint
from raymt.config import Config
from raymt.data.epoch import batching_record
from raymt.model import build_model
from raymt.precision import Precision
from raymt.tokenizer import Tokenizer
from raymt.trainer import Trainer, compile_model, restore_training, set_rng_state, unwrap
from raymt.worker_data import EpochFeed
from raymt.worker_env import WorkerEnv


@dataclass(frozen=True)
class Saved:
    """What a worker starts from: a checkpoint's weights and train state, each maybe absent."""

    weights: Optional[dict] = None
    state: Optional[TrainState] = None
    resumed_from: Optional[str] = None  # this run's own checkpoint (its data state carries over), as shown

    @classmethod
    def resume(cls, directory: str | Path, shown: str) -> "Saved":
        """This run's latest checkpoint (after a failure, or on resume), shown as `shown`."""
        return cls(load_weights(directory), load_train_state(directory), shown)

    @classmethod
    def initial(cls, init_checkpoint: Optional[str], full_state: bool = False) -> "Saved":
        """An initial checkpoint's weights, with `full_state` also its optimizer, scheduler and
        step, continuing at this run's peak learning rate (a PBT exploit); without one, nothing."""
        if init_checkpoint is None:
            return cls()
        return cls(load_weights(init_checkpoint), load_train_state(init_checkpoint) if full_state else None)

    @property
    def start(self) -> TrainState:
        """The train state to continue from: the saved one, else step 0 of epoch 0."""
        return self.state or TrainState()


@dataclass
class Restored:
    """The model (placed, maybe compiled), optimizer, scheduler and fp16 loss scaler a worker
    trains with, and the step and epoch it starts at."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Optional[torch.amp.GradScaler]
    step: int = 0
    epoch: int = 0
    valid_best: Optional[dict] = None  # train.patience's count so far (`EarlyStop`)


def restore(
    cfg: Config, vocab_size: int, env: WorkerEnv, saved: Saved, place: Callable[[torch.nn.Module], torch.nn.Module]
) -> Restored:
    """A new model with `saved`'s weights, `place`d on the device, its optimizer, scheduler and
    loss scaler restored from `saved`'s state (trainer.restore_training); compiled with
    train.compile."""
    if saved.resumed_from is not None and env.is_rank0:
        print(f"resuming at step {saved.state.step} from {saved.resumed_from}", flush=True)
    scaler = env.precision.grad_scaler()  # fp16 only
    model, optimizer, scheduler = restore_training(
        build_model(cfg.model, vocab_size), cfg, saved.weights, saved.state, place, scaler
    )
    if cfg.train.compile:
        model = compile_model(model)
    return Restored(model, optimizer, scheduler, scaler, saved.start.step, saved.start.epoch, saved.start.valid_best)


@dataclass
class EarlyStop:
    """train.patience: the best validation BLEU so far, its step, and how many evaluations since
    did not beat it (`best`, which checkpoints keep as the train state's valid_best)."""

    patience: Optional[int]
    best: Optional[dict] = None  # {"bleu": float, "step": int, "since": int}

    def update(self, step: int, bleu: float) -> bool:
        """Count an evaluation's BLEU; True when the run stops: `patience` in a row without a better one."""
        if self.patience is None:
            return False
        if self.best is None or bleu > self.best["bleu"]:
            self.best = {"bleu": bleu, "step": step, "since": 0}
        else:
            self.best = {**self.best, "since": self.best["since"] + 1}
        return self.best["since"] >= self.patience

    def line(self, step: int) -> str:
        """Rank 0's line when the run stops early."""
        return (
            f"step {step}: validation BLEU has not beaten {self.best['bleu']:.2f} (step {self.best['step']}) "
            f"in {self.best['since']} evaluations: stopping early (train.patience={self.patience})"
        )


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


@dataclass(frozen=True)
class CheckpointWriter:
    """Rank 0's checkpoints: the model, the run's config as given (before elastic scaling),
    tokenizer and languages, and a train state that holds every rank's data position and RNG
    states, so that a restart continues each worker's stream and dropout where they were. The
    precision the run trains in goes into both: config.json's train.precision and the train
    state's "precision" (what and why), which a resume or restart keeps unless one is pinned."""

    run_cfg: Config
    tokenizer: Tokenizer
    languages: Optional[dict] = None  # a tagged model's, for its config.json
    precision: Optional[Precision] = None  # the run's, recorded in every checkpoint

    def write(
        self,
        directory: str | Path,
        trainer: Trainer,
        feed: EpochFeed,
        ranks: list[tuple[dict, dict]],
        valid_best: Optional[dict] = None,
    ) -> None:
        """Save a checkpoint into `directory`; `ranks`: every rank's (data position, RNG states);
        `valid_best`: train.patience's count (`EarlyStop.best`)."""
        state = TrainState(
            optimizer=trainer.optimizer.state_dict(),
            scheduler=trainer.scheduler.state_dict(),
            step=trainer.step,
            epoch=trainer.epoch,
            data_positions=[p for p, _ in ranks],
            data_segment=feed.segment_record(trainer.epoch),
            rng_states=[r for _, r in ranks],
            grad_scaler=trainer.scaler.state_dict() if trainer.scaler else None,
            data_batching=batching_record(self.run_cfg.data),  # what data_positions count batches of
            data_mix=feed.data_mix,  # several corpora: what the positions are positions in (else None)
            precision=self.precision.record() if self.precision is not None else None,
            valid_best=valid_best,
        )
        cfg = self.run_cfg
        if self.precision is not None:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=self.precision.name))
        save_checkpoint(directory, unwrap(trainer.model), cfg, self.tokenizer, state, self.languages)
