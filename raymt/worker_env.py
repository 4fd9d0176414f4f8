"""What a training worker is handed and where it runs: the driver's `LoopConfig`; rank, world
size, collective, device, precision, and its ways out to Ray Train (prepare a model or loader,
report) as plain functions; the elastic global batch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from raymt.config import Config
from raymt.precision import Precision, ProbeShape, for_training, row_widths
from raymt.trainer import SINGLE, Collective


@dataclass(frozen=True)
class ValidRows:
    """One pair's validation set as the workers get it: its rows (`format.eval_rows`, each
    source starting with the pair's tag, if any) and every reference."""

    rows: list[dict]
    refs: list[str]


@dataclass(frozen=True)
class LoopConfig:
    """What the driver hands every training worker (`raymt.train.fit`). Built on the driver, so
    that a field missing or misnamed fails there, before Ray starts, not inside a worker."""

    config: Config  # the run's, as given: a worker scales the batch of a resized group itself
    spm_model: bytes
    num_threads: int  # torch threads per worker (`cluster.Plan.num_threads`)
    training_corpora: list  # a `format.TrainingCorpus` each (one pair's: a list of one)
    valid: dict[str, ValidRows]  # pair ("en-de") -> its validation set, every one scored
    languages: Optional[dict] = None  # a tagged model's, for its checkpoints' config.json
    init_checkpoint: Optional[str] = None  # a new run's starting weights
    init_full_state: bool = False  # with its optimizer, scheduler and step (a PBT exploit)
    log_dir: Optional[str] = None  # metrics.csv, the data trace and profiles go there

    def to_dict(self) -> dict:
        """The dict Ray Train hands `train_loop_per_worker` (its train_loop_config): the fields
        as they are, nothing copied."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, fields: dict) -> "LoopConfig":
        """The loop config `to_dict` gave Ray Train, as the worker receives it."""
        return cls(**fields)

    def valid_widths(self) -> Optional[tuple[tuple[int, int], ...]]:
        """(source, target) widths of the validation rows (every pair's): the precision probe's
        stand-in for the training rows its batches are cut from."""
        return row_widths([row for s in self.valid.values() for row in s.rows])


def _as_is(thing):
    """One process's preparation: the model or loader unchanged."""
    return thing


def _prepared_as_is(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """One process's prepare_model: the model unchanged."""
    return model


def _no_report(metrics: dict, checkpoint_dir: Optional[str]) -> None:
    """One process's report: nothing to tell."""


@dataclass(frozen=True)
class WorkerEnv:
    """A worker's place in its group and its ways out; alone, one CPU process that reports nothing.

    `raymt.worker.WorkerLoop.on_ray_train` fills it from Ray Train; tests pass fakes.
    """

    device: torch.device = torch.device("cpu")
    collective: Collective = SINGLE
    precision: Precision = Precision("cpu")  # the training precision (`agree_precision`)
    prepare_model: Callable[..., torch.nn.Module] = _prepared_as_is  # (model, parallel_strategy_kwargs=)
    prepare_loader: Callable[[Iterable], Iterable] = _as_is  # a loader -> this worker's share of it
    report: Callable[[dict, Optional[str]], None] = _no_report  # metrics and a checkpoint directory (rank 0)

    @property
    def rank(self) -> int:
        """This worker's rank in the group."""
        return self.collective.rank

    @property
    def world_size(self) -> int:
        """The number of workers in the group."""
        return self.collective.world_size

    @property
    def is_rank0(self) -> bool:
        """Whether this worker prints, writes metrics.csv and saves checkpoints."""
        return self.collective.rank == 0

    def agree_precision(
        self,
        cfg: Config,
        vocab_size: int,
        kept: Optional[dict] = None,
        widths: Optional[Sequence[tuple[int, int]]] = None,
    ) -> "WorkerEnv":
        """This environment with the training precision every rank takes (rank 0's), its TF32
        flags set: pinned, else `kept` (a resumed checkpoint's record), else chosen; on a CPU with
        bf16 units every rank times the probe at once, with this process's threads and batches
        of data.max_tokens cut as the run cuts them from rows of `widths` (source, target), as the run will."""
        shape = ProbeShape.of_run(cfg, torch.get_num_threads(), self.world_size, widths)
        chosen = for_training(self.device, cfg, vocab_size, shape, self.collective, kept)
        return dataclasses.replace(self, precision=self.collective.all_gather_object(chosen)[0].apply())


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
