"""`minipaged.exercises.compare`, the notebooks' "Build it" cell: it never passes the package's
code off as the learner's. With no workspace folder, `yours` is a sentence saying so and only the
reference is drawn; with untouched stubs, the stub's "not written yet" sentence; with code that
raises, one sentence naming the error and the learner's line. Stage 2 runs three scenarios (an
exact fill, refusals, a free) and draws every block table: each planted bug of stage 2 makes
what it shows differ from the reference's."""

import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

sys.path.insert(0, str(Path(__file__).parent))

from exercise_bugs import ALTERNATIVES, BUGS  # noqa: E402
from minipaged.exercises import checks, compare  # noqa: E402
from minipaged.exercises.compare import find_workspace  # noqa: E402
from minipaged.exercises.stubs import source_of, start  # noqa: E402
from minipaged.exercises.tasks import BY_ID  # noqa: E402

STAGE2 = ("2.take", "2.reserve", "2.grow", "2.free")
SCENARIOS = 3


def test_no_workspace_says_so_and_draws_only_the_reference(tmp_path):
    yours, reference, figures = compare("2", tmp_path / "nowhere")
    assert isinstance(yours, str) and yours.startswith("no workspace at ")
    assert "python -m minipaged.exercises start" in yours
    assert len(reference) == SCENARIOS and all(isinstance(v, list) for v in reference.values())
    assert [f.axes[0].get_title() for f in figures] == \
        [f"the reference's blocks: {name}" for name in reference]


def test_the_scenarios_fill_the_pool_exactly_refuse_and_free():
    _, reference, _ = compare("2", draw=False)
    calls = [c for run in reference.values() for c in run]
    assert any(c.endswith("refused: OutOfBlocksError") for c in calls)
    assert any(c.startswith("grow") and c.endswith("refused: RequestError") for c in calls)
    assert any(c.startswith("free") and c.endswith("refused: RequestError") for c in calls)
    fill = reference["an exact fill: every block full"]
    taken = sum(len(eval(c.split(" -> ")[1])) for c in fill if c.startswith("reserve"))
    assert taken == 12 and fill[-1] == "grow([0, 2], 2) -> 0"


def test_the_workspace_is_found_here_or_one_folder_up(tmp_path, monkeypatch):
    (tmp_path / "workspace").mkdir()
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert find_workspace() == tmp_path / "workspace"
    monkeypatch.chdir(tmp_path)
    assert find_workspace() == tmp_path / "workspace"


def test_untouched_stubs_say_not_written_and_draw_only_the_reference(tmp_path):
    start(tmp_path)
    yours, reference, figures = compare("2", tmp_path)
    assert isinstance(yours, str) and "not written yet" in yours
    assert len(figures) == SCENARIOS


def _workspace(tmp_path, sources: dict):
    """A stage 2 workspace: the stub file's imports, then each task's function: `sources[id]`
    or the reference's own."""
    start(tmp_path)
    path = tmp_path / BY_ID["2.take"].file
    head = path.read_text().split("\n# 2.take")[0]
    body = "\n".join(sources.get(t, source_of(BY_ID[t])) for t in STAGE2)
    path.write_text(head + "\n" + body)
    return tmp_path


def test_a_correct_workspace_matches_the_reference(tmp_path):
    alternatives = {v[0]: v[1] for v in ALTERNATIVES.values() if v[0] in STAGE2[1:]}
    yours, reference, figures = compare("2", _workspace(tmp_path, alternatives))
    assert yours == reference and len(figures) == 2 * SCENARIOS


@pytest.mark.parametrize("name", [n for n, v in BUGS.items() if v[0] in STAGE2])
def test_every_planted_bug_of_stage_2_shows(name, tmp_path):
    task_id, source, _ = BUGS[name]
    yours, reference, _ = compare("2", _workspace(tmp_path, {task_id: source}), draw=False)
    assert yours != reference, f"{name}: compare shows the reference's calls"


def test_code_that_raises_is_one_sentence_beside_the_reference(tmp_path):
    broken = '''
def free(self, seq_id):
    return self._table[check_one(self, seq_id), 99]
'''
    yours, reference, figures = compare("2", _workspace(tmp_path, {"2.free": broken}))
    assert yours.startswith("your code raised IndexError") and "99" in yours
    assert "\n" not in yours and "Traceback" not in yours
    assert [f.axes[0].get_title().startswith("the reference's") for f in figures] == \
        [True] * SCENARIOS


def test_stage_7_gives_the_tokens_and_what_speculation_did(tmp_path):
    """The reference's tokens with speculation are the no-cache forward's; drafts were proposed
    and some accepted; untouched stubs say "not written yet"."""
    start(tmp_path)
    yours, reference, figures = compare("7", tmp_path)
    assert isinstance(yours, str) and yours.startswith("not written yet: 7.propose")
    assert reference["tokens"] == [t[:10] for t in checks.stage7._no_cache_continuations(14)]
    stats = reference["stats"]
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens <= stats.draft_tokens
    assert figures == []


def test_stage_6_runs_its_scenarios_and_shows_a_cow_bug(tmp_path):
    """Stage 6's scenarios fork, copy-on-write, fill the pool exactly and refuse; a
    copy-on-write that copies for every sharer (the last writer too) shows in what it returns."""
    _, reference, figures = compare("6", tmp_path / "nowhere")
    calls = [c for name, run in reference.items() if name != "samples" for c in run]
    assert any(c.startswith("fork") and c.endswith("refused: RequestError") for c in calls)
    assert any(c.endswith("refused: OutOfBlocksError") for c in calls)
    assert len(figures) == 3
    start(tmp_path)
    path = tmp_path / BY_ID["6.cow"].file
    text = path.read_text()
    head = text.split("\n# 6.fork")[0]
    bug = BUGS["cow: copies every sharer, the last writer too"][1]
    path.write_text(head + "\n" + "\n".join(
        bug if t == "6.cow" else source_of(BY_ID[t]) for t in ("6.fork", "6.cow", "6.hash")))
    yours, reference, _ = compare("6", tmp_path, draw=False)
    assert not isinstance(yours, str) and yours != reference
