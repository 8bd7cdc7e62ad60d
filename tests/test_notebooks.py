"""Every notebook runs top to bottom on a CPU, imports minipaged, defines nothing of its own, and
is committed executed — with its figures, and with the outputs a fresh run gives."""

import re
from pathlib import Path

import nbformat
import pytest

from notebooks import execute

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LESSONS = sorted((ROOT / "lessons").glob("[0-9]*.md"))
NOT_DETERMINISTIC = {
    "a path of this machine": re.compile(r"/(home|work|tmp|root|Users)/|site-packages"),
    "a memory address": re.compile(r"\b0x[0-9a-f]{6,}\b"),
    "a timing": re.compile(r"\b\d+(\.\d+)?\s?(ms|µs|us)\b|\bit/s\b|tok/s|\bseconds\b"),
}


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def images(cell) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def text(cell) -> str:
    """A cell's text outputs, with decimals rounded to 3 significant digits (the last digit of
    a float may differ between CPUs; anything else differing means the notebook is stale)."""
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", "") if o.output_type == "stream" else
                   o.get("data", {}).get("text/plain", "") if "data" in o else
                   f"{o.get('ename')}: {o.get('evalue')}")
    return re.sub(r"\d+\.\d+(e[+-]?\d+)?", lambda m: f"{float(m.group()):.3g}", "".join(out))


def test_every_lesson_has_its_notebook():
    assert NOTEBOOKS, "no notebooks under notebooks/"
    for lesson in LESSONS:
        stage = lesson.name.split("-")[0]
        assert list((ROOT / "notebooks").glob(f"{stage}_*.ipynb")), \
            f"lesson {lesson.name} has no notebook notebooks/{stage}_*.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_executed_with_figures_and_nothing_machine_specific(path):
    nb = nbformat.read(path, as_version=4)
    cells = code_cells(nb)
    assert all(c.execution_count is not None for c in cells), \
        f"{path.name} is committed without running every cell: run `python tests/notebooks.py`"
    assert sum(images(c) for c in cells) > 0, f"{path.name} is committed without its figures"
    for c in cells:
        assert not any(o.output_type == "error" for o in c.outputs), \
            f"{path.name} is committed with an error in a cell"
        for what, pattern in NOT_DETERMINISTIC.items():
            m = pattern.search(text(c))
            assert not m, f"{path.name} shows {what} ({m.group()!r}): outputs must be " \
                          f"the same on every run and every machine"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_imports_the_package_and_defines_nothing(path):
    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in code_cells(nb)]
    assert any(re.search(r"^\s*(import|from) minipaged", src, re.M) for src in code), \
        f"{path.name} never imports minipaged"
    for src in code:
        assert "sys.path" not in src, f"{path.name} edits sys.path: the package is installed"
        for line in src.splitlines():
            assert not line.lstrip().startswith(("def ", "class ")), \
                f"{path.name} defines code ({line.strip()!r}): it belongs in the package"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_fresh_run_gives_the_committed_outputs(path):
    committed = code_cells(nbformat.read(path, as_version=4))
    fresh = code_cells(execute(path))
    for i, (old, new) in enumerate(zip(committed, fresh)):
        assert images(new) == images(old), \
            f"{path.name}, code cell {i}: draws {images(new)} figure(s), committed with " \
            f"{images(old)}; run `python tests/notebooks.py {path.relative_to(ROOT)}`"
        assert text(new) == text(old), \
            f"{path.name}, code cell {i} prints something else than what is committed; run " \
            f"`python tests/notebooks.py {path.relative_to(ROOT)}` and commit the notebook"


def test_notebook_02_reproduces_the_articles_block_table():
    """The seed article's picture: A (11 tokens) and B (6) in blocks {0: [7, 1, 3], 1: [5, 2]}
    of a 9-block pool; a request that does not fit changes nothing."""
    nb = nbformat.read(ROOT / "notebooks" / "02_cache_manager.ipynb", as_version=4)
    shown = "".join(text(c) for c in code_cells(nb))
    assert "{0: [7, 1, 3], 1: [5, 2]}" in shown
    assert "Nothing was allocated" in shown and "unchanged: True" in shown
