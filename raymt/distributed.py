"""A worker group over torch.distributed: its `Collective`, and the model in DDP (its arguments,
bf16 gradient compression). No Ray here: Ray Train's `prepare_model` comes in as an argument."""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from raymt.config import TrainConfig
from raymt.trainer import Collective


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


def group_collective() -> Collective:
    """This process's worker group's collective: torch.distributed's, or one process's."""
    return TorchCollective() if dist.is_initialized() else Collective()


# torch 2.13 renamed DDP's broadcast_buffers (deprecated, with a warning) to forward_sync_buffers.
_BUFFER_SYNC = next(
    k
    for k in ("forward_sync_buffers", "broadcast_buffers")
    if k in inspect.signature(DistributedDataParallel).parameters
)


def ddp_kwargs(train: TrainConfig) -> dict:
    """The DistributedDataParallel arguments prepare_model gets."""
    # Smaller buckets start all-reducing earlier in backward. No buffer needs syncing: the only
    # one, the sinusoid table `positions`, is computed alike on every rank, and syncing would
    # broadcast it from rank 0 before every forward.
    return {"bucket_cap_mb": train.ddp_bucket_mb, "gradient_as_bucket_view": True, _BUFFER_SYNC: False}


def place_model(
    model: torch.nn.Module, train: TrainConfig, world_size: int, prepare: Callable[..., torch.nn.Module]
) -> torch.nn.Module:
    """The model on this worker's device, in DDP (gloo on CPUs, NCCL on GPUs) when there are several:
    `prepare` is Ray Train's `prepare_model`."""
    model = prepare(model, parallel_strategy_kwargs=ddp_kwargs(train))
    compress_gradients(model, train, world_size)
    return model


def compress_gradients(model: torch.nn.Module, train: TrainConfig, world_size: int) -> None:
    """With train.grad_compression and several workers, all-reduce gradients in bf16 (half the bytes)."""
    if train.grad_compression and world_size > 1:  # one worker: no DDP, nothing to reduce
        # NCCL only (torch refuses it on gloo); each bucket is cast to bf16, summed, cast back.
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
