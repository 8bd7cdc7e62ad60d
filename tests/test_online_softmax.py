"""Stage 3b's reference algorithm: paged_attention_v1 (one program per (sequence, KV head)
walking its block table with a running max and sum) and paged_attention_v2 (partitions merged
by their maxima and sums) give stage 3's gather path's answer, to fp32 rounding.

Ground truth is the gather path (`flash_attn_with_kvcache(..., backend="torch")`, itself
checked against a dense loop in test_paged_attention.py) and, for what the notebook draws
(the running max and sum block by block, the partitions), scores computed here directly from
the cache with one matrix product.
"""

import math

import pytest
import torch
from test_paged_attention import dense_reference, paged_locate, random_paged_case

from minipaged.online_softmax import (Partition, Step, combine_partitions, paged_attention_v1,
                                      paged_attention_v2)
from minipaged.paged_attention import flash_attn_with_kvcache, owned_block_table


def written(case):
    """The gather path's output for `case`, and what every backend attends over once the new
    k/v are written: (expected, (q, k_cache, v_cache, table, seqlens_k), causal, scale)."""
    call = {k: (t.clone() if torch.is_tensor(t) else t) for k, t in case.items()}
    expected = flash_attn_with_kvcache(**call, backend="torch")       # writes call's cache
    lengths = call["cache_seqlens"]
    if isinstance(lengths, int):
        lengths = torch.full((call["q"].shape[0],), lengths, dtype=torch.int32)
    table, seqlens_k = owned_block_table(call["q"], call["k_cache"], call["k"], lengths,
                                         call["block_table"])
    args = (call["q"], call["k_cache"], call["v_cache"], table, seqlens_k)
    return expected, args, call["causal"], call["softmax_scale"]


@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
@pytest.mark.parametrize("seed", range(25))
def test_v1_and_v2_match_the_gather_path(block_size, seed):
    case, _ = random_paged_case(7000 * block_size + seed, block_size)
    expected, args, causal, scale = written(case)
    torch.testing.assert_close(paged_attention_v1(*args, causal, scale), expected,
                               atol=1e-5, rtol=1e-5)
    for blocks_per_partition in (1, 2, 5):
        out = paged_attention_v2(*args, causal, scale,
                                 partition_size=blocks_per_partition * block_size)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bf16_within_bf16_rounding_of_a_dense_reference():
    case, lengths = random_paged_case(11, 16)
    for name in ("q", "k_cache", "v_cache", "k", "v"):
        if case[name] is not None:
            case[name] = case[name].bfloat16()
    dense, _, _ = dense_reference(case["q"], case["k_cache"], case["v_cache"], case["k"],
                                  case["v"], lengths, paged_locate(case["block_table"], 16),
                                  case["causal"], case["softmax_scale"])
    _, args, causal, scale = written(case)
    for out in (paged_attention_v1(*args, causal, scale),
                paged_attention_v2(*args, causal, scale, partition_size=16)):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), dense, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block_size", [3, 16])
def test_stale_data_outside_a_rows_keys_never_leaks(block_size):
    """Slots past a row's keys (the tail of its last block, free blocks) may hold anything,
    NaN included: the answer does not change."""
    case, _ = random_paged_case(42, block_size)
    expected, (q, k_cache, v_cache, table, seqlens_k), causal, scale = written(case)
    owned = {(int(table[b, p // block_size]), p % block_size)
             for b, n in enumerate(seqlens_k.tolist()) for p in range(n)}
    for junk in (float("nan"), float("inf"), -1e30):
        k_junk, v_junk = k_cache.clone(), v_cache.clone()
        for blk in range(k_cache.shape[0]):
            for off in range(block_size):
                if (blk, off) not in owned:
                    k_junk[blk, off] = v_junk[blk, off] = junk
        for attend in (paged_attention_v1, paged_attention_v2):
            kwargs = {"partition_size": 2 * block_size} if attend is paged_attention_v2 else {}
            out = attend(q, k_junk, v_junk, table, seqlens_k, causal, scale, **kwargs)
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def direct_scores(q, k_cache, table, b, kv_head, n, scale):
    """Row b's scores for KV head kv_head's query rows, from the whole row at once: (R, n)."""
    Hq, Hk, bs = q.shape[2], k_cache.shape[2], k_cache.shape[1]
    group = Hq // Hk
    keys = torch.cat([k_cache[int(table[b, j]), :, kv_head]
                      for j in range(-(-n // bs))])[:n]                       # (n, D)
    rows = q[b, :, kv_head * group:(kv_head + 1) * group].reshape(-1, q.shape[-1])
    return rows @ keys.T * scale


def test_trace_is_the_running_max_and_sum_block_by_block():
    """What notebook 03b draws: after block j, m is the max of the scores of blocks 0..j and
    l the sum of exp(score - m) over them — checked against all scores computed at once."""
    gen = torch.Generator().manual_seed(0)
    bs, lengths, Hq, Hk, D = 4, [13, 4, 0], 4, 2, 8
    q = torch.randn(3, 1, Hq, D, generator=gen)
    k_cache, v_cache = torch.randn(2, 12, bs, Hk, D, generator=gen)
    table = torch.randperm(12, generator=gen).view(3, 4)
    seqlens_k = torch.tensor(lengths)
    trace = []
    paged_attention_v1(q, k_cache, v_cache, table, seqlens_k, trace=trace)
    assert all(isinstance(s, Step) for s in trace)
    for b, n in enumerate(lengths):
        for h in range(Hk):
            steps = [s for s in trace if (s.b, s.kv_head) == (b, h)]
            assert [s.j for s in steps] == list(range(math.ceil(n / bs)))   # table order
            assert [s.block for s in steps] == table[b, :len(steps)].tolist()
            if not steps:
                continue                                    # an empty row reads no block
            scores = direct_scores(q, k_cache, table, b, h, n, D ** -0.5)
            for s in steps:
                seen = scores[:, :min(n, (s.j + 1) * bs)]
                m = seen.max(dim=1).values
                torch.testing.assert_close(s.m, m)
                torch.testing.assert_close(s.l, torch.exp(seen - m[:, None]).sum(dim=1))
            assert all((later.m >= earlier.m).all() for earlier, later in zip(steps, steps[1:]))


def test_v2_partitions_cover_the_row_in_order_and_merge_by_their_max_and_sum():
    gen = torch.Generator().manual_seed(1)
    bs, n, D = 4, 37, 8
    q = torch.randn(1, 1, 2, D, generator=gen)
    k_cache, v_cache = torch.randn(2, 16, bs, 1, D, generator=gen)
    table = torch.randperm(16, generator=gen)[None, :10]
    trace = []
    out = paged_attention_v2(q, k_cache, v_cache, table, torch.tensor([n]), partition_size=12,
                             trace=trace)
    assert all(isinstance(p, Partition) for p in trace)
    assert [list(p.blocks) for p in trace] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    scores = direct_scores(q, k_cache, table, 0, 0, n, D ** -0.5)
    for p in trace:
        part = scores[:, p.blocks[0] * bs:min(n, (p.blocks[-1] + 1) * bs)]
        torch.testing.assert_close(p.m, part.max(dim=1).values)
        torch.testing.assert_close(p.l, torch.exp(part - p.m[:, None]).sum(dim=1))
    weights = torch.softmax(scores, dim=1)
    values = torch.cat([v_cache[int(table[0, j]), :, 0] for j in range(10)])[:n]
    torch.testing.assert_close(out[0, 0], weights @ values)
    with pytest.raises(ValueError, match="multiple of the block size"):
        paged_attention_v2(q, k_cache, v_cache, table, torch.tensor([n]), partition_size=10)


def test_combine_partitions_of_any_split_is_the_softmax_of_the_whole():
    gen = torch.Generator().manual_seed(2)
    scores, values = torch.randn(3, 20, generator=gen) * 4, torch.randn(20, 5, generator=gen)
    expected = torch.softmax(scores, dim=1) @ values
    for cuts in ([0, 20], [0, 7, 20], [0, 1, 2, 19, 20], [0, 5, 5, 20]):   # [5, 5]: empty
        parts = [(scores[:, a:b], values[a:b]) for a, b in zip(cuts, cuts[1:])]
        m = torch.stack([s.max(dim=1).values if s.shape[1] else torch.full((3,), -math.inf)
                         for s, _ in parts])
        shift = torch.where(m == -math.inf, 0.0, m)
        l = torch.stack([torch.exp(s - c[:, None]).sum(dim=1) for (s, _), c in zip(parts, shift)])
        acc = torch.stack([torch.exp(s - c[:, None]) @ v for (s, v), c in zip(parts, shift)])
        torch.testing.assert_close(combine_partitions(m, l, acc), expected)
