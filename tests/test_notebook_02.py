"""Notebook 02 runs top to bottom on a CPU and shows the seed article's block table."""

from pathlib import Path

import nbclient
import nbformat

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_cache_manager.ipynb"


def test_notebook_02_runs_and_reproduces_the_article():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")
    assert not any(line.lstrip().startswith(("def ", "class "))
                   for cell in nb.cells if cell.cell_type == "code"
                   for line in cell.source.splitlines())
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    shown = [out.get("data", {}).get("text/plain", "") + out.get("text", "")
             for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert "{0: [7, 1, 3], 1: [5, 2]}" in shown
    assert any("Nothing was allocated" in s for s in shown)
    assert any("unchanged: True" in s for s in shown)
