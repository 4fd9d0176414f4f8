"""benchmarks/gpu_check.py: its CPU form (`--cpu --tiny`) runs green with the table's shape, so
it cannot rot; its caps fit one GPU session; its GPU-only figures from fakes."""

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402

NUMBER = r"-?[\d,]+(\.\d+)?"
PERCENT = r"\d+\.\d%"


def table(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The printed Markdown table: (row, run) -> its cells by column name."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["row", "run", "value", "peak", "matmul"], header
    cells = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    return {(c["row"], c["run"]): c for c in cells}


def test_part_caps_fit_one_gpu_session():
    # The device tool lends 15 minutes a session; the check must fit 8 of them by construction.
    assert gpu_check.TOTAL_S == 480
    assert sum(gpu_check.FULL.caps.values()) <= gpu_check.TOTAL_S
    assert "start-up" in gpu_check.FULL.caps
    # The matmul comes first, so that a run cut short still has an MFU denominator.
    assert list(gpu_check.FULL.caps)[:3] == ["start-up", "prepare", "matmul"]


def test_gpu_runs_get_the_gpu_defaults(tmp_path):
    """The ray, compiled and plain parts train what `python -m raymt.train --gpu` would on one
    GPU: only the run's length, logging, time bound and name are the check's own."""
    from raymt.flags import build_config
    from raymt.train import parse_args

    args = gpu_check.parse_args(["--out", str(tmp_path), "--work", str(tmp_path), "--corpus", str(tmp_path)])
    sizes = gpu_check.FULL
    user = build_config(
        parse_args(
            [
                "--gpu",
                "--num-workers",
                "1",
                "--preset",
                sizes.preset,
                "--max-steps",
                str(sizes.steps),
                "--corpus",
                str(tmp_path),
            ]
        )
    )  # a one-GPU user
    for extra in ([], ["--set", "train.compile=true"]):
        flags = gpu_check.train_flags(args, sizes, "ray", sizes.steps, *gpu_check.speed_flags(sizes, 1.0), *extra)
        cfg = gpu_check.train_config(gpu_check.parse_args(["--part", "train", "--", *flags]))
        assert cfg.train.use_gpu and cfg.train.num_workers == 1 and cfg.train.compile == bool(extra)
        assert (cfg.data, cfg.optim, cfg.model, cfg.decode) == (user.data, user.optim, user.model, user.decode)
        assert (cfg.train.max_steps, cfg.train.eval_every, cfg.train.log_every) == (200, 200, 25)


@pytest.mark.parametrize(
    "name, card, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "A100", "bf16", 312.0),
        ("NVIDIA A10G", "A10G", "bf16", 70.0),  # not an A100
        ("NVIDIA L4", "L4", "bf16", 121.0),  # not an L40S
        ("NVIDIA L40S", "L40S", "bf16", 362.0),
        ("Tesla V100-SXM2-16GB", "V100 SXM2", "fp16", 125.0),
        ("Tesla T4", "T4", "fp16", 65.0),
    ],
)
def test_card_peaks_match_device_names(name, card, dtype, tflops):
    assert gpu_check.card_peak(name) == (card, dtype, tflops)


@pytest.mark.parametrize(
    "name, capability, dtype, peak",
    [("NVIDIA H200", (9, 0), "bf16", 989.0), ("Tesla V100-SXM2-16GB", (7, 0), "fp16", 125.0)],
)
def test_matmul_part_on_a_fake_gpu(tmp_path, monkeypatch, name, capability, dtype, peak):
    """The GPU branch of the first part (a mistake there would cost a lent GPU's session)."""
    import torch

    from benchmarks import speed

    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0))
    monkeypatch.setattr(speed, "matmul_flops", lambda *a: calls.append(a) or 7e14)
    args = gpu_check.parse_args(["--part", "matmul", "--out", str(tmp_path)])
    assert gpu_check.part_matmul(args, gpu_check.FULL) == 0
    result = json.loads((tmp_path / "matmul.json").read_text())
    assert calls == [("cuda", {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], gpu_check.FULL.matmul_n)]
    assert (result["gpu"], result["peak_tflops"], result["dtype"], result["matmul_tflops"]) == (
        name,
        peak,
        dtype,
        700.0,
    )
    assert result["capability"] == "sm_%d%d" % capability


def test_unknown_card_has_no_peak_and_says_so():
    assert gpu_check.card_peak("NVIDIA GeForce RTX 4090") is None
    parts = {
        "matmul": {
            "gpu": "NVIDIA GeForce RTX 4090",
            "card": None,
            "peak_tflops": None,
            "dtype": "bf16",
            "matmul_tflops": 150.0,
            "n": 8192,
        },
        "ray": {"tokens_per_s": 1e5, "flops_per_token": 3e8},
    }
    rows = gpu_check.table_rows(parts, cpu=False)
    cells = {(r[0], r[1]): r for r in rows}
    assert cells[("gpu", "-")][3] == "n/a (unknown card)"
    assert cells[("mfu", "ray")][3:] == ("n/a", "20.0%")  # 3e13 / 150e12


def test_a_run_with_other_padding_keeps_its_own_flops():
    """On a CPU the compiled run pads to the shape ladder: the plain run's FLOPs are not its FLOPs."""
    parts = {
        "matmul": {"gpu": "cpu", "card": None, "peak_tflops": None, "dtype": "fp32", "matmul_tflops": 1.0, "n": 512},
        "ray": {"tokens_per_s": 1e6, "flops_per_token": 4.0e5, "pad_multiple": 1},
        "plain": {"tokens_per_s": 1e6, "flops_per_token": 4.2e5},
        "compiled": {"tokens_per_s": 1e6, "flops_per_token": 5.1e5, "pad_multiple": 8},
    }
    cells = {(r[0], r[1]): r for r in gpu_check.table_rows(parts, cpu=True)}
    assert cells[("mfu", "ray")][4] == "42.0%" and cells[("mfu", "compiled")][4] == "51.0%"  # of 1 TFLOP/s


def test_gpu_table_from_fake_parts():
    """The figures a GPU run would give, as the table shows them."""
    parts = {
        "matmul": {
            "gpu": "NVIDIA H200",
            "capability": "sm_90",
            "card": "H200",
            "peak_tflops": 989.0,
            "dtype": "bf16",
            "matmul_tflops": 700.0,
            "n": 8192,
        },
        "ray": {"tokens_per_s": 1.0e6, "flops_per_token": 4e8, "data_share": 0.0123, "peak_gpu_mb": None},
        "plain": {"tokens_per_s": 1.25e6, "flops_per_token": 4e8, "peak_gpu_mb": 40960.0, "syncs_per_step": 0.04},
        "compiled": {"error": "timed out after 120 s"},
    }
    text = gpu_check.markdown(gpu_check.table_rows(parts, cpu=False))
    t = table(text)
    assert t[("mfu", "ray")]["peak"] == "40.4%" and t[("mfu", "ray")]["matmul"] == "57.1%"
    assert t[("mfu", "plain")]["peak"] == "50.6%" and t[("mfu", "plain")]["matmul"] == "71.4%"
    assert t[("mfu", "compiled")]["peak"] == "n/a"
    assert t[("tgt tok/s", "compiled")]["value"] == "error: timed out after 120 s"
    assert t[("goal", "-")]["value"] == "met: best MFU through Ray Train 40.4% of peak (goal 40%)"
    assert t[("ray/plain", "ray")]["value"] == "0.800"
    assert t[("data_share", "ray")]["value"] == "0.012"
    assert t[("peak GPU MiB", "plain")]["value"] == "40,960"
    assert t[("peak GPU MiB", "ray")]["value"] == "n/a (not logged)"
    assert t[("syncs/step", "plain")]["value"] == "0.040"
    assert t[("matmul", "-")]["peak"].startswith("989 TFLOP/s bf16")
    assert t[("resume", "resume")]["value"] == "not run (yet)"


def test_run_figures_from_metrics_csv(tmp_path):
    """tok/s leaves out the warm-up interval and weighs the others by time; the run's last data_share;
    peak GPU memory when the worker logs it."""
    logged = tmp_path / "metrics.csv"
    logged.write_text(
        "step,tokens_per_s,valid_bleu,data_share,peak_gpu_mb\n25,10,,0.5,100\n50,200,,0.1,300\n100,100,1.5,0.05,310\n"
    )
    figures = gpu_check.metrics_figures(str(logged))
    # 25 steps at 200 tok/s and 50 at 100 (about as many tokens a step): 75 steps in 0.625 "s".
    assert figures == {"tokens_per_s": pytest.approx(120.0), "steps": 75, "data_share": 0.05, "peak_gpu_mb": 310.0}
    logged.write_text("step,tokens_per_s,data_share\n25,10,0.5\n50,200,0.1\n")
    assert gpu_check.metrics_figures(str(logged))["peak_gpu_mb"] is None
    logged.write_text("step,tokens_per_s,data_share\n25,10,0.5\n")
    assert "error" in gpu_check.metrics_figures(str(logged))


def test_syncs_counted_once_each(monkeypatch):
    """Every synchronization counts, the same warning from the same line included."""
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def three_syncs():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)

    assert gpu_check.count_syncs(three_syncs) == 3
    assert modes == ["warn", "default"]


@pytest.mark.timeout(1500)
def test_tiny_gpu_check_on_cpu(tmp_path, ray_address):
    out = tmp_path / "check"
    # Parts have their own caps; a busy shared machine gets 3x of them.
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--tiny", "--out", str(out), "--timeout-scale", "3"],
        capture_output=True,
        text=True,
        timeout=1450,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    t = table(run.stdout)
    for name in ("ray", "plain"):
        assert re.fullmatch(NUMBER, t[("tgt tok/s", name)]["value"]), t[("tgt tok/s", name)]
        mfu = t[("mfu", name)]
        assert mfu["peak"] == "n/a" and re.fullmatch(PERCENT, mfu["matmul"]), mfu  # CPU: no datasheet
    assert t[("tgt tok/s", "compiled")]["value"].startswith("skipped")
    assert re.fullmatch(r"\d+\.\d{3}", t[("ray/plain", "ray")]["value"]), t[("ray/plain", "ray")]
    assert re.fullmatch(r"\d\.\d{3}", t[("data_share", "ray")]["value"]), t[("data_share", "ray")]
    assert t[("syncs/step", "plain")]["value"] == "n/a (CPU)"
    assert t[("goal", "-")]["value"] == "n/a (CPU)"
    assert re.match(r"[\d,]+\.\d [GT]FLOP/s", t[("matmul", "-")]["matmul"]), t[("matmul", "-")]
    assert t[("resume", "resume")]["value"].startswith("ok:"), t[("resume", "resume")]
    assert t[("evaluate", "evaluate")]["value"].startswith("ok:"), t[("evaluate", "evaluate")]

    results = json.loads((out / "gpu_check.json").read_text())
    parts = results["parts"]
    assert results["table"] == [list(r) for r in gpu_check.table_rows(parts, cpu=True)]
    assert parts["ray"]["steps"] == gpu_check.TINY.steps - gpu_check.TINY.log_every
    assert parts["plain"]["steps"] == parts["ray"]["steps"]  # the same batches after the same warm-up
    # The same model on the same batches: the same losses at every progress line.
    ray_loss, plain_loss = (
        dict(re.findall(r"step (\d+)/\d+ \| epoch \d+ \| loss ([\d.]+)", (out / f"{name}.log").read_text()))
        for name in ("ray", "plain")
    )
    steps = [str(s) for s in range(gpu_check.TINY.log_every, gpu_check.TINY.steps + 1, gpu_check.TINY.log_every)]
    for step in steps:
        assert float(ray_loss[step]) == pytest.approx(float(plain_loss[step]), abs=0.01), (step, ray_loss, plain_loss)
    resume = parts["resume"]
    # A worker was killed after the first checkpoint; the new group started from it and went on.
    assert resume["killed"]["after_checkpoints"] >= 1
    assert 0 < resume["resumed_at"] < resume["last_step"] == gpu_check.TINY.resume_steps
    assert parts["evaluate"]["sentences"] == 60
