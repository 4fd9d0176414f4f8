"""The options of the commands beside training: `raymt data prepare` (PrepareConfig, and the
one a run that prepares its own corpus derives), `raymt data score` (ScoreConfig) and
`raymt backtranslate` (BacktranslateConfig), the last two with the flags of a shard job
(ShardJobOptions: sharding, actors, progress)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

from raymt.command import flag, group
from raymt.config.sections import Config, CorpusOptions, DecodeOptions, positive
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
# Decoding or scoring actors on CPU when --num-actors is not given (with --gpu: one per GPU of the cluster).
CPU_ACTORS = 2


@dataclass
class ShardJobOptions:
    """A shard job's sharding, batching, actors and progress (raymt.shard_job): the flags that
    `raymt backtranslate` and `raymt data score` share, each command wording some of them
    (`group(words=)`: `shard_job_words`)."""

    HELP_WORDS: ClassVar[dict[str, str]] = {
        "lines": "input lines per output shard",
        "tokens": "padded tokens per batch",
        "actors": "actors",
    }

    # Input line ids [k * shard_lines, (k + 1) * shard_lines) are output shard k: the unit of restart.
    shard_lines: int = flag(10_000, "{lines}")
    # Padded tokens per batch (sentences sorted by length inside each shard).
    max_tokens: int = flag(4096, "{tokens}")
    num_actors: Optional[int] = flag(None, "{actors}; default %d, with --gpu one per GPU" % CPU_ACTORS)
    gpu: bool = flag(False, "one GPU per actor")
    cpus_per_actor: Optional[float] = flag(None, "CPUs per actor (default: the cluster's, split)")
    num_cpus: Optional[int] = flag(None, "CPUs of a local Ray instance (not with RAY_ADDRESS)")
    progress_s: float = flag(10.0, "seconds between progress lines")
    verbose: bool = flag(False, "also print Ray's own INFO lines")

    def __post_init__(self) -> None:
        for name in ("shard_lines", "max_tokens", "progress_s"):
            value = getattr(self, name)
            check(value > 0, f"--{name.replace('_', '-')} {value} must be > 0")
        check(self.num_actors is None or self.num_actors >= 1, f"--num-actors {self.num_actors} must be >= 1")
        check(
            self.cpus_per_actor is None or self.cpus_per_actor > 0,
            f"--cpus-per-actor {self.cpus_per_actor} must be > 0",
        )


def shard_job_words(work: str, lines: str, tokens: str) -> dict[str, str]:
    """A command's words in the shard job's flags' help: its actors' `work`, what a shard holds, what a batch counts."""
    return {"actors": f"{work} actors", "lines": lines, "tokens": tokens}


@dataclass(kw_only=True)
class BacktranslateConfig:
    """`raymt backtranslate`: the model, input and output, decoding (DecodeOptions, its --seed this
    config's), engine and noise of a back-translation job, and its sharding and actors."""

    checkpoint: tuple[str, ...] = flag(
        help="raymt checkpoint, or a `raymt export --format ctranslate2` directory; repeated: an ensemble of "
        "raymt checkpoints that share a tokenizer (raymt's engine)",
        repeat=True,
        required=True,
    )
    input: str = flag(
        help="text (plain, .gz/.xz/.zst/.bz2), .tsv, .jsonl or .parquet: a file, a glob, a directory or a URI",
        metavar="SPEC",
        required=True,
    )
    output: str = flag(help="shards, bt.json (and text) go here", metavar="DIR|URI", required=True)
    format: str = flag("parquet", "text: also aligned text.<lang> files", choices=BT_FORMATS)
    column: Optional[str] = flag(
        None, "TSV: 0-based column (default 0); JSONL/Parquet: key (default the source language)"
    )
    src_lang: Optional[str] = flag(None, "the input's language: checked against the model's source")
    tgt_lang: Optional[str] = flag(None, "the output's language: checked (tagged models: picks the tag)")
    # --sample: sampled outputs (Edunov et al. 2018), seeded by --seed below.
    decode: DecodeOptions = group(DecodeOptions, skip=("seed",))
    # Noised beam output (Edunov et al. 2018): drop each word with p_delete, replace it by
    # `filler` with p_replace, and move words at most `swap` positions (0 turns that part off).
    noise: bool = flag(False, "noised beam output: delete, replace, swap words")
    noise_delete: float = flag(0.1, "drop probability of a word")
    noise_replace: float = flag(0.1, "probability of the filler")
    noise_swap: int = flag(3, "words move at most this far")
    noise_filler: str = flag("<blank>", "the word that replaces words")
    # Seed of sampling and noise: a redone shard draws what it drew before.
    seed: int = flag(1, "seed of sampling and noise (per line id)")
    engine: str = flag("auto", choices=BT_ENGINES)  # auto: ctranslate2 when installed, else raymt
    # CTranslate2 weights at run time; auto: int8 on CPU, float16 on GPU.
    compute_type: str = flag("auto", "CTranslate2: auto = int8 on CPU, float16 on GPU")
    shards: ShardJobOptions = group(
        ShardJobOptions,
        words=shard_job_words("decoding", "input lines per output shard", "padded source tokens per batch"),
    )

    def __post_init__(self) -> None:
        check(len(self.checkpoint) > 0, "--checkpoint: give at least one checkpoint")
        check(self.format in BT_FORMATS, f"--format {self.format!r}: one of {', '.join(BT_FORMATS)}")
        check(self.engine in BT_ENGINES, f"--engine {self.engine!r}: one of {', '.join(BT_ENGINES)}")
        check(
            not (self.decode.sample and self.noise), "--sample and --noise are two ways of back-translating: pick one"
        )
        for name in ("noise_delete", "noise_replace"):
            p = getattr(self, name)
            check(0 <= p < 1, f"--{name.replace('_', '-')} {p} must be in [0, 1)")
        check(self.noise_swap >= 0, f"--noise-swap {self.noise_swap} must be >= 0 (0 = no swaps)")
        check(bool(self.noise_filler.strip()), "--noise-filler must not be blank")

    def decode_options(self) -> DecodeOptions:
        """The decoding options of the job: sampling seeded by --seed (each batch's seed drawn from it)."""
        return dataclasses.replace(self.decode, seed=self.seed if self.decode.sample else None)


@dataclass(kw_only=True)
class ScoreConfig:
    """`raymt data score`: the two models, the corpus (and its validation set) and the output of a
    dual cross-entropy scoring job, and its sharding and actors."""

    # Without a forward model a pair's score is exp(-H_backward(src|tgt)): the cross-entropy filter
    # of distilled pairs (mozilla/translations scores a teacher's translations with a backward model).
    forward: Optional[str] = flag(
        None, "a raymt checkpoint translating src->tgt (none: score by the backward model alone)", metavar="CKPT"
    )
    backward: str = flag(help="a raymt checkpoint translating tgt->src", metavar="CKPT", required=True)
    corpus: str = flag(help="PREFIX (PREFIX.<src>, PREFIX.<tgt>) or a file", metavar="SPEC", required=True)
    # The validation set scored by the same models into OUTPUT/valid (a score directory of its
    # own): what prepare's calibrate_valid sets its threshold from.
    valid: Optional[str] = flag(
        None, "also score this validation set into OUTPUT/valid (for prepare's --calibrate-valid)", metavar="SPEC"
    )
    output: Optional[str] = flag(None, "the scores' directory (default SPEC.scores, beside it)", metavar="DIR|URI")
    src_lang: Optional[str] = flag(
        None, "the corpus's source language (default: the models')", name="--src", metavar="SRC_LANG"
    )
    tgt_lang: Optional[str] = flag(
        None, "the corpus's target language (default: the models')", name="--tgt", metavar="TGT_LANG"
    )
    src_col: Optional[str] = flag(None, "TSV column number, or JSONL key / Parquet column (default: --src)")
    tgt_col: Optional[str] = flag(None, "TSV column number, or JSONL key / Parquet column (default: --tgt)")
    # Padded tokens per batch: the longer of source and target (pairs sorted by length in a shard).
    shards: ShardJobOptions = group(
        ShardJobOptions, words=shard_job_words("scoring", "corpus lines per score shard", "padded tokens per batch")
    )
