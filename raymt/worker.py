"""The training loop each Ray Train worker runs: a plain PyTorch loop plus a few Ray calls."""

from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import ray.train
import ray.train.torch
import sacrebleu
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from raymt.batching import Batch, collate, window_batches
from raymt.checkpoint import MODEL_FILE, load_train_state, load_weights, save_checkpoint
from raymt.config import Config
from raymt.decoding import DecodeOptions, decode
from raymt.model import Transformer
from raymt.optim import inverse_sqrt, loss_sum, make_optimizer, row_nll
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


def unwrap(model: torch.nn.Module) -> Transformer:
    """The plain Transformer inside a DDP wrapper (1 worker: no wrapper)."""
    return getattr(model, "module", model)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all workers (identity in a single process)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def lockstep(batches: Iterable[Batch], update_freq: int,
             device: torch.device) -> Iterator[tuple[list[Batch], int]]:
    """Group micro-batches per update and keep every worker in step.

    Yields (this worker's micro-batches, global target tokens) until every worker has run
    out; a worker that ran out early yields an empty group and takes a dummy step.
    """
    it = iter(batches)
    while True:
        group = list(itertools.islice(it, update_freq))
        num_groups, num_tokens = _all_reduce([len(group) > 0, sum(b.num_tokens for b in group)], device)
        if num_groups == 0:
            return
        yield [b.to(device) for b in group], int(num_tokens)


def _dummy_batch(device: torch.device) -> Batch:
    """A one-token batch whose zero-weighted loss lets an idle worker join the all-reduce."""
    return collate([[EOS_ID]], [[BOS_ID]]).to(device)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: list[Batch],
               global_tokens: int, cfg: Config, autocast=contextlib.nullcontext) -> float:
    """One update on the mean loss over every target token of the global batch.

    DDP averages gradients over workers, so each worker scales its summed loss by
    world_size / global_tokens: the result is the gradient of sum(loss) / global_tokens.
    Returns this worker's summed loss.
    """
    model.train()
    scale = _world_size() / global_tokens
    micro = group or [_dummy_batch(next(model.parameters()).device)]
    total = 0.0
    for i, batch in enumerate(micro):
        last = i == len(micro) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast():
                logits = model(batch.src, batch.tgt_in)
            loss = loss_sum(logits, batch.tgt_out, cfg.optim.label_smoothing)
            (loss * (scale if group else 0.0)).backward()
        total += loss.item() if group else 0.0
    if cfg.optim.clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def collate_eval(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Validation rows -> padded tensors plus each row's corpus index."""
    batch = collate([r["src_ids"] for r in rows], [r["tgt_ids"] for r in rows])
    return {"index": torch.tensor([r["index"] for r in rows]), "src": batch.src,
            "tgt_in": batch.tgt_in, "tgt_out": batch.tgt_out}


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Iterable[dict], tokenizer: Tokenizer,
             refs: list[str], opts: DecodeOptions) -> dict[str, float]:
    """Loss, BLEU and chrF of this worker's share, merged so that every row counts once."""
    net = unwrap(model)
    net.eval()
    rows = []
    for batch in loader:
        nll = row_nll(net(batch["src"], batch["tgt_in"]), batch["tgt_out"])
        num_tokens = (batch["tgt_out"] != PAD_ID).sum(1)
        hyps = [tokenizer.decode(h) for h in decode(net, batch["src"], opts)]
        rows += zip(batch["index"].tolist(), nll.tolist(), num_tokens.tolist(), hyps)
    parts: list = [None] * _world_size()
    if dist.is_initialized():
        dist.all_gather_object(parts, rows)
    else:
        parts = [rows]
    # A DistributedSampler pads shares to equal size by repeating rows: keep one of each.
    merged = {r[0]: r for part in parts for r in part}
    assert len(merged) == len(refs), f"scored {len(merged)} of {len(refs)} rows"
    ordered = [merged[i] for i in range(len(refs))]
    hyps = [r[3] for r in ordered]
    return {"valid_loss": sum(r[1] for r in ordered) / sum(r[2] for r in ordered),
            "valid_bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
            "valid_chrf": sacrebleu.corpus_chrf(hyps, [refs]).score}


def epoch_batches(shard, cfg: Config, epoch: int) -> Iterator[Batch]:
    """This worker's token-budget batches for one epoch, deterministic given seed and epoch."""
    rng = np.random.default_rng([cfg.train.seed, epoch, ray.train.get_context().get_world_rank()])
    windows = shard.iter_batches(
        batch_size=cfg.data.window_rows, batch_format="numpy",
        local_shuffle_buffer_size=cfg.data.shuffle_buffer_rows or None,
        local_shuffle_seed=cfg.train.seed * 100_003 + epoch)
    for window in windows:
        yield from window_batches(window, cfg.data.max_tokens, rng)


def _restore(model: Transformer, optimizer, scheduler, init_checkpoint: Optional[str]) -> dict:
    """Load the latest Ray Train checkpoint (after a failure or on resume), if any."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            model.load_state_dict(load_weights(d))
            state = load_train_state(d)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return state
    if init_checkpoint is not None:  # start a new run from another run's weights
        model.load_state_dict(load_weights(init_checkpoint))
    return {"step": 0, "epoch": 0}


class Progress:
    """Rank 0's progress lines: step, loss, lr, tokens/s and ETA."""

    def __init__(self, cfg: Config, start_step: int):
        self.cfg, self.start_step = cfg, start_step
        self.t0 = self.t_last = time.perf_counter()
        self.loss = self.tokens = 0.0

    def update(self, loss: float, tokens: int) -> None:
        """Accumulate one step's summed loss (this worker) and global token count."""
        self.loss += loss
        self.tokens += tokens

    def log(self, step: int, epoch: int, lr: float, device: torch.device, is_rank0: bool) -> dict:
        """All-reduce the interval's loss, print a line on rank 0 and reset."""
        loss_total, = _all_reduce([self.loss], device)
        now = time.perf_counter()
        tokens_per_s = self.tokens / max(now - self.t_last, 1e-9)
        metrics = {"train_loss": loss_total / max(self.tokens, 1), "lr": lr,
                   "tokens_per_s": tokens_per_s}
        if is_rank0:
            done = step - self.start_step
            eta = (now - self.t0) / max(done, 1) * (self.cfg.train.max_steps - step)
            print(f"step {step}/{self.cfg.train.max_steps} | epoch {epoch + 1} | "
                  f"loss {metrics['train_loss']:.3f} | lr {lr:.2e} | "
                  f"{tokens_per_s / 1000:.1f}k tok/s | eta {eta / 60:.1f} min", flush=True)
        self.loss = self.tokens = 0.0
        self.t_last = now
        return metrics


def _report(metrics: dict, model, optimizer, scheduler, cfg: Config, tokenizer: Tokenizer,
            step: int, epoch: int) -> None:
    """Every rank reports (a barrier); only rank 0 writes and attaches the checkpoint."""
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, unwrap(model), cfg, tokenizer, {
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": step, "epoch": epoch})
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def train_loop_per_worker(loop_config: dict) -> None:
    """Build tokenizer, model and data inside the worker from config; train; report."""
    cfg = Config.from_dict(loop_config["config"])
    tokenizer = Tokenizer(loop_config["spm_model"])
    torch.set_num_threads(loop_config["num_threads"])
    torch.manual_seed(cfg.train.seed)
    device = ray.train.torch.get_device()
    is_rank0 = ray.train.get_context().get_world_rank() == 0
    on_gpu = device.type == "cuda"

    model = Transformer(cfg.model, tokenizer.vocab_size)
    optimizer = make_optimizer(model, cfg.optim, fused=on_gpu)
    scheduler = inverse_sqrt(optimizer, cfg.optim.warmup_steps)
    state = _restore(model, optimizer, scheduler, loop_config.get("init_checkpoint"))
    model = ray.train.torch.prepare_model(model)  # DDP over gloo (CPU) or nccl (GPU)
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16))
                if on_gpu and cfg.train.bf16 else contextlib.nullcontext)

    valid = loop_config["valid"]
    valid_loader = ray.train.torch.prepare_data_loader(DataLoader(
        valid["rows"], batch_size=cfg.data.eval_batch_size, collate_fn=collate_eval))
    opts = DecodeOptions(beam=cfg.train.valid_beam, length_penalty=cfg.train.length_penalty,
                         max_len_a=cfg.train.max_len_a, max_len_b=cfg.train.max_len_b)
    shard = ray.train.get_dataset_shard("train")

    step, epoch = state["step"], state["epoch"]
    progress, evaluated = Progress(cfg, step), step
    deadline = (time.monotonic() + 60 * cfg.train.max_minutes) if cfg.train.max_minutes else None

    def out_of_time() -> bool:
        # Any worker past the deadline stops all of them at the same step.
        late = deadline is not None and time.monotonic() > deadline
        return _all_reduce([float(late)], device)[0] > 0

    def evaluate_and_report() -> None:
        metrics = progress.log(step, epoch, scheduler.get_last_lr()[0], device, is_rank0)
        metrics.update(evaluate(model, valid_loader, tokenizer, valid["refs"], opts),
                       step=step, epoch=epoch)
        if is_rank0:
            print(f"step {step} | valid loss {metrics['valid_loss']:.3f} | "
                  f"BLEU {metrics['valid_bleu']:.2f} | chrF {metrics['valid_chrf']:.2f}", flush=True)
        _report(metrics, model, optimizer, scheduler, cfg, tokenizer, step, epoch)

    stop = False
    while not stop and step < cfg.train.max_steps and (cfg.train.epochs is None or epoch < cfg.train.epochs):
        for group, num_tokens in lockstep(epoch_batches(shard, cfg, epoch), cfg.optim.update_freq, device):
            progress.update(train_step(model, optimizer, group, num_tokens, cfg, autocast), num_tokens)
            scheduler.step()
            step += 1
            if step % cfg.train.eval_every == 0 or step >= cfg.train.max_steps:
                evaluate_and_report()
                evaluated = step
            elif step % cfg.train.log_every == 0:
                progress.log(step, epoch, scheduler.get_last_lr()[0], device, is_rank0)
            stop = step >= cfg.train.max_steps or (step % cfg.train.log_every == 0 and out_of_time())
            if stop:
                break
        if not stop:
            epoch += 1
    if evaluated != step:  # the epoch or time limit ended the run between evaluations
        evaluate_and_report()
