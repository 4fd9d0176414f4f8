"""The quick-start notebook runs top to bottom (small settings) and its plots render."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(600)


# ~70-85 s on an AVX2-only 2-core box, the default suite's largest share after the GPU check's CPU
# form: CI runs it after the default suite (`-m ci`), which then stays under 8 minutes there.
@pytest.mark.slow
@pytest.mark.ci
def test_quickstart_notebook_executes(tmp_path, monkeypatch, ray_address):
    import matplotlib.image
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("RAYMT_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("RAYMT_NOTEBOOK_PLOTS", str(tmp_path / "plots"))
    monkeypatch.setenv("RAYMT_STORAGE_PATH", str(tmp_path / "runs"))
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=540, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()  # raises on error

    for name in ("training.png", "sweep.png"):
        path = tmp_path / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # not blank
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "->" in outputs  # translations printed
