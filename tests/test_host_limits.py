"""The host matrix's limits (run.sh HOST_LIMITS) take effect: each library reports the
instruction set it was limited to, or a narrower one where this CPU has no more.

`./run.sh test --hosts` reruns the tests marked `hosts` under each entry of HOST_LIMITS; a limit
a library ignores (a misspelt value: ATen takes `avx2`, not `AVX2`, and says nothing) would rerun
them on this host's own kernels. What each library reports:
- ATen (ATEN_CPU_CAPABILITY): `torch.backends.cpu.get_cpu_capability()`, in this process;
- oneDNN (ONEDNN_MAX_CPU_ISA): its verbose line `isa:...`, in a child running a oneDNN op;
- MKL (MKL_ENABLE_INSTRUCTIONS): its verbose version line, in a child running a matmul; on an
  AMD CPU it names no instruction set ("Intel(R) Architecture processors"): skipped there;
- CTranslate2 (CT2_FORCE_CPU_ISA): its info log's "Selected ISA", in a child loading a model.
Each check is skipped (not passed) where its variable is not set, as in the default suite.
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from tiny_checkpoint import tokenizer

from raymt.config import tiny
from raymt.model import Transformer

ROOT = Path(__file__).resolve().parents[1]
ATEN_VALUES = ("default", "avx2", "avx512")  # what ATen reads; anything else is ignored silently
CT2_VALUES = ("GENERIC", "AVX", "AVX2", "AVX512")  # CTranslate2's x86 names (src/cpu/cpu_isa.cc)


def width(isa: str) -> int:
    """How wide an instruction set named by a limit or a library's report is: 0 (no AVX: SSE,
    GENERIC, DEFAULT), 1 AVX, 2 AVX2, 3 AVX-512, 4 AMX."""
    name = isa.upper()
    marks = ((4, ("AMX",)), (3, ("AVX-512", "AVX512", "AVX10")), (2, ("AVX2",)), (1, ("AVX",)))
    return next((w for w, names in marks if any(m in name for m in names)), 0)


def child_output(code: str, **env: str) -> str:
    """stdout and stderr of a Python child running `code` with this process's environment (its
    limits) plus `env`."""
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def aten_isa(tmp_path: Path) -> Optional[str]:
    """The capability ATen dispatches to in this process (DEFAULT, AVX2, AVX512)."""
    return torch.backends.cpu.get_cpu_capability()


def onednn_isa(tmp_path: Path) -> Optional[str]:
    """The ISA oneDNN reports in a child (its verbose `isa:` line), or None without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    code = "import torch; torch.mkldnn_max_pool2d(torch.randn(1, 1, 4, 4).to_mkldnn(), [2, 2])"
    return re.search(r"^onednn_verbose,.*,isa:(.*)$", child_output(code, ONEDNN_VERBOSE="1"), re.M)[1]


def mkl_isa(tmp_path: Path) -> Optional[str]:
    """The instruction set MKL's verbose version line names in a child, or None where it names none."""
    if not torch.backends.mkl.is_available():
        return None
    line = re.search(
        r"^MKL_VERBOSE .* architecture (.*?),",
        child_output("import torch; torch.ones(64, 64) @ torch.ones(64, 64)", MKL_VERBOSE="1"),
        re.M,
    )
    return line[1] if line and "AVX" in line[1] else None  # an AMD CPU's names none


def ct2_isa(tmp_path: Path) -> Optional[str]:
    """The ISA CTranslate2 selects in a child loading a tiny model saved under tmp_path."""
    pytest.importorskip("ctranslate2")
    from raymt.exporting import ctranslate2_spec

    tok = tokenizer()
    spec = ctranslate2_spec(Transformer(tiny(), tok.vocab_size), tok)
    spec.validate()
    spec.optimize(quantization="float32")
    spec.save(str(tmp_path))
    code = (
        "import logging, ctranslate2; ctranslate2.set_log_level(logging.INFO); "
        f"ctranslate2.Translator({str(tmp_path)!r}, device='cpu', intra_threads=1)"
    )
    return re.search(r"Selected ISA: (\w+)", child_output(code))[1]


PROBES: dict[str, Callable[[Path], Optional[str]]] = {
    "ATEN_CPU_CAPABILITY": aten_isa,
    "ONEDNN_MAX_CPU_ISA": onednn_isa,
    "MKL_ENABLE_INSTRUCTIONS": mkl_isa,
    "CT2_FORCE_CPU_ISA": ct2_isa,
}


def host_limits() -> list[dict[str, str]]:
    """run.sh's HOST_LIMITS: each entry's NAME=VALUE pairs."""
    block = re.search(r"^HOST_LIMITS=\((.*?)^\)", (ROOT / "run.sh").read_text(), re.S | re.M)[1]
    return [dict(pair.split("=", 1) for pair in entry.split()) for entry in re.findall(r'"([^"]*)"', block)]


def test_every_host_limits_torch_and_ctranslate2_with_values_they_read():
    entries = host_limits()
    assert len(entries) >= 2, entries
    for limits in entries:
        assert set(limits) <= set(PROBES), f"a limit this file does not check: {limits}"
        assert limits.get("ATEN_CPU_CAPABILITY") in ATEN_VALUES, limits
        assert limits.get("CT2_FORCE_CPU_ISA") in CT2_VALUES, limits


@pytest.mark.hosts
@pytest.mark.parametrize("name", list(PROBES))
def test_the_limit_took_effect(name, tmp_path):
    limit = os.environ.get(name)
    if not limit:
        pytest.skip(f"{name} is not set (./run.sh test --hosts sets it)")
    seen = PROBES[name](tmp_path)
    if seen is None:
        pytest.skip(f"{name}={limit}: the library reports no instruction set here")
    assert width(seen) <= width(limit), f"{name}={limit}, but the library uses {seen}"


def test_width_orders_what_the_libraries_report():
    reports = ["DEFAULT", "GENERIC", "Intel SSE4.1", "Intel AVX", "AVX2", "Intel AVX2 with Intel DL Boost"]
    reports += ["Intel AVX-512 with Intel DL Boost and bfloat16 support", "AVX512_CORE_AMX"]
    assert [width(r) for r in reports] == [0, 0, 0, 1, 2, 2, 3, 4]
    assert width("avx2") == width("AVX2") and width("avx512") > width("AVX2")
