"""Joint SentencePiece tokenizer; the one place where special token ids are defined."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path
from typing import Iterable, Sequence

import sentencepiece as spm

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3


def round_up(n: int, multiple: int = 8) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return (n + multiple - 1) // multiple * multiple


class Tokenizer:
    """A SentencePiece model with raymt's special ids and a model vocabulary padded to 8."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        assert self.sp.pad_id() == PAD_ID and self.sp.eos_id() == EOS_ID

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
        except RuntimeError as err:
            raise ValueError(f"{path} is not a SentencePiece model ({err})") from None

    def save(self, path: str | Path) -> None:
        """Write the serialized SentencePiece model."""
        Path(path).write_bytes(self.model_proto)

    @property
    def vocab_size(self) -> int:
        """Embedding rows: the SentencePiece vocabulary rounded up to a multiple of 8."""
        return round_up(self.sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of one sentence, without BOS/EOS."""
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many sentences (SentencePiece's threaded batch path)."""
        return self.sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized text; ids past EOS, specials and padding rows are dropped."""
        out = []
        for i in ids:
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID) and i < self.sp.get_piece_size():
                out.append(int(i))
        return self.sp.decode(out)


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
