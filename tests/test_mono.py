"""`raymt data mono`: monolingual text for back-translation (raymt.data.mono_clean): each rule
counted, exclusion, seeded sampling, the output whole or not at all, reruns, one-line errors, and
`raymt backtranslate --input` reading the output."""

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from raymt.command import parse, to_argv
from raymt.data import mono_clean
from raymt.data.__main__ import main as data_main
from raymt.data.mono import count_lines, input_files
from raymt.data.mono_clean import COUNTS, HashSet64, MonoConfig, run

# German sentences language ID is sure of, each distinct even after near_text (words, case, digits).
GERMAN = [
    "Der Hund läuft schnell über die grüne Wiese.",
    "Heute scheint die Sonne den ganzen Tag.",
    "Wir fahren morgen mit dem Zug nach Berlin.",
    "Das Buch liegt auf dem kleinen Tisch in der Küche.",
    "Meine Schwester arbeitet in einem großen Krankenhaus.",
    "Im Winter schneit es oft in den Bergen.",
    "Die Kinder spielen nach der Schule im Park.",
    "Er trinkt jeden Morgen eine Tasse Kaffee.",
    "Wir haben gestern einen langen Spaziergang gemacht.",
    "Der Zug hatte wegen des Wetters eine Stunde Verspätung.",
    "Sie kauft frisches Gemüse auf dem Markt.",
    "Das Museum ist am Montag geschlossen.",
    "Mein Bruder spielt seit Jahren Gitarre in einer Band.",
    "Die Katze schläft gern auf dem warmen Sofa.",
    "Im Sommer fahren viele Familien an die Ostsee.",
    "Der Lehrer erklärt die Aufgabe noch einmal.",
]


def write(path: Path, lines: list, gz: bool = False) -> Path:
    """Lines (str, or bytes as they are) into a file, one a line."""
    data = b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def kept(out: Path, lang: str = "de") -> list[str]:
    """The kept lines of an output."""
    return gzip.decompress((out / f"mono.{lang}.gz").read_bytes()).decode().split("\n")[:-1]


def record(out: Path) -> dict:
    return json.loads((out / "mono.json").read_text())


def config(inputs, out, **kwargs) -> MonoConfig:
    return MonoConfig(input=[str(p) for p in inputs], output=str(out), lang="de", **kwargs)


# ---------------------------------------------------------------- the rules and their counts


def test_each_rule_counts_the_lines_it_drops_and_the_rest_stay_in_order(tmp_path, capsys):
    lines = [
        GERMAN[0],
        "  " + GERMAN[1] + "  ",  # stripped
        "",  # empty
        "   ",  # empty
        b"\xff\xfe kein UTF-8",  # invalid
        "Ja",  # too_short (--min-chars 3)
        "Hallo Welt",  # too_short (--min-words 3)
        " ".join(["Wort"] * 4 + ["lang"] * 30),  # too_long (--max-words 30)
        "1234 5678 9012 3456 +++",  # alpha_ratio
        "und und und und und dann kam er nach Hause",  # repeats
        "The weather is lovely today and we walk to the park.",  # wrong_language
        GERMAN[2],  # excluded
        GERMAN[0],  # duplicate
        GERMAN[3],
        "der hund läuft schnell über die grüne wiese",  # near_duplicate of line 0
        GERMAN[4],
    ]
    src = write(tmp_path / "news.de", lines)
    write(tmp_path / "dev.de", [GERMAN[2], "eine Zeile, die es nicht gibt"])
    cfg = config([src], tmp_path / "out", min_chars=3, min_words=3, max_words=30, near_dedup=True)
    cfg.exclude = [str(tmp_path / "dev")]  # PREFIX: PREFIX.de
    result = run(cfg)
    assert kept(tmp_path / "out") == [GERMAN[0], GERMAN[1], GERMAN[3], GERMAN[4]]
    expected = {name: 0 for name in COUNTS}
    expected.update(read=16, invalid=1, empty=2, too_short=2, too_long=1, alpha_ratio=1, repeats=1)
    expected.update(wrong_language=1, excluded=1, duplicate=1, near_duplicate=1, kept=4)
    assert result.counts == expected == record(tmp_path / "out")["counts"]
    assert record(tmp_path / "out")["exclude_lines"] == [2]
    assert result.text == str(tmp_path / "out" / "mono.de.gz")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("mono: kept 4 of 16 lines (dropped: invalid 1, empty 2, too_short 2, too_long 1, ")


def test_exact_copies_count_as_duplicates_under_near_dedup_too_and_rules_can_be_off(tmp_path):
    a, b = "Das ist ein Satz mit 3 Wörtern.", "das ist ein satz mit 7 wörtern"
    src = write(tmp_path / "in.de", [a, b, b, a, "und und und und und dann"])
    r = run(config([src], tmp_path / "near", near_dedup=True))
    assert (r.counts["duplicate"], r.counts["near_duplicate"], r.counts["repeats"]) == (1, 2, 1)
    off = run(config([src], tmp_path / "off", dedup=False, repeats=False, wrong_language=False))
    assert kept(tmp_path / "off") == [a, b, b, a, "und und und und und dann"] and off.counts["kept"] == 5


def test_every_input_kind_is_read_as_backtranslate_reads_it(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write(d / "a.de.gz", GERMAN[:3], gz=True)
    write(d / "b.tsv", [f"x\t{s}" for s in GERMAN[3:5]])
    write(d / "c.jsonl", [json.dumps({"de": s, "en": "x"}) for s in GERMAN[5:7]] + ["{not json"])
    glob = tmp_path / "more*.de"
    write(tmp_path / "more1.de", GERMAN[7:9])
    write(tmp_path / "more2.de", GERMAN[9:10])
    run(config([d / "a.de.gz", d / "c.jsonl", glob], tmp_path / "out"))
    assert kept(tmp_path / "out") == GERMAN[:3] + GERMAN[5:10]
    r = run(config([d / "b.tsv"], tmp_path / "tsv", column="1"))
    assert kept(tmp_path / "tsv") == GERMAN[3:5] and r.counts["read"] == 2
    r = run(config([d / "c.jsonl"], tmp_path / "jsonl"))
    assert r.counts["invalid"] == 1


def test_exclusion_matches_after_the_dedup_key(tmp_path):
    src = write(tmp_path / "in.de", GERMAN[:6])
    test = write(tmp_path / "test.de.gz", ["  " + GERMAN[1], "DER HUND LÄUFT SCHNELL ÜBER DIE GRÜNE WIESE"], gz=True)
    valid = write(tmp_path / "valid.txt", [GERMAN[2]])
    r = run(config([src], tmp_path / "exact", exclude=[str(tmp_path / "test"), str(valid)]))
    assert kept(tmp_path / "exact") == [GERMAN[0], *GERMAN[3:6]] and r.counts["excluded"] == 2
    r = run(config([src], tmp_path / "near", exclude=[str(test)], near_dedup=True))  # case and punctuation aside
    assert kept(tmp_path / "near") == [GERMAN[2], *GERMAN[3:6]] and r.counts["excluded"] == 2


# ---------------------------------------------------------------- sampling


def test_sampling_keeps_the_same_lines_whatever_the_order_or_files(tmp_path):
    lines = [f"{s[:-1]} am Tag {n}." for n in range(5) for s in GERMAN]  # 80 distinct lines
    one = write(tmp_path / "one.de", lines)
    run(config([one], tmp_path / "a", max_lines=25, seed=3))
    shuffled = random.Random(1).sample(lines, len(lines))
    parts = [write(tmp_path / f"p{i}.de.gz", shuffled[i::3], gz=True) for i in range(3)]
    r = run(config(parts, tmp_path / "b", max_lines=25, seed=3))
    assert (tmp_path / "a" / "mono.de.gz").read_bytes() == (tmp_path / "b" / "mono.de.gz").read_bytes()
    assert len(kept(tmp_path / "a")) == 25 and set(kept(tmp_path / "a")) <= set(lines)
    assert (r.counts["kept"], r.counts["sampled_out"], r.counts["read"]) == (25, 55, 80)
    run(config([one], tmp_path / "c", max_lines=25, seed=4))
    assert set(kept(tmp_path / "c")) != set(kept(tmp_path / "a"))  # another seed, another sample
    r = run(config([one], tmp_path / "all", max_lines=100))
    assert sorted(kept(tmp_path / "all")) == sorted(lines) and r.counts["sampled_out"] == 0


def test_the_hash_set_agrees_with_a_python_set():
    rng = np.random.default_rng(0)
    hashes = HashSet64()
    reference: set[int] = set()
    for size in (1, 5, 300, 7, 1000, 2, 64):
        batch = [int(h) for h in rng.integers(0, 2**64, size=size, dtype=np.uint64)]
        batch += list(reference)[:3]  # some seen before
        found = hashes.contains(batch)
        assert found.tolist() == [h in reference for h in batch]
        hashes.add([h for h in batch if h not in reference])
        reference.update(batch)
    assert len(hashes) == len(reference) and len(hashes.runs) < 6  # runs of equal size merged
    assert hashes.contains([2**64 - 1, 0]).tolist() == [2**64 - 1 in reference, 0 in reference]


# ---------------------------------------------------------------- the output and reruns


def test_a_rerun_does_nothing_and_other_settings_are_refused(tmp_path, capsys):
    src = write(tmp_path / "in.de", GERMAN)
    out = tmp_path / "out"
    run(config([src], out))
    stamp = (out / "mono.json").stat().st_mtime_ns
    r = run(config([src], out))
    assert "already holds this text" in capsys.readouterr().out and r.counts["kept"] == len(GERMAN)
    assert (out / "mono.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"with other settings \(--max-chars, --near-dedup\)"):
        run(config([src], out, max_chars=100, near_dedup=True))
    write(src, GERMAN[:-1])
    with pytest.raises(ValueError, match=r"other settings \(--input \(or its files changed\)\)"):
        run(config([src], out))
    write(src, GERMAN)
    (out / "mono.de.gz").unlink()  # its record there, its text gone: made again
    run(config([src], out))
    assert kept(out) == GERMAN
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not monolingual text of raymt data mono .* holds notes.txt"):
        run(config([src], other))


def test_a_failure_leaves_no_output_and_no_staging(tmp_path, monkeypatch):
    src = write(tmp_path / "in.de", GERMAN * 3000)  # several chunks
    monkeypatch.setattr(mono_clean, "CHUNK_LINES", 1000)
    calls = []

    def fail_later(self, raw):
        calls.append(len(raw))
        if len(calls) == 3:
            raise RuntimeError("killed")
        return chunk(self, raw)

    chunk = mono_clean.MonoFilter.chunk
    monkeypatch.setattr(mono_clean.MonoFilter, "chunk", fail_later)
    with pytest.raises(RuntimeError, match="killed"):
        run(config([src], tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.de"]
    with pytest.raises(ValueError, match=r"all 4 lines of --input were dropped \(empty 2, too_long 2\)"):
        run(config([write(tmp_path / "bad.de", ["", "", "x" * 50, "y" * 60])], tmp_path / "out", max_chars=10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.de", "in.de"]


def test_output_to_a_uri_is_uploaded_with_its_record_last(tmp_path):
    src = write(tmp_path / "in.de", GERMAN)
    out = tmp_path / "mono"
    r = run(config([src], f"file://{out}"))
    assert kept(out) == GERMAN and r.text == f"file://{out}/mono.de.gz"
    assert run(config([src], f"file://{out}")).record == r.record  # found again


def test_backtranslate_input_reads_the_output_directory_or_its_file(tmp_path):
    src = write(tmp_path / "in.de", GERMAN + GERMAN[:4])
    out = tmp_path / "out"
    r = run(config([src], out))
    files = input_files(str(out))
    assert [f.path for f in files] == [r.text] and files[0].kind == "text"
    assert [count_lines(f) for f in files] == [len(GERMAN)]
    assert [f.path for f in input_files(r.text)] == [r.text]
    (out / "mono.json").write_text("{}")
    with pytest.raises(ValueError, match="its mono.json is not the record of `raymt data mono`"):
        input_files(str(out))


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_input", "missing file --input"),
        ("lang", "--lang xx: language ID (fastText lid.176) cannot identify it: pass --no-wrong-language"),
        ("bad_lang", "--lang 'de/x' must be a language code"),
        ("limits", "--max-chars 5 must be >= --min-chars and 1"),
        ("fraction", "--wrong-language-confidence 1.5 must be in (0, 1]"),
        ("max_lines", "--max-lines 0 must be >= 1"),
        ("exclude", "--exclude {tmp}/nothing: no such file, nor {tmp}/nothing.de"),
        ("exclude_tsv", "--exclude {tmp}/dev.tsv: a TSV file has no language's column"),
        ("column", "--column 'de': a TSV column is a 0-based number"),
        ("output_file", "--output {tmp}/in.de is a file"),
    ],
)
def test_bad_input_is_one_line_before_any_line_is_read(tmp_path, capsys, monkeypatch, case, message):
    src = write(tmp_path / "in.de", GERMAN)
    write(tmp_path / "dev.tsv", ["a\tb"])
    write(tmp_path / "in.tsv", ["a\tb"])
    monkeypatch.setattr(mono_clean, "read_chunks", lambda *a: pytest.fail("a line was read"))
    flags = {
        "no_input": ["--input", str(tmp_path / "missing.de")],
        "lang": ["--lang", "xx"],
        "bad_lang": ["--lang", "de/x"],
        "limits": ["--min-chars", "10", "--max-chars", "5"],
        "fraction": ["--wrong-language-confidence", "1.5"],
        "max_lines": ["--max-lines", "0"],
        "exclude": ["--exclude", str(tmp_path / "nothing")],
        "exclude_tsv": ["--exclude", str(tmp_path / "dev.tsv")],
        "column": ["--input", str(tmp_path / "in.tsv"), "--column", "de"],
        "output_file": ["--output", str(src)],
    }[case]
    argv = ["mono", "--input", str(src), "--output", str(tmp_path / "out"), "--lang", "de", *flags]
    assert data_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raymt.data mono: error: "), err
    assert message.format(tmp=tmp_path) in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_config_renders_the_command_line_that_builds_it():
    cfg = MonoConfig(
        input=["a.de.gz", "s3://b/news/"],
        output="out",
        lang="de",
        max_words=80,
        near_dedup=True,
        wrong_language=False,
        exclude=["dev", "test.de"],
        max_lines=1000,
        seed=7,
    )
    argv = to_argv(cfg)
    assert "--no-wrong-language" in argv and argv.count("--input") == 2
    assert parse(MonoConfig, argv, "raymt data mono") == cfg
    assert parse(MonoConfig, to_argv(MonoConfig(input=["x"], output="o", lang="fr")), "p").lang == "fr"


# ---------------------------------------------------------------- back-translated (Ray actors)


@pytest.mark.slow  # ~35 s: Ray actors
@pytest.mark.ci
def test_backtranslate_reads_a_mono_output_directly(ray_cluster, tmp_path):
    from tiny_checkpoint import make_checkpoint

    from raymt import backtranslate
    from raymt.config import BacktranslateConfig, DecodeOptions

    src = write(tmp_path / "in.de", GERMAN + ["", "The weather is lovely today and we walk to the park."])
    mono = run(config([src], tmp_path / "mono"))
    checkpoint = make_checkpoint(tmp_path / "de-en", seed=1, pair="de-en")
    cfg = BacktranslateConfig(
        checkpoint=(str(checkpoint),),
        input=mono.output,
        output=str(tmp_path / "bt"),
        format="text",
        engine="raymt",
        decode=DecodeOptions(beam=1, max_len_a=0.0, max_len_b=4),
    )
    job = backtranslate.run(cfg)
    assert job.info["done"] and job.info["num_lines"] == mono.counts["kept"] == len(GERMAN)
    assert job.info["counts"]["translated"] == len(GERMAN)
    assert (tmp_path / "bt" / "text.de").read_text().split("\n")[:-1] == GERMAN
