"""Inputs that carry their languages: specs, tags (raymt.tags) and temperature mixing (raymt.data.mixing).

Fast unit tests, no Ray: the functions are pure (docs/design-inputs.md).
"""

import math
from collections import Counter

import numpy as np
import pytest

from raymt.config import (
    CorpusSpec,
    DataConfig,
    check_corpora,
    corpora_from_flags,
    corpora_from_tables,
    parse_pairs,
    split_spec,
)
from raymt.config.corpus import one_pair, with_one_pair
from raymt.data.epoch import Piece, epoch_pieces, stream_ranges
from raymt.data.mixing import allocate, epoch_rows, sample_sizes, sampling_probs
from raymt.tags import BT_TAG, decode_tags, lang_tag, reserved_pieces, source_tags

SIZES = [100_003, 9_001, 517]  # awkward sizes: floats of n_i / N are not exact


# ---------------------------------------------------------------- temperature


def test_temperature_one_is_proportional_and_five_flatter():
    p1, p5 = sampling_probs(SIZES, 1.0), sampling_probs(SIZES, 5.0)
    assert np.allclose(p1, np.array(SIZES) / sum(SIZES))
    root = np.array(SIZES, dtype=float) ** 0.2
    assert np.allclose(p5, root / root.sum())
    assert p5[0] < p1[0] and p5[2] > p1[2]  # the big corpus loses share, the small one gains
    assert np.allclose(sampling_probs(SIZES, math.inf), 1 / 3)
    assert math.isclose(p5.sum(), 1.0)


def test_weight_multiplies_size_before_temperature():
    assert np.allclose(sampling_probs([100, 50], 1.0, [1.0, 2.0]), [0.5, 0.5])
    assert np.allclose(sampling_probs([100, 50], 3.0, [1.0, 2.0]), sampling_probs([100, 100], 3.0))


def test_epoch_rows_at_temperature_one_are_each_corpus_once():
    assert epoch_rows(SIZES, 1.0) == SIZES
    assert epoch_rows([7], 5.0) == [7]  # one corpus: its epoch whatever T
    rows = epoch_rows(SIZES, 5.0)
    assert sum(rows) == sum(SIZES)
    assert rows[0] < SIZES[0] and rows[2] > SIZES[2]  # big corpus downsampled, small upsampled
    assert np.allclose(np.array(rows) / sum(rows), sampling_probs(SIZES, 5.0), atol=1e-5)
    assert epoch_rows([100, 50], 1.0, [2.0, 1.0]) == [200, 50]


def test_allocate_sums_exactly_and_gives_every_corpus_a_row():
    assert allocate(10, [1 / 3, 1 / 3, 1 / 3]) == [4, 3, 3]  # largest remainders, ties to the lower index
    assert allocate(10, [0.14, 0.86]) == [1, 9]  # 1.4 and 8.6: the larger remainder gets the row
    assert allocate(10, [0.25, 0.75]) == [3, 7]
    assert allocate(10, [0.75, 0.25]) == [8, 2]
    assert allocate(100, [0.999999, 0.000001]) == [100, 1]  # at least one row each


def test_sentencepiece_sample_is_balanced_by_the_temperature():
    assert sample_sizes([5_000_000], 200_000, 5.0) == [200_000]  # one corpus: today's sample
    assert sample_sizes([150_000, 50_000], 200_000, 1.0) == [150_000, 50_000]
    big, small = sample_sizes([1_000_000, 10_000], 200_000, 5.0)
    assert small == 10_000 and big == 200_000 - round(200_000 * sampling_probs([1_000_000, 10_000], 5.0)[1])


@pytest.mark.parametrize(
    "args, message",
    [
        (([10, 0], 1.0), "cleaning emptied"),
        (([10, 5], 0.0), "data.temperature=0.0 must be > 0"),
        (([10, 5], 1.0, [1.0, 0.0]), "weights"),
    ],
)
def test_sampling_rejects_bad_values(args, message):
    with pytest.raises(ValueError, match=message):
        sampling_probs(*args)


# ---------------------------------------------------------------- the epoch's schedule


def test_epoch_schedule_is_drawn_from_seed_and_epoch_only():
    rows = epoch_rows(SIZES, 5.0)
    assert epoch_pieces(rows, 1, 3) == epoch_pieces(rows, 1, 3)
    assert epoch_pieces(rows, 1, 3) != epoch_pieces(rows, 2, 3)
    assert epoch_pieces(rows, 1, 3) != epoch_pieces(rows, 1, 4)
    for e in (0, 3):
        pieces = epoch_pieces(rows, 1, e)
        for i, r in enumerate(rows):  # each corpus: its window of the stream, in order, once
            mine = [p for p in pieces if p.corpus == i]
            assert mine[0].lo == e * r and mine[-1].hi == (e + 1) * r
            assert all(a.hi == b.lo for a, b in zip(mine, mine[1:]))


def test_every_stretch_of_the_schedule_holds_the_epochs_mix():
    rows = epoch_rows([400_000, 100_000, 25_000], 1.0)
    pieces = epoch_pieces(rows, 1, 0)
    counts = np.array([math.ceil(r / 1024) for r in rows])
    seen = np.zeros(3)
    for length, piece in enumerate(pieces, 1):  # every prefix, so every worker's slice
        seen[piece.corpus] += 1
        assert (np.abs(seen - length * counts / counts.sum()) <= 2).all(), (length, seen)
    assert [p.corpus for p in pieces[:12]] != [p.corpus for p in epoch_pieces(rows, 1, 1)[:12]]


def test_one_corpus_reads_its_rows_in_order_at_any_seed():
    pieces = epoch_pieces([2500], seed=9, epoch=2)
    assert pieces == [Piece(0, 5000, 6024), Piece(0, 6024, 7048), Piece(0, 7048, 7500)]


def test_resume_from_any_position_continues_the_same_schedule():
    """An epoch's schedule is drawn from (seed, epoch) only: a run resumed in any epoch, after
    whatever else drew, reads that epoch's pieces as an uninterrupted run does."""
    rows = epoch_rows([5000, 1200, 300], 5.0)
    full = [epoch_pieces(rows, 4, epoch, 256) for epoch in range(3)]
    for epoch in (2, 0, 1):
        epoch_pieces(rows, 5, epoch, 256)  # another run's draws in between
        assert epoch_pieces(rows, 4, epoch, 256) == full[epoch]
    assert full[0] != full[1] != full[2]


def test_each_pair_once_per_epoch_of_its_corpus():
    sizes = [5000, 1200, 300]
    rows = epoch_rows(sizes, 5.0)  # the big corpus takes several epochs per pass, the small ones fewer
    assert rows[0] < sizes[0] and rows[2] > sizes[2]
    seen = [dict() for _ in sizes]  # corpus epoch -> times each row was read
    for piece in (p for epoch in range(7) for p in epoch_pieces(rows, 1, epoch, 256)):
        for k, lo, hi in stream_ranges(sizes[piece.corpus], piece.lo, piece.hi):
            seen[piece.corpus].setdefault(k, np.zeros(sizes[piece.corpus], int))[lo:hi] += 1
    for i, n in enumerate(sizes):
        complete = 7 * rows[i] // n  # corpus epochs finished in 7 epochs
        assert complete >= 1
        for k in range(complete):
            assert (seen[i][k] == 1).all(), (i, k)


def test_stream_ranges_split_at_corpus_epochs():
    assert stream_ranges(10, 5, 27) == [(0, 5, 10), (1, 0, 10), (2, 0, 7)]
    assert stream_ranges(10, 20, 20) == []


# ---------------------------------------------------------------- specs


def test_corpus_spec_holds_tuples_and_names():
    c = CorpusSpec("en", "de", ["a", "b"], "bt", 2, test="t")
    assert (c.train, c.test, c.pair, c.name, c.builtin) == (("a", "b"), ("t",), "en-de", "en-de.bt", False)
    assert CorpusSpec("en", "de").builtin


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(src_lang="en", tgt_lang="en"), "both 'en': pick two languages"),
        (dict(src_lang="en", tgt_lang="d e"), "must be a language code"),
        (dict(src_lang="en", tgt_lang="de", origin="synthetic"), "origin='synthetic' must be one of real, bt"),
        (dict(src_lang="en", tgt_lang="de", weight=0), "weight=0 must be a number > 0"),
        (dict(src_lang="en", tgt_lang="de", weight=float("nan")), "must be a number > 0"),
        (dict(src_lang="en", tgt_lang="de", origin="bt"), "back-translated corpus needs files: pass --bt en-de:PATH"),
        (dict(src_lang="en", tgt_lang="de", train=["a", "a"]), "listed twice"),
        (dict(src_lang="en", tgt_lang="de", train=[3]), "must be a path or a list of paths"),
    ],
)
def test_corpus_spec_rejects_mistakes_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        CorpusSpec(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("en-de:data/train", (("en", "de"), "data/train")),
        ("pt_BR-eng_Latn:x.tsv", (("pt_BR", "eng_Latn"), "x.tsv")),
        ("en-de:s3://bucket/bt/", (("en", "de"), "s3://bucket/bt/")),
        ("s3://bucket/train", (None, "s3://bucket/train")),
        ("data/train", (None, "data/train")),
        ("./a:b", (None, "./a:b")),
    ],
)
def test_split_spec(spec, expected):
    assert split_spec(spec, "--train") == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        ("en:x", "'en' is not a language pair"),
        ("pt-BR-en:x", "use pt_BR, not pt-BR"),
        ("en-en:x", "two different codes"),
        ("en-de:", "nothing after 'en-de:'"),
        ("", "empty SPEC"),
    ],
)
def test_split_spec_rejects_malformed_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        split_spec(spec, "--train")


def test_parse_pairs():
    assert parse_pairs("en-de,en-fr, de-en") == [("en", "de"), ("en", "fr"), ("de", "en")]
    with pytest.raises(ValueError, match="en-de given twice"):
        parse_pairs("en-de,en-fr,en-de")


def test_flags_group_by_pair_and_origin():
    corpora = corpora_from_flags(
        ["en-de:a", "b", "de-en:c"], ["s3://x/bt"], ["en-de:va", "de-en:vb"], ["en-de:t1", "en-de:t2"], ("en", "de")
    )
    assert corpora == [
        CorpusSpec("en", "de", ("a", "b"), valid="va", test=("t1", "t2")),
        CorpusSpec("de", "en", ("c",), valid="vb"),
        CorpusSpec("en", "de", ("s3://x/bt",), "bt"),
    ]
    both = corpora_from_flags(["en-de:m30k", "de-en:m30k"], [], ["en-de:val", "de-en:val"], [], ("en", "de"))
    # One prefix, two directions.
    assert [(c.pair, c.train) for c in both] == [("en-de", ("m30k",)), ("de-en", ("m30k",))]


def test_input_flags_are_one_group_for_train_and_prepare():
    """InputFlags: the same flags in `raymt train`'s config (`TrainFlags`) and in `raymt data
    prepare`'s (`PrepareCommand`), each a group with its own words in the help."""
    from raymt.command import parse, parser
    from raymt.data.__main__ import PrepareCommand
    from raymt.flags import InputFlags, TrainFlags

    argv = ["--train", "en-de:a", "--train", "b", "--bt", "en-de:bt", "--valid", "v", "--pairs", "en-fr"]
    flags = InputFlags(train=["en-de:a", "b"], valid=["v"], bt=["en-de:bt"], pairs="en-fr")
    assert parse(TrainFlags, argv, "train").inputs == flags
    assert flags.corpora(("en", "de"))[0] == CorpusSpec("en", "fr")  # --pairs first, without files

    def help_text(cls: type) -> str:
        return " ".join(parser(cls, "x").format_help().split())

    train, prepare = help_text(TrainFlags), help_text(PrepareCommand)
    assert "without SRC-TGT: for --src-lang-TGT (default: the pair of data.corpora" in train
    assert "--pairs SRC-TGT,... pairs of the built-in corpus, e.g." in train
    assert "without SRC-TGT: for --src-(--tgt) (PREFIX.<src>" in prepare and "{" not in prepare
    assert "--pairs SRC-TGT,... pairs of the built-in corpus or --dataset, e.g." in prepare


def test_real_weight_upsamples_the_real_corpora_beside_back_translated_ones():
    corpora = corpora_from_flags(["a", "de-en:c"], ["bt/"], ["v", "de-en:w"], [], ("en", "de"), real_weight=3)
    assert [(c.name, c.weight) for c in corpora] == [("en-de", 3.0), ("de-en", 3.0), ("en-de.bt", 1.0)]
    # Its share of an epoch at T=1: 3 * 100 real rows beside 100 synthetic ones.
    assert epoch_rows([100, 100], 1.0, [3.0, 1.0]) == [300, 100]
    for weight, message in ((0.0, "--real-weight 0 must be a number > 0"), (math.nan, "--real-weight nan must")):
        with pytest.raises(ValueError, match=message):
            corpora_from_flags(["a"], ["bt/"], ["v"], [], ("en", "de"), real_weight=weight)
    with pytest.raises(ValueError, match="--real-weight upsamples the real pairs beside back-translated ones: add"):
        corpora_from_flags(["a"], [], ["v"], [], ("en", "de"), real_weight=2)


@pytest.mark.parametrize(
    "flags, message",
    [
        ((["en-de:a", "en-fr:b"], [], ["en-de:v"], []), "pair en-fr has no validation set: pass --valid en-fr:PREFIX"),
        ((["en-de:a"], [], ["en-de:v", "en-fr:w"], []), "--valid en-fr:... names a pair with no --train or --bt data"),
        ((["en-de:a"], [], ["v", "en-de:w"], []), "--valid is given 2 times for en-de"),
        ((["en-de:a"], ["en-de:a"], ["v"], []), r"a \(en-de\) is in two corpora of one pair"),
    ],
)
def test_flags_reject_mistakes(flags, message):
    with pytest.raises(ValueError, match=message):
        corpora_from_flags(*flags, default_pair=("en", "de"))


def test_tables_give_corpora():
    corpora = corpora_from_tables(
        [
            {"src_lang": "en", "tgt_lang": "de", "train": "europarl", "valid": "dev", "weight": 2.0},
            {"src_lang": "en", "tgt_lang": "de", "train": ["bt1", "bt2"], "origin": "bt"},
            {"src_lang": "en", "tgt_lang": "fr"},  # the built-in corpus's en-fr
        ]
    )
    assert [c.name for c in corpora] == ["en-de", "en-de.bt", "en-fr"]
    assert corpora[0].weight == 2.0 and corpora[1].train == ("bt1", "bt2") and corpora[2].builtin


@pytest.mark.parametrize(
    "tables, message",
    [
        ([{"src_lang": "en", "tgt_lang": "de", "path": "x"}], r"data.corpora\[0\]: unknown key\(s\) path"),
        ([{"src_lang": "en", "train": "x"}], "tgt_lang missing"),
        (
            [
                {"src_lang": "en", "tgt_lang": "de", "train": "x", "valid": "v"},
                {"src_lang": "en", "tgt_lang": "de", "train": "y"},
            ],
            "corpus en-de is given twice",
        ),
        (
            [
                {"src_lang": "en", "tgt_lang": "de", "train": "x", "valid": "v"},
                {"src_lang": "en", "tgt_lang": "de", "train": "y", "origin": "bt", "valid": "w"},
            ],
            "pair en-de has 2 validation sets",
        ),
        ([{"src_lang": "en", "tgt_lang": "ja"}], "language 'ja' is not in the built-in corpus"),
        ([], "non-empty list of tables"),
    ],
)
def test_tables_reject_mistakes(tables, message):
    with pytest.raises(ValueError, match=message):
        corpora_from_tables(tables)


def test_single_pair_config_is_one_corpus():
    data = DataConfig()
    (builtin,) = data.corpora
    assert builtin == CorpusSpec("en", "de") and builtin.builtin and data.pairs() == [("en", "de")]
    # Older configs' one-pair fields are read into the corpus they describe.
    old = {"src_lang": "fr", "tgt_lang": "es", "train": "tr", "valid": "va", "test": "te"}
    corpora = with_one_pair(data.corpora, old)
    assert corpora == [CorpusSpec("fr", "es", ("tr",), valid="va", test=("te",))]
    check_corpora(corpora)
    assert reserved_pieces(corpora) == []  # no tag: the SentencePiece model stays as today's
    assert with_one_pair(corpora, {"train": None, "valid": None, "test": None}) == [CorpusSpec("fr", "es")]
    with pytest.raises(ValueError, match="--train is set but --valid is not"):
        with_one_pair(data.corpora, {"train": "tr"})


def test_only_one_real_corpus_of_one_file_is_what_the_one_pair_fields_described():
    flags = corpora_from_flags(["en-de:x"], [], ["en-de:v"], [], ("fr", "es"))
    assert one_pair(flags) and with_one_pair(flags, {"src_lang": "fr"})[0].pair == "fr-de"
    for corpora in (
        corpora_from_flags(["x"], ["y"], ["v"], [], ("en", "de")),  # + bt
        corpora_from_flags(["x", "y"], [], ["v"], [], ("en", "de")),  # 2 files
        corpora_from_flags(["en-de:x", "de-en:x"], [], ["en-de:v", "de-en:v"], [], ("en", "de")),
    ):
        assert not one_pair(corpora)
        assert with_one_pair(corpora, {"src_lang": "fr"}) == corpora  # languages beside corpora: unused
        with pytest.raises(ValueError, match="data.corpora and data.train are both set"):
            with_one_pair(corpora, {"train": "z"})
    assert epoch_rows([1234], 5.0) == [1234]


# ---------------------------------------------------------------- tags


def test_reserved_pieces_and_source_tags():
    de_en = [CorpusSpec("en", "de", ("a",)), CorpusSpec("de", "en", ("b",))]
    bt = CorpusSpec("en", "de", ("c",), "bt")
    assert lang_tag("de") == "<2de>"
    assert reserved_pieces(de_en) == ["<2de>", "<2en>"]
    assert reserved_pieces([*de_en, bt]) == ["<2de>", "<2en>", BT_TAG]
    assert reserved_pieces([*de_en, bt], bt_tag=False) == ["<2de>", "<2en>"]
    assert reserved_pieces([de_en[0], bt]) == [BT_TAG]  # one target language: no language tag
    reserved = reserved_pieces([*de_en, bt])
    assert source_tags(de_en[1], reserved) == ["<2en>"]
    assert source_tags(bt, reserved) == ["<2de>", BT_TAG]
    assert source_tags(bt, ["<2de>", "<2en>"]) == ["<2de>"]  # untagged back-translation


def test_a_corpus_language_with_a_hyphen_is_refused_in_one_line():
    """Pairs are named SRC-TGT everywhere (tags, metrics columns, manifests): pt-BR-en would be
    read as pt -> BR-en, and its validation sources would go untagged."""
    with pytest.raises(ValueError, match="src_lang=.pt-BR. must be a language code .*not pt-BR"):
        CorpusSpec("pt-BR", "en", ("a",))
    with pytest.raises(ValueError, match="tag language='zh-Hant'"):
        lang_tag("zh-Hant")
    assert CorpusSpec("pt_BR", "en", ("a",)).pair == "pt_BR-en" and lang_tag("pt_BR") == "<2pt_BR>"


def test_decode_tags_check_the_target_language():
    assert decode_tags("fr", ["de", "fr"], ["<2de>", "<2fr>"]) == ["<2fr>"]
    assert decode_tags(None, ["de"], []) == [] and decode_tags("de", ["de"], [BT_TAG]) == []
    with pytest.raises(ValueError, match="translates into de, fr: pass --tgt-lang"):
        decode_tags(None, ["de", "fr"], ["<2de>", "<2fr>"])
    with pytest.raises(ValueError, match="--tgt-lang es: this model was trained to translate into de, fr"):
        decode_tags("es", ["de", "fr"], ["<2de>", "<2fr>"])
    with pytest.raises(ValueError, match="--tgt-lang en: .* into de;"):
        decode_tags("en", ["de"], [])


# ---------------------------------------------------------------- the design's claim, end to end


def _write_corpora(directory, sizes: list[int]) -> tuple[list[list], dict[str, int]]:
    """Two Parquet shards per corpus whose sources name (corpus, row id); each shard's first row id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raymt.data.format import Shard

    corpora, first = [], {}
    for i, n in enumerate(sizes):
        corpora.append([])
        for lo, hi in ((0, n // 2), (n // 2, n)):
            path, ids = str(directory / f"c{i}-{lo}.parquet"), range(lo, hi)
            src = [[5 + i, 100 + r] + [7] * (r % 5) for r in ids]  # lengths 2-6
            pq.write_table(
                pa.table(
                    {
                        "src_ids": pa.array(src, pa.list_(pa.int32())),
                        "tgt_ids": pa.array([[9, 100 + r] for r in ids], pa.list_(pa.int32())),
                    }
                ),
                path,
                row_group_size=20,
            )
            corpora[i].append(Shard(path, hi - lo))
            first[path] = lo
    return corpora, first


class _MixedPlan:
    """Section 4 of docs/design-inputs.md over `corpora`: each epoch's reads, and what they hold."""

    def __init__(self, corpora: list[list], first: dict[str, int], rows: list[int], piece_rows: int):
        self.corpora, self.first, self.rows, self.piece_rows = corpora, first, rows, piece_rows
        self.sizes = [sum(s.num_pairs for s in shards) for shards in corpora]

    def corpus_reads(self, seed: int, i: int, k: int) -> list[tuple[str, int, int]]:
        """Corpus i's epoch k: its shards in the permutation [seed, k, 7919, i]."""
        order = np.random.default_rng([seed, k, 7919, i]).permutation(len(self.corpora[i]))
        return [(self.corpora[i][j].path, 0, self.corpora[i][j].num_pairs) for j in order]

    def epoch_reads(self, files, seed: int, epoch: int) -> list[tuple[str, int, int]]:
        """The mixed epoch's plan (stands in for raymt.data.epoch.epoch_reads)."""
        from raymt.data.epoch import sub_plan

        return [
            read
            for p in epoch_pieces(self.rows, seed, epoch, self.piece_rows)
            for k, a, b in stream_ranges(self.sizes[p.corpus], p.lo, p.hi)
            for read in sub_plan(self.corpus_reads(seed, p.corpus, k), a, b)
        ]

    def planned(self, seed: int, epoch: int) -> Counter:
        """(corpus, row id) of each corpus's stream window [epoch r_i, (epoch + 1) r_i)."""
        from raymt.data.epoch import sub_plan

        return Counter(
            (i, self.first[path] + x)
            for i, r in enumerate(self.rows)
            for k, a, b in stream_ranges(self.sizes[i], epoch * r, (epoch + 1) * r)
            for path, s, e in sub_plan(self.corpus_reads(seed, i, k), a, b)
            for x in range(s, e)
        )


def test_mixed_plan_through_todays_stream_is_exact(tmp_path, monkeypatch):
    """With only `epoch_reads` and `slice_bounds` giving the mixed plan, today's TrainStream,
    resume and elastic resize train each planned row once, and each pair once per corpus epoch."""
    from raymt.data import epoch as planning
    from raymt.data import stream

    sizes, seed = [300, 70, 45], 7
    corpora, first = _write_corpora(tmp_path, sizes)
    plan = _MixedPlan(corpora, first, epoch_rows(sizes, 5.0), piece_rows=16)
    bounds = lambda files, s, e, rank, world: planning.row_bounds(sum(plan.rows), rank, world)
    for module in (planning, stream):  # epoch_slice (the stream's plan) and resize_segment look them up
        monkeypatch.setattr(module, "epoch_reads", plan.epoch_reads)
        monkeypatch.setattr(module, "slice_bounds", bounds)
    corpora = planning.Mix(corpora, plan.rows, 16)  # read by the stream: its plan is the one above
    cfg = DataConfig(window_rows=32, shuffle_buffer_rows=32, max_tokens=64, max_len=20)

    def run(rank, world, position, segment=None, stop=None):
        s = stream.TrainStream(corpora, cfg, seed, rank, world, position, segment=segment)
        out = []
        for batch in s:
            out.append(([(int(c) - 5, int(r) - 100) for c, r in batch.src[:, :2].tolist()], s.position))
            if len(out) == stop:
                break
        s.close()
        return out

    def trained(*runs):
        return Counter(pair for batches in runs for pairs, _ in batches for pair in pairs)

    for epoch in range(3):  # each planned row once across 2 workers
        both = trained(run(0, 2, stream.Position(epoch)), run(1, 2, stream.Position(epoch)))
        assert both == plan.planned(seed, epoch)
    full = run(1, 2, stream.Position(2))
    for j in (1, len(full) // 2):  # resumed from a batch's position: the same remaining batches
        assert run(1, 2, full[j - 1][1]) == full[j:]
    old = [run(0, 2, stream.Position(1), stop=4), run(1, 2, stream.Position(1), stop=7)]
    saved = [batches[-1][1].to_dict() for batches in old]
    new = [run(r, 3, *stream.resume_point(corpora, cfg, seed, 1, saved, None, r, 3)) for r in range(3)]
    assert trained(*old, *new) == plan.planned(seed, 1)  # resized from 2 workers to 3 mid-epoch
    for i, n in enumerate(sizes):  # windows tile each corpus's stream: each pair once per corpus epoch
        seen = Counter(
            row for epoch in range(6) for (c, row), m in plan.planned(seed, epoch).items() if c == i for _ in range(m)
        )
        assert len(seen) == n and set(seen.values()) <= {6 * plan.rows[i] // n, -(-6 * plan.rows[i] // n)}
