"""Stage 5b's drawings and benchmark: the step counts they read, checked on hand-made histories
and small runs."""

import matplotlib
import torch
from conftest import tiny_model

from minipaged import viz
from minipaged.benchmarks import chunked_latency as bench
from minipaged.engine import StepRecord

matplotlib.use("Agg")

# Request 0 decodes every step; request 1 arrives at step 1 and runs its 10-token prompt in two
# chunks (steps 1 and 2), then decodes at step 3 (its first token was sampled at step 2).
HISTORY = [StepRecord(0, {0: "running"}, decoded=[0]),
           StepRecord(1, {0: "running", 1: "running"}, decoded=[0], prefilled={1: 6}),
           StepRecord(2, {0: "running", 1: "running"}, decoded=[0], prefilled={1: 4}),
           StepRecord(3, {0: "running", 1: "running"}, decoded=[0, 1]),
           StepRecord(4, {1: "running"}, decoded=[1])]


def test_gaps_and_first_tokens_count_the_tokens_in_between():
    assert [viz.step_tokens(rec) for rec in HISTORY] == [1, 7, 5, 2, 1]
    assert viz.token_gaps(HISTORY, 0) == [7, 5, 2]       # the steps after each of its tokens
    assert viz.token_gaps(HISTORY, 1) == [1]
    assert viz.time_to_first_token(HISTORY, 1) == 7 + 5   # arrival (step 1) to its last chunk


def test_the_drawings_draw_every_slice():
    fig = viz.plot_token_budget([("no budget", HISTORY, None), ("budget 8", HISTORY, 8)])
    ax = fig.axes[0]
    assert len(ax.patches) == sum(len(r.decoded) + len(r.prefilled) for r in HISTORY)
    assert [p.get_hatch() for p in ax.patches].count(viz.CHUNK_HATCH) == 2
    assert any(line.get_ydata()[0] == 8 for line in fig.axes[1].lines)
    fig = viz.plot_token_latency({"a": HISTORY, "b": HISTORY[:4]}, req_ids=[0])
    assert [p.get_height() for p in fig.axes[1].patches] == [7, 7]


def test_the_benchmark_serves_its_trace_under_each_budget():
    torch.set_num_threads(1)
    model = tiny_model(dtype=torch.float32, max_seq_len=512)
    trace = bench.chats_and_long_prompts(chats=3, chat_prompt=5, chat_tokens=12, long_prompt=40,
                                         long_tokens=2, long_every=6, vocab=512)
    assert [(len(p), n, a) for p, n, a in trace] == [(5, 12, 0)] * 3 + [(40, 2, 3), (40, 2, 9)]
    servers = [[bench.serve(model, trace, b, chats=3, block_size=4)] for b in (None, 16)]
    whole, chunked = servers[0][0], servers[1][0]
    assert whole.max_step_tokens == 40 + 3 and chunked.max_step_tokens == 16
    assert len(whole.inter_token) == len(chunked.inter_token) == 3 * 11
    assert whole.generated_tokens == chunked.generated_tokens == 3 * 12 + 2 * 2
    assert bench.results_table(servers, "t").row_count == 2


def test_the_benchmark_cli_refuses_a_bad_budget(capsys):
    assert bench.main(["--random-model", "--budgets", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: argument --budgets")
