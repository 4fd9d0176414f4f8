"""raymt.command, the command layer: flags from a config's fields and back (`to_argv`), groups,
repeated and positional flags, converters, and a user error as one line."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from raymt.command import command_line, flag, group, main_of, options, parse, to_argv
from raymt.errors import check


@dataclass
class Inner:
    beam: int = flag(5, "beam size")
    sample: bool = flag(False, "sample")
    seed: Optional[int] = flag(None, "seed")
    hidden: int = 3  # no flag

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Sampling implies beam 1."""
        return {**values, "beam": 1} if values.get("sample") else values

    def __post_init__(self) -> None:
        check(self.beam >= 1, f"--beam {self.beam} must be >= 1")


def pairs(raw: list[str]) -> dict[str, str]:
    """NAME=CKPT flags into a dict."""
    return dict(item.split("=", 1) for item in raw)


@dataclass
class Demo:
    inputs: list[str] = flag(help="inputs", positional=True, repeat=True)
    checkpoint: tuple[str, ...] = flag(help="repeat: an ensemble", repeat=True, required=True)
    models: dict[str, str] = flag(
        default_factory=dict,
        name="--model",
        repeat=True,
        parse=pairs,
        render=lambda d: [f"{k}={v}" for k, v in d.items()],
    )
    timeout_s: float = flag(2.5, "seconds", name="--timeout")
    cache: bool = flag(True, "keep a cache")
    engine: str = flag("auto", "engine", choices=("auto", "raymt"))
    decode: Inner = group(Inner)
    label: Optional[str] = flag(None, "a label")


@dataclass
class Small:
    decode: Inner = group(Inner, skip=("sample", "seed"))


def test_flags_build_the_config_and_the_config_renders_its_flags():
    argv = ["--checkpoint", "a", "--checkpoint", "b", "--model", "x=c1", "--timeout", "4.0", "--no-cache"]
    cfg = parse(Demo, argv + ["--beam", "3", "--label", "run 1", "f1", "f2"], "demo")
    assert cfg == Demo(
        inputs=["f1", "f2"],
        checkpoint=("a", "b"),
        models={"x": "c1"},
        timeout_s=4.0,
        cache=False,
        decode=Inner(beam=3),
        label="run 1",
    )
    assert parse(Demo, to_argv(cfg), "demo") == cfg
    assert to_argv(parse(Demo, ["--checkpoint", "a"], "demo")) == ["--checkpoint", "a"]  # defaults left out
    assert command_line("demo run", cfg).startswith("raymt demo run --checkpoint a --checkpoint b --model x=c1")
    assert "'run 1'" in command_line("demo", cfg)


def test_a_group_builds_through_its_hook_and_skips_flags():
    assert parse(Demo, ["--checkpoint", "a", "--sample"], "demo").decode == Inner(beam=1, sample=True)
    assert [o.flag for o in options(Small)] == ["--beam"]
    with pytest.raises(SystemExit):
        parse(Small, ["--sample"], "small")


def test_positional_arguments_that_look_like_flags_render_after_a_separator():
    cfg = Demo(inputs=["-x"], checkpoint=("a",))
    assert to_argv(cfg)[-2:] == ["--", "-x"]
    assert parse(Demo, to_argv(cfg), "demo") == cfg


def test_a_bad_value_is_one_line_and_status_2(capsys):
    ran = []
    assert main_of("demo", Demo, ran.append, ["--checkpoint", "a", "--beam", "0"]) == 2
    assert capsys.readouterr().err == "demo: error: --beam 0 must be >= 1\n"
    assert main_of("demo", Demo, ran.append, ["--checkpoint", "a"]) == 0
    assert ran == [Demo(checkpoint=("a",))]
    with pytest.raises(SystemExit):  # argparse's own errors: a required flag, a choice
        parse(Demo, ["--checkpoint", "a", "--engine", "other"], "demo")


def test_the_example_command_of_the_architecture_doc_runs(capsys, monkeypatch):
    """docs/architecture.md's command a new one copies: it parses, runs and refuses a bad value."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    code = re.search(r"## Commands.*?```python\n(.*?)```", doc, re.S).group(1)
    module = types.ModuleType("greet")
    monkeypatch.setitem(sys.modules, "greet", module)  # dataclasses look their module up
    exec(compile(code, "docs/architecture.md", "exec"), module.__dict__)  # noqa: S102 - the repository's own doc
    greet = module.__dict__
    assert greet["main"](["--checkpoint", "ckpt", "--times", "2", "--beam", "2"]) == 0
    assert greet["main"](["--checkpoint", "ckpt", "--times", "0"]) == 2
    assert capsys.readouterr().err == "raymt greet: error: --times 0 must be >= 1\n"
    assert to_argv(greet["GreetConfig"](checkpoint="c", times=3)) == ["--checkpoint", "c", "--times", "3"]
