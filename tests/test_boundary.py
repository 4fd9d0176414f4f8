"""Model, decoding, tokenizer and data-reader code is plain PyTorch: no Ray, no torch.distributed
at module level (a function may import Ray Data, as raymt.data.stream's reader does)."""

import ast
import subprocess
import sys
from pathlib import Path

import raymt

PLAIN = [
    "model",
    "decoding",
    "ensemble",
    "tokenizer",
    "langid",
    "batching",
    "checkpoint",
    "command",
    "config",
    "config.corpus",
    "config.sections",
    "config.commands",
    "config.presets",
    "config.overrides",
    "config.schedule",
    "optim",
    "metrics",
    "export",
    "exporting",
    "argos",
    "average",
    "hf_import",
    "hf_model",
    "hf_marian",
    "hf_m2m",
    "provenance",
    "profiling",
    "storage",
    "data",
    "data.builtin",
    "data.text",
    "data.mono",
    "data.sources",
    "data.clean",
    "data.shards",
    "data.staging",
    "data.layout",
    "data.format",
    "data.epoch",
    "data.stream",
    "trainer",
    "worker_env",
    "worker_state",
    "worker_data",
    "worker_logs",
    "plot",
    "curves",
    "data.mixing",
    "tags",
    "precision",
    "errors",
    "engines",
    "bt_job",
    "shard_job",
    "data.scores",
    "flags",
    "rundir",
    "rundata",
    "compare",
    "sweep_report",
    "config.serve",
    "serve.text",
    "serve.batcher",
    "serve.api",
    "serve.page",
    "serve.routing",
    "autoscale",
    "cluster",
    "shared_dir",
    "ray_console",
]


def module_path(module: str) -> Path:
    """raymt/<a>/<b>.py of "a.b"; a package's __init__.py."""
    path = Path(raymt.__file__).parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def module_level(node: ast.AST):
    """The nodes of a module outside function bodies (where imports run at import time)."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from module_level(child)


def imported_names(path: Path) -> set[str]:
    """Modules imported when the module is imported (function bodies are not searched)."""
    names = set()
    for node in module_level(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_plain_modules_import_neither_ray_nor_torch_distributed():
    for module in PLAIN:
        for name in imported_names(module_path(module)):
            assert not (name == "ray" or name.startswith("ray.")), f"{module}.py imports {name}"
            assert "torch.distributed" not in name, f"{module}.py imports {name}"
            if name.startswith("raymt."):
                inside = name.split(".", 1)[1]
                assert any(inside == m or inside.startswith(m + ".") for m in PLAIN), f"{module}.py imports {name}"


def test_translating_loads_no_ray():
    code = (
        "import sys, raymt.translate, raymt.model, raymt.decoding, raymt.tokenizer, raymt.batching,"
        "raymt.data.text, raymt.data.format, raymt.data.stream;"
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
