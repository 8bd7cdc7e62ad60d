"""The wheel ships every file the package reads: each file under minipaged/ that is not Python
is named in pyproject.toml's package-data, or an installed copy runs without it (panels.c was
missing from the wheel until stop 44, and an installed FusedLlama fell back to oneDNN)."""

import fnmatch
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shipped(path: str, package_data: dict) -> bool:
    """Whether package-data names `path` (relative to the root, e.g. minipaged/fast/panels.c)."""
    for package, patterns in package_data.items():
        folder = package.replace(".", "/") + "/"
        if path.startswith(folder) and any(fnmatch.fnmatch(path[len(folder):], pattern)
                                           for pattern in patterns):
            return True
    return False


def test_every_file_the_package_reads_is_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    files = subprocess.run(["git", "ls-files", "minipaged"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    others = [f for f in files if not f.endswith(".py")]
    assert "minipaged/fast/panels.c" in others and "minipaged/fast/operators.cpp" in others
    assert [f for f in others if not shipped(f, package_data)] == []
    assert not shipped("minipaged/fast/panels.c", {"minipaged": ["cpu_attention.c"]})
