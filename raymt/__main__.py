"""The `raymt` console command: `raymt COMMAND ARGS` runs `python -m raymt.COMMAND ARGS`.

raymt train --preset tiny
raymt translate --checkpoint runs/<run>/best < input.txt
"""

from __future__ import annotations

import runpy
import sys
from typing import Optional

from raymt.errors import cli_error

# command -> one line of help; each runs its module exactly as `python -m raymt.<command>`
COMMANDS = {
    "train": "train a model on Ray Train workers",
    "tune": "sweep hyper-parameters with Ray Tune",
    "data": "prepare a corpus, score its pairs, clean monolingual text (`raymt data prepare|score|mono ...`)",
    "translate": "translate stdin or a file with a checkpoint",
    "evaluate": "score a checkpoint on test sets (sacreBLEU)",
    "backtranslate": "translate a monolingual corpus on a Ray cluster (restartable)",
    "average": "average the weights of several checkpoints",
    "export": "export a checkpoint for serving",
    "distill": "distill a small fast student from a teacher or an ensemble (translate, train, export)",
    "pipeline": "from corpora to a deployed student in one resumable command (run, plan, show STEP)",
    "import": "import a Hugging Face OPUS-MT (Marian) or NLLB / M2M-100 model as a checkpoint",
    "plot": "draw learning curves of one or more runs (PNG)",
    "serve": "serve a checkpoint over HTTP on Ray Serve (batched across requests)",
}


# The commands whose module has another name (`import` is a Python keyword).
MODULES = {"import": "hf_import"}


def usage() -> str:
    """The top-level help: the commands and how to get each one's flags."""
    lines = ["usage: raymt COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`raymt COMMAND --help` lists a command's flags; `python -m raymt.COMMAND` is the same."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command named by the first argument with the rest of the arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        return cli_error("raymt", f"unknown command '{command}'; use one of {', '.join(COMMANDS)}")
    sys.argv = [f"raymt {command}", *args]
    # the module ends with its own `sys.exit(main())`, whose SystemExit passes through
    runpy.run_module(f"raymt.{MODULES.get(command, command)}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
