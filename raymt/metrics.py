"""sacreBLEU scores with their signatures."""

from __future__ import annotations

import csv
import time
from importlib.metadata import version
from pathlib import Path
from typing import Mapping, Optional, Sequence

import sacrebleu

# Targets written without spaces between words: TER's asian_support splits their characters.
ASIAN_LANGS = ("zh", "ja", "ko")


def bleu_metric(lang: str = "", **kwargs) -> sacrebleu.metrics.BLEU:
    """sacreBLEU's BLEU for target language `lang`: 13a, or zh/ja/ko's own tokenizer (ja and ko:
    sacrebleu[ja]/[ko]; without them 'char', which the signature then names)."""
    try:
        return sacrebleu.metrics.BLEU(trg_lang=lang, **kwargs)
    except RuntimeError:  # ja-mecab / ko-mecab without their packages
        return sacrebleu.metrics.BLEU(tokenize="char", **kwargs)


def _metrics(extra: bool, lang: str) -> dict:
    """sacreBLEU metrics by name: BLEU and chrF; with `extra` TER and lowercased BLEU too."""
    metrics = {"bleu": bleu_metric(lang), "chrf": sacrebleu.metrics.CHRF()}
    if extra:
        metrics |= {
            "ter": sacrebleu.metrics.TER(asian_support=lang in ASIAN_LANGS),
            "bleu_lc": bleu_metric(lang, lowercase=True),
        }
    return metrics


def moses_tokenized(lines: list[str], lang: str) -> list[str]:
    """`lines` Moses-tokenized (sacremoses, the Perl tokenizer's port) and lowercased."""
    from sacremoses import MosesTokenizer  # only the test score needs it

    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(line, escape=False, return_str=True).lower() for line in lines]


def papers_bleu(hyps: list[str], refs: list[str], lang: str) -> tuple[float, str]:
    """(BLEU, signature) in the papers' form: multi-bleu.perl's BLEU (no smoothing) on
    Moses-tokenized, lowercased hypotheses and references, as Multi30k papers report it."""
    # multi-bleu and fairseq's scorer split on whitespace and do not smooth: sacreBLEU's
    # BLEU with tokenize="none" and smooth_method="none" is the same formula.
    bleu = sacrebleu.metrics.BLEU(tokenize="none", smooth_method="none", force=True)
    value = bleu.corpus_score(moses_tokenized(hyps, lang), [moses_tokenized(refs, lang)]).score
    return value, (
        f"nrefs:1|case:lc|tok:moses-{lang}|smooth:none|sacremoses:{version('sacremoses')}"
        f"|sacrebleu:{sacrebleu.__version__}"
    )


def score(hyps: list[str], refs: list[str], extra: bool = False, lang: str = "en") -> dict:
    """The one scorer: corpus scores on detokenized text, each with its sacreBLEU signature;
    BLEU tokenized for `lang`, the target language (`bleu_metric`).

    Keys: bleu, chrf, bleu_signature, chrf_signature; with `extra` also ter, bleu_lc
    (lowercased) and bleu_tok (`papers_bleu` with the Moses rules of `lang`) and their *_signature.
    """
    out: dict = {}
    for name, metric in _metrics(extra, lang).items():
        out[name] = metric.corpus_score(hyps, [refs]).score
        out[f"{name}_signature"] = str(metric.get_signature())
    if extra and papers_bleu_available():
        out[PAPERS_BLEU], out[f"{PAPERS_BLEU}_signature"] = papers_bleu(hyps, refs, lang)
    return out


def papers_bleu_available() -> bool:
    """Whether sacremoses imports: without it the test scores keep sacreBLEU, chrF and TER and
    leave out the papers' form, instead of losing them all after training."""
    try:
        import sacremoses  # noqa: F401
    except ImportError:
        return False
    return True


# The `score(..., extra=True)` key printed beside sacreBLEU: Moses-tokenized, lowercased BLEU.
PAPERS_BLEU = "bleu_tok"


def score_lines(
    name: str, scores: dict, checkpoint: str, beam: int, length_penalty: float, num_sentences: Optional[int] = None
) -> list[str]:
    """How a test score is printed (raymt.train and raymt.evaluate): the scores, the weights and
    decoding they come from, and every sacreBLEU signature.

    `scores` is `score(..., extra=True)`'s; its `bleu_tok` is papers' tokenized lowercased BLEU
    (Moses tokenizer, multi-bleu).
    """
    sentences = f", {num_sentences} sentences" if num_sentences is not None else ""
    ter = f", TER {scores['ter']:.2f}" if "ter" in scores else ""
    papers = (
        f"tokenized lowercased BLEU {scores[PAPERS_BLEU]:.2f} (Moses tokenizer, lowercase, multi-bleu; papers' form)"
        if PAPERS_BLEU in scores
        else "no tokenized lowercased BLEU (papers' form): sacremoses is not installed; pip install sacremoses"
    )
    lines = [
        f"{name} BLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.2f}{ter} (sacreBLEU{sentences}); {papers}",
        f"  checkpoint {checkpoint}; beam {beam}, length penalty {length_penalty:g}",
    ]
    labels = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", "bleu_lc": "BLEU-lc", PAPERS_BLEU: "BLEU-tok"}
    lines += [
        f"  {label + ':':<9} {scores[key + '_signature']}"
        for key, label in labels.items()
        if key + "_signature" in scores
    ]
    return lines


CSV_COLUMNS = (
    "step",
    "epoch",
    "time_s",
    "train_loss",
    "lr",
    "tokens_per_s",
    "valid_loss",
    "valid_bleu",
    "valid_chrf",
    "skipped_steps",
    "data_share",
    "peak_rss_mb",
    "peak_gpu_mb",
)


# Validation metrics kept per language pair (multilingual runs), as `valid_bleu/en-de`.
PAIR_METRICS = ("valid_loss", "valid_bleu", "valid_chrf")


def pair_columns(pairs: Sequence[str]) -> tuple[str, ...]:
    """The per-pair metrics.csv columns of a multilingual run: valid_loss/en-de, valid_bleu/en-de,
    valid_chrf/en-de for each pair in order; none for one pair (today's columns only)."""
    return tuple(f"{metric}/{pair}" for pair in pairs for metric in PAIR_METRICS) if len(pairs) > 1 else ()


def pair_metrics(per_pair: Mapping[str, dict], num_tokens: Mapping[str, int]) -> dict:
    """One validation's metrics from each pair's (`raymt.trainer.evaluate`'s dict, by pair, and
    the target tokens its loss is averaged over): the per-pair columns, and as `valid_bleu` and
    `valid_chrf` their mean over pairs (what ranks checkpoints), `valid_loss` token-weighted.

    One pair: its dict unchanged (no per-pair columns)."""
    assert per_pair and set(per_pair) == set(num_tokens), (list(per_pair), list(num_tokens))
    if len(per_pair) == 1:
        return dict(next(iter(per_pair.values())))
    out = {f"{metric}/{pair}": m[metric] for pair, m in per_pair.items() for metric in PAIR_METRICS}
    tokens = sum(num_tokens.values())
    out["valid_loss"] = sum(m["valid_loss"] * num_tokens[pair] for pair, m in per_pair.items()) / max(tokens, 1)
    for metric in ("valid_bleu", "valid_chrf"):
        out[metric] = sum(m[metric] for m in per_pair.values()) / len(per_pair)
    # Every pair is scored by the same sacreBLEU metric: one signature stands for all.
    first = next(iter(per_pair.values()))
    out |= {k: v for k, v in first.items() if k.endswith("_signature")}
    return out


class MetricsLog:
    """Rank 0's live metrics: `metrics.csv` and a TensorBoard event file in one directory.

    `pairs` (a multilingual run's language pairs) adds their columns (`pair_columns`) after
    today's; TensorBoard shows them as valid/bleu/en-de and so on."""

    def __init__(self, directory: str | Path, pairs: Sequence[str] = ()):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "metrics.csv"
        new = not path.exists()  # a resumed run appends, in the columns its file has (older: fewer)
        columns = CSV_COLUMNS + pair_columns(pairs) if new else path.read_text().partition("\n")[0].split(",")
        self.csv = path.open("a", newline="")
        self.rows = csv.DictWriter(self.csv, fieldnames=columns, extrasaction="ignore")
        if new:
            self.rows.writeheader()
        self.tensorboard = SummaryWriter(str(self.directory / "tensorboard"))
        self.t0 = time.time()

    def write(self, step: int, metrics: dict) -> None:
        """Append one row and the matching scalars (train/..., valid/...)."""
        self.rows.writerow({"step": step, "time_s": round(time.time() - self.t0, 2), **metrics})
        self.csv.flush()
        for key, value in metrics.items():
            if isinstance(value, str):  # sacreBLEU signatures: text, not TensorBoard scalars
                continue
            split, _, name = key.partition("_")
            if split in ("train", "valid"):
                self.tensorboard.add_scalar(f"{split}/{name}", value, step)
            elif key in ("lr", "tokens_per_s", "data_share", "peak_rss_mb", "peak_gpu_mb"):
                self.tensorboard.add_scalar(f"train/{key}", value, step)
        self.tensorboard.flush()

    def close(self) -> None:
        """Flush and close both files."""
        self.csv.close()
        self.tensorboard.close()
