"""`raymt.export`: a self-contained model directory that translates like its checkpoint; no code runs on load."""

import os
import subprocess
import sys

import pytest
import torch
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import export, exporting, translate
from raymt.checkpoint import load_model, load_weights

SENTENCES = ["Germany and March 3, 2021", "Monday, July 4, 1999 and twelve kilometers"]


class RunsCode:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_malicious_pickle(path, tmp_path):
    """Overwrite `path` with a torch file whose unpickling would create a marker file."""
    marker = tmp_path / "code_ran"
    torch.save({"embed.weight": RunsCode(marker)}, path)
    return marker


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("export") / "checkpoint", seed=3)


def translated(directory, capsys):
    capsys.readouterr()
    assert translate.main(["--checkpoint", str(directory), "--beam", "2", "--max-len-b", "4", *SENTENCES]) == 0
    return capsys.readouterr().out


def test_export_translates_like_the_checkpoint(checkpoint, tmp_path, capsys):
    out = tmp_path / "model"
    assert export.main(["--checkpoint", str(checkpoint), "--output", str(out), "--format", "torch"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.pt", "spm.model"]
    for key, value in load_weights(checkpoint).items():
        assert torch.equal(load_weights(out)[key], value)
    assert translated(out, capsys) == translated(checkpoint, capsys)


def test_exported_model_translates_without_ray(checkpoint, tmp_path):
    out = exporting.export_model(checkpoint, tmp_path / "model", "torch")
    code = (
        "import sys, raymt.translate as t; status = t.main(['--checkpoint', sys.argv[1], '--beam', '1', "
        "'--max-len-b', '3', 'Belize']); print('ray' in sys.modules, status)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "False 0"


def test_half_precision_export_loads(checkpoint, tmp_path):
    out = exporting.export_model(checkpoint, tmp_path / "half", "torch", "float16")
    assert load_weights(out)["embed.weight"].dtype == torch.float16
    model, _, _ = load_model(out)
    assert model.embed.weight.dtype == torch.float32
    assert (out / "model.pt").stat().st_size < 0.6 * (checkpoint / "model.pt").stat().st_size


def test_malicious_pickle_is_refused(checkpoint, tmp_path, err_lines):
    out = exporting.export_model(checkpoint, tmp_path / "model", "torch")
    marker = plant_malicious_pickle(out / "model.pt", tmp_path)
    with pytest.raises(ValueError, match=r"refusing to load .*model\.pt: it would run posix\.system"):
        load_model(out)
    assert translate.main(["--checkpoint", str(out), "Belize"]) == 2
    err = err_lines()
    assert len(err) == 1 and "corrupt or malicious" in err[0]
    assert not marker.exists()


def test_safetensors_export(checkpoint, tmp_path, capsys):
    pytest.importorskip("safetensors")
    out = exporting.export_model(checkpoint, tmp_path / "model", "auto")
    assert (out / "model.safetensors").is_file() and not (out / "model.pt").exists()
    assert translated(out, capsys) == translated(checkpoint, capsys)


@pytest.mark.parametrize("case", ["missing", "not_empty"])
def test_export_errors_are_one_line(checkpoint, tmp_path, case, err_lines):
    source = str(tmp_path / "nothing") if case == "missing" else str(checkpoint)
    (tmp_path / "out").mkdir()
    if case == "not_empty":
        (tmp_path / "out" / "file").write_text("x")
    assert export.main(["--checkpoint", source, "--output", str(tmp_path / "out")]) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.export: error: ")
    assert ("does not exist" if case == "missing" else "not empty") in err[0]


def test_the_config_renders_its_command_and_run_returns_the_export(tmp_path, capsys):
    from raymt.command import command_line, parse, to_argv

    cfg = export.ExportConfig(checkpoint="s3://b/ckpt", output="out", format="ctranslate2", dtype="int8")
    assert parse(export.ExportConfig, to_argv(cfg), "export") == cfg
    assert (
        command_line("export", cfg)
        == "raymt export --checkpoint s3://b/ckpt --output out --format ctranslate2 --dtype int8"
    )
    with pytest.raises(ValueError, match="--dtype int4: one of"):
        export.ExportConfig(checkpoint="c", output="o", dtype="int4")
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    out = export.run(export.ExportConfig(checkpoint=str(checkpoint), output=str(tmp_path / "out"), format="torch"))
    assert out == tmp_path / "out" and (out / "model.pt").is_file()
    assert capsys.readouterr().out.startswith(f"exported {checkpoint} -> {out}")
