"""Stage 5b: a token budget per step changes when tokens are computed, never which tokens come
out. Ground truth: each request alone on the contiguous cache (stage 1), and stage 5's engine
for the runs without a budget."""

import dataclasses
import random

import pytest
from conftest import greedy_reference, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import TRACES, trace
from test_sharing_generation import BS, expected, prompts_with_a_system_prompt, run_engine

from minipaged import Engine, RequestError, generate, viz
from minipaged.chunked_engine import ChunkedEngine
from minipaged.engine import Engine as Stage5Engine


def serve(engine_class, block_size, budget, preemption="recompute", **options):
    """test_scheduler's trace for this block size (tight pool, staggered arrivals) on an
    engine; returns the engine after the run."""
    model, reqs, _ = trace(block_size)
    if budget is not None:
        options["max_num_batched_tokens"] = budget
    engine = engine_class(model, TRACES[block_size][2], block_size, preemption, max_num_seqs=8,
                          **options)
    for prompt, n, arrival in reqs:
        engine.add_request(prompt, n, stop_tokens=[], arrival_step=arrival)
    engine.run()
    return engine


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("block_size, budget", [(1, 1), (1, 2), (1, 9), (16, 1), (16, 3),
                                                (16, 17), (16, 200), (256, 64)])
def test_any_budget_gives_exactly_the_tokens_alone(block_size, budget, preemption):
    engine = serve(ChunkedEngine, block_size, budget, preemption, record=True)
    _, _, alone = trace(block_size)
    assert [r.output for r in engine.requests] == alone
    st = engine.stats
    assert st.max_step_tokens <= budget and st.running_max <= budget
    # The pool really was too small — except under a budget of one token: one request runs
    # per step, the oldest, to its end, so the pool never runs dry and nobody is preempted.
    assert st.preemptions >= 2 or budget == 1
    assert max(viz.step_tokens(rec) for rec in engine.history) == st.max_step_tokens
    if budget < 200:                                       # some prompt really was chunked
        assert any(len(p) > budget for p, _, _ in trace(block_size)[1])
    cpu = engine.swap.cpu_managers if engine.swap else []
    for m in engine.cache.managers + cpu:                  # every block back, swap pool empty
        assert m.num_free_blocks == m.num_blocks and not m.live_seq_ids()


def test_without_a_budget_the_engine_is_stage_5s():
    """No budget runs stage 5's steps: same tokens, same statistics, same step by step history,
    and the largest step is a whole prompt plus the decodes beside it."""
    runs = [serve(cls, 16, None, "swap", record=True) for cls in (Stage5Engine, ChunkedEngine,
                                                                     Engine)]
    base = runs[0]
    for other in runs[1:]:
        assert [r.output for r in other.requests] == [r.output for r in base.requests]
        assert dataclasses.replace(other.stats, seconds=0) == \
            dataclasses.replace(base.stats, seconds=0)
        assert other.history == base.history
    longest = max(len(p) for p, _, _ in trace(16)[1])
    assert base.stats.max_step_tokens >= longest


def test_a_long_prompt_no_longer_stalls_the_running_chats():
    """Four chats decode; a 200-token prompt arrives at step 5. Without a budget one step runs
    all 200 tokens beside the four decodes. With a budget of 32 every step runs the four decodes
    and a 28-token chunk: the chats get a token every step, the prompt its first token after
    ceil(200 / 28) = 8 steps — in one model call per step."""
    model = tiny_model(max_seq_len=512)
    rng = random.Random(7)
    chats = [[rng.randrange(512) for _ in range(6)] for _ in range(4)]
    long_prompt = [rng.randrange(512) for _ in range(200)]
    runs = {}
    for budget in (None, 32):
        calls = []
        hook = model.register_forward_pre_hook(lambda m, args: calls.append(args[0].numel()))
        engine = ChunkedEngine(model, 64, 16, max_num_batched_tokens=budget, record=True)
        for c in chats:
            engine.add_request(c, 30, stop_tokens=[])
        late = engine.add_request(long_prompt, 5, stop_tokens=[], arrival_step=5)
        steps = []
        while engine.has_unfinished():
            before = len(calls)
            engine.step()
            steps.append(calls[before:])
        hook.remove()
        runs[budget] = engine
        if budget:
            assert all(len(c) <= 1 for c in steps)           # one call per step...
            assert [sum(c) for c in steps] == [viz.step_tokens(rec) for rec in engine.history]
    whole, chunked = runs[None], runs[32]
    assert [r.output for r in whole.requests] == [r.output for r in chunked.requests]
    assert whole.requests[4].output == greedy_reference(model, long_prompt, 5)
    assert whole.stats.max_step_tokens == 200 + 4
    assert chunked.stats.max_step_tokens == 32
    chunks = [rec.prefilled.get(late.req_id) for rec in chunked.history[5:13]]
    assert chunks == [28] * 7 + [4]
    for rec in chunked.history[5:13]:                     # no chat waits for the prompt
        assert sorted(rec.decoded) == [0, 1, 2, 3]
    first_token = min(rec.step for rec in chunked.history if late.req_id in rec.decoded)
    assert first_token == 13                              # sampled at step 12, decodes at 13


def test_a_half_prefilled_request_loses_to_recompute_only_what_it_had_computed():
    """A decodes and grows; B's 30-token prompt is prefilled 2 tokens a step. When A needs a
    block and none is free, B — the newest — is preempted in the middle of its prompt. Recompute
    throws away exactly the tokens B had computed (counted here from the step history) and
    prefills them again; swap keeps them and B resumes where it stopped."""
    model = tiny_model(max_seq_len=512)
    rng = random.Random(11)
    a, b = [rng.randrange(512) for _ in range(3)], [rng.randrange(512) for _ in range(30)]
    for preemption in ("recompute", "swap"):
        engine = ChunkedEngine(model, 12, 4, preemption, max_num_batched_tokens=3, record=True,
                               watermark=0.0)
        ra = engine.add_request(a, 40, stop_tokens=[])
        rb = engine.add_request(b, 2, stop_tokens=[], arrival_step=2)
        engine.run()
        assert ra.output == greedy_reference(model, a, 40)
        assert rb.output == greedy_reference(model, b, 2)
        held, lost, mid_prompt = {}, 0, 0        # tokens in the cache per request; thrown away
        for rec in engine.history:
            for i, mode in rec.preempted:
                mid_prompt += i == rb.req_id and 0 < held.get(i, 0) < len(b)
                if mode == "recompute":
                    lost += held.pop(i, 0)
            for i in rec.decoded:
                held[i] = held.get(i, 0) + 1
            for i, n in rec.prefilled.items():
                held[i] = held.get(i, 0) + n
        assert mid_prompt >= 1
        chunks = sum(rec.prefilled.get(rb.req_id, 0) for rec in engine.history)
        if preemption == "recompute":
            assert lost > 0 and engine.stats.recomputed_tokens == lost
            assert chunks > len(b)
        else:
            assert engine.stats.recomputed_tokens == 0 and chunks == len(b)


def test_parallel_samples_fork_after_the_last_chunk():
    model = tiny_model(seed=1)
    prompt = prompts_with_a_system_prompt(k=1, system=40)[0]           # 41..51 tokens
    requests = [(prompt, 6, 0, 4, 0)]
    out, stats = run_engine(model, requests, max_num_batched_tokens=7)
    assert out == expected(model, requests)
    assert stats.prefill_tokens == len(prompt)                          # one prefill for four
    assert stats.max_step_tokens <= 7
    _, whole = run_engine(model, requests)
    assert stats.peak_used_blocks == whole.peak_used_blocks             # the blocks are shared


@pytest.mark.parametrize("budget", [2, 5])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_forked_groups_and_prefix_hits_survive_preemption_under_a_budget(preemption, budget):
    model = tiny_model(seed=1)
    prompts = prompts_with_a_system_prompt(k=3, system=13, seed=4)
    requests = [(p, 14, 2 * i, 3, 3 * i) for i, p in enumerate(prompts)]
    out, stats = run_engine(model, requests, num_blocks=8, preemption=preemption,
                            prefix_caching=True, max_num_batched_tokens=budget)
    assert stats.preemptions > 0 and stats.max_step_tokens <= budget
    assert out == expected(model, requests)


def test_a_prefix_hit_starts_the_first_chunk_after_the_cached_blocks():
    model = tiny_model(seed=1)
    system = prompts_with_a_system_prompt(k=1, system=30)[0][:30]      # 3 full blocks of 8
    engine = Engine(model, 40, BS, prefix_caching=True, max_num_batched_tokens=5, record=True)
    first = engine.add_request(system + [7, 8, 9], 4, stop_tokens=[])
    engine.run()
    second = engine.add_request(system + [4, 5], 4, stop_tokens=[])
    engine.step()
    assert engine.stats.cached_tokens == 3 * BS
    assert engine.history[-1].prefilled == {second.req_id: 5}
    assert engine.scheduler.num_computed_tokens(second) == 3 * BS + 5  # chunk 24..28
    engine.run()
    assert first.output == greedy_reference(model, system + [7, 8, 9], 4)
    assert second.output == greedy_reference(model, system + [4, 5], 4)
    assert engine.stats.prefill_tokens == len(first.prompt) + len(second.prompt) - 3 * BS


SYSTEM = prompts_with_a_system_prompt(k=1, system=17, seed=9)[0][:17]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_traces_of_samples_and_shared_prefixes_under_a_budget(data):
    """Random arrivals of prompts that often share a system prompt, n samples each, prefix
    caching on or off, a small pool, any budget: every sample is the one it is alone."""
    model = tiny_model(seed=1)
    requests = []
    for i in range(data.draw(st.integers(2, 4), label="requests")):
        shared = SYSTEM[:data.draw(st.sampled_from([0, 9, 17]))]
        tail = data.draw(st.lists(st.integers(1, 500), min_size=1, max_size=10))
        requests.append((shared + tail, data.draw(st.integers(1, 8)), data.draw(st.integers(0, 6)),
                         data.draw(st.integers(1, 3)), 3 * i))
    budget = data.draw(st.sampled_from([1, 2, 3, 7, 16]), label="budget")
    out, stats = run_engine(model, requests, num_blocks=data.draw(st.sampled_from([5, 6, 9])),
                            preemption=data.draw(st.sampled_from(["recompute", "swap"])),
                            prefix_caching=data.draw(st.booleans()),
                            max_num_batched_tokens=budget)
    assert out == expected(model, requests)
    assert stats.max_step_tokens <= budget


def test_the_budget_is_a_positive_number_of_tokens():
    model = tiny_model()
    for bad in (0, -3, 2.5, "64"):
        with pytest.raises(RequestError, match="max_num_batched_tokens"):
            ChunkedEngine(model, 8, 4, max_num_batched_tokens=bad)
    with pytest.raises(RequestError, match="max_num_batched_tokens"):
        generate(model, [[1, 2]], 3, cache="paged", max_num_batch_tokens=8)   # a typo: listed
    assert generate(model, [[1, 2, 3]], 4, cache="paged", max_num_batched_tokens=1,
                    stop_tokens=[]) == [greedy_reference(model, [1, 2, 3], 4)]
