"""Stub files, generated from the package's own functions: the signature and the docstring
kept, the shapes the reference names listed as comments, the body a NotImplementedError that
names the lesson section. The imports a file needs are the names the reference bodies use."""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from pathlib import Path

from .grader import resolve
from .tasks import TASKS, Task


def source_of(task: Task) -> str:
    """The reference function's source, dedented (a method's `self` is kept)."""
    _, _, fn = resolve(task.target)
    return textwrap.dedent(inspect.getsource(fn))


def function_node(source: str) -> ast.FunctionDef:
    return ast.parse(source).body[0]


def body_lines(task: Task) -> int:
    """Lines a learner writes: the reference body without its docstring, comments and blanks."""
    src = source_of(task)
    node = function_node(src)
    body = node.body[1:] if ast.get_docstring(node) else node.body
    lines = src.splitlines()[body[0].lineno - 1: body[-1].end_lineno]
    return sum(1 for ln in lines if ln.strip() and not ln.strip().startswith("#"))


def module_of(task: Task) -> types.ModuleType:
    owner, _, _ = resolve(task.target)
    return inspect.getmodule(owner) if isinstance(owner, type) else owner


def used_globals(task: Task) -> dict[str, str]:
    """name -> import line, for the module-level names the reference body reads."""
    module = module_of(task)
    node = function_node(source_of(task))
    out = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in vars(module):
            value = vars(module)[n.id]
            if isinstance(value, types.ModuleType):
                line = f"import {value.__name__}" + (f" as {n.id}" if
                                                     value.__name__.split(".")[-1] != n.id or
                                                     "." in value.__name__ else "")
            else:
                line = f"from {module.__name__} import {n.id}"
            out[n.id] = line
    return out


def shape_hints(task: Task) -> list[str]:
    """`name: (B, T)` for every line of the reference that carries a shape comment."""
    hints = []
    src = source_of(task)
    for ln in src.splitlines():
        code, _, comment = ln.partition("#")
        comment = comment.strip()
        if comment.startswith("(") and "=" in code:
            name = code.split("=")[0].strip().split(",")[0].strip()
            hints.append(f"{name}: {comment}")
    return hints


def self_helpers(task: Task) -> list[str]:
    """`self.name(...)`: first docstring line, for each method or attribute of the class that
    the reference reads through `self` (a learner needs to know they exist)."""
    owner, attr, _ = resolve(task.target)
    if not isinstance(owner, type):
        return []
    names = []
    for n in ast.walk(function_node(source_of(task))):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                n.value.id == "self" and n.attr not in names:
            names.append(n.attr)
    out = []
    for name in names:
        value = inspect.getattr_static(owner, name, None)
        if callable(value) or isinstance(value, (property, staticmethod)):
            doc = (inspect.getdoc(getattr(owner, name)) or "").split("\n")[0]
            kind = "" if isinstance(value, property) else "()"
            out.append(f"self.{name}{kind}: {doc}" if doc else f"self.{name}{kind}")
        else:
            out.append(f"self.{name}")
    return out


def stub(task: Task) -> str:
    """The function as a learner receives it."""
    src = source_of(task)
    node = function_node(src)
    lines = src.splitlines()
    first_body = node.body[0]
    doc = ast.get_docstring(node)
    end = first_body.end_lineno if doc else first_body.lineno - 1
    head = lines[:end]
    if node.decorator_list:
        head = lines[node.decorator_list[0].lineno - 1 - (node.decorator_list[0].lineno - 1):end]
    indent = " " * (len(lines[first_body.lineno - 1]) - len(lines[first_body.lineno - 1].lstrip()))
    out = list(head)
    helpers = self_helpers(task)
    if helpers:
        out.append(f"{indent}# helpers of the class the reference calls (read them in {module_of(task).__name__}):")
        out += [f"{indent}#   {h}" for h in helpers]
    hints = shape_hints(task)
    if hints:
        out.append(f"{indent}# shapes the reference works with:")
        out += [f"{indent}#   {h}" for h in hints]
    out.append(f'{indent}raise NotImplementedError("not written yet: {task.id}, see {task.lesson}")')
    return "\n".join(out) + "\n"


def stub_file(tasks: list[Task]) -> str:
    """One workspace file: a docstring, the imports its functions need, a stub per task."""
    stage = tasks[0].stage
    imports = sorted({line for t in tasks for line in used_globals(t).values()})
    ids = ", ".join(t.id for t in tasks)
    parts = [f'"""Stage {stage}: your code for {ids}.\n\n'
             f"Each function below stands in for the package's own when you run\n"
             f"    python -m minipaged.exercises check {stage} --workspace <this folder>\n"
             f"(a method takes `self`: it becomes a method of the class named above it).\n"
             f"Write the body; keep the signature.\n\"\"\"\n",
             "from __future__ import annotations\n",
             "\n".join(imports) + "\n" if imports else ""]
    for t in tasks:
        owner = t.target.rsplit(".", 2)
        where = f"method of {owner[1]}" if owner[1][:1].isupper() else "function"
        parts.append(f"\n# {t.id}: {t.what}\n# ({where} {t.target}; {t.lesson})\n" + stub(t))
    return "\n".join(parts)


def files() -> dict[str, list[Task]]:
    out: dict[str, list[Task]] = {}
    for t in TASKS:
        out.setdefault(t.file, []).append(t)
    return out


def start(directory: Path) -> list[tuple[str, str]]:
    """Write every stub file into `directory` that is not there yet: (file, 'wrote'|'kept')."""
    directory.mkdir(parents=True, exist_ok=True)
    done = []
    for name, tasks in files().items():
        path = directory / name
        if path.exists():
            done.append((name, "kept (already there)"))
            continue
        path.write_text(stub_file(tasks))
        done.append((name, "wrote"))
    return done
