"""recipes/*.toml: each loads into the config, states its corpus, hardware, global batch and
expected quality in a header that matches its fields, and trains 20 steps (shrunk to a tiny
model on the CPU, every other field as written) so that no recipe rots."""

import dataclasses
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_checkpoint import make_checkpoint, one_thread, tokenizer  # noqa: F401

from raymt.batching import chunk_batches, collate
from raymt.checkpoint import load_config
from raymt.config import Config, batch_schedule
from raymt.data.builtin import generate
from raymt.flags import build_config
from raymt.model import build_model
from raymt.precision import autocast_for
from raymt.tokenizer import EOS_ID
from raymt.train import parse_args, resolve_resume
from raymt.trainer import Trainer, restore_training

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
# Training recipes (`raymt train --config`); recipes/pipeline-*.toml are `raymt pipeline` configs
# (tests/test_pipeline.py).
RECIPES = sorted(p for p in RECIPE_DIR.glob("*.toml") if not p.name.startswith("pipeline-"))
HEADER_KEYS = ("corpus", "hardware", "global batch", "expected", "time", "run", "scaling")
GLOBAL_BATCH = re.compile(r"(\d+) workers? × (\d+) tokens × (\d+) accumulation = (\d+) tokens per update")
# The model shrunk to test size and the run moved to the CPU; nothing else is overridden.
TINY = [
    "model.d_model=16",
    "model.num_heads=2",
    "model.d_ff=32",
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
    "train.use_gpu=false",
    "train.max_steps=20",
]


def recipe_config(path: Path, *overrides: str) -> Config:
    """The config `raymt train --config PATH --set ...` builds (device defaults included)."""
    return build_config(parse_args(["--config", str(path), *(f"--set={o}" for o in overrides)]))


def header(path: Path) -> dict[str, str]:
    """The leading comment block: its first line as 'title', then `# key: text` entries whose
    continuation lines (`#   ...`) are joined to them."""
    lines = list(itertools.takewhile(lambda line: line.startswith("#"), path.read_text(encoding="utf-8").splitlines()))
    fields = {"title": lines[0][1:].strip()}
    key = None
    for line in lines[1:]:
        if line.startswith("#   "):
            assert key is not None, f"{path.name}: a continuation line before any key: {line!r}"
            fields[key] += " " + line[1:].strip()
            continue
        key, sep, text = line[1:].strip().partition(":")
        assert sep and key in HEADER_KEYS, f"{path.name}: header line {line!r} is not `# KEY: ...`"
        fields[key] = text.strip()
    return fields


@pytest.mark.parametrize("name", ["wmt14-en-de-base", "wmt14-en-de-big"])
def test_wmt14_recipes_fill_fast_gpus_and_follow_the_lr_rule(name):
    """>= 16k tokens per GPU (3,328 left an H200 launch-bound), compiled, and the lr and warmup
    of the one batch rule of --gpu runs for the recipe's global batch (issue 27, item 9)."""
    cfg = recipe_config(RECIPE_DIR / f"{name}.toml")
    assert cfg.train.use_gpu and cfg.train.compile
    assert cfg.data.max_tokens >= 16384
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == batch_schedule(cfg)


def test_the_named_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {"multi30k-cpu", "multi30k-gpu", "wmt14-en-de-base", "wmt14-en-de-big"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_and_its_header_matches_its_fields(path):
    cfg = recipe_config(path)  # every field is a config field, every value valid
    fields = header(path)
    assert re.fullmatch(rf"raymt recipe {re.escape(path.stem)}, version \d+ \(\d{{4}}-\d\d-\d\d\)", fields["title"]), (
        fields["title"]
    )
    assert set(HEADER_KEYS) <= set(fields), sorted(set(HEADER_KEYS) - set(fields))
    workers, tokens, accumulation, total = map(int, GLOBAL_BATCH.search(fields["global batch"]).groups())
    assert (workers, tokens, accumulation) == (cfg.train.num_workers, cfg.data.max_tokens, cfg.optim.update_freq)
    assert total == workers * tokens * accumulation
    assert "unverified" in fields["expected"] or "measured" in fields["expected"]
    assert f"--config recipes/{path.name}" in fields["run"]
    hardware = fields["hardware"].lower()
    assert ("gpu" in hardware and "cpu" not in hardware) == cfg.train.use_gpu


def _batches(cfg: Config, seed: int):
    """Endless token-budget batches of a generated en-de corpus, cut with the recipe's data fields."""
    tok = tokenizer()
    src, tgt = generate(300, *cfg.data.pair(), seed=seed)
    src_ids = [ids + [EOS_ID] for ids in tok.encode_batch(src)]
    tgt_ids = tok.encode_batch(tgt)
    src_lens = np.array([len(s) for s in src_ids])
    tgt_lens = np.array([len(t) + 1 for t in tgt_ids])  # BOS / EOS
    rng = np.random.default_rng(seed)
    for _ in itertools.count():
        for rows in chunk_batches(
            src_lens, tgt_lens, cfg.data.window_rows, cfg.data.max_tokens, rng, pad_multiple=cfg.data.pad_multiple
        ):
            yield collate([src_ids[i] for i in rows], [tgt_ids[i] for i in rows])


@pytest.mark.slow  # ~14 s: every recipe's model, 20 steps (CI runs it: .ci/run; the default suite stays under 5 min)
@pytest.mark.ci
def test_every_recipe_trains_twenty_steps():
    """Each recipe's optimizer, schedule, accumulation, batching and precision, on a tiny model."""
    for path in RECIPES:
        cfg = recipe_config(path, *TINY)
        torch.manual_seed(0)
        model, optimizer, scheduler = restore_training(
            build_model(cfg.model, tokenizer().vocab_size), cfg, None, None, lambda m: m
        )
        before = [p.detach().clone() for p in model.parameters()]
        device = torch.device("cpu")
        trainer = Trainer(cfg, model, optimizer, scheduler, device, autocast=autocast_for(device, cfg.train.bf16))
        read = 0

        def counted(batches):
            nonlocal read
            for batch in batches:
                read += 1
                yield batch

        assert trainer.train_epoch(counted(_batches(cfg, seed=1))), path.name  # max_steps reached
        assert trainer.step == 20, path.name
        # lockstep reads one update ahead: 21 updates' micro-batches were drawn for 20 steps.
        assert read == 21 * cfg.optim.update_freq, (path.name, read)
        assert math.isfinite(trainer.progress.last["train_loss"]), path.name
        assert scheduler.get_last_lr()[0] == pytest.approx(cfg.optim.lr * min(1.0, 20 / cfg.optim.warmup_steps))
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), path.name


def test_the_finetune_recipe_keeps_the_checkpoints_model_and_lowers_the_lr(tmp_path):
    """finetune-multi30k with --init: the checkpoint's model and vocabulary (the recipe sets no
    shape), lower dropout, a fraction of multi30k-cpu's lr with a shorter warmup, early stopping."""
    checkpoint = make_checkpoint(tmp_path / "ck")
    recipe = RECIPE_DIR / "finetune-multi30k.toml"
    cfg, _, start = resolve_resume(parse_args(["--init", str(checkpoint), "--config", str(recipe)]))
    saved = load_config(checkpoint)[0]
    assert start == str(checkpoint) and cfg.data.vocab_size == saved.data.vocab_size
    assert cfg.model == dataclasses.replace(saved.model, dropout=0.1)
    scratch = recipe_config(RECIPE_DIR / "multi30k-cpu.toml")
    assert cfg.optim.lr <= scratch.optim.lr / 5 and cfg.optim.warmup_steps < scratch.optim.warmup_steps
    assert cfg.train.patience is not None and cfg.train.patience * cfg.train.eval_every < cfg.train.max_steps


def test_the_docs_fine_tuning_mix_builds_on_the_finetune_recipe(tmp_path):
    """docs/training.md's mix.toml appended to finetune-multi30k (as its `cat` does) with --init:
    two labeled en-de corpora, the general one weighted to half of each epoch, validated on the domain."""
    doc = (RECIPE_DIR.parent / "docs" / "training.md").read_text(encoding="utf-8")
    mix = re.search(r"```toml\n(# mix\.toml.*?)```", doc, re.S).group(1)
    config = tmp_path / "finetune-mix.toml"
    config.write_text((RECIPE_DIR / "finetune-multi30k.toml").read_text(encoding="utf-8") + mix, encoding="utf-8")
    checkpoint = make_checkpoint(tmp_path / "ck")
    cfg, _, _ = resolve_resume(parse_args(["--init", str(checkpoint), "--config", str(config)]))
    domain, general = cfg.data.corpora
    assert (domain.label, domain.valid, general.label, general.valid) == ("domain", "multi30k/val", "general", None)
    assert general.weight * 1_000_000 == pytest.approx(domain.weight * 29_000, rel=1e-3)
    assert cfg.train.patience is not None
