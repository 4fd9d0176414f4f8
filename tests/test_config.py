"""Configuration: one home for defaults, presets, overrides, one-line errors before Ray."""

import subprocess
import sys

import pytest

from raymt.config import Config, apply_overrides, base, parse_set_args, preset
from raymt.train import build_config, parse_args


def test_presets_and_overrides():
    assert (base().num_encoder_layers, base().d_model, base().d_ff, base().num_heads) == (6, 512, 2048, 8)
    cfg = apply_overrides(Config(), {"optim.lr": "5e-4", "train.epochs": "3", "model.pre_norm": "false",
                                     "data.test": "none"})
    assert (cfg.optim.lr, cfg.train.epochs, cfg.model.pre_norm, cfg.data.test) == (5e-4, 3, False, None)
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_cli_sources_layer_in_order(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[optim]\nlr = 0.002\nwarmup_steps = 10\n[model]\nd_model = 64\n")
    args = parse_args(["--preset", "tiny", "--config", str(f), "--num-workers", "3",
                       "--set", "optim.lr=1e-3", "--src-lang", "fr", "--tgt-lang", "es"])
    cfg = build_config(args)
    assert cfg.model.d_model == 64 and cfg.model.num_heads == 2  # file over preset
    assert cfg.optim.lr == 1e-3 and cfg.optim.warmup_steps == 10  # --set over file
    assert cfg.train.num_workers == 3 and (cfg.data.src_lang, cfg.data.tgt_lang) == ("fr", "es")


@pytest.mark.parametrize("overrides, message", [
    ({"optim.lrr": "1"}, "unknown config field 'optim.lrr'"),
    ({"modle.d_model": "1"}, "unknown config field"),
    ({"model.d_model": "100", "model.num_heads": "3"}, "divisible by model.num_heads"),
    ({"data.vocab_size": "1001"}, "multiple of 8"),
    ({"optim.lr": "fast"}, "optim.lr='fast' is not a valid float"),
    ({"model.dropout": "1.5"}, r"model.dropout=1.5 must be in \[0, 1\)"),
    ({"train.num_workers": "0"}, "train.num_workers=0 must be > 0"),
    ({"data.src_lang": "xx"}, "not in the built-in corpus"),
    ({"model.activation": "swish"}, "must be one of relu, gelu"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(Config(), overrides)


def test_bad_preset_and_set_syntax():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ValueError, match="section.field=value"):
        parse_set_args(["optim.lr"])


@pytest.mark.parametrize("argv, message", [
    (["--set", "optim.lr=-1"], "optim.lr=-1.0 must be > 0"),
    (["--preset", "huge"], "unknown preset"),
    (["--train", "/nonexistent/corpus", "--valid", "/nonexistent/val"], "missing file /nonexistent/corpus.en"),
])
def test_cli_errors_are_one_line_before_ray(argv, message, tmp_path):
    out = subprocess.run([sys.executable, "-m", "raymt.train", "--storage-path", str(tmp_path), *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "ray" not in out.stdout.lower()
