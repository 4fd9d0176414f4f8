"""Runs started by `ray job submit`: nothing is written into Ray's temporary copy of the job's
working directory, and a multi-node cluster never gets a run directory only one node sees."""

from pathlib import Path

import pytest
from tiny_checkpoint import make_checkpoint, write_pairs

from raymt import backtranslate, evaluate, storage
from raymt.autoscale import RayCluster
from raymt.config import Config
from raymt.rundir import finalize
from raymt.shared_dir import check_shared


@pytest.fixture
def job_cwd(tmp_path, monkeypatch) -> Path:
    """The cwd of a `ray job submit` entrypoint: Ray's unpacked --working-dir; HOME elsewhere."""
    package = tmp_path / "ray/session_1/runtime_resources/working_dir_files/_ray_pkg_0123abcd"
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAYMT_STORAGE_PATH", raising=False)
    return package


def test_a_ray_package_is_recognized(job_cwd, tmp_path):
    assert storage.ray_package(job_cwd / "runs/x") == str(job_cwd)
    assert storage.ray_package(job_cwd) == str(job_cwd)
    assert storage.ray_package(tmp_path / "runs") is None
    assert storage.ray_package("s3://b/runtime_resources/_ray_pkg_1/runs") is None


def test_relative_outputs_of_a_job_go_under_home_not_into_its_package(job_cwd, tmp_path, capsys):
    home = tmp_path / "home"
    assert storage.output_location("runs", "--storage-path") == str(home / "raymt/runs")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and str(home / "raymt/runs") in out and str(job_cwd) in out
    assert "RAYMT_STORAGE_PATH" in out
    assert storage.output_location(str(tmp_path / "abs"), "--output") == str(tmp_path / "abs")
    assert storage.output_location("s3://bucket/runs/", "--output") == "s3://bucket/runs"
    assert capsys.readouterr().out == ""  # nothing moved: nothing said


def test_an_absolute_path_inside_the_package_is_one_line(job_cwd):
    with pytest.raises(ValueError, match="Ray's temporary copy of a job's working directory") as err:
        storage.output_location(str(job_cwd / "runs"), "--storage-path")
    assert "\n" not in str(err.value) and "--storage-path" in str(err.value)


def test_outside_a_job_relative_outputs_stay_relative_to_the_cwd(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert storage.output_location("evaluation", "--output-dir") == str(tmp_path / "evaluation")
    assert capsys.readouterr().out == ""


def test_a_job_run_goes_to_home_raymt_runs(job_cwd, tmp_path, capsys):
    cfg = finalize(Config())  # the default storage path: "runs"
    assert cfg.train.storage_path == str(tmp_path / "home/raymt/runs")
    assert str(tmp_path / "home/raymt/runs") in capsys.readouterr().out


def test_raymt_storage_path_wins_in_a_job(job_cwd, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYMT_STORAGE_PATH", "s3://bucket/runs")
    assert finalize(Config()).train.storage_path == "s3://bucket/runs"
    assert capsys.readouterr().out == ""


def test_evaluate_and_backtranslate_outputs_of_a_job_go_under_home(job_cwd, tmp_path):
    """`raymt evaluate`'s default --output-dir and a relative `backtranslate --output`."""
    checkpoint = make_checkpoint(tmp_path / "checkpoint")
    pairs = write_pairs(tmp_path / "set", 3, seed=1)
    cfg = evaluate.check_inputs(evaluate.EvaluateConfig((str(checkpoint),), (str(pairs),))).cfg
    assert cfg.output_dir == str(tmp_path / "home/raymt/evaluation") and Path(cfg.output_dir).is_dir()
    (tmp_path / "mono.en").write_text("one two\nthree\n")
    flags = ["--checkpoint", str(checkpoint), "--input", str(tmp_path / "mono.en"), "--output", "bt"]
    job = backtranslate.check_args(backtranslate.parse_args([*flags, "--engine", "raymt"]))
    assert job.output == str(tmp_path / "home/raymt/bt")
    assert not any(job_cwd.iterdir())  # nothing in Ray's copy


class Nodes(RayCluster):
    """A cluster whose other nodes see the files of `shared` (a directory) and nothing else."""

    def __init__(self, shared=None):
        self.shared, self.asked = shared, []

    def nodes_without(self, path: str) -> list[str]:
        self.asked.append(path)
        if self.shared is not None and Path(path).is_relative_to(self.shared):
            return []
        return ["10.0.0.2", "10.0.0.3"]


def test_a_node_local_run_directory_on_a_multi_node_cluster_is_one_line(tmp_path):
    cluster = Nodes()
    with pytest.raises(ValueError) as err:
        check_shared(str(tmp_path / "runs/r"), "--storage-path", cluster)
    message = str(err.value)
    assert "\n" not in message and "10.0.0.2, 10.0.0.3" in message
    assert "--storage-path" in message and "RAYMT_STORAGE_PATH" in message
    assert not list(tmp_path.iterdir())  # the probe leaves nothing behind
    assert cluster.asked and Path(cluster.asked[0]).parent == tmp_path  # probed in the nearest existing directory


def test_a_shared_or_remote_run_directory_passes(tmp_path):
    check_shared(str(tmp_path / "runs"), "--storage-path", Nodes(shared=tmp_path))
    cluster = Nodes()
    check_shared("s3://bucket/runs", "--storage-path", cluster)
    assert cluster.asked == []  # object storage: every node reaches it


def test_a_single_node_cluster_passes(ray_cluster, tmp_path):
    check_shared(str(tmp_path / "runs"), "--storage-path")  # the test session's one-node head


def test_a_relative_prepare_out_of_a_job_goes_under_home(job_cwd, tmp_path, monkeypatch, capsys):
    """`raymt data prepare --out corpus` in a job: the corpus goes to ~/raymt/corpus, said in one
    line; an absolute --out inside the package is one line, before anything is prepared."""
    from raymt.data import prepare
    from raymt.data.__main__ import main

    got = []
    monkeypatch.setattr(prepare, "prepare_corpora", lambda cfg, out, *a, **kw: got.append(out))
    assert main(["prepare", "--out", "corpus", "--pairs", "en-de"]) == 0
    assert got == [str(tmp_path / "home/raymt/corpus")]
    assert "raymt: --out corpus goes to " in capsys.readouterr().out
    assert main(["prepare", "--out", str(job_cwd / "corpus"), "--pairs", "en-de"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raymt.data: error: --out ") and err.count("\n") == 1 and len(got) == 1
    assert not any(job_cwd.iterdir())  # nothing in Ray's copy
