"""Model, decoding and tokenizer code is plain PyTorch: no Ray, no torch.distributed."""

import ast
import subprocess
import sys
from pathlib import Path

import raymt

PLAIN = ["model", "decoding", "tokenizer", "batching", "checkpoint", "config", "optim", "corpus", "metrics",
         "export", "average", "profiling", "plot"]


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_plain_modules_import_neither_ray_nor_torch_distributed():
    pkg = Path(raymt.__file__).parent
    for module in PLAIN:
        for name in imported_names(pkg / f"{module}.py"):
            assert not (name == "ray" or name.startswith("ray.")), f"{module}.py imports {name}"
            assert "torch.distributed" not in name, f"{module}.py imports {name}"
            if name.startswith("raymt."):
                assert name.split(".")[1] in PLAIN, f"{module}.py imports {name}"


def test_translating_loads_no_ray():
    code = ("import sys, raymt.translate, raymt.model, raymt.decoding, raymt.tokenizer;"
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
