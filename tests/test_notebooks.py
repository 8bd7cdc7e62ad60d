"""Every notebook runs top to bottom on a CPU, imports minipaged, and defines nothing of its own."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_only_imports_the_package(path):
    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert any("minipaged" in src for src in code), f"{path.name} never imports minipaged"
    for src in code:
        for line in src.splitlines():
            assert not line.lstrip().startswith(("def ", "class ")), \
                f"{path.name} defines code ({line.strip()!r}): it belongs in the package"
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
