"""Test helpers: tiny untrained checkpoints and parallel text files, made in well under a second."""

import functools
import gzip
from pathlib import Path

import pytest
import torch

from raymt.checkpoint import TrainState, save_checkpoint
from raymt.config import Config, CorpusSpec, DataConfig, tiny
from raymt.data.builtin import generate
from raymt.model import Transformer
from raymt.tokenizer import Tokenizer, train_tokenizer


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Import into a test module: tiny models gain nothing from threads, busy CPUs lose a lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def tokenizer(vocab_size: int = 256) -> Tokenizer:
    """A joint en/de SentencePiece model trained on built-in corpus text."""
    src, tgt = generate(400, "en", "de", seed=1)
    return train_tokenizer(src + tgt, vocab_size)


def make_checkpoint(
    directory: Path, seed: int = 0, vocab_size: int = 256, d_model: int = 32, step: int = 0, pair: str = "en-de"
) -> Path:
    """A random tiny model saved as a raymt checkpoint (model.pt, config.json, spm.model, train_state.pt)
    translating `pair` (the tokenizer is joint en/de)."""
    torch.manual_seed(seed)
    tok = tokenizer(vocab_size)
    corpora = [CorpusSpec(*pair.split("-"))]
    config = Config(model=tiny(), data=DataConfig(vocab_size=vocab_size, corpora=corpora))
    config.model.d_model = d_model
    model = Transformer(config.model, tok.vocab_size)
    return save_checkpoint(directory, model, config, tok, TrainState(step=step))


def write_pairs(prefix: Path, num_pairs: int, seed: int, gz: bool = False) -> Path:
    """PREFIX.en and PREFIX.de from the built-in corpus (gzipped when gz)."""
    src, tgt = generate(num_pairs, "en", "de", seed=seed)
    for lang, lines in (("en", src), ("de", tgt)):
        text = "".join(line + "\n" for line in lines)
        if gz:
            with gzip.open(f"{prefix}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            Path(f"{prefix}.{lang}").write_text(text, encoding="utf-8")
    return prefix
