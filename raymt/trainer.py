"""The training loop in plain PyTorch: step, lockstep, validation, progress, restore.

No Ray and no `torch.distributed` here: collective operations go through a `Collective`
(this module's single-process one by default; `raymt.distributed` has the torch.distributed
one), so the loop runs and is tested in one process. What a loop around it adds at each step
(validation, checkpoints, logs) comes in as `Hooks`.

The step never waits for the device (no `.item()`, `bool(tensor)`, `.tolist()`, `.cpu()`):
- the loss, the count of skipped updates and the longest run of them stay on the device
  and are read once per log interval (`Progress.log`);
- a non-finite gradient norm skips the update inside fused AdamW (its `found_inf` input,
  as `torch.amp.GradScaler` uses it) instead of a host-side `if`; with fp16's loss scaler
  (raymt.precision) the scale backs off and grows on the device too;
- the global target token count that normalizes the loss comes from a CPU all-reduce of
  host-side counts issued one update ahead (`lockstep`), never from a device tensor.

A skipped update still counts as a step: the step counter and the lr schedule move on
(the host cannot know it was skipped without waiting), AdamW's own step count and moments
do not. More than `train.max_nonfinite_steps` skipped in a row stop the run at the next log
interval.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Optional

import torch
from torch.profiler import record_function

from raymt.batching import Batch, ShapeLadder, collate, padding_rows
from raymt.config import Config, DataConfig
from raymt.decoding import DecodeOptions, decode
from raymt.metrics import score
from raymt.model import Transformer
from raymt.optim import inverse_sqrt, loss_sum, make_optimizer, row_nll
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

if TYPE_CHECKING:  # the annotation only: the training loop needs no checkpoint files
    from raymt.checkpoint import TrainState


class Done:
    """A finished collective: `wait` returns its tensor."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        """The reduced tensor."""
        return self.tensor


class Collective:
    """Collective operations of a single process: every one is the identity."""

    world_size = 1
    rank = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all workers in place (a device tensor; enqueued, not awaited)."""
        return tensor

    def all_reduce_sum_async(self, tensor: torch.Tensor) -> Done:
        """Start summing a CPU tensor over all workers; `.wait()` on the result gives it."""
        return Done(tensor)

    def all_gather_object(self, obj: Any) -> list:
        """Every worker's `obj`, in rank order."""
        return [obj]


SINGLE = Collective()


def unwrap(model: torch.nn.Module) -> Transformer:
    """The plain Transformer inside torch.compile and DDP wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


# ---------------------------------------------------------------- compilation


def compile_model(model: torch.nn.Module, backend: str | Callable = "inductor") -> torch.nn.Module:
    """torch.compile the (DDP-wrapped) model; shapes that change get dynamic dims, not one graph each."""
    # Compiling the DDP wrapper lets DDPOptimizer split graphs at bucket boundaries, so the
    # gradient all-reduce still overlaps backward (torch docs, "torch.compile with DDP").
    return torch.compile(model, backend=backend, dynamic=None)


# ---------------------------------------------------------------- state


def restore_training(
    model: torch.nn.Module,
    cfg: Config,
    weights: Optional[dict],
    train_state: Optional[TrainState],
    place: Callable[[torch.nn.Module], torch.nn.Module],
    scaler: Optional[torch.amp.GradScaler] = None,
):
    """Load weights, put the model on its device (`place`), then build and restore the optimizer
    (and fp16's loss `scaler`, where the run has one and the checkpoint saved one).

    The optimizer comes after `place` so that its state (and fused kernels) live on the
    parameters' device; built before, a GPU resume crashes ("exp_avgs is on cpu").
    A restored optimizer takes this run's optim.lr and AdamW settings at the restored point of
    the schedule: a resume given another optim.lr (as the non-finite error advises), or a PBT
    exploit's donor state, trains with them; unchanged, they are what was restored.
    Returns (placed model, optimizer, scheduler).
    """
    if weights is not None:
        unwrap(model).load_state_dict(weights)
    model = place(model)
    optimizer = make_optimizer(unwrap(model), cfg.optim)
    scheduler = inverse_sqrt(optimizer, cfg.optim.warmup_steps)
    if train_state is not None:
        saved = dict(train_state.optimizer)  # kernels of this optimizer, not the saving one's
        saved["param_groups"] = [
            {**g, "fused": optimizer.defaults["fused"], "foreach": optimizer.defaults["foreach"]}
            for g in saved["param_groups"]
        ]
        optimizer.load_state_dict(saved)  # moves the state to each parameter's device
        scheduler.load_state_dict(train_state.scheduler)
        if scaler is not None and train_state.grad_scaler:  # none: saved by a bf16/fp32 run
            scaler.load_state_dict(train_state.grad_scaler)
        # The state dicts carry the saving run's lr (base_lrs) and settings; this run's config wins.
        scheduler.base_lrs = [cfg.optim.lr] * len(scheduler.base_lrs)
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
        for group in optimizer.param_groups:
            group.update(
                lr=cfg.optim.lr * factor,
                betas=(cfg.optim.beta1, cfg.optim.beta2),
                eps=cfg.optim.eps,
                weight_decay=cfg.optim.weight_decay,
            )
    return model, optimizer, scheduler


def rng_state(device: torch.device, cuda=torch.cuda) -> dict:
    """This process's CPU RNG state and, on a GPU, that of `device` alone (not every visible GPU's)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict | torch.Tensor, device: torch.device, cuda=torch.cuda) -> bool:
    """Restore `rng_state()`'s result on `device`; False when it holds no state for `device`.

    Only `device`'s generator is set: workers sharing a node's GPUs leave each other's alone.
    Older checkpoints hold a bare CPU tensor, or a list of every GPU the saving worker saw
    (its own at its device index): the entry at this device's index is used if there is one.
    """
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if device.type != "cuda":
        return True
    saved = state.get("cuda")
    if isinstance(saved, list):  # get_rng_state_all() of an older checkpoint
        index = device.index or 0
        saved = saved[index] if index < len(saved) else None
    if saved is None:  # saved on the CPU, or on fewer GPUs than this device's index
        return False
    cuda.set_rng_state(saved, device)
    return True


# ---------------------------------------------------------------- the step


class Update(NamedTuple):
    """One update's micro-batches on this worker and what all workers agreed on."""

    batches: list[Batch]  # this worker's micro-batches, on the device (empty: a dummy step)
    num_tokens: int  # target tokens of the global batch
    late: bool  # some worker is past its time budget
    mark: Any  # what `mark()` returned right after this worker's batches were read


def lockstep(
    batches: Iterable[Batch],
    update_freq: int,
    device: torch.device,
    collective: Collective = SINGLE,
    late: Callable[[], bool] = lambda: False,
    mark: Callable[[], Any] = lambda: None,
) -> Iterator[Update]:
    """Group micro-batches per update and keep every worker in step.

    Yields an `Update` until every worker has run out; a worker that ran out early yields an
    empty group and takes a dummy step. Each group's [has_batches, num_tokens, late] is
    all-reduced on the CPU, one update ahead: the next group's reduction runs while this
    update trains, so the step waits for no collective of its own.
    """
    it = iter(batches)

    def read() -> tuple[list[Batch], Any, Any]:
        group = list(itertools.islice(it, update_freq))
        counts = torch.tensor([len(group) > 0, sum(b.num_tokens for b in group), late()], dtype=torch.float64)
        return group, mark(), collective.all_reduce_sum_async(counts)

    group, tag, pending = read()
    try:
        while True:
            with record_function("raymt.lockstep"):  # waits here for the slowest worker's batch
                # A CPU tensor: numpy() cannot wait for a device (it refuses CUDA tensors).
                has_batches, num_tokens, num_late = pending.wait().numpy()
            pending = None
            if has_batches == 0:
                return
            moved = [b.to(device) for b in group]
            current = Update(moved, int(num_tokens), num_late > 0, tag)
            group, tag, pending = read()
            yield current
    finally:  # every worker issued the same reductions; finish the last before leaving
        if pending is not None:
            pending.wait()


def _dummy_batch(device: torch.device, data: DataConfig) -> Batch:
    """A zero-weighted batch that lets an idle worker join the all-reduce: with a shape ladder,
    all-PAD rows of its narrowest rung (on the ladder, so no new compiled shape, and the
    cheapest attention of any rung), else one token."""
    ladder = ShapeLadder.from_config(data)
    if ladder is None:
        return collate([[EOS_ID]], [[BOS_ID]]).to(device)
    rows, width = ladder.shape(1)
    moved = int(data.tag_side == "tgt")  # real batches' shapes: the tag moved from src to tgt (tag_to_decoder)
    return padding_rows(rows, width - moved, width + moved).to(device)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    group: list[Batch],
    global_tokens: int,
    cfg: Config,
    autocast=contextlib.nullcontext,
    world_size: int = 1,
    scaler: Optional[torch.amp.GradScaler] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One update on the mean loss over every target token of the global batch.

    DDP averages gradients over workers, so each worker scales its summed loss by
    world_size / global_tokens: the result is the gradient of sum(loss) / global_tokens.
    Returns device scalars (this worker's summed loss, 1.0 if the update was applied else
    0.0): an update whose gradient norm is not finite is skipped. After DDP's all-reduce
    every worker holds the same gradients, so all workers skip together. With a fused
    optimizer (make_optimizer's) the skip happens on the device; others wait for the check.
    With fp16's `scaler` the loss is scaled before backward and the gradients unscaled before
    clipping; an overflow is such a non-finite norm (skipped, counted) and backs the scale off.
    """
    model.train()
    scale = world_size / global_tokens if group else 0.0  # host numbers: no device sync
    device = next(model.parameters()).device
    micro = group or [_dummy_batch(device, cfg.data)]
    total = torch.zeros((), device=device)
    for i, batch in enumerate(micro):
        last = i == len(micro) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with record_function("raymt.forward"):
                with autocast():
                    logits = model(batch.src, batch.tgt_in)
                loss = loss_sum(logits, batch.tgt_out, cfg.optim.label_smoothing)
            with record_function("raymt.backward"):  # with DDP: the all-reduce it does not hide
                scaled = loss * scale
                (scaled if scaler is None else scaler.scale(scaled)).backward()
        if group:
            total += loss.detach()
    max_norm = cfg.optim.clip_norm if cfg.optim.clip_norm > 0 else float("inf")
    with record_function("raymt.clip"):
        if scaler is not None:  # true gradients to clip; notes inf/nan per device for update()
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        found_inf = (~torch.isfinite(norm)).float()  # () on the device
    with record_function("raymt.optimizer"):
        if getattr(optimizer, "_step_supports_amp_scaling", False):  # fused: skips on the device
            optimizer.found_inf = found_inf
            optimizer.step()
            del optimizer.found_inf
        elif not found_inf:  # waits for the device
            optimizer.step()
        if scaler is not None:  # halve the scale after an overflow, grow it after clean steps
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return total, 1.0 - found_inf


# ---------------------------------------------------------------- validation


def collate_eval(rows: list[dict], tag_side: str = "src") -> dict[str, torch.Tensor]:
    """Validation rows -> padded tensors plus each row's corpus index (`tag_side` "tgt": the
    tags moved to the decoder, `raymt.batching.tag_to_decoder`, and kept as the (B, 1) "prefix"
    decoding forces)."""
    batch = collate([r["src_ids"] for r in rows], [r["tgt_ids"] for r in rows], tag_side)
    out = {"index": torch.tensor([r["index"] for r in rows]), "src": batch.src}
    out.update(tgt_in=batch.tgt_in, tgt_out=batch.tgt_out)
    return {**out, "prefix": batch.tgt_in[:, 1:2]} if tag_side == "tgt" else out


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: Iterable[dict],
    tokenizer: Tokenizer,
    refs: list[str],
    opts: DecodeOptions,
    collective: Collective = SINGLE,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    lang: str = "",
) -> dict:
    """Loss, BLEU and chrF (with signatures) of every worker's share, each row counted once;
    forward passes and decoding under `autocast` (training's precision); BLEU tokenized for
    `lang`, the target language. `valid_tokens`: the target tokens the loss is averaged over
    (to weight several pairs' losses, `pair_metrics`)."""
    net = unwrap(model)
    net.eval()
    rows = []
    for batch in loader:
        with autocast():
            nll = row_nll(net(batch["src"], batch["tgt_in"]), batch["tgt_out"])  # fp32 (B,)
            ids = decode(net, batch["src"], opts, batch.get("prefix"))
        num_tokens = (batch["tgt_out"] != PAD_ID).sum(1)
        hyps = [tokenizer.decode(h) for h in ids]
        rows += zip(batch["index"].tolist(), nll.tolist(), num_tokens.tolist(), hyps)
    parts = collective.all_gather_object(rows)
    # A DistributedSampler pads shares to equal size by repeating rows: keep one of each.
    merged = {r[0]: r for part in parts for r in part}
    assert len(merged) == len(refs), f"scored {len(merged)} of {len(refs)} rows"
    ordered = [merged[i] for i in range(len(refs))]
    scores = score([r[3] for r in ordered], refs, lang=lang)
    num_tokens = sum(r[2] for r in ordered)
    return {
        "valid_loss": sum(r[1] for r in ordered) / num_tokens,
        "valid_bleu": scores["bleu"],
        "valid_chrf": scores["chrf"],
        "valid_bleu_signature": scores["bleu_signature"],
        "valid_chrf_signature": scores["chrf_signature"],
        "valid_tokens": num_tokens,
    }


# ---------------------------------------------------------------- progress


class Progress:
    """The interval's loss and skipped updates, kept on the device; rank 0's progress lines."""

    def __init__(
        self, cfg: Config, start_step: int, device: torch.device, collective: Collective = SINGLE, is_rank0: bool = True
    ):
        self.cfg, self.start_step, self.collective, self.is_rank0 = cfg, start_step, collective, is_rank0
        self.t0 = self.t_last = time.perf_counter()
        self.tokens = 0  # global target tokens of this interval's updates (host)
        # [summed loss, tokens of applied updates, skipped updates, longest run of skipped]
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.run = torch.zeros((), dtype=torch.float64, device=device)  # skipped in a row now
        self.num_skipped = 0
        self.last_step = start_step  # the step the interval began after
        self.last: Optional[dict] = None
        self.note: Callable[[], str] = lambda: ""  # the progress line's end (a GPU worker's memory)

    def update(self, loss: torch.Tensor, applied: torch.Tensor, num_tokens: int) -> None:
        """Add one update's summed loss (this worker), applied flag and global token count."""
        self.tokens += num_tokens
        self.run = (self.run + 1) * (1 - applied)
        step = torch.stack(
            [torch.where(applied > 0, loss, 0.0), applied * num_tokens, 1 - applied, torch.zeros_like(applied)]
        ).double()
        self.sums += step
        torch.maximum(self.sums[3], self.run, out=self.sums[3])

    def log(self, step: int, epoch: int, lr: float) -> dict:
        """All-reduce the interval's loss (the one sync of an interval), print on rank 0, reset."""
        if self.tokens == 0 and self.last is not None:  # nothing new since the last line
            return dict(self.last)  # (tokens are global counts: every rank takes this branch)
        self.collective.all_reduce_sum(self.sums[:1])
        loss, applied_tokens, skipped, worst_run = self.sums.tolist()
        self.num_skipped += int(skipped)
        now = time.perf_counter()
        tokens_per_s = self.tokens / max(now - self.t_last, 1e-9)
        # No applied update since this attempt started (e.g. a PBT trial at max_steps): nan.
        metrics = {
            "train_loss": loss / applied_tokens if applied_tokens else float("nan"),
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "skipped_steps": self.num_skipped,
            "nonfinite_in_a_row": int(worst_run),
        }
        if self.is_rank0:
            done = step - self.start_step
            eta = (now - self.t0) / max(done, 1) * (self.cfg.train.max_steps - step)
            if self.cfg.train.max_minutes:  # the time budget may end the run first
                eta = max(0.0, min(eta, 60 * self.cfg.train.max_minutes - (now - self.t0)))
            print(
                f"step {step}/{self.cfg.train.max_steps} | epoch {epoch + 1} | "
                f"loss {metrics['train_loss']:.3f} | lr {lr:.2e} | "
                f"{tokens_per_s / 1000:.1f}k tok/s | eta {eta / 60:.1f} min{self.note()}",
                flush=True,
            )
            if skipped:
                print(
                    f"steps {self.last_step + 1}-{step}: {int(skipped)} updates "
                    f"skipped (non-finite loss or gradient; {self.num_skipped} in all)",
                    flush=True,
                )
        self.sums.zero_()
        self.sums[3] = self.run  # a run of skipped updates goes on into the next interval
        self.tokens = 0
        self.t_last, self.last_step = now, step
        self.last = metrics
        return dict(metrics)


# ---------------------------------------------------------------- the loop


class Hooks:
    """What a loop around `Trainer` adds to its steps (raymt.worker.WorkerLoop); alone, nothing."""

    def before_step(self, update: Update) -> None:
        """Called with each update before it trains."""

    def after_step(self, update: Update) -> None:
        """Called after each update (step already counted)."""

    def logged(self, metrics: dict) -> None:
        """Called with the training metrics of each log interval that ends without an evaluation."""

    def evaluate(self, metrics: dict) -> bool:
        """Called every train.eval_every steps and at max_steps, with the interval's training
        metrics; True stops the run (early stopping)."""
        return False

    def note(self) -> str:
        """The end of rank 0's progress line."""
        return ""


NO_HOOKS = Hooks()


class Trainer:
    """One worker's training loop: updates, progress lines, the evaluation and stop cadence.

    `hooks` (raymt.worker.WorkerLoop) add validation, checkpoints and logs; without them it
    trains and prints progress lines in one process.
    """

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        device: torch.device,
        step: int = 0,
        epoch: int = 0,
        collective: Collective = SINGLE,
        autocast=contextlib.nullcontext,
        scaler: Optional[torch.amp.GradScaler] = None,
        hooks: Hooks = NO_HOOKS,
    ):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.device, self.step, self.epoch, self.collective = device, step, epoch, collective
        self.autocast, self.scaler, self.hooks = autocast, scaler, hooks  # scaler: fp16's loss scaler, else None
        self.is_rank0 = collective.rank == 0
        self.progress = Progress(cfg, step, device, collective, self.is_rank0)
        self.progress.note = hooks.note
        minutes = cfg.train.max_minutes
        self.deadline = time.monotonic() + 60 * minutes if minutes else None

    def late(self) -> bool:
        """True once this worker is past the time budget."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def train_epoch(self, batches: Iterable[Batch], mark: Callable[[], Any] = lambda: None) -> bool:
        """Train on `batches` until they end; True when the run must stop (steps, time, early stop)."""
        cfg = self.cfg
        for update in lockstep(batches, cfg.optim.update_freq, self.device, self.collective, self.late, mark):
            self.hooks.before_step(update)
            loss, applied = train_step(
                self.model,
                self.optimizer,
                update.batches,
                update.num_tokens,
                cfg,
                self.autocast,
                self.collective.world_size,
                self.scaler,
            )
            self.progress.update(loss, applied, update.num_tokens)
            self.scheduler.step()
            self.step += 1
            self.hooks.after_step(update)
            if self.step % cfg.train.eval_every == 0 or self.step >= cfg.train.max_steps:
                if self.hooks.evaluate(self.log_train()):
                    return True
            elif self.step % cfg.train.log_every == 0:
                self.hooks.logged(self.log_train())
            if self.step >= cfg.train.max_steps or (self.step % cfg.train.log_every == 0 and update.late):
                return True
        return False

    def log_train(self) -> dict:
        """The interval's training metrics and rank 0's progress line; stops a run stuck on
        non-finite updates."""
        metrics = self.progress.log(self.step, self.epoch, self.scheduler.get_last_lr()[0])
        if metrics["nonfinite_in_a_row"] > self.cfg.train.max_nonfinite_steps:
            raise RuntimeError(
                f"{metrics['nonfinite_in_a_row']} updates in a row had a non-finite loss or gradient "
                f"(by step {self.step}); the last checkpoint is intact: lower optim.lr or raise "
                "optim.warmup_steps, then continue with --resume"
            )
        metrics["epoch"] = self.epoch
        return metrics
