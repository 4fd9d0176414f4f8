"""Runs on object storage, against a real S3-compatible server on 127.0.0.1 (tests/s3.py):
corpus, run files, logs and checkpoints under the bucket; --resume by URI; checkpoint URIs
for the CLIs, with the same refusal of code-running pickles as local files."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import REFERENCE_STEPS as STEPS
from conftest import tiny_run
from test_bad_input import error_line
from test_export import plant_malicious_pickle
from test_faults import assert_mid_epoch, assert_same_as_reference, final_weights, trained_pairs
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import average, exporting, rundir, storage, train, translate
from raymt.checkpoint import RAY_SNAPSHOT_FILE
from raymt.config import Config, CorpusSpec, PrepareConfig
from raymt.data import format as corpus_format
from raymt.data import prepare, sources
from raymt.data.builtin import generate
from raymt.rundata import plan_data

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def prefix(s3_bucket, tmp_path, monkeypatch):
    """A fresh s3:// prefix in the test bucket; checkpoint downloads go to a private cache."""
    monkeypatch.setenv("RAYMT_CACHE", str(tmp_path / "cache"))
    return f"{s3_bucket}/{uuid.uuid4().hex[:8]}"


def upload_pairs(location: str, num_pairs: int, seed: int) -> str:
    """LOCATION.en and LOCATION.de from the built-in corpus, written straight to the bucket."""
    src, tgt = generate(num_pairs, "en", "de", seed=seed)
    for lang, lines in (("en", src), ("de", tgt)):
        storage.write_bytes(f"{location}.{lang}", "".join(line + "\n" for line in lines).encode())
    return location


def test_locations_files_and_mirrors(prefix, tmp_path):
    assert storage.split(f"{prefix}/runs/x/") == (f"{prefix}/runs", "x")
    assert storage.join(prefix, "a", "b.txt") == f"{prefix}/a/b.txt"
    with pytest.raises(ValueError, match="no parent directory"):
        storage.split("s3://bucket")
    storage.write_bytes(f"{prefix}/d/one.txt", b"1")
    assert storage.exists(f"{prefix}/d/one.txt") and not storage.exists(f"{prefix}/d/two.txt")
    assert storage.listdir(f"{prefix}/d") == ["one.txt"] and storage.listdir(f"{prefix}/none") == []

    mirror = storage.MirroredDir(f"{prefix}/d", fetch=("one.txt", "missing.txt"))
    assert mirror.path.is_dir() and (mirror.path / "one.txt").read_bytes() == b"1"
    (mirror.path / "one.txt").write_bytes(b"11")
    (mirror.path / "sub").mkdir()
    (mirror.path / "sub" / "two.txt").write_bytes(b"2")
    mirror.close()
    assert storage.read_bytes(f"{prefix}/d/one.txt") == b"11"
    assert storage.read_bytes(f"{prefix}/d/sub/two.txt") == b"2" and not mirror.path.exists()

    copy = storage.local_copy(f"{prefix}/d")
    assert (copy / "sub" / "two.txt").read_bytes() == b"2" and str(copy).startswith(str(tmp_path / "cache"))
    storage.write_bytes(f"{prefix}/d/one.txt", b"changed")
    assert storage.local_copy(f"{prefix}/d/") == copy and (copy / "one.txt").read_bytes() == b"11"  # once
    with pytest.raises(ValueError, match="does not exist"):
        storage.local_copy(f"{prefix}/nothing")


def test_a_file_uri_gets_its_directories(tmp_path):
    """`raymt backtranslate --output file:///new/dir` writes bt.json first: the directory is made."""
    storage.write_bytes(f"file://{tmp_path}/new/dir/bt.json", b"{}")
    assert (tmp_path / "new" / "dir" / "bt.json").read_bytes() == b"{}"


def test_checkpoint_uris_for_translate_export_average(prefix, tmp_path, capsys):
    local = make_checkpoint(tmp_path / "ckpt", seed=4)
    storage.upload_dir(local, f"{prefix}/ckpt")
    fast = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "4", "Belize", "Monday"]  # an untrained model
    assert translate.main(["--checkpoint", str(local), *fast]) == 0
    expected = capsys.readouterr().out
    assert translate.main(["--checkpoint", f"{prefix}/ckpt", *fast]) == 0
    assert capsys.readouterr().out == expected

    out = exporting.export_model(f"{prefix}/ckpt", tmp_path / "exported", "torch")
    for name, value in torch.load(local / "model.pt", weights_only=True).items():
        assert torch.equal(torch.load(out / "model.pt", weights_only=True)[name], value)
    assert average.main(["--checkpoints", f"{prefix}/ckpt", str(local), "--output", str(tmp_path / "avg")]) == 0

    bad = tmp_path / "bad"
    shutil.copytree(local, bad)
    marker = plant_malicious_pickle(bad / "model.pt", tmp_path)
    storage.upload_dir(bad, f"{prefix}/bad")
    assert translate.main(["--checkpoint", f"{prefix}/bad", *fast]) == 2
    line = error_line(capsys, "raymt.translate")
    assert "refusing to load" in line and "posix.system" in line and "corrupt or malicious" in line
    assert not marker.exists()


@pytest.mark.slow  # ~7 s: evaluate's actors on the bucket (CI runs it: .ci/run; the default suite stays under 5 min)
@pytest.mark.ci
def test_evaluate_checkpoint_and_test_set_uris(prefix, tmp_path, ray_address):
    """evaluate --checkpoint s3://... --test s3://...: the driver and the decoding actor (on the
    session's head) each load the checkpoint from the bucket."""
    storage.upload_dir(make_checkpoint(tmp_path / "ckpt", seed=4), f"{prefix}/ckpt")
    test_prefix = upload_pairs(f"{prefix}/raw/test", 6, seed=3)
    out = tmp_path / "eval"
    run_cli(
        [
            "raymt.evaluate",
            "--checkpoint",
            f"{prefix}/ckpt",
            "--test",
            test_prefix,
            "--output-dir",
            str(out),
            "--num-actors",
            "1",
            "--num-cpus",
            "1",
            "--beam",
            "1",
            "--max-len-a",
            "0",
            "--max-len-b",
            "4",
        ],
        tmp_path,
    )
    report = json.loads((out / "report.json").read_text())
    assert report["checkpoint"] == f"{prefix}/ckpt" and report["test_sets"]["test"]["num_sentences"] == 6


@pytest.mark.parametrize("where", ["s3", "local"])
def test_resume_of_a_trained_run_without_registered_checkpoint_is_an_error(prefix, tmp_path, capsys, where):
    run_dir = f"{prefix}/runs/lost" if where == "s3" else str(tmp_path / "runs" / "lost")
    storage.write_bytes(storage.join(run_dir, rundir.RUN_CONFIG), json.dumps(Config().to_dict()).encode())
    storage.write_bytes(storage.join(run_dir, rundir.METRICS_CSV), b"step,epoch\n20,0\n40,0\n")
    assert train.main(["--resume", run_dir]) == 2
    line = error_line(capsys, "raymt.train")
    assert "logged step 40 but Ray Train registered no checkpoint" in line and "start again at step 0" in line


def test_prepare_out_uri(ray_cluster, prefix):
    """A corpus written to the bucket whole (manifest last); prepared again: found, or replaced."""
    pairs = generate(300, "en", "de", seed=5)
    train_src = [sources.Source(kind="pairs", pairs=pairs, generated=True)]
    valid = [sources.Source(kind="pairs", pairs=(pairs[0][:20], pairs[1][:20]))]
    out = f"{prefix}/corpus"
    cfg = PrepareConfig(vocab_size=128, shard_pairs=100)
    manifest = prepare.prepare_corpora(
        cfg, out, [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), train_src, valid)]
    )
    assert {"manifest.json", "spm.model", "train", "valid"} <= set(storage.listdir(out))
    prepared = corpus_format.open_corpus(out)
    assert prepared.manifest == manifest
    assert len(prepared.shards()) == 3
    assert prepared.eval_set("valid")[0] == pairs[0][:20]
    assert prepared.tokenizer().vocab_size == 128
    assert (
        prepare.prepare_corpora(
            cfg, out, [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), train_src, valid)]
        )
        == manifest
    )  # already
    other = PrepareConfig(vocab_size=120, shard_pairs=100)
    with pytest.raises(ValueError, match="already holds a corpus prepared from other inputs"):
        prepare.prepare_corpora(
            other, out, [sources.CorpusInput(CorpusSpec(other.src_lang, other.tgt_lang), train_src, valid)]
        )
    again = prepare.prepare_corpora(
        other, out, [sources.CorpusInput(CorpusSpec(other.src_lang, other.tgt_lang), train_src, valid)], overwrite=True
    )
    assert again["vocab_size"] == 120
    assert corpus_format.open_corpus(out).manifest["fingerprint"] != manifest["fingerprint"]


def run_cli(args: list, cwd, timeout: int = 600) -> str:
    """Run `python -m ...` in `cwd` (the environment, with the S3 endpoint, is inherited)."""
    out = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout + out.stderr


@pytest.mark.slow  # ~35 s: a 2-worker run on the bucket (CI runs it: .ci/run)
@pytest.mark.ci
def test_run_on_s3_from_uri_inputs(prefix, tmp_path, capsys, ray_address):
    """--train/--valid/--test URIs, storage_path on S3: the corpus prepared in the run, config,
    tokenizer, metrics, event file and checkpoints all land in the bucket and nothing in the
    working directory; a resume would reuse the corpus; the checkpoints translate and average
    by URI. (Resuming by URI: test_killed_driver_resumes_from_s3_exactly, slow.)"""
    raw = f"{prefix}/raw"
    upload_pairs(f"{raw}/train", 400, seed=1)
    upload_pairs(f"{raw}/valid", 12, seed=2)
    upload_pairs(f"{raw}/test", 12, seed=3)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    argv = [
        "--train",
        f"{raw}/train",
        "--valid",
        f"{raw}/valid",
        "--test",
        f"{raw}/test",
        "--storage-path",
        f"{prefix}/runs",
        "--name",
        "quick",
        "--max-steps",
        "4",
        "--preset",
        "tiny",
        "--num-workers",
        "2",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.log_every=2",
        "--set",
        "data.vocab_size=128",
        "--set",
        "data.max_tokens=256",
        "--set",
        "decode.beam=1",
    ]
    run_cli(["raymt.train", *argv], cwd)
    run_dir = f"{prefix}/runs/quick"
    names = storage.listdir(run_dir)
    for name in ("raymt_config.json", "spm.model", "corpus", "logs", "summary.json", "plots", RAY_SNAPSHOT_FILE):
        assert name in names, names
    assert rundir.RunDir(run_dir).registered_checkpoints() == 2
    # Built-in text read from files gets the content rules (12-hour vs 24-hour times, amounts in
    # digits): about a third of it goes; what stays was read from the bucket.
    assert corpus_format.open_corpus(f"{run_dir}/corpus").training_corpora[0].num_pairs > 200
    assert storage.listdir(f"{run_dir}/logs/tensorboard")[0].startswith("events.out.tfevents")
    steps = [
        int(row.split(",")[0])
        for row in storage.read_bytes(f"{run_dir}/{rundir.METRICS_CSV}").decode().splitlines()[1:]
    ]
    assert set(steps) == {2, 4}
    assert list(cwd.iterdir()) == []

    cfg, resume_dir, _ = train.resolve_resume(train.parse_args(["--resume", run_dir]))
    cfg = rundir.RunDir(resume_dir).resume_config(cfg)  # what train.run does first
    assert resume_dir == run_dir and cfg.train.storage_path == f"{prefix}/runs" and cfg.train.name == "quick"
    assert plan_data(cfg, run_dir, resume_dir, None)[1].corpora is None  # corpus reused
    summary = json.loads(storage.read_bytes(f"{run_dir}/summary.json"))
    assert summary["best_checkpoint"].startswith(run_dir + "/checkpoint_")
    assert translate.main(["--checkpoint", summary["best_checkpoint"], "--beam", "1", "Belize"]) == 0
    assert capsys.readouterr().out.strip()
    assert average.main([run_dir, "--last", "2", "--output", str(tmp_path / "last2")]) == 0
    assert len(json.loads((tmp_path / "last2" / average.AVERAGE_FILE).read_text())["checkpoints"]) == 2


def wait_for_remote_checkpoints(run_dir: str, count: int, proc, timeout: float = 600) -> None:
    """Block until Ray Train has registered `count` checkpoints in the run's snapshot in the bucket."""
    deadline = time.time() + timeout
    while rundir.RunDir(run_dir).registered_checkpoints() < count:
        assert time.time() < deadline and proc.poll() is None, "no checkpoint before the kill"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_killed_driver_resumes_from_s3_exactly(prefix, tmp_path):
    """Multi30k-sized data prepared into the bucket; a 2-worker run with storage_path there is
    killed after two checkpoints and resumed by URI from an empty working directory: same
    parameters and the same pairs at every step as an uninterrupted run."""
    corpus = f"{prefix}/corpus"
    run_cli(["raymt.data", "prepare", "--out", corpus, "--dataset", "builtin", "--vocab-size", "256"], tmp_path)
    storage_path = f"{prefix}/runs"
    extra = ("--corpus", corpus)
    run_cli(tiny_run(storage_path, "ref", STEPS, *extra)[2:], tmp_path)
    reference_dir = tmp_path / "reference"
    storage.download_dir(f"{storage_path}/ref", reference_dir)
    reference = final_weights(reference_dir), trained_pairs(reference_dir)

    proc = subprocess.Popen(
        tiny_run(storage_path, "killed", STEPS, *extra),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_remote_checkpoints(f"{storage_path}/killed", 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and every process of its local Ray
    proc.wait()

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    log = run_cli(["raymt.train", "--resume", f"{storage_path}/killed"], fresh)
    resumed = [int(m) for m in re.findall(r"resuming at step (\d+)", log)]
    assert resumed and 0 < resumed[0] < STEPS
    assert list(fresh.iterdir()) == []
    run_dir = tmp_path / "killed"
    storage.download_dir(f"{storage_path}/killed", run_dir)
    start = [
        p.parent
        for p in run_dir.glob("checkpoint_*/train_state.pt")
        if torch.load(p, weights_only=True)["step"] == resumed[0]
    ]
    assert_mid_epoch(start[0])
    assert_same_as_reference(run_dir, reference)
