"""What a GPU run gets without asking: its test set decoded on GPUs, workers, step budget and a batch schedule."""

import re
import shlex
from pathlib import Path

import pytest
import ray.data
from tiny_checkpoint import make_checkpoint, write_pairs

from raymt import autoscale, evaluate, train
from raymt.data.builtin import generate
from raymt.flags import build_config
from raymt.train import parse_args, resolve_resume


class FakeDataset:
    """Ray Data as `translate_on_cluster` uses it: records what `map_batches` asks for and
    'decodes' each planned batch to one hypothesis per sentence, without a GPU."""

    def __init__(self, seen: dict, rows: list):
        self.seen, self.rows = seen, rows

    def map_batches(self, fn, **kwargs):
        self.seen.update(kwargs, fn=fn)
        return self

    def take_all(self):
        return [{"set": r["set"], "index": i, "score": -1.0, "hyp": f"hyp {i}"} for r in self.rows for i in r["index"]]


def test_gpu_run_decodes_its_test_set_on_an_actor_pool_of_gpus_not_on_the_driver(tmp_path, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "checkpoint_000001", step=7)  # the driver's copy
    src, tgt = generate(20, "en", "de", seed=3)
    cfg = build_config(parse_args(["--gpu", "--num-workers", "3"]))
    seen = {}
    monkeypatch.setattr(ray.data, "from_items", lambda rows, **_: FakeDataset(seen, rows))
    monkeypatch.setattr(autoscale.RayCluster, "resources", lambda self: {"CPU": 16.0, "GPU": 3.0})

    def on_the_driver(*args, **kwargs):
        raise AssertionError("the test set was decoded on the driver")

    monkeypatch.setattr(evaluate, "load_engine", on_the_driver)
    stored = tmp_path / "storage" / "r" / "checkpoint_000001"  # the run's storage, where every node reads
    make_checkpoint(stored, step=7)
    [scores] = evaluate.score_test_sets(checkpoint, {"en-de": (src, tgt)}, cfg, str(stored)).values()
    assert seen["fn"] is evaluate.BatchTranslator
    assert (seen["num_gpus"], seen["num_cpus"], seen["compute"].min_size) == (
        1,
        1.0,
        3,
    )  # one GPU an actor, one actor a worker
    assert seen["fn_constructor_kwargs"]["device"] == "cuda"
    assert seen["fn_constructor_kwargs"]["checkpoints"] == [str(stored)]  # not the driver's copy
    assert scores["num_sentences"] == 20 and scores["beam"] == cfg.decode.beam
    assert scores["checkpoint"].startswith(f"{stored} (step 7")
    monkeypatch.setattr(autoscale.RayCluster, "resources", lambda self: {"CPU": 16.0, "GPU": 2.0})
    evaluate.score_test_sets(checkpoint, {"en-de": (src, tgt)}, cfg, str(stored))  # lost a node
    assert seen["compute"].min_size == 2


def test_cpu_run_keeps_decoding_its_test_set_on_the_driver(tmp_path, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "checkpoint_000001")
    src, tgt = generate(4, "en", "de", seed=3)
    monkeypatch.setattr(evaluate, "translate_on_cluster", lambda *a, **kw: pytest.fail("an actor pool on CPU"))
    cfg = build_config(parse_args(["--set", "decode.beam=1"]))
    scores = evaluate.score_test_sets(checkpoint, {"en-de": (src, tgt)}, cfg, str(checkpoint))
    assert scores["en-de"]["num_sentences"] == 4


def test_gpu_workers_default_to_the_clusters_gpus():
    """`raymt train --gpu` on a 1-GPU box asks for 1 worker, not 2 it cannot place."""
    assert build_config(parse_args(["--gpu"]), cluster_gpus=lambda: 1).train.num_workers == 1
    assert build_config(parse_args(["--gpu"]), cluster_gpus=lambda: 8).train.num_workers == 8
    given = build_config(parse_args(["--gpu", "--num-workers", "4"]), cluster_gpus=lambda: pytest.fail("asked"))
    assert given.train.num_workers == 4
    with pytest.raises(ValueError, match="the cluster has no GPU now; pass --num-workers N") as err:
        build_config(parse_args(["--gpu"]), cluster_gpus=lambda: 0)
    assert "\n" not in str(err.value)
    assert build_config(parse_args([]), cluster_gpus=lambda: pytest.fail("asked")).train.num_workers == 2  # CPU


def test_train_main_counts_the_clusters_gpus(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(train, "count_cluster_gpus", lambda verbose=False: 1)
    monkeypatch.setattr(train, "run", lambda cfg, *a, **kw: seen.setdefault("cfg", cfg) and {})
    monkeypatch.setattr(train, "print_summary", lambda summary: None)
    assert train.main(["--gpu", "--storage-path", str(tmp_path)]) == 0
    assert seen["cfg"].train.num_workers == 1 and seen["cfg"].train.use_gpu


def test_gpu_run_gets_a_gpu_step_budget_and_validation_interval():
    cpu, gpu = build_config(parse_args([])), build_config(parse_args(["--gpu"]))
    assert (cpu.train.max_steps, cpu.train.eval_every) == (400, 400)
    assert (gpu.train.max_steps, gpu.train.eval_every) == (20000, 1000)
    assert gpu.optim.warmup_steps == 4000 and gpu.train.max_steps >= 4 * gpu.optim.warmup_steps
    mine = build_config(parse_args(["--gpu", "--max-steps", "3000", "--set", "train.eval_every=500"]))
    assert (mine.train.max_steps, mine.train.eval_every, mine.optim.warmup_steps) == (3000, 500, 750)


@pytest.mark.parametrize(
    "argv, lr",
    [
        (["--num-workers", "1"], 8.0e-4),  # 32k tokens: the paper's 7.0e-4 x sqrt(32768 / 25000)
        (["--num-workers", "1", "--set", "data.max_tokens=12500"], 4.9e-4),  # half the paper's batch
        (["--num-workers", "2", "--set", "data.max_tokens=12500", "--set", "optim.update_freq=2"], 9.9e-4),
        (["--num-workers", "8"], 1.4e-3),  # 262k tokens: x3.2, capped at twice the paper's lr
    ],
)
def test_lr_follows_the_global_batch(argv, lr):
    cfg = build_config(parse_args(["--gpu", "--preset", "base", *argv]))
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (lr, 4000)


def test_gpu_run_prints_its_schedule_at_start(tmp_path, monkeypatch, capsys):
    cfg = build_config(parse_args(["--gpu", "--preset", "base", "--num-workers", "8", "--storage-path", str(tmp_path)]))

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the run's first step after its start-up lines

    monkeypatch.setattr(train, "plan_data", stop)
    with pytest.raises(KeyboardInterrupt):
        train.run(cfg)
    assert capsys.readouterr().out.startswith(
        "lr 1.4e-3 and warmup 4000 for a global batch of 262k tokens (8 workers x 32768 x update_freq 1): "
        "the paper's 25k-token schedule, lr x sqrt(batch ratio) = x3.24, capped at x2"
    )


def test_run_from_a_checkpoint_keeps_its_batch_schedule(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ck")  # saved with the CPU defaults: 2048 tokens, lr 3e-3, warmup 100
    argv = ["--init", str(checkpoint), "--gpu", "--num-workers", "1"]
    cfg, _, start = resolve_resume(parse_args(argv))
    assert start == str(checkpoint)
    assert (cfg.data.max_tokens, cfg.optim.lr, cfg.optim.warmup_steps) == (2048, 3e-3, 100)
    assert cfg.data.pad_multiple == 8  # the other GPU defaults still apply
    cfg, _, _ = resolve_resume(parse_args([*argv, "--set", "optim.lr=1e-3", "--set", "data.max_tokens=8192"]))
    assert (cfg.data.max_tokens, cfg.optim.lr) == (8192, 1e-3)  # what the user sets wins


def test_cluster_docs_command_peaks_its_lr(tmp_path):
    """docs/cluster.md's training command: its warmup ends well inside its run (issue 27: warmup
    4000 with max_steps 400 peaked the lr at a tenth)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text()
    command = re.search(r"ray job submit .* -- python -m raymt\.train (.*)", doc.replace("\\\n", " "))
    argv = shlex.split(command.group(1))
    argv = [a.replace("s3://<bucket>/corpora/wmt14-en-de", str(tmp_path)) for a in argv]
    cfg = build_config(parse_args(argv))
    assert cfg.train.use_gpu and cfg.train.num_workers == 16
    assert cfg.optim.warmup_steps * 4 <= cfg.train.max_steps


def test_evaluate_gpu_uses_one_actor_per_gpu(tmp_path, monkeypatch):
    """`raymt evaluate --gpu` on a 1-GPU box: 1 actor, not 2 it cannot place."""
    checkpoint = make_checkpoint(tmp_path / "ck")
    prefix = write_pairs(tmp_path / "test", 4, seed=2)
    seen = {}
    monkeypatch.setattr(evaluate, "init_ray", lambda *a, **kw: False)
    monkeypatch.setattr(autoscale.RayCluster, "resources", lambda self: {"CPU": 8.0, "GPU": 1.0})

    def pool(checkpoint, sources, opts, num_actors, *args, **kwargs):
        seen["num_actors"] = num_actors
        return [[(-1.0, "x")] * len(s) for s in sources]

    monkeypatch.setattr(evaluate, "translate_on_cluster", pool)
    argv = ["--checkpoint", str(checkpoint), "--test", str(prefix), "--output-dir", str(tmp_path / "out")]
    assert evaluate.main([*argv, "--gpu"]) == 0 and seen["num_actors"] == 1
    assert evaluate.main(argv) == 0 and seen["num_actors"] == 2  # CPU: as before
