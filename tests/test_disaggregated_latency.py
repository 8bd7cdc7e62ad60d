"""Stage 9b's latency benchmark: the same trace colocated and disaggregated gives the no-paging
tokens both ways, and its timelines count what they say. The long prompt runs in chunks of the
budget on the colocated engine, and never on the disaggregated decode engine, which computes
only each prompt's last block (its times are the benchmark's to measure, not a test's)."""

from pathlib import Path

import matplotlib
import torch
from conftest import tiny_model

from minipaged import generate
from minipaged.benchmarks import disaggregated_latency as bench
from minipaged.viz import plot_step_times

matplotlib.use("Agg")


def test_both_servers_give_the_no_paging_tokens_and_honest_timelines():
    model = tiny_model(dtype=torch.float32, max_seq_len=256)
    trace = bench.chats_and_long_prompts(chats=2, chat_prompt=9, chat_tokens=12, long_prompt=150,
                                         long_tokens=3, long_every=6, vocab=512)
    assert [a for _, _, a in trace] == [0, 0, 3, 9]            # two long prompts, while chats run
    expected = [generate(model, [p], n, stop_tokens=[])[0] for p, n, _ in trace]
    colo = bench.colocated(model, trace, 2, 32, 16)
    dis = bench.disaggregated(model, trace, 2, 16)
    for run in (colo, dis):
        assert run.outputs == expected, run.name
        assert len(run.step_start) == len(run.step_seconds) == len(run.step_tokens)
        assert len(run.arrivals) == 2 and len(run.gaps) == 2 * (12 - 1)
        assert run.step_start == sorted(run.step_start) and min(run.step_seconds) > 0
    assert max(colo.step_tokens) == 32                         # the budget's chunks
    assert sum(colo.step_tokens) >= 2 * 150                    # the long prompts ran here
    assert max(dis.step_tokens) <= 2 + 2 * 16                  # decodes and last blocks only
    assert sum(dis.step_tokens) < 150
    fig = plot_step_times([colo, dis], "a CPU")
    assert len(fig.axes) == 2 and "worst gap" in fig.axes[1].get_title(loc="left")


def test_the_recorded_run_is_the_one_the_benchmarks_page_quotes():
    """Notebook 09b draws `disaggregated_latency.json`; the benchmarks page quotes its worst
    gaps (the table's medians, and its timeline, are the same run's: its last round)."""
    page = (Path(__file__).resolve().parents[1] / "lessons" / "benchmarks.md").read_text()
    rec = bench.recorded()
    assert rec["cpu"] in page and len(rec["runs"]) == 2
    for run in rec["runs"]:
        assert f"| {run.name} |" in page
        assert f"{1e3 * run.worst_gap:.0f} ms" in page or f"{1e3 * run.worst_gap:.1f}" in page
        assert len(run.step_seconds) == len(run.step_tokens) and run.arrivals
