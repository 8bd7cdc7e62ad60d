"""Stage 9b's check: the remap that pairs the prefill side's block ids with the decode side's."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ... import disaggregated
from ...disaggregated_run import Job, serve_in_one_process
from ...errors import RequestError
from ..grader import expect
from .common import no_cache_greedy, prop, tiny_model


@prop(80)
@example(6, 0, 6, 0, 0)                                # nothing skipped
@example(4, 4, 4, 1, 0)                                # everything skipped: nothing moves
@example(5, 2, 4, 2, 0)                                # blocks after `end` stay
@example(3, 0, 0, 0, 0)                                # nothing at all
@example(4, -1, 2, 0, 0)                               # first before block 0
@example(4, 3, 2, 0, 0)                                # first after end
@example(4, 1, 5, 0, 0)                                # end past both tables
@example(4, 1, 4, 0, -1)                               # the decode side's table is shorter
@example(4, 1, 4, 0, 1)                                # the prefill side's table is shorter
@given(st.integers(0, 8), st.integers(-2, 9), st.integers(-2, 9), st.integers(0, 3),
       st.integers(-1, 1))
def remap_pairs_the_same_logical_blocks(length, first, end, seed, shorter):
    """remap(remote_table, local_table, first, end) lists (remote id, local id) for logical
    blocks first, first+1, ..., end-1, in that order: block j of the prefill side's table goes
    to block j of the decode side's, whatever ids each side's free set handed out. Unless
    0 <= first <= end <= the length of both tables, it raises RequestError."""
    g = torch.Generator().manual_seed(seed)
    remote = torch.randperm(40, generator=g)[:length].tolist()
    local = (torch.randperm(40, generator=g)[:length] + 100).tolist()   # never a remote id
    if shorter < 0 and local:
        local.pop()
    if shorter > 0 and remote:
        remote.pop()
    call = f"remap({remote}, {local}, first={first}, end={end})"
    if not 0 <= first <= end <= min(len(remote), len(local)):
        try:
            got = disaggregated.remap(list(remote), list(local), first, end)
        except RequestError:
            return
        expect(False, f"{call} returned {got}: it must raise RequestError (first and end "
                      f"must satisfy 0 <= first <= end <= the length of both tables)")
    got = disaggregated.remap(list(remote), list(local), first, end)
    want = [(remote[j], local[j]) for j in range(first, end)]
    expect(isinstance(got, list), f"{call} returned {got!r}: return a list of pairs")
    expect([tuple(p) for p in got] == want, f"{call} returned {got}, but block j's pair is "
                                            f"(remote_table[j], local_table[j]) for j from "
                                            f"first to end-1: {want}")


def disaggregated_tokens_and_moved_kv():
    """With your remap, the decode side's blocks hold the prefill side's K/V, and its greedy
    tokens are the no-cache forward's (prompts sharing two blocks: the second skips them)."""
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    prompts = [list(range(8)) + torch.randint(0, 96, (k,), generator=g).tolist()
               for k in (9, 14)]
    job = Job(prompts, [4, 4], 0.0, 1.0, [], 0, 1, dict(block_size=4, max_seq_len=96))
    report = serve_in_one_process(model, job, record=True)
    prefill, decode = report["engines"]
    move = decode.connector.moves[-1]                  # the last move: nothing reused it since
    key, layer, pairs = move.key, move.layer, move.pairs
    mine, theirs = decode.cache.managers[layer], prefill.cache.managers[layer]
    for r, loc in pairs:
        expect(torch.equal(mine.k_cache_paged[loc], theirs.k_cache_paged[r]),
               f"after moving prompt {key}, the decode side's block {loc} (layer {layer}) does "
               f"not hold the K of the prefill side's block {r}: check which ids you paired")
    for got, want in zip(report["decode"]["outputs"], no_cache_greedy(prompts, 4)):
        expect(got == want, f"the decode side's tokens {got} are not the no-cache forward's "
                            f"{want}: a block landed in the wrong place")
