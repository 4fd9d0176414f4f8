"""The worker's GPU path without a GPU: each worker's own CUDA generator in checkpoints, DDP
without buffer broadcasts, bf16 gradient compression, CUDA out-of-memory as one line, peak GPU
memory in metrics.csv (fake CUDA functions stand in for a GPU)."""

import csv
import dataclasses
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
from ray.train import WorkerGroupError
from test_worker import loop_config
from tiny_checkpoint import one_thread  # noqa: F401
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from raymt import train
from raymt.batching import collate
from raymt.config import Config, apply_overrides, tiny
from raymt.distributed import compress_gradients, ddp_kwargs, place_model
from raymt.metrics import MetricsLog
from raymt.model import build_model
from raymt.trainer import Progress, rng_state, set_rng_state
from raymt.worker import WorkerLoop, out_of_memory_hint
from raymt.worker_env import WorkerEnv
from raymt.worker_logs import Usage
from raymt.worker_state import Saved, restore_rng

VOCAB = 64


def cuda(index: int) -> torch.device:
    """The `index`-th visible GPU (a device object only: nothing runs on it)."""
    return torch.device("cuda", index)


class FakeCuda:
    """torch.cuda's RNG functions over `num_devices` visible GPUs, failing as torch does on others."""

    def __init__(self, num_devices: int, first: int = 0):
        self.states = [torch.full((16,), first + i, dtype=torch.uint8) for i in range(num_devices)]
        self.set_on: list[int] = []  # device indices whose generator was set

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.states)

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return self.states[device.index].clone()  # IndexError on a GPU this process cannot see

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        self.states[device.index] = state.clone()
        self.set_on.append(device.index)

    def get_rng_state_all(self) -> list:
        return [self.get_rng_state(cuda(i)) for i in range(len(self.states))]

    def set_rng_state_all(self, states: list) -> None:
        for i, state in enumerate(states):
            self.set_rng_state(state, cuda(i))


def test_a_restarted_worker_that_sees_fewer_gpus_restores_only_its_own_generator(tmp_path):
    """8 workers on one 8-GPU node save; rank 5 restarts on a node where it sees 2 GPUs."""
    saving = FakeCuda(8, first=10)
    torch.manual_seed(5)
    states = [rng_state(cuda(rank), saving) for rank in range(8)]  # each rank's own GPU
    expected = torch.rand(4)
    assert [s["cuda"][0].item() for s in states] == list(range(10, 18))
    torch.save({"rng_states": states}, tmp_path / "state.pt")  # as checkpoints hold them
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)["rng_states"]

    restarted = FakeCuda(2)
    restore_rng(loaded, rank=5, world_size=8, device=cuda(1), seed=1, step=40, cuda=restarted)
    assert restarted.set_on == [1]  # the other worker's generator on this node is left alone
    assert restarted.states[1].tolist() == [15] * 16 and restarted.states[0].tolist() == [0] * 16
    assert torch.equal(torch.rand(4), expected)  # the CPU stream continues where it was


def test_older_checkpoints_with_every_visible_gpus_state_stay_loadable(capsys):
    """An older checkpoint's list of every visible GPU's state: this device's entry, else a reseed."""
    torch.manual_seed(3)
    old = {"cpu": torch.get_rng_state(), "cuda": FakeCuda(8, first=20).get_rng_state_all()}
    restarted = FakeCuda(2)
    assert set_rng_state(old, cuda(1), restarted)
    assert restarted.set_on == [1] and restarted.states[1].tolist() == [21] * 16

    saved_on_two = {"cpu": old["cpu"], "cuda": old["cuda"][:2]}  # resumed as cuda:5 of 8
    bigger = FakeCuda(8)
    restore_rng([saved_on_two] * 8, rank=5, world_size=8, device=cuda(5), seed=1, step=40, cuda=bigger)
    assert bigger.set_on == [] and "dropout is reseeded" in capsys.readouterr().out
    reseeded = torch.rand(4)
    torch.manual_seed(1 * 1000 + 5 + 1 + 7919 * 40)  # the resize rule
    assert torch.equal(torch.rand(4), reseeded)

    assert not set_rng_state(old["cpu"], cuda(0), restarted)  # a bare CPU state on a GPU: reseed
    assert set_rng_state(old["cpu"], torch.device("cpu"))  # on a CPU it is the whole state
    assert "cuda" not in rng_state(torch.device("cpu"), bigger)  # a CPU worker saves no GPU state


def test_ddp_kwargs_leave_buffers_alone_and_keep_the_bucket_size():
    cfg = apply_overrides(Config(model=tiny()), {"train.ddp_bucket_mb": 4.0})
    kwargs = ddp_kwargs(cfg.train)
    assert kwargs["bucket_cap_mb"] == 4.0 and kwargs["gradient_as_bucket_view"] is True
    sync = {k: v for k, v in kwargs.items() if k in ("broadcast_buffers", "forward_sync_buffers")}
    assert list(sync.values()) == [False], kwargs


def _ddp_worker(rank: int, init_file: str, kwargs: dict, out_dir: str) -> None:
    """One of two gloo processes: after DDP wraps the model, rank 1's `positions` differs; forward."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_model(tiny(), VOCAB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    model.positions.add_(rank)  # a rank-local change: a broadcast from rank 0 would undo it
    batch = collate([[5, 6, 3]], [[7, 8]])
    ddp(batch.src, batch.tgt_in).sum().backward()
    torch.save(
        {"positions_sum": model.positions.sum(), "warnings": [str(w.message) for w in caught]},
        Path(out_dir) / f"r{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.slow  # ~6 s: two gloo processes (CI runs it: .ci/run; the default suite stays under 5 min)
@pytest.mark.ci
def test_ddp_does_not_broadcast_buffers_before_forward(tmp_path):
    """A real 2-process gloo DDP with the worker's kwargs: rank 1's buffer survives a forward."""
    kwargs = ddp_kwargs(Config(model=tiny()).train)
    # Children import this module to find _ddp_worker (spawn gives them this sys.path); raises if one fails.
    torch.multiprocessing.spawn(_ddp_worker, args=(str(tmp_path / "init"), kwargs, str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(2))
    table = tiny().max_positions * tiny().d_model
    torch.testing.assert_close(r1["positions_sum"], r0["positions_sum"] + table)  # not overwritten
    assert not [w for w in r0["warnings"] + r1["warnings"] if "buffers" in w]  # no deprecated kwarg


class FakeDDP(torch.nn.Module):
    """Records comm hooks: torch refuses the bf16 hook on gloo, so no CPU run can register it."""

    def __init__(self):
        super().__init__()
        self.hooks: list = []

    def register_comm_hook(self, state, hook) -> None:
        self.hooks.append((state, hook))


def test_bf16_gradient_compression_is_opt_in_and_only_with_several_workers(monkeypatch):
    on = apply_overrides(Config(model=tiny()), {"train.grad_compression": True})
    assert Config().train.grad_compression is False
    for cfg, world_size in ((Config(model=tiny()), 2), (on, 1)):
        model = FakeDDP()
        compress_gradients(model, cfg.train, world_size)
        assert model.hooks == []
    prepared = []

    def prepare_model(m, parallel_strategy_kwargs):  # Ray Train's, as WorkerEnv passes it
        return prepared.append(parallel_strategy_kwargs) or m

    model = place_model(FakeDDP(), on.train, 16, prepare_model)  # the worker's own placement
    assert model.hooks == [(None, default_hooks.bf16_compress_hook)]
    assert prepared == [ddp_kwargs(on.train)]


def worker_loop(tmp_path: Path, cfg: Config) -> WorkerLoop:
    """A WorkerLoop of `cfg` built without Ray Train: one CPU process, nothing reported."""
    return WorkerLoop.create(dataclasses.replace(loop_config(tmp_path), config=cfg), WorkerEnv(), Saved())


def test_cuda_out_of_memory_in_a_step_becomes_one_line_naming_max_tokens(monkeypatch, tmp_path):
    cfg = apply_overrides(Config(model=tiny()), {"data.max_tokens": 4096})
    loop = worker_loop(tmp_path, cfg)
    loop.trainer.step = 7

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("raymt.trainer.train_step", out_of_memory)
    loop.feed.open_next(1)
    with pytest.raises(ValueError) as err:
        loop.train_epoch()
    line = str(err.value)
    assert line == (
        "CUDA out of memory at step 8 with data.max_tokens=4096 per worker: retry with "
        "--set data.max_tokens=2048 --set optim.update_freq=2 (same global batch)"
    )
    retry = dict(re.findall(r"--set (\S+)=(\d+)", line))  # what it suggests is a valid config
    retried = apply_overrides(cfg, {k: int(v) for k, v in retry.items()})
    assert retried.data.max_tokens * retried.optim.update_freq == 4096 * cfg.optim.update_freq

    assert out_of_memory_hint(8, cfg, 24 * 2**30).startswith(
        "CUDA out of memory at step 8 with data.max_tokens=4096 per worker (GPU 24 GiB): retry"
    )
    floor = apply_overrides(cfg, {"data.max_len": 200, "data.max_tokens": 300})
    assert "cannot go below 202 (data.max_len's padded pair)" in out_of_memory_hint(3, floor, None)

    monkeypatch.setattr("raymt.worker_data.evaluate", out_of_memory)  # validation: its own budget
    with pytest.raises(
        ValueError,
        match=r"validating at step 7 with data.eval_batch_size=64: "
        r"retry with --set data.eval_batch_size=32$",
    ):
        loop.evaluate(loop.trainer.log_train())
    loop.feed.end_epoch(stop=True)


def test_the_driver_prints_a_workers_one_line_error_not_rays_traceback(monkeypatch, capsys):
    line = "CUDA out of memory at step 8 with data.max_tokens=4096 per worker: retry with ..."
    failed = WorkerGroupError("rank 0: RuntimeError ...", {1: ValueError(line), 0: RuntimeError("NCCL error")})
    failed = pickle.loads(pickle.dumps(failed))  # as Ray hands it from the controller to fit()

    def run(*args, **kwargs):
        raise failed

    monkeypatch.setattr(train, "run", run)
    assert train.main(["--preset", "tiny"]) == 2
    assert capsys.readouterr().err == f"raymt.train: error: {line}\n"

    failed = WorkerGroupError("rank 0: RuntimeError ...", {0: RuntimeError("NCCL error")})
    with pytest.raises(WorkerGroupError):  # a crash is not a user mistake: Ray's full report
        train.main(["--preset", "tiny"])


def test_peak_gpu_memory_is_in_metrics_csv_and_the_progress_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1536 * 2**20)
    gpu = Usage(cuda(0))
    usage = gpu(waited_s=0.0)
    assert usage["peak_gpu_mb"] == 1536.0 and usage["peak_rss_mb"] > 0
    log = MetricsLog(tmp_path)
    log.write(10, {"train_loss": 2.5, **usage})
    log.close()
    with open(tmp_path / "metrics.csv") as f:
        row = next(csv.DictReader(f))
    assert float(row["peak_gpu_mb"]) == 1536.0

    progress = Progress(Config(model=tiny()), 0, torch.device("cpu"))
    progress.note = gpu.note
    progress.update(torch.tensor(10.0), torch.tensor(1.0), 5)
    progress.log(1, 0, 1e-3)
    assert capsys.readouterr().out.rstrip().endswith("| peak GPU 1.5 GiB")

    cpu = Usage(torch.device("cpu"))  # a CPU worker: resident memory only, nothing on the line
    assert "peak_gpu_mb" not in cpu(waited_s=0.0) and cpu.note() == ""


def test_a_resumed_older_metrics_csv_keeps_its_columns(tmp_path):
    old_columns = "step,epoch,time_s,train_loss,peak_rss_mb"
    (tmp_path / "metrics.csv").write_text(old_columns + "\n1,0,0.5,3.0,100.0\n")
    log = MetricsLog(tmp_path)
    log.write(2, {"train_loss": 2.0, "peak_rss_mb": 120.0, "peak_gpu_mb": 900.0})
    log.close()
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == old_columns and len(lines[2].split(",")) == 5
