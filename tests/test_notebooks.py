"""Every notebook in ``notebooks/`` is committed with its executed outputs, runs on the CPU, and writes its plots.

Notebooks save their plots as PNG files in ``$KVKIT_PLOT_DIR`` (default: the
working directory); each runs here in its own temporary directory.
"""

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
_PNG = b"\x89PNG\r\n\x1a\n"


def test_there_are_notebooks():
    """The notebooks folder holds at least the quickstart, offload study and component tour."""
    assert {"quickstart", "offload_study", "component_tour"} <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_its_outputs(path):
    """Every code cell ran, in order, without an error, and each figure is in the file for a reader to see."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "run every cell once, in order"
    outputs = [o for cell in code for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"], "a committed cell failed"
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure is shown"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_needs_no_files_beside_the_checkout(path):
    """No notebook reads a trace from outside the package (the built-in trace ships with kvkit)."""
    text = path.read_text()
    assert "shared/traces" not in text and '"shared"' not in text and ".jsonl" not in text


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_writes_its_plots(path, tmp_path, monkeypatch):
    """The notebook executes without error and every PNG it writes is a real, non-blank image."""
    import nbformat
    import numpy as np
    from matplotlib.image import imread
    from nbclient import NotebookClient

    monkeypatch.setenv("KVKIT_PLOT_DIR", str(tmp_path))
    for knob in ("KVKIT_FULL", "KVKIT_TRACE"):  # the quick default run, on the built-in trace
        monkeypatch.delenv(knob, raising=False)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    pngs = sorted(tmp_path.rglob("*.png"))
    assert pngs, f"{path.name} wrote no PNG plot"
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == _PNG and len(data) > 5_000, png.name
        pixels = imread(png)
        assert np.ptp(pixels[..., :3]) > 0, f"{png.name} is blank"
    shown = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
             if "image/png" in o.get("data", {})]
    assert len(shown) >= len(pngs), "every saved plot is also shown"
