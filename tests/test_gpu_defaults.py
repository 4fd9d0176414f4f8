"""What a GPU run gets without asking: its test set decoded on GPUs, workers, step budget and a batch schedule."""

import pytest
import ray.data

from raymt import cluster, evaluate, train
from raymt.data.builtin import generate
from raymt.train import build_config, parse_args
from tiny_checkpoint import make_checkpoint


class FakeDataset:
    """Ray Data as `translate_on_cluster` uses it: records what `map_batches` asks for and
    'decodes' each planned batch to one hypothesis per sentence, without a GPU."""

    def __init__(self, seen: dict, rows: list):
        self.seen, self.rows = seen, rows

    def map_batches(self, fn, **kwargs):
        self.seen.update(kwargs, fn=fn)
        return self

    def take_all(self):
        return [{"set": r["set"], "index": i, "score": -1.0, "hyp": f"hyp {i}"}
                for r in self.rows for i in r["index"]]


def test_gpu_run_decodes_its_test_set_on_an_actor_pool_of_gpus_not_on_the_driver(tmp_path, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "checkpoint_000001", step=7)  # the driver's copy
    src, tgt = generate(20, "en", "de", seed=3)
    cfg = build_config(parse_args(["--gpu", "--num-workers", "3"]))
    seen = {}
    monkeypatch.setattr(ray.data, "from_items", lambda rows, **_: FakeDataset(seen, rows))
    monkeypatch.setattr(cluster.RayCluster, "resources", lambda self: {"CPU": 16.0, "GPU": 3.0})

    def on_the_driver(*args, **kwargs):
        raise AssertionError("the test set was decoded on the driver")

    monkeypatch.setattr(train, "load_model", on_the_driver)
    monkeypatch.setattr(train, "translate", on_the_driver)
    stored = tmp_path / "storage" / "r" / "checkpoint_000001"  # the run's storage, where every node reads
    make_checkpoint(stored, step=7)
    scores = train.score_test_set(checkpoint, (src, tgt), cfg, str(stored))
    assert seen["fn"] is evaluate.BatchTranslator
    assert (seen["num_gpus"], seen["num_cpus"], seen["compute"].min_size) == (1, 1.0, 3)  # one GPU an actor, one actor a worker
    assert seen["fn_constructor_kwargs"]["device"] == "cuda"
    assert seen["fn_constructor_kwargs"]["checkpoint"] == str(stored)  # not the driver's copy
    assert scores["num_sentences"] == 20 and scores["beam"] == cfg.decode.beam
    assert scores["checkpoint"].startswith(f"{stored} (step 7")


def test_cpu_run_keeps_decoding_its_test_set_on_the_driver(tmp_path, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "checkpoint_000001")
    src, tgt = generate(4, "en", "de", seed=3)
    monkeypatch.setattr(evaluate, "translate_on_cluster", lambda *a, **kw: pytest.fail("an actor pool on CPU"))
    cfg = build_config(parse_args(["--set", "decode.beam=1"]))
    assert train.score_test_set(checkpoint, (src, tgt), cfg, str(checkpoint))["num_sentences"] == 4
