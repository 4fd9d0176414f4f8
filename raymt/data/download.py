"""Download known public parallel corpora by name: cached, resumable, checksum-verified.

`fetch_dataset("multi30k", "en", "de", cache_dir)` returns split -> (src file, tgt file).
Only urllib: no new dependencies. Files land in CACHE_DIR/NAME/; downloads go to FILE.part
and are renamed only once verified, so a half-downloaded file is never used.

Checksums: a file's digest is either known (written in the spec below) or, where we have
no trustworthy value, recorded on first download in CACHE_DIR/checksums.json ("trust on
first use") and checked against that record whenever the file is reused or fetched again.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import os
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Callable, Optional, Union

Splits = dict[str, tuple[str, str]]

ATTEMPTS = 5  # tries per file; each retry resumes where the last one stopped
BACKOFF_S = 1.0  # first wait between tries, doubled each time (tests set it near 0)
TIMEOUT_S = 60.0  # socket timeout: a stalled server counts as a transient error
CHUNK = 1 << 20


# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Multi30kSpec:
    """Files BASE_URL/{split}.{lang}.gz, one per split and language."""

    base_url: str
    langs: tuple[str, ...]
    test_sets: dict[str, tuple[str, ...]]  # test split -> languages that have it upstream
    digests: dict[str, str]  # file name -> "sha256:HEX", where known


@dataclass(frozen=True)
class Remote:
    """One file to download; digest "sha256:HEX" / "md5:HEX", or None (trust on first use)."""

    url: str
    digest: Optional[str] = None


@dataclass(frozen=True)
class TrainPart:
    """A training tarball whose members STEM.<lang> (in any folder) hold one corpus."""

    remote: Remote
    stem: str


@dataclass(frozen=True)
class TestSet:
    """An SGML test set from sacrebleu's registry: tarball plus (src, ref) member per pair."""

    key: str
    sacrebleu_name: str
    remote: Remote
    members: dict[str, tuple[str, str]]


@dataclass(frozen=True)
class WmtSpec:
    """Training tarballs concatenated into one corpus, plus newstest valid/test sets."""

    pairs: tuple[str, ...]
    train: tuple[TrainPart, ...]
    valid: TestSet
    tests: tuple[TestSet, ...]


def _sacrebleu_test_set(key: str, sacrebleu_name: str, pairs: tuple[str, ...]) -> TestSet:
    """URL, MD5 and member names of a test set, read from the installed sacrebleu's registry."""
    # sacrebleu (a declared dependency, 2.x) is the authority on where the official test
    # sets live and what they hash to; copying its values here would let them drift.
    from sacrebleu.dataset import DATASETS as SACREBLEU

    entry = SACREBLEU[sacrebleu_name]
    (url,), (md5,) = entry.data, entry.md5
    members = {pair: (entry.langpairs[pair][0], entry.langpairs[pair][1]) for pair in pairs}
    return TestSet(key, sacrebleu_name, Remote(url, f"md5:{md5}"), members)


_MULTI30K_SHA256 = {  # the real upstream files (checked against copies we hold)
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
}

_WMT14_PAIRS = ("en-de", "de-en")

DATASETS: dict[str, Union[Multi30kSpec, WmtSpec]] = {
    # Multi30k task 1 (Elliott et al. 2016). Test sets: test_2016_flickr exists for all four
    # languages; test_2017_flickr and test_2017_mscoco for en/de/fr only (WMT17 had no
    # Czech), as the upstream README's statistics list. test_2018_flickr is left out: its
    # files came in a later upstream commit that the README does not document, so we are
    # not sure of its language coverage. fr, cs and the 2017 files have no known digest.
    "multi30k": Multi30kSpec(
        base_url="https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/",
        langs=("en", "de", "fr", "cs"),
        test_sets={
            "test_2016_flickr": ("en", "de", "fr", "cs"),
            "test_2017_flickr": ("en", "de", "fr"),
            "test_2017_mscoco": ("en", "de", "fr"),
        },
        digests={name: f"sha256:{hexdigest}" for name, hexdigest in _MULTI30K_SHA256.items()},
    ),
    # WMT14 en-de as in Vaswani et al. 2017. The three training tarballs have NO known
    # checksum (statmt.org publishes none that we could confirm): trust on first use.
    # newstest2013 (wmt13 test.tgz) and newstest2014 (wmt14 test-filtered.tgz, the 3003-line
    # filtered set) come with the MD5 that sacrebleu's registry gives.
    "wmt14": WmtSpec(
        pairs=_WMT14_PAIRS,
        train=(
            TrainPart(Remote("https://www.statmt.org/europarl/v7/de-en.tgz"), "europarl-v7.de-en"),
            TrainPart(Remote("https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz"), "commoncrawl.de-en"),
            TrainPart(Remote("https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz"), "news-commentary-v9.de-en"),
        ),
        valid=_sacrebleu_test_set("newstest2013", "wmt13", _WMT14_PAIRS),
        tests=(_sacrebleu_test_set("newstest2014", "wmt14", _WMT14_PAIRS),),
    ),
}


# ----------------------------------------------------------------------------- API


def fetch_dataset(
    name: str, src_lang: str, tgt_lang: str, cache_dir: Path, mirror: Optional[str] = None
) -> dict[str, tuple[str, str]]:
    """Download (or reuse from cache_dir) a named corpus; return split name -> (src file, tgt file)."""
    spec = DATASETS.get(name)
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    if mirror is None:
        mirror = os.environ.get("RAYMT_MIRROR") or None
    cache_dir = Path(cache_dir)
    if isinstance(spec, Multi30kSpec):
        return _fetch_multi30k(name, spec, src_lang, tgt_lang, cache_dir, mirror)
    return _fetch_wmt(name, spec, src_lang, tgt_lang, cache_dir, mirror)


def _log(message: str) -> None:
    """One progress line on stderr (stdout stays free for the CLI's own output)."""
    print(message, file=sys.stderr, flush=True)


def _url(url: str, mirror: Optional[str]) -> str:
    """URL itself, or the mirror base URL followed by URL's file name."""
    if not mirror:
        return url
    return mirror.rstrip("/") + "/" + PurePosixPath(url).name


# ----------------------------------------------------------------------------- multi30k


def _fetch_multi30k(
    name: str, spec: Multi30kSpec, src: str, tgt: str, cache_dir: Path, mirror: Optional[str]
) -> Splits:
    """Multi30k: train, valid (upstream "val") and the test sets both languages have."""
    if src not in spec.langs or tgt not in spec.langs or src == tgt:
        raise ValueError(
            f"{name} has no {src}-{tgt}: it supports any two different languages of {', '.join(spec.langs)}"
        )
    splits = {"train": "train", "valid": "val"}
    splits.update({test: test for test, langs in spec.test_sets.items() if src in langs and tgt in langs})
    result = {}
    for key, split in splits.items():
        files = []
        for lang in (src, tgt):
            file_name = f"{split}.{lang}.gz"
            remote = Remote(spec.base_url + file_name, spec.digests.get(file_name))
            files.append(str(_fetch_file(remote, cache_dir / name / file_name, cache_dir, mirror)))
        result[key] = (files[0], files[1])
    return result


# ----------------------------------------------------------------------------- wmt


def _fetch_wmt(name: str, spec: WmtSpec, src: str, tgt: str, cache_dir: Path, mirror: Optional[str]) -> Splits:
    """WMT: one concatenated training corpus, newstest valid and test sets."""
    pair = f"{src}-{tgt}"
    if pair not in spec.pairs:
        raise ValueError(f"{name} has no {pair}; supported pairs: {', '.join(spec.pairs)}")
    root = cache_dir / name
    result = {
        "train": _wmt_train(spec.train, src, tgt, root, cache_dir, mirror),
        "valid": _wmt_test(spec.valid, pair, root, cache_dir, mirror),
    }
    for test in spec.tests:
        result[test.key] = _wmt_test(test, pair, root, cache_dir, mirror)
    return result


def _wmt_train(
    parts: tuple[TrainPart, ...], src: str, tgt: str, root: Path, cache_dir: Path, mirror: Optional[str]
) -> tuple[str, str]:
    """train.<pair>.<lang>.gz: every part's STEM.<lang> member, in spec order."""
    pair = "-".join(sorted((src, tgt)))  # the same corpus serves both directions
    outputs = {lang: root / f"train.{pair}.{lang}.gz" for lang in (src, tgt)}
    if not all(path.exists() for path in outputs.values()):
        tarballs = [
            _fetch_file(part.remote, root / PurePosixPath(part.remote.url).name, cache_dir, mirror) for part in parts
        ]
        started = time.monotonic()
        temps = {lang: path.with_name(path.name + ".tmp") for lang, path in outputs.items()}
        with (
            gzip.open(temps[src], "wb", compresslevel=6) as src_out,
            gzip.open(temps[tgt], "wb", compresslevel=6) as tgt_out,
        ):
            writers = {src: src_out, tgt: tgt_out}  # level 6: 9 is far slower for ~1 GB of text
            lines = sum(_append_part(part.stem, tarball, writers) for part, tarball in zip(parts, tarballs))
        for lang, path in outputs.items():  # renamed only when complete: a crash leaves no train file
            temps[lang].replace(path)
        _log(
            f"{root.name}/train.{pair}: {lines} sentence pairs from {len(parts)} corpora "
            f"in {time.monotonic() - started:.1f} s"
        )
    return str(outputs[src]), str(outputs[tgt])


def _append_part(stem: str, tarball: Path, writers: dict[str, IO[bytes]]) -> int:
    """Append STEM.<lang> of TARBALL to writers[lang]; the number of (aligned) lines."""
    wanted = {f"{stem}.{lang}": lang for lang in writers}
    counts: dict[str, int] = {}

    def copy(member: str, data: IO[bytes]) -> None:
        counts[wanted[member]] = _copy_lines(data, writers[wanted[member]])

    _stream_members(tarball, set(wanted), copy)
    if len(set(counts.values())) != 1:
        raise ValueError(
            f"{tarball.name}: {stem} members have different line counts {counts}; "
            f"delete {tarball} and download it again"
        )
    return next(iter(counts.values()))


def _copy_lines(data: IO[bytes], out: IO[bytes]) -> int:
    """Copy lines, ending each with one \\n and turning stray \\r into spaces; the line count."""
    # Readers open text with universal newlines, which would split a line at a lone \r
    # (Common Crawl has some) and misalign source and target. Every line also gets its
    # \n so that a part without a final newline does not merge into the next part.
    count = 0
    for line in data:
        out.write(line.rstrip(b"\r\n").replace(b"\r", b" ") + b"\n")
        count += 1
    return count


def _stream_members(tarball: Path, names: set[str], handle: Callable[[str, IO[bytes]], None]) -> None:
    """Call handle(base name, data) for each regular member of TARBALL whose base name is in NAMES."""
    # Stream mode ("r|*") reads the archive once; random access into a 900 MB .tgz would
    # decompress it again for every member. Matching base names accepts both a flat
    # layout and a folder (news-commentary puts its files under training/).
    found = set()
    try:
        with tarfile.open(tarball, "r|*") as tar:
            for member in tar:
                base = PurePosixPath(member.name).name
                if member.isfile() and base in names and base not in found:
                    handle(base, tar.extractfile(member))
                    found.add(base)
    except (tarfile.TarError, EOFError, zlib.error) as err:  # a cut-short or damaged archive
        raise ValueError(
            f"cannot read {tarball.name} ({err}); delete {tarball} and download it again, or check the mirror"
        ) from None
    if found != names:
        raise ValueError(
            f"{tarball.name} lacks {', '.join(sorted(names - found))}; "
            f"delete {tarball} and download it again, or check the mirror"
        )


def _wmt_test(test: TestSet, pair: str, root: Path, cache_dir: Path, mirror: Optional[str]) -> tuple[str, str]:
    """Plain-text source and reference of a newstest set, extracted from its SGML."""
    members = test.members[pair]
    outputs = [root / PurePosixPath(member).name.removesuffix(".sgm") for member in members]
    if all(path.exists() for path in outputs):
        return str(outputs[0]), str(outputs[1])
    tarball = _fetch_file(test.remote, root / PurePosixPath(test.remote.url).name, cache_dir, mirror)
    raw = root / "raw"
    raw.mkdir(exist_ok=True)

    def save(member: str, data: IO[bytes]) -> None:
        (raw / member).write_bytes(data.read())

    _stream_members(tarball, {PurePosixPath(member).name for member in members}, save)
    temps = [path.with_name(path.name + ".tmp") for path in outputs]
    for sgm, temp in zip(members, temps):
        _sgml_to_text(test.sacrebleu_name, raw / PurePosixPath(sgm).name, temp)
    counts = [_count_lines(temp) for temp in temps]
    if counts[0] != counts[1] or counts[0] == 0:
        raise ValueError(
            f"{test.key} {pair}: source has {counts[0]} lines, reference {counts[1]}; "
            f"delete {tarball} and download it again"
        )
    for temp, path in zip(temps, outputs):
        temp.replace(path)
    return str(outputs[0]), str(outputs[1])


def _count_lines(path: Path) -> int:
    """Number of lines of a plain text file."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _sgml_to_text(sacrebleu_name: str, sgm: Path, txt: Path) -> None:
    """Segments of an SGML file as text lines, extracted by sacrebleu's own code."""
    # The same extraction sacrebleu applies before scoring `-t wmt14`, so our references
    # are line-for-line the ones BLEU is reported against.
    from sacrebleu.dataset import DATASETS as SACREBLEU

    SACREBLEU[sacrebleu_name]._convert_format(str(sgm), str(txt))


# ----------------------------------------------------------------------------- downloads


class _Transient(Exception):
    """A failure worth retrying (short read, unusable range answer)."""


def _fetch_file(remote: Remote, dest: Path, cache_dir: Path, mirror: Optional[str]) -> Path:
    """DEST, verified: reused from the cache or downloaded (resuming DEST.part) and checked."""
    key = dest.relative_to(cache_dir).as_posix()
    expected = remote.digest or _records(cache_dir).get(key)
    algo = expected.partition(":")[0] if expected else "sha256"
    if dest.exists():
        actual = _digest(dest, algo)
        if expected is None:  # in the cache but never recorded (checksums.json was removed)
            _trust(cache_dir, key, actual, "found in the cache")
        if expected is None or actual == expected:
            return dest
        _log(f"{key}: cached copy has {actual}, expected {expected}; downloading it again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    url = _url(remote.url, mirror)
    started = time.monotonic()
    sized = _download(url, part)
    actual = _digest(part, algo)
    if expected is None and not sized:  # nothing tells a whole file from a cut-short one
        part.unlink()
        raise ValueError(
            f"cannot verify {key} from {url}: the server sent no file size (Content-Length) and no "
            f"checksum is known, so a cut-short download would be trusted; the file was deleted: "
            f"download from a server (--mirror) that sends Content-Length"
        )
    if expected is None:
        _trust(cache_dir, key, actual, "downloaded")
    elif actual != expected:
        part.unlink()
        origin = "" if remote.digest else " (recorded in checksums.json on first use)"
        raise ValueError(
            f"checksum mismatch for {key} from {url}: expected {expected}{origin}, "
            f"got {actual}; the file was deleted: run again, and if it persists "
            f"check the mirror"
        )
    part.replace(dest)
    _log(f"{key}: {_size(dest.stat().st_size)} in {time.monotonic() - started:.1f} s")
    return dest


def _download(url: str, part: Path) -> bool:
    """Complete PART from URL, retrying transient errors with backoff and resuming each time;
    whether its size was checked against the size the server gave."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _download_once(url, part) is not None
        except urllib.error.HTTPError as err:
            err.close()
            if err.code < 500:  # 404, 403...: retrying will not help
                raise ValueError(
                    f"cannot download {url}: HTTP {err.code} {err.reason}; check the dataset name and the mirror"
                ) from None
            error: Exception = err
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, _Transient) as err:
            error = err
        if attempt == ATTEMPTS:
            raise ValueError(
                f"cannot download {url} after {ATTEMPTS} attempts ({error}); "
                f"check the network or the mirror: a new run resumes {part.name}"
            ) from None
        wait = BACKOFF_S * 2 ** (attempt - 1)
        _log(f"{part.name}: {error}; retrying in {wait:.1f} s ({attempt}/{ATTEMPTS - 1})")
        time.sleep(wait)


def _download_once(url: str, part: Path) -> Optional[int]:
    """One request: append to PART from its current size (Range), or start over on a 200; the
    file size PART was checked against, None when the server gave none."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "raymt-download"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as err:
        if err.code != 416 or not offset:
            raise
        with err:  # range past the end: PART is complete if the server's size says so
            total = _range_total(err.headers)
        if total == offset:
            return total
        part.unlink()
        raise _Transient(f"server rejected resuming at byte {offset}; starting over") from None
    with response:
        if response.status == 206 and not response.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
            part.unlink()
            raise _Transient("server answered a different byte range; starting over")
        # 206: the rest of the file. 200: the server ignores Range, so the whole file again.
        mode = "ab" if response.status == 206 else "wb"
        if offset and mode == "wb":
            _log(f"{part.name}: server does not resume downloads; starting over")
        length = response.headers.get("Content-Length")
        total = _range_total(response.headers) if mode == "ab" else (int(length) if length else None)
        # A chunked reply ends with a zero-length chunk: http.client raises if it is cut short.
        framed = response.headers.get("Transfer-Encoding", "").lower() == "chunked"
        received = 0
        with open(part, mode) as out:
            while chunk := response.read(CHUNK):
                out.write(chunk)
                received += len(chunk)
    # http.client returns a short body silently when the connection drops, so check here.
    if length is not None and received < int(length):
        raise _Transient(f"connection closed after {received} of {length} bytes")
    size = part.stat().st_size
    if total is None:
        return size if framed and mode == "wb" else None
    if size < total:  # e.g. a server that answers a range request short
        raise _Transient(f"reply ended at byte {size} of {total}")
    if size > total:
        part.unlink()
        raise _Transient(f"got {size} bytes of a {total}-byte file; starting over")
    return total


def _range_total(headers: Any) -> Optional[int]:
    """The whole file's size in a Content-Range header ("bytes 0-9/1234", "bytes */1234"), if given."""
    total = (headers.get("Content-Range") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else None


def _size(n: int) -> str:
    """Byte count for people: 950 B, 27.3 kB, 1.2 MB, 0.9 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _digest(path: Path, algo: str) -> str:
    """ "ALGO:HEX" of a file."""
    hasher = hashlib.new(algo)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return f"{algo}:{hasher.hexdigest()}"


def _records(cache_dir: Path) -> dict[str, str]:
    """Digests recorded on first use: cache-relative file name -> "sha256:HEX"."""
    path = cache_dir / "checksums.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not valid JSON; delete it to record checksums afresh") from None


def _trust(cache_dir: Path, key: str, digest: str, how: str) -> None:
    """Record DIGEST for KEY in checksums.json (trust on first use) and say so."""
    records = _records(cache_dir)
    records[key] = digest
    cache_dir.mkdir(parents=True, exist_ok=True)
    temp = cache_dir / "checksums.json.tmp"
    temp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    temp.replace(cache_dir / "checksums.json")  # atomic: a crash never leaves half a record file
    _log(
        f"{key}: no known checksum; {how} file recorded as {digest} in checksums.json "
        f"(trusted on first use, verified on reuse)"
    )
