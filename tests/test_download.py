"""raymt.download against a local HTTP server: mirror, resume, checksums, cache, errors."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import re
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from raymt.data import download
from raymt.data.download import fetch_dataset

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
needs_multi30k = pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"{MULTI30K} is missing")
SHA256 = {  # the real upstream files, as in raymt.download
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
}


# ----------------------------------------------------------------------------- server


@dataclasses.dataclass
class Server:
    """What the test server serves and saw; tests set the fault knobs."""

    root: Path
    url: str = ""
    requests: list = dataclasses.field(default_factory=list)  # dicts: name, range, status, sent
    ranges: bool = True  # False: ignore Range, answer 200
    drop_after: dict = dataclasses.field(default_factory=dict)  # name -> bytes, then close (once)
    errors: dict = dataclasses.field(default_factory=dict)  # name -> how many 503s first
    corrupt: set = dataclasses.field(default_factory=set)  # names served with bytes flipped
    short: dict = dataclasses.field(default_factory=dict)  # name -> at most these bytes per range reply
    no_length: set = dataclasses.field(default_factory=set)  # names served without Content-Length

    def seen(self, name: str) -> list:
        """Requests for one file name."""
        return [r for r in self.requests if r["name"] == name]


def _handler(server: Server) -> type:
    """A request handler with Range support and injectable faults (the stdlib one has neither)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            record = {"name": name, "range": self.headers.get("Range"), "status": 0, "sent": 0}
            server.requests.append(record)
            path = server.root / name
            if server.errors.get(name):
                server.errors[name] -= 1
                return self._reply(record, 503, b"busy")
            if "/" in name or not path.is_file():
                return self._reply(record, 404, b"not found")
            data = path.read_bytes()
            if name in server.corrupt:
                data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
            match = re.fullmatch(r"bytes=(\d+)-", record["range"] or "")
            length = {"Content-Length": None} if name in server.no_length else {}
            if not (match and server.ranges):
                return self._reply(record, 200, data, length, limit=server.drop_after.pop(name, None))
            start = int(match.group(1))
            if start >= len(data):
                return self._reply(record, 416, b"", {"Content-Range": f"bytes */{len(data)}"})
            end = min(len(data), start + server.short.get(name, len(data)))  # a short answer, well formed
            return self._reply(
                record,
                206,
                data[start:end],
                {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"},
                limit=server.drop_after.pop(name, None),
            )

        def _reply(
            self, record: dict, status: int, body: bytes, headers: dict | None = None, limit: int | None = None
        ) -> None:
            """Send BODY, or only its first LIMIT bytes and then close (a dropped connection)."""
            record["status"] = status
            self.send_response(status)
            for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                if value is not None:  # None: leave the header out
                    self.send_header(key, value)
            self.end_headers()
            sent = body if limit is None else body[:limit]
            self.wfile.write(sent)
            record["sent"] = len(sent)
            self.close_connection = True

        def log_message(self, *args) -> None:
            pass

    return Handler


@contextlib.contextmanager
def serve(root: Path):
    """A ThreadingHTTPServer on 127.0.0.1 serving ROOT, as a Server."""
    server = Server(root)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    """No real backoff waits, and no mirror leaking in from the environment."""
    monkeypatch.setattr(download, "BACKOFF_S", 0.01)
    monkeypatch.delenv("RAYMT_MIRROR", raising=False)


@pytest.fixture
def m30k(monkeypatch):
    """Server over the local Multi30k copy, which holds only the test_2016_flickr test set."""
    spec = download.DATASETS["multi30k"]
    monkeypatch.setitem(
        download.DATASETS,
        "multi30k",
        dataclasses.replace(spec, test_sets={"test_2016_flickr": spec.test_sets["test_2016_flickr"]}),
    )
    with serve(MULTI30K) as server:
        yield server


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _gz_lines(path: str | Path) -> int:
    with gzip.open(path, "rb") as f:
        return sum(1 for _ in f)


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- multi30k


@needs_multi30k
def test_multi30k_through_mirror(tmp_path, m30k, err_lines):
    splits = fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    assert set(splits) == {"train", "valid", "test_2016_flickr"}
    lines = {"train": 29000, "valid": 1014, "test_2016_flickr": 1000}
    for key, (src, tgt) in splits.items():
        assert src.endswith(".en.gz") and tgt.endswith(".de.gz")
        for path in (src, tgt):
            assert _sha256(path) == SHA256[Path(path).name]
            assert _gz_lines(path) == lines[key]
    assert not list(tmp_path.rglob("*.part")) and not (tmp_path / "checksums.json").exists()
    assert len(err_lines()) == 6  # one line per file
    # the reverse direction is the same files, swapped, and needs no download
    count = len(m30k.requests)
    reverse = fetch_dataset("multi30k", "de", "en", tmp_path, mirror=m30k.url)
    assert reverse["valid"] == splits["valid"][::-1] and len(m30k.requests) == count


@needs_multi30k
def test_mirror_from_environment(tmp_path, m30k, monkeypatch):
    monkeypatch.setenv("RAYMT_MIRROR", m30k.url)
    fetch_dataset("multi30k", "en", "de", tmp_path)
    assert len(m30k.requests) == 6


@needs_multi30k
def test_interrupted_download_resumes_with_range(tmp_path, m30k):
    size = (MULTI30K / "train.en.gz").stat().st_size
    m30k.drop_after["train.en.gz"] = 300_000
    splits = fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    first, second = m30k.seen("train.en.gz")
    assert first["range"] is None and first["sent"] == 300_000
    assert second["range"] == "bytes=300000-" and second["status"] == 206
    assert second["sent"] == size - 300_000
    assert _sha256(splits["train"][0]) == SHA256["train.en.gz"]


@needs_multi30k
def test_part_left_by_a_killed_run_is_resumed(tmp_path, m30k):
    part = tmp_path / "multi30k" / "val.de.gz.part"
    part.parent.mkdir()
    part.write_bytes((MULTI30K / "val.de.gz").read_bytes()[:1000])
    splits = fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    (request,) = m30k.seen("val.de.gz")
    assert request["range"] == "bytes=1000-" and request["status"] == 206
    assert _sha256(splits["valid"][1]) == SHA256["val.de.gz"] and not part.exists()


@needs_multi30k
def test_complete_part_is_verified_and_kept(tmp_path, m30k):
    # a run killed between download and rename leaves a whole .part: the server answers 416
    data = (MULTI30K / "val.de.gz").read_bytes()
    (tmp_path / "multi30k").mkdir()
    (tmp_path / "multi30k" / "val.de.gz.part").write_bytes(data)
    splits = fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    (request,) = m30k.seen("val.de.gz")
    assert request["range"] == f"bytes={len(data)}-" and request["status"] == 416
    assert _sha256(splits["valid"][1]) == SHA256["val.de.gz"]


@needs_multi30k
def test_server_without_range_support_starts_over(tmp_path, m30k):
    m30k.ranges = False
    m30k.drop_after["val.en.gz"] = 5000
    splits = fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    first, second = m30k.seen("val.en.gz")
    assert second["range"] == "bytes=5000-" and second["status"] == 200
    assert _sha256(splits["valid"][0]) == SHA256["val.en.gz"]


@needs_multi30k
def test_server_errors_are_retried(tmp_path, m30k):
    m30k.errors["val.en.gz"] = 2
    fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    assert [r["status"] for r in m30k.seen("val.en.gz")] == [503, 503, 200]


@needs_multi30k
def test_persistent_server_errors_give_up(tmp_path, m30k):
    m30k.errors["val.en.gz"] = 99
    with pytest.raises(ValueError, match="after 5 attempts") as excinfo:
        fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    assert "val.en.gz" in _one_line_error(excinfo)


@needs_multi30k
def test_corrupted_download_is_rejected(tmp_path, m30k):
    m30k.corrupt.add("val.de.gz")
    with pytest.raises(ValueError, match="checksum mismatch for multi30k/val.de.gz") as excinfo:
        fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    message = _one_line_error(excinfo)
    assert SHA256["val.de.gz"] in message and "mirror" in message
    assert not (tmp_path / "multi30k" / "val.de.gz").exists()
    assert not (tmp_path / "multi30k" / "val.de.gz.part").exists()


@needs_multi30k
def test_second_fetch_reuses_cache(tmp_path, m30k):
    first = fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    count = len(m30k.requests)
    assert fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url) == first
    assert len(m30k.requests) == count
    # a cached file that no longer matches its checksum is downloaded again, alone
    Path(first["valid"][0]).write_bytes(b"damaged")
    fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    assert [r["name"] for r in m30k.requests[count:]] == ["val.en.gz"]
    assert _sha256(first["valid"][0]) == SHA256["val.en.gz"]


def test_unknown_names_and_pairs(tmp_path):
    cases = [
        ("europarl", "en", "de", "unknown dataset 'europarl'; known datasets: multi30k, wmt14"),
        ("multi30k", "en", "es", "multi30k has no en-es"),
        ("multi30k", "en", "en", "multi30k has no en-en"),
        ("wmt14", "en", "fr", "wmt14 has no en-fr; supported pairs: en-de, de-en"),
    ]
    for name, src, tgt, expected in cases:
        with pytest.raises(ValueError) as excinfo:
            fetch_dataset(name, src, tgt, tmp_path, mirror="http://127.0.0.1:9/")
        assert expected in _one_line_error(excinfo)
    assert not list(tmp_path.iterdir())


def test_404_is_an_immediate_error(tmp_path):
    with serve(tmp_path / "empty") as server:
        with pytest.raises(ValueError, match="HTTP 404") as excinfo:
            fetch_dataset("multi30k", "en", "de", tmp_path / "cache", mirror=server.url)
    assert f"{server.url}train.en.gz" in _one_line_error(excinfo)
    assert len(server.requests) == 1


def _write_gz(path: Path, lines: list[str]) -> None:
    path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode(), mtime=0))


def test_unknown_checksums_are_trusted_on_first_use(tmp_path, capsys):
    served = tmp_path / "served"
    served.mkdir()
    for split, n in (("train", 5), ("val", 2), ("test_2016_flickr", 3)):
        for lang in ("fr", "cs"):
            _write_gz(served / f"{split}.{lang}.gz", [f"{split} {lang} {i}" for i in range(n)])
    cache = tmp_path / "cache"
    with serve(served) as server:
        splits = fetch_dataset("multi30k", "fr", "cs", cache, mirror=server.url)
        assert set(splits) == {"train", "valid", "test_2016_flickr"}  # no 2017 sets for cs
        records = download._records(cache)
        assert records["multi30k/val.cs.gz"] == "sha256:" + _sha256(served / "val.cs.gz")
        assert len(records) == 6
        assert capsys.readouterr().err.count("no known checksum") == 6
        # a later download must match the recorded digest
        Path(splits["valid"][1]).unlink()
        _write_gz(served / "val.cs.gz", ["changed upstream"])
        with pytest.raises(ValueError, match="recorded in checksums.json") as excinfo:
            fetch_dataset("multi30k", "fr", "cs", cache, mirror=server.url)
    assert "multi30k/val.cs.gz" in _one_line_error(excinfo)


def _served_fr_cs(root: Path) -> Path:
    """Multi30k fr/cs files (no known checksum: trusted on first use), val.fr.gz of 3,000+ bytes."""
    root.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("fr", "cs"):
            _write_gz(root / f"{split}.{lang}.gz", [f"{split} {lang} {i}" for i in range(3)])
    (root / "val.fr.gz").write_bytes(gzip.compress(bytes(range(256)) * 12, compresslevel=0, mtime=0))
    return root


def test_a_short_range_reply_is_resumed_until_the_declared_size(tmp_path):
    served = _served_fr_cs(tmp_path / "served")
    size = (served / "val.fr.gz").stat().st_size
    with serve(served) as server:
        server.drop_after["val.fr.gz"] = 1000  # the connection drops, then each range reply is short
        server.short["val.fr.gz"] = 800
        splits = fetch_dataset("multi30k", "fr", "cs", tmp_path / "cache", mirror=server.url)
    assert [(r["range"], r["sent"]) for r in server.seen("val.fr.gz")] == [
        (None, 1000),
        ("bytes=1000-", 800),
        ("bytes=1800-", 800),
        ("bytes=2600-", size - 2600),
    ]
    assert _sha256(splits["valid"][0]) == _sha256(served / "val.fr.gz")
    assert download._records(tmp_path / "cache")["multi30k/val.fr.gz"] == "sha256:" + _sha256(served / "val.fr.gz")


def test_a_file_cut_short_is_never_installed_nor_trusted(tmp_path):
    served = _served_fr_cs(tmp_path / "served")
    cache = tmp_path / "cache"
    with serve(served) as server:
        server.drop_after["val.fr.gz"] = 1000
        server.short["val.fr.gz"] = 10  # never done within the attempts
        with pytest.raises(ValueError, match="after 5 attempts") as excinfo:
            fetch_dataset("multi30k", "fr", "cs", cache, mirror=server.url)
        assert "val.fr.gz" in _one_line_error(excinfo)
        # Without Content-Length a dropped connection looks like the end of the file.
        server.short.clear()
        server.no_length.add("val.fr.gz")
        server.ranges = False
        (cache / "multi30k" / "val.fr.gz.part").unlink()
        server.drop_after["val.fr.gz"] = 1000
        with pytest.raises(ValueError, match="cannot verify multi30k/val.fr.gz .* no file size") as excinfo:
            fetch_dataset("multi30k", "fr", "cs", cache, mirror=server.url)
        _one_line_error(excinfo)
    assert not (cache / "multi30k" / "val.fr.gz").exists() and not (cache / "multi30k" / "val.fr.gz.part").exists()
    assert "multi30k/val.fr.gz" not in download._records(cache)


@needs_multi30k
def test_a_file_without_content_length_is_verified_by_its_known_checksum(tmp_path, m30k):
    m30k.no_length.add("val.en.gz")
    splits = fetch_dataset("multi30k", "en", "de", tmp_path, mirror=m30k.url)
    assert _sha256(splits["valid"][0]) == SHA256["val.en.gz"] and not (tmp_path / "checksums.json").exists()


# ----------------------------------------------------------------------------- wmt14


def _tgz(path: Path, members: dict[str, bytes]) -> str:
    """Write a .tgz with these members; its MD5."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.md5(path.read_bytes()).hexdigest()


def _sgml(setid: str, lines: list[str]) -> bytes:
    """A newstest file in the WMT "fake SGML" layout."""
    segs = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, 1))
    return (
        f'<srcset setid="{setid}" srclang="any">\n<doc sysid="ref" docid="d1" genre="news" '
        f'origlang="en">\n<p>\n{segs}</p>\n</doc>\n</srcset>\n'
    ).encode()


def _fake_wmt14(root: Path) -> tuple[str, str]:
    """The five WMT14 tarballs, members named as upstream; MD5s of the two test tarballs."""
    root.mkdir()
    _tgz(
        root / "de-en.tgz",
        {"europarl-v7.de-en.de": b"ep de 1\nep de 2\n", "europarl-v7.de-en.en": b"ep en 1\nep en 2\n"},
    )
    _tgz(
        root / "training-parallel-commoncrawl.tgz",
        {
            "commoncrawl.de-en.annotation": b"x\n",
            "commoncrawl.fr-en.fr": b"cc fr\n",
            "commoncrawl.de-en.de": b"cc de 1\ncc\rde 2\r\n",
            "commoncrawl.de-en.en": b"cc en 1\ncc en 2",
        },
    )
    _tgz(
        root / "training-parallel-nc-v9.tgz",
        {
            "training/news-commentary-v9.de-en.de": b"nc de\n",
            "training/news-commentary-v9.de-en.en": b"nc en\n",
            "training/news-commentary-v9.cs-en.cs": b"nc cs\n",
        },
    )
    md5_13 = _tgz(
        root / "test.tgz",
        {
            f"test/newstest2013-src.{lang}.sgm": _sgml("newstest2013", [f"nt13 {lang} {i}" for i in range(3)])
            for lang in ("en", "de", "fr")
        },
    )
    md5_14 = _tgz(
        root / "test-filtered.tgz",
        {
            f"test/newstest2014-deen-{side}.{lang}.sgm": _sgml(
                "newstest2014", [f"nt14 {side} {lang}  {i} " for i in range(4)]
            )
            for side in ("src", "ref")
            for lang in ("en", "de")
        },
    )
    return md5_13, md5_14


def test_wmt14_spec_takes_test_sets_from_sacrebleu():
    from sacrebleu.dataset import DATASETS as SACREBLEU

    spec = download.DATASETS["wmt14"]
    assert spec.valid.remote.url == SACREBLEU["wmt13"].data[0]
    assert spec.valid.remote.digest == "md5:" + SACREBLEU["wmt13"].md5[0]
    assert spec.tests[0].remote.digest == "md5:" + SACREBLEU["wmt14"].md5[0]
    assert spec.tests[0].members["en-de"] == ("test/newstest2014-deen-src.en.sgm", "test/newstest2014-deen-ref.de.sgm")
    assert all(part.remote.digest is None for part in spec.train)  # none known: trust on first use


def test_wmt14_from_fake_tarballs(tmp_path, monkeypatch, capsys):
    md5_13, md5_14 = _fake_wmt14(tmp_path / "served")
    spec = download.DATASETS["wmt14"]
    valid = dataclasses.replace(spec.valid, remote=dataclasses.replace(spec.valid.remote, digest=f"md5:{md5_13}"))
    test = dataclasses.replace(spec.tests[0], remote=dataclasses.replace(spec.tests[0].remote, digest=f"md5:{md5_14}"))
    monkeypatch.setitem(download.DATASETS, "wmt14", dataclasses.replace(spec, valid=valid, tests=(test,)))
    cache = tmp_path / "cache"
    with serve(tmp_path / "served") as server:
        monkeypatch.setenv("RAYMT_MIRROR", server.url)
        splits = fetch_dataset("wmt14", "en", "de", cache)
        assert set(splits) == {"train", "valid", "newstest2014"}
        with gzip.open(splits["train"][0], "rt") as f:
            assert f.read() == "ep en 1\nep en 2\ncc en 1\ncc en 2\nnc en\n"
        with gzip.open(splits["train"][1], "rt") as f:
            assert f.read() == "ep de 1\nep de 2\ncc de 1\ncc de 2\nnc de\n"  # lone \r -> space
        assert Path(splits["valid"][1]).read_text() == "nt13 de 0\nnt13 de 1\nnt13 de 2\n"
        assert Path(splits["newstest2014"][0]).read_text().splitlines() == [
            f"nt14 src en {i}" for i in range(4)
        ]  # sacrebleu's extraction collapses spaces
        assert Path(splits["newstest2014"][1]).read_text().startswith("nt14 ref de 0\n")
        assert set(download._records(cache)) == {
            "wmt14/de-en.tgz",
            "wmt14/training-parallel-commoncrawl.tgz",
            "wmt14/training-parallel-nc-v9.tgz",
        }
        assert "5 sentence pairs from 3 corpora" in capsys.readouterr().err
        # the other direction shares train and newstest2013; newstest2014 has its own files
        count = len(server.requests)
        reverse = fetch_dataset("wmt14", "de", "en", cache)
        assert reverse["train"] == splits["train"][::-1]
        assert reverse["valid"] == splits["valid"][::-1]
        assert Path(reverse["newstest2014"][0]).read_text().startswith("nt14 src de 0\n")
        assert [r["name"] for r in server.requests[count:]] == []  # test-filtered.tgz is cached


def test_a_cut_short_tarball_is_a_one_line_error(tmp_path, monkeypatch):
    _fake_wmt14(tmp_path / "served")
    tarball = tmp_path / "served" / "de-en.tgz"
    tarball.write_bytes(tarball.read_bytes()[:-80])  # the server sends it whole: only reading finds the cut
    with serve(tmp_path / "served") as server:
        with pytest.raises(ValueError, match=r"cannot read de-en.tgz \(.*\); delete .*de-en.tgz") as excinfo:
            fetch_dataset("wmt14", "en", "de", tmp_path / "cache", mirror=server.url)
    _one_line_error(excinfo)
    assert not list((tmp_path / "cache" / "wmt14").glob("train.*.gz"))
