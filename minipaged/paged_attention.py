"""Stage 3: paged attention — attend over a KV cache scattered across fixed-size blocks.

The pool `k_cache`/`v_cache` is (num_blocks, block_size, n_kv_heads, head_dim); row b's table
`block_table[b]` lists its blocks in order: position `pos` lives in block
`block_table[b, pos // block_size]` at offset `pos % block_size`. `flash_attn_with_kvcache` has
flash-attn's signature and meaning; its readable PyTorch version (1) writes the new k/v through a
slot mapping, (2) gathers each row's blocks into one tensor, (3) attends as the contiguous cache.
"""

from __future__ import annotations

import torch

from .backends import BACKENDS, dispatch, register_backend
from .cache_checks import check_lengths, check_table
from .kv_cache import attention_over_cache


@dispatch
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, backend: str = "auto"):
    """Write `k`/`v` (B, Sk, Hk, D) into the cache in place at `cache_seqlens`, then attend `q`
    (B, Sq, Hq, D) over cache_seqlens[b] + Sk keys of row b: (B, Sq, Hq, D). `@dispatch`
    (`backends.py`) checks the call and serves it with flash-attn's kernel where it can; past it,
    the call is paged and `backend` is "torch" (below) or a later stage's kernel asked by name."""
    table, seqlens_k = owned_block_table(q, k_cache, k, cache_seqlens, block_table)
    write_new_kv(k_cache, v_cache, k, v, table, cache_seqlens)
    return BACKENDS[backend].attend(q, k_cache, v_cache, table, seqlens_k, causal, softmax_scale,
                                    num_splits)


def owned_block_table(q, k_cache, k, cache_seqlens, block_table):
    """(table (B, n), seqlens_k (B,)): the table cut to the n blocks the longest row needs,
    entries a row does not own (padding, stale ids) pointed at block 0, which no backend reads
    past seqlens_k[b], the keys row b has once the new tokens are in."""
    device, (num_blocks, block_size) = q.device, k_cache.shape[:2]
    block_table = block_table.to(device)
    n_new = 0 if k is None else k.shape[1]
    seqlens_k = cache_seqlens.long() + n_new                                  # (B,) keys per row
    check_lengths(cache_seqlens, seqlens_k, block_table.shape[1], block_size)
    L = max(seqlens_k.tolist())                           # the longest row: all we gather
    n = -(-L // block_size)                                                   # ceil(L / bs)
    owned = torch.arange(n, device=device) * block_size < seqlens_k[:, None]  # (B, n)
    table = torch.where(owned, block_table[:, :n].long(), 0)                  # (B, n)
    check_table(table, owned, num_blocks, cache_seqlens, block_size, writes=n_new > 0)
    return table, seqlens_k


def write_new_kv(k_cache, v_cache, k, v, table, cache_seqlens) -> None:
    """Write the new k/v (B, Sk, Hk, D) in place: token t of row b at position
    p = cache_seqlens[b] + t, slot table[b, p // block_size] * block_size + p % block_size of the
    pool seen as one array of slots (vLLM's slot_mapping), split back into (block, offset)."""
    if k is None:
        return
    block_size, n_new, device = k_cache.shape[1], k.shape[1], k.device
    positions = cache_seqlens[:, None].long() + torch.arange(n_new, device=device)  # (B, Sk)
    slot_mapping = table.gather(1, positions // block_size) * block_size \
        + positions % block_size                                          # (B, Sk)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k                      # in place, (B, Sk, Hk, D) slots
    v_cache[blocks, offsets] = v


def _gather_and_attend(q, k_cache, v_cache, table, seqlens_k, causal, softmax_scale, num_splits):
    """The "torch" backend: gather each row's blocks, then attend with the contiguous cache's
    attention (`num_splits` is a kernel's knob; it means nothing here)."""
    L = max(seqlens_k.tolist())                           # the longest row: all we gather
    k_ctx, v_ctx = _gather(k_cache, table, L), _gather(v_cache, table, L)    # (B, L, Hk, D)
    return attention_over_cache(q, k_ctx, v_ctx, seqlens_k, causal=causal,
                                softmax_scale=softmax_scale)


def _gather(cache, table, L):
    """The first L slots of each row's blocks, one contiguous (B, L, Hk, D) tensor (index_select
    copies a block as one piece; `cache[table]` goes element by element, twice as slow on a CPU)."""
    blocks = cache.index_select(0, table.reshape(-1))          # (B * n, block_size, Hk, D)
    return blocks.view(table.shape[0], -1, *cache.shape[2:])[:, :L]    # (B, L, Hk, D)


register_backend("torch", _gather_and_attend)
