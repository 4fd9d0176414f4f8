"""Where raymt's files live: a local path or a URI that a pyarrow filesystem reads (s3://,
gs://, hdfs://, file://). Every file raymt reads or writes by a user-given location goes
through `filesystem` here, so object storage and local disk take the same code path.

Credentials and endpoints come from the environment as the cloud SDKs read them (for
S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION, and AWS_ENDPOINT_URL
for an S3-compatible server such as MinIO); pyarrow's S3 filesystem reads them itself.
A resolved filesystem carries its endpoint when it is pickled to a Ray worker.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.fs as pafs

from raymt.errors import InputError, first_line


def is_uri(location: str | Path) -> bool:
    """Whether a location is a URI (scheme://...) rather than a local path."""
    return "://" in str(location)


def normalize(location: str | Path) -> str:
    """A URI as given (without a trailing slash), or a local path made absolute."""
    location = str(location)
    if is_uri(location):
        return location.rstrip("/")
    return os.path.abspath(os.path.expanduser(location))


# Ray unpacks a job's --working-dir (and py_modules) into <session>/runtime_resources/
# working_dir_files/_ray_pkg_<hash>/ and starts the job's entrypoint there: a copy that is Ray's,
# deleted when its cache needs the room or the session ends. Relative outputs of a process started
# there go under JOB_HOME instead (Ray does not say where the job was submitted from: its package
# is a zip named by content hash, and the submitter may be a laptop).
JOB_HOME = "~/raymt"


def ray_package(location: str | Path) -> Optional[str]:
    """The Ray runtime-env package directory (a job's unpacked --working-dir) a local path lies in, if any."""
    if is_uri(location):
        return None
    parts = Path(normalize(location)).parts
    for i in range(2, len(parts)):
        if parts[i].startswith("_ray_pkg_") and "runtime_resources" in parts[:i]:
            return str(Path(*parts[: i + 1]))
    return None


def output_location(location: str | Path, flag: str) -> str:
    """Where an output goes: a URI as given, a local path made absolute. In Ray's temporary
    copy of a job's working directory a relative path goes under JOB_HOME instead (one line
    says where) and an absolute path inside that copy is a one-line error naming `flag`."""
    path = os.path.expanduser(str(location))
    if is_uri(path):
        return normalize(path)
    package = ray_package(os.getcwd())
    env = ", or set RAYMT_STORAGE_PATH" if flag == "--storage-path" else ""  # train's and tune's default
    if not os.path.isabs(path) and package is not None:
        moved = normalize(os.path.join(os.path.expanduser(JOB_HOME), path))
        print(
            f"raymt: {flag} {location} goes to {moved}, not into {package} (Ray's temporary copy of "
            f"the job's working directory): pass an absolute path or a URI{env} to choose",
            flush=True,
        )
        return moved
    inside = ray_package(path)
    if inside is not None:
        raise ValueError(
            f"{flag} {location} is inside {inside}, Ray's temporary copy of a job's working directory "
            f"(deleted after the job): pass a directory outside it or a URI (s3://...){env}"
        )
    return normalize(path)


def join(location: str | Path, *parts: str) -> str:
    """`location/part/...` for a local path or a URI."""
    out = normalize(location)
    for part in parts:
        out = out.rstrip("/") + "/" + part.strip("/")
    return out


def split(location: str | Path) -> tuple[str, str]:
    """(parent, name) of a local path or URI: `s3://b/runs/x` -> (`s3://b/runs`, `x`)."""
    location = normalize(location)
    parent, _, name = location.rpartition("/")
    if not name or parent.endswith(":/"):
        raise ValueError(f"{location} has no parent directory: name a directory inside a bucket")
    return parent, name


def filesystem(location: str | Path) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and its path of a local path or URI."""
    location = str(location)
    if location.startswith(("http://", "https://")):
        raise InputError(
            f"{location}: http(s) inputs are not read directly; download the file first, "
            "or use --dataset NAME for a known public corpus"
        )
    if is_uri(location):
        try:
            return pafs.FileSystem.from_uri(location)
        except (pa.ArrowException, OSError, ValueError) as err:
            raise InputError(
                f"{location}: cannot open this URI ({first_line(err)}); use a local path "
                "or an s3://, gs://, hdfs:// or file:// URI"
            ) from None
    return pafs.LocalFileSystem(), normalize(location)


def file_type(location: str | Path) -> pafs.FileType:
    """NotFound, File or Directory (an object-store prefix with objects under it is a Directory)."""
    fs, path = filesystem(location)
    return fs.get_file_info(path).type


def exists(location: str | Path) -> bool:
    """Whether a local path or URI names an existing file."""
    return file_type(location) == pafs.FileType.File


def listdir(location: str | Path) -> list[str]:
    """The names directly inside a directory; empty when it is missing."""
    fs, path = filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(info.base_name for info in infos)


def read_bytes(location: str | Path) -> bytes:
    """The content of a local file or URI (not decompressed)."""
    fs, path = filesystem(location)
    with fs.open_input_stream(path, compression=None) as f:
        return f.read()


def write_bytes(location: str | Path, data: bytes) -> None:
    """Write a whole file (local: to a temporary name, then renamed; objects appear whole anyway)."""
    if not is_uri(location):
        path = Path(normalize(location))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return
    fs, path = filesystem(location)
    if isinstance(fs, pafs.LocalFileSystem):  # file://: a file system needs the directory (S3 does not)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path, compression=None) as f:
        f.write(data)


def upload_dir(local: str | Path, location: str | Path) -> None:
    """Copy every file under a local directory to `location` (existing files are replaced)."""
    fs, path = filesystem(location)
    if any(Path(local).iterdir()):
        if isinstance(fs, pafs.LocalFileSystem):  # file://: the files at the top need the directory (S3 does not)
            fs.create_dir(path, recursive=True)
        pafs.copy_files(
            str(Path(local).resolve()), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs
        )


def download_dir(location: str | Path, local: str | Path) -> None:
    """Copy every file under `location` into a local directory."""
    fs, path = filesystem(location)
    Path(local).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(
        path, str(Path(local).resolve()), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem()
    )


def cache_root() -> Path:
    """raymt's local cache: $RAYMT_CACHE, else ~/.cache/raymt."""
    return Path(os.environ.get("RAYMT_CACHE") or "~/.cache/raymt").expanduser()


def local_copy(location: str | Path, kind: str = "checkpoints") -> Path:
    """A local directory with the files of `location`: itself when local, else a copy
    downloaded once into the cache (cache_root()/kind/<hash of the URI>)."""
    if not is_uri(location):
        return Path(normalize(location))
    uri = normalize(location)
    target = cache_root() / kind / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if target.is_dir():
        return target
    if file_type(uri) != pafs.FileType.Directory:
        raise ValueError(f"{uri} does not exist (or holds no files): check the URI")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        download_dir(uri, tmp)
        os.replace(tmp, target)  # whole or not at all; another process may have won the race
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class MirroredDir:
    """A directory written locally and mirrored to `location` on `sync()`.

    For a local `location` it is that directory itself and `sync` does nothing; for a
    URI (files cannot be appended to in object storage) `fetch` names the files that are
    downloaded first, so that appending continues them.
    """

    def __init__(self, location: str | Path, fetch: tuple[str, ...] = ()):
        self.location = normalize(location)
        if not is_uri(self.location):
            self.path, self.remote = Path(self.location), False
        else:
            self.path, self.remote = Path(tempfile.mkdtemp(prefix="raymt-mirror-")), True
        self.path.mkdir(parents=True, exist_ok=True)
        for name in fetch:
            self.fetch(name)

    def fetch(self, name: str) -> None:
        """Download the file `name` (a relative path) if it exists remotely (no-op when local)."""
        data = optional_bytes(join(self.location, name)) if self.remote else None
        if data is not None:
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)
            (self.path / name).write_bytes(data)

    def sync(self) -> None:
        """Upload the local files (no-op for a local location)."""
        if self.remote:
            upload_dir(self.path, self.location)

    def close(self) -> None:
        """Upload one last time and remove the local copy."""
        self.sync()
        if self.remote:
            shutil.rmtree(self.path, ignore_errors=True)


def optional_bytes(location: str | Path) -> Optional[bytes]:
    """The content of a file, or None when it does not exist."""
    return read_bytes(location) if exists(location) else None
