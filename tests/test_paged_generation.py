"""Stage 3: generation on the paged cache gives exactly the tokens of the contiguous cache and of
the no-cache forward, while blocks come and go the way lesson 03 says they do.

Each claim is checked twice: on stage 3's own static batch (`generate_paged`: stage 1's loop on
a PagedCache) and on the engine that `generate(cache="paged")` runs (stages 5 and 6).

Ground truth is `greedy_reference` (the whole sequence recomputed by the no-cache forward for
every token) and, for the bookkeeping, counts derived here from the prompts and the tokens seen
by the callback — never a number the cache reports about itself.
"""

import pytest
import torch
from conftest import greedy_reference, tiny_model

from minipaged import OutOfBlocksError, RequestError, generate
from minipaged.paged_cache import PagedCache
from minipaged.paged_generation import generate_paged

PAGED = ["static", "engine"]


def paged(how, model, prompts, n, **options):
    """Generate on the paged cache: stage 3's static batch, or the engine."""
    if how == "static":
        return generate_paged(model, prompts, n, **options)
    return generate(model, prompts, n, cache="paged", **options)


def mixed_prompts(block_size, seed=0):
    """Prompts of lengths 1, just under a block, exactly a block, and more than two blocks."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, max(1, block_size - 2), block_size, 2 * block_size + 3]
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def ceil_div(a, b):
    return -(-a // b)


@pytest.mark.parametrize("how", PAGED)
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_equals_contiguous_equals_no_cache(block_size, how):
    model = tiny_model(max_seq_len=1024)
    prompts = mixed_prompts(block_size)
    n = 12                # the prompt just under a block crosses into the next (at size 1, all do)
    expected = [greedy_reference(model, p, n) for p in prompts]
    out = paged(how, model, prompts, n, block_size=block_size, stop_tokens=[])
    contiguous = generate(model, prompts, n, cache="contiguous", stop_tokens=[])
    assert out == expected
    assert contiguous == expected
    crossing = [p for p in prompts if ceil_div(len(p), block_size) < ceil_div(len(p) + n, block_size)]
    assert crossing, "no sequence crossed a block boundary: the test would prove less"


def stops_at_different_steps(model, prompts, n, block_size):
    """Stop tokens taken from an unconstrained run, so sequences really stop, at different steps."""
    free = generate(model, prompts, n, cache="paged", block_size=block_size, stop_tokens=[])
    stop = {free[0][1], free[2][6]}
    cut = [f[:min(f.index(t) for t in stop if t in f)] if stop & set(f) else f for f in free]
    assert len({len(c) for c in cut}) >= 3 and min(len(c) for c in cut) < n, cut
    return free, sorted(stop), cut


@pytest.mark.parametrize("how", PAGED)
@pytest.mark.parametrize("block_size", [1, 16])
def test_sequences_stopping_at_different_steps(block_size, how):
    model = tiny_model()
    prompts = mixed_prompts(block_size, seed=1)
    n = 20
    free, stop, cut = stops_at_different_steps(model, prompts, n, block_size)
    assert free == [greedy_reference(model, p, n) for p in prompts]
    assert paged(how, model, prompts, n, block_size=block_size, stop_tokens=stop) == cut
    assert generate(model, prompts, n, cache="contiguous", stop_tokens=stop) == cut


@pytest.mark.parametrize("how", PAGED)
def test_blocks_follow_the_sequences_and_all_return(how):
    """Blocks are taken as sequences grow, freed the moment one stops while the others go on,
    every block is free at the end, and the per-layer tables differ (yet give the same tokens)."""
    bs, n = 4, 20
    model = tiny_model(n_layers=3)
    prompts = mixed_prompts(bs, seed=2)
    _, stop, cut = stops_at_different_steps(model, prompts, n, bs)
    calls = {}                       # callbacks seen per sequence = tokens it produced so far
    ended_at = {}                    # sequence -> callback number at which it produced its last token
    seen = dict(grew=0, freed_while_others_ran=0, layers_differ=0)
    caches = []

    def check(event, seq_id, token, cache):
        # When a sequence's token is reported, the cache holds its prompt plus every token it
        # had produced before this one (the newest is fed at the next step).
        before = calls.get(seq_id, 0)
        caches.append(cache)
        for m in cache.managers:
            live = set(m.live_seq_ids())
            assert int(m.seq_lens_for([seq_id])[0]) == len(prompts[seq_id]) + before
            owned = [b for s in live for b in m.blocks_of(s)]
            assert len(owned) == len(set(owned))              # no block has two owners
            for s in live:
                assert len(m.blocks_of(s)) == ceil_div(int(m.seq_lens_for([s])[0]), bs)
            assert m.num_used_blocks == len(owned)
            # A sequence that ended in an earlier step holds nothing any more.
            done = {s for s, at in ended_at.items() if at < len(caches) - len(prompts)}
            assert not live & done
        live = set(cache.managers[0].live_seq_ids())
        seen["grew"] += (len(prompts[seq_id]) + before) % bs == 1 and before > 0
        tables = [{s: m.blocks_of(s) for s in live} for m in cache.managers]
        seen["layers_differ"] += any(t != tables[0] for t in tables[1:])
        seen["freed_while_others_ran"] += bool(ended_at) and len(live) < len(prompts)
        calls[seq_id] = before + 1
        if token in stop or calls[seq_id] == n:
            ended_at[seq_id] = len(caches)

    out = paged(how, model, prompts, n, block_size=bs, stop_tokens=stop, callback=check)
    assert out == cut
    assert seen["grew"] > 0 and seen["freed_while_others_ran"] > 0 and seen["layers_differ"] > 0
    cache = caches[-1]
    for m in cache.managers:                                  # the end: every block is free
        assert m.num_free_blocks == m.num_blocks and m.live_seq_ids() == []
        assert sorted(m.free_blocks.ids()) == list(range(m.num_blocks))   # no prefix caching


def snapshot(cache):
    """Everything a prepare may change, for every layer."""
    layers = [(m.block_table.clone(), m.seq_lens.clone(), m.num_blocks_held.clone(),
               m.free_blocks.ids(), m.free_blocks._rng.getstate(), m.live_seq_ids())
              for m in cache.managers]
    seqlens = None if cache.cache_seqlens is None else cache.cache_seqlens.clone()
    tables = None if cache.block_tables is None else [t.clone() for t in cache.block_tables]
    return layers, seqlens, tables


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("seq_ids, n_new", [
    ([2], 9),            # a new sequence needing 3 blocks, 1 free
    ([0, 1], 5),         # growth: 3 new blocks needed, 1 free
    ([0, 1, 2], 4),      # a mix: 1 block for the new one, 1 for growth; each would fit alone
])
def test_out_of_blocks_leaves_every_layer_untouched(seq_ids, n_new):
    model = tiny_model(n_layers=3)
    cache = PagedCache(model.args, num_blocks=6, block_size=4, max_seqs=4, max_seq_len=64,
                       dtype=torch.float64)
    cache.prepare([0], 7)                       # 2 blocks
    cache.prepare([1], 8)                       # 2 blocks, full: 2 of 6 left
    cache.prepare([0, 1], 1)                    # seq 1 takes a third: 1 left
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError, match="Nothing was allocated"):
        cache.prepare(seq_ids, n_new)
    assert same(snapshot(cache), before)
    cache.prepare([0, 1], 1)                    # and the cache still works: 9 and 10 tokens
    assert [m.num_free_blocks for m in cache.managers] == [0, 0, 0]


def test_a_sequence_outgrowing_max_seq_len_leaves_every_layer_untouched():
    model = tiny_model(n_layers=3)
    cache = PagedCache(model.args, num_blocks=20, block_size=4, max_seqs=4, max_seq_len=16,
                       dtype=torch.float64)
    cache.prepare([0], 10)
    before = snapshot(cache)
    with pytest.raises(RequestError):
        cache.prepare([1, 0], 8)                # seq 1 fits, seq 0 would reach 18 > 16
    assert same(snapshot(cache), before)


def test_a_pool_too_small_for_everyone_waits_and_one_too_small_for_anyone_refuses():
    model = tiny_model()
    prompts = mixed_prompts(4)
    want = generate(model, prompts, 8, cache="contiguous", stop_tokens=[])
    longest = max(-(-(len(p) + 7) // 4) for p in prompts)        # blocks the longest one needs
    assert generate(model, prompts, 8, cache="paged", block_size=4, num_blocks=longest,
                    stop_tokens=[]) == want                      # stage 5 queues and preempts
    with pytest.raises(RequestError, match="could never run"):
        generate(model, prompts, 8, cache="paged", block_size=4, num_blocks=longest - 1, stop_tokens=[])


def test_a_static_batch_refuses_a_pool_too_small_for_everyone_before_any_work():
    """Stage 3 alone cannot wait or preempt: it says so up front, and computes nothing."""
    model = tiny_model()
    prompts = mixed_prompts(4)
    everyone = sum(-(-(len(p) + 8) // 4) for p in prompts)      # each prompt at its full length
    calls = []
    with pytest.raises(OutOfBlocksError, match="static batch cannot wait"):
        generate_paged(model, prompts, 8, block_size=4, num_blocks=everyone - 1,
                       stop_tokens=[], callback=lambda *a: calls.append(a))
    assert calls == []
    assert generate_paged(model, prompts, 8, block_size=4, num_blocks=everyone,
                          stop_tokens=[]) == generate(model, prompts, 8, stop_tokens=[])


@pytest.mark.parametrize("how", PAGED)
def test_a_kv_budget_sizes_the_pool(how):
    model = tiny_model()
    a = model.args
    per_block = 2 * a.n_layers * 4 * a.n_kv_heads * a.head_dim * 8        # float64: 8 bytes
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    seen = []
    out = paged(how, model, prompts, 6, block_size=4, kv_budget=7 * per_block + 5,
                stop_tokens=[], callback=lambda e, i, t, c: seen.append(c.num_blocks))
    assert set(seen) == {7}
    assert out == [greedy_reference(model, p, 6) for p in prompts]


@pytest.mark.parametrize("how", PAGED)
def test_seeded_sampling_is_the_same_on_both_caches(how):
    model = tiny_model()
    prompts = mixed_prompts(16, seed=3)
    kw = dict(temperature=1.0, top_p=0.9, stop_tokens=[], seed=11)
    out = paged(how, model, prompts, 15, block_size=16, **kw)
    assert out == generate(model, prompts, 15, cache="contiguous", **kw)
    assert out != paged(how, model, prompts, 15, block_size=16, stop_tokens=[])


@pytest.mark.parametrize("how", PAGED)
def test_bfloat16_model_on_the_paged_path(how):
    model = tiny_model(dtype=torch.bfloat16)
    prompts = mixed_prompts(16, seed=4)
    pools = []
    out = paged(how, model, prompts, 10, block_size=16, stop_tokens=[],
                callback=lambda e, i, t, c: pools.append(c.managers[0].k_cache_paged.dtype))
    assert set(pools) == {torch.bfloat16}
    assert [len(o) for o in out] == [10] * len(prompts)
    # Same weights, same gathered keys and values, same attention: the same tokens as the
    # contiguous cache, bit for bit (the no-cache forward rounds differently in bf16).
    assert out == generate(model, prompts, 10, cache="contiguous", stop_tokens=[])
