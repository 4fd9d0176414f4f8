"""README and docs/ name only what exists: files, Python names and config fields."""

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from raymt.config import Config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w/.])((?:raymt|benchmarks|tests|recipes|notebooks|docs)/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w.])(raymt(?:\.[a-z_]\w*)+)(?![\w.])")  # not `raymt.COMMAND`
FIELD = re.compile(r"^(data|model|optim|train|decode)\.(\w+)(?:=.*)?$")
FILE = re.compile(r"\.(pt|bin|json|model|py|toml|csv|png|md|parquet)$")  # `model.pt` is a file


def spans(page: Path) -> list[str]:
    """The `code` spans of a Markdown page (fenced blocks included, line by line)."""
    return CODE.findall(page.read_text())


def resolves(dotted: str) -> bool:
    """Whether `raymt.a.b` is a module, or an attribute of the longest importable module."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def profiler_label(dotted: str) -> bool:
    """Whether the name is a label the code gives a profiled region (e.g. `raymt.forward`)."""
    return any(f'"{dotted}"' in p.read_text() for p in (ROOT / "raymt").rglob("*.py"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_name_and_field_exists(page):
    fields = {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(Config)
        for f in dataclasses.fields(s.type if isinstance(s.type, type) else getattr(Config(), s.name))
    }
    missing = []
    for span in spans(page):
        missing += [p for p in PATH.findall(span) if not (ROOT / p).exists() and "<" not in p]
        missing += [d for d in DOTTED.findall(span) if not (resolves(d) or profiler_label(d))]
        m = FIELD.match(span.strip())
        if m and not FILE.search(span.strip()) and f"{m[1]}.{m[2]}" not in fields:
            missing.append(span)
    assert not missing, f"{page.name} names what does not exist: {sorted(set(missing))}"


def test_readme_is_a_front_door():
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024


def test_the_module_map_has_a_row_for_every_module():
    """docs/architecture.md's module map names every module of raymt/ (a package by its
    directory's row), and no row names a module that is gone (issue 56)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `(raymt/[\w/]+(?:\.py|/))`", page, re.M))
    modules = {
        p.relative_to(ROOT).as_posix() if p.name != "__init__.py" else p.parent.relative_to(ROOT).as_posix() + "/"
        for p in (ROOT / "raymt").rglob("*.py")
    }
    modules -= {"raymt/", "raymt/data/", "raymt/serve/"}  # packages whose modules have rows of their own
    assert sorted(modules - rows) == [] and sorted(rows - modules) == []
