"""What a training worker reads: the epoch feed (this epoch's stream, the next one's read ahead,
the position a checkpoint resumes from, each update's traced pairs) and the validation sets."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.data import DataLoader

from raymt.checkpoint import TrainState
from raymt.config import Config, DataConfig
from raymt.data.epoch import Mix, Position, batching_record, mix_record, training_data
from raymt.data.format import TrainingCorpus
from raymt.data.stream import TrainStream, resume_point
from raymt.decoding import DecodeOptions
from raymt.metrics import pair_metrics
from raymt.tokenizer import Tokenizer
from raymt.trainer import SINGLE, Collective, collate_eval, evaluate
from raymt.worker_env import ValidRows


class EpochFeed:
    """This worker's training pairs, epoch by epoch, from a checkpoint's data state on.

    One pair's shards, or several corpora mixed by data.temperature (checkpoints record the
    mix, `data_mix`). `position` is where a checkpoint taken now resumes this worker's stream.
    """

    def __init__(
        self,
        training_corpora: list[TrainingCorpus],
        cfg: Config,
        rank: int,
        world_size: int,
        epoch: int,
        state: TrainState,
        resumed: bool = False,
    ):
        """`state`: a checkpoint's train state (`TrainState()`: a new run); `resumed`: this run's
        own, whose data positions carry over only to the same mix of corpora."""
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.mix: Mix = training_data(training_corpora, cfg.data.temperature, cfg.data.shuffle_block_rows)
        self.data_mix = mix_record(training_corpora, cfg.data.temperature)
        if resumed:
            check_data_mix(state.data_mix, self.data_mix)
        saved, batching = state.data_positions, state.data_batching
        self.position, self.segment = resume_point(
            self.mix, cfg.data, cfg.train.seed, epoch, saved, state.data_segment, rank, world_size, batching
        )
        note = resize_note(saved, world_size, batching_changes(batching, cfg.data))
        if note and rank == 0:
            left = self.segment.num_left() if self.segment else self.mix.num_rows
            print(
                f"{note}: the workers share the {left} pairs "
                f"left of epoch {epoch + 1} ({self.mix.num_rows - left} trained before; each pair once)",
                flush=True,
            )
        self.trace = self.pin_memory = False
        self.stream: Optional[TrainStream] = None  # this epoch's
        self.upcoming: Optional[TrainStream] = None  # the next epoch's, started after this one's first step
        self.waited_s = 0.0  # the time earlier epochs' streams kept the loop waiting

    def start(self, trace: bool = False, pin_memory: bool = False) -> None:
        """Start reading from `position` (with `trace`, noting a digest of every pair handed out)."""
        self.trace, self.pin_memory = trace, pin_memory
        self.stream = self.open(self.position)

    def open(self, position: Position, start: bool = True) -> TrainStream:
        """This worker's stream of the epoch `position` is in, reading ahead once started."""
        stream = TrainStream(
            self.mix,
            self.cfg.data,
            self.cfg.train.seed,
            self.rank,
            self.world_size,
            position,
            trace=self.trace,
            pin_memory=self.pin_memory,
            segment=self.segment,
        )
        return stream.start() if start else stream

    def open_next(self, epoch: int) -> None:
        """Open (not start) the stream of `epoch`, the one after this stream's."""
        self.upcoming = self.open(Position(epoch), start=False)

    def mark(self) -> tuple[Position, list[str]]:
        """Right after an update's batches are read: the stream position and traced pairs.

        lockstep reads the next update's batches before this one trains, so both are
        taken here, not after the step.
        """
        traced = list(self.stream.traced)
        self.stream.traced.clear()
        return self.stream.position, traced

    def advance(self, mark: tuple[Position, list[str]]) -> None:
        """Before an update trains: note the position a checkpoint after it resumes from."""
        self.position, _ = mark
        # The next epoch's stream starts after this epoch's first step, so its first chunk
        # is read and cut while this epoch trains: an epoch never waits for the next.
        self.upcoming.start()

    def end_epoch(self, stop: bool) -> None:
        """Close this epoch's stream; unless the run stops, the next epoch's takes its place."""
        if not stop:
            self.position = self.stream.position
        self.waited_s += self.stream.busy_s
        self.stream.busy_s = 0.0
        self.stream.close()
        if stop:
            self.upcoming.close()
        else:
            self.position, self.stream = self.upcoming.position, self.upcoming.start()

    def waited(self) -> float:
        """Seconds the loop has waited for batches so far."""
        return self.waited_s + self.stream.busy_s

    def segment_record(self, epoch: int) -> Optional[dict]:
        """A checkpoint's `data_segment`: the rest of `epoch` a resized group shares, if any."""
        return self.segment.to_dict() if self.segment and self.segment.epoch == epoch else None

    def close(self) -> None:
        """Stop reading."""
        self.stream.close()


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
            "(--init CHECKPOINT_DIR --name NEW)"
        )


def batching_changes(saved: Optional[dict], cfg: DataConfig) -> str:
    """The batching fields a resume changes, in words ("data.max_tokens 4096 -> 2048"); "" if none."""
    now = batching_record(cfg)
    return ", ".join(f"data.{k} {v} -> {now[k]}" for k, v in (saved or {}).items() if now.get(k) != v)


def resize_note(saved: Optional[list], world_size: int, recut: str) -> str:
    """Why a resumed worker group shares the rest of an epoch anew: another group size, other
    batching fields (`recut`), or both; "" when it continues every saved position."""
    if not saved:
        return ""
    resized = f"resized from {len(saved)} to {world_size} workers" if len(saved) != world_size else ""
    return "; ".join(x for x in (resized, recut) if x)


class ValidSets:
    """Each pair's validation set, its sources starting with the pair's tag (if any): this
    worker's share of the rows (a loader) and every reference."""

    def __init__(
        self,
        sets: dict[str, tuple[Iterable[dict], list[str]]],
        tokenizer: Tokenizer,
        opts: DecodeOptions,
    ):
        self.sets, self.tokenizer, self.opts = sets, tokenizer, opts
        self.pairs = list(sets)

    @classmethod
    def create(
        cls,
        valid: dict[str, ValidRows],
        cfg: Config,
        tokenizer: Tokenizer,
        prepare: Callable[[DataLoader], Iterable],
    ) -> "ValidSets":
        """The driver's validation rows (`raymt.train.valid_rows`) in loaders that `prepare` shares out."""
        collate = functools.partial(collate_eval, tag_side=cfg.data.tag_side)  # the tag where training has it
        loaders = {
            pair: (prepare(DataLoader(v.rows, batch_size=cfg.data.eval_batch_size, collate_fn=collate)), v.refs)
            for pair, v in valid.items()
        }
        # Validation BLEU is greedy or beam search: decode.sample is for translating, not scoring.
        opts = dataclasses.replace(cfg.decode, beam=cfg.train.valid_beam, sample=False)
        return cls(loaders, tokenizer, opts)

    def score(
        self,
        model: torch.nn.Module,
        collective: Collective = SINGLE,
        autocast: Callable[[], Any] = contextlib.nullcontext,
    ) -> dict:
        """Each pair's validation metrics and, with several pairs, their averages (`pair_metrics`)."""
        per_pair, num_tokens = {}, {}
        for pair, (loader, refs) in self.sets.items():
            lang = pair.split("-", 1)[1]  # codes hold no '-'
            scores = evaluate(model, loader, self.tokenizer, refs, self.opts, collective, autocast, lang)
            num_tokens[pair] = scores.pop("valid_tokens")  # weights the pairs' losses; no metric
            per_pair[pair] = scores
        return pair_metrics(per_pair, num_tokens)

    def line(self, step: int, metrics: dict) -> str:
        """Rank 0's line of an evaluation; with several pairs BLEU and chrF are their means, and
        each pair's BLEU follows."""
        each = "".join(f" | {p} {metrics[f'valid_bleu/{p}']:.2f}" for p in self.pairs if len(self.pairs) > 1)
        return (
            f"step {step} | valid loss {metrics['valid_loss']:.3f} | "
            f"BLEU {metrics['valid_bleu']:.2f} | chrF {metrics['valid_chrf']:.2f}{each}"
        )
