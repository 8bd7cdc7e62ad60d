"""Stage 1: the naive, contiguous KV cache — reserved up front, the way Meta's reference does it.

Every sequence slot gets `max_seq_len` positions in every layer before it has produced a single
token. Most of those slots are never used: that waste is what paging (stages 2-3) wins back.

The cache interface, the one every cache in this repository offers (stated here, once):

    cache.prepare(seq_ids, num_new_tokens)   # before a forward: room for each sequence's new tokens
    cache.positions                           # (B, T): where each new token sits in its sequence
    cache.attend(layer, q, k, v)              # store the new k/v, attend q over everything stored
    cache.free(seq_id)                        # a finished sequence gives its memory back

and `cache.cache_seqlens` (B,) int32: tokens each row stored before the step (flash-attn's
name), so row b's new tokens sit at positions cache_seqlens[b], cache_seqlens[b] + 1, ...
The model calls `positions` and `attend`; generation calls `prepare` and `free`. So stage 3's
paged cache can replace this one without the model noticing.

The sizes, ids and memory a cache is given are checked first (`checks.py`, not needed on a
first read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_contiguous, check_count, check_row_room, check_rows


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, dtype=torch.bfloat16,
                       n_layers: int = 1) -> int:
    """Bytes of K and V one token occupies in `n_layers` layers: 2 (K and V) * n_layers *
    n_kv_heads * head_dim * bytes per element. Llama 3 8B in bf16: 2 * 32 * 8 * 128 * 2 =
    131,072 (128 KiB), so a cache of 8,192 tokens takes 1 GiB per sequence."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize


def attention_over_cache(q, k_ctx, v_ctx, seqlens_k, causal=True, softmax_scale=None):
    """Attend `q` to the first `seqlens_k[b]` keys of row b (the one attention both caches share).

    q (B, Sq, Hq, D); k_ctx, v_ctx (B, L, Hk, D) with Hq a multiple of Hk (grouped-query
    attention); seqlens_k (B,) — valid keys per row, the newest Sq of them belonging to the
    queries themselves. With `causal`, query i of row b sees key j only if
    j <= i + seqlens_k[b] - Sq: the mask is aligned bottom-right, as in flash-attn.

    Exact for any content past `seqlens_k[b]` (a reused block's stale data, even NaN): those
    slots are zeroed before the product, since a softmax weight of 0 times NaN is still NaN.
    A query that sees no key at all gets a zero output, as in flash-attn.
    """
    B, Sq, Hq, D = q.shape
    L = k_ctx.shape[1]
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    lens = seqlens_k.tolist()
    q, k_ctx, v_ctx = q.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2)  # (B, H, ., D)
    full = L > 0 and all(n == L for n in lens)             # every row attends to all L keys
    if full and Sq in (1, L):
        # A decode step of one sequence (or of rows of one length), or whole prompts, causal:
        # nothing to mask, one call.
        y = sdpa(q, k_ctx, v_ctx, scale, is_causal=causal and Sq > 1)
    else:
        y = masked_attention(q, k_ctx, v_ctx, seqlens_k, causal, scale)
    return y.transpose(1, 2)                                                  # (B, Sq, Hq, D)


def attend_rows(q, keys, values, scale):
    """Row b's one query, q[b] (Hq, 1, D), over its own keys[b] and values[b] (Hk, n_b, D):
    a decode step whose rows differ in length, (B, Hq, 1, D) out. Each row sees exactly its
    keys, so nothing is masked and nothing past a row is read; on a CPU this loop beats one
    masked call over the rows padded to the longest (flash-attn's kernel also works row by
    row). A row with no key gets zeros."""
    return torch.cat([sdpa(q[b:b + 1], k[None], v[None], scale) if k.shape[1] else
                      torch.zeros_like(q[b:b + 1]) for b, (k, v) in enumerate(zip(keys, values))])


def sdpa(q, k, v, scale, **options):
    """`F.scaled_dot_product_attention` on (B, H, T, D) tensors, grouped-query heads included,
    in q's dtype. On a CPU, bf16 and fp16 are computed in float32: torch's half-precision
    attention there is slower than its float32 one (measured where this was written: 2x for
    one query, 5x for a batch of 16, no faster for a whole prompt), and float32 is as exact."""
    dtype = q.dtype
    q, k, v = upcast(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                          **options).to(dtype)


def upcast(*tensors):
    """The tensors in the dtype `sdpa` computes in: float32 for bf16 and fp16 on a CPU, else as
    they are. A batch attended row by row is converted once, whole, rather than row by row."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype in (torch.bfloat16, torch.float16):
        return tuple(t.float() for t in tensors)
    return tensors


def masked_attention(q, k_ctx, v_ctx, seqlens_k, causal, scale):
    """The general case of `attention_over_cache` (prompt chunks after cached tokens, rows of
    different lengths), on q (B, Hq, Sq, D) and k_ctx, v_ctx (B, Hk, L, D): one masked call."""
    B, _, Sq, _ = q.shape
    L = k_ctx.shape[2]
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
    sees_nothing = ~mask.any(-1)                                    # (B, Sq or 1)
    return y.masked_fill(sees_nothing[:, None, :, None], 0)         # (B, Hq, Sq, D)


class ContiguousCache:
    """Per layer a `(max_batch, max_seq_len, n_kv_heads, head_dim)` pair, reserved up front.

    Sequence `i` owns row `i` of every layer for its whole life, used or not.
    """

    def __init__(self, args, max_batch: int, max_seq_len: int | None = None,
                 device="cpu", dtype=torch.float32):
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len or args.max_seq_len
        self.n_layers = args.n_layers
        check_contiguous(args, max_batch, self.max_seq_len, device, dtype, kv_bytes_per_token)
        shape = (max_batch, self.max_seq_len, args.n_kv_heads, args.head_dim)
        self.k_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32)   # tokens stored, per row
        self.rows = None                  # the rows of the current step, (B,)
        self.cache_seqlens = None         # their lengths before the step, (B,) int32
        self.positions = None             # the positions of the step's new tokens, (B, T)

    # -- bookkeeping -------------------------------------------------------------------
    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """Get ready for a forward over `seq_ids`, each adding `num_new_tokens` tokens."""
        rows = torch.as_tensor(check_rows(seq_ids, self.max_batch), dtype=torch.long)  # (B,)
        after = self.seq_lens[rows] + check_count(num_new_tokens)                    # (B,)
        check_row_room(int(after.max()), self.max_seq_len)
        self.rows = rows
        self.cache_seqlens = self.seq_lens[rows].clone()
        self.seq_lens[rows] = after
        # What every layer's `attend` needs, computed once per step rather than once per layer.
        device = self.k_cache[0].device
        self._rows_dev = rows.to(device)
        self._seqlens_dev = self.cache_seqlens.to(device)
        self.positions = self._seqlens_dev[:, None].long() + torch.arange(
            num_new_tokens, device=device)                                    # (B, T)
        self._seqlens_k = self._seqlens_dev + num_new_tokens                   # (B,)
        self._max_len = int(after.max())
        self._row_lens = list(zip(rows.tolist(), after.tolist()))   # (row, keys it holds)

    def free(self, seq_id: int) -> None:
        """Forget a finished sequence. Its row stays reserved: that is this cache's flaw."""
        self.seq_lens[seq_id] = 0

    # -- attention -----------------------------------------------------------------------
    def attend(self, layer: int, q, k, v):
        """Write the step's k/v (B, T, Hk, D) at each row's next positions, then attend."""
        rows, positions, L = self._rows_dev, self.positions, self._max_len
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache[rows[:, None], positions] = k
        v_cache[rows[:, None], positions] = v
        if q.shape[1] == 1:
            # Decode: row r's keys are its first n slots, already one piece of memory, so its
            # one query attends over views of them, row by row: nothing is copied.
            keys = [k_cache[r, :n].transpose(0, 1) for r, n in self._row_lens]    # (Hk, n, D)
            values = [v_cache[r, :n].transpose(0, 1) for r, n in self._row_lens]
            return attend_rows(q.transpose(1, 2), keys, values,
                               q.shape[-1] ** -0.5).transpose(1, 2)             # (B, 1, Hq, D)
        # Prompts: one call over the rows side by side, which needs them copied out together.
        # index_select copies each row's first L slots as one piece; `k_cache[rows, :L]`
        # indexes element by element and takes about three times as long on a CPU.
        k_ctx = k_cache[:, :L].index_select(0, rows)                          # (B, L, Hk, D)
        v_ctx = v_cache[:, :L].index_select(0, rows)
        return attention_over_cache(q, k_ctx, v_ctx, self._seqlens_k, causal=True)

    # -- what the lesson draws ------------------------------------------------------------------
    def usage(self):
        """(used, reserved) slots per row: used = tokens stored, reserved = max_seq_len each."""
        return self.seq_lens.tolist(), [self.max_seq_len] * self.max_batch

    def bytes_per_slot(self) -> int:
        """Bytes of K and V for one token position, summed over all layers."""
        _, _, n_kv_heads, head_dim = self.k_cache[0].shape
        return kv_bytes_per_token(n_kv_heads, head_dim, self.k_cache[0].dtype, self.n_layers)

    def reserved_bytes(self) -> int:
        """What this cache took from memory the moment it was built, used or not."""
        return self.max_batch * self.max_seq_len * self.bytes_per_slot()
