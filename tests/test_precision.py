"""train.bf16: autocast where the hardware has bf16 units, fp32 elsewhere."""

import contextlib
import re
from pathlib import Path

import torch

from raymt import trainer
from raymt.trainer import autocast_for, native_bf16


def test_cpu_bf16_follows_the_cpu_flags():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None
    assert native_bf16(torch.device("cpu")) == expected


def test_autocast_only_where_asked_and_native(monkeypatch):
    cpu = torch.device("cpu")
    assert autocast_for(cpu, bf16=False) is contextlib.nullcontext
    monkeypatch.setattr(trainer, "native_bf16", lambda device: False)
    assert autocast_for(cpu, bf16=True) is contextlib.nullcontext
    monkeypatch.setattr(trainer, "native_bf16", lambda device: True)
    layer = torch.nn.Linear(8, 8)
    with autocast_for(cpu, bf16=True)():
        assert layer(torch.randn(2, 8)).dtype == torch.bfloat16
    assert layer(torch.randn(2, 8)).dtype == torch.float32
