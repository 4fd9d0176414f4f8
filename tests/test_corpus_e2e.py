"""A named corpus fetched over HTTP (127.0.0.1), prepared with Ray Data, ready for a run."""

import dataclasses

import pytest
from test_download import MULTI30K, serve

from raymt.config import Config, apply_overrides, tiny
from raymt.data import download
from raymt.data import format as corpus_format
from raymt.data.__main__ import main

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (MULTI30K / "train.en.gz").is_file(), reason="needs ../shared/data/multi30k"),
]


@pytest.mark.slow  # ~5 s: a download and a run's preparation (CI runs it: .ci/run; the default suite stays under 5 min)
@pytest.mark.ci
def test_prepare_multi30k_over_http_for_a_run(ray_cluster, tmp_path, monkeypatch, capsys):
    # The local copy holds test_2016_flickr only; upstream also has the 2017 sets.
    spec = download.DATASETS["multi30k"]
    monkeypatch.setitem(
        download.DATASETS,
        "multi30k",
        dataclasses.replace(spec, test_sets={"test_2016_flickr": spec.test_sets["test_2016_flickr"]}),
    )
    out = tmp_path / "corpus"
    with serve(MULTI30K) as server:
        status = main(
            [
                "prepare",
                "--dataset",
                "multi30k",
                "--src",
                "en",
                "--tgt",
                "de",
                "--mirror",
                server.url,
                "--cache-dir",
                str(tmp_path / "cache"),
                "--out",
                str(out),
                "--vocab-size",
                "1000",
                "--shard-pairs",
                "8000",
            ]
        )
    assert status == 0, capsys.readouterr().err
    prepared = corpus_format.open_corpus(str(out))
    manifest, files = prepared.manifest, prepared.shards()
    assert len(files) >= 4 and max(f.num_pairs for f in files) <= 8000
    (train,) = [c["train"] for c in manifest["corpora"]]
    assert sum(f.num_pairs for f in files) == train["num_pairs"] and train["input_pairs"] == 29000
    assert train["num_pairs"] > 28900 and 500 < manifest["vocab_size"] <= 1000
    assert manifest["splits"]["test"]["en-de"]["test_2016_flickr"]["num_pairs"] == 1000

    # A run on it takes the validation and the first test set from the manifest (training
    # on a prepared corpus itself runs in test_gpu_check and test_storage).
    from raymt.rundata import plan_data

    cfg = apply_overrides(Config(model=tiny()), {"data.corpus": str(out)})
    cfg, run_data = plan_data(cfg, tmp_path / "runs" / "m30k", None, None)
    assert cfg.data.pairs() == [("en", "de")] and run_data.corpora is None
    assert {k: len(v["en-de"][0]) for k, v in run_data.eval_sets.items()} == {"valid": 1014, "test": 1000}
