"""A local run directory every node of the cluster must reach, probed from each (`check_shared`)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Optional

from raymt import storage
from raymt.autoscale import RayCluster


def check_shared(location: str, flag: str = "--storage-path", cluster: Optional[RayCluster] = None) -> None:
    """A one-line error, before training, when a local run directory is on this node only and the
    cluster has other nodes: their workers read the run's corpus there and Ray Train (2.60) writes
    checkpoints there from the worker of rank 0 (its StorageContext fails on a node without the
    directory's marker). A shared directory (NFS, or nodes on one machine) or a URI passes."""
    if storage.is_uri(location):
        return
    existing = Path(location)
    while not existing.exists():  # nothing is created: the nearest existing directory is probed
        existing = existing.parent
    marker = existing / f".raymt-shared-{uuid.uuid4().hex}"
    marker.touch()
    try:
        missing = (cluster or RayCluster()).nodes_without(str(marker))
    finally:
        marker.unlink(missing_ok=True)
    if missing:
        raise ValueError(
            f"{flag} {location} is on this node only: the cluster's nodes at {', '.join(missing)} cannot "
            f"reach it, and training writes checkpoints and reads its corpus there from every node: "
            f"pass {flag} a URI (s3://...) or a directory every node shares (NFS), or set RAYMT_STORAGE_PATH"
        )
