"""`raymt.backtranslate`: every input line once, aligned, in line-id order; restarts; bad input before Ray."""

import dataclasses
import gzip
import json
import lzma
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from agreement import assert_translations_agree
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import backtranslate as bt
from raymt import bt_job, engines, shard_job
from raymt.checkpoint import languages_entry
from raymt.command import command_line, to_argv
from raymt.config import BacktranslateConfig, DecodeOptions, ShardJobOptions
from raymt.data.builtin import generate
from raymt.data.mono import InputFile, count_lines

pytestmark = pytest.mark.timeout(600)
FLAGS = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "4", "--engine", "raymt", "--progress-s", "0.5"]
OPTS = DecodeOptions(beam=1, max_len_a=0.0, max_len_b=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bt") / "checkpoint", seed=2)


def sentences(n: int, seed: int) -> list[str]:
    return generate(n, "en", "de", seed=seed)[0]


def shards(out: Path) -> pa.Table:
    """Every shard's rows, in file-name order."""
    files = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files])


def untranslated(table: pa.Table) -> set[int]:
    """Line ids without a score: the empty and invalid lines."""
    ids, scores = table.column("line_id").to_pylist(), table.column("score").to_pylist()
    return {i for i, score in zip(ids, scores) if math.isnan(score)}


def run(args: list[str]) -> int:
    return bt.main(args)


def bt_config(**kwargs) -> BacktranslateConfig:
    """A config of the options given (the model, input and output are never read)."""
    return BacktranslateConfig(**{"checkpoint": ("model",), "input": "mono.en", "output": "out", **kwargs})


# ---------------------------------------------------------------- pure functions


def test_noise_deletes_replaces_and_moves_words_at_most_k():
    words = [f"w{i}" for i in range(2000)]
    text = " ".join(words)
    cfg = bt_config(noise=True, noise_swap=0)
    noised = bt.noise_words(text, random.Random("1:7"), cfg).split()
    assert noised == bt.noise_words(text, random.Random("1:7"), cfg).split()  # repeatable per line
    assert noised != bt.noise_words(text, random.Random("1:8"), cfg).split()
    assert 0.07 < 1 - len(noised) / len(words) < 0.13  # deleted with p = 0.1
    assert 0.07 < noised.count(cfg.noise_filler) / len(noised) < 0.13  # replaced with p = 0.1
    kept = [w for w in noised if w != cfg.noise_filler]
    assert kept == sorted(kept, key=lambda w: int(w[1:]))  # without swaps, in order
    # Swaps alone: a permutation moving no word more than 3 places (Lample et al. 2018).
    swap = bt_config(noise=True, noise_delete=0, noise_replace=0, noise_swap=3)
    moved = bt.noise_words(text, random.Random(0), swap).split()
    assert sorted(moved) == sorted(words) and moved != words
    assert max(abs(i - int(w[1:])) for i, w in enumerate(moved)) <= 3
    off = bt_config(noise=True, noise_delete=0, noise_replace=0, noise_swap=0)
    assert bt.noise_words("a b c", random.Random(0), off) == "a b c"


def test_count_lines_counts_as_the_reader_splits(tmp_path):
    cases = {b"": 0, b"a\n": 1, b"a": 1, b"a\nb": 2, b"a\n\n": 2, b"\n": 1}
    for i, (data, expected) in enumerate(cases.items()):
        path = tmp_path / f"f{i}.txt.gz"
        path.write_bytes(gzip.compress(data))
        assert count_lines(InputFile(str(path), "text", 1, 0)) == expected, data


def test_auto_engine_is_ctranslate2_when_installed(checkpoint):
    model = engines.load_model_info(str(checkpoint))
    have = pytest.importorskip("ctranslate2") is not None
    assert have and engines.resolve_engine("auto", model) == "ctranslate2"
    assert engines.resolve_engine("raymt", model) == "raymt"


def test_tagged_model_takes_its_tag(checkpoint):
    model = engines.load_model_info(str(checkpoint))
    # The entry as training writes it into config.json (a multilingual checkpoint's own format).
    model.languages = languages_entry([("en", "de"), ("en", "fr")], {"<2de>": 4, "<2fr>": 5})
    assert model.languages["pairs"] == [["en", "de"], ["en", "fr"]]
    assert bt.directions(model, "en", "fr") == ("en", "fr", ["<2fr>"])
    with pytest.raises(ValueError, match="pass --tgt-lang"):
        bt.directions(model, "en", None)
    with pytest.raises(ValueError, match="--tgt-lang es: this model was trained to translate into de, fr"):
        bt.directions(model, "en", "es")
    with pytest.raises(ValueError, match="--src-lang de: .* trained to translate into fr from en"):
        bt.directions(model, "de", "fr")


def test_tagged_model_checks_the_source_against_the_target(checkpoint):
    model = engines.load_model_info(str(checkpoint))
    model.languages = languages_entry([("en", "de"), ("de", "en")], {"<2de>": 4, "<2en>": 5})
    assert bt.directions(model, None, "en") == ("de", "en", ["<2en>"])  # the one source trained into en
    assert bt.directions(model, None, "de") == ("en", "de", ["<2de>"])
    with pytest.raises(ValueError, match="--src-lang en: .* trained to translate into en from de"):
        bt.directions(model, "en", "en")  # both languages are sources, but en->en was never trained
    model.languages = languages_entry([("de", "en"), ("fr", "en")], {"<2en>": 4})
    with pytest.raises(ValueError, match="translates into en from de, fr: pass --src-lang"):
        bt.directions(model, None, "en")


def test_a_config_renders_the_command_line_that_builds_it():
    shards = ShardJobOptions(shard_lines=7, max_tokens=64, num_actors=2, gpu=True, cpus_per_actor=0.5, num_cpus=3)
    sampled = bt_config(
        checkpoint=("a", "b"),
        format="text",
        column="2",
        src_lang="en",
        tgt_lang="de",
        decode=DecodeOptions(beam=1, length_penalty=1.0, max_len_a=0.5, max_len_b=3, sample=True, top_k=5),
        seed=7,
        engine="raymt",
        compute_type="int8",
        shards=dataclasses.replace(shards, progress_s=0.5, verbose=True),
    )
    noised = bt_config(noise=True, noise_delete=0.2, noise_replace=0.0, noise_swap=0, noise_filler="_", shards=shards)
    for cfg in (sampled, noised):
        assert bt.parse_args(to_argv(cfg)) == cfg
    assert command_line("backtranslate", sampled).startswith("raymt backtranslate --checkpoint a --checkpoint b ")
    assert bt.parse_args(["--checkpoint", "m", "--input", "i", "--output", "o", "--sample", "--beam", "4"]).decode == (
        DecodeOptions(beam=1, sample=True)  # --sample implies beam 1
    )
    assert sampled.decode_options().seed == 7 and noised.decode_options().seed is None  # --seed seeds sampling


def test_a_settings_record_refuses_other_settings_naming_their_flags(tmp_path):
    record = shard_job.SettingsRecord("job.json", "a test job", flags={"beam": "--beam"}, rerun_free=("verbose",))
    out = str(tmp_path / "out")
    assert record.check(out, {"beam": 2, "verbose": True}) is None  # a new job
    record.write(out, record.settings({"beam": 2, "lang": "de", "verbose": True}))
    assert json.loads((tmp_path / "out" / "job.json").read_text()) == {"beam": 2, "lang": "de"}
    assert record.check(out, {"beam": 2, "lang": "de", "verbose": False}) == {"beam": 2, "lang": "de"}
    with pytest.raises(ValueError, match=r"holds a test job with other settings \(--beam, lang\): rerun it"):
        record.check(out, {"beam": 3, "lang": "fr"})
    (tmp_path / "out" / "job.json").write_text("[1]")
    with pytest.raises(ValueError, match="its job.json is not the record of a test job"):
        record.check(out, {"beam": 2})
    (tmp_path / "out" / "job.json").unlink()
    (tmp_path / "out" / shard_job.shard_name(0)).write_bytes(b"")
    with pytest.raises(ValueError, match=r"is not a test job \(no job.json\) and holds part-000000000000.parquet"):
        record.check(out, {"beam": 2})
    with pytest.raises(ValueError, match="is a file"):
        record.check(str(tmp_path / "out" / shard_job.shard_name(0)), {"beam": 2})
    (tmp_path / "out" / shard_job.shard_name(0)).unlink()
    (tmp_path / "out" / "notes.txt").write_text("someone else's\n")
    assert record.check(out, {"beam": 2}) is None  # only shards mark a directory as a job's
    anything = dataclasses.replace(record, marks="")  # distill.json's: the directory must be empty
    with pytest.raises(ValueError, match=r"is not a test job \(no job.json\) and holds notes.txt"):
        anything.check(out, {"beam": 2})


# ---------------------------------------------------------------- bad input: one line, before Ray


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("Ray must not start on bad input")

    monkeypatch.setattr(shard_job, "init_ray", refuse)


@pytest.mark.parametrize(
    "case",
    [
        "no_input",
        "no_checkpoint",
        "corrupt_checkpoint",
        "direction",
        "bad_uri",
        "other_settings",
        "beam",
        "corrupt_xz",
        "arrow_no_column",
        "arrow_not_text",
    ],
)
def test_bad_input_is_one_line_before_ray(checkpoint, case, tmp_path, no_ray, err_lines):
    mono = tmp_path / "mono.en"
    mono.write_text("".join(s + "\n" for s in sentences(20, 1)))
    ckpt, inp, out, extra = str(checkpoint), str(mono), str(tmp_path / "out"), []
    if case == "no_input":
        inp = str(tmp_path / "missing.en")
    elif case == "no_checkpoint":
        ckpt = str(tmp_path / "nothing")
    elif case == "corrupt_checkpoint":
        broken = make_checkpoint(tmp_path / "broken")
        data = (broken / "model.pt").read_bytes()
        (broken / "model.pt").write_bytes(data[: len(data) // 2])
        ckpt = str(broken)
    elif case == "direction":
        extra = ["--src-lang", "de", "--tgt-lang", "en"]
    elif case == "bad_uri":
        inp = "nope://bucket/mono.en"
    elif case == "other_settings":
        job = bt.check_args(bt.parse_args(["--checkpoint", ckpt, "--input", inp, "--output", out, *FLAGS]))
        bt_job.write_info(job)
        extra = ["--beam", "3"]
    elif case == "beam":
        extra = ["--beam", "0"]
    elif case == "corrupt_xz":
        data = bytearray(lzma.compress(mono.read_bytes()))
        data[40:60] = bytes(b ^ 0xFF for b in data[40:60])  # flipped bytes inside the compressed stream
        inp = str(tmp_path / "mono.en.xz")
        Path(inp).write_bytes(bytes(data))
    elif case.startswith("arrow_"):
        table = pa.table({"de": sentences(3, 1)} if case == "arrow_no_column" else {"en": [1, 2, 3]})
        inp, new = (str(tmp_path / "mono.arrow"), pa.ipc.new_file)
        if case == "arrow_not_text":  # the IPC stream format, as well as the file format
            inp, new = (str(tmp_path / "mono.ipc"), pa.ipc.new_stream)
        with new(inp, table.schema) as writer:
            writer.write_table(table)
    assert run(["--checkpoint", ckpt, "--input", inp, "--output", out, *FLAGS, *extra]) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.backtranslate: error: "), err
    expected = {
        "no_input": "missing file --input",
        "no_checkpoint": "does not exist",
        "corrupt_checkpoint": "cannot load",
        "direction": "translates en->de, so its input is en",
        "bad_uri": "cannot open this URI",
        "other_settings": "holds a back-translation with other settings (the decoding flags)",
        "beam": "beam=0 must be >= 1",  # DecodeOptions' own check, as `raymt evaluate --beam 0`
        "corrupt_xz": "mono.en.xz: Corrupt input data; check that the file is complete",
        "arrow_no_column": "mono.arrow has no column 'en' (columns: de): pass --column",
        "arrow_not_text": "mono.ipc: column 'en' has type int64, not string: pass --column to name a text column",
    }[case]
    assert expected in err[0]


# ---------------------------------------------------------------- --format text, without Ray


class UpperEngine:
    """A stand-in engine: the output is the input in capitals."""

    def encode(self, texts: list[str], tgt_lang=None, src_lang=None) -> list[list[str]]:
        return [text.split() for text in texts]

    def length(self, source: list[str]) -> int:
        return len(source)

    def translate_ids(self, sources: list[list[str]], opts, n_best: int = 1) -> list[list[tuple[float, str]]]:
        return [[(0.0, " ".join(s).upper())] for s in sources]


def decode_here(args: list[str]) -> None:
    """Write a job's shards in this process, as its actors would."""
    job = bt.check_args(bt.parse_args(args))
    bt_job.write_info(job)
    for shard, block in job.shard_inputs():
        data, _ = bt_job.shard_file(bt.translate_block(UpperEngine(), block, job.opts, job.cfg))
        shard_job.write_shard(job.shard_location(shard), data)


@pytest.fixture
def text_job(checkpoint, tmp_path, no_ray):
    """A --format text job into a file:// URI, its shards written here; (args, output dir, input lines)."""
    lines = sentences(12, 7)
    mono = tmp_path / "mono.en"
    mono.write_text("".join(s + "\n" for s in lines))
    out = tmp_path / "out"
    out.mkdir()  # a file:// URI is written as an object store's objects: no directory is made
    args = ["--checkpoint", str(checkpoint), "--input", str(mono), "--output", f"file://{out}", *FLAGS]
    args += ["--format", "text", "--shard-lines", "5"]
    decode_here(args)
    return args, out, lines


def assert_text_complete(out: Path, lines: list[str]) -> None:
    assert (out / "text.en").read_text().split("\n")[:-1] == lines
    assert (out / "text.de").read_text().split("\n")[:-1] == [s.upper() for s in lines]
    assert not list(out.glob("*.tmp"))


def test_text_interrupted_while_written_is_rewritten(text_job):
    args, out, lines = text_job
    assert run(args) == 0
    assert_text_complete(out, lines)
    # As a run killed while writing the text leaves it: bt.json not done, text.en cut short.
    info = json.loads((out / "bt.json").read_text())
    (out / "bt.json").write_text(json.dumps({**info, "done": False, "text": []}))
    (out / "text.en").write_text("".join(s + "\n" for s in lines[:3]))
    assert run(args) == 0  # nothing left to translate: the text is written again all the same
    assert_text_complete(out, lines)
    assert json.loads((out / "bt.json").read_text())["text"] == ["text.en", "text.de"]


def test_text_failing_midway_leaves_no_partial_file(text_job, monkeypatch):
    args, out, lines = text_job
    job = bt.check_args(bt.parse_args(args))
    real, calls = bt_job.pq.read_table, []

    def fail_on_the_third_shard(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("connection reset")
        return real(*a, **kw)

    monkeypatch.setattr(bt_job.pq, "read_table", fail_on_the_third_shard)
    with pytest.raises(OSError, match="connection reset"):
        bt_job.write_text(job)
    assert not list(out.glob("text.*"))  # neither under its final name nor a temporary one
    monkeypatch.undo()
    assert run(args) == 0
    assert_text_complete(out, lines)


# ---------------------------------------------------------------- on the cluster


def write_inputs(root: Path) -> tuple[Path, list[str], list[int], list[int]]:
    """A directory of four kinds of file; (dir, expected inputs, empty line ids, invalid line ids)."""
    root.mkdir()
    s = sentences(40, 9)
    texts: list[str] = []
    empty: list[int] = []
    invalid: list[int] = []
    # a.txt.gz: plain lines, a blank one and one that is not UTF-8
    lines = [x.encode() for x in s[:10]]
    lines[3], lines[6] = b"", b"caf\xe9 au lait"
    (root / "a.txt.gz").write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    texts += [x.decode() if i != 6 else "" for i, x in enumerate(lines)]
    empty, invalid = [3], [6]
    # b.tsv: column 0 (the default), one line without it (blank) and a whitespace-only one
    rows = [f"{x}\tignored" for x in s[10:20]]
    rows[2] = "   \tignored"
    (root / "b.tsv").write_text("\n".join(rows) + "\n")
    texts += [r.split("\t")[0] for r in rows]
    empty.append(12)
    # c.jsonl: key "en" (the model's source language); a line that is not JSON
    objs = [json.dumps({"en": x, "id": i}) for i, x in enumerate(s[20:30])]
    objs[4] = "{not json"
    (root / "c.jsonl").write_text("\n".join(objs) + "\n")
    texts += [x if i != 4 else "" for i, x in enumerate(s[20:30])]
    invalid.append(24)
    # d.parquet: a null is an empty line
    col = s[30:40]
    pq.write_table(pa.table({"en": pa.array(col[:5] + [None] + col[6:], pa.string())}), root / "d.parquet")
    texts += col[:5] + [""] + col[6:]
    empty.append(35)
    return root, texts, empty, invalid


def test_shard_inputs_are_whole_shards_across_files_and_skip_done_ones(checkpoint, tmp_path):
    inputs, texts, _, invalid = write_inputs(tmp_path / "in")
    flags = ["--checkpoint", str(checkpoint), "--input", str(inputs), "--output", str(tmp_path / "out"), *FLAGS]
    job = bt.check_args(bt.parse_args([*flags, "--shard-lines", "7"]))
    job.todo = [1, 2, 5]  # 1: lines 7-13 (a.txt.gz and b.tsv); 5: 35-39, the short last one
    got = list(job.shard_inputs())
    assert [shard for shard, _ in got] == job.todo
    for shard, table in got:
        ids = list(range(7 * shard, min(7 * shard + 7, 40)))
        assert table.column("line_id").to_pylist() == ids
        assert table.column("text").to_pylist() == [None if i in invalid else texts[i] for i in ids]
    with (inputs / "b.tsv").open("a") as f:
        f.write("one more\tline\n")
    with pytest.raises(ValueError, match="b.tsv has more lines now but had 10 when the job started"):
        list(job.shard_inputs())


@pytest.mark.hosts  # actors vs this process
def test_every_input_kind_aligned_each_line_once(ray_cluster, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYMT_CACHE", str(tmp_path / "cache"))
    inputs, texts, empty, invalid = write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    args = ["--checkpoint", str(checkpoint), "--input", str(inputs), "--output", str(out), "--format", "text"]
    assert run([*args, *FLAGS, "--shard-lines", "7", "--num-actors", "2"]) == 0
    table = shards(out)
    assert table.column("line_id").to_pylist() == list(range(40))  # each line once, in order
    assert table.column("input").to_pylist() == texts
    outputs = table.column("output").to_pylist()
    assert untranslated(table) == set(empty + invalid)
    assert all(outputs[i] == "" for i in empty + invalid)
    info = json.loads((out / "bt.json").read_text())
    assert info["done"] and info["num_lines"] == 40 and info["num_shards"] == 6
    assert info["counts"] == {"translated": 35, "empty": 3, "invalid": 2}
    assert (info["src_lang"], info["tgt_lang"], info["engine"]) == ("en", "de", "raymt")
    # The outputs are what the engine gives each shard (one block, across files), decoded here.
    engine = engines.load_engine(str(checkpoint), "raymt")
    cfg = bt_config(shards=ShardJobOptions(shard_lines=7))
    expected = []
    for start in range(0, 40, 7):
        ids = range(start, min(start + 7, 40))
        block = pa.table(
            {
                "line_id": pa.array(ids, pa.int64()),
                "text": pa.array([None if i in invalid else texts[i] for i in ids], pa.string()),
            }
        )
        expected += bt.translate_block(engine, block, OPTS, cfg).column("output").to_pylist()
    # The actors are other processes (their own threads, their own kernel paths): ties may part.
    rows = [i for i in range(40) if i not in empty + invalid]
    assert [outputs[i] for i in empty + invalid] == [expected[i] for i in empty + invalid]
    pick = lambda values: [values[i] for i in rows]
    assert_translations_agree(checkpoint, pick(texts), None, pick(outputs), pick(expected))
    # --format text: aligned line by line with the input
    assert (out / "text.en").read_text().split("\n")[:-1] == texts
    assert (out / "text.de").read_text().split("\n")[:-1] == outputs
    # A rerun finds everything done: no shard is written again.
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")}
    assert run([*args, *FLAGS, "--shard-lines", "7"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")} == stamps


@pytest.mark.slow
@pytest.mark.ci
def test_corrupt_and_missing_shards_are_redone(ray_cluster, checkpoint, tmp_path):
    mono = tmp_path / "mono.en"
    mono.write_text("".join(s + "\n" for s in sentences(50, 4)))
    out = tmp_path / "out"
    args = ["--checkpoint", str(checkpoint), "--input", str(mono), "--output", str(out), *FLAGS, "--shard-lines", "10"]
    assert run(args) == 0
    before = shards(out)
    files = sorted(out.glob("part-*.parquet"))
    files[1].write_bytes(files[1].read_bytes()[:100])  # truncated
    files[3].unlink()
    (out / (files[0].name + ".tmp")).write_bytes(b"half")  # a write the driver did not finish
    stamps = {p.name: p.stat().st_mtime_ns for p in (files[0], files[2], files[4])}
    assert run(args) == 0
    assert shards(out).equals(before)
    assert {p.name: p.stat().st_mtime_ns for p in (files[0], files[2], files[4])} == stamps
    assert not list(out.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.ci
def test_ctranslate2_engine_and_sampling(ray_cluster, checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2")
    monkeypatch.setenv("RAYMT_CACHE", str(tmp_path / "cache"))
    lines = sentences(30, 5)
    lines[2] = ""
    mono = tmp_path / "mono.en"
    mono.write_text("".join(s + "\n" for s in lines))
    for name, extra in (("auto", []), ("sample", ["--engine", "raymt", "--sample", "--top-k", "5"])):
        out = tmp_path / name
        args = ["--checkpoint", str(checkpoint), "--input", str(mono), "--output", str(out), "--shard-lines", "8"]
        assert run([*args, "--max-len-a", "0", "--max-len-b", "4", "--num-actors", "1", *extra]) == 0
        table = shards(out)
        assert table.column("line_id").to_pylist() == list(range(30))
        assert table.column("input").to_pylist() == lines
        # A random model may end a translation at once; only the empty line has no score. How
        # often depends on the CPU's kernels (CTranslate2 int8: 14 of 30 on an AVX2-only EPYC).
        assert untranslated(table) == {2} and table.column("output")[2].as_py() == ""
        assert sum(bool(o) for o in table.column("output").to_pylist()) >= 10
        info = json.loads((out / "bt.json").read_text())
        assert info["counts"] == {"translated": 29, "empty": 1, "invalid": 0}
        assert info["engine"] == ("ctranslate2" if name == "auto" else "raymt") and info["done"]
    assert (tmp_path / "cache" / "ctranslate2").is_dir()  # exported once, into the cache


@pytest.mark.slow
@pytest.mark.ci
def test_output_to_object_storage(ray_cluster, checkpoint, tmp_path, s3_bucket):
    import pyarrow.fs as pafs

    lines = sentences(12, 6)
    mono = tmp_path / "mono.en"
    mono.write_text("".join(s + "\n" for s in lines))
    uri = f"{s3_bucket}/bt-out"
    args = ["--checkpoint", str(checkpoint), "--input", str(mono), "--output", uri, "--format", "text", *FLAGS]
    assert run([*args, "--shard-lines", "5"]) == 0
    fs, path = pafs.FileSystem.from_uri(uri)
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(path)))
    assert names == [
        "bt.json",
        "part-000000000000.parquet",
        "part-000000000005.parquet",
        "part-000000000010.parquet",
        "text.de",
        "text.en",
    ]
    with fs.open_input_stream(f"{path}/text.en") as f:
        assert f.read().decode().split("\n")[:-1] == lines
    assert run([*args, "--shard-lines", "5"]) == 0  # done: nothing to do


# ---------------------------------------------------------------- killed and resumed


def start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raymt.backtranslate", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def wait_for_shards(out: Path, more_than: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while len(list(out.glob("part-*.parquet"))) <= more_than:
        assert proc.poll() is None, "the job ended before it could be killed"
        assert time.time() < deadline, "no shard written in time"
        time.sleep(0.05)


# Each actor writes its shard's file as soon as it is decoded (before, Ray Data delivered every
# output block to the driver at the end of the run: no shard file existed to kill it after).
@pytest.mark.slow
@pytest.mark.ci
def test_killed_driver_then_actor_resume_each_line_once(ray_address, checkpoint, tmp_path):
    """Done when 1 of issue 29: 20,000 lines, the driver SIGKILLed, then an actor; every line once."""
    rng = random.Random(3)
    pool = sentences(500, 8)
    lines = [rng.choice(pool).encode() for _ in range(20_000)]
    blank = set(rng.sample(range(20_000), 200))
    bad = set(rng.sample(sorted(set(range(20_000)) - blank), 50))
    for i in blank:
        lines[i] = b""
    for i in bad:
        lines[i] = b"\xff\xfe" + lines[i]
    mono = tmp_path / "mono.en.gz"
    mono.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    out = tmp_path / "out"
    args = ["--checkpoint", str(checkpoint), "--input", str(mono), "--output", str(out), *FLAGS]
    args += ["--shard-lines", "1000", "--num-actors", "2"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), shard_job.DELAY_ENV: "0.5"}

    first = start(args, tmp_path / "first.log", env)
    wait_for_shards(out, 2, first)  # shard files while the driver still runs
    os.killpg(first.pid, signal.SIGKILL)  # the driver, at once
    first.wait()
    written = len(list(out.glob("part-*.parquet")))
    assert written < 20
    stale = set(ray_address.processes(bt.ACTOR_TITLE))  # the killed driver's actors, on their way out

    second = start(args, tmp_path / "second.log", env)
    wait_for_shards(out, written, second)  # the rerun has written a shard: its actors are busy
    deadline = time.time() + 60
    while not (actors := [pid for pid in ray_address.processes(bt.ACTOR_TITLE) if pid not in stale]):
        assert second.poll() is None and time.time() < deadline, "no decoding actor of the rerun found"
        time.sleep(0.05)
    os.kill(actors[0], signal.SIGKILL)  # an actor, mid-run: its shards go to the other; Ray restarts it
    rc = second.wait(timeout=600)
    log = (tmp_path / "second.log").read_text()
    if rc != 0:  # the job failed instead of retrying: the same command finishes it
        third = start(args, tmp_path / "third.log", env)
        rc = third.wait(timeout=600)
        log = (tmp_path / "third.log").read_text()
    assert rc == 0, log[-3000:]
    assert "backtranslated 20,000 lines" in log
    # The rerun kept the shards the killed driver's actors had written (and any they finished since).
    to_do = int(re.search(r"in 20 shards, (\d+) to do", (tmp_path / "second.log").read_text()).group(1))
    assert to_do <= 20 - written

    table = shards(out)
    assert table.column("line_id").to_pylist() == list(range(20_000))  # once each, in order
    assert table.column("input").to_pylist() == ["" if i in bad else x.decode() for i, x in enumerate(lines)]
    assert untranslated(table) == blank | bad
    assert all(o == "" for o in table.column("output").take(sorted(blank | bad)).to_pylist())
    info = json.loads((out / "bt.json").read_text())
    assert info["done"] and info["counts"] == {"translated": 19_750, "empty": 200, "invalid": 50}


@pytest.mark.slow  # ~40 s: two actors, one killed (CI runs it: .ci/run)
@pytest.mark.ci
def test_a_dead_actors_shards_go_to_a_live_actor_not_to_its_restart(
    ray_cluster, ray_head, checkpoint, tmp_path, monkeypatch
):
    """Issue 46: SIGKILL one of two actors mid-run. Ray restarts it (here in 300 s); its shards are
    decoded by the other actor meanwhile, so the run ends long before the restart, each line once."""
    import threading

    starts = tmp_path / "starts"  # a line per actor start: the third is the killed one's restart

    class BacktranslateActor(bt.BacktranslateActor):  # a local class: sent to Ray by value
        def __init__(self, **kwargs):
            with starts.open("a") as f:
                f.write("start\n")
            if len(starts.read_text().split()) > 2:
                time.sleep(300)  # an engine's load on a busy machine, much longer
            super().__init__(**kwargs)

    monkeypatch.setattr(bt, "BacktranslateActor", BacktranslateActor)
    monkeypatch.setenv(shard_job.DELAY_ENV, "0.3")
    monkeypatch.setenv("RAYMT_CACHE", str(tmp_path / "cache"))
    mono, out = tmp_path / "mono.en", tmp_path / "out"
    mono.write_text("\n".join(sentences(200, 5)) + "\n")
    args = ["--checkpoint", str(checkpoint), "--input", str(mono), "--output", str(out), *FLAGS]
    args += ["--shard-lines", "10", "--num-actors", "2"]
    before, result = set(ray_head.processes(bt.ACTOR_TITLE)), {}
    thread = threading.Thread(target=lambda: result.update(rc=run(args)), daemon=True)
    thread.start()
    deadline = time.time() + 300
    while len(list(out.glob("part-*.parquet"))) < 2:  # both actors are up and busy
        assert thread.is_alive() and time.time() < deadline, "no shard written in time"
        time.sleep(0.05)
    actors = [pid for pid in ray_head.processes(bt.ACTOR_TITLE) if pid not in before]
    assert len(actors) == 2
    os.kill(actors[0], signal.SIGKILL)
    killed = time.time()
    thread.join(timeout=240)
    assert not thread.is_alive(), "the run waited for the dead actor's restart"
    assert result["rc"] == 0 and time.time() - killed < 120
    assert shards(out).column("line_id").to_pylist() == list(range(200))  # once each, in order
    assert json.loads((out / "bt.json").read_text())["done"]
