"""Stage 5: the benchmark's trace and servers, and the scheduling drawings."""

import matplotlib
import pytest
import torch
from conftest import tiny_model

from minipaged import viz
from minipaged.benchmarks import serving as bench
from minipaged.kv_budget import bytes_per_block
from minipaged.engine import StepRecord

matplotlib.use("Agg")


def test_the_trace_has_sharegpts_means_scaled_down():
    trace, limit = bench.sharegpt_like_trace(4000, scale=4, seed=1)
    assert limit == 512
    mean_in = sum(len(p) for p, _ in trace) / len(trace)
    mean_out = sum(o for _, o in trace) / len(trace)
    # Geometric draws; cutting the few longer than 512 pulls the output mean down a little.
    assert 161.31 / 4 * 0.93 < mean_in < 161.31 / 4 * 1.07
    assert 337.99 / 4 * 0.88 < mean_out < 337.99 / 4 * 1.05
    assert all(len(p) + o <= limit and len(p) >= 1 and o >= 1 for p, o in trace)
    assert bench.sharegpt_like_trace(4000, scale=4, seed=1)[0] == trace


def test_three_servers_do_the_same_work_within_one_budget():
    torch.set_num_threads(1)
    model = tiny_model(dtype=torch.float32, max_seq_len=512)
    trace, limit = bench.sharegpt_like_trace(12, scale=16, vocab=512, seed=0)
    per_token = bytes_per_block(1, 2, 16, torch.float32, n_layers=2)
    a, b, c = bench.run_all(model, trace, 3 * limit * per_token, limit, block_size=4)
    assert a.generated_tokens == b.generated_tokens == c.generated_tokens == \
        sum(o for _, o in trace)
    assert a.max_concurrent == 3 and a.preemptions == 0     # 3 reserved rows, never more
    assert c.max_concurrent > 3                             # the same memory holds more
    table = bench.results_table([a, b, c], "t")
    assert table.row_count == 5


def test_timeline_runs_and_drawings():
    hist = [StepRecord(0, {0: "running"}, {0: 1}),
            StepRecord(1, {0: "running", 1: "waiting"}, {0: 2}),
            StepRecord(2, {0: "running", 1: "running"}, {0: 2, 1: 1}, [(1, "recompute")]),
            StepRecord(3, {0: "running", 1: "preempted"}, {0: 3}),
            StepRecord(4, {1: "running"}, {1: 2})]
    assert viz._runs(hist, 0) == [["running", 0, 4]]
    assert viz._runs(hist, 1) == [["waiting", 1, 1], ["running", 2, 1], ["preempted", 3, 1],
                                  ["running", 4, 1]]
    fig = viz.plot_timeline(hist)
    bars = [c for c in fig.axes[0].collections if len(c.get_paths())]
    assert len(bars) == 5                                 # one per run
    fig = viz.plot_pool_over_time(hist, num_blocks=4)
    assert fig.axes[0].get_ylim()[1] == pytest.approx(4 * 1.08)
    assert [t.get_text() for t in fig.axes[0].texts] == ["R"]
