"""Stage 1's checks: the contiguous cache (task 1.attend)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ...generation import generate_static
from ...kv_cache import ContiguousCache
from ...model import ModelArgs
from ..grader import expect
from .common import close, dense_attention, expect_same_tokens, no_cache_tokens, prompts_of, prop, tiny_model


def contiguous_cache_tokens():
    """The contiguous cache gives the no-cache forward's greedy tokens (prompts of 3, 9, 14)."""
    model, lengths, n = tiny_model(), (3, 9, 14), 6
    cache = ContiguousCache(model.args, 3, model.args.max_seq_len, dtype=torch.float64)
    got = generate_static(model, prompts_of(lengths), n, cache=cache, stop_tokens=[])
    want = no_cache_tokens(lengths, n)
    expect_same_tokens(got, want, lengths, "on the contiguous cache", "the model without a cache")


@prop(20)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(1, 3),
       st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.integers(0, 10**6))
def contiguous_attend_matches_dense(prompt_lens, steps, heads, seed):
    """Prefill rows of different lengths, then decode: every output matches dense float64
    attention over exactly the tokens each row stored (1, 2 or 4 query heads)."""
    g = torch.Generator().manual_seed(seed)
    (Hq, Hk), D, B = heads, 8, len(prompt_lens)
    args = ModelArgs(dim=Hq * D, n_layers=1, n_heads=Hq, n_kv_heads=Hk, vocab_size=8,
                     max_seq_len=16)
    cache = ContiguousCache(args, B + 1, 16, dtype=torch.float64)
    rows = list(range(1, B + 1))                     # row 0 stays empty: rows are not batch slots
    hist_k = [torch.zeros(0, Hk, D, dtype=torch.float64) for _ in rows]
    hist_v = [torch.zeros(0, Hk, D, dtype=torch.float64) for _ in rows]
    for b, n in enumerate(prompt_lens):              # each prompt on its own, as generation does
        q, k, v = (torch.randn(1, n, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hk, Hk))
        cache.prepare([rows[b]], n)
        out = cache.attend(0, q, k, v)
        hist_k[b], hist_v[b] = k[0], v[0]
        want = dense_attention(q[0], hist_k[b], hist_v[b])
        expect(close(out[0], want), f"a prompt of {n} tokens in row {rows[b]}: the attention "
                                    f"output differs from dense attention over its {n} keys")
    for t in range(steps):                            # decode every row together
        q, k, v = (torch.randn(B, 1, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hk, Hk))
        cache.prepare(rows, 1)
        out = cache.attend(0, q, k, v)
        for b in range(B):
            hist_k[b] = torch.cat([hist_k[b], k[b]])
            hist_v[b] = torch.cat([hist_v[b], v[b]])
            want = dense_attention(q[b], hist_k[b], hist_v[b])
            expect(close(out[b], want), f"decode step {t + 1}, row {rows[b]} with "
                                        f"{len(hist_k[b])} keys: the output differs from dense "
                                        f"attention over the keys it stored")
        for b in range(B):
            stored = cache.k_cache[0][rows[b], :len(hist_k[b])]
            expect(close(stored, hist_k[b], 0), f"row {rows[b]}'s first {len(hist_k[b])} slots "
                                                f"do not hold the keys written to it, in order")
