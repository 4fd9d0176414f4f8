"""What the pipeline's tests share: a minimal config, the tiny recipe's steps, and each step's key
of a config given as TOML tables."""

from raymt.pipeline.config import from_dict
from raymt.pipeline.graph import pipeline_steps
from raymt.pipeline.keys import set_keys

BASE = {"src": "en", "tgt": "de", "output": "out"}
# The steps of recipes/pipeline-tiny.toml, in order: back-translation and a two-stage teacher.
TINY_STEPS = [
    "corpus",
    "prepare",
    "mono-src",
    "mono-tgt",
    "backward",
    "bt",
    "prepare-bt",
    "teacher-1-bt",
    "teacher-1-avg",
    "teacher-1",
    "distill",
    "student",
    "export",
    "evaluate",
]


def keys(data: dict) -> dict[str, str]:
    """Each step's key of a config given as TOML tables."""
    cfg = from_dict(data)
    steps = pipeline_steps(cfg)
    set_keys(steps, cfg.pair)
    return {s.name: s.key for s in steps}


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """The steps of `before` whose key differs in `after` (or that `after` lacks)."""
    return {name for name in before if before[name] != after.get(name)}
