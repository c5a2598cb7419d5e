"""The policy-study notebook is committed without outputs and executes top to bottom on the CPU."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "policy_study.ipynb"


def test_notebook_is_committed_without_outputs():
    """No code cell carries outputs or an execution count."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, cell.source[:80]


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    """Every cell runs without error (the shared-trace sections only where the trace exists)."""
    monkeypatch.setenv("KVKIT_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    assert {p.name for p in tmp_path.glob("*.png")} >= {"hit_density_table.png",
                                                         "synthetic_hit_ratio.png"}
