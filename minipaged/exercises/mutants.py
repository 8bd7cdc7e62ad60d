"""Wrong solutions, made on purpose: single-point mutations of a task's reference function.

Each mutant changes one thing in the reference's syntax tree: a comparison flipped (< and <=,
== and !=, ...), an arithmetic operator swapped (+ and -, * and //, ...), an integer constant
moved by one, a boolean negated (and/or swapped), one statement deleted, two neighbouring
statements swapped where one touches what the other does (a check moved after the work it
guards), or a call skipped (replaced by
one of its arguments: `check_new(self, seq_id)` -> `seq_id`, `self.blocks_for(n)` -> `n`). A mutant is
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
from .stubs import module_of, source_of
from .tasks import Task

COMPARE = {ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.GtE], ast.Gt: [ast.GtE, ast.Lt],
           ast.GtE: [ast.Gt, ast.LtE], ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq],
           ast.In: [ast.NotIn], ast.NotIn: [ast.In], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is]}
ARITH = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.FloorDiv, ast.Add],
         ast.FloorDiv: [ast.Mult, ast.Mod], ast.Div: [ast.Mult], ast.Mod: [ast.FloorDiv],
         ast.MatMult: [ast.Mult]}

# task id -> {mutant description: why it cannot change what the function does}
EQUIVALENT: dict[str, dict[str, str]] = {
    "9.apply": {
        "line 6: swapped with the next statement `out.update({s: list(b) for s, b in "
        "changes['replaced'].items`":
            "step_changes never lists a sequence both as appended and as replaced",
    },
    "4.split": {
        "line 10: swapped with the next statement `used_some_day = np.minimum(allocated, final)`":
            "np.minimum of the lists gives the same numbers as of the int64 arrays",
    },
    "2.free": {
        "line 5: swapped with the next statement `self._table[s, :self._held[s]] = PAD_BLOCK`":
            "`blocks` is a list copied from the row before either runs",
    },
    "5.admit": {
        "line 5: swapped with the next statement `need = self.blocks_for(req.num_tokens)`":
            "`self.group(req)` and `self.blocks_for(...)` only read the scheduler",
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
    "6.fork": {
        "line 5: swapped with the next statement `self.refs[self._table[p, :k]] += 1`":
            "the counts are raised through the parent's row, which the copy into the child's "
            "row does not change",
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
        "line 11: deleted `freed = 0`": "the loop over cache.managers sets freed, and a cache has "
                                       "one manager per layer, so at least one (ModelArgs "
                                       "refuses n_layers < 1)",
        "line 11: constant 0 -> 1": "the same first value of freed, always overwritten",
        "line 11: constant 0 -> -1": "the same first value of freed, always overwritten",
        "line 12: swapped with the next statement `hashes = getattr(cache, 'hashes', {}).get(s)`":
            "the loop over layers never touches cache.hashes; the names are cut after both",
        "line 13: swapped with the next statement `if not 0 <= num_tokens <= int(m._lens[s]):`":
            "reading held and keep changes nothing, so the refusal still comes first",
    },
    "6b.reorder": {
        "line 3: swapped with the next statement `for i, b in enumerate(self.beams):`":
            "only the contiguous cache takes the first branch, and there copy_rows rewrites "
            "every row it keeps: freeing the pruned rows first changes nothing it reads",
    },
    "3b.walk": {
        "line 13: swapped with the next statement `m = torch.full((R,), float('-inf'), dtype=work, device=rows.`":
            "`m` reads only rows.device, which `rows.to(work)` does not change",
        "line 2: constant 0 -> 1": "`who=(0, 0)` is a default no caller relies on: it only "
                                   "labels trace steps, and every caller that traces passes it",
        "line 2: constant 0 -> -1": "the same default of `who`, never used unlabelled",
    },
}


def _root(node) -> str:
    """`self._table[s, :k]` -> 'self._table', `blocks` -> 'blocks': what an expression names."""
    while isinstance(node, (ast.Subscript, ast.Starred)):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


# modules whose functions the references call without changing their arguments, and methods
# that only read their object
PURE_MODULES = {"torch", "np", "math", "random"}
READ_ONLY_METHODS = {"sum", "to", "max", "min", "tolist", "numpy", "clone", "view", "reshape",
                     "long", "float", "double", "item", "index_select", "gather", "masked_fill",
                     "get", "nonzero", "all", "any", "exp", "size", "float", "int", "copy",
                     "unsqueeze", "expand", "narrow", "flatten", "argmax", "keys", "values",
                     "items"}


def _touches(stmt):
    """(what a statement writes, what it reads), as roots. A method call may change its object
    (a method of self: anything of self, 'self.*'), a plain function call anything it is given;
    the functions of PURE_MODULES and READ_ONLY_METHODS change nothing."""
    writes, reads = set(), set()
    for n in ast.walk(stmt):
        if isinstance(n, (ast.Name, ast.Attribute, ast.Subscript)):
            root = _root(n)
            if root:
                (writes if isinstance(getattr(n, "ctx", None), (ast.Store, ast.Del)) else
                 reads).add(root)
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Name):
                given = {_root(a) for a in n.args}
            elif n.func.attr in READ_ONLY_METHODS or _root(n.func.value) in PURE_MODULES:
                given = set()
            else:
                given = {_root(n.func.value)}
            writes |= {g for g in given if g}
            if "self" in given:
                writes.add("self.*")
    return writes, reads


def _dependent(a, b) -> bool:
    """Whether swapping statements a and b can change anything: one writes what the other
    reads or writes (statements that touch different arrays are not mutated by a swap)."""
    (wa, ra), (wb, rb) = _touches(a), _touches(b)

    def clash(w, other):
        return any(x == y or "self.*" in (x, y) and (x.startswith("self") and y.startswith("self"))
                   for x in w for y in other)
    return clash(wa, rb | wb) or clash(wb, ra)


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
        if isinstance(n, ast.Call) and not isinstance(n.func, ast.Name) or \
                isinstance(n, ast.Call) and n.func.id not in ("range", "len", "int", "list",
                                                              "zip", "min", "max", "sum"):
            for k, a in enumerate(n.args):
                if isinstance(a, ast.Name) and a.id != "self":
                    out.append((f"line {line}: `{ast.unparse(n)[:60]}` -> `{a.id}` (the call "
                                f"skipped)", (i, "unwrap", k, None)))
        if isinstance(n, (ast.FunctionDef, ast.For, ast.While, ast.If, ast.With)):
            for field in ("body", "orelse"):
                stmts = getattr(n, field, None) or []
                for k, s in enumerate(stmts):
                    if n is func and k == 0 and isinstance(s, ast.Expr) and \
                            isinstance(s.value, ast.Constant):
                        continue                             # the docstring
                    out.append((f"line {s.lineno - func.lineno + 1}: deleted "
                                f"`{ast.unparse(s).splitlines()[0][:60]}`", (i, "del", (field, k), None)))
                    if k + 1 < len(stmts) and _dependent(s, stmts[k + 1]):
                        out.append((f"line {s.lineno - func.lineno + 1}: swapped with the next "
                                    f"statement `{ast.unparse(stmts[k + 1]).splitlines()[0][:60]}`",
                                    (i, "swap", (field, k), None)))
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
    elif kind == "unwrap":
        parent = next(p for p in ast.walk(tree) for f, v in ast.iter_fields(p)
                      if v is n or (isinstance(v, list) and any(x is n for x in v)))
        for f, v in ast.iter_fields(parent):
            if v is n:
                setattr(parent, f, n.args[arg])
            elif isinstance(v, list):
                for j, x in enumerate(v):
                    if x is n:
                        v[j] = n.args[arg]
    elif kind == "swap":
        field, k = arg
        stmts = getattr(n, field)
        stmts[k], stmts[k + 1] = stmts[k + 1], stmts[k]
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


def time_limits(task: Task) -> list[float]:
    """Seconds each of the task's checks may run on a mutant: ten times what it takes on the
    reference (at least 1 s), so that a mutant that loops forever is stopped soon."""
    out = []
    for check in task.checks:
        start = time.perf_counter()
        run_check(check, task, None)
        out.append(max(1.0, 10 * (time.perf_counter() - start)))
    return out


def kills(task: Task, fn, seconds_limit=6.0) -> str | None:
    """The first check that fails with `fn` standing in (its sentence), or None if all pass.
    `seconds_limit`: one limit for every check, or a list of one per check."""
    limits = seconds_limit if isinstance(seconds_limit, list) else \
        [seconds_limit] * len(task.checks)
    checks.common.SHRINK = False
    try:
        with stand_in(task.target, fn):
            for check, limit in zip(task.checks, limits):
                outcome = run_check(check, task, limit)
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
    limits = time_limits(task)
    for desc, fn in chosen:
        reason = kills(task, fn, limits)
        if reason:
            killed += 1
        elif desc in known:
            equivalent.append((desc, known[desc]))
        else:
            survivors.append(desc)
        if progress:
            progress(desc, reason)
    return killed, survivors, equivalent, len(chosen), time.perf_counter() - start
