"""`raymt.translate`: flag and input mistakes are one line; --ref splits lines as the inputs do."""

import io

import pytest
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import translate

FAST = ["--beam", "1", "--max-len-b", "3", "--device", "cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("translate") / "checkpoint")


@pytest.mark.parametrize("case", ["batch_zero", "batch_negative", "no_cuda", "no_device", "empty_with_ref"])
def test_bad_flags_and_input_are_one_line(checkpoint, tmp_path, case, monkeypatch, err_lines):
    ref = tmp_path / "ref.txt"
    ref.write_text("")
    args = ["--checkpoint", str(checkpoint), *FAST]
    args += {
        "batch_zero": ["--batch-size", "0", "Belize"],
        "batch_negative": ["--batch-size", "-1", "Belize"],
        "no_cuda": ["--device", "cuda", "Belize"],
        "no_device": ["--device", "gpu", "Belize"],
        "empty_with_ref": ["--ref", str(ref)],
    }[case]
    monkeypatch.setattr(translate.torch.cuda, "is_available", lambda: False)  # as on a CPU-only machine
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert translate.main(args) == 2
    err = err_lines()
    assert len(err) == 1 and err[0].startswith("raymt.translate: error: "), err
    expected = {
        "batch_zero": "--batch-size 0 must be >= 1",
        "batch_negative": "--batch-size -1 must be >= 1",
        "no_cuda": "--device cuda: no CUDA GPU is available on this machine; use --device cpu",
        "no_device": "--device gpu: not a torch device",
        "empty_with_ref": "--ref: there is no input to score",
    }[case]
    assert expected in err[0]


def test_ref_lines_split_on_newlines_only(checkpoint, tmp_path, monkeypatch, capsys):
    ref = tmp_path / "ref.txt"
    ref.write_text("Belize\u2028und Chile\nMonday\x0c, July 4\n", encoding="utf-8")  # 2 lines, not 4
    monkeypatch.setattr("sys.stdin", io.StringIO("Belize and Chile\nMonday, July 4\n"))
    assert translate.main(["--checkpoint", str(checkpoint), *FAST, "--ref", str(ref)]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 2
    assert "BLEU " in out.err and "chrF " in out.err
