"""The sections of a training run's `Config` (model, data, optim, train, decode): every default,
validated in `__post_init__`, the fields older configs named otherwise, and the checks across
sections (`check_training`)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from raymt.command import flag
from raymt.config.corpus import CorpusSpec, check_corpora, corpora_from_tables, read_one_pair
from raymt.errors import check
from raymt.tags import TAG_SIDES

ACTIVATIONS = ("relu", "gelu", "swish")
# model.positions: raymt's sinusoids (Vaswani et al.), or fairseq's (M2M-100, NLLB; see raymt.model).
POSITIONS = ("sinusoidal", "fairseq")
SP_MODEL_TYPES = ("unigram", "bpe")
# Widths in the batch shape ladder of GPU and compiled runs (data.shape_buckets): on WMT-like
# lengths (max_len 200, 32k-token batches, widths 8..208) 11 rungs, each one (B, S, T).
GPU_SHAPE_BUCKETS = 12


def positive(obj: Any, section: str, *names: str) -> None:
    """Check that each named numeric field of `obj` is > 0."""
    for name in names:
        value = getattr(obj, name)
        check(value > 0, f"{section}.{name}={value!r} must be > 0")


@dataclass
class ModelConfig:
    """Encoder-decoder Transformer shape (Vaswani et al. 2017); defaults are the `mini` preset."""

    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 512
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation: str = "relu"
    pre_norm: bool = True
    # Sinusoidal positions need no table, but decoding stops at this length.
    max_positions: int = 1024
    # What imported models (raymt.hf_import) need; the defaults are raymt's own models.
    # Embeddings times sqrt(d_model) before positions are added.
    scale_embedding: bool = True
    positions: str = "sinusoidal"
    # A fixed (untrained) bias on the output logits: OPUS-MT's final_logits_bias.
    output_bias: bool = False
    # The output projection is the embedding (tied); false: a separate (V, D) matrix.
    tie_output: bool = True
    # The decoder's own embedding (and output) of this many rows, apart from the encoder's: an
    # imported OPUS-MT with separate vocabularies (the tokenizer's target ids). None: one embedding.
    target_vocab_size: Optional[int] = None

    def __post_init__(self) -> None:
        positive(
            self, "model", "d_model", "num_heads", "d_ff", "num_encoder_layers", "num_decoder_layers", "max_positions"
        )
        check(
            self.d_model % self.num_heads == 0,
            f"model.d_model={self.d_model} must be divisible by model.num_heads={self.num_heads}",
        )
        check(self.d_model % 2 == 0, f"model.d_model={self.d_model} must be even (sinusoidal positions)")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"model.{name}={value!r} must be in [0, 1)")
        check(
            self.activation in ACTIVATIONS,
            f"model.activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}",
        )
        check(
            self.positions in POSITIONS,
            f"model.positions={self.positions!r} must be one of {', '.join(POSITIONS)}",
        )
        if self.target_vocab_size is not None:
            check(
                self.target_vocab_size > 0 and self.target_vocab_size % 8 == 0,
                f"model.target_vocab_size={self.target_vocab_size!r} must be a positive multiple of 8 (or unset)",
            )


@dataclass
class CorpusOptions:
    """How training pairs are tokenized and cleaned when a corpus is prepared: the same fields
    for `python -m raymt.data prepare` (PrepareConfig, each field a flag of it) and for a run that
    prepares its own corpus from --train files or the built-in corpus (DataConfig, as data.*)."""

    sp_model_type: str = flag("unigram", "sp_model_type (default %(default)s)")
    # Sentence pairs sampled to train SentencePiece: bounded, never the whole corpus.
    sp_sample_size: int = flag(200_000, "sp_sample_size (default %(default)s)")
    # Pairs with more tokens than this on either side are dropped.
    max_len: int = flag(200, "max_len (default %(default)s)")
    # Pairs longer than this in characters are dropped before tokenizing (cheap guard).
    max_chars: int = flag(2000, "max_chars (default %(default)s)")
    # Pairs whose token-length ratio exceeds max_ratio are dropped (misalignments) ...
    max_ratio: float = flag(3.0, "max_ratio (default %(default)s)")
    # ... when the longer side has at least this many tokens (short pairs vary a lot).
    ratio_min_len: int = flag(3, "ratio_min_len (default %(default)s)")
    # Drop exact duplicate (src, tgt) pairs, keeping the first in input order.
    dedup: bool = flag(False, "sets dedup")
    # ... and near-duplicates: pairs equal after lower-casing, dropping punctuation and writing
    # every number as 0 (counted as near_duplicate; the first in input order is kept, or with
    # min_score/keep_best the highest-scored pair that passes the other rules).
    near_dedup: bool = flag(False, "sets near_dedup")
    # The content rules (docs/data.md, "Cleaning rules"), each counted under its name; off for
    # the generated built-in corpus, and a corpus may set them for itself (CorpusSpec.clean).
    # copy: the target is (nearly) the source: word sets and characters in order alike >= copy_similarity.
    copy: bool = flag(True, "unsets copy", name="--no-copy")
    copy_similarity: float = flag(0.8, "copy_similarity (default %(default)s)")
    # number_mismatch: both sides have numbers, and not the same (4.50 = 4,50; digits vs words pass).
    number_mismatch: bool = flag(True, "unsets number_mismatch", name="--no-number-mismatch")
    # url_mismatch: the sides' URLs and e-mail addresses differ.
    url_mismatch: bool = flag(True, "unsets url_mismatch", name="--no-url-mismatch")
    # alpha_ratio: letters are under alpha_ratio_min of a side's non-space characters.
    alpha_ratio: bool = flag(True, "unsets alpha_ratio", name="--no-alpha-ratio")
    alpha_ratio_min: float = flag(0.5, "alpha_ratio_min (default %(default)s)")
    # repeats: a word or word n-gram (n <= 3) more than repeats_max times in a row.
    repeats: bool = flag(True, "unsets repeats", name="--no-repeats")
    repeats_max: int = flag(3, "repeats_max (default %(default)s)")
    # wrong_language: language ID (raymt.langid) is at least wrong_language_confidence sure that a
    # side is not in the language the corpus names (it gives that language a probability under
    # 1 - confidence); sides under wrong_language_min_chars characters are not judged (a name or a
    # number reads as any language). Off by default: it also judges text in no language (codes,
    # made-up test sentences), and a corpus in a language lid.176 does not know would need it off.
    wrong_language: bool = flag(False, "sets wrong_language")
    wrong_language_confidence: float = flag(0.8, "wrong_language_confidence (default %(default)s)")
    wrong_language_min_chars: int = flag(5, "wrong_language_min_chars (default %(default)s)")
    # score: the dual conditional cross-entropy filter (docs/data.md, "Scoring pairs"): a pair is
    # dropped when its `raymt data score` score (exp(-dcce), in (0, 1], higher is better) is under
    # min_score, or when it is not among the best keep_best fraction of its corpus's scored pairs,
    # or when it scores under the calibrate_valid quantile of the validation pairs' scores (the
    # same scorers' scores of the corpus's validation set, `raymt data score --valid`: a threshold
    # without labels that drops about that share of pairs as clean as the validation set);
    # the scores are read from `scores` (a directory of `raymt data score`; None: SPEC.scores
    # beside each training input). Off (None) by default; one of the three at most.
    min_score: Optional[float] = flag(None, "min_score (default %(default)s)")
    keep_best: Optional[float] = flag(None, "keep_best (default %(default)s)")
    calibrate_valid: Optional[float] = flag(None, "calibrate_valid (default %(default)s)", metavar="Q")
    scores: Optional[str] = flag(None, "scores (default %(default)s)")
    # Drop and count lines that are not valid UTF-8 instead of failing.
    skip_invalid: bool = flag(False, "sets skip_invalid")
    # Several corpora are mixed with p_i ~ (weight_i * n_i)^(1/temperature) (raymt.data.mixing),
    # and the SentencePiece sample is balanced the same way: 1 = proportional to size (as
    # repeated --train files are concatenated), 5 as in M2M-100/XLM-R (small corpora up).
    temperature: float = flag(1.0, "temperature (default %(default)s)")
    # A reserved <BT> piece before every back-translated source (Caswell et al. 2019).
    bt_tag: bool = flag(True, "unsets bt_tag", name="--no-bt-tag")
    # Tokenize with this tokenizer instead of training a SentencePiece model: a checkpoint or
    # export directory (its spm.model), or a SentencePiece .model file. A student keeps its
    # teacher's vocabulary (`raymt distill`), as fairseq's --srcdict; None: train one.
    tokenizer: Optional[str] = flag(None, "tokenizer (default %(default)s)")

    def check_corpus_options(self, section: str) -> None:
        """Validate the shared fields; messages name them as `section.field`."""
        positive(self, section, "sp_sample_size", "max_len", "max_chars")
        check(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0,
            f"{section}.temperature={self.temperature!r} must be a number > 0 (1 = proportional, 5 flatter)",
        )
        check(
            self.sp_model_type in SP_MODEL_TYPES,
            f"{section}.sp_model_type={self.sp_model_type!r} must be one of {', '.join(SP_MODEL_TYPES)}",
        )
        check(self.max_ratio >= 1.0, f"{section}.max_ratio={self.max_ratio!r} must be >= 1")
        check(self.ratio_min_len >= 1, f"{section}.ratio_min_len={self.ratio_min_len} must be >= 1")
        for name in ("copy_similarity", "alpha_ratio_min", "wrong_language_confidence"):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and 0 < value <= 1,
                f"{section}.{name}={value!r} must be a number in (0, 1]",
            )
        check(self.repeats_max >= 1, f"{section}.repeats_max={self.repeats_max} must be >= 1")
        check(
            self.wrong_language_min_chars >= 1,
            f"{section}.wrong_language_min_chars={self.wrong_language_min_chars} must be >= 1",
        )
        for name in ("min_score", "keep_best"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, (int, float)) and 0 < value <= 1),
                f"{section}.{name}={value!r} must be a number in (0, 1]",
            )
        q = self.calibrate_valid
        check(
            q is None or (isinstance(q, (int, float)) and 0 < q < 1),
            f"{section}.calibrate_valid={q!r} must be a number in (0, 1): the share of validation pairs under "
            "the threshold (0.05: the score that 5% of them fall under)",
        )
        given = [name for name in ("min_score", "keep_best", "calibrate_valid") if getattr(self, name) is not None]
        check(
            len(given) <= 1,
            " and ".join(f"{section}.{name}" for name in given) + " are ways of filtering by score: set one",
        )
        check(
            self.scores is None or bool(given),
            f"{section}.scores={self.scores!r} filters nothing without min_score, keep_best or calibrate_valid",
        )


@dataclass
class DataConfig(CorpusOptions):
    """Corpus, tokenizer and batching (the cleaning fields of CorpusOptions apply when the run
    prepares its own corpus; a prepared --corpus keeps the options it was made with)."""

    # The corpora a run trains on, each with its languages, files, origin ("real" or "bt"),
    # weight and its pair's valid/test sets ([[data.corpora]] tables, or the --train/--valid/
    # --test/--bt/--pairs/--src-lang/--tgt-lang flags); one pair is a list of one. A corpus
    # without files is the built-in corpus of its pair, generated offline: the default run's en-de.
    corpora: list[CorpusSpec] = field(default_factory=lambda: [CorpusSpec("en", "de")])
    # A corpus made by `python -m raymt.data prepare` (local path or URI): its shards, tokenizer,
    # validation and test sets. data.corpora then names its pairs, without files (the run reads
    # them from its manifest); a one-pair corpus's valid/test there replace its own sets.
    corpus: Optional[str] = None
    builtin_train_size: int = 24000
    builtin_eval_size: int = 300
    # Joint SentencePiece vocabulary; None: 8000 for corpus files, 1000 for the built-in corpus.
    vocab_size: Optional[int] = None
    # Per worker and micro-batch: rows * longest row (padding included) stays under this.
    max_tokens: int = 2048
    # Rows per length-sorted window from which token-budget batches are cut: the more rows,
    # the more alike the lengths in a batch (less padding), the less random its composition.
    window_rows: int = 16384
    # Training batches' widths (src and tgt) are padded up to a multiple of this, and the
    # token budget counts the padded width: an epoch then has few distinct batch shapes
    # (kernels and torch.compile see a small ladder). 1: no rounding, the CPU default (on
    # short sentences a ladder of 8 pads ~16% more); GPU and compiled runs get 8
    # (`device_defaults`).
    pad_multiple: int = 1
    # Training batch shapes from a ladder of this many widths (multiples of pad_multiple,
    # geometric up to max_len + 1), each with a fixed row count max_tokens // width: src and
    # tgt pad to the batch's rung and short batches get all-PAD rows (no loss), so an epoch
    # has at most this many (B, S, T) shapes, the zero-weight dummy batch included
    # (batching.ShapeLadder). 0: widths and rows are free, the CPU default (fewer padded
    # tokens); GPU and compiled runs get GPU_SHAPE_BUCKETS (`device_defaults`).
    shape_buckets: int = 0
    shuffle_buffer_rows: int = 16384
    # Each epoch reads every shard in blocks of this many rows, in an order drawn from (seed,
    # epoch), so that the chunks of data.shuffle_buffer_rows pairs batches are cut from hold other
    # pairs every epoch (a corpus of one shard too); 1024 is the token index's block. 0: every
    # shard whole, in order (runs and checkpoints written before this field read so).
    shuffle_block_rows: int = 1024
    eval_batch_size: int = 64
    # Where a tagged (multilingual) model reads its target-language tag: "src", before the
    # source (Johnson et al. 2017), or "tgt", the decoder's first token after BOS (fairseq's
    # --decoder-langtok, M2M-100/NLLB; CTranslate2's target_prefix): the same prepared corpus,
    # the tag moved at collation (raymt.batching.tag_to_decoder), recorded in checkpoints.
    tag_side: str = "src"

    def widest(self) -> int:
        """The widest batch: a pair of data.max_len with its EOS (or BOS), padded to data.pad_multiple."""
        return -(-(self.max_len + 1) // self.pad_multiple) * self.pad_multiple

    def min_max_tokens(self) -> int:
        """The smallest data.max_tokens that holds one pair of data.max_len (never below max_len + 2)."""
        return max(self.max_len + 2, self.widest())

    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) pairs of data.corpora, each once, in order."""
        return list(dict.fromkeys((c.src_lang, c.tgt_lang) for c in self.corpora))

    def pair(self) -> tuple[str, str]:
        """(source, target) of the first corpus: the one direction of a one-pair (untagged) model."""
        return self.pairs()[0]

    def __post_init__(self) -> None:
        self.check_corpus_options("data")
        positive(
            self,
            "data",
            "builtin_train_size",
            "builtin_eval_size",
            "max_tokens",
            "window_rows",
            "eval_batch_size",
            "pad_multiple",
        )
        if self.vocab_size is not None:
            positive(self, "data", "vocab_size")
            check(
                self.vocab_size % 8 == 0,
                f"data.vocab_size={self.vocab_size} must be a multiple of 8 (e.g. {(self.vocab_size + 7) // 8 * 8})",
            )
        check(
            self.max_tokens >= self.min_max_tokens(),
            f"data.max_tokens={self.max_tokens} must be at least {self.min_max_tokens()} so that every kept "
            f"sentence fits in a batch (data.max_len + 2, and its padded width at data.pad_multiple)",
        )
        check(
            self.shape_buckets == 0 or self.shape_buckets >= 2,
            f"data.shape_buckets={self.shape_buckets} must be 0 (free shapes) or at least 2 "
            f"(a ladder from data.pad_multiple to data.max_len + 1; GPU runs get {GPU_SHAPE_BUCKETS})",
        )
        check(self.shuffle_buffer_rows >= 0, f"data.shuffle_buffer_rows={self.shuffle_buffer_rows} must be >= 0")
        check(
            self.tag_side in TAG_SIDES,
            f"data.tag_side={self.tag_side!r} must be src (the tag before the source) or tgt (first in the decoder)",
        )
        check(
            self.shuffle_block_rows >= 0,
            f"data.shuffle_block_rows={self.shuffle_block_rows} must be >= 0 (0: shards read whole, in order)",
        )
        self._check_corpora()

    def _check_corpora(self) -> None:
        """data.corpora: tables become CorpusSpecs, checked together (raymt.config.corpus); beside a
        prepared data.corpus they name its pairs only (no files, any language)."""
        check(
            isinstance(self.corpora, list),
            f"data.corpora={self.corpora!r} must be a list of tables ([[data.corpora]] in TOML)",
        )
        prepared = self.corpus is not None
        if all(isinstance(c, CorpusSpec) for c in self.corpora):
            check_corpora(self.corpora, builtin=not prepared)
        else:  # tables of a config file or config.json, checked as they are read
            given = [dataclasses.asdict(c) if isinstance(c, CorpusSpec) else c for c in self.corpora]
            self.corpora = corpora_from_tables(given, builtin=not prepared)
        check(
            not prepared or not any(c.train for c in self.corpora),
            "data.corpus and data.train are both set: train either on a prepared corpus "
            "(--corpus) or on text files (--train)",
        )

    def sp_vocab_size(self) -> int:
        """The SentencePiece vocabulary size to train."""
        if self.vocab_size is not None:
            return self.vocab_size
        return 1000 if all(c.builtin for c in self.corpora) else 8000


@dataclass
class OptimConfig:
    """Adam with inverse-square-root warmup, label smoothing, clipping, accumulation."""

    # Peak lr and a short warmup for the default run (mini model, built-in corpus, 400 steps):
    # it ends above 90 test BLEU (92.48 measured) at 0.47 of the cost of a 900-step run at 2e-3 with
    # 300 warmup steps. Paper-size models want ~7e-4 and 4000 steps.
    lr: float = 3e-3
    warmup_steps: int = 100
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    # Micro-batches accumulated per update (no_sync on all but the last).
    update_freq: int = 1

    def __post_init__(self) -> None:
        positive(self, "optim", "lr", "warmup_steps", "eps", "update_freq")
        for name in ("beta1", "beta2", "label_smoothing"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"optim.{name}={value!r} must be in [0, 1)")
        check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay!r} must be >= 0")
        check(self.clip_norm >= 0, f"optim.clip_norm={self.clip_norm!r} must be >= 0 (0 = off)")


PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # train.precision's values (raymt.precision)


@dataclass
class TrainConfig:
    """Run length, evaluation, scaling and storage."""

    # The quick start's length: short enough for a weak 2-core machine (see optim.lr).
    max_steps: int = 400
    epochs: Optional[int] = None
    # Wall-clock budget for the training loop (checked every log_every steps).
    max_minutes: Optional[float] = None
    # Validation (greedy decoding of the whole valid set) also runs after the last step.
    eval_every: int = 400
    log_every: int = 50
    num_workers: int = 2
    # Elastic training: start with as few as min_workers when the cluster has no room for
    # num_workers, go on with fewer after a node is lost (needs max_failures), and grow
    # back to num_workers as nodes return. optim.update_freq is raised on a smaller group to
    # keep num_workers' global batch; an epoch in progress is shared out anew (every pair
    # still once). None: a fixed group of num_workers.
    min_workers: Optional[int] = None
    # How often (seconds) an elastic run looks for room to grow; each resize restarts the
    # group from the latest checkpoint.
    resize_interval_s: float = 60.0
    use_gpu: bool = False
    # CPUs reserved per worker; None = the cluster's CPUs but one (raymt.cluster.plan), split evenly.
    cpus_per_worker: Optional[float] = None
    # Low precision allowed (raymt.precision): bf16 autocast on GPUs with bf16 units, fp16
    # with dynamic loss scaling on older GPUs (V100, T4), bf16 on CPUs with bf16 units
    # (AVX512-BF16, AMX) where a short timed probe finds it faster for the model; else fp32.
    # false: fp32 everywhere (whatever train.precision says).
    bf16: bool = True
    # "auto": the precision a resumed checkpoint recorded, else raymt.precision's choice above;
    # "fp32", "bf16" or "fp16" (with loss scaling) pin it. Checkpoints record the choice here.
    precision: str = "auto"
    # TF32 tensor cores for fp32 matmuls and convolutions on GPUs of compute capability >= 8.0.
    tf32: bool = True
    seed: int = 1
    # Run directories and checkpoints: a local path, or s3://, gs://, ... shared by all nodes.
    storage_path: str = field(default_factory=lambda: os.environ.get("RAYMT_STORAGE_PATH", "runs"))
    name: Optional[str] = None
    # Checkpoints kept: the best by validation BLEU plus the latest (enough to average).
    num_to_keep: int = 5
    # Updates with a non-finite loss or gradient are skipped; more than this many in a row stop the run.
    max_nonfinite_steps: int = 10
    max_failures: int = 0
    # Log a digest of every training pair per step to logs/trace-rank<r>.tsv (tests, debugging).
    trace_data: bool = False
    # DDP gradient bucket size in MB (torch's default 25): all-reduce starts per full bucket.
    ddp_bucket_mb: float = 25.0
    # All-reduce gradients in bf16 (half the bytes) when several workers train: for multi-node
    # runs whose network is the bottleneck. NCCL (GPU) only; gradients lose precision.
    grad_compression: bool = False
    # torch.profiler over this many steps after the first log interval, on every rank:
    # logs/profile-rank<r>.txt (time per step part, top operators) and .json (Chrome trace).
    profile_steps: int = 0
    # torch.compile the model (after DDP wraps it). Shapes that change between batches make
    # one dynamic-shape graph after the first recompile, not one graph per batch.
    compile: bool = False
    # Beam of the validation BLEU during training (1 = greedy); the test set's is decode.beam.
    valid_beam: int = 1
    # Early stopping: the run ends after this many evaluations in a row without a validation BLEU
    # (valid_bleu, the pairs' mean) above its best so far (fine-tuning: a few); None: it trains
    # until max_steps, epochs or max_minutes. Checkpoints keep the count: a restart goes on with it.
    patience: Optional[int] = None
    # On a cluster that autoscales (cluster.yaml's GPU nodes start at min_workers: 0), how long
    # the driver waits for the autoscaler to bring up the workers' GPUs or CPUs before it gives
    # up with one line (raymt.autoscale.grow); a fixed cluster fails at once. 0: never wait.
    autoscale_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        positive(self, "train", "max_steps", "eval_every", "log_every", "num_workers", "num_to_keep", "valid_beam")
        if self.epochs is not None:
            positive(self, "train", "epochs")
        for name in ("cpus_per_worker", "max_minutes", "patience"):
            if getattr(self, name) is not None:
                positive(self, "train", name)
        check(self.max_nonfinite_steps >= 0, f"train.max_nonfinite_steps={self.max_nonfinite_steps} must be >= 0")
        if self.min_workers is not None:
            check(
                1 <= self.min_workers <= self.num_workers,
                f"train.min_workers={self.min_workers} must be between 1 and train.num_workers="
                f"{self.num_workers} (or unset for a fixed group)",
            )
        check(self.resize_interval_s >= 0, f"train.resize_interval_s={self.resize_interval_s} must be >= 0")
        check(self.max_failures >= -1, f"train.max_failures={self.max_failures} must be >= -1")
        check(self.ddp_bucket_mb > 0, f"train.ddp_bucket_mb={self.ddp_bucket_mb} must be > 0")
        check(self.profile_steps >= 0, f"train.profile_steps={self.profile_steps} must be >= 0 (0 = off)")
        check(
            self.precision in PRECISIONS,
            f"train.precision={self.precision!r} must be one of {', '.join(map(repr, PRECISIONS))}",
        )
        check(
            self.autoscale_timeout_s >= 0,
            f"train.autoscale_timeout_s={self.autoscale_timeout_s} must be >= 0 (0 = never wait)",
        )


@dataclass
class DecodeOptions:
    """How to search, the one home of decoding defaults: beam 1 is greedy; output length is at
    most a * src_len + b. `Config.decode` (test set, translate, evaluate, export)."""

    beam: int = flag(5, "beam size (1 = greedy)")
    # GNMT length penalty alpha: scores are divided by ((5 + length) / 6) ** alpha.
    length_penalty: float = flag(0.6, "GNMT alpha")
    max_len_a: float = flag(1.2, "max output = a * src_len + b")
    max_len_b: int = flag(10, "")
    use_cache: bool = True
    # Sampling (beam 1 only) draws each token from softmax(log_probs / temperature) over
    # the top_k most likely tokens (0: all). Draws depend on the seed and on the batch.
    sample: bool = flag(False, "sample instead of searching (implies --beam 1)")
    temperature: float = flag(1.0, "sampling temperature")
    top_k: int = flag(0, "sample among the K most likely tokens (0 = all)")
    seed: Optional[int] = flag(None, "seed for --sample (repeatable output)")

    def __post_init__(self) -> None:
        check(self.beam >= 1, f"beam={self.beam} must be >= 1 (1 = greedy)")
        check(self.length_penalty >= 0, f"length_penalty={self.length_penalty} must be >= 0")
        check(self.max_len_a >= 0, f"max_len_a={self.max_len_a} must be >= 0")
        check(
            not self.sample or self.beam == 1,
            f"sampling draws one hypothesis per sentence: use beam 1, not {self.beam}",
        )
        check(self.temperature > 0, f"temperature={self.temperature} must be > 0")
        check(self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 = the whole vocabulary)")

    def check(self) -> None:
        """Validate again (after fields were assigned one by one); raises a one-line ValueError."""
        self.__post_init__()

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The decoding flags' values (raymt.command): --sample implies beam 1."""
        return {**values, "beam": 1} if values.get("sample") else values


@dataclass
class Config:
    """Everything one training run needs; crosses to Ray workers as a plain dict."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeOptions = field(default_factory=DecodeOptions)

    def to_dict(self) -> dict:
        """Plain nested dict (JSON-serializable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """Build from a nested dict, rejecting unknown fields (older configs' names are mapped)."""
        d = _renamed(d)
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(d) - set(sections)
        check(not unknown, f"unknown config section(s) {sorted(unknown)}; known: {', '.join(sections)}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for name, value in d.items():
            section_cls = hints[name]
            known = {f.name for f in dataclasses.fields(section_cls)}
            bad = set(value) - known
            check(
                not bad,
                f"unknown field(s) {', '.join(f'{name}.{b}' for b in sorted(bad))}; known: {', '.join(sorted(known))}",
            )
            kwargs[name] = section_cls(**value)
        return cls(**kwargs)


# Fields that moved: (old section, old name) -> (new section, new name). Configs and
# checkpoints written before the move still load.
RENAMED = {
    ("train", "test_beam"): ("decode", "beam"),
    ("train", "length_penalty"): ("decode", "length_penalty"),
    ("train", "max_len_a"): ("decode", "max_len_a"),
    ("train", "max_len_b"): ("decode", "max_len_b"),
}
# Fields added since: the value a run config or checkpoint written without them meant.
ADDED = {("data", "shuffle_block_rows"): 0}  # shards read whole, in order


def _renamed(d: dict) -> dict:
    """A copy of the nested config dict `d` with moved fields under their new names, fields added
    since at what their absence meant (`ADDED`), and older configs' one-pair fields
    (data.src_lang/tgt_lang/train/valid/test) read into data.corpora."""
    out = {section: dict(value) if isinstance(value, dict) else value for section, value in d.items()}
    for (section, name), (new_section, new_name) in RENAMED.items():
        if isinstance(out.get(section), dict) and name in out[section]:
            value = out[section].pop(name)
            out.setdefault(new_section, {}).setdefault(new_name, value)
    for (section, name), value in ADDED.items():
        if isinstance(out.get(section), dict):
            out[section].setdefault(name, value)
    if isinstance(out.get("data"), dict):
        out["data"] = read_one_pair(out["data"], DataConfig().corpora)
    return out


def check_training(cfg: Config) -> None:
    """Checks across sections of a training run's config, once every override is in (a config
    file may leave a field to a flag: grad_compression to --gpu)."""
    width = cfg.data.widest() + int(cfg.data.tag_side == "tgt")  # BOS and the tag start the target
    check(
        width <= cfg.model.max_positions,
        f"data.max_len={cfg.data.max_len} makes batches {width} positions wide but model.max_positions="
        f"{cfg.model.max_positions}: raise model.max_positions to {width} or lower data.max_len",
    )
    check(
        not cfg.train.grad_compression or cfg.train.use_gpu,
        "train.grad_compression=true compresses the GPU workers' all-reduce (NCCL): add --gpu, or leave "
        "it false for CPU workers (gloo has no bf16 hook)",
    )
