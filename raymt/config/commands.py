"""The options of the commands beside training: `raymt data prepare` (PrepareConfig, and the
one a run that prepares its own corpus derives), `raymt data score` (ScoreConfig) and
`raymt backtranslate` (BacktranslateConfig)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raymt.command import flag
from raymt.config.sections import Config, CorpusOptions, positive
from raymt.errors import check


@dataclass
class PrepareConfig(CorpusOptions):
    """`python -m raymt.data prepare`: cleaning, tokenizer and sharding of a raw parallel corpus
    (each field a flag of it: `raymt.data.__main__.PrepareCommand`)."""

    src_lang: str = flag("en", "src_lang (default %(default)s)", name="--src")
    tgt_lang: str = flag("de", "tgt_lang (default %(default)s)", name="--tgt")
    # Joint SentencePiece vocabulary (one model for both languages).
    vocab_size: int = flag(8000, "vocab_size (default %(default)s)")
    # At most this many pairs per Parquet shard.
    shard_pairs: int = flag(100_000, "shard_pairs (default %(default)s)")
    seed: int = flag(1, "seed (default %(default)s)")

    def __post_init__(self) -> None:
        for name in ("src_lang", "tgt_lang"):
            value = getattr(self, name)
            check(
                bool(value) and value.replace("-", "").replace("_", "").isalnum(),
                f"prepare.{name}={value!r} must be a language code such as en or pt_BR",
            )
        check(
            self.src_lang != self.tgt_lang,
            f"prepare.src_lang and prepare.tgt_lang are both {self.src_lang!r}: pick two languages",
        )
        self.check_corpus_options("prepare")
        positive(self, "prepare", "vocab_size", "shard_pairs")
        check(
            self.vocab_size % 8 == 0,
            f"prepare.vocab_size={self.vocab_size} must be a multiple of 8 (e.g. {(self.vocab_size + 7) // 8 * 8})",
        )


def run_prepare_config(cfg: Config) -> PrepareConfig:
    """The PrepareConfig of a run that prepares its own corpus (--train files or the built-in
    corpus): every CorpusOptions field comes from data.*, so no cleaning option is dropped."""
    shared = {f.name: getattr(cfg.data, f.name) for f in dataclasses.fields(CorpusOptions)}
    return PrepareConfig(
        src_lang=cfg.data.pair()[0],
        tgt_lang=cfg.data.pair()[1],
        vocab_size=cfg.data.sp_vocab_size(),
        seed=cfg.train.seed,
        **shared,
    )


BT_ENGINES = ("auto", "raymt", "ctranslate2")
BT_FORMATS = ("parquet", "text")


@dataclass
class BacktranslateConfig:
    """`python -m raymt.backtranslate`: sharding, batching, engine and noise of a back-translation
    job (decoding itself is DecodeOptions)."""

    # Input line ids [k * shard_lines, (k + 1) * shard_lines) are output shard k: the unit of restart.
    shard_lines: int = 10_000
    # Padded source tokens per decoding batch (sentences sorted by length inside each shard).
    max_tokens: int = 4096
    engine: str = "auto"  # auto: ctranslate2 when installed (exported once per node), else raymt
    # CTranslate2 weights at run time; auto: int8 on CPU, float16 on GPU.
    compute_type: str = "auto"
    # Noised beam output (Edunov et al. 2018): drop each word with p_delete, replace it by
    # `filler` with p_replace, and move words at most `swap` positions (0 turns that part off).
    noise: bool = False
    noise_delete: float = 0.1
    noise_replace: float = 0.1
    noise_swap: int = 3
    noise_filler: str = "<blank>"
    # Seed of sampling and noise: a redone shard draws what it drew before.
    seed: int = 1
    progress_s: float = 10.0  # seconds between progress lines

    def __post_init__(self) -> None:
        for name in ("shard_lines", "max_tokens", "progress_s"):
            value = getattr(self, name)
            check(value > 0, f"--{name.replace('_', '-')} {value} must be > 0")
        check(self.engine in BT_ENGINES, f"--engine {self.engine!r}: one of {', '.join(BT_ENGINES)}")
        for name in ("noise_delete", "noise_replace"):
            p = getattr(self, name)
            check(0 <= p < 1, f"--{name.replace('_', '-')} {p} must be in [0, 1)")
        check(self.noise_swap >= 0, f"--noise-swap {self.noise_swap} must be >= 0 (0 = no swaps)")
        check(bool(self.noise_filler.strip()), "--noise-filler must not be blank")


@dataclass
class ScoreConfig:
    """`raymt data score`: sharding and batching of a corpus's dual cross-entropy scoring job."""

    # Corpus line ids [k * shard_lines, (k + 1) * shard_lines) are score shard k: the unit of restart.
    shard_lines: int = 10_000
    # Padded tokens per scoring batch (the longer of source and target; pairs sorted by length in a shard).
    max_tokens: int = 4096
    progress_s: float = 10.0  # seconds between progress lines

    def __post_init__(self) -> None:
        for name in ("shard_lines", "max_tokens", "progress_s"):
            value = getattr(self, name)
            check(value > 0, f"--{name.replace('_', '-')} {value} must be > 0")
