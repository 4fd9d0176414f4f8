"""The training loop each Ray Train worker runs: a plain PyTorch loop plus a few Ray calls."""

from __future__ import annotations

import contextlib
import itertools
import re
import resource
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional

import ray.train
import ray.train.torch
import sacrebleu
import torch
import torch.distributed as dist
from torch.profiler import record_function
from torch.utils.data import DataLoader

from raymt.batching import Batch, collate
from raymt.checkpoint import load_train_state, load_weights, save_checkpoint
from raymt.config import Config
from raymt.decoding import DecodeOptions, decode
from raymt.metrics import MetricsLog
from raymt.model import Transformer
from raymt.optim import inverse_sqrt, loss_sum, make_optimizer, row_nll
from raymt.profiling import StepProfiler
from raymt.data.stream import Position, TrainStream, restore_position
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
        with record_function("raymt.lockstep"):  # waits here for the slowest worker's last step
            num_groups, num_tokens = _all_reduce([len(group) > 0, sum(b.num_tokens for b in group)],
                                                 device)
        if num_groups == 0:
            return
        yield [b.to(device) for b in group], int(num_tokens)


def _dummy_batch(device: torch.device) -> Batch:
    """A one-token batch whose zero-weighted loss lets an idle worker join the all-reduce."""
    return collate([[EOS_ID]], [[BOS_ID]]).to(device)


def native_bf16(device: torch.device) -> bool:
    """True on CUDA, and on CPUs with bf16 units (AVX512-BF16 or AMX), where bf16 matmuls pay."""
    if device.type == "cuda":
        return True
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: stay in fp32
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", cpuinfo) is not None


def autocast_for(device: torch.device, bf16: bool):
    """A factory of the forward pass's autocast context: bf16 where asked and native, else none."""
    if bf16 and native_bf16(device):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: list[Batch],
               global_tokens: int, cfg: Config, autocast=contextlib.nullcontext) -> tuple[float, bool]:
    """One update on the mean loss over every target token of the global batch.

    DDP averages gradients over workers, so each worker scales its summed loss by
    world_size / global_tokens: the result is the gradient of sum(loss) / global_tokens.
    Returns (this worker's summed loss, whether the update was applied): an update whose
    gradient norm is not finite is skipped. After DDP's all-reduce every worker holds the
    same gradients, so all workers skip together.
    """
    model.train()
    scale = _world_size() / global_tokens
    micro = group or [_dummy_batch(next(model.parameters()).device)]
    total = torch.zeros((), device=micro[0].src.device)
    for i, batch in enumerate(micro):
        last = i == len(micro) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with record_function("raymt.forward"):
                with autocast():
                    logits = model(batch.src, batch.tgt_in)
                loss = loss_sum(logits, batch.tgt_out, cfg.optim.label_smoothing)
            with record_function("raymt.backward"):  # with DDP: the all-reduce it does not hide
                (loss * (scale if group else 0.0)).backward()
        if group:
            total += loss.detach()
    max_norm = cfg.optim.clip_norm if cfg.optim.clip_norm > 0 else float("inf")
    with record_function("raymt.clip"):
        finite = bool(torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
    with record_function("raymt.optimizer"):
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return total.item(), finite


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


def _restore(model: Transformer, optimizer, scheduler, cfg: Config, loop_config: dict) -> dict:
    """Load the latest Ray Train checkpoint (after a failure or on resume), or an initial one.

    An initial checkpoint gives weights only, or with `init_full_state` also optimizer,
    scheduler and step, continuing at this run's peak learning rate (a PBT exploit).
    """
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            model.load_state_dict(load_weights(d))
            state = load_train_state(d)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if ray.train.get_context().get_world_rank() == 0:
            print(f"resuming at step {state['step']} from {checkpoint.path}", flush=True)
        return state
    init = loop_config.get("init_checkpoint")
    if init is None:
        return {"step": 0, "epoch": 0}
    model.load_state_dict(load_weights(init))
    if not loop_config.get("init_full_state"):
        return {"step": 0, "epoch": 0}
    state = load_train_state(init)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scheduler.base_lrs = [cfg.optim.lr] * len(scheduler.base_lrs)
    for group, lr in zip(optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    return state


class Progress:
    """Rank 0's progress lines: step, loss, lr, tokens/s and ETA."""

    def __init__(self, cfg: Config, start_step: int):
        self.cfg, self.start_step = cfg, start_step
        self.t0 = self.t_last = time.perf_counter()
        self.loss = self.tokens = 0.0
        self.last: Optional[dict] = None

    def update(self, loss: float, tokens: int) -> None:
        """Accumulate one step's summed loss (this worker) and global token count."""
        self.loss += loss
        self.tokens += tokens

    def log(self, step: int, epoch: int, lr: float, device: torch.device, is_rank0: bool) -> dict:
        """All-reduce the interval's loss, print a line on rank 0 and reset."""
        if self.tokens == 0 and self.last is not None:  # nothing new since the last line
            return dict(self.last)  # (tokens are global counts: every rank takes this branch)
        loss_total, = _all_reduce([self.loss], device)
        now = time.perf_counter()
        tokens_per_s = self.tokens / max(now - self.t_last, 1e-9)
        # No step since this attempt started (e.g. a PBT trial continuing at max_steps): nan.
        metrics = {"train_loss": loss_total / self.tokens if self.tokens else float("nan"), "lr": lr,
                   "tokens_per_s": tokens_per_s}
        if is_rank0:
            done = step - self.start_step
            eta = (now - self.t0) / max(done, 1) * (self.cfg.train.max_steps - step)
            if self.cfg.train.max_minutes:  # the time budget may end the run first
                eta = min(eta, 60 * self.cfg.train.max_minutes - (now - self.t0))
            print(f"step {step}/{self.cfg.train.max_steps} | epoch {epoch + 1} | "
                  f"loss {metrics['train_loss']:.3f} | lr {lr:.2e} | "
                  f"{tokens_per_s / 1000:.1f}k tok/s | eta {eta / 60:.1f} min", flush=True)
        self.loss = self.tokens = 0.0
        self.t_last = now
        self.last = metrics
        return dict(metrics)


def _report(metrics: dict, model, optimizer, scheduler, cfg: Config, tokenizer: Tokenizer,
            step: int, epoch: int, position: dict) -> None:
    """Every rank reports (a barrier); only rank 0 writes and attaches the checkpoint.

    The checkpoint holds every rank's data position and RNG state, so that a restart
    continues each worker's stream and dropout exactly where they were.
    """
    mine = (position, torch.get_rng_state())
    parts: list = [None] * _world_size()
    if dist.is_initialized():
        dist.all_gather_object(parts, mine)
    else:
        parts = [mine]
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, unwrap(model), cfg, tokenizer, {
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": step, "epoch": epoch, "data_positions": [p for p, _ in parts],
            "rng_states": [r for _, r in parts]})
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


class WorkerLoop:
    """One worker's model, data and state; `run` is the training loop."""

    def __init__(self, loop_config: dict):
        cfg = self.cfg = Config.from_dict(loop_config["config"])
        self.tokenizer = Tokenizer(loop_config["spm_model"])
        torch.set_num_threads(loop_config["num_threads"])
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        self.device = ray.train.torch.get_device()
        self.rank = ray.train.get_context().get_world_rank()
        self.world_size = ray.train.get_context().get_world_size()
        self.is_rank0 = self.rank == 0
        on_gpu = self.device.type == "cuda"

        model = Transformer(cfg.model, self.tokenizer.vocab_size)
        self.optimizer = make_optimizer(model, cfg.optim, fused=on_gpu)
        self.scheduler = inverse_sqrt(self.optimizer, cfg.optim.warmup_steps)
        state = _restore(model, self.optimizer, self.scheduler, cfg, loop_config)
        self.step, self.epoch = state["step"], state["epoch"]
        # DDP over gloo (CPU) or nccl (GPU); smaller buckets start all-reducing earlier in backward.
        self.model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs={
            "bucket_cap_mb": cfg.train.ddp_bucket_mb, "gradient_as_bucket_view": True})
        self.train_files = loop_config["train_files"]
        self.position = restore_position(state.get("data_positions"), self.rank, self.world_size,
                                         self.epoch)
        rng_states = state.get("rng_states")
        if rng_states and len(rng_states) == self.world_size:  # dropout continues exactly
            torch.set_rng_state(rng_states[self.rank])
        else:  # each rank draws its own dropout masks
            torch.manual_seed(cfg.train.seed * 1000 + self.rank + 1)
        log_dir = loop_config.get("log_dir")
        self.trace = None
        if cfg.train.trace_data and log_dir:  # each (re)start of the worker group: an attempt
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.trace = open(Path(log_dir) / f"trace-rank{self.rank}.tsv", "a")
            self.trace.write(f"#start\t{self.step}\n")
        self.stream = self.open_stream(self.position)  # reading starts while the rest sets up
        self.autocast = autocast_for(self.device, cfg.train.bf16)
        if self.is_rank0:
            bf16 = self.autocast is not contextlib.nullcontext
            print(f"forward pass in {'bf16 autocast' if bf16 else 'fp32'} on {self.device}", flush=True)

        self.valid = loop_config["valid"]
        self.valid_loader = ray.train.torch.prepare_data_loader(DataLoader(
            self.valid["rows"], batch_size=cfg.data.eval_batch_size, collate_fn=collate_eval))
        self.opts = DecodeOptions(beam=cfg.train.valid_beam, length_penalty=cfg.train.length_penalty,
                                  max_len_a=cfg.train.max_len_a, max_len_b=cfg.train.max_len_b)
        self.progress = Progress(cfg, self.step)
        self.metrics_log = MetricsLog(log_dir) if self.is_rank0 and log_dir else None
        self.deadline = (time.monotonic() + 60 * cfg.train.max_minutes) if cfg.train.max_minutes else None
        self.num_skipped = self.bad_in_a_row = 0
        self.profiler = StepProfiler(cfg.train.profile_steps, start=cfg.train.log_every,
                                     prefix=Path(log_dir) / f"profile-rank{self.rank}" if log_dir else None,
                                     cuda=on_gpu)

    def run(self) -> None:
        """Train until max_steps, the epoch limit or the time budget; evaluate and report."""
        cfg, stop = self.cfg, False
        self.evaluated: Optional[int] = None  # the step of this attempt's last evaluation
        self.loop_t0, self.data_s, self.eval_s = time.perf_counter(), 0.0, 0.0
        while not stop and self.step < cfg.train.max_steps and (
                cfg.train.epochs is None or self.epoch < cfg.train.epochs):
            self.upcoming = self.open_stream(Position(self.epoch + 1), start=False)
            stop = self.train_epoch()
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

    def open_stream(self, position: Position, start: bool = True) -> TrainStream:
        """This worker's stream of the epoch `position` is in, reading ahead once started."""
        stream = TrainStream(self.train_files, self.cfg.data, self.cfg.train.seed, self.rank,
                             self.world_size, position, trace=self.trace is not None,
                             pin_memory=self.device.type == "cuda")
        return stream.start() if start else stream

    def train_epoch(self) -> bool:
        """Train on the current stream until it ends; True when the run must stop (steps, time)."""
        cfg = self.cfg
        for group, num_tokens in lockstep(self.stream, cfg.optim.update_freq, self.device):
            self.position = self.stream.position
            # The next epoch's stream starts after this epoch's first step: starting a Ray Data
            # read takes seconds (5-14 s for the first batch here under load), and its reader
            # then waits with one chunk queued, so an epoch never waits for the next.
            self.upcoming.start()
            loss, applied = train_step(self.model, self.optimizer, group, num_tokens, cfg, self.autocast)
            self.write_trace()
            if not applied:
                self.skip_nonfinite()
                continue
            self.bad_in_a_row = 0
            self.progress.update(loss, num_tokens)
            self.scheduler.step()
            self.step += 1
            self.profiler.after_step(self.step)
            if self.step % cfg.train.eval_every == 0 or self.step >= cfg.train.max_steps:
                self.evaluate_and_report()
            elif self.step % cfg.train.log_every == 0:
                self.log_train()
            if self.step >= cfg.train.max_steps or (
                    self.step % cfg.train.log_every == 0 and self.out_of_time()):
                return True
        self.position = self.stream.position
        return False

    def write_trace(self) -> None:
        """With train.trace_data, log the digest of every pair this step trained on."""
        if self.trace:
            self.trace.writelines(f"{self.step + 1}\t{self.epoch}\t{h}\n" for h in self.stream.traced)
            self.trace.flush()
            self.stream.traced.clear()

    def skip_nonfinite(self) -> None:
        """Count a skipped update; too many in a row end the run, its checkpoints intact."""
        self.num_skipped += 1
        self.bad_in_a_row += 1
        if self.is_rank0:
            print(f"step {self.step + 1}: non-finite loss or gradient, update skipped "
                  f"({self.bad_in_a_row} in a row, {self.num_skipped} in all)", flush=True)
        if self.bad_in_a_row > self.cfg.train.max_nonfinite_steps:
            raise RuntimeError(
                f"{self.bad_in_a_row} updates in a row had a non-finite loss or gradient (after "
                f"step {self.step}); the last checkpoint is intact: lower optim.lr or raise "
                "optim.warmup_steps, then continue with --resume")

    def log_train(self) -> dict:
        """Progress line and training metrics of the last interval."""
        metrics = self.progress.log(self.step, self.epoch, self.scheduler.get_last_lr()[0],
                                    self.device, self.is_rank0)
        metrics.update(epoch=self.epoch, skipped_steps=self.num_skipped, **self.usage())
        if self.metrics_log:
            self.metrics_log.write(self.step, metrics)
        return metrics

    def usage(self) -> dict:
        """Share of the loop spent waiting for data, and this worker's peak resident memory."""
        waited = self.data_s + self.stream.busy_s
        training = time.perf_counter() - self.loop_t0 - self.eval_s  # validation excluded
        return {"data_share": waited / max(training, 1e-9),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    def evaluate_and_report(self) -> None:
        """Validate on the whole dev set, report to Ray Train with a checkpoint from rank 0."""
        metrics = self.progress.log(self.step, self.epoch, self.scheduler.get_last_lr()[0],
                                    self.device, self.is_rank0)
        t0 = time.perf_counter()
        metrics.update(evaluate(self.model, self.valid_loader, self.tokenizer, self.valid["refs"],
                                self.opts))
        self.eval_s += time.perf_counter() - t0
        metrics.update(step=self.step, epoch=self.epoch, skipped_steps=self.num_skipped, **self.usage())
        if self.is_rank0:
            print(f"step {self.step} | valid loss {metrics['valid_loss']:.3f} | "
                  f"BLEU {metrics['valid_bleu']:.2f} | chrF {metrics['valid_chrf']:.2f}", flush=True)
        if self.metrics_log:
            self.metrics_log.write(self.step, metrics)
        _report(metrics, self.model, self.optimizer, self.scheduler, self.cfg, self.tokenizer,
                self.step, self.epoch, self.position.to_dict())
        self.evaluated = self.step

    def out_of_time(self) -> bool:
        """True on every worker once any worker is past the time budget."""
        late = self.deadline is not None and time.monotonic() > self.deadline
        return _all_reduce([float(late)], self.device)[0] > 0


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: build everything inside the worker from config, then train."""
    WorkerLoop(loop_config).run()
