"""Tokenizer: special ids in one place, vocabulary padded to 8, round trip."""

import itertools

import pytest

from raymt.data import builtin
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer


def test_round_trip_and_special_ids(tmp_path):
    src, tgt = builtin.generate(600, "en", "de", seed=3)
    tok = train_tokenizer(itertools.chain(src, tgt), vocab_size=504, sample_size=500)
    assert tok.vocab_size % 8 == 0 and tok.vocab_size >= tok.sp.get_piece_size()
    assert (tok.sp.pad_id(), tok.sp.unk_id(), tok.sp.bos_id(), tok.sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    for line in src[:50] + tgt[:50]:
        assert tok.decode(tok.encode(line)) == line
    tok.save(tmp_path / "spm.model")
    again = Tokenizer.load(tmp_path / "spm.model")
    assert again.encode(src[0]) == tok.encode(src[0])
    # Decoding stops at EOS and skips BOS/PAD.
    ids = tok.encode(src[1])
    assert tok.decode([BOS_ID, *ids, EOS_ID, *tok.encode("junk"), PAD_ID]) == src[1]


def test_builtin_corpus_is_deterministic_and_held_out():
    a = builtin.builtin_splits("en", "fr", 300, 40, seed=5)
    b = builtin.builtin_splits("en", "fr", 300, 40, seed=5)
    assert a == b
    assert {k: len(v[0]) for k, v in a.items()} == {"train": 300, "valid": 40, "test": 40}
    train = set(a["train"][0])
    assert not train & set(a["valid"][0]) and not train & set(a["test"][0])
    assert all(len(s.split()) >= 1 for s in a["train"][1])


def test_a_pair_of_languages_gets_the_sentences_of_all_four():
    """Formatting only the two languages asked for draws the same phrases as formatting all."""
    import random

    for seed in range(200):
        both = builtin.sentence(random.Random(seed), ("de", "es"))
        every = builtin.sentence(random.Random(seed))
        assert both == {"de": every["de"], "es": every["es"]}, seed
    src, tgt = builtin.generate(50, "fr", "en", seed=2)
    assert [builtin.sentence(r)["fr"] for r in [random.Random(2)] for _ in range(50)] == src


def test_a_language_outside_the_corpus_gets_the_same_phrases_in_its_own_words():
    """benchmarks/noise.py's held-out wrong languages: the same draws, formatted by Babel in Russian."""
    import random

    for seed in range(20):
        ru, every = builtin.sentence(random.Random(seed), ("ru", "de")), builtin.sentence(random.Random(seed))
        assert ru["de"] == every["de"], seed
    months = [builtin._date(random.Random(seed), ("ru",))["ru"] for seed in range(20)]
    assert all(any("\u0400" <= c <= "\u04ff" for c in m) for m in months)  # Cyrillic month names
    with pytest.raises(ValueError, match="is not in the built-in corpus"):
        builtin.generate(5, "en", "ru", seed=1)  # the corpus itself stays LANGS


def test_a_vocabulary_too_small_for_the_characters_is_a_one_line_error():
    sentences = ["alpha beta gamma delta epsilon", "zeta eta theta"]  # 17 characters + 4 specials
    with pytest.raises(ValueError, match=r"^vocabulary size 16 is smaller than the \d+ pieces") as err:
        train_tokenizer(sentences, vocab_size=16, model_type="bpe")
    assert "raise data.vocab_size / --vocab-size to at least 24" in str(err.value) and "\n" not in str(err.value)


def test_an_imported_vocabulary_bundle(tmp_path):
    """A source and a target SentencePiece model over a model's own ids (raymt import's tokenizer):
    each side splits with its model, pieces map through the table, controls never come from text."""
    src, tgt = builtin.generate(300, "en", "de", seed=4)
    source, target = train_tokenizer(src, 120), train_tokenizer(tgt, 120)
    pieces_of = lambda sp: [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]  # noqa: E731
    table = ["<pad>", "<unk>", "<s>", "</s>", ">>fr<<", *dict.fromkeys(pieces_of(source.sp) + pieces_of(target.sp))]
    tok = Tokenizer.bundle(source.model_proto, target.model_proto, table, controls=[4], aliases={"<2fr>": 4})
    tok.save(tmp_path / "spm.model")
    tok = Tokenizer.load(tmp_path / "spm.model")
    assert tok.vocab_size == -(-len(table) // 8) * 8 and tok.num_pieces == len(table)
    assert tok.piece_to_id("<2fr>") == 4 and tok.is_control(4) and not tok.is_control(5)
    assert tok.piece_to_id("not a piece") == UNK_ID and tok.id_to_piece(4) == ">>fr<<"
    for line in tgt[:20]:
        ids = tok.encode(line, "tgt")
        assert [table[i] for i in ids] == target.sp.encode(line, out_type=str)
        assert tok.decode([4, *ids, EOS_ID, 7]) == line  # the control dropped, nothing after EOS
    assert [table[i] for i in tok.encode(src[0])] == source.sp.encode(src[0], out_type=str)
    with pytest.raises(ValueError, match="is not a SentencePiece model or raymt tokenizer"):
        (tmp_path / "bad.model").write_bytes(b"raymt-tokenizer\n{")
        Tokenizer.load(tmp_path / "bad.model")


def test_a_bundle_of_separate_vocabularies(tmp_path):
    """Separate source and target vocabularies (OPUS-MT's target_vocab.json): each side's ids come
    from its own table, of its own size, with raymt's specials at PAD 0 .. EOS 3 on both."""
    src, tgt = builtin.generate(300, "en", "de", seed=4)
    source, target = train_tokenizer(src, 120), train_tokenizer(tgt, 160)
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    src_table = specials + [source.sp.id_to_piece(i) for i in range(4, source.sp.get_piece_size())]
    tgt_table = specials + [">>x<<"] + [target.sp.id_to_piece(i) for i in range(4, target.sp.get_piece_size())]
    shared = Tokenizer.bundle(source.model_proto, target.model_proto, src_table)
    tok = Tokenizer.bundle(source.model_proto, target.model_proto, src_table, [], {}, tgt_table, [4])
    assert shared.shared and b'"version": 1' in shared.model_proto and b"target_pieces" not in shared.model_proto
    tok.save(tmp_path / "spm.model")
    tok = Tokenizer.load(tmp_path / "spm.model")
    assert not tok.shared and (tok.vocab_size, tok.target_vocab_size) == (
        -(-len(src_table) // 8) * 8,
        -(-len(tgt_table) // 8) * 8,
    )
    assert tok.pieces_of("src") == src_table and tok.pieces_of("tgt") == tgt_table
    assert all(tok.id_to_piece(i, side) == specials[i] for i in range(4) for side in ("src", "tgt"))
    assert tok.is_control(4, "tgt") and not tok.is_control(4) and tok.id_to_piece(4, "tgt") == ">>x<<"
    for line in tgt[:20]:
        ids = tok.encode(line, "tgt")
        assert [tgt_table[i] for i in ids] == target.sp.encode(line, out_type=str)
        assert [tok.piece_to_id(p, "tgt") for p in target.sp.encode(line, out_type=str)] == ids
        assert tok.decode([4, *ids, EOS_ID, 7]) == line  # the target's ids, its control dropped
    assert [src_table[i] for i in tok.encode(src[0])] == source.sp.encode(src[0], out_type=str)
