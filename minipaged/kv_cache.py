"""Stage 1: the naive, contiguous KV cache — reserved up front, the way Meta's reference does it:
every sequence gets `max_seq_len` slots in every layer before it has produced a single token.

The cache interface, the one every cache in this repository offers (stated here, once):

    cache.prepare(seq_ids, num_new_tokens)   # before a forward: room for each sequence's new tokens
    cache.positions                           # (B, T): where each new token sits in its sequence
    cache.attend(layer, q, k, v)              # store the new k/v, attend q over everything stored
    cache.free(seq_id)                        # a finished sequence gives its memory back

and `cache.cache_seqlens` (B,) int32: tokens each row stored before the step (flash-attn's
name), so row b's new tokens sit at positions cache_seqlens[b], cache_seqlens[b] + 1, ...
The model calls `positions` and `attend`; generation calls `prepare` and `free`. So stage 3's
paged cache can replace this one without the model noticing. (The checks of sizes, ids and
memory live in `checks.py` and `cache_checks.py`, not needed on a first read.)
"""

from __future__ import annotations

import torch

from .backends import sdpa   # F.scaled_dot_product_attention (on a CPU, in float32)
from .cache_queries import ContiguousQueries   # what drawings ask: not the idea
from .cache_checks import check_contiguous, check_row_step


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, dtype=torch.bfloat16,
                       n_layers: int = 1) -> int:
    """Bytes of K and V one token takes in `n_layers` layers. Llama 3 8B in bf16:
    2 * 32 * 8 * 128 * 2 = 131,072 (128 KiB), so 8,192 tokens take 1 GiB per sequence."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize


def attention_over_cache(q, k_ctx, v_ctx, seqlens_k, causal=True, softmax_scale=None):
    """Attend `q` to the first `seqlens_k[b]` keys of row b (the one attention both caches share).

    q (B, Sq, Hq, D); k_ctx, v_ctx (B, L, Hk, D), Hq a multiple of Hk (grouped-query attention);
    the newest Sq keys of a row are the queries' own. `causal` aligns the mask bottom-right, as
    flash-attn does: query i of row b sees key j if j <= i + seqlens_k[b] - Sq."""
    B, Sq, Hq, D = q.shape
    L = k_ctx.shape[1]
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    q, k_ctx, v_ctx = q.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2)  # (B, H, ., D)
    if L > 0 and all(n == L for n in seqlens_k.tolist()) and Sq in (1, L):
        # every row attends to all L keys (one decode step, or whole prompts): nothing to mask
        return sdpa(q, k_ctx, v_ctx, scale, is_causal=causal and Sq > 1).transpose(1, 2)
    # Anything else (prompt chunks after cached tokens, rows of different lengths) needs a mask.
    # Slots past a row's keys are zeroed first: they may hold stale data, even NaN, and a softmax
    # weight of 0 times NaN is still NaN.
    seqlens_k = seqlens_k.to(device=q.device, dtype=torch.long)
    key_pos = torch.arange(L, device=q.device)                      # (L,)
    valid = key_pos[None, :] < seqlens_k[:, None]                   # (B, L)
    k_ctx = torch.where(valid[:, None, :, None], k_ctx, 0)         # (torch.where: ~3x faster
    v_ctx = torch.where(valid[:, None, :, None], v_ctx, 0)         #  than masked_fill on a CPU)
    mask = valid[:, None, :]                                        # (B, 1, L)
    if causal:
        last_visible = seqlens_k[:, None] - Sq + torch.arange(Sq, device=q.device)  # (B, Sq)
        mask = mask & (key_pos[None, None, :] <= last_visible[:, :, None])         # (B, Sq, L)
    y = sdpa(q, k_ctx, v_ctx, scale, attn_mask=mask[:, None])       # mask (B, 1, Sq or 1, L)
    sees_nothing = ~mask.any(-1)                                    # (B, Sq or 1): no key at all
    return y.masked_fill(sees_nothing[:, None, :, None], 0).transpose(1, 2)  # (B, Sq, Hq, D)


class ContiguousCache(ContiguousQueries):
    """Per layer a `(max_batch, max_seq_len, n_kv_heads, head_dim)` pair, reserved up front:
    sequence `i` owns row `i` of every layer for its whole life, used or not."""

    def __init__(self, args, max_batch: int, max_seq_len: int | None = None,
                 device="cpu", dtype=torch.float32):
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len or args.max_seq_len
        check_contiguous(args, max_batch, self.max_seq_len, device, dtype, kv_bytes_per_token)
        shape = (max_batch, self.max_seq_len, args.n_kv_heads, args.head_dim)
        self.k_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32)   # tokens stored, per row
        self.rows = None                  # the rows of the current step, (B,)
        self.cache_seqlens = None         # their lengths before the step, (B,) int32
        self.positions = None             # the positions of the step's new tokens, (B, T)

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """Get ready for a forward over `seq_ids`, each adding `num_new_tokens` tokens."""
        rows, n = check_row_step(self, seq_ids, num_new_tokens)   # rows in range, room for n more
        self.rows = torch.as_tensor(rows, dtype=torch.long)                         # (B,)
        self.cache_seqlens = self.seq_lens[self.rows].clone()
        self.seq_lens[self.rows] += n
        device = self.k_cache[0].device
        self.positions = self.cache_seqlens.to(device)[:, None].long() + torch.arange(
            n, device=device)                                                   # (B, T)

    def free(self, seq_id: int) -> None:
        """Forget a finished sequence. Its row stays reserved: that is this cache's flaw."""
        self.seq_lens[seq_id] = 0

    def attend(self, layer: int, q, k, v):
        """Write the step's k/v (B, T, Hk, D) at each row's next positions, then attend."""
        rows = self.rows.to(q.device)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache[rows[:, None], self.positions] = k
        v_cache[rows[:, None], self.positions] = v
        seqlens_k = self.cache_seqlens.to(q.device) + q.shape[1]                 # (B,)
        L = int(seqlens_k.max())
        return attention_over_cache(q, k_cache[rows, :L], v_cache[rows, :L], seqlens_k)
