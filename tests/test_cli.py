"""The `raymt` console dispatcher and run.sh's install split."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_checkpoint import make_checkpoint

from raymt.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
# runpy warns when a test has already imported the module it runs; the console command has not
RERUN = pytest.mark.filterwarnings("ignore:'raymt.translate' found in sys.modules:RuntimeWarning")


def raymt(*args: str) -> subprocess.CompletedProcess:
    """Run `python -m raymt ARGS` (what the `raymt` console script runs) and capture its output."""
    return subprocess.run([sys.executable, "-m", "raymt", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


# Every command, in the order `raymt --help` lists them.
EXPECTED = (
    "train",
    "tune",
    "data",
    "translate",
    "evaluate",
    "backtranslate",
    "average",
    "export",
    "distill",
    "pipeline",
    "import",
    "plot",
    "serve",
)


def test_help_lists_every_command():
    out = raymt("--help")
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^  (\w+) ", out.stdout, re.M)
    assert listed == list(EXPECTED)


def test_import_runs_raymt_hf_import():
    """`import` is a Python keyword: `raymt import` runs raymt.hf_import."""
    out = raymt("import", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: raymt import") and "--output" in out.stdout


def test_data_has_its_subcommands():
    """`raymt data` runs raymt.data: prepare, score and mono (raymt.data.mono_clean), each with its flags."""
    out = raymt("data", "--help")
    assert out.returncode == 0, out.stderr
    assert re.search(r"\{prepare,score,mono\}", out.stdout), out.stdout
    out = raymt("data", "mono", "--help")
    assert out.returncode == 0, out.stderr
    assert "--max-lines N" in out.stdout and "--exclude SPEC" in out.stdout


def test_translate_help_is_the_module_help():
    out = raymt("translate", "--help")
    assert out.returncode == 0, out.stderr
    assert "--checkpoint" in out.stdout and "--beam" in out.stdout


def test_unknown_command_is_a_one_line_error(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'trian'" in err and "train" in err


@RERUN
def test_translate_through_the_dispatcher_equals_the_module(tmp_path, capsys):
    from raymt import translate

    ckpt = make_checkpoint(tmp_path / "ckpt")
    args = ["--checkpoint", str(ckpt), "--max-len-b", "5", "Germany and March 3, 2021"]
    with pytest.raises(SystemExit) as done:  # the module's own sys.exit(main())
        main(["translate", *args])
    via_raymt = capsys.readouterr().out
    assert done.value.code == 0 and via_raymt.strip()
    assert translate.main(args) == 0
    assert capsys.readouterr().out == via_raymt


@RERUN
def test_a_command_exits_with_its_module_status(capsys):
    with pytest.raises(SystemExit) as done:  # --checkpoint is required: argparse's usage error
        main(["translate"])
    assert done.value.code == 2 and "--checkpoint" in capsys.readouterr().err


def test_console_script_points_at_the_dispatcher():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[project\.scripts\]\nraymt = "raymt\.__main__:main"$', text, re.M)
    assert set(COMMANDS) == set(EXPECTED)


@pytest.mark.parametrize("command, extras", [("train", []), ("shell", []), ("test", ["test"]), ("lint", ["lint"])])
def test_run_sh_installs_only_the_extras_a_command_needs(tmp_path, command, extras):
    """run.sh with a stub venv (python and pip that log their arguments): what it would install."""
    (tmp_path / "pyproject.toml").write_text("")
    script = (ROOT / "run.sh").read_text()
    (tmp_path / "run.sh").write_text(script)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    for tool in ("python", "pip", "ruff"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\n')
        (bin_dir / tool).chmod(0o755)
    subprocess.run(["bash", str(tmp_path / "run.sh"), command], check=True, timeout=30, capture_output=True)
    installs = [line.split()[-1] for line in log.read_text().splitlines() if line.startswith("pip install -e")]
    assert installs == ["."] + [f".[{e}]" for e in extras]
