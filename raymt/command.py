"""The command layer, one style for every `raymt COMMAND`: a command is a typed config (a dataclass
whose fields carry their flags: `flag`, and groups of another config's flags: `group`) and
`run(config)`; `main(argv)` only parses (`parse`). A config renders itself back to the command
line that builds it (`to_argv`, `command_line`): what a pipeline prints for a step to run alone.

    @dataclass
    class AverageConfig:
        run_dir: str = flag(help="the run directory", positional=True)
        last: int = flag(3, "average the last N checkpoints")

    def run(cfg: AverageConfig) -> Path: ...
    def main(argv=None) -> int:
        return main_of("raymt.average", AverageConfig, run, argv, description=__doc__)

Flags are the fields' names with dashes (`max_tokens` -> --max-tokens) unless `name` says
otherwise; a bool is a switch (--no-NAME too when its default is True); `repeat` collects a
repeated flag into a list or tuple; `parse`/`render` convert a field's value from and to its
flag's strings where the two differ (`--model NAME=CKPT` into a dict). A field without `flag`
is no flag (a default the command line does not set). A group's class may define
`from_flags(values) -> values` to adjust its flags' values before it is built (sampling implies
beam 1). This module imports nothing of raymt but its errors: every config may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

from raymt.errors import cli_error

T = TypeVar("T")
FLAG = "raymt.flag"
GROUP = "raymt.group"


@dataclass(frozen=True)
class FlagSpec:
    """How a config field is given on the command line (`flag`)."""

    help: str = ""
    name: Optional[str] = None  # --NAME; default: the field's name with dashes
    metavar: Optional[str] = None
    repeat: bool = False  # the flag may be repeated; its values collected in order
    positional: bool = False  # an argument without a flag (a list of them with `repeat`)
    required: bool = False
    choices: Optional[tuple[str, ...]] = None
    parse: Optional[Callable[[Any], Any]] = None  # the flag's value (a list with `repeat`) -> the field's
    render: Optional[Callable[[Any], Any]] = None  # the field's value -> the flag's (a list with `repeat`)


@dataclass(frozen=True)
class GroupSpec:
    """A field holding another config whose flags are this command's too (`group`)."""

    skip: tuple[str, ...] = ()  # its fields that are no flag of this command
    help: tuple[tuple[str, str], ...] = ()  # (field, help) where this command words a flag its own way


def flag(
    default: Any = MISSING,
    help: str = "",
    *,
    default_factory: Any = MISSING,
    **spec: Any,
) -> Any:
    """A dataclass field that is also a command-line flag (`FlagSpec`'s keywords)."""
    if default is MISSING and default_factory is MISSING and spec.get("repeat"):
        default_factory = list
    return dataclasses.field(default=default, default_factory=default_factory, metadata={FLAG: FlagSpec(help, **spec)})


def group(cls: type, skip: Sequence[str] = (), help: Optional[dict[str, str]] = None) -> Any:
    """A dataclass field holding a `cls` config, whose flags (all but `skip`) are this command's;
    `help`: this command's own help of some of them (field -> help)."""
    spec = GroupSpec(tuple(skip), tuple((help or {}).items()))
    return dataclasses.field(default_factory=cls, metadata={GROUP: spec})


# ---------------------------------------------------------------- the fields


@dataclass(frozen=True)
class Option:
    """One flag of a command: its field's path in the config, spec, type and default."""

    path: tuple[str, ...]  # ("decode", "beam")
    spec: FlagSpec
    kind: Any  # the field's annotation, Optional unwrapped
    default: Any

    @property
    def dest(self) -> str:
        """The argparse destination: the path joined, unique across groups."""
        return "__".join(self.path)

    @property
    def flag(self) -> str:
        """The flag's name as typed: --max-tokens."""
        return self.spec.name or "--" + self.path[-1].replace("_", "-")


def _unwrap(kind: Any) -> Any:
    """Optional[X] -> X."""
    if typing.get_origin(kind) is Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one of a factory)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def options(
    cls: type, path: tuple[str, ...] = (), skip: Sequence[str] = (), helps: Optional[dict[str, str]] = None
) -> list[Option]:
    """Every flag of config class `cls`, its groups' included, in field order (`helps`: a group's
    help of some fields, `group(help=)`)."""
    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if GROUP in f.metadata:
            spec = f.metadata[GROUP]
            out += options(hints[f.name], path + (f.name,), spec.skip, dict(spec.help))
        elif FLAG in f.metadata:
            flag_spec = f.metadata[FLAG]
            if helps and f.name in helps:
                flag_spec = dataclasses.replace(flag_spec, help=helps[f.name])
            out.append(Option(path + (f.name,), flag_spec, _unwrap(hints[f.name]), _default(f)))
    return out


# ---------------------------------------------------------------- flags -> config


def add_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """The flags of config class `cls` on parser `p`."""
    for opt in options(cls):
        s, kw = opt.spec, {"help": opt.spec.help}
        if s.metavar:
            kw["metavar"] = s.metavar
        if s.choices:
            kw["choices"] = s.choices
        item = typing.get_args(opt.kind)[0] if typing.get_origin(opt.kind) in (list, tuple) else opt.kind
        if opt.kind is bool and not s.parse:
            kw["action"] = argparse.BooleanOptionalAction if opt.default is True else "store_true"
        elif s.repeat:
            kw["type"] = item if item in (int, float) else str
            if s.positional:
                kw["nargs"] = "*"
            else:
                kw["action"] = "append"
        elif opt.kind in (int, float) and not s.parse:
            kw["type"] = opt.kind
        if len(opt.path) > 1 and "action" not in kw and not s.metavar and not s.choices:
            kw["metavar"] = opt.path[-1].upper()  # a group's flag shows BEAM, as a field of its own would
        if s.positional:
            p.add_argument(opt.dest, **kw)
            continue
        kw["default"] = None  # "not given": the config's default stays (a repeated flag: [])
        if s.repeat:
            kw["default"] = []
        p.add_argument(opt.flag, dest=opt.dest, required=s.required, **kw)


def _build(cls: type, values: dict[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    """An instance of `cls` from the given flags' values by path (groups built first)."""
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        here = path + (f.name,)
        if GROUP in f.metadata:
            kwargs[f.name] = _build(hints[f.name], values, here)
        elif here in values:
            kwargs[f.name] = values[here]
    if hasattr(cls, "from_flags"):
        kwargs = cls.from_flags(kwargs)
    return cls(**kwargs)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The config of parsed flags (`add_flags`): a flag not given keeps its field's default."""
    values: dict[tuple[str, ...], Any] = {}
    for opt in options(cls):
        value = getattr(args, opt.dest)
        if value is None or (opt.spec.repeat and not value and not opt.spec.parse):
            continue
        if opt.spec.parse:
            value = opt.spec.parse(value)
        elif typing.get_origin(opt.kind) is tuple:
            value = tuple(value)
        values[opt.path] = value
    return _build(cls, values)


def parser(cls: type, prog: str, description: Optional[str] = None) -> argparse.ArgumentParser:
    """A command's parser: the flags of its config class."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(p, cls)
    return p


def parse(cls: type[T], argv: Optional[Sequence[str]], prog: str, description: Optional[str] = None) -> T:
    """The validated config of a command line (a ValueError names a bad value)."""
    return from_args(cls, parser(cls, prog, description).parse_args(argv))


def main_of(
    prog: str,
    cls: type[T],
    run: Callable[[T], Any],
    argv: Optional[Sequence[str]] = None,
    description: Optional[str] = None,
) -> int:
    """A command's `main`: its config parsed, then `run(config)`; a user error is one line, status 2."""
    try:
        cfg = parse(cls, argv, prog, description)
        run(cfg)
    except ValueError as err:
        return cli_error(prog, err)
    return 0


# ---------------------------------------------------------------- config -> flags


def _get(cfg: Any, path: tuple[str, ...]) -> Any:
    """The value at `path` of a config."""
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


def _text(value: Any) -> str:
    """A flag's value as typed."""
    return value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)


def to_argv(cfg: Any) -> list[str]:
    """The flags that build `cfg` (`parse(type(cfg), to_argv(cfg), ...) == cfg`): those whose
    value differs from its default, positional arguments last."""
    argv: list[str] = []
    positional: list[str] = []
    for opt in options(type(cfg)):
        value = _get(cfg, opt.path)
        if value == opt.default and not opt.spec.required:
            continue
        raw = opt.spec.render(value) if opt.spec.render else value
        if opt.kind is bool and not opt.spec.parse:
            argv.append(opt.flag if value else "--no-" + opt.flag[2:])
        elif opt.spec.positional:
            positional += [_text(v) for v in (raw if opt.spec.repeat else [raw])]
        elif opt.spec.repeat:
            for v in raw:
                argv += [opt.flag, _text(v)]
        elif raw is not None:
            argv += [opt.flag, _text(raw)]
    return argv + (["--", *positional] if any(p.startswith("-") for p in positional) else positional)


def command_line(command: str, cfg: Any) -> str:
    """The shell line that runs `cfg` alone: `raymt COMMAND FLAGS`."""
    return shlex.join(["raymt", *command.split(), *to_argv(cfg)])
