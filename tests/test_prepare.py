"""`python -m raymt.data prepare`: raw corpora -> SentencePiece + Parquet shards, exact counts, safe output."""

import gzip
import json
import lzma
import zlib
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raymt.config import CorpusOptions, CorpusSpec, PrepareConfig
from raymt.data import format as corpus_format
from raymt.data import mono, prepare, shards, sources, text
from raymt.data.__main__ import main

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()
SMALL = ["--vocab-size", "80", "--sp-model-type", "bpe"]  # tiny vocabulary: seconds per corpus


def sentence(i: int, n: int = 4) -> str:
    """A distinct short sentence made of known words."""
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)) + f" n{i}"


def mirrored(count: int, start: int = 0) -> list[tuple[str, str]]:
    """Pairs whose target is the source's words reversed: same token counts, ratio 1."""
    return [(sentence(i), " ".join(reversed(sentence(i).split()))) for i in range(start, start + count)]


def write_lines(path: Path, lines: list, compress: str = "") -> Path:
    """Write lines (str or raw bytes) to path, gzip/xz/zstd-compressed as asked."""
    data = b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines)
    opener = {"gz": gzip.open, "xz": lzma.open, "zst": lambda p, mode: pa.CompressedOutputStream(str(p), "zstd")}.get(
        compress, open
    )
    with opener(path, "wb") as f:
        f.write(data)
    return path


def write_prefix(prefix: Path, pairs: list[tuple], compress: str = "") -> str:
    """PREFIX.en and PREFIX.de (optionally compressed); returns PREFIX."""
    ext = f".{compress}" if compress else ""
    write_lines(Path(f"{prefix}.en{ext}"), [s for s, _ in pairs], compress)
    write_lines(Path(f"{prefix}.de{ext}"), [t for _, t in pairs], compress)
    return str(prefix)


def check_inputs(cfg: PrepareConfig, train: list, valid: list) -> list[dict]:
    """The driver's check of one pair's inputs (`check_corpus_inputs` of a corpus of one)."""
    return sources.check_corpus_inputs(cfg, [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), train, valid)])


def decoded_train(out: Path) -> Counter:
    """The training shards decoded back to text, as a multiset of pairs."""
    prepared = corpus_format.open_corpus(str(out))
    tokenizer = prepared.tokenizer()
    pairs: Counter = Counter()
    for path, num_pairs, index in prepared.shards():
        table = pq.read_table(path)
        assert table.num_rows == num_pairs and table.schema.field("src_ids").type == pa.list_(pa.int32())
        lengths = [
            len(s) + len(t) for s, t in zip(table.column("src_ids").to_pylist(), table.column("tgt_ids").to_pylist())
        ]
        # What epoch slices balance on: tokens after every 1024 rows and after the last.
        ends = [*range(1024, num_pairs, 1024), num_pairs]
        assert list(index) == [sum(lengths[:e]) for e in ends]
        for s, t in zip(table.column("src_ids").to_pylist(), table.column("tgt_ids").to_pylist()):
            pairs[tokenizer.decode(s), tokenizer.decode(t)] += 1
    return pairs


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the CLI in this process (the session's Ray cluster); (status, stdout, stderr)."""
    status = main(["prepare", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def error_line(err: str) -> str:
    """The one error line the CLI printed (Ray's own log lines may surround it)."""
    lines = [line for line in err.splitlines() if line.startswith("raymt.data: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_text_gz_corpus_end_to_end(ray_cluster, tmp_path, capsys):
    train = mirrored(40) + [("  padded  ", "  gepolstert ")]
    prefix = write_prefix(tmp_path / "train", train, "gz")
    valid = write_prefix(tmp_path / "val", mirrored(5, 100) + [("", "leer")])
    test = write_prefix(tmp_path / "newstest", mirrored(3, 200))
    out = tmp_path / "corpus"
    status, stdout, _ = run_cli(
        capsys, "--out", str(out), "--train", prefix, "--valid", valid, "--test", test, "--shard-pairs", "7", *SMALL
    )
    assert status == 0
    assert "kept" in stdout and "dropped in en-de: none" in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "raymt-corpus/2" and manifest["command"].startswith("python -m raymt.data")
    train_split = manifest["corpora"][0]["train"]
    assert train_split["input_pairs"] == 41 and train_split["num_pairs"] == 41
    assert set(train_split["dropped"].values()) == {0}
    assert [f["path"] for f in train_split["files"]] == [f"train/en-de/part-{i:05d}.parquet" for i in range(6)]
    assert all(f["num_pairs"] <= 7 for f in train_split["files"])
    assert decoded_train(out) == Counter((s.strip(), t.strip()) for s, t in train)
    prepared = corpus_format.open_corpus(str(out))
    tokenizer = prepared.tokenizer()
    for side, name in ((0, "src_tokens"), (1, "tgt_tokens")):
        assert train_split[name] == sum(len(tokenizer.encode(p[side].strip())) for p in train)
    # Validation and test sets keep every row (the empty one too), stripped.
    src, tgt = prepared.eval_set("valid")
    assert (src[-1], tgt[-1], len(src)) == ("", "leer", 6)
    assert prepared.eval_set("newstest")[0] == [s for s, _ in mirrored(3, 200)]
    assert not list(tmp_path.glob("corpus.tmp-*"))


@pytest.mark.parametrize("where", ["driver", "ray"])
def test_pairs_that_tokenize_to_nothing_are_dropped_as_empty(ray_cluster, tmp_path, capsys, monkeypatch, where):
    """A side of only a zero-width space, a control character or a byte-order mark passes the text
    rules (pass 1) but has no token (pass 2): dropped and counted as empty, not a changed input."""
    if where == "ray":
        monkeypatch.setattr(shards, "DRIVER_BYTES", 0)
    invisible = [("\u200b", "alpha beta"), ("\x01", "alpha beta"), ("gamma delta", "\ufeff")]
    prefix = write_prefix(tmp_path / "train", mirrored(20) + invisible + mirrored(10, 20))
    valid = write_prefix(tmp_path / "val", mirrored(3, 100))
    argv = ["--out", str(tmp_path / "corpus"), "--train", prefix, "--valid", valid, *SMALL]
    status, stdout, err = run_cli(capsys, *argv)
    assert status == 0, err
    train = json.loads((tmp_path / "corpus" / "manifest.json").read_text())["corpora"][0]["train"]
    assert (train["input_pairs"], train["num_pairs"], train["dropped"]["empty"]) == (33, 30, 3)
    assert sum(train["dropped"].values()) == 3
    assert "dropped in en-de: empty 3" in stdout.splitlines()
    assert decoded_train(tmp_path / "corpus") == Counter(mirrored(30))
    assert run_cli(capsys, *argv)[0] == 0


def write_table_input(tmp_path: Path, kind: str, pairs: list[tuple]) -> list[str]:
    """The pairs as a TSV (.xz, extra column), JSONL (.zst) or Parquet file; the CLI flags for it."""
    if kind == "tsv":
        path = write_lines(tmp_path / "train.tsv.xz", [f"{i}\t{s}\t{t}" for i, (s, t) in enumerate(pairs)], "xz")
        return ["--train", str(path), "--src-col", "1", "--tgt-col", "2"]
    if kind == "jsonl":
        lines = [json.dumps({"id": i, "en": s, "de": t}) for i, (s, t) in enumerate(pairs)]
        return ["--train", str(write_lines(tmp_path / "train.jsonl.zst", lines, "zst"))]
    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.table({"german": [t for _, t in pairs], "score": [1.0] * len(pairs), "english": [s for s, _ in pairs]}), path
    )
    return ["--train", str(path), "--src-col", "english", "--tgt-col", "german"]


@pytest.mark.parametrize("kind", ["tsv", "jsonl", "parquet"])
def test_table_inputs(ray_cluster, tmp_path, capsys, kind):
    pairs = mirrored(30) + [("", "nur ziel")]
    flags = write_table_input(tmp_path, kind, pairs)
    valid = write_prefix(tmp_path / "val", mirrored(4, 100))
    out = tmp_path / "corpus"
    status, _, err = run_cli(capsys, "--out", str(out), *flags, "--valid", valid, "--shard-pairs", "16", *SMALL)
    assert status == 0, err
    train = json.loads((out / "manifest.json").read_text())["corpora"][0]["train"]
    assert (train["input_pairs"], train["num_pairs"], train["dropped"]["empty"]) == (31, 30, 1)
    assert [f["num_pairs"] for f in train["files"]] == [16, 14]
    assert decoded_train(out) == Counter(mirrored(30))


def test_cleaning_counts_are_exact(ray_cluster, tmp_path, capsys):
    normal = mirrored(20)  # with --vocab-size 200 every word is one token: lengths are known
    long_pair = (" ".join(WORDS * 2), " ".join(reversed(WORDS * 2)))  # 48 tokens or more each side
    src = [s for s, _ in normal] + [
        "",
        "solo",
        "x" * 500,
        long_pair[0],
        "beta",
        normal[0][0],
        normal[1][0],
        long_pair[0],
        normal[2][0],
    ]
    tgt = [t for _, t in normal] + [
        "leer",
        "   ",
        "kurz",
        long_pair[1],
        " ".join(WORDS[:12]),
        normal[0][1],
        normal[1][1],
        long_pair[1],
        normal[2][1] + " anders",
    ]
    src.append(b"caf\xe9 latin-1")  # invalid UTF-8, dropped and counted with --skip-invalid
    tgt.append("kaffee")
    write_lines(tmp_path / "train.en", src)
    write_lines(tmp_path / "train.de", tgt)
    valid = write_prefix(tmp_path / "val", mirrored(3, 100))
    out = tmp_path / "corpus"
    status, stdout, err = run_cli(
        capsys,
        "--out",
        str(out),
        "--train",
        str(tmp_path / "train"),
        "--valid",
        valid,
        "--max-len",
        "30",
        "--max-chars",
        "400",
        "--dedup",
        "--skip-invalid",
        "--vocab-size",
        "200",
    )
    assert status == 0, err
    train = json.loads((out / "manifest.json").read_text())["corpora"][0]["train"]
    # The second copy of the over-long pair counts as too_long: rules apply in order.
    assert {rule: n for rule, n in train["dropped"].items() if n} == {
        "invalid_utf8": 1,
        "empty": 2,
        "too_long_chars": 1,
        "too_long": 2,
        "ratio": 1,
        "duplicate": 2,
    }
    assert (train["input_pairs"], train["num_pairs"]) == (30, 21)
    expected = Counter(normal + [(normal[2][0], normal[2][1] + " anders")])
    assert decoded_train(out) == expected
    assert "duplicate 2" in stdout


def small_corpus(tmp_path: Path, name: str, count: int = 24) -> tuple[str, str]:
    """A train and a valid prefix."""
    return (
        write_prefix(tmp_path / f"{name}-train", mirrored(count)),
        write_prefix(tmp_path / f"{name}-val", mirrored(3, 100)),
    )


def test_rerun_is_a_no_op_and_overwrite_is_explicit(ray_cluster, tmp_path, capsys):
    train, valid = small_corpus(tmp_path, "a")
    out = tmp_path / "corpus"
    argv = ["--out", str(out), "--train", train, "--valid", valid, *SMALL]
    assert run_cli(capsys, *argv)[0] == 0
    before = (out / "manifest.json").read_text()
    status, stdout, _ = run_cli(capsys, *argv)
    assert status == 0 and "already prepared" in stdout and "kept" not in stdout
    other, _ = small_corpus(tmp_path, "b", count=30)
    changed = ["--out", str(out), "--train", other, "--valid", valid, *SMALL]
    status, _, err = run_cli(capsys, *changed)
    assert status == 2 and "--overwrite" in error_line(err) and str(out) in error_line(err)
    assert (out / "manifest.json").read_text() == before
    assert run_cli(capsys, *changed, "--overwrite")[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["corpora"][0]["train"]["num_pairs"] == 30
        and manifest["fingerprint"] != json.loads(before)["fingerprint"]
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("corpus")) == ["corpus"]
    # A directory with other content is never replaced, --overwrite or not.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    status, _, err = run_cli(
        capsys, "--out", str(tmp_path / "notes"), "--train", train, "--valid", valid, "--overwrite", *SMALL
    )
    assert status == 2 and "holds no prepared corpus" in error_line(err)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_overwrite_replaces_corpus_files_an_upload_left_without_manifest(ray_cluster, tmp_path, capsys):
    """Object storage gets the manifest last: an upload cut short leaves corpus files without it."""
    train, valid = small_corpus(tmp_path, "a")
    out = tmp_path / "corpus"
    argv = ["--out", f"file://{out}", "--train", train, "--valid", valid, "--shard-pairs", "10", *SMALL]
    assert run_cli(capsys, *argv)[0] == 0
    (out / "manifest.json").unlink()
    (out / "train" / "en-de" / "part-00002.parquet").unlink()
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and "holds corpus files but no manifest.json" in error_line(err) and "--overwrite" in err
    status, _, err = run_cli(capsys, *argv, "--overwrite")
    assert status == 0, err
    manifest = corpus_format.open_corpus(str(out)).manifest
    assert manifest["corpora"][0]["train"]["num_pairs"] == 24 and decoded_train(out) == Counter(mirrored(24))


def bad_input(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """Flags for one broken input and a fragment its error must contain."""
    train, valid = small_corpus(tmp_path, "ok", count=12)
    if case == "line_counts":
        write_lines(tmp_path / "t.en", ["a b", "c d", "e f"])
        write_lines(tmp_path / "t.de", ["a b", "c d"])
        return [
            "--train",
            str(tmp_path / "t"),
            "--valid",
            valid,
        ], f"{tmp_path}/t.de ends after 2 lines but {tmp_path}/t.en"
    if case == "missing":
        return ["--train", train, "--valid", str(tmp_path / "nope")], f"missing file {tmp_path}/nope.en"
    if case == "empty":
        (tmp_path / "e.en").write_text("")
        write_lines(tmp_path / "e.de", ["x"])
        return [
            "--src-file",
            str(tmp_path / "e.en"),
            "--tgt-file",
            str(tmp_path / "e.de"),
            "--valid",
            valid,
        ], f"{tmp_path}/e.en is empty"
    if case == "utf8":
        write_lines(tmp_path / "u.en", ["fine", b"bad \xff byte", "fine"])
        write_lines(tmp_path / "u.de", ["gut", "schlecht", "gut"])
        return ["--train", str(tmp_path / "u"), "--valid", valid], f"{tmp_path}/u.en:2: not valid UTF-8"
    if case == "utf8_valid":
        write_lines(tmp_path / "v.en", ["fine", b"bad \xff byte"])
        write_lines(tmp_path / "v.de", ["gut", "schlecht"])
        return ["--train", train, "--valid", str(tmp_path / "v")], f"{tmp_path}/v.en:2: not valid UTF-8"
    if case in ("column", "column_type"):
        pq.write_table(pa.table({"en": ["a"], "de": [1]}), tmp_path / "t.parquet")
        col = "german" if case == "column" else "de"
        message = "has no column 'german'" if case == "column" else "column 'de' has type int64, not string"
        return ["--train", str(tmp_path / "t.parquet"), "--tgt-col", col, "--valid", valid], message
    if case == "gz_damaged":
        write_prefix(tmp_path / "z", [(f"line {i}", f"zeile {i}") for i in range(100)], "gz")
        raw = bytearray((tmp_path / "z.en.gz").read_bytes())
        middle = len(raw) // 2
        raw[middle : middle + 4] = bytes(b ^ 0xFF for b in raw[middle : middle + 4])
        with pytest.raises(zlib.error):  # the deflate data is broken, not only the checksum
            gzip.decompress(bytes(raw))
        (tmp_path / "z.en.gz").write_bytes(raw)
        return ["--train", str(tmp_path / "z"), "--valid", valid], f"cannot read {tmp_path}/z.en.gz: Error -3"
    if case == "json":
        write_lines(tmp_path / "j.jsonl", ['{"en": "a", "de": "b"}', '{"en": "a", de}'])
        return ["--train", str(tmp_path / "j.jsonl"), "--valid", valid], f"{tmp_path}/j.jsonl:2: not valid JSON"
    if case == "tsv":
        write_lines(tmp_path / "t.tsv", ["a\tb", "only one column"])
        return ["--train", str(tmp_path / "t.tsv"), "--valid", valid], f"{tmp_path}/t.tsv:2: 1 tab-separated column"
    if case == "all_dropped":
        return [
            "--train",
            train,
            "--valid",
            valid,
            "--max-chars",
            "3",
        ], "all 12 training pairs were dropped (too_long_chars 12)"
    if case == "no_valid":
        return ["--train", train], "--valid is missing"
    if case == "vocab_small":
        return ["--train", train, "--valid", valid, "--vocab-size", "16"], "vocabulary size 16 is smaller than the"
    assert case == "option"
    return ["--train", train, "--valid", valid, "--vocab-size", "100"], "prepare.vocab_size=100 must be a multiple of 8"


@pytest.mark.parametrize(
    "case",
    [
        "line_counts",
        "missing",
        "empty",
        "utf8",
        "utf8_valid",
        "gz_damaged",
        "column",
        "column_type",
        "json",
        "tsv",
        "all_dropped",
        "no_valid",
        "option",
        "vocab_small",
    ],
)
def test_bad_inputs_fail_in_one_line(ray_cluster, tmp_path, capsys, case):
    flags, message = bad_input(tmp_path, case)
    out = tmp_path / "corpus"
    status, _, err = run_cli(capsys, "--out", str(out), *SMALL, *flags)
    assert status == 2
    assert message in error_line(err)
    assert not out.exists() and not list(tmp_path.glob("corpus.tmp-*"))


def test_pairs_source_with_a_given_tokenizer(ray_cluster, tmp_path):
    """The path raymt.train takes for the built-in corpus: in-memory pairs, tokenizer known."""
    from raymt.tokenizer import train_tokenizer

    pairs = mirrored(50)
    tokenizer = train_tokenizer([s for p in pairs for s in p], 80, "bpe")
    src, tgt = [s for s, _ in pairs], [t for _, t in pairs]
    cfg = PrepareConfig(vocab_size=80, shard_pairs=20)
    train, valid = [sources.Source("pairs", pairs=(src, tgt))], [sources.Source("pairs", pairs=(src[:5], tgt[:5]))]
    manifest = prepare.prepare_corpora(
        cfg, str(tmp_path / "c"), [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), train, valid)], tokenizer
    )
    prepared = corpus_format.open_corpus(str(tmp_path / "c"))
    assert prepared.manifest == manifest and prepared.tokenizer().model_proto == tokenizer.model_proto
    assert [f.num_pairs for f in prepared.shards()] == [20, 20, 10]
    assert decoded_train(tmp_path / "c") == Counter(pairs)


def equivalence_inputs(tmp_path: Path, kind: str) -> list[sources.Source]:
    """Training inputs with pairs of every cleaning rule: in memory, or in four files of every
    kind (gzipped text with an invalid line, TSV.xz, JSONL.zst, Parquet) holding copies."""
    pairs = mirrored(300) + mirrored(20) + [("x " * 60, "y"), ("", "z"), ("a b", "b a " * 9)]
    if kind == "pairs":
        return [sources.Source("pairs", pairs=([s for s, _ in pairs], [t for _, t in pairs]))]
    prefix = write_prefix(tmp_path / "train", pairs[:200], "gz")
    with gzip.open(f"{prefix}.en.gz", "ab") as f:
        f.write(b"caf\xe9 latin-1\n")  # invalid UTF-8, dropped and counted (skip_invalid)
    with gzip.open(f"{prefix}.de.gz", "ab") as f:
        f.write(b"kaffee\n")
    inputs = [sources.Source("text", paths=(f"{prefix}.en.gz", f"{prefix}.de.gz"))]
    for part, table_kind in zip((pairs[150:250], pairs[250:], pairs[:40]), ("tsv", "jsonl", "parquet")):
        (tmp_path / table_kind).mkdir()
        flags = write_table_input(tmp_path / table_kind, table_kind, part)
        cols = flags[flags.index("--src-col") + 1 :][::2] if "--src-col" in flags else [None, None]
        inputs.append(sources.Source(table_kind, paths=(flags[1],), src_col=cols[0], tgt_col=cols[1]))
    return inputs


@pytest.mark.parametrize(
    "kind",
    # files: ~24 s on an AVX2 EPYC since dedup goes through Ray Data's hash shuffle (CI runs it)
    ["pairs", pytest.param("files", marks=[pytest.mark.slow, pytest.mark.ci])],
)
def test_small_inputs_prepared_in_the_driver_equal_ray_datas(ray_cluster, tmp_path, monkeypatch, kind):
    """Both passes in the driver (small inputs: `shards.in_driver`) write what Ray Data's tasks
    write: the same SentencePiece model, counts, rows in order and shards."""
    # Its over-long pairs repeat words: repeats off, so that the token rules drop them.
    cfg = PrepareConfig(vocab_size=120, shard_pairs=100, dedup=True, max_len=40, skip_invalid=True, repeats=False)
    train, valid = equivalence_inputs(tmp_path, kind), [sources.Source("pairs", pairs=(["a"], ["b"]))]

    def prepared(out: Path) -> tuple:
        manifest = prepare.prepare_corpora(
            cfg, str(out), [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), train, valid)]
        )
        rows = [pq.read_table(path).to_pylist() for path, _, _ in corpus_format.open_corpus(str(out)).shards()]
        return {**manifest["corpora"][0], "splits": manifest["splits"]}, manifest["sp_model_sha256"], rows

    assert shards.in_driver(check_inputs(cfg, train, valid))
    here = prepared(tmp_path / "here")
    monkeypatch.setattr(shards, "DRIVER_PAIRS", 0)
    monkeypatch.setattr(shards, "DRIVER_BYTES", 0)
    assert not shards.in_driver(check_inputs(cfg, train, valid))
    assert prepared(tmp_path / "ray") == here
    dropped = here[0]["train"]["dropped"]
    if kind == "pairs":
        assert dropped["duplicate"] == 20 and dropped["empty"] == 1 and dropped["too_long"] + dropped["ratio"] == 2
        assert [len(rows) for rows in here[2]] == [100, 100, 100]
    else:  # pairs 150-199 and 0-39 come twice: the second copies are dropped, in input order
        assert dropped["invalid_utf8"] == 1 and dropped["duplicate"] == 20 + 50 + 40
        assert here[0]["train"]["num_pairs"] == 300


def test_specs_and_manifest_errors(tmp_path):
    cfg = PrepareConfig()
    write_lines(tmp_path / "x.en.zst", ["a"])  # not really zstd: only the name is resolved here
    write_lines(tmp_path / "x.de.xz", ["b"], "xz")
    assert sources.source_from_spec(str(tmp_path / "x"), cfg).paths == (f"{tmp_path}/x.en.zst", f"{tmp_path}/x.de.xz")
    assert sources.source_from_spec("a/news.tsv.gz", cfg).kind == "tsv"
    assert sources.source_from_spec("s3://bucket/data.jsonl.zst", cfg).kind == "jsonl"
    assert sources.spec_name("data/newstest2014.tsv.gz") == "newstest2014"
    (tmp_path / "pq").mkdir()
    for name in ("b.parquet", "a.parquet", "notes.txt"):
        (tmp_path / "pq" / name).write_text("")
    assert sources.source_from_spec(str(tmp_path / "pq"), cfg).paths == (
        f"{tmp_path}/pq/a.parquet",
        f"{tmp_path}/pq/b.parquet",
    )
    with pytest.raises(ValueError, match="http"):
        https = sources.Source("tsv", ("https://example.com/x.tsv",))
        check_inputs(cfg, [https], [https])
    with pytest.raises(ValueError, match=r"no manifest\.json"):
        corpus_format.open_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="must be >= 1"):
        PrepareConfig(max_ratio=0.5)
    with pytest.raises(ValueError, match="both 'de'"):
        PrepareConfig(src_lang="de")


def test_file_kinds_are_one_table_for_every_reader(tmp_path):
    """raymt.data.text names the kinds that prepare, --train SPECs and backtranslate all read."""
    cases = {
        "a.en": "text",
        "a.en.gz": "text",
        "news.TSV.xz": "tsv",
        "x.jsonl.zst": "jsonl",
        "x.ndjson": "jsonl",
        "p.parquet": "parquet",
        "s3://b/p.arrow": "parquet",
        "f.feather": "parquet",
        "i.ipc.bz2": "parquet",
    }
    assert {name: text.file_kind(name) for name in cases} == cases
    assert text.strip_compression("News.TSV.GZ") == "News.TSV" and text.strip_compression("a.en") == "a.en"
    # A SPEC names a file of a kind, Parquet/Arrow files (a directory of them), or PREFIX.<src>/<tgt>.
    cfg, prefix = PrepareConfig(), write_prefix(tmp_path / "train", mirrored(3))
    specs = (prefix, "t.tsv.gz", "t.parquet", "s3://b/t.jsonl")
    assert [sources.source_from_spec(s, cfg).kind for s in specs] == ["text", "tsv", "parquet", "jsonl"]
    with pytest.raises(ValueError, match="missing file .*nothing.en"):
        sources.source_from_spec(str(tmp_path / "nothing"), cfg)
    with pytest.raises(ValueError, match="is a directory without .parquet or .arrow files"):
        sources.source_from_spec(str(tmp_path), cfg)


def test_one_pair_is_a_corpus_of_one(tmp_path, capsys):
    """One pair goes through the corpora pipeline as a list of one (a `CorpusInput`): a
    raymt-corpus/2 corpus of one real, untagged corpus whose shards, sets and SentencePiece model
    are the one pair's; its progress lines and errors name no corpus."""
    cfg = PrepareConfig(vocab_size=96, shard_pairs=50, dedup=True)
    pairs = mirrored(200)

    def mem(n: int) -> sources.Source:
        return sources.Source("pairs", pairs=([s for s, _ in pairs[:n]], [t for _, t in pairs[:n]]))

    one = prepare.prepare_corpora(
        cfg,
        str(tmp_path / "one"),
        [sources.CorpusInput(CorpusSpec(cfg.src_lang, cfg.tgt_lang), [mem(200)], [mem(5)], {"t": [mem(3)]})],
    )
    assert one["format"] == corpus_format.FORMAT and one["tags"] == {"target_langs": ["de"], "reserved": {}}
    assert [(c["name"], c["origin"], c["source_tags"]) for c in one["corpora"]] == [("en-de", "real", [])]
    assert "prepare: tokenizing and writing training shards\n" in capsys.readouterr().out
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.parquet"))
    assert files == [
        Path("test/en-de/t.parquet"),
        *(Path(f"train/en-de/part-0000{i}.parquet") for i in range(4)),
        Path("valid/en-de.parquet"),
    ]
    prepared = corpus_format.open_corpus(str(tmp_path / "one"))
    (corpus,) = prepared.training_corpora
    assert prepared.shards() == list(corpus.shards)
    assert decoded_train(tmp_path / "one") == Counter(pairs)
    assert prepared.eval_set("t", "en-de")[0] == [s for s, _ in pairs[:3]]


@pytest.mark.parametrize("string_type", ["string", "large_string", "string_view"])
def test_prepare_and_backtranslate_take_every_string_column_type(tmp_path, string_type):
    """One text-column check (`raymt.data.text.check_text_column`): string, large_string and
    string_view columns are text to prepare and to backtranslate alike; int64 is not."""
    tp = getattr(pa, string_type)()
    table = pa.table({"en": pa.array(["a b", None], tp), "de": pa.array(["x", "y z"], tp), "n": [1, 2]})
    path = str(tmp_path / "t.arrow")
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table)
    cfg, source = PrepareConfig(), sources.Source("parquet", (path,))
    check_inputs(cfg, [source], [source])
    assert sources.read_eval(cfg, [source]) == (["a b", ""], ["x", "y z"])
    (f,) = mono.input_files(path)
    mono.check_columns([f], None, "en")
    assert mono.count_lines(f) == 2
    assert [mono.text_of(raw, f.kind, "en", False) for raw in mono.raw_items(f, "en")] == ["a b", ""]
    for check in (
        lambda: check_inputs(cfg, [sources.Source("parquet", (path,), "n")], [source]),
        lambda: mono.check_columns([f], "n", "en"),
    ):
        with pytest.raises(ValueError, match=r"column 'n' has type int64, not string"):
            check()


def test_dataset_flag_maps_splits(tmp_path, monkeypatch):
    """--dataset: train -> train, valid -> valid, every other split -> a test set of that name."""
    import sys
    import types

    from raymt.command import parse
    from raymt.data.__main__ import PrepareCommand, prepare_inputs

    calls = []

    def fetch_dataset(name, src_lang, tgt_lang, cache_dir, mirror=None):
        calls.append((name, src_lang, tgt_lang, cache_dir, mirror))
        return {
            split: (f"{cache_dir}/{split}.{src_lang}", f"{cache_dir}/{split}.{tgt_lang}")
            for split in ("train", "valid", "test_2016_flickr")
        }

    monkeypatch.setitem(sys.modules, "raymt.data.download", types.SimpleNamespace(fetch_dataset=fetch_dataset))
    monkeypatch.setenv("RAYMT_CACHE", str(tmp_path / "cache"))
    extra = write_prefix(tmp_path / "extra", mirrored(2))

    def sources(*argv):
        cfg = parse(PrepareCommand, ["--out", str(tmp_path / "o"), *argv], "prepare")
        (corpus,) = prepare_inputs(cfg)  # one pair: a list of one
        return corpus.train, corpus.valid, corpus.test

    train, valid, tests = sources(
        "--dataset", "multi30k", "--src", "de", "--tgt", "en", "--test", extra, "--mirror", "http://mirror.example"
    )
    assert calls == [("multi30k", "de", "en", tmp_path / "cache", "http://mirror.example")]
    assert train[0].paths == (f"{tmp_path}/cache/train.de", f"{tmp_path}/cache/train.en")
    assert valid[0].paths[0].endswith("valid.de") and sorted(tests) == ["extra", "test_2016_flickr"]
    assert list(tests)[0] == "extra"  # the pair's own test set first (the one a run scores), as with --pairs
    # A dataset's pair is read as --pairs reads the built-in corpus's, in any of its languages.
    train, _, _ = sources("--dataset", "multi30k", "--pairs", "cs-en")
    assert calls[-1][1:3] == ("cs", "en") and train[0].paths == (
        f"{tmp_path}/cache/train.cs",
        f"{tmp_path}/cache/train.en",
    )
    train, valid, tests = sources("--dataset", "builtin", "--test-name", "x", "--test", extra)
    assert train[0].kind == "pairs" and len(train[0].pairs[0]) == 24000 and sorted(tests) == ["test", "x"]
    for argv, message in [
        (["--dataset", "multi30k", "--train", extra], "pass one of them"),
        (["--train", extra, "--valid", extra, "--mirror", "m"], "only apply with --dataset"),
        (["--train", extra, "--valid", extra, "--test", extra, "--test", extra], "two test sets are named 'extra'"),
    ]:
        with pytest.raises(ValueError, match=message):
            sources(*argv)


def test_train_run_prepares_with_the_data_cleaning_options(ray_cluster, tmp_path):
    """A --train run's prepare stage applies data.max_ratio and data.dedup (the PrepareConfig fields)."""
    from raymt.data.clean import _token_rule
    from raymt.flags import build_config
    from raymt.rundata import materialize, plan_data
    from raymt.train import parse_args

    # Pairs whose target has about twice the source's words: kept at the default max_ratio 3,
    # dropped at 1.5; and 4 exact duplicates, dropped only under data.dedup.
    doubled = [(sentence(i, 3), sentence(i, 3) + " " + sentence(i + 1, 3)) for i in range(300, 330)]
    pairs = mirrored(120) + doubled + mirrored(4)
    prefix = write_prefix(tmp_path / "train", pairs)
    valid = write_prefix(tmp_path / "valid", mirrored(5, 500))
    args = parse_args(
        [
            "--train",
            prefix,
            "--valid",
            valid,
            "--storage-path",
            str(tmp_path / "runs"),
            "--set",
            "data.max_ratio=1.5",
            "--set",
            "data.dedup=true",
            "--set",
            "data.number_mismatch=false",  # the doubled targets hold a second number (n301)
            "--set",
            "data.vocab_size=80",
            "--set",
            "data.sp_model_type=bpe",
        ]
    )
    cfg, run_data = plan_data(build_config(args), tmp_path / "run", None, None)
    prepared = materialize(run_data)
    tokenizer, manifest, options = prepared.tokenizer(), prepared.manifest, prepared.options
    assert (options["max_ratio"], options["dedup"], options["vocab_size"]) == (1.5, True, 80)

    def ratio_drops(max_ratio: float) -> int:
        rule = CorpusOptions(max_len=cfg.data.max_len, max_ratio=max_ratio, ratio_min_len=cfg.data.ratio_min_len)
        return sum(_token_rule(len(tokenizer.encode(s)), len(tokenizer.encode(t)), rule) == "ratio" for s, t in pairs)

    dropped = manifest["corpora"][0]["train"]["dropped"]
    assert dropped["ratio"] == ratio_drops(1.5) > ratio_drops(3.0)
    assert dropped["duplicate"] == 4


def test_the_prepare_command_renders_its_flags():
    """PrepareCommand's flags (its own, the input flags train has, PrepareConfig's) round-trip, and
    the command line a corpus records is the one that prepares it again."""
    from raymt.command import parse, to_argv
    from raymt.data.__main__ import PrepareCommand

    argv = ["--out", "o", "--train", "en-de:a", "--valid", "en-de:v", "--test", "en-de:t", "--test-name", "news"]
    argv += [
        "--bt",
        "de-en:b",
        "--real-weight",
        "2",
        "--src-col",
        "1",
        "--no-copy",
        "--dedup",
        "--src",
        "de",
        "--tgt",
        "en",
    ]
    argv += ["--vocab-size", "16", "--min-score", "0.25", "--tokenizer", "spm.model", "--overwrite"]
    cfg = parse(PrepareCommand, argv, "prepare")
    assert cfg.options == PrepareConfig(
        copy=False, dedup=True, src_lang="de", tgt_lang="en", vocab_size=16, min_score=0.25, tokenizer="spm.model"
    )
    assert cfg.inputs.bt == ["de-en:b"] and cfg.inputs.real_weight == 2.0 and cfg.test_name == ["news"]
    assert parse(PrepareCommand, to_argv(cfg), "prepare") == cfg
    assert "--no-copy" in to_argv(cfg) and "--copy" not in to_argv(cfg)
    with pytest.raises(ValueError, match="--mirror and --cache-dir only apply with --dataset"):
        PrepareCommand(out="o", inputs=cfg.inputs, mirror="m")
