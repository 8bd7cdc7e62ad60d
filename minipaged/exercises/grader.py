"""The grader's machinery: put a learner's function in the package's place, run a task's
checks around it, and say what failed in a sentence.

`stand_in(target, fn)` swaps one function of the package for `fn` while a check runs and puts
the original back after: a method is replaced on its class; a module function is replaced in
its module and in every module of the package that imported it by name (`from x import f`),
and in the registries that hold it (the attention backends of stage 3).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import hypothesis.reporting


class CheckFailed(AssertionError):
    """A property of the task does not hold; the message is the sentence a learner reads."""


class NotWritten(Exception):
    """A stub still raises NotImplementedError."""


class TooSlow(BaseException):
    """A check ran past its time limit (a loop that never ends, most likely). A BaseException,
    so that hypothesis does not catch it and replay the example that hangs."""


def expect(ok, sentence: str) -> None:
    """Fail the running check with `sentence` unless `ok`."""
    if not ok:
        raise CheckFailed(sentence)


# -- finding and replacing the package's function -------------------------------------------------

def resolve(target: str):
    """'minipaged.cache_manager.CacheManager.grow' -> (owner, attribute name, the function):
    owner is the class or the module that holds it."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:-1]:
            owner = getattr(owner, name)
        attr = parts[-1]
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        return owner, attr, fn
    raise ImportError(f"no module in {target}")


def _package_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "minipaged" or name.startswith("minipaged."))]


@contextlib.contextmanager
def stand_in(target: str, fn):
    """While inside, the package calls `fn` wherever it called the function `target` names."""
    owner, attr, original = resolve(target)
    undo = []
    if isinstance(owner, type):
        undo.append((owner, attr, original))
        setattr(owner, attr, fn)
    else:
        for module in _package_modules():
            space = vars(module)
            for name, value in list(space.items()):
                if value is original:
                    undo.append((module, name, value))
                    setattr(module, name, fn)
                elif isinstance(value, dict):            # a registry, e.g. BACKENDS
                    for key, entry in list(value.items()):
                        if isinstance(entry, tuple) and hasattr(entry, "_replace") and \
                                any(field is original for field in entry):
                            swapped = entry._replace(**{f: fn for f, v in entry._asdict().items()
                                                        if v is original})
                            undo.append((value, key, entry))
                            value[key] = swapped
    try:
        yield
    finally:
        for where, name, value in reversed(undo):
            if isinstance(where, dict):
                where[name] = value
            else:
                setattr(where, name, value)


# -- the learner's workspace ----------------------------------------------------------------------

def load_workspace_file(path: Path):
    """Import a workspace file as a module of its own (a fresh copy on every call)."""
    name = f"minipaged_workspace_{path.stem}_{time.monotonic_ns()}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- running a check --------------------------------------------------------------------------------

@dataclass
class Outcome:
    check: str
    passed: bool
    message: str = ""
    seconds: float = 0.0


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TooSlow in the main thread after `seconds` (no limit where signals cannot)."""
    if seconds is None or not hasattr(signal, "SIGALRM"):
        yield
        return

    def ring(*_):
        raise TooSlow()

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _falsifying(text: str) -> str:
    """The 'Falsifying example' part of hypothesis's report, if any."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.startswith(("Falsifying", "Failing")):
            return "\n".join("      " + x for x in lines[i:i + 16])
    return ""


def run_check(check, task, seconds_limit: float | None = 60.0) -> Outcome:
    """Run one check (a function of no arguments) and turn whatever happens into an Outcome
    with a sentence: never a traceback, unless the grader itself broke."""
    report = io.StringIO()
    start = time.perf_counter()
    try:
        with hypothesis.reporting.with_reporter(lambda s: report.write(str(s) + "\n")), \
                time_limit(seconds_limit):
            check()
        return Outcome(check.__name__, True, seconds=time.perf_counter() - start)
    except NotImplementedError as e:
        msg = f"not written yet: {task.id}, see {task.lesson}" if "see lessons/" in str(e) or \
            "not written yet" in str(e) else f"NotImplementedError: {e}"
        return Outcome(check.__name__, False, msg, time.perf_counter() - start)
    except TooSlow:
        msg = f"took longer than {seconds_limit:.0f} s: does a loop never end?"
        notes = []
    except CheckFailed as e:
        msg, notes = str(e), getattr(e, "__notes__", [])
    except Exception as e:                              # the learner's code raised
        msg, notes = raised_where(e), getattr(e, "__notes__", [])
    example = _falsifying(report.getvalue() + "\n" + "\n".join(map(str, notes)))
    if example:
        msg += "\n    the input it failed on (shrunk to the smallest found):\n" + example
    return Outcome(check.__name__, False, msg, time.perf_counter() - start)


def raised_where(e: BaseException) -> str:
    """`ValueError: ... (at your line 12: x = y[3])` — the innermost frame of the workspace,
    or of the package, in one line."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if "minipaged_workspace" in (f.filename or "") or
            "/workspace" in (f.filename or "") or f.filename.endswith(".py") and
            "exercises" not in f.filename and "hypothesis" not in f.filename]
    where = ""
    if mine:
        f = mine[-1]
        where = f" (raised at {Path(f.filename).name}:{f.lineno}: {(f.line or '').strip()})"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}{where}"
