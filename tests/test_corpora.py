"""Several corpora in one run (issue 30, inputs and corpus; issue 29's --bt): flags and tables ->
config, `raymt data prepare` of a `raymt-corpus/2` corpus (tags, per-pair sets, BT
directories), a run's prepare step, and the one-line errors before Ray starts.

Fast: the built-in corpus at a few hundred pairs per pair, tiny vocabularies, no Ray.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_prepare import mirrored, write_prefix

from raymt.config import Config, CorpusSpec, DataConfig, PrepareConfig
from raymt.data import builtin, layout, prepare, shards, sources
from raymt.data import format as corpus_format
from raymt.data.__main__ import main as data_main
from raymt.flags import build_config
from raymt.rundata import materialize, pair_tags, plan_data
from raymt.tags import BT_TAG
from raymt.tokenizer import train_tokenizer
from raymt.train import parse_args

SMALL = ["--vocab-size", "200", "--sp-model-type", "bpe"]
SIZES = {"builtin_train_size": 300, "builtin_eval_size": 20}


@pytest.fixture
def no_ray(monkeypatch):
    """Fail any test that starts Ray: these inputs are all prepared in the driver or refused before."""
    import ray

    from raymt.data import prepare as prepare_module

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(prepare_module, "init_ray", refuse)


@pytest.fixture
def small_builtin(monkeypatch):
    """`raymt data prepare --pairs` generates 300 training and 20 evaluation pairs per pair."""
    for name, value in SIZES.items():
        monkeypatch.setattr(DataConfig, name, value)


def prepare_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`raymt data prepare ARGV` in this process; (status, stdout, stderr)."""
    status = data_main(["prepare", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def shard_rows(corpus: str, entry: corpus_format.TrainingCorpus) -> list[tuple[list[int], list[int]]]:
    """Every (src_ids, tgt_ids) of a corpus's shards."""
    rows = []
    for shard in entry.shards:
        table = pq.read_table(shard.path)
        rows += zip(table.column("src_ids").to_pylist(), table.column("tgt_ids").to_pylist())
    return rows


def write_bt_dir(path: Path, rows: list[tuple[str, str]], src_lang: str = "de", tgt_lang: str = "en") -> str:
    """A `raymt backtranslate` output: shards of (line_id, input, output, score) and bt.json of a
    `src_lang`->`tgt_lang` model (rows are (input, output))."""
    path.mkdir(parents=True)
    half = len(rows) // 2
    for first, part in ((0, rows[:half]), (half, rows[half:])):
        table = pa.table(
            {
                "line_id": pa.array(range(first, first + len(part)), pa.int64()),
                "input": [i for i, _ in part],
                "output": [o for _, o in part],
                "score": pa.array([-1.0] * len(part), pa.float32()),
            }
        )
        pq.write_table(table, path / f"part-{first}.parquet")
    meta = {"src_lang": src_lang, "tgt_lang": tgt_lang, "checkpoint": "ckpt", "num_lines": len(rows), "done": True}
    (path / "bt.json").write_text(json.dumps(meta))
    return str(path)


# ---------------------------------------------------------------- flags and tables -> config


def test_flags_make_one_pair_or_corpora():
    assert build_config(parse_args([])).data.corpora == [CorpusSpec("en", "de")]  # the built-in en-de
    one = build_config(parse_args(["--train", "en-de:a", "--valid", "en-de:v", "--test", "t"]))
    assert one.data.corpora == [CorpusSpec("en", "de", ("a",), valid="v", test=("t",))]
    bare = build_config(parse_args(["--src-lang", "fr", "--tgt-lang", "en", "--train", "a", "--valid", "v"]))
    assert bare.data.corpora == [CorpusSpec("fr", "en", ("a",), valid="v")]
    assert build_config(parse_args(["--pairs", "fr-es"])).data.corpora == [CorpusSpec("fr", "es")]
    langs = build_config(parse_args(["--src-lang", "fr", "--valid", "v", "--test", "t"]))
    assert langs.data.corpora == [CorpusSpec("fr", "de", valid="v", test=("t",))]
    # Older configs' one-pair fields, in a config file or --set, change the one corpus.
    assert build_config(parse_args(["--set", "data.tgt_lang=es"])).data.corpora == [CorpusSpec("en", "es")]

    argv = ["--train", "en-de:a", "--train", "en-fr:b", "--valid", "en-de:v", "--valid", "en-fr:w"]
    argv += ["--bt", "en-de:s3://bucket/bt/", "--test", "en-fr:t1", "--test", "en-fr:t2", "--set", "data.temperature=5"]
    many = build_config(parse_args(argv))
    assert [c.name for c in many.data.corpora] == ["en-de", "en-fr", "en-de.bt"]
    assert many.data.corpora[1] == CorpusSpec("en", "fr", ("b",), valid="w", test=("t1", "t2"))
    assert many.data.corpora[2].train == ("s3://bucket/bt/",) and many.data.temperature == 5.0
    assert many.data.sp_vocab_size() == 8000
    pairs = build_config(parse_args(["--pairs", "en-de,en-fr,de-en"]))
    assert [(c.pair, c.builtin) for c in pairs.data.corpora] == [("en-de", True), ("en-fr", True), ("de-en", True)]
    assert pairs.data.sp_vocab_size() == 1000
    # Two files of one pair: one real corpus.
    two = build_config(parse_args(["--train", "a", "--train", "b", "--valid", "v"]))
    assert two.data.corpora == [CorpusSpec("en", "de", ("a", "b"), valid="v")]
    # So is one .tsv/.jsonl/Parquet input.
    tsv = build_config(parse_args(["--train", "news.tsv.gz", "--valid", "v"]))
    assert tsv.data.corpora == [CorpusSpec("en", "de", ("news.tsv.gz",), valid="v")]


def test_tables_round_trip_and_old_configs_load(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[data]\ntemperature = 5.0\nbt_tag = false\n"
        '[[data.corpora]]\nsrc_lang = "en"\ntgt_lang = "de"\ntrain = ["c/europarl", "c/news"]\n'
        'valid = "c/dev"\ntest = ["c/newstest2014"]\n'
        '[[data.corpora]]\nsrc_lang = "en"\ntgt_lang = "de"\ntrain = "s3://b/bt/"\norigin = "bt"\nweight = 2\n'
    )
    cfg = build_config(parse_args(["--config", str(toml)]))
    assert cfg.data.corpora == [
        CorpusSpec("en", "de", ("c/europarl", "c/news"), valid="c/dev", test=("c/newstest2014",)),
        CorpusSpec("en", "de", ("s3://b/bt/",), "bt", 2),
    ]
    assert (cfg.data.temperature, cfg.data.bt_tag) == (5.0, False)
    saved = json.loads(json.dumps(cfg.to_dict()))  # as config.json holds it
    assert Config.from_dict(saved) == cfg

    # A single-pair config.json is its one corpus; an older one (one-pair fields, no corpora,
    # temperature or bt_tag) is read into it.
    single = Config().to_dict()
    assert {k: single["data"][k] for k in ("corpora", "temperature", "bt_tag")} == {
        "corpora": [
            {"src_lang": "en", "tgt_lang": "de", "train": (), "origin": "real", "weight": 1.0}
            | {"valid": None, "test": (), "label": None, "clean": {}}
        ],
        "temperature": 1.0,
        "bt_tag": True,
    }
    for key in ("corpora", "temperature", "bt_tag"):
        del single["data"][key]
    assert Config.from_dict(single) == Config()
    old = {"src_lang": "fr", "tgt_lang": "en", "train": "tr", "valid": "va", "test": None, "corpora": []}
    assert Config.from_dict({"data": old}).data.corpora == [CorpusSpec("fr", "en", ("tr",), valid="va")]
    prepared = {"src_lang": "cs", "tgt_lang": "en", "train": None, "valid": None, "test": None, "corpus": "c"}
    assert Config.from_dict({"data": prepared}).data.corpora == [CorpusSpec("cs", "en")]  # any language
    beside = {"src_lang": "en", "tgt_lang": "de", "corpora": [{"src_lang": "de", "tgt_lang": "en"}]}
    assert Config.from_dict({"data": beside}).data.corpora == [CorpusSpec("de", "en")]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": "x", "valid": "v"}, "data.corpora and data.train are both set"),
        ({"corpus": "c"}, "data.corpus and data.train are both set"),
        ({"test": "t"}, "data.corpora and data.test are both set"),
        ({"temperature": 0}, "data.temperature=0 must be a number > 0"),
    ],
)
def test_corpora_with_single_pair_fields_are_refused(data, message):
    tables = [{"src_lang": "en", "tgt_lang": "de", "train": "a", "valid": "w"}, {"src_lang": "en", "tgt_lang": "fr"}]
    with pytest.raises(ValueError, match=message):
        Config.from_dict({"data": {"corpora": tables, **data}})


# ---------------------------------------------------------------- the prepared corpus


def test_builtin_three_pairs_make_a_tagged_corpus(tmp_path, capsys, no_ray, small_builtin):
    out = tmp_path / "m"
    status, stdout, err = prepare_cli(capsys, "--out", str(out), "--pairs", "en-de,en-fr,de-en", *SMALL)
    assert status == 0, err
    prepared = corpus_format.open_corpus(str(out))
    manifest = prepared.manifest
    assert manifest["format"] == corpus_format.FORMAT
    assert manifest["tags"] == {"target_langs": ["de", "en", "fr"], "reserved": {"<2de>": 4, "<2en>": 5, "<2fr>": 6}}
    assert (manifest["options"]["temperature"], manifest["options"]["bt_tag"]) == (1.0, True)
    corpora = prepared.training_corpora
    assert [(c.name, c.origin, c.source_tags) for c in corpora] == [
        ("en-de", "real", ("<2de>",)),
        ("en-fr", "real", ("<2fr>",)),
        ("de-en", "real", ("<2en>",)),
    ]

    tokenizer = prepared.tokenizer()
    tag_ids = {4, 5, 6}
    for piece, i in manifest["tags"]["reserved"].items():
        assert tokenizer.sp.piece_to_id(piece) == i and tokenizer.sp.is_control(i)
    # A tag in text stays text: ordinary pieces (here unknown: the corpus has no '<'), never a tag id.
    literal = "Treffen am <2de> Montag"
    assert not tag_ids & set(tokenizer.encode(literal))
    assert "<2de>" not in tokenizer.sp.encode(literal, out_type=str) and "2de" in tokenizer.decode(
        tokenizer.encode(literal)
    )

    for c in corpora:
        rows = shard_rows(str(out), c)
        expected = builtin.builtin_splits(c.src_lang, c.tgt_lang, 300, 20, 1)
        assert len(rows) == c.num_pairs == 300
        tag = manifest["tags"]["reserved"][c.source_tags[0]]
        # The corpus's tag first on every source, nowhere else; the text after it is the pair's.
        assert all(s[0] == tag and not tag_ids & set(s[1:]) and not tag_ids & set(t) for s, t in rows)
        decoded = {(tokenizer.decode(s), tokenizer.decode(t)) for s, t in rows}
        assert decoded == set(zip(*expected["train"]))
        assert prepared.eval_set("valid", c.pair) == expected["valid"]
        assert prepared.eval_set("test", c.pair) == expected["test"]
        assert prepared.prefix_ids(c.pair) == [tag]
    assert "en-fr (real)" in stdout and "total bt" in stdout and "<2fr> = id 6" in stdout

    again = prepare_cli(capsys, "--out", str(out), "--pairs", "en-de,en-fr,de-en", *SMALL)
    assert again[0] == 0 and "already prepared" in again[1]


def test_back_translated_pairs_are_tagged_and_counted_apart(tmp_path, capsys, no_ray):
    real = mirrored(60)
    synthetic = [(f"{t} synthetic", f"{s} synthetic") for s, t in mirrored(40, 100)]  # (German input, English output)
    synthetic[5] = (synthetic[5][0], "")  # a line the model failed on: dropped and counted
    bt_dir = write_bt_dir(tmp_path / "bt", synthetic)
    text_bt = write_prefix(tmp_path / "textbt", mirrored(10, 300))
    train = write_prefix(tmp_path / "train", real)
    valid = write_prefix(tmp_path / "valid", mirrored(5, 500))
    out = tmp_path / "c"
    argv = ["--out", str(out), "--train", train, "--valid", valid, "--bt", bt_dir, "--bt", f"en-de:{text_bt}", *SMALL]
    status, stdout, err = prepare_cli(capsys, *argv)
    assert status == 0, err
    prepared = corpus_format.open_corpus(str(out))
    manifest = prepared.manifest
    assert prepared.reserved == {BT_TAG: 4}  # one target language: no <2de>
    real_corpus, bt = prepared.training_corpora
    assert (real_corpus.name, real_corpus.source_tags, bt.name, bt.source_tags) == ("en-de", (), "en-de.bt", (BT_TAG,))
    assert bt.num_pairs == 39 + 10 and manifest["corpora"][1]["train"]["dropped"]["empty"] == 1
    tokenizer = prepared.tokenizer()
    rows = shard_rows(str(out), bt)
    assert all(s[0] == 4 and 4 not in s[1:] for s, _ in rows)
    assert all(4 not in s for s, _ in shard_rows(str(out), real_corpus))
    decoded = {(tokenizer.decode(s), tokenizer.decode(t)) for s, t in rows}
    # The trained pair is en-de: the English `output` is the source, the German `input` the target.
    expected = {(o, i) for i, o in synthetic if o} | set(mirrored(10, 300))
    assert decoded == expected
    assert manifest["splits"]["valid"]["en-de"]["num_pairs"] == 5
    rows = dict(layout.corpora_summary_rows(manifest))
    assert rows["total real"][:2] == [60, 60] and rows["total bt"][:2] == [50, 49] and rows["total"][1] == 109
    assert "en-de.bt (bt)" in stdout and "dropped in en-de.bt: empty 1" in stdout

    no_tag = prepare_cli(capsys, *argv[:1], str(tmp_path / "c2"), *argv[2:], "--no-bt-tag", "--real-weight", "2")
    assert no_tag[0] == 0, no_tag[2]
    plain = corpus_format.open_corpus(str(tmp_path / "c2"))
    assert plain.reserved == {} and plain.options["bt_tag"] is False
    # --real-weight: the real pairs twice per epoch beside the synthetic ones.
    assert [c.weight for c in plain.training_corpora] == [2.0, 1.0]


def test_temperature_balances_the_sentencepiece_sample(tmp_path, capsys, no_ray, monkeypatch):
    """The joint sample takes each corpus's share of sp_sample_size at the run's temperature."""
    seen = []

    def spy(sentences, *args, **kwargs):
        sentences = list(sentences)
        seen.append((sentences, kwargs["control_symbols"]))
        return train_tokenizer(sentences, *args, **kwargs)

    monkeypatch.setattr(prepare, "train_tokenizer", spy)
    big = write_prefix(tmp_path / "big", mirrored(90))
    small = tmp_path / "small"
    for lang, lines in (("en", [s for s, _ in mirrored(10, 200)]), ("fr", [t for _, t in mirrored(10, 200)])):
        Path(f"{small}.{lang}").write_text("\n".join(lines) + "\n")
    valid = write_prefix(tmp_path / "v", mirrored(3, 500))
    for lang in ("en", "fr"):
        Path(f"{tmp_path}/vf.{lang}").write_text("a b c\n")
    base = ["--train", f"en-de:{big}", "--train", f"en-fr:{small}", "--valid", f"en-de:{valid}"]
    base += ["--valid", f"en-fr:{tmp_path}/vf", "--sp-sample-size", "20", *SMALL]
    for temperature, shares in (("1", (18, 2)), ("100", (10, 10))):
        status, _, err = prepare_cli(capsys, "--out", str(tmp_path / temperature), "--temperature", temperature, *base)
        assert status == 0, err
        sentences, symbols = seen[-1]
        assert len(sentences) == 2 * sum(shares) and symbols == ["<2de>", "<2fr>"]
        from_small = sum(s in {x for x, _ in mirrored(10, 200)} for s in sentences)  # its sources
        assert from_small == shares[1]


def test_one_pair_flags_and_one_labeled_corpus_prepare_alike(tmp_path, capsys, no_ray):
    """--train PREFIX (the one-pair flags) and --train en-de:PREFIX (one real corpus) prepare the
    same corpus, byte for byte: one corpus, no tags, a SentencePiece model without control symbols."""
    train = write_prefix(tmp_path / "train", mirrored(80))
    valid = write_prefix(tmp_path / "valid", mirrored(5, 500))
    old = prepare_cli(capsys, "--out", str(tmp_path / "old"), "--train", train, "--valid", valid, *SMALL)
    new = prepare_cli(capsys, "--out", str(tmp_path / "new"), "--train", f"en-de:{train}", "--valid", valid, *SMALL)
    assert old[0] == new[0] == 0, (old, new)
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("old", "new")]
    for m in manifests:
        del m["created"], m["command"]
    assert manifests[0] == manifests[1] and manifests[0]["format"] == corpus_format.FORMAT
    assert (tmp_path / "old" / "spm.model").read_bytes() == (tmp_path / "new" / "spm.model").read_bytes()
    assert manifests[0]["tags"] == {"target_langs": ["de"], "reserved": {}}
    # No control symbols: the same model as a tokenizer trained without the argument.
    lines = [s for pair in mirrored(30) for s in pair]
    assert (
        train_tokenizer(lines, 96, "bpe").model_proto
        == train_tokenizer(lines, 96, "bpe", control_symbols=()).model_proto
    )
    # Every reader sees it as one real, untagged corpus.
    new = corpus_format.open_corpus(str(tmp_path / "new"))
    (only,) = new.training_corpora
    assert (only.name, only.origin, only.source_tags, only.num_pairs) == ("en-de", "real", (), 80)
    assert new.prefix_ids("en-de") == []


@pytest.mark.slow  # Ray Data's start-up: ~15 s on 2 CPUs
@pytest.mark.ci
def test_ray_data_writes_the_tagged_corpora_the_driver_writes(ray_cluster, tmp_path, monkeypatch):
    """Several corpora through Ray Data's tasks (large inputs) equal the driver's passes: the same
    tagged SentencePiece model, counts and rows (tags included), shard by shard."""
    cfg = PrepareConfig(vocab_size=120, sp_model_type="bpe", shard_pairs=40, dedup=True)
    pairs = mirrored(70) + mirrored(10)  # 10 duplicates
    bt = write_bt_dir(tmp_path / "bt", [(t, s) for s, t in mirrored(50, 300)] + [("x", "")])
    specs = [CorpusSpec("en", "de", ("p",), valid="v"), CorpusSpec("en", "fr", ("p",), valid="v")]
    specs.append(CorpusSpec("en", "de", (bt,), "bt"))
    memory = sources.Source("pairs", pairs=([s for s, _ in pairs], [t for _, t in pairs]))
    corpora = [
        sources.CorpusInput(spec, [memory] if spec.origin == "real" else [sources.bt_source(bt, spec, cfg)])
        for spec in specs
    ]
    for c in corpora[:2]:
        c.valid = [sources.Source("pairs", pairs=(["a"], ["b"]))]

    def prepared(out: Path) -> tuple:
        manifest = prepare.prepare_corpora(cfg, str(out), corpora)
        entries = corpus_format.PreparedCorpus(str(out), manifest).training_corpora
        rows = [pq.read_table(shard.path).to_pylist() for c in entries for shard in c.shards]
        return [c["train"]["dropped"] for c in manifest["corpora"]], manifest["sp_model_sha256"], manifest["tags"], rows

    here = prepared(tmp_path / "here")
    monkeypatch.setattr(shards, "DRIVER_PAIRS", 0)
    monkeypatch.setattr(shards, "DRIVER_BYTES", 0)
    assert prepared(tmp_path / "ray") == here
    assert [d["duplicate"] for d in here[0]] == [10, 10, 0] and here[0][2]["empty"] == 1
    assert here[2]["reserved"] == {"<2de>": 4, "<2fr>": 5, BT_TAG: 6}
    assert all(row["src_ids"][:2] == [4, 6] for row in here[3][-2]) and len(here[3]) == 2 + 2 + 2


def test_eval_rows_put_the_pair_tag_first():
    tokenizer = train_tokenizer([s for pair in mirrored(30) for s in pair], 96, "bpe", control_symbols=["<2de>"])
    pairs = ([mirrored(1)[0][0]], [mirrored(1)[0][1]])
    plain, tagged = corpus_format.eval_rows(pairs, tokenizer, 64), corpus_format.eval_rows(pairs, tokenizer, 64, [4])
    assert tagged[0]["src_ids"] == [4] + plain[0]["src_ids"] and tagged[0]["tgt_ids"] == plain[0]["tgt_ids"]


# ---------------------------------------------------------------- a run's prepare step


def test_a_run_prepares_its_corpora_per_pair(tmp_path, no_ray):
    sets = [f"--set=data.{k}={v}" for k, v in SIZES.items()] + ["--set=data.vocab_size=200"]
    cfg = build_config(parse_args(["--pairs", "en-de,en-fr,de-en", *sets, "--set=data.sp_model_type=bpe"]))
    cfg, run_data = plan_data(cfg, tmp_path / "run", None, None)
    assert sorted(run_data.eval_sets["valid"]) == ["de-en", "en-de", "en-fr"]
    assert run_data.eval_sets["test"]["en-fr"] == builtin.builtin_splits("en", "fr", 300, 20, 1)["test"]
    prepared = materialize(run_data)
    corpora, tokenizer = prepared.training_corpora, prepared.tokenizer()
    assert [(c.name, c.source_tags, c.num_pairs) for c in corpora] == [
        ("en-de", ("<2de>",), 300),
        ("en-fr", ("<2fr>",), 300),
        ("de-en", ("<2en>",), 300),
    ]
    assert all(s[0] == tokenizer.sp.piece_to_id(c.source_tags[0]) for c in corpora for s, _ in shard_rows("", c))
    assert prepared.options["vocab_size"] == 200
    # A resumed run finds its corpus prepared; a prepared /2 corpus gives the same sets per pair.
    _, resumed = plan_data(cfg, tmp_path / "run", str(tmp_path / "run"), None)
    assert resumed.corpora is None
    given = build_config(parse_args(["--corpus", run_data.corpus_dir]))
    _, from_corpus = plan_data(given, tmp_path / "run2", None, None)
    assert from_corpus.eval_sets["valid"] == run_data.eval_sets["valid"]
    # A checkpoint whose SentencePiece model lacks the tags cannot start these corpora.
    untagged = tmp_path / "ckpt"
    untagged.mkdir()
    (untagged / "spm.model").write_bytes(train_tokenizer(["a b c", "d e f"] * 20, 24, "bpe").model_proto)
    with pytest.raises(ValueError, match="does not reserve the tag.s. <2de>, <2en>, <2fr>"):
        plan_data(cfg, tmp_path / "run3", None, untagged)


def test_labeled_corpora_of_one_pair_mix_by_weight(tmp_path, no_ray):
    """A domain corpus beside a general one of the same pair (fine-tuning without forgetting):
    each its own training corpus with its weight, one untagged pair, one validation set."""
    general = write_prefix(tmp_path / "general", mirrored(60))
    domain = write_prefix(tmp_path / "domain", mirrored(20, 300))
    valid = write_prefix(tmp_path / "valid", mirrored(5, 500))
    config = tmp_path / "mix.toml"
    config.write_text(
        f'[[data.corpora]]\nlabel = "general"\nsrc_lang = "en"\ntgt_lang = "de"\ntrain = "{general}"\n'
        f'valid = "{valid}"\n[[data.corpora]]\nlabel = "domain"\nsrc_lang = "en"\ntgt_lang = "de"\n'
        f'train = "{domain}"\nweight = 3.0\n'
    )
    cfg = build_config(parse_args(["--config", str(config), "--set=data.vocab_size=200"]))
    assert [c.name for c in cfg.data.corpora] == ["general", "domain"] and cfg.data.pairs() == [("en", "de")]
    cfg, run_data = plan_data(cfg, tmp_path / "run", None, None)
    prepared = materialize(run_data)
    corpora = prepared.training_corpora
    assert [(c.name, c.weight, c.num_pairs, c.source_tags) for c in corpora] == [
        ("general", 1.0, 60, ()),
        ("domain", 3.0, 20, ()),
    ]
    assert pair_tags(prepared).languages is None  # one pair: an untagged model
    twice = config.read_text().replace('label = "domain"\n', "")
    config.write_text(twice.replace('label = "general"\n', ""))
    with pytest.raises(ValueError, match="given twice.*label"):
        build_config(parse_args(["--config", str(config)]))


def test_a_run_on_one_tsv_corpus_is_a_one_pair_run(tmp_path, no_ray):
    """One real corpus that data.train cannot hold (a .tsv): a corpus of one, untagged."""
    for name, pairs in (("train", mirrored(60)), ("valid", mirrored(4, 500)), ("test", mirrored(3, 600))):
        (tmp_path / f"{name}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    argv = [f"--train=en-fr:{tmp_path}/train.tsv", f"--valid=en-fr:{tmp_path}/valid.tsv"]
    argv += [f"--test=en-fr:{tmp_path}/test.tsv", "--set=data.vocab_size=96", "--set=data.sp_model_type=bpe"]
    cfg, run_data = plan_data(build_config(parse_args(argv)), tmp_path / "run", None, None)
    assert cfg.data.pairs() == [("en", "fr")]
    assert run_data.eval_sets == {
        "valid": {"en-fr": tuple(map(list, zip(*mirrored(4, 500))))},
        "test": {"en-fr": tuple(map(list, zip(*mirrored(3, 600))))},
    }
    prepared = materialize(run_data)
    (corpus,) = prepared.training_corpora
    assert prepared.manifest["format"] == corpus_format.FORMAT and prepared.reserved == {}
    assert (corpus.name, corpus.source_tags, corpus.num_pairs) == ("en-fr", (), 60)
    assert list(corpus.shards) == prepared.shards()
    assert pair_tags(prepared).languages is None


# ---------------------------------------------------------------- bad input: one line, before Ray


def bad_prepare_case(tmp_path: Path, case: str) -> list[str]:
    """`raymt data prepare` flags of one bad-input case."""
    train = write_prefix(tmp_path / "train", mirrored(20))
    valid = write_prefix(tmp_path / "valid", mirrored(3, 500))
    out = ["--out", str(tmp_path / "o")]
    bt_dir = write_bt_dir(tmp_path / "bt", [(t, s) for s, t in mirrored(10)]) if "bt" in case else ""
    return (
        out
        + {
            "no_valid": ["--train", f"en-de:{train}", "--train", f"en-fr:{train}", "--valid", f"en-de:{valid}"],
            "pair_twice": ["--pairs", "en-de,en-fr,en-de"],
            "not_builtin": ["--pairs", "en-de,en-ja"],
            "bad_spec": ["--train", f"en:{train}", "--valid", valid],
            "valid_without_data": [
                "--train",
                f"en-de:{train}",
                "--valid",
                f"en-de:{valid}",
                "--valid",
                f"en-fr:{valid}",
            ],
            "two_valid": ["--train", f"en-de:{train}", "--valid", f"en-de:{valid}", "--valid", f"en-de:{valid}"],
            "bt_direction": ["--train", f"de-en:{train}", "--valid", f"de-en:{valid}", "--bt", f"de-en:{bt_dir}"],
            "bt_unfinished": ["--train", train, "--valid", valid, "--bt", bt_dir],
            "pairs_and_train": ["--pairs", "en-de", "--train", f"en-de:{train}"],
            "real_weight_without_bt": ["--train", train, "--valid", valid, "--real-weight", "2"],
            "dataset_without_pairs": ["--dataset", "multi30k", "--bt", bt_dir],
        }[case]
    )


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_valid", "pair en-fr has no validation set: pass --valid en-fr:PREFIX"),
        ("pair_twice", "--pairs: en-de given twice"),
        ("not_builtin", "language 'ja' is not in the built-in corpus"),
        ("bad_spec", "'en' is not a language pair"),
        ("valid_without_data", "--valid en-fr:... names a pair with no --train or --bt data"),
        ("two_valid", "--valid is given 2 times for en-de"),
        ("bt_direction", "a de->en model made these pairs, so they train en-de, not de-en: pass --bt en-de:"),
        ("bt_unfinished", "the back-translation is not finished"),
        ("pairs_and_train", "en-de also comes from --pairs"),
        ("real_weight_without_bt", "--real-weight upsamples the real pairs beside back-translated ones: add --bt"),
        ("dataset_without_pairs", "name its pairs with --pairs"),
    ],
)
def test_bad_corpora_fail_in_one_line_before_ray(tmp_path, capsys, no_ray, case, message):
    argv = bad_prepare_case(tmp_path, case)
    if case == "bt_unfinished":
        meta = json.loads((tmp_path / "bt" / "bt.json").read_text())
        (tmp_path / "bt" / "bt.json").write_text(json.dumps({**meta, "done": False}))
    status, _, err = prepare_cli(capsys, *argv, *SMALL)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "o").exists()


def test_a_corpus_emptied_by_cleaning_is_named(tmp_path, capsys, no_ray):
    train = write_prefix(tmp_path / "train", mirrored(20))
    long = write_prefix(tmp_path / "long", [(" ".join(["w"] * 50), "x")] * 5)
    valid = write_prefix(tmp_path / "valid", mirrored(3, 500))
    argv = ["--out", str(tmp_path / "o"), "--train", train, "--valid", valid, "--bt", long, "--max-chars", "60"]
    status, _, err = prepare_cli(capsys, *argv, *SMALL)
    assert status == 2 and "error: corpus en-de.bt: all 5 training pairs were dropped (too_long_chars 5)" in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pairs", "en-de,en-fr", "--corpus", "c"], "data.corpora and data.corpus are both set"),
        (["--train", "en-de:a", "--train", "en-fr:b", "--valid", "en-de:v"], "pair en-fr has no validation set"),
        (["--valid", "en-fr:v"], "--valid en-fr:v names a pair with no --train, --bt or --pairs data"),
        (["--pairs", "en-de,en-fr", "--bt", "en-de:/nonexistent/bt"], "missing file /nonexistent/bt.en"),
    ],
)
def test_run_flags_fail_in_one_line_before_ray(tmp_path, capsys, monkeypatch, no_ray, argv, message):
    from raymt import train

    monkeypatch.setattr(train, "init_ray", lambda *a, **k: (_ for _ in ()).throw(AssertionError("Ray started")))
    status = train.main(["--storage-path", str(tmp_path), *argv, *[f"--set=data.{k}={v}" for k, v in SIZES.items()]])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err


def test_prepare_config_has_the_new_options():
    assert (PrepareConfig().temperature, PrepareConfig().bt_tag) == (1.0, True)
    with pytest.raises(ValueError, match=r"prepare.temperature=-1 must be a number > 0"):
        PrepareConfig(temperature=-1)


def test_the_sentencepiece_sample_takes_at_most_the_pairs_a_corpus_sample_holds():
    """Pass 1 counts duplicate pairs, a sample holds them once: k_i beyond its pairs would take
    targets as sources (and count them twice)."""
    deduplicated = ["s1", "s2", "t1", "t2"]  # 2 distinct pairs: sources, then targets
    other = ["a1", "a2", "a3", "b1", "b2", "b3"]
    joint, shares = prepare.joint_sample([deduplicated, other], [5, 2])
    assert shares == [2, 2]
    assert joint == ["s1", "s2", "t1", "t2", "a1", "a2", "b1", "b2"]
