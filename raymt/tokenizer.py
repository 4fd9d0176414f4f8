"""Joint SentencePiece tokenizer; the one place where special token ids are defined."""

from __future__ import annotations

import base64
import io
import json
import random
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence

import sentencepiece as spm

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3


def round_up(n: int, multiple: int = 8) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return (n + multiple - 1) // multiple * multiple


# An imported model's tokenizer (raymt.hf_import) is this line, then JSON: see Tokenizer.
BUNDLE_MAGIC = b"raymt-tokenizer\n"
BUNDLE_VERSION = 2  # 2: separate vocabularies (target_pieces); 1: one vocabulary


class Tokenizer:
    """raymt's tokenizer, from the bytes of `spm.model`: a SentencePiece model whose ids are the
    model's (every raymt-trained model: the vocabulary padded to 8), or an imported model's bundle
    (`bundle`): a source and a target SentencePiece model whose pieces map to the model's ids by a
    table (OPUS-MT's vocab.json, NLLB's fairseq offset), control ids (language codes: never made
    from text, dropped by `decode`) and aliases (raymt's tag names for them, "<2de>"). A bundle of
    separate vocabularies (OPUS-MT's target_vocab.json) has a second table, the target's ids (the
    decoder's and the output's: `side` "tgt"); PAD, UNK, BOS and EOS are the same ids on both sides.
    A bundle with `strip` decodes as MarianTokenizer does: the text stripped of surrounding spaces."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        if model_proto.startswith(BUNDLE_MAGIC):
            meta = json.loads(model_proto[len(BUNDLE_MAGIC) :])
            if meta.get("version", 1) > BUNDLE_VERSION:
                raise ValueError(f"a tokenizer bundle of version {meta['version']}: written by a newer raymt")
            self.source_proto = base64.b64decode(meta["source"])
            target = meta.get("target")
            self.target_proto = base64.b64decode(target) if target else self.source_proto
            self.source = spm.SentencePieceProcessor(model_proto=self.source_proto)
            self.target = spm.SentencePieceProcessor(model_proto=self.target_proto) if target else self.source
            self.pieces: Optional[list[str]] = meta["pieces"]  # model id -> piece ("": no piece)
            self.ids = {p: i for i, p in enumerate(self.pieces) if p}
            self.ids.update(meta.get("aliases", {}))
            self.controls = set(meta.get("controls", []))
            self.strip = bool(meta.get("strip", False))
            self.num_rows = int(meta["num_rows"])
            # The target's ids: the source's, or a table of their own (separate vocabularies).
            self.target_pieces, self.target_ids, self.target_controls = self.pieces, self.ids, self.controls
            if meta.get("target_pieces") is not None:
                self.target_pieces = meta["target_pieces"]
                self.target_ids = {p: i for i, p in enumerate(self.target_pieces) if p}
                self.target_controls = set(meta.get("target_controls", []))
        else:
            self.source_proto = self.target_proto = model_proto  # the SentencePiece models' bytes
            self.source = self.target = spm.SentencePieceProcessor(model_proto=model_proto)
            self.pieces = self.target_pieces = None
            self.strip = False
            assert self.source.pad_id() == PAD_ID and self.source.eos_id() == EOS_ID
        self.sp = self.source

    @classmethod
    def bundle(
        cls,
        source: bytes,
        target: Optional[bytes],
        pieces: Sequence[str],
        controls: Iterable[int] = (),
        aliases: Optional[dict[str, int]] = None,
        target_pieces: Optional[Sequence[str]] = None,
        target_controls: Iterable[int] = (),
        strip: bool = False,
    ) -> "Tokenizer":
        """An imported vocabulary: `pieces[i]` is model id i's piece ("" for none, PAD/UNK/BOS/EOS
        included), split by the `source` SentencePiece model on the source side and `target` (None:
        the same) on the target side; the model has `round_up(len(pieces))` rows. `target_pieces`
        (None: `pieces`) are the target's ids when the vocabularies are separate, with their own
        `target_controls`; `strip`: `decode` strips the text (MarianTokenizer's rule)."""
        meta = {
            "version": 1,
            "source": base64.b64encode(source).decode(),
            "target": None if target is None or target == source else base64.b64encode(target).decode(),
            "pieces": list(pieces),
            "controls": sorted(int(i) for i in controls),
            "aliases": dict(aliases or {}),
            "num_rows": round_up(len(pieces)),
        }
        if target_pieces is not None:  # only then: a shared vocabulary's bundle stays as it was
            meta.update(version=2, target_pieces=list(target_pieces))
            meta["target_controls"] = sorted(int(i) for i in target_controls)
        if strip:  # only then: the other families' bundles stay as they were
            meta["strip"] = True
        return cls(BUNDLE_MAGIC + json.dumps(meta, ensure_ascii=False).encode())

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """Load a `.model` file written by `save`."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"SentencePiece model {path} does not exist; point to the run's spm.model or a checkpoint directory"
            )
        try:
            return cls(path.read_bytes())
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a SentencePiece model or raymt tokenizer ({err})") from None

    def save(self, path: str | Path) -> None:
        """Write the serialized tokenizer (a SentencePiece model, or an imported bundle)."""
        Path(path).write_bytes(self.model_proto)

    @property
    def shared(self) -> bool:
        """Whether source and target ids are one vocabulary (every model but a separate-vocabulary import)."""
        return self.target_pieces is self.pieces

    @property
    def vocab_size(self) -> int:
        """Embedding rows (the source's): the vocabulary rounded up to a multiple of 8."""
        return self.num_rows if self.pieces is not None else round_up(self.source.get_piece_size())

    @property
    def target_vocab_size(self) -> int:
        """The target embedding's and the output's rows: `vocab_size`, or the target's own vocabulary's."""
        return self.vocab_size if self.shared else round_up(len(self.target_pieces))

    @property
    def num_pieces(self) -> int:
        """Source ids with a piece (the rest, up to `vocab_size`, are padding rows)."""
        return len(self.pieces) if self.pieces is not None else self.source.get_piece_size()

    def pieces_of(self, side: str = "src") -> list[str]:
        """Every id's piece on `side`, in id order ("" for an id without one), padding rows left out."""
        if self.pieces is None:
            return [self.source.id_to_piece(i) for i in range(self.source.get_piece_size())]
        return list(self.target_pieces if side == "tgt" else self.pieces)

    def id_to_piece(self, i: int, side: str = "src") -> str:
        """The piece of model id `i` (`side` "tgt": of the target's ids)."""
        if self.pieces is None:
            return self.source.id_to_piece(i)
        return (self.target_pieces if side == "tgt" else self.pieces)[i]

    def piece_to_id(self, piece: str, side: str = "src") -> int:
        """The model id of `piece` (or of a tag alias) on `side`, UNK_ID when it has none."""
        if self.pieces is None:
            return self.source.piece_to_id(piece)
        return (self.target_ids if side == "tgt" else self.ids).get(piece, UNK_ID)

    def is_control(self, i: int, side: str = "src") -> bool:
        """Whether id `i` is a control symbol (a tag or language code: never made from text)."""
        if self.pieces is None:
            return self.source.is_control(i)
        return i in (self.target_controls if side == "tgt" else self.controls)

    def encode(self, text: str, side: str = "src") -> list[int]:
        """Token ids of one sentence, without BOS/EOS (`side` "tgt": with the target's model and ids)."""
        if self.pieces is None:  # raymt's own: one model, its ids are the model's
            return self.source.encode(text)
        return self.encode_batch([text], side)[0]

    def encode_batch(self, texts: Sequence[str], side: str = "src") -> list[list[int]]:
        """Token ids of many sentences (SentencePiece's threaded batch path)."""
        sp = self.target if side == "tgt" else self.source
        if self.pieces is None:
            return sp.encode(list(texts))
        get = (self.target_ids if side == "tgt" else self.ids).get
        return [[get(p, UNK_ID) for p in pieces] for pieces in sp.encode(list(texts), out_type=str)]

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized text of target ids; ids past EOS, specials and padding rows are dropped."""
        out = []
        num = self.num_pieces if self.pieces is None else len(self.target_pieces)
        for i in ids:
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID) and i < num:
                out.append(int(i))
        if self.pieces is None:
            return self.source.decode(out)
        pieces, controls = self.target_pieces, self.target_controls
        text = self.target.decode_pieces([pieces[i] for i in out if i != UNK_ID and i not in controls and pieces[i]])
        # SentencePiece returns a piece its model lacks as written, "▁car" (OPUS-MT's joint
        # vocab.json holds the source's pieces too): its ▁ is a space, as in MarianTokenizer.
        text = text.replace("\u2581", " ")
        return text.strip() if self.strip else text


def train_tokenizer(
    sentences: Iterable[str],
    vocab_size: int,
    model_type: str = "unigram",
    sample_size: int = 200_000,
    seed: int = 1,
    num_threads: int = 1,
    control_symbols: Sequence[str] = (),
) -> Tokenizer:
    """Train a joint SentencePiece model on a reservoir sample of at most `sample_size` lines,
    with `num_threads` threads (the caller knows the machine: raymt.cluster.machine_cpus).

    `control_symbols` (tags such as <2de>, <BT>) get ids 4, 5, ... in order: never split,
    never made from text (a literal "<2de>" stays text), dropped by `decode`.
    """
    rng = random.Random(seed)
    sample: list[str] = []
    for n, line in enumerate(sentences):
        if len(sample) < sample_size:
            sample.append(line)
        else:
            j = rng.randrange(n + 1)
            if j < sample_size:
                sample[j] = line
    if not sample:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    buffer = io.BytesIO()
    # Passed only when there are some: a model without tags is trained exactly as before.
    extra = {"control_symbols": list(control_symbols)} if control_symbols else {}
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=buffer,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            hard_vocab_limit=False,
            num_threads=num_threads,
            minloglevel=2,
            **extra,
        )
    except RuntimeError as err:
        raise ValueError(_training_error(str(err), vocab_size)) from None
    return Tokenizer(buffer.getvalue())


def _training_error(message: str, vocab_size: int) -> str:
    """A one-line message for an error of SentencePiece's trainer."""
    # "Vocabulary size is smaller than required_chars. 16 vs 20.": every character of the
    # sample (character_coverage 1.0) and every special piece needs an id of its own.
    small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if small:
        return (
            f"vocabulary size {vocab_size} is smaller than the {small.group(2)} pieces that the training "
            f"text's characters and the special tokens need: raise data.vocab_size / --vocab-size to "
            f"at least {round_up(int(small.group(2)))}"
        )
    detail = message.strip().splitlines()[-1] if message.strip() else "no detail"
    return f"SentencePiece could not train a tokenizer ({detail}): check data.vocab_size / --vocab-size and the inputs"
