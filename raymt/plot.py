"""Learning curves: train and validation loss, validation BLEU and chrF against step and time.

    python -m raymt.plot runs/RUN                       # one run
    python -m raymt.plot runs/A runs/B --out compare    # runs overlaid, one colour each

Reads each run's `logs/metrics.csv` and writes `curves_step.png` and `curves_time.png`
(`raymt.curves`, which also writes every training run's own into `RUN/plots/`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from raymt.curves import plot_runs
from raymt.errors import cli_error


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line: run directories and the output folder."""
    parser = argparse.ArgumentParser(prog="python -m raymt.plot", description=__doc__.split("\n")[0])
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="a run directory (its logs/metrics.csv is read); several are overlaid"
    )
    parser.add_argument(
        "--out", default="plots", help="folder for curves_step.png and curves_time.png (default ./plots)"
    )
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        written = plot_runs(args.runs, args.out)
    except OSError as err:  # an --out that cannot be written
        return cli_error("raymt.plot", f"cannot write the plots to {args.out}: {err.strerror or err}")
    except ValueError as err:
        return cli_error("raymt.plot", err)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
