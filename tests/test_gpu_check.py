"""benchmarks/gpu_check.py --cpu --tiny: the GPU check's own code path runs green on CPU, so it cannot rot."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.timeout(1500)
def test_tiny_gpu_check_on_cpu(tmp_path, ray_address):
    out = tmp_path / "check"
    # Parts have their own timeouts; a busy shared machine gets 3x of them.
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--tiny", "--out", str(out), "--timeout-scale", "3"],
                         capture_output=True, text=True, timeout=1450, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]

    expected = ["run", "resume", "evaluate", "ray vs plain", "eager vs compiled", "matmul", "mfu"]
    if importlib.util.find_spec("transformers") is not None:
        expected += ["raymt vs hf marian 12k", "raymt vs hf marian 32k"]
    table = run.stdout[run.stdout.index("\npart "):]
    for name in expected:
        assert name in parts, name
        assert "error" not in parts[name], (name, parts[name])
        assert any(line.startswith(name) and " error " not in line and "FAILED" not in line
                   for line in table.splitlines()), name

    assert parts["run"]["test_bleu"] is not None and parts["run"]["steps"] == 40
    resume = parts["resume"]
    # A worker was killed after the first checkpoint; the new group started from it and went on.
    assert resume["killed"]["after_checkpoints"] >= 1
    assert 0 < resume["resumed_at"] < resume["last_step"] == 30
    assert parts["evaluate"]["sentences"] == 60
    assert parts["ray vs plain"]["ratio"] > 0 and parts["matmul"]["flops_per_s"] > 0
    assert 0 < parts["mfu"]["plain loop"] < 1
