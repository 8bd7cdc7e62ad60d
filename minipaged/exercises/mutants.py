"""Wrong solutions, made on purpose: single-point mutations of a task's reference function.

Each mutant changes one thing in the reference's syntax tree: a comparison flipped (< and <=,
== and !=, ...), an arithmetic operator swapped (+ and -, * and //, ...), an integer constant
moved by one, a boolean negated (and/or swapped), or one statement deleted. A mutant is
compiled in the reference module's namespace and stands in for the reference while the task's
checks run: a mutant that makes a check fail (or raise, or hang) is killed. A survivor that
cannot change behaviour is listed in EQUIVALENT with the reason.
"""

from __future__ import annotations

import ast
import copy
import random
import textwrap
import time

from . import checks
from .grader import run_check, stand_in
from .stubs import function_node, module_of, source_of
from .tasks import Task

COMPARE = {ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.GtE], ast.Gt: [ast.GtE, ast.Lt],
           ast.GtE: [ast.Gt, ast.LtE], ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq],
           ast.In: [ast.NotIn], ast.NotIn: [ast.In], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is]}
ARITH = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.FloorDiv, ast.Add],
         ast.FloorDiv: [ast.Mult, ast.Mod], ast.Div: [ast.Mult], ast.Mod: [ast.FloorDiv],
         ast.MatMult: [ast.Mult]}

# task id -> {mutant description: why it cannot change what the function does}
EQUIVALENT: dict[str, dict[str, str]] = {
    "5.admit": {
        "line 7: `Sub` -> `Add` in `self.max_num_seqs - len(self.running)`":
            "the engine builds its cache with max_num_seqs rows, and a swapped request keeps its "
            "row, so len(free_rows) <= max_num_seqs - len(running) always: the min is free_rows "
            "either way",
    },
    "5b.admissible": {
        "line 6: `Gt` -> `GtE` in `n > 0`": "at n = 0 one more pass sets n below 0, which "
                                            "ends the loop, and max(n, 0) returns 0 as before",
        "line 6: constant 0 -> -1": "`n > -1` is `n >= 0`: the same as the entry above",
    },
    "6.cow": {
        "line 4: `LtE` -> `Lt` in `self.refs.max(initial=0) <= 1`":
            "a shortcut: with no count above 1 the loop finds no shared block either",
        "line 4: constant 1 -> 0": "`refs.max() <= 0`: the same shortcut taken less often",
        "line 4: constant 0 -> 1": "`initial=` only matters for an empty pool, which no "
                                   "manager has (num_blocks >= 1)",
        "line 4: constant 0 -> -1": "the same `initial=`, never used",
        "line 8: `Gt` -> `GtE` in `self.refs[last] > 1`":
            "the loop copies only where left[b] > 1, so a block held by one table is never "
            "copied either way",
        "line 8: constant 1 -> 0": "`refs[last] > 0`: the same as the entry above",
        "line 7: constant 0 -> -1": "np.maximum(held - 1, -1) differs only for a row holding "
                                    "no block, whose length is 0, which is never partial",
    },
    "7.propose": {
        "line 1: constant 1 -> 0": "a default min_n of 0 only adds a try with n = 0, whose 'tail' "
                                   "tokens[-0:] is the whole list: no earlier empty slice equals "
                                   "a non-empty list, and an empty list tries no n at all",
        "line 6: `Sub` -> `Add` in `len(tokens) - 1`":
            "it only lets n reach len(tokens) or len(tokens) + 1, where no start lies before the "
            "tail (the inner range is empty), so those n find nothing and the loop goes on",
        "line 6: constant 1 -> 0": "n = len(tokens): the same empty inner range as the entry "
                                   "above",
        "line 8: constant 1 -> 2": "the inner range's stop -1 -> -2 adds start = -1, where "
                                   "tokens[-1:n - 1] is empty (n <= len(tokens) - 1), so it "
                                   "never matches a tail of n >= 1 tokens",
    },
    "7.rollback": {
        "line 6: deleted `freed = 0`": "the loop over cache.managers sets freed, and a cache has "
                                       "one manager per layer, so at least one (ModelArgs "
                                       "refuses n_layers < 1)",
        "line 6: constant 0 -> 1": "the same first value of freed, always overwritten",
        "line 6: constant 0 -> -1": "the same first value of freed, always overwritten",
    },
    "3b.walk": {
        "line 2: constant 0 -> 1": "`who=(0, 0)` is a default no caller relies on: it only "
                                   "labels trace steps, and every caller that traces passes it",
        "line 2: constant 0 -> -1": "the same default of `who`, never used unlabelled",
    },
}


def _sites(tree):
    """Every mutation point: (description, a function that applies it to a copied tree)."""
    func = tree.body[0]
    nodes = list(ast.walk(func))
    out = []
    for i, n in enumerate(nodes):
        line = getattr(n, "lineno", 0) - func.lineno + 1
        if isinstance(n, ast.Compare):
            for k, op in enumerate(n.ops):
                for new in COMPARE.get(type(op), []):
                    out.append((f"line {line}: `{type(op).__name__}` -> `{new.__name__}` in "
                                f"`{ast.unparse(n)}`", (i, "cmp", k, new)))
        elif isinstance(n, (ast.BinOp, ast.AugAssign)):
            for new in ARITH.get(type(n.op), []):
                out.append((f"line {line}: `{type(n.op).__name__}` -> `{new.__name__}` in "
                            f"`{ast.unparse(n)}`", (i, "arith", 0, new)))
        elif isinstance(n, ast.Constant) and type(n.value) is int:
            for d in (1, -1):
                out.append((f"line {line}: constant {n.value} -> {n.value + d}", (i, "const", d, None)))
        elif isinstance(n, ast.BoolOp):
            new = ast.Or if isinstance(n.op, ast.And) else ast.And
            out.append((f"line {line}: `{type(n.op).__name__}` -> `{new.__name__}` in "
                        f"`{ast.unparse(n)[:60]}`", (i, "bool", 0, new)))
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            out.append((f"line {line}: `not` dropped in `{ast.unparse(n)[:60]}`", (i, "not", 0, None)))
        if isinstance(n, (ast.FunctionDef, ast.For, ast.While, ast.If, ast.With)):
            for field in ("body", "orelse"):
                stmts = getattr(n, field, None) or []
                for k, s in enumerate(stmts):
                    if n is func and k == 0 and isinstance(s, ast.Expr) and \
                            isinstance(s.value, ast.Constant):
                        continue                             # the docstring
                    out.append((f"line {s.lineno - func.lineno + 1}: deleted "
                                f"`{ast.unparse(s).splitlines()[0][:60]}`", (i, "del", (field, k), None)))
    return out


def _apply(tree, site):
    tree = copy.deepcopy(tree)
    nodes = list(ast.walk(tree.body[0]))
    i, kind, arg, new = site
    n = nodes[i]
    if kind == "cmp":
        n.ops[arg] = new()
    elif kind == "arith":
        n.op = new()
    elif kind == "const":
        n.value = n.value + arg
    elif kind == "bool":
        n.op = new()
    elif kind == "not":
        parent = next(p for p in ast.walk(tree) for f, v in ast.iter_fields(p)
                      if v is n or (isinstance(v, list) and any(x is n for x in v)))
        for f, v in ast.iter_fields(parent):
            if v is n:
                setattr(parent, f, n.operand)
            elif isinstance(v, list):
                for j, x in enumerate(v):
                    if x is n:
                        v[j] = n.operand
    elif kind == "del":
        field, k = arg
        stmts = getattr(n, field)
        del stmts[k]
        if not stmts or (field == "body" and n is tree.body[0] and len(stmts) == 1 and
                         isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant)):
            stmts.append(ast.Pass())
    return ast.fix_missing_locations(tree)


def mutants(task: Task):
    """(description, function) for every mutant of the task's reference."""
    src = source_of(task)
    tree = ast.parse(textwrap.dedent(src))
    tree.body[0].decorator_list = []
    module = module_of(task)
    out = []
    for desc, site in _sites(tree):
        mutated = _apply(tree, site)
        code = compile(mutated, f"<mutant of {task.target}>", "exec")
        space = dict(vars(module))
        exec(code, space)
        out.append((desc, space[tree.body[0].name]))
    return out


def kills(task: Task, fn, seconds_limit: float = 6.0) -> str | None:
    """The first check that fails with `fn` standing in (its sentence), or None if all pass."""
    checks.common.SHRINK = False
    try:
        with stand_in(task.target, fn):
            for check in task.checks:
                outcome = run_check(check, task, seconds_limit)
                if not outcome.passed:
                    return f"{check.__name__}: {outcome.message.splitlines()[0]}"
    finally:
        checks.common.SHRINK = True
    return None


def score(task: Task, limit: int | None = None, seed: int = 0, progress=None):
    """Run the task's mutants (all, or a seeded sample of `limit`). Returns (killed, survivors,
    equivalent, total run, seconds)."""
    all_mutants = mutants(task)
    chosen = all_mutants if limit is None or limit >= len(all_mutants) else \
        random.Random(seed).sample(all_mutants, limit)
    killed, survivors, equivalent = 0, [], []
    start = time.perf_counter()
    known = EQUIVALENT.get(task.id, {})
    for desc, fn in chosen:
        reason = kills(task, fn)
        if reason:
            killed += 1
        elif desc in known:
            equivalent.append((desc, known[desc]))
        else:
            survivors.append(desc)
        if progress:
            progress(desc, reason)
    return killed, survivors, equivalent, len(chosen), time.perf_counter() - start
