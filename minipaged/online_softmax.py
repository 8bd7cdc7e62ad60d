"""Stage 3b: inside the kernel — paged attention computed the way a kernel computes it.

Stage 3's PyTorch path gathers each row's blocks into one contiguous tensor, then attends. A
paged-attention kernel never makes that copy. One program per (sequence, KV head) walks the
row's block table, reads each block where it lies in the pool, and folds the block's scores
into an online softmax: a running max `m`, a running sum `l` of exp(score - m), and an
accumulator of exp(score - m) * value that is rescaled whenever `m` grows. After the last block,
output = accumulator / l. No score outlives its block, so the loop needs the same small memory
for 10 keys or 100,000.

    paged_attention_v1   that loop over the whole row (vLLM's paged_attention_v1 kernel)
    paged_attention_v2   the row cut into partitions of `partition_size` tokens, each walked on
                         its own (in parallel, on a GPU), then merged by `combine_partitions`
                         with each partition's max and sum (vLLM's v2, flash-decoding)

Both take what every backend of `flash_attn_with_kvcache` takes once the new k/v are written
(`owned_block_table` in paged_attention.py): a table whose entries are real blocks, and the
keys per row, `seqlens_k`. They are written to be read: one program after another, in Python
loops. `triton_attention.py` runs the same loop as a Triton kernel, every program at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Step(NamedTuple):
    """What one program knows after folding in one block (recorded when `trace` is a list)."""
    b: int                  # the sequence (row of the batch)
    kv_head: int
    j: int                  # the logical block: entry j of the row's block table
    block: int              # the physical block it points at
    scores: torch.Tensor    # (R, block_size) the block's scores, -inf where a row sees no key
    m: torch.Tensor         # (R,) the running max after this block
    l: torch.Tensor         # (R,) the running sum after this block


class Partition(NamedTuple):
    """One partition of v2, walked on its own (recorded when `trace` is a list)."""
    b: int
    kv_head: int
    p: int                  # the partition: logical blocks `blocks` of the row
    blocks: range
    m: torch.Tensor         # (R,) its max
    l: torch.Tensor         # (R,) its sum of exp(score - m)


def program_rows(q, b: int, kv_head: int, n_kv_heads: int, n: int, causal: bool):
    """The query rows of program (b, kv_head), and the last key position each row may see.

    With grouped-query attention `group = Hq // Hk` query heads share a KV head, so one program
    per (sequence, KV head) serves all of them and reads each block once. Its R = Sq * group
    rows are (query position i, head of the group), in that order. Query i of a row with n
    keys sees keys 0 .. n - Sq + i under `causal` (the mask aligned bottom-right, as in
    flash-attn), keys 0 .. n - 1 otherwise: `last_key` is -1 for a query that sees none.
    """
    _, Sq, Hq, D = q.shape
    group = Hq // n_kv_heads
    heads = slice(kv_head * group, (kv_head + 1) * group)
    rows = q[b, :, heads].reshape(Sq * group, D)                          # (R, D)
    i = torch.arange(Sq, device=q.device).repeat_interleave(group)       # (R,) query positions
    last_key = n - Sq + i if causal else torch.full_like(i, n - 1)
    return rows, last_key.clamp(max=n - 1)


def walk_blocks(rows, last_key, k_cache, v_cache, table_row, kv_head: int, n: int, blocks,
                scale: float, trace=None, who=(0, 0)):
    """One program's loop: fold logical blocks `blocks` of a row with n keys into (m, l, acc).

    rows (R, D) and last_key (R,) from `program_rows`; the pool k_cache, v_cache
    (num_blocks, block_size, Hk, D); table_row (n_blocks,) the row's block table. Returns the
    running max m (R,), the running sum l (R,) and the accumulator acc (R, D), unnormalised:
    output = acc / l. Computes in float32 (float64 for float64 inputs).
    """
    R, D = rows.shape
    block_size = k_cache.shape[1]
    work = torch.promote_types(rows.dtype, torch.float32)
    rows = rows.to(work)
    m = torch.full((R,), float("-inf"), dtype=work, device=rows.device)   # running max
    l = torch.zeros(R, dtype=work, device=rows.device)                    # running sum
    acc = torch.zeros(R, D, dtype=work, device=rows.device)               # running output
    for j in blocks:
        block = int(table_row[j])                           # logical block j lies here
        pos = j * block_size + torch.arange(block_size, device=rows.device)   # its positions
        keys = k_cache[block, :, kv_head].to(work)          # (block_size, D), read in place
        values = v_cache[block, :, kv_head].to(work)
        # Slots past the row's n keys belong to no one yet: they may hold a freed block's
        # stale data, even NaN. Their scores are masked, but 0 * NaN is NaN, so zero the
        # values too (vLLM's kernel does the same to the last block's values).
        values = torch.where((pos < n)[:, None], values, 0.0)
        scores = rows @ keys.T * scale                                      # (R, block_size)
        scores = scores.masked_fill(pos[None, :] > last_key[:, None], float("-inf"))

        m_new = torch.maximum(m, scores.max(dim=1).values)                  # (R,)
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead, so that
        # exp(-inf - (-inf)) never makes a NaN: its weights are exp(-inf) = 0.
        shift = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(scores - shift[:, None])                              # (R, block_size)
        alpha = torch.exp(m - shift)            # what the sums so far are worth under m_new
        l = alpha * l + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ values                             # (R, D)
        m = m_new
        if trace is not None:
            trace.append(Step(*who, j, block, scores, m, l))
    return m, l, acc


def finish(l, acc):
    """output = acc / l; a row that saw no key has l = 0 and acc = 0, and returns zeros, as
    flash-attn does."""
    return acc / torch.where(l > 0, l, 1.0)[..., None]


def paged_attention_v1(q, k_cache, v_cache, block_table, seqlens_k, causal: bool = True,
                       softmax_scale: float | None = None, trace: list | None = None):
    """Attention over a paged KV cache, one program per (sequence, KV head), block by block.

    q (B, Sq, Hq, D); k_cache, v_cache (num_blocks, block_size, Hk, D); block_table (B, n)
    every entry a real block; seqlens_k (B,) the keys of each row (the newest Sq of them
    belong to the queries). Returns (B, Sq, Hq, D) in q's dtype. With `trace` a list, every
    step of every program appends a `Step`.
    """
    B, Sq, Hq, D = q.shape
    Hk, block_size = k_cache.shape[2], k_cache.shape[1]
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    group = Hq // Hk
    out = torch.zeros_like(q)
    for b in range(B):                                  # the grid: one program per
        n = int(seqlens_k[b])                           # (sequence, KV head), run in turn
        for h in range(Hk):
            rows, last_key = program_rows(q, b, h, Hk, n, causal)
            n_blocks = -(-max(0, int(last_key.max()) + 1) // block_size)   # any row sees
            m, l, acc = walk_blocks(rows, last_key, k_cache, v_cache, block_table[b], h, n,
                                    range(n_blocks), scale, trace, who=(b, h))
            out[b, :, h * group:(h + 1) * group] = finish(l, acc).view(Sq, group, D)
    return out


def combine_partitions(m, l, acc):
    """Merge partitions walked on their own: m, l (P, ...) and acc (P, ..., D) -> (..., D).

    Partition p summed exp(score - m[p]). Under the overall max M those sums are worth
    exp(m[p] - M) times as much, so the total is sum_p exp(m[p] - M) * l[p], and the output
    sum_p exp(m[p] - M) * acc[p] / total. A partition with no visible key has m = -inf and
    weighs exp(-inf) = 0. (vLLM's v2 stores each partition's output already divided by its
    sum, and multiplies it back in its reduce kernel: the same arithmetic.)
    """
    M = m.max(dim=0).values                                     # (...) the overall max
    shift = torch.where(M == float("-inf"), 0.0, M)
    weight = torch.exp(m - shift)                               # (P, ...) each one's worth
    total = (weight * l).sum(dim=0)                             # (...)
    return finish(total, (weight[..., None] * acc).sum(dim=0))


def paged_attention_v2(q, k_cache, v_cache, block_table, seqlens_k, causal: bool = True,
                       softmax_scale: float | None = None, partition_size: int = 512,
                       trace: list | None = None):
    """v1 with each row cut into partitions of `partition_size` tokens (whole blocks: vLLM's
    default is 512), each walked on its own, then merged by `combine_partitions`.

    On a GPU the partitions run as programs of their own, so a long row keeps many programs
    busy even in a small batch — the case v1 leaves the GPU idle. Same arguments and result
    as `paged_attention_v1`; with `trace` a list, every partition appends a `Partition`.
    """
    B, Sq, Hq, D = q.shape
    Hk, block_size = k_cache.shape[2], k_cache.shape[1]
    if partition_size % block_size:
        raise ValueError(f"partition_size ({partition_size}) must be a multiple of the block "
                         f"size ({block_size}): a partition is made of whole blocks")
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    group, per = Hq // Hk, partition_size // block_size          # blocks per partition
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(seqlens_k[b])
        for h in range(Hk):
            rows, last_key = program_rows(q, b, h, Hk, n, causal)
            n_blocks = -(-max(0, int(last_key.max()) + 1) // block_size)
            parts = []
            for p, first in enumerate(range(0, max(n_blocks, 1), per)):   # one program each
                blocks = range(first, min(first + per, n_blocks))
                parts.append(walk_blocks(rows, last_key, k_cache, v_cache, block_table[b], h,
                                         n, blocks, scale))
                if trace is not None:
                    trace.append(Partition(b, h, p, blocks, parts[-1][0], parts[-1][1]))
            m, l, acc = (torch.stack(x) for x in zip(*parts))   # (P, R), (P, R), (P, R, D)
            out[b, :, h * group:(h + 1) * group] = combine_partitions(m, l, acc).view(Sq, group, D)
    return out
