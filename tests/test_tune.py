"""`python -m raymt.tune`: search-space errors, a sweep end to end; slow: a sweep resumed, PBT."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raymt.tune import parse_space

pytestmark = pytest.mark.timeout(600)

TINY_TRIAL = ["--preset", "tiny", "--num-workers", "1", "--max-steps", "20",
              "--set", "train.eval_every=10", "--set", "train.log_every=10",
              "--set", "data.vocab_size=256", "--set", "data.builtin_train_size=600",
              "--set", "data.builtin_eval_size=30", "--set", "data.max_tokens=512"]


@pytest.mark.parametrize("search, grid, message", [
    (["optim.lr=loguniform:1e-4"], [], "expected two numbers LOW:HIGH"),
    (["optim.lr=loguniform:3e-3:1e-4"], [], "LOW must be below HIGH"),
    (["optim.lr=gauss:1:2"], [], "unknown distribution 'gauss'"),
    (["optim.lr"], [], "must look like section.field=DIST:ARGS"),
    (["optim.lrate=uniform:0:1"], [], "unknown config field 'optim.lrate'"),
    ([], ["model.dropout=0.1,2.0"], r"model.dropout=2.0 must be in \[0, 1\)"),
    ([], ["train.max_steps=ten"], "'ten' is not a valid int"),
    ([], ["data.vocab_size=4000,8000"], "prepares its corpus once"),  # it would be ignored
    (["data.max_ratio=uniform:1.5:3"], [], "prepares its corpus once"),
])
def test_bad_search_spaces_are_one_clear_error(search, grid, message):
    with pytest.raises(ValueError, match=message):
        parse_space(search, grid)


def tune_cli(*args, timeout=400, **kw):
    return subprocess.run([sys.executable, "-m", "raymt.tune", *args], capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_impossible_resources_fail_before_any_trial(tmp_path, ray_cluster, err_lines):
    from raymt.tune import main

    assert main(["--num-workers", "8", "--storage-path", str(tmp_path)]) == 2
    assert err_lines()[-1].startswith("raymt.tune: error: --num-workers 8 x")
    assert not any(tmp_path.iterdir())


def trial_runs(sweep: Path) -> dict[str, list[dict]]:
    """Train runs per Tune trial id, from each run's summary.json."""
    runs: dict[str, list[dict]] = {}
    for summary in sorted((sweep / "trials").glob("*/summary.json")):
        trial_id = summary.parent.name.rsplit("-", 1)[0]
        runs.setdefault(trial_id, []).append(json.loads(summary.read_text()))
    return runs


def test_a_one_trial_sweep_end_to_end(tmp_path, ray_address):
    """`python -m raymt.tune` end to end on one trial (the notebook runs two at once through
    `run_sweep`; the slow test below, two in turn, interrupted and resumed)."""
    out = tune_cli(*TINY_TRIAL, "--grid", "optim.lr=1e-2", "--scheduler", "fifo",
                   "--storage-path", str(tmp_path), "--sweep-name", "s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = trial_runs(tmp_path / "s")
    assert len(runs) == 1 and all(len(r) == 1 and "valid_bleu" in r[0]["valid"] for r in runs.values()), runs
    result = json.loads((tmp_path / "s" / "results.json").read_text())
    assert [(r["status"], r["optim.lr"]) for r in result["table"]] == [("completed", 1e-2)]
    assert (Path(result["best"]["checkpoint"]) / "model.pt").is_file()
    assert "best checkpoint:" in out.stdout


@pytest.mark.slow  # ~1 min: three Train runs one after another (CI runs it: .ci/run)
@pytest.mark.ci
def test_two_trial_sweep_then_interrupt_and_resume(tmp_path, ray_address):
    sweep = tmp_path / "s"
    # One trial at a time: the first has finished and the second not when the sweep is stopped.
    args = [*TINY_TRIAL, "--grid", "optim.lr=1e-3,1e-2", "--scheduler", "fifo", "--max-concurrent", "1",
            "--storage-path", str(tmp_path), "--sweep-name", "s"]
    proc = subprocess.Popen([sys.executable, "-m", "raymt.tune", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((sweep / "trials").exists() and trial_runs(sweep)):
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(1)
    proc.send_signal(signal.SIGINT)  # Tune saves its state and stops
    proc.wait(timeout=120)
    finished = {t: len(r) for t, r in trial_runs(sweep).items()}
    assert len(finished) == 1

    out = tune_cli("--resume-sweep", str(sweep), *TINY_TRIAL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = trial_runs(sweep)
    assert len(runs) == 2
    for trial, count in finished.items():
        assert len(runs[trial]) == count  # the finished trial was not rerun
    result = json.loads((sweep / "results.json").read_text())
    assert [r["status"] for r in result["table"]] == ["completed"] * 2
    bleus = [r["valid_bleu"] for r in result["table"]]
    assert bleus == sorted(bleus, reverse=True)
    assert (Path(result["best"]["checkpoint"]) / "model.pt").is_file()
    assert "best checkpoint:" in out.stdout


@pytest.mark.slow  # ~2.5 min: every exploit restarts Train runs
def test_pbt_trial_continues_from_another_trials_checkpoint(tmp_path):
    out = tune_cli(*TINY_TRIAL, "--max-steps", "40", "--grid", "optim.lr=1e-4,1e-2",
                   "--scheduler", "pbt", "--max-concurrent", "2", "--set", "train.cpus_per_worker=0.5",
                   "--storage-path", str(tmp_path), "--sweep-name", "pbt")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = trial_runs(tmp_path / "pbt")
    continued = [r for rs in runs.values() for r in rs if r.get("init_checkpoint")]
    assert continued, "no trial was restarted from a checkpoint"
    for run in continued:
        donor = Path(run["init_checkpoint"])
        own = Path(run["run_dir"]).name.rsplit("-", 1)[0]
        assert own not in str(donor)  # it came from another trial
        # It kept the donor's step (and optimizer and weights): a fresh run logs step 10 first.
        assert run["start_step"] > 10


def test_a_sweep_with_failed_trials_exits_1(capsys):
    from raymt.tune import exit_status

    assert exit_status([{"status": "completed"}, {"status": "stopped early"}]) == 0
    assert capsys.readouterr().err == ""
    assert exit_status([{"status": "completed"}, {"status": "error"}, {"status": "error"}]) == 1
    assert capsys.readouterr().err.strip() == ("raymt.tune: error: 2 of 3 trials failed; their error "
                                               "files are listed in Tune's table above")


@pytest.mark.slow  # PBT's case (the PBT test is slow too)
@pytest.mark.ci
def test_a_trial_continuing_at_its_last_step_ends_with_a_checkpoint(ray_cluster, tmp_path):
    """PBT may hand a trial a donor checkpoint at max_steps: it reports it instead of failing."""
    import torch

    from raymt.checkpoint import load_train_state, save_checkpoint
    from raymt.config import Config, DataConfig, TrainConfig, tiny
    from raymt.model import Transformer
    from raymt.optim import inverse_sqrt, make_optimizer
    from raymt.train import run
    from tiny_checkpoint import tokenizer

    cfg = Config(model=tiny(), data=DataConfig(vocab_size=256, builtin_train_size=200,
                                              builtin_eval_size=8),
                 train=TrainConfig(num_workers=1, max_steps=20, eval_every=10, cpus_per_worker=0.5,
                                   storage_path=str(tmp_path), name="continued"))
    model = Transformer(cfg.model, tokenizer(256).vocab_size)
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = inverse_sqrt(optimizer, cfg.optim.warmup_steps)
    for _ in range(20):  # no gradients: the optimizer leaves the weights alone
        optimizer.step()
        scheduler.step()
    donor = save_checkpoint(tmp_path / "donor", model, cfg, tokenizer(256), {
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "step": 20, "epoch": 0})
    summary = run(cfg, init_checkpoint=donor, score_test=False, init_full_state=True)
    assert load_train_state(summary["best_checkpoint"])["step"] == 20
    assert set(summary["valid"]) >= {"valid_loss", "valid_bleu"}
    torch.testing.assert_close(torch.load(Path(summary["best_checkpoint"]) / "model.pt",
                                          weights_only=True), model.state_dict())


def test_janitor_removes_groups_whose_cpus_nobody_uses(ray_cluster):
    """A left-behind group is removed even if a zero-CPU actor still lives in it; a used one stays."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raymt.tune import janitor

    @ray.remote
    class Idle:
        def ping(self):
            return 1

    left, busy = (placement_group([{"CPU": 0.5}]) for _ in range(2))
    ray.get([left.ready(), busy.ready()])
    in_group = lambda pg: PlacementGroupSchedulingStrategy(placement_group=pg)
    lodger = Idle.options(num_cpus=0, scheduling_strategy=in_group(left)).remote()
    worker = Idle.options(num_cpus=0.5, scheduling_strategy=in_group(busy)).remote()
    ray.get([lodger.ping.remote(), worker.ping.remote()])
    cleaner = janitor()
    cleaner.grace_s = 0.0
    cleaner.sweep(now=0.0)  # both seen; the unused one marked idle
    cleaner.sweep(now=1.0)
    state = lambda pg: placement_group_table(pg)["state"]
    assert state(left) == "REMOVED" and state(busy) == "CREATED"
    ray.kill(worker)
    ray.util.remove_placement_group(busy)
