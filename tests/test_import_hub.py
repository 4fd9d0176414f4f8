"""`raymt import ORG/NAME`: a Hugging Face Hub id, read through huggingface_hub's cache, imports as
its directory does. The cache is built here as huggingface_hub lays it out (blobs, snapshots of
symlinks, refs); every test runs with HF_HUB_OFFLINE set, and the download path with a stand-in
for snapshot_download: nothing reaches the network."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

from hf_models import save_opus_mt  # noqa: E402
from tiny_checkpoint import one_thread  # noqa: E402, F401 (autouse fixture)

from raymt import hf_import  # noqa: E402
from raymt.checkpoint import CONFIG_FILE, load_weights  # noqa: E402

ID = "Helsinki-NLP/opus-mt-en-de"
COMMITS = ("a" * 40, "b" * 40)  # the snapshots of the cached repository: the first is tagged v1, the second is main


def cache_repo(cache: Path, repo_id: str, directory: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """`directory`'s files cached as huggingface_hub caches a repository's snapshot: each file a
    blob named by its hash, the snapshot's files symlinks to them, each ref a file naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(directory.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads the file as the commit
    return snapshot


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[Path]:
    """Two tiny OPUS-MT directories of different weights, the first also without the languages in
    tokenizer_config.json (only the name says them)."""
    root = tmp_path_factory.mktemp("models")
    first, second = (save_opus_mt(root / f"v{seed}" / "opus-mt-en-de", seed=seed) for seed in (0, 1))
    (first / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "MarianTokenizer"}))
    return [first, second]


@pytest.fixture
def hub(tmp_path, monkeypatch, models) -> Path:
    """A Hugging Face cache holding ID at both COMMITS, as this process's huggingface_hub reads it
    (its constants were read from the environment at import) and as a command started here would
    (the environment); offline."""
    cache = tmp_path / "hf" / "hub"
    for model, commit, refs in zip(models, COMMITS, [("v1",), ("main",)]):
        cache_repo(cache, ID, model, commit, refs)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def same_checkpoints(got: Path, want: Path) -> bool:
    """Whether two checkpoints hold the same files, byte for byte (weights, tokenizer), and the same
    config but for data.corpus (the directory each was imported from)."""
    names = sorted(p.name for p in got.iterdir())
    if names != sorted(p.name for p in want.iterdir()):
        return False
    configs = [json.loads((c / CONFIG_FILE).read_text()) for c in (got, want)]
    for config in configs:
        config["config"]["data"].pop("corpus")
    same_files = all((got / n).read_bytes() == (want / n).read_bytes() for n in names if n != CONFIG_FILE)
    return same_files and configs[0] == configs[1]


def bad(tmp_path, capsys, *argv) -> str:
    """The one-line error of `raymt import` (exit 2, nothing written)."""
    out = tmp_path / "out"
    assert hf_import.main([*argv, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("raymt import: error: ") and not out.exists()
    return err


def test_a_hub_id_imports_as_its_directory(hub, models, tmp_path, capsys):
    """The id is main's snapshot; the checkpoint is that directory's import (its languages from the
    id's name where tokenizer_config.json does not say them)."""
    got = hf_import.import_model(ID, tmp_path / "by-id")
    assert same_checkpoints(got, hf_import.import_model(models[1], tmp_path / "by-dir"))
    assert not same_checkpoints(got, hf_import.import_model(models[0], tmp_path / "other"))
    config = json.loads((got / CONFIG_FILE).read_text())["config"]["data"]
    assert config["corpus"] == str(hub / f"models--{ID.replace('/', '--')}" / "snapshots" / COMMITS[1])
    # The first has no languages in tokenizer_config.json: the id's name says them, the snapshot's cannot.
    unnamed = tmp_path / "model"
    shutil.copytree(models[0], unnamed)
    assert "pass --src-lang and --tgt-lang" in bad(tmp_path, capsys, str(unnamed))
    assert hf_import.main([ID, "--revision", "v1", "--output", str(tmp_path / "v1")]) == 0
    assert f"imported {ID} -> " in capsys.readouterr().out
    assert same_checkpoints(tmp_path / "v1", tmp_path / "other")


@pytest.mark.parametrize("revision", ["v1", COMMITS[0], "main"])
def test_revision_pins_a_snapshot(hub, models, tmp_path, revision):
    """--revision: a tag or a commit of the cache picks its snapshot, main the newest."""
    got = hf_import.import_model(ID, tmp_path / "got", revision=revision)
    want = models[1] if revision == "main" else models[0]
    assert same_checkpoints(got, hf_import.import_model(want, tmp_path / "want"))


def test_names_neither_a_directory_nor_a_cached_id(hub, tmp_path, capsys, monkeypatch):
    """Offline, an uncached id or revision is one line naming the cache and the fixes; a name that is
    no id either says so, and so does an id without huggingface_hub."""
    err = bad(tmp_path, capsys, "Helsinki-NLP/opus-mt-en-fr")
    assert "Helsinki-NLP/opus-mt-en-fr is not a directory, and the Hub id Helsinki-NLP/opus-mt-en-fr is not" in err
    assert f"in the Hugging Face cache ({hub}) and HF_HUB_OFFLINE is set" in err
    assert "download it with network (HF_HUB_OFFLINE unset), or pass a model directory" in err
    assert f"the Hub id {ID} at revision v2 is not in the Hugging Face cache" in bad(
        tmp_path, capsys, ID, "--revision", "v2"
    )
    err = bad(tmp_path, capsys, str(tmp_path / "no" / "such" / "model"))
    assert "is not a directory, nor a Hugging Face Hub id (ORG/NAME" in err
    incomplete = getattr(huggingface_hub.errors, "IncompleteSnapshotError", None)
    if incomplete is not None:  # a snapshot its cached tree listing finds files missing from

        def partial(*args, **kwargs):
            raise incomplete("The cached snapshot is incomplete", snapshot_path=str(hub))

        monkeypatch.setattr(huggingface_hub, "snapshot_download", partial)
        assert f"the Hub id {ID} is only partly in the Hugging Face cache" in bad(tmp_path, capsys, ID)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed: training's install lacks it
    assert f"{ID} is not a directory; reading it as a Hub id needs huggingface_hub" in bad(tmp_path, capsys, ID)


def test_a_directory_wins_over_the_id_of_its_name(hub, models, tmp_path, monkeypatch, capsys):
    """A directory ORG/NAME under the working directory is imported, not the cached id; --revision
    with it is a mistake."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(models[0], tmp_path / ID)
    got = hf_import.import_model(ID, tmp_path / "got")
    assert same_checkpoints(got, hf_import.import_model(models[0], tmp_path / "want"))
    assert f"--revision v1 pins a Hub id's version, but {ID} is a local directory" in bad(
        tmp_path, capsys, ID, "--revision", "v1"
    )


def test_online_downloads_the_files_it_reads(models, tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE unset, snapshot_download fetches configurations, tokenizers and
    safetensors weights, and pytorch_model.bin only where there are none: a stand-in that copies
    the patterns' files of a local "remote" repository (TF weights it never asks for)."""
    from fnmatch import fnmatch

    remote = shutil.copytree(models[1], tmp_path / "remote-safetensors")
    (remote / "tf_model.h5").write_bytes(b"never fetched")
    bin_remote = shutil.copytree(remote, tmp_path / "remote-bin")
    torch.save(load_weights(bin_remote), bin_remote / "pytorch_model.bin")
    (bin_remote / "model.safetensors").unlink()
    calls = []

    def snapshot_download(repo_id, revision, allow_patterns, local_files_only):
        calls.append((repo_id, revision, allow_patterns, local_files_only))
        source = tmp_path / f"remote-{repo_id.split('/')[1]}"
        snapshot = tmp_path / "cache" / repo_id / (revision or "main")
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in source.iterdir():
            if any(fnmatch(file.name, p) for p in allow_patterns):
                shutil.copy(file, snapshot / file.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    want = hf_import.import_model(models[1], tmp_path / "want")
    for kind in ("safetensors", "bin"):
        calls.clear()
        got = hf_import.import_model(f"org/{kind}", tmp_path / kind, revision="v3")
        assert load_weights(got).keys() == load_weights(want).keys()
        assert all(torch.equal(load_weights(got)[k], v) for k, v in load_weights(want).items())
        assert [c[2] for c in calls] == [hf_import.HUB_FILES] + ([hf_import.HUB_BIN] if kind == "bin" else [])
        assert all(c[1] == "v3" and c[3] is False for c in calls)
        snapshot = tmp_path / "cache" / "org" / kind / "v3"
        assert not (snapshot / "tf_model.h5").exists() and (snapshot / "pytorch_model.bin").exists() == (kind == "bin")


@pytest.mark.slow  # ~5 s: the command in a new process (CI runs it: -m ci)
@pytest.mark.ci
def test_the_command_reads_hf_home_and_hf_hub_offline(hub, tmp_path):
    """`raymt import ID` in a new process: the cache under HF_HOME (no HF_HUB_CACHE), and with
    HF_HUB_OFFLINE an uncached id is one line, exit 2."""
    home = tmp_path / "home"
    shutil.move(hub, home / "hub")  # HF_HOME/hub is huggingface_hub's default cache
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(sys.path))

    def command(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "raymt", "import", *argv], env=env, capture_output=True, text=True, timeout=300
        )

    done = command(ID, "--output", str(tmp_path / "got"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "got" / CONFIG_FILE).is_file()
    failed = command("Helsinki-NLP/opus-mt-en-fr", "--output", str(tmp_path / "none"))
    assert failed.returncode == 2 and not (tmp_path / "none").exists()
    assert failed.stderr.strip().count("\n") == 0, failed.stderr
    assert f"not in the Hugging Face cache ({home / 'hub'}) and HF_HUB_OFFLINE is set" in failed.stderr


def test_the_revision_round_trips_through_its_flag():
    from raymt.command import command_line, parse, to_argv

    cfg = hf_import.ImportConfig(directory=ID, output="ckpt", revision="v1")
    assert parse(hf_import.ImportConfig, to_argv(cfg), "raymt import") == cfg
    assert command_line("import", cfg) == f"raymt import --output ckpt --revision v1 {ID}"
