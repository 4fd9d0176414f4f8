"""raymt.precision: bf16 where the hardware has it and it pays, fp16 with loss scaling on older
GPUs, TF32 on Ampere and later, autocast in validation and decoding, the first log line.

There is no GPU here: the GPU choices are checked against a faked device capability."""

import json
import re
import threading
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_trainer import VOCAB, batches, count_host_syncs, small_config
from tiny_checkpoint import one_thread, tokenizer  # noqa: F401

from raymt import precision
from raymt.checkpoint import load_train_state
from raymt.config import Config, DecodeOptions, apply_overrides, tiny
from raymt.model import build_model
from raymt.optim import inverse_sqrt, make_optimizer
from raymt.precision import ProbeShape, batch_shapes, for_inference, for_training, native_bf16, row_widths
from raymt.trainer import Collective, Done, Trainer, collate_eval, evaluate, restore_training, train_step

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of the given compute capability: bf16 units from 8.0 on (A100), none before (V100, T4)."""

    def install(major: int, minor: int = 0):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: major >= 8)

    return install


@pytest.fixture
def tf32_flags():
    """Put the process's TF32 flags back as they were."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """The CPU probe's cache in a temp dir."""
    path = tmp_path / "precision.json"
    monkeypatch.setenv(precision.CACHE_ENV, str(path))
    return path


def test_cpu_bf16_follows_the_cpu_flags():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None
    assert native_bf16(CPU) == expected


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_a_gpu_without_bf16_trains_in_fp16_with_a_grad_scaler(fake_gpu):
    fake_gpu(7, 0)  # V100
    chosen = for_training(CUDA, Config(), VOCAB)
    assert chosen.dtype == torch.float16
    assert isinstance(chosen.grad_scaler(), torch.amp.GradScaler)
    assert chosen.line(CUDA) == (
        "precision: forward pass in fp16 autocast (fp32 weights), TF32 off, dynamic "
        "loss scaling (GradScaler) on cuda:0 (no bf16 units; no TF32 before compute "
        "capability 8.0; this GPU has 7.0)"
    )
    inference = for_inference(CUDA, Config(), VOCAB)
    assert inference.dtype == torch.float16  # decoding needs no scaler, but the same dtype


def test_ampere_trains_in_bf16_with_tf32_unless_turned_off(fake_gpu, tf32_flags):
    fake_gpu(8, 0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    chosen = for_training(CUDA, Config(), VOCAB).apply()
    assert chosen.dtype == torch.bfloat16 and chosen.grad_scaler() is None
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert (
        chosen.line(CUDA)
        == "precision: forward pass in bf16 autocast (fp32 weights), TF32 on, no loss scaling on cuda:0"
    )

    cfg = Config()
    cfg.train.bf16, cfg.train.tf32 = False, False
    off = for_training(CUDA, cfg, VOCAB).apply()
    assert off.dtype is None and not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert off.line(CUDA).endswith("fp32, TF32 off, no loss scaling on cuda:0 (train.bf16=false; train.tf32=false)")
    cfg.train.tf32 = True  # an H100 told train.bf16=false still gets TF32 GEMMs
    assert for_training(CUDA, cfg, VOCAB).apply().tf32 and torch.backends.cuda.matmul.allow_tf32


def test_the_cpu_probe_rejects_bf16_where_it_measures_slower(monkeypatch, cache):
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    measured = []
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda cfg, vocab_size, *a: measured.append(1) or 0.97)
    cfg = Config()
    slower = for_training(CPU, cfg, VOCAB)
    assert slower.dtype is None and slower.autocast().__class__.__name__ == "nullcontext"
    assert slower.line(CPU) == (
        "precision: forward pass in fp32 on cpu (bf16 measured 0.97x fp32 for this model; bf16 needs 1.05x)"
    )
    again = for_training(CPU, cfg, VOCAB)  # the cache answers: no second probe
    assert measured == [1] and "0.97x fp32 for this model; cached" in again.line(CPU)
    assert for_inference(CPU, cfg, VOCAB).dtype is None

    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda cfg, vocab_size, *a: 1.46)
    wider = Config()
    wider.model.d_model, wider.model.d_ff = 256, 1024  # another shape: measured apart
    faster = for_training(CPU, wider, VOCAB)
    assert faster.dtype == torch.bfloat16 and faster.grad_scaler() is None
    assert (
        faster.line(CPU)
        == "precision: forward pass in bf16 autocast (fp32 weights) on cpu (bf16 measured 1.46x fp32 for this model)"
    )
    assert for_inference(CPU, wider, VOCAB).dtype is None  # decoding on a CPU: fp32 (not training's probe)

    cfg.train.bf16 = False  # keeps forcing fp32, without a probe
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda *a: pytest.fail("probed"))
    assert for_training(CPU, cfg, VOCAB).line(CPU) == "precision: forward pass in fp32 on cpu (train.bf16=false)"
    other = Config()
    other.model.num_decoder_layers = 3  # no cached result: inference decodes in fp32, never probes
    assert for_inference(CPU, other, VOCAB).dtype is None


def test_the_probe_times_both_precisions_and_leaves_the_rng_alone(cache):
    cfg = Config(model=tiny())
    cfg.data.max_tokens = 256
    torch.manual_seed(3)
    state = torch.get_rng_state()
    speedup, cached = precision.cpu_bf16_speedup(cfg, VOCAB)
    assert speedup > 0 and not cached
    assert torch.equal(torch.get_rng_state(), state)  # the run's initial weights and dropout unchanged
    assert precision.cpu_bf16_speedup(cfg, VOCAB) == (round(speedup, 3), True)


FP16 = precision.Precision("cpu", torch.float16)  # CPU autocast has fp16 too: the GPU path's twin


def overflowing_scaler() -> torch.amp.GradScaler:
    """A loss scaler whose first scale overflows fp16 gradients, and backs off to 16 after."""
    return torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-20)


@pytest.mark.parametrize("fused", [True, False])
def test_an_overflow_under_loss_scaling_skips_the_update_and_is_counted(fused, monkeypatch):
    cfg = small_config(max_steps=4, log_every=2, eval_every=1000)
    torch.manual_seed(0)
    model = build_model(cfg.model, VOCAB)
    optimizer = make_optimizer(model, cfg.optim, fused=fused)  # fused: skips on the device
    scheduler = inverse_sqrt(optimizer, cfg.optim.warmup_steps)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = overflowing_scaler()
    batch = batches(1)[0]
    loss, applied = train_step(model, optimizer, [batch], batch.num_tokens, cfg, FP16.autocast, scaler=scaler)
    assert applied.item() == 0.0 and scaler.get_scale() == 16.0
    for name, value in model.state_dict().items():  # skipped: nothing changed
        assert torch.equal(value, before[name]), name

    trainer = Trainer(cfg, model, optimizer, scheduler, CPU, autocast=FP16.autocast, scaler=overflowing_scaler())
    data = batches(6)
    calls = count_host_syncs(monkeypatch) if fused else []
    assert trainer.train_epoch(data)
    monkeypatch.undo()
    assert len(calls) <= 4 // 2, calls  # the scaler adds no host sync to the step
    assert trainer.progress.last["skipped_steps"] == 1 and trainer.progress.num_skipped == 1
    assert trainer.scaler.get_scale() == 16.0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_scaled_step_equals_the_unscaled_one():
    """The gradients are unscaled before clipping and the step: the loss scale changes nothing."""
    cfg = small_config()
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**16)):
        torch.manual_seed(0)
        model, optimizer, _ = restore_training(build_model(cfg.model, VOCAB), cfg, None, None, lambda m: m)
        for batch in batches(3):
            assert train_step(model, optimizer, [batch], batch.num_tokens, cfg, scaler=scaler)[1].item() == 1.0
        results.append(model.state_dict())
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-5, atol=1e-6)


def test_the_loss_scale_is_checkpointed_and_restored(tmp_path):
    """The worker's checkpoints save the scaler's state; restore_training loads it on resume."""
    from raymt.worker_state import CheckpointWriter

    cfg = small_config()
    torch.manual_seed(0)
    tok = tokenizer()
    model, optimizer, scheduler = restore_training(build_model(cfg.model, tok.vocab_size), cfg, None, None, lambda m: m)
    scaler = overflowing_scaler()
    batch = batches(1)[0]
    train_step(model, optimizer, [batch], batch.num_tokens, cfg, FP16.autocast, scaler=scaler)
    trainer = Trainer(cfg, model, optimizer, scheduler, torch.device("cpu"), step=1, scaler=scaler)
    feed = types.SimpleNamespace(segment_record=lambda epoch: None, data_mix=None)  # one pair: no mix record
    CheckpointWriter(cfg, tok).write(tmp_path, trainer, feed, [({}, {"cpu": torch.get_rng_state()})])
    saved = load_train_state(tmp_path)
    assert saved.grad_scaler["scale"] == 16.0

    resumed = torch.amp.GradScaler("cpu")
    restore_training(
        build_model(cfg.model, tok.vocab_size), cfg, model.state_dict(), saved, lambda m: m, scaler=resumed
    )
    assert resumed.get_scale() == 16.0
    fresh = torch.amp.GradScaler("cpu")  # a checkpoint of a bf16 run has no scaler state
    restore_training(
        build_model(cfg.model, tok.vocab_size), cfg, None, replace(saved, grad_scaler=None), lambda m: m, scaler=fresh
    )
    assert fresh.get_scale() == 2.0**16


def test_validation_runs_its_forward_passes_and_decoding_under_autocast():
    cfg = Config(model=tiny())
    tok = tokenizer()
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size)
    seen = []  # every linear layer's call, of the loss's forward pass and of decoding's steps
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(
                lambda module, args, out: seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
            )
    src = [tok.encode(s) for s in ("one two", "three")]
    rows = [{"index": i, "src_ids": s + [3], "tgt_ids": s} for i, s in enumerate(src)]
    loader = [collate_eval(rows)]
    opts = DecodeOptions(beam=1, max_len_a=0, max_len_b=3)
    bf16 = precision.Precision("cpu", torch.bfloat16)
    metrics = evaluate(model, loader, tok, ["eins zwei", "drei"], opts, autocast=bf16.autocast)
    assert seen and all(enabled and dtype == torch.bfloat16 for enabled, dtype in seen), seen
    assert metrics["valid_loss"] > 0
    seen.clear()
    evaluate(model, loader, tok, ["eins zwei", "drei"], opts)  # fp32 by default
    assert seen and all(not enabled and dtype == torch.float32 for enabled, dtype in seen)


def test_cpu_bf16_training_keeps_attention_in_fp32_and_the_linear_layers_in_bf16(monkeypatch):
    # torch 2.13's bf16 flash-attention backward on a CPU is ~7x fp32's from 12 tokens on.
    import raymt.model

    cfg = Config(model=tiny())
    torch.manual_seed(0)
    model = build_model(cfg.model, VOCAB)
    calls, real = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        raymt.model.F,
        "scaled_dot_product_attention",
        lambda q, k, v, **kw: calls.append((q.dtype, k.dtype, torch.is_autocast_enabled("cpu"))) or real(q, k, v, **kw),
    )
    src, tgt = torch.randint(4, VOCAB, (3, 13)), torch.randint(4, VOCAB, (3, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
    assert logits.dtype == torch.bfloat16  # the output projection ran in bf16
    logits.float().sum().backward()
    layers = cfg.model.num_encoder_layers + 2 * cfg.model.num_decoder_layers
    assert calls == [(torch.float32, torch.float32, False)] * layers
    calls.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # decoding: bf16 throughout
        model(src, tgt)
    assert calls == [(torch.bfloat16, torch.bfloat16, True)] * layers


def test_translate_evaluate_and_the_test_set_decode_in_fp32_on_a_cpu_where_training_took_bf16(
    monkeypatch, cache, tmp_path
):
    """raymt.translate, raymt.evaluate's actor and the test-set decode of raymt.train autocast
    as for_inference says: on a CPU fp32, even where the checkpoint trained in bf16 and a cached
    probe found bf16 training pays (issue 44: bf16 changed outputs for no decoding speed)."""
    import numpy as np
    from tiny_checkpoint import make_checkpoint

    from raymt import engines, translate
    from raymt import evaluate as evaluate_module
    from raymt.checkpoint import load_model

    checkpoint = make_checkpoint(tmp_path / "checkpoint")
    _, tok, cfg = load_model(checkpoint)
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    precision.write_cache(precision.probe_key(cfg.model, tok.vocab_size), 2.0)
    cfg.train.precision = "bf16"  # as a checkpoint of a bf16 run records it
    assert for_inference(CPU, cfg, tok.vocab_size).dtype is None
    seen = []

    def spy(module, name: str) -> None:
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            seen.append((name, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(engines, "decode_ids")  # raymt.translate's, the driver's and the actor's engine
    assert translate.main(["--checkpoint", str(checkpoint), "--beam", "1", "--device", "cpu", "hello"]) == 0
    evaluate_module.decode_on_driver(checkpoint, ["hello"], cfg)
    actor = evaluate_module.BatchTranslator(str(checkpoint), {"beam": 1}, "cpu", 1)
    actor({"set": [0], "index": [np.array([0])], "lengths": [np.array([3])], "src_ids": [np.array([5, 6, 3])]})
    assert [name for name, _, _ in seen] == ["decode_ids", "decode_ids", "decode_ids"]
    assert not any(enabled for _, enabled, _ in seen), seen


# ---------------------------------------------------------------- what the run measures and keeps


class ThreadGroup:
    """Workers of one process as threads: a barrier makes each collective call meet."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size


class ThreadCollective(Collective):
    """One thread's view of a ThreadGroup: all-gathers and all-reduces across the threads."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.size

    def all_gather_object(self, obj):
        self.group.slots[self.rank] = obj
        self.group.barrier.wait()
        out = list(self.group.slots)
        self.group.barrier.wait()
        return out

    def all_reduce_sum_async(self, tensor):
        tensor.copy_(sum(self.all_gather_object(tensor.clone())))
        return Done(tensor)


def in_threads(size: int, work) -> list:
    """`work(collective)` on `size` threads at once, as `size` workers; their results by rank."""
    group, results = ThreadGroup(size), [None] * size

    def run(rank: int) -> None:
        results[rank] = work(ThreadCollective(group, rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_every_worker_probes_at_once_with_the_runs_shape_and_rank_0s_cache_answers(monkeypatch, cache):
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    cfg = Config(model=tiny())
    cfg.data.max_tokens = 256
    widths = [(10, 12), (5, 4)]  # source with EOS, target with BOS/EOS
    shape = ProbeShape.of_run(cfg, threads=1, workers=2, widths=widths)
    batches = shape.batches(VOCAB)
    assert len(batches) == precision.PROBE_BATCHES and shape.shapes[0] == (51, 5, 4)  # 256 // 5 rows
    assert shape.shapes[-1] == (21, 10, 12)  # sorted by width; 256 // 12 rows
    assert [(b.src.size(0), b.src.size(1), b.tgt_out.size(1)) for b in batches] == list(shape.shapes)
    passes = []
    real_step = precision.train_step
    monkeypatch.setattr(precision, "train_step", lambda *a, **k: passes.append(1) or real_step(*a, **k))
    chosen = in_threads(2, lambda c: for_training(CPU, cfg, VOCAB, shape, c))
    per_pass = 2 * len(batches)  # 2 workers
    assert chosen[0] == chosen[1] and len(passes) % per_pass == 0 and len(passes) >= per_pass * 2 * 2
    key = precision.probe_key(cfg.model, VOCAB, shape)
    assert f"probe{precision.PROBE_VERSION} threads1 workers2 batch256:51x5x4," in key and list(
        precision.read_cache()
    ) == [key]
    assert "with 2 workers of 1 threads" in chosen[0].line(CPU)
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda *a: pytest.fail("probed"))
    again = in_threads(2, lambda c: for_training(CPU, cfg, VOCAB, shape, c))
    assert again[0].dtype == chosen[0].dtype and "cached" in again[0].line(CPU)
    other = ProbeShape.of_run(cfg, threads=2, workers=2, widths=widths)  # other threads: another key
    assert precision.probe_key(cfg.model, VOCAB, other) != key


def test_the_probe_cuts_its_batches_from_the_runs_rows_as_the_loader_does():
    rows = [{"src_ids": [5] * n + [3], "tgt_ids": [6] * (n + 1)} for n in (30, 4, 7, 9, 12, 2)]
    assert row_widths(rows) == ((31, 32), (5, 6), (8, 9), (10, 11), (13, 14), (3, 4))
    assert row_widths([]) is None
    data = Config().data
    # Rows of 8 and 32 tokens, 1:1: the long ones hold 4/5 of the tokens, so 4/5 of the batches.
    shapes = batch_shapes([(8, 7), (32, 30)], 256, data, k=5)
    assert shapes == ((32, 8, 7),) + ((8, 32, 30),) * 4
    # A batch's widths are its longest source's and its longest target's, as the loader pads them.
    mixed = batch_shapes([(8, 3), (3, 8)], 256, data, k=64)
    assert (
        {(32, 8, 8), (32, 8, 3), (32, 3, 8)}
        <= set(mixed)
        <= {(r, s, t) for r in range(1, 33) for s in (3, 8) for t in (3, 8)}
    )
    data.pad_multiple = 8  # the run's padding rules: widths rounded up to 8
    assert set(batch_shapes([(5, 7), (12, 9)], 256, data, k=4)) <= {(32, 8, 8), (16, 16, 16)}
    assert ProbeShape.of_run(Config(), 1, 1).shapes == ((97, 21, 21),)  # no rows known: one batch of 20-token rows


def test_train_precision_pins_and_train_bf16_false_still_forces_fp32(monkeypatch, cache):
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda *a: pytest.fail("probed"))
    cfg = apply_overrides(Config(), {"train.precision": "bf16"})
    assert for_training(CPU, cfg, VOCAB).line(CPU) == (
        "precision: forward pass in bf16 autocast (fp32 weights) on cpu (train.precision=bf16)"
    )
    kept = {"name": "bf16", "device_type": "cpu", "why": "bf16 measured 1.20x fp32 for this model"}
    pinned = for_training(CPU, apply_overrides(Config(), {"train.precision": "fp32"}), VOCAB, kept=kept)
    assert pinned.dtype is None and pinned.why == "train.precision=fp32; the checkpoint trained in bf16"
    forced = for_training(CPU, apply_overrides(cfg, {"train.bf16": False}), VOCAB, kept=kept)
    assert forced.dtype is None and forced.why.startswith("train.bf16=false")
    fp16 = for_training(CPU, apply_overrides(Config(), {"train.precision": "fp16"}), VOCAB)
    assert fp16.dtype == torch.float16 and fp16.grad_scaler() is not None
    with pytest.raises(ValueError, match=r"train.precision='bf17' must be one of 'auto', 'fp32', 'bf16', 'fp16'"):
        apply_overrides(Config(), {"train.precision": "bf17"})


def test_a_resumed_run_keeps_the_recorded_precision_where_the_cache_now_says_otherwise(
    monkeypatch, cache, tmp_path, capsys
):
    """Done-when 3 of issue 47: the worker (WorkerLoop.create with a fake environment) records
    the precision it trained in; resumed from that checkpoint it keeps it, though the probe's
    cache now says the other, and a fresh run of the same config follows the cache."""
    from test_worker import Reports, loop_config

    from raymt.checkpoint import load_config
    from raymt.worker import WorkerLoop
    from raymt.worker_env import WorkerEnv
    from raymt.worker_state import Saved

    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda *a: 1.5)  # bf16 pays, the probe says
    config = loop_config(tmp_path, **{"train.max_steps": 2, "train.eval_every": 2})
    reports = Reports(tmp_path)
    WorkerLoop.create(config, WorkerEnv(report=reports), Saved()).run()
    assert "bf16 autocast (fp32 weights) on cpu (bf16 measured 1.50x fp32 for this model)" in capsys.readouterr().out
    checkpoint = reports.checkpoints[2]
    assert load_train_state(checkpoint).precision["name"] == "bf16"
    assert load_config(checkpoint)[0].train.precision == "bf16"  # the run's config as the checkpoint keeps it

    precision.cache_path().write_text(json.dumps({k: 0.8 for k in precision.read_cache()}))  # now: bf16 slower
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda *a: pytest.fail("probed"))
    resumed = WorkerLoop.create(config, WorkerEnv(report=reports), Saved.resume(checkpoint, shown="checkpoint-2"))
    assert resumed.env.precision.dtype == torch.bfloat16
    assert "(as the checkpoint recorded: bf16 measured 1.50x fp32 for this model)" in capsys.readouterr().out
    fresh = WorkerLoop.create(config, WorkerEnv(report=reports), Saved())  # a new run: the cache decides
    assert fresh.env.precision.dtype is None and "0.80x" in fresh.env.precision.why
    pinned_cfg = apply_overrides(config.config, {"train.precision": "fp32"})  # the user pins it: that wins
    config = replace(config, config=pinned_cfg)  # over the record
    pinned = WorkerLoop.create(config, WorkerEnv(report=reports), Saved.resume(checkpoint, shown="checkpoint-2"))
    assert pinned.env.precision.dtype is None and "the checkpoint trained in bf16" in pinned.env.precision.why
