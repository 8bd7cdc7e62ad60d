"""Stages 3 and 3b's checks: paged attention, and the kernel's online-softmax walk."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ...cache_manager import PAD_BLOCK
from ...generation import generate_static
from ...online_softmax import paged_attention_v1, paged_attention_v2
from ...paged_attention import flash_attn_with_kvcache
from ...paged_cache import PagedCache
from ..grader import expect
from .common import close, contiguous_tokens, dense_attention, expect_same_tokens, prompts_of, prop, tiny_model


@st.composite
def paged_calls(draw):
    """A random paged cache: rows with stored tokens in scattered blocks, new tokens to add."""
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    B = draw(st.integers(1, 3))
    Hk = draw(st.sampled_from([1, 2]))
    Hq = Hk * draw(st.sampled_from([1, 2]))
    stored = draw(st.lists(st.integers(0, 9), min_size=B, max_size=B))
    new = draw(st.integers(1, 4))
    equal = draw(st.booleans())
    if equal:
        stored = [stored[0]] * B
    seed = draw(st.integers(0, 10**6))
    return block_size, B, Hq, Hk, stored, new, seed


def _paged_case(block_size, B, Hq, Hk, stored, new, seed, D=4):
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + new) // block_size) for n in stored]
    width = max(need) + 1
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((B, width), PAD_BLOCK, dtype=torch.int32)
    it = iter(perm)
    for b in range(B):
        for j in range(need[b]):
            table[b, j] = next(it)
    k_cache = torch.full((num_blocks, block_size, Hk, D), float("nan"), dtype=torch.float64)
    v_cache = torch.full_like(k_cache, float("nan"))
    hist_k = [torch.randn(n, Hk, D, generator=g, dtype=torch.float64) for n in stored]
    hist_v = [torch.randn(n, Hk, D, generator=g, dtype=torch.float64) for n in stored]
    for b in range(B):                           # what the rows stored before: written by hand
        for p in range(stored[b]):
            blk, off = int(table[b, p // block_size]), p % block_size
            k_cache[blk, off], v_cache[blk, off] = hist_k[b][p], hist_v[b][p]
    q = torch.randn(B, new, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, new, Hk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, new, Hk, D, generator=g, dtype=torch.float64)
    return q, k, v, k_cache, v_cache, table, hist_k, hist_v


@prop(40)
@given(paged_calls())
def paged_attention_matches_dense(case):
    """`flash_attn_with_kvcache(..., backend="torch")` on a pool of scattered blocks (free slots
    full of NaN) writes each new k/v into the slot its block table names and returns dense
    float64 attention over each row's stored and new keys."""
    block_size, B, Hq, Hk, stored, new, seed = case
    q, k, v, k_cache, v_cache, table, hist_k, hist_v = _paged_case(*case)
    lens = torch.tensor(stored, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                  block_table=table, causal=True, backend="torch")
    what = (f"block_size={block_size}, rows storing {stored} tokens, {new} new each, "
            f"block_table={table.tolist()}")
    for b in range(B):
        for t in range(new):
            p = stored[b] + t
            blk, off = int(table[b, p // block_size]), p % block_size
            expect(torch.equal(k_cache[blk, off], k[b, t]) and torch.equal(v_cache[blk, off], v[b, t]),
                   f"{what}: new token {t} of row {b} (position {p}) should be written to block "
                   f"{blk}, offset {off}, and is not")
        keys, values = torch.cat([hist_k[b], k[b]]), torch.cat([hist_v[b], v[b]])
        want = dense_attention(q[b], keys, values)
        expect(close(out[b], want), f"{what}: row {b}'s output differs from dense attention "
                                    f"over its {stored[b] + new} keys")
    again = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + new,
                                    block_table=table, causal=True, backend="torch")
    expect(close(again, out), f"{what}: called again with no new k/v (k=None, v=None) over the "
                              f"{[n + new for n in stored]} stored keys, the output changed: "
                              f"with nothing to write, nothing is written")


class _CallPerLayer(PagedCache):
    """Stage 3's paged cache calling `flash_attn_with_kvcache` on each layer, with the tables
    and lengths its CacheManagers give (the grader's own harness: the call the lesson
    describes, with its write and its gather, whatever the cache does for speed)."""

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        super().prepare(seq_ids, num_new_tokens)
        self._step_ids, self._step_new = [int(s) for s in seq_ids], num_new_tokens

    def attend(self, layer, q, k, v):
        m = self.managers[layer]
        return flash_attn_with_kvcache(q, m.k_cache_paged, m.v_cache_paged, k, v,
                                       cache_seqlens=m.seq_lens_for(self._step_ids) - self._step_new,
                                       block_table=m.block_table_for(self._step_ids),
                                       causal=True, backend="torch")


def paged_call_tokens():
    """A paged cache that calls `flash_attn_with_kvcache` per layer gives the contiguous cache's
    greedy tokens (prompts of 3, 9, 14 with blocks of 4; and two prompts of 5 with blocks of 2)."""
    model = tiny_model()
    for lengths, bs in (((3, 9, 14), 4), ((5, 5), 2)):
        n = 6
        cache = _CallPerLayer(model.args, 64, bs, len(lengths), model.args.max_seq_len,
                              dtype=torch.float64, seed=3)
        got = generate_static(model, prompts_of(lengths), n, cache=cache, stop_tokens=[])
        want = contiguous_tokens(lengths, n)
        expect_same_tokens(got, want, lengths, f"on the paged cache (blocks of {bs})",
                           "the contiguous cache")


# -- stage 3b --------------------------------------------------------------------------------------

@prop(40)
@given(paged_calls(), st.booleans(), st.integers(1, 3), st.sampled_from([1.0, 1.0, 400.0]))
def kernel_walk_matches_dense(case, causal, blocks_per_partition, loudness):
    """paged_attention_v1 and v2 (partitions of 1-3 blocks) read each row's blocks in place
    (free slots hold NaN) and return dense float64 attention, causal or not (a row with no key
    at all: zeros); v1's trace holds,
    after each block, the running max of the scores so far and the running sum of
    exp(score - max)."""
    block_size, B, Hq, Hk, stored, new, seed = case
    q, k, v, k_cache, v_cache, table, hist_k, hist_v = _paged_case(*case)
    q = q * loudness                              # 400: scores in the thousands, exp overflows
    seqlens = torch.tensor(stored) + new
    for b in range(B):                            # the new keys, stored (the write is stage 3's)
        for t in range(new):
            p = stored[b] + t
            blk = int(table[b, p // block_size])
            k_cache[blk, p % block_size], v_cache[blk, p % block_size] = k[b, t], v[b, t]
    owned = torch.where(table >= 0, table, 0).long()
    what = (f"block_size={block_size}, keys per row {seqlens.tolist()}, {new} queries each, "
            f"causal={causal}, queries scaled by {loudness}, block_table={table.tolist()}")
    trace = []
    out1 = paged_attention_v1(q, k_cache, v_cache, owned, seqlens, causal=causal, trace=trace)
    out2 = paged_attention_v2(q, k_cache, v_cache, owned, seqlens, causal=causal,
                              partition_size=blocks_per_partition * block_size)
    for b in range(B):
        keys, values = torch.cat([hist_k[b], k[b]]), torch.cat([hist_v[b], v[b]])
        want = dense_attention(q[b], keys, values, causal)
        expect(close(out1[b], want), f"v1, {what}: row {b}'s output differs from dense attention")
        expect(close(out2[b], want), f"v2 with partitions of {blocks_per_partition} block(s), "
                                     f"{what}: row {b}'s output differs from dense attention")
    empty = seqlens.clone()
    empty[0] = 0                                  # row 0 with no key at all: zeros, as flash-attn
    for name, out in (("v1", paged_attention_v1(q, k_cache, v_cache, owned, empty, causal=causal)),
                      ("v2", paged_attention_v2(q, k_cache, v_cache, owned, empty, causal=causal,
                                                partition_size=blocks_per_partition * block_size))):
        expect(bool((out[0] == 0).all()),
               f"{name}, {what}, but row 0 given no key at all (seqlens_k 0): its output must be "
               f"zeros (a query that sees no key), not {out[0].flatten()[:3].tolist()}...")
    seen: dict = {}
    for s in trace:
        key = (s.b, s.kv_head)
        prev = seen.get(key, torch.full_like(s.m, float("-inf")))
        scores = torch.cat([seen.get(key + ("scores",), s.scores[:, :0]), s.scores], dim=1)
        seen[key + ("scores",)] = scores
        m = scores.max(dim=1).values
        shift = torch.where(m == float("-inf"), 0.0, m)
        l = torch.exp(scores - shift[:, None]).sum(dim=1)
        expect(torch.equal(s.m, torch.maximum(prev, m)) and close(s.l, l),
               f"v1, {what}: after block {s.j} of row {s.b}, head {s.kv_head}, the running max "
               f"or sum is not the max / sum of exp(score - max) over the keys seen so far")
        seen[key] = s.m
    for b in range(B):
        for h in range(Hk):
            js = [s.j for s in trace if (s.b, s.kv_head) == (b, h)]
            want_js = list(range(-(-int(seqlens[b]) // block_size)))
            expect(js == want_js, f"v1, {what}: with trace=[] the program of row {b}, head {h} "
                                  f"recorded blocks {js}; it walks blocks {want_js}, one Step each")
    if loudness == 1.0:                           # bf16 in, float32 inside, bf16 out
        half = paged_attention_v1(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), owned,
                                  seqlens, causal=causal)
        for b in range(B):
            keys, values = torch.cat([hist_k[b], k[b]]), torch.cat([hist_v[b], v[b]])
            want = dense_attention(q[b].bfloat16(), keys.bfloat16(), values.bfloat16(), causal)
            expect(half.dtype == torch.bfloat16 and close(half[b], want, 3e-2),
                   f"v1 in bfloat16, {what}: row {b}'s output is not dense attention (to "
                   f"bfloat16's precision), or not bfloat16")
