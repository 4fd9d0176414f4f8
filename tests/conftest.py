"""Shared fixtures: tiny models and a local 2-CPU Ray cluster."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance (2 CPUs) shared by the tests that need it."""
    import ray
    from ray.data import DataContext

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


# Ray forwards its actors' log lines to the driver's stderr whenever they come, e.g.
# "\x1b[36m(PlacementGroupCleaner pid=7)\x1b[0m Failed to query ..." from a detached
# helper of an earlier run; those are not the output under test.
_RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\(([^)]*pid=\d+[^)]*|raylet[^)]*)\)")


@pytest.fixture
def err_lines(capsys):
    """Return a function giving captured stderr lines, less lines forwarded from Ray actors."""
    def lines() -> list[str]:
        err = capsys.readouterr().err.strip().splitlines()
        return [line for line in err if not _RAY_FORWARDED.match(line)]
    return lines


@pytest.fixture
def tiny_model():
    """A random tiny Transformer in eval mode."""
    from raymt.config import tiny
    from raymt.model import Transformer

    torch.manual_seed(0)
    return Transformer(tiny(), vocab_size=64).eval()


from s3 import s3_bucket  # noqa: E402,F401 (session fixture: a local S3 server, tests/s3.py)
