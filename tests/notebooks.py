"""Execute the notebooks the way the tests do, and write them back with their outputs.

    python tests/notebooks.py                       # every notebook under notebooks/
    python tests/notebooks.py notebooks/02_*.ipynb  # some of them

The notebooks are committed executed, so a reader on GitHub sees every figure; run this after
changing a notebook or the code it draws, and commit the result. Outputs are deterministic
(seeded, no timings): running it twice writes the same text.
"""

import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path):
    """The notebook at `path`, run top to bottom on the CPU in an empty `notebooks/` folder of
    its own: a learner's `workspace/` beside the real one (what `python -m minipaged.exercises
    start` writes) would otherwise change what the Build it cells print."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "notebooks"
        folder.mkdir()
        NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(folder)}}).execute()
    nb.metadata.pop("widgets", None)
    return nb


def main(paths):
    for path in paths or sorted((ROOT / "notebooks").glob("*.ipynb")):
        path = Path(path)
        nbformat.write(execute(path), path)
        print(f"executed {path.relative_to(ROOT) if path.is_absolute() else path}")


if __name__ == "__main__":
    main(sys.argv[1:])
