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

from raymt.command import command_line, flag, group, main_of, options, parse, parser, to_argv
from raymt.config import DecodeOptions, ServeConfig
from raymt.errors import check
from raymt.evaluate import EvaluateConfig
from raymt.serve.__main__ import ServeCommand
from raymt.translate import TranslateConfig


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


def test_help_names_a_flags_value_as_argparse_does(capsys):
    with pytest.raises(SystemExit):
        parse(Demo, ["--help"], "demo")
    out = capsys.readouterr().out
    assert "--beam BEAM " in out and "--timeout TIMEOUT " in out and "[--model MODEL]" in out and "DECODE__" not in out


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


def test_a_flag_shows_its_field_s_name_in_help_a_group_s_too():
    """--beam BEAM, not the parser's unique destination DECODE__BEAM; a switch, a choice and a
    given metavar keep theirs."""
    text = parser(Demo, "demo").format_help()
    assert "--beam BEAM " in text and "--seed SEED " in text and "--timeout TIMEOUT " in text
    assert "DECODE__" not in text and "--engine {auto,raymt}" in text and "--sample " in text


def unpairs(models: dict[str, str]) -> list[str]:
    """A dict into NAME=CKPT flags."""
    return [f"{k}={v}" for k, v in models.items()]


@dataclass
class Served:
    models: dict[str, str] = flag(default_factory=dict, name="--model", repeat=True, parse=pairs, render=unpairs)

    def __post_init__(self) -> None:
        check(bool(self.models), "--one X or --model NAME=X is required")


@dataclass
class Shorthand:
    one: Optional[str] = flag(None, "the same as --model default=X")
    served: Served = group(Served)

    @classmethod
    def from_flag_paths(cls, values: dict[tuple[str, ...], Any]) -> dict[tuple[str, ...], Any]:
        """--one X is --model default=X."""
        one = values.pop(("one",), None)
        return values if one is None else {**values, ("served", "models"): {"default": one}}


def test_a_shorthand_flag_sets_a_groups_field_before_the_group_is_built():
    assert parse(Shorthand, ["--one", "x"], "s") == Shorthand(served=Served({"default": "x"}))
    cfg = parse(Shorthand, ["--model", "a=x", "--model", "b=y"], "s")
    assert cfg.served.models == {"a": "x", "b": "y"} and parse(Shorthand, to_argv(cfg), "s") == cfg
    assert to_argv(parse(Shorthand, ["--one", "x"], "s")) == ["--model", "default=x"]
    with pytest.raises(ValueError, match="is required"):
        parse(Shorthand, [], "s")


def test_the_commands_configs_round_trip():
    """translate, evaluate and serve: a non-default config renders the flags that build it."""
    served = ServeConfig(
        models={"en-de": "runs/a/best", "de-en": "s3://b/c"},
        engine="raymt",
        port=9000,
        autoscale="1:3",
        request_timeout_s=5.0,
        decode=DecodeOptions(beam=3, max_len_a=0.5),
    )
    configs = [
        (ServeCommand(serve=served, api_keys="keys.txt", status_every_s=5.0, print_config=True), "raymt serve"),
        (
            TranslateConfig(
                checkpoint=("a", "b"),
                text=("Hello.", "-x"),
                tgt_lang="de",
                decode=DecodeOptions(beam=1, sample=True, temperature=0.5, top_k=5, seed=3),
                batch_size=8,
                ref="ref.txt",
                device="cpu",
            ),
            "raymt translate",
        ),
        (
            EvaluateConfig(
                checkpoint=("a",),
                test=("t1", "t2"),
                src_lang="en",
                tgt_lang="de",
                output_dir="out",
                num_actors=2,
                gpu=True,
                cpus_per_actor=1.5,
                autoscale_timeout_s=10.0,
                num_cpus=4,
                decode=DecodeOptions(beam=2, length_penalty=1.0),
                batch_size=8,
                verbose=True,
            ),
            "raymt evaluate",
        ),
    ]
    for cfg, prog in configs:
        assert parse(type(cfg), to_argv(cfg), prog) == cfg, prog
    assert "--request-timeout 5.0" in command_line("serve", configs[0][0])
    assert not {"--sample", "--seed"} & {o.flag for o in options(ServeCommand) + options(EvaluateConfig)}


def test_serves_checkpoint_flag_is_its_one_model():
    one = parse(ServeCommand, ["--checkpoint", "ckpt"], "raymt serve")
    assert one == parse(ServeCommand, ["--model", "default=ckpt"], "raymt serve") and one.checkpoint is None
    assert to_argv(one) == ["--model", "default=ckpt"]
    with pytest.raises(ValueError, match="--checkpoint and --model: give one of them"):
        parse(ServeCommand, ["--checkpoint", "ckpt", "--model", "a=b"], "raymt serve")


@dataclass
class Words:
    HELP_WORDS = {"whose": "the run's"}
    train: list[str] = flag(help="pairs of {whose} corpus", repeat=True, metavar="SPEC")


@dataclass(kw_only=True)
class Picks:
    """Positional arguments that may be left out, a flag of several values, a --no- switch,
    defaults and words in the help, a group's flags named as the command's own."""

    run_dir: Optional[str] = flag(None, "a run", positional=True)
    checkpoints: list[str] = flag(help="these", repeat=True, many=True, metavar="DIR")
    copy: bool = flag(True, "unsets copy", name="--no-copy")
    max_len: int = flag(200, "max_len (default %(default)s)")
    output: str = flag(help="where", required=True)
    inputs: Words = group(Words, words={"whose": "the prepared"})
    decode: Inner = group(Inner)


def test_optional_positionals_many_values_and_no_switches_round_trip():
    cfg = parse(Picks, ["--checkpoints", "a", "b", "--checkpoints", "c", "--no-copy", "--output", "o"], "picks")
    assert cfg == Picks(checkpoints=["a", "b", "c"], copy=False, output="o")
    assert to_argv(cfg) == ["--checkpoints", "a", "b", "c", "--no-copy", "--output", "o"]
    with_run = Picks(run_dir="runs/x", checkpoints=["a"], output="o", max_len=9, decode=Inner(beam=2))
    assert to_argv(with_run)[-2:] == ["--", "runs/x"]  # --checkpoints would take it
    for each in (cfg, with_run, Picks(output="o", inputs=Words(train=["t"]))):
        assert parse(Picks, to_argv(each), "picks") == each
    assert parse(Picks, ["--output", "o", "r"], "picks").run_dir == "r"


def test_help_shows_defaults_words_and_a_groups_flags_as_the_commands_own():
    from raymt.command import parser

    text = " ".join(parser(Picks, "picks").format_help().split())
    assert "--max-len MAX_LEN max_len (default 200)" in text and "--no-copy unsets copy" in text
    assert "--beam BEAM" in text and "--train SPEC pairs of the prepared corpus" in text
    assert "--train SPEC pairs of the run's corpus" in " ".join(parser(Words, "w").format_help().split())
    assert "[run_dir]" in text and "--checkpoints DIR [DIR ...]" in text


def test_errors_are_named_as_the_module(capsys):
    assert main_of("python -m raymt.demo", Demo, print, ["--checkpoint", "a", "--beam", "0"]) == 2
    assert capsys.readouterr().err == "raymt.demo: error: --beam 0 must be >= 1\n"


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
