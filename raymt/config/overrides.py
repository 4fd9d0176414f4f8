"""Config files and `--set` overrides: dotted keys (`optim.lr`) and string values parsed to
the fields' types."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from raymt.config.sections import RENAMED, Config
from raymt.errors import check

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package
    import tomli as tomllib


def parse_value(raw: str, tp: Any, key: str) -> Any:
    """Convert the string `raw` to the annotated type `tp` of field `key`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        if raw.lower() in ("none", "null", ""):
            return None
        tp = next(a for a in args if a is not type(None))
    try:
        if tp is bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(float(raw)) if "e" in raw.lower() else int(raw)
        if tp is float:
            return float(raw)
        return str(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a valid {tp.__name__}") from None


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Return a copy of `cfg` with dotted keys (e.g. `optim.lr`) replaced; values may be strings.
    Older configs' one-pair keys (data.src_lang, ...) are read before: `raymt.flags.build_config`."""
    hints = typing.get_type_hints(Config)
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        section, name = RENAMED.get((section, name), (section, name))  # an older config's name
        check(
            section in hints and name,
            f"unknown config field {key!r}; fields look like {', '.join(s + '.<name>' for s in hints)}",
        )
        section_hints = typing.get_type_hints(hints[section])
        check(name in section_hints, f"unknown config field {key!r}; {section} has: {', '.join(sorted(section_hints))}")
        if isinstance(value, str):
            value = parse_value(value, section_hints[name], key)
        grouped.setdefault(section, {})[name] = value
    kwargs = {s: dataclasses.replace(getattr(cfg, s), **v) for s, v in grouped.items()}
    return dataclasses.replace(cfg, **kwargs)


def parse_set_args(items: list[str]) -> dict[str, str]:
    """Turn `["optim.lr=5e-4", ...]` into `{"optim.lr": "5e-4"}`."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        check(bool(sep) and bool(key), f"--set {item!r} must look like section.field=value")
        out[key.strip()] = value.strip()
    return out


def load_file(path: str | Path) -> dict:
    """Read a JSON or TOML config file into a nested dict."""
    path = Path(path)
    check(path.is_file(), f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        return json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"config file {path} is not valid {path.suffix[1:] or 'JSON'}: {err}") from None


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict to dotted keys."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
