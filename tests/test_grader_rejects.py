"""A grader is proven by the wrong answers it rejects, and by the right answers it accepts.

Each plausible bug of `exercise_bugs.BUGS` (a reserve or grow that takes blocks before it
checks, an id that is never checked, a wrong count, copy-on-write or chunk sizes judged wrongly,
drafts from the wrong match) is planted in the task's reference, as a learner's workspace file
would be, and the task's checks must fail it with a sentence that names the problem, never a
traceback. Each differently-shaped correct solution of `exercise_bugs.ALTERNATIVES`, one for
every task (another loop, `rng.randrange` for the uniform draw), must pass every check of its
task.
"""

import textwrap

import pytest

from exercise_bugs import ALTERNATIVES, BUGS
from minipaged.exercises.grader import run_check, stand_in
from minipaged.exercises.stubs import module_of
from minipaged.exercises.tasks import BY_ID


def planted(task, source):
    """The function `source` defines, compiled in the module of the task's reference."""
    space = dict(vars(module_of(task)))
    exec(textwrap.dedent(source), space)
    return space[task.name]


def failures(task_id, source):
    task = BY_ID[task_id]
    with stand_in(task.target, planted(task, source)):
        return [o for o in (run_check(c, task) for c in task.checks) if not o.passed]


@pytest.mark.parametrize("name", BUGS)
def test_the_grader_rejects_a_plausible_bug_with_a_sentence(name):
    task_id, source, words = BUGS[name]
    failed = failures(task_id, source)
    assert failed, f"{task_id}: the bug '{name}' passes every check"
    sentence = failed[0].message
    assert words in sentence, f"{name}: {sentence}"
    assert "Traceback" not in sentence and not sentence.startswith(("IndexError", "KeyError"))


@pytest.mark.parametrize("name", ALTERNATIVES)
def test_a_differently_shaped_correct_solution_passes(name):
    task_id, source = ALTERNATIVES[name]
    failed = failures(task_id, source)
    assert not failed, f"{name}: " + "; ".join(f"{o.check}: {o.message}" for o in failed)


def test_every_task_has_a_differently_shaped_correct_solution():
    assert {v[0] for v in ALTERNATIVES.values()} == set(BY_ID)
    assert {v[0] for v in BUGS.values()} >= {"2.reserve", "2.grow", "2.free", "6.cow",
                                            "5b.admissible", "7.propose"}
