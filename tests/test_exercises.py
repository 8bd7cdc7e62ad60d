"""The course's grader is itself graded (`minipaged/exercises/`):

  * the package's own code passes every task, and the untouched stubs fail every one, each
    failure saying "not written yet" and naming the lesson section;
  * wrong solutions fail: for every task, every single-point mutation of the reference (an
    operator flipped, a constant moved by one, a statement deleted, two dependent statements
    swapped, a call skipped) is run, and at least 95% of those not proven equivalent must be
    killed by its checks (`python -m minipaged.exercises mutants` prints the same score per
    task; the exercises' README records it);
  * the command line keeps its contract: `list` is tab-separated, `start` never overwrites,
    `check` exits 0 only when every check passes, 1 when one fails, 2 on bad input, and a failure
    is a sentence with the shrunk input, never a traceback.
"""

import ast

import pytest

from minipaged.exercises import STAGES, TASKS
from minipaged.exercises.__main__ import main
from minipaged.exercises.grader import load_workspace_file, resolve, run_check, stand_in
from minipaged.exercises.mutants import EQUIVALENT, mutants, score
from minipaged.exercises.stubs import (body_lines, global_helpers, self_helpers, start,
                                       stub_file)
from minipaged.exercises.tasks import select

IDS = [t.id for t in TASKS]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("workspace")
    start(folder)
    return folder


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_the_reference_passes(task):
    for check in task.checks:
        outcome = run_check(check, task)
        assert outcome.passed, f"{task.id}: {outcome.check}: {outcome.message}"


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_the_untouched_stub_fails_and_says_not_written(task, stubs):
    fn = getattr(load_workspace_file(stubs / task.file), task.name)
    with stand_in(task.target, fn):
        outcomes = [run_check(c, task) for c in task.checks]
    assert any(not o.passed for o in outcomes)
    assert any(o.message.startswith(f"not written yet: {task.id}, see {task.lesson}")
               for o in outcomes)


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_every_mutant_is_killed_or_proven_equivalent_95_percent(task):
    """Every mutant of the task (no sample): at least 95% of those not listed as equivalent
    fail a check, and every listed equivalent one is still a mutant of the reference."""
    killed, survivors, equivalent, total, _ = score(task)
    counted = total - len(equivalent)
    assert total >= 8, f"{task.id} has only {total} mutants"
    assert killed >= 0.95 * counted, f"{task.id}: {killed}/{counted} killed; survivors: {survivors}"
    listed = set(EQUIVALENT.get(task.id, {}))
    assert listed <= {d for d, _ in mutants(task)}, f"{task.id}: stale EQUIVALENT entries"


def test_stand_in_puts_everything_back():
    """Methods, module functions, names imported elsewhere and backend registries return to the
    package's own functions after a check."""
    from minipaged import paged_attention
    before = {t.target: resolve(t.target)[2] for t in TASKS}
    backend = paged_attention.BACKENDS["torch"]
    for t in TASKS:
        with stand_in(t.target, lambda *a, **k: None):
            assert resolve(t.target)[2] is not before[t.target]
    assert {t.target: resolve(t.target)[2] for t in TASKS} == before
    assert paged_attention.BACKENDS["torch"] == backend


def test_tasks_cover_every_stage_in_order_and_name_real_functions():
    assert [t.stage for t in TASKS] == sorted((t.stage for t in TASKS), key=STAGES.index)
    assert {t.stage for t in TASKS} == set(STAGES)
    assert len(set(IDS)) == len(IDS)
    for t in TASKS:
        assert t.id.split(".")[0] == t.stage and callable(resolve(t.target)[2])
        assert 1 <= body_lines(t) <= 40, f"{t.id}: not one sitting"
        assert t.lesson.startswith("lessons/0")
    for name in {t.file for t in TASKS}:     # one function name per file
        names = [t.name for t in TASKS if t.file == name]
        assert len(names) == len(set(names))


def test_a_stub_keeps_the_signature_and_docstring_and_compiles():
    for t in TASKS:
        tree = ast.parse(stub_file([t]))
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
        ref = next(n for n in ast.parse(__import__("inspect").getsource(resolve(t.target)[2])
                                        .strip()).body)
        assert ast.dump(fn.args) == ast.dump(ref.args) and fn.name == ref.name
        assert ast.get_docstring(fn) == ast.get_docstring(ref)
        assert "return" not in ast.unparse(fn.body[-1]) and "NotImplementedError" in ast.unparse(fn.body[-1])


def test_a_stub_documents_every_helper_it_may_call():
    """Each function, constant and attribute the reference uses is listed in its stub with what
    it takes and does (a docstring, or the line of __init__ that sets it): no stub sends the
    learner to the module that holds the answer, and a wrong guess at a helper's arguments is
    not the first thing the learner meets."""
    for t in TASKS:
        text = stub_file([t])
        assert "read them in" not in text, t.id
        for h in global_helpers(t) + self_helpers(t):
            what = h.split(": ", 1)[1] if ": " in h else h.split(" = ", 1)[-1]
            assert what.strip() and (": " in h or " = " in h), f"{t.id}: `{h}` says nothing"
            assert h.split("(")[0].split(":")[0].split(" = ")[0] in text, t.id


def test_list_is_tab_separated(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(TASKS)
    for line, t in zip(lines, TASKS):
        assert line.split("\t") == [t.id, t.stage, t.file, t.target, t.what]


def test_start_never_overwrites_and_says_so(tmp_path, capsys):
    mine = tmp_path / TASKS[0].file
    mine.write_text("# my work\n")
    assert main(["start", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert mine.read_text() == "# my work\n"
    assert f"kept (already there): {mine}" in out and "wrote:" in out


def test_check_grades_a_wrong_solution_with_a_sentence_and_an_input(tmp_path, capsys):
    """A grow that takes one block too many fails: exit 1, the property in words, the shrunk
    input, no traceback. The stubs of the stage fail, and --reference passes (exit 0)."""
    start(tmp_path)
    path = tmp_path / "stage2_cache_manager.py"
    src = path.read_text()
    wrong = ('''
def grow(self, seq_ids, num_new_tokens):
    rows = check_live(self, seq_ids, unique=True)
    n = check_count(num_new_tokens)
    seqs, held, needed = self._crossing(rows, n)
    needed = [k + 1 for k in needed]
    total = sum(needed) - sum(held)
    if seqs:
        check_room(self, seqs, needed, total)
        self._add_blocks(seqs, held, needed)
    self._lens[rows] += n
    return total
''')
    path.write_text(src + wrong)
    assert main(["check", "2.grow", "--workspace", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL 2.grow" in out and "the input it failed on" in out and "Traceback" not in out
    assert "AttributeError" not in out and "blocks" in out     # the bug, not a missing helper
    assert main(["check", "2.grow", "--reference"]) == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["check", "9.nothing", "--reference"]) == 2
    assert capsys.readouterr().err.startswith("error: no task or stage '9.nothing'")
    assert main(["check", "2", "--workspace", str(tmp_path / "absent")]) == 2
    assert "start" in capsys.readouterr().err


def test_select_by_task_stage_and_all():
    assert [t.id for t in select("2")] == ["2.take", "2.reserve", "2.grow", "2.free"]
    assert select("2.grow")[0].id == "2.grow" and len(select("all")) == len(TASKS)
