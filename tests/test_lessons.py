"""The lessons and the README describe the code as it is.

  * A fenced block whose info string names a file of the repository — ```` ```python
    minipaged/cache_manager.py ```` — is a quote: each run of its lines between `...` lines
    must appear, verbatim and in order, in that file.
  * No placeholder line (an ALL_CAPS_NAME alone on a line) is left outside code blocks.
  * Every repository path a document names (`minipaged/...`, `lessons/...`, `notebooks/...`,
    `tests/...`, `assets/...`, relative links) exists.
  * Every `python -m minipaged...` command names a module that exists and runs something
    (it has a `__main__` block, or is a package with a `__main__.py`).
  * Every `name`, `name()` or `Name.attr` in backticks whose first part the package defines
    (a module, class or function of minipaged) resolves: the module, class, function, method or
    attribute is there.
"""

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "lessons").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\S*)[ \t]*(\S*)[ \t]*$")


def blocks(text):
    """(info words, first line number, lines) of every fenced block."""
    out, current = [], None
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line.strip())
        if m and current is None:
            current = (m.group(1), m.group(2), i + 1, [])
        elif line.strip() == "```" and current is not None:
            out.append(current)
            current = None
        elif current is not None:
            current[3].append(line)
    assert current is None, "a code block is never closed"
    return out


def prose(text):
    """The text outside fenced blocks."""
    keep, inside = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside:
            keep.append(line)
    return "\n".join(keep)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_quoted_code_is_in_the_file_it_names(doc):
    quotes = [(src, start, lines) for _, src, start, lines in blocks(doc.read_text()) if src]
    for src, start, lines in quotes:
        path = ROOT / src
        assert path.is_file(), f"{doc.name}:{start} quotes {src}, which does not exist"
        source = [line.rstrip() for line in path.read_text().splitlines()]
        runs, run = [], []
        for line in lines:
            if line.strip() in ("...", "# ..."):
                runs.append(run)
                run = []
            else:
                run.append(line.rstrip())
        runs.append(run)
        at = 0
        for run in filter(None, runs):
            for k in range(at, len(source) - len(run) + 1):
                if source[k:k + len(run)] == run:
                    at = k + len(run)
                    break
            else:
                pytest.fail(f"{doc.name}:{start}: these lines are not in {src} (in this order):\n"
                            + "\n".join(run))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_placeholder_is_left(doc):
    for line in prose(doc.read_text()).splitlines():
        assert not re.fullmatch(r"\s*[A-Z][A-Z0-9]*_[A-Z0-9_]+\s*", line), \
            f"{doc.name} has a placeholder line: {line.strip()}"


PATH = re.compile(r"(?<![\w/.-])((?:minipaged|lessons|notebooks|tests|assets)/[\w./-]*\w)")
LINK = re.compile(r"\]\(((?!https?:|#)[^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_files_exist(doc):
    text = doc.read_text()
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"
    for m in LINK.finditer(text):
        target = (doc.parent / m.group(1).split("#")[0]).resolve()
        assert target.exists(), f"{doc.name} links to {m.group(1)}, which does not exist"


def anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation but - and _ dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_to_a_heading_find_it(doc):
    """`glossary.md#prefill`, `#section`: the page linked to has a heading with that anchor."""
    for m in LINK.finditer(doc.read_text()):
        page, _, fragment = m.group(1).partition("#")
        target = (doc.parent / page).resolve() if page else doc
        if fragment and target.suffix == ".md":
            anchors = {anchor(h) for h in re.findall(r"(?m)^#+ (.*)$", prose(target.read_text()))}
            assert fragment in anchors, f"{doc.name} links to {m.group(1)}: no such heading"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_name_modules_that_exist(doc):
    for m in re.finditer(r"python -m (minipaged[\w.]*)", doc.read_text()):
        module = m.group(1).rstrip(".")
        path, file = ROOT / module.replace(".", "/"), ROOT / (module.replace(".", "/") + ".py")
        runs = file.is_file() and re.search(r"^if __name__ == .__main__.:", file.read_text(), re.M)
        assert runs or (path / "__main__.py").is_file(), \
            f"{doc.name} runs `python -m {module}`, which is no module with a main"


def package_names():
    """Module names (short and dotted) and the names every module defines at its top level."""
    modules, defined = {}, {}
    for path in sorted((ROOT / "minipaged").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[dotted.removeprefix("minipaged.")] = dotted
        modules.setdefault(parts[-2] if parts[-1] == "__init__" else parts[-1], dotted)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                defined.setdefault(node.name, dotted)
    return modules, defined


MODULES, DEFINED = package_names()
FILE_SUFFIXES = {"py", "md", "ipynb", "json", "safetensors", "model", "pth", "png", "gguf", "txt",
                 "csv", "toml"}
HF_KEY = re.compile(r"model\.(embed_tokens|layers|norm)\b")
CODE = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\([^`]*\))?`")


def resolves(dotted: str) -> bool:
    head, *rest = dotted.split(".")
    if head in MODULES:
        obj = importlib.import_module(MODULES[head])
    else:
        obj = getattr(importlib.import_module(DEFINED[head]), head)
    for name in rest:
        if isinstance(obj, type(importlib)) and f"{obj.__name__}.{name}" in MODULES.values():
            obj = importlib.import_module(f"{obj.__name__}.{name}")
        elif hasattr(obj, name):
            obj = getattr(obj, name)
        elif isinstance(obj, type) and any(name in getattr(k, "__annotations__", {})
                                           for k in obj.__mro__):
            return True                         # a dataclass field
        elif isinstance(obj, type):             # set in an __init__ of it or a base: the sources
            return any(re.search(rf"self\.{name}\b", Path(importlib.import_module(
                k.__module__).__file__).read_text()) for k in obj.__mro__
                if k.__module__.startswith("minipaged"))
        else:
            return False
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_code_exists(doc):
    files = {p.name for p in (ROOT / "minipaged").rglob("*.py")}
    for m in CODE.finditer(prose(doc.read_text())):
        dotted = m.group(1)
        if dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES:
            assert not dotted.endswith(".py") or dotted.split("/")[-1] in files, \
                f"{doc.name} names `{dotted}`, a module the package does not have"
            continue
        head = dotted.split(".")[0]
        if HF_KEY.match(dotted):
            continue                            # a Hugging Face checkpoint key, not our module
        if head not in MODULES and head not in DEFINED:
            continue                            # not the package's name (torch, vLLM, a variable)
        assert resolves(dotted), f"{doc.name} names `{m.group(0).strip('`')}`, which the " \
                                 f"package does not have"
