"""The package reads in order: reading order is dependency order.

Parsed, never imported: every module's imports are read with `ast`.

  * Each module at the package root is a stage of the course (its docstring opens with
    "Stage N:"), or one of the few modules that are not: `__init__`, `api` (above every stage),
    `errors` (below every stage), `cli` (what every command line shares; no stage uses it), and
    the support modules beside the stages (`checks`, `backends`, `sizing`: validation, backend
    dispatch, pool sizing), whose docstrings open with "Support, not a stage (not needed on a
    first read)".
  * A stage's module imports only earlier stages, its own stage, `errors` and support modules
    — never a later stage, never `api`, never a subpackage (formats, embedded, chat, viz,
    benchmarks, fast).
  * A support module imports `errors`, other support modules and only stages that come no
    later than the first stage that uses it; never a subpackage.
  * No module imports the package inside a function: such an import hides a cycle or a
    layering mistake.
  * The modules import each other without a cycle.
  * Subpackages keep to their floor: formats reads checkpoints for the model and nothing above
    it; viz draws the stages but knows no application; fast rearranges the stages' model and
    caches for speed and knows nothing above them (no stage imports it); exercises (the course's
    tasks and grader) may import every stage and drawing, and nothing imports it; nothing but
    benchmarks imports benchmarks.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minipaged"
SUPPORT = {"checks", "cache_checks", "backends", "sizing", "cache_queries", "rope_scaling",
           "sampling", "kv_formats"}
NOT_STAGES = {"__init__", "api", "errors", "cli"} | SUPPORT
STAGE = re.compile(r"Stage (\d+)(b?):")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(importer: str, node) -> list[str]:
    """The modules of this package that an import statement in `importer` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "minipaged"]
    if node.level:
        base = importer.split(".")
        base = base[:len(base) - node.level + (1 if is_package(importer) else 0)]
        module = ".".join(base + ([node.module] if node.module else []))
    elif (node.module or "").split(".")[0] == "minipaged":
        module = node.module
    else:
        return []
    targets = []
    for alias in node.names:                    # `from pkg import submodule` loads the submodule
        sub = f"{module}.{alias.name}"
        targets.append(sub if sub in MODULES else module)
    return targets


def imports(name: str, top_level_only: bool = True) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(resolve(name, node))
    return found


def stage_of(name: str):
    """(number, "b" or "") of a root module, from its docstring; None for a module of no stage."""
    short = name.removeprefix("minipaged.")
    if "." in short or short in NOT_STAGES or name == "minipaged":
        return None
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    m = STAGE.match(doc)
    assert m, f"minipaged/{short}.py is at the package root but its docstring does not open " \
              f"with 'Stage N:' — the root is the course; move it into a subpackage"
    return int(m.group(1)), m.group(2)


ROOT_MODULES = [n for n in MODULES if n.count(".") == 1 and not is_package(n)
                and n.split(".")[1] not in NOT_STAGES]


def test_every_root_module_is_a_stage():
    stages = {stage_of(n) for n in ROOT_MODULES}
    for k in range(1, 7):
        assert (k, "") in stages, f"no module opens with 'Stage {k}:'"


@pytest.mark.parametrize("name", ROOT_MODULES)
def test_a_stage_imports_only_earlier_stages(name):
    mine = stage_of(name)
    for target in imports(name):
        short = target.removeprefix("minipaged.")
        assert "." not in short and target != "minipaged", \
            f"{name} (stage {mine}) imports {target}: a stage imports no subpackage"
        if short in NOT_STAGES:
            assert short == "errors" or short in SUPPORT, \
                f"{name} imports {target}, which sits above every stage"
            continue
        theirs = stage_of(target)
        assert theirs <= mine, \
            f"{name} (stage {''.join(map(str, mine))}) imports {target} of the later stage " \
            f"{''.join(map(str, theirs))}: later stages extend earlier ones, not the other way"


@pytest.mark.parametrize("short", sorted(SUPPORT))
def test_a_support_module_sits_beside_the_stages_it_serves(short):
    name = f"minipaged.{short}"
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    assert doc.startswith("Support, not a stage (not needed on a first read)"), \
        f"{name}'s docstring must open by saying it is support, not needed on a first read"
    users = [stage_of(n) for n in ROOT_MODULES if name in imports(n) and stage_of(n)]
    first_user = min(users, default=None)
    for target in imports(name):
        t = target.removeprefix("minipaged.")
        assert "." not in t and target != "minipaged", f"{name} imports the subpackage {target}"
        if t in NOT_STAGES:
            assert t == "errors" or t in SUPPORT, f"{name} imports {target}, above the stages"
            continue
        assert first_user is not None and stage_of(target) <= first_user, \
            f"{name} imports {target} (stage {stage_of(target)}), later than stage " \
            f"{first_user}, the first stage that uses {name}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_package_import_inside_a_function(name):
    tree = ast.parse(MODULES[name].read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    assert not resolve(name, node), \
                        f"{MODULES[name]}:{node.lineno} imports the package inside " \
                        f"{fn.name}(); import it at the top"


def test_no_import_cycle():
    graph = {n: imports(n) for n in MODULES}
    state = {}                                  # 1: on the current path, 2: done

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = path[path.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


FLOORS = {   # subpackage -> what else in the package it may import (besides itself and errors)
    "formats": {"minipaged.model", "minipaged.checks"},   # checks: below the model, which uses it
    "viz": {m for m in ROOT_MODULES} | {f"minipaged.{m}" for m in SUPPORT},
    "embedded": {"minipaged.model", "minipaged.formats", "minipaged.viz", "minipaged.cli"},
    "fast": {m for m in ROOT_MODULES} | {f"minipaged.{m}" for m in SUPPORT},
    # the course's tasks and grader: every stage and drawing, never a benchmark
    "exercises": {"minipaged"} | {m for m in MODULES if not m.startswith("minipaged.benchmarks")},
}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.count(".") >= 2 or
                                        (n.count(".") == 1 and is_package(n))))
def test_subpackages_keep_to_their_floor(name):
    sub = name.split(".")[1]
    for target in imports(name):
        if target in ("minipaged.errors",) or target.startswith(f"minipaged.{sub}"):
            continue
        assert not target.startswith("minipaged.benchmarks"), \
            f"{name} imports {target}: nothing but the benchmarks imports a benchmark"
        if sub in FLOORS:
            allowed = FLOORS[sub]
            assert any(target == a or target.startswith(a + ".") for a in allowed), \
                f"{name} imports {target}, above the {sub} subpackage's floor"


def test_cli_sits_beside_errors():
    """The command lines' shared conventions import nothing of the package but its errors, so
    every program (chat, embedded, benchmarks) can use them without reaching across."""
    assert imports("minipaged.cli") <= {"minipaged.errors"}


def test_nothing_imports_the_exercises():
    """The grader stands a learner's function in for the package's; no stage may depend on it."""
    for name in MODULES:
        if not name.startswith("minipaged.exercises"):
            assert not any(t.startswith("minipaged.exercises") for t in imports(name, False)), \
                f"{name} imports the exercises: the course's grader sits above everything"
