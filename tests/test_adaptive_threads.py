"""FastEngine's adaptive thread count (minipaged/fast/threads.py): the decision from readings
fed in by hand (cores other processes used, worked out here from the numbers given), the
/proc/stat arithmetic against a hand-made file, and a run that drops a thread midway: the
tokens of the no-cache forward, and the user's thread count back at the end; eager, and
compiled with graphs for one thread fewer (which the run switches to without compiling)."""

import functools
import os

import pytest
import torch

from conftest import greedy_reference, tiny_model
from minipaged import UsageError, generate
from minipaged.fast import FastEngine, FusedLlama, compile_decode, matvec
from minipaged.fast.matvec import panel_helper
from minipaged.fast.threads import AdaptiveThreads, busy_seconds


@pytest.fixture
def two_threads():
    """torch on 2 threads for the test, the caller's count back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def governor(cores: int) -> AdaptiveThreads:
    g = AdaptiveThreads()
    g.cpus = list(range(cores))           # a machine of `cores` cores, whatever this one has
    return g


def feed(g: AdaptiveThreads, others_per_interval, own_per_second=1.0, interval=0.5):
    """Readings half a second apart in which other processes used the given cores' worth and
    this process `own_per_second`; the thread count decided after each."""
    wall, busy, own, counts = 100.0, 5000.0, 20.0, [g.update(100.0, 5000.0, 20.0)]
    for others in others_per_interval:
        wall += interval
        own += own_per_second * interval
        busy += (own_per_second + others) * interval
        counts.append(g.update(wall, busy, own))
    return counts


def test_one_thread_fewer_while_another_process_holds_a_core(two_threads):
    g = governor(2)
    # quiet; a busy loop starts (0.7, then a whole core); it stays (0.5 is above rise_at);
    # it stops (0.1)
    assert feed(g, [0.05, 0.7, 1.0, 0.5, 0.35, 0.1, 0.0]) == [2, 2, 1, 1, 1, 1, 2, 2]
    assert g.others == pytest.approx(0.0)


def test_a_little_noise_never_drops_a_thread(two_threads):
    assert feed(governor(2), [0.2, 0.55, 0.3, 0.59, 0.0]) == [2] * 6


def test_each_core_held_costs_one_thread_never_below_one():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        # 4 cores: a core and a half held costs 2 threads; all of them leaves one
        assert feed(governor(4), [1.7, 1.7, 0.9, 3.9, 0.0]) == [4, 2, 2, 3, 1, 4]
        torch.set_num_threads(1)                 # the user's single thread stays single
        assert feed(governor(4), [3.0, 3.0]) == [1, 1, 1]
        torch.set_num_threads(6)                 # more threads than cores: left alone if quiet
        assert feed(governor(4), [0.1, 1.0, 0.0]) == [6, 6, 3, 6]
    finally:
        torch.set_num_threads(before)


def test_with_compiled_counts_it_picks_the_largest_allowed_else_the_smallest(two_threads):
    g = governor(2)
    g.counts = (2, 1)                            # a 2-core machine: the same as any count
    assert feed(g, [0.05, 0.7, 1.0, 0.5, 0.35, 0.1, 0.0]) == [2, 2, 1, 1, 1, 1, 2, 2]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        g = governor(4)
        g.counts = (4, 3)
        # as in the test above, whose counts were [4, 2, 2, 3, 1, 4]: 2 and 1 were not
        # compiled, so 3, the fewest that were
        assert feed(g, [1.7, 1.7, 0.9, 3.9, 0.0]) == [4, 3, 3, 3, 3, 4]
    finally:
        torch.set_num_threads(before)


def test_busy_seconds_reads_the_processes_cores_from_proc_stat():
    stat = ("cpu  900 900 900 900 900 9 9 9 0 0\n"
            "cpu0 100 2 30 5000 70 4 5 6 0 0\n"
            "cpu1 200 1 10 9000 80 1 1 1 0 0\n"
            "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    # user + nice + system + irq + softirq + steal; idle and iowait are not busy
    assert busy_seconds([0], stat) == pytest.approx((100 + 2 + 30 + 4 + 5 + 6) / hz)
    assert busy_seconds([0, 1], stat) == pytest.approx((147 + 200 + 1 + 10 + 1 + 1 + 1) / hz)


def test_restore_puts_the_users_count_back(two_threads):
    g = governor(2)
    g.tick()                                     # a run starts: the user's count is 2
    torch.set_num_threads(1)                     # as a busy machine makes tick do
    g.restore()
    assert torch.get_num_threads() == 2 and g.user_threads is None


def test_a_run_that_drops_a_thread_gives_the_same_tokens_and_ends_on_the_users_count(
        two_threads, monkeypatch):
    """The governor is told another process holds a whole core from the second reading on,
    a reading every step (interval 0): the run drops to one thread after its first step."""
    model = tiny_model()
    prompts = [list(range(1, 19)), [5, 6], list(range(30, 45))]
    clock = iter(range(10**6))

    def read(self):             # each reading one second on: ours 1 s busy, the others' 1 s
        t = next(clock)
        return float(t), 2.0 * t, float(t)

    seen = []
    monkeypatch.setattr(AdaptiveThreads, "read", read)
    monkeypatch.setattr(AdaptiveThreads, "__init__", functools.partialmethod(
        AdaptiveThreads.__init__, interval=0.0))
    got = generate(model, prompts, 10, cache="paged", stop_tokens=[], engine_class=FastEngine,
                   callback=lambda *_: seen.append(torch.get_num_threads()))
    assert got == [greedy_reference(model, p, 10) for p in prompts]
    assert seen[0] == 2 and set(seen[len(prompts):]) == {1}     # prefills first, then 1 thread
    assert torch.get_num_threads() == 2


def test_turned_off_it_never_touches_the_count(two_threads, monkeypatch):
    monkeypatch.setattr(AdaptiveThreads, "read", lambda self: pytest.fail("read the machine"))
    model = tiny_model()
    engine = functools.partial(FastEngine, adaptive_threads=False)
    assert generate(model, [[5, 6, 7]], 4, cache="paged", stop_tokens=[],
                    engine_class=engine) == [greedy_reference(model, [5, 6, 7], 4)]
    with pytest.raises(UsageError, match="adaptive_threads must be True or False"):
        FastEngine(model, 8, adaptive_threads="yes")


def test_a_model_with_compiled_steps_keeps_the_users_count(two_threads, monkeypatch):
    """A graph runs on the thread count it was compiled for (another count compiles it again):
    the governor leaves a model compiled for the user's count alone, even with another process
    on a whole core."""
    model = tiny_model()
    clock = iter(range(10**6))
    monkeypatch.setattr(AdaptiveThreads, "read", lambda self: (float(t := next(clock)), 2.0 * t,
                                                               float(t)))
    monkeypatch.setattr(AdaptiveThreads, "__init__", functools.partialmethod(
        AdaptiveThreads.__init__, interval=0.0))
    model.compiled = lambda *a: pytest.fail("a Llama never calls it: only its presence counts")
    seen = []
    try:
        got = generate(model, [[5, 6, 7], [8, 9]], 6, cache="paged", stop_tokens=[],
                       engine_class=FastEngine,
                       callback=lambda *_: seen.append(torch.get_num_threads()))
    finally:
        del model.compiled
    assert got == [greedy_reference(model, p, 6) for p in ([5, 6, 7], [8, 9])]
    assert set(seen) == {2}


def busy_from_the_second_reading(monkeypatch):
    """Readings one second apart, another process on a whole core from the second on, a
    reading every step (interval 0)."""
    clock = iter(range(10**6))
    monkeypatch.setattr(AdaptiveThreads, "read", lambda self: (float(t := next(clock)), 2.0 * t,
                                                               float(t)))
    monkeypatch.setattr(AdaptiveThreads, "__init__", functools.partialmethod(
        AdaptiveThreads.__init__, interval=0.0))


def test_a_model_compiled_for_one_thread_fewer_drops_to_it_without_compiling_again(
        two_threads, monkeypatch):
    """`compile_decode(..., fewer_threads=True)` compiles the graphs for 2 threads and for 1,
    and leaves the count at 2; a busy run then takes its steps through the compiled graphs on
    1 thread (none compiled during the run), gives the no-cache forward's tokens, and ends on
    the user's 2 threads."""
    model = tiny_model(dtype=torch.float32)
    fast = FusedLlama(model)
    assert compile_decode(fast, batches=True, fewer_threads=True) > 0
    assert fast.compiled_threads == (2, 1) and torch.get_num_threads() == 2
    fast.native = None           # decode steps through the graphs, not as one C++ call
    calls = []                   # the thread count in force at each compiled step
    one, many = fast.compiled, fast.compiled_batches
    fast.compiled = lambda *a: calls.append(("one", torch.get_num_threads())) or one(*a)
    fast.compiled_batches = lambda *a, **k: calls.append(("many", torch.get_num_threads())) \
        or many(*a, **k)
    busy_from_the_second_reading(monkeypatch)
    helper = []                  # panels.c's helper turned on (True) and off, in turn
    monkeypatch.setattr(matvec, "panel_helper", lambda start: helper.append(
        (start, torch.get_num_threads())) or panel_helper(start))
    prompts = [list(range(1, 19)), [5, 6], list(range(30, 45))]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        got = generate(fast, prompts, [10, 10, 14], cache="paged", stop_tokens=[],
                       engine_class=FastEngine, max_num_batched_tokens=64)
    finally:
        fast.compiled, fast.compiled_batches = one, many
    assert got == [greedy_reference(model, p, n) for p, n in zip(prompts, [10, 10, 14])]
    assert calls[0] == ("many", 2)                           # the prefills, before any reading
    assert ("many", 1) in calls and ("one", 1) in calls      # both graphs, on one thread
    assert set(calls[1:]) <= {("many", 1), ("one", 1)}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert torch.get_num_threads() == 2
    # on at each reading while down to one thread, off when the run ended
    assert helper[0] == (True, 1) and set(helper[:-1]) == {(True, 1)} and helper[-1] == (False, 2)
    assert not matvec.panel_helper_state()[0]
