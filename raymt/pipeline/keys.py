"""Each step's key and state. A step's output is OUT/steps/<step>.<key>/, the key a short hash of
the step kind, its version (bumped in code when the step's results change; never a hash of source
files), the languages, the settings that change its results (not the resources a step runs on:
`RESOURCE_FIELDS`), the fingerprints of its input files and the keys of the steps it uses. So a
changed setting makes exactly the steps downstream of it stale, and a reverted one finds its old
output again (still under the old key).

A step is done when its directory holds its command's own end marker. OUT/pipeline.json records
the last run's steps (key, settings, inputs, the keys used): `plan` names what changed since.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from raymt.data.text import input_file_info

KEY_LENGTH = 12
STEPS_DIR = "steps"
PIPELINE_FILE = "pipeline.json"
RECORD_FILE = "step.json"  # in a finished step's directory: its record, wall time and resources
# Settings of how a step runs, not of what it makes: the workers, actors and CPUs it spreads over,
# restart units, progress and verbosity. A stage field or `set` item (train.num_workers=1) of one
# of these names is in no key, so that a step reruns on another machine without redoing its work.
# (train.num_workers also scales the global batch: a run resumed keeps the one it started with.)
RESOURCE_FIELDS = frozenset(
    {
        "num_workers",
        "min_workers",
        "cpus_per_worker",
        "resize_interval_s",
        "autoscale_timeout_s",
        "num_actors",
        "cpus_per_actor",
        "num_cpus",
        "shard_lines",
        "progress_s",
        "verbose",
    }
)


def digest(blob: Any) -> str:
    """The short hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:KEY_LENGTH]


def file_fingerprint(path: str) -> dict:
    """What identifies an input file's content without reading it: size and mtime (as a prepared
    corpus's fingerprint does); a missing file: one line naming it."""
    info = input_file_info(path)
    return {"size": info.size, "mtime_ns": info.mtime_ns}


def flat_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings with each `set` list read as its FIELD=VALUE items ("student.set.train.max_steps":
    "20"), so that a change names the one override that changed; those of RESOURCE_FIELDS left out."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if key.endswith((".set", "_set")) and isinstance(value, list):
            out.update({f"{key}.{k.strip()}": v.strip() for k, _, v in (item.partition("=") for item in value)})
        else:
            out[key] = value
    return {key: value for key, value in out.items() if key.rpartition(".")[2] not in RESOURCE_FIELDS}


@dataclass
class Step:
    """One step of a pipeline: its name (teacher-2), kind, the settings that change its results
    (flat: "teacher.preset"), its input files' fingerprints and the steps it uses."""

    name: str
    kind: str
    version: int
    settings: dict[str, Any]
    inputs: dict[str, dict] = field(default_factory=dict)
    uses: tuple[str, ...] = ()
    key: str = ""  # `set_keys`

    def record(self, keys: dict[str, str], pair: tuple[str, str]) -> dict:
        """What the key hashes (and the record in OUT/pipeline.json and the step's step.json)."""
        return {
            "kind": self.kind,
            "version": self.version,
            "languages": list(pair),
            "settings": flat_settings(self.settings),
            "inputs": self.inputs,
            "uses": {name: keys[name] for name in self.uses},
        }

    def dirname(self) -> str:
        """OUT/steps/<this>."""
        return f"{self.name}.{self.key}"


def set_keys(steps: list[Step], pair: tuple[str, str]) -> dict[str, dict]:
    """Each step's key, in order (a step's uses come before it); the records they hash, by name."""
    keys: dict[str, str] = {}
    records: dict[str, dict] = {}
    for step in steps:
        records[step.name] = step.record(keys, pair)
        step.key = keys[step.name] = digest(records[step.name])
        records[step.name]["key"] = step.key
    return records


def read_json(path: Path) -> Optional[dict]:
    """A JSON file's content, None when it is not there (or half-written)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def changes(old: dict, new: dict) -> list[str]:
    """What differs between a step's last record and its record now, in words."""
    out = []
    if old.get("version") != new["version"]:
        out.append(f"step version {old.get('version')} -> {new['version']}")
    if old.get("languages") != new["languages"]:
        out.append(f"languages {'-'.join(old.get('languages') or [])} -> {'-'.join(new['languages'])}")
    before, now = old.get("settings", {}), new["settings"]
    for key in sorted(set(before) | set(now), key=lambda k: (k not in now, k)):
        if before.get(key) != now.get(key):
            out.append(f"{key} {before.get(key, '(unset)')} -> {now.get(key, '(unset)')}")
    for name in sorted(set(old.get("inputs", {})) | set(new["inputs"])):
        if old.get("inputs", {}).get(name) != new["inputs"].get(name):
            out.append(f"{name} changed")
    for name, key in new["uses"].items():
        if old.get("uses", {}).get(name) != key:
            out.append(f"uses {name}, which changed")
    return out


@dataclass
class State:
    """A step's state for `plan`: done, to do (new, or continued from a partial output) or stale."""

    state: str  # "done" | "to do" | "stale"
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.state} ({self.reason})" if self.reason else self.state


def step_state(step: Step, now: dict, out: Path, done: Callable[[Path], bool], last: Optional[dict]) -> State:
    """The state of `step` in OUT (`done`: whether a directory holds the command's end marker;
    `now`: its record) against `last`, its record in the last run's OUT/pipeline.json."""
    where = out / STEPS_DIR / step.dirname()
    if done(where):
        return State("done")
    if last is not None and last.get("key") != step.key:
        return State("stale", "; ".join(changes(last, now)) or "its key changed")
    return State("to do", "continues its partial output" if where.exists() else "")
