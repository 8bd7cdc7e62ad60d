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


def _assignment(owner: type, name: str) -> str:
    """The line of the class's (or a base's) __init__ that sets `self.name`, as written."""
    for cls in owner.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None or not hasattr(init, "__code__"):
            continue
        try:
            lines = textwrap.dedent(inspect.getsource(init)).splitlines()
        except (OSError, TypeError):
            continue
        for ln in lines:
            code = ln.split("#")[0]
            targets = code.split("=")[0].split(",") if "=" in code else []
            if any(x.split(":")[0].strip() == f"self.{name}" for x in targets):
                return " ".join(ln.split())
    return ""


def _signature(fn) -> str:
    """`(cm, seq_id, unique: bool = False) -> np.ndarray`: annotations as written, unquoted."""
    try:
        return str(inspect.signature(fn)).replace("'", "")
    except (TypeError, ValueError):
        return "(...)"


def _doc(value) -> str:
    """A docstring's first paragraph, on one line."""
    doc = inspect.getdoc(value) or ""
    return " ".join(doc.split("\n\n")[0].split())


def self_helpers(task: Task) -> list[str]:
    """What the reference reads through `self`, each with what it is: a method's signature and
    docstring, an attribute's line in __init__ (a learner needs to know they exist and what
    they take, without opening the file that holds the answer)."""
    owner, attr, _ = resolve(task.target)
    if not isinstance(owner, type):
        return []
    names = []
    for n in ast.walk(function_node(source_of(task))):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                n.value.id == "self" and n.attr not in names and n.attr != attr:
            names.append(n.attr)
    out = []
    for name in names:
        value = inspect.getattr_static(owner, name, None)
        if isinstance(value, property):
            out.append(f"self.{name} (a property): {_doc(value)}")
        elif callable(value) or isinstance(value, staticmethod):
            fn = getattr(owner, name)
            sig = _signature(fn).replace("(self, ", "(").replace("(self)", "()")
            out.append(f"self.{name}{sig}: {_doc(fn)}")
        else:
            line = _assignment(owner, name)
            out.append(f"self.{name}: set in __init__ as `{line}`" if line else f"self.{name}")
    return out


def global_helpers(task: Task) -> list[str]:
    """The package's functions, classes and constants the reference calls, each with its
    signature and what it does (the stub file imports them)."""
    out = []
    for name in used_globals(task):
        value = vars(module_of(task))[name]
        if isinstance(value, types.ModuleType):
            continue
        if callable(value):
            out.append(f"{name}{_signature(value)}: {_doc(value)}")
        else:
            out.append(f"{name} = {value!r}")
    return out


def _comment(text: str, indent: str, width: int = 96) -> list[str]:
    """`text` as comment lines of at most `width` characters, later lines indented."""
    return [indent + ln for ln in textwrap.wrap(text, width - len(indent),
                                                initial_indent="#   ",
                                                subsequent_indent="#       ")]


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
    helpers = global_helpers(task)
    if helpers:
        out.append(f"{indent}# you may call (imported at the top of this file):")
        for h in helpers:
            out += _comment(h, indent)
    helpers = self_helpers(task)
    if helpers:
        out.append(f"{indent}# what the class gives you (through self):")
        for h in helpers:
            out += _comment(h, indent)
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
