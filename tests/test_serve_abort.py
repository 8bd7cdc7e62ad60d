"""`Engine.abort` (what the server does when a client hangs up): a request aborted between two
steps, in whatever state it is — waiting, running, swapped out, half-way through a chunked
prefill, the head of a group of samples not forked yet — gives back every block it held, in
the KV pool and the CPU pool, and the requests left are served exactly as if it had never
been there (their tokens are the contiguous cache's)."""

import pytest
import torch

from minipaged import Engine, generate

from conftest import tiny_model

BS = 4
CONFIGS = {
    "recompute": dict(preemption="recompute"),
    "swap": dict(preemption="swap"),
    "chunked": dict(max_num_batched_tokens=6),
    "prefix-cache": dict(prefix_caching=True),
}


STATES = {"recompute": {"waiting", "running"}, "swap": {"swapped"}, "chunked": {"prefilling", "group waiting"},
          "prefix-cache": {"waiting", "running"}}


def prompts_for(k, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 14, (k,), generator=gen)]


def state_of(engine, r):
    s = engine.scheduler
    if r in engine.pending:
        return "pending"
    if r in getattr(s, "prefilling", ()):
        return "prefilling"
    if r.req_id in getattr(s, "siblings", {}) and r.status == "waiting":
        return "group waiting"
    return r.status


@pytest.mark.parametrize("name", CONFIGS)
def test_abort_frees_every_block_and_leaves_the_others_exact(name):
    model = tiny_model()
    prompts = prompts_for(9)
    engine = Engine(model, 14, BS, max_num_seqs=8, **CONFIGS[name])
    reqs = [engine.add_request(p, 10, stop_tokens=[], n=3 if i == 4 else 1)
            for i, p in enumerate(prompts)]
    doomed = {1, 4, 6, 8}                  # aborted at some step, whatever state they are in
    seen = {}
    while engine.has_unfinished():
        for i in sorted(doomed):
            r = reqs[i]
            state = state_of(engine, r)
            # abort each when it is in a state not yet seen (or at the end, whatever it is)
            if r.status != "finished" and (state not in seen.values() or engine.step_count > 30):
                seen[i] = state
                for member in engine.requests[r.req_id:r.req_id + (3 if i == 4 else 1)]:
                    engine.abort(member)       # the server aborts each sample of a request
                doomed.discard(i)
                break
        engine.step()
    assert len(set(seen.values())) >= 3, seen
    assert STATES[name] <= set(seen.values()), seen
    # nothing leaked: every block back, in both pools, every row back
    assert engine.cache.num_used_blocks == 0
    if engine.swap is not None:
        assert engine.swap.cpu_managers[0].num_free_blocks == engine.swap.cpu_managers[0].num_blocks
    s = engine.scheduler
    assert sorted(s.free_rows) == list(range(s.cache.managers[0].max_seqs))
    assert not getattr(s, "followers", {}) and not getattr(s, "siblings", {})
    assert not getattr(s, "prefilling", set())
    # the aborted ones (and the samples of the aborted group) ended where they were
    group = engine.requests[reqs[4].req_id:reqs[4].req_id + 3]
    for r in [reqs[i] for i in seen] + group:
        assert r.status == "finished" and r.seq_id is None and len(r.output) < 10
    # the others are exact: the contiguous cache's tokens, as if they had been alone
    kept = [i for i in range(len(prompts)) if i not in seen]
    expected = generate(model, [prompts[i] for i in kept], 10, stop_tokens=[])
    assert [reqs[i].output for i in kept] == expected


def test_abort_of_a_finished_request_changes_nothing():
    model = tiny_model()
    engine = Engine(model, 20, BS)
    r = engine.add_request(prompts_for(1)[0], 3, stop_tokens=[])
    engine.run()
    before = (list(r.output), r.finish_step, engine.cache.num_free_blocks)
    engine.abort(r)
    assert (r.output, r.finish_step, engine.cache.num_free_blocks) == before
