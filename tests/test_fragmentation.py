"""Stage 4: the waste metrics, the first-fit allocator, the workloads, the simulator against the
real caches, and the lesson's claims on a ShareGPT-like workload."""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model

from minipaged import generate
from minipaged.cache_manager import CacheManager
from minipaged.engine import Engine
from minipaged.errors import MiniPagedError, OutOfBlocksError, RequestError, TraceError
from minipaged.fragmentation import (EXTERNAL, IDLE, INTERNAL, RESERVED, TOKEN,
                                     FirstFitAllocator, KVWaste, measure_contiguous,
                                     measure_paged, slot_map_paged, slot_map_region, waste)
from minipaged.kv_cache import ContiguousCache
from minipaged.simulator import Policy, simulate
from minipaged.workloads import (ALPACA, SHAREGPT, Workload, alpaca_like, load, load_trace,
                                 sharegpt_like)


# -- the metrics on small cases, counted by hand ---------------------------------------------------

def test_one_request_of_20_tokens_in_blocks_of_16_leaves_12_slots_internal():
    cm = CacheManager(num_blocks=4, block_size=16, n_kv_heads=1, head_dim=2, max_seqs=2,
                      max_blocks_per_seq=4)
    cm.reserve(0, 20)                         # finished: 20 tokens in 2 blocks = 32 slots
    w = measure_paged(cm, {0: 20})
    assert (w.tokens, w.reservation, w.internal, w.external, w.idle) == (20, 0, 12, 0, 32)
    assert w.bytes_per_slot == 2 * 1 * 2 * 4  # K and V, 1 head, head_dim 2, float32
    assert w.shares()["internal"] == 12 / 64


def test_a_growing_paged_request_splits_its_last_block_into_reservation_and_internal():
    cm = CacheManager(num_blocks=4, block_size=16, n_kv_heads=1, head_dim=2, max_seqs=2,
                      max_blocks_per_seq=4)
    cm.reserve(0, 18)                         # will end at 20: slots 18, 19 are still to come
    w = measure_paged(cm, {0: 20})
    assert (w.tokens, w.reservation, w.internal, w.idle) == (18, 2, 12, 32)
    cm.reserve(1, 5)                          # will end at 40: its one block is all reservation
    w = measure_paged(cm, {0: 20, 1: 40})
    assert (w.tokens, w.reservation, w.internal, w.idle) == (23, 2 + 11, 12, 16)


def test_layers_that_disagree_are_refused():
    layers = [CacheManager(4, 16, 1, 2, max_seqs=2, max_blocks_per_seq=4, seed=s) for s in (0, 1)]
    for cm in layers:
        cm.reserve(0, 18)
    assert measure_paged(layers, {0: 20}).bytes_per_slot == 2 * (2 * 1 * 2 * 4)   # two layers
    layers[1].grow([0], 1)                    # layer 1 now holds a token layer 0 does not
    with pytest.raises(MiniPagedError, match="disagree"):
        measure_paged(layers, {0: 20})


def test_slot_map_of_a_paged_pool():
    cm = CacheManager(num_blocks=3, block_size=4, n_kv_heads=1, head_dim=2, max_seqs=1,
                      max_blocks_per_seq=3, seed=0)
    cm.reserve(0, 5)                          # final length 6: blocks [a, b], 5 tokens
    grid = slot_map_paged(cm, {0: 6})
    first, last = cm.blocks_of(0)
    assert grid[first].tolist() == [TOKEN] * 4
    assert grid[last].tolist() == [TOKEN, RESERVED, INTERNAL, INTERNAL]
    free = ({0, 1, 2} - {first, last}).pop()
    assert grid[free].tolist() == [IDLE] * 4
    counts = np.bincount(grid.ravel(), minlength=5).tolist()   # the map and the metric agree
    assert counts == list(measure_paged(cm, {0: 6}).slots().values())


def test_contiguous_reservation_internal_and_external_by_hand():
    # a 100-slot region: A holds [0, 30) with 10 of its final 25 tokens stored, B holds
    # [50, 80) with 30 of 30; holes [30, 50) and [80, 100) of 20 each. The next request needs 35.
    w = waste(stored=[10, 30], allocated=[30, 30], final=[25, 30], capacity=100,
              pieces=[20, 20], next_need=35)
    assert (w.tokens, w.reservation, w.internal, w.external, w.idle) == (40, 15, 5, 40, 0)
    # needing 15, it fits a hole: no piece is too small for it
    assert waste([10, 30], [30, 30], [25, 30], 100, [20, 20], next_need=15).external == 0
    # needing 50, more than all 40 free slots: that is too little memory, not fragmentation
    assert waste([10, 30], [30, 30], [25, 30], 100, [20, 20], next_need=50).idle == 40
    # nobody waiting: free memory is idle
    assert waste([10, 30], [30, 30], [25, 30], 100, [20, 20]).idle == 40


def test_measure_contiguous_reads_the_rows_of_a_real_cache(model):
    cache = ContiguousCache(model.args, max_batch=4, max_seq_len=32, dtype=torch.float64)
    cache.prepare([0], 5)
    cache.prepare([2], 9)                     # rows 1 and 3 hold nothing: two free pieces of 32
    w = measure_contiguous(cache, {0: 12, 2: 9}, next_need=40)
    assert (w.tokens, w.reservation, w.internal) == (14, 7, 64 - 21)
    assert (w.external, w.idle) == (64, 0)    # 64 free, in pieces of 32 < 40
    assert w.bytes_per_slot == 2 * 2 * 2 * 16 * 8   # K, V x 2 layers x 2 heads x 16 x float64
    cache.free(2)                             # rows 1, 2, 3 now one free piece of 96
    assert measure_contiguous(cache, {0: 12}, next_need=40).external == 0
    with pytest.raises(RequestError, match="no final length"):
        measure_contiguous(cache, {})


def test_kvwaste_adds_up_and_converts_to_bytes():
    w = KVWaste(tokens=3, reservation=2, internal=1, external=4, idle=0, bytes_per_slot=10)
    assert w.capacity == 10 and w.allocated == 6
    assert w.bytes()["external"] == 40
    assert sum(w.shares().values()) == pytest.approx(1.0)


def test_impossible_lengths_are_refused():
    with pytest.raises(RequestError):
        waste(stored=[5], allocated=[4], final=[9], capacity=10)
    with pytest.raises(RequestError):
        waste(stored=[5], allocated=[16], final=[4], capacity=16)
    with pytest.raises(RequestError, match="more than"):
        waste(stored=[5], allocated=[16], final=[9], capacity=8)


# -- the first-fit allocator -------------------------------------------------------------------

def test_first_fit_takes_the_first_hole_that_fits():
    a = FirstFitAllocator(100)
    assert [a.allocate(k, 20) for k in "abcde"] == [0, 20, 40, 60, 80]
    assert a.allocate("f", 1) is None and a.free_slots == 0
    a.free("b")
    a.free("d")                               # holes [20, 40) and [60, 80)
    assert a.holes() == [(20, 20), (60, 20)]
    assert a.allocate("g", 15) == 20          # the first hole, not the best one
    assert a.allocate("h", 10) == 60          # 5 left at [35, 40) is too small
    assert a.holes() == [(35, 5), (70, 10)]
    assert a.extents()["h"] == (60, 10)


def test_freeing_merges_neighbouring_holes():
    a = FirstFitAllocator(60)
    for k in "abc":
        a.allocate(k, 20)
    a.free("a")
    a.free("c")
    assert a.holes() == [(0, 20), (40, 20)]
    assert a.allocate("big", 30) is None      # 40 free, but no piece of 30
    a.free("b")                               # merges with both neighbours
    assert a.holes() == [(0, 60)] and a.largest_hole() == 60
    assert a.allocate("big", 30) == 0


def test_external_fragmentation_on_a_known_layout():
    a = FirstFitAllocator(64)
    for k, n in zip("abcd", (10, 6, 20, 8)):  # a [0,10) b [10,16) c [16,36) d [36,44), 20 free
        a.allocate(k, n)
    a.free("b")                               # holes: [10, 16) of 6 and [44, 64) of 20
    stored, final = {"a": 10, "c": 5, "d": 8}, {"a": 10, "c": 20, "d": 8}
    grid = slot_map_region(a, stored, final, next_need=24)
    assert (grid == EXTERNAL).sum() == 26     # 26 free >= 24, but in pieces of 6 and 20
    assert (grid == RESERVED).sum() == 15 and (grid == TOKEN).sum() == 23
    w = waste([10, 5, 8], [10, 20, 8], [10, 20, 8], 64,
              pieces=[s for _, s in a.holes()], next_need=24)
    assert (w.external, w.idle) == (26, 0)
    assert (slot_map_region(a, stored, final, next_need=20) == EXTERNAL).sum() == 6


def test_allocator_refuses_misuse():
    a = FirstFitAllocator(10)
    a.allocate("x", 4)
    with pytest.raises(RequestError):
        a.allocate("x", 2)
    with pytest.raises(RequestError):
        a.allocate("y", 0)
    with pytest.raises(RequestError):
        a.free("nobody")


# -- workloads -----------------------------------------------------------------------------------

def test_synthetic_workloads_are_seeded():
    a, b = sharegpt_like(300, seed=3), sharegpt_like(300, seed=3)
    assert np.array_equal(a.prompt_lens, b.prompt_lens)
    assert np.array_equal(a.output_lens, b.output_lens)
    assert not np.array_equal(a.output_lens, sharegpt_like(300, seed=4).output_lens)


@pytest.mark.parametrize("make, means", [(sharegpt_like, SHAREGPT), (alpaca_like, ALPACA)])
def test_synthetic_means_match_the_paper(make, means):
    wl = make(40_000, seed=1, max_seq_len=8192)          # no request is cut at 8192
    assert wl.prompt_lens.mean() == pytest.approx(means[0], rel=0.02)
    assert wl.output_lens.mean() == pytest.approx(means[1], rel=0.02)
    assert wl.prompt_lens.min() >= 1 and wl.output_lens.min() >= 1
    # geometric: the spread is as large as the mean (a coefficient of variation near 1)
    assert wl.output_lens.std() / wl.output_lens.mean() == pytest.approx(1.0, abs=0.05)


def test_synthetic_requests_fit_max_seq_len():
    wl = sharegpt_like(5000, seed=0, max_seq_len=512)
    assert (wl.prompt_lens + wl.output_lens).max() <= 512
    assert (wl.final_lens == wl.prompt_lens + wl.output_lens - 1).all()


def test_trace_files_csv_and_json(tmp_path):
    csv_path = tmp_path / "trace.csv"
    csv_path.write_text("id,prompt_len,output_len\n7,12,30\n8, 5 ,1\n")
    wl = load_trace(csv_path)
    assert wl.prompt_lens.tolist() == [12, 5] and wl.output_lens.tolist() == [30, 1]
    objects = tmp_path / "objects.json"
    objects.write_text(json.dumps([{"prompt_len": 3, "output_len": 4, "note": "x"}]))
    assert load_trace(objects).output_lens.tolist() == [4]
    pairs = tmp_path / "pairs.json"
    pairs.write_text("[[3, 4], [10, 2]]")
    assert load(str(pairs)).prompt_lens.tolist() == [3, 10]


@pytest.mark.parametrize("name, text, match", [
    ("a.csv", "prompt,output\n1,2\n", "missing prompt_len, output_len"),
    ("a.csv", "prompt_len,output_len\n4,x\n", "line 2: output_len must be a whole number"),
    ("a.csv", "prompt_len,output_len\n4,2.5\n", "whole number"),
    ("a.csv", "prompt_len,output_len\n0,3\n", "prompt_len must be"),
    ("a.csv", "prompt_len,output_len\n", "holds no requests"),
    ("a.csv", "", "no header"),
    ("a.json", "[[1, 2], [3]]", "request 1: expected"),
    ("a.json", '{"prompt_len": 3}', "expected a JSON list"),
    ("a.json", "[[1, 2],", "not valid JSON"),
    ("a.json", '[["1", 2]]', "not strings"),
    ("a.json", "[[1, true]]", "whole number"),
    ("a.json", "[[1000, 2000]]", "do not fit in max_seq_len=2048"),
    ("a.txt", "1,2", "must be a .csv or .json"),
])
def test_bad_trace_files_say_what_is_wrong(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=match):
        load_trace(path, max_seq_len=2048)


def test_a_missing_trace_file():
    with pytest.raises(TraceError, match="does not exist"):
        load("no/such/trace.csv")


# -- the simulator on cases small enough to follow by hand ----------------------------------------

def test_simulator_contiguous_oracle_by_hand():
    # region of 10 slots; requests (prompt, output): final lengths 5, 4, 6.
    wl = Workload("hand", np.array([3, 2, 4]), np.array([3, 3, 3]))
    r = simulate(wl, Policy("oracle"), budget_slots=10, max_seq_len=8)
    # step 0: A [0,5) and B [5,9) admitted; C needs 6, 1 slot free: too little, idle.
    assert r.waste_at(0) == KVWaste(5, 4, 0, 0, 1)
    # steps 1, 2: A and B grow; at step 3 both leave and C is admitted with its prompt of 4.
    assert r.waste_at(2) == KVWaste(9, 0, 0, 0, 1)
    assert r.waste_at(3) == KVWaste(4, 2, 0, 0, 4)
    assert r.series["running"].tolist() == [2, 2, 2, 1, 1, 1]
    assert r.series["waiting"].tolist() == [1, 1, 1, 0, 0, 0]


def test_simulator_measures_external_fragmentation():
    # A region of 12 slots. Final lengths: A 4, B 6, C 2, D 6 (oracle extents of that size).
    # Step 0: A [0,4), B [4,10), C [10,12) fill it; D waits. Step 2: C leaves, 2 free < 6: too
    # little memory (idle). Step 3: A leaves: 6 free, but as holes of 4 and 2 — D still waits,
    # on external fragmentation alone. Step 4: B leaves, the holes merge, D gets [0,6).
    wl = Workload("hand", np.array([2, 3, 1, 1]), np.array([3, 4, 2, 6]))
    r = simulate(wl, Policy("oracle"), budget_slots=12, max_seq_len=8)
    assert r.series["external"][:5].tolist() == [0, 0, 0, 6, 0]
    assert r.series["idle"][:5].tolist() == [0, 0, 2, 0, 6]
    assert r.series["running"][:5].tolist() == [3, 3, 2, 1, 1]
    assert r.series["waiting"][:5].tolist() == [1, 1, 1, 1, 0]


def test_simulator_paged_preempts_the_newest_request():
    # 3 blocks of 2 slots, no watermark. A: prompt 2, output 4 (final 5); B: prompt 1, output 4.
    # Step 0: one block each. Step 1: A 2 -> 3 takes the last block, B 1 -> 2. Step 2: B's block
    # is full and none is free: B, the newer, is preempted. Step 4: A has left; B comes back
    # and recomputes its 2 tokens (prompt + the output token it had stored).
    wl = Workload("hand", np.array([2, 1]), np.array([4, 4]))
    r = simulate(wl, Policy("paged", 2), budget_slots=6, max_seq_len=6, watermark=0)
    assert (r.preemptions, r.recomputed_tokens) == (1, 2)
    assert r.series["running"].tolist() == [2, 2, 1, 1, 1, 1, 1]
    assert r.series["waiting"].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert r.series["token states"].tolist() == [3, 5, 4, 5, 2, 3, 4]


def test_the_simulator_admits_by_the_schedulers_watermark_rule():
    """Stage 4's simulator and stage 5's scheduler ask one function, simulator.admits. A pool of
    10 blocks of 4: A (a 16-token prompt, 4 blocks) runs; B's 24-token prompt needs the other 6.
    With the watermark (one block kept free) both hold B back until A has finished; without it
    both admit B at once, and both must preempt it at the next step, when A crosses a block."""
    model = tiny_model()
    prompts, outputs = [16, 24], [8, 3]
    for watermark, preemptions, first_steps in ((0.01, 0, [1, 1]), (0.0, 1, [2, 1])):
        sim = simulate(Workload("two", np.array(prompts), np.array(outputs)), Policy("paged", 4),
                       budget_slots=40, max_seq_len=40, watermark=watermark)
        engine = Engine(model, num_blocks=10, block_size=4, watermark=watermark, max_seq_len=40,
                        record=True)
        for p, o in zip(prompts, outputs):
            engine.add_request(list(range(1, p + 1)), o, stop_tokens=[])
        engine.run()
        running = [sum(s == "running" for s in rec.states.values()) for rec in engine.history]
        assert sim.preemptions == engine.stats.preemptions == preemptions
        assert running[:2] == sim.series["running"][:2].tolist() == first_steps
        if watermark:                   # nobody preempted: the two agree at every step
            assert running == sim.series["running"].tolist()


def test_simulator_refuses_a_budget_too_small():
    wl = Workload("hand", np.array([3]), np.array([3]))
    with pytest.raises(OutOfBlocksError):
        simulate(wl, Policy("max"), budget_slots=4, max_seq_len=8)
    with pytest.raises(RequestError):
        simulate(wl, Policy("oracle"), budget_slots=64, max_seq_len=5)


# -- agreement with the real caches during a real generation -----------------------------------------

PROMPT_LENS = [5, 17, 9, 30, 2, 12]
MAX_NEW = 20


@pytest.fixture(scope="module")
def real_run():
    """A tiny model, six prompts, and stop tokens that end the requests at different steps.

    The stop tokens are picked from an unstopped greedy run, so every request's output length
    (the stop token counts as produced) is known before the measured run starts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a model this small only loses time to threads on a busy CPU
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    free_run = generate(model, prompts, MAX_NEW, stop_tokens=[])
    stops = {free_run[1][3], free_run[3][11], free_run[4][6]}
    returned = [next((i for i, t in enumerate(o) if t in stops), MAX_NEW) for o in free_run]
    outputs = [min(n + 1, MAX_NEW) for n in returned]
    assert len(set(outputs)) >= 3
    yield model, prompts, stops, returned, outputs
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_the_simulator_predicts_what_the_real_caches_hold(real_run, kind):
    model, prompts, stops, returned, outputs = real_run
    final = {i: p + o - 1 for i, (p, o) in enumerate(zip(PROMPT_LENS, outputs))}
    bs, max_seq_len = 8, 64
    num_blocks = sum(-(-f // bs) for f in final.values()) + 3
    measured, running, last = [], [], [None]

    def read(event, seq_id, token, cache):
        """Read the cache once per step: after the last prefill, then after each decode prepare."""
        if (event == "prefill" and seq_id != len(prompts) - 1) or cache.cache_seqlens is last[0]:
            return
        last[0] = cache.cache_seqlens
        if kind == "paged":
            measured.append(measure_paged(cache, final))
            running.append(len(cache.managers[0].live_seq_ids()))
        else:
            measured.append(measure_contiguous(cache, final))
            running.append(int((cache.seq_lens > 0).sum()))

    out = generate(model, prompts, MAX_NEW, cache=kind, stop_tokens=list(stops), callback=read,
                   block_size=bs, num_blocks=num_blocks, max_seq_len=max_seq_len)
    assert [len(o) for o in out] == returned

    args = model.args
    bytes_per_slot = 2 * args.n_layers * args.n_kv_heads * args.head_dim * 8    # float64
    policy, budget = ((Policy("paged", bs), num_blocks * bs) if kind == "paged"
                      else (Policy("max"), len(prompts) * max_seq_len))
    sim = simulate(Workload("real", np.array(PROMPT_LENS), np.array(outputs)), policy, budget,
                   max_seq_len, bytes_per_slot=bytes_per_slot)
    assert sim.num_steps == len(measured) == max(outputs)
    assert [sim.waste_at(t) for t in range(sim.num_steps)] == measured
    assert sim.series["running"].tolist() == running
    if kind == "paged":       # the last blocks' tails were really there, and were predicted
        assert any(w.internal for w in measured) and any(w.reservation for w in measured)


# -- the lesson's claims, on the ShareGPT-like workload ---------------------------------------------

def test_paged_beats_max_length_reservation_on_sharegpt():
    wl = sharegpt_like(600, seed=0, max_seq_len=2048)
    budget = 32 * 2048                        # 8 GiB of Llama 3 8B bf16 KV: 65,536 slots
    paged = simulate(wl, Policy("paged", 16), budget, 2048)
    full = simulate(wl, Policy("max"), budget, 2048)
    assert paged.token_share_of_allocated() >= 0.95
    assert paged.shares()["token states"] >= 0.95
    assert full.shares()["token states"] < 0.40
    assert paged.mean_running() >= 3 * full.mean_running()
    assert full.mean_running() == 32          # 65,536 / 2,048: the region holds 32 rows


# -- the command line ------------------------------------------------------------------------------

def test_the_cli_prints_the_table_and_writes_the_figures(tmp_path, capsys):
    from minipaged.benchmarks.policies import main
    assert main(["--requests", "150", "--kv-budget-tokens", "16384", "--assets",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("contiguous, max_seq_len", "contiguous, oracle", "paged, block 256"):
        assert label in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fragmentation_block_size.png", "fragmentation_concurrency.png",
        "fragmentation_policies.png"]


def test_the_cli_reports_a_bad_trace_in_a_sentence(tmp_path, capsys):
    from minipaged.benchmarks.policies import main
    bad = tmp_path / "trace.csv"
    bad.write_text("prompt,output\n1,2\n")
    assert main(["--workload", str(bad), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "prompt_len" in err and "Traceback" not in err
