"""sacreBLEU scores with their signatures."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Optional

import sacrebleu


def _metrics(extra: bool) -> dict:
    """sacreBLEU metrics by name: BLEU and chrF; with `extra` TER and lowercased 13a BLEU too."""
    metrics = {"bleu": sacrebleu.metrics.BLEU(), "chrf": sacrebleu.metrics.CHRF()}
    if extra:  # bleu_lc: the closest sacreBLEU equivalent of papers' tokenized, lowercased BLEU
        metrics |= {"ter": sacrebleu.metrics.TER(),
                    "bleu_lc": sacrebleu.metrics.BLEU(tokenize="13a", lowercase=True)}
    return metrics


def score(hyps: list[str], refs: list[str], extra: bool = False) -> dict:
    """The one scorer: corpus scores on detokenized text, each with its sacreBLEU signature.

    Keys: bleu, chrf, bleu_signature, chrf_signature; with `extra` also ter, bleu_lc and
    their *_signature.
    """
    out: dict = {}
    for name, metric in _metrics(extra).items():
        out[name] = metric.corpus_score(hyps, [refs]).score
        out[f"{name}_signature"] = str(metric.get_signature())
    return out


# The `score(..., extra=True)` key printed beside sacreBLEU: 13a-tokenized, lowercased BLEU.
PAPERS_BLEU = "bleu_lc"


def score_lines(name: str, scores: dict, checkpoint: str, beam: int, length_penalty: float,
                num_sentences: Optional[int] = None) -> list[str]:
    """How a test score is printed (raymt.train and raymt.evaluate): the scores, the weights and
    decoding they come from, and every sacreBLEU signature.

    `scores` is `score(..., extra=True)`'s; its `bleu_lc` (sacreBLEU's 13a tokenizer,
    lowercased) is the closest sacreBLEU form of papers' tokenized lowercased BLEU.
    """
    sentences = f", {num_sentences} sentences" if num_sentences is not None else ""
    ter = f", TER {scores['ter']:.2f}" if "ter" in scores else ""
    lines = [f"{name} BLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.2f}{ter} (sacreBLEU{sentences}); "
             f"tokenized lowercased BLEU {scores[PAPERS_BLEU]:.2f} (13a, lowercase; papers' form)",
             f"  checkpoint {checkpoint}; beam {beam}, length penalty {length_penalty:g}"]
    labels = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", PAPERS_BLEU: "BLEU-lc"}
    lines += [f"  {label + ':':<8} {scores[key + '_signature']}" for key, label in labels.items()
              if key + "_signature" in scores]
    return lines


CSV_COLUMNS = ("step", "epoch", "time_s", "train_loss", "lr", "tokens_per_s",
               "valid_loss", "valid_bleu", "valid_chrf", "skipped_steps", "data_share", "peak_rss_mb",
               "peak_gpu_mb")


class MetricsLog:
    """Rank 0's live metrics: `metrics.csv` and a TensorBoard event file in one directory."""

    def __init__(self, directory: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "metrics.csv"
        new = not path.exists()  # a resumed run appends, in the columns its file has (older: fewer)
        columns = CSV_COLUMNS if new else path.read_text().partition("\n")[0].split(",")
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
