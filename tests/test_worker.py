"""The worker loop without Ray Train: `WorkerLoop.create` with a fake environment (its report
keeps the checkpoints) trains, writes metrics.csv, the data trace and checkpoints as a Ray run
does, and a loop built from one of those checkpoints continues exactly."""

import csv
import dataclasses
import shutil
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny_checkpoint import one_thread, tokenizer  # noqa: F401

from raymt.checkpoint import STATE_FILE, load_train_state, load_weights
from raymt.config import Config, apply_overrides, tiny
from raymt.data.builtin import generate
from raymt.data.format import Shard, TrainingCorpus, eval_rows
from raymt.metrics import CSV_COLUMNS
from raymt.worker import WorkerLoop
from raymt.worker_data import ValidSets
from raymt.worker_env import LoopConfig, ValidRows, WorkerEnv
from raymt.worker_state import Saved

STATE_KEYS = {
    "optimizer",
    "scheduler",
    "step",
    "epoch",
    "data_positions",
    "data_segment",
    "rng_states",
    "grad_scaler",
    "data_batching",
    "precision",
}


def loop_config(tmp_path: Path, **overrides) -> LoopConfig:
    """A driver's loop config (raymt.train.fit's) for a tiny model on 300 built-in pairs (one
    corpus of two shards), 20 validation pairs, logs under tmp_path/logs; `overrides`: config fields."""
    tok = tokenizer()
    src, tgt = generate(320, "en", "de", seed=4)
    shards = tmp_path / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    parts = []
    for k, (lo, hi) in enumerate(((0, 180), (180, 300))):
        ids = [pa.array(tok.encode_batch(side[lo:hi]), pa.list_(pa.int32())) for side in (src, tgt)]
        path = shards / f"part-{k:05d}.parquet"
        pq.write_table(pa.table({"src_ids": ids[0], "tgt_ids": ids[1]}), path, row_group_size=64)
        parts.append(Shard(str(path), hi - lo))
    defaults = {"model.dropout": 0.1, "data.max_tokens": 1500, "data.window_rows": 64, "train.trace_data": True}
    cfg = apply_overrides(Config(model=tiny()), {**defaults, **overrides})
    valid = (src[300:], tgt[300:])
    return LoopConfig(
        config=cfg,
        spm_model=tok.model_proto,
        num_threads=1,
        training_corpora=[TrainingCorpus("en-de", "en", "de", "real", 1.0, (), parts, 300)],
        valid={"en-de": ValidRows(eval_rows(valid, tok, cfg.model.max_positions), valid[1])},
        log_dir=str(tmp_path / "logs"),
    )


class Reports:
    """A fake report function: every rank's metrics, and each checkpoint copied to keep it."""

    def __init__(self, directory: Path):
        self.directory, self.metrics, self.checkpoints = directory, [], {}

    def __call__(self, metrics: dict, checkpoint_dir: Optional[str]) -> None:
        self.metrics.append(metrics)
        if checkpoint_dir is not None:
            kept = self.directory / f"checkpoint-{metrics['step']}"
            shutil.copytree(checkpoint_dir, kept)
            self.checkpoints[metrics["step"]] = kept


@pytest.mark.hosts  # exact resume
def test_a_loop_built_without_ray_trains_logs_and_resumes_exactly(tmp_path, capsys):
    config = loop_config(tmp_path / "first", **{"train.max_steps": 12, "train.eval_every": 6, "train.log_every": 3})
    reports = Reports(tmp_path / "first")
    WorkerLoop.create(config, WorkerEnv(report=reports), Saved()).run()
    out = capsys.readouterr().out
    assert out.startswith("precision: forward pass in") and "step 12 | valid loss" in out
    assert [m["step"] for m in reports.metrics] == [6, 12] and sorted(reports.checkpoints) == [6, 12]
    assert set(torch.load(reports.checkpoints[6] / STATE_FILE, weights_only=True)) == STATE_KEYS
    state = load_train_state(reports.checkpoints[6])
    assert state.step == 6 and len(state.data_positions) == 1
    with open(tmp_path / "first" / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS and [r["step"] for r in rows] == ["3", "6", "9", "12"]
    trace = (tmp_path / "first" / "logs" / "trace-rank0.tsv").read_text().splitlines()
    assert trace[0].startswith("#start\t0\t") and trace[0].endswith("\t1")
    assert {line.split("\t")[0] for line in trace[1:]} == {str(s) for s in range(1, 13)}
    assert {line.split("\t")[1] for line in trace[1:]} == {"0", "1"}  # the run crosses an epoch's end

    # Another loop, from the step-6 checkpoint: the same pairs, dropout and weights at step 12.
    resumed = Reports(tmp_path / "second")
    saved = Saved.resume(reports.checkpoints[6], shown="checkpoint-6")
    config = dataclasses.replace(config, log_dir=str(tmp_path / "first" / "logs"))
    WorkerLoop.create(config, WorkerEnv(report=resumed), saved).run()
    assert "resuming at step 6 from checkpoint-6" in capsys.readouterr().out
    assert [m["step"] for m in resumed.metrics] == [12]
    for name, value in load_weights(reports.checkpoints[12]).items():
        torch.testing.assert_close(load_weights(resumed.checkpoints[12])[name], value, rtol=0, atol=0)
    trace = (tmp_path / "first" / "logs" / "trace-rank0.tsv").read_text().splitlines()
    restart = trace.index(next(line for line in trace[1:] if line.startswith("#start")))
    assert sorted(trace[restart + 1 :]) == sorted(line for line in trace[1:restart] if int(line.split("\t")[0]) > 6)


def test_a_fresh_run_names_its_mix_and_refuses_another_mix_on_resume(tmp_path):
    """A checkpoint of this run resumed with other corpora: the one-line data_mix error."""
    config = loop_config(tmp_path, **{"train.max_steps": 2, "train.eval_every": 2})
    reports = Reports(tmp_path)
    WorkerLoop.create(config, WorkerEnv(report=reports), Saved()).run()
    saved = Saved.resume(reports.checkpoints[2], shown="checkpoint-2")
    other_mix = {"names": ["x"], "rows": [9], "temperature": 1.0}
    tampered = Saved(saved.weights, dataclasses.replace(saved.state, data_mix=other_mix), "c")
    with pytest.raises(ValueError, match="this run reads one pair's corpus: its data positions do not carry over"):
        WorkerLoop.create(config, WorkerEnv(report=reports), tampered)


def test_a_loop_from_an_initial_checkpoint_starts_at_step_0_with_its_weights(tmp_path):
    """--init (`Saved.initial`): the checkpoint's weights at step 0 of epoch 0, a new optimizer
    and lr schedule (the checkpoint's own train state, at step 4, is not read)."""
    config = loop_config(tmp_path / "first", **{"train.max_steps": 4, "train.eval_every": 4})
    reports = Reports(tmp_path / "first")
    WorkerLoop.create(config, WorkerEnv(report=reports), Saved()).run()
    donor = reports.checkpoints[4]
    assert load_train_state(donor).step == 4
    fields = {"train.max_steps": 3, "train.eval_every": 3, "train.log_every": 1, "train.seed": 7}
    config = loop_config(tmp_path / "second", **fields)
    started = Reports(tmp_path / "second")
    loop = WorkerLoop.create(config, WorkerEnv(report=started), Saved.initial(str(donor)))
    assert (loop.trainer.step, loop.trainer.epoch, loop.feed.position.epoch) == (0, 0, 0)
    weights = loop.trainer.model.state_dict()
    assert all(torch.equal(weights[name], value) for name, value in load_weights(donor).items())
    assert not loop.trainer.optimizer.state and loop.trainer.scheduler.last_epoch == 0
    loop.run()
    assert [m["step"] for m in started.metrics] == [3] and load_train_state(started.checkpoints[3]).step == 3
    with open(tmp_path / "second" / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    optim = config.config.optim
    assert float(rows[0]["lr"]) == pytest.approx(optim.lr / optim.warmup_steps)  # the warmup's first step


@pytest.mark.hosts  # exact resume
def test_patience_stops_the_run_and_a_restart_keeps_its_count(tmp_path, monkeypatch, capsys):
    """train.patience=2: validation BLEU 5, 7, 6, 7 at steps 2, 4, 6, 8 stops the run at step 8 of
    12; a loop restarted from the step-6 checkpoint (BLEU 7 at step 4, one evaluation since) stops
    at step 8 too, with the same weights."""
    scripted = iter([5.0, 7.0, 6.0, 7.0, 7.0])
    real = ValidSets.score
    monkeypatch.setattr(ValidSets, "score", lambda self, *a, **k: {**real(self, *a, **k), "valid_bleu": next(scripted)})
    fields = {"train.max_steps": 12, "train.eval_every": 2, "train.log_every": 2, "train.patience": 2}
    config = loop_config(tmp_path / "first", **fields)
    reports = Reports(tmp_path / "first")
    WorkerLoop.create(config, WorkerEnv(report=reports), Saved()).run()
    assert [m["step"] for m in reports.metrics] == [2, 4, 6, 8]
    assert (
        "step 8: validation BLEU has not beaten 7.00 (step 4) in 2 evaluations: stopping early"
        in capsys.readouterr().out
    )
    assert load_train_state(reports.checkpoints[6]).valid_best == {"bleu": 7.0, "step": 4, "since": 1}

    resumed = Reports(tmp_path / "second")
    saved = Saved.resume(reports.checkpoints[6], shown="checkpoint-6")
    WorkerLoop.create(
        dataclasses.replace(config, log_dir=str(tmp_path / "second")), WorkerEnv(report=resumed), saved
    ).run()
    assert [m["step"] for m in resumed.metrics] == [8]
    for name, value in load_weights(reports.checkpoints[8]).items():
        torch.testing.assert_close(load_weights(resumed.checkpoints[8])[name], value, rtol=0, atol=0)
