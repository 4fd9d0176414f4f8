"""`raymt pipeline run [STEP ...]|plan|show STEP CONFIG.toml`: from raw corpora to a deployed student
in one resumable command (docs/pipeline.md). `run` runs the steps (or the STEPs and those they use), skipping
the done ones (its rerun after a kill redoes no finished step), side by side where the cluster has
room; `plan` lists each step's key and state (done, to do, or stale and why) and the time left,
without starting Ray; `show STEP` prints the command that runs one step alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from raymt.cluster import check_ray_address
from raymt.command import flag, parse
from raymt.errors import check, cli_error
from raymt.pipeline.config import load
from raymt.pipeline.runner import Pipeline
from raymt.shard_job import Unfinished

PROG = "raymt.pipeline"
ACTIONS = ("run", "plan", "show")


@dataclass(kw_only=True)
class PipelineCommand:
    """`raymt pipeline`: what to do, the config file (and the step `show` names), its overrides."""

    action: str = flag(help="run the steps, plan (a dry run) or show STEP's command", positional=True, choices=ACTIONS)
    args: list[str] = flag(
        help="[STEP ...] CONFIG.toml (run STEP ...: those steps and the steps they use)",
        positional=True,
        repeat=True,
        required=True,
        metavar="ARG",
    )
    output: Optional[str] = flag(None, "the output directory (instead of the config's output)", metavar="DIR")
    set: list[str] = flag(help="override any config field (repeatable)", repeat=True, metavar="STAGE.FIELD=VALUE")
    share_output: bool = flag(False, "write into an output directory that another pipeline (languages, corpus) wrote")
    verbose: bool = flag(False, "also print Ray's own INFO lines")

    def __post_init__(self) -> None:
        wanted = {"show": 2, "plan": 1}.get(self.action, len(self.args) or 1)
        usage = {"show": "show STEP CONFIG.toml", "run": "run [STEP ...] CONFIG.toml", "plan": "plan CONFIG.toml"}
        check(
            len(self.args) == wanted,
            f"{self.action}: {' '.join(self.args)}: usage: raymt pipeline {usage[self.action]}",
        )

    @property
    def config(self) -> str:
        """The config file."""
        return self.args[-1]


def run(cmd: PipelineCommand) -> Optional[dict]:
    """The action: `run` returns the report; `plan` and `show` print (a one-line ValueError for a
    mistake in the config, before Ray starts)."""
    pipeline = Pipeline(load(cmd.config, cmd.output, cmd.set), cmd.verbose, cmd.share_output)
    if cmd.action == "plan":
        print("\n".join(pipeline.plan()))
        return None
    if cmd.action == "show":
        print(pipeline.command(cmd.args[0]))
        return None
    for name in cmd.args[:-1]:
        pipeline.check_step(name)
    check_ray_address()
    return pipeline.run(cmd.args[:-1])


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status: 2 for a user error, 1 when a step did not finish."""
    try:
        run(parse(PipelineCommand, argv, "raymt pipeline", __doc__.split("\n\n")[0]))
    except ValueError as err:
        return cli_error(PROG, " ".join(str(err).split("\n")))
    except Unfinished as err:
        return cli_error(PROG, err, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
