"""Bad input for training and translation: one line naming the problem and the fix, exit
code 2, nothing written. (Corpus rows of the README's table are in test_prepare.py.)"""

import dataclasses
import json

import pytest
from tiny_checkpoint import make_checkpoint, one_thread, tokenizer  # noqa: F401

from raymt import train, translate
from raymt.checkpoint import load_config
from raymt.config import CorpusSpec, PrepareConfig
from raymt.data import prepare, sources

pytestmark = pytest.mark.timeout(300)

TINY = [
    "--preset",
    "tiny",
    "--max-steps",
    "2",
    "--set",
    "data.builtin_train_size=200",
    "--set",
    "data.builtin_eval_size=10",
    "--set",
    "data.vocab_size=256",
]


def error_line(capsys, prog: str) -> str:
    """The single `prog: error: ...` line on stderr."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def checkpoint(tmp_path):
    return make_checkpoint(tmp_path / "ckpt")


# --init keeps the checkpoint's model shape and vocabulary: each flag that changes one is named.
REFUSED = {
    "preset": (["--preset", "small"], "--preset small changes model.d_model (32 in --init"),
    "set_shape": (["--set", "model.num_heads=4"], "--set model.num_heads=4 changes model.num_heads (2 in --init"),
    "set_activation": (["--set", "model.activation=swish"], "--set model.activation=swish changes model.activation"),
    "set_positions": (["--set", "model.positions=fairseq"], "--set model.positions=fairseq changes model.positions"),
    "vocab_size": (["--set", "data.vocab_size=512"], "--set data.vocab_size=512 changes data.vocab_size (256 in"),
    "sp_model_type": (["--set", "data.sp_model_type=bpe"], "--set data.sp_model_type=bpe changes data.sp_model_type"),
    "config": (["--config", "{config}"], "--config {config} (model.tie_output = False) changes model.tie_output"),
}


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_init_refuses_a_flag_that_changes_the_model_or_vocabulary(flag, checkpoint, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[model]\ntie_output = false\ndropout = 0.2\n")
    argv = [a.replace("{config}", str(config)) for a in REFUSED[flag][0]]
    message = REFUSED[flag][1].replace("{config}", str(config))
    assert train.main(["--init", str(checkpoint), *argv, "--storage-path", str(tmp_path / "runs")]) == 2
    line = error_line(capsys, "raymt.train")
    assert message in line and line.endswith("drop it, or train from scratch without --init"), line
    assert not (tmp_path / "runs").exists()


def test_init_takes_the_checkpoints_model_with_other_dropout_rates(checkpoint):
    """The checkpoint's model and vocabulary, its pairs without its files, the defaults elsewhere
    (a new name: a new run directory); dropout rates and the rest may be set, and a flag that
    sets a shape field to the checkpoint's value is no change."""
    meta = json.loads((checkpoint / "config.json").read_text())
    meta["config"]["train"].update(name="old", max_steps=99)
    meta["config"]["data"]["corpora"] = [{"src_lang": "en", "tgt_lang": "de", "train": ["a"], "valid": "b"}]
    (checkpoint / "config.json").write_text(json.dumps(meta))
    argv = ["--init", str(checkpoint), "--set", "model.dropout=0.05", "--set", "model.attention_dropout=0.1"]
    argv += ["--preset", "tiny", "--set", "data.vocab_size=256", "--max-steps", "7"]
    cfg, resume_dir, start = train.resolve_resume(train.parse_args(argv))
    assert (resume_dir, start) == (None, str(checkpoint))
    assert cfg.model == dataclasses.replace(load_config(checkpoint)[0].model, dropout=0.05, attention_dropout=0.1)
    assert cfg.data.vocab_size == 256 and (cfg.train.max_steps, cfg.train.name) == (7, None)
    assert [(c.src_lang, c.tgt_lang, c.train, c.valid) for c in cfg.data.corpora] == [("en", "de", (), None)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--resume", "{ckpt}"],
            "--resume {ckpt} is a checkpoint, not a run directory: start a new run from its weights with --init {ckpt}",
        ),
        (
            ["--init", "{tmp}"],
            "--init {tmp}: not a checkpoint (no model.pt or model.safetensors); continue a run "
            "directory with --resume {tmp}",
        ),
        (["--init", "{ckpt}", "--resume", "{tmp}"], "--resume {tmp} and --init {ckpt}: give one"),
    ],
)
def test_resume_continues_runs_and_init_starts_from_checkpoints(argv, message, checkpoint, tmp_path, capsys):
    fill = lambda text: text.replace("{ckpt}", str(checkpoint)).replace("{tmp}", str(tmp_path))  # noqa: E731
    assert train.main([fill(a) for a in argv]) == 2
    assert fill(message) in error_line(capsys, "raymt.train")


def test_checkpoint_of_another_vocabulary(ray_cluster, checkpoint, tmp_path, capsys):
    other = tokenizer(128)
    corpus = tmp_path / "corpus"
    pairs = (["a b c", "d e f"] * 20, ["g h i", "j k l"] * 20)
    one = [sources.Source(kind="pairs", pairs=pairs)]
    cfg = PrepareConfig(vocab_size=128)
    prepare.prepare_corpora(
        cfg, str(corpus), [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), one, one)], tokenizer=other
    )
    argv = ["--init", str(checkpoint), "--corpus", str(corpus), "--storage-path", str(tmp_path / "runs")]
    assert train.main(argv) == 2
    assert "has a different SentencePiece model than the corpus" in error_line(capsys, "raymt.train")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("damage", ["truncated", "missing_spm", "missing_weights"])
def test_damaged_checkpoint(checkpoint, capsys, damage):
    if damage == "truncated":
        data = (checkpoint / "model.pt").read_bytes()
        (checkpoint / "model.pt").write_bytes(data[: len(data) // 2])
        expected = "corrupt, truncated or not weights-only"
    elif damage == "missing_spm":
        (checkpoint / "spm.model").unlink()
        expected = "spm.model does not exist"
    else:
        (checkpoint / "model.pt").unlink()
        expected = "model.pt does not exist"
    assert translate.main(["--checkpoint", str(checkpoint), "Belize"]) == 2
    assert expected in error_line(capsys, "raymt.translate")


def test_unwritable_storage_path(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    assert train.main([*TINY, "--storage-path", str(tmp_path / "a_file" / "runs")]) == 2
    line = error_line(capsys, "raymt.train")
    assert "cannot write the run directory" in line and "pass a writable --storage-path" in line
    assert (tmp_path / "a_file").read_text() == "x"


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--num-workers", "8"], "train.num_workers=8 x 0.25 CPUs needs 2 CPUs"),
        (["--gpu", "--num-workers", "2"], "with --gpu needs 2 GPUs; the cluster has 0"),
        (["--gpu"], "--gpu: the cluster has no GPU now; pass --num-workers N"),
    ],
)  # one worker per GPU: none
def test_more_workers_or_gpus_than_the_cluster_has(ray_cluster, tmp_path, capsys, flags, expected):
    assert train.main([*TINY, *flags, "--storage-path", str(tmp_path / "runs")]) == 2
    assert expected in error_line(capsys, "raymt.train")
    assert not (tmp_path / "runs").exists()


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """Disk full halfway through torch.save: the old checkpoint still loads, the half-written
    one has no weights file, so nothing (average --last, translate) picks it up."""
    import io

    import torch

    from raymt.average import run_checkpoints
    from raymt.checkpoint import TrainState, load_config, load_model, load_weights, save_checkpoint

    good = make_checkpoint(tmp_path / "checkpoint_1")
    before = load_weights(good)
    model, tok, _ = load_model(good)
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        with open(path, "wb") as f:
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    config = load_config(good)[0]
    for target in (tmp_path / "checkpoint_2", good):  # a new checkpoint, and over the old one
        with pytest.raises(OSError):
            save_checkpoint(target, model, config, tok, TrainState(step=9))
    monkeypatch.setattr(torch, "save", real_save)

    assert all(torch.equal(v, before[k]) for k, v in load_weights(good).items())
    assert torch.load(good / "train_state.pt", weights_only=True)["step"] == 0
    assert run_checkpoints(tmp_path) == [good]
    with pytest.raises(ValueError, match="model.pt does not exist"):
        load_model(tmp_path / "checkpoint_2")
