"""benchmarks/gpu_check.py, run as its users run it: its CPU form (`--cpu --tiny`) runs green with
the table's shape, so it cannot rot; `--plan` shows caps that fit one GPU session and runs with the
GPU defaults; `--report` makes the table of GPU-only figures from fake parts. The figures it takes
from raymt.profiling (card peaks, matmul, MFU, syncs, metrics.csv rates) are tested in test_profiling.py."""

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

NUMBER = r"-?[\d,]+(\.\d+)?"
PERCENT = r"\d+\.\d%"


def gpu_check(*flags: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """benchmarks/gpu_check.py FLAGS in a process of its own; it must exit 0."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def rows(stdout: str) -> list[list[str]]:
    """The printed Markdown table's rows below its header and separator line, each a list of cells."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert lines[1] == "|---|---|---|---|---|", lines[:2]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["row", "run", "value", "peak", "matmul"], header
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def table(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The printed Markdown table: (row, run) -> its cells by column name."""
    cells = [dict(zip(["row", "run", "value", "peak", "matmul"], row)) for row in rows(stdout)]
    return {(c["row"], c["run"]): c for c in cells}


def report(directory: Path, parts: dict, device: str) -> dict[tuple[str, str], dict[str, str]]:
    """The table `--report` prints of a gpu_check.json holding `parts`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gpu_check.json").write_text(json.dumps({"device": device, "parts": parts}))
    return table(gpu_check("--report", str(directory)).stdout)


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> dict:
    """What the GPU check would run (`--plan`), with every path in an empty directory."""
    where = str(tmp_path_factory.mktemp("plan").resolve())
    return json.loads(gpu_check("--plan", "--out", where, "--work", where, "--corpus", where).stdout)


def test_part_caps_fit_one_gpu_session(plan):
    # The device tool lends 15 minutes a session; the check must fit 8 of them by construction.
    caps = plan["sizes"]["caps"]
    assert plan["total_s"] == 480
    assert sum(caps.values()) <= plan["total_s"]
    assert "start-up" in caps
    # The matmul comes first, so that a run cut short still has an MFU denominator.
    assert list(caps)[:3] == ["start-up", "prepare", "matmul"]


def test_gpu_runs_get_the_gpu_defaults(plan):
    """The ray, compiled and plain parts train what `python -m raymt.train --gpu` would on one
    GPU: only the run's length, logging, time bound and name are the check's own."""
    from raymt.flags import build_config
    from raymt.train import parse_args

    sizes, corpus = plan["sizes"], plan["configs"]["ray"]["data"]["corpus"]
    user = build_config(
        parse_args(
            [
                "--gpu",
                "--num-workers",
                "1",
                "--preset",
                sizes["preset"],
                "--max-steps",
                str(sizes["steps"]),
                "--corpus",
                corpus,
            ]
        )
    )  # a one-GPU user
    sections = ("data", "optim", "model", "decode")
    expected = json.loads(json.dumps({s: asdict(getattr(user, s)) for s in sections}, default=str))
    for name, compiled in (("ray", False), ("compiled", True), ("plain", False)):
        cfg = plan["configs"][name]  # what the part's process builds from its command line
        train = cfg["train"]
        assert train["use_gpu"] and train["num_workers"] == 1 and train["compile"] == compiled, name
        assert {s: cfg[s] for s in sections} == expected, name
        assert (train["max_steps"], train["eval_every"], train["log_every"]) == (200, 200, 25)
        assert plan["commands"][name][2:4] == ["--part", "plain" if name == "plain" else "train"]


def test_unknown_card_has_no_peak_and_says_so(tmp_path):
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
    t = report(tmp_path, parts, "cuda")
    assert t[("gpu", "-")]["peak"] == "n/a (unknown card)"
    assert (t[("mfu", "ray")]["peak"], t[("mfu", "ray")]["matmul"]) == ("n/a", "20.0%")  # 3e13 / 150e12


def test_a_run_with_other_padding_keeps_its_own_flops(tmp_path):
    """On a CPU the compiled run pads to the shape ladder: the plain run's FLOPs are not its FLOPs."""
    parts = {
        "matmul": {"gpu": "cpu", "card": None, "peak_tflops": None, "dtype": "fp32", "matmul_tflops": 1.0, "n": 512},
        "ray": {"tokens_per_s": 1e6, "flops_per_token": 4.0e5, "pad_multiple": 1},
        "plain": {"tokens_per_s": 1e6, "flops_per_token": 4.2e5},
        "compiled": {"tokens_per_s": 1e6, "flops_per_token": 5.1e5, "pad_multiple": 8},
    }
    t = report(tmp_path, parts, "cpu")
    assert t[("mfu", "ray")]["matmul"] == "42.0%" and t[("mfu", "compiled")]["matmul"] == "51.0%"  # of 1 TFLOP/s


def test_gpu_table_from_fake_parts(tmp_path):
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
    t = report(tmp_path, parts, "cuda")
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


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "resume",
    [
        pytest.param(False, id="without-resume"),  # the default suite's form (~35 s)
        # ~30 s more: a worker killed and its group restarted (CI runs it: .ci/run)
        pytest.param(True, id="whole", marks=[pytest.mark.slow, pytest.mark.ci]),
    ],
)
def test_tiny_gpu_check_on_cpu(resume, tmp_path, ray_address):
    out = tmp_path / "check"
    # Parts have their own caps; a busy shared machine gets 3x of them.
    flags = ["--cpu", "--tiny", "--out", str(out), "--timeout-scale", "3", *([] if resume else ["--skip-resume"])]
    run = gpu_check(*flags, cwd=tmp_path, timeout=1450)
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
    expected = "ok:" if resume else "skipped (--skip-resume)"
    assert t[("resume", "resume")]["value"].startswith(expected), t[("resume", "resume")]
    assert t[("evaluate", "evaluate")]["value"].startswith("ok:"), t[("evaluate", "evaluate")]

    results = json.loads((out / "gpu_check.json").read_text())
    parts, sizes = results["parts"], results["sizes"]  # the tiny sizes
    # The saved table is the one its saved parts make, and the one printed at the end.
    saved = [[cell.replace("|", "/").strip() for cell in row] for row in results["table"]]
    assert rows(gpu_check("--report", str(out)).stdout) == saved == rows(run.stdout)
    assert parts["matmul"]["n"] == sizes["matmul_n"]
    assert parts["ray"]["steps"] == sizes["steps"] - sizes["log_every"]
    assert parts["plain"]["steps"] == parts["ray"]["steps"]  # the same batches after the same warm-up
    # The same model on the same batches: the same losses at every progress line.
    ray_loss, plain_loss = (
        dict(re.findall(r"step (\d+)/\d+ \| epoch \d+ \| loss ([\d.]+)", (out / f"{name}.log").read_text()))
        for name in ("ray", "plain")
    )
    steps = [str(s) for s in range(sizes["log_every"], sizes["steps"] + 1, sizes["log_every"])]
    for step in steps:
        assert float(ray_loss[step]) == pytest.approx(float(plain_loss[step]), abs=0.01), (step, ray_loss, plain_loss)
    if resume:  # a worker was killed after the first checkpoint; the new group started from it and went on
        killed = parts["resume"]
        assert killed["killed"]["after_checkpoints"] >= 1
        assert 0 < killed["resumed_at"] < killed["last_step"] == sizes["resume_steps"]
    assert parts["evaluate"]["sentences"] == 60
