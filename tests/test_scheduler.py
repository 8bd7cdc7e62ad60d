"""Stage 5: nothing lost, nothing changed — scheduling, preemption and swapping never change a
request's tokens, and every block comes back."""

import random

import pytest
import torch
from conftest import tiny_model

from minipaged import OutOfBlocksError, RequestError, generate
from minipaged.cache_manager import CacheManager
from minipaged.swap import move_sequence
from minipaged.engine import Engine
from minipaged.generation import row_generator


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# block_size: (prompt lengths, new tokens, pool blocks) — a pool that forces many preemptions.
TRACES = {1: ((1, 14), (1, 24), 30), 16: ((1, 40), (10, 40), 5), 256: ((200, 250), (30, 100), 4)}
_alone = {}


def trace(block_size):
    """12 requests with their own lengths and arrival steps, and each one's greedy tokens when
    generated alone on the contiguous cache (the reference)."""
    if block_size not in _alone:
        model = tiny_model(max_seq_len=512)
        (p0, p1), (m0, m1), _ = TRACES[block_size]
        rng = random.Random(block_size)
        reqs = [([rng.randrange(512) for _ in range(rng.randint(p0, p1))], rng.randint(m0, m1),
                 rng.randint(0, 20)) for _ in range(12)]
        alone = [generate(model, [p], n, cache="contiguous", stop_tokens=[])[0]
                 for p, n, _ in reqs]
        _alone[block_size] = (model, reqs, alone)
    return _alone[block_size]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_preempted_requests_produce_exactly_their_tokens_alone(block_size, preemption):
    model, reqs, alone = trace(block_size)
    engine = Engine(model, TRACES[block_size][2], block_size, preemption, max_num_seqs=8)
    for prompt, n, arrival in reqs:
        engine.add_request(prompt, n, stop_tokens=[], arrival_step=arrival)
    done = engine.run()
    assert [r.output for r in done] == alone
    st = engine.stats
    assert st.preemptions >= 4                        # the pool really was too small
    if preemption == "swap":
        assert st.swapped_blocks > 0 and st.swap_bytes == st.swapped_blocks * engine.block_bytes
    else:
        assert st.recomputed_tokens > 0 and st.swapped_blocks == 0
    cpu = engine.swap.cpu_managers if engine.swap else []
    for m in engine.cache.managers + cpu:                         # every block back, swap empty
        assert m.num_free_blocks == m.num_blocks and not m.live_seq_ids()
    s = engine.scheduler
    assert not (s.waiting or s.running or s.swapped)
    assert sorted(s.free_rows) == list(range(8))


def test_seeded_sampling_survives_preemption():
    model, reqs, alone = trace(16)
    kw = dict(temperature=1.0, top_p=0.9, stop_tokens=[], seed=7)
    prompts, limits = [p for p, _, _ in reqs], [n for _, n, _ in reqs]
    together = generate(model, prompts, limits, cache="contiguous", **kw)
    for preemption in ("recompute", "swap"):
        engine = Engine(model, 5, 16, preemption, max_num_seqs=8)
        for i, (p, n, arrival) in enumerate(reqs):
            engine.add_request(p, n, 1.0, 0.9, row_generator(7, i), [], arrival)
        assert [r.output for r in engine.run()] == together
        assert engine.stats.preemptions > 0
    paged = generate(model, prompts, limits, cache="paged", block_size=16, num_blocks=5, **kw)
    assert paged == together
    assert together != alone                           # sampling, not greedy
    for preemption in ("recompute", "swap"):           # stage 5b: prompts in chunks of <= 5
        assert generate(model, prompts, limits, cache="paged", block_size=16, num_blocks=5,
                        preemption=preemption, max_num_batched_tokens=5, **kw) == together


def test_generate_with_a_small_pool_admits_and_preempts_instead_of_failing():
    model = tiny_model()
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(9)]
    limits = [rng.randint(0, 25) for _ in prompts]
    assert 0 in limits
    expected = generate(model, prompts, limits, stop_tokens=[])   # contiguous, per-prompt limits
    assert [len(o) for o in expected] == limits
    for preemption in ("recompute", "swap"):
        out = generate(model, prompts, limits, cache="paged", block_size=4, num_blocks=12,
                       preemption=preemption, stop_tokens=[])
        assert out == expected


def test_stop_tokens_and_callback_on_the_engine_match_the_contiguous_path():
    model = tiny_model()
    prompts = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]
    free = generate(model, prompts, 10, stop_tokens=[])
    stop = free[0][3]
    events = {"contiguous": [], "paged": []}
    for cache in events:
        out = generate(model, prompts, 10, cache=cache, stop_tokens=[stop], num_blocks=6,
                       block_size=4, callback=lambda e, i, t, c: events[cache].append((e, i, t)))
        assert out == [f[:f.index(stop)] if stop in f else f for f in free]
    # The same token for the same prompt, once each; a recomputed request gets its next
    # token from a prefill rather than a decode.
    tokens = {k: sorted((i, t) for _, i, t in v) for k, v in events.items()}
    assert tokens["paged"] == tokens["contiguous"]
    assert sum(e == "prefill" for e, _, _ in events["paged"]) > len(prompts)


def test_a_request_larger_than_the_pool_is_refused_up_front():
    model = tiny_model()
    engine = Engine(model, num_blocks=3, block_size=4)
    with pytest.raises(RequestError, match="may need 4 blocks .* only 3 per layer"):
        engine.add_request(list(range(10)), 4)              # 10 + 4 - 1 = 13 tokens: 4 blocks
    assert not engine.has_unfinished()
    with pytest.raises(RequestError, match="could never run"):
        generate(model, [[1, 2], list(range(10))], 4, cache="paged", block_size=4, num_blocks=3)
    # Exactly the pool, watermark or not: it runs alone, it does not spin.
    engine.add_request(list(range(9)), 4, stop_tokens=[])   # 12 tokens at most: 3 blocks
    engine.add_request([7], 2, stop_tokens=[])
    done = engine.run()
    assert [len(r.output) for r in done] == [4, 2] and engine.stats.steps <= 8


def test_requests_wait_for_their_arrival_step_and_step_returns_the_finished():
    model = tiny_model()
    engine = Engine(model, num_blocks=64, block_size=4, record=True)
    late = engine.add_request([1, 2, 3], 3, stop_tokens=[], arrival_step=5)
    early = engine.add_request([4, 5], 2, stop_tokens=[])
    finished = [engine.step() for _ in range(10)]
    assert finished[1] == [early] and finished[7] == [late]
    assert sum(map(len, finished)) == 2
    first_seen = min(rec.step for rec in engine.history if late.req_id in rec.states)
    assert first_seen == 5 and early.finish_step == 1 and late.finish_step == 7


def test_static_batches_admit_only_when_the_batch_has_finished():
    model = tiny_model()
    rng = random.Random(5)
    reqs = [([rng.randrange(512) for _ in range(rng.randint(1, 12))], rng.randint(1, 20))
            for _ in range(10)]
    runs = {}
    for static in (False, True):
        engine = Engine(model, 16, 4, static_batches=static, max_num_seqs=4, record=True)
        for p, n in reqs:
            engine.add_request(p, n, stop_tokens=[])
        runs[static] = ([r.output for r in engine.run()], engine)
    assert runs[True][0] == runs[False][0]
    history = runs[True][1].history
    for before, now in zip(history, history[1:]):
        started = [i for i, s in now.states.items() if s == "running" and i not in before.states]
        still = [i for i, s in before.states.items() if s == "running" and i in now.states]
        assert not (started and still), f"step {now.step} admitted {started} beside {still}"
    assert runs[True][1].stats.steps > runs[False][1].stats.steps


def test_move_sequence_copies_blocks_into_new_ones_and_frees_the_old():
    gpu = CacheManager(8, 4, 2, 3, max_seqs=4, max_blocks_per_seq=8, seed=1)
    cpu = CacheManager(8, 4, 2, 3, max_seqs=4, max_blocks_per_seq=8, seed=2)
    gpu.k_cache_paged.normal_()
    gpu.v_cache_paged.normal_()
    gpu.reserve(0, 3)
    gpu.reserve(1, 10)
    before = gpu.blocks_of(1)
    k, v = gpu.k_cache_paged[before].clone(), gpu.v_cache_paged[before].clone()   # (3, 4, 2, 3)
    out_blocks, cpu_blocks = move_sequence(gpu, cpu, 1)
    assert out_blocks == before and 1 not in gpu and gpu.num_free_blocks == 7
    assert torch.equal(cpu.k_cache_paged[cpu_blocks], k) and cpu.seq_lens_for([1]).item() == 10
    gpu.reserve(2, 16)                                   # someone takes blocks meanwhile
    _, back = move_sequence(cpu, gpu, 1)
    assert torch.equal(gpu.k_cache_paged[back], k) and torch.equal(gpu.v_cache_paged[back], v)
    assert gpu.blocks_of(1) == back and cpu.num_free_blocks == 8
    assert set(back).isdisjoint(gpu.blocks_of(0) + gpu.blocks_of(2))


def test_swap_without_room_moves_nothing_in_any_layer():
    model = tiny_model()
    engine = Engine(model, 8, 4, "swap", num_cpu_blocks=2)
    cache, swap = engine.cache, engine.swap
    cache.prepare([0], 11)                               # 3 blocks per layer
    tables = [m.block_table.clone() for m in cache.managers]
    with pytest.raises(OutOfBlocksError, match="no room .* nothing was moved"):
        swap.swap_out(0)
    assert all(torch.equal(t, m.block_table) for t, m in zip(tables, cache.managers))
    assert all(m.num_free_blocks == 2 for m in swap.cpu_managers)
    assert not swap.can_swap_out(0)


def test_bad_engine_options():
    model = tiny_model()
    with pytest.raises(RequestError, match="preemption"):
        Engine(model, 8, 4, "drop")
    with pytest.raises(RequestError, match="num_blocks"):
        Engine(model, None, 4)
    with pytest.raises(RequestError, match="max_new_tokens"):
        generate(model, [[1], [2]], [3], cache="paged")
    engine = Engine(model, 8, 4)
    for bad, why in [(dict(prompt=[]), "empty"), (dict(max_new_tokens=-1), "max_new_tokens"),
                     (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p")]:
        with pytest.raises(RequestError, match=why):
            engine.add_request(**{"prompt": [1], "max_new_tokens": 2, **bad})
    assert engine.requests == [] and not engine.has_unfinished()     # nothing was queued
    with pytest.raises(RequestError, match="raise max_seq_len"):
        engine.add_request([1] * 250, 10)


def test_run_with_a_progress_bar():
    model = tiny_model()
    engine = Engine(model, 6, 4)
    for n in (3, 9, 5):
        engine.add_request([1, 2, 3], n, stop_tokens=[])
    assert [len(r.output) for r in engine.run(progress=True)] == [3, 9, 5]
