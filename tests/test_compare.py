"""`minipaged.exercises.compare`, the notebooks' "Build it" cell: it never passes the package's
code off as the learner's. With no workspace folder, `yours` is a sentence saying so and only the
reference is drawn; with untouched stubs, `yours` is the stub's "not written yet" sentence."""

import matplotlib

matplotlib.use("Agg")

from minipaged.cache_manager import CacheManager  # noqa: E402
from minipaged.exercises import compare  # noqa: E402
from minipaged.exercises.stubs import start  # noqa: E402


def test_no_workspace_says_so_and_draws_only_the_reference(tmp_path):
    yours, reference, figures = compare("2", tmp_path / "nowhere")
    assert isinstance(yours, str) and yours.startswith("no workspace at ")
    assert "python -m minipaged.exercises start" in yours
    assert isinstance(reference, CacheManager)
    assert [f.axes[0].get_title() for f in figures] == ["the reference's blocks"]


def test_untouched_stubs_say_not_written_and_draw_only_the_reference(tmp_path):
    start(tmp_path)
    yours, reference, figures = compare("2", tmp_path)
    assert isinstance(yours, str) and "not written yet" in yours
    assert len(figures) == 1


def test_stage_7_gives_the_tokens_and_what_speculation_did(tmp_path):
    """The reference's tokens with speculation are the no-cache forward's; drafts were proposed
    and some accepted; untouched stubs say "not written yet"."""
    from minipaged.exercises import checks
    start(tmp_path)
    yours, reference, figures = compare("7", tmp_path)
    assert isinstance(yours, str) and yours.startswith("not written yet: 7.propose")
    assert reference["tokens"] == [t[:10] for t in checks.stage7._no_cache_continuations(14)]
    stats = reference["stats"]
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens <= stats.draft_tokens
    assert figures == []
