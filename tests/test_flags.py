"""raymt.flags: `raymt train`'s and `raymt tune`'s flags as typed configs (`TrainFlags`, `TuneFlags`,
issue 66) build the Config the argparse flags built before, render back to their command line, and a
Config handed to `train.run` is the one its command line builds."""

from __future__ import annotations

import json

import pytest

from raymt import train, tune
from raymt.command import command_line, to_argv
from raymt.config import Config, flatten
from raymt.flags import InputFlags, TrainFlags, build_config

BUILTIN = {"train": (), "origin": "real", "weight": 1.0, "valid": None, "test": (), "label": None, "clean": {}}

# Flags and the fields of the Config they build that differ from Config()'s, as the argparse parser
# of flag_parser built them (computed with the code before TrainFlags, 59de93d).
BUILT_BEFORE = [
    ([], {}),
    (
        ["--preset", "base", "--gpu", "--max-steps", "3000", "--set", "optim.lr=1e-3", "--num-workers", "4"],
        {
            "model.d_model": 512,
            "model.num_heads": 8,
            "model.d_ff": 2048,
            "model.num_encoder_layers": 6,
            "model.num_decoder_layers": 6,
            "data.max_tokens": 32768,
            "data.pad_multiple": 8,
            "data.shape_buckets": 12,
            "optim.lr": 0.001,
            "optim.warmup_steps": 750,
            "train.max_steps": 3000,
            "train.eval_every": 1000,
            "train.num_workers": 4,
            "train.use_gpu": True,
        },
    ),
    (
        ["--src-lang", "fr", "--tgt-lang", "en", "--train", "a", "--valid", "v", "--test", "t1", "--test", "t2"],
        {
            "data.corpora": [
                {**BUILTIN, "src_lang": "fr", "tgt_lang": "en", "train": ("a",), "valid": "v", "test": ("t1", "t2")}
            ]
        },
    ),
    (
        ["--pairs", "en-fr", "--bt", "en-de:bt", "--real-weight", "2", "--train", "en-de:x", "--valid", "en-de:v"]
        + ["--config", "CONFIG"],
        {
            "data.corpora": [
                {**BUILTIN, "src_lang": "en", "tgt_lang": "fr", "weight": 2.0},
                {**BUILTIN, "src_lang": "en", "tgt_lang": "de", "train": ("x",), "weight": 2.0, "valid": "v"},
                {**BUILTIN, "src_lang": "en", "tgt_lang": "de", "train": ("bt",), "origin": "bt"},
            ],
            "optim.lr": 0.0003,
            "train.eval_every": 50,
        },
    ),
    (
        ["--corpus", "prep", "--epochs", "3", "--max-minutes", "1.5", "--name", "n", "--storage-path", "s3://b/r"]
        + ["--max-steps", "1e3"],
        {
            "data.corpus": "prep",
            "train.max_steps": 1000,
            "train.epochs": 3,
            "train.max_minutes": 1.5,
            "train.storage_path": "s3://b/r",
            "train.name": "n",
        },
    ),
    (
        ["--set", "data.src_lang=es", "--valid", "dev", "--test", "te", "--verbose"],
        {"data.corpora": [{**BUILTIN, "src_lang": "es", "tgt_lang": "de", "valid": "dev", "test": ("te",)}]},
    ),
]


def changed(cfg: Config) -> dict:
    """The flat fields of `cfg` that differ from the default Config's."""
    default = flatten(Config().to_dict())
    return {k: v for k, v in flatten(cfg.to_dict()).items() if default.get(k) != v}


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlr = 3e-4\n[train]\neval_every = 50\n")
    return str(path)


@pytest.mark.parametrize("argv, before", BUILT_BEFORE)
def test_the_flags_build_the_config_they_built_before(argv, before, config_file):
    """Same Config, so the same weights at step 40."""
    argv = [config_file if a == "CONFIG" else a for a in argv]
    assert changed(build_config(train.parse_args(argv))) == before


def test_a_sweep_s_flags_build_the_config_they_built_before():
    cfg, space = tune.sweep_config(tune.parse_args(["--max-steps", "200", "--pairs", "en-de,de-en"]))
    pairs = [{**BUILTIN, "src_lang": "en", "tgt_lang": "de"}, {**BUILTIN, "src_lang": "de", "tgt_lang": "en"}]
    assert changed(cfg) == {"data.corpora": pairs, "train.max_steps": 200, "train.eval_every": 100, "decode.beam": 1}
    assert list(space) == ["optim.lr"]  # the default grid


def test_the_flags_render_back_to_their_command_line():
    inputs = InputFlags(["a", "fr-en:b"], ["v"], ["t1", "t2"], ["bt"], "en-de", 0.5)
    flags = TrainFlags(
        preset="tiny",
        config="c.toml",
        set=["optim.lr=1e-3", "data.max_tokens=512"],
        num_workers=3,
        max_steps=40,
        epochs=2,
        max_minutes=1.5,
        corpus="s3://b/c",
        storage_path="runs x",
        name="n",
        src_lang="fr",
        tgt_lang="en",
        inputs=inputs,
        gpu=True,
        verbose=True,
        resume="r",
        init="i",
    )
    assert train.parse_args(to_argv(flags)) == flags
    assert to_argv(TrainFlags()) == [] and train.parse_args([]) == TrainFlags()
    student = TrainFlags(max_steps=40, inputs=InputFlags(train=["en-de:x y"]))
    assert command_line("train", student) == "raymt train --max-steps 40 --train 'en-de:x y'"
    sweep = tune.TuneFlags(
        TrainFlags(max_steps=40, gpu=True, set=["data.max_tokens=512"]),
        search=["model.dropout=uniform:0:0.3"],
        grid=["optim.lr=1e-3,2e-3"],
        num_samples=4,
        max_concurrent=2,
        scheduler="pbt",
        metric="valid_loss",
        sweep_name="s",
    )
    assert tune.parse_args(to_argv(sweep)) == sweep


def test_a_bad_value_is_the_one_line_it_was(capsys):
    with pytest.raises(ValueError, match="^train.max_steps='ten' is not a valid int$"):
        train.parse_args(["--max-steps", "ten"])
    assert train.main(["--max-minutes", "soon"]) == 2
    assert capsys.readouterr().err == "raymt.train: error: train.max_minutes='soon' is not a valid float\n"
    assert tune.main(["--scheduler", "hyperband"]) == 2
    assert capsys.readouterr().err == "raymt.tune: error: --scheduler 'hyperband' must be one of asha, pbt, fifo\n"
    assert tune.main(["--max-concurrent", "0"]) == 2
    assert capsys.readouterr().err == "raymt.tune: error: --num-samples and --max-concurrent must be >= 1\n"
    with pytest.raises(SystemExit):  # tune has no --resume/--init
        tune.parse_args(["--init", "ckpt"])


def test_a_config_handed_to_run_is_the_one_its_config_file_builds(tmp_path):
    """A caller holding a Config (distill's student) calls `train.run(cfg)`: the Config that
    `raymt train --config` of its file would build."""
    cfg = build_config(train.parse_args(["--preset", "student_mini", "--gpu", "--pairs", "en-de,de-en"]))
    path = tmp_path / "student.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert build_config(TrainFlags(config=str(path))) == cfg
