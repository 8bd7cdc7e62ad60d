"""Stage 9b: prefill on one engine, decode on another, KV blocks moved between them.

Ground truth is the no-paging cache (stage 1's contiguous batch): the decode side's tokens must
be its tokens, whatever moved, was skipped, failed or was preempted. Both pools must end clean:
every block free or cached-free."""

import multiprocessing
import os
import queue
import signal
import threading
import time

import pytest
import torch

from conftest import tiny_model
from minipaged import generate
from minipaged.disaggregated import (LOAD_MARGIN, DisaggregationError, Faults,
                                     PrefillConnector, PrefillEngine, leaked_blocks, remap)
from minipaged.disaggregated_run import (Job, build_engine, prefill_loop, prompts_inbox,
                                         serve_disaggregated, serve_in_one_process)
from minipaged.errors import RequestError


def prompts(lengths, seed=1, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, 512, (k,), generator=g).tolist() for k in lengths]


SHARED = list(range(100, 108))                    # two blocks of 4, in every prompt below


def job(ps, m, temperature=0.0, n=1, **options):
    options.setdefault("block_size", 4)
    return Job(ps, [m] * len(ps), temperature, 1.0, [], 0, n, dict(options, max_seq_len=256))


def reference(model, ps, m, temperature=0.0, n=1):
    out = generate(model, ps, m, temperature=temperature, n=n, stop_tokens=[], seed=0)
    return out if n == 1 else [t for group in out for t in group]


def check_clean(report, num_prompts):
    assert report["prefill"]["leaked"] == 0 and report["decode"]["leaked"] == 0
    assert report["prefill"]["freed_by_ack"] == num_prompts
    assert report["prefill"]["freed_by_timeout"] == 0


def test_two_processes_give_the_no_paging_tokens():
    """Both entries across two processes: generate(disaggregated=True), and the reports behind
    it — prompts that share two blocks, so the decode side skips them after the first."""
    model = tiny_model()
    ps = prompts([3, 14, 17, 30], prefix=SHARED)
    expected = reference(model, ps, 6)
    assert generate(model, ps, 6, cache="paged", block_size=4, stop_tokens=[],
                    disaggregated=True) == expected
    report = serve_disaggregated(model, job(ps, 6))
    assert report["decode"]["outputs"] == expected
    check_clean(report, len(ps))
    t = report["decode"]["transfer"]
    assert t.blocks_skipped >= 2 and t.blocks_sent > 0 and t.loads_failed == 0
    assert report["decode"]["cached_tokens"] == (t.blocks_sent + t.blocks_skipped) * 4  # not redone
    assert t.bytes_sent == t.blocks_sent * 2 * 2 * 4 * 2 * 16 * 8   # K,V · layers · bs · Hk · D · f64


@pytest.mark.parametrize("case", ["chunked prefill", "prefix caching", "preemption", "n=2"])
def test_one_engines_tokens_and_clean_pools(case):
    """The same loops in one process: chunked prefill on the prefill side, prefix caching on
    both, the decode side preempting, n=2 sampled children forked on the decode side."""
    model, temperature, n, options = tiny_model(), 0.0, 1, {}
    ps = prompts([5, 21, 33, 9], prefix=SHARED)
    if case == "chunked prefill":
        options = dict(max_num_batched_tokens=8)
    elif case == "prefix caching":
        options = dict(prefix_caching=True)
    elif case == "preemption":
        options = dict(num_blocks=24)
    else:
        temperature, n = 0.8, 2
    report = serve_in_one_process(model, job(ps, 12, temperature, n, **options), record=True)
    assert report["decode"]["outputs"] == reference(model, ps, 12, temperature, n)
    check_clean(report, len(ps))
    prefill, decode = report["engines"]
    if case == "preemption":
        assert decode.stats.preemptions > 0
    if case == "chunked prefill":
        assert prefill.stats.max_step_tokens <= 8
    moves = decode.connector.moves
    assert moves and any(r != loc for mv in moves for r, loc in mv.pairs)   # other ids
    assert report["decode"]["transfer"].blocks_skipped >= 2 * (len(ps) - 1)       # the shared two


def test_the_decode_side_holds_the_prefill_sides_kv_after_the_move():
    """Every pair of the remap: the decode side's block holds what the prefill side's held (one
    prompt: no later prefill reuses the prefill side's freed blocks)."""
    model = tiny_model()
    report = serve_in_one_process(model, job(prompts([26]), 1), record=True)
    prefill, decode = report["engines"]
    assert len(decode.connector.moves) == 2                 # one per layer, 6 blocks each
    for mv in decode.connector.moves:
        assert len(mv.pairs) == 6
        mine, theirs = decode.cache.managers[mv.layer], prefill.cache.managers[mv.layer]
        for r, loc in mv.pairs:
            assert torch.equal(mine.k_cache_paged[loc], theirs.k_cache_paged[r])
            assert torch.equal(mine.v_cache_paged[loc], theirs.v_cache_paged[r])


def test_remap_pairs_each_sides_own_ids_after_the_skipped_blocks():
    assert remap([7, 3, 9, 4], [0, 5, 2, 8], 1, 3) == [(3, 5), (9, 2)]
    assert remap([7, 3], [1, 2], 2, 2) == []
    for first, end, local in [(-1, 1, [1, 2]), (2, 1, [1, 2]), (0, 2, [1])]:
        with pytest.raises(RequestError, match="0 <= first <= end"):
            remap([7, 3], local, first, end)


def test_a_failed_transfer_is_recomputed():
    """Loads of requests 1 and 3 break after layer 0 (half written): the decode side frees what
    it took and recomputes those prompts; the same tokens, both pools clean."""
    model = tiny_model()
    ps = prompts([14, 17, 30, 22])
    report = serve_in_one_process(model, job(ps, 6), Faults(fail={1, 3}))
    assert report["decode"]["outputs"] == reference(model, ps, 6)
    assert report["decode"]["transfer"].loads_failed == 2
    check_clean(report, len(ps))


def test_the_prefill_side_frees_what_nobody_acknowledges_after_the_timeout():
    """No decode side at all (it died): the prefill side still ends, within the timeout, with
    every held block freed."""
    model = tiny_model()
    j = job(prompts([14, 17, 30]), 4)
    engine = build_engine(PrefillEngine, model, j, prefill=True)
    engine.connector = PrefillConnector(engine.cache, queue.Queue(), timeout=0.3)
    start = time.monotonic()
    report = prefill_loop(engine, prompts_inbox(j.prompts), queue.Queue())
    assert time.monotonic() - start < 0.3 + 5.0
    assert report == {"leaked": 0, "freed_by_ack": 0, "freed_by_timeout": 3}


def test_held_blocks_are_freed_by_the_ack_at_once_or_by_the_deadline():
    """Two prompts of 4 blocks each, held after their prefill; the ack frees one at once, the
    other is freed at its deadline and not a moment before."""
    model = tiny_model()
    j = job(prompts([14, 15]), 1)
    now = [0.0]
    engine = build_engine(PrefillEngine, model, j, prefill=True)
    engine.connector = conn = PrefillConnector(engine.cache, queue.Queue(), 10.0, lambda: now[0])
    for p in j.prompts:
        engine.add_request(p, 1, stop_tokens=[])
    while engine.has_unfinished():
        engine.step()                                 # prefilled and finished: blocks held
    assert leaked_blocks(engine.cache) == 8 and conn.get_finished(set()) == []
    now[0] = 1.0
    assert conn.get_finished({1}) == [1] and leaked_blocks(engine.cache) == 4
    now[0] = 9.9
    assert conn.get_finished(set()) == [] and leaked_blocks(engine.cache) == 4
    now[0] = 10.0
    assert conn.get_finished(set()) == [0] and leaked_blocks(engine.cache) == 0
    assert (conn.freed_by_ack, conn.freed_by_timeout) == (1, 1)


def kill_rank_once_met(rank, after):
    """In a thread: SIGKILL rank `rank` `after` seconds after the ranks met."""
    sent = []

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ranks = [p for p in multiprocessing.active_children() if p.name.startswith("minipaged-rank")]
            if len(ranks) == 2:
                time.sleep(after)
                for p in multiprocessing.active_children():
                    if p.name == f"minipaged-rank{rank}" and p.pid:
                        os.kill(p.pid, signal.SIGKILL)
                        sent.append(time.monotonic())
                return
            time.sleep(0.02)
    threading.Thread(target=watch, daemon=True).start()
    return sent


def test_blocks_announced_past_their_deadline_are_not_read_but_recomputed():
    """A hold shorter than the decode side's margin: every deadline has passed by the time the
    decode side would read (the prefill side may have reused those blocks): it reads nothing and
    recomputes every prompt, with the same tokens."""
    model = tiny_model()
    ps = prompts([14, 17, 30])
    report = serve_in_one_process(model, job(ps, 6), timeout=LOAD_MARGIN / 2)
    assert report["decode"]["outputs"] == reference(model, ps, 6)
    t = report["decode"]["transfer"]
    assert t.loads_timed_out == t.loads_failed == len(ps) and t.blocks_sent == 0
    assert report["prefill"]["leaked"] == 0 == report["decode"]["leaked"]


def test_a_killed_prefill_engine_ends_the_call_with_an_error():
    """SIGKILL the prefill engine as the two start (the decode side then waits for its pool):
    one error naming it, within seconds, not the 30 s the decode side would wait, and no
    process left."""
    model = tiny_model(dtype=torch.float32)
    sent = kill_rank_once_met(0, 0.3)
    with pytest.raises(DisaggregationError, match=r"the prefill engine died \(killed by SIGKILL"):
        generate(model, prompts([100] * 8), 100, cache="paged", stop_tokens=[],
                 disaggregated=True)
    assert sent and time.monotonic() - sent[0] < 5.0
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minipaged")]


@pytest.mark.parametrize("extra", [dict(cache="contiguous"), dict(tensor_parallel=2),
                                   dict(callback=print), dict(disaggregated="yes")])
def test_what_cannot_run_disaggregated_is_refused_before_any_process(extra):
    options = {"cache": "paged", "disaggregated": True, **extra}
    with pytest.raises(RequestError, match="disaggregated=True runs on cache='paged'"):
        generate(tiny_model(), prompts([5]), 2, **options)


def no_process_left():
    return not [p for p in multiprocessing.active_children() if p.name.startswith("minipaged")]


def test_a_killed_decode_engine_leaves_the_prefill_side_to_free_what_it_held():
    """Two processes; the decode engine is SIGKILLed as request 1's blocks are announced. One
    error names it; the prefill engine, left running, frees every block it held at the timeout
    (its report rides on the error), and then no process is left."""
    model = tiny_model()
    ps = prompts([14, 17, 30, 22])
    start = time.monotonic()
    with pytest.raises(DisaggregationError, match=r"the decode engine died \(killed by SIGKILL") \
            as e:
        serve_disaggregated(model, job(ps, 6), Faults(die={1}), timeout=1.0)
    assert time.monotonic() - start < 1.0 + 20.0
    assert "the prefill engine then freed what it held and ended (0 blocks left in use)" in \
        str(e.value)
    prefill = e.value.prefill
    assert prefill["leaked"] == 0 and prefill["freed_by_timeout"] >= 3, prefill
    assert prefill["freed_by_ack"] + prefill["freed_by_timeout"] == len(ps)
    assert no_process_left()


def test_a_hanging_transfer_is_given_up_at_the_deadline_and_recomputed():
    """A request's read of layer 1 never returns (it hangs; nothing fails): the decode side
    gives it up before the prefill side's deadline and recomputes the prompt. The same tokens,
    both pools clean — in one process (the last request hangs: one thread waits on it, and the
    announcements behind it would age past their deadlines too), and in two."""
    model = tiny_model()
    ps = prompts([14, 17, 30, 22])
    start = time.monotonic()
    report = serve_in_one_process(model, job(ps, 6), Faults(hang={3}), timeout=0.5)
    assert 0.3 < time.monotonic() - start < 0.5 + 10.0      # it waited, for the deadline only
    assert report["decode"]["outputs"] == reference(model, ps, 6)
    t = report["decode"]["transfer"]
    assert t.loads_timed_out == 1 and t.loads_failed == 1 and t.blocks_sent > 0
    check_clean(report, len(ps))
    report = serve_disaggregated(model, job(ps, 6), Faults(hang={1}), timeout=2.0)
    assert report["decode"]["outputs"] == reference(model, ps, 6)
    assert report["decode"]["transfer"].loads_timed_out >= 1
    p = report["prefill"]
    assert p["leaked"] == 0 and report["decode"]["leaked"] == 0
    assert p["freed_by_ack"] + p["freed_by_timeout"] == len(ps)
    assert no_process_left()
