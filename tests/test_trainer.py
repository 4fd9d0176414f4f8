"""raymt.trainer without Ray: restore on the parameters' device, a step without
host syncs (one process and two gloo processes), non-finite runs, torch.compile."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import one_thread  # noqa: F401

from raymt.batching import collate
from raymt.checkpoint import TrainState
from raymt.config import Config, apply_overrides, tiny
from raymt.model import build_model
from raymt.trainer import Trainer, compile_model, restore_training, train_step

VOCAB = 64


def rows(n: int, seed: int, max_len: int = 12) -> list:
    """n token-id rows of 2..max_len ids."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(2, max_len, (n,), generator=g)
    ]


def batches(num: int, seed: int = 0) -> list:
    """`num` batches of 2-5 rows of varying lengths (src ends in EOS)."""
    sizes = torch.randint(2, 6, (num,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [collate([r + [3] for r in rows(b, seed + i)], rows(b, seed + 100 + i)) for i, b in enumerate(sizes)]


def small_config(**train) -> Config:
    cfg = Config(model=tiny())
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def trained(cfg: Config, num_steps: int) -> tuple:
    """(model, optimizer, scheduler, saved optimizer and scheduler state) after `num_steps` updates."""
    torch.manual_seed(0)
    model, optimizer, scheduler = restore_training(build_model(cfg.model, VOCAB), cfg, None, None, lambda m: m)
    for batch in batches(num_steps):
        train_step(model, optimizer, [batch], batch.num_tokens, cfg)
        scheduler.step()
    return model, optimizer, scheduler, TrainState(optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict())


def test_restored_optimizer_state_lives_on_the_parameters_device():
    """The worker's order: weights, then the device (`place`), then the optimizer and its state.

    `meta` stands in for the GPU: a device that is not the CPU the checkpoint loads onto.
    Building the optimizer before `place`, as raymt did until now, leaves its state on the
    CPU and a GPU resume crashes in fused AdamW ("exp_avgs is on cpu").
    """
    cfg = small_config()
    model, optimizer, scheduler, saved = trained(cfg, 2)

    placed = []

    def place(m: torch.nn.Module) -> torch.nn.Module:
        """As `.to("cuda")` does: the same Parameter objects, their data on the device."""
        placed.append(m)
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)  # keeps each Parameter object
        try:
            return m.to("meta")
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)

    moved, restored, restored_scheduler = restore_training(
        build_model(cfg.model, VOCAB), cfg, model.state_dict(), saved, place
    )
    assert len(placed) == 1 and restored_scheduler.last_epoch == 2
    params = list(moved.parameters())
    assert all(p.device.type == "meta" for p in params)
    assert [id(p) for g in restored.param_groups for p in g["params"]] == [id(p) for p in params]
    fused = restored.defaults["fused"]
    for p in params:
        assert set(restored.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in restored.state[p].items():
            if key != "step" or fused:  # unfused AdamW keeps its step count on the CPU by design
                assert value.device == p.device, (key, value.device, p.device)


def test_a_resume_trains_with_the_configs_learning_rate_at_the_restored_point():
    """`--resume RUN --set optim.lr=...` (the non-finite error's advice) takes the new peak at the
    saved step of the schedule; an unchanged config restores exactly what was saved."""
    cfg = small_config()
    model, optimizer, scheduler, saved = trained(cfg, 3)
    weights, lr_then = model.state_dict(), optimizer.param_groups[0]["lr"]
    _, same, _ = restore_training(build_model(cfg.model, VOCAB), cfg, weights, saved, lambda m: m)
    assert same.param_groups[0]["lr"] == lr_then
    lower = apply_overrides(cfg, {"optim.lr": cfg.optim.lr / 10, "optim.weight_decay": 0.01})
    _, restored, restored_scheduler = restore_training(
        build_model(cfg.model, VOCAB), lower, weights, saved, lambda m: m
    )
    assert restored_scheduler.last_epoch == 3 and restored_scheduler.base_lrs == [cfg.optim.lr / 10]
    assert math.isclose(restored.param_groups[0]["lr"], lr_then / 10)
    assert restored.param_groups[0]["weight_decay"] == 0.01
    restored_scheduler.step()  # and the schedule goes on from the new peak
    assert math.isclose(restored.param_groups[0]["lr"], scheduler.lr_lambdas[0](4) * cfg.optim.lr / 10)


SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


def count_host_syncs(monkeypatch) -> list:
    """Wrap the tensor methods that wait for the device; returns the list of calls made.

    Calls from raymt/batching.py are the data side's (counts on host tensors before any
    copy to the device) and are not counted.
    """
    calls = []
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _name=name, _original=original, **kwargs):
            if Path(sys._getframe(1).f_code.co_filename).name != "batching.py":
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return calls


def test_twenty_steps_sync_with_the_host_once_per_log_interval(monkeypatch):
    cfg = small_config(max_steps=20, log_every=5, eval_every=1000)
    torch.manual_seed(0)
    model, optimizer, scheduler = restore_training(build_model(cfg.model, VOCAB), cfg, None, None, lambda m: m)
    trainer = Trainer(cfg, model, optimizer, scheduler, torch.device("cpu"))
    data = batches(25)
    calls = count_host_syncs(monkeypatch)
    assert trainer.train_epoch(data)  # max_steps reached
    monkeypatch.undo()
    assert trainer.step == 20
    assert len(calls) <= 20 // 5, calls
    assert math.isfinite(trainer.progress.last["train_loss"])


def _two_process_worker(rank: int, init_file: str, out: str) -> None:
    """One of two gloo processes: DDP, the torch.distributed Collective, 20 steps, syncs counted."""
    import torch.distributed as dist

    from raymt.distributed import TorchCollective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cfg = small_config(max_steps=20, log_every=5, eval_every=1000)
    torch.manual_seed(0)
    model, optimizer, scheduler = restore_training(
        build_model(cfg.model, VOCAB), cfg, None, None, torch.nn.parallel.DistributedDataParallel
    )
    trainer = Trainer(cfg, model, optimizer, scheduler, torch.device("cpu"), collective=TorchCollective())
    data = batches(25 if rank == 0 else 12, seed=rank * 1000)  # rank 1 runs out: dummy steps
    with pytest.MonkeyPatch.context() as mp:
        calls = count_host_syncs(mp)
        trainer.train_epoch(data)
    torch.save({"calls": len(calls), "step": trainer.step, "params": model.module.state_dict()}, out)
    dist.destroy_process_group()


@pytest.mark.slow  # ~5 s: two gloo processes (CI runs it: .ci/run; the default suite stays under 5 min)
@pytest.mark.ci
def test_two_gloo_processes_step_without_host_syncs(tmp_path):
    """The CPU all-reduce one update ahead, across processes: in step, in sync, no waits."""
    ctx = torch.multiprocessing.get_context("spawn")
    env = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env])  # children import this file
    try:
        procs = [
            ctx.Process(target=_two_process_worker, args=(r, str(tmp_path / "init"), str(tmp_path / f"r{r}.pt")))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
    finally:
        os.environ["PYTHONPATH"] = env
    assert [p.exitcode for p in procs] == [0, 0]
    results = [torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(2)]
    assert [r["step"] for r in results] == [20, 20]
    assert all(r["calls"] <= 20 // 5 for r in results), [r["calls"] for r in results]
    for name, value in results[0]["params"].items():
        torch.testing.assert_close(results[1]["params"][name], value)


def test_a_run_of_nonfinite_updates_stops_at_the_log_interval():
    cfg = small_config(max_steps=20, log_every=5, eval_every=1000, max_nonfinite_steps=3)
    torch.manual_seed(0)
    model, optimizer, scheduler = restore_training(build_model(cfg.model, VOCAB), cfg, None, None, lambda m: m)
    with torch.no_grad():
        model.embed.weight.fill_(float("inf"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(cfg, model, optimizer, scheduler, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="5 updates in a row had a non-finite"):
        trainer.train_epoch(batches(25))
    assert trainer.step == 5 and trainer.progress.num_skipped == 5
    for name, value in model.state_dict().items():  # no update was applied
        torch.testing.assert_close(value, before[name], equal_nan=True)


@pytest.mark.slow  # ~4 s: inductor (CI runs it: .ci/run; the default suite stays under 5 min)
@pytest.mark.ci
def test_compiled_model_does_not_recompile_per_batch():
    """Batches of many shapes (widths padded to multiples of 8): a few graphs, none per batch."""
    torch._dynamo.reset()
    compiled = []

    def counting_backend(gm, example_inputs):
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    def padded(num: int, seed: int) -> list:
        out = []
        for b in batches(num, seed):
            fields = []
            for t in (b.src, b.tgt_in, b.tgt_out):
                width = -(-t.size(1) // 8) * 8
                fields.append(torch.nn.functional.pad(t, (0, width - t.size(1))))
            out.append(type(b)(*fields))
        return out

    cfg = small_config(max_steps=1000, log_every=100, eval_every=1000)
    torch.manual_seed(0)
    model, optimizer, scheduler = restore_training(
        build_model(cfg.model, VOCAB), cfg, None, None, lambda m: compile_model(m, backend=counting_backend)
    )
    trainer = Trainer(cfg, model, optimizer, scheduler, torch.device("cpu"))
    epoch = padded(16, 0)
    assert len({(b.src.shape, b.tgt_in.shape) for b in epoch}) > 4
    trainer.train_epoch(epoch)
    first = len(compiled)
    assert 0 < first <= 4, compiled
    trainer.train_epoch(padded(16, 50))  # another epoch, other shapes: nothing new to compile
    assert len(compiled) == first, compiled


def test_a_smaller_elastic_group_keeps_the_global_batch(capsys):
    """Fewer workers than train.num_workers raise optim.update_freq (rounded up); a fixed
    group, or the full elastic one, keeps the config as it is."""
    from raymt.worker_env import elastic_batch

    cfg = apply_overrides(Config(), {"train.num_workers": "4", "train.min_workers": "1", "optim.update_freq": "2"})
    assert [elastic_batch(cfg, w).optim.update_freq for w in (4, 2, 1, 3)] == [2, 4, 8, 3]
    elastic_batch(cfg, 3, verbose=True)
    assert "3 of 4 workers: optim.update_freq 2 -> 3 keeps the global batch (9/8 of it)" in capsys.readouterr().out
    fixed = apply_overrides(Config(), {"train.num_workers": "4"})
    assert elastic_batch(fixed, 2) is fixed
