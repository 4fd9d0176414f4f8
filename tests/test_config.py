"""Configuration: one home for defaults, presets, overrides, one-line errors before Ray."""

import subprocess
import sys
from typing import Optional

import pytest

from raymt.config import GPU_MAX_TOKENS, Config, apply_overrides, base, parse_set_args, preset
from raymt.flags import build_config
from raymt.train import parse_args


def test_presets_and_overrides():
    assert (base().num_encoder_layers, base().d_model, base().d_ff, base().num_heads) == (6, 512, 2048, 8)
    cfg = apply_overrides(Config(), {"optim.lr": "5e-4", "train.epochs": "3", "model.pre_norm": "false"})
    assert (cfg.optim.lr, cfg.train.epochs, cfg.model.pre_norm) == (5e-4, 3, False)
    assert Config.from_dict(cfg.to_dict()) == cfg
    # An older config's one-pair key is read where build_config assembles the flat map.
    assert build_config(parse_args(["--set", "data.test=none"])).data.corpora[0].test == ()


def test_cli_sources_layer_in_order(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[optim]\nlr = 0.002\nwarmup_steps = 10\n[model]\nd_model = 64\n")
    args = parse_args(
        [
            "--preset",
            "tiny",
            "--config",
            str(f),
            "--num-workers",
            "3",
            "--set",
            "optim.lr=1e-3",
            "--src-lang",
            "fr",
            "--tgt-lang",
            "es",
        ]
    )
    cfg = build_config(args)
    assert cfg.model.d_model == 64 and cfg.model.num_heads == 2  # file over preset
    assert cfg.optim.lr == 1e-3 and cfg.optim.warmup_steps == 10  # --set over file
    assert cfg.train.num_workers == 3 and cfg.data.pairs() == [("fr", "es")]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optim.lrr": "1"}, "unknown config field 'optim.lrr'"),
        ({"modle.d_model": "1"}, "unknown config field"),
        ({"model.d_model": "100", "model.num_heads": "3"}, "divisible by model.num_heads"),
        ({"data.vocab_size": "1001"}, "multiple of 8"),
        ({"optim.lr": "fast"}, "optim.lr='fast' is not a valid float"),
        ({"model.dropout": "1.5"}, r"model.dropout=1.5 must be in \[0, 1\)"),
        ({"train.num_workers": "0"}, "train.num_workers=0 must be > 0"),
        ({"train.min_workers": "3"}, "train.min_workers=3 must be between 1 and train.num_workers=2"),
        ({"model.activation": "tanh"}, "must be one of relu, gelu, swish"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(Config(), overrides)


def test_decoding_defaults_live_in_one_section():
    """Config.decode is a DecodeOptions: translate/evaluate's defaults are the run's test decoding."""
    from raymt import config, decoding

    assert decoding.DecodeOptions is config.DecodeOptions and Config().decode == config.DecodeOptions()
    DecodeOptions = config.DecodeOptions
    cfg = apply_overrides(Config(), {"decode.beam": "3", "decode.length_penalty": "1.0"})
    assert (cfg.decode.beam, cfg.decode.length_penalty) == (3, 1.0)
    with pytest.raises(ValueError, match="beam=0 must be >= 1"):
        apply_overrides(Config(), {"decode.beam": "0"})
    with pytest.raises(ValueError, match="length_penalty=-1.0 must be >= 0"):
        DecodeOptions(length_penalty=-1.0)


def test_configs_written_before_the_decode_section_still_load():
    """Run configs and checkpoints saved with train.test_beam/length_penalty/max_len_a/max_len_b."""
    old = Config().to_dict()
    del old["decode"]
    old["train"].update(test_beam=2, length_penalty=1.0, max_len_a=1.5, max_len_b=7, valid_beam=1)
    cfg = Config.from_dict(old)
    assert (cfg.decode.beam, cfg.decode.length_penalty, cfg.decode.max_len_a, cfg.decode.max_len_b) == (2, 1.0, 1.5, 7)
    assert cfg.train.valid_beam == 1
    assert old["train"]["test_beam"] == 2  # the caller's dict is left as it was
    cfg = apply_overrides(Config(), {"train.test_beam": "4", "train.max_len_b": "3"})  # old --set names
    assert (cfg.decode.beam, cfg.decode.max_len_b) == (4, 3)


def test_bad_preset_and_set_syntax():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ValueError, match="section.field=value"):
        parse_set_args(["optim.lr"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "optim.lr=-1"], "optim.lr=-1.0 must be > 0"),
        (["--preset", "huge"], "unknown preset"),
        (["--train", "/nonexistent/corpus", "--valid", "/nonexistent/val"], "missing file /nonexistent/corpus.en"),
        # would die inside a worker at the first pair longer than 127 tokens, maybe hours in
        (["--set", "model.max_positions=128"], "data.max_len=200 makes batches 201 positions wide"),
        # one 200-token pair padded to a multiple of 8 is 208 wide: 202 tokens would overflow the budget
        (["--set", "data.max_tokens=202", "--set", "data.pad_multiple=8"], "data.max_tokens=202 must be at least 208"),
        # torch refuses the bf16 hook on gloo: a traceback from every worker
        (["--set", "train.grad_compression=true"], "add --gpu, or leave it false for CPU workers"),
    ],
)
def test_cli_errors_are_one_line_before_ray(argv, message, tmp_path, capsys, monkeypatch):
    import ray

    from raymt import train

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the error")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(train, "init_ray", no_ray)
    try:
        status = train.main(["--storage-path", str(tmp_path), *argv])
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    out = capsys.readouterr()
    assert status == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert "ray" not in out.out.lower()


def test_cross_section_checks_wait_for_every_override(tmp_path):
    """A config file may set grad_compression and leave use_gpu to --gpu."""
    f = tmp_path / "run.toml"
    f.write_text("[train]\ngrad_compression = true\n")
    cfg = build_config(parse_args(["--config", str(f), "--gpu", "--num-workers", "2"]))
    assert cfg.train.grad_compression and cfg.train.use_gpu
    assert build_config(parse_args(["--set", "model.max_positions=201"])).model.max_positions == 201


def test_gpu_and_compiled_runs_get_device_defaults_unless_set(tmp_path):
    cpu = build_config(parse_args([]))
    assert (cpu.data.max_tokens, cpu.data.pad_multiple) == (2048, 1)  # CPU: nothing changes
    gpu = build_config(parse_args(["--gpu"]))
    assert (gpu.data.max_tokens, gpu.data.pad_multiple) == (GPU_MAX_TOKENS, 8)
    # 128 wide, 2 workers x 32k tokens: the paper's 1.4e-3 x sqrt(65536 / 25000) (config.batch_schedule)
    assert (gpu.optim.lr, gpu.optim.warmup_steps) == (2.3e-3, 4000)
    big = build_config(parse_args(["--gpu", "--preset", "big", "--max-steps", "100000"]))
    assert big.data.max_tokens == GPU_MAX_TOKENS // 2
    assert (big.optim.lr, big.optim.warmup_steps) == (5.7e-4, 4000)  # the paper's 4.9e-4 x sqrt(32768 / 25000)
    base = build_config(parse_args(["--gpu", "--preset", "base", "--set", "optim.lr=1e-3", "--max-steps", "400"]))
    assert (base.optim.lr, base.optim.warmup_steps) == (1e-3, 100)  # what the user set wins
    f = tmp_path / "c.toml"
    f.write_text("[data]\nmax_tokens = 4096\n")
    for argv in (["--gpu", "--set", "data.max_tokens=4096"], ["--gpu", "--config", str(f)]):
        assert build_config(parse_args(argv)).data.max_tokens == 4096  # what the user set wins
    compiled = build_config(parse_args(["--set", "train.compile=true"]))
    assert (compiled.data.max_tokens, compiled.data.pad_multiple) == (2048, 8)
    resumed = build_config(parse_args(["--gpu"]), cpu, new_run=False)  # a resumed run keeps its batches
    assert (resumed.data.max_tokens, resumed.data.pad_multiple) == (2048, 1)


def test_config_loads_nothing_of_raymt_data():
    """The corpus specs live in raymt.config.corpus, so DataConfig checks [[data.corpora]] tables
    without raymt.data (which builds on raymt.config: no cycle)."""
    code = (
        "import sys; from raymt.config import Config, DataConfig;"
        "DataConfig(corpora=[{'src_lang': 'en', 'tgt_lang': 'de'}]);"
        "print(sorted(m for m in sys.modules if m.startswith('raymt.data')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_value_and_check_lang_are_public():
    """`raymt data prepare` parses its flags with the --set parser; tags check codes as corpora do."""
    from raymt.config import parse_value
    from raymt.tags import check_lang

    assert parse_value("2e3", int, "data.max_tokens") == 2000 and parse_value("none", Optional[str], "k") is None
    with pytest.raises(ValueError, match="data.max_len='x' is not a valid int"):
        parse_value("x", int, "data.max_len")
    check_lang("pt_BR", "corpus")
    with pytest.raises(ValueError, match="'pt-BR' must be a language code"):
        check_lang("pt-BR", "corpus")


def test_older_configs_one_pair_fields_are_read_into_corpora(tmp_path):
    """[data] src_lang/tgt_lang/train/valid/test (config files and recipes before issue 43, --set,
    run directories' raymt_config.json and checkpoints' config.json) are data.corpora's one corpus."""
    import json
    from pathlib import Path

    from raymt.config import CorpusSpec

    old = tmp_path / "old.toml"
    old.write_text('[data]\nsrc_lang = "fr"\ntgt_lang = "en"\ntrain = "tr"\nvalid = "va"\nmax_tokens = 4096\n')
    cfg = build_config(parse_args(["--config", str(old)]))
    assert cfg.data.corpora == [CorpusSpec("fr", "en", ("tr",), valid="va")] and cfg.data.max_tokens == 4096
    # Flags and --set change the corpus the file made, as they changed its fields.
    cfg = build_config(parse_args(["--config", str(old), "--valid", "dev", "--set", "data.test=te"]))
    assert cfg.data.corpora == [CorpusSpec("fr", "en", ("tr",), valid="dev", test=("te",))]
    assert build_config(parse_args(["--set", "data.src_lang=es"])).data.pairs() == [("es", "de")]
    with pytest.raises(ValueError, match="not in the built-in corpus"):
        build_config(parse_args(["--set", "data.src_lang=xx"]))
    # Read by build_config and Config.from_dict only: a Config built in code names data.corpora.
    with pytest.raises(ValueError, match="unknown config field 'data.src_lang'"):
        apply_overrides(Config(), {"data.src_lang": "es"})
    runs = Path(__file__).parent / "fixtures" / "ee135a8" / "runs"
    for saved in sorted(runs.glob("*/raymt_config.json")) + sorted(runs.glob("*/checkpoint_*/config.json")):
        meta = json.loads(saved.read_text())
        data = Config.from_dict(meta.get("config", meta)).data
        assert data.corpora == [CorpusSpec("en", "de")] and data.corpus in ("corpus-v1", "corpus-v2"), saved
    with pytest.raises(ValueError, match="data.corpora and data.train are both set"):
        Config.from_dict({"data": {"train": "x", "corpora": [{"src_lang": "en", "tgt_lang": "de", "train": "a"}]}})
