"""A corpus directory written whole or not at all: already-prepared check, staging, move or upload into place
(also a `raymt data mono` output: its record, mono.json, in the manifest's place)."""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import pyarrow.fs as pafs

import raymt
from raymt import storage
from raymt.data.format import (
    MANIFEST_FILE,
    SPM_FILE,
    TEST_DIR,
    TRAIN_DIR,
    VALID_DIR,
    VALID_FILE,
    PreparedCorpus,
    open_corpus,
)
from raymt.errors import user_error


def existing_corpus(out: str, fp: str, overwrite: bool) -> Optional[dict]:
    """The manifest when OUT already holds this very corpus; an error when it holds other content."""
    kind = storage.file_type(out)
    if kind == pafs.FileType.NotFound or (kind == pafs.FileType.Directory and not storage.listdir(out)):
        return None
    if kind != pafs.FileType.Directory:
        raise ValueError(f"--out {out} is a file: pick a directory")
    try:
        corpus = open_corpus(out)
    except ValueError:
        if not _corpus_files_only(out):
            raise ValueError(
                f"--out {out} is not empty and holds no prepared corpus: pick a new or "
                "empty directory (--overwrite only replaces a prepared corpus)"
            ) from None
        if not overwrite:
            raise ValueError(
                f"--out {out} holds corpus files but no {MANIFEST_FILE} (an upload cut short?): "
                "pass --overwrite to replace them, or pick another --out"
            ) from None
        return None
    fingerprint = corpus.manifest.get("fingerprint")
    if fingerprint == fp and _complete(corpus):
        return corpus.manifest
    if not overwrite and fingerprint == fp:
        raise ValueError(
            f"--out {out} holds this corpus but misses some of its files: pass --overwrite to prepare it again"
        )
    if not overwrite:
        raise ValueError(
            f"--out {out} already holds a corpus prepared from other inputs or options: "
            "pass --overwrite to replace it, or pick another --out"
        )
    return None


def _corpus_files_only(out: str) -> bool:
    """Whether every file under OUT is one a corpus holds (what an interrupted upload leaves: its
    manifest goes last), so that --overwrite may replace it."""
    fs, path = storage.filesystem(out)
    root = path.rstrip("/") + "/"
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        assert info.path.startswith(root), (info.path, root)
        rel = info.path[len(root) :].split("/")
        if info.type == pafs.FileType.Directory:
            known = rel[0] in (TRAIN_DIR, VALID_DIR, TEST_DIR)
        elif rel[0] == TRAIN_DIR:  # train/part-N.parquet, or train/CORPUS/part-N.parquet
            known = re.fullmatch(r"part-\d+\.parquet", rel[-1]) is not None and len(rel) <= 3
        elif rel[0] in (VALID_DIR, TEST_DIR):
            known = rel[-1].endswith(".parquet") and len(rel) <= 3
        else:
            known = rel in ([SPM_FILE], [VALID_FILE])
        if not known:
            return False
    return True


def _complete(corpus: PreparedCorpus) -> bool:
    """Whether every file its manifest names is there."""
    return all(storage.exists(storage.join(corpus.location, p)) for p in corpus.files())


def _staging(out: str) -> Path:
    """A new local directory to build the corpus in: next to a local OUT (renamed into place at
    the end), else in the local temporary directory (uploaded at the end)."""
    if storage.is_uri(out):
        return Path(tempfile.mkdtemp(prefix="raymt-prepare-"))
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f"{out_path.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def _install(tmp: Path, out: str, record: str = MANIFEST_FILE) -> None:
    """Move the finished corpus into place; a replaced one is removed only afterwards.

    On object storage there is no rename: an old corpus is removed manifest (`record`) first, the
    new files are uploaded, and the manifest goes last, so no reader sees a corpus half-written.
    """
    if storage.is_uri(out):
        fs, path = storage.filesystem(out)
        if storage.exists(storage.join(out, record)):
            fs.delete_file(storage.filesystem(storage.join(out, record))[1])
        fs.delete_dir_contents(path, missing_dir_ok=True)
        manifest = (tmp / record).read_bytes()
        (tmp / record).unlink()
        storage.upload_dir(tmp, out)
        storage.write_bytes(storage.join(out, record), manifest)
        return
    out_path = Path(out)
    if out_path.is_dir() and not any(out_path.iterdir()):
        out_path.rmdir()
    if not out_path.exists():
        os.rename(tmp, out_path)
        return
    old = out_path.with_name(f"{out_path.name}.old-{secrets.token_hex(4)}")
    os.rename(out_path, old)
    os.rename(tmp, out_path)
    shutil.rmtree(old)


def build_staged(out: str, build: Callable[[Path], dict], record: str = MANIFEST_FILE, **entries) -> dict:
    """Build a corpus in a staging dir beside `out` with `build(tmp)`, add `entries` and the
    provenance to its manifest (the file `record`, written last), then move it into place: `out`
    is whole or untouched."""
    tmp = _staging(out)
    try:
        manifest = build(tmp)
        manifest.update(
            **entries,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            raymt_version=raymt.__version__,
        )
        (tmp / record).write_text(json.dumps(manifest, indent=2) + "\n")
        _install(tmp, out, record)
    except Exception as err:
        user = user_error(err)
        if user is not None:
            raise user from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
