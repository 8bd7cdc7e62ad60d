"""Stages 5 and 5b: the scheduler's invariants, checked after every step of random traces.

The model is a fake with no weights (conftest.FakeModel): it writes each token's id into the
cache as its key (and the id minus the layer as its value) and returns random logits. So the
invariants can read the pools back and check that every running or swapped request holds
exactly its own tokens, in order — through prefill, decode, swap-out, swap-in and recompute,
whole or in chunks. Under a token budget (stage 5b) the fake also counts the tokens of every
call it gets: no step runs more than the budget, in one call, and chunks only take what the
decodes left.
"""

from collections import Counter

import pytest
import torch
from conftest import FakeModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import RequestError
from minipaged.chunked_engine import ChunkedEngine
from minipaged.engine import Engine

STOP = 0                      # the fake model's stop token (when a trace uses one)


def check_pool(m, holders, layer, prefilling=()):
    """`holders` own exactly the blocks their cached tokens need, holding those very tokens;
    no block has two owners; free + used = all. A decoding request holds all its tokens but the
    newest; one still prefilling (in chunks) holds a prefix of them, at least its first chunk."""
    assert m.live_seq_ids() == sorted(r.seq_id for r in holders)
    owned = []
    for r in holders:
        n = int(m.seq_lens[r.seq_id])
        if r in prefilling:
            assert 1 <= n <= r.num_tokens - 1
        else:
            assert n == r.num_tokens - 1            # the newest token is not in the cache yet
        blocks = m.blocks_of(r.seq_id)
        assert len(blocks) == -(-n // m.block_size)
        stored = m.k_cache_paged[blocks].flatten(0, 1)[:n, 0, 0]          # (n,)
        values = m.v_cache_paged[blocks].flatten(0, 1)[:n, 0, 0]
        tokens = (r.prompt + r.output)[:n]
        assert stored.tolist() == tokens
        assert values.tolist() == [t - layer for t in tokens]
        owned += blocks
    assert len(owned) == len(set(owned))
    assert sorted(owned + m.free_blocks.ids()) == list(range(m.num_blocks))


def check_invariants(engine):
    s = engine.scheduler
    queues = {"pending": engine.pending, "waiting": s.waiting, "running": s.running,
              "swapped": s.swapped}
    count = Counter(id(r) for q in queues.values() for r in q)
    for r in engine.requests:                       # exactly one queue, or finished
        assert count[id(r)] == (0 if r.status == "finished" else 1)
    for name, q in queues.items():
        assert all(r.status == name for r in q)
    assert all(r.seq_id is None for r in list(s.waiting) + engine.pending)
    followers = [r for group in getattr(s, "followers", {}).values() for r in group]
    rows = [r.seq_id for r in s.running + list(s.swapped) + followers]
    assert sorted(rows + s.free_rows) == list(range(engine.cache.managers[0].max_seqs))
    prefilling = getattr(s, "prefilling", set())
    assert prefilling <= set(s.running) | set(s.swapped)
    chunked = [r for r in s.running if r in prefilling]   # at most one, the newest
    assert chunked in ([], s.running[-1:])
    for layer, m in enumerate(engine.cache.managers):
        check_pool(m, s.running, layer, prefilling)
    if engine.swap is None:
        assert not s.swapped
    else:
        for layer, m in enumerate(engine.swap.cpu_managers):
            check_pool(m, s.swapped, layer, prefilling)


def check_budget(engine, model, calls_before, decoding_before):
    """The step just run (stage 5b): one model call of at most `max_num_batched_tokens` tokens,
    exactly the tokens the history records; a chunk ran only if every request that was decoding
    got its token (or lost its blocks)."""
    budget, rec = engine.max_num_batched_tokens, engine.history[-1]
    calls = model.calls[calls_before:]
    ran = len(rec.decoded) + sum(rec.prefilled.values())
    assert len(calls) <= 1 and sum(calls) == ran <= budget
    assert all(n >= 1 for n in rec.prefilled.values())
    if rec.prefilled:
        preempted = {i for i, _ in rec.preempted}
        assert decoding_before <= set(rec.decoded) | preempted


@st.composite
def traces(draw, budgets=(None,)):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(1, 12))
    longest = min(24, max(2, num_blocks * block_size * 3 // 4))   # so the pool runs dry often
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        preemption=draw(st.sampled_from(["recompute", "swap"])),
        num_cpu_blocks=draw(st.sampled_from([None, None, None, 2])),
        static_batches=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.01, 0.3])),
        max_num_seqs=draw(st.sampled_from([8, 8, 3, 1])),
        stop=draw(st.sampled_from([[], [], [STOP]])),
        seed=draw(st.integers(0, 2**16)),
        budget=draw(st.sampled_from(budgets)),
        requests=draw(st.lists(st.tuples(st.integers(1, longest), st.integers(0, longest),
                                         st.integers(0, 8)), min_size=2, max_size=10)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_invariants_hold_after_every_step(trace):
    run_trace(trace, Engine)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(budgets=(1, 1, 2, 3, 5, 8, 13, 64)))
def test_invariants_hold_under_a_token_budget(trace):
    run_trace(trace, ChunkedEngine, max_num_batched_tokens=trace["budget"], record=True)


def run_trace(trace, engine_class, **options):
    torch.set_num_threads(1)
    model = FakeModel(trace["seed"])
    engine = engine_class(model, trace["num_blocks"], trace["block_size"], trace["preemption"],
                          max_num_seqs=trace["max_num_seqs"],
                          num_cpu_blocks=trace["num_cpu_blocks"], watermark=trace["watermark"],
                          static_batches=trace["static_batches"], **options)
    budget = options.get("max_num_batched_tokens")
    gen = torch.Generator().manual_seed(trace["seed"])
    accepted = []
    for n_prompt, max_new, arrival in trace["requests"]:
        prompt = torch.randint(1, 6, (n_prompt,), generator=gen).tolist()
        fits = -(-(n_prompt + max(max_new, 1) - 1) // trace["block_size"]) <= trace["num_blocks"]
        if not fits:                                # refused up front, never left to spin
            with pytest.raises(RequestError, match="could never run"):
                engine.add_request(prompt, max_new, stop_tokens=trace["stop"],
                                   arrival_step=arrival)
            continue
        accepted.append(engine.add_request(prompt, max_new, stop_tokens=trace["stop"],
                                           arrival_step=arrival))

    first_admissions, idle = [], 0
    while engine.has_unfinished():
        assert engine.step_count < 5000, "the engine stopped making progress"
        arrived = engine.scheduler.has_unfinished() or any(
            r.arrival_step <= engine.step_count for r in engine.pending)
        busy_before, calls_before = engine.stats.busy_steps, len(model.calls)
        decoding = {r.req_id for r in engine.scheduler.running
                    if r not in getattr(engine.scheduler, "prefilling", ())}
        engine.step()
        check_invariants(engine)
        if budget:
            check_budget(engine, model, calls_before, decoding)
        # Progress: a step with any arrived request runs the model for at least one of them.
        assert engine.stats.busy_steps == busy_before + 1 or not arrived
        idle += not arrived
        for r in sorted(accepted, key=lambda r: (r.arrival_step, r.req_id)):
            if r.status not in ("waiting", "pending") and r not in first_admissions:
                first_admissions.append(r)
    # Every busy step samples a token that is never taken back: steps are bounded by tokens
    # (with chunks: by tokens run, of which a step runs at least one).
    stats = engine.stats
    if budget:
        assert stats.max_step_tokens <= budget
        assert stats.busy_steps <= stats.prefill_tokens + stats.generated_tokens
    else:
        assert stats.busy_steps <= sum(r.max_new_tokens for r in accepted)
    started = [r for r in first_admissions if r.max_new_tokens > 0]   # first come, first served
    assert started == sorted(started, key=lambda r: (r.arrival_step, r.req_id))

    for r in accepted:
        assert r.status == "finished" and len(r.output) <= r.max_new_tokens
        assert STOP not in r.output or not trace["stop"]
        if not trace["stop"]:
            assert len(r.output) == r.max_new_tokens
    cpu = engine.swap.cpu_managers if engine.swap else []
    for m in engine.cache.managers + cpu:                         # all free, swap pool empty
        assert m.num_free_blocks == m.num_blocks and not m.live_seq_ids()
    if trace["preemption"] == "recompute":
        assert engine.stats.swapped_blocks == 0
