"""Learning curves: train and validation loss, validation BLEU and chrF against step and time.

    python -m raymt.plot runs/RUN                       # one run
    python -m raymt.plot runs/A runs/B --out compare    # runs overlaid, one colour each

Reads each run's `logs/metrics.csv` and writes `curves_step.png` and `curves_time.png`
(`raymt.curves`, which also writes every training run's own into `RUN/plots/`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raymt.command import flag, main_of
from raymt.curves import plot_runs
from raymt.errors import check


@dataclass(kw_only=True)
class PlotConfig:
    """`raymt plot`: the run directories and the output folder."""

    runs: list[str] = flag(
        help="a run directory (its logs/metrics.csv is read); several are overlaid",
        positional=True,
        repeat=True,
        required=True,
        metavar="RUN",
    )
    out: str = flag("plots", "folder for curves_step.png and curves_time.png (default ./plots)")

    def __post_init__(self) -> None:
        check(bool(self.runs), "no run directory: give one or more RUN")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    return main_of("python -m raymt.plot", PlotConfig, run, argv, __doc__.split("\n")[0])


def run(cfg: PlotConfig) -> list[Path]:
    """Draw the runs' curves into `cfg.out`, printing each file's path; returns them."""
    try:
        written = plot_runs(cfg.runs, cfg.out)
    except OSError as err:  # an --out that cannot be written
        raise ValueError(f"cannot write the plots to {cfg.out}: {err.strerror or err}") from None
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    sys.exit(main())
