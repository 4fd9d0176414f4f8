"""`raymt.average`: last/best/explicit selection, mean weights that load and translate, clear refusals."""

import json

import pytest
import torch
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import average, translate
from raymt.checkpoint import load_model, load_weights
from raymt.decoding import DecodeOptions
from raymt.decoding import translate as translate_sentences

# (directory name, step, valid_bleu, valid_loss); names sort differently from steps on purpose.
RUN = [
    ("checkpoint_2026-01-01_10-00-00.000003", 30, 1.5, 4.0),
    ("checkpoint_2026-01-01_09-00-00.000001", 10, 2.5, 4.4),
    ("checkpoint_2026-01-01_09-30-00.000002", 20, 0.5, 3.9),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory laid out as Ray Train 2.60 leaves it: checkpoints and the manager snapshot."""
    run = tmp_path_factory.mktemp("run")
    results = []
    for seed, (name, step, bleu, loss) in enumerate(RUN):
        make_checkpoint(run / name, seed=seed, step=step)
        results.append(
            {
                "version": 0,
                "checkpoint_dir_name": name,
                "metrics": {"valid_loss": loss, "valid_bleu": bleu, "step": step, "epoch": 1},
            }
        )
    (run / "checkpoint_manager_snapshot.json").write_text(
        json.dumps(
            {
                "ray_version": "2.60.0",
                "checkpoint_results": results,
                "checkpoint_report_indices": [1, 2, 3],
                "latest_checkpoint_result": results[0],
                "pending_training_results": [],
                "current_report_index": 4,
            }
        )
    )
    return run


def test_average_of_three_loads_and_translates(run_dir, tmp_path, capsys):
    dirs = [run_dir / name for name, *_ in RUN]
    assert average.main(["--checkpoints", *map(str, dirs), "--output", str(tmp_path / "avg")]) == 0
    states = [load_weights(d) for d in dirs]
    model, tokenizer, _ = load_model(tmp_path / "avg")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, sum(s[key] for s in states) / 3, atol=1e-6, rtol=1e-6)
    assert not torch.equal(model.embed.weight, states[0]["embed.weight"])
    hyps = translate_sentences(
        model, tokenizer, ["Germany and March 3, 2021", "Belize"], DecodeOptions(beam=2, max_len_b=4)
    )
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)
    capsys.readouterr()
    assert translate.main(["--checkpoint", str(tmp_path / "avg"), "--beam", "2", "Belize"]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    assert json.loads((tmp_path / "avg" / "average.json").read_text())["checkpoints"] == [str(d) for d in dirs]


def test_last_n_is_chosen_by_step(run_dir):
    assert [d.name for d in average.last_checkpoints(run_dir, 2)] == [RUN[0][0], RUN[2][0]]


def test_best_n_is_chosen_by_ray_metrics(run_dir):
    assert [d.name for d in average.best_checkpoints(run_dir, 2)] == [RUN[1][0], RUN[0][0]]
    assert [d.name for d in average.best_checkpoints(run_dir, 1, "valid_loss")] == [RUN[2][0]]


def test_cli_best_writes_a_checkpoint(run_dir, tmp_path, capsys):
    assert average.main([str(run_dir), "--best", "2", "--output", str(tmp_path / "best2")]) == 0
    assert load_model(tmp_path / "best2")[0].vocab_size > 0
    assert "wrote" in capsys.readouterr().out


def reversed_checkpoint(directory):
    """A checkpoint like the others but trained de->en: same model and spm.model, other direction."""
    make_checkpoint(directory, seed=5)
    meta = json.loads((directory / "config.json").read_text())
    (corpus,) = meta["config"]["data"]["corpora"]
    corpus["src_lang"], corpus["tgt_lang"] = corpus["tgt_lang"], corpus["src_lang"]
    (directory / "config.json").write_text(json.dumps(meta))
    return directory


@pytest.mark.parametrize(
    "case", ["too_many", "other_model", "other_vocab", "other_direction", "no_spm", "metric", "overwrite"]
)
def test_refusals_are_one_line(run_dir, tmp_path, case, err_lines):
    first = str(run_dir / RUN[0][0])
    args = {
        "too_many": [str(run_dir), "--last", "4"],
        "metric": [str(run_dir), "--best", "2", "--metric", "valid_ter"],
        "overwrite": ["--checkpoints", first, first],
    }.get(case)
    if case == "other_model":
        args = ["--checkpoints", first, str(make_checkpoint(tmp_path / "narrow", d_model=16))]
    elif case == "other_vocab":
        args = ["--checkpoints", first, str(make_checkpoint(tmp_path / "vocab", vocab_size=248))]
    elif case == "other_direction":
        args = ["--checkpoints", first, str(reversed_checkpoint(tmp_path / "de-en"))]
    elif case == "no_spm":
        (make_checkpoint(tmp_path / "no_spm") / "spm.model").unlink()
        args = ["--checkpoints", first, str(tmp_path / "no_spm")]
    out = str(tmp_path / "out") if case != "overwrite" else first
    assert average.main([*args, "--output", out]) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.average: error: ")
    expected = {
        "too_many": "only 3 checkpoint(s)",
        "other_model": "model.d_model=16 vs 32",
        "other_vocab": "same vocabulary",
        "other_direction": "de-en translates de->en but",
        "no_spm": "no_spm/spm.model does not exist",
        "metric": "'valid_ter'",
        "overwrite": "is one of",
    }[case]
    assert expected in err[0]


def test_malicious_train_state_is_refused(tmp_path):
    from test_export import plant_malicious_pickle

    ckpt = make_checkpoint(tmp_path / "run" / "checkpoint_x")
    marker = plant_malicious_pickle(ckpt / "train_state.pt", tmp_path)
    with pytest.raises(ValueError, match="refusing to load .*train_state.pt: it would run posix.system"):
        average.last_checkpoints(tmp_path / "run", 1)
    assert not marker.exists()


def test_the_config_renders_its_command_and_picks_one_way(tmp_path, err_lines):
    """AverageConfig round-trips through its flags; --last, --best and --checkpoints exclude each
    other and a run directory goes with --last/--best only: one-line errors, before anything is read."""
    from raymt.average import AverageConfig
    from raymt.command import parse, to_argv

    for cfg in (
        AverageConfig(run_dir="runs/x", best=2, metric="valid_loss", mode="min", output="avg"),
        AverageConfig(checkpoints=["a", "b"], output="avg"),
    ):
        assert parse(AverageConfig, to_argv(cfg), "average") == cfg
    out = ["--output", str(tmp_path / "out")]
    for argv, message in [
        (["runs/x"], "which checkpoints? give --last N, --best N or --checkpoints"),
        (["runs/x", "--last", "1", "--best", "1"], "--last and --best each pick checkpoints"),
        (["--last", "2"], "--last needs a run directory"),
        (["runs/x", "--checkpoints", "a"], "not both"),
    ]:
        assert average.main([*argv, *out]) == 2
        err = err_lines()
        assert len(err) == 1 and err[0].startswith("raymt.average: error: ") and message in err[0], err
