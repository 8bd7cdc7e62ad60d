"""python -m minipaged.exercises list | start [DIR] | check TASK|STAGE|all [--workspace DIR]
[--reference] | mutants [TASK|STAGE|all] [--limit N]"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .grader import load_workspace_file, run_check, stand_in
from .mutants import score
from .stubs import start
from .tasks import STAGES, TASKS, select


def error(sentence: str) -> int:
    print(f"error: {sentence}", file=sys.stderr)
    return 2


def cmd_list() -> int:
    for t in TASKS:
        print("\t".join((t.id, t.stage, t.file, t.target, t.what)))
    return 0


def cmd_start(directory: str) -> int:
    path = Path(directory)
    if path.exists() and not path.is_dir():
        return error(f"{path} is a file; give a folder for the workspace")
    for name, what in start(path):
        print(f"{what}: {path / name}")
    print(f"next: python -m minipaged.exercises check 1 --workspace {path}")
    return 0


def _targets(what: str):
    try:
        return select(what)
    except KeyError:
        return None


def cmd_check(what: str, workspace: str, reference: bool) -> int:
    tasks = _targets(what)
    if tasks is None:
        return error(f"no task or stage {what!r}: give a task id (see `list`), a stage "
                     f"({' '.join(STAGES)}) or all")
    folder = Path(workspace)
    if not reference and not folder.is_dir():
        return error(f"no workspace at {folder}: run `python -m minipaged.exercises start "
                     f"{folder}` first, or pass --workspace DIR (or --reference)")
    torch.set_num_threads(1)
    failed = 0
    for t in tasks:
        start = time.perf_counter()
        if reference:
            fn = None
        else:
            path = folder / t.file
            if not path.exists():
                print(f"FAIL {t.id}: {path} is missing (run `start` again: it writes only "
                      f"missing files)")
                failed += 1
                continue
            try:
                module = load_workspace_file(path)
            except Exception as e:                       # a syntax error, a bad import
                print(f"FAIL {t.id}: {path.name} does not load: {type(e).__name__}: {e}")
                failed += 1
                continue
            fn = getattr(module, t.name, None)
            if fn is None:
                print(f"FAIL {t.id}: {path.name} defines no function {t.name}")
                failed += 1
                continue
        outcomes = []
        if fn is None:
            outcomes = [run_check(c, t) for c in t.checks]
        else:
            with stand_in(t.target, fn):
                outcomes = [run_check(c, t) for c in t.checks]
        bad = [o for o in outcomes if not o.passed]
        took = time.perf_counter() - start
        if bad:
            failed += 1
            print(f"FAIL {t.id} ({took:.1f} s)")
            for o in bad:
                print(f"  {o.check}: {o.message}")
        else:
            print(f"ok   {t.id} ({took:.1f} s): {', '.join(o.check for o in outcomes)}")
    print(f"{len(tasks) - failed} of {len(tasks)} task(s) pass"
          + ("" if reference else f" (workspace {folder})"))
    return 0 if not failed else 1


def cmd_mutants(what: str, limit: int | None) -> int:
    tasks = _targets(what)
    if tasks is None:
        return error(f"no task or stage {what!r}")
    torch.set_num_threads(1)
    worst = 1.0
    for t in tasks:
        killed, survivors, equivalent, total, seconds = score(t, limit)
        counted = total - len(equivalent)
        rate = killed / counted if counted else 1.0
        worst = min(worst, rate)
        print(f"{t.id}\t{killed}/{counted} killed ({rate:.0%})\t{len(equivalent)} equivalent"
              f"\t{seconds:.0f} s")
        for s in survivors:
            print(f"  survived: {s}")
        for d, why in equivalent:
            print(f"  equivalent: {d}: {why}")
    return 0 if worst >= 0.95 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipaged.exercises",
                                description="Build minipaged yourself: stubs and a grader.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every task: id, stage, file, the package function, what to write")
    s = sub.add_parser("start", help="write the stub files (never overwrites)")
    s.add_argument("dir", nargs="?", default="workspace")
    c = sub.add_parser("check", help="grade a task, a stage or all")
    c.add_argument("what")
    c.add_argument("--workspace", default="workspace")
    c.add_argument("--reference", action="store_true", help="grade the package's own code")
    m = sub.add_parser("mutants", help="mutation score of the checks, per task")
    m.add_argument("what", nargs="?", default="all")
    m.add_argument("--limit", type=int, default=None, help="a seeded sample of N mutants a task")
    a = p.parse_args(argv)
    if a.cmd == "list":
        return cmd_list()
    if a.cmd == "start":
        return cmd_start(a.dir)
    if a.cmd == "check":
        return cmd_check(a.what, a.workspace, a.reference)
    return cmd_mutants(a.what, a.limit)


if __name__ == "__main__":
    sys.exit(main())
